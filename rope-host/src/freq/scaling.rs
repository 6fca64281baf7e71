//! The scaling families as models publish them: [`RopeScaling`] and its parameters, named and
//! typed as in the configs, with each family's domain (their formulas are in `families.rs`,
//! their computation in [`super::FrequencySpec::build`]).

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
/// Each variant's domain is checked by [`FrequencySpec::build`](super::FrequencySpec::build),
/// on top of what every family needs (`theta` finite and positive with every `theta^(-2i/d)` at
/// most `2^20`, `rotary_dim` even and at least 2). Throughout, a factor lies in
/// `[2^-20, 2^20]`, a length (`original_max_position_embeddings`, `max_position_embeddings`,
/// `seq_len`) is nonzero, and an `attention_factor` lies in `[1e-3, 1e3]`; and whatever the
/// family computes is checked again: every frequency finite, positive (zero only for the pairs
/// [`RopeScaling::Proportional`] leaves unrotated) and at most `2^20`, the attention factor in
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
/// `f64`. Unchecked, as [`inv_freq`](super::inv_freq) (see [`RopeScaling::Axial`] for the
/// checked form).
pub fn axial_inv_freq(theta: f64, axes_dim: &[u32]) -> Vec<f64> {
    axes_dim
        .iter()
        .flat_map(|&d| (0..d / 2).map(move |i| theta.powf(-2.0 * f64::from(i) / f64::from(d))))
        .collect()
}

impl RopeScaling {
    /// The fields [`FrequencySpec::build`](super::FrequencySpec::build)'s final check names
    /// when this family's output is out of bounds: the argument, the field that scaled the
    /// frequencies and the one (or ones) that made the attention factor.
    pub(super) fn blame(&self) -> (&'static str, &'static str, &'static str) {
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
