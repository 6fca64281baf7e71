//! The across-heads planner (`across.rs`): its refusals, its access width and its grid.

use rope_kernels::abi::{
    NORM_ACROSS_MAX_THREADS, NormCode, SHARED_BUFFER_F32, token_warps_heads_per_thread,
};

use super::super::NormScope;
use super::super::across::{AcrossPlan, plan_across};
use super::super::plan::plan_fused;
use super::super::request::{FusedRequest, RawNorm};
use super::{D, H200, TOKENS, buf, request, tensor};
use crate::config::RopeStyle;
use crate::error::{Error, Result};

/// [`request`]'s q and k (32 and 8 heads of 128 at 64 tokens) in place, normalised across heads:
/// weights of `32 * 128` and `8 * 128`, no cache or v.
fn across_request(style: RopeStyle) -> FusedRequest {
    FusedRequest {
        k_written: true,
        v: None,
        cache: None,
        norm: Some(RawNorm {
            q_weight: buf(4 << 24, 32 * D),
            k_weight: buf(5 << 24, 8 * D),
            eps: 1e-6,
            code: NormCode::Rms,
            scope: NormScope::AcrossHeads,
        }),
        ..request(style)
    }
}

/// The argument a refused plan names.
fn invalid_name(planned: Result<Option<AcrossPlan>>) -> &'static str {
    match planned {
        Err(Error::Invalid { arg, .. }) => arg,
        other => panic!("expected Error::Invalid, got {other:?}"),
    }
}

#[test]
fn across_heads_plans_a_block_per_token_holding_both_tensors_heads() {
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        let p = plan_across(&across_request(style), &H200)
            .expect("valid")
            .expect("non-empty");
        let threads = p.grid.config.block_dim.0;
        assert_eq!(p.grid.config.grid_dim, (TOKENS as u32, 1, 1));
        // Two slots of 16 lanes a warp, four 16-bit heads each: q's 32 heads take 4 warps, k's
        // 8 one, all in one block.
        assert_eq!(p.groups, 16, "{style:?}");
        assert_eq!(p.grid.heads_per_chunk, 2 * token_warps_heads_per_thread(2));
        assert_eq!(threads, 5 * 32);
        assert!(threads >= D as u32 / 2, "a thread per cos/sin pair");
        assert!(D as u32 + threads / 32 <= SHARED_BUFFER_F32);
    }
}

#[test]
fn across_heads_plans_a_block_per_tensor_where_both_do_not_fit_one() {
    // 64 q heads take 8 warps and 64 k heads 8 more: 512 threads of both fit one block; 72 of
    // each (9 warps) do not, and take a block each.
    for (heads, rows, warps) in [(64, 1, 16), (72, 2, 9)] {
        let mut r = across_request(RopeStyle::Neox);
        r.rope.q = tensor(1 << 24, heads);
        r.rope.k = Some(tensor(2 << 24, heads));
        if let Some(n) = &mut r.norm {
            (n.q_weight, n.k_weight) = (buf(4 << 24, heads * D), buf(5 << 24, heads * D));
        }
        let p = plan_across(&r, &H200).expect("valid").expect("non-empty");
        assert_eq!(
            p.grid.config.grid_dim,
            (TOKENS as u32, rows, 1),
            "{heads} heads"
        );
        assert_eq!(p.grid.config.block_dim.0, warps * 32, "{heads} heads");
        assert!(p.grid.config.block_dim.0 <= NORM_ACROSS_MAX_THREADS);
    }
}

#[test]
fn across_heads_of_512_take_segments_of_two_whole_warps() {
    // bf16 heads of 512 at 8-element accesses: 64 groups, two warps a head, four heads a
    // segment: 8 q heads take 4 warps and 3 k heads 2, in one block of at least the 256
    // cos/sin threads.
    let d = 512;
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        let mut r = across_request(style);
        r.rope.config = crate::config::RopeConfig::builder(d as u32, style)
            .build()
            .expect("valid");
        let shaped = |at: u64, heads: usize| {
            let mut t = tensor(at, heads);
            t.x_layout = crate::layout::Layout::thd(TOKENS, heads, d);
            t.x = buf(at, t.x_layout.end().expect("small"));
            t
        };
        (r.rope.q, r.rope.k) = (shaped(1 << 24, 8), Some(shaped(2 << 24, 3)));
        if let Some(n) = &mut r.norm {
            (n.q_weight, n.k_weight) = (buf(4 << 24, 8 * d), buf(5 << 24, 3 * d));
        }
        let p = plan_across(&r, &H200).expect("valid").expect("non-empty");
        assert_eq!(
            (p.groups, p.grid.groups.divisor.get()),
            (64, 64),
            "{style:?}"
        );
        assert_eq!(p.grid.heads_per_chunk, token_warps_heads_per_thread(2));
        assert_eq!(p.grid.config.grid_dim, (TOKENS as u32, 1, 1));
        assert_eq!(
            p.grid.config.block_dim.0,
            8 * 32,
            "{style:?}: 6 warps, 256 threads of cos/sin"
        );
        assert!(d as u32 + 8 <= SHARED_BUFFER_F32);
    }
}

#[test]
fn across_heads_refuses_what_its_kernels_do_not_store() {
    let base = across_request(RopeStyle::Neox);
    // A cache (and v) as the fused request's.
    let cached = FusedRequest {
        norm: base.norm,
        ..request(RopeStyle::Neox)
    };
    assert_eq!(invalid_name(plan_across(&cached, &H200)), "cache");
    // Weights of one head, where a tensor's heads take one each.
    let mut short = base;
    if let Some(n) = &mut short.norm {
        n.q_weight = buf(4 << 24, D);
    }
    assert_eq!(invalid_name(plan_across(&short, &H200)), "norm.q_weight");
    // More heads than a block of NORM_ACROSS_MAX_THREADS holds at 8 heads a warp.
    let heads = (NORM_ACROSS_MAX_THREADS / 32 * 8 + 1) as usize;
    let mut wide = base;
    wide.rope.q = tensor(1 << 24, heads);
    if let Some(n) = &mut wide.norm {
        n.q_weight = buf(4 << 24, heads * D);
    }
    assert_eq!(invalid_name(plan_across(&wide, &H200)), "q");
    // The fused planner leaves such a request to this one.
    let planned = plan_fused(
        &base,
        &H200,
        &|_| 3,
        crate::tuning::FusedKernels::Auto,
        None,
    );
    assert!(
        matches!(
            planned,
            Err(Error::Invalid {
                arg: "norm.scope",
                ..
            })
        ),
        "{planned:?}"
    );
}
