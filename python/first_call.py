"""A fresh Python process's first ``rope_rs.apply_rope``, as one JSON line.

Seconds from ``import rope_rs`` (torch imported and its CUDA context made first, timed apart)
to the first call finished, on a decode step's shape (64 tokens, 32 q and 8 kv heads of 128,
bf16, NeoX, computed sin/cos). Meaningful only as the process's first rope_rs call: run it in a
fresh process, once with ``CUDA_CACHE_DISABLE=1`` and once with a warm driver cache
(``python/run.sh --first-call`` on the GPU bundle).
"""

import json
import os
import time

t0 = time.perf_counter()
import torch  # noqa: E402

q = torch.randn(64, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(64, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
t1 = time.perf_counter()
import rope_rs  # noqa: E402

t2 = time.perf_counter()
rope_rs.apply_rope(q, k, positions=100, theta=10_000.0, inplace=True)
torch.cuda.synchronize()
t3 = time.perf_counter()
print(
    json.dumps(
        {
            "torch_and_context_s": t1 - t0,
            "import_rope_rs_s": t2 - t1,
            "first_apply_rope_s": t3 - t2,
            "import_to_first_call_s": t3 - t1,
            "cache_disabled": os.environ.get("CUDA_CACHE_DISABLE") == "1",
        }
    )
)
