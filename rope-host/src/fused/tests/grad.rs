//! The backward planner (`grad.rs`): its validation, its access width and its grid.

use rope_kernels::abi::{
    DType, NORM_GRAD_MAX_THREADS, NORM_GRAD_SEGMENT_HEADS_PER_THREAD, NormGradKernelName,
    SHARED_BUFFER_F32, token_warps_heads_per_thread,
};

use super::super::grad::{GradPlan, GradRequest, max_grad_blocks, plan_grad};
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
fn backward_plans_each_tokens_warps_in_one_block_and_a_wave_of_block_rows() {
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        let p = plan(&grad_request(style))
            .expect("valid")
            .expect("non-empty");
        let (threads, (columns, rows, _)) = (p.grid.config.block_dim.0, p.grid.config.grid_dim);
        assert_eq!(threads % 32, 0);
        assert!(threads <= NORM_GRAD_MAX_THREADS);
        assert!(threads >= D as u32 / 2, "a thread per cos/sin pair");
        assert!(2 * D as u32 <= SHARED_BUFFER_F32);
        assert_eq!(
            p.groups, 16,
            "{style:?}: 8 elements of 16-bit pairs per thread"
        );
        // Two slots of 16 lanes a warp, each of four 16-bit heads: q's 32 heads take 4 warps,
        // k's 8 one, all in one block.
        let per_warp = 2 * token_warps_heads_per_thread(2);
        assert_eq!(per_warp, 8);
        assert_eq!(p.grid.heads_per_chunk, per_warp);
        assert_eq!(p.q_warps, 4);
        assert_eq!((threads, columns), (5 * 32, 1));
        // A block row per token: 64 tokens, fewer than the 132 x 3 blocks resident.
        assert_eq!(rows, TOKENS as u32);
        assert_eq!(p.blocks, columns * rows);
    }
}

#[test]
fn backward_grid_rows_stop_at_one_wave_with_their_workspace_rows() {
    // 1024 tokens (8 MiB of q, within the buffers' 16 MiB apart).
    let mut r = grad_request(RopeStyle::Neox);
    let tokens = 1024;
    let k = r.fused.rope.k.as_mut().expect("k");
    for (t, heads) in [(k, 8), (&mut r.fused.rope.q, 32)] {
        t.x_layout = Layout::thd(tokens, heads, D);
        t.x.len = t.x_layout.end().expect("small");
    }
    r.q_input = (
        buf(r.q_input.0.ptr, tokens * 32 * D),
        Layout::thd(tokens, 32, D),
    );
    r.k_input = (
        buf(r.k_input.0.ptr, tokens * 8 * D),
        Layout::thd(tokens, 8, D),
    );
    let p = plan(&r).expect("valid").expect("non-empty");
    assert_eq!(p.grid.config.grid_dim, (1, 132 * 3, 1));
    assert_eq!(p.blocks, 132 * 3);
    // Two rows of head_dim per block: one fewer f32 is refused.
    r.workspace.len = 2 * 132 * 3 * D - 1;
    assert_eq!(invalid_name(plan(&r)), "workspace");
    r.workspace.len += 1;
    assert!(plan(&r).is_ok());
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

/// A backward of `heads` q and k heads of `head_dim` features of `dtype` at `tokens` tokens,
/// pairs of `style`, every buffer sized to its layout and 16 MiB from the next.
fn shaped_request(
    (style, dtype): (RopeStyle, DType),
    head_dim: usize,
    (q_heads, k_heads): (usize, usize),
    tokens: usize,
) -> GradRequest {
    let mut r = grad_request(style);
    r.fused.rope.config = RopeConfig::builder(head_dim as u32, style)
        .build()
        .expect("valid");
    r.fused.rope.dtype = dtype;
    let k = r.fused.rope.k.as_mut().expect("k");
    for (t, heads) in [(k, k_heads), (&mut r.fused.rope.q, q_heads)] {
        t.x_layout = Layout::thd(tokens, heads, head_dim);
        t.x.len = t.x_layout.end().expect("small");
    }
    for ((buf, layout), heads) in [(&mut r.q_input, q_heads), (&mut r.k_input, k_heads)] {
        *layout = Layout::thd(tokens, heads, head_dim);
        buf.len = tokens * heads * head_dim;
    }
    for w in [&mut r.q_weight, &mut r.k_weight] {
        w.len = head_dim;
    }
    let norm = r.fused.norm.as_mut().expect("norm");
    norm.q_weight.len = head_dim;
    norm.k_weight.len = head_dim;
    r.norm = *norm;
    r
}

#[test]
fn backward_plans_keep_the_kernels_block_and_shared_buffer_bounds_for_every_shape() {
    let (mut planned, mut long) = (0, 0);
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for head_dim in [64, 96, 128, 256, 512] {
                for heads in [(1, 0), (1, 1), (8, 1), (32, 8), (40, 8), (64, 8), (3, 5)] {
                    for tokens in [1, 7, 64] {
                        let r = shaped_request((style, dtype), head_dim, heads, tokens);
                        let p = match plan(&r) {
                            Ok(Some(p)) => p,
                            Ok(None) => panic!("{style:?} {dtype:?} {head_dim} {heads:?}: empty"),
                            // Heads the access widths cannot split into a warp or whole warps.
                            Err(Error::Invalid { arg: "config", .. }) => {
                                assert_ne!(head_dim, 512, "{style:?} {dtype:?}: heads of 512");
                                continue;
                            }
                            Err(e) => panic!("{style:?} {dtype:?} {head_dim} {heads:?}: {e}"),
                        };
                        planned += 1;
                        let half = head_dim as u32 / 2;
                        let threads = p.grid.config.block_dim.0;
                        let (columns, rows, _) = p.grid.config.grid_dim;
                        // The kernel traps otherwise: whole warps (whole segments of a
                        // head's warps), no more than its `.maxntid`, within a warp a thread
                        // per cos/sin pair and two tokens' pairs, across warps one token's
                        // pairs and each warp's sums, then both weight rows within the shared
                        // buffer.
                        let segment = p.groups.next_power_of_two().div_ceil(32);
                        assert_eq!(threads % (32 * segment), 0);
                        assert!(threads <= NORM_GRAD_MAX_THREADS);
                        assert!(4 * half <= SHARED_BUFFER_F32);
                        if segment == 1 {
                            assert!(threads >= half);
                        } else {
                            assert!(matches!(p.groups, 64 | 128));
                            let per_thread = NORM_GRAD_SEGMENT_HEADS_PER_THREAD;
                            assert_eq!(p.grid.heads_per_chunk, per_thread);
                            assert!(2 * 2 * per_thread * threads / 32 <= SHARED_BUFFER_F32);
                            long += 1;
                        }
                        // Every head has its warps: q's, then k's, over the columns.
                        let per_warp = p.grid.heads_per_chunk;
                        assert!(p.q_warps / segment * per_warp >= heads.0 as u32);
                        let k_warps = (heads.1 as u32).div_ceil(per_warp) * segment;
                        assert!(columns * (threads / 32) >= p.q_warps + k_warps);
                        assert!(rows as usize <= tokens);
                        assert_eq!(p.blocks, columns * rows);
                        // The workspace the planner needs is within what Rope promises.
                        let bound = max_grad_blocks(&H200, heads.0 + heads.1) * 2 * head_dim;
                        assert!(2 * p.blocks as usize * head_dim <= bound);
                    }
                }
            }
        }
    }
    assert!(planned > 300, "{planned} shapes planned");
    assert!(long >= 6 * 7 * 3, "{long} shapes of heads across warps");
}

#[test]
fn backward_heads_wider_than_a_warp_take_segments_of_whole_warps() {
    // bf16 NeoX heads of 512: 64 groups of four pairs, two warps a head; f32 interleaved: 128
    // groups of two pairs, four warps. `NORM_GRAD_SEGMENT_HEADS_PER_THREAD` heads a thread.
    let per = NORM_GRAD_SEGMENT_HEADS_PER_THREAD;
    for (style, dtype, groups, segment) in [
        (RopeStyle::Neox, DType::BF16, 64, 2),
        (RopeStyle::Interleaved, DType::BF16, 64, 2),
        (RopeStyle::Neox, DType::F32, 64, 2),
        (RopeStyle::Interleaved, DType::F32, 128, 4),
    ] {
        let r = shaped_request((style, dtype), 512, (32, 8), TOKENS);
        let p = plan(&r).expect("valid").expect("non-empty");
        assert_eq!((p.groups, p.grid.groups.divisor.get()), (groups, groups));
        assert_eq!(p.grid.heads_per_chunk, NORM_GRAD_SEGMENT_HEADS_PER_THREAD);
        assert_eq!(p.q_warps, 32 / per * segment);
        // Blocks of four warps: two segments of two, or one of four.
        assert_eq!(p.grid.config.block_dim.0, 128, "{style:?} {dtype:?}");
        assert_eq!(
            p.grid.config.grid_dim.0,
            ((32 + 8) / per * segment).div_ceil(4)
        );
    }
    // f32 interleaved heads of 256: 64 groups, two warps a segment; q's 5 heads and k's 3 in
    // whole segments, over blocks of four warps.
    let r = shaped_request((RopeStyle::Interleaved, DType::F32), 256, (5, 3), TOKENS);
    let p = plan(&r).expect("valid").expect("non-empty");
    let (q_warps, k_warps) = (5u32.div_ceil(per) * 2, 3u32.div_ceil(per) * 2);
    assert_eq!((p.groups, p.q_warps), (64, q_warps));
    assert_eq!(p.grid.config.grid_dim.0, (q_warps + k_warps).div_ceil(4));
    assert_eq!(p.grid.config.block_dim.0, 4 * 32);
}

#[test]
fn backward_heads_wider_than_a_warp_at_a_narrow_access_are_refused_naming_config() {
    // A weight aligned to one bf16 element leaves two-element accesses: 128 groups of NeoX
    // pairs, whole warps only at the widest access.
    let mut r = shaped_request((RopeStyle::Neox, DType::BF16), 512, (8, 2), TOKENS);
    r.norm.q_weight.ptr += 2;
    r.fused.norm.as_mut().expect("norm").q_weight.ptr += 2;
    assert_eq!(invalid_name(plan(&r)), "config");
    // Heads of 1024: 128 groups of NeoX 16-bit pairs take whole warps, but their weight rows
    // do not fit the shared buffer.
    let r = shaped_request((RopeStyle::Neox, DType::BF16), 1024, (8, 2), TOKENS);
    assert_eq!(invalid_name(plan(&r)), "config");
}
