//! The one error type of the set-up.

/// Why [`BenchDevice::open`](crate::BenchDevice::open) failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Device 0 could not be opened: no CUDA driver, or no device. The demo runs its CPU path
    /// instead; the benchmark stops.
    #[error("device 0 could not be opened")]
    NoDevice(#[source] rope_host::Error),
    /// Device 0 is open, but its stream, its RoPE handle or the L2 flush buffer could not be
    /// created.
    #[error("setting up device 0")]
    Setup(#[source] rope_host::Error),
}
