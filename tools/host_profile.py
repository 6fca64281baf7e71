"""Host microseconds per call of the Python drop-ins at decode shapes, next to `copy_`.

`python/bench.py` times each row once, 100-200 calls in a row; on a host whose timings drift
between seconds that reads differently from row to row. This script times every call in
rounds (each round: `--calls` calls of each function in turn, `copy_` among them) and prints
the median and the fastest round per function, so that two wheels run one after the other
(`PYTHONPATH=old python3 tools/host_profile.py; PYTHONPATH=new ...`) compare on the same host.
The launches go to the current stream; the GPU runs them behind the host.

    python3 tools/host_profile.py [--rounds 7] [--calls 5000]
"""

import argparse
import statistics
import time

import torch

import rope_rs


def calls():
    """(name, function) pairs: the decode rows of python/bench.py (64 tokens, 32 q and 8 kv
    heads of 128, bf16), each through the drop-in as a user calls it."""
    dev, bf16, t, hq, hk, d = "cuda", torch.bfloat16, 64, 32, 8, 128
    q, k = torch.randn(t, 1, hq, d, device=dev, dtype=bf16), torch.randn(t, 1, hk, d, device=dev, dtype=bf16)
    ids = torch.randint(0, 8192, (t, 1), device=dev)
    src = torch.randn(t * (hq + hk) * d, device=dev, dtype=bf16)
    dst = torch.empty_like(src)
    yield "copy_", lambda: dst.copy_(src)
    yield "apply_rope", lambda: rope_rs.apply_rope(q, k, position_ids=ids, theta=500000.0, inplace=True)
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev, dtype=bf16)
    query, key, value = qkv[:, : hq * d], qkv[:, hq * d : (hq + hk) * d], qkv[:, (hq + hk) * d :]
    cache = torch.randn(8192, d, device=dev, dtype=torch.float32)
    positions = torch.randint(0, 8192, (t,), device=dev)
    yield "rotary_embedding", lambda: rope_rs.rotary_embedding(positions, query, key, d, cache, True)
    w = torch.ones(d, device=dev, dtype=bf16)
    norm_args = (qkv, hq, hk, hk, d, 1e-6, w, w, cache, True, positions)
    yield "fused_qk_norm_rope", lambda: rope_rs.fused_qk_norm_rope(*norm_args)
    blocks = t // 16 + 8
    key_cache = torch.zeros(blocks, 16, hk, d, device=dev, dtype=bf16)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(blocks * 16, device=dev)[:t]
    cached = dict(key_cache=key_cache, value_cache=value_cache, slot_mapping=slots)
    yield "fused_qk_norm_rope + cache", lambda: rope_rs.fused_qk_norm_rope(*norm_args, **cached)
    rope_args = (positions, query, key, d, cache, True)
    yield "rotary_embedding + cache", lambda: rope_rs.rotary_embedding(*rope_args, value=value, **cached)
    pool, v_pool = torch.zeros(blocks * 16, hk * d, device=dev, dtype=bf16), torch.zeros(blocks * 16, hk * d, device=dev, dtype=bf16)
    arg = rope_rs.FusedSetKVBufferArg(value, pool, v_pool, None, None, slots)
    yield "SGLang + fused_set_kv_buffer", lambda: rope_rs.apply_rope_with_cos_sin_cache_inplace(*rope_args, arg)
    e4m3 = torch.float8_e4m3fn
    q3, k3, v3 = query.view(t, hq, d), key.view(t, hk, d), value.view(t, hk, d)
    q_out, k_out = torch.empty(t, hq, d, device=dev, dtype=e4m3), torch.empty(t, hk, d, device=dev, dtype=e4m3)
    yield "rope_quantize_fp8 (outputs given)", lambda: rope_rs.rope_quantize_fp8(
        q3, k3, None, None, cache, positions, True, None, 1.0, 1.0, q_out, k_out
    )
    yield "rope_quantize_fp8 (outputs allocated)", lambda: rope_rs.rope_quantize_fp8(q3, k3, None, None, cache, positions)
    i32 = torch.int32
    table = (
        torch.arange(blocks, device=dev, dtype=i32),
        torch.tensor([0, blocks], device=dev, dtype=i32),
        torch.zeros(t, device=dev, dtype=i32),
        torch.arange(t, device=dev, dtype=i32),
    )
    fi_caches = (torch.zeros(blocks, 16, hk, d, device=dev, dtype=e4m3), torch.zeros(blocks, 16, hk, d, device=dev, dtype=e4m3))
    yield "append (q_rope_out given)", lambda: rope_rs.rope_quantize_fp8_append_paged_kv_cache(
        q3, k3, None, None, v3, cache, positions, fi_caches, *table, q_rope_out=q_out
    )
    yield "append (q_rope_out allocated)", lambda: rope_rs.rope_quantize_fp8_append_paged_kv_cache(
        q3, k3, None, None, v3, cache, positions, fi_caches, *table
    )
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)
    emb = ids[:1].float()[..., None] * (500000.0 ** (-torch.arange(0, d, 2, device=dev) / d))
    emb = torch.cat((emb, emb), -1)
    cos_d, sin_d = emb.cos().to(bf16), emb.sin().to(bf16)
    yield "HF apply_rotary_pos_emb", lambda: rope_rs.apply_rotary_pos_emb(qh, kh, cos_d, sin_d)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    fns = list(calls())
    for _, fn in fns:
        fn()
    torch.cuda.synchronize()
    times = {name: [] for name, _ in fns}
    for _ in range(args.rounds):
        for name, fn in fns:
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
            torch.cuda.synchronize()
    print(f"rope_rs from {rope_rs.__file__}; {args.rounds} rounds of {args.calls} calls; µs per call")
    print(f"{'call':40s} {'median':>8s} {'fastest':>8s}")
    for name, ts in times.items():
        print(f"{name:40s} {statistics.median(ts):8.2f} {min(ts):8.2f}")


if __name__ == "__main__":
    main()
