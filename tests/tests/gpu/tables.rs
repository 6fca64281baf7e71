//! Tables built on the GPU by `Rope::build_tables`.

use proptest::prelude::*;
use rope_harness::case::{
    Case, DTypeCase, DeviceTables, KCase, LayoutKind, PosCase, Source, TestElem,
};
use rope_harness::with_elem;
use rope_host::{Direction, RopeStyle, SinCosTables, TableData, TableFormat};
use rope_tests::gpu::gpu_or_skip;
use rope_tests::strategies;

use super::super::runner;

/// Downloads `(cos, sin)` as `[max_position, rotary_dim / 2]` rows whatever the format.
fn download<T: TestElem>(
    t: &SinCosTables<T>,
    stream: &std::sync::Arc<rope_host::cudarc::driver::CudaStream>,
    half: usize,
) -> (Vec<T>, Vec<T>) {
    match t.data() {
        TableData::Separate { cos, sin } => (
            stream.clone_dtoh(cos).expect("download"),
            stream.clone_dtoh(sin).expect("download"),
        ),
        TableData::Combined(cache) => {
            let all = stream.clone_dtoh(cache).expect("download");
            let rows = all.chunks(2 * half);
            (
                rows.clone().flat_map(|r| r[..half].to_vec()).collect(),
                rows.flat_map(|r| r[half..].to_vec()).collect(),
            )
        }
    }
}

/// Every entry is within one ulp of the type of the exact f64 value (or `2^-28` absolute near
/// zeros, the f64 angle's own error: [`rope_harness::tolerance::table_entry`]), for every
/// dtype and format.
#[test]
fn built_tables_match_f64_cos_sin() {
    let Some((stream, rope)) = gpu_or_skip("built_tables_match_f64_cos_sin") else {
        return;
    };
    fn check<T: TestElem + rope_host::cudarc::driver::ValidAsZeroBits>(
        rope: &rope_host::Rope,
        stream: &std::sync::Arc<rope_host::cudarc::driver::CudaStream>,
        (theta, half, rows, combined): (f64, usize, usize, bool),
    ) -> Result<(), TestCaseError> {
        let format = if combined {
            TableFormat::Combined
        } else {
            TableFormat::Separate
        };
        let t = rope
            .build_tables::<T>(theta, 2 * half as u32, rows, format)
            .expect("valid");
        let (cos, sin) = download(&t, stream, half);
        let (want_cos, want_sin) = rope_reference::reference::tables(theta, 2 * half, rows);
        for (got, want) in cos.iter().zip(&want_cos).chain(sin.iter().zip(&want_sin)) {
            let tol = rope_harness::tolerance::table_entry::<T>(*want);
            prop_assert!(
                (got.to_f64() - want).abs() <= tol,
                "{}: {:?} vs {want}",
                T::NAME,
                got
            );
        }
        Ok(())
    }
    runner(48)
        .run(
            &(
                2.0f64..2e6,
                1usize..=128,
                1usize..5000,
                any::<bool>(),
                strategies::dtype(),
            ),
            |(theta, half, rows, combined, dtype)| {
                let p = (theta, half, rows, combined);
                with_elem!(dtype, T => check::<T>(&rope, &stream, p))
            },
        )
        .expect("built tables match f64");
}

/// In f32, RoPE from built tables is bit-identical to RoPE with in-kernel sin/cos: the same
/// arithmetic produces the same cos/sin.
#[test]
fn built_tables_reproduce_in_kernel_sin_cos_exactly() {
    let Some((stream, rope)) = gpu_or_skip("built_tables_reproduce_in_kernel_sin_cos_exactly")
    else {
        return;
    };
    for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
        for format in [TableFormat::Separate, TableFormat::Combined] {
            let case = Case {
                style,
                direction: Direction::Forward,
                dtype: DTypeCase::F32,
                batch: 2,
                seq: 40,
                heads: 5,
                head_dim: 64,
                rotary_dim: 48,
                rotary_offset: 0,
                layout: LayoutKind::Bshd,
                k: KCase::Separate { heads: 2 },
                source: Source::Theta(500_000.0),
                positions: PosCase::Offset(3),
                in_place: false,
                seed: 77,
            };
            let run = |dev: &mut rope_harness::case::DeviceCase<f32>| -> Vec<f32> {
                dev.launch(&rope).expect("launch");
                let q = dev.q.out.as_ref().expect("out of place");
                stream.clone_dtoh(q).expect("download")
            };
            let mut computed = case.upload::<f32>(&stream).expect("upload");
            let a = run(&mut computed);
            let mut tabled = case.upload::<f32>(&stream).expect("upload");
            let built = rope
                .build_tables::<f32>(500_000.0, 48, 48, format)
                .expect("valid");
            tabled.tables = Some(match built.into_data() {
                TableData::Separate { cos, sin } => DeviceTables::Separate(cos, sin),
                TableData::Combined(cache) => DeviceTables::Combined(cache),
            });
            tabled.case.source = Source::Table {
                theta: 500_000.0,
                max_position: 48,
                format,
                in_f32: false,
            };
            let b = run(&mut tabled);
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{style:?} {format:?}"
            );
        }
    }
}

/// Invalid table requests return errors naming the argument.
#[test]
fn invalid_table_requests_are_rejected() {
    let Some((_stream, rope)) = gpu_or_skip("invalid_table_requests_are_rejected") else {
        return;
    };
    for (theta, rotary, rows, arg) in [
        (0.0, 64, 10, "theta"),
        (f64::NAN, 64, 10, "theta"),
        (1e4, 63, 10, "rotary_dim"),
        (1e4, 0, 10, "rotary_dim"),
        (1e4, 64, 0, "max_position"),
        (1e4, 64, usize::MAX, "max_position"),
    ] {
        let err = rope
            .build_tables::<f32>(theta, rotary, rows, TableFormat::Separate)
            .expect_err("invalid");
        assert!(
            matches!(err, rope_host::Error::Invalid { arg: a, .. } if a == arg),
            "{err}"
        );
    }
}
