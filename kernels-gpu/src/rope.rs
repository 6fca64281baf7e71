//! The RoPE kernel family: forward and backward rotation, interleaved (GPT-J) and rotate-half
//! (GPT-NeoX) pairing, sin/cos from tables or from `theta`, implicit or explicit positions.
//!
//! # Formula
//! For pair `i` of a head at position `p`, with `c = cos(p * inv_freq_i)`, `s = sin(...)`:
//! forward `(a, b) -> (a c - b s, b c + a s)`; backward (the transposed rotation)
//! `(a, b) -> (a c + b s, b c - a s)`. Interleaved pairs are `(x[2i], x[2i + 1])`; NeoX pairs
//! are `(x[i], x[i + half])`, where `half = rotary_dim / 2`.
//!
//! # Layout
//! `x` and `out` hold `[batch, seq, heads, head_dim]` elements at element strides
//! `(stride_batch, stride_seq, stride_head, 1)`; `out` may equal `x` (in place).
//!
//! # Thread mapping
//! A work item is one (token, group of pairs): `groups = half / pairs_per_thread` items per
//! token, `tokens * groups` in all, walked by a grid-stride loop over `blockIdx.x`, so
//! consecutive threads touch consecutive addresses of a head. Each item computes or loads the
//! sin/cos of its pairs once and applies them to the heads
//! `blockIdx.y * heads_per_chunk .. min(+heads_per_chunk, heads)`, four heads at a time with all
//! loads issued before the stores. Every access moves `lanes` elements at once (16 bytes for
//! `f32` when alignment allows).

use core::num::{NonZeroU32, NonZeroU64};

use crate::abi::PositionCode;
use crate::elem::{self, Elem};
use crate::intrinsics::{block_dim_x, block_idx_x, block_idx_y, grid_dim_x, thread_idx_x, trap};
use crate::math;

/// Which elements form a pair; see the module documentation.
trait Pairing {
    /// `true` for rotate-half pairs `(x[i], x[i + half])`, `false` for `(x[2i], x[2i + 1])`.
    const NEOX: bool;
    /// Heads whose loads are issued together before their stores: enough bytes in flight per
    /// thread (64 at 16-byte accesses) without the register cost of more address streams
    /// (NeoX reads two per head; four NeoX heads took 148 registers on sm_90, two take 80).
    /// Either 2 or 4.
    const HEADS_UNROLL: usize;
}

/// GPT-J / RoFormer pairs `(x[2i], x[2i + 1])`.
struct Interleaved;
impl Pairing for Interleaved {
    const NEOX: bool = false;
    const HEADS_UNROLL: usize = 4;
}

/// GPT-NeoX rotate-half pairs `(x[i], x[i + half])`.
struct Neox;
impl Pairing for Neox {
    const NEOX: bool = true;
    const HEADS_UNROLL: usize = 2;
}

/// Where cos/sin come from; see [`crate::abi::SinCosSource`].
trait Source {
    /// `true` for tables, `false` for `cos`/`sin` computed from `inv_freq`.
    const TABLE: bool;
}

/// Tables `cos`, `sin` of `[table_positions, half]`.
struct Table;
impl Source for Table {
    const TABLE: bool = true;
}

/// Computed from `inv_freq` (`half` `f64` values).
struct Theta;
impl Source for Theta {
    const TABLE: bool = false;
}

/// The kernel arguments, gathered so the generic body takes one value.
#[derive(Clone, Copy)]
struct Args<T> {
    x: *const T,
    out: *mut T,
    tokens: u64,
    seq: NonZeroU32,
    heads: u32,
    heads_per_chunk: u32,
    groups: NonZeroU32,
    half: u32,
    lanes: u32,
    x_strides: [u64; 3],
    out_strides: [u64; 3],
    cos: *const T,
    sin: *const T,
    table_positions: u64,
    inv_freq: *const f64,
    positions: u32,
    pos_ptr: *const u8,
    pos_base: i64,
    /// `1.0` forward, `-1.0` backward (the transposed rotation).
    sin_sign: f32,
}

/// The position of token `(b, s)`.
///
/// # Safety
/// `pos_ptr` points at the array the position code describes (see [`PositionCode`]).
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
        }
    }
}

/// Loads one head's `L` elements (interleaved) or `2 L` elements (NeoX) of this work item.
///
/// # Safety
/// `head` points at a head of `2 * half` elements; `j0` is this item's first pair; the
/// alignment promised for `lanes` holds.
#[inline(always)]
unsafe fn load_head<T: Elem, P: Pairing, const L: usize>(
    head: *const T,
    j0: usize,
    half: usize,
) -> [[T; L]; 2] {
    // SAFETY: NeoX reads elements j0..j0+L and half+j0..half+j0+L, interleaved reads
    // 2*j0..2*j0+L; j0 + L <= half (resp. 2*j0 + L <= 2*half) because groups * L covers half
    // exactly, so every read stays in the head. Alignment is the caller's promise.
    unsafe {
        if P::NEOX {
            [
                elem::load::<T, L>(head.add(j0)),
                elem::load::<T, L>(head.add(half + j0)),
            ]
        } else {
            [elem::load::<T, L>(head.add(2 * j0)), [T::from_f32(0.0); L]]
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
    let mut lo = v[0];
    let mut hi = v[1];
    if P::NEOX {
        for k in 0..L {
            let (y0, y1) = math::rotate(lo[k].to_f32(), hi[k].to_f32(), cos[k], sin[k]);
            lo[k] = T::from_f32(y0);
            hi[k] = T::from_f32(y1);
        }
        // SAFETY: the same element ranges `load_head` read, in the output head.
        unsafe {
            elem::store::<T, L>(out_head.add(j0), lo);
            elem::store::<T, L>(out_head.add(half + j0), hi);
        }
    } else {
        for k in 0..L / 2 {
            let (y0, y1) = math::rotate(lo[2 * k].to_f32(), lo[2 * k + 1].to_f32(), cos[k], sin[k]);
            lo[2 * k] = T::from_f32(y0);
            lo[2 * k + 1] = T::from_f32(y1);
        }
        // SAFETY: the same element range `load_head` read, in the output head.
        unsafe { elem::store::<T, L>(out_head.add(2 * j0), lo) };
    }
}

/// Applies this item's rotation to `U` heads starting at `h`: all loads, then all stores.
///
/// # Safety
/// `h + U <= heads`, and the promises of [`load_head`] for every head.
#[inline(always)]
unsafe fn heads_block<T: Elem, P: Pairing, const L: usize, const U: usize>(
    x: *const T,
    out: *mut T,
    (x_stride, out_stride): (usize, usize),
    h: usize,
    (j0, half): (usize, usize),
    cos: &[f32; L],
    sin: &[f32; L],
) {
    let mut v = [[[T::from_f32(0.0); L]; 2]; U];
    // Index loops over the constant `U` unroll fully, keeping `v` in registers.
    #[allow(clippy::needless_range_loop)]
    for u in 0..U {
        // SAFETY: head h + u < heads exists at this stride; see `load_head`.
        v[u] = unsafe { load_head::<T, P, L>(x.add((h + u) * x_stride), j0, half) };
    }
    #[allow(clippy::needless_range_loop)]
    for u in 0..U {
        // SAFETY: head h + u < heads exists at this stride; see `rotate_store_head`.
        unsafe {
            rotate_store_head::<T, P, L>(out.add((h + u) * out_stride), j0, half, v[u], cos, sin)
        };
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

/// The kernel body for `L` elements per access.
///
/// # Safety
/// The promises of the entry points (see [`rope_neox_table_fwd_f32`]).
#[inline(always)]
unsafe fn body<T: Elem, P: Pairing, S: Source, const L: usize>(a: &Args<T>) {
    let pairs_per_item: u32 = if P::NEOX { L as u32 } else { (L / 2) as u32 };
    let groups = NonZeroU64::from(a.groups);
    let seq = NonZeroU64::from(a.seq);
    let total = a.tokens * groups.get();
    let step = grid_dim_x() as u64 * block_dim_x() as u64;
    let h0 = (block_idx_y() as u64 * a.heads_per_chunk as u64).min(a.heads as u64) as usize;
    let h1 = (h0 as u64 + a.heads_per_chunk as u64).min(a.heads as u64) as usize;
    let half = a.half as usize;
    let mut idx = block_idx_x() as u64 * block_dim_x() as u64 + thread_idx_x() as u64;
    while idx < total {
        let token = idx / groups;
        let j0 = (idx % groups) as u32 * pairs_per_item;
        let (b, s) = (token / seq, token % seq);
        // SAFETY: (b, s) is a token of the batch; the position array is the caller's promise.
        let pos = unsafe { position(a, b, s) };

        let mut cos = [0.0f32; L];
        let mut sin = [0.0f32; L];
        if S::TABLE {
            if pos >= 0 && (pos as u64) < a.table_positions {
                let row = pos as usize * half + j0 as usize;
                unrolled(pairs_per_item as usize, |k| {
                    // SAFETY: pos < table_positions and j0 + k < half, so the index is
                    // below table_positions * half, the tables' promised length.
                    unsafe {
                        cos[k] = (*a.cos.add(row + k)).to_f32();
                        sin[k] = (*a.sin.add(row + k)).to_f32() * a.sin_sign;
                    }
                });
            } else {
                // A position outside the table: documented NaN outputs, never a read
                // outside the table.
                cos = [f32::NAN; L];
                sin = [f32::NAN; L];
            }
        } else {
            unrolled(pairs_per_item as usize, |k| {
                // SAFETY: j0 + k < half, the promised length of inv_freq.
                let f = unsafe { *a.inv_freq.add(j0 as usize + k) };
                let (c, s) = math::rope_cos_sin(pos, f);
                cos[k] = c;
                sin[k] = s * a.sin_sign;
            });
        }

        // SAFETY: b < batch, s < seq, so these offsets address the token's first head in x
        // and out, whose layouts the caller promises.
        let (xt, ot) = unsafe {
            (
                a.x.add((b * a.x_strides[0] + s * a.x_strides[1]) as usize),
                a.out
                    .add((b * a.out_strides[0] + s * a.out_strides[1]) as usize),
            )
        };
        let strides = (a.x_strides[2] as usize, a.out_strides[2] as usize);
        let mut h = h0;
        let (j0, cos, sin) = ((j0 as usize, half), &cos, &sin);
        while h + P::HEADS_UNROLL <= h1 {
            // SAFETY: h + HEADS_UNROLL <= h1 <= heads. (A const generic cannot name
            // `P::HEADS_UNROLL` directly on stable Rust, hence the two arms.)
            unsafe {
                if P::HEADS_UNROLL == 4 {
                    heads_block::<T, P, L, 4>(xt, ot, strides, h, j0, cos, sin)
                } else {
                    heads_block::<T, P, L, 2>(xt, ot, strides, h, j0, cos, sin)
                }
            };
            h += P::HEADS_UNROLL;
        }
        while h < h1 {
            // SAFETY: h < h1 <= heads.
            unsafe { heads_block::<T, P, L, 1>(xt, ot, strides, h, j0, cos, sin) };
            h += 1;
        }
        idx += step;
    }
}

/// Picks the monomorphized body for the `lanes` argument.
///
/// # Safety
/// The promises of the entry points.
#[inline(always)]
unsafe fn dispatch<T: Elem, P: Pairing, S: Source>(a: &Args<T>) {
    // SAFETY: forwarded promises; `lanes` selects a body whose access width the host checked.
    unsafe {
        match a.lanes {
            4 => body::<T, P, S, 4>(a),
            2 => body::<T, P, S, 2>(a),
            1 if P::NEOX => body::<T, P, S, 1>(a),
            _ => trap(),
        }
    }
}

/// Defines one exported entry point per (pairing, source, direction, dtype).
macro_rules! rope_kernel {
    ($(#[$doc:meta])* $name:ident, $t:ty, $pairing:ty, $source:ty, $sin_sign:expr) => {
        $(#[$doc])*
        ///
        /// # Arguments
        /// `x`, `out`: `[batch, seq, heads, 2 * half]` at element strides `x_stride_*` /
        /// `out_stride_*` (last dimension contiguous); `tokens = batch * seq`;
        /// `heads_per_chunk`: heads handled by one `blockIdx.y`; `groups = half /
        /// pairs_per_thread` with `pairs_per_thread = lanes` (NeoX) or `lanes / 2`
        /// (interleaved); `cos`, `sin`, `table_positions` for table kernels and `inv_freq`
        /// for computed sin/cos (the other pointers are unused and may be null);
        /// `positions`: a [`PositionCode`] with `pos_ptr` and `pos_base`.
        ///
        /// # Safety
        /// - `x` and `out` address every element of their layout; the element ranges of
        ///   distinct heads do not overlap, and `out` either equals `x` or overlaps it nowhere;
        /// - `x`, `out` and every stride are aligned to `lanes` elements (`half` too for NeoX);
        /// - for tables, `cos` and `sin` hold `table_positions * half` elements each; for
        ///   computed sin/cos, `inv_freq` holds `half` `f64`;
        /// - `pos_ptr` holds the array its [`PositionCode`] names;
        /// - the grid has `blockIdx.y * heads_per_chunk < heads` for every block.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            x: *const $t,
            out: *mut $t,
            tokens: u64,
            seq: NonZeroU32,
            heads: u32,
            heads_per_chunk: u32,
            groups: NonZeroU32,
            half: u32,
            lanes: u32,
            x_stride_batch: u64,
            x_stride_seq: u64,
            x_stride_head: u64,
            out_stride_batch: u64,
            out_stride_seq: u64,
            out_stride_head: u64,
            cos: *const $t,
            sin: *const $t,
            table_positions: u64,
            inv_freq: *const f64,
            positions: u32,
            pos_ptr: *const u8,
            pos_base: i64,
        ) {
            let args = Args {
                x,
                out,
                tokens,
                seq,
                heads,
                heads_per_chunk,
                groups,
                half,
                lanes,
                x_strides: [x_stride_batch, x_stride_seq, x_stride_head],
                out_strides: [out_stride_batch, out_stride_seq, out_stride_head],
                cos,
                sin,
                table_positions,
                inv_freq,
                positions,
                pos_ptr,
                pos_base,
                sin_sign: $sin_sign,
            };
            // SAFETY: the caller's promises, listed above, are those `dispatch` needs.
            unsafe { dispatch::<$t, $pairing, $source>(&args) }
        }
    };
}

rope_kernel!(
    /// Forward RoPE, interleaved pairs `(x[2i], x[2i + 1])`, cos/sin tables, `f32`.
    rope_interleaved_table_fwd_f32, f32, Interleaved, Table, 1.0
);
rope_kernel!(
    /// Backward RoPE (transposed rotation), interleaved pairs, cos/sin tables, `f32`.
    rope_interleaved_table_bwd_f32, f32, Interleaved, Table, -1.0
);
rope_kernel!(
    /// Forward RoPE, interleaved pairs, cos/sin computed from `inv_freq`, `f32`.
    rope_interleaved_theta_fwd_f32, f32, Interleaved, Theta, 1.0
);
rope_kernel!(
    /// Backward RoPE, interleaved pairs, cos/sin computed from `inv_freq`, `f32`.
    rope_interleaved_theta_bwd_f32, f32, Interleaved, Theta, -1.0
);
rope_kernel!(
    /// Forward RoPE, NeoX rotate-half pairs `(x[i], x[i + half])`, cos/sin tables, `f32`.
    rope_neox_table_fwd_f32, f32, Neox, Table, 1.0
);
rope_kernel!(
    /// Backward RoPE (transposed rotation), NeoX pairs, cos/sin tables, `f32`.
    rope_neox_table_bwd_f32, f32, Neox, Table, -1.0
);
rope_kernel!(
    /// Forward RoPE, NeoX pairs, cos/sin computed from `inv_freq`, `f32`.
    rope_neox_theta_fwd_f32, f32, Neox, Theta, 1.0
);
rope_kernel!(
    /// Backward RoPE, NeoX pairs, cos/sin computed from `inv_freq`, `f32`.
    rope_neox_theta_bwd_f32, f32, Neox, Theta, -1.0
);
