//! What the test files share: the GPU or a printed skip.

use std::io::Write;

use candle_core::Device;

/// Device 0, or `None` after printing that `name` was skipped.
pub fn gpu_or_skip(name: &str) -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(dev) => Some(dev),
        Err(why) if std::env::var("ROPE_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("{name}: ROPE_REQUIRE_GPU=1 but no GPU: {why}")
        }
        Err(why) => {
            let _ = writeln!(std::io::stderr(), "SKIPPED (no GPU): {name}: {why}");
            None
        }
    }
}
