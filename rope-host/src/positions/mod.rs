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
//! positions also the kernel's `cos_sin_axes`, since each pair reads its own axis; their axis
//! maps live in `axes.rs`).

use cudarc::driver::CudaView;
use std::num::NonZeroU32;

use rope_kernels::abi::{ContextParallelSplit, MAX_AXES, PositionCode};

use crate::bind::{Binder, RawBuf};
use crate::error::{Result, invalid};

mod axes;

pub(crate) use axes::check_axes_dim;
pub use axes::{AxisMap, DeviceAxisMap, ItemAxes, RawAxisMap};

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
    /// `c = L / (2 * size)`. Positions are derived in the kernel: no id tensor is built. The
    /// split is a launch argument (a CUDA graph replays the captured one), the boundaries
    /// device data.
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

/// What validation found: the kernel's position code and scalars, the largest position of
/// [`Positions::Offset`] (tables must hold it) and, for multi-axis positions, the map's
/// [`ItemAxes`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PositionsPlan {
    pub(crate) code: PositionCode,
    pub(crate) base: i64,
    pub(crate) count: u32,
    pub(crate) max_implicit: Option<u64>,
    pub(crate) item_axes: ItemAxes,
}

impl PositionsPlan {
    /// The plan for launches of `pairs` pairs per work item: multi-axis positions whose map puts
    /// each item's pairs on one axis take the group-axes codes (one position per item, the
    /// map not read), the rest stay as they are.
    pub(crate) fn for_items(self, pairs: u32) -> Self {
        let code = match self.code {
            PositionCode::MultiAxisI32 => PositionCode::GroupAxesI32,
            PositionCode::MultiAxisI64 => PositionCode::GroupAxesI64,
            _ => return self,
        };
        match self.item_axes.for_pairs(pairs) {
            Some(groups) => Self {
                code,
                base: groups.to_base(),
                ..self
            },
            None => self,
        }
    }
}

/// The encoded position arguments.
pub(crate) struct PositionArgs {
    pub(crate) position_code: u32,
    pub(crate) pos_ptr: u64,
    pub(crate) pos_aux: u64,
    pub(crate) pos_count: u32,
    pub(crate) pos_base: i64,
}

impl DeviceInts<'_> {
    /// Binds the array for reading; `arg` names it in errors.
    pub(crate) fn bind<'s>(
        &'s self,
        arg: &'static str,
        binder: &mut Binder<'s>,
    ) -> Result<RawInts> {
        Ok(match self {
            Self::I32(v) => RawInts {
                buf: binder.read(arg, v)?,
                ty: IntType::I32,
            },
            Self::I64(v) => RawInts {
                buf: binder.read(arg, v)?,
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
            Self::RowOffsets(offsets) => {
                RawPositions::RowOffsets(offsets.bind("positions", binder)?)
            }
            Self::Ids { ids, shape } => RawPositions::Ids {
                ids: ids.bind("positions", binder)?,
                shape: *shape,
            },
            Self::Varlen {
                cu_seqlens,
                offsets,
            } => RawPositions::Varlen {
                cu_seqlens: cu_seqlens.bind("positions", binder)?,
                offsets: offsets
                    .as_ref()
                    .map(|o| o.bind("positions", binder))
                    .transpose()?,
            },
            Self::VarlenContextParallel { cu_seqlens, split } => {
                RawPositions::VarlenContextParallel {
                    cu_seqlens: cu_seqlens.bind("positions", binder)?,
                    split: *split,
                }
            }
            Self::MultiAxis { positions, axes } => RawPositions::MultiAxis {
                positions: positions.bind("positions", binder)?,
                axes: RawAxisMap {
                    axes: binder.read("positions", &axes.axes)?,
                    n_axes: axes.n_axes,
                    item_axes: axes.item_axes,
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
            item_axes: ItemAxes::UNKNOWN,
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
                // per-row ids' kernel path, which is faster than the row-offset path for a
                // decode step inside a CUDA graph (docs/perf/decisions.md).
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
                PositionsPlan {
                    item_axes: axes.item_axes,
                    ..plan(code, 0, n, None)
                }
            }
        })
    }

    /// The device memory the kernel reads for positions, as `(address, bytes)` ranges (at
    /// most two; no allocation, this runs on every launch).
    pub(crate) fn device_reads(&self) -> [Option<(u64, u64)>; 2] {
        match self {
            Self::Offset(_) => [None, None],
            Self::RowOffsets(ints)
            | Self::Ids { ids: ints, .. }
            | Self::VarlenContextParallel {
                cu_seqlens: ints, ..
            } => [Some(ints.bytes()), None],
            Self::Varlen {
                cu_seqlens,
                offsets,
            } => [Some(cu_seqlens.bytes()), offsets.map(|o| o.bytes())],
            Self::MultiAxis { positions, axes } => [
                Some(positions.bytes()),
                Some((axes.axes.ptr, axes.axes.len as u64)),
            ],
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
            position_code: plan.code as u32,
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
mod tests;
