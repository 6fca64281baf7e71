//! What the plans of the kernels whose block holds a token's warps (the QK-norm + RoPE
//! backward's, `grad/plan.rs`, and the across-heads kernels', `across.rs`) share: the 32-bit
//! spans their kernels address, and the access width, with it the threads holding one head's
//! pairs.

use rope_kernels::abi::DType;

use crate::check::{layout_aligned, span_below_2_32};
use crate::config::{RopeConfig, RopeStyle};
use crate::error::{Result, invalid};
use crate::layout::Layout;

/// Checks that every named layout given spans fewer than 2^32 elements: the kernels index
/// them in 32 bits. `launch` names the launch in errors.
///
/// # Errors
/// [`crate::Error::Invalid`] naming the first layout that spans more.
pub(super) fn spans_below_2_32(
    spans: &[(&'static str, Option<Layout>)],
    launch: &str,
) -> Result<()> {
    for &(name, l) in spans {
        if let Some(l) = l
            && !span_below_2_32(&l)
        {
            return Err(invalid(
                name,
                format!("spans 2^32 elements or more; {launch} addresses tensors below that"),
            ));
        }
    }
    Ok(())
}

/// The access widths tried, widest first: 16 bytes per vector where the pairs' threads keep a
/// head within a warp segment with registers to spare (NeoX pairs of 16-bit elements take two
/// 8-byte vectors: at 16 bytes the backward's kernels took too many registers), then two
/// elements.
fn candidate_lanes(style: RopeStyle, dtype: DType) -> [u32; 2] {
    match (style, dtype.size()) {
        (RopeStyle::Interleaved, 2) => [8, 2],
        _ => [4, 2],
    }
}

/// The access width and the threads holding one head's pairs (`half / pairs`): the widest of
/// [`candidate_lanes`] that splits `cfg`'s pairs evenly over threads whose power of two is at
/// most 32, or over exactly 64 or 128 threads (two or four whole warps, which the kernels sum
/// across) at the widest access, and to which every layout (its address, and its element size:
/// bytes for FP8) and every weight vector (`dtype` elements) is aligned. `launch` names the
/// launch in errors.
///
/// # Errors
/// [`crate::Error::Invalid`] naming `config` when a head takes other threads at every width
/// that divides it, else `q` when nothing is aligned to two elements.
pub(super) fn access(
    (cfg, dtype): (&RopeConfig, DType),
    (layouts, weights): (&[(u64, Layout, usize)], &[u64]),
    launch: &str,
) -> Result<(u32, u32)> {
    let half = cfg.half();
    let mut too_wide = false;
    for (i, lanes) in candidate_lanes(cfg.style(), dtype).into_iter().enumerate() {
        let pairs = cfg.style().pairs_per_item(lanes);
        if !half.is_multiple_of(pairs) {
            continue;
        }
        let groups = half / pairs;
        let warps = i == 0 && matches!(groups, 64 | 128);
        if groups.next_power_of_two() > 32 && !warps {
            too_wide = true;
            continue;
        }
        let vector = u64::from(lanes) * dtype.size() as u64;
        let weights_aligned = weights.iter().all(|p| p.is_multiple_of(vector));
        let aligned = layouts
            .iter()
            .filter(|(_, l, _)| !l.is_empty())
            .all(|(addr, l, size)| layout_aligned(*addr, l, *size, lanes as usize));
        if weights_aligned && aligned {
            return Ok((lanes, groups));
        }
    }
    Err(if too_wide {
        invalid(
            "config",
            format!(
                "head_dim {} takes more than a warp's 32 threads per head in {launch}, other \
                 than 64 or 128 at the widest access, at this alignment",
                cfg.head_dim()
            ),
        )
    } else {
        invalid(
            "q",
            format!(
                "{launch} needs every tensor, input, output and weight address and stride aligned \
                 to two elements"
            ),
        )
    })
}
