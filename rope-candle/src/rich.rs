//! What candle_nn's functions cannot express: device position ids, multi-axis positions
//! (mRoPE, N-D axial), in-kernel sin/cos with the scaling families, partial rotary, both
//! layouts, and q and k in one call.

use std::sync::Arc;

use candle_core::{Device, Result, Tensor};
use rope_host::{AxisMap, DeviceAxisMap, Direction, Frequencies, FrequencySpec, RopeStyle};

use crate::error::invalid;
use crate::layout::Axes;
use crate::op::{Pos, RopeCandleOp, Source};

/// Where sin/cos come from.
#[derive(Clone, Debug)]
pub enum SinCos {
    /// Tables `[rows, rotary_dim / 2]` (or `[batch, rows, rotary_dim / 2]`) of `xs`'s dtype
    /// or f32; positions read rows (offset positions only).
    Tables {
        /// The cosines.
        cos: Tensor,
        /// The sines.
        sin: Tensor,
    },
    /// Computed in the kernel: `inv_freq_i = theta^(-2i/r)` in f64, cos/sin within one f32 ulp.
    Computed {
        /// The frequency base (`rope_theta`).
        theta: f64,
    },
    /// Computed in the kernel from frequencies of any scaling family ([`frequencies`]).
    Frequencies(Arc<Frequencies>),
}

/// Positions of the tokens.
#[derive(Clone, Copy, Debug)]
pub enum Positions<'a> {
    /// `p = offset + s` (prefill from `offset`).
    Offset(u32),
    /// Device ids (i32 or i64 on the tensors' device): `[seq]`, shared by the batch rows, or
    /// `[batch, seq]`. They survive CUDA-graph replay: write new ids into the same tensor.
    Ids(&'a Tensor),
    /// Multi-axis positions (Qwen2-VL's mRoPE, Qwen3-VL's interleaved mRoPE, FLUX's N-D axial
    /// RoPE): `positions` (i32 or i64, contiguous) holds `[n_axes, batch, seq]` or
    /// `[n_axes, batch * seq]` integers, row `a` axis `a`'s position of each token
    /// (transformers' `position_ids [3, batch, seq]` as it is), and pair `j` of the rotated
    /// features rotates by the position of axis `axes[j]` (an [`AxisMap`] uploaded by
    /// [`axis_map`]: `AxisMap::mrope`, `mrope_interleaved` or `axial`).
    MultiAxis {
        /// `[n_axes, batch, seq]` or `[n_axes, batch * seq]` positions.
        positions: &'a Tensor,
        /// Which axis each rotated pair takes its position from.
        axes: &'a Arc<DeviceAxisMap>,
    },
}

impl<'a> Positions<'a> {
    /// The device tensor the launch reads positions from, if any.
    pub(crate) fn tensor(self) -> Option<&'a Tensor> {
        match self {
            Positions::Offset(_) => None,
            Positions::Ids(t) | Positions::MultiAxis { positions: t, .. } => Some(t),
        }
    }
}

/// A RoPE application: style, layout, rotated width and sin/cos.
#[derive(Clone, Debug)]
pub struct RopeSpec {
    /// Pairing: rotate-half (NeoX, Llama) or interleaved (GPT-J).
    pub style: RopeStyle,
    /// Which axes of the 4-D tensors are batch, seq, heads and head features.
    pub axes: Axes,
    /// Rotated features (partial rotary); `None` rotates the whole head.
    pub rotary_dim: Option<u32>,
    /// Where sin/cos come from.
    pub sincos: SinCos,
}

/// Frequencies of `spec` (any scaling family: linear, dynamic NTK, YaRN, Llama 3, LongRoPE)
/// uploaded once to `device`, for [`SinCos::Frequencies`].
///
/// # Errors
/// A wrapped [`crate::Error`] when `device` is not CUDA or `spec` is invalid.
pub fn frequencies(device: &Device, spec: &FrequencySpec) -> Result<Arc<Frequencies>> {
    let Device::Cuda(dev) = device else {
        return Err(invalid("device", "frequencies live on a CUDA device").into());
    };
    let rope = rope_host::Rope::new(dev.cuda_stream()).map_err(crate::Error::from)?;
    Ok(Arc::new(
        rope.frequencies(spec).map_err(crate::Error::from)?,
    ))
}

/// `map` uploaded once to `device`, for [`Positions::MultiAxis`].
///
/// ```no_run
/// # fn main() -> candle_core::Result<()> {
/// use rope_candle::AxisMap;
/// let dev = candle_core::Device::new_cuda(0)?;
/// // Qwen2.5-VL-7B: head_dim 128, mrope_section [16, 24, 24].
/// let map = AxisMap::mrope([16, 24, 24], 128).map_err(rope_candle::Error::from)?;
/// let axes = rope_candle::axis_map(&dev, &map)?;
/// # Ok(())
/// # }
/// ```
///
/// # Errors
/// A wrapped [`crate::Error`] when `device` is not CUDA or the upload fails.
pub fn axis_map(device: &Device, map: &AxisMap) -> Result<Arc<DeviceAxisMap>> {
    let Device::Cuda(dev) = device else {
        return Err(invalid("device", "axis maps live on a CUDA device").into());
    };
    let rope = rope_host::Rope::new(dev.cuda_stream()).map_err(crate::Error::from)?;
    Ok(Arc::new(rope.axis_map(map).map_err(crate::Error::from)?))
}

/// The op for `spec` at `positions`, and the tables it takes (contiguous).
fn op_for(
    spec: &RopeSpec,
    positions: Positions<'_>,
) -> Result<(RopeCandleOp, Option<(Tensor, Tensor)>)> {
    let (source, tables) = match &spec.sincos {
        SinCos::Tables { cos, sin } => {
            (Source::Tables, Some((cos.contiguous()?, sin.contiguous()?)))
        }
        SinCos::Computed { theta } => (Source::Computed { theta: *theta }, None),
        SinCos::Frequencies(f) => (Source::Frequencies(f.clone()), None),
    };
    let pos = match positions {
        Positions::Offset(o) => Pos::Offset(o),
        Positions::Ids(_) => Pos::Ids,
        Positions::MultiAxis { axes, .. } => Pos::MultiAxis(axes.clone()),
    };
    if tables.is_some() && !matches!(positions, Positions::Offset(0)) {
        return Err(invalid(
            "positions",
            "tables go with Offset(0); select rows first (cos.index_select) or use computed sin/cos",
        )
        .into());
    }
    let op = RopeCandleOp {
        style: spec.style,
        axes: spec.axes,
        rotary_dim: spec.rotary_dim,
        direction: Direction::Forward,
        source,
        pos,
    };
    Ok((op, tables))
}

/// The error for a tensor not on a CUDA device.
fn needs_cuda(function: &str) -> candle_core::Error {
    invalid(
        "xs",
        format!(
            "rope_candle::{function} runs on CUDA; on the CPU use rope_candle::rope (candle_nn's path)"
        ),
    )
    .into()
}

/// `xs` rotated by `spec` at `positions`, as a new tensor; gradients flow to `xs` through
/// backprop. CUDA only.
///
/// # Errors
/// A wrapped [`crate::Error`] naming the argument (`xs`, `cos`, `ids`, `positions`,
/// `rotary_dim`, ...) when the description is invalid or `xs` is not on a CUDA device.
pub fn apply(xs: &Tensor, spec: &RopeSpec, positions: Positions<'_>) -> Result<Tensor> {
    if !xs.device().is_cuda() {
        return Err(needs_cuda("apply"));
    }
    let (op, tables) = op_for(spec, positions)?;
    match (tables, positions.tensor()) {
        (Some((cos, sin)), _) => xs.apply_op3(&cos, &sin, op),
        (None, None) => xs.apply_op1(op),
        (None, Some(ids)) => xs.apply_op2(ids, op),
    }
}

/// `xs` rotated by `spec` at `positions` where it is: any strided view without repeated
/// elements (for example `q` narrowed out of a fused QKV tensor) is rotated inside its
/// storage, the rest of the storage untouched. Like candle's other in-place ops it records no
/// gradient: use [`apply`] for training. CUDA only.
///
/// # Errors
/// As [`apply`]; also candle's error when a source tensor shares `xs`'s storage.
pub fn apply_inplace(xs: &Tensor, spec: &RopeSpec, positions: Positions<'_>) -> Result<()> {
    if !xs.device().is_cuda() {
        return Err(needs_cuda("apply_inplace"));
    }
    let (op, tables) = op_for(spec, positions)?;
    match (tables, positions.tensor()) {
        (Some((cos, sin)), _) => xs.inplace_op3(&cos, &sin, &op),
        (None, None) => xs.inplace_op1(&op),
        (None, Some(ids)) => xs.inplace_op2(ids, &op),
    }
}

/// q and k rotated by the same `spec` and `positions` in one call (two launches sharing the
/// handle and the uploaded frequencies; q and k may have different head counts).
///
/// # Errors
/// As [`apply`], for either tensor.
pub fn apply_qk(
    q: &Tensor,
    k: &Tensor,
    spec: &RopeSpec,
    positions: Positions<'_>,
) -> Result<(Tensor, Tensor)> {
    Ok((apply(q, spec, positions)?, apply(k, spec, positions)?))
}

/// q and k rotated in place by the same `spec` and `positions` (see [`apply_inplace`]).
///
/// # Errors
/// As [`apply_inplace`], for either tensor.
pub fn apply_qk_inplace(
    q: &Tensor,
    k: &Tensor,
    spec: &RopeSpec,
    positions: Positions<'_>,
) -> Result<()> {
    apply_inplace(q, spec, positions)?;
    apply_inplace(k, spec, positions)
}
