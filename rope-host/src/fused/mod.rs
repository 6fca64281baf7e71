//! Fused launches: [`Rope::run_fused`]. Mirrors `rope-kernels/src/fused.rs`.
//!
//! # Formula
//! For each q and k head `x` of a token (the whole head rotated, both pairings; forward, or
//! backward where nothing is normalised, quantised or cached):
//! 1. with [`QkNorm`]: `x_e <- x_e / sqrt(sum_e x_e^2 / head_dim + eps) * w_e` (`1 + w_e` for
//!    [`NormWeight::OnePlus`]), in `f32`;
//! 2. the rotation of [`Rope::run`];
//! 3. q to its output ([`QOut`]: in place, out of place, or FP8 E4M3 of `q / scale`); k to its
//!    output ([`KOut`]) and, with a [`KvCache`], k and v (v unchanged) into the cache slot of
//!    the token (`slot_mapping[t]`; a negative slot is padding and writes nothing), in the
//!    tensors' type or FP8 E4M3 of `value / scale`.
//!
//! Each output is rounded once, from `f32`. FP8 rounds to nearest even and saturates at ±448
//! ([`rope_kernels::math::f32_to_e4m3`]).
//!
//! # Layouts
//! q, k and v are [`Layout`]s (`[batch, seq, heads, head_dim]` at any strides with contiguous
//! heads), separate or views into one QKV buffer ([`FusedIo::Packed`]). The cache is described
//! by [`CacheLayout`]: vLLM's `[num_blocks, block_size, kv_heads, head_dim]`
//! ([`CacheLayout::blocks_rows_heads`]) or `[num_blocks, kv_heads, block_size, head_dim]`
//! ([`CacheLayout::blocks_heads_rows`]), or any strides; slot `s` is row `s % block_size` of
//! block `s / block_size`. Token `t` is `b * seq + s` of q's layout.
//!
//! # A launch
//! As [`Rope::run`]: bind, plan (`plan.rs`: validation, access width, grid), encode, launch.

mod bind;
mod plan;
mod raw;
mod request;
mod rotation;
mod rows;
#[cfg(test)]
mod tests;

use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaView, CudaViewMut};
use rope_kernels::abi::{FormatCode, FusedKernelName, NormCode};

use crate::bind::Binder;
use crate::config::RopeElem;
use crate::error::Result;
use crate::handle::{FreqUse, Rope};
use crate::kernel_args::FusedArgs;
use crate::layout::Layout;
use crate::op::{RopeOp, Tensor, TensorMut};
use crate::positions::{DeviceInts, IntType};
use crate::rope::{Work, encode_work};
pub(crate) use plan::FusedPlan;
use plan::plan_fused;
pub use raw::{
    RawCacheData, RawFp8Scale, RawFusedIo, RawFusedOp, RawKOut, RawKvCache, RawQOut, RawQkNorm,
};
pub(crate) use request::FusedRequest;
use request::RawScale;
use rows::RowsLaunch;

/// Per-head RMS normalisation of q and k before the rotation (the q/k norms of Qwen3, Gemma 3,
/// OLMo 2): `x_e / sqrt(mean_e(x_e^2) + eps) * w_e`, computed in `f32`.
#[derive(Debug)]
pub struct QkNorm<'a, T> {
    /// q's weights, `head_dim` elements.
    pub q_weight: CudaView<'a, T>,
    /// k's weights, `head_dim` elements.
    pub k_weight: CudaView<'a, T>,
    /// Added to the mean square; finite and not negative.
    pub eps: f32,
    /// How the weights multiply.
    pub weight: NormWeight,
}

/// How [`QkNorm`]'s weights multiply the normalised head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NormWeight {
    /// `x_hat * w` (Qwen3, OLMo 2, Llama-style RMSNorm).
    Plain,
    /// `x_hat * (1 + w)` (Gemma).
    OnePlus,
}

/// The scale of FP8 stores, in device memory (so a graph replays with the current value):
/// the stored value is `e4m3(x / scale)`.
#[derive(Debug)]
pub enum Fp8Scale<'a> {
    /// One scale for the tensor.
    PerTensor(CudaView<'a, f32>),
    /// One scale per head of the tensor.
    PerHead(CudaView<'a, f32>),
}

/// Where the rotated q goes.
#[derive(Debug)]
pub enum QOut<'a, T> {
    /// Back into q.
    InPlace(TensorMut<'a, T>),
    /// Into another tensor of q's type and dimensions.
    OutOfPlace {
        /// Read only.
        input: Tensor<'a, T>,
        /// Written only.
        output: TensorMut<'a, T>,
    },
    /// Into an FP8 E4M3 tensor (`u8` bits) of q's dimensions, as `e4m3(q / scale)`.
    Fp8 {
        /// Read only.
        input: Tensor<'a, T>,
        /// Written only, at its own strides (in bytes).
        output: TensorMut<'a, u8>,
        /// Per tensor or per q head.
        scale: Fp8Scale<'a>,
    },
}

/// Where the rotated k goes (besides the cache, with one).
#[derive(Debug)]
pub enum KOut<'a, T> {
    /// Back into k.
    InPlace(TensorMut<'a, T>),
    /// Into another tensor of k's type and dimensions.
    OutOfPlace {
        /// Read only.
        input: Tensor<'a, T>,
        /// Written only.
        output: TensorMut<'a, T>,
    },
    /// Only into the cache (a [`KvCache`] is required): k itself is read only.
    CacheOnly(Tensor<'a, T>),
}

/// The tensors of a fused launch.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // Built once per launch and consumed at once.
pub enum FusedIo<'a, T> {
    /// q, k (and v for a cache) as their own views; views of one QKV buffer are fine when q and
    /// k are only read ([`QOut::Fp8`], [`KOut::CacheOnly`]).
    Separate {
        /// q and where it goes.
        q: QOut<'a, T>,
        /// k and where it goes.
        k: KOut<'a, T>,
        /// v, required with a cache (copied into it), else `None`.
        v: Option<Tensor<'a, T>>,
    },
    /// q, k and v as layouts in one QKV buffer (as a fused projection writes it): q and k are
    /// rotated in place inside it, v is only read.
    Packed {
        /// The buffer.
        data: CudaViewMut<'a, T>,
        /// q's layout in it.
        q: Layout,
        /// k's layout in it.
        k: Layout,
        /// v's layout in it, required with a cache.
        v: Option<Layout>,
    },
}

/// The element layout of a paged KV cache (one for k's cache and v's): slot `s` is row
/// `s % block_size` of block `s / block_size`, and element `e` of head `h` of that row is at
/// `block * strides[0] + row * strides[1] + h * strides[2] + e`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLayout {
    /// Blocks (pages).
    pub num_blocks: usize,
    /// Rows (tokens) per block.
    pub block_size: usize,
    /// Heads per row: k's heads.
    pub kv_heads: usize,
    /// Elements per head: the config's `head_dim`.
    pub head_dim: usize,
    /// Element strides of a block, a row and a head.
    pub strides: [usize; 3],
}

impl CacheLayout {
    /// vLLM's `[num_blocks, block_size, kv_heads, head_dim]` (FlashAttention's paged layout,
    /// FlashInfer's NHD), contiguous.
    pub fn blocks_rows_heads(
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        Self {
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            strides: [
                block_size * kv_heads * head_dim,
                kv_heads * head_dim,
                head_dim,
            ],
        }
    }

    /// `[num_blocks, kv_heads, block_size, head_dim]` (FlashInfer's HND), contiguous.
    pub fn blocks_heads_rows(
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        Self {
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            strides: [
                kv_heads * block_size * head_dim,
                head_dim,
                block_size * head_dim,
            ],
        }
    }
}

/// The caches k and v are written into, in the tensors' type or as FP8 E4M3.
#[derive(Debug)]
pub enum CacheData<'a, T> {
    /// Elements of the tensors' type.
    Elem {
        /// k's cache.
        k: CudaViewMut<'a, T>,
        /// v's cache.
        v: CudaViewMut<'a, T>,
    },
    /// FP8 E4M3 bits, `e4m3(value / scale)`.
    Fp8 {
        /// k's cache.
        k: CudaViewMut<'a, u8>,
        /// v's cache.
        v: CudaViewMut<'a, u8>,
        /// Per tensor or per kv head.
        k_scale: Fp8Scale<'a>,
        /// Per tensor or per kv head.
        v_scale: Fp8Scale<'a>,
    },
}

/// The paged-cache write of a fused launch.
#[derive(Debug)]
pub struct KvCache<'a, T> {
    /// One slot per token (`batch * seq`, `i32` or `i64` as vLLM's `slot_mapping`); a negative
    /// slot (padding) writes nothing. Device data: a slot past the cache is skipped too.
    pub slot_mapping: DeviceInts<'a>,
    /// The layout of both caches.
    pub layout: CacheLayout,
    /// The caches.
    pub data: CacheData<'a, T>,
}

/// A fused operation: the rotation (whole head) with an optional q/k normalisation.
#[derive(Debug)]
pub struct FusedOp<'a, T> {
    /// The rotation: the config must rotate the whole head, forward (backward only without a
    /// norm, an FP8 q or a cache).
    pub rope: RopeOp<'a, T>,
    /// Per-head RMS normalisation before the rotation.
    pub norm: Option<QkNorm<'a, T>>,
}

impl Rope {
    /// Validates and launches one fused kernel: normalisation (optional), rotation of q and k,
    /// and their stores (and v's, into the cache); asynchronous on the stream, allocating and
    /// synchronizing nothing, so it can be captured in a CUDA graph (with computed sin/cos,
    /// call [`Rope::prepare`] first).
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming the offending argument (nothing is launched and no
    /// output is touched): as [`Rope::run_qk`], and `config` for a partial or backward
    /// rotation, `norm` for bad weights or eps (or a head too wide for the normalisation's
    /// sum), `v` and `cache` for tensors, layouts, slot mappings or scales that do not fit;
    /// [`crate::Error::Driver`] when the launch fails.
    pub fn run_fused<T: RopeElem>(
        &self,
        op: &FusedOp<'_, T>,
        mut io: FusedIo<'_, T>,
        mut cache: Option<KvCache<'_, T>>,
    ) -> Result<()> {
        let mut binder = Binder::new(&self.stream);
        let req = bind::bind(&mut binder, op, &mut io, cache.as_mut())?;
        // SAFETY: the stream is the `Rope`'s; the binder checked every view's context and
        // holds its length; the guards, dropped after the launch, order later uses after it.
        unsafe { self.launch_fused(&req, self.stream.cu_stream(), FreqUse::OwnStream) }?;
        drop(binder);
        Ok(())
    }

    /// Plans, encodes and launches a fused request on `stream` (the handle's own, or another:
    /// `on`).
    ///
    /// # Safety
    /// Every address of `req` is device memory of this context holding the length given,
    /// alive and not used by others until the kernel has finished on `stream`, a live stream
    /// of this context.
    pub(crate) unsafe fn launch_fused(
        &self,
        req: &FusedRequest,
        stream: CUstream,
        on: FreqUse,
    ) -> Result<()> {
        let Some(plan) = self.plan_fused(req)? else {
            return Ok(());
        };
        // SAFETY: the caller's promises, for the plan of `req`.
        unsafe { self.launch_fused_plan(req, &plan, stream, on) }
    }

    /// The fused plan of `req` on this handle's device, module and kernel choice (`None`: an
    /// empty launch).
    pub(crate) fn plan_fused(&self, req: &FusedRequest) -> Result<Option<FusedPlan>> {
        let module = &self.module;
        let blocks = |k: FusedKernelName| module.blocks_per_sm(k.symbol());
        let rows_blocks = |k: FusedKernelName, l: &RowsLaunch| {
            module.blocks_per_sm_at(k.symbol(), l.threads, l.shared_bytes)
        };
        let rows = module.bulk_rows().then_some(&rows_blocks as _);
        plan_fused(req, &self.facts, &blocks, self.fused_kernels, rows)
    }

    /// Encodes and launches a fused request planned by [`Rope::plan_fused`].
    ///
    /// # Safety
    /// As [`Rope::launch_fused`]; `plan` is `req`'s.
    pub(crate) unsafe fn launch_fused_plan(
        &self,
        req: &FusedRequest,
        plan: &FusedPlan,
        stream: CUstream,
        on: FreqUse,
    ) -> Result<()> {
        let positions = req.rope.positions.encode(&plan.positions);
        let (raw, config) = (&req.rope.sincos, &req.rope.config);
        let inv_freq = self.launch_inv_freq(raw, config, on)?;
        let sincos = raw.encode(&plan.sincos, config, inv_freq);
        let work = Work {
            grid: &plan.grid,
            tokens: plan.tokens,
            rot_groups: plan.rot_groups,
            lanes: plan.lanes,
        };
        let rope = encode_work(&req.rope, &work, &positions, &sincos);
        let args = encode(req, plan, rope);
        let function = self.module.function(plan.kernel.symbol())?;
        // SAFETY: `FusedArgs` comes from `fused_kernel_params!`, the entry points' list. The
        // plan proved what the entry points' `# Safety` asks: every tensor, output, weight,
        // scale, slot array and cache holds what its layout and the kernel address (the cache
        // for every slot below `cache_slots`), written regions overlap nothing else,
        // pointers and strides are aligned to `lanes`, the whole head is rotated, and
        // `groups` is a power of two of at most 32 with a norm; positions and sin/cos as for
        // `Rope::run`. The function was loaded in this context.
        // With programmatic overlap the function comes from `PTX_SM90` (`overlap_for`).
        unsafe {
            args.launch(
                self.stream.context(),
                &function,
                plan.grid.config,
                stream,
                self.overlap_for(plan.kernel.symbol()),
            )
        }
    }
}

impl NormWeight {
    /// The kernels' code for this weighting.
    pub(crate) fn code(self) -> NormCode {
        match self {
            NormWeight::Plain => NormCode::Rms,
            NormWeight::OnePlus => NormCode::RmsOnePlus,
        }
    }
}

/// The FP8 scales of q's output, k's cache and v's cache, in that order, as the kernels take
/// them: the address and the step between heads, 0 for one scale (or no FP8 store: then the
/// address is 0 too) and 1 for one per head. Each destination keeps its own granularity, so a
/// per-head k scale beside a per-tensor v scale (or the reverse) is read as given.
fn scale_args(req: &FusedRequest) -> [(u64, u32); 3] {
    let arg = |s: Option<RawScale>| s.map_or((0, 0), |s| (s.buf.ptr, u32::from(s.per_head)));
    let cache = req.cache.and_then(|c| c.fp8);
    [
        arg(req.q_fp8),
        arg(cache.map(|(k, _)| k)),
        arg(cache.map(|(_, v)| v)),
    ]
}

/// The fused kernel's arguments: the RoPE arguments of the request (q's output in bytes for
/// FP8, k's output null when k is only cached) and the fused ones.
fn encode(req: &FusedRequest, plan: &FusedPlan, rope: crate::kernel_args::RopeArgs) -> FusedArgs {
    let out0 = match (req.q_fp8, req.rope.q.out) {
        // The output's offset counts bytes, not elements of the input's type.
        (Some(_), Some((buf, layout))) => buf.ptr + layout.offset as u64,
        _ => rope.out0,
    };
    let out1 = if req.k_written { rope.out1 } else { 0 };
    let es = req.rope.dtype.size() as u64;
    let (v, heads_v, v_strides) = match req.v {
        Some((buf, l)) => (
            buf.ptr + l.offset as u64 * es,
            l.heads as u32,
            l.strides.map(|s| s as u64),
        ),
        None => (0, 0, [0; 3]),
    };
    let (norm, q_norm_weight, k_norm_weight, norm_eps) = match req.norm {
        Some(n) => (n.code as u32, n.q_weight.ptr, n.k_weight.ptr, n.eps),
        None => (NormCode::None as u32, 0, 0, 0.0),
    };
    let q_format = match req.q_fp8 {
        Some(_) => FormatCode::E4m3 as u32,
        None => FormatCode::Elem as u32,
    };
    let [
        (q_scale, q_scale_step),
        (k_scale, k_scale_step),
        (v_scale, v_scale_step),
    ] = scale_args(req);
    let c = req.cache.as_ref();
    let strides = c.map_or([0; 3], |c| c.layout.strides.map(|s| s as u64));
    let block = plan.block;
    macro_rules! with_rope {
        ({ $r:ident } $($param:ident: $kind:ident,)*) => {
            FusedArgs {
                $($param: $r.$param,)*
                v,
                heads_v,
                v_stride_batch: v_strides[0],
                v_stride_seq: v_strides[1],
                v_stride_head: v_strides[2],
                head_dim: req.rope.config.head_dim(),
                norm,
                q_norm_weight,
                k_norm_weight,
                norm_eps,
                q_format,
                q_scale,
                q_scale_step,
                slots: c.map_or(0, |c| c.slots.buf.ptr),
                slots_wide: u32::from(c.is_some_and(|c| c.slots.ty == IntType::I64)),
                k_cache: c.map_or(0, |c| c.k.ptr),
                v_cache: c.map_or(0, |c| c.v.ptr),
                cache_stride_block: strides[0],
                cache_stride_slot: strides[1],
                cache_stride_head: strides[2],
                block_size: block.divisor.get(),
                block_magic: block.magic,
                block_shift: block.shift,
                cache_slots: plan.cache_slots,
                cache_format: if c.is_some_and(|c| c.fp8.is_some()) {
                    FormatCode::E4m3 as u32
                } else {
                    FormatCode::Elem as u32
                },
                k_scale,
                v_scale,
                k_scale_step,
                v_scale_step,
                q_warps: plan.token_warps[0],
                k_warps: plan.token_warps[1],
                v_warps: plan.token_warps[2],
                prefetch_tokens: plan.prefetch_tokens,
                sin_sign: req.rope.config.direction().sin_sign(),
            }
        };
    }
    let mut args = rope_kernels::rope_kernel_params!(with_rope { rope });
    (args.out0, args.out1) = (out0, out1);
    args
}
