//! The encode step of a fused launch: a validated [`FusedRequest`] and its [`FusedPlan`] as the
//! kernels' arguments ([`FusedArgs`], and for FlashInfer's forms [`FusedFormsArgs`]).

use std::num::NonZeroU32;

use rope_kernels::abi::{FormatCode, NopeCached, NormCode, SlotCode};
use rope_kernels::divide::Divisor;

use super::plan::FusedPlan;
use super::request::{self, CacheStore, FusedRequest, NopePart, RawScale, ScaleSource};
use super::{Fp8Format, NonRotaryCache, RawCacheAddress};
use crate::bind::RawBuf;
use crate::kernel_args::{FusedArgs, FusedFormsArgs, Nvfp4Args, RopeArgs};
use crate::layout::Layout;
use crate::positions::IntType;

/// One FP8 destination's scale as the kernels take it: the address, the step between heads (0
/// for one scale, 1 for one per head) and the multiplier the kernel takes where the address is 0
/// (a multiplier by value, or no FP8 store).
pub(super) type ScaleArg = (u64, u32, f32);

/// The [`ScaleArg`]s of q's output, k's (FP8 output or cache) and v's cache, in that order,
/// found once per launch for [`encode`] (the addresses and steps) and [`encode_forms`] (the
/// multipliers). Each destination keeps its own granularity, so a per-head k scale beside a
/// per-tensor v scale (or the reverse) is read as given.
pub(super) fn scale_args(req: &FusedRequest) -> [ScaleArg; 3] {
    let arg = |s: Option<RawScale>| match s.map(|s| s.source) {
        Some(ScaleSource::Array { buf, per_head }) => (buf.ptr, u32::from(per_head), 0.0),
        Some(ScaleSource::Multiplier(m)) => (0, 0, m),
        None => (0, 0, 0.0),
    };
    // The cache's scales: FP8's, or NVFP4's global ones.
    let cache = req.cache.and_then(|c| match c.store {
        CacheStore::Elem => None,
        CacheStore::Fp8(f) => Some((f.k, f.v)),
        CacheStore::Nvfp4(n) => Some((n.k, n.v)),
    });
    let k = req.k_fp8.map(|f| f.scale).or(cache.map(|c| c.0));
    [
        arg(req.q_fp8.map(|f| f.scale)),
        arg(k),
        arg(cache.map(|c| c.1)),
    ]
}

/// A non-rotary part's arguments (zeros without one): the input's address (at its offset,
/// `es`-byte elements), its token and head strides, then the output's (bytes). The plan
/// checked both spans are below 2^32 elements, so the strides fit `u32`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct NopeArgs {
    pub(super) x: u64,
    pub(super) x_strides: [u32; 2],
    pub(super) out: u64,
    pub(super) out_strides: [u32; 2],
}

/// The address of a part's input or output (at its offset, `size`-byte elements) and its token
/// and head strides.
fn part_at((buf, l): (RawBuf, Layout), size: usize) -> (u64, [u32; 2]) {
    (
        buf.ptr + (l.offset * size) as u64,
        [l.strides[1] as u32, l.strides[2] as u32],
    )
}

/// The arguments of `part` (zeros without one).
fn nope_args(part: Option<NopePart>, es: usize) -> NopeArgs {
    let Some(p) = part else {
        return NopeArgs::default();
    };
    let (x, x_strides) = part_at(p.input, es);
    let (out, out_strides) = part_at(p.output, 1);
    NopeArgs {
        x,
        x_strides,
        out,
        out_strides,
    }
}

/// k's part into the cache as the kernels take it: its [`NopeArgs`] (the output at the cache
/// part's first byte: after the rotated features of the k cache, or the latent cache, v's
/// buffer; no output strides), the [`NopeCached`] bits (v's features past the rotation too,
/// after the rotated ones) and that destination's block, row and head strides (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CachedNopeArgs {
    pub(super) part: NopeArgs,
    pub(super) cached: NopeCached,
    pub(super) strides: [u64; 3],
}

/// [`CachedNopeArgs`] of `req` (`None` without a part into the cache).
pub(super) fn cached_nope_args(req: &FusedRequest, es: usize) -> Option<CachedNopeArgs> {
    let (part, cache) = (req.nope.cached?, req.cache?);
    let (x, x_strides) = part_at(part.input, es);
    let (out, layout, bits) = match part.into {
        NonRotaryCache::AfterRotated => {
            let v = if req.v.is_some() { NopeCached::V } else { 0 };
            // The part's first element, `head_dim` elements of the cache's format into k's head.
            let ces = cache.element_size(es) as u64;
            let head_dim = u64::from(req.rope.config.head_dim()) * ces;
            (cache.k.ptr + head_dim, cache.layout, NopeCached::K | v)
        }
        NonRotaryCache::Latent(l) => (cache.v.ptr, l, NopeCached::K),
    };
    Some(CachedNopeArgs {
        part: NopeArgs {
            x,
            x_strides,
            out,
            out_strides: [0; 2],
        },
        cached: NopeCached(bits),
        strides: layout.strides.map(|s| s as u64),
    })
}

/// q's and k's output addresses (`out0`, `out1`): an FP8 output's offset counts bytes, not
/// elements of the input's type; k's is null when k is only cached.
pub(super) fn output_addresses(req: &FusedRequest, rope: &RopeArgs) -> (u64, u64) {
    let out0 = match (req.q_fp8, req.rope.q.out) {
        (Some(_), Some((buf, layout))) => buf.ptr + layout.offset as u64,
        _ => rope.out0,
    };
    let out1 = match (req.k_fp8, req.rope.k.and_then(|k| k.out)) {
        (Some(_), Some((buf, layout))) => buf.ptr + layout.offset as u64,
        _ if req.k_written => rope.out1,
        _ => 0,
    };
    (out0, out1)
}

/// The kernels' code of an output stored as `fp8` (the tensors' type without).
pub(super) fn format_code(fp8: Option<Fp8Format>) -> u32 {
    fp8.map_or(FormatCode::Elem, Fp8Format::code) as u32
}

/// The page-table arguments: `slot_mode`, `page_positions`, `kv_indptr`, `kv_indices`,
/// `kv_requests`, `kv_pages` (zeros without one); with one, `slots` is its `batch_indices`.
fn page_table_args(cache: Option<&request::RawCache>) -> (u32, u64, u64, u64, u32, u32) {
    match cache.map(|c| c.address) {
        Some(RawCacheAddress::PageTable(t)) => (
            SlotCode::PageTable as u32,
            t.positions.ptr,
            t.kv_indptr.ptr,
            t.kv_indices.ptr,
            // The plan checked the lengths fit u32 and kv_indptr holds at least one entry.
            (t.kv_indptr.len - 1) as u32,
            t.kv_indices.len as u32,
        ),
        _ => (SlotCode::Slots as u32, 0, 0, 0, 0, 0),
    }
}

/// The fused kernel's arguments: the RoPE arguments of the request (q's output in bytes for
/// FP8, k's output null when k is only cached) and the fused ones.
pub(super) fn encode(
    req: &FusedRequest,
    plan: &FusedPlan,
    rope: RopeArgs,
    scales: &[ScaleArg; 3],
) -> FusedArgs {
    let (out0, out1) = output_addresses(req, &rope);
    let es = req.rope.dtype.size() as u64;
    let (v, heads_v, v_strides) = match req.v {
        Some((buf, l)) => (
            buf.ptr + l.offset as u64 * es,
            l.heads as u32,
            l.strides.map(|s| s as u64),
        ),
        None => (0, 0, [0; 3]),
    };
    let (norm, q_norm_weight, k_norm_weight, norm_eps) = match req.norm {
        Some(n) => (n.code as u32, n.q_weight.ptr, n.k_weight.ptr, n.eps),
        None => (NormCode::None as u32, 0, 0, 0.0),
    };
    let [
        (q_scale, q_scale_step, _),
        (k_scale, k_scale_step, _),
        (v_scale, v_scale_step, _),
    ] = *scales;
    let c = req.cache.as_ref();
    let (slots, slots_wide) = match c.map(|c| c.address) {
        Some(RawCacheAddress::Slots(s)) => (s.buf.ptr, u32::from(s.ty == IntType::I64)),
        Some(RawCacheAddress::PageTable(t)) => (t.batch_indices.ptr, 0),
        None => (0, 0),
    };
    let strides = c.map_or([0; 3], |c| c.layout.strides.map(|s| s as u64));
    let block = plan.block;
    macro_rules! with_rope {
        ({ $r:ident } $($param:ident: $kind:ident,)*) => {
            FusedArgs {
                $($param: $r.$param,)*
                v,
                heads_v,
                v_stride_batch: v_strides[0],
                v_stride_seq: v_strides[1],
                v_stride_head: v_strides[2],
                head_dim: req.rope.config.head_dim(),
                norm,
                q_norm_weight,
                k_norm_weight,
                norm_eps,
                q_format: format_code(req.q_fp8.map(|f| f.format)),
                q_scale,
                q_scale_step,
                slots,
                slots_wide,
                k_cache: c.map_or(0, |c| c.k.ptr),
                v_cache: c.map_or(0, |c| c.v.ptr),
                cache_stride_block: strides[0],
                cache_stride_slot: strides[1],
                cache_stride_head: strides[2],
                block_size: block.divisor.get(),
                block_magic: block.magic,
                block_shift: block.shift,
                cache_slots: plan.cache_slots,
                cache_format: c.map_or(FormatCode::Elem, |c| c.format_code()) as u32,
                k_scale,
                v_scale,
                k_scale_step,
                v_scale_step,
                q_warps: plan.token_warps[0],
                k_warps: plan.token_warps[1],
                v_warps: plan.token_warps[2],
                prefetch_tokens: plan.prefetch_tokens,
                sin_sign: req.rope.config.direction().sin_sign(),
            }
        };
    }
    let mut args = rope_kernels::rope_kernel_params!(with_rope { rope });
    (args.out0, args.out1) = (out0, out1);
    args
}

/// The arguments of a kernel of FlashInfer's forms: `base` ([`encode`]'s) and the forms' own
/// (`rope_kernels::fused_forms_kernel_params!`): the multipliers (of `scales`, as `base`'s
/// scales), k's output format, the page table, the non-rotary parts.
pub(super) fn encode_forms(
    req: &FusedRequest,
    plan: &FusedPlan,
    base: FusedArgs,
    scales: &[ScaleArg; 3],
) -> FusedFormsArgs {
    let [
        (_, _, q_multiplier),
        (_, _, k_multiplier),
        (_, _, v_multiplier),
    ] = *scales;
    let (slot_mode, page_positions, kv_indptr, kv_indices, kv_requests, kv_pages) =
        page_table_args(req.cache.as_ref());
    let es = req.rope.dtype.size();
    let q_nope = nope_args(req.nope.q, es);
    let cached = cached_nope_args(req, es).unwrap_or(CachedNopeArgs {
        part: nope_args(req.nope.k, es),
        cached: NopeCached::NONE,
        strides: [0; 3],
    });
    let k_nope = cached.part;
    // Without parts no block reaches `rope_blocks`.
    let (rope_blocks, threads, accesses) = plan
        .nope
        .map_or((u32::MAX, Divisor::new(NonZeroU32::MIN), 0), |n| {
            (n.rope_blocks, n.threads, n.accesses)
        });
    macro_rules! with_base {
        ({ $b:ident } $($param:ident: $kind:ident,)*) => {
            FusedFormsArgs {
                $($param: $b.$param,)*
                q_multiplier,
                k_multiplier,
                v_multiplier,
                k_format: format_code(req.k_fp8.map(|f| f.format)),
                slot_mode,
                page_positions,
                kv_indptr,
                kv_indices,
                kv_requests,
                kv_pages,
                rope_blocks,
                nope_threads: threads.divisor.get(),
                nope_magic: threads.magic,
                nope_shift: threads.shift,
                nope_accesses: accesses,
                q_nope: q_nope.x,
                q_nope_stride_token: q_nope.x_strides[0],
                q_nope_stride_head: q_nope.x_strides[1],
                q_nope_out: q_nope.out,
                q_nope_out_stride_token: q_nope.out_strides[0],
                q_nope_out_stride_head: q_nope.out_strides[1],
                k_nope: k_nope.x,
                k_nope_stride_token: k_nope.x_strides[0],
                k_nope_stride_head: k_nope.x_strides[1],
                k_nope_out: k_nope.out,
                k_nope_out_stride_token: k_nope.out_strides[0],
                k_nope_out_stride_head: k_nope.out_strides[1],
                nope_cached: cached.cached.0,
                nope_cache_stride_block: cached.strides[0],
                nope_cache_stride_slot: cached.strides[1],
                nope_cache_stride_head: cached.strides[2],
            }
        };
    }
    rope_kernels::fused_kernel_params!(with_base { base })
}

/// The arguments of a kernel of NVFP4 caches: `base` ([`encode`]'s: the codes' buffers as the
/// caches, the global scales as the cache scales), the block scales' addresses and strides.
pub(super) fn encode_nvfp4(req: &FusedRequest, base: FusedArgs) -> Nvfp4Args {
    let (k_block_scales, v_block_scales, strides) = match req.cache.map(|c| c.store) {
        Some(CacheStore::Nvfp4(n)) => (
            n.k_block_scales.ptr,
            n.v_block_scales.ptr,
            n.scale_strides.map(|s| s as u64),
        ),
        _ => (0, 0, [0; 3]),
    };
    macro_rules! with_base {
        ({ $b:ident } $($param:ident: $kind:ident,)*) => {
            Nvfp4Args {
                $($param: $b.$param,)*
                k_block_scales,
                v_block_scales,
                scale_stride_block: strides[0],
                scale_stride_slot: strides[1],
                scale_stride_head: strides[2],
            }
        };
    }
    rope_kernels::fused_kernel_params!(with_base { base })
}
