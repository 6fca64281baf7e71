//! The fused checks of a launch's tensors: q, k and their outputs, v, the norm's weights, the
//! FP8 scales and the cache (the cache's and scales' own checks in `cache_checks.rs`, the
//! non-rotary parts' in `non_rotary.rs`), each region the launch reads or writes returned for
//! the overlap check. Shared by the fused, backward and across-heads plans.

use super::cache_checks::{check_cache, check_scale};
use super::non_rotary::{CACHE_NOPE_NAME, check_nope, head_width};
use super::request::FusedRequest;
use crate::check::{Of, Region, read_region, region, same_dims, wide_region};
use crate::error::{Result, invalid};
use crate::layout::{Layout, apart_in_one_buffer, packed_are_disjoint};
use crate::plan::{TensorReq, option_reads};

/// Checks every tensor, weight, scale and cache, and returns the regions the launch reads and
/// writes.
pub(super) fn check_fused_tensors(req: &FusedRequest, k: &TensorReq) -> Result<Vec<Region>> {
    let (cfg, es) = (&req.rope.config, req.rope.dtype.size());
    let q = &req.rope.q;
    // Room for every region a launch has (tensors, outputs, caches, slots, weights, scales,
    // tables, positions), so that the checks allocate once.
    let mut regions = Vec::with_capacity(16);
    regions.push(region(
        ("q", Of::Q),
        q.x,
        &q.x_layout,
        cfg,
        (es, q.out.is_none()),
    )?);
    if let Some((buf, l)) = q.out {
        let out_es = if req.q_fp8.is_some() { 1 } else { es };
        same_dims("q.output", &l, &q.x_layout)?;
        regions.push(region(("q.output", Of::Q), buf, &l, cfg, (out_es, true))?);
    }
    if !req.k_written && req.cache.is_none() {
        return Err(invalid(
            "k",
            "is only cached (KOut::CacheOnly), which needs a KvCache",
        ));
    }
    if req.k_fp8.is_some() && req.cache.is_some() {
        return Err(invalid(
            "k.output",
            "an FP8 k output and a cache write do not come together (k's scale serves one)",
        ));
    }
    let k_in_place = k.out.is_none() && req.k_written;
    regions.push(region(
        ("k", Of::K),
        k.x,
        &k.x_layout,
        cfg,
        (es, k_in_place),
    )?);
    same_tokens("k", &k.x_layout, &q.x_layout)?;
    if let Some((buf, l)) = k.out {
        let out_es = if req.k_fp8.is_some() { 1 } else { es };
        same_dims("k.output", &l, &k.x_layout)?;
        regions.push(region(("k.output", Of::K), buf, &l, cfg, (out_es, true))?);
    }
    if req.rope.packed && !packed_are_disjoint(&q.x_layout, &k.x_layout) {
        return Err(invalid(
            "k",
            "packed q and k must share batch and seq strides and address disjoint elements",
        ));
    }
    let latent = req.nope.latent().is_some();
    match (req.v, &req.cache) {
        (Some(_), Some(_)) if latent => {
            return Err(invalid(
                "v",
                "MLA's latent cache (NonRotaryCache::Latent) takes no v: k's non-rotary part \
                 stands for it",
            ));
        }
        (Some((buf, l)), Some(_)) => {
            same_tokens("v", &l, &q.x_layout)?;
            if l.heads != k.x_layout.heads {
                return Err(invalid(
                    "v",
                    format!("has {} heads, k has {}", l.heads, k.x_layout.heads),
                ));
            }
            if req.rope.packed
                && !(packed_are_disjoint(&q.x_layout, &l) && packed_are_disjoint(&k.x_layout, &l))
            {
                return Err(invalid(
                    "v",
                    "packed v must share q's batch and seq strides and address elements of its own",
                ));
            }
            let width = head_width(cfg, &req.nope);
            regions.push(wide_region(("v", Of::V), buf, &l, width, (es, false))?);
        }
        (Some(_), None) => {
            return Err(invalid("v", "is only read to fill a cache; pass a KvCache"));
        }
        (None, Some(_)) if latent => {}
        (None, Some(_)) => return Err(invalid("v", "a cache write needs v")),
        (None, None) => {}
    }
    if let Some(n) = &req.norm {
        if !n.eps.is_finite() || n.eps < 0.0 {
            return Err(invalid(
                "norm.eps",
                format!("must be finite and not negative, got {}", n.eps),
            ));
        }
        let weights = [
            ("norm.q_weight", n.q_weight, q.x_layout.heads),
            ("norm.k_weight", n.k_weight, k.x_layout.heads),
        ];
        for (arg, w, heads) in weights {
            // Across heads, one weight per feature of the token's heads of the tensor.
            let (want, of) = if n.across_heads() {
                (heads * cfg.head_dim() as usize, "heads * head_dim")
            } else {
                (cfg.head_dim() as usize, "head_dim")
            };
            if w.len != want {
                return Err(invalid(
                    arg,
                    format!("holds {} elements, needs {of} = {want}", w.len),
                ));
            }
            if !w.ptr.is_multiple_of(es as u64) {
                return Err(invalid(arg, format!("is not aligned to {es} bytes")));
            }
            regions.push(read_region(arg, (w.ptr, (w.len * es) as u64)));
        }
    }
    if let Some(f) = req.q_fp8 {
        regions.extend(check_scale(&f.scale, q.x_layout.heads)?);
    }
    if let Some(f) = req.k_fp8 {
        regions.extend(check_scale(&f.scale, k.x_layout.heads)?);
    }
    if let Some(c) = &req.cache {
        check_cache(c, (cfg, &req.nope), es, k.x_layout.heads, &mut regions)?;
    }
    regions.extend(check_nope(req, es)?);
    one_k_region(req, k, es, &mut regions);
    regions.extend(option_reads(&req.rope));
    Ok(regions)
}

/// Makes k's region and its cached non-rotary part's one where both are column ranges of one
/// buffer's rows and no element of one is an element of the other (vLLM splits one `[tokens,
/// kv_lora_rank + rot_dim]` projection into MLA's `kv_c` and `k_pe`, rotating `k_pe` in
/// place; [`apart_in_one_buffer`]).
fn one_k_region(req: &FusedRequest, k: &TensorReq, es: usize, regions: &mut Vec<Region>) {
    let Some(part) = req.nope.cached else { return };
    let (Some(ki), Some(pi)) = (
        regions.iter().position(|r| r.name == "k"),
        regions.iter().position(|r| r.name == CACHE_NOPE_NAME),
    ) else {
        return;
    };
    let (Some(kr), Some(pr)) = (regions.get(ki), regions.get(pi)) else {
        return;
    };
    if !(kr.start < pr.end && pr.start < kr.end) {
        return;
    }
    let (start, end) = (kr.start.min(pr.start), kr.end.max(pr.end));
    let (p_buf, p_layout) = part.input;
    if apart_in_one_buffer((k.x.ptr, &k.x_layout), (p_buf.ptr, &p_layout), es)
        && let Some(kr) = regions.get_mut(ki)
    {
        (kr.start, kr.end) = (start, end);
        regions.remove(pi);
    }
}

/// A tensor's batch and seq equal q's.
pub(super) fn same_tokens(arg: &'static str, l: &Layout, q: &Layout) -> Result<()> {
    if (l.batch, l.seq) != (q.batch, q.seq) {
        return Err(invalid(
            arg,
            format!(
                "batch and seq {:?} differ from q's {:?}",
                (l.batch, l.seq),
                (q.batch, q.seq)
            ),
        ));
    }
    Ok(())
}
