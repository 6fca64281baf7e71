"""Issue 53/54 evidence (log v72): rotations of strided views against a Triton copy of the same
views, a Triton copy of as many contiguous elements and torch's copy_, same run: a partial
rotation's first 64 of 128 features per head and MLA's q_pe (the last 64 of 192) in place, and
rope-bench's strided row (q through a view of 32 of every 48 heads, k of 8 of 24, written
contiguous)."""
import sys, torch, triton, triton.language as tl
sys.path.insert(0, "gpu-bundle/python")  # the GPU bundle's copy of python/bench.py
from bench import gpu_times
import rope_rs


@triton.jit
def copy_rows(src, dst, heads, s_tok, s_head, d_tok, d_head, W: tl.constexpr, HB: tl.constexpr):
    pid = tl.program_id(0)
    tok = pid // tl.cdiv(heads, HB)
    hb = pid % tl.cdiv(heads, HB)
    h = hb * HB + tl.arange(0, HB)[:, None]
    w = tl.arange(0, W)[None, :]
    mask = h < heads
    x = tl.load(src + tok * s_tok + h * s_head + w, mask=mask)
    tl.store(dst + tok * d_tok + h * d_head + w, x, mask=mask)


def tcopy(src, dst):
    t, h, w = src.shape
    grid = (t * triton.cdiv(h, 16),)
    return lambda: copy_rows[grid](src, dst, h, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1), W=w, HB=16)


dev, bf16 = "cuda", torch.bfloat16
props = torch.cuda.get_device_properties(0)
flush = torch.empty(2 * props.L2_cache_size // 4 + 1, device=dev, dtype=torch.float32)
t = 8192
ids = torch.randint(0, 8192, (1, t), device=dev)
print("| case | rope µs | Triton copy of the views µs | Triton contiguous copy µs | copy_ µs | rope / view copy | rope / copy_ |")
print("|---|---|---|---|---|---|---|")
print(f"{props.name}; {t} tokens, bf16, median of 100 launches, L2 flushed")
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
    vcopy = tcopy(view, oview)
    ccopy = tcopy(a.view(t, heads, rot), b.view(t, heads, rot))
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
qkv = torch.randn(t, 48, 128, device=dev, dtype=bf16)
kbuf = torch.randn(t, 24, 128, device=dev, dtype=bf16)
qv, kv = qkv[:, :32], kbuf[:, :8]
qo, ko = torch.empty(t, 32, 128, device=dev, dtype=bf16), torch.empty(t, 8, 128, device=dev, dtype=bf16)
n = t * 40 * 128
a, b = torch.randn(n, device=dev, dtype=bf16), torch.empty(n, device=dev, dtype=bf16)
for style in ("neox", "interleaved"):
    call = lambda style=style: rope_rs.apply_rope(qv[None], kv[None], out=qo[None], k_out=ko[None], position_ids=ids, theta=1e4, style=style)
    qc, kc = tcopy(qv, qo), tcopy(kv, ko)
    views = lambda: (qc(), kc())
    cont = tcopy(a.view(t, 40, 128), b.view(t, 40, 128))
    for f in (call, views, cont):
        f()
    r, v, c, tc = gpu_times([call, views, cont, lambda: b.copy_(a)], 100, flush)
    print(f"| strided q (32 of 48 heads) and k (8 of 24), out of place, {style} | {r:.2f} | {v:.2f} (two launches) | {c:.2f} | {tc:.2f} | {100*v/r:.1f}% | {100*tc/r:.1f}% |")
    nq = t * 32 * 128
    call = lambda style=style: rope_rs.apply_rope(qv[None], out=qo[None], position_ids=ids, theta=1e4, style=style)
    cont = tcopy(a[:nq].view(t, 32, 128), b[:nq].view(t, 32, 128))
    for f in (call, qc, cont):
        f()
    r, v, c, tc = gpu_times([call, qc, cont, lambda: b[:nq].copy_(a[:nq])], 100, flush)
    print(f"| strided q alone (32 of 48 heads), out of place, {style} | {r:.2f} | {v:.2f} | {c:.2f} | {tc:.2f} | {100*v/r:.1f}% | {100*tc/r:.1f}% |")
