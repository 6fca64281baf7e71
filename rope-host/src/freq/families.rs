//! The scaling families' formulas, each with the checks that keep it inside the domain where
//! it is finite, and the checks they share.

use std::f64::consts::PI;

use super::{ATTENTION_RANGE, FACTOR_RANGE, MAX_INV_FREQ, Yarn, YarnBlend, inv_freq};
use crate::error::{Result, invalid};

/// Position interpolation: every frequency divided by `factor`.
pub(super) fn linear(base: Vec<f64>, factor: f64) -> Result<(Vec<f64>, f64)> {
    let factor = scale_factor("factor", factor)?;
    Ok((base.iter().map(|f| f / factor).collect(), 1.0))
}

/// Dynamic NTK: the default frequencies of a base grown for sequences past the model's context
/// (`max_position_embeddings`).
pub(super) fn dynamic_ntk(
    (theta, d): (f64, u32),
    factor: f64,
    max_position_embeddings: u32,
    seq_len: u64,
) -> Result<(Vec<f64>, f64)> {
    let dim = f64::from(d);
    let factor = scale_factor("factor", factor)?;
    let max = length("max_position_embeddings", max_position_embeddings.into())?;
    length("seq_len", seq_len)?;
    if d <= 2 {
        return Err(invalid("rotary_dim", "dynamic NTK needs rotary_dim > 2"));
    }
    // `seq_len >= max >= 1` and `factor` in [2^-20, 2^20]: the growth lies in [1, 2^84] up to
    // rounding errors far below 1, so it is finite and positive, and only a huge `theta` makes
    // the grown base overflow.
    let seq_len = seq_len.max(max_position_embeddings.into()) as f64;
    let growth = factor * seq_len / max - (factor - 1.0);
    let grown = theta * growth.powf(dim / (dim - 2.0));
    if !(grown.is_finite() && grown > 0.0) {
        return Err(invalid(
            "scaling",
            format!(
                "the grown base theta * growth^(d / (d - 2)) must be finite and positive, got \
                 {grown} (theta {theta}, growth factor * seq_len / max_position_embeddings - \
                 (factor - 1) = {growth})"
            ),
        ));
    }
    let f = inv_freq(grown, d);
    check_frequencies("scaling", || format!("the grown base {grown}"), &f)?;
    Ok((f, 1.0))
}

/// Dynamic NTK with `alpha` (Hunyuan): base `theta * alpha^(d / (d - 2))`.
pub(super) fn dynamic_ntk_alpha((theta, d): (f64, u32), alpha: f64) -> Result<(Vec<f64>, f64)> {
    let alpha = growth_factor("alpha", alpha)?;
    if d <= 2 {
        return Err(invalid(
            "rotary_dim",
            "dynamic NTK with alpha needs rotary_dim > 2",
        ));
    }
    let dim = f64::from(d);
    // `alpha` in [1, 2^20] and `d / (d - 2)` in (1, 2]: the growth lies in [1, 2^40], and a
    // base at least `theta` keeps every frequency within the default family's.
    let grown = theta * alpha.powf(dim / (dim - 2.0));
    if !(grown.is_finite() && grown > 0.0) {
        return Err(invalid(
            "scaling",
            format!(
                "alpha {alpha} grows theta {theta} to {grown}: theta * alpha^(d / (d - 2)) must \
                 be finite and positive"
            ),
        ));
    }
    let f = inv_freq(grown, d);
    check_frequencies("scaling", || format!("alpha {alpha} (base {grown})"), &f)?;
    Ok((f, 1.0))
}

/// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth blend between.
pub(super) fn llama3(
    base: Vec<f64>,
    factor: f64,
    (low_freq_factor, high_freq_factor): (f64, f64),
    original_max_position_embeddings: u32,
) -> Result<(Vec<f64>, f64)> {
    let factor = scale_factor("factor", factor)?;
    let low = positive("low_freq_factor", low_freq_factor)?;
    let high = positive("high_freq_factor", high_freq_factor)?;
    let original = length(
        "original_max_position_embeddings",
        original_max_position_embeddings.into(),
    )?;
    if low >= high {
        return Err(invalid(
            "scaling",
            format!("low_freq_factor {low} must be below high_freq_factor {high}"),
        ));
    }
    // Wavelengths may overflow to infinity (a tiny frequency or `low_freq_factor`);
    // they are only compared and divided into, which stays finite.
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
                // In [0, 1] on this branch; the clamp only removes rounding
                // excursions when `high - low` is a few ulps, which would take the
                // blend outside [f / factor, f] (even below zero).
                let smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0);
                (1.0 - smooth) * f / factor + smooth * f
            }
        })
        .collect();
    Ok((f, 1.0))
}

/// LongRoPE / Phi-3: per-pair extension factors (long past the original context, else short)
/// and an attention factor from the extension ratio: `factor` when given, else the ratio of the
/// two context lengths.
pub(super) fn longrope(
    base: Vec<f64>,
    (short_factor, long_factor): (&[f64], &[f64]),
    factor: Option<f64>,
    (original_max_position_embeddings, max_position_embeddings, seq_len): (u32, u32, u64),
    attention_factor: Option<f64>,
) -> Result<(Vec<f64>, f64)> {
    let original = log_length(
        "original_max_position_embeddings",
        original_max_position_embeddings,
    )?;
    let max = length("max_position_embeddings", max_position_embeddings.into())?;
    length("seq_len", seq_len)?;
    let factor = factor.map(|f| scale_factor("factor", f)).transpose()?;
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
        for (i, &v) in list.iter().enumerate() {
            scale_factor(&format!("{name}[{i}]"), v)?;
        }
    }
    let ext = if seq_len > u64::from(original_max_position_embeddings) {
        long_factor
    } else {
        short_factor
    };
    let scale = factor.unwrap_or(max / original);
    let attention = match attention_factor {
        Some(a) => attention_factor_in_range("attention_factor", a)?,
        None if scale <= 1.0 => 1.0,
        // `scale` in (1, 2^31) and `original` at least 2: the square root's argument lies in
        // (1, 32).
        None => attention_factor_in_range(
            "the attention factor sqrt(1 + ln(factor, or max_position_embeddings / \
                 original_max_position_embeddings) / ln(original_max_position_embeddings))",
            (1.0 + scale.ln() / original.ln()).sqrt(),
        )?,
    };
    Ok((
        base.iter().zip(ext).map(|(f, e)| f / e).collect(),
        attention,
    ))
}

/// Checks that every frequency is finite, positive and at most [`MAX_INV_FREQ`]; the error names
/// `arg` and, in its problem, `cause()` (the field that produced the frequencies).
pub(super) fn check_frequencies(
    arg: &'static str,
    cause: impl FnOnce() -> String,
    f: &[f64],
) -> Result<()> {
    check_frequencies_from(Lowest::Positive, arg, cause, f)
}

/// The least frequency [`check_frequencies_from`] accepts.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Lowest {
    /// Above zero: every pair rotates.
    Positive,
    /// Zero too: a pair of frequency zero is left as it is (cos 1, sin 0), as Gemma 4's
    /// proportional RoPE leaves the pairs past its rotated share.
    Zero,
}

/// [`check_frequencies`] with zero accepted where `lowest` says so.
pub(super) fn check_frequencies_from(
    lowest: Lowest,
    arg: &'static str,
    cause: impl FnOnce() -> String,
    f: &[f64],
) -> Result<()> {
    let low_ok = |v: f64| v > 0.0 || (lowest == Lowest::Zero && v == 0.0);
    match f
        .iter()
        .enumerate()
        .find(|&(_, &v)| !(v.is_finite() && low_ok(v) && v <= MAX_INV_FREQ))
    {
        None => Ok(()),
        Some((i, v)) => Err(invalid(
            arg,
            format!(
                "{} gives inv_freq[{i}] = {v}; every frequency must be finite, {} and at most \
                 2^20 (so that position * inv_freq < 2^51 for positions below 2^31)",
                cause(),
                match lowest {
                    Lowest::Positive => "positive",
                    Lowest::Zero => "non-negative",
                },
            ),
        )),
    }
}

/// Gemma 4's proportional RoPE: the first `floor(partial_rotary_factor * d / 2)` pairs take the
/// default frequencies of the whole width `d`, divided by `factor`; the other pairs frequency
/// zero (left as they are).
pub(super) fn proportional(
    base: Vec<f64>,
    partial_rotary_factor: f64,
    factor: f64,
) -> Result<(Vec<f64>, f64)> {
    let partial_rotary_factor = share(partial_rotary_factor)?;
    let factor = scale_factor("factor", factor)?;
    // floor(partial_rotary_factor * d / 2), with d / 2 the pairs (halving and doubling are
    // exact, so this is transformers' product to the bit).
    let rotated = (partial_rotary_factor * base.len() as f64).floor() as usize;
    let f = base
        .iter()
        .enumerate()
        .map(|(i, &f)| if i < rotated { f / factor } else { 0.0 })
        .collect();
    Ok((f, 1.0))
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

/// `v` if it is a scaling factor in [`FACTOR_RANGE`], else an error naming it.
fn scale_factor(name: &str, v: f64) -> Result<f64> {
    let (lo, hi) = FACTOR_RANGE;
    if v.is_finite() && (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(invalid(
            "scaling",
            format!("{name} must lie in [2^-20, 2^20], got {v}"),
        ))
    }
}

/// `v` if it is a factor that only grows the base or shrinks the frequencies, in
/// `[1, 2^20]`, else an error naming it: the frequencies then stay within the default
/// family's.
fn growth_factor(name: &str, v: f64) -> Result<f64> {
    if v.is_finite() && (1.0..=FACTOR_RANGE.1).contains(&v) {
        Ok(v)
    } else {
        Err(invalid(
            "scaling",
            format!("{name} must lie in [1, 2^20], got {v}"),
        ))
    }
}

/// `partial_rotary_factor` if it is a share of a head, in `(0, 1]`, else an error naming it.
pub(super) fn share(partial_rotary_factor: f64) -> Result<f64> {
    if partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0 {
        Ok(partial_rotary_factor)
    } else {
        Err(invalid(
            "scaling",
            format!("partial_rotary_factor must lie in (0, 1], got {partial_rotary_factor}"),
        ))
    }
}

/// `v` as an `f64` if it is a length in tokens, nonzero, else an error naming it.
fn length(name: &str, v: u64) -> Result<f64> {
    if v >= 1 {
        Ok(v as f64)
    } else {
        Err(invalid(
            "scaling",
            format!("{name} must be a nonzero length in tokens, got {v}"),
        ))
    }
}

/// `v` as an `f64` if it is a length whose logarithm divides, at least 2, else an error naming
/// it.
fn log_length(name: &str, v: u32) -> Result<f64> {
    if v >= 2 {
        Ok(f64::from(v))
    } else {
        Err(invalid(
            "scaling",
            format!("{name} must be at least 2 (its logarithm divides), got {v}"),
        ))
    }
}

/// `v` if it is an attention factor in [`ATTENTION_RANGE`], else an error naming it.
fn attention_factor_in_range(name: &str, v: f64) -> Result<f64> {
    let (lo, hi) = ATTENTION_RANGE;
    if v.is_finite() && (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(invalid(
            "scaling",
            format!("{name} must lie in [{lo}, {hi}], got {v}"),
        ))
    }
}

/// The largest `mixed_b` of [`ntk`]: `(d/2)^mixed_b` stays finite for every `u32` width.
const MAX_MIXED_B: f64 = 16.0;

/// NTK-aware scaling (vLLM's `ntk`): the base grown by `factor` and every frequency divided by
/// `factor^(2/d)`, or, with `mixed_b`, each frequency divided by its own `lambda`.
pub(super) fn ntk(
    (theta, d): (f64, u32),
    factor: f64,
    mixed_b: Option<f64>,
) -> Result<(Vec<f64>, f64)> {
    let factor = growth_factor("factor", factor)?;
    let dim = f64::from(d);
    // `factor >= 1`: the base only grows and every divisor is at least 1, so every frequency
    // stays within the default family's.
    let f = match mixed_b {
        None => {
            let grown = theta * factor;
            if !(grown.is_finite() && grown > 0.0) {
                return Err(invalid(
                    "scaling",
                    format!("theta * factor must be finite, got {theta} * {factor} = {grown}"),
                ));
            }
            let shrink = factor.powf(2.0 / dim);
            inv_freq(grown, d).iter().map(|f| f / shrink).collect()
        }
        Some(b) => {
            if !(b.is_finite() && b > 0.0 && b <= MAX_MIXED_B) {
                return Err(invalid(
                    "scaling",
                    format!("mixed_b must lie in (0, 16], got {b}"),
                ));
            }
            // `(d/2)^b <= 2^496` is finite, and `m^b <= (d/2)^b`, so `a m^b` lies between 0 and
            // `ln(factor)`: every `lambda` between 1 and `factor`.
            let a = factor.ln() / (dim / 2.0).powf(b);
            inv_freq(theta, d)
                .iter()
                .enumerate()
                .map(|(i, f)| f / (a * (i as f64 + 1.0).powf(b)).exp())
                .collect()
        }
    };
    Ok((f, 1.0))
}

/// YaRN's frequencies and attention factor.
pub(super) fn yarn(theta: f64, d: u32, y: &Yarn) -> Result<(Vec<f64>, f64)> {
    if theta <= 1.0 {
        return Err(invalid(
            "theta",
            format!(
                "YaRN needs theta > 1 (its logarithm divides the correction range), got {theta}"
            ),
        ));
    }
    let factor = scale_factor("factor", y.factor)?;
    let original = length(
        "original_max_position_embeddings",
        y.original_max_position_embeddings.into(),
    )?;
    let (fast, slow) = (
        positive("beta_fast", y.beta_fast)?,
        positive("beta_slow", y.beta_slow)?,
    );
    for (name, m) in [("mscale", y.mscale), ("mscale_all_dim", y.mscale_all_dim)] {
        if let Some(m) = m
            && !(m.is_finite() && m >= 0.0)
        {
            return Err(invalid(
                "scaling",
                format!("{name} must be finite and >= 0, got {m}"),
            ));
        }
    }
    let c = y.mscale_coefficient;
    if !(0.0..=1.0).contains(&c) {
        return Err(invalid(
            "scaling",
            format!("mscale_coefficient must lie in [0, 1], got {c}"),
        ));
    }
    let dim = f64::from(d);
    // At least 1 (and at most 14.9 m for `factor <= 2^20`) for `m >= 0`.
    let mscale_of = |m: f64| {
        if factor <= 1.0 {
            1.0
        } else {
            c * m * factor.ln() + 1.0
        }
    };
    let attention = match (y.attention_factor, y.mscale, y.mscale_all_dim) {
        (Some(a), _, _) => attention_factor_in_range("attention_factor", a)?,
        (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => attention_factor_in_range(
            "the attention factor mscale(factor, mscale) / mscale(factor, mscale_all_dim)",
            mscale_of(m) / mscale_of(all),
        )?,
        _ => mscale_of(1.0),
    };
    // The dimension (in pairs * 2 units) at which a frequency makes `rotations` turns over the
    // original context. `ln(theta) > 0`; the other logarithm is finite unless
    // `original / (rotations * 2 pi)` overflows or underflows, which is checked.
    let correction_dim = |name: &str, rotations: f64| {
        let c = dim * (original / (rotations * 2.0 * PI)).ln() / (2.0 * theta.ln());
        if c.is_finite() {
            Ok(c)
        } else {
            Err(invalid(
                "scaling",
                format!(
                    "{name} {rotations} gives correction dimension {c}: \
                     original_max_position_embeddings / ({name} * 2 pi) must be finite and \
                     positive"
                ),
            ))
        }
    };
    let (mut low, mut high) = (
        correction_dim("beta_fast", fast)?,
        correction_dim("beta_slow", slow)?,
    );
    if y.truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    // Both finite here, so `high - low` is zero only when they are equal, which the widening
    // below rules out: the ramp's division is by a non-zero finite number.
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
            let w = 1.0 - ramp;
            // Either blend lies between the two values, so inside the frequency bounds.
            match y.blend {
                YarnBlend::Linear => interpolation * (1.0 - w) + extrapolation * w,
                YarnBlend::Log => (w * extrapolation.ln() + (1.0 - w) * interpolation.ln()).exp(),
            }
        })
        .collect();
    Ok((f, attention))
}
