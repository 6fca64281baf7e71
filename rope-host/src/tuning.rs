//! The tuning rules: where a launch's kernel or its parameters are chosen from the device's
//! facts ([`DeviceFacts`]) rather than from the launch's shapes alone. Each rule's measurement
//! is in docs/perf/decisions.md. Also the kernels tests may pin ([`FusedKernels`]).

use rope_kernels::abi::FusedKernelName;

use crate::device::DeviceFacts;

/// Which fused kernels a handle's launches take ([`crate::Rope::with_fused_kernels`]):
/// [`FusedKernels::Auto`], the planner's choice by the launch and the device, unless a test or a
/// benchmark pins one to reach kernels the planner keeps for other shapes or devices. A pinned
/// choice that cannot serve a launch leaves that launch to the planner. Hidden from the
/// documentation: the planner's choice is the one users want.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FusedKernels {
    /// The planner's choice.
    #[default]
    Auto,
    /// The item loop for every launch ([`rope_kernels::abi::Mapping::ItemLoop`]), whose
    /// preferred-width kernels otherwise serve only tensors spanning 2^32 elements or more.
    ItemLoop,
    /// The two-heads kernels wherever they serve (where the planner would take four heads per
    /// thread at many waves).
    TwoHeads,
    /// The four-heads kernels ([`FusedKernelName::four_heads`]: every pairing and type without
    /// FlashInfer's forms) wherever they serve, else as [`FusedKernels::TwoHeads`].
    FourHeads,
    /// The rows kernels ([`rope_kernels::abi::Mapping::Rows`], sm_90 builds) wherever they
    /// serve, with this many token buffers per block (2 to `ROWS_MAX_STAGES`, fewer where they
    /// do not fit), else as
    /// [`FusedKernels::Auto`].
    Rows {
        /// Token buffers per block.
        stages: u32,
    },
}

impl FusedKernels {
    /// The rows kernels with the planner's [`ROWS_STAGES`] token buffers per block.
    pub const ROWS: Self = Self::Rows {
        stages: ROWS_STAGES,
    };

    /// Every choice, the rows kernels as [`FusedKernels::ROWS`] (for tests that cover each).
    pub const ALL: [Self; 5] = [
        Self::Auto,
        Self::ItemLoop,
        Self::TwoHeads,
        Self::FourHeads,
        Self::ROWS,
    ];
}

/// Registers of one multiprocessor (64 Ki 32-bit registers on sm_80 to sm_90).
const REGISTERS_PER_SM: u32 = 65_536;

/// Whether a launch of two-heads `kernel` over `tokens` tokens, `warps` warps per token, has
/// more than twice the threads `facts`' device holds of it at once at its registers: many
/// waves, where the launch is bound by the instructions it issues and four heads per thread
/// share a thread's set-up (prefill); otherwise two keep each thread's chain short, and the
/// launch fills the device anyway (decode).
pub(crate) fn many_waves(
    kernel: FusedKernelName,
    facts: &DeviceFacts,
    tokens: u64,
    warps: u32,
) -> bool {
    let Some(registers) = kernel.token_heads_registers().filter(|&r| r > 0) else {
        return false;
    };
    let resident = u64::from(facts.sm_count)
        * u64::from(facts.threads_per_sm.min(REGISTERS_PER_SM / registers));
    tokens.saturating_mul(u64::from(warps) * 32) > 2 * resident
}

/// The DRAM bandwidth (GB/s, [`DeviceFacts::dram_gb_per_s`]) from which the rows kernels take
/// the launches of the four-heads kernels that store FP8. At prefill, on devices above it the
/// rows kernels are clearly faster than the four-heads kernels for FP8 stores (with the
/// four-heads kernels' prefetch, [`prefetch_tokens`], too) and as fast or slower for 16-bit
/// ones; on devices below it the four-heads kernels are faster for every store
/// (docs/perf/decisions.md).
pub(crate) const ROWS_MIN_DRAM_GB_PER_S: u32 = 4000;

/// Token buffers per block of the rows kernels: the copies run one token ahead of the
/// arithmetic.
pub(crate) const ROWS_STAGES: u32 = 2;

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
