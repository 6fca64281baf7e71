//! The f64 reference of the fused kernels (`Rope::run_fused`): per-head RMS normalisation, the
//! rotation of one head, and the FP8 values a rounding may give.

use rope_host::RopeStyle;
use rope_kernels::math::{E4M3_MAX, e4m3_to_f32};

/// `x_e / sqrt(mean(x^2) + eps) * w_e` (`1 + w_e` when `one_plus`), in f64.
pub fn rms_norm(x: &[f64], w: &[f64], eps: f64, one_plus: bool) -> Vec<f64> {
    let mean = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (mean + eps).sqrt();
    let one = if one_plus { 1.0 } else { 0.0 };
    x.iter().zip(w).map(|(v, w)| v * r * (w + one)).collect()
}

/// The sizes an output element's error bound depends on (`rope_harness::tolerance`): the pair
/// `(a, b)` it was rotated from, and its terms `|a c| + |b s|` (for `b c + a s`,
/// `|b c| + |a s|`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ElementScale {
    /// The pair's inputs, first and second of `style`'s pairing.
    pub pair: (f64, f64),
    /// The absolute values of the two products the element sums.
    pub terms: f64,
}

/// One whole head rotated forward by pair `i`'s `(cos[i], sin[i])`: `(a, b) -> (a c - b s,
/// b c + a s)` for the pairs of `style`; also returns each element's [`ElementScale`].
pub fn rotate_head(
    x: &[f64],
    style: RopeStyle,
    cos: &[f64],
    sin: &[f64],
) -> (Vec<f64>, Vec<ElementScale>) {
    let d = x.len();
    let (mut y, mut scale) = (x.to_vec(), vec![ElementScale::default(); d]);
    for i in 0..d / 2 {
        let (ia, ib) = crate::reference::pair(style, i, d);
        let (a, b, c, s) = (x[ia], x[ib], cos[i], sin[i]);
        y[ia] = a * c - b * s;
        y[ib] = b * c + a * s;
        scale[ia] = ElementScale {
            pair: (a, b),
            terms: (a * c).abs() + (b * s).abs(),
        };
        scale[ib] = ElementScale {
            pair: (a, b),
            terms: (b * c).abs() + (a * s).abs(),
        };
    }
    (y, scale)
}

/// The FP8 E4M3 values nearest `v` below and above (equal when `v` is one), saturated at
/// ±448: a correct rounding of `v`, or of a value within a rounding of it, is one of them.
pub fn e4m3_bracket(v: f64) -> (f64, f64) {
    let values: Vec<f64> = (0u8..0x7f).map(|b| f64::from(e4m3_to_f32(b))).collect();
    let a = v.abs().min(f64::from(E4M3_MAX));
    let below = values
        .iter()
        .copied()
        .filter(|&x| x <= a)
        .fold(0.0, f64::max);
    let above = values
        .iter()
        .copied()
        .find(|&x| x >= a)
        .unwrap_or(f64::from(E4M3_MAX));
    if v < 0.0 {
        (-above, -below)
    } else {
        (below, above)
    }
}
