//! One launch from Python objects: each tensor borrowed through DLPack (its type's C exchange
//! API when the launch needs no synchronization, else `__dlpack_device__`, then
//! `__dlpack__(stream=)`), read into rope-host's raw forms, checked against the others, and
//! launched once with [`Rope::run_raw`] on the caller's stream; the capsules (or tensor
//! objects) are released after the launch is enqueued.
//!
//! What persists between calls (one [`Rope`] per device, the frequency vectors launches read)
//! is rope-host's [`rope_host::shared`].

use std::sync::Arc;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rope_host::cudarc::driver::sys::CUstream;
use rope_host::{
    AngleMode, AxisMap, ConfigBase, ConfigValue, ContextParallel, DType, Direction, Error,
    Frequencies, FrequencySpec, IdsShape, Layout, RawBuf, RawInts, RawIo, RawOp, RawPositions,
    RawSinCos, RawTensor, RawTensors, Rope, RopeConfig, RopeStyle, StreamOverlap, shared,
};

use crate::dlpack::{self, ArgError, DL_CUDA, DLManagedTensor, Dense, Elem, TensorLayout};
use crate::exchange;
use crate::options::Axes;

/// The process's [`Rope`] for CUDA device `device` with `overlap` ([`shared::primary`]).
pub(crate) fn rope_for(device: i32, overlap: StreamOverlap) -> PyResult<Arc<Rope>> {
    let ordinal = usize::try_from(device)
        .map_err(|_| PyValueError::new_err(format!("invalid CUDA device {device}")))?;
    shared::primary(ordinal, overlap).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// The Python names of a launch's arguments, for messages: rope-host names its arguments
/// `q`, `q.output`, `k`, `k.output`, `positions`, `sincos`, `sincos.cos` and `sincos.sin`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Names {
    /// The tensor rope-host calls `q`.
    pub q: &'static str,
    /// `k`.
    pub k: &'static str,
    /// `q.output`.
    pub out: &'static str,
    /// `k.output`.
    pub k_out: &'static str,
    /// `positions`.
    pub positions: &'static str,
    /// `sincos`.
    pub sincos: &'static str,
    /// Any other rope-host argument's Python name (the fused launches': `v`, `norm.q_weight`,
    /// `cache.k`, ...), consulted first.
    pub other: &'static [(&'static str, &'static str)],
}

impl Names {
    /// `apply_rope`'s names; `positions` and `sincos` are set from the arguments given.
    pub const APPLY_ROPE: Self = Self {
        q: "q",
        k: "k",
        out: "out",
        k_out: "k_out",
        positions: "positions",
        sincos: "theta",
        other: &[],
    };

    /// The Python name of rope-host's argument `arg`.
    pub(crate) fn python_name(&self, arg: &'static str) -> &'static str {
        if let Some((_, name)) = self.other.iter().find(|(a, _)| *a == arg) {
            return name;
        }
        match arg {
            "q" => self.q,
            "q.output" => self.out,
            "k" => self.k,
            "k.output" => self.k_out,
            "positions" => self.positions,
            "sincos" => self.sincos,
            "sincos.cos" => "cos",
            "sincos.sin" => "sin",
            other => other,
        }
    }

    /// rope-host's error as a Python exception: invalid arguments become
    /// `ValueError("{python name}: {problem}")`, arguments of the wrong type `TypeError`, the
    /// driver's `RuntimeError`.
    pub fn host_error(&self, e: Error) -> PyErr {
        match e {
            Error::Invalid { arg, problem } => {
                PyValueError::new_err(format!("{}: {problem}", self.python_name(arg)))
            }
            Error::WrongType { arg, problem } => {
                PyTypeError::new_err(format!("{}: {problem}", self.python_name(arg)))
            }
            other => PyRuntimeError::new_err(other.to_string()),
        }
    }
}

/// rope-host's error as a Python exception, for arguments named in Python as in rope-host
/// (`scaling`, `theta`, `rotary_dim`): as [`ArgNames::host_error`].
pub(crate) fn same_name_error(e: Error) -> PyErr {
    match e {
        Error::Invalid { arg, problem } => PyValueError::new_err(format!("{arg}: {problem}")),
        Error::WrongType { arg, problem } => PyTypeError::new_err(format!("{arg}: {problem}")),
        other => PyRuntimeError::new_err(other.to_string()),
    }
}

/// An argument problem as a Python exception.
pub(crate) fn arg_error(e: ArgError) -> PyErr {
    match e {
        ArgError::Type(m) => PyTypeError::new_err(m),
        ArgError::Value(m) => PyValueError::new_err(m),
    }
}

/// A tensor borrowed through DLPack, and what was read from it.
///
/// Through `__dlpack__`, `_keep` is the capsule it returned, kept (and with it the producer's
/// tensor) until this is dropped. The capsule is not consumed: it keeps the name `"dltensor"`,
/// so its own destructor (the producer's) calls the `DLManagedTensor`'s deleter when Python
/// frees it, exactly once and after the launch that used it was enqueued. (A consumer that
/// keeps the tensor beyond the capsule's life renames it `"used_dltensor"` and calls the deleter
/// itself; rope_rs needs the memory only until the kernel is enqueued on the stream that the
/// producer ordered after its own work, and stream order covers the rest.)
///
/// Through the DLPack C exchange API (`exchange.rs`), `_keep` is the tensor object itself: the
/// producer's non-owning description stays valid while the object lives, unchanged (the GIL is
/// held from the read to the launch, so no Python code runs in between).
struct Borrowed<'py> {
    _keep: Bound<'py, PyAny>,
    dense: Dense,
    /// The address of the object borrowed (the argument, not the capsule): a second borrow of
    /// it in the same launch reads it again from here.
    source: usize,
}

/// The `stream=` argument of `__dlpack__` for a launch on `stream`: DLPack's number for it (1
/// for the legacy default stream, since 0 is reserved as ambiguous), so that the producer
/// orders its pending writes of the tensor before `stream`; or -1 ("no synchronization") when
/// the caller has ordered them itself (`producer_sync=False`).
pub(crate) fn dlpack_stream(stream: u64, producer_sync: bool) -> i64 {
    match (producer_sync, stream) {
        (false, _) => -1,
        (true, 0) => 1,
        (true, s) => s as i64,
    }
}

/// Borrows `obj` (named `arg` in errors): through its type's DLPack C exchange API when it has
/// one and no synchronization is asked (`dlpack_stream` -1, as the exchange API's "no_sync"
/// functions do none), else through `__dlpack__(stream=dlpack_stream)`.
fn borrow<'py>(obj: &Bound<'py, PyAny>, arg: &str, dlpack_stream: i64) -> PyResult<Borrowed<'py>> {
    if dlpack_stream == -1
        && let Some(api) = exchange::types::api_of(obj)
    {
        // SAFETY: `obj` is a live object (we hold a reference) of the type whose
        // `__dlpack_c_exchange_api__` gave `api`, and we hold the GIL.
        if let Some(t) = unsafe { api.dltensor(obj.as_ptr().cast()) } {
            // SAFETY: the producer filled `t` for `obj`, which we hold: its `shape` points to
            // `ndim` extents and its `strides` to as many (or null), valid while `obj` lives
            // unchanged, and `read` copies them before returning.
            let dense = unsafe { dlpack::read(&t, arg) }.map_err(arg_error)?;
            exchange::types::count_fast_borrow();
            return Ok(Borrowed {
                _keep: obj.clone(),
                dense,
                source: obj.as_ptr() as usize,
            });
        }
        // The producer could not describe `obj` (an exception is set): `__dlpack__` decides,
        // with the errors it has always raised.
        let _ = PyErr::take(obj.py());
    }
    borrow_capsule(obj, arg, dlpack_stream)
}

/// Borrows `obj` (named `arg` in errors), passing `dlpack_stream` to its `__dlpack__`.
fn borrow_capsule<'py>(
    obj: &Bound<'py, PyAny>,
    arg: &str,
    dlpack_stream: i64,
) -> PyResult<Borrowed<'py>> {
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
    let kwargs = PyDict::new(py);
    kwargs.set_item("stream", dlpack_stream)?;
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
        _keep: capsule,
        dense,
        source: obj.as_ptr() as usize,
    })
}

/// What a launch reads of `obj` (named `arg`): borrowed as a launch with `producer_sync`
/// borrows it (on PyTorch's current stream, `producer_sync=False`), then released. For tests
/// that compare the exchange API's description with `__dlpack__`'s.
pub(crate) fn describe(obj: &Bound<'_, PyAny>, arg: &str, producer_sync: bool) -> PyResult<Dense> {
    // The stream only matters to `__dlpack__` with producer_sync: the legacy default stream.
    borrow(obj, arg, dlpack_stream(0, producer_sync)).map(|b| b.dense)
}

/// How the tensors to rotate are seen as rope-host tensors.
#[derive(Clone, Copy)]
pub(crate) enum View {
    /// By rank and `layout=`: `[b, s, h, d]`, `[s, b, h, d]`, `[b, h, s, d]` or `[t, h, d]`.
    Rope(Option<TensorLayout>),
    /// vLLM's and FlashInfer's `[t, h * head_size]` or `[t, h, head_size]`.
    Heads(usize),
}

impl View {
    fn tensor(self, d: &Dense, arg: &str) -> PyResult<RawTensor> {
        match self {
            Self::Rope(layout) => dlpack::rope_tensor(d, layout, arg),
            Self::Heads(head_size) => dlpack::heads_tensor(d, head_size, arg),
        }
        .map_err(arg_error)
    }
}

/// Where positions come from, with the tensors still to borrow.
pub(crate) enum PositionsArg<'a, 'py> {
    /// `p = offset + s`.
    Offset(u32),
    /// `p = offsets[b] + s`: a tensor `[batch]`.
    RowOffsets(&'a Bound<'py, PyAny>),
    /// `p = ids[s]` (`[seq]`) or `ids[b, s]` (`[batch, seq]`).
    Ids(&'a Bound<'py, PyAny>),
    /// Per-axis positions: pair `i` of token `t` at `ids[axis(i), t]` (`[n_axes, batch, seq]`
    /// or `[n_axes, tokens]`).
    MultiAxis {
        /// The positions of each axis.
        ids: &'a Bound<'py, PyAny>,
        /// Which axis each pair takes.
        axes: Axes,
    },
    /// Packed sequences: `cu_seqlens [num_seqs + 1]` and optional offsets `[num_seqs]`.
    Varlen {
        /// Cumulative sequence lengths.
        cu_seqlens: &'a Bound<'py, PyAny>,
        /// Per-sequence offsets.
        offsets: Option<&'a Bound<'py, PyAny>>,
    },
    /// Packed sequences split over context-parallel ranks: `cu_seqlens [num_seqs + 1]` of the
    /// whole sequences.
    VarlenContextParallel {
        /// Cumulative whole-sequence lengths.
        cu_seqlens: &'a Bound<'py, PyAny>,
        /// The ranks and this rank.
        split: ContextParallel,
    },
}

/// Where sin/cos come from, with the tensors still to borrow.
pub(crate) enum SinCosArg<'a, 'py> {
    /// Computed from `theta` with `angle`.
    Theta(f64, AngleMode),
    /// Computed from a `scaling` dictionary's frequencies (with `theta` as its base).
    Scaling {
        /// The dictionary or its JSON text.
        given: Scaling,
        /// `theta=`, if given.
        theta: Option<f64>,
        /// `angle=`.
        angle: AngleMode,
    },
    /// Computed from frequencies given on the host.
    HostInvFreq(Vec<f64>, f64, AngleMode),
    /// Computed from a `float64` CUDA tensor of frequencies.
    DeviceInvFreq(&'a Bound<'py, PyAny>, f64, AngleMode),
    /// Read from `cos_sin_cache`.
    Cache(&'a Bound<'py, PyAny>),
    /// Read from `cos` and `sin`.
    Tables(&'a Bound<'py, PyAny>, &'a Bound<'py, PyAny>),
}

/// A `scaling=` argument: a Hugging Face `rope_scaling` dictionary's items, or its JSON text.
pub(crate) enum Scaling {
    /// The dictionary's items.
    Entries(Vec<(String, ConfigValue)>),
    /// The dictionary as JSON text.
    Json(String),
}

impl Scaling {
    /// The frequencies it describes, with what the call gives beside it.
    pub fn spec(&self, base: ConfigBase) -> rope_host::Result<FrequencySpec> {
        match self {
            Scaling::Entries(entries) => FrequencySpec::from_rope_scaling(entries, base),
            Scaling::Json(text) => FrequencySpec::from_rope_scaling_json(text, base),
        }
    }
}

/// One launch as the Python functions describe it.
pub(crate) struct Launch<'a, 'py> {
    /// The tensor rope-host calls q.
    pub q: &'a Bound<'py, PyAny>,
    /// The tensor rope-host calls k.
    pub k: Option<&'a Bound<'py, PyAny>>,
    /// q's output; `None` in place.
    pub out: Option<&'a Bound<'py, PyAny>>,
    /// k's output; `None` in place.
    pub k_out: Option<&'a Bound<'py, PyAny>>,
    /// The arguments' Python names.
    pub names: Names,
    /// How q, k and the outputs are read.
    pub view: View,
    /// Where positions come from.
    pub positions: PositionsArg<'a, 'py>,
    /// Where sin/cos come from.
    pub sincos: SinCosArg<'a, 'py>,
    /// The pairing.
    pub style: RopeStyle,
    /// `rotary_dim=`, if given.
    pub rotary_dim: Option<u32>,
    /// Forward or backward.
    pub direction: Direction,
    /// The `CUstream` to launch on.
    pub stream: u64,
    /// Whether the producers must order their writes before `stream` (see [`dlpack_stream`]).
    pub producer_sync: bool,
    /// How the launch may overlap the kernel before it on `stream` (`pdl=`).
    pub overlap: StreamOverlap,
}

/// The borrowed tensors of a launch: alive until it is enqueued.
pub(crate) struct Held<'py> {
    dlpack_stream: i64,
    pub(crate) device: i32,
    borrowed: Vec<Borrowed<'py>>,
}

impl<'py> Held<'py> {
    /// The borrows of a launch whose first tensor is `obj` (named `name`), borrowed with
    /// `dlpack_stream`: its device is the launch's. Room for all the others at once (a launch
    /// borrows at most a dozen tensors; one allocation).
    pub(crate) fn first(obj: &Bound<'py, PyAny>, name: &str, dlpack_stream: i64) -> PyResult<Self> {
        let first = borrow(obj, name, dlpack_stream)?;
        let mut borrowed = Vec::with_capacity(12);
        let device = first.dense.device_id;
        borrowed.push(first);
        Ok(Self {
            dlpack_stream,
            device,
            borrowed,
        })
    }

    /// The borrows of an eager call whose first tensor is `x` (named `name`), with the stream
    /// it launches on and whether the producers must order their writes before it: `stream` if
    /// given (they must), else the producer's current stream on `x`'s device by the DLPack
    /// exchange API (they are ordered already). None, having borrowed nothing, for a producer
    /// without that API: the wrapper finds the stream.
    pub(crate) fn eager(
        x: &Bound<'py, PyAny>,
        name: &str,
        stream: Option<u64>,
    ) -> PyResult<Option<(Self, (u64, bool))>> {
        if let Some(s) = stream {
            let held = Self::first(x, name, dlpack_stream(s, true))?;
            return Ok(Some((held, (s, true))));
        }
        let Some(api) = exchange::types::api_of(x) else {
            return Ok(None);
        };
        let held = Self::first(x, name, -1)?;
        // SAFETY: we hold the GIL, which the producer needs.
        match unsafe { api.current_cuda_stream(held.device) } {
            Some(s) => Ok(Some((held, (s, false)))),
            None => {
                let _ = PyErr::take(x.py());
                Ok(None)
            }
        }
    }

    /// What was read from the first tensor.
    pub(crate) fn first_dense(&self) -> &Dense {
        &self.borrowed[0].dense
    }

    /// Borrows `obj` (named `name`), which must be on the launch's device; returns what was
    /// read from it. An object borrowed before in this launch (an eager drop-in reads some
    /// tensors to choose its form, then the launch reads them) is not borrowed again: the GIL
    /// is held throughout, so it is unchanged.
    pub(crate) fn borrow(&mut self, obj: &Bound<'py, PyAny>, name: &str) -> PyResult<&Dense> {
        let source = obj.as_ptr() as usize;
        if let Some(i) = self.borrowed.iter().position(|b| b.source == source) {
            return Ok(&self.borrowed[i].dense);
        }
        let b = borrow(obj, name, self.dlpack_stream)?;
        if b.dense.device_id != self.device {
            return Err(PyValueError::new_err(format!(
                "{name} is on CUDA device {}, the tensors to rotate on device {}",
                b.dense.device_id, self.device
            )));
        }
        self.borrowed.push(b);
        Ok(&self.borrowed.last().expect("just pushed").dense)
    }

    /// Borrows a tensor to rotate or write, if given ([`Held::required_tensor`]).
    pub(crate) fn tensor(
        &mut self,
        obj: Option<&Bound<'py, PyAny>>,
        name: &'static str,
        spec: (Elem, &str, View),
    ) -> PyResult<Option<RawTensor>> {
        obj.map(|obj| self.required_tensor(obj, name, spec))
            .transpose()
    }

    /// Borrows a tensor to rotate or write: on q's device, of q's element type (`elem`, q
    /// named `q_name`), read by `view`.
    pub(crate) fn required_tensor(
        &mut self,
        obj: &Bound<'py, PyAny>,
        name: &'static str,
        (elem, q_name, view): (Elem, &str, View),
    ) -> PyResult<RawTensor> {
        let d = self.borrow(obj, name)?;
        if d.elem != elem {
            return Err(PyValueError::new_err(format!(
                "{name} is {}, {q_name} is {}",
                d.elem.name(),
                elem.name()
            )));
        }
        view.tensor(d, name)
    }
}

/// Tensors rotated or read in place as one buffer when their address ranges meet (views of
/// one fused QKV tensor, as PyTorch slices it): the buffer spanning all of them and each layout
/// offset into it, so that rope-host checks their disjointness element by element rather than
/// by address range. `None` when no two meet (or an offset is not a whole element): they are
/// separate buffers.
pub(crate) fn one_buffer(tensors: &[RawTensor], es: u64) -> Option<(RawBuf, Vec<Layout>)> {
    let end = |t: &RawTensor| t.buf.ptr + t.buf.len as u64 * es;
    let meet = tensors.iter().enumerate().any(|(i, a)| {
        tensors[i + 1..]
            .iter()
            .any(|b| a.buf.ptr < end(b) && b.buf.ptr < end(a))
    });
    let base = tensors.iter().map(|t| t.buf.ptr).min()?;
    let aligned = tensors
        .iter()
        .all(|t| (t.buf.ptr - base).is_multiple_of(es));
    if !(meet && aligned) {
        return None;
    }
    let last = tensors.iter().map(end).max()?;
    let layouts = tensors
        .iter()
        .map(|t| {
            let delta = ((t.buf.ptr - base) / es) as usize;
            t.layout.with_offset(t.layout.offset() + delta)
        })
        .collect();
    let buf = RawBuf {
        ptr: base,
        len: ((last - base) / es) as usize,
    };
    Some((buf, layouts))
}

/// q and k for an in-place launch: separate buffers, or one buffer ([`one_buffer`]).
fn qk_in_place(q: RawTensor, k: RawTensor, es: u64) -> RawTensors {
    match one_buffer(&[q, k], es) {
        Some((buf, layouts)) => RawTensors::Packed {
            buf,
            q: layouts[0],
            k: layouts[1],
        },
        None => RawTensors::Separate {
            q: RawIo::InPlace(q),
            k: RawIo::InPlace(k),
        },
    }
}

/// `input` rotated in place, or into `output`.
fn io(input: RawTensor, output: Option<RawTensor>) -> RawIo {
    match output {
        None => RawIo::InPlace(input),
        Some(output) => RawIo::OutOfPlace { input, output },
    }
}

/// Validates `l` (here and in rope-host) and launches it on its stream.
pub(crate) fn launch(l: Launch<'_, '_>) -> PyResult<()> {
    let names = l.names;
    let mut held = Held::first(l.q, names.q, dlpack_stream(l.stream, l.producer_sync))?;
    let q = held.first_dense();
    let (device, elem) = (held.device, q.elem);
    let dtype = dlpack::float_type(q, names.q).map_err(arg_error)?;
    let q_tensor = l.view.tensor(q, names.q)?;
    let mut tensor = |obj, name| held.tensor(obj, name, (elem, names.q, l.view));
    let k_tensor = tensor(l.k, names.k)?;
    let out_tensor = tensor(l.out, names.out)?;
    let k_out_tensor = tensor(l.k_out, names.k_out)?;
    if k_out_tensor.is_some() && k_tensor.is_none() {
        return Err(PyValueError::new_err(format!(
            "{}: given without {}",
            names.k_out, names.k
        )));
    }
    let positions = raw_positions(&l.positions, &mut held, &names)?;
    let head_dim = u32::try_from(q_tensor.layout.head_dim()).map_err(|_| {
        PyValueError::new_err(format!(
            "{} has heads of {} elements",
            names.q,
            q_tensor.layout.head_dim()
        ))
    })?;
    let stream = l.stream as usize as CUstream;
    let (sincos, rotary_dim, _frequencies) = raw_sincos(
        l.sincos,
        &mut held,
        (dtype, elem.name(), head_dim, l.rotary_dim),
        (&names, stream),
    )?;
    let positions = positions.finish(device, &names, (rotary_dim, stream))?;
    let config = RopeConfig::builder(head_dim, l.style)
        .direction(l.direction)
        .rotary_dim(rotary_dim)
        .build()
        .map_err(|e| names.host_error(e))?;
    // Default frequencies are checked before the device is used.
    if let RawSinCos::Computed { theta } = sincos {
        rope_host::check_default_frequencies(theta, rotary_dim).map_err(|e| names.host_error(e))?;
    }
    let rope = rope_for(device, l.overlap)?;
    if let RawSinCos::Computed { theta } = sincos {
        // Other streams read only prepared frequencies (`run_raw`'s `# Safety`).
        // SAFETY: `stream` is a stream of `rope`'s context, the Python caller's promise
        // (documented on every function taking `stream=`).
        unsafe { shared::prepare(&rope, (theta, rotary_dim), stream, "sincos") }
            .map_err(|e| names.host_error(e))?;
    }
    let op = RawOp {
        config,
        dtype,
        positions,
        sincos,
    };
    let tensors = match (k_tensor, out_tensor, k_out_tensor) {
        (None, out, _) => RawTensors::Q(io(q_tensor, out)),
        (Some(k), None, None) => qk_in_place(q_tensor, k, dtype.size() as u64),
        (Some(k), out, k_out) => RawTensors::Separate {
            q: io(q_tensor, out),
            k: io(k, k_out),
        },
    };
    // SAFETY: `run_raw`'s promises, and who keeps them:
    // - every address is memory of CUDA device `device` (DLPack said so, checked for each
    //   tensor by `borrow` and `Held::borrow`), and `rope` runs on that device's primary
    //   context, the context CUDA runtime users (PyTorch) allocate in; `stream` is a stream of
    //   that context: the Python caller's promise, documented on every function taking
    //   `stream=`;
    // - each buffer holds the elements given: `dlpack.rs` sized every buffer from the
    //   producer's own shape and strides, ending after the last addressed element, with the
    //   producer's element type (outputs and k checked to have q's);
    // - the capsules (or, through the exchange API, the tensor objects) in `held` keep the
    //   producers' tensors alive until this returns, after the launch is enqueued; after
    //   that, keeping them allocated until the kernel finishes on `stream` is the caller's
    //   promise (PyTorch's allocator reuses memory in the order of
    //   the tensor's stream, or after `record_stream`); `_frequencies` and the prepared
    //   vectors are pinned by `shared`, never freed;
    // - the producers made `stream` wait for the work that wrote the tensors (`__dlpack__`'s
    //   `stream=`), or the caller did (`producer_sync=False`, documented), and the caller
    //   promises that nothing else touches q, k and the outputs meanwhile;
    // - frequencies uploaded here (prepared or host-computed) were complete before this
    //   launch, and a device `inv_freq` was ordered before `stream` by its producer.
    unsafe { rope.run_raw(&op, tensors, stream) }.map_err(|e| names.host_error(e))?;
    drop(held);
    Ok(())
}

/// Positions borrowed and reduced to rope-host's raw form ([`raw_positions`]), but for the axis
/// map of per-axis positions, which waits for the launch's rotary width
/// ([`BorrowedPositions::finish`]).
pub(crate) enum BorrowedPositions {
    /// Every kind of positions but per-axis ones.
    Ready(RawPositions),
    /// Per-axis positions (`[n_axes, tokens]`) and their axes.
    Axes { ids: RawInts, axes: Axes },
}

impl BorrowedPositions {
    /// The raw positions of a launch of `rotary_dim` rotated features on `stream` of `device`:
    /// the axis map built for that width and pinned on the device (`shared::axis_map`).
    pub(crate) fn finish(
        self,
        device: i32,
        names: &Names,
        (rotary_dim, stream): (u32, CUstream),
    ) -> PyResult<RawPositions> {
        let (ids, axes) = match self {
            Self::Ready(p) => return Ok(p),
            Self::Axes { ids, axes } => (ids, axes),
        };
        let (map, arg) = match &axes {
            Axes::Mrope {
                sections,
                interleaved: true,
            } => (
                AxisMap::mrope_interleaved(*sections, rotary_dim),
                "mrope_section",
            ),
            Axes::Mrope { sections, .. } => {
                (AxisMap::mrope(*sections, rotary_dim), "mrope_section")
            }
            Axes::Axial { axes_dim } => (AxisMap::axial(axes_dim, rotary_dim), "axes_dim"),
        };
        let map = map.map_err(|e| names.host_error(e))?;
        let rope = rope_for(device, StreamOverlap::None)?;
        // SAFETY: `stream` is a stream of `rope`'s context, the Python caller's promise
        // (documented on every function taking `stream=`).
        let axes = unsafe { shared::axis_map(&rope, &map, stream, arg) }
            .map_err(|e| names.host_error(e))?;
        Ok(RawPositions::MultiAxis {
            positions: ids,
            axes: axes.raw(),
        })
    }
}

/// Borrows the position tensors and reduces them to rope-host's raw form (mRoPE's map to
/// follow).
pub(crate) fn raw_positions<'py>(
    p: &PositionsArg<'_, 'py>,
    held: &mut Held<'py>,
    names: &Names,
) -> PyResult<BorrowedPositions> {
    let name = names.positions;
    Ok(BorrowedPositions::Ready(match p {
        PositionsArg::MultiAxis { ids, axes } => {
            let d = held.borrow(ids, name)?;
            let ids = dlpack::axis_ints(d, name, axes.n_axes()).map_err(arg_error)?;
            return Ok(BorrowedPositions::Axes {
                ids,
                axes: axes.clone(),
            });
        }
        PositionsArg::Offset(offset) => RawPositions::Offset(*offset),
        PositionsArg::RowOffsets(obj) => {
            let d = held.borrow(obj, name)?;
            RawPositions::RowOffsets(dlpack::ints_1d(d, name, "batch").map_err(arg_error)?)
        }
        PositionsArg::Ids(obj) => {
            let d = held.borrow(obj, name)?;
            let shape = if d.shape.len() == 2 {
                IdsShape::PerRow
            } else {
                IdsShape::Shared
            };
            let ids = dlpack::ints(d, name).map_err(arg_error)?;
            RawPositions::Ids { ids, shape }
        }
        PositionsArg::Varlen {
            cu_seqlens,
            offsets,
        } => {
            let d = held.borrow(cu_seqlens, "cu_seqlens")?;
            let cu = dlpack::ints_1d(d, "cu_seqlens", "num_seqs + 1").map_err(arg_error)?;
            let offsets = match offsets {
                None => None,
                Some(obj) => {
                    let d = held.borrow(obj, name)?;
                    Some(dlpack::ints_1d(d, name, "num_seqs").map_err(arg_error)?)
                }
            };
            RawPositions::Varlen {
                cu_seqlens: cu,
                offsets,
            }
        }
        PositionsArg::VarlenContextParallel { cu_seqlens, split } => {
            let d = held.borrow(cu_seqlens, "cu_seqlens")?;
            let cu = dlpack::ints_1d(d, "cu_seqlens", "num_seqs + 1").map_err(arg_error)?;
            RawPositions::VarlenContextParallel {
                cu_seqlens: cu,
                split: *split,
            }
        }
    }))
}

/// Borrows or uploads the sin/cos source and reduces it to rope-host's raw form, with the
/// rotary width of the launch (`rotary_dim=`, else what the source serves, else `head_dim`) and
/// the host-computed frequencies it reads, if any.
pub(crate) fn raw_sincos<'py>(
    s: SinCosArg<'_, 'py>,
    held: &mut Held<'py>,
    (dtype, elem, head_dim, rotary_dim): (DType, &str, u32, Option<u32>),
    (names, stream): (&Names, CUstream),
) -> PyResult<(RawSinCos, u32, Option<Arc<Frequencies>>)> {
    let device = held.device;
    let host = |inv_freq: &[f64], attention: f64, angle: AngleMode| -> PyResult<_> {
        let rope = rope_for(device, StreamOverlap::None)?;
        // SAFETY: `stream` is a stream of `rope`'s context, the Python caller's promise.
        let f =
            unsafe { shared::frequencies(&rope, (inv_freq, attention, angle), stream, "sincos") }
                .map_err(|e| names.host_error(e))?;
        Ok((f.raw(), rotary_dim.unwrap_or(f.rotary_dim()), Some(f)))
    };
    let table_type = |d: &Dense, name: &str, t: DType| {
        if t == dtype || t == DType::F32 {
            Ok(())
        } else {
            Err(PyValueError::new_err(format!(
                "{name} must be float32 or the tensors' {elem}, got {}",
                d.elem.name()
            )))
        }
    };
    match s {
        SinCosArg::Theta(theta, AngleMode::Exact) => Ok((
            RawSinCos::Computed { theta },
            rotary_dim.unwrap_or(head_dim),
            None,
        )),
        SinCosArg::Theta(theta, angle) => {
            let r = rotary_dim.unwrap_or(head_dim);
            let spec = rope_host::FrequencySpec::new(theta, r).angle(angle);
            let (f, a) = spec.build().map_err(|e| names.host_error(e))?;
            host(&f, a, angle)
        }
        SinCosArg::Scaling {
            given,
            theta,
            angle,
        } => {
            let base = ConfigBase {
                theta,
                head_dim,
                rotary_dim,
                angle,
            };
            let spec = given.spec(base).map_err(|e| names.host_error(e))?;
            let (f, a) = spec.build().map_err(|e| names.host_error(e))?;
            let (raw, _, f) = host(&f, a, angle)?;
            Ok((raw, spec.rotary_dim, f))
        }
        SinCosArg::HostInvFreq(f, a, angle) => host(&f, a, angle),
        SinCosArg::DeviceInvFreq(obj, attention_factor, angle) => {
            let d = held.borrow(obj, "inv_freq")?;
            let (inv_freq, r) = dlpack::inv_freq(d, "inv_freq").map_err(arg_error)?;
            let raw = RawSinCos::Frequencies {
                inv_freq,
                rotary_dim: r,
                angle,
                attention_factor: attention_factor as f32,
            };
            Ok((raw, rotary_dim.unwrap_or(r), None))
        }
        SinCosArg::Cache(obj) => {
            let d = held.borrow(obj, "cos_sin_cache")?;
            let (cache, t, shape) = dlpack::cos_sin_cache(d, "cos_sin_cache").map_err(arg_error)?;
            table_type(d, "cos_sin_cache", t)?;
            let raw = RawSinCos::CosSinCache {
                cache,
                dtype: t,
                shape,
            };
            Ok((raw, rotary_dim.unwrap_or(shape.rotary_dim), None))
        }
        SinCosArg::Tables(cos, sin) => {
            let d = held.borrow(cos, "cos")?;
            let cos_elem = d.elem;
            let (cos, t, shape) = dlpack::half_table(d, "cos").map_err(arg_error)?;
            table_type(d, "cos", t)?;
            let d = held.borrow(sin, "sin")?;
            let sin_elem = d.elem;
            let (sin, sin_t, sin_shape) = dlpack::half_table(d, "sin").map_err(arg_error)?;
            if (sin_t, sin_shape) != (t, shape) {
                return Err(PyValueError::new_err(format!(
                    "sin is {} [{}, {}], cos is {} [{}, {}]: the tables must agree",
                    sin_elem.name(),
                    sin_shape.max_position,
                    sin_shape.rotary_dim / 2,
                    cos_elem.name(),
                    shape.max_position,
                    shape.rotary_dim / 2
                )));
            }
            let raw = RawSinCos::Table {
                cos,
                sin,
                dtype: t,
                shape,
            };
            Ok((raw, rotary_dim.unwrap_or(shape.rotary_dim), None))
        }
    }
}
