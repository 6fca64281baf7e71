"""The GPU test modules' gate: torch that sees a GPU, else a skip of the whole module that says
why (without torch or CUDA), or a failure under ROPE_REQUIRE_GPU=1 (the GPU bundle's runner sets
it, so that GPU tests cannot pass without running)."""

import os

import pytest


def cuda_torch():
    """The torch module, once it sees a CUDA GPU; otherwise skips the calling test module (or
    fails it under ROPE_REQUIRE_GPU=1)."""
    required = os.environ.get("ROPE_REQUIRE_GPU") == "1"
    if required:
        import torch
    else:
        torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        if required:
            raise RuntimeError("ROPE_REQUIRE_GPU=1 but torch.cuda.is_available() is False")
        pytest.skip("SKIPPED (no GPU): torch.cuda.is_available() is False", allow_module_level=True)
    return torch
