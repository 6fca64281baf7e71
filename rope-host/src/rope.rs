//! RoPE on the GPU: the typed description of an operation, its validation, the launch grid and
//! the launch. Mirrors `kernels-gpu/src/rope.rs`.
//!
//! # Formula
//! For head `h` of token `(b, s)` at position `p`, pair `i < d/2` (`d = head_dim`) rotates by
//! `angle = p * inv_freq_i`, `inv_freq_i = theta^(-2i/d)`:
//! forward `(a, b) -> (a cos - b sin, b cos + a sin)`, backward `(a, b) -> (a cos + b sin,
//! b cos - a sin)` (the gradient: the transposed rotation). Pairs are `(x[2i], x[2i+1])` for
//! [`RopeStyle::Interleaved`] and `(x[i], x[i + d/2])` for [`RopeStyle::Neox`].

use std::sync::{Arc, Mutex};

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchConfig, PushKernelArg, sys::CUdevice_attribute,
};
use kernels_gpu::abi::{BLOCK_THREADS, KernelName, PositionCode, SinCosSource};
pub use kernels_gpu::abi::{DType, Direction, RopeStyle};

use crate::error::{Result, invalid};
use crate::module::{Module, module_for};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
}

/// A storage type of the kernels (sealed: implemented for the types in [`DType`]).
pub trait RopeElem: DeviceRepr + Copy + sealed::Sealed {
    /// The matching [`DType`].
    const DTYPE: DType;
}

impl RopeElem for f32 {
    const DTYPE: DType = DType::F32;
}

/// The static part of a RoPE operation: head size, pairing and direction.
///
/// ```
/// use rope_host::{Direction, RopeConfig, RopeStyle};
/// let cfg = RopeConfig::builder(128, RopeStyle::Neox).direction(Direction::Backward).build()?;
/// assert_eq!(cfg.head_dim(), 128);
/// # Ok::<(), rope_host::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeConfig {
    head_dim: u32,
    style: RopeStyle,
    direction: Direction,
}

impl RopeConfig {
    /// Starts a configuration for heads of `head_dim` elements paired by `style`.
    pub fn builder(head_dim: u32, style: RopeStyle) -> RopeConfigBuilder {
        RopeConfigBuilder {
            head_dim,
            style,
            direction: Direction::Forward,
        }
    }
    /// Elements per head.
    pub fn head_dim(&self) -> u32 {
        self.head_dim
    }
    /// The pairing.
    pub fn style(&self) -> RopeStyle {
        self.style
    }
    /// Forward or backward.
    pub fn direction(&self) -> Direction {
        self.direction
    }
    /// Pairs per head, `head_dim / 2`.
    pub fn half(&self) -> u32 {
        self.head_dim / 2
    }
}

/// Builds a validated [`RopeConfig`].
#[derive(Clone, Debug)]
pub struct RopeConfigBuilder {
    head_dim: u32,
    style: RopeStyle,
    direction: Direction,
}

impl RopeConfigBuilder {
    /// Forward or backward; defaults to [`Direction::Forward`].
    pub fn direction(mut self, direction: Direction) -> Self {
        self.direction = direction;
        self
    }

    /// Checks and returns the configuration.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming `head_dim` when it is zero or odd.
    pub fn build(self) -> Result<RopeConfig> {
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(invalid(
                "head_dim",
                format!("must be even and at least 2, got {}", self.head_dim),
            ));
        }
        Ok(RopeConfig {
            head_dim: self.head_dim,
            style: self.style,
            direction: self.direction,
        })
    }
}

/// Where the tensor's elements are: dimensions `[batch, seq, heads, head_dim]` and the element
/// strides of the first three (the last dimension is contiguous).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    /// Element strides of batch, seq and head.
    strides: [usize; 3],
}

impl Layout {
    /// A contiguous row-major `[batch, seq, heads, head_dim]` tensor.
    pub fn bshd(batch: usize, seq: usize, heads: usize, head_dim: usize) -> Self {
        let sh = head_dim;
        let ss = heads.saturating_mul(sh);
        let sb = seq.saturating_mul(ss);
        Self {
            batch,
            seq,
            heads,
            head_dim,
            strides: [sb, ss, sh],
        }
    }
    /// Batch rows.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Tokens per batch row.
    pub fn seq(&self) -> usize {
        self.seq
    }
    /// Heads per token.
    pub fn heads(&self) -> usize {
        self.heads
    }
    /// Elements per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Element strides of the batch, seq and head dimensions.
    pub fn strides(&self) -> [usize; 3] {
        self.strides
    }
    /// Elements from the first to one past the last addressed element; `None` on overflow.
    /// Zero for an empty tensor.
    pub fn span(&self) -> Option<usize> {
        if self.batch == 0 || self.seq == 0 || self.heads == 0 || self.head_dim == 0 {
            return Some(0);
        }
        let [sb, ss, sh] = self.strides;
        (self.batch - 1)
            .checked_mul(sb)?
            .checked_add((self.seq - 1).checked_mul(ss)?)?
            .checked_add((self.heads - 1).checked_mul(sh)?)?
            .checked_add(self.head_dim)
    }
}

/// Where the cosine and sine of each (position, pair) come from.
#[derive(Debug)]
pub enum SinCos<'a, T> {
    /// Tables `cos[p, i]`, `sin[p, i]`, row-major `[max_position, head_dim / 2]`. A position
    /// outside `0..max_position` in explicit ids makes that token's outputs NaN (never a read
    /// outside the table); implicit positions are checked on the host.
    Table {
        /// `cos(p * inv_freq_i)` at `[p * head_dim/2 + i]`.
        cos: CudaView<'a, T>,
        /// `sin(p * inv_freq_i)` at `[p * head_dim/2 + i]`.
        sin: CudaView<'a, T>,
    },
    /// Computed in the kernel: `inv_freq_i = theta^(-2i / head_dim)`, the angle in `f64` and
    /// `cos`/`sin` within one `f32` ulp (see `kernels_gpu::math`). Any position is accepted.
    Computed {
        /// The frequency base, finite and positive (commonly 10 000, or 500 000 for Llama 3).
        theta: f64,
    },
}

/// The shape of an explicit position-id array.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IdsShape {
    /// `[seq]`: every batch row uses the same ids.
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

/// The position of token `s` of batch row `b`.
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
}

/// The tensor(s) rotated: in place, or from an input into a separate output of the same
/// layout.
#[derive(Debug)]
pub enum Io<'a, T> {
    /// `x <- rope(x)`.
    InPlace(CudaViewMut<'a, T>),
    /// `output <- rope(input)`; the two must not overlap.
    OutOfPlace {
        /// Read only.
        input: CudaView<'a, T>,
        /// Written only.
        output: CudaViewMut<'a, T>,
    },
}

/// A complete RoPE operation except the tensors it rotates.
#[derive(Debug)]
pub struct RopeOp<'a, T> {
    /// Head size, pairing and direction.
    pub config: RopeConfig,
    /// The layout of the rotated tensor (input and output alike).
    pub layout: Layout,
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
    Computed { theta: f64 },
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
}

/// Everything validation needs, in plain values: what [`Rope::run`] derives from the views.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request<'a> {
    pub(crate) config: RopeConfig,
    pub(crate) layout: Layout,
    pub(crate) elem_size: usize,
    pub(crate) x: Buf,
    /// `None` in place.
    pub(crate) out: Option<Buf>,
    pub(crate) sincos: SinCosReq,
    pub(crate) positions: PositionsReq<'a>,
}

/// The grid of a launch and the heads each `blockIdx.y` handles.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Grid {
    pub(crate) config: LaunchConfig,
    pub(crate) heads_per_chunk: u32,
}

/// Everything a launch needs except the device pointers; `None` grid for an empty tensor.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    pub(crate) grid: Option<Grid>,
    pub(crate) lanes: u32,
    pub(crate) groups: u32,
    pub(crate) source: SinCosSource,
    pub(crate) table_positions: u64,
    pub(crate) positions: PositionCode,
    pub(crate) pos_base: i64,
    /// `batch * seq`.
    pub(crate) tokens: u64,
}

/// Chooses the grid: `items = tokens * groups` work items on `blockIdx.x` in blocks of
/// [`BLOCK_THREADS`], and heads split over `blockIdx.y` only as far as needed to give every
/// multiprocessor a full complement of threads (so sin/cos are reused across as many heads as
/// possible). `gridDim.y <= 65535` and `gridDim.x <= 2^31 - 1` always hold: the kernel's
/// grid-stride loop covers any remainder.
///
/// # Errors
/// [`Error::Invalid`] naming `layout` when `tokens * groups` overflows `u64`.
pub(crate) fn grid(tokens: u64, groups: u32, heads: u32, sm_count: u32) -> Result<Option<Grid>> {
    const MAX_GRID_X: u64 = i32::MAX as u64;
    const MAX_GRID_Y: u64 = 65_535;
    const THREADS_PER_SM: u64 = 2048;
    if tokens == 0 || heads == 0 || groups == 0 {
        return Ok(None);
    }
    let items = tokens
        .checked_mul(groups as u64)
        .ok_or_else(|| invalid("layout", "batch * seq * head_dim overflows u64"))?;
    let resident = sm_count.max(1) as u64 * THREADS_PER_SM;
    let wanted_chunks = resident
        .div_ceil(items)
        .clamp(1, (heads as u64).min(MAX_GRID_Y));
    let heads_per_chunk = (heads as u64).div_ceil(wanted_chunks);
    let chunks = (heads as u64).div_ceil(heads_per_chunk);
    let blocks_x = items.div_ceil(BLOCK_THREADS as u64).min(MAX_GRID_X);
    Ok(Some(Grid {
        config: LaunchConfig {
            grid_dim: (blocks_x as u32, chunks as u32, 1),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        },
        heads_per_chunk: heads_per_chunk as u32,
    }))
}

/// The widest access (in elements) that the pairing, the head size and the alignment of every
/// tensor address and stride allow; `None` when interleaved pairs cannot be read as pairs.
fn lanes(req: &Request<'_>) -> Option<u32> {
    let half = req.config.half() as usize;
    let neox = req.config.style == RopeStyle::Neox;
    let mut lanes = 16 / req.elem_size;
    while lanes >= 1 {
        let bytes = (lanes * req.elem_size) as u64;
        let shape_ok = if neox {
            half.is_multiple_of(lanes)
        } else {
            lanes.is_multiple_of(2) && (2 * half).is_multiple_of(lanes)
        };
        let addr_ok = req.x.addr.is_multiple_of(bytes)
            && req.out.is_none_or(|o| o.addr.is_multiple_of(bytes));
        let strides_ok = req.layout.strides.iter().all(|s| s.is_multiple_of(lanes));
        if shape_ok && addr_ok && strides_ok {
            return Some(lanes as u32);
        }
        lanes /= 2;
    }
    None
}

/// Validates a request and computes its launch; pure, so it is tested without a GPU.
///
/// # Errors
/// [`Error::Invalid`] naming the first offending argument.
pub(crate) fn plan(req: &Request<'_>, sm_count: u32) -> Result<Plan> {
    let cfg = &req.config;
    let l = &req.layout;
    let half = cfg.half() as usize;
    if l.head_dim != cfg.head_dim as usize {
        return Err(invalid(
            "layout",
            format!(
                "head_dim {} differs from the config's head_dim {}",
                l.head_dim, cfg.head_dim
            ),
        ));
    }
    for (name, v) in [("layout.seq", l.seq), ("layout.heads", l.heads)] {
        if v > u32::MAX as usize {
            return Err(invalid(name, format!("{v} exceeds {}", u32::MAX)));
        }
    }
    let span = l
        .span()
        .ok_or_else(|| invalid("layout", "the addressed span overflows usize"))?;
    check_buffer("x", req.x, span, req.elem_size)?;
    if let Some(out) = req.out {
        check_buffer("output", out, span, req.elem_size)?;
        // In u128: neither the byte span nor an address plus it can overflow.
        let bytes = span as u128 * req.elem_size as u128;
        let (xa, oa) = (u128::from(req.x.addr), u128::from(out.addr));
        if span > 0 && oa < xa + bytes && xa < oa + bytes {
            return Err(invalid(
                "output",
                "overlaps the input; use Io::InPlace to rotate in place",
            ));
        }
    }
    let tokens = (l.batch as u64)
        .checked_mul(l.seq as u64)
        .ok_or_else(|| invalid("layout", "batch * seq overflows u64"))?;

    // Positions: the largest implicit position, and the kernel code.
    let last = l.seq.saturating_sub(1) as u64;
    let (positions, pos_base, max_implicit) = match req.positions {
        PositionsReq::Offset(o) => (PositionCode::Offset, o as i64, Some(o as u64 + last)),
        PositionsReq::RowOffsets(offsets) => {
            if offsets.len() != l.batch {
                return Err(invalid(
                    "positions",
                    format!("{} row offsets for a batch of {}", offsets.len(), l.batch),
                ));
            }
            let max = offsets.iter().max().map(|&m| m as u64 + last);
            (PositionCode::RowOffsets, 0, max)
        }
        PositionsReq::Ids { ids, ty, shape } => {
            let (want, what) = match shape {
                IdsShape::Shared => (l.seq as u64, "[seq]"),
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
            (code, 0, None)
        }
    };

    let (source, table_positions) = match req.sincos {
        SinCosReq::Table { cos, sin } => {
            if cos.len != sin.len {
                return Err(invalid(
                    "sincos",
                    format!("cos has {} elements but sin has {}", cos.len, sin.len),
                ));
            }
            if cos.len == 0 || !cos.len.is_multiple_of(half) {
                return Err(invalid(
                    "sincos",
                    format!(
                        "tables of {} elements are not [max_position, {half}] with max_position >= 1",
                        cos.len
                    ),
                ));
            }
            for (name, b) in [("sincos.cos", cos), ("sincos.sin", sin)] {
                if !b.addr.is_multiple_of(req.elem_size as u64) {
                    return Err(invalid(name, "is not aligned to its element size"));
                }
            }
            let rows = (cos.len / half) as u64;
            if let Some(max) = max_implicit.filter(|&m| tokens > 0 && m >= rows) {
                return Err(invalid(
                    "positions",
                    format!("position {max} is past the end of a table of {rows} positions"),
                ));
            }
            (SinCosSource::Table, rows)
        }
        SinCosReq::Computed { theta } => {
            if !(theta.is_finite() && theta > 0.0) {
                return Err(invalid(
                    "theta",
                    format!("must be finite and positive, got {theta}"),
                ));
            }
            (SinCosSource::Theta, 0)
        }
    };

    let lanes = lanes(req).ok_or_else(|| {
        invalid(
            if req.out.is_some() {
                "x or output"
            } else {
                "x"
            },
            "interleaved pairs need the tensor address and strides aligned to two elements",
        )
    })?;
    let pairs_per_item = if cfg.style == RopeStyle::Neox {
        lanes
    } else {
        lanes / 2
    };
    let groups = cfg.half() / pairs_per_item;
    let grid = grid(tokens, groups, l.heads as u32, sm_count)?;
    Ok(Plan {
        grid,
        lanes,
        groups,
        source,
        table_positions,
        positions,
        pos_base,
        tokens,
    })
}

/// Checks that a tensor buffer covers `span` elements and is element-aligned.
fn check_buffer(arg: &'static str, b: Buf, span: usize, elem_size: usize) -> Result<()> {
    if b.len < span {
        return Err(invalid(
            arg,
            format!("holds {} elements, the layout addresses {span}", b.len),
        ));
    }
    if !b.addr.is_multiple_of(elem_size as u64) {
        return Err(invalid(arg, format!("is not aligned to {elem_size} bytes")));
    }
    Ok(())
}

/// Per-thread resources of one kernel as compiled for the device; see [`Rope::resources`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelResources {
    /// The kernel's PTX symbol.
    pub name: &'static str,
    /// Registers per thread.
    pub registers: i32,
    /// Local memory per thread in bytes; non-zero means spills or stack arrays.
    pub local_bytes: i32,
}

/// A cached device frequency vector and its `(theta bits, rotary_dim)` key.
type FreqEntry = ((u64, u32), Arc<CudaSlice<f64>>);

/// Runs RoPE kernels on one stream. Cheap to create: the module is loaded once per context and
/// shared by every `Rope` of that context.
#[derive(Debug)]
pub struct Rope {
    stream: Arc<CudaStream>,
    module: Arc<Module>,
    sm_count: u32,
    /// Frequency vectors already on the device, by `(theta bits, rotary_dim)`.
    inv_freq: Mutex<Vec<FreqEntry>>,
}

impl Rope {
    /// Prepares to launch on `stream`, loading the PTX module into its context on first use.
    ///
    /// # Errors
    /// [`Error::Driver`] when the module does not load (for example a driver too old for the
    /// PTX) or the device cannot be queried.
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
    fn inv_freq(&self, theta: f64, rotary_dim: u32) -> Result<Arc<CudaSlice<f64>>> {
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
        KernelName::ALL
            .iter()
            .map(|&name| {
                let f = self.module.function(name);
                Ok(KernelResources {
                    name: name.symbol(),
                    registers: f.num_regs()?,
                    local_bytes: f.local_size_bytes()?,
                })
            })
            .collect()
    }

    /// Validates `op` with `io` and launches the rotation; asynchronous on the stream.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an invalid description (nothing is launched and no output is
    /// touched); [`Error::Driver`] when a copy or the launch fails.
    pub fn run<T: RopeElem>(&self, op: &RopeOp<'_, T>, mut io: Io<'_, T>) -> Result<()> {
        let stream = &self.stream;
        let x_len = match &io {
            Io::InPlace(x) => x.len(),
            Io::OutOfPlace { input, .. } => input.len(),
        };
        // Device pointers; the guards record reads/writes for cudarc's stream tracking when
        // dropped after the launch.
        let (x_ptr, out_ptr, out_len, _gx, _go) = match &mut io {
            Io::InPlace(x) => {
                let (p, g) = x.device_ptr_mut(stream);
                (p, p, None, g, None)
            }
            Io::OutOfPlace { input, output } => {
                let out_len = output.len();
                let (pi, gi) = input.device_ptr(stream);
                let (po, go) = output.device_ptr_mut(stream);
                (pi, po, Some(out_len), gi, Some(go))
            }
        };
        let (sincos_req, cos_ptr, sin_ptr, _gt) = match &op.sincos {
            SinCos::Table { cos, sin } => {
                let (pc, gc) = cos.device_ptr(stream);
                let (ps, gs) = sin.device_ptr(stream);
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
                (req, pc, ps, Some((gc, gs)))
            }
            SinCos::Computed { theta } => (SinCosReq::Computed { theta: *theta }, 0, 0, None),
        };
        let (positions_req, ids_ptr, _gi) = match &op.positions {
            Positions::Offset(o) => (PositionsReq::Offset(*o), 0, None),
            Positions::RowOffsets(offsets) => (PositionsReq::RowOffsets(offsets), 0, None),
            Positions::Ids { ids, shape } => {
                let (ty, (p, g), len) = match ids {
                    PositionIds::I32(v) => (IdType::I32, v.device_ptr(stream), v.len()),
                    PositionIds::I64(v) => (IdType::I64, v.device_ptr(stream), v.len()),
                };
                (
                    PositionsReq::Ids {
                        ids: Buf { addr: p, len },
                        ty,
                        shape: *shape,
                    },
                    p,
                    Some(g),
                )
            }
        };
        let req = Request {
            config: op.config,
            layout: op.layout,
            elem_size: std::mem::size_of::<T>(),
            x: Buf {
                addr: x_ptr,
                len: x_len,
            },
            out: out_len.map(|len| Buf { addr: out_ptr, len }),
            sincos: sincos_req,
            positions: positions_req,
        };
        let plan = plan(&req, self.sm_count)?;
        let Some(grid) = plan.grid else {
            return Ok(()); // An empty tensor: nothing to rotate.
        };

        // Row offsets travel to the device only now that the request is known to be valid.
        let row_offsets = match op.positions {
            Positions::RowOffsets(offsets) => Some(stream.clone_htod(offsets)?),
            _ => None,
        };
        let (row_ptr, _gr) = match &row_offsets {
            Some(r) => {
                let (p, g) = r.device_ptr(stream);
                (p, Some(g))
            }
            None => (0, None),
        };
        let pos_ptr = if row_offsets.is_some() {
            row_ptr
        } else {
            ids_ptr
        };

        let l = &op.layout;
        let [sb, ss, sh] = l.strides.map(|s| s as u64);
        let tokens = plan.tokens;
        let (seq, heads, half) = (l.seq as u32, l.heads as u32, op.config.half());
        let positions_code = plan.positions as u32;
        let inv_freq = match op.sincos {
            SinCos::Computed { theta } => Some(self.inv_freq(theta, op.config.head_dim)?),
            SinCos::Table { .. } => None,
        };
        let (inv_freq_ptr, _gf) = match &inv_freq {
            Some(f) => {
                let (p, g) = f.device_ptr(stream);
                (p, Some(g))
            }
            None => (0, None),
        };
        let func = self.module.function(KernelName {
            style: op.config.style,
            source: plan.source,
            direction: op.config.direction,
            dtype: T::DTYPE,
        });
        let mut launch = stream.launch_builder(func);
        launch
            .arg(&x_ptr)
            .arg(&out_ptr)
            .arg(&tokens)
            .arg(&seq)
            .arg(&heads)
            .arg(&grid.heads_per_chunk)
            .arg(&plan.groups)
            .arg(&half)
            .arg(&plan.lanes)
            .arg(&sb)
            .arg(&ss)
            .arg(&sh)
            .arg(&sb)
            .arg(&ss)
            .arg(&sh)
            .arg(&cos_ptr)
            .arg(&sin_ptr)
            .arg(&plan.table_positions)
            .arg(&inv_freq_ptr)
            .arg(&positions_code)
            .arg(&pos_ptr)
            .arg(&plan.pos_base);
        // SAFETY: the arguments match, in order and type, the parameters of the
        // `rope_kernel!` entry points in kernels-gpu/src/rope.rs (pointers as u64, NonZeroU32
        // as u32). `plan` proved: `x` and the output each hold the layout's span (so every head
        // of every token is in bounds) and do not overlap unless they are the same buffer (in
        // place); x, output and strides are aligned to `lanes` elements for the chosen
        // pairing; seq >= 1 and groups >= 1 (empty tensors returned above); table rows hold
        // `half` elements and number `table_positions`, or `inv_freq` holds `half` f64; ids or row offsets have the length
        // their position code names; the grid keeps blockIdx.y * heads_per_chunk < heads.
        // The views borrow their buffers until this call returns, and the guards order later
        // uses after the launch on the stream.
        unsafe { launch.launch(grid.config) }?;
        Ok(())
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

    fn request(config: RopeConfig, layout: Layout) -> Request<'static> {
        let span = layout.span().expect("small layout");
        Request {
            config,
            layout,
            elem_size: 4,
            x: Buf {
                addr: 1 << 20,
                len: span,
            },
            out: None,
            sincos: SinCosReq::Computed { theta: 10_000.0 },
            positions: PositionsReq::Offset(0),
        }
    }

    #[test]
    fn grid_respects_hardware_limits_for_huge_problems() {
        for (tokens, groups, heads) in [
            (1u64 << 20, 16u32, 32u32),
            (1 << 40, 1, 1),
            (1, 1, 100_000),
            (64, 16, 4096),
        ] {
            let g = grid(tokens, groups, heads, 132)
                .expect("no overflow")
                .expect("non-empty");
            let (x, y, z) = g.config.grid_dim;
            assert!(x >= 1 && x as u64 <= i32::MAX as u64);
            assert!((1..=65_535).contains(&y) && z == 1);
            assert!(g.config.block_dim.0 <= 1024);
            // Every head is covered, and no chunk starts past the last head.
            assert!(y as u64 * g.heads_per_chunk as u64 >= heads as u64);
            assert!(((y - 1) as u64 * g.heads_per_chunk as u64) < heads as u64);
        }
    }

    #[test]
    fn grid_keeps_all_heads_in_one_chunk_when_tokens_fill_the_gpu() {
        let g = grid(8192 * 4, 16, 32, 132)
            .expect("fits")
            .expect("non-empty");
        assert_eq!(g.config.grid_dim.1, 1);
        assert_eq!(g.heads_per_chunk, 32);
    }

    #[test]
    fn grid_splits_heads_for_decode() {
        let g = grid(64, 16, 32, 132).expect("fits").expect("non-empty");
        assert!(g.config.grid_dim.1 > 1);
    }

    #[test]
    fn rejects_odd_or_zero_head_dim() {
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
    }

    #[test]
    fn picks_16_byte_accesses_when_aligned() {
        let p = plan(&request(neox(128), Layout::bshd(2, 3, 4, 128)), 132).expect("valid");
        assert_eq!((p.lanes, p.groups), (4, 16));
        let mut r = request(neox(6), Layout::bshd(2, 3, 4, 6));
        r.x.addr += 4;
        let p = plan(&r, 132).expect("valid");
        assert_eq!((p.lanes, p.groups), (1, 3));
    }

    #[test]
    fn rejects_short_table_for_implicit_positions() {
        let mut r = request(neox(4), Layout::bshd(1, 10, 1, 4));
        r.sincos = SinCosReq::Table {
            cos: Buf { addr: 0, len: 18 },
            sin: Buf { addr: 64, len: 18 },
        };
        r.positions = PositionsReq::Offset(0);
        let err = plan(&r, 1).unwrap_err();
        assert!(
            matches!(
                err,
                Error::Invalid {
                    arg: "positions",
                    ..
                }
            ),
            "{err}"
        );
        r.sincos = SinCosReq::Table {
            cos: Buf { addr: 0, len: 20 },
            sin: Buf { addr: 128, len: 20 },
        };
        plan(&r, 1).expect("ten positions fit a ten-row table");
    }

    mod plan_never_panics {
        use super::*;
        use proptest::prelude::*;

        fn buf() -> impl Strategy<Value = Buf> {
            let addr = prop_oneof![
                Just(0u64),
                (0u64..64).prop_map(|a| a * 4),
                Just(u64::MAX - 15)
            ];
            (addr, prop_oneof![0usize..4096, Just(usize::MAX)])
                .prop_map(|(addr, len)| Buf { addr, len })
        }

        fn dim() -> impl Strategy<Value = usize> {
            prop_oneof![
                Just(0usize),
                1usize..9,
                Just(usize::MAX / 3),
                Just(u32::MAX as usize + 1)
            ]
        }

        proptest! {
            /// Arbitrary, mostly invalid requests: `plan` returns an error or a plan whose
            /// buffers cover the layout, and never panics (no overflow, no division by zero).
            #[test]
            fn plan_errs_or_covers_the_layout(
                half in prop_oneof![1u32..5, Just(64u32)],
                neox in any::<bool>(),
                (batch, seq, heads) in (dim(), dim(), dim()),
                x in buf(),
                out in proptest::option::of(buf()),
                table in proptest::option::of((buf(), buf())),
                theta in prop_oneof![Just(10_000.0f64), Just(0.0), Just(f64::NAN), -5.0f64..5.0],
                offsets in proptest::collection::vec(any::<u32>(), 0..4),
                ids in (buf(), any::<bool>(), any::<bool>()),
                kind in 0u8..3,
            ) {
                let style = if neox { RopeStyle::Neox } else { RopeStyle::Interleaved };
                let config = RopeConfig::builder(2 * half, style).build().expect("even head_dim");
                let layout = Layout::bshd(batch, seq, heads, 2 * half as usize);
                let positions = match kind {
                    0 => PositionsReq::Offset(offsets.first().copied().unwrap_or(0)),
                    1 => PositionsReq::RowOffsets(&offsets),
                    _ => PositionsReq::Ids {
                        ids: ids.0,
                        ty: if ids.1 { IdType::I64 } else { IdType::I32 },
                        shape: if ids.2 { IdsShape::PerRow } else { IdsShape::Shared },
                    },
                };
                let sincos = match table {
                    Some((cos, sin)) => SinCosReq::Table { cos, sin },
                    None => SinCosReq::Computed { theta },
                };
                let req = Request { config, layout, elem_size: 4, x, out, sincos, positions };
                match plan(&req, 132) {
                    Err(Error::Invalid { .. }) => {}
                    Err(e) => prop_assert!(false, "unexpected error kind: {e}"),
                    Ok(p) => {
                        let span = layout.span().expect("a valid plan has a finite span");
                        prop_assert!(x.len >= span);
                        prop_assert!(out.is_none_or(|o| o.len >= span));
                        if let Some(g) = p.grid {
                            prop_assert!(g.config.grid_dim.1 <= 65_535);
                            prop_assert!(p.groups >= 1 && seq >= 1);
                        }
                    }
                }
            }
        }
    }
}
