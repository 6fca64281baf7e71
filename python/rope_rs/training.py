"""The training form of the fused QK-norm + RoPE (Qwen3, OLMo 2, Gemma 3): per-head RMS
normalisation of q and k, then the rotation, in one launch forward and one backward (the
gradients of q, k and both norm weights), under PyTorch's autograd. torch is imported by the
caller's tensors, never at the package's import."""

import sys
from typing import Any, Tuple

from rope_rs import _native


def _function() -> Any:
    """The autograd Function, defined once torch is imported (by the caller's tensors)."""
    global _QkNormRope
    if _QkNormRope is not None:
        return _QkNormRope
    torch = sys.modules["torch"]

    def stream(x: Any) -> int:
        # A CPU tensor gets stream 0: the native call then names it (q must be a CUDA tensor).
        return torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0

    class QkNormRope(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, q_weight, k_weight, cos_sin_cache, positions, eps, is_neox, gemma):
            d = q.shape[-1]
            q_out, k_out = torch.empty_like(q), torch.empty_like(k)
            _native._qk_norm_rope(
                q, k, q_out, k_out, q_weight, k_weight, cos_sin_cache, positions, d, eps,
                is_neox, gemma, stream(q),
            )
            ctx.save_for_backward(q, k, q_weight, k_weight, cos_sin_cache, positions)
            ctx.options = (d, eps, is_neox, gemma)
            return q_out, k_out

        @staticmethod
        def backward(ctx, grad_q, grad_k):
            q, k, q_weight, k_weight, cos_sin_cache, positions = ctx.saved_tensors
            d, eps, is_neox, gemma = ctx.options
            grad_q = torch.zeros_like(q) if grad_q is None else grad_q.contiguous()
            grad_k = torch.zeros_like(k) if grad_k is None else grad_k.contiguous()
            q, k = q.contiguous(), k.contiguous()
            gq, gk = torch.empty_like(q), torch.empty_like(k)
            gwq, gwk = torch.empty_like(q_weight), torch.empty_like(k_weight)
            heads = (q.numel() + k.numel()) // (d * max(1, positions.numel()))
            n = _native._qk_norm_rope_workspace(q, heads, d)
            workspace = torch.empty(n, dtype=torch.float32, device=q.device)
            _native._qk_norm_rope_backward(
                q, k, grad_q, grad_k, gq, gk, q_weight, k_weight, gwq, gwk, workspace,
                cos_sin_cache, positions, d, eps, is_neox, gemma, stream(q),
            )
            return gq, gk, gwq, gwk, None, None, None, None, None

    _QkNormRope = QkNormRope
    return QkNormRope


_QkNormRope: Any = None


def qk_norm_rope(
    q: Any,
    k: Any,
    q_weight: Any,
    k_weight: Any,
    cos_sin_cache: Any,
    positions: Any,
    *,
    eps: float = 1e-6,
    is_neox: bool = True,
    gemma: bool = False,
) -> Tuple[Any, Any]:
    """Per-head RMS norm, then RoPE, of ``q`` ``[num_tokens, q_heads, head_size]`` and ``k``
    ``[num_tokens, k_heads, head_size]``: new tensors ``(q_out, k_out)``, the inputs unchanged,
    with a fused backward under autograd (the gradients of ``q``, ``k``, ``q_weight`` and
    ``k_weight`` from one launch and a small reduction).

    Each head ``x`` becomes ``R(x / sqrt(mean(x^2) + eps) * w')`` with ``w' = weight`` (``1 +
    weight`` with ``gemma=True``, Gemma 3's), computed in float32 and rounded once; ``R``
    rotates rotate-half pairs (``is_neox=True``) or interleaved pairs by the ``cos_sin_cache``
    row (``[max_position, head_size]``: cos half, then sin half, vLLM's form) at each token's
    ``positions`` (int32 or int64, ``[num_tokens]``). Whole heads rotate. The weight gradients
    are summed in a fixed order: the same inputs give the same bits every run.

    Raises TypeError for arguments that are not torch tensors, and ValueError naming the
    argument for tensors that do not fit (shapes, types, devices, a head wider than the kernels
    take).
    """
    torch = sys.modules.get("torch")
    for name, x in (("q", q), ("k", k), ("q_weight", q_weight), ("k_weight", k_weight)):
        if torch is None or not isinstance(x, torch.Tensor):
            raise TypeError(f"qk_norm_rope: {name} must be a torch.Tensor, got {type(x).__name__}")
    fn = _function()
    return fn.apply(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, is_neox, gemma)
