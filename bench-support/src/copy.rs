//! Reference kernels in hand-written PTX (`ptx/copy.ptx`): an empty kernel, the launch-overhead
//! floor of the decode case, and plain copy kernels (16 bytes per thread and iteration,
//! grid-stride; one access or four independent ones per iteration), which show what a simple
//! kernel reaches next to the driver's copy.

use std::sync::Arc;

use rope_host::cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg,
    sys::CUdevice_attribute,
};
use rope_host::cudarc::nvrtc::Ptx;

/// The PTX text of the reference kernels.
pub const PTX: &str = include_str!("../ptx/copy.ptx");

/// Name of the empty kernel in [`PTX`].
const EMPTY: &str = "rope_bench_empty";

/// A plain copy kernel of [`PTX`]: `n` vectors of 16 bytes from `src` to `dst`, grid-stride.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyKernel {
    /// One 16-byte load and store per iteration.
    OneAccess,
    /// Four independent 16-byte loads, then their four stores, per iteration.
    FourAccesses,
}

impl CopyKernel {
    /// Every copy kernel, in the order the benchmark reports them.
    pub const ALL: [CopyKernel; 2] = [CopyKernel::OneAccess, CopyKernel::FourAccesses];

    /// The kernel's entry point in [`PTX`].
    pub const fn name(self) -> &'static str {
        match self {
            CopyKernel::OneAccess => "rope_bench_copy1",
            CopyKernel::FourAccesses => "rope_bench_copy4",
        }
    }
}

/// The reference kernels loaded on one context.
#[derive(Debug)]
pub struct ReferenceKernels {
    empty: CudaFunction,
    one_access: CudaFunction,
    four_accesses: CudaFunction,
    /// The copies' launch: 8 blocks of 256 threads per SM.
    copy_grid: LaunchConfig,
}

impl ReferenceKernels {
    /// Loads [`PTX`] on `ctx` and looks up every kernel.
    ///
    /// # Errors
    /// The driver's error when the module does not load on this device or a kernel is missing.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, DriverError> {
        let module = ctx.load_module(Ptx::from_src(PTX))?;
        let sms = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        Ok(Self {
            empty: module.load_function(EMPTY)?,
            one_access: module.load_function(CopyKernel::OneAccess.name())?,
            four_accesses: module.load_function(CopyKernel::FourAccesses.name())?,
            copy_grid: LaunchConfig {
                grid_dim: (sms as u32 * 8, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
        })
    }

    /// Launches the empty kernel on one thread (asynchronously, on `stream`).
    ///
    /// # Errors
    /// The driver's error when the launch fails.
    pub fn launch_empty(&self, stream: &Arc<CudaStream>) -> Result<(), DriverError> {
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `rope_bench_empty` in ptx/copy.ptx takes no parameters and touches no memory.
        unsafe { stream.launch_builder(&self.empty).launch(one) }.map(drop)
    }

    /// Launches `kernel` (asynchronously, on `stream`) on 8 blocks of 256 threads per SM,
    /// copying the whole 16-byte vectors of the shorter of `src` and `dst`.
    ///
    /// # Errors
    /// The driver's error when the launch fails.
    pub fn launch_copy(
        &self,
        stream: &Arc<CudaStream>,
        kernel: CopyKernel,
        src: &CudaSlice<u8>,
        dst: &mut CudaSlice<u8>,
    ) -> Result<(), DriverError> {
        let vectors = (src.len().min(dst.len()) / 16) as u64;
        let func = match kernel {
            CopyKernel::OneAccess => &self.one_access,
            CopyKernel::FourAccesses => &self.four_accesses,
        };
        let mut launch = stream.launch_builder(func);
        launch.arg(src).arg(dst).arg(&vectors);
        // SAFETY: the arguments match `(.u64 src, .u64 dst, .u64 n)` of `rope_bench_copy1` and
        // `rope_bench_copy4` in ptx/copy.ptx; both kernels access vectors `0..n` only, and
        // `vectors` fits in each buffer; a `CudaSlice` is a whole device allocation, which CUDA
        // aligns to at least 256 bytes, so every 16-byte access is aligned; `dst` is borrowed
        // mutably, so it does not alias `src`.
        unsafe { launch.launch(self.copy_grid) }.map(drop)
    }
}
