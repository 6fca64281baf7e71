//! The plan step of a backward launch, pure so that it is tested without a GPU: validation of
//! the gradients, the forward inputs, the weight gradients and the workspace (beside the fused
//! launches' own checks of the tensors, the norm and the options), the access width and the
//! grid.

use std::num::NonZeroU32;

use cudarc::driver::LaunchConfig;
use rope_kernels::abi::{
    Direction, NORM_GRAD_MAX_THREADS, NORM_GRAD_SEGMENT_HEADS_PER_THREAD, NormGradKernelName,
    SHARED_BUFFER_F32, token_warps_heads_per_thread,
};
use rope_kernels::divide::Divisor;

use super::super::tensors::check_fused_tensors;
use super::super::warps::{access, spans_below_2_32};
use super::GradRequest;
use crate::check::{Of, Region, check_overlaps, region, same_dims};
use crate::device::DeviceFacts;
use crate::error::{Result, invalid};
use crate::plan::Grid;
use crate::positions::PositionsPlan;
use crate::sincos::SinCosPlan;

/// Everything a backward launch needs except the device pointers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GradPlan {
    pub(crate) kernel: NormGradKernelName,
    pub(crate) grid: Grid,
    pub(crate) lanes: u32,
    /// Threads holding one head's pairs, `half / pairs` (in a segment of the grid's `groups`,
    /// the power of two at or above it).
    pub(crate) groups: u32,
    pub(crate) tokens: u64,
    pub(crate) positions: PositionsPlan,
    pub(crate) sincos: SinCosPlan,
    /// Warps of q's heads in each token's sequence of warps (k's follow).
    pub(crate) q_warps: u32,
    /// Blocks of the grid: each writes a row of q's weight sums and one of k's.
    pub(crate) blocks: u32,
}

/// The most blocks a backward grid of `heads` q and k heads takes: a full complement of the
/// smallest blocks (one warp) on every multiprocessor, or one per head where that is more (a
/// token's sequence of warps has at most one warp per head).
pub(crate) fn max_grad_blocks(facts: &DeviceFacts, heads: usize) -> usize {
    let full = facts.sm_count as usize * (facts.threads_per_sm / 32) as usize;
    full.max(heads)
}

/// Validates a backward request and computes its launch: `None` when there is nothing to do.
/// `blocks_per_sm(kernel, threads)` is the driver's occupancy for blocks of `threads`.
///
/// # Errors
/// [`crate::Error::Invalid`] naming the first offending argument.
pub(crate) fn plan_grad(
    req: &GradRequest,
    facts: &DeviceFacts,
    blocks_per_sm: &dyn Fn(NormGradKernelName, u32) -> u32,
) -> Result<Option<GradPlan>> {
    let fused = &req.fused;
    let (cfg, dtype) = (&fused.rope.config, fused.rope.dtype);
    let es = dtype.size();
    if cfg.direction() != Direction::Forward
        || cfg.rotary_dim() != cfg.head_dim()
        || cfg.rotary_offset() != 0
    {
        return Err(invalid(
            "config",
            format!(
                "the fused backward takes the forward step of a whole-head rotation \
                 (rotary_dim {} of head_dim {} at offset {}, {:?})",
                cfg.rotary_dim(),
                cfg.head_dim(),
                cfg.rotary_offset(),
                cfg.direction()
            ),
        ));
    }
    if req.norm.across_heads() {
        return Err(invalid(
            "norm.scope",
            "the fused backward takes a per-head norm (NormScope::PerHead)",
        ));
    }
    let Some(k_req) = fused.rope.k else {
        return Err(invalid("k", "the fused backward needs k"));
    };
    let mut regions = check_fused_tensors(fused, &k_req)?;
    let (q, k) = (&fused.rope.q.x_layout, &k_req.x_layout);
    for (name, (buf, l), grad) in [("q_input", req.q_input, q), ("k_input", req.k_input, k)] {
        same_dims(name, &l, grad)?;
        regions.push(region((name, Of::Read), buf, &l, cfg, (es, false))?);
    }
    for (name, w) in [("q_weight", req.q_weight), ("k_weight", req.k_weight)] {
        if w.len != cfg.head_dim() as usize {
            return Err(invalid(
                name,
                format!(
                    "holds {} elements, needs head_dim {}",
                    w.len,
                    cfg.head_dim()
                ),
            ));
        }
        regions.push(written(name, (w.ptr, (w.len * es) as u64)));
    }
    let tokens = (q.batch as u64)
        .checked_mul(q.seq as u64)
        .ok_or_else(|| invalid("q", "batch * seq overflows u64"))?;
    // The kernels index tokens and elements in 32 bits.
    if tokens > u64::from(u32::MAX) {
        return Err(invalid(
            "q",
            format!("{tokens} tokens: the fused backward takes fewer than 2^32"),
        ));
    }
    let q_req = &fused.rope.q;
    let spans = [
        ("q", Some(q_req.x_layout)),
        ("q.output", q_req.out.map(|(_, l)| l)),
        ("k", Some(k_req.x_layout)),
        ("k.output", k_req.out.map(|(_, l)| l)),
        ("q_input", Some(req.q_input.1)),
        ("k_input", Some(req.k_input.1)),
    ];
    spans_below_2_32(&spans, "the fused backward")?;
    let seq = u32::try_from(q.seq).map_err(|_| invalid("q", "seq exceeds u32::MAX"))?;
    let heads = q.heads + k.heads;
    let empty = tokens == 0 || heads == 0;
    let positions = fused.rope.positions.check(q.batch, q.seq, cfg.half())?;
    let sincos = fused
        .rope
        .sincos
        .check(cfg, dtype, positions.max_implicit.filter(|_| !empty))?;
    let es_of = |(buf, l): (crate::bind::RawBuf, crate::layout::Layout)| (buf.ptr, l, es);
    let layouts: Vec<_> = [
        Some((fused.rope.q.x, fused.rope.q.x_layout)),
        Some((k_req.x, k_req.x_layout)),
        fused.rope.q.out,
        k_req.out,
        Some(req.q_input),
        Some(req.k_input),
    ]
    .into_iter()
    .flatten()
    .map(es_of)
    .collect();
    let weights = fused
        .norm
        .map_or(Vec::new(), |n| vec![n.q_weight.ptr, n.k_weight.ptr]);
    let (lanes, groups) = access((cfg, dtype), (&layouts, &weights), "the fused backward")?;
    // A head's threads: a warp segment of a power of two, the lanes past `groups` idle, or a
    // segment of `segment` whole warps (64 or 128 groups).
    let threads_per_head = groups.next_power_of_two();
    let segment = threads_per_head.div_ceil(32);
    // Each token's threads form a sequence of warps, q's then k's: a warp's slots of
    // `threads_per_head` lanes (or a segment of warps), each taking
    // `token_warps_heads_per_thread` consecutive heads. Block `(bx, by)` takes warps `bx *
    // warps ..` of the sequence of tokens `by`, then a grid's worth further each. Its threads
    // find each token's `half` cos/sin pairs: within a warp, one each, so it holds at least
    // `half` threads, and the shared buffer takes two tokens' pairs; across warps, a segment's
    // thread each its own pairs', one head a thread, and the buffer takes two tokens' `2 U`
    // sums of each warp, the block holding whole segments. The buffer then takes q's and k's
    // weight sums.
    let head_dim = cfg.head_dim();
    let half = cfg.half();
    let per_thread = if segment == 1 {
        token_warps_heads_per_thread(es)
    } else {
        NORM_GRAD_SEGMENT_HEADS_PER_THREAD
    };
    let most = NORM_GRAD_MAX_THREADS / 32;
    let sums = 2 * 2 * per_thread * (most / segment * segment);
    if 2 * head_dim > SHARED_BUFFER_F32
        || (segment == 1 && half > NORM_GRAD_MAX_THREADS)
        || (segment > 1 && sums > SHARED_BUFFER_F32)
    {
        return Err(invalid(
            "config",
            format!("head_dim {head_dim} is wider than the fused backward's sums take"),
        ));
    }
    // The heads of a warp's slots, or of a segment of `segment` warps.
    let per_warp = if segment == 1 {
        32 / threads_per_head * per_thread
    } else {
        per_thread
    };
    let tensor_warps = |heads: usize| (heads as u32).div_ceil(per_warp) * segment;
    let q_warps = tensor_warps(q.heads);
    let sequence = q_warps + tensor_warps(k.heads);
    let warps = if segment == 1 {
        sequence.clamp(1, most).max(half.div_ceil(32))
    } else {
        sequence.min(most / segment * segment)
    };
    let columns = sequence.div_ceil(warps).max(1);
    let kernel = NormGradKernelName {
        style: cfg.style(),
        source: sincos.source,
        dtype,
    };
    let threads = warps * 32;
    let resident = facts
        .sm_count
        .saturating_mul(blocks_per_sm(kernel, threads).max(1));
    // One wave of blocks, but no block row without a token.
    let rows = u64::from((resident / columns).max(1)).min(tokens.max(1)) as u32;
    let blocks = columns * rows;
    let need = 2 * u64::from(blocks) * u64::from(head_dim);
    if (req.workspace.len as u64) < need {
        return Err(invalid(
            "workspace",
            format!(
                "holds {} f32, this launch needs {need} (Rope::fused_backward_workspace)",
                req.workspace.len
            ),
        ));
    }
    regions.push(written("workspace", (req.workspace.ptr, need * 4)));
    check_overlaps(&regions, false)?;
    if empty {
        return Ok(None);
    }
    let (Some(seq), Some(segment)) = (NonZeroU32::new(seq), NonZeroU32::new(threads_per_head))
    else {
        return Ok(None);
    };
    Ok(Some(GradPlan {
        kernel,
        grid: Grid {
            config: LaunchConfig {
                grid_dim: (columns, rows, 1),
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
        q_warps,
        blocks,
    }))
}

/// A written array of `bytes` at `ptr`.
fn written(name: &'static str, (ptr, bytes): (u64, u64)) -> Region {
    Region {
        start: ptr as u128,
        end: ptr as u128 + bytes as u128,
        written: true,
        name,
        of: Of::Read,
    }
}
