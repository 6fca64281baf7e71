//! The Python package `rope_rs`: rope-rs's RoPE kernels on tensors that other frameworks own
//! (PyTorch and anything else that speaks DLPack), launched on the caller's CUDA stream through
//! [`rope_host::Rope::run_raw`].
//!
//! Pure, tested by `cargo test` without Python (a `rope_scaling` dictionary is read by
//! rope-host's `FrequencySpec::from_rope_scaling`):
//! - `dlpack.rs`: DLPack's C structures and their reading into rope-host's raw forms;
//! - `exchange.rs`: DLPack's C exchange API (`__dlpack_c_exchange_api__`): its tables, their
//!   version gate and calls (finding and caching each type's table is behind `python`);
//! - `options.rs`: which of `apply_rope`'s exclusive arguments select positions and sin/cos;
//!
//! Behind the feature `python` (the extension module `rope_rs._native`):
//! - `native.rs`: the Python functions and their arguments (`flashinfer.rs`: FlashInfer's
//!   `rope_quantize_fp8` forms, with the eager calls of its drop-ins; `hf.rs`: Hugging Face's
//!   `apply_rotary_pos_emb` eager call; `eager.rs`: torch's objects those calls use;
//!   `training.rs`: the QK-norm + RoPE training form; `dit.rs`: the diffusion transformers'
//!   norm across heads);
//! - `launch.rs`: tensors borrowed by DLPack (the exchange API's fast path, else `__dlpack__`),
//!   one launch, and what persists between calls.
//!
//! Build the wheel as the README's Set up does (maturin, linked by zig for manylinux2014);
//! `cargo test` builds this crate without Python (the feature is off).

#[cfg(feature = "python")]
mod dit;
pub mod dlpack;
#[cfg(feature = "python")]
mod eager;
pub mod exchange;
#[cfg(feature = "python")]
mod flashinfer;
#[cfg(feature = "python")]
mod fused;
#[cfg(feature = "python")]
mod hf;
#[cfg(feature = "python")]
mod launch;
#[cfg(feature = "python")]
mod native;
pub mod options;
#[cfg(feature = "python")]
mod training;

/// rope-rs: rotary position embedding on NVIDIA GPUs, kernels written in Rust; tensors by
/// DLPack.
#[cfg(feature = "python")]
#[pyo3::pymodule]
#[pyo3(name = "_native")]
fn native_module(m: &pyo3::Bound<'_, pyo3::types::PyModule>) -> pyo3::PyResult<()> {
    native::register(m)?;
    flashinfer::register(m)?;
    training::register(m)?;
    dit::register(m)?;
    hf::register(m)
}
