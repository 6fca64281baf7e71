//! The training form of the fused QK-norm + RoPE from Python objects (`rope_rs.qk_norm_rope`
//! and its autograd): the forward step on separate q and k, normalised and rotated into new
//! tensors (one launch of [`rope_host::Rope::run_fused_raw`]), and its backward (one call of
//! [`rope_host::Rope::run_fused_backward_raw`]: the gradients of q's and k's inputs and of both
//! norm weights), each on the caller's stream. sin/cos come from a `cos_sin_cache`
//! `[max_position, rotary_dim]` (cos half, then sin half) at per-token `positions`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use rope_host::cudarc::driver::sys::CUstream;
use rope_host::{NormWeight, RawBuf, RawFusedGrads, RawFusedOp, RawIo, RawQkNorm};

use crate::dlpack::{self, Elem};
use crate::fused::{self, FusedLaunch, FusedTensors};
use crate::launch::{Held, Names, PositionsArg, View, arg_error, dlpack_stream, rope_for};
use crate::native::{overlap, pairing};

/// rope-host's argument names as `qk_norm_rope` calls them.
const OTHER: [(&str, &str); 9] = [
    ("norm", "q"),
    ("norm.eps", "eps"),
    ("norm.q_weight", "q_weight"),
    ("norm.k_weight", "k_weight"),
    ("config", "cos_sin_cache"),
    ("q_input", "q"),
    ("k_input", "k"),
    ("q_weight", "grad_q_weight"),
    ("k_weight", "grad_k_weight"),
];

/// The names of the forward step's arguments.
const FORWARD: Names = Names {
    q: "q",
    k: "k",
    out: "q_out",
    k_out: "k_out",
    positions: "positions",
    sincos: "cos_sin_cache",
    other: &OTHER,
};

/// The names of the backward's: rope-host's q and k are the output gradients.
const BACKWARD: Names = Names {
    q: "grad_q",
    k: "grad_k",
    out: "grad_q_input",
    k_out: "grad_k_input",
    positions: "positions",
    sincos: "cos_sin_cache",
    other: &OTHER,
};

/// The weighting: `w` or Gemma's `1 + w`.
fn weighting(gemma: bool) -> NormWeight {
    if gemma {
        NormWeight::OnePlus
    } else {
        NormWeight::Plain
    }
}

/// The forward step: `q` and `k` (`[tokens, heads, head_size]` or `[tokens, heads *
/// head_size]`) normalised per head by `q_weight`, `k_weight` and rotated into `q_out` and
/// `k_out` (of their shapes).
#[pyfunction]
#[pyo3(signature = (
    q, k, q_out, k_out, q_weight, k_weight, cos_sin_cache, positions, head_size, eps, is_neox,
    gemma, stream
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn _qk_norm_rope(
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    q_out: &Bound<'_, PyAny>,
    k_out: &Bound<'_, PyAny>,
    q_weight: &Bound<'_, PyAny>,
    k_weight: &Bound<'_, PyAny>,
    cos_sin_cache: &Bound<'_, PyAny>,
    positions: &Bound<'_, PyAny>,
    head_size: usize,
    eps: f64,
    is_neox: bool,
    gemma: bool,
    stream: u64,
) -> PyResult<()> {
    fused::launch(FusedLaunch {
        tensors: FusedTensors::OutOfPlace {
            query: q,
            key: k,
            query_out: q_out,
            key_out: k_out,
        },
        head_size,
        norm: Some((q_weight, k_weight, eps, weighting(gemma))),
        norm_scope: rope_host::NormScope::PerHead,
        positions,
        axes: None,
        cos_sin_cache,
        style: pairing(is_neox),
        cache: None,
        names: FORWARD,
        stream,
        producer_sync: false,
        overlap: overlap(false),
    })
}

/// The f32 workspace `_qk_norm_rope_backward` needs for `heads` q and k heads of `head_size`
/// on `tensor`'s device.
#[pyfunction]
pub(crate) fn _qk_norm_rope_workspace(
    tensor: &Bound<'_, PyAny>,
    heads: usize,
    head_size: usize,
) -> PyResult<usize> {
    // Read only for its device: nothing is launched, so no stream is asked of the producer.
    let device = Held::first(tensor, "q", -1)?.device;
    Ok(rope_for(device, overlap(false))?.fused_backward_workspace(heads, head_size))
}

/// The backward of `_qk_norm_rope`: from the forward inputs `q`, `k` and the output gradients
/// `grad_q`, `grad_k`, writes the input gradients `grad_q_input`, `grad_k_input` (each of its
/// gradient's shape) and the weights' `grad_q_weight`, `grad_k_weight` (`[head_size]`), with
/// `workspace` (float32, `_qk_norm_rope_workspace` elements).
#[pyfunction]
#[pyo3(signature = (
    q, k, grad_q, grad_k, grad_q_input, grad_k_input, q_weight, k_weight, grad_q_weight,
    grad_k_weight, workspace, cos_sin_cache, positions, head_size, eps, is_neox, gemma, stream
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn _qk_norm_rope_backward(
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    grad_q: &Bound<'_, PyAny>,
    grad_k: &Bound<'_, PyAny>,
    grad_q_input: &Bound<'_, PyAny>,
    grad_k_input: &Bound<'_, PyAny>,
    q_weight: &Bound<'_, PyAny>,
    k_weight: &Bound<'_, PyAny>,
    grad_q_weight: &Bound<'_, PyAny>,
    grad_k_weight: &Bound<'_, PyAny>,
    workspace: &Bound<'_, PyAny>,
    cos_sin_cache: &Bound<'_, PyAny>,
    positions: &Bound<'_, PyAny>,
    head_size: usize,
    eps: f64,
    is_neox: bool,
    gemma: bool,
    stream: u64,
) -> PyResult<()> {
    let names = BACKWARD;
    let mut held = Held::first(q, "q", dlpack_stream(stream, false))?;
    let device = held.device;
    let first = held.first_dense();
    let elem = first.elem;
    let dtype = dlpack::float_type(first, "q").map_err(arg_error)?;
    let view = View::Heads(head_size);
    let mut tensor = |obj, name| held.required_tensor(obj, name, (elem, "q", view));
    let q_input = tensor(q, "q")?;
    let k_input = tensor(k, "k")?;
    let gq = tensor(grad_q, "grad_q")?;
    let gk = tensor(grad_k, "grad_k")?;
    let gq_in = tensor(grad_q_input, "grad_q_input")?;
    let gk_in = tensor(grad_k_input, "grad_k_input")?;
    let mut vector = |obj, name, elem, n| -> PyResult<RawBuf> {
        let d = held.borrow(obj, name)?;
        dlpack::vector(d, name, elem, n).map_err(arg_error)
    };
    let norm = RawQkNorm {
        q_weight: vector(q_weight, "q_weight", elem, head_size)?,
        k_weight: vector(k_weight, "k_weight", elem, head_size)?,
        eps: eps as f32,
        weight: weighting(gemma),
        scope: rope_host::NormScope::PerHead,
    };
    let grad_weights = (
        vector(grad_q_weight, "grad_q_weight", elem, head_size)?,
        vector(grad_k_weight, "grad_k_weight", elem, head_size)?,
    );
    let workspace = {
        let d = held.borrow(workspace, "workspace")?;
        let n = d.shape.iter().product();
        dlpack::vector(d, "workspace", Elem::F32, n).map_err(arg_error)?
    };
    let head_dim = u32::try_from(head_size)
        .map_err(|_| PyValueError::new_err(format!("head_size {head_size} is too large")))?;
    let rope = rope_for(device, overlap(false))?;
    let op = RawFusedOp {
        rope: fused::cache_rotation(
            &mut held,
            (&PositionsArg::Ids(positions), cos_sin_cache),
            (head_dim, pairing(is_neox), dtype, elem),
            (&names, stream as usize as CUstream),
        )?,
        norm: Some(norm),
    };
    let grads = RawFusedGrads {
        q_input,
        k_input,
        q: RawIo::OutOfPlace {
            input: gq,
            output: gq_in,
        },
        k: RawIo::OutOfPlace {
            input: gk,
            output: gk_in,
        },
        q_weight: grad_weights.0,
        k_weight: grad_weights.1,
        workspace,
    };
    // SAFETY: as `fused::launch_held`'s launch: every address is memory of CUDA device
    // `device` (checked per tensor by `Held::borrow`) sized by `dlpack.rs` from its producer's
    // shape and strides with the producer's element type (the workspace float32); `held` keeps
    // the tensors alive until the launch is enqueued and the caller keeps them until it has run
    // on `stream`, a stream of the device's primary context on which their writers are ordered
    // (the Python wrapper passes PyTorch's current stream), touching nothing the launch writes.
    unsafe { rope.run_fused_backward_raw(&op, &grads, stream as usize as CUstream) }
        .map_err(|e| names.host_error(e))?;
    drop(held);
    Ok(())
}

/// Adds the training functions to the native module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_qk_norm_rope, m)?)?;
    m.add_function(wrap_pyfunction!(_qk_norm_rope_workspace, m)?)?;
    m.add_function(wrap_pyfunction!(_qk_norm_rope_backward, m)?)?;
    Ok(())
}
