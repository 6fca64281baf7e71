//! FlashInfer's `rope_quantize_fp8` forms from Python, in two kinds of native call:
//! - the plain calls (`rope_quantize_fp8`, `rope_quantize_fp8_append_paged_kv_cache`): every
//!   argument explicit (the FP8 type by name, the outputs given, the stream given), as the
//!   custom operators of `rope_rs.torch` make them;
//! - the eager calls (`_rope_quantize_fp8_eager`, `_rope_quantize_fp8_append_eager`), which the
//!   package's drop-ins make first for `torch.Tensor`s outside `torch.compile`: FlashInfer's own
//!   arguments, read in one native call (the FP8 type from `quantize_dtype` or the outputs, the
//!   outputs allocated or handed out again, MLA's form, PyTorch's current stream), so that the
//!   Python wrapper does nothing per call. They answer `None` where the call needs the
//!   wrapper: a page table to convert to int32, an argument it refuses with its own message,
//!   a producer without DLPack's exchange API.
//!
//! Both read their arguments into one [`Call`], which launches through `fused.rs`.

use std::collections::HashMap;
use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use rope_host::Fp8Format;

use crate::dlpack::{Dims, Elem};
use crate::eager::{Torch, torch};
use crate::fused::{
    self, AddressArg, CacheArg, CacheNopeArg, CacheType, FusedLaunch, FusedTensors, ScalesArg,
};
use crate::launch::{self, Held, Names};
use crate::native::{overlap, pairing};

/// FlashInfer's `quantize_dtype` by PyTorch's name.
fn quantize_format(name: &str) -> PyResult<Fp8Format> {
    match name {
        "float8_e4m3fn" => Ok(Fp8Format::E4m3),
        "float8_e5m2" => Ok(Fp8Format::E5m2),
        other => Err(PyValueError::new_err(format!(
            "quantize_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {other}"
        ))),
    }
}

/// A quantisation multiplier (`quant_scale_*`) as the kernels take it: finite in `f32`.
fn multiplier(value: f64, arg: &str) -> PyResult<f32> {
    let m = value as f32;
    if m.is_finite() {
        Ok(m)
    } else {
        Err(PyValueError::new_err(format!(
            "{arg} must be finite in float32, got {value}"
        )))
    }
}

/// rope-host's names of FlashInfer's `rope_quantize_fp8*` arguments, the caches' first (as
/// `paged_kv_cache` holds them: `(k_cache, v_cache)`, or MLA's `(ckv_cache, kpe_cache)`).
macro_rules! flashinfer_names {
    ($($cache:expr,)*) => {
        Names {
            q: "q_rope",
            k: "k_rope",
            out: "q_rope_out",
            k_out: "k_rope_out",
            positions: "pos_ids",
            sincos: "cos_sin_cache",
            other: &[
                $($cache,)*
                ("v", "v"),
                ("config", "cos_sin_cache"),
                ("q.scale", "quant_scale_q"),
                ("k.scale", "quant_scale_kv"),
                ("cache", "paged_kv_cache"),
                ("cache.layout", "paged_kv_cache"),
                ("cache.k_scale", "quant_scale_kv"),
                ("cache.v_scale", "quant_scale_kv"),
                ("cache.batch_indices", "batch_indices"),
                ("cache.positions", "positions"),
                ("cache.kv_indptr", "kv_indptr"),
                ("cache.kv_indices", "kv_indices"),
                ("q.non_rotary.input", "q_nope"),
                ("q.non_rotary.output", "q_nope_out"),
                ("k.non_rotary.input", "k_nope"),
                ("k.non_rotary.output", "k_nope_out"),
                ("cache.non_rotary.input", "k_nope"),
            ],
        }
    };
}

/// FlashInfer's names, GQA/MHA: `paged_kv_cache = (k_cache, v_cache)`.
const FLASHINFER_NAMES: Names = flashinfer_names!(
    ("cache.k", "paged_kv_cache[0]"),
    ("cache.v", "paged_kv_cache[1]"),
);

/// FlashInfer's names, MLA: `paged_kv_cache = (ckv_cache, kpe_cache)`, the rotated k into
/// `kpe_cache` (rope-host's `cache.k`) and `k_nope` into `ckv_cache` (its `cache.v`).
const FLASHINFER_MLA_NAMES: Names = flashinfer_names!(
    ("cache.k", "paged_kv_cache[1]"),
    ("cache.v", "paged_kv_cache[0]"),
    ("cache.non_rotary.layout", "paged_kv_cache[0]"),
    ("cache.layout", "paged_kv_cache[1]"),
);

/// A non-rotary part with its output, both or neither (`arg` names the output in the error).
type NopePair<'py> = Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)>;

/// [`NopePair`] of the arguments given.
fn nope_pair<'py>(
    x: Option<&Bound<'py, PyAny>>,
    out: Option<&Bound<'py, PyAny>>,
    arg: &str,
) -> PyResult<NopePair<'py>> {
    match (x, out) {
        (Some(x), Some(out)) => Ok(Some((x.clone(), out.clone()))),
        (None, None) => Ok(None),
        _ => Err(PyValueError::new_err(format!(
            "{arg}: give the non-rotary part with its output, or neither"
        ))),
    }
}

/// Where a call's k goes.
enum KInto<'a, 'py> {
    /// `rope_quantize_fp8`: FP8 into `k_rope_out`, its non-rotary part (with its output) if
    /// any.
    Outputs {
        /// k's FP8 output.
        k_rope_out: &'a Bound<'py, PyAny>,
        /// `(k_nope, k_nope_out)`.
        k_nope: Option<&'a (Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    },
    /// The append form: FP8 into the paged caches, with `v` (GQA/MHA) or without (MLA).
    Cache(PagedCache<'a, 'py>),
}

/// The append form's cache write, as FlashInfer names it.
struct PagedCache<'a, 'py> {
    /// `[nnz, num_kv_heads, head_dim]`, or None for MLA.
    v: Option<&'a Bound<'py, PyAny>>,
    /// rope-host's k cache (the rotated k) and v cache (v, or MLA's latent `k_nope`).
    caches: (&'a Bound<'py, PyAny>, &'a Bound<'py, PyAny>),
    /// `[kv_indices, kv_indptr, batch_indices, positions]`, int32.
    table: [&'a Bound<'py, PyAny>; 4],
    /// Tokens per page.
    page_size: usize,
    /// `"NHD"` or `"HND"`.
    kv_layout: &'a str,
    /// k's non-rotary part, if it has features.
    k_nope: Option<&'a Bound<'py, PyAny>>,
}

/// One call of a `rope_quantize_fp8` form, its arguments read.
struct Call<'a, 'py> {
    /// q's rotated part, `[nnz, num_qo_heads, rope_dim]`.
    q_rope: &'a Bound<'py, PyAny>,
    /// k's, `[nnz, num_kv_heads, rope_dim]` or MLA's `[nnz, rope_dim]`.
    k_rope: &'a Bound<'py, PyAny>,
    /// `[max_seq_len, rope_dim]`, cosines then sines.
    cos_sin_cache: &'a Bound<'py, PyAny>,
    /// One position per token.
    pos_ids: &'a Bound<'py, PyAny>,
    /// FlashInfer's `is_neox`.
    is_neox: bool,
    /// The rotated features per head.
    rope_dim: usize,
    /// The FP8 type of every output.
    format: Fp8Format,
    /// `(quant_scale_q, quant_scale_kv)`.
    scales: (f64, f64),
    /// q's FP8 output.
    q_rope_out: &'a Bound<'py, PyAny>,
    /// `(q_nope, q_nope_out)`.
    q_nope: Option<&'a (Bound<'py, PyAny>, Bound<'py, PyAny>)>,
    /// Where k goes.
    k: KInto<'a, 'py>,
    /// The stream and whether the producers must order their writes before it.
    stream: (u64, bool),
    /// FlashInfer's `enable_pdl`.
    pdl: bool,
}

impl<'py> Call<'_, 'py> {
    /// Validates and launches the call; `held` holds the tensors an eager call read already
    /// (begun with `q_rope`).
    fn launch(self, held: Option<Held<'py>>) -> PyResult<()> {
        let (k_out, k_nope, cache, names) = match self.k {
            KInto::Outputs { k_rope_out, k_nope } => {
                (Some(k_rope_out), k_nope, None, FLASHINFER_NAMES)
            }
            KInto::Cache(c) => {
                let non_rotary = match (c.k_nope, c.v) {
                    (Some(k), Some(_)) => Some(CacheNopeArg::AfterRotated(k)),
                    (Some(k), None) => Some(CacheNopeArg::Latent(k)),
                    (None, Some(_)) => None,
                    (None, None) => {
                        return Err(PyValueError::new_err(
                            "k_nope: MLA's paged cache (v None) takes k's latent features",
                        ));
                    }
                };
                let heads_first = match c.kv_layout {
                    "NHD" => false,
                    "HND" => true,
                    other => {
                        return Err(PyValueError::new_err(format!(
                            "kv_layout must be \"NHD\" or \"HND\", got {other:?}"
                        )));
                    }
                };
                let kv = multiplier(self.scales.1, "quant_scale_kv")?;
                let [kv_indices, kv_indptr, batch_indices, positions] = c.table;
                let cache = CacheArg {
                    key_cache: c.caches.0,
                    value_cache: c.caches.1,
                    address: AddressArg::PageTable([
                        batch_indices,
                        positions,
                        kv_indptr,
                        kv_indices,
                    ]),
                    dtype: CacheType::Fp8(self.format),
                    scales: Some(ScalesArg::Multiplier(kv)),
                    heads_first,
                    page_size: Some(c.page_size),
                    non_rotary,
                };
                let names = if c.v.is_some() {
                    FLASHINFER_NAMES
                } else {
                    FLASHINFER_MLA_NAMES
                };
                (None, None, Some((cache, c.v)), names)
            }
        };
        let (cache, value) = match cache {
            Some((cache, v)) => (Some(cache), v),
            None => (None, None),
        };
        let l = FusedLaunch {
            tensors: FusedTensors::Quantized {
                q: self.q_rope,
                k: self.k_rope,
                value,
                q_out: self.q_rope_out,
                k_out,
                nope: [self.q_nope, k_nope],
                format: self.format,
                multipliers: (
                    multiplier(self.scales.0, "quant_scale_q")?,
                    multiplier(self.scales.1, "quant_scale_kv")?,
                ),
            },
            head_size: self.rope_dim,
            norm: None,
            norm_scope: rope_host::NormScope::PerHead,
            positions: self.pos_ids,
            axes: None,
            cos_sin_cache: self.cos_sin_cache,
            style: pairing(self.is_neox),
            cache,
            names,
            stream: self.stream.0,
            producer_sync: self.stream.1,
            overlap: overlap(self.pdl),
        };
        match held {
            Some(held) => fused::launch_held(l, held),
            None => fused::launch(l),
        }
    }
}

/// FlashInfer's `rope_quantize_fp8` (and `mla_rope_quantize_fp8`) for the rotated parts: rotates
/// `q_rope` `[nnz, num_qo_heads, rope_dim]` and `k_rope` `[nnz, num_kv_heads, rope_dim]` (or
/// `[nnz, rope_dim]`, MLA's one head) at `pos_ids` with `cos_sin_cache` `[max_seq_len,
/// rope_dim]` (cosines, then sines) and stores FP8 (`quantize_dtype`, "float8_e4m3fn" or
/// "float8_e5m2") of `x * quant_scale_q` into `q_rope_out` and of `x * quant_scale_kv` into
/// `k_rope_out` (tensors of q_rope's and k_rope's shapes, of that FP8 type or uint8), rounded
/// to nearest even and saturated at the format's largest finite value. The non-rotary parts
/// `q_nope` `[nnz, num_qo_heads, no_rope_dim]` and `k_nope` (`[nnz, num_kv_heads,
/// no_rope_dim]`, or `[nnz, no_rope_dim]`) go, unrotated, into `q_nope_out` and `k_nope_out`
/// as FP8 of `x * quant_scale_q` and `x * quant_scale_kv`, in the same launch (each with its
/// output, or neither). The inputs are only read.
///
/// Launched asynchronously on `stream` with the caller's guarantees of `apply_rope`
/// (`producer_sync` and `pdl` as there).
#[pyfunction]
#[pyo3(signature = (
    q_rope, k_rope, cos_sin_cache, pos_ids, is_neox, rope_dim, quantize_dtype, quant_scale_q,
    quant_scale_kv, q_rope_out, k_rope_out, stream=0, producer_sync=true, pdl=false, q_nope=None,
    q_nope_out=None, k_nope=None, k_nope_out=None
))]
#[allow(clippy::too_many_arguments)]
fn rope_quantize_fp8(
    q_rope: &Bound<'_, PyAny>,
    k_rope: &Bound<'_, PyAny>,
    cos_sin_cache: &Bound<'_, PyAny>,
    pos_ids: &Bound<'_, PyAny>,
    is_neox: bool,
    rope_dim: usize,
    quantize_dtype: &str,
    quant_scale_q: f64,
    quant_scale_kv: f64,
    q_rope_out: &Bound<'_, PyAny>,
    k_rope_out: &Bound<'_, PyAny>,
    stream: u64,
    producer_sync: bool,
    pdl: bool,
    q_nope: Option<&Bound<'_, PyAny>>,
    q_nope_out: Option<&Bound<'_, PyAny>>,
    k_nope: Option<&Bound<'_, PyAny>>,
    k_nope_out: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let q_nope = nope_pair(q_nope, q_nope_out, "q_nope_out")?;
    let k_nope = nope_pair(k_nope, k_nope_out, "k_nope_out")?;
    Call {
        q_rope,
        k_rope,
        cos_sin_cache,
        pos_ids,
        is_neox,
        rope_dim,
        format: quantize_format(quantize_dtype)?,
        scales: (quant_scale_q, quant_scale_kv),
        q_rope_out,
        q_nope: q_nope.as_ref(),
        k: KInto::Outputs {
            k_rope_out,
            k_nope: k_nope.as_ref(),
        },
        stream: (stream, producer_sync),
        pdl,
    }
    .launch(None)
}

/// FlashInfer's `rope_quantize_fp8_append_paged_kv_cache`: as [`rope_quantize_fp8`] for q (into
/// `q_rope_out`), and the rotated k and `v` (`[nnz, num_kv_heads, rope_dim]`) as FP8 of `x *
/// quant_scale_kv` into the paged caches `k_cache` and `v_cache` (`[max_pages, page_size,
/// num_kv_heads, rope_dim]` for `kv_layout` "NHD", `[max_pages, num_kv_heads, page_size,
/// rope_dim]` for "HND"), token `t` at entry `positions[t] % page_size` of page
/// `kv_indices[kv_indptr[b] + positions[t] // page_size]`, `b = batch_indices[t]` (all int32; a
/// negative `b` is padding and writes nothing, as does an entry outside the request's pages or
/// the arrays).
///
/// The non-rotary parts: `q_nope` into `q_nope_out` as in [`rope_quantize_fp8`]; `k_nope`
/// (`[nnz, num_kv_heads, no_rope_dim]`) into each k cache head after its rotated features, the
/// caches' heads and v's then holding `rope_dim + no_rope_dim` elements. MLA's form (`v` None):
/// `k_rope` `[nnz, rope_dim]` into `k_cache` (`kpe_cache`, `[max_pages, page_size,
/// rope_dim]`) and `k_nope` `[nnz, no_rope_dim]` into `v_cache` (`ckv_cache`, `[max_pages,
/// page_size, no_rope_dim]`), both FP8 of `x * quant_scale_kv`.
#[pyfunction]
#[pyo3(signature = (
    q_rope, k_rope, v, cos_sin_cache, pos_ids, k_cache, v_cache, kv_indices, kv_indptr,
    batch_indices, positions, is_neox, rope_dim, quantize_dtype, quant_scale_q, quant_scale_kv,
    page_size, kv_layout, q_rope_out, stream=0, producer_sync=true, pdl=false, q_nope=None,
    q_nope_out=None, k_nope=None
))]
#[allow(clippy::too_many_arguments)]
fn rope_quantize_fp8_append_paged_kv_cache(
    q_rope: &Bound<'_, PyAny>,
    k_rope: &Bound<'_, PyAny>,
    v: Option<&Bound<'_, PyAny>>,
    cos_sin_cache: &Bound<'_, PyAny>,
    pos_ids: &Bound<'_, PyAny>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
    kv_indices: &Bound<'_, PyAny>,
    kv_indptr: &Bound<'_, PyAny>,
    batch_indices: &Bound<'_, PyAny>,
    positions: &Bound<'_, PyAny>,
    is_neox: bool,
    rope_dim: usize,
    quantize_dtype: &str,
    quant_scale_q: f64,
    quant_scale_kv: f64,
    page_size: usize,
    kv_layout: &str,
    q_rope_out: &Bound<'_, PyAny>,
    stream: u64,
    producer_sync: bool,
    pdl: bool,
    q_nope: Option<&Bound<'_, PyAny>>,
    q_nope_out: Option<&Bound<'_, PyAny>>,
    k_nope: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let q_nope = nope_pair(q_nope, q_nope_out, "q_nope_out")?;
    Call {
        q_rope,
        k_rope,
        cos_sin_cache,
        pos_ids,
        is_neox,
        rope_dim,
        format: quantize_format(quantize_dtype)?,
        scales: (quant_scale_q, quant_scale_kv),
        q_rope_out,
        q_nope: q_nope.as_ref(),
        k: KInto::Cache(PagedCache {
            v,
            caches: (k_cache, v_cache),
            table: [kv_indices, kv_indptr, batch_indices, positions],
            page_size,
            kv_layout,
            k_nope,
        }),
        stream: (stream, producer_sync),
        pdl,
    }
    .launch(None)
}

/// The FP8 format of an eager call: `quantize_dtype` (torch's two FP8 types), else the type of
/// the first output given, else E4M3 (FlashInfer's choice). None for another type: the
/// wrapper refuses it.
fn eager_format<'py>(
    torch: &Torch,
    held: &mut Held<'py>,
    quantize_dtype: Option<&Bound<'py, PyAny>>,
    outputs: &[(Option<&Bound<'py, PyAny>>, &str)],
) -> PyResult<Option<Fp8Format>> {
    if let Some(dtype) = quantize_dtype {
        return Ok(torch.format(dtype));
    }
    let Some((out, name)) = outputs.iter().find_map(|(o, n)| o.map(|o| (o, *n))) else {
        return Ok(Some(Fp8Format::E4m3));
    };
    Ok(match held.borrow(out, name)?.elem {
        Elem::E4m3 => Some(Fp8Format::E4m3),
        Elem::E5m2 => Some(Fp8Format::E5m2),
        _ => None,
    })
}

/// The element type of FP8 `format` as PyTorch's own type (not bytes).
fn fp8_elem(format: Fp8Format) -> Elem {
    match format {
        Fp8Format::E4m3 => Elem::E4m3,
        Fp8Format::E5m2 => Elem::E5m2,
    }
}

/// `x` if it is a non-rotary part with features (FlashInfer's zero-feature tensors carry
/// nothing).
fn with_features<'a, 'py>(
    held: &mut Held<'py>,
    x: Option<&'a Bound<'py, PyAny>>,
    name: &str,
) -> PyResult<Option<&'a Bound<'py, PyAny>>> {
    let Some(x) = x else { return Ok(None) };
    let features = held.borrow(x, name)?.shape.last().copied().unwrap_or(0);
    Ok((features != 0).then_some(x))
}

/// The zero-feature outputs handed out again, by the rotated output's shape, the FP8 format
/// and the device; at most [`KEPT_LIMIT`] (decode batches come in many sizes), then started
/// afresh. A tensor with no elements owns no memory.
static KEPT: Mutex<Option<KeptOutputs>> = Mutex::new(None);

/// [`KEPT`]'s map: `(shape of the rotated output, format, device)` to the tensor.
type KeptOutputs = HashMap<(Dims, Fp8Format, i32), Py<PyAny>>;

/// How many zero-feature outputs [`KEPT`] holds at most.
const KEPT_LIMIT: usize = 256;

/// The output of a non-rotary part: `out` if given; else, for a `part` with features, a new
/// tensor of its shape (FlashInfer's `empty_like`); else a tensor of `rope_out`'s shape with no
/// features (the shape FlashInfer allocates), one kept per shape, format and device.
fn part_output<'py>(
    torch: &Torch,
    held: &mut Held<'py>,
    (out, part): (Option<&Bound<'py, PyAny>>, Option<&Bound<'py, PyAny>>),
    (rope_out, rope_name): (&Bound<'py, PyAny>, &str),
    format: Fp8Format,
) -> PyResult<Bound<'py, PyAny>> {
    let py = rope_out.py();
    if let Some(out) = out {
        return Ok(out.clone());
    }
    if let Some(part) = part {
        let shape = held.borrow(part, "non-rotary part")?.shape;
        return torch.new_empty(part, &shape, format);
    }
    let d = held.borrow(rope_out, rope_name)?;
    let key = (d.shape, format, d.device_id);
    let mut shape = d.shape;
    let last = shape.len().saturating_sub(1);
    if let Some(features) = shape.get_mut(last) {
        *features = 0;
    }
    let kept = KEPT
        .lock()
        .ok()
        .and_then(|k| k.as_ref()?.get(&key).map(|t| t.clone_ref(py)));
    if let Some(kept) = kept {
        let kept = kept.into_bound(py);
        // One a caller reshaped (`resize_`) or marked for autograd is replaced.
        let intact = launch::describe(&kept, "kept", false).is_ok_and(|k| k.shape == shape)
            && !kept
                .getattr(pyo3::intern!(py, "requires_grad"))?
                .is_truthy()?;
        if intact {
            return Ok(kept);
        }
    }
    let made = torch.new_empty(rope_out, &shape, format)?;
    let dropped = KEPT.lock().ok().map(|mut k| {
        let map = k.get_or_insert_with(HashMap::new);
        let full = (map.len() >= KEPT_LIMIT).then(|| std::mem::take(map));
        map.insert(key, made.clone().unbind());
        full
    });
    // Released outside the lock (dropping a tensor runs its owner's code).
    drop(dropped);
    Ok(made)
}

/// One rotated part's outputs in an eager call.
struct PartOutputs<'py> {
    /// The rotated features' FP8 output.
    rope_out: Bound<'py, PyAny>,
    /// The non-rotary part's FP8 output.
    nope_out: Bound<'py, PyAny>,
    /// The non-rotary part, if it has features, with its output.
    nope: NopePair<'py>,
}

/// The outputs of `x_rope` and its non-rotary part in an eager call: `rope_out` if given, else
/// `torch.empty_like(x_rope, dtype=format)`; the part's output as [`part_output`] finds it.
/// `names` names `rope_out` and the part in errors.
fn part_outputs<'py>(
    torch: &Torch,
    held: &mut Held<'py>,
    (x_rope, rope_out): (&Bound<'py, PyAny>, Option<&Bound<'py, PyAny>>),
    (nope, nope_out): (Option<&Bound<'py, PyAny>>, Option<&Bound<'py, PyAny>>),
    (names, format): ([&str; 2], Fp8Format),
) -> PyResult<PartOutputs<'py>> {
    let rope_out = match rope_out {
        Some(o) => o.clone(),
        None => torch.empty_like_fp8(x_rope, format)?,
    };
    let part = with_features(held, nope, names[1])?;
    let nope_out = part_output(torch, held, (nope_out, part), (&rope_out, names[0]), format)?;
    let nope = part.map(|x| (x.clone(), nope_out.clone()));
    Ok(PartOutputs {
        rope_out,
        nope_out,
        nope,
    })
}

/// `rope_rs.rope_quantize_fp8`'s eager call for `torch.Tensor`s: FlashInfer's arguments as
/// given (`quantize_dtype` a torch dtype or None, outputs None to allocate), and the `stream=`
/// keyword (None: PyTorch's current stream). Returns `(q_rope_out, k_rope_out, q_nope_out,
/// k_nope_out)` after the launch, or None, launching nothing, where the wrapper must take the
/// call (module doc).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn _rope_quantize_fp8_eager<'py>(
    q_rope: &Bound<'py, PyAny>,
    k_rope: &Bound<'py, PyAny>,
    q_nope: Option<&Bound<'py, PyAny>>,
    k_nope: Option<&Bound<'py, PyAny>>,
    cos_sin_cache: &Bound<'py, PyAny>,
    pos_ids: &Bound<'py, PyAny>,
    is_neox: bool,
    quantize_dtype: Option<&Bound<'py, PyAny>>,
    quant_scale_q: f64,
    quant_scale_kv: f64,
    q_rope_out: Option<&Bound<'py, PyAny>>,
    k_rope_out: Option<&Bound<'py, PyAny>>,
    q_nope_out: Option<&Bound<'py, PyAny>>,
    k_nope_out: Option<&Bound<'py, PyAny>>,
    enable_pdl: bool,
    stream: Option<u64>,
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    let py = q_rope.py();
    let Some((mut held, stream)) = Held::eager(q_rope, "q_rope", stream)? else {
        return Ok(None);
    };
    let torch = torch(py)?;
    let outputs = [
        (q_rope_out, "q_rope_out"),
        (k_rope_out, "k_rope_out"),
        (q_nope_out, "q_nope_out"),
        (k_nope_out, "k_nope_out"),
    ];
    let Some(format) = eager_format(torch, &mut held, quantize_dtype, &outputs)? else {
        return Ok(None);
    };
    let rope_dim = held.first_dense().shape.last().copied().unwrap_or(0);
    let q = part_outputs(
        torch,
        &mut held,
        (q_rope, q_rope_out),
        (q_nope, q_nope_out),
        (["q_rope_out", "q_nope"], format),
    )?;
    let k = part_outputs(
        torch,
        &mut held,
        (k_rope, k_rope_out),
        (k_nope, k_nope_out),
        (["k_rope_out", "k_nope"], format),
    )?;
    Call {
        q_rope,
        k_rope,
        cos_sin_cache,
        pos_ids,
        is_neox,
        rope_dim,
        format,
        scales: (quant_scale_q, quant_scale_kv),
        q_rope_out: &q.rope_out,
        q_nope: q.nope.as_ref(),
        k: KInto::Outputs {
            k_rope_out: &k.rope_out,
            k_nope: k.nope.as_ref(),
        },
        stream,
        pdl: enable_pdl,
    }
    .launch(Some(held))?;
    PyTuple::new(py, [q.rope_out, k.rope_out, q.nope_out, k.nope_out]).map(Some)
}

/// `rope_rs.rope_quantize_fp8_append_paged_kv_cache`'s eager call for `torch.Tensor`s:
/// FlashInfer's arguments as given (`paged_kv_cache` the tuple, `quantize_dtype` a torch dtype
/// or None, `q_rope_out`/`q_nope_out` None to allocate), and the `stream=` keyword (None:
/// PyTorch's current stream). Returns `(q_rope_out, q_nope_out)` after the launch, or None,
/// launching nothing, where the wrapper must take the call (module doc): v given or missing
/// against the form `k_rope`'s rank picks, a `paged_kv_cache` not a pair, caches or an FP8
/// type other than FlashInfer takes, MLA without `k_nope`, a page table not int32.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn _rope_quantize_fp8_append_eager<'py>(
    q_rope: &Bound<'py, PyAny>,
    k_rope: &Bound<'py, PyAny>,
    q_nope: Option<&Bound<'py, PyAny>>,
    k_nope: Option<&Bound<'py, PyAny>>,
    v: Option<&Bound<'py, PyAny>>,
    cos_sin_cache: &Bound<'py, PyAny>,
    pos_ids: &Bound<'py, PyAny>,
    paged_kv_cache: &Bound<'py, PyAny>,
    kv_indices: &Bound<'py, PyAny>,
    kv_indptr: &Bound<'py, PyAny>,
    batch_indices: &Bound<'py, PyAny>,
    positions: &Bound<'py, PyAny>,
    is_neox: bool,
    quantize_dtype: Option<&Bound<'py, PyAny>>,
    quant_scale_q: f64,
    quant_scale_kv: f64,
    page_size: usize,
    kv_layout: &str,
    q_rope_out: Option<&Bound<'py, PyAny>>,
    q_nope_out: Option<&Bound<'py, PyAny>>,
    enable_pdl: bool,
    stream: Option<u64>,
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    let py = q_rope.py();
    let Some((mut held, stream)) = Held::eager(q_rope, "q_rope", stream)? else {
        return Ok(None);
    };
    let torch = torch(py)?;
    let mla = held.borrow(k_rope, "k_rope")?.shape.len() == 2;
    let Ok(pair) = paged_kv_cache.cast::<PyTuple>() else {
        return Ok(None);
    };
    if mla == v.is_some() || pair.len() != 2 {
        return Ok(None);
    }
    // rope-host's k cache takes the rotated k, its v cache v or (MLA) k's latent part.
    let (k_at, v_at) = if mla { (1, 0) } else { (0, 1) };
    let (k_cache, v_cache) = (pair.get_item(k_at)?, pair.get_item(v_at)?);
    let outputs = [(q_rope_out, "q_rope_out"), (q_nope_out, "q_nope_out")];
    let Some(format) = eager_format(torch, &mut held, quantize_dtype, &outputs)? else {
        return Ok(None);
    };
    let elem = fp8_elem(format);
    let names = if mla {
        ["paged_kv_cache[1]", "paged_kv_cache[0]"]
    } else {
        ["paged_kv_cache[0]", "paged_kv_cache[1]"]
    };
    for (cache, name) in [&k_cache, &v_cache].into_iter().zip(names) {
        if held.borrow(cache, name)?.elem != elem {
            return Ok(None);
        }
    }
    let table = [kv_indices, kv_indptr, batch_indices, positions];
    for (t, name) in table
        .iter()
        .zip(["kv_indices", "kv_indptr", "batch_indices", "positions"])
    {
        if held.borrow(t, name)?.elem != Elem::I32 {
            return Ok(None);
        }
    }
    let k_part = with_features(&mut held, k_nope, "k_nope")?;
    if mla && k_part.is_none() {
        return Ok(None);
    }
    let rope_dim = held.first_dense().shape.last().copied().unwrap_or(0);
    let q = part_outputs(
        torch,
        &mut held,
        (q_rope, q_rope_out),
        (q_nope, q_nope_out),
        (["q_rope_out", "q_nope"], format),
    )?;
    Call {
        q_rope,
        k_rope,
        cos_sin_cache,
        pos_ids,
        is_neox,
        rope_dim,
        format,
        scales: (quant_scale_q, quant_scale_kv),
        q_rope_out: &q.rope_out,
        q_nope: q.nope.as_ref(),
        k: KInto::Cache(PagedCache {
            v,
            caches: (&k_cache, &v_cache),
            table,
            page_size,
            kv_layout,
            k_nope: k_part,
        }),
        stream,
        pdl: enable_pdl,
    }
    .launch(Some(held))?;
    PyTuple::new(py, [q.rope_out, q.nope_out]).map(Some)
}

/// Adds this module's functions to `rope_rs._native`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rope_quantize_fp8, m)?)?;
    m.add_function(wrap_pyfunction!(
        rope_quantize_fp8_append_paged_kv_cache,
        m
    )?)?;
    m.add_function(wrap_pyfunction!(_rope_quantize_fp8_eager, m)?)?;
    m.add_function(wrap_pyfunction!(_rope_quantize_fp8_append_eager, m)?)?;
    Ok(())
}
