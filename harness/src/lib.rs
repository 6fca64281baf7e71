//! The GPU harness that the property tests (`rope-tests`), the demo and the benchmark share:
//! one random RoPE problem uploaded, launched and compared with the f64 reference of
//! `rope-reference`.
//!
//! - [`case`]: one random RoPE problem ([`case::Case`]), uploaded, launched and compared with
//!   the reference, and [`with_elem!`], which turns a case's [`case::DTypeCase`] into its
//!   element type.
//! - [`fused`]: one random fused case (norm, rotation, KV-cache write, FP8) uploaded, launched
//!   and compared with the reference, byte for byte.
//! - [`elem`]: the storage types under test ([`elem::TestElem`], also named from [`case`]).
//! - [`rotate`]: an f32 rotation at explicit positions in one call.
//! - [`tolerance`]: the one rule for how close an output must be to the reference, for the
//!   plain and the fused kernels and the built tables.

pub mod case;
pub mod elem;
pub mod fused;
pub mod rotate;
pub mod tolerance;

/// What [`with_elem!`] names from the caller's crate, whose dependencies may not include `half`.
#[doc(hidden)]
pub mod __private {
    pub use rope_host::half::{bf16, f16};
}
