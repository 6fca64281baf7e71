//! Test support for rope-rs: proptest strategies ([`strategies`]) and GPU access that reports
//! skips ([`gpu`]). The f64 reference and the case runner the tests check the kernels with are
//! in `rope-reference`; the tests themselves are in `tests/`. The repository README's examples and
//! the guide's (`docs/guide/`) are this crate's doctests.

pub mod gpu;
pub mod strategies;

/// The repository README's examples compile as doctests. They live here rather than in
/// `rope-host`, which may include only files inside its own folder: a published crate's package
/// holds nothing else, so its doctests could not find `../../README.md`.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;

/// The guide's chapters (`docs/guide/`) compile as doctests too, one item each.
#[cfg(doctest)]
mod guide {
    #[doc = include_str!("../../docs/guide/api.md")]
    struct Api;
    #[doc = include_str!("../../docs/guide/positions.md")]
    struct Positions;
    #[doc = include_str!("../../docs/guide/serving.md")]
    struct Serving;
    #[doc = include_str!("../../docs/guide/fused.md")]
    struct Fused;
    #[doc = include_str!("../../docs/guide/python.md")]
    struct Python;
    #[doc = include_str!("../../docs/guide/candle.md")]
    struct Candle;
    #[doc = include_str!("../../docs/guide/scaling.md")]
    struct Scaling;
    #[doc = include_str!("../../docs/guide/accuracy.md")]
    struct Accuracy;
    #[doc = include_str!("../../docs/guide/benchmarks.md")]
    struct Benchmarks;
    #[doc = include_str!("../../docs/guide/development.md")]
    struct Development;
}
