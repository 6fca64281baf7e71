//! The fused serving epilogue from Python objects: q/k RMS normalisation (optional), the
//! rotation, and k and v written into a KV cache (optional; in the tensors' type or FP8),
//! one launch of [`Rope::run_fused_raw`] on the caller's stream. The tensors come as vLLM's
//! packed QKV (`fused_qk_norm_rope`), as separate query, key and value (vLLM's and SGLang's
//! rotations with a cache write), or as FlashInfer's rotated parts with FP8 outputs
//! (`rope_quantize_fp8*`, its cache addressed by a page table); `native.rs` reads the Python
//! arguments into a [`FusedLaunch`].

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use rope_host::cudarc::driver::sys::CUstream;
use rope_host::{
    CacheLayout, DType, Fp8Format, Layout, NonRotaryCache, NormScope, NormWeight, RawBuf,
    RawCacheAddress, RawCacheData, RawCacheNonRotary, RawFp8Scale, RawFusedIo, RawFusedOp, RawIo,
    RawKOut, RawKvCache, RawNonRotary, RawNvfp4Cache, RawOp, RawPageTable, RawQOut, RawQkNorm,
    RawTensor, RopeConfig, RopeStyle, StreamOverlap,
};

use crate::dlpack::{self, Elem};
use crate::launch::{
    Held, Names, PositionsArg, SinCosArg, View, arg_error, dlpack_stream, one_buffer,
    raw_positions, raw_sincos, rope_for,
};
use crate::options::Axes;

/// The element type of a KV cache (vLLM's `kv_cache_dtype`; FlashInfer's cache tensors').
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CacheType {
    /// The tensors' own type (`"auto"`).
    Auto,
    /// FP8 bytes (`"fp8"`, `"fp8_e4m3"`: E4M3; `"fp8_e5m2"`: E5M2).
    Fp8(Fp8Format),
    /// NVFP4 (`"nvfp4"`): vLLM's packed rows in uint8, each head's `head_size / 2` bytes of
    /// E2M1 codes and then its `head_size / 16` E4M3 block scales (see [`nvfp4_cache`]).
    Nvfp4,
}

impl CacheType {
    /// Parses `kv_cache_dtype=`.
    pub(crate) fn parse(name: &str) -> PyResult<Self> {
        match name {
            "auto" => Ok(Self::Auto),
            "fp8" | "fp8_e4m3" => Ok(Self::Fp8(Fp8Format::E4m3)),
            "fp8_e5m2" => Ok(Self::Fp8(Fp8Format::E5m2)),
            "nvfp4" => Ok(Self::Nvfp4),
            other => Err(PyValueError::new_err(format!(
                "kv_cache_dtype must be \"auto\", \"fp8\", \"fp8_e4m3\", \"fp8_e5m2\" or \
                 \"nvfp4\", got {other:?}"
            ))),
        }
    }
}

/// The PyTorch type names of FP8 bytes of `format`, for messages.
fn fp8_names(format: Fp8Format) -> &'static str {
    match format {
        Fp8Format::E4m3 => "uint8 or float8_e4m3fn",
        Fp8Format::E5m2 => "uint8 or float8_e5m2",
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
    /// query and key read, normalised and rotated into outputs of their shapes (the training
    /// form's forward step); no cache.
    OutOfPlace {
        /// Read only.
        query: &'a Bound<'py, PyAny>,
        /// Read only.
        key: &'a Bound<'py, PyAny>,
        /// query's result.
        query_out: &'a Bound<'py, PyAny>,
        /// key's result.
        key_out: &'a Bound<'py, PyAny>,
    },
    /// FlashInfer's rotated parts, read only, rotated into FP8 outputs of `x * multiplier`:
    /// q to `q_out`, k to `k_out` (or only to the cache, without one).
    Quantized {
        /// q's rotated features.
        q: &'a Bound<'py, PyAny>,
        /// k's.
        k: &'a Bound<'py, PyAny>,
        /// Copied into the cache.
        value: Option<&'a Bound<'py, PyAny>>,
        /// q's FP8 output.
        q_out: &'a Bound<'py, PyAny>,
        /// k's FP8 output, when there is no cache.
        k_out: Option<&'a Bound<'py, PyAny>>,
        /// q's and k's non-rotary parts with their FP8 outputs (FlashInfer's `q_nope`,
        /// `q_nope_out`, `k_nope`, `k_nope_out`).
        nope: [Option<&'a (Bound<'py, PyAny>, Bound<'py, PyAny>)>; 2],
        /// The outputs' format.
        format: Fp8Format,
        /// q's and k's multipliers (FlashInfer's `quant_scale_q`, `quant_scale_kv`).
        multipliers: (f32, f32),
    },
}

/// Which cache slot each token writes, still to borrow.
pub(crate) enum AddressArg<'a, 'py> {
    /// vLLM's `slot_mapping` (SGLang's `cache_loc`): int32/int64, one per token.
    Slots(&'a Bound<'py, PyAny>),
    /// FlashInfer's page table, all int32: `batch_indices`, `positions` (one per token),
    /// `kv_indptr`, `kv_indices`.
    PageTable([&'a Bound<'py, PyAny>; 4]),
}

/// An FP8 cache's scales, still to borrow.
pub(crate) enum ScalesArg<'a, 'py> {
    /// float32 tensors for k and v, one element or one per kv head: `fp8(x / scale)`.
    Tensors(&'a Bound<'py, PyAny>, &'a Bound<'py, PyAny>),
    /// One multiplier for both (FlashInfer's `quant_scale_kv`): `fp8(x * multiplier)`.
    Multiplier(f32),
}

/// k's non-rotary part into the cache (FlashInfer's `k_nope` in its append form), still to
/// borrow.
pub(crate) enum CacheNopeArg<'a, 'py> {
    /// GQA/MHA: after each k cache head's rotated features; the caches' and v's heads hold
    /// `rope_dim + no_rope_dim` elements.
    AfterRotated(&'a Bound<'py, PyAny>),
    /// MLA: into `value_cache` (`ckv_cache`, `[max_pages, page_size, no_rope_dim]`), the rotated
    /// k into `key_cache` (`kpe_cache`, `[max_pages, page_size, rope_dim]`); no v.
    Latent(&'a Bound<'py, PyAny>),
    /// MLA into one cache (vLLM's `kv_cache`, `[num_blocks, block_size, kv_lora_rank +
    /// rot_dim]`, given as both `key_cache` and `value_cache`): the part into each row's first
    /// `kv_lora_rank` columns, the rotated k into the rest; no v.
    LatentColumns(&'a Bound<'py, PyAny>, usize),
}

/// The KV-cache write of a fused launch, still to borrow.
pub(crate) struct CacheArg<'a, 'py> {
    /// k's cache: paged `[num_blocks, block_size, kv_heads, head_size]` or a token pool
    /// `[slots, kv_heads * head_size]` ([`dlpack::cache`]).
    pub key_cache: &'a Bound<'py, PyAny>,
    /// v's cache, of key_cache's shape and strides.
    pub value_cache: &'a Bound<'py, PyAny>,
    /// Each token's slot; a negative slot (or padding request) writes nothing.
    pub address: AddressArg<'a, 'py>,
    /// The caches' element type.
    pub dtype: CacheType,
    /// FP8 scales, required with FP8.
    pub scales: Option<ScalesArg<'a, 'py>>,
    /// The 4-D caches are FlashInfer's HND `[pages, kv_heads, page_size, head_size]` (else
    /// `[num_blocks, block_size, kv_heads, head_size]`, vLLM's and FlashInfer's NHD).
    pub heads_first: bool,
    /// The page size the caller states (FlashInfer's `page_size=`), checked against the
    /// cache's.
    pub page_size: Option<usize>,
    /// k's non-rotary part into the cache, if any.
    pub non_rotary: Option<CacheNopeArg<'a, 'py>>,
}

/// One fused launch as the Python functions describe it.
pub(crate) struct FusedLaunch<'a, 'py> {
    /// The tensors.
    pub tensors: FusedTensors<'a, 'py>,
    /// Elements per head.
    pub head_size: usize,
    /// `(q_weight, k_weight, eps, weighting)` of the RMS normalisation before the rotation.
    pub norm: Option<(
        &'a Bound<'py, PyAny>,
        &'a Bound<'py, PyAny>,
        f64,
        NormWeight,
    )>,
    /// Which features the norm normalises together: each head (weights of `head_size`), or a
    /// token's heads of q and of k (weights of `heads * head_size`, checked by rope-host).
    pub norm_scope: NormScope,
    /// One position per token, int32 or int64 (`[tokens]`); with `axes`, a row per axis
    /// (`[n_axes, tokens]`).
    pub positions: &'a Bound<'py, PyAny>,
    /// The axes, when the positions are per axis.
    pub axes: Option<Axes>,
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
    let latent = matches!(
        c.non_rotary,
        Some(CacheNopeArg::Latent(_) | CacheNopeArg::LatentColumns(..))
    );
    let cache = |held: &mut Held<'py>, obj, arg| -> PyResult<(RawBuf, CacheLayout)> {
        let d = held.borrow(obj, name(arg))?;
        let want_ok = match c.dtype {
            CacheType::Auto => d.elem == elem,
            CacheType::Fp8(format) => d.elem.holds(format),
            CacheType::Nvfp4 => d.elem == Elem::U8,
        };
        if !want_ok {
            let want = match c.dtype {
                CacheType::Auto => format!("{} (kv_cache_dtype=\"auto\")", elem.name()),
                CacheType::Fp8(format) => format!("{} (the FP8 format asked)", fp8_names(format)),
                CacheType::Nvfp4 => "uint8 (kv_cache_dtype=\"nvfp4\")".into(),
            };
            return Err(PyValueError::new_err(format!(
                "{} must be {want}, got {}",
                name(arg),
                d.elem.name()
            )));
        }
        if let Some(CacheNopeArg::LatentColumns(_, rank)) = c.non_rotary {
            // The latent part's columns for v's cache, the rotated k's after them for k's.
            let row = d.shape.as_slice().last().copied().unwrap_or(0);
            if rank >= row {
                return Err(PyValueError::new_err(format!(
                    "{} rows hold {row} elements: no room after the {rank} latent features \
                     ({}'s) for the rotated k",
                    name(arg),
                    name("cache.non_rotary.input")
                )));
            }
            let cols = match arg {
                "cache.k" => (rank, row.saturating_sub(rank)),
                _ => (0, rank),
            };
            let part = dlpack::columns(d, cols, name(arg)).map_err(arg_error)?;
            return dlpack::latent_cache(&part, name(arg)).map_err(arg_error);
        }
        if latent {
            return dlpack::latent_cache(d, name(arg)).map_err(arg_error);
        }
        let four_d = d.shape.len() == 4;
        // NVFP4 rows: each head's codes and block scales, in bytes.
        let row = match c.dtype {
            CacheType::Nvfp4 => nvfp4_row(head_size, name(arg))?,
            _ => head_size,
        };
        let (buf, mut layout) = dlpack::cache(d, row, name(arg)).map_err(arg_error)?;
        if c.dtype == CacheType::Nvfp4 && layout.head_dim != row {
            return Err(PyValueError::new_err(format!(
                "{} holds {} bytes a head; an NVFP4 cache holds head_size // 2 + head_size // \
                 16 = {row} (vLLM's packed rows)",
                name(arg),
                layout.head_dim
            )));
        }
        if c.heads_first && four_d {
            // [pages, kv_heads, page_size, head_size]: dlpack::cache read the second and third
            // dimensions as rows and heads.
            (layout.block_size, layout.kv_heads) = (layout.kv_heads, layout.block_size);
            layout.strides.swap(1, 2);
        }
        Ok((buf, layout))
    };
    let (k, layout) = cache(held, c.key_cache, "cache.k")?;
    let (v, v_layout) = cache(held, c.value_cache, "cache.v")?;
    if !latent && v_layout != layout {
        return Err(PyValueError::new_err(format!(
            "{} must have {}'s shape and strides: {v_layout:?} against {layout:?}",
            name("cache.v"),
            name("cache.k")
        )));
    }
    if let Some(page_size) = c.page_size
        && page_size != layout.block_size
    {
        return Err(PyValueError::new_err(format!(
            "page_size: {page_size}, the caches hold pages of {}",
            layout.block_size
        )));
    }
    let address = match c.address {
        AddressArg::Slots(obj) => {
            let slots = held.borrow(obj, name("cache.slot_mapping"))?;
            RawCacheAddress::Slots(
                dlpack::ints_1d(slots, name("cache.slot_mapping"), "num_tokens")
                    .map_err(arg_error)?,
            )
        }
        AddressArg::PageTable(objs) => {
            const ARGS: [(&str, &str); 4] = [
                ("cache.batch_indices", "num_tokens"),
                ("cache.positions", "num_tokens"),
                ("cache.kv_indptr", "batch_size + 1"),
                ("cache.kv_indices", "total_pages"),
            ];
            let mut bufs = [RawBuf { ptr: 0, len: 0 }; 4];
            for ((buf, obj), (arg, what)) in bufs.iter_mut().zip(objs).zip(ARGS) {
                let d = held.borrow(obj, name(arg))?;
                *buf = dlpack::i32_1d(d, name(arg), what).map_err(arg_error)?;
            }
            let [batch_indices, positions, kv_indptr, kv_indices] = bufs;
            RawCacheAddress::PageTable(RawPageTable {
                batch_indices,
                positions,
                kv_indptr,
                kv_indices,
            })
        }
    };
    let scale = |held: &mut Held<'py>, obj, arg| {
        let d = held.borrow(obj, name(arg))?;
        dlpack::fp8_scale(d, name(arg)).map_err(arg_error)
    };
    let (layout, data) = match (c.dtype, &c.scales) {
        (CacheType::Auto, None) => (layout, RawCacheData::Elem { k, v }),
        (CacheType::Auto, Some(_)) => {
            return Err(PyValueError::new_err(format!(
                "{}: scales apply to FP8 and NVFP4 caches only (kv_cache_dtype=\"fp8\" or \
                 \"nvfp4\")",
                name("cache.k_scale")
            )));
        }
        (CacheType::Fp8(_) | CacheType::Nvfp4, None) => {
            return Err(PyValueError::new_err(format!(
                "{}: an FP8 or NVFP4 cache needs k_scale and v_scale (float32 tensors)",
                name("cache.k_scale")
            )));
        }
        (CacheType::Fp8(format), Some(ScalesArg::Tensors(ks, vs))) => (
            layout,
            RawCacheData::Fp8 {
                k,
                v,
                k_scale: scale(held, ks, "cache.k_scale")?,
                v_scale: scale(held, vs, "cache.v_scale")?,
                format,
            },
        ),
        (CacheType::Fp8(format), Some(ScalesArg::Multiplier(m))) => (
            layout,
            RawCacheData::Fp8 {
                k,
                v,
                k_scale: RawFp8Scale::Multiplier(*m),
                v_scale: RawFp8Scale::Multiplier(*m),
                format,
            },
        ),
        (CacheType::Nvfp4, Some(ScalesArg::Tensors(ks, vs))) => {
            let scales = (
                scale(held, ks, "cache.k_scale")?,
                scale(held, vs, "cache.v_scale")?,
            );
            nvfp4_cache((k, v, layout), scales, head_size)
        }
        (CacheType::Nvfp4, Some(ScalesArg::Multiplier(_))) => {
            return Err(PyValueError::new_err(format!(
                "{}: an NVFP4 cache's global scales are float32 tensors, not a multiplier",
                name("cache.k_scale")
            )));
        }
    };
    let part_name = name("cache.non_rotary.input");
    let non_rotary = match c.non_rotary {
        Some(CacheNopeArg::AfterRotated(obj)) => Some(RawCacheNonRotary {
            input: heads_arg(held, obj, part_name, (Holds::Elem(elem), None))?,
            into: NonRotaryCache::AfterRotated,
        }),
        Some(CacheNopeArg::Latent(obj) | CacheNopeArg::LatentColumns(obj, _)) => {
            Some(RawCacheNonRotary {
                input: heads_arg(held, obj, part_name, (Holds::Elem(elem), None))?,
                into: NonRotaryCache::Latent(v_layout),
            })
        }
        None => None,
    };
    Ok(RawKvCache {
        address,
        layout,
        data,
        non_rotary,
    })
}

/// Bytes of one head's row in vLLM's packed NVFP4 cache: `head_size / 2` bytes of codes, then
/// `head_size / 16` block scales; `head_size` a multiple of 16.
fn nvfp4_row(head_size: usize, arg: &str) -> PyResult<usize> {
    if head_size == 0 || !head_size.is_multiple_of(16) {
        return Err(PyValueError::new_err(format!(
            "{arg}: an NVFP4 cache holds heads of a multiple of 16 elements (a block scale's), \
             got head_size {head_size}"
        )));
    }
    Ok(head_size / 2 + head_size / 16)
}

/// The NVFP4 caches of vLLM's packed rows (`layout` their bytes, each head's row
/// [`nvfp4_row`] bytes): the codes at the head's first byte, addressed in elements (twice the
/// byte strides), and the block scales `head_size / 2` bytes into each row, at the byte strides.
fn nvfp4_cache(
    (k, v, bytes): (RawBuf, RawBuf, CacheLayout),
    (k_scale, v_scale): (RawFp8Scale, RawFp8Scale),
    head_size: usize,
) -> (CacheLayout, RawCacheData) {
    let codes = CacheLayout {
        head_dim: head_size,
        strides: bytes.strides.map(|s| 2 * s),
        ..bytes
    };
    // The scales start half a head into the row; the planner checks they fit the buffer.
    let at = head_size / 2;
    let scales = |b: RawBuf| RawBuf {
        ptr: b.ptr + at as u64,
        len: b.len.saturating_sub(at),
    };
    let cache = |codes: RawBuf, scale| RawNvfp4Cache {
        codes,
        block_scales: scales(codes),
        scale,
    };
    (
        codes,
        RawCacheData::Nvfp4 {
            k: cache(k, k_scale),
            v: cache(v, v_scale),
            scale_strides: bytes.strides,
        },
    )
}

/// What a tensor of heads must hold: elements of the tensors' type, or FP8 bytes of a format.
#[derive(Clone, Copy)]
enum Holds {
    Elem(Elem),
    Fp8(Fp8Format),
}

/// A tensor of heads (`[nnz, heads, size]`, or `[nnz, heads * size]`) holding `holds`, its
/// heads `size` elements wide, or as wide as its last dimension with `None` (a non-rotary
/// part's `[nnz, heads, no_rope_dim]`, or `[nnz, no_rope_dim]` as one head; v's).
fn heads_arg<'py>(
    held: &mut Held<'py>,
    obj: &Bound<'py, PyAny>,
    name: &'static str,
    (holds, size): (Holds, Option<usize>),
) -> PyResult<RawTensor> {
    let d = held.borrow(obj, name)?;
    let (ok, want) = match holds {
        Holds::Elem(elem) => (d.elem == elem, elem.name()),
        Holds::Fp8(format) => (d.elem.holds(format), fp8_names(format)),
    };
    if !ok {
        return Err(PyValueError::new_err(format!(
            "{name} must be {want}, got {}",
            d.elem.name()
        )));
    }
    let size = size.unwrap_or(d.shape.last().copied().unwrap_or(0));
    dlpack::heads_tensor(d, size, name).map_err(arg_error)
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
            let k = held.required_tensor(key, names.python_name("k"), spec)?;
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
        FusedTensors::OutOfPlace {
            key,
            query_out,
            key_out,
            ..
        } => {
            let spec = (elem, arg, view);
            let mut tensor = |obj, name| held.required_tensor(obj, name, spec);
            let k = tensor(key, names.python_name("k"))?;
            let q_output = tensor(query_out, names.python_name("q.output"))?;
            let k_output = tensor(key_out, names.python_name("k.output"))?;
            let io = RawFusedIo::Separate {
                q: RawQOut::Elem(RawIo::OutOfPlace {
                    input: first,
                    output: q_output,
                }),
                k: RawKOut::Elem(RawIo::OutOfPlace {
                    input: k,
                    output: k_output,
                }),
                v: None,
            };
            Ok((io, elem, dtype))
        }
        FusedTensors::Quantized {
            k,
            value,
            q_out,
            k_out,
            nope,
            format,
            multipliers: (mq, mk),
            ..
        } => {
            let q = first;
            let spec = (elem, arg, view);
            let k_in = held.required_tensor(k, names.python_name("k"), spec)?;
            // v's heads may hold non-rotary features after the rotated ones (FlashInfer's
            // `rope_dim + no_rope_dim`): its width is its own, checked by rope-host against the
            // cache's.
            let v = match value {
                Some(obj) => {
                    let v = (Holds::Elem(elem), None);
                    Some(heads_arg(held, obj, names.python_name("v"), v)?)
                }
                None => None,
            };
            // An FP8 output (`fp8`) or an input of the tensors' type, of heads of `size`
            // elements (the last dimension's with `None`).
            let mut heads = |obj: &Bound<'py, PyAny>, arg, fp8: bool, size: Option<usize>| {
                let holds = if fp8 {
                    Holds::Fp8(format)
                } else {
                    Holds::Elem(elem)
                };
                heads_arg(held, obj, names.python_name(arg), (holds, size))
            };
            let q_output = heads(q_out, "q.output", true, Some(head_size))?;
            let k_output = match k_out {
                Some(obj) => Some(heads(obj, "k.output", true, Some(head_size))?),
                None => None,
            };
            let mut part = |pair: Option<&(Bound<'py, PyAny>, Bound<'py, PyAny>)>, who: &str| {
                let Some((x, out)) = pair else {
                    return Ok(None);
                };
                let (input, output) = match who {
                    "q" => ("q.non_rotary.input", "q.non_rotary.output"),
                    _ => ("k.non_rotary.input", "k.non_rotary.output"),
                };
                PyResult::Ok(Some(RawNonRotary {
                    input: heads(x, input, false, None)?,
                    output: heads(out, output, true, None)?,
                }))
            };
            let q = RawQOut::Fp8 {
                input: q,
                output: q_output,
                scale: RawFp8Scale::Multiplier(mq),
                format,
                non_rotary: part(nope[0], "q")?,
            };
            let k = match k_output {
                Some(output) => RawKOut::Fp8 {
                    input: k_in,
                    output,
                    scale: RawFp8Scale::Multiplier(mk),
                    format,
                    non_rotary: part(nope[1], "k")?,
                },
                None => RawKOut::CacheOnly(k_in),
            };
            Ok((RawFusedIo::Separate { q, k, v }, elem, dtype))
        }
    }
}

/// Validates `l` (here and in rope-host) and launches it on its stream.
pub(crate) fn launch(l: FusedLaunch<'_, '_>) -> PyResult<()> {
    // The first tensor sets the device every other must be on.
    let first = match &l.tensors {
        FusedTensors::Packed { qkv, .. } => *qkv,
        FusedTensors::Separate { query, .. } | FusedTensors::OutOfPlace { query, .. } => *query,
        FusedTensors::Quantized { q, .. } => *q,
    };
    let dlpack_stream = dlpack_stream(l.stream, l.producer_sync);
    let held = Held::first(first, l.names.python_name("q"), dlpack_stream)?;
    launch_held(l, held)
}

/// The rotation of a launch given as vLLM gives it: `positions` (ids, or ids with axes), the
/// `cos_sin_cache` (`[max_position, rotary_dim]`, its halves cos and sin: the cache's width
/// sets `rotary_dim`), `head_dim` features per head paired by `style`, of `dtype` (`elem`).
pub(crate) fn cache_rotation<'py>(
    held: &mut Held<'py>,
    (positions, cos_sin_cache): (&PositionsArg<'_, 'py>, &Bound<'py, PyAny>),
    (head_dim, style, dtype, elem): (u32, RopeStyle, DType, Elem),
    (names, stream): (&Names, CUstream),
) -> PyResult<RawOp> {
    let device = held.device;
    let positions = raw_positions(positions, held, names)?;
    let (sincos, rotary_dim, _frequencies) = raw_sincos(
        SinCosArg::Cache(cos_sin_cache),
        held,
        (dtype, elem.name(), head_dim, None),
        (names, stream),
    )?;
    let positions = positions.finish(device, names, (rotary_dim, stream))?;
    let config = RopeConfig::builder(head_dim, style)
        .rotary_dim(rotary_dim)
        .build()
        .map_err(|e| names.host_error(e))?;
    Ok(RawOp {
        config,
        dtype,
        positions,
        sincos,
    })
}

/// [`launch`] with tensors already borrowed: `held` began with `l`'s first tensor (`qkv`,
/// `query` or `q`) and borrowed as `l.stream` and `l.producer_sync` ask ([`dlpack_stream`]).
pub(crate) fn launch_held<'py>(l: FusedLaunch<'_, 'py>, mut held: Held<'py>) -> PyResult<()> {
    let names = l.names;
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
        Some((qw, kw, eps, weighting)) => {
            let mut weight = |obj, arg| -> PyResult<_> {
                let name = names.python_name(arg);
                let d = held.borrow(obj, name)?;
                // Across heads any length here: rope-host names a length other than
                // `heads * head_size`.
                let len = match l.norm_scope {
                    NormScope::PerHead => l.head_size,
                    NormScope::AcrossHeads => d.shape.iter().product(),
                };
                dlpack::vector(d, name, elem, len).map_err(arg_error)
            };
            Some(RawQkNorm {
                q_weight: weight(qw, "norm.q_weight")?,
                k_weight: weight(kw, "norm.k_weight")?,
                eps: eps as f32,
                weight: weighting,
                scope: l.norm_scope,
            })
        }
        None => None,
    };
    let cache = match &l.cache {
        Some(c) => Some(raw_cache(c, &mut held, (elem, l.head_size), &names)?),
        None => None,
    };
    let positions = match &l.axes {
        Some(axes) => PositionsArg::MultiAxis {
            ids: l.positions,
            axes: axes.clone(),
        },
        None => PositionsArg::Ids(l.positions),
    };
    let stream = l.stream as usize as CUstream;
    let rotation = cache_rotation(
        &mut held,
        (&positions, l.cos_sin_cache),
        (head_dim, l.style, dtype, elem),
        (&names, stream),
    )?;
    let rope = rope_for(device, l.overlap)?;
    let op = RawFusedOp {
        rope: rotation,
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
