//! The rows kernels' body on sm_90 and newer ([`crate::abi::Access::Rows`]; see
//! [`super::rows_body`]).
//!
//! A block holds the warps of one token's heads (q's, then k's, then v's, two heads of
//! [`ROWS_HEAD_DIM`] elements per step, [`ROWS_GROUPS`] lanes per head) and a last, producer
//! warp. Each token buffer in the block's shared memory holds a token's rows and its cos/sin,
//! and has two mbarriers: "full" completes when the bulk copy engine has brought the rows and
//! the producer has written cos/sin (two arrivals by the producer's lane 0, and the bytes), and
//! "empty" when every thread of the other warps has read the buffer (one arrival each). The
//! producer fills the buffers in turn, each once it is empty, so it runs up to `stages` tokens
//! ahead, and reads each token's positions a token before it finds its cos/sin. The other warps
//! take the buffers in turn, each once it is full, with no barrier between them: each runs a
//! loop made for its own work ([`heads_loop`]), whose normalisation, rotation and destination
//! formats are fixed for the launch, so its steps hold only its own stores, and whose set-up
//! (the norm's weights, the FP8 multipliers of its heads) is found once for all its tokens.

use super::{
    Fused, Kind, butterfly, mapped_slot, norm_factor, norm_weights, put, rotate_fma,
    slot_offset_u32, sum_squares,
};
use crate::abi::{
    FormatCode, NormCode, ROWS_COS_SIN_BYTES, ROWS_DATA_OFFSET, ROWS_GROUPS, ROWS_HEAD_DIM,
    ROWS_HEADS_PER_STEP, ROWS_HEADS_STEPS, ROWS_MAX_STAGES,
};
use crate::elem::{Elem, Fp8, unrolled};
use crate::intrinsics::bulk::{
    bulk_load, dynamic_shared_bytes, mbarrier_arrive, mbarrier_init, mbarrier_wait, rows_shared,
    shared_load_f32x4, shared_load_u32x2, shared_store_f32_at,
};
use crate::intrinsics::{
    block_dim_x, block_idx_x, grid_dim_x, rcp_approx, rcp_approx_ftz, sync_threads_count,
    sync_warp, thread_idx_x, trap, wait_for_prior_grids,
};
use crate::rope::{Args, Neox, Pairing, Source, cos_sin, position, rotate_values_with, widen};

/// Elements per access (four NeoX pairs a lane) and steps over heads per token.
const L: usize = 4;
const STEPS: usize = ROWS_HEADS_STEPS as usize;

/// Pairs of a head, and pairs each producer lane finds cos/sin of.
const HALF: u32 = ROWS_HEAD_DIM / 2;
const PRODUCER_PAIRS: u32 = HALF / 32;

/// Where a warp of the rows kernels stores one destination's heads ([`heads_loop`]).
trait RowsStore {
    /// Whether the warp stores to this destination at all.
    const ON: bool;
    /// FP8 E4M3 of `value * (1 / scale)`, else the tensors' type.
    const FP8: bool;
}

/// No destination.
struct NoStore;
impl RowsStore for NoStore {
    const ON: bool = false;
    const FP8: bool = false;
}

/// The tensors' element type.
struct ElemStore;
impl RowsStore for ElemStore {
    const ON: bool = true;
    const FP8: bool = false;
}

/// FP8 E4M3.
struct Fp8Store;
impl RowsStore for Fp8Store {
    const ON: bool = true;
    const FP8: bool = true;
}

/// Whether a warp whose destinations are `A` and `B` takes its FP8 multiplier into the norm's
/// factor: it normalises, and its one destination is FP8.
const fn folds<A: RowsStore, B: RowsStore>(norm: bool) -> bool {
    norm && ((A::FP8 && !B::ON) || (B::FP8 && !A::ON))
}

/// Bytes per element stored to a destination in `D`'s format.
const fn dest_bytes<T: Elem, D: RowsStore>() -> usize {
    if D::FP8 { 1 } else { T::SIZE }
}

/// What a thread of the rows kernels finds once for all its tokens ([`body`]).
#[derive(Clone, Copy)]
struct RowsThread {
    block_threads: u32,
    /// The tensor of this thread's warp and its heads (unused by the producer).
    kind: Kind,
    heads: u32,
    /// This lane's first head (heads `first_head + 2 * step`).
    first_head: u32,
    /// This lane's first pair (`4 * (lane % 16)`).
    j0: u32,
    /// Where this lane's elements of its first head, and of its tensor's head 0, start in a
    /// buffer (bytes from the buffer's start).
    row_at: u32,
    tensor_at: u32,
    /// Bytes of the three rows of one buffer, of q's and of k's; bytes of a buffer (its rows
    /// and cos/sin).
    total: u32,
    buffer: u32,
    q_bytes: u32,
    k_bytes: u32,
    stages: u32,
}

/// [`super::rows_body`] on sm_90 and newer: the set-up every warp shares, then each warp's own
/// loop.
///
/// # Safety
/// As [`super::rows_body`].
#[inline(always)]
pub(super) unsafe fn body<T: Elem, P: Pairing, S: Source>(f: &Fused<T>) {
    let a = &f.rope;
    let (tid, block_threads) = (thread_idx_x(), block_dim_x());
    let (q_warps, k_warps, v_warps) = (f.q_warps, f.k_warps, f.v_warps);
    let head_bytes = 2 * ROWS_HEAD_DIM;
    // Each stored tensor's row, in q, k, v order (a tensor the launch stores nothing of has
    // no warps and no row).
    let row_bytes = |warps: u32, heads: u32| if warps == 0 { 0 } else { heads * head_bytes };
    let q_bytes = row_bytes(q_warps, a.q.heads);
    let k_bytes = row_bytes(k_warps, a.k.heads);
    let v_bytes = row_bytes(v_warps, f.v.heads);
    let total = q_bytes + k_bytes + v_bytes;
    let buffer = total + ROWS_COS_SIN_BYTES;
    let stages = dynamic_shared_bytes().saturating_sub(ROWS_DATA_OFFSET) / buffer;
    let norm = NormCode::from_u32(f.norm);
    let producer_warp = q_warps + k_warps + v_warps;
    if norm.is_none()
        || f.head_dim != ROWS_HEAD_DIM
        || a.half != HALF
        || q_warps == 0
        || block_threads != 32 * (producer_warp + 1)
        || f.cache_slots > 1 << 32
        || !(1..=ROWS_MAX_STAGES).contains(&stages)
        || T::SIZE != 2
        || !P::NEOX
    {
        trap()
    }
    // Every global access comes after this (sm_90: programmatic dependent launch).
    wait_for_prior_grids();
    let (warp, lane) = (tid / 32, tid % 32);
    let (kind, warp_in_tensor, heads, row_of) = if warp < q_warps {
        (Kind::Q, warp, a.q.heads, 0)
    } else if warp < q_warps + k_warps {
        (Kind::K, warp - q_warps, a.k.heads, q_bytes)
    } else {
        // v's warps, and the producer's (whose fields go unused).
        (
            Kind::V,
            warp - q_warps - k_warps,
            f.v.heads,
            q_bytes + k_bytes,
        )
    };
    let (head_in_step, group) = (lane / ROWS_GROUPS, lane % ROWS_GROUPS);
    let first_head = warp_in_tensor * ROWS_HEADS_PER_STEP * ROWS_HEADS_STEPS + head_in_step;
    let tensor_at = row_of + 8 * group;
    let r = RowsThread {
        block_threads,
        kind,
        heads,
        first_head,
        j0: 4 * group,
        row_at: tensor_at + first_head * head_bytes,
        tensor_at,
        total,
        buffer,
        q_bytes,
        k_bytes,
        stages,
    };
    if warp == producer_warp {
        // SAFETY: the caller's promises; this is the block's last warp.
        unsafe { producer_loop::<T, S>(f, r, lane) };
        return;
    }
    let normed = norm != Some(NormCode::None);
    let cache_fp8 = f.cache_format == FormatCode::E4m3 as u32;
    let cached = !f.slots.is_null();
    // SAFETY (each loop): the caller's promises; the warp's destinations and their formats
    // are the ones the loop stores to.
    unsafe {
        match kind {
            Kind::Q => match (normed, f.q_format == FormatCode::E4m3 as u32) {
                (false, false) => heads_loop::<T, false, true, ElemStore, NoStore>(f, r),
                (false, true) => heads_loop::<T, false, true, Fp8Store, NoStore>(f, r),
                (true, false) => heads_loop::<T, true, true, ElemStore, NoStore>(f, r),
                (true, true) => heads_loop::<T, true, true, Fp8Store, NoStore>(f, r),
            },
            Kind::K => match (normed, !a.k.out.is_null(), cached, cache_fp8) {
                (false, true, false, _) => heads_loop::<T, false, true, ElemStore, NoStore>(f, r),
                (false, false, true, false) => {
                    heads_loop::<T, false, true, NoStore, ElemStore>(f, r)
                }
                (false, false, true, true) => heads_loop::<T, false, true, NoStore, Fp8Store>(f, r),
                (false, true, true, false) => {
                    heads_loop::<T, false, true, ElemStore, ElemStore>(f, r)
                }
                (false, true, true, true) => {
                    heads_loop::<T, false, true, ElemStore, Fp8Store>(f, r)
                }
                (true, true, false, _) => heads_loop::<T, true, true, ElemStore, NoStore>(f, r),
                (true, false, true, false) => heads_loop::<T, true, true, NoStore, ElemStore>(f, r),
                (true, false, true, true) => heads_loop::<T, true, true, NoStore, Fp8Store>(f, r),
                (true, true, true, false) => {
                    heads_loop::<T, true, true, ElemStore, ElemStore>(f, r)
                }
                (true, true, true, true) => heads_loop::<T, true, true, ElemStore, Fp8Store>(f, r),
                // k stores nothing: it has no warps.
                (_, false, false, _) => trap(),
            },
            Kind::V => match cache_fp8 {
                false => heads_loop::<T, false, false, NoStore, ElemStore>(f, r),
                true => heads_loop::<T, false, false, NoStore, Fp8Store>(f, r),
            },
        }
    }
}

/// A warp's place in the block's walk over tokens: its token `t`, the token's buffer `s` and
/// the parity of that buffer's mbarrier phases for this round of the buffers.
#[derive(Clone, Copy)]
struct Turn {
    t: u32,
    s: u32,
    phase: u32,
}

impl Turn {
    /// The block's first token, in buffer 0.
    #[inline(always)]
    fn first() -> Self {
        Turn {
            t: block_idx_x(),
            s: 0,
            phase: 0,
        }
    }

    /// The block's next token (`gridDim.x` on), in the next of the `stages` buffers.
    #[inline(always)]
    fn next(self, stages: u32) -> Self {
        let wrap = self.s + 1 == stages;
        Turn {
            t: self.t + grid_dim_x(),
            s: if wrap { 0 } else { self.s + 1 },
            phase: self.phase ^ u32::from(wrap),
        }
    }
}

/// The `.shared` addresses of buffer `s`'s "full" and "empty" mbarriers.
#[inline(always)]
fn mbarriers(s: u32) -> (u32, u32) {
    (rows_shared(8 * s), rows_shared(8 * (ROWS_MAX_STAGES + s)))
}

/// Where buffer `s` starts and where its cos/sin start (bytes into the dynamic shared memory).
#[inline(always)]
fn buffer_at(r: &RowsThread, s: u32) -> (u32, u32) {
    let at = ROWS_DATA_OFFSET + s * r.buffer;
    (at, at + r.total)
}

/// The producer warp's loop (see the module documentation): its lane 0 sets up the mbarriers
/// and asks for every token's rows; each lane finds cos/sin of pairs `lane + 32 * p` of each
/// token.
///
/// # Safety
/// The promises of [`super::rows_body`]; `r` as [`body`] finds it; the caller is the block's
/// last warp, and the other warps run [`heads_loop`].
#[inline(always)]
unsafe fn producer_loop<T: Elem, S: Source>(f: &Fused<T>, r: RowsThread, lane: u32) {
    const PAIRS: usize = PRODUCER_PAIRS as usize;
    let a = &f.rope;
    let grid = grid_dim_x();
    let valid = |t: u32| u64::from(t) < a.tokens;
    let t0 = block_idx_x();
    if lane == 0 {
        let mut s = 0;
        while s < r.stages {
            let (full, empty) = mbarriers(s);
            // SAFETY: the mbarriers' 8 bytes each lead the dynamic shared memory, used by
            // nothing else. "full" takes lane 0's two arrivals (the copies', then cos/sin's),
            // "empty" one of each thread of the other warps.
            unsafe {
                mbarrier_init(full, 2);
                mbarrier_init(empty, r.block_threads - 32);
            }
            s += 1;
        }
    }
    let e = |p: usize| lane + 32 * p as u32;
    let pos_of = |t: u32, p: usize| {
        // SAFETY: the callers check t < tokens; the position promises.
        unsafe { rows_position(a, t, e(p)) }
    };
    // The positions of the block's next token.
    let mut pos_next = [0i64; PAIRS];
    if valid(t0) {
        unrolled(PAIRS, |p| pos_next[p] = pos_of(t0, p));
    }
    // The mbarriers are set up for every warp.
    sync_threads_count(r.block_threads);
    let mut turn = Turn::first();
    while valid(turn.t) {
        let Turn { t, s, phase } = turn;
        let (full, empty) = mbarriers(s);
        let (_, cos_at) = buffer_at(&r, s);
        // SAFETY: the mbarriers were set up; buffer s is free once "empty" completes the phase
        // before this one (at once for its first use: the phase before a new mbarrier's first
        // counts as complete).
        unsafe { mbarrier_wait(empty, phase ^ 1) };
        if lane == 0 {
            // SAFETY: buffer s is free.
            unsafe { rows_fetch(f, &r, t, s) };
        }
        let pos = pos_next;
        if valid(t + grid) {
            unrolled(PAIRS, |p| pos_next[p] = pos_of(t + grid, p));
        }
        unrolled(PAIRS, |p| {
            // SAFETY: e(p) < half; the table or frequency promises; the cos/sin of buffer s
            // are free (it is empty) and 2 * HALF values long.
            unsafe {
                let (c, sn) = cos_sin::<T, S, 1>(a, pos[p], e(p) as usize, 1);
                shared_store_f32_at(rows_shared(cos_at + 4 * e(p)), c[0]);
                shared_store_f32_at(rows_shared(cos_at + 4 * (HALF + e(p))), sn[0]);
            }
        });
        // Every lane's cos/sin are written before lane 0 arrives for them.
        sync_warp();
        if lane == 0 {
            // SAFETY: the phase expects this second arrival; its release orders the warp's
            // writes (ordered before it by the warp barrier) before the other warps' reads.
            unsafe { mbarrier_arrive(full) };
        }
        turn = turn.next(r.stages);
    }
}

/// The producer's lane 0 asks for token `t`'s rows (none past the tokens) into buffer `s`:
/// q's, k's and v's in turn, the first copy arriving on the buffer's "full" mbarrier with the
/// bytes to expect.
///
/// # Safety
/// Buffer `s` is free: nothing reads it until its mbarrier's next phase completes; the
/// promises of [`super::rows_body`].
#[inline(always)]
unsafe fn rows_fetch<T>(f: &Fused<T>, r: &RowsThread, t: u32, s: u32) {
    let a = &f.rope;
    if u64::from(t) >= a.tokens {
        return;
    }
    let (b, sq) = a.seq.div_rem_u32(t);
    let first =
        |strides: [u64; 3]| (u64::from(b) * strides[0] + u64::from(sq) * strides[1]) as usize;
    let ((bar, _), (row, _)) = (mbarriers(s), buffer_at(r, s));
    // SAFETY (each copy): the token's row of each stored tensor's heads is contiguous,
    // 16-byte aligned and as long as its part of the buffer (the caller's promise); q is
    // always stored.
    unsafe {
        let q = a.q.x.add(first(a.q.x_strides)).cast();
        bulk_load(bar, r.total, rows_shared(row), q, r.q_bytes);
        if r.k_bytes != 0 {
            let src = a.k.x.add(first(a.k.x_strides)).cast();
            bulk_load(bar, 0, rows_shared(row + r.q_bytes), src, r.k_bytes);
        }
        let v_bytes = r.total - r.q_bytes - r.k_bytes;
        if v_bytes != 0 {
            let src = f.v.x.add(first(f.v.x_strides)).cast();
            bulk_load(
                bar,
                0,
                rows_shared(row + r.q_bytes + r.k_bytes),
                src,
                v_bytes,
            );
        }
    }
}

/// The position of token `t` for pair `e` (as [`position`] takes it for lanes of four pairs).
///
/// # Safety
/// `t < tokens`; the position promises.
#[inline(always)]
unsafe fn rows_position<T>(a: &Args<T>, t: u32, e: u32) -> i64 {
    let (b, s) = a.seq.div_rem_u32(t);
    // SAFETY: the caller's promises.
    unsafe { position(a, u64::from(b), u64::from(s), e / L as u32) }
}

/// One warp's loop over the block's tokens and its tensor's heads (see the module
/// documentation).
///
/// `NORM`: the warp normalises (q's and k's warps of a launch with a norm); `ROTATES`: it
/// rotates (q's and k's). `A` is the warp's own output (q's output; k's output, if any), `B`
/// its cache destination (k's and v's, with a cache).
///
/// # Safety
/// The promises of [`super::rows_body`]; `r` as [`body`] finds it; `A` and `B` are the
/// warp's destinations in their formats.
#[inline(always)]
unsafe fn heads_loop<T: Elem, const NORM: bool, const ROTATES: bool, A: RowsStore, B: RowsStore>(
    f: &Fused<T>,
    r: RowsThread,
) {
    type P = Neox;
    let a = &f.rope;
    let grid = grid_dim_x();
    let valid = |t: u32| u64::from(t) < a.tokens;
    let j0 = r.j0 as usize;
    let offsets = (j0, HALF as usize + j0);
    // The warp's destinations (A is q's or k's output, B k's or v's cache) as their start and
    // element strides, and its FP8 destination's scales (k's output is never FP8).
    let ((base_a, strides_a), (base_b, strides_b), (scale, scale_step)) = match r.kind {
        Kind::Q => {
            let q = (a.q.out.cast::<u8>(), a.q.out_strides);
            (q, q, (f.q_scale, f.q_scale_step))
        }
        Kind::K => {
            let k = (a.k.out.cast::<u8>(), a.k.out_strides);
            (k, (f.k_cache, f.cache_strides), (f.k_scale, f.k_scale_step))
        }
        Kind::V => {
            let c = (f.v_cache, f.cache_strides);
            (c, c, (f.v_scale, f.v_scale_step))
        }
    };
    // Bytes between the heads of each destination.
    let head_a = strides_a[2] as usize * dest_bytes::<T, A>();
    let head_b = strides_b[2] as usize * dest_bytes::<T, B>();
    let mut w = [[0.0f32; L]; 2];
    if NORM {
        // SAFETY: the weights hold head_dim elements aligned like a head.
        w = unsafe { norm_weights::<T, P, L>(f, r.kind, (j0, HALF as usize)) };
    }
    // The multipliers `1 / scale` of this lane's heads, the same for every token (a lane past
    // the heads takes head 0's).
    let mut mult = [1.0f32; STEPS];
    if A::FP8 || B::FP8 {
        unrolled(STEPS, |k| {
            let i = r.first_head + k as u32 * ROWS_HEADS_PER_STEP;
            let i = if i < r.heads { i } else { 0 };
            // SAFETY: FP8 destinations have their scales: one (`scale_step` 0), or one per
            // head (the entry points' promise).
            mult[k] = rcp_approx(unsafe { *scale.add((i * scale_step) as usize) });
        });
    }
    // Exact for powers of two.
    let inv_dim = rcp_approx_ftz(ROWS_HEAD_DIM as f32);
    let t0 = block_idx_x();
    // The cache warps read each token's slot a token ahead.
    let slot_at = |t: u32| {
        if B::ON && valid(t) {
            // SAFETY: t < tokens; with a cache, `slots` holds one per token.
            unsafe { mapped_slot(f, u64::from(t)) }
        } else {
            -1
        }
    };
    let mut slot_next = slot_at(t0);
    // The producer has set up the mbarriers.
    sync_threads_count(r.block_threads);
    let mut turn = Turn::first();
    while valid(turn.t) {
        let Turn { t, s, phase } = turn;
        let slot = slot_next;
        slot_next = slot_at(t + grid);
        // This token's destinations: this lane's first head of each.
        let (b, sq) = a.seq.div_rem_u32(t);
        let head = u64::from(r.first_head);
        let out_a = if A::ON {
            let at = u64::from(b) * strides_a[0] + u64::from(sq) * strides_a[1];
            let at = at + head * strides_a[2];
            base_a.wrapping_add(at as usize * dest_bytes::<T, A>())
        } else {
            core::ptr::null_mut()
        };
        // A token without a slot (padding) stores nothing to the cache.
        let offset = if B::ON {
            slot_offset_u32(f, slot)
        } else {
            None
        };
        let has_slot = offset.is_some();
        let out_b = match offset {
            Some(at) => {
                let at = at + head * strides_b[2];
                base_b.wrapping_add(at as usize * dest_bytes::<T, B>())
            }
            None => core::ptr::null_mut(),
        };
        let (full, empty) = mbarriers(s);
        let (start, cos_at) = buffer_at(&r, s);
        // SAFETY: the mbarriers were set up; phase `phase` of "full" completes once this
        // token's rows and cos/sin are in buffer s.
        unsafe { mbarrier_wait(full, phase) };
        // The whole warp is here (the loop is warp-uniform): said before the norm's shuffles,
        // ptxas emits no divergence check and fallback path before each of them.
        if NORM {
            sync_warp();
        }
        let (cos, sin) = if ROTATES {
            // SAFETY: pairs j0..j0 + 4 of the token's cos and sin, 16-byte aligned, inside the
            // buffer, made visible by the wait.
            unsafe {
                let at = |v: u32| rows_shared(cos_at + 4 * (v + r.j0));
                (shared_load_f32x4(at(0)), shared_load_f32x4(at(HALF)))
            }
        } else {
            ([0.0; L], [0.0; L])
        };
        let (row, head0) = (
            rows_shared(start + r.row_at),
            rows_shared(start + r.tensor_at),
        );
        unrolled(STEPS, |k| {
            let i = r.first_head + k as u32 * ROWS_HEADS_PER_STEP;
            let live = i < r.heads;
            // Lanes past the tensor's heads read its head 0 (inside the buffer) and store
            // nothing; they still join the norm's shuffles.
            let step_bytes = k as u32 * ROWS_HEADS_PER_STEP * 2 * ROWS_HEAD_DIM;
            let from = if live { row + step_bytes } else { head0 };
            // SAFETY: inside the token's row of this tensor, 8-byte aligned; the mbarrier
            // wait above made the row visible.
            let words = unsafe {
                [
                    shared_load_u32x2(from),
                    shared_load_u32x2(from + ROWS_HEAD_DIM),
                ]
            };
            // SAFETY: four 16-bit elements are two 32-bit words; any bits are a valid `T`.
            let raw: [[T; L]; 2] = words.map(|w| unsafe { (&raw const w).cast::<[T; L]>().read() });
            let mut v = widen(raw);
            if NORM {
                let sum = butterfly([sum_squares::<P, L>(&v)], ROWS_GROUPS)[0];
                let mut factor = norm_factor(sum, inv_dim, f.norm_eps);
                if folds::<A, B>(NORM) {
                    factor *= mult[k];
                }
                unrolled(L, |e| {
                    v[0][e] = v[0][e] * factor * w[0][e];
                    v[1][e] = v[1][e] * factor * w[1][e];
                });
            }
            if live {
                let mut y = if ROTATES {
                    rotate_values_with::<P, L>(|p, e| v[p][e], &cos, &sin, rotate_fma)
                } else {
                    v
                };
                let steps = k * ROWS_HEADS_PER_STEP as usize;
                // An FP8 destination's values are multiplied by `1 / scale` before its store
                // (in the norm's factor where it folds): A's (q's FP8 output, whose warp has no
                // B) before A's store, B's (an FP8 cache) after A's store of the values.
                // SAFETY (each store): head i of the warp's tensor at the token's destinations,
                // which the entry points promise.
                unsafe {
                    if A::FP8 && !folds::<A, B>(NORM) {
                        y = y.map(|h| h.map(|x| x * mult[k]));
                    }
                    if A::ON {
                        rows_store::<T, A>(out_a.wrapping_add(steps * head_a), offsets, y);
                    }
                    if B::FP8 && !A::FP8 && !folds::<A, B>(NORM) {
                        y = y.map(|h| h.map(|x| x * mult[k]));
                    }
                    if B::ON && has_slot {
                        rows_store::<T, B>(out_b.wrapping_add(steps * head_b), offsets, y);
                    }
                }
            }
        });
        // This thread is done with buffer s.
        // SAFETY: the phase of "empty" expects one arrival of each thread of these warps.
        unsafe { mbarrier_arrive(empty) };
        turn = turn.next(r.stages);
    }
}

/// Stores one head's values `y` at `head` (elements `offsets`) in `D`'s format (FP8 values
/// already multiplied by `1 / scale`).
///
/// # Safety
/// `head` points at a head of the destination, in its format.
#[inline(always)]
unsafe fn rows_store<T: Elem, D: RowsStore>(
    head: *mut u8,
    offsets: (usize, usize),
    y: [[f32; L]; 2],
) {
    // SAFETY: the caller's promises.
    unsafe {
        if D::FP8 {
            put::<Fp8, Neox, L>(head.cast(), offsets, y)
        } else {
            put::<T, Neox, L>(head.cast(), offsets, y)
        }
    }
}
