//! Tests of the planner, without a GPU.

use super::*;
use crate::error::Error;
use crate::positions::{IdsShape, IntType, RawInts};
use crate::sincos::TableShape;

fn neox(head_dim: u32) -> RopeConfig {
    RopeConfig::builder(head_dim, RopeStyle::Neox)
        .build()
        .expect("valid head_dim")
}

fn tensor(layout: Layout, ptr: u64) -> TensorReq {
    let len = layout.end().expect("small layout");
    TensorReq {
        x: RawBuf { ptr, len },
        x_layout: layout,
        out: None,
    }
}

fn request(config: RopeConfig, layout: Layout) -> Request {
    Request {
        config,
        dtype: DType::F32,
        q: tensor(layout, 1 << 20),
        k: None,
        fused: false,
        sincos: RawSinCos::Computed { theta: 10_000.0 },
        positions: RawPositions::Offset(0),
    }
}

/// A device of `sm_count` multiprocessors of 2048 threads.
fn facts(sm_count: u32) -> DeviceFacts {
    DeviceFacts {
        sm_count,
        threads_per_sm: 2048,
    }
}

/// Plans `r` on 132 multiprocessors where every kernel runs at its launch bounds (standing in
/// for the driver's occupancy calculation).
fn plan_of(r: &Request) -> Result<Option<Plan>> {
    plan(r, &facts(132), &|k: KernelName| k.min_blocks_per_sm())
}

/// The plan of a valid, non-empty request.
fn valid(r: &Request) -> Plan {
    plan_of(r).expect("valid").expect("non-empty")
}

/// Work-item groups per token.
fn groups(p: &Plan) -> u32 {
    p.grid.groups.divisor.get()
}

fn invalid_arg(r: Result<Option<Plan>>) -> &'static str {
    match r {
        Err(Error::Invalid { arg, .. }) => arg,
        other => panic!("expected Error::Invalid, got {other:?}"),
    }
}

/// Separate tables of `rows` rows for `config`, at `addr` and `addr + 2^16`.
fn table(config: &RopeConfig, rows: usize, addr: u64) -> RawSinCos {
    let len = rows * config.half() as usize;
    RawSinCos::Table {
        cos: RawBuf { ptr: addr, len },
        sin: RawBuf {
            ptr: addr + (1 << 16),
            len,
        },
        dtype: DType::F32,
        shape: TableShape {
            max_position: rows,
            rotary_dim: config.rotary_dim(),
        },
    }
}

#[test]
fn picks_16_byte_accesses_when_aligned() {
    let p = valid(&request(neox(128), Layout::bshd(2, 3, 4, 128)));
    assert_eq!((p.lanes, groups(&p)), (4, 16));
    let mut r = request(neox(6), Layout::bshd(2, 3, 4, 6));
    r.q.x.ptr += 4;
    let p = valid(&r);
    assert_eq!((p.lanes, groups(&p)), (1, 3));
}

#[test]
fn picks_8_byte_accesses_for_16_bit_neox_and_16_bytes_otherwise() {
    let interleaved = RopeConfig::builder(128, RopeStyle::Interleaved)
        .build()
        .expect("valid");
    for (cfg, dtype, lanes) in [
        (neox(128), DType::BF16, 4),
        (neox(128), DType::F32, 4),
        (interleaved, DType::F16, 8),
        (interleaved, DType::F32, 4),
    ] {
        let mut r = request(cfg, Layout::bshd(2, 3, 4, 128));
        r.dtype = dtype;
        let p = valid(&r);
        assert_eq!(p.lanes, lanes, "{:?}, {dtype:?}", cfg.style());
        assert_eq!(p.lanes, preferred_lanes(cfg.style(), dtype.size()));
    }
}

#[test]
fn partial_rotary_copies_the_rest_only_out_of_place() {
    let cfg = RopeConfig::builder(128, RopeStyle::Neox)
        .rotary_dim(64)
        .build()
        .expect("valid");
    let layout = Layout::bshd(1, 2, 3, 128);
    let p = valid(&request(cfg, layout));
    assert_eq!((p.rot_groups, groups(&p)), (8, 8));
    let mut r = request(cfg, layout);
    r.q.out = Some((
        RawBuf {
            ptr: 1 << 30,
            len: 768,
        },
        layout,
    ));
    let p = valid(&r);
    assert_eq!((p.rot_groups, groups(&p)), (8, 24));
}

/// `len` integers of `ty` at `ptr`.
#[test]
fn rotary_offset_shifts_the_pointers_and_limits_the_access_width() {
    // DeepSeek-V3's q head: 192 features, the last 64 rotated (interleaved bf16).
    let mla = |offset| {
        RopeConfig::builder(192, RopeStyle::Interleaved)
            .rotary_dim(64)
            .rotary_offset(offset)
            .build()
            .expect("valid")
    };
    let mut r = request(mla(128), Layout::bshd(2, 3, 4, 192));
    r.dtype = DType::BF16;
    let p = valid(&r);
    assert_eq!((p.lanes, p.rot_groups, groups(&p)), (8, 8, 8));
    let out = tensor(Layout::bshd(2, 3, 4, 192), 1 << 24);
    r.q.out = Some((out.x, out.x_layout));
    // Out of place, the 128 pass-through elements take 16 more groups.
    assert_eq!(groups(&valid(&r)), 8 + 16);
    // An offset of 2 elements allows only pairs of elements.
    let mut r2 = request(mla(2), Layout::bshd(2, 3, 4, 192));
    r2.dtype = DType::BF16;
    assert_eq!(valid(&r2).lanes, 2);
    let args = crate::rope::encode_for_test(&r, &valid(&r));
    assert_eq!(
        args.x0,
        (1 << 20) + 128 * 2,
        "q starts at the rotated slice"
    );
    assert_eq!(args.out0, (1 << 24) + 128 * 2);
    assert_eq!(args.rotary_offset, 128);
}

#[test]
fn multi_axis_positions_are_checked_against_the_tokens_and_pairs() {
    use crate::positions::RawAxisMap;
    let config = neox(8);
    let mut r = request(config, Layout::bshd(2, 3, 1, 8));
    let map = |len| RawAxisMap {
        axes: RawBuf { ptr: 1 << 30, len },
        n_axes: 3,
    };
    r.positions = RawPositions::MultiAxis {
        positions: ints(1 << 28, 18, IntType::I64),
        axes: map(4),
    };
    valid(&r);
    r.positions = RawPositions::MultiAxis {
        positions: ints(1 << 28, 18, IntType::I64),
        axes: map(3),
    };
    assert_eq!(invalid_arg(plan_of(&r)), "positions");
    // The output may not overlap the positions or the axis map.
    r.positions = RawPositions::MultiAxis {
        positions: ints(1 << 20, 18, IntType::I64),
        axes: map(4),
    };
    assert_eq!(invalid_arg(plan_of(&r)), "q");
}

fn ints(ptr: u64, len: usize, ty: IntType) -> RawInts {
    RawInts {
        buf: RawBuf { ptr, len },
        ty,
    }
}

#[test]
fn tables_must_hold_offset_positions_and_the_kernel_guards_the_rest() {
    let mut r = request(neox(8), Layout::bshd(2, 5, 2, 8));
    // Offset 5 of 5 tokens reaches position 9: a 10-row table fits, a 9-row one not.
    r.positions = RawPositions::Offset(5);
    r.sincos = table(&r.config, 10, 0);
    valid(&r);
    r.sincos = table(&r.config, 9, 0);
    assert_eq!(invalid_arg(plan_of(&r)), "positions");
    // Device row offsets are not known on the host: any table is accepted, and a position
    // outside it gives NaN in the kernel.
    r.positions = RawPositions::RowOffsets(ints(1 << 12, 2, IntType::I32));
    r.sincos = table(&r.config, 1, 0);
    valid(&r);
}

#[test]
fn rejects_overlapping_outputs() {
    let layout = Layout::bshd(1, 4, 2, 8);
    let mut r = request(neox(8), layout);
    r.q.out = Some((
        RawBuf {
            ptr: (1 << 20) + 64,
            len: 64,
        },
        layout,
    ));
    assert_eq!(invalid_arg(plan_of(&r)), "q.output");
    let self_overlapping = Layout::strided([1, 4, 2, 8], [64, 8, 4, 1], 0).expect("valid");
    let r = request(neox(8), self_overlapping);
    assert_eq!(invalid_arg(plan_of(&r)), "q");
}

#[test]
fn rejects_outputs_over_tables_ids_or_frequencies() {
    let layout = Layout::bshd(1, 4, 2, 8);
    let out = |ptr| Some((RawBuf { ptr, len: 64 }, layout));
    // The tables lie at 0 (cos) and 2^16 (sin), 4 rows of 4 f32 each.
    let mut r = request(neox(8), layout);
    r.sincos = table(&r.config, 4, 0);
    r.q.out = out(1 << 18);
    valid(&r);
    for addr in [0, 32, (1 << 16) + 60] {
        r.q.out = out(addr);
        assert_eq!(invalid_arg(plan_of(&r)), "q.output", "output at {addr}");
    }
    // In place over the combined cache.
    let mut r = request(neox(8), layout);
    r.sincos = RawSinCos::CosSinCache {
        cache: RawBuf {
            ptr: (1 << 20) + 100,
            len: 32,
        },
        dtype: DType::F32,
        shape: TableShape {
            max_position: 4,
            rotary_dim: 8,
        },
    };
    assert_eq!(invalid_arg(plan_of(&r)), "q");
    // k's output over the ids; the ids lie just past q.
    let mut r = request(neox(8), layout);
    let ids = ints((1 << 20) + 256, 4, IntType::I64);
    r.positions = RawPositions::Ids {
        ids,
        shape: IdsShape::Shared,
    };
    r.k = Some(TensorReq {
        out: Some((
            RawBuf {
                ptr: 1 << 24,
                len: 64,
            },
            layout,
        )),
        ..tensor(layout, 1 << 22)
    });
    valid(&r);
    r.k = Some(TensorReq {
        out: Some((
            RawBuf {
                ptr: ids.buf.ptr + 24,
                len: 64,
            },
            layout,
        )),
        ..tensor(layout, 1 << 22)
    });
    assert_eq!(invalid_arg(plan_of(&r)), "k.output");
    // In place over a frequency vector.
    let mut r = request(neox(8), layout);
    r.sincos = RawSinCos::Frequencies {
        inv_freq: RawBuf {
            ptr: (1 << 20) + 8,
            len: 4,
        },
        rotary_dim: 8,
        angle: crate::AngleMode::Exact,
        attention_factor: 1.0,
    };
    assert_eq!(invalid_arg(plan_of(&r)), "q");
}

#[test]
fn empty_tensors_are_a_no_op_whatever_their_strides() {
    // No heads: the sequence stride is 0, so the layout "maps" every token to one address.
    let cfg = neox(8);
    let r = request(cfg, Layout::bshd(1, 7, 0, 8));
    assert!(plan_of(&r).expect("valid").is_none());
    // Odd strides and offsets that would fail alignment, a table far too short, buffers of
    // length zero, and an output over the input: nothing is addressed.
    let odd = Layout::strided([3, 0, 5, 8], [1, 3, 0, 1], 7).expect("unit stride");
    let mut r = request(cfg, odd);
    r.q.x.len = 0;
    r.q.out = Some((r.q.x, odd));
    r.sincos = table(&cfg, 1, 0);
    r.positions = RawPositions::Offset(1000);
    assert!(plan_of(&r).expect("valid").is_none());
    // Argument shapes must still agree: a head size other than the config's is an error.
    let r = request(cfg, Layout::bshd(0, 7, 2, 6));
    assert_eq!(invalid_arg(plan_of(&r)), "q");
}

#[test]
fn empty_k_beside_q_takes_no_part_in_alignment() {
    let interleaved = RopeConfig::builder(8, RopeStyle::Interleaved)
        .build()
        .expect("valid");
    let mut r = request(interleaved, Layout::bshd(1, 4, 2, 8));
    let odd_empty = Layout::strided([1, 4, 0, 8], [3, 3, 3, 1], 1).expect("unit stride");
    r.k = Some(tensor(odd_empty, (1 << 22) + 4));
    assert_eq!(valid(&r).lanes, 4);
}

mod plan_never_panics {
    use super::*;
    use proptest::prelude::*;

    fn buf() -> BoxedStrategy<RawBuf> {
        let addr = prop_oneof![
            Just(0u64),
            (0u64..64).prop_map(|a| a * 4),
            Just(u64::MAX - 15)
        ];
        (addr, prop_oneof![0usize..4096, Just(usize::MAX)])
            .prop_map(|(ptr, len)| RawBuf { ptr, len })
            .boxed()
    }

    fn dim() -> BoxedStrategy<usize> {
        prop_oneof![
            Just(0usize),
            1usize..9,
            Just(usize::MAX / 3),
            Just(u32::MAX as usize + 1)
        ]
        .boxed()
    }

    fn layout(head_dim: usize) -> BoxedStrategy<Layout> {
        (
            dim(),
            dim(),
            dim(),
            [dim(), dim(), dim()],
            prop_oneof![Just(0usize), 0usize..64, Just(usize::MAX)],
        )
            .prop_map(move |(b, s, h, st, off)| {
                Layout::strided([b, s, h, head_dim], [st[0], st[1], st[2], 1], off)
                    .expect("unit stride")
            })
            .boxed()
    }

    fn tensor_req(head_dim: usize) -> BoxedStrategy<TensorReq> {
        (
            buf(),
            layout(head_dim),
            proptest::option::of((buf(), layout(head_dim))),
        )
            .prop_map(|(x, x_layout, out)| TensorReq { x, x_layout, out })
            .boxed()
    }

    fn shape() -> BoxedStrategy<TableShape> {
        (
            prop_oneof![0usize..40, Just(usize::MAX)],
            prop_oneof![Just(16u32), 0u32..20],
        )
            .prop_map(|(max_position, rotary_dim)| TableShape {
                max_position,
                rotary_dim,
            })
            .boxed()
    }

    proptest! {
        /// Arbitrary, mostly invalid requests: `plan` returns an `Invalid` error or a plan
        /// whose buffers cover the layouts, and never panics (no overflow, no division by
        /// zero).
        #[test]
        fn plan_errs_or_covers_the_layouts(
            (half, rot) in prop_oneof![(1u32..5, 0u32..3), (Just(64u32), Just(0u32))],
            neox in any::<bool>(),
            q in tensor_req(16),
            k in proptest::option::of(tensor_req(16)),
            fused in any::<bool>(),
            table in proptest::option::of((buf(), buf(), any::<bool>(), shape())),
            theta in prop_oneof![Just(10_000.0f64), Just(0.0), Just(f64::NAN), -5.0f64..5.0],
            offset in any::<u32>(),
            arrays in [(buf(), any::<bool>()), (buf(), any::<bool>())],
            shared in any::<bool>(),
            with_offsets in any::<bool>(),
            kind in 0u8..4,
        ) {
            let style = if neox { RopeStyle::Neox } else { RopeStyle::Interleaved };
            let head_dim = 2 * half + 2 * rot;
            let config = RopeConfig::builder(head_dim, style)
                .rotary_dim(2 * half)
                .build()
                .expect("valid");
            let fix = |mut t: TensorReq| {
                t.x_layout.head_dim = head_dim as usize;
                if let Some((_, l)) = &mut t.out { l.head_dim = head_dim as usize; }
                t
            };
            let [a, b] = arrays.map(|(buf, wide)| RawInts {
                buf,
                ty: if wide { IntType::I64 } else { IntType::I32 },
            });
            let positions = match kind {
                0 => RawPositions::Offset(offset),
                1 => RawPositions::RowOffsets(a),
                2 => RawPositions::Varlen {
                    cu_seqlens: a,
                    offsets: with_offsets.then_some(b),
                },
                _ => RawPositions::Ids {
                    ids: a,
                    shape: if shared { IdsShape::Shared } else { IdsShape::PerRow },
                },
            };
            let dtype = DType::F32;
            let sincos = match table {
                Some((cache, _, true, shape)) => RawSinCos::CosSinCache { cache, dtype, shape },
                Some((cos, sin, false, shape)) => RawSinCos::Table { cos, sin, dtype, shape },
                None => RawSinCos::Computed { theta },
            };
            let (q, k) = (fix(q), k.map(fix));
            let req = Request { config, dtype: DType::F32, q, k, fused, sincos, positions };
            match plan(&req, &facts(132), &|k: KernelName| k.min_blocks_per_sm()) {
                Err(Error::Invalid { .. }) | Ok(None) => {}
                Err(e) => prop_assert!(false, "unexpected error kind: {e}"),
                Ok(Some(p)) => {
                    for t in [Some(q), k].into_iter().flatten() {
                        let (x, out) = (t.x_layout, t.out);
                        prop_assert!(x.is_empty() || t.x.len >= x.end().expect("finite"));
                        if let Some((b, l)) = out {
                            prop_assert!(l.is_empty() || b.len >= l.end().expect("finite"));
                        }
                    }
                    prop_assert!(p.grid.config.grid_dim.1 <= 65_535);
                    prop_assert!(groups(&p) >= 1 && p.rot_groups >= 1);
                }
            }
        }
    }
}

mod aliasing {
    use super::*;
    use proptest::prelude::*;

    /// The buffers one operation receives, at random addresses in a small range so that they
    /// often meet: q and k (each in place or with an output), separate tables and ids.
    #[derive(Clone, Debug)]
    struct Buffers {
        q: (u64, Option<u64>),
        k: (u64, Option<u64>),
        cos: u64,
        sin: u64,
        ids: u64,
    }

    fn addr() -> BoxedStrategy<u64> {
        (0u64..48).prop_map(|a| a * 64).boxed()
    }

    fn buffers() -> BoxedStrategy<Buffers> {
        let io = || (addr(), proptest::option::of(addr()));
        (io(), io(), addr(), addr(), addr())
            .prop_map(|(q, k, cos, sin, ids)| Buffers {
                q,
                k,
                cos,
                sin,
                ids,
            })
            .boxed()
    }

    /// Byte ranges `[start, end)` meet.
    fn meet(a: (u64, u64), b: (u64, u64)) -> bool {
        a.0 < b.1 && b.0 < a.1
    }

    proptest! {
        /// Any written tensor that meets another buffer of the launch is rejected, naming the
        /// written tensor; with every buffer apart, the launch is valid.
        #[test]
        fn written_buffers_that_meet_another_are_rejected(b in buffers()) {
            // Each tensor: 2 tokens x 1 head x 8 f32 = 64 bytes; tables 4 rows x 4 f32 = 64
            // bytes each; ids 2 x i64 = 16 bytes.
            let layout = Layout::bshd(1, 2, 1, 8);
            let config = neox(8);
            let io = |(x, out): (u64, Option<u64>)| TensorReq {
                x: RawBuf { ptr: x, len: 16 },
                x_layout: layout,
                out: out.map(|o| (RawBuf { ptr: o, len: 16 }, layout)),
            };
            let mut req = request(config, layout);
            (req.q, req.k) = (io(b.q), Some(io(b.k)));
            req.sincos = RawSinCos::Table {
                cos: RawBuf { ptr: b.cos, len: 16 },
                sin: RawBuf { ptr: b.sin, len: 16 },
                dtype: DType::F32,
                shape: TableShape { max_position: 4, rotary_dim: 8 },
            };
            req.positions = RawPositions::Ids {
                ids: ints(b.ids, 2, IntType::I64),
                shape: IdsShape::Shared,
            };
            // (range, written, name) for every buffer.
            let tensor = |(x, out): (u64, Option<u64>), names: (&'static str, &'static str)| {
                let mut v = vec![((x, x + 64), out.is_none(), names.0)];
                v.extend(out.map(|o| ((o, o + 64), true, names.1)));
                v
            };
            let mut all = tensor(b.q, ("q", "q.output"));
            all.extend(tensor(b.k, ("k", "k.output")));
            all.extend([
                ((b.cos, b.cos + 64), false, "sincos.cos"),
                ((b.sin, b.sin + 64), false, "sincos.sin"),
                ((b.ids, b.ids + 16), false, "positions"),
            ]);
            let clash = all.iter().enumerate().any(|(i, w)| {
                w.1 && all.iter().enumerate().any(|(j, r)| i != j && meet(w.0, r.0))
            });
            match plan_of(&req) {
                Ok(_) => prop_assert!(!clash, "accepted overlapping buffers {b:?}"),
                Err(Error::Invalid { arg, .. }) => {
                    prop_assert!(clash, "rejected disjoint buffers {b:?}: {arg}");
                    let written = ["q", "q.output", "k", "k.output"];
                    prop_assert!(written.contains(&arg), "{arg}");
                }
                Err(e) => prop_assert!(false, "{e}"),
            }
        }
    }
}

mod empty_tensors {
    use super::*;
    use proptest::prelude::*;

    /// A layout of `head_dim` elements per head with at least one of batch, seq and heads zero,
    /// and arbitrary strides and offset.
    fn empty_layout(head_dim: usize) -> BoxedStrategy<Layout> {
        let any_dim = || prop_oneof![0usize..5, Just(u32::MAX as usize)];
        let stride = || prop_oneof![0usize..100, Just(usize::MAX)];
        (
            (any_dim(), any_dim(), any_dim(), 0usize..3),
            [stride(), stride(), stride()],
            prop_oneof![0usize..100, Just(usize::MAX)],
        )
            .prop_map(move |((b, s, h, zero), st, offset)| {
                let mut dims = [b, s, h];
                dims[zero] = 0;
                let [b, s, h] = dims;
                Layout::strided([b, s, h, head_dim], [st[0], st[1], st[2], 1], offset)
                    .expect("unit stride")
            })
            .boxed()
    }

    proptest! {
        /// An operation on empty tensors is a no-op whatever their strides, offsets, buffers
        /// and tables: `plan` returns `Ok(None)` once the head size agrees with the config.
        #[test]
        fn empty_tensors_plan_to_nothing(
            interleaved in any::<bool>(),
            q in empty_layout(8),
            out in proptest::option::of(empty_layout(8)),
            addrs in [0u64..1024, 0u64..1024],
            lens in [0usize..64, 0usize..64],
            table_rows in 1usize..4,
            offset in any::<u32>(),
        ) {
            let style = if interleaved { RopeStyle::Interleaved } else { RopeStyle::Neox };
            let config = RopeConfig::builder(8, style).build().expect("valid");
            let mut r = request(config, q);
            r.q.x = RawBuf { ptr: addrs[0], len: lens[0] };
            // An output of the input's dimensions, at any strides, offset and address.
            r.q.out = out.map(|o| {
                let o = Layout::strided([q.batch, q.seq, q.heads, 8], [o.strides[0], o.strides[1], o.strides[2], 1], o.offset)
                    .expect("unit stride");
                (RawBuf { ptr: addrs[1], len: lens[1] }, o)
            });
            r.sincos = table(&config, table_rows, 0);
            r.positions = RawPositions::Offset(offset);
            prop_assert!(matches!(plan_of(&r), Ok(None)), "{:?}", plan_of(&r));
        }
    }
}
