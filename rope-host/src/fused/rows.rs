//! The rows kernels' part of a fused plan ([`Mapping::Rows`](rope_kernels::abi::Mapping::Rows);
//! their body is `rope-kernels/src/fused/rows.rs`): which launches they take, their blocks'
//! warps and shared memory, and their persistent grid.

use std::num::NonZeroU32;

use cudarc::driver::LaunchConfig;
use rope_kernels::abi::{
    FusedKernelName, ROWS_COS_SIN_BYTES, ROWS_DATA_OFFSET, ROWS_GROUPS, ROWS_HEAD_DIM,
    ROWS_HEADS_PER_STEP, ROWS_HEADS_STEPS, ROWS_MAX_STAGES, ROWS_MAX_WARPS,
};
use rope_kernels::divide::Divisor;

use super::request::FusedRequest;
use crate::bind::RawBuf;
use crate::device::DeviceFacts;
use crate::error::Result;
use crate::layout::Layout;
use crate::plan::Grid;
use crate::tuning::{FusedKernels, ROWS_MIN_DRAM_GB_PER_S, ROWS_STAGES};

/// Blocks of a rows kernel of the given launch that one multiprocessor holds at once (the
/// driver's occupancy for its threads and dynamic shared memory). The planner takes one where
/// the rows kernels run: where the kernels come from the sm_90 build.
pub(crate) type RowsOccupancy<'a> = &'a dyn Fn(FusedKernelName, &RowsLaunch) -> Result<u32>;

/// A rows kernel's launch ([`Mapping::Rows`](rope_kernels::abi::Mapping::Rows)): warps per block
/// of q's, k's and v's heads, the block's threads and its dynamic shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowsLaunch {
    pub(crate) warps: [u32; 3],
    pub(crate) threads: u32,
    pub(crate) shared_bytes: u32,
}

/// Shared memory a block may take without asking the driver for more (48 KiB).
const ROWS_MAX_SHARED: u64 = 48 * 1024;

/// The rows kernels' launch for `req` with up to `stages` token buffers (each a token's rows and
/// [`ROWS_COS_SIN_BYTES`]; fewer where they do not fit the block's shared memory after
/// [`ROWS_DATA_OFFSET`]; at least two), or `None` when
/// they cannot serve it: heads of [`ROWS_HEAD_DIM`] elements in `groups = rot_groups =`
/// [`ROWS_GROUPS`] accesses, and each of the `stored` tensors' (q, k, v) heads of a token one
/// contiguous, 16-byte aligned row (heads `head_dim` elements apart, the tensor's address and
/// batch and seq strides multiples of 16 bytes). A block holds the warps of the stored heads
/// and one more, which brings the rows and finds cos/sin.
fn rows_launch(
    req: &FusedRequest,
    (groups, rot_groups): (u32, u32),
    stored: [u32; 3],
    stages: u32,
) -> Option<RowsLaunch> {
    let head_dim = req.rope.config.head_dim();
    if head_dim != ROWS_HEAD_DIM || groups != ROWS_GROUPS || rot_groups != ROWS_GROUPS {
        return None;
    }
    let es = req.rope.dtype.size() as u64;
    let k = req.rope.k?;
    let inputs = [
        Some((req.rope.q.x, req.rope.q.x_layout)),
        Some((k.x, k.x_layout)),
        req.v,
    ];
    let row_ok = |(buf, l): (RawBuf, Layout)| {
        let start = buf.ptr.wrapping_add(l.offset as u64 * es);
        let strided = |n: usize, stride: usize| n <= 1 || (stride as u64 * es).is_multiple_of(16);
        start.is_multiple_of(16)
            && l.strides[2] == l.head_dim
            && strided(l.batch, l.strides[0])
            && strided(l.seq, l.strides[1])
    };
    let heads_per_warp = ROWS_HEADS_PER_STEP * ROWS_HEADS_STEPS;
    let mut warps = [0; 3];
    let mut row = 0u64;
    for ((w, &heads), input) in warps.iter_mut().zip(&stored).zip(inputs) {
        if heads == 0 {
            continue;
        }
        if !row_ok(input?) {
            return None;
        }
        *w = heads.div_ceil(heads_per_warp);
        row += u64::from(heads) * u64::from(head_dim) * es;
    }
    let all = warps.iter().sum::<u32>() + 1;
    // Each buffer holds a token's rows and its cos/sin.
    let buffer = row + u64::from(ROWS_COS_SIN_BYTES);
    let fit = (ROWS_MAX_SHARED - u64::from(ROWS_DATA_OFFSET)) / buffer;
    let stages = u64::from(stages.clamp(2, ROWS_MAX_STAGES)).min(fit);
    (all <= ROWS_MAX_WARPS && stages >= 2).then_some(RowsLaunch {
        warps,
        threads: 32 * all,
        shared_bytes: (u64::from(ROWS_DATA_OFFSET) + stages * buffer) as u32,
    })
}

/// The rows kernel and launch that take `req` of the two-heads `kernel`, if any: every launch
/// they can serve ([`rows_launch`]) when `choice` pins them, and under [`FusedKernels::Auto`]
/// the launches the four-heads kernels would take (`four_heads`) that store FP8 (q's output or
/// the cache) on devices of at least [`ROWS_MIN_DRAM_GB_PER_S`]. A kernel of FlashInfer's forms
/// has no rows kernel ([`FusedKernelName::rows`]), so those forms never reach the rows kernels.
pub(crate) fn rows_kernel(
    req: &FusedRequest,
    kernel: FusedKernelName,
    choice: FusedKernels,
    four_heads: bool,
    facts: &DeviceFacts,
    groups: (u32, u32),
    stored: [u32; 3],
) -> Option<(FusedKernelName, RowsLaunch)> {
    let stores_fp8 = req.q_fp8.is_some() || req.cache.is_some_and(|c| c.fp8().is_some());
    let stages = match choice {
        FusedKernels::Rows { stages } => stages,
        FusedKernels::Auto
            if four_heads && stores_fp8 && facts.dram_gb_per_s >= ROWS_MIN_DRAM_GB_PER_S =>
        {
            ROWS_STAGES
        }
        _ => return None,
    };
    Some((kernel.rows()?, rows_launch(req, groups, stored, stages)?))
}

/// The persistent grid of a rows `launch` over `tokens` tokens (`seq` per batch row): the
/// `resident` blocks the device holds at once, or one per token where there are fewer, each
/// walking tokens `blockIdx.x, blockIdx.x + gridDim.x, ..`; `None` when there is nothing to
/// walk (no tokens, `seq` or `groups` 0).
pub(crate) fn rows_grid(
    launch: &RowsLaunch,
    (tokens, seq): (u64, u32),
    groups: u32,
    resident: u64,
) -> Option<Grid> {
    let (seq, groups) = (NonZeroU32::new(seq)?, NonZeroU32::new(groups)?);
    (tokens > 0).then(|| Grid {
        config: LaunchConfig {
            grid_dim: (tokens.min(resident).min(u64::from(u32::MAX)) as u32, 1, 1),
            block_dim: (launch.threads, 1, 1),
            shared_mem_bytes: launch.shared_bytes,
        },
        heads_per_chunk: 0,
        seq: Divisor::new(seq),
        groups: Divisor::new(groups),
    })
}
