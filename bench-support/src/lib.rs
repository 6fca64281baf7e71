//! What the demo (`rope-demo`) and the benchmark (`rope-bench`) share.
//!
//! - [`BenchDevice`]: device 0 with its stream, RoPE handle and L2 flush buffer, set up once.
//! - [`timing`]: medians of device-event-timed runs after warm-up, paired runs of two
//!   functions, and the L2 flush run before each timed region.
//! - [`copy`]: the reference kernels (an empty kernel and plain copies) in hand-written PTX.
//! - [`decode`]: a serving loop's decode step, eager and inside a CUDA graph.
//! - [`first_call`]: a fresh process's first launch of one kernel family, from opening the
//!   device.
//! - [`fused`]: the fused kernels at decode and prefill, against a copy of their bytes and the
//!   unfused sequence.
//! - [`report`]: the benchmark's JSON report.
//!
//! ```no_run
//! use rope_bench_support::BenchDevice;
//! use rope_bench_support::timing::Runs;
//!
//! let mut gpu = BenchDevice::open()?;
//! let src = gpu.stream.alloc_zeros::<u8>(1 << 30)?;
//! let mut dst = gpu.stream.alloc_zeros::<u8>(1 << 30)?;
//! let ms = gpu.copy_ms(Runs { warmup: 5, timed: 50 }, &src, &mut dst)?;
//! println!("1 GiB device-to-device copy: {ms:.3} ms");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod copy;
pub mod decode;
mod device;
mod error;
pub mod first_call;
pub mod fused;
pub mod report;
pub mod timing;

pub use device::BenchDevice;
pub use error::Error;
