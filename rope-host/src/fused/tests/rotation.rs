//! Which plain rotations the fused kernels take ([`FusedRequest::rotation`],
//! [`rotation_may_take_four_heads`]).

use rope_kernels::abi::Mapping;

use super::super::rotation::rotation_may_take_four_heads;
use super::*;

/// [`with_tokens`]'s q and k as a plain rotation of `style` (`bf16`, computed sin/cos).
fn rotation(style: RopeStyle, tokens: usize) -> Request {
    with_tokens(style, tokens).rope
}

#[test]
fn prefill_rotations_of_every_pairing_and_type_plan_on_the_four_heads_kernels() {
    let cases = [
        (RopeStyle::Neox, DType::BF16, 8192),
        (RopeStyle::Neox, DType::F16, 4096),
        (RopeStyle::Neox, DType::F32, 4096),
        (RopeStyle::Interleaved, DType::BF16, 8192),
        (RopeStyle::Interleaved, DType::F32, 4096),
    ];
    for (style, dtype, tokens) in cases {
        let mut rope = rotation(style, tokens);
        rope.dtype = dtype;
        let req = FusedRequest::rotation(&rope).expect("a whole-head forward q and k");
        assert!(req.norm.is_none() && req.cache.is_none() && req.v.is_none());
        assert!(req.k_written && req.q_fp8.is_none());
        assert!(rotation_may_take_four_heads(&req, &H200));
        let plan = plan_on(&H200, &req, FusedKernels::Auto, true);
        assert_eq!(
            plan.kernel.mapping,
            Mapping::FOUR_HEADS,
            "{style:?} {dtype:?} {tokens}"
        );
    }
}

#[test]
fn decode_rotations_stay_on_the_rope_kernels() {
    // Decode: a wave or less.
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        let decode = FusedRequest::rotation(&rotation(style, TOKENS)).expect("forward");
        assert!(!rotation_may_take_four_heads(&decode, &H200), "{style:?}");
    }
}

#[test]
fn partial_rotations_in_place_are_narrower_heads_and_backward_ones_are_fused_requests() {
    let prefill = rotation(RopeStyle::Neox, 8192);
    let backward = Request {
        config: RopeConfig::builder(D as u32, RopeStyle::Neox)
            .direction(Direction::Backward)
            .build()
            .expect("valid"),
        ..prefill
    };
    let req = FusedRequest::rotation(&backward).expect("a plain backward rotation");
    let plan = plan_on(&H200, &req, FusedKernels::Auto, true);
    assert_eq!(plan.kernel.mapping, Mapping::FOUR_HEADS);
    // Elements 32..96 of each head of 128, in place: heads of 64 elements, 32 further in.
    let partial = Request {
        config: RopeConfig::builder(D as u32, RopeStyle::Neox)
            .rotary_dim(64)
            .rotary_offset(32)
            .build()
            .expect("valid"),
        ..prefill
    };
    let req = FusedRequest::rotation(&partial).expect("in place");
    let (cfg, q, k) = (req.rope.config, req.rope.q, req.rope.k.expect("k"));
    assert_eq!(
        (cfg.head_dim(), cfg.rotary_dim(), cfg.rotary_offset()),
        (64, 64, 0)
    );
    for (narrow, whole) in [(q, prefill.q), (k, prefill.k.expect("k"))] {
        assert_eq!((narrow.x.ptr, narrow.x.len), (whole.x.ptr, whole.x.len));
        assert_eq!(narrow.x_layout.head_dim, 64);
        assert_eq!(narrow.x_layout.offset, whole.x_layout.offset + 32);
        assert_eq!(narrow.x_layout.strides, whole.x_layout.strides);
    }
    let plan = plan_on(&H200, &req, FusedKernels::Auto, true);
    assert_eq!(plan.kernel.mapping, Mapping::FOUR_HEADS);
    // Out of place, the other elements are copied: not a fused request.
    let out = |t: TensorReq| TensorReq {
        out: Some((buf(1 << 50, t.x.len), t.x_layout)),
        ..t
    };
    let copied = Request {
        q: out(partial.q),
        ..partial
    };
    assert!(FusedRequest::rotation(&copied).is_none());
    assert!(FusedRequest::rotation(&prefill).is_some());
}

#[test]
fn q_alone_plans_with_an_empty_k_that_no_thread_takes() {
    let prefill = rotation(RopeStyle::Neox, 8192);
    let q_only = Request { k: None, ..prefill };
    let req = FusedRequest::rotation(&q_only).expect("q alone, whole head");
    let k = req.rope.k.expect("an empty k");
    assert_eq!((k.x_layout.heads, k.x), (0, q_only.q.x));
    assert!(rotation_may_take_four_heads(&req, &H200));
    let plan = plan_on(&H200, &req, FusedKernels::Auto, false);
    assert_eq!(plan.kernel.mapping, Mapping::FOUR_HEADS);
    assert_eq!(plan.token_warps[1..], [0, 0]);
    assert!(plan.token_warps[0] > 0);
}

#[test]
fn multi_axis_positions_take_the_four_heads_kernels_only_with_computed_sin_cos() {
    let mut rope = rotation(RopeStyle::Neox, 8192);
    rope.positions = RawPositions::MultiAxis {
        positions: RawInts {
            buf: buf(1 << 47, 3 * 8192),
            ty: IntType::I64,
        },
        axes: crate::positions::RawAxisMap {
            axes: buf(1 << 48, D / 2),
            n_axes: 3,
            item_axes: crate::positions::ItemAxes::UNKNOWN,
        },
    };
    let computed = FusedRequest::rotation(&rope).expect("forward");
    assert!(rotation_may_take_four_heads(&computed, &H200));
    rope.sincos = RawSinCos::CosSinCache {
        cache: buf(1 << 49, 8192 * D),
        dtype: DType::BF16,
        shape: TableShape {
            max_position: 8192,
            rotary_dim: D as u32,
        },
    };
    let table = FusedRequest::rotation(&rope).expect("forward");
    assert!(!rotation_may_take_four_heads(&table, &H200));
}
