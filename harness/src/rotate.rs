//! One out-of-place f32 rotation (at explicit positions, or as any op says), from host data
//! to host data.

use std::sync::Arc;

use rope_host::cudarc::driver::CudaStream;
use rope_host::{
    DeviceInts, IdsShape, Io, Layout, Positions, Rope, RopeConfig, RopeOp, RopeStyle, SinCos,
    Tensor, TensorMut,
};

/// Rotates `x`, a `[seq, heads, d]` f32 tensor, out of place at the explicit `ids` (one per
/// token) with `sincos`, forward, and returns the output: the one-call form the accuracy test
/// and the demo's accuracy table share.
///
/// # Errors
/// Any error of the upload, the launch or the download.
pub fn rotate_f32_at(
    rope: &Rope,
    stream: &Arc<CudaStream>,
    style: RopeStyle,
    x: &[f32],
    (seq, heads, d): (usize, usize, usize),
    ids: &[i64],
    sincos: SinCos<'_, f32>,
) -> anyhow::Result<Vec<f32>> {
    let ids = stream.clone_htod(ids)?;
    let op = RopeOp {
        config: RopeConfig::builder(d as u32, style).build()?,
        positions: Positions::Ids {
            ids: DeviceInts::I64(ids.as_view()),
            shape: IdsShape::Shared,
        },
        sincos,
    };
    rotate_f32(rope, stream, &op, x, (seq, heads, d))
}

/// Rotates `x`, a `[seq, heads, d]` f32 tensor, out of place as `op` says, and returns the
/// output.
///
/// # Errors
/// Any error of the upload, the launch or the download.
pub fn rotate_f32(
    rope: &Rope,
    stream: &Arc<CudaStream>,
    op: &RopeOp<'_, f32>,
    x: &[f32],
    (seq, heads, d): (usize, usize, usize),
) -> anyhow::Result<Vec<f32>> {
    let input = stream.clone_htod(x)?;
    let mut out = stream.alloc_zeros::<f32>(x.len())?;
    let layout = Layout::shd(seq, heads, d);
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
    rope.run(op, io)?;
    Ok(stream.clone_dtoh(&out)?)
}
