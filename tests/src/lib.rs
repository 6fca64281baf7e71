//! Test support for rope-rs: proptest strategies ([`strategies`]) and GPU access that reports
//! skips ([`gpu`]). The f64 reference and the case runner the tests check the kernels with are
//! in `rope-reference`; the tests themselves are in `tests/`.

pub mod gpu;
pub mod strategies;
