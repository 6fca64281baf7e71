"""rope-rs: rotary position embedding (RoPE) for NVIDIA GPUs, with kernels written in Rust.

Tensors are passed by DLPack (``torch.Tensor`` and anything else with ``__dlpack__`` and
``__dlpack_device__``) and rotated in place on the CUDA stream given as ``stream=``:

    import torch, rope_rs
    q = torch.randn(1, 4096, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    rope_rs.apply_rope(q, k, theta=500000.0, stream=torch.cuda.current_stream().cuda_stream)

``rotary_embedding`` is a drop-in for vLLM's op of the same name.
"""

from rope_rs._native import __version__, apply_rope, rotary_embedding

__all__ = ["__version__", "apply_rope", "rotary_embedding"]
