"""vLLM's ``MRotaryEmbedding`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) on rope_rs's mRoPE rotation
(``apply_rope``'s ``mrope_section``). torch is imported by the caller's tensors, never here."""

import sys
from typing import Any, Optional, Sequence, Tuple

import rope_rs
from rope_rs.dual_chunk import check_sizes


class MRotaryEmbedding:
    """vLLM's ``MRotaryEmbedding(head_size, rotary_dim, max_position_embeddings, base,
    is_neox_style, dtype, mrope_section=None, mrope_interleaved=False)`` as a callable with its
    ``forward``.

    ``forward(positions, query, key, offsets=None)`` returns new tensors ``(query_out,
    key_out)`` of ``query``'s and ``key``'s shapes (``[num_tokens, num_heads * head_size]``),
    the inputs unchanged. ``positions`` is ``[3, num_tokens]`` (temporal, height and width
    positions of multimodal inputs: pair ``i`` of each head rotates at the row of its section,
    in blocks ``mrope_section`` long, or with ``mrope_interleaved`` in Qwen3-VL's ``T H W T H W
    ...`` order, as vLLM's ``apply_interleaved_rope`` assigns them) or ``[num_tokens]`` (text
    alone: every pair at that position).

    Each head's first ``rotary_dim`` features rotate (``is_neox_style``: rotate-half pairs, else
    interleaved) with ``inv_freq[i] = base ** (-2i / rotary_dim)`` and angles formed in float32
    as vLLM forms them; cos and sin stay float32 (vLLM's cache holds them in ``dtype``) and each
    output is rounded once. The other features are copied. One rope_rs launch on PyTorch's
    current stream; positions int32 or int64 on the tensors' device. vLLM's YaRN variant
    (``scaling_factor``) is not taken.

    Raises ValueError for what vLLM's class asserts (``mrope_section`` of other than three
    entries or not summing to ``rotary_dim / 2``, ``rotary_dim`` odd or past ``head_size``; a
    ``[3, num_tokens]`` call without ``mrope_section``), TypeError for tensors other than
    ``torch.Tensor``, and as ``apply_rope`` for the tensors.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        is_neox_style: bool,
        dtype: Any = None,
        mrope_section: Optional[Sequence[int]] = None,
        mrope_interleaved: bool = False,
    ) -> None:
        check_sizes(head_size, rotary_dim, max_position_embeddings)
        if mrope_section is not None:
            section = [int(n) for n in mrope_section]
            if len(section) != 3 or sum(section) != rotary_dim // 2:
                raise ValueError(
                    f"mrope_section must be three pair counts summing to rotary_dim / 2 = {rotary_dim // 2}, "
                    f"got {section}"
                )
            mrope_section = section
        self.head_size, self.rotary_dim, self.base = head_size, rotary_dim, float(base)
        self.max_position_embeddings, self.is_neox_style, self.dtype = max_position_embeddings, is_neox_style, dtype
        self.mrope_section, self.mrope_interleaved = mrope_section, bool(mrope_interleaved)

    def forward(self, positions: Any, query: Any, key: Any, offsets: Optional[Any] = None) -> Tuple[Any, Any]:
        torch = sys.modules.get("torch")
        if torch is None or not all(isinstance(x, torch.Tensor) for x in (positions, query, key)):
            raise TypeError("positions, query and key must be torch.Tensors (MRotaryEmbedding)")
        if offsets is not None:
            positions = positions + offsets
        axes = {}
        if positions.dim() == 2:
            if self.mrope_section is None:
                raise ValueError("positions: [3, num_tokens] needs the mrope_section given at construction")
            axes = dict(mrope_section=self.mrope_section, mrope_interleaved=self.mrope_interleaved)
        t, d = query.shape[0], self.head_size
        q_out, k_out = rope_rs.apply_rope(
            query.reshape(t, -1, d),
            key.reshape(key.shape[0], -1, d),
            position_ids=positions,
            layout="thd",
            style="neox" if self.is_neox_style else "interleaved",
            theta=self.base,
            rotary_dim=self.rotary_dim,
            angle="f32",
            **axes,
        )
        return q_out.reshape(query.shape), k_out.reshape(key.shape)

    __call__ = forward
