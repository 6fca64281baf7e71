//! The storage types under test ([`TestElem`]: `f32`, `f16`, `bf16`) and what the checks need to
//! know about each: rounding from `f64`, exact widening, a poison value and the spacing of its
//! values.

use std::fmt::Debug;

use rope_host::RopeElem;
use rope_host::cudarc::driver::ValidAsZeroBits;
use rope_host::half::{bf16, f16};

/// A storage type under test, with what the checks need to know about it.
pub trait TestElem: RopeElem + ValidAsZeroBits + Debug + Send + Sync + Unpin + 'static {
    /// `f32`, `f16` or `bf16`.
    const NAME: &'static str;
    /// Rounds once to this type, to nearest even.
    fn from_f64(v: f64) -> Self;
    /// Widens exactly.
    fn to_f64(self) -> f64;
    /// A NaN with a payload the kernels never produce: written into outputs before a launch,
    /// so an element still holding it afterwards was never written.
    fn poison() -> Self;
    /// The raw bits, for exact comparisons (NaN included).
    fn bits(self) -> u64;
    /// The spacing of this type's values at `|v|` (one unit in the last place).
    fn ulp(v: Self) -> f64;
}

impl TestElem for f32 {
    const NAME: &'static str = "f32";
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn poison() -> Self {
        f32::from_bits(0x7fc0_dead)
    }
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
    fn ulp(v: Self) -> f64 {
        let a = v.abs();
        f64::from(f32::from_bits(a.to_bits() + 1) - a)
    }
}

impl TestElem for f16 {
    const NAME: &'static str = "f16";
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn poison() -> Self {
        f16::from_bits(0x7e5b)
    }
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
    fn ulp(v: Self) -> f64 {
        let a = v.to_bits() & 0x7fff;
        f16::from_bits(a + 1).to_f64() - f16::from_bits(a).to_f64()
    }
}

impl TestElem for bf16 {
    const NAME: &'static str = "bf16";
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn poison() -> Self {
        bf16::from_bits(0x7fd5)
    }
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
    fn ulp(v: Self) -> f64 {
        let a = v.to_bits() & 0x7fff;
        bf16::from_bits(a + 1).to_f64() - bf16::from_bits(a).to_f64()
    }
}
