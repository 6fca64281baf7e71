//! The fused planner's NVFP4 caches: the four-heads kernels of their own, the layout and
//! buffer checks (codes at half the strides, block scales at their own strides or between the
//! codes of one buffer) and the refusals of what those kernels do not store.

use rope_kernels::abi::FusedForms;

use super::*;

/// Makes `r`'s cache NVFP4 at its layout: codes of `len / 2` bytes at the cache buffers, block
/// scales of `len / 16` bytes laid out as the codes, one global scale each.
pub(super) fn nvfp4_cache(r: &mut FusedRequest) {
    let c = r.cache.as_mut().expect("cache");
    let len = c.k.len;
    (c.k.len, c.v.len) = (len / 2, len / 2);
    c.store = CacheStore::Nvfp4(CacheNvfp4 {
        k_block_scales: buf(9 << 24, len / 16),
        v_block_scales: buf(10 << 24, len / 16),
        scale_strides: c.layout.nvfp4_scale_strides(),
        k: array_scale("cache.k_scale", 11 << 24, 1, false),
        v: array_scale("cache.v_scale", 12 << 24, 8, true),
    });
}

fn nvfp4_of(r: &mut FusedRequest) -> &mut CacheNvfp4 {
    match &mut r.cache.as_mut().expect("cache").store {
        CacheStore::Nvfp4(n) => n,
        _ => panic!("an NVFP4 cache"),
    }
}

#[test]
fn nvfp4_caches_take_their_four_heads_kernels_at_decode_and_prefill() {
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        for tokens in [1, TOKENS, 8192] {
            let mut r = with_tokens(style, tokens);
            let len = 16 * 16 * 8 * D;
            let c = r.cache.as_mut().expect("cache");
            (c.k, c.v) = (buf(1 << 50, len), buf(1 << 51, len));
            c.layout = CacheLayout::blocks_rows_heads(16, 16, 8, D);
            nvfp4_cache(&mut r);
            for choice in [
                FusedKernels::Auto,
                FusedKernels::TwoHeads,
                FusedKernels::ItemLoop,
            ] {
                let p = plan_on(&H200, &r, choice, true);
                assert_eq!(
                    (p.kernel.mapping, p.kernel.forms),
                    (Mapping::FOUR_HEADS, FusedForms::Nvfp4),
                    "{style:?} {tokens} {choice:?}"
                );
                assert!(p.kernel.symbol().ends_with("_four_heads_nvfp4"));
                // Four heads a thread: q's 32 heads take 8 x 16 threads, four warps; k's and
                // v's 8 heads one warp each.
                assert_eq!(p.token_warps, [4, 1, 1]);
            }
        }
    }
}

#[test]
fn nvfp4_buffers_are_checked_at_half_and_a_sixteenth_of_the_elements() {
    let len = 16 * 16 * 8 * D;
    let mut r = request(RopeStyle::Neox);
    nvfp4_cache(&mut r);
    assert!(plan_of(&r).is_ok());
    // One byte short of the codes, or of the block scales.
    let mut short = r;
    short.cache.as_mut().expect("cache").v.len = len / 2 - 1;
    assert_eq!(invalid_arg(&short), "cache.v");
    let mut short = request(RopeStyle::Neox);
    nvfp4_cache(&mut short);
    nvfp4_of(&mut short).k_block_scales.len = len / 16 - 1;
    assert_eq!(invalid_arg(&short), "cache.k_block_scales");
    // Codes off a 4-byte boundary.
    let mut off = request(RopeStyle::Neox);
    nvfp4_cache(&mut off);
    off.cache.as_mut().expect("cache").k.ptr += 2;
    assert_eq!(invalid_arg(&off), "cache.k");
}

/// vLLM's packed rows: each head's 64 bytes of codes, then its 8 scales, 72 bytes a head, in
/// one buffer per cache; scales that run into the next head's codes are refused.
#[test]
fn nvfp4_scales_may_sit_between_the_codes_of_one_buffer() {
    let (heads, row) = (8, D / 2 + D / 16);
    let mut r = request(RopeStyle::Neox);
    nvfp4_cache(&mut r);
    let c = r.cache.as_mut().expect("cache");
    let bytes = 16 * 16 * heads * row;
    c.layout.strides = [16 * heads * 2 * row, heads * 2 * row, 2 * row];
    (c.k, c.v) = (buf(20 << 24, bytes), buf(21 << 24, bytes));
    let scales = |base: u64, at: usize| buf(base + at as u64, bytes - at);
    {
        let n = nvfp4_of(&mut r);
        n.scale_strides = [16 * heads * row, heads * row, row];
        n.k_block_scales = scales(20 << 24, D / 2);
        n.v_block_scales = scales(21 << 24, D / 2);
    }
    let p = plan_of(&r).expect("valid").expect("non-empty");
    assert_eq!(p.kernel.forms, FusedForms::Nvfp4);
    // Scales starting 8 bytes into the codes write over them.
    nvfp4_of(&mut r).k_block_scales = scales(20 << 24, D / 2 - 8);
    assert!(matches!(plan_of(&r), Err(Error::Invalid { .. })));
}

#[test]
fn nvfp4_blocks_need_heads_and_strides_of_whole_blocks() {
    // An element stride off a multiple of 8 (codes off 4-byte steps).
    let mut r = request(RopeStyle::Interleaved);
    nvfp4_cache(&mut r);
    r.cache.as_mut().expect("cache").layout.strides[2] = D + 4;
    assert_eq!(invalid_arg(&r), "cache.layout");
    // NeoX heads of 48 (halves of 24) would put a block across both halves' vectors;
    // interleaved heads of 48 are whole blocks.
    for (style, ok) in [(RopeStyle::Neox, false), (RopeStyle::Interleaved, true)] {
        let d = 48;
        let mut r = request(style);
        r.rope.config = RopeConfig::builder(d as u32, style).build().expect("valid");
        for (t, heads) in [(&mut r.rope.q, 32), (r.rope.k.as_mut().expect("k"), 8)] {
            t.x_layout = Layout::thd(TOKENS, heads, d);
            t.x.len = t.x_layout.end().expect("small");
        }
        r.v = Some((buf(3 << 24, TOKENS * 8 * d), Layout::thd(TOKENS, 8, d)));
        r.norm = None;
        let c = r.cache.as_mut().expect("cache");
        c.layout = CacheLayout::blocks_rows_heads(16, 16, 8, d);
        (c.k.len, c.v.len) = (16 * 16 * 8 * d, 16 * 16 * 8 * d);
        nvfp4_cache(&mut r);
        nvfp4_of(&mut r).scale_strides = [16 * 8 * 3, 8 * 3, 3];
        match plan_of(&r) {
            Ok(Some(p)) if ok => assert_eq!(p.kernel.forms, FusedForms::Nvfp4),
            Err(Error::Invalid { arg, .. }) if !ok => assert_eq!(arg, "cache.layout"),
            other => panic!("{style:?}: {other:?}"),
        }
    }
}

/// Every element type and pairing has its NVFP4 kernels, in the builds' lists.
#[test]
fn nvfp4_caches_are_written_from_every_element_type() {
    for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
        for dtype in [DType::F16, DType::BF16, DType::F32] {
            let mut r = request(style);
            nvfp4_cache(&mut r);
            r.rope.dtype = dtype;
            let p = plan_of(&r).expect("planned").expect("a launch");
            assert_eq!((p.kernel.dtype, p.kernel.forms), (dtype, FusedForms::Nvfp4));
            let symbol = p.kernel.symbol();
            assert!(symbol.ends_with("_four_heads_nvfp4"), "{symbol}");
            assert!(
                rope_kernels::abi::all_symbols().any(|s| s == symbol),
                "{symbol}"
            );
        }
    }
}

#[test]
fn nvfp4_refuses_multipliers_page_tables_partial_heads_and_narrow_accesses() {
    let mut r = request(RopeStyle::Neox);
    nvfp4_cache(&mut r);
    nvfp4_of(&mut r).v = RawScale {
        arg: "cache.v_scale",
        source: ScaleSource::Multiplier(2.0),
    };
    assert_eq!(invalid_arg(&r), "cache.v_scale");

    let mut r = request(RopeStyle::Neox);
    nvfp4_cache(&mut r);
    r.cache.as_mut().expect("cache").address = RawCacheAddress::PageTable(RawPageTable {
        batch_indices: buf(13 << 24, TOKENS),
        positions: buf(14 << 24, TOKENS),
        kv_indptr: buf(15 << 24, 2),
        kv_indices: buf(16 << 24, 16),
    });
    assert_eq!(invalid_arg(&r), "cache.kv_indices");

    let mut r = request(RopeStyle::Neox);
    nvfp4_cache(&mut r);
    r.rope.config = RopeConfig::builder(D as u32, RopeStyle::Neox)
        .rotary_dim(64)
        .build()
        .expect("valid");
    assert_eq!(invalid_arg(&r), "config");

    // q 4 bytes off an 8-byte boundary: only narrower accesses, which the item loop takes.
    let mut r = request(RopeStyle::Neox);
    nvfp4_cache(&mut r);
    r.rope.q.x.ptr += 4;
    assert_eq!(invalid_arg(&r), "cache");
}
