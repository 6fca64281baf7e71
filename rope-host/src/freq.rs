//! Rotary frequencies computed on the host in `f64`: the default family and the scaling
//! families models publish in their configs (Hugging Face's `rope_scaling`).
//!
//! Every family yields one `inv_freq[i]` per rotated pair `i < rotary_dim / 2` and an attention
//! factor that multiplies cos and sin (1 except for YaRN and LongRoPE). The kernels consume the
//! vector ([`crate::Frequencies`]) for in-kernel sin/cos, and [`crate::Rope::build_tables_for`]
//! builds tables from the same vector.

use std::f64::consts::PI;

use cudarc::driver::CudaSlice;
pub use kernels_gpu::math::AngleMode;

use crate::error::{Result, invalid};

/// The default RoPE frequencies for `rotary_dim` rotated features:
/// `inv_freq[i] = theta^(-2i / rotary_dim)` for `i < rotary_dim / 2`, in `f64`.
pub fn inv_freq(theta: f64, rotary_dim: u32) -> Vec<f64> {
    (0..rotary_dim / 2)
        .map(|i| theta.powf(-2.0 * f64::from(i) / f64::from(rotary_dim)))
        .collect()
}

/// YaRN's parameters (`rope_type: "yarn"`), with the defaults of the published method.
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    /// `factor`: context extension ratio `s`.
    pub factor: f64,
    /// `original_max_position_embeddings`: the pre-training context `L`.
    pub original_max_position_embeddings: f64,
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
}

impl Yarn {
    /// YaRN with `factor` over a pre-training context of `original_max_position_embeddings`,
    /// other fields at their defaults.
    pub fn new(factor: f64, original_max_position_embeddings: f64) -> Self {
        Self {
            factor,
            original_max_position_embeddings,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            attention_factor: None,
            truncate: true,
        }
    }
}

/// A frequency family with its parameters, named as model configs name them.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// `theta^(-2i/d)`.
    Default,
    /// Position interpolation (`rope_type: "linear"`): `inv_freq / factor`.
    Linear {
        /// `factor`.
        factor: f64,
    },
    /// Dynamic NTK (`rope_type: "dynamic"`): for a sequence longer than
    /// `original_max_position_embeddings`, the base grows to
    /// `theta * (factor * seq_len / original - (factor - 1))^(d / (d - 2))`.
    DynamicNtk {
        /// `factor`.
        factor: f64,
        /// `max_position_embeddings` of the original model.
        original_max_position_embeddings: f64,
        /// The current sequence length (the base is unchanged up to the original context).
        seq_len: f64,
    },
    /// YaRN (`rope_type: "yarn"`): interpolation blended with extrapolation by a linear ramp
    /// over the dimensions between the `beta_slow` and `beta_fast` rotation counts, and an
    /// attention factor `0.1 ln(factor) + 1` (or its `mscale` form).
    Yarn(Yarn),
    /// Llama 3.1 (`rope_type: "llama3"`): wavelengths above `original / low_freq_factor` are
    /// divided by `factor`, below `original / high_freq_factor` kept, smoothly blended between.
    Llama3 {
        /// `factor` (8 for Llama 3.1).
        factor: f64,
        /// `low_freq_factor` (1).
        low_freq_factor: f64,
        /// `high_freq_factor` (4).
        high_freq_factor: f64,
        /// `original_max_position_embeddings` (8192).
        original_max_position_embeddings: f64,
    },
    /// LongRoPE / Phi-3 (`rope_type: "longrope"`): `inv_freq[i] = 1 / (ext[i] * theta^(2i/d))`
    /// with `ext = long_factor` past the original context and `short_factor` within it; attention
    /// factor `sqrt(1 + ln(max / original) / ln(original))`.
    LongRope {
        /// `short_factor`, one per pair.
        short_factor: Vec<f64>,
        /// `long_factor`, one per pair.
        long_factor: Vec<f64>,
        /// `original_max_position_embeddings`.
        original_max_position_embeddings: f64,
        /// `max_position_embeddings`.
        max_position_embeddings: f64,
        /// The current sequence length (chooses long or short factors).
        seq_len: f64,
        /// `attention_factor`, if given: overrides the computed one.
        attention_factor: Option<f64>,
    },
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
    /// # Errors
    /// [`crate::Error::Invalid`] naming `theta`, `rotary_dim` or `scaling` for parameters
    /// outside their domain (non-positive or non-finite factors and lengths, factor lists of the
    /// wrong length, `low_freq_factor >= high_freq_factor`, ...).
    pub fn build(&self) -> Result<(Vec<f64>, f64)> {
        let (theta, d) = (self.theta, self.rotary_dim);
        if !(theta.is_finite() && theta > 0.0) {
            return Err(invalid(
                "theta",
                format!("must be finite and positive, got {theta}"),
            ));
        }
        if d < 2 || !d.is_multiple_of(2) {
            return Err(invalid(
                "rotary_dim",
                format!("must be even and at least 2, got {d}"),
            ));
        }
        let base = inv_freq(theta, d);
        let dim = f64::from(d);
        Ok(match &self.scaling {
            RopeScaling::Default => (base, 1.0),
            RopeScaling::Linear { factor } => {
                let factor = positive("factor", *factor)?;
                (base.iter().map(|f| f / factor).collect(), 1.0)
            }
            RopeScaling::DynamicNtk {
                factor,
                original_max_position_embeddings,
                seq_len,
            } => {
                let factor = positive("factor", *factor)?;
                let original = positive(
                    "original_max_position_embeddings",
                    *original_max_position_embeddings,
                )?;
                let seq_len = positive("seq_len", *seq_len)?.max(original);
                if d <= 2 {
                    return Err(invalid("rotary_dim", "dynamic NTK needs rotary_dim > 2"));
                }
                let grown =
                    theta * (factor * seq_len / original - (factor - 1.0)).powf(dim / (dim - 2.0));
                (inv_freq(grown, d), 1.0)
            }
            RopeScaling::Yarn(y) => yarn(theta, d, y)?,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let factor = positive("factor", *factor)?;
                let low = positive("low_freq_factor", *low_freq_factor)?;
                let high = positive("high_freq_factor", *high_freq_factor)?;
                let original = positive(
                    "original_max_position_embeddings",
                    *original_max_position_embeddings,
                )?;
                if low >= high {
                    return Err(invalid(
                        "scaling",
                        format!("low_freq_factor {low} must be below high_freq_factor {high}"),
                    ));
                }
                let (low_wavelen, high_wavelen) = (original / low, original / high);
                let f = base
                    .iter()
                    .map(|&f| {
                        let wavelen = 2.0 * PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (original / wavelen - low) / (high - low);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                (f, 1.0)
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_position_embeddings,
                max_position_embeddings,
                seq_len,
                attention_factor,
            } => {
                let original = positive(
                    "original_max_position_embeddings",
                    *original_max_position_embeddings,
                )?;
                let max = positive("max_position_embeddings", *max_position_embeddings)?;
                let seq_len = positive("seq_len", *seq_len)?;
                for (name, list) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                    if list.len() != base.len() {
                        return Err(invalid(
                            "scaling",
                            format!(
                                "{name} has {} entries, rotary_dim / 2 is {}",
                                list.len(),
                                base.len()
                            ),
                        ));
                    }
                    for &v in list {
                        positive(name, v)?;
                    }
                }
                let ext = if seq_len > original {
                    long_factor
                } else {
                    short_factor
                };
                let scale = max / original;
                let attention = match attention_factor {
                    Some(a) => positive("attention_factor", *a)?,
                    None if scale <= 1.0 => 1.0,
                    None => (1.0 + scale.ln() / original.ln()).sqrt(),
                };
                (
                    base.iter().zip(ext).map(|(f, e)| f / e).collect(),
                    attention,
                )
            }
        })
    }
}

/// `v` if it is finite and positive, else an error naming the scaling parameter.
fn positive(name: &str, v: f64) -> Result<f64> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(invalid(
            "scaling",
            format!("{name} must be finite and positive, got {v}"),
        ))
    }
}

/// YaRN's frequencies and attention factor.
fn yarn(theta: f64, d: u32, y: &Yarn) -> Result<(Vec<f64>, f64)> {
    let factor = positive("factor", y.factor)?;
    let original = positive(
        "original_max_position_embeddings",
        y.original_max_position_embeddings,
    )?;
    let (fast, slow) = (
        positive("beta_fast", y.beta_fast)?,
        positive("beta_slow", y.beta_slow)?,
    );
    let dim = f64::from(d);
    let mscale_of = |m: f64| {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * m * factor.ln() + 1.0
        }
    };
    let attention = match (y.attention_factor, y.mscale, y.mscale_all_dim) {
        (Some(a), _, _) => positive("attention_factor", a)?,
        (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale_of(m) / mscale_of(all),
        _ => mscale_of(1.0),
    };
    // The dimension (in pairs * 2 units) at which a frequency makes `rotations` turns over the
    // original context.
    let correction_dim =
        |rotations: f64| dim * (original / (rotations * 2.0 * PI)).ln() / (2.0 * theta.ln());
    let (mut low, mut high) = (correction_dim(fast), correction_dim(slow));
    if y.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
    if low == high {
        high += 0.001;
    }
    let f = inv_freq(theta, d)
        .iter()
        .enumerate()
        .map(|(i, &extrapolation)| {
            let interpolation = extrapolation / factor;
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation_weight = 1.0 - ramp;
            interpolation * (1.0 - extrapolation_weight) + extrapolation * extrapolation_weight
        })
        .collect();
    Ok((f, attention))
}

/// A frequency vector on the device, ready for [`crate::SinCos::Frequencies`] and
/// [`crate::Rope::build_tables_for`]; made by [`crate::Rope::frequencies`].
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
}
