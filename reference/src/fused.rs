//! The f64 reference of the fused kernels (`Rope::run_fused`): per-head RMS normalisation, the
//! rotation of one head, and the FP8 values a rounding may give (E4M3, and FlashInfer's E5M2);
//! FlashInfer's page-table cache addressing ([`page_table_slot`]); and the gradients of the
//! normalisation followed by the rotation ([`rms_norm_rope_backward`]).

use rope_host::RopeStyle;
use rope_kernels::math::{e2m1_to_f32, e4m3_to_f32, e5m2_to_f32};

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
    bracket(v, (0u8..0x7f).map(|b| f64::from(e4m3_to_f32(b))))
}

/// The FP8 E5M2 values nearest `v` below and above, saturated at ±57344 (as CUDA's
/// `__NV_SATFINITE` conversion, which FlashInfer's FP8 outputs use), as [`e4m3_bracket`].
pub fn e5m2_bracket(v: f64) -> (f64, f64) {
    bracket(v, (0u8..0x7c).map(|b| f64::from(e5m2_to_f32(b))))
}

/// The FP4 E2M1 values (NVFP4's elements) nearest `v` below and above, saturated at ±6, as
/// [`e4m3_bracket`].
pub fn e2m1_bracket(v: f64) -> (f64, f64) {
    bracket(v, (0u8..8).map(|b| f64::from(e2m1_to_f32(b))))
}

/// The two of `values` (the non-negative finite values of a format, increasing) nearest `v`
/// below and above, by magnitude, saturated at the largest, with `v`'s sign.
fn bracket(v: f64, values: impl Iterator<Item = f64>) -> (f64, f64) {
    let values: Vec<f64> = values.collect();
    let max = values[values.len() - 1];
    let a = v.abs().min(max);
    let below = values
        .iter()
        .copied()
        .filter(|&x| x <= a)
        .fold(0.0, f64::max);
    let above = values.iter().copied().find(|&x| x >= a).unwrap_or(max);
    if v < 0.0 {
        (-above, -below)
    } else {
        (below, above)
    }
}

/// FlashInfer's paged-cache address of token `t` (`rope_quantize_fp8_append_paged_kv_cache`,
/// `append_paged_kv_cache`): request `b = batch_indices[t]` (a negative one writes nothing),
/// its page `kv_indices[kv_indptr[b] + positions[t] / page_size]` and the entry
/// `positions[t] % page_size` in it, as `(page, entry)`. `None` as well for a negative
/// position, a page past the request's own (`kv_indptr[b + 1]`; FlashInfer does not check it)
/// and addresses outside the arrays: what a kernel guarding device metadata skips.
pub fn page_table_slot(
    (kv_indices, kv_indptr): (&[i32], &[i32]),
    (batch_indices, positions): (&[i32], &[i32]),
    page_size: usize,
    t: usize,
) -> Option<(usize, usize)> {
    let b = usize::try_from(*batch_indices.get(t)?).ok()?;
    let pos = usize::try_from(*positions.get(t)?).ok()?;
    if b + 1 >= kv_indptr.len() || page_size == 0 {
        return None;
    }
    let first = usize::try_from(kv_indptr[b]).ok()?;
    let at = first + pos / page_size;
    if at >= usize::try_from(kv_indptr[b + 1]).ok()? {
        return None;
    }
    let page = usize::try_from(*kv_indices.get(at)?).ok()?;
    Some((page, pos % page_size))
}

/// The gradients of one head's per-head RMS normalisation followed by its forward rotation,
/// `y = R(n)` with `n_e = x_e r w'_e`, `r = 1 / sqrt(mean(x^2) + eps)` and `w'_e = w_e` (`1 + w_e`
/// when `one_plus`), given `dy = dL/dy`. Returns `(dx, dw)`, this head's share of the weight's
/// gradient (a launch sums it over its heads and tokens):
///
/// - `dn = R^T dy`: each pair `(p, q) -> (p c + q s, q c - p s)`, the rotation by `-sin`;
/// - `dw_e = dn_e x_e r`;
/// - with `u_e = dn_e w'_e`: `dx_j = r u_j - r^3 x_j (sum_e u_e x_e) / d`.
pub fn rms_norm_rope_backward(
    x: &[f64],
    w: &[f64],
    (eps, one_plus): (f64, bool),
    style: RopeStyle,
    cos: &[f64],
    sin: &[f64],
    dy: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let d = x.len();
    let neg_sin: Vec<f64> = sin.iter().map(|s| -s).collect();
    let (dn, _) = rotate_head(dy, style, cos, &neg_sin);
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt();
    let one = if one_plus { 1.0 } else { 0.0 };
    let u: Vec<f64> = dn.iter().zip(w).map(|(g, w)| g * (w + one)).collect();
    let ux = u.iter().zip(x).map(|(u, x)| u * x).sum::<f64>();
    let dx = u
        .iter()
        .zip(x)
        .map(|(u, x)| r * u - r * r * r * x * ux / d as f64)
        .collect();
    let dw = dn.iter().zip(x).map(|(g, x)| g * x * r).collect();
    (dx, dw)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `sum_e dy_e y_e` of the forward pass, the loss whose gradients the backward gives.
    fn loss(
        x: &[f64],
        w: &[f64],
        one_plus: bool,
        style: RopeStyle,
        cs: (&[f64], &[f64]),
        dy: &[f64],
    ) -> f64 {
        let n = rms_norm(x, w, 1e-6, one_plus);
        let (y, _) = rotate_head(&n, style, cs.0, cs.1);
        y.iter().zip(dy).map(|(y, g)| y * g).sum()
    }

    /// A deterministic spread of values in (-1, 1) (no random-number crate in this one).
    fn values(n: usize, seed: u64) -> Vec<f64> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn norm_rope_backward_matches_central_differences_of_the_forward() {
        for (style, one_plus, d) in [
            (RopeStyle::Neox, false, 16),
            (RopeStyle::Interleaved, true, 12),
            (RopeStyle::Neox, true, 8),
        ] {
            let (x, w, dy) = (values(d, 1), values(d, 2), values(d, 3));
            let angles: Vec<f64> = values(d / 2, 4).iter().map(|a| a * 3.0).collect();
            let cos: Vec<f64> = angles.iter().map(|a| a.cos()).collect();
            let sin: Vec<f64> = angles.iter().map(|a| a.sin()).collect();
            let (dx, dw) = rms_norm_rope_backward(&x, &w, (1e-6, one_plus), style, &cos, &sin, &dy);
            let h = 1e-6;
            for e in 0..d {
                let at = |v: &[f64], delta: f64| {
                    let mut v = v.to_vec();
                    v[e] += delta;
                    v
                };
                let fx = (loss(&at(&x, h), &w, one_plus, style, (&cos, &sin), &dy)
                    - loss(&at(&x, -h), &w, one_plus, style, (&cos, &sin), &dy))
                    / (2.0 * h);
                let fw = (loss(&x, &at(&w, h), one_plus, style, (&cos, &sin), &dy)
                    - loss(&x, &at(&w, -h), one_plus, style, (&cos, &sin), &dy))
                    / (2.0 * h);
                assert!(
                    (dx[e] - fx).abs() < 1e-7 * (1.0 + fx.abs()),
                    "{style:?} dx[{e}]: {} vs {fx}",
                    dx[e]
                );
                assert!(
                    (dw[e] - fw).abs() < 1e-7 * (1.0 + fw.abs()),
                    "{style:?} dw[{e}]: {} vs {fw}",
                    dw[e]
                );
            }
        }
    }

    #[test]
    fn fp8_and_fp4_brackets_hold_the_value_and_saturate() {
        assert_eq!(e4m3_bracket(448.0), (448.0, 448.0));
        assert_eq!(e4m3_bracket(1e9), (448.0, 448.0));
        assert_eq!(e4m3_bracket(-1.1), (-1.125, -1.0));
        assert_eq!(e5m2_bracket(57_344.0), (57_344.0, 57_344.0));
        assert_eq!(e5m2_bracket(-1e9), (-57_344.0, -57_344.0));
        // 1.1 lies between 1 and 1.25 (two mantissa bits), 2^-17 between 0 and 2^-16.
        assert_eq!(e5m2_bracket(1.1), (1.0, 1.25));
        assert_eq!(e5m2_bracket(2f64.powi(-17)), (0.0, 2f64.powi(-16)));
        assert_eq!(e2m1_bracket(2.6), (2.0, 3.0));
        assert_eq!(e2m1_bracket(-5.0), (-6.0, -4.0));
        assert_eq!(e2m1_bracket(100.0), (6.0, 6.0));
        assert_eq!(e2m1_bracket(0.5), (0.5, 0.5));
        assert_eq!(e2m1_bracket(0.1), (0.0, 0.5));
    }

    /// Two requests of pages 16: request 0 holds pages [7, 3], request 1 page [5]; a token of
    /// batch index -1 (padding), positions past a request's pages and addresses outside the
    /// arrays write nothing.
    #[test]
    fn page_table_slots_follow_indptr_and_indices() {
        let (indices, indptr) = ([7, 3, 5], [0, 2, 3]);
        let batch = [0, 0, 1, -1, 1, 2, 0];
        let positions = [0, 17, 4, 0, 16, 0, 32];
        let slot = |t| page_table_slot((&indices, &indptr), (&batch, &positions), 16, t);
        assert_eq!(slot(0), Some((7, 0)));
        assert_eq!(slot(1), Some((3, 1)));
        assert_eq!(slot(2), Some((5, 4)));
        assert_eq!(slot(3), None, "batch index -1");
        assert_eq!(slot(4), None, "position past the request's pages");
        assert_eq!(slot(5), None, "batch index past kv_indptr");
        assert_eq!(slot(6), None, "a page of the next request");
        assert_eq!(slot(7), None, "token past the arrays");
    }
}
