//! The plan step of a launch, pure so that it is tested without a GPU: validation of the
//! tensors (shapes, buffers, alignment, overlaps with each other and with everything the
//! kernel reads), the options' own checks ([`crate::positions`], [`crate::sincos`]), the
//! access width, the kernel and the grid.

mod grid;
#[cfg(test)]
mod tests;

pub(crate) use grid::{Grid, fused_grid, grid, one_head_warps};
use rope_kernels::abi::{Access, DType, KernelName, preferred_lanes};

use crate::bind::RawBuf;
use crate::config::{RopeConfig, RopeStyle};
use crate::device::DeviceFacts;
use crate::error::{Result, invalid};
use crate::layout::{Layout, packed_are_disjoint};
use crate::positions::{PositionsPlan, RawPositions};
use crate::sincos::{RawSinCos, SinCosPlan};

/// One tensor with its buffers reduced to [`RawBuf`]; `out` is `None` in place.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TensorReq {
    pub(crate) x: RawBuf,
    pub(crate) x_layout: Layout,
    pub(crate) out: Option<(RawBuf, Layout)>,
}

impl TensorReq {
    /// Every layout of the tensor: its input's, then its output's if out of place.
    fn layouts(self) -> impl Iterator<Item = (u64, Layout)> {
        std::iter::once((self.x.ptr, self.x_layout)).chain(self.out.map(|(b, l)| (b.ptr, l)))
    }
}

/// Everything validation needs, in plain values: what the bind step derives from the views.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request {
    pub(crate) config: RopeConfig,
    pub(crate) dtype: DType,
    pub(crate) q: TensorReq,
    pub(crate) k: Option<TensorReq>,
    /// q and k are in place in the same buffer (`QkIo::Packed`).
    pub(crate) packed: bool,
    pub(crate) positions: RawPositions,
    pub(crate) sincos: RawSinCos,
}

/// Everything a launch needs except the device pointers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    pub(crate) kernel: KernelName,
    pub(crate) grid: Grid,
    pub(crate) lanes: u32,
    pub(crate) rot_groups: u32,
    /// `batch * seq`.
    pub(crate) tokens: u64,
    pub(crate) positions: PositionsPlan,
    pub(crate) sincos: SinCosPlan,
}

/// Validates a request and computes its launch: `None` when the tensors are empty (nothing to
/// do once the arguments agree with each other).
///
/// # Errors
/// [`crate::Error::Invalid`] naming the first offending argument.
pub(crate) fn plan(
    req: &Request,
    facts: &DeviceFacts,
    blocks_per_sm: &dyn Fn(KernelName) -> u32,
) -> Result<Option<Plan>> {
    let cfg = &req.config;
    let q = &req.q.x_layout;
    check_tensors(req)?;
    let heads = req.q.x_layout.heads as u64 + req.k.map_or(0, |k| k.x_layout.heads as u64);
    if heads > u32::MAX as u64 {
        return Err(invalid(
            "k",
            "q and k together have more than u32::MAX heads",
        ));
    }
    let tokens = (q.batch as u64)
        .checked_mul(q.seq as u64)
        .ok_or_else(|| invalid("q", "batch * seq overflows u64"))?;
    let empty = tokens == 0 || heads == 0;
    let positions = req.positions.check(q.batch, q.seq, cfg.half())?;
    let max_position = positions.max_implicit.filter(|_| !empty);
    let sincos = req.sincos.check(cfg, req.dtype, max_position)?;
    if empty {
        return Ok(None);
    }

    let pass_through = cfg.rotary_dim() < cfg.head_dim()
        && (req.q.out.is_some() || req.k.is_some_and(|k| k.out.is_some()));
    let lanes = lanes(req, pass_through).ok_or_else(|| {
        invalid(
            "q",
            "interleaved pairs need every tensor address and stride aligned to two elements",
        )
    })?;
    let pairs_per_item = match cfg.style() {
        RopeStyle::Neox => lanes,
        RopeStyle::Interleaved => lanes / 2,
    };
    let rot_groups = cfg.half() / pairs_per_item;
    let pass_groups = if pass_through {
        (cfg.head_dim() - cfg.rotary_dim()) / lanes
    } else {
        0
    };
    let kernel = KernelName {
        style: cfg.style(),
        source: sincos.source,
        dtype: req.dtype,
        access: if lanes == preferred_lanes(cfg.style(), req.dtype.size()) {
            Access::Wide
        } else {
            Access::Narrow
        },
    };
    let seq = u32::try_from(q.seq).map_err(|_| invalid("q", "seq exceeds u32::MAX"))?;
    let Some(grid) = grid(
        (tokens, seq),
        rot_groups + pass_groups,
        heads as u32,
        facts,
        blocks_per_sm(kernel),
    )?
    else {
        return Ok(None);
    };
    // Every head in a block row of its own and nothing to pass through: the one-head kernel,
    // one work item per thread, on the same grid (whose x covers every item when there are
    // fewer than 2^32), with 32-bit element offsets (every tensor spans fewer than 2^32).
    let one_head = kernel.access == Access::Wide
        && pass_groups == 0
        && grid.heads_per_chunk == 1
        && tokens.saturating_mul(u64::from(rot_groups)) < 1 << 32
        && spans_below_2_32(req);
    let kernel = if one_head {
        KernelName {
            access: Access::OneHead,
            ..kernel
        }
    } else {
        kernel
    };
    Ok(Some(Plan {
        kernel,
        grid,
        lanes,
        rot_groups,
        tokens,
        positions: positions.for_items(pairs_per_item),
        sincos,
    }))
}

/// Checks every tensor's buffers and layouts, k against q, and that nothing written meets
/// anything else the launch reads or writes.
///
/// # Errors
/// [`crate::Error::Invalid`] naming the first offending tensor.
fn check_tensors(req: &Request) -> Result<()> {
    let (cfg, q) = (&req.config, &req.q.x_layout);
    let mut regions = tensor_regions(Of::Q, &req.q, cfg, req.dtype.size())?;
    if let Some(k) = &req.k {
        let l = &k.x_layout;
        if (l.batch, l.seq) != (q.batch, q.seq) {
            return Err(invalid(
                "k",
                format!(
                    "batch and seq {:?} differ from q's {:?}",
                    (l.batch, l.seq),
                    (q.batch, q.seq)
                ),
            ));
        }
        regions.extend(tensor_regions(Of::K, k, cfg, req.dtype.size())?);
        if req.packed && !packed_are_disjoint(q, l) {
            return Err(invalid(
                "k",
                "packed q and k must share batch and seq strides and address disjoint elements",
            ));
        }
    }
    regions.extend(option_reads(req));
    check_overlaps(&regions, req.packed)
}

/// The regions the request's options make the kernel read: the sin/cos tables and the
/// position arrays.
pub(crate) fn option_reads(req: &Request) -> impl Iterator<Item = Region> {
    let tables = req.sincos.device_reads().into_iter().flatten();
    let reads = tables.map(|r| read_region("the sin/cos tables", r));
    let arrays = req.positions.device_reads().into_iter().flatten();
    reads.chain(arrays.map(|r| read_region("the position arrays", r)))
}

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
    if written && !layout.is_non_overlapping() {
        return Err(invalid(
            arg,
            "the layout maps different elements to one address",
        ));
    }
    let start = u128::from(buf.ptr) + layout.offset as u128 * es as u128;
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

/// Checks one tensor's buffers and layouts; returns its regions.
fn tensor_regions(
    of: Of,
    t: &TensorReq,
    config: &RopeConfig,
    elem_size: usize,
) -> Result<Vec<Region>> {
    let (x_name, out_name) = match of {
        Of::K => ("k", "k.output"),
        _ => ("q", "q.output"),
    };
    let mut regions = Vec::new();
    let input = (x_name, t.x, t.x_layout, t.out.is_none());
    let output = t.out.map(|(b, l)| (out_name, b, l, true));
    for (arg, buf, layout, written) in std::iter::once(input).chain(output) {
        regions.push(region(
            (arg, of),
            buf,
            &layout,
            config,
            (elem_size, written),
        )?);
    }
    if let Some((_, o)) = t.out {
        same_dims(out_name, &o, &t.x_layout)?;
    }
    Ok(regions)
}

/// Checks that `layout` fits the configuration, the kernels' index types and its buffer.
pub(crate) fn check_layout(
    arg: &'static str,
    buf: RawBuf,
    layout: &Layout,
    config: &RopeConfig,
    elem_size: usize,
) -> Result<()> {
    if layout.head_dim != config.head_dim() as usize {
        return Err(invalid(
            arg,
            format!(
                "head_dim {} differs from the config's {}",
                layout.head_dim,
                config.head_dim()
            ),
        ));
    }
    if layout.seq > u32::MAX as usize || layout.heads > u32::MAX as usize {
        return Err(invalid(
            arg,
            format!("seq and heads must fit in u32, got {layout:?}"),
        ));
    }
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

/// The widest access (in elements) that the pairing, the sizes and the alignment of every
/// non-empty tensor's address and strides allow; `None` when interleaved pairs cannot be read
/// as pairs.
fn lanes(req: &Request, pass_through: bool) -> Option<u32> {
    let es = req.dtype.size();
    let tensors: Vec<(u64, Layout)> = [Some(req.q), req.k]
        .into_iter()
        .flatten()
        .flat_map(|t| t.layouts())
        .filter(|(_, l)| !l.is_empty())
        .collect();
    widest_lanes(&req.config, es, pass_through, |lanes| {
        tensors
            .iter()
            .all(|(addr, l)| layout_aligned(*addr, l, es, lanes))
    })
}

/// Whether every layout of `req`'s tensors (inputs and outputs) spans fewer than 2^32
/// elements, so that the one-head kernels' 32-bit offsets cannot wrap.
pub(crate) fn spans_below_2_32(req: &Request) -> bool {
    [Some(req.q), req.k]
        .into_iter()
        .flatten()
        .flat_map(|t| t.layouts())
        .all(|(_, l)| span_below_2_32(&l))
}

/// Whether `l` spans fewer than 2^32 elements (see [`spans_below_2_32`]).
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
