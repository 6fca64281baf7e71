"""rope-rs for ``torch.Tensor``s, eagerly: what ``rope_rs.apply_rope`` dispatches to for them.

Everything of ``rope_rs.torch`` but the custom operators (see that module for the whole). This
module imports nothing of ``torch.compile``'s machinery (``torch._dynamo``, ``torch.library``'s
custom operators, which pull in ``torch.fx`` and triton and take seconds to import), so an eager
process pays none of it: under ``torch.compile`` (``torch.compiler.is_compiling()``), the calls
here import ``rope_rs.torch``, which registers the operators, and go through them.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union, get_type_hints

import torch
from torch import Tensor

import rope_rs
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
    host_inv_freq: Optional[List[float]]
    attention_factor: Optional[float]
    angle: Optional[str]
    scaling: Optional[str]
    rotary_dim: Optional[int]
    backward: bool
    cp_size: int
    cp_rank: int
    pdl: bool
    mrope_section: Optional[List[int]]
    mrope_interleaved: bool
    axes_dim: Optional[List[int]]

    def flipped(self) -> "Options":
        """The same launch in the other direction (the gradient's)."""
        return self._replace(backward=not self.backward)


# The tensor fields of `Options`, saved for backward by the custom operators.
_TENSOR_FIELDS = tuple(f for f, t in get_type_hints(Options).items() if t == Optional[Tensor])

# The arguments of ``rope_rs.apply_rope`` that `Options` describes, with their defaults: its
# keyword-only parameters but those that say where the results go and on which stream.
_OPTION_DEFAULTS: Dict[str, Any] = {
    name: p.default
    for name, p in inspect.signature(rope_rs.apply_rope).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and name not in ("inplace", "out", "k_out", "stream")
}


def _scaling_json(scaling: Any) -> str:
    """A ``scaling=`` dict as JSON text, how the custom operators carry it (rope-host reads it)."""
    if not isinstance(scaling, dict):
        raise TypeError(f"scaling must be a dict (a config's rope_scaling), got {type(scaling).__name__}")
    return json.dumps(scaling)


def options(q: Tensor, **given: Any) -> Options:
    """The :class:`Options` of ``rope_rs.apply_rope``'s keyword arguments (all but ``inplace``,
    ``out``, ``k_out`` and ``stream``; the same names and defaults) for tensors like `q`:
    positions split into an int offset and a tensor, a ``scaling`` dict as JSON text, host
    ``inv_freq`` as a list of floats, a device ``inv_freq`` of another dtype converted to float64.
    Everything else is checked by the native call.

    Raises TypeError for an argument ``rope_rs.apply_rope`` does not take.
    """
    for name in given:
        if name not in _OPTION_DEFAULTS:
            raise TypeError(f"options() got an unexpected keyword argument {name!r}")
    a = {**_OPTION_DEFAULTS, **given}
    positions, inv_freq, scaling = a.pop("positions"), a.pop("inv_freq"), a.pop("scaling")
    if isinstance(positions, Tensor):
        offset, row_offsets = 0, positions
    elif positions is None:
        offset, row_offsets = 0, None
    elif isinstance(positions, bool) or not isinstance(positions, int):
        raise TypeError(f"positions must be an int (an offset) or a CUDA int32/int64 tensor, got {type(positions).__name__}")
    else:
        offset, row_offsets = positions, None
    if scaling is not None:
        to_json = _scaling_json
        if torch.compiler.is_compiling():
            from rope_rs.torch import scaling_json_outside_graph as to_json
        scaling = to_json(scaling)
    host_inv_freq = None
    if inv_freq is not None and not isinstance(inv_freq, Tensor):
        inv_freq, host_inv_freq = None, [float(f) for f in inv_freq]
    elif inv_freq is not None and (inv_freq.dtype != torch.float64 or inv_freq.device != q.device):
        inv_freq = inv_freq.to(device=q.device, dtype=torch.float64)
    for name in ("mrope_section", "axes_dim"):
        if a[name] is not None:
            a[name] = [int(n) for n in a[name]]
    numbers = {
        "theta": float,
        "attention_factor": float,
        "backward": bool,
        "cp_size": int,
        "cp_rank": int,
        "pdl": bool,
        "mrope_interleaved": bool,
    }
    for name, kind in numbers.items():
        if a[name] is not None:
            a[name] = kind(a[name])
    a.update(offset=offset, row_offsets=row_offsets, inv_freq=inv_freq, host_inv_freq=host_inv_freq, scaling=scaling)
    return Options(*[a[f] for f in Options._fields])


def _stream(q: Tensor) -> int:
    """PyTorch's current stream of q's device, as a `CUstream` int: by the DLPack C exchange API
    when torch has it (no stream object built), else from ``torch.cuda.current_stream``."""
    if not q.is_cuda:
        return 0
    current = _native._current_stream(q)
    return torch.cuda.current_stream(q.device).cuda_stream if current is None else current


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
    kwargs = {f: _plain(v) if isinstance(v, Tensor) else v for f, v in zip(Options._fields, o)}
    offset, row_offsets, host_inv_freq = kwargs.pop("offset"), kwargs.pop("row_offsets"), kwargs.pop("host_inv_freq")
    kwargs["positions"] = offset if row_offsets is None else row_offsets
    if host_inv_freq is not None:
        kwargs["inv_freq"] = host_inv_freq
    _native.apply_rope(
        _plain(q),
        _plain(k),
        out=out,
        k_out=k_out,
        stream=_stream(q) if stream is None else stream,
        # On the current stream, the tensors' writers are already ordered before the launch.
        producer_sync=stream is not None,
        **kwargs,
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
    k: Optional[Tensor],
    given: Dict[str, Any],
    *,
    inplace: bool = False,
    out: Optional[Tensor] = None,
    k_out: Optional[Tensor] = None,
    stream: Optional[int] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """``rope_rs.apply_rope`` for ``torch.Tensor``s, which dispatches here with its other keyword
    arguments in `given` (see its docstring).

    Eagerly and without autograd, one native launch on PyTorch's current stream (or ``stream``),
    into ``out``/``k_out`` or tensors from ``torch.empty_like``. When q or k requires grad (and
    grad mode is on), through :class:`RopeFunction`; under ``torch.compile``, through the custom
    operators. ``out``, ``k_out`` and ``stream`` belong to the first path only; in-place calls
    are not recorded for autograd.
    """
    o = options(q, **given)
    compiling = torch.compiler.is_compiling()
    grad = torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad))
    if inplace and (out is not None or k_out is not None):
        raise ValueError("out: inplace=True rotates q and k themselves; give out and k_out only out of place")
    for name, t in (("out", out), ("k_out", k_out)):
        if t is not None and t.requires_grad:
            raise ValueError(f"{name}: requires grad, and rope_rs writes it outside autograd; pass a tensor that does not")
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


# Per device, int32 vectors `[0, 2, 4, ...]` of growing length, made outside CUDA graph captures
# and never written or freed (launches on any stream, and captured graphs, may read a prefix).
_EVEN_POSITIONS: Dict[torch.device, List[Tensor]] = {}


def _even_positions(device: torch.device, n: int) -> Tensor:
    """`[0, 2, ..., 2 (n - 1)]` as int32 on `device`: a prefix of a kept vector, so that a
    decode loop launches no ``arange`` per call."""
    kept = _EVEN_POSITIONS.get(device)
    if kept and kept[-1].shape[0] >= n:
        return kept[-1][:n]
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return torch.arange(0, 2 * n, 2, device=device, dtype=torch.int32)
    longest = max(n, 2 * kept[-1].shape[0] if kept else 4096)
    made = torch.arange(0, 2 * longest, 2, device=device, dtype=torch.int32)
    # Complete before any stream reads it (later calls may launch on other streams).
    torch.cuda.current_stream(device).synchronize()
    _EVEN_POSITIONS.setdefault(device, []).append(made)
    return made[:n]


def _hf_rows(t: Tensor, position_ids: Optional[Tensor], batch: int, seq: int, name: str) -> Tensor:
    """HF's per-token `cos` or `sin` (`t`) as a rope-rs table of half rows: row `j` of HF's
    `[rows, r]` (`cat(freqs, freqs)`) is half rows `2j` (the cos or sin of the frequencies) and
    `2j + 1` (the same again), so token (b, s) reads half row `2 j(b, s)`."""
    if position_ids is not None and t.dim() == 2:
        # Older transformers: cos [max_position, r], indexed by position_ids [batch, seq].
        rows = t
    else:
        rows = t.unsqueeze(0) if t.dim() == 2 else t
        if rows.dim() != 3 or rows.shape[1] != seq or rows.shape[0] not in (1, batch):
            raise ValueError(
                f"{name} must be [batch or 1, seq, rotary_dim] for q of batch {batch} and seq {seq}, got shape "
                f"{tuple(t.shape)}"
            )
        # One row of positions for every batch row (HF's usual [1, seq, r]), else one per token.
        rows = rows[0] if rows.shape[0] == 1 or rows.stride(0) == 0 else rows
    return rows.contiguous().view(-1, t.shape[-1] // 2)


def _hf_ids(q: Tensor, cos: Tensor, position_ids: Optional[Tensor], batch: int, seq: int) -> Tensor:
    """The half row of `_hf_rows`'s table each token reads: `2 position_ids` for a
    `[max_position, r]` table, `2 s` for rows shared by the batch, `2 (b seq + s)` otherwise."""
    if position_ids is not None and cos.dim() == 2:
        return (position_ids * 2).to(torch.int64)
    if cos.dim() == 2 or cos.shape[0] == 1 or cos.stride(0) == 0:
        return _even_positions(q.device, seq)
    return torch.arange(0, 2 * batch * seq, 2, device=q.device, dtype=torch.int64).view(batch, seq)


# The last cos/sin a Hugging Face call read, with what it made of them: `(cos, sin, key, cos
# rows, sin rows, ids)`, the key being `rope_rs._native._hf_key`'s (cos's and sin's addresses,
# q's batch, seq, dtype and CUDA device). A model passes the same cos and sin tensors to every layer of a forward, so
# the views and ids are made once per forward. Kept only when the rows are views of cos and sin
# (no copy or conversion): then they read whatever cos and sin hold, and holding them keeps that
# memory allocated. An entry is used for the same cos and sin objects, still at the same
# addresses, with q of the same batch, length, dtype and device.
_HF_TABLES: List[Tuple[Tensor, Tensor, Any, Tensor, Tensor, Tensor]] = []


def _hf_tables(
    q: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor], batch: int, seq: int, unsqueeze_dim: int
) -> Tuple[Tensor, Tensor, Tensor]:
    """HF's cos and sin (already checked and converted) as rope-rs tables of half rows and the
    half row each token reads (`_hf_rows`, `_hf_ids`), kept for the next call when they are
    views (see `_HF_TABLES`)."""
    cos_rows = _hf_rows(cos, position_ids, batch, seq, "cos")
    sin_rows = _hf_rows(sin, position_ids, batch, seq, "sin")
    ids = _hf_ids(q, cos, position_ids, batch, seq)
    views = cos_rows.data_ptr() == cos.data_ptr() and sin_rows.data_ptr() == sin.data_ptr()
    # Ids from position_ids (older transformers) change with its contents: never kept.
    if (
        position_ids is None
        and views
        and not torch.compiler.is_compiling()
        and not torch.cuda.is_current_stream_capturing()
    ):
        key = _native._hf_key(q, cos, sin, unsqueeze_dim)
        if key is not None:
            _HF_TABLES[:] = [(cos, sin, key, cos_rows, sin_rows, ids)]
    return cos_rows, sin_rows, ids


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
    rows (rope-rs tables are ``[positions, rotary_dim / 2]``), at positions read from a vector of
    even numbers kept per device (one launch per call; cos/sin given per batch row take an
    ``arange`` of int64 too). Raises ValueError naming the argument for shapes
    that do not fit.
    """
    kept = _HF_TABLES[0] if _HF_TABLES and position_ids is None else None
    if (
        kept is not None
        and kept[0] is cos
        and kept[1] is sin
        and not torch.compiler.is_compiling()
        and not (torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)))
    ):
        # The kept tables, nothing for autograd: one native call checks their key, allocates the
        # outputs and launches on the current stream (None: the rest of this function decides).
        rotated = _native._apply_rotary_pos_emb_eager(q, k, unsqueeze_dim, kept)
        if rotated is not None:
            return rotated
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
    if (
        kept is not None
        and kept[0] is cos
        and kept[1] is sin
        and not torch.compiler.is_compiling()
        and kept[2] == _native._hf_key(q, cos, sin, unsqueeze_dim)
    ):
        cos_rows, sin_rows, ids = kept[3:]
    else:
        if cos.shape != sin.shape:
            raise ValueError(f"sin has shape {tuple(sin.shape)}, cos {tuple(cos.shape)}")
        rotary_dim = cos.shape[-1]
        if rotary_dim % 2:
            raise ValueError(f"cos must have an even last dimension (rotary_dim), got {rotary_dim}")
        if cos.dtype not in (torch.float32, q.dtype):
            cos, sin = cos.float(), sin.float()
        cos_rows, sin_rows, ids = _hf_tables(q, cos, sin, position_ids, batch, seq, unsqueeze_dim)
    direct = rope_rs._direct(torch, q, k, None, None, None, None)
    if direct is None:
        # Autograd, torch.compile, another device: the public call's full path.
        rotated = rope_rs.apply_rope(q, k, position_ids=ids, cos=cos_rows, sin=sin_rows, layout=layout)
        return (rotated, None) if k is None else rotated
    q_out = torch.empty_like(q)
    k_out = None if k is None else torch.empty_like(k)
    stream, sync = direct
    # By position, in the native signature's order (see rope_rs.apply_rope).
    _native.apply_rope(
        q, k, q_out, k_out, None, ids, None, layout, "neox", None, None, cos_rows, sin_rows,
        None, None, None, None, None, False, stream, sync, 1, 0, False,
    )
    return q_out, k_out
