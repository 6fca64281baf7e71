//! RoPE on the GPU: the typed description of an operation, its validation, the launch grid and
//! the launch. Mirrors `kernels-gpu/src/rope.rs`.
//!
//! # Formula
//! For head `h` of token `(b, s)` at position `p`, pair `i < r/2` (`r = rotary_dim`, by default
//! `head_dim`) rotates by `angle = p * inv_freq_i`, `inv_freq_i = theta^(-2i/r)`:
//! forward `(a, b) -> (a cos - b sin, b cos + a sin)`, backward `(a, b) -> (a cos + b sin,
//! b cos - a sin)` (the gradient: the transposed rotation). Pairs are `(x[2i], x[2i+1])` for
//! [`RopeStyle::Interleaved`] and `(x[i], x[i + r/2])` for [`RopeStyle::Neox`]; elements
//! `r..head_dim` pass through unchanged.

use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};

pub use crate::layout::Layout;
use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchConfig, PushKernelArg, SyncOnDrop, sys::CUdevice_attribute,
};
use kernels_gpu::abi::{
    Access, BLOCK_THREADS, KernelName, PositionCode, SinCosSource, preferred_lanes,
};
pub use kernels_gpu::abi::{DType, Direction, RopeStyle};
use kernels_gpu::divide::Divisor;

use crate::error::{Result, invalid};
use crate::freq::AngleMode;
use crate::layout::fused_are_disjoint;
use crate::module::{Module, module_for};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A storage type of the kernels (sealed: `f32`, `half::f16`, `half::bf16`). Arithmetic is
/// `f32`; results are rounded once to the storage type.
pub trait RopeElem: DeviceRepr + Copy + sealed::Sealed {
    /// The matching [`DType`].
    const DTYPE: DType;
}

impl RopeElem for f32 {
    const DTYPE: DType = DType::F32;
}
impl RopeElem for half::f16 {
    const DTYPE: DType = DType::F16;
}
impl RopeElem for half::bf16 {
    const DTYPE: DType = DType::BF16;
}

/// The static part of a RoPE operation: head size, rotated features, pairing and direction.
///
/// ```
/// use rope_host::{Direction, RopeConfig, RopeStyle};
/// let cfg = RopeConfig::builder(128, RopeStyle::Neox)
///     .rotary_dim(64)
///     .direction(Direction::Backward)
///     .build()?;
/// assert_eq!((cfg.head_dim(), cfg.rotary_dim()), (128, 64));
/// # Ok::<(), rope_host::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeConfig {
    head_dim: u32,
    rotary_dim: u32,
    style: RopeStyle,
    direction: Direction,
}

impl RopeConfig {
    /// Starts a configuration for heads of `head_dim` elements paired by `style`.
    pub fn builder(head_dim: u32, style: RopeStyle) -> RopeConfigBuilder {
        RopeConfigBuilder {
            head_dim,
            rotary_dim: None,
            style,
            direction: Direction::Forward,
        }
    }
    /// Elements per head.
    pub fn head_dim(&self) -> u32 {
        self.head_dim
    }
    /// Rotated elements per head (the first `rotary_dim`; the rest pass through).
    pub fn rotary_dim(&self) -> u32 {
        self.rotary_dim
    }
    /// The pairing.
    pub fn style(&self) -> RopeStyle {
        self.style
    }
    /// Forward or backward.
    pub fn direction(&self) -> Direction {
        self.direction
    }
    /// Rotated pairs per head, `rotary_dim / 2`.
    pub fn half(&self) -> u32 {
        self.rotary_dim / 2
    }
}

/// Builds a validated [`RopeConfig`].
#[derive(Clone, Debug)]
pub struct RopeConfigBuilder {
    head_dim: u32,
    rotary_dim: Option<u32>,
    style: RopeStyle,
    direction: Direction,
}

impl RopeConfigBuilder {
    /// Rotate only the first `rotary_dim` elements of each head (partial rotary, as in
    /// GPT-NeoX, Phi and ChatGLM); defaults to `head_dim`.
    pub fn rotary_dim(mut self, rotary_dim: u32) -> Self {
        self.rotary_dim = Some(rotary_dim);
        self
    }

    /// Forward or backward; defaults to [`Direction::Forward`].
    pub fn direction(mut self, direction: Direction) -> Self {
        self.direction = direction;
        self
    }

    /// Checks and returns the configuration.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `head_dim` when it is zero or odd, or `rotary_dim`
    /// when it is zero, odd or larger than `head_dim`.
    pub fn build(self) -> Result<RopeConfig> {
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(invalid(
                "head_dim",
                format!("must be even and at least 2, got {}", self.head_dim),
            ));
        }
        let rotary_dim = self.rotary_dim.unwrap_or(self.head_dim);
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > self.head_dim {
            return Err(invalid(
                "rotary_dim",
                format!(
                    "must be even, at least 2 and at most head_dim {}, got {rotary_dim}",
                    self.head_dim
                ),
            ));
        }
        Ok(RopeConfig {
            head_dim: self.head_dim,
            rotary_dim,
            style: self.style,
            direction: self.direction,
        })
    }
}

/// A read-only tensor: a device buffer and where in it the elements are.
#[derive(Debug)]
pub struct Tensor<'a, T> {
    /// The buffer.
    pub data: CudaView<'a, T>,
    /// The layout inside it.
    pub layout: Layout,
}

/// A written tensor: a device buffer and where in it the elements are.
#[derive(Debug)]
pub struct TensorMut<'a, T> {
    /// The buffer.
    pub data: CudaViewMut<'a, T>,
    /// The layout inside it.
    pub layout: Layout,
}

/// One rotated tensor: in place, or from an input into an output of the same dimensions (the
/// strides may differ).
#[derive(Debug)]
pub enum Io<'a, T> {
    /// `x <- rope(x)`.
    InPlace(TensorMut<'a, T>),
    /// `output <- rope(input)`; the two must not overlap. Pass-through elements are copied.
    OutOfPlace {
        /// Read only.
        input: Tensor<'a, T>,
        /// Written only.
        output: TensorMut<'a, T>,
    },
}

/// q and k rotated by one launch, sharing each token's sin/cos (GQA/MQA head counts may
/// differ).
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // Built once per launch and consumed at once.
pub enum QkIo<'a, T> {
    /// q and k in their own buffers, each in or out of place.
    Separate {
        /// The query tensor.
        q: Io<'a, T>,
        /// The key tensor.
        k: Io<'a, T>,
    },
    /// q and k as two layouts in one buffer, rotated in place: the q and k parts of a fused
    /// QKV projection. Their elements must not meet.
    Fused {
        /// The buffer holding both.
        data: CudaViewMut<'a, T>,
        /// The query layout in it.
        q: Layout,
        /// The key layout in it.
        k: Layout,
    },
}

/// Where the cosine and sine of each (position, pair) come from. Tables have the element type
/// of the tensors (the type system rules out a mismatch).
#[derive(Debug)]
pub enum SinCos<'a, T> {
    /// Tables `cos[p, i]`, `sin[p, i]`, row-major `[max_position, rotary_dim / 2]`.
    Table {
        /// `cos(p * inv_freq_i)` at `[p * rotary_dim/2 + i]`.
        cos: CudaView<'a, T>,
        /// `sin(p * inv_freq_i)` at `[p * rotary_dim/2 + i]`.
        sin: CudaView<'a, T>,
    },
    /// vLLM's and FlashInfer's `cos_sin_cache [max_position, rotary_dim]`: row `p` holds the
    /// `rotary_dim / 2` cosines, then the `rotary_dim / 2` sines.
    CosSinCache(CudaView<'a, T>),
    /// Computed in the kernel: `inv_freq_i = theta^(-2i / rotary_dim)` on the host in `f64`,
    /// the angle in `f64` and `cos`/`sin` within one `f32` ulp (see `kernels_gpu::math`).
    Computed {
        /// The frequency base, finite and positive (commonly 10 000, or 500 000 for Llama 3).
        theta: f64,
    },
    /// Computed in the kernel from a frequency vector of any scaling family, with its angle
    /// mode and attention factor ([`crate::Rope::frequencies`]).
    Frequencies(&'a crate::Frequencies),
}

/// The shape of an explicit position-id array.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IdsShape {
    /// `[seq]`: every batch row uses the same ids (also `[total_tokens]` for packed tensors).
    Shared,
    /// `[batch, seq]`: one id per token.
    PerRow,
}

/// Explicit position ids in device memory.
#[derive(Debug)]
pub enum PositionIds<'a> {
    /// 32-bit ids.
    I32(CudaView<'a, i32>),
    /// 64-bit ids.
    I64(CudaView<'a, i64>),
}

/// The position of token `s` of batch row `b`. With tables, an explicit id outside
/// `0..max_position` makes that token's outputs NaN (never a read outside the table); implicit
/// and packed positions are checked against the table before launch.
#[derive(Debug)]
pub enum Positions<'a> {
    /// Implicit, one offset for all rows: `p = offset + s`.
    Offset(u32),
    /// Implicit, one offset per batch row (decoding with a KV cache): `p = offsets[b] + s`.
    /// The host values are copied to the device at each launch.
    RowOffsets(&'a [u32]),
    /// Explicit ids: `p = ids[s]` ([`IdsShape::Shared`]) or `p = ids[b * seq + s]`
    /// ([`IdsShape::PerRow`]).
    Ids {
        /// The ids.
        ids: PositionIds<'a>,
        /// Their shape.
        shape: IdsShape,
    },
    /// Packed variable-length sequences ([`Layout::thd`], batch 1): token `t` of sequence `i`
    /// (`cu_seqlens[i] <= t < cu_seqlens[i + 1]`) is at `t - cu_seqlens[i] + offsets[i]`.
    /// `cu_seqlens` has one more entry than there are sequences, starts at 0, never decreases
    /// and ends at the total token count. Copied to the device at each launch.
    Varlen {
        /// Cumulative sequence lengths, `[num_seqs + 1]`.
        cu_seqlens: &'a [u32],
        /// Per-sequence position offsets (cached tokens), `[num_seqs]`; `None` for zeros.
        offsets: Option<&'a [u32]>,
    },
}

/// A complete RoPE operation except the tensors it rotates.
#[derive(Debug)]
pub struct RopeOp<'a, T> {
    /// Head size, rotated features, pairing and direction.
    pub config: RopeConfig,
    /// Where positions come from.
    pub positions: Positions<'a>,
    /// Where sin/cos come from.
    pub sincos: SinCos<'a, T>,
}

/// A device buffer as validation sees it: its address and length in elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Buf {
    pub(crate) addr: u64,
    pub(crate) len: usize,
}

/// One tensor with its buffers reduced to [`Buf`]; `out` is `None` in place.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TensorReq {
    pub(crate) x: Buf,
    pub(crate) x_layout: Layout,
    pub(crate) out: Option<(Buf, Layout)>,
}

/// The integer type of explicit ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IdType {
    I32,
    I64,
}

/// Sin/cos source with buffers reduced to [`Buf`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum SinCosReq {
    Table { cos: Buf, sin: Buf },
    CosSinCache(Buf),
    Computed { theta: f64 },
    Frequencies { rotary_dim: u32 },
}

/// Positions with buffers reduced to [`Buf`].
#[derive(Clone, Copy, Debug)]
pub(crate) enum PositionsReq<'a> {
    Offset(u32),
    RowOffsets(&'a [u32]),
    Ids {
        ids: Buf,
        ty: IdType,
        shape: IdsShape,
    },
    Varlen {
        cu_seqlens: &'a [u32],
        offsets: Option<&'a [u32]>,
    },
}

/// Everything validation needs, in plain values: what [`Rope::run`] derives from the views.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request<'a> {
    pub(crate) config: RopeConfig,
    pub(crate) dtype: DType,
    pub(crate) q: TensorReq,
    pub(crate) k: Option<TensorReq>,
    /// q and k are in place in the same buffer (`QkIo::Fused`).
    pub(crate) fused: bool,
    pub(crate) sincos: SinCosReq,
    pub(crate) positions: PositionsReq<'a>,
}

/// The grid of a launch, the heads each `blockIdx.y` handles and the divisors that split a
/// work item's index into token and group, and a token into batch row and sequence index.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grid {
    pub(crate) config: LaunchConfig,
    pub(crate) heads_per_chunk: u32,
    pub(crate) seq: Divisor,
    pub(crate) groups: Divisor,
}

/// Everything a launch needs except the device pointers; `None` grid for an empty tensor.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    pub(crate) kernel: KernelName,
    pub(crate) grid: Option<Grid>,
    pub(crate) lanes: u32,
    pub(crate) rot_groups: u32,
    /// Elements per table row and rows (tables only).
    pub(crate) table_stride: u64,
    pub(crate) table_positions: u64,
    pub(crate) positions: PositionCode,
    pub(crate) pos_base: i64,
    pub(crate) pos_count: u32,
    /// `batch * seq`.
    pub(crate) tokens: u64,
}

/// What the launch planner needs to know of the device.
pub(crate) struct Gpu<'a> {
    /// Streaming multiprocessors.
    pub(crate) sm_count: u32,
    /// Blocks of [`BLOCK_THREADS`] threads of a kernel that one multiprocessor holds at once
    /// (the driver's occupancy calculation for that kernel's registers).
    pub(crate) blocks_per_sm: &'a dyn Fn(KernelName) -> u32,
}

/// Chooses the grid: `items = tokens * groups` work items on `blockIdx.x` in blocks of
/// [`BLOCK_THREADS`], and heads split over `blockIdx.y` only as far as needed to give every
/// multiprocessor a full complement of threads (so sin/cos are reused across as many heads as
/// possible), or up to two chunks further when that splits the heads equally, taking of those
/// equal splits the one whose last wave of blocks (`sm_count * blocks_per_sm` blocks run at
/// once) is fullest, fewer chunks on a tie.
///
/// Measured on an H200 (docs/perf.md v17, v18): ragged chunks (32 heads as 11, 11, 10) leave
/// blocks of unequal work and cost both sin/cos paths 1-2 points of copy bandwidth; a last wave
/// that is mostly empty costs up to 8 (the 40 heads of the prefill case as 5 x 8 instead of
/// 4 x 10, which fills four waves to 97% rather than 78%: +1.3 points for both paths); and each
/// further chunk costs the in-kernel path one more sin/cos evaluation per item, which is why the
/// search stops two chunks out (32 heads as 8 x 4 instead of 7, 7, 7, 7, 4: 5% slower).
/// `gridDim.y <= 65535` and `gridDim.x <= 2^31 - 1` always hold: the kernel's grid-stride loop
/// covers any remainder.
///
/// # Errors
/// [`crate::Error::Invalid`] naming `layout` when `tokens * groups` overflows `u64`.
pub(crate) fn grid(
    tokens: u64,
    seq: u32,
    groups: u32,
    heads: u32,
    sm_count: u32,
    blocks_per_sm: u32,
) -> Result<Option<Grid>> {
    const MAX_GRID_X: u64 = i32::MAX as u64;
    const MAX_GRID_Y: u64 = 65_535;
    const THREADS_PER_SM: u64 = 2048;
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
    let resident = sm_count.max(1) as u64 * THREADS_PER_SM;
    let max_chunks = heads.min(MAX_GRID_Y);
    let wanted = resident.div_ceil(items).clamp(1, max_chunks);
    let slots = sm_count.max(1) as u64 * blocks_per_sm.max(1) as u64;
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

/// A byte range of one buffer region, for overlap checks.
#[derive(Clone, Copy, Debug)]
struct Region {
    start: u128,
    end: u128,
    written: bool,
    /// Which tensor (0 q, 1 k) and whether it is that tensor's input (`false`) or output.
    owner: (usize, bool),
}

/// Checks one tensor's buffers and layouts; returns its regions.
fn check_tensor(
    name: (&'static str, &'static str),
    t: &TensorReq,
    config: &RopeConfig,
    elem_size: usize,
) -> Result<Vec<Region>> {
    let (x_name, out_name) = name;
    let mut regions = Vec::new();
    let input = (x_name, t.x, t.x_layout, t.out.is_none(), false);
    let output = t.out.map(|(b, l)| (out_name, b, l, true, true));
    let entries = std::iter::once(input).chain(output);
    for (arg, buf, layout, written, is_out) in entries {
        if layout.head_dim != config.head_dim as usize {
            return Err(invalid(
                arg,
                format!(
                    "head_dim {} differs from the config's {}",
                    layout.head_dim, config.head_dim
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
        if !buf.addr.is_multiple_of(elem_size as u64) {
            return Err(invalid(arg, format!("is not aligned to {elem_size} bytes")));
        }
        if written && !layout.is_non_overlapping() {
            return Err(invalid(
                arg,
                "the layout maps different elements to one address",
            ));
        }
        let es = elem_size as u128;
        let start = u128::from(buf.addr) + layout.offset as u128 * es;
        let span = layout.span().unwrap_or(0) as u128 * es;
        regions.push(Region {
            start,
            end: start + span,
            written,
            owner: (0, is_out),
        });
    }
    if let Some((_, out_layout)) = t.out {
        let l = &t.x_layout;
        let o = &out_layout;
        if (l.batch, l.seq, l.heads, l.head_dim) != (o.batch, o.seq, o.heads, o.head_dim) {
            return Err(invalid(
                out_name,
                format!("dimensions {o:?} differ from the input's {l:?}"),
            ));
        }
    }
    Ok(regions)
}

/// The widest access (in elements) that the pairing, the sizes and the alignment of every
/// tensor address and stride allow; `None` when interleaved pairs cannot be read as pairs.
fn lanes(req: &Request<'_>, pass_through: bool) -> Option<u32> {
    let cfg = &req.config;
    let (half, rotary, head) = (
        cfg.half() as usize,
        cfg.rotary_dim as usize,
        cfg.head_dim as usize,
    );
    let neox = cfg.style == RopeStyle::Neox;
    let es = req.dtype.size();
    let mut tensors: Vec<(u64, Layout)> = Vec::new();
    for t in [Some(req.q), req.k].into_iter().flatten() {
        tensors.push((t.x.addr, t.x_layout));
        tensors.extend(t.out.map(|(b, l)| (b.addr, l)));
    }
    let mut lanes = preferred_lanes(cfg.style, es) as usize;
    while lanes >= 1 {
        let bytes = (lanes * es) as u64;
        let shape_ok = if neox {
            half.is_multiple_of(lanes)
        } else {
            lanes.is_multiple_of(2) && rotary.is_multiple_of(lanes)
        } && (!pass_through || (head - rotary).is_multiple_of(lanes));
        // Wrapping arithmetic: `bytes` is a power of two, so alignment modulo 2^64 is exact
        // (an empty tensor may carry any address and offset).
        let aligned = tensors.iter().all(|(addr, l)| {
            addr.wrapping_add((l.offset as u64).wrapping_mul(es as u64))
                .is_multiple_of(bytes)
                && l.strides.iter().all(|s| s.is_multiple_of(lanes))
        });
        if shape_ok && aligned {
            return Some(lanes as u32);
        }
        lanes /= 2;
    }
    None
}

/// Validates a request and computes its launch; pure, so it is tested without a GPU.
///
/// # Errors
/// [`crate::Error::Invalid`] naming the first offending argument.
pub(crate) fn plan(req: &Request<'_>, gpu: &Gpu<'_>) -> Result<Plan> {
    let cfg = &req.config;
    let half = cfg.half() as usize;
    let q = &req.q.x_layout;

    // Tensors: shapes, buffers, alignment, self-overlap, then overlap between them.
    let mut regions = check_tensor(("q", "q.output"), &req.q, cfg, req.dtype.size())?;
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
        let mut kr = check_tensor(("k", "k.output"), k, cfg, req.dtype.size())?;
        kr.iter_mut().for_each(|r| r.owner.0 = 1);
        regions.extend(kr);
        if req.fused && !fused_are_disjoint(q, l) {
            return Err(invalid(
                "k",
                "fused q and k must share batch and seq strides and address disjoint elements",
            ));
        }
    }
    for (i, w) in regions.iter().enumerate().filter(|(_, r)| r.written) {
        for (j, r) in regions.iter().enumerate() {
            let fused_pair = req.fused && w.owner.0 != r.owner.0;
            if i == j || fused_pair || !(w.start < r.end && r.start < w.end) {
                continue;
            }
            let arg = match w.owner {
                (0, false) => "q",
                (0, true) => "q.output",
                (_, false) => "k",
                (_, true) => "k.output",
            };
            return Err(invalid(arg, "overlaps another tensor of the launch"));
        }
    }
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

    // Positions: the largest implicit position, and the kernel code.
    let last = q.seq.saturating_sub(1) as u64;
    let (positions, pos_base, pos_count, max_implicit) = match req.positions {
        PositionsReq::Offset(o) => (PositionCode::Offset, o as i64, 0, Some(o as u64 + last)),
        PositionsReq::RowOffsets(offsets) => {
            if offsets.len() != q.batch {
                return Err(invalid(
                    "positions",
                    format!("{} row offsets for a batch of {}", offsets.len(), q.batch),
                ));
            }
            let max = offsets.iter().max().map(|&m| m as u64 + last);
            (PositionCode::RowOffsets, 0, 0, max)
        }
        PositionsReq::Ids { ids, ty, shape } => {
            let (want, what) = match shape {
                IdsShape::Shared => (q.seq as u64, "[seq]"),
                IdsShape::PerRow => (tokens, "[batch, seq]"),
            };
            let size = match ty {
                IdType::I32 => 4,
                IdType::I64 => 8,
            };
            if ids.len as u64 != want {
                return Err(invalid(
                    "positions",
                    format!("ids hold {} elements, {what} needs {want}", ids.len),
                ));
            }
            if !ids.addr.is_multiple_of(size) {
                return Err(invalid(
                    "positions",
                    format!("ids are not {size}-byte aligned"),
                ));
            }
            let code = match (ty, shape) {
                (IdType::I32, IdsShape::Shared) => PositionCode::IdsI32Shared,
                (IdType::I32, IdsShape::PerRow) => PositionCode::IdsI32PerRow,
                (IdType::I64, IdsShape::Shared) => PositionCode::IdsI64Shared,
                (IdType::I64, IdsShape::PerRow) => PositionCode::IdsI64PerRow,
            };
            (code, 0, 0, None)
        }
        PositionsReq::Varlen {
            cu_seqlens,
            offsets,
        } => {
            let max = check_varlen(cu_seqlens, offsets, q.batch, q.seq)?;
            (PositionCode::Varlen, 0, (cu_seqlens.len() - 1) as u32, max)
        }
    };

    let (source, table_stride, table_positions) = match req.sincos {
        SinCosReq::Table { cos, sin } => {
            if cos.len != sin.len {
                return Err(invalid(
                    "sincos",
                    format!("cos has {} elements but sin has {}", cos.len, sin.len),
                ));
            }
            let rows = table_rows(cos.len, half, "[max_position, rotary_dim / 2]")?;
            for (name, b) in [("sincos.cos", cos), ("sincos.sin", sin)] {
                if !b.addr.is_multiple_of(req.dtype.size() as u64) {
                    return Err(invalid(name, "is not aligned to its element size"));
                }
            }
            (SinCosSource::Table, half as u64, rows)
        }
        SinCosReq::CosSinCache(cache) => {
            let rows = table_rows(cache.len, 2 * half, "[max_position, rotary_dim]")?;
            if !cache.addr.is_multiple_of(req.dtype.size() as u64) {
                return Err(invalid("sincos", "is not aligned to its element size"));
            }
            (SinCosSource::Table, 2 * half as u64, rows)
        }
        SinCosReq::Computed { theta } => {
            if !(theta.is_finite() && theta > 0.0) {
                return Err(invalid(
                    "theta",
                    format!("must be finite and positive, got {theta}"),
                ));
            }
            (SinCosSource::Theta, 0, 0)
        }
        SinCosReq::Frequencies { rotary_dim } => {
            if rotary_dim != cfg.rotary_dim {
                return Err(invalid(
                    "sincos",
                    format!(
                        "frequencies for rotary_dim {rotary_dim}, the config rotates {}",
                        cfg.rotary_dim
                    ),
                ));
            }
            (SinCosSource::Theta, 0, 0)
        }
    };
    let past_table = max_implicit.filter(|&m| tokens > 0 && m >= table_positions);
    if let (SinCosSource::Table, Some(max)) = (source, past_table) {
        return Err(invalid(
            "positions",
            format!("position {max} is past the end of a table of {table_positions} positions"),
        ));
    }

    let pass_through = cfg.rotary_dim < cfg.head_dim
        && (req.q.out.is_some() || req.k.is_some_and(|k| k.out.is_some()));
    let lanes = lanes(req, pass_through).ok_or_else(|| {
        invalid(
            "q",
            "interleaved pairs need every tensor address and stride aligned to two elements",
        )
    })?;
    let pairs_per_item = if cfg.style == RopeStyle::Neox {
        lanes
    } else {
        lanes / 2
    };
    let rot_groups = cfg.half() / pairs_per_item;
    let pass_groups = if pass_through {
        (cfg.head_dim - cfg.rotary_dim) / lanes
    } else {
        0
    };
    let groups = rot_groups + pass_groups;
    let kernel = KernelName {
        style: cfg.style,
        source,
        direction: cfg.direction,
        dtype: req.dtype,
        access: if lanes == preferred_lanes(cfg.style, req.dtype.size()) {
            Access::Wide
        } else {
            Access::Narrow
        },
    };
    let blocks_per_sm = (gpu.blocks_per_sm)(kernel);
    let grid = grid(
        tokens,
        q.seq as u32,
        groups,
        heads as u32,
        gpu.sm_count,
        blocks_per_sm,
    )?;
    Ok(Plan {
        kernel,
        grid,
        lanes,
        rot_groups,
        table_stride,
        table_positions,
        positions,
        pos_base,
        pos_count,
        tokens,
    })
}

/// Rows of a table of `len` elements with rows of `row` elements.
fn table_rows(len: usize, row: usize, shape: &str) -> Result<u64> {
    if len == 0 || !len.is_multiple_of(row) {
        return Err(invalid(
            "sincos",
            format!("{len} elements are not {shape} with max_position >= 1 (rows of {row})"),
        ));
    }
    Ok((len / row) as u64)
}

/// Checks packed-sequence positions and returns the largest position they give.
fn check_varlen(
    cu_seqlens: &[u32],
    offsets: Option<&[u32]>,
    batch: usize,
    total: usize,
) -> Result<Option<u64>> {
    if batch != 1 {
        return Err(invalid(
            "positions",
            format!("varlen positions need batch 1 (Layout::thd), got {batch}"),
        ));
    }
    let n = cu_seqlens
        .len()
        .checked_sub(1)
        .filter(|&n| n >= 1)
        .ok_or_else(|| {
            invalid(
                "positions",
                "cu_seqlens needs at least two entries (one sequence)",
            )
        })?;
    if n > u32::MAX as usize - 1 {
        return Err(invalid("positions", "too many sequences"));
    }
    if cu_seqlens[0] != 0 {
        return Err(invalid(
            "positions",
            format!("cu_seqlens must start at 0, got {}", cu_seqlens[0]),
        ));
    }
    if let Some(i) = cu_seqlens.windows(2).position(|w| w[1] < w[0]) {
        return Err(invalid(
            "positions",
            format!(
                "cu_seqlens decreases at {}: {} then {}",
                i + 1,
                cu_seqlens[i],
                cu_seqlens[i + 1]
            ),
        ));
    }
    if cu_seqlens[n] as usize != total {
        return Err(invalid(
            "positions",
            format!(
                "cu_seqlens ends at {} but the tensor has {total} tokens",
                cu_seqlens[n]
            ),
        ));
    }
    if let Some(o) = offsets.filter(|o| o.len() != n) {
        return Err(invalid(
            "positions",
            format!("{} offsets for {n} sequences", o.len()),
        ));
    }
    Ok(cu_seqlens
        .windows(2)
        .enumerate()
        .filter(|(_, w)| w[1] > w[0])
        .map(|(i, w)| (w[1] - w[0] - 1) as u64 + offsets.map_or(0, |o| o[i] as u64))
        .max())
}

/// A cached device frequency vector and its `(theta bits, rotary_dim)` key.
type FreqEntry = ((u64, u32), Arc<CudaSlice<f64>>);

/// Per-thread resources of one kernel as compiled for the device; see [`Rope::resources`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelResources {
    /// The kernel's PTX symbol.
    pub name: &'static str,
    /// Registers per thread.
    pub registers: i32,
    /// Local memory per thread in bytes; non-zero means spills or stack arrays.
    pub local_bytes: i32,
    /// Static shared memory per block in bytes.
    pub shared_bytes: i32,
    /// Blocks of `BLOCK_THREADS` threads that fit one multiprocessor at once.
    pub blocks_per_sm: u32,
}

/// Runs RoPE kernels on one stream. Cheap to create: the module is loaded once per context and
/// shared by every `Rope` of that context.
#[derive(Debug)]
pub struct Rope {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) module: Arc<Module>,
    pub(crate) sm_count: u32,
    /// Frequency vectors already on the device, by `(theta bits, rotary_dim)`.
    inv_freq: Mutex<Vec<FreqEntry>>,
}

/// A tensor's device pointers (offset applied) and layouts; `out` equals `x` in place.
struct TensorPtrs {
    x: u64,
    out: u64,
    x_layout: Layout,
    out_layout: Layout,
}

impl Rope {
    /// Prepares to launch on `stream`, loading the PTX module into its context on first use.
    ///
    /// # Errors
    /// [`crate::Error::Driver`] when the module does not load (for example a driver too old for
    /// the PTX) or the device cannot be queried.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let ctx = stream.context();
        let module = module_for(ctx)?;
        let sm_count =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        Ok(Self {
            stream,
            module,
            sm_count,
            inv_freq: Mutex::new(Vec::new()),
        })
    }

    /// The stream launches go to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device copy of `inv_freq(theta, rotary_dim)`, uploaded on first use.
    pub(crate) fn inv_freq(&self, theta: f64, rotary_dim: u32) -> Result<Arc<CudaSlice<f64>>> {
        let key = (theta.to_bits(), rotary_dim);
        let mut cache = self
            .inv_freq
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((_, f)) = cache.iter().find(|(k, _)| *k == key) {
            return Ok(f.clone());
        }
        let f = Arc::new(
            self.stream
                .clone_htod(&crate::freq::inv_freq(theta, rotary_dim))?,
        );
        cache.push((key, f.clone()));
        Ok(f)
    }

    /// What the driver's JIT compiler allotted each kernel on this device: registers per
    /// thread and local memory (spills) per thread, the resource report of the PTX.
    ///
    /// # Errors
    /// [`crate::Error::Driver`] when an attribute query fails.
    pub fn resources(&self) -> Result<Vec<KernelResources>> {
        kernels_gpu::abi::all_symbols()
            .map(|name| {
                let f = self.module.function(name);
                Ok(KernelResources {
                    name,
                    registers: f.num_regs()?,
                    local_bytes: f.local_size_bytes()?,
                    shared_bytes: f.shared_size_bytes()?,
                    blocks_per_sm: self.module.blocks_per_sm(name),
                })
            })
            .collect()
    }

    /// Validates `op` with one tensor and launches the rotation; asynchronous on the stream.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] for an invalid description (nothing is launched and no output
    /// is touched); [`crate::Error::Driver`] when a copy or the launch fails.
    pub fn run<T: RopeElem>(&self, op: &RopeOp<'_, T>, q: Io<'_, T>) -> Result<()> {
        let stream = self.stream.as_ref();
        let mut q = q;
        let mut guards = Vec::new();
        let q = io_request(&mut q, stream, &mut guards);
        self.launch(op, q, None, false)
    }

    /// Validates `op` with q and k and rotates both in one launch, computing or loading each
    /// token's sin/cos once for the heads of both; asynchronous on the stream.
    ///
    /// # Errors
    /// As [`Rope::run`]; also [`crate::Error::Invalid`] naming `k` when k's batch or seq
    /// differ from q's, or fused layouts share elements.
    pub fn run_qk<T: RopeElem>(&self, op: &RopeOp<'_, T>, qk: QkIo<'_, T>) -> Result<()> {
        let stream = self.stream.as_ref();
        match qk {
            QkIo::Separate { mut q, mut k } => {
                let mut guards = Vec::new();
                let q = io_request(&mut q, stream, &mut guards);
                let k = io_request(&mut k, stream, &mut guards);
                self.launch(op, q, Some(k), false)
            }
            QkIo::Fused { mut data, q, k } => {
                let len = data.len();
                let (p, _guard) = data.device_ptr_mut(stream);
                let req = |layout: Layout| TensorReq {
                    x: Buf { addr: p, len },
                    x_layout: layout,
                    out: None,
                };
                let ptrs = |layout: Layout| tensor_ptrs(p, layout, p, layout, size_of::<T>());
                self.launch(op, (req(q), ptrs(q)), Some((req(k), ptrs(k))), true)
            }
        }
    }

    /// Validates and launches. The callers hold the tensors' pointer guards (cudarc's stream
    /// tracking of the views) until this returns; `guards` here hold the tables' and ids'.
    fn launch<T: RopeElem>(
        &self,
        op: &RopeOp<'_, T>,
        q: (TensorReq, TensorPtrs),
        k: Option<(TensorReq, TensorPtrs)>,
        fused: bool,
    ) -> Result<()> {
        let stream = self.stream.as_ref();
        let mut guards = Vec::new();
        let (sincos_req, cos_ptr, sin_ptr) = match &op.sincos {
            SinCos::Table { cos, sin } => {
                let (pc, gc) = cos.device_ptr(stream);
                let (ps, gs) = sin.device_ptr(stream);
                guards.extend([gc, gs]);
                let req = SinCosReq::Table {
                    cos: Buf {
                        addr: pc,
                        len: cos.len(),
                    },
                    sin: Buf {
                        addr: ps,
                        len: sin.len(),
                    },
                };
                (req, pc, ps)
            }
            SinCos::CosSinCache(cache) => {
                let (p, g) = cache.device_ptr(stream);
                guards.push(g);
                let sin = p + (op.config.half() as usize * size_of::<T>()) as u64;
                (
                    SinCosReq::CosSinCache(Buf {
                        addr: p,
                        len: cache.len(),
                    }),
                    p,
                    sin,
                )
            }
            SinCos::Computed { theta } => (SinCosReq::Computed { theta: *theta }, 0, 0),
            SinCos::Frequencies(f) => (
                SinCosReq::Frequencies {
                    rotary_dim: f.rotary_dim,
                },
                0,
                0,
            ),
        };
        let (positions_req, ids_ptr) = match &op.positions {
            Positions::Offset(o) => (PositionsReq::Offset(*o), 0),
            Positions::RowOffsets(offsets) => (PositionsReq::RowOffsets(offsets), 0),
            Positions::Ids { ids, shape } => {
                let (ty, (p, g), len) = match ids {
                    PositionIds::I32(v) => (IdType::I32, v.device_ptr(stream), v.len()),
                    PositionIds::I64(v) => (IdType::I64, v.device_ptr(stream), v.len()),
                };
                guards.push(g);
                (
                    PositionsReq::Ids {
                        ids: Buf { addr: p, len },
                        ty,
                        shape: *shape,
                    },
                    p,
                )
            }
            Positions::Varlen {
                cu_seqlens,
                offsets,
            } => (
                PositionsReq::Varlen {
                    cu_seqlens,
                    offsets: *offsets,
                },
                0,
            ),
        };
        let req = Request {
            config: op.config,
            dtype: T::DTYPE,
            q: q.0,
            k: k.as_ref().map(|k| k.0),
            fused,
            sincos: sincos_req,
            positions: positions_req,
        };
        let gpu = Gpu {
            sm_count: self.sm_count,
            blocks_per_sm: &|k| self.module.blocks_per_sm(k.symbol()),
        };
        let plan = plan(&req, &gpu)?;
        let Some(grid) = plan.grid else {
            return Ok(()); // An empty tensor: nothing to rotate.
        };

        // Host position arrays travel to the device only now that the request is valid.
        let (main, aux): (&[u32], Option<&[u32]>) = match op.positions {
            Positions::RowOffsets(offsets) => (offsets, None),
            Positions::Varlen {
                cu_seqlens,
                offsets,
            } => (cu_seqlens, offsets),
            _ => (&[], None),
        };
        let main = if main.is_empty() {
            None
        } else {
            Some(self.stream.clone_htod(main)?)
        };
        let aux = match aux {
            Some(a) => Some(self.stream.clone_htod(a)?),
            None => None,
        };
        let cached = match op.sincos {
            SinCos::Computed { theta } => Some(self.inv_freq(theta, op.config.rotary_dim)?),
            _ => None,
        };
        let (inv_freq, angle_mode, cs_scale) = match (&op.sincos, &cached) {
            (SinCos::Frequencies(f), _) => {
                (Some(&f.inv_freq), f.angle as u32, f.attention_factor as f32)
            }
            (_, Some(c)) => (Some(c.as_ref()), AngleMode::Exact as u32, 1.0f32),
            _ => (None, AngleMode::Exact as u32, 1.0f32),
        };
        let (pos_ptr, pos_aux, inv_freq_ptr, _g1, _g2, _g3);
        (pos_ptr, _g1) = match &main {
            Some(m) => {
                let (p, g) = m.device_ptr(stream);
                (p, Some(g))
            }
            None => (ids_ptr, None),
        };
        (pos_aux, _g2) = match &aux {
            Some(a) => {
                let (p, g) = a.device_ptr(stream);
                (p, Some(g))
            }
            None => (0, None),
        };
        (inv_freq_ptr, _g3) = match inv_freq {
            Some(f) => {
                let (p, g) = f.device_ptr(stream);
                (p, Some(g))
            }
            None => (0, None),
        };

        let q_ptrs = &q.1;
        let none = TensorPtrs {
            x: 0,
            out: 0,
            x_layout: Layout::bshd(0, 0, 0, 0),
            out_layout: Layout::bshd(0, 0, 0, 0),
        };
        let k_ptrs = k.as_ref().map_or(&none, |k| &k.1);
        let strides = |l: &Layout| l.strides.map(|s| s as u64);
        let (qx, qo, kx, ko) = (
            strides(&q_ptrs.x_layout),
            strides(&q_ptrs.out_layout),
            strides(&k_ptrs.x_layout),
            strides(&k_ptrs.out_layout),
        );
        let (q_heads, k_heads) = (q_ptrs.x_layout.heads as u32, k_ptrs.x_layout.heads as u32);
        let (half, rotary_dim) = (op.config.half(), op.config.rotary_dim);
        let positions_code = plan.positions as u32;
        let (seq, groups) = (grid.seq.divisor.get(), grid.groups.divisor.get());
        let func = self.module.function(plan.kernel.symbol());
        let mut launch = stream.launch_builder(func);
        launch
            .arg(&q_ptrs.x)
            .arg(&q_ptrs.out)
            .arg(&q_heads)
            .arg(&qx[0])
            .arg(&qx[1])
            .arg(&qx[2])
            .arg(&qo[0])
            .arg(&qo[1])
            .arg(&qo[2])
            .arg(&k_ptrs.x)
            .arg(&k_ptrs.out)
            .arg(&k_heads)
            .arg(&kx[0])
            .arg(&kx[1])
            .arg(&kx[2])
            .arg(&ko[0])
            .arg(&ko[1])
            .arg(&ko[2])
            .arg(&plan.tokens)
            .arg(&seq)
            .arg(&grid.seq.magic)
            .arg(&grid.seq.shift)
            .arg(&grid.heads_per_chunk)
            .arg(&groups)
            .arg(&grid.groups.magic)
            .arg(&grid.groups.shift)
            .arg(&plan.rot_groups)
            .arg(&half)
            .arg(&rotary_dim)
            .arg(&plan.lanes)
            .arg(&cos_ptr)
            .arg(&sin_ptr)
            .arg(&plan.table_stride)
            .arg(&plan.table_positions)
            .arg(&inv_freq_ptr)
            .arg(&angle_mode)
            .arg(&cs_scale)
            .arg(&positions_code)
            .arg(&pos_ptr)
            .arg(&pos_aux)
            .arg(&plan.pos_count)
            .arg(&plan.pos_base);
        // SAFETY: the arguments match, in order and type, the parameters of the `rope_kernel!`
        // entry points in kernels-gpu/src/rope.rs (pointers as u64, NonZeroU32 as u32). `plan`
        // proved: each tensor's buffer holds its layout's end, so every head of every token is in
        // bounds; written layouts never map two elements to one address, and written regions
        // overlap no other tensor (fused q and k: disjoint element sets); pointers and strides are
        // aligned to `lanes` elements and `lanes` divides the pairs and pass-through elements as
        // `groups` counts them; seq >= 1 and groups >= 1 (empty tensors returned above), their
        // magic numbers and shifts from `Divisor::new`; tables hold `table_positions` rows of
        // `table_stride >= half` elements, or `inv_freq` holds `half` f64; ids, row offsets or
        // cu_seqlens/offsets have the lengths their position code names; the grid keeps
        // blockIdx.y * heads_per_chunk < q.heads + k.heads. The views borrow their buffers until
        // this call returns, and the guards order later uses after the launch.
        unsafe { launch.launch(grid.config) }?;
        Ok(())
    }
}

/// Reduces an [`Io`] to validation values and device pointers, keeping its pointer guards.
fn io_request<'s, T>(
    io: &'s mut Io<'_, T>,
    stream: &'s CudaStream,
    guards: &mut Vec<SyncOnDrop<'s>>,
) -> (TensorReq, TensorPtrs) {
    let es = size_of::<T>();
    match io {
        Io::InPlace(t) => {
            let len = t.data.len();
            let (p, g) = t.data.device_ptr_mut(stream);
            guards.push(g);
            let req = TensorReq {
                x: Buf { addr: p, len },
                x_layout: t.layout,
                out: None,
            };
            (req, tensor_ptrs(p, t.layout, p, t.layout, es))
        }
        Io::OutOfPlace { input, output } => {
            let (in_len, out_len) = (input.data.len(), output.data.len());
            let (pi, gi) = input.data.device_ptr(stream);
            let (po, go) = output.data.device_ptr_mut(stream);
            guards.extend([gi, go]);
            let req = TensorReq {
                x: Buf {
                    addr: pi,
                    len: in_len,
                },
                x_layout: input.layout,
                out: Some((
                    Buf {
                        addr: po,
                        len: out_len,
                    },
                    output.layout,
                )),
            };
            (req, tensor_ptrs(pi, input.layout, po, output.layout, es))
        }
    }
}

/// Device pointers of a tensor's first elements.
fn tensor_ptrs(x: u64, x_layout: Layout, out: u64, out_layout: Layout, es: usize) -> TensorPtrs {
    TensorPtrs {
        // Wrapping: these are computed before validation and used only after it succeeds.
        x: x.wrapping_add((x_layout.offset as u64).wrapping_mul(es as u64)),
        out: out.wrapping_add((out_layout.offset as u64).wrapping_mul(es as u64)),
        x_layout,
        out_layout,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn neox(head_dim: u32) -> RopeConfig {
        RopeConfig::builder(head_dim, RopeStyle::Neox)
            .build()
            .expect("valid head_dim")
    }

    fn tensor(layout: Layout, addr: u64) -> TensorReq {
        let len = layout.end().expect("small layout");
        TensorReq {
            x: Buf { addr, len },
            x_layout: layout,
            out: None,
        }
    }

    fn request(config: RopeConfig, layout: Layout) -> Request<'static> {
        Request {
            config,
            dtype: DType::F32,
            q: tensor(layout, 1 << 20),
            k: None,
            fused: false,
            sincos: SinCosReq::Computed { theta: 10_000.0 },
            positions: PositionsReq::Offset(0),
        }
    }

    /// The blocks per multiprocessor the launch bounds promise, standing in for the driver's
    /// occupancy calculation.
    fn launch_bounds(k: KernelName) -> u32 {
        k.min_blocks_per_sm()
    }

    /// A device of `sm_count` multiprocessors where every kernel runs at its launch bounds.
    fn gpu(sm_count: u32) -> Gpu<'static> {
        Gpu {
            sm_count,
            blocks_per_sm: &launch_bounds,
        }
    }

    /// Work-item groups per token of a non-empty plan.
    fn groups(p: &Plan) -> u32 {
        p.grid.expect("non-empty").groups.divisor.get()
    }

    fn invalid_arg(r: Result<Plan>) -> &'static str {
        match r {
            Err(Error::Invalid { arg, .. }) => arg,
            other => panic!("expected Error::Invalid, got {other:?}"),
        }
    }

    /// The grid of `tokens` tokens (one sequence row each) on an H200: 132 multiprocessors
    /// holding `blocks_per_sm` blocks each.
    fn h200_grid(tokens: u64, groups: u32, heads: u32, blocks_per_sm: u32) -> Grid {
        grid(tokens, 1, groups, heads, 132, blocks_per_sm)
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
                grid(tokens, seq, groups, heads, 132, 8)
                    .expect("fits")
                    .is_none()
            );
        }
        assert!(grid(64, 64, 16, 0, 132, 8).expect("fits").is_none());
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
    fn rejects_odd_or_zero_head_dim_and_bad_rotary_dim() {
        for d in [0, 1, 7, 129] {
            let err = RopeConfig::builder(d, RopeStyle::Neox).build().unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::Invalid {
                        arg: "head_dim",
                        ..
                    }
                ),
                "{err}"
            );
        }
        for r in [0, 3, 130] {
            let err = RopeConfig::builder(128, RopeStyle::Neox)
                .rotary_dim(r)
                .build()
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::Invalid {
                        arg: "rotary_dim",
                        ..
                    }
                ),
                "{err}"
            );
        }
    }

    #[test]
    fn picks_16_byte_accesses_when_aligned() {
        let p = plan(&request(neox(128), Layout::bshd(2, 3, 4, 128)), &gpu(132)).expect("valid");
        assert_eq!((p.lanes, groups(&p)), (4, 16));
        let mut r = request(neox(6), Layout::bshd(2, 3, 4, 6));
        r.q.x.addr += 4;
        let p = plan(&r, &gpu(132)).expect("valid");
        assert_eq!((p.lanes, groups(&p)), (1, 3));
    }

    #[test]
    fn picks_8_byte_accesses_for_16_bit_neox_and_16_bytes_otherwise() {
        let interleaved = RopeConfig::builder(128, RopeStyle::Interleaved)
            .build()
            .expect("valid");
        for (cfg, dtype, lanes) in [
            (neox(128), DType::BF16, 4),
            (neox(128), DType::F32, 4),
            (interleaved, DType::F16, 8),
            (interleaved, DType::F32, 4),
        ] {
            let elem_size = dtype.size();
            let mut r = request(cfg, Layout::bshd(2, 3, 4, 128));
            r.dtype = dtype;
            let p = plan(&r, &gpu(132)).expect("valid");
            assert_eq!(
                p.lanes,
                lanes,
                "{:?}, {elem_size}-byte elements",
                cfg.style()
            );
            assert_eq!(p.lanes, preferred_lanes(cfg.style(), elem_size));
        }
    }

    #[test]
    fn partial_rotary_copies_the_rest_only_out_of_place() {
        let cfg = RopeConfig::builder(128, RopeStyle::Neox)
            .rotary_dim(64)
            .build()
            .expect("valid");
        let layout = Layout::bshd(1, 2, 3, 128);
        let p = plan(&request(cfg, layout), &gpu(132)).expect("valid");
        assert_eq!((p.rot_groups, groups(&p)), (8, 8));
        let mut r = request(cfg, layout);
        r.q.out = Some((
            Buf {
                addr: 1 << 30,
                len: 768,
            },
            layout,
        ));
        let p = plan(&r, &gpu(132)).expect("valid");
        assert_eq!((p.rot_groups, groups(&p)), (8, 24));
    }

    #[test]
    fn rejects_short_table_for_implicit_positions() {
        let mut r = request(neox(4), Layout::bshd(1, 10, 1, 4));
        r.sincos = SinCosReq::Table {
            cos: Buf { addr: 0, len: 18 },
            sin: Buf { addr: 64, len: 18 },
        };
        assert_eq!(invalid_arg(plan(&r, &gpu(1))), "positions");
        r.sincos = SinCosReq::Table {
            cos: Buf { addr: 0, len: 20 },
            sin: Buf { addr: 128, len: 20 },
        };
        plan(&r, &gpu(1)).expect("ten positions fit a ten-row table");
        r.sincos = SinCosReq::CosSinCache(Buf { addr: 0, len: 40 });
        plan(&r, &gpu(1)).expect("ten rows of rotary_dim");
        r.sincos = SinCosReq::CosSinCache(Buf { addr: 0, len: 36 });
        assert_eq!(invalid_arg(plan(&r, &gpu(1))), "positions");
    }

    #[test]
    fn checks_cu_seqlens() {
        let layout = Layout::thd(10, 2, 8);
        let mut r = request(neox(8), layout);
        for (cu, ok) in [
            (&[0u32, 4, 10][..], true),
            (&[0, 0, 10], true),
            (&[0, 5, 4, 10], false),
            (&[1, 4, 10], false),
            (&[0, 4, 9], false),
            (&[0], false),
        ] {
            r.positions = PositionsReq::Varlen {
                cu_seqlens: cu,
                offsets: None,
            };
            assert_eq!(plan(&r, &gpu(1)).is_ok(), ok, "{cu:?}");
        }
        let offsets = [3u32, 0];
        r.positions = PositionsReq::Varlen {
            cu_seqlens: &[0, 4, 10],
            offsets: Some(&offsets),
        };
        // Positions reach max(4 - 1 + 3, 6 - 1 + 0) = 6: a 7-row table fits, a 6-row one not.
        r.sincos = SinCosReq::Table {
            cos: Buf { addr: 0, len: 28 },
            sin: Buf { addr: 128, len: 28 },
        };
        plan(&r, &gpu(1)).expect("positions up to 6 fit 7 rows");
        r.sincos = SinCosReq::Table {
            cos: Buf { addr: 0, len: 24 },
            sin: Buf { addr: 128, len: 24 },
        };
        assert_eq!(invalid_arg(plan(&r, &gpu(1))), "positions");
    }

    #[test]
    fn rejects_overlapping_outputs() {
        let layout = Layout::bshd(1, 4, 2, 8);
        let mut r = request(neox(8), layout);
        r.q.out = Some((
            Buf {
                addr: (1 << 20) + 64,
                len: 64,
            },
            layout,
        ));
        assert_eq!(invalid_arg(plan(&r, &gpu(1))), "q.output");
        let self_overlapping = Layout::strided([1, 4, 2, 8], [64, 8, 4, 1], 0).expect("valid");
        let r = request(neox(8), self_overlapping);
        assert_eq!(invalid_arg(plan(&r, &gpu(1))), "q");
    }

    mod plan_never_panics {
        use super::*;
        use proptest::prelude::*;

        fn buf() -> BoxedStrategy<Buf> {
            let addr = prop_oneof![
                Just(0u64),
                (0u64..64).prop_map(|a| a * 4),
                Just(u64::MAX - 15)
            ];
            (addr, prop_oneof![0usize..4096, Just(usize::MAX)])
                .prop_map(|(addr, len)| Buf { addr, len })
                .boxed()
        }

        fn dim() -> BoxedStrategy<usize> {
            prop_oneof![
                Just(0usize),
                1usize..9,
                Just(usize::MAX / 3),
                Just(u32::MAX as usize + 1)
            ]
            .boxed()
        }

        fn layout(head_dim: usize) -> BoxedStrategy<Layout> {
            (
                dim(),
                dim(),
                dim(),
                [dim(), dim(), dim()],
                prop_oneof![Just(0usize), 0usize..64, Just(usize::MAX)],
            )
                .prop_map(move |(b, s, h, st, off)| {
                    Layout::strided([b, s, h, head_dim], [st[0], st[1], st[2], 1], off)
                        .expect("unit stride")
                })
                .boxed()
        }

        fn tensor_req(head_dim: usize) -> BoxedStrategy<TensorReq> {
            (
                buf(),
                layout(head_dim),
                proptest::option::of((buf(), layout(head_dim))),
            )
                .prop_map(|(x, x_layout, out)| TensorReq { x, x_layout, out })
                .boxed()
        }

        proptest! {
            /// Arbitrary, mostly invalid requests: `plan` returns an `Invalid` error or a plan
            /// whose buffers cover the layouts, and never panics (no overflow, no division by
            /// zero).
            #[test]
            fn plan_errs_or_covers_the_layouts(
                (half, rot) in prop_oneof![(1u32..5, 0u32..3), (Just(64u32), Just(0u32))],
                neox in any::<bool>(),
                q in tensor_req(16),
                k in proptest::option::of(tensor_req(16)),
                fused in any::<bool>(),
                table in proptest::option::of((buf(), buf(), any::<bool>())),
                theta in prop_oneof![Just(10_000.0f64), Just(0.0), Just(f64::NAN), -5.0f64..5.0],
                offsets in proptest::collection::vec(any::<u32>(), 0..4),
                ids in (buf(), any::<bool>(), any::<bool>()),
                kind in 0u8..4,
            ) {
                let style = if neox { RopeStyle::Neox } else { RopeStyle::Interleaved };
                let head_dim = 2 * half + 2 * rot;
                let config = RopeConfig::builder(head_dim, style).rotary_dim(2 * half).build().expect("valid");
                let fix = |mut t: TensorReq| {
                    t.x_layout.head_dim = head_dim as usize;
                    if let Some((_, l)) = &mut t.out { l.head_dim = head_dim as usize; }
                    t
                };
                let positions = match kind {
                    0 => PositionsReq::Offset(offsets.first().copied().unwrap_or(0)),
                    1 => PositionsReq::RowOffsets(&offsets),
                    2 => PositionsReq::Varlen { cu_seqlens: &offsets, offsets: Some(&offsets[offsets.len().min(1)..]) },
                    _ => PositionsReq::Ids {
                        ids: ids.0,
                        ty: if ids.1 { IdType::I64 } else { IdType::I32 },
                        shape: if ids.2 { IdsShape::PerRow } else { IdsShape::Shared },
                    },
                };
                let sincos = match table {
                    Some((cos, _, true)) => SinCosReq::CosSinCache(cos),
                    Some((cos, sin, false)) => SinCosReq::Table { cos, sin },
                    None => SinCosReq::Computed { theta },
                };
                let (q, k) = (fix(q), k.map(fix));
                let req = Request { config, dtype: DType::F32, q, k, fused, sincos, positions };
                match plan(&req, &gpu(132)) {
                    Err(Error::Invalid { .. }) => {}
                    Err(e) => prop_assert!(false, "unexpected error kind: {e}"),
                    Ok(p) => {
                        for t in [Some(q), k].into_iter().flatten() {
                            let end = t.x_layout.end().expect("a valid plan has finite ends");
                            prop_assert!(t.x_layout.is_empty() || t.x.len >= end);
                            if let Some((b, l)) = t.out {
                                prop_assert!(l.is_empty() || b.len >= l.end().expect("finite"));
                            }
                        }
                        if let Some(g) = p.grid {
                            prop_assert!(g.config.grid_dim.1 <= 65_535);
                            prop_assert!(g.groups.divisor.get() >= 1 && p.rot_groups >= 1);
                        }
                    }
                }
            }
        }
    }
}
