//! The extension module `rope_rs._native`: `apply_rope` and vLLM's `rotary_embedding`.
//!
//! Each call borrows its tensors through DLPack (`__dlpack_device__`, then `__dlpack__(stream=)`),
//! validates them (here and in rope-host), launches once with [`Rope::run_raw`] on the caller's
//! stream and releases the capsules after the launch is enqueued.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rope_host::cudarc::driver::sys::CUstream;
use rope_host::{
    Direction, Error, IdsShape, RawBuf, RawIo, RawOp, RawPositions, RawSinCos, RawTensor,
    RawTensors, Rope, RopeConfig, RopeStyle, open_device,
};

use crate::dlpack::{self, ArgError, DL_CUDA, DLManagedTensor, Dense};

/// One [`Rope`] per CUDA device, on its primary context (the one PyTorch uses).
static ROPES: Mutex<BTreeMap<i32, Arc<Rope>>> = Mutex::new(BTreeMap::new());

fn rope_for(device: i32) -> PyResult<Arc<Rope>> {
    let mut ropes = ROPES
        .lock()
        .map_err(|_| PyRuntimeError::new_err("rope_rs: a previous call panicked"))?;
    if let Some(rope) = ropes.get(&device) {
        return Ok(rope.clone());
    }
    let ordinal = usize::try_from(device)
        .map_err(|_| PyValueError::new_err(format!("invalid CUDA device {device}")))?;
    let ctx = open_device(ordinal).map_err(host_error)?;
    let rope = Arc::new(Rope::new(ctx.default_stream()).map_err(host_error)?);
    ropes.insert(device, rope.clone());
    Ok(rope)
}

/// rope-host's errors: invalid arguments become `ValueError("{arg}: {problem}")`, the driver's
/// `RuntimeError`.
fn host_error(e: Error) -> PyErr {
    match e {
        Error::Invalid { .. } => PyValueError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

fn arg_error(e: ArgError) -> PyErr {
    match e {
        ArgError::Type(m) => PyTypeError::new_err(m),
        ArgError::Value(m) => PyValueError::new_err(m),
    }
}

/// A tensor borrowed through DLPack: the capsule `__dlpack__` returned, kept (and with it the
/// producer's tensor) until this is dropped, and what was read from it.
///
/// The capsule is not consumed: it keeps the name `"dltensor"`, so its own destructor (the
/// producer's) calls the `DLManagedTensor`'s deleter when Python frees it, exactly once and
/// after the launch that used it was enqueued. (A consumer that keeps the tensor beyond the
/// capsule's life renames it `"used_dltensor"` and calls the deleter itself; rope_rs needs the
/// memory only until the kernel is enqueued on the stream that the producer ordered after its
/// own work, and stream order covers the rest.)
struct Borrowed<'py> {
    _capsule: Bound<'py, PyAny>,
    dense: Dense,
}

/// Borrows `obj` (named `arg` in errors) for use on `stream`.
fn borrow<'py>(obj: &Bound<'py, PyAny>, arg: &str, stream: u64) -> PyResult<Borrowed<'py>> {
    let py = obj.py();
    let not_dlpack = || {
        let ty = obj
            .get_type()
            .name()
            .map_or_else(|_| "?".to_owned(), |n| n.to_string());
        PyTypeError::new_err(format!(
            "{arg} must be a tensor supporting DLPack (__dlpack__ and __dlpack_device__), got {ty}"
        ))
    };
    if !obj.hasattr("__dlpack__")? {
        return Err(not_dlpack());
    }
    let device = obj
        .getattr("__dlpack_device__")
        .map_err(|_| not_dlpack())?
        .call0()?;
    let (device_type, device_id): (i32, i32) = device.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "{arg}.__dlpack_device__() must return (device_type, device_id)"
        ))
    })?;
    if device_type != DL_CUDA {
        return Err(PyValueError::new_err(format!(
            "{arg} must be a CUDA tensor (DLPack device type 2), got {}",
            dlpack::device_name(device_type)
        )));
    }
    // DLPack's stream argument for CUDA: 1 is the legacy default stream (0 is reserved as
    // ambiguous); the producer makes `stream` wait for the work that wrote the tensor.
    let kwargs = PyDict::new(py);
    kwargs.set_item("stream", if stream == 0 { 1 } else { stream })?;
    let capsule = obj.call_method("__dlpack__", (), Some(&kwargs))?;
    // SAFETY: `capsule` is a live Python object (we hold a reference); `PyCapsule_GetPointer`
    // checks that it is a capsule named "dltensor" and returns null with an exception set
    // otherwise.
    let managed = unsafe { pyo3::ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dltensor".as_ptr()) }
        as *const DLManagedTensor;
    if managed.is_null() {
        let _ = PyErr::take(py);
        return Err(PyTypeError::new_err(format!(
            "{arg}.__dlpack__() did not return an unused \"dltensor\" capsule"
        )));
    }
    // SAFETY: an unconsumed "dltensor" capsule points to a `DLManagedTensor` that stays valid
    // (its `shape` holding `ndim` extents, its `strides` null or as many) until the capsule's
    // destructor runs, which `Borrowed` postpones by holding the capsule.
    let dense = unsafe { dlpack::read(&(*managed).dl_tensor, arg) }.map_err(arg_error)?;
    if dense.device_id != device_id {
        return Err(PyValueError::new_err(format!(
            "{arg}: __dlpack_device__() says device {device_id}, the tensor says {}",
            dense.device_id
        )));
    }
    Ok(Borrowed {
        _capsule: capsule,
        dense,
    })
}

/// How q and k are seen as rope-host tensors.
#[derive(Clone, Copy)]
enum View {
    /// `[b, s, h, d]` or `[t, h, d]`.
    Rope,
    /// vLLM's `[t, h * head_size]` or `[t, h, head_size]`.
    Heads(usize),
}

impl View {
    fn tensor(self, d: &Dense, arg: &str) -> PyResult<RawTensor> {
        match self {
            Self::Rope => dlpack::rope_tensor(d, arg),
            Self::Heads(head_size) => dlpack::heads_tensor(d, head_size, arg),
        }
        .map_err(arg_error)
    }
}

/// Where positions come from.
enum PositionsArg<'a, 'py> {
    /// `p = offset + s`.
    Offset(u32),
    /// A CUDA tensor of ids, with its argument name.
    Ids(&'a Bound<'py, PyAny>, &'static str),
}

/// Where sin/cos come from.
enum SinCosArg<'a, 'py> {
    /// Computed in the kernel from `theta`.
    Theta(f64),
    /// Read from a combined `cos_sin_cache`.
    Cache(&'a Bound<'py, PyAny>),
}

/// One launch as the Python functions describe it.
struct Launch<'a, 'py> {
    q: (&'a Bound<'py, PyAny>, &'static str),
    k: Option<(&'a Bound<'py, PyAny>, &'static str)>,
    view: View,
    positions: PositionsArg<'a, 'py>,
    sincos: SinCosArg<'a, 'py>,
    style: RopeStyle,
    rotary_dim: Option<u32>,
    direction: Direction,
    stream: u64,
}

/// q and k for one launch: separate buffers, or, when their address ranges meet (views of one
/// fused QKV tensor, as PyTorch slices it), one buffer spanning both with each layout offset
/// into it, so that rope-host checks their disjointness element by element rather than by
/// address range.
fn qk_tensors(q: RawTensor, k: RawTensor, es: u64) -> RawTensors {
    let end = |t: &RawTensor| t.buf.ptr + t.buf.len as u64 * es;
    let meet = q.buf.ptr < end(&k) && k.buf.ptr < end(&q);
    let base = q.buf.ptr.min(k.buf.ptr);
    let aligned = (q.buf.ptr - base).is_multiple_of(es) && (k.buf.ptr - base).is_multiple_of(es);
    if !(meet && aligned) {
        return RawTensors::Separate {
            q: RawIo::InPlace(q),
            k: RawIo::InPlace(k),
        };
    }
    let offset = |t: &RawTensor| {
        let delta = ((t.buf.ptr - base) / es) as usize;
        t.layout.with_offset(t.layout.offset() + delta)
    };
    RawTensors::Fused {
        buf: RawBuf {
            ptr: base,
            len: ((end(&q).max(end(&k)) - base) / es) as usize,
        },
        q: offset(&q),
        k: offset(&k),
    }
}

fn launch(l: Launch<'_, '_>) -> PyResult<()> {
    let (q_obj, q_name) = l.q;
    let q = borrow(q_obj, q_name, l.stream)?;
    let device = q.dense.device_id;
    let Some(dtype) = q.dense.elem.float() else {
        return Err(PyValueError::new_err(format!(
            "{q_name} must be float32, float16 or bfloat16, got {}",
            q.dense.elem.name()
        )));
    };
    let q_tensor = l.view.tensor(&q.dense, q_name)?;
    let same_device = |b: &Borrowed<'_>, name: &str| {
        if b.dense.device_id == device {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!(
                "{name} is on CUDA device {}, {q_name} on device {device}",
                b.dense.device_id
            )))
        }
    };
    let k = match l.k {
        Some((obj, name)) => {
            let k = borrow(obj, name, l.stream)?;
            same_device(&k, name)?;
            if k.dense.elem != q.dense.elem {
                return Err(PyValueError::new_err(format!(
                    "{name} is {}, {q_name} is {}",
                    k.dense.elem.name(),
                    q.dense.elem.name()
                )));
            }
            let tensor = l.view.tensor(&k.dense, name)?;
            Some((k, tensor))
        }
        None => None,
    };
    let (positions, _ids) = match l.positions {
        PositionsArg::Offset(offset) => (RawPositions::Offset(offset), None),
        PositionsArg::Ids(obj, name) => {
            let ids = borrow(obj, name, l.stream)?;
            same_device(&ids, name)?;
            let shape = if ids.dense.shape.len() == 2 {
                IdsShape::PerRow
            } else {
                IdsShape::Shared
            };
            let raw = dlpack::ints(&ids.dense, name).map_err(arg_error)?;
            (RawPositions::Ids { ids: raw, shape }, Some(ids))
        }
    };
    let (sincos, rotary_dim, _cache) = match l.sincos {
        SinCosArg::Theta(theta) => (RawSinCos::Computed { theta }, l.rotary_dim, None),
        SinCosArg::Cache(obj) => {
            let cache = borrow(obj, "cos_sin_cache", l.stream)?;
            same_device(&cache, "cos_sin_cache")?;
            let (buf, cache_dtype, shape) =
                dlpack::cos_sin_cache(&cache.dense, "cos_sin_cache").map_err(arg_error)?;
            if cache_dtype != dtype && cache_dtype != rope_host::DType::F32 {
                return Err(PyValueError::new_err(format!(
                    "cos_sin_cache must be float32 or {q_name}'s {}, got {}",
                    q.dense.elem.name(),
                    cache.dense.elem.name()
                )));
            }
            let sincos = RawSinCos::CosSinCache {
                cache: buf,
                dtype: cache_dtype,
                shape,
            };
            (sincos, l.rotary_dim.or(Some(shape.rotary_dim)), Some(cache))
        }
    };
    let head_dim = u32::try_from(q_tensor.layout.head_dim()).map_err(|_| {
        PyValueError::new_err(format!(
            "{q_name} has heads of {} elements",
            q_tensor.layout.head_dim()
        ))
    })?;
    let mut config = RopeConfig::builder(head_dim, l.style).direction(l.direction);
    if let Some(r) = rotary_dim {
        config = config.rotary_dim(r);
    }
    let op = RawOp {
        config: config.build().map_err(host_error)?,
        dtype,
        positions,
        sincos,
    };
    let tensors = match &k {
        None => RawTensors::Q(RawIo::InPlace(q_tensor)),
        Some((_, k_tensor)) => qk_tensors(q_tensor, *k_tensor, dtype.size() as u64),
    };
    let rope = rope_for(device)?;
    if let RawSinCos::Computed { theta } = op.sincos {
        // Other streams may read only prepared frequencies (`run_raw`'s `# Safety`).
        rope.prepare(theta, op.config.rotary_dim())
            .map_err(host_error)?;
    }
    let stream = l.stream as usize as CUstream;
    // SAFETY: `run_raw`'s promises, and who keeps them:
    // - every address is memory of CUDA device `device` (DLPack said so, checked for each
    //   tensor above), and `rope` runs on that device's primary context, the context CUDA
    //   runtime users (PyTorch) allocate in; `stream` is a stream of that context: the Python
    //   caller's promise, documented on `apply_rope` and `rotary_embedding`;
    // - each buffer holds the elements given: `dlpack.rs` sized every buffer from the
    //   producer's own shape and strides, ending after the last addressed element, with the
    //   producer's element type;
    // - the capsules (`q`, `k`, `_ids`, `_cache`) keep the producers' tensors alive until this
    //   returns, after the launch is enqueued; after that, keeping them allocated until the
    //   kernel finishes on `stream` is the caller's promise (PyTorch's allocator reuses memory
    //   in the order of the tensor's stream, or after `record_stream`);
    // - the producers made `stream` wait for the work that wrote the tensors (`__dlpack__`'s
    //   `stream=`), and the caller promises that nothing else touches q and k meanwhile;
    // - `Computed` frequencies were prepared above, complete before any launch reads them.
    unsafe { rope.run_raw(&op, tensors, stream) }.map_err(host_error)?;
    drop(k);
    drop(q);
    Ok(())
}

fn parse_style(style: &str) -> PyResult<RopeStyle> {
    match style {
        "neox" => Ok(RopeStyle::Neox),
        "interleaved" => Ok(RopeStyle::Interleaved),
        other => Err(PyValueError::new_err(format!(
            "style must be \"neox\" or \"interleaved\", got {other:?}"
        ))),
    }
}

/// Rotates q (and k) in place by rotary position embedding (RoPE), on the GPU.
///
/// q and k are CUDA tensors (any object with `__dlpack__` and `__dlpack_device__`, such as a
/// `torch.Tensor`) of float32, float16 or bfloat16, shaped `[batch, seq, heads, head_dim]` or
/// `[tokens, heads, head_dim]`, with any strides but a contiguous last dimension; k has q's
/// dtype, batch and seq, and may have other heads.
///
/// Positions: token `s` is at `positions + s` (an int, default 0), or at
/// `position_ids[s]` (`[seq]`) or `position_ids[b, s]` (`[batch, seq]`), a CUDA int32 or int64
/// tensor. sin/cos: computed in the kernel from `theta` (`inv_freq_i = theta^(-2i/rotary_dim)`),
/// or read from `cos_sin_cache` `[max_position, rotary_dim]` (cos half, then sin half; float32
/// or q's dtype; then `theta` is unused and `rotary_dim` defaults to its width). `style` is
/// "neox" (pairs `(x[i], x[i + r/2])`) or "interleaved" (pairs `(x[2i], x[2i+1])`);
/// `rotary_dim` (default head_dim) rotates the first `rotary_dim` features only; `backward`
/// applies the inverse rotation (the gradient).
///
/// The kernel is launched asynchronously on `stream`, a `CUstream` handle as an int (for
/// PyTorch `torch.cuda.current_stream().cuda_stream`; 0, the default, is the legacy default
/// stream). The caller guarantees that `stream` belongs to the tensors' device (its primary
/// context, as PyTorch's streams do), that the tensors stay allocated until the kernel has run
/// on `stream` (PyTorch does this for tensors used on their own stream; otherwise call
/// `tensor.record_stream`), and that nothing else writes them or reads q and k meanwhile.
///
/// Raises TypeError for an argument of the wrong Python type (not DLPack), ValueError naming
/// the argument for an invalid tensor or option (nothing is launched then), RuntimeError when
/// the CUDA driver fails.
#[pyfunction]
#[pyo3(signature = (q, k=None, *, positions=None, position_ids=None, style="neox", theta=10000.0, cos_sin_cache=None, rotary_dim=None, backward=false, stream=0))]
#[allow(clippy::too_many_arguments)]
fn apply_rope(
    q: &Bound<'_, PyAny>,
    k: Option<&Bound<'_, PyAny>>,
    positions: Option<i64>,
    position_ids: Option<&Bound<'_, PyAny>>,
    style: &str,
    theta: f64,
    cos_sin_cache: Option<&Bound<'_, PyAny>>,
    rotary_dim: Option<u32>,
    backward: bool,
    stream: u64,
) -> PyResult<()> {
    let positions = match (positions, position_ids) {
        (Some(_), Some(_)) => {
            return Err(PyValueError::new_err(
                "give positions (an offset) or position_ids, not both",
            ));
        }
        (_, Some(ids)) => PositionsArg::Ids(ids, "position_ids"),
        (offset, None) => {
            let offset = offset.unwrap_or(0);
            PositionsArg::Offset(u32::try_from(offset).map_err(|_| {
                PyValueError::new_err(format!(
                    "positions must be an offset in 0..2^32, got {offset}"
                ))
            })?)
        }
    };
    launch(Launch {
        q: (q, "q"),
        k: k.map(|k| (k, "k")),
        view: View::Rope,
        positions,
        sincos: cos_sin_cache.map_or(SinCosArg::Theta(theta), SinCosArg::Cache),
        style: parse_style(style)?,
        rotary_dim,
        direction: if backward {
            Direction::Backward
        } else {
            Direction::Forward
        },
        stream,
    })
}

/// vLLM's `rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)`: rotates
/// query and key in place.
///
/// `positions` is a CUDA int32/int64 tensor `[num_tokens]`; `query` and `key` are
/// `[num_tokens, num_heads * head_size]` (or `[num_tokens, num_heads, head_size]`) with a
/// contiguous last dimension, `key` may be None; `cos_sin_cache` is `[max_position,
/// rotary_dim]` (cos half, then sin half) in float32 or query's dtype; `is_neox` picks
/// rotate-half pairs (else interleaved). The first `rotary_dim` features of each head rotate.
///
/// Launched asynchronously on `stream` (a `CUstream` handle as an int; 0, the default, is the
/// legacy default stream; vLLM's own op uses `torch.cuda.current_stream()`), with the caller's
/// guarantees of `apply_rope`. Raises as `apply_rope` does.
#[pyfunction]
#[pyo3(signature = (positions, query, key, head_size, cos_sin_cache, is_neox, *, stream=0))]
fn rotary_embedding(
    positions: &Bound<'_, PyAny>,
    query: &Bound<'_, PyAny>,
    key: Option<&Bound<'_, PyAny>>,
    head_size: usize,
    cos_sin_cache: &Bound<'_, PyAny>,
    is_neox: bool,
    stream: u64,
) -> PyResult<()> {
    launch(Launch {
        q: (query, "query"),
        k: key.map(|k| (k, "key")),
        view: View::Heads(head_size),
        positions: PositionsArg::Ids(positions, "positions"),
        sincos: SinCosArg::Cache(cos_sin_cache),
        style: if is_neox {
            RopeStyle::Neox
        } else {
            RopeStyle::Interleaved
        },
        rotary_dim: None,
        direction: Direction::Forward,
        stream,
    })
}

/// rope-rs: rotary position embedding on NVIDIA GPUs, kernels written in Rust; tensors by
/// DLPack.
#[pymodule]
#[pyo3(name = "_native")]
fn native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(apply_rope, m)?)?;
    m.add_function(wrap_pyfunction!(rotary_embedding, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
