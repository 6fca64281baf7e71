//! q apart from FlashInfer's forms (`apart.rs`): which launches run as two, and what each
//! part holds.

use rope_kernels::abi::{FusedForms, Mapping};

use super::*;
use crate::fused::apart::q_apart;
use crate::fused::request::NopeParts;
use crate::positions::IdsShape;

/// MLA as vLLM's `concat_and_cache_mla_rope_fused` launches it at `tokens` tokens: 128 q heads
/// of 64 rotated features in place, one k head of 64 in place and into the k cache, k's 512
/// latent features into the latent cache (FlashInfer's forms: k's part into the cache), FP8
/// caches; every buffer far apart.
pub(super) fn mla(tokens: usize) -> FusedRequest {
    let blocks = tokens.div_ceil(16) + 1;
    let q = Layout::thd(tokens, 128, 64);
    let k = Layout::thd(tokens, 1, 64);
    let part = Layout::thd(tokens, 1, 512);
    let k_cache = CacheLayout::blocks_rows_heads(blocks, 16, 1, 64);
    let latent = CacheLayout::blocks_rows_heads(blocks, 16, 1, 512);
    let mut r = FusedRequest {
        rope: Request {
            config: RopeConfig::builder(64, RopeStyle::Neox)
                .build()
                .expect("valid"),
            dtype: DType::BF16,
            q: TensorReq {
                x: buf(1 << 40, q.end().expect("fits")),
                x_layout: q,
                out: None,
            },
            k: Some(TensorReq {
                x: buf(1 << 41, k.end().expect("fits")),
                x_layout: k,
                out: None,
            }),
            packed: false,
            positions: RawPositions::Ids {
                ids: RawInts {
                    buf: buf(1 << 42, tokens),
                    ty: IntType::I64,
                },
                shape: IdsShape::PerRow,
            },
            sincos: RawSinCos::Computed { theta: 1e4 },
        },
        q_fp8: None,
        k_fp8: None,
        k_written: true,
        v: None,
        norm: None,
        cache: Some(RawCache {
            address: RawCacheAddress::Slots(RawInts {
                buf: buf(1 << 43, tokens),
                ty: IntType::I64,
            }),
            layout: k_cache,
            k: buf(1 << 44, blocks * 16 * 64),
            v: buf(1 << 45, blocks * 16 * 512),
            store: CacheStore::Elem,
        }),
        nope: NopeParts {
            cached: Some(CachedNope {
                input: (buf(1 << 46, part.end().expect("fits")), part),
                into: NonRotaryCache::Latent(latent),
            }),
            ..Default::default()
        },
    };
    fp8_cache(&mut r);
    r
}

fn apart(r: &FusedRequest) -> Option<[(FusedRequest, FusedPlan); 2]> {
    let whole = plan_of(r).expect("valid").expect("non-empty");
    q_apart(r, &whole, &plan_of)
}

/// At prefill, MLA's q heads run alone on the four-heads kernels, then k's head, the caches
/// and the latent part on FlashInfer's forms' kernels with no q thread; each part holds its
/// side's tensors alone.
#[test]
fn prefill_runs_q_apart_from_flashinfer_forms_on_four_heads() {
    let r = mla(8192);
    let [(q, q_plan), (rest, rest_plan)] = apart(&r).expect("two launches");
    assert_eq!(q_plan.kernel.mapping, Mapping::FOUR_HEADS);
    assert_eq!(q_plan.kernel.forms, FusedForms::Plain);
    assert_eq!(q.rope.q.x, r.rope.q.x);
    assert_eq!(q.rope.k.expect("k").x_layout.heads, 0);
    assert!(q.cache.is_none() && q.nope.cached.is_none());
    assert_eq!(rest_plan.kernel.forms, FusedForms::FlashInfer);
    assert_eq!(rest.rope.q.x_layout.heads, 0);
    assert_eq!(rest_plan.token_warps[0], 0);
    assert_eq!(rest.rope.k.expect("k").x, r.rope.k.expect("k").x);
    assert!(rest.cache.is_some() && rest.nope.cached.is_some());
}

/// At decode, and with a FlashInfer form on q's side (a multiplier of q's FP8 output), the
/// launch stays one.
#[test]
fn decode_and_q_side_forms_stay_one_launch() {
    assert!(apart(&mla(64)).is_none());
    let mut r = mla(8192);
    r.q_fp8 = Some(RawFp8 {
        format: Fp8Format::E4m3,
        scale: RawScale {
            arg: "q.scale",
            source: ScaleSource::Multiplier(0.5),
        },
    });
    r.rope.q.out = Some((
        buf(1 << 49, r.rope.q.x_layout.end().expect("fits")),
        r.rope.q.x_layout,
    ));
    assert!(apart(&r).is_none());
    // Without FlashInfer's forms there is nothing to take apart.
    let mut plain = mla(8192);
    (plain.cache, plain.nope.cached) = (None, None);
    assert!(apart(&plain).is_none());
}
