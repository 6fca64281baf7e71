//! What launches know of the device: the facts the planner reads ([`DeviceFacts`], queried once
//! per `Rope`), how a launch may overlap the kernel before it ([`StreamOverlap`]), and whether a
//! stream is capturing a graph ([`capturing`]). Plain values, so the pure rooms (planning,
//! tuning) take them without a handle.

use std::sync::Arc;

use cudarc::driver::sys::{CUdevice_attribute, CUstream, CUstreamCaptureStatus};
use cudarc::driver::{CudaContext, result};

use crate::error::Result;

/// What the launch planner knows of the device, queried once per [`crate::Rope`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceFacts {
    /// Streaming multiprocessors.
    pub(crate) sm_count: u32,
    /// Threads one multiprocessor holds at once (2048 on sm_80 and sm_90, 1536 on sm_86 and
    /// sm_89).
    pub(crate) threads_per_sm: u32,
    /// Peak DRAM bandwidth in GB/s: twice the memory clock times the bus width (3352 on an
    /// H100 SXM, 4915 on an H200; 0 where the driver reports no memory clock, so that only
    /// choices made for slower memory apply).
    pub(crate) dram_gb_per_s: u32,
}

impl DeviceFacts {
    /// The facts of `ctx`'s device.
    ///
    /// # Errors
    /// [`crate::Error::Driver`] when an attribute query fails.
    pub(crate) fn query(ctx: &Arc<CudaContext>) -> Result<Self> {
        let attribute = |a| -> Result<u32> { Ok(ctx.attribute(a)?.max(1) as u32) };
        Ok(Self {
            sm_count: attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            threads_per_sm: attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
            )?,
            // kHz times bits, two transfers a clock: kHz * bits / 4e6 is GB/s.
            dram_gb_per_s: (u64::from(attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE,
            )?) * u64::from(attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH,
            )?) / 4_000_000)
                .min(u64::from(u32::MAX)) as u32,
        })
    }
}

/// How a launch may overlap the kernel before it on the same stream.
///
/// The default, [`StreamOverlap::None`], is the stream's usual order: a kernel starts after the
/// previous work has completed. [`StreamOverlap::Programmatic`] asks for programmatic dependent
/// launch (compute capability 9.0 and newer): the launch carries the driver's programmatic stream
/// serialization attribute, so its blocks may be scheduled as the previous kernel's blocks
/// finish, before that kernel has completed; they wait (`griddepcontrol.wait`) until it has
/// completed and its writes are visible before they read or write any memory. Results are the
/// same either way; what overlaps is one kernel's launch with the end of the one before (at
/// decode inside a CUDA graph, a sizeable share of each launch's time: docs/perf/decisions.md).
/// It applies to the kernels built for it ([`PtxBuild::Sm90`](crate::PtxBuild): the one-head
/// kernels decode steps take, and the fused kernels but the item-loop fallbacks); every other
/// launch, and every launch on older devices, is ordered as with [`StreamOverlap::None`]. The
/// kernels do not trigger their dependents early, so a launch after them starts no sooner than
/// it would after any kernel, unless the handle reads ahead ([`crate::Rope::with_read_ahead`]).
/// Captured in a CUDA graph, such launches become programmatic edges (a driver of CUDA 12.3 or
/// newer).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StreamOverlap {
    /// Every launch starts after the previous work on its stream has completed.
    #[default]
    None,
    /// Programmatic dependent launch where the device and the kernel support it.
    Programmatic,
}

/// Whether `stream` of `ctx` is capturing a CUDA graph, or its state cannot be told: either
/// way no upload (a synchronizing copy) may happen now. The one capture check of the crate.
///
/// # Safety
/// `stream` is a live stream of `ctx`.
pub(crate) unsafe fn capturing(ctx: &CudaContext, stream: CUstream) -> bool {
    if ctx.bind_to_thread().is_err() {
        return true;
    }
    // SAFETY: `stream` belongs to `ctx`, now current on this thread (the caller's promise).
    match unsafe { result::stream::is_capturing(stream) } {
        Ok(status) => status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
        Err(_) => true,
    }
}
