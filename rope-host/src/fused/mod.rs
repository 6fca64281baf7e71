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
mod cache;
mod cache_checks;
mod encode;
mod grad;
mod latent;
mod non_rotary;
mod plan;
mod raw;
mod request;
mod rotation;
mod rows;
mod tensors;
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
use crate::rope::Work;
pub use cache::{
    CacheAddress, CacheData, CacheLayout, CacheNonRotary, KvCache, NonRotaryCache, Nvfp4Cache,
    PageTable,
};
pub use grad::{FusedGrads, RawFusedGrads};
pub(crate) use plan::FusedPlan;
use plan::{plan_checked, plan_fused};
pub use raw::{
    RawCacheAddress, RawCacheData, RawCacheNonRotary, RawFp8Scale, RawFusedIo, RawFusedOp, RawKOut,
    RawKvCache, RawNonRotary, RawNvfp4Cache, RawPageTable, RawQOut, RawQkNorm,
};
pub(crate) use request::FusedRequest;
use rows::{RowsLaunch, RowsOccupancy};

/// A fused planner (`plan_fused`, `plan_checked`): a request on a device, with its module's
/// occupancy, the kernel choice and (sm_90 builds) the rows kernels' occupancy.
type Planner = fn(
    &FusedRequest,
    &crate::device::DeviceFacts,
    &dyn Fn(FusedKernelName) -> u32,
    crate::tuning::FusedKernels,
    Option<RowsOccupancy>,
) -> Result<Option<FusedPlan>>;

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
    /// rotation, `norm` for bad weights or eps (or a head of more than 128 accesses, or of more
    /// than 32 in a launch the four-heads kernels cannot take), `v` and `cache` for tensors,
    /// layouts, slot mappings or scales that do not fit;
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
        if let Some((heads, heads_plan)) =
            latent::latent_as_v(req, &|r| self.plan_by(r, plan_checked))
        {
            // SAFETY: `heads` holds `req`'s addresses, validated by `plan` above, and stores
            // `req`'s latent part where `req` stores it (v's heads of its slots' rows).
            return unsafe { self.launch_fused_plan(&heads, &heads_plan, stream, on) };
        }
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
        self.plan_by(req, plan_fused)
    }

    /// `req` planned by `planner` (`plan_fused`, or `plan_checked` for a rewrite of a request
    /// `plan_fused` validated) on this handle's device, module and kernel choice.
    fn plan_by(&self, req: &FusedRequest, planner: Planner) -> Result<Option<FusedPlan>> {
        let module = &self.module;
        let blocks = |k: FusedKernelName| module.blocks_per_sm(k.symbol());
        let rows_blocks = |k: FusedKernelName, l: &RowsLaunch| {
            module.blocks_per_sm_at(k.symbol(), l.threads, l.shared_bytes)
        };
        let rows = module.bulk_rows().then_some(&rows_blocks as _);
        planner(req, &self.facts, &blocks, self.fused_kernels, rows)
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
        // most 32 with a norm (64 or 128 for the long-norm kernels, whose blocks `fused_grid`
        // cuts into whole segments of `groups / 32` warps); positions and sin/cos as for
        // `Rope::run`. The function was
        // loaded in this context. With programmatic overlap the function comes from
        // the sm_90 build (`overlap_for`).
        unsafe {
            match plan.kernel.forms {
                FusedForms::Plain | FusedForms::Partial | FusedForms::LongNorm => {
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
