//! Plain rotations on the fused kernels: a rotation of [`Rope::run`](crate::Rope::run) that the
//! fused planner, given nothing to normalise, quantise or cache, would give a four-heads kernel
//! is launched on it (docs/perf/decisions.md, "Plain rotations at prefill take the fused
//! kernels").

use rope_kernels::abi::{
    FusedForms, FusedKernelName, Mapping, SinCosSource, ThreadHeads, preferred_lanes,
};

use super::apart::empty_at;
use super::plan::FusedPlan;
use super::request::FusedRequest;
use crate::config::RopeConfig;
use crate::device::DeviceFacts;
use crate::handle::Rope;
use crate::layout::Layout;
use crate::plan::{Request, TensorReq, token_heads_warps};
use crate::positions::RawPositions;
use crate::sincos::RawSinCos;
use crate::tuning::many_waves;

impl Rope {
    /// The fused launch that a plain rotation takes instead of the RoPE kernels': its request
    /// with nothing normalised or cached and the plan, where the planner gives it a four-heads
    /// kernel (prefill; docs/perf/decisions.md, "Plain rotations at prefill take the
    /// fused kernels"). `None` leaves it to the RoPE kernels, which validate it again and name
    /// what is wrong where the fused planner refused it.
    pub(crate) fn rotation_on_fused(&self, rope: &Request) -> Option<(FusedRequest, FusedPlan)> {
        let req = FusedRequest::rotation(rope)?;
        if !rotation_may_take_four_heads(&req, &self.facts) {
            return None;
        }
        let plan = self.plan_fused(&req).ok()??;
        (plan.kernel.mapping == Mapping::FOUR_HEADS).then_some((req, plan))
    }
}

impl FusedRequest {
    /// A plain rotation as a fused launch with nothing normalised, quantised or cached: q and k
    /// rotated over the whole head (either direction), each in place or into its output. q
    /// alone goes with an empty k: no heads, at q's address, so that it spans, stores and
    /// overlaps nothing, and no thread of the fused kernels takes a head of it.
    ///
    /// A partial or offset rotation in place rotates, of each head, the `rotary_dim` elements
    /// from `rotary_offset` on and leaves the rest as they are: the same as a whole-head
    /// rotation of heads of `rotary_dim` elements that start `rotary_offset` elements further
    /// into the same buffers at the same strides (heads apart when `rotary_dim < head_dim`).
    /// `None` for the partial or offset rotations out of place, whose other elements are
    /// copied, which the fused kernels do not do.
    pub(crate) fn rotation(rope: &Request) -> Option<Self> {
        let cfg = &rope.config;
        let whole = cfg.rotary_dim() == cfg.head_dim() && cfg.rotary_offset() == 0;
        let rope = if whole {
            *rope
        } else {
            narrowed_in_place(rope)?
        };
        let rope = &rope;
        let k = rope.k.unwrap_or(empty_at(rope.q));
        Some(Self {
            rope: Request {
                k: Some(k),
                ..*rope
            },
            q_fp8: None,
            k_fp8: None,
            k_written: true,
            v: None,
            norm: None,
            cache: None,
            nope: Default::default(),
        })
    }
}

/// `rope`, rotated in place, as the whole-head rotation of its rotated elements
/// ([`FusedRequest::rotation`]): heads of `rotary_dim` elements, `rotary_offset` elements
/// further into each buffer. `None` when a tensor is written out of place.
fn narrowed_in_place(rope: &Request) -> Option<Request> {
    let cfg = &rope.config;
    let in_place = |t: &TensorReq| t.out.is_none();
    if !in_place(&rope.q) || !rope.k.as_ref().is_none_or(in_place) {
        return None;
    }
    let config = RopeConfig::builder(cfg.rotary_dim(), cfg.style())
        .direction(cfg.direction())
        .build()
        .ok()?;
    let (width, skip) = (cfg.rotary_dim() as usize, cfg.rotary_offset() as usize);
    let narrow = |t: TensorReq| {
        let layout = t.x_layout;
        Some(TensorReq {
            x_layout: Layout {
                head_dim: width,
                offset: layout.offset.checked_add(skip)?,
                ..layout
            },
            ..t
        })
    };
    Some(Request {
        config,
        q: narrow(rope.q)?,
        k: match rope.k {
            Some(k) => Some(narrow(k)?),
            None => None,
        },
        ..*rope
    })
}

/// Whether a plain rotation ([`FusedRequest::rotation`]) should be planned on the fused kernels:
/// only where the planner takes a four-heads kernel for it, launches at many waves
/// ([`many_waves`], reckoned here at the preferred width from the shapes alone), so that the
/// launches that stay on the RoPE kernels (decode above all) are not planned twice; and not
/// with multi-axis positions read with a table, which the RoPE kernels serve faster (they
/// read one position for a group's pairs of one axis).
pub(super) fn rotation_may_take_four_heads(req: &FusedRequest, facts: &DeviceFacts) -> bool {
    let rope = &req.rope;
    let Some(k) = rope.k else {
        return false;
    };
    let table = matches!(
        rope.sincos,
        RawSinCos::Table { .. } | RawSinCos::CosSinCache { .. }
    );
    if table && matches!(rope.positions, RawPositions::MultiAxis { .. }) {
        return false;
    }
    let cfg = &rope.config;
    let two_heads = FusedKernelName {
        style: cfg.style(),
        source: SinCosSource::Theta,
        dtype: rope.dtype,
        mapping: Mapping::TWO_HEADS,
        forms: FusedForms::Plain,
    };
    if two_heads.four_heads().is_none() {
        return false;
    }
    let pairs = preferred_lanes(cfg.style(), rope.dtype.size());
    let groups = cfg.half() / pairs;
    let heads = [rope.q.x_layout.heads, k.x_layout.heads].map(|h| h.min(u32::MAX as usize) as u32);
    let warps = heads
        .iter()
        .map(|&h| token_heads_warps(h, groups, ThreadHeads::Two.count()))
        .fold(0u32, u32::saturating_add);
    let tokens = (rope.q.x_layout.batch as u64).saturating_mul(rope.q.x_layout.seq as u64);
    many_waves(two_heads, facts, tokens, warps)
}
