//! The kernels against the f64 reference on random problems.

use std::collections::BTreeMap;
use std::sync::Arc;

use proptest::prelude::*;
use rope_harness::case::{
    Case, Comparison, DTypeCase, KCase, LayoutKind, PosCase, Source, run_and_check,
};
use rope_host::TableFormat;
use rope_host::cudarc::driver::CudaStream;
use rope_host::{Direction, IdsShape, Rope, RopeStyle};
use rope_tests::gpu::gpu_or_skip;
use rope_tests::strategies;

use super::super::{report, runner};

/// A small f32 case to build variations on.
fn base(style: RopeStyle) -> Case {
    Case {
        style,
        direction: Direction::Forward,
        dtype: DTypeCase::F32,
        batch: 2,
        seq: 4,
        heads: 3,
        head_dim: 8,
        rotary_dim: 8,
        rotary_offset: 0,
        layout: LayoutKind::Bshd,
        k: KCase::None,
        source: Source::Theta(10_000.0),
        positions: PosCase::Offset(0),
        in_place: false,
        seed: 5,
    }
}

/// Runs up to `cases` random cases of `strategy` on the GPU against the f64 reference
/// ([`run_and_check`]), failing on the first mismatch, and reports per `form(case)`: cases,
/// elements, largest error and the worst error/tolerance ratio, as `GPU {form}{what}`.
pub(crate) fn check_random_cases(
    name: &str,
    cases: u32,
    strategy: impl Strategy<Value = Case>,
    form: impl Fn(&Case) -> String,
    what: &str,
) {
    let Some((stream, rope)) = gpu_or_skip(name) else {
        return;
    };
    let stats = std::cell::RefCell::new(BTreeMap::<String, (usize, Comparison)>::new());
    runner(cases)
        .run(&strategy, |case| {
            let cmp = run_and_check(&case, &rope, &stream)
                .map_err(|e| TestCaseError::fail(format!("{e}\n{case:?}")))?;
            let mut s = stats.borrow_mut();
            let entry = s.entry(form(&case)).or_default();
            entry.0 += 1;
            entry.1 = entry.1.merge(cmp);
            Ok(())
        })
        .expect("GPU output matches the reference");
    for (form, (cases, c)) in stats.into_inner() {
        report(&format!(
            "GPU {form}{what} vs f64 reference: {cases} random cases, {} elements, max abs error {:.3e}, worst error/tolerance {:.3}",
            c.checked, c.max_abs_err, c.worst_ratio
        ));
    }
}

/// Every style, direction, dtype, layout (strided with gaps and offsets included), partial
/// rotary, q alone or with k (separate with GQA head counts, or fused in one QKV buffer),
/// sin/cos source and table format, position kind (packed varlen included), in or out of
/// place, on random shapes and fresh random data. Per dtype, by
/// [`rope_harness::tolerance`]'s rule: f32 within 8 units of `2^-24 (|a| + |b|)` of the f64
/// reference, f16/bf16 within one ulp of their type at it plus that; NaN exactly where an id
/// falls outside the table; every output element written, nothing else touched.
#[test]
fn kernels_match_reference_on_random_cases() {
    check_random_cases(
        "kernels_match_reference_on_random_cases",
        1500,
        strategies::case(),
        |case| format!("{:?}", case.dtype),
        "",
    );
}

/// Prefill-sized rotations of q alone or with k, of either pairing and every element type,
/// forward and backward, which the planner gives the fused four-heads kernels (their layouts,
/// sources and positions as random as [`kernels_match_reference_on_random_cases`]'s; those
/// whose alignment narrows the access stay on the RoPE kernels): within the same tolerances of
/// the f64 reference, every output element written, nothing else touched.
#[test]
fn prefill_rotations_on_the_fused_kernels_match_reference() {
    check_random_cases(
        "prefill_rotations_on_the_fused_kernels_match_reference",
        24,
        strategies::prefill_case(),
        |case| format!("{:?} prefill", case.dtype),
        "",
    );
}

/// Packed sequences split over 1 to 8 context-parallel ranks (whole `cu_seqlens`, random
/// cuts, empty sequences, a random rank), with every other option of
/// [`kernels_match_reference_on_random_cases`] and its tolerances: the kernel's derived
/// positions match the reference's chunks.
#[test]
fn context_parallel_cases_match_reference() {
    check_random_cases(
        "context_parallel_cases_match_reference",
        400,
        strategies::context_parallel_case(),
        |case| format!("{:?}", case.dtype),
        " context-parallel",
    );
}

/// Backward applied to the forward output on the GPU returns the input (f32, to tolerance).
#[test]
fn backward_undoes_forward_on_gpu() {
    let Some((stream, rope)) = gpu_or_skip("backward_undoes_forward_on_gpu") else {
        return;
    };
    runner(64)
        .run(&strategies::case(), |mut case| {
            // Out-of-table ids give NaN both ways; keep to covered positions, q alone, f32.
            case.positions = PosCase::Offset(0);
            case.dtype = DTypeCase::F32;
            case.k = KCase::None;
            case.direction = Direction::Forward;
            case.in_place = true;
            let fail = |e: String| TestCaseError::fail(format!("{e}\n{case:?}"));
            let mut dev = case
                .upload::<f32>(&stream)
                .map_err(|e| fail(e.to_string()))?;
            let x = stream
                .clone_dtoh(&dev.q.x)
                .map_err(|e| fail(e.to_string()))?;
            dev.launch(&rope).map_err(|e| fail(e.to_string()))?;
            dev.case.direction = Direction::Backward;
            dev.launch(&rope).map_err(|e| fail(e.to_string()))?;
            let z = stream
                .clone_dtoh(&dev.q.x)
                .map_err(|e| fail(e.to_string()))?;
            for (i, (&a, &b)) in x.iter().zip(&z).enumerate() {
                prop_assert!(
                    (a - b).abs() <= 4e-6 * (1.0 + a.abs()),
                    "element {i}: {a} -> {b}\n{case:?}"
                );
            }
            Ok(())
        })
        .expect("backward undoes forward");
}

/// Explicit ids outside the table (negative or too large) make that token's outputs NaN and
/// leave every other token correct: never a read outside the table.
#[test]
fn ids_outside_the_table_give_nan() {
    let Some((stream, rope)) = gpu_or_skip("ids_outside_the_table_give_nan") else {
        return;
    };
    for (style, wide, format) in [
        (RopeStyle::Neox, false, TableFormat::Separate),
        (RopeStyle::Interleaved, true, TableFormat::Combined),
    ] {
        let far = if wide { 1i64 << 40 } else { i32::MAX as i64 };
        let case = Case {
            source: Source::Table {
                theta: 10_000.0,
                max_position: 10,
                format,
                in_f32: false,
            },
            positions: PosCase::Ids {
                ids: vec![0, -1, 9, 10, far, 3, -far, 2],
                wide,
                shape: IdsShape::PerRow,
            },
            ..base(style)
        };
        let cmp = check(&case, &stream, &rope);
        assert_eq!(
            cmp.checked,
            4 * 3 * 8,
            "ids -1, 10, {far} and -{far} are outside 0..10"
        );
    }
}

/// Grids for a million tokens and for tens of thousands of heads launch and are correct.
#[test]
fn huge_token_and_head_counts_launch() {
    let Some((stream, rope)) = gpu_or_skip("huge_token_and_head_counts_launch") else {
        return;
    };
    for (batch, seq, heads) in [
        (1usize, 1usize << 20, 1usize),
        (3, 1, 70_000),
        (1, 70_000, 2),
    ] {
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            let case = Case {
                batch,
                seq,
                heads,
                head_dim: 2,
                rotary_dim: 2,
                seed: 9,
                ..base(style)
            };
            let cmp = check(&case, &stream, &rope);
            assert_eq!(cmp.checked, batch * seq * heads * 2);
        }
    }
}

fn check(case: &Case, stream: &Arc<CudaStream>, rope: &Rope) -> Comparison {
    run_and_check(case, rope, stream).unwrap_or_else(|e| panic!("{e}\n{case:?}"))
}
