//! The fused serving epilogue from Python objects: q/k RMS normalisation (optional), the
//! rotation, and k and v written into a KV cache (optional; in the tensors' type or FP8 E4M3),
//! one launch of [`Rope::run_fused_raw`] on the caller's stream. The tensors come as vLLM's
//! packed QKV (`fused_qk_norm_rope`) or as separate query, key and value (vLLM's and SGLang's
//! rotations with a cache write); `native.rs` reads the Python arguments into a
//! [`FusedLaunch`].

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use rope_host::cudarc::driver::sys::CUstream;
use rope_host::{
    CacheLayout, DType, Layout, NormWeight, RawBuf, RawCacheData, RawFusedIo, RawFusedOp, RawIo,
    RawKOut, RawKvCache, RawOp, RawQOut, RawQkNorm, RawTensor, RopeConfig, RopeStyle,
    StreamOverlap,
};

use crate::dlpack::{self, Elem};
use crate::launch::{
    Held, Names, PositionsArg, SinCosArg, View, arg_error, dlpack_stream, one_buffer,
    raw_positions, raw_sincos, rope_for,
};

/// The element type of a KV cache (vLLM's `kv_cache_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CacheType {
    /// The tensors' own type (`"auto"`).
    Auto,
    /// FP8 E4M3 bytes, `e4m3(x / scale)` (`"fp8"`, `"fp8_e4m3"`).
    Fp8E4m3,
}

impl CacheType {
    /// Parses `kv_cache_dtype=`.
    pub(crate) fn parse(name: &str) -> PyResult<Self> {
        match name {
            "auto" => Ok(Self::Auto),
            "fp8" | "fp8_e4m3" => Ok(Self::Fp8E4m3),
            other => Err(PyValueError::new_err(format!(
                "kv_cache_dtype must be \"auto\", \"fp8\" or \"fp8_e4m3\", got {other:?}"
            ))),
        }
    }
}

/// The tensors of a fused launch, still to borrow.
pub(crate) enum FusedTensors<'a, 'py> {
    /// vLLM's packed `[num_tokens, (hq + hk + hv) * head_dim]`: q and k rotated in place, v
    /// (the last `hv` heads) only read.
    Packed {
        /// The buffer.
        qkv: &'a Bound<'py, PyAny>,
        /// q's, k's and v's heads.
        heads: [usize; 3],
    },
    /// query and key rotated in place, value only read (`[num_tokens, heads * head_size]` or
    /// `[num_tokens, heads, head_size]` each; views of one buffer are fine).
    Separate {
        /// Rotated in place.
        query: &'a Bound<'py, PyAny>,
        /// Rotated in place.
        key: &'a Bound<'py, PyAny>,
        /// Copied into the cache.
        value: Option<&'a Bound<'py, PyAny>>,
    },
}

/// The KV-cache write of a fused launch, still to borrow.
pub(crate) struct CacheArg<'a, 'py> {
    /// k's cache: paged `[num_blocks, block_size, kv_heads, head_size]` or a token pool
    /// `[slots, kv_heads * head_size]` ([`dlpack::cache`]).
    pub key_cache: &'a Bound<'py, PyAny>,
    /// v's cache, of key_cache's shape and strides.
    pub value_cache: &'a Bound<'py, PyAny>,
    /// One slot per token, int32 or int64; negative: nothing written.
    pub slot_mapping: &'a Bound<'py, PyAny>,
    /// The caches' element type.
    pub dtype: CacheType,
    /// FP8 scales (float32, one or one per kv head), required with FP8.
    pub scales: Option<(&'a Bound<'py, PyAny>, &'a Bound<'py, PyAny>)>,
}

/// One fused launch as the Python functions describe it.
pub(crate) struct FusedLaunch<'a, 'py> {
    /// The tensors.
    pub tensors: FusedTensors<'a, 'py>,
    /// Elements per head.
    pub head_size: usize,
    /// `(q_weight, k_weight, eps)` of the RMS normalisation before the rotation.
    pub norm: Option<(&'a Bound<'py, PyAny>, &'a Bound<'py, PyAny>, f64)>,
    /// One position per token, int32 or int64.
    pub positions: &'a Bound<'py, PyAny>,
    /// `[max_position, head_size]`, cos half then sin half.
    pub cos_sin_cache: &'a Bound<'py, PyAny>,
    /// The pairing.
    pub style: RopeStyle,
    /// The cache write, if any.
    pub cache: Option<CacheArg<'a, 'py>>,
    /// The arguments' Python names.
    pub names: Names,
    /// The `CUstream` to launch on.
    pub stream: u64,
    /// Whether the producers must order their writes before `stream`.
    pub producer_sync: bool,
    /// How the launch may overlap the kernel before it (`pdl=`).
    pub overlap: StreamOverlap,
}

/// The packed QKV's q, k and v as layouts of one buffer: `[1, tokens, heads, head_dim]` views
/// at head offsets 0, `hq` and `hq + hk`.
fn packed_layouts(
    t: &RawTensor,
    [hq, hk, hv]: [usize; 3],
    arg: &str,
) -> PyResult<(Layout, Layout, Layout)> {
    let l = t.layout;
    if hq + hk + hv != l.heads() {
        return Err(PyValueError::new_err(format!(
            "{arg} holds {} heads of {} elements per token, num_heads_q + num_heads_k + \
             num_heads_v is {}",
            l.heads(),
            l.head_dim(),
            hq + hk + hv
        )));
    }
    let [sb, ss, sh] = l.strides();
    let part = |heads: usize, first: usize| {
        Layout::strided(
            [l.batch(), l.seq(), heads, l.head_dim()],
            [sb, ss, sh, 1],
            l.offset() + first * sh,
        )
        .map_err(|e| PyValueError::new_err(format!("{arg}: {e}")))
    };
    Ok((part(hq, 0)?, part(hk, hq)?, part(hv, hq + hk)?))
}

/// Borrows and checks the cache write: both caches of one layout and of the type
/// `kv_cache_dtype` names, the slots and the scales.
fn raw_cache<'py>(
    c: &CacheArg<'_, 'py>,
    held: &mut Held<'py>,
    (elem, head_size): (Elem, usize),
    names: &Names,
) -> PyResult<RawKvCache> {
    let name = |arg| names.python_name(arg);
    let cache = |held: &mut Held<'py>, obj, arg| -> PyResult<(RawBuf, CacheLayout)> {
        let d = held.borrow(obj, name(arg))?;
        let want_ok = match c.dtype {
            CacheType::Auto => d.elem == elem,
            CacheType::Fp8E4m3 => d.elem.fp8_bytes(),
        };
        if !want_ok {
            let want = match c.dtype {
                CacheType::Auto => format!("{} (kv_cache_dtype=\"auto\")", elem.name()),
                CacheType::Fp8E4m3 => "uint8 or float8_e4m3fn (an FP8 kv_cache_dtype)".into(),
            };
            return Err(PyValueError::new_err(format!(
                "{} must be {want}, got {}",
                name(arg),
                d.elem.name()
            )));
        }
        dlpack::cache(d, head_size, name(arg)).map_err(arg_error)
    };
    let (k, layout) = cache(held, c.key_cache, "cache.k")?;
    let (v, v_layout) = cache(held, c.value_cache, "cache.v")?;
    if v_layout != layout {
        return Err(PyValueError::new_err(format!(
            "{} must have {}'s shape and strides: {v_layout:?} against {layout:?}",
            name("cache.v"),
            name("cache.k")
        )));
    }
    let slots = held.borrow(c.slot_mapping, name("cache.slot_mapping"))?;
    let slot_mapping =
        dlpack::ints_1d(slots, name("cache.slot_mapping"), "num_tokens").map_err(arg_error)?;
    let data = match (c.dtype, c.scales) {
        (CacheType::Auto, None) => RawCacheData::Elem { k, v },
        (CacheType::Auto, Some(_)) => {
            return Err(PyValueError::new_err(format!(
                "{}: scales apply to FP8 caches only (kv_cache_dtype=\"fp8\")",
                name("cache.k_scale")
            )));
        }
        (CacheType::Fp8E4m3, None) => {
            return Err(PyValueError::new_err(format!(
                "{}: an FP8 cache needs k_scale and v_scale (float32 tensors)",
                name("cache.k_scale")
            )));
        }
        (CacheType::Fp8E4m3, Some((ks, vs))) => {
            let scale = |held: &mut Held<'py>, obj, arg| {
                let d = held.borrow(obj, name(arg))?;
                dlpack::fp8_scale(d, name(arg)).map_err(arg_error)
            };
            RawCacheData::Fp8 {
                k,
                v,
                k_scale: scale(held, ks, "cache.k_scale")?,
                v_scale: scale(held, vs, "cache.v_scale")?,
            }
        }
    };
    Ok(RawKvCache {
        slot_mapping,
        layout,
        data,
    })
}

/// The launch's tensors as rope-host's fused forms, with the buffers' element type; the first
/// (`qkv` or `query`) is `held`'s first borrow.
fn raw_io<'py>(
    tensors: &FusedTensors<'_, 'py>,
    held: &mut Held<'py>,
    (head_size, names): (usize, &Names),
    cached: bool,
) -> PyResult<(RawFusedIo, Elem, DType)> {
    let view = View::Heads(head_size);
    let arg = names.python_name("q");
    let d = held.first_dense();
    let (elem, dtype) = (d.elem, dlpack::float_type(d, arg).map_err(arg_error)?);
    let first = dlpack::heads_tensor(d, head_size, arg).map_err(arg_error)?;
    match *tensors {
        FusedTensors::Packed { heads, .. } => {
            let t = first;
            let (q, k, v) = packed_layouts(&t, heads, arg)?;
            let io = RawFusedIo::Packed {
                buf: t.buf,
                q,
                k,
                v: cached.then_some(v),
            };
            Ok((io, elem, dtype))
        }
        FusedTensors::Separate { key, value, .. } => {
            let q = first;
            let spec = (elem, arg, view);
            let k = held
                .tensor(Some(key), names.python_name("k"), spec)?
                .expect("given");
            let v = held.tensor(value, names.python_name("v"), spec)?;
            let es = dtype.size() as u64;
            let mut all = vec![q, k];
            all.extend(v);
            let io = match one_buffer(&all, es) {
                Some((buf, layouts)) => RawFusedIo::Packed {
                    buf,
                    q: layouts[0],
                    k: layouts[1],
                    v: layouts.get(2).copied(),
                },
                None => RawFusedIo::Separate {
                    q: RawQOut::Elem(RawIo::InPlace(q)),
                    k: RawKOut::Elem(RawIo::InPlace(k)),
                    v,
                },
            };
            Ok((io, elem, dtype))
        }
    }
}

/// Validates `l` (here and in rope-host) and launches it on its stream.
pub(crate) fn launch(l: FusedLaunch<'_, '_>) -> PyResult<()> {
    let names = l.names;
    // The first tensor sets the device every other must be on.
    let first = match &l.tensors {
        FusedTensors::Packed { qkv, .. } => *qkv,
        FusedTensors::Separate { query, .. } => *query,
    };
    let dlpack_stream = dlpack_stream(l.stream, l.producer_sync);
    let mut held = Held::first(first, names.python_name("q"), dlpack_stream)?;
    let device = held.device;
    let (io, elem, dtype) = raw_io(
        &l.tensors,
        &mut held,
        (l.head_size, &names),
        l.cache.is_some(),
    )?;
    let head_dim = u32::try_from(l.head_size)
        .map_err(|_| PyValueError::new_err(format!("head_size {} is too large", l.head_size)))?;
    let norm = match l.norm {
        Some((qw, kw, eps)) => {
            let mut weight = |obj, arg| -> PyResult<_> {
                let name = names.python_name(arg);
                let d = held.borrow(obj, name)?;
                dlpack::vector(d, name, elem, l.head_size).map_err(arg_error)
            };
            Some(RawQkNorm {
                q_weight: weight(qw, "norm.q_weight")?,
                k_weight: weight(kw, "norm.k_weight")?,
                eps: eps as f32,
                weight: NormWeight::Plain,
            })
        }
        None => None,
    };
    let cache = match &l.cache {
        Some(c) => Some(raw_cache(c, &mut held, (elem, l.head_size), &names)?),
        None => None,
    };
    let positions = raw_positions(&PositionsArg::Ids(l.positions), &mut held, &names)?;
    let stream = l.stream as usize as CUstream;
    let (sincos, rotary_dim, _frequencies) = raw_sincos(
        SinCosArg::Cache(l.cos_sin_cache),
        &mut held,
        (dtype, elem.name(), head_dim, None),
        (&names, stream),
    )?;
    let config = RopeConfig::builder(head_dim, l.style)
        .rotary_dim(rotary_dim)
        .build()
        .map_err(|e| names.host_error(e))?;
    let rope = rope_for(device, l.overlap)?;
    let op = RawFusedOp {
        rope: RawOp {
            config,
            dtype,
            positions,
            sincos,
        },
        norm,
    };
    // SAFETY: `run_fused_raw`'s promises are `run_raw`'s, kept as in `launch::launch`:
    // - every address is memory of CUDA device `device` (DLPack said so, checked for each
    //   tensor by `Held::borrow`), `rope` runs on its primary context, and `stream` is a
    //   stream of that context (the Python caller's promise, documented with `stream=`);
    // - each buffer holds the elements given: `dlpack.rs` sized every buffer from the
    //   producer's shape and strides, ending after its last element, with the producer's
    //   element type (tensors, weights of the tensors' type, float32 scales, int slots,
    //   caches of the tensors' type or bytes for FP8);
    // - `held` keeps the producers' tensors alive until the launch is enqueued, and the
    //   caller keeps them allocated until it has run on `stream`, orders their writers before
    //   `stream` (or the producers did, `__dlpack__(stream=)`), and touches nothing the
    //   launch writes meanwhile;
    // - the cos/sin cache is the caller's tensor, ordered like the others.
    unsafe { rope.run_fused_raw(&op, io, cache, stream) }.map_err(|e| names.host_error(e))?;
    drop(held);
    Ok(())
}
