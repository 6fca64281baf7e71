//! Event timing shared by the demo and the benchmark: the median of many device-event-timed
//! runs after warm-up, with an optional step (an L2 flush) run before each timed region; and two
//! functions timed alternately, so that their comparison sees the same clocks (callers that also
//! give both the same buffers take buffer placement out of it too).

use std::sync::Arc;

use rope_host::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError, sys};

/// How many runs to discard and to time.
#[derive(Clone, Copy, Debug)]
pub struct Runs {
    /// Untimed runs first (module load, caches, clocks).
    pub warmup: usize,
    /// Timed runs; the median is reported.
    pub timed: usize,
}

/// A buffer written before each timed run so that the next run reads its inputs from device
/// memory rather than from L2.
pub struct L2Flush {
    buf: CudaSlice<u8>,
}

impl L2Flush {
    /// Bytes overwritten: several times the 50 MiB L2 of an H100/H200.
    pub const BYTES: usize = 256 << 20;

    /// Allocates the flush buffer.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self, DriverError> {
        Ok(Self {
            buf: stream.alloc_zeros::<u8>(Self::BYTES)?,
        })
    }

    /// Overwrites the buffer (asynchronously, on `stream`).
    pub fn run(&mut self, stream: &Arc<CudaStream>) -> Result<(), DriverError> {
        stream.memset_zeros(&mut self.buf)
    }
}

/// Median time of `f` in milliseconds over `runs.timed` runs, each bracketed by device
/// events, after `runs.warmup` untimed runs; `flush` (if any) runs before each timed region.
pub fn median_ms<E: From<DriverError>>(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    runs: Runs,
    mut flush: Option<&mut L2Flush>,
    mut f: impl FnMut() -> Result<(), E>,
) -> Result<f64, E> {
    for _ in 0..runs.warmup {
        f()?;
    }
    let mut times = Vec::with_capacity(runs.timed);
    for _ in 0..runs.timed.max(1) {
        times.push(timed_ms(ctx, stream, flush.as_deref_mut(), &mut f)?);
    }
    Ok(quartiles(times)[1])
}

/// The lower quartile, median and upper quartile of `values` (non-empty).
pub fn quartiles(mut values: Vec<f64>) -> [f64; 3] {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    [values[n / 4], values[n / 2], values[n * 3 / 4]]
}

/// Times of `f(0)` and `f(1)` in milliseconds, run alternately: `runs.timed` pairs after
/// `runs.warmup` untimed pairs, `f(0)` first in even pairs and `f(1)` first in odd ones,
/// `flush` (if any) before each timed region. Pair `i` holds the two times taken back to back,
/// so their ratio compares the two under the same clocks and temperature.
pub fn paired_ms<E: From<DriverError>>(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    runs: Runs,
    mut flush: Option<&mut L2Flush>,
    mut f: impl FnMut(usize) -> Result<(), E>,
) -> Result<Vec<[f64; 2]>, E> {
    for _ in 0..runs.warmup {
        f(0)?;
        f(1)?;
    }
    let mut pairs = Vec::with_capacity(runs.timed);
    for i in 0..runs.timed.max(1) {
        let mut pair = [0.0; 2];
        for side in [i % 2, 1 - i % 2] {
            pair[side] = timed_ms(ctx, stream, flush.as_deref_mut(), || f(side))?;
        }
        pairs.push(pair);
    }
    Ok(pairs)
}

/// One run of `f` bracketed by device events, in milliseconds, after `flush` (if any).
fn timed_ms<E: From<DriverError>>(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    flush: Option<&mut L2Flush>,
    mut f: impl FnMut() -> Result<(), E>,
) -> Result<f64, E> {
    if let Some(flush) = flush {
        flush.run(stream)?;
    }
    let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
    let start = ctx.new_event(flags)?;
    let end = ctx.new_event(flags)?;
    start.record(stream)?;
    f()?;
    end.record(stream)?;
    end.synchronize()?;
    Ok(start.elapsed_ms(&end)? as f64)
}
