//! The fused serving epilogue on candle tensors: per-head RMS normalisation of q and k, their
//! rotation, and the write of k and v into a paged KV cache, in one launch of
//! `Rope::run_fused_raw` on candle's stream and buffers.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};
use candle_core::{Layout, Storage, Tensor};
use rope_host::cudarc::driver::{CudaStream, DevicePtr, SyncOnDrop};
use rope_host::{
    CacheLayout, DType, Fp8Format, IntType, NormWeight, RawBuf, RawCacheAddress, RawCacheData,
    RawFp8Scale, RawFusedIo, RawFusedOp, RawInts, RawIo, RawKOut, RawKvCache, RawOp, RawPositions,
    RawQOut, RawQkNorm, RawSinCos, RawTensor, RopeConfig, RopeStyle, TableShape,
};

use crate::error::{Error, invalid};
use crate::layout::{Axes, to_rope};
use crate::op::{ids_shape, multi_axis_shape};
use crate::rich::{Positions, SinCos};

/// Per-head RMS normalisation of q and k before the rotation:
/// `x_e / sqrt(mean_e(x_e^2) + eps) * w_e` ([`NormWeight::Plain`]) or `* (1 + w_e)`
/// ([`NormWeight::OnePlus`]), the mean over each head's `head_dim` features.
#[derive(Clone, Debug)]
pub struct QkNorm {
    /// q's weights, `[head_dim]` of q's dtype.
    pub q_weight: Tensor,
    /// k's weights, `[head_dim]` of q's dtype.
    pub k_weight: Tensor,
    /// Added to the mean square; finite and not negative.
    pub eps: f32,
    /// How the weights multiply.
    pub weight: NormWeight,
}

/// A fused launch: pairing, layout of q, k and v, sin/cos and the optional normalisation. The
/// whole head rotates, forward.
#[derive(Clone, Debug)]
pub struct FusedSpec {
    /// Pairing: rotate-half (NeoX, Llama) or interleaved (GPT-J).
    pub style: RopeStyle,
    /// Which axes of q, k and v are batch, seq, heads and head features.
    pub axes: Axes,
    /// Where sin/cos come from: [`SinCos::Computed`], [`SinCos::Frequencies`], or
    /// [`SinCos::Tables`] `[rows, head_dim / 2]` (q's dtype or f32) whose row `p` holds
    /// position `p`'s cosines and sines.
    pub sincos: SinCos,
    /// Per-head RMS normalisation before the rotation, or none.
    pub norm: Option<QkNorm>,
}

/// How a paged cache holds its values.
#[derive(Clone, Debug)]
pub enum CacheValues {
    /// Elements of q's dtype.
    Elem,
    /// FP8 E4M3 bytes (tensors of dtype `U8` or `F8E4M3`), `e4m3(value / scale)`: each scale
    /// an f32 tensor of `[1]` (per tensor) or `[kv_heads]` (per head), read on the device.
    Fp8 {
        /// k's scales.
        k_scale: Tensor,
        /// v's scales.
        v_scale: Tensor,
    },
}

/// The paged KV cache a fused launch writes k and v into: token `t` (batch row `b`, position
/// `s`, `t = b * seq + s`) goes to slot `slot_mapping[t]`, row `slot % block_size` of block
/// `slot / block_size`; a negative slot (padding) writes nothing, and so does a slot past the
/// cache.
#[derive(Clone, Copy, Debug)]
pub struct PagedKvCache<'a> {
    /// k's cache, `[num_blocks, block_size, kv_heads, head_dim]` (vLLM's layout, FlashInfer's
    /// NHD), any strides with the head features contiguous.
    pub k_cache: &'a Tensor,
    /// v's cache, with k's cache's dims and strides.
    pub v_cache: &'a Tensor,
    /// `[batch * seq]` slots, i32 or i64, contiguous.
    pub slot_mapping: &'a Tensor,
    /// The caches' values.
    pub values: &'a CacheValues,
}

/// q and k normalised (with `spec.norm`) and rotated in place by `spec` at `positions`, and,
/// with `cache`, k and v written into it; one launch on candle's stream. q, k and v are 4-D
/// (`spec.axes`) of one dtype (f32, f16 or bf16) with the same batch, seq and head size, any
/// strides with the head features contiguous: views of a fused QKV tensor are fine. v is
/// required with a cache and only read. Like candle's in-place ops it records no gradient.
/// CUDA only.
///
/// # Errors
/// A wrapped [`crate::Error`] naming the argument (`q`, `k`, `v`, `cache.k_cache`,
/// `cache.slot_mapping`, `norm.q_weight`, `sincos`, `positions`, ...) when a tensor is not on
/// q's CUDA device or the description is invalid; nothing is launched then and nothing is
/// written.
pub fn fused_inplace(
    q: &Tensor,
    k: &Tensor,
    v: Option<&Tensor>,
    spec: &FusedSpec,
    positions: Positions<'_>,
    cache: Option<PagedKvCache<'_>>,
) -> candle_core::Result<()> {
    Ok(launch(q, k, v, spec, positions, cache)?)
}

/// A tensor's storage guard and layout, named for errors.
pub(crate) struct Held<'t> {
    arg: &'static str,
    storage: candle_core::StorageRef<'t>,
    layout: &'t Layout,
}

impl<'t> Held<'t> {
    /// `tensor`'s storage, which must be on `device` (q's CUDA device).
    pub(crate) fn new(
        arg: &'static str,
        tensor: &'t Tensor,
        device: &candle_core::Device,
    ) -> Result<Self, Error> {
        if !tensor.device().same_device(device) {
            return Err(invalid(arg, "must be on q's CUDA device"));
        }
        let (storage, layout) = tensor.storage_and_layout();
        Ok(Self {
            arg,
            storage,
            layout,
        })
    }

    fn cuda(&self) -> Result<&CudaStorage, Error> {
        match &*self.storage {
            Storage::Cuda(s) => Ok(s),
            _ => Err(invalid(self.arg, "must be on a CUDA device")),
        }
    }
}

/// The storage guards of one launch, held until it is queued.
pub(crate) struct Guards<'a> {
    pub(crate) stream: &'a Arc<CudaStream>,
    pub(crate) held: Vec<SyncOnDrop<'a>>,
}

impl<'a> Guards<'a> {
    /// The whole allocation behind `h` (its layout's start offset counts from it) and its
    /// element type.
    fn slice(&mut self, h: &'a Held<'_>) -> Result<(RawBuf, Elem), Error> {
        macro_rules! bind {
            ($s:expr, $elem:expr) => {{
                let (ptr, guard) = $s.device_ptr(self.stream);
                self.held.push(guard);
                Ok((RawBuf { ptr, len: $s.len() }, $elem))
            }};
        }
        let storage = h.cuda()?;
        match &storage.slice {
            CudaStorageSlice::F32(s) => bind!(s, Elem::Float(DType::F32)),
            CudaStorageSlice::F16(s) => bind!(s, Elem::Float(DType::F16)),
            CudaStorageSlice::BF16(s) => bind!(s, Elem::Float(DType::BF16)),
            CudaStorageSlice::U8(s) => bind!(s, Elem::Byte),
            CudaStorageSlice::F8E4M3(s) => bind!(s, Elem::Byte),
            CudaStorageSlice::I32(s) => bind!(s, Elem::Int(IntType::I32)),
            CudaStorageSlice::I64(s) => bind!(s, Elem::Int(IntType::I64)),
            _ => Err(invalid(
                h.arg,
                format!("dtype {:?} is not supported here", storage.dtype()),
            )),
        }
    }

    /// A contiguous tensor's elements from its start offset.
    fn contiguous(&mut self, h: &'a Held<'_>) -> Result<(RawBuf, Elem), Error> {
        let (start, end) = h
            .layout
            .contiguous_offsets()
            .ok_or_else(|| invalid(h.arg, "must be contiguous"))?;
        let (buf, elem) = self.slice(h)?;
        let buf = RawBuf {
            ptr: buf.ptr + (start * elem.size()) as u64,
            len: end - start,
        };
        Ok((buf, elem))
    }
}

/// The element types a fused launch binds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Elem {
    Float(DType),
    Byte,
    Int(IntType),
}

impl Elem {
    fn size(self) -> usize {
        match self {
            Elem::Float(d) => d.size(),
            Elem::Byte => 1,
            Elem::Int(IntType::I32) => 4,
            Elem::Int(IntType::I64) => 8,
        }
    }
}

/// A float tensor of `dtype` (its whole allocation; the layout addresses it), as rope-host's
/// view with `axes`.
pub(crate) fn float_tensor<'a>(
    g: &mut Guards<'a>,
    h: &'a Held<'_>,
    dtype: DType,
    axes: Axes,
) -> Result<RawTensor, Error> {
    match g.slice(h)? {
        (buf, Elem::Float(d)) if d == dtype => Ok(RawTensor {
            buf,
            layout: to_rope(h.arg, h.layout, axes)?,
        }),
        _ => Err(invalid(h.arg, format!("must have q's dtype {dtype:?}"))),
    }
}

/// q, k and v as rope-host's launch takes them: views of one allocation (q, k and v narrowed
/// out of one QKV tensor) as the packed form, whose checks allow the views to interleave as
/// long as no element is shared; tensors of their own as the separate form.
fn tensors_io(q: RawTensor, k: RawTensor, v: Option<RawTensor>) -> Result<RawFusedIo, Error> {
    if q.buf != k.buf {
        return Ok(RawFusedIo::Separate {
            q: RawQOut::Elem(RawIo::InPlace(q)),
            k: RawKOut::Elem(RawIo::InPlace(k)),
            v,
        });
    }
    let v = match v {
        Some(v) if v.buf != q.buf => {
            return Err(invalid(
                "v",
                "must be a view of q and k's allocation when they share one",
            ));
        }
        v => v.map(|v| v.layout),
    };
    Ok(RawFusedIo::Packed {
        buf: q.buf,
        q: q.layout,
        k: k.layout,
        v,
    })
}

fn launch(
    q: &Tensor,
    k: &Tensor,
    v: Option<&Tensor>,
    spec: &FusedSpec,
    positions: Positions<'_>,
    cache: Option<PagedKvCache<'_>>,
) -> Result<(), Error> {
    let device = q.device();
    let candle_core::Device::Cuda(cuda) = device else {
        return Err(invalid(
            "q",
            "rope_candle::fused_inplace runs on CUDA tensors only",
        ));
    };
    // Every tensor's storage is held (read) until the launch is queued. candle runs a device's
    // work on its one stream, so the stream orders this launch after earlier writes of these
    // buffers and before later uses; the writes go through addresses, as candle's own kernels
    // write theirs.
    let q_h = Held::new("q", q, device)?;
    let k_h = Held::new("k", k, device)?;
    let v_h = v.map(|v| Held::new("v", v, device)).transpose()?;
    let norm_h = match &spec.norm {
        Some(n) => Some((
            Held::new("norm.q_weight", &n.q_weight, device)?,
            Held::new("norm.k_weight", &n.k_weight, device)?,
        )),
        None => None,
    };
    let tables_h = match &spec.sincos {
        SinCos::Tables { cos, sin } => Some((
            Held::new("cos", cos, device)?,
            Held::new("sin", sin, device)?,
        )),
        _ => None,
    };
    let ids_h = held_positions(positions, device)?;
    let cache_h = match cache {
        Some(c) => {
            let scales = match c.values {
                CacheValues::Elem => None,
                CacheValues::Fp8 { k_scale, v_scale } => Some((
                    Held::new("cache.k_scale", k_scale, device)?,
                    Held::new("cache.v_scale", v_scale, device)?,
                )),
            };
            Some((
                Held::new("cache.k_cache", c.k_cache, device)?,
                Held::new("cache.v_cache", c.v_cache, device)?,
                Held::new("cache.slot_mapping", c.slot_mapping, device)?,
                scales,
            ))
        }
        None => None,
    };

    let stream = cuda.cuda_stream();
    let rope = rope_host::shared::on_stream(&stream)?;
    let mut g = Guards {
        stream: &stream,
        held: Vec::new(),
    };
    let dtype = match q_h.cuda()?.dtype() {
        candle_core::DType::F32 => DType::F32,
        candle_core::DType::F16 => DType::F16,
        candle_core::DType::BF16 => DType::BF16,
        d => return Err(invalid("q", format!("dtype {d:?}: only f32, f16 and bf16"))),
    };
    let q_t = float_tensor(&mut g, &q_h, dtype, spec.axes)?;
    let k_t = float_tensor(&mut g, &k_h, dtype, spec.axes)?;
    let v_t = v_h
        .as_ref()
        .map(|h| float_tensor(&mut g, h, dtype, spec.axes))
        .transpose()?;
    let [batch, seq, _, head_dim] = spec.axes.bshd("q", q_h.layout.dims())?;
    let head_dim_u32 = u32::try_from(head_dim)
        .map_err(|_| invalid("q", format!("head_dim {head_dim} exceeds u32")))?;
    let config = RopeConfig::builder(head_dim_u32, spec.style).build()?;

    let norm = match (&spec.norm, &norm_h) {
        (Some(n), Some((qw, kw))) => Some(RawQkNorm {
            q_weight: weight_buf(&mut g, qw, dtype)?,
            k_weight: weight_buf(&mut g, kw, dtype)?,
            eps: n.eps,
            weight: n.weight,
            scope: rope_host::NormScope::PerHead,
        }),
        _ => None,
    };
    let sincos = raw_sincos(
        &mut g,
        &rope,
        (&spec.sincos, tables_h.as_ref()),
        dtype,
        head_dim,
    )?;
    let positions = raw_positions(&mut g, positions, ids_h.as_ref(), (batch, seq))?;
    let cache = match &cache_h {
        Some((kc, vc, slots, scales)) => Some(RawKvCache {
            non_rotary: None,
            address: RawCacheAddress::Slots(ints_buf(&mut g, slots)?),
            layout: cache_layout(kc, vc)?,
            data: cache_data(&mut g, kc, vc, scales.as_ref(), dtype)?,
        }),
        None => None,
    };
    let op = RawFusedOp {
        rope: RawOp {
            config,
            dtype,
            positions,
            sincos,
        },
        norm,
    };
    let io = tensors_io(q_t, k_t, v_t)?;
    // SAFETY: `stream` is candle's stream of q's device and `rope` was made on it, so the
    // context matches; every address comes from a `CudaSlice` of that device (each tensor was
    // checked to be on it) with its length in elements of the type rope-host is told (start
    // offsets added only within the slice, by `Guards::contiguous`); the storage guards and
    // the slices' guards live until the launch is queued, and candle's one stream orders every
    // other use of these buffers before or after it; frequencies and computed sin/cos were
    // prepared on this stream. rope-host validates that what the launch writes (q, k, the
    // caches' slots) overlaps nothing it reads or writes elsewhere.
    unsafe { rope.run_fused_raw(&op, io, cache, stream.cu_stream()) }?;
    drop(g);
    Ok(())
}

/// The launch's sin/cos as rope-host takes them: computed (its frequencies prepared on `rope`'s
/// stream), frequencies, or tables `[rows, head_dim / 2]` (held in `tables`) of `dtype` or f32.
pub(crate) fn raw_sincos<'a>(
    g: &mut Guards<'a>,
    rope: &rope_host::Rope,
    (sincos, tables): (&SinCos, Option<&'a (Held<'_>, Held<'_>)>),
    dtype: DType,
    head_dim: usize,
) -> Result<RawSinCos, Error> {
    let head_dim_u32 = u32::try_from(head_dim)
        .map_err(|_| invalid("q", format!("head_dim {head_dim} exceeds u32")))?;
    Ok(match (sincos, tables) {
        (SinCos::Computed { theta }, _) => {
            rope.prepare(*theta, head_dim_u32)?;
            RawSinCos::Computed { theta: *theta }
        }
        (SinCos::Frequencies(f), _) => f.raw(),
        (SinCos::Tables { .. }, None) => return Err(invalid("sincos", "tables not held")),
        (SinCos::Tables { .. }, Some((cos, sin))) => {
            let (cos_buf, cos_elem) = g.contiguous(cos)?;
            let (sin_buf, sin_elem) = g.contiguous(sin)?;
            let half = head_dim / 2;
            let rows = match cos.layout.dims() {
                [rows, h] if *h == half => *rows,
                d => {
                    return Err(invalid(
                        "cos",
                        format!("expected [rows, {half}], got {d:?}"),
                    ));
                }
            };
            if sin.layout.dims() != cos.layout.dims() || sin_elem != cos_elem {
                return Err(invalid("sin", "must have cos's shape and dtype"));
            }
            let table_dtype = match cos_elem {
                Elem::Float(d) if d == dtype || d == DType::F32 => d,
                _ => return Err(invalid("cos", "tables are q's dtype or f32")),
            };
            RawSinCos::Table {
                cos: cos_buf,
                sin: sin_buf,
                dtype: table_dtype,
                shape: TableShape {
                    max_position: rows,
                    rotary_dim: head_dim_u32,
                },
            }
        }
    })
}

/// The tensor `positions` reads (ids, named `ids` in errors, or multi-axis positions), held.
pub(crate) fn held_positions<'t>(
    positions: Positions<'t>,
    device: &candle_core::Device,
) -> Result<Option<Held<'t>>, Error> {
    let arg = match positions {
        Positions::Ids(_) => "ids",
        _ => "positions",
    };
    positions
        .tensor()
        .map(|t| Held::new(arg, t, device))
        .transpose()
}

/// The launch's positions as rope-host takes them: an offset, ids of `[seq]` or
/// `[batch, seq]`, or multi-axis positions of `[n_axes, batch, seq]` or `[n_axes, batch *
/// seq]`, the tensor held in `held`.
pub(crate) fn raw_positions<'a>(
    g: &mut Guards<'a>,
    positions: Positions<'_>,
    held: Option<&'a Held<'_>>,
    (batch, seq): (usize, usize),
) -> Result<RawPositions, Error> {
    Ok(match (positions, held) {
        (Positions::Offset(o), _) => RawPositions::Offset(o),
        (Positions::Ids(_), Some(ids)) => RawPositions::Ids {
            ids: ints_buf(g, ids)?,
            shape: ids_shape(ids.layout.dims(), batch, seq)?,
        },
        (Positions::MultiAxis { axes, .. }, Some(p)) => {
            multi_axis_shape(p.layout.dims(), axes.n_axes(), batch, seq)?;
            RawPositions::MultiAxis {
                positions: ints_buf(g, p)?,
                axes: axes.raw(),
            }
        }
        (_, None) => return Err(invalid("positions", "positions not held")),
    })
}

/// Normalisation weights: `[head_dim]` of q's dtype, contiguous.
pub(crate) fn weight_buf<'a>(
    g: &mut Guards<'a>,
    h: &'a Held<'_>,
    dtype: DType,
) -> Result<RawBuf, Error> {
    match g.contiguous(h)? {
        (buf, Elem::Float(d)) if d == dtype => Ok(buf),
        _ => Err(invalid(h.arg, format!("must have q's dtype {dtype:?}"))),
    }
}

/// Position ids or slots: i32 or i64, contiguous.
pub(crate) fn ints_buf<'a>(g: &mut Guards<'a>, h: &'a Held<'_>) -> Result<RawInts, Error> {
    match g.contiguous(h)? {
        (buf, Elem::Int(ty)) => Ok(RawInts { buf, ty }),
        _ => Err(invalid(h.arg, "must be i32 or i64")),
    }
}

/// The caches' layout: `[num_blocks, block_size, kv_heads, head_dim]`, the same dims and
/// strides for both, head features contiguous.
fn cache_layout(k: &Held<'_>, v: &Held<'_>) -> Result<CacheLayout, Error> {
    let dims: [usize; 4] = k.layout.dims().try_into().map_err(|_| {
        invalid(
            k.arg,
            format!(
                "expected [num_blocks, block_size, kv_heads, head_dim], got {:?}",
                k.layout.dims()
            ),
        )
    })?;
    let stride = k.layout.stride();
    if dims[3] > 1 && stride[3] != 1 {
        return Err(invalid(
            k.arg,
            format!("the last dimension must be contiguous (stride 1), got strides {stride:?}"),
        ));
    }
    if v.layout.dims() != k.layout.dims() || v.layout.stride() != stride {
        return Err(invalid(v.arg, "must have k_cache's dims and strides"));
    }
    Ok(CacheLayout {
        num_blocks: dims[0],
        block_size: dims[1],
        kv_heads: dims[2],
        head_dim: dims[3],
        strides: [stride[0], stride[1], stride[2]],
    })
}

/// A cache's elements from its layout's start offset.
fn cache_buf<'a>(g: &mut Guards<'a>, h: &'a Held<'_>) -> Result<(RawBuf, Elem), Error> {
    let (buf, elem) = g.slice(h)?;
    let start = h.layout.start_offset();
    Ok((
        RawBuf {
            ptr: buf.ptr + (start * elem.size()) as u64,
            len: buf.len.saturating_sub(start),
        },
        elem,
    ))
}

/// The caches' data: elements of q's dtype, or FP8 bytes with their scales.
fn cache_data<'a>(
    g: &mut Guards<'a>,
    k: &'a Held<'_>,
    v: &'a Held<'_>,
    scales: Option<&'a (Held<'_>, Held<'_>)>,
    dtype: DType,
) -> Result<RawCacheData, Error> {
    let (k_buf, k_elem) = cache_buf(g, k)?;
    let (v_buf, v_elem) = cache_buf(g, v)?;
    match scales {
        None => {
            for (h, elem) in [(k, k_elem), (v, v_elem)] {
                if elem != Elem::Float(dtype) {
                    return Err(invalid(
                        h.arg,
                        format!("must have q's dtype {dtype:?} (or be FP8 with CacheValues::Fp8)"),
                    ));
                }
            }
            Ok(RawCacheData::Elem { k: k_buf, v: v_buf })
        }
        Some((ks, vs)) => {
            for (h, elem) in [(k, k_elem), (v, v_elem)] {
                if elem != Elem::Byte {
                    return Err(invalid(h.arg, "an FP8 cache is U8 or F8E4M3"));
                }
            }
            let kv_heads = k.layout.dims()[2];
            Ok(RawCacheData::Fp8 {
                k: k_buf,
                v: v_buf,
                k_scale: fp8_scale(g, ks, kv_heads)?,
                v_scale: fp8_scale(g, vs, kv_heads)?,
                format: Fp8Format::E4m3,
            })
        }
    }
}

/// An FP8 scale: f32 `[1]` per tensor or `[kv_heads]` per head, contiguous.
fn fp8_scale<'a>(
    g: &mut Guards<'a>,
    h: &'a Held<'_>,
    kv_heads: usize,
) -> Result<RawFp8Scale, Error> {
    let (buf, elem) = g.contiguous(h)?;
    if elem != Elem::Float(DType::F32) {
        return Err(invalid(h.arg, "scales are f32"));
    }
    match h.layout.dims() {
        [1] => Ok(RawFp8Scale::PerTensor(buf)),
        [n] if *n == kv_heads => Ok(RawFp8Scale::PerHead(buf)),
        d => Err(invalid(
            h.arg,
            format!("expected [1] or [kv_heads] = [{kv_heads}], got {d:?}"),
        )),
    }
}
