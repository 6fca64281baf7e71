//! A fused launch by address ([`FusedRequest`]): what `bind` makes of the views, and what the
//! planner (`plan.rs`, `rows.rs`) validates and plans, in plain values.

use rope_kernels::abi::{FormatCode, NormCode};

use super::{CacheLayout, Fp8Format, NonRotaryCache, NormScope, RawCacheAddress};
use crate::bind::RawBuf;
use crate::layout::Layout;
use crate::plan::Request;

/// An FP8 destination's scale: an array by address (one `f32`, or one per head; the stored
/// value is `fp8(x / scale)`), or a multiplier by value (`fp8(x * multiplier)`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawScale {
    /// The argument it came from, for errors.
    pub(crate) arg: &'static str,
    pub(crate) source: ScaleSource,
}

/// Where [`RawScale`]'s multipliers come from.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ScaleSource {
    /// `1 / scale`, from one `f32` or one per head.
    Array { buf: RawBuf, per_head: bool },
    /// The value itself.
    Multiplier(f32),
}

/// An FP8 output: its format and its scale.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawFp8 {
    pub(crate) format: Fp8Format,
    pub(crate) scale: RawScale,
}

/// An FP8 cache's format and its k and v scales.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CacheFp8 {
    pub(crate) format: Fp8Format,
    pub(crate) k: RawScale,
    pub(crate) v: RawScale,
}

/// An NVFP4 cache's block-scale buffers, their byte strides (block, row, head) and its k and v
/// global scales (the codes' buffers are [`RawCache`]'s `k` and `v`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CacheNvfp4 {
    pub(crate) k_block_scales: RawBuf,
    pub(crate) v_block_scales: RawBuf,
    pub(crate) scale_strides: [usize; 3],
    pub(crate) k: RawScale,
    pub(crate) v: RawScale,
}

/// How a cache stores its elements.
#[derive(Clone, Copy, Debug)]
pub(crate) enum CacheStore {
    /// In the tensors' type.
    Elem,
    /// FP8, one byte each.
    Fp8(CacheFp8),
    /// NVFP4: half a byte each, and a scale per block.
    Nvfp4(CacheNvfp4),
}

/// A head's features outside the rotation by address (see [`super::NonRotary`]): the input
/// and its FP8 output (bytes), each with its layout.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NopePart {
    pub(crate) input: (RawBuf, Layout),
    pub(crate) output: (RawBuf, Layout),
}

/// k's features outside the rotation by address, stored into a cache (see
/// [`super::CacheNonRotary`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct CachedNope {
    pub(crate) input: (RawBuf, Layout),
    pub(crate) into: NonRotaryCache,
}

/// q's and k's features outside the rotation, stored beside their FP8 outputs or, k's, into the
/// cache (none for most launches).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct NopeParts {
    pub(crate) q: Option<NopePart>,
    pub(crate) k: Option<NopePart>,
    pub(crate) cached: Option<CachedNope>,
}

impl NopeParts {
    /// The latent cache's layout, when k's part goes to one (MLA).
    pub(crate) fn latent(&self) -> Option<CacheLayout> {
        match self.cached?.into {
            NonRotaryCache::Latent(l) => Some(l),
            NonRotaryCache::AfterRotated => None,
        }
    }

    /// The features the cached part adds to each k and v cache head (and v head), when it
    /// goes after the rotated ones (GQA/MHA); 0 otherwise.
    pub(crate) fn after_rotated(&self) -> usize {
        match self.cached {
            Some(c) if c.into == NonRotaryCache::AfterRotated => c.input.1.head_dim,
            _ => 0,
        }
    }
}

/// The normalisation's weights by address.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawNorm {
    pub(crate) q_weight: RawBuf,
    pub(crate) k_weight: RawBuf,
    pub(crate) eps: f32,
    pub(crate) code: NormCode,
    pub(crate) scope: NormScope,
}

impl RawNorm {
    /// Whether one factor normalises all of a token's heads of a tensor.
    pub(crate) fn across_heads(&self) -> bool {
        self.scope == NormScope::AcrossHeads
    }
}

/// The cache write by address.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawCache {
    pub(crate) address: RawCacheAddress,
    pub(crate) layout: CacheLayout,
    /// The caches (NVFP4's values).
    pub(crate) k: RawBuf,
    pub(crate) v: RawBuf,
    /// How they store their elements.
    pub(crate) store: CacheStore,
}

impl RawCache {
    /// FP8 caches' format and scales.
    pub(crate) fn fp8(&self) -> Option<CacheFp8> {
        match self.store {
            CacheStore::Fp8(f) => Some(f),
            _ => None,
        }
    }

    /// The kernels' code of the caches' format.
    pub(crate) fn format_code(&self) -> FormatCode {
        match self.store {
            CacheStore::Elem => FormatCode::Elem,
            CacheStore::Fp8(f) => f.format.code(),
            CacheStore::Nvfp4(_) => FormatCode::Nvfp4,
        }
    }

    /// Bytes of one cache element of the tensors' type or FP8: one for FP8 caches, else the
    /// tensors' `es` (NVFP4 caches are checked and addressed by `cache_checks::check_nvfp4`).
    pub(crate) fn element_size(&self, es: usize) -> usize {
        if self.fp8().is_some() { 1 } else { es }
    }
}

/// Everything validation of a fused launch needs, in plain values.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedRequest {
    /// q and k (always present) with their inputs and outputs, positions and sin/cos; q's
    /// output is FP8 bits when `q_fp8` is set (k's when `k_fp8` is), and `fused` means one QKV
    /// buffer.
    pub(crate) rope: Request,
    pub(crate) q_fp8: Option<RawFp8>,
    /// k's output is FP8 (then there is no cache).
    pub(crate) k_fp8: Option<RawFp8>,
    /// Whether k's rotated heads are written to k (in place or its output), not only cached.
    pub(crate) k_written: bool,
    pub(crate) v: Option<(RawBuf, Layout)>,
    pub(crate) norm: Option<RawNorm>,
    pub(crate) cache: Option<RawCache>,
    /// The non-rotary parts of q's and k's FP8 outputs.
    pub(crate) nope: NopeParts,
}
