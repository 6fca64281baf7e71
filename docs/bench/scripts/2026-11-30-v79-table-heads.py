"""Issue 53 evidence (log v79): plain prefill rotations (8192 tokens, in place in a QKV buffer
of q, k and v heads of 128, bf16, NeoX) by head counts, sin/cos source (computed, a bf16 or f32
`cos_sin_cache`) and positions (an offset, or device ids), each against a same-run copy_ of q's
and k's bytes, with python/bench.py's timing (L2 flushed, host launch hidden behind a spin).
Run with the wheel installed: python3 THIS.py (python/bench.py on the path)."""
import sys, torch
sys.path.insert(0, "python")
from bench import gpu_times
import rope_rs

dev, bf16 = "cuda", torch.bfloat16
T = 8192
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
cache16 = torch.randn(T, 128, device=dev, dtype=bf16)
cache32 = cache16.float()
ids = torch.arange(T, device=dev).view(1, T)
rows = []
for hq, hk in [(32, 8), (28, 4), (32, 4), (28, 8), (16, 4), (64, 8)]:
    qkv = torch.randn(1, T, hq + 2 * hk, 128, device=dev, dtype=bf16)
    q, k = qkv[:, :, :hq], qkv[:, :, hq:hq + hk]
    src = torch.randn(T * (hq + hk) * 128, device=dev, dtype=bf16)
    dst = torch.empty_like(src)
    fns, names = [lambda: dst.copy_(src)], ["copy"]
    for pos_name, pos in [("offset", {}), ("ids", {"position_ids": ids})]:
        for src_name, s in [("theta", {"theta": 500000.0}), ("cache bf16", {"cos_sin_cache": cache16}),
                            ("cache f32", {"cos_sin_cache": cache32})]:
            kw = {**pos, **s}
            fns.append(lambda kw=kw: rope_rs.apply_rope(q, k, inplace=True, **kw))
            names.append(f"{pos_name:6} {src_name}")
    t = gpu_times(fns, 60, flush)
    for n, x in zip(names[1:], t[1:]):
        print(f"{hq}q+{hk}k  {n:18} {x:7.2f} us  {100 * t[0] / x:5.1f}% of copy ({t[0]:.2f})")
