//! Test support for rope-rs: proptest strategies ([`strategies`]) and GPU access that reports
//! skips ([`gpu`]). The f64 reference and the case runner the tests check the kernels with are
//! in `rope-reference`; the tests themselves are in `tests/`. The repository README's examples are
//! this crate's doctests.

pub mod gpu;
pub mod strategies;

/// The repository README's examples compile as doctests. They live here rather than in
/// `rope-host`, which may include only files inside its own folder: a published crate's package
/// holds nothing else, so its doctests could not find `../../README.md`.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
