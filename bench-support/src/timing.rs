//! Event timing shared by the demo and the benchmark: the median of many device-event-timed
//! runs after warm-up, with an optional step (an L2 flush) run before each timed region; and two
//! functions timed alternately, so that their comparison sees the same clocks (callers that also
//! give both the same buffers take buffer placement out of it too).

use std::sync::Arc;

use rope_host::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DriverError, sys};
use serde::Serialize;

/// How many runs to discard and to time.
#[derive(Clone, Copy, Debug, Serialize)]
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

/// The median of `values` (non-empty) with a distribution-free 95% confidence interval for the
/// median of the population they were drawn from: `[lower, median, upper]`.
///
/// Of `n` independent draws, the number below the population median is Binomial(`n`, 1/2), so
/// the order statistics of ranks `n/2 - 0.98 sqrt(n)` and `1 + n/2 + 0.98 sqrt(n)` (1-based,
/// rounded; the normal approximation, `1.96 / 2 = 0.98`) bracket it with about 95% probability
/// whatever the distribution. With fewer than 6 values the interval is the whole range.
pub fn median_interval(mut values: Vec<f64>) -> [f64; 3] {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    let half_width = 0.98 * (n as f64).sqrt();
    let rank = |r: f64| (r.round().max(1.0) as usize).min(n) - 1;
    [
        values[rank(n as f64 / 2.0 - half_width)],
        values[n / 2],
        values[rank(1.0 + n as f64 / 2.0 + half_width)],
    ]
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

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{RngExt, SeedableRng};

    use super::*;

    #[test]
    fn median_interval_takes_the_textbook_ranks() {
        // n = 100: the 40th and 61st smallest values (Conover's table), in any input order.
        let values: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(median_interval(values), [40.0, 51.0, 61.0]);
        // Tiny samples: the whole range.
        assert_eq!(median_interval(vec![3.0, 1.0, 2.0]), [1.0, 2.0, 3.0]);
        assert_eq!(median_interval(vec![7.0]), [7.0, 7.0, 7.0]);
    }

    #[test]
    fn median_interval_covers_the_median_about_95_percent_of_the_time() {
        // Skewed draws (exponential, median ln 2) from a fixed seed.
        let mut rng = StdRng::seed_from_u64(2026);
        let trials = 2000;
        let mut covered = 0;
        for _ in 0..trials {
            let draws = (0..200)
                .map(|_| -(1.0 - rng.random::<f64>()).ln())
                .collect();
            let [lo, _, hi] = median_interval(draws);
            covered += usize::from(lo <= std::f64::consts::LN_2 && std::f64::consts::LN_2 <= hi);
        }
        let rate = covered as f64 / trials as f64;
        assert!((0.93..=0.975).contains(&rate), "coverage {rate}");
    }
}
