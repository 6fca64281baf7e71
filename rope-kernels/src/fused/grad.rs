//! The gradient of the fused normalisation and rotation (QK-norm + RoPE backward): for the
//! training steps of Qwen3, OLMo 2 and Gemma 3, whose q and k heads are RMS-normalised per head
//! and then rotated.
//!
//! # Formula
//! The forward step of each q and k head `x` of `d = head_dim` features (the whole head
//! rotated) is `r = 1 / sqrt(sum_e x_e^2 / d + eps)`, `n = x r`, `z = n * w'` (`w' = w`, or
//! `1 + w` for [`NormCode::RmsOnePlus`]), `y = R z` (the rotation of [`crate::rope`] at the
//! token's position). Given the gradient `gy` of `y`, each head's gradient of `x` is
//! - `gz = R^T gy` (the rotation with `sin` times `sin_sign`, `-1` for a forward `R`),
//! - `gx_e = r (gz_e w'_e - n_e c)` with `c = r (sum_e gz_e w'_e x_e) / d`,
//!
//! and the weights' gradient `gw_e = sum over tokens and heads of gz_e n_e` (q's heads for q's
//! weights, k's for k's). Everything is computed in `f32`, `r` as the forward kernels find it
//! (`super::norm_factor`), and each output is rounded once.
//!
//! # Layout
//! `gy` is read from `x0`/`x1` and `gx` written to `out0`/`out1` (equal: in place) at the RoPE
//! parameters' strides; the forward inputs `x` of q and k at their own strides (`q_in`, `k_in`).
//! `partials` receives `f32` rows of `d` features, two per block: block `(bx, by)` of a grid
//! of `G = gridDim.x * gridDim.y` blocks writes row `by * gridDim.x + bx` (the sum over its q
//! heads and tokens of `gz_e n_e`) and row `G + by * gridDim.x + bx` (its k heads'). The weights
//! kernel ([`weights_body`]) sums them.
//!
//! # Thread mapping
//! Each token's threads form a sequence of warps, q's `q_warps` then k's. A warp holds `32 /
//! groups` slots of `groups` lanes (a power of two of at most 32; the first `rot_groups = half /
//! pairs` hold a head's pairs, the rest only join its sums, which are butterfly shuffles over
//! the slot), and each slot takes `U` ([`token_warps_heads_per_thread`]) consecutive heads.
//! Heads of 64 or 128 groups (heads of 512; `f32` interleaved heads of 256) take segments of
//! `groups / 32` whole warps instead, fewer heads each
//! ([`NORM_GRAD_SEGMENT_HEADS_PER_THREAD`]; [`segment_totals`]: each warp's sums meet
//! the segment's other warps' in shared memory at a barrier of the block), and each of their
//! threads finds its own pairs' cos/sin, with no shared buffer or barrier for them.
//! Block `(bx, by)` holds warps `bx * blockDim.x / 32 ..` of the sequence and walks tokens `by`,
//! then a grid's worth further each. With tables and with interleaved pairs each thread starts
//! copying a token's heads into its part of a shared staging buffer (`cp.async`, two stages)
//! while it computes the token before; NeoX pairs with sin/cos computed load each token's heads
//! into registers at its step. At each token the block's first `half` threads find its cos/sin,
//! one pair each, into one of two halves of the shared buffer, and after one barrier every
//! thread reads its pairs: one cos/sin computation serves the token's heads in the block. At
//! the end the lanes of a warp holding the same features add their weight sums with shuffles,
//! then the block's warps, one at a time in warp order, into q's and k's rows in the shared
//! buffer: the same launch gives the same gradients every time.

use super::{mul_add, norm_factor, read_cos_sin, rotate_fma, segment_sums, share_cos_sin};
use crate::abi::{
    NORM_GRAD_MAX_THREADS, NORM_GRAD_SEGMENT_HEADS_PER_THREAD, NormCode,
    token_warps_heads_per_thread,
};
use crate::elem::{Bf16, Elem, Half, unrolled};
use crate::intrinsics::stage::{
    STAGE_BYTES, STAGE_THREAD_BYTES, commit, copy_async, load as stage_load, wait_all_but_last,
};
use crate::intrinsics::{
    SHARED_F32, block_dim_x, block_idx_x, block_idx_y, grid_dim_x, grid_dim_y, shared_load_f32s,
    shared_store_f32, shuffle_xor, sync_threads_count, thread_idx_x, trap,
};
use crate::rope::{
    Args, Interleaved, Neox, Pairing, Params, Source, Table, Theta, cos_sin, load_head, offset_u32,
    position, rotate_values_with, vector_offsets, widen,
};

/// The gradient kernel's arguments: the RoPE arguments (`gy` in, `gx` out, positions, sin/cos)
/// and the rest.
struct Grad<T> {
    rope: Args<T>,
    /// The forward inputs of q and k and their `[batch, seq, head]` strides.
    q_in: (*const T, [u64; 3]),
    k_in: (*const T, [u64; 3]),
    norm: u32,
    q_norm_weight: *const T,
    k_norm_weight: *const T,
    norm_eps: f32,
    q_warps: u32,
    partials: *mut f32,
}

/// One head's loaded elements in `f32`, as [`load_head`] lays them out, or zeros for a thread
/// past its block row's heads.
///
/// # Safety
/// With `active`, as [`load_head`].
#[inline(always)]
unsafe fn load_f32<T: Elem, P: Pairing, const L: usize>(
    active: bool,
    head: *const T,
    j0: usize,
    half: usize,
) -> [[f32; L]; 2] {
    if active {
        // SAFETY: the caller's promise.
        widen(unsafe { load_head::<T, P, L>(head, j0, half) })
    } else {
        [[0.0; L]; 2]
    }
}

/// One head's gradient at one token from its loaded forward input `x` and output gradient
/// `gy` (both as [`load_head`] lays them out): stores the input gradient at `out` (unless
/// null) and adds the head's weight terms `gz_e n_e` to `acc`. Every lane of the warp calls it
/// (the norm's sums are warp shuffles over segments of `groups` lanes).
///
/// # Safety
/// A non-null `out` addresses this thread's elements of the head's input gradient.
#[inline(always)]
unsafe fn head_gradient<T: Elem, P: Pairing, const L: usize>(
    (x, gy): ([[f32; L]; 2], [[f32; L]; 2]),
    (cos, sin, w): (&[f32; L], &[f32; L], &[[f32; L]; 2]),
    (groups, inv_dim, eps): (u32, f32, f32),
    (out, j0, half): (*mut T, usize, usize),
    acc: &mut [[f32; L]; 2],
) {
    let (gz, gzw, parts) = head_terms::<P, L>((&x, &gy), (cos, sin, w));
    let sums = segment_sums(parts, groups);
    // SAFETY: the caller's promise.
    unsafe { head_finish::<T, P, L>((&x, gz, gzw), sums, (inv_dim, eps), (out, j0, half), acc) };
}

/// A head's terms at one token, from this thread's elements: `gz = R^T gy`, `gz w'`, and this
/// thread's parts of the norm's two sums, `[sum x_e^2, sum gz_e w'_e x_e]`.
#[inline(always)]
#[allow(clippy::type_complexity)]
fn head_terms<P: Pairing, const L: usize>(
    (x, gy): (&[[f32; L]; 2], &[[f32; L]; 2]),
    (cos, sin, w): (&[f32; L], &[f32; L], &[[f32; L]; 2]),
) -> ([[f32; L]; 2], [[f32; L]; 2], [f32; 2]) {
    // `sin` carries `sin_sign`: the transposed rotation of a forward step.
    let gz = rotate_values_with::<P, L>(|i, k| gy[i][k], cos, sin, rotate_fma);
    let mut gzw = [[0.0f32; L]; 2];
    let (mut squares, mut dot) = (0.0f32, 0.0f32);
    unrolled(L, |k| {
        for i in 0..2 {
            gzw[i][k] = gz[i][k] * w[i][k];
            squares = mul_add(x[i][k], x[i][k], squares);
            dot = mul_add(gzw[i][k], x[i][k], dot);
        }
    });
    (gz, gzw, [squares, dot])
}

/// A head's input gradient from its terms ([`head_terms`]) and the head's two sums over all
/// its elements: stores it at `out` (unless null) and adds the weight terms `gz_e n_e` to
/// `acc`.
///
/// # Safety
/// A non-null `out` addresses this thread's elements of the head's input gradient.
#[inline(always)]
unsafe fn head_finish<T: Elem, P: Pairing, const L: usize>(
    (x, gz, gzw): (&[[f32; L]; 2], [[f32; L]; 2], [[f32; L]; 2]),
    [squares, dot]: [f32; 2],
    (inv_dim, eps): (f32, f32),
    (out, j0, half): (*mut T, usize, usize),
    acc: &mut [[f32; L]; 2],
) {
    let r = norm_factor(squares, inv_dim, eps);
    let c = r * dot * inv_dim;
    let mut gx = [[0.0f32; L]; 2];
    unrolled(L, |k| {
        for i in 0..2 {
            let n = x[i][k] * r;
            gx[i][k] = r * mul_add(-n, c, gzw[i][k]);
            acc[i][k] = mul_add(gz[i][k], n, acc[i][k]);
        }
    });
    if !out.is_null() {
        let (first, second) = vector_offsets::<P>(j0, half);
        // SAFETY: this thread's elements of the head (the caller's promise).
        unsafe {
            T::store_rounded(out.add(first), gx[0]);
            if P::NEOX {
                T::store_rounded(out.add(second), gx[1]);
            }
        }
    }
}

/// The gradient body for accesses of `L` elements, `U` heads per thread; `LONG`: heads of 64
/// or 128 groups, each the `groups / 32` consecutive warps of a segment (see the module
/// documentation).
///
/// # Safety
/// The promises of the entry points.
#[inline(always)]
unsafe fn body<T: Elem, P: Pairing, S: Source, const L: usize, const U: usize, const LONG: bool>(
    g: &Grad<T>,
) {
    // The heads are staged through shared memory a token ahead (see the loop) with tables and
    // interleaved pairs; NeoX pairs with sin/cos computed load each token's heads where they
    // are used (docs/perf/decisions.md, the backward's entry).
    let staged = S::TABLE || !P::NEOX;
    let a = &g.rope;
    let pairs = if P::NEOX { L } else { L / 2 };
    // Each head's threads: a segment of `groups` lanes (a power of two), of which the first
    // `rot_groups` hold pairs and the rest only join the sums.
    let groups = a.groups.divisor.get();
    let threads = block_dim_x();
    // The block's threads find the token's `half` cos/sin pairs, one each, into one of two
    // halves of the shared buffer. `LONG`: each thread finds its own pairs' (the block may
    // hold fewer threads than pairs), and the shared buffer takes each warp's `2 U` sums of
    // its heads (`rows` values), in one of two halves; the block holds whole segments.
    let rows = 2 * U as u32 * (threads / 32);
    if LONG {
        if (groups != 64 && groups != 128)
            || a.rot_groups != groups
            || threads % groups != 0
            || 4 * a.half as usize > SHARED_F32
            || 2 * rows as usize > SHARED_F32
        {
            trap()
        }
    } else if groups > 32
        || !groups.is_power_of_two()
        || threads % 32 != 0
        || threads < a.half
        || 4 * a.half as usize > SHARED_F32
    {
        trap()
    }
    let shift = groups.trailing_zeros();
    let tid = thread_idx_x();
    let lane = tid % 32;
    let warp = block_idx_x() * (threads / 32) + tid / 32;
    let is_q = warp < g.q_warps;
    let (tensor, (input, in_strides), weight, warp_in_tensor) = if is_q {
        (a.q, g.q_in, g.q_norm_weight, warp)
    } else {
        (a.k, g.k_in, g.k_norm_weight, warp - g.q_warps)
    };
    // This thread's heads: `U` consecutive heads from `i0`; its pairs from group `group`.
    let (i0, group) = if LONG {
        let at = warp_in_tensor * 32 + lane;
        ((at >> shift) * U as u32, at & (groups - 1))
    } else {
        let (slot, group) = (lane >> shift, lane & (groups - 1));
        (warp_in_tensor * a.heads_per_chunk + slot * U as u32, group)
    };
    let pairs_here = group < a.rot_groups;
    let mut live = [false; U];
    unrolled(U, |u| {
        live[u] = pairs_here && i0 + (u as u32) < tensor.heads
    });
    let (j0, half) = (group as usize * pairs, a.half as usize);
    // SAFETY: the weights hold `head_dim` elements; j0 is this thread's first pair.
    let mut w = unsafe { load_f32::<T, P, L>(pairs_here, weight, j0, half) };
    if g.norm == NormCode::RmsOnePlus as u32 {
        unrolled(L, |k| {
            w[0][k] += 1.0;
            w[1][k] += 1.0;
        });
    }
    let consts = (groups, 1.0 / a.rotary_dim as f32, g.norm_eps);
    let mut acc = [[0.0f32; L]; 2];
    // Block row `by` takes tokens `by`, then a grid's worth further each. Tokens and element
    // offsets fit in 32 bits (every tensor spans fewer than 2^32 elements).
    let tokens = a.tokens as u32;
    let step = grid_dim_y();
    let t = block_idx_y();
    // The shared half this token's cos/sin take: a thread writing the next token's has passed
    // the barrier after which every thread has read this one's.
    let mut base = 0;
    // Staged, each token's heads reach the staging buffer by `cp.async` a token ahead: in flight
    // while the previous token's gradients are computed, in no register. A thread's vectors of one
    // stage (`U` heads, the forward input then the output gradient, the NeoX pair's two
    // vectors) lie `NORM_GRAD_MAX_THREADS` vectors apart, so that a warp's lanes read
    // consecutive vectors.
    let (bytes, vectors) = ((L * T::SIZE) as u32, if P::NEOX { 2 } else { 1 });
    let stage_at = |stage: u32, (u, i, v): (usize, usize, usize)| {
        let chunk = ((u * 2 + i) * vectors + v) as u32;
        stage * STAGE_BYTES + (chunk * NORM_GRAD_MAX_THREADS + tid) * bytes
    };
    if threads > NORM_GRAD_MAX_THREADS || U as u32 * 2 * vectors as u32 * bytes > STAGE_THREAD_BYTES
    {
        trap()
    }
    let (first_v, second_v) = vector_offsets::<P>(j0, half);
    let issue = |t: u32, stage: u32| {
        if staged && t < tokens {
            let (b, s) = a.seq.div_rem_u32(t);
            let (in_first, in_step) = (offset_u32(in_strides, (b, s), i0), in_strides[2] as u32);
            let strides = tensor.x_strides;
            let (gy_first, gy_step) = (offset_u32(strides, (b, s), i0), strides[2] as u32);
            unrolled(U, |u| {
                let u32_ = u as u32;
                let heads = [
                    input.wrapping_add((in_first + u32_ * in_step) as usize),
                    tensor.x.wrapping_add((gy_first + u32_ * gy_step) as usize),
                ];
                unrolled(2, |i| {
                    unrolled(vectors, |v| {
                        let e = if v == 0 { first_v } else { second_v };
                        let src = heads[i].wrapping_add(e).cast::<u8>();
                        let at = stage_at(stage, (u, i, v));
                        // SAFETY: for a live head, (b, s) is a token and `i0 + u` a head of
                        // the tensor (offsets below 2^32), `e` this thread's vector in it,
                        // aligned to its `bytes` (the entry points' promises); a dead head's
                        // copy reads nothing and writes zeros. The stage holds every thread's
                        // vectors (checked above).
                        unsafe {
                            match bytes {
                                16 => copy_async::<16>(at, src, live[u]),
                                8 => copy_async::<8>(at, src, live[u]),
                                _ => copy_async::<4>(at, src, live[u]),
                            }
                        }
                    });
                });
            });
        }
        if staged {
            commit();
        }
    };
    // Each step starts the copy of token `ahead` into `stage` and computes token `now` (none at
    // the first step) from the other stage; one call site, so the copies' code is inlined once.
    let (mut now, mut ahead, mut stage) = (tokens, t, 0);
    loop {
        issue(ahead, stage);
        if now >= tokens {
            if ahead >= tokens {
                break;
            }
            now = ahead;
            ahead = ahead.wrapping_add(step);
            ahead = if ahead < step { tokens } else { ahead };
            stage ^= 1;
            continue;
        }
        let (b, s) = a.seq.div_rem_u32(now);
        let computed = stage ^ 1;
        if staged {
            wait_all_but_last();
        }
        let mut loaded = [[[[T::ZERO; L]; 2]; 2]; U];
        if staged {
            unrolled(U, |u| {
                unrolled(2, |i| {
                    unrolled(vectors, |v| {
                        let at = stage_at(computed, (u, i, v));
                        // SAFETY: this thread's copy of this stage, complete (waited for
                        // above); `bytes` is `L` elements of `T`.
                        loaded[u][i][v] = unsafe {
                            match bytes {
                                16 => core::mem::transmute_copy(&stage_load::<4>(at)),
                                8 => core::mem::transmute_copy(&stage_load::<2>(at)),
                                _ => core::mem::transmute_copy(&stage_load::<1>(at)),
                            }
                        };
                    });
                });
            });
        } else {
            let first = |strides: [u64; 3]| (offset_u32(strides, (b, s), i0), strides[2] as u32);
            let (in_first, in_step) = first(in_strides);
            let (gy_first, gy_step) = first(tensor.x_strides);
            unrolled(U, |u| {
                if live[u] {
                    let u32_ = u as u32;
                    let (at_in, at_gy) = (in_first + u32_ * in_step, gy_first + u32_ * gy_step);
                    // SAFETY: (b, s) is a token and `i0 + u` a head of the tensor (offsets
                    // below 2^32); the entry points' promises for the tensors' addresses.
                    loaded[u] = unsafe {
                        [
                            load_head::<T, P, L>(input.add(at_in as usize), j0, half),
                            load_head::<T, P, L>(tensor.x.add(at_gy as usize), j0, half),
                        ]
                    };
                }
            });
        }
        let (cos, sin) = if LONG {
            if pairs_here {
                // SAFETY: (b, s) is a token, `group` this thread's group, pairs `j0..j0 +
                // pairs` of the rotation; the position, table and frequency promises.
                unsafe {
                    let pos = position(a, u64::from(b), u64::from(s), group);
                    cos_sin::<T, S, L>(a, pos, j0, pairs)
                }
            } else {
                ([0.0; L], [0.0; L])
            }
        } else {
            // SAFETY: base + 2 half <= 4 half <= SHARED_F32; (b, s) is a token; the position,
            // table and frequency promises.
            unsafe { share_cos_sin::<T, S>(a, (b, s), pairs, base) };
            sync_threads_count(threads);
            if pairs_here {
                // SAFETY: j0 + pairs <= half, j0, half and base multiples of pairs; written
                // before the barrier above.
                unsafe { read_cos_sin::<L>((base, a.half), (j0, pairs)) }
            } else {
                ([0.0; L], [0.0; L])
            }
        };
        let strides = tensor.out_strides;
        let (out_first, out_step) = (offset_u32(strides, (b, s), i0), strides[2] as u32);
        let out_of = |u: usize| {
            if live[u] {
                // SAFETY: the head's output, as its input above.
                unsafe { tensor.out.add((out_first + u as u32 * out_step) as usize) }
            } else {
                core::ptr::null_mut()
            }
        };
        if LONG {
            // SAFETY: every thread of the block is here (it walks the block's tokens); the
            // buffer holds two halves of the block's warps' sums (checked above), and a
            // thread writing this half again has passed the barrier of the token between,
            // which every thread reaches after reading this token's sums.
            let sums = unsafe {
                segment_totals::<T, P, L, U>(&loaded, (&cos, &sin, &w), (base, groups / 32))
            };
            unrolled(U, |u| {
                let x = widen(loaded[u][0]);
                let (gz, gzw, _) = head_terms::<P, L>((&x, &widen(loaded[u][1])), (&cos, &sin, &w));
                let finish = (consts.1, consts.2);
                // SAFETY: `out` is null or this thread's head of the output.
                unsafe {
                    head_finish::<T, P, L>(
                        (&x, gz, gzw),
                        sums[u],
                        finish,
                        (out_of(u), j0, half),
                        &mut acc,
                    )
                };
            });
        } else {
            unrolled(U, |u| {
                let io = (widen(loaded[u][0]), widen(loaded[u][1]));
                // SAFETY: `out` is null or this thread's head of the output.
                unsafe {
                    head_gradient::<T, P, L>(
                        io,
                        (&cos, &sin, &w),
                        consts,
                        (out_of(u), j0, half),
                        &mut acc,
                    )
                };
            });
        }
        base ^= if LONG { rows } else { 2 * a.half };
        if ahead >= tokens {
            break;
        }
        now = ahead;
        ahead = ahead.wrapping_add(step);
        ahead = if ahead < step { tokens } else { ahead };
        stage ^= 1;
    }
    // SAFETY: the entry points' promises for `partials` and the block's shape.
    unsafe { store_partials::<P, L>(g, acc, (groups, j0), is_q) };
}

/// Each of this thread's `U` heads' two norm sums ([`head_terms`]) over the whole head, a
/// segment of `groups / 32` consecutive warps: each warp's butterfly sums, written by its lane
/// 0 from element `exchange` of the shared buffer (`2 U` values a warp: the heads' sums of
/// squares, then their dot products), then, after a barrier of the block, the segment's
/// warps' values added in warp order, so that every thread of a head finds the same sums.
///
/// # Safety
/// Every thread of the block calls it; the block holds whole segments of `segment` warps
/// (2 or 4); `exchange + 2 U` values per warp of the block fit the buffer, `exchange` a
/// multiple of `U`; no thread still reads the values from `exchange` of an earlier call.
#[inline(always)]
unsafe fn segment_totals<T: Elem, P: Pairing, const L: usize, const U: usize>(
    loaded: &[[[[T; L]; 2]; 2]; U],
    cos_sin_w: (&[f32; L], &[f32; L], &[[f32; L]; 2]),
    (exchange, segment): (u32, u32),
) -> [[f32; 2]; U] {
    let (mut squares, mut dots) = ([0.0f32; U], [0.0f32; U]);
    unrolled(U, |u| {
        let (x, gy) = (widen(loaded[u][0]), widen(loaded[u][1]));
        let (_, _, [sq, dot]) = head_terms::<P, L>((&x, &gy), cos_sin_w);
        (squares[u], dots[u]) = (sq, dot);
    });
    let (squares, dots) = (segment_sums(squares, 32), segment_sums(dots, 32));
    let (tid, threads) = (thread_idx_x(), block_dim_x());
    let warp = tid / 32;
    let row = |w: u32| exchange + w * 2 * U as u32;
    if tid % 32 == 0 {
        unrolled(U, |u| {
            // SAFETY: the warp's row lies in the buffer (the caller's promise).
            unsafe {
                shared_store_f32(row(warp) + u as u32, squares[u]);
                shared_store_f32(row(warp) + (U + u) as u32, dots[u]);
            }
        });
    }
    sync_threads_count(threads);
    // The segment's warps: `segment` from the first of a multiple of `segment`.
    let first = warp - warp % segment;
    let mut sums = [[0.0f32; 2]; U];
    let mut w = first;
    while w < first + segment {
        // SAFETY: the rows of the block's warps lie in the buffer, each part of `U` values
        // from a multiple of `U` (the caller's promise); written before the barrier above.
        let (sq, dot) = unsafe {
            (
                shared_load_f32s::<U>(row(w)),
                shared_load_f32s::<U>(row(w) + U as u32),
            )
        };
        unrolled(U, |u| {
            sums[u][0] += sq[u];
            sums[u][1] += dot[u];
        });
        w += 1;
    }
    sums
}

/// Adds each thread's weight sums over the lanes of its warp holding the same features
/// (butterfly shuffles across the heads of the warp), then the block's warps' sums, one warp
/// at a time in warp order, into q's and k's rows of the shared buffer, and writes them to the
/// block's two `partials` rows.
///
/// # Safety
/// `partials` holds the grid's rows of `head_dim` `f32`; the block holds whole warps, every
/// thread of the block calls it, and `2 * head_dim <= SHARED_F32`.
#[inline(always)]
unsafe fn store_partials<P: Pairing, const L: usize>(
    g: &Grad<impl Sized>,
    mut acc: [[f32; L]; 2],
    (groups, j0): (u32, usize),
    is_q: bool,
) {
    let a = &g.rope;
    let mut step = groups;
    while step < 32 {
        unrolled(L, |k| {
            acc[0][k] += shuffle_xor(acc[0][k], step, u32::MAX);
            acc[1][k] += shuffle_xor(acc[1][k], step, u32::MAX);
        });
        step <<= 1;
    }
    let d = a.rotary_dim;
    let (threads, tid) = (block_dim_x(), thread_idx_x());
    // Every thread has read its last cos/sin: the buffer takes the rows.
    sync_threads_count(threads);
    let mut e = tid;
    while e < 2 * d {
        // SAFETY: e < 2 d <= SHARED_F32.
        unsafe { shared_store_f32(e, 0.0) };
        e += threads;
    }
    // The first `rot_groups` lanes of each warp hold its sums: warp `w` adds them to its
    // tensor's row in turn.
    let (first, second) = vector_offsets::<P>(j0, a.half as usize);
    let row = if is_q { 0 } else { d };
    let mut w = 0;
    while w < threads / 32 {
        sync_threads_count(threads);
        if tid / 32 == w && tid % 32 < a.rot_groups {
            unrolled(L, |k| {
                // SAFETY: row + feature < 2 d <= SHARED_F32.
                unsafe {
                    let at = row + (first + k) as u32;
                    shared_store_f32(at, shared_load_f32s::<1>(at)[0] + acc[0][k]);
                    if P::NEOX {
                        let at = row + (second + k) as u32;
                        shared_store_f32(at, shared_load_f32s::<1>(at)[0] + acc[1][k]);
                    }
                }
            });
        }
        w += 1;
    }
    sync_threads_count(threads);
    // Block (bx, by): q's row `by * gridDim.x + bx`, k's the grid's blocks further.
    let blocks = grid_dim_x() * grid_dim_y();
    let block = block_idx_y() * grid_dim_x() + block_idx_x();
    let mut e = tid;
    while e < 2 * d {
        let r = if e < d { block } else { blocks + block };
        // SAFETY: the block's rows of `d` values (the caller's promise); e < 2 d <= SHARED_F32.
        unsafe { *g.partials.add((r * d + e % d) as usize) = shared_load_f32s::<1>(e)[0] };
        e += threads;
    }
}

/// Selects the body for the launch's access width.
///
/// # Safety
/// The promises of the entry points.
#[inline(always)]
unsafe fn dispatch<T: Elem, P: Pairing, S: Source>(g: &Grad<T>) {
    // SAFETY: forwarded promises; `lanes` selects a body whose access width the host checked.
    unsafe {
        const U2: usize = token_warps_heads_per_thread(2) as usize;
        const U4: usize = token_warps_heads_per_thread(4) as usize;
        const U1: usize = NORM_GRAD_SEGMENT_HEADS_PER_THREAD as usize;
        // Segments of more than a warp at the widest accesses alone (the host's rule).
        let long = g.rope.groups.divisor.get() > 32;
        match (T::SIZE, g.rope.lanes, P::NEOX, long) {
            (2, 8, false, false) => body::<T, P, S, 8, U2, false>(g),
            (2, 8, false, true) => body::<T, P, S, 8, U1, true>(g),
            (2, 4, true, false) => body::<T, P, S, 4, U2, false>(g),
            (2, 4, true, true) => body::<T, P, S, 4, U1, true>(g),
            (2, 2, _, false) => body::<T, P, S, 2, U2, false>(g),
            (4, 4, _, false) => body::<T, P, S, 4, U4, false>(g),
            (4, 4, _, true) => body::<T, P, S, 4, U1, true>(g),
            (4, 2, _, false) => body::<T, P, S, 2, U4, false>(g),
            _ => trap(),
        }
    }
}

crate::norm_grad_kernel_params!(params_struct {
    /// The parameters of every gradient entry point ([`crate::norm_grad_kernel_params!`]).
    GradParams
});

/// The RoPE parameters among a gradient entry point's parameters `$p` (`read_ahead` and
/// `common_launch` are the one-head RoPE kernels' alone).
macro_rules! rope_params_of {
    ({ $p:ident } $($param:ident: $kind:ident,)*) => {
        Params { $($param: $p.$param,)* sin_sign: $p.sin_sign, read_ahead: 0, common_launch: 0 }
    };
}

impl<T> Grad<T> {
    /// Gathers the entry point's parameters for the generic body.
    #[inline(always)]
    fn new(p: GradParams<T>) -> Self {
        Grad {
            rope: Args::new(crate::rope_kernel_params!(rope_params_of { p })),
            q_in: (
                p.q_in,
                [p.q_in_stride_batch, p.q_in_stride_seq, p.q_in_stride_head],
            ),
            k_in: (
                p.k_in,
                [p.k_in_stride_batch, p.k_in_stride_seq, p.k_in_stride_head],
            ),
            norm: p.norm,
            q_norm_weight: p.q_norm_weight,
            k_norm_weight: p.k_norm_weight,
            norm_eps: p.norm_eps,
            q_warps: p.q_warps,
            partials: p.partials.cast(),
        }
    }
}

/// Defines one exported gradient entry point per (pairing, source, dtype), then one weights
/// entry point per dtype.
macro_rules! grad_kernel {
    (
        $($name:ident: $pairing:ident, $source:ident, $dt:ident, $t:ty;)*
        @weights $($weights:ident: $wdt:ident, $wt:ty;)*
    ) => {
        $(crate::norm_grad_kernel_params!(grad_entry { $name: $pairing, $source, $t });)*
        $(crate::norm_grad_weights_kernel_params!(weights_entry { $weights: $wt });)*
    };
}

/// One gradient entry point with the parameter list of [`crate::norm_grad_kernel_params!`].
macro_rules! grad_entry {
    (
        { $name:ident: $pairing:ident, $source:ident, $t:ty }
        $($param:ident: $kind:ident,)*
    ) => {
        /// One gradient entry point of the QK-norm + RoPE backward; its name says the pairing,
        /// the sin/cos source and the element type. See the module documentation, and
        /// `norm_grad_kernel_params!` in `abi.rs` for the parameters.
        ///
        /// # Safety
        /// The promises of the RoPE entry points (`crate::rope`) for `gy` (`x0`, `x1`) and `gx`
        /// (`out0`, `out1`), every tensor spanning fewer than 2^32 elements and `tokens` below
        /// 2^32, with the whole head rotated (`rotary_dim = head_dim`,
        /// `rotary_offset = 0`, `rot_groups = half / pairs` and `groups` the power of two at or
        /// above it, at most 32, `heads_per_chunk = (32 / groups) *
        /// token_warps_heads_per_thread(size of the element)`), and:
        /// `q_in` and `k_in` address q's and k's heads at their strides, aligned to `lanes`
        /// elements and overlapping no output; the norm weights hold `head_dim` elements
        /// each; the block holds whole warps, at least `half` and at most
        /// `NORM_GRAD_MAX_THREADS` threads, with `4 half` and `2 head_dim` at most
        /// `SHARED_F32`; block `(bx, by)` takes warps `bx * blockDim.x / 32 ..` of each token's
        /// sequence of q's `q_warps` warps then k's; `partials` holds
        /// `2 * gridDim.x * gridDim.y * head_dim` `f32` overlapping nothing else.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            $($param: crate::device_param_type!($kind, $t),)*
        ) {
            let args = Grad::new(GradParams::<$t> { $($param,)* });
            // SAFETY: the caller's promises, listed above, are those `dispatch` needs.
            unsafe { dispatch::<$t, $pairing, $source<$t>>(&args) }
        }
    };
}

/// The weights kernel's body: `q_grad[e]` (`k_grad[e]`) is the sum of column `e` of q's (k's)
/// `partials` rows, in row order within each of the block's warps, then the warps in order, rounded once to `T`.
///
/// Block `(bx, by)` of [`crate::abi::NORM_GRAD_WEIGHTS_THREADS`] threads takes features `bx *
/// 32 ..` of q's weights (`by = 0`) or k's (`by = 1`); thread `i` sums rows `i / 32, i / 32 +
/// parts, ..` of column `bx * 32 + i % 32` (`parts` the block's warps), four at a time into
/// four sums.
///
/// # Safety
/// The promises of the weights entry points.
#[inline(always)]
unsafe fn weights_body<T: Elem>(p: &WeightsParams<T>) {
    let tid = thread_idx_x();
    let (lane, part) = (tid % 32, tid / 32);
    let parts = block_dim_x() / 32;
    let e = block_idx_x() * 32 + lane;
    let d = p.head_dim;
    let (first, rows, out) = if block_idx_y() == 0 {
        (0, p.q_rows, p.q_grad)
    } else {
        (p.q_rows, p.k_rows, p.k_grad)
    };
    // Four rows in flight per step, each summed into its own accumulator, then the four in
    // order: one row at a time left each thread waiting on each load in turn.
    let mut sums = [0.0f32; 4];
    if e < d {
        let at = |r: u32| ((first + r) * d + e) as usize;
        let mut r = part;
        while r + 3 * parts < rows {
            // SAFETY: rows first + r .. first + r + 3 parts of `partials`, column e < head_dim.
            unsafe {
                let p = p.partials.cast::<f32>();
                unrolled(4, |i| sums[i] += *p.add(at(r + i as u32 * parts)));
            }
            r += 4 * parts;
        }
        while r < rows {
            // SAFETY: as above, one row.
            sums[0] += unsafe { *p.partials.cast::<f32>().add(at(r)) };
            r += parts;
        }
    }
    let sum = (sums[0] + sums[1]) + (sums[2] + sums[3]);
    // SAFETY: tid < blockDim.x <= SHARED_F32.
    unsafe { shared_store_f32(tid, sum) };
    sync_threads_count(block_dim_x());
    if part == 0 && e < d && !out.is_null() {
        let mut total = 0.0f32;
        let mut i = 0;
        while i < parts {
            // SAFETY: i * 32 + lane < blockDim.x <= SHARED_F32.
            total += unsafe { shared_load_f32s::<1>(i * 32 + lane) }[0];
            i += 1;
        }
        // SAFETY: e < head_dim, inside the weights' gradient.
        unsafe { *out.add(e as usize) = T::from_f32(total) };
    }
}

crate::norm_grad_weights_kernel_params!(params_struct {
    /// The parameters of every weights entry point
    /// ([`crate::norm_grad_weights_kernel_params!`]).
    WeightsParams
});

/// One weights entry point with the parameter list of
/// [`crate::norm_grad_weights_kernel_params!`].
macro_rules! weights_entry {
    (
        { $name:ident: $t:ty }
        $($param:ident: $kind:ident,)*
    ) => {
        /// One weights entry point of the QK-norm + RoPE backward: the norm weights' gradients
        /// from the gradient kernel's `partials` (see [`weights_body`]).
        ///
        /// # Safety
        /// `partials` holds `(q_rows + k_rows) * head_dim` `f32`; `q_grad` and `k_grad` hold
        /// `head_dim` elements each (or are null: not written) and overlap nothing read; the
        /// grid is `(ceil(head_dim / 32), 2)` blocks of at most `SHARED_F32` threads, whole
        /// warps.
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(
            $($param: crate::device_param_type!($kind, $t),)*
        ) {
            let p = WeightsParams::<$t> { $($param,)* };
            // SAFETY: the caller's promises, listed above.
            unsafe { weights_body(&p) }
        }
    };
}

crate::abi::for_each_norm_grad_kernel!(grad_kernel);
