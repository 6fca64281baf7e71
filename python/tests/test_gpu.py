"""GPU tests of rope_rs against an f64 PyTorch reference; skipped without torch or CUDA."""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("SKIPPED (no GPU): torch.cuda.is_available() is False", allow_module_level=True)

import rope_rs  # noqa: E402

DEV = "cuda"
# Max error per element: atol + rtol * |reference| (outputs are rounded once, from f32 math).
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def stream():
    return torch.cuda.current_stream().cuda_stream


def theta_cos_sin(pos, theta, rotary_dim):
    """cos, sin [..., rotary_dim / 2] in f64 of positions `pos`."""
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=DEV) / rotary_dim)
    angle = pos.to(torch.float64)[..., None] * inv_freq
    return angle.cos(), angle.sin()


def cache_cos_sin(pos, cache):
    rows = cache.to(torch.float64)[pos.long()]
    half = cache.shape[1] // 2
    return rows[..., :half], rows[..., half:]


def vllm_cache(theta, rotary_dim, max_position, dtype=torch.float32):
    """vLLM's cos_sin_cache: f32 frequencies and angles, cos half then sin half."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.einsum("i,j->ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype).to(DEV)


def reference(x, cos, sin, style, rotary_dim=None, backward=False):
    """RoPE of x [b, s, h, d] (or [t, h, d]) in f64; cos/sin broadcast as [b, s, 1, r/2]."""
    x = x.to(torch.float64)
    d = x.shape[-1]
    r = rotary_dim or d
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if backward:
        sin = -sin
    out = x.clone()
    if style == "neox":
        a, b = x[..., : r // 2], x[..., r // 2 : r]
        out[..., : r // 2] = a * cos - b * sin
        out[..., r // 2 : r] = b * cos + a * sin
    else:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
        out[..., 0:r:2] = a * cos - b * sin
        out[..., 1:r:2] = b * cos + a * sin
    return out


def check(out, ref):
    atol, rtol = TOL[out.dtype]
    torch.testing.assert_close(out.to(torch.float64), ref, atol=atol, rtol=rtol)


def randn(*shape, dtype):
    return torch.randn(*shape, device=DEV, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("rank", [4, 3])
def test_theta_offset_q_and_k(dtype, style, rank):
    b, s, hq, hk, d, offset, theta = 2, 37, 4, 2, 64, 11, 10000.0
    shape = (b, s) if rank == 4 else (b * s,)
    q, k = randn(*shape, hq, d, dtype=dtype), randn(*shape, hk, d, dtype=dtype)
    q0, k0 = q.clone(), k.clone()
    pos = torch.arange(s, device=DEV).repeat(b, 1) + offset
    if rank == 3:
        pos = torch.arange(b * s, device=DEV) + offset
    cos, sin = theta_cos_sin(pos, theta, d)
    rope_rs.apply_rope(q, k, positions=offset, style=style, theta=theta, stream=stream())
    check(q, reference(q0, cos, sin, style))
    check(k, reference(k0, cos, sin, style))


@pytest.mark.parametrize("int_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("per_row", [False, True])
def test_position_ids(int_dtype, per_row):
    b, s, h, d, theta = 3, 16, 4, 128, 500000.0
    q = randn(b, s, h, d, dtype=torch.bfloat16)
    q0 = q.clone()
    if per_row:
        ids = torch.randint(0, 8192, (b, s), device=DEV, dtype=int_dtype)
        pos = ids
    else:
        ids = torch.randint(0, 8192, (s,), device=DEV, dtype=int_dtype)
        pos = ids.repeat(b, 1)
    cos, sin = theta_cos_sin(pos, theta, d)
    rope_rs.apply_rope(q, position_ids=ids, theta=theta, stream=stream())
    check(q, reference(q0, cos, sin, "neox"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", ["f32", "same"])
def test_cos_sin_cache_partial_rotary(dtype, cache_dtype):
    t, h, d, r, max_position = 50, 4, 128, 64, 4096
    cache = vllm_cache(10000.0, r, max_position, torch.float32 if cache_dtype == "f32" else dtype)
    ids = torch.randint(0, max_position, (t,), device=DEV, dtype=torch.int64)
    q = randn(t, h, d, dtype=dtype)
    q0 = q.clone()
    cos, sin = cache_cos_sin(ids, cache)
    rope_rs.apply_rope(q, position_ids=ids, cos_sin_cache=cache, stream=stream())
    check(q, reference(q0, cos, sin, "neox", rotary_dim=r))


def test_backward_inverts_forward_on_strided_views():
    b, s, hq, hk, d = 2, 9, 8, 2, 64
    qkv = randn(b, s, hq + 2 * hk, d, dtype=torch.float32)
    q, k = qkv[:, :, :hq], qkv[:, :, hq : hq + hk]
    qkv0 = qkv.clone()
    for backward in (False, True):
        rope_rs.apply_rope(q, k, positions=5, style="interleaved", backward=backward, stream=stream())
    torch.testing.assert_close(qkv, qkv0, atol=1e-5, rtol=1e-5)


def test_vllm_rotary_embedding():
    t, hq, hk, d, max_position = 33, 8, 2, 128, 2048
    qkv = randn(t, (hq + 2 * hk) * d, dtype=torch.bfloat16)
    query, key = qkv[:, : hq * d], qkv[:, hq * d : (hq + hk) * d]
    cache = vllm_cache(10000.0, d, max_position)
    positions = torch.randint(0, max_position, (t,), device=DEV, dtype=torch.int64)
    q0, k0 = query.clone().view(t, hq, d), key.clone().view(t, hk, d)
    v0 = qkv[:, (hq + hk) * d :].clone()
    rope_rs.rotary_embedding(positions, query, key, d, cache, True, stream=stream())
    cos, sin = cache_cos_sin(positions, cache)
    check(query.view(t, hq, d), reference(q0, cos, sin, "neox"))
    check(key.view(t, hk, d), reference(k0, cos, sin, "neox"))
    assert torch.equal(qkv[:, (hq + hk) * d :], v0)  # v is untouched


def test_side_stream():
    side = torch.cuda.Stream()
    q = randn(4, 16, 64, dtype=torch.float32)
    q0 = q.clone()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rope_rs.apply_rope(q, positions=3, stream=side.cuda_stream)
    torch.cuda.current_stream().wait_stream(side)
    cos, sin = theta_cos_sin(torch.arange(4, device=DEV) + 3, 10000.0, 64)
    check(q, reference(q0, cos, sin, "neox"))


def test_invalid_cuda_arguments_are_value_errors():
    q = randn(4, 2, 64, dtype=torch.float32)
    with pytest.raises(ValueError, match="k is bfloat16, q is float32"):
        rope_rs.apply_rope(q, randn(4, 2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rotary_dim"):
        rope_rs.apply_rope(q, rotary_dim=7)
    with pytest.raises(ValueError, match="q must have a contiguous last dimension"):
        rope_rs.apply_rope(randn(4, 2, 128, dtype=torch.float32)[..., ::2])
    with pytest.raises(ValueError, match="positions"):
        rope_rs.apply_rope(q, position_ids=torch.zeros(5, device=DEV, dtype=torch.int64))
