//! The QK-norm + RoPE backward (`Rope::run_fused_backward`, and by address
//! `Rope::run_fused_backward_raw`) against the f64 gradients of `rope_reference::fused::
//! rms_norm_rope_backward` (itself checked against central differences of the forward): random
//! shapes, both pairings, table and computed sin/cos, offset and per-token positions, both
//! weightings, in place and out of place, GQA head counts, and a prefill-sized case every fifth.
//! Input gradients are checked element by element, the weights' gradients against the sum over
//! tokens and heads; malformed launches are refused before anything is written.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rope_harness::case::TestElem;
use rope_harness::fused::{MAX_POSITION, THETA};
use rope_host::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use rope_host::{
    DeviceInts, FusedGrads, FusedOp, IdsShape, Io, Layout, NormWeight, Positions, QkNorm, RawBuf,
    RawFusedGrads, RawFusedOp, RawIo, RawOp, RawQkNorm, RawTensor, Rope, RopeConfig, RopeOp,
    RopeStyle, SinCos, SinCosTables, TableData, TableFormat, Tensor, TensorMut,
};
use rope_reference::fused::rms_norm_rope_backward;
use rope_reference::reference::inv_freq;
use rope_tests::gpu::{case_cap, gpu_or_skip};

use super::super::report;

/// One random backward case.
#[derive(Clone, Debug)]
struct Case {
    style: RopeStyle,
    d: usize,
    batch: usize,
    seq: usize,
    hq: usize,
    hk: usize,
    /// Per-token positions, or an offset.
    ids: Option<Vec<i64>>,
    offset: i64,
    table: bool,
    weight: NormWeight,
    in_place: bool,
    /// Through `run_fused_backward_raw`.
    raw: bool,
}

impl Case {
    fn random(j: u64, es: usize) -> Self {
        let mut rng = StdRng::seed_from_u64(j * 7_919 + es as u64);
        let style = if rng.random_bool(0.5) {
            RopeStyle::Neox
        } else {
            RopeStyle::Interleaved
        };
        // Heads of more than a warp's accesses are `run_long`'s.
        let dims: &[usize] = if es == 4 && style == RopeStyle::Interleaved {
            &[64, 96, 128]
        } else {
            &[64, 96, 128, 256]
        };
        let d = dims[rng.random_range(0..dims.len())];
        let large = j % 5 == 4;
        let (batch, seq, hq, hk) = if large {
            (2, 1_024, 32, 8)
        } else {
            (
                rng.random_range(1..4),
                rng.random_range(1..40),
                rng.random_range(1..13),
                rng.random_range(1..5),
            )
        };
        // Prefill-sized cases take per-token ids: their sequences are longer than the tables.
        let ids = (large || rng.random_bool(0.5)).then(|| {
            (0..batch * seq)
                .map(|_| rng.random_range(0..MAX_POSITION as i64))
                .collect()
        });
        let offset = rng.random_range(0..MAX_POSITION as i64 - seq.min(MAX_POSITION - 1) as i64);
        Case {
            style,
            d,
            batch,
            seq,
            hq,
            hk,
            offset: if ids.is_none() && seq >= MAX_POSITION {
                0
            } else {
                offset
            },
            ids,
            table: rng.random_bool(0.5),
            weight: if rng.random_bool(0.5) {
                NormWeight::Plain
            } else {
                NormWeight::OnePlus
            },
            in_place: rng.random_bool(0.5),
            raw: j % 2 == 1,
        }
    }

    fn position(&self, t: usize) -> i64 {
        match &self.ids {
            Some(ids) => ids[t],
            None => self.offset + (t % self.seq) as i64,
        }
    }

    fn tokens(&self) -> usize {
        self.batch * self.seq
    }
}

/// The values a case's data is drawn from: forward inputs, weights and output gradients,
/// rounded to `T`.
struct Data<T> {
    xq: Vec<T>,
    xk: Vec<T>,
    wq: Vec<T>,
    wk: Vec<T>,
    gq: Vec<T>,
    gk: Vec<T>,
}

fn draw<T: TestElem>(c: &Case, seed: u64) -> Data<T> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut values = |n: usize, range: f64| -> Vec<T> {
        (0..n)
            .map(|_| T::from_f64(rng.random_range(-range..range)))
            .collect()
    };
    let (nq, nk) = (c.tokens() * c.hq * c.d, c.tokens() * c.hk * c.d);
    // Gemma's weights are offsets from 1; the others' near 1.
    let w = if c.weight == NormWeight::OnePlus {
        0.5
    } else {
        1.5
    };
    Data {
        xq: values(nq, 2.0),
        xk: values(nk, 2.0),
        wq: values(c.d, w),
        wk: values(c.d, w),
        gq: values(nq, 1.0),
        gk: values(nk, 1.0),
    }
}

/// The launch's outputs, downloaded.
struct Got<T> {
    gq: Vec<T>,
    gk: Vec<T>,
    wq: Vec<T>,
    wk: Vec<T>,
}

/// The worst error of a test, as a share of its bound.
#[derive(Default)]
struct Worst {
    ratio: f64,
    checked: usize,
}

impl Worst {
    fn check(&mut self, what: &str, got: f64, want: f64, bound: f64) -> Result<(), String> {
        let err = (got - want).abs();
        self.checked += 1;
        if err.is_nan() || err > bound {
            return Err(format!(
                "{what}: got {got}, want {want} (error {err}, bound {bound})"
            ));
        }
        self.ratio = self.ratio.max(err / bound);
        Ok(())
    }
}

fn launch<T: TestElem>(
    c: &Case,
    data: &Data<T>,
    stream: &std::sync::Arc<CudaStream>,
    rope: &Rope,
) -> Result<Got<T>, String> {
    let e = |e: rope_host::cudarc::driver::DriverError| e.to_string();
    let h = |e: rope_host::Error| e.to_string();
    let config = RopeConfig::builder(c.d as u32, c.style)
        .build()
        .map_err(h)?;
    let tables: Option<SinCosTables<T>> = if c.table {
        Some(
            rope.build_tables::<T>(THETA, c.d as u32, MAX_POSITION + 32, TableFormat::Separate)
                .map_err(h)?,
        )
    } else {
        rope.prepare(THETA, c.d as u32).map_err(h)?;
        None
    };
    let ids: Vec<i64> = c.ids.clone().unwrap_or_else(|| vec![0]);
    let ids_dev = stream.clone_htod(&ids).map_err(e)?;
    let up = |v: &Vec<T>| stream.clone_htod(v).map_err(e);
    let (xq, xk, wq, wk) = (up(&data.xq)?, up(&data.xk)?, up(&data.wq)?, up(&data.wk)?);
    let (mut gq, mut gk) = (up(&data.gq)?, up(&data.gk)?);
    let poison = |n: usize| stream.clone_htod(&vec![T::poison(); n]).map_err(e);
    let (mut oq, mut ok) = (poison(data.gq.len())?, poison(data.gk.len())?);
    let (mut dwq, mut dwk) = (poison(c.d)?, poison(c.d)?);
    let heads = c.hq + c.hk;
    let mut workspace: CudaSlice<f32> = stream
        .alloc_zeros(rope.fused_backward_workspace(heads, c.d))
        .map_err(e)?;
    let (lq, lk) = (
        Layout::bshd(c.batch, c.seq, c.hq, c.d),
        Layout::bshd(c.batch, c.seq, c.hk, c.d),
    );
    let sincos = match &tables {
        Some(t) => t.sincos(),
        None => SinCos::Computed { theta: THETA },
    };
    let weight = c.weight;
    if c.raw {
        let buf = |s: &CudaSlice<T>| RawBuf {
            ptr: s.device_ptr(stream).0,
            len: s.len(),
        };
        let tensor = |s: &CudaSlice<T>, layout| RawTensor {
            buf: buf(s),
            layout,
        };
        let io = |g: &CudaSlice<T>, o: &CudaSlice<T>, layout| {
            if c.in_place {
                RawIo::InPlace(tensor(g, layout))
            } else {
                RawIo::OutOfPlace {
                    input: tensor(g, layout),
                    output: tensor(o, layout),
                }
            }
        };
        let op = RawFusedOp {
            rope: RawOp {
                config,
                dtype: T::DTYPE,
                positions: match &c.ids {
                    Some(_) => rope_host::RawPositions::Ids {
                        ids: rope_host::RawInts {
                            buf: RawBuf {
                                ptr: ids_dev.device_ptr(stream).0,
                                len: ids.len(),
                            },
                            ty: rope_host::IntType::I64,
                        },
                        shape: IdsShape::PerRow,
                    },
                    None => rope_host::RawPositions::Offset(c.offset as u32),
                },
                sincos: match tables.as_ref().map(|t| t.data()) {
                    Some(TableData::Separate { cos, sin }) => rope_host::RawSinCos::Table {
                        cos: buf(cos),
                        sin: buf(sin),
                        dtype: T::DTYPE,
                        shape: rope_host::TableShape {
                            max_position: MAX_POSITION + 32,
                            rotary_dim: c.d as u32,
                        },
                    },
                    _ => rope_host::RawSinCos::Computed { theta: THETA },
                },
            },
            norm: Some(RawQkNorm {
                q_weight: buf(&wq),
                k_weight: buf(&wk),
                eps: 1e-6,
                weight,
                scope: rope_host::NormScope::PerHead,
            }),
        };
        let grads = RawFusedGrads {
            q_input: tensor(&xq, lq),
            k_input: tensor(&xk, lk),
            q: io(&gq, &oq, lq),
            k: io(&gk, &ok, lk),
            q_weight: buf(&dwq),
            k_weight: buf(&dwk),
            workspace: RawBuf {
                ptr: workspace.device_ptr(stream).0,
                len: workspace.len(),
            },
        };
        // SAFETY: every buffer lives on this stream's context until the synchronize below.
        unsafe { rope.run_fused_backward_raw(&op, &grads, stream.cu_stream()) }.map_err(h)?;
    } else {
        let op = FusedOp {
            rope: RopeOp {
                config,
                positions: match &c.ids {
                    Some(_) => Positions::Ids {
                        ids: DeviceInts::I64(ids_dev.as_view()),
                        shape: IdsShape::PerRow,
                    },
                    None => Positions::Offset(c.offset as u32),
                },
                sincos,
            },
            norm: Some(QkNorm {
                q_weight: wq.as_view(),
                k_weight: wk.as_view(),
                eps: 1e-6,
                weight,
                scope: rope_host::NormScope::PerHead,
            }),
        };
        fn io<'a, T>(
            in_place: bool,
            g: &'a mut CudaSlice<T>,
            o: &'a mut CudaSlice<T>,
            layout: Layout,
        ) -> Io<'a, T> {
            if in_place {
                Io::InPlace(TensorMut {
                    data: g.as_view_mut(),
                    layout,
                })
            } else {
                Io::OutOfPlace {
                    input: Tensor {
                        data: g.as_view(),
                        layout,
                    },
                    output: TensorMut {
                        data: o.as_view_mut(),
                        layout,
                    },
                }
            }
        }
        let grads = FusedGrads {
            q_input: Tensor {
                data: xq.as_view(),
                layout: lq,
            },
            k_input: Tensor {
                data: xk.as_view(),
                layout: lk,
            },
            q: io(c.in_place, &mut gq, &mut oq, lq),
            k: io(c.in_place, &mut gk, &mut ok, lk),
            q_weight: dwq.as_view_mut(),
            k_weight: dwk.as_view_mut(),
            workspace: workspace.as_view_mut(),
        };
        rope.run_fused_backward(&op, grads).map_err(h)?;
    }
    stream.synchronize().map_err(e)?;
    let down = |s: &CudaSlice<T>| stream.clone_dtoh(s).map_err(e);
    let (gq, gk) = if c.in_place {
        (down(&gq)?, down(&gk)?)
    } else {
        (down(&oq)?, down(&ok)?)
    };
    Ok(Got {
        gq,
        gk,
        wq: down(&dwq)?,
        wk: down(&dwk)?,
    })
}

/// The case's tables' rows, downloaded, or `None` for computed sin/cos.
fn cos_sin(c: &Case, tables: Option<&(Vec<f64>, Vec<f64>)>, p: i64) -> (Vec<f64>, Vec<f64>) {
    let half = c.d / 2;
    let freqs = inv_freq(THETA, c.d);
    (0..half)
        .map(|i| match tables {
            Some((cos, sin)) => (cos[p as usize * half + i], sin[p as usize * half + i]),
            None => ((p as f64 * freqs[i]).cos(), (p as f64 * freqs[i]).sin()),
        })
        .unzip()
}

fn check_case<T: TestElem>(
    c: &Case,
    seed: u64,
    stream: &std::sync::Arc<CudaStream>,
    rope: &Rope,
    worst: &mut Worst,
) -> Result<(), String> {
    let data = draw::<T>(c, seed);
    let got = launch(c, &data, stream, rope)?;
    // The tables the kernel read, as the reference reads them.
    let tables = if c.table {
        let t = rope
            .build_tables::<T>(THETA, c.d as u32, MAX_POSITION + 32, TableFormat::Separate)
            .map_err(|e| e.to_string())?;
        let TableData::Separate { cos, sin } = t.data() else {
            return Err("tables built separate".into());
        };
        let down = |s: &CudaSlice<T>| -> Result<Vec<f64>, String> {
            Ok(stream
                .clone_dtoh(s)
                .map_err(|e| e.to_string())?
                .iter()
                .map(|v| v.to_f64())
                .collect())
        };
        Some((down(cos)?, down(sin)?))
    } else {
        None
    };
    let one_plus = c.weight == NormWeight::OnePlus;
    let f = |v: &[T]| -> Vec<f64> { v.iter().map(|v| v.to_f64()).collect() };
    let d = c.d;
    for (name, heads, x, w, g, out, wgot) in [
        ("q", c.hq, &data.xq, &data.wq, &data.gq, &got.gq, &got.wq),
        ("k", c.hk, &data.xk, &data.wk, &data.gk, &got.gk, &got.wk),
    ] {
        let w64 = f(w);
        let mut dw = vec![0.0f64; d];
        // The sizes of the terms each weight gradient sums: its elements of `R^T gy` round
        // at the size of the pairs they come from.
        let mut dw_scale = vec![0.0f64; d];
        for t in 0..c.tokens() {
            let (cos, sin) = cos_sin(c, tables.as_ref(), c.position(t));
            for h in 0..heads {
                let at = (t * heads + h) * d;
                let (xh, gh) = (f(&x[at..at + d]), f(&g[at..at + d]));
                let (dx, dwh) =
                    rms_norm_rope_backward(&xh, &w64, (1e-6, one_plus), c.style, &cos, &sin, &gh);
                // The f32 arithmetic's error grows with the terms each element sums.
                let r = 1.0 / (xh.iter().map(|v| v * v).sum::<f64>() / d as f64 + 1e-6).sqrt();
                let scale = r
                    * gh.iter().map(|v| v.abs()).fold(0.0, f64::max)
                    * w64
                        .iter()
                        .map(|v| (v + f64::from(u8::from(one_plus))).abs())
                        .fold(0.0, f64::max);
                let gmax = gh.iter().map(|v| v.abs()).fold(0.0, f64::max);
                for e in 0..d {
                    let want = dx[e];
                    let bound = T::ulp(T::from_f64(want.abs())) + 6e-6 * scale;
                    worst.check(
                        &format!("{name} gradient, token {t}, head {h}, element {e}"),
                        out[at + e].to_f64(),
                        want,
                        bound,
                    )?;
                    dw[e] += dwh[e];
                    dw_scale[e] += gmax * xh[e].abs() * r;
                }
            }
        }
        for e in 0..d {
            let bound = T::ulp(T::from_f64(dw[e].abs())) + 2e-6 * dw_scale[e];
            worst.check(
                &format!("{name} weight gradient, element {e}"),
                wgot[e].to_f64(),
                dw[e],
                bound,
            )?;
        }
    }
    Ok(())
}

fn run<T: TestElem>(name: &str, cases: u64) {
    run_with::<T>(name, cases, |_, _| {});
}

/// [`run`] with each drawn case changed by `change(j, case)`.
fn run_with<T: TestElem>(name: &str, cases: u64, change: impl Fn(u64, &mut Case)) {
    let Some((stream, rope)) = gpu_or_skip(name) else {
        return;
    };
    let mut worst = Worst::default();
    for j in 0..cases.min(case_cap()) {
        let mut c = Case::random(j, size_of::<T>());
        change(j, &mut c);
        if let Err(e) = check_case::<T>(&c, j ^ 0x5eed, &stream, &rope, &mut worst) {
            panic!("{name}: case {j} {c:?}: {e}");
        }
    }
    report(&format!(
        "{name}: {} values checked, largest error {:.3} of its bound",
        worst.checked, worst.ratio
    ));
}

#[test]
fn fused_backward_matches_reference_bf16() {
    run::<rope_host::half::bf16>("fused_backward_matches_reference_bf16", 20);
}

#[test]
fn fused_backward_matches_reference_f16() {
    run::<rope_host::half::f16>("fused_backward_matches_reference_f16", 20);
}

#[test]
fn fused_backward_matches_reference_f32() {
    run::<f32>("fused_backward_matches_reference_f32", 20);
}

/// Heads whose norm sums over more than a warp's accesses (Gemma 4's global layers: heads of
/// 512; `f32` interleaved heads of 256: 64 or 128 accesses), which the kernels sum across the
/// head's two or four warps: [`run`]'s random cases at those widths.
fn run_long<T: TestElem>(name: &str, cases: u64) {
    run_with::<T>(name, cases, |j, c| {
        c.d = if size_of::<T>() == 4 && j % 3 == 1 {
            c.style = RopeStyle::Interleaved;
            256
        } else {
            512
        };
    });
}

#[test]
fn fused_backward_of_heads_wider_than_a_warp_matches_reference_bf16() {
    run_long::<rope_host::half::bf16>(
        "fused_backward_of_heads_wider_than_a_warp_matches_reference_bf16",
        15,
    );
}

#[test]
fn fused_backward_of_heads_wider_than_a_warp_matches_reference_f16() {
    run_long::<rope_host::half::f16>(
        "fused_backward_of_heads_wider_than_a_warp_matches_reference_f16",
        10,
    );
}

#[test]
fn fused_backward_of_heads_wider_than_a_warp_matches_reference_f32() {
    run_long::<f32>(
        "fused_backward_of_heads_wider_than_a_warp_matches_reference_f32",
        10,
    );
}

/// A backward with a workspace one row short, an input of other dimensions, or no norm, is
/// refused naming the argument, and the gradients keep their poison.
#[test]
fn fused_backward_refuses_bad_arguments_and_writes_nothing() {
    let name = "fused_backward_refuses_bad_arguments_and_writes_nothing";
    let Some((stream, rope)) = gpu_or_skip(name) else {
        return;
    };
    let (d, tokens, hq, hk) = (64usize, 4usize, 2usize, 1usize);
    let config = RopeConfig::builder(d as u32, RopeStyle::Neox)
        .build()
        .expect("config");
    rope.prepare(THETA, d as u32).expect("prepare");
    let zeros = |n: usize| stream.alloc_zeros::<f32>(n).expect("alloc");
    let (xq, xk, w) = (zeros(tokens * hq * d), zeros(tokens * hk * d), zeros(d));
    let (mut gq, mut gk) = (zeros(tokens * hq * d), zeros(tokens * hk * d));
    let poison = |n: usize| stream.clone_htod(&vec![f32::poison(); n]).expect("upload");
    let (mut dwq, mut dwk) = (poison(d), poison(d));
    let need = rope.fused_backward_workspace(hq + hk, d);
    for (what, workspace_len, k_heads, norm) in [
        ("workspace", 1, hk, true),
        ("k_input", need, hk + 1, true),
        ("norm", need, hk, false),
    ] {
        let mut workspace = zeros(workspace_len);
        let op = FusedOp {
            rope: RopeOp {
                config,
                positions: Positions::Offset(0),
                sincos: SinCos::Computed { theta: THETA },
            },
            norm: norm.then(|| QkNorm {
                q_weight: w.as_view(),
                k_weight: w.as_view(),
                eps: 1e-6,
                weight: NormWeight::Plain,
                scope: rope_host::NormScope::PerHead,
            }),
        };
        let grads = FusedGrads {
            q_input: Tensor {
                data: xq.as_view(),
                layout: Layout::thd(tokens, hq, d),
            },
            k_input: Tensor {
                data: xk.as_view(),
                layout: Layout::thd(tokens, k_heads, d),
            },
            q: Io::InPlace(TensorMut {
                data: gq.as_view_mut(),
                layout: Layout::thd(tokens, hq, d),
            }),
            k: Io::InPlace(TensorMut {
                data: gk.as_view_mut(),
                layout: Layout::thd(tokens, hk, d),
            }),
            q_weight: dwq.as_view_mut(),
            k_weight: dwk.as_view_mut(),
            workspace: workspace.as_view_mut(),
        };
        let err = rope.run_fused_backward(&op, grads).expect_err(what);
        assert!(err.to_string().contains(what), "{what}: {err}");
        stream.synchronize().expect("sync");
        let got = stream.clone_dtoh(&dwq).expect("download");
        assert!(
            got.iter().all(|v| v.to_bits() == f32::poison().to_bits()),
            "{what}"
        );
    }
    let _ = &mut dwk;
}
