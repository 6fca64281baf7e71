//! The four-heads kernels' prefetch of heads to come (`prefetch_ahead` in
//! `rope-kernels/src/fused.rs`): how far ahead, and on which devices.

use crate::handle::DeviceFacts;

/// Bytes of heads the four-heads kernels keep asked for in L2 ahead of the tokens their
/// threads work on ([`prefetch_tokens`]): far enough that the lines arrive before their tokens'
/// blocks start, near enough that the bytes streaming through L2 in between (the launch's
/// reads and writes) do not evict them first. Of the distances tried at prefill, 4 MiB was the
/// fastest for every fusion: nearer ones gain less, farther ones lose lines to eviction
/// (docs/perf/decisions.md).
pub(crate) const PREFETCH_BYTES: u64 = 4 << 20;

/// The DRAM bandwidth (GB/s, [`DeviceFacts::dram_gb_per_s`]) from which the four-heads
/// kernels prefetch: the prefetch was measured to pay on devices above it. Devices below it,
/// whose four-heads launches already come close to their copy without it, go without until it
/// is measured there (docs/perf/decisions.md).
pub(crate) const PREFETCH_MIN_DRAM_GB_PER_S: u32 = 4000;

/// The four-heads kernels' prefetch distance on `facts`' device: the tokens whose heads
/// (`heads_per_token` heads of `head_bytes` bytes read per token: q's, and k's and v's where
/// the launch stores them) make [`PREFETCH_BYTES`], at least 1 and at most `u32::MAX`; 0 (no
/// prefetch) below [`PREFETCH_MIN_DRAM_GB_PER_S`].
pub(crate) fn prefetch_tokens(facts: &DeviceFacts, heads_per_token: u32, head_bytes: u64) -> u32 {
    if facts.dram_gb_per_s < PREFETCH_MIN_DRAM_GB_PER_S {
        return 0;
    }
    let per_token = (u64::from(heads_per_token) * head_bytes).max(1);
    (PREFETCH_BYTES / per_token).clamp(1, u64::from(u32::MAX)) as u32
}
