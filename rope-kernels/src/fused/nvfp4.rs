//! The NVFP4 cache stores of the four-heads kernels of NVFP4 caches (`_four_heads_nvfp4`,
//! [`crate::abi::FusedForms::Nvfp4`]; the layout in [`crate::nvfp4_kernel_params!`]).
//!
//! # Formula
//! Each block of [`NVFP4_BLOCK`] consecutive elements `x` of a cached head (k's normalised and
//! rotated, v's as read), with `m = 1 / s` the head's global multiplier (`s` its global scale,
//! the reciprocal from `rcp.approx`, as the FP8 caches' multipliers):
//! - its scale `b = e4m3(max_e |x_e| * m * (1 / 6))` ([`crate::math::f32_to_e4m3`], nearest
//!   even, saturating at 448: the largest element maps to about E2M1's largest, 6);
//! - its values `e2m1(x_e * (m / b))` ([`crate::math::f32_to_e2m1`], nearest even, saturating
//!   at 6; `m / b` as `m` times the approximate reciprocal of `b`, `rcp.approx.ftz`, within an
//!   ulp: `b` is 0 or a normal `f32`), zeros where `b` is 0.
//!
//! So `x_e ~ e2m1_e * b * s`, TensorRT-LLM's two-level NVFP4 with its global scale as `1 / s`.
//!
//! # Thread mapping
//! A thread of the four-heads mapping holds, of each head, one vector of `L` consecutive
//! elements (two, `half` apart, for NeoX), and the vectors of a head's consecutive threads are
//! consecutive: a block's elements are the vectors of `NVFP4_BLOCK / L` consecutive lanes (2 or
//! 4, aligned), which exchange their maxima with one or two butterfly shuffles
//! ([`block_maxima`], while the whole warp is there). Each lane stores its `L / 2` bytes of
//! codes ([`crate::math::e2m1_code`]); the block's first lane its scale.
//!
//! # Layout
//! Codes: the cache's element offsets (the cache strides, in elements) halved to bytes.
//! Block scales: a buffer (or the codes' buffer) at byte strides of their own, `scale_stride_*`
//! of [`crate::nvfp4_kernel_params!`]: block `b` of a head at byte `b` from the head's first.

use crate::abi::NVFP4_BLOCK;
use crate::access::store;
use crate::intrinsics::{rcp_approx_ftz, shuffle_xor, sync_warp, thread_idx_x, trap};
use crate::math::{e2m1_code, e4m3_magnitude};
use crate::rope::{Pairing, vector_offsets};

use super::{Fp8Dest, fp8_multipliers};

/// One NVFP4 cache's destination: its codes (two E2M1 codes a byte, addressed by the cache's
/// element offsets halved), its block scales (one E4M3 byte per [`NVFP4_BLOCK`] elements, at
/// their own byte strides) and its global scales (one `f32`, or one per head at a step of 1).
#[derive(Clone, Copy)]
pub(super) struct Nvfp4Cache {
    pub(super) codes: *mut u8,
    pub(super) block_scales: *mut u8,
    pub(super) global: (*const f32, u32),
}

/// Two E4M3 codes of non-negative values: one paired conversion where the PTX targets sm_89 or
/// newer, the same bits as [`crate::math::f32_to_e4m3`] otherwise.
#[inline(always)]
fn e4m3_pair(lo: f32, hi: f32) -> [u8; 2] {
    #[cfg(target_feature = "sm_89")]
    {
        let w = crate::intrinsics::f32x2_to_e4m3x2(lo, hi);
        [w as u8, (w >> 8) as u8]
    }
    #[cfg(not(target_feature = "sm_89"))]
    {
        [crate::math::f32_to_e4m3(lo), crate::math::f32_to_e4m3(hi)]
    }
}

/// The E2M1 codes of `x * r`, two a byte (element `2 i` in the low four bits of byte `i`), in
/// the low `4 L` bits.
#[inline(always)]
fn packed_codes<const L: usize>(x: &[f32; L], r: f32) -> u32 {
    let mut word = 0u32;
    let mut k = 0;
    while k < L {
        word |= e2m1_code(x[k] * r) << (4 * k);
        k += 1;
    }
    word
}

/// Each block's largest magnitude among the live heads' values `y(u)` (zero for heads that are
/// not live), one per head and vector, exchanged among the block's lanes.
///
/// Every lane of the warp calls this (full-warp shuffles); a block's lanes are consecutive and
/// aligned ([`NVFP4_BLOCK`]` / L` of them), so each exchange stays inside blocks.
#[inline(always)]
pub(super) fn block_maxima<P: Pairing, const L: usize, const U: usize>(
    y: &impl Fn(usize) -> [[f32; L]; 2],
    live: [bool; U],
) -> [[f32; 2]; U] {
    let block_lanes = NVFP4_BLOCK / L as u32;
    let vectors = if P::NEOX { 2 } else { 1 };
    let mut top = [[0.0f32; 2]; U];
    each_head!(U, u => { if live[u] {
        let x = y(u);
        let mut v = 0;
        while v < vectors {
            let mut k = 0;
            while k < L {
                top[u][v] = top[u][v].max(x[v][k].abs());
                k += 1;
            }
            v += 1;
        }
    } });
    // The whole warp is here (the caller's promise): said before the shuffles, so that none
    // needs a convergence check.
    sync_warp();
    let mut s = 1;
    while s < block_lanes {
        let mut u = 0;
        while u < U {
            let mut v = 0;
            while v < vectors {
                top[u][v] = top[u][v].max(shuffle_xor(top[u][v], s, u32::MAX));
                v += 1;
            }
            u += 1;
        }
        s *= 2;
    }
    top
}

/// Stores one vector `x` of a head: its `L / 2` bytes of codes at element `e` (halved to its
/// byte) of the codes, given its block's scale code, the head's multiplier `m`; the block's
/// first lane (`leader`) also stores the scale code at byte `scale`.
///
/// # Safety
/// The vector's bytes and the scale byte lie in their buffers; `e` is a multiple of `L`.
#[inline(always)]
unsafe fn store_vector<const L: usize>(
    cache: &Nvfp4Cache,
    (e, scale): (u64, u64),
    x: &[f32; L],
    (code, m, leader): (u8, f32, bool),
) {
    // A scale is 0 or at least 2^-9, a normal `f32`: the reciprocal needs no subnormal care.
    let b = e4m3_magnitude(code);
    let r = if b > 0.0 { m * rcp_approx_ftz(b) } else { 0.0 };
    let word = packed_codes::<L>(x, r);
    let byte = (e / 2) as usize;
    // SAFETY: the caller's promises; `e` a multiple of `L`, the `L / 2` bytes are aligned to
    // their size.
    unsafe {
        if L == 8 {
            store::<u32, 1>(cache.codes.add(byte).cast(), [word]);
        } else {
            store::<u16, 1>(cache.codes.add(byte).cast(), [word as u16]);
        }
        if leader {
            *cache.block_scales.add(scale as usize) = code;
        }
    }
}

/// Stores the four-heads body's live heads `i0 + u` (`live[u]`), each's values `y(u)`, into
/// an NVFP4 cache as the module says: head `i0 + u`'s codes start at element `first + u *
/// stride` (halved to bytes) and its block scales at byte `scale_first + u * scale_stride`;
/// `at` is the thread's `(j0, half)`, `tops` the blocks' largest magnitudes
/// ([`block_maxima`]).
///
/// # Safety
/// The live heads' elements (and their block scales) lie inside the cache's buffers; `first`
/// and `stride` are multiples of 8; the global scales hold one `f32` (step 0) or one per head;
/// `L` is 4 or 8.
#[inline(always)]
pub(super) unsafe fn store_heads<P: Pairing, const L: usize, const U: usize>(
    cache: &Nvfp4Cache,
    ((first, stride), (scale_first, scale_stride)): ((u64, u64), (u64, u64)),
    (live, i0): ([bool; U], u32),
    (at, tops): ((usize, usize), &[[f32; 2]; U]),
    y: &impl Fn(usize) -> [[f32; L]; 2],
) {
    if (L != 4 && L != 8) || U > 4 {
        trap()
    }
    let block_lanes = NVFP4_BLOCK / L as u32;
    let leader = thread_idx_x() % block_lanes == 0;
    let dest = Fp8Dest {
        e5m2: false,
        scale: cache.global.0,
        step: cache.global.1,
        multiplier: 0.0,
    };
    // SAFETY: one global scale, or one per live head (the caller's promise).
    let mul = unsafe { fp8_multipliers::<U, false>(&dest, i0, live) };
    let (first_at, second_at) = vector_offsets::<P>(at.0, at.1);
    // The scales' codes, `e4m3(top * m / 6)`, two a conversion: a head's two vectors (NeoX),
    // or two heads' one.
    let scaled = |u: usize, v: usize| tops[u][v] * (mul[u] * (1.0 / 6.0));
    let mut codes = [[0u8; 2]; U];
    let mut u = 0;
    while u < U {
        if P::NEOX {
            codes[u] = e4m3_pair(scaled(u, 0), scaled(u, 1));
            u += 1;
        } else {
            let next = if u + 1 < U { scaled(u + 1, 0) } else { 0.0 };
            let pair = e4m3_pair(scaled(u, 0), next);
            codes[u][0] = pair[0];
            if u + 1 < U {
                codes[u + 1][0] = pair[1];
            }
            u += 2;
        }
    }
    let block = u64::from(NVFP4_BLOCK);
    each_head!(U, u => { if live[u] {
        let x = y(u);
        let head = first + u as u64 * stride;
        let scales = scale_first + u as u64 * scale_stride;
        let (e0, e1) = (first_at as u64, second_at as u64);
        // SAFETY: the head's vectors and block scales lie in the cache (the caller's promise).
        unsafe {
            let first = (head + e0, scales + e0 / block);
            store_vector::<L>(cache, first, &x[0], (codes[u][0], mul[u], leader));
            if P::NEOX {
                let second = (head + e1, scales + e1 / block);
                store_vector::<L>(cache, second, &x[1], (codes[u][1], mul[u], leader));
            }
        }
    } });
}
