//! Which of `apply_rope`'s mutually exclusive arguments a call gave, and what they select:
//! where positions come from ([`positions`]), whether they are per-axis positions
//! ([`axes`]) and where sin/cos come from ([`sincos`]). Pure, so every combination is tested
//! without Python; `native.rs` fills the inputs in.

use crate::dlpack::ArgError;

/// What a call gave for `positions=`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PositionsGiven {
    /// Nothing.
    None,
    /// An int.
    Int(i64),
    /// A tensor.
    Tensor,
}

/// Where positions come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PositionsKind {
    /// `p = offset + s` (an int, default 0).
    Offset(u32),
    /// `p = positions[b] + s`: a tensor `[batch]`.
    RowOffsets,
    /// `p = position_ids[s]` or `position_ids[b, s]`.
    Ids,
    /// Packed sequences: `cu_seqlens`, with per-sequence offsets when `positions` is a tensor.
    Varlen {
        /// `positions` is a tensor of per-sequence offsets.
        offsets: bool,
    },
    /// Packed sequences split over `cp_size > 1` context-parallel ranks: `cu_seqlens` of the
    /// whole sequences, this rank `cp_rank`.
    VarlenContextParallel {
        /// The ranks.
        cp_size: u32,
        /// This rank.
        cp_rank: u32,
    },
}

/// Picks the position source from `positions=`, whether `position_ids=` and `cu_seqlens=`
/// were given, and the context-parallel split `(cp_size, cp_rank)` (`(1, 0)`: none).
///
/// # Errors
/// [`ArgError::Value`] naming the argument for contradicting combinations, an offset
/// outside `0..2^32`, and a split other than `(1, 0)` without `cu_seqlens` or with
/// per-sequence offsets (its range is rope-host's to check).
pub fn positions(
    positions: PositionsGiven,
    position_ids: bool,
    cu_seqlens: bool,
    (cp_size, cp_rank): (u32, u32),
) -> Result<PositionsKind, ArgError> {
    let value = |m: &str| Err(ArgError::Value(m.into()));
    if (cp_size, cp_rank) != (1, 0) {
        return match (positions, position_ids, cu_seqlens) {
            (PositionsGiven::None | PositionsGiven::Int(0), false, true) => {
                Ok(PositionsKind::VarlenContextParallel { cp_size, cp_rank })
            }
            (_, _, false) => value(
                "cp_size: a context-parallel split needs cu_seqlens (the whole sequences' \
                 boundaries)",
            ),
            _ => value(
                "cp_size: with a context-parallel split, positions come from cu_seqlens alone \
                 (no positions or position_ids)",
            ),
        };
    }
    match (positions, position_ids, cu_seqlens) {
        (_, true, true) => value("position_ids: give position_ids or cu_seqlens, not both"),
        // An offset of 0 is the default, which the Python layer passes along with ids.
        (PositionsGiven::None | PositionsGiven::Int(0), true, false) => Ok(PositionsKind::Ids),
        (_, true, false) => value(
            "positions: give positions (start positions) or position_ids (one per token), not both",
        ),
        (PositionsGiven::Tensor, false, false) => Ok(PositionsKind::RowOffsets),
        (PositionsGiven::Tensor, false, true) => Ok(PositionsKind::Varlen { offsets: true }),
        (PositionsGiven::None | PositionsGiven::Int(0), false, true) => {
            Ok(PositionsKind::Varlen { offsets: false })
        }
        (PositionsGiven::Int(_), false, true) => value(
            "positions: with cu_seqlens, give per-sequence offsets as a tensor [num_seqs], not \
             an int",
        ),
        (PositionsGiven::None, false, false) => Ok(PositionsKind::Offset(0)),
        (PositionsGiven::Int(o), false, false) => {
            u32::try_from(o).map(PositionsKind::Offset).map_err(|_| {
                ArgError::Value(format!(
                    "positions must be an offset in 0..2^32 (or a tensor), got {o}"
                ))
            })
        }
    }
}

/// Per-axis positions as `mrope_section=`/`mrope_interleaved=` or `axes_dim=` ask for them:
/// `position_ids` holds a row of positions per axis (`[n_axes, batch, seq]` or `[n_axes,
/// tokens]`) and each rotated pair rotates at its axis's row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Axes {
    /// mRoPE: the pairs of each head split into temporal, height and width sections, in blocks
    /// in that order (Qwen2-VL, Qwen2.5-VL) or interleaved `T H W T H W ...` (Qwen3-VL); the
    /// sections sum to `rotary_dim / 2` (rope-host checks).
    Mrope {
        sections: [u32; 3],
        interleaved: bool,
    },
    /// N-D axial RoPE (FLUX's `EmbedND`): axis `a` owns `axes_dim[a] / 2` consecutive pairs,
    /// rotated with `theta^(-2i / axes_dim[a])` when sin/cos come from `theta`; the widths sum
    /// to `rotary_dim` (rope-host checks).
    Axial { axes_dim: Vec<u32> },
}

impl Axes {
    /// Rows of `position_ids`.
    pub fn n_axes(&self) -> usize {
        match self {
            Self::Mrope { .. } => 3,
            Self::Axial { axes_dim } => axes_dim.len(),
        }
    }
}

/// The per-axis positions of a call (`None` without `mrope_section` and `axes_dim`), whose
/// positions come from `kind`.
///
/// # Errors
/// [`ArgError::Value`] naming `mrope_section` when it has other than three entries,
/// `axes_dim` for other than one to four entries or with `mrope_section`, either when the
/// positions are not `position_ids`, and `mrope_interleaved` when given without sections.
pub fn axes(
    section: Option<&[u32]>,
    interleaved: bool,
    axes_dim: Option<&[u32]>,
    kind: PositionsKind,
) -> Result<Option<Axes>, ArgError> {
    let value = |m: &str| Err(ArgError::Value(m.into()));
    if interleaved && section.is_none() {
        return value("mrope_interleaved: given without mrope_section");
    }
    let (axes, name) = match (section, axes_dim) {
        (None, None) => return Ok(None),
        (Some(_), Some(_)) => return value("axes_dim: give mrope_section or axes_dim, not both"),
        (Some(section), None) => {
            let sections: [u32; 3] = section.try_into().map_err(|_| {
                ArgError::Value(format!(
                    "mrope_section must have three entries (temporal, height, width pairs), got {}",
                    section.len()
                ))
            })?;
            (
                Axes::Mrope {
                    sections,
                    interleaved,
                },
                "mrope_section",
            )
        }
        (None, Some(dims)) => {
            if !(1..=4).contains(&dims.len()) {
                return Err(ArgError::Value(format!(
                    "axes_dim must have 1 to 4 entries (one per axis), got {}",
                    dims.len()
                )));
            }
            (
                Axes::Axial {
                    axes_dim: dims.to_vec(),
                },
                "axes_dim",
            )
        }
    };
    if kind != PositionsKind::Ids {
        return Err(ArgError::Value(format!(
            "{name}: per-axis positions come from position_ids, [{n}, batch, seq] or [{n}, \
             tokens] (one row per axis)",
            n = axes.n_axes()
        )));
    }
    Ok(Some(axes))
}

/// Which sin/cos arguments a call gave (`angle` only when it differs from the default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SinCosGiven {
    /// `theta=`.
    pub theta: bool,
    /// `scaling=`.
    pub scaling: bool,
    /// `inv_freq=`.
    pub inv_freq: bool,
    /// `cos_sin_cache=`.
    pub cos_sin_cache: bool,
    /// `cos=`.
    pub cos: bool,
    /// `sin=`.
    pub sin: bool,
    /// `attention_factor=`.
    pub attention_factor: bool,
    /// `angle=`.
    pub angle: bool,
}

/// Where sin/cos come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SinCosKind {
    /// Computed from `theta` (default 10 000) and `angle`.
    Theta,
    /// Computed from the frequencies of `scaling` (with `theta` as its base).
    Scaling,
    /// Computed from the given `inv_freq` (and `attention_factor`).
    InvFreq,
    /// Read from `cos_sin_cache`.
    Cache,
    /// Read from `cos` and `sin`.
    Tables,
}

/// Picks the sin/cos source from the arguments given.
///
/// # Errors
/// [`ArgError::Value`] naming the argument: more than one source, `cos` without `sin` (or the
/// reverse), or an argument the chosen source does not read (`theta` with tables or
/// `inv_freq`, `attention_factor` anywhere but with `inv_freq`, `angle` with tables).
pub fn sincos(g: SinCosGiven) -> Result<SinCosKind, ArgError> {
    let err = |m: &str| Err(ArgError::Value(m.into()));
    if g.cos != g.sin {
        return err("cos and sin: give both tables or neither");
    }
    let sources = [g.cos_sin_cache, g.cos, g.inv_freq, g.scaling];
    if sources.iter().filter(|&&s| s).count() > 1 {
        return err(
            "cos_sin_cache: give one sin/cos source: cos_sin_cache, cos and sin, inv_freq, or \
             scaling (with theta), or theta alone",
        );
    }
    let tables = g.cos_sin_cache || g.cos;
    if tables {
        let name = if g.cos {
            "cos and sin"
        } else {
            "cos_sin_cache"
        };
        for (given, arg, why) in [
            (g.theta, "theta", "the table holds the angles"),
            (g.angle, "angle", "the table holds the angles"),
            (
                g.attention_factor,
                "attention_factor",
                "scale the table instead",
            ),
        ] {
            if given {
                return Err(ArgError::Value(format!(
                    "{arg}: unused with {name} ({why})"
                )));
            }
        }
        return Ok(if g.cos {
            SinCosKind::Tables
        } else {
            SinCosKind::Cache
        });
    }
    if g.inv_freq {
        if g.theta {
            return err("theta: unused with inv_freq (the frequencies are given)");
        }
        return Ok(SinCosKind::InvFreq);
    }
    if g.attention_factor {
        return err(if g.scaling {
            "attention_factor: give it inside scaling (\"attention_factor\")"
        } else {
            "attention_factor: only with inv_freq (scaling families compute their own)"
        });
    }
    Ok(if g.scaling {
        SinCosKind::Scaling
    } else {
        SinCosKind::Theta
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No context-parallel split.
    const NO_SPLIT: (u32, u32) = (1, 0);

    fn is_value<T: std::fmt::Debug>(r: Result<T, ArgError>, needle: &str) {
        match r {
            Err(ArgError::Value(m)) => assert!(m.contains(needle), "{m:?} lacks {needle:?}"),
            other => panic!("expected a ValueError with {needle:?}, got {other:?}"),
        }
    }

    /// Sections of three entries or one to four axis widths with position_ids select
    /// per-axis positions; other counts, both, other position sources and interleaving alone
    /// name their argument.
    #[test]
    fn per_axis_positions_take_position_ids() {
        assert_eq!(axes(None, false, None, PositionsKind::Ids), Ok(None));
        assert_eq!(
            axes(Some(&[16, 24, 24]), true, None, PositionsKind::Ids),
            Ok(Some(Axes::Mrope {
                sections: [16, 24, 24],
                interleaved: true
            }))
        );
        let flux = axes(None, false, Some(&[16, 56, 56]), PositionsKind::Ids);
        assert_eq!(
            flux.clone().map(|a| a.map(|a| a.n_axes())),
            Ok(Some(3)),
            "{flux:?}"
        );
        is_value(
            axes(Some(&[16, 24]), false, None, PositionsKind::Ids),
            "mrope_section must have three entries",
        );
        is_value(
            axes(None, false, Some(&[8, 8, 8, 8, 8]), PositionsKind::Ids),
            "axes_dim must have 1 to 4 entries",
        );
        is_value(
            axes(Some(&[16, 24, 24]), false, Some(&[128]), PositionsKind::Ids),
            "axes_dim: give mrope_section or axes_dim, not both",
        );
        is_value(
            axes(Some(&[16, 24, 24]), false, None, PositionsKind::Offset(0)),
            "mrope_section: per-axis positions come from position_ids, [3, batch, seq]",
        );
        is_value(
            axes(None, false, Some(&[32, 32]), PositionsKind::Offset(0)),
            "axes_dim: per-axis positions come from position_ids, [2, batch, seq]",
        );
        is_value(
            axes(None, true, None, PositionsKind::Ids),
            "mrope_interleaved: given without mrope_section",
        );
    }

    #[test]
    fn positions_pick_one_source() {
        use PositionsGiven::{Int, None, Tensor};
        assert_eq!(
            positions(None, false, false, NO_SPLIT),
            Ok(PositionsKind::Offset(0))
        );
        assert_eq!(
            positions(Int(7), false, false, NO_SPLIT),
            Ok(PositionsKind::Offset(7))
        );
        assert_eq!(
            positions(Tensor, false, false, NO_SPLIT),
            Ok(PositionsKind::RowOffsets)
        );
        assert_eq!(
            positions(None, true, false, NO_SPLIT),
            Ok(PositionsKind::Ids)
        );
        // What the Python layer passes with ids: the default offset.
        assert_eq!(
            positions(Int(0), true, false, NO_SPLIT),
            Ok(PositionsKind::Ids)
        );
        assert_eq!(
            positions(Tensor, false, true, NO_SPLIT),
            Ok(PositionsKind::Varlen { offsets: true })
        );
        assert_eq!(
            positions(Int(0), false, true, NO_SPLIT),
            Ok(PositionsKind::Varlen { offsets: false })
        );
        is_value(
            positions(Int(3), true, false, NO_SPLIT),
            "positions: give positions",
        );
        is_value(
            positions(None, true, true, NO_SPLIT),
            "position_ids: give position_ids",
        );
        is_value(
            positions(Int(3), false, true, NO_SPLIT),
            "per-sequence offsets",
        );
        is_value(
            positions(Int(-1), false, false, NO_SPLIT),
            "positions must be an offset",
        );
        is_value(positions(Int(1 << 32), false, false, NO_SPLIT), "0..2^32");
    }

    #[test]
    fn context_parallel_splits_need_cu_seqlens_alone() {
        use PositionsGiven::{Int, None, Tensor};
        assert_eq!(
            positions(None, false, true, (4, 1)),
            Ok(PositionsKind::VarlenContextParallel {
                cp_size: 4,
                cp_rank: 1
            })
        );
        // What the Python layer passes by default: offset 0; a rank alone is a split too.
        assert_eq!(
            positions(Int(0), false, true, (1, 1)),
            Ok(PositionsKind::VarlenContextParallel {
                cp_size: 1,
                cp_rank: 1
            })
        );
        is_value(positions(None, false, false, (2, 0)), "needs cu_seqlens");
        is_value(positions(Tensor, false, true, (2, 0)), "cu_seqlens alone");
        is_value(positions(None, true, true, (2, 0)), "cu_seqlens alone");
        is_value(positions(None, true, false, (2, 0)), "needs cu_seqlens");
    }

    #[test]
    fn sincos_sources_exclude_each_other() {
        let g = SinCosGiven::default;
        assert_eq!(sincos(g()), Ok(SinCosKind::Theta));
        let theta = SinCosGiven {
            theta: true,
            angle: true,
            ..g()
        };
        assert_eq!(sincos(theta), Ok(SinCosKind::Theta));
        let scaling = SinCosGiven {
            theta: true,
            scaling: true,
            ..g()
        };
        assert_eq!(sincos(scaling), Ok(SinCosKind::Scaling));
        let inv = SinCosGiven {
            inv_freq: true,
            attention_factor: true,
            angle: true,
            ..g()
        };
        assert_eq!(sincos(inv), Ok(SinCosKind::InvFreq));
        let cache = SinCosGiven {
            cos_sin_cache: true,
            ..g()
        };
        assert_eq!(sincos(cache), Ok(SinCosKind::Cache));
        let tables = SinCosGiven {
            cos: true,
            sin: true,
            ..g()
        };
        assert_eq!(sincos(tables), Ok(SinCosKind::Tables));
    }

    #[test]
    fn sincos_rejects_what_the_source_does_not_read() {
        let g = SinCosGiven::default;
        is_value(
            sincos(SinCosGiven { cos: true, ..g() }),
            "cos and sin: give both",
        );
        is_value(
            sincos(SinCosGiven {
                cos_sin_cache: true,
                inv_freq: true,
                ..g()
            }),
            "give one sin/cos source",
        );
        is_value(
            sincos(SinCosGiven {
                cos_sin_cache: true,
                theta: true,
                ..g()
            }),
            "theta: unused with cos_sin_cache",
        );
        is_value(
            sincos(SinCosGiven {
                cos: true,
                sin: true,
                angle: true,
                ..g()
            }),
            "angle: unused with cos and sin",
        );
        is_value(
            sincos(SinCosGiven {
                inv_freq: true,
                theta: true,
                ..g()
            }),
            "theta: unused with inv_freq",
        );
        is_value(
            sincos(SinCosGiven {
                scaling: true,
                attention_factor: true,
                ..g()
            }),
            "give it inside scaling",
        );
        is_value(
            sincos(SinCosGiven {
                attention_factor: true,
                ..g()
            }),
            "attention_factor: only with inv_freq",
        );
    }
}
