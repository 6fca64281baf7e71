//! The domains of the frequency families, one module per property:
//! `FrequencySpec::build` never panics; what it accepts has finite, positive frequencies of at
//! most `2^20` and an attention factor in `[1e-3, 1e3]`; a parameter outside its family's
//! documented domain is rejected with `Error::Invalid` naming it; everything inside the domains
//! over wide ranges is accepted; and the fuzzer's cases and published configs give the known
//! answers.
//!
//! [`documented_violations`] writes the domains of the `RopeScaling` docs out once, as the
//! oracle the properties compare `build` with.

use proptest::prelude::*;
use rope_host::{Error, FrequencySpec, RopeScaling, Yarn};
use rope_tests::strategies;

use super::runner;

/// The largest accepted frequency and the range of scaling factors and attention factors.
const MAX_INV_FREQ: f64 = 1_048_576.0;
const FACTOR_RANGE: (f64, f64) = (1.0 / 1_048_576.0, 1_048_576.0);
const ATTENTION_RANGE: (f64, f64) = (1e-3, 1e3);

/// The documented domain of one parameter.
#[derive(Clone, Copy, Debug)]
enum Domain {
    /// `theta`: finite, positive, and every default frequency at most `2^20` at `rotary_dim`.
    Theta(u32),
    /// YaRN's `theta`: finite and above 1.
    ThetaAboveOne,
    /// A scaling factor: in `[2^-20, 2^20]`.
    Factor,
    /// A length in tokens (an integer, widened to `f64` here): nonzero.
    Length,
    /// A length whose logarithm divides (LongRoPE's original context): at least 2.
    LogLength,
    /// Finite and positive.
    Positive,
    /// Finite and non-negative (`mscale`, `mscale_all_dim`).
    NonNegative,
    /// An attention factor: in `[1e-3, 1e3]`.
    Attention,
    /// Dynamic NTK's `alpha`, and NTK's `factor`: in `[1, 2^20]`.
    Alpha,
    /// NTK's `mixed_b`: in `(0, 16]`.
    MixedB,
    /// Proportional RoPE's `partial_rotary_factor`: in `(0, 1]`.
    Share,
    /// YaRN's `mscale_coefficient`: in `[0, 1]`.
    Unit,
}

impl Domain {
    fn contains(self, v: f64) -> bool {
        let in_range = |(lo, hi): (f64, f64)| v.is_finite() && (lo..=hi).contains(&v);
        match self {
            Self::Theta(d) => {
                v.is_finite()
                    && v > 0.0
                    && rope_host::inv_freq(v, d)
                        .iter()
                        .all(|&f| f.is_finite() && f > 0.0 && f <= MAX_INV_FREQ)
            }
            Self::ThetaAboveOne => v.is_finite() && v > 1.0,
            Self::Factor => in_range(FACTOR_RANGE),
            Self::Length => v >= 1.0,
            Self::LogLength => v >= 2.0,
            Self::Positive => v.is_finite() && v > 0.0,
            Self::NonNegative => v.is_finite() && v >= 0.0,
            Self::Attention => in_range(ATTENTION_RANGE),
            Self::Alpha => in_range((1.0, FACTOR_RANGE.1)),
            Self::MixedB => v.is_finite() && v > 0.0 && v <= 16.0,
            Self::Share => v > 0.0 && v <= 1.0,
            Self::Unit => (0.0..=1.0).contains(&v),
        }
    }
}

/// Every documented domain condition `spec` breaks, as `(arg, field)`: the error's `arg` and the
/// config field its problem starts with (empty where `arg` names it alone). Conditions on what
/// the formulas compute (dynamic NTK's grown base, YaRN's correction range, computed attention
/// factors, the frequency bound after scaling) are not listed: `build` may reject those as well.
fn documented_violations(spec: &FrequencySpec) -> Vec<(&'static str, &'static str)> {
    let mut v = Vec::new();
    let (theta, d) = (spec.theta, spec.rotary_dim);
    let rotary_dim_ok = d >= 2 && d % 2 == 0;
    if !rotary_dim_ok {
        v.push(("rotary_dim", ""));
    }
    if !Domain::Theta(if rotary_dim_ok { d } else { 0 }).contains(theta) {
        v.push(("theta", ""));
    }
    let mut check = |domain: Domain, value: f64, field: &'static str| {
        if !domain.contains(value) {
            v.push(("scaling", field));
        }
    };
    let mut extra = Vec::new();
    match &spec.scaling {
        RopeScaling::Default => {}
        RopeScaling::Axial { axes_dim } => {
            let widths_ok = (1..=4).contains(&axes_dim.len())
                && axes_dim.iter().all(|&w| w > 0 && w % 2 == 0)
                && axes_dim.iter().map(|&w| u64::from(w)).sum::<u64>() == u64::from(d);
            if !widths_ok {
                v.push(("scaling", "axes_dim"));
            }
        }
        RopeScaling::Linear { factor } => check(Domain::Factor, *factor, "factor"),
        RopeScaling::DynamicNtkAlpha { alpha } => {
            check(Domain::Alpha, *alpha, "alpha");
            if d == 2 {
                extra.push(("rotary_dim", ""));
            }
        }
        RopeScaling::Proportional {
            partial_rotary_factor,
            factor,
        } => {
            check(
                Domain::Share,
                *partial_rotary_factor,
                "partial_rotary_factor",
            );
            check(Domain::Factor, *factor, "factor");
        }
        RopeScaling::Ntk { factor, mixed_b } => {
            check(Domain::Alpha, *factor, "factor");
            if let Some(b) = mixed_b {
                check(Domain::MixedB, *b, "mixed_b");
            }
        }
        RopeScaling::DynamicNtk {
            factor,
            max_position_embeddings,
            seq_len,
        } => {
            check(Domain::Factor, *factor, "factor");
            check(
                Domain::Length,
                (*max_position_embeddings).into(),
                "max_position_embeddings",
            );
            check(Domain::Length, *seq_len as f64, "seq_len");
            if d == 2 {
                extra.push(("rotary_dim", ""));
            }
        }
        RopeScaling::Yarn(y) => {
            if !Domain::ThetaAboveOne.contains(theta) {
                extra.push(("theta", ""));
            }
            check(Domain::Factor, y.factor, "factor");
            check(
                Domain::Length,
                y.original_max_position_embeddings.into(),
                "original_max_position_embeddings",
            );
            check(Domain::Unit, y.mscale_coefficient, "mscale_coefficient");
            check(Domain::Positive, y.beta_fast, "beta_fast");
            check(Domain::Positive, y.beta_slow, "beta_slow");
            for (m, field) in [(y.mscale, "mscale"), (y.mscale_all_dim, "mscale_all_dim")] {
                if let Some(m) = m {
                    check(Domain::NonNegative, m, field);
                }
            }
            if let Some(a) = y.attention_factor {
                check(Domain::Attention, a, "attention_factor");
            }
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            check(Domain::Factor, *factor, "factor");
            check(Domain::Positive, *low_freq_factor, "low_freq_factor");
            check(Domain::Positive, *high_freq_factor, "high_freq_factor");
            check(
                Domain::Length,
                (*original_max_position_embeddings).into(),
                "original_max_position_embeddings",
            );
            if low_freq_factor >= high_freq_factor {
                extra.push(("scaling", "low_freq_factor"));
            }
        }
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            factor,
            original_max_position_embeddings,
            max_position_embeddings,
            seq_len,
            attention_factor,
        } => {
            check(
                Domain::LogLength,
                (*original_max_position_embeddings).into(),
                "original_max_position_embeddings",
            );
            check(
                Domain::Length,
                (*max_position_embeddings).into(),
                "max_position_embeddings",
            );
            check(Domain::Length, *seq_len as f64, "seq_len");
            if let Some(f) = factor {
                check(Domain::Factor, *f, "factor");
            }
            for (list, field) in [(short_factor, "short_factor"), (long_factor, "long_factor")] {
                if list.len() != d as usize / 2 {
                    extra.push(("scaling", field));
                }
                for &e in list {
                    check(Domain::Factor, e, field);
                }
            }
            if let Some(a) = attention_factor {
                check(Domain::Attention, *a, "attention_factor");
            }
        }
    }
    v.extend(extra);
    v
}

/// Whether `err` is an `Error::Invalid` matching `(arg, field)`: the same `arg`, and a problem
/// that starts with the field (followed by a space or an index).
fn names(err: &Error, (arg, field): (&str, &str)) -> bool {
    match err {
        Error::Invalid { arg: a, problem } => {
            *a == arg
                && (field.is_empty()
                    || problem.starts_with(&format!("{field} "))
                    || problem.starts_with(&format!("{field}[")))
        }
        _ => false,
    }
}

/// Asserts what an accepted spec promises: `rotary_dim / 2` frequencies, each finite, positive
/// and at most `2^20`, and an attention factor in `[1e-3, 1e3]`.
fn assert_bounded(spec: &FrequencySpec, (f, attention): &(Vec<f64>, f64)) {
    assert_eq!(f.len(), spec.rotary_dim as usize / 2, "{spec:?}");
    // Proportional RoPE's pairs past its share have frequency zero; every other is positive.
    let zero_ok = matches!(spec.scaling, RopeScaling::Proportional { .. });
    for (i, &v) in f.iter().enumerate() {
        assert!(
            v.is_finite() && (v > 0.0 || (zero_ok && v == 0.0)) && v <= MAX_INV_FREQ,
            "inv_freq[{i}] = {v} for {spec:?}"
        );
    }
    let (lo, hi) = ATTENTION_RANGE;
    assert!(
        attention.is_finite() && (lo..=hi).contains(attention),
        "attention factor {attention} for {spec:?}"
    );
}

mod build_never_panics_and_accepts_only_bounded_outputs {
    //! Any description, valid or not (edge values in every field): `build` returns; an `Ok` has
    //! bounded outputs; a description breaking a documented domain is rejected, naming one of
    //! the fields it breaks; every error is `Error::Invalid` naming `theta`, `rotary_dim` or
    //! `scaling`.
    use super::*;

    #[test]
    fn any_description_is_bounded_or_rejected_by_name() {
        let accepted = std::cell::Cell::new(0u32);
        let mut runner = runner(20_000);
        let cases = runner.config().cases;
        runner
            .run(&strategies::frequency_spec_any(), |spec| {
                let violations = documented_violations(&spec);
                match spec.build() {
                    Ok(out) => {
                        prop_assert!(violations.is_empty(), "{spec:?} accepted: {violations:?}");
                        assert_bounded(&spec, &out);
                        accepted.set(accepted.get() + 1);
                    }
                    Err(err) => {
                        prop_assert!(
                            matches!(
                                err,
                                Error::Invalid {
                                    arg: "theta" | "rotary_dim" | "scaling",
                                    ..
                                }
                            ),
                            "{spec:?}: {err}"
                        );
                        if violations.is_empty() {
                            // Only the checks on what the formulas compute remain, and only
                            // scaling families have them.
                            prop_assert!(
                                spec.scaling != RopeScaling::Default
                                    && matches!(err, Error::Invalid { arg: "scaling", .. }),
                                "{spec:?} rejected without a documented violation: {err}"
                            );
                        } else {
                            prop_assert!(
                                violations.iter().any(|&v| names(&err, v)),
                                "{spec:?}: {err} names none of {violations:?}"
                            );
                        }
                    }
                }
                Ok(())
            })
            .expect("every description bounded or rejected by name");
        // The strategy mixes plausible values in, so a good share is accepted (about a quarter;
        // one in twenty at the least, whatever ROPE_GPU_CASES caps the cases to).
        let accepted = accepted.get();
        assert!(accepted * 20 > cases, "only {accepted} of {cases} accepted");
    }
}

mod out_of_domain_parameters_are_rejected_by_name {
    //! A published-looking description of each family with exactly one parameter replaced by a
    //! value outside its domain: `Error::Invalid` with that parameter's `arg`, the problem
    //! starting with its config name.
    use super::*;

    /// One float parameter of one family: its `(arg, field)`, its domain, a value inside it,
    /// and a published-looking description with the parameter set to a given value.
    struct Param {
        arg: &'static str,
        field: &'static str,
        domain: Domain,
        inside: f64,
        with: fn(f64) -> FrequencySpec,
    }

    /// One length of one family: its field, the least length it takes (1, or 2 for LongRoPE's
    /// original context), a length it takes, and a published-looking description with the
    /// length set to a given value (`u32` fields take every value below their least).
    struct LengthParam {
        field: &'static str,
        least: u64,
        inside: u64,
        with: fn(u64) -> FrequencySpec,
    }

    fn yarn(f: impl FnOnce(&mut Yarn)) -> FrequencySpec {
        let mut y = Yarn {
            mscale: Some(0.707),
            mscale_all_dim: Some(0.707),
            ..Yarn::new(4.0, 32_768)
        };
        f(&mut y);
        FrequencySpec::new(1e6, 128).scaling(RopeScaling::Yarn(y))
    }

    fn ntk(factor: f64, max: u32, seq_len: u64) -> FrequencySpec {
        FrequencySpec::new(10_000.0, 128).scaling(RopeScaling::DynamicNtk {
            factor,
            max_position_embeddings: max,
            seq_len,
        })
    }

    /// vLLM's `ntk` (gte-multilingual's base and width).
    fn vllm_ntk(factor: f64, mixed_b: Option<f64>) -> FrequencySpec {
        FrequencySpec::new(20_000.0, 64).scaling(RopeScaling::Ntk { factor, mixed_b })
    }

    /// Gemma 4's full-attention layers' proportional RoPE.
    fn gemma4(partial_rotary_factor: f64, factor: f64) -> FrequencySpec {
        FrequencySpec::new(1e6, 512).scaling(RopeScaling::Proportional {
            partial_rotary_factor,
            factor,
        })
    }

    fn llama3(factor: f64, low: f64, high: f64, original: u32) -> FrequencySpec {
        FrequencySpec::new(500_000.0, 128).scaling(RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: original,
        })
    }

    /// LongRoPE's fields, to set one by name.
    struct LongRope {
        short: Vec<f64>,
        long: Vec<f64>,
        factor: Option<f64>,
        original: u32,
        max: u32,
        seq_len: u64,
        attention: Option<f64>,
    }

    fn longrope(f: impl FnOnce(&mut LongRope)) -> FrequencySpec {
        let mut l = LongRope {
            short: vec![1.05; 48],
            long: (0..48).map(|i| 1.0 + i as f64).collect(),
            factor: None,
            original: 4096,
            max: 131_072,
            seq_len: 8192,
            attention: None,
        };
        f(&mut l);
        FrequencySpec::new(10_000.0, 96).scaling(RopeScaling::LongRope {
            short_factor: l.short,
            long_factor: l.long,
            factor: l.factor,
            original_max_position_embeddings: l.original,
            max_position_embeddings: l.max,
            seq_len: l.seq_len,
            attention_factor: l.attention,
        })
    }

    /// `v` as a `u32` field: the lengths below a field's least fit.
    fn u32_length(v: u64) -> u32 {
        u32::try_from(v).expect("a u32 length")
    }

    fn params() -> Vec<Param> {
        use Domain::*;
        let p = |arg, field, domain, inside, with| Param {
            arg,
            field,
            domain,
            inside,
            with,
        };
        vec![
            p("theta", "", Theta(128), 1e4, |v| FrequencySpec::new(v, 128)),
            p("theta", "", ThetaAboveOne, 1e6, |v| FrequencySpec {
                theta: v,
                ..yarn(|_| {})
            }),
            p("scaling", "factor", Factor, 4.0, |v| {
                FrequencySpec::new(10_000.0, 128).scaling(RopeScaling::Linear { factor: v })
            }),
            p("scaling", "factor", Factor, 2.0, |v| ntk(v, 4096, 8192)),
            p("scaling", "factor", Alpha, 8.0, |v| vllm_ntk(v, None)),
            p("scaling", "mixed_b", MixedB, 0.75, |v| {
                vllm_ntk(8.0, Some(v))
            }),
            p("scaling", "partial_rotary_factor", Share, 0.25, |v| {
                gemma4(v, 1.0)
            }),
            p("scaling", "factor", Factor, 1.0, |v| gemma4(0.25, v)),
            p("scaling", "factor", Factor, 4.0, |v| yarn(|y| y.factor = v)),
            p("scaling", "mscale_coefficient", Unit, 0.07, |v| {
                yarn(|y| y.mscale_coefficient = v)
            }),
            p("scaling", "beta_fast", Positive, 32.0, |v| {
                yarn(|y| y.beta_fast = v)
            }),
            p("scaling", "beta_slow", Positive, 1.0, |v| {
                yarn(|y| y.beta_slow = v)
            }),
            p("scaling", "mscale", NonNegative, 0.707, |v| {
                yarn(|y| y.mscale = Some(v))
            }),
            p("scaling", "mscale_all_dim", NonNegative, 0.707, |v| {
                yarn(|y| y.mscale_all_dim = Some(v))
            }),
            p("scaling", "attention_factor", Attention, 1.0, |v| {
                yarn(|y| y.attention_factor = Some(v))
            }),
            p("scaling", "factor", Factor, 8.0, |v| {
                llama3(v, 1.0, 4.0, 8192)
            }),
            p("scaling", "low_freq_factor", Positive, 1.0, |v| {
                llama3(8.0, v, 4.0, 8192)
            }),
            p("scaling", "high_freq_factor", Positive, 4.0, |v| {
                llama3(8.0, 1.0, v, 8192)
            }),
            p("scaling", "factor", Factor, 32.0, |v| {
                longrope(|l| l.factor = Some(v))
            }),
            p("scaling", "short_factor", Factor, 1.05, |v| {
                longrope(|l| l.short[5] = v)
            }),
            p("scaling", "long_factor", Factor, 48.0, |v| {
                longrope(|l| l.long[47] = v)
            }),
            p("scaling", "attention_factor", Attention, 1.2, |v| {
                longrope(|l| l.attention = Some(v))
            }),
        ]
    }

    fn length_params() -> Vec<LengthParam> {
        let p = |field, least, inside, with| LengthParam {
            field,
            least,
            inside,
            with,
        };
        let original = "original_max_position_embeddings";
        let max = "max_position_embeddings";
        vec![
            p(max, 1, 4096, |v| ntk(2.0, u32_length(v), 8192)),
            p("seq_len", 1, 8192, |v| ntk(2.0, 4096, v)),
            p(original, 1, 32_768, |v| {
                yarn(|y| y.original_max_position_embeddings = u32_length(v))
            }),
            p(original, 1, 8192, |v| llama3(8.0, 1.0, 4.0, u32_length(v))),
            p(original, 2, 4096, |v| {
                longrope(|l| l.original = u32_length(v))
            }),
            p(max, 1, 131_072, |v| longrope(|l| l.max = u32_length(v))),
            p("seq_len", 1, 8192, |v| longrope(|l| l.seq_len = v)),
        ]
    }

    #[test]
    fn each_description_is_valid_with_its_parameter_inside_the_domain() {
        let specs = params()
            .into_iter()
            .map(|param| {
                assert!(param.domain.contains(param.inside), "{}", param.field);
                (param.with)(param.inside)
            })
            .chain(length_params().into_iter().map(|param| {
                assert!(param.inside >= param.least, "{}", param.field);
                (param.with)(param.inside)
            }));
        for spec in specs {
            assert!(documented_violations(&spec).is_empty(), "{spec:?}");
            let out = spec.build().expect("valid");
            assert_bounded(&spec, &out);
        }
    }

    #[test]
    fn one_parameter_outside_its_domain_is_rejected_by_name() {
        let all = params();
        let n = all.len();
        runner(20_000)
            .run(
                &(0..n).prop_flat_map(|i| {
                    let domain = params()[i].domain;
                    (
                        Just(i),
                        strategies::edge_f64()
                            .prop_filter("outside the domain", move |&v| !domain.contains(v)),
                    )
                }),
                |(i, v)| {
                    let param = &all[i];
                    let spec = (param.with)(v);
                    let err = spec.build().expect_err("outside the domain");
                    prop_assert!(
                        names(&err, (param.arg, param.field)),
                        "{} = {v}: {err}",
                        param.field
                    );
                    Ok(())
                },
            )
            .expect("one parameter outside its domain");
    }

    /// Lengths are integers, so their domains leave out only the few values below the least:
    /// every one of them is tried.
    #[test]
    fn every_length_below_its_least_is_rejected_by_name() {
        for param in length_params() {
            for v in 0..param.least {
                let spec = (param.with)(v);
                let err = spec.build().expect_err("below the least length");
                assert!(
                    names(&err, ("scaling", param.field)),
                    "{} = {v}: {err}",
                    param.field
                );
            }
        }
    }
}

mod in_domain_descriptions_are_accepted {
    //! Every family over wide ranges inside its documented domain (theta in `(1, 1e7]`, factors
    //! over all of `[2^-20, 2^20]`, lengths up to `2^31`, ...): accepted, with bounded outputs.
    use super::*;

    #[test]
    fn descriptions_inside_every_domain_are_accepted_with_bounded_outputs() {
        runner(20_000)
            .run(&strategies::frequency_spec_in_domain(), |spec| {
                prop_assert!(documented_violations(&spec).is_empty(), "{spec:?}");
                match spec.build() {
                    Ok(out) => assert_bounded(&spec, &out),
                    Err(err) => prop_assert!(false, "{spec:?} rejected: {err}"),
                }
                Ok(())
            })
            .expect("in-domain descriptions accepted");
    }
}

mod known_answers {
    //! The fuzzer's cases (each accepted before, with non-finite outputs), the
    //! bounds themselves, and published configs that must stay accepted.
    use super::*;

    fn err(spec: FrequencySpec) -> (&'static str, String) {
        match spec.build().expect_err("invalid") {
            Error::Invalid { arg, problem } => (arg, problem),
            other => panic!("not Invalid: {other}"),
        }
    }

    #[test]
    fn yarn_with_theta_1_is_rejected_naming_theta() {
        // ln(theta) = 0 divided the correction range: inv_freq was NaN.
        let (arg, problem) =
            err(FrequencySpec::new(1.0, 64).scaling(RopeScaling::Yarn(Yarn::new(40.0, 4096))));
        assert_eq!(arg, "theta");
        assert!(problem.contains("theta > 1"), "{problem}");
        for theta in [0.5, 1e-3] {
            let (arg, _) = err(
                FrequencySpec::new(theta, 64).scaling(RopeScaling::Yarn(Yarn::new(40.0, 4096)))
            );
            assert_eq!(arg, "theta");
        }
    }

    fn phi3(original: u32) -> FrequencySpec {
        FrequencySpec::new(10_000.0, 96).scaling(RopeScaling::LongRope {
            short_factor: vec![1.0; 48],
            long_factor: vec![4.0; 48],
            factor: None,
            original_max_position_embeddings: original,
            max_position_embeddings: 131_072,
            seq_len: 8192,
            attention_factor: None,
        })
    }

    #[test]
    fn longrope_with_original_context_at_most_1_is_rejected_naming_it() {
        // ln(1) = 0 divided: the attention factor was inf.
        let (arg, problem) = err(phi3(1));
        assert_eq!(arg, "scaling");
        assert_eq!(
            problem,
            "original_max_position_embeddings must be at least 2 (its logarithm divides), got 1"
        );
        assert!(
            err(phi3(0))
                .1
                .starts_with("original_max_position_embeddings ")
        );
    }

    #[test]
    fn subnormal_linear_factor_is_rejected_naming_factor() {
        // inv_freq / 1e-320 was inf.
        let (arg, problem) =
            err(FrequencySpec::new(10_000.0, 64).scaling(RopeScaling::Linear { factor: 1e-320 }));
        assert_eq!(arg, "scaling");
        assert!(problem.starts_with("factor "), "{problem}");
    }

    #[test]
    fn tiny_theta_is_rejected_naming_theta() {
        // theta^(-2i/d) overflowed: in-kernel sin/cos of an infinite angle were NaN.
        let (arg, problem) = err(FrequencySpec::new(1e-300, 64));
        assert_eq!(arg, "theta");
        assert!(problem.contains("2^20"), "{problem}");
    }

    #[test]
    fn bounds_are_inclusive() {
        let linear = |factor| {
            FrequencySpec::new(10_000.0, 64)
                .scaling(RopeScaling::Linear { factor })
                .build()
        };
        let next = |v: f64| f64::from_bits(v.to_bits() + 1);
        let prev = |v: f64| f64::from_bits(v.to_bits() - 1);
        let (lo, hi) = FACTOR_RANGE;
        // The first frequency divided by 2^-20 is 2^20 exactly: the frequency bound.
        assert_eq!(linear(lo).expect("lowest factor").0[0], MAX_INV_FREQ);
        assert!(linear(hi).is_ok());
        assert!(linear(prev(lo)).is_err() && linear(next(hi)).is_err());
        let attention = |a| {
            FrequencySpec::new(1e6, 128)
                .scaling(RopeScaling::Yarn(Yarn {
                    attention_factor: Some(a),
                    ..Yarn::new(4.0, 32_768)
                }))
                .build()
        };
        let (lo, hi) = ATTENTION_RANGE;
        assert!(attention(lo).is_ok() && attention(hi).is_ok());
        assert!(attention(prev(lo)).is_err() && attention(next(hi)).is_err());
    }

    #[test]
    fn computed_attention_factors_outside_the_range_are_rejected() {
        // DeepSeek's ratio with mscale_all_dim far above mscale: 1 / (1 + 0.1 * 1e5 * ln 40).
        let (arg, problem) = err(FrequencySpec::new(10_000.0, 64).scaling(RopeScaling::Yarn(
            Yarn {
                mscale: Some(1.0),
                mscale_all_dim: Some(1e5),
                ..Yarn::new(40.0, 4096)
            },
        )));
        assert_eq!(arg, "scaling");
        assert!(problem.contains("mscale_all_dim"), "{problem}");
    }

    #[test]
    fn longrope_attention_factors_at_the_extreme_lengths_and_factors_stay_in_range() {
        // Integer lengths keep the ratio below 2^31 and the original context at least 2, so a
        // computed factor is at most sqrt(32): no original context sits a hair above 1, where
        // ln(original) ~ 1e-15 would take the factor far past 1e3.
        let longrope = |factor, original, max| {
            FrequencySpec::new(10_000.0, 96).scaling(RopeScaling::LongRope {
                short_factor: vec![1.0; 48],
                long_factor: vec![4.0; 48],
                factor,
                original_max_position_embeddings: original,
                max_position_embeddings: max,
                seq_len: u64::MAX,
                attention_factor: None,
            })
        };
        let (lo, hi) = FACTOR_RANGE;
        for (spec, want) in [
            (
                longrope(None, 2, u32::MAX),
                (1.0 + (f64::from(u32::MAX) / 2.0).ln() / 2f64.ln()).sqrt(),
            ),
            (longrope(None, u32::MAX, 1), 1.0),
            (longrope(Some(hi), 2, 1), 21f64.sqrt()),
            (longrope(Some(lo), u32::MAX, u32::MAX), 1.0),
            (longrope(Some(1.0), 2, u32::MAX), 1.0),
        ] {
            let out = spec.build().expect("in the domain");
            assert_bounded(&spec, &out);
            assert!((out.1 - want).abs() <= 1e-12 * want, "{spec:?}: {}", out.1);
            assert!(out.1 <= 32f64.sqrt());
        }
    }

    #[test]
    fn dynamic_ntk_grown_base_that_overflows_is_rejected() {
        let ntk = |theta, factor, seq_len| {
            err(
                FrequencySpec::new(theta, 64).scaling(RopeScaling::DynamicNtk {
                    factor,
                    max_position_embeddings: 1,
                    seq_len,
                }),
            )
        };
        // The growth is finite (about 2^84) and so is its power d / (d - 2) = 32 / 31, but not
        // the base times it.
        let (arg, problem) = ntk(1e300, 1_048_576.0, u64::MAX);
        assert_eq!(arg, "scaling");
        assert!(problem.starts_with("the grown base"), "{problem}");
        // Below `4e257` no base overflows.
        let spec = FrequencySpec::new(4e257, 4).scaling(RopeScaling::DynamicNtk {
            factor: 1_048_576.0,
            max_position_embeddings: 1,
            seq_len: u64::MAX,
        });
        assert_bounded(&spec, &spec.build().expect("finite grown base"));
        // A factor outside [2^-20, 2^20] is rejected before any of that.
        assert!(ntk(10_000.0, 1e300, 3).1.starts_with("factor must lie"));
    }

    #[test]
    fn dynamic_ntk_needs_rotary_dim_above_2() {
        let (arg, _) = err(
            FrequencySpec::new(10_000.0, 2).scaling(RopeScaling::DynamicNtk {
                factor: 2.0,
                max_position_embeddings: 4096,
                seq_len: 8192,
            }),
        );
        assert_eq!(arg, "rotary_dim");
    }

    #[test]
    fn llama3_blend_stays_within_f_over_factor_and_f_when_the_band_is_one_ulp_wide() {
        // With high_freq_factor one ulp above low_freq_factor, the rounding of
        // original / wavelength puts the unclamped smoothing weight at -1 or 2 for some
        // factors: the blend would then leave [f / factor, f], below zero at factor 8.
        let (theta, d, factor) = (500_000.0, 128, 8.0);
        let base = rope_host::inv_freq(theta, d);
        let mut excursions = 0;
        for (i, &f) in base.iter().enumerate() {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            for (original, k) in [8192u32, 4096, 131_072]
                .into_iter()
                .flat_map(|o| (-6i64..=6).map(move |k| (o, k)))
            {
                // low_freq_factor within a few ulps of original / wavelength, the band one ulp
                // wide.
                let exact = f64::from(original) / wavelen;
                let low = f64::from_bits((exact.to_bits() as i64 + k) as u64);
                let high = f64::from_bits(low.to_bits() + 1);
                let original_f = f64::from(original);
                let in_band = wavelen >= original_f / high && wavelen <= original_f / low;
                let smooth = (original_f / wavelen - low) / (high - low);
                if !in_band || (0.0..=1.0).contains(&smooth) {
                    continue;
                }
                excursions += 1;
                let spec = FrequencySpec::new(theta, d).scaling(RopeScaling::Llama3 {
                    factor,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: original,
                });
                let v = spec.build().expect("in the domain").0[i];
                assert!(
                    v >= f / factor && v <= f,
                    "i {i}, original {original}: {v} outside [{}, {f}]",
                    f / factor
                );
            }
        }
        assert!(excursions > 0, "no rounding excursion to test");
    }

    #[test]
    fn published_configs_are_accepted() {
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * b;
        // Llama 3.1.
        let llama = FrequencySpec::new(500_000.0, 128).scaling(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        });
        // Qwen2.5 with YaRN: factor 4 over 32768, theta 10^6.
        let qwen = FrequencySpec::new(1e6, 128).scaling(RopeScaling::Yarn(Yarn::new(4.0, 32_768)));
        // DeepSeek-V2: mscale 0.707 / 0.707, factor 40 over 4096.
        let deepseek = FrequencySpec::new(10_000.0, 64).scaling(RopeScaling::Yarn(Yarn {
            mscale: Some(0.707),
            mscale_all_dim: Some(0.707),
            ..Yarn::new(40.0, 4096)
        }));
        // gpt-oss: YaRN factor 32 over 4096, theta 150 000, no truncation.
        let gpt_oss = FrequencySpec::new(150_000.0, 64).scaling(RopeScaling::Yarn(Yarn {
            truncate: false,
            ..Yarn::new(32.0, 4096)
        }));
        // Phi-3 LongRoPE, 4096 -> 131072, with factor lists shaped like Phi-3's (short ones
        // near 1, long ones rising from 1 to about 60); Phi-3's configs give no `factor`, and
        // configs that give one set the attention factor by it.
        let phi3 = |factor, seq_len| {
            FrequencySpec::new(10_000.0, 96).scaling(RopeScaling::LongRope {
                short_factor: (0..48).map(|i| 1.0 + i as f64 / 400.0).collect(),
                long_factor: (0..48)
                    .map(|i| 1.0 + (i as f64 / 47.0).powi(2) * 59.0)
                    .collect(),
                factor,
                original_max_position_embeddings: 4096,
                max_position_embeddings: 131_072,
                seq_len,
                attention_factor: None,
            })
        };
        let linear = FrequencySpec::new(10_000.0, 128).scaling(RopeScaling::Linear { factor: 4.0 });
        let ntk = FrequencySpec::new(10_000.0, 128).scaling(RopeScaling::DynamicNtk {
            factor: 2.0,
            max_position_embeddings: 4096,
            seq_len: 16_384,
        });
        let longrope_attention = |s: f64| (1.0 + s.ln() / 4096f64.ln()).sqrt();
        for (spec, attention) in [
            (llama, 1.0),
            (qwen, 0.1 * 4f64.ln() + 1.0),
            (deepseek, 1.0),
            (gpt_oss, 0.1 * 32f64.ln() + 1.0),
            (phi3(None, 2048), longrope_attention(32.0)),
            (phi3(None, 100_000), longrope_attention(32.0)),
            (phi3(Some(32.0), 100_000), longrope_attention(32.0)),
            (phi3(Some(16.0), 2048), longrope_attention(16.0)),
            (phi3(Some(1.0), 2048), 1.0),
            (linear, 1.0),
            (ntk, 1.0),
        ] {
            let out = spec.build().expect("published config");
            assert_bounded(&spec, &out);
            assert!(
                close(out.1, attention),
                "{spec:?}: {} vs {attention}",
                out.1
            );
        }
    }
}
