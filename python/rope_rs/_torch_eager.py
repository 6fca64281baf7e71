"""rope-rs for ``torch.Tensor``s, eagerly: what ``rope_rs.apply_rope`` dispatches to for them.

Everything of ``rope_rs.torch`` but the custom operators (see that module for the whole). This
module imports nothing of ``torch.compile``'s machinery (``torch._dynamo``, ``torch.library``'s
custom operators, which pull in ``torch.fx`` and triton and take seconds to import), so an eager
process pays none of it: under ``torch.compile`` (``torch.compiler.is_compiling()``), the calls
here import ``rope_rs.torch``, which registers the operators, and go through them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from rope_rs import _native

__all__ = ["apply_rope", "apply_rotary_pos_emb", "RopeFunction", "Options", "options"]


class Options(NamedTuple):
    """Everything of a launch but the tensors to rotate, in the custom operators' argument order
    (see ``rope_rs.apply_rope`` for each field's meaning); build it with :func:`options`."""

    offset: int
    row_offsets: Optional[Tensor]
    position_ids: Optional[Tensor]
    cu_seqlens: Optional[Tensor]
    layout: Optional[str]
    style: str
    theta: Optional[float]
    cos_sin_cache: Optional[Tensor]
    cos: Optional[Tensor]
    sin: Optional[Tensor]
    inv_freq: Optional[Tensor]
    attention_factor: Optional[float]
    angle: Optional[str]
    rotary_dim: Optional[int]
    backward: bool
    cp_size: int
    cp_rank: int
    pdl: bool

    def flipped(self) -> "Options":
        """The same launch in the other direction (the gradient's)."""
        return self._replace(backward=not self.backward)


# The tensor fields of `Options`, saved for backward by the custom operators.
_TENSOR_FIELDS = ("row_offsets", "position_ids", "cu_seqlens", "cos_sin_cache", "cos", "sin", "inv_freq")

# Frequency vectors of `scaling=` dicts and host `inv_freq=` lists, per device: (inv_freq float64
# tensor, attention factor). Kept for the process's lifetime: launches on other streams and
# captured graphs may read them at any later time.
_FREQUENCIES: dict = {}


def _frozen(value: Any) -> Any:
    """`value` as a hashable key (dicts and lists of a config as tuples)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


def _frequencies(
    device: torch.device, head_dim: int, theta: Optional[float], scaling: Any, rotary_dim: Optional[int]
) -> Tuple[Tensor, float]:
    """The float64 `inv_freq` tensor on `device` and the attention factor of a `scaling` dict."""
    key = (device, head_dim, theta, rotary_dim, _frozen(scaling))
    try:
        cached = _FREQUENCIES.get(key)
    except TypeError:  # an unhashable value inside `scaling`
        key, cached = None, None
    if cached is not None:
        return cached
    inv_freq, attention = _native.frequencies(head_dim, theta=theta, scaling=scaling, rotary_dim=rotary_dim)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            "scaling: its frequencies are uploaded to the GPU on first use, which cannot happen while "
            "the stream is capturing a CUDA graph; make the same call once before capturing (a warm-up run)"
        )
    cached = (torch.tensor(inv_freq, dtype=torch.float64, device=device), attention)
    if key is not None:
        _FREQUENCIES[key] = cached
    return cached


def _host_inv_freq(device: torch.device, inv_freq: Any) -> Tensor:
    """A host sequence of frequencies as a float64 tensor on `device`, uploaded once."""
    values = tuple(float(f) for f in inv_freq)
    key = (device, "inv_freq", values)
    cached = _FREQUENCIES.get(key)
    if cached is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                "inv_freq: a host sequence is uploaded to the GPU on first use, which cannot happen while "
                "the stream is capturing a CUDA graph; pass a CUDA tensor, or make the same call once before "
                "capturing"
            )
        cached = (torch.tensor(values, dtype=torch.float64, device=device), 1.0)
        _FREQUENCIES[key] = cached
    return cached[0]


def options(
    q: Tensor,
    *,
    positions: Union[int, Tensor, None] = None,
    position_ids: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    layout: Optional[str] = None,
    style: str = "neox",
    theta: Optional[float] = None,
    cos_sin_cache: Optional[Tensor] = None,
    cos: Optional[Tensor] = None,
    sin: Optional[Tensor] = None,
    inv_freq: Any = None,
    attention_factor: Optional[float] = None,
    angle: Optional[str] = None,
    scaling: Optional[dict] = None,
    rotary_dim: Optional[int] = None,
    backward: bool = False,
    cp_size: int = 1,
    cp_rank: int = 0,
    pdl: bool = False,
) -> Options:
    """The :class:`Options` of ``rope_rs.apply_rope``'s arguments for tensors like `q`: positions
    split into an int offset and a tensor, ``scaling`` and host ``inv_freq`` turned into a float64
    ``inv_freq`` tensor on q's device (with ``scaling``'s attention factor), a device ``inv_freq``
    of another dtype converted to float64. Everything else is checked by the native call.

    Raises ValueError as ``rope_rs.apply_rope`` does for ``scaling`` combined with another sin/cos
    source or with ``attention_factor``.
    """
    if isinstance(positions, Tensor):
        offset, row_offsets = 0, positions
    elif positions is None:
        offset, row_offsets = 0, None
    elif isinstance(positions, bool) or not isinstance(positions, int):
        raise TypeError(f"positions must be an int (an offset) or a CUDA int32/int64 tensor, got {type(positions).__name__}")
    else:
        offset, row_offsets = positions, None
    if scaling is not None:
        if inv_freq is not None or cos_sin_cache is not None or cos is not None or sin is not None:
            raise ValueError(
                "cos_sin_cache: give one sin/cos source: cos_sin_cache, cos and sin, inv_freq, or scaling "
                "(with theta), or theta alone"
            )
        if attention_factor is not None:
            raise ValueError('attention_factor: give it inside scaling ("attention_factor")')
        frequencies = _frequencies
        if torch.compiler.is_compiling():
            from rope_rs.torch import frequencies_outside_graph as frequencies
        inv_freq, attention_factor = frequencies(q.device, q.shape[-1], theta, scaling, rotary_dim)
        theta = None
    elif inv_freq is not None:
        if not isinstance(inv_freq, Tensor):
            host_inv_freq = _host_inv_freq
            if torch.compiler.is_compiling():
                from rope_rs.torch import host_inv_freq_outside_graph as host_inv_freq
            inv_freq = host_inv_freq(q.device, inv_freq)
        elif inv_freq.dtype != torch.float64 or inv_freq.device != q.device:
            inv_freq = inv_freq.to(device=q.device, dtype=torch.float64)
    return Options(
        offset,
        row_offsets,
        position_ids,
        cu_seqlens,
        layout,
        style,
        None if theta is None else float(theta),
        cos_sin_cache,
        cos,
        sin,
        inv_freq,
        None if attention_factor is None else float(attention_factor),
        angle,
        rotary_dim,
        bool(backward),
        int(cp_size),
        int(cp_rank),
        bool(pdl),
    )


def _stream(device: torch.device) -> int:
    """PyTorch's current stream of `device`, as a `CUstream` int."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _plain(t: Optional[Tensor]) -> Optional[Tensor]:
    """`t` as DLPack exports it: PyTorch refuses to export tensors that require grad."""
    return t.detach() if t is not None and t.requires_grad else t


def _launch(
    q: Tensor,
    k: Optional[Tensor],
    out: Optional[Tensor],
    k_out: Optional[Tensor],
    o: Options,
    stream: Optional[int] = None,
) -> None:
    """One native launch of `o` on PyTorch's current stream of q's device (or `stream`)."""
    for name, t in (
        ("k", k),
        ("out", out),
        ("k_out", k_out),
        ("positions", o.row_offsets),
        ("position_ids", o.position_ids),
        ("cu_seqlens", o.cu_seqlens),
        ("cos_sin_cache", o.cos_sin_cache),
        ("cos", o.cos),
        ("sin", o.sin),
        ("inv_freq", o.inv_freq),
    ):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        # PyTorch exports tensors by DLPack only from the current device.
        with torch.cuda.device(q.device):
            return _launch(q, k, out, k_out, o, stream)
    _native.apply_rope(
        _plain(q),
        _plain(k),
        out=out,
        k_out=k_out,
        positions=o.offset if o.row_offsets is None else _plain(o.row_offsets),
        position_ids=_plain(o.position_ids),
        cu_seqlens=_plain(o.cu_seqlens),
        layout=o.layout,
        style=o.style,
        theta=o.theta,
        cos_sin_cache=_plain(o.cos_sin_cache),
        cos=_plain(o.cos),
        sin=_plain(o.sin),
        inv_freq=_plain(o.inv_freq),
        attention_factor=o.attention_factor,
        angle=o.angle,
        rotary_dim=o.rotary_dim,
        backward=o.backward,
        cp_size=o.cp_size,
        cp_rank=o.cp_rank,
        pdl=o.pdl,
        stream=_stream(q.device) if stream is None else stream,
        # On the current stream, the tensors' writers are already ordered before the launch.
        producer_sync=stream is not None,
    )


def _rotated(q: Tensor, k: Optional[Tensor], o: Options) -> Tuple[Tensor, Optional[Tensor]]:
    """New tensors holding q and k rotated by `o`."""
    out = torch.empty_like(q)
    k_out = None if k is None else torch.empty_like(k)
    _launch(q, k, out, k_out, o)
    return out, k_out


def _gradient(g: Optional[Tensor]) -> Optional[Tensor]:
    """An incoming gradient in a form the kernels read: a contiguous last dimension (gradients
    of reductions arrive expanded, with stride 0)."""
    if g is None or g.stride(-1) == 1 or g.shape[-1] == 1:
        return g
    return g.contiguous()


class RopeFunction(torch.autograd.Function):
    """RoPE as a ``torch.autograd.Function``: ``RopeFunction.apply(q, k, options)`` returns new
    ``(q_out, k_out)`` (``k_out`` is None without k); the backward rotates the incoming gradients
    by the transposed rotation (the same launch with ``backward`` flipped), itself through
    ``RopeFunction``, so higher derivatives work too. No gradient flows to positions, tables or
    frequencies. ``rope_rs.apply_rope`` uses it when q or k requires grad outside
    ``torch.compile``."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Optional[Tensor], o: Options) -> Tuple[Tensor, Optional[Tensor]]:
        ctx.options = o
        return _rotated(q, k, o)

    @staticmethod
    def backward(ctx: Any, grad_q: Optional[Tensor], grad_k: Optional[Tensor]) -> Tuple[Any, ...]:
        o = ctx.options.flipped()
        grad_q, grad_k = _gradient(grad_q), _gradient(grad_k)
        if grad_q is None and grad_k is None:
            return None, None, None
        if grad_q is None:
            dk, _ = RopeFunction.apply(grad_k, None, o)
            return None, dk, None
        dq, dk = RopeFunction.apply(grad_q, grad_k, o)
        return dq, dk, None


def _result(q: Tensor, k: Optional[Tensor]) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    return q if k is None else (q, k)


def apply_rope(
    q: Tensor,
    k: Optional[Tensor] = None,
    *,
    positions: Union[int, Tensor, None] = None,
    position_ids: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    layout: Optional[str] = None,
    style: str = "neox",
    theta: Optional[float] = None,
    cos_sin_cache: Optional[Tensor] = None,
    cos: Optional[Tensor] = None,
    sin: Optional[Tensor] = None,
    inv_freq: Any = None,
    attention_factor: Optional[float] = None,
    angle: Optional[str] = None,
    scaling: Optional[dict] = None,
    rotary_dim: Optional[int] = None,
    inplace: bool = False,
    out: Optional[Tensor] = None,
    k_out: Optional[Tensor] = None,
    backward: bool = False,
    stream: Optional[int] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    pdl: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``rope_rs.apply_rope`` for ``torch.Tensor``s (see its docstring); it dispatches here.

    Eagerly and without autograd, one native launch on PyTorch's current stream (or ``stream``),
    into ``out``/``k_out`` or tensors from ``torch.empty_like``. When q or k requires grad (and
    grad mode is on), through :class:`RopeFunction`; under ``torch.compile``, through the custom
    operators. ``out``, ``k_out`` and ``stream`` belong to the first path only; in-place calls
    are not recorded for autograd.
    """
    o = options(
        q,
        positions=positions,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        layout=layout,
        style=style,
        theta=theta,
        cos_sin_cache=cos_sin_cache,
        cos=cos,
        sin=sin,
        inv_freq=inv_freq,
        attention_factor=attention_factor,
        angle=angle,
        scaling=scaling,
        rotary_dim=rotary_dim,
        backward=backward,
        cp_size=cp_size,
        cp_rank=cp_rank,
        pdl=pdl,
    )
    compiling = torch.compiler.is_compiling()
    grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))
    if inplace and (out is not None or k_out is not None):
        raise ValueError("out: inplace=True rotates q and k themselves; give out and k_out only out of place")
    if inplace and grad:
        raise ValueError(
            "inplace: in-place rotation is not recorded for autograd; use inplace=False (the default) "
            "for tensors that require grad"
        )
    if compiling or grad:
        for name, value in (("out", out), ("k_out", k_out), ("stream", stream)):
            if value is not None:
                why = "torch.compile" if compiling else "autograd"
                raise ValueError(f"{name}: not with {why} (use torch.cuda.stream(...) to pick the stream)")
    if compiling:
        # Importing rope_rs.torch registers the custom operators (once; dynamo runs the import).
        import rope_rs.torch as ops

        if inplace:
            if k is None:
                ops.rope_inplace_op(q, *o)
            else:
                ops.rope_qk_inplace_op(q, k, *o)
            return _result(q, k)
        if k is None:
            return ops.rope_op(q, *o)
        return ops.rope_qk_op(q, k, *o)
    if grad:
        q_out, k_out = RopeFunction.apply(q, k, o)
        return _result(q_out, k_out)
    if inplace:
        _launch(q, k, None, None, o, stream)
        return _result(q, k)
    if out is None:
        out = torch.empty_like(q)
    if k is not None and k_out is None:
        k_out = torch.empty_like(k)
    _launch(q, k, out, k_out, o, stream)
    return _result(out, k_out)


def _hf_positions(
    q: Tensor, cos: Tensor, position_ids: Optional[Tensor], batch: int, seq: int
) -> Tuple[Tensor, Tensor]:
    """HF's per-token cos rows as a rope-rs table of half rows, and the position of each token
    in it: row `t` of HF's `[rows, r]` (`cat(freqs, freqs)`) is half rows `2t` (cos of the
    frequencies) and `2t + 1` (the same again), so token (b, s) reads half row `2 t(b, s)`."""
    if position_ids is not None and cos.dim() == 2:
        # Older transformers: cos [max_position, r], indexed by position_ids [batch, seq].
        return cos, (position_ids * 2).to(torch.int64)
    if cos.dim() == 2:
        cos = cos.unsqueeze(0)
    if cos.dim() != 3 or cos.shape[1] != seq or cos.shape[0] not in (1, batch):
        raise ValueError(
            f"cos must be [batch or 1, seq, rotary_dim] for q of batch {batch} and seq {seq}, got shape "
            f"{tuple(cos.shape)}"
        )
    if cos.shape[0] == 1 or cos.stride(0) == 0:
        # One row of positions for every batch row (HF's usual [1, seq, r]).
        return cos[0], torch.arange(0, 2 * seq, 2, device=q.device, dtype=torch.int32)
    ids = torch.arange(0, 2 * batch * seq, 2, device=q.device, dtype=torch.int64)
    return cos, ids.view(batch, seq)


def apply_rotary_pos_emb(
    q: Tensor,
    k: Optional[Tensor],
    cos: Tensor,
    sin: Tensor,
    position_ids: Optional[Tensor] = None,
    unsqueeze_dim: int = 1,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Hugging Face's ``apply_rotary_pos_emb`` (``transformers.models.llama.modeling_llama``) on
    rope-rs's kernels: returns new ``(q_embed, k_embed)``, differentiable, like
    ``(q * cos) + (rotate_half(q) * sin)``.

    q and k are ``[batch, heads, seq, head_dim]`` (``unsqueeze_dim=1``, HF's default) or
    ``[batch, seq, heads, head_dim]`` (``unsqueeze_dim=2``), with any strides but a contiguous last
    dimension and any head counts. ``cos`` and ``sin`` are what HF's rotary embedding returns:
    ``[batch or 1, seq, rotary_dim]``, each row ``cat(freqs, freqs)`` (the same half twice, as HF
    builds them; the second half is not read), float32 or q's dtype (others are converted to
    float32). ``rotary_dim`` may be below head_dim: the first ``rotary_dim`` features rotate, the
    rest are copied (what partial-rotary models do around this function). Older transformers
    passed ``cos``/``sin`` as ``[max_position, rotary_dim]`` tables with ``position_ids``
    ``[batch, seq]``; that form works too (``position_ids`` is otherwise unused, as in HF).

    Nothing is copied but into the outputs: the cos/sin rows are read in place as a table of half
    rows (rope-rs tables are ``[positions, rotary_dim / 2]``), at positions from one small
    ``arange`` of int32 (int64 per batch row). Raises ValueError naming the argument for shapes
    that do not fit.
    """
    if unsqueeze_dim == 1:
        layout, batch, seq = "bhsd", q.shape[0], q.shape[2]
    elif unsqueeze_dim == 2:
        layout, batch, seq = "bshd", q.shape[0], q.shape[1]
    else:
        raise ValueError(
            f"unsqueeze_dim must be 1 (q [batch, heads, seq, head_dim]) or 2 (q [batch, seq, heads, head_dim]), "
            f"got {unsqueeze_dim}"
        )
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D for apply_rotary_pos_emb, got shape {tuple(q.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"sin has shape {tuple(sin.shape)}, cos {tuple(cos.shape)}")
    rotary_dim = cos.shape[-1]
    if rotary_dim % 2:
        raise ValueError(f"cos must have an even last dimension (rotary_dim), got {rotary_dim}")
    if cos.dtype not in (torch.float32, q.dtype):
        cos, sin = cos.float(), sin.float()
    cos_rows, ids = _hf_positions(q, cos, position_ids, batch, seq)
    sin_rows, _ = _hf_positions(q, sin, position_ids, batch, seq)
    half = rotary_dim // 2
    rotated = apply_rope(
        q,
        k,
        position_ids=ids,
        cos=cos_rows.contiguous().view(-1, half),
        sin=sin_rows.contiguous().view(-1, half),
        layout=layout,
    )
    return (rotated, None) if k is None else rotated
