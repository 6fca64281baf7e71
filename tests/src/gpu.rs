//! Access to the GPU for tests: one shared stream, or a printed skip.
//!
//! Without a GPU (no driver, or no device) a GPU test prints `SKIPPED (no GPU)` with the reason
//! and returns; with `ROPE_REQUIRE_GPU=1` (set by the GPU bundle's runner) it fails instead, so
//! GPU tests can never pass without running on a GPU.

use std::io::Write;
use std::sync::{Arc, OnceLock};

use rope_host::cudarc::driver::{CudaSlice, CudaStream};
use rope_host::{FusedKernels, Rope, SinCosTables, TableData, open_device};

/// A stream on device 0 and a RoPE handle on it.
type Device = (Arc<CudaStream>, Arc<Rope>);

/// The shared stream and RoPE handle, or why there is none.
fn device() -> &'static Result<Device, String> {
    static DEVICE: OnceLock<Result<Device, String>> = OnceLock::new();
    DEVICE.get_or_init(|| {
        let ctx = open_device(0).map_err(|e| e.to_string())?;
        let stream = ctx.new_stream().map_err(|e| e.to_string())?;
        let rope = Rope::new(stream.clone()).map_err(|e| e.to_string())?;
        Ok((stream, Arc::new(rope)))
    })
}

/// Whether the environment demands a GPU (`ROPE_REQUIRE_GPU=1`).
pub fn gpu_required() -> bool {
    std::env::var("ROPE_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The GPU stream and RoPE handle for test `name`, or `None` after printing that the test was
/// skipped.
///
/// # Panics
/// When no GPU is available and [`gpu_required`].
pub fn gpu_or_skip(name: &str) -> Option<Device> {
    match device() {
        Ok((stream, rope)) => Some((stream.clone(), rope.clone())),
        Err(why) if gpu_required() => panic!("{name}: ROPE_REQUIRE_GPU=1 but no GPU: {why}"),
        Err(why) => {
            // Written past libtest's capture, so the skip shows in every run's output.
            let _ = writeln!(std::io::stderr(), "SKIPPED (no GPU): {name}: {why}");
            None
        }
    }
}

/// Handles on `stream` whose fused launches take each of [`FusedKernels::ALL`] in turn (the
/// planner's choice, the item loop, two and four heads per thread, the rows kernels; see
/// [`Rope::with_fused_kernels`]). The fused tests spread their cases over them with
/// [`pinned_for`], so that one run reaches the kernels the planner keeps for other shapes or
/// devices.
///
/// # Panics
/// When the device cannot be queried.
pub fn pinned_handles(stream: &Arc<CudaStream>) -> Vec<(FusedKernels, Rope)> {
    FusedKernels::ALL
        .into_iter()
        .map(|k| {
            let rope = Rope::new(stream.clone()).expect("handle");
            (k, rope.with_fused_kernels(k))
        })
        .collect()
}

/// The handle of [`pinned_handles`] case `i` of a test takes: the next one each case, and one
/// further every twenty cases, so that cases of a period dividing 20 (every twentieth case
/// prefill-sized) still meet every handle.
pub fn pinned_for(i: u64) -> usize {
    ((i + i / 20) % FusedKernels::ALL.len() as u64) as usize
}

/// The `cos_sin_cache` of tables built with `TableFormat::Combined`.
///
/// # Panics
/// When the tables are separate.
pub fn combined_cache<T>(tables: &SinCosTables<T>) -> &CudaSlice<T> {
    match tables.data() {
        TableData::Combined(cache) => cache,
        TableData::Separate { .. } => panic!("tables built separate, expected combined"),
    }
}

/// The most random cases a GPU property test runs: `ROPE_GPU_CASES` when it is set to a number
/// (the bundle's sanitizer runs set it: kernels under compute-sanitizer run orders of magnitude
/// slower), else no limit.
pub fn case_cap() -> u64 {
    std::env::var("ROPE_GPU_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(u64::MAX)
}
