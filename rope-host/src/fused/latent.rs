//! MLA's latent cache as v's heads: where the latent cache's rows are the k cache's rows
//! (vLLM's one MLA cache, `[num_blocks, block_size, kv_lora_rank + rot_dim]`: each row the
//! latent features, then the rotated `k_pe`), the latent features of a token are v heads of
//! `head_dim` features stored into its slot at the cache's strides, which the plain kernels
//! (four heads a thread at prefill, one at decode) store with q's and k's heads in one launch.
//! FlashInfer's forms' non-rotary blocks would store them instead, on the two-heads kernels of
//! those forms, in a launch of its own at prefill (`super::apart`) (docs/perf/decisions.md, "MLA's
//! latent cache as v's heads").

use super::NonRotaryCache;
use super::plan::{FusedPlan, flashinfer_form};
use super::request::{CacheStore, FusedRequest, NopeParts, RawCache, RawScale, ScaleSource};
use crate::error::Result;
use crate::layout::Layout;

/// `req` with MLA's latent features as v's heads (see the module), planned by `plan_of`, where
/// `req` (validated by `plan_fused`) has one k head, a latent cache whose blocks and rows are the
/// k cache's, a latent part of a whole number of heads, and no other of FlashInfer's forms, and
/// where `plan_of` plans it. `None`: launch `req` as planned.
pub(super) fn latent_as_v(
    req: &FusedRequest,
    plan_of: &dyn Fn(&FusedRequest) -> Result<Option<FusedPlan>>,
) -> Option<(FusedRequest, FusedPlan)> {
    let heads = req.as_latent_v()?;
    let plan = plan_of(&heads).ok()??;
    Some((heads, plan))
}

impl FusedRequest {
    /// This request with its latent part as v's heads (see [`latent_as_v`]), `None` where it
    /// has no latent part or one the plain kernels cannot store as v heads.
    fn as_latent_v(&self) -> Option<Self> {
        let part = self.nope.cached?;
        let NonRotaryCache::Latent(latent) = part.into else {
            return None;
        };
        let cache = self.cache?;
        let k = self.rope.k?;
        let head_dim = self.rope.config.head_dim() as usize;
        let (buf, x) = part.input;
        let l = cache.layout;
        let rows_of =
            |c: &super::CacheLayout| (c.num_blocks, c.block_size, c.strides[0], c.strides[1]);
        let rows_shared = rows_of(&latent) == rows_of(&l);
        if !rows_shared
            || k.x_layout.heads != 1
            || x.heads != 1
            || self.v.is_some()
            || self.nope.q.is_some()
            || self.nope.k.is_some()
            || head_dim == 0
            || !x.head_dim.is_multiple_of(head_dim)
        {
            return None;
        }
        // The latent part is stored with k's scale (the cache's `v_scale` is not used): one, or
        // k's one head's, for all its heads.
        let one_scale = |s: RawScale| RawScale {
            source: match s.source {
                ScaleSource::Array { buf, .. } => ScaleSource::Array {
                    buf,
                    per_head: false,
                },
                multiplier => multiplier,
            },
            ..s
        };
        let store = match cache.store {
            CacheStore::Elem => CacheStore::Elem,
            CacheStore::Fp8(f) => CacheStore::Fp8(super::request::CacheFp8 {
                v: one_scale(f.k),
                ..f
            }),
            CacheStore::Nvfp4(_) => return None,
        };
        let heads = Self {
            v: Some((
                buf,
                Layout {
                    heads: x.head_dim / head_dim,
                    head_dim,
                    strides: [x.strides[0], x.strides[1], head_dim],
                    ..x
                },
            )),
            cache: Some(RawCache {
                layout: super::CacheLayout {
                    strides: [l.strides[0], l.strides[1], head_dim],
                    ..l
                },
                store,
                ..cache
            }),
            nope: NopeParts::default(),
            ..*self
        };
        // Every other form of FlashInfer's keeps the launch on those forms' kernels.
        flashinfer_form(&heads).is_none().then_some(heads)
    }
}
