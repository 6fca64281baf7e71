//! The four-heads kernels' prefetch distance (`prefetch_tokens` in `tuning.rs`), as the fused planner applies it.

use super::*;

/// Four-heads launches (prefill) on a device of at least 4 TB/s ask L2 for the heads of the
/// tokens `PREFETCH_BYTES` (4 MiB) of read heads ahead: 341 tokens of q's, k's and v's 48
/// heads of 256 bytes with the cache, 409 of q's and k's 40 without it, 512 of q's 32 beside
/// a k of no heads.
/// The two-heads kernels (decode), the rows kernels, and every launch on an H100's 3.35 TB/s
/// prefetch nothing.
#[test]
fn four_heads_launches_prefetch_four_mib_of_heads_ahead_on_fast_dram_only() {
    let with_cache = with_tokens(RopeStyle::Neox, 8192);
    let mut norm_rope = with_cache;
    (norm_rope.cache, norm_rope.v, norm_rope.k_written) = (None, None, true);
    // k of no heads: only q's heads are read and stored.
    let mut q_alone = norm_rope;
    let k = q_alone.rope.k.as_mut().expect("k");
    k.x_layout = Layout::thd(8192, 0, D);
    k.x.len = 0;
    for (r, ahead) in [(&with_cache, 341), (&norm_rope, 409), (&q_alone, 512)] {
        let p = plan_on(&H200, r, FusedKernels::Auto, false);
        assert_eq!(p.kernel.mapping, Mapping::FOUR_HEADS);
        assert_eq!(p.prefetch_tokens, ahead);
        let p = plan_on(&H100, r, FusedKernels::Auto, false);
        assert_eq!(p.kernel.mapping, Mapping::FOUR_HEADS);
        assert_eq!(p.prefetch_tokens, 0);
    }
    let decode = plan_on(&H200, &request(RopeStyle::Neox), FusedKernels::Auto, false);
    assert_eq!(decode.kernel.mapping, Mapping::TWO_HEADS);
    assert_eq!(decode.prefetch_tokens, 0);
    let mut fp8 = with_cache;
    fp8_cache(&mut fp8);
    let rows = plan_on(&H200, &fp8, FusedKernels::Auto, true);
    assert_eq!(rows.kernel.mapping, Mapping::Rows);
    assert_eq!(rows.prefetch_tokens, 0);
}
