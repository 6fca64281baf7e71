"""vLLM's ``DualChunkRotaryEmbedding`` (Qwen2.5-1M's dual chunk attention) on rope_rs's
rotations: keys at their position within a chunk, queries at the five positions its three
attention passes read them at (see :class:`DualChunkRotaryEmbedding`). torch is imported by
the caller's tensors, never here."""

import sys
from typing import Any, Optional, Tuple

import rope_rs


def check_sizes(head_size: int, rotary_dim: int, max_position_embeddings: int) -> None:
    """What vLLM's rotary embedding classes assert of their sizes: ``rotary_dim`` even, positive
    and at most ``head_size``, ``max_position_embeddings`` positive (ValueError otherwise)."""
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"rotary_dim must be even, positive and at most head_size {head_size}, got {rotary_dim}")
    if max_position_embeddings <= 0:
        raise ValueError(f"max_position_embeddings must be positive, got {max_position_embeddings}")


class DualChunkRotaryEmbedding:
    """vLLM's ``DualChunkRotaryEmbedding(head_size, rotary_dim, max_position_embeddings, base,
    is_neox_style, dtype, chunk_size, local_size)`` as a callable with its ``forward``.

    With ``L = chunk_size - local_size`` and ``p = positions + offsets`` (``offsets`` optional),
    ``forward(positions, query, key, offsets=None)`` returns new tensors ``(query_out,
    key_out)``, the inputs unchanged:

    - ``key_out``: ``key`` ``[num_tokens, num_kv_heads * head_size]`` rotated at ``p % L``;
    - ``query_out`` ``[num_tokens, 5 * num_heads * head_size]``: ``query`` ``[num_tokens,
      num_heads * head_size]`` rotated at five positions, concatenated along the last dimension
      in vLLM's order: ``p % L`` (intra-chunk), ``min(p % L + L, chunk_size)`` (successive
      chunk), ``min(2 L - 1, chunk_size)`` for every token (inter-chunk), ``p % L + L``
      (successive, unclamped) and ``p % L + chunk_size`` (inter-chunk, by position).

    Each head's first ``rotary_dim`` features rotate (``is_neox_style``: rotate-half pairs,
    else interleaved) with ``inv_freq[i] = base ** (-2i / rotary_dim)`` and angles formed in
    float32 as vLLM forms them; the other features are copied. ``max_position_embeddings`` and
    ``dtype`` are taken for vLLM's signature and checked, not needed: nothing is tabulated.
    Six rope_rs launches on PyTorch's current stream (one for the keys, one per query
    position); positions int32 or int64 ``[num_tokens]`` on the tensors' device.

    Raises ValueError for sizes vLLM's class could not serve (``local_size`` outside
    ``[0, chunk_size)``, ``rotary_dim`` odd or past ``head_size``), TypeError for tensors
    other than ``torch.Tensor``, and as ``apply_rope`` for the tensors.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: Any = None,
        chunk_size: int = 0,
        local_size: int = 0,
    ) -> None:
        if not 0 <= local_size < chunk_size:
            raise ValueError(
                f"local_size must lie in [0, chunk_size): chunk_size {chunk_size}, local_size {local_size}"
            )
        check_sizes(head_size, rotary_dim, max_position_embeddings)
        self.head_size, self.rotary_dim, self.base = head_size, rotary_dim, float(base)
        self.max_position_embeddings, self.is_neox_style, self.dtype = max_position_embeddings, is_neox_style, dtype
        self.chunk_size, self.local_size = chunk_size, local_size
        self.chunk_len = chunk_size - local_size

    def query_positions(self, p: Any) -> Tuple[Any, ...]:
        """The five query positions of tokens at positions ``p`` (an integer tensor), in the
        order of ``forward``'s output."""
        torch = sys.modules["torch"]
        size, span = self.chunk_size, self.chunk_len
        within = torch.remainder(p, span)
        inter = torch.full_like(p, min(2 * span - 1, size))
        return within, (within + span).clamp(max=size), inter, within + span, within + size

    def forward(self, positions: Any, query: Any, key: Any, offsets: Optional[Any] = None) -> Tuple[Any, Any]:
        torch = sys.modules.get("torch")
        if torch is None or not all(isinstance(x, torch.Tensor) for x in (positions, query, key)):
            raise TypeError("positions, query and key must be torch.Tensors (DualChunkRotaryEmbedding)")
        p = positions if offsets is None else positions + offsets
        t, d = query.shape[0], self.head_size
        q = query.reshape(t, -1, d)
        k = key.reshape(key.shape[0], -1, d)
        options = dict(
            layout="thd",
            style="neox" if self.is_neox_style else "interleaved",
            theta=self.base,
            rotary_dim=self.rotary_dim,
            angle="f32",
        )
        key_out = torch.empty_like(k)
        rope_rs.apply_rope(k, position_ids=torch.remainder(p, self.chunk_len), out=key_out, **options)
        query_out = torch.empty(t, 5, q.shape[1], d, device=q.device, dtype=q.dtype)
        for i, at in enumerate(self.query_positions(p)):
            rope_rs.apply_rope(q, position_ids=at, out=query_out[:, i], **options)
        return query_out.view(t, -1), key_out.view(key.shape[0], -1)

    __call__ = forward
