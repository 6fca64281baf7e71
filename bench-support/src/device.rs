//! The device the demo and the benchmark run on, set up once.

use std::sync::Arc;

use rope_host::cudarc::driver::{CudaContext, CudaStream};
use rope_host::{Rope, open_device};

use crate::Error;
use crate::timing::L2Flush;

/// Device 0 with a stream, a RoPE handle on that stream and the L2 flush buffer: what every
/// timed run of the demo and the benchmark uses.
pub struct BenchDevice {
    /// The context of device 0.
    pub ctx: Arc<CudaContext>,
    /// The stream every launch, copy and event goes to.
    pub stream: Arc<CudaStream>,
    /// The RoPE handle on `stream`.
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
        let rope = Rope::new(stream.clone()).map_err(Error::Setup)?;
        let flush = L2Flush::new(&stream).map_err(|e| Error::Setup(e.into()))?;
        Ok(Self {
            ctx,
            stream,
            rope,
            flush,
        })
    }
}
