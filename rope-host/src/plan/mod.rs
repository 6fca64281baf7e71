//! The plan step of a launch, pure so that it is tested without a GPU: validation of the
//! tensors (shapes, buffers, alignment, overlaps with each other and with everything the
//! kernel reads), the options' own checks ([`crate::positions`], [`crate::sincos`]), the
//! access width, the kernel and the grid.

mod grid;
#[cfg(test)]
mod tests;

pub(crate) use grid::{Grid, fused_grid, grid, token_heads_warps};
use rope_kernels::abi::{DType, KernelName, Mapping, preferred_lanes};

use crate::bind::RawBuf;
use crate::check::{
    Of, Region, check_overlaps, layout_aligned, read_region, region, same_dims, span_below_2_32,
    widest_lanes,
};
use crate::config::RopeConfig;
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
    let pairs_per_item = cfg.style().pairs_per_item(lanes);
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
        mapping: if lanes == preferred_lanes(cfg.style(), req.dtype.size()) {
            Mapping::WIDE
        } else {
            Mapping::NARROW
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
    let one_head = kernel.mapping == Mapping::WIDE
        && pass_groups == 0
        && grid.heads_per_chunk == 1
        && tokens.saturating_mul(u64::from(rot_groups)) < 1 << 32
        && spans_below_2_32(req);
    let kernel = if one_head {
        KernelName {
            mapping: Mapping::ONE_HEAD,
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
/// elements, so that the token-heads kernels' 32-bit offsets cannot wrap.
pub(crate) fn spans_below_2_32(req: &Request) -> bool {
    [Some(req.q), req.k]
        .into_iter()
        .flatten()
        .flat_map(|t| t.layouts())
        .all(|(_, l)| span_below_2_32(&l))
}
