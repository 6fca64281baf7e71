//! A fused launch by address ([`FusedRequest`]): what `bind` makes of the views, and what the
//! planner (`plan.rs`, `rows.rs`) validates and plans, in plain values.

use rope_kernels::abi::NormCode;

use super::CacheLayout;
use crate::bind::RawBuf;
use crate::layout::Layout;
use crate::plan::Request;
use crate::positions::RawInts;

/// An FP8 scale array by address: one `f32`, or one per head.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawScale {
    /// The argument it came from, for errors.
    pub(crate) arg: &'static str,
    pub(crate) buf: RawBuf,
    pub(crate) per_head: bool,
}

/// The normalisation's weights by address.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawNorm {
    pub(crate) q_weight: RawBuf,
    pub(crate) k_weight: RawBuf,
    pub(crate) eps: f32,
    pub(crate) code: NormCode,
}

/// The cache write by address.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawCache {
    pub(crate) slots: RawInts,
    pub(crate) layout: CacheLayout,
    pub(crate) k: RawBuf,
    pub(crate) v: RawBuf,
    /// FP8 caches' scales (k's, v's); `None` for caches of the tensors' type.
    pub(crate) fp8: Option<(RawScale, RawScale)>,
}

/// Everything validation of a fused launch needs, in plain values.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedRequest {
    /// q and k (always present) with their inputs and outputs, positions and sin/cos; q's
    /// output is FP8 bits when `q_fp8` is set, and `fused` means one QKV buffer.
    pub(crate) rope: Request,
    pub(crate) q_fp8: Option<RawScale>,
    /// Whether k's rotated heads are written to k (in place or its output), not only cached.
    pub(crate) k_written: bool,
    pub(crate) v: Option<(RawBuf, Layout)>,
    pub(crate) norm: Option<RawNorm>,
    pub(crate) cache: Option<RawCache>,
}
