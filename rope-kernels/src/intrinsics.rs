//! The only module that touches `core::arch::nvptx` or inline PTX: thread and block indices,
//! paired f16 and bf16 conversions, approximate reciprocals, the L2 prefetch, warp shuffles,
//! the fused kernels' shared buffer and the block barrier, programmatic dependent launch and
//! `trap`.

use core::arch::{asm, global_asm, nvptx};

/// `threadIdx.x`.
#[inline(always)]
pub fn thread_idx_x() -> u32 {
    // SAFETY: reading the %tid.x special register has no preconditions in a kernel.
    unsafe { nvptx::_thread_idx_x() }
}

/// `blockIdx.x`.
#[inline(always)]
pub fn block_idx_x() -> u32 {
    // SAFETY: reading the %ctaid.x special register has no preconditions in a kernel.
    unsafe { nvptx::_block_idx_x() }
}

/// `blockIdx.y`.
#[inline(always)]
pub fn block_idx_y() -> u32 {
    // SAFETY: reading the %ctaid.y special register has no preconditions in a kernel.
    unsafe { nvptx::_block_idx_y() }
}

/// `blockIdx.z`.
#[inline(always)]
pub fn block_idx_z() -> u32 {
    // SAFETY: reading the %ctaid.z special register has no preconditions in a kernel.
    unsafe { nvptx::_block_idx_z() }
}

/// `gridDim.y`.
#[inline(always)]
pub fn grid_dim_y() -> u32 {
    // SAFETY: reading the %nctaid.y special register has no preconditions in a kernel.
    unsafe { nvptx::_grid_dim_y() }
}

/// `blockDim.x`.
#[inline(always)]
pub fn block_dim_x() -> u32 {
    // SAFETY: reading the %ntid.x special register has no preconditions in a kernel.
    unsafe { nvptx::_block_dim_x() }
}

/// `gridDim.x`.
#[inline(always)]
pub fn grid_dim_x() -> u32 {
    // SAFETY: reading the %nctaid.x special register has no preconditions in a kernel.
    unsafe { nvptx::_grid_dim_x() }
}

/// `f32` values in the block's shared buffer ([`shared_store_f32`], [`shared_load_f32s`]): 4 KiB.
pub const SHARED_F32: usize = 1024;

// The module's one shared-memory variable (rustc has no address space for a `static` in shared
// memory, so it is declared in PTX). Only kernels that take its address get it allocated.
global_asm!(".shared .align 16 .b8 rope_fused_shared[4096];");

/// Stores `v` at element `i` of the block's shared buffer with `st.shared` (a generic
/// pointer to it, from `cvta.shared`, kept generic accesses in ptxas's code).
///
/// # Safety
/// `i < SHARED_F32`.
#[inline(always)]
pub unsafe fn shared_store_f32(i: u32, v: f32) {
    // SAFETY: i < SHARED_F32, inside the 4 KiB buffer (the caller's promise).
    unsafe {
        asm!(
            "{{ .reg .u32 rope_sh; mov.u32 rope_sh, rope_fused_shared; add.u32 rope_sh, rope_sh, {o}; st.shared.f32 [rope_sh], {v}; }}",
            o = in(reg32) i * 4,
            v = in(reg32) v,
            options(nostack, preserves_flags),
        )
    };
}

/// Loads `N` (1, 2 or 4) consecutive `f32` of the block's shared buffer from element `i` with one
/// `ld.shared` (a vector load of two or four for 2 and 4).
///
/// # Safety
/// `i + N <= SHARED_F32` and `i` a multiple of `N`.
#[inline(always)]
pub unsafe fn shared_load_f32s<const N: usize>(i: u32) -> [f32; N] {
    let mut v = [0.0f32; N];
    let o = i * 4;
    // SAFETY: inside the buffer and aligned to the access (the caller's promise); the `asm`
    // reads shared memory only, and the barrier before it (a memory-clobbering `asm`) orders it
    // after the writes.
    unsafe {
        match N {
            4 => asm!(
                "{{ .reg .u32 rope_sh; mov.u32 rope_sh, rope_fused_shared; add.u32 rope_sh, rope_sh, {o}; ld.shared.v4.f32 {{{a}, {b}, {c}, {d}}}, [rope_sh]; }}",
                o = in(reg32) o,
                a = out(reg32) v[0], b = out(reg32) v[1 % N], c = out(reg32) v[2 % N], d = out(reg32) v[3 % N],
                options(nostack, preserves_flags, readonly),
            ),
            2 => asm!(
                "{{ .reg .u32 rope_sh; mov.u32 rope_sh, rope_fused_shared; add.u32 rope_sh, rope_sh, {o}; ld.shared.v2.f32 {{{a}, {b}}}, [rope_sh]; }}",
                o = in(reg32) o,
                a = out(reg32) v[0], b = out(reg32) v[1 % N],
                options(nostack, preserves_flags, readonly),
            ),
            1 => asm!(
                "{{ .reg .u32 rope_sh; mov.u32 rope_sh, rope_fused_shared; add.u32 rope_sh, rope_sh, {o}; ld.shared.f32 {a}, [rope_sh]; }}",
                o = in(reg32) o,
                a = out(reg32) v[0],
                options(nostack, preserves_flags, readonly),
            ),
            _ => trap(),
        }
    }
    v
}

/// The QK-norm + RoPE backward's staging buffer in shared memory: two stages of
/// [`crate::abi::NORM_GRAD_MAX_THREADS`] threads' [`STAGE_THREAD_BYTES`] each, which
/// `cp.async` fills from global memory a token ahead (sm_80 and newer).
pub mod stage {
    use core::arch::{asm, global_asm};

    use crate::abi::NORM_GRAD_MAX_THREADS;

    /// Bytes of one thread's part of one stage.
    pub const STAGE_THREAD_BYTES: u32 = 128;
    /// Bytes of one stage.
    pub const STAGE_BYTES: u32 = NORM_GRAD_MAX_THREADS * STAGE_THREAD_BYTES;

    // Declared in PTX as the fused buffer is; allocated only in the kernels that take its
    // address.
    global_asm!(".shared .align 16 .b8 rope_grad_stage[{n}];", n = const 2 * STAGE_BYTES);

    /// Starts copying `B` (4, 8 or 16) bytes from `src` to byte `at` of the staging buffer,
    /// or `B` zero bytes where `copied` is false (nothing is read from `src` then), in this
    /// thread's current group of asynchronous copies ([`commit`]).
    ///
    /// # Safety
    /// `at + B <= 2 * STAGE_BYTES`, `at` a multiple of `B`; with `copied`, `src` points at `B`
    /// readable bytes of global memory aligned to `B`; nothing reads the destination before
    /// [`wait_all_but_last`] has passed the copy's group.
    #[inline(always)]
    pub unsafe fn copy_async<const B: u32>(at: u32, src: *const u8, copied: bool) {
        let n: u32 = if copied { B } else { 0 };
        // SAFETY: the caller's promises; the copy writes shared memory only, and reads `src`
        // only with `copied`.
        unsafe {
            match B {
                16 => asm!(
                    "{{ .reg .u32 rope_st; mov.u32 rope_st, rope_grad_stage; add.u32 rope_st, rope_st, {at}; cp.async.cg.shared.global [rope_st], [{src}], 16, {n}; }}",
                    at = in(reg32) at, src = in(reg64) src, n = in(reg32) n,
                    options(nostack, preserves_flags),
                ),
                8 => asm!(
                    "{{ .reg .u32 rope_st; mov.u32 rope_st, rope_grad_stage; add.u32 rope_st, rope_st, {at}; cp.async.ca.shared.global [rope_st], [{src}], 8, {n}; }}",
                    at = in(reg32) at, src = in(reg64) src, n = in(reg32) n,
                    options(nostack, preserves_flags),
                ),
                4 => asm!(
                    "{{ .reg .u32 rope_st; mov.u32 rope_st, rope_grad_stage; add.u32 rope_st, rope_st, {at}; cp.async.ca.shared.global [rope_st], [{src}], 4, {n}; }}",
                    at = in(reg32) at, src = in(reg64) src, n = in(reg32) n,
                    options(nostack, preserves_flags),
                ),
                _ => super::trap(),
            }
        }
    }

    /// Closes this thread's current group of asynchronous copies (`cp.async.commit_group`);
    /// a group with no copies completes at once.
    #[inline(always)]
    pub fn commit() {
        // SAFETY: no operands; marks a group boundary only.
        unsafe { asm!("cp.async.commit_group;", options(nostack, preserves_flags)) };
    }

    /// Waits until every group of this thread's asynchronous copies but the last committed
    /// has completed (`cp.async.wait_group 1`): their bytes are then in the staging buffer.
    /// The `asm` may read and write memory, so no access moves across it.
    #[inline(always)]
    pub fn wait_all_but_last() {
        // SAFETY: no operands; waits only.
        unsafe { asm!("cp.async.wait_group 1;", options(nostack, preserves_flags)) };
    }

    /// Loads `W` (1, 2 or 4) 32-bit words from byte `at` of the staging buffer with one
    /// `ld.shared`.
    ///
    /// # Safety
    /// `at + 4 W <= 2 * STAGE_BYTES`, `at` a multiple of `4 W`; written by this thread's copies
    /// of a group [`wait_all_but_last`] has passed since.
    #[inline(always)]
    pub unsafe fn load<const W: usize>(at: u32) -> [u32; W] {
        let mut v = [0u32; W];
        // SAFETY: inside the buffer, aligned (the caller's promises); reads shared memory only,
        // ordered after the wait (a memory-clobbering `asm`).
        unsafe {
            match W {
                4 => asm!(
                    "{{ .reg .u32 rope_st; mov.u32 rope_st, rope_grad_stage; add.u32 rope_st, rope_st, {at}; ld.shared.v4.b32 {{{a}, {b}, {c}, {d}}}, [rope_st]; }}",
                    at = in(reg32) at,
                    a = out(reg32) v[0], b = out(reg32) v[1 % W], c = out(reg32) v[2 % W], d = out(reg32) v[3 % W],
                    options(nostack, preserves_flags, readonly),
                ),
                2 => asm!(
                    "{{ .reg .u32 rope_st; mov.u32 rope_st, rope_grad_stage; add.u32 rope_st, rope_st, {at}; ld.shared.v2.b32 {{{a}, {b}}}, [rope_st]; }}",
                    at = in(reg32) at,
                    a = out(reg32) v[0], b = out(reg32) v[1 % W],
                    options(nostack, preserves_flags, readonly),
                ),
                1 => asm!(
                    "{{ .reg .u32 rope_st; mov.u32 rope_st, rope_grad_stage; add.u32 rope_st, rope_st, {at}; ld.shared.b32 {a}, [rope_st]; }}",
                    at = in(reg32) at,
                    a = out(reg32) v[0],
                    options(nostack, preserves_flags, readonly),
                ),
                _ => super::trap(),
            }
        }
        v
    }
}

/// The rows kernels' shared memory, bulk copies and mbarriers (sm_90 and newer: PTX ISA 8.0).
#[cfg(target_feature = "sm_90")]
pub mod bulk {
    use core::arch::{asm, global_asm};

    // The rows kernels' dynamic shared memory, sized by each launch (`.extern`: only kernels that
    // take its address use it).
    global_asm!(".extern .shared .align 128 .b8 rope_rows_shared[];");

    /// The bytes of dynamic shared memory this launch gave each block (`%dynamic_smem_size`).
    #[inline(always)]
    pub fn dynamic_shared_bytes() -> u32 {
        let n: u32;
        // SAFETY: reads a special register; touches no memory.
        unsafe {
            asm!(
                "mov.u32 {n}, %dynamic_smem_size;",
                n = out(reg32) n,
                options(pure, nomem, nostack, preserves_flags),
            )
        };
        n
    }

    /// The `.shared` address of byte `offset` of the rows kernels' dynamic shared memory.
    #[inline(always)]
    pub fn rows_shared(offset: u32) -> u32 {
        let a: u32;
        // SAFETY: takes an address; touches no memory.
        unsafe {
            asm!(
                "mov.u32 {a}, rope_rows_shared;",
                "add.u32 {a}, {a}, {o};",
                a = out(reg32) a,
                o = in(reg32) offset,
                options(pure, nomem, nostack, preserves_flags),
            )
        };
        a
    }

    /// Loads 8 bytes (two 32-bit words) of shared memory at `.shared` address `at`, as one
    /// vector `ld.shared` of two `.b32`.
    ///
    /// # Safety
    /// `at` is 8-byte aligned inside the block's shared memory, written before a barrier (or an
    /// mbarrier wait) this thread has passed since.
    #[inline(always)]
    pub unsafe fn shared_load_u32x2(at: u32) -> [u32; 2] {
        let (a, b): (u32, u32);
        // SAFETY: the caller's promise; reads shared memory only.
        unsafe {
            asm!(
                "ld.shared.v2.b32 {{{a}, {b}}}, [{at}];",
                at = in(reg32) at,
                a = out(reg32) a,
                b = out(reg32) b,
                options(nostack, preserves_flags, readonly),
            )
        };
        [a, b]
    }

    /// Initialises the mbarrier at `.shared` address `bar` for `count` arrivals per phase
    /// (`mbarrier.init`), and makes it visible to the bulk copy engine
    /// (`fence.mbarrier_init.release.cluster`); a block barrier must follow before others use it.
    ///
    /// # Safety
    /// `bar` is 8-byte aligned shared memory that nothing else uses while the mbarrier lives.
    #[inline(always)]
    pub unsafe fn mbarrier_init(bar: u32, count: u32) {
        // SAFETY: the caller's promise.
        unsafe {
            asm!(
                "mbarrier.init.shared::cta.b64 [{b}], {n};",
                "fence.mbarrier_init.release.cluster;",
                b = in(reg32) bar,
                n = in(reg32) count,
                options(nostack, preserves_flags),
            )
        };
    }

    /// Arrives on the mbarrier `bar` (`mbarrier.arrive`, release: this thread's earlier
    /// memory accesses happen before a wait that sees the phase complete).
    ///
    /// # Safety
    /// `bar` was set up by [`mbarrier_init`]; the phase expects this arrival.
    #[inline(always)]
    pub unsafe fn mbarrier_arrive(bar: u32) {
        // SAFETY: the caller's promise.
        unsafe {
            asm!(
                "mbarrier.arrive.shared::cta.b64 _, [{b}];",
                b = in(reg32) bar,
                options(nostack, preserves_flags),
            )
        };
    }

    /// Loads four `f32` of shared memory at `.shared` address `at`, as one vector `ld.shared`
    /// of four `.f32`.
    ///
    /// # Safety
    /// `at` is 16-byte aligned inside the block's shared memory, written before a barrier (or
    /// an mbarrier wait) this thread has passed since.
    #[inline(always)]
    pub unsafe fn shared_load_f32x4(at: u32) -> [f32; 4] {
        let (a, b, c, d): (f32, f32, f32, f32);
        // SAFETY: the caller's promise; reads shared memory only.
        unsafe {
            asm!(
                "ld.shared.v4.f32 {{{a}, {b}, {c}, {d}}}, [{at}];",
                at = in(reg32) at,
                a = out(reg32) a,
                b = out(reg32) b,
                c = out(reg32) c,
                d = out(reg32) d,
                options(nostack, preserves_flags, readonly),
            )
        };
        [a, b, c, d]
    }

    /// Stores `v` to shared memory at `.shared` address `at` (`st.shared.f32`).
    ///
    /// # Safety
    /// `at` is 4-byte aligned inside the block's shared memory that no other thread accesses
    /// until a barrier (or an mbarrier phase) orders it.
    #[inline(always)]
    pub unsafe fn shared_store_f32_at(at: u32, v: f32) {
        // SAFETY: the caller's promise.
        unsafe {
            asm!(
                "st.shared.f32 [{at}], {v};",
                at = in(reg32) at,
                v = in(reg32) v,
                options(nostack, preserves_flags),
            )
        };
    }

    /// Starts copying `bytes` bytes from global `src` to `.shared` address `dst` with the bulk
    /// copy engine (`cp.async.bulk`), completing on the mbarrier `bar`, after this thread's own
    /// arrival on `bar` announced `expected` bytes (`mbarrier.arrive.expect_tx`; pass the
    /// phase's total with its first copy, 0 with the others). Orders this thread's earlier
    /// shared-memory accesses before the copy (`fence.proxy.async.shared::cta`).
    ///
    /// # Safety
    /// `src` holds `bytes` readable bytes and `dst` as many in shared memory that nothing reads or
    /// writes until the mbarrier's phase completes; both 16-byte aligned, `bytes` a multiple of
    /// 16; `bar` was set up by [`mbarrier_init`].
    #[inline(always)]
    pub unsafe fn bulk_load(bar: u32, expected: u32, dst: u32, src: *const u8, bytes: u32) {
        // SAFETY: the caller's promises.
        unsafe {
            if expected != 0 {
                asm!(
                    "fence.proxy.async.shared::cta;",
                    "mbarrier.arrive.expect_tx.shared::cta.b64 _, [{b}], {n};",
                    b = in(reg32) bar,
                    n = in(reg32) expected,
                    options(nostack, preserves_flags),
                );
            }
            asm!(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [{d}], [{s}], {n}, [{b}];",
                d = in(reg32) dst,
                s = in(reg64) src,
                n = in(reg32) bytes,
                b = in(reg32) bar,
                options(nostack, preserves_flags),
            )
        };
    }

    /// Waits until the phase of parity `parity` of the mbarrier `bar` completes
    /// (`mbarrier.try_wait.parity` in a loop): the bulk copies it counts have landed in shared
    /// memory and are visible to this thread.
    ///
    /// # Safety
    /// `bar` was set up by [`mbarrier_init`].
    #[inline(always)]
    pub unsafe fn mbarrier_wait(bar: u32, parity: u32) {
        loop {
            let done: u32;
            // SAFETY: the caller's promise; the `asm` may read memory, so no load moves above it.
            unsafe {
                asm!(
                    "{{",
                    ".reg .pred rope_done;",
                    "mbarrier.try_wait.parity.shared::cta.b64 rope_done, [{b}], {p};",
                    "selp.u32 {d}, 1, 0, rope_done;",
                    "}}",
                    b = in(reg32) bar,
                    p = in(reg32) parity,
                    d = out(reg32) done,
                    options(nostack, preserves_flags),
                )
            };
            if done != 0 {
                break;
            }
        }
    }
}

/// `bar.sync 0, threads`: waits until `threads` threads of the block (a multiple of 32, whole
/// warps) arrive, and makes the shared-memory writes before it visible to the reads after it
/// among them. Exactly that many threads must reach it; the others may have left the kernel.
/// The `asm` may read and write memory, so no access moves across it.
#[inline(always)]
pub fn sync_threads_count(threads: u32) {
    // SAFETY: a barrier over `threads` threads of the block; the callers reach it with that
    // many.
    unsafe { asm!("bar.sync 0, {n};", n = in(reg32) threads, options(nostack, preserves_flags)) };
}

/// `bar.sync id, threads`: named barrier `id` (1 to 15; 0 is [`sync_threads_count`]'s) of
/// `threads` threads of the block (a multiple of 32, whole warps), with the same ordering of
/// shared-memory accesses among them. Exactly that many threads must reach barrier `id`.
#[inline(always)]
pub fn sync_named(id: u32, threads: u32) {
    // SAFETY: a barrier over `threads` threads of the block; the callers reach each id with
    // that many.
    unsafe {
        asm!(
            "bar.sync {id}, {n};",
            id = in(reg32) id,
            n = in(reg32) threads,
            options(nostack, preserves_flags)
        )
    };
}

/// Aborts the kernel (the launch then fails with an illegal-instruction error on the host).
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` ends the kernel; it has no memory effects a caller relies on.
    unsafe { nvptx::trap() }
}

/// Blocks until every grid this launch depends on programmatically (the kernel before it on
/// its stream, when the host launched it with programmatic stream serialization) has completed
/// and its memory operations are visible (`griddepcontrol.wait`, sm_90+). Returns at once in a
/// launch without such a dependency. On targets before sm_90 it is nothing: the host never
/// launches those builds' kernels with the attribute. A kernel calls it before its first
/// global load or store; the `asm` may read and write memory, so none is moved above it.
#[inline(always)]
pub fn wait_for_prior_grids() {
    #[cfg(target_feature = "sm_90")]
    // SAFETY: `griddepcontrol.wait` only delays this thread; it has no operands.
    unsafe {
        asm!("griddepcontrol.wait;", options(nostack, preserves_flags))
    };
}

/// Lets the grid launched after this one on its stream with programmatic stream serialization
/// start before this one ends (`griddepcontrol.launch_dependents`, sm_90+): once every block
/// of this grid has run it or exited, the next grid's blocks may run up to their own
/// [`wait_for_prior_grids`], which still waits for this grid to complete. Nothing on targets
/// before sm_90.
#[inline(always)]
pub fn allow_dependent_grids() {
    #[cfg(target_feature = "sm_90")]
    // SAFETY: `griddepcontrol.launch_dependents` only signals the scheduler; it has no operands
    // and touches no memory.
    unsafe {
        asm!(
            "griddepcontrol.launch_dependents;",
            options(nostack, preserves_flags)
        )
    };
}

/// Defines a function rounding two `f32` to nearest even with one paired `cvt.rn.*x2.f32`
/// into a word `$word` (register class `$class`) of two elements: `lo` in its low half and `hi`
/// in its high half.
macro_rules! paired_round {
    ($(#[$attr:meta])* $name:ident, $cvt:literal, $word:ty, $class:ident) => {
        $(#[$attr])*
        #[inline(always)]
        pub fn $name(lo: f32, hi: f32) -> $word {
            let packed: $word;
            // SAFETY: a register-only conversion.
            unsafe {
                asm!(
                    concat!($cvt, " {d}, {hi}, {lo};"),
                    d = out($class) packed,
                    hi = in(reg32) hi,
                    lo = in(reg32) lo,
                    options(pure, nomem, nostack, preserves_flags),
                )
            };
            packed
        }
    };
}

paired_round!(
    /// Rounds two `f32` to bfloat16 (`cvt.rn.bf16x2.f32`, sm_80+); NaN becomes the canonical
    /// bf16 NaN.
    f32x2_to_bf16x2,
    "cvt.rn.bf16x2.f32",
    u32,
    reg32
);
paired_round!(
    /// Rounds two `f32` to IEEE binary16 (`cvt.rn.f16x2.f32`).
    f32x2_to_f16x2,
    "cvt.rn.f16x2.f32",
    u32,
    reg32
);
paired_round!(
    /// Rounds two `f32` to FP8 E4M3 (`e4m3fn`) with one `cvt.rn.satfinite.e4m3x2.f32` (sm_89+,
    /// so only in the PTX built for sm_89): saturating to `±448` (infinities included), NaN to
    /// a NaN code. For every non-NaN input the same bits as [`crate::math::f32_to_e4m3`].
    #[cfg(target_feature = "sm_89")]
    f32x2_to_e4m3x2,
    "cvt.rn.satfinite.e4m3x2.f32",
    u16,
    reg16
);
paired_round!(
    /// Rounds two `f32` to FP8 E5M2 with one `cvt.rn.satfinite.e5m2x2.f32` (sm_89+, so only in
    /// the PTX built for sm_89): saturating to `±57344` (infinities included), NaN to a NaN
    /// code. For every non-NaN input the same bits as [`crate::math::f32_to_e5m2`].
    #[cfg(target_feature = "sm_89")]
    f32x2_to_e5m2x2,
    "cvt.rn.satfinite.e5m2x2.f32",
    u16,
    reg16
);

/// Widens the IEEE binary16 value in the low 16 bits of `bits` to `f32` (exact). Taking a
/// 32-bit register keeps vectors of 16-bit elements packed two to a register until each is
/// converted.
#[inline(always)]
pub fn f16_bits_to_f32(bits: u32) -> f32 {
    let v: f32;
    // SAFETY: register-only conversions.
    unsafe {
        asm!(
            "{{",
            ".reg .b16 h;",
            "cvt.u16.u32 h, {b};",
            "cvt.f32.f16 {v}, h;",
            "}}",
            b = in(reg32) bits,
            v = out(reg32) v,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    v
}

/// Widens the two bfloat16 values packed in `word` (the first in the low half, as a 32-bit
/// load of them holds them) to `f32` (exact: a shift and a mask). Inline PTX keeps the word
/// whole: from a 64-bit load LLVM took the second word's first value with a 64-bit shift and
/// a mask, two instructions where this takes one.
#[inline(always)]
pub fn bf16x2_to_f32x2(word: u32) -> [f32; 2] {
    let (lo, hi): (f32, f32);
    // SAFETY: register-only bit operations.
    unsafe {
        asm!(
            "shl.b32 {lo}, {w}, 16;",
            "and.b32 {hi}, {w}, 0xffff0000;",
            w = in(reg32) word,
            lo = out(reg32) lo,
            hi = out(reg32) hi,
            options(pure, nomem, nostack, preserves_flags),
        )
    };
    [lo, hi]
}

/// Asks for the cache line holding `ptr` to be brought into L2 (`prefetch.global.L2`): no
/// register receives it, so the request stays in flight through arithmetic that follows it.
#[inline(always)]
pub fn prefetch_l2<T>(ptr: *const T) {
    // SAFETY: a prefetch is a hint without architectural effect; it does not fault on any
    // address, and the callers pass addresses they are about to load anyway.
    unsafe {
        asm!(
            "prefetch.global.L2 [{p}];",
            p = in(reg64) ptr,
            options(nostack, preserves_flags, readonly),
        )
    };
}

/// `bar.warp.sync` over the whole warp: every lane arrives, and the shared-memory writes
/// before it are visible to the warp's reads after it. Before warp shuffles it also tells
/// ptxas the warp has converged, so that it emits no divergence check (`BRA.DIV`) and fallback
/// path before each shuffle (whose registers made the four-heads kernels spill).
///
/// Every lane of the calling warp must reach it (the callers' code is warp-uniform there).
#[inline(always)]
pub fn sync_warp() {
    // SAFETY: a warp barrier with no other effect; all 32 lanes reach it (the callers'
    // promise).
    unsafe {
        asm!(
            "bar.warp.sync 0xffffffff;",
            options(nostack, preserves_flags)
        )
    };
}

/// Defines a warp shuffle of one `f32` (`shfl.sync` in mode `$mode`): `v` of the lane its
/// second argument names, among the lanes of `members`, which must all execute the call and
/// include that lane.
macro_rules! shuffle {
    ($(#[$doc:meta])* $name:ident, $mode:literal) => {
        $(#[$doc])*
        #[inline(always)]
        pub fn $name(v: f32, lane: u32, members: u32) -> f32 {
            let out: f32;
            // SAFETY: a register exchange between the converged lanes of `members` (the
            // caller's promise); no memory is touched.
            unsafe {
                asm!(
                    concat!("shfl.sync.", $mode, ".b32 {d}, {v}, {l}, 31, {m};"),
                    d = out(reg32) out,
                    v = in(reg32) v,
                    l = in(reg32) lane,
                    m = in(reg32) members,
                    options(nomem, nostack, preserves_flags),
                )
            };
            out
        }
    };
}

shuffle!(
    /// `v` of lane `lane` of this thread's warp (`shfl.sync.idx.b32`).
    shuffle_idx,
    "idx"
);
shuffle!(
    /// `v` of lane `this lane ^ lane` of this thread's warp (`shfl.sync.bfly.b32`).
    shuffle_xor,
    "bfly"
);

/// Defines a function for a one-operand approximate `f32` instruction (no slow path, so no
/// call: the correctly rounded `div`/`sqrt`/`rcp` sequences call a subroutine for rare operands,
/// and registers live across that call are spilled).
macro_rules! approx {
    ($(#[$doc:meta])* $name:ident, $op:literal) => {
        $(#[$doc])*
        #[inline(always)]
        pub fn $name(x: f32) -> f32 {
            let y: f32;
            // SAFETY: a register-only instruction.
            unsafe {
                asm!(
                    concat!($op, " {y}, {x};"),
                    y = out(reg32) y,
                    x = in(reg32) x,
                    options(pure, nomem, nostack, preserves_flags),
                )
            };
            y
        }
    };
}

approx!(
    /// `1 / x` to within one ulp (`rcp.approx.f32`; subnormals kept).
    rcp_approx,
    "rcp.approx.f32"
);
approx!(
    /// `1 / x` to within one ulp for normal `x` and results (`rcp.approx.ftz.f32`: one
    /// instruction, where [`rcp_approx`] scales subnormal operands around it).
    rcp_approx_ftz,
    "rcp.approx.ftz.f32"
);
approx!(
    /// `1 / sqrt(x)` to within 2^-22.9 relative (`rsqrt.approx.ftz.f32`: a subnormal `x` is
    /// taken as zero, giving infinity).
    rsqrt_approx,
    "rsqrt.approx.ftz.f32"
);

/// `N` consecutive `T` (2, 4, 8 or 16 bytes in all; other sizes as [`crate::access::load`])
/// loaded from global memory with one access whose L2 lines take the evict-last priority
/// (`createpolicy.fractional.L2::evict_last` and `ld.global.L2::cache_hint`, PTX ISA 7.4: the
/// sm_89 and sm_90 builds; a plain load in the sm_80 build, whose PTX ISA is 7.0).
///
/// For data that every launch reads again while a stream of other bytes passes through L2:
/// sin/cos table rows, which a prefill's q, k and v (tens of MB a launch) otherwise evict
/// between one token's read of a row and the next launch's.
///
/// # Safety
/// `p` points at `N` readable `T` in global memory, aligned to their total size.
#[inline(always)]
pub unsafe fn load_evict_last<T: Copy, const N: usize>(p: *const T) -> [T; N] {
    #[cfg(any(target_feature = "sm_89", target_feature = "sm_90"))]
    {
        let mut w = [0u32; 4];
        // SAFETY: the caller's promise; each arm's access has the size of the `N` values and
        // writes as many bytes of `w` from its start, which the read below takes back as `T`s.
        unsafe {
            match N * size_of::<T>() {
                16 => asm!(
                    "{{ .reg .b64 rope_pol; createpolicy.fractional.L2::evict_last.b64 rope_pol, 1.0; ld.global.L2::cache_hint.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}], rope_pol; }}",
                    p = in(reg64) p,
                    a = out(reg32) w[0], b = out(reg32) w[1], c = out(reg32) w[2], d = out(reg32) w[3],
                    options(nostack, preserves_flags, readonly),
                ),
                8 => asm!(
                    "{{ .reg .b64 rope_pol; createpolicy.fractional.L2::evict_last.b64 rope_pol, 1.0; ld.global.L2::cache_hint.v2.u32 {{{a}, {b}}}, [{p}], rope_pol; }}",
                    p = in(reg64) p,
                    a = out(reg32) w[0], b = out(reg32) w[1],
                    options(nostack, preserves_flags, readonly),
                ),
                4 => asm!(
                    "{{ .reg .b64 rope_pol; createpolicy.fractional.L2::evict_last.b64 rope_pol, 1.0; ld.global.L2::cache_hint.u32 {a}, [{p}], rope_pol; }}",
                    p = in(reg64) p,
                    a = out(reg32) w[0],
                    options(nostack, preserves_flags, readonly),
                ),
                2 => {
                    let h: u16;
                    asm!(
                        "{{ .reg .b64 rope_pol; createpolicy.fractional.L2::evict_last.b64 rope_pol, 1.0; ld.global.L2::cache_hint.b16 {a}, [{p}], rope_pol; }}",
                        p = in(reg64) p,
                        a = out(reg16) h,
                        options(nostack, preserves_flags, readonly),
                    );
                    // Little-endian: the two bytes at the start of `w`.
                    w[0] = u32::from(h);
                }
                _ => return crate::access::load::<T, N>(p),
            }
            w.as_ptr().cast::<[T; N]>().read_unaligned()
        }
    }
    #[cfg(not(any(target_feature = "sm_89", target_feature = "sm_90")))]
    // SAFETY: the caller's promise.
    unsafe {
        crate::access::load::<T, N>(p)
    }
}
