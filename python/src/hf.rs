//! Hugging Face's `apply_rotary_pos_emb` eager call: `rope_rs._torch_eager` keeps the rope-rs
//! tables it made of the last `cos` and `sin` (views of them, the half row each token reads),
//! under a key of what they were made for; a call with those same `cos` and `sin` that needs
//! neither autograd nor `torch.compile` comes here, which checks the key, allocates the outputs
//! and launches, in one native call.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::dlpack::Dense;
use crate::eager::torch;
use crate::launch::{Held, describe};
use crate::native::apply_rope;

/// What kept tables were made for: `cos`'s and `sin`'s addresses, q's batch and sequence
/// length, q's element type (its [`crate::dlpack::Elem`] as a number) and CUDA device.
type Key = (u64, u64, usize, usize, u8, i32);

/// The [`Key`] of q, cos and sin as read, q `[batch, heads, seq, head_dim]` (`unsqueeze_dim`
/// 1) or `[batch, seq, heads, head_dim]` (2); None for another rank or `unsqueeze_dim`.
fn key_of(q: &Dense, (cos, sin): (&Dense, &Dense), unsqueeze_dim: i64) -> Option<Key> {
    if q.shape.len() != 4 {
        return None;
    }
    let seq = match unsqueeze_dim {
        1 => q.shape[2],
        2 => q.shape[1],
        _ => return None,
    };
    Some((cos.ptr, sin.ptr, q.shape[0], seq, q.elem as u8, q.device_id))
}

/// The key under which `rope_rs._torch_eager` keeps the tables made of `cos` and `sin` for
/// `q` (HF's `unsqueeze_dim`); None where a tensor cannot be read as a CUDA tensor or the
/// shapes do not fit (nothing is kept then).
#[pyfunction]
fn _hf_key(
    q: &Bound<'_, PyAny>,
    cos: &Bound<'_, PyAny>,
    sin: &Bound<'_, PyAny>,
    unsqueeze_dim: i64,
) -> Option<Key> {
    let read = |x| describe(x, "tensor", false).ok();
    key_of(&read(q)?, (&read(cos)?, &read(sin)?), unsqueeze_dim)
}

/// `rope_rs._torch_eager.apply_rotary_pos_emb` for a call with the kept tables' `cos` and `sin`
/// needing neither autograd nor `torch.compile`: `kept` is the entry `(cos, sin, key, cos_rows,
/// sin_rows, ids)`. Returns new `(q_embed, k_embed)` (`torch.empty_like`), rotated on
/// PyTorch's current stream, or None, launching nothing, where the Python function decides:
/// a key that differs (the tensors changed, or q's shape, type or device), an `unsqueeze_dim`
/// or rank it refuses, a producer without DLPack's exchange API.
#[pyfunction]
fn _apply_rotary_pos_emb_eager<'py>(
    q: &Bound<'py, PyAny>,
    k: Option<&Bound<'py, PyAny>>,
    unsqueeze_dim: i64,
    kept: &Bound<'py, PyTuple>,
) -> PyResult<Option<Bound<'py, PyTuple>>> {
    let layout = match unsqueeze_dim {
        1 => "bhsd",
        _ => "bshd",
    };
    if kept.len() != 6 {
        return Ok(None);
    }
    let item = |i| kept.get_item(i);
    let (cos, sin, key) = (item(0)?, item(1)?, item(2)?);
    let Some((held, (stream, producer_sync))) = Held::eager(q, "q", None)? else {
        return Ok(None);
    };
    let now = key_of(
        held.first_dense(),
        (
            &describe(&cos, "cos", false)?,
            &describe(&sin, "sin", false)?,
        ),
        unsqueeze_dim,
    );
    if now.is_none() || key.extract::<Option<Key>>().ok().flatten() != now {
        return Ok(None);
    }
    drop(held);
    let (cos_rows, sin_rows, ids) = (item(3)?, item(4)?, item(5)?);
    let torch = torch(q.py())?;
    let q_out = torch.empty_like(q)?;
    let k_out = k.map(|k| torch.empty_like(k)).transpose()?;
    apply_rope(
        q,
        k,
        Some(&q_out),
        k_out.as_ref(),
        None,
        Some(&ids),
        None,
        Some(layout),
        "neox",
        None,
        None,
        Some(&cos_rows),
        Some(&sin_rows),
        None,
        None,
        None,
        None,
        None,
        false,
        stream,
        producer_sync,
        1,
        0,
        false,
        None,
        false,
        None,
    )?;
    let k_out = match k_out {
        Some(k) => k,
        None => q.py().None().into_bound(q.py()),
    };
    PyTuple::new(q.py(), [q_out, k_out]).map(Some)
}

/// Adds this module's functions to `rope_rs._native`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_hf_key, m)?)?;
    m.add_function(wrap_pyfunction!(_apply_rotary_pos_emb_eager, m)?)?;
    Ok(())
}
