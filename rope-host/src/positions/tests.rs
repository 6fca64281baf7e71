//! The position kinds' validation and encoding, without a GPU.

use super::*;
use rope_kernels::abi::GroupAxes;

fn ints(ptr: u64, len: usize, ty: IntType) -> RawInts {
    RawInts {
        buf: RawBuf { ptr, len },
        ty,
    }
}

fn varlen(cu: usize, offsets: Option<RawInts>) -> RawPositions {
    RawPositions::Varlen {
        cu_seqlens: ints(0, cu, IntType::I32),
        offsets,
    }
}

#[test]
fn varlen_arrays_need_one_more_boundary_than_offsets_and_one_type() {
    let plan = varlen(3, None).check(1, 10, 4).expect("two sequences");
    assert_eq!((plan.code, plan.count), (PositionCode::VarlenI32, 2));
    varlen(3, Some(ints(64, 2, IntType::I32)))
        .check(1, 10, 4)
        .expect("two offsets");
    for bad in [
        varlen(1, None),
        varlen(0, None),
        varlen(3, Some(ints(64, 3, IntType::I32))),
        varlen(3, Some(ints(64, 2, IntType::I64))),
        varlen(3, Some(ints(66, 2, IntType::I32))),
    ] {
        assert!(bad.check(1, 10, 4).is_err(), "{bad:?}");
    }
    assert!(varlen(3, None).check(2, 10, 4).is_err(), "batch 2");
}

#[test]
fn only_offsets_bound_the_largest_position_on_the_host() {
    let plan = RawPositions::Offset(5).check(3, 10, 4).expect("valid");
    assert_eq!(plan.max_implicit, Some(14));
    let rows = RawPositions::RowOffsets(ints(0, 3, IntType::I64));
    let plan = rows.check(3, 4, 4).expect("valid");
    assert_eq!(
        (plan.code, plan.max_implicit),
        (PositionCode::RowOffsetsI64, None)
    );
}

#[test]
fn row_offsets_of_one_token_rows_take_the_per_row_ids_path() {
    for (ty, code) in [
        (IntType::I32, PositionCode::IdsI32PerRow),
        (IntType::I64, PositionCode::IdsI64PerRow),
    ] {
        let plan = RawPositions::RowOffsets(ints(0, 64, ty)).check(64, 1, 4);
        assert_eq!(plan.expect("valid").code, code);
    }
}

#[test]
fn rejects_arrays_of_the_wrong_length_or_alignment() {
    let ids = |ptr, len, shape| RawPositions::Ids {
        ids: ints(ptr, len, IntType::I64),
        shape,
    };
    ids(0, 4, IdsShape::Shared).check(3, 4, 4).expect("[seq]");
    ids(0, 12, IdsShape::PerRow)
        .check(3, 4, 4)
        .expect("[batch, seq]");
    assert!(ids(0, 12, IdsShape::Shared).check(3, 4, 4).is_err());
    assert!(
        ids(4, 4, IdsShape::Shared).check(3, 4, 4).is_err(),
        "misaligned"
    );
    let rows = |len| RawPositions::RowOffsets(ints(0, len, IntType::I32));
    assert!(rows(2).check(3, 4, 4).is_err());
    rows(3).check(3, 4, 4).expect("one per row");
}

fn arg_of<T: std::fmt::Debug>(r: Result<T>) -> &'static str {
    match r {
        Err(crate::Error::Invalid { arg, .. }) => arg,
        other => panic!("expected Error::Invalid, got {other:?}"),
    }
}

#[test]
fn mrope_sections_take_consecutive_pairs() {
    // Written out by hand: t t h h h w for sections [2, 3, 1].
    let map = AxisMap::mrope([2, 3, 1], 12).expect("valid");
    assert_eq!((map.n_axes(), map.axes()), (3, &[0, 0, 1, 1, 1, 2][..]));
    // Qwen2.5-VL-7B: 16 temporal, 24 height, 24 width pairs.
    let qwen = AxisMap::mrope([16, 24, 24], 128).expect("valid");
    let count = |a| qwen.axes().iter().filter(|&&x| x == a).count();
    assert_eq!((count(0), count(1), count(2)), (16, 24, 24));
    assert_eq!(
        (qwen.axes()[15], qwen.axes()[16], qwen.axes()[40]),
        (0, 1, 2)
    );
}

#[test]
fn interleaved_mrope_is_qwen3_vl_assignment() {
    // apply_interleaved_mrope: h at 1::3 below 3 s_h, w at 2::3 below 3 s_w, t elsewhere.
    let map = AxisMap::mrope_interleaved([4, 2, 2], 16).expect("valid");
    assert_eq!(map.axes(), &[0, 1, 2, 0, 1, 2, 0, 0]);
    // Qwen3-VL: [24, 20, 20] over 64 pairs: THW repeated 20 times, then TTTT.
    let q3 = AxisMap::mrope_interleaved([24, 20, 20], 128).expect("valid");
    let want: Vec<u8> = (0..64)
        .map(|j| if j >= 60 { 0 } else { (j % 3) as u8 })
        .collect();
    assert_eq!(q3.axes(), &want[..]);
}

#[test]
fn axial_axes_own_contiguous_blocks() {
    let map = AxisMap::axial(&[4, 2, 6], 12).expect("valid");
    assert_eq!((map.n_axes(), map.axes()), (3, &[0, 0, 1, 2, 2, 2][..]));
    // FLUX: axes_dim [16, 56, 56] of head_dim 128.
    let flux = AxisMap::axial(&[16, 56, 56], 128).expect("valid");
    assert_eq!((flux.axes()[7], flux.axes()[8], flux.axes()[36]), (0, 1, 2));
}

#[test]
fn rejects_invalid_multi_axis_descriptions() {
    assert_eq!(arg_of(AxisMap::mrope([16, 24, 23], 128)), "mrope_section");
    assert_eq!(arg_of(AxisMap::mrope([16, 24, 25], 128)), "mrope_section");
    assert_eq!(
        arg_of(AxisMap::mrope_interleaved([24, 20, 21], 128)),
        "mrope_section"
    );
    assert_eq!(arg_of(AxisMap::mrope([1, 1, 1], 7)), "rotary_dim");
    assert_eq!(arg_of(AxisMap::axial(&[16, 55, 57], 128)), "axes_dim");
    assert_eq!(arg_of(AxisMap::axial(&[16, 56, 54], 128)), "axes_dim");
    assert_eq!(arg_of(AxisMap::axial(&[0, 128], 128)), "axes_dim");
    assert_eq!(arg_of(AxisMap::axial(&[], 128)), "axes_dim");
    assert_eq!(arg_of(AxisMap::axial(&[2, 2, 2, 2, 2], 10)), "axes_dim");
    assert_eq!(arg_of(AxisMap::new(0, vec![0])), "axes");
    assert_eq!(arg_of(AxisMap::new(5, vec![0])), "axes");
    assert_eq!(arg_of(AxisMap::new(2, vec![0, 1, 2])), "axes");
    assert_eq!(arg_of(AxisMap::new(2, Vec::new())), "axes");
    AxisMap::new(4, vec![3, 0, 2, 1]).expect("valid");
}

fn multi(len: usize, ty: IntType, map_len: usize, n_axes: u32) -> RawPositions {
    RawPositions::MultiAxis {
        positions: ints(0, len, ty),
        axes: RawAxisMap {
            axes: RawBuf {
                ptr: 1 << 20,
                len: map_len,
            },
            n_axes,
            item_axes: ItemAxes::UNKNOWN,
        },
    }
}

#[test]
fn multi_axis_positions_hold_one_row_per_axis_and_a_map_of_half_pairs() {
    // batch 2, seq 5: 10 tokens, 3 axes; 4 pairs.
    let plan = multi(30, IntType::I64, 4, 3).check(2, 5, 4).expect("valid");
    assert_eq!((plan.code, plan.count), (PositionCode::MultiAxisI64, 3));
    let plan = multi(30, IntType::I32, 4, 3).check(2, 5, 4).expect("valid");
    assert_eq!(plan.code, PositionCode::MultiAxisI32);
    for (bad, half) in [
        (multi(29, IntType::I64, 4, 3), 4),
        (multi(20, IntType::I64, 4, 3), 4),
        (multi(30, IntType::I64, 3, 3), 4),
        (multi(30, IntType::I64, 4, 3), 5),
        (multi(0, IntType::I64, 4, 0), 4),
        (multi(50, IntType::I64, 4, 5), 4),
    ] {
        assert_eq!(arg_of(bad.check(2, 5, half)), "positions", "{bad:?}");
    }
    let misaligned = RawPositions::MultiAxis {
        positions: ints(4, 30, IntType::I64),
        axes: RawAxisMap {
            axes: RawBuf { ptr: 0, len: 4 },
            n_axes: 3,
            item_axes: ItemAxes::UNKNOWN,
        },
    };
    assert_eq!(arg_of(misaligned.check(2, 5, 4)), "positions");
    let args = multi(30, IntType::I32, 4, 3).encode(&plan);
    assert_eq!(
        (args.position_code, args.pos_aux, args.pos_count),
        (PositionCode::MultiAxisI32 as u32, 1 << 20, 3)
    );
}

/// A multi-axis launch whose work items' pairs each lie on one axis (Qwen2.5-VL's sections
/// with 2 or 4 pairs per item) takes the group-axes code, its groups' axes in `pos_base`; one
/// pair per item (64 groups, more than `pos_base` holds), an interleaved map, or a map known
/// only by address keep the per-pair code.
#[test]
fn multi_axis_items_on_one_axis_take_the_group_axes_code() {
    let mrope = AxisMap::mrope([16, 24, 24], 128).expect("valid");
    let raw = |item_axes| RawPositions::MultiAxis {
        positions: ints(0, 30, IntType::I64),
        axes: RawAxisMap {
            axes: RawBuf {
                ptr: 1 << 20,
                len: 64,
            },
            n_axes: 3,
            item_axes,
        },
    };
    let plan = raw(mrope.item_axes()).check(2, 5, 64).expect("valid");
    assert_eq!(plan.code, PositionCode::MultiAxisI64);
    for pairs in [2u32, 4] {
        let items = plan.for_items(pairs);
        assert_eq!(items.code, PositionCode::GroupAxesI64, "{pairs} pairs");
        for group in 0..64 / pairs {
            let axis = GroupAxes::axis_in_base(items.base, group);
            assert_eq!(axis, u32::from(mrope.axes()[(group * pairs) as usize]));
        }
        let args = raw(mrope.item_axes()).encode(&items);
        assert_eq!(
            (args.position_code, args.pos_base, args.pos_count),
            (PositionCode::GroupAxesI64 as u32, items.base, 3)
        );
    }
    assert_eq!(plan.for_items(1), plan);
    let unknown = raw(ItemAxes::UNKNOWN).check(2, 5, 64).expect("valid");
    assert_eq!(unknown.for_items(4), unknown);
    let interleaved = AxisMap::mrope_interleaved([16, 24, 24], 128).expect("valid");
    let plan = raw(interleaved.item_axes()).check(2, 5, 64).expect("valid");
    assert_eq!(plan.for_items(2).code, PositionCode::MultiAxisI64);
    // Sections that are multiples of two pairs but not of four.
    let two = AxisMap::mrope([18, 22, 24], 128).expect("valid");
    let plan = raw(two.item_axes()).check(2, 5, 64).expect("valid");
    assert_eq!(plan.for_items(2).code, PositionCode::GroupAxesI64);
    assert_eq!(plan.for_items(4).code, PositionCode::MultiAxisI64);
    // One-position codes are left alone.
    let ids = RawPositions::Ids {
        ids: ints(0, 10, IntType::I32),
        shape: IdsShape::PerRow,
    };
    let plan = ids.check(2, 5, 64).expect("valid");
    assert_eq!(plan.for_items(4), plan);
}
