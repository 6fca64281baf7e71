"""Type stubs of the native module ``rope_rs._native``."""

from typing import Any, Literal, Optional

__version__: str

def apply_rope(
    q: Any,
    k: Optional[Any] = None,
    *,
    positions: Optional[int] = None,
    position_ids: Optional[Any] = None,
    style: Literal["neox", "interleaved"] = "neox",
    theta: float = 10000.0,
    cos_sin_cache: Optional[Any] = None,
    rotary_dim: Optional[int] = None,
    backward: bool = False,
    stream: int = 0,
) -> None:
    """Rotates q (and k) in place by RoPE on the GPU; see ``help(rope_rs.apply_rope)``.

    q, k: CUDA DLPack tensors (float32/float16/bfloat16) ``[batch, seq, heads, head_dim]`` or
    ``[tokens, heads, head_dim]``, contiguous last dimension. positions: an offset (default 0);
    position_ids: a CUDA int32/int64 tensor ``[seq]`` or ``[batch, seq]``. sin/cos from
    ``theta`` or ``cos_sin_cache`` ``[max_position, rotary_dim]`` (float32 or q's dtype).
    stream: a ``CUstream`` handle (``torch.cuda.current_stream().cuda_stream``; 0 = legacy
    default stream). Raises TypeError (not DLPack), ValueError (invalid tensor or option),
    RuntimeError (CUDA driver).
    """

def rotary_embedding(
    positions: Any,
    query: Any,
    key: Optional[Any],
    head_size: int,
    cos_sin_cache: Any,
    is_neox: bool,
    *,
    stream: int = 0,
) -> None:
    """vLLM's ``rotary_embedding``: rotates query and key ``[num_tokens, num_heads * head_size]``
    in place at ``positions`` ``[num_tokens]`` with ``cos_sin_cache`` ``[max_position,
    rotary_dim]``."""
