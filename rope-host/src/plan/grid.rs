//! The launch grid: how a launch's work items and heads map onto blocks.

use std::num::NonZeroU32;

use cudarc::driver::LaunchConfig;
use rope_kernels::abi::{BLOCK_THREADS, TOKEN_HEADS_MAX_WARPS};
use rope_kernels::divide::Divisor;

use crate::device::DeviceFacts;
use crate::error::{Result, invalid};

/// The grid of a launch, the heads each `blockIdx.y` handles and the divisors that split a
/// work item's index into token and group, and a token into batch row and sequence index.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grid {
    pub(crate) config: LaunchConfig,
    pub(crate) heads_per_chunk: u32,
    pub(crate) seq: Divisor,
    pub(crate) groups: Divisor,
}

/// Chooses the grid: `items = tokens * groups` work items on `blockIdx.x` in blocks of
/// [`BLOCK_THREADS`], and heads split over `blockIdx.y` only as far as needed to give every
/// multiprocessor a full complement of threads (so sin/cos are reused across as many heads as
/// possible), or up to two chunks further when that splits the heads equally, taking of those
/// equal splits the one whose last wave of blocks (`sm_count * blocks_per_sm` blocks run at
/// once) is fullest, fewer chunks on a tie.
///
/// Ragged chunks (32 heads as 11, 11, 10) leave blocks of unequal work and slow both sin/cos
/// paths; a last wave that is mostly empty slows them more (so the 40 heads of a prefill go as
/// 5 x 8, whose blocks fill their last wave better than 4 x 10's); and each further chunk costs
/// the in-kernel path one more sin/cos evaluation per item, which is why the search stops two
/// chunks out: 32 heads go as 7, 7, 7, 7, 4, where 8 x 4 was slower (docs/perf/decisions.md).
/// `gridDim.y <= 65535` and `gridDim.x <= 2^31 - 1` always hold: the kernel's grid-stride loop
/// covers any remainder.
///
/// # Errors
/// [`crate::Error::Invalid`] naming `layout` when `tokens * groups` overflows `u64`.
pub(crate) fn grid(
    (tokens, seq): (u64, u32),
    groups: u32,
    heads: u32,
    facts: &DeviceFacts,
    blocks_per_sm: u32,
) -> Result<Option<Grid>> {
    const MAX_GRID_X: u64 = i32::MAX as u64;
    const MAX_GRID_Y: u64 = 65_535;
    let (Some(seq), Some(groups_nz)) = (NonZeroU32::new(seq), NonZeroU32::new(groups)) else {
        return Ok(None);
    };
    if tokens == 0 || heads == 0 {
        return Ok(None);
    }
    let items = tokens
        .checked_mul(groups as u64)
        .ok_or_else(|| invalid("layout", "batch * seq * head_dim overflows u64"))?;
    let heads = heads as u64;
    let blocks_x = items.div_ceil(BLOCK_THREADS as u64).min(MAX_GRID_X);
    let sm_count = facts.sm_count.max(1) as u64;
    let resident = sm_count * facts.threads_per_sm.max(1) as u64;
    let max_chunks = heads.min(MAX_GRID_Y);
    let wanted = resident.div_ceil(items).clamp(1, max_chunks);
    let slots = sm_count * blocks_per_sm.max(1) as u64;
    // (blocks, the slots of the waves they occupy): the first over the second is how full the
    // waves are. Both stay below 2^48, so the cross products fit in u128.
    let fill = |chunks: u64| {
        let blocks = blocks_x * chunks;
        (blocks as u128, (blocks.div_ceil(slots) * slots) as u128)
    };
    let mut equal: Option<u64> = None;
    for c in (wanted..=(wanted + 2).min(max_chunks)).filter(|c| heads.is_multiple_of(*c)) {
        let (blocks, room) = fill(c);
        if equal.is_none_or(|best| {
            let (best_blocks, best_room) = fill(best);
            blocks * best_room > best_blocks * room
        }) {
            equal = Some(c);
        }
    }
    let heads_per_chunk = heads.div_ceil(equal.unwrap_or(wanted));
    let chunks = heads.div_ceil(heads_per_chunk);
    Ok(Some(Grid {
        config: LaunchConfig {
            grid_dim: (blocks_x as u32, chunks as u32, 1),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        },
        heads_per_chunk: heads_per_chunk as u32,
        seq: Divisor::new(seq),
        groups: Divisor::new(groups_nz),
    }))
}

/// Warps a tensor of `heads` heads of `groups` accesses takes per token in the fused
/// token-heads grid ([`fused_grid`]): a thread per `thread_heads` heads and group, in warps of
/// that tensor alone. Callers keep `heads * groups` within `u32`.
pub(crate) fn token_heads_warps(heads: u32, groups: u32, thread_heads: u32) -> u32 {
    (heads.div_ceil(thread_heads) * groups).div_ceil(32)
}

/// The grid of the fused token-heads kernels ([`rope_kernels::abi::Mapping::TokenHeads`]): one
/// block row per token (`blockIdx.z * gridDim.y + blockIdx.y`, `gridDim.y` at most 65535), and on
/// `blockIdx.x` the token's sequence of `warps` (q's, k's, v's: see [`token_heads_warps`]) cut
/// into the fewest equal blocks of at most [`TOKEN_HEADS_MAX_WARPS`] warps, so that a block's
/// cos/sin arithmetic serves as many heads as it can, each block a whole number of segments of
/// `segment_warps` warps (a norm summed across warps: each tensor's warps are a multiple of it;
/// 1 otherwise). `heads_per_chunk` is 0 (the token-heads kernels do not read it).
///
/// # Errors
/// [`crate::Error::Invalid`] naming `q` when the tokens exceed `65535^2`, or a token's warps
/// times 32 exceed `u32::MAX` (the kernels index a tensor's threads in `u32`).
pub(crate) fn fused_grid(
    (tokens, seq): (u64, u32),
    groups: u32,
    warps: [u32; 3],
    segment_warps: u32,
) -> Result<Option<Grid>> {
    const MAX_GRID_YZ: u64 = 65_535;
    let (Some(seq), Some(groups_nz)) = (NonZeroU32::new(seq), NonZeroU32::new(groups)) else {
        return Ok(None);
    };
    let all: u64 = warps.iter().map(|&w| u64::from(w)).sum();
    if tokens == 0 || all == 0 {
        return Ok(None);
    }
    if all * 32 > u64::from(u32::MAX) {
        return Err(invalid(
            "q",
            format!(
                "{all} warps per token are more than the fused kernels index ({})",
                u32::MAX / 32
            ),
        ));
    }
    if tokens > MAX_GRID_YZ * MAX_GRID_YZ {
        return Err(invalid(
            "q",
            format!(
                "{tokens} tokens are more than a fused launch's grid holds ({})",
                MAX_GRID_YZ * MAX_GRID_YZ
            ),
        ));
    }
    let segment = u64::from(segment_warps.clamp(1, TOKEN_HEADS_MAX_WARPS));
    let segments = all.div_ceil(segment);
    let blocks = segments.div_ceil(u64::from(TOKEN_HEADS_MAX_WARPS) / segment);
    let threads = (segments.div_ceil(blocks) * segment) as u32 * 32;
    let rows = tokens.min(MAX_GRID_YZ);
    Ok(Some(Grid {
        config: LaunchConfig {
            grid_dim: (blocks as u32, rows as u32, tokens.div_ceil(rows) as u32),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        },
        heads_per_chunk: 0,
        seq: Divisor::new(seq),
        groups: Divisor::new(groups_nz),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An H200: 132 multiprocessors of 2048 threads.
    const H200: DeviceFacts = DeviceFacts {
        sm_count: 132,
        threads_per_sm: 2048,
        dram_gb_per_s: 4915,
    };

    /// The grid of `tokens` tokens (one sequence row each) on an H200: 132 multiprocessors
    /// holding `blocks_per_sm` blocks each.
    fn h200_grid(tokens: u64, groups: u32, heads: u32, blocks_per_sm: u32) -> Grid {
        grid((tokens, 1), groups, heads, &H200, blocks_per_sm)
            .expect("no overflow")
            .expect("non-empty")
    }

    #[test]
    fn grid_respects_hardware_limits_for_huge_problems() {
        for (tokens, groups, heads) in [
            (1u64 << 20, 16u32, 32u32),
            (1 << 40, 1, 1),
            (1, 1, 100_000),
            (64, 16, 4096),
        ] {
            let g = h200_grid(tokens, groups, heads, 8);
            let (x, y, z) = g.config.grid_dim;
            assert!(x >= 1 && x as u64 <= i32::MAX as u64);
            assert!((1..=65_535).contains(&y) && z == 1);
            assert!(g.config.block_dim.0 <= 1024);
            // Every head is covered, and no chunk starts past the last head.
            assert!(y as u64 * g.heads_per_chunk as u64 >= heads as u64);
            assert!(((y - 1) as u64 * g.heads_per_chunk as u64) < heads as u64);
            assert_eq!(g.groups.divisor.get(), groups);
        }
    }

    #[test]
    fn grid_is_empty_without_tokens_heads_or_groups() {
        for (tokens, seq, groups, heads) in [(0, 1, 16, 32), (64, 0, 16, 32), (64, 64, 0, 32)] {
            assert!(
                grid((tokens, seq), groups, heads, &H200, 8)
                    .expect("fits")
                    .is_none()
            );
        }
        assert!(grid((64, 64), 16, 0, &H200, 8).expect("fits").is_none());
    }

    #[test]
    fn grid_keeps_all_heads_in_one_chunk_when_tokens_fill_the_gpu() {
        let g = h200_grid(8192 * 4, 16, 32, 8);
        assert_eq!(g.config.grid_dim.1, 1);
        assert_eq!(g.heads_per_chunk, 32);
    }

    #[test]
    fn grid_splits_heads_equally_with_the_fullest_last_wave() {
        // 8192 tokens of 16 items (1024 blocks of 128) want 3 chunks. With 10 blocks per SM
        // (1320 run at once): 32 heads go as 4 x 8, their only equal split in 3..=5; 40 heads as
        // 5 x 8, whose 5120 blocks fill 4 waves to 97%, where 4 x 10 fills them to 78%; 48 heads
        // as 3 x 16, which fills its waves as well as 4 x 12 does, with fewer chunks.
        for (heads, chunks, per_chunk) in [(32, 4, 8), (40, 5, 8), (48, 3, 16)] {
            let g = h200_grid(8192, 16, heads, 10);
            assert_eq!(
                (g.config.grid_dim.1, g.heads_per_chunk),
                (chunks, per_chunk),
                "{heads} heads"
            );
        }
        // With 8 blocks per SM (1056 at once) 4 x 10 and 5 x 8 fill their waves equally: 4 x 10.
        let g = h200_grid(8192, 16, 40, 8);
        assert_eq!((g.config.grid_dim.1, g.heads_per_chunk), (4, 10));
        // 37 heads (prime) have no divisor in 3..=5: ragged chunks of 13, 13, 11.
        let g = h200_grid(8192, 16, 37, 10);
        assert_eq!((g.config.grid_dim.1, g.heads_per_chunk), (3, 13));
        // 8 items per token want 5 chunks: 32 heads stay 7, 7, 7, 7, 4 rather than 8 x 4.
        let g = h200_grid(8192, 8, 32, 10);
        assert_eq!((g.config.grid_dim.1, g.heads_per_chunk), (5, 7));
    }

    #[test]
    fn grid_splits_heads_for_decode() {
        let g = h200_grid(64, 16, 32, 8);
        assert!(g.config.grid_dim.1 > 1);
    }

    #[test]
    fn grid_splits_heads_further_on_devices_with_more_threads_per_sm() {
        // 8192 tokens of 16 items fill 2048-thread SMs in 3 chunks (32 heads as 4 x 8 with 10
        // blocks per SM); with 1536 threads per SM two suffice, as 2 x 16.
        let sm86 = DeviceFacts {
            sm_count: 132,
            threads_per_sm: 1536,
            ..H200
        };
        let g = grid((8192, 1), 16, 32, &sm86, 10)
            .expect("fits")
            .expect("non-empty");
        assert_eq!((g.config.grid_dim.1, g.heads_per_chunk), (2, 16));
    }

    /// The token-heads grid of `tokens` tokens and `warps`: its grid and block dimensions.
    fn token_heads(tokens: u64, warps: [u32; 3]) -> ((u32, u32, u32), u32) {
        let g = fused_grid((tokens, 1), 16, warps, 1)
            .expect("fits")
            .expect("non-empty");
        (g.config.grid_dim, g.config.block_dim.0)
    }

    /// A token's warps are cut into the fewest equal blocks of at most `TOKEN_HEADS_MAX_WARPS`
    /// warps; a tensor may share a block with another (each warp holds one tensor's threads).
    #[test]
    fn fused_grid_cuts_each_tokens_warps_into_the_fewest_equal_blocks() {
        let max = TOKEN_HEADS_MAX_WARPS;
        for warps in [[8u32, 2, 2], [1, 1, 0], [16, 4, 4], [40, 8, 8], [3, 0, 0]] {
            let all: u32 = warps.iter().sum();
            let ((x, _, _), threads) = token_heads(64, warps);
            assert_eq!(x, all.div_ceil(max));
            assert!(threads % 32 == 0 && threads / 32 <= max);
            // Equal blocks: the last holds fewer warps than the others by less than a warp
            // per block.
            assert!(x * threads / 32 >= all && (x * threads / 32) - all < x);
        }
    }

    /// A norm summed across `segment` warps: every block holds whole segments (a multiple of
    /// `segment` warps, at most `TOKEN_HEADS_MAX_WARPS`), so no segment straddles two blocks.
    #[test]
    fn fused_grid_keeps_each_segment_of_warps_in_one_block() {
        for segment in [2u32, 4] {
            for warps in [
                [16u32, 4, 4],
                [4, 2, 2],
                [2 * segment, segment, 0],
                [64, 8, 8],
            ] {
                let warps = warps.map(|w| w.next_multiple_of(segment));
                let all: u32 = warps.iter().sum();
                let g = fused_grid((64, 1), 32 * segment, warps, segment)
                    .expect("fits")
                    .expect("non-empty");
                let (x, threads) = (g.config.grid_dim.0, g.config.block_dim.0);
                assert_eq!(threads % (32 * segment), 0, "{segment} {warps:?}");
                assert!(threads / 32 <= TOKEN_HEADS_MAX_WARPS);
                assert!(x * threads / 32 >= all && x * threads / 32 - all < x * segment);
            }
        }
    }

    /// The fused grid gives every token a block row: `gridDim.y` up to 65535 rows, then rows of
    /// 65535 on `gridDim.z`.
    #[test]
    fn fused_grid_takes_one_block_row_per_token() {
        let rows = |tokens: u64| {
            let ((_, y, z), _) = token_heads(tokens, [8, 2, 2]);
            (y, z)
        };
        assert_eq!(rows(64), (64, 1));
        assert_eq!(rows(65_535), (65_535, 1));
        assert_eq!(rows(65_536), (65_535, 2));
        assert_eq!(rows(65_535 * 65_535), (65_535, 65_535));
        assert!(fused_grid((65_535 * 65_535 + 1, 1), 16, [8, 2, 2], 1).is_err());
        assert!(fused_grid((1, 1), 32, [u32::MAX / 32, 1, 0], 1).is_err());
    }
}
