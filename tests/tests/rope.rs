//! Properties of RoPE, one module per property. CPU modules check the f64 reference and the
//! kernels' pure math and always run; `gpu_*` modules run the kernels and print a skip line when
//! no GPU is present (and fail instead under `ROPE_REQUIRE_GPU=1`).

use std::io::Write;

use ndarray::{Array2, Array4, s};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use rope_host::{Direction, RopeStyle};
use rope_tests::reference::{self, RefSinCos};
use rope_tests::strategies;

/// Writes a line past libtest's output capture, so summaries and skips always show.
fn report(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// A proptest runner that keeps no regression files (the bundle runs far from the sources).
fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
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

    /// The kernels' own cos/sin (`kernels_gpu::math`, the code the GPU runs) are within one f32
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
                        let (c, s) = kernels_gpu::math::rope_cos_sin(
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

mod gpu {
    pub mod matches_reference;
    pub mod rejects_invalid;
    pub mod tables;
}
