//! The plan step of a fused launch, pure so that it is tested without a GPU: validation (the
//! tensors, weights, scales and cache in `tensors.rs`, then their overlaps), the options' own
//! checks, the access width, the kernel and the grid.

use std::num::NonZeroU32;

use rope_kernels::abi::{
    BLOCK_THREADS, Direction, FusedForms, FusedKernelName, MAX_FUSED_ITEMS, Mapping, ThreadHeads,
    preferred_lanes,
};
use rope_kernels::divide::Divisor;

use super::cache_checks::{block_size, cache_as_layout, cache_slots, check_address};
use super::non_rotary::{CACHE_NOPE_NAME, NopePlan, plan_nope};
use super::request::{CacheStore, FusedRequest, RawFp8, ScaleSource};
use super::rows::{RowsOccupancy, rows_grid, rows_kernel};
use super::tensors::check_fused_tensors;
use super::{Fp8Format, RawCacheAddress};
use crate::check::{check_overlaps, layout_aligned, span_below_2_32, widest_lanes};
use crate::device::DeviceFacts;
use crate::error::{Result, invalid};
use crate::plan::{Grid, TensorReq, fused_grid, grid, spans_below_2_32, token_heads_warps};
use crate::positions::PositionsPlan;
use crate::sincos::SinCosPlan;
use crate::tuning::{FusedKernels, many_waves, prefetch_tokens};

/// Everything a fused launch needs except the device pointers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedPlan {
    pub(crate) kernel: FusedKernelName,
    pub(crate) grid: Grid,
    pub(crate) lanes: u32,
    pub(crate) rot_groups: u32,
    pub(crate) tokens: u64,
    pub(crate) positions: PositionsPlan,
    pub(crate) sincos: SinCosPlan,
    /// The cache's block size (1 without a cache).
    pub(crate) block: Divisor,
    /// Slots the cache holds, `num_blocks * block_size` (0 without a cache).
    pub(crate) cache_slots: u64,
    /// The token-heads kernels' warps per token of q's, k's and v's threads (0 for the item loop,
    /// and for a tensor the launch stores nothing of).
    pub(crate) token_warps: [u32; 3],
    /// How many tokens ahead the four-heads kernels ask L2 for heads ([`prefetch_tokens`]; 0
    /// for the other kernels).
    pub(crate) prefetch_tokens: u32,
    /// The blocks of the non-rotary parts (FlashInfer's forms only).
    pub(crate) nope: Option<NopePlan>,
}

/// What a launch needs to take the token-heads kernels (`token_heads` in [`plan_fused`]), as
/// the errors of launches only they can store say it.
const TOKEN_HEADS_FIT: &str = "each tensor below 2^32 elements at the widest access (addresses \
                               and strides aligned to 16 bytes), a cache of at most 2^32 slots, \
                               and tables within 2^32 elements aligned to their reads";

/// Items of one token and head that the normalisation's warp-shuffle sum spans in every
/// kernel.
const MAX_NORM_GROUPS: u32 = 32;

/// Items of one token and head that the four-heads kernels' normalisation spans, summed
/// across the warps of a head (`warps_sum`, up to four).
const MAX_LONG_NORM_GROUPS: u32 = 128;

/// Validates a fused request and computes its launch: `None` when there is nothing to do.
/// `choice` pins the kernels for tests (see [`FusedKernels`]); `rows_occupancy` is given where
/// the rows kernels run (sm_90 builds) and says how many blocks of theirs a multiprocessor
/// holds.
///
/// # Errors
/// [`crate::Error::Invalid`] naming the first offending argument.
pub(crate) fn plan_fused(
    req: &FusedRequest,
    facts: &DeviceFacts,
    blocks_per_sm: &dyn Fn(FusedKernelName) -> u32,
    choice: FusedKernels,
    rows_occupancy: Option<RowsOccupancy>,
) -> Result<Option<FusedPlan>> {
    if req.norm.is_some_and(|n| n.across_heads()) {
        return Err(invalid(
            "norm.scope",
            "a norm across heads takes the across-heads kernels, which Rope::run_fused plans \
             apart (super::across)",
        ));
    }
    check_config(req)?;
    let Some(k_req) = req.rope.k else {
        return Err(invalid("k", "a fused launch needs k"));
    };
    let regions = check_fused_tensors(req, &k_req)?;
    check_overlaps(&regions, req.rope.packed)?;
    plan_checked(req, facts, blocks_per_sm, choice, rows_occupancy)
}

/// [`plan_fused`] past its checks of the tensors, weights, scales and cache and of their
/// overlaps: for a request those checks accepted, or one that holds such a request's addresses
/// and writes its regions alone (MLA's latent cache as v's heads, `super::latent`), which the
/// checks of GQA's caches would refuse for v's heads.
///
/// # Errors
/// [`crate::Error::Invalid`] naming the first offending argument.
pub(crate) fn plan_checked(
    req: &FusedRequest,
    facts: &DeviceFacts,
    blocks_per_sm: &dyn Fn(FusedKernelName) -> u32,
    choice: FusedKernels,
    rows_occupancy: Option<RowsOccupancy>,
) -> Result<Option<FusedPlan>> {
    let cfg = &req.rope.config;
    let es = req.rope.dtype.size();
    let Some(k_req) = req.rope.k else {
        return Err(invalid("k", "a fused launch needs k"));
    };
    let q = &req.rope.q.x_layout;
    let k = &k_req.x_layout;
    let seq = u32::try_from(q.seq).map_err(|_| invalid("q", "seq exceeds u32::MAX"))?;
    let heads = q.heads as u64 + k.heads as u64 + req.v.map_or(0, |(_, l)| l.heads as u64);
    if heads > u32::MAX as u64 {
        return Err(invalid(
            "k",
            "q, k and v together have more than u32::MAX heads",
        ));
    }
    let tokens = (q.batch as u64)
        .checked_mul(q.seq as u64)
        .ok_or_else(|| invalid("q", "batch * seq overflows u64"))?;
    let empty = tokens == 0 || heads == 0;
    let positions = req.rope.positions.check(q.batch, q.seq, cfg.half())?;
    let max_position = positions.max_implicit.filter(|_| !empty);
    let sincos = req.rope.sincos.check(cfg, req.rope.dtype, max_position)?;
    if let Some(c) = &req.cache {
        check_address(&c.address, tokens)?;
    }
    if empty {
        return Ok(None);
    }
    let lanes =
        widest_lanes(cfg, es, false, |lanes| aligned(req, &k_req, lanes)).ok_or_else(|| {
            invalid(
                "q",
                "interleaved pairs need every tensor address and stride aligned to two elements",
            )
        })?;
    let pairs = cfg.style().pairs_per_item(lanes);
    let rot_groups = cfg.half() / pairs;
    // A partial head's features past the rotation: groups of `2 pairs` after the rotation's
    // (the `_partial` kernels).
    let passed = cfg.head_dim() - cfg.rotary_dim();
    let partial = passed > 0;
    if !passed.is_multiple_of(2 * pairs) {
        return Err(invalid(
            "config",
            format!(
                "the {passed} features past rotary_dim {} are not whole accesses of {} (the \
                 rotated features' access at this alignment)",
                cfg.rotary_dim(),
                2 * pairs
            ),
        ));
    }
    let all_groups = rot_groups + passed / (2 * pairs);
    let groups = if req.norm.is_some() {
        let groups = all_groups.next_power_of_two();
        if groups > MAX_LONG_NORM_GROUPS {
            return Err(invalid(
                "norm",
                format!(
                    "head_dim {} takes {all_groups} accesses of {lanes} elements per head; the \
                     normalisation sums over at most {MAX_LONG_NORM_GROUPS}",
                    cfg.head_dim()
                ),
            ));
        }
        groups
    } else {
        all_groups
    };
    // A norm over more than a warp's accesses (heads of 512 16-bit elements, of 256 or 512
    // `f32`) is summed across the head's warps by the four-heads kernels alone.
    let long_norm = req.norm.is_some() && groups > MAX_NORM_GROUPS;
    let kernel = FusedKernelName {
        style: cfg.style(),
        source: sincos.source,
        dtype: req.rope.dtype,
        mapping: if lanes == preferred_lanes(cfg.style(), es) {
            Mapping::WIDE
        } else {
            Mapping::NARROW
        },
        forms: FusedForms::Plain,
    };
    let (block, cache_slots) = match &req.cache {
        Some(c) => (block_size(&c.layout)?, cache_slots(&c.layout)?),
        None => (NonZeroU32::MIN, 0),
    };
    // A launch at the preferred width whose tensors each span fewer than 2^32 elements (whose
    // cache holds at most 2^32 slots, and whose tables suit the token-heads kernels' reads: see
    // `planned_table_fits`) takes the token-heads kernels: a thread per two (or
    // four: the four-heads kernels, `many_waves`) heads and access, no head loop (at decode
    // its length is one head's chain; at prefill its many resident threads keep more loads in
    // flight than the item loop, which holds one block of heads per thread), with 32-bit
    // element offsets and slot division. Other launches take the item loop.
    //
    // FlashInfer's forms are stored by the two-heads kernels of those forms alone (in the item
    // loop and the four-heads kernels their stores made ptxas spill, and their parameters made
    // every other launch slower at decode), even where other kernels are pinned.
    let flashinfer = flashinfer_form(req);
    // NVFP4 caches are stored by four-heads kernels of their own (`_four_heads_nvfp4`): their
    // block maxima and conversions weigh on no other launch.
    let nvfp4 = req
        .cache
        .is_some_and(|c| matches!(c.store, CacheStore::Nvfp4(_)));
    // Partial heads, like FlashInfer's forms, have token-heads kernels alone.
    let token_heads =
        (choice != FusedKernels::ItemLoop || flashinfer.is_some() || partial || nvfp4 || long_norm)
            && kernel.mapping == Mapping::WIDE
            && spans_below_2_32(&req.rope)
            && req.v.is_none_or(|(_, l)| span_below_2_32(&l))
            && cache_slots <= 1 << 32
            && req.rope.sincos.planned_table_fits(&sincos, cfg, pairs);
    if let Some(arg) = flashinfer.filter(|_| !token_heads) {
        return Err(invalid(
            arg,
            format!(
                "page tables, E5M2, multipliers, FP8 k outputs and non-rotary parts are stored \
                 by the token-heads kernels alone, which this launch cannot take: \
                 {TOKEN_HEADS_FIT}"
            ),
        ));
    }
    if nvfp4 {
        if let Some(arg) = flashinfer {
            return Err(invalid(
                arg,
                "an NVFP4 cache is stored by kernels without FlashInfer's forms: no page table, \
                 E5M2, multiplier, FP8 k output or non-rotary part",
            ));
        }
        if partial {
            return Err(invalid(
                "config",
                format!(
                    "an NVFP4 cache is stored with whole-head rotations: rotary_dim {} of \
                     head_dim {}",
                    cfg.rotary_dim(),
                    cfg.head_dim()
                ),
            ));
        }
        if !token_heads {
            return Err(invalid(
                "cache",
                format!(
                    "an NVFP4 cache is stored by the four-heads kernels alone, which this launch \
                     cannot take: {TOKEN_HEADS_FIT}"
                ),
            ));
        }
    }
    if long_norm && (!token_heads || flashinfer.is_some() || partial || nvfp4) {
        return Err(invalid(
            "norm",
            format!(
                "head_dim {} takes {all_groups} accesses of {lanes} elements per head: a norm \
                 over more than {MAX_NORM_GROUPS} is summed across warps by the four-heads \
                 kernels alone, which this launch cannot take: a whole-head rotation, no NVFP4 \
                 cache, page table, E5M2, multiplier, FP8 k output or non-rotary part, \
                 {TOKEN_HEADS_FIT}",
                cfg.head_dim()
            ),
        ));
    }
    if partial && (!token_heads || flashinfer.is_some()) {
        return Err(invalid(
            "config",
            format!(
                "rotary_dim {} of head_dim {} (a partial rotation) is fused by the two-heads \
                 kernels alone, which this launch cannot take: no page table, E5M2, multiplier, \
                 FP8 k output or non-rotary part, each tensor below 2^32 elements at the widest \
                 access, a cache of at most 2^32 slots, and tables within 2^32 elements aligned \
                 to their reads",
                cfg.rotary_dim(),
                cfg.head_dim()
            ),
        ));
    }
    let kernel = FusedKernelName {
        mapping: if token_heads {
            Mapping::TWO_HEADS
        } else {
            kernel.mapping
        },
        forms: if flashinfer.is_some() {
            FusedForms::FlashInfer
        } else if nvfp4 {
            FusedForms::Nvfp4
        } else if partial {
            FusedForms::Partial
        } else if long_norm {
            FusedForms::LongNorm
        } else {
            FusedForms::Plain
        },
        ..kernel
    };
    // k's heads are stored when written back or cached; v's only with the cache.
    let k_stored = req.k_written || req.cache.is_some();
    let stored_heads = [
        q.heads as u32,
        if k_stored { k.heads as u32 } else { 0 },
        req.v
            .filter(|_| req.cache.is_some())
            .map_or(0, |(_, l)| l.heads as u32),
    ];
    let warps_at = |heads: u32| stored_heads.map(|h| token_heads_warps(h, groups, heads));
    // Only a two-heads kernel without FlashInfer's forms (of whole heads, or of partial heads of
    // 16-bit elements) has a four-heads kernel, so the item loop never takes one.
    // NVFP4 caches and norms summed across warps take their four-heads kernel whatever the
    // size or the choice.
    let four_heads = if nvfp4 || long_norm {
        Some(FusedKernelName {
            mapping: Mapping::FOUR_HEADS,
            ..kernel
        })
    } else {
        kernel.four_heads().filter(|_| match choice {
            FusedKernels::FourHeads => true,
            FusedKernels::TwoHeads => false,
            FusedKernels::Auto | FusedKernels::Rows { .. } => many_waves(
                kernel,
                facts,
                tokens,
                warps_at(ThreadHeads::Two.count()).iter().sum(),
            ),
            FusedKernels::ItemLoop => false,
        })
    };
    let rows = rows_occupancy.filter(|_| !long_norm).and_then(|occupancy| {
        let launch = rows_kernel(
            req,
            kernel,
            choice,
            four_heads.is_some(),
            facts,
            (groups, rot_groups),
            stored_heads,
        )?;
        Some((launch, occupancy))
    });
    let (kernel, thread_heads) = match four_heads {
        Some(four) => (four, ThreadHeads::Four.count()),
        None => (kernel, ThreadHeads::Two.count()),
    };
    let (kernel, token_warps) = match rows {
        Some(((rows, launch), _)) => (rows, launch.warps),
        None if token_heads => (kernel, warps_at(thread_heads)),
        None => (kernel, [0; 3]),
    };
    // The four-heads kernels (prefill) ask L2 for the heads of tokens to come; at decode the
    // launch's tokens are all resident at once.
    let prefetch_tokens = if kernel.mapping == Mapping::FOUR_HEADS {
        let head_bytes = u64::from(cfg.head_dim()) * es as u64;
        prefetch_tokens(facts, stored_heads.iter().sum(), head_bytes)
    } else {
        0
    };
    let grid = if let Some(((rows, launch), occupancy)) = rows {
        let resident = u64::from(facts.sm_count) * u64::from(occupancy(rows, &launch)?.max(1));
        rows_grid(&launch, (tokens, seq), groups, resident)
    } else if token_heads {
        let segment_warps = if long_norm { groups / 32 } else { 1 };
        fused_grid((tokens, seq), groups, token_warps, segment_warps)?
    } else {
        // The fused kernels index their work items in 32 bits.
        if tokens.saturating_mul(groups as u64) > MAX_FUSED_ITEMS {
            return Err(invalid(
                "q",
                format!(
                    "{tokens} tokens of {groups} accesses per head are more than the fused kernels' \
                     {MAX_FUSED_ITEMS} work items"
                ),
            ));
        }
        // Chunks of heads only to fill the threads the kernel can hold at once: each chunk
        // repeats the item's position, sin/cos and slot work, which the fused kernel's issue
        // rate pays for. (Asked here only: the occupancy query loads the kernel.)
        let per_sm = blocks_per_sm(kernel);
        let resident = DeviceFacts {
            threads_per_sm: facts.threads_per_sm.min(per_sm.max(1) * BLOCK_THREADS),
            ..*facts
        };
        grid((tokens, seq), groups, heads as u32, &resident, per_sm)?
    };
    // A grid of no threads stores nothing: every tensor a launch stores into has no heads.
    let Some(mut grid) = grid else {
        return Ok(None);
    };
    // The non-rotary parts take blocks after each token's (FlashInfer's forms: token-heads).
    let nope = plan_nope(req, &mut grid, es)?;
    Ok(Some(FusedPlan {
        kernel,
        grid,
        lanes,
        rot_groups,
        tokens,
        positions: positions.for_items(pairs),
        sincos,
        block: Divisor::new(block),
        cache_slots,
        token_warps,
        prefetch_tokens,
        nope,
    }))
}

/// The argument of `req`'s first FlashInfer form, if it has one: a multiplier or E5M2 for q's
/// FP8 output, q's non-rotary part, an FP8 k output (with or without its non-rotary part), an FP8 cache of E5M2 or multipliers, a page table.
pub(super) fn flashinfer_form(req: &FusedRequest) -> Option<&'static str> {
    let extended = |f: RawFp8| {
        f.format != Fp8Format::E4m3 || matches!(f.scale.source, ScaleSource::Multiplier(_))
    };
    if req.q_fp8.is_some_and(extended) {
        return Some("q.scale");
    }
    if req.nope.q.is_some() {
        return Some("q.non_rotary.input");
    }
    if req.k_fp8.is_some() {
        return Some("k.output");
    }
    if req.nope.cached.is_some() {
        return Some(CACHE_NOPE_NAME);
    }
    let c = req.cache?;
    if let Some(f) = c.fp8()
        && (extended(RawFp8 {
            format: f.format,
            scale: f.k,
        }) || matches!(f.v.source, ScaleSource::Multiplier(_)))
    {
        return Some("cache.k_scale");
    }
    matches!(c.address, RawCacheAddress::PageTable(_)).then_some("cache.kv_indices")
}

/// The fused kernels rotate the whole head or its first `rotary_dim` features (the features
/// past them normalised and stored unrotated), forward, or backward where they normalise,
/// quantise and cache nothing (a plain rotation).
fn check_config(req: &FusedRequest) -> Result<()> {
    let cfg = &req.rope.config;
    let plain =
        req.norm.is_none() && req.q_fp8.is_none() && req.k_fp8.is_none() && req.cache.is_none();
    if cfg.direction() != Direction::Forward && !plain {
        return Err(invalid(
            "config",
            "fused kernels rotate backward only where nothing is normalised, quantised or cached",
        ));
    }
    if cfg.rotary_offset() != 0 {
        return Err(invalid(
            "config",
            format!(
                "fused kernels rotate each head's first features: rotary_dim {} at offset {} of \
                 head_dim {}",
                cfg.rotary_dim(),
                cfg.rotary_offset(),
                cfg.head_dim()
            ),
        ));
    }
    Ok(())
}

/// Whether every address and stride the kernel accesses with `lanes`-element vectors is
/// aligned to them.
fn aligned(req: &FusedRequest, k: &TensorReq, lanes: usize) -> bool {
    let es = req.rope.dtype.size();
    let q = &req.rope.q;
    let out_es = if req.q_fp8.is_some() { 1 } else { es };
    let k_out_es = if req.k_fp8.is_some() { 1 } else { es };
    // A latent cache (v's buffer) is written by the non-rotary blocks alone, whose checks
    // (`check_nope`) take its alignment.
    let cache = req.cache.as_ref().and_then(|c| {
        let ces = c.element_size(es);
        let l = cache_as_layout(&c.layout).ok()?;
        let v = req.nope.latent().is_none().then_some((c.v.ptr, l, ces));
        Some([Some((c.k.ptr, l, ces)), v])
    });
    // No allocation: this runs for each access width a launch tries.
    let layouts = [
        Some((q.x.ptr, q.x_layout, es)),
        Some((k.x.ptr, k.x_layout, es)),
        q.out.map(|(b, l)| (b.ptr, l, out_es)),
        k.out.map(|(b, l)| (b.ptr, l, k_out_es)),
        req.v.map(|(b, l)| (b.ptr, l, es)),
        cache.and_then(|c| c[0]),
        cache.and_then(|c| c[1]),
    ];
    let weights = req.norm.is_none_or(|n| {
        [n.q_weight.ptr, n.k_weight.ptr]
            .iter()
            .all(|p| p.is_multiple_of((lanes * es) as u64))
    });
    weights
        && layouts
            .iter()
            .flatten()
            .filter(|(_, l, _)| !l.is_empty())
            .all(|(addr, l, es)| layout_aligned(*addr, l, *es, lanes))
}
