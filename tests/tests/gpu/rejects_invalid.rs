//! Invalid descriptions: a typed error naming the argument, nothing launched, outputs untouched,
//! and the device still healthy afterwards.

use proptest::prelude::*;
use rope_host::{Error, IdsShape, Io, Layout, PositionIds, Positions, RopeConfig, RopeOp, SinCos};
use rope_tests::case::{Case, DeviceCase, DeviceIds, PosCase, Source};
use rope_tests::gpu::gpu_or_skip;
use rope_tests::strategies;

use super::super::runner;

/// One way to break a valid launch, and the argument its error must name.
#[derive(Clone, Copy, Debug)]
enum Breakage {
    ShortInput,
    ShortOutput,
    HeadDimMismatch,
    TableTooShort,
    TablesDiffer,
    TableNotWholeRows,
    WrongRowOffsetCount,
    WrongIdCount,
    BadTheta(f64),
}

impl Breakage {
    fn arg(self, case: &Case) -> &'static str {
        match self {
            Self::ShortInput => "x",
            Self::ShortOutput if case.in_place => "x",
            Self::ShortOutput => "output",
            Self::HeadDimMismatch => "layout",
            Self::TableTooShort | Self::WrongRowOffsetCount | Self::WrongIdCount => "positions",
            Self::TablesDiffer | Self::TableNotWholeRows => "sincos",
            Self::BadTheta(_) => "theta",
        }
    }
}

fn breakage() -> impl Strategy<Value = Breakage> {
    prop_oneof![
        Just(Breakage::ShortInput),
        Just(Breakage::ShortOutput),
        Just(Breakage::HeadDimMismatch),
        Just(Breakage::TableTooShort),
        Just(Breakage::TablesDiffer),
        Just(Breakage::TableNotWholeRows),
        Just(Breakage::WrongRowOffsetCount),
        Just(Breakage::WrongIdCount),
        prop_oneof![
            Just(0.0),
            Just(-10_000.0),
            Just(f64::NAN),
            Just(f64::INFINITY)
        ]
        .prop_map(Breakage::BadTheta),
    ]
}

/// Shapes the case so that `b` applies to it (a table for table breakages, and so on).
fn fit(mut case: Case, b: Breakage) -> Case {
    match b {
        Breakage::TableTooShort | Breakage::TablesDiffer | Breakage::TableNotWholeRows => {
            case.source = Source::Table {
                theta: 10_000.0,
                max_position: case.seq + 4,
            };
            case.positions = PosCase::Offset(0);
        }
        Breakage::WrongRowOffsetCount => case.positions = PosCase::RowOffsets(vec![0; case.batch]),
        Breakage::WrongIdCount => {
            case.positions = PosCase::Ids {
                ids: vec![0; case.seq],
                wide: true,
                shape: IdsShape::Shared,
            }
        }
        Breakage::BadTheta(_) => case.source = Source::Theta(10_000.0),
        _ => {}
    }
    if matches!(b, Breakage::TableNotWholeRows) && case.head_dim == 2 {
        case.head_dim = 4; // with one pair per row every length is whole rows
    }
    case
}

/// Launches `dev` with breakage `b` applied.
fn run_broken(dev: &mut DeviceCase, b: Breakage, rope: &rope_host::Rope) -> rope_host::Result<()> {
    let c = dev.case.clone();
    let half = c.head_dim / 2;
    let config = if let Breakage::HeadDimMismatch = b {
        RopeConfig::builder(c.head_dim as u32 + 2, c.style).build()?
    } else {
        c.config()?
    };
    let layout = Layout::bshd(c.batch, c.seq, c.heads, c.head_dim);
    let row_offsets: Vec<u32> = vec![0; c.batch + 1];
    let ids_shape = match &c.positions {
        PosCase::Ids { shape, .. } => *shape,
        _ => IdsShape::Shared,
    };
    let positions = match (b, &dev.ids) {
        (Breakage::TableTooShort, _) => Positions::Offset(5),
        (Breakage::WrongRowOffsetCount, _) => Positions::RowOffsets(&row_offsets),
        (Breakage::WrongIdCount, Some(DeviceIds::I64(ids))) => Positions::Ids {
            ids: PositionIds::I64(ids.slice(..ids.len() - 1)),
            shape: ids_shape,
        },
        (_, Some(DeviceIds::I64(ids))) => Positions::Ids {
            ids: PositionIds::I64(ids.as_view()),
            shape: ids_shape,
        },
        (_, Some(DeviceIds::I32(ids))) => Positions::Ids {
            ids: PositionIds::I32(ids.as_view()),
            shape: ids_shape,
        },
        (_, None) => match &c.positions {
            PosCase::RowOffsets(_) => Positions::RowOffsets(&row_offsets[..c.batch]),
            _ => Positions::Offset(0),
        },
    };
    let sincos = match (&dev.tables, b) {
        (_, Breakage::BadTheta(theta)) => SinCos::Computed { theta },
        (Some((cos, sin)), Breakage::TablesDiffer) => SinCos::Table {
            cos: cos.as_view(),
            sin: sin.slice(..sin.len() - half),
        },
        (Some((cos, sin)), Breakage::TableNotWholeRows) => SinCos::Table {
            cos: cos.slice(..cos.len() - 1),
            sin: sin.slice(..sin.len() - 1),
        },
        (Some((cos, sin)), _) => SinCos::Table {
            cos: cos.as_view(),
            sin: sin.as_view(),
        },
        (None, _) => SinCos::Computed { theta: 10_000.0 },
    };
    let op = RopeOp {
        config,
        layout,
        positions,
        sincos,
    };
    let n = c.len();
    let io = match (&mut dev.out, b) {
        (None, Breakage::ShortInput | Breakage::ShortOutput) => {
            Io::InPlace(dev.x.slice_mut(..n - 1))
        }
        (None, _) => Io::InPlace(dev.x.as_view_mut()),
        (Some(out), Breakage::ShortInput) => Io::OutOfPlace {
            input: dev.x.slice(..n - 1),
            output: out.as_view_mut(),
        },
        (Some(out), Breakage::ShortOutput) => Io::OutOfPlace {
            input: dev.x.as_view(),
            output: out.slice_mut(..n - 1),
        },
        (Some(out), _) => Io::OutOfPlace {
            input: dev.x.as_view(),
            output: out.as_view_mut(),
        },
    };
    rope.run(&op, io)
}

/// Random valid problems, each broken one way: the error names the argument, the output holds
/// exactly what it held before, and a valid launch afterwards succeeds (no GPU fault).
#[test]
fn invalid_descriptions_are_rejected_and_outputs_untouched() {
    let Some((stream, rope)) =
        gpu_or_skip("invalid_descriptions_are_rejected_and_outputs_untouched")
    else {
        return;
    };
    runner(200)
        .run(&(strategies::case(), breakage()), |(case, b)| {
            let case = fit(case, b);
            let mut dev = case
                .upload(&stream)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let before = dev
                .result(&stream)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            let err =
                run_broken(&mut dev, b, &rope).expect_err("a broken description must be rejected");
            match &err {
                Error::Invalid { arg, .. } => {
                    prop_assert_eq!(*arg, b.arg(&case), "{} for {:?}", err, b)
                }
                other => prop_assert!(false, "expected Error::Invalid for {:?}, got {}", b, other),
            }
            let after = dev
                .result(&stream)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(
                before
                    .iter()
                    .zip(&after)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "output changed"
            );
            dev.launch(&rope)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            stream
                .synchronize()
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            Ok(())
        })
        .expect("invalid descriptions rejected");
}
