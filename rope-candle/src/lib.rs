//! rope-rs inside [candle](https://github.com/huggingface/candle): RoPE as candle custom ops
//! whose CUDA forward launches rope-host on candle's own stream and buffers (strided views
//! without copies) and whose backward is the transposed rotation, so gradients flow through
//! `candle_core::backprop`.
//!
//! - [`rope`], [`rope_i`], [`rope_thd`]: `candle_nn::rotary_emb`'s signatures and tables; CPU
//!   tensors go to candle_nn's implementation.
//! - [`apply`] and [`apply_qk`] with a [`RopeSpec`]: device position ids or multi-axis positions
//!   ([`Positions::MultiAxis`] with an [`AxisMap`] uploaded by [`axis_map`]), in-kernel sin/cos
//!   ([`SinCos::Computed`], or [`SinCos::Frequencies`] for the scaling families), partial
//!   rotary, `[b, h, s, d]` or `[b, s, h, d]`; CUDA only.
//! - [`apply_inplace`] and [`apply_qk_inplace`]: the same, rotating the tensors where they are
//!   (candle's in-place ops: strided views of a fused QKV tensor, no gradients); CUDA only.
//! - [`fused_inplace`] with a [`FusedSpec`]: the serving epilogue in one launch, per-head RMS
//!   normalisation of q and k ([`QkNorm`]), their rotation in place, and k and v written into
//!   a paged KV cache ([`PagedKvCache`], elements or FP8); CUDA only.
//!
//! Build: candle-core's `cuda` feature runs nvcc (see the crate's README), and rope-host is used
//! with its default features off, so candle picks cudarc's linking mode and CUDA version.
//!
//! ```no_run
//! use candle_core::{DType, Device, Tensor};
//!
//! fn main() -> candle_core::Result<()> {
//!     let dev = Device::new_cuda(0)?;
//!     let (b, h, t, d) = (1, 8, 16, 64);
//!     let xs = Tensor::randn(0f32, 1., (b, h, t, d), &dev)?;
//!     let cos = Tensor::randn(0f32, 1., (t, d / 2), &dev)?;
//!     let sin = Tensor::randn(0f32, 1., (t, d / 2), &dev)?;
//!     // Was: candle_nn::rotary_emb::rope(&xs, &cos, &sin)?
//!     let ys = rope_candle::rope(&xs, &cos, &sin)?;
//!     assert_eq!(ys.dtype(), DType::F32);
//!     Ok(())
//! }
//! ```

mod drop_in;
mod error;
mod fused;
mod layout;
mod op;
mod rich;
mod training;

pub use drop_in::{rope, rope_i, rope_thd};
pub use error::Error;
pub use fused::{CacheValues, FusedSpec, PagedKvCache, QkNorm, fused_inplace};
pub use layout::Axes;
pub use rich::{
    Positions, RopeSpec, SinCos, apply, apply_inplace, apply_qk, apply_qk_inplace, axis_map,
    frequencies,
};
pub use rope_host::{
    AngleMode, AxisMap, ConfigBase, ConfigValue, DeviceAxisMap, FrequencySpec, NormWeight,
    RopeScaling, RopeStyle,
};
pub use training::{NormRopeSpec, norm_rope};
