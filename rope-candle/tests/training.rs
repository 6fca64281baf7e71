//! `norm_rope` (QK-norm + RoPE with a fused backward) against the same step written with
//! candle's own differentiable ops (the norm and the rotation at gathered table rows), in f32, forward and gradients through `candle_core::backprop`. GPU tests print
//! `SKIPPED (no GPU)` without a CUDA device, and fail instead with `ROPE_REQUIRE_GPU=1`.

use candle_core::{DType, Device, Tensor, Var};
use rope_candle::{
    Axes, AxisMap, NormRopeSpec, NormWeight, Positions, RopeStyle, SinCos, axis_map, norm_rope,
};

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

/// Asserts `y` (the op's output) matches `want` (the same step with candle's ops) within 2e-5
/// of its largest element, and that the gradients of `x` and `w` under a random upstream
/// gradient match within 1e-4 of theirs; `what` names the case in failures.
fn assert_step_matches(y: Tensor, want: Tensor, (x, w): (&Var, &Var), what: &str) -> Res {
    let err = max_diff(&y, &want)?;
    assert!(
        err < 2e-5 * max_abs(&want)?.max(1.0),
        "{what}: forward off by {err}"
    );
    let gy = Tensor::randn(0f32, 1.0, y.shape(), y.device())?;
    let grads = (y * &gy)?.sum_all()?.backward()?;
    let want_grads = (want * &gy)?.sum_all()?.backward()?;
    for (name, v) in [("xs", x), ("weight", w)] {
        let got = grads.get(v).expect("a gradient");
        let want = want_grads.get(v).expect("a gradient");
        let err = max_diff(got, want)?;
        let scale = max_abs(want)?.max(1.0);
        assert!(
            err < 1e-4 * scale,
            "{what} {name}: gradient off by {err} (scale {scale})"
        );
    }
    Ok(())
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
        assert_step_matches(y, want, (&x, &w), &format!("{style:?} d {d}"))?;
    }
    Ok(())
}

/// Qwen3-VL's pairing of a QK norm with interleaved mRoPE: `norm_rope` at multi-axis positions
/// `[3, b, s]` against the step with candle's ops at per-token rows built in f64 (each pair at
/// its axis's position), forward and gradients.
#[test]
fn norm_rope_at_multi_axis_positions_matches_candles_ops() -> Res {
    let Some(dev) = gpu_or_skip("norm_rope_at_multi_axis_positions_matches_candles_ops") else {
        return Ok(());
    };
    let (b, s, h, d, eps, theta) = (2, 17, 3, 64, 1e-6, 10_000f64);
    let tokens = b * s;
    let pos: Vec<i64> = (0..3 * tokens)
        .map(|i| {
            let (axis, tok) = (i / tokens, i % tokens);
            let base = (tok * 29 % 400) as i64;
            if tok % 2 == 1 {
                base + axis as i64 * 7
            } else {
                base
            }
        })
        .collect();
    let pos_t = Tensor::from_vec(pos.clone(), (3, b, s), &dev)?;
    for (map, style) in [
        (
            AxisMap::mrope_interleaved([8, 12, 12], d as u32),
            RopeStyle::Neox,
        ),
        (
            AxisMap::mrope([8, 12, 12], d as u32),
            RopeStyle::Interleaved,
        ),
    ] {
        let map = map.map_err(rope_candle::Error::from)?;
        let axes = axis_map(&dev, &map)?;
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for tok in 0..tokens {
            for (i, &axis) in map.axes().iter().enumerate() {
                let a = pos[axis as usize * tokens + tok] as f64
                    * theta.powf(-2.0 * i as f64 / d as f64);
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        let rows = (
            Tensor::from_vec(cos, (tokens, d / 2), &dev)?,
            Tensor::from_vec(sin, (tokens, d / 2), &dev)?,
        );
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (b, s, h, d), &dev)?)?;
        let w = Var::from_tensor(&(Tensor::randn(0f32, 0.3, d, &dev)? + 1.0)?)?;
        let spec = NormRopeSpec {
            style,
            axes: Axes::Bshd,
            sincos: SinCos::Computed { theta },
            eps: eps as f32,
            weight: NormWeight::Plain,
        };
        let positions = Positions::MultiAxis {
            positions: &pos_t,
            axes: &axes,
        };
        let y = norm_rope(x.as_tensor(), w.as_tensor(), &spec, positions)?;
        let want = reference(
            x.as_tensor(),
            w.as_tensor(),
            (&rows.0, &rows.1),
            (style, false, eps),
        )?;
        assert_step_matches(y, want, (&x, &w), &format!("{style:?}"))?;
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
