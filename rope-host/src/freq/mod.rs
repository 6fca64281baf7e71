//! Rotary frequencies computed on the host in `f64`: the default family and the scaling
//! families models publish in their configs (Hugging Face's `rope_scaling`).
//!
//! Every family yields one `inv_freq[i]` per rotated pair `i < rotary_dim / 2` and an attention
//! factor that multiplies cos and sin (1 except for YaRN and LongRoPE). The kernels consume the
//! vector ([`crate::Frequencies`]) for in-kernel sin/cos, and [`crate::Rope::build_tables_for`]
//! builds tables from the same vector.

use cudarc::driver::{CudaSlice, DevicePtr};
pub use rope_kernels::math::AngleMode;

use crate::error::{Result, invalid};

mod config;
mod families;
mod scaling;
#[cfg(test)]
mod tests;

pub use config::{ConfigBase, ConfigValue, DEFAULT_THETA, ROPE_SCALING_KEYS};
pub use scaling::{RopeScaling, Yarn, YarnBlend, axial_inv_freq};

use families::{Lowest, check_frequencies, check_frequencies_from};

/// The largest frequency [`FrequencySpec::build`] and the in-kernel path accept: `2^20`.
///
/// The kernels reduce `angle = position * inv_freq` modulo `pi/2` by rounding `angle * 2/pi`
/// with the `1.5 * 2^52` trick (`rope_kernels::math::cos_sin_f32`), which is defined for
/// `|angle| < 2^51`; with every frequency at most `2^20`, every position of magnitude below
/// `2^31` stays there (`2^31 * 2^20 = 2^51`), so in-kernel cos/sin are finite and within `[-1, 1]`
/// over the whole range they are specified for. The one-ulp accuracy of `rope_kernels::math`
/// holds where the angle is below `2^32`: at every position below `2^31` for frequencies up to 1,
/// which is every default-family frequency with `theta >= 1`.
const MAX_INV_FREQ: f64 = 1_048_576.0;

/// The range of an attention factor, `[1e-3, 1e3]`.
///
/// The factor multiplies cos and sin (as an `f32`), so every rotated output, and attention
/// logits by its square. Published forms stay close to 1: YaRN's `0.1 ln(factor) + 1` is at
/// most 2.39 for factors up to `2^20`, Phi-3's LongRoPE factor is 1.19, DeepSeek's mscale ratio
/// is 1 (equal `mscale` and `mscale_all_dim`). The range rejects only descriptions that would scale outputs a thousandfold (logits a
/// millionfold) or shrink them to nothing, while it keeps the factor a normal `f32` either way.
const ATTENTION_RANGE: (f64, f64) = (1e-3, 1e3);

/// The range of a scaling factor (`factor`, LongRoPE's `short_factor`/`long_factor` entries),
/// `[2^-20, 2^20]`.
///
/// The lower end is the frequency bound: the first frequency is 1 in every family and a factor
/// divides it, so a factor below `2^-20` takes it past [`MAX_INV_FREQ`]. The upper end is the
/// same distance on the other side, a millionfold context extension, against published ones of
/// at most a few hundred; it keeps every scaled frequency within `2^20` of its base one.
const FACTOR_RANGE: (f64, f64) = (1.0 / 1_048_576.0, 1_048_576.0);

/// The default RoPE frequencies for `rotary_dim` rotated features:
/// `inv_freq[i] = theta^(-2i / rotary_dim)` for `i < rotary_dim / 2`, in `f64`.
///
/// Unchecked: for `theta` below 1 the frequencies grow with `i` and may exceed `2^20` or
/// overflow. [`FrequencySpec::build`] accepts a `theta` only when every one of these frequencies
/// is finite, positive and at most `2^20`, so that `position * inv_freq` stays below `2^51`,
/// where the kernels' reduction of the angle is defined, for every position below `2^31` (the
/// range over which in-kernel sin/cos are specified). Every `theta >= 1` passes (its frequencies
/// are at most 1).
pub fn inv_freq(theta: f64, rotary_dim: u32) -> Vec<f64> {
    (0..rotary_dim / 2)
        .map(|i| theta.powf(-2.0 * f64::from(i) / f64::from(rotary_dim)))
        .collect()
}

/// [`inv_freq`] after checking its arguments and result: every family's base in
/// [`FrequencySpec::build`], and the check for the in-kernel path ([`crate::SinCos::Computed`])
/// to call, whose `theta` is held to the same bound.
///
/// # Errors
/// [`crate::Error::Invalid`] naming `theta` when it is not finite and positive or when a
/// frequency is above `2^20` (a `theta` far below 1, such as `1e-300`), and `rotary_dim` when it
/// is odd or below 2.
pub(crate) fn checked_inv_freq(theta: f64, rotary_dim: u32) -> Result<Vec<f64>> {
    if !(theta.is_finite() && theta > 0.0) {
        return Err(invalid(
            "theta",
            format!("must be finite and positive, got {theta}"),
        ));
    }
    if rotary_dim < 2 || !rotary_dim.is_multiple_of(2) {
        return Err(invalid(
            "rotary_dim",
            format!("must be even and at least 2, got {rotary_dim}"),
        ));
    }
    let f = inv_freq(theta, rotary_dim);
    check_frequencies("theta", || format!("theta {theta}"), &f)?;
    Ok(f)
}

/// Checks that `theta` and `rotary_dim` give default frequencies the kernels take, without
/// computing them: `rotary_dim` even and at least 2, `theta` finite and positive, and the
/// extreme frequencies `1` and `theta^(-(rotary_dim - 2) / rotary_dim)` within the bounds
/// [`FrequencySpec::build`] holds every family to.
///
/// # Errors
/// [`crate::Error::Invalid`] naming `rotary_dim` or `theta`.
pub fn check_default_frequencies(theta: f64, rotary_dim: u32) -> Result<()> {
    if rotary_dim < 2 || !rotary_dim.is_multiple_of(2) {
        return Err(invalid(
            "rotary_dim",
            format!("must be even and at least 2, got {rotary_dim}"),
        ));
    }
    check_theta(theta, rotary_dim)
}

/// Checks `theta` for the default family of `rotary_dim` (even, at least 2) as
/// [`checked_inv_freq`] does, without building the vector: the frequencies `theta^(-2i/d)` are
/// monotonic in `i`, so the first (1) and the last bound them. What the in-kernel path
/// ([`crate::SinCos::Computed`]) and [`crate::Rope::build_tables`] check at every call.
///
/// # Errors
/// [`crate::Error::Invalid`] naming `theta` when it is not finite and positive or a frequency
/// is above `2^20`.
pub(crate) fn check_theta(theta: f64, rotary_dim: u32) -> Result<()> {
    if !(theta.is_finite() && theta > 0.0) {
        return Err(invalid(
            "theta",
            format!("must be finite and positive, got {theta}"),
        ));
    }
    let last = rotary_dim / 2 - 1;
    let extreme = theta.powf(-2.0 * f64::from(last) / f64::from(rotary_dim));
    check_frequencies("theta", || format!("theta {theta}"), &[1.0, extreme])
}

/// Everything that defines a frequency vector: base, rotated features, family, angle mode.
#[derive(Clone, Debug, PartialEq)]
pub struct FrequencySpec {
    /// `rope_theta`, the base.
    pub theta: f64,
    /// Rotated features (`head_dim * partial_rotary_factor`), even.
    pub rotary_dim: u32,
    /// The family.
    pub scaling: RopeScaling,
    /// How the kernels form angles from these frequencies.
    pub angle: AngleMode,
}

impl FrequencySpec {
    /// The default family at `theta` with exact angles.
    pub fn new(theta: f64, rotary_dim: u32) -> Self {
        Self {
            theta,
            rotary_dim,
            scaling: RopeScaling::Default,
            angle: AngleMode::Exact,
        }
    }

    /// The same spec with another family.
    pub fn scaling(mut self, scaling: RopeScaling) -> Self {
        self.scaling = scaling;
        self
    }

    /// The same spec with another angle mode.
    pub fn angle(mut self, angle: AngleMode) -> Self {
        self.angle = angle;
        self
    }

    /// Computes `(inv_freq, attention_factor)` in `f64`.
    ///
    /// An accepted spec yields `rotary_dim / 2` frequencies, each finite, positive (or zero, for
    /// the pairs [`RopeScaling::Proportional`] leaves unrotated) and at most `2^20`, so that
    /// `position * inv_freq` stays below `2^51`, where the kernels' reduction of the angle is
    /// defined, for every position below `2^31` (the range over which in-kernel sin/cos are
    /// specified); and an attention factor in `[1e-3, 1e3]` (see [`RopeScaling`]).
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `theta`, `rotary_dim` or `scaling` (its problem names
    /// the config field) for parameters outside their family's domain, listed on each
    /// [`RopeScaling`] variant: `theta` not finite and positive (or not above 1 for YaRN),
    /// `rotary_dim` odd or below 2, factors outside `[2^-20, 2^20]`, lengths of zero (and
    /// LongRoPE's original context of 1), factor lists of the wrong length,
    /// `low_freq_factor >= high_freq_factor`, ...; and, as a final check on what the family
    /// computed, for any frequency that is not finite, positive and at most `2^20` or an
    /// attention factor outside `[1e-3, 1e3]`.
    pub fn build(&self) -> Result<(Vec<f64>, f64)> {
        let (theta, d) = (self.theta, self.rotary_dim);
        let base = checked_inv_freq(theta, d)?;
        let (f, attention) = match &self.scaling {
            RopeScaling::Default => (base, 1.0),
            RopeScaling::Axial { axes_dim } => {
                crate::positions::check_axes_dim(axes_dim, d).map_err(|e| match e {
                    crate::Error::Invalid { problem, .. } => {
                        invalid("scaling", format!("axes_dim {problem}"))
                    }
                    other => other,
                })?;
                (axial_inv_freq(theta, axes_dim), 1.0)
            }
            RopeScaling::Linear { factor } => families::linear(base, *factor)?,
            RopeScaling::DynamicNtk {
                factor,
                max_position_embeddings,
                seq_len,
            } => families::dynamic_ntk((theta, d), *factor, *max_position_embeddings, *seq_len)?,
            RopeScaling::DynamicNtkAlpha { alpha } => {
                families::dynamic_ntk_alpha((theta, d), *alpha)?
            }
            RopeScaling::Ntk { factor, mixed_b } => families::ntk((theta, d), *factor, *mixed_b)?,
            RopeScaling::Proportional {
                partial_rotary_factor,
                factor,
            } => families::proportional(base, *partial_rotary_factor, *factor)?,
            RopeScaling::Yarn(y) => families::yarn(theta, d, y)?,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => families::llama3(
                base,
                *factor,
                (*low_freq_factor, *high_freq_factor),
                *original_max_position_embeddings,
            )?,
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                factor,
                original_max_position_embeddings,
                max_position_embeddings,
                seq_len,
                attention_factor,
            } => families::longrope(
                base,
                (short_factor, long_factor),
                *factor,
                (
                    *original_max_position_embeddings,
                    *max_position_embeddings,
                    *seq_len,
                ),
                *attention_factor,
            )?,
        };
        // The final check: whatever the family computed, an accepted spec never hands the
        // kernels a frequency or attention factor outside the bounds documented above.
        let (arg, freq_field, attention_field) = self.scaling.blame();
        let lowest = match self.scaling {
            RopeScaling::Proportional { .. } => Lowest::Zero,
            _ => Lowest::Positive,
        };
        check_frequencies_from(lowest, arg, || freq_field.to_string(), &f)?;
        let (lo, hi) = ATTENTION_RANGE;
        if !(attention.is_finite() && (lo..=hi).contains(&attention)) {
            return Err(invalid(
                arg,
                format!(
                    "{attention_field} gives attention factor {attention}, outside [{lo}, {hi}]"
                ),
            ));
        }
        Ok((f, attention))
    }
}

/// A frequency vector given by the caller in the precision its framework holds it, for
/// [`crate::Rope::frequencies_from`].
///
/// Hugging Face's models compute `inv_freq = 1 / theta^(2i/d)` in `f32`, and about a third of
/// those entries differ from the `f32` nearest the exact value, which is what the `f64`
/// frequencies of a [`FrequencySpec`] round to under [`AngleMode::F32Compat`]. The model's own
/// `f32` vector, with [`AngleMode::F32Compat`], reproduces its angles `f32(p) * inv_freq[i]`
/// exactly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum InvFreq<'a> {
    /// `f32` frequencies, widened exactly to `f64`.
    F32(&'a [f32]),
    /// `f64` frequencies.
    F64(&'a [f64]),
}

impl InvFreq<'_> {
    /// The frequencies in `f64` and the rotary width they serve (`2 * len`), after the checks
    /// [`FrequencySpec::build`] makes of what it computes.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `inv_freq` when it is empty, when `2 * len` does not fit
    /// a `u32`, or when an entry is not finite, negative or above `2^20` (zero entries, which
    /// leave their pairs as they are, are taken: Gemma 4's proportional vectors end in them).
    pub(crate) fn checked(self) -> Result<(Vec<f64>, u32)> {
        let f: Vec<f64> = match self {
            Self::F32(f) => f.iter().map(|&v| f64::from(v)).collect(),
            Self::F64(f) => f.to_vec(),
        };
        if f.is_empty() {
            return Err(invalid(
                "inv_freq",
                "must hold at least one frequency (rotary_dim is twice its length), got none",
            ));
        }
        let rotary_dim = u32::try_from(f.len())
            .ok()
            .and_then(|n| n.checked_mul(2))
            .ok_or_else(|| {
                invalid(
                    "inv_freq",
                    format!(
                        "holds {} frequencies; rotary_dim, twice that, must fit a u32",
                        f.len()
                    ),
                )
            })?;
        let cause = || "the given vector".to_string();
        check_frequencies_from(Lowest::Zero, "inv_freq", cause, &f)?;
        Ok((f, rotary_dim))
    }
}

/// `attention_factor` if it lies in `[1e-3, 1e3]`, the range [`FrequencySpec::build`] holds
/// computed attention factors to.
///
/// # Errors
/// [`crate::Error::Invalid`] naming `attention_factor` when it is outside that range or NaN.
pub(crate) fn check_attention_factor(attention_factor: f64) -> Result<f64> {
    let (lo, hi) = ATTENTION_RANGE;
    if attention_factor.is_finite() && (lo..=hi).contains(&attention_factor) {
        Ok(attention_factor)
    } else {
        Err(invalid(
            "attention_factor",
            format!("must lie in [{lo}, {hi}], got {attention_factor}"),
        ))
    }
}

/// A frequency vector on the device, ready for [`crate::SinCos::Frequencies`] and
/// [`crate::Rope::build_tables_for`]; made by [`crate::Rope::frequencies`] or
/// [`crate::Rope::frequencies_from`].
#[derive(Debug)]
pub struct Frequencies {
    pub(crate) inv_freq: CudaSlice<f64>,
    pub(crate) rotary_dim: u32,
    pub(crate) attention_factor: f64,
    pub(crate) angle: AngleMode,
}

impl Frequencies {
    /// Rotated features these frequencies are for.
    pub fn rotary_dim(&self) -> u32 {
        self.rotary_dim
    }
    /// The factor multiplying cos and sin (YaRN's and LongRoPE's attention scaling; else 1).
    pub fn attention_factor(&self) -> f64 {
        self.attention_factor
    }
    /// How the kernels form angles from these frequencies.
    pub fn angle(&self) -> AngleMode {
        self.angle
    }
    /// The sin/cos source of these frequencies for [`crate::Rope::run_raw`]. The vector is
    /// complete on the device when [`crate::Rope::frequencies`] returns, so launches on any
    /// stream may read it.
    pub fn raw(&self) -> crate::RawSinCos {
        let stream = self.inv_freq.stream();
        // The vector is never written after its upload, so no later use needs ordering after
        // the read this records.
        let ptr = self.inv_freq.device_ptr(stream).0;
        crate::RawSinCos::Frequencies {
            inv_freq: crate::RawBuf {
                ptr,
                len: self.inv_freq.len(),
            },
            rotary_dim: self.rotary_dim,
            angle: self.angle,
            attention_factor: self.attention_factor as f32,
        }
    }
}
