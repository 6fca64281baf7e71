//! `norm_rope` (QK-norm + RoPE with a fused backward) against the same step written with
//! candle's own differentiable ops (the norm and the rotation at gathered table rows), in f32, forward and gradients through `candle_core::backprop`. GPU tests print
//! `SKIPPED (no GPU)` without a CUDA device, and fail instead with `ROPE_REQUIRE_GPU=1`.

use candle_core::{DType, Device, Tensor, Var};
use rope_candle::{Axes, NormRopeSpec, NormWeight, Positions, RopeStyle, SinCos, norm_rope};

mod common;
use common::gpu_or_skip;

type Res = candle_core::Result<()>;

/// The step with candle's ops: `x [b, s, h, d]` normalised per head by `w` (`1 + w` when
/// `one_plus`), rotated by `cos`, `sin` rows `[b * s, d / 2]` (one per token).
fn reference(
    x: &Tensor,
    w: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    (style, one_plus, eps): (RopeStyle, bool, f64),
) -> candle_core::Result<Tensor> {
    let (b, s, h, d) = x.dims4()?;
    let mean = x.sqr()?.mean_keepdim(3)?;
    let r = (mean + eps)?.sqrt()?.recip()?;
    let w = if one_plus { (w + 1.0)? } else { w.clone() };
    let n = x.broadcast_mul(&r)?.broadcast_mul(&w)?;
    // The rotation with candle's differentiable ops (candle_nn's rotary kernels record no
    // gradient): cos and sin of each token broadcast over its heads.
    let half = d / 2;
    let (cos, sin) = (cos.reshape((b, s, 1, half))?, sin.reshape((b, s, 1, half))?);
    let (a, bb) = match style {
        RopeStyle::Neox => (n.narrow(3, 0, half)?, n.narrow(3, half, half)?),
        RopeStyle::Interleaved => {
            let pairs = n.reshape((b, s, h, half, 2))?;
            (
                pairs.narrow(4, 0, 1)?.squeeze(4)?,
                pairs.narrow(4, 1, 1)?.squeeze(4)?,
            )
        }
    };
    let first = (a.broadcast_mul(&cos)? - bb.broadcast_mul(&sin)?)?;
    let second = (bb.broadcast_mul(&cos)? + a.broadcast_mul(&sin)?)?;
    match style {
        RopeStyle::Neox => Tensor::cat(&[first, second], 3),
        RopeStyle::Interleaved => Tensor::stack(&[first, second], 4)?.reshape((b, s, h, d)),
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> candle_core::Result<f32> {
    (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

fn max_abs(a: &Tensor) -> candle_core::Result<f32> {
    a.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

#[test]
fn norm_rope_forward_and_gradients_match_candles_ops() -> Res {
    let Some(dev) = gpu_or_skip("norm_rope_forward_and_gradients_match_candles_ops") else {
        return Ok(());
    };
    let (b, s, h, eps) = (2, 33, 4, 1e-6);
    // Heads of 512 (Gemma 4's global layers): a norm summed across warps.
    for (d, style, one_plus) in [
        (64, RopeStyle::Neox, false),
        (64, RopeStyle::Interleaved, true),
        (64, RopeStyle::Neox, true),
        (512, RopeStyle::Neox, true),
        (512, RopeStyle::Interleaved, false),
    ] {
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, s, h, d), &dev)?)?;
        let w0 = (Tensor::randn(0f32, 0.3, d, &dev)? + if one_plus { 0.0 } else { 1.0 })?;
        let w = Var::from_tensor(&w0)?;
        let ids = Tensor::from_vec(
            (0..(b * s) as i64)
                .map(|t| (t * 37) % 500)
                .collect::<Vec<_>>(),
            (b, s),
            &dev,
        )?;
        let angles = Tensor::arange(0f32, 512.0, &dev)?
            .reshape((512, 1))?
            .broadcast_mul(
                &(Tensor::arange_step(0f32, d as f32, 2.0, &dev)?
                    * (-(10_000f64.ln()) / d as f64))?
                    .exp()?
                    .reshape((1, d / 2))?,
            )?;
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        let spec = NormRopeSpec {
            style,
            axes: Axes::Bshd,
            sincos: SinCos::Tables {
                cos: cos.clone(),
                sin: sin.clone(),
            },
            eps: eps as f32,
            weight: if one_plus {
                NormWeight::OnePlus
            } else {
                NormWeight::Plain
            },
        };
        let y = norm_rope(x.as_tensor(), w.as_tensor(), &spec, Positions::Ids(&ids))?;
        let flat = ids.flatten_all()?;
        let rows = (cos.index_select(&flat, 0)?, sin.index_select(&flat, 0)?);
        let want = reference(
            x.as_tensor(),
            w.as_tensor(),
            (&rows.0, &rows.1),
            (style, one_plus, eps),
        )?;
        let err = max_diff(&y, &want)?;
        assert!(
            err < 2e-5 * max_abs(&want)?.max(1.0),
            "{style:?} d {d}: forward off by {err}"
        );

        let gy = Tensor::randn(0f32, 1.0, (b, s, h, d), &dev)?;
        let grads = (y * &gy)?.sum_all()?.backward()?;
        let want_grads = (want * &gy)?.sum_all()?.backward()?;
        for (name, v) in [("xs", &x), ("weight", &w)] {
            let got = grads.get(v).expect("a gradient");
            let want = want_grads.get(v).expect("a gradient");
            let err = max_diff(got, want)?;
            let scale = max_abs(want)?.max(1.0);
            assert!(
                err < 1e-4 * scale,
                "{style:?} d {d} {name}: gradient off by {err} (scale {scale})"
            );
        }
    }
    Ok(())
}

/// NeoX pairs of `[b, s, h, d]` tensors, sin/cos computed at theta 10000, plain weights.
fn computed_spec() -> NormRopeSpec {
    NormRopeSpec {
        style: RopeStyle::Neox,
        axes: Axes::Bshd,
        sincos: SinCos::Computed { theta: 10_000.0 },
        eps: 1e-6,
        weight: NormWeight::Plain,
    }
}

#[test]
fn norm_rope_refuses_a_weight_of_another_length() -> Res {
    let Some(dev) = gpu_or_skip("norm_rope_refuses_a_weight_of_another_length") else {
        return Ok(());
    };
    let x = Tensor::zeros((1, 4, 2, 64), DType::F32, &dev)?;
    let w = Tensor::ones(32, DType::F32, &dev)?;
    let spec = computed_spec();
    let err = norm_rope(&x, &w, &spec, Positions::Offset(0)).unwrap_err();
    assert!(err.to_string().contains("norm.q_weight"), "{err}");
    Ok(())
}

#[test]
fn norm_rope_on_the_cpu_is_refused_not_a_panic() {
    let x = Tensor::zeros((1, 4, 2, 64), DType::F32, &Device::Cpu).expect("cpu tensor");
    let w = Tensor::ones(64, DType::F32, &Device::Cpu).expect("cpu tensor");
    let spec = computed_spec();
    let err = norm_rope(&x, &w, &spec, Positions::Offset(0)).unwrap_err();
    assert!(err.to_string().contains("CUDA"), "{err}");
}
