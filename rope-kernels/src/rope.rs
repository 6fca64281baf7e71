//! The RoPE kernel family: forward and backward rotation, interleaved (GPT-J) and rotate-half
//! (GPT-NeoX) pairing, sin/cos from tables or from frequencies, implicit, explicit, packed
//! variable-length or multi-axis positions (each pair taking its own axis's position: mRoPE,
//! N-D axial RoPE), partial rotary at any offset in the head, and one or two tensors (q and k)
//! per launch.
//!
//! # Formula
//! For pair `i < half` (`half = rotary_dim / 2`) of a head at position `p`, with
//! `c = cos(p * inv_freq_i)`, `s = sin(...)`: forward `(a, b) -> (a c - b s, b c + a s)`;
//! backward (the transposed rotation) `(a, b) -> (a c + b s, b c - a s)`, the same entry point
//! with `s` times its `sin_sign` argument, `-1.0` (`Direction::sin_sign`). Interleaved pairs are
//! `(x[2i], x[2i + 1])`; NeoX pairs are `(x[i], x[i + half])`, both counted from
//! `rotary_offset`. Elements outside `rotary_offset..rotary_offset + rotary_dim` pass through
//! unchanged (copied when `out` differs from `x`).
//!
//! # Layout
//! Each tensor holds `[batch, seq, heads, head_dim]` elements at element strides
//! `(stride_batch, stride_seq, stride_head, 1)`; its `out` either equals its `x` (in place) or
//! overlaps no input. Tensor 1 (k) has its own heads and strides and may have no heads.
//!
//! # Thread mapping
//! A work item is one (token, group): groups `0..rot_groups` rotate `pairs_per_item` pairs, groups
//! `rot_groups..groups` copy `lanes` pass-through elements. The `tokens * groups` items are walked
//! by a grid-stride loop over `blockIdx.x`, so consecutive threads touch consecutive addresses of a
//! head; an item's index splits into token and group, and the token into batch row and sequence
//! index, by multiply-high with the host's magic numbers ([`crate::divide`]) rather than by
//! division instructions. Each rotating item computes or loads the sin/cos of its pairs once and
//! applies them to the heads `blockIdx.y * heads_per_chunk .. +heads_per_chunk` of the
//! concatenation of tensor 0's and tensor 1's heads, several heads at a time with all loads issued
//! before the stores (with computed sin/cos in place, the first heads' elements are prefetched
//! into L2 before the arithmetic). Every access moves `lanes` elements at once: when alignment
//! allows, the preferred width of `abi::preferred_lanes` (16 bytes; 8 for NeoX pairs of 16-bit
//! elements).
//!
//! The `_one_head` kernels ([`Mapping::ONE_HEAD`]) serve launches whose grid gives every head a
//! block row of its own and that copy nothing through (decode steps): each thread rotates the one
//! work item `blockIdx.x * blockDim.x + threadIdx.x` of head `blockIdx.y`, with no loop.

use core::marker::PhantomData;

use crate::abi::{
    ContextParallelSplit, GroupAxes, Mapping, PositionCode, TableElem, clamped_axis,
    for_each_kernel, pass_through_start, planned_table_vectors,
};
use crate::access;
use crate::divide::Divisor;
use crate::elem::{Bf16, Elem, Half, unrolled};
use crate::intrinsics::{
    allow_dependent_grids, block_dim_x, block_idx_x, block_idx_y, grid_dim_x, load_evict_last,
    prefetch_l2, thread_idx_x, trap, wait_for_prior_grids,
};
use crate::math;

/// Which elements form a pair; see the module documentation.
pub(crate) trait Pairing {
    /// `true` for rotate-half pairs `(x[i], x[i + half])`, `false` for `(x[2i], x[2i + 1])`.
    const NEOX: bool;
    /// Heads whose loads are issued together before their stores: bytes in flight per thread
    /// at a modest register cost (NeoX reads two vectors per head; four NeoX heads with 16-bit
    /// elements take far more registers than the kernels' cap, and fewer threads of more
    /// registers each were slower than more threads: docs/perf/decisions.md). Either 2 or 4.
    const HEADS_UNROLL: usize;
}

/// GPT-J / RoFormer pairs `(x[2i], x[2i + 1])`.
pub(crate) struct Interleaved;
impl Pairing for Interleaved {
    const NEOX: bool = false;
    const HEADS_UNROLL: usize = 4;
}

/// GPT-NeoX rotate-half pairs `(x[i], x[i + half])`.
pub(crate) struct Neox;
impl Pairing for Neox {
    const NEOX: bool = true;
    const HEADS_UNROLL: usize = 2;
}

/// Where cos/sin come from; see [`crate::abi::SinCosSource`]. Each source is generic over the
/// tensors' element type `T` so that every entry point names its source as `Source<T>`.
pub(crate) trait Source {
    /// `true` for tables, `false` for `cos`/`sin` computed from `inv_freq`.
    const TABLE: bool;
}

/// Tables of the tensors' element type or of `f32` (`table_elem`, [`TableElem`]): row `p` of
/// `cos` and of `sin` starts at `p * table_stride`.
pub(crate) struct Table<T>(PhantomData<T>);
impl<T> Source for Table<T> {
    const TABLE: bool = true;
}

/// Computed from `inv_freq` (`half` `f64` values).
pub(crate) struct Theta<T>(PhantomData<T>);
impl<T> Source for Theta<T> {
    const TABLE: bool = false;
}

/// One rotated tensor: input, output (equal when in place), heads and element strides.
#[derive(Clone, Copy)]
pub(crate) struct TensorArgs<T> {
    pub(crate) x: *const T,
    pub(crate) out: *mut T,
    pub(crate) heads: u32,
    pub(crate) x_strides: [u64; 3],
    pub(crate) out_strides: [u64; 3],
}

/// The kernel arguments, gathered so the generic body takes one value.
#[derive(Clone, Copy)]
pub(crate) struct Args<T> {
    /// Tensor 0 (q) and tensor 1 (k, possibly without heads). Named fields rather than an
    /// array: a loop over an array of structs would put them in local memory.
    pub(crate) q: TensorArgs<T>,
    pub(crate) k: TensorArgs<T>,
    pub(crate) tokens: u64,
    pub(crate) seq: Divisor,
    pub(crate) heads_per_chunk: u32,
    pub(crate) groups: Divisor,
    pub(crate) rot_groups: u32,
    pub(crate) half: u32,
    pub(crate) rotary_dim: u32,
    pub(crate) rotary_offset: u32,
    pub(crate) lanes: u32,
    /// Tables of the element type `table_elem` gives ([`Args::f32_tables`]).
    pub(crate) cos: *const u8,
    pub(crate) sin: *const u8,
    pub(crate) table_stride: u64,
    pub(crate) table_rows: u64,
    pub(crate) table_elem: u32,
    pub(crate) inv_freq: *const f64,
    pub(crate) angle_mode: u32,
    pub(crate) cs_scale: f32,
    pub(crate) position_code: u32,
    pub(crate) pos_ptr: *const u8,
    pub(crate) pos_aux: *const u8,
    pub(crate) pos_count: u32,
    pub(crate) pos_base: i64,
    /// `1.0` forward, `-1.0` backward (the transposed rotation): `Direction::sin_sign`.
    pub(crate) sin_sign: f32,
    /// Non-zero: the one-head kernels read positions, frequencies and tables before waiting for
    /// the grid before them, and let the next grid start first (see `one_head_body`).
    pub(crate) read_ahead: u32,
    /// Non-zero: a one-head launch that is decode's common launch
    /// ([`crate::abi::common_one_head_launch`]; see `one_head`).
    pub(crate) common_launch: u32,
}

impl<T: Elem> Args<T> {
    /// Whether the tables hold `f32` for 16-bit tensors ([`TableElem::F32`]); the tables of
    /// `f32` tensors are `f32` whatever the code, so their kernels hold one table read.
    #[inline(always)]
    pub(crate) fn f32_tables(&self) -> bool {
        T::SIZE != 4 && self.table_elem == TableElem::F32 as u32
    }
}

/// The position of token `(b, s)` for the work items of rotating group `group`; for per-pair
/// multi-axis positions, the token's index `b * seq + s`, from which [`cos_sin`] reads each
/// pair's position.
///
/// Device arrays are read as they are: a position outside a table makes the token's outputs NaN
/// (see [`cos_sin`]), and malformed `cu_seqlens` only give wrong positions, never an access
/// outside the arrays or the tensors.
///
/// # Safety
/// `pos_ptr` (and `pos_aux`) point at the arrays the position code describes (see
/// [`PositionCode`]).
#[inline(always)]
pub(crate) unsafe fn position<T>(a: &Args<T>, b: u64, s: u64, group: u32) -> i64 {
    // SAFETY: the caller's promises.
    unsafe { position_read::<T, PlainRead>(a, b, s, group) }
}

/// How [`position_read`] loads a token's entry of the position ids or row offsets.
pub(crate) trait PositionRead {
    /// Loads the integer at `p`.
    ///
    /// # Safety
    /// `p` points at a readable, aligned `I` in global memory.
    unsafe fn read<I: Copy>(p: *const I) -> I;
}

/// Plain loads.
pub(crate) struct PlainRead;
impl PositionRead for PlainRead {
    #[inline(always)]
    unsafe fn read<I: Copy>(p: *const I) -> I {
        // SAFETY: the caller's promise.
        unsafe { *p }
    }
}

/// Loads with L2's evict-last priority ([`load_evict_last`]), for kernels that go on to read
/// the position's table row: with both kept in L2, the token's two reads in a row find L2
/// rather than memory.
pub(crate) struct KeptInL2;
impl PositionRead for KeptInL2 {
    #[inline(always)]
    unsafe fn read<I: Copy>(p: *const I) -> I {
        // SAFETY: the caller's promise (an `i32` or `i64`: 4 or 8 bytes, aligned).
        unsafe { load_evict_last::<I, 1>(p)[0] }
    }
}

/// [`position`], with the ids and row offsets (the one-load position kinds) read by `R`; the
/// varlen, per-group-axis and multi-axis kinds read as in [`position`].
///
/// # Safety
/// As [`position`].
#[inline(always)]
pub(crate) unsafe fn position_read<T, R: PositionRead>(
    a: &Args<T>,
    b: u64,
    s: u64,
    group: u32,
) -> i64 {
    let seq = a.seq.divisor.get() as u64;
    let Some(code) = PositionCode::from_u32(a.position_code) else {
        trap()
    };
    let at = |i: u64| i as usize;
    // SAFETY: b < batch and s < seq because b * seq + s < tokens = batch * seq; the caller
    // promises the array sizes listed in `PositionCode`, which these indices stay inside (a
    // group's axis is clamped below `pos_count`, at least 1 for the multi-axis codes).
    unsafe {
        let i32s = a.pos_ptr.cast::<i32>();
        let i64s = a.pos_ptr.cast::<i64>();
        match code {
            PositionCode::Offset => a.pos_base.wrapping_add(s as i64),
            PositionCode::RowOffsetsI32 => (R::read(i32s.add(at(b))) as i64).wrapping_add(s as i64),
            PositionCode::RowOffsetsI64 => R::read(i64s.add(at(b))).wrapping_add(s as i64),
            PositionCode::IdsI32Shared => R::read(i32s.add(at(s))) as i64,
            PositionCode::IdsI32PerRow => R::read(i32s.add(at(b * seq + s))) as i64,
            PositionCode::IdsI64Shared => R::read(i64s.add(at(s))),
            PositionCode::IdsI64PerRow => R::read(i64s.add(at(b * seq + s))),
            PositionCode::VarlenI32 => varlen_position::<T, i32>(a, b * seq + s),
            PositionCode::VarlenI64 => varlen_position::<T, i64>(a, b * seq + s),
            PositionCode::GroupAxesI32 | PositionCode::GroupAxesI64 => {
                let axis =
                    GroupAxes::axis_in_base(a.pos_base, group).min(a.pos_count.saturating_sub(1));
                let wide = code == PositionCode::GroupAxesI64;
                axis_position(a, wide, axis, b * seq + s)
            }
            // Each pair reads its own axis's position: `cos_sin` takes the token's index.
            PositionCode::MultiAxisI32 | PositionCode::MultiAxisI64 => (b * seq + s) as i64,
        }
    }
}

/// A signed integer type of device position arrays.
trait Index: Copy {
    /// Widens to `i64` exactly.
    fn to_i64(self) -> i64;
}
impl Index for i32 {
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self as i64
    }
}
impl Index for i64 {
    #[inline(always)]
    fn to_i64(self) -> i64 {
        self
    }
}

/// The position of packed token `t`: `t - cu_seqlens[i] (+ offsets[i])` for the sequence `i`
/// with `cu_seqlens[i] <= t < cu_seqlens[i + 1]`, found by binary search (the last `i` whose
/// start is at most `t`; malformed `cu_seqlens` give some `i` in range, never an access
/// outside the arrays). With a context-parallel split in `pos_base`, `cu_seqlens` bound whole
/// sequences and the position is [`ContextParallelSplit::position`]'s.
///
/// # Safety
/// `pos_ptr` holds `pos_count + 1` `I` (`pos_count >= 1`); `pos_aux` is null or holds
/// `pos_count` `I`. Whatever their values, the search index stays in `0..pos_count`.
#[inline(always)]
unsafe fn varlen_position<T, I: Index>(a: &Args<T>, t: u64) -> i64 {
    let cu = a.pos_ptr.cast::<I>();
    let split = ContextParallelSplit::from_base(a.pos_base);
    let bound = split.search_bound(t);
    let (mut lo, mut hi) = (0u32, a.pos_count.saturating_sub(1));
    while lo < hi {
        let mid = hi - (hi - lo) / 2;
        // SAFETY: lo < mid <= hi <= pos_count - 1, inside the pos_count + 1 entries.
        if unsafe { *cu.add(mid as usize) }.to_i64() <= bound {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    // SAFETY: lo <= pos_count - 1, inside both arrays, and lo + 1 <= pos_count inside
    // `cu_seqlens`'s pos_count + 1 entries.
    unsafe {
        let start = (*cu.add(lo as usize)).to_i64();
        if split.size.get() > 1 {
            let end = (*cu.add(lo as usize + 1)).to_i64();
            return split.position(t, start, end);
        }
        let offset = if a.pos_aux.is_null() {
            0
        } else {
            (*a.pos_aux.cast::<I>().add(lo as usize)).to_i64()
        };
        (t as i64).wrapping_sub(start).wrapping_add(offset)
    }
}

/// Where this work item's vectors start in a head, in elements: `(j0, half + j0)` for NeoX
/// (the second is the pairs' partners), `(2 j0, _)` interleaved (one vector holds the pairs).
/// Loads, stores and prefetches all address a head through this.
#[inline(always)]
pub(crate) fn vector_offsets<P: Pairing>(j0: usize, half: usize) -> (usize, usize) {
    if P::NEOX {
        (j0, half + j0)
    } else {
        (2 * j0, 0)
    }
}

/// Loads one head's `L` elements (interleaved) or `2 L` elements (NeoX) of this work item.
///
/// # Safety
/// `head` points at a head of at least `rotary_dim` elements; `j0` is this item's first pair;
/// the alignment promised for `lanes` holds.
#[inline(always)]
pub(crate) unsafe fn load_head<T: Elem, P: Pairing, const L: usize>(
    head: *const T,
    j0: usize,
    half: usize,
) -> [[T; L]; 2] {
    let (first, second) = vector_offsets::<P>(j0, half);
    // SAFETY: NeoX reads elements j0..j0+L and half+j0..half+j0+L, interleaved reads
    // 2*j0..2*j0+L; j0 + L <= half (resp. 2*j0 + L <= 2*half) because rot_groups * L covers
    // the pairs exactly, so every read stays in the head. Alignment is the caller's promise.
    unsafe {
        if P::NEOX {
            [
                access::load::<T, L>(head.add(first)),
                access::load::<T, L>(head.add(second)),
            ]
        } else {
            [access::load::<T, L>(head.add(first)), [T::ZERO; L]]
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
    let (first, second) = vector_offsets::<P>(j0, half);
    let [lo, hi] = rotate_values::<P, L>(|i, k| v[i][k].to_f32(), cos, sin);
    // Results are rounded in pairs (one `cvt.rn.bf16x2.f32` for bf16).
    // SAFETY: the same element ranges `load_head` read, in the output head.
    unsafe {
        T::store_rounded(out_head.add(first), lo);
        if P::NEOX {
            T::store_rounded(out_head.add(second), hi);
        }
    }
}

/// One head's loaded vectors (as [`load_head`] returns them) widened to `f32`.
#[inline(always)]
pub(crate) fn widen<T: Elem, const L: usize>(v: [[T; L]; 2]) -> [[f32; L]; 2] {
    v.map(T::widen)
}

/// Rotates one head's vectors by this item's `cos` and `sin`, reading element `k` of vector
/// `i` (laid out as [`load_head`] returns them) as `v(i, k)`, each just before its pair is
/// rotated: NeoX pair `k` is `(v(0, k), v(1, k))`, interleaved pair `k` is
/// `(v(0, 2k), v(0, 2k + 1))` (the second vector is then unused and returned as zeros).
#[inline(always)]
pub(crate) fn rotate_values<P: Pairing, const L: usize>(
    v: impl Fn(usize, usize) -> f32,
    cos: &[f32; L],
    sin: &[f32; L],
) -> [[f32; L]; 2] {
    rotate_values_with::<P, L>(v, cos, sin, math::rotate)
}

/// [`rotate_values`] with `rotate(a, b, cos, sin)` rotating each pair.
#[inline(always)]
pub(crate) fn rotate_values_with<P: Pairing, const L: usize>(
    v: impl Fn(usize, usize) -> f32,
    cos: &[f32; L],
    sin: &[f32; L],
    rotate: impl Fn(f32, f32, f32, f32) -> (f32, f32),
) -> [[f32; L]; 2] {
    let mut lo = [0.0f32; L];
    let mut hi = [0.0f32; L];
    if P::NEOX {
        unrolled(L, |k| {
            (lo[k], hi[k]) = rotate(v(0, k), v(1, k), cos[k], sin[k])
        });
    } else {
        unrolled(L / 2, |k| {
            (lo[2 * k], lo[2 * k + 1]) = rotate(v(0, 2 * k), v(0, 2 * k + 1), cos[k], sin[k]);
        });
    }
    [lo, hi]
}

/// Loads this item's elements of the `U` heads `h..h + U` of the concatenated q and k heads.
///
/// # Safety
/// `h + U <= q.heads + k.heads`; `tok` holds the token's bases from [`token_bases`]; the
/// promises of [`load_head`] for every head.
#[inline(always)]
unsafe fn load_block<T: Elem, P: Pairing, const L: usize, const U: usize>(
    a: &Args<T>,
    tok: &TokenBases<T>,
    h: usize,
    (j0, half): (usize, usize),
) -> [[[T; L]; 2]; U] {
    let mut v = [[[T::ZERO; L]; 2]; U];
    unrolled(U, |u| {
        // SAFETY: head h + u exists; see `head` and `load_head`.
        v[u] = unsafe { load_head::<T, P, L>(head(a, tok, h + u).0, j0, half) };
    });
    v
}

/// Rotates the heads [`load_block`] loaded and stores them.
///
/// # Safety
/// As [`load_block`].
#[inline(always)]
unsafe fn store_block<T: Elem, P: Pairing, const L: usize, const U: usize>(
    a: &Args<T>,
    tok: &TokenBases<T>,
    h: usize,
    (j0, half): (usize, usize),
    v: &[[[T; L]; 2]; U],
    (cos, sin): (&[f32; L], &[f32; L]),
) {
    unrolled(U, |u| {
        // SAFETY: head h + u exists; see `head` and `rotate_store_head`.
        unsafe { rotate_store_head::<T, P, L>(head(a, tok, h + u).1, j0, half, v[u], cos, sin) };
    });
}

/// Applies this item's rotation to the `U` heads `h..h + U`: all loads, then all stores.
///
/// # Safety
/// As [`load_block`].
#[inline(always)]
unsafe fn heads_block<T: Elem, P: Pairing, const L: usize, const U: usize>(
    a: &Args<T>,
    tok: &TokenBases<T>,
    h: usize,
    j0: (usize, usize),
    cs: (&[f32; L], &[f32; L]),
) {
    // SAFETY: the caller's promises.
    unsafe {
        let v = load_block::<T, P, L, U>(a, tok, h, j0);
        store_block::<T, P, L, U>(a, tok, h, j0, &v, cs);
    }
}

/// One token's first head in each tensor's input and output.
struct TokenBases<T> {
    q: (*const T, *mut T),
    k: (*const T, *mut T),
}

/// Input and output of head `h` of the concatenated q and k heads of the token `tok`.
/// Computing each head's address afresh (a select and a multiply) keeps loop strength reduction
/// from holding a 64-bit pointer per access stream.
///
/// # Safety
/// `h < q.heads + k.heads`, `tok` from [`token_bases`].
#[inline(always)]
unsafe fn head<T>(a: &Args<T>, tok: &TokenBases<T>, h: usize) -> (*const T, *mut T) {
    let hq = a.q.heads as usize;
    let (t, (x, out), h) = if h < hq {
        (&a.q, tok.q, h)
    } else {
        (&a.k, tok.k, h - hq)
    };
    // SAFETY: head h of that tensor exists at its head stride.
    unsafe {
        (
            x.add(h * t.x_strides[2] as usize),
            out.add(h * t.out_strides[2] as usize),
        )
    }
}

/// The heads that block row `blockIdx.y` handles, in the concatenation of q's and k's heads.
#[inline(always)]
fn head_range<T>(a: &Args<T>) -> (usize, usize) {
    let heads = a.q.heads as u64 + a.k.heads as u64;
    let first = (block_idx_y() as u64 * a.heads_per_chunk as u64).min(heads);
    let last = (first + a.heads_per_chunk as u64).min(heads);
    (first as usize, last as usize)
}

/// Cos and sin of this item's pairs (`sin` already signed for the direction); for multi-axis
/// position codes, `pos` is the token's index and [`cos_sin_axes`] finds each pair's position.
/// Table reads take L2's evict-last priority ([`load_evict_last`]): a row is read again by
/// later tokens and launches at that position, and the heads streaming through L2 between
/// those reads evicted it otherwise, which made table launches at prefill much faster
/// (docs/perf/decisions.md).
///
/// # Safety
/// The table or `inv_freq` promises of the entry points.
#[inline(always)]
pub(crate) unsafe fn cos_sin<T: Elem, S: Source, const L: usize>(
    a: &Args<T>,
    pos: i64,
    j0: usize,
    pairs: usize,
) -> ([f32; L], [f32; L]) {
    // SAFETY: the caller's promises.
    unsafe { cos_sin_read::<T, S, AnyTable, L>(a, pos, j0, pairs) }
}

/// [`cos_sin`], with a single-position table row read by `R`.
///
/// # Safety
/// As [`cos_sin`], and `R`'s promise.
#[inline(always)]
pub(crate) unsafe fn cos_sin_read<T: Elem, S: Source, R: TableRead, const L: usize>(
    a: &Args<T>,
    pos: i64,
    j0: usize,
    pairs: usize,
) -> ([f32; L], [f32; L]) {
    let mut pos = pos;
    if a.position_code >= PositionCode::MultiAxisI32 as u32 {
        // A uniform branch on a kernel argument, inside the sin/cos step only: a separate
        // multi-axis instance of the whole loop took more registers and spilled in ptxas.
        // With tables, an item whose pairs all take one axis (every item of mRoPE's and
        // FLUX's maps when the sections are multiples of the pairs per item) reads that axis's
        // position once and goes on as one position, with vector table reads. (For in-kernel
        // sin/cos the same shortcut made ptxas spill in the NeoX bf16 kernels.)
        // SAFETY: for multi-axis codes `pos` is the token's index; j0 + pairs <= half, the
        // map's length; the caller's promises.
        let shared_axis = if S::TABLE {
            // SAFETY: j0 + pairs <= half, the map's length (the caller's promise).
            unsafe { item_axis(a, j0, pairs) }
        } else {
            None
        };
        match shared_axis {
            Some(axis) => {
                let wide = a.position_code == PositionCode::MultiAxisI64 as u32;
                // SAFETY: the clamped axis is below pos_count; the token index is below tokens.
                pos = unsafe { axis_position(a, wide, axis, pos as u64) };
            }
            None => return unsafe { cos_sin_axes::<T, S, L>(a, pos as u64, j0, pairs) },
        }
    }
    let mut cos = [0.0f32; L];
    let mut sin = [0.0f32; L];
    if S::TABLE {
        // A uniform branch on a kernel argument: one kernel reads tables of either type.
        // SAFETY: the caller's promises, for tables of the type `table_elem` gives.
        (cos, sin) = unsafe {
            if a.f32_tables() {
                table_row::<T, f32, R, L>(a, pos, j0, pairs)
            } else {
                table_row::<T, T, R, L>(a, pos, j0, pairs)
            }
        };
    } else {
        let Some(mode) = math::AngleMode::from_u32(a.angle_mode) else {
            trap()
        };
        let (scale, sin_scale) = (a.cs_scale, a.cs_scale * a.sin_sign);
        unrolled(pairs, |k| {
            // SAFETY: j0 + k < half, the promised length of inv_freq.
            let f = unsafe { *a.inv_freq.add(j0 + k) };
            let (c, s) = math::rope_cos_sin_mode(pos, f, mode);
            cos[k] = c * scale;
            sin[k] = s * sin_scale;
        });
    }
    (cos, sin)
}

/// An item's frequencies loaded before its position ([`preload_frequencies`]): `Some` where
/// sin/cos are computed from one position for the whole item (every position kind but
/// multi-axis), else `None` (tables, or each pair's own axis).
pub(crate) type Preloaded<const L: usize> = Option<[f64; L]>;

/// Loads this item's frequencies `inv_freq[j0..j0 + pairs]` where sin/cos are computed from one
/// position, for a kernel to issue before the position's load: issued after it, they waited
/// for it (the compiler placed the position's conversion first), and their latency followed
/// the position's. [`cos_sin_preloaded`] takes them.
///
/// # Safety
/// `j0 + pairs <= half`, the promised length of `inv_freq` (for computed sources).
#[inline(always)]
pub(crate) unsafe fn preload_frequencies<T, S: Source, const L: usize>(
    a: &Args<T>,
    j0: usize,
    pairs: usize,
) -> Preloaded<L> {
    if S::TABLE || a.position_code >= PositionCode::MultiAxisI32 as u32 {
        return None;
    }
    let mut f = [0.0f64; L];
    // SAFETY: j0 + k < half, the caller's promise.
    unrolled(pairs, |k| f[k] = unsafe { *a.inv_freq.add(j0 + k) });
    Some(f)
}

/// [`cos_sin`] with the frequencies [`preload_frequencies`] loaded: in-kernel cos and sin of
/// `pos * f[k]`, scaled by the attention factor and sin signed for the direction, or
/// [`cos_sin`] itself where nothing was preloaded. ([`cos_sin_read`] keeps its own loop, loading
/// each frequency where it is used: the kernels that inline it are allocated at a register cap
/// that the same code reordered does not keep to.)
///
/// # Safety
/// As [`cos_sin`].
#[inline(always)]
pub(crate) unsafe fn cos_sin_preloaded<T: Elem, S: Source, const L: usize>(
    a: &Args<T>,
    pos: i64,
    (j0, pairs): (usize, usize),
    freqs: &Preloaded<L>,
) -> ([f32; L], [f32; L]) {
    let (Some(f), Some(mode)) = (freqs, math::AngleMode::from_u32(a.angle_mode)) else {
        // SAFETY: the caller's promises.
        return unsafe { cos_sin::<T, S, L>(a, pos, j0, pairs) };
    };
    let mut cos = [0.0f32; L];
    let mut sin = [0.0f32; L];
    let (scale, sin_scale) = (a.cs_scale, a.cs_scale * a.sin_sign);
    unrolled(pairs, |k| {
        let (c, s) = math::rope_cos_sin_mode(pos, f[k], mode);
        cos[k] = c * scale;
        sin[k] = s * sin_scale;
    });
    (cos, sin)
}

/// Row `pos`'s entries `j0..j0 + pairs` of tables of `E`, widened, sin times `sin_sign`; NaN
/// for a position outside the tables, which are never read outside their rows.
///
/// # Safety
/// As [`cos_sin_read`], with tables of `E`.
#[inline(always)]
unsafe fn table_row<T, E: Elem, R: TableRead, const L: usize>(
    a: &Args<T>,
    pos: i64,
    j0: usize,
    pairs: usize,
) -> ([f32; L], [f32; L]) {
    if R::PLANNED {
        // SAFETY: j0 + pairs <= half; the table promises and the host's plan.
        return unsafe { PlannedTable::read::<T, E, L>(a, pos, j0, pairs) };
    }
    if pos < 0 || (pos as u64) >= a.table_rows {
        // A position outside the table: documented NaN outputs, never a read outside it.
        return ([f32::NAN; L], [f32::NAN; L]);
    }
    let (mut cos, mut sin) = ([0.0f32; L], [0.0f32; L]);
    let row = pos as usize * a.table_stride as usize + j0;
    // SAFETY: pos < table_rows and j0 + pairs <= half <= table_stride, so the entries are
    // inside the tables' promised rows.
    unsafe {
        let (c, s) = (a.cos.cast::<E>().add(row), a.sin.cast::<E>().add(row));
        if table_vectors::<E>(a, pairs) {
            // Aligned: the item's entries of each table with one access.
            (cos, sin) = (load_pairs::<E, L>(c, pairs), load_pairs::<E, L>(s, pairs));
        } else {
            unrolled(pairs, |k| {
                cos[k] = load_evict_last::<E, 1>(c.add(k))[0].to_f32();
                sin[k] = load_evict_last::<E, 1>(s.add(k))[0].to_f32();
            });
        }
    }
    unrolled(pairs, |k| sin[k] *= a.sin_sign);
    (cos, sin)
}

/// Entry `at` of both tables of `E`, widened.
///
/// # Safety
/// `at` lies inside both tables, of `E`.
#[inline(always)]
unsafe fn table_entry<T, E: Elem>(a: &Args<T>, at: usize) -> (f32, f32) {
    // SAFETY: the caller's promise.
    unsafe {
        (
            load_evict_last::<E, 1>(a.cos.cast::<E>().add(at))[0].to_f32(),
            load_evict_last::<E, 1>(a.sin.cast::<E>().add(at))[0].to_f32(),
        )
    }
}

/// How [`cos_sin_read`] reads a row of the cos and sin tables.
pub(crate) trait TableRead {
    /// `true` where the host planned the launch for [`PlannedTable`]'s reads.
    const PLANNED: bool;
}

/// Any table: 64-bit row offsets, the vector reads' alignment tested per launch.
pub(crate) struct AnyTable;
impl TableRead for AnyTable {
    const PLANNED: bool = false;
}

/// Tables of a launch the host planned for these reads ([`crate::abi::planned_table_fits`]):
/// each table spans fewer than 2^32 elements, and where an item's entries make a vector of 4,
/// 8 or 16 bytes, both tables and their row stride are aligned to it. So row offsets are 32-bit
/// and the alignment needs no test; both vector loads sit in one branch, their words starting
/// as NaN and widened after it: no 64-bit multiply or alignment test, four moves of NaN words
/// rather than eight of `f32`s, one range test and one branch instead of two: fewer
/// instructions per thread, and slightly faster launches at prefill and decode
/// (docs/perf/decisions.md).
pub(crate) struct PlannedTable;
impl TableRead for PlannedTable {
    const PLANNED: bool = true;
}
impl PlannedTable {
    /// Row `pos`'s entries `j0..j0 + pairs` of both tables widened, sin times `sin_sign`; NaN
    /// for a position outside the tables.
    ///
    /// # Safety
    /// `j0 + pairs <= half <= table_stride`; the tables hold `table_rows` rows of
    /// `table_stride` `E`; [`crate::abi::planned_table_fits`].
    #[inline(always)]
    unsafe fn read<T, E: Elem, const L: usize>(
        a: &Args<T>,
        pos: i64,
        j0: usize,
        pairs: usize,
    ) -> ([f32; L], [f32; L]) {
        // A negative position wraps above table_rows (fewer than 2^32 rows).
        let inside = (pos as u64) < a.table_rows;
        // Below 2^32 when inside: each table spans fewer than 2^32 elements.
        let row = (pos as u32)
            .wrapping_mul(a.table_stride as u32)
            .wrapping_add(j0 as u32) as usize;
        let (pc, ps) = (
            a.cos.cast::<E>().wrapping_add(row),
            a.sin.cast::<E>().wrapping_add(row),
        );
        let bytes = pairs * size_of::<E>();
        if !planned_table_vectors(pairs as u64, size_of::<E>() as u64) || L * size_of::<E>() > 32 {
            let (mut cos, mut sin) = ([f32::NAN; L], [f32::NAN; L]);
            if inside {
                // SAFETY: pos < table_rows and j0 + pairs <= half <= table_stride, so the
                // entries are inside the tables.
                unrolled(pairs, |k| unsafe {
                    cos[k] = load_evict_last::<E, 1>(pc.add(k))[0].to_f32();
                    sin[k] = load_evict_last::<E, 1>(ps.add(k))[0].to_f32();
                });
            }
            unrolled(pairs, |k| sin[k] *= a.sin_sign);
            return (cos, sin);
        }
        let nan = [E::from_f32(f32::NAN); 4];
        // SAFETY: 4 `E`s hold at least 4 bytes.
        let nan_word = unsafe { nan.as_ptr().cast::<u32>().read_unaligned() };
        let (mut c, mut s) = ([nan_word; 8], [nan_word; 8]);
        if inside {
            // SAFETY: pos < table_rows and j0 + pairs <= half <= table_stride, so `row`
            // and the `bytes` after it are inside the tables, aligned to `bytes` (the promise).
            unsafe { (c, s) = (load_words(pc.cast(), bytes), load_words(ps.cast(), bytes)) };
        }
        // SAFETY: L `E`s fit the 32 bytes of each array (tested above).
        let (cos, mut sin) = unsafe {
            (
                E::widen(c.as_ptr().cast::<[E; L]>().read_unaligned()),
                E::widen(s.as_ptr().cast::<[E; L]>().read_unaligned()),
            )
        };
        unrolled(pairs, |k| sin[k] *= a.sin_sign);
        (cos, sin)
    }
}

/// The `bytes` (4, 8 or 16) at `p` as the first of eight words, with one access
/// ([`load_evict_last`]); the other words are zero.
///
/// # Safety
/// `p` points at `bytes` readable bytes aligned to `bytes`.
#[inline(always)]
unsafe fn load_words(p: *const u32, bytes: usize) -> [u32; 8] {
    let mut w = [0u32; 8];
    // SAFETY (each arm): the caller's promise, for that many bytes.
    unsafe {
        match bytes {
            16 => [w[0], w[1], w[2], w[3]] = load_evict_last::<u32, 4>(p),
            8 => [w[0], w[1]] = load_evict_last::<u32, 2>(p),
            _ => [w[0]] = load_evict_last::<u32, 1>(p),
        }
    }
    w
}

/// The axis of every pair `j0..j0 + pairs` of a multi-axis map, clamped, when they all share
/// one; `None` otherwise.
///
/// # Safety
/// `pos_aux` holds at least `j0 + pairs` `u8`.
#[inline(always)]
unsafe fn item_axis<T>(a: &Args<T>, j0: usize, pairs: usize) -> Option<u32> {
    // SAFETY: j0 + k < j0 + pairs, inside the map (the caller's promise).
    let axis = |k: usize| clamped_axis(unsafe { *a.pos_aux.add(j0 + k) }, a.pos_count);
    let first = axis(0);
    let mut same = true;
    unrolled(pairs, |k| same &= axis(k) == first);
    same.then_some(first)
}

/// Token `t`'s position on `axis` (`i64` when `wide`, else `i32`).
///
/// # Safety
/// `axis < pos_count`, `t < tokens`; `pos_ptr` holds `pos_count` rows of `tokens` integers of
/// that type.
#[inline(always)]
unsafe fn axis_position<T>(a: &Args<T>, wide: bool, axis: u32, t: u64) -> i64 {
    let i = (u64::from(axis) * a.tokens + t) as usize;
    // SAFETY: axis < pos_count and t < tokens: inside the pos_count * tokens positions.
    unsafe {
        if wide {
            *a.pos_ptr.cast::<i64>().add(i)
        } else {
            *a.pos_ptr.cast::<i32>().add(i) as i64
        }
    }
}

/// The position of pair `j` of token `t` under multi-axis positions (`t < tokens`, `j <
/// half`): the token's positions on its first four axes are loaded together with the pair's
/// entry of the map, one memory latency where the axis and then its position are two in a row
/// (as [`cos_sin_axes`] reads them). For kernels with registers to spare: in the kernels
/// capped at 64 registers the four positions made ptxas spill.
///
/// # Safety
/// `t < tokens`, `j < half`; `pos_ptr` holds `pos_count >= 1` rows of `tokens` integers of the
/// code's type and `pos_aux` `half` `u8`.
#[inline(always)]
pub(crate) unsafe fn pair_axis_position<T>(a: &Args<T>, t: u64, j: usize) -> i64 {
    let wide = a.position_code == PositionCode::MultiAxisI64 as u32;
    // (Four named values, not an array: an array indexed by the axis went to local memory.)
    let on = |r: u32| {
        if r < a.pos_count {
            // SAFETY: r < pos_count and t < tokens: inside the pos_count * tokens positions.
            unsafe { axis_position(a, wide, r, t) }
        } else {
            0
        }
    };
    let (p0, p1, p2, p3) = (on(0), on(1), on(2), on(3));
    // SAFETY: j < half, the map's length.
    match clamped_axis(unsafe { *a.pos_aux.add(j) }, a.pos_count) {
        0 => p0,
        1 => p1,
        2 => p2,
        3 => p3,
        // SAFETY: the clamped axis is below pos_count and t < tokens.
        axis => unsafe { axis_position(a, wide, axis, t) },
    }
}

/// [`cos_sin`] for multi-axis positions: pair `j0 + k` of token `t` rotates by the position
/// of its axis, `positions[axis * tokens + t]` with `axis = min(axes[j0 + k], pos_count - 1)`.
/// The map and the positions are device data: the clamp keeps any map value inside the
/// `pos_count` rows, and a position outside a table gives that pair NaN, as in [`cos_sin`].
/// Pairs whose axes hold equal positions get exactly what the one-position path computes.
///
/// # Safety
/// `t < tokens`; `pos_ptr` holds `pos_count >= 1` rows of `tokens` integers of the code's type
/// and `pos_aux` `half` `u8`; `j0 + pairs <= half`; the table or `inv_freq` promises.
#[inline(always)]
unsafe fn cos_sin_axes<T: Elem, S: Source, const L: usize>(
    a: &Args<T>,
    t: u64,
    j0: usize,
    pairs: usize,
) -> ([f32; L], [f32; L]) {
    let mut cos = [0.0f32; L];
    let mut sin = [0.0f32; L];
    let wide = a.position_code == PositionCode::MultiAxisI64 as u32;
    let mode = math::AngleMode::from_u32(a.angle_mode);
    unrolled(pairs, |k| {
        // SAFETY: j0 + k < half, the map's length; the clamped axis is below pos_count and
        // t < tokens, so the index lies inside the pos_count * tokens positions.
        let pos = unsafe {
            let axis = clamped_axis(*a.pos_aux.add(j0 + k), a.pos_count) as u64;
            let i = (axis * a.tokens + t) as usize;
            if wide {
                *a.pos_ptr.cast::<i64>().add(i)
            } else {
                *a.pos_ptr.cast::<i32>().add(i) as i64
            }
        };
        if S::TABLE {
            if pos >= 0 && (pos as u64) < a.table_rows {
                let at = pos as usize * a.table_stride as usize + j0 + k;
                // SAFETY: pos < table_rows and j0 + k < half <= table_stride, in tables of the
                // type `table_elem` gives.
                let (c, s) = unsafe {
                    if a.f32_tables() {
                        table_entry::<T, f32>(a, at)
                    } else {
                        table_entry::<T, T>(a, at)
                    }
                };
                cos[k] = c;
                sin[k] = s * a.sin_sign;
            } else {
                cos[k] = f32::NAN;
                sin[k] = f32::NAN;
            }
        } else {
            let Some(mode) = mode else { trap() };
            // SAFETY: j0 + k < half, the promised length of inv_freq.
            let f = unsafe { *a.inv_freq.add(j0 + k) };
            let (c, s) = math::rope_cos_sin_mode(pos, f, mode);
            cos[k] = c * a.cs_scale;
            sin[k] = s * (a.cs_scale * a.sin_sign);
        }
    });
    (cos, sin)
}

/// Whether an item's `pairs` table entries (starting at a multiple of `pairs` in a row) can be
/// read with one access per table: `pairs * size_of::<E>()` is 4, 8 or 16 bytes and both tables
/// and their row stride are aligned to it. The same for every thread of a launch.
#[inline(always)]
fn table_vectors<E: Elem>(a: &Args<impl Sized>, pairs: usize) -> bool {
    let bytes = pairs * size_of::<E>();
    matches!(bytes, 4 | 8 | 16)
        && (a.cos as usize | a.sin as usize | (a.table_stride as usize * size_of::<E>()))
            .is_multiple_of(bytes)
}

/// `pairs` (1, 2, 4 or 8) consecutive table entries widened to `f32`, read with one access
/// ([`load_evict_last`]).
///
/// # Safety
/// `p` points at `pairs` readable entries aligned to their total size (see [`table_vectors`]).
#[inline(always)]
unsafe fn load_pairs<E: Elem, const L: usize>(p: *const E, pairs: usize) -> [f32; L] {
    let mut out = [0.0f32; L];
    // SAFETY (each arm): the caller's promise, for that many entries.
    unsafe {
        match pairs {
            8 => {
                let v = load_evict_last::<E, 8>(p);
                unrolled(8, |k| out[k] = v[k].to_f32());
            }
            4 => {
                let v = load_evict_last::<E, 4>(p);
                unrolled(4, |k| out[k] = v[k].to_f32());
            }
            2 => {
                let v = load_evict_last::<E, 2>(p);
                unrolled(2, |k| out[k] = v[k].to_f32());
            }
            _ => out[0] = load_evict_last::<E, 1>(p)[0].to_f32(),
        }
    }
    out
}

/// Computed sin/cos. In place, an item with several heads first requests its elements of its
/// first heads, up to [`PREFETCH_BYTES`], into L2 ([`prefetch_l2`]), so that the memory system
/// fetches them while the `f64` arithmetic runs; then the heads are rotated, their loads mostly
/// hitting L2. A prefetch holds no register, where a load issued ahead of the arithmetic holds
/// its result through it (at the 48-register limit ptxas moved such loads after the
/// arithmetic). Out of place, where the outputs take L2 lines of their own, prefetching was
/// slower than none (docs/perf/decisions.md). An item with one head loads it ahead instead (see
/// [`rotate_heads`]).
///
/// # Safety
/// `last <= q.heads + k.heads`; `tok` from [`token_bases`]; `j0 + pairs <= half`; the
/// `inv_freq` promises.
#[inline(always)]
unsafe fn prefetch_then_rotate<T: Elem, P: Pairing, S: Source, const L: usize>(
    a: &Args<T>,
    tok: &TokenBases<T>,
    (first, last): (usize, usize),
    (j0, half): (usize, usize),
    (pos, wide): (i64, bool),
    in_place: bool,
) {
    let head_bytes = L * size_of::<T>() * if P::NEOX { 2 } else { 1 };
    let ahead = if in_place {
        PREFETCH_BYTES / head_bytes
    } else {
        0
    };
    let ahead = if loads_before_cos_sin(wide, (first, last)) {
        0
    } else {
        ahead
    };
    for h in first..last.min(first + ahead) {
        // SAFETY: head h exists.
        let x = unsafe { head(a, tok, h).0 };
        // The addresses `load_head` reads next (a prefetch of any address is harmless).
        let (first, second) = vector_offsets::<P>(j0, half);
        prefetch_l2(x.wrapping_add(first));
        if P::NEOX {
            prefetch_l2(x.wrapping_add(second));
        }
    }
    // SAFETY: the caller's promises.
    unsafe {
        rotate_heads::<T, P, S, L>(a, tok, (first, last), (j0, half), (pos, wide));
    }
}

/// Bytes per thread that [`prefetch_then_rotate`] requests ahead of the arithmetic: 8 heads of
/// 16-bit NeoX pairs or interleaved elements, 4 of `f32` NeoX pairs. With every thread of an
/// H200 resident that is at most 21 MiB in flight, well inside its 50 MiB L2.
const PREFETCH_BYTES: usize = 128;

/// The kernel body for `L` elements per access; `wide` in the wide kernels (see
/// [`rotate_heads`]).
///
/// # Safety
/// The promises of the entry points (see [`rope_neox_table_f32`]).
#[inline(always)]
unsafe fn body<T: Elem, P: Pairing, S: Source, const L: usize>(a: &Args<T>, wide: bool) {
    let pairs = if P::NEOX { L } else { L / 2 };
    let total = a.tokens * a.groups.divisor.get() as u64;
    let step = grid_dim_x() as u64 * block_dim_x() as u64;
    let heads = head_range(a);
    let half = a.half as usize;
    // Every tensor rotated in place (outputs of distinct tensors never overlap inputs).
    let in_place =
        a.q.x == a.q.out.cast_const() && (a.k.heads == 0 || a.k.x == a.k.out.cast_const());
    let mut idx = block_idx_x() as u64 * block_dim_x() as u64 + thread_idx_x() as u64;
    while idx < total {
        let (token, group) = a.groups.div_rem(idx);
        let group = group as u32;
        let (b, s) = a.seq.div_rem(token);
        if group < a.rot_groups {
            let j0 = group as usize * pairs;
            // SAFETY: (b, s) is a token of the batch; the position arrays are promised.
            let pos = unsafe { position(a, b, s, group) };
            // SAFETY: b < batch, s < seq.
            let tok = unsafe { token_bases(a, (b, s)) };
            // SAFETY: j0 + pairs <= half; the heads exist; the table / inv_freq promises.
            unsafe {
                if S::TABLE {
                    rotate_heads::<T, P, S, L>(a, &tok, heads, (j0, half), (pos, wide))
                } else {
                    prefetch_then_rotate::<T, P, S, L>(
                        a,
                        &tok,
                        heads,
                        (j0, half),
                        (pos, wide),
                        in_place,
                    )
                }
            }
        } else {
            // The pass-through elements 0..rotary_offset and rotary_offset +
            // rotary_dim..head_dim, relative to the pointers, which start at rotary_offset.
            let e0 = pass_through_start(
                group - a.rot_groups,
                L as u32,
                a.rotary_offset,
                a.rotary_dim,
            );
            // SAFETY: as above; the pass-through groups cover the head_dim - rotary_dim
            // elements outside the rotated slice exactly, so e0 + rotary_offset + L <= head_dim.
            unsafe { copy_heads::<T, L>(a, (b, s), heads, e0) };
        }
        idx += step;
    }
}

/// The token `(b, s)`'s first head in each tensor's input and output.
///
/// # Safety
/// `b < batch`, `s < seq` of the promised layouts.
#[inline(always)]
unsafe fn token_bases<T>(a: &Args<T>, (b, s): (u64, u64)) -> TokenBases<T> {
    let base = |t: &TensorArgs<T>| {
        // SAFETY: the offsets address the token inside the layouts the caller promises.
        unsafe {
            (
                t.x.add((b * t.x_strides[0] + s * t.x_strides[1]) as usize),
                t.out
                    .add((b * t.out_strides[0] + s * t.out_strides[1]) as usize),
            )
        }
    };
    TokenBases {
        q: base(&a.q),
        k: base(&a.k),
    }
}

/// Whether an item loads its heads `first..last` before finding cos/sin ([`rotate_heads`]):
/// one head, in the `wide` kernels.
#[inline(always)]
fn loads_before_cos_sin(wide: bool, (first, last): (usize, usize)) -> bool {
    wide && last == first + 1
}

/// Rotates heads `first..last` (of q's and k's heads together) of token `(b, s)` by the cos/sin
/// of position `pos` ([`cos_sin`]). In the `wide` kernels, an item with one head (small token
/// counts, where the grid gives every head its own block row) issues that head's loads before
/// [`cos_sin`] runs, so that their latency overlaps the position and table reads or the
/// arithmetic: there that chain is the whole launch. Items with more heads find cos/sin first:
/// holding their first block's loads through it was slower at prefill (fewer loads in flight
/// per round, or spills; docs/perf/decisions.md), and their later blocks overlap one another's
/// latency. (The narrow kernels, with several bodies, spilled with the one-head path.) Launches
/// that copy no pass-through elements take the one-head kernels ([`one_head_body`]) instead;
/// here the path serves those that do.
///
/// # Safety
/// `b < batch`, `s < seq`, `last <= q.heads + k.heads`; the promises of [`load_head`] and of
/// [`cos_sin`].
#[inline(always)]
unsafe fn rotate_heads<T: Elem, P: Pairing, S: Source, const L: usize>(
    a: &Args<T>,
    tok: &TokenBases<T>,
    (first, last): (usize, usize),
    (j0, half): (usize, usize),
    (pos, wide): (i64, bool),
) {
    let pairs = if P::NEOX { L } else { L / 2 };
    if loads_before_cos_sin(wide, (first, last)) {
        // SAFETY: head `first` exists; j0 + pairs <= half; the caller's promises.
        unsafe {
            let v = load_head::<T, P, L>(head(a, tok, first).0, j0, half);
            let (cos, sin) = cos_sin::<T, S, L>(a, pos, j0, pairs);
            rotate_store_head::<T, P, L>(head(a, tok, first).1, j0, half, v, &cos, &sin);
        }
        return;
    }
    // SAFETY: j0 + pairs <= half; the caller's promises.
    let (cos, sin) = unsafe { cos_sin::<T, S, L>(a, pos, j0, pairs) };
    let (cos, sin) = (&cos, &sin);
    let j0 = (j0, half);
    let mut h = first;
    while h + P::HEADS_UNROLL <= last {
        // SAFETY: h + HEADS_UNROLL <= last. (A const generic cannot name `P::HEADS_UNROLL`
        // directly on stable Rust, hence the two arms.)
        unsafe {
            if P::HEADS_UNROLL == 4 {
                heads_block::<T, P, L, 4>(a, tok, h, j0, (cos, sin))
            } else {
                heads_block::<T, P, L, 2>(a, tok, h, j0, (cos, sin))
            }
        };
        h += P::HEADS_UNROLL;
    }
    if P::HEADS_UNROLL > 2 && h + 2 <= last {
        // SAFETY: h + 2 <= last. A remainder of two or three heads takes two rounds, not three.
        unsafe { heads_block::<T, P, L, 2>(a, tok, h, j0, (cos, sin)) };
        h += 2;
    }
    if h < last {
        // SAFETY: h < last, and at most one head is left.
        unsafe { heads_block::<T, P, L, 1>(a, tok, h, j0, (cos, sin)) };
    }
}

/// Copies elements `e0..e0 + L` (relative to the tensors' pointers, which start
/// `rotary_offset` elements into each head) of heads `first..last` (of q's and k's heads
/// together) of token `(b, s)` from input to output.
///
/// # Safety
/// `b < batch`, `s < seq`, `last <= q.heads + k.heads`,
/// `0 <= rotary_offset + e0` and `rotary_offset + e0 + L <= head_dim`, aligned to `L` elements.
#[inline(always)]
unsafe fn copy_heads<T: Elem, const L: usize>(
    a: &Args<T>,
    token: (u64, u64),
    (first, last): (usize, usize),
    e0: isize,
) {
    // SAFETY: the caller's promise on (b, s).
    let tok = unsafe { token_bases(a, token) };
    for h in first..last {
        // SAFETY: head h exists, elements e0..e0+L inside it, aligned: the caller's promise.
        unsafe {
            let (x, out) = head(a, &tok, h);
            access::store::<T, L>(out.offset(e0), access::load::<T, L>(x.offset(e0)));
        }
    }
}

/// The one-head body ([`Mapping::ONE_HEAD`]): this thread's work item `blockIdx.x * blockDim.x +
/// threadIdx.x` (token and rotating group) of head `blockIdx.y` of q's and k's heads together,
/// or nothing past the last item. It finds its position first (its chain, the position and then
/// the table rows or the `f64` arithmetic, is the longest), issues its head's loads, then finds
/// cos/sin while they are in flight. No loop, no head range and no pass-through copy: per thread
/// only the index split, one tensor's addresses and the rotation (at decode, where every head
/// has its own block row, the general body's loop and head bookkeeping were most of the
/// instructions a thread ran).
///
/// Built for sm_90, it takes part in programmatic dependent launch: it waits for the grid before
/// it ([`wait_for_prior_grids`]) before its first global access, so that the host may launch it
/// with the attribute and its launch overlap the end of the previous kernel.
///
/// `COMMON` compiles it for decode's common launch ([`one_head`],
/// [`crate::abi::common_one_head_launch`]): positions are `i64` ids per token
/// (`PositionCode::IdsI64PerRow`), computed angles are `f64` ([`math::AngleMode::Exact`]) and
/// tables hold `T` and fit the planned reads ([`PlannedTable`]: 32-bit row offsets, no
/// alignment test), so neither the position code nor the source's options are read or branched
/// on. `read_ahead` is the launch's `read_ahead` argument (its trigger already issued).
///
/// # Safety
/// The promises of the entry points, and those of [`Mapping::ONE_HEAD`]: `gridDim.y` is
/// `q.heads + k.heads`, there are no pass-through groups (`groups = rot_groups`),
/// `tokens * groups < 2^32`, and every tensor and output spans fewer than 2^32 elements
/// (`(batch - 1) * stride_batch + (seq - 1) * stride_seq + (heads - 1) * stride_head +
/// head_dim`); with `COMMON`, the launch is what it assumes.
#[inline(always)]
unsafe fn one_head_body<T: Elem, P: Pairing, S: Source, const L: usize, const COMMON: bool>(
    a: &Args<T>,
    read_ahead: bool,
) {
    let pairs = if P::NEOX { L } else { L / 2 };
    let idx = block_idx_x() * block_dim_x() + thread_idx_x();
    // The table kernels' common copy counts the items in 32 bits (fewer than 2^32: the
    // promise); the computed copy keeps the 64-bit count, the faster schedule there
    // (docs/perf/decisions.md).
    let outside = if COMMON && S::TABLE {
        idx >= (a.tokens as u32).wrapping_mul(a.rot_groups)
    } else {
        u64::from(idx) >= a.tokens * u64::from(a.rot_groups)
    };
    if outside {
        return;
    }
    let (token, group) = a.groups.div_rem_u32(idx);
    let (b32, s32) = a.seq.div_rem_u32(token);
    let (b, s) = (u64::from(b32), u64::from(s32));
    let (j0, half) = (group as usize * pairs, a.half as usize);
    // Reading ahead ([`one_head`] let the next grid start), this one reads what the grid before
    // it does not write (the host's promise: positions, frequencies, tables) before waiting for
    // it; the head, which it may write, only after. Otherwise every read follows the wait.
    if !read_ahead {
        wait_for_prior_grids();
    }
    // SAFETY: j0 + pairs <= half, the promised length of inv_freq.
    let freqs = unsafe { preload_frequencies::<T, S, L>(a, j0, pairs) };
    // SAFETY: (b, s) is a token of the batch (idx < tokens * groups); the position arrays are
    // promised (`COMMON`: `batch * seq` `i64` ids, entry `b * seq + s` = `token`).
    let pos = unsafe {
        if COMMON {
            *a.pos_ptr.cast::<i64>().add(token as usize)
        } else {
            position(a, b, s, group)
        }
    };
    let h = block_idx_y();
    let (t, h) = if h < a.q.heads {
        (&a.q, h)
    } else {
        (&a.k, h - a.q.heads)
    };
    let at = |strides: &[u64; 3]| offset_u32(*strides, (b32, s32), h) as usize;
    // SAFETY: head h of that tensor exists (gridDim.y covers q's and k's heads), j0 + pairs <=
    // half; the promises of `load_head` and `cos_sin`.
    unsafe {
        let (x, out) = (t.x.add(at(&t.x_strides)), t.out.add(at(&t.out_strides)));
        // The head's loads are in flight while cos/sin are read or computed, unless they must
        // wait for the grid before.
        let mut v = if read_ahead {
            [[T::ZERO; L]; 2]
        } else {
            load_head::<T, P, L>(x, j0, half)
        };
        let (cos, sin) = match (COMMON, &freqs) {
            (true, Some(f)) => cos_sin_exact::<T, L>(a, pos, pairs, f),
            // Tables of `T` that fit the planned reads (the promise of `COMMON`).
            (true, None) if S::TABLE => PlannedTable::read::<T, T, L>(a, pos, j0, pairs),
            _ => cos_sin_preloaded::<T, S, L>(a, pos, (j0, pairs), &freqs),
        };
        if read_ahead {
            wait_for_prior_grids();
            v = load_head::<T, P, L>(x, j0, half);
        }
        rotate_store_head::<T, P, L>(out, j0, half, v, &cos, &sin);
    }
}

/// In-kernel cos and sin of `pos * f[k]` with `f64` angles ([`math::AngleMode::Exact`]),
/// scaled by the attention factor and sin signed for the direction: [`cos_sin_preloaded`] for a
/// launch known to take that mode.
#[inline(always)]
fn cos_sin_exact<T, const L: usize>(
    a: &Args<T>,
    pos: i64,
    pairs: usize,
    f: &[f64; L],
) -> ([f32; L], [f32; L]) {
    let (mut cos, mut sin) = ([0.0f32; L], [0.0f32; L]);
    let (scale, sin_scale) = (a.cs_scale, a.cs_scale * a.sin_sign);
    unrolled(pairs, |k| {
        let (c, s) = math::rope_cos_sin_mode(pos, f[k], math::AngleMode::Exact);
        cos[k] = c * scale;
        sin[k] = s * sin_scale;
    });
    (cos, sin)
}

/// The one-head body for this launch: a copy compiled for decode's common launch (`i64` ids
/// per token, `f64` angles or planned tables of `T`), which the host marks (`common_launch`,
/// [`crate::abi::common_one_head_launch`]) and which reads neither choice's argument again,
/// or the general one. The choice is one uniform branch at the kernel's start, after the
/// trigger of a launch that reads ahead (`read_ahead`, passed on to the body).
///
/// # Safety
/// The promises of `one_head_body`.
#[inline(always)]
unsafe fn one_head<T: Elem, P: Pairing, S: Source, const L: usize>(a: &Args<T>) {
    // Reading ahead, the next grid may start at once: the trigger comes before anything else.
    let read_ahead = a.read_ahead != 0;
    if read_ahead {
        allow_dependent_grids();
    }
    // Table launches are marked by the host (whether the tables fit the planned reads depends
    // on their addresses); computed ones the kernel recognises itself, so that the copy's code
    // knows their position code and angle mode.
    let common = if S::TABLE {
        a.common_launch != 0
    } else {
        a.position_code == PositionCode::IdsI64PerRow as u32
            && a.angle_mode == math::AngleMode::Exact as u32
    };
    // SAFETY: forwarded promises; `COMMON` only where the launch is what it assumes (for tables,
    // the entry points' promise on `common_launch`).
    unsafe {
        if common {
            one_head_body::<T, P, S, L, true>(a, read_ahead)
        } else {
            one_head_body::<T, P, S, L, false>(a, read_ahead)
        }
    }
}

/// The element offset of head `i` of token `(b, s)` at `strides`, in 32 bits, for the one-head
/// kernels (this module's and the fused ones): they run only where every tensor spans fewer
/// than 2^32 elements, so each index times its stride and their sum fit (a dimension of size 1
/// has index 0, whatever its stride).
#[inline(always)]
pub(crate) fn offset_u32(strides: [u64; 3], (b, s): (u32, u32), i: u32) -> u32 {
    b.wrapping_mul(strides[0] as u32)
        .wrapping_add(s.wrapping_mul(strides[1] as u32))
        .wrapping_add(i.wrapping_mul(strides[2] as u32))
}

/// Picks the monomorphized body for the `lanes` argument: the [preferred] body for the
/// wide and one-head kernels, one of the narrower ones for the `_narrow` kernels.
///
/// [preferred]: crate::abi::preferred_lanes
///
/// # Safety
/// The promises of the entry points.
#[inline(always)]
unsafe fn dispatch<T: Elem, P: Pairing, S: Source, const ACCESS: u8>(a: &Args<T>) {
    const WIDE: u8 = Mapping::WIDE.code();
    const NARROW: u8 = Mapping::NARROW.code();
    const ONE_HEAD: u8 = Mapping::ONE_HEAD.code();
    // SAFETY: forwarded promises; `lanes` selects a body whose access width the host checked.
    unsafe {
        match (ACCESS, T::SIZE, a.lanes, P::NEOX) {
            (WIDE, 4, 4, _) => body::<T, P, S, 4>(a, true),
            (WIDE, 2, 8, false) => body::<T, P, S, 8>(a, true),
            (WIDE, 2, 4, true) => body::<T, P, S, 4>(a, true),
            // One-head kernels take the preferred width only: no `lanes` to read.
            (ONE_HEAD, 4, _, _) => one_head::<T, P, S, 4>(a),
            (ONE_HEAD, 2, _, false) => one_head::<T, P, S, 8>(a),
            (ONE_HEAD, 2, _, true) => one_head::<T, P, S, 4>(a),
            (NARROW, 2, 4, false) => body::<T, P, S, 4>(a, false),
            (NARROW, _, 2, _) => body::<T, P, S, 2>(a, false),
            (NARROW, _, 1, true) => body::<T, P, S, 1>(a, false),
            // The narrow accesses of the wide kernels without a narrow entry point
            // (`KernelName::narrow_in_wide`: f32 tensors with tables).
            (WIDE, 4, 2, _) if S::TABLE => body::<T, P, S, 2>(a, false),
            (WIDE, 4, 1, true) if S::TABLE => body::<T, P, S, 1>(a, false),
            _ => trap(),
        }
    }
}

/// The entry points' parameters, one field per entry of [`crate::plain_kernel_params!`].
macro_rules! params_struct {
    ({} $($param:ident: $kind:ident,)*) => {
        /// The parameters of every RoPE entry point, as `crate::plain_kernel_params!` lists
        /// them.
        pub(crate) struct Params<T> {
            $(pub(crate) $param: crate::device_param_type!($kind, T),)*
        }
    };
}
crate::plain_kernel_params!(params_struct {});

impl<T> Args<T> {
    /// Gathers the entry point's parameters for the generic body.
    #[inline(always)]
    pub(crate) fn new(p: Params<T>) -> Self {
        Args {
            q: TensorArgs {
                x: p.x0,
                out: p.out0,
                heads: p.heads0,
                x_strides: [p.x0_stride_batch, p.x0_stride_seq, p.x0_stride_head],
                out_strides: [p.out0_stride_batch, p.out0_stride_seq, p.out0_stride_head],
            },
            k: TensorArgs {
                x: p.x1,
                out: p.out1,
                heads: p.heads1,
                x_strides: [p.x1_stride_batch, p.x1_stride_seq, p.x1_stride_head],
                out_strides: [p.out1_stride_batch, p.out1_stride_seq, p.out1_stride_head],
            },
            tokens: p.tokens,
            seq: Divisor {
                divisor: p.seq,
                magic: p.seq_magic,
                shift: p.seq_shift,
            },
            heads_per_chunk: p.heads_per_chunk,
            groups: Divisor {
                divisor: p.groups,
                magic: p.groups_magic,
                shift: p.groups_shift,
            },
            rot_groups: p.rot_groups,
            half: p.half,
            rotary_dim: p.rotary_dim,
            rotary_offset: p.rotary_offset,
            lanes: p.lanes,
            cos: p.cos,
            sin: p.sin,
            table_stride: p.table_stride,
            table_rows: p.table_rows,
            table_elem: p.table_elem,
            inv_freq: p.inv_freq,
            angle_mode: p.angle_mode,
            cs_scale: p.cs_scale,
            position_code: p.position_code,
            pos_ptr: p.pos_ptr,
            pos_aux: p.pos_aux,
            pos_count: p.pos_count,
            pos_base: p.pos_base,
            sin_sign: p.sin_sign,
            read_ahead: p.read_ahead,
            common_launch: p.common_launch,
        }
    }
}

/// Defines one exported entry point per (pairing, source, dtype), wide, narrow (where the list
/// names one) and one-head; each rotates forward or backward as its `sin_sign` says.
macro_rules! rope_kernel {
    (
        $($wide:ident, [$($narrow:ident)?], $one_head:ident:
            $pairing:ident, $source:ident, $dt:ident, $t:ty;)*
    ) => {$(
        crate::plain_kernel_params!(rope_entry { $wide, WIDE: $pairing, $source, $t });
        $(crate::plain_kernel_params!(rope_entry { $narrow, NARROW: $pairing, $source, $t });)?
        crate::plain_kernel_params!(rope_entry { $one_head, ONE_HEAD: $pairing, $source, $t });
    )*};
}

/// One entry point with the parameter list of [`crate::plain_kernel_params!`].
macro_rules! rope_entry {
    (
        { $name:ident, $mapping:ident: $pairing:ident, $source:ident, $t:ty }
        $($param:ident: $kind:ident,)*
    ) => {
        /// One RoPE entry point; its name says the pairing, the sin/cos source, the element
        /// type and whether accesses are narrower than the preferred width (`_narrow`) or each
        /// thread rotates one item of its block row's one head (`_one_head`, with the further
        /// promises of `one_head_body`); `sin_sign` gives the direction. See the module
        /// documentation for the formula and mapping, and `plain_kernel_params!` in `abi.rs`
        /// for the parameters.
        ///
        /// # Safety
        /// - each `xn`/`outn`, less `rotary_offset` elements, addresses every element of its
        ///   layout, with `rotary_offset + rotary_dim <= head_dim` and the pass-through groups
        ///   covering the other `head_dim - rotary_dim` elements; distinct heads' element
        ///   ranges do not overlap, and `outn` equals `xn` or overlaps no input;
        /// - every tensor pointer and stride is aligned to `lanes` elements, and `lanes`
        ///   divides the work as `groups` says;
        /// - for tables, `cos` and `sin` hold `table_rows` rows of `table_stride >= half`
        ///   elements; for computed sin/cos, `inv_freq` holds `half` `f64`;
        /// - `pos_ptr` and `pos_aux` hold the arrays their [`PositionCode`] names (their values
        ///   may be anything);
        /// - `seq_magic`, `seq_shift`, `groups_magic` and `groups_shift` are those
        ///   [`Divisor::new`] computes for `seq` and `groups`.
        /// - `common_launch` is non-zero only for a one-head launch that
        ///   [`crate::abi::common_one_head_launch`] accepts.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            $($param: crate::device_param_type!($kind, $t),)*
        ) {
            let args = Args::new(Params::<$t> { $($param,)* });
            // SAFETY: the caller's promises, listed above, are those `dispatch` needs.
            unsafe { dispatch::<$t, $pairing, $source<$t>, { Mapping::$mapping.code() }>(&args) }
        }
    };
}

for_each_kernel!(rope_kernel);
