//! The fused checks of the cache write and the FP8 scales: the addressing arrays (a slot
//! mapping or FlashInfer's page table), the cache's layout and buffers, and each scale (an
//! array of one or one per head, or a finite multiplier). Pure, as the rest of the plan step
//! (`plan.rs`), which calls them.

use std::num::NonZeroU32;

use super::non_rotary::head_width;
use super::request::{CacheNvfp4, CacheStore, NopeParts, RawCache, RawScale, ScaleSource};
use super::{CacheLayout, RawCacheAddress, RawPageTable};
use crate::bind::RawBuf;
use crate::check::{Of, Region, check_in_buffer, layout_region, read_region, wide_region};
use crate::config::{RopeConfig, RopeStyle};
use crate::error::{Result, invalid};
use crate::layout::{Layout, apart_in_one_buffer};
use crate::positions::RawInts;
use rope_kernels::abi::NVFP4_BLOCK;

/// An FP8 scale array holds one `f32`, or one per head, aligned (its region returned); a
/// multiplier is finite.
pub(super) fn check_scale(s: &RawScale, heads: usize) -> Result<Option<Region>> {
    let (buf, per_head) = match s.source {
        ScaleSource::Array { buf, per_head } => (buf, per_head),
        ScaleSource::Multiplier(m) if m.is_finite() => return Ok(None),
        ScaleSource::Multiplier(m) => {
            return Err(invalid(s.arg, format!("multiplier {m} is not finite")));
        }
    };
    let want = if per_head { heads } else { 1 };
    if buf.len != want {
        let what = if per_head { "one per head" } else { "one" };
        return Err(invalid(
            s.arg,
            format!("holds {} scales, needs {what}: {want}", buf.len),
        ));
    }
    if !buf.ptr.is_multiple_of(4) {
        return Err(invalid(s.arg, "is not aligned to 4 bytes"));
    }
    Ok(Some(read_region(s.arg, (buf.ptr, 4 * want as u64))))
}

/// The cache's addressing arrays: one slot per token, or a page table of `i32` arrays (one
/// request index and one position per token, at least one `kv_indptr` entry, lengths within
/// `u32`), each aligned.
pub(super) fn check_address(address: &RawCacheAddress, tokens: u64) -> Result<()> {
    let t = match address {
        RawCacheAddress::Slots(slots) => return check_ints(slots, tokens),
        RawCacheAddress::PageTable(t) => t,
    };
    for (arg, buf) in [
        ("cache.batch_indices", t.batch_indices),
        ("cache.positions", t.positions),
    ] {
        if buf.len as u64 != tokens {
            return Err(invalid(
                arg,
                format!("holds {} entries, needs one per token: {tokens}", buf.len),
            ));
        }
    }
    if t.kv_indptr.len == 0 {
        return Err(invalid(
            "cache.kv_indptr",
            "is empty: it needs one entry per request and one more",
        ));
    }
    for (arg, buf) in page_table_arrays(t) {
        if !buf.ptr.is_multiple_of(4) {
            return Err(invalid(arg, "is not 4-byte aligned"));
        }
        if u32::try_from(buf.len).is_err() {
            return Err(invalid(arg, "holds more than u32::MAX entries"));
        }
    }
    Ok(())
}

/// A page table's four `i32` arrays, named as in errors.
fn page_table_arrays(t: &RawPageTable) -> [(&'static str, RawBuf); 4] {
    [
        ("cache.batch_indices", t.batch_indices),
        ("cache.positions", t.positions),
        ("cache.kv_indptr", t.kv_indptr),
        ("cache.kv_indices", t.kv_indices),
    ]
}

/// The slot mapping holds one integer per token, aligned.
pub(super) fn check_ints(slots: &RawInts, tokens: u64) -> Result<()> {
    if slots.buf.len as u64 != tokens {
        return Err(invalid(
            "cache.slot_mapping",
            format!(
                "holds {} slots, needs one per token: {tokens}",
                slots.buf.len
            ),
        ));
    }
    if !slots.buf.ptr.is_multiple_of(slots.ty.size()) {
        return Err(invalid(
            "cache.slot_mapping",
            format!("is not {}-byte aligned", slots.ty.size()),
        ));
    }
    Ok(())
}

/// `num_blocks * block_size`, the slots a cache holds.
///
/// # Errors
/// [`crate::Error::Invalid`] naming `cache.layout` when it overflows `u64`.
pub(super) fn cache_slots(l: &CacheLayout) -> Result<u64> {
    (l.num_blocks as u64)
        .checked_mul(l.block_size as u64)
        .ok_or_else(|| invalid("cache.layout", "num_blocks * block_size overflows u64"))
}

/// The cache's block size, 1 to `u32::MAX` slots.
///
/// # Errors
/// [`crate::Error::Invalid`] naming `cache.layout` for any other.
pub(super) fn block_size(l: &CacheLayout) -> Result<NonZeroU32> {
    u32::try_from(l.block_size)
        .ok()
        .and_then(NonZeroU32::new)
        .ok_or_else(|| {
            invalid(
                "cache.layout",
                format!("block_size must be 1 to u32::MAX, got {}", l.block_size),
            )
        })
}

/// The cache as a [`Layout`] (`[num_blocks, block_size, kv_heads, head_dim]` at its strides),
/// so the tensor checks apply to it.
pub(super) fn cache_as_layout(l: &CacheLayout) -> Result<Layout> {
    Layout::strided(
        [l.num_blocks, l.block_size, l.kv_heads, l.head_dim],
        [l.strides[0], l.strides[1], l.strides[2], 1],
        0,
    )
    .map_err(|_| invalid("cache.layout", format!("{l:?} overflows usize")))
}

/// Checks the cache layout against k and the config (its heads `head_dim` wide, or that and
/// the non-rotary features after them), both caches' buffers (v's as the latent cache's layout
/// where k's non-rotary part goes there) and the scales; adds their regions (the slot
/// mapping's included) to `regions`.
pub(super) fn check_cache(
    c: &RawCache,
    (cfg, nope): (&RopeConfig, &NopeParts),
    es: usize,
    k_heads: usize,
    regions: &mut Vec<Region>,
) -> Result<()> {
    let l = &c.layout;
    if l.kv_heads != k_heads {
        return Err(invalid(
            "cache.layout",
            format!("has {} kv heads, k has {k_heads}", l.kv_heads),
        ));
    }
    block_size(l)?;
    cache_slots(l)?;
    let layout = cache_as_layout(l)?;
    if let CacheStore::Nvfp4(n) = &c.store {
        check_nvfp4(c, n, cfg, regions)?;
        return check_address_regions(&c.address, regions);
    }
    let ces = c.element_size(es);
    let width = head_width(cfg, nope);
    let k_region = wide_region(("cache.k", Of::Cache), c.k, &layout, width, (ces, true))?;
    match nope.latent() {
        // Its dimensions are checked with k's part (`check_nope`).
        Some(latent) => {
            let latent_layout = cache_as_layout(&latent)?;
            check_in_buffer("cache.v", c.v, &latent_layout, ces)?;
            let v_region =
                layout_region(("cache.v", Of::Cache), c.v.ptr, &latent_layout, (ces, true))?;
            // vLLM's MLA cache (`[num_blocks, block_size, kv_lora_rank + rot_dim]`: each row
            // the latent features, then the rotated k): one buffer whose rows hold both
            // caches' columns, checked as one region when no element of one is an element of
            // the other.
            if apart_in_one_buffer((c.k.ptr, &layout), (c.v.ptr, &latent_layout), ces) {
                regions.push(Region {
                    start: k_region.start.min(v_region.start),
                    end: k_region.end.max(v_region.end),
                    ..k_region
                });
            } else {
                regions.extend([k_region, v_region]);
            }
        }
        None => {
            regions.push(k_region);
            regions.push(wide_region(
                ("cache.v", Of::Cache),
                c.v,
                &layout,
                width,
                (ces, true),
            )?);
        }
    }
    if let Some(f) = c.fp8() {
        regions.extend(check_scale(&f.k, k_heads)?);
        regions.extend(check_scale(&f.v, k_heads)?);
    }
    check_address_regions(&c.address, regions)
}

/// Adds the regions the cache's addressing arrays are read from.
fn check_address_regions(address: &RawCacheAddress, regions: &mut Vec<Region>) -> Result<()> {
    match address {
        RawCacheAddress::Slots(slots) => {
            let bytes = (slots.buf.len as u64).saturating_mul(slots.ty.size());
            regions.push(read_region("cache.slot_mapping", (slots.buf.ptr, bytes)));
        }
        RawCacheAddress::PageTable(t) => {
            for (arg, buf) in page_table_arrays(t) {
                regions.push(read_region(arg, (buf.ptr, 4 * buf.len as u64)));
            }
        }
    }
    Ok(())
}

/// Checks an NVFP4 cache (see [`super::Nvfp4Cache`]): `head_dim` (the config's) a multiple of
/// [`NVFP4_BLOCK`], and for NeoX pairs of twice that (no block spans both halves); the element
/// strides multiples of 8 (codes at 4-byte steps); each cache's codes (the layout at half the
/// strides, in bytes, aligned to 4) and block scales (`head_dim / 16` bytes a head at the
/// scale strides) inside their buffers, apart from each other (the scales may sit between the
/// codes of one buffer: [`nvfp4_regions`]); global scales in device memory, one or one per kv
/// head. Adds their regions.
fn check_nvfp4(
    c: &RawCache,
    n: &CacheNvfp4,
    cfg: &RopeConfig,
    regions: &mut Vec<Region>,
) -> Result<()> {
    let l = &c.layout;
    let block = NVFP4_BLOCK as usize;
    if !l.head_dim.is_multiple_of(block) || l.strides.iter().any(|s| !s.is_multiple_of(8)) {
        return Err(invalid(
            "cache.layout",
            format!(
                "an NVFP4 cache's head_dim is a multiple of {block} (a block scale's elements) \
                 and its element strides multiples of 8 (4 bytes of codes), got head_dim {} and \
                 strides {:?}",
                l.head_dim, l.strides
            ),
        ));
    }
    if cfg.style() == RopeStyle::Neox && !l.head_dim.is_multiple_of(2 * block) {
        return Err(invalid(
            "cache.layout",
            format!(
                "NVFP4 blocks of NeoX heads lie in one half of the head: head_dim {} is not a \
                 multiple of {}",
                l.head_dim,
                2 * block
            ),
        ));
    }
    let codes = cache_as_layout(&CacheLayout {
        head_dim: l.head_dim / 2,
        strides: l.strides.map(|s| s / 2),
        ..*l
    })?;
    let scales = cache_as_layout(&CacheLayout {
        head_dim: l.head_dim / block,
        strides: n.scale_strides,
        ..*l
    })?;
    let head_dim = cfg.head_dim() as usize;
    let caches = [
        ("cache.k", c.k, "cache.k_block_scales", n.k_block_scales),
        ("cache.v", c.v, "cache.v_block_scales", n.v_block_scales),
    ];
    for (arg, code_buf, scales_arg, scale_buf) in caches {
        let whose = (
            head_dim / 2,
            "half the config's head_dim (two codes a byte)",
        );
        let code_region = wide_region((arg, Of::Cache), code_buf, &codes, whose, (1, true))?;
        if !code_buf.ptr.is_multiple_of(4) {
            return Err(invalid(
                arg,
                "an NVFP4 cache's codes are aligned to 4 bytes",
            ));
        }
        let whose = (
            head_dim / block,
            "the config's head_dim / 16 (a scale a block)",
        );
        let scale_region = wide_region(
            (scales_arg, Of::Cache),
            scale_buf,
            &scales,
            whose,
            (1, true),
        )?;
        let (code_at, scale_at) = ((code_buf.ptr, &codes), (scale_buf.ptr, &scales));
        regions.extend(nvfp4_regions(code_at, scale_at, code_region, scale_region));
    }
    for s in [&n.k, &n.v] {
        if matches!(s.source, ScaleSource::Multiplier(_)) {
            return Err(invalid(
                s.arg,
                "an NVFP4 cache's global scale is an f32 in device memory, one or one per kv \
                 head (a multiplier is FlashInfer's FP8 form)",
            ));
        }
        regions.extend(check_scale(s, l.kv_heads)?);
    }
    Ok(())
}

/// The regions of one NVFP4 cache's codes and block scales: two, or one spanning both where
/// the scales sit between the codes of one buffer and no scale byte is a code byte (vLLM's
/// packed rows: each head's codes, then its scales, at the same block, row and head strides).
/// That holds when both layouts share those strides and dimensions, each head's scales lie
/// before or after its codes, and the layout of the head's codes and scales together (from the
/// first byte of either to the last) maps no two bytes to one.
fn nvfp4_regions(
    (code_ptr, codes): (u64, &Layout),
    (scale_ptr, scales): (u64, &Layout),
    code_region: Region,
    scale_region: Region,
) -> Vec<Region> {
    let meet = code_region.start < scale_region.end && scale_region.start < code_region.end;
    let interleaved_apart = || {
        let same = codes.strides == scales.strides
            && (codes.batch, codes.seq, codes.heads) == (scales.batch, scales.seq, scales.heads);
        let (c0, s0) = (
            i128::from(code_ptr) + codes.offset as i128,
            i128::from(scale_ptr) + scales.offset as i128,
        );
        let (c1, s1) = (c0 + codes.head_dim as i128, s0 + scales.head_dim as i128);
        // A head's codes and scales together, from the first byte of either to the last.
        let together = usize::try_from(c1.max(s1) - c0.min(s0)).map(|width| Layout {
            head_dim: width,
            ..*codes
        });
        same && (s1 <= c0 || c1 <= s0) && together.is_ok_and(|l| l.is_non_overlapping())
    };
    if meet && interleaved_apart() {
        vec![Region {
            start: code_region.start.min(scale_region.start),
            end: code_region.end.max(scale_region.end),
            ..code_region
        }]
    } else {
        vec![code_region, scale_region]
    }
}
