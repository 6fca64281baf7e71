//! Division of work-item indices by a divisor fixed for a launch, without a division
//! instruction.
//!
//! The kernels split every flat index into (token, group) and every token into (batch, seq):
//! two divisions per work item. On the GPU a `u32` division is a sequence of about twenty
//! instructions (and a `u64` one several times that), which the in-kernel sin/cos path, whose
//! issue slots are already busy with `f64` arithmetic, notices. The host computes a
//! [`Divisor`] once per launch; the kernel then divides with a multiply-high, an add and a
//! shift, and falls back to a plain division for indices of `2^32` and above.
//!
//! # The magic number
//! For a divisor `1 <= d < 2^32` let `l = ceil(log2 d)` and `M = ceil(2^(32 + l) / d)`. As
//! `2^(l - 1) < d <= 2^l` (or `d = 1`, `l = 0`), `2^32 <= M < 2^33`, and the kernel argument is
//! `magic = M - 2^32 < 2^32`. With `e = M d - 2^(32 + l)`, `0 <= e < d <= 2^l`,
//! `n M / 2^(32 + l) = n / d + n e / (d 2^(32 + l))`, and for `n < 2^32` the last term is below
//! `1 / d`, the least distance from `n / d` up to the next integer. So
//! `n / d = floor(n M / 2^(32 + l)) = (n + (n magic >> 32)) >> l`, with every intermediate
//! below `2^33`.

use core::num::NonZeroU32;

/// A divisor with its magic number and shift (see the module documentation), passed to the
/// kernels as three `u32` arguments; build it with [`Divisor::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Divisor {
    /// The divisor `d`.
    pub divisor: NonZeroU32,
    /// `ceil(2^(32 + shift) / d) - 2^32`.
    pub magic: u32,
    /// `ceil(log2 d)`.
    pub shift: u32,
}

impl Divisor {
    /// The magic number and shift of `divisor`.
    pub const fn new(divisor: NonZeroU32) -> Self {
        let d = divisor.get() as u128;
        let shift = u32::BITS - (divisor.get() - 1).leading_zeros();
        let m = (1u128 << (32 + shift)).div_ceil(d);
        Self {
            divisor,
            magic: (m - (1u128 << 32)) as u32,
            shift,
        }
    }

    /// `(n / d, n % d)`, exact for every `n` when `magic` and `shift` are those [`Divisor::new`]
    /// computes (the kernels rely on it for their indices, so their entry points list it among
    /// their safety promises). Indices of `2^32` and above take a plain `u64` division.
    #[inline(always)]
    pub fn div_rem(self, n: u64) -> (u64, u64) {
        let d = self.divisor.get() as u64;
        if n >> 32 == 0 {
            let hi = ((n as u32 as u64) * self.magic as u64) >> 32;
            let q = (n + hi).wrapping_shr(self.shift);
            (q, n.wrapping_sub(q.wrapping_mul(d)))
        } else {
            (n / d, n % d)
        }
    }

    /// `(n / d, n % d)` for a 32-bit index: [`Divisor::div_rem`] without the wide fallback
    /// (the sum `n + (n magic >> 32)` still takes 33 bits).
    #[inline(always)]
    pub fn div_rem_u32(self, n: u32) -> (u32, u32) {
        let hi = (u64::from(n) * u64::from(self.magic)) >> 32;
        let q = ((u64::from(n) + hi) >> self.shift) as u32;
        (q, n.wrapping_sub(q.wrapping_mul(self.divisor.get())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn div(d: u32) -> Divisor {
        Divisor::new(NonZeroU32::new(d).expect("nonzero"))
    }

    /// Checks the multiply-high form itself (not the fallback) against `/` and `%`.
    fn assert_exact(v: Divisor, n: u64) {
        let d = v.divisor.get() as u64;
        let hi = (n * v.magic as u64) >> 32;
        assert_eq!((n + hi) >> v.shift, n / d, "{n} / {d} by magic {v:?}");
        assert_eq!(v.div_rem(n), (n / d, n % d));
        let (q, r) = v.div_rem_u32(n as u32);
        assert_eq!((u64::from(q), u64::from(r)), (n / d, n % d));
    }

    #[test]
    fn magic_division_is_exact_for_every_index_below_2_pow_32() {
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let special = [
            1u32,
            2,
            3,
            5,
            7,
            12,
            16,
            24,
            48,
            641,
            8191,
            8192,
            8193,
            1 << 31,
        ];
        let divisors = special
            .into_iter()
            .chain([u32::MAX, u32::MAX - 1, (1 << 31) + 1])
            .chain((0..2000).map(|_| (next() >> 32) as u32 >> (next() % 32)))
            .filter(|&d| d > 0)
            .collect::<std::vec::Vec<_>>();
        for d in divisors {
            let v = div(d);
            let d64 = d as u64;
            // Around the multiples of d (where the quotient steps), the ends of the range and
            // random indices.
            let mut ns = [0u64, 1, u32::MAX as u64, u32::MAX as u64 - 1, d64 - 1, d64].to_vec();
            let top = u32::MAX as u64 / d64;
            for q in [1, 2, top / 2, top.saturating_sub(1), top] {
                for delta in [-1i64, 0, 1] {
                    let n = (q * d64) as i64 + delta;
                    if (0..=u32::MAX as i64).contains(&n) {
                        ns.push(n as u64);
                    }
                }
            }
            ns.extend((0..200).map(|_| next() >> 32));
            for n in ns {
                assert_exact(v, n);
            }
        }
    }

    #[test]
    fn exhaustive_over_small_divisors_and_indices() {
        for d in 1..=300u32 {
            let v = div(d);
            for n in 0..20_000u64 {
                assert_exact(v, n);
            }
        }
    }

    #[test]
    fn indices_of_2_pow_32_and_above_fall_back_to_plain_division() {
        let v = div(48);
        for n in [1u64 << 32, (1 << 32) + 47, u64::MAX, 1 << 40] {
            assert_eq!(v.div_rem(n), (n / 48, n % 48));
        }
    }
}
