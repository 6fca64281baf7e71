//! The normalisation across heads with RoPE (diffusion transformers): a fused launch whose
//! [`super::QkNorm`] has [`super::NormScope::AcrossHeads`]. Mirrors
//! `rope-kernels/src/fused/across.rs`.
//!
//! # Formula
//! For each token, q's heads `x` (`H` of `d` features, `n = H d`) are normalised together,
//! `x_{h,e} / sqrt(sum x^2 / n + eps) * w'_{h d + e}` (`w` of `H d` weights, `w' = w` or `1 + w`),
//! then each head is rotated at the token's position; k alike with its own weights. All in
//! `f32`, each output rounded once to the tensors' type or to FP8.
//!
//! # A launch
//! As [`crate::Rope::run_fused`]'s (bind, then here: plan, encode, launch): the plan checks the
//! request as every fused launch's (tensors, outputs, weights, scales, positions, sin/cos) and
//! refuses what these kernels do not store (a cache, v, non-rotary parts, a partial or backward
//! rotation), then picks the access width and a grid of one block per token and tensor.

use std::num::NonZeroU32;

use cudarc::driver::LaunchConfig;
use cudarc::driver::sys::CUstream;
use rope_kernels::abi::{
    Direction, NORM_ACROSS_MAX_THREADS, NormAcrossKernelName, SHARED_BUFFER_F32,
    token_warps_heads_per_thread,
};
use rope_kernels::divide::Divisor;

use super::encode::{ScaleArg, format_code, output_addresses, scale_args};
use super::request::FusedRequest;
use super::tensors::check_fused_tensors;
use super::warps::{access, spans_below_2_32};
use crate::check::check_overlaps;
use crate::device::DeviceFacts;
use crate::error::{Result, invalid};
use crate::handle::{FreqUse, Rope};
use crate::kernel_args::{NormAcrossArgs, RopeArgs};
use crate::plan::Grid;
use crate::positions::PositionsPlan;
use crate::rope::Work;
use crate::sincos::SinCosPlan;
use crate::tuning::prefetch_tokens;

/// Everything an across-heads launch needs except the device pointers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AcrossPlan {
    pub(crate) kernel: NormAcrossKernelName,
    pub(crate) grid: Grid,
    pub(crate) lanes: u32,
    /// Threads holding one head's pairs, `half / pairs` (in a segment of the grid's `groups`,
    /// the power of two at or above it).
    pub(crate) groups: u32,
    pub(crate) tokens: u64,
    pub(crate) positions: PositionsPlan,
    pub(crate) sincos: SinCosPlan,
    /// How many tokens ahead each block asks L2 for its heads.
    pub(crate) prefetch_tokens: u32,
}

/// Validates an across-heads request and computes its launch: `None` when there is nothing to
/// do. Blocks ask L2 for the heads of tokens ahead by the four-heads kernels' rule
/// ([`prefetch_tokens`]).
///
/// # Errors
/// [`crate::Error::Invalid`] naming the first offending argument.
pub(crate) fn plan_across(req: &FusedRequest, facts: &DeviceFacts) -> Result<Option<AcrossPlan>> {
    let (cfg, dtype) = (&req.rope.config, req.rope.dtype);
    let es = dtype.size();
    if cfg.direction() != Direction::Forward
        || cfg.rotary_dim() != cfg.head_dim()
        || cfg.rotary_offset() != 0
    {
        return Err(invalid(
            "config",
            format!(
                "a norm across heads takes a forward whole-head rotation (rotary_dim {} of \
                 head_dim {} at offset {}, {:?})",
                cfg.rotary_dim(),
                cfg.head_dim(),
                cfg.rotary_offset(),
                cfg.direction()
            ),
        ));
    }
    if req.cache.is_some() || req.v.is_some() {
        return Err(invalid(
            "cache",
            "a norm across heads writes q and k only: no cache or v",
        ));
    }
    if req.nope.q.is_some() || req.nope.k.is_some() || req.nope.cached.is_some() {
        return Err(invalid(
            "q",
            "a norm across heads takes no non-rotary parts (the whole head rotates)",
        ));
    }
    let Some(k_req) = req.rope.k else {
        return Err(invalid("k", "a fused launch needs k"));
    };
    if !req.k_written {
        return Err(invalid("k", "a norm across heads writes k to its output"));
    }
    let regions = check_fused_tensors(req, &k_req)?;
    check_overlaps(&regions, req.rope.packed)?;
    let q = &req.rope.q.x_layout;
    let k = &k_req.x_layout;
    let tokens = (q.batch as u64)
        .checked_mul(q.seq as u64)
        .ok_or_else(|| invalid("q", "batch * seq overflows u64"))?;
    // One block column per token.
    if tokens > i32::MAX as u64 {
        return Err(invalid(
            "q",
            format!("{tokens} tokens: a norm across heads takes fewer than 2^31"),
        ));
    }
    let spans = [
        ("q", Some(*q)),
        ("q.output", req.rope.q.out.map(|(_, l)| l)),
        ("k", Some(*k)),
        ("k.output", k_req.out.map(|(_, l)| l)),
    ];
    spans_below_2_32(&spans, "a norm across heads")?;
    let seq = u32::try_from(q.seq).map_err(|_| invalid("q", "seq exceeds u32::MAX"))?;
    let empty = tokens == 0 || q.heads + k.heads == 0;
    let positions = req.rope.positions.check(q.batch, q.seq, cfg.half())?;
    let sincos = req
        .rope
        .sincos
        .check(cfg, dtype, positions.max_implicit.filter(|_| !empty))?;
    // Outputs in FP8 count bytes.
    let out_size = |fp8: bool| if fp8 { 1 } else { es };
    let layouts: Vec<_> = [
        Some((req.rope.q.x.ptr, *q, es)),
        Some((k_req.x.ptr, *k, es)),
        req.rope
            .q
            .out
            .map(|(b, l)| (b.ptr, l, out_size(req.q_fp8.is_some()))),
        k_req
            .out
            .map(|(b, l)| (b.ptr, l, out_size(req.k_fp8.is_some()))),
    ]
    .into_iter()
    .flatten()
    .collect();
    let weights = req
        .norm
        .map_or(Vec::new(), |n| vec![n.q_weight.ptr, n.k_weight.ptr]);
    let (lanes, groups) = access((cfg, dtype), (&layouts, &weights), "a norm across heads")?;
    let half = cfg.half();
    // A tensor's heads: warps of `32 / threads_per_head` slots, or segments of
    // `threads_per_head / 32` warps, each taking `token_warps_heads_per_thread` consecutive
    // heads; a block holds them and at least the `half` threads that find the token's
    // cos/sin, within the shared buffer.
    let threads_per_head = groups.next_power_of_two();
    let per_thread = token_warps_heads_per_thread(es);
    let (per_warp, head_warps) = if threads_per_head <= 32 {
        (32 / threads_per_head * per_thread, 1)
    } else {
        (per_thread, threads_per_head / 32)
    };
    let (q_warps, k_warps) = (
        (q.heads as u32).div_ceil(per_warp) * head_warps,
        (k.heads as u32).div_ceil(per_warp) * head_warps,
    );
    // A block per token holding both tensors' warps where they fit, else one per tensor.
    let fits = |warps: u32| {
        let threads = (warps * 32).max(half.next_multiple_of(32));
        (threads <= NORM_ACROSS_MAX_THREADS && 2 * half + threads / 32 <= SHARED_BUFFER_F32)
            .then_some(threads)
    };
    let both = fits(q_warps + k_warps).map(|threads| (1, threads));
    let Some((rows, threads)) = both.or_else(|| fits(q_warps.max(k_warps)).map(|t| (2, t))) else {
        return Err(invalid(
            "q",
            format!(
                "{} q and {} k heads of {}: a norm across heads holds a tensor's heads in one \
                 block of at most {NORM_ACROSS_MAX_THREADS} threads, {per_warp} heads in {head_warps} \
                 warp(s)",
                q.heads,
                k.heads,
                cfg.head_dim()
            ),
        ));
    };
    if empty {
        return Ok(None);
    }
    let (Some(seq), Some(segment)) = (NonZeroU32::new(seq), NonZeroU32::new(threads_per_head))
    else {
        return Ok(None);
    };
    let kernel = NormAcrossKernelName {
        style: cfg.style(),
        source: sincos.source,
        dtype,
    };
    let head_bytes = u64::from(cfg.head_dim()) * es as u64;
    Ok(Some(AcrossPlan {
        kernel,
        grid: Grid {
            config: LaunchConfig {
                grid_dim: (tokens as u32, rows, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            },
            heads_per_chunk: per_warp,
            seq: Divisor::new(seq),
            groups: Divisor::new(segment),
        },
        lanes,
        groups,
        tokens,
        positions,
        sincos,
        prefetch_tokens: prefetch_tokens(facts, (q.heads + k.heads) as u32, head_bytes),
    }))
}

/// The kernel's arguments from a validated request, its plan and its RoPE arguments.
fn encode(req: &FusedRequest, plan: &AcrossPlan, rope: RopeArgs) -> NormAcrossArgs {
    let (out0, out1) = output_addresses(req, &rope);
    let [q_scale, k_scale, _]: [ScaleArg; 3] = scale_args(req);
    let (norm, q_weight, k_weight, eps) = match req.norm {
        Some(n) => (n.code as u32, n.q_weight.ptr, n.k_weight.ptr, n.eps),
        None => (0, 0, 0, 0.0),
    };
    macro_rules! with_rope {
        ({ $r:ident } $($param:ident: $kind:ident,)*) => {
            NormAcrossArgs {
                $($param: $r.$param,)*
                norm,
                q_norm_weight: q_weight,
                k_norm_weight: k_weight,
                norm_eps: eps,
                prefetch_tokens: plan.prefetch_tokens,
                q_format: format_code(req.q_fp8.map(|f| f.format)),
                q_scale: q_scale.0,
                q_scale_step: q_scale.1,
                q_multiplier: q_scale.2,
                k_format: format_code(req.k_fp8.map(|f| f.format)),
                k_scale: k_scale.0,
                k_scale_step: k_scale.1,
                k_multiplier: k_scale.2,
            }
        };
    }
    let mut args = rope_kernels::rope_kernel_params!(with_rope { rope });
    (args.out0, args.out1) = (out0, out1);
    args
}

impl Rope {
    /// Plans, encodes and launches an across-heads request on `stream`.
    ///
    /// # Safety
    /// Every address of `req` is device memory of this context holding the length given,
    /// alive and not used by others until the kernel has finished on `stream`, a live stream
    /// of this context.
    pub(crate) unsafe fn launch_across(
        &self,
        req: &FusedRequest,
        stream: CUstream,
        on: FreqUse,
    ) -> Result<()> {
        let Some(plan) = plan_across(req, &self.facts)? else {
            return Ok(());
        };
        let work = Work {
            grid: &plan.grid,
            tokens: plan.tokens,
            rot_groups: plan.groups,
            lanes: plan.lanes,
        };
        let plans = (&plan.positions, &plan.sincos);
        let args = encode(req, &plan, self.rope_args(&req.rope, &work, plans, on)?);
        let function = self.module.function(plan.kernel.symbol())?;
        let (context, overlap) = (
            self.stream.context(),
            self.overlap_for(plan.kernel.symbol()),
        );
        // SAFETY: `NormAcrossArgs` comes from `norm_across_kernel_params!`, the entry points'
        // list. The plan proved what their `# Safety` asks: every tensor, output, weight and
        // scale holds what its layout and the kernel address (weights of `heads * head_dim`),
        // written regions overlap nothing else, pointers and strides are aligned to `lanes`
        // (outputs in FP8 in bytes), the whole head rotates forward with `rot_groups = half /
        // pairs` threads in segments of the power of two at or above it, at most 32,
        // `heads_per_chunk` their slots per warp times `token_warps_heads_per_thread` (or 64
        // or 128 groups in segments of whole warps, `heads_per_chunk` the heads of one); a grid of
        // `(tokens, 1)` blocks holding both tensors' warps or `(tokens, 2)` holding each
        // tensor's, whole warps, at least `half` threads and at most
        // `NORM_ACROSS_MAX_THREADS`, within the shared buffer; positions and
        // sin/cos as for `Rope::run`. The function was loaded in this context; with
        // programmatic overlap it comes from the sm_90 build (`overlap_for`).
        unsafe { args.launch(context, &function, plan.grid.config, stream, overlap) }
    }
}
