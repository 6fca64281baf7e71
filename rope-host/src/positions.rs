//! Where each token's position comes from: the public [`Positions`] option and its raw form
//! [`RawPositions`], their validation and how they encode into the kernel's `positions`,
//! `pos_ptr`, `pos_aux`, `pos_count` and `pos_base` arguments (the kernel's side is `position` in
//! `rope-kernels/src/rope.rs`, decoding [`PositionCode`]).
//!
//! Every kind but [`Positions::Offset`] lives in device memory, so a launch allocates, copies and
//! synchronizes nothing and can be captured in a CUDA graph and replayed with new values. Their
//! values cannot be checked on the host without a synchronization; the kernel guards them
//! instead: a position outside a table makes that token's outputs NaN, and malformed
//! `cu_seqlens` give wrong positions but never a read or write outside the arrays or tensors.
//!
//! A new position kind touches this file and the kernel's `position` function (multi-axis
//! positions also the kernel's `cos_sin_axes`, since each pair reads its own axis).

use cudarc::driver::{CudaSlice, CudaView, DevicePtr};
use std::num::NonZeroU32;

use rope_kernels::abi::{ContextParallelSplit, MAX_AXES, PositionCode};

use crate::bind::{Binder, RawBuf};
use crate::error::{Result, invalid};

/// The shape of an explicit position-id array.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IdsShape {
    /// `[seq]`: every batch row uses the same ids (also `[total_tokens]` for packed tensors).
    Shared,
    /// `[batch, seq]`: one id per token.
    PerRow,
}

/// A device array of signed integers, as frameworks pass positions and sequence boundaries
/// (PyTorch's `int32`/`int64`).
#[derive(Debug)]
pub enum DeviceInts<'a> {
    /// 32-bit integers.
    I32(CudaView<'a, i32>),
    /// 64-bit integers.
    I64(CudaView<'a, i64>),
}

/// The integer type of a device array.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IntType {
    /// `i32`.
    I32,
    /// `i64`.
    I64,
}

impl IntType {
    /// Bytes per element.
    pub const fn size(self) -> u64 {
        match self {
            Self::I32 => 4,
            Self::I64 => 8,
        }
    }
}

/// A device array given by address: `len` integers of type `ty` at `buf.ptr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawInts {
    /// The address and length in elements.
    pub buf: RawBuf,
    /// The element type.
    pub ty: IntType,
}

/// The position of token `s` of batch row `b`. With tables, a position outside
/// `0..max_position` makes that token's outputs NaN (never a read outside the table).
#[derive(Debug)]
pub enum Positions<'a> {
    /// Implicit, one offset for all rows: `p = offset + s`; checked against tables on the host.
    Offset(u32),
    /// One offset per batch row (decoding with a KV cache): `p = offsets[b] + s`, `offsets`
    /// holding `batch` integers.
    RowOffsets(DeviceInts<'a>),
    /// Explicit ids: `p = ids[s]` ([`IdsShape::Shared`]) or `p = ids[b * seq + s]`
    /// ([`IdsShape::PerRow`]).
    Ids {
        /// The ids.
        ids: DeviceInts<'a>,
        /// Their shape.
        shape: IdsShape,
    },
    /// Packed variable-length sequences ([`crate::Layout::thd`], batch 1), as flash-attention's
    /// varlen functions take them: token `t` of sequence `i`
    /// (`cu_seqlens[i] <= t < cu_seqlens[i + 1]`) is at `t - cu_seqlens[i] + offsets[i]`.
    /// `cu_seqlens` has one more entry than there are sequences and should start at 0, never
    /// decrease and end at the total token count (the kernel does not rely on it: see the module
    /// documentation).
    Varlen {
        /// Cumulative sequence lengths, `[num_seqs + 1]`.
        cu_seqlens: DeviceInts<'a>,
        /// Per-sequence position offsets (cached tokens), `[num_seqs]`, of `cu_seqlens`'s
        /// integer type; `None` for zeros.
        offsets: Option<DeviceInts<'a>>,
    },
    /// Packed sequences split over context-parallel ranks ([`crate::Layout::thd`], batch 1),
    /// as Megatron-LM and Transformer Engine split them: `cu_seqlens` bound the *whole*
    /// sequences (each length divisible by `2 * size`), the tensor holds this rank's `L / size`
    /// tokens of each sequence of whole length `L`: chunks `rank` and `2 * size - 1 - rank`
    /// of its `2 * size` equal chunks, so local token `s` of a sequence is at
    /// `rank * c + s` for `s < c` and at `(2 * size - 1 - rank) * c + (s - c)` after, with
    /// `c = L / (2 * size)`. Positions are derived in the kernel: no id tensor is built.
    VarlenContextParallel {
        /// Cumulative whole-sequence lengths, `[num_seqs + 1]`.
        cu_seqlens: DeviceInts<'a>,
        /// The ranks and this rank.
        split: ContextParallel,
    },
    /// Multi-axis positions (Qwen2-VL's mRoPE, Qwen3-VL's interleaved mRoPE, FLUX's N-D axial
    /// RoPE): `positions` holds `[n_axes, batch * seq]` integers, row `a` axis `a`'s position of
    /// token `b * seq + s` (Qwen2-VL's `position_ids [3, batch, seq]` as it is), and pair `j`
    /// rotates by the position of axis `axes[j]` ([`AxisMap`], uploaded by
    /// [`crate::Rope::axis_map`]). Tokens whose axes all hold one position (text tokens) get
    /// exactly what [`Positions::Ids`] gives for it.
    MultiAxis {
        /// `[n_axes, batch * seq]` positions.
        positions: DeviceInts<'a>,
        /// Which axis each pair takes its position from.
        axes: &'a DeviceAxisMap,
    },
}

/// A context-parallel split for [`Positions::VarlenContextParallel`]: `size` ranks, this one
/// `rank`; checked on construction.
///
/// ```
/// use rope_host::ContextParallel;
/// let split = ContextParallel::new(4, 1)?;
/// assert_eq!((split.size(), split.rank()), (4, 1));
/// assert!(ContextParallel::new(4, 4).is_err());
/// # Ok::<(), rope_host::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ContextParallel {
    split: ContextParallelSplit,
}

impl ContextParallel {
    /// The most ranks: the kernel multiplies a local token index by the size in 64 bits.
    pub const MAX_SIZE: u32 = 1 << 16;

    /// `size` ranks, this one `rank`.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `cp_size` when `size` is outside `1..=65536`, naming
    /// `cp_rank` when `rank >= size`.
    pub fn new(size: u32, rank: u32) -> Result<Self> {
        let size = NonZeroU32::new(size)
            .filter(|s| s.get() <= Self::MAX_SIZE)
            .ok_or_else(|| {
                invalid(
                    "cp_size",
                    format!("must lie in 1..={}, got {size}", Self::MAX_SIZE),
                )
            })?;
        if rank >= size.get() {
            return Err(invalid(
                "cp_rank",
                format!("must be below cp_size {size}, got {rank}"),
            ));
        }
        Ok(Self {
            split: ContextParallelSplit { size, rank },
        })
    }

    /// The number of ranks.
    pub fn size(self) -> u32 {
        self.split.size.get()
    }

    /// This rank.
    pub fn rank(self) -> u32 {
        self.split.rank
    }
}

/// Which position axis each rotated pair `j < rotary_dim / 2` takes its position from, for
/// [`Positions::MultiAxis`]; checked on construction (every entry below `n_axes`, `n_axes` in
/// `1..=4`) and uploaded once by [`crate::Rope::axis_map`].
///
/// ```
/// use rope_host::AxisMap;
/// // Qwen2.5-VL-7B: head_dim 128, mrope_section [16, 24, 24].
/// let map = AxisMap::mrope([16, 24, 24], 128)?;
/// assert_eq!((map.n_axes(), &map.axes()[14..18]), (3, &[0, 0, 1, 1][..]));
/// # Ok::<(), rope_host::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AxisMap {
    n_axes: u32,
    axes: Vec<u8>,
}

impl AxisMap {
    /// A map of `n_axes` axes, `axes[j]` the axis of pair `j`.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `axes` when `n_axes` is outside `1..=4`, the map is
    /// empty or an entry is not below `n_axes`.
    pub fn new(n_axes: u32, axes: Vec<u8>) -> Result<Self> {
        if !(1..=MAX_AXES).contains(&n_axes) {
            return Err(invalid(
                "axes",
                format!("n_axes must lie in 1..={MAX_AXES}, got {n_axes}"),
            ));
        }
        if axes.is_empty() {
            return Err(invalid("axes", "the map must cover at least one pair"));
        }
        if let Some((j, a)) = axes
            .iter()
            .enumerate()
            .find(|(_, a)| u32::from(**a) >= n_axes)
        {
            return Err(invalid(
                "axes",
                format!("pair {j} takes axis {a}, but there are {n_axes} axes"),
            ));
        }
        Ok(Self { n_axes, axes })
    }

    /// Qwen2-VL's and Qwen2.5-VL's mRoPE: `mrope_section = [s_t, s_h, s_w]` with
    /// `s_t + s_h + s_w = rotary_dim / 2`; pairs `0..s_t` take the temporal position (axis 0),
    /// the next `s_h` the height (axis 1), the last `s_w` the width (axis 2).
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `mrope_section` when the sections do not sum to
    /// `rotary_dim / 2`, and `rotary_dim` when it is odd or below 2.
    pub fn mrope(mrope_section: [u32; 3], rotary_dim: u32) -> Result<Self> {
        let half = check_sections(mrope_section, rotary_dim)?;
        let axes = (0..half)
            .map(|j| {
                if j < mrope_section[0] {
                    0
                } else if j < mrope_section[0] + mrope_section[1] {
                    1
                } else {
                    2
                }
            })
            .collect();
        Self::new(3, axes)
    }

    /// Qwen3-VL's interleaved mRoPE (`mrope_interleaved`), as transformers'
    /// `apply_interleaved_mrope` assigns it: pair `j` takes the height (axis 1) when
    /// `j % 3 == 1` and `j < 3 s_h`, the width (axis 2) when `j % 3 == 2` and `j < 3 s_w`, and
    /// the temporal position (axis 0) otherwise (`[T H W T H W ... T T]`).
    ///
    /// # Errors
    /// As [`AxisMap::mrope`].
    pub fn mrope_interleaved(mrope_section: [u32; 3], rotary_dim: u32) -> Result<Self> {
        let half = check_sections(mrope_section, rotary_dim)?;
        let axes = (0..half)
            .map(|j| match j % 3 {
                1 if j < 3 * mrope_section[1] => 1,
                2 if j < 3 * mrope_section[2] => 2,
                _ => 0,
            })
            .collect();
        Self::new(3, axes)
    }

    /// FLUX's N-D axial RoPE (`EmbedND`): axis `a` owns a contiguous block of
    /// `axes_dim[a] / 2` pairs, in axis order. Its frequencies, `theta^(-2i / axes_dim[a])`
    /// within each block, come from [`crate::RopeScaling::Axial`].
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `axes_dim` when it has no entry or more than 4, an
    /// entry is odd or zero, or the entries do not sum to `rotary_dim`.
    pub fn axial(axes_dim: &[u32], rotary_dim: u32) -> Result<Self> {
        check_axes_dim(axes_dim, rotary_dim)?;
        let axes = axes_dim
            .iter()
            .enumerate()
            .flat_map(|(a, &d)| std::iter::repeat_n(a as u8, d as usize / 2))
            .collect();
        Self::new(axes_dim.len() as u32, axes)
    }

    /// Number of position axes (rows of the positions array).
    pub fn n_axes(&self) -> u32 {
        self.n_axes
    }

    /// The axis of each pair.
    pub fn axes(&self) -> &[u8] {
        &self.axes
    }
}

/// Checks `mrope_section` against `rotary_dim`; returns `rotary_dim / 2`.
fn check_sections(sections: [u32; 3], rotary_dim: u32) -> Result<u32> {
    if rotary_dim < 2 || !rotary_dim.is_multiple_of(2) {
        return Err(invalid(
            "rotary_dim",
            format!("must be even and at least 2, got {rotary_dim}"),
        ));
    }
    let sum: u64 = sections.iter().map(|&s| u64::from(s)).sum();
    if sum != u64::from(rotary_dim / 2) {
        return Err(invalid(
            "mrope_section",
            format!(
                "{sections:?} sums to {sum}, rotary_dim / 2 is {}",
                rotary_dim / 2
            ),
        ));
    }
    Ok(rotary_dim / 2)
}

/// Checks FLUX's `axes_dim` against `rotary_dim`: 1 to 4 even, nonzero entries summing to it.
pub(crate) fn check_axes_dim(axes_dim: &[u32], rotary_dim: u32) -> Result<()> {
    if !(1..=MAX_AXES as usize).contains(&axes_dim.len()) {
        return Err(invalid(
            "axes_dim",
            format!("needs 1 to {MAX_AXES} axes, got {}", axes_dim.len()),
        ));
    }
    if let Some(d) = axes_dim.iter().find(|&&d| d == 0 || !d.is_multiple_of(2)) {
        return Err(invalid(
            "axes_dim",
            format!("every axis needs an even, nonzero width, got {d} in {axes_dim:?}"),
        ));
    }
    let sum: u64 = axes_dim.iter().map(|&d| u64::from(d)).sum();
    if sum != u64::from(rotary_dim) {
        return Err(invalid(
            "axes_dim",
            format!("{axes_dim:?} sums to {sum}, rotary_dim is {rotary_dim}"),
        ));
    }
    Ok(())
}

/// An [`AxisMap`] on the device, made by [`crate::Rope::axis_map`]: complete when made, so
/// launches on any stream (and captured graphs) may read it.
#[derive(Debug)]
pub struct DeviceAxisMap {
    pub(crate) axes: CudaSlice<u8>,
    pub(crate) n_axes: u32,
}

impl DeviceAxisMap {
    /// Number of position axes.
    pub fn n_axes(&self) -> u32 {
        self.n_axes
    }

    /// Pairs covered (`rotary_dim / 2` of the launches it serves).
    pub fn pairs(&self) -> usize {
        self.axes.len()
    }

    /// The map by address, for [`RawPositions::MultiAxis`].
    pub fn raw(&self) -> RawAxisMap {
        let stream = self.axes.stream();
        // The map is never written after its upload, so no later use needs ordering after the
        // read this records.
        let ptr = self.axes.device_ptr(stream).0;
        RawAxisMap {
            axes: RawBuf {
                ptr,
                len: self.axes.len(),
            },
            n_axes: self.n_axes,
        }
    }
}

/// An axis map given by address: `axes.len` `u8` axis indices at `axes.ptr`, for `n_axes`
/// axes. Its values are device data: the kernel clamps each to `n_axes - 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawAxisMap {
    /// One `u8` per pair.
    pub axes: RawBuf,
    /// Rows of the positions array, 1 to 4.
    pub n_axes: u32,
}

/// [`Positions`] with device arrays given by address: what [`crate::Rope::run_raw`] takes and
/// what the safe API reduces [`Positions`] to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawPositions {
    /// As [`Positions::Offset`].
    Offset(u32),
    /// As [`Positions::RowOffsets`].
    RowOffsets(RawInts),
    /// As [`Positions::Ids`].
    Ids {
        /// The ids.
        ids: RawInts,
        /// Their shape.
        shape: IdsShape,
    },
    /// As [`Positions::Varlen`].
    Varlen {
        /// Cumulative sequence lengths.
        cu_seqlens: RawInts,
        /// Per-sequence offsets.
        offsets: Option<RawInts>,
    },
    /// As [`Positions::VarlenContextParallel`].
    VarlenContextParallel {
        /// Cumulative whole-sequence lengths.
        cu_seqlens: RawInts,
        /// The ranks and this rank.
        split: ContextParallel,
    },
    /// As [`Positions::MultiAxis`].
    MultiAxis {
        /// `[n_axes, batch * seq]` positions.
        positions: RawInts,
        /// The axis of each pair.
        axes: RawAxisMap,
    },
}

/// What validation found: the kernel's position code and scalars, and the largest position of
/// [`Positions::Offset`] (tables must hold it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PositionsPlan {
    pub(crate) code: PositionCode,
    pub(crate) base: i64,
    pub(crate) count: u32,
    pub(crate) max_implicit: Option<u64>,
}

/// The encoded position arguments.
pub(crate) struct PositionArgs {
    pub(crate) positions: u32,
    pub(crate) pos_ptr: u64,
    pub(crate) pos_aux: u64,
    pub(crate) pos_count: u32,
    pub(crate) pos_base: i64,
}

impl DeviceInts<'_> {
    /// Binds the array for reading.
    fn bind<'s>(&'s self, binder: &mut Binder<'s>) -> Result<RawInts> {
        Ok(match self {
            Self::I32(v) => RawInts {
                buf: binder.read("positions", v)?,
                ty: IntType::I32,
            },
            Self::I64(v) => RawInts {
                buf: binder.read("positions", v)?,
                ty: IntType::I64,
            },
        })
    }
}

impl Positions<'_> {
    /// Reduces the option to its raw form; device arrays must belong to the binder's context.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `positions` for an array from another CUDA context.
    pub(crate) fn bind<'s>(&'s self, binder: &mut Binder<'s>) -> Result<RawPositions> {
        Ok(match self {
            Self::Offset(o) => RawPositions::Offset(*o),
            Self::RowOffsets(offsets) => RawPositions::RowOffsets(offsets.bind(binder)?),
            Self::Ids { ids, shape } => RawPositions::Ids {
                ids: ids.bind(binder)?,
                shape: *shape,
            },
            Self::Varlen {
                cu_seqlens,
                offsets,
            } => RawPositions::Varlen {
                cu_seqlens: cu_seqlens.bind(binder)?,
                offsets: offsets.as_ref().map(|o| o.bind(binder)).transpose()?,
            },
            Self::VarlenContextParallel { cu_seqlens, split } => {
                RawPositions::VarlenContextParallel {
                    cu_seqlens: cu_seqlens.bind(binder)?,
                    split: *split,
                }
            }
            Self::MultiAxis { positions, axes } => RawPositions::MultiAxis {
                positions: positions.bind(binder)?,
                axes: RawAxisMap {
                    axes: binder.read("positions", &axes.axes)?,
                    n_axes: axes.n_axes,
                },
            },
        })
    }
}

impl RawInts {
    /// Checks the length (`want` elements, described by `what`) and alignment.
    fn check(&self, want: u64, what: &str) -> Result<()> {
        if self.buf.len as u64 != want {
            return Err(invalid(
                "positions",
                format!("{what} holds {} elements, needs {want}", self.buf.len),
            ));
        }
        let size = self.ty.size();
        if !self.buf.ptr.is_multiple_of(size) {
            return Err(invalid(
                "positions",
                format!("{what} is not {size}-byte aligned"),
            ));
        }
        Ok(())
    }

    /// `(address, bytes)` of the array.
    fn bytes(&self) -> (u64, u64) {
        (
            self.buf.ptr,
            (self.buf.len as u64).saturating_mul(self.ty.size()),
        )
    }
}

impl RawPositions {
    /// Checks the positions against q's `batch` and `seq` and the `half` rotated pairs.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `positions`: arrays of the wrong length, type or
    /// alignment, packed sequences with a batch other than 1, axis maps of another length than
    /// `half` or with `n_axes` outside `1..=4`.
    pub(crate) fn check(&self, batch: usize, seq: usize, half: u32) -> Result<PositionsPlan> {
        let plan = |code, base, count, max_implicit| PositionsPlan {
            code,
            base,
            count,
            max_implicit,
        };
        let wide = |ints: &RawInts, i32_code, i64_code| match ints.ty {
            IntType::I32 => i32_code,
            IntType::I64 => i64_code,
        };
        Ok(match self {
            Self::Offset(o) => {
                let last = seq.saturating_sub(1) as u64;
                plan(PositionCode::Offset, *o as i64, 0, Some(*o as u64 + last))
            }
            Self::RowOffsets(offsets) => {
                offsets.check(batch as u64, "row offsets [batch]")?;
                // With one token per row (decoding), `offsets[b] + 0` is `ids[b * 1 + 0]`: the
                // per-row ids' kernel path, which measured 0.06-0.11 µs faster per launch than
                // the row-offset path for a decode step inside a CUDA graph on an H100.
                let code = if seq == 1 {
                    wide(
                        offsets,
                        PositionCode::IdsI32PerRow,
                        PositionCode::IdsI64PerRow,
                    )
                } else {
                    wide(
                        offsets,
                        PositionCode::RowOffsetsI32,
                        PositionCode::RowOffsetsI64,
                    )
                };
                plan(code, 0, 0, None)
            }
            Self::Ids { ids, shape } => {
                let (want, what) = match shape {
                    IdsShape::Shared => (seq as u64, "ids [seq]"),
                    IdsShape::PerRow => (
                        (batch as u64).saturating_mul(seq as u64),
                        "ids [batch, seq]",
                    ),
                };
                ids.check(want, what)?;
                let code = match (ids.ty, shape) {
                    (IntType::I32, IdsShape::Shared) => PositionCode::IdsI32Shared,
                    (IntType::I32, IdsShape::PerRow) => PositionCode::IdsI32PerRow,
                    (IntType::I64, IdsShape::Shared) => PositionCode::IdsI64Shared,
                    (IntType::I64, IdsShape::PerRow) => PositionCode::IdsI64PerRow,
                };
                plan(code, 0, 0, None)
            }
            Self::Varlen {
                cu_seqlens,
                offsets,
            } => {
                let count = check_varlen(cu_seqlens, offsets.as_ref(), batch)?;
                let code = wide(cu_seqlens, PositionCode::VarlenI32, PositionCode::VarlenI64);
                plan(code, 0, count, None)
            }
            Self::VarlenContextParallel { cu_seqlens, split } => {
                let count = check_varlen(cu_seqlens, None, batch)?;
                let code = wide(cu_seqlens, PositionCode::VarlenI32, PositionCode::VarlenI64);
                plan(code, split.split.to_base(), count, None)
            }
            Self::MultiAxis { positions, axes } => {
                let n = axes.n_axes;
                if !(1..=MAX_AXES).contains(&n) {
                    return Err(invalid(
                        "positions",
                        format!("n_axes must lie in 1..={MAX_AXES}, got {n}"),
                    ));
                }
                if axes.axes.len != half as usize {
                    return Err(invalid(
                        "positions",
                        format!(
                            "the axis map covers {} pairs, rotary_dim / 2 is {half}",
                            axes.axes.len
                        ),
                    ));
                }
                let tokens = (batch as u64).saturating_mul(seq as u64);
                positions.check(
                    u64::from(n).saturating_mul(tokens),
                    &format!("positions [{n} axes, batch * seq]"),
                )?;
                let code = wide(
                    positions,
                    PositionCode::MultiAxisI32,
                    PositionCode::MultiAxisI64,
                );
                plan(code, 0, n, None)
            }
        })
    }

    /// The device memory the kernel reads for positions, as `(address, bytes)` ranges.
    pub(crate) fn device_reads(&self) -> Vec<(u64, u64)> {
        match self {
            Self::Offset(_) => Vec::new(),
            Self::RowOffsets(ints)
            | Self::Ids { ids: ints, .. }
            | Self::VarlenContextParallel {
                cu_seqlens: ints, ..
            } => vec![ints.bytes()],
            Self::Varlen {
                cu_seqlens,
                offsets,
            } => std::iter::once(cu_seqlens)
                .chain(offsets)
                .map(RawInts::bytes)
                .collect(),
            Self::MultiAxis { positions, axes } => {
                vec![positions.bytes(), (axes.axes.ptr, axes.axes.len as u64)]
            }
        }
    }

    /// Encodes the kernel's position arguments for the validated `plan`.
    pub(crate) fn encode(&self, plan: &PositionsPlan) -> PositionArgs {
        let (pos_ptr, pos_aux) = match self {
            Self::Offset(_) => (0, 0),
            Self::RowOffsets(ints)
            | Self::Ids { ids: ints, .. }
            | Self::VarlenContextParallel {
                cu_seqlens: ints, ..
            } => (ints.buf.ptr, 0),
            Self::Varlen {
                cu_seqlens,
                offsets,
            } => (cu_seqlens.buf.ptr, offsets.map_or(0, |o| o.buf.ptr)),
            Self::MultiAxis { positions, axes } => (positions.buf.ptr, axes.axes.ptr),
        };
        PositionArgs {
            positions: plan.code as u32,
            pos_ptr,
            pos_aux,
            pos_count: plan.count,
            pos_base: plan.base,
        }
    }
}

/// Checks packed-sequence arrays (their lengths, types and alignment: their values are the
/// kernel's to guard) and returns the number of sequences.
fn check_varlen(cu_seqlens: &RawInts, offsets: Option<&RawInts>, batch: usize) -> Result<u32> {
    if batch != 1 {
        return Err(invalid(
            "positions",
            format!("varlen positions need batch 1 (Layout::thd), got {batch}"),
        ));
    }
    let n = cu_seqlens.buf.len.checked_sub(1).filter(|&n| n >= 1);
    let n = n.filter(|&n| n < u32::MAX as usize).ok_or_else(|| {
        invalid(
            "positions",
            format!(
                "cu_seqlens needs 2 to 2^32 - 1 entries (one more than the sequences), got {}",
                cu_seqlens.buf.len
            ),
        )
    })?;
    cu_seqlens.check(n as u64 + 1, "cu_seqlens [num_seqs + 1]")?;
    if let Some(o) = offsets {
        if o.ty != cu_seqlens.ty {
            return Err(invalid(
                "positions",
                "varlen offsets must have cu_seqlens's integer type",
            ));
        }
        o.check(n as u64, "offsets [num_seqs]")?;
    }
    Ok(n as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(ptr: u64, len: usize, ty: IntType) -> RawInts {
        RawInts {
            buf: RawBuf { ptr, len },
            ty,
        }
    }

    fn varlen(cu: usize, offsets: Option<RawInts>) -> RawPositions {
        RawPositions::Varlen {
            cu_seqlens: ints(0, cu, IntType::I32),
            offsets,
        }
    }

    #[test]
    fn varlen_arrays_need_one_more_boundary_than_offsets_and_one_type() {
        let plan = varlen(3, None).check(1, 10, 4).expect("two sequences");
        assert_eq!((plan.code, plan.count), (PositionCode::VarlenI32, 2));
        varlen(3, Some(ints(64, 2, IntType::I32)))
            .check(1, 10, 4)
            .expect("two offsets");
        for bad in [
            varlen(1, None),
            varlen(0, None),
            varlen(3, Some(ints(64, 3, IntType::I32))),
            varlen(3, Some(ints(64, 2, IntType::I64))),
            varlen(3, Some(ints(66, 2, IntType::I32))),
        ] {
            assert!(bad.check(1, 10, 4).is_err(), "{bad:?}");
        }
        assert!(varlen(3, None).check(2, 10, 4).is_err(), "batch 2");
    }

    #[test]
    fn only_offsets_bound_the_largest_position_on_the_host() {
        let plan = RawPositions::Offset(5).check(3, 10, 4).expect("valid");
        assert_eq!(plan.max_implicit, Some(14));
        let rows = RawPositions::RowOffsets(ints(0, 3, IntType::I64));
        let plan = rows.check(3, 4, 4).expect("valid");
        assert_eq!(
            (plan.code, plan.max_implicit),
            (PositionCode::RowOffsetsI64, None)
        );
    }

    #[test]
    fn row_offsets_of_one_token_rows_take_the_per_row_ids_path() {
        for (ty, code) in [
            (IntType::I32, PositionCode::IdsI32PerRow),
            (IntType::I64, PositionCode::IdsI64PerRow),
        ] {
            let plan = RawPositions::RowOffsets(ints(0, 64, ty)).check(64, 1, 4);
            assert_eq!(plan.expect("valid").code, code);
        }
    }

    #[test]
    fn rejects_arrays_of_the_wrong_length_or_alignment() {
        let ids = |ptr, len, shape| RawPositions::Ids {
            ids: ints(ptr, len, IntType::I64),
            shape,
        };
        ids(0, 4, IdsShape::Shared).check(3, 4, 4).expect("[seq]");
        ids(0, 12, IdsShape::PerRow)
            .check(3, 4, 4)
            .expect("[batch, seq]");
        assert!(ids(0, 12, IdsShape::Shared).check(3, 4, 4).is_err());
        assert!(
            ids(4, 4, IdsShape::Shared).check(3, 4, 4).is_err(),
            "misaligned"
        );
        let rows = |len| RawPositions::RowOffsets(ints(0, len, IntType::I32));
        assert!(rows(2).check(3, 4, 4).is_err());
        rows(3).check(3, 4, 4).expect("one per row");
    }

    fn arg_of<T: std::fmt::Debug>(r: Result<T>) -> &'static str {
        match r {
            Err(crate::Error::Invalid { arg, .. }) => arg,
            other => panic!("expected Error::Invalid, got {other:?}"),
        }
    }

    #[test]
    fn mrope_sections_take_consecutive_pairs() {
        // Written out by hand: t t h h h w for sections [2, 3, 1].
        let map = AxisMap::mrope([2, 3, 1], 12).expect("valid");
        assert_eq!((map.n_axes(), map.axes()), (3, &[0, 0, 1, 1, 1, 2][..]));
        // Qwen2.5-VL-7B: 16 temporal, 24 height, 24 width pairs.
        let qwen = AxisMap::mrope([16, 24, 24], 128).expect("valid");
        let count = |a| qwen.axes().iter().filter(|&&x| x == a).count();
        assert_eq!((count(0), count(1), count(2)), (16, 24, 24));
        assert_eq!(
            (qwen.axes()[15], qwen.axes()[16], qwen.axes()[40]),
            (0, 1, 2)
        );
    }

    #[test]
    fn interleaved_mrope_is_qwen3_vl_assignment() {
        // apply_interleaved_mrope: h at 1::3 below 3 s_h, w at 2::3 below 3 s_w, t elsewhere.
        let map = AxisMap::mrope_interleaved([4, 2, 2], 16).expect("valid");
        assert_eq!(map.axes(), &[0, 1, 2, 0, 1, 2, 0, 0]);
        // Qwen3-VL: [24, 20, 20] over 64 pairs: THW repeated 20 times, then TTTT.
        let q3 = AxisMap::mrope_interleaved([24, 20, 20], 128).expect("valid");
        let want: Vec<u8> = (0..64)
            .map(|j| if j >= 60 { 0 } else { (j % 3) as u8 })
            .collect();
        assert_eq!(q3.axes(), &want[..]);
    }

    #[test]
    fn axial_axes_own_contiguous_blocks() {
        let map = AxisMap::axial(&[4, 2, 6], 12).expect("valid");
        assert_eq!((map.n_axes(), map.axes()), (3, &[0, 0, 1, 2, 2, 2][..]));
        // FLUX: axes_dim [16, 56, 56] of head_dim 128.
        let flux = AxisMap::axial(&[16, 56, 56], 128).expect("valid");
        assert_eq!((flux.axes()[7], flux.axes()[8], flux.axes()[36]), (0, 1, 2));
    }

    #[test]
    fn rejects_invalid_multi_axis_descriptions() {
        assert_eq!(arg_of(AxisMap::mrope([16, 24, 23], 128)), "mrope_section");
        assert_eq!(arg_of(AxisMap::mrope([16, 24, 25], 128)), "mrope_section");
        assert_eq!(
            arg_of(AxisMap::mrope_interleaved([24, 20, 21], 128)),
            "mrope_section"
        );
        assert_eq!(arg_of(AxisMap::mrope([1, 1, 1], 7)), "rotary_dim");
        assert_eq!(arg_of(AxisMap::axial(&[16, 55, 57], 128)), "axes_dim");
        assert_eq!(arg_of(AxisMap::axial(&[16, 56, 54], 128)), "axes_dim");
        assert_eq!(arg_of(AxisMap::axial(&[0, 128], 128)), "axes_dim");
        assert_eq!(arg_of(AxisMap::axial(&[], 128)), "axes_dim");
        assert_eq!(arg_of(AxisMap::axial(&[2, 2, 2, 2, 2], 10)), "axes_dim");
        assert_eq!(arg_of(AxisMap::new(0, vec![0])), "axes");
        assert_eq!(arg_of(AxisMap::new(5, vec![0])), "axes");
        assert_eq!(arg_of(AxisMap::new(2, vec![0, 1, 2])), "axes");
        assert_eq!(arg_of(AxisMap::new(2, Vec::new())), "axes");
        AxisMap::new(4, vec![3, 0, 2, 1]).expect("valid");
    }

    fn multi(len: usize, ty: IntType, map_len: usize, n_axes: u32) -> RawPositions {
        RawPositions::MultiAxis {
            positions: ints(0, len, ty),
            axes: RawAxisMap {
                axes: RawBuf {
                    ptr: 1 << 20,
                    len: map_len,
                },
                n_axes,
            },
        }
    }

    #[test]
    fn multi_axis_positions_hold_one_row_per_axis_and_a_map_of_half_pairs() {
        // batch 2, seq 5: 10 tokens, 3 axes; 4 pairs.
        let plan = multi(30, IntType::I64, 4, 3).check(2, 5, 4).expect("valid");
        assert_eq!((plan.code, plan.count), (PositionCode::MultiAxisI64, 3));
        let plan = multi(30, IntType::I32, 4, 3).check(2, 5, 4).expect("valid");
        assert_eq!(plan.code, PositionCode::MultiAxisI32);
        for (bad, half) in [
            (multi(29, IntType::I64, 4, 3), 4),
            (multi(20, IntType::I64, 4, 3), 4),
            (multi(30, IntType::I64, 3, 3), 4),
            (multi(30, IntType::I64, 4, 3), 5),
            (multi(0, IntType::I64, 4, 0), 4),
            (multi(50, IntType::I64, 4, 5), 4),
        ] {
            assert_eq!(arg_of(bad.check(2, 5, half)), "positions", "{bad:?}");
        }
        let misaligned = RawPositions::MultiAxis {
            positions: ints(4, 30, IntType::I64),
            axes: RawAxisMap {
                axes: RawBuf { ptr: 0, len: 4 },
                n_axes: 3,
            },
        };
        assert_eq!(arg_of(misaligned.check(2, 5, 4)), "positions");
        let args = multi(30, IntType::I32, 4, 3).encode(&plan);
        assert_eq!(
            (args.positions, args.pos_aux, args.pos_count),
            (PositionCode::MultiAxisI32 as u32, 1 << 20, 3)
        );
    }
}
