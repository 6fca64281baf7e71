//! The normalisation across heads with the rotation, for diffusion transformers (WAN-style
//! video models, whose q and k are RMS-normalised over all of a token's heads at once before a
//! 3-D axial rotation).
//!
//! # Formula
//! For each token and each of q and k, with `x` the token's `H` heads of `d = head_dim`
//! features (`n = H d` values, the whole head rotated): `r = 1 / sqrt(sum x^2 / n + eps)` and
//! `z_{h,e} = x_{h,e} r w'_{h d + e}` (`w` q's or k's `H d` weights, `w' = w`, or `1 + w` for
//! [`NormCode::RmsOnePlus`]; `z = x` for [`NormCode::None`]); then `y = R z` for each head, at
//! the token's position (every position kind of [`crate::rope`], multi-axis included: the 3-D
//! axial positions of video models). All in `f32` (`r` as the fused kernels find it,
//! `super::norm_factor`, `1 / n` to about one ulp); each output rounded once, to the tensors'
//! type or to FP8 of `y m` (E4M3 or E5M2, `m = 1 / scale` from a scale array or a multiplier
//! by value, as the fused kernels' FP8 stores).
//!
//! # Layout
//! q and k are `[batch, seq, heads, head_dim]` at the RoPE parameters' strides (`x0`/`x1` in,
//! `out0`/`out1` out, equal in place; views of one packed QKV buffer work); an FP8 output is
//! addressed in bytes.
//!
//! # Thread mapping
//! A token's threads form a sequence of warps, q's then k's: a tensor's warps hold `32 /
//! groups` slots of `groups` lanes (a power of two of at most 32; the first `rot_groups = half /
//! pairs` hold a head's pairs), or for 64 or 128 groups segments of `groups / 32` whole warps,
//! each slot or segment taking `U` consecutive heads ([`token_warps_heads_per_thread`]), as the
//! backward's (`super::grad`). Block `(t, 0)` of a
//! grid of one row holds token `t`'s whole sequence; of a grid of two rows (a sequence longer
//! than a block), block `(t, 0)` holds q's warps and `(t, 1)` k's. Each thread loads its heads
//! (and their weights), asks L2 for its share of the heads `prefetch_tokens` tokens on, sums its
//! squares, and a butterfly over the warp leaves the warp's sum with every lane; lane 0 writes
//! it to the shared buffer, where the block's first `half` threads also write the token's
//! cos/sin, one pair each. After one barrier every thread adds its tensor's warp sums in warp
//! order (so every thread of the tensor finds the same factor), normalises, rotates and
//! stores. Warps past the block's heads and past the `half` cos/sin threads leave at once.

use super::{
    Fp8Dest, norm_factor, prefetch_ahead, read_cos_sin, reciprocal, rotate_fma, segment_sums,
    share_cos_sin, store_heads, sum_squares,
};
use crate::abi::PositionCode;
use crate::abi::{NORM_ACROSS_MAX_THREADS, NormCode, token_warps_heads_per_thread};
use crate::elem::{Bf16, Elem, Half, unrolled};
use crate::intrinsics::{
    SHARED_F32, block_dim_x, block_idx_x, block_idx_y, grid_dim_y, shared_load_f32s,
    shared_store_f32, sync_threads_count, sync_warp, thread_idx_x, trap, wait_for_prior_grids,
};
use crate::rope::{
    Args, Interleaved, Neox, Pairing, Params, Source, Table, Theta, cos_sin, load_head, offset_u32,
    pair_axis_position, rotate_values_with, widen,
};

/// The across-heads kernel's arguments: the RoPE arguments (q and k in and out, positions,
/// sin/cos) and the rest.
struct Across<T> {
    rope: Args<T>,
    norm: u32,
    q_norm_weight: *const T,
    k_norm_weight: *const T,
    norm_eps: f32,
    prefetch_tokens: u32,
    /// q's and k's output format, scale array (null: the multiplier), step and multiplier.
    q_dest: (u32, (*const f32, u32), f32),
    k_dest: (u32, (*const f32, u32), f32),
}

/// The body for accesses of `L` elements, `U` heads per thread.
///
/// # Safety
/// The promises of the entry points.
#[inline(always)]
unsafe fn body<T: Elem, P: Pairing, S: Source, const L: usize, const U: usize>(g: &Across<T>) {
    let a = &g.rope;
    let pairs = if P::NEOX { L } else { L / 2 };
    let groups = a.groups.divisor.get();
    let threads = block_dim_x();
    let half = a.half;
    // The shared buffer: the token's cos (from 0) and sin (from `half`), then one sum per warp
    // (from `2 half`).
    let sums = 2 * half;
    // A head's threads: a segment of `groups` lanes of a warp, or of `groups / 32` whole warps
    // (64 or 128 groups, every one holding pairs).
    let long = groups > 32;
    if (long && ((groups != 64 && groups != 128) || a.rot_groups != groups))
        || !groups.is_power_of_two()
        || threads % 32 != 0
        || threads < half
        || threads > NORM_ACROSS_MAX_THREADS
        || (sums + threads / 32) as usize > SHARED_F32
    {
        trap()
    }
    let Some(norm) = NormCode::from_u32(g.norm) else {
        trap()
    };
    let token = block_idx_x();
    // Uniform in the block: the grid holds `tokens` block columns.
    if u64::from(token) >= a.tokens {
        return;
    }
    // The token's sequence of warps: q's, then k's. One grid row: a block holds it all; two:
    // block row 0 holds q's warps, row 1 k's.
    // `heads_per_chunk`: the heads of a warp, or of a segment of `segment` warps.
    let (per_warp, segment) = (a.heads_per_chunk.max(1), (groups / 32).max(1));
    let (q_warps, k_warps) = (
        a.q.heads.div_ceil(per_warp) * segment,
        a.k.heads.div_ceil(per_warp) * segment,
    );
    let (first, last) = match (grid_dim_y(), block_idx_y()) {
        (1, _) => (0, q_warps + k_warps),
        (_, 0) => (0, q_warps),
        _ => (q_warps, q_warps + k_warps),
    };
    let tid = thread_idx_x();
    let (lane, warp) = (tid % 32, tid / 32);
    // The warps that stay: those of the block's heads, and those of the `half` cos/sin
    // threads.
    let meeting = ((last - first) * 32)
        .max(half.next_multiple_of(32))
        .min(threads);
    if tid >= meeting {
        return;
    }
    let at = first + warp;
    let working = at < last;
    let is_q = at < q_warps;
    let (tensor, weight, dest, warp_in_tensor) = if is_q {
        (a.q, g.q_norm_weight, g.q_dest, at)
    } else {
        (a.k, g.k_norm_weight, g.k_dest, at - q_warps)
    };
    // The block's warps of this thread's tensor (their sums are its sum of squares).
    let (own_first, own_last) = if is_q {
        (0, q_warps.min(last) - first)
    } else {
        (q_warps.max(first) - first, last - first)
    };
    let shift = groups.trailing_zeros();
    // This thread's heads: `U` consecutive heads from `i0`, its pairs from group `group` (the
    // `32 / groups` slots of a warp, or the segments of warps, in order).
    let at_lane = warp_in_tensor * 32 + lane;
    let (i0, group) = ((at_lane >> shift) * U as u32, at_lane & (groups - 1));
    let pairs_here = working && group < a.rot_groups;
    let mut live = [false; U];
    unrolled(U, |u| {
        live[u] = pairs_here && i0 + (u as u32) < tensor.heads
    });
    let (j0, half_z) = (group as usize * pairs, half as usize);
    let (b, s) = a.seq.div_rem_u32(token);
    let (first, step) = (
        offset_u32(tensor.x_strides, (b, s), i0),
        tensor.x_strides[2] as u32,
    );
    let normed = norm != NormCode::None;
    // Every global access comes after this: the set-up above overlaps the previous grid in a
    // programmatic dependent launch (sm_90 builds; nothing before sm_90).
    wait_for_prior_grids();
    let mut raw = [[[T::ZERO; L]; 2]; U];
    unrolled(U, |u| {
        if live[u] {
            // SAFETY: head i0 + u of the tensor exists at token (b, s) (offsets below 2^32),
            // j0 is this thread's first pair (the entry points' promises).
            raw[u] = unsafe {
                load_head::<T, P, L>(tensor.x.add((first + u as u32 * step) as usize), j0, half_z)
            };
        }
    });
    if pairs_here {
        prefetch_ahead::<T, U, false>(
            (a, g.prefetch_tokens),
            (tensor.x, tensor.x_strides),
            token,
            (i0, tensor.heads),
            group,
            (half, 2 * half),
        );
    }
    // SAFETY: 2 half values from 0 fit the buffer (checked above); (b, s) is a token; the
    // position, table and frequency promises.
    unsafe {
        if a.position_code >= PositionCode::MultiAxisI32 as u32 {
            // Each pair's position with the token's positions on every axis loaded together
            // (`pair_axis_position`): this kernel has the registers for them.
            if tid < half {
                let pos = pair_axis_position(a, u64::from(token), tid as usize);
                // Read as one position: the same arguments with a one-position code.
                let one = Args {
                    position_code: PositionCode::Offset as u32,
                    ..*a
                };
                let (c, sn) = cos_sin::<T, S, 1>(&one, pos, tid as usize, 1);
                shared_store_f32(tid, c[0]);
                shared_store_f32(half + tid, sn[0]);
            }
        } else {
            share_cos_sin::<T, S>(a, (b, s), pairs, 0)
        }
    };
    if normed {
        // Widened here for the sum and again after the barrier: held across it in `f32`, the
        // heads took twice the registers of their loaded form.
        let mut squares = 0.0f32;
        unrolled(U, |u| squares += sum_squares::<P, L>(&widen(raw[u])));
        // The warp is whole here (its threads leave together, above).
        sync_warp();
        let [total] = segment_sums([squares], 32);
        if lane == 0 {
            // SAFETY: sums + warp < sums + threads / 32 <= SHARED_F32.
            unsafe { shared_store_f32(sums + warp, total) };
        }
    }
    sync_threads_count(meeting);
    let mut v = [[[0.0f32; L]; 2]; U];
    unrolled(U, |u| v[u] = widen(raw[u]));
    if normed {
        // Every thread adds the same sums in the same order.
        let mut total = 0.0f32;
        let mut w = own_first;
        while w < own_last {
            // SAFETY: as the store above; written before the barrier.
            total += unsafe { shared_load_f32s::<1>(sums + w) }[0];
            w += 1;
        }
        let inv_n = reciprocal((tensor.heads * 2 * half) as f32);
        let r = norm_factor(total, inv_n, g.norm_eps);
        let one = if norm == NormCode::RmsOnePlus {
            1.0
        } else {
            0.0
        };
        // The weights are loaded here, after the barrier: every token reads the same ones
        // (from L1), and held across it they took registers the heads need.
        unrolled(U, |u| {
            let mut raw_w = [[T::ZERO; L]; 2];
            if live[u] {
                // SAFETY: head i0 + u's weights are the `head_dim` from `(i0 + u) * 2 half` of
                // the tensor's `heads * head_dim` (the entry points' promises); j0 is this
                // thread's first pair.
                raw_w = unsafe {
                    let h = i0 + u as u32;
                    load_head::<T, P, L>(weight.add((h * 2 * half) as usize), j0, half_z)
                };
            }
            let w = widen(raw_w);
            unrolled(L, |k| {
                v[u][0][k] = v[u][0][k] * r * (w[0][k] + one);
                v[u][1][k] = v[u][1][k] * r * (w[1][k] + one);
            });
        });
    }
    if !live[0] {
        return;
    }
    // SAFETY: j0 + pairs <= half, j0 and half multiples of pairs; written before the barrier.
    let (cos, sin) = unsafe { read_cos_sin::<L>((0, half), (j0, pairs)) };
    let y = |u: usize| rotate_values_with::<P, L>(|p, k| v[u][p][k], &cos, &sin, rotate_fma);
    let (format, scales, multiplier) = dest;
    let out_first = offset_u32(tensor.out_strides, (b, s), i0);
    let heads = (
        u64::from(out_first),
        u64::from(tensor.out_strides[2] as u32),
    );
    // SAFETY: head i0 + u of the output exists when `live[u]`, at strides in elements of its
    // format, aligned to `lanes`; an FP8 output's scales hold one `f32` or one per head (the
    // entry points' promises).
    unsafe {
        store_heads::<T, P, L, U, true>(
            tensor.out.cast(),
            heads,
            (live, i0),
            Fp8Dest::of::<true>(format, scales, multiplier),
            (j0, half_z),
            &y,
        )
    };
}

/// Selects the body for the launch's access width.
///
/// # Safety
/// The promises of the entry points.
#[inline(always)]
unsafe fn dispatch<T: Elem, P: Pairing, S: Source>(g: &Across<T>) {
    // SAFETY: forwarded promises; `lanes` selects a body whose access width the host checked.
    unsafe {
        match (T::SIZE, g.rope.lanes, P::NEOX) {
            (2, 8, false) => body::<T, P, S, 8, { token_warps_heads_per_thread(2) as usize }>(g),
            (2, 4, true) => body::<T, P, S, 4, { token_warps_heads_per_thread(2) as usize }>(g),
            (2, 2, _) => body::<T, P, S, 2, { token_warps_heads_per_thread(2) as usize }>(g),
            (4, 4, _) => body::<T, P, S, 4, { token_warps_heads_per_thread(4) as usize }>(g),
            (4, 2, _) => body::<T, P, S, 2, { token_warps_heads_per_thread(4) as usize }>(g),
            _ => trap(),
        }
    }
}

crate::norm_across_kernel_params!(params_struct {
    /// The parameters of every across-heads entry point
    /// ([`crate::norm_across_kernel_params!`]).
    AcrossParams
});

/// The RoPE parameters among an entry point's parameters `$p` (`read_ahead` and
/// `common_launch` are the one-head RoPE kernels' alone; the rotation is forward).
macro_rules! rope_params_of {
    ({ $p:ident } $($param:ident: $kind:ident,)*) => {
        Params { $($param: $p.$param,)* sin_sign: 1.0, read_ahead: 0, common_launch: 0 }
    };
}

impl<T> Across<T> {
    /// Gathers the entry point's parameters for the generic body.
    #[inline(always)]
    fn new(p: AcrossParams<T>) -> Self {
        Across {
            rope: Args::new(crate::rope_kernel_params!(rope_params_of { p })),
            norm: p.norm,
            q_norm_weight: p.q_norm_weight,
            k_norm_weight: p.k_norm_weight,
            norm_eps: p.norm_eps,
            prefetch_tokens: p.prefetch_tokens,
            q_dest: (
                p.q_format,
                (p.q_scale.cast(), p.q_scale_step),
                p.q_multiplier,
            ),
            k_dest: (
                p.k_format,
                (p.k_scale.cast(), p.k_scale_step),
                p.k_multiplier,
            ),
        }
    }
}

/// Defines one exported entry point per (pairing, source, dtype).
macro_rules! across_kernel {
    ($($name:ident: $pairing:ident, $source:ident, $dt:ident, $t:ty;)*) => {
        $(crate::norm_across_kernel_params!(across_entry { $name: $pairing, $source, $t });)*
    };
}

/// One entry point with the parameter list of [`crate::norm_across_kernel_params!`].
macro_rules! across_entry {
    (
        { $name:ident: $pairing:ident, $source:ident, $t:ty }
        $($param:ident: $kind:ident,)*
    ) => {
        /// One entry point of the normalisation across heads with RoPE; its name says the
        /// pairing, the sin/cos source and the element type. See the module documentation,
        /// and `norm_across_kernel_params!` in `abi.rs` for the parameters.
        ///
        /// # Safety
        /// The promises of the RoPE entry points (`crate::rope`) for q (`x0`, `out0`) and k
        /// (`x1`, `out1`), every tensor spanning fewer than 2^32 elements of its format and
        /// `tokens` below 2^31, with the whole head rotated (`rotary_dim = head_dim`,
        /// `rotary_offset = 0`, `rot_groups = half / pairs` and `groups` the power of two at
        /// or above it, at most 32, `heads_per_chunk = (32 / groups) *
        /// token_warps_heads_per_thread(size of the element)`; or `rot_groups = groups` of 64
        /// or 128 and `heads_per_chunk = token_warps_heads_per_thread(size of the element)`),
        /// and: the norm weights hold
        /// `heads * head_dim` elements of their tensor, aligned to `lanes`, when `norm` is not
        /// 0; an FP8 output (`q_format`, `k_format` not the tensors' type) is addressed in
        /// bytes and its scale array is null or holds one `f32` (step 0) or one per head (step
        /// 1); the grid is `(tokens, 1)` blocks holding the warps of both tensors' heads, or
        /// `(tokens, 2)` holding each tensor's (the second row k's), of whole warps, at least
        /// `half` and at most `NORM_ACROSS_MAX_THREADS` threads, with `2 half` plus one value
        /// per warp within `SHARED_F32`.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            $($param: crate::device_param_type!($kind, $t),)*
        ) {
            let args = Across::new(AcrossParams::<$t> { $($param,)* });
            // SAFETY: the caller's promises, listed above, are those `dispatch` needs.
            unsafe { dispatch::<$t, $pairing, $source<$t>>(&args) }
        }
    };
}

crate::abi::for_each_norm_across_kernel!(across_kernel);
