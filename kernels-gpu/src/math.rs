//! The arithmetic of RoPE as plain functions that compile for the GPU and the host alike.
//!
//! Everything here is `core`-only Rust with no intrinsics, so the host's unit tests exercise
//! exactly the code the kernels run. Nothing here reads memory.
//!
//! # The angle and its accuracy
//! Pair `i` of the token at position `p` rotates by `angle = p * inv_freq_i`, with the
//! frequencies `inv_freq_i` (for the default family `theta^(-2i/d)`) computed on the host in
//! `f64`. The kernels compute that angle in `f64`, reduce it modulo `pi/2` in `f64` (Cody–Waite with a three-part `pi/2`) and evaluate
//! `sin`/`cos` of the reduced argument with `f64` polynomials, rounding to `f32` once at the end.
//! The `f64` angle is off by about `2^-52 * |angle|` (under `1e-9` radians up to position
//! `2^22`) and the reduction adds about `2^-52`, so `cos`/`sin` land within one `f32` unit in
//! the last place of the exact values (within `2^-28` absolute near their zeros); an `f32`
//! angle (`p_f32 * inv_freq_f32`) is off by up to `ulp(p * inv_freq) / 2`, about `3e-2`
//! radians at position one million.

/// `2^52 * 1.5`: adding and subtracting it rounds an `f64` of magnitude below `2^51` to the
/// nearest integer (ties to even) without any float-to-int conversion.
const ROUND_MAGIC: f64 = 6_755_399_441_055_744.0;

/// `pi/2` split into four parts whose sum is within `1e-36` of `pi/2`. The first three carry 21
/// significant bits each, so `k * PIO2_n` is exact for every `|k| < 2^32`.
const PIO2_1: f64 = 1.570_796_012_878_418;
const PIO2_2: f64 = 3.139_164_164_167_596e-7;
const PIO2_3: f64 = 6.223_369_259_164_557e-14;
const PIO2_4: f64 = 2.912_732_056_093_356e-20;

/// Rotates one pair `(a, b)` by the angle whose cosine and sine are `cos`, `sin`:
/// `(a cos - b sin, b cos + a sin)`.
///
/// The backward pass of RoPE is the same rotation with `-sin` (the transposed rotation).
#[inline(always)]
pub fn rotate(a: f32, b: f32, cos: f32, sin: f32) -> (f32, f32) {
    (a * cos - b * sin, b * cos + a * sin)
}

/// Rounds `x` to the nearest integer, ties to even, for `|x| < 2^51`.
#[inline(always)]
fn round_to_int(x: f64) -> f64 {
    (x + ROUND_MAGIC) - ROUND_MAGIC
}

/// `sin(r)` and `cos(r)` for `|r| <= pi/4` (a little beyond is fine), by Taylor series to
/// degree 13 and 14: truncation error below `(pi/4)^15 / 15! < 2^-44` and
/// `(pi/4)^16 / 16! < 2^-48`, far below the `2^-25` that rounding to `f32` allows. (The f64
/// evaluation is for the `f32` result, not for `f64` accuracy.)
#[inline(always)]
fn sincos_reduced(r: f64) -> (f64, f64) {
    let z = r * r;
    let mut s = 1.0 / 6_227_020_800.0; // 1/13!
    s = s * z - 1.0 / 39_916_800.0; // 1/11!
    s = s * z + 1.0 / 362_880.0;
    s = s * z - 1.0 / 5_040.0;
    s = s * z + 1.0 / 120.0;
    s = s * z - 1.0 / 6.0;
    let sin = r + r * z * s;
    let mut c = 1.0 / 87_178_291_200.0; // 1/14!
    c = c * z - 1.0 / 479_001_600.0; // 1/12!
    c = c * z + 1.0 / 3_628_800.0;
    c = c * z - 1.0 / 40_320.0;
    c = c * z + 1.0 / 720.0;
    c = c * z - 1.0 / 24.0;
    c = c * z + 0.5;
    let cos = 1.0 - z * c;
    (sin, cos)
}

/// `(cos(angle), sin(angle))` rounded once to `f32`, for `|angle| < 2^32`.
///
/// The angle is reduced to `r = angle - k * pi/2` with `|r| <= pi/4` using a four-part `pi/2`
/// (the first step is exact, the others add about `2^-53` each), and the quadrant `k mod 4` picks
/// and signs the series results. Beyond `2^32` the reduction degrades gracefully but is no
/// longer exact.
#[inline(always)]
pub fn cos_sin_f32(angle: f64) -> (f32, f32) {
    let k = round_to_int(angle * core::f64::consts::FRAC_2_PI);
    let r = (((angle - k * PIO2_1) - k * PIO2_2) - k * PIO2_3) - k * PIO2_4;
    let (s, c) = sincos_reduced(r);
    // k is an integer below 2^50 in magnitude, so the cast is exact; `& 3` is k mod 4 in two's
    // complement for negative k too.
    let (cos, sin) = match (k as i64) & 3 {
        0 => (c, s),
        1 => (-s, c),
        2 => (-c, -s),
        _ => (s, -c),
    };
    (cos as f32, sin as f32)
}

/// `(cos, sin)` of `position * inv_freq`, rounded once to `f32`.
///
/// This is what the kernels compute when sin/cos do not come from a table; `inv_freq` is the
/// pair's frequency (for the default family `theta^(-2i / rotary_dim)`, computed on the host).
#[inline(always)]
pub fn rope_cos_sin(position: i64, inv_freq: f64) -> (f32, f32) {
    cos_sin_f32(position as f64 * inv_freq)
}

/// How the kernels form the angle `position * inv_freq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum AngleMode {
    /// In `f64` (see the module documentation): cos/sin within one `f32` ulp of the exact
    /// values at any position below `2^31`.
    Exact = 0,
    /// As PyTorch/HF models compute it: `f32(position) * f32(inv_freq)` rounded to `f32`, then
    /// cos/sin of that `f32` angle (computed exactly and rounded once). Reproduces models trained
    /// with such tables, including their error at long positions.
    F32Compat = 1,
}

impl AngleMode {
    /// Decodes a kernel argument; unknown codes mean [`AngleMode::Exact`].
    #[inline(always)]
    pub fn from_u32(code: u32) -> Self {
        if code == Self::F32Compat as u32 {
            Self::F32Compat
        } else {
            Self::Exact
        }
    }
}

/// The angle `position * inv_freq` formed as `mode` says. Both forms are computed and one is
/// selected, so the kernels share one sin/cos evaluation between the modes (a branch around
/// two copies of it cost registers).
#[inline(always)]
pub fn angle(position: i64, inv_freq: f64, mode: AngleMode) -> f64 {
    let exact = position as f64 * inv_freq;
    let f32_angle = f64::from(position as f32 * inv_freq as f32);
    if mode == AngleMode::F32Compat {
        f32_angle
    } else {
        exact
    }
}

/// `(cos, sin)` of `position * inv_freq` formed as `mode` says, rounded once to `f32`.
#[inline(always)]
pub fn rope_cos_sin_mode(position: i64, inv_freq: f64, mode: AngleMode) -> (f32, f32) {
    cos_sin_f32(angle(position, inv_freq, mode))
}

/// Widens bfloat16 bits to `f32` (exact: bfloat16 is the top half of an `f32`).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Rounds an `f32` to bfloat16 bits, to nearest with ties to even; NaN stays a quiet NaN
/// (of the same sign), infinities stay infinite, and overflow rounds to infinity.
#[inline(always)]
pub fn f32_to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if v.is_nan() {
        return ((u >> 16) | 0x0040) as u16;
    }
    // Adding 0x7fff plus the lowest kept bit rounds to nearest, ties to even; a carry out of
    // the mantissa correctly bumps the exponent (up to infinity).
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;

    /// Distance between two `f32` in units in the last place of `exact`.
    fn ulps(got: f32, exact: f64) -> f64 {
        let e = exact as f32;
        let ulp = if e == 0.0 {
            f32::MIN_POSITIVE as f64
        } else {
            (f32::from_bits(e.abs().to_bits() + 1) - e.abs()) as f64
        };
        ((got as f64) - exact).abs() / ulp
    }

    #[test]
    fn pio2_parts_sum_to_pi_over_2() {
        assert_eq!(
            ((PIO2_4 + PIO2_3) + PIO2_2) + PIO2_1,
            core::f64::consts::FRAC_PI_2
        );
        // The first three parts have at most 21 significant bits (32 trailing zero bits), so
        // k * PIO2_n is exact for |k| < 2^32.
        for p in [PIO2_1, PIO2_2, PIO2_3] {
            assert_eq!(p.to_bits() & ((1 << 32) - 1), 0, "{p}");
        }
    }

    #[test]
    fn cos_sin_within_one_ulp_over_wide_angles() {
        // Angles from tiny to 2^31, plus the neighbourhoods of multiples of pi/2.
        let mut a = 1e-9f64;
        while a < 2.2e9 {
            for angle in [a, -a] {
                let (c, s) = cos_sin_f32(angle);
                assert!(
                    ulps(c, angle.cos()) <= 1.0,
                    "cos({angle}) = {c} vs {}",
                    angle.cos()
                );
                assert!(
                    ulps(s, angle.sin()) <= 1.0,
                    "sin({angle}) = {s} vs {}",
                    angle.sin()
                );
            }
            a *= 1.011;
        }
        for k in 1..2000i64 {
            let angle = k as f64 * core::f64::consts::FRAC_PI_2 * 1.000_000_1;
            let (c, s) = cos_sin_f32(angle);
            assert!(((c as f64) - angle.cos()).abs() < 1e-7);
            assert!(((s as f64) - angle.sin()).abs() < 1e-7);
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (upwards).
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
        assert_eq!(f32_to_bf16(f32::NEG_INFINITY), 0xff80);
        assert!(bf16_to_f32(f32_to_bf16(f32::NAN)).is_nan());
        for bits in [0u16, 0x0001, 0x3f80, 0x7f7f, 0x8001, 0xc2f7] {
            assert_eq!(f32_to_bf16(bf16_to_f32(bits)), bits);
        }
    }

    #[test]
    fn rotate_is_the_plain_formula() {
        let (y0, y1) = rotate(1.5, -2.0, 0.6, 0.8);
        assert_eq!(y0, 1.5 * 0.6 - (-2.0) * 0.8);
        assert_eq!(y1, -2.0 * 0.6 + 1.5 * 0.8);
    }

    #[test]
    fn reduction_is_exact_near_every_multiple_of_pi_over_2_below_2_pow_22() {
        // With inv_freq 1 the angle is the position itself: every integer below 2^22, which
        // includes the integers closest to multiples of pi/2 in that range (the hardest
        // arguments for the reduction).
        let mut worst = 0.0f64;
        for p in 0..(1i64 << 22) {
            let (c, s) = rope_cos_sin(p, 1.0);
            let a = p as f64;
            for (got, want) in [(c, a.cos()), (s, a.sin())] {
                let err = ((got as f64) - want).abs();
                let tol = (f64::from(f32::EPSILON) * want.abs()).max(2f64.powi(-28));
                assert!(err <= tol, "p={p}: {got} vs {want}");
                worst = worst.max(err);
            }
        }
        assert!(worst < 6e-8, "worst {worst}");
    }

    #[test]
    fn f32_compat_reproduces_the_f32_angle() {
        let f = 10_000f64.powf(-0.25);
        for p in [0i64, 1, 4095, 131_071, 1_048_575] {
            let a = p as f32 * f as f32;
            let (c, s) = rope_cos_sin_mode(p, f, AngleMode::F32Compat);
            assert_eq!((c, s), ((a as f64).cos() as f32, (a as f64).sin() as f32));
        }
    }

    #[test]
    fn position_zero_gives_identity_rotation() {
        for i in 0..64 {
            assert_eq!(
                rope_cos_sin(0, 10_000f64.powf(-(i as f64) / 64.0)),
                (1.0, 0.0)
            );
        }
    }
}
