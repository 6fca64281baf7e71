//! Where each token's position comes from: the public [`Positions`] option, its validation, what
//! it uploads and how it encodes into the kernel's `positions`, `pos_ptr`, `pos_aux`,
//! `pos_count` and `pos_base` arguments (the kernel's side is `position` in
//! `kernels-gpu/src/rope.rs`, decoding [`PositionCode`]).
//!
//! A new position kind touches this file and the kernel's `position` function.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr};
use kernels_gpu::abi::PositionCode;

use crate::bind::{Binder, Buf};
use crate::error::{Result, invalid};

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
    /// Packed variable-length sequences ([`crate::Layout::thd`], batch 1): token `t` of
    /// sequence `i` (`cu_seqlens[i] <= t < cu_seqlens[i + 1]`) is at
    /// `t - cu_seqlens[i] + offsets[i]`. `cu_seqlens` has one more entry than there are
    /// sequences, starts at 0, never decreases and ends at the total token count. Copied to the
    /// device at each launch.
    Varlen {
        /// Cumulative sequence lengths, `[num_seqs + 1]`.
        cu_seqlens: &'a [u32],
        /// Per-sequence position offsets (cached tokens), `[num_seqs]`; `None` for zeros.
        offsets: Option<&'a [u32]>,
    },
}

/// The integer type of explicit ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IdType {
    I32,
    I64,
}

impl IdType {
    /// Bytes per id.
    pub(crate) const fn size(self) -> u64 {
        match self {
            Self::I32 => 4,
            Self::I64 => 8,
        }
    }
}

/// [`Positions`] at launch time: device views reduced to [`Buf`]s (their pointer guards held
/// by the [`Binder`]), host slices as they are. What validation and encoding read.
#[derive(Clone, Copy, Debug)]
pub(crate) enum BoundPositions<'a> {
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

/// What validation found: the kernel's position code and scalars, and the largest position the
/// implicit and packed kinds give (tables must hold it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PositionsPlan {
    pub(crate) code: PositionCode,
    pub(crate) base: i64,
    pub(crate) count: u32,
    pub(crate) max_implicit: Option<u64>,
}

/// The encoded position arguments, with the uploads they point into.
pub(crate) struct PositionArgs {
    pub(crate) positions: u32,
    pub(crate) pos_ptr: u64,
    pub(crate) pos_aux: u64,
    pub(crate) pos_count: u32,
    pub(crate) pos_base: i64,
    /// Host arrays copied to the device for this launch; freed (stream-ordered) after it.
    pub(crate) _uploads: Vec<CudaSlice<u32>>,
}

impl<'a> Positions<'a> {
    /// Reduces the option to its launch-time form; device views must belong to the binder's
    /// context.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `positions` for ids from another CUDA context.
    pub(crate) fn bind<'s>(&'s self, binder: &mut Binder<'s>) -> Result<BoundPositions<'s>>
    where
        'a: 's,
    {
        Ok(match self {
            Self::Offset(o) => BoundPositions::Offset(*o),
            Self::RowOffsets(offsets) => BoundPositions::RowOffsets(offsets),
            Self::Ids { ids, shape } => {
                let (ids, ty) = match ids {
                    PositionIds::I32(v) => (binder.read("positions", v)?, IdType::I32),
                    PositionIds::I64(v) => (binder.read("positions", v)?, IdType::I64),
                };
                BoundPositions::Ids {
                    ids,
                    ty,
                    shape: *shape,
                }
            }
            Self::Varlen {
                cu_seqlens,
                offsets,
            } => BoundPositions::Varlen {
                cu_seqlens,
                offsets: *offsets,
            },
        })
    }
}

impl BoundPositions<'_> {
    /// Checks the positions against q's `batch` and `seq`.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `positions`: row offsets not one per batch row, ids of
    /// the wrong length or misaligned, malformed `cu_seqlens` or offsets.
    pub(crate) fn check(&self, batch: usize, seq: usize) -> Result<PositionsPlan> {
        let last = seq.saturating_sub(1) as u64;
        let implicit = |code, base, count, max_implicit| PositionsPlan {
            code,
            base,
            count,
            max_implicit,
        };
        Ok(match *self {
            Self::Offset(o) => implicit(PositionCode::Offset, o as i64, 0, Some(o as u64 + last)),
            Self::RowOffsets(offsets) => {
                if offsets.len() != batch {
                    return Err(invalid(
                        "positions",
                        format!("{} row offsets for a batch of {batch}", offsets.len()),
                    ));
                }
                let max = offsets.iter().max().map(|&m| m as u64 + last);
                implicit(PositionCode::RowOffsets, 0, 0, max)
            }
            Self::Ids { ids, ty, shape } => {
                let (want, what) = match shape {
                    IdsShape::Shared => (seq as u64, "[seq]"),
                    IdsShape::PerRow => ((batch as u64).saturating_mul(seq as u64), "[batch, seq]"),
                };
                if ids.len as u64 != want {
                    return Err(invalid(
                        "positions",
                        format!("ids hold {} elements, {what} needs {want}", ids.len),
                    ));
                }
                if !ids.addr.is_multiple_of(ty.size()) {
                    let size = ty.size();
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
                implicit(code, 0, 0, None)
            }
            Self::Varlen {
                cu_seqlens,
                offsets,
            } => {
                let max = check_varlen(cu_seqlens, offsets, batch, seq)?;
                let count = (cu_seqlens.len() - 1) as u32;
                implicit(PositionCode::Varlen, 0, count, max)
            }
        })
    }

    /// The device memory the kernel reads for positions, in bytes: `(address, bytes)`.
    pub(crate) fn device_reads(&self) -> Option<(u64, u64)> {
        match self {
            Self::Ids { ids, ty, .. } => {
                Some((ids.addr, (ids.len as u64).saturating_mul(ty.size())))
            }
            _ => None,
        }
    }

    /// Uploads host arrays and encodes the kernel's position arguments for the validated
    /// `plan`.
    ///
    /// # Errors
    /// [`crate::Error::Driver`] when a copy to the device fails.
    pub(crate) fn encode(
        &self,
        plan: &PositionsPlan,
        stream: &Arc<CudaStream>,
    ) -> Result<PositionArgs> {
        let mut uploads = Vec::new();
        let mut upload = |host: &[u32]| -> Result<u64> {
            let slice = stream.clone_htod(host)?;
            let ptr = slice.device_ptr(stream).0;
            uploads.push(slice);
            Ok(ptr)
        };
        let (pos_ptr, pos_aux) = match *self {
            Self::Offset(_) => (0, 0),
            Self::RowOffsets(offsets) => (upload(offsets)?, 0),
            Self::Ids { ids, .. } => (ids.addr, 0),
            Self::Varlen {
                cu_seqlens,
                offsets,
            } => {
                let cu = upload(cu_seqlens)?;
                (cu, offsets.map(&mut upload).transpose()?.unwrap_or(0))
            }
        };
        Ok(PositionArgs {
            positions: plan.code as u32,
            pos_ptr,
            pos_aux,
            pos_count: plan.count,
            pos_base: plan.base,
            _uploads: uploads,
        })
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn varlen<'a>(cu_seqlens: &'a [u32], offsets: Option<&'a [u32]>) -> BoundPositions<'a> {
        BoundPositions::Varlen {
            cu_seqlens,
            offsets,
        }
    }

    #[test]
    fn accepts_only_well_formed_cu_seqlens() {
        for (cu, ok) in [
            (&[0u32, 4, 10][..], true),
            (&[0, 0, 10], true),
            (&[0, 5, 4, 10], false),
            (&[1, 4, 10], false),
            (&[0, 4, 9], false),
            (&[0], false),
        ] {
            assert_eq!(varlen(cu, None).check(1, 10).is_ok(), ok, "{cu:?}");
        }
        assert!(varlen(&[0, 4, 10], None).check(2, 10).is_err(), "batch 2");
        assert!(
            varlen(&[0, 4, 10], Some(&[1])).check(1, 10).is_err(),
            "one offset"
        );
    }

    #[test]
    fn largest_implicit_position_counts_offsets() {
        // Positions reach max(4 - 1 + 3, 6 - 1 + 0) = 6.
        let plan = varlen(&[0, 4, 10], Some(&[3, 0]))
            .check(1, 10)
            .expect("valid");
        assert_eq!((plan.max_implicit, plan.count), (Some(6), 2));
        let plan = BoundPositions::Offset(5).check(3, 10).expect("valid");
        assert_eq!(plan.max_implicit, Some(14));
        let plan = BoundPositions::RowOffsets(&[2, 9, 0])
            .check(3, 4)
            .expect("valid");
        assert_eq!(plan.max_implicit, Some(12));
    }

    #[test]
    fn rejects_ids_of_the_wrong_length_or_alignment() {
        let ids = |addr, len, shape| BoundPositions::Ids {
            ids: Buf { addr, len },
            ty: IdType::I64,
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
        assert!(BoundPositions::RowOffsets(&[1, 2]).check(3, 4).is_err());
    }
}
