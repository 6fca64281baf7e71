//! The fused kernel family: in one launch, per-head RMS normalisation of q and k (optional),
//! the RoPE rotation of both, and the stores a serving step wants next: q to its output (in
//! place, out of place or as FP8), k to its own output and/or with v into a paged KV cache
//! (in the tensors' type or FP8).
//!
//! # Formula
//! For each q and k head `x` of token `t` (both pairings, the full head rotated, or in the
//! `_partial` kernels its first `2 half` features and the rest stored as normalised, forward
//! or, as `sin_sign` says, backward: the transposed rotation, for launches that normalise,
//! quantise and cache nothing):
//! - normalisation (`norm` not [`NormCode::None`]): `r = 1 / sqrt(sum_e x_e^2 / head_dim +
//!   eps)`, `x_e <- x_e * r * w_e` (`w` q's or k's weights, `1 + w_e` for
//!   [`NormCode::RmsOnePlus`]), all in `f32`: the sum with fused multiply-adds, the mean plus
//!   `eps` as one (`sum * (1 / head_dim) + eps`, the reciprocal to about one ulp), `r` from the
//!   approximate reciprocal square root and one Newton step (about one `f32` ulp);
//! - rotation as in [`crate::rope`], each result with one fused multiply-add;
//! - q to `out0`; k to `out1` when given; with a cache, k and v (unrotated, unnormalised) to
//!   slot `slots[t]` of `k_cache` and `v_cache` (or the slot a page table gives the token:
//!   FlashInfer's `kv_indices[kv_indptr[b] + p / block_size] * block_size + p % block_size`),
//!   skipped for a negative slot or one at or past `cache_slots`;
//! - each store rounds once to its format: the tensors' type, or FP8 (E4M3,
//!   [`crate::math::f32_to_e4m3`], or E5M2, [`crate::math::f32_to_e5m2`], saturating) of
//!   `value * m`, `m = 1 / scale` from a scale array (the reciprocal from `rcp.approx`, within
//!   one `f32` ulp: FP8 keeps 3 bits at most) or a multiplier passed by value.
//!
//! FlashInfer's forms (a page table, E5M2, multipliers by value, an FP8 k output) are stored by
//! two-heads entry points of their own (`_two_heads_flashinfer`, the body's `FI`), with
//! parameters of their own (`crate::fused_forms_kernel_params!`): in the item loop and the
//! four-heads kernels those stores made ptxas spill, and inside the other kernels their code and
//! parameters made every decode launch slower.
//!
//! The instructions each thread issues, and each block's chain of latencies (its loads, the
//! norm's dependent shuffle steps, the reciprocal square root, the stores), bound the kernels
//! at prefill; hence the fused multiply-adds and approximations above, none of which moves a
//! 16-bit result by more than its rounding.
//!
//! # Layout
//! q, k and v are `[batch, seq, heads, head_dim]` at their own strides (as in
//! [`crate::rope`]; views into one fused QKV buffer work). The cache holds `[blocks,
//! block_size, kv_heads, head_dim]` or `[blocks, kv_heads, block_size, head_dim]` (vLLM's two
//! orders), or any order given by its three strides; slot `s` is block `s / block_size`, row
//! `s % block_size`.
//!
//! # Thread mapping
//! The wide and narrow kernels: a work item is one (token, group), as in [`crate::rope`], and
//! walks the heads
//! `blockIdx.y * heads_per_chunk ..` of the concatenation of q's, k's and v's heads in blocks
//! of [`HEADS_UNROLL`] heads of one tensor: it loads its `lanes` elements (two vectors for NeoX)
//! of every head of the block, then with normalisation the `groups` items of the token (a power
//! of two, at most 32, consecutive lanes of one warp) add their squares with butterfly
//! shuffles, then it rotates and stores. Items past `rot_groups` only take part in the sums;
//! whole warps run the loop, so the shuffles always name all 32 lanes. Sin/cos, the position
//! and the cache slot are found once per item and serve every head (rows of v's heads alone
//! find no sin/cos).
//!
//! The token-heads kernels (every launch at the preferred width whose tensors span fewer than
//! 2^32 elements and whose tables suit [`crate::rope::PlannedTable`], decode and prefill
//! alike): one thread per two heads (the two-heads kernels; the four-heads kernels, in
//! launches of many waves, four: [`crate::abi::ThreadHeads`]) of one tensor and one
//! group, one block row per token, each warp of one tensor (a block holds up to
//! [`crate::abi::TOKEN_HEADS_MAX_WARPS`] of the token's q, k and v warps), no loop. Each
//! thread issues its heads' loads, then reads its table rows, or takes its pairs' cos/sin from
//! the block's shared buffer (each of the block's first `half` threads computes one pair of the
//! token), then normalises, rotates and stores as above. A launch's length is then one head's
//! chain, where the item loop's is the chain of every head of the item in turn; at prefill the
//! mapping's many resident threads keep more loads in flight than the item loop's one block of
//! heads per thread, once its per-thread set-up is shared by two or four heads (see
//! `token_heads_body`).
//!
//! Built for sm_90, each kernel takes part in programmatic dependent launch: it waits for the
//! grid before it after its set-up, before its first global access (see
//! `crate::intrinsics::wait_for_prior_grids`).

use crate::abi::{
    FormatCode, MAX_FUSED_ITEMS, Mapping, NOPE_ACCESSES_PER_THREAD, NopeCached, NormCode, SlotCode,
    ThreadHeads, for_each_fused_kernel,
};
use crate::divide::Divisor;
use crate::elem::{Bf16, Elem, Fp8, Fp8E5m2, Half, unrolled};
use crate::intrinsics::{
    SHARED_F32, block_dim_x, block_idx_x, block_idx_y, block_idx_z, grid_dim_x, grid_dim_y,
    prefetch_l2, rcp_approx, rcp_approx_ftz, rsqrt_approx, shared_load_f32s, shared_store_f32,
    shuffle_idx, shuffle_xor, sync_named, sync_threads_count, sync_warp, thread_idx_x, trap,
    wait_for_prior_grids,
};
use crate::rope::{
    Args, Interleaved, KeptInL2, Neox, Pairing, Params, PlannedTable, Source, Table, TensorArgs,
    Theta, cos_sin, cos_sin_preloaded, cos_sin_read, load_head, offset_u32, position,
    position_read, preload_frequencies, rotate_values_with, vector_offsets, widen,
};

/// An entry point family's parameters as a struct, one field per entry of its list (the
/// fused kernels', FlashInfer's forms', the backward's and the across-heads kernels').
macro_rules! params_struct {
    ({ $(#[$doc:meta])* $name:ident } $($param:ident: $kind:ident,)*) => {
        $(#[$doc])*
        struct $name<T> {
            $($param: crate::device_param_type!($kind, T),)*
        }
    };
}

mod across;
mod grad;
#[cfg(target_feature = "sm_90")]
mod rows;

/// [`ThreadHeads::Two`] and [`ThreadHeads::Four`] as the body's const parameter `U`.
const TWO_HEADS_U: usize = ThreadHeads::Two.count() as usize;
const FOUR_HEADS_U: usize = ThreadHeads::Four.count() as usize;

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
    /// The steps of `k_scale` and `v_scale` between heads: 0 (one scale) or 1 (one per head).
    k_scale_step: u32,
    v_scale_step: u32,
    /// The FP8 multipliers of q's output, k's and v's stores where their scale is null.
    q_multiplier: f32,
    k_multiplier: f32,
    v_multiplier: f32,
    /// k's output's format (FP8 with k's scale; then there is no cache).
    k_format: u32,
    /// Where the slots come from (a [`SlotCode`]).
    slot_mode: u32,
    /// The page table, for [`SlotCode::PageTable`] (see `crate::fused_kernel_params!`).
    page_positions: *const i32,
    kv_indptr: *const i32,
    kv_indices: *const i32,
    kv_requests: u32,
    kv_pages: u32,
    /// The token-heads kernels' warps per token of q's, k's and v's threads (in
    /// that order).
    q_warps: u32,
    k_warps: u32,
    v_warps: u32,
    /// The four-heads kernels' prefetch distance in tokens (0: none); see [`prefetch_ahead`].
    prefetch_tokens: u32,
    /// FlashInfer's non-rotary parts (none outside its forms' entry points).
    nope: NonRotary<T>,
    /// The NVFP4 caches' block scales (null outside their entry points) and their block, row
    /// and head strides, in bytes.
    k_block_scales: *mut u8,
    v_block_scales: *mut u8,
    block_scale_strides: [u64; 3],
}

/// FlashInfer's non-rotary parts by address (see `crate::fused_forms_kernel_params!`): the
/// blocks of a token's row from `rope_blocks` on, `threads` threads and `accesses` accesses per
/// head, and q's and k's
/// inputs (null: no such part) and FP8 outputs at their (token, head) strides; `cached`, the
/// [`NopeCached`] bits, sends k's part into a cache at `k_out` (`cache_strides`: block, row
/// and head, in bytes) and adds v's features past `head_dim`.
#[derive(Clone, Copy)]
struct NonRotary<T> {
    rope_blocks: u32,
    threads: Divisor,
    accesses: u32,
    q: *const T,
    q_strides: [u32; 2],
    q_out: *mut u8,
    q_out_strides: [u32; 2],
    k: *const T,
    k_strides: [u32; 2],
    k_out: *mut u8,
    k_out_strides: [u32; 2],
    cached: NopeCached,
    cache_strides: [u64; 3],
}

impl<T> NonRotary<T> {
    /// No non-rotary part: no block reaches `rope_blocks`.
    const NONE: Self = NonRotary {
        rope_blocks: u32::MAX,
        threads: Divisor {
            divisor: core::num::NonZeroU32::MIN,
            magic: 0,
            shift: 0,
        },
        accesses: 0,
        q: core::ptr::null(),
        q_strides: [0; 2],
        q_out: core::ptr::null_mut(),
        q_out_strides: [0; 2],
        k: core::ptr::null(),
        k_strides: [0; 2],
        k_out: core::ptr::null_mut(),
        k_out_strides: [0; 2],
        cached: NopeCached::NONE,
        cache_strides: [0; 3],
    };
}

/// Heads a work item loads before it stores any (both pairings): two heads are 16 elements, 32
/// bytes of 16-bit elements, as [`crate::rope`]'s NeoX blocks. Four (as `rope` unrolls
/// interleaved heads) took the interleaved 16-bit kernels far past 64 registers without a cap,
/// and spilled heavily at the 64 of 1024 resident threads.
const HEADS_UNROLL: usize = 2;

/// Which of the three tensors a run of heads belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Q,
    K,
    V,
}

/// What a work item finds once and uses for every head: its token, its pairs, whether it
/// rotates (items past `rot_groups`, and lanes past the last item, only join the norm's
/// shuffles), its cos/sin and its cache slot.
///
/// Indices are kept in 32 bits (the host keeps `seq` and `head_dim` within `u32`, the work items
/// within [`MAX_FUSED_ITEMS`]): the kernel holds this through every block at 64 registers, and
/// each 64-bit field was a register more, which ptxas spilled.
struct Item<const L: usize> {
    /// Batch row and sequence index (below the items, so within `u32`).
    token: (u32, u32),
    /// The first pair and `half` (see [`vector_offsets`]).
    j0: (u32, u32),
    active: bool,
    cos: [f32; L],
    sin: [f32; L],
    slot: Slot,
}

/// A cache slot's element offset, or none: one 64-bit register where `Option<u64>` takes a
/// second for its tag (an offset is below the cache's size, so never `u64::MAX`).
#[derive(Clone, Copy)]
struct Slot(u64);

impl Slot {
    const NONE: Slot = Slot(u64::MAX);

    #[inline(always)]
    fn new(offset: Option<u64>) -> Self {
        offset.map_or(Slot::NONE, Slot)
    }

    #[inline(always)]
    fn get(self) -> Option<u64> {
        (self.0 != u64::MAX).then_some(self.0)
    }
}

impl<const L: usize> Item<L> {
    /// The item's first pair and `half`, as [`load_head`] takes them.
    #[inline(always)]
    fn pairs(&self) -> (usize, usize) {
        (self.j0.0 as usize, self.j0.1 as usize)
    }
}

/// The FP8 scales of one destination of the item loop (E4M3 of scale arrays: the item loop
/// takes no FlashInfer form, see `token_heads_body`). Each head's reciprocal is found where its stores use it
/// (one `rcp.approx`): set up ahead of a block, a per-tensor scale's ran (predicated off) in
/// every block of 16-bit outputs too, and its register through the block made ptxas spill.
struct Scales {
    fp8: bool,
    scale: *const f32,
    step: u32,
}

impl Scales {
    /// The scales of stores in `format`.
    ///
    /// # Safety
    /// For FP8, `scale` points at one `f32` per head at a step of `step` (0: one in all).
    #[inline(always)]
    unsafe fn new(format: u32, scale: *const f32, step: u32) -> Self {
        Scales {
            fp8: format == FormatCode::E4m3 as u32,
            scale,
            step,
        }
    }

    /// The multiplier of head `i`'s FP8 stores, `None` for stores in the tensors' type.
    ///
    /// # Safety
    /// `i` is a head of the destination.
    #[inline(always)]
    unsafe fn of(&self, i: usize) -> Option<f32> {
        // SAFETY: one scale per head at `step`, or one (the promise of `new`).
        self.fp8
            .then(|| rcp_approx(unsafe { *self.scale.add(i * self.step as usize) }))
    }
}

/// An FP8 destination: its format and where its multipliers come from: `1 / scale[head *
/// step]`, or `multiplier` where `scale` is null.
#[derive(Clone, Copy)]
struct Fp8Dest {
    e5m2: bool,
    scale: *const f32,
    step: u32,
    multiplier: f32,
}

impl Fp8Dest {
    /// The FP8 destination of stores in `format`, `None` for the tensors' type; E5M2 only in
    /// the code of FlashInfer's forms (`FI`).
    ///
    /// Safe to build; its users need `scale` null (`FI` only) or pointing at one `f32` per head
    /// at a step of `step` (0: one in all).
    #[inline(always)]
    fn of<const FI: bool>(
        format: u32,
        (scale, step): (*const f32, u32),
        multiplier: f32,
    ) -> Option<Self> {
        (format != FormatCode::Elem as u32).then_some(Fp8Dest {
            e5m2: FI && format == FormatCode::E5m2 as u32,
            scale,
            step,
            multiplier,
        })
    }
}

/// `a * b + c` rounded once (`fma.rn.f32`): one instruction where a product and a sum are two,
/// and the fused kernel is bound by how many it issues.
#[inline(always)]
fn mul_add(a: f32, b: f32, c: f32) -> f32 {
    core::f32::math::mul_add(a, b, c)
}

/// Rotates one pair as [`crate::math::rotate`] does, each result with one product rounded
/// into a fused multiply-add: `(fma(a, cos, -b sin), fma(b, cos, a sin))`.
#[inline(always)]
fn rotate_fma(a: f32, b: f32, cos: f32, sin: f32) -> (f32, f32) {
    (mul_add(a, cos, -(b * sin)), mul_add(b, cos, a * sin))
}

/// `1 / x` to about one ulp: [`rcp_approx`] and one Newton step (`r += r (1 - x r)`), without
/// the subroutine call of a correctly rounded division. Infinite or zero results are kept.
#[inline(always)]
fn reciprocal(x: f32) -> f32 {
    let r = rcp_approx(x);
    let e = mul_add(-x, r, 1.0);
    if r.is_finite() && r != 0.0 {
        mul_add(e, r, r)
    } else {
        r
    }
}

/// `1 / sqrt(x)` to about one ulp: [`rsqrt_approx`] and one Newton step
/// (`r (3 - x r^2) / 2`), without the subroutine call of a correctly rounded square root and
/// division. An infinite result (`x = 0`) is kept.
#[inline(always)]
fn inverse_sqrt(x: f32) -> f32 {
    let r = rsqrt_approx(x);
    let refined = r * mul_add(0.5 * x * r, -r, 1.5);
    if r.is_finite() { refined } else { r }
}

/// The sums of each of `v`'s values over the `width` lanes of this thread's segment of its
/// warp (`width` a power of two dividing 32; butterfly: every lane gets the same sums, since
/// each step adds the same two values on both sides). The `U` sums share each step, so their
/// shuffles are in flight together. Every lane of the warp must call it (the shuffles name the
/// whole warp, a constant mask that needs no convergence check).
#[inline(always)]
fn segment_sums<const U: usize>(v: [f32; U], width: u32) -> [f32; U] {
    // The widths of heads of 64, 128 and 256 elements at the widest accesses, as straight-line
    // code: a loop over a run-time width costs a compare, a branch and a shift per step.
    match width {
        8 => butterfly(v, 8),
        16 => butterfly(v, 16),
        32 => butterfly(v, 32),
        _ => butterfly(v, width),
    }
}

/// A head's normalisation factor `1 / sqrt(sum * inv_dim + eps)` from its sum of squares `sum`
/// over `1 / inv_dim` elements.
#[inline(always)]
fn norm_factor(sum: f32, inv_dim: f32, eps: f32) -> f32 {
    inverse_sqrt(mul_add(sum, inv_dim, eps))
}

/// Each of `U` heads' normalisation factor ([`norm_factor`]), where `sum` is the
/// head's value of `squares` summed over the `width` lanes of this thread's segment (as
/// [`segment_sums`]); every lane of a segment gets the same factors. Every lane of the warp
/// must call it.
///
/// Four heads over at least four lanes take a reduce-scatter: two exchange steps leave each
/// lane of four with one head's partial sum (two shuffles, then one), the remaining steps sum
/// it over the segment, each lane finds its own head's factor, and four indexed shuffles
/// gather the four factors: 9 shuffles, 5 additions and one reciprocal square root where the
/// butterfly takes 16, 16 and four. Lanes holding the same head add the same values in the
/// same order, so the factors agree across the segment.
#[inline(always)]
fn norm_factors<const U: usize, const LONG: bool>(
    squares: [f32; U],
    (width, normed_threads): (u32, u32),
    inv_dim: f32,
    eps: f32,
) -> [f32; U] {
    let factor = |sum: f32| norm_factor(sum, inv_dim, eps);
    if U != 4 || width < 4 {
        let sums = segment_sums(squares, width);
        let mut out = [0.0f32; U];
        unrolled(U, |u| out[u] = factor(sums[u]));
        return out;
    }
    // `% U` keeps the indices in bounds in the instances that return above.
    let s = |u: usize| squares[u % U];
    let lane = thread_idx_x() % 32;
    // Lane bit 0 keeps heads 2 and 3 (else 0 and 1) and sends its partner the other two.
    let (keep, send) = if lane & 1 != 0 {
        ((s(2), s(3)), (s(0), s(1)))
    } else {
        ((s(0), s(1)), (s(2), s(3)))
    };
    let pair = (
        keep.0 + shuffle_xor(send.0, 1, u32::MAX),
        keep.1 + shuffle_xor(send.1, 1, u32::MAX),
    );
    // Lane bit 1 keeps the second of its pair: the lane now holds head `2 * bit0 + bit1`.
    let (keep, send) = if lane & 2 != 0 {
        (pair.1, pair.0)
    } else {
        (pair.0, pair.1)
    };
    let mut sum = keep + shuffle_xor(send, 2, u32::MAX);
    // The widths of heads of 64, 128 and 256 elements as straight-line code.
    match width {
        4 => {}
        8 => sum += shuffle_xor(sum, 4, u32::MAX),
        16 => {
            sum += shuffle_xor(sum, 4, u32::MAX);
            sum += shuffle_xor(sum, 8, u32::MAX);
        }
        _ if LONG => {
            sum += shuffle_xor(sum, 4, u32::MAX);
            sum += shuffle_xor(sum, 8, u32::MAX);
            sum += shuffle_xor(sum, 16, u32::MAX);
            // SAFETY: `LONG` kernels' segments are 64 or 128 lanes, the blocks whole segments
            // (the entry points' promise), and `normed_threads` those of the block's warps
            // that normalise, each of which calls this once.
            sum = unsafe { warps_sum(sum, width / 32, normed_threads) };
        }
        _ => {
            let mut step = 4;
            while step < width {
                sum += shuffle_xor(sum, step, u32::MAX);
                step <<= 1;
            }
        }
    }
    let own = factor(sum);
    // Head h's factor sits on lane `base + (h >> 1) + 2 (h & 1)` of this lane's four.
    let base = lane & !3;
    let mut out = [0.0f32; U];
    unrolled(U, |u| {
        let h = u as u32;
        out[u] = shuffle_idx(own, base + (h >> 1) + 2 * (h & 1), u32::MAX);
    });
    out
}

/// Where [`warps_sum`] keeps the warps' sums in the block's shared buffer: a row of eight (at
/// least [`crate::abi::TOKEN_HEADS_MAX_WARPS`]) per lane of four, past every cos/sin a block
/// shares (`2 half` values, with `half` at most the block's threads).
const WARP_SUMS: u32 = (SHARED_F32 as u32) - 4 * 8;

/// The four-heads reduce-scatter's per-lane sum (lane `l` holds the head of `l % 4`, summed
/// over its warp) summed over the `warps` consecutive warps of the block that hold the
/// segment, in warp order, so that every lane of the segment gets the same total: each warp's
/// lanes 0-3 write their sums to shared memory, the block's `threads` normalising threads meet
/// at barrier 1 (one barrier id for every segment: with an id per segment the barriers, 16 a
/// multiprocessor, held the kernels to four blocks of four warps), and each lane reads its
/// head's `warps` sums with one load.
///
/// # Safety
/// Every lane of the block's `threads / 32` normalising warps calls it once, and those of
/// segments of `warps` warps (2 or 4); the block's warps are a multiple of `warps`, at most
/// [`crate::abi::TOKEN_HEADS_MAX_WARPS`], and its segments start at warps that are multiples
/// of `warps`.
#[inline(always)]
unsafe fn warps_sum(sum: f32, warps: u32, threads: u32) -> f32 {
    let (lane, warp) = (thread_idx_x() % 32, thread_idx_x() / 32);
    // SAFETY: warp < 8 and lane % 4 < 4: every index lies in WARP_SUMS..SHARED_F32, and the
    // loads start at a multiple of their width (`warps` divides the first warp; WARP_SUMS and
    // the rows are multiples of 8).
    unsafe {
        if lane < 4 {
            shared_store_f32(WARP_SUMS + 8 * lane + warp, sum);
        }
        sync_named(1, threads);
        let at = WARP_SUMS + 8 * (lane % 4) + (warp - warp % warps);
        if warps == 2 {
            let v = shared_load_f32s::<2>(at);
            v[0] + v[1]
        } else {
            let v = shared_load_f32s::<4>(at);
            (v[0] + v[1]) + (v[2] + v[3])
        }
    }
}

/// [`segment_sums`]'s steps, unrolled where `width` is a constant.
#[inline(always)]
fn butterfly<const U: usize>(mut v: [f32; U], width: u32) -> [f32; U] {
    let mut step = 1;
    while step < width {
        unrolled(U, |u| v[u] += shuffle_xor(v[u], step, u32::MAX));
        step <<= 1;
    }
    v
}

/// The heads that block row `blockIdx.y` handles, in the concatenation of q's, k's and v's
/// (the host keeps their sum within `u32`).
#[inline(always)]
fn head_range<T>(f: &Fused<T>) -> (u32, u32) {
    let a = &f.rope;
    let heads = a.q.heads as u64 + a.k.heads as u64 + f.v.heads as u64;
    let first = (block_idx_y() as u64 * a.heads_per_chunk as u64).min(heads);
    let last = (first + a.heads_per_chunk as u64).min(heads);
    (first as u32, last as u32)
}

/// Token `t`'s cache slot ([`SlotCode`]): its entry of `slots` ([`mapped_slot`]), or with a
/// page table its page's slot ([`page_table_slot`]).
///
/// # Safety
/// `slots` holds `tokens` integers of its width; `t < tokens`; a page table's arrays hold what
/// the entry points promise.
#[inline(always)]
unsafe fn slot_value<T, const FI: bool>(f: &Fused<T>, t: u64) -> i64 {
    // SAFETY: the caller's promises.
    unsafe {
        if FI && f.slot_mode == SlotCode::PageTable as u32 {
            page_table_slot(f, t)
        } else {
            mapped_slot(f, t)
        }
    }
}

/// Token `t`'s entry of `slots`, widened.
///
/// # Safety
/// `slots` holds `tokens` integers of its width; `t < tokens`.
#[inline(always)]
unsafe fn mapped_slot<T>(f: &Fused<T>, t: u64) -> i64 {
    // SAFETY: t < tokens, the promised length of `slots`.
    unsafe {
        if f.slots_wide != 0 {
            *f.slots.cast::<i64>().add(t as usize)
        } else {
            *f.slots.cast::<i32>().add(t as usize) as i64
        }
    }
}

/// Token `t`'s slot by the page table: request `b = slots[t]`, position `p =
/// page_positions[t]`, page `kv_indices[kv_indptr[b] + p / block_size]`, slot `page *
/// block_size + p % block_size`; `-1` (no cache write) for a negative request, position or
/// page, a request at or past `kv_requests`, or an entry outside the request's pages
/// (`kv_indptr[b] .. kv_indptr[b + 1]`) or outside `kv_indices`: each device value is checked
/// before it addresses anything.
///
/// # Safety
/// `slots` and `page_positions` hold `tokens` `i32`, `kv_indptr` `kv_requests + 1` and
/// `kv_indices` `kv_pages`; `t < tokens`.
#[inline(always)]
unsafe fn page_table_slot<T>(f: &Fused<T>, t: u64) -> i64 {
    // SAFETY: t < tokens; each index below is checked against its array's length first.
    unsafe {
        let b = *f.slots.cast::<i32>().add(t as usize);
        let p = *f.page_positions.add(t as usize);
        if b < 0 || p < 0 || b as u32 >= f.kv_requests {
            return -1;
        }
        let first = *f.kv_indptr.add(b as usize);
        let end = *f.kv_indptr.add(b as usize + 1);
        let (page_iter, entry) = f.block.div_rem_u32(p as u32);
        let at = i64::from(first) + i64::from(page_iter);
        if first < 0 || at >= i64::from(end) || at >= i64::from(f.kv_pages) {
            return -1;
        }
        let page = *f.kv_indices.add(at as usize);
        if page < 0 {
            return -1;
        }
        i64::from(page) * i64::from(f.block.divisor.get()) + i64::from(entry)
    }
}

/// `slot` as a slot of the cache, `None` when the token writes no cache: a negative slot
/// (padding) or one past the cache.
#[inline(always)]
fn slot_in_cache<T>(f: &Fused<T>, slot: i64) -> Option<u64> {
    (slot >= 0 && (slot as u64) < f.cache_slots).then_some(slot as u64)
}

/// The element offset of `slot`'s block and row in the cache (see [`slot_in_cache`]).
#[inline(always)]
fn slot_offset<T>(f: &Fused<T>, slot: i64) -> Option<u64> {
    let (block, row) = f.block.div_rem(slot_in_cache(f, slot)?);
    Some(block * f.cache_strides[0] + row * f.cache_strides[1])
}

/// The element offset of token `t`'s cache slot (block and row), or `None` when the token
/// writes no cache (no slots, or see [`slot_in_cache`]).
///
/// # Safety
/// `slots` is null or holds `tokens` integers of its width; `t < tokens`.
#[inline(always)]
unsafe fn cache_slot<T>(f: &Fused<T>, t: u64) -> Option<u64> {
    if f.slots.is_null() {
        return None;
    }
    // SAFETY: the caller's promise (the item loop takes no page table).
    slot_offset(f, unsafe { mapped_slot(f, t) })
}

/// [`cache_slot`] with the slot divided in 32 bits, for caches of at most 2^32 slots.
///
/// # Safety
/// As [`cache_slot`], and `cache_slots <= 2^32`.
#[inline(always)]
unsafe fn cache_slot_u32<T, const FI: bool>(f: &Fused<T>, t: u64) -> Option<u64> {
    if f.slots.is_null() {
        return None;
    }
    // SAFETY: the caller's promise.
    slot_offset_u32(f, unsafe { slot_value::<T, FI>(f, t) })
}

/// [`slot_offset`] with the slot divided in 32 bits: for caches of at most 2^32 slots, whose
/// slots all fit in `u32` (the callers check `cache_slots`).
#[inline(always)]
fn slot_offset_u32<T>(f: &Fused<T>, slot: i64) -> Option<u64> {
    // A slot below cache_slots <= 2^32 fits in u32.
    let (block, row) = f.block.div_rem_u32(slot_in_cache(f, slot)? as u32);
    Some(u64::from(block) * f.cache_strides[0] + u64::from(row) * f.cache_strides[1])
}

/// Stores one head's vectors at `head` (a head of `T`, or of FP8 after multiplying by
/// `inv_scale`) where [`load_head`] reads a head's.
///
/// # Safety
/// `head` points at a head of the format's elements that holds the item's elements, aligned
/// to `L`.
#[inline(always)]
unsafe fn store_head<T: Elem, P: Pairing, const L: usize>(
    head: *mut u8,
    inv_scale: Option<f32>,
    (j0, half): (usize, usize),
    y: &[[f32; L]; 2],
) {
    let at = vector_offsets::<P>(j0, half);
    // SAFETY: the caller's promises.
    unsafe {
        match inv_scale {
            Some(s) => {
                let mut scaled = *y;
                unrolled(L, |k| {
                    scaled[0][k] *= s;
                    scaled[1][k] *= s;
                });
                put::<Fp8, P, L>(head.cast(), at, scaled)
            }
            None => put::<T, P, L>(head.cast(), at, *y),
        }
    }
}

/// `y` times `m`, the values an FP8 store rounds.
#[inline(always)]
fn scaled<const L: usize>(y: &[[f32; L]; 2], m: f32) -> [[f32; L]; 2] {
    let mut out = *y;
    unrolled(L, |k| {
        out[0][k] *= m;
        out[1][k] *= m;
    });
    out
}

/// Rounds one head's vectors `y` to `D` and stores them at the element offsets `first` and
/// (NeoX) `second` of `head`, as [`store_head`] does.
///
/// # Safety
/// The element ranges [`load_head`] reads lie inside the head, aligned to `L`.
#[inline(always)]
unsafe fn put<D: Elem, P: Pairing, const L: usize>(
    head: *mut D,
    (first, second): (usize, usize),
    y: [[f32; L]; 2],
) {
    // SAFETY: the element ranges `load_head` reads, inside the head (the caller's promise).
    unsafe {
        D::store_rounded(head.add(first), y[0]);
        if P::NEOX {
            D::store_rounded(head.add(second), y[1]);
        }
    }
}

/// Bytes per element of a store format.
#[inline(always)]
fn format_bytes<T>(format: u32) -> usize {
    if format == FormatCode::Elem as u32 {
        size_of::<T>()
    } else {
        1
    }
}

/// Whether the launch stores anything for the heads of `kind`: not for v, nor for k without
/// an output of its own, without a cache. The same in the whole grid, so a whole warp skips
/// those heads together (a token without a slot only skips its cache stores).
#[inline(always)]
fn stores<T>(f: &Fused<T>, kind: Kind) -> bool {
    match kind {
        Kind::Q => true,
        Kind::K => !f.rope.k.out.is_null() || !f.slots.is_null(),
        Kind::V => !f.slots.is_null(),
    }
}

/// Tensor `kind`'s input and its batch, seq and head strides: values, not a reference to one
/// of the three tensors (a reference chosen at run time kept the arguments in local memory).
#[inline(always)]
fn input_of<T>(f: &Fused<T>, kind: Kind) -> (*const T, [u64; 3]) {
    let a = &f.rope;
    match kind {
        Kind::Q => (a.q.x, a.q.x_strides),
        Kind::K => (a.k.x, a.k.x_strides),
        Kind::V => (f.v.x, f.v.x_strides),
    }
}

/// The element offset of head `i` of token `(b, s)` in a tensor of batch, seq and head
/// `strides`.
#[inline(always)]
fn head_offset(strides: [u64; 3], (b, s): (u64, u64), i: u64) -> u64 {
    b * strides[0] + s * strides[1] + i * strides[2]
}

/// The FP8 scales of the stores of tensor `kind`'s heads: q's output's, or the cache's (k's and
/// v's only write FP8 into a cache, so a token without a slot takes none).
///
/// # Safety
/// FP8 destinations have their scales (the entry points' promise).
#[inline(always)]
unsafe fn scales_for<T>(f: &Fused<T>, kind: Kind, has_slot: bool) -> Scales {
    // SAFETY: the entry points' promise; the k and v scales serve only cache stores, which need
    // a slot.
    unsafe {
        match kind {
            Kind::Q => Scales::new(f.q_format, f.q_scale, f.q_scale_step),
            _ if !has_slot => Scales::new(FormatCode::Elem as u32, f.k_scale, 0),
            Kind::K => Scales::new(f.cache_format, f.k_scale, f.k_scale_step),
            Kind::V => Scales::new(f.cache_format, f.v_scale, f.v_scale_step),
        }
    }
}

/// Stores head `i` of tensor `kind` of the token, its values `y` (rotated and normalised, or v's
/// as read), to every destination the launch has for it: q's output; k's output and its cache
/// slot; v's cache slot (`slot`: the token's slot offset, if it writes the cache). `at(strides)`
/// is the element offset of this head of the token in a tensor of those batch, seq and head
/// strides (in the width each body's promises allow).
///
/// # Safety
/// The destinations address this head's elements inside their tensors or the cache's slot (the
/// entry points' promises), aligned to `lanes`; `scales` come from [`scales_for`].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn store_outputs<T: Elem, P: Pairing, const L: usize>(
    f: &Fused<T>,
    (kind, i): (Kind, usize),
    at: impl Fn([u64; 3]) -> usize,
    slot: Option<u64>,
    scales: &Scales,
    pairs: (usize, usize),
    y: &[[f32; L]; 2],
) {
    let a = &f.rope;
    let cache_head = |cache: *mut u8, slot: u64| {
        cache.wrapping_add(
            (slot + i as u64 * f.cache_strides[2]) as usize * format_bytes::<T>(f.cache_format),
        )
    };
    // SAFETY (each store): the caller's promises.
    unsafe {
        match kind {
            Kind::Q => {
                let out = a.q.out.cast::<u8>();
                let head = out.wrapping_add(at(a.q.out_strides) * format_bytes::<T>(f.q_format));
                store_head::<T, P, L>(head, scales.of(i), pairs, y);
            }
            Kind::K => {
                if !a.k.out.is_null() {
                    store_head::<T, P, L>(a.k.out.add(at(a.k.out_strides)).cast(), None, pairs, y);
                }
                if let Some(slot) = slot {
                    store_head::<T, P, L>(cache_head(f.k_cache, slot), scales.of(i), pairs, y);
                }
            }
            Kind::V => {
                if let Some(slot) = slot {
                    store_head::<T, P, L>(cache_head(f.v_cache, slot), scales.of(i), pairs, y);
                }
            }
        }
    }
}

/// The norm's weights at this item's elements of a head of tensor `kind` (q's or k's), as
/// loaded (see [`weights_f32`]): those of pair `j0` of `half`, from element `skip` on (0 but for
/// a partial head's features past the rotation).
///
/// # Safety
/// The weights hold `head_dim` elements aligned like a head; `j0` is this item's first pair and
/// `skip` a multiple of the access.
#[inline(always)]
unsafe fn load_weights<T: Elem, P: Pairing, const L: usize>(
    f: &Fused<T>,
    kind: Kind,
    (skip, j0, half): (usize, usize, usize),
) -> [[T; L]; 2] {
    let weights = if kind == Kind::Q {
        f.q_norm_weight
    } else {
        f.k_norm_weight
    };
    // SAFETY: the caller's promise.
    unsafe { load_head::<T, P, L>(weights.add(skip), j0, half) }
}

/// Loaded norm weights in `f32`, with `1` added for [`NormCode::RmsOnePlus`].
#[inline(always)]
fn weights_f32<T: Elem, const L: usize>(f: &Fused<T>, raw: [[T; L]; 2]) -> [[f32; L]; 2] {
    let mut w = widen(raw);
    if f.norm == NormCode::RmsOnePlus as u32 {
        unrolled(L, |k| {
            w[0][k] += 1.0;
            w[1][k] += 1.0;
        });
    }
    w
}

/// The norm's weights at this item's elements of a head of tensor `kind` (q's or k's), in
/// `f32`, with `1` added for [`NormCode::RmsOnePlus`].
///
/// # Safety
/// As [`load_weights`].
#[inline(always)]
unsafe fn norm_weights<T: Elem, P: Pairing, const L: usize>(
    f: &Fused<T>,
    kind: Kind,
    pairs: (usize, usize),
) -> [[f32; L]; 2] {
    // SAFETY: the caller's promise.
    weights_f32(f, unsafe {
        load_weights::<T, P, L>(f, kind, (0, pairs.0, pairs.1))
    })
}

/// The sum of the squares of one head's loaded values (as [`load_head`] lays them out), with
/// fused multiply-adds.
#[inline(always)]
fn sum_squares<P: Pairing, const L: usize>(v: &[[f32; L]; 2]) -> f32 {
    let mut sum = 0.0f32;
    unrolled(L, |k| {
        sum = mul_add(v[0][k], v[0][k], sum);
        if P::NEOX {
            sum = mul_add(v[1][k], v[1][k], sum);
        }
    });
    sum
}

/// Normalises one head's values in place: `x_e <- x_e * r * w_e`, where `r = 1 / sqrt(sum *
/// inv_dim + eps)` is the head's factor ([`norm_factor`]).
#[inline(always)]
fn normalise<const L: usize>(v: &mut [[f32; L]; 2], w: &[[f32; L]; 2], r: f32) {
    unrolled(L, |k| {
        v[0][k] = v[0][k] * r * w[0][k];
        v[1][k] = v[1][k] * r * w[1][k];
    });
}

/// Heads `first..last` of the q, k, v concatenation for this item, in blocks inside one tensor:
/// [`HEADS_UNROLL`] heads while that many are left in the tensor, then one at a time.
/// One loop with the tensor chosen at run time, so that one copy of each block's code serves
/// q, k and v: a loop per tensor kept each tensor's loop-invariant values live through the
/// whole item loop, well past the 64-register cap.
///
/// # Safety
/// `last <=` the heads of q, k and v; the item's token exists; the promises of the entry
/// points.
#[inline(always)]
unsafe fn item_heads<T: Elem, P: Pairing, const L: usize>(
    f: &Fused<T>,
    item: &Item<L>,
    (first, last): (u32, u32),
) {
    let (hq, hk) = (f.rope.q.heads, f.rope.k.heads);
    let mut h = first;
    while h < last {
        let (kind, start, end) = if h < hq {
            (Kind::Q, 0, hq)
        } else if h - hq < hk {
            (Kind::K, hq, hq + hk)
        } else {
            (Kind::V, hq + hk, last)
        };
        let end = end.min(last);
        if !stores(f, kind) {
            h = end;
            continue;
        }
        let (i, left) = (h - start, end - h);
        // SAFETY (each block): heads i..i + U of the tensor lie before `end`.
        unsafe {
            if left >= HEADS_UNROLL as u32 {
                fused_block::<T, P, L, HEADS_UNROLL>(f, item, kind, i);
                h += HEADS_UNROLL as u32;
            } else {
                fused_block::<T, P, L, 1>(f, item, kind, i);
                h += 1;
            }
        }
    }
}

/// `$body` for `$u` = 0, ..., `$count - 1` as straight-line code, for `$count <= 4`: as
/// [`unrolled`], for bodies too large for LLVM to inline a closure of them (which then became a
/// function with its captures in local memory).
macro_rules! each_head {
    ($count:expr, $u:ident => $body:block) => {
        if $count > 4 {
            trap()
        }
        each_head!(@ $count, $u, $body, 0 1 2 3)
    };
    (@ $count:expr, $u:ident, $body:block, $($k:literal)*) => {
        $(if $k < $count {
            let $u: usize = $k;
            $body
        })*
    };
}

// After `each_head!`, which it uses.
mod nvfp4;

/// Heads `h..h + U` of tensor `kind` (indices in that tensor): every load, then the norm (q and
/// k, with their weights' elements of this item), then the rotations and stores.
///
/// # Safety
/// As [`item_heads`], for `h + U <=` the tensor's heads.
#[inline(always)]
unsafe fn fused_block<T: Elem, P: Pairing, const L: usize, const U: usize>(
    f: &Fused<T>,
    item: &Item<L>,
    kind: Kind,
    h: u32,
) {
    let h = h as usize;
    let a = &f.rope;
    let norm = f.norm != NormCode::None as u32 && kind != Kind::V;
    let mut w = [[0.0f32; L]; 2];
    if norm && item.active {
        // SAFETY: the weights hold head_dim elements aligned like a head.
        w = unsafe { norm_weights::<T, P, L>(f, kind, item.pairs()) };
    }
    // SAFETY: FP8 destinations have their scales (the entry points' promise).
    let scales = unsafe { scales_for(f, kind, item.slot.get().is_some()) };
    let (x, x_strides) = input_of(f, kind);
    let (b, s) = (item.token.0 as u64, item.token.1 as u64);
    let (j0, half) = item.pairs();
    let mut raw = [[[T::ZERO; L]; 2]; U];
    if item.active {
        unrolled(U, |u| {
            let offset = head_offset(x_strides, (b, s), (h + u) as u64);
            // SAFETY: head h + u of this tensor exists at its strides; j0 is this item's pair.
            raw[u] = unsafe { load_head::<T, P, L>(x.add(offset as usize), j0, half) };
        });
    }
    let mut v = [[[0.0f32; L]; 2]; U];
    unrolled(U, |u| v[u] = widen(raw[u]));
    if norm {
        // Every lane of the warp takes this branch: `norm` and the heads are the grid's.
        let mut squares = [0.0f32; U];
        unrolled(U, |u| squares[u] = sum_squares::<P, L>(&v[u]));
        // Recomputed per block (four instructions) rather than held in a register throughout.
        let inv_dim = reciprocal(f.head_dim as f32);
        let sums = segment_sums(squares, a.groups.divisor.get());
        unrolled(U, |u| {
            normalise(&mut v[u], &w, norm_factor(sums[u], inv_dim, f.norm_eps))
        });
    }
    if !item.active {
        return;
    }
    each_head!(U, u => {
        let i = h + u;
        let y = match kind {
            Kind::V => v[u],
            _ => rotate_values_with::<P, L>(|p, k| v[u][p][k], &item.cos, &item.sin, rotate_fma),
        };
        // SAFETY: head i of this tensor and the item's token and slot, whose destinations the
        // entry points promise; `scales` from `scales_for`.
        unsafe {
            let slot = item.slot.get();
            let at = |strides: [u64; 3]| head_offset(strides, (b, s), i as u64) as usize;
            store_outputs::<T, P, L>(f, (kind, i), at, slot, &scales, (j0, half), &y)
        };
    });
}

/// Computes pair `e = threadIdx.x` (for `e < half`) of token `(b, s)`'s cos and sin into the
/// block's shared array from element `base`: cos at `base + e`, sin at `base + half + e`; the
/// position of pair `e` is its rotating group's (`e / pairs`), as [`cos_sin`] finds it. One
/// pair per thread, no loop: the position's code (a match over every position kind) inside a
/// loop took the kernels to their register limit, or spilled under a cap.
///
/// # Safety
/// `base + 2 * half <=` [`SHARED_F32`]; `(b, s)` is a token; the position and frequency
/// promises.
#[inline(always)]
pub(crate) unsafe fn share_cos_sin<T: Elem, S: Source>(
    a: &Args<T>,
    (b, s): (u32, u32),
    pairs: usize,
    base: u32,
) {
    let (half, e) = (a.half, thread_idx_x());
    if e < half {
        // SAFETY: e < half, the pairs the position and frequency arrays describe; the buffer
        // holds base + 2 * half <= SHARED_F32 values.
        unsafe {
            // The pair's frequency is loaded before its position, so that their latencies
            // overlap.
            let freq = preload_frequencies::<T, S, 1>(a, e as usize, 1);
            let pos = position(a, u64::from(b), u64::from(s), e / pairs as u32);
            let (c, sn) = cos_sin_preloaded::<T, S, 1>(a, pos, (e as usize, 1), &freq);
            shared_store_f32(base + e, c[0]);
            shared_store_f32(base + half + e, sn[0]);
        }
    }
}

/// Reads cos and sin of pairs `j0..j0 + pairs` from the block's shared array (as
/// [`share_cos_sin`] writes it from element `base`), with one shared-memory access per array.
///
/// # Safety
/// `base + 2 * half <=` [`SHARED_F32`]; `base`, `j0` and `half` are multiples of `pairs`,
/// `j0 + pairs <= half` (the pairs come in whole groups), so both reads are aligned to their
/// width; the array was written before a barrier this thread has passed since.
#[inline(always)]
pub(crate) unsafe fn read_cos_sin<const L: usize>(
    (base, half): (u32, u32),
    (j0, pairs): (usize, usize),
) -> ([f32; L], [f32; L]) {
    let mut cs = ([0.0f32; L], [0.0f32; L]);
    let (c0, s0) = (base + j0 as u32, base + half + j0 as u32);
    // SAFETY: the caller's promises.
    unsafe {
        match pairs {
            4 => {
                let (c, sn) = (shared_load_f32s::<4>(c0), shared_load_f32s::<4>(s0));
                unrolled(4, |k| (cs.0[k % L], cs.1[k % L]) = (c[k], sn[k]));
            }
            2 => {
                let (c, sn) = (shared_load_f32s::<2>(c0), shared_load_f32s::<2>(s0));
                unrolled(2, |k| (cs.0[k % L], cs.1[k % L]) = (c[k], sn[k]));
            }
            _ => unrolled(pairs, |k| {
                let k32 = k as u32;
                cs.0[k % L] = shared_load_f32s::<1>(c0 + k32)[0];
                cs.1[k % L] = shared_load_f32s::<1>(s0 + k32)[0];
            }),
        }
    }
    cs
}

/// The FP8 multipliers (`1 / scale`) of `U` consecutive heads from `i0` of a destination whose
/// scales are `scale[head * step]`: one reciprocal for a per-tensor scale (`step` 0), one per
/// live head otherwise; the destination's `multiplier` where `scale` is null. `rcp.approx.ftz`
/// (within one `f32` ulp of a normal scale; E4M3 and E5M2 keep 3 and 2 bits).
///
/// # Safety
/// `scale` is null or holds one `f32` (`step` 0) or one per head, for every head `i0 + u` with
/// `live[u]`; `live[0]` when any is.
#[inline(always)]
unsafe fn fp8_multipliers<const U: usize, const FI: bool>(
    dest: &Fp8Dest,
    i0: u32,
    live: [bool; U],
) -> [f32; U] {
    let (scale, step) = (dest.scale, dest.step);
    let first = if FI && scale.is_null() {
        dest.multiplier
    } else {
        // SAFETY: head i0 is live (the caller's promise), so its scale exists.
        rcp_approx_ftz(unsafe { *scale.add((i0 * step) as usize) })
    };
    let mut m = [first; U];
    if step != 0 {
        unrolled(U, |u| {
            if u > 0 && live[u] {
                // SAFETY: head i0 + u is live, so its scale exists.
                m[u] = rcp_approx_ftz(unsafe { *scale.add((i0 + u as u32) as usize) });
            }
        });
    }
    m
}

/// The token-heads body ([`Mapping::TokenHeads`]: `U` two, or four for the four-heads kernels)
/// for `L` elements per access.
///
/// A token's threads form a sequence of warps: q's `q_warps`, then k's `k_warps`, then v's
/// `v_warps`, each tensor's threads (one per `U` consecutive heads and one group: thread `n` of
/// a tensor takes heads `U (n / groups) ..` and group `n % groups`) in warps of their own, so
/// the tensor, its pointers, strides and stores are the same in a whole warp. Block
/// `blockIdx.x` holds warps `blockIdx.x * blockDim.x / 32 ..` of the sequence of token
/// `blockIdx.z * gridDim.y + blockIdx.y`, so that one cos/sin computation serves every q and k
/// warp of the block.
///
/// A thread issues its heads' loads (in the four-heads kernels, then asks L2 for a line of its
/// place's heads `prefetch_tokens` tokens on: [`prefetch_ahead`]), finds its cos/sin (table
/// rows; or from the block's shared arithmetic), then normalises (with the sums of each head's
/// `groups` lanes), rotates and stores, with element offsets in 32 bits. Lanes past the tensor's last head or its
/// `rot_groups` load and store nothing but take part in the barrier and the shuffles; warps
/// past the sequence leave at once unless they compute cos/sin for the block, and the barrier
/// counts the warps that stay.
///
/// At prefill the kernels are bound by the instructions they issue, so what a thread does
/// besides its loads and stores is shared by its heads (the index splits by magic numbers, the
/// offsets, the position and cos/sin, the norm weights, the cache slot, the FP8 multipliers),
/// and each store format is a branch uniform in the warp rather than predicated code every
/// thread issues.
///
/// # Safety
/// The promises of the entry points, and: `gridDim.y * gridDim.z >= tokens`; `blockDim.x` is a
/// multiple of 32; `q_warps`, `k_warps` and `v_warps` count `U` heads per thread; every tensor
/// and output spans fewer than 2^32 elements; the cache holds at most 2^32 slots; tables suit
/// [`PlannedTable`] ([`crate::abi::planned_table_fits`]).
#[inline(always)]
unsafe fn token_heads_body<
    T: Elem,
    P: Pairing,
    S: Source,
    const L: usize,
    const U: usize,
    const FI: bool,
    const PARTIAL: bool,
    const FP4: bool,
    const LONG: bool,
>(
    f: &Fused<T>,
) {
    let a = &f.rope;
    let pairs = if P::NEOX { L } else { L / 2 };
    let groups = a.groups.divisor.get();
    let norm = f.norm != NormCode::None as u32;
    let (tid, block_threads) = (thread_idx_x(), block_dim_x());
    // `LONG`: a norm over 64 or 128 groups, summed across the head's warps (`warps_sum`: the
    // host's blocks hold whole segments of them).
    if LONG {
        if NormCode::from_u32(f.norm).is_none()
            || (norm && groups != 64 && groups != 128)
            || block_threads % 32 != 0
        {
            trap()
        }
    } else if NormCode::from_u32(f.norm).is_none()
        || (norm && groups > 32)
        || block_threads % 32 != 0
    {
        trap()
    }
    // Below 2^32: the host's grid has at most 65535 rows of 65535 tokens.
    let token = block_idx_z() * grid_dim_y() + block_idx_y();
    // Whole blocks leave together: the barrier and the shuffles below need every thread.
    if u64::from(token) >= a.tokens {
        return;
    }
    // Uniform in the block: its blocks past the rotation's take the non-rotary parts.
    if FI && block_idx_x() >= f.nope.rope_blocks {
        // SAFETY: token < tokens; the entry points' promises for the non-rotary parts.
        unsafe {
            if T::SIZE == 4 {
                non_rotary::<T, 4>(f, token)
            } else {
                non_rotary::<T, 8>(f, token)
            }
        }
        return;
    }
    let first_warp = block_idx_x() * (block_threads / 32);
    let warp = first_warp + tid / 32;
    let qk_warps = f.q_warps + f.k_warps;
    let all_warps = qk_warps + f.v_warps;
    // `LONG`: the block's q and k warps, which normalise, meet at one barrier for their sums.
    let normed_threads = if LONG {
        qk_warps
            .min(first_warp + block_threads / 32)
            .saturating_sub(first_warp)
            * 32
    } else {
        0
    };
    let (kind, warp_in_tensor, heads) = if warp < f.q_warps {
        (Kind::Q, warp, a.q.heads)
    } else if warp < qk_warps {
        (Kind::K, warp - f.q_warps, a.k.heads)
    } else {
        (Kind::V, warp - qk_warps, f.v.heads)
    };
    let half = a.half;
    // Uniform in the block: a block of v's warps alone finds no cos/sin.
    let shared = !S::TABLE
        && first_warp < qk_warps
        && half <= block_threads
        && 2 * half as usize <= SHARED_F32;
    // The block's first warps hold its part of the sequence and, with shared cos/sin, the
    // warps of its first `half` threads: the warps that stay are the longer of the two.
    let meeting = (all_warps.saturating_sub(first_warp) * 32)
        .min(block_threads)
        .max(if shared { half.next_multiple_of(32) } else { 0 });
    if tid >= meeting {
        return;
    }
    let (m, group) = a.groups.div_rem_u32(warp_in_tensor * 32 + tid % 32);
    let i0 = m * U as u32;
    let working = warp < all_warps && stores(f, kind);
    let mut live = [false; U];
    unrolled(U, |u| {
        live[u] = working && i0 + (u as u32) < heads && group < a.rot_groups
    });
    // Partial heads (`PARTIAL`): the features past the rotation belong to the groups after the
    // rotation's (see `passed_features`); they are normalised and stored as the others, not
    // rotated.
    let passed = if PARTIAL {
        passed_features::<T>(f, group, pairs)
    } else {
        None
    };
    if passed.is_some() {
        unrolled(U, |u| live[u] = working && i0 + (u as u32) < heads);
    }
    // The first head is live whenever any is.
    let active = live[0];
    let rotates = kind != Kind::V;
    let (b, s) = a.seq.div_rem_u32(token);
    // This thread's features of each head: pairs `j0..j0 + pairs` of `half_z` from element
    // `skip` on.
    let (skip, j0, half_z) = match passed {
        Some(at) => at,
        None => (0, group as usize * pairs, half as usize),
    };
    let (x, x_strides) = input_of(f, kind);
    let (first, head_stride) = (offset_u32(x_strides, (b, s), i0), x_strides[2] as u32);
    let first = first + skip as u32;
    // Every global access comes after this: the set-up above overlaps the previous grid in a
    // programmatic dependent launch (sm_90 builds; nothing before sm_90).
    wait_for_prior_grids();
    // The heads' loads are in flight while the table rows are read or sin/cos computed.
    let mut raw = [[[T::ZERO; L]; 2]; U];
    unrolled(U, |u| {
        if live[u] {
            let at = first + u as u32 * head_stride;
            // SAFETY: head i0 + u of this tensor exists at its strides (its offset within the
            // span, below 2^32); j0 is this thread's first pair.
            raw[u] = unsafe { load_head::<T, P, L>(x.add(at as usize), j0, half_z) };
        }
    });
    // Partial heads' groups all ask, for the rotated features and those past them.
    if U == FOUR_HEADS_U && working && (PARTIAL || group < a.rot_groups) {
        let ahead = (&f.rope, f.prefetch_tokens);
        let head = (i0, heads);
        prefetch_ahead::<T, U, PARTIAL>(
            ahead,
            (x, x_strides),
            token,
            head,
            group,
            (half, f.head_dim),
        );
    }
    // k's and v's warps ask for the token's cache slot to be brought into L2 with their
    // heads' loads, so that its load where the stores need it, after the norm, finds it there
    // rather than in memory. A prefetch holds no register (the slot loaded here and held
    // through the norm made ptxas spill). Four-heads kernels only: the two-heads kernels, at
    // decode, were slower with it (docs/perf/decisions.md).
    if U == FOUR_HEADS_U && kind != Kind::Q && active && !f.slots.is_null() {
        let width = if f.slots_wide != 0 { 8 } else { 4 };
        prefetch_l2(f.slots.cast::<u8>().wrapping_add(token as usize * width));
    }
    // With tables, the norm's weights (as loaded: fewer registers) are in flight with the
    // heads; with sin/cos computed they are loaded after the block's barrier (held across it,
    // they spilled the computed kernels at their register cap), and so in the four-heads
    // kernels but the NeoX 16-bit ones (held across the table reads, they made ptxas spill the
    // interleaved 16-bit and the `f32` ones).
    let early = S::TABLE && (U == TWO_HEADS_U || (P::NEOX && T::SIZE == 2));
    let normed = norm && rotates;
    let weights = || {
        let mut raw = [[T::ZERO; L]; 2];
        if normed && active {
            // SAFETY: the weights hold head_dim elements aligned like a head.
            raw = unsafe { load_weights::<T, P, L>(f, kind, (skip, j0, half_z)) };
        }
        raw
    };
    let early_weights = if early { weights() } else { [[T::ZERO; L]; 2] };
    if shared {
        // SAFETY: 2 * half fits the buffer; (b, s) is a token (token < tokens); every thread
        // of the block that stays is here, with the same token.
        unsafe { share_cos_sin::<T, S>(a, (b, s), pairs, 0) };
        sync_threads_count(meeting);
    }
    let (cos, sin) = if !(rotates && active) || passed.is_some() {
        ([0.0; L], [0.0; L])
    } else if shared {
        // SAFETY: j0 + pairs <= half, j0 and half multiples of pairs; the buffer was written
        // before the barrier above.
        unsafe { read_cos_sin::<L>((0, half), (j0, pairs)) }
    } else {
        let (b, s) = (u64::from(b), u64::from(s));
        // SAFETY: (b, s) is a token; j0 + pairs <= half; the position, table and frequency
        // promises.
        unsafe {
            // With a table, the position is kept in L2 as its row is: a token's two reads in a
            // row otherwise waited on memory for the position, which made table launches at
            // prefill a little slower (docs/perf/decisions.md). With sin/cos computed, the same
            // reads made ptxas spill the four-heads kernels.
            if S::TABLE {
                let pos = position_read::<T, KeptInL2>(a, b, s, group);
                cos_sin_read::<T, S, PlannedTable, L>(a, pos, j0, pairs)
            } else {
                cos_sin::<T, S, L>(a, position(a, b, s, group), j0, pairs)
            }
        }
    };
    let mut v = [[[0.0f32; L]; 2]; U];
    unrolled(U, |u| v[u] = widen(raw[u]));
    if normed {
        // Uniform in the warp, so the shuffles have the whole warp.
        let w = weights_f32(f, if early { early_weights } else { weights() });
        let mut squares = [0.0f32; U];
        unrolled(U, |u| squares[u] = sum_squares::<P, L>(&v[u]));
        // Exact for powers of two, within one ulp otherwise.
        let inv_dim = rcp_approx_ftz(f.head_dim as f32);
        // The whole warp is here. Said before the shuffles (not inside `norm_factors`, whose
        // branch on the width LLVM copied it into), ptxas checks no divergence before each
        // shuffle, and spills none of the registers the fallback paths held.
        sync_warp();
        let factors =
            norm_factors::<U, LONG>(squares, (groups, normed_threads), inv_dim, f.norm_eps);
        unrolled(U, |u| normalise(&mut v[u], &w, factors[u]));
    }
    let y = |u: usize| {
        if rotates && passed.is_none() {
            rotate_values_with::<P, L>(|p, k| v[u][p][k], &cos, &sin, rotate_fma)
        } else {
            v[u]
        }
    };
    // NVFP4 caches: each block's largest magnitude, exchanged while the whole warp is here, so
    // that the shuffles name all 32 lanes (among the storing lanes alone they would name a
    // block's lanes and carry convergence code). Uniform in the warp.
    let tops = if FP4 && kind != Kind::Q {
        nvfp4::block_maxima::<P, L, U>(&y, live)
    } else {
        [[0.0; 2]; U]
    };
    if !active {
        return;
    }
    let at = (j0, half_z);
    // SAFETY (every store below): head i0 + u of the tensor and token (b, s) exists when
    // `live[u]`, and the entry points promise its destinations (spanning fewer than 2^32
    // elements, aligned to `lanes`) and FP8 destinations' scales.
    unsafe {
        match kind {
            Kind::Q => {
                let first = offset_u32(a.q.out_strides, (b, s), i0) + skip as u32;
                let heads = (u64::from(first), u64::from(a.q.out_strides[2] as u32));
                let scales = (f.q_scale, f.q_scale_step);
                let dest = Fp8Dest::of::<FI>(f.q_format, scales, f.q_multiplier);
                store_heads::<T, P, L, U, FI>(a.q.out.cast(), heads, (live, i0), dest, at, &y);
            }
            _ => {
                // NVFP4 caches find the slot's block and row, which address both its codes and
                // its block scales.
                // SAFETY: token < tokens; the cache holds at most 2^32 slots (the token-heads
                // promise).
                let place = if FP4 { cache_place(f, token) } else { None };
                let slot = if FP4 {
                    place.map(|(b, r)| {
                        u64::from(b) * f.cache_strides[0] + u64::from(r) * f.cache_strides[1]
                    })
                } else {
                    cache_slot_u32::<T, FI>(f, u64::from(token))
                };
                if kind == Kind::K && !a.k.out.is_null() {
                    let first = offset_u32(a.k.out_strides, (b, s), i0) + skip as u32;
                    let heads = (u64::from(first), u64::from(a.k.out_strides[2] as u32));
                    // An FP8 k output is one of FlashInfer's forms (two-heads kernels only).
                    let dest = if FI {
                        let scales = (f.k_scale, f.k_scale_step);
                        Fp8Dest::of::<FI>(f.k_format, scales, f.k_multiplier)
                    } else {
                        None
                    };
                    store_heads::<T, P, L, U, FI>(a.k.out.cast(), heads, (live, i0), dest, at, &y);
                }
                if let Some(slot) = slot {
                    let (cache, scale, multiplier) = match kind {
                        Kind::K => (f.k_cache, (f.k_scale, f.k_scale_step), f.k_multiplier),
                        _ => (f.v_cache, (f.v_scale, f.v_scale_step), f.v_multiplier),
                    };
                    let stride = f.cache_strides[2];
                    let heads = (slot + u64::from(i0) * stride + skip as u64, stride);
                    if FP4 {
                        let block_scales = match kind {
                            Kind::K => f.k_block_scales,
                            _ => f.v_block_scales,
                        };
                        let cache = nvfp4::Nvfp4Cache {
                            codes: cache,
                            block_scales,
                            global: scale,
                        };
                        let ss = f.block_scale_strides;
                        let (b, r) = place.unwrap_or((0, 0));
                        let scales = (
                            u64::from(b) * ss[0] + u64::from(r) * ss[1] + u64::from(i0) * ss[2],
                            ss[2],
                        );
                        let at_heads = (heads, scales);
                        let heads = (live, i0);
                        nvfp4::store_heads::<P, L, U>(&cache, at_heads, heads, (at, &tops), &y);
                    } else {
                        let dest = Fp8Dest::of::<FI>(f.cache_format, scale, multiplier);
                        store_heads::<T, P, L, U, FI>(cache, heads, (live, i0), dest, at, &y);
                    }
                }
            }
        }
    }
}

/// A partial head's features past the rotation (the `_partial` kernels): the `head_dim - 2
/// half` of them belong to the groups after the rotation's `rot_groups`, `2 pairs` features
/// each, laid out as the rotation's from element `2 half` on (NeoX: each group's two vectors
/// `(head_dim - 2 half) / 2` apart). For such a group, `(skip, j0, half)` of its features:
/// pairs `j0..j0 + pairs` of `half` from element `skip` on; `None` for the other groups.
#[inline(always)]
fn passed_features<T>(f: &Fused<T>, group: u32, pairs: usize) -> Option<(usize, usize, usize)> {
    let (half, rot_groups) = (f.rope.half, f.rope.rot_groups);
    let pass = f.head_dim.saturating_sub(2 * half);
    let passed = group
        .checked_sub(rot_groups)
        .filter(|g| *g < pass / (2 * pairs as u32))?;
    Some((
        2 * half as usize,
        passed as usize * pairs,
        pass as usize / 2,
    ))
}

/// FlashInfer's non-rotary parts, in the blocks of token `token`'s row from `rope_blocks` on:
/// thread `n` of those blocks takes accesses `i + j * threads` (`N` elements, 16 bytes; `i = n %
/// threads`, `j` below [`NOPE_ACCESSES_PER_THREAD`], those below `accesses`) of head `n /
/// threads` of q's part, then k's, then v's (see [`NopeCached::V`]), loads them all, then
/// stores each unrotated as `fp8(x * m)`: q's in the format and with the multiplier `m` of q's
/// FP8 output; k's in those of k's FP8 output, or of the cache with k's scale when the part is
/// cached; v's in the cache's with v's scale. Into a cache of the tensors' type a cached part is
/// stored as loaded. A cached part of a token without a slot, and threads past the heads,
/// store nothing.
///
/// # Safety
/// `token < tokens`; the entry points' promises for the non-rotary parts (each part's heads
/// inside its input and output, aligned to one access (`N` elements of the input, and of the
/// output's format), spanning fewer than 2^32 elements; a cache part's heads inside the cache
/// for every slot below `cache_slots`),
/// and an FP8 output of the rotated part of each uncached part given.
#[inline(always)]
unsafe fn non_rotary<T: Elem, const N: usize>(f: &Fused<T>, token: u32) {
    let n = &f.nope;
    let index = (block_idx_x() - n.rope_blocks) * block_dim_x() + thread_idx_x();
    let (head, lane) = n.threads.div_rem_u32(index);
    let q_heads = if n.q.is_null() { 0 } else { f.rope.q.heads };
    let k_heads = if n.k.is_null() { 0 } else { f.rope.k.heads };
    let v_heads = if n.cached.has(NopeCached::V) {
        f.v.heads
    } else {
        0
    };
    // Scalars chosen one by one: a tuple of the part's arrays went to local memory.
    let is_q = head < q_heads;
    let is_k = !is_q && head - q_heads < k_heads;
    if !is_q && !is_k && head - q_heads - k_heads >= v_heads {
        return;
    }
    let head = if is_q {
        head
    } else if is_k {
        head - q_heads
    } else {
        head - q_heads - k_heads
    };
    let cached = !is_q && (!is_k || n.cached.has(NopeCached::K));
    let (format, scale, step, multiplier) = if is_q {
        (f.q_format, f.q_scale, f.q_scale_step, f.q_multiplier)
    } else if !cached {
        (f.k_format, f.k_scale, f.k_scale_step, f.k_multiplier)
    } else if is_k {
        (f.cache_format, f.k_scale, f.k_scale_step, f.k_multiplier)
    } else {
        (f.cache_format, f.v_scale, f.v_scale_step, f.v_multiplier)
    };
    // A cached part goes into a cache of the tensors' type unconverted; an uncached part's
    // output is FP8 (the host's rule).
    let elem = format == FormatCode::Elem as u32;
    if elem && !cached {
        trap()
    }
    // Bytes per element of the destination.
    let size = if elem { T::SIZE as u32 } else { 1 };
    let stride = n.threads.divisor.get();
    // Every global access comes after this (see `token_heads_body`).
    wait_for_prior_grids();
    // SAFETY: the head and its access lie inside the part's input and output (a cached part's
    // inside the cache, its slot below `cache_slots`), aligned (the caller's promise); a scale
    // array holds this head's (`fp8_multipliers`).
    unsafe {
        let (x, out) = if is_q {
            let at = token * n.q_strides[0] + head * n.q_strides[1];
            let to = token * n.q_out_strides[0] + head * n.q_out_strides[1];
            (n.q.add(at as usize), n.q_out.add(to as usize))
        } else if !cached {
            let at = token * n.k_strides[0] + head * n.k_strides[1];
            let to = token * n.k_out_strides[0] + head * n.k_out_strides[1];
            (n.k.add(at as usize), n.k_out.add(to as usize))
        } else {
            let Some((block, row)) = cache_place::<T>(f, token) else {
                return;
            };
            // The cache offsets count elements of the cache's format, `size` bytes each.
            if is_k {
                let at = token * n.k_strides[0] + head * n.k_strides[1];
                let [sb, sr, sh] = n.cache_strides;
                let to = u64::from(block) * sb + u64::from(row) * sr + u64::from(head) * sh;
                (
                    n.k.add(at as usize),
                    n.k_out.add((to * u64::from(size)) as usize),
                )
            } else {
                let (b, s) = f.rope.seq.div_rem_u32(token);
                let at = offset_u32(f.v.x_strides, (b, s), head) + f.head_dim;
                let [sb, sr, sh] = f.cache_strides;
                let to = u64::from(block) * sb + u64::from(row) * sr + u64::from(head) * sh;
                let to = (to + u64::from(f.head_dim)) * u64::from(size);
                (f.v.x.add(at as usize), f.v_cache.add(to as usize))
            }
        };
        let m = if scale.is_null() {
            multiplier
        } else {
            rcp_approx_ftz(*scale.add((head * step) as usize))
        };
        // Every load in flight before the first store.
        const J: usize = NOPE_ACCESSES_PER_THREAD as usize;
        let mut raw = [[T::ZERO; N]; J];
        unrolled(J, |j| {
            let access = lane + j as u32 * stride;
            if access < n.accesses {
                raw[j] = crate::access::load::<T, N>(x.add((access * N as u32) as usize));
            }
        });
        unrolled(J, |j| {
            let access = lane + j as u32 * stride;
            if access < n.accesses {
                let o = out.add((access * N as u32 * size) as usize);
                if elem {
                    crate::access::store::<T, N>(o.cast(), raw[j]);
                    return;
                }
                let mut v = T::widen(raw[j]);
                unrolled(N, |e| v[e] *= m);
                if format == FormatCode::E5m2 as u32 {
                    Fp8E5m2::store_rounded::<N>(o.cast(), v)
                } else {
                    Fp8::store_rounded::<N>(o.cast(), v)
                }
            }
        });
    }
}

/// Token `t`'s cache slot as its block and row, or `None` when the token writes no cache (see
/// [`slot_in_cache`]); FlashInfer's forms.
///
/// # Safety
/// As [`cache_slot_u32`].
#[inline(always)]
unsafe fn cache_place<T>(f: &Fused<T>, t: u32) -> Option<(u32, u32)> {
    if f.slots.is_null() {
        return None;
    }
    // SAFETY: the caller's promise.
    let slot = unsafe { slot_value::<T, true>(f, u64::from(t)) };
    // A slot below cache_slots <= 2^32 fits in u32.
    Some(f.block.div_rem_u32(slot_in_cache(f, slot)? as u32))
}

/// Asks L2 for this thread's share of the heads its place (heads `i0..i0 + U` of its tensor,
/// group `group`) takes in the token `prefetch_tokens` after `token`, if there is one: the
/// `U * lines` 128-byte lines of those heads' rotated `2 half` elements (`PARTIAL`: all
/// `head_dim`; `lines` per head) are spread over the place's groups that ask (those of the
/// rotation; `PARTIAL`: all), thread `group` taking line `group / U` of head `i0 + group % U`.
/// Those elements are two accesses of at most 16 bytes per asking group, so the askers are at
/// least `U * lines` for `U = 4`: every line is asked for.
///
/// A prefetch holds no register and no scoreboard, so the requests for tokens to come stay in
/// flight while the thread waits on its own loads, and those tokens' loads find L2 rather than
/// memory: memory holds more bytes in flight than the resident threads' own loads (30 warps per
/// multiprocessor at 64 registers). On devices of high DRAM bandwidth this made prefill
/// markedly faster, with tables and with sin/cos computed alike (docs/perf/decisions.md).
///
/// Touches no memory a thread reads or writes: a prefetch has no architectural effect, and the
/// addresses are those of heads that exist (`i0 + group % U < heads`, a token below `tokens`).
#[inline(always)]
fn prefetch_ahead<T, const U: usize, const PARTIAL: bool>(
    (a, prefetch_tokens): (&Args<T>, u32),
    (x, strides): (*const T, [u64; 3]),
    token: u32,
    (i0, heads): (u32, u32),
    group: u32,
    (half, head_dim): (u32, u32),
) {
    let ahead = u64::from(token) + u64::from(prefetch_tokens);
    if prefetch_tokens == 0 || ahead >= a.tokens {
        return;
    }
    // Below tokens, so below 2^32 (the token-heads grid's promise).
    let (b, s) = a.seq.div_rem_u32(ahead as u32);
    let line = (128 / size_of::<T>()) as u32;
    let (head, first) = (i0 + group % U as u32, (group / U as u32) * line);
    if head < heads && first < if PARTIAL { head_dim } else { 2 * half } {
        let at = offset_u32(strides, (b, s), head) + first;
        prefetch_l2(x.wrapping_add(at as usize));
    }
}

/// Stores the token-heads body's live heads `i0 + u` (`live[u]`), each's values `y(u)`, into a
/// destination whose head `i0 + u` starts `first + u * stride` elements of its format after
/// `base`: FP8 (`dest`) of the values times their multiplier ([`fp8_multipliers`]), else the
/// tensors' type.
///
/// # Safety
/// Those heads lie inside the destination, aligned to `lanes`; FP8 destinations' scales are
/// null or hold one `f32` (step 0) or one per head.
#[inline(always)]
unsafe fn store_heads<T: Elem, P: Pairing, const L: usize, const U: usize, const FI: bool>(
    base: *mut u8,
    (first, stride): (u64, u64),
    (live, i0): ([bool; U], u32),
    dest: Option<Fp8Dest>,
    at: (usize, usize),
    y: &impl Fn(usize) -> [[f32; L]; 2],
) {
    // SAFETY (each store): the caller's promises.
    unsafe {
        // One branch on the format for all the heads: inside the heads' stores, both formats'
        // code held the rotated heads at once, which made ptxas spill the four-heads kernels.
        match dest {
            Some(d) if d.e5m2 => store_fp8_heads::<Fp8E5m2, P, L, U, FI>(
                base,
                (first, stride),
                (live, i0),
                &d,
                at,
                y,
            ),
            Some(d) => {
                store_fp8_heads::<Fp8, P, L, U, FI>(base, (first, stride), (live, i0), &d, at, y)
            }
            None => {
                let base = base.cast::<T>();
                each_head!(U, u => { if live[u] {
                    let head = base.add((first + u as u64 * stride) as usize);
                    store_head::<T, P, L>(head.cast(), None, at, &y(u));
                } });
            }
        }
    }
}

/// [`store_heads`]'s FP8 stores, in the format `D`: each live head's values times its
/// multiplier ([`fp8_multipliers`]).
///
/// # Safety
/// As [`store_heads`], for a destination of `D`.
#[inline(always)]
unsafe fn store_fp8_heads<D: Elem, P: Pairing, const L: usize, const U: usize, const FI: bool>(
    base: *mut u8,
    (first, stride): (u64, u64),
    (live, i0): ([bool; U], u32),
    dest: &Fp8Dest,
    at: (usize, usize),
    y: &impl Fn(usize) -> [[f32; L]; 2],
) {
    // SAFETY (each store): the caller's promises.
    unsafe {
        let mul = fp8_multipliers::<U, FI>(dest, i0, live);
        let offsets = vector_offsets::<P>(at.0, at.1);
        each_head!(U, u => { if live[u] {
            let head = base.add((first + u as u64 * stride) as usize).cast::<D>();
            put::<D, P, L>(head, offsets, scaled(&y(u), mul[u]));
        } });
    }
}

/// The rows body ([`Mapping::Rows`]: NeoX pairs of 16-bit elements, heads of
/// [`crate::abi::ROWS_HEAD_DIM`] elements, four pairs per lane; see [`rows`]).
///
/// A persistent grid: block `blockIdx.x` walks tokens `blockIdx.x, blockIdx.x + gridDim.x,
/// ..`. Its warps `0..q_warps` take q's heads, then k's, then v's, two heads a step,
/// [`crate::abi::ROWS_HEADS_STEPS`] steps, each lane reading its head's elements `4g..4g + 4`
/// and `64 + 4g..` from the token's rows in shared memory; its last warp brings the rows there
/// with the bulk copy engine and finds cos/sin.
///
/// # Safety
/// The promises of the entry points, and: built for sm_90; `head_dim =`
/// [`crate::abi::ROWS_HEAD_DIM`]; `blockDim.x = 32 * (q_warps + k_warps + v_warps + 1)`, each
/// tensor's warps covering its stored heads at `2 *` [`crate::abi::ROWS_HEADS_STEPS`] heads per
/// warp (q's at least one); every stored tensor's heads of a token contiguous (`stride_head =
/// head_dim`), its token rows 16-byte aligned; the launch's dynamic shared memory holds
/// [`crate::abi::ROWS_DATA_OFFSET`] bytes and then `stages` (1 to
/// [`crate::abi::ROWS_MAX_STAGES`]) buffers, each the three rows of a token and
/// [`crate::abi::ROWS_COS_SIN_BYTES`]; a cache of at most 2^32 slots.
#[inline(always)]
unsafe fn rows_body<T: Elem, P: Pairing, S: Source>(f: &Fused<T>) {
    // The bulk copies and mbarriers exist from sm_90 on; the host never launches the rows
    // kernels of older builds.
    #[cfg(not(target_feature = "sm_90"))]
    {
        let _ = f;
        trap()
    }
    #[cfg(target_feature = "sm_90")]
    // SAFETY: the caller's promises.
    unsafe {
        rows::body::<T, P, S>(f)
    }
}

/// The kernel body for `L` elements per access (the wide and narrow kernels).
///
/// # Safety
/// The promises of the entry points.
#[inline(always)]
unsafe fn body<T: Elem, P: Pairing, S: Source, const L: usize>(f: &Fused<T>) {
    let a = &f.rope;
    let pairs = if P::NEOX { L } else { L / 2 };
    let groups = a.groups.divisor.get();
    let total = a.tokens * groups as u64;
    let (first, last) = head_range(f);
    // Uniform per block row: a row of v's heads alone (at decode, where each row holds one
    // head) needs no position or cos/sin.
    let rotates = first < a.q.heads + a.k.heads;
    let half = a.half as usize;
    if NormCode::from_u32(f.norm).is_none() || (f.norm != 0 && groups > 32) {
        trap()
    }
    // The loop runs on 32-bit indices: the host keeps the items within `MAX_FUSED_ITEMS` (2^30)
    // and the grid to the blocks they fill, so `idx` stays below 2^30 + 32, `step` below 2^30 +
    // 128 and their sum below 2^32. (The clamp keeps any larger count in range; a trap there
    // instead made ptxas spill far more.)
    let total = total.min(MAX_FUSED_ITEMS) as u32;
    let step = grid_dim_x() * block_dim_x();
    let mut idx = block_idx_x() * block_dim_x() + thread_idx_x();
    // Every global access is in the loop: the set-up above overlaps the previous grid in a
    // programmatic dependent launch (sm_90 builds; nothing before sm_90).
    wait_for_prior_grids();
    // Whole warps enter and leave the loop together (blocks and `step` are whole warps, and a
    // warp's first lane decides), so the norm's shuffles always have all 32 lanes; lanes past
    // the last item load and store nothing. A warp segment of `groups` lanes is one token.
    while idx & !31 < total {
        let in_range = idx < total;
        let (token, group) = a.groups.div_rem(idx as u64);
        let (b, s) = a.seq.div_rem(token);
        let active = in_range && (group as u32) < a.rot_groups;
        let j0 = if active { group as usize * pairs } else { 0 };
        let mut cs = ([0.0f32; L], [0.0f32; L]);
        if active && rotates {
            // SAFETY: (b, s) is a token; j0 + pairs <= half; the position, table and
            // frequency promises.
            cs = unsafe { cos_sin::<T, S, L>(a, position(a, b, s, group as u32), j0, pairs) };
        }
        let item = Item {
            token: (b as u32, s as u32),
            j0: (j0 as u32, half as u32),
            active,
            cos: cs.0,
            sin: cs.1,
            // SAFETY: token < tokens when in range.
            slot: Slot::new(if in_range {
                unsafe { cache_slot(f, token) }
            } else {
                None
            }),
        };
        // SAFETY: the heads exist (`head_range`); the token exists when the item is active (and
        // nothing is loaded or stored otherwise).
        unsafe { item_heads::<T, P, L>(f, &item, (first, last)) };
        idx += step;
    }
}

/// Picks the monomorphized body for the `lanes` argument, as [`crate::rope`]'s dispatch; `FI`:
/// the two-heads body with FlashInfer's forms (the entry points of
/// [`crate::fused_forms_kernel_params!`]); `PARTIAL`: the token-heads bodies of partial heads
/// (the `_partial` entry points).
///
/// # Safety
/// The promises of the entry points.
#[inline(always)]
unsafe fn dispatch<
    T: Elem,
    P: Pairing,
    S: Source,
    const ACCESS: u8,
    const FI: bool,
    const PARTIAL: bool,
    const FP4: bool,
    const LONG: bool,
>(
    f: &Fused<T>,
) {
    const WIDE: u8 = Mapping::WIDE.code();
    const NARROW: u8 = Mapping::NARROW.code();
    const TWO_HEADS: u8 = Mapping::TWO_HEADS.code();
    const FOUR_HEADS: u8 = Mapping::FOUR_HEADS.code();
    const ROWS: u8 = Mapping::Rows.code();
    // SAFETY: forwarded promises; `lanes` selects a body whose access width the host checked.
    unsafe {
        match (ACCESS, T::SIZE, f.rope.lanes, P::NEOX) {
            (WIDE, 4, 4, _) => body::<T, P, S, 4>(f),
            (WIDE, 2, 8, false) => body::<T, P, S, 8>(f),
            (WIDE, 2, 4, true) => body::<T, P, S, 4>(f),
            // Token-heads kernels take the preferred width only: no `lanes` to read. Four-heads
            // kernels have no FlashInfer forms.
            (TWO_HEADS, 4, _, _) => {
                token_heads_body::<T, P, S, 4, TWO_HEADS_U, FI, PARTIAL, false, false>(f)
            }
            (TWO_HEADS, 2, _, false) => {
                token_heads_body::<T, P, S, 8, TWO_HEADS_U, FI, PARTIAL, false, false>(f)
            }
            (TWO_HEADS, 2, _, true) => {
                token_heads_body::<T, P, S, 4, TWO_HEADS_U, FI, PARTIAL, false, false>(f)
            }
            (FOUR_HEADS, 4, _, _) => {
                token_heads_body::<T, P, S, 4, FOUR_HEADS_U, false, PARTIAL, FP4, LONG>(f)
            }
            (FOUR_HEADS, 2, _, false) => {
                token_heads_body::<T, P, S, 8, FOUR_HEADS_U, false, PARTIAL, FP4, LONG>(f)
            }
            (FOUR_HEADS, 2, _, true) => {
                token_heads_body::<T, P, S, 4, FOUR_HEADS_U, false, PARTIAL, FP4, LONG>(f)
            }
            (ROWS, 2, _, true) => rows_body::<T, P, S>(f),
            (NARROW, 2, 4, false) => body::<T, P, S, 4>(f),
            (NARROW, _, 2, _) => body::<T, P, S, 2>(f),
            (NARROW, _, 1, true) => body::<T, P, S, 1>(f),
            _ => trap(),
        }
    }
}

crate::fused_kernel_params!(params_struct {
    /// The parameters of every fused entry point but FlashInfer's forms'.
    FusedParams
});
crate::fused_forms_kernel_params!(params_struct {
    /// The parameters of the entry points of FlashInfer's forms.
    FusedFormsParams
});
crate::nvfp4_kernel_params!(params_struct {
    /// The parameters of the entry points of NVFP4 caches.
    Nvfp4Params
});

/// The parameters of [`crate::fused_kernel_params!`] among `$p`'s (FlashInfer's forms' entry
/// points take them and more).
macro_rules! fused_params_of {
    ({ $p:ident } $($param:ident: $kind:ident,)*) => {
        FusedParams { $($param: $p.$param,)* }
    };
}

/// The RoPE parameters of a fused entry point's parameters `$p`, its `sin_sign` among them
/// (`read_ahead` and `common_launch` are the one-head RoPE kernels' alone).
macro_rules! rope_params_of {
    ({ $p:ident } $($param:ident: $kind:ident,)*) => {
        Params { $($param: $p.$param,)* sin_sign: $p.sin_sign, read_ahead: 0, common_launch: 0 }
    };
}

impl<T> Fused<T> {
    /// Gathers the entry point's parameters for the generic body.
    #[inline(always)]
    fn new(p: FusedParams<T>) -> Self {
        Fused {
            rope: Args::new(crate::rope_kernel_params!(rope_params_of { p })),
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
            k_scale_step: p.k_scale_step,
            v_scale_step: p.v_scale_step,
            q_multiplier: 0.0,
            k_multiplier: 0.0,
            v_multiplier: 0.0,
            k_format: FormatCode::Elem as u32,
            slot_mode: SlotCode::Slots as u32,
            page_positions: core::ptr::null(),
            kv_indptr: core::ptr::null(),
            kv_indices: core::ptr::null(),
            kv_requests: 0,
            kv_pages: 0,
            q_warps: p.q_warps,
            k_warps: p.k_warps,
            v_warps: p.v_warps,
            prefetch_tokens: p.prefetch_tokens,
            nope: NonRotary::NONE,
            k_block_scales: core::ptr::null_mut(),
            v_block_scales: core::ptr::null_mut(),
            block_scale_strides: [0; 3],
        }
    }

    /// Gathers the parameters of an entry point of NVFP4 caches.
    #[inline(always)]
    fn new_nvfp4(p: Nvfp4Params<T>) -> Self {
        Fused {
            k_block_scales: p.k_block_scales,
            v_block_scales: p.v_block_scales,
            block_scale_strides: [
                p.scale_stride_block,
                p.scale_stride_slot,
                p.scale_stride_head,
            ],
            ..Self::new(crate::fused_kernel_params!(fused_params_of { p }))
        }
    }

    /// Gathers the parameters of an entry point of FlashInfer's forms.
    #[inline(always)]
    fn new_forms(p: FusedFormsParams<T>) -> Self {
        Fused {
            q_multiplier: p.q_multiplier,
            k_multiplier: p.k_multiplier,
            v_multiplier: p.v_multiplier,
            k_format: p.k_format,
            slot_mode: p.slot_mode,
            page_positions: p.page_positions.cast(),
            kv_indptr: p.kv_indptr.cast(),
            kv_indices: p.kv_indices.cast(),
            kv_requests: p.kv_requests,
            kv_pages: p.kv_pages,
            nope: NonRotary {
                rope_blocks: p.rope_blocks,
                threads: Divisor {
                    divisor: p.nope_threads,
                    magic: p.nope_magic,
                    shift: p.nope_shift,
                },
                accesses: p.nope_accesses,
                q: p.q_nope,
                q_strides: [p.q_nope_stride_token, p.q_nope_stride_head],
                q_out: p.q_nope_out,
                q_out_strides: [p.q_nope_out_stride_token, p.q_nope_out_stride_head],
                k: p.k_nope,
                k_strides: [p.k_nope_stride_token, p.k_nope_stride_head],
                k_out: p.k_nope_out,
                k_out_strides: [p.k_nope_out_stride_token, p.k_nope_out_stride_head],
                cached: NopeCached(p.nope_cached),
                cache_strides: [
                    p.nope_cache_stride_block,
                    p.nope_cache_stride_slot,
                    p.nope_cache_stride_head,
                ],
            },
            ..Self::new(crate::fused_kernel_params!(fused_params_of { p }))
        }
    }
}

/// Defines one exported entry point per (pairing, source, dtype) and mapping: wide, narrow and
/// two heads per thread, then the four-heads, rows, partial (two and four heads) and NVFP4
/// entry points.
macro_rules! fused_kernel {
    (
        $($wide:ident, $narrow:ident, $two_heads:ident, $forms:ident:
            $pairing:ident, $source:ident, $dt:ident, $t:ty;)*
        @four_heads $($four:ident: $fpairing:ident, $fsource:ident, $fdt:ident, $ft:ty;)*
        @rows $($rows:ident: $rsource:ident, $rdt:ident, $rt:ty;)*
        @partial $($ptwo:ident: $ppairing:ident, $psource:ident, $pdt:ident, $pt:ty;)*
        @partial_four $($pfour:ident: $qpairing:ident, $qsource:ident, $qdt:ident, $qt:ty;)*
        @nvfp4 $($nfour:ident: $npairing:ident, $nsource:ident, $ndt:ident, $nt:ty;)*
        @long_norm $($lfour:ident: $lpairing:ident, $lsource:ident, $ldt:ident, $lt:ty;)*
    ) => {
        $(
            crate::fused_kernel_params!(fused_entry {
                $wide, WIDE: $pairing, $source, $t, FusedParams => new, false, false, false, false
            });
            crate::fused_kernel_params!(fused_entry {
                $narrow, NARROW: $pairing, $source, $t, FusedParams => new, false, false, false, false
            });
            crate::fused_kernel_params!(fused_entry {
                $two_heads, TWO_HEADS: $pairing, $source, $t, FusedParams => new, false, false, false, false
            });
            crate::fused_forms_kernel_params!(fused_entry {
                $forms, TWO_HEADS: $pairing, $source, $t, FusedFormsParams => new_forms, true, false, false, false
            });
        )*
        $(
            crate::fused_kernel_params!(fused_entry {
                $four, FOUR_HEADS: $fpairing, $fsource, $ft, FusedParams => new, false, false, false, false
            });
        )*
        $(
            crate::fused_kernel_params!(fused_entry {
                $rows, Rows: Neox, $rsource, $rt, FusedParams => new, false, false, false, false
            });
        )*
        $(
            crate::fused_kernel_params!(fused_entry {
                $ptwo, TWO_HEADS: $ppairing, $psource, $pt, FusedParams => new, false, true, false, false
            });
        )*
        $(
            crate::fused_kernel_params!(fused_entry {
                $pfour, FOUR_HEADS: $qpairing, $qsource, $qt, FusedParams => new, false, true, false, false
            });
        )*
        $(
            crate::nvfp4_kernel_params!(fused_entry {
                $nfour, FOUR_HEADS: $npairing, $nsource, $nt, Nvfp4Params => new_nvfp4, false, false, true, false
            });
        )*
        $(
            crate::fused_kernel_params!(fused_entry {
                $lfour, FOUR_HEADS: $lpairing, $lsource, $lt, FusedParams => new, false, false, false, true
            });
        )*
    };
}

/// One entry point: its parameter list (`crate::fused_kernel_params!`, or for FlashInfer's
/// forms `crate::fused_forms_kernel_params!`) as the struct `$params`, gathered by `Fused::$new`
/// for the generic body of `$mapping`; `$forms` says whether it stores FlashInfer's forms,
/// `$partial` whether its heads hold features past the rotation, `$fp4` whether its cache is
/// NVFP4 (`crate::nvfp4_kernel_params!`).
macro_rules! fused_entry {
    (
        {
            $name:ident, $mapping:ident: $pairing:ident, $source:ident, $t:ty,
            $params:ident => $new:ident, $forms:literal, $partial:literal, $fp4:literal,
            $long:literal
        }
        $($param:ident: $kind:ident,)*
    ) => {
        /// One fused entry point; its name says the pairing, the sin/cos source, the element
        /// type and the mapping (`_narrow`: narrower than the preferred width; `_two_heads`,
        /// and `_four_heads`: a thread per two, or four, heads and access, on the grid of
        /// `token_heads_body`; `_rows`: the rows kernels; `_two_heads_flashinfer`: the
        /// two-heads kernels of FlashInfer's forms, with page-table caches, E5M2, multipliers by
        /// value, an FP8 k output and non-rotary parts; `_two_heads_partial`: the two-heads
        /// kernels of heads longer than the rotation, whose features past it are normalised and
        /// stored unrotated, and `_four_heads_partial` their four-heads kernels;
        /// `_four_heads_nvfp4`: the four-heads kernels of NVFP4 caches;
        /// `_four_heads_long_norm`: the four-heads kernels of norms summed across a head's
        /// warps). See
        /// the module documentation, and
        /// `fused_kernel_params!`, `fused_forms_kernel_params!` and `nvfp4_kernel_params!` in
        /// `abi.rs` for the parameters.
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
        /// most 32 when `norm` is not 0 (64 or 128 in the `_four_heads_long_norm` kernels, each
        /// block a whole number of segments of `groups / 32` warps, at most
        /// `TOKEN_HEADS_MAX_WARPS`). The `_two_heads` and `_four_heads` kernels also need
        /// every tensor and output to span fewer than 2^32 elements, the cache to hold at most
        /// 2^32 slots and the tables to fit `crate::abi::planned_table_fits`. The
        /// `_two_heads_flashinfer` kernels also need: FP8 scales null (the multiplier is then
        /// the argument's) or as above; for `slot_mode` 1, `slots`, `page_positions`,
        /// `kv_indptr` and `kv_indices` holding `tokens`, `tokens`, `kv_requests + 1` and
        /// `kv_pages` `i32`; with `k_format` FP8, `out1` addressing k's heads in bytes and no
        /// cache written; and each non-rotary part's heads (of q's or k's FP8 output) inside
        /// its input and output at their strides, aligned to one 16-byte access, spanning
        /// fewer than 2^32 elements. The `_partial` kernels take heads of `head_dim` elements
        /// (q's and k's, their outputs' and the caches') of which the first `2 half` rotate:
        /// `head_dim - 2 half` a multiple of a group's `2 pairs` features (`pairs`: `lanes`
        /// for NeoX, `lanes / 2` interleaved), and `groups` at least `rot_groups` and the
        /// `(head_dim - 2 half) / (2 pairs)` groups of the features past the rotation. The
        /// `_nvfp4` kernels take the cache as NVFP4: every slot below `cache_slots` addresses,
        /// at the cache strides (multiples of 16, as `head_dim` and, for NeoX, `half`), `k.heads`
        /// heads whose element `e` is byte `e / 2` of `k_cache` (`v_cache`, aligned to 4 bytes)
        /// and whose `head_dim / 16` block scales lie at the scale strides in `k_block_scales`
        /// (`v_block_scales`), apart from every code; the global scales as FP8 scales above.
        #[unsafe(no_mangle)]
        #[allow(clippy::too_many_arguments)]
        pub unsafe extern "ptx-kernel" fn $name(
            $($param: crate::device_param_type!($kind, $t),)*
        ) {
            let args = Fused::$new($params::<$t> { $($param,)* });
            // SAFETY: the caller's promises, listed above, are those `dispatch` needs.
            unsafe {
                dispatch::<
                    $t,
                    $pairing,
                    $source<$t>,
                    { Mapping::$mapping.code() },
                    $forms,
                    $partial,
                    $fp4,
                    $long,
                >(&args)
            }
        }
    };
}

for_each_fused_kernel!(fused_kernel);
