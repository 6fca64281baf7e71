//! The Python package `rope_rs`: rope-rs's RoPE kernels on tensors that other frameworks own
//! (PyTorch and anything else that speaks DLPack), launched on the caller's CUDA stream through
//! [`rope_host::Rope::run_raw`].
//!
//! - `dlpack.rs`: DLPack's C structures and their reading into rope-host's raw forms, pure and
//!   tested without Python;
//! - `native.rs` (feature `python`): the extension module `rope_rs._native`.
//!
//! Build the wheel with `maturin build --release -m python/pyproject.toml`; `cargo test`
//! builds this crate without Python (the feature is off) and runs the DLPack tests.

pub mod dlpack;
#[cfg(feature = "python")]
mod native;
