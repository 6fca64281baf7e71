"""FlashInfer's ``fused_qk_rmsnorm_rope`` (video diffusion transformers, WAN-style) on one
rope_rs launch with the norm across heads. torch is imported by the caller's tensors, never
here."""

import math
import sys
from typing import Any, Dict, Optional, Tuple

from rope_rs import _native

# The positions and cos_sin_cache of each grid and frequency set, per device: built once (as
# FlashInfer keeps its frequency table), so a CUDA graph replays a launch that reads them.
_TABLES: Dict[Tuple[Any, ...], Tuple[Any, Any]] = {}


def axis_frequencies(
    channels: Tuple[int, int, int], base: float, factor: float, low: float, high: float
) -> list:
    """The ``head_dim / 2`` frequencies of FlashInfer's table, in float64: for each axis of
    ``c`` channels (frames, height, width, in that order), ``base ** (-2 i / c)`` for ``i <
    c / 2``; with ``factor != 1``, YaRN's blend ``f / factor * r + f * (1 - r)``, ``r =
    clamp((i - low) / (high - low), 0, 1)`` (``high`` moved by 0.001 where it equals ``low``)."""
    freqs = []
    for c in channels:
        for i in range(c // 2):
            f = base ** (-2.0 * i / c)
            if factor != 1.0:
                hi = high + 0.001 if abs(low - high) <= 1e-6 else high
                ramp = min(max((i - low) / (hi - low), 0.0), 1.0)
                f = f / factor * ramp + f * (1.0 - ramp)
            freqs.append(f)
    return freqs


def _tables(torch: Any, device: Any, grid: Tuple[int, int, int], freqs: list, attention: float, seq: int, tokens: int) -> Tuple[Any, Any]:
    """The ``[3, tokens]`` int32 positions (frame, height, width of token ``t % seq`` on the
    ``ppf x pph x ppw`` grid) and the float32 ``cos_sin_cache`` ``[max(grid), head_dim]`` of
    ``cos(p f_j) * attention`` then ``sin(p f_j) * attention``, computed in float64; kept per
    device, grid and frequencies for eager calls (built in the graph under ``torch.compile``)."""
    if torch.compiler.is_compiling():
        return _build_tables(torch, device, grid, freqs, attention, seq, tokens)
    key = (str(device), grid, tuple(freqs), attention, seq, tokens)
    hit = _TABLES.get(key)
    if hit is None:
        hit = _TABLES[key] = _build_tables(torch, device, grid, freqs, attention, seq, tokens)
    return hit


def _build_tables(torch: Any, device: Any, grid: Tuple[int, int, int], freqs: list, attention: float, seq: int, tokens: int) -> Tuple[Any, Any]:
    """:func:`_tables`' positions and cache, built."""
    _, pph, ppw = grid
    t = torch.arange(tokens, dtype=torch.int64, device=device) % seq
    positions = torch.stack((t // (pph * ppw), t % (pph * ppw) // ppw, t % ppw)).to(torch.int32)
    rows = torch.arange(max(grid), dtype=torch.float64, device=device)[:, None]
    angles = rows * torch.tensor(freqs, dtype=torch.float64, device=device)[None, :]
    cache = (torch.cat((angles.cos(), angles.sin()), dim=1) * attention).to(torch.float32)
    return positions, cache


def fused_qk_rmsnorm_rope(
    qkv: Any,
    q_weight: Any,
    k_weight: Any,
    *,
    ppf: int,
    pph: int,
    ppw: int,
    num_frame_channels: int,
    num_height_channels: int,
    num_width_channels: int,
    num_heads_q: int,
    num_heads_k: int,
    num_heads_v: int,
    head_dim: int,
    eps: float = 1e-6,
    base: float = 10000.0,
    interleave: bool = True,
    factor: float = 1.0,
    low: float = 0.0,
    high: float = 0.0,
    attention_factor: float = 1.0,
    is_qk_norm: bool = True,
    output_fp8: bool = False,
    output_quant_scale: float = 1.0,
    v_quant_scale: float = 1.0,
    q_out: Any = None,
    k_out: Any = None,
    v_out: Any = None,
) -> Tuple[Any, Any, Any]:
    """FlashInfer's ``fused_qk_rmsnorm_rope`` for ``torch.Tensor``s: from the packed ``qkv``
    (``[batch, seq_len, (num_heads_q + num_heads_k + num_heads_v) * head_dim]``, or 2-D
    ``[num_tokens, ...]`` with ``num_tokens`` a multiple of ``ppf * pph * ppw``), q's heads of a
    token are RMS-normalised together, ``x / sqrt(mean(x**2) + eps) * q_weight`` (``q_weight``
    ``[num_heads_q * head_dim]`` of qkv's dtype; k alike with ``k_weight``; no norm with
    ``is_qk_norm=False``), then each head is rotated (interleaved pairs, or NeoX's with
    ``interleave=False``) at its token's frame, height and width on the ``ppf x pph x ppw``
    grid (token ``t`` of a sequence at ``t // (pph ppw)``, ``t // ppw % pph``, ``t % ppw``): the
    first ``num_frame_channels / 2`` pairs by the frame with frequencies ``base ** (-2i /
    num_frame_channels)``, then the height's and the width's pairs alike (YaRN's blend with
    ``factor``, ``low``, ``high``; cos and sin times ``attention_factor``). v is copied. All in
    float32, each output rounded once to qkv's dtype, or with ``output_fp8`` to
    ``float8_e4m3fn`` of ``x * output_quant_scale`` (v's of ``v * v_quant_scale``), saturating.

    Returns ``(q_out, k_out, v_out)``, each ``[..., num_heads_x, head_dim]`` (given ones are
    written). q and k: one rope_rs launch on PyTorch's current stream (cos and sin from a float32
    table of the axes' exact angles, not FlashInfer's ``__sincosf``); v: one copy. Under
    ``torch.compile`` the launch is ``torch.ops.rope_rs.qk_norm_across_rope_``. Raises
    ValueError for sizes FlashInfer refuses and as ``apply_rope`` for the tensors.
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(qkv, torch.Tensor):
        raise TypeError(f"fused_qk_rmsnorm_rope: qkv must be a torch.Tensor, got {type(qkv).__name__}")
    channels = (int(num_frame_channels), int(num_height_channels), int(num_width_channels))
    if sum(channels) != head_dim or any(c % 2 for c in channels):
        raise ValueError(
            f"num_frame_channels, num_height_channels, num_width_channels must be even and sum to "
            f"head_dim {head_dim}, got {channels}"
        )
    grid = (int(ppf), int(pph), int(ppw))
    if min(grid) <= 0:
        raise ValueError(f"ppf, pph, ppw must be positive, got {grid}")
    seq = math.prod(grid)
    heads = (int(num_heads_q), int(num_heads_k), int(num_heads_v))
    if qkv.ndim not in (2, 3) or qkv.shape[-1] != sum(heads) * head_dim:
        raise ValueError(
            f"qkv must be [num_tokens or batch, seq_len, {sum(heads)} * {head_dim}], got {tuple(qkv.shape)}"
        )
    if qkv.ndim == 3 and qkv.shape[1] != seq:
        raise ValueError(f"qkv's seq_len {qkv.shape[1]} is not ppf * pph * ppw = {seq}")
    tokens = qkv.shape[0] * (qkv.shape[1] if qkv.ndim == 3 else 1)
    if tokens % seq:
        raise ValueError(f"qkv's {tokens} tokens are not a multiple of ppf * pph * ppw = {seq}")
    lead = tuple(qkv.shape[:-1])
    flat = qkv.view(tokens, sum(heads), head_dim)
    hq, hk, _ = heads
    q, k, v = flat[:, :hq], flat[:, hq : hq + hk], flat[:, hq + hk :]
    dtype = torch.float8_e4m3fn if output_fp8 else qkv.dtype
    outs = []
    for out, h in zip((q_out, k_out, v_out), heads):
        outs.append(out if out is not None else torch.empty(lead + (h, head_dim), dtype=dtype, device=qkv.device))
    freqs = axis_frequencies(channels, float(base), float(factor), float(low), float(high))
    positions, cache = _tables(torch, qkv.device, grid, freqs, float(attention_factor), seq, tokens)
    view = lambda o, h: o.view(tokens, h, head_dim)  # noqa: E731
    args = (
        q, k, view(outs[0], hq), view(outs[1], hk),
        q_weight if is_qk_norm else None, k_weight if is_qk_norm else None,
        cache, positions, [c // 2 for c in channels], head_dim, float(eps), not interleave,
        float(output_quant_scale) if output_fp8 else None,
    )
    if torch.compiler.is_compiling():
        import rope_rs.torch as ops  # registers the operators (once; dynamo runs the import)

        ops.qk_norm_across_rope_op(*args)
    else:
        _native._qk_norm_across_rope(*args, torch.cuda.current_stream(qkv.device).cuda_stream)
    v_view = view(outs[2], heads[2])
    if output_fp8:
        v_view.copy_((v.float() * v_quant_scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn))
    else:
        v_view.copy_(v)
    return outs[0], outs[1], outs[2]
