//! The f64 reference: RoPE written directly from its definition with ndarray.
//!
//! `x` is `[batch, seq, heads, head_dim]`; positions are resolved to one `i64` per token
//! (`[batch, seq]`) before the reference sees them, so every position source shares one path.

use ndarray::{Array2, Array4, ArrayView2, ArrayView3, ArrayView4, Axis};
use rope_host::{Direction, RopeStyle};

/// Where the reference takes cos/sin from.
#[derive(Clone, Debug)]
pub enum RefSinCos {
    /// Tables `[max_position, rotary_dim/2]`; a position outside them gives NaN outputs, as the
    /// kernels document.
    Table {
        /// `cos[p, i]`.
        cos: Array2<f64>,
        /// `sin[p, i]`.
        sin: Array2<f64>,
    },
    /// `cos`/`sin` of `p * theta^(-2i/rotary_dim)`, in f64.
    Theta(f64),
    /// `scale * cos`/`sin` of `p * inv_freq[i]`, in f64 (any scaling family).
    Frequencies {
        /// One frequency per pair.
        inv_freq: Vec<f64>,
        /// The attention factor multiplying cos and sin.
        scale: f64,
    },
}

/// `theta^(-2i/rotary_dim)` for `i < rotary_dim/2`, in f64.
pub fn inv_freq(theta: f64, rotary_dim: usize) -> Vec<f64> {
    (0..rotary_dim / 2)
        .map(|i| theta.powf(-2.0 * i as f64 / rotary_dim as f64))
        .collect()
}

/// `inv_freq` as Hugging Face's models compute it in PyTorch's default dtype,
/// `1.0 / (theta ** (arange(0, rotary_dim, 2).float() / rotary_dim))`: every step in f32 (the
/// exponent `2i / rotary_dim`, the power and the reciprocal each rounded to f32).
pub fn hf_inv_freq(theta: f32, rotary_dim: usize) -> Vec<f32> {
    (0..rotary_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / rotary_dim as f32))
        .collect()
}

/// Tables `[positions.len(), inv_freq.len()]` (row `r` for position `positions[r]`) of cos and
/// sin of the f32 angle `f32(p) * inv_freq[i]`, as f32 frameworks form it, each computed in f64
/// from that angle and rounded once to f32.
pub fn f32_angle_tables(inv_freq: &[f32], positions: &[i64]) -> (Array2<f32>, Array2<f32>) {
    let angle = Array2::from_shape_fn((positions.len(), inv_freq.len()), |(r, i)| {
        f64::from(positions[r] as f32 * inv_freq[i])
    });
    (
        angle.mapv(|a| a.cos() as f32),
        angle.mapv(|a| a.sin() as f32),
    )
}

/// Tables `[max_position, rotary_dim/2]` of `cos`/`sin(p * inv_freq_i)`, in f64.
pub fn tables(theta: f64, rotary_dim: usize, max_position: usize) -> (Array2<f64>, Array2<f64>) {
    let f = inv_freq(theta, rotary_dim);
    let angle = Array2::from_shape_fn((max_position, rotary_dim / 2), |(p, i)| p as f64 * f[i]);
    (angle.mapv(f64::cos), angle.mapv(f64::sin))
}

/// `(cos, sin)` of pair `i` at position `p`, or NaN where a table does not cover `p`.
fn cos_sin(src: &RefSinCos, p: i64, i: usize, rotary_dim: usize) -> (f64, f64) {
    match src {
        RefSinCos::Table { cos, sin } => {
            if p < 0 || p as usize >= cos.nrows() {
                (f64::NAN, f64::NAN)
            } else {
                (cos[[p as usize, i]], sin[[p as usize, i]])
            }
        }
        RefSinCos::Theta(theta) => {
            let angle = p as f64 * theta.powf(-2.0 * i as f64 / rotary_dim as f64);
            (angle.cos(), angle.sin())
        }
        RefSinCos::Frequencies { inv_freq, scale } => {
            let angle = p as f64 * inv_freq[i];
            (scale * angle.cos(), scale * angle.sin())
        }
    }
}

/// The element indices `(a, b)` of pair `i` when the first `rotary_dim` elements rotate.
pub fn pair(style: RopeStyle, i: usize, rotary_dim: usize) -> (usize, usize) {
    match style {
        RopeStyle::Interleaved => (2 * i, 2 * i + 1),
        RopeStyle::Neox => (i, i + rotary_dim / 2),
    }
}

/// RoPE of `x` in f64 with all of each head rotated; see [`rope_partial`].
pub fn rope(
    x: ArrayView4<'_, f64>,
    positions: ArrayView2<'_, i64>,
    style: RopeStyle,
    direction: Direction,
    src: &RefSinCos,
) -> Array4<f64> {
    rope_partial(x, positions, style, direction, src, x.len_of(Axis(3)))
}

/// RoPE of `x` in f64: for pair `i < rotary_dim / 2`, forward `(a, b) -> (a c - b s, b c + a s)`,
/// backward with `-s`; elements `rotary_dim..head_dim` pass through.
pub fn rope_partial(
    x: ArrayView4<'_, f64>,
    positions: ArrayView2<'_, i64>,
    style: RopeStyle,
    direction: Direction,
    src: &RefSinCos,
    rotary_dim: usize,
) -> Array4<f64> {
    let sign = match direction {
        Direction::Forward => 1.0,
        Direction::Backward => -1.0,
    };
    let mut y = x.to_owned();
    for ((b, s, h, i), _) in x
        .slice(ndarray::s![.., .., .., ..rotary_dim / 2])
        .indexed_iter()
    {
        let (c, sn) = cos_sin(src, positions[[b, s]], i, rotary_dim);
        let sn = sign * sn;
        let (ia, ib) = pair(style, i, rotary_dim);
        let (a, bb) = (x[[b, s, h, ia]], x[[b, s, h, ib]]);
        y[[b, s, h, ia]] = a * c - bb * sn;
        y[[b, s, h, ib]] = bb * c + a * sn;
    }
    y
}

/// The axis of each pair under Qwen2-VL's mRoPE, as transformers' `apply_multimodal_rotary_pos_emb`
/// builds cos/sin: the frequency vector split into chunks of `mrope_section` (`[s_t, s_h, s_w]`),
/// chunk `i` taken from the position of axis `i % 3`.
pub fn mrope_axes(mrope_section: [usize; 3]) -> Vec<usize> {
    let mut axes = Vec::new();
    for (i, &len) in mrope_section.iter().enumerate() {
        axes.extend(std::iter::repeat_n(i % 3, len));
    }
    axes
}

/// The axis of each pair under Qwen3-VL's interleaved mRoPE, as transformers'
/// `apply_interleaved_mrope` writes it: start from the temporal frequencies, then for
/// `(dim, offset)` in `(1, 1), (2, 2)` overwrite the indices `offset, offset + 3, ...` below
/// `3 * mrope_section[dim]` with axis `dim`'s.
pub fn mrope_interleaved_axes(mrope_section: [usize; 3]) -> Vec<usize> {
    let half: usize = mrope_section.iter().sum();
    let mut axes = vec![0; half];
    for (dim, offset) in [(1usize, 1usize), (2, 2)] {
        let length = mrope_section[dim] * 3;
        for idx in (offset..length.min(half)).step_by(3) {
            axes[idx] = dim;
        }
    }
    axes
}

/// The axis of each pair and its frequency under FLUX's `EmbedND`: the concatenation over axes
/// `a` of `rope(ids[..., a], axes_dim[a], theta)`, whose `omega = 1 / theta^(arange(0, d, 2) / d)`.
pub fn axial(axes_dim: &[usize], theta: f64) -> (Vec<usize>, Vec<f64>) {
    let mut axes = Vec::new();
    let mut inv_freq = Vec::new();
    for (a, &d) in axes_dim.iter().enumerate() {
        for k in (0..d).step_by(2) {
            axes.push(a);
            inv_freq.push(1.0 / theta.powf(k as f64 / d as f64));
        }
    }
    (axes, inv_freq)
}

/// RoPE of `x` in f64 with multi-axis positions and a rotated slice at an offset: pair `i`
/// (`i < rotary_dim / 2`) of token `(b, s)` rotates by the position `positions[axes[i], b, s]`
/// ([`rope_partial`]'s rotation); its elements are those of [`pair`] shifted by
/// `rotary_offset`; every other element passes through. One axis with `axes` all 0 and offset
/// 0 is [`rope_partial`].
#[allow(clippy::too_many_arguments)]
pub fn rope_axes(
    x: ArrayView4<'_, f64>,
    positions: ArrayView3<'_, i64>,
    axes: &[usize],
    style: RopeStyle,
    direction: Direction,
    src: &RefSinCos,
    rotary_dim: usize,
    rotary_offset: usize,
) -> Array4<f64> {
    let sign = match direction {
        Direction::Forward => 1.0,
        Direction::Backward => -1.0,
    };
    let (batch, seq, heads, _) = x.dim();
    let mut y = x.to_owned();
    for b in 0..batch {
        for s in 0..seq {
            for i in 0..rotary_dim / 2 {
                let p = positions[[axes[i], b, s]];
                let (c, sn) = cos_sin(src, p, i, rotary_dim);
                let sn = sign * sn;
                let (ia, ib) = pair(style, i, rotary_dim);
                let (ia, ib) = (ia + rotary_offset, ib + rotary_offset);
                for h in 0..heads {
                    let (a, bb) = (x[[b, s, h, ia]], x[[b, s, h, ib]]);
                    y[[b, s, h, ia]] = a * c - bb * sn;
                    y[[b, s, h, ib]] = bb * c + a * sn;
                }
            }
        }
    }
    y
}

/// The position of each token a context-parallel rank holds, as Megatron-LM's
/// `get_batch_on_this_cp_rank` and Transformer Engine's THD split lay them out: every whole
/// sequence (`cu_seqlens` bound the whole sequences, each length divisible by `2 * size`) is
/// cut into `2 * size` equal chunks of its positions `0..L`, rank `rank` keeps chunks `rank`
/// and `2 * size - 1 - rank` in that order, and the rank's tokens are those of every sequence
/// in turn.
pub fn context_parallel_positions(cu_seqlens: &[u32], size: usize, rank: usize) -> Vec<i64> {
    let mut out = Vec::new();
    for w in cu_seqlens.windows(2) {
        let len = (w[1] - w[0]) as i64;
        let chunk = len / (2 * size as i64);
        for c in [rank as i64, (2 * size - 1 - rank) as i64] {
            out.extend(c * chunk..(c + 1) * chunk);
        }
    }
    out
}
