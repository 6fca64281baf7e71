//! What serving loops need: every launch captured in a CUDA graph and replayed with new
//! positions and data, device metadata that is malformed never reaching outside the tensors,
//! and launches on foreign pointers and streams through `Rope::run_raw`.

use std::sync::Arc;

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rope_harness::case::{Case, DTypeCase, KCase, LayoutKind, PosCase, Source};
use rope_host::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use rope_host::cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use rope_host::{
    ContextParallel, DType, DeviceInts, Direction, IdsShape, IntType, Io, Layout, Positions,
    RawBuf, RawInts, RawIo, RawOp, RawPositions, RawSinCos, RawTensor, RawTensors, Rope,
    RopeConfig, RopeOp, RopeStyle, SinCos, TableFormat, TableShape, TensorMut,
};
use rope_tests::gpu::{combined_cache, gpu_or_skip};

use super::super::{report, runner};

const THETA: f64 = 10_000.0;

/// A stream and handle on device 0 in a context object of their own with cudarc's event
/// tracking off, as graph capture needs (the shared test context keeps it on).
fn untracked(stream: &Arc<CudaStream>) -> (Arc<CudaStream>, Rope) {
    let ctx = CudaContext::new(stream.context().ordinal()).expect("device 0");
    // SAFETY: this context object is used by this test alone, on one stream, so no cross-
    // stream ordering is lost by turning the tracking off.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().expect("stream");
    let rope = Rope::new(stream.clone()).expect("handle");
    (stream, rope)
}

/// One position kind of a case with `batch` rows of `seq` tokens, all positions below 48,
/// drawn from `seed`.
fn positions(kind: usize, batch: usize, seq: usize, seed: u64) -> PosCase {
    let mut rng = StdRng::seed_from_u64(seed);
    let wide = kind % 2 == 1;
    match kind {
        0 => PosCase::Offset(rng.random_range(0..16)),
        1 | 2 => PosCase::RowOffsets {
            offsets: (0..batch).map(|_| rng.random_range(0..16)).collect(),
            wide,
        },
        3 | 4 => PosCase::Ids {
            ids: (0..batch * seq).map(|_| rng.random_range(0..48)).collect(),
            wide,
            shape: IdsShape::PerRow,
        },
        7 | 8 => {
            // Two ranks: whole sequences twice the local `seq`, cut at multiples of 4.
            let cut = 4 * rng.random_range(0..=seq as u32 / 2);
            PosCase::VarlenContextParallel {
                cu_seqlens: vec![0, cut, 2 * seq as u32],
                size: 2,
                rank: rng.random_range(0..2),
                wide,
            }
        }
        _ => {
            let cut = rng.random_range(0..=seq as u32);
            PosCase::Varlen {
                cu_seqlens: vec![0, cut, seq as u32],
                offsets: Some(vec![rng.random_range(0..16), rng.random_range(0..16)]),
                wide,
            }
        }
    }
}

/// Position kinds: offset, row offsets i64/i32, ids i64/i32, varlen i64/i32, varlen split
/// over two context-parallel ranks i64/i32 (see `positions`).
const KINDS: usize = 9;

/// Every position kind (device arrays in `i32` and `i64`) with every sin/cos source (tables of
/// the tensors' type, `f32` tables, in-kernel) and both styles, bf16 and f32, q and a GQA k in
/// one launch: captured into a CUDA graph, replayed after new data and new positions (the same
/// offset for `Positions::Offset`, a launch argument) were written into the same buffers,
/// checked against the f64 reference and bit for bit against an eager launch of the same
/// inputs.
#[test]
fn every_launch_kind_replays_from_a_cuda_graph() {
    let Some((shared, _)) = gpu_or_skip("every_launch_kind_replays_from_a_cuda_graph") else {
        return;
    };
    let (stream, rope) = untracked(&shared);
    rope.prepare(THETA, 16)
        .expect("in-kernel frequencies up front");
    let mut launches = 0;
    for kind in 0..KINDS {
        for (source, dtype) in [
            (0, DTypeCase::BF16),
            (1, DTypeCase::BF16),
            (2, DTypeCase::F32),
            (2, DTypeCase::BF16),
        ] {
            for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
                let varlen = kind >= 5;
                let (batch, seq) = if varlen { (1, 12) } else { (3, 4) };
                let case = |seed: u64| Case {
                    style,
                    direction: Direction::Forward,
                    dtype,
                    batch,
                    seq,
                    heads: 4,
                    head_dim: 16,
                    rotary_dim: 16,
                    rotary_offset: 0,
                    layout: LayoutKind::Bshd,
                    k: KCase::Separate { heads: 2 },
                    source: match source {
                        2 => Source::Theta(THETA),
                        n => Source::Table {
                            theta: THETA,
                            max_position: 48,
                            format: TableFormat::Combined,
                            in_f32: n == 1,
                        },
                    },
                    positions: positions(kind, batch, seq, seed),
                    in_place: false,
                    seed,
                };
                let (first, mut second) = (case(1), case(2));
                match (&first.positions, &mut second.positions) {
                    // An offset is a launch argument: a replay uses the captured one.
                    (PosCase::Offset(_), p) => *p = first.positions.clone(),
                    // So is a context-parallel split; the boundaries are device data.
                    (
                        PosCase::VarlenContextParallel { size, rank, .. },
                        PosCase::VarlenContextParallel {
                            size: size2,
                            rank: rank2,
                            ..
                        },
                    ) => (*size2, *rank2) = (*size, *rank),
                    _ => {}
                }
                rope_harness::with_elem!(dtype, T => {
                    replay::<T>(&rope, &stream, &first, &second);
                });
                launches += 1;
            }
        }
    }
    report(&format!(
        "CUDA graphs: {launches} captured launch kinds replayed with new positions and data"
    ));
}

/// Captures `first`'s launch, rewrites its buffers with `second`'s inputs, replays the graph
/// and checks the result against the reference and against an eager launch.
fn replay<T: rope_harness::case::TestElem>(
    rope: &Rope,
    stream: &Arc<CudaStream>,
    first: &Case,
    second: &Case,
) {
    macro_rules! ok {
        ($e:expr) => {
            $e.unwrap_or_else(|e| panic!("{e}\n{second:?}"))
        };
    }
    let mut dev = ok!(first.upload::<T>(stream));
    ok!(stream.synchronize());
    ok!(stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
    ok!(dev.launch(rope));
    let graph = ok!(stream.end_capture(CUgraphInstantiate_flags(0)));
    let graph = graph.expect("the capture recorded the launch");
    ok!(dev.rewrite(second, stream));
    ok!(graph.launch());
    ok!(stream.synchronize());
    ok!(dev.verify_all(stream));
    let outputs = |dev: &rope_harness::case::DeviceCase<T>| -> Vec<u64> {
        let q = ok!(stream.clone_dtoh(dev.q.out.as_ref().expect("out of place")));
        let k = dev
            .k
            .as_ref()
            .and_then(|k| k.out.as_ref())
            .expect("k out of place");
        let k = ok!(stream.clone_dtoh(k));
        q.iter().chain(&k).map(|v| v.bits()).collect()
    };
    let replayed = outputs(&dev);
    ok!(dev.launch(rope));
    assert_eq!(
        replayed,
        outputs(&dev),
        "graph replay and eager launch differ"
    );
}

/// Random malformed device metadata (row offsets and ids anywhere in `i32`/`i64`, `cu_seqlens`
/// and offsets of any values: decreasing, negative, past the tensor, also with a
/// context-parallel split of up to 65536 ranks) never make the kernel touch
/// memory outside the tensors (guard regions around the output stay intact; run the bundle's
/// `--sanitize` for the device's own check); with tables, every output is a finite rotation or
/// NaN.
#[test]
fn malformed_device_metadata_stays_inside_the_tensors() {
    let Some((stream, rope)) = gpu_or_skip("malformed_device_metadata_stays_inside_the_tensors")
    else {
        return;
    };
    let values = prop_oneof![
        any::<i64>(),
        -40i64..40,
        Just(i64::MIN),
        Just(i64::MAX),
        Just(i32::MIN as i64),
        Just(i32::MAX as i64)
    ];
    let strategy = (
        proptest::collection::vec(values, 1..8),
        proptest::collection::vec(any::<i64>(), 8),
        (0usize..4, any::<bool>(), any::<bool>(), any::<bool>()),
    );
    runner(200)
        .run(&strategy, |(main, aux, (kind, wide, table, neox))| {
            malformed_case(&rope, &stream, (&main, &aux), (kind, wide, table, neox))
        })
        .expect("malformed metadata stays inside the tensors");
}

/// One launch of [`malformed_device_metadata_stays_inside_the_tensors`].
fn malformed_case(
    rope: &Rope,
    stream: &Arc<CudaStream>,
    (main, aux): (&[i64], &[i64]),
    (kind, wide, table, neox): (usize, bool, bool, bool),
) -> Result<(), TestCaseError> {
    let fail = |e: &dyn std::fmt::Display| TestCaseError::fail(e.to_string());
    // 8 tokens of 2 heads of 8 f32 in the middle of a buffer with 256 guard elements a side.
    let (guard, n) = (256usize, 8 * 2 * 8);
    let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let input = stream.clone_htod(&x).map_err(|e| fail(&e))?;
    let mut out = stream
        .clone_htod(&vec![-7.5f32; n + 2 * guard])
        .map_err(|e| fail(&e))?;
    // Row offsets need `batch` entries, ids `tokens`, varlen `count + 1` boundaries: shapes
    // chosen from the random array's own length.
    let (batch, seq) = match kind {
        0 => (main.len(), 1),
        1 => (1, 8),
        _ => (1, 8),
    };
    let main: Vec<i64> = if kind == 1 {
        main.iter().cycle().take(8).copied().collect()
    } else {
        main.to_vec()
    };
    let main = if kind >= 2 && main.len() < 2 {
        vec![main[0], main[0]]
    } else {
        main
    };
    let seqs = main.len().saturating_sub(1);
    let upload = |v: &[i64]| -> Result<DeviceArray, TestCaseError> {
        Ok(if wide {
            DeviceArray::I64(stream.clone_htod(v).map_err(|e| fail(&e))?)
        } else {
            let v: Vec<i32> = v.iter().map(|&x| x as i32).collect();
            DeviceArray::I32(stream.clone_htod(&v).map_err(|e| fail(&e))?)
        })
    };
    let main_dev = upload(&main)?;
    let aux_dev = upload(&aux[..seqs.max(1)])?;
    let tokens = batch * seq;
    let layout = Layout::bshd(batch, seq, 2, 8);
    let x_layout = if kind == 0 {
        layout
    } else {
        Layout::shd(tokens, 2, 8)
    };
    let positions = match kind {
        0 => Positions::RowOffsets(main_dev.view()),
        1 => Positions::Ids {
            ids: main_dev.view(),
            shape: IdsShape::Shared,
        },
        2 => Positions::Varlen {
            cu_seqlens: main_dev.view(),
            offsets: Some(aux_dev.view()),
        },
        _ => {
            // Any split: the sizes multiply local token indices in the kernel's search.
            let size = [2, 3, 8, ContextParallel::MAX_SIZE][aux[0].unsigned_abs() as usize % 4];
            let rank = (aux[1].unsigned_abs() % u64::from(size)) as u32;
            Positions::VarlenContextParallel {
                cu_seqlens: main_dev.view(),
                split: ContextParallel::new(size, rank).map_err(|e| fail(&e))?,
            }
        }
    };
    let tables = rope
        .build_tables::<f32>(THETA, 8, 64, TableFormat::Separate)
        .map_err(|e| fail(&e))?;
    let style = if neox {
        RopeStyle::Neox
    } else {
        RopeStyle::Interleaved
    };
    let op = RopeOp {
        config: RopeConfig::builder(8, style)
            .build()
            .map_err(|e| fail(&e))?,
        positions,
        sincos: if table {
            tables.sincos()
        } else {
            SinCos::Computed { theta: THETA }
        },
    };
    let x_in = if kind == 0 { x.len() } else { tokens * 16 };
    let io = Io::OutOfPlace {
        input: rope_host::Tensor {
            data: input.slice(..x_in),
            layout: x_layout,
        },
        output: TensorMut {
            data: out.slice_mut(guard..guard + x_in),
            layout: x_layout,
        },
    };
    rope.run(&op, io).map_err(|e| fail(&e))?;
    let got = stream.clone_dtoh(&out).map_err(|e| fail(&e))?;
    let outside = got[..guard].iter().chain(&got[guard + x_in..]);
    prop_assert!(
        outside.clone().all(|&v| v == -7.5),
        "a guard element changed"
    );
    if table {
        for pair in got[guard..guard + x_in].chunks(2) {
            prop_assert!(
                pair.iter().all(|v| v.is_nan()) || pair.iter().all(|v| v.is_finite()),
                "{pair:?}"
            );
        }
    }
    Ok(())
}

/// A device array of either integer type.
enum DeviceArray {
    I32(rope_host::cudarc::driver::CudaSlice<i32>),
    I64(rope_host::cudarc::driver::CudaSlice<i64>),
}

impl DeviceArray {
    fn view(&self) -> DeviceInts<'_> {
        match self {
            Self::I32(s) => DeviceInts::I32(s.as_view()),
            Self::I64(s) => DeviceInts::I64(s.as_view()),
        }
    }
}

/// `Rope::run_raw` on raw device pointers and a raw stream of another handle gives, bit for
/// bit, what the safe API gives on the same inputs: positions from device row offsets, an f32
/// `cos_sin_cache` with bf16 tensors, q and k in place in one fused buffer.
#[test]
fn raw_pointers_and_streams_match_the_safe_api() {
    let Some((stream, rope)) = gpu_or_skip("raw_pointers_and_streams_match_the_safe_api") else {
        return;
    };
    use rope_host::half::bf16;
    let (batch, seq, hq, hk, d) = (2usize, 5usize, 4usize, 2usize, 32usize);
    let token = (hq + hk) * d;
    let data: Vec<bf16> = (0..batch * seq * token)
        .map(|i| bf16::from_f32((i as f32 * 0.61).cos()))
        .collect();
    let offsets = stream.clone_htod(&[7i32, 30]).expect("upload");
    let tables = rope
        .build_tables::<f32>(THETA, d as u32, 64, TableFormat::Combined)
        .expect("tables");
    let q = Layout::strided([batch, seq, hq, d], [seq * token, token, d, 1], 0).expect("q");
    let k = Layout::strided([batch, seq, hk, d], [seq * token, token, d, 1], hq * d).expect("k");
    let config = RopeConfig::builder(d as u32, RopeStyle::Neox)
        .build()
        .expect("config");

    let mut safe = stream.clone_htod(&data).expect("upload");
    let op = RopeOp {
        config,
        positions: Positions::RowOffsets(DeviceInts::I32(offsets.as_view())),
        sincos: tables.sincos_f32::<bf16>(),
    };
    let fused = rope_host::QkIo::Packed {
        data: safe.as_view_mut(),
        q,
        k,
    };
    rope.run_qk(&op, fused).expect("safe launch");

    let other = stream.context().new_stream().expect("a foreign stream");
    let mut raw = other.clone_htod(&data).expect("upload");
    other.synchronize().expect("upload complete");
    let shape = TableShape {
        max_position: 64,
        rotary_dim: d as u32,
    };
    let cache = combined_cache(&tables);
    let raw_op = RawOp {
        config,
        dtype: DType::BF16,
        positions: RawPositions::RowOffsets(RawInts {
            buf: RawBuf {
                ptr: offsets.device_ptr(&stream).0,
                len: 2,
            },
            ty: IntType::I32,
        }),
        sincos: RawSinCos::CosSinCache {
            cache: RawBuf {
                ptr: cache.device_ptr(&stream).0,
                len: cache.len(),
            },
            dtype: DType::F32,
            shape,
        },
    };
    stream.synchronize().expect("tables and offsets complete");
    let buf = RawBuf {
        ptr: raw.device_ptr_mut(&other).0,
        len: data.len(),
    };
    // SAFETY: `other` is a stream of the handle's context; every address is a live allocation
    // of that context holding the lengths given (offsets: 2 i32, the cache: 64 rows of 32 f32,
    // the fused buffer: the whole QKV tensor), complete before the launch (synchronized
    // above), freed only after the synchronization below, and written by nothing else.
    unsafe {
        rope.run_raw(&raw_op, RawTensors::Packed { buf, q, k }, other.cu_stream())
            .expect("raw launch");
    }
    other.synchronize().expect("raw launch complete");
    let bits = |v: Vec<bf16>| v.into_iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let want = bits(stream.clone_dtoh(&safe).expect("download"));
    assert_eq!(bits(other.clone_dtoh(&raw).expect("download")), want);
    assert_ne!(want, bits(data), "the launch rotated something");

    // Invalid raw descriptions are refused like safe ones, naming the argument.
    let too_short = RawTensors::Q(RawIo::InPlace(RawTensor {
        buf: RawBuf {
            ptr: buf.ptr,
            len: 10,
        },
        layout: q,
    }));
    // SAFETY: rejected before any launch, as the validation runs first.
    let err = unsafe { rope.run_raw(&raw_op, too_short, other.cu_stream()) };
    assert!(
        matches!(err, Err(rope_host::Error::Invalid { arg: "q", .. })),
        "{err:?}"
    );
}

/// Launches with programmatic dependent launch ([`StreamOverlap::Programmatic`]) give, bit for
/// bit, what the same launches give serialized: chains of in-place launches on one stream, each
/// reading what the one before wrote, eager and captured in a CUDA graph, for the one-head
/// kernels (decode-sized launches: every head its own block row) of both pairings with table
/// and in-kernel sin/cos, and for a fused norm + rope launch; again from a handle that reads
/// ahead ([`Rope::with_read_ahead`]: the next launch starts early, positions and sin/cos are
/// read before the wait). A kernel that read its input before the previous grid had finished
/// would read stale data and differ. On devices before
/// sm_90 both chains run serialized (the test then checks only that the option is accepted).
#[test]
fn programmatic_launch_chains_match_serialized_ones_bit_for_bit() {
    use rope_host::half::bf16;
    use rope_host::{FusedIo, FusedOp, KOut, NormWeight, QOut, QkIo, QkNorm, StreamOverlap};
    let name = "programmatic_launch_chains_match_serialized_ones_bit_for_bit";
    let Some((shared, _)) = gpu_or_skip(name) else {
        return;
    };
    let (stream, serial) = untracked(&shared);
    let overlapped = Rope::new(stream.clone())
        .expect("handle")
        .with_overlap(StreamOverlap::Programmatic);
    assert_eq!(overlapped.overlap(), StreamOverlap::Programmatic);
    // SAFETY: the ids and tables are written before the chains, never by a launch of them.
    let reading_ahead = unsafe {
        Rope::new(stream.clone())
            .expect("handle")
            .with_overlap(StreamOverlap::Programmatic)
            .with_read_ahead()
    };
    let (batch, hq, hk, d) = (64, 32, 8, 128);
    for rope in [&serial, &overlapped, &reading_ahead] {
        rope.prepare(THETA, d as u32).expect("frequencies");
    }
    let ids: Vec<i64> = (0..batch as i64).map(|b| 7 + 5 * b).collect();
    let ids = stream.clone_htod(&ids).expect("ids");
    let tables = serial
        .build_tables::<bf16>(THETA, d as u32, 512, TableFormat::Combined)
        .expect("tables");
    let weights: Vec<bf16> = (0..d)
        .map(|e| bf16::from_f32(0.5 + e as f32 / 64.0))
        .collect();
    let weights = stream.clone_htod(&weights).expect("weights");
    let mut rng = StdRng::seed_from_u64(23);
    let start = |n: usize, rng: &mut StdRng| -> Vec<bf16> {
        (0..n)
            .map(|_| bf16::from_f32(rng.random_range(-2.0..2.0)))
            .collect()
    };
    const CHAIN: usize = 40;
    // (style, table sin/cos, fused norm + rope)
    let launches = [
        (RopeStyle::Neox, true, false),
        (RopeStyle::Neox, false, false),
        (RopeStyle::Interleaved, true, false),
        (RopeStyle::Interleaved, false, false),
        (RopeStyle::Neox, false, true),
    ];
    for (style, table, fused) in launches {
        let q0 = start(batch * hq * d, &mut rng);
        let k0 = start(batch * hk * d, &mut rng);
        let config = RopeConfig::builder(d as u32, style)
            .build()
            .expect("config");
        // The chain's result from `rope`, eager or replayed from a graph of the chain.
        let chain = |rope: &Rope, graph: bool| -> Vec<u16> {
            let mut q = stream.clone_htod(&q0).expect("q");
            let mut k = stream.clone_htod(&k0).expect("k");
            let mut step = || {
                let op = RopeOp {
                    config,
                    positions: Positions::Ids {
                        ids: DeviceInts::I64(ids.as_view()),
                        shape: IdsShape::PerRow,
                    },
                    sincos: if table {
                        tables.sincos()
                    } else {
                        SinCos::Computed { theta: THETA }
                    },
                };
                let io = |data, heads| TensorMut {
                    data,
                    layout: Layout::bshd(batch, 1, heads, d),
                };
                if fused {
                    let op = FusedOp {
                        rope: op,
                        norm: Some(QkNorm {
                            q_weight: weights.as_view(),
                            k_weight: weights.as_view(),
                            eps: 1e-6,
                            weight: NormWeight::Plain,
                            scope: rope_host::NormScope::PerHead,
                        }),
                    };
                    let io = FusedIo::Separate {
                        q: QOut::InPlace(io(q.as_view_mut(), hq)),
                        k: KOut::InPlace(io(k.as_view_mut(), hk)),
                        v: None,
                    };
                    rope.run_fused(&op, io, None)
                } else {
                    let qk = QkIo::Separate {
                        q: Io::InPlace(io(q.as_view_mut(), hq)),
                        k: Io::InPlace(io(k.as_view_mut(), hk)),
                    };
                    rope.run_qk(&op, qk)
                }
            };
            if graph {
                stream
                    .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                    .expect("capture");
                let captured = (0..CHAIN).try_for_each(|_| step());
                let graph = stream.end_capture(CUgraphInstantiate_flags(0));
                captured.expect("captured launches");
                graph
                    .expect("graph")
                    .expect("the capture recorded the chain")
                    .launch()
                    .expect("replay");
            } else {
                (0..CHAIN).try_for_each(|_| step()).expect("launches");
            }
            let mut out = stream.clone_dtoh(&q).expect("q back");
            out.extend(stream.clone_dtoh(&k).expect("k back"));
            out.iter().map(|v| v.to_bits()).collect()
        };
        let want = chain(&serial, false);
        let start_bits: Vec<u16> = q0.iter().chain(&k0).map(|v| v.to_bits()).collect();
        assert_ne!(want, start_bits, "the chain changed nothing");
        for (rope, how) in [(&overlapped, "overlapped"), (&reading_ahead, "read-ahead")] {
            for graph in [false, true] {
                assert!(
                    chain(rope, graph) == want,
                    "{style:?} table {table} fused {fused} graph {graph}: {how} chain differs"
                );
            }
        }
    }
    use rope_host::cudarc::driver::sys::CUdevice_attribute::{
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJOR,
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MINOR,
    };
    let attribute = |a| shared.context().attribute(a).unwrap_or(-1);
    let capability = format!("{}.{}", attribute(MAJOR), attribute(MINOR));
    report(&format!(
        "programmatic dependent launch: {} chains of {CHAIN} launches (eager and in a graph) equal \
         the serialized ones on compute capability {capability}",
        launches.len()
    ));
}
