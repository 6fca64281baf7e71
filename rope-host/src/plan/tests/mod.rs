//! Tests of the planner, without a GPU.

use super::*;
use crate::Direction;
use crate::config::RopeStyle;
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
        packed: false,
        sincos: RawSinCos::Computed { theta: 10_000.0 },
        positions: RawPositions::Offset(0),
    }
}

/// A device of `sm_count` multiprocessors of 2048 threads.
fn facts(sm_count: u32) -> DeviceFacts {
    DeviceFacts {
        sm_count,
        threads_per_sm: 2048,
        dram_gb_per_s: 4915,
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

/// A decode step (64 tokens, 32 + 8 heads of 128: every head gets a block row) takes the
/// one-head kernel on the same grid; a prefill (heads share block rows), a launch with
/// pass-through elements to copy, one of narrow accesses, or one with a tensor spanning 2^32
/// elements keeps its kernel.
#[test]
fn decode_sized_launches_take_the_one_head_kernel() {
    let mut r = request(neox(128), Layout::bshd(64, 1, 32, 128));
    r.dtype = DType::BF16;
    r.k = Some(tensor(Layout::bshd(64, 1, 8, 128), 1 << 30));
    let p = valid(&r);
    assert_eq!(p.kernel.mapping, Mapping::ONE_HEAD);
    assert_eq!(
        (p.grid.heads_per_chunk, p.grid.config.grid_dim),
        (1, (8, 40, 1))
    );
    assert_eq!(p.kernel.symbol(), "rope_neox_theta_bf16_one_head");
    // A tensor spanning 2^32 elements or more (here through its batch stride) keeps the wide
    // kernel: the one-head kernels compute offsets in 32 bits.
    let far = Layout::strided([64, 1, 32, 128], [1 << 27, 4096, 128, 1], 0).expect("layout");
    let mut r = request(neox(128), far);
    r.dtype = DType::BF16;
    r.k = Some(tensor(Layout::bshd(64, 1, 8, 128), 1 << 40));
    assert!(far.span().is_some_and(|s| s as u64 >= 1 << 32));
    let p = valid(&r);
    assert_eq!(
        (p.kernel.mapping, p.grid.heads_per_chunk),
        (Mapping::WIDE, 1)
    );
    let near = Layout::strided([64, 1, 32, 128], [1 << 20, 4096, 128, 1], 0).expect("layout");
    let mut r = request(neox(128), near);
    r.dtype = DType::BF16;
    assert_eq!(valid(&r).kernel.mapping, Mapping::ONE_HEAD);
    let mut prefill = request(neox(128), Layout::bshd(1, 8192, 32, 128));
    prefill.dtype = DType::BF16;
    let p = valid(&prefill);
    assert!(p.grid.heads_per_chunk > 1);
    assert_eq!(p.kernel.mapping, Mapping::WIDE);
    let partial = RopeConfig::builder(128, RopeStyle::Neox)
        .rotary_dim(64)
        .build()
        .expect("valid");
    let layout = Layout::bshd(1, 2, 3, 128);
    let mut r = request(partial, layout);
    assert_eq!(valid(&r).kernel.mapping, Mapping::ONE_HEAD, "in place");
    r.q.out = Some((
        RawBuf {
            ptr: 1 << 30,
            len: 768,
        },
        layout,
    ));
    assert_eq!(
        valid(&r).kernel.mapping,
        Mapping::WIDE,
        "pass-through copies"
    );
    let mut r = request(neox(6), Layout::bshd(2, 3, 4, 6));
    r.q.x.ptr += 4;
    assert_eq!(valid(&r).kernel.mapping, Mapping::NARROW);
}

/// Decode's common launch (one-head kernel, `i64` ids per token or one-token row offsets,
/// `f64` angles or tables of the tensors' type that fit 32-bit offsets and aligned vectors) is
/// marked for the kernel's copy of its body compiled for it; every other launch is not.
#[test]
fn only_decodes_common_launch_is_marked_common() {
    let config = neox(128);
    let decode = |positions, sincos| {
        let mut r = request(config, Layout::bshd(64, 1, 32, 128));
        r.dtype = DType::BF16;
        r.k = Some(tensor(Layout::bshd(64, 1, 8, 128), 1 << 30));
        r.positions = positions;
        r.sincos = sincos;
        r
    };
    let ids = |ty| RawPositions::Ids {
        ids: ints(1 << 36, 64, ty),
        shape: IdsShape::PerRow,
    };
    let bf16_table = |addr, dtype| match table(&config, 4096, addr) {
        RawSinCos::Table {
            cos, sin, shape, ..
        } => RawSinCos::Table {
            cos,
            sin,
            dtype,
            shape,
        },
        _ => unreachable!("table() gives separate tables"),
    };
    let computed = RawSinCos::Computed { theta: 10_000.0 };
    let marked = |r: &Request| {
        let p = valid(r);
        crate::rope::common_launch_for_test(r, &p)
    };
    let aligned = 1 << 38;
    for (what, r, want) in [
        (
            "i64 ids, computed",
            decode(ids(IntType::I64), computed),
            true,
        ),
        (
            "i64 ids, bf16 tables",
            decode(ids(IntType::I64), bf16_table(aligned, DType::BF16)),
            true,
        ),
        (
            "one-token i64 row offsets, bf16 tables",
            decode(
                RawPositions::RowOffsets(ints(1 << 36, 64, IntType::I64)),
                bf16_table(aligned, DType::BF16),
            ),
            true,
        ),
        ("i32 ids", decode(ids(IntType::I32), computed), false),
        ("offsets", decode(RawPositions::Offset(7), computed), false),
        (
            "f32 tables of bf16 tensors",
            decode(ids(IntType::I64), bf16_table(aligned, DType::F32)),
            false,
        ),
        (
            "tables off the vectors' alignment",
            decode(ids(IntType::I64), bf16_table(aligned + 2, DType::BF16)),
            false,
        ),
    ] {
        assert_eq!(valid(&r).kernel.mapping, Mapping::ONE_HEAD, "{what}");
        assert_eq!(marked(&r), want, "{what}");
    }
    let mut prefill = request(config, Layout::bshd(1, 8192, 32, 128));
    prefill.dtype = DType::BF16;
    prefill.positions = RawPositions::Ids {
        ids: ints(1 << 36, 8192, IntType::I64),
        shape: IdsShape::PerRow,
    };
    assert_eq!(valid(&prefill).kernel.mapping, Mapping::WIDE);
    assert!(!marked(&prefill), "the item-loop kernel");
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

/// The gradient runs the forward launch's kernel on the same grid: its arguments differ only in
/// `sin_sign`, `-1` where the forward's is `+1`.
#[test]
fn both_directions_take_one_kernel_and_differ_only_in_the_sign_of_sin() {
    let fwd = request(neox(128), Layout::bshd(2, 3, 4, 128));
    let mut bwd = request(
        RopeConfig::builder(128, RopeStyle::Neox)
            .direction(Direction::Backward)
            .build()
            .expect("valid"),
        Layout::bshd(2, 3, 4, 128),
    );
    bwd.dtype = fwd.dtype;
    let (pf, pb) = (valid(&fwd), valid(&bwd));
    assert_eq!(pf.kernel, pb.kernel);
    assert_eq!(pf.grid.config.grid_dim, pb.grid.config.grid_dim);
    let (af, ab) = (
        crate::rope::encode_for_test(&fwd, &pf),
        crate::rope::encode_for_test(&bwd, &pb),
    );
    assert_eq!((af.sin_sign, ab.sin_sign), (1.0, -1.0));
    assert_eq!(
        crate::kernel_args::RopeArgs {
            sin_sign: 1.0,
            ..ab
        },
        af
    );
}

#[test]
fn multi_axis_positions_are_checked_against_the_tokens_and_pairs() {
    use crate::positions::RawAxisMap;
    let config = neox(8);
    let mut r = request(config, Layout::bshd(2, 3, 1, 8));
    let map = |len| RawAxisMap {
        axes: RawBuf { ptr: 1 << 30, len },
        n_axes: 3,
        item_axes: crate::positions::ItemAxes::UNKNOWN,
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

mod properties;
