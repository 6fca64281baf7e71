//! The backward planner (`grad.rs`): its validation, its access width and its grid.

use rope_kernels::abi::{
    NORM_GRAD_HEADS_PER_THREAD, NORM_GRAD_MAX_THREADS, NORM_GRAD_SHARED_F32, NormGradKernelName,
};

use super::super::grad::{GradPlan, GradRequest, plan_grad};
use super::super::request::FusedRequest;
use super::{D, H200, TOKENS, buf, request};
use crate::config::{RopeConfig, RopeStyle};
use crate::error::{Error, Result};
use crate::layout::Layout;

/// The backward of [`request`]'s norm + rope (32 q and 8 k heads of 128 at 64 tokens): the
/// gradients in place, the inputs, weight gradients and a workspace each 16 MiB apart.
fn grad_request(style: RopeStyle) -> GradRequest {
    let fused = FusedRequest {
        k_written: true,
        v: None,
        cache: None,
        ..request(style)
    };
    let norm = fused.norm.expect("request has a norm");
    GradRequest {
        fused,
        norm,
        q_input: (buf(9 << 24, TOKENS * 32 * D), Layout::thd(TOKENS, 32, D)),
        k_input: (buf(10 << 24, TOKENS * 8 * D), Layout::thd(TOKENS, 8, D)),
        q_weight: buf(11 << 24, D),
        k_weight: buf(12 << 24, D),
        workspace: buf(13 << 24, 1 << 20),
    }
}

/// `r` planned on an H200 whose multiprocessors hold three blocks of each kernel.
fn plan(r: &GradRequest) -> Result<Option<GradPlan>> {
    plan_grad(r, &H200, &|_: NormGradKernelName, _| 3)
}

/// The argument a refused plan names.
fn invalid_name(planned: Result<Option<GradPlan>>) -> &'static str {
    match planned {
        Err(Error::Invalid { arg, .. }) => arg,
        other => panic!("expected Error::Invalid, got {other:?}"),
    }
}

#[test]
fn backward_plans_blocks_of_whole_warps_within_the_shared_sums() {
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        let p = plan(&grad_request(style))
            .expect("valid")
            .expect("non-empty");
        let (threads, rows) = (p.grid.config.block_dim.0, p.grid.config.grid_dim.1);
        assert_eq!(threads % 32, 0);
        assert!(threads <= NORM_GRAD_MAX_THREADS);
        assert!(threads / 32 * D as u32 <= NORM_GRAD_SHARED_F32);
        assert_eq!(
            p.groups, 16,
            "{style:?}: 8 elements of 16-bit pairs per thread"
        );
        // Two slots of 16 lanes a warp, each of NORM_GRAD_HEADS_PER_THREAD heads.
        let per_chunk = 2 * NORM_GRAD_HEADS_PER_THREAD;
        assert_eq!(p.grid.heads_per_chunk, per_chunk);
        assert_eq!(p.chunks, (32 / per_chunk, 8 / per_chunk));
        assert_eq!(rows, p.chunks.0 + p.chunks.1);
        // At most a token per warp: 64 tokens over blocks of 8 warps.
        assert_eq!(threads, 256);
        assert_eq!(p.grid.config.grid_dim.0, TOKENS as u32 / 8);
    }
}

#[test]
fn backward_refuses_what_it_cannot_take_naming_the_argument() {
    let mut r = grad_request(RopeStyle::Neox);
    r.workspace.len = 100;
    assert_eq!(invalid_name(plan(&r)), "workspace");

    let mut r = grad_request(RopeStyle::Neox);
    r.k_input.1 = Layout::thd(TOKENS, 4, D);
    assert_eq!(invalid_name(plan(&r)), "k_input");

    let mut r = grad_request(RopeStyle::Neox);
    r.q_weight.len = D - 1;
    assert_eq!(invalid_name(plan(&r)), "q_weight");

    // The input meets the gradient written in place.
    let mut r = grad_request(RopeStyle::Neox);
    r.q_input.0 = r.fused.rope.q.x;
    assert_eq!(invalid_name(plan(&r)), "q");

    // A partial rotation.
    let mut r = grad_request(RopeStyle::Neox);
    r.fused.rope.config = RopeConfig::builder(D as u32, RopeStyle::Neox)
        .rotary_dim(64)
        .build()
        .expect("valid");
    assert_eq!(invalid_name(plan(&r)), "config");
}
