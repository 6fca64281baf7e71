"""Issue 53/54 evidence: rotations of strided views (a partial rotation's first 64 of 128
features per head; MLA's q_pe, the last 64 of 192) against a Triton copy of the same view,
a Triton copy of as many contiguous elements and torch's contiguous copy_, same run."""
import sys, torch, triton, triton.language as tl
sys.path.insert(0, "gpu-bundle/python")  # the GPU bundle's copy of python/bench.py
from bench import gpu_times
import rope_rs


@triton.jit
def copy_rows(src, dst, rows, heads, s_tok, s_head, W: tl.constexpr, HB: tl.constexpr):
    pid = tl.program_id(0)
    tok = pid // tl.cdiv(heads, HB)
    hb = pid % tl.cdiv(heads, HB)
    h = hb * HB + tl.arange(0, HB)[:, None]
    w = tl.arange(0, W)[None, :]
    mask = h < heads
    off = tok * s_tok + h * s_head + w
    tl.store(dst + off, tl.load(src + off, mask=mask), mask=mask)


def triton_copy(src, dst, W):
    t, h = src.shape[0], src.shape[1]
    HB = 16
    grid = (t * triton.cdiv(h, HB),)
    return lambda: copy_rows[grid](src, dst, t, h, src.stride(0), src.stride(1), W=W, HB=HB)


dev, bf16 = "cuda", torch.bfloat16
props = torch.cuda.get_device_properties(0)
flush = torch.empty(2 * props.L2_cache_size // 4 + 1, device=dev, dtype=torch.float32)
t = 8192
ids = torch.randint(0, 8192, (1, t), device=dev)
print(f"{props.name}; {t} tokens, bf16, median of 100 launches, L2 flushed")
print("| view | rope µs | Triton copy of the view µs | Triton contiguous copy µs | copy_ µs | rope / view copy | rope / contiguous copy_ |")
print("|---|---|---|---|---|---|---|")
for name, heads, width, lo, rot in (
    ("first 64 of 128 (partial, 32 q + 8 k heads)", 40, 128, 0, 64),
    ("whole 128 (32 q + 8 k heads)", 40, 128, 0, 128),
    ("MLA q_pe: last 64 of 192, 128 heads", 128, 192, 128, 64),
):
    base = torch.randn(t, heads, width, device=dev, dtype=bf16)
    other = torch.randn(t, heads, width, device=dev, dtype=bf16)
    view, oview = base[:, :, lo : lo + rot], other[:, :, lo : lo + rot]
    n = t * heads * rot
    a, b = torch.randn(n, device=dev, dtype=bf16), torch.empty(n, device=dev, dtype=bf16)
    vcopy = triton_copy(view, oview, rot)
    ccopy = triton_copy(a.view(t, heads, rot), b.view(t, heads, rot), rot)
    if rot == 64 and lo == 0:
        q = base.view(1, t, heads, width)
        call = lambda q=q: rope_rs.apply_rope(q, position_ids=ids, theta=1e4, rotary_dim=64, inplace=True)
    else:
        q = view.unsqueeze(0)
        call = lambda q=q: rope_rs.apply_rope(q, position_ids=ids, theta=1e4, inplace=True)
    for f in (call, vcopy, ccopy):
        f()
    r, v, c, tc = gpu_times([call, vcopy, ccopy, lambda: b.copy_(a)], 100, flush)
    print(f"| {name} | {r:.2f} | {v:.2f} | {c:.2f} | {tc:.2f} | {100*v/r:.1f}% | {100*tc/r:.1f}% |")
