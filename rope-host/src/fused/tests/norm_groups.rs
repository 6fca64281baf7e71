//! The fused planner's norm groups: a head's items in a power of two for the warp's sum, and
//! past a warp's 32 the four-heads kernels that sum across the head's warps.

use rope_kernels::abi::FusedForms;

use super::*;

/// With a norm, a head's items are rounded up to a power of two so that they share a warp
/// segment; without one they are not; past 32 items per head (64 or 128) the norm is summed
/// across the head's warps by the four-heads kernels alone, whatever is pinned, in blocks of
/// whole segments; past 128 it is refused, as are launches those kernels cannot take (partial
/// rotations, NVFP4 caches).
#[test]
fn norm_groups_are_a_power_of_two_and_past_32_take_the_four_heads_kernels() {
    let mut r = request(RopeStyle::Interleaved);
    let odd = |d: usize| {
        let mut r = request(RopeStyle::Interleaved);
        r.rope.config = RopeConfig::builder(d as u32, RopeStyle::Interleaved)
            .build()
            .expect("valid");
        for t in [&mut r.rope.q, r.rope.k.as_mut().expect("k")] {
            t.x_layout = Layout::thd(TOKENS, t.x_layout.heads, d);
            t.x.len = t.x_layout.end().expect("small");
        }
        r.v = Some((buf(3 << 24, TOKENS * 8 * d), Layout::thd(TOKENS, 8, d)));
        let cache = r.cache.as_mut().expect("cache");
        cache.layout = CacheLayout::blocks_rows_heads(16, 16, 8, d);
        cache.k.len = 16 * 16 * 8 * d;
        cache.v.len = cache.k.len;
        let norm = r.norm.as_mut().expect("norm");
        norm.q_weight.len = d;
        norm.k_weight.len = d;
        r
    };
    // 80 = 10 accesses of 8: 16 groups, 10 of them rotating.
    let p = plan_of(&odd(80)).expect("valid").expect("non-empty");
    assert_eq!((p.rot_groups, p.grid.groups.divisor.get()), (10, 16));
    let mut plain = odd(80);
    plain.norm = None;
    let p = plan_of(&plain).expect("valid").expect("non-empty");
    assert_eq!(p.grid.groups.divisor.get(), 10);
    // 512 = 64 accesses of 8: two warps a head; 1024, four; 2048 refused.
    for (d, segment) in [(512, 2), (1024, 4)] {
        for choice in [
            FusedKernels::Auto,
            FusedKernels::TwoHeads,
            FusedKernels::ItemLoop,
        ] {
            let p = plan_with(&odd(d), choice)
                .expect("valid")
                .expect("non-empty");
            assert_eq!(
                (p.kernel.mapping, p.kernel.forms),
                (Mapping::FOUR_HEADS, FusedForms::LongNorm),
                "{d} {choice:?}"
            );
            let symbol = p.kernel.symbol();
            assert!(symbol.ends_with("_four_heads_long_norm"), "{symbol}");
            assert!(rope_kernels::abi::all_symbols().any(|s| s == symbol));
            assert_eq!(p.grid.groups.divisor.get(), 32 * segment);
            let block_warps = p.grid.config.block_dim.0 / 32;
            assert_eq!(block_warps % segment, 0, "{d} {choice:?}");
            assert!(block_warps <= rope_kernels::abi::TOKEN_HEADS_MAX_WARPS);
        }
    }
    assert_eq!(invalid_arg(&odd(2048)), "norm");
    // A partial rotation of such heads has two-heads kernels alone.
    let mut partial = odd(512);
    partial.rope.config = RopeConfig::builder(512, RopeStyle::Interleaved)
        .rotary_dim(256)
        .build()
        .expect("valid");
    assert_eq!(invalid_arg(&partial), "norm");
    // So has an NVFP4 cache (its four-heads kernels sum a head within a warp).
    let mut nvfp4 = odd(512);
    super::nvfp4::nvfp4_cache(&mut nvfp4);
    assert_eq!(invalid_arg(&nvfp4), "norm");
    nvfp4.norm = None;
    assert!(plan_of(&nvfp4).is_ok());
    r.norm = None;
    assert!(plan_of(&r).is_ok());
}
