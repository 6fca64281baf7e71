//! The f64 reference of RoPE, pure host code: what the GPU harness (`rope-harness`), the
//! property tests, the demo and the benchmark check the kernels against.
//!
//! - [`reference`](mod@reference): RoPE written directly from its definition with ndarray, in f64.
//! - [`fused`](mod@fused): the fused kernels' normalisation, one head's rotation and FP8 bounds,
//!   and the backward of the normalisation with the rotation (QK-norm + RoPE in training).
//!
//! ```
//! use ndarray::{Array2, Array4, s};
//! use rope_host::{Direction, RopeStyle};
//! use rope_reference::reference::{self, RefSinCos};
//!
//! // One row of four tokens, two heads of 8: position 0 leaves its token unchanged.
//! let x = Array4::from_shape_fn((1, 4, 2, 8), |(_, t, h, e)| (t + h + e) as f64);
//! let positions = Array2::from_shape_fn((1, 4), |(_, t)| t as i64);
//! let src = RefSinCos::Theta(10_000.0);
//! let y = reference::rope(x.view(), positions.view(), RopeStyle::Neox, Direction::Forward, &src);
//! assert_eq!(y.slice(s![.., 0, .., ..]), x.slice(s![.., 0, .., ..]));
//! ```

pub mod fused;
pub mod reference;
