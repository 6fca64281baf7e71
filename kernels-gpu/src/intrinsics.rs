//! The only module that touches `core::arch::nvptx`: thread and block indices and `trap`.
//!
//! Each wrapper reads a special register; none has preconditions, so they are safe functions.

use core::arch::nvptx;

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

/// Aborts the kernel (the launch then fails with an illegal-instruction error on the host).
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` ends the kernel; it has no memory effects a caller relies on.
    unsafe { nvptx::trap() }
}
