//! `cargo run --release`: every RoPE variant on a realistic shape, checked against the f64
//! reference and timed against a device-to-device copy of the same bytes in the same run.
//!
//! Without a GPU it says so, runs the CPU reference path on a small shape, and exits 0.

use anyhow::{Context, Result};
use rope_bench_support::BenchDevice;
use rope_bench_support::timing::{Runs, median_interval, median_ms, quartiles};
use rope_harness::case::{
    Case, DTypeCase, KCase, LayoutKind, PosCase, Source, TestElem, compare, gather,
};
use rope_harness::rotate::rotate_f32_at;
use rope_harness::with_elem;
use rope_host::{
    AngleMode, Direction, FrequencySpec, IdsShape, Layout, RopeStyle, SinCos, TableFormat,
};

/// Llama-style prefill: batch 1, 8192 tokens, 32 heads of 128.
const SHAPE: (usize, usize, usize, usize) = (1, 8192, 32, 128);
const THETA: f64 = 500_000.0;
const RUNS: Runs = Runs {
    warmup: 5,
    timed: 50,
};
/// Pairs for the head-to-head of the in-kernel path against the table: on an H200 the 95%
/// interval of the median ratio then spans about +-0.2% (f32) to +-2% (the short r64 launch).
const PAIRS: Runs = Runs {
    warmup: 10,
    timed: 1000,
};

/// `rope-demo`: every variant, then the head-to-head and the accuracy table;
/// `rope-demo --head-to-head`: the head-to-head alone (no checks, for repeated runs).
fn main() -> Result<()> {
    let head_to_head_only = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--head-to-head") => true,
        Some(_) => anyhow::bail!("usage: rope-demo [--head-to-head]"),
    };
    match BenchDevice::open() {
        Ok(gpu) => gpu_demo(gpu, head_to_head_only),
        Err(rope_bench_support::Error::NoDevice(e)) => {
            println!("no GPU: {e}");
            println!("running the CPU reference path only");
            cpu_demo()
        }
        Err(e) => Err(e.into()),
    }
}

/// The demo's shape as an f32 NeoX case with in-kernel sin/cos, in place: the template of
/// every variant and of the CPU check.
fn base_case() -> Case {
    let (batch, seq, heads, head_dim) = SHAPE;
    Case {
        style: RopeStyle::Neox,
        direction: Direction::Forward,
        dtype: DTypeCase::F32,
        batch,
        seq,
        heads,
        head_dim,
        rotary_dim: head_dim,
        rotary_offset: 0,
        layout: LayoutKind::Bshd,
        k: KCase::None,
        source: Source::Theta(THETA),
        positions: PosCase::Offset(0),
        in_place: true,
        seed: 2026,
    }
}

/// The demo's variants: every style, sin/cos source, position kind and in/out of place in
/// f32, then bf16 forms users run (fused q+k with GQA, partial rotary, combined cache).
fn variants() -> Vec<Case> {
    let (batch, seq, _, _) = SHAPE;
    let base = base_case();
    let table = table_source();
    // Explicit ids equal to the implicit positions.
    let ids = PosCase::Ids {
        ids: (0..batch * seq).map(|t| (t % seq) as i64).collect(),
        wide: true,
        shape: IdsShape::PerRow,
    };
    let mut out = Vec::new();
    for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
        for source in [table, Source::Theta(THETA)] {
            for positions in [PosCase::Offset(0), ids.clone()] {
                for in_place in [true, false] {
                    out.push(Case {
                        style,
                        source,
                        positions: positions.clone(),
                        in_place,
                        ..base.clone()
                    });
                }
            }
        }
    }
    let bf16 = Case {
        dtype: DTypeCase::BF16,
        ..base
    };
    for source in [table, Source::Theta(THETA)] {
        out.push(Case {
            source,
            ..bf16.clone()
        });
        out.push(Case {
            source,
            k: KCase::Packed {
                heads: 8,
                v_heads: 8,
            },
            ..bf16.clone()
        });
        out.push(Case {
            source,
            k: KCase::Separate { heads: 8 },
            in_place: false,
            ..bf16.clone()
        });
        out.push(Case {
            source,
            rotary_dim: 64,
            ..bf16.clone()
        });
    }
    let cache = Source::Table {
        theta: THETA,
        max_position: seq,
        format: TableFormat::Combined,
        in_f32: false,
    };
    out.push(Case {
        source: cache,
        ..bf16.clone()
    });
    out.push(Case {
        direction: Direction::Backward,
        in_place: false,
        ..bf16
    });
    out
}

/// Separate cos and sin tables covering the demo's positions.
fn table_source() -> Source {
    Source::Table {
        theta: THETA,
        max_position: SHAPE.1,
        format: TableFormat::Separate,
        in_f32: false,
    }
}

fn describe(c: &Case) -> String {
    let k = match c.k {
        KCase::None => String::new(),
        KCase::Separate { heads } => format!("+k{heads}"),
        KCase::Packed { heads, .. } => format!("+k{heads} qkv"),
    };
    let partial = if c.rotary_dim < c.head_dim {
        format!(" r{}", c.rotary_dim)
    } else {
        String::new()
    };
    format!(
        "{:<4} {:<11} {:<9} {:<8} {:<9} {:<3}{}",
        format!("{:?}", c.dtype).to_lowercase(),
        format!("{:?}{partial}", c.style).to_lowercase(),
        match c.source {
            Source::Table {
                format: TableFormat::Combined,
                ..
            } => "cache",
            Source::Table { .. } => "table",
            Source::Theta(_) => "computed",
        },
        match c.positions {
            PosCase::Ids { .. } => "ids i64",
            _ => "implicit",
        },
        format!(
            "{}{}",
            if c.in_place { "inplace" } else { "outplace" },
            if c.direction == Direction::Backward {
                " bwd"
            } else {
                ""
            }
        ),
        k,
        "",
    )
}

/// Checks one variant against the reference and times it against a copy of the bytes it moves.
fn run_variant<T: TestElem>(case: &Case, gpu: &mut BenchDevice) -> Result<(String, bool)> {
    let mut dev = case.upload::<T>(&gpu.stream)?;
    let check = dev.check(&gpu.rope, &gpu.stream);
    let elems = case.touched_elems();
    let bytes = 2.0 * (elems * size_of::<T>()) as f64;
    let copy_src = gpu.stream.alloc_zeros::<T>(elems)?;
    let mut copy_dst = gpu.stream.alloc_zeros::<T>(elems)?;
    let rope_ms = median_ms(&gpu.ctx, &gpu.stream, RUNS, Some(&mut gpu.flush), || {
        dev.launch(&gpu.rope)
    })?;
    let copy_ms = gpu.copy_ms(RUNS, &copy_src, &mut copy_dst)?;
    let (ok, verdict) = match &check {
        Ok(c) => (true, format!("ok, max err {:.2e}", c.max_abs_err)),
        Err(e) => (false, format!("FAILED: {e}")),
    };
    Ok((
        format!(
            "{} {:>9.1} {:>8.0} {:>9.1} {:>7.1}%  {verdict}",
            describe(case),
            rope_ms * 1e3,
            bytes / (rope_ms * 1e-3) / 1e9,
            copy_ms * 1e3,
            100.0 * copy_ms / rope_ms,
        ),
        ok,
    ))
}

fn gpu_demo(mut gpu: BenchDevice, head_to_head_only: bool) -> Result<()> {
    let (batch, seq, heads, head_dim) = SHAPE;
    println!(
        "device: {}; shape [batch {batch}, seq {seq}, heads {heads}, head_dim {head_dim}], theta {THETA}",
        gpu.ctx.name()?
    );
    if head_to_head_only {
        return head_to_head(&mut gpu);
    }
    for r in gpu.rope.resources()? {
        if r.name.starts_with("rope_") && !r.name.starts_with("rope_fused") {
            println!(
                "{:<32} {:>3} registers, {} bytes local memory",
                r.name, r.registers, r.local_bytes
            );
        }
    }
    println!(
        "timings: median of {} event-timed launches after {} warm-up, L2 flushed before each \
         (the rotated tensors would otherwise stay in the 50 MiB L2 from one launch to the next)",
        RUNS.timed, RUNS.warmup
    );
    let mut rows = Vec::new();
    let mut failures = 0;
    for case in variants() {
        let (row, ok) = with_elem!(case.dtype, T => run_variant::<T>(&case, &mut gpu))?;
        failures += usize::from(!ok);
        rows.push(row);
    }
    println!();
    println!(
        "{:<4} {:<11} {:<9} {:<8} {:<13} {:>9} {:>8} {:>9} {:>8}  check",
        "type", "style", "sincos", "position", "io", "rope µs", "GB/s", "copy µs", "vs copy"
    );
    for r in &rows {
        println!("{r}");
    }
    anyhow::ensure!(
        failures == 0,
        "{failures} variants disagree with the reference"
    );
    head_to_head(&mut gpu)?;
    accuracy_table(&gpu)?;
    decode_in_a_graph(&gpu)
}

/// A serving loop's decode step per launch, eager and in a 100-launch CUDA graph, next to a
/// copy of the same bytes ([`rope_bench_support::decode`]).
fn decode_in_a_graph(gpu: &BenchDevice) -> Result<()> {
    let rows = rope_bench_support::decode::decode_in_graphs(gpu.ctx.ordinal())?;
    println!();
    println!("decode b64 s1, 32 q + 8 k heads, d128, bf16, in place, NeoX: µs per launch");
    println!("{:<28} {:>8} {:>8}", "", "eager", "graph");
    for r in rows {
        println!("{:<28} {:>8.2} {:>8.2}", r.variant, r.eager_us, r.graph_us);
    }
    Ok(())
}

/// Every in-kernel variant against the same variant reading tables, on the same buffers and
/// launched alternately ([`BenchDevice::paired_sources_ms`]). The table above times each
/// variant on buffers of its own; where the buffers lie in device memory moves a launch's time
/// by up to 4% on an H200 (docs/perf/log.md, "table and in-kernel paths timed on the same
/// buffers"), so rows of that table differ by placement as well as by kernel.
///
/// Each row gives the median ratio computed / table over the pairs with its 95% interval
/// ([`median_interval`]) and a verdict: "faster" when the interval lies below 1, "slower" when
/// it lies above 1, "level" when it holds 1 (no difference the pairs can resolve).
fn head_to_head(gpu: &mut BenchDevice) -> Result<()> {
    println!();
    println!(
        "in-kernel sin/cos against the table on the same buffers: {} pairs of launches timed \
         back to back after {} warm-up pairs, L2 flushed before each; ratio = computed / table \
         per pair, median with its 95% interval",
        PAIRS.timed, PAIRS.warmup
    );
    println!(
        "{:<4} {:<11} {:<8} {:<13} {:>9} {:>12} {:>7}  {:<13} {:<13} verdict",
        "type",
        "style",
        "position",
        "io",
        "table µs",
        "computed µs",
        "ratio",
        "95% interval",
        "quartiles"
    );
    for computed in variants()
        .into_iter()
        .filter(|c| matches!(c.source, Source::Theta(_)))
    {
        let sources = [table_source(), computed.source];
        let table = Case {
            source: sources[0],
            ..computed.clone()
        };
        let pairs = with_elem!(computed.dtype, T => time_pair::<T>(&table, sources, gpu))?;
        let [_, table_ms, _] = quartiles(pairs.iter().map(|p| p[0]).collect());
        let [_, computed_ms, _] = quartiles(pairs.iter().map(|p| p[1]).collect());
        let ratios: Vec<f64> = pairs.iter().map(|p| p[1] / p[0]).collect();
        let [q1, _, q3] = quartiles(ratios.clone());
        let [lo, ratio, hi] = median_interval(ratios);
        let verdict = if hi < 1.0 {
            "faster"
        } else if lo > 1.0 {
            "slower"
        } else {
            "level"
        };
        // The variant's description without its sin/cos column, which names one side only.
        let row = describe(&computed).replacen("computed  ", "", 1);
        println!(
            "{row} {:>9.1} {:>12.1} {ratio:>7.4}  {lo:.4}-{hi:.4} {q1:.3}-{q3:.3}   {verdict}",
            table_ms * 1e3,
            computed_ms * 1e3,
        );
    }
    Ok(())
}

/// Uploads `table` (a case reading tables) and times it with each of `sources` in turn on
/// those buffers, alternately; milliseconds per pair, in the order of `sources`.
fn time_pair<T: TestElem>(
    table: &Case,
    sources: [Source; 2],
    gpu: &mut BenchDevice,
) -> Result<Vec<[f64; 2]>> {
    let mut dev = table.upload::<T>(&gpu.stream)?;
    Ok(gpu.paired_sources_ms(PAIRS, &mut dev, sources)?)
}

/// Max abs error of f32 outputs against f64 at long positions, for the accurate in-kernel path,
/// the usual f32 table `cos(f32(p) * f32(inv_freq))` and the f32-compatible in-kernel mode.
fn accuracy_table(gpu: &BenchDevice) -> Result<()> {
    let BenchDevice { stream, rope, .. } = gpu;
    let (seq, heads, d) = (1024usize, 4usize, 128usize);
    let layout = Layout::shd(seq, heads, d);
    // x ~ N(0, 1) by Box-Muller over a fixed sequence.
    let x: Vec<f32> = (0..seq * heads * d)
        .map(|i| {
            let u1 = ((i as u64 * 2_654_435_761 % 1_000_003) as f64 + 0.5) / 1_000_003.0;
            let u2 = ((i as u64 * 40_503 % 999_983) as f64 + 0.5) / 999_983.0;
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect();
    let x64 = gather(&x, &layout);
    let exact = FrequencySpec::new(THETA, d as u32);
    let compat = rope.frequencies(&exact.clone().angle(AngleMode::F32Compat))?;
    println!();
    println!(
        "accuracy, NeoX, theta {THETA}, head_dim {d}, x ~ N(0,1): max abs error of f32 outputs vs f64"
    );
    println!(
        "{:>10} {:>14} {:>18} {:>16}",
        "positions", "in-kernel", "usual f32 table", "f32-compat mode"
    );
    for band in [4096usize, 131_072, 1_048_576, 4_194_304] {
        let ids: Vec<i64> = (0..seq as i64)
            .map(|s| {
                if s == 0 {
                    band as i64 - 1
                } else {
                    (s * 2_654_435_761) % band as i64
                }
            })
            .collect();
        let table = rope.build_tables_for::<f32>(&compat, band, TableFormat::Separate)?;
        let want = rope_reference::reference::rope(
            x64.view(),
            ndarray::Array2::from_shape_vec((1, seq), ids.clone())?.view(),
            RopeStyle::Neox,
            Direction::Forward,
            &rope_reference::reference::RefSinCos::Theta(THETA),
        );
        let mut errors = Vec::new();
        for sincos in [
            SinCos::Computed { theta: THETA },
            table.sincos(),
            SinCos::Frequencies(&compat),
        ] {
            let out = rotate_f32_at(
                rope,
                stream,
                RopeStyle::Neox,
                &x,
                (seq, heads, d),
                &ids,
                sincos,
            )?;
            let got = gather(&out, &layout);
            errors.push((&got - &want).iter().fold(0.0f64, |m, v| m.max(v.abs())));
        }
        println!(
            "{:>10} {:>14.2e} {:>18.2e} {:>16.2e}",
            band, errors[0], errors[1], errors[2]
        );
    }
    Ok(())
}

/// Without a GPU: the reference on a small shape, and the kernels' own cos/sin against it.
fn cpu_demo() -> Result<()> {
    let mut worst = 0.0f64;
    for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
        let (seq, heads, head_dim) = (64, 4, 128);
        let case = Case {
            style,
            seq,
            heads,
            source: Source::Theta(THETA),
            positions: PosCase::Offset(100_000),
            ..base_case()
        };
        let layout = Layout::bshd(1, seq, heads, head_dim);
        let x: Vec<f32> = (0..layout.span().unwrap_or(0))
            .map(|i| ((i * 7919) % 1000) as f32 / 125.0 - 4.0)
            .collect();
        let want = rope_reference::reference::rope(
            gather(&x, &layout).view(),
            case.resolved_positions().view(),
            style,
            Direction::Forward,
            &rope_reference::reference::RefSinCos::Theta(THETA),
        );
        // The CPU stand-in for the kernel: the kernels' math crate, pair by pair.
        let freqs = rope_host::inv_freq(THETA, case.head_dim as u32);
        let mut got = x.clone();
        for t in 0..case.seq {
            for h in 0..case.heads {
                for (i, &f) in freqs.iter().enumerate() {
                    let (c, s) = rope_kernels::math::rope_cos_sin(100_000 + t as i64, f);
                    let (ia, ib) = rope_reference::reference::pair(style, i, case.head_dim);
                    let base = (t * case.heads + h) * case.head_dim;
                    let (y0, y1) = rope_kernels::math::rotate(x[base + ia], x[base + ib], c, s);
                    got[base + ia] = y0;
                    got[base + ib] = y1;
                }
            }
        }
        let cmp = compare::<f32>(
            &case,
            &gather(&x, &layout),
            &gather(&got, &layout),
            &want,
            heads,
        )
        .map_err(anyhow::Error::msg)
        .context("CPU check")?;
        println!(
            "{style:?}: kernel math on the CPU vs f64 reference, max abs error {:.2e}",
            cmp.max_abs_err
        );
        worst = worst.max(cmp.max_abs_err);
    }
    println!("CPU reference path ok (max abs error {worst:.2e}); run on a GPU machine for timings");
    Ok(())
}
