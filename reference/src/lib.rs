//! The f64 reference of RoPE and the runner that checks the GPU against it, shared by the
//! property tests (`rope-tests`), the demo and the benchmark.
//!
//! - [`reference`]: RoPE written directly from its definition with ndarray, in f64.
//! - [`case`]: one random RoPE problem ([`case::Case`]), uploaded, launched and compared with
//!   the reference.
//! - [`rotate`]: an f32 rotation at explicit positions in one call.

pub mod case;
pub mod reference;
pub mod rotate;
