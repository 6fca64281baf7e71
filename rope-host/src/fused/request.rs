//! A fused launch by address ([`FusedRequest`]): what `bind` makes of the views, and what the
//! planner (`plan.rs`, `rows.rs`) validates and plans, in plain values.

use rope_kernels::abi::NormCode;

use super::CacheLayout;
use crate::bind::RawBuf;
use crate::layout::Layout;
use crate::plan::{Request, TensorReq};
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

impl FusedRequest {
    /// A plain rotation as a fused launch with nothing normalised, quantised or cached: q and k
    /// rotated over the whole head (either direction), each in place or into its output. q
    /// alone goes with an empty k: no heads, at q's address, so that it spans, stores and
    /// overlaps nothing, and no thread of the fused kernels takes a head of it. `None` for the
    /// rotations the fused kernels do not perform (partial or offset).
    pub(crate) fn rotation(rope: &Request) -> Option<Self> {
        let cfg = &rope.config;
        if cfg.rotary_dim() != cfg.head_dim() || cfg.rotary_offset() != 0 {
            return None;
        }
        let k = rope.k.unwrap_or(TensorReq {
            x: rope.q.x,
            x_layout: Layout {
                heads: 0,
                ..rope.q.x_layout
            },
            out: None,
        });
        Some(Self {
            rope: Request {
                k: Some(k),
                ..*rope
            },
            q_fp8: None,
            k_written: true,
            v: None,
            norm: None,
            cache: None,
        })
    }
}
