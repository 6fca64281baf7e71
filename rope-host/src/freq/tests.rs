//! Unit tests of the frequency builders.

use super::*;
use crate::Error;

#[test]
fn checked_inv_freq_is_the_default_family_where_it_is_defined() {
    for (theta, d) in [
        (10_000.0, 128),
        (500_000.0, 64),
        (1.0, 8),
        (0.5, 6),
        (1e300, 2),
    ] {
        assert_eq!(
            checked_inv_freq(theta, d).expect("valid"),
            inv_freq(theta, d)
        );
    }
}

#[test]
fn checked_inv_freq_rejects_theta_whose_frequencies_leave_the_reduction_range() {
    // theta = 1e-300 (the fuzzer's case): theta^(-2i/d) overflows.
    for theta in [
        1e-300,
        0.0,
        -1.0,
        f64::NAN,
        f64::INFINITY,
        f64::MIN_POSITIVE,
    ] {
        let err = checked_inv_freq(theta, 64).expect_err("invalid theta");
        assert!(
            matches!(err, Error::Invalid { arg: "theta", .. }),
            "{theta}: {err}"
        );
    }
    // With d = 4 the largest frequency is theta^(-1/2): 2^20 exactly at theta = 2^-40.
    assert_eq!(
        checked_inv_freq(2f64.powi(-40), 4).expect("at the bound")[1],
        MAX_INV_FREQ
    );
    let err = checked_inv_freq(2f64.powi(-41), 4).expect_err("past the bound");
    assert!(matches!(err, Error::Invalid { arg: "theta", .. }), "{err}");
    // With d = 2 the only frequency is theta^0 = 1, whatever theta.
    assert_eq!(checked_inv_freq(1e-300, 2).expect("one pair"), vec![1.0]);
}

#[test]
fn checked_inv_freq_rejects_odd_or_tiny_rotary_dim() {
    for d in [0, 1, 7] {
        let err = checked_inv_freq(10_000.0, d).expect_err("invalid rotary_dim");
        assert!(
            matches!(
                err,
                Error::Invalid {
                    arg: "rotary_dim",
                    ..
                }
            ),
            "{d}: {err}"
        );
    }
}

#[test]
fn check_theta_agrees_with_checked_inv_freq() {
    for theta in [
        1e-300,
        1e-9,
        1e-6,
        0.01,
        0.5,
        1.0,
        10_000.0,
        1e12,
        0.0,
        -2.0,
        f64::NAN,
    ] {
        for d in [2, 4, 64, 128, 256] {
            assert_eq!(
                check_theta(theta, d).is_ok(),
                checked_inv_freq(theta, d).is_ok(),
                "theta {theta}, rotary_dim {d}"
            );
        }
    }
}

#[test]
fn given_frequencies_are_widened_exactly_with_rotary_dim_twice_their_length() {
    let f32s = [1.0f32, 0.1, 1.0e-30, f32::from_bits(1), 1_048_576.0];
    let (f, rotary_dim) = InvFreq::F32(&f32s).checked().expect("valid");
    assert_eq!(rotary_dim, 10);
    for (&wide, &narrow) in f.iter().zip(&f32s) {
        assert_eq!(wide, f64::from(narrow));
        assert_eq!(wide as f32, narrow);
    }
    let f64s = [0.5, 1e-300, MAX_INV_FREQ];
    assert_eq!(
        InvFreq::F64(&f64s).checked().expect("valid"),
        (f64s.to_vec(), 6)
    );
}

#[test]
fn given_frequencies_outside_the_frequency_bound_are_rejected_naming_inv_freq() {
    let is_inv_freq = |r: Result<(Vec<f64>, u32)>| {
        matches!(
            r,
            Err(Error::Invalid {
                arg: "inv_freq",
                ..
            })
        )
    };
    assert!(is_inv_freq(InvFreq::F32(&[]).checked()));
    assert!(is_inv_freq(InvFreq::F64(&[]).checked()));
    let next = |v: f64| f64::from_bits(v.to_bits() + 1);
    for bad in [
        -1.0,
        -f64::MIN_POSITIVE,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        next(MAX_INV_FREQ),
    ] {
        let err = InvFreq::F64(&[0.5, bad, 0.25])
            .checked()
            .expect_err("out of bounds");
        match err {
            Error::Invalid { arg, problem } => {
                assert_eq!(arg, "inv_freq");
                assert!(problem.contains("inv_freq[1]"), "{bad}: {problem}");
            }
            other => panic!("{bad}: {other}"),
        }
        // The same values in f32, where they exist there.
        let narrow = bad as f32;
        if f64::from(narrow) > MAX_INV_FREQ || !(narrow.is_finite() && narrow >= 0.0) {
            assert!(is_inv_freq(InvFreq::F32(&[narrow]).checked()), "{narrow}");
        }
    }
    // The smallest f32 above 2^20 is past the bound as well.
    let above = f32::from_bits(1_048_576.0f32.to_bits() + 1);
    assert!(is_inv_freq(InvFreq::F32(&[above]).checked()));
    // Zeros (of either sign) leave their pairs as they are: Gemma 4's proportional vectors end
    // in them.
    let (f, rotary_dim) = InvFreq::F32(&[1.0, 0.5, 0.0, -0.0])
        .checked()
        .expect("zeros are frequencies");
    assert_eq!((f, rotary_dim), (vec![1.0, 0.5, 0.0, 0.0], 8));
}

/// transformers' `_compute_proportional_rope_parameters` (`modeling_rope_utils.py`, read by
/// `Gemma4TextRotaryEmbedding`): `rope_angles = int(partial_rotary_factor * head_dim // 2)`,
/// `inv_freq = 1 / base ** (arange(0, 2 * rope_angles, 2) / head_dim)` padded with
/// `head_dim // 2 - rope_angles` zeros, all divided by `factor`; attention factor 1.
/// Transcribed here for Gemma 4's full-attention layers (`global_head_dim` 512,
/// `partial_rotary_factor` 0.25, `rope_theta` 1e6) and other shares.
#[test]
fn proportional_is_gemma4s_share_of_the_whole_heads_frequencies_then_zeros() {
    for (theta, head_dim, share, factor) in [
        (1e6, 512u32, 0.25, 1.0),
        (1e6, 256, 0.25, 1.0),
        (1e4, 128, 0.5, 2.0),
        (1e4, 64, 1.0, 1.0),
        (1e4, 10, 0.3, 1.0),
    ] {
        let spec = FrequencySpec::new(theta, head_dim).scaling(RopeScaling::Proportional {
            partial_rotary_factor: share,
            factor,
        });
        let (f, attention) = spec.build().expect("valid");
        assert_eq!((f.len(), attention), (head_dim as usize / 2, 1.0));
        let angles = (share * f64::from(head_dim) / 2.0).floor() as usize;
        for (i, &got) in f.iter().enumerate() {
            let want = if i < angles {
                1.0 / theta.powf(2.0 * i as f64 / f64::from(head_dim)) / factor
            } else {
                0.0
            };
            assert!(
                (got - want).abs() <= 4.0 * f64::EPSILON * want,
                "{head_dim} {share}: {i}: {got} vs {want}"
            );
        }
        if share == 1.0 {
            assert_eq!(f, inv_freq(theta, head_dim));
        }
    }
    for (share, factor, field) in [
        (0.0, 1.0, "partial_rotary_factor "),
        (1.5, 1.0, "partial_rotary_factor "),
        (f64::NAN, 1.0, "partial_rotary_factor "),
        (0.25, 0.0, "factor "),
        (0.25, f64::INFINITY, "factor "),
    ] {
        let spec = FrequencySpec::new(1e6, 512).scaling(RopeScaling::Proportional {
            partial_rotary_factor: share,
            factor,
        });
        match spec.build() {
            Err(Error::Invalid {
                arg: "scaling",
                problem,
            }) => assert!(problem.starts_with(field), "{problem}"),
            other => panic!("{share} {factor}: {other:?}"),
        }
    }
}

#[test]
fn given_attention_factors_outside_1e_3_to_1e3_are_rejected_naming_it() {
    let (lo, hi) = ATTENTION_RANGE;
    for ok in [lo, 1.0, 1.19, hi] {
        assert_eq!(check_attention_factor(ok).expect("in range"), ok);
    }
    let next = |v: f64| f64::from_bits(v.to_bits() + 1);
    let prev = |v: f64| f64::from_bits(v.to_bits() - 1);
    for bad in [
        prev(lo),
        next(hi),
        0.0,
        -1.0,
        f64::NAN,
        f64::INFINITY,
        f64::MIN_POSITIVE,
    ] {
        let err = check_attention_factor(bad).expect_err("out of range");
        assert!(
            matches!(
                err,
                Error::Invalid {
                    arg: "attention_factor",
                    ..
                }
            ),
            "{bad}: {err}"
        );
    }
}

#[test]
fn axial_frequencies_are_each_axis_own_default_family() {
    let spec = FrequencySpec::new(10_000.0, 12).scaling(RopeScaling::Axial {
        axes_dim: vec![4, 2, 6],
    });
    let (f, attention) = spec.build().expect("valid");
    // Written out: axis 0 (d 4): 1, theta^(-1/2); axis 1 (d 2): 1; axis 2 (d 6): 1,
    // theta^(-1/3), theta^(-2/3).
    let t: f64 = 10_000.0;
    let want = [
        1.0,
        t.powf(-0.5),
        1.0,
        1.0,
        t.powf(-1.0 / 3.0),
        t.powf(-2.0 / 3.0),
    ];
    assert_eq!(attention, 1.0);
    for (got, want) in f.iter().zip(want) {
        assert!((got - want).abs() <= 1e-15 * want, "{got} vs {want}");
    }
    // FLUX: theta 10000, axes_dim [16, 56, 56]; one axis is the default family.
    let flux = FrequencySpec::new(10_000.0, 128).scaling(RopeScaling::Axial {
        axes_dim: vec![16, 56, 56],
    });
    let (f, _) = flux.build().expect("valid");
    assert_eq!(f.len(), 64);
    assert_eq!(&f[..8], &inv_freq(10_000.0, 16)[..]);
    assert_eq!(&f[8..36], &inv_freq(10_000.0, 56)[..]);
    assert_eq!(&f[36..], &inv_freq(10_000.0, 56)[..]);
    let one = FrequencySpec::new(500.0, 64).scaling(RopeScaling::Axial { axes_dim: vec![64] });
    assert_eq!(one.build().expect("valid").0, inv_freq(500.0, 64));
}

#[test]
fn axial_frequencies_reject_widths_that_do_not_tile_rotary_dim() {
    for axes_dim in [vec![], vec![3, 13], vec![8, 4], vec![0, 16], vec![4; 5]] {
        let spec = FrequencySpec::new(10_000.0, 16).scaling(RopeScaling::Axial {
            axes_dim: axes_dim.clone(),
        });
        match spec.build() {
            Err(Error::Invalid {
                arg: "scaling",
                problem,
            }) => assert!(problem.contains("axes_dim"), "{problem}"),
            other => panic!("{axes_dim:?}: {other:?}"),
        }
    }
}

#[test]
fn dynamic_ntk_alpha_grows_the_base_by_alpha_to_the_d_over_d_minus_2() {
    // Hunyuan-A13B: rope_theta 10000, alpha 1000, head_dim 128.
    let spec =
        FrequencySpec::new(10_000.0, 128).scaling(RopeScaling::DynamicNtkAlpha { alpha: 1000.0 });
    let (f, attention) = spec.build().expect("valid");
    let base = 10_000.0 * 1000f64.powf(128.0 / 126.0);
    assert_eq!(attention, 1.0);
    for (i, got) in f.iter().enumerate() {
        let want = 1.0 / base.powf(2.0 * i as f64 / 128.0);
        assert!(
            (got - want).abs() <= 4.0 * f64::EPSILON * want,
            "{i}: {got} vs {want}"
        );
    }
    // alpha 1 is the default family.
    let one = FrequencySpec::new(500.0, 64).scaling(RopeScaling::DynamicNtkAlpha { alpha: 1.0 });
    assert_eq!(one.build().expect("valid").0, inv_freq(500.0, 64));
}

/// TeleChat3's YaRN: vLLM's `TeleChat3RoPEScaledRotaryEmbedding` takes YaRN's frequencies and
/// `mscale = 0.07 ln(factor) + 1` (TeleChat3's own `_yarn_get_mscale` with `mscale` 1); the
/// values its tutorial's 32K and 128K configs give (factor 4 and 16 over 8192 tokens, theta
/// 10000).
#[test]
fn yarn_takes_telechat3s_mscale_coefficient() {
    for (factor, mscale) in [(4.0, 1.097_04), (16.0, 1.194_08)] {
        let standard = Yarn::new(factor, 8192);
        let telechat3 = Yarn {
            mscale_coefficient: 0.07,
            ..standard.clone()
        };
        let build = |y: Yarn| {
            FrequencySpec::new(10_000.0, 128)
                .scaling(RopeScaling::Yarn(y))
                .build()
                .expect("valid")
        };
        let ((f, a), (f_std, a_std)) = (build(telechat3), build(standard));
        assert_eq!(f, f_std);
        assert_eq!(a, 0.07 * f64::ln(factor) + 1.0);
        assert!((a - mscale).abs() < 1e-5, "{a}");
        assert_eq!(a_std, 0.1 * f64::ln(factor) + 1.0);
    }
    for c in [-0.1, 1.5, f64::NAN] {
        let y = Yarn {
            mscale_coefficient: c,
            ..Yarn::new(4.0, 8192)
        };
        match FrequencySpec::new(10_000.0, 128)
            .scaling(RopeScaling::Yarn(y))
            .build()
        {
            Err(Error::Invalid {
                arg: "scaling",
                problem,
            }) => assert!(problem.starts_with("mscale_coefficient "), "{problem}"),
            other => panic!("{c}: {other:?}"),
        }
    }
}

/// Grok-1's `yarn_log` (vLLM's `Grok1ScalingRotaryEmbedding`, `rotary_embedding/
/// grok1_scaling_rope.py`): YaRN's correction range and ramp, `mask = 1 - ramp`, and
/// `inv_freq = exp(mask * log(f) + (1 - mask) * log(f / factor))`; cos and sin unscaled.
/// Transcribed here, with the linear blend's range and ramp, for a Grok-like head (rope_theta
/// 208533496, head_dim 128, factor 16 over 8192 tokens, beta_fast 8, beta_slow 1).
#[test]
fn yarn_log_blends_in_log_space_between_the_same_bounds() {
    let (theta, d, factor, original) = (208_533_496.0f64, 128u32, 16.0f64, 8192u32);
    let y = Yarn {
        beta_fast: 8.0,
        beta_slow: 1.0,
        attention_factor: Some(1.0),
        blend: YarnBlend::Log,
        ..Yarn::new(factor, original)
    };
    let (f, attention) = FrequencySpec::new(theta, d)
        .scaling(RopeScaling::Yarn(y.clone()))
        .build()
        .expect("valid");
    assert_eq!(attention, 1.0);
    let dim = f64::from(d);
    let correction = |rotations: f64| {
        dim * (f64::from(original) / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * theta.ln())
    };
    let low = correction(8.0).floor().max(0.0);
    let high = correction(1.0).ceil().min(dim - 1.0);
    assert!(low < high);
    for (i, &got) in f.iter().enumerate() {
        let extrapolated = theta.powf(-2.0 * i as f64 / dim);
        let mask = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
        let want = (mask * extrapolated.ln() + (1.0 - mask) * (extrapolated / factor).ln()).exp();
        assert!(
            (got - want).abs() <= 16.0 * f64::EPSILON * want,
            "{i}: {got} vs {want}"
        );
        // Between the interpolated and the extrapolated value, as the linear blend is.
        assert!(
            extrapolated / factor * (1.0 - 1e-12) <= got && got <= extrapolated * (1.0 + 1e-12)
        );
    }
    // The linear blend differs inside the ramp and agrees outside it (to rounding: exp(ln x)).
    let linear = FrequencySpec::new(theta, d)
        .scaling(RopeScaling::Yarn(Yarn {
            blend: YarnBlend::Linear,
            ..y
        }))
        .build()
        .expect("valid")
        .0;
    for i in [0, 63] {
        assert!(
            (f[i] - linear[i]).abs() <= 4.0 * f64::EPSILON * linear[i],
            "{i}"
        );
    }
    assert!(f.iter().zip(&linear).any(|(a, b)| (a - b).abs() > 1e-6 * b));
}

/// vLLM's `NTKScalingRotaryEmbedding` (`vllm/model_executor/layers/rotary_embedding/
/// ntk_scaling_rope.py`): without `mixed_b`, the default frequencies of base
/// `rope_theta * factor` divided by `factor ** (2 / rotary_dim)`; with it,
/// `a = log(factor) / (rotary_dim / 2) ** mixed_b`,
/// `lambda = exp(a * arange(1, rotary_dim // 2 + 1) ** mixed_b)` and the default frequencies of
/// `rope_theta` divided by `lambda`. Transcribed here term by term.
#[test]
fn ntk_is_vllms_ntk_scaling_with_and_without_mixed_b() {
    let close = |got: &[f64], want: &dyn Fn(f64) -> f64| {
        for (i, &g) in got.iter().enumerate() {
            let w = want(i as f64);
            assert!((g - w).abs() <= 8.0 * f64::EPSILON * w, "{i}: {g} vs {w}");
        }
    };
    // gte-multilingual-base: rope_theta 20000, factor 8, head_dim 64.
    let (theta, d, s) = (20_000.0, 64.0, 8.0);
    let fixed = FrequencySpec::new(theta, 64).scaling(RopeScaling::Ntk {
        factor: s,
        mixed_b: None,
    });
    let (f, attention) = fixed.build().expect("valid");
    assert_eq!((f.len(), attention), (32, 1.0));
    close(&f, &|i| {
        1.0 / (theta * s).powf(2.0 * i / d) / s.powf(2.0 / d)
    });
    // The blog's mixed_b 0.75 with factor 12.
    let (s, b) = (12.0, 0.75);
    let mixed = FrequencySpec::new(theta, 64).scaling(RopeScaling::Ntk {
        factor: s,
        mixed_b: Some(b),
    });
    let a = f64::ln(s) / (d / 2.0).powf(b);
    close(&mixed.build().expect("valid").0, &|i| {
        1.0 / theta.powf(2.0 * i / d) / (a * (i + 1.0).powf(b)).exp()
    });
    // mixed_b 1 is the form without it.
    let one = FrequencySpec::new(theta, 64).scaling(RopeScaling::Ntk {
        factor: s,
        mixed_b: Some(1.0),
    });
    let without = FrequencySpec::new(theta, 64).scaling(RopeScaling::Ntk {
        factor: s,
        mixed_b: None,
    });
    close(&one.build().expect("valid").0, &|i| {
        without.build().expect("valid").0[i as usize]
    });
}

#[test]
fn ntk_rejects_factors_and_mixed_b_outside_their_domain() {
    let ntk = |theta: f64, factor: f64, mixed_b: Option<f64>| {
        FrequencySpec::new(theta, 64)
            .scaling(RopeScaling::Ntk { factor, mixed_b })
            .build()
    };
    for (factor, mixed_b, field) in [
        (0.0, None, "factor "),
        (0.5, None, "factor "),
        (f64::NAN, None, "factor "),
        (2e6, Some(1.0), "factor "),
        (8.0, Some(0.0), "mixed_b "),
        (8.0, Some(-0.5), "mixed_b "),
        (8.0, Some(16.5), "mixed_b "),
        (8.0, Some(f64::INFINITY), "mixed_b "),
    ] {
        match ntk(10_000.0, factor, mixed_b) {
            Err(Error::Invalid {
                arg: "scaling",
                problem,
            }) => assert!(problem.starts_with(field), "{problem}"),
            other => panic!("{factor} {mixed_b:?}: {other:?}"),
        }
    }
    // A grown base that overflows is rejected, not handed to the kernels.
    match ntk(1e305, 2e4, None) {
        Err(Error::Invalid {
            arg: "scaling",
            problem,
        }) => assert!(problem.starts_with("theta * factor"), "{problem}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn dynamic_ntk_alpha_rejects_alpha_outside_its_domain_and_rotary_dim_2() {
    for alpha in [0.5, 0.0, -1.0, f64::NAN, f64::INFINITY, 2e6] {
        let spec = FrequencySpec::new(10_000.0, 64).scaling(RopeScaling::DynamicNtkAlpha { alpha });
        match spec.build() {
            Err(Error::Invalid {
                arg: "scaling",
                problem,
            }) => assert!(problem.starts_with("alpha "), "{problem}"),
            other => panic!("{alpha}: {other:?}"),
        }
    }
    let two = FrequencySpec::new(10_000.0, 2).scaling(RopeScaling::DynamicNtkAlpha { alpha: 2.0 });
    assert!(matches!(
        two.build(),
        Err(Error::Invalid {
            arg: "rotary_dim",
            ..
        })
    ));
    // A base that overflows is rejected, not handed to the kernels.
    let huge = FrequencySpec::new(1e305, 64).scaling(RopeScaling::DynamicNtkAlpha { alpha: 1e6 });
    assert!(matches!(
        huge.build(),
        Err(Error::Invalid { arg: "scaling", .. })
    ));
}
