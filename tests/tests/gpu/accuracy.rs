//! Long-context accuracy of the in-kernel sin/cos, the f32-compatible angle mode, and the
//! scaling families on the GPU.

use std::sync::Arc;

use ndarray::Array4;
use proptest::prelude::*;
use rope_host::cudarc::driver::CudaStream;
use rope_host::{
    AngleMode, Direction, FrequencySpec, IdsShape, Rope, RopeScaling, RopeStyle, SinCos, Yarn,
};
use rope_reference::case::{
    Case, DTypeCase, KCase, LayoutKind, PosCase, Source, compare, run_and_check,
};
use rope_reference::reference::{self, RefSinCos};
use rope_tests::gpu::gpu_or_skip;

use super::super::{random_x, report, runner};

/// Positions up to 2^22 and theta up to 10^7: every f32 output within the f32 tolerance of the
/// f64 reference, so cos/sin stay accurate where an f32 angle would be off by radians.
#[test]
fn in_kernel_sin_cos_is_accurate_to_position_2_pow_22() {
    let Some((stream, rope)) = gpu_or_skip("in_kernel_sin_cos_is_accurate_to_position_2_pow_22")
    else {
        return;
    };
    runner(96)
        .run(
            &(
                any::<bool>(),
                1e4f64..1e7,
                1usize..=64,
                proptest::collection::vec(0i64..(1 << 22), 64),
                any::<u64>(),
            ),
            |(neox, theta, half, mut ids, seed)| {
                ids[0] = (1 << 22) - 1;
                let case = Case {
                    style: if neox {
                        RopeStyle::Neox
                    } else {
                        RopeStyle::Interleaved
                    },
                    direction: Direction::Forward,
                    dtype: DTypeCase::F32,
                    batch: 1,
                    seq: 64,
                    heads: 3,
                    head_dim: 2 * half,
                    rotary_dim: 2 * half,
                    layout: LayoutKind::Bshd,
                    k: KCase::None,
                    source: Source::Theta(theta),
                    positions: PosCase::Ids {
                        ids,
                        wide: true,
                        shape: IdsShape::Shared,
                    },
                    in_place: false,
                    seed,
                };
                run_and_check(&case, &rope, &stream)
                    .map_err(|e| TestCaseError::fail(format!("{e}\n{case:?}")))?;
                Ok(())
            },
        )
        .expect("accurate at long positions");
}

/// Runs one f32 rotation; see [`rope_reference::rotate::rotate_f32_at`].
fn rotate(
    rope: &Rope,
    stream: &Arc<CudaStream>,
    style: RopeStyle,
    x: &[f32],
    dims: (usize, usize, usize),
    ids: &[i64],
    sincos: SinCos<'_, f32>,
) -> Vec<f32> {
    rope_reference::rotate::rotate_f32_at(rope, stream, style, x, dims, ids, sincos)
        .expect("rotation")
}

/// The GPU's output is bit-identical to the kernels' math run on the CPU, in both angle modes
/// and with an attention factor: the same IEEE operations, in the same order, without fused
/// multiply-adds.
#[test]
fn gpu_output_is_bit_identical_to_the_cpu_emulation() {
    let Some((stream, rope)) = gpu_or_skip("gpu_output_is_bit_identical_to_the_cpu_emulation")
    else {
        return;
    };
    let (seq, heads, d) = (257, 4, 96);
    let x: Vec<f32> = random_x(3, (1, seq, heads, d))
        .iter()
        .map(|&v| v as f32)
        .collect();
    let ids: Vec<i64> = (0..seq as i64).map(|s| s * 16_411 + 7).collect();
    for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
        for angle in [AngleMode::Exact, AngleMode::F32Compat] {
            let spec = FrequencySpec::new(500_000.0, d as u32)
                .scaling(RopeScaling::Yarn(Yarn::new(4.0, 8192.0)))
                .angle(angle);
            let freqs = rope.frequencies(&spec).expect("valid");
            let got = rotate(
                &rope,
                &stream,
                style,
                &x,
                (seq, heads, d),
                &ids,
                SinCos::Frequencies(&freqs),
            );
            let (f, scale) = spec.build().expect("valid");
            let mut want = x.clone();
            for (s, &p) in ids.iter().enumerate() {
                for h in 0..heads {
                    for (i, &fi) in f.iter().enumerate() {
                        let (c, sn) = kernels_gpu::math::rope_cos_sin_mode(p, fi, angle);
                        let (c, sn) = (c * scale as f32, sn * scale as f32);
                        let (ia, ib) = reference::pair(style, i, d);
                        let base = (s * heads + h) * d;
                        let (y0, y1) = kernels_gpu::math::rotate(x[base + ia], x[base + ib], c, sn);
                        want[base + ia] = y0;
                        want[base + ib] = y1;
                    }
                }
            }
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{style:?} {angle:?}: GPU and CPU emulation differ");
        }
    }
}

/// Every scaling family through `SinCos::Frequencies` against the f64 reference with the
/// family's f64 frequencies and attention factor.
#[test]
fn scaling_families_match_the_reference_on_gpu() {
    let Some((stream, rope)) = gpu_or_skip("scaling_families_match_the_reference_on_gpu") else {
        return;
    };
    let (seq, heads, d) = (64, 4, 128);
    let families = [
        RopeScaling::Default,
        RopeScaling::Linear { factor: 4.0 },
        RopeScaling::DynamicNtk {
            factor: 4.0,
            original_max_position_embeddings: 4096.0,
            seq_len: 16384.0,
        },
        RopeScaling::Yarn(Yarn::new(16.0, 4096.0)),
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        },
        RopeScaling::LongRope {
            short_factor: (0..d / 2).map(|i| 1.0 + i as f64 / 64.0).collect(),
            long_factor: (0..d / 2).map(|i| 1.0 + i as f64 / 8.0).collect(),
            original_max_position_embeddings: 4096.0,
            max_position_embeddings: 131_072.0,
            seq_len: 100_000.0,
            attention_factor: None,
        },
    ];
    let x64 = random_x(17, (1, seq, heads, d));
    let x: Vec<f32> = x64.iter().map(|&v| v as f32).collect();
    let ids: Vec<i64> = (0..seq as i64).map(|s| s * 1999 + 3).collect();
    for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
        for scaling in &families {
            let spec = FrequencySpec::new(500_000.0, d as u32).scaling(scaling.clone());
            let freqs = rope.frequencies(&spec).expect("valid");
            let got = rotate(
                &rope,
                &stream,
                style,
                &x,
                (seq, heads, d),
                &ids,
                SinCos::Frequencies(&freqs),
            );
            let (inv_freq, scale) = spec.build().expect("valid");
            let pos = ndarray::Array2::from_shape_vec((1, seq), ids.clone()).expect("shape");
            let xr = x64.mapv(|v| v as f32 as f64);
            let want = reference::rope(
                xr.view(),
                pos.view(),
                style,
                Direction::Forward,
                &RefSinCos::Frequencies { inv_freq, scale },
            );
            let case = Case {
                style,
                direction: Direction::Forward,
                dtype: DTypeCase::F32,
                batch: 1,
                seq,
                heads,
                head_dim: d,
                rotary_dim: d,
                layout: LayoutKind::Bshd,
                k: KCase::None,
                source: Source::Theta(500_000.0),
                positions: PosCase::Offset(0),
                in_place: false,
                seed: 0,
            };
            // The attention factor scales outputs, so it scales the tolerance too.
            let scaled = |a: &Array4<f64>| a.mapv(|v| v / scale.max(1.0));
            let got =
                Array4::from_shape_vec((1, seq, heads, d), got.iter().map(|&v| v as f64).collect())
                    .expect("shape");
            let cmp = compare::<f32>(&case, &xr, &scaled(&got), &scaled(&want), heads)
                .unwrap_or_else(|e| panic!("{style:?} {scaling:?}: {e}"));
            report(&format!(
                "GPU {style:?} {}: max abs error {:.2e}",
                family_name(scaling),
                cmp.max_abs_err * scale.max(1.0)
            ));
        }
    }
}

fn family_name(s: &RopeScaling) -> &'static str {
    match s {
        RopeScaling::Default => "default",
        RopeScaling::Linear { .. } => "linear",
        RopeScaling::DynamicNtk { .. } => "dynamic NTK",
        RopeScaling::Yarn(_) => "YaRN",
        RopeScaling::Llama3 { .. } => "Llama 3.1",
        RopeScaling::LongRope { .. } => "LongRoPE",
    }
}
