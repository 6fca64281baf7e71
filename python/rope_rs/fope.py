"""vLLM's ``FourierRotaryEmbedding`` (FoPE: cos and sin learned per kv head) on one rope_rs
rotation with tables. torch is imported by the caller's tensors, never here."""

import math
import sys
from typing import Any, Optional, Tuple

import rope_rs
from rope_rs.dual_chunk import check_sizes


class FourierRotaryEmbedding:
    """vLLM's ``FourierRotaryEmbedding(head_size, rotary_dim, max_position_embeddings, base,
    is_neox_style, dtype, init_cache, num_key_value_heads, num_inv_freq, fope_sep_head,
    fope_init_factor)`` as a callable with its ``forward``; the model's ``cos_coef`` and
    ``sin_coef`` (``[num_key_value_heads, D, D]``) are given by :meth:`set_coefficients`.

    The tables, as vLLM computes them: ``inv_freq[i] = 1 / base ** (2i / rotary_dim)`` in
    float32, keeping the first ``num_inv_freq`` (or, without it, those above ``2 pi /
    max_position_embeddings``): ``D`` of them; ``c = cos(t inv_freq) @ cos_coef[h]`` and ``s =
    sin(t inv_freq) @ sin_coef[h]`` per position ``t`` and kv head ``h`` (the first head's
    coefficients for every head without ``fope_sep_head``), padded to ``head_size / 2`` pairs
    with ``c = 1``, ``s = 0`` (those pairs pass through), rounded to ``dtype``.

    ``forward(positions, query, key, offsets=None)`` returns new tensors of ``query``'s and
    ``key``'s shapes (``[num_tokens, heads * head_size]``), the inputs unchanged: each head's
    rotate-half pairs ``(x_i, x_{i + head_size / 2})`` become ``(x_i c_i - x_{i+half} s_i,
    x_{i+half} c_i + x_i s_i)`` with its kv head's ``c`` and ``s`` at the token's position (q
    head ``j`` of ``H`` takes kv head ``j // (H / num_key_value_heads)``, as vLLM's reshape
    groups them), computed in float32 and rounded once. One rope_rs launch on PyTorch's current
    stream: the heads viewed as ``[num_tokens, kv_heads, heads per kv head, head_size]`` and
    rotated at position ``p * kv_heads + h`` in tables of ``max_position_embeddings * kv_heads``
    rows; a position outside the tables makes that token's outputs NaN (vLLM's ``index_select``
    raises).

    Raises ValueError for sizes vLLM's class could not serve, for a call before
    :meth:`set_coefficients`, and for heads that are not whole groups of the kv heads; TypeError
    for tensors other than ``torch.Tensor``; and as ``apply_rope`` for the tensors.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: Any = None,
        init_cache: bool = True,
        num_key_value_heads: int = 1,
        num_inv_freq: Optional[int] = None,
        fope_sep_head: bool = True,
        fope_init_factor: float = 0.0,
    ) -> None:
        check_sizes(head_size, rotary_dim, max_position_embeddings)
        if head_size % 2:
            raise ValueError(f"head_size must be even, got {head_size}")
        if num_key_value_heads <= 0:
            raise ValueError(f"num_key_value_heads must be positive, got {num_key_value_heads}")
        if num_inv_freq is not None and not 0 < num_inv_freq <= min(rotary_dim, head_size) // 2:
            raise ValueError(
                f"num_inv_freq must lie in 1..={min(rotary_dim, head_size) // 2}, got {num_inv_freq}"
            )
        self.head_size, self.rotary_dim, self.base = head_size, rotary_dim, float(base)
        self.max_position_embeddings, self.is_neox_style, self.dtype = max_position_embeddings, is_neox_style, dtype
        self.num_key_value_heads, self.num_inv_freq = num_key_value_heads, num_inv_freq
        self.fope_sep_head, self.fope_init_factor = bool(fope_sep_head), fope_init_factor
        self.tables: Optional[Tuple[Any, Any]] = None

    def kept_inv_freq(self, torch: Any, device: Any) -> Any:
        """vLLM's frequencies (float32): the first ``num_inv_freq``, else those above ``2 pi /
        max_position_embeddings``."""
        r = self.rotary_dim
        inv_freq = 1.0 / (self.base ** (torch.arange(0, r, 2, dtype=torch.float32, device=device) / r))
        if self.num_inv_freq is not None:
            return inv_freq[: self.num_inv_freq]
        return inv_freq[inv_freq > 2.0 * math.pi / self.max_position_embeddings]

    def set_coefficients(self, cos_coef: Any, sin_coef: Any) -> None:
        """Builds the tables from the model's ``cos_coef`` and ``sin_coef`` (``[kv_heads, D,
        D]``, on the device the calls will use), as vLLM's first forward does."""
        torch = sys.modules.get("torch")
        if torch is None or not all(isinstance(x, torch.Tensor) for x in (cos_coef, sin_coef)):
            raise TypeError("cos_coef and sin_coef must be torch.Tensors (FourierRotaryEmbedding)")
        inv_freq = self.kept_inv_freq(torch, cos_coef.device)
        n, half = inv_freq.shape[0], self.head_size // 2
        heads = self.num_key_value_heads if self.fope_sep_head else 1
        for name, coef in (("cos_coef", cos_coef), ("sin_coef", sin_coef)):
            if coef.dim() != 3 or coef.shape[0] < heads or tuple(coef.shape[1:]) != (n, n):
                raise ValueError(f"{name} must be [{heads}, {n}, {n}] (kv heads, kept frequencies twice), got {tuple(coef.shape)}")
        if n > half:
            raise ValueError(f"{n} kept frequencies exceed head_size / 2 = {half}")
        t = torch.arange(self.max_position_embeddings, dtype=torch.float32, device=cos_coef.device)
        freqs = torch.outer(t, inv_freq)
        cos = torch.einsum("tD,hDd->thd", freqs.cos(), cos_coef[:heads].float())
        sin = torch.einsum("tD,hDd->thd", freqs.sin(), sin_coef[:heads].float())
        cos = torch.nn.functional.pad(cos, (0, half - n), value=1.0)
        sin = torch.nn.functional.pad(sin, (0, half - n), value=0.0)
        dtype = self.dtype if self.dtype is not None else cos_coef.dtype
        self.tables = tuple(x.to(dtype).reshape(-1, half).contiguous() for x in (cos, sin))

    def forward(self, positions: Any, query: Any, key: Any, offsets: Optional[Any] = None) -> Tuple[Any, Any]:
        torch = sys.modules.get("torch")
        if torch is None or not all(isinstance(x, torch.Tensor) for x in (positions, query, key)):
            raise TypeError("positions, query and key must be torch.Tensors (FourierRotaryEmbedding)")
        if self.tables is None:
            raise ValueError("call set_coefficients(cos_coef, sin_coef) first (the model's FoPE weights)")
        p = positions.flatten() if offsets is None else (positions + offsets).flatten()
        t, d = p.shape[0], self.head_size
        heads = self.num_key_value_heads if self.fope_sep_head else 1
        for name, x in (("query", query), ("key", key)):
            if x.shape[-1] % (heads * d):
                raise ValueError(f"{name}: {x.shape[-1]} features are not whole groups of {heads} kv heads of {d}")
        # Token t's kv head h at table row p * heads + h.
        rows = p.to(torch.int64)[:, None] * heads + torch.arange(heads, device=p.device)
        cos, sin = self.tables
        q_out, k_out = rope_rs.apply_rope(
            query.view(t, heads, -1, d), key.view(t, heads, -1, d), position_ids=rows, cos=cos, sin=sin
        )
        return q_out.reshape(query.shape), k_out.reshape(key.shape)

    __call__ = forward
