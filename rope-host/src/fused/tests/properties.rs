//! Properties of the fused planner over random descriptions, valid and not: it never panics,
//! and every description it accepts either launches threads for what it stores or, when it
//! stores nothing, is a no-op.

use cudarc::driver::LaunchConfig;
use proptest::prelude::*;

use super::*;
use crate::positions::IdsShape;

/// Far apart in the address space, so that only the descriptions' own sizes decide overlaps.
const SPACING: u64 = 1 << 40;

/// A buffer for `layout` of `es`-byte elements at `slot * SPACING`: its exact length, or
/// (`short`) one element less.
fn buf_for(slot: u64, layout: &Layout, short: bool) -> RawBuf {
    let len = layout.end().unwrap_or(usize::MAX);
    buf(
        slot * SPACING,
        if short { len.saturating_sub(1) } else { len },
    )
}

/// A scale of `heads` heads' granularity (`per_head`), of the right length unless `wrong`.
fn scale(arg: &'static str, slot: u64, (per_head, wrong): (bool, bool), heads: usize) -> RawScale {
    let len = if per_head { heads } else { 1 };
    RawScale {
        arg,
        source: ScaleSource::Array {
            buf: buf(slot * SPACING, if wrong { len + 1 } else { len }),
            per_head,
        },
    }
}

/// An FP8 destination of `scale`, E5M2 or E4M3.
fn fp8(scale: RawScale, e5m2: bool) -> RawFp8 {
    let format = if e5m2 {
        Fp8Format::E5m2
    } else {
        Fp8Format::E4m3
    };
    RawFp8 { format, scale }
}

/// One random description: its tensors' shapes, destinations, cache and options, mostly
/// valid (every ninth-or-so choice breaks something).
#[derive(Clone, Debug)]
struct Description {
    neox: bool,
    dtype: DType,
    d: usize,
    batch: usize,
    seq: usize,
    q_heads: usize,
    k_heads: usize,
    /// 0: in place, 1: out of place, 2: FP8 out.
    q_out: u8,
    q_scale: (bool, bool),
    /// 0: in place, 1: out of place, 2: only cached, 3: FP8 out (a multiplier, or NaN).
    k_out: u8,
    /// FP8 stores in E5M2 rather than E4M3.
    e5m2: bool,
    cache: Option<CacheDescription>,
    norm: Option<(bool, f32)>,
    ids: bool,
    short: usize,
    choice: FusedKernels,
    bulk_rows: bool,
    h100: bool,
}

#[derive(Clone, Debug)]
struct CacheDescription {
    v: Option<usize>,
    block_size: usize,
    num_blocks: usize,
    kv_heads_off: bool,
    fp8: Option<((bool, bool), (bool, bool))>,
    slots_wide: bool,
    slots_off: bool,
    /// Addressed by a page table of this many requests (0: an empty `kv_indptr`).
    page_table: Option<usize>,
}

fn granularity() -> impl Strategy<Value = (bool, bool)> {
    (any::<bool>(), prop::bool::weighted(0.1))
}

fn cache() -> impl Strategy<Value = CacheDescription> {
    (
        prop_oneof![8 => Just(None), 1 => Just(Some(0usize)), 1 => Just(Some(3usize))],
        prop_oneof![Just(0usize), Just(1), Just(16), Just(u32::MAX as usize + 1)],
        prop_oneof![Just(0usize), Just(1), Just(64)],
        prop::bool::weighted(0.1),
        proptest::option::of((granularity(), granularity())),
        any::<bool>(),
        prop::bool::weighted(0.1),
        proptest::option::of(prop_oneof![Just(0usize), Just(1), Just(4)]),
    )
        .prop_map(
            |(v, block_size, num_blocks, kv_heads_off, fp8, slots_wide, slots_off, page_table)| {
                CacheDescription {
                    v,
                    block_size,
                    num_blocks,
                    kv_heads_off,
                    fp8,
                    slots_wide,
                    slots_off,
                    page_table,
                }
            },
        )
}

fn description() -> impl Strategy<Value = Description> {
    let shape = (
        any::<bool>(),
        prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)],
        prop_oneof![Just(64usize), Just(128), Just(256)],
        prop_oneof![Just(0usize), Just(1), Just(2)],
        prop_oneof![Just(0usize), Just(1), Just(5), Just(64)],
        prop_oneof![Just(0usize), Just(1), Just(3), Just(32)],
        prop_oneof![Just(0usize), Just(1), Just(8)],
    );
    let io = (
        0u8..3,
        granularity(),
        (0u8..4, any::<bool>()),
        proptest::option::of(cache()),
        proptest::option::of((
            any::<bool>(),
            prop_oneof![Just(1e-6f32), Just(0.0), Just(-1.0), Just(f32::NAN)],
        )),
        any::<bool>(),
    );
    let plan = (
        prop_oneof![8 => Just(usize::MAX), 1 => 0usize..9],
        prop_oneof![
            Just(FusedKernels::ItemLoop),
            Just(FusedKernels::Auto),
            Just(FusedKernels::TwoHeads),
            Just(FusedKernels::FourHeads),
            Just(FusedKernels::Rows { stages: 2 }),
        ],
        any::<bool>(),
        any::<bool>(),
    );
    (shape, io, plan).prop_map(
        |(
            (neox, dtype, d, batch, seq, q_heads, k_heads),
            (q_out, q_scale, (k_out, e5m2), cache, norm, ids),
            (short, choice, bulk_rows, h100),
        )| Description {
            neox,
            dtype,
            d,
            batch,
            seq,
            q_heads,
            k_heads,
            q_out,
            q_scale,
            k_out,
            e5m2,
            cache,
            norm,
            ids,
            short,
            choice,
            bulk_rows,
            h100,
        },
    )
}

impl Description {
    /// The request, its buffers in slots of [`SPACING`]; the `short`-th buffer (if any) one
    /// element short.
    fn request(&self) -> FusedRequest {
        let style = if self.neox {
            RopeStyle::Neox
        } else {
            RopeStyle::Interleaved
        };
        let config = RopeConfig::builder(self.d as u32, style)
            .build()
            .expect("valid");
        let tokens = self.batch * self.seq;
        let bshd = |heads| Layout::bshd(self.batch, self.seq, heads, self.d);
        let (lq, lk) = (bshd(self.q_heads), bshd(self.k_heads));
        let short = |i: usize| self.short == i;
        let mut q = TensorReq {
            x: buf_for(1, &lq, short(0)),
            x_layout: lq,
            out: None,
        };
        let mut q_fp8 = None;
        match self.q_out {
            0 => {}
            1 => q.out = Some((buf_for(2, &lq, short(1)), lq)),
            _ => {
                q.out = Some((buf_for(2, &lq, short(1)), lq));
                q_fp8 = Some(fp8(
                    scale("q.scale", 3, self.q_scale, self.q_heads),
                    self.e5m2,
                ));
            }
        }
        let mut k = TensorReq {
            x: buf_for(4, &lk, short(2)),
            x_layout: lk,
            out: None,
        };
        let mut k_fp8 = None;
        if self.k_out == 1 || self.k_out == 3 {
            k.out = Some((buf_for(5, &lk, short(3)), lk));
        }
        if self.k_out == 3 {
            let m = if self.short == 8 { f32::NAN } else { 0.5 };
            let scale = RawScale {
                arg: "k.scale",
                source: ScaleSource::Multiplier(m),
            };
            k_fp8 = Some(fp8(scale, self.e5m2));
        }
        let (v, cache) = match &self.cache {
            None => (None, None),
            Some(c) => {
                let lv = bshd(c.v.unwrap_or(self.k_heads));
                let kv_heads = self.k_heads + usize::from(c.kv_heads_off);
                let layout =
                    CacheLayout::blocks_rows_heads(c.num_blocks, c.block_size, kv_heads, self.d);
                let cache_len = c
                    .num_blocks
                    .saturating_mul(c.block_size)
                    .saturating_mul(kv_heads * self.d);
                let cache_buf = |slot| {
                    let short = short(4 + slot as usize - 7);
                    buf(slot * SPACING, cache_len.saturating_sub(usize::from(short)))
                };
                let slots = tokens + usize::from(c.slots_off);
                let fp8 = c.fp8.map(|(kg, vg)| {
                    let k = fp8(scale("cache.k_scale", 10, kg, kv_heads), self.e5m2);
                    CacheFp8 {
                        format: k.format,
                        k: k.scale,
                        v: scale("cache.v_scale", 11, vg, kv_heads),
                    }
                });
                let address = match c.page_table {
                    Some(requests) => RawCacheAddress::PageTable(RawPageTable {
                        batch_indices: buf(9 * SPACING, slots),
                        positions: buf(15 * SPACING, tokens),
                        kv_indptr: buf(16 * SPACING, requests),
                        kv_indices: buf(17 * SPACING, 8),
                    }),
                    None => RawCacheAddress::Slots(RawInts {
                        buf: buf(9 * SPACING, slots),
                        ty: if c.slots_wide {
                            IntType::I64
                        } else {
                            IntType::I32
                        },
                    }),
                };
                let raw = RawCache {
                    address,
                    layout,
                    k: cache_buf(7),
                    v: cache_buf(8),
                    store: fp8.map_or(CacheStore::Elem, CacheStore::Fp8),
                };
                (Some((buf_for(6, &lv, short(6)), lv)), Some(raw))
            }
        };
        let norm = self.norm.map(|(one_plus, eps)| RawNorm {
            q_weight: buf(12 * SPACING, self.d),
            k_weight: buf(13 * SPACING, self.d - usize::from(short(7))),
            eps,
            code: if one_plus {
                NormCode::RmsOnePlus
            } else {
                NormCode::Rms
            },
            scope: crate::fused::NormScope::PerHead,
        });
        let positions = if self.ids {
            RawPositions::Ids {
                ids: RawInts {
                    buf: buf(14 * SPACING, tokens),
                    ty: IntType::I64,
                },
                shape: IdsShape::PerRow,
            }
        } else {
            RawPositions::Offset(0)
        };
        FusedRequest {
            rope: Request {
                config,
                dtype: self.dtype,
                q,
                k: Some(k),
                packed: false,
                positions,
                sincos: RawSinCos::Computed { theta: 1e4 },
            },
            q_fp8,
            k_fp8,
            k_written: self.k_out != 2,
            v,
            norm,
            cache,
            nope: Default::default(),
        }
    }

    /// Heads the launch stores per token: q's, k's when written back or cached, v's when
    /// cached.
    fn stored_heads(&self) -> usize {
        let k_stored = self.k_out != 2 || self.cache.is_some();
        let v = self
            .cache
            .as_ref()
            .map_or(0, |c| c.v.unwrap_or(self.k_heads));
        self.q_heads + if k_stored { self.k_heads } else { 0 } + v
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4096))]

    /// Every description the planner accepts launches a grid of threads (within the driver's
    /// limits) when it stores some head of some token, and is a no-op (`None`) only when it
    /// stores nothing; a refusal is `Error::Invalid`; k only cached without a cache is never
    /// accepted. Nothing panics (no overflow, no division by zero, no `expect`).
    #[test]
    fn every_accepted_description_launches_or_is_a_no_op(desc in description()) {
        let r = desc.request();
        let facts = if desc.h100 { H100 } else { H200 };
        let four = |_: FusedKernelName, _: &RowsLaunch| -> Result<u32> { Ok(4) };
        let rows = desc.bulk_rows.then_some(&four as RowsOccupancy);
        let planned = plan_fused(&r, &facts, &|_: FusedKernelName| 8, desc.choice, rows);
        let tokens = desc.batch * desc.seq;
        match planned {
            Err(Error::Invalid { .. }) => {}
            Err(e) => prop_assert!(false, "unexpected error kind: {e}"),
            Ok(None) => {
                prop_assert!(desc.k_out != 2 || desc.cache.is_some(), "{desc:?}");
                prop_assert!(desc.k_out != 3 || desc.cache.is_none(), "{desc:?}");
                prop_assert!(tokens == 0 || desc.stored_heads() == 0, "{desc:?}");
            }
            Ok(Some(p)) => {
                prop_assert!(desc.k_out != 2 || desc.cache.is_some(), "{desc:?}");
                prop_assert!(desc.k_out != 3 || desc.cache.is_none(), "{desc:?}");
                // The rows kernels take no page table, multiplier, E5M2 or FP8 k output.
                if p.kernel.mapping == Mapping::Rows {
                    let fp8 = desc.q_out == 2 || desc.cache.as_ref().is_some_and(|c| c.fp8.is_some());
                    prop_assert!(!(desc.e5m2 && fp8) && desc.k_out != 3, "{desc:?}");
                    prop_assert!(desc.cache.as_ref().is_none_or(|c| c.page_table.is_none()));
                }
                prop_assert!(tokens > 0 && desc.stored_heads() > 0, "{desc:?}");
                prop_assert_eq!(p.tokens, tokens as u64);
                let LaunchConfig { grid_dim: (x, y, z), block_dim: (bx, by, bz), .. } =
                    p.grid.config;
                prop_assert!(x >= 1 && y >= 1 && z >= 1, "{:?}", p.grid.config);
                prop_assert!(y <= 65_535 && z <= 65_535, "{:?}", p.grid.config);
                prop_assert!(bx >= 1 && by == 1 && bz == 1 && bx <= 1024, "{:?}", p.grid.config);
            }
        }
    }
}
