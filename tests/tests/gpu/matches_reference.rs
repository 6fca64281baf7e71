//! The kernels against the f64 reference on random problems.

use proptest::prelude::*;
use rope_host::{Direction, IdsShape, RopeStyle};
use rope_tests::case::{Case, PosCase, Source, compare};
use rope_tests::gpu::gpu_or_skip;
use rope_tests::strategies;

use super::super::{report, runner};

/// Runs `case` on the GPU and compares it with the reference.
fn check(
    case: &Case,
    stream: &std::sync::Arc<rope_host::cudarc::driver::CudaStream>,
    rope: &rope_host::Rope,
) -> Result<rope_tests::case::Comparison, String> {
    let mut dev = case.upload(stream).map_err(|e| e.to_string())?;
    dev.launch(rope)
        .map_err(|e| format!("launch failed: {e}"))?;
    let got = dev.result(stream).map_err(|e| e.to_string())?;
    compare(
        case,
        &case.input(),
        &got,
        case.reference(&case.input()).view(),
    )
}

/// Every style, direction, sin/cos source, position kind and in/out of place, on random shapes
/// (head_dim 2, seq 1, one head, 130 heads, odd batches) and fresh random data: every element
/// within [`rope_tests::case::f32_tolerance`] of the f64 reference, NaN exactly where an id
/// falls outside the table, no element left unwritten.
#[test]
fn kernels_match_reference_on_random_cases() {
    let Some((stream, rope)) = gpu_or_skip("kernels_match_reference_on_random_cases") else {
        return;
    };
    let stats = std::cell::RefCell::new((0usize, 0usize, 0.0f64, 0.0f64));
    runner(600)
        .run(&strategies::case(), |case| {
            let cmp = check(&case, &stream, &rope)
                .map_err(|e| TestCaseError::fail(format!("{e}\n{case:?}")))?;
            let mut s = stats.borrow_mut();
            s.0 += 1;
            s.1 += cmp.checked;
            s.2 = s.2.max(cmp.max_abs_err);
            s.3 = s.3.max(cmp.worst_ratio);
            Ok(())
        })
        .expect("GPU output matches the reference");
    let (cases, elements, max_err, ratio) = stats.into_inner();
    report(&format!(
        "GPU f32 vs f64 reference: {cases} random cases, {elements} elements, max abs error {max_err:.3e}, worst error/tolerance {ratio:.3}"
    ));
}

/// Backward applied to the forward output on the GPU returns the input.
#[test]
fn backward_undoes_forward_on_gpu() {
    let Some((stream, rope)) = gpu_or_skip("backward_undoes_forward_on_gpu") else {
        return;
    };
    runner(64)
        .run(&strategies::case(), |mut case| {
            if matches!(case.source, Source::Table { .. }) {
                // Out-of-table ids give NaN both ways; keep this property to covered positions.
                case.positions = PosCase::Offset(0);
            }
            case.direction = Direction::Forward;
            case.in_place = false;
            let mut fwd = case
                .upload(&stream)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            fwd.launch(&rope)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let y = fwd
                .result(&stream)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let mut back = Case {
                direction: Direction::Backward,
                in_place: true,
                ..case.clone()
            }
            .upload(&stream)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
            stream
                .memcpy_htod(&y, &mut back.x)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            back.launch(&rope)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let z = back
                .result(&stream)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let x = case.input();
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
    for (style, wide) in [(RopeStyle::Neox, false), (RopeStyle::Interleaved, true)] {
        let far = if wide { 1i64 << 40 } else { i32::MAX as i64 };
        let case = Case {
            style,
            direction: Direction::Forward,
            batch: 2,
            seq: 4,
            heads: 3,
            head_dim: 8,
            source: Source::Table {
                theta: 10_000.0,
                max_position: 10,
            },
            positions: PosCase::Ids {
                ids: vec![0, -1, 9, 10, far, 3, -far, 2],
                wide,
                shape: IdsShape::PerRow,
            },
            in_place: false,
            seed: 5,
        };
        let cmp = check(&case, &stream, &rope).expect("NaN exactly at the out-of-table ids");
        assert!(cmp.checked > 0);
        let nan_tokens = case
            .reference(&case.input())
            .iter()
            .filter(|v| v.is_nan())
            .count()
            / (3 * 8);
        assert_eq!(
            nan_tokens, 4,
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
                style,
                direction: Direction::Forward,
                batch,
                seq,
                heads,
                head_dim: 2,
                source: Source::Theta(10_000.0),
                positions: PosCase::Offset(0),
                in_place: false,
                seed: 9,
            };
            let cmp = check(&case, &stream, &rope)
                .unwrap_or_else(|e| panic!("{batch}x{seq}x{heads}: {e}"));
            assert_eq!(cmp.checked, case.len());
        }
    }
}
