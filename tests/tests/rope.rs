//! Properties of RoPE, one module per property. CPU modules check the f64 reference and the
//! kernels' pure math and always run; `gpu_*` modules run the kernels and print a skip line when
//! no GPU is present (and fail instead under `ROPE_REQUIRE_GPU=1`).

use std::io::Write;

use ndarray::{Array2, Array4, s};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use rope_host::{Direction, RopeStyle};
use rope_reference::reference::{self, RefSinCos};
use rope_tests::strategies;

/// Writes a line past libtest's output capture, so summaries and skips always show.
fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// A proptest runner that keeps no regression files (the bundle runs far from the sources), of
/// `cases` cases or at most `ROPE_GPU_CASES` when that is set (the bundle's sanitizer runs set
/// it: kernels under compute-sanitizer run orders of magnitude slower).
fn runner(cases: u32) -> TestRunner {
    let cap = u32::try_from(rope_tests::gpu::case_cap()).unwrap_or(u32::MAX);
    TestRunner::new(Config {
        cases: cases.min(cap),
        failure_persistence: None,
        ..Config::default()
    })
}

/// Random `[batch, seq, heads, head_dim]` data in `[-4, 4)` from a seed.
fn random_x(seed: u64, shape: (usize, usize, usize, usize)) -> Array4<f64> {
    use rand::{RngExt, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    Array4::from_shape_simple_fn(shape, || rng.random_range(-4.0..4.0))
}

fn sequential_positions(batch: usize, seq: usize, offset: i64) -> Array2<i64> {
    Array2::from_shape_fn((batch, seq), |(_, s)| offset + s as i64)
}

/// How many f32 values lie between `a` and `b`, plus one (0 when they are equal, 1 for
/// neighbours; the two zeros count as one value).
fn ulps_apart(a: f32, b: f32) -> u64 {
    let ordered = |v: f32| {
        let bits = i64::from(v.to_bits() & 0x7fff_ffff);
        if v.is_sign_negative() { -bits } else { bits }
    };
    ordered(a).abs_diff(ordered(b))
}

mod matches_plain_formula {
    use super::*;

    /// The reference equals RoPE written as complex multiplication: pair `(a, b)` is `a + ib`,
    /// rotated by `e^(i angle)` (by `e^(-i angle)` backward).
    #[test]
    fn reference_is_complex_rotation() {
        runner(64)
            .run(
                &(
                    strategies::style(),
                    strategies::direction(),
                    strategies::head_dim(),
                    strategies::theta(),
                    0i64..100_000,
                    any::<u64>(),
                ),
                |(style, direction, d, theta, offset, seed)| {
                    let x = random_x(seed, (2, 3, 2, d));
                    let pos = sequential_positions(2, 3, offset);
                    let y = reference::rope(
                        x.view(),
                        pos.view(),
                        style,
                        direction,
                        &RefSinCos::Theta(theta),
                    );
                    let sign = if direction == Direction::Forward {
                        1.0
                    } else {
                        -1.0
                    };
                    for ((b, s, h, i), _) in x.slice(s![.., .., .., ..d / 2]).indexed_iter() {
                        let angle =
                            sign * pos[[b, s]] as f64 * theta.powf(-2.0 * i as f64 / d as f64);
                        let (ia, ib) = reference::pair(style, i, d);
                        let (re, im) = (x[[b, s, h, ia]], x[[b, s, h, ib]]);
                        let want = (
                            re * angle.cos() - im * angle.sin(),
                            re * angle.sin() + im * angle.cos(),
                        );
                        prop_assert!((y[[b, s, h, ia]] - want.0).abs() < 1e-12);
                        prop_assert!((y[[b, s, h, ib]] - want.1).abs() < 1e-12);
                    }
                    Ok(())
                },
            )
            .expect("the reference is the complex rotation");
    }

    /// The kernels' own cos/sin (`rope_kernels::math`, the code the GPU runs) are within one f32
    /// ulp of the f64 values, or `2^-28` absolute near a zero of cos/sin (where the f64 angle's
    /// own error, about `2^-52 * angle`, dominates), at positions up to 2^22, theta up to 10^7.
    #[test]
    fn kernel_cos_sin_within_one_ulp() {
        runner(2000)
            .run(
                &(0i64..(1 << 22), 1u32..=128, 1.5f64..1.0e7),
                |(p, half, theta)| {
                    let d = 2 * half;
                    for i in [0, half / 3, half / 2, half - 1] {
                        let (c, s) = rope_kernels::math::rope_cos_sin(
                            p,
                            rope_host::inv_freq(theta, d)[i as usize],
                        );
                        let angle = p as f64 * theta.powf(-2.0 * i as f64 / d as f64);
                        for (got, want) in [(c, angle.cos()), (s, angle.sin())] {
                            let tol = (f64::from(f32::EPSILON) * want.abs()).max(2f64.powi(-28));
                            prop_assert!(
                                (f64::from(got) - want).abs() <= tol,
                                "p={p} i={i} d={d} theta={theta}: {got} vs {want}"
                            );
                        }
                    }
                    Ok(())
                },
            )
            .expect("kernel cos/sin within one ulp");
    }
}

mod norm_preserved {
    use super::*;

    /// Each pair keeps its Euclidean norm, for both styles and both sources.
    #[test]
    fn every_pair_keeps_its_norm() {
        runner(64)
            .run(
                &(
                    strategies::style(),
                    strategies::direction(),
                    strategies::head_dim(),
                    strategies::theta(),
                    any::<u64>(),
                    any::<bool>(),
                ),
                |(style, direction, d, theta, seed, table)| {
                    let x = random_x(seed, (1, 5, 3, d));
                    let pos = sequential_positions(1, 5, 7);
                    let src = if table {
                        let (cos, sin) = reference::tables(theta, d, 12);
                        RefSinCos::Table { cos, sin }
                    } else {
                        RefSinCos::Theta(theta)
                    };
                    let y = reference::rope(x.view(), pos.view(), style, direction, &src);
                    for ((b, s, h, i), _) in x.slice(s![.., .., .., ..d / 2]).indexed_iter() {
                        let (ia, ib) = reference::pair(style, i, d);
                        let before = x[[b, s, h, ia]].hypot(x[[b, s, h, ib]]);
                        let after = y[[b, s, h, ia]].hypot(y[[b, s, h, ib]]);
                        prop_assert!((before - after).abs() <= 1e-12 * before.max(1.0));
                    }
                    Ok(())
                },
            )
            .expect("norms preserved");
    }
}

mod relative_position {
    use super::*;

    /// `<rope(q, m), rope(k, n)>` depends only on `m - n`: shifting both positions by `t`
    /// leaves every head's dot product unchanged.
    #[test]
    fn dot_product_depends_only_on_the_offset() {
        runner(64)
            .run(
                &(
                    strategies::style(),
                    strategies::head_dim(),
                    strategies::theta(),
                    0i64..10_000,
                    0i64..10_000,
                    0i64..100_000,
                    any::<u64>(),
                ),
                |(style, d, theta, m, n, t, seed)| {
                    let q = random_x(seed, (1, 1, 4, d));
                    let k = random_x(seed ^ 0x9e37_79b9, (1, 1, 4, d));
                    let src = RefSinCos::Theta(theta);
                    let dot = |pq: i64, pk: i64| -> Vec<f64> {
                        let rq = reference::rope(
                            q.view(),
                            Array2::from_elem((1, 1), pq).view(),
                            style,
                            Direction::Forward,
                            &src,
                        );
                        let rk = reference::rope(
                            k.view(),
                            Array2::from_elem((1, 1), pk).view(),
                            style,
                            Direction::Forward,
                            &src,
                        );
                        (0..4)
                            .map(|h| {
                                (&rq.slice(s![0, 0, h, ..]) * &rk.slice(s![0, 0, h, ..])).sum()
                            })
                            .collect()
                    };
                    for (a, b) in dot(m, n).iter().zip(dot(m + t, n + t)) {
                        prop_assert!((a - b).abs() <= 1e-9 * (d as f64) * 16.0, "{a} vs {b}");
                    }
                    Ok(())
                },
            )
            .expect("relative position property");
    }
}

mod inverse {
    use super::*;

    /// Backward (rotation by -angle) undoes forward (rotation by +angle).
    #[test]
    fn backward_undoes_forward() {
        runner(64)
            .run(
                &(
                    strategies::style(),
                    strategies::head_dim(),
                    strategies::theta(),
                    0i64..1_000_000,
                    any::<u64>(),
                ),
                |(style, d, theta, offset, seed)| {
                    let x = random_x(seed, (2, 4, 3, d));
                    let pos = sequential_positions(2, 4, offset);
                    let src = RefSinCos::Theta(theta);
                    let y = reference::rope(x.view(), pos.view(), style, Direction::Forward, &src);
                    let z = reference::rope(y.view(), pos.view(), style, Direction::Backward, &src);
                    let err = (&z - &x).iter().fold(0.0f64, |m, v| m.max(v.abs()));
                    prop_assert!(err < 1e-12, "round trip error {err}");
                    Ok(())
                },
            )
            .expect("inverse");
    }
}

mod position_zero_is_identity {
    use super::*;

    #[test]
    fn position_zero_leaves_every_element() {
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            let x = random_x(3, (1, 1, 5, 128));
            let y = reference::rope(
                x.view(),
                Array2::zeros((1, 1)).view(),
                style,
                Direction::Forward,
                &RefSinCos::Theta(10_000.0),
            );
            assert_eq!(x, y);
        }
    }
}

mod styles_are_a_permutation {
    use super::*;

    /// Interleaved RoPE equals NeoX RoPE on the input with its pairs moved from `(2i, 2i+1)` to
    /// `(i, i + d/2)`, and the output moved back.
    #[test]
    fn interleaved_is_neox_after_permuting_pairs() {
        let d = 64;
        let x = random_x(11, (1, 6, 3, d));
        let pos = sequential_positions(1, 6, 1234);
        let src = RefSinCos::Theta(10_000.0);
        let to_neox = |a: &Array4<f64>| {
            let mut p = a.clone();
            for i in 0..d / 2 {
                p.slice_mut(s![.., .., .., i])
                    .assign(&a.slice(s![.., .., .., 2 * i]));
                p.slice_mut(s![.., .., .., i + d / 2])
                    .assign(&a.slice(s![.., .., .., 2 * i + 1]));
            }
            p
        };
        let inter = reference::rope(
            x.view(),
            pos.view(),
            RopeStyle::Interleaved,
            Direction::Forward,
            &src,
        );
        let neox = reference::rope(
            to_neox(&x).view(),
            pos.view(),
            RopeStyle::Neox,
            Direction::Forward,
            &src,
        );
        assert_eq!(to_neox(&inter), neox);
    }
}

mod scaling_families {
    //! Each family's builder against the published formula written out per frequency, and the
    //! properties the families are designed to have.
    use std::f64::consts::PI;

    use rope_host::{FrequencySpec, RopeScaling, Yarn};

    use super::*;

    fn build(theta: f64, d: u32, scaling: RopeScaling) -> (Vec<f64>, f64) {
        FrequencySpec::new(theta, d)
            .scaling(scaling)
            .build()
            .expect("valid parameters")
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-13 * a.abs().max(b.abs())
    }

    /// `theta^(-2i/d)`, the default family, written as a reciprocal power.
    fn default_freq(theta: f64, d: u32, i: usize) -> f64 {
        1.0 / theta.powf((2 * i) as f64 / d as f64)
    }

    #[test]
    fn default_and_linear_follow_their_formulas() {
        runner(64)
            .run(
                &(2.0f64..1e7, 1u32..=128, 0.5f64..64.0),
                |(theta, half, factor)| {
                    let d = 2 * half;
                    let (f, a) = build(theta, d, RopeScaling::Default);
                    let (g, b) = build(theta, d, RopeScaling::Linear { factor });
                    prop_assert!(a == 1.0 && b == 1.0);
                    for i in 0..half as usize {
                        prop_assert!(close(f[i], default_freq(theta, d, i)));
                        prop_assert!(close(g[i], default_freq(theta, d, i) / factor));
                    }
                    Ok(())
                },
            )
            .expect("default and linear");
    }

    #[test]
    fn dynamic_ntk_grows_the_base_only_past_the_original_context() {
        runner(64)
            .run(
                &(
                    1e3f64..1e6,
                    2u32..=64,
                    1.0f64..16.0,
                    512u32..8192,
                    0.1f64..8.0,
                ),
                |(theta, half, factor, max, ratio)| {
                    let d = 2 * half;
                    let seq_len = (f64::from(max) * ratio).ceil() as u64;
                    let (f, _) = build(
                        theta,
                        d,
                        RopeScaling::DynamicNtk {
                            factor,
                            max_position_embeddings: max,
                            seq_len,
                        },
                    );
                    let base = if seq_len <= u64::from(max) {
                        theta
                    } else {
                        theta
                            * (factor * seq_len as f64 / f64::from(max) - factor + 1.0)
                                .powf(d as f64 / (d as f64 - 2.0))
                    };
                    for (i, &v) in f.iter().enumerate() {
                        prop_assert!(
                            close(v, default_freq(base, d, i)),
                            "i {i}: {v} vs {}",
                            default_freq(base, d, i)
                        );
                    }
                    Ok(())
                },
            )
            .expect("dynamic NTK");
    }

    #[test]
    fn yarn_extrapolates_fast_dimensions_and_interpolates_slow_ones() {
        runner(64)
            .run(
                &(1e4f64..1e6, 16u32..=128, 2.0f64..64.0, 2048u32..32768),
                |(theta, half, factor, original)| {
                    let d = 2 * half;
                    let (f, attention) =
                        build(theta, d, RopeScaling::Yarn(Yarn::new(factor, original)));
                    let original = f64::from(original);
                    prop_assert!(close(attention, 0.1 * factor.ln() + 1.0));
                    // The correction range in dimensions (floor/ceil), as published in the reference
                    // implementation: dimensions below `low` extrapolate, above `high` interpolate,
                    // linear in the dimension index between.
                    let dim_for = |rotations: f64| {
                        d as f64 * (original / (rotations * 2.0 * PI)).ln() / (2.0 * theta.ln())
                    };
                    let low = dim_for(32.0).floor().max(0.0);
                    let high = dim_for(1.0).ceil().min(d as f64 - 1.0);
                    for (i, &v) in f.iter().enumerate() {
                        let base = default_freq(theta, d, i);
                        let ramp = ((i as f64 - low) / (high - low).max(0.001)).clamp(0.0, 1.0);
                        let want = base * (1.0 - ramp) + base / factor * ramp;
                        prop_assert!(close(v, want), "i {i}: {v} vs {want}");
                        if (i as f64) <= low {
                            prop_assert!(close(v, base));
                        }
                        if (i as f64) >= high {
                            prop_assert!(close(v, base / factor));
                        }
                    }
                    Ok(())
                },
            )
            .expect("YaRN");
        // DeepSeek-style mscale: attention factor is the ratio of the two mscales.
        let y = Yarn {
            mscale: Some(0.707),
            mscale_all_dim: Some(0.707),
            ..Yarn::new(40.0, 4096)
        };
        assert_eq!(build(10_000.0, 64, RopeScaling::Yarn(y)).1, 1.0);
    }

    #[test]
    fn llama3_keeps_high_frequencies_divides_low_ones_and_blends_between() {
        let (theta, d) = (500_000.0, 128);
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let (f, a) = build(theta, d, scaling);
        assert_eq!(a, 1.0);
        for (i, &v) in f.iter().enumerate() {
            let base = default_freq(theta, d, i);
            let wavelen = 2.0 * PI / base;
            let want = if wavelen < 8192.0 / 4.0 {
                base
            } else if wavelen > 8192.0 {
                base / 8.0
            } else {
                let smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
                (1.0 - smooth) * base / 8.0 + smooth * base
            };
            assert!(close(v, want), "i {i}: {v} vs {want}");
            assert!(v <= base * (1.0 + 1e-15) && v >= base / 8.0 * (1.0 - 1e-15));
        }
        assert!(close(f[0], 1.0) && close(f[63], default_freq(theta, d, 63) / 8.0));
    }

    #[test]
    fn longrope_picks_long_factors_past_the_original_context() {
        let half = 48usize;
        let short: Vec<f64> = (0..half).map(|i| 1.0 + i as f64 / 100.0).collect();
        let long: Vec<f64> = (0..half).map(|i| 1.0 + i as f64 / 4.0).collect();
        for (seq_len, ext) in [(1, &short), (4096, &short), (4097, &long), (100_000, &long)] {
            let scaling = RopeScaling::LongRope {
                short_factor: short.clone(),
                long_factor: long.clone(),
                factor: None,
                original_max_position_embeddings: 4096,
                max_position_embeddings: 131_072,
                seq_len,
                attention_factor: None,
            };
            let (f, a) = build(10_000.0, 2 * half as u32, scaling);
            assert!(close(
                a,
                (1.0 + (131_072.0f64 / 4096.0).ln() / 4096.0f64.ln()).sqrt()
            ));
            for (i, &v) in f.iter().enumerate() {
                assert!(close(
                    v,
                    1.0 / (ext[i] * 10_000f64.powf((2 * i) as f64 / (2 * half) as f64))
                ));
            }
        }
    }

    /// As Hugging Face computes it: a given `factor` sets the attention factor
    /// `sqrt(1 + ln(factor) / ln(original))` (1 for `factor <= 1`) whatever
    /// `max_position_embeddings` is; without one, the ratio of the two lengths stands for it;
    /// a given `attention_factor` overrides both. The factor lists are chosen by `seq_len`
    /// against the original context alone.
    #[test]
    fn longrope_attention_factor_comes_from_factor_when_given() {
        let half = 16usize;
        let scaling = |factor, max, attention_factor| RopeScaling::LongRope {
            short_factor: vec![1.0; half],
            long_factor: vec![2.0; half],
            factor,
            original_max_position_embeddings: 4096,
            max_position_embeddings: max,
            seq_len: 8192,
            attention_factor,
        };
        let from = |s: f64| (1.0 + s.ln() / 4096f64.ln()).sqrt();
        for (factor, max, attention_factor, want) in [
            (Some(16.0), 131_072, None, from(16.0)),
            (Some(16.0), 4096, None, from(16.0)),
            (Some(0.5), 131_072, None, 1.0),
            (Some(1.0), 131_072, None, 1.0),
            (None, 131_072, None, from(32.0)),
            (None, 4096, None, 1.0),
            (None, 2048, None, 1.0),
            (Some(16.0), 131_072, Some(1.5), 1.5),
        ] {
            let (f, a) = build(
                10_000.0,
                2 * half as u32,
                scaling(factor, max, attention_factor),
            );
            assert!(
                close(a, want),
                "factor {factor:?}, max {max}, attention_factor {attention_factor:?}: {a} vs {want}"
            );
            assert!(close(f[0], 0.5), "long factors past the original context");
        }
    }

    #[test]
    fn invalid_family_parameters_are_rejected() {
        let bad = [
            RopeScaling::Linear { factor: 0.0 },
            RopeScaling::Linear { factor: f64::NAN },
            RopeScaling::DynamicNtk {
                factor: 2.0,
                max_position_embeddings: 0,
                seq_len: 10,
            },
            RopeScaling::Yarn(Yarn::new(-4.0, 4096)),
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 4.0,
                high_freq_factor: 1.0,
                original_max_position_embeddings: 8192,
            },
            RopeScaling::LongRope {
                short_factor: vec![1.0; 3],
                long_factor: vec![1.0; 32],
                factor: None,
                original_max_position_embeddings: 4096,
                max_position_embeddings: 8192,
                seq_len: 10,
                attention_factor: None,
            },
            RopeScaling::LongRope {
                short_factor: vec![1.0; 32],
                long_factor: vec![1.0; 32],
                factor: Some(0.0),
                original_max_position_embeddings: 4096,
                max_position_embeddings: 8192,
                seq_len: 10,
                attention_factor: None,
            },
        ];
        for scaling in bad {
            let err = FrequencySpec::new(10_000.0, 64)
                .scaling(scaling.clone())
                .build()
                .expect_err("invalid");
            assert!(
                matches!(err, rope_host::Error::Invalid { arg: "scaling", .. }),
                "{scaling:?}: {err}"
            );
        }
        assert!(FrequencySpec::new(0.0, 64).build().is_err());
        assert!(FrequencySpec::new(10_000.0, 7).build().is_err());
    }
}

mod given_frequencies {
    //! Why `Rope::frequencies_from` takes a model's own f32 frequency vector: frameworks that
    //! compute `inv_freq` in f32 hold entries that are not the f32 nearest the exact value, and
    //! under `AngleMode::F32Compat` only their own vector gives their angles.
    use rope_kernels::math::{AngleMode, angle, rope_cos_sin_mode};

    use super::*;

    #[test]
    fn hf_f32_frequencies_differ_from_the_correctly_rounded_ones_in_some_entries() {
        for (theta, d) in [
            (10_000.0f32, 64usize),
            (10_000.0, 128),
            (500_000.0, 128),
            (1e6, 128),
        ] {
            let hf = reference::hf_inv_freq(theta, d);
            let exact = rope_host::inv_freq(f64::from(theta), d as u32);
            let ulps: Vec<u64> = hf
                .iter()
                .zip(&exact)
                .map(|(&h, &e)| ulps_apart(h, e as f32))
                .collect();
            let differ = ulps.iter().filter(|&&u| u > 0).count();
            report(&format!(
                "theta {theta}, rotary_dim {d}: {differ} of {} f32 frequencies differ from the \
                 correctly rounded ones, by up to {} ulp",
                hf.len(),
                ulps.iter().max().expect("non-empty")
            ));
            assert!(
                differ > 0,
                "theta {theta}, rotary_dim {d}: no entry differs"
            );
            assert!(ulps.iter().all(|&u| u <= 8), "{ulps:?}");
        }
    }

    /// With the model's f32 vector widened to f64, the kernels' `F32Compat` angle is the f32
    /// angle `f32(p) * inv_freq[i]` at every position and pair (with the correctly rounded
    /// vector it is not), and cos/sin of it are those of the f32 tables to within one ulp, equal
    /// but for near-ties of the rounding. The GPU is bit-identical to this CPU emulation
    /// (`gpu::accuracy`).
    #[test]
    fn f32_compat_with_the_models_f32_vector_forms_its_f32_angles_exactly() {
        let (theta, d) = (500_000.0f32, 128);
        let hf = reference::hf_inv_freq(theta, d);
        let exact = rope_host::inv_freq(f64::from(theta), d as u32);
        let positions: Vec<i64> = (0..4096i64)
            .map(|k| k * 511 + 3)
            .chain([(1 << 31) - 1])
            .collect();
        let mut other_angles = 0;
        for &p in &positions {
            for (&h, &e) in hf.iter().zip(&exact) {
                let f32_angle = f64::from(p as f32 * h);
                assert_eq!(angle(p, f64::from(h), AngleMode::F32Compat), f32_angle);
                if angle(p, e, AngleMode::F32Compat) != f32_angle {
                    other_angles += 1;
                }
            }
        }
        assert!(
            other_angles > 0,
            "the correctly rounded vector gave the same angles"
        );
        let (cos, sin) = reference::f32_angle_tables(&hf, &positions);
        let (mut off_by_one, mut total) = (0usize, 0usize);
        for (r, &p) in positions.iter().enumerate() {
            for (i, &h) in hf.iter().enumerate() {
                let (c, s) = rope_cos_sin_mode(p, f64::from(h), AngleMode::F32Compat);
                for (got, want) in [(c, cos[[r, i]]), (s, sin[[r, i]])] {
                    let u = ulps_apart(got, want);
                    assert!(u <= 1, "p {p}, i {i}: {got} vs {want}");
                    off_by_one += usize::from(u == 1);
                    total += 1;
                }
            }
        }
        report(&format!(
            "F32Compat cos/sin vs f32-angle tables: {off_by_one} of {total} one ulp apart"
        ));
        assert!(off_by_one * 1000 <= total, "{off_by_one} of {total}");
    }
}

/// Multi-axis positions and rotated slices at an offset: the reference's maps (written from
/// the published code) against the host library's, the axial frequencies against FLUX's
/// formula, and the reference's general form against the one-position form.
mod multi_axis {
    use ndarray::Array3;
    use rope_host::{AxisMap, FrequencySpec, RopeScaling};

    use super::*;

    /// The host's `AxisMap` constructors give the maps the reference builds from transformers'
    /// and FLUX's code, for every section split and axis widths.
    #[test]
    fn host_axis_maps_are_the_published_ones() {
        runner(500)
            .run(
                &(1usize..=80).prop_flat_map(|half| {
                    (
                        Just(half),
                        strategies::mrope_section(half),
                        strategies::axes_dim(half),
                    )
                }),
                |(half, sections, axes_dim)| {
                    let r = 2 * half as u32;
                    let widen =
                        |m: AxisMap| m.axes().iter().map(|&a| a as usize).collect::<Vec<_>>();
                    let s32 = sections.map(|v| v as u32);
                    let mrope = AxisMap::mrope(s32, r).expect("sections sum to half");
                    prop_assert_eq!(widen(mrope), reference::mrope_axes(sections));
                    let inter = AxisMap::mrope_interleaved(s32, r).expect("valid");
                    prop_assert_eq!(widen(inter), reference::mrope_interleaved_axes(sections));
                    let d32: Vec<u32> = axes_dim.iter().map(|&v| v as u32).collect();
                    let axial = AxisMap::axial(&d32, r).expect("valid widths");
                    prop_assert_eq!(axial.n_axes() as usize, axes_dim.len());
                    prop_assert_eq!(widen(axial), reference::axial(&axes_dim, 1.0).0);
                    Ok(())
                },
            )
            .expect("the host's maps are the published ones");
    }

    /// `RopeScaling::Axial`'s frequencies are FLUX's `1 / theta^(arange(0, d, 2) / d)` per axis.
    #[test]
    fn axial_frequencies_are_flux_formula() {
        runner(300)
            .run(
                &(1usize..=80, strategies::theta()).prop_flat_map(|(half, theta)| {
                    (strategies::axes_dim(half), Just(theta), Just(half))
                }),
                |(axes_dim, theta, half)| {
                    let spec =
                        FrequencySpec::new(theta, 2 * half as u32).scaling(RopeScaling::Axial {
                            axes_dim: axes_dim.iter().map(|&v| v as u32).collect(),
                        });
                    let (f, attention) = spec.build().expect("valid");
                    prop_assert_eq!(attention, 1.0);
                    let (_, want) = reference::axial(&axes_dim, theta);
                    prop_assert_eq!(f.len(), want.len());
                    for (g, w) in f.iter().zip(&want) {
                        prop_assert!((g - w).abs() <= 4.0 * f64::EPSILON * w, "{g} vs {w}");
                    }
                    Ok(())
                },
            )
            .expect("axial frequencies follow FLUX");
    }

    /// With one axis (or all axes equal) and no offset, the general reference is the
    /// one-position reference; with an offset it rotates the shifted slice and leaves the rest.
    #[test]
    fn general_reference_reduces_to_the_one_position_form() {
        runner(200)
            .run(
                &(
                    strategies::style(),
                    strategies::direction(),
                    strategies::head_and_rotary_dim(),
                    strategies::theta(),
                    1usize..=4,
                    any::<u64>(),
                ),
                |(style, direction, (d, r), theta, n_axes, seed)| {
                    let x = random_x(seed, (2, 3, 2, d));
                    let pos = sequential_positions(2, 3, (seed % 1000) as i64);
                    let src = RefSinCos::Theta(theta);
                    let want =
                        reference::rope_partial(x.view(), pos.view(), style, direction, &src, r);
                    // Every axis holds the token's position: any map gives the 1-D result.
                    let all = Array3::from_shape_fn((n_axes, 2, 3), |(_, b, s)| pos[[b, s]]);
                    let axes: Vec<usize> = (0..r / 2)
                        .map(|j| (j * 7 + seed as usize) % n_axes)
                        .collect();
                    let got = reference::rope_axes(
                        x.view(),
                        all.view(),
                        &axes,
                        style,
                        direction,
                        &src,
                        r,
                        0,
                    );
                    prop_assert_eq!(&got, &want);
                    // A slice at offset o: the rotation of the slice alone, the rest unchanged.
                    let o = (seed as usize % (d - r + 1)) & !1;
                    let sliced = reference::rope_axes(
                        x.view(),
                        all.view(),
                        &axes,
                        style,
                        direction,
                        &src,
                        r,
                        o,
                    );
                    let part = x.slice(s![.., .., .., o..o + r]).to_owned();
                    let part_want =
                        reference::rope_partial(part.view(), pos.view(), style, direction, &src, r);
                    prop_assert_eq!(
                        &sliced.slice(s![.., .., .., o..o + r]).to_owned(),
                        &part_want
                    );
                    prop_assert_eq!(
                        sliced.slice(s![.., .., .., ..o]),
                        x.slice(s![.., .., .., ..o])
                    );
                    prop_assert_eq!(
                        sliced.slice(s![.., .., .., o + r..]),
                        x.slice(s![.., .., .., o + r..])
                    );
                    Ok(())
                },
            )
            .expect("the general reference reduces to the one-position one");
    }

    /// Each pair of a multi-axis token rotates by its own axis's position (mRoPE sections,
    /// written out for one token).
    #[test]
    fn pairs_rotate_by_their_own_axis() {
        let (d, theta) = (12usize, 100.0);
        let x = random_x(3, (1, 1, 1, d));
        // Axes t, h, w at positions 5, 7, 11; mrope_section [1, 2, 3].
        let pos = Array3::from_shape_vec((3, 1, 1), vec![5i64, 7, 11]).expect("shape");
        let axes = reference::mrope_axes([1, 2, 3]);
        assert_eq!(axes, [0, 1, 1, 2, 2, 2]);
        let y = reference::rope_axes(
            x.view(),
            pos.view(),
            &axes,
            RopeStyle::Neox,
            Direction::Forward,
            &RefSinCos::Theta(theta),
            d,
            0,
        );
        for (i, p) in [5.0, 7.0, 7.0, 11.0, 11.0, 11.0].into_iter().enumerate() {
            let angle: f64 = p * theta.powf(-2.0 * i as f64 / d as f64);
            let (a, b) = (x[[0, 0, 0, i]], x[[0, 0, 0, i + 6]]);
            assert!((y[[0, 0, 0, i]] - (a * angle.cos() - b * angle.sin())).abs() < 1e-12);
            assert!((y[[0, 0, 0, i + 6]] - (b * angle.cos() + a * angle.sin())).abs() < 1e-12);
        }
    }
}

mod context_parallel {
    use std::num::NonZeroU32;

    use rope_harness::case::PosCase;
    use rope_host::ContextParallel;
    use rope_kernels::abi::ContextParallelSplit;

    use super::*;

    /// The reference's rank positions (chunks cut from each whole sequence, as Megatron-LM lays
    /// them out) equal the kernel's (a search over the whole boundaries, then the two-chunk
    /// formula of `rope_kernels::abi`), for random sequences, sizes and ranks; and the ranks
    /// together hold every whole position once.
    #[test]
    fn rank_positions_equal_the_kernels_and_cover_every_position_once() {
        runner(500)
            .run(
                &(0usize..40)
                    .prop_flat_map(|half| strategies::varlen_context_parallel(2 * half, 8)),
                |case| {
                    let PosCase::VarlenContextParallel {
                        cu_seqlens, size, ..
                    } = case
                    else {
                        unreachable!("the strategy's kind")
                    };
                    let mut seen: Vec<Vec<u32>> = cu_seqlens
                        .windows(2)
                        .map(|w| vec![0; (w[1] - w[0]) as usize])
                        .collect();
                    for rank in 0..size {
                        let want = reference::context_parallel_positions(
                            &cu_seqlens,
                            size as usize,
                            rank as usize,
                        );
                        let split = ContextParallelSplit {
                            size: NonZeroU32::new(size).expect("size >= 1"),
                            rank,
                        };
                        let cu: Vec<i64> = cu_seqlens.iter().map(|&c| c as i64).collect();
                        for (t, &w) in want.iter().enumerate() {
                            let bound = split.search_bound(t as u64);
                            let i = cu[..cu.len() - 1]
                                .iter()
                                .rposition(|&c| c <= bound)
                                .expect("starts at 0");
                            prop_assert_eq!(split.position(t as u64, cu[i], cu[i + 1]), w);
                            seen[i][w as usize] += 1;
                        }
                    }
                    prop_assert!(seen.iter().flatten().all(|&n| n == 1));
                    Ok(())
                },
            )
            .unwrap();
    }

    /// Sizes outside `1..=65536` are refused naming `cp_size`, ranks not below the size naming
    /// `cp_rank`.
    #[test]
    fn splits_outside_their_range_are_refused_by_name() {
        for (size, rank, name) in [(0, 0, "cp_size"), (65537, 0, "cp_size"), (4, 4, "cp_rank")] {
            match ContextParallel::new(size, rank) {
                Err(rope_host::Error::Invalid { arg, .. }) => assert_eq!(arg, name),
                other => panic!("{size} {rank}: {other:?}"),
            }
        }
        let split = ContextParallel::new(65536, 65535).expect("the largest split");
        assert_eq!((split.size(), split.rank()), (65536, 65535));
    }
}

mod scaling_domains;

mod gpu {
    pub mod accuracy;
    pub mod finite_outputs;
    pub mod fused;
    pub mod fused_backward;
    pub mod kernel_code;
    pub mod matches_reference;
    pub mod mla;
    pub mod multi_axis;
    pub mod rejects_invalid;
    pub mod serving;
    pub mod tables;
}
