//! The f64 reference of RoPE and the runner that checks the GPU against it, shared by the
//! property tests (`rope-tests`), the demo and the benchmark.
//!
//! - [`reference`]: RoPE written directly from its definition with ndarray, in f64.
//! - [`case`]: one random RoPE problem ([`case::Case`]), uploaded, launched and compared with
//!   the reference, and [`with_elem!`], which turns a case's [`case::DTypeCase`] into its
//!   element type.
//! - [`rotate`]: an f32 rotation at explicit positions in one call.

pub mod case;
pub mod reference;
pub mod rotate;

/// What [`with_elem!`] names from the caller's crate, whose dependencies may not include `half`.
#[doc(hidden)]
pub mod __private {
    pub use rope_host::half::{bf16, f16};
}
