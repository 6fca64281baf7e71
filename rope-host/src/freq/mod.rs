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
#[cfg(test)]
mod tests;

pub use config::{ConfigBase, ConfigValue, DEFAULT_THETA, ROPE_SCALING_KEYS};

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

/// YaRN's parameters (`rope_type: "yarn"`), with the defaults of the published method.
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    /// `factor`: context extension ratio `s`.
    pub factor: f64,
    /// `original_max_position_embeddings`: the pre-training context `L`, in tokens.
    pub original_max_position_embeddings: u32,
    /// `beta_fast` (default 32): rotations above which a dimension is extrapolated.
    pub beta_fast: f64,
    /// `beta_slow` (default 1): rotations below which a dimension is interpolated.
    pub beta_slow: f64,
    /// `mscale` (DeepSeek's form of the attention factor), if given.
    pub mscale: Option<f64>,
    /// `mscale_all_dim`, if given.
    pub mscale_all_dim: Option<f64>,
    /// `attention_factor`, if given: overrides the computed one.
    pub attention_factor: Option<f64>,
    /// `truncate` (default true): round the correction range outwards to whole dimensions.
    pub truncate: bool,
    /// The coefficient `c` of `mscale(m) = c m ln(factor) + 1` (default 0.1, the YaRN paper's and
    /// transformers'; TeleChat3 uses 0.07, as vLLM's `TeleChat3RoPEScaledRotaryEmbedding`
    /// computes it).
    pub mscale_coefficient: f64,
    /// How each frequency blends its interpolated and extrapolated values (default
    /// [`YarnBlend::Linear`]).
    pub blend: YarnBlend,
}

/// How YaRN blends a dimension's interpolated frequency `f / factor` and extrapolated one `f`,
/// with the extrapolation weight `w = 1 - ramp` of its dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum YarnBlend {
    /// `(f / factor) (1 - w) + f w`: the YaRN paper's, transformers' and vLLM's `yarn`.
    Linear,
    /// `exp(w ln f + (1 - w) ln(f / factor)) = f factor^(w - 1)`: Grok-1's `yarn_log` (vLLM's
    /// `Grok1ScalingRotaryEmbedding`, which leaves cos and sin unscaled: set
    /// `attention_factor` to 1 for it).
    Log,
}

impl Yarn {
    /// YaRN with `factor` over a pre-training context of `original_max_position_embeddings`
    /// tokens, other fields at their defaults.
    pub fn new(factor: f64, original_max_position_embeddings: u32) -> Self {
        Self {
            factor,
            original_max_position_embeddings,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            attention_factor: None,
            truncate: true,
            mscale_coefficient: 0.1,
            blend: YarnBlend::Linear,
        }
    }
}

/// A frequency family with its parameters, named and typed as model configs have them: factors
/// are `f64`, lengths in tokens are integers (`u32` for the config's context lengths, `u64` for
/// the current sequence length, which may exceed every `u32` position by one).
///
/// Each variant's domain is checked by [`FrequencySpec::build`], on top of what every family
/// needs (`theta` finite and positive with every `theta^(-2i/d)` at most `2^20`, `rotary_dim`
/// even and at least 2). Throughout, a factor lies in `[2^-20, 2^20]`, a length
/// (`original_max_position_embeddings`, `max_position_embeddings`, `seq_len`) is nonzero, and
/// an `attention_factor` lies in `[1e-3, 1e3]`; and whatever the family computes is checked
/// again: every frequency finite, positive and at most `2^20`, the attention factor in
/// `[1e-3, 1e3]`.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// `theta^(-2i/d)`.
    ///
    /// Domain: what every family needs, nothing more.
    Default,
    /// Position interpolation (`rope_type: "linear"`): `inv_freq / factor`.
    ///
    /// Domain: `factor` in `[2^-20, 2^20]`.
    Linear {
        /// `factor`.
        factor: f64,
    },
    /// Dynamic NTK (`rope_type: "dynamic"`): for a sequence longer than the model's
    /// `max_position_embeddings`, which this family reads as the original context `L0`, the
    /// base grows to `theta * (factor * seq_len / L0 - (factor - 1))^(d / (d - 2))`.
    ///
    /// Domain: `factor` in `[2^-20, 2^20]`, lengths nonzero, `rotary_dim > 2`, and the grown
    /// base finite (the growth lies in `[1, 2^84]` up to rounding and its power in
    /// `[1, 2^168]`, so the base is finite for every `theta` below `4e257`).
    DynamicNtk {
        /// `factor`.
        factor: f64,
        /// `max_position_embeddings`: the context the model was trained for (the config's
        /// top-level field, not one inside `rope_scaling`).
        max_position_embeddings: u32,
        /// The current sequence length in tokens (the base is unchanged up to
        /// `max_position_embeddings`).
        seq_len: u64,
    },
    /// Dynamic NTK with `alpha` (Hunyuan's `rope_scaling: {"type": "dynamic", "alpha": ..}`,
    /// vLLM's `DynamicNTKAlphaRotaryEmbedding`): the base grows to
    /// `theta * alpha^(d / (d - 2))` (`d = rotary_dim`) whatever the sequence length.
    ///
    /// Domain: `alpha` in `[1, 2^20]` (the base only grows, so every frequency stays within
    /// the default family's), `rotary_dim > 2`, and the grown base finite (the growth lies in
    /// `[1, 2^40]`, so the base is finite for every `theta` below `1e296`).
    DynamicNtkAlpha {
        /// `alpha`.
        alpha: f64,
    },
    /// NTK-aware scaling (vLLM's `rope_type: "ntk"`, `NTKScalingRotaryEmbedding`, after
    /// kexue.fm/archives/9706; GTE's multilingual encoders): with `mixed_b` absent, the default
    /// frequencies of base `theta * factor` divided by `factor^(2/d)`, that is
    /// `theta^(-2i/d) * factor^(-(2i + 2)/d)`; with `mixed_b = b`, `theta^(-2i/d) / lambda_(i+1)`
    /// with `lambda_m = exp(a m^b)` and `a = ln(factor) / (d/2)^b` (so `b = 1` is the form
    /// without it). Attention factor 1, at every sequence length.
    ///
    /// Domain: `factor` in `[1, 2^20]` (the base only grows, so every frequency stays within
    /// the default family's), `mixed_b` in `(0, 16]` when given, and `theta * factor` finite
    /// (every `theta` below `1e302`).
    Ntk {
        /// `factor`.
        factor: f64,
        /// `mixed_b`, if given.
        mixed_b: Option<f64>,
    },
    /// Gemma 4's proportional RoPE (`rope_type: "proportional"`, transformers'
    /// `_compute_proportional_rope_parameters`): the whole head rotates as NeoX pairs
    /// (`rotary_dim` is the head size `d`), the first `floor(partial_rotary_factor * d / 2)`
    /// pairs with `theta^(-2i/d) / factor` (exponents over the whole head, not the rotated
    /// share) and the others with frequency zero, which leaves them as they are. Attention
    /// factor 1. (vLLM's `Gemma4RotaryEmbedding` leaves `factor` out; Gemma 4's configs have none,
    /// so 1.)
    ///
    /// Domain: `partial_rotary_factor` in `(0, 1]`, `factor` in `[2^-20, 2^20]`. The frequencies
    /// past the rotated share are zero, the one family whose frequencies may be.
    Proportional {
        /// `partial_rotary_factor` (0.25 for Gemma 4's full-attention layers).
        partial_rotary_factor: f64,
        /// `factor` (1 when the config has none).
        factor: f64,
    },
    /// YaRN (`rope_type: "yarn"`): interpolation blended with extrapolation by a linear ramp
    /// over the dimensions between the `beta_slow` and `beta_fast` rotation counts, and an
    /// attention factor `c ln(factor) + 1` with `c = mscale_coefficient` (0.1; or its `mscale`
    /// form).
    ///
    /// Domain: `theta > 1` (its logarithm divides the correction range), `factor` in
    /// `[2^-20, 2^20]`, `original_max_position_embeddings` nonzero, `beta_fast` and
    /// `beta_slow` finite and positive with finite correction dimensions
    /// (`original / (beta * 2 pi)` neither overflowing nor underflowing), `mscale` and
    /// `mscale_all_dim` finite and non-negative when given, `mscale_coefficient` in `[0, 1]`,
    /// and the attention factor in
    /// `[1e-3, 1e3]`. The order of `beta_fast` and `beta_slow` is not checked: reversed, the
    /// ramp runs the other way, finite still.
    Yarn(Yarn),
    /// Llama 3.1 (`rope_type: "llama3"`): wavelengths above `original / low_freq_factor` are
    /// divided by `factor`, below `original / high_freq_factor` kept, smoothly blended between.
    ///
    /// Domain: `factor` in `[2^-20, 2^20]`, `low_freq_factor` and `high_freq_factor` finite and
    /// positive with `low_freq_factor < high_freq_factor` (their difference divides),
    /// `original_max_position_embeddings` nonzero.
    Llama3 {
        /// `factor` (8 for Llama 3.1).
        factor: f64,
        /// `low_freq_factor` (1).
        low_freq_factor: f64,
        /// `high_freq_factor` (4).
        high_freq_factor: f64,
        /// `original_max_position_embeddings` (8192), in tokens.
        original_max_position_embeddings: u32,
    },
    /// LongRoPE / Phi-3 (`rope_type: "longrope"`): `inv_freq[i] = 1 / (ext[i] * theta^(2i/d))`
    /// with `ext = long_factor` when `seq_len > original_max_position_embeddings` and
    /// `short_factor` otherwise; attention factor `sqrt(1 + ln(s) / ln(original))` for the
    /// extension ratio `s > 1` (1 for `s <= 1`), where `s` is `factor` when given and
    /// `max_position_embeddings / original_max_position_embeddings` otherwise, as Hugging Face's
    /// `_compute_longrope_parameters` computes it.
    ///
    /// Domain: `original_max_position_embeddings` at least 2 (its logarithm divides),
    /// `max_position_embeddings` and `seq_len` nonzero, `factor` in `[2^-20, 2^20]` when given,
    /// `rotary_dim / 2` entries in each factor list, each in `[2^-20, 2^20]`, and the attention
    /// factor in `[1e-3, 1e3]` (a computed one lies in `[1, sqrt(32)]` for these lengths and
    /// factors).
    LongRope {
        /// `short_factor`, one per pair.
        short_factor: Vec<f64>,
        /// `long_factor`, one per pair.
        long_factor: Vec<f64>,
        /// `factor`, if given: the extension ratio the attention factor is computed from
        /// (Phi-3's configs leave it out, and the ratio of the two lengths stands for it).
        factor: Option<f64>,
        /// `original_max_position_embeddings`: the pre-training context, in tokens (configs
        /// without it use `max_position_embeddings`).
        original_max_position_embeddings: u32,
        /// `max_position_embeddings`: the extended context, in tokens.
        max_position_embeddings: u32,
        /// The current sequence length in tokens (chooses long or short factors).
        seq_len: u64,
        /// `attention_factor`, if given: overrides the computed one.
        attention_factor: Option<f64>,
    },
    /// N-D axial RoPE (FLUX's `EmbedND`, with [`crate::AxisMap::axial`] for the positions):
    /// axis `a` owns a contiguous block of `axes_dim[a] / 2` pairs, in axis order, with its own
    /// frequencies `theta^(-2i / axes_dim[a])` for `i < axes_dim[a] / 2`; attention factor 1.
    ///
    /// Domain: 1 to 4 axes, each width even and nonzero, the widths summing to `rotary_dim`,
    /// and every axis's frequencies at most `2^20` (every `theta >= 1`).
    Axial {
        /// `axes_dim`: each axis's rotated features.
        axes_dim: Vec<u32>,
    },
}

/// FLUX's per-axis frequencies: `theta^(-2i / d_a)` for `i < d_a / 2`, axis after axis, in
/// `f64`. Unchecked, as [`inv_freq`] (see [`RopeScaling::Axial`] for the checked form).
pub fn axial_inv_freq(theta: f64, axes_dim: &[u32]) -> Vec<f64> {
    axes_dim
        .iter()
        .flat_map(|&d| (0..d / 2).map(move |i| theta.powf(-2.0 * f64::from(i) / f64::from(d))))
        .collect()
}

impl RopeScaling {
    /// The fields [`FrequencySpec::build`]'s final check names when this family's output is out
    /// of bounds: the argument, the field that scaled the frequencies and the one (or ones) that
    /// made the attention factor.
    fn blame(&self) -> (&'static str, &'static str, &'static str) {
        match self {
            Self::Default => ("theta", "theta", "theta"),
            Self::Axial { .. } => ("scaling", "axes_dim", "axes_dim"),
            Self::DynamicNtkAlpha { .. } => ("scaling", "alpha", "alpha"),
            Self::Linear { .. } | Self::DynamicNtk { .. } | Self::Llama3 { .. } => {
                ("scaling", "factor", "factor")
            }
            Self::Proportional { .. } => ("scaling", "factor", "factor"),
            Self::Ntk { mixed_b, .. } => (
                "scaling",
                if mixed_b.is_some() {
                    "factor and mixed_b"
                } else {
                    "factor"
                },
                "factor",
            ),
            Self::Yarn(y) => (
                "scaling",
                "factor",
                match (y.attention_factor, y.mscale, y.mscale_all_dim) {
                    (Some(_), _, _) => "attention_factor",
                    (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                        "mscale and mscale_all_dim"
                    }
                    _ => "factor",
                },
            ),
            Self::LongRope {
                factor,
                original_max_position_embeddings,
                seq_len,
                attention_factor,
                ..
            } => (
                "scaling",
                if *seq_len > u64::from(*original_max_position_embeddings) {
                    "long_factor"
                } else {
                    "short_factor"
                },
                match (attention_factor, factor) {
                    (Some(_), _) => "attention_factor",
                    (None, Some(_)) => "factor",
                    (None, None) => "original_max_position_embeddings and max_position_embeddings",
                },
            ),
        }
    }
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
    /// the pairs [`RopeScaling::Proportional`] leaves unrotated) and at most `2^20`, so that `position * inv_freq` stays below `2^51`, where the kernels' reduction of
    /// the angle is defined, for every position below `2^31` (the range over which in-kernel
    /// sin/cos are specified); and an attention factor in `[1e-3, 1e3]` (see [`RopeScaling`]).
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
