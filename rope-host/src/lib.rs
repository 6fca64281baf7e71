//! Rotary position embedding (RoPE) on NVIDIA GPUs, with kernels written in Rust.
//!
//! The kernels (crate `kernels-gpu`) are compiled to PTX by rustc's NVPTX backend and embedded
//! here ([`PTX`]); at run time only the CUDA driver is needed, loaded dynamically, so this crate
//! builds on stable Rust on machines with no CUDA installed.
//!
//! Both pairings ([`RopeStyle::Interleaved`], GPT-J; [`RopeStyle::Neox`], rotate-half), forward
//! and backward ([`Direction`]), sin/cos from tables or computed from `theta` in the kernel
//! ([`SinCos`]), implicit or explicit positions ([`Positions`]), in place or out of place
//! ([`Io`]), on `[batch, seq, heads, head_dim]` tensors ([`Layout`]).
//!
//! ```no_run
//! use rope_host::{open_device, Io, Layout, Positions, Rope, RopeConfig, RopeOp, RopeStyle, SinCos};
//!
//! let ctx = open_device(0)?;
//! let stream = ctx.default_stream();
//! let rope = Rope::new(stream.clone())?;
//! let (batch, seq, heads, head_dim) = (1, 8192, 32, 128);
//! let mut q = stream.alloc_zeros::<f32>(batch * seq * heads * head_dim)?;
//! let op = RopeOp {
//!     config: RopeConfig::builder(head_dim as u32, RopeStyle::Neox).build()?,
//!     layout: Layout::bshd(batch, seq, heads, head_dim),
//!     positions: Positions::Offset(0),
//!     sincos: SinCos::Computed { theta: 500_000.0 },
//! };
//! rope.run(&op, Io::InPlace(q.as_view_mut()))?;
//! stream.synchronize()?;
//! # Ok::<(), rope_host::Error>(())
//! ```

mod error;
mod freq;
mod module;
mod rope;

pub use cudarc;
pub use error::{Error, Result};
pub use freq::inv_freq;
pub use module::{PTX, open_device};
pub use rope::{
    DType, Direction, IdsShape, Io, KernelResources, Layout, PositionIds, Positions, Rope,
    RopeConfig, RopeConfigBuilder, RopeElem, RopeOp, RopeStyle, SinCos,
};
