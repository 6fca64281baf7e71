//! The fused kernel family: in one launch, per-head RMS normalisation of q and k (optional),
//! the RoPE rotation of both, and the stores a serving step wants next: q to its output (in
//! place, out of place or as FP8), k to its own output and/or with v into a paged KV cache
//! (in the tensors' type or FP8).
//!
//! # Formula
//! For each q and k head `x` of token `t` (both pairings, forward, the full head rotated):
//! - normalisation (`norm` not [`NormCode::None`]): `r = 1 / sqrt(sum_e x_e^2 / head_dim +
//!   eps)`, `x_e <- x_e * r * w_e` (`w` q's or k's weights, `1 + w_e` for
//!   [`NormCode::RmsOnePlus`]), all in `f32`;
//! - rotation as in [`crate::rope`];
//! - q to `out0`; k to `out1` when given; with a cache, k and v (unrotated, unnormalised) to
//!   slot `slots[t]` of `k_cache` and `v_cache`, skipped for a negative slot or one at or past
//!   `cache_slots`;
//! - each store rounds once to its format: the tensors' type, or FP8 E4M3 of `value / scale`
//!   ([`crate::math::f32_to_e4m3`], saturating).
//!
//! # Layout
//! q, k and v are `[batch, seq, heads, head_dim]` at their own strides (as in
//! [`crate::rope`]; views into one fused QKV buffer work). The cache holds `[blocks,
//! block_size, kv_heads, head_dim]` or `[blocks, kv_heads, block_size, head_dim]` (vLLM's two
//! orders), or any order given by its three strides; slot `s` is block `s / block_size`, row
//! `s % block_size`.
//!
//! # Thread mapping
//! A work item is one (token, group), as in [`crate::rope`], and walks the heads
//! `blockIdx.y * heads_per_chunk ..` of the concatenation of q's, k's and v's heads, one head
//! at a time: the item loads its `lanes` elements (two vectors for NeoX), and with
//! normalisation the `groups` items of the token (a power of two, at most 32, consecutive
//! lanes of one warp) add their squares with butterfly shuffles; items past `rot_groups` only
//! take part in that sum. Sin/cos, the position and the cache slot are found once per item and
//! serve every head.

use crate::abi::{Direction, FormatCode, NormCode, for_each_fused_kernel};
use crate::divide::Divisor;
use crate::elem::{self, Bf16, Elem, Fp8, Half};
use crate::intrinsics::{
    block_dim_x, block_idx_x, block_idx_y, grid_dim_x, lane_id, shuffle_xor, thread_idx_x, trap,
};
use crate::rope::{
    Args, Interleaved, Neox, Pairing, Params, Source, Table, TableF32, TensorArgs, Theta, cos_sin,
    load_head, position, rotate_values, unrolled, vector_offsets, widen,
};

/// The fused kernel's arguments: the RoPE arguments (q, k, positions, sin/cos) and the rest.
struct Fused<T> {
    rope: Args<T>,
    /// v's input (its `out` unused).
    v: TensorArgs<T>,
    head_dim: u32,
    norm: u32,
    q_norm_weight: *const T,
    k_norm_weight: *const T,
    norm_eps: f32,
    q_format: u32,
    q_scale: *const f32,
    q_scale_step: u32,
    slots: *const u8,
    slots_wide: u32,
    k_cache: *mut u8,
    v_cache: *mut u8,
    /// Block, slot-in-block and head strides, in elements of `cache_format`.
    cache_strides: [u64; 3],
    block: Divisor,
    cache_slots: u64,
    cache_format: u32,
    k_scale: *const f32,
    v_scale: *const f32,
    kv_scale_step: u32,
}

/// Which tensor a head of the q, k, v concatenation belongs to, with its index there.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Head {
    Q(usize),
    K(usize),
    V(usize),
}

/// Where one head's rotated (or copied) vectors go: the head's first element, the store
/// format, and the scale of FP8 stores.
struct Dest {
    head: *mut u8,
    format: u32,
    scale: *const f32,
}

/// The lanes of this thread's segment of `width` lanes (a power of two dividing 32) in its
/// warp, as the member mask of a shuffle.
#[inline(always)]
fn segment_members(width: u32) -> u32 {
    if width >= 32 {
        u32::MAX
    } else {
        ((1u32 << width) - 1) << (lane_id() & !(width - 1))
    }
}

/// The sum of `v` over the `width` lanes of this thread's segment (butterfly: every lane gets
/// the same sum, since each step adds the same two values on both sides).
#[inline(always)]
fn segment_sum(v: f32, width: u32, members: u32) -> f32 {
    let mut sum = v;
    let mut step = 1;
    while step < width {
        sum += shuffle_xor(sum, step, members);
        step <<= 1;
    }
    sum
}

/// The heads that block row `blockIdx.y` handles, in the concatenation of q's, k's and v's.
#[inline(always)]
fn head_range<T>(f: &Fused<T>) -> (usize, usize) {
    let a = &f.rope;
    let heads = a.q.heads as u64 + a.k.heads as u64 + f.v.heads as u64;
    let first = (block_idx_y() as u64 * a.heads_per_chunk as u64).min(heads);
    let last = (first + a.heads_per_chunk as u64).min(heads);
    (first as usize, last as usize)
}

/// The element offset of token `t`'s cache slot (block and row), or `None` when the token
/// writes no cache (no slots, or a slot that is negative or past the cache).
///
/// # Safety
/// `slots` is null or holds `tokens` integers of its width; `t < tokens`.
#[inline(always)]
unsafe fn cache_slot<T>(f: &Fused<T>, t: u64) -> Option<u64> {
    if f.slots.is_null() {
        return None;
    }
    // SAFETY: t < tokens, the promised length of `slots`.
    let slot = unsafe {
        if f.slots_wide != 0 {
            *f.slots.cast::<i64>().add(t as usize)
        } else {
            *f.slots.cast::<i32>().add(t as usize) as i64
        }
    };
    if slot < 0 || slot as u64 >= f.cache_slots {
        return None;
    }
    let (block, row) = f.block.div_rem(slot as u64);
    Some(block * f.cache_strides[0] + row * f.cache_strides[1])
}

/// Converts one head's vectors to `D` (FP8 after multiplying by `inv_scale`) and stores them
/// where [`load_head`] reads a head's.
///
/// # Safety
/// `head` points at a head of `D` elements that holds the item's elements, aligned to `L`.
#[inline(always)]
unsafe fn store_head<D: Elem, P: Pairing, const L: usize>(
    head: *mut D,
    (j0, half): (usize, usize),
    y: &[[f32; L]; 2],
    inv_scale: Option<f32>,
) {
    let (first, second) = vector_offsets::<P>(j0, half);
    let scaled = |v: [f32; L]| match inv_scale {
        Some(s) => v.map(|x| x * s),
        None => v,
    };
    // SAFETY: the element ranges `load_head` reads, inside the head (the caller's promise).
    unsafe {
        elem::store::<D, L>(head.add(first), D::from_f32_array(scaled(y[0])));
        if P::NEOX {
            elem::store::<D, L>(head.add(second), D::from_f32_array(scaled(y[1])));
        }
    }
}

/// Stores one head's result at `dest` in its format.
///
/// # Safety
/// `dest.head` points at a head of the format's elements holding the item's elements, aligned
/// to `L`; for FP8, `dest.scale` points at a readable `f32`.
#[inline(always)]
unsafe fn store<T: Elem, P: Pairing, const L: usize>(
    dest: Dest,
    j0: (usize, usize),
    y: &[[f32; L]; 2],
) {
    // SAFETY: the caller's promises.
    unsafe {
        if dest.format == FormatCode::E4m3 as u32 {
            let inv_scale = 1.0 / *dest.scale;
            store_head::<Fp8, P, L>(dest.head.cast(), j0, y, Some(inv_scale));
        } else {
            store_head::<T, P, L>(dest.head.cast(), j0, y, None);
        }
    }
}

/// Bytes per element of a store format.
#[inline(always)]
fn format_bytes<T>(format: u32) -> usize {
    if format == FormatCode::E4m3 as u32 {
        1
    } else {
        size_of::<T>()
    }
}

/// Normalises, rotates and stores head `h` (of the q, k, v concatenation) of token `(b, s)`.
///
/// # Safety
/// `h < q.heads + k.heads + heads_v`; `(b, s)` a token; `slot` from [`cache_slot`]; the
/// promises of the entry points.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn fused_head<T: Elem, P: Pairing, const L: usize>(
    f: &Fused<T>,
    (b, s): (u64, u64),
    h: usize,
    (j0, half): (usize, usize),
    active: bool,
    members: u32,
    (cos, sin): (&[f32; L], &[f32; L]),
    slot: Option<u64>,
) {
    let a = &f.rope;
    let (hq, hk) = (a.q.heads as usize, a.k.heads as usize);
    // Values, not a reference to one of the three tensors: a reference chosen at run time
    // would keep the arguments in local memory.
    let (head, x, x_strides) = if h < hq {
        (Head::Q(h), a.q.x, a.q.x_strides)
    } else if h < hq + hk {
        (Head::K(h - hq), a.k.x, a.k.x_strides)
    } else {
        (Head::V(h - hq - hk), f.v.x, f.v.x_strides)
    };
    let index = match head {
        Head::Q(i) | Head::K(i) | Head::V(i) => i,
    };
    let token_offset = |strides: [u64; 3]| b * strides[0] + s * strides[1];
    let x_offset = token_offset(x_strides) + index as u64 * x_strides[2];
    let mut v = [[0.0f32; L]; 2];
    if active {
        // SAFETY: head `index` of this tensor exists at its strides; j0 is this item's pair.
        v = widen(unsafe { load_head::<T, P, L>(x.add(x_offset as usize), j0, half) });
    }
    let norm = f.norm != NormCode::None as u32;
    if norm && !matches!(head, Head::V(_)) {
        // Every lane of the segment takes this branch: the head and `norm` are the segment's.
        let mut squares = 0.0f32;
        unrolled(L, |k| squares += v[0][k] * v[0][k] + v[1][k] * v[1][k]);
        let sum = segment_sum(squares, a.groups.divisor.get(), members);
        let r = 1.0 / core::f32::math::sqrt(sum / f.head_dim as f32 + f.norm_eps);
        if active {
            let weights = if matches!(head, Head::Q(_)) {
                f.q_norm_weight
            } else {
                f.k_norm_weight
            };
            // SAFETY: the weights hold head_dim elements aligned like a head.
            let w = widen(unsafe { load_head::<T, P, L>(weights, j0, half) });
            let one = if f.norm == NormCode::RmsOnePlus as u32 {
                1.0
            } else {
                0.0
            };
            unrolled(L, |k| {
                v[0][k] = v[0][k] * r * (w[0][k] + one);
                v[1][k] = v[1][k] * r * (w[1][k] + one);
            });
        }
    }
    if !active {
        return;
    }
    let y = match head {
        Head::V(_) => v,
        _ => rotate_values::<P, L>(|i, k| v[i][k], cos, sin),
    };
    let cache_dest = |cache: *mut u8, scale: *const f32| {
        slot.map(|slot| Dest {
            head: cache.wrapping_add(
                (slot + index as u64 * f.cache_strides[2]) as usize
                    * format_bytes::<T>(f.cache_format),
            ),
            format: f.cache_format,
            scale: scale.wrapping_add(index * f.kv_scale_step as usize),
        })
    };
    let j0 = (j0, half);
    // SAFETY (each store): the destinations address this head's elements inside their tensors
    // or the cache's slot (the entry points' promises), aligned to `lanes`; scales exist for
    // every head at their step.
    unsafe {
        match head {
            Head::Q(i) => {
                let offset = token_offset(a.q.out_strides) + i as u64 * a.q.out_strides[2];
                let dest = Dest {
                    head: a
                        .q
                        .out
                        .cast::<u8>()
                        .wrapping_add(offset as usize * format_bytes::<T>(f.q_format)),
                    format: f.q_format,
                    scale: f.q_scale.wrapping_add(i * f.q_scale_step as usize),
                };
                store::<T, P, L>(dest, j0, &y);
            }
            Head::K(i) => {
                if !a.k.out.is_null() {
                    let offset = token_offset(a.k.out_strides) + i as u64 * a.k.out_strides[2];
                    let dest = Dest {
                        head: a.k.out.add(offset as usize).cast(),
                        format: FormatCode::Elem as u32,
                        scale: core::ptr::null(),
                    };
                    store::<T, P, L>(dest, j0, &y);
                }
                if let Some(dest) = cache_dest(f.k_cache, f.k_scale) {
                    store::<T, P, L>(dest, j0, &y);
                }
            }
            Head::V(_) => {
                if let Some(dest) = cache_dest(f.v_cache, f.v_scale) {
                    store::<T, P, L>(dest, j0, &y);
                }
            }
        }
    }
}

/// The kernel body for `L` elements per access.
///
/// # Safety
/// The promises of the entry points.
#[inline(always)]
unsafe fn body<T: Elem, P: Pairing, S: Source, const L: usize>(f: &Fused<T>) {
    let a = &f.rope;
    let pairs = if P::NEOX { L } else { L / 2 };
    let groups = a.groups.divisor.get();
    let total = a.tokens * groups as u64;
    let step = grid_dim_x() as u64 * block_dim_x() as u64;
    let (first, last) = head_range(f);
    let half = a.half as usize;
    if NormCode::from_u32(f.norm).is_none() || (f.norm != 0 && groups > 32) {
        trap()
    }
    let members = segment_members(groups);
    let mut idx = block_idx_x() as u64 * block_dim_x() as u64 + thread_idx_x() as u64;
    // `total` is a multiple of `groups` and `step` of 32, so the lanes of a segment enter and
    // leave the loop together.
    while idx < total {
        let (token, group) = a.groups.div_rem(idx);
        let (b, s) = a.seq.div_rem(token);
        let active = (group as u32) < a.rot_groups;
        let j0 = if active { group as usize * pairs } else { 0 };
        let mut cs = ([0.0f32; L], [0.0f32; L]);
        if active {
            // SAFETY: (b, s) is a token; j0 + pairs <= half; the position, table and
            // frequency promises.
            cs = unsafe { cos_sin::<T, S, L>(a, position(a, b, s), j0, pairs) };
        }
        // SAFETY: token < tokens.
        let slot = unsafe { cache_slot(f, token) };
        for h in first..last {
            // SAFETY: h < last <= the heads of q, k and v.
            unsafe {
                fused_head::<T, P, L>(
                    f,
                    (b, s),
                    h,
                    (j0, half),
                    active,
                    members,
                    (&cs.0, &cs.1),
                    slot,
                )
            };
        }
        idx += step;
    }
}

/// Picks the monomorphized body for the `lanes` argument, as [`crate::rope`]'s dispatch.
///
/// # Safety
/// The promises of the entry points.
#[inline(always)]
unsafe fn dispatch<T: Elem, P: Pairing, S: Source, const WIDE: bool>(f: &Fused<T>) {
    // SAFETY: forwarded promises; `lanes` selects a body whose access width the host checked.
    unsafe {
        match (WIDE, T::SIZE, f.rope.lanes, P::NEOX) {
            (true, 4, 4, _) => body::<T, P, S, 4>(f),
            (true, 2, 8, false) => body::<T, P, S, 8>(f),
            (true, 2, 4, true) => body::<T, P, S, 4>(f),
            (false, 2, 4, false) => body::<T, P, S, 4>(f),
            (false, _, 2, _) => body::<T, P, S, 2>(f),
            (false, _, 1, true) => body::<T, P, S, 1>(f),
            _ => trap(),
        }
    }
}

/// The fused entry points' parameters, one field per entry of [`crate::fused_kernel_params!`].
macro_rules! fused_params_struct {
    ({} $($param:ident: $kind:ident,)*) => {
        /// The parameters of every fused entry point.
        struct FusedParams<T> {
            $($param: crate::device_param_type!($kind, T),)*
        }
    };
}
crate::fused_kernel_params!(fused_params_struct {});

/// The RoPE parameters of a fused entry point's parameters `$p`.
macro_rules! rope_params_of {
    ({ $p:ident } $($param:ident: $kind:ident,)*) => {
        Params { $($param: $p.$param,)* }
    };
}

impl<T> Fused<T> {
    /// Gathers the entry point's parameters for the generic body.
    #[inline(always)]
    fn new(p: FusedParams<T>) -> Self {
        Fused {
            rope: Args::new(
                crate::rope_kernel_params!(rope_params_of { p }),
                Direction::Forward,
            ),
            v: TensorArgs {
                x: p.v,
                out: core::ptr::null_mut(),
                heads: p.heads_v,
                x_strides: [p.v_stride_batch, p.v_stride_seq, p.v_stride_head],
                out_strides: [0; 3],
            },
            head_dim: p.head_dim,
            norm: p.norm,
            q_norm_weight: p.q_norm_weight,
            k_norm_weight: p.k_norm_weight,
            norm_eps: p.norm_eps,
            q_format: p.q_format,
            q_scale: p.q_scale.cast(),
            q_scale_step: p.q_scale_step,
            slots: p.slots,
            slots_wide: p.slots_wide,
            k_cache: p.k_cache,
            v_cache: p.v_cache,
            cache_strides: [
                p.cache_stride_block,
                p.cache_stride_slot,
                p.cache_stride_head,
            ],
            block: Divisor {
                divisor: p.block_size,
                magic: p.block_magic,
                shift: p.block_shift,
            },
            cache_slots: p.cache_slots,
            cache_format: p.cache_format,
            k_scale: p.k_scale.cast(),
            v_scale: p.v_scale.cast(),
            kv_scale_step: p.kv_scale_step,
        }
    }
}

/// Defines one exported entry point per (pairing, source, dtype), wide and narrow.
macro_rules! fused_kernel {
    ($($wide:ident, $narrow:ident: $pairing:ident, $source:ident, $dt:ident, $t:ty;)*) => {$(
        crate::fused_kernel_params!(fused_entry { $wide, true: $pairing, $source, $t });
        crate::fused_kernel_params!(fused_entry { $narrow, false: $pairing, $source, $t });
    )*};
}

/// One entry point with the parameter list of [`crate::fused_kernel_params!`].
macro_rules! fused_entry {
    (
        { $name:ident, $is_wide:literal: $pairing:ident, $source:ident, $t:ty }
        $($param:ident: $kind:ident,)*
    ) => {
        /// One fused entry point; its name says the pairing, the sin/cos source, the element
        /// type and (`_narrow`) whether accesses are narrower than the preferred width. See the
        /// module documentation, and `fused_kernel_params!` in `abi.rs` for the parameters.
        ///
        /// # Safety
        /// The promises of the RoPE entry points (`crate::rope`) for q and k (with `out1` null
        /// or k's output), and: `v` addresses `heads_v` heads of `head_dim` elements per token
        /// at its strides; `out0` addresses q's heads in elements of `q_format`; the norm
        /// weights hold `head_dim` elements each when `norm` is not 0; FP8 formats have their
        /// scales (`f32`, one per head at a step of 1, or one); `slots` is null or holds
        /// `tokens` integers; every slot below `cache_slots` addresses, at the cache strides,
        /// `k.heads` heads of `head_dim` elements of `cache_format` inside `k_cache` and
        /// `v_cache`; every pointer and stride is aligned to `lanes` elements; written regions
        /// overlap nothing else the launch reads or writes; `groups` is a power of two of at
        /// most 32 when `norm` is not 0.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            $($param: crate::device_param_type!($kind, $t),)*
        ) {
            let args = Fused::new(FusedParams::<$t> { $($param,)* });
            // SAFETY: the caller's promises, listed above, are those `dispatch` needs.
            unsafe { dispatch::<$t, $pairing, $source<$t>, $is_wide>(&args) }
        }
    };
}

for_each_fused_kernel!(fused_kernel);
