//! The one rule for whether a GPU output is close enough to its f64 reference, shared by the
//! plain kernels' checks ([`crate::case::compare`], which the property tests, the demo and the
//! benchmark call), the fused kernels' tests and the table tests.
//!
//! # The rotated element's bound
//! An output `y = a c - b s` (or `b c + a s`) of the pair `(a, b)` rotated by `(c, s)`, with
//! `u = 2^-24` (the unit roundoff of `f32`, in which every kernel computes), is within
//!
//! ```text
//! bound = rounding + ROTATION_UNITS u (|a| + |b|) + [norm] NORM_UNITS u max(|a c| + |b s|, NORM_FLOOR)
//! ```
//!
//! of the reference, where
//! - `rounding` is 0 for `f32` outputs and one unit in the last place of the reference rounded
//!   once to the type for `f16`/`bf16` ([`TestElem::ulp`]): the kernel rounds its `f32` result
//!   once, which moves it by at most half a unit; the other half is the margin the plain and
//!   the fused tests both allowed. Every output, 16-bit ones included, is compared with the
//!   unrounded reference: `|got - want| <= bound` (comparing a 16-bit output with the
//!   reference rounded to its type would accept one more unit on the far side).
//! - `ROTATION_UNITS u (|a| + |b|)` is the `f32` arithmetic of the rotation, relative to the
//!   pair's inputs as the rotation reads them (after the norm, when there is one): rounding the
//!   two products and the sum costs at most 3 units, and cos/sin within one ulp of the exact
//!   ones at most 2 more (an error of `cos` multiplies `|a|` whatever `s` is, so the inputs,
//!   not the terms, are the scale). It also carries a table source: the tests compare with
//!   the exact cos/sin or with the downloaded table, so a table's own rounding is either in the
//!   reference or within those 2 units.
//! - `[norm] NORM_UNITS u max(|a c| + |b s|, NORM_FLOOR)`, only when the kernel normalises the
//!   head first (the fused kernels' RMS norm): the normalised inputs carry a relative error of
//!   their own (the `f32` sum of `head_dim` squares, the reciprocal square root, the weight's
//!   multiplication and `1 + w`), and an error `a δa`, `b δb` of them reaches `y` as
//!   `a c δa - b s δb`, so its scale is the terms `|a c| + |b s|`. The floor covers the rounding
//!   of `1 + w`, absolute rather than relative to the weighted value, where the weighted head
//!   is tiny. `NORM_UNITS` and `NORM_FLOOR` keep the fused tests' earlier bound
//!   (`4e-6 max(terms, 1e-3)`, about 67 units) together with the rotation's 8 units.
//!
//! Pass-through elements must be bit-exact, a NaN reference (a position outside a table) must
//! give NaN, and nothing else is close enough ([`check`] treats a NaN error as too large).
//!
//! # Tables
//! A built cos/sin table entry is within one unit in the last place of its type of the exact
//! value, or `2^-28` absolute near zero (the f64 angle's own error): [`table_entry`].

use crate::elem::TestElem;

/// The unit roundoff of `f32`, `2^-24`: the kernels compute in `f32`.
pub const UNIT: f64 = f32::EPSILON as f64 / 2.0;

/// Units of [`UNIT`] times `|a| + |b|` the rotation's `f32` arithmetic may cost: 3 for the
/// products and the sum, 2 for cos/sin within one ulp, and slack to 8.
pub const ROTATION_UNITS: f64 = 8.0;

/// Units of [`UNIT`] times `|a c| + |b s|` an in-kernel RMS norm may add (see the module
/// documentation): with [`ROTATION_UNITS`], the 67 units (`4e-6`) the fused tests allowed.
pub const NORM_UNITS: f64 = 59.0;

/// The smallest terms scale the norm's error is taken relative to (see the module
/// documentation).
pub const NORM_FLOOR: f64 = 1e-3;

/// The smallest bound of an `f32` output: an exact reference still passes an exact result
/// when every other term is zero.
const FLOOR: f64 = 1e-30;

/// What the bound of one rotated output element depends on besides its type.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rotated {
    /// The f64 reference `y`.
    pub want: f64,
    /// The pair's inputs `(a, b)` as the rotation reads them: after the norm, if any.
    pub pair: (f64, f64),
    /// `Some(|a c| + |b s|)` when the kernel normalises the head before rotating it; `None`
    /// without a norm.
    pub norm_terms: Option<f64>,
}

impl Rotated {
    /// The bound of an output of type `T` (see the module documentation for the formula).
    pub fn bound<T: TestElem>(&self) -> f64 {
        let (a, b) = self.pair;
        let rotation = ROTATION_UNITS * UNIT * (a.abs() + b.abs());
        let norm = self
            .norm_terms
            .map_or(0.0, |terms| NORM_UNITS * UNIT * terms.max(NORM_FLOOR));
        let rounding = if is_f32::<T>() {
            0.0
        } else {
            T::ulp(T::from_f64(self.want))
        };
        rounding + rotation + norm + FLOOR
    }
}

/// Whether `T` is `f32` (no rounding of the kernel's `f32` result).
fn is_f32<T: TestElem>() -> bool {
    T::NAME == "f32"
}

/// The error `|got - want|` of an output of type `T` (`got` widened to f64) and its bound:
/// it passes when `err <= bound` (a NaN error does not).
pub fn check<T: TestElem>(got: f64, element: &Rotated) -> (f64, f64) {
    ((got - element.want).abs(), element.bound::<T>())
}

/// The bound of a built table entry of type `T` whose exact value is `want`: one unit in the
/// last place of the type, or `2^-28` absolute near zero.
pub fn table_entry<T: TestElem>(want: f64) -> f64 {
    T::ulp(T::from_f64(want)).max(2f64.powi(-28))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rope_host::half::{bf16, f16};

    #[test]
    fn plain_f32_bound_is_eight_units_of_the_inputs() {
        let e = Rotated {
            want: 0.5,
            pair: (1.0, -2.0),
            norm_terms: None,
        };
        let want = 8.0 * 2f64.powi(-24) * 3.0;
        assert!((e.bound::<f32>() - want).abs() <= 1e-29);
    }

    #[test]
    fn sixteen_bit_bounds_add_one_ulp_at_the_reference() {
        let e = Rotated {
            want: 1.0,
            pair: (1.0, 0.0),
            norm_terms: None,
        };
        let f32_part = e.bound::<f32>();
        assert_eq!(e.bound::<f16>(), 2f64.powi(-10) + f32_part);
        assert_eq!(e.bound::<bf16>(), 2f64.powi(-7) + f32_part);
        // A bf16 output two units away fails, one unit away passes.
        let (err, bound) = check::<bf16>(1.0 + 2.0 * 2f64.powi(-7), &e);
        assert!(err > bound);
        let (err, bound) = check::<bf16>(1.0 + 2f64.powi(-7), &e);
        assert!(err <= bound);
    }

    #[test]
    fn the_norm_term_keeps_the_fused_tests_earlier_bound() {
        // With the terms equal to the inputs, rotation and norm make the earlier 4e-6.
        let e = Rotated {
            want: 1.0,
            pair: (1.0, 0.0),
            norm_terms: Some(1.0),
        };
        assert!((e.bound::<f32>() - 4e-6).abs() < 0.01 * 4e-6);
        // Tiny terms: the floor.
        let tiny = Rotated {
            norm_terms: Some(0.0),
            pair: (0.0, 0.0),
            ..e
        };
        assert!((tiny.bound::<f32>() - 59.0 * 2f64.powi(-24) * 1e-3).abs() < 1e-15);
    }

    #[test]
    fn a_nan_output_fails() {
        let e = Rotated {
            want: 1.0,
            pair: (1.0, 0.0),
            norm_terms: None,
        };
        let (err, bound) = check::<f32>(f64::NAN, &e);
        assert!(err.is_nan() && bound > 0.0);
        let (err, bound) = check::<f32>(1.0 + 1e-3, &e);
        assert!(err > bound);
    }
}
