//! Tests of the fused planner, without a GPU.

mod across;
mod apart;
mod fp8;
mod grad;
mod latent;
mod norm_groups;
mod nvfp4;
mod prefetch;
mod properties;
mod rotation;
mod rows;

use rope_kernels::abi::{DType, FusedKernelName, MAX_FUSED_ITEMS, Mapping, NopeCached, NormCode};

use super::encode::{cached_nope_args, scale_args};
use super::plan::{FusedPlan, plan_fused};
use super::request::{
    CacheFp8, CacheNvfp4, CacheStore, CachedNope, FusedRequest, NopePart, RawCache, RawFp8,
    RawNorm, RawScale, ScaleSource,
};
use super::rows::{RowsLaunch, RowsOccupancy};
use super::{CacheLayout, Fp8Format, NonRotaryCache, RawCacheAddress, RawPageTable};
use crate::Direction;
use crate::bind::RawBuf;
use crate::config::{RopeConfig, RopeStyle};
use crate::device::DeviceFacts;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::plan::{Request, TensorReq};
use crate::positions::{IntType, RawInts, RawPositions};
use crate::sincos::{RawSinCos, TableShape};
use crate::tuning::{FusedKernels, ROWS_STAGES};

/// Decode of Qwen3-8B-like shapes: 64 tokens, 32 q and 8 kv heads of 128.
const TOKENS: usize = 64;
const D: usize = 128;

fn buf(ptr: u64, len: usize) -> RawBuf {
    RawBuf { ptr, len }
}

fn tensor(ptr: u64, heads: usize) -> TensorReq {
    let layout = Layout::thd(TOKENS, heads, D);
    TensorReq {
        x: buf(ptr, layout.end().expect("small")),
        x_layout: layout,
        out: None,
    }
}

fn config(style: RopeStyle) -> RopeConfig {
    RopeConfig::builder(D as u32, style).build().expect("valid")
}

/// q in place, k and v to a bf16 cache of 16 blocks of 16 slots, with the q/k norm; every
/// buffer 16 MiB apart.
fn request(style: RopeStyle) -> FusedRequest {
    let layout = CacheLayout::blocks_rows_heads(16, 16, 8, D);
    let cache_len = 16 * 16 * 8 * D;
    FusedRequest {
        rope: Request {
            config: config(style),
            dtype: DType::BF16,
            q: tensor(1 << 24, 32),
            k: Some(tensor(2 << 24, 8)),
            packed: false,
            positions: RawPositions::Offset(0),
            sincos: RawSinCos::Computed { theta: 1e6 },
        },
        q_fp8: None,
        k_fp8: None,
        k_written: false,
        v: Some((buf(3 << 24, TOKENS * 8 * D), Layout::thd(TOKENS, 8, D))),
        norm: Some(RawNorm {
            q_weight: buf(4 << 24, D),
            k_weight: buf(5 << 24, D),
            eps: 1e-6,
            code: NormCode::Rms,
            scope: crate::fused::NormScope::PerHead,
        }),
        cache: Some(RawCache {
            address: RawCacheAddress::Slots(RawInts {
                buf: buf(6 << 24, TOKENS),
                ty: IntType::I64,
            }),
            layout,
            k: buf(7 << 24, cache_len),
            v: buf(8 << 24, cache_len),
            store: CacheStore::Elem,
        }),
        nope: Default::default(),
    }
}

/// An H200's facts: 132 multiprocessors of 2048 threads, 4.9 TB/s of DRAM bandwidth.
const H200: DeviceFacts = DeviceFacts {
    sm_count: 132,
    threads_per_sm: 2048,
    dram_gb_per_s: 4915,
};

/// An H100's: the H200's with 3.35 TB/s.
const H100: DeviceFacts = DeviceFacts {
    dram_gb_per_s: 3352,
    ..H200
};

fn plan_of(r: &FusedRequest) -> Result<Option<FusedPlan>> {
    plan_with(r, FusedKernels::Auto)
}

/// `r` planned on an H200-like device with the kernels `choice` allows.
fn plan_with(r: &FusedRequest, choice: FusedKernels) -> Result<Option<FusedPlan>> {
    plan_fused(r, &H200, &|_: FusedKernelName| 8, choice, None)
}

/// `r`, valid and non-empty, planned on `facts`' device with the kernels `choice` allows, and
/// with the rows kernels (four blocks a multiprocessor) where `bulk_rows` (an sm_90 build).
fn plan_on(
    facts: &DeviceFacts,
    r: &FusedRequest,
    choice: FusedKernels,
    bulk_rows: bool,
) -> FusedPlan {
    let four = |_: FusedKernelName, _: &RowsLaunch| -> Result<u32> { Ok(4) };
    let rows = bulk_rows.then_some(&four as RowsOccupancy);
    plan_fused(r, facts, &|_: FusedKernelName| 8, choice, rows)
        .expect("valid")
        .expect("non-empty")
}

/// [`request`] of `style` at `tokens` tokens (32 q, 8 k and 8 v heads of 128, one slot each),
/// its tensors far apart in the address space.
fn with_tokens(style: RopeStyle, tokens: usize) -> FusedRequest {
    let mut r = request(style);
    for (t, heads, ptr) in [
        (&mut r.rope.q, 32, 1u64 << 40),
        (r.rope.k.as_mut().expect("k"), 8, 1 << 44),
    ] {
        t.x_layout = Layout::thd(tokens, heads, D);
        t.x = buf(ptr, t.x_layout.end().expect("fits"));
    }
    let v = Layout::thd(tokens, 8, D);
    r.v = Some((buf(1 << 45, v.end().expect("fits")), v));
    slots_of(&mut r).buf = buf(1 << 46, tokens);
    r
}

/// `r`'s slot mapping (its cache is addressed by one).
fn slots_of(r: &mut FusedRequest) -> &mut RawInts {
    match &mut r.cache.as_mut().expect("cache").address {
        RawCacheAddress::Slots(s) => s,
        RawCacheAddress::PageTable(_) => panic!("a slot mapping"),
    }
}

/// A scale array of `len` `f32` at `ptr`, named `arg`.
fn array_scale(arg: &'static str, ptr: u64, len: usize, per_head: bool) -> RawScale {
    RawScale {
        arg,
        source: ScaleSource::Array {
            buf: buf(ptr, len),
            per_head,
        },
    }
}

/// Makes `r`'s cache FP8 E4M3, with one scale each for k and v.
fn fp8_cache(r: &mut FusedRequest) {
    r.cache.as_mut().expect("cache").store = CacheStore::Fp8(CacheFp8 {
        format: Fp8Format::E4m3,
        k: array_scale("k_scale", 1 << 47, 1, false),
        v: array_scale("v_scale", 1 << 48, 1, false),
    });
}

fn invalid_arg(r: &FusedRequest) -> &'static str {
    match plan_of(r) {
        Err(Error::Invalid { arg, .. }) => arg,
        other => panic!("expected Error::Invalid, got {other:?}"),
    }
}

#[test]
fn decode_with_norm_and_cache_plans_one_wide_launch_over_q_k_and_v_heads() {
    for (style, lanes, groups) in [(RopeStyle::Neox, 4, 16), (RopeStyle::Interleaved, 8, 16)] {
        let p = plan_of(&request(style)).expect("valid").expect("non-empty");
        assert_eq!(p.kernel.mapping, Mapping::TWO_HEADS);
        assert_eq!((p.lanes, p.rot_groups), (lanes, groups));
        assert_eq!(p.grid.groups.divisor.get(), groups);
        assert_eq!(p.tokens, TOKENS as u64);
        assert_eq!(p.cache_slots, 256);
        // The two-heads kernel: q's 32 heads take 16 x 16 threads (two heads each), eight
        // warps; k's and v's 8 heads two each: 12 warps, three blocks of four (at most five
        // warps a block) per token, a block row per token.
        assert_eq!(p.grid.config.grid_dim, (3, TOKENS as u32, 1));
        assert_eq!(p.grid.config.block_dim, (128, 1, 1));
        assert_eq!(p.token_warps, [8, 2, 2]);
    }
}

/// Launches at the preferred width take the token-heads (two- or four-heads) kernels at any size
/// (decode and prefill) while every tensor spans fewer than 2^32 elements (their offsets are
/// 32-bit); a larger tensor takes the wide kernel's item loop, its 48 heads split over
/// `blockIdx.y` without leaving one out.
#[test]
fn launches_take_the_token_heads_kernels_while_every_tensor_spans_below_2_32() {
    let p = plan_of(&with_tokens(RopeStyle::Neox, 8192))
        .expect("valid")
        .expect("non-empty");
    assert_eq!(p.kernel.mapping, Mapping::FOUR_HEADS);
    // Four heads per thread at this size: 4 + 1 + 1 warps, two blocks of three per token.
    assert_eq!(p.grid.config.grid_dim, (2, 8192, 1));
    assert_eq!(p.token_warps, [4, 1, 1]);
    // The item loop when the token-heads kernels are not allowed (the tests' override).
    let p = plan_with(&with_tokens(RopeStyle::Neox, 8192), FusedKernels::ItemLoop)
        .expect("valid")
        .expect("non-empty");
    assert_eq!(p.kernel.mapping, Mapping::WIDE);
    // q of 2^20 tokens of 32 x 128 spans 2^32 elements.
    let p = plan_of(&with_tokens(RopeStyle::Neox, 1 << 20))
        .expect("valid")
        .expect("non-empty");
    assert_eq!(p.kernel.mapping, Mapping::WIDE);
    assert_eq!(p.token_warps, [0, 0, 0]);
    let (y, per) = (p.grid.config.grid_dim.1, p.grid.heads_per_chunk);
    assert!(per > 0 && y * per >= 48 && (y - 1) * per < 48);
}

/// Table launches take the token-heads (here four-heads) kernels only where their tables suit
/// those kernels' reads (`planned_table_fits`): each table below 2^32 elements, and both tables
/// and their row stride aligned to an item's vector of entries (NeoX bf16: four entries, 8
/// bytes). Other tables take the item loop, which tests the alignment and offsets rows in 64
/// bits.
#[test]
fn table_launches_take_the_token_heads_kernels_only_with_tables_their_reads_fit() {
    let access = |sincos: RawSinCos| {
        let mut r = with_tokens(RopeStyle::Neox, 8192);
        r.rope.sincos = sincos;
        plan_of(&r)
            .expect("valid")
            .expect("non-empty")
            .kernel
            .mapping
    };
    let shape = |max_position| TableShape {
        max_position,
        rotary_dim: D as u32,
    };
    let tables = |cos: u64, sin: u64, rows: usize| RawSinCos::Table {
        cos: buf(cos, rows * D / 2),
        sin: buf(sin, rows * D / 2),
        dtype: DType::BF16,
        shape: shape(rows),
    };
    assert_eq!(access(tables(1 << 49, 1 << 50, 8192)), Mapping::FOUR_HEADS);
    // Either table one entry (2 bytes) past an 8-byte boundary.
    assert_eq!(access(tables(1 << 49, (1 << 50) + 2, 8192)), Mapping::WIDE);
    assert_eq!(access(tables((1 << 49) + 2, 1 << 50, 8192)), Mapping::WIDE);
    // Rows of 64 entries: 2^26 rows make 2^32 elements a table.
    assert_eq!(
        access(tables(1 << 49, 1 << 50, (1 << 26) - 1)),
        Mapping::FOUR_HEADS
    );
    assert_eq!(access(tables(1 << 49, 1 << 50, 1 << 26)), Mapping::WIDE);
    // vLLM's cos_sin_cache: rows of 128 entries, the sines 128 bytes after the cosines.
    let cache = |ptr: u64| RawSinCos::CosSinCache {
        cache: buf(ptr, 8192 * D),
        dtype: DType::BF16,
        shape: shape(8192),
    };
    assert_eq!(access(cache(1 << 49)), Mapping::FOUR_HEADS);
    assert_eq!(access(cache((1 << 49) + 4)), Mapping::WIDE);
}

/// Launches take the four-heads kernels once the two-heads grid's threads are more than twice
/// what the device holds of the two-heads kernel at once at its registers (132 x 1365 threads
/// on the H200-like device at the NeoX 16-bit kernels' 48: past 938 tokens of 12 warps; 132 x
/// 1024 at the interleaved ones' 64: past 704); smaller launches take two heads per thread, and
/// the tests' override pins either.
#[test]
fn four_heads_per_thread_only_for_launches_of_many_waves() {
    let planned = |style, tokens, choice| {
        let p = plan_with(&with_tokens(style, tokens), choice)
            .expect("valid")
            .expect("non-empty");
        let heads = match p.kernel.mapping {
            Mapping::TWO_HEADS => 2,
            Mapping::FOUR_HEADS => 4,
            other => panic!("{other:?}"),
        };
        (heads, p.token_warps)
    };
    let auto = FusedKernels::Auto;
    // 132 SMs hold 1365 threads each at the two-heads kernel's 48 registers; a token takes
    // 12 warps of them.
    assert_eq!(planned(RopeStyle::Neox, 938, auto), (2, [8, 2, 2]));
    assert_eq!(planned(RopeStyle::Neox, 939, auto), (4, [4, 1, 1]));
    assert_eq!(planned(RopeStyle::Interleaved, 704, auto), (2, [8, 2, 2]));
    assert_eq!(planned(RopeStyle::Interleaved, 705, auto), (4, [4, 1, 1]));
    let (two, four) = (FusedKernels::TwoHeads, FusedKernels::FourHeads);
    assert_eq!(planned(RopeStyle::Neox, 64, four), (4, [4, 1, 1]));
    assert_eq!(planned(RopeStyle::Neox, 8192, two), (2, [8, 2, 2]));
    assert_eq!(planned(RopeStyle::Interleaved, 64, four), (4, [4, 1, 1]));
    assert_eq!(planned(RopeStyle::Interleaved, 8192, two), (2, [8, 2, 2]));
}

/// A partial rotation with a norm and a cache (the first `rotary_dim` of 128 features) plans on
/// the kernels of partial heads, whatever kernels are pinned: four heads a thread for 16-bit
/// elements at prefill (as whole heads: the planner's choice or pinned to four heads), else
/// two; `rot_groups` for the rotated features' accesses, and `groups` the next power of two of
/// those and the accesses of the features past them (two vectors of 4 a group for NeoX bf16,
/// one of 8 interleaved).
#[test]
fn partial_rotations_take_the_token_heads_kernels_of_partial_heads() {
    use rope_kernels::abi::FusedForms;
    for (style, rotary_dim, rot_groups, groups) in [
        (RopeStyle::Neox, 64, 8, 16),
        (RopeStyle::Neox, 96, 12, 16),
        (RopeStyle::Neox, 32, 4, 16),
        (RopeStyle::Interleaved, 64, 8, 16),
        (RopeStyle::Interleaved, 120, 15, 16),
    ] {
        for (choice, tokens, dtype, mapping) in [
            (FusedKernels::Auto, 8192, DType::BF16, Mapping::FOUR_HEADS),
            (
                FusedKernels::FourHeads,
                8192,
                DType::F16,
                Mapping::FOUR_HEADS,
            ),
            (
                FusedKernels::FourHeads,
                64,
                DType::BF16,
                Mapping::FOUR_HEADS,
            ),
            (FusedKernels::Auto, 64, DType::BF16, Mapping::TWO_HEADS),
            (
                FusedKernels::TwoHeads,
                8192,
                DType::BF16,
                Mapping::TWO_HEADS,
            ),
            (
                FusedKernels::ItemLoop,
                8192,
                DType::BF16,
                Mapping::TWO_HEADS,
            ),
            (FusedKernels::Auto, 8192, DType::F32, Mapping::TWO_HEADS),
        ] {
            let mut r = with_tokens(style, tokens);
            r.rope.dtype = dtype;
            r.rope.config = RopeConfig::builder(D as u32, style)
                .rotary_dim(rotary_dim)
                .build()
                .expect("valid");
            let p = plan_with(&r, choice).expect("valid").expect("non-empty");
            let case = (style, rotary_dim, choice, tokens, dtype);
            assert_eq!(p.kernel.mapping, mapping, "{case:?}");
            assert_eq!(p.kernel.forms, FusedForms::Partial, "{case:?}");
            if dtype != DType::F32 {
                let planned = (p.rot_groups, p.grid.groups.divisor.get());
                assert_eq!(planned, (rot_groups, groups), "{case:?}");
            }
        }
    }
}

/// An offset rotation, and a backward one with a norm or cache, are refused naming `config`.
#[test]
fn rejects_offset_rotation_and_backward_with_a_norm_or_cache() {
    let mut r = request(RopeStyle::Neox);
    r.rope.config = RopeConfig::builder(D as u32, RopeStyle::Neox)
        .rotary_dim(64)
        .rotary_offset(32)
        .build()
        .expect("valid");
    assert_eq!(invalid_arg(&r), "config");
    let mut r = request(RopeStyle::Neox);
    r.rope.config = RopeConfig::builder(D as u32, RopeStyle::Neox)
        .direction(Direction::Backward)
        .build()
        .expect("valid");
    assert_eq!(invalid_arg(&r), "config");
}

#[test]
fn rejects_bad_norm_weights_and_eps() {
    for eps in [f32::NAN, -1e-6, f32::INFINITY] {
        let mut r = request(RopeStyle::Neox);
        r.norm.as_mut().expect("norm").eps = eps;
        assert_eq!(invalid_arg(&r), "norm.eps");
    }
    let mut r = request(RopeStyle::Neox);
    r.norm.as_mut().expect("norm").q_weight.len = D - 1;
    assert_eq!(invalid_arg(&r), "norm.q_weight");
    let mut r = request(RopeStyle::Neox);
    r.norm.as_mut().expect("norm").k_weight.ptr += 1;
    assert_eq!(invalid_arg(&r), "norm.k_weight");
}

#[test]
fn rejects_v_without_cache_and_cache_without_v() {
    let mut r = request(RopeStyle::Neox);
    (r.cache, r.k_written) = (None, true);
    assert_eq!(invalid_arg(&r), "v");
    let mut r = request(RopeStyle::Neox);
    r.v = None;
    assert_eq!(invalid_arg(&r), "v");
    let mut r = request(RopeStyle::Neox);
    r.v = Some((buf(3 << 24, TOKENS * 4 * D), Layout::thd(TOKENS, 4, D)));
    assert_eq!(invalid_arg(&r), "v");
}

#[test]
fn rejects_caches_that_do_not_fit() {
    let mut r = request(RopeStyle::Neox);
    r.cache.as_mut().expect("cache").layout.kv_heads = 4;
    assert_eq!(invalid_arg(&r), "cache.layout");
    let mut r = request(RopeStyle::Neox);
    r.cache.as_mut().expect("cache").layout.block_size = 0;
    assert_eq!(invalid_arg(&r), "cache.layout");
    let mut r = request(RopeStyle::Neox);
    r.cache.as_mut().expect("cache").k.len -= 1;
    assert_eq!(invalid_arg(&r), "cache.k");
    let mut r = request(RopeStyle::Neox);
    slots_of(&mut r).buf.len = TOKENS - 1;
    assert_eq!(invalid_arg(&r), "cache.slot_mapping");
    // Rows that overlap each other: a slot stride smaller than a row.
    let mut r = request(RopeStyle::Neox);
    r.cache.as_mut().expect("cache").layout.strides[1] = D;
    assert_eq!(invalid_arg(&r), "cache.k");
    // v's cache is k's.
    let mut r = request(RopeStyle::Neox);
    let c = r.cache.as_mut().expect("cache");
    c.v = c.k;
    assert_eq!(invalid_arg(&r), "cache.k");
    // The cache overlaps q.
    let mut r = request(RopeStyle::Neox);
    r.cache.as_mut().expect("cache").k.ptr = r.rope.q.x.ptr + 64;
    assert_eq!(invalid_arg(&r), "q");
}

/// Packed q, k and v must address disjoint elements of their buffer.
#[test]
fn packed_qkv_must_be_disjoint() {
    let mut r = request(RopeStyle::Neox);
    let row = (32 + 8 + 8) * D;
    let at = |head: usize, heads: usize| {
        Layout::strided([1, TOKENS, heads, D], [TOKENS * row, row, D, 1], head * D).expect("fits")
    };
    let qkv = buf(1 << 24, TOKENS * row);
    r.rope.packed = true;
    r.k_written = true;
    r.rope.q = TensorReq {
        x: qkv,
        x_layout: at(0, 32),
        out: None,
    };
    r.rope.k = Some(TensorReq {
        x: qkv,
        x_layout: at(32, 8),
        out: None,
    });
    r.v = Some((qkv, at(40, 8)));
    assert!(plan_of(&r).expect("valid").is_some());
    r.v = Some((qkv, at(36, 8)));
    assert_eq!(invalid_arg(&r), "v");
}

/// The fused kernels index work items (tokens times accesses per head) in 32 bits: up to
/// `MAX_FUSED_ITEMS` items plan, one token more is refused.
#[test]
fn work_items_are_limited_to_what_32_bit_indices_hold() {
    let q_k_at = |tokens: usize| {
        let mut r = request(RopeStyle::Neox);
        let x = |ptr: u64, heads: usize| {
            let layout = Layout::thd(tokens, heads, D);
            TensorReq {
                x: buf(ptr, layout.end().expect("fits")),
                x_layout: layout,
                out: None,
            }
        };
        r.rope.q = x(1 << 44, 32);
        r.rope.k = Some(x(1 << 46, 8));
        r.v = None;
        r.cache = None;
        r.k_written = true;
        r
    };
    // NeoX bf16 heads of 128 take 16 accesses each.
    let most = MAX_FUSED_ITEMS as usize / 16;
    let p = plan_of(&q_k_at(most)).expect("valid").expect("non-empty");
    assert_eq!(p.tokens, most as u64);
    assert_eq!(invalid_arg(&q_k_at(most + 1)), "q");
}

/// k only cached (`KOut::CacheOnly`) needs a cache: without one it is refused naming `k`, with
/// q of any head count (q of no heads once reached a panic in the grid's planning).
#[test]
fn cache_only_k_without_a_cache_is_refused_naming_k() {
    for q_heads in [0, 1, 32] {
        let mut r = request(RopeStyle::Neox);
        (r.cache, r.v, r.k_written) = (None, None, false);
        let q = Layout::thd(TOKENS, q_heads, D);
        r.rope.q = TensorReq {
            x: buf(1 << 24, q.end().expect("small")),
            x_layout: q,
            out: None,
        };
        assert_eq!(invalid_arg(&r), "k", "{q_heads} q heads");
    }
}

/// A launch that stores nothing (q of no heads, k of no heads beside a cache of no kv heads) is
/// a no-op; q of no heads beside k's stored heads still launches.
#[test]
fn launches_that_store_no_head_are_a_no_op() {
    let zero_q = |r: &mut FusedRequest| {
        let q = Layout::thd(TOKENS, 0, D);
        r.rope.q = TensorReq {
            x: buf(1 << 24, 0),
            x_layout: q,
            out: None,
        };
    };
    let mut r = request(RopeStyle::Neox);
    zero_q(&mut r);
    let p = plan_of(&r).expect("valid").expect("k and v are cached");
    assert_eq!(p.token_warps[0], 0);
    let mut r = request(RopeStyle::Neox);
    (r.cache, r.v, r.k_written) = (None, None, true);
    zero_q(&mut r);
    let k = r.rope.k.as_mut().expect("k");
    k.x_layout = Layout::thd(TOKENS, 0, D);
    k.x.len = 0;
    assert!(plan_of(&r).expect("valid").is_none());
}

/// mRoPE's positions (Qwen3-VL: QK-norm, interleaved mRoPE, the cache write) plan as any other
/// positions: the token-heads kernels, the multi-axis code with its map, and the positions
/// array checked as `n_axes` rows of the tokens.
#[test]
fn multi_axis_positions_plan_with_norm_and_cache() {
    use crate::positions::{AxisMap, RawAxisMap};
    let map = AxisMap::mrope_interleaved([16, 24, 24], D as u32).expect("valid");
    // `rows` rows of `i64` positions, read through the map.
    let positions = |rows: usize| RawPositions::MultiAxis {
        positions: RawInts {
            buf: buf(29 << 24, rows * TOKENS),
            ty: IntType::I64,
        },
        axes: RawAxisMap {
            axes: buf(30 << 24, map.axes().len()),
            n_axes: map.n_axes(),
            item_axes: map.item_axes(),
        },
    };
    let mut r = request(RopeStyle::Neox);
    r.rope.positions = positions(3);
    let p = plan_of(&r).expect("valid").expect("non-empty");
    assert_eq!(p.kernel.mapping, Mapping::TWO_HEADS);
    assert!(matches!(
        p.positions.code,
        rope_kernels::abi::PositionCode::MultiAxisI64
            | rope_kernels::abi::PositionCode::GroupAxesI64
    ));
    // Two rows where the map has three.
    r.rope.positions = positions(2);
    assert_eq!(invalid_arg(&r), "positions");
}
