//! Fused launches by address: [`Rope::run_fused_raw`], for memory and streams that other
//! frameworks own (the Python bindings, candle). The forms mirror the safe API's
//! ([`super::FusedOp`], [`super::FusedIo`], [`super::KvCache`]) with [`RawBuf`]s for views; they
//! reduce to the same [`FusedRequest`] the safe API binds, so both are validated, planned and
//! launched by the same code.

use cudarc::driver::sys::CUstream;

use super::request::{FusedRequest, RawCache, RawNorm, RawScale};
use super::{CacheLayout, NormWeight};
use crate::bind::RawBuf;
use crate::error::Result;
use crate::handle::{FreqUse, Rope};
use crate::layout::Layout;
use crate::plan::{Request, TensorReq};
use crate::positions::RawInts;
use crate::rope::{RawIo, RawOp, RawTensor};

/// An FP8 scale array by address (`f32`): the stored value is `e4m3(x / scale)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawFp8Scale {
    /// One scale for the tensor (`len >= 1`).
    PerTensor(RawBuf),
    /// One scale per head of the tensor.
    PerHead(RawBuf),
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawQOut {
    /// In place or into an output of q's type.
    Elem(RawIo),
    /// Into FP8 E4M3 bits: `output`'s buffer and layout count bytes.
    Fp8 {
        /// Read only.
        input: RawTensor,
        /// Written only, one byte per element.
        output: RawTensor,
        /// Per tensor or per q head.
        scale: RawFp8Scale,
    },
}

/// Where the rotated k goes besides the cache (as [`super::KOut`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawKOut {
    /// In place or into an output of k's type.
    Elem(RawIo),
    /// Only into the cache: k is read only.
    CacheOnly(RawTensor),
}

/// The tensors of a [`Rope::run_fused_raw`] launch (as [`super::FusedIo`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
/// E4M3 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawCacheData {
    /// Elements of the tensors' type.
    Elem {
        /// k's cache.
        k: RawBuf,
        /// v's cache.
        v: RawBuf,
    },
    /// FP8 E4M3 bytes, `e4m3(value / scale)`.
    Fp8 {
        /// k's cache, in bytes.
        k: RawBuf,
        /// v's cache, in bytes.
        v: RawBuf,
        /// Per tensor or per kv head.
        k_scale: RawFp8Scale,
        /// Per tensor or per kv head.
        v_scale: RawFp8Scale,
    },
}

/// The paged-cache write by address (as [`super::KvCache`]): token `t`'s k and v go to slot
/// `slot_mapping[t]` (negative: padding, nothing written; past the cache: skipped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawKvCache {
    /// One slot per token, `i32` or `i64`.
    pub slot_mapping: RawInts,
    /// The layout of both caches.
    pub layout: CacheLayout,
    /// The caches.
    pub data: RawCacheData,
}

impl RawFp8Scale {
    /// The planner's form of the scale, named `arg` in errors.
    pub(super) fn raw(self, arg: &'static str) -> RawScale {
        let (buf, per_head) = match self {
            Self::PerTensor(buf) => (buf, false),
            Self::PerHead(buf) => (buf, true),
        };
        RawScale { arg, buf, per_head }
    }
}

impl From<RawTensor> for TensorReq {
    fn from(t: RawTensor) -> Self {
        RawIo::InPlace(t).into()
    }
}

/// The request the planner validates: the same form [`Rope::run_fused`]'s bind step makes.
fn request(op: &RawFusedOp, io: RawFusedIo, cache: Option<RawKvCache>) -> FusedRequest {
    let (q, q_fp8, k, k_written, v, packed) = match io {
        RawFusedIo::Separate { q, k, v } => {
            let (q, q_fp8) = match q {
                RawQOut::Elem(io) => (io.into(), None),
                RawQOut::Fp8 {
                    input,
                    output,
                    scale,
                } => (
                    RawIo::OutOfPlace { input, output }.into(),
                    Some(scale.raw("q.scale")),
                ),
            };
            let (k, k_written) = match k {
                RawKOut::Elem(io) => (io.into(), true),
                RawKOut::CacheOnly(t) => (t.into(), false),
            };
            (q, q_fp8, k, k_written, v.map(|t| (t.buf, t.layout)), false)
        }
        RawFusedIo::Packed { buf, q, k, v } => {
            let tensor = |layout| RawTensor { buf, layout }.into();
            (tensor(q), None, tensor(k), true, v.map(|l| (buf, l)), true)
        }
    };
    let norm = op.norm.map(|n| RawNorm {
        q_weight: n.q_weight,
        k_weight: n.k_weight,
        eps: n.eps,
        code: n.weight.code(),
    });
    let cache = cache.map(|c| {
        let (k, v, fp8) = match c.data {
            RawCacheData::Elem { k, v } => (k, v, None),
            RawCacheData::Fp8 {
                k,
                v,
                k_scale,
                v_scale,
            } => (
                k,
                v,
                Some((k_scale.raw("cache.k_scale"), v_scale.raw("cache.v_scale"))),
            ),
        };
        RawCache {
            slots: c.slot_mapping,
            layout: c.layout,
            k,
            v,
            fp8,
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
        k_written,
        v,
        norm,
        cache,
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
