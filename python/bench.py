"""Times rope_rs from Python against a same-run ``copy_`` of the same bytes (needs torch and CUDA).

    python python/bench.py [--reps 200] [--json bench.json] [--only TEXT ...]
    python python/bench.py --host-rounds 7 [--calls 3000]

GPU time: CUDA events around each launch, the L2 cache flushed before each (a write of twice its
size), median over ``--reps`` launches. Between the flush and the start event the GPU spins for
about a millisecond (``torch.cuda._sleep``), so that the host has enqueued the launch before the
start event runs and the events time the GPU's work, not the host's call overhead; the copy is one ``Tensor.copy_`` of as many bytes as the
launch reads (q and k), timed the same way, interleaved with it. A ratio near 1 means the launch
moves its bytes as fast as a copy, so the Python path adds no GPU time. Host time: the wall time
per call of ``--reps`` back-to-back calls from Python, the fastest of five rounds (the GPU is
never the bottleneck there: each call enqueues one short kernel), for ``rope_rs.apply_rope``, for the native call under it
with everything precomputed, and for ``copy_``; the same for the serving drop-ins (vLLM's
``fused_qk_norm_rope`` and ``rotary_embedding`` with a cache write, its MLA
``concat_and_cache_mla_rope_fused``, SGLang's rotation with ``fused_set_kv_buffer_arg``,
FlashInfer's FP8 forms) at decode and prefill. ``--host-rounds N`` times only the decode rows'
calls on the host, in N rounds of ``--calls`` calls of each in turn (``copy_`` among them), for
comparing two wheels run one after the other on a host whose speed drifts.
"""

import argparse
import itertools
import json
import statistics
import time

import torch

import rope_rs
from rope_rs import _native


#: GPU clock cycles to spin before each timed launch: about a millisecond at H100/H200 clocks,
#: far longer than any call's host overhead.
SPIN_CYCLES = 2_000_000


def gpu_times(fns, reps, flush):
    """Median GPU microseconds of each function, launches interleaved, L2 flushed before each,
    with the host's enqueueing hidden behind a spin (see the module documentation)."""
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            flush.zero_()
            torch.cuda._sleep(SPIN_CYCLES)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times[i].append((start, end))
    torch.cuda.synchronize()
    return [statistics.median([s.elapsed_time(e) * 1e3 for s, e in pairs]) for pairs in times]


#: Rounds of back-to-back calls per host timing; the fastest is reported.
HOST_ROUNDS = 5


def host_time(fn, reps):
    """Wall-clock microseconds per call: the fastest of `HOST_ROUNDS` rounds of `reps`
    back-to-back calls (launches only; the GPU synchronized between rounds). The host's other
    work lands on some rounds and not others; the fastest round is the call's own cost."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(HOST_ROUNDS):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, time.perf_counter() - start)
        torch.cuda.synchronize()
    return best / reps * 1e6


def cases():
    """(name, tensors rotated, rope_rs call, the same call as a native call)."""
    dev, bf16 = "cuda", torch.bfloat16
    stream = torch.cuda.current_stream().cuda_stream
    # Decode: 64 sequences of one token, Llama-3-8B heads, positions on the device.
    q, k = torch.randn(64, 1, 32, 128, device=dev, dtype=bf16), torch.randn(64, 1, 8, 128, device=dev, dtype=bf16)
    ids = torch.randint(0, 8192, (64, 1), device=dev)
    yield (
        "decode b64 32q+8k bf16, position_ids, theta",
        (q, k),
        lambda: rope_rs.apply_rope(q, k, position_ids=ids, theta=500000.0, inplace=True),
        lambda: _native.apply_rope(q, k, position_ids=ids, theta=500000.0, stream=stream, producer_sync=False),
    )
    cache = torch.randn(8192, 128, device=dev, dtype=torch.float32)
    query, key = q.view(64, -1), k.view(64, -1)
    positions = ids.view(64)
    yield (
        "decode b64, vLLM rotary_embedding (f32 cache)",
        (q, k),
        lambda: rope_rs.rotary_embedding(positions, query, key, 128, cache, True),
        lambda: _native.rotary_embedding(positions, query, key, 128, cache, True, stream=stream, producer_sync=False),
    )
    # Hugging Face's drop-in at decode: [b, h, 1, d] views, cos/sin [1, 1, d] as its rotary
    # embedding returns them (the same pair for every layer of a forward).
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)
    emb = ids[:1].float()[..., None] * (500000.0 ** (-torch.arange(0, 128, 2, device=dev) / 128))
    emb = torch.cat((emb, emb), -1)
    cos_d, sin_d = emb.cos().to(bf16), emb.sin().to(bf16)
    yield (
        "decode b64, HF apply_rotary_pos_emb (out of place)",
        (q, k),
        lambda: rope_rs.apply_rotary_pos_emb(qh, kh, cos_d, sin_d),
        None,
    )
    # The serving drop-ins at decode: a packed QKV of 64 tokens, vLLM's paged cache (bf16,
    # 16-token blocks) and SGLang's token pool. "Tensors" are what the copy moves: q and k, plus
    # k and v again for the cache write.
    yield from serving_cases(64, stream)
    yield from mla_cases(64, stream)
    yield from serving_cases(4096, stream)
    yield from mla_cases(8192, stream)
    # Prefill: one sequence of 4096 tokens.
    q, k = torch.randn(1, 4096, 32, 128, device=dev, dtype=bf16), torch.randn(1, 4096, 8, 128, device=dev, dtype=bf16)
    yield (
        "prefill 4096 tok 32q+8k bf16, offset, theta",
        (q, k),
        lambda: rope_rs.apply_rope(q, k, theta=500000.0, inplace=True),
        lambda: _native.apply_rope(q, k, theta=500000.0, stream=stream, producer_sync=False),
    )
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    yield (
        "prefill, out of place into given outputs",
        (q, k),
        lambda: rope_rs.apply_rope(q, k, theta=500000.0, out=q_out, k_out=k_out),
        lambda: _native.apply_rope(
            q, k, out=q_out, k_out=k_out, theta=500000.0, stream=stream, producer_sync=False
        ),
    )
    # mRoPE at Qwen2.5-VL-7B's shapes (28 q + 4 k heads of 128, sections 16/24/24, in place),
    # blocks and Qwen3-VL's interleaved order, positions [3, batch, seq].
    qv, kv = torch.randn(1, 4096, 28, 128, device=dev, dtype=bf16), torch.randn(1, 4096, 4, 128, device=dev, dtype=bf16)
    axes = torch.randint(0, 4096, (3, 1, 4096), device=dev)
    for interleaved in (False, True):
        mrope = dict(position_ids=axes, theta=1000000.0, mrope_section=[16, 24, 24], mrope_interleaved=interleaved)
        yield (
            f"prefill 4096 tok 28q+4k bf16, mRoPE{' interleaved' if interleaved else ''}, theta",
            (qv, kv),
            lambda m=mrope: rope_rs.apply_rope(qv, kv, inplace=True, **m),
            lambda m=mrope: _native.apply_rope(qv, kv, stream=stream, producer_sync=False, **m),
        )
    # Hugging Face's drop-in: [b, h, s, d] views and cos/sin as its rotary embedding returns them.
    qh, kh = q.transpose(1, 2), k.transpose(1, 2)
    freqs = torch.arange(4096, device=dev)[:, None].float() * (500000.0 ** (-torch.arange(0, 128, 2, device=dev) / 128))
    emb = torch.cat((freqs, freqs), -1)[None]
    cos, sin = emb.cos().to(bf16), emb.sin().to(bf16)
    yield (
        "prefill, HF apply_rotary_pos_emb (out of place)",
        (q, k),
        lambda: rope_rs.apply_rotary_pos_emb(qh, kh, cos, sin),
        None,
    )


def serving_cases(tokens, stream):
    """The serving drop-ins on `tokens` tokens of 32 q and 8 kv heads of 128 (bf16)."""
    dev, bf16, t, hq, hk, d = "cuda", torch.bfloat16, tokens, 32, 8, 128
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev, dtype=bf16)
    query, key, value = qkv[:, : hq * d], qkv[:, hq * d : (hq + hk) * d], qkv[:, (hq + hk) * d :]
    w = torch.ones(d, device=dev, dtype=bf16)
    cache = torch.randn(8192, d, device=dev, dtype=torch.float32)
    positions = torch.randint(0, 8192, (t,), device=dev)
    blocks = (t + 15) // 16 + 8
    key_cache = torch.zeros(blocks, 16, hk, d, device=dev, dtype=bf16)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(blocks * 16, device=dev)[:t]
    pool = torch.zeros(blocks * 16, hk * d, device=dev, dtype=bf16)
    v_pool = torch.zeros_like(pool)
    step = "decode b64" if t == 64 else f"prefill {t} tok"
    cached = dict(key_cache=key_cache, value_cache=value_cache, slot_mapping=slots)
    norm_args = (qkv, hq, hk, hk, d, 1e-6, w, w, cache, True, positions)
    yield (
        f"{step}, vLLM fused_qk_norm_rope",
        (query, key),
        lambda: rope_rs.fused_qk_norm_rope(*norm_args),
        lambda: _native.fused_qk_norm_rope(*norm_args, stream=stream, producer_sync=False),
    )
    yield (
        f"{step}, vLLM fused_qk_norm_rope + paged cache write",
        (query, key, key, value),
        lambda: rope_rs.fused_qk_norm_rope(*norm_args, **cached),
        lambda: _native.fused_qk_norm_rope(*norm_args, **cached, stream=stream, producer_sync=False),
    )
    rope_args = (positions, query, key, d, cache, True)
    yield (
        f"{step}, vLLM rotary_embedding + paged cache write",
        (query, key, key, value),
        lambda: rope_rs.rotary_embedding(*rope_args, value=value, **cached),
        lambda: _native.rotary_embedding(*rope_args, value=value, **cached, stream=stream, producer_sync=False),
    )
    # FlashInfer's rope_quantize_fp8 forms (no non-rotary part), E4M3, a page table of one
    # request per token row.
    e4m3 = torch.float8_e4m3fn
    q3, k3, v3 = query.view(t, hq, d), key.view(t, hk, d), value.view(t, hk, d)
    q_out, k_out = torch.empty(t, hq, d, device=dev, dtype=e4m3), torch.empty(t, hk, d, device=dev, dtype=e4m3)
    fi_caches = (torch.zeros(blocks, 16, hk, d, device=dev, dtype=e4m3), torch.zeros(blocks, 16, hk, d, device=dev, dtype=e4m3))
    i32 = torch.int32
    table = (
        torch.arange(blocks, device=dev, dtype=i32),
        torch.tensor([0, blocks], device=dev, dtype=i32),
        torch.zeros(t, device=dev, dtype=i32),
        torch.arange(t, device=dev, dtype=i32),
    )
    quant_args = (q3, k3, cache, positions, True, d, "float8_e4m3fn", 1.0, 1.0, q_out, k_out)
    yield (
        f"{step}, FlashInfer rope_quantize_fp8",
        (query, key),
        lambda: rope_rs.rope_quantize_fp8(q3, k3, None, None, cache, positions, True, None, 1.0, 1.0, q_out, k_out),
        lambda: _native.rope_quantize_fp8(*quant_args, stream=stream, producer_sync=False),
    )
    yield (
        f"{step}, FlashInfer rope_quantize_fp8_append_paged_kv_cache",
        (query, key, value),
        lambda: rope_rs.rope_quantize_fp8_append_paged_kv_cache(
            q3, k3, None, None, v3, cache, positions, fi_caches, *table, q_rope_out=q_out
        ),
        lambda: _native.rope_quantize_fp8_append_paged_kv_cache(
            q3, k3, v3, cache, positions, *fi_caches, *table, True, d, "float8_e4m3fn", 1.0, 1.0, 16, "NHD", q_out,
            stream=stream, producer_sync=False,
        ),
    )
    # DeepSeek's MLA: 128 q heads of 512 non-rotary and 64 rotary features (views of one
    # [t, 128, 576] tensor), k's 512 latent and 64 rotary features; everything to E4M3.
    q_mla = torch.randn(t, 128, 576, device=dev, dtype=bf16)
    k_mla = torch.randn(t, 576, device=dev, dtype=bf16)
    mla_in = (q_mla[..., 512:], k_mla[:, 512:], q_mla[..., :512], k_mla[:, :512])
    mla_out = [torch.empty(x.shape, device=dev, dtype=e4m3) for x in mla_in]
    mla_cache = torch.randn(8192, 64, device=dev, dtype=torch.float32)
    yield (
        f"{step}, FlashInfer mla_rope_quantize_fp8 (128 heads, 512 + 64)",
        (q_mla, k_mla),
        lambda: rope_rs.mla_rope_quantize_fp8(
            mla_in[0], mla_in[1], mla_in[2], mla_in[3], mla_cache, positions, True, None, 1.0, 1.0, *mla_out
        ),
        lambda: _native.rope_quantize_fp8(
            mla_in[0], mla_in[1], mla_cache, positions, True, 64, "float8_e4m3fn", 1.0, 1.0, mla_out[0], mla_out[1],
            stream, False, False, mla_in[2], mla_out[2], mla_in[3], mla_out[3],
        ),
    )
    # The same into MLA's paged caches (FlashInfer's append form): k's latent features into
    # ckv_cache, its rotated 64 into kpe_cache, pages of 16 tokens.
    mla_caches = (
        torch.zeros(blocks, 16, 512, device=dev, dtype=e4m3),
        torch.zeros(blocks, 16, 64, device=dev, dtype=e4m3),
    )
    yield (
        f"{step}, FlashInfer rope_quantize_fp8_append_paged_kv_cache, MLA (128 heads, 512 + 64)",
        (q_mla, k_mla),
        lambda: rope_rs.rope_quantize_fp8_append_paged_kv_cache(
            mla_in[0], mla_in[1], mla_in[2], mla_in[3], None, mla_cache, positions, mla_caches, *table,
            q_rope_out=mla_out[0], q_nope_out=mla_out[2],
        ),
        lambda: _native.rope_quantize_fp8_append_paged_kv_cache(
            mla_in[0], mla_in[1], None, mla_cache, positions, mla_caches[1], mla_caches[0], *table, True, 64,
            "float8_e4m3fn", 1.0, 1.0, 16, "NHD", mla_out[0], stream, False, False, mla_in[2], mla_out[2], mla_in[3],
        ),
    )
    arg = rope_rs.FusedSetKVBufferArg(value, pool, v_pool, None, None, slots)
    yield (
        f"{step}, SGLang rope + fused_set_kv_buffer",
        (query, key, key, value),
        lambda: rope_rs.apply_rope_with_cos_sin_cache_inplace(*rope_args, arg),
        lambda: _native.apply_rope_with_cos_sin_cache_inplace(*rope_args, arg, stream=stream, producer_sync=False),
    )


def mla_cases(tokens, stream):
    """vLLM's MLA drop-in (``concat_and_cache_mla_rope_fused``) on `tokens` tokens of 128 q
    heads: q_pe, the last 64 of each head's 128 + 64 features, and k_pe rotated in place, each
    token's ``[kv_c | rotated k_pe]`` (views of one ``[t, 512 + 64]`` projection) into the one
    latent cache, E4M3 or bf16; the copy moves q_pe and the projection."""
    dev, bf16, t = "cuda", torch.bfloat16, tokens
    step = "decode b64" if t == 64 else f"prefill {t} tok"
    q_v = torch.randn(t, 128, 192, device=dev, dtype=bf16)
    kv = torch.randn(t, 576, device=dev, dtype=bf16)
    q_pe, kv_c, k_pe = q_v[..., 128:], kv[:, :512], kv[:, 512:]
    table, unit = torch.randn(8192, 64, device=dev, dtype=bf16), torch.ones(1, device=dev)
    positions = torch.randint(0, 8192, (t,), device=dev)
    blocks = (t + 15) // 16 + 8
    slots = torch.randperm(blocks * 16, device=dev)[:t]
    for kv_cache_dtype, cache_type in (("fp8", torch.uint8), ("auto", bf16)):
        kv_cache = torch.zeros(blocks, 16, 576, device=dev, dtype=cache_type)
        args = (positions, q_pe, k_pe, kv_c, table, True, slots, kv_cache, kv_cache_dtype, unit)
        yield (
            f"{step}, vLLM concat_and_cache_mla_rope_fused, {kv_cache_dtype} (128 heads, 64 + 512)",
            (q_pe, kv),
            lambda a=args: rope_rs.concat_and_cache_mla_rope_fused(*a),
            lambda a=args: _native.concat_and_cache_mla_rope_fused(*a, 64, stream, False, False),
        )


def host_rounds(rounds, calls):
    """Host microseconds per call of every decode row's rope_rs call and of a ``copy_`` of
    decode bytes, timed in `rounds` rounds (each: `calls` calls of each function in turn); the
    median and the fastest round per function. For comparing two wheels run one after the other
    on a host whose speed drifts between seconds."""
    # The decode rows come first; the generator stops there (later rows rebind the names that
    # the decode rows' calls read).
    decode = itertools.takewhile(lambda case: case[0].startswith("decode"), cases())
    fns = [(name, call) for name, _, call, _ in decode]
    src = torch.randn(64 * 40 * 128, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    fns.insert(0, ("copy_ (64 tokens of 40 heads of 128, bf16)", lambda: dst.copy_(src)))
    for _, fn in fns:
        fn()
    torch.cuda.synchronize()
    times = {name: [] for name, _ in fns}
    for _ in range(rounds):
        for name, fn in fns:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    print(f"rope_rs from {rope_rs.__file__}; {rounds} rounds of {calls} calls; host µs per call")
    print("| case | median | fastest |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {min(ts):.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--host-rounds", type=int, metavar="N", help="only the decode rows' host time, in N interleaved rounds"
    )
    parser.add_argument("--calls", type=int, default=3000, help="calls per function and round (--host-rounds)")
    parser.add_argument(
        "--only", action="append", default=[], metavar="TEXT", help="only the rows whose name holds TEXT (repeatable)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    if args.host_rounds:
        host_rounds(args.host_rounds, args.calls)
        return
    props = torch.cuda.get_device_properties(0)
    flush = torch.empty(2 * props.L2_cache_size // 4 + 1, device="cuda", dtype=torch.float32)
    print(f"{props.name}, torch {torch.__version__}, rope_rs {rope_rs.__version__}; median of {args.reps} launches")
    header = ("case", "rope µs", "copy µs", "ratio", "rope GB/s", "host µs: rope_rs call", "native", "copy_")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    rows = []
    for name, tensors, call, native in cases():
        if args.only and not any(text in name for text in args.only):
            continue
        numel = sum(t.numel() for t in tensors)
        src = torch.randn(numel, device="cuda").to(tensors[0].dtype)
        dst = torch.empty_like(src)
        copy = lambda: dst.copy_(src)  # noqa: E731
        call()  # warm-up: module load, frequencies upload
        rope_us, copy_us = gpu_times([call, copy], args.reps, flush)
        nbytes = 2 * numel * tensors[0].element_size()  # read and written once each
        row = {
            "case": name,
            "rope_us": rope_us,
            "copy_us": copy_us,
            "ratio": rope_us / copy_us,
            "rope_gbps": nbytes / rope_us / 1e3,
            "host_us_apply_rope": host_time(call, args.reps),
            "host_us_native": None if native is None else host_time(native, args.reps),
            "host_us_copy": host_time(copy, args.reps),
        }
        rows.append(row)
        native_host = "-" if row["host_us_native"] is None else f"{row['host_us_native']:.1f}"
        print(
            f"| {name} | {rope_us:.2f} | {copy_us:.2f} | {row['ratio']:.3f} | {row['rope_gbps']:.0f} | "
            f"{row['host_us_apply_rope']:.1f} | {native_host} | {row['host_us_copy']:.1f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "torch": torch.__version__, "reps": args.reps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
