//! The RoPE kernel family: forward and backward rotation, interleaved (GPT-J) and rotate-half
//! (GPT-NeoX) pairing, sin/cos from tables or from frequencies, implicit, explicit or packed
//! variable-length positions, partial rotary, and one or two tensors (q and k) per launch.
//!
//! # Formula
//! For pair `i < half` (`half = rotary_dim / 2`) of a head at position `p`, with
//! `c = cos(p * inv_freq_i)`, `s = sin(...)`: forward `(a, b) -> (a c - b s, b c + a s)`;
//! backward (the transposed rotation) `(a, b) -> (a c + b s, b c - a s)`. Interleaved pairs are
//! `(x[2i], x[2i + 1])`; NeoX pairs are `(x[i], x[i + half])`. Elements `rotary_dim..head_dim`
//! pass through unchanged (copied when `out` differs from `x`).
//!
//! # Layout
//! Each tensor holds `[batch, seq, heads, head_dim]` elements at element strides
//! `(stride_batch, stride_seq, stride_head, 1)`; its `out` either equals its `x` (in place) or
//! overlaps no input. Tensor 1 (k) has its own heads and strides and may have no heads.
//!
//! # Thread mapping
//! A block takes a tile of `tile_tokens` consecutive tokens (tiles walked by a grid-stride loop
//! over `blockIdx.x`) and the heads `blockIdx.y * heads_per_chunk ..` of the concatenation of
//! tensor 0's and tensor 1's heads. It first writes the tile's `(cos, sin)` pairs, one per
//! (token, pair), into shared memory (read from the tables, or computed from `inv_freq`
//! once per token and frequency however many heads use them), with each token's base offsets;
//! then a row is one head of one token, and thread `(tx, ty) = (tid % cols, tid / cols)`
//! takes group `tx` (groups `0..rot_groups` rotate `pairs_per_item` pairs, the rest copy
//! `lanes` pass-through elements) of rows `ty, ty + rows_step, ...`, several rows at a time with
//! all loads issued before the stores. Consecutive threads touch consecutive addresses of a
//! head, and every access moves `lanes` elements at once (16 bytes when alignment allows).

use core::num::{NonZeroU32, NonZeroU64};

use crate::abi::{
    Direction, FastDiv, MAX_TILE_TOKENS, PositionCode, RopeStyle, SCRATCH_SINCOS_BYTES,
    for_each_kernel, rows_unroll,
};
use crate::elem::{self, Bf16, Elem};
use crate::intrinsics::{
    block_dim_x, block_idx_x, block_idx_y, grid_dim_x, shared_scratch, sync_threads, thread_idx_x,
    trap,
};
use crate::math;

/// Which elements form a pair; see the module documentation.
trait Pairing {
    /// `true` for rotate-half pairs `(x[i], x[i + half])`, `false` for `(x[2i], x[2i + 1])`.
    const NEOX: bool;
    /// Rows whose loads are issued together before their stores ([`rows_unroll`]); 4 or 8.
    const ROWS_UNROLL: u32;
}

/// GPT-J / RoFormer pairs `(x[2i], x[2i + 1])`.
struct Interleaved;
impl Pairing for Interleaved {
    const NEOX: bool = false;
    const ROWS_UNROLL: u32 = rows_unroll(RopeStyle::Interleaved);
}

/// GPT-NeoX rotate-half pairs `(x[i], x[i + half])`.
struct Neox;
impl Pairing for Neox {
    const NEOX: bool = true;
    const ROWS_UNROLL: u32 = rows_unroll(RopeStyle::Neox);
}

/// Where cos/sin come from; see [`crate::abi::SinCosSource`].
trait Source {
    /// `true` for tables, `false` for `cos`/`sin` computed from `inv_freq`.
    const TABLE: bool;
}

/// Tables: row `p` of `cos` and of `sin` starts at `p * table_stride`.
struct Table;
impl Source for Table {
    const TABLE: bool = true;
}

/// Computed from `inv_freq` (`half` `f64` values).
struct Theta;
impl Source for Theta {
    const TABLE: bool = false;
}

/// One rotated tensor: input, output (equal when in place), heads and element strides.
#[derive(Clone, Copy)]
struct TensorArgs<T> {
    x: *const T,
    out: *mut T,
    heads: u32,
    x_strides: [u64; 3],
    out_strides: [u64; 3],
}

/// The kernel arguments, gathered so the generic body takes one value.
#[derive(Clone, Copy)]
struct Args<T> {
    /// Tensor 0 (q) and tensor 1 (k, possibly without heads). Named fields rather than an
    /// array: a loop over an array of structs would put them in local memory.
    q: TensorArgs<T>,
    k: TensorArgs<T>,
    tokens: u64,
    seq: NonZeroU32,
    heads_per_chunk: u32,
    tile_tokens: NonZeroU32,
    cols: NonZeroU32,
    groups: NonZeroU32,
    rot_groups: u32,
    half: u32,
    rotary_dim: u32,
    lanes: u32,
    cos: *const T,
    sin: *const T,
    table_stride: u64,
    table_positions: u64,
    inv_freq: *const f64,
    angle_mode: u32,
    cs_scale: f32,
    positions: u32,
    pos_ptr: *const u8,
    pos_aux: *const u8,
    pos_count: u32,
    pos_base: i64,
    /// `1.0` forward, `-1.0` backward (the transposed rotation).
    sin_sign: f32,
    /// The block's shared scratch: the tile's `(cos, sin)` pairs, token-major.
    sincos: *mut CosSin,
    /// Division by `seq`.
    seq_div: FastDiv,
}

/// One pair's cosine and (direction-signed) sine, 8-byte aligned so a pair is one access.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct CosSin {
    cos: f32,
    sin: f32,
}

/// The position of token `(b, s)`.
///
/// # Safety
/// `pos_ptr` (and `pos_aux`) point at the arrays the position code describes (see
/// [`PositionCode`]).
#[inline(always)]
unsafe fn position<T>(a: &Args<T>, b: u64, s: u64) -> i64 {
    let seq = a.seq.get() as u64;
    let Some(code) = PositionCode::from_u32(a.positions) else {
        trap()
    };
    // SAFETY: b < batch and s < seq because b * seq + s < tokens = batch * seq; the caller
    // promises the array sizes listed in `PositionCode`, which these indices stay inside.
    unsafe {
        match code {
            PositionCode::Offset => a.pos_base + s as i64,
            PositionCode::RowOffsets => *a.pos_ptr.cast::<u32>().add(b as usize) as i64 + s as i64,
            PositionCode::IdsI32Shared => *a.pos_ptr.cast::<i32>().add(s as usize) as i64,
            PositionCode::IdsI32PerRow => {
                *a.pos_ptr.cast::<i32>().add((b * seq + s) as usize) as i64
            }
            PositionCode::IdsI64Shared => *a.pos_ptr.cast::<i64>().add(s as usize),
            PositionCode::IdsI64PerRow => *a.pos_ptr.cast::<i64>().add((b * seq + s) as usize),
            PositionCode::Varlen => varlen_position(a, b * seq + s),
        }
    }
}

/// The position of packed token `t`: `t - cu_seqlens[i] (+ offsets[i])` for the sequence `i`
/// with `cu_seqlens[i] <= t < cu_seqlens[i + 1]`, found by binary search.
///
/// # Safety
/// `pos_ptr` holds `pos_count + 1` `u32` (`pos_count >= 1`); `pos_aux` is null or holds
/// `pos_count` `u32`. Whatever their values, the search index stays in `0..pos_count`.
#[inline(always)]
unsafe fn varlen_position<T>(a: &Args<T>, t: u64) -> i64 {
    let cu = a.pos_ptr.cast::<u32>();
    let (mut lo, mut hi) = (0u32, a.pos_count.saturating_sub(1));
    while lo < hi {
        let mid = hi - (hi - lo) / 2;
        // SAFETY: lo < mid <= hi <= pos_count - 1, inside the pos_count + 1 entries.
        if unsafe { *cu.add(mid as usize) } as u64 <= t {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    // SAFETY: lo <= pos_count - 1, inside both arrays.
    unsafe {
        let start = *cu.add(lo as usize) as i64;
        let offset = if a.pos_aux.is_null() {
            0
        } else {
            *a.pos_aux.cast::<u32>().add(lo as usize) as i64
        };
        t as i64 - start + offset
    }
}

/// Loads one head's `L` elements (interleaved) or `2 L` elements (NeoX) of this work item.
///
/// # Safety
/// `head` points at a head of at least `rotary_dim` elements; `j0` is this item's first pair;
/// the alignment promised for `lanes` holds.
#[inline(always)]
unsafe fn load_head<T: Elem, P: Pairing, const L: usize>(
    head: *const T,
    j0: usize,
    half: usize,
) -> [[T; L]; 2] {
    // SAFETY: NeoX reads elements j0..j0+L and half+j0..half+j0+L, interleaved reads
    // 2*j0..2*j0+L; j0 + L <= half (resp. 2*j0 + L <= 2*half) because rot_groups * L covers
    // the pairs exactly, so every read stays in the head. Alignment is the caller's promise.
    unsafe {
        if P::NEOX {
            [
                elem::load::<T, L>(head.add(j0)),
                elem::load::<T, L>(head.add(half + j0)),
            ]
        } else {
            [elem::load::<T, L>(head.add(2 * j0)), [T::ZERO; L]]
        }
    }
}

/// Rotates one head's loaded elements and stores them.
///
/// # Safety
/// As [`load_head`], for `out_head` and writes.
#[inline(always)]
unsafe fn rotate_store_head<T: Elem, P: Pairing, const L: usize>(
    out_head: *mut T,
    j0: usize,
    half: usize,
    v: [[T; L]; 2],
    cos: &[f32; L],
    sin: &[f32; L],
) {
    let mut lo = [0.0f32; L];
    let mut hi = [0.0f32; L];
    if P::NEOX {
        unrolled(L, |k| {
            (lo[k], hi[k]) = math::rotate(v[0][k].to_f32(), v[1][k].to_f32(), cos[k], sin[k]);
        });
        // SAFETY: the same element ranges `load_head` read, in the output head.
        unsafe {
            elem::store::<T, L>(out_head.add(j0), T::from_f32_array(lo));
            elem::store::<T, L>(out_head.add(half + j0), T::from_f32_array(hi));
        }
    } else {
        unrolled(L / 2, |k| {
            let (x0, x1) = (v[0][2 * k].to_f32(), v[0][2 * k + 1].to_f32());
            (lo[2 * k], lo[2 * k + 1]) = math::rotate(x0, x1, cos[k], sin[k]);
        });
        // SAFETY: the same element range `load_head` read, in the output head.
        unsafe { elem::store::<T, L>(out_head.add(2 * j0), T::from_f32_array(lo)) };
    }
}

/// Calls `f(0)`, ..., `f(count - 1)` as straight-line code, for `count <= 8`.
///
/// `count` is a constant at every call site, so after inlining each call indexes arrays with a
/// constant and the arrays stay in registers; a `for` loop over a large body is not unrolled
/// by LLVM and would put them in local memory.
#[inline(always)]
fn unrolled(count: usize, mut f: impl FnMut(usize)) {
    if count > 8 {
        trap()
    }
    macro_rules! step {
        ($($k:literal)*) => {$(if $k < count { f($k) })*};
    }
    step!(0 1 2 3 4 5 6 7);
}

/// The heads that block row `blockIdx.y` handles, in the concatenation of q's and k's heads:
/// `(first, count)`.
#[inline(always)]
fn head_range<T>(a: &Args<T>) -> (u32, u32) {
    let heads = a.q.heads as u64 + a.k.heads as u64;
    let first = (block_idx_y() as u64 * a.heads_per_chunk as u64).min(heads);
    let last = (first + a.heads_per_chunk as u64).min(heads);
    (first as u32, (last - first) as u32)
}

/// Cos and sin of pair `j` at position `pos` (`sin` already signed for the direction).
///
/// # Safety
/// `j < half`; the table or `inv_freq` promises of the entry points.
#[inline(always)]
unsafe fn cos_sin<T: Elem, S: Source>(a: &Args<T>, pos: i64, j: u32) -> CosSin {
    if S::TABLE {
        if pos >= 0 && (pos as u64) < a.table_positions {
            let i = pos as usize * a.table_stride as usize + j as usize;
            // SAFETY: pos < table_positions and j < half <= table_stride, so the index is
            // inside the tables' promised rows.
            unsafe {
                CosSin {
                    cos: (*a.cos.add(i)).to_f32(),
                    sin: (*a.sin.add(i)).to_f32() * a.sin_sign,
                }
            }
        } else {
            // A position outside the table: documented NaN outputs, never a read outside it.
            CosSin {
                cos: f32::NAN,
                sin: f32::NAN,
            }
        }
    } else {
        let mode = math::AngleMode::from_u32(a.angle_mode);
        // SAFETY: j < half, the promised length of inv_freq.
        let f = unsafe { *a.inv_freq.add(j as usize) };
        let (c, s) = math::rope_cos_sin_mode(pos, f, mode);
        CosSin {
            cos: c * a.cs_scale,
            sin: s * (a.cs_scale * a.sin_sign),
        }
    }
}

/// Writes the `(cos, sin)` pairs of tokens `t0..t0 + tt` into the scratch, spread over the
/// block's threads.
///
/// # Safety
/// The tokens exist; `tt * half` pairs fit the scratch; the promises of [`position`] and
/// [`cos_sin`].
#[inline(always)]
unsafe fn fill_scratch<T: Elem, S: Source>(a: &Args<T>, t0: u64, tt: u32, half: NonZeroU32) {
    let (tid, threads) = (thread_idx_x(), block_dim_x());
    for t in 0..tt {
        let (b, s) = batch_seq(a, t0 + t as u64);
        // SAFETY: the token exists; the caller's promises.
        let pos = unsafe { position(a, b, s) };
        let mut j = tid;
        while j < half.get() {
            let i = t as usize * half.get() as usize + j as usize;
            // SAFETY: j < half; pair i of the tile fits the scratch (the caller's promise).
            unsafe { a.sincos.add(i).write(cos_sin::<T, S>(a, pos, j)) };
            j += threads;
        }
    }
}

/// `(b, s)` of token `token = b * seq + s`, with a 32-bit division when the token fits.
#[inline(always)]
fn batch_seq<T>(a: &Args<T>, token: u64) -> (u64, u64) {
    match u32::try_from(token) {
        Ok(t) => {
            let (b, s) = a.seq_div.divmod(t);
            (b as u64, s as u64)
        }
        Err(_) => {
            let seq = NonZeroU64::from(a.seq);
            (token / seq, token % seq)
        }
    }
}

/// This thread's share of a tile: one token and every `hthreads`-th head of the block's
/// heads, at one group of pairs.
#[derive(Clone, Copy)]
struct Lane<T> {
    /// The token's index in the tile (its `(cos, sin)` pairs start at `t * half`).
    t: u32,
    /// The token's position (table kernels read its row).
    pos: i64,
    /// The token's first head in q's input and output and in k's input and output.
    q: (*const T, *mut T),
    k: (*const T, *mut T),
    /// The block's heads are `first..first + count` of q's and k's heads together; this
    /// thread takes `first + hslot + i * hthreads` for `i = 0, 1, ...` below `count`.
    first: u32,
    count: u32,
    hslot: u32,
    hthreads: u32,
}

/// Input and output of head `first + k` (of q's and k's heads together) of the lane's token.
///
/// # Safety
/// `k < count`; the head exists.
#[inline(always)]
unsafe fn lane_head<T>(a: &Args<T>, lane: &Lane<T>, k: u32) -> (*const T, *mut T) {
    let h = (lane.first + k) as usize;
    let hq = a.q.heads as usize;
    // Selects values, not a reference to `a.q` or `a.k`: a pointer select would put the
    // arguments in local memory.
    let in_q = h < hq;
    let (x, out) = if in_q { lane.q } else { lane.k };
    let h = if in_q { h } else { h - hq };
    let xs = if in_q {
        a.q.x_strides[2]
    } else {
        a.k.x_strides[2]
    } as usize;
    let os = if in_q {
        a.q.out_strides[2]
    } else {
        a.k.out_strides[2]
    } as usize;
    // SAFETY: head h of the picked tensor exists at its head stride.
    unsafe { (x.add(h * xs), out.add(h * os)) }
}

/// The lane's `i`-th head offset within the block's heads, if it is one.
#[inline(always)]
fn nth_head<T>(lane: &Lane<T>, i: u32, u: usize) -> Option<u32> {
    let k = (i as u64 + u as u64) * lane.hthreads as u64 + lane.hslot as u64;
    (k < lane.count as u64).then_some(k as u32)
}

/// Loads the lane's heads `i..i + U` (those that exist) at pairs `j0..j0 + pairs`.
///
/// # Safety
/// The lane's token and heads exist; `j0 + pairs <= half`; the promises of [`load_head`].
#[inline(always)]
unsafe fn load_rows<T: Elem, P: Pairing, const L: usize, const U: usize>(
    a: &Args<T>,
    lane: &Lane<T>,
    i: u32,
    (j0, half): (usize, usize),
) -> [[[T; L]; 2]; U] {
    let mut v = [[[T::ZERO; L]; 2]; U];
    unrolled(U, |u| {
        if let Some(k) = nth_head(lane, i, u) {
            // SAFETY: k < count; see `lane_head` and `load_head`.
            v[u] = unsafe { load_head::<T, P, L>(lane_head(a, lane, k).0, j0, half) };
        }
    });
    v
}

/// The `(cos, sin)` of the lane's token at pairs `j0..j0 + pairs`: read from the tables
/// (cached; one row per thread and round) or from the scratch the block filled.
///
/// # Safety
/// `j0 + pairs <= half`; the table promises, or the scratch holds the tile's pairs.
#[inline(always)]
unsafe fn lane_cos_sin<T: Elem, S: Source, const L: usize>(
    a: &Args<T>,
    lane: &Lane<T>,
    (j0, half): (usize, usize),
    pairs: usize,
) -> ([f32; L], [f32; L]) {
    let mut cos = [0.0f32; L];
    let mut sin = [0.0f32; L];
    let first = lane.t as usize * half + j0;
    unrolled(pairs, |k| {
        let cs = if S::TABLE {
            // SAFETY: j0 + k < half; the table promises.
            unsafe { cos_sin::<T, S>(a, lane.pos, (j0 + k) as u32) }
        } else {
            // SAFETY: pair j0 + k < half of the lane's token, written by `fill_scratch`.
            unsafe { *a.sincos.add(first + k) }
        };
        cos[k] = cs.cos;
        sin[k] = cs.sin;
    });
    (cos, sin)
}

/// Rotates the heads [`load_rows`] loaded by `(cos, sin)` and stores them.
///
/// # Safety
/// As [`load_rows`].
#[inline(always)]
unsafe fn store_rows<T: Elem, P: Pairing, const L: usize, const U: usize>(
    a: &Args<T>,
    lane: &Lane<T>,
    i: u32,
    (j0, half): (usize, usize),
    v: &[[[T; L]; 2]; U],
    (cos, sin): (&[f32; L], &[f32; L]),
) {
    unrolled(U, |u| {
        if let Some(k) = nth_head(lane, i, u) {
            // SAFETY: k < count; see `lane_head` and `rotate_store_head`.
            unsafe {
                let out = lane_head(a, lane, k).1;
                rotate_store_head::<T, P, L>(out, j0, half, v[u], cos, sin);
            }
        }
    });
}

/// Copies elements `e0..e0 + L` of the lane's heads from input to output.
///
/// # Safety
/// The lane's token and heads exist; `e0 + L <= head_dim`, aligned to `L` elements.
#[inline(always)]
unsafe fn copy_rows<T: Elem, const L: usize>(a: &Args<T>, lane: &Lane<T>, e0: usize) {
    let mut k = lane.hslot;
    while k < lane.count {
        // SAFETY: k < count; the caller's promises on e0.
        unsafe {
            let (x, out) = lane_head(a, lane, k);
            elem::store::<T, L>(out.add(e0), elem::load::<T, L>(x.add(e0)));
        }
        k = k.saturating_add(lane.hthreads);
    }
}

/// The kernel body for `L` elements per access and `U` heads per round.
///
/// The block's threads are `(t, hslot, tx)` with `tx` fastest (`cols` groups), then `hslot`
/// (`hthreads`), then the tile token `t` (`tile_tokens`). Per tile: each thread issues the
/// loads of its first round (token `t`, heads `hslot, hslot + hthreads, ...`, group `tx`),
/// then the block writes the tile's `(cos, sin)` pairs to the scratch (so the loads' latency
/// overlaps the table reads or the sin/cos arithmetic), then after a barrier the rows are
/// rotated and stored. No division in the per-row work.
///
/// # Safety
/// The promises of the entry points (see [`rope_neox_table_fwd_f32`]).
#[inline(always)]
unsafe fn body<T: Elem, P: Pairing, S: Source, const L: usize, const U: usize>(a: &Args<T>) {
    let pairs = if P::NEOX { L } else { L / 2 };
    let (Some(half), tile_tokens) = (NonZeroU32::new(a.half), a.tile_tokens.get()) else {
        trap()
    };
    let (first, count) = head_range(a);
    if count == 0 {
        return; // block-uniform: this block row has no heads
    }
    let per_token = block_dim_x() / a.cols / tile_tokens;
    if tile_tokens > MAX_TILE_TOKENS
        || tile_tokens as usize * half.get() as usize * 8 > SCRATCH_SINCOS_BYTES
        || per_token == 0
    {
        trap()
    }
    let tid = thread_idx_x();
    let (tx, rest) = (tid % a.cols, tid / a.cols);
    let (t, hslot) = (rest / per_token, rest % per_token);
    let half_u = half.get() as usize;
    let tiles = a.tokens.div_ceil(tile_tokens as u64);
    let mut tile_idx = block_idx_x() as u64;
    // Block-uniform loop: every thread reaches the same barriers.
    while tile_idx < tiles {
        let t0 = tile_idx * tile_tokens as u64;
        let tt = (a.tokens - t0).min(tile_tokens as u64) as u32;
        let token = t0 + t as u64;
        let (b, s) = batch_seq(a, token.min(a.tokens - 1));
        // (b, s) is clamped to the last token for threads past the tile's end, which touch
        // no row: their `count` is 0.
        let lane = Lane {
            t,
            // SAFETY: (b, s) is a token of the batch; the position arrays are promised.
            pos: if S::TABLE {
                unsafe { position(a, b, s) }
            } else {
                0
            },
            q: token_base(&a.q, b, s),
            k: token_base(&a.k, b, s),
            first,
            count: if t < tt { count } else { 0 },
            hslot,
            hthreads: per_token,
        };
        if !S::TABLE {
            // SAFETY: tokens t0..t0 + tt exist; the tile fits the scratch (checked above).
            unsafe { fill_scratch::<T, S>(a, t0, tt, half) };
            // SAFETY: `S` is the same for the whole block, and every thread runs this loop
            // the same number of times.
            unsafe { sync_threads() };
        }
        let mut g = tx;
        while g < a.groups.get() {
            if g < a.rot_groups {
                let j0 = (g as usize * pairs, half_u);
                let mut i = 0;
                while i * per_token < lane.count {
                    // SAFETY: the lane's heads exist; g < rot_groups so its pairs are inside
                    // `half`; the scratch holds this tile's pairs (computed sin/cos). The
                    // table reads are issued after the loads, so their latencies overlap.
                    unsafe {
                        let v = load_rows::<T, P, L, U>(a, &lane, i, j0);
                        let (cos, sin) = lane_cos_sin::<T, S, L>(a, &lane, j0, pairs);
                        store_rows::<T, P, L, U>(a, &lane, i, j0, &v, (&cos, &sin));
                    }
                    i += U as u32;
                }
            } else {
                let e0 = a.rotary_dim as usize + (g - a.rot_groups) as usize * L;
                // SAFETY: e0 + L <= head_dim because the pass-through groups cover
                // rotary_dim..head_dim exactly.
                unsafe { copy_rows::<T, L>(a, &lane, e0) };
            }
            g += a.cols.get();
        }
        if !S::TABLE {
            // SAFETY: as above; the next tile's scratch writes wait for this tile's reads.
            unsafe { sync_threads() };
        }
        tile_idx += grid_dim_x() as u64;
    }
}

/// The first head of token `(b, s)` in a tensor's input and output (wrapping arithmetic: a
/// tensor without heads may have null pointers; the heads' accesses are the checked part).
#[inline(always)]
fn token_base<T>(t: &TensorArgs<T>, b: u64, s: u64) -> (*const T, *mut T) {
    let off = |st: &[u64; 3]| (b * st[0] + s * st[1]) as usize;
    (
        t.x.wrapping_add(off(&t.x_strides)),
        t.out.wrapping_add(off(&t.out_strides)),
    )
}

/// Picks the monomorphized body for the `lanes` argument: the 16-byte body for the wide
/// kernels, one of the narrower ones for the `_narrow` kernels.
///
/// # Safety
/// The promises of the entry points.
#[inline(always)]
unsafe fn dispatch<T: Elem, P: Pairing, S: Source, const WIDE: bool>(a: &Args<T>) {
    // SAFETY: forwarded promises; `lanes` selects a body whose access width the host checked.
    unsafe {
        match (WIDE, T::SIZE, a.lanes) {
            (true, 4, 4) => body_rows::<T, P, S, 4>(a),
            (true, 2, 8) => body_rows::<T, P, S, 8>(a),
            (false, 2, 4) => body_rows::<T, P, S, 4>(a),
            (false, _, 2) => body_rows::<T, P, S, 2>(a),
            (false, _, 1) if P::NEOX => body_rows::<T, P, S, 1>(a),
            _ => trap(),
        }
    }
}

/// [`body`] with the pairing's rows per round.
///
/// # Safety
/// The promises of the entry points.
#[inline(always)]
unsafe fn body_rows<T: Elem, P: Pairing, S: Source, const L: usize>(a: &Args<T>) {
    // SAFETY: forwarded promises. (A const generic cannot name `P::ROWS_UNROLL` directly.)
    unsafe {
        match P::ROWS_UNROLL {
            8 => body::<T, P, S, L, 8>(a),
            4 => body::<T, P, S, L, 4>(a),
            _ => trap(),
        }
    }
}

/// Defines one exported entry point per (pairing, source, direction, dtype).
macro_rules! rope_kernel {
    ($($wide:ident, $narrow:ident: $pairing:ident, $source:ident, $dir:ident, $dt:ident, $t:ty;)*) => {$(
        rope_kernel!(@entry $wide, true: $pairing, $source, $dir, $dt, $t);
        rope_kernel!(@entry $narrow, false: $pairing, $source, $dir, $dt, $t);
    )*};
    (@entry $name:ident, $is_wide:literal: $pairing:ident, $source:ident, $dir:ident, $dt:ident, $t:ty) => {
        /// One RoPE entry point; its name says the pairing, the sin/cos source, the direction,
        /// the element type and (`_narrow`) whether accesses are narrower than 16 bytes. See
        /// the module documentation for the formula and mapping.
        ///
        /// # Arguments
        /// Per tensor `n` in 0 (q) and 1 (k, `heads1 = 0` when absent): `xn`, `outn`,
        /// `headsn`, element strides `xn_stride_*`, `outn_stride_*` of
        /// `[batch, seq, heads, head_dim]` (last dimension contiguous). `tokens = batch * seq`;
        /// `heads_per_chunk`: heads (of both tensors together) handled by one `blockIdx.y`;
        /// `tile_tokens`: tokens per block tile (at most [`MAX_TILE_TOKENS`], with
        /// `tile_tokens * half * 8 <= SCRATCH_SINCOS_BYTES` and
        /// `tile_tokens * heads_per_chunk <= u32::MAX`); `cols`: threads per row of the
        /// block (`blockDim.x` a multiple of it);
        /// `groups = rot_groups + pass-through groups`, `rot_groups = half / pairs_per_item`
        /// with `pairs_per_item = lanes` (NeoX) or `lanes / 2` (interleaved), and
        /// `(head_dim - rotary_dim) / lanes` pass-through groups out of place (0 in place);
        /// `cos`, `sin`, `table_stride` (elements per row), `table_positions` for table
        /// kernels and `inv_freq`, `angle_mode` (a [`math::AngleMode`]) and `cs_scale` (the
        /// attention factor multiplying cos and sin, 1 by default) for computed sin/cos (the
        /// other pointers are unused and may be null); `positions`: a [`PositionCode`] with
        /// `pos_ptr`, `pos_aux`, `pos_count`, `pos_base`.
        ///
        /// # Safety
        /// - each `xn`/`outn` addresses every element of its layout; distinct heads'
        ///   element ranges do not overlap, and `outn` equals `xn` or overlaps no input;
        /// - every tensor pointer and stride is aligned to `lanes` elements, and `lanes`
        ///   divides the work as `groups` says;
        /// - for tables, `cos` and `sin` hold `table_positions` rows of `table_stride >= half`
        ///   elements; for computed sin/cos, `inv_freq` holds `half` `f64`;
        /// - `pos_ptr` and `pos_aux` hold the arrays their [`PositionCode`] names.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            x0: *const $t,
            out0: *mut $t,
            heads0: u32,
            x0_stride_batch: u64,
            x0_stride_seq: u64,
            x0_stride_head: u64,
            out0_stride_batch: u64,
            out0_stride_seq: u64,
            out0_stride_head: u64,
            x1: *const $t,
            out1: *mut $t,
            heads1: u32,
            x1_stride_batch: u64,
            x1_stride_seq: u64,
            x1_stride_head: u64,
            out1_stride_batch: u64,
            out1_stride_seq: u64,
            out1_stride_head: u64,
            tokens: u64,
            seq: NonZeroU32,
            heads_per_chunk: u32,
            tile_tokens: NonZeroU32,
            cols: NonZeroU32,
            groups: NonZeroU32,
            rot_groups: u32,
            half: u32,
            rotary_dim: u32,
            lanes: u32,
            cos: *const $t,
            sin: *const $t,
            table_stride: u64,
            table_positions: u64,
            inv_freq: *const f64,
            angle_mode: u32,
            cs_scale: f32,
            positions: u32,
            pos_ptr: *const u8,
            pos_aux: *const u8,
            pos_count: u32,
            pos_base: i64,
        ) {
            let args = Args {
                q: TensorArgs {
                        x: x0,
                        out: out0,
                        heads: heads0,
                        x_strides: [x0_stride_batch, x0_stride_seq, x0_stride_head],
                        out_strides: [out0_stride_batch, out0_stride_seq, out0_stride_head],
                    },
                k: TensorArgs {
                        x: x1,
                        out: out1,
                        heads: heads1,
                        x_strides: [x1_stride_batch, x1_stride_seq, x1_stride_head],
                        out_strides: [out1_stride_batch, out1_stride_seq, out1_stride_head],
                    },
                tokens,
                seq,
                heads_per_chunk,
                tile_tokens,
                cols,
                groups,
                rot_groups,
                half,
                rotary_dim,
                lanes,
                cos,
                sin,
                table_stride,
                table_positions,
                inv_freq,
                angle_mode,
                cs_scale,
                positions,
                pos_ptr,
                pos_aux,
                pos_count,
                pos_base,
                sin_sign: sin_sign(Direction::$dir),
                sincos: shared_scratch().cast::<CosSin>(),
                seq_div: FastDiv::new(seq),
            };
            // SAFETY: the caller's promises, listed above, are those `dispatch` needs.
            unsafe { dispatch::<$t, $pairing, $source, $is_wide>(&args) }
        }
    };
}

/// `+1` forward, `-1` backward: the sign of `sin` in the rotation.
const fn sin_sign(direction: Direction) -> f32 {
    match direction {
        Direction::Forward => 1.0,
        Direction::Backward => -1.0,
    }
}

for_each_kernel!(rope_kernel);
