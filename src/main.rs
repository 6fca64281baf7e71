//! `cargo run --release`: every RoPE variant on a realistic shape, checked against the f64
//! reference and timed against a device-to-device copy of the same bytes in the same run.
//!
//! Without a GPU it says so, runs the CPU reference path on a small shape, and exits 0.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{Context, Result};
use ndarray::Array4;
use rope_host::cudarc::driver::{CudaContext, CudaStream, sys::CUevent_flags};
use rope_host::{Direction, IdsShape, Rope, RopeStyle, open_device};
use rope_tests::case::{Case, PosCase, Source, compare};

/// Llama-style prefill: batch 1, 8192 tokens, 32 heads of 128.
const SHAPE: (usize, usize, usize, usize) = (1, 8192, 32, 128);
const THETA: f64 = 500_000.0;
const WARMUP: usize = 5;
const TIMED: usize = 50;

fn main() -> Result<()> {
    match open_device(0) {
        Ok(ctx) => gpu_demo(ctx),
        Err(e) => {
            println!("no GPU: {e}");
            println!("running the CPU reference path only");
            cpu_demo()
        }
    }
}

/// One demo variant.
fn variants() -> Vec<Case> {
    let (batch, seq, heads, head_dim) = SHAPE;
    let mut out = Vec::new();
    for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
        for table in [true, false] {
            for ids in [false, true] {
                for in_place in [true, false] {
                    // Explicit ids equal the implicit positions, so both kinds share a reference.
                    let positions = if ids {
                        PosCase::Ids {
                            ids: (0..batch * seq).map(|t| (t % seq) as i64).collect(),
                            wide: true,
                            shape: IdsShape::PerRow,
                        }
                    } else {
                        PosCase::Offset(0)
                    };
                    let source = if table {
                        Source::Table {
                            theta: THETA,
                            max_position: seq,
                        }
                    } else {
                        Source::Theta(THETA)
                    };
                    out.push(Case {
                        style,
                        direction: Direction::Forward,
                        batch,
                        seq,
                        heads,
                        head_dim,
                        source,
                        positions,
                        in_place,
                        seed: 2026,
                    });
                }
            }
        }
    }
    out
}

fn describe(c: &Case) -> String {
    format!(
        "{:<11} {:<8} {:<10} {:<8}",
        match c.style {
            RopeStyle::Interleaved => "interleaved",
            RopeStyle::Neox => "neox",
        },
        match c.source {
            Source::Table { .. } => "table",
            Source::Theta(_) => "computed",
        },
        match c.positions {
            PosCase::Ids { .. } => "ids i64",
            _ => "implicit",
        },
        if c.in_place { "inplace" } else { "outplace" },
    )
}

/// Median of event-timed runs of `f`, in milliseconds.
fn time_ms(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..WARMUP {
        f()?;
    }
    let mut times = Vec::with_capacity(TIMED);
    for _ in 0..TIMED {
        let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        start.record(stream)?;
        f()?;
        end.record(stream)?;
        end.synchronize()?;
        times.push(start.elapsed_ms(&end)? as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[TIMED / 2])
}

fn gpu_demo(ctx: Arc<CudaContext>) -> Result<()> {
    let stream = ctx.new_stream()?;
    let rope = Rope::new(stream.clone())?;
    let (batch, seq, heads, head_dim) = SHAPE;
    println!(
        "device: {}; shape [batch {batch}, seq {seq}, heads {heads}, head_dim {head_dim}] f32, theta {THETA}",
        ctx.name()?
    );
    for r in rope.resources()? {
        println!(
            "{:<26} {:>3} registers, {} bytes local memory",
            r.name, r.registers, r.local_bytes
        );
    }
    let n = batch * seq * heads * head_dim;
    let bytes = 2.0 * (n * 4) as f64; // one read and one write of the tensor
    let copy_src = stream.alloc_zeros::<f32>(n)?;
    let mut copy_dst = stream.alloc_zeros::<f32>(n)?;

    let mut references: HashMap<String, Array4<f64>> = HashMap::new();
    let mut rows = Vec::new();
    let mut failures = 0;
    let x = variants()[0].input();
    for case in variants() {
        let key = format!("{:?} {:?}", case.style, case.source);
        let want = references.entry(key).or_insert_with(|| case.reference(&x));
        let mut dev = case.upload(&stream)?;
        dev.launch(&rope)?;
        let got = dev.result(&stream)?;
        let check = compare(&case, &x, &got, want.view());
        let rope_ms = time_ms(&ctx, &stream, || Ok(dev.launch(&rope)?))?;
        let copy_ms = time_ms(&ctx, &stream, || {
            Ok(stream.memcpy_dtod(&copy_src, &mut copy_dst)?)
        })?;
        let verdict = match &check {
            Ok(c) => format!("ok, max err {:.2e}", c.max_abs_err),
            Err(e) => {
                failures += 1;
                format!("FAILED: {e}")
            }
        };
        rows.push(format!(
            "{} {:>9.1} {:>8.0} {:>9.1} {:>7.1}%  {verdict}",
            describe(&case),
            rope_ms * 1e3,
            bytes / (rope_ms * 1e-3) / 1e9,
            copy_ms * 1e3,
            100.0 * copy_ms / rope_ms,
        ));
    }
    println!();
    println!(
        "{:<11} {:<8} {:<10} {:<8} {:>9} {:>8} {:>9} {:>8}  check",
        "style", "sincos", "positions", "io", "rope µs", "GB/s", "copy µs", "vs copy"
    );
    for r in &rows {
        println!("{r}");
    }
    anyhow::ensure!(
        failures == 0,
        "{failures} variants disagree with the reference"
    );
    Ok(())
}

/// Without a GPU: the reference on a small shape, and the kernels' own cos/sin against it.
fn cpu_demo() -> Result<()> {
    let mut worst = 0.0f64;
    for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
        let case = Case {
            style,
            direction: Direction::Forward,
            batch: 1,
            seq: 64,
            heads: 4,
            head_dim: 128,
            source: Source::Theta(THETA),
            positions: PosCase::Offset(100_000),
            in_place: false,
            seed: 1,
        };
        let x = case.input();
        let want = case.reference(&x);
        // The CPU stand-in for the kernel: the kernels' math crate, pair by pair.
        let freqs = rope_host::inv_freq(THETA, case.head_dim as u32);
        let mut got = x.clone();
        for t in 0..case.seq {
            for h in 0..case.heads {
                for (i, &f) in freqs.iter().enumerate() {
                    let (c, s) = kernels_gpu::math::rope_cos_sin(100_000 + t as i64, f);
                    let (ia, ib) = rope_tests::reference::pair(style, i, case.head_dim);
                    let base = (t * case.heads + h) * case.head_dim;
                    let (y0, y1) = kernels_gpu::math::rotate(x[base + ia], x[base + ib], c, s);
                    got[base + ia] = y0;
                    got[base + ib] = y1;
                }
            }
        }
        let cmp = compare(&case, &x, &got, want.view())
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
