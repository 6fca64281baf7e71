//! The f64 reference of RoPE and the runner that checks the GPU against it, shared by the
//! property tests (`rope-tests`), the demo and the benchmark.
//!
//! - [`reference`](mod@reference): RoPE written directly from its definition with ndarray, in f64.
//! - [`case`]: one random RoPE problem ([`case::Case`]), uploaded, launched and compared with
//!   the reference, and [`with_elem!`], which turns a case's [`case::DTypeCase`] into its
//!   element type.
//! - [`rotate`]: an f32 rotation at explicit positions in one call.
//! - [`fused`](mod@fused): the normalisation, one head's rotation and FP8 bounds of the fused
//!   kernels.
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

pub mod case;
pub mod fused;
pub mod reference;
pub mod rotate;

/// What [`with_elem!`] names from the caller's crate, whose dependencies may not include `half`.
#[doc(hidden)]
pub mod __private {
    pub use rope_host::half::{bf16, f16};
}
