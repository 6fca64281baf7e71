//! `rope`, `rope_i` and `rope_thd` with `candle_nn::rotary_emb`'s signatures and tables.

use candle_core::{Result, Tensor};
use rope_host::{Direction, RopeStyle};

use crate::error::invalid;
use crate::layout::Axes;
use crate::op::{Pos, RopeCandleOp, Source};

/// Rotate-half RoPE (GPT-NeoX, Llama) of `xs` `[batch, heads, seq, head_dim]` with tables
/// `cos`, `sin` of `[rows, head_dim / 2]` or `[batch, rows, head_dim / 2]` (`rows >= seq`,
/// position `s` reads row `s`), as `candle_nn::rotary_emb::rope`.
///
/// Unlike candle's, `xs` may be any strided view with contiguous head features, and gradients
/// flow through backprop (the backward rotation; none for `cos` and `sin`). On CUDA, one
/// rope-rs launch on candle's stream; on other devices, candle_nn's own implementation (its
/// differentiable `rope_slow` for 2-D tables, its fused `rope`, without gradients, for batched
/// ones).
///
/// # Errors
/// A wrapped [`crate::Error`] naming the argument when the shapes or dtypes disagree (tables of
/// `xs`'s dtype or f32) or the heads are not contiguous; candle's errors otherwise.
pub fn rope(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    with_tables(xs, cos, sin, RopeStyle::Neox, Axes::Bhsd)
}

/// Interleaved RoPE (GPT-J, RoFormer): pairs `(x[2i], x[2i + 1])`; otherwise as [`rope`]
/// (`candle_nn::rotary_emb::rope_i`).
///
/// # Errors
/// As [`rope`].
pub fn rope_i(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    with_tables(xs, cos, sin, RopeStyle::Interleaved, Axes::Bhsd)
}

/// Rotate-half RoPE of `xs` `[batch, seq, heads, head_dim]`; otherwise as [`rope`]
/// (`candle_nn::rotary_emb::rope_thd`).
///
/// # Errors
/// As [`rope`].
pub fn rope_thd(xs: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    with_tables(xs, cos, sin, RopeStyle::Neox, Axes::Bshd)
}

fn with_tables(
    xs: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    style: RopeStyle,
    axes: Axes,
) -> Result<Tensor> {
    let [_, seq, _, head_dim] = axes.bshd("xs", xs.dims())?;
    let rows = match cos.dims() {
        [t, _] | [_, t, _] => *t,
        d => return Err(invalid("cos", format!("expected 2 or 3 dimensions, got {d:?}")).into()),
    };
    if rows < seq {
        return Err(invalid("cos", format!("{rows} rows for {seq} positions")).into());
    }
    if !xs.device().is_cuda() {
        return cpu_fallback(xs, cos, sin, style, axes);
    }
    let op = RopeCandleOp {
        style,
        axes,
        rotary_dim: Some(u32::try_from(head_dim).map_err(|_| invalid("xs", "head_dim too large"))?),
        direction: Direction::Forward,
        source: Source::Tables,
        pos: Pos::Offset(0),
    };
    xs.apply_op3(&cos.contiguous()?, &sin.contiguous()?, op)
}

/// candle_nn's implementation, for tensors not on a CUDA device.
fn cpu_fallback(
    xs: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    style: RopeStyle,
    axes: Axes,
) -> Result<Tensor> {
    use candle_nn::rotary_emb as nn;
    let batched = cos.rank() == 3;
    let bhsd = match axes {
        Axes::Bhsd => xs.contiguous()?,
        Axes::Bshd => xs.transpose(1, 2)?.contiguous()?,
    };
    let out = match (style, batched) {
        (RopeStyle::Neox, false) => nn::rope_slow(&bhsd, cos, sin)?,
        (RopeStyle::Interleaved, false) => nn::rope_i_slow(&bhsd, cos, sin)?,
        (RopeStyle::Neox, true) => nn::rope(&bhsd, &cos.contiguous()?, &sin.contiguous()?)?,
        (RopeStyle::Interleaved, true) => {
            nn::rope_i(&bhsd, &cos.contiguous()?, &sin.contiguous()?)?
        }
    };
    match axes {
        Axes::Bhsd => Ok(out),
        Axes::Bshd => out.transpose(1, 2)?.contiguous(),
    }
}
