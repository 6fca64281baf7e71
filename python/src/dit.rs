//! The diffusion transformers' form of the fused launch from Python objects
//! (`rope_rs.fused_qk_rmsnorm_rope`, FlashInfer's signature): q and k normalised across all of a
//! token's heads, then rotated by 3-D axial positions, into outputs of their type or FP8; one
//! launch of [`rope_host::Rope::run_fused_raw`] with [`NormScope::AcrossHeads`] on the
//! caller's stream. The Python layer builds the positions and the `cos_sin_cache` of the axes'
//! frequencies and copies v.

use pyo3::prelude::*;
use rope_host::{Fp8Format, NormScope, NormWeight};

use crate::fused::{self, FusedLaunch, FusedTensors};
use crate::launch::Names;
use crate::native::{overlap, pairing};
use crate::options::Axes;

/// rope-host's argument names as `fused_qk_rmsnorm_rope` calls them.
const NAMES: Names = Names {
    q: "qkv",
    k: "qkv",
    out: "q_out",
    k_out: "k_out",
    positions: "ppf, pph, ppw",
    sincos: "base",
    other: &[
        ("norm", "is_qk_norm"),
        ("norm.eps", "eps"),
        ("norm.q_weight", "q_weight"),
        ("norm.k_weight", "k_weight"),
        ("config", "head_dim"),
    ],
};

/// The launch: `q` and `k` (`[tokens, heads, head_size]` views of the packed qkv) normalised
/// across heads by `q_weight`, `k_weight` (`heads * head_size` each; none without a norm),
/// rotated at `positions` (`[3, tokens]`: frame, height, width) whose pairs take their axis in
/// blocks of `sections` pairs, with `cos_sin_cache` (`[rows, head_size]`, float32), into `q_out`
/// and `k_out`: of q's type, or with `fp8_multiplier` E4M3 bytes of `x * multiplier`.
#[pyfunction]
#[pyo3(signature = (
    q, k, q_out, k_out, q_weight, k_weight, cos_sin_cache, positions, sections, head_size, eps,
    is_neox, fp8_multiplier, stream
))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn _qk_norm_across_rope(
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    q_out: &Bound<'_, PyAny>,
    k_out: &Bound<'_, PyAny>,
    q_weight: Option<&Bound<'_, PyAny>>,
    k_weight: Option<&Bound<'_, PyAny>>,
    cos_sin_cache: &Bound<'_, PyAny>,
    positions: &Bound<'_, PyAny>,
    sections: [u32; 3],
    head_size: usize,
    eps: f64,
    is_neox: bool,
    fp8_multiplier: Option<f32>,
    stream: u64,
) -> PyResult<()> {
    let tensors = match fp8_multiplier {
        None => FusedTensors::OutOfPlace {
            query: q,
            key: k,
            query_out: q_out,
            key_out: k_out,
        },
        Some(m) => FusedTensors::Quantized {
            q,
            k,
            value: None,
            q_out,
            k_out: Some(k_out),
            nope: [None, None],
            format: Fp8Format::E4m3,
            multipliers: (m, m),
        },
    };
    let norm = match (q_weight, k_weight) {
        (Some(qw), Some(kw)) => Some((qw, kw, eps, NormWeight::Plain)),
        _ => None,
    };
    fused::launch(FusedLaunch {
        tensors,
        head_size,
        norm,
        norm_scope: NormScope::AcrossHeads,
        positions,
        axes: Some(Axes::Mrope {
            sections,
            interleaved: false,
        }),
        cos_sin_cache,
        style: pairing(is_neox),
        cache: None,
        names: NAMES,
        stream,
        producer_sync: false,
        overlap: overlap(false),
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_qk_norm_across_rope, m)?)?;
    Ok(())
}
