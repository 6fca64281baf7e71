//! Properties of the planner over random requests: it never panics, it refuses exactly the
//! aliasing it must, and empty tensors are a no-op.

use super::*;

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
            packed in any::<bool>(),
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
            let req = Request { config, dtype: DType::F32, q, k, packed, sincos, positions };
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
