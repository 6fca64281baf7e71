//! rope-candle against candle's own functions, an f64 reference, backprop and finite
//! differences. GPU tests print `SKIPPED (no GPU)` without a CUDA device, and fail instead with
//! `ROPE_REQUIRE_GPU=1` (the GPU bundle's runner sets it). The binary itself needs the CUDA
//! libraries candle links (libcuda.so.1, cuBLAS, cuRAND, NVRTC) to start.

use std::io::Write;

use candle_core::{DType, Device, IndexOp, Tensor, Var};
use rope_candle::{Axes, Positions, RopeSpec, RopeStyle, SinCos};

mod common;
use common::gpu_or_skip;

type Res = candle_core::Result<()>;

/// Mantissa bits of `dtype`.
fn mantissa_bits(dtype: DType) -> i32 {
    match dtype {
        DType::F16 => 10,
        DType::BF16 => 7,
        _ => 23,
    }
}

/// One unit in the last place of `dtype` at `v`.
fn ulp(v: f64, dtype: DType) -> f64 {
    let min_exp = match dtype {
        DType::F16 => -14,
        DType::BF16 => -126,
        _ => -126,
    };
    let e = if v == 0.0 {
        min_exp
    } else {
        (v.abs().log2().floor() as i32).max(min_exp)
    };
    2f64.powi(e - mantissa_bits(dtype))
}

/// Values of `t` in row-major order, as f64.
fn values(t: &Tensor) -> candle_core::Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// Asserts `got` is within `ulps` of `want` element by element (the largest error reported).
fn assert_ulps(what: &str, got: &Tensor, want: &Tensor, ulps: f64) -> Res {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let dtype = want.dtype();
    let (g, w) = (values(got)?, values(want)?);
    let worst = g
        .iter()
        .zip(&w)
        .map(|(g, w)| (g - w).abs() / ulp(*w, dtype))
        .fold(0f64, f64::max);
    assert!(worst <= ulps, "{what}: {worst} ulps (allowed {ulps})");
    Ok(())
}

/// Asserts `got` (rope-candle) is within `ulps` of `want` (candle_nn's kernel) at the scale of
/// each output's two terms, `m = |x_j cos_i| + |x_k sin_i|` (`x_k` the pair partner): each
/// kernel's own rounding error is bounded by one ulp of `m` (candle's 16-bit kernels round both
/// products to the 16-bit type before the sum, rope-rs computes in f32 and rounds once), so
/// where the terms cancel the results can differ by many ulps of the small result but not of
/// `m`. `xs` is `[b, _, _, d]` with the sequence at `seq_axis` (1 or 2); tables are
/// `[t, d/2]` or `[b, t, d/2]`. Prints the largest difference.
#[allow(clippy::too_many_arguments)]
fn assert_pair_ulps(
    what: &str,
    got: &Tensor,
    want: &Tensor,
    (xs, cos, sin): (&Tensor, &Tensor, &Tensor),
    style: RopeStyle,
    seq_axis: usize,
    ulps: f64,
) -> Res {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let dtype = want.dtype();
    let dims = xs.dims4()?;
    let d = dims.3;
    let half = d / 2;
    let (g, w, x) = (values(got)?, values(want)?, values(xs)?);
    let (c, sn) = (values(cos)?, values(sin)?);
    let rows = cos.dims()[cos.rank() - 2];
    let batched = cos.rank() == 3;
    let mut worst = 0f64;
    for (n, ((g, w), xv)) in g.iter().zip(&w).zip(&x).enumerate() {
        let e = n % d;
        let outer = n / d;
        let (i2, i1, b) = (
            outer % dims.2,
            outer / dims.2 % dims.1,
            outer / (dims.2 * dims.1),
        );
        let t = if seq_axis == 2 { i2 } else { i1 };
        let (i, partner) = match style {
            RopeStyle::Neox => (e % half, if e < half { n + half } else { n - half }),
            _ => (e / 2, n ^ 1),
        };
        let row = if batched { b * rows + t } else { t };
        let (cv, sv) = (c[row * half + i], sn[row * half + i]);
        let m = (xv * cv).abs() + (x[partner] * sv).abs();
        worst = worst.max((g - w).abs() / ulp(m, dtype));
    }
    let _ = writeln!(
        std::io::stderr(),
        "{what}: largest difference {worst:.3} ulps of the terms' scale"
    );
    assert!(worst <= ulps, "{what}: {worst} ulps (allowed {ulps})");
    Ok(())
}

/// Asserts `got` is within `tol * (1 + |want|)` of `want`.
fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

/// cos and sin tables `[rows, r/2]` in f32 for `theta`.
fn tables(
    rows: usize,
    r: usize,
    theta: f64,
    dev: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let half = r / 2;
    let angle = |p: usize, i: usize| p as f64 * theta.powf(-2.0 * i as f64 / r as f64);
    let cos: Vec<f32> = (0..rows * half)
        .map(|k| angle(k / half, k % half).cos() as f32)
        .collect();
    let sin: Vec<f32> = (0..rows * half)
        .map(|k| angle(k / half, k % half).sin() as f32)
        .collect();
    Ok((
        Tensor::from_vec(cos, (rows, half), dev)?,
        Tensor::from_vec(sin, (rows, half), dev)?,
    ))
}

/// The f64 reference on a `[b, s, h, d]` tensor: position `pos(b, s)`, `cos/sin(p, i)`.
#[allow(clippy::too_many_arguments)]
fn reference(
    x: &[f64],
    [nb, ns, nh, d]: [usize; 4],
    r: usize,
    style: RopeStyle,
    backward: bool,
    pos: impl Fn(usize, usize) -> usize,
    cs: impl Fn(usize, usize) -> (f64, f64),
) -> Vec<f64> {
    let mut y = x.to_vec();
    let half = r / 2;
    for b in 0..nb {
        for s in 0..ns {
            for h in 0..nh {
                let base = ((b * ns + s) * nh + h) * d;
                for i in 0..half {
                    let (c, sn) = cs(pos(b, s), i);
                    let sn = if backward { -sn } else { sn };
                    let (j, k) = match style {
                        RopeStyle::Neox => (base + i, base + i + half),
                        _ => (base + 2 * i, base + 2 * i + 1),
                    };
                    y[j] = x[j] * c - x[k] * sn;
                    y[k] = x[k] * c + x[j] * sn;
                }
            }
        }
    }
    y
}

mod matches_candle {
    use super::*;

    /// candle_nn's own function and ours on the same contiguous inputs.
    fn case(dev: &Device, dtype: DType, style: RopeStyle, thd: bool) -> Res {
        let (b, h, t, d) = (2, 3, 17, 64);
        let shape = if thd { (b, t, h, d) } else { (b, h, t, d) };
        let xs = Tensor::randn(0f32, 1., shape, dev)?.to_dtype(dtype)?;
        let (cos, sin) = tables(t, d, 10_000.0, dev)?;
        let (cos, sin) = (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?);
        let (ours, theirs) = match (style, thd) {
            (RopeStyle::Neox, false) => (
                rope_candle::rope(&xs, &cos, &sin)?,
                candle_nn::rotary_emb::rope(&xs, &cos, &sin)?,
            ),
            (RopeStyle::Neox, true) => (
                rope_candle::rope_thd(&xs, &cos, &sin)?,
                candle_nn::rotary_emb::rope_thd(&xs, &cos, &sin)?,
            ),
            _ => (
                rope_candle::rope_i(&xs, &cos, &sin)?,
                candle_nn::rotary_emb::rope_i(&xs, &cos, &sin)?,
            ),
        };
        assert_pair_ulps(
            &format!("{dtype:?} {style:?} thd={thd}"),
            &ours,
            &theirs,
            (&xs, &cos, &sin),
            style,
            if thd { 1 } else { 2 },
            2.0,
        )
    }

    #[test]
    fn rope_rope_i_rope_thd_every_dtype() -> Res {
        let Some(dev) = gpu_or_skip("matches_candle::rope_rope_i_rope_thd_every_dtype") else {
            return Ok(());
        };
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            case(&dev, dtype, RopeStyle::Neox, false)?;
            case(&dev, dtype, RopeStyle::Interleaved, false)?;
            case(&dev, dtype, RopeStyle::Neox, true)?;
        }
        Ok(())
    }

    #[test]
    fn batched_tables() -> Res {
        let Some(dev) = gpu_or_skip("matches_candle::batched_tables") else {
            return Ok(());
        };
        let (b, h, t, d) = (3, 2, 9, 32);
        let xs = Tensor::randn(0f32, 1., (b, h, t, d), &dev)?;
        let cos = Tensor::randn(0f32, 1., (b, t, d / 2), &dev)?;
        let sin = Tensor::randn(0f32, 1., (b, t, d / 2), &dev)?;
        let ours = rope_candle::rope(&xs, &cos, &sin)?;
        let theirs = candle_nn::rotary_emb::rope(&xs, &cos, &sin)?;
        assert_pair_ulps(
            "batched tables",
            &ours,
            &theirs,
            (&xs, &cos, &sin),
            RopeStyle::Neox,
            2,
            2.0,
        )
    }
}

mod strided_matches_reference {
    use super::*;

    #[test]
    fn narrowed_and_transposed_views() -> Res {
        let Some(dev) = gpu_or_skip("strided_matches_reference::narrowed_and_transposed_views")
        else {
            return Ok(());
        };
        let (b, t, h, d, theta) = (2, 11, 5, 32, 10_000.0);
        // A fused projection [b, t, 2h, d]: the first h heads, seen as [b, h, t, d].
        let fused = Tensor::randn(0f32, 1., (b, t, 2 * h, d), &dev)?;
        let view = fused.narrow(2, 0, h)?.transpose(1, 2)?;
        assert!(!view.is_contiguous());
        let (cos, sin) = tables(t + 4, d, theta, &dev)?;
        for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
            let out = match style {
                RopeStyle::Neox => rope_candle::rope(&view, &cos, &sin)?,
                _ => rope_candle::rope_i(&view, &cos, &sin)?,
            };
            let x = values(&view.transpose(1, 2)?.contiguous()?)?;
            let (c, s) = (values(&cos)?, values(&sin)?);
            let want = reference(
                &x,
                [b, t, h, d],
                d,
                style,
                false,
                |_, s| s,
                |p, i| (c[p * d / 2 + i], s[p * d / 2 + i]),
            );
            let got = values(&out.transpose(1, 2)?.contiguous()?)?;
            assert_close(&format!("{style:?}"), &got, &want, 1e-6);
        }
        Ok(())
    }

    /// `apply_inplace` on q and k narrowed out of a fused QKV tensor `[b, t, h + 2 kv, d]`
    /// (strided views sharing one storage) writes exactly what `apply` returns for the same
    /// views, for every sin/cos and position source, and leaves v untouched.
    #[test]
    fn in_place_on_fused_qkv_views_equals_out_of_place() -> Res {
        let Some(dev) = gpu_or_skip(
            "strided_matches_reference::in_place_on_fused_qkv_views_equals_out_of_place",
        ) else {
            return Ok(());
        };
        let (b, t, h, kv, d) = (2, 9, 4, 2, 64);
        let ids = Tensor::from_vec(
            (0..t as i64).map(|s| 3 * s + 1).collect::<Vec<_>>(),
            t,
            &dev,
        )?;
        let (cos, sin) = tables(t, d, 10_000.0, &dev)?;
        for dtype in [DType::F32, DType::BF16] {
            let (cos, sin) = (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?);
            for (sincos, positions) in [
                (SinCos::Computed { theta: 10_000.0 }, Positions::Ids(&ids)),
                (SinCos::Computed { theta: 10_000.0 }, Positions::Offset(5)),
                (SinCos::Tables { cos, sin }, Positions::Offset(0)),
            ] {
                let spec = RopeSpec {
                    style: RopeStyle::Neox,
                    axes: Axes::Bshd,
                    rotary_dim: None,
                    sincos,
                };
                let qkv = Tensor::randn(0f32, 1., (b, t, h + 2 * kv, d), &dev)?.to_dtype(dtype)?;
                let (q, k, v) = (
                    qkv.narrow(2, 0, h)?,
                    qkv.narrow(2, h, kv)?,
                    qkv.narrow(2, h + kv, kv)?,
                );
                let (want_q, want_k) = rope_candle::apply_qk(&q, &k, &spec, positions)?;
                let v_before = values(&v)?;
                rope_candle::apply_qk_inplace(&q, &k, &spec, positions)?;
                let what = format!("{dtype:?} {:?}", spec.sincos);
                assert_eq!(values(&q)?, values(&want_q)?, "{what}: q");
                assert_eq!(values(&k)?, values(&want_k)?, "{what}: k");
                assert_eq!(values(&v)?, v_before, "{what}: v untouched");
            }
        }
        Ok(())
    }

    #[test]
    fn computed_partial_rotary_with_device_ids() -> Res {
        let Some(dev) =
            gpu_or_skip("strided_matches_reference::computed_partial_rotary_with_device_ids")
        else {
            return Ok(());
        };
        let (b, t, h, d, r, theta) = (2, 7, 3, 64, 32, 500_000.0);
        let xs = Tensor::randn(0f32, 1., (b, t, h, d), &dev)?;
        let ids: Vec<i64> = (0..b * t).map(|k| (k * 37 % 1000) as i64).collect();
        let ids_t = Tensor::from_vec(ids.clone(), (b, t), &dev)?;
        let spec = RopeSpec {
            style: RopeStyle::Neox,
            axes: Axes::Bshd,
            rotary_dim: Some(r as u32),
            sincos: SinCos::Computed { theta },
        };
        let out = rope_candle::apply(&xs, &spec, Positions::Ids(&ids_t))?;
        let angle = |p: usize, i: usize| p as f64 * theta.powf(-2.0 * i as f64 / r as f64);
        let want = reference(
            &values(&xs)?,
            [b, t, h, d],
            r,
            RopeStyle::Neox,
            false,
            |bb, s| ids[bb * t + s] as usize,
            |p, i| (angle(p, i).cos(), angle(p, i).sin()),
        );
        // In-kernel sin/cos within one f32 ulp, angles in f64: a few ulps of the output.
        assert_close("computed", &values(&out)?, &want, 1e-5);
        // q and k in one call, k with fewer heads.
        let k = Tensor::randn(0f32, 1., (b, t, 1, d), &dev)?;
        let (q2, k2) = rope_candle::apply_qk(&xs, &k, &spec, Positions::Ids(&ids_t))?;
        assert_close("apply_qk q", &values(&q2)?, &want, 1e-5);
        let want_k = reference(
            &values(&k)?,
            [b, t, 1, d],
            r,
            RopeStyle::Neox,
            false,
            |bb, s| ids[bb * t + s] as usize,
            |p, i| (angle(p, i).cos(), angle(p, i).sin()),
        );
        assert_close("apply_qk k", &values(&k2)?, &want_k, 1e-5);
        Ok(())
    }
}

mod gradients {
    use super::*;

    /// `loss = sum(rope(x) * w)`: its gradient is the backward rotation of `w`.
    #[test]
    fn backprop_is_the_backward_rotation_and_matches_finite_differences() -> Res {
        let Some(dev) = gpu_or_skip("gradients::backprop_is_the_backward_rotation") else {
            return Ok(());
        };
        let (b, h, t, d) = (1, 2, 5, 16);
        let x = Var::from_tensor(&Tensor::randn(0f32, 1., (b, h, t, d), &dev)?)?;
        let w = Tensor::randn(0f32, 1., (b, h, t, d), &dev)?;
        let (cos, sin) = tables(t, d, 10_000.0, &dev)?;
        let loss = |x: &Tensor| -> candle_core::Result<Tensor> {
            (rope_candle::rope(x, &cos, &sin)? * &w)?.sum_all()
        };
        let grads = loss(x.as_tensor())?.backward()?;
        let g = grads.get(x.as_tensor()).expect("x takes part in the loss");
        let (c, s) = (values(&cos)?, values(&sin)?);
        let wb = values(&w.transpose(1, 2)?.contiguous()?)?;
        let want = reference(
            &wb,
            [b, t, h, d],
            d,
            RopeStyle::Neox,
            true,
            |_, s| s,
            |p, i| (c[p * d / 2 + i], s[p * d / 2 + i]),
        );
        let got = values(&g.transpose(1, 2)?.contiguous()?)?;
        assert_close("backward rotation", &got, &want, 1e-6);
        // Central differences in f32 on a few elements (the loss is linear in x, so the only
        // error is rounding).
        let eps = 1e-2f32;
        for idx in [(0, 0, 0, 0), (0, 1, 4, 15), (0, 0, 2, 9)] {
            let (bi, hi, ti, di) = idx;
            let mut e = vec![0f32; b * h * t * d];
            e[((bi * h + hi) * t + ti) * d + di] = eps;
            let e = Tensor::from_vec(e, (b, h, t, d), &dev)?;
            let up = loss(&(x.as_tensor() + &e)?)?.to_scalar::<f32>()?;
            let down = loss(&(x.as_tensor() - &e)?)?.to_scalar::<f32>()?;
            let fd = f64::from(up - down) / (2.0 * f64::from(eps));
            let an = f64::from(g.i(idx)?.to_scalar::<f32>()?);
            assert!(
                (fd - an).abs() <= 1e-2 * (1.0 + an.abs()),
                "{idx:?}: {fd} vs {an}"
            );
        }
        Ok(())
    }
}

mod multi_axis {
    use super::*;
    use rope_candle::AxisMap;

    /// Positions `[3, b, t]` (i64): text-like tokens with one position on every axis, and
    /// image-like tokens whose axes differ.
    fn positions(b: usize, t: usize) -> Vec<i64> {
        let mut p = vec![0i64; 3 * b * t];
        for tok in 0..b * t {
            let base = (tok * 37 % 700) as i64;
            let image = tok % 3 == 1;
            for a in 0..3 {
                p[a * b * t + tok] = if image {
                    base + (a as i64) * (tok as i64 % 11)
                } else {
                    base
                };
            }
        }
        p
    }

    /// mRoPE, interleaved mRoPE and axial maps: `apply` against the f64 reference (each pair
    /// at its axis's position), in place equal to out of place, q and k in one call, and the
    /// gradient the backward rotation of the upstream gradient.
    #[test]
    fn multi_axis_positions_match_reference() -> Res {
        let Some(dev) = gpu_or_skip("multi_axis::multi_axis_positions_match_reference") else {
            return Ok(());
        };
        let (b, t, h, d, theta) = (2, 9, 3, 64, 10_000.0);
        let pos = positions(b, t);
        let pos_t = Tensor::from_vec(pos.clone(), (3, b, t), &dev)?;
        for (name, map) in [
            ("mrope", AxisMap::mrope([8, 12, 12], d as u32)),
            (
                "mrope interleaved",
                AxisMap::mrope_interleaved([8, 12, 12], d as u32),
            ),
            ("axial", AxisMap::axial(&[16, 24, 24], d as u32)),
        ] {
            let map = map.map_err(rope_candle::Error::from)?;
            let axes = rope_candle::axis_map(&dev, &map)?;
            for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
                let spec = RopeSpec {
                    style,
                    axes: Axes::Bshd,
                    rotary_dim: None,
                    sincos: SinCos::Computed { theta },
                };
                let positions = Positions::MultiAxis {
                    positions: &pos_t,
                    axes: &axes,
                };
                let x = Var::from_tensor(&Tensor::randn(0f32, 1., (b, t, h, d), &dev)?)?;
                let out = rope_candle::apply(x.as_tensor(), &spec, positions)?;
                // Token `tok`'s pair `i` at the position of axis `axes[i]`.
                let cs = |tok: usize, i: usize| {
                    let p = pos[map.axes()[i] as usize * b * t + tok] as f64;
                    let a = p * theta.powf(-2.0 * i as f64 / d as f64);
                    (a.cos(), a.sin())
                };
                let what = format!("{name} {style:?}");
                let reference_of = |x: &[f64], heads: usize, backward: bool| {
                    reference(
                        x,
                        [b, t, heads, d],
                        d,
                        style,
                        backward,
                        |bb, s| bb * t + s,
                        cs,
                    )
                };
                let want = reference_of(&values(x.as_tensor())?, h, false);
                assert_close(&what, &values(&out)?, &want, 1e-5);

                let inplace = x.as_tensor().copy()?;
                rope_candle::apply_inplace(&inplace, &spec, positions)?;
                assert_eq!(values(&inplace)?, values(&out)?, "{what}: in place");

                let k = Tensor::randn(0f32, 1., (b, t, 1, d), &dev)?;
                let (_, k2) = rope_candle::apply_qk(x.as_tensor(), &k, &spec, positions)?;
                let want_k = reference_of(&values(&k)?, 1, false);
                assert_close(&format!("{what}: k"), &values(&k2)?, &want_k, 1e-5);

                let gy = Tensor::randn(0f32, 1., (b, t, h, d), &dev)?;
                let grads = (out * &gy)?.sum_all()?.backward()?;
                let g = grads.get(x.as_tensor()).expect("x takes part in the loss");
                let want_g = reference_of(&values(&gy)?, h, true);
                assert_close(&format!("{what}: gradient"), &values(g)?, &want_g, 1e-5);
            }
        }
        // Positions as `[n_axes, batch * seq]` give the same rotation.
        let map = AxisMap::mrope([8, 12, 12], d as u32).map_err(rope_candle::Error::from)?;
        let axes = rope_candle::axis_map(&dev, &map)?;
        let spec = RopeSpec {
            style: RopeStyle::Neox,
            axes: Axes::Bshd,
            rotary_dim: None,
            sincos: SinCos::Computed { theta },
        };
        let x = Tensor::randn(0f32, 1., (b, t, h, d), &dev)?;
        let flat = pos_t.reshape((3, b * t))?;
        let a = rope_candle::apply(
            &x,
            &spec,
            Positions::MultiAxis {
                positions: &pos_t,
                axes: &axes,
            },
        )?;
        let c = rope_candle::apply(
            &x,
            &spec,
            Positions::MultiAxis {
                positions: &flat,
                axes: &axes,
            },
        )?;
        assert_eq!(values(&a)?, values(&c)?, "[3, b * t] positions");
        Ok(())
    }

    /// Positions of the wrong shape or axis count, and float positions, are refused naming
    /// `positions`, and the output is not written.
    #[test]
    fn malformed_multi_axis_positions_are_refused() -> Res {
        let Some(dev) = gpu_or_skip("multi_axis::malformed_multi_axis_positions_are_refused")
        else {
            return Ok(());
        };
        let (b, t, h, d) = (1, 5, 2, 64);
        let map = AxisMap::mrope([8, 12, 12], d as u32).map_err(rope_candle::Error::from)?;
        let axes = rope_candle::axis_map(&dev, &map)?;
        let spec = RopeSpec {
            style: RopeStyle::Neox,
            axes: Axes::Bshd,
            rotary_dim: None,
            sincos: SinCos::Computed { theta: 10_000.0 },
        };
        let x = Tensor::randn(0f32, 1., (b, t, h, d), &dev)?;
        let before = values(&x)?;
        for bad in [
            Tensor::zeros((2, b, t), DType::I64, &dev)?,
            Tensor::zeros((3, b, t + 1), DType::I64, &dev)?,
            Tensor::zeros((3, b * t + 1), DType::I64, &dev)?,
            Tensor::zeros((3, b, t), DType::F32, &dev)?,
        ] {
            let positions = Positions::MultiAxis {
                positions: &bad,
                axes: &axes,
            };
            let err = rope_candle::apply(&x, &spec, positions).unwrap_err();
            assert!(err.to_string().contains("positions"), "{err}");
            let err = rope_candle::apply_inplace(&x, &spec, positions).unwrap_err();
            assert!(err.to_string().contains("positions"), "{err}");
            assert_eq!(values(&x)?, before, "xs untouched");
        }
        Ok(())
    }
}

mod cpu_fallback {
    use super::*;

    /// On the CPU the drop-ins are candle_nn's own implementation (and differentiable).
    #[test]
    fn rope_on_cpu_is_candle_nn_and_has_gradients() -> Res {
        let dev = Device::Cpu;
        let (b, h, t, d) = (2, 3, 6, 16);
        let x = Var::from_tensor(&Tensor::randn(0f32, 1., (b, h, t, d), &dev)?)?;
        let (cos, sin) = tables(t, d, 10_000.0, &dev)?;
        let ours = rope_candle::rope(x.as_tensor(), &cos, &sin)?;
        let theirs = candle_nn::rotary_emb::rope(x.as_tensor(), &cos, &sin)?;
        assert_ulps("cpu rope", &ours, &theirs, 1.0)?;
        let ours_i = rope_candle::rope_i(x.as_tensor(), &cos, &sin)?;
        let theirs_i = candle_nn::rotary_emb::rope_i(x.as_tensor(), &cos, &sin)?;
        assert_ulps("cpu rope_i", &ours_i, &theirs_i, 1.0)?;
        let xt = x.as_tensor().transpose(1, 2)?.contiguous()?;
        let ours_t = rope_candle::rope_thd(&xt, &cos, &sin)?;
        let theirs_t = candle_nn::rotary_emb::rope_thd(&xt, &cos, &sin)?;
        assert_ulps("cpu rope_thd", &ours_t, &theirs_t, 1.0)?;
        let grads = ours.sum_all()?.backward()?;
        assert!(
            grads.get(x.as_tensor()).is_some(),
            "CPU path keeps gradients"
        );
        Ok(())
    }

    #[test]
    fn apply_on_cpu_is_a_clear_error() -> Res {
        let xs = Tensor::zeros((1, 2, 3, 8), DType::F32, &Device::Cpu)?;
        let spec = RopeSpec {
            style: RopeStyle::Neox,
            axes: Axes::Bshd,
            rotary_dim: None,
            sincos: SinCos::Computed { theta: 10_000.0 },
        };
        let err = rope_candle::apply(&xs, &spec, Positions::Offset(0)).unwrap_err();
        assert!(err.to_string().contains("runs on CUDA"), "{err}");
        Ok(())
    }
}
