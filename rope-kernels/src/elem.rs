//! Element types the kernels load and store.
//!
//! Arithmetic is always `f32`: an element converts to `f32` on load and rounds once on store.

use crate::access::store;
use crate::intrinsics::trap;
use crate::{intrinsics, math};

/// A storage type of the kernels.
pub trait Elem: Copy {
    /// Zero, to initialise arrays.
    const ZERO: Self;
    /// Bytes per element.
    const SIZE: usize = size_of::<Self>();
    /// Widens to `f32` exactly.
    fn to_f32(self) -> f32;
    /// Widens `N` values as [`Elem::to_f32`] does each (types stored two to a 32-bit word
    /// override it to widen whole words).
    #[inline(always)]
    fn widen<const N: usize>(v: [Self; N]) -> [f32; N] {
        let mut out = [0.0f32; N];
        unrolled(N, |k| out[k] = v[k].to_f32());
        out
    }
    /// Rounds an `f32` to this type, to nearest even (identity for `f32`).
    fn from_f32(v: f32) -> Self;
    /// Rounds `N` values as [`Elem::from_f32`] does each and stores them at `p` with one
    /// access, as [`store`] (types with a paired conversion instruction override it).
    ///
    /// # Safety
    /// As [`store`].
    #[inline(always)]
    unsafe fn store_rounded<const N: usize>(p: *mut Self, v: [f32; N]) {
        // Straight-line rather than `v.map(..)`: inside a large kernel LLVM kept `map` as a
        // call with the array in local memory.
        let mut out = [Self::ZERO; N];
        unrolled(N, |k| out[k] = Self::from_f32(v[k]));
        // SAFETY: the caller's promise.
        unsafe { store(p, out) }
    }
}

impl Elem for f32 {
    const ZERO: Self = 0.0;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    unsafe fn store_rounded<const N: usize>(p: *mut Self, v: [f32; N]) {
        // SAFETY: the caller's promise.
        unsafe { store(p, v) }
    }
}

/// IEEE binary16 as its bits, so that vectors of them stay packed two to a 32-bit register until
/// each is widened (a native `f16` vector loads into one register per element, which cost the
/// computed-sin/cos NeoX kernel its spill-free register budget); conversions are the hardware's
/// (`cvt.f32.f16` from a 32-bit register, `cvt.rn.f16.f32`, and `cvt.rn.f16x2.f32` for pairs).
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Half(u16);

impl Elem for Half {
    const ZERO: Self = Half(0);
    #[inline(always)]
    fn to_f32(self) -> f32 {
        intrinsics::f16_bits_to_f32(self.0 as u32)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        Half((v as f16).to_bits())
    }
    /// Two values per `cvt.rn.f16x2.f32`, the same rounding as [`Elem::from_f32`].
    #[inline(always)]
    unsafe fn store_rounded<const N: usize>(p: *mut Self, v: [f32; N]) {
        // SAFETY: the caller's promise.
        unsafe { store_pairs(p, v, intrinsics::f32x2_to_f16x2, Self::from_f32) }
    }
}

/// bfloat16 as its bits; conversions in [`math`], shared with the host tests.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Bf16(u16);

impl Elem for Bf16 {
    const ZERO: Self = Bf16(0);
    #[inline(always)]
    fn to_f32(self) -> f32 {
        math::bf16_to_f32(self.0)
    }
    /// Pairs of values as the 32-bit words a load holds them in, one instruction per value
    /// ([`intrinsics::bf16x2_to_f32x2`]).
    #[inline(always)]
    fn widen<const N: usize>(v: [Self; N]) -> [f32; N] {
        let mut out = [0.0f32; N];
        unrolled(N / 2, |k| {
            let word = u32::from(v[2 * k].0) | u32::from(v[2 * k + 1].0) << 16;
            [out[2 * k], out[2 * k + 1]] = intrinsics::bf16x2_to_f32x2(word);
        });
        if N % 2 == 1 {
            out[N - 1] = v[N - 1].to_f32();
        }
        out
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        Bf16(math::f32_to_bf16(v))
    }
    /// Two values per `cvt.rn.bf16x2.f32`; the same rounding as [`math::f32_to_bf16`] for
    /// every non-NaN input.
    #[inline(always)]
    unsafe fn store_rounded<const N: usize>(p: *mut Self, v: [f32; N]) {
        // SAFETY: the caller's promise.
        unsafe { store_pairs(p, v, intrinsics::f32x2_to_bf16x2, Self::from_f32) }
    }
}

/// FP8 E4M3 (`e4m3fn`) bits: converted by [`math::f32_to_e4m3`] (saturating) and
/// [`math::e4m3_to_f32`]. The fused kernels store it; nothing loads it.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Fp8(u8);

impl Elem for Fp8 {
    const ZERO: Self = Fp8(0);
    #[inline(always)]
    fn to_f32(self) -> f32 {
        math::e4m3_to_f32(self.0)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        Fp8(math::f32_to_e4m3(v))
    }
    /// Two values per `cvt.rn.satfinite.e4m3x2.f32` where the PTX targets sm_89 or newer (the
    /// same bits as [`Elem::from_f32`] for every non-NaN input; about 19 instructions per value
    /// in software).
    #[cfg(target_feature = "sm_89")]
    #[inline(always)]
    unsafe fn store_rounded<const N: usize>(p: *mut Self, v: [f32; N]) {
        // SAFETY: the caller's promise.
        unsafe { store_pairs(p, v, intrinsics::f32x2_to_e4m3x2, Self::from_f32) }
    }
}

/// FP8 E5M2 bits: converted by [`math::f32_to_e5m2`] (saturating) and [`math::e5m2_to_f32`].
/// The fused kernels store it; nothing loads it.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct Fp8E5m2(u8);

impl Elem for Fp8E5m2 {
    const ZERO: Self = Fp8E5m2(0);
    #[inline(always)]
    fn to_f32(self) -> f32 {
        math::e5m2_to_f32(self.0)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        Fp8E5m2(math::f32_to_e5m2(v))
    }
    /// Two values per `cvt.rn.satfinite.e5m2x2.f32` where the PTX targets sm_89 or newer (the
    /// same bits as [`Elem::from_f32`] for every non-NaN input).
    #[cfg(target_feature = "sm_89")]
    #[inline(always)]
    unsafe fn store_rounded<const N: usize>(p: *mut Self, v: [f32; N]) {
        // SAFETY: the caller's promise.
        unsafe { store_pairs(p, v, intrinsics::f32x2_to_e5m2x2, Self::from_f32) }
    }
}

/// Stores `N` values (`N` at most 8) rounded two at a time by `pair`, which packs its first
/// argument in the low half of a word `W` of two elements and its second in the high half, as
/// the words the conversions return: splitting each word into its two elements and joining them
/// again cost two instructions per pair. An odd `N` rounds each value with `single`.
///
/// # Safety
/// As [`store`].
#[inline(always)]
unsafe fn store_pairs<E: Elem, W: Copy, const N: usize>(
    p: *mut E,
    v: [f32; N],
    pair: impl Fn(f32, f32) -> W,
    single: impl Fn(f32) -> E,
) {
    // `% N` keeps every index in bounds in the arms that do not run.
    let word = |i: usize| pair(v[2 * i % N], v[(2 * i + 1) % N]);
    // SAFETY (each arm): `N` elements are `N / 2` words of two, with the same size and
    // alignment; the caller's promise.
    unsafe {
        match N {
            8 => store::<W, 4>(p.cast(), [word(0), word(1), word(2), word(3)]),
            4 => store::<W, 2>(p.cast(), [word(0), word(1)]),
            2 => store::<W, 1>(p.cast(), [word(0)]),
            _ => {
                let mut out = [E::ZERO; N];
                unrolled(N, |k| out[k] = single(v[k]));
                store(p, out)
            }
        }
    }
}

/// Calls `f(0)`, ..., `f(count - 1)` as straight-line code, for `count <= 8`.
///
/// `count` is a constant at every call site, so after inlining each call indexes arrays with a
/// constant and the arrays stay in registers; a `for` loop over a large body is not unrolled
/// by LLVM and would put them in local memory.
#[inline(always)]
pub(crate) fn unrolled(count: usize, mut f: impl FnMut(usize)) {
    if count > 8 {
        trap()
    }
    macro_rules! step {
        ($($k:literal)*) => {$(if $k < count { f($k) })*};
    }
    step!(0 1 2 3 4 5 6 7);
}
