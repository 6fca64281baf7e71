//! The non-rotary parts of q's and k's FP8 outputs ([`super::NonRotary`], FlashInfer's
//! `q_nope` and `k_nope`): their checks, and the blocks of a token's row that store them
//! ([`NopePlan`]). Pure, as the rest of the plan step (`plan.rs`, which calls them).

use std::num::NonZeroU32;

use rope_kernels::abi::NOPE_ACCESSES_PER_THREAD;
use rope_kernels::divide::Divisor;

use super::NonRotaryCache;
use super::request::{CachedNope, FusedRequest, NopePart, NopeParts};
use crate::bind::RawBuf;
use crate::check::{Of, Region, check_in_buffer, layout_aligned, layout_region, span_below_2_32};
use crate::config::RopeConfig;
use crate::error::{Result, invalid};
use crate::layout::Layout;
use crate::plan::Grid;

/// Where the non-rotary parts go in a token's row of blocks: from block `rope_blocks` on,
/// `threads` threads and `accesses` accesses per head (see
/// `crate::fused_forms_kernel_params!`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NopePlan {
    pub(crate) rope_blocks: u32,
    pub(crate) threads: Divisor,
    pub(crate) accesses: u32,
}

/// The argument names of q's non-rotary part's input and output.
pub(super) const Q_NOPE_NAMES: (&str, &str) = ("q.non_rotary.input", "q.non_rotary.output");
/// The argument names of k's.
pub(super) const K_NOPE_NAMES: (&str, &str) = ("k.non_rotary.input", "k.non_rotary.output");
/// The argument name of k's part into the cache ([`super::CacheNonRotary`]).
pub(super) const CACHE_NOPE_NAME: &str = "cache.non_rotary.input";

/// The elements of a k or v cache head, and of a v head, with how the message names them: the
/// config's `head_dim`, and the non-rotary features after it when k's part goes there
/// ([`super::NonRotaryCache::AfterRotated`]).
pub(super) fn head_width(cfg: &RopeConfig, nope: &NopeParts) -> (usize, &'static str) {
    match nope.after_rotated() {
        0 => (cfg.head_dim() as usize, "the config's"),
        wide => (
            cfg.head_dim() as usize + wide,
            "head_dim and the cache's non-rotary features,",
        ),
    }
}

/// Elements of one 16-byte access of `es`-byte elements: the non-rotary parts' access.
fn nope_lanes(es: usize) -> usize {
    16 / es
}

/// Checks the non-rotary parts against their rotated tensors (q's and k's inputs, `es`-byte
/// elements) and returns their regions: each input `[batch, seq, heads, nope_dim]` of its
/// rotated tensor's batch, seq and heads, tokens at one stride, inside its buffer; each output
/// of its input's dimensions in bytes, no two elements at one address; both parts of one
/// `nope_dim`; addresses, strides and `nope_dim` multiples of one 16-byte access; spans below
/// 2^32 elements (the kernels' 32-bit offsets).
///
/// # Errors
/// [`crate::Error::Invalid`] naming the part's `input` or `output`.
pub(crate) fn check_nope(req: &FusedRequest, es: usize) -> Result<Vec<Region>> {
    let mut regions = Vec::new();
    let k = req.rope.k.map_or(req.rope.q.x_layout, |k| k.x_layout);
    let parts = [
        (req.nope.q, req.rope.q.x_layout, Of::Q, Q_NOPE_NAMES),
        (req.nope.k, k, Of::K, K_NOPE_NAMES),
    ];
    let mut dim = None;
    let mut same_dim = |nope_dim: usize, arg: &'static str| {
        let first = *dim.get_or_insert(nope_dim);
        if first != nope_dim {
            return Err(invalid(
                arg,
                format!("has {nope_dim} features per head, q's non-rotary part {first}"),
            ));
        }
        Ok(())
    };
    for (part, rotated, of, names) in parts {
        let Some(p) = part else { continue };
        same_dim(p.input.1.head_dim, names.0)?;
        let (x, out) = check_part(p, &rotated, names, es, of)?;
        regions.extend([x, out]);
    }
    if let Some(c) = req.nope.cached {
        same_dim(c.input.1.head_dim, CACHE_NOPE_NAME)?;
        regions.push(check_cached(req, c, &k, es)?);
    }
    Ok(regions)
}

/// k's part into the cache (see [`check_nope`]): the input as a part's, of k's batch, seq and
/// heads; a latent cache of the k cache's blocks, k's heads and the part's width, whose stores
/// (one access of `16 / es` elements of the cache's format: FP8 bytes, or the tensors' type)
/// are aligned; its input's region.
fn check_cached(req: &FusedRequest, c: CachedNope, k: &Layout, es: usize) -> Result<Region> {
    let lanes = nope_lanes(es);
    let x = c.input.1;
    check_dims(&x, k, (CACHE_NOPE_NAME, lanes))?;
    if let (NonRotaryCache::Latent(l), Some(cache)) = (c.into, req.cache) {
        let k_cache = &cache.layout;
        let want = (k_cache.num_blocks, k_cache.block_size, x.heads, x.head_dim);
        if (l.num_blocks, l.block_size, l.kv_heads, l.head_dim) != want {
            return Err(invalid(
                "cache.non_rotary.layout",
                format!(
                    "has {} blocks of {} slots of {} heads of {}; the k cache's blocks and the \
                     part's heads make {want:?}",
                    l.num_blocks, l.block_size, l.kv_heads, l.head_dim
                ),
            ));
        }
        let ces = cache.element_size(es);
        let aligned = cache.v.ptr.is_multiple_of((lanes * ces) as u64)
            && l.strides.iter().all(|s| s.is_multiple_of(lanes));
        if !aligned {
            return Err(invalid(
                "cache.non_rotary.layout",
                format!(
                    "the latent cache's address must be a multiple of {} bytes and its strides \
                     of {lanes} elements",
                    lanes * ces
                ),
            ));
        }
    }
    part_region((c.input, CACHE_NOPE_NAME), (es, lanes), (false, Of::K))
}

/// One part's checks (see [`check_nope`]); its input's and output's regions.
fn check_part(
    p: NopePart,
    rotated: &Layout,
    (input, output): (&'static str, &'static str),
    es: usize,
    of: Of,
) -> Result<(Region, Region)> {
    let lanes = nope_lanes(es);
    let (x, out) = (p.input.1, p.output.1);
    check_dims(&x, rotated, (input, lanes))?;
    let dims = |l: &Layout| (l.batch, l.seq, l.heads, l.head_dim);
    if dims(&out) != dims(&x) {
        return Err(invalid(
            output,
            format!("dimensions {out:?} differ from the input's {x:?}"),
        ));
    }
    let x_region = part_region((p.input, input), (es, lanes), (false, of))?;
    let out_region = part_region((p.output, output), (1, lanes), (true, of))?;
    Ok((x_region, out_region))
}

/// A part's input `x` has its rotated tensor's batch, seq and heads, and a positive multiple
/// of `lanes` (one 16-byte access) features per head.
fn check_dims(x: &Layout, rotated: &Layout, (input, lanes): (&'static str, usize)) -> Result<()> {
    let dims = |l: &Layout| (l.batch, l.seq, l.heads);
    if dims(x) != dims(rotated) {
        return Err(invalid(
            input,
            format!(
                "dimensions {x:?} differ from the rotated tensor's {rotated:?} in batch, seq or heads"
            ),
        ));
    }
    if x.head_dim == 0 || !x.head_dim.is_multiple_of(lanes) {
        return Err(invalid(
            input,
            format!(
                "has {} features per head; the non-rotary part takes a positive multiple of {lanes} (16 bytes)",
                x.head_dim
            ),
        ));
    }
    Ok(())
}

/// A part's input or output (`written`), elements of `size` bytes, in its buffer: inside it,
/// tokens at one stride, address, offset and strides multiples of `lanes` elements, spanning
/// fewer than 2^32 elements, and a written layout mapping no two elements to one address; its
/// region.
fn part_region(
    ((buf, l), arg): ((RawBuf, Layout), &'static str),
    (size, lanes): (usize, usize),
    (written, of): (bool, Of),
) -> Result<Region> {
    check_in_buffer(arg, buf, &l, size)?;
    if l.batch > 1 && l.strides[0] != l.seq.saturating_mul(l.strides[1]) {
        return Err(invalid(
            arg,
            "tokens must lie at one stride (stride_batch = seq * stride_seq)",
        ));
    }
    if !layout_aligned(buf.ptr, &l, size, lanes) {
        return Err(invalid(
            arg,
            format!("address, offset and strides must be multiples of {lanes} elements"),
        ));
    }
    if !span_below_2_32(&l) {
        return Err(invalid(arg, "spans 2^32 elements or more"));
    }
    layout_region((arg, of), buf.ptr, &l, (size, written))
}

/// Adds the non-rotary parts' blocks to a token-heads `grid` (`blockDim.x` threads a block):
/// each token's row gets, after its `rope_blocks` blocks, enough for every head of each part
/// (`es`-byte elements) to take a thread per [`NOPE_ACCESSES_PER_THREAD`] of its accesses.
/// `None` without parts.
///
/// # Errors
/// [`crate::Error::Invalid`] naming `q.non_rotary.input` when a token's blocks pass `u32`.
pub(crate) fn plan_nope(
    req: &FusedRequest,
    grid: &mut Grid,
    es: usize,
) -> Result<Option<NopePlan>> {
    let n = &req.nope;
    let heads = |part: Option<NopePart>| part.map_or(0, |p| p.input.1.heads as u64);
    let cached = n.cached.map(|c| c.input.1);
    let Some(dim) =
        n.q.or(n.k)
            .map(|p| p.input.1.head_dim)
            .or(cached.map(|l| l.head_dim))
    else {
        return Ok(None);
    };
    let accesses = (dim / nope_lanes(es)) as u64;
    let per_head = accesses.div_ceil(u64::from(NOPE_ACCESSES_PER_THREAD));
    // v's heads add their features past the rotation where k's part goes after the rotated ones.
    let v_heads = match (n.after_rotated(), req.v) {
        (0, _) | (_, None) => 0,
        (_, Some((_, l))) => l.heads as u64,
    };
    let cached_heads = cached.map_or(0, |l| l.heads as u64);
    let threads = (heads(n.q) + heads(n.k) + cached_heads + v_heads) * per_head;
    let block = u64::from(grid.config.block_dim.0);
    let rope_blocks = grid.config.grid_dim.0;
    let blocks = u64::from(rope_blocks) + threads.div_ceil(block);
    // The kernel counts a token's non-rotary threads in `u32`.
    let threads_fit = threads.div_ceil(block) * block <= u64::from(u32::MAX);
    let (Ok(blocks), Some(per_head), Ok(accesses), true) = (
        u32::try_from(blocks),
        u32::try_from(per_head).ok().and_then(NonZeroU32::new),
        u32::try_from(accesses),
        threads_fit,
    ) else {
        return Err(invalid(
            Q_NOPE_NAMES.0,
            "a token's non-rotary accesses are more than the grid's row of blocks holds",
        ));
    };
    grid.config.grid_dim.0 = blocks;
    Ok(Some(NopePlan {
        rope_blocks,
        threads: Divisor::new(per_head),
        accesses,
    }))
}
