//! The validation every family's plan shares, pure so that it is tested without a GPU: a
//! layout against its buffer and the configuration ([`check_layout`], [`check_in_buffer`]), the
//! byte range it addresses ([`Region`], [`region`], [`layout_region`], [`read_region`]), written ranges against every other
//! range of a launch ([`check_overlaps`]), and the widest access the pairing and the alignment of
//! every tensor allow ([`widest_lanes`], [`layout_aligned`]).

use rope_kernels::abi::preferred_lanes;

use crate::bind::RawBuf;
use crate::config::{RopeConfig, RopeStyle};
use crate::error::{Result, invalid};
use crate::layout::Layout;

/// A read-only array of `bytes` at `ptr`.
pub(crate) fn read_region(name: &'static str, (ptr, bytes): (u64, u64)) -> Region {
    Region {
        start: ptr as u128,
        end: ptr as u128 + bytes as u128,
        written: false,
        name,
        of: Of::Read,
    }
}

/// Checks one layout in its buffer (elements of `es` bytes) and returns its region; a written
/// layout must not map two elements to one address.
pub(crate) fn region(
    (arg, of): (&'static str, Of),
    buf: RawBuf,
    layout: &Layout,
    cfg: &RopeConfig,
    (es, written): (usize, bool),
) -> Result<Region> {
    check_layout(arg, buf, layout, cfg, es)?;
    layout_region((arg, of), buf.ptr, layout, (es, written))
}

/// [`region`] for a layout whose heads are `head_dim` elements wide, the config's and more (a
/// cache head or a v head that also holds non-rotary features; `whose` names the sum).
pub(crate) fn wide_region(
    (arg, of): (&'static str, Of),
    buf: RawBuf,
    layout: &Layout,
    head_dim: (usize, &str),
    (es, written): (usize, bool),
) -> Result<Region> {
    check_layout_width(arg, buf, layout, head_dim, es)?;
    layout_region((arg, of), buf.ptr, layout, (es, written))
}

/// The byte range `layout` (elements of `es` bytes) addresses from `ptr`; a written layout
/// must not map two elements to one address.
pub(crate) fn layout_region(
    (arg, of): (&'static str, Of),
    ptr: u64,
    layout: &Layout,
    (es, written): (usize, bool),
) -> Result<Region> {
    if written && !layout.is_non_overlapping() {
        return Err(invalid(
            arg,
            "the layout maps different elements to one address",
        ));
    }
    let start = u128::from(ptr) + layout.offset as u128 * es as u128;
    Ok(Region {
        start,
        end: start + layout.span().unwrap_or(0) as u128 * es as u128,
        written,
        name: arg,
        of,
    })
}

/// An output's dimensions equal its input's.
pub(crate) fn same_dims(arg: &'static str, out: &Layout, input: &Layout) -> Result<()> {
    let dims = |l: &Layout| (l.batch, l.seq, l.heads, l.head_dim);
    if dims(out) != dims(input) {
        return Err(invalid(
            arg,
            format!("dimensions {out:?} differ from the input's {input:?}"),
        ));
    }
    Ok(())
}

/// A byte range of device memory that a launch reads or writes, for overlap checks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Region {
    pub(crate) start: u128,
    pub(crate) end: u128,
    pub(crate) written: bool,
    /// The argument it belongs to (`q`, `q.output`, `k`, `k.output`, ...) or what it holds.
    pub(crate) name: &'static str,
    pub(crate) of: Of,
}

/// What a [`Region`] belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Of {
    /// Tensor q's input or output.
    Q,
    /// Tensor k's input or output.
    K,
    /// Tensor v (the fused kernels' cache input).
    V,
    /// A paged cache the fused kernels write.
    Cache,
    /// Something the kernel only reads: tables, ids, frequencies.
    Read,
}

/// Checks that `layout` fits the configuration, the kernels' index types and its buffer.
pub(crate) fn check_layout(
    arg: &'static str,
    buf: RawBuf,
    layout: &Layout,
    config: &RopeConfig,
    elem_size: usize,
) -> Result<()> {
    let head_dim = (config.head_dim() as usize, "the config's");
    check_layout_width(arg, buf, layout, head_dim, elem_size)
}

/// [`check_layout`] for heads of `head_dim` elements (`whose`, for the message).
fn check_layout_width(
    arg: &'static str,
    buf: RawBuf,
    layout: &Layout,
    (head_dim, whose): (usize, &str),
    elem_size: usize,
) -> Result<()> {
    if layout.head_dim != head_dim {
        return Err(invalid(
            arg,
            format!(
                "head_dim {} differs from {whose} {head_dim}",
                layout.head_dim
            ),
        ));
    }
    if layout.seq > u32::MAX as usize || layout.heads > u32::MAX as usize {
        return Err(invalid(
            arg,
            format!("seq and heads must fit in u32, got {layout:?}"),
        ));
    }
    check_in_buffer(arg, buf, layout, elem_size)
}

/// Checks that the elements `layout` addresses (of `elem_size` bytes) lie inside `buf`, whose
/// address is aligned to them.
pub(crate) fn check_in_buffer(
    arg: &'static str,
    buf: RawBuf,
    layout: &Layout,
    elem_size: usize,
) -> Result<()> {
    let end = layout
        .end()
        .ok_or_else(|| invalid(arg, "the addressed span overflows usize"))?;
    if !layout.is_empty() && buf.len < end {
        return Err(invalid(
            arg,
            format!(
                "holds {} elements, the layout addresses up to {end}",
                buf.len
            ),
        ));
    }
    if !layout.is_empty() && !buf.ptr.is_multiple_of(elem_size as u64) {
        return Err(invalid(arg, format!("is not aligned to {elem_size} bytes")));
    }
    Ok(())
}

/// Written regions may meet no other region: not another tensor, nor a table or ids the kernel
/// reads (packed q and k share a buffer, their disjointness checked element by element).
pub(crate) fn check_overlaps(regions: &[Region], packed: bool) -> Result<()> {
    for (i, w) in regions.iter().enumerate().filter(|(_, r)| r.written) {
        for (j, r) in regions.iter().enumerate() {
            let tensor = |of| matches!(of, Of::Q | Of::K | Of::V);
            let packed_pair = packed && tensor(r.of) && tensor(w.of) && w.of != r.of;
            // Ranges meet when each starts before the other ends; an empty one meets none.
            let meet = w.start < r.end && r.start < w.end && w.start < w.end && r.start < r.end;
            if i == j || packed_pair || !meet {
                continue;
            }
            let other = match r.of {
                Of::Read => r.name,
                Of::Q | Of::K | Of::V | Of::Cache => "another tensor of the launch",
            };
            return Err(invalid(w.name, format!("overlaps {other}")));
        }
    }
    Ok(())
}

/// Whether `l` spans fewer than 2^32 elements, so that 32-bit element offsets into it cannot
/// wrap (the token-heads kernels').
pub(crate) fn span_below_2_32(l: &Layout) -> bool {
    l.span().is_some_and(|s| (s as u64) < 1 << 32)
}

/// Whether the layout `l` of `es`-byte elements in a buffer at `addr` starts at a multiple of
/// `lanes` elements and strides by multiples of them.
pub(crate) fn layout_aligned(addr: u64, l: &Layout, es: usize, lanes: usize) -> bool {
    // Wrapping arithmetic: `lanes * es` is a power of two, so alignment modulo 2^64 is exact.
    addr.wrapping_add((l.offset as u64).wrapping_mul(es as u64))
        .is_multiple_of((lanes * es) as u64)
        && l.strides.iter().all(|s| s.is_multiple_of(lanes))
}

/// The widest access, from the preferred width of the pairing and `es`-byte elements down to
/// one element, that splits the pairs (and pass-through elements) of `cfg` into whole groups
/// and for which `aligned(lanes)` holds; `None` when interleaved pairs cannot be read as pairs.
pub(crate) fn widest_lanes(
    cfg: &RopeConfig,
    es: usize,
    pass_through: bool,
    aligned: impl Fn(usize) -> bool,
) -> Option<u32> {
    let (half, rotary, head, offset) = (
        cfg.half() as usize,
        cfg.rotary_dim() as usize,
        cfg.head_dim() as usize,
        cfg.rotary_offset() as usize,
    );
    let mut lanes = preferred_lanes(cfg.style(), es) as usize;
    while lanes >= 1 {
        let shape_ok = match cfg.style() {
            RopeStyle::Neox => half.is_multiple_of(lanes),
            RopeStyle::Interleaved => lanes.is_multiple_of(2) && rotary.is_multiple_of(lanes),
        } && (!pass_through || (head - rotary).is_multiple_of(lanes))
            // The tensors' pointers start at the rotated slice.
            && offset.is_multiple_of(lanes);
        if shape_ok && aligned(lanes) {
            return Some(lanes as u32);
        }
        lanes /= 2;
    }
    None
}
