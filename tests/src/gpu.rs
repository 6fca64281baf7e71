//! Access to the GPU for tests: one shared stream, or a printed skip.
//!
//! Without a GPU (no driver, or no device) a GPU test prints `SKIPPED (no GPU)` with the reason
//! and returns; with `ROPE_REQUIRE_GPU=1` (set by the GPU bundle's runner) it fails instead, so
//! GPU tests can never pass without running on a GPU.

use std::io::Write;
use std::sync::{Arc, OnceLock};

use rope_host::cudarc::driver::CudaStream;
use rope_host::{Rope, open_device};

/// A stream on device 0 and a RoPE handle on it.
type Device = (Arc<CudaStream>, Arc<Rope>);

/// The shared stream and RoPE handle, or why there is none.
fn device() -> &'static Result<Device, String> {
    static DEVICE: OnceLock<Result<Device, String>> = OnceLock::new();
    DEVICE.get_or_init(|| {
        let ctx = open_device(0).map_err(|e| e.to_string())?;
        let stream = ctx.new_stream().map_err(|e| e.to_string())?;
        let rope = Rope::new(stream.clone()).map_err(|e| e.to_string())?;
        Ok((stream, Arc::new(rope)))
    })
}

/// Whether the environment demands a GPU (`ROPE_REQUIRE_GPU=1`).
pub fn gpu_required() -> bool {
    std::env::var("ROPE_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The GPU stream and RoPE handle for test `name`, or `None` after printing that the test was
/// skipped.
///
/// # Panics
/// When no GPU is available and [`gpu_required`].
pub fn gpu_or_skip(name: &str) -> Option<Device> {
    match device() {
        Ok((stream, rope)) => Some((stream.clone(), rope.clone())),
        Err(why) if gpu_required() => panic!("{name}: ROPE_REQUIRE_GPU=1 but no GPU: {why}"),
        Err(why) => {
            // Written past libtest's capture, so the skip shows in every run's output.
            let _ = writeln!(std::io::stderr(), "SKIPPED (no GPU): {name}: {why}");
            None
        }
    }
}

/// Rotates `x`, a `[seq, heads, d]` f32 tensor, out of place at the explicit `ids` (one per
/// token) with `sincos`, forward, and returns the output: the one-call form the accuracy test
/// and the demo's accuracy table share.
///
/// # Errors
/// Any error of the upload, the launch or the download.
pub fn rotate_f32_at(
    rope: &Rope,
    stream: &Arc<CudaStream>,
    style: rope_host::RopeStyle,
    x: &[f32],
    (seq, heads, d): (usize, usize, usize),
    ids: &[i64],
    sincos: rope_host::SinCos<'_, f32>,
) -> anyhow::Result<Vec<f32>> {
    use rope_host::{
        IdsShape, Io, Layout, PositionIds, Positions, RopeConfig, RopeOp, Tensor, TensorMut,
    };
    let input = stream.clone_htod(x)?;
    let mut out = stream.alloc_zeros::<f32>(x.len())?;
    let ids = stream.clone_htod(ids)?;
    let layout = Layout::shd(seq, heads, d);
    let op = RopeOp {
        config: RopeConfig::builder(d as u32, style).build()?,
        positions: Positions::Ids {
            ids: PositionIds::I64(ids.as_view()),
            shape: IdsShape::Shared,
        },
        sincos,
    };
    let io = Io::OutOfPlace {
        input: Tensor {
            data: input.as_view(),
            layout,
        },
        output: TensorMut {
            data: out.as_view_mut(),
            layout,
        },
    };
    rope.run(&op, io)?;
    Ok(stream.clone_dtoh(&out)?)
}
