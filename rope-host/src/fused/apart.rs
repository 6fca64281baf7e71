//! q apart from FlashInfer's forms: a fused launch whose FlashInfer forms are all on k's side
//! (k's part into the cache, as MLA's latent cache; k's FP8 output; the cache's E5M2,
//! multipliers or page table) would run every q head on the forms' two-heads kernels, which
//! have no four-heads variant. At prefill it runs as two launches instead: q's heads alone on
//! the four-heads kernels, then k's
//! and v's heads, the cache and the parts with q empty on the forms' kernels
//! (docs/perf/decisions.md, "q apart from FlashInfer's forms at prefill").

use rope_kernels::abi::{FusedForms, Mapping};

use super::plan::{FusedPlan, flashinfer_form};
use super::request::{FusedRequest, NopeParts};
use crate::error::Result;
use crate::layout::Layout;
use crate::plan::{Request, TensorReq};

/// The two launches of `req` (q's, then the rest), each with its plan, where `plan` (the whole
/// request's, which validated everything) takes FlashInfer's forms, q's side has none of them,
/// and q alone is planned by `plan_of` onto a four-heads kernel (launches of many waves:
/// decode stays one launch), as plain rotations take the fused kernels (`rotation.rs`): never
/// the rows kernels, whose bulk loads of each tensor's rows no launch with an empty tensor has
/// run. `None`: launch `req` as planned.
pub(super) fn q_apart(
    req: &FusedRequest,
    plan: &FusedPlan,
    plan_of: &dyn Fn(&FusedRequest) -> Result<Option<FusedPlan>>,
) -> Option<[(FusedRequest, FusedPlan); 2]> {
    if plan.kernel.forms != FusedForms::FlashInfer {
        return None;
    }
    let q = req.q_alone()?;
    if flashinfer_form(&q).is_some() {
        return None;
    }
    let q_plan = plan_of(&q).ok()??;
    if q_plan.kernel.mapping != Mapping::FOUR_HEADS {
        return None;
    }
    let rest = req.without_q()?;
    let rest_plan = plan_of(&rest).ok()??;
    Some([(q, q_plan), (rest, rest_plan)])
}

impl FusedRequest {
    /// q's heads alone: q with its output, FP8 format and norm weight, k empty (no heads, at
    /// q's address, as [`FusedRequest::rotation`] has it), nothing cached. `None` without q
    /// heads.
    fn q_alone(&self) -> Option<Self> {
        let q = self.rope.q;
        if q.x_layout.heads == 0 {
            return None;
        }
        Some(Self {
            rope: Request {
                k: Some(empty_at(q)),
                ..self.rope
            },
            q_fp8: self.q_fp8,
            k_fp8: None,
            k_written: true,
            v: None,
            norm: self.norm,
            cache: None,
            nope: NopeParts {
                q: self.nope.q,
                k: None,
                cached: None,
            },
        })
    }

    /// Everything but q's heads: q empty (no heads, at k's address), k, v, the cache and k's
    /// parts as they were. `None` without k.
    fn without_q(&self) -> Option<Self> {
        let k = self.rope.k?;
        Some(Self {
            rope: Request {
                q: empty_at(k),
                ..self.rope
            },
            q_fp8: None,
            nope: NopeParts {
                q: None,
                ..self.nope
            },
            ..*self
        })
    }
}

/// A tensor of `t`'s batch, seq and strides with no heads, at `t`'s address, read in place: it
/// spans, stores and overlaps nothing, and no thread takes a head of it.
pub(super) fn empty_at(t: TensorReq) -> TensorReq {
    TensorReq {
        x: t.x,
        x_layout: Layout {
            heads: 0,
            ..t.x_layout
        },
        out: None,
    }
}
