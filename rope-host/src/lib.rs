//! Rotary position embedding (RoPE) on NVIDIA GPUs, with kernels written in Rust.
//!
//! The kernels (crate `rope-kernels`) are compiled to PTX by rustc's NVPTX backend and embedded
//! here, zstd-compressed ([`ptx`]: one build for sm_80 and two for the kernels with newer code
//! on sm_89 and on sm_90 and newer), with their cubins in the published packages; at run time
//! only the CUDA driver is needed, loaded dynamically, so this
//! crate builds on stable Rust on machines with no CUDA installed.
//!
//! Both pairings ([`RopeStyle::Interleaved`], GPT-J; [`RopeStyle::Neox`], rotate-half),
//! forward and backward ([`Direction`]), partial rotary ([`RopeConfigBuilder::rotary_dim`]),
//! sin/cos from tables, a combined `cos_sin_cache` or computed from `theta` in the kernel
//! ([`SinCos`]), implicit, explicit or packed variable-length positions ([`Positions`]),
//! `f32`/`f16`/`bf16` ([`RopeElem`]), any strided layout with contiguous heads ([`Layout`]), in
//! place or out of place ([`Io`]), and q and k in one launch ([`Rope::run_qk`], [`QkIo`]).
//!
//! Positions other than a constant offset live in device memory ([`DeviceInts`]), so launches
//! allocate, copy and synchronize nothing and can be captured in CUDA graphs (see
//! [`Rope::prepare`]); memory and streams owned by other frameworks go through the `unsafe`
//! [`Rope::run_raw`]. Decode steps and fused launches can overlap the kernel before them on
//! Hopper and newer ([`StreamOverlap::Programmatic`]).
//!
//! ```no_run
//! use rope_host::{
//!     open_device, Io, Layout, Positions, Rope, RopeConfig, RopeOp, RopeStyle, SinCos, TensorMut,
//! };
//!
//! let ctx = open_device(0)?;
//! let stream = ctx.default_stream();
//! let rope = Rope::new(stream.clone())?;
//! let (batch, seq, heads, head_dim) = (1, 8192, 32, 128);
//! let mut q = stream.alloc_zeros::<rope_host::half::bf16>(batch * seq * heads * head_dim)?;
//! let op = RopeOp {
//!     config: RopeConfig::builder(head_dim as u32, RopeStyle::Neox).build()?,
//!     positions: Positions::Offset(0),
//!     sincos: SinCos::Computed { theta: 500_000.0 },
//! };
//! let layout = Layout::bshd(batch, seq, heads, head_dim);
//! rope.run(&op, Io::InPlace(TensorMut { data: q.as_view_mut(), layout }))?;
//! stream.synchronize()?;
//! # Ok::<(), rope_host::Error>(())
//! ```
#![warn(missing_docs)]
// No public entry reaches a panic: an input the checks missed comes back as an `Error`, and
// every index is checked (`get`) or proved by a fixed size. Tests assert with `expect` freely.
#![cfg_attr(
    not(test),
    deny(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )
)]

mod bind;
mod check;
mod config;
mod device;
mod error;
mod freq;
mod fused;
mod handle;
mod kernel_args;
mod layout;
mod module;
mod op;
mod plan;
mod positions;
mod ptx;
mod rope;
mod sass;
pub mod shared;
mod sincos;
mod table;
mod tuning;

pub use bind::RawBuf;
pub use config::{DType, Direction, RopeConfig, RopeConfigBuilder, RopeElem, RopeStyle};
pub use cudarc;
pub use device::StreamOverlap;
pub use error::{Error, Result};
pub use freq::{
    AngleMode, ConfigBase, ConfigValue, DEFAULT_THETA, Frequencies, FrequencySpec, InvFreq,
    ROPE_SCALING_KEYS, RopeScaling, Yarn, YarnBlend, axial_inv_freq, check_default_frequencies,
    inv_freq,
};
pub use fused::{
    CacheAddress, CacheData, CacheLayout, CacheNonRotary, Fp8Format, Fp8Scale, FusedGrads, FusedIo,
    FusedOp, KOut, KvCache, NonRotary, NonRotaryCache, NormScope, NormWeight, Nvfp4Cache,
    PageTable, QOut, QkNorm, RawCacheAddress, RawCacheData, RawCacheNonRotary, RawFp8Scale,
    RawFusedGrads, RawFusedIo, RawFusedOp, RawKOut, RawKvCache, RawNonRotary, RawNvfp4Cache,
    RawPageTable, RawQOut, RawQkNorm,
};
pub use half;
pub use handle::{FREQUENCY_CACHE, KernelResources, Rope};
pub use layout::Layout;
pub use module::{KernelCode, PTX_ARCH_VAR, open_device};
pub use op::{Io, QkIo, RopeOp, Tensor, TensorMut};
pub use positions::{
    AxisMap, ContextParallel, DeviceAxisMap, DeviceInts, IdsShape, IntType, ItemAxes, Positions,
    RawAxisMap, RawInts, RawPositions,
};
pub use ptx::ptx;
pub use rope::{RawIo, RawOp, RawTensor, RawTensors};
pub use rope_kernels::abi::PtxBuild;
pub use sass::{KERNEL_CODE_VAR, compiled_architectures};
pub use sincos::{RawSinCos, SinCos, TableShape};
pub use table::{SinCosTables, TableData, TableFormat};
#[doc(hidden)]
pub use tuning::FusedKernels;

/// The crate README's example compiles as a doctest. (The repository README's examples are
/// doctests of `rope-tests`: a path outside this folder would not be in the published package.)
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
