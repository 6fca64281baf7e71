//! The extension module `rope_rs._native`: `apply_rope` (explicit outputs, explicit stream),
//! vLLM's `rotary_embedding` and `frequencies`. The Python package (`rope_rs/__init__.py`,
//! `rope_rs/torch.py`) wraps them with defaults taken from PyTorch: the current stream and
//! outputs allocated for out-of-place calls.
//!
//! Here the Python arguments are read into `options.rs`'s and `launch.rs`'s (or `fused.rs`'s)
//! descriptions; those borrow the tensors and launch. Every argument may be given by position,
//! in the signature's order: the package's wrappers do so, since positions are parsed faster
//! than keywords (each keyword is matched by name).

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use rope_host::{
    AngleMode, ConfigBase, ConfigValue, ContextParallel, DEFAULT_THETA, Direction, FrequencySpec,
    NormWeight, ROPE_SCALING_KEYS, RopeScaling, RopeStyle, StreamOverlap,
};

use crate::dlpack::{DL_CUDA, TensorLayout};
use crate::exchange;
use crate::fused::{
    self, AddressArg, CacheArg, CacheNopeArg, CacheType, FusedLaunch, FusedTensors, ScalesArg,
};
use crate::launch::{
    self, Held, Launch, Names, PositionsArg, Scaling, SinCosArg, View, arg_error, same_name_error,
};
use crate::options::{self, Axes, PositionsGiven, PositionsKind, SinCosGiven, SinCosKind};

/// The range `attention_factor=` must lie in (rope-host's bound on every attention factor).
const ATTENTION_RANGE: (f64, f64) = (1e-3, 1e3);

fn parse_style(style: &str) -> PyResult<RopeStyle> {
    match style {
        "neox" => Ok(RopeStyle::Neox),
        "interleaved" => Ok(RopeStyle::Interleaved),
        other => Err(PyValueError::new_err(format!(
            "style must be \"neox\" or \"interleaved\", got {other:?}"
        ))),
    }
}

fn parse_angle(angle: Option<&str>) -> PyResult<AngleMode> {
    match angle {
        None | Some("exact") => Ok(AngleMode::Exact),
        Some("f32") => Ok(AngleMode::F32Compat),
        Some(other) => Err(PyValueError::new_err(format!(
            "angle must be \"exact\" or \"f32\", got {other:?}"
        ))),
    }
}

/// The type name of `obj`, for messages.
fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string())
}

/// What `positions=` is: nothing, an int or a tensor.
fn positions_given(positions: Option<&Bound<'_, PyAny>>) -> PyResult<PositionsGiven> {
    let Some(p) = positions else {
        return Ok(PositionsGiven::None);
    };
    if p.is_instance_of::<PyInt>() && !p.is_instance_of::<PyBool>() {
        let offset: i64 = p.extract().map_err(|_| {
            PyValueError::new_err(format!("positions must be an offset in 0..2^32, got {p}"))
        })?;
        return Ok(PositionsGiven::Int(offset));
    }
    if p.hasattr("__dlpack__")? {
        return Ok(PositionsGiven::Tensor);
    }
    Err(PyTypeError::new_err(format!(
        "positions must be an int (an offset) or a CUDA int32/int64 tensor, got {}",
        type_name(p)
    )))
}

/// Whether `obj` is a DLPack tensor in host memory (numpy's arrays, PyTorch's CPU tensors).
fn host_dlpack(obj: &Bound<'_, PyAny>) -> PyResult<bool> {
    if !obj.hasattr("__dlpack_device__")? {
        return Ok(false);
    }
    let (device_type, _): (i32, i32) = obj.call_method0("__dlpack_device__")?.extract()?;
    Ok(device_type != DL_CUDA)
}

/// A Python number or sequence of numbers as a `scaling` value.
fn scaling_value(key: &str, v: &Bound<'_, PyAny>) -> PyResult<ConfigValue> {
    Ok(if v.is_none() {
        ConfigValue::Null
    } else if v.is_instance_of::<PyBool>() {
        ConfigValue::Bool(v.extract()?)
    } else if v.is_instance_of::<PyInt>() {
        match v.extract::<i64>() {
            Ok(i) => ConfigValue::Int(i),
            Err(_) => ConfigValue::Float(v.extract()?),
        }
    } else if v.is_instance_of::<PyFloat>() {
        ConfigValue::Float(v.extract()?)
    } else if v.is_instance_of::<PyString>() {
        ConfigValue::Str(v.extract()?)
    } else if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        ConfigValue::List(v.extract().map_err(|_| {
            PyTypeError::new_err(format!("scaling: entry {key:?} must be a list of numbers"))
        })?)
    } else {
        return Err(PyTypeError::new_err(format!(
            "scaling: entry {key:?} must be a number, str, bool or list of numbers, got {}",
            type_name(v)
        )));
    })
}

/// `scaling=` as given: a dictionary, or its JSON text (how `rope_rs.torch`'s custom operators
/// carry it).
fn scaling_given(scaling: &Bound<'_, PyAny>) -> PyResult<Scaling> {
    if let Ok(text) = scaling.cast::<PyString>() {
        return Ok(Scaling::Json(text.to_cow()?.into_owned()));
    }
    let dict = scaling.cast::<PyDict>().map_err(|_| {
        PyTypeError::new_err(format!(
            "scaling must be a dict (a config's rope_scaling) or its JSON text, got {}",
            type_name(scaling)
        ))
    })?;
    dict.iter()
        .map(|(k, v)| {
            let key: String = k
                .extract()
                .map_err(|_| PyTypeError::new_err("scaling's keys must be str"))?;
            let value = scaling_value(&key, &v)?;
            Ok((key, value))
        })
        .collect::<PyResult<_>>()
        .map(Scaling::Entries)
}

/// `attention_factor=`, checked against [`ATTENTION_RANGE`]; 1 when not given.
/// The launches' overlap for `pdl=`: programmatic dependent launch where the device and kernel
/// support it (see `rope_host::StreamOverlap`).
pub(crate) fn overlap(pdl: bool) -> StreamOverlap {
    if pdl {
        StreamOverlap::Programmatic
    } else {
        StreamOverlap::None
    }
}

fn attention(attention_factor: Option<f64>) -> PyResult<f64> {
    let a = attention_factor.unwrap_or(1.0);
    let (lo, hi) = ATTENTION_RANGE;
    if a.is_finite() && (lo..=hi).contains(&a) {
        Ok(a)
    } else {
        Err(PyValueError::new_err(format!(
            "attention_factor must lie in [{lo}, {hi}], got {a}"
        )))
    }
}

/// The sin/cos arguments of `apply_rope`.
struct SinCosArgs<'a, 'py> {
    theta: Option<f64>,
    cos_sin_cache: Option<&'a Bound<'py, PyAny>>,
    cos: Option<&'a Bound<'py, PyAny>>,
    sin: Option<&'a Bound<'py, PyAny>>,
    inv_freq: Option<&'a Bound<'py, PyAny>>,
    attention_factor: Option<f64>,
    angle: Option<&'a str>,
    scaling: Option<&'a Bound<'py, PyAny>>,
}

impl<'a, 'py> SinCosArgs<'a, 'py> {
    /// The source these arguments select, and the name errors about it use.
    fn resolve(self) -> PyResult<(SinCosArg<'a, 'py>, &'static str)> {
        let given = SinCosGiven {
            theta: self.theta.is_some(),
            scaling: self.scaling.is_some(),
            inv_freq: self.inv_freq.is_some(),
            cos_sin_cache: self.cos_sin_cache.is_some(),
            cos: self.cos.is_some(),
            sin: self.sin.is_some(),
            attention_factor: self.attention_factor.is_some(),
            angle: self.angle.is_some(),
        };
        let kind = options::sincos(given).map_err(arg_error)?;
        let angle = parse_angle(self.angle)?;
        let theta = self.theta.unwrap_or(DEFAULT_THETA);
        Ok(match (kind, self.cos_sin_cache, self.cos, self.sin) {
            (SinCosKind::Cache, Some(cache), ..) => (SinCosArg::Cache(cache), "cos_sin_cache"),
            (SinCosKind::Tables, _, Some(cos), Some(sin)) => {
                (SinCosArg::Tables(cos, sin), "cos and sin")
            }
            (SinCosKind::Theta, ..) => (SinCosArg::Theta(theta, angle), "theta"),
            (SinCosKind::Scaling, ..) => {
                let given = scaling_given(self.scaling.expect("the Scaling source has scaling"))?;
                let arg = SinCosArg::Scaling {
                    given,
                    theta: self.theta,
                    angle,
                };
                (arg, "scaling")
            }
            (SinCosKind::InvFreq, ..) => {
                let obj = self.inv_freq.expect("the InvFreq source has inv_freq");
                let a = attention(self.attention_factor)?;
                let arg = if obj.hasattr("__dlpack__")? && !host_dlpack(obj)? {
                    SinCosArg::DeviceInvFreq(obj, a, angle)
                } else {
                    // Host arrays (numpy, CPU tensors) through their lists.
                    let seq = if obj.hasattr("tolist")? {
                        obj.call_method0("tolist")?
                    } else {
                        obj.clone()
                    };
                    let v: Vec<f64> = seq.extract().map_err(|_| {
                        PyTypeError::new_err(format!(
                            "inv_freq must be a CUDA float64 tensor or a sequence of floats, got {}",
                            type_name(obj)
                        ))
                    })?;
                    SinCosArg::HostInvFreq(v, a, angle)
                };
                (arg, "inv_freq")
            }
            _ => unreachable!("options::sincos checked that the chosen source's arguments exist"),
        })
    }
}

/// Rotates q (and k) by rotary position embedding (RoPE) on the GPU: the native call under
/// `rope_rs.apply_rope`, with explicit outputs and an explicit stream.
///
/// Tensors are CUDA tensors of one device passed by DLPack (`__dlpack__` and
/// `__dlpack_device__`, as `torch.Tensor` has). q and k are float32, float16 or bfloat16,
/// `[batch, seq, heads, head_dim]` (`layout="bshd"`, the default for 4-D tensors),
/// `[seq, batch, heads, head_dim]` (`"sbhd"`), `[batch, heads, seq, head_dim]` (`"bhsd"`) or
/// `[tokens, heads, head_dim]` (3-D, `"thd"`), with any strides but a contiguous last
/// dimension; k has q's dtype, batch and seq and any number of heads. `out` and `k_out`, when
/// given, receive the results (q's and k's shapes and dtype, any strides; q and k are then only
/// read); otherwise q and k are rotated in place.
///
/// Positions, one of: `positions`, an int (`p = positions + s`, default 0) or a tensor
/// `[batch]` (`p = positions[b] + s`); `position_ids`, a tensor `[seq]` or `[batch, seq]`
/// (`p = position_ids[s]` or `position_ids[b, s]`); `cu_seqlens` `[num_seqs + 1]` for packed
/// 3-D tensors (token `t` of sequence `i` at `t - cu_seqlens[i] + positions[i]`, `positions`
/// then an optional tensor `[num_seqs]`). Integer tensors are contiguous int32 or int64.
/// With `mrope_section` (three pair counts, temporal, height and width, summing to
/// `rotary_dim / 2`), `position_ids` is mRoPE's `[3, batch, seq]` or `[3, tokens]`: pair `i`
/// of each head rotates at the row of its section (blocks in that order, Qwen2-VL and
/// Qwen2.5-VL; with `mrope_interleaved=True` the `T H W T H W ...` order of Qwen3-VL). With
/// `axes_dim` (one to four even widths summing to `rotary_dim`, FLUX's `EmbedND`),
/// `position_ids` is `[n_axes, batch, seq]` or `[n_axes, tokens]`: axis `a` owns
/// `axes_dim[a] / 2` consecutive pairs, and `theta` gives them `theta^(-2i / axes_dim[a])`.
///
/// sin/cos, one of: `theta` (default 10000; `inv_freq[i] = theta^(-2i / rotary_dim)`, cos and
/// sin computed in the kernel); `scaling`, a Hugging Face `rope_scaling` dict (`rope_type`
/// "default", "linear", "dynamic", "yarn", "longrope" or "llama3" with the config's keys, plus
/// `max_position_embeddings` and `seq_len` where the family reads them; `theta` is its base);
/// `inv_freq` `[rotary_dim / 2]`, a CUDA float64 tensor (read as given) or floats on the host,
/// with `attention_factor` (default 1) multiplying cos and sin; `cos_sin_cache`
/// `[max_position, rotary_dim]` (cos half, then sin half); `cos` and `sin`
/// `[max_position, rotary_dim / 2]` each. Tables are float32 or q's dtype; a position outside a
/// table makes that token's outputs NaN. `angle="f32"` forms angles as PyTorch models do,
/// `f32(p) * f32(inv_freq)` rounded to f32, instead of exactly (`"exact"`, the default).
///
/// `style`: "neox" rotates pairs `(x[i], x[i + r/2])`, "interleaved" `(x[2i], x[2i+1])`.
/// `rotary_dim` (default: what the table or frequencies serve, else head_dim) rotates the first
/// `rotary_dim` features of each head; the others are copied out of place and left alone in
/// place. `backward=True` applies the transposed rotation (the gradient of the forward one).
///
/// The kernel is launched asynchronously on `stream`, a `CUstream` handle as an int (0: the
/// legacy default stream). The caller guarantees that `stream` belongs to the tensors' device
/// (its primary context, as PyTorch's streams do), that every tensor stays allocated until the
/// kernel has run on `stream` (PyTorch does this for tensors used on their own stream; otherwise
/// call `tensor.record_stream`), and that nothing else writes them, or reads what is written,
/// meanwhile. Each tensor's producer is asked (`__dlpack__(stream=...)`) to order its pending
/// writes before `stream`; `producer_sync=False` asks for no synchronization (`stream=-1`), for
/// callers that launch on the stream the tensors were written on (as `rope_rs` does on PyTorch's
/// current stream, sparing PyTorch a comparison of streams per tensor). Frequencies computed on
/// the host (`theta`, `scaling`, `inv_freq` floats,
/// `angle="f32"`) are uploaded once per process on first use and kept; an upload cannot happen
/// while `stream` is capturing a CUDA graph, so make the same call once before capturing.
///
/// `pdl=True` asks for programmatic dependent launch (compute capability 9.0 and newer): the
/// launch may start before the kernel ahead of it on `stream` has completed, and the kernel
/// waits for that one before it touches memory (same results; the decode-sized launches and
/// fused kernels built for it, others launch as usual; captured in a CUDA graph it needs a
/// driver of CUDA 12.3 or newer).
///
/// Raises TypeError for an argument of the wrong Python type, ValueError naming the argument
/// for an invalid tensor or option (nothing is launched then), RuntimeError when the CUDA
/// driver fails.
#[pyfunction]
#[pyo3(signature = (
    q, k=None, out=None, k_out=None, positions=None, position_ids=None, cu_seqlens=None,
    layout=None, style="neox", theta=None, cos_sin_cache=None, cos=None, sin=None,
    inv_freq=None, attention_factor=None, angle=None, scaling=None, rotary_dim=None,
    backward=false, stream=0, producer_sync=true, cp_size=1, cp_rank=0, pdl=false,
    mrope_section=None, mrope_interleaved=false, axes_dim=None
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn apply_rope(
    q: &Bound<'_, PyAny>,
    k: Option<&Bound<'_, PyAny>>,
    out: Option<&Bound<'_, PyAny>>,
    k_out: Option<&Bound<'_, PyAny>>,
    positions: Option<&Bound<'_, PyAny>>,
    position_ids: Option<&Bound<'_, PyAny>>,
    cu_seqlens: Option<&Bound<'_, PyAny>>,
    layout: Option<&str>,
    style: &str,
    theta: Option<f64>,
    cos_sin_cache: Option<&Bound<'_, PyAny>>,
    cos: Option<&Bound<'_, PyAny>>,
    sin: Option<&Bound<'_, PyAny>>,
    inv_freq: Option<&Bound<'_, PyAny>>,
    attention_factor: Option<f64>,
    angle: Option<&str>,
    scaling: Option<&Bound<'_, PyAny>>,
    rotary_dim: Option<u32>,
    backward: bool,
    stream: u64,
    producer_sync: bool,
    cp_size: u32,
    cp_rank: u32,
    pdl: bool,
    mrope_section: Option<Vec<u32>>,
    mrope_interleaved: bool,
    axes_dim: Option<Vec<u32>>,
) -> PyResult<()> {
    let style = parse_style(style)?;
    let layout = TensorLayout::parse(layout).map_err(arg_error)?;
    let kind = options::positions(
        positions_given(positions)?,
        position_ids.is_some(),
        cu_seqlens.is_some(),
        (cp_size, cp_rank),
    )
    .map_err(arg_error)?;
    let axes = options::axes(
        mrope_section.as_deref(),
        mrope_interleaved,
        axes_dim.as_deref(),
        kind,
    )
    .map_err(arg_error)?;
    let positions_tensor = positions.filter(|p| !p.is_instance_of::<PyInt>());
    let (positions_arg, positions_name) = match (kind, positions_tensor, position_ids, cu_seqlens) {
        (PositionsKind::Offset(o), ..) => (PositionsArg::Offset(o), "positions"),
        (PositionsKind::RowOffsets, Some(p), ..) => (PositionsArg::RowOffsets(p), "positions"),
        (PositionsKind::Ids, _, Some(ids), _) => match axes.clone() {
            Some(axes) => (PositionsArg::MultiAxis { ids, axes }, "position_ids"),
            None => (PositionsArg::Ids(ids), "position_ids"),
        },
        (PositionsKind::Varlen { offsets }, p, _, Some(cu)) => {
            let arg = PositionsArg::Varlen {
                cu_seqlens: cu,
                offsets: p.filter(|_| offsets),
            };
            (arg, if offsets { "positions" } else { "cu_seqlens" })
        }
        (PositionsKind::VarlenContextParallel { cp_size, cp_rank }, _, _, Some(cu)) => {
            let split = ContextParallel::new(cp_size, cp_rank).map_err(|e| match e {
                rope_host::Error::Invalid { arg, problem } => {
                    PyValueError::new_err(format!("{arg}: {problem}"))
                }
                other => PyRuntimeError::new_err(other.to_string()),
            })?;
            let arg = PositionsArg::VarlenContextParallel {
                cu_seqlens: cu,
                split,
            };
            (arg, "cu_seqlens")
        }
        _ => unreachable!("options::positions checked that the chosen source's arguments exist"),
    };
    let (sincos, sincos_name) = SinCosArgs {
        theta,
        cos_sin_cache,
        cos,
        sin,
        inv_freq,
        attention_factor,
        angle,
        scaling,
    }
    .resolve()?;
    let sincos = axial_frequencies(sincos, axes.as_ref())?;
    launch::launch(Launch {
        q,
        k,
        out,
        k_out,
        names: Names {
            positions: positions_name,
            sincos: sincos_name,
            ..Names::APPLY_ROPE
        },
        view: View::Rope(layout),
        positions: positions_arg,
        sincos,
        style,
        rotary_dim,
        direction: if backward {
            Direction::Backward
        } else {
            Direction::Forward
        },
        stream,
        producer_sync,
        overlap: overlap(pdl),
    })
}

/// N-D axial positions' frequencies: from `theta`, each axis's `theta^(-2i / axes_dim[a])`
/// (computed on the host, pinned at launch); a table or given frequencies stay as they are
/// (they hold the axes' own), and a `scaling` family is refused.
fn axial_frequencies<'a, 'py>(
    sincos: SinCosArg<'a, 'py>,
    axes: Option<&Axes>,
) -> PyResult<SinCosArg<'a, 'py>> {
    let Some(Axes::Axial { axes_dim }) = axes else {
        return Ok(sincos);
    };
    match sincos {
        SinCosArg::Theta(theta, angle) => {
            let rotary_dim = axes_dim.iter().map(|&d| u64::from(d)).sum::<u64>();
            let rotary_dim = u32::try_from(rotary_dim)
                .map_err(|_| PyValueError::new_err("axes_dim: the widths sum past u32::MAX"))?;
            let spec =
                FrequencySpec::new(theta, rotary_dim)
                    .angle(angle)
                    .scaling(RopeScaling::Axial {
                        axes_dim: axes_dim.clone(),
                    });
            // rope-host names the scaling family; here the widths are `axes_dim` itself.
            let (f, a) = spec.build().map_err(|e| match e {
                rope_host::Error::Invalid { problem, .. } => PyValueError::new_err(format!(
                    "axes_dim: {}",
                    problem.strip_prefix("axes_dim ").unwrap_or(&problem)
                )),
                other => Names::APPLY_ROPE.host_error(other),
            })?;
            Ok(SinCosArg::HostInvFreq(f, a, angle))
        }
        SinCosArg::Scaling { .. } => Err(PyValueError::new_err(
            "scaling: not with axes_dim (the axes give the frequencies: theta^(-2i / axes_dim[a]))",
        )),
        other => Ok(other),
    }
}

/// The cache-write arguments as given: all of `key_cache`, `value_cache` and `slot_mapping`
/// or none.
fn cache_arg<'a, 'py>(
    (key_cache, value_cache, slot_mapping): CacheObjects<'a, 'py>,
    kv_cache_dtype: &str,
    (k_scale, v_scale): (Option<&'a Bound<'py, PyAny>>, Option<&'a Bound<'py, PyAny>>),
) -> PyResult<Option<CacheArg<'a, 'py>>> {
    let dtype = CacheType::parse(kv_cache_dtype)?;
    let scales = match (k_scale, v_scale) {
        (Some(k), Some(v)) => Some((k, v)),
        (None, None) => None,
        (Some(_), None) => {
            return Err(PyValueError::new_err(
                "v_scale: given k_scale, give v_scale too",
            ));
        }
        (None, Some(_)) => {
            return Err(PyValueError::new_err(
                "k_scale: given v_scale, give k_scale too",
            ));
        }
    };
    match (key_cache, value_cache, slot_mapping) {
        (Some(key_cache), Some(value_cache), Some(slot_mapping)) => Ok(Some(CacheArg {
            key_cache,
            value_cache,
            address: AddressArg::Slots(slot_mapping),
            dtype,
            scales: scales.map(|(k, v)| ScalesArg::Tensors(k, v)),
            heads_first: false,
            page_size: None,
            non_rotary: None,
        })),
        (None, None, None) if scales.is_none() && dtype == CacheType::Auto => Ok(None),
        (None, None, None) => Err(PyValueError::new_err(
            "key_cache: kv_cache_dtype, k_scale and v_scale describe a cache write; give \
             key_cache, value_cache and slot_mapping",
        )),
        _ => Err(PyValueError::new_err(
            "key_cache, value_cache and slot_mapping go together: give all three to write the KV \
             cache, or none",
        )),
    }
}

/// `key_cache`, `value_cache` and `slot_mapping`, each optional.
type CacheObjects<'a, 'py> = (
    Option<&'a Bound<'py, PyAny>>,
    Option<&'a Bound<'py, PyAny>>,
    Option<&'a Bound<'py, PyAny>>,
);

/// The pairing of the peers' `is_neox`: rotate-half, else interleaved.
pub(crate) fn pairing(is_neox: bool) -> RopeStyle {
    if is_neox {
        RopeStyle::Neox
    } else {
        RopeStyle::Interleaved
    }
}

/// The names of vLLM's (and SGLang's, FlashInfer's) rotation arguments.
const VLLM_NAMES: Names = Names {
    q: "query",
    k: "key",
    out: "query",
    k_out: "key",
    positions: "positions",
    sincos: "cos_sin_cache",
    other: &[],
};

/// rope-host's names of a cache write's arguments in vLLM's words.
const VLLM_CACHE_NAMES: [(&str, &str); 6] = [
    ("cache.k", "key_cache"),
    ("cache.v", "value_cache"),
    ("cache.layout", "key_cache"),
    ("cache.slot_mapping", "slot_mapping"),
    ("cache.k_scale", "k_scale"),
    ("cache.v_scale", "v_scale"),
];

/// vLLM's `rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)`: rotates
/// query and key in place; with `key_cache`, `value_cache` and `slot_mapping` it also writes
/// the rotated key and `value` into vLLM's paged KV cache in the same launch (the write of
/// vLLM's `reshape_and_cache_flash`).
///
/// `positions` is a CUDA int32/int64 tensor `[num_tokens]`; `query` and `key` are
/// `[num_tokens, num_heads * head_size]` (or `[num_tokens, num_heads, head_size]`) with a
/// contiguous last dimension, `key` may be None (without a cache); `cos_sin_cache` is
/// `[max_position, rotary_dim]` (cos half, then sin half) in float32 or query's dtype;
/// `is_neox` picks rotate-half pairs (else interleaved). The first `rotary_dim` features of
/// each head rotate.
///
/// The cache write: `value` like key; `key_cache` and `value_cache`
/// `[num_blocks, block_size, num_kv_heads, head_size]` (any strides with a contiguous last
/// dimension, the same for both); token `t` goes to row `slot_mapping[t] % block_size` of block
/// `slot_mapping[t] // block_size` (`slot_mapping` int32/int64 `[num_tokens]`; a negative slot
/// writes nothing). `kv_cache_dtype` "auto" stores query's dtype; "fp8" (or "fp8_e4m3") stores
/// FP8 E4M3 of `x / k_scale` and `x / v_scale` (float32 tensors of one element or one per kv
/// head) into uint8 or float8_e4m3fn caches, rounded to nearest even and saturated at ±448;
/// "fp8_e5m2" stores E5M2 (uint8 or float8_e5m2 caches, saturated at ±57344); "nvfp4" stores
/// NVFP4 into vLLM's packed uint8 caches `[num_blocks, block_size, num_kv_heads, head_size / 2 +
/// head_size / 16]`, each head's row its E2M1 codes (two a byte, the even element low) and then
/// its E4M3 block scales, one per 16 elements, `b = e4m3(max|x| / (6 scale))`, codes
/// `e2m1(x / (b scale))`, `scale` the global `k_scale` or `v_scale` (whole-head rotations).
/// With the cache write the features past `rotary_dim` are stored as they are (a partial
/// rotation in the fused kernels: `head_size - rotary_dim` whole accesses, no offset).
///
/// Launched asynchronously on `stream` (a `CUstream` handle as an int; 0, the default, is the
/// legacy default stream), with the caller's guarantees of `apply_rope` (`producer_sync` and
/// `pdl` as there). Raises as `apply_rope` does.
#[pyfunction]
#[pyo3(signature = (
    positions, query, key, head_size, cos_sin_cache, is_neox, value=None, key_cache=None,
    value_cache=None, slot_mapping=None, kv_cache_dtype="auto", k_scale=None, v_scale=None,
    stream=0, producer_sync=true, pdl=false
))]
#[allow(clippy::too_many_arguments)]
fn rotary_embedding(
    positions: &Bound<'_, PyAny>,
    query: &Bound<'_, PyAny>,
    key: Option<&Bound<'_, PyAny>>,
    head_size: usize,
    cos_sin_cache: &Bound<'_, PyAny>,
    is_neox: bool,
    value: Option<&Bound<'_, PyAny>>,
    key_cache: Option<&Bound<'_, PyAny>>,
    value_cache: Option<&Bound<'_, PyAny>>,
    slot_mapping: Option<&Bound<'_, PyAny>>,
    kv_cache_dtype: &str,
    k_scale: Option<&Bound<'_, PyAny>>,
    v_scale: Option<&Bound<'_, PyAny>>,
    stream: u64,
    producer_sync: bool,
    pdl: bool,
) -> PyResult<()> {
    let style = pairing(is_neox);
    let names = VLLM_NAMES;
    let cache = cache_arg(
        (key_cache, value_cache, slot_mapping),
        kv_cache_dtype,
        (k_scale, v_scale),
    )?;
    let Some(cache) = cache else {
        if value.is_some() {
            return Err(PyValueError::new_err(
                "value: is only read to fill a KV cache; give key_cache, value_cache and slot_mapping",
            ));
        }
        return launch::launch(Launch {
            q: query,
            k: key,
            out: None,
            k_out: None,
            names,
            view: View::Heads(head_size),
            positions: PositionsArg::Ids(positions),
            sincos: SinCosArg::Cache(cos_sin_cache),
            style,
            rotary_dim: None,
            direction: Direction::Forward,
            stream,
            producer_sync,
            overlap: overlap(pdl),
        });
    };
    let (Some(key), Some(value)) = (key, value) else {
        return Err(PyValueError::new_err(
            "key and value: a KV cache write needs both (key rotated, value copied)",
        ));
    };
    const OTHER: [(&str, &str); 9] = [
        ("v", "value"),
        ("config", "cos_sin_cache"),
        ("cache", "key_cache"),
        VLLM_CACHE_NAMES[0],
        VLLM_CACHE_NAMES[1],
        VLLM_CACHE_NAMES[2],
        VLLM_CACHE_NAMES[3],
        VLLM_CACHE_NAMES[4],
        VLLM_CACHE_NAMES[5],
    ];
    fused::launch(FusedLaunch {
        tensors: FusedTensors::Separate {
            query,
            key,
            value: Some(value),
        },
        head_size,
        norm: None,
        norm_scope: rope_host::NormScope::PerHead,
        positions,
        axes: None,
        cos_sin_cache,
        style,
        cache: Some(cache),
        names: Names {
            other: &OTHER,
            ..names
        },
        stream,
        producer_sync,
        overlap: overlap(pdl),
    })
}

/// The names of vLLM's `concat_and_cache_mla_rope_fused` arguments: q's and k's rotated parts
/// `q_pe` and `k_pe`, the latent part `kv_c` (rope-host's k non-rotary part into the cache) and
/// the one cache `kv_cache` holding both.
const VLLM_MLA_NAMES: Names = Names {
    q: "q_pe",
    k: "k_pe",
    out: "q_pe",
    k_out: "k_pe",
    positions: "positions",
    sincos: "cos_sin_cache",
    other: &[
        ("config", "cos_sin_cache"),
        ("cache", "kv_cache"),
        ("cache.k", "kv_cache"),
        ("cache.v", "kv_cache"),
        ("cache.layout", "kv_cache"),
        ("cache.non_rotary.layout", "kv_cache"),
        ("cache.non_rotary.input", "kv_c"),
        ("cache.slot_mapping", "slot_mapping"),
        ("cache.k_scale", "kv_cache_scale"),
        ("cache.v_scale", "kv_cache_scale"),
    ],
};

/// vLLM's `concat_and_cache_mla_rope_fused(positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox,
/// slot_mapping, kv_cache, kv_cache_dtype, kv_cache_scale)`, MLA's (DeepSeek's) rotation and
/// latent-cache write in one launch: rotates `q_pe` `[num_tokens, num_heads, rot_dim]` and the
/// one shared `k_pe` `[num_tokens, rot_dim]` in place at `positions` (int32/int64
/// `[num_tokens]`) with `cos_sin_cache` `[max_position, rot_dim]`, and writes each token's
/// `[kv_c | rotated k_pe]` (`kv_c` `[num_tokens, kv_lora_rank]`) into row `slot % block_size`
/// of block `slot // block_size` of `kv_cache` `[num_blocks, block_size, kv_lora_rank +
/// rot_dim]` (`slot_mapping` int32/int64 `[num_tokens]`; a negative slot writes nothing, the
/// token's q_pe and k_pe are still rotated). `kv_cache_dtype` "auto" stores q_pe's dtype
/// (`kv_cache_scale` unused), "fp8" (or "fp8_e4m3") FP8 E4M3 of `x / kv_cache_scale` (a float32
/// tensor of one element) into a uint8 or float8_e4m3fn cache, "fp8_e5m2" E5M2. `rot_dim` is
/// `q_pe`'s last extent (the
/// Python wrapper passes it), every token row is rotated (the wrapper cuts them to
/// `slot_mapping`'s length, as vLLM does for padded batches).
///
/// Launched as `rotary_embedding`; raises as `apply_rope` does.
#[pyfunction]
#[pyo3(signature = (
    positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_dtype,
    kv_cache_scale, rot_dim, stream=0, producer_sync=true, pdl=false
))]
#[allow(clippy::too_many_arguments)]
fn concat_and_cache_mla_rope_fused(
    positions: &Bound<'_, PyAny>,
    q_pe: &Bound<'_, PyAny>,
    k_pe: &Bound<'_, PyAny>,
    kv_c: &Bound<'_, PyAny>,
    cos_sin_cache: &Bound<'_, PyAny>,
    is_neox: bool,
    slot_mapping: &Bound<'_, PyAny>,
    kv_cache: &Bound<'_, PyAny>,
    kv_cache_dtype: &str,
    kv_cache_scale: &Bound<'_, PyAny>,
    rot_dim: usize,
    stream: u64,
    producer_sync: bool,
    pdl: bool,
) -> PyResult<()> {
    let dtype = CacheType::parse(kv_cache_dtype)?;
    // As in vLLM, a cache of the tensors' type ignores the scale.
    let scales = match dtype {
        CacheType::Auto => None,
        CacheType::Fp8(_) => Some(ScalesArg::Tensors(kv_cache_scale, kv_cache_scale)),
        CacheType::Nvfp4 => {
            return Err(PyValueError::new_err(
                "kv_cache_dtype: MLA's latent cache is bf16, float16 or FP8 here; NVFP4 caches \
                 are GQA/MHA caches (rotary_embedding, fused_qk_norm_rope)",
            ));
        }
    };
    // kv_c's features: the latent part's width, its columns first in each kv_cache row.
    let kv_lora_rank = kv_c
        .getattr(pyo3::intern!(kv_c.py(), "shape"))
        .and_then(|s| s.get_item(-1))
        .and_then(|n| n.extract::<usize>())
        .map_err(|_| {
            PyValueError::new_err("kv_c must be a tensor [num_tokens, kv_lora_rank] with a shape")
        })?;
    fused::launch(FusedLaunch {
        tensors: FusedTensors::Separate {
            query: q_pe,
            key: k_pe,
            value: None,
        },
        head_size: rot_dim,
        norm: None,
        norm_scope: rope_host::NormScope::PerHead,
        positions,
        axes: None,
        cos_sin_cache,
        style: pairing(is_neox),
        cache: Some(CacheArg {
            key_cache: kv_cache,
            value_cache: kv_cache,
            address: AddressArg::Slots(slot_mapping),
            dtype,
            scales,
            heads_first: false,
            page_size: None,
            non_rotary: Some(CacheNopeArg::LatentColumns(kv_c, kv_lora_rank)),
        }),
        names: VLLM_MLA_NAMES,
        stream,
        producer_sync,
        overlap: overlap(pdl),
    })
}

/// SGLang's `apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size,
/// cos_sin_cache, is_neox=True, fused_set_kv_buffer_arg=None)` (FlashInfer's without the last
/// argument): rotates query and key in place as `rotary_embedding` does; with
/// `fused_set_kv_buffer_arg` (an object with `value`, `k_buffer`, `v_buffer`, `cache_loc`,
/// `k_scale` and `v_scale`, as SGLang's `FusedSetKVBufferArg`) it also writes the rotated key
/// and `value` into SGLang's token pool in the same launch: token `t`'s heads go to row
/// `cache_loc[t]` of `k_buffer` and `v_buffer` (`[pool_size, num_kv_heads * head_size]` or
/// `[pool_size, num_kv_heads, head_size]`, the tensors' dtype; `cache_loc` int64 or int32
/// `[num_tokens]`, a negative entry writes nothing). As in SGLang's kernel, `k_scale` and
/// `v_scale` must be None.
///
/// Launched as `rotary_embedding`; raises as `apply_rope` does.
#[pyfunction]
#[pyo3(signature = (
    positions, query, key, head_size, cos_sin_cache, is_neox=true, fused_set_kv_buffer_arg=None,
    stream=0, producer_sync=true, pdl=false
))]
#[allow(clippy::too_many_arguments)]
fn apply_rope_with_cos_sin_cache_inplace<'py>(
    positions: &Bound<'py, PyAny>,
    query: &Bound<'py, PyAny>,
    key: Option<&Bound<'py, PyAny>>,
    head_size: usize,
    cos_sin_cache: &Bound<'py, PyAny>,
    is_neox: bool,
    fused_set_kv_buffer_arg: Option<&Bound<'py, PyAny>>,
    stream: u64,
    producer_sync: bool,
    pdl: bool,
) -> PyResult<()> {
    let Some(arg) = fused_set_kv_buffer_arg.filter(|a| !a.is_none()) else {
        return rotary_embedding(
            positions,
            query,
            key,
            head_size,
            cos_sin_cache,
            is_neox,
            None,
            None,
            None,
            None,
            "auto",
            None,
            None,
            stream,
            producer_sync,
            pdl,
        );
    };
    let field = |name: &Bound<'py, PyString>| -> PyResult<Bound<'py, PyAny>> {
        arg.getattr(name).map_err(|_| {
            PyTypeError::new_err(format!(
                "fused_set_kv_buffer_arg must have value, k_buffer, v_buffer and cache_loc (as \
                 SGLang's FusedSetKVBufferArg); it has no {name}"
            ))
        })
    };
    let py = arg.py();
    let (value, k_buffer, v_buffer, cache_loc) = (
        field(pyo3::intern!(py, "value"))?,
        field(pyo3::intern!(py, "k_buffer"))?,
        field(pyo3::intern!(py, "v_buffer"))?,
        field(pyo3::intern!(py, "cache_loc"))?,
    );
    let scales = [
        ("k_scale", pyo3::intern!(py, "k_scale")),
        ("v_scale", pyo3::intern!(py, "v_scale")),
    ];
    for (scale, attr) in scales {
        if arg.getattr(attr).is_ok_and(|s| !s.is_none()) {
            return Err(PyValueError::new_err(format!(
                "fused_set_kv_buffer_arg.{scale} must be None (as in SGLang's kernel): the pool \
                 stores the tensors' dtype"
            )));
        }
    }
    let Some(key) = key else {
        return Err(PyValueError::new_err(
            "key: fused_set_kv_buffer_arg writes the rotated key; give it",
        ));
    };
    const OTHER: [(&str, &str); 7] = [
        ("v", "fused_set_kv_buffer_arg.value"),
        ("config", "cos_sin_cache"),
        ("cache", "fused_set_kv_buffer_arg.k_buffer"),
        ("cache.k", "fused_set_kv_buffer_arg.k_buffer"),
        ("cache.v", "fused_set_kv_buffer_arg.v_buffer"),
        ("cache.layout", "fused_set_kv_buffer_arg.k_buffer"),
        ("cache.slot_mapping", "fused_set_kv_buffer_arg.cache_loc"),
    ];
    fused::launch(FusedLaunch {
        tensors: FusedTensors::Separate {
            query,
            key,
            value: Some(&value),
        },
        head_size,
        norm: None,
        norm_scope: rope_host::NormScope::PerHead,
        positions,
        axes: None,
        cos_sin_cache,
        style: pairing(is_neox),
        cache: Some(CacheArg {
            key_cache: &k_buffer,
            value_cache: &v_buffer,
            address: AddressArg::Slots(&cache_loc),
            dtype: CacheType::Auto,
            scales: None,
            heads_first: false,
            page_size: None,
            non_rotary: None,
        }),
        names: Names {
            other: &OTHER,
            ..VLLM_NAMES
        },
        stream,
        producer_sync,
        overlap: overlap(pdl),
    })
}

/// `rope_rs.apply_rope_with_cos_sin_cache_inplace`'s eager call for `torch.Tensor`s: as
/// [`apply_rope_with_cos_sin_cache_inplace`], on `stream` if given (the producers then order
/// their writes before it), else on PyTorch's current stream, found by the DLPack exchange API.
/// Returns whether it launched: false, launching nothing, for a producer without that API (the
/// wrapper finds the stream).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn _apply_rope_with_cos_sin_cache_inplace_eager(
    positions: &Bound<'_, PyAny>,
    query: &Bound<'_, PyAny>,
    key: Option<&Bound<'_, PyAny>>,
    head_size: usize,
    cos_sin_cache: &Bound<'_, PyAny>,
    is_neox: bool,
    fused_set_kv_buffer_arg: Option<&Bound<'_, PyAny>>,
    pdl: bool,
    stream: Option<u64>,
) -> PyResult<bool> {
    let Some((_, (stream, producer_sync))) = Held::eager(query, "query", stream)? else {
        return Ok(false);
    };
    apply_rope_with_cos_sin_cache_inplace(
        positions,
        query,
        key,
        head_size,
        cos_sin_cache,
        is_neox,
        fused_set_kv_buffer_arg,
        stream,
        producer_sync,
        pdl,
    )?;
    Ok(true)
}

/// vLLM's `fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps,
/// q_weight, k_weight, cos_sin_cache, is_neox, position_ids)`: in place on the packed
/// `qkv [num_tokens, (num_heads_q + num_heads_k + num_heads_v) * head_dim]` (any row stride,
/// contiguous rows), each q and k head is RMS-normalised,
/// `x / sqrt(mean(x^2) + eps) * weight` (`q_weight`, `k_weight`: `[head_dim]` of qkv's dtype),
/// then rotated at `position_ids [num_tokens]` (int32/int64) with `cos_sin_cache
/// [max_position, rotary_dim]` (cos half, then sin half; float32 or qkv's dtype; the first
/// `rotary_dim` features of each head rotate, those past them are normalised only), computed
/// in float32 and rounded once; v is untouched.
///
/// With `key_cache`, `value_cache` and `slot_mapping` (and `kv_cache_dtype`, `k_scale`,
/// `v_scale`), the rotated k and v also go into vLLM's paged KV cache in the same launch, as
/// `rotary_embedding` describes. With `mrope_section` (and `mrope_interleaved`), as
/// `apply_rope`'s, `position_ids` is mRoPE's `[3, num_tokens]` (Qwen3-VL's QK-norm with
/// interleaved mRoPE).
///
/// Launched as `rotary_embedding`; raises as `apply_rope` does.
#[pyfunction]
#[pyo3(signature = (
    qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
    cos_sin_cache, is_neox, position_ids, key_cache=None, value_cache=None,
    slot_mapping=None, kv_cache_dtype="auto", k_scale=None, v_scale=None, stream=0,
    producer_sync=true, pdl=false, mrope_section=None, mrope_interleaved=false
))]
#[allow(clippy::too_many_arguments)]
fn fused_qk_norm_rope(
    qkv: &Bound<'_, PyAny>,
    num_heads_q: usize,
    num_heads_k: usize,
    num_heads_v: usize,
    head_dim: usize,
    eps: f64,
    q_weight: &Bound<'_, PyAny>,
    k_weight: &Bound<'_, PyAny>,
    cos_sin_cache: &Bound<'_, PyAny>,
    is_neox: bool,
    position_ids: &Bound<'_, PyAny>,
    key_cache: Option<&Bound<'_, PyAny>>,
    value_cache: Option<&Bound<'_, PyAny>>,
    slot_mapping: Option<&Bound<'_, PyAny>>,
    kv_cache_dtype: &str,
    k_scale: Option<&Bound<'_, PyAny>>,
    v_scale: Option<&Bound<'_, PyAny>>,
    stream: u64,
    producer_sync: bool,
    pdl: bool,
    mrope_section: Option<Vec<u32>>,
    mrope_interleaved: bool,
) -> PyResult<()> {
    let cache = cache_arg(
        (key_cache, value_cache, slot_mapping),
        kv_cache_dtype,
        (k_scale, v_scale),
    )?;
    let axes = options::axes(
        mrope_section.as_deref(),
        mrope_interleaved,
        None,
        PositionsKind::Ids,
    )
    .map_err(arg_error)?;
    const OTHER: [(&str, &str); 14] = [
        ("v", "qkv"),
        ("layout", "qkv"),
        ("norm", "head_dim"),
        ("norm.eps", "eps"),
        ("norm.q_weight", "q_weight"),
        ("norm.k_weight", "k_weight"),
        ("config", "cos_sin_cache"),
        ("cache", "key_cache"),
        VLLM_CACHE_NAMES[0],
        VLLM_CACHE_NAMES[1],
        VLLM_CACHE_NAMES[2],
        VLLM_CACHE_NAMES[3],
        VLLM_CACHE_NAMES[4],
        VLLM_CACHE_NAMES[5],
    ];
    fused::launch(FusedLaunch {
        tensors: FusedTensors::Packed {
            qkv,
            heads: [num_heads_q, num_heads_k, num_heads_v],
        },
        head_size: head_dim,
        norm: Some((q_weight, k_weight, eps, NormWeight::Plain)),
        norm_scope: rope_host::NormScope::PerHead,
        positions: position_ids,
        axes,
        cos_sin_cache,
        style: pairing(is_neox),
        cache,
        names: Names {
            q: "qkv",
            k: "qkv",
            out: "qkv",
            k_out: "qkv",
            positions: "position_ids",
            sincos: "cos_sin_cache",
            other: &OTHER,
        },
        stream,
        producer_sync,
        overlap: overlap(pdl),
    })
}

/// The frequencies `apply_rope` computes sin/cos from for `theta=`, `scaling=`,
/// `rotary_dim=` and `angle=` on heads of `head_dim` elements: `(inv_freq, attention_factor)`,
/// `rotary_dim / 2` floats computed on the host in float64 by rope-host (nothing touches the
/// GPU). The kernels form angles `p * inv_freq[i]` and multiply cos and sin by
/// `attention_factor`.
///
/// Raises TypeError and ValueError as `apply_rope` does for these arguments.
#[pyfunction]
#[pyo3(signature = (head_dim, *, theta=None, scaling=None, rotary_dim=None, angle=None))]
fn frequencies(
    head_dim: u32,
    theta: Option<f64>,
    scaling: Option<&Bound<'_, PyAny>>,
    rotary_dim: Option<u32>,
    angle: Option<&str>,
) -> PyResult<(Vec<f64>, f64)> {
    let angle = parse_angle(angle)?;
    let spec = match scaling {
        Some(s) => {
            let base = ConfigBase {
                theta,
                head_dim,
                rotary_dim,
                angle,
            };
            scaling_given(s)?.spec(base).map_err(same_name_error)?
        }
        None => FrequencySpec::new(
            theta.unwrap_or(DEFAULT_THETA),
            rotary_dim.unwrap_or(head_dim),
        )
        .angle(angle),
    };
    spec.build().map_err(|e| Names::APPLY_ROPE.host_error(e))
}

/// The current work stream of the producer of `tensor` on its CUDA device, by the DLPack C
/// exchange API of its type (`torch.cuda.current_stream(device).cuda_stream` for a
/// `torch.Tensor`, without building a stream object): a `CUstream` as an int (0: the legacy
/// default stream), or None when the type has no usable exchange API (or it is switched off),
/// `tensor` is not on a CUDA device, or the producer failed.
#[pyfunction]
fn _current_stream(tensor: &Bound<'_, PyAny>) -> Option<u64> {
    exchange::types::current_stream(tensor)
}

/// Whether `tensor`'s type has a DLPack C exchange API that rope_rs uses (major version 1,
/// with `dltensor_from_py_object_no_sync`), and it is switched on: then launches that need no
/// producer synchronization (`producer_sync=False`) borrow `tensor` through it.
#[pyfunction]
fn _exchange_api_used(tensor: &Bound<'_, PyAny>) -> bool {
    exchange::types::api_of(tensor).is_some()
}

/// Switches the DLPack C exchange API on or off for this process (tests; the environment
/// variable `ROPE_RS_NO_DLPACK_C_API=1` switches it off from the start); returns whether it was
/// on.
#[pyfunction]
fn _set_exchange_api(enabled: bool) -> bool {
    exchange::types::set_enabled(enabled)
}

/// How many tensors were borrowed through the DLPack C exchange API in this process (tests).
#[pyfunction]
fn _exchange_borrows() -> u64 {
    exchange::types::fast_borrows()
}

/// `_dlpack_view`'s answer: address, dtype, shape, strides, device.
type DlpackView = (u64, &'static str, Vec<usize>, Vec<usize>, i32);

/// What a launch reads of `tensor` (named `arg` in errors), borrowed as a launch with
/// `producer_sync` borrows it: `(address, dtype, shape, strides, device)` (tests).
#[pyfunction]
#[pyo3(signature = (tensor, *, producer_sync, arg="tensor"))]
fn _dlpack_view(tensor: &Bound<'_, PyAny>, producer_sync: bool, arg: &str) -> PyResult<DlpackView> {
    let d = launch::describe(tensor, arg, producer_sync)?;
    Ok((
        d.ptr,
        d.elem.name(),
        d.shape.to_vec(),
        d.strides.to_vec(),
        d.device_id,
    ))
}

/// Adds this module's functions and constants to `rope_rs._native`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(apply_rope, m)?)?;
    m.add_function(wrap_pyfunction!(rotary_embedding, m)?)?;
    m.add_function(wrap_pyfunction!(apply_rope_with_cos_sin_cache_inplace, m)?)?;
    m.add_function(wrap_pyfunction!(
        _apply_rope_with_cos_sin_cache_inplace_eager,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(fused_qk_norm_rope, m)?)?;
    m.add_function(wrap_pyfunction!(concat_and_cache_mla_rope_fused, m)?)?;
    m.add_function(wrap_pyfunction!(frequencies, m)?)?;
    m.add_function(wrap_pyfunction!(_current_stream, m)?)?;
    m.add_function(wrap_pyfunction!(_exchange_api_used, m)?)?;
    m.add_function(wrap_pyfunction!(_set_exchange_api, m)?)?;
    m.add_function(wrap_pyfunction!(_exchange_borrows, m)?)?;
    m.add_function(wrap_pyfunction!(_dlpack_view, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("SCALING_KEYS", ROPE_SCALING_KEYS.to_vec())?;
    Ok(())
}
