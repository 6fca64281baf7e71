//! What every RoPE launch is configured by: the element types ([`RopeElem`]) and the
//! configuration ([`RopeConfig`], built and validated by [`RopeConfigBuilder`]): head size,
//! rotated features and their offset, pairing and direction.

use cudarc::driver::DeviceRepr;
pub use rope_kernels::abi::{DType, Direction, RopeStyle};

use crate::error::{Result, invalid};

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
    rotary_offset: u32,
    style: RopeStyle,
    direction: Direction,
}

impl RopeConfig {
    /// Starts a configuration for heads of `head_dim` elements paired by `style`.
    pub fn builder(head_dim: u32, style: RopeStyle) -> RopeConfigBuilder {
        RopeConfigBuilder {
            head_dim,
            rotary_dim: None,
            rotary_offset: 0,
            style,
            direction: Direction::Forward,
        }
    }
    /// Elements per head.
    pub fn head_dim(&self) -> u32 {
        self.head_dim
    }
    /// Rotated elements per head (`rotary_offset..rotary_offset + rotary_dim`; the rest pass
    /// through).
    pub fn rotary_dim(&self) -> u32 {
        self.rotary_dim
    }
    /// The first rotated element of each head (0 unless set).
    pub fn rotary_offset(&self) -> u32 {
        self.rotary_offset
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
    rotary_offset: u32,
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

    /// Rotate elements `rotary_offset..rotary_offset + rotary_dim` of each head instead of the
    /// first `rotary_dim`, the others passing through (copied out of place, untouched in
    /// place): DeepSeek-V2/V3's multi-head latent attention keeps the rotary part of a head
    /// after its `qk_nope_head_dim` other features. Defaults to 0.
    ///
    /// With interleaved pairs the offset must be even; the kernels' access width is the
    /// largest that divides it (an offset that is a multiple of 8 elements, or 4 for NeoX
    /// pairs of 16-bit elements, keeps the widest accesses).
    pub fn rotary_offset(mut self, rotary_offset: u32) -> Self {
        self.rotary_offset = rotary_offset;
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
    /// [`crate::Error::Invalid`] naming `head_dim` when it is zero or odd, `rotary_dim`
    /// when it is zero, odd or larger than `head_dim`, or `rotary_offset` when
    /// `rotary_offset + rotary_dim` exceeds `head_dim` or interleaved pairs would start at an
    /// odd offset (no access of whole pairs is aligned there).
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
        let offset = self.rotary_offset;
        if u64::from(offset) + u64::from(rotary_dim) > u64::from(self.head_dim) {
            return Err(invalid(
                "rotary_offset",
                format!(
                    "rotary_offset {offset} + rotary_dim {rotary_dim} exceeds head_dim {}",
                    self.head_dim
                ),
            ));
        }
        if self.style == RopeStyle::Interleaved && !offset.is_multiple_of(2) {
            return Err(invalid(
                "rotary_offset",
                format!("interleaved pairs need an even rotary_offset, got {offset}"),
            ));
        }
        Ok(RopeConfig {
            head_dim: self.head_dim,
            rotary_dim,
            rotary_offset: offset,
            style: self.style,
            direction: self.direction,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

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
        for (style, r, o) in [
            (RopeStyle::Neox, 64, 65),
            (RopeStyle::Neox, 128, 1),
            (RopeStyle::Interleaved, 64, 3),
            (RopeStyle::Interleaved, 2, u32::MAX),
        ] {
            let err = RopeConfig::builder(128, style)
                .rotary_dim(r)
                .rotary_offset(o)
                .build()
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::Invalid {
                        arg: "rotary_offset",
                        ..
                    }
                ),
                "{err}"
            );
        }
        let mla = RopeConfig::builder(192, RopeStyle::Interleaved)
            .rotary_dim(64)
            .rotary_offset(128)
            .build()
            .expect("DeepSeek-V3's q head: 128 + 64");
        assert_eq!((mla.rotary_offset(), mla.half()), (128, 32));
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
}
