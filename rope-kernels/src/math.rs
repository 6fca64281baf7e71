//! The arithmetic of RoPE as plain functions that compile for the GPU and the host alike.
//!
//! Everything here is plain Rust with no intrinsics (`f64` fused multiply-adds are `core`'s on
//! the GPU and `std`'s on the host, one rounding either way), so the host's unit tests exercise
//! exactly the code the kernels run. Nothing here reads memory.
//!
//! # The angle and its accuracy
//! Pair `i` of the token at position `p` rotates by `angle = p * inv_freq_i`, with the
//! frequencies `inv_freq_i` (for the default family `theta^(-2i/d)`) computed on the host in
//! `f64`. The kernels compute that angle in `f64`, reduce it modulo `pi/2` in `f64` (Cody–Waite
//! with fused multiply-adds and a two-part `pi/2`) and evaluate `sin`/`cos` of the reduced
//! argument with `f64` polynomials, rounding to `f32` once at the end. The `f64` angle is off by
//! about `2^-53 * |angle|` (under `1e-9` radians up to position `2^22`) and the reduction adds
//! about `2^-53 * |r|`, so `cos`/`sin` land within one `f32` unit in the last place of the exact
//! values (within `2^-28` absolute near their zeros); an `f32` angle (`p_f32 * inv_freq_f32`) is
//! off by up to `ulp(p * inv_freq) / 2`, about `3e-2` radians at position one million.

/// `2^52 * 1.5`: adding and subtracting it rounds an `f64` of magnitude below `2^51` to the
/// nearest integer (ties to even) without any float-to-int conversion.
const ROUND_MAGIC: f64 = 6_755_399_441_055_744.0;

/// `pi/2` as the `f64` nearest to it (`FRAC_PI_2`) plus the `f64` nearest to the remainder; the
/// sum is within `1.5e-33` of `pi/2`.
const PIO2_HI: f64 = core::f64::consts::FRAC_PI_2;
const PIO2_LO: f64 = 6.123_233_995_736_766e-17;

/// Rotates one pair `(a, b)` by the angle whose cosine and sine are `cos`, `sin`:
/// `(a cos - b sin, b cos + a sin)`.
///
/// The backward pass of RoPE is the same rotation with `-sin` (the transposed rotation).
#[inline(always)]
pub fn rotate(a: f32, b: f32, cos: f32, sin: f32) -> (f32, f32) {
    (a * cos - b * sin, b * cos + a * sin)
}

/// `a * b + c` with one rounding (a fused multiply-add: `fma.rn.f64` on the GPU).
#[inline(always)]
fn fma(a: f64, b: f64, c: f64) -> f64 {
    #[cfg(target_arch = "nvptx64")]
    {
        core::f64::math::mul_add(a, b, c)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        std::primitive::f64::mul_add(a, b, c)
    }
}

/// `a * b + c` with one rounding in `f32` (`fma.rn.f32` on the GPU).
#[inline(always)]
fn fma_f32(a: f32, b: f32, c: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        core::f32::math::mul_add(a, b, c)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        std::primitive::f32::mul_add(a, b, c)
    }
}

/// `sin(r)` and `cos(r)` for `|r| <= pi/4` (a little beyond is fine), by Taylor series to
/// degree 11 and 10: truncation error below `(pi/4)^13 / 13! < 2^-36` and
/// `(pi/4)^12 / 12! < 2^-32` against values of at least `|r| * 2/pi` and `0.7`, far below the
/// `2^-25` relative half-ulp of the `f32` result. (The `f64` evaluation is for the `f32` result,
/// not for `f64` accuracy.)
#[inline(always)]
fn sincos_reduced(r: f64) -> (f64, f64) {
    let z = r * r;
    let mut s = -1.0 / 39_916_800.0; // -1/11!
    s = fma(s, z, 1.0 / 362_880.0);
    s = fma(s, z, -1.0 / 5_040.0);
    s = fma(s, z, 1.0 / 120.0);
    s = fma(s, z, -1.0 / 6.0);
    let sin = fma(r * z, s, r);
    let mut c = -1.0 / 3_628_800.0; // -1/10!
    c = fma(c, z, 1.0 / 40_320.0);
    c = fma(c, z, -1.0 / 720.0);
    c = fma(c, z, 1.0 / 24.0);
    c = fma(c, z, -0.5);
    let cos = fma(z, c, 1.0);
    (sin, cos)
}

/// `(cos(angle), sin(angle))` rounded once to `f32`, for `|angle| < 2^32`.
///
/// `k = round(angle * 2/pi)` comes from one fused multiply-add with `ROUND_MAGIC = 1.5 * 2^52`
/// (whose low bits then hold `k mod 4`, the quadrant). The reduced argument `r = angle - k * pi/2`,
/// `|r| <= pi/4`, takes two fused multiply-adds: `angle - k * PIO2_HI` is exact (both are
/// multiples of `ulp(PIO2_HI) = 2^-52`, or `2^-53` when `|angle| < 1` and `|k| <= 1`, and the
/// difference is below 1), and subtracting `k * PIO2_LO` rounds once, relative to `r`; what the
/// two parts miss of `pi/2` adds at most `|k| * 1.5e-33`. The quadrant picks and signs the
/// series results.
#[inline(always)]
pub fn cos_sin_f32(angle: f64) -> (f32, f32) {
    let shifted = fma(angle, core::f64::consts::FRAC_2_PI, ROUND_MAGIC);
    let k = shifted - ROUND_MAGIC;
    // `shifted = 1.5 * 2^52 + k` has a unit last place, so its mantissa's low bits are those of
    // `k + 2^51`, and `2^51` is a multiple of 4: the two lowest bits are `k mod 4`.
    let quadrant = shifted.to_bits() as u32 & 3;
    let r = fma(-k, PIO2_LO, fma(-k, PIO2_HI, angle));
    let (s, c) = sincos_reduced(r);
    let (s, c) = (s as f32, c as f32);
    // By quadrant 0, 1, 2, 3: cos is c, -s, -c, s and sin is s, c, -s, -c. Odd quadrants swap
    // the two; the sign flips for cos in quadrants 1 and 2 and for sin in 2 and 3. Selects and
    // sign-bit flips rather than a `match`: the threads of a warp sit in different quadrants, and
    // a `match` compiles to an indirect branch that they would take one quadrant at a time.
    let (cos, sin) = if quadrant & 1 == 1 { (s, c) } else { (c, s) };
    let flip = |v: f32, bit: u32| f32::from_bits(v.to_bits() ^ (bit << 30));
    (flip(cos, (quadrant + 1) & 2), flip(sin, quadrant & 2))
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
    /// Decodes a kernel argument; `None` for an unknown code (the kernels trap on it, as on
    /// an unknown position code: the host only sends codes of this enum).
    #[inline(always)]
    pub fn from_u32(code: u32) -> Option<Self> {
        match code {
            0 => Some(Self::Exact),
            1 => Some(Self::F32Compat),
            _ => None,
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

/// The largest finite FP8 E4M3 value (`e4m3fn`: 4 exponent bits of bias 7, 3 mantissa bits, no
/// infinities, `0x7f`/`0xff` NaN).
pub const E4M3_MAX: f32 = 448.0;

/// Rounds an `f32` to FP8 E4M3 (`e4m3fn`) bits, to nearest with ties to even, saturating: a
/// magnitude at or above [`E4M3_MAX`] (infinity included) gives `±448`, as the FP8 attention
/// kernels expect of a scaled cache; NaN gives `0x7f` with the input's sign. Magnitudes below
/// `2^-6` round to the subnormals `m * 2^-9`.
///
/// Branch-free: every case is computed and one is selected, since a per-element branch
/// diverges within a warp.
#[inline(always)]
pub fn f32_to_e4m3(v: f32) -> u8 {
    const TWO_23: f32 = 8_388_608.0;
    let bits = v.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = bits & 0x7fff_ffff;
    // At or above 2^-6: keep 3 of the 23 mantissa bits, rounding to nearest even; a carry bumps
    // the exponent, and below 448 the result stays at most 448 (exponent 15, mantissa 6). Bits
    // 20.. of the rounded value are then the exponent (bias 127) and the 3 kept bits.
    let rounded = a.wrapping_add(0x7_ffff + ((a >> 20) & 1));
    let normal = (rounded >> 20).wrapping_sub((127 - 7) << 3);
    // Below 2^-6: a multiple of 2^-9. `a * 512` is exact and below 8, and adding 2^23 rounds it
    // to an integer, ties to even, which the sum's low mantissa bits then hold (8 is the
    // smallest normal's code, so a carry lands on it).
    let subnormal = (f32::from_bits(a) * 512.0 + TWO_23).to_bits() - TWO_23.to_bits();
    let code = if a < 0x3c80_0000 { subnormal } else { normal };
    let code = if a >= E4M3_MAX.to_bits() { 0x7e } else { code };
    let code = if a > 0x7f80_0000 { 0x7f } else { code };
    sign | code as u8
}

/// The value of FP8 E4M3 (`e4m3fn`) bits as an `f32` (exact).
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((b >> 3) & 0xf), f32::from(b & 7));
    let magnitude = match (e, b & 7) {
        (15, 7) => f32::NAN,
        (0, _) => m * (1.0 / 512.0),
        _ => (1.0 + m / 8.0) * f32::from_bits(((e - 7 + 127) as u32) << 23),
    };
    sign * magnitude
}

/// The value of a non-negative finite FP8 E4M3 code (`0..=0x7e`) as an `f32` (exact), in two
/// instructions: the code's exponent and mantissa bits placed at an `f32`'s make `value *
/// 2^-120` (a subnormal `f32` for E4M3's subnormals, so the product needs subnormals kept, as
/// PTX's `mul.rn.f32` without `.ftz` keeps them).
#[inline(always)]
pub fn e4m3_magnitude(code: u8) -> f32 {
    const TWO_120: f32 = f32::from_bits((127 + 120) << 23);
    f32::from_bits(u32::from(code) << 20) * TWO_120
}

/// The largest finite FP8 E5M2 value (5 exponent bits of bias 15, 2 mantissa
/// bits, infinities and NaNs as in IEEE 754): `1.75 * 2^15`.
pub const E5M2_MAX: f32 = 57_344.0;

/// Rounds an `f32` to FP8 E5M2 bits, to nearest with ties to even, saturating as CUDA's
/// `__NV_SATFINITE` conversion does: a magnitude at or above [`E5M2_MAX`] (infinity included)
/// gives `±57344`; NaN gives `0x7f` with the input's sign. Magnitudes below `2^-14` round to the
/// subnormals `m * 2^-16`.
///
/// Branch-free, as [`f32_to_e4m3`].
#[inline(always)]
pub fn f32_to_e5m2(v: f32) -> u8 {
    const TWO_23: f32 = 8_388_608.0;
    let bits = v.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = bits & 0x7fff_ffff;
    // At or above 2^-14: keep 2 of the 23 mantissa bits, rounding to nearest even; bits 21.. of
    // the rounded value are then the exponent (bias 127) and the 2 kept bits.
    let rounded = a.wrapping_add(0xf_ffff + ((a >> 21) & 1));
    let normal = (rounded >> 21).wrapping_sub((127 - 15) << 2);
    // Below 2^-14: a multiple of 2^-16, found as `f32_to_e4m3` finds its subnormals (4 is the
    // smallest normal's code).
    let subnormal = (f32::from_bits(a) * 65_536.0 + TWO_23).to_bits() - TWO_23.to_bits();
    let code = if a < 0x3880_0000 { subnormal } else { normal };
    let code = if a >= E5M2_MAX.to_bits() { 0x7b } else { code };
    let code = if a > 0x7f80_0000 { 0x7f } else { code };
    sign | code as u8
}

/// The largest FP4 E2M1 value (2 exponent bits of bias 1, 1 mantissa bit, no infinities or
/// NaNs; the element type of NVFP4): `1.5 * 2^2`.
pub const E2M1_MAX: f32 = 6.0;

/// Rounds an `f32` to FP4 E2M1 bits (the low 4 bits; bit 3 the sign), to nearest with ties to
/// even, saturating: a magnitude at or above [`E2M1_MAX`] (infinity included) gives `±6`. E2M1
/// holds no NaN: a NaN gives `±6` too, with the input's sign. See [`e2m1_code`].
#[inline(always)]
pub fn f32_to_e2m1(v: f32) -> u8 {
    e2m1_code(v) as u8
}

/// [`f32_to_e2m1`] in the low 4 bits of a `u32` (the rest zero), in a dozen integer and float
/// instructions. The eight magnitudes are `0, 0.5, 1, 1.5, 2, 3, 4, 6` (codes 0 to 7): from 1
/// on, an exponent (bias 1) and one mantissa bit; below, multiples of 0.5.
#[inline(always)]
pub fn e2m1_code(v: f32) -> u32 {
    const TWO_23: f32 = 8_388_608.0;
    // The magnitude at most 6 (the minimum of NaN and 6 is 6).
    let a = v.abs().min(E2M1_MAX);
    let bits = a.to_bits();
    // At or above 1: keep 1 of the 23 mantissa bits, rounding to nearest even; bits 22.. of the
    // rounded value are then the exponent (bias 127) and the kept bit, `code + 252`, and 6
    // stays 6. Adding 4 more makes the low three bits the code.
    let normal = bits.wrapping_add((0x1f_ffff + (4 << 22)) + ((bits >> 22) & 1)) >> 22;
    // Below 1: a multiple of 0.5. `a * 2` is exact and below 2, and adding 2^23 rounds it to an
    // integer, ties to even, which the sum's low mantissa bits then hold (2 is the code of 1, so
    // a carry lands on it); one fused multiply-add, the product being exact.
    let subnormal = fma_f32(a, 2.0, TWO_23).to_bits();
    let code = if a < 1.0 { subnormal } else { normal };
    // The code's three bits, and the sign (bit 31) as bit 3.
    (code & 7) | ((v.to_bits() >> 28) & 8)
}

/// The value of FP4 E2M1 bits (the low 4 bits of `b`) as an `f32` (exact).
#[inline(always)]
pub fn e2m1_to_f32(b: u8) -> f32 {
    let sign = if b & 0x8 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((b >> 1) & 3), f32::from(b & 1));
    let magnitude = match e {
        0 => m * 0.5,
        _ => (1.0 + m / 2.0) * f32::from_bits(((e - 1 + 127) as u32) << 23),
    };
    sign * magnitude
}

/// The value of FP8 E5M2 bits as an `f32` (exact).
#[inline(always)]
pub fn e5m2_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((b >> 2) & 0x1f), f32::from(b & 3));
    let magnitude = match (e, b & 3) {
        (31, 0) => f32::INFINITY,
        (31, _) => f32::NAN,
        (0, _) => m * (1.0 / 65_536.0),
        _ => (1.0 + m / 4.0) * f32::from_bits(((e - 15 + 127) as u32) << 23),
    };
    sign * magnitude
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
        assert_eq!(PIO2_HI + PIO2_LO, core::f64::consts::FRAC_PI_2);
        // The low part is the f64 nearest to the remainder: half its ulp exceeds what is left.
        let ulp_lo = f64::from_bits(PIO2_LO.to_bits() + 1) - PIO2_LO;
        assert!(1.5e-33 < ulp_lo / 2.0);
    }

    /// The series and reduction errors are far below the final rounding, so cos/sin are correctly
    /// rounded except within a hair of a tie: at most 0.51 ulp (measured 0.502).
    const MAX_ULPS: f64 = 0.51;

    fn assert_close(angle: f64) {
        let (c, s) = cos_sin_f32(angle);
        for (name, got, want) in [("cos", c, angle.cos()), ("sin", s, angle.sin())] {
            let u = ulps(got, want);
            assert!(u <= MAX_ULPS, "{name}({angle}) = {got} vs {want}: {u} ulp");
        }
    }

    #[test]
    fn cos_sin_within_0_51_ulp_over_wide_and_random_angles() {
        // Angles from tiny to 2^31 on a geometric grid.
        let mut a = 1e-9f64;
        while a < 2.2e9 {
            assert_close(a);
            assert_close(-a);
            a *= 1.011;
        }
        // Two million pseudo-random angles: half uniform in [0, 8), half log-uniform up to 2^22.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for i in 0..2_000_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 11) as f64 / (1u64 << 53) as f64;
            let angle = if i % 2 == 0 {
                u * 8.0
            } else {
                (u * 22.0 * core::f64::consts::LN_2).exp()
            };
            assert_close(angle);
        }
        // The neighbourhoods of multiples of pi/2, absolute.
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

    /// A frequency of zero (Gemma 4's pairs past its rotated share) leaves its pair as it is:
    /// cos exactly 1 and sin exactly zero, at every position and in every angle mode, so the
    /// rotation `x cos - y sin`, `y cos + x sin` returns both elements unchanged.
    #[test]
    fn zero_frequency_is_the_identity_at_every_position() {
        for mode in [AngleMode::Exact, AngleMode::F32Compat] {
            for p in [0i64, 1, -1, 7, 4096, 1 << 20, i32::MAX as i64, -(1 << 31)] {
                let (c, s) = rope_cos_sin_mode(p, 0.0, mode);
                assert_eq!((c, s.abs()), (1.0, 0.0), "{p} {mode:?}");
                assert_eq!(rotate(1.5, -2.0, c, s), (1.5, -2.0));
            }
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

    /// Every non-negative finite value of a small float format (FP8, FP4), in increasing order
    /// of magnitude, as `(bits, value)`: the codes below `end` (the first code of infinity or
    /// NaN, or of the negative values).
    fn format_values(decode: fn(u8) -> f32, end: u8) -> std::vec::Vec<(u8, f64)> {
        (0u8..end).map(|b| (b, f64::from(decode(b)))).collect()
    }

    /// The nearest of `values` to `x` (ties to the even mantissa), saturating at the largest,
    /// by search; `nan` for NaN; `sign_bit` the format's sign bit.
    fn nearest(x: f32, values: &[(u8, f64)], (nan, sign_bit): (u8, u8)) -> u8 {
        let sign = if x.is_sign_negative() { sign_bit } else { 0 };
        if x.is_nan() {
            return sign | nan;
        }
        // Saturated first: far past the largest value, distances to the largest few are equal.
        let a = f64::from(x.abs()).min(values[values.len() - 1].1);
        let mut best = values[0];
        for &(b, v) in values {
            let (d, best_d) = ((v - a).abs(), (best.1 - a).abs());
            if d < best_d || (d == best_d && b & 1 == 0) {
                best = (b, v);
            }
        }
        sign | best.0
    }

    /// Probes for a rounding to `values`: every value, every midpoint and its neighbours, values
    /// past the largest, and a sweep of `f32` bit patterns.
    fn rounding_probes(values: &[(u8, f64)]) -> std::vec::Vec<f32> {
        let mut probes: std::vec::Vec<f32> = std::vec::Vec::new();
        for w in values.windows(2) {
            let mid = ((w[0].1 + w[1].1) / 2.0) as f32;
            probes.extend([w[0].1 as f32, mid, f32::from_bits(mid.to_bits() + 1)]);
            if mid.to_bits() > 0 {
                probes.push(f32::from_bits(mid.to_bits() - 1));
            }
        }
        let max = values[values.len() - 1].1 as f32;
        probes.extend([
            max,
            max * 1.03,
            max * 1.2,
            1e30,
            f32::INFINITY,
            f32::MIN_POSITIVE,
            0.0,
        ]);
        probes.extend(
            (0..1u32 << 16).map(|i| f32::from_bits(i.wrapping_mul(65_537 * 4099) ^ i << 7)),
        );
        probes
    }

    /// `round(x)` equals the nearest value by search for every probe and its negation; a NaN
    /// gives `nan` (whatever its sign); `sign_bit` is the format's sign bit.
    fn check_rounding(round: fn(f32) -> u8, values: &[(u8, f64)], (nan, sign_bit): (u8, u8)) {
        for x in rounding_probes(values) {
            for x in [x, -x] {
                let (got, want) = (round(x), nearest(x, values, (nan, sign_bit)));
                if x.is_nan() {
                    assert_eq!(got & !sign_bit, nan);
                } else {
                    assert_eq!(got, want, "{x:e}: got {got:#04x}, nearest {want:#04x}");
                }
            }
        }
    }

    #[test]
    fn e4m3_values_increase_and_reach_448() {
        let values = format_values(e4m3_to_f32, 0x7f);
        assert!(values.windows(2).all(|w| w[0].1 < w[1].1));
        assert_eq!(values[values.len() - 1].1, f64::from(E4M3_MAX));
        assert_eq!(values[1].1, 2f64.powi(-9));
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
    }

    /// Rounding matches the nearest value by search (ties to even, saturation at 448).
    #[test]
    fn e4m3_rounds_to_nearest_even_and_saturates() {
        check_rounding(f32_to_e4m3, &format_values(e4m3_to_f32, 0x7f), (0x7f, 0x80));
    }

    /// The two-instruction decoding gives every non-negative finite code's value.
    #[test]
    fn e4m3_magnitude_matches_the_decoding() {
        for code in 0u8..0x7f {
            assert_eq!(e4m3_magnitude(code), e4m3_to_f32(code), "{code:#04x}");
        }
    }

    #[test]
    fn e5m2_values_increase_and_reach_57344() {
        let values = format_values(e5m2_to_f32, 0x7c);
        assert!(values.windows(2).all(|w| w[0].1 < w[1].1));
        assert_eq!(values[values.len() - 1].1, f64::from(E5M2_MAX));
        assert_eq!(values[1].1, 2f64.powi(-16));
        assert_eq!(values[4].1, 2f64.powi(-14));
        assert_eq!(e5m2_to_f32(0x7c), f32::INFINITY);
        assert!(e5m2_to_f32(0x7d).is_nan() && e5m2_to_f32(0xff).is_nan());
        assert_eq!(e5m2_to_f32(0xfb), -57_344.0);
    }

    /// Rounding matches the nearest value by search (ties to even, saturation at 57344 as
    /// `__NV_SATFINITE`, infinity included).
    #[test]
    fn e5m2_rounds_to_nearest_even_and_saturates() {
        check_rounding(f32_to_e5m2, &format_values(e5m2_to_f32, 0x7c), (0x7f, 0x80));
    }

    #[test]
    fn e2m1_values_increase_and_reach_6() {
        let values = format_values(e2m1_to_f32, 8);
        let magnitudes: std::vec::Vec<f64> = values.iter().map(|&(_, v)| v).collect();
        assert_eq!(magnitudes, [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]);
        assert_eq!(e2m1_to_f32(0xf), -6.0);
        assert_eq!(e2m1_to_f32(0x9), -0.5);
    }

    /// Rounding matches the nearest value by search (ties to even, saturation at 6, infinity
    /// included); NaN gives the largest magnitude, E2M1 having no NaN.
    #[test]
    fn e2m1_rounds_to_nearest_even_and_saturates() {
        check_rounding(f32_to_e2m1, &format_values(e2m1_to_f32, 8), (7, 0x8));
        assert_eq!(f32_to_e2m1(-f32::NAN), 0xf);
        assert_eq!(f32_to_e2m1(f32::NAN), 0x7);
        assert_eq!(f32_to_e2m1(-0.0), 0x8);
    }
}
