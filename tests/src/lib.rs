//! Test support for rope-rs: the f64 ndarray reference ([`reference`]), random problems run on
//! the GPU and the reference alike ([`case`]), proptest strategies ([`strategies`]) and GPU
//! access that reports skips ([`gpu`]) and event timing for the demo and the benchmark
//! ([`timing`]). The tests themselves are in `tests/`.

pub mod case;
pub mod gpu;
pub mod reference;
pub mod strategies;
pub mod timing;
