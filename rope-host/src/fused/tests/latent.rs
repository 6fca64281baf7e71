//! MLA's latent cache as v's heads (`latent.rs`): which launches store the latent part with
//! the plain kernels, and what the rewritten launch holds.

use rope_kernels::abi::{FusedForms, Mapping};

use super::apart::mla;
use super::*;
use crate::fused::latent::latent_as_v;
use crate::fused::plan::plan_checked;

/// Rows of vLLM's one MLA cache: 512 latent features, then the 64 rotated ones.
const ROW: usize = 576;

/// [`mla`] into vLLM's one cache (`[blocks, 16, 576]`, `concat_and_cache_mla_rope_fused`): the
/// latent cache its first 512 columns, the k cache its last 64, both of the cache's strides.
fn vllm_mla(tokens: usize) -> FusedRequest {
    let mut r = mla(tokens);
    let c = r.cache.as_mut().expect("cache");
    let blocks = c.layout.num_blocks;
    let (base, len) = (1u64 << 44, blocks * 16 * ROW);
    let strides = [16 * ROW, ROW];
    c.layout.strides = [strides[0], strides[1], 64];
    // FP8 caches: a byte an element.
    (c.k, c.v) = (buf(base + 512, len - 512), buf(base, len));
    let part = r.nope.cached.as_mut().expect("part");
    part.into = NonRotaryCache::Latent(CacheLayout {
        strides: [strides[0], strides[1], 512],
        ..CacheLayout::blocks_rows_heads(blocks, 16, 1, 512)
    });
    r
}

/// `r` as v's heads with its plan (the plan of `plan_checked`, as `Rope::launch_fused` asks).
fn as_v(r: &FusedRequest) -> Option<(FusedRequest, FusedPlan)> {
    plan_of(r).expect("valid").expect("non-empty");
    let checked = |r: &FusedRequest| {
        plan_checked(r, &H200, &|_: FusedKernelName| 8, FusedKernels::Auto, None)
    };
    latent_as_v(r, &checked)
}

/// vLLM's one cache: the latent part's 512 features are eight v heads of 64 into the latent
/// columns of each slot's row, stored with k's scale by the plain kernels (four heads a thread
/// at prefill) in one launch; q, k and the caches' addresses are the request's.
#[test]
fn vllm_one_mla_cache_stores_the_latent_part_as_v_heads() {
    for (tokens, mapping) in [(8192, Mapping::FOUR_HEADS), (64, Mapping::TWO_HEADS)] {
        let r = vllm_mla(tokens);
        let (heads, plan) = as_v(&r).expect("one launch");
        assert_eq!(plan.kernel.forms, FusedForms::Plain);
        assert_eq!(plan.kernel.mapping, mapping, "{tokens} tokens");
        assert!(plan.nope.is_none() && heads.nope.cached.is_none());
        let (v, layout) = heads.v.expect("v");
        let part = r.nope.cached.expect("part").input;
        assert_eq!(v, part.0);
        assert_eq!((layout.heads, layout.head_dim), (8, 64));
        assert_eq!(layout.strides, [tokens * 512, 512, 64]);
        assert!(plan.token_warps[2] > 0);
        let (c, rc) = (heads.cache.expect("cache"), r.cache.expect("cache"));
        assert_eq!((c.k, c.v), (rc.k, rc.v));
        assert_eq!(c.layout.strides, [16 * ROW, ROW, 64]);
        assert_eq!(heads.rope.q.x, r.rope.q.x);
        assert_eq!(heads.rope.k.expect("k").x, r.rope.k.expect("k").x);
        // v's FP8 stores take k's one scale.
        let [_, (k_scale, k_step, _), (v_scale, v_step, _)] = scale_args(&heads);
        assert_eq!((k_scale, k_step), (1 << 47, 0));
        assert_eq!((v_scale, v_step), (k_scale, 0));
    }
}

/// A per-head k scale (k's one head) serves all of the latent part's heads.
#[test]
fn latent_heads_take_ks_one_scale_per_head_or_not() {
    let mut r = vllm_mla(64);
    if let Some(CacheStore::Fp8(f)) = r.cache.as_mut().map(|c| &mut c.store) {
        f.k = array_scale("k_scale", 1 << 47, 1, true);
    }
    let (heads, _) = as_v(&r).expect("one launch");
    let [_, (k_scale, k_step, _), (v_scale, v_step, _)] = scale_args(&heads);
    assert_eq!((k_scale, k_step), (1 << 47, 1));
    assert_eq!((v_scale, v_step), (1 << 47, 0));
}

/// FlashInfer's two caches (rows of 64 and of 512), a latent part not a whole number of heads,
/// and another of FlashInfer's forms (a page table) keep the forms' kernels.
#[test]
fn separate_caches_and_other_forms_keep_the_forms_kernels() {
    assert!(as_v(&mla(8192)).is_none());
    assert!(as_v(&mla(64)).is_none());
    let mut narrow = vllm_mla(64);
    let part = narrow.nope.cached.as_mut().expect("part");
    part.input.1 = Layout::thd(64, 1, 480);
    part.into = NonRotaryCache::Latent(CacheLayout {
        strides: [16 * ROW, ROW, 480],
        ..CacheLayout::blocks_rows_heads(narrow.cache.expect("cache").layout.num_blocks, 16, 1, 480)
    });
    assert!(as_v(&narrow).is_none());
    let mut paged = vllm_mla(64);
    let c = paged.cache.as_mut().expect("cache");
    c.address = RawCacheAddress::PageTable(RawPageTable {
        batch_indices: buf(1 << 50, 64),
        positions: buf(1 << 51, 64),
        kv_indptr: buf(1 << 52, 2),
        kv_indices: buf(1 << 53, c.layout.num_blocks),
    });
    assert!(as_v(&paged).is_none());
}
