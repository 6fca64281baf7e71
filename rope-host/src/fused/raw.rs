//! Fused launches by address: [`Rope::run_fused_raw`], for memory and streams that other
//! frameworks own (the Python bindings, candle). The forms mirror the safe API's
//! ([`super::FusedOp`], [`super::FusedIo`], [`super::KvCache`]) with [`RawBuf`]s for views; they
//! reduce to the same [`FusedRequest`] the safe API binds, so both are validated, planned and
//! launched by the same code.

use cudarc::driver::sys::CUstream;

use super::request::{
    CacheFp8, CacheNvfp4, CacheStore, CachedNope, FusedRequest, NopePart, NopeParts, RawCache,
    RawFp8, RawNorm, RawScale, ScaleSource,
};
use super::{CacheLayout, Fp8Format, NonRotaryCache, NormScope, NormWeight};
use crate::bind::RawBuf;
use crate::error::Result;
use crate::handle::{FreqUse, Rope};
use crate::layout::Layout;
use crate::plan::{Request, TensorReq};
use crate::positions::RawInts;
use crate::rope::{RawIo, RawOp, RawTensor};

/// An FP8 scale by address (`f32`; the stored value is `fp8(x / scale)`) or a multiplier by
/// value (`fp8(x * multiplier)`), as [`super::Fp8Scale`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RawFp8Scale {
    /// One scale for the tensor (`len >= 1`).
    PerTensor(RawBuf),
    /// One scale per head of the tensor.
    PerHead(RawBuf),
    /// One multiplier for the tensor, finite.
    Multiplier(f32),
}

/// [`super::QkNorm`] by address: `x_e / sqrt(mean_e(x_e^2) + eps) * w_e` (or `* (1 + w_e)`),
/// the weights `head_dim` elements of the tensors' type.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RawQkNorm {
    /// q's weights.
    pub q_weight: RawBuf,
    /// k's weights.
    pub k_weight: RawBuf,
    /// Added to the mean square; finite and not negative.
    pub eps: f32,
    /// How the weights multiply.
    pub weight: NormWeight,
    /// Which features share one normalisation factor.
    pub scope: NormScope,
}

impl RawQkNorm {
    /// The form the planner takes.
    pub(crate) fn raw(self) -> RawNorm {
        RawNorm {
            q_weight: self.q_weight,
            k_weight: self.k_weight,
            eps: self.eps,
            code: self.weight.code(),
            scope: self.scope,
        }
    }
}

/// A fused operation by address: the rotation (whole head, forward; [`RawOp`]) with an
/// optional normalisation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RawFusedOp {
    /// The rotation, positions and sin/cos, and the tensors' element type.
    pub rope: RawOp,
    /// Per-head RMS normalisation before the rotation.
    pub norm: Option<RawQkNorm>,
}

/// Where the rotated q goes (as [`super::QOut`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RawQOut {
    /// In place or into an output of q's type.
    Elem(RawIo),
    /// Into FP8 bits: `output`'s buffer and layout count bytes.
    Fp8 {
        /// Read only.
        input: RawTensor,
        /// Written only, one byte per element.
        output: RawTensor,
        /// Per tensor or per q head, or a multiplier.
        scale: RawFp8Scale,
        /// E4M3 or E5M2.
        format: Fp8Format,
        /// q's features outside the rotation, stored alongside.
        non_rotary: Option<RawNonRotary>,
    },
}

/// A head's features outside the rotation by address (as [`super::NonRotary`]): the input's
/// and the FP8 output's buffers and layouts (the output's counting bytes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RawNonRotary {
    /// Read only.
    pub input: RawTensor,
    /// Written only, one byte per element.
    pub output: RawTensor,
}

impl RawNonRotary {
    /// The form the planner takes.
    fn part(self) -> NopePart {
        NopePart {
            input: (self.input.buf, self.input.layout),
            output: (self.output.buf, self.output.layout),
        }
    }
}

/// Where the rotated k goes besides the cache (as [`super::KOut`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RawKOut {
    /// In place or into an output of k's type.
    Elem(RawIo),
    /// Only into the cache: k is read only.
    CacheOnly(RawTensor),
    /// Into FP8 bits (no cache): `output`'s buffer and layout count bytes.
    Fp8 {
        /// Read only.
        input: RawTensor,
        /// Written only, one byte per element.
        output: RawTensor,
        /// Per tensor or per k head, or a multiplier.
        scale: RawFp8Scale,
        /// E4M3 or E5M2.
        format: Fp8Format,
        /// k's features outside the rotation, stored alongside.
        non_rotary: Option<RawNonRotary>,
    },
}

/// The tensors of a [`Rope::run_fused_raw`] launch (as [`super::FusedIo`]).
#[derive(Clone, Copy, Debug, PartialEq)]
#[allow(clippy::large_enum_variant)] // Built once per launch and consumed at once.
pub enum RawFusedIo {
    /// q, k (and v for a cache) in buffers of their own (or read-only views of one).
    Separate {
        /// q and where it goes.
        q: RawQOut,
        /// k and where it goes.
        k: RawKOut,
        /// v, required with a cache, else `None`.
        v: Option<RawTensor>,
    },
    /// q, k and v as layouts in one QKV buffer: q and k rotated in place, v only read.
    Packed {
        /// The buffer.
        buf: RawBuf,
        /// q's layout in it.
        q: Layout,
        /// k's layout in it.
        k: Layout,
        /// v's layout in it, required with a cache.
        v: Option<Layout>,
    },
}

/// The caches by address (as [`super::CacheData`]): elements of the tensors' type, or FP8
/// bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RawCacheData {
    /// Elements of the tensors' type.
    Elem {
        /// k's cache.
        k: RawBuf,
        /// v's cache.
        v: RawBuf,
    },
    /// FP8 bytes, `fp8(value / scale)` (or `fp8(value * multiplier)`).
    Fp8 {
        /// k's cache, in bytes.
        k: RawBuf,
        /// v's cache, in bytes.
        v: RawBuf,
        /// Per tensor or per kv head, or a multiplier.
        k_scale: RawFp8Scale,
        /// Per tensor or per kv head, or a multiplier.
        v_scale: RawFp8Scale,
        /// E4M3 or E5M2, both caches.
        format: Fp8Format,
    },
    /// NVFP4 (as [`super::CacheData::Nvfp4`]).
    Nvfp4 {
        /// k's cache.
        k: RawNvfp4Cache,
        /// v's cache.
        v: RawNvfp4Cache,
        /// Byte strides of a block, a row and a head in both caches' block scales.
        scale_strides: [usize; 3],
    },
}

/// One NVFP4 cache by address (as [`super::Nvfp4Cache`]): bytes of codes and of block scales.
/// The scales may lie in the codes' buffer, beside each head's codes (vLLM's packed NVFP4
/// rows: a head's `head_dim / 2` bytes of codes, then its `head_dim / 16` scales): then
/// `block_scales` is that buffer from the first head's first scale, the scale strides the
/// codes' byte strides, and no scale byte may be a code byte of any head.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RawNvfp4Cache {
    /// The E2M1 codes, two a byte.
    pub codes: RawBuf,
    /// The E4M3 block scales, one per 16 elements.
    pub block_scales: RawBuf,
    /// The global scale (per tensor or per kv head).
    pub scale: RawFp8Scale,
}

/// Which slot each token's k and v go to, by address (as [`super::CacheAddress`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawCacheAddress {
    /// One slot per token, `i32` or `i64` (negative: padding, nothing written; past the cache:
    /// skipped).
    Slots(RawInts),
    /// FlashInfer's page table (as [`super::PageTable`]).
    PageTable(RawPageTable),
}

/// [`super::PageTable`] by address: four `i32` arrays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawPageTable {
    /// The request of each token.
    pub batch_indices: RawBuf,
    /// Each token's position in its request.
    pub positions: RawBuf,
    /// Requests + 1 offsets into `kv_indices`.
    pub kv_indptr: RawBuf,
    /// Page numbers.
    pub kv_indices: RawBuf,
}

/// The paged-cache write by address (as [`super::KvCache`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RawKvCache {
    /// Where each token's k and v go.
    pub address: RawCacheAddress,
    /// The layout of both caches.
    pub layout: CacheLayout,
    /// The caches.
    pub data: RawCacheData,
    /// k's features outside the rotation, written into a cache with the rotated ones.
    pub non_rotary: Option<RawCacheNonRotary>,
}

/// k's non-rotary part into a cache, by address (as [`super::CacheNonRotary`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RawCacheNonRotary {
    /// Read only.
    pub input: RawTensor,
    /// Which cache it goes to.
    pub into: NonRotaryCache,
}

impl RawFp8Scale {
    /// The planner's form of the scale, named `arg` in errors.
    pub(super) fn raw(self, arg: &'static str) -> RawScale {
        let source = match self {
            Self::PerTensor(buf) => ScaleSource::Array {
                buf,
                per_head: false,
            },
            Self::PerHead(buf) => ScaleSource::Array {
                buf,
                per_head: true,
            },
            Self::Multiplier(m) => ScaleSource::Multiplier(m),
        };
        RawScale { arg, source }
    }
}

impl From<RawTensor> for TensorReq {
    fn from(t: RawTensor) -> Self {
        RawIo::InPlace(t).into()
    }
}

/// An FP8 output (q's or k's) as the planner takes it: the input read, the output written (in
/// bytes), and its format and scale.
fn fp8_output(
    (input, output): (RawTensor, RawTensor),
    scale: RawScale,
    format: Fp8Format,
) -> (TensorReq, RawFp8) {
    (
        RawIo::OutOfPlace { input, output }.into(),
        RawFp8 { format, scale },
    )
}

/// The request the planner validates: the same form [`Rope::run_fused`]'s bind step makes.
fn request(op: &RawFusedOp, io: RawFusedIo, cache: Option<RawKvCache>) -> FusedRequest {
    let mut nope = NopeParts::default();
    let (q, q_fp8, (k, k_fp8, k_written), v, packed) = match io {
        RawFusedIo::Separate { q, k, v } => {
            let (q, q_fp8) = match q {
                RawQOut::Elem(io) => (io.into(), None),
                RawQOut::Fp8 {
                    input,
                    output,
                    scale,
                    format,
                    non_rotary,
                } => {
                    nope.q = non_rotary.map(RawNonRotary::part);
                    let (q, fp8) = fp8_output((input, output), scale.raw("q.scale"), format);
                    (q, Some(fp8))
                }
            };
            let k = match k {
                RawKOut::Elem(io) => (io.into(), None, true),
                RawKOut::CacheOnly(t) => (t.into(), None, false),
                RawKOut::Fp8 {
                    input,
                    output,
                    scale,
                    format,
                    non_rotary,
                } => {
                    nope.k = non_rotary.map(RawNonRotary::part);
                    let (k, fp8) = fp8_output((input, output), scale.raw("k.scale"), format);
                    (k, Some(fp8), true)
                }
            };
            (q, q_fp8, k, v.map(|t| (t.buf, t.layout)), false)
        }
        RawFusedIo::Packed { buf, q, k, v } => {
            let tensor = |layout| RawTensor { buf, layout }.into();
            (
                tensor(q),
                None,
                (tensor(k), None, true),
                v.map(|l| (buf, l)),
                true,
            )
        }
    };
    let norm = op.norm.map(RawQkNorm::raw);
    let cache = cache.map(|c| {
        let (k, v, store) = match c.data {
            RawCacheData::Elem { k, v } => (k, v, CacheStore::Elem),
            RawCacheData::Fp8 {
                k,
                v,
                k_scale,
                v_scale,
                format,
            } => (
                k,
                v,
                CacheStore::Fp8(CacheFp8 {
                    format,
                    k: k_scale.raw("cache.k_scale"),
                    v: v_scale.raw("cache.v_scale"),
                }),
            ),
            RawCacheData::Nvfp4 {
                k,
                v,
                scale_strides,
            } => (
                k.codes,
                v.codes,
                CacheStore::Nvfp4(CacheNvfp4 {
                    k_block_scales: k.block_scales,
                    v_block_scales: v.block_scales,
                    scale_strides,
                    k: k.scale.raw("cache.k_scale"),
                    v: v.scale.raw("cache.v_scale"),
                }),
            ),
        };
        nope.cached = c.non_rotary.map(|p| CachedNope {
            input: (p.input.buf, p.input.layout),
            into: p.into,
        });
        RawCache {
            address: c.address,
            layout: c.layout,
            k,
            v,
            store,
        }
    });
    FusedRequest {
        rope: Request {
            config: op.rope.config,
            dtype: op.rope.dtype,
            q,
            k: Some(k),
            packed,
            positions: op.rope.positions,
            sincos: op.rope.sincos,
        },
        q_fp8,
        k_fp8,
        k_written,
        v,
        norm,
        cache,
        nope,
    }
}

impl Rope {
    /// Validates a fused operation given by addresses and launches it on `stream`: what
    /// [`Rope::run_fused`] does for views, for memory and streams other frameworks own.
    /// Everything `run_fused` validates is validated here, on the addresses and lengths given;
    /// asynchronous on `stream`, allocating and synchronizing nothing.
    ///
    /// # Safety
    /// The promises of [`Rope::run_raw`], for every buffer here: weights (`head_dim` elements
    /// of `op.rope.dtype`), FP8 scales (`f32`), slot arrays (their `IntType`), caches (of the
    /// tensors' type, or bytes for FP8) and FP8 outputs (bytes) hold `len` such elements at
    /// `ptr` in the context of `stream`, alive until the kernel has finished on it, and nothing
    /// else touches what the launch writes meanwhile.
    ///
    /// # Errors
    /// As [`Rope::run_fused`], except that nothing checks contexts; [`crate::Error::Driver`]
    /// when the launch fails.
    pub unsafe fn run_fused_raw(
        &self,
        op: &RawFusedOp,
        io: RawFusedIo,
        cache: Option<RawKvCache>,
        stream: CUstream,
    ) -> Result<()> {
        let req = request(op, io, cache);
        // SAFETY: the caller's promises are `launch_fused`'s.
        unsafe { self.launch_fused(&req, stream, FreqUse::OtherStream) }
    }
}
