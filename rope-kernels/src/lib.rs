//! RoPE kernels for NVIDIA GPUs, written in Rust and compiled to PTX by rustc's own
//! `nvptx64-nvidia-cuda` backend (`cargo xtask ptx`).
//!
//! The crate has two faces:
//! - on `nvptx64` it exports the `extern "ptx-kernel"` entry points of `rope`, `fused` and
//!   `table` (one file per kernel family), built on the few device intrinsics gathered in `intrinsics`;
//! - everywhere, including stable Rust on the host, it exposes the pure arithmetic in [`math`]
//!   and [`divide`] and the launch contract in [`abi`], so the host library and the CPU tests
//!   share them.
//!
//! Moving to another GPU backend (for example rust-cuda's NVVM) means swapping the
//! `intrinsics` module and nothing else.
#![no_std]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(abi_ptx, stdarch_nvptx, f16, asm_experimental_arch, core_float_math)
)]

// On the host, `math` takes its fused multiply-add from `std`.
#[cfg(not(target_arch = "nvptx64"))]
extern crate std;

pub mod abi;
pub mod divide;
pub mod math;

#[cfg(target_arch = "nvptx64")]
mod access;
#[cfg(target_arch = "nvptx64")]
mod elem;
#[cfg(target_arch = "nvptx64")]
pub mod fused;
#[cfg(target_arch = "nvptx64")]
mod intrinsics;
#[cfg(target_arch = "nvptx64")]
pub mod rope;
#[cfg(target_arch = "nvptx64")]
pub mod table;
