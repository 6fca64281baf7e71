//! Long-context accuracy of the in-kernel sin/cos, the f32-compatible angle mode (with
//! frequencies given by the caller), and the scaling families on the GPU.

use std::sync::Arc;

use ndarray::Array4;
use proptest::prelude::*;
use rope_harness::case::{
    Case, DTypeCase, KCase, LayoutKind, PosCase, Source, compare, run_and_check,
};
use rope_host::cudarc::driver::CudaStream;
use rope_host::{
    AngleMode, Direction, FrequencySpec, IdsShape, InvFreq, Rope, RopeScaling, RopeStyle, SinCos,
    TableData, TableFormat, Yarn,
};
use rope_reference::reference::{self, RefSinCos};
use rope_tests::gpu::gpu_or_skip;

use super::super::{random_x, report, runner, ulps_apart};

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
                    rotary_offset: 0,
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

/// Runs one f32 rotation; see [`rope_harness::rotate::rotate_f32_at`].
fn rotate(
    rope: &Rope,
    stream: &Arc<CudaStream>,
    style: RopeStyle,
    x: &[f32],
    dims: (usize, usize, usize),
    ids: &[i64],
    sincos: SinCos<'_, f32>,
) -> Vec<f32> {
    rope_harness::rotate::rotate_f32_at(rope, stream, style, x, dims, ids, sincos)
        .expect("rotation")
}

/// The kernels' math run on the CPU: `x`, a `[seq, heads, d]` f32 tensor, rotated forward over
/// all `d` features at `ids` with frequencies `f`, attention factor `scale` and angle mode
/// `angle`, through `rope_kernels::math` (the same IEEE operations in the same order).
fn cpu_emulation(
    style: RopeStyle,
    x: &[f32],
    (seq, heads, d): (usize, usize, usize),
    ids: &[i64],
    (f, scale, angle): (&[f64], f64, AngleMode),
) -> Vec<f32> {
    assert_eq!(ids.len(), seq);
    let mut out = x.to_vec();
    for (s, &p) in ids.iter().enumerate() {
        for h in 0..heads {
            for (i, &fi) in f.iter().enumerate() {
                let (c, sn) = rope_kernels::math::rope_cos_sin_mode(p, fi, angle);
                let (c, sn) = (c * scale as f32, sn * scale as f32);
                let (ia, ib) = reference::pair(style, i, d);
                let base = (s * heads + h) * d;
                let (y0, y1) = rope_kernels::math::rotate(x[base + ia], x[base + ib], c, sn);
                out[base + ia] = y0;
                out[base + ib] = y1;
            }
        }
    }
    out
}

/// Whether `a` and `b` hold the same bits everywhere.
fn bit_identical(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
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
                .scaling(RopeScaling::Yarn(Yarn::new(4.0, 8192)))
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
            let want = cpu_emulation(style, &x, (seq, heads, d), &ids, (&f, scale, angle));
            assert!(
                bit_identical(&got, &want),
                "{style:?} {angle:?}: GPU and CPU emulation differ"
            );
        }
    }
}

/// A model's own f32 frequencies (Hugging Face computes `inv_freq` in f32, and about a third of
/// its entries are not the f32 nearest the exact value) through `Rope::frequencies_from` with
/// `AngleMode::F32Compat`: rotations are bit-identical to the CPU emulation with that vector
/// widened to f64, whose angles are the model's f32 angles `f32(p) * inv_freq[i]` exactly (the
/// CPU test `given_frequencies` proves that for every pair at 4097 positions); the tables built
/// from it are the f32-angle tables to within one ulp, equal but for near-ties of the rounding
/// of cos/sin, while tables from the correctly rounded frequencies are many ulps away from them.
/// An f64 vector gives what the `FrequencySpec` of the same frequencies gives.
#[test]
fn given_f32_frequencies_reproduce_the_models_f32_angles() {
    let Some((stream, rope)) = gpu_or_skip("given_f32_frequencies_reproduce_the_models_f32_angles")
    else {
        return;
    };
    let (theta, seq, heads, d) = (500_000.0f32, 257, 4, 128);
    let hf = reference::hf_inv_freq(theta, d);
    let widened: Vec<f64> = hf.iter().map(|&v| f64::from(v)).collect();
    let x: Vec<f32> = random_x(29, (1, seq, heads, d))
        .iter()
        .map(|&v| v as f32)
        .collect();
    let ids: Vec<i64> = (0..seq as i64).map(|s| s * 8191 + 5).collect();
    for (style, attention) in [
        (RopeStyle::Interleaved, 1.0),
        (RopeStyle::Neox, 1.0),
        (RopeStyle::Neox, 1.19),
    ] {
        let freqs = rope
            .frequencies_from(InvFreq::F32(&hf), attention, AngleMode::F32Compat)
            .expect("valid");
        assert_eq!(freqs.rotary_dim(), d as u32);
        assert_eq!(freqs.attention_factor(), attention);
        let got = rotate(
            &rope,
            &stream,
            style,
            &x,
            (seq, heads, d),
            &ids,
            SinCos::Frequencies(&freqs),
        );
        let want = cpu_emulation(
            style,
            &x,
            (seq, heads, d),
            &ids,
            (&widened, attention, AngleMode::F32Compat),
        );
        assert!(
            bit_identical(&got, &want),
            "{style:?}, attention factor {attention}: GPU and CPU emulation differ"
        );
    }

    // Tables over positions 0..2^15 against cos/sin of the f32 angle, computed on the host.
    let rows = 1usize << 15;
    let positions: Vec<i64> = (0..rows as i64).collect();
    let (want_cos, want_sin) = reference::f32_angle_tables(&hf, &positions);
    let download = |freqs: &rope_host::Frequencies| -> (Vec<f32>, Vec<f32>) {
        let t = rope
            .build_tables_for::<f32>(freqs, rows, TableFormat::Separate)
            .expect("valid");
        match t.data() {
            TableData::Separate { cos, sin } => (
                stream.clone_dtoh(cos).expect("download"),
                stream.clone_dtoh(sin).expect("download"),
            ),
            TableData::Combined(_) => unreachable!("separate tables were built"),
        }
    };
    // (entries one ulp apart, most ulps apart) from the f32-angle tables.
    let distance = |(cos, sin): (Vec<f32>, Vec<f32>)| {
        let mut one = 0usize;
        let mut most = 0u64;
        for (got, want) in cos.iter().zip(&want_cos).chain(sin.iter().zip(&want_sin)) {
            let u = ulps_apart(*got, *want);
            one += usize::from(u == 1);
            most = most.max(u);
        }
        (one, most)
    };
    let given = rope
        .frequencies_from(InvFreq::F32(&hf), 1.0, AngleMode::F32Compat)
        .expect("valid");
    let (one, most) = distance(download(&given));
    let total = 2 * rows * d / 2;
    report(&format!(
        "GPU tables from the model's f32 frequencies vs f32-angle tables: {one} of {total} \
         entries one ulp apart, none further"
    ));
    assert!(most <= 1, "an entry {most} ulps from the f32-angle table");
    assert!(
        one * 1000 <= total,
        "{one} of {total} entries one ulp apart"
    );
    let rounded = rope
        .frequencies(&FrequencySpec::new(f64::from(theta), d as u32).angle(AngleMode::F32Compat))
        .expect("valid");
    let (_, most_rounded) = distance(download(&rounded));
    report(&format!(
        "GPU tables from the correctly rounded frequencies: up to {most_rounded} ulps from the \
         f32-angle tables"
    ));
    assert!(
        most_rounded > 1,
        "the correctly rounded vector gave the same tables"
    );

    // An f64 vector is the vector a spec uploads.
    let spec = FrequencySpec::new(f64::from(theta), d as u32);
    let (f, _) = spec.build().expect("valid");
    let from_vector = rope
        .frequencies_from(InvFreq::F64(&f), 1.0, AngleMode::Exact)
        .expect("valid");
    let from_spec = rope.frequencies(&spec).expect("valid");
    let run = |freqs| {
        rotate(
            &rope,
            &stream,
            RopeStyle::Neox,
            &x,
            (seq, heads, d),
            &ids,
            SinCos::Frequencies(freqs),
        )
    };
    assert!(bit_identical(&run(&from_vector), &run(&from_spec)));
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
            max_position_embeddings: 4096,
            seq_len: 16384,
        },
        RopeScaling::DynamicNtkAlpha { alpha: 1000.0 },
        RopeScaling::Yarn(Yarn::new(16.0, 4096)),
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        },
        RopeScaling::LongRope {
            short_factor: (0..d / 2).map(|i| 1.0 + i as f64 / 64.0).collect(),
            long_factor: (0..d / 2).map(|i| 1.0 + i as f64 / 8.0).collect(),
            factor: None,
            original_max_position_embeddings: 4096,
            max_position_embeddings: 131_072,
            seq_len: 100_000,
            attention_factor: None,
        },
        RopeScaling::LongRope {
            short_factor: (0..d / 2).map(|i| 1.0 + i as f64 / 64.0).collect(),
            long_factor: (0..d / 2).map(|i| 1.0 + i as f64 / 8.0).collect(),
            factor: Some(16.0),
            original_max_position_embeddings: 8192,
            max_position_embeddings: 8192,
            seq_len: 100_000,
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
                rotary_offset: 0,
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
        RopeScaling::Axial { .. } => "axial",
        RopeScaling::DynamicNtkAlpha { .. } => "dynamic NTK alpha",
        RopeScaling::Linear { .. } => "linear",
        RopeScaling::DynamicNtk { .. } => "dynamic NTK",
        RopeScaling::Proportional { .. } => "proportional (Gemma 4)",
        RopeScaling::Ntk { mixed_b: None, .. } => "NTK",
        RopeScaling::Ntk {
            mixed_b: Some(_), ..
        } => "NTK with mixed_b",
        RopeScaling::Yarn(_) => "YaRN",
        RopeScaling::Llama3 { .. } => "Llama 3.1",
        RopeScaling::LongRope { factor: None, .. } => "LongRoPE",
        RopeScaling::LongRope {
            factor: Some(_), ..
        } => "LongRoPE with factor",
    }
}
