//! The bind step of a fused launch: the views of [`super::FusedOp`], [`super::FusedIo`] and
//! [`super::KvCache`] reduced to a [`FusedRequest`] of addresses, each checked to belong to the
//! binder's context (as `crate::bind` does for the RoPE launches).

use super::non_rotary::{CACHE_NOPE_NAME, K_NOPE_NAMES, Q_NOPE_NAMES};
use super::raw::{RawCacheAddress, RawFp8Scale, RawPageTable};
use super::request::{
    CacheFp8, CacheNvfp4, CacheStore, CachedNope, FusedRequest, NopePart, NopeParts, RawCache,
    RawFp8, RawNorm, RawScale,
};
use super::{
    CacheAddress, CacheData, Fp8Format, Fp8Scale, FusedIo, FusedOp, KOut, KvCache, NonRotary, QOut,
};
use crate::bind::Binder;
use crate::config::RopeElem;
use crate::error::Result;
use crate::op::{Tensor, TensorMut};
use crate::plan::TensorReq;

/// Reduces the views to a [`FusedRequest`] of addresses, each checked to belong to the
/// binder's context.
pub(super) fn bind<'s, T: RopeElem>(
    binder: &mut Binder<'s>,
    op: &'s FusedOp<'_, T>,
    io: &'s mut FusedIo<'_, T>,
    cache: Option<&'s mut KvCache<'_, T>>,
) -> Result<FusedRequest> {
    let tensor = |buf, layout| TensorReq {
        x: buf,
        x_layout: layout,
        out: None,
    };
    let mut nope = NopeParts::default();
    let (q, q_fp8, (k, k_fp8, k_written), v, packed) = match io {
        FusedIo::Separate { q, k, v } => {
            let (q, q_fp8) = match q {
                QOut::InPlace(t) => (tensor(binder.write("q", &mut t.data)?, t.layout), None),
                QOut::OutOfPlace { input, output } => (
                    bind_out_of_place(binder, ("q", "q.output"), input, output)?,
                    None,
                ),
                QOut::Fp8 {
                    input,
                    output,
                    scale,
                    format,
                    non_rotary,
                } => {
                    let names = ("q", "q.output", "q.scale", Q_NOPE_NAMES);
                    let io = (&*input, output, non_rotary.as_mut());
                    let (q, fp8, part) = bind_fp8(binder, names, io, scale, *format)?;
                    nope.q = part;
                    (q, Some(fp8))
                }
            };
            let k = match k {
                KOut::InPlace(t) => (
                    tensor(binder.write("k", &mut t.data)?, t.layout),
                    None,
                    true,
                ),
                KOut::OutOfPlace { input, output } => (
                    bind_out_of_place(binder, ("k", "k.output"), input, output)?,
                    None,
                    true,
                ),
                KOut::CacheOnly(t) => (tensor(binder.read("k", &t.data)?, t.layout), None, false),
                KOut::Fp8 {
                    input,
                    output,
                    scale,
                    format,
                    non_rotary,
                } => {
                    let names = ("k", "k.output", "k.scale", K_NOPE_NAMES);
                    let io = (&*input, output, non_rotary.as_mut());
                    let (k, fp8, part) = bind_fp8(binder, names, io, scale, *format)?;
                    nope.k = part;
                    (k, Some(fp8), true)
                }
            };
            let v = match v {
                Some(t) => Some((binder.read("v", &t.data)?, t.layout)),
                None => None,
            };
            (q, q_fp8, k, v, false)
        }
        FusedIo::Packed { data, q, k, v } => {
            let buf = binder.write("q", data)?;
            (
                tensor(buf, *q),
                None,
                (tensor(buf, *k), None, true),
                v.map(|l| (buf, l)),
                true,
            )
        }
    };
    let norm = match &op.norm {
        Some(n) => Some(RawNorm {
            q_weight: binder.read("norm.q_weight", &n.q_weight)?,
            k_weight: binder.read("norm.k_weight", &n.k_weight)?,
            eps: n.eps,
            code: n.weight.code(),
            scope: n.scope,
        }),
        None => None,
    };
    let cache = match cache {
        Some(c) => {
            let address = match &c.address {
                CacheAddress::Slots(s) => {
                    RawCacheAddress::Slots(s.bind("cache.slot_mapping", binder)?)
                }
                CacheAddress::PageTable(t) => RawCacheAddress::PageTable(RawPageTable {
                    batch_indices: binder.read("cache.batch_indices", &t.batch_indices)?,
                    positions: binder.read("cache.positions", &t.positions)?,
                    kv_indptr: binder.read("cache.kv_indptr", &t.kv_indptr)?,
                    kv_indices: binder.read("cache.kv_indices", &t.kv_indices)?,
                }),
            };
            let (k, v, store) = match &mut c.data {
                CacheData::Elem { k, v } => (
                    binder.write("cache.k", k)?,
                    binder.write("cache.v", v)?,
                    CacheStore::Elem,
                ),
                CacheData::Nvfp4 {
                    k,
                    v,
                    scale_strides,
                } => (
                    binder.write("cache.k", &mut k.codes)?,
                    binder.write("cache.v", &mut v.codes)?,
                    CacheStore::Nvfp4(CacheNvfp4 {
                        scale_strides: *scale_strides,
                        k_block_scales: binder
                            .write("cache.k_block_scales", &mut k.block_scales)?,
                        v_block_scales: binder
                            .write("cache.v_block_scales", &mut v.block_scales)?,
                        k: bind_scale(binder, "cache.k_scale", &k.scale)?,
                        v: bind_scale(binder, "cache.v_scale", &v.scale)?,
                    }),
                ),
                CacheData::Fp8 {
                    k,
                    v,
                    k_scale,
                    v_scale,
                    format,
                } => (
                    binder.write("cache.k", k)?,
                    binder.write("cache.v", v)?,
                    CacheStore::Fp8(CacheFp8 {
                        format: *format,
                        k: bind_scale(binder, "cache.k_scale", k_scale)?,
                        v: bind_scale(binder, "cache.v_scale", v_scale)?,
                    }),
                ),
            };
            if let Some(p) = &c.non_rotary {
                nope.cached = Some(CachedNope {
                    input: (binder.read(CACHE_NOPE_NAME, &p.input.data)?, p.input.layout),
                    into: p.into,
                });
            }
            Some(RawCache {
                address,
                layout: c.layout,
                k,
                v,
                store,
            })
        }
        None => None,
    };
    Ok(FusedRequest {
        rope: crate::plan::Request {
            config: op.rope.config,
            dtype: T::DTYPE,
            q,
            k: Some(k),
            packed,
            positions: op.rope.positions.bind(binder)?,
            sincos: op.rope.sincos.bind(binder)?,
        },
        q_fp8,
        k_fp8,
        k_written,
        v,
        norm,
        cache,
        nope,
    })
}

/// Binds a read input and a written output (of the input's type, or FP8 bits), named
/// `names` in errors.
fn bind_out_of_place<'s, T, O>(
    binder: &mut Binder<'s>,
    (x_name, out_name): (&'static str, &'static str),
    input: &'s Tensor<'_, T>,
    output: &'s mut TensorMut<'_, O>,
) -> Result<TensorReq> {
    Ok(TensorReq {
        x: binder.read(x_name, &input.data)?,
        x_layout: input.layout,
        out: Some((binder.write(out_name, &mut output.data)?, output.layout)),
    })
}

/// Binds an FP8 output (q's or k's): its input, its output of FP8 bytes, its scale and its
/// non-rotary part (if any: input read, FP8 output written), named `names` in errors.
fn bind_fp8<'s, T>(
    binder: &mut Binder<'s>,
    (x_name, out_name, scale_name, nope_names): (
        &'static str,
        &'static str,
        &'static str,
        (&'static str, &'static str),
    ),
    (input, output, non_rotary): (
        &'s Tensor<'_, T>,
        &'s mut TensorMut<'_, u8>,
        Option<&'s mut NonRotary<'_, T>>,
    ),
    scale: &'s Fp8Scale<'_>,
    format: Fp8Format,
) -> Result<(TensorReq, RawFp8, Option<NopePart>)> {
    let tensor = bind_out_of_place(binder, (x_name, out_name), input, output)?;
    let scale = bind_scale(binder, scale_name, scale)?;
    let part = match non_rotary {
        Some(p) => Some(NopePart {
            input: (binder.read(nope_names.0, &p.input.data)?, p.input.layout),
            output: (
                binder.write(nope_names.1, &mut p.output.data)?,
                p.output.layout,
            ),
        }),
        None => None,
    };
    Ok((tensor, RawFp8 { format, scale }, part))
}

/// Binds an FP8 scale for reading.
fn bind_scale<'s>(
    binder: &mut Binder<'s>,
    arg: &'static str,
    scale: &'s Fp8Scale<'_>,
) -> Result<RawScale> {
    let raw = match scale {
        Fp8Scale::PerTensor(s) => RawFp8Scale::PerTensor(binder.read(arg, s)?),
        Fp8Scale::PerHead(s) => RawFp8Scale::PerHead(binder.read(arg, s)?),
        Fp8Scale::Multiplier(m) => RawFp8Scale::Multiplier(*m),
    };
    Ok(raw.raw(arg))
}
