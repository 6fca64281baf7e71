//! Every accepted frequency description or given frequency vector with finite inputs writes only
//! finite values (the one exception, NaN for an explicit id outside a table, is tested in
//! `matches_reference`).

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rope_harness::rotate::rotate_f32_at;
use rope_host::{AngleMode, InvFreq, SinCos, TableFormat};
use rope_tests::gpu::gpu_or_skip;
use rope_tests::strategies;

use super::super::runner;

/// Random inputs in `[-4, 4)` for `[seq, heads, d]` and ids below `max_id`.
fn inputs(seed: u64, (seq, heads, d): (usize, usize, usize), max_id: i64) -> (Vec<f32>, Vec<i64>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let x = (0..seq * heads * d)
        .map(|_| rng.random_range(-4.0f32..4.0))
        .collect();
    let mut ids: Vec<i64> = (0..seq).map(|_| rng.random_range(0..max_id)).collect();
    ids[0] = max_id - 1;
    (x, ids)
}

/// Frequency descriptions of every family, valid or not, and `theta`s from the edges of `f64`:
/// whatever `FrequencySpec::build` and the in-kernel path accept rotates finite inputs at
/// positions below `2^31` into finite outputs, in the kernel and through tables built from the
/// same frequencies.
#[test]
fn accepted_descriptions_write_finite_values() {
    let Some((stream, rope)) = gpu_or_skip("accepted_descriptions_write_finite_values") else {
        return;
    };
    let spec = prop_oneof![
        strategies::frequency_spec_any(),
        strategies::frequency_spec_in_domain()
    ];
    let accepted = std::sync::atomic::AtomicUsize::new(0);
    runner(200)
        .run(
            &(
                spec,
                strategies::edge_f64(),
                strategies::style(),
                any::<u64>(),
            ),
            |(spec, theta, style, seed)| {
                let shape = (8, 2, spec.rotary_dim as usize);
                let all_finite = |out: Vec<f32>| out.iter().all(|v| v.is_finite());
                if let Ok(freqs) = rope.frequencies(&spec) {
                    accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let (x, ids) = inputs(seed, shape, 1 << 31);
                    let sincos = SinCos::Frequencies(&freqs);
                    let out = rotate_f32_at(&rope, &stream, style, &x, shape, &ids, sincos)
                        .map_err(|e| TestCaseError::fail(format!("{spec:?}: {e}")))?;
                    prop_assert!(all_finite(out), "in-kernel, {:?}", spec);
                    let tables = rope
                        .build_tables_for::<f32>(&freqs, 64, TableFormat::Combined)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let (x, ids) = inputs(seed, shape, 64);
                    let out =
                        rotate_f32_at(&rope, &stream, style, &x, shape, &ids, tables.sincos())
                            .map_err(|e| TestCaseError::fail(format!("{spec:?}: {e}")))?;
                    prop_assert!(all_finite(out), "tables, {:?}", spec);
                }
                let d = 2 * (1 + seed % 64) as usize;
                let shape = (8, 2, d);
                let (x, ids) = inputs(seed, shape, 1 << 31);
                let sincos = SinCos::Computed { theta };
                if let Ok(out) = rotate_f32_at(&rope, &stream, style, &x, shape, &ids, sincos) {
                    prop_assert!(all_finite(out), "Computed {{ theta: {} }}, d {}", theta, d);
                }
                Ok(())
            },
        )
        .expect("accepted descriptions write finite values");
    let accepted = accepted.into_inner();
    assert!(accepted > 0, "no description was accepted");
    eprintln!(
        "accepted_descriptions_write_finite_values: {accepted} accepted frequency descriptions"
    );
}

/// Frequency vectors and attention factors given by the caller, in f32 or f64, valid or not
/// (edge values in any entry), in both angle modes: whatever `Rope::frequencies_from` accepts
/// rotates finite inputs at positions below `2^31` into finite outputs.
#[test]
fn accepted_given_frequencies_write_finite_values() {
    let Some((stream, rope)) = gpu_or_skip("accepted_given_frequencies_write_finite_values") else {
        return;
    };
    let entry = || {
        prop_oneof![
            3 => strategies::log_uniform(2f64.powi(-40), 2f64.powi(20)),
            1 => strategies::edge_f64(),
        ]
    };
    let accepted = std::sync::atomic::AtomicUsize::new(0);
    let check =
        |(f, attention, narrow, compat, style, seed): (Vec<f64>, f64, bool, bool, _, u64)| {
            let narrowed: Vec<f32> = f.iter().map(|&v| v as f32).collect();
            let given = if narrow {
                InvFreq::F32(&narrowed)
            } else {
                InvFreq::F64(&f)
            };
            let angle = if compat {
                AngleMode::F32Compat
            } else {
                AngleMode::Exact
            };
            if let Ok(freqs) = rope.frequencies_from(given, attention, angle) {
                accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let shape = (8, 2, freqs.rotary_dim() as usize);
                let (x, ids) = inputs(seed, shape, 1 << 31);
                let sincos = SinCos::Frequencies(&freqs);
                let out = rotate_f32_at(&rope, &stream, style, &x, shape, &ids, sincos)
                    .map_err(|e| TestCaseError::fail(format!("{given:?}: {e}")))?;
                prop_assert!(
                    out.iter().all(|v| v.is_finite()),
                    "{:?}, attention factor {}, {:?}",
                    given,
                    attention,
                    angle
                );
            }
            Ok(())
        };
    // One vector every run accepts (the draws below may accept none at a low case cap).
    let valid = (0..32)
        .map(|i| 10_000f64.powf(-(i as f64) / 32.0))
        .collect();
    check((valid, 1.0, false, false, rope_host::RopeStyle::Neox, 7))
        .expect("a valid vector writes finite values");
    assert_eq!(accepted.load(std::sync::atomic::Ordering::Relaxed), 1);
    runner(200)
        .run(
            &(
                proptest::collection::vec(entry(), 0..=64),
                prop_oneof![
                    3 => strategies::log_uniform(1e-3, 1e3),
                    1 => strategies::edge_f64(),
                ],
                any::<bool>(),
                any::<bool>(),
                strategies::style(),
                any::<u64>(),
            ),
            check,
        )
        .expect("accepted given frequencies write finite values");
    let accepted = accepted.into_inner();
    assert!(accepted > 0, "no given vector was accepted");
    eprintln!("accepted_given_frequencies_write_finite_values: {accepted} accepted vectors");
}
