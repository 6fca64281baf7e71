//! Multi-axis positions (Qwen2-VL's mRoPE, Qwen3-VL's interleaved mRoPE, FLUX's N-D axial RoPE)
//! and rotated slices at an offset (DeepSeek's MLA) on the GPU: against the f64 reference on
//! random cases, text tokens bit for bit equal to the one-position path, and malformed device
//! maps and positions kept inside the arrays and tensors.

use std::sync::Arc;

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rope_harness::case::{AxesCase, Case, PosCase, TestElem};
use rope_harness::with_elem;
use rope_host::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use rope_host::{
    AngleMode, AxisMap, DType, DeviceInts, FrequencySpec, IdsShape, IntType, Io, ItemAxes, Layout,
    Positions, RawAxisMap, RawBuf, RawInts, RawIo, RawOp, RawPositions, RawSinCos, RawTensor,
    RawTensors, Rope, RopeConfig, RopeOp, RopeStyle, SinCos, TableFormat, TableShape, TensorMut,
};
use rope_tests::gpu::{combined_cache, gpu_or_skip};
use rope_tests::strategies;

use super::super::runner;
use super::matches_reference::check_random_cases;

/// The form a case exercises, for the summary.
fn form(case: &Case) -> String {
    let positions = match &case.positions {
        PosCase::MultiAxis { axes, n_axes, .. } => match axes {
            AxesCase::Mrope(_) => "mrope".to_string(),
            AxesCase::MropeInterleaved(_) => "mrope interleaved".to_string(),
            AxesCase::Axial(_) => format!("axial {n_axes}-D"),
            AxesCase::Map(_) => format!("map of {n_axes} axes"),
        },
        _ => "1-D".to_string(),
    };
    let slice = if case.rotary_offset > 0 {
        " + offset"
    } else {
        ""
    };
    format!("{positions}{slice} {:?}", case.dtype)
}

/// Every multi-axis form (i32 or i64 positions) with both pairings, rotated slices at random
/// offsets, every dtype, direction, layout, k form, sin/cos source (tables built from the
/// case's frequencies, per-axis ones for axial cases, or computed in the kernel) and in or out
/// of place, against the f64 reference with the tolerances of `kernels_match_reference`;
/// pairs whose axis position falls outside a table are NaN, every output element is written
/// and nothing else is touched.
#[test]
fn multi_axis_and_sliced_cases_match_reference() {
    check_random_cases(
        "multi_axis_and_sliced_cases_match_reference",
        1200,
        strategies::sliced_multi_axis_case(),
        form,
        "",
    );
}

/// Every output element of a case after one launch, as bits (out-of-place outputs, or the
/// rotated buffers in place).
fn output_bits<T: TestElem>(
    case: &Case,
    rope: &Rope,
    stream: &Arc<CudaStream>,
) -> Result<Vec<u64>, String> {
    let mut dev = case.upload::<T>(stream).map_err(|e| e.to_string())?;
    dev.launch(rope).map_err(|e| e.to_string())?;
    let mut bits = Vec::new();
    for t in std::iter::once(&dev.q).chain(dev.k.as_ref()) {
        let buf = t.out.as_ref().unwrap_or(&t.x);
        let host = stream.clone_dtoh(buf).map_err(|e| e.to_string())?;
        bits.extend(host.into_iter().map(TestElem::bits));
    }
    Ok(bits)
}

/// Tokens whose axes all hold one position (text tokens of a vision-language model) give
/// exactly, bit for bit, what `Positions::Ids` gives at that position: random cases of every
/// dtype, pairing, direction, layout, k form, table or computed source, in or out of place,
/// with any non-axial map of 1 to 4 axes (axial maps have their own frequencies).
#[test]
fn text_tokens_equal_the_one_position_result_bit_for_bit() {
    let Some((stream, rope)) = gpu_or_skip("text_tokens_equal_the_one_position_result_bit_for_bit")
    else {
        return;
    };
    let axes = (1usize..=64).prop_flat_map(strategies::axes);
    runner(400)
        .run(
            &(strategies::case(), axes, any::<bool>()),
            |(case, (axes, n_axes), wide)| {
                let half = case.rotary_dim / 2;
                let axes = match axes {
                    AxesCase::Axial(_) => AxesCase::Map(vec![0; half]),
                    // The map must cover this case's pairs.
                    AxesCase::Mrope(_) => AxesCase::Mrope([half, 0, 0]),
                    AxesCase::MropeInterleaved(_) => {
                        AxesCase::MropeInterleaved([half / 2, half - half / 2, 0])
                    }
                    AxesCase::Map(m) => AxesCase::Map((0..half).map(|j| m[j % m.len()]).collect()),
                };
                let ids: Vec<i64> = case.resolved_positions().iter().copied().collect();
                let one = Case {
                    positions: PosCase::Ids {
                        ids: ids.clone(),
                        wide,
                        shape: IdsShape::PerRow,
                    },
                    ..case.clone()
                };
                let multi = Case {
                    positions: PosCase::MultiAxis {
                        positions: ids.repeat(n_axes),
                        n_axes,
                        axes,
                        wide,
                    },
                    ..case.clone()
                };
                let fail = |e: String| TestCaseError::fail(format!("{e}\n{multi:?}"));
                let (a, b) = with_elem!(case.dtype, T => (
                    output_bits::<T>(&one, &rope, &stream).map_err(fail)?,
                    output_bits::<T>(&multi, &rope, &stream).map_err(fail)?,
                ));
                prop_assert!(a == b, "text tokens differ from the 1-D path\n{multi:?}");
                Ok(())
            },
        )
        .expect("text tokens are the one-position result");
}

/// The same with frequency vectors in both angle modes (`AngleMode::F32Compat` forms the f32
/// angle of the axis's position), bf16 and f32, both pairings, an mRoPE map, i32 and i64.
#[test]
fn text_tokens_equal_the_one_position_result_in_both_angle_modes() {
    let Some((stream, rope)) =
        gpu_or_skip("text_tokens_equal_the_one_position_result_in_both_angle_modes")
    else {
        return;
    };
    let (seq, heads, d) = (37usize, 3usize, 64usize);
    let mut rng = StdRng::seed_from_u64(21);
    let x: Vec<f32> = (0..seq * heads * d)
        .map(|_| rng.random_range(-4.0..4.0))
        .collect();
    let ids: Vec<i64> = (0..seq).map(|_| rng.random_range(0..1i64 << 24)).collect();
    let map = rope
        .axis_map(&AxisMap::mrope([8, 12, 12], d as u32).expect("valid"))
        .expect("upload");
    for angle in [AngleMode::Exact, AngleMode::F32Compat] {
        let freqs = rope
            .frequencies(&FrequencySpec::new(1e6, d as u32).angle(angle))
            .expect("frequencies");
        for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
            for wide in [false, true] {
                let config = RopeConfig::builder(d as u32, style)
                    .build()
                    .expect("config");
                let run = |positions: Positions<'_>| -> Vec<u32> {
                    let op = RopeOp {
                        config,
                        positions,
                        sincos: SinCos::Frequencies(&freqs),
                    };
                    rope_harness::rotate::rotate_f32(&rope, &stream, &op, &x, (seq, heads, d))
                        .expect("rotation")
                        .into_iter()
                        .map(f32::to_bits)
                        .collect()
                };
                let (one, multi) = if wide {
                    let a = stream.clone_htod(&ids).expect("upload");
                    let b = stream.clone_htod(&ids.repeat(3)).expect("upload");
                    (
                        run(Positions::Ids {
                            ids: DeviceInts::I64(a.as_view()),
                            shape: IdsShape::Shared,
                        }),
                        run(Positions::MultiAxis {
                            positions: DeviceInts::I64(b.as_view()),
                            axes: &map,
                        }),
                    )
                } else {
                    let narrow: Vec<i32> = ids.iter().map(|&p| p as i32).collect();
                    let a = stream.clone_htod(&narrow).expect("upload");
                    let b = stream.clone_htod(&narrow.repeat(3)).expect("upload");
                    (
                        run(Positions::Ids {
                            ids: DeviceInts::I32(a.as_view()),
                            shape: IdsShape::Shared,
                        }),
                        run(Positions::MultiAxis {
                            positions: DeviceInts::I32(b.as_view()),
                            axes: &map,
                        }),
                    )
                };
                assert_eq!(one, multi, "{angle:?} {style:?} wide {wide}");
            }
        }
    }
}

/// An f32 multi-axis launch description by address: head size `d`, `positions` and `axes`,
/// sin/cos from the combined f32 `cache` of 100 positions (built for `d`) or computed with
/// theta 10 000 when there is none.
fn f32_multi_axis_op(
    (d, style): (usize, RopeStyle),
    positions: RawInts,
    axes: RawAxisMap,
    cache: Option<RawBuf>,
) -> RawOp {
    RawOp {
        config: RopeConfig::builder(d as u32, style)
            .build()
            .expect("config"),
        dtype: DType::F32,
        positions: RawPositions::MultiAxis { positions, axes },
        sincos: match cache {
            Some(cache) => RawSinCos::CosSinCache {
                cache,
                dtype: DType::F32,
                shape: TableShape {
                    max_position: 100,
                    rotary_dim: d as u32,
                },
            },
            None => RawSinCos::Computed { theta: 10_000.0 },
        },
    }
}

/// `slice`'s device address on `stream` and its whole length, as `run_raw` takes buffers.
fn raw_buf<T>(slice: &CudaSlice<T>, stream: &Arc<CudaStream>) -> RawBuf {
    RawBuf {
        ptr: slice.device_ptr(stream).0,
        len: slice.len(),
    }
}

/// Launches `op` on the handle's stream, out of place from `input` to `output` (each with its
/// layout, addressing inside its buffer).
///
/// # Safety
/// The addresses in `op` (positions, axis map, cache) are live allocations of the handle's
/// context with the lengths given, complete on its stream and written by nothing else until
/// the launch completes.
unsafe fn run_f32(
    rope: &Rope,
    op: &RawOp,
    (input, layout): (&CudaSlice<f32>, Layout),
    (output, out_layout): (&mut CudaSlice<f32>, Layout),
) {
    let stream = rope.stream().clone();
    let out_len = output.len();
    let io = RawIo::OutOfPlace {
        input: RawTensor {
            buf: raw_buf(input, &stream),
            layout,
        },
        output: RawTensor {
            buf: RawBuf {
                ptr: output.device_ptr_mut(&stream).0,
                len: out_len,
            },
            layout: out_layout,
        },
    };
    // SAFETY: the caller's promises for `op`; the tensors are live allocations of the lengths
    // given, used on this stream only.
    unsafe { rope.run_raw(op, RawTensors::Q(io), stream.cu_stream()) }.expect("launch");
}

/// Device axis maps are not validated on the host: a map with entries far past `n_axes`
/// (up to 255) gives exactly what the map clamped to the last axis gives, positions of any
/// value (negative, past the table, past `i32`) give NaN with tables or finite garbage with
/// computed sin/cos, and nothing outside the output tensor is written.
#[test]
fn malformed_axis_maps_and_positions_stay_inside_the_arrays() {
    let Some((stream, rope)) =
        gpu_or_skip("malformed_axis_maps_and_positions_stay_inside_the_arrays")
    else {
        return;
    };
    let (tokens, heads, d, guard) = (29usize, 3usize, 32usize, 64usize);
    let half = d / 2;
    let tables = rope
        .build_tables::<f32>(10_000.0, d as u32, 100, TableFormat::Combined)
        .expect("tables");
    let cache = combined_cache(&tables);
    rope.prepare(10_000.0, d as u32).expect("prepare");
    for seed in 0..24u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let n_axes = 1 + (seed % 4) as usize;
        let style = if seed % 2 == 0 {
            RopeStyle::Neox
        } else {
            RopeStyle::Interleaved
        };
        let table = seed % 3 != 0;
        let x: Vec<f32> = (0..tokens * heads * d)
            .map(|_| rng.random_range(-4.0..4.0))
            .collect();
        let positions: Vec<i64> = (0..n_axes * tokens)
            .map(|_| match rng.random_range(0..4) {
                0 => rng.random_range(0..100),
                1 => rng.random_range(-1_000_000..0),
                2 => rng.random_range(100..1 << 40),
                _ => rng.random_range(i64::MIN..i64::MAX),
            })
            .collect();
        let bad: Vec<u8> = (0..half).map(|_| rng.random_range(0..=255)).collect();
        let clamped: Vec<u8> = bad.iter().map(|&a| a.min(n_axes as u8 - 1)).collect();
        let input = stream.clone_htod(&x).expect("upload");
        let pos = stream.clone_htod(&positions).expect("upload");
        let run = |map: &[u8]| -> Vec<f32> {
            let map = stream.clone_htod(map).expect("upload");
            let poison = vec![f32::from_bits(0x7fc0_dead); guard + x.len() + guard];
            let mut out = stream.clone_htod(&poison).expect("upload");
            stream.synchronize().expect("uploads complete");
            let layout = Layout::thd(tokens, heads, d);
            let out_layout = Layout::strided(
                [1, tokens, heads, d],
                [tokens * heads * d, heads * d, d, 1],
                guard,
            )
            .expect("unit stride");
            let positions = RawInts {
                buf: raw_buf(&pos, &stream),
                ty: IntType::I64,
            };
            let axes = RawAxisMap {
                axes: raw_buf(&map, &stream),
                n_axes: n_axes as u32,
                item_axes: ItemAxes::UNKNOWN,
            };
            let cache = table.then(|| raw_buf(cache, &stream));
            let op = f32_multi_axis_op((d, style), positions, axes, cache);
            // SAFETY: the handle's own stream; every address is a live allocation of its
            // context with the lengths given (input and positions as uploaded, the map `half`
            // bytes, the output `poison.len()` f32, the cache as built), complete (synchronized
            // above) and freed only after the download below; nothing else writes them.
            unsafe { run_f32(&rope, &op, (&input, layout), (&mut out, out_layout)) };
            let got = stream.clone_dtoh(&out).expect("download");
            let (before, rest) = got.split_at(guard);
            let (inside, after) = rest.split_at(x.len());
            for g in before.iter().chain(after) {
                assert_eq!(
                    g.to_bits(),
                    0x7fc0_dead,
                    "seed {seed}: written outside the output"
                );
            }
            inside.to_vec()
        };
        let (a, b) = (run(&bad), run(&clamped));
        let same = a
            .iter()
            .zip(&b)
            .all(|(p, q)| p.to_bits() == q.to_bits() || (p.is_nan() && q.is_nan()));
        assert!(
            same,
            "seed {seed}: a malformed map differs from the clamped one"
        );
        if table {
            // Pairs of in-table positions are finite, the others NaN: some of each.
            assert!(a.iter().any(|v| v.is_nan()), "seed {seed}");
        }
        assert!(
            a.iter().all(|v| v.to_bits() != 0x7fc0_dead),
            "seed {seed}: unwritten"
        );
    }
}

/// Launches whose work items' pairs each share one axis (mRoPE and axial maps with sections
/// that are multiples of the pairs per item) read one position per item; they give exactly, bit
/// for bit, what the per-pair path gives for the same map known only by address
/// ([`ItemAxes::UNKNOWN`]), with positions inside and outside the table (NaN), negative ones,
/// both pairings, tables and computed sin/cos, i32 and i64 positions. An unaligned map (every
/// launch on the per-pair path) is the control.
#[test]
fn group_axes_launches_equal_the_per_pair_path_bit_for_bit() {
    let Some((stream, rope)) =
        gpu_or_skip("group_axes_launches_equal_the_per_pair_path_bit_for_bit")
    else {
        return;
    };
    let (tokens, heads) = (37usize, 3usize);
    let maps = [
        AxisMap::mrope([16, 24, 24], 128),
        AxisMap::axial(&[16, 56, 56], 128),
        AxisMap::mrope([8, 12, 12], 64),
        AxisMap::axial(&[8, 8, 8, 8], 32),
        AxisMap::mrope([6, 13, 13], 64),
    ];
    let mut launches = 0;
    for (m, map) in maps.into_iter().enumerate() {
        let map = map.expect("valid map");
        let (n_axes, half) = (map.n_axes() as usize, map.axes().len());
        let d = 2 * half;
        let tables = rope
            .build_tables::<f32>(10_000.0, d as u32, 100, TableFormat::Combined)
            .expect("tables");
        let cache = combined_cache(&tables);
        rope.prepare(10_000.0, d as u32).expect("prepare");
        let device_map = rope.axis_map(&map).expect("upload");
        let mut rng = StdRng::seed_from_u64(m as u64);
        let x: Vec<f32> = (0..tokens * heads * d)
            .map(|_| rng.random_range(-4.0..4.0))
            .collect();
        let positions: Vec<i64> = (0..n_axes * tokens)
            .map(|_| match rng.random_range(0..8) {
                0 => rng.random_range(-50..0),
                1 => rng.random_range(100..200),
                _ => rng.random_range(0..100),
            })
            .collect();
        let narrow: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let input = stream.clone_htod(&x).expect("upload");
        let (pos64, pos32) = (
            stream.clone_htod(&positions).expect("upload"),
            stream.clone_htod(&narrow).expect("upload"),
        );
        stream.synchronize().expect("uploads complete");
        for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
            for table in [false, true] {
                for wide in [false, true] {
                    let run = |item_axes: ItemAxes| -> Vec<u32> {
                        let mut out = stream.alloc_zeros::<f32>(x.len()).expect("alloc");
                        let layout = Layout::thd(tokens, heads, d);
                        let positions = RawInts {
                            buf: if wide {
                                raw_buf(&pos64, &stream)
                            } else {
                                raw_buf(&pos32, &stream)
                            },
                            ty: if wide { IntType::I64 } else { IntType::I32 },
                        };
                        let axes = RawAxisMap {
                            item_axes,
                            ..device_map.raw()
                        };
                        let cache = table.then(|| raw_buf(cache, &stream));
                        let op = f32_multi_axis_op((d, style), positions, axes, cache);
                        // SAFETY: the handle's own stream; every address is a live allocation
                        // of its context with the lengths given (input, positions and map as
                        // uploaded and synchronized, the output allocated on this stream, the
                        // cache as built), freed only after the download below; nothing else
                        // writes them.
                        unsafe { run_f32(&rope, &op, (&input, layout), (&mut out, layout)) };
                        let got = stream.clone_dtoh(&out).expect("download");
                        got.into_iter().map(f32::to_bits).collect()
                    };
                    let (grouped, per_pair) = (run(map.item_axes()), run(ItemAxes::UNKNOWN));
                    let what = format!("map {m} {style:?} table {table} i64 {wide}");
                    assert!(
                        grouped.iter().any(|&b| !f32::from_bits(b).is_nan()),
                        "{what}: no finite output"
                    );
                    if table {
                        assert!(
                            grouped.iter().any(|&b| f32::from_bits(b).is_nan()),
                            "{what}: no position outside the table"
                        );
                    }
                    assert!(grouped == per_pair, "{what}: the paths differ");
                    launches += 1;
                }
            }
        }
    }
    println!("group_axes_launches_equal_the_per_pair_path_bit_for_bit: {launches} launch pairs");
}

/// Multi-axis descriptions that disagree with the launch are refused before anything runs,
/// naming `positions`, with the output untouched: a map for another rotary width, a positions
/// array of the wrong length; and a rotated slice that interleaved pairs cannot start at.
#[test]
fn mismatched_multi_axis_descriptions_are_refused() {
    let Some((stream, rope)) = gpu_or_skip("mismatched_multi_axis_descriptions_are_refused") else {
        return;
    };
    let (tokens, heads, d) = (6usize, 2usize, 16usize);
    let layout = Layout::thd(tokens, heads, d);
    let mut q = stream
        .clone_htod(&vec![1.0f32; tokens * heads * d])
        .expect("upload");
    let positions = stream.alloc_zeros::<i32>(3 * tokens).expect("alloc");
    let short = stream.alloc_zeros::<i32>(3 * tokens - 1).expect("alloc");
    let map_16 = rope
        .axis_map(&AxisMap::mrope([2, 3, 3], 16).expect("valid"))
        .expect("upload");
    let map_8 = rope
        .axis_map(&AxisMap::mrope([2, 1, 1], 8).expect("valid"))
        .expect("upload");
    let config = RopeConfig::builder(d as u32, RopeStyle::Neox)
        .build()
        .expect("config");
    for (ints, map) in [(&positions, &map_8), (&short, &map_16)] {
        let op = RopeOp {
            config,
            positions: Positions::MultiAxis {
                positions: DeviceInts::I32(ints.as_view()),
                axes: map,
            },
            sincos: SinCos::Computed { theta: 1e4 },
        };
        let io = Io::InPlace(TensorMut {
            data: q.as_view_mut(),
            layout,
        });
        let err = rope.run(&op, io);
        assert!(
            matches!(
                err,
                Err(rope_host::Error::Invalid {
                    arg: "positions",
                    ..
                })
            ),
            "{err:?}"
        );
    }
    let odd = RopeConfig::builder(d as u32, RopeStyle::Interleaved)
        .rotary_dim(8)
        .rotary_offset(3)
        .build();
    assert!(matches!(
        odd,
        Err(rope_host::Error::Invalid {
            arg: "rotary_offset",
            ..
        })
    ));
    let after = stream.clone_dtoh(&q).expect("download");
    assert!(after.iter().all(|&v| v == 1.0), "nothing was launched");
}
