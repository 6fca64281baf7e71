//! `fused_inplace` against an f64 reference of its definition: per-head RMS normalisation, the
//! rotation at each token's position, and k and v in the cache slots their tokens name (FP8
//! bytes decoded), every other cache byte untouched. GPU tests print `SKIPPED (no GPU)`
//! without a CUDA device, and fail instead with `ROPE_REQUIRE_GPU=1`.

use candle_core::{DType, Device, Tensor};
use rope_candle::{
    Axes, CacheValues, FusedSpec, NormWeight, PagedKvCache, Positions, QkNorm, RopeStyle, SinCos,
};

mod common;
use common::gpu_or_skip;

type Res = candle_core::Result<()>;

fn values(t: &Tensor) -> candle_core::Result<Vec<f64>> {
    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// The value of FP8 E4M3 (`e4m3fn`) bits.
fn e4m3(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((b >> 3) & 0xf), f64::from(b & 7));
    let magnitude = if e == 0 {
        m / 512.0
    } else {
        (1.0 + m / 8.0) * 2f64.powi(e - 7)
    };
    sign * magnitude
}

/// Sizes of one case: batch, tokens per row, q heads, kv heads, head size, cache blocks and
/// rows per block.
#[derive(Clone, Copy)]
struct Shape {
    b: usize,
    t: usize,
    h: usize,
    kv: usize,
    d: usize,
    blocks: usize,
    rows: usize,
}

/// What the fused launch writes, by its definition in f64: q and k (`[b, t, heads, d]`
/// row-major) normalised with `w` (`weight(w_e)` multiplies) and rotated at `pos(b, s)` with
/// `cos_sin(p, i)`.
#[allow(clippy::too_many_arguments)]
fn reference(
    x: &[f64],
    [b, t, heads, d]: [usize; 4],
    style: RopeStyle,
    norm: Option<(&[f64], f64)>,
    pos: impl Fn(usize, usize) -> usize,
    cos_sin: impl Fn(usize, usize) -> (f64, f64),
) -> Vec<f64> {
    let mut out = x.to_vec();
    let half = d / 2;
    for bb in 0..b {
        for s in 0..t {
            for hh in 0..heads {
                let at = ((bb * t + s) * heads + hh) * d;
                let head: Vec<f64> = match norm {
                    Some((w, eps)) => {
                        let ms = x[at..at + d].iter().map(|v| v * v).sum::<f64>() / d as f64;
                        let r = 1.0 / (ms + eps).sqrt();
                        (0..d).map(|e| x[at + e] * r * w[e]).collect()
                    }
                    None => x[at..at + d].to_vec(),
                };
                for i in 0..half {
                    let (j, k) = match style {
                        RopeStyle::Neox => (i, i + half),
                        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (c, sn) = cos_sin(pos(bb, s), i);
                    out[at + j] = head[j] * c - head[k] * sn;
                    out[at + k] = head[k] * c + head[j] * sn;
                }
            }
        }
    }
    out
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

/// Slots of `n` tokens in a cache of `slots` rows: distinct, scattered, every fifth padding.
fn slot_mapping(n: usize, slots: usize) -> Vec<i64> {
    (0..n)
        .map(|i| {
            if i % 5 == 3 {
                -1
            } else {
                ((i * 37 + 11) % slots) as i64
            }
        })
        .collect()
}

/// Normalisation, rotation with computed sin/cos at device ids, and an f32 cache write, on q, k
/// and v narrowed out of one QKV tensor: q and k in place, each slot's row of both caches
/// holding its token's k and v, every other row still zero, v untouched; both styles.
#[test]
fn norm_rope_and_cache_write_match_the_reference_f32() -> Res {
    let Some(dev) = gpu_or_skip("norm_rope_and_cache_write_match_the_reference_f32") else {
        return Ok(());
    };
    let sh = Shape {
        b: 2,
        t: 7,
        h: 4,
        kv: 2,
        d: 64,
        blocks: 5,
        rows: 8,
    };
    let (eps, theta) = (1e-6, 10_000.0);
    let n = sh.b * sh.t;
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        let qkv = Tensor::randn(0f32, 1., (sh.b, sh.t, sh.h + 2 * sh.kv, sh.d), &dev)?;
        let (q, k, v) = (
            qkv.narrow(2, 0, sh.h)?,
            qkv.narrow(2, sh.h, sh.kv)?,
            qkv.narrow(2, sh.h + sh.kv, sh.kv)?,
        );
        let (q0, k0, v0) = (values(&q)?, values(&k)?, values(&v)?);
        let q_weight = Tensor::randn(1f32, 0.2, sh.d, &dev)?;
        let k_weight = Tensor::randn(1f32, 0.2, sh.d, &dev)?;
        let (qw, kw) = (values(&q_weight)?, values(&k_weight)?);
        let ids: Vec<i64> = (0..n).map(|i| (i * 131 % 4000) as i64).collect();
        let ids_t = Tensor::from_vec(ids.clone(), (sh.b, sh.t), &dev)?;
        let cache_shape = (sh.blocks, sh.rows, sh.kv, sh.d);
        let k_cache = Tensor::zeros(cache_shape, DType::F32, &dev)?;
        let v_cache = Tensor::zeros(cache_shape, DType::F32, &dev)?;
        let slots = slot_mapping(n, sh.blocks * sh.rows);
        let slots_t = Tensor::from_vec(slots.clone(), n, &dev)?;
        let spec = FusedSpec {
            style,
            axes: Axes::Bshd,
            sincos: SinCos::Computed { theta },
            norm: Some(QkNorm {
                q_weight,
                k_weight,
                eps: eps as f32,
                weight: NormWeight::Plain,
            }),
        };
        let cache = PagedKvCache {
            k_cache: &k_cache,
            v_cache: &v_cache,
            slot_mapping: &slots_t,
            values: &CacheValues::Elem,
        };
        rope_candle::fused_inplace(&q, &k, Some(&v), &spec, Positions::Ids(&ids_t), Some(cache))?;

        let angle = |p: usize, i: usize| p as f64 * theta.powf(-2.0 * i as f64 / sh.d as f64);
        let cs = |p: usize, i: usize| (angle(p, i).cos(), angle(p, i).sin());
        let pos = |bb: usize, s: usize| ids[bb * sh.t + s] as usize;
        let want_q = reference(
            &q0,
            [sh.b, sh.t, sh.h, sh.d],
            style,
            Some((&qw, eps)),
            pos,
            cs,
        );
        let want_k = reference(
            &k0,
            [sh.b, sh.t, sh.kv, sh.d],
            style,
            Some((&kw, eps)),
            pos,
            cs,
        );
        let what = format!("{style:?}");
        assert_close(&format!("{what} q"), &values(&q)?, &want_q, 2e-5);
        assert_close(&format!("{what} k"), &values(&k)?, &want_k, 2e-5);
        assert_eq!(values(&v)?, v0, "{what}: v untouched");
        let (kc, vc) = (values(&k_cache)?, values(&v_cache)?);
        let row = sh.kv * sh.d;
        let mut written = vec![false; sh.blocks * sh.rows];
        for (tok, &slot) in slots.iter().enumerate() {
            if slot < 0 {
                continue;
            }
            let s = slot as usize;
            written[s] = true;
            let (at, from) = (s * row, tok * row);
            assert_close(
                &format!("{what} k_cache slot {s}"),
                &kc[at..at + row],
                &want_k[from..from + row],
                2e-5,
            );
            assert_eq!(
                &vc[at..at + row],
                &v0[from..from + row],
                "{what}: v_cache slot {s}"
            );
        }
        for (s, _) in written.iter().enumerate().filter(|(_, w)| !**w) {
            let at = s * row;
            assert!(
                kc[at..at + row]
                    .iter()
                    .chain(&vc[at..at + row])
                    .all(|x| *x == 0.0),
                "{what}: slot {s} of no token was written"
            );
        }
    }
    Ok(())
}

/// bf16 q, k and v with a bf16 sin/cos table read at offset positions, no normalisation, and an
/// FP8 cache (U8 tensors, one scale each): each written byte decodes to the reference value over
/// its scale within E4M3's rounding, q and k within bf16's.
#[test]
fn table_rope_and_fp8_cache_match_the_reference_bf16() -> Res {
    let Some(dev) = gpu_or_skip("table_rope_and_fp8_cache_match_the_reference_bf16") else {
        return Ok(());
    };
    let sh = Shape {
        b: 1,
        t: 9,
        h: 8,
        kv: 2,
        d: 128,
        blocks: 3,
        rows: 4,
    };
    let (offset, theta) = (17usize, 500_000.0f64);
    let n = sh.b * sh.t;
    let rows = offset + sh.t + 3;
    let half = sh.d / 2;
    let angle = |p: usize, i: usize| p as f64 * theta.powf(-2.0 * i as f64 / sh.d as f64);
    let table = |f: fn(f64) -> f64| -> candle_core::Result<Tensor> {
        let v: Vec<f32> = (0..rows * half)
            .map(|x| f(angle(x / half, x % half)) as f32)
            .collect();
        Tensor::from_vec(v, (rows, half), &dev)?.to_dtype(DType::BF16)
    };
    let (cos, sin) = (table(f64::cos)?, table(f64::sin)?);
    let (cos_v, sin_v) = (values(&cos)?, values(&sin)?);
    let q = Tensor::randn(0f32, 1., (sh.b, sh.t, sh.h, sh.d), &dev)?.to_dtype(DType::BF16)?;
    let k = Tensor::randn(0f32, 1., (sh.b, sh.t, sh.kv, sh.d), &dev)?.to_dtype(DType::BF16)?;
    let v = Tensor::randn(0f32, 1., (sh.b, sh.t, sh.kv, sh.d), &dev)?.to_dtype(DType::BF16)?;
    let (q0, k0, v0) = (values(&q)?, values(&k)?, values(&v)?);
    let cache_shape = (sh.blocks, sh.rows, sh.kv, sh.d);
    let k_cache = Tensor::zeros(cache_shape, DType::U8, &dev)?;
    let v_cache = Tensor::zeros(cache_shape, DType::U8, &dev)?;
    let (k_scale, v_scale) = (0.5f32, 0.25f32);
    let values_fp8 = CacheValues::Fp8 {
        k_scale: Tensor::from_vec(vec![k_scale], 1, &dev)?,
        v_scale: Tensor::from_vec(vec![v_scale], 1, &dev)?,
    };
    let slots = slot_mapping(n, sh.blocks * sh.rows);
    let slots_t = Tensor::from_vec(slots.iter().map(|&s| s as i32).collect::<Vec<_>>(), n, &dev)?;
    let spec = FusedSpec {
        style: RopeStyle::Neox,
        axes: Axes::Bshd,
        sincos: SinCos::Tables { cos, sin },
        norm: None,
    };
    let cache = PagedKvCache {
        k_cache: &k_cache,
        v_cache: &v_cache,
        slot_mapping: &slots_t,
        values: &values_fp8,
    };
    rope_candle::fused_inplace(
        &q,
        &k,
        Some(&v),
        &spec,
        Positions::Offset(offset as u32),
        Some(cache),
    )?;
    let cs = |p: usize, i: usize| (cos_v[p * half + i], sin_v[p * half + i]);
    let pos = |_: usize, s: usize| offset + s;
    let want_q = reference(
        &q0,
        [sh.b, sh.t, sh.h, sh.d],
        RopeStyle::Neox,
        None,
        pos,
        cs,
    );
    let want_k = reference(
        &k0,
        [sh.b, sh.t, sh.kv, sh.d],
        RopeStyle::Neox,
        None,
        pos,
        cs,
    );
    // bf16 keeps 8 significant bits: one rounding of each output.
    assert_close("q", &values(&q)?, &want_q, 1.0 / 128.0);
    assert_close("k", &values(&k)?, &want_k, 1.0 / 128.0);
    let kc = k_cache.flatten_all()?.to_vec1::<u8>()?;
    let vc = v_cache.flatten_all()?.to_vec1::<u8>()?;
    let row = sh.kv * sh.d;
    for (tok, &slot) in slots.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let (at, from) = (slot as usize * row, tok * row);
        for e in 0..row {
            // E4M3 keeps 4 significant bits (half an ulp: 1/16 relative), below 2^-6 steps of
            // 2^-9; the k reference is itself within bf16's rounding of the kernel's value.
            for (what, byte, want) in [
                ("k_cache", kc[at + e], want_k[from + e] / f64::from(k_scale)),
                ("v_cache", vc[at + e], v0[from + e] / f64::from(v_scale)),
            ] {
                let got = e4m3(byte);
                assert!(
                    (got - want).abs() <= want.abs() / 14.0 + 1.0 / 512.0,
                    "{what} slot {slot} element {e}: {got} for {want}"
                );
            }
        }
    }
    Ok(())
}

/// NeoX pairs of `[batch, seq, heads, head_dim]` tensors rotated by sin/cos computed from
/// theta 10^4, without a norm: the launch the refusal tests make.
fn plain_spec() -> FusedSpec {
    FusedSpec {
        style: RopeStyle::Neox,
        axes: Axes::Bshd,
        sincos: SinCos::Computed { theta: 10_000.0 },
        norm: None,
    }
}

/// Launches [`plain_spec`] on q, k and v (3 tokens at offset 0, one kv head of 64) with a
/// write into zeroed caches `[2, 4, 1, 64]` of `cache_dtype` at slots 0, 1 and 2, which must
/// fail: its error, and the k cache after it.
fn refused_with_caches(
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    cache_dtype: DType,
    why: &str,
) -> candle_core::Result<(candle_core::Error, Tensor)> {
    let dev = q.device();
    let k_cache = Tensor::zeros((2, 4, 1, 64), cache_dtype, dev)?;
    let v_cache = Tensor::zeros((2, 4, 1, 64), cache_dtype, dev)?;
    let slots = Tensor::from_vec(vec![0i64, 1, 2], 3, dev)?;
    let cache = PagedKvCache {
        k_cache: &k_cache,
        v_cache: &v_cache,
        slot_mapping: &slots,
        values: &CacheValues::Elem,
    };
    let err = rope_candle::fused_inplace(
        q,
        k,
        Some(v),
        &plain_spec(),
        Positions::Offset(0),
        Some(cache),
    )
    .expect_err(why);
    Ok((err, k_cache))
}

/// A cache of another dtype than q's is refused by name before anything is written: q, k and
/// both caches keep their values.
#[test]
fn a_cache_of_another_dtype_is_refused_and_nothing_is_written() -> Res {
    let Some(dev) = gpu_or_skip("a_cache_of_another_dtype_is_refused_and_nothing_is_written")
    else {
        return Ok(());
    };
    let q = Tensor::randn(0f32, 1., (1, 3, 2, 64), &dev)?;
    let k = Tensor::randn(0f32, 1., (1, 3, 1, 64), &dev)?;
    let v = Tensor::randn(0f32, 1., (1, 3, 1, 64), &dev)?;
    let (q0, k0) = (values(&q)?, values(&k)?);
    let (err, k_cache) =
        refused_with_caches((&q, &k, &v), DType::BF16, "a bf16 cache for f32 tensors")?;
    assert!(err.to_string().contains("cache.k_cache"), "{err}");
    assert_eq!(values(&q)?, q0);
    assert_eq!(values(&k)?, k0);
    assert!(values(&k_cache)?.iter().all(|x| *x == 0.0));
    Ok(())
}

/// q and k narrowed out of one allocation take the packed form, which needs v in it too: a v
/// of its own is refused by name, and q and k keep their values.
#[test]
fn a_v_outside_a_shared_qk_allocation_is_refused_by_name() -> Res {
    let Some(dev) = gpu_or_skip("a_v_outside_a_shared_qk_allocation_is_refused_by_name") else {
        return Ok(());
    };
    let qk = Tensor::randn(0f32, 1., (1, 3, 3, 64), &dev)?;
    let (q, k) = (qk.narrow(2, 0, 2)?, qk.narrow(2, 2, 1)?);
    let v = Tensor::randn(0f32, 1., (1, 3, 1, 64), &dev)?;
    let qk0 = values(&qk)?;
    let (err, k_cache) =
        refused_with_caches((&q, &k, &v), DType::F32, "v outside q and k's allocation")?;
    assert!(err.to_string().contains("v:"), "{err}");
    assert_eq!(values(&qk)?, qk0);
    assert!(values(&k_cache)?.iter().all(|x| *x == 0.0));
    Ok(())
}

/// On CPU tensors the fused op is an error naming q (it runs on CUDA only); no GPU needed.
#[test]
fn fused_on_cpu_is_an_error_naming_q() -> Res {
    let dev = Device::Cpu;
    let q = Tensor::zeros((1, 2, 2, 64), DType::F32, &dev)?;
    let k = Tensor::zeros((1, 2, 1, 64), DType::F32, &dev)?;
    let err = rope_candle::fused_inplace(&q, &k, None, &plain_spec(), Positions::Offset(0), None)
        .expect_err("CPU tensors");
    assert!(err.to_string().contains("q:"), "{err}");
    Ok(())
}
