//! Fused launches: [`Rope::run_fused`]. Mirrors `rope-kernels/src/fused.rs`.
//!
//! # Formula
//! For each q and k head `x` of a token (the whole head rotated, both pairings; forward, or
//! backward where nothing is normalised, quantised or cached):
//! 1. with [`QkNorm`]: `x_e <- x_e / sqrt(sum_e x_e^2 / head_dim + eps) * w_e` (`1 + w_e` for
//!    [`NormWeight::OnePlus`]), in `f32`;
//! 2. the rotation of [`Rope::run`];
//! 3. q to its output ([`QOut`]: in place, out of place, or FP8 of `q / scale` or `q *
//!    multiplier`); k to its output ([`KOut`], FP8 as q's) and, with a [`KvCache`], k and v (v
//!    unchanged) into the cache slot of the token ([`CacheAddress`]: `slot_mapping[t]`, a
//!    negative slot is padding and writes nothing; or FlashInfer's [`PageTable`]), in the
//!    tensors' type or FP8 of `value / scale` or `value * multiplier`.
//!
//! Each output is rounded once, from `f32`. FP8 ([`Fp8Format`]) rounds to nearest even and
//! saturates at ±448 (E4M3, [`rope_kernels::math::f32_to_e4m3`]) or ±57344 (E5M2,
//! [`rope_kernels::math::f32_to_e5m2`]). FlashInfer's forms (a page table, E5M2, multipliers, an
//! FP8 k output) run on the token-heads kernels only; a launch those cannot take (a tensor of
//! 2^32 elements or more, accesses narrower than 16 bytes) is refused naming the form's
//! argument.
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
//! As [`Rope::run`]: bind (`bind.rs`), plan (`plan.rs`: validation, access width, grid),
//! encode (`encode.rs`), launch.

mod across;
mod apart;
mod bind;
mod cache_checks;
mod encode;
mod grad;
mod non_rotary;
mod plan;
mod raw;
mod request;
mod rotation;
mod rows;
#[cfg(test)]
mod tests;
mod warps;

use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaView, CudaViewMut};
use rope_kernels::abi::{FormatCode, FusedForms, FusedKernelName, NormCode};

use crate::bind::Binder;
use crate::config::RopeElem;
use crate::error::Result;
use crate::handle::{FreqUse, Rope};
use crate::layout::Layout;
use crate::op::{RopeOp, Tensor, TensorMut};
use crate::positions::DeviceInts;
use crate::rope::Work;
pub use grad::{FusedGrads, RawFusedGrads};
pub(crate) use plan::FusedPlan;
use plan::plan_fused;
pub use raw::{
    RawCacheAddress, RawCacheData, RawCacheNonRotary, RawFp8Scale, RawFusedIo, RawFusedOp, RawKOut,
    RawKvCache, RawNonRotary, RawNvfp4Cache, RawPageTable, RawQOut, RawQkNorm,
};
pub(crate) use request::FusedRequest;
use rows::RowsLaunch;

/// RMS normalisation of q and k before the rotation: `x_e / sqrt(mean_e(x_e^2) + eps) * w_e`,
/// computed in `f32`, the mean over each head (the q/k norms of Qwen3, Gemma 3, OLMo 2) or over
/// all of a token's heads of the tensor (diffusion transformers), as [`NormScope`] says.
#[derive(Debug)]
pub struct QkNorm<'a, T> {
    /// q's weights: `head_dim` elements, or `heads * head_dim` across heads.
    pub q_weight: CudaView<'a, T>,
    /// k's weights, as q's.
    pub k_weight: CudaView<'a, T>,
    /// Added to the mean square; finite and not negative.
    pub eps: f32,
    /// How the weights multiply.
    pub weight: NormWeight,
    /// Which features share one normalisation factor.
    pub scope: NormScope,
}

/// Which of a token's features [`QkNorm`] normalises together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum NormScope {
    /// Each head by itself (Qwen3, Gemma 3, OLMo 2): weights of `head_dim` elements, shared by
    /// the heads.
    #[default]
    PerHead,
    /// All of the token's heads of q (and, apart, of k) as one vector of `heads * head_dim`
    /// features (WAN-style diffusion transformers; FlashInfer's `fused_qk_rmsnorm_rope`):
    /// weights of `heads * head_dim` elements, head `h`'s from `h * head_dim`. Such a launch
    /// rotates the whole head forward and stores q and k in their type or FP8, without a cache
    /// or non-rotary parts (see `rope-kernels/src/fused/across.rs`).
    AcrossHeads,
}

/// How [`QkNorm`]'s weights multiply the normalised head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NormWeight {
    /// `x_hat * w` (Qwen3, OLMo 2, Llama-style RMSNorm).
    Plain,
    /// `x_hat * (1 + w)` (Gemma).
    OnePlus,
}

/// The scale of FP8 stores: in device memory (so a graph replays with the current value),
/// the stored value `fp8(x / scale)`; or a multiplier passed by value (FlashInfer's
/// `quant_scale`: `fp8(x * multiplier)`; a graph replays the value captured).
#[derive(Debug)]
pub enum Fp8Scale<'a> {
    /// One scale for the tensor.
    PerTensor(CudaView<'a, f32>),
    /// One scale per head of the tensor.
    PerHead(CudaView<'a, f32>),
    /// One multiplier for the tensor, finite.
    Multiplier(f32),
}

/// The FP8 format of a store: the value rounded to nearest even, saturating at the format's
/// largest finite magnitude.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Format {
    /// E4M3 (`float8_e4m3fn`), largest 448 ([`rope_kernels::math::f32_to_e4m3`]).
    E4m3,
    /// E5M2 (`float8_e5m2`), largest 57344 ([`rope_kernels::math::f32_to_e5m2`]).
    E5m2,
}

impl Fp8Format {
    /// The kernels' code for stores in this format.
    pub(crate) fn code(self) -> FormatCode {
        match self {
            Fp8Format::E4m3 => FormatCode::E4m3,
            Fp8Format::E5m2 => FormatCode::E5m2,
        }
    }
}

/// Where the rotated q goes.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // Built once per launch and consumed at once.
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
    /// Into an FP8 tensor (`u8` bits) of q's dimensions, as `fp8(q / scale)` (or `fp8(q *
    /// multiplier)`).
    Fp8 {
        /// Read only.
        input: Tensor<'a, T>,
        /// Written only, at its own strides (in bytes).
        output: TensorMut<'a, u8>,
        /// Per tensor or per q head, or a multiplier.
        scale: Fp8Scale<'a>,
        /// E4M3 or E5M2.
        format: Fp8Format,
        /// q's features outside the rotation in tensors of their own, stored alongside.
        non_rotary: Option<NonRotary<'a, T>>,
    },
}

/// A head's features that are not rotated, kept in tensors of their own beside the rotated
/// ones (FlashInfer's `q_nope` and `k_nope`, MLA's latent part): stored, unrotated, as FP8 with
/// the format and scale of the rotated part's FP8 output, `fp8(x / scale)` or `fp8(x *
/// multiplier)`, in the same launch.
///
/// Layout: `input` is `[batch, seq, heads, nope_dim]` with the rotated tensor's batch, seq and
/// heads, tokens at one stride (`stride_batch = seq * stride_seq`, or one batch row); `output`
/// (FP8 bytes) has the input's dimensions at its own strides; q's and k's parts have the same
/// `nope_dim`. Token `t = b * seq + s`, head `h`, element `e` is read at `t * stride_seq + h *
/// stride_head + e` of the input. `nope_dim`, the strides and the offsets are multiples of `16 /
/// size_of::<T>()` (one 16-byte access), and each part spans fewer than 2^32 elements. Runs
/// on the token-heads kernels of FlashInfer's forms.
#[derive(Debug)]
pub struct NonRotary<'a, T> {
    /// Read only.
    pub input: Tensor<'a, T>,
    /// Written only, FP8 bytes.
    pub output: TensorMut<'a, u8>,
}

/// Where the rotated k goes (besides the cache, with one).
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // Built once per launch and consumed at once.
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
    /// Into an FP8 tensor (`u8` bits) of k's dimensions, as `fp8(k / scale)` (or `fp8(k *
    /// multiplier)`); a launch with a cache does not take it.
    Fp8 {
        /// Read only.
        input: Tensor<'a, T>,
        /// Written only, at its own strides (in bytes).
        output: TensorMut<'a, u8>,
        /// Per tensor or per k head, or a multiplier.
        scale: Fp8Scale<'a>,
        /// E4M3 or E5M2.
        format: Fp8Format,
        /// k's features outside the rotation in tensors of their own, stored alongside.
        non_rotary: Option<NonRotary<'a, T>>,
    },
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

    /// The byte strides of NVFP4 block scales laid out as this layout's elements, one byte per
    /// 16 elements (a scale pool mirroring the codes', as TensorRT-LLM's): the strides over 16.
    pub fn nvfp4_scale_strides(&self) -> [usize; 3] {
        self.strides.map(|s| s / 16)
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

/// The caches k and v are written into: in the tensors' type, as FP8, or as NVFP4.
#[derive(Debug)]
pub enum CacheData<'a, T> {
    /// Elements of the tensors' type.
    Elem {
        /// k's cache.
        k: CudaViewMut<'a, T>,
        /// v's cache.
        v: CudaViewMut<'a, T>,
    },
    /// FP8 bits, `fp8(value / scale)` (or `fp8(value * multiplier)`).
    Fp8 {
        /// k's cache.
        k: CudaViewMut<'a, u8>,
        /// v's cache.
        v: CudaViewMut<'a, u8>,
        /// Per tensor or per kv head, or a multiplier.
        k_scale: Fp8Scale<'a>,
        /// Per tensor or per kv head, or a multiplier.
        v_scale: Fp8Scale<'a>,
        /// E4M3 or E5M2, both caches.
        format: Fp8Format,
    },
    /// NVFP4 ([`Nvfp4Cache`]): FP4 E2M1 codes with an FP8 E4M3 scale per 16 elements and a
    /// global scale. Stored by four-heads kernels of their own: bf16 tensors, whole-head
    /// rotations, slot mappings, no non-rotary part, tensors below 2^32 elements at the widest
    /// access.
    Nvfp4 {
        /// k's cache.
        k: Nvfp4Cache<'a>,
        /// v's cache.
        v: Nvfp4Cache<'a>,
        /// Byte strides of a block, a row and a head in both caches' block scales (each head's
        /// `head_dim / 16` scales consecutive bytes); [`CacheLayout::nvfp4_scale_strides`] for
        /// scales laid out as the codes.
        scale_strides: [usize; 3],
    },
}

/// One NVFP4 cache (k's or v's), two-level as TensorRT-LLM's: each block of 16 consecutive
/// elements `x` of a head (k rotated and normalised as stored elsewhere, v as read) is stored
/// with `m = 1 / scale` as the block scale `b = e4m3(max |x_e| * m / 6)` (nearest even,
/// saturating at 448) and the codes `e2m1(x_e * m / b)` (nearest even, saturating at 6;
/// zeros where `b` is 0), so that `x_e ~ e2m1_e * b * scale`.
///
/// Layout: the [`CacheLayout`] gives each element's offset `e` in elements (so its strides
/// are twice the codes' byte strides: multiples of 8; `head_dim` a multiple of 16, and of 32
/// for NeoX pairs so that no block spans the two halves' vectors). Its code is byte `e / 2` of
/// `codes` (the low four bits for even `e`, bit 3 the sign; torch's `float4_e2m1fn_x2` order),
/// `codes` aligned to 4 bytes. Block `b` (elements `16 b .. 16 b + 16`) of head `h` in slot
/// `(block, row)` has its scale at byte `block * s[0] + row * s[1] + h * s[2] + b` of
/// `block_scales`, `s` the [`CacheData::Nvfp4`]'s `scale_strides`. (Scales inside the codes'
/// rows, as vLLM's packed NVFP4 cache keeps them, are one buffer: [`RawNvfp4Cache`].)
#[derive(Debug)]
pub struct Nvfp4Cache<'a> {
    /// The E2M1 codes, two a byte.
    pub codes: CudaViewMut<'a, u8>,
    /// The E4M3 block scales, one per 16 elements.
    pub block_scales: CudaViewMut<'a, u8>,
    /// The global scale (per tensor or per kv head, in device memory).
    pub scale: Fp8Scale<'a>,
}

/// Which cache slot each token's k and v go to. Device data: a slot outside the cache (or a
/// page-table entry outside its arrays) is skipped, never written.
#[derive(Debug)]
pub enum CacheAddress<'a> {
    /// vLLM's `slot_mapping`: one slot per token (`batch * seq`, `i32` or `i64`); a negative
    /// slot (padding) writes nothing.
    Slots(DeviceInts<'a>),
    /// FlashInfer's page table ([`PageTable`]).
    PageTable(PageTable<'a>),
}

/// FlashInfer's paged-KV addressing (`append_paged_kv_cache`,
/// `rope_quantize_fp8_append_paged_kv_cache`), all `i32`: token `t` of request `b =
/// batch_indices[t]` at position `p = positions[t]` in it goes to entry `p % page_size` of page
/// `kv_indices[kv_indptr[b] + p / page_size]` (`page_size` the layout's `block_size`). A
/// negative `b` (padding) writes nothing; so does a negative position or page, a request
/// without an entry in `kv_indptr`, or a page entry outside `kv_indptr[b] .. kv_indptr[b + 1]`
/// or `kv_indices` (FlashInfer's kernel does not check these).
#[derive(Debug)]
pub struct PageTable<'a> {
    /// The request of each token (`batch * seq`).
    pub batch_indices: CudaView<'a, i32>,
    /// Each token's position in its request (`batch * seq`).
    pub positions: CudaView<'a, i32>,
    /// Request `b`'s pages are entries `kv_indptr[b] .. kv_indptr[b + 1]` of `kv_indices`
    /// (requests + 1 entries).
    pub kv_indptr: CudaView<'a, i32>,
    /// Page numbers.
    pub kv_indices: CudaView<'a, i32>,
}

/// The paged-cache write of a fused launch.
#[derive(Debug)]
pub struct KvCache<'a, T> {
    /// Where each token's k and v go.
    pub address: CacheAddress<'a>,
    /// The layout of both caches.
    pub layout: CacheLayout,
    /// The caches.
    pub data: CacheData<'a, T>,
    /// k's features outside the rotation, written into a cache with the rotated ones.
    pub non_rotary: Option<CacheNonRotary<'a, T>>,
}

/// k's features outside the rotation in a tensor of their own (FlashInfer's `k_nope` in
/// `rope_quantize_fp8_append_paged_kv_cache`, vLLM's MLA `kv_c`), written unrotated into a cache
/// in the same launch as the rotated ones, for each token that has a slot: `fp8(x / scale)` or
/// `fp8(x * multiplier)` in the cache's format with k's scale ([`CacheData::Fp8`]), or as they
/// are ([`CacheData::Elem`]; a latent cache's address then aligned to 16 bytes).
///
/// Layout: `input` is `[batch, seq, kv_heads, nope_dim]` with k's batch, seq and heads, tokens
/// at one stride, as [`NonRotary`]'s input (`nope_dim`, strides and offset multiples of one
/// 16-byte access; q's non-rotary part, if any, of the same `nope_dim`). Runs on the
/// token-heads kernels of FlashInfer's forms.
#[derive(Debug)]
pub struct CacheNonRotary<'a, T> {
    /// Read only.
    pub input: Tensor<'a, T>,
    /// Which cache it goes to.
    pub into: NonRotaryCache,
}

/// Where [`CacheNonRotary`]'s part goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NonRotaryCache {
    /// GQA/MHA (FlashInfer's `k_cache` heads of `rope_dim + no_rope_dim`): each cache head
    /// holds `head_dim + nope_dim` elements (the [`CacheLayout`]'s `head_dim`), k's rotated
    /// features at `0..head_dim`, the part at `head_dim..`. v is as wide: its input heads hold
    /// `head_dim + nope_dim` elements, all stored into v's cache (in its format, with v's scale).
    AfterRotated,
    /// MLA (FlashInfer's `(ckv_cache, kpe_cache)`): the part goes into the cache's `v` buffer
    /// (the latent cache, `ckv_cache`), laid out by this layout (`kv_heads` k's heads, `head_dim`
    /// the part's `nope_dim`, the k cache's `num_blocks` and `block_size`), and the rotated k
    /// into the cache's `k` buffer (`kpe_cache`). The launch has no v, and the cache's
    /// `v_scale` is not used.
    Latent(CacheLayout),
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
        if req.norm.is_some_and(|n| n.across_heads()) {
            // SAFETY: the caller's promises.
            return unsafe { self.launch_across(req, stream, on) };
        }
        let Some(plan) = self.plan_fused(req)? else {
            return Ok(());
        };
        if let Some([(q, q_plan), (rest, rest_plan)]) =
            apart::q_apart(req, &plan, &|r| self.plan_fused(r))
        {
            // SAFETY: the two requests hold `req`'s addresses (each a part of its tensors and
            // nothing else), planned above; their written regions are `req`'s, which its plan
            // proved apart from everything either launch reads.
            unsafe { self.launch_fused_plan(&q, &q_plan, stream, on) }?;
            // SAFETY: as above.
            return unsafe { self.launch_fused_plan(&rest, &rest_plan, stream, on) };
        }
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
        let work = Work {
            grid: &plan.grid,
            tokens: plan.tokens,
            rot_groups: plan.rot_groups,
            lanes: plan.lanes,
        };
        let rope = self.rope_args(&req.rope, &work, (&plan.positions, &plan.sincos), on)?;
        let scales = encode::scale_args(req);
        let args = encode::encode(req, plan, rope, &scales);
        let function = self.module.function(plan.kernel.symbol())?;
        let (context, overlap) = (
            self.stream.context(),
            self.overlap_for(plan.kernel.symbol()),
        );
        let config = plan.grid.config;
        // SAFETY: `FusedArgs` comes from `fused_kernel_params!`, and `FusedFormsArgs` from
        // `fused_forms_kernel_params!`, the entry points' lists, and the kernel's forms pick the
        // list its entry point takes. The plan proved what the entry points' `# Safety` asks:
        // every tensor, output, weight, scale, slot array, page table and cache holds what its
        // layout and the kernel address (the cache for every slot below `cache_slots`), written
        // regions overlap nothing else, pointers and strides are aligned to `lanes`, the whole
        // head is rotated (or, for the partial kernels, its first `2 half` features, the rest
        // whole accesses of the groups `groups` covers), and `groups` is a power of two of at
        // most 32 with a norm; positions and sin/cos as for `Rope::run`. The function was
        // loaded in this context. With programmatic overlap the function comes from
        // `PTX_SM90` (`overlap_for`).
        unsafe {
            match plan.kernel.forms {
                FusedForms::Plain | FusedForms::Partial => {
                    args.launch(context, &function, config, stream, overlap)
                }
                FusedForms::FlashInfer => encode::encode_forms(req, plan, args, &scales)
                    .launch(context, &function, config, stream, overlap),
                FusedForms::Nvfp4 => encode::encode_nvfp4(req, args)
                    .launch(context, &function, config, stream, overlap),
            }
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
