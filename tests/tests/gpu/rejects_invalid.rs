//! Invalid descriptions: a typed error naming the argument, nothing launched, outputs untouched,
//! and the device still healthy afterwards.

use proptest::prelude::*;
use rope_harness::case::{
    Case, DTypeCase, DeviceCase, DeviceTables, KCase, LayoutKind, PosCase, Source,
};
use rope_host::TableFormat;
use rope_host::{
    DeviceInts, Error, IdsShape, Io, Layout, Positions, QkIo, RopeConfig, RopeOp, SinCos,
    TableShape, Tensor, TensorMut,
};
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
    TableWrongWidth,
    WrongRowOffsetCount,
    WrongIdCount,
    BadTheta(f64),
    CuSeqlensTooShort,
    VarlenOffsetsOfAnotherType,
    KSeqMismatch,
    FusedOverlap,
    OverlappingStrides,
}

impl Breakage {
    fn arg(self, case: &Case) -> &'static str {
        match self {
            Self::ShortInput | Self::HeadDimMismatch | Self::OverlappingStrides => "q",
            Self::ShortOutput if case.in_place => "q",
            Self::ShortOutput => "q.output",
            Self::TableTooShort
            | Self::WrongRowOffsetCount
            | Self::WrongIdCount
            | Self::CuSeqlensTooShort
            | Self::VarlenOffsetsOfAnotherType => "positions",
            Self::TablesDiffer => "sincos.sin",
            Self::TableNotWholeRows => "sincos.cos",
            Self::TableWrongWidth => "sincos",
            Self::BadTheta(_) => "theta",
            Self::KSeqMismatch | Self::FusedOverlap => "k",
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
        Just(Breakage::TableWrongWidth),
        Just(Breakage::WrongRowOffsetCount),
        Just(Breakage::WrongIdCount),
        prop_oneof![
            Just(0.0),
            Just(-10_000.0),
            Just(f64::NAN),
            Just(f64::INFINITY)
        ]
        .prop_map(Breakage::BadTheta),
        Just(Breakage::CuSeqlensTooShort),
        Just(Breakage::VarlenOffsetsOfAnotherType),
        Just(Breakage::KSeqMismatch),
        Just(Breakage::FusedOverlap),
        Just(Breakage::OverlappingStrides),
    ]
}

/// Shapes a random case so that `b` applies to it: f32, q alone in a contiguous layout unless
/// the breakage is about k, with the sin/cos and positions the breakage needs.
fn fit(mut case: Case, b: Breakage) -> Case {
    case.dtype = DTypeCase::F32;
    case.layout = LayoutKind::Bshd;
    case.k = KCase::None;
    case.source = Source::Theta(10_000.0);
    case.positions = PosCase::Offset(0);
    match b {
        Breakage::TableTooShort
        | Breakage::TablesDiffer
        | Breakage::TableNotWholeRows
        | Breakage::TableWrongWidth => {
            let format = TableFormat::Separate;
            case.source = Source::Table {
                theta: 10_000.0,
                max_position: case.seq + 4,
                format,
                in_f32: false,
            };
            if case.rotary_dim == 2 {
                // With one pair per row every length is whole rows.
                case.head_dim += 2;
                case.rotary_dim = 4;
            }
        }
        Breakage::WrongRowOffsetCount => {
            case.positions = PosCase::RowOffsets {
                offsets: vec![0; case.batch],
                wide: false,
            }
        }
        Breakage::WrongIdCount => {
            case.positions = PosCase::Ids {
                ids: vec![0; case.seq],
                wide: true,
                shape: IdsShape::Shared,
            }
        }
        Breakage::CuSeqlensTooShort | Breakage::VarlenOffsetsOfAnotherType => case.batch = 1,
        Breakage::KSeqMismatch => case.k = KCase::Separate { heads: 1 },
        Breakage::FusedOverlap => {
            case.in_place = true;
            case.k = KCase::Packed {
                heads: 1,
                v_heads: 0,
            };
        }
        Breakage::OverlappingStrides => case.in_place = true,
        _ => {}
    }
    case
}

/// Launches `dev` with breakage `b` applied.
fn run_broken(
    dev: &mut DeviceCase<f32>,
    b: Breakage,
    rope: &rope_host::Rope,
) -> rope_host::Result<()> {
    let c = dev.case.clone();
    let half = c.rotary_dim / 2;
    let config = c.config()?;
    let mut layout = c.layout(c.heads);
    let stream = rope.stream();
    let row_offsets = stream.clone_htod(&vec![0i32; c.batch + 1])?;
    let cu = match b {
        Breakage::CuSeqlensTooShort => stream.clone_htod(&[0i32])?,
        _ => stream.clone_htod(&[0, c.seq as i32])?,
    };
    let wide_offsets = stream.clone_htod(&[0i64])?;
    let positions = match (b, &dev.ids) {
        (Breakage::TableTooShort, _) => Positions::Offset(5),
        (Breakage::WrongRowOffsetCount, _) => {
            Positions::RowOffsets(DeviceInts::I32(row_offsets.as_view()))
        }
        (Breakage::CuSeqlensTooShort | Breakage::VarlenOffsetsOfAnotherType, _) => {
            Positions::Varlen {
                cu_seqlens: DeviceInts::I32(cu.as_view()),
                offsets: matches!(b, Breakage::VarlenOffsetsOfAnotherType)
                    .then(|| DeviceInts::I64(wide_offsets.as_view())),
            }
        }
        (Breakage::WrongIdCount, Some(rope_harness::case::DeviceArrays::I64(ids, _))) => {
            Positions::Ids {
                ids: DeviceInts::I64(ids.slice(..ids.len() - 1)),
                shape: IdsShape::Shared,
            }
        }
        _ => Positions::Offset(0),
    };
    let max_position = match c.source {
        Source::Table { max_position, .. } => max_position,
        Source::Theta(_) => 0,
    };
    let shape = TableShape {
        max_position,
        rotary_dim: if let Breakage::TableWrongWidth = b {
            c.rotary_dim as u32 / 2
        } else {
            c.rotary_dim as u32
        },
    };
    let sincos = match (&dev.tables, b) {
        (_, Breakage::BadTheta(theta)) => SinCos::Computed { theta },
        (Some(DeviceTables::Separate(cos, sin)), Breakage::TablesDiffer) => SinCos::Table {
            cos: cos.as_view(),
            sin: sin.slice(..sin.len() - half),
            shape,
        },
        (Some(DeviceTables::Separate(cos, sin)), Breakage::TableNotWholeRows) => SinCos::Table {
            cos: cos.slice(..cos.len() - 1),
            sin: sin.slice(..sin.len() - 1),
            shape,
        },
        (Some(DeviceTables::Separate(cos, sin)), _) => SinCos::Table {
            cos: cos.as_view(),
            sin: sin.as_view(),
            shape,
        },
        _ => SinCos::Computed { theta: 10_000.0 },
    };
    let op = RopeOp {
        config,
        positions,
        sincos,
    };
    if let Breakage::HeadDimMismatch = b {
        layout = Layout::bshd(c.batch, c.seq, c.heads, c.head_dim + 2);
    }
    if let Breakage::OverlappingStrides = b {
        // Heads one element apart: every head shares all but one element with the next.
        let token = c.heads + c.head_dim;
        layout = Layout::strided(
            [c.batch, c.seq, c.heads + 1, c.head_dim],
            [c.seq * token, token, 1, 1],
            0,
        )?;
    }
    if let KCase::Packed { .. } = c.k {
        let (q, k, _) = c.packed_layouts();
        // FusedOverlap: k starts inside q's last head.
        let k = k.with_offset(k.offset() - 1);
        return rope.run_qk(
            &op,
            QkIo::Packed {
                data: dev.q.x.as_view_mut(),
                q,
                k,
            },
        );
    }
    let n = dev.q.x.len();
    let out_layout = Layout::bshd(c.batch, c.seq, c.heads, c.head_dim);
    let q = match (&mut dev.q.out, b) {
        (None, Breakage::ShortInput | Breakage::ShortOutput) => Io::InPlace(TensorMut {
            data: dev.q.x.slice_mut(..n - 1),
            layout,
        }),
        (None, _) => Io::InPlace(TensorMut {
            data: dev.q.x.as_view_mut(),
            layout,
        }),
        (Some(out), Breakage::ShortInput) => Io::OutOfPlace {
            input: Tensor {
                data: dev.q.x.slice(..n - 1),
                layout,
            },
            output: TensorMut {
                data: out.as_view_mut(),
                layout: out_layout,
            },
        },
        (Some(out), Breakage::ShortOutput) => {
            let m = out.len();
            Io::OutOfPlace {
                input: Tensor {
                    data: dev.q.x.as_view(),
                    layout,
                },
                output: TensorMut {
                    data: out.slice_mut(..m - 1),
                    layout: out_layout,
                },
            }
        }
        (Some(out), _) => Io::OutOfPlace {
            input: Tensor {
                data: dev.q.x.as_view(),
                layout,
            },
            output: TensorMut {
                data: out.as_view_mut(),
                layout: out_layout,
            },
        },
    };
    match (b, dev.k.as_mut()) {
        (Breakage::KSeqMismatch, Some(k)) => {
            // k claims one token more per row than q.
            let kl = Layout::bshd(c.batch, c.seq + 1, 1, c.head_dim);
            let k_io = Io::InPlace(TensorMut {
                data: k.x.as_view_mut(),
                layout: kl,
            });
            rope.run_qk(&op, QkIo::Separate { q, k: k_io })
        }
        _ => rope.run(&op, q),
    }
}

/// Random valid problems, each broken one way: the error names the argument, the outputs
/// hold exactly what they held before, and a valid launch afterwards succeeds (no GPU fault).
#[test]
fn invalid_descriptions_are_rejected_and_outputs_untouched() {
    let Some((stream, rope)) =
        gpu_or_skip("invalid_descriptions_are_rejected_and_outputs_untouched")
    else {
        return;
    };
    runner(300)
        .run(&(strategies::case(), breakage()), |(case, b)| {
            let case = fit(case, b);
            let fail = |e: String| TestCaseError::fail(format!("{e}\n{case:?} {b:?}"));
            let mut dev = case
                .upload::<f32>(&stream)
                .map_err(|e| fail(e.to_string()))?;
            let snapshot = |dev: &DeviceCase<f32>| -> Result<Vec<Vec<f32>>, TestCaseError> {
                let mut bufs = vec![&dev.q.x];
                bufs.extend(dev.q.out.as_ref());
                if let Some(k) = &dev.k {
                    bufs.push(&k.x);
                    bufs.extend(k.out.as_ref());
                }
                bufs.into_iter()
                    .map(|b| stream.clone_dtoh(b).map_err(|e| fail(e.to_string())))
                    .collect()
            };
            let before = snapshot(&dev)?;
            let err =
                run_broken(&mut dev, b, &rope).expect_err("a broken description must be rejected");
            match &err {
                Error::Invalid { arg, .. } => {
                    prop_assert_eq!(*arg, b.arg(&case), "{} for {:?}", err, b)
                }
                other => prop_assert!(false, "expected Error::Invalid for {:?}, got {}", b, other),
            }
            let after = snapshot(&dev)?;
            let same = before
                .iter()
                .flatten()
                .zip(after.iter().flatten())
                .all(|(x, y)| x.to_bits() == y.to_bits());
            prop_assert!(same, "a buffer changed after a rejected launch");
            dev.launch(&rope).map_err(|e| fail(e.to_string()))?;
            stream.synchronize().map_err(|e| fail(e.to_string()))?;
            Ok(())
        })
        .expect("invalid descriptions rejected");
}

/// A last stride other than 1 is refused when the layout is built.
#[test]
fn non_contiguous_heads_are_refused() {
    let err = Layout::strided([1, 2, 3, 4], [24, 12, 4, 2], 0).expect_err("stride 2");
    assert!(matches!(err, Error::Invalid { arg: "layout", .. }), "{err}");
    let _ = RopeConfig::builder(8, rope_host::RopeStyle::Neox)
        .build()
        .expect("valid");
}

/// A buffer from another CUDA context than the `Rope`'s is refused with the argument named,
/// whichever argument it is, and the launch's other buffers are untouched.
#[test]
fn buffers_from_another_context_are_refused() {
    use rope_host::cudarc::driver::{CudaContext, CudaViewMut};
    let Some((stream, rope)) = gpu_or_skip("buffers_from_another_context_are_refused") else {
        return;
    };
    let other = CudaContext::new_non_primary(stream.context().ordinal(), 0)
        .expect("a second context on the same device");
    let theirs = other.default_stream();
    let layout = Layout::bshd(1, 4, 2, 8);
    let config = RopeConfig::builder(8, rope_host::RopeStyle::Neox)
        .build()
        .expect("valid");
    let op = |positions, sincos| RopeOp {
        config,
        positions,
        sincos,
    };
    let computed = || SinCos::Computed { theta: 10_000.0 };
    let arg = |r: rope_host::Result<()>| match r {
        Err(Error::Invalid { arg, .. }) => arg,
        other => panic!("expected Error::Invalid, got {other:?}"),
    };
    let ones = vec![1.0f32; 64];
    let mut ours = stream.clone_htod(&ones).expect("upload");
    let mut foreign = theirs.clone_htod(&ones).expect("upload");
    fn in_place(data: CudaViewMut<'_, f32>) -> Io<'_, f32> {
        let layout = Layout::bshd(1, 4, 2, 8);
        Io::InPlace(TensorMut { data, layout })
    }

    let r = rope.run(
        &op(Positions::Offset(0), computed()),
        in_place(foreign.as_view_mut()),
    );
    assert_eq!(arg(r), "q");
    let io = Io::OutOfPlace {
        input: Tensor {
            data: ours.as_view(),
            layout,
        },
        output: TensorMut {
            data: foreign.as_view_mut(),
            layout,
        },
    };
    assert_eq!(
        arg(rope.run(&op(Positions::Offset(0), computed()), io)),
        "q.output"
    );

    let ids = theirs.clone_htod(&[0i64, 1, 2, 3]).expect("upload");
    let positions = Positions::Ids {
        ids: DeviceInts::I64(ids.as_view()),
        shape: IdsShape::Shared,
    };
    let r = rope.run(&op(positions, computed()), in_place(ours.as_view_mut()));
    assert_eq!(arg(r), "positions");

    let table = theirs.clone_htod(&[1.0f32; 64]).expect("upload");
    let sincos = SinCos::CosSinCache {
        cache: table.as_view(),
        shape: TableShape {
            max_position: 8,
            rotary_dim: 8,
        },
    };
    let r = rope.run(
        &op(Positions::Offset(0), sincos),
        in_place(ours.as_view_mut()),
    );
    assert_eq!(arg(r), "sincos");

    let frequencies = rope_host::Rope::new(theirs.clone())
        .expect("a handle in the other context")
        .frequencies(&rope_host::FrequencySpec::new(10_000.0, 8))
        .expect("valid");
    let r = rope.run(
        &op(Positions::Offset(0), SinCos::Frequencies(&frequencies)),
        in_place(ours.as_view_mut()),
    );
    assert_eq!(arg(r), "sincos");

    // Nothing was launched: our buffer still holds its ones.
    assert_eq!(stream.clone_dtoh(&ours).expect("download"), ones);
}
