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
//! A new position kind touches this file and the kernel's `position` function.

use cudarc::driver::CudaView;
use rope_kernels::abi::PositionCode;

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
    /// Checks the positions against q's `batch` and `seq`.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `positions`: arrays of the wrong length, type or
    /// alignment, packed sequences with a batch other than 1.
    pub(crate) fn check(&self, batch: usize, seq: usize) -> Result<PositionsPlan> {
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
        })
    }

    /// The device memory the kernel reads for positions, as `(address, bytes)` ranges.
    pub(crate) fn device_reads(&self) -> Vec<(u64, u64)> {
        match self {
            Self::Offset(_) => Vec::new(),
            Self::RowOffsets(ints) | Self::Ids { ids: ints, .. } => vec![ints.bytes()],
            Self::Varlen {
                cu_seqlens,
                offsets,
            } => std::iter::once(cu_seqlens)
                .chain(offsets)
                .map(RawInts::bytes)
                .collect(),
        }
    }

    /// Encodes the kernel's position arguments for the validated `plan`.
    pub(crate) fn encode(&self, plan: &PositionsPlan) -> PositionArgs {
        let (pos_ptr, pos_aux) = match self {
            Self::Offset(_) => (0, 0),
            Self::RowOffsets(ints) | Self::Ids { ids: ints, .. } => (ints.buf.ptr, 0),
            Self::Varlen {
                cu_seqlens,
                offsets,
            } => (cu_seqlens.buf.ptr, offsets.map_or(0, |o| o.buf.ptr)),
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
        let plan = varlen(3, None).check(1, 10).expect("two sequences");
        assert_eq!((plan.code, plan.count), (PositionCode::VarlenI32, 2));
        varlen(3, Some(ints(64, 2, IntType::I32)))
            .check(1, 10)
            .expect("two offsets");
        for bad in [
            varlen(1, None),
            varlen(0, None),
            varlen(3, Some(ints(64, 3, IntType::I32))),
            varlen(3, Some(ints(64, 2, IntType::I64))),
            varlen(3, Some(ints(66, 2, IntType::I32))),
        ] {
            assert!(bad.check(1, 10).is_err(), "{bad:?}");
        }
        assert!(varlen(3, None).check(2, 10).is_err(), "batch 2");
    }

    #[test]
    fn only_offsets_bound_the_largest_position_on_the_host() {
        let plan = RawPositions::Offset(5).check(3, 10).expect("valid");
        assert_eq!(plan.max_implicit, Some(14));
        let rows = RawPositions::RowOffsets(ints(0, 3, IntType::I64));
        let plan = rows.check(3, 4).expect("valid");
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
            let plan = RawPositions::RowOffsets(ints(0, 64, ty)).check(64, 1);
            assert_eq!(plan.expect("valid").code, code);
        }
    }

    #[test]
    fn rejects_arrays_of_the_wrong_length_or_alignment() {
        let ids = |ptr, len, shape| RawPositions::Ids {
            ids: ints(ptr, len, IntType::I64),
            shape,
        };
        ids(0, 4, IdsShape::Shared).check(3, 4).expect("[seq]");
        ids(0, 12, IdsShape::PerRow)
            .check(3, 4)
            .expect("[batch, seq]");
        assert!(ids(0, 12, IdsShape::Shared).check(3, 4).is_err());
        assert!(
            ids(4, 4, IdsShape::Shared).check(3, 4).is_err(),
            "misaligned"
        );
        let rows = |len| RawPositions::RowOffsets(ints(0, len, IntType::I32));
        assert!(rows(2).check(3, 4).is_err());
        rows(3).check(3, 4).expect("one per row");
    }
}
