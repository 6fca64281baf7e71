//! The device the demo and the benchmark run on, set up once.

use std::sync::Arc;

use rope_harness::case::{DeviceCase, Source, TestElem};
use rope_host::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, DriverError};
use rope_host::{FusedKernels, Rope, open_device};

use crate::Error;
use crate::timing::{L2Flush, Runs, median_ms, paired_ms};

/// Device 0 with a stream, a RoPE handle on that stream and the L2 flush buffer: what every
/// timed run of the demo and the benchmark uses.
pub struct BenchDevice {
    /// The context of device 0.
    pub ctx: Arc<CudaContext>,
    /// The stream every launch, copy and event goes to.
    pub stream: Arc<CudaStream>,
    /// The RoPE handle on `stream`, its fused kernels pinned as
    /// `ROPE_BENCH_FUSED_KERNELS` says.
    pub rope: Rope,
    /// The buffer overwritten before each timed run.
    pub flush: L2Flush,
}

impl BenchDevice {
    /// Opens device 0 and creates, in this order, a stream, the RoPE handle and the flush
    /// buffer.
    ///
    /// # Errors
    /// [`Error::NoDevice`] when device 0 cannot be opened (no driver, or no device);
    /// [`Error::Setup`] when the stream, the handle or the buffer cannot be created.
    pub fn open() -> Result<Self, Error> {
        let ctx = open_device(0).map_err(Error::NoDevice)?;
        let stream = ctx.new_stream().map_err(|e| Error::Setup(e.into()))?;
        let rope = Rope::new(stream.clone())
            .map_err(Error::Setup)?
            .with_fused_kernels(kernels_from_env());
        let flush = L2Flush::new(&stream).map_err(|e| Error::Setup(e.into()))?;
        Ok(Self {
            ctx,
            stream,
            rope,
            flush,
        })
    }

    /// Median time in milliseconds of a device-to-device copy of `src` into `dst`
    /// ([`median_ms`]), L2 flushed before each timed copy.
    ///
    /// # Errors
    /// The driver's error when a copy or an event fails.
    ///
    /// # Panics
    /// When `dst` is shorter than `src`.
    pub fn copy_ms<T: DeviceRepr>(
        &mut self,
        runs: Runs,
        src: &CudaSlice<T>,
        dst: &mut CudaSlice<T>,
    ) -> Result<f64, DriverError> {
        let stream = &self.stream;
        median_ms(&self.ctx, stream, runs, Some(&mut self.flush), || {
            stream.memcpy_dtod(src, dst)
        })
    }

    /// Times `case` with each of `sources` in turn on its buffers, launched alternately
    /// ([`paired_ms`]), L2 flushed before each timed launch; milliseconds per pair, in the
    /// order of `sources`. The case is left with whichever source ran last.
    ///
    /// # Errors
    /// Any error of a launch or an event.
    pub fn paired_sources_ms<T: TestElem>(
        &mut self,
        runs: Runs,
        case: &mut DeviceCase<T>,
        sources: [Source; 2],
    ) -> rope_host::Result<Vec<[f64; 2]>> {
        let rope = &self.rope;
        paired_ms(
            &self.ctx,
            &self.stream,
            runs,
            Some(&mut self.flush),
            |side| {
                case.case.source = sources[side];
                case.launch(rope)
            },
        )
    }
}

/// Environment variable: pins the fused kernels of every handle the benchmark makes
/// ([`Rope::with_fused_kernels`], for A/B runs of kernels the planner would not take):
/// `item-loop`, `2` or `4` heads per thread, `rows` (or `rows2` to `rows4` token buffers per
/// block); unset or anything else, the planner's choice.
pub const KERNELS_VAR: &str = "ROPE_BENCH_FUSED_KERNELS";

/// The fused kernels [`KERNELS_VAR`] pins.
pub fn kernels_from_env() -> FusedKernels {
    match std::env::var(KERNELS_VAR).as_deref() {
        Ok("item-loop") => FusedKernels::ItemLoop,
        Ok("2") => FusedKernels::TwoHeads,
        Ok("4") => FusedKernels::FourHeads,
        Ok("rows") => FusedKernels::ROWS,
        Ok("rows2") => FusedKernels::Rows { stages: 2 },
        Ok("rows3") => FusedKernels::Rows { stages: 3 },
        Ok("rows4") => FusedKernels::Rows { stages: 4 },
        _ => FusedKernels::Auto,
    }
}
