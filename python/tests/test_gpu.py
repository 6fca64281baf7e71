"""GPU tests of rope_rs: every API form against an f64 PyTorch reference and against Hugging
Face's own functions (transformers' llama and GPT-J ``apply_rotary_pos_emb``, its rotary
embedding and scaling families), in and out of place; gradients against the f64 reference and
by ``torch.autograd.gradcheck``; capture in ``torch.cuda.graph`` and replay with new positions;
a ``torch.compile``d model step through the custom operators.

Skipped without torch or CUDA (failed instead with ROPE_REQUIRE_GPU=1, as the GPU bundle's
runner sets it); the tests that use transformers skip without it.
"""

import subprocess
import sys
import textwrap

import pytest

from gpu_gate import cuda_torch

torch = cuda_torch()

import rope_rs  # noqa: E402
import rope_rs.torch as rope_torch  # noqa: E402

DEV = "cuda"
# Max error per element: atol + rtol * |reference| (outputs are rounded once, from f32 math).
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STYLES = ["neox", "interleaved"]
LAYOUTS = ["bshd", "sbhd", "bhsd", "thd"]


def stream():
    return torch.cuda.current_stream().cuda_stream


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEV, dtype=torch.float32).to(dtype)


def shaped(layout, b, s, h, d):
    """The shape of a tensor of `b` rows of `s` tokens of `h` heads of `d` in `layout`."""
    return {"bshd": (b, s, h, d), "sbhd": (s, b, h, d), "bhsd": (b, h, s, d), "thd": (b * s, h, d)}[layout]


def as_bshd(x, layout):
    """`x` (in `layout`) seen as [batch, seq, heads, head_dim]."""
    if layout == "sbhd":
        return x.transpose(0, 1)
    if layout == "bhsd":
        return x.transpose(1, 2)
    if layout == "thd":
        return x.unsqueeze(0)
    return x


def inv_freq64(theta, rotary_dim):
    return theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=DEV) / rotary_dim)


def cos_sin(pos, inv_freq, attention=1.0):
    """cos, sin [..., r/2] in f64 of positions `pos` (any integer shape) and frequencies."""
    angle = pos.to(torch.float64)[..., None] * inv_freq.to(device=DEV, dtype=torch.float64)
    return angle.cos() * attention, angle.sin() * attention


def table_cos_sin(pos, cos_table, sin_table):
    """cos, sin [..., r/2] in f64 read from tables [max_position, r/2]."""
    return cos_table.to(torch.float64)[pos.long()], sin_table.to(torch.float64)[pos.long()]


def vllm_cache(theta, rotary_dim, max_position, dtype=torch.float32):
    """vLLM's cos_sin_cache: f32 frequencies and angles, cos half then sin half."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.einsum("i,j->ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype).to(DEV)


def reference(x, cos, sin, style, rotary_dim=None, backward=False):
    """RoPE of x [b, s, h, d] in f64; cos/sin [b, s, r/2] broadcast over heads. Differentiable."""
    x = x.to(torch.float64)
    d = x.shape[-1]
    r = rotary_dim or 2 * cos.shape[-1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if backward:
        sin = -sin
    if style == "neox":
        a, b = x[..., : r // 2], x[..., r // 2 : r]
        rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    else:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
        rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, x[..., r:d]), dim=-1)


def hf_formula(x, cos, sin, style):
    """x [b, s, h, d] rotated in f64 by Hugging Face's own functions: llama's
    ``apply_rotary_pos_emb`` (rotate-half, cos/sin as ``cat(freqs, freqs)``) or GPT-J's
    (interleaved), on the first ``2 * cos.shape[-1]`` features; the rest pass through."""
    pytest.importorskip("transformers")
    x = x.to(torch.float64)
    cos, sin = cos.to(torch.float64), sin.to(torch.float64)
    r = 2 * cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    if style == "neox":
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        c, s = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        heads_first = rot.transpose(1, 2)
        out, _ = apply_rotary_pos_emb(heads_first, heads_first, c, s, unsqueeze_dim=1)
        out = out.transpose(1, 2)
    else:
        from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb

        out = apply_rotary_pos_emb(rot, sin, cos)
    return torch.cat((out, rest), dim=-1)


def check(out, ref, extra_atol=0.0):
    atol, rtol = TOL[out.dtype]
    torch.testing.assert_close(out.to(torch.float64), ref.to(torch.float64), atol=atol + extra_atol, rtol=rtol)


class TestForms:
    """Every layout, style, dtype, in and out of place."""

    @pytest.mark.parametrize("inplace", [False, True])
    @pytest.mark.parametrize("layout", LAYOUTS)
    @pytest.mark.parametrize("style", STYLES)
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_layouts_styles_dtypes(self, dtype, style, layout, inplace):
        b = 1 if layout == "thd" else 2
        s, hq, hk, d, offset, theta = 37, 4, 2, 64, 11, 10000.0
        q, k = randn(*shaped(layout, b, s, hq, d), dtype=dtype), randn(*shaped(layout, b, s, hk, d), dtype=dtype)
        q0, k0 = q.clone(), k.clone()
        q_out, k_out = rope_rs.apply_rope(
            q, k, positions=offset, style=style, theta=theta, layout=layout, inplace=inplace
        )
        if inplace:
            assert q_out is q and k_out is k
        else:
            assert torch.equal(q, q0) and torch.equal(k, k0), "out of place must leave the inputs alone"
            assert q_out.shape == q.shape and k_out.dtype == dtype
        pos = torch.arange(s, device=DEV).expand(b, s) + offset
        cos, sin = cos_sin(pos, inv_freq64(theta, d))
        for out, x0 in ((q_out, q0), (k_out, k0)):
            x0, out = as_bshd(x0, layout), as_bshd(out, layout)
            check(out, reference(x0, cos, sin, style))
            check(out, hf_formula(x0, cos, sin, style))

    def test_q_alone_returns_one_tensor(self):
        q = randn(3, 8, 64)
        out = rope_rs.apply_rope(q, positions=2)
        assert isinstance(out, torch.Tensor)
        cos, sin = cos_sin(torch.arange(3, device=DEV)[None] + 2, inv_freq64(10000.0, 64))
        check(out, reference(q[None], cos, sin, "neox")[0])

    def test_outputs_with_their_own_strides(self):
        b, s, h, d = 2, 10, 4, 64
        q = randn(b, s, h, d)
        out = torch.empty(b, h, s, d, device=DEV).transpose(1, 2)  # [b, s, h, d] seen head-major
        res = rope_rs.apply_rope(q, positions=3, out=out)
        assert res is out
        cos, sin = cos_sin(torch.arange(s, device=DEV).expand(b, s) + 3, inv_freq64(10000.0, d))
        check(out, reference(q, cos, sin, "neox"))

    def test_fused_qkv_views(self):
        b, s, hq, hk, d = 2, 9, 8, 2, 64
        qkv = randn(b, s, hq + 2 * hk, d)
        q, k, v = qkv[:, :, :hq], qkv[:, :, hq : hq + hk], qkv[:, :, hq + hk :]
        qkv0 = qkv.clone()
        cos, sin = cos_sin(torch.arange(s, device=DEV).expand(b, s) + 5, inv_freq64(10000.0, d))
        q_out, k_out = rope_rs.apply_rope(q, k, positions=5, style="interleaved")
        check(q_out, reference(qkv0[:, :, :hq], cos, sin, "interleaved"))
        assert torch.equal(qkv, qkv0)
        rope_rs.apply_rope(q, k, positions=5, style="interleaved", inplace=True)
        check(q, reference(qkv0[:, :, :hq], cos, sin, "interleaved"))
        check(k, reference(qkv0[:, :, hq : hq + hk], cos, sin, "interleaved"))
        assert torch.equal(v, qkv0[:, :, hq + hk :]), "v is untouched"
        for backward in (False, True):  # the backward rotation inverts the forward one
            rope_rs.apply_rope(q, k, positions=5, style="interleaved", backward=not backward, inplace=True)
        check(q, reference(qkv0[:, :, :hq], cos, sin, "interleaved"))

    @pytest.mark.parametrize("style", STYLES)
    def test_backward_is_the_transposed_rotation(self, style):
        q = randn(2, 7, 3, 64)
        cos, sin = cos_sin(torch.arange(7, device=DEV).expand(2, 7) + 100, inv_freq64(10000.0, 64))
        out = rope_rs.apply_rope(q, positions=100, style=style, backward=True)
        check(out, reference(q, cos, sin, style, backward=True))
        back = rope_rs.apply_rope(out, positions=100, style=style)
        torch.testing.assert_close(back, q, atol=1e-5, rtol=1e-5)


class TestPositions:
    @pytest.mark.parametrize("int_dtype", [torch.int32, torch.int64])
    @pytest.mark.parametrize("kind", ["row_offsets", "ids_shared", "ids_per_row"])
    def test_position_kinds(self, kind, int_dtype):
        b, s, h, d, theta = 3, 16, 4, 128, 500000.0
        q = randn(b, s, h, d)
        if kind == "row_offsets":
            starts = torch.randint(0, 100000, (b,), device=DEV, dtype=int_dtype)
            pos, kwargs = starts[:, None].long() + torch.arange(s, device=DEV), {"positions": starts}
        elif kind == "ids_shared":
            ids = torch.randint(0, 1 << 20, (s,), device=DEV, dtype=int_dtype)
            pos, kwargs = ids.expand(b, s), {"position_ids": ids}
        else:
            ids = torch.randint(0, 1 << 20, (b, s), device=DEV, dtype=int_dtype)
            pos, kwargs = ids, {"position_ids": ids}
        out = rope_rs.apply_rope(q, theta=theta, **kwargs)
        check(out, reference(q, *cos_sin(pos, inv_freq64(theta, d)), "neox"))

    @pytest.mark.parametrize("offsets", [False, True])
    @pytest.mark.parametrize("int_dtype", [torch.int32, torch.int64])
    def test_packed_sequences(self, offsets, int_dtype):
        lengths, starts = [5, 1, 12, 7], [3, 0, 1000, 42]
        cu = torch.tensor([0, 5, 6, 18, 25], device=DEV, dtype=int_dtype)
        pos = torch.cat([torch.arange(n) + (start if offsets else 0) for n, start in zip(lengths, starts)])
        pos = pos.to(DEV)[None]
        t, hq, hk, d = sum(lengths), 4, 1, 64
        q, k = randn(t, hq, d, dtype=torch.bfloat16), randn(t, hk, d, dtype=torch.bfloat16)
        kwargs = {"positions": torch.tensor(starts, device=DEV, dtype=int_dtype)} if offsets else {}
        q_out, k_out = rope_rs.apply_rope(q, k, cu_seqlens=cu, style="interleaved", **kwargs)
        cos, sin = cos_sin(pos, inv_freq64(10000.0, d))
        check(q_out, reference(q[None], cos, sin, "interleaved")[0])
        check(k_out, reference(k[None], cos, sin, "interleaved")[0])


    @pytest.mark.parametrize("cp_size", [1, 2, 4])
    def test_context_parallel_ranks(self, cp_size):
        # Whole sequences of 8, 16 and 24 tokens (divisible by 2 * cp_size), each rank's tokens
        # cut as Megatron-LM does: chunks r and 2 * cp_size - 1 - r of 2 * cp_size.
        whole = [8, 16, 24]
        cu = torch.tensor([0, 8, 24, 48], device=DEV, dtype=torch.int32)
        h, d = 2, 64
        for rank in range(cp_size):
            pos = []
            for n in whole:
                c = n // (2 * cp_size)
                for chunk in (rank, 2 * cp_size - 1 - rank):
                    pos += list(range(chunk * c, (chunk + 1) * c))
            pos = torch.tensor(pos, device=DEV)[None]
            q = randn(pos.shape[1], h, d, dtype=torch.bfloat16)
            out = rope_rs.apply_rope(q, cu_seqlens=cu, cp_size=cp_size, cp_rank=rank)
            check(out, reference(q[None], *cos_sin(pos, inv_freq64(10000.0, d)), "neox")[0])


def mrope_axes(sections, interleaved):
    """Each pair's axis (0 temporal, 1 height, 2 width) as transformers assigns them: Qwen2-VL's
    ``apply_multimodal_rotary_pos_emb`` in blocks of ``mrope_section``, Qwen3-VL's
    ``apply_interleaved_mrope`` as ``T H W T H W ...`` with the pairs past ``3 * section`` of an
    axis temporal."""
    if not interleaved:
        return [axis for axis, n in enumerate(sections) for _ in range(n)]
    return [
        1 if j % 3 == 1 and j < 3 * sections[1] else 2 if j % 3 == 2 and j < 3 * sections[2] else 0
        for j in range(sum(sections))
    ]


class TestMrope:
    """mRoPE (``mrope_section``): every pair of each token rotated at its axis's row of
    ``position_ids`` [3, batch, seq] (or [3, tokens]), against an f64 reference that picks each
    pair's position by :func:`mrope_axes`."""

    @staticmethod
    def pair_cos_sin(pos, sections, interleaved, theta, d, cache=None):
        """cos, sin [b, s, d/2] in f64: pair j at pos[axis(j)], from theta or a vLLM cache."""
        axes = torch.tensor(mrope_axes(sections, interleaved), device=DEV)
        pp = pos.permute(*range(1, pos.dim()), 0)[..., axes]
        half = d // 2
        if cache is None:
            angle = pp.to(torch.float64) * inv_freq64(theta, d)
            return angle.cos(), angle.sin()
        j = torch.arange(half, device=DEV)
        c = cache.to(torch.float64)
        return c[pp.long(), j], c[pp.long(), half + j]

    @pytest.mark.parametrize("source", ["theta", "cache"])
    @pytest.mark.parametrize("style", ["neox", "interleaved"])
    @pytest.mark.parametrize("interleaved", [False, True])
    def test_mrope_matches_reference(self, interleaved, style, source):
        b, s, hq, hk, d, theta = 2, 40, 4, 2, 128, 1000000.0
        sections = [16, 24, 24]
        # Text tokens (all axes equal) and image tokens (a 5 x 8 grid at one time step).
        pos = torch.randint(0, 4096, (3, b, s), device=DEV)
        pos[:, :, :10] = torch.arange(10, device=DEV)
        q, k = randn(b, s, hq, d, dtype=torch.bfloat16), randn(b, s, hk, d, dtype=torch.bfloat16)
        cache = vllm_cache(theta, d, 4096) if source == "cache" else None
        kwargs = {"cos_sin_cache": cache} if cache is not None else {"theta": theta}
        q_out, k_out = rope_rs.apply_rope(
            q, k, position_ids=pos, mrope_section=sections, mrope_interleaved=interleaved, style=style, **kwargs
        )
        cos, sin = self.pair_cos_sin(pos, sections, interleaved, theta, d, cache)
        check(q_out, reference(q, cos, sin, style))
        check(k_out, reference(k, cos, sin, style))

    def test_packed_tokens_and_gradients(self):
        """[3, tokens] with 3-D q and k, in f32, and the gradient under autograd (the backward
        rotation at the same positions)."""
        t, h, d, theta, sections = 50, 3, 64, 10000.0, [8, 12, 12]
        pos = torch.randint(0, 1000, (3, t), device=DEV)
        q = randn(t, h, d).requires_grad_()
        out = rope_rs.apply_rope(q, position_ids=pos, mrope_section=sections, mrope_interleaved=True, theta=theta)
        cos, sin = self.pair_cos_sin(pos, sections, True, theta, d)
        ref = reference(q.detach()[None], cos[None], sin[None], "neox")[0]
        check(out, ref)
        grad = randn(t, h, d)
        out.backward(grad)
        check(q.grad, reference(grad[None], cos[None], sin[None], "neox", backward=True)[0])

    @pytest.mark.parametrize("style", ["interleaved", "neox"])
    def test_axial_matches_reference(self, style):
        """FLUX's ``EmbedND`` (``axes_dim`` [16, 56, 56], theta 10000, float64 frequencies):
        axis ``a`` owns ``axes_dim[a] / 2`` consecutive pairs at ``theta ** (-2i / axes_dim[a])``,
        rotated at that axis's row of ``position_ids`` [3, batch, seq]."""
        b, s, h, d, theta, axes_dim = 2, 30, 3, 128, 10000.0, [16, 56, 56]
        pos = torch.randint(0, 64, (3, b, s), device=DEV)
        q, k = randn(b, s, h, d, dtype=torch.bfloat16), randn(b, s, h, d, dtype=torch.bfloat16)
        q_out, k_out = rope_rs.apply_rope(q, k, position_ids=pos, axes_dim=axes_dim, theta=theta, style=style)
        angles = []
        for a, width in enumerate(axes_dim):
            freqs = theta ** (-torch.arange(0, width, 2, dtype=torch.float64, device=DEV) / width)
            angles.append(pos[a].to(torch.float64)[..., None] * freqs)
        angle = torch.cat(angles, -1)
        check(q_out, reference(q, angle.cos(), angle.sin(), style))
        check(k_out, reference(k, angle.cos(), angle.sin(), style))

    def test_compiled_matches_eager(self):
        b, s, h, d, sections = 1, 24, 2, 128, [16, 24, 24]
        pos = torch.randint(0, 4096, (3, b, s), device=DEV)
        q = randn(b, s, h, d, dtype=torch.bfloat16)

        def step(x, p):
            return rope_rs.apply_rope(x, position_ids=p, mrope_section=sections, theta=1000000.0)

        torch.testing.assert_close(torch.compile(step, fullgraph=True)(q, pos), step(q, pos), rtol=0, atol=0)


SOURCES = ["theta", "cache_f32", "cache_same", "tables_f32", "tables_same", "inv_freq_f64", "inv_freq_f32", "inv_freq_list"]


class TestSinCos:
    @pytest.mark.parametrize("rotary_dim", [64, 32])
    @pytest.mark.parametrize("source", SOURCES)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_sources_and_partial_rotary(self, dtype, source, rotary_dim):
        t, h, d, max_position, theta = 50, 4, 64, 4096, 10000.0
        ids = torch.randint(0, max_position, (t,), device=DEV, dtype=torch.int64)
        q = randn(t, h, d, dtype=dtype)
        f = inv_freq64(theta, rotary_dim)
        table_dtype = torch.float32 if source.endswith("f32") else dtype
        if source == "theta":
            kwargs, (cos, sin) = {"theta": theta, "rotary_dim": rotary_dim}, cos_sin(ids, f)
        elif source.startswith("cache"):
            cache = vllm_cache(theta, rotary_dim, max_position, table_dtype)
            kwargs = {"cos_sin_cache": cache}
            cos, sin = table_cos_sin(ids, cache[:, : rotary_dim // 2], cache[:, rotary_dim // 2 :])
        elif source.startswith("tables"):
            c, s = cos_sin(torch.arange(max_position, device=DEV), f)
            c, s = c.to(table_dtype), s.to(table_dtype)
            kwargs, (cos, sin) = {"cos": c, "sin": s}, table_cos_sin(ids, c, s)
        elif source == "inv_freq_f64":
            kwargs, (cos, sin) = {"inv_freq": f}, cos_sin(ids, f)
        elif source == "inv_freq_f32":  # converted to f64 exactly: the f32 values are the frequencies
            kwargs, (cos, sin) = {"inv_freq": f.float()}, cos_sin(ids, f.float())
        else:
            kwargs, (cos, sin) = {"inv_freq": f.tolist()}, cos_sin(ids, f)
        out = rope_rs.apply_rope(q, position_ids=ids, **kwargs)
        check(out, reference(q[None], cos[None], sin[None], "neox", rotary_dim=rotary_dim)[0])
        assert torch.equal(out[..., rotary_dim:], q[..., rotary_dim:]), "features past rotary_dim are copied"

    def test_attention_factor_scales_cos_and_sin(self):
        q, f = randn(2, 5, 3, 32), inv_freq64(10000.0, 32)
        out = rope_rs.apply_rope(q, positions=9, inv_freq=f, attention_factor=1.25)
        pos = torch.arange(5, device=DEV).expand(2, 5) + 9
        check(out, reference(q, *cos_sin(pos, f, 1.25), "neox"))

    def test_positions_outside_a_table_give_nan(self):
        cache = vllm_cache(10000.0, 64, 16)
        q = randn(4, 2, 64)
        ids = torch.tensor([0, 15, 16, -1], device=DEV)
        out = rope_rs.apply_rope(q, position_ids=ids, cos_sin_cache=cache)
        assert out[:2].isfinite().all() and out[2:].isnan().all()

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_angle_f32_reproduces_a_models_own_angles(self, dtype):
        """With a model's f32 ``inv_freq`` and ``angle="f32"``, the angles are its own
        ``f32(p) * inv_freq`` (Hugging Face's rotary embedding), at long positions too."""
        pytest.importorskip("transformers")
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        d, s = 128, 64
        config = LlamaConfig(hidden_size=4 * d, num_attention_heads=4, head_dim=d, rope_theta=500000.0)
        rot = LlamaRotaryEmbedding(config=config).to(DEV)
        pos = torch.randint(50000, 120000, (1, s), device=DEV)
        cos, sin = rot(torch.zeros(1, device=DEV), pos)
        q = randn(1, s, 4, d, dtype=dtype)
        out = rope_rs.apply_rope(q, position_ids=pos, inv_freq=rot.inv_freq, angle="f32")
        half = d // 2
        check(out, hf_formula(q, cos[..., :half], sin[..., :half], "neox"))
        if dtype == torch.float32:
            exact = rope_rs.apply_rope(q, position_ids=pos, inv_freq=rot.inv_freq)
            assert (exact - out).abs().max() > 1e-3, "f32 angles differ from exact ones at these positions"


# Hugging Face's scaling families, each as transformers' config carries it (and as the dict
# rope_rs takes), with the base it is used with and the largest position tested.
MAX_POSITION_EMBEDDINGS = 4096
FAMILIES = {
    "default": (10000.0, {"rope_type": "default"}, 3000),
    "linear": (10000.0, {"rope_type": "linear", "factor": 4.0}, 3000),
    "dynamic": (10000.0, {"rope_type": "dynamic", "factor": 2.0}, 6000),
    "yarn": (10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}, 3000),
    "yarn_mscale": (
        10000.0,
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        3000,
    ),
    "longrope_short": (
        10000.0,
        {
            "rope_type": "longrope",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "short_factor": [1.0 + 0.02 * i for i in range(32)],
            "long_factor": [1.0 + 0.5 * i for i in range(32)],
        },
        1000,
    ),
    "longrope_long": (
        10000.0,
        {
            "rope_type": "longrope",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "short_factor": [1.0 + 0.02 * i for i in range(32)],
            "long_factor": [1.0 + 0.5 * i for i in range(32)],
        },
        3000,
    ),
    "llama3": (
        500000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
        3000,
    ),
}
HEAD_DIM = 64


def rope_rs_scaling(family, seq_len):
    """The dict rope_rs takes for `family`: the config's, plus the lengths it reads."""
    _, scaling, _ = FAMILIES[family]
    return {**scaling, "max_position_embeddings": MAX_POSITION_EMBEDDINGS, "seq_len": seq_len}


def hf_rotary_embedding(family, pos):
    """transformers' rotary embedding of `family` after a forward at positions `pos` (which
    updates the dynamic and LongRoPE frequencies as a model's forward does), and its cos/sin."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    theta, scaling, _ = FAMILIES[family]
    kwargs = {
        "hidden_size": 4 * HEAD_DIM,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rope_theta": theta,
    }
    if scaling["rope_type"] != "default":
        kwargs["rope_scaling"] = dict(scaling)
    if scaling["rope_type"] == "longrope":
        # transformers 4 reads the original context from the config's top level.
        kwargs["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
    rot = LlamaRotaryEmbedding(config=LlamaConfig(**kwargs)).to(DEV)
    cos, sin = rot(torch.zeros(1, device=DEV), pos)
    return rot, cos, sin


class TestScalingFamilies:
    @pytest.mark.parametrize("family", FAMILIES)
    def test_frequencies_match_transformers(self, family):
        theta, _, max_pos = FAMILIES[family]
        pos = torch.arange(max_pos, device=DEV)[None]
        rot, _, _ = hf_rotary_embedding(family, pos)
        f, attention = rope_rs.frequencies(HEAD_DIM, theta=theta, scaling=rope_rs_scaling(family, max_pos))
        hf = rot.inv_freq.to(torch.float64).cpu()
        torch.testing.assert_close(torch.tensor(f, dtype=torch.float64), hf, rtol=1e-5, atol=0)
        assert attention == pytest.approx(float(rot.attention_scaling), rel=1e-6)

    @pytest.mark.parametrize("style", STYLES)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("family", FAMILIES)
    def test_kernels_match_the_f64_reference(self, family, dtype, style):
        theta, _, max_pos = FAMILIES[family]
        b, s, hq, hk = 2, 24, 4, 2
        pos = torch.randint(0, max_pos, (b, s), device=DEV)
        pos[0, 0] = max_pos - 1
        scaling = rope_rs_scaling(family, max_pos)
        q, k = randn(b, s, hq, HEAD_DIM, dtype=dtype), randn(b, s, hk, HEAD_DIM, dtype=dtype)
        q_out, k_out = rope_rs.apply_rope(q, k, position_ids=pos, theta=theta, scaling=scaling, style=style)
        f, attention = rope_rs.frequencies(HEAD_DIM, theta=theta, scaling=scaling)
        cos, sin = cos_sin(pos, torch.tensor(f, dtype=torch.float64), attention)
        check(q_out, reference(q, cos, sin, style))
        check(k_out, reference(k, cos, sin, style))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("family", FAMILIES)
    def test_end_to_end_against_transformers(self, family, dtype):
        """Against transformers' rotary embedding and apply_rotary_pos_emb, whose f32 angles are
        off the exact ones by up to ``p * inv_freq * 2^-23``: compared in f64 with that margin."""
        theta, _, max_pos = FAMILIES[family]
        b, s = 2, 24
        pos = torch.randint(0, max_pos, (b, s), device=DEV)
        pos[0, 0] = max_pos - 1
        _, cos, sin = hf_rotary_embedding(family, pos)
        q = randn(b, s, 4, HEAD_DIM, dtype=dtype)
        out = rope_rs.apply_rope(q, position_ids=pos, theta=theta, scaling=rope_rs_scaling(family, max_pos))
        half = HEAD_DIM // 2
        margin = 4 * max_pos * 2.0**-23 * q.abs().max().item()
        check(out, hf_formula(q, cos[..., :half], sin[..., :half], "neox"), extra_atol=margin)


class TestDropIns:
    @pytest.mark.parametrize("flashinfer", [False, True])
    @pytest.mark.parametrize("is_neox", [True, False])
    def test_vllm_and_flashinfer(self, is_neox, flashinfer):
        t, hq, hk, d, max_position = 33, 8, 2, 128, 2048
        qkv = randn(t, (hq + 2 * hk) * d, dtype=torch.bfloat16)
        query, key = qkv[:, : hq * d], qkv[:, hq * d : (hq + hk) * d]
        cache = vllm_cache(10000.0, d, max_position)
        positions = torch.randint(0, max_position, (t,), device=DEV, dtype=torch.int64)
        q0, k0 = query.clone().view(t, hq, d), key.clone().view(t, hk, d)
        v0 = qkv[:, (hq + hk) * d :].clone()
        if flashinfer:
            rope_rs.apply_rope_with_cos_sin_cache_inplace(positions, query, key, d, cache, is_neox=is_neox)
        else:
            rope_rs.rotary_embedding(positions, query, key, d, cache, is_neox)
        style = "neox" if is_neox else "interleaved"
        cos, sin = table_cos_sin(positions, cache[:, : d // 2], cache[:, d // 2 :])
        check(query.view(t, hq, d), reference(q0[None], cos[None], sin[None], style)[0])
        check(key.view(t, hk, d), reference(k0[None], cos[None], sin[None], style)[0])
        assert torch.equal(qkv[:, (hq + hk) * d :], v0), "v is untouched"

    def test_vllm_partial_rotary(self):
        t, h, d, r = 9, 4, 128, 64
        query = randn(t, h * d, dtype=torch.float16)
        q0 = query.clone().view(t, h, d)
        cache = vllm_cache(10000.0, r, 512, torch.float16)
        positions = torch.randint(0, 512, (t,), device=DEV, dtype=torch.int32)
        rope_rs.rotary_embedding(positions, query, None, d, cache, True)
        cos, sin = table_cos_sin(positions, cache[:, : r // 2], cache[:, r // 2 :])
        check(query.view(t, h, d), reference(q0[None], cos[None], sin[None], "neox", rotary_dim=r)[0])

    @pytest.mark.parametrize("cos_batch", [1, 2])
    @pytest.mark.parametrize("unsqueeze_dim", [1, 2])
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_hugging_face_apply_rotary_pos_emb(self, dtype, unsqueeze_dim, cos_batch):
        pytest.importorskip("transformers")
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, hq, hk, s, d = 2, 4, 2, 19, 64
        # Hugging Face's cos/sin: cat(freqs, freqs) at each token's position, in q's dtype.
        pos = torch.randint(0, 4096, (cos_batch, s), device=DEV)
        c, sn = cos_sin(pos, inv_freq64(10000.0, d))
        cos, sin = torch.cat((c, c), -1).to(dtype), torch.cat((sn, sn), -1).to(dtype)
        shape = (lambda h: (b, h, s, d)) if unsqueeze_dim == 1 else (lambda h: (b, s, h, d))
        q, k = randn(*shape(hq), dtype=dtype), randn(*shape(hk), dtype=dtype)
        q_embed, k_embed = rope_rs.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        want_q, want_k = apply_rotary_pos_emb(
            q.double(), k.double(), cos.double(), sin.double(), unsqueeze_dim=unsqueeze_dim
        )
        check(q_embed, want_q)
        check(k_embed, want_k)

    def test_hugging_face_tables_follow_new_and_rewritten_cos_sin(self):
        """The drop-in reuses the last call's views of cos and sin (a model passes the same pair
        to every layer); a new pair, a pair rewritten in place, and a pair of other positions
        for another batch size each rotate by what they hold."""
        pytest.importorskip("transformers")
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        d = 64

        def tables(pos):
            c, sn = cos_sin(pos, inv_freq64(10000.0, d))
            return torch.cat((c, c), -1).float(), torch.cat((sn, sn), -1).float()

        def rotate_and_check(q, k, cos, sin):
            q_embed, k_embed = rope_rs.apply_rotary_pos_emb(q, k, cos, sin)
            want_q, want_k = apply_rotary_pos_emb(q.double(), k.double(), cos.double(), sin.double())
            check(q_embed, want_q)
            check(k_embed, want_k)

        q, k = randn(2, 4, 7, d), randn(2, 2, 7, d)
        cos, sin = tables(torch.randint(0, 4096, (1, 7), device=DEV))
        for _ in range(2):  # the second call reuses the first's tables
            rotate_and_check(q, k, cos, sin)
        new_cos, new_sin = tables(torch.randint(0, 4096, (1, 7), device=DEV))
        cos.copy_(new_cos), sin.copy_(new_sin)  # rewritten in place: same addresses
        rotate_and_check(q, k, cos, sin)
        rotate_and_check(q, k, *tables(torch.randint(0, 4096, (1, 7), device=DEV)))  # a new pair
        q3, k3 = randn(3, 4, 7, d), randn(3, 2, 7, d)
        rotate_and_check(q3, k3, *tables(torch.randint(0, 4096, (3, 7), device=DEV)))  # per batch row

    def test_hugging_face_outputs_are_new_tensors_laid_out_like_the_inputs(self):
        """The drop-in's outputs are new tensors in the layout ``torch.empty_like`` gives (a
        transposed q stays transposed), the inputs stay untouched, and a call with the kept
        tables of the previous one leaves no memory behind."""
        d = 64
        c, sn = cos_sin(torch.randint(0, 4096, (1, 9), device=DEV), inv_freq64(10000.0, d))
        cos, sin = torch.cat((c, c), -1).float(), torch.cat((sn, sn), -1).float()
        for q, k in (
            (randn(2, 9, 4, d).transpose(1, 2), randn(2, 9, 2, d).transpose(1, 2)),
            (randn(2, 4, 9, d), None),
        ):
            q0 = q.clone()
            q_embed, k_embed = rope_rs.apply_rotary_pos_emb(q, k, cos, sin)
            assert q_embed.stride() == torch.empty_like(q).stride() and q_embed.shape == q.shape
            assert q_embed.data_ptr() != q.data_ptr() and torch.equal(q, q0)
            assert (k_embed is None) == (k is None)
            if k is not None:
                assert k_embed.stride() == torch.empty_like(k).stride()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for _ in range(50):
            rope_rs.apply_rotary_pos_emb(q, k, cos, sin)
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before

    def test_hugging_face_drop_in_launches_one_kernel(self):
        """After a first call, a decode step through the HF drop-in (cos/sin [1, seq, r]) runs
        one kernel: positions come from a kept vector, not an ``arange`` per call."""
        b, s, d = 4, 1, 64
        c, sn = cos_sin(torch.full((1, s), 17, device=DEV), inv_freq64(10000.0, d))
        cos, sin = torch.cat((c, c), -1).float(), torch.cat((sn, sn), -1).float()
        q, k = randn(b, 8, s, d), randn(b, 2, s, d)
        want = rope_rs.apply_rotary_pos_emb(q, k, cos, sin)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = rope_rs.apply_rotary_pos_emb(q, k, cos, sin)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1 and kernels[0].startswith("rope_"), kernels
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    def test_hugging_face_partial_and_older_tables(self):
        """cos/sin narrower than the heads rotate the first features; transformers' older form,
        tables [max_position, r] indexed by position_ids, works too."""
        pytest.importorskip("transformers")
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, h, s, d, r, max_position = 2, 4, 11, 64, 32, 128
        c, sn = cos_sin(torch.arange(max_position, device=DEV), inv_freq64(10000.0, r))
        cos_table, sin_table = torch.cat((c, c), -1).float(), torch.cat((sn, sn), -1).float()
        position_ids = torch.randint(0, max_position, (b, s), device=DEV)
        q, k = randn(b, h, s, d), randn(b, h, s, d)
        q_embed, k_embed = rope_rs.apply_rotary_pos_emb(q, k, cos_table, sin_table, position_ids)
        cos, sin = cos_table[position_ids].double(), sin_table[position_ids].double()
        for x, got in ((q, q_embed), (k, k_embed)):
            rot, _ = apply_rotary_pos_emb(x[..., :r].double(), x[..., :r].double(), cos, sin)
            check(got, torch.cat((rot, x[..., r:].double()), -1))

    def test_patching_a_hugging_face_model(self):
        """A Llama model with rope_rs patched in gives the model's own outputs and gradients."""
        pytest.importorskip("transformers")
        import transformers.models.llama.modeling_llama as llama
        from transformers import LlamaConfig, LlamaModel

        torch.manual_seed(0)
        config = LlamaConfig(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            vocab_size=1000,
            max_position_embeddings=4096,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        )
        model = LlamaModel(config).to(DEV)
        ids = torch.randint(0, 1000, (2, 50), device=DEV)

        def run():
            model.zero_grad()
            hidden = model(input_ids=ids).last_hidden_state
            hidden.square().mean().backward()
            return hidden.detach(), model.layers[0].self_attn.q_proj.weight.grad.clone()

        want_hidden, want_grad = run()
        original = llama.apply_rotary_pos_emb
        llama.apply_rotary_pos_emb = rope_rs.apply_rotary_pos_emb
        try:
            hidden, grad = run()
        finally:
            llama.apply_rotary_pos_emb = original
        torch.testing.assert_close(hidden, want_hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(grad, want_grad, atol=1e-4, rtol=1e-3)


def rms_normed(x, w, eps):
    """x [..., d] RMS-normalised in f64 over the last dimension, times w [d]."""
    x = x.to(torch.float64)
    return x / (x.square().mean(-1, keepdim=True) + eps).sqrt() * w.to(torch.float64)


def fp8_close(got, want, scale):
    """FP8 E4M3 bytes `got` (uint8 or float8_e4m3fn) decode to `want / scale` (f64, saturated at
    448) within one E4M3 step, and nearly all to the nearest value exactly."""
    decoded = got.view(torch.float8_e4m3fn).to(torch.float64)
    target = (want.to(torch.float64) / scale).clamp(-448, 448)
    torch.testing.assert_close(decoded, target, atol=2.0**-9, rtol=2.0**-3)
    exact = (decoded == target.to(torch.float8_e4m3fn).to(torch.float64)).double().mean().item()
    assert exact > 0.98, f"only {exact:.4f} of the FP8 bytes are the nearest value"


class ServingCase:
    """A decode or prefill step of a serving stack: a packed QKV of `t` tokens (bf16), norm
    weights, vLLM's cos_sin_cache, positions, and a paged cache of `blocks` blocks of
    `block_size` rows with a slot per token (some -1: padding), filled with a sentinel."""

    def __init__(self, t=37, hq=8, hk=2, d=128, block_size=16, blocks=12, dtype=torch.bfloat16, seed=0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.t, self.hq, self.hk, self.d, self.dtype = t, hq, hk, d, dtype
        self.qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEV, generator=g).to(dtype)
        self.q_weight = (1 + 0.1 * torch.randn(d, device=DEV, generator=g)).to(dtype)
        self.k_weight = (1 + 0.1 * torch.randn(d, device=DEV, generator=g)).to(dtype)
        self.cache = vllm_cache(10000.0, d, 4096)
        self.positions = torch.randint(0, 4096, (t,), device=DEV, generator=g)
        slots = torch.randperm(blocks * block_size, device=DEV, generator=g)[:t]
        slots[::5] = -1
        self.slots = slots
        self.block_size, self.blocks = block_size, blocks

    def split(self, qkv=None):
        qkv = self.qkv if qkv is None else qkv
        hq, hk, d = self.hq, self.hk, self.d
        return qkv[:, : hq * d], qkv[:, hq * d : (hq + hk) * d], qkv[:, (hq + hk) * d :]

    def paged(self, dtype=None):
        """A key or value cache [blocks, block_size, hk, d] of a sentinel value."""
        shape = (self.blocks, self.block_size, self.hk, self.d)
        if dtype == torch.uint8:
            return torch.full(shape, 0x7E, device=DEV, dtype=torch.uint8)
        return torch.full(shape, -7.0, device=DEV, dtype=dtype or self.dtype)

    def reference(self, style, norm):
        """q and k after the (optional) norm and the rotation, in f64 [t, h, d]."""
        q, k, _ = (x.reshape(self.t, -1, self.d) for x in self.split())
        if norm:
            q, k = rms_normed(q, self.q_weight, 1e-6), rms_normed(k, self.k_weight, 1e-6)
        d = self.d
        cos, sin = table_cos_sin(self.positions, self.cache[:, : d // 2], self.cache[:, d // 2 :])
        rot = lambda x: reference(x[None], cos[None], sin[None], style)[0]  # noqa: E731
        return rot(q), rot(k)

    def check_paged(self, key_cache, value_cache, k_rotated, v):
        """Each kept slot holds the token's rotated k and its v (bit for bit); every other row
        still holds the sentinel."""
        flat_k = key_cache.view(-1, self.hk, self.d)
        flat_v = value_cache.view(-1, self.hk, self.d)
        kept = self.slots >= 0
        rows = self.slots[kept]
        assert torch.equal(flat_k[rows], k_rotated.reshape(self.t, self.hk, self.d)[kept])
        assert torch.equal(flat_v[rows], v.reshape(self.t, self.hk, self.d)[kept])
        untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEV)
        untouched[rows] = False
        sentinel = self.paged(key_cache.dtype).view(-1, self.hk, self.d)[0]
        assert (flat_k[untouched] == sentinel).all() and (flat_v[untouched] == sentinel).all()


class TestServing:
    """The fused serving epilogue through the peers' signatures: vLLM's ``fused_qk_norm_rope``
    (with and without its cache write) and ``rotary_embedding`` with a cache, SGLang's
    ``apply_rope_with_cos_sin_cache_inplace`` with ``FusedSetKVBufferArg``; eagerly, under
    ``torch.compile(fullgraph=True)`` and replayed from a CUDA graph. References are written
    from the peers' documented semantics."""

    @pytest.mark.parametrize("is_neox", [True, False])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    @pytest.mark.parametrize("d", [128, 256, 512])
    def test_vllm_fused_qk_norm_rope(self, is_neox, dtype, d):
        """Heads of 512 (Gemma 4's global layers), and float32 heads of 256 interleaved, take
        more than a warp's accesses per head: their norm is summed across the head's warps."""
        c = ServingCase(d=d, dtype=dtype, seed=int(is_neox) + d)
        style = "neox" if is_neox else "interleaved"
        want_q, want_k = c.reference(style, norm=True)
        v0 = c.split()[2].clone()
        rope_rs.fused_qk_norm_rope(
            c.qkv, c.hq, c.hk, c.hk, c.d, 1e-6, c.q_weight, c.k_weight, c.cache, is_neox, c.positions
        )
        q, k, v = c.split()
        # Normalised values reach ~4: 16-bit outputs round at that magnitude.
        check(q.reshape(c.t, c.hq, c.d), want_q, extra_atol=0.0 if dtype == torch.float32 else 2e-2)
        check(k.reshape(c.t, c.hk, c.d), want_k, extra_atol=0.0 if dtype == torch.float32 else 2e-2)
        assert torch.equal(v, v0), "v is untouched"

    @pytest.mark.parametrize("interleaved", [False, True])
    @pytest.mark.parametrize("with_cache", [False, True])
    def test_fused_qk_norm_rope_with_mrope(self, interleaved, with_cache):
        """Qwen3-VL's step: QK-norm, then mRoPE at position_ids [3, num_tokens] (text tokens with
        equal axes, image tokens on a grid), and the cache write, in one launch."""
        c = ServingCase(seed=11)
        sections = [16, 24, 24]
        pos = torch.randint(0, 4096, (3, c.t), device=DEV)
        pos[:, :8] = torch.arange(8, device=DEV)
        q, k, v = (x.reshape(c.t, -1, c.d) for x in c.split())
        want_q, want_k = rms_normed(q, c.q_weight, 1e-6), rms_normed(k, c.k_weight, 1e-6)
        cos, sin = TestMrope.pair_cos_sin(pos, sections, interleaved, 10000.0, c.d, c.cache)
        rot = lambda x: reference(x[None], cos[None], sin[None], "neox")[0]  # noqa: E731
        want_q, want_k = rot(want_q), rot(want_k)
        v0 = c.split()[2].clone()
        key_cache, value_cache = c.paged(), c.paged()
        cached = dict(key_cache=key_cache, value_cache=value_cache, slot_mapping=c.slots) if with_cache else {}
        rope_rs.fused_qk_norm_rope(
            c.qkv, c.hq, c.hk, c.hk, c.d, 1e-6, c.q_weight, c.k_weight, c.cache, True, pos,
            mrope_section=sections, mrope_interleaved=interleaved, **cached,
        )
        q, k, v = c.split()
        check(q.reshape(c.t, c.hq, c.d), want_q, extra_atol=2e-2)
        check(k.reshape(c.t, c.hk, c.d), want_k, extra_atol=2e-2)
        assert torch.equal(v, v0), "v is untouched"
        if with_cache:
            c.check_paged(key_cache, value_cache, k, v)

    @pytest.mark.parametrize("fp8", [False, True])
    def test_vllm_fused_qk_norm_rope_with_its_cache_write(self, fp8):
        c = ServingCase(seed=3)
        want_q, want_k = c.reference("neox", norm=True)
        _, _, v = c.split()
        v0 = v.clone()
        key_cache, value_cache = c.paged(torch.uint8 if fp8 else None), c.paged(torch.uint8 if fp8 else None)
        scales = dict(kv_cache_dtype="fp8", k_scale=torch.tensor([0.5], device=DEV), v_scale=torch.tensor([0.25], device=DEV)) if fp8 else {}
        rope_rs.fused_qk_norm_rope(
            c.qkv, c.hq, c.hk, c.hk, c.d, 1e-6, c.q_weight, c.k_weight, c.cache, True, c.positions,
            key_cache=key_cache, value_cache=value_cache, slot_mapping=c.slots, **scales,
        )
        q, k, _ = c.split()
        check(q.reshape(c.t, c.hq, c.d), want_q, extra_atol=2e-2)
        check(k.reshape(c.t, c.hk, c.d), want_k, extra_atol=2e-2)
        if not fp8:
            c.check_paged(key_cache, value_cache, k, v0)
            return
        kept = c.slots >= 0
        rows = c.slots[kept]
        fp8_close(key_cache.view(-1, c.hk, c.d)[rows], want_k[kept], 0.5)
        fp8_close(value_cache.view(-1, c.hk, c.d)[rows], v0.reshape(c.t, c.hk, c.d)[kept], 0.25)
        others = torch.ones(c.blocks * c.block_size, dtype=torch.bool, device=DEV)
        others[rows] = False
        assert (key_cache.view(-1, c.hk, c.d)[others] == 0x7E).all()

    @pytest.mark.parametrize("is_neox", [True, False])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("d", [128, 64])
    def test_vllm_fused_qk_norm_rope_into_an_nvfp4_cache(self, d, dtype, is_neox):
        """``kv_cache_dtype="nvfp4"``: vLLM's packed uint8 rows ``[blocks, block_size, hk, d/2 +
        d/16]``, each head's E2M1 codes (two a byte, the even element low) then its E4M3 scales,
        one per 16 elements: every block scale is ``max|x| / (6 s)`` rounded to E4M3, and every
        code ``x / (b s)`` rounded to E2M1 (within half a step, saturated at 6), for k (normalised
        and rotated) and v; rows without a slot keep their sentinel."""
        c = ServingCase(d=d, dtype=dtype, seed=70 + d + int(is_neox))
        _, want_k = c.reference("neox" if is_neox else "interleaved", norm=True)
        _, _, v = c.split()
        v0 = v.clone().reshape(c.t, c.hk, d).to(torch.float64)
        row = d // 2 + d // 16
        shape = (c.blocks, c.block_size, c.hk, row)
        key_cache = torch.full(shape, 0x7E, device=DEV, dtype=torch.uint8)
        value_cache = torch.full(shape, 0x7E, device=DEV, dtype=torch.uint8)
        k_scale, v_scale = torch.tensor([0.05], device=DEV), torch.tensor([0.02], device=DEV)
        rope_rs.fused_qk_norm_rope(
            c.qkv, c.hq, c.hk, c.hk, d, 1e-6, c.q_weight, c.k_weight, c.cache, is_neox, c.positions,
            key_cache=key_cache, value_cache=value_cache, slot_mapping=c.slots, kv_cache_dtype="nvfp4",
            k_scale=k_scale, v_scale=v_scale,
        )
        e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64, device=DEV)
        kept = c.slots >= 0
        rows = c.slots[kept]
        for cache, want, s in ((key_cache, want_k, 0.05), (value_cache, v0, 0.02)):
            flat = cache.view(-1, c.hk, row)
            got = flat[rows]
            codes = got[..., : d // 2]
            nibbles = torch.stack((codes & 0xF, codes >> 4), -1).reshape(-1, c.hk, d).long()
            values = e2m1[nibbles & 7] * torch.where(nibbles >= 8, -1.0, 1.0)
            b = got[..., d // 2 :].view(torch.float8_e4m3fn).to(torch.float64)
            x = want[kept].reshape(-1, c.hk, d // 16, 16)
            t = x.abs().amax(-1) / (6 * s)
            nearest = t.to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64)
            assert (b == nearest).double().mean().item() > 0.99
            torch.testing.assert_close(b, t, rtol=2.0**-4, atol=2.0**-10)
            z = (x / (b[..., None] * s)).clamp(-6, 6)
            step = torch.where(z.abs() < 2, 0.5, torch.where(z.abs() < 4, 1.0, 2.0))
            err = (values.reshape(z.shape) - z).abs()
            assert (err <= step / 2 + 1e-6).all(), f"codes off by {(err - step / 2).max().item()}"
            others = torch.ones(flat.shape[0], dtype=torch.bool, device=DEV)
            others[rows] = False
            assert (flat[others] == 0x7E).all()
        with pytest.raises(ValueError, match="k_scale"):
            rope_rs.fused_qk_norm_rope(
                c.qkv, c.hq, c.hk, c.hk, d, 1e-6, c.q_weight, c.k_weight, c.cache, is_neox, c.positions,
                key_cache=key_cache, value_cache=value_cache, slot_mapping=c.slots, kv_cache_dtype="nvfp4",
            )

    @pytest.mark.parametrize("is_neox", [True, False])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("d, rotary_dim", [(128, 64), (128, 32), (96, 64), (256, 128), (64, 48)])
    def test_vllm_fused_qk_norm_rope_partial_rotary(self, d, rotary_dim, dtype, is_neox):
        """vLLM's ``fused_qk_norm_rope`` with a ``cos_sin_cache`` narrower than the head (GLM-4
        and Phi rotate part of it): every q and k head normalised whole, its first
        ``rotary_dim`` features rotated, the rest stored normalised; the cache write stores the
        same k and v as they are."""
        c = ServingCase(d=d, dtype=dtype, seed=60 + d + rotary_dim + int(is_neox))
        style = "neox" if is_neox else "interleaved"
        cache = vllm_cache(10000.0, rotary_dim, 4096, dtype)
        q, k, v = (x.reshape(c.t, -1, d) for x in c.split())
        q, k = rms_normed(q, c.q_weight, 1e-6), rms_normed(k, c.k_weight, 1e-6)
        half = rotary_dim // 2
        cos, sin = table_cos_sin(c.positions, cache[:, :half], cache[:, half:])
        rot = lambda x: reference(x[None], cos[None], sin[None], style, rotary_dim)[0]  # noqa: E731
        want_q, want_k, v0 = rot(q), rot(k), v.clone()
        key_cache, value_cache = c.paged(), c.paged()
        rope_rs.fused_qk_norm_rope(
            c.qkv, c.hq, c.hk, c.hk, d, 1e-6, c.q_weight, c.k_weight, cache, is_neox, c.positions,
            key_cache=key_cache, value_cache=value_cache, slot_mapping=c.slots,
        )
        q, k, _ = c.split()
        check(q.reshape(c.t, c.hq, d), want_q, extra_atol=2e-2)
        check(k.reshape(c.t, c.hk, d), want_k, extra_atol=2e-2)
        c.check_paged(key_cache, value_cache, k, v0)

    @pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
    def test_vllm_rotary_embedding_with_its_cache_write(self, slot_dtype):
        c = ServingCase(seed=4)
        want_q, want_k = c.reference("interleaved", norm=False)
        query, key, value = c.split()
        v0 = value.clone()
        key_cache, value_cache = c.paged(), c.paged()
        rope_rs.rotary_embedding(
            c.positions, query, key, c.d, c.cache, False, value=value, key_cache=key_cache,
            value_cache=value_cache, slot_mapping=c.slots.to(slot_dtype),
        )
        check(query.reshape(c.t, c.hq, c.d), want_q)
        check(key.reshape(c.t, c.hk, c.d), want_k)
        c.check_paged(key_cache, value_cache, key, v0)

    def test_vllm_rotary_embedding_partial_with_its_cache_write(self):
        """vLLM's ``rotary_embedding`` with a narrower ``cos_sin_cache`` and a cache write: the
        first 64 of 128 features rotated, the rest as they were, in place and in the cache."""
        c = ServingCase(seed=16)
        r = 64
        cache = vllm_cache(10000.0, r, 4096, c.dtype)
        query, key, value = c.split()
        q0, k0, v0 = (x.reshape(c.t, -1, c.d).clone() for x in (query, key, value))
        cos, sin = table_cos_sin(c.positions, cache[:, : r // 2], cache[:, r // 2 :])
        rot = lambda x: reference(x[None], cos[None], sin[None], "neox", r)[0]  # noqa: E731
        key_cache, value_cache = c.paged(), c.paged()
        rope_rs.rotary_embedding(
            c.positions, query, key, c.d, cache, True, value=value, key_cache=key_cache,
            value_cache=value_cache, slot_mapping=c.slots,
        )
        check(query.reshape(c.t, c.hq, c.d), rot(q0))
        check(key.reshape(c.t, c.hk, c.d), rot(k0))
        assert torch.equal(query.reshape(c.t, c.hq, c.d)[..., r:], q0[..., r:]), "the rest as it was"
        c.check_paged(key_cache, value_cache, key, v0)

    def test_vllm_rotary_embedding_into_an_e5m2_cache(self):
        c = ServingCase(seed=15)
        _, want_k = c.reference("neox", norm=False)
        query, key, value = c.split()
        v0 = value.clone()
        shape = (c.blocks, c.block_size, c.hk, c.d)
        key_cache = torch.full(shape, 0x3C, device=DEV, dtype=torch.uint8).view(torch.float8_e5m2)
        value_cache = torch.full(shape, 0x3C, device=DEV, dtype=torch.uint8).view(torch.float8_e5m2)
        k_scale, v_scale = torch.tensor([0.5], device=DEV), torch.tensor([0.125], device=DEV)
        rope_rs.rotary_embedding(
            c.positions, query, key, c.d, c.cache, True, value=value, key_cache=key_cache,
            value_cache=value_cache, slot_mapping=c.slots, kv_cache_dtype="fp8_e5m2", k_scale=k_scale,
            v_scale=v_scale,
        )
        kept = c.slots >= 0
        rows = c.slots[kept]
        fp8_near(key_cache.view(-1, c.hk, c.d)[rows], want_k[kept], 2.0, torch.float8_e5m2)
        fp8_near(value_cache.view(-1, c.hk, c.d)[rows], v0.reshape(c.t, c.hk, c.d)[kept], 8.0, torch.float8_e5m2)
        others = torch.ones(c.blocks * c.block_size, dtype=torch.bool, device=DEV)
        others[rows] = False
        assert (key_cache.view(torch.uint8).view(-1, c.hk, c.d)[others] == 0x3C).all()
        with pytest.raises(ValueError, match="^key_cache"):
            rope_rs.rotary_embedding(
                c.positions, query, key, c.d, c.cache, True, value=value, key_cache=key_cache,
                value_cache=value_cache, slot_mapping=c.slots, kv_cache_dtype="fp8_e4m3", k_scale=k_scale,
                v_scale=v_scale,
            )

    def test_sglang_fused_set_kv_buffer(self):
        c = ServingCase(seed=5)
        want_q, want_k = c.reference("neox", norm=False)
        query, key, value = c.split()
        v0 = value.clone()
        pool = 300
        k_buffer = torch.full((pool, c.hk * c.d), -7.0, device=DEV, dtype=c.dtype)
        v_buffer = torch.full((pool, c.hk * c.d), -7.0, device=DEV, dtype=c.dtype)
        loc = torch.randperm(pool, device=DEV)[: c.t]
        loc[3] = -1
        arg = rope_rs.FusedSetKVBufferArg(value=value, k_buffer=k_buffer, v_buffer=v_buffer, k_scale=None, v_scale=None, cache_loc=loc)
        rope_rs.apply_rope_with_cos_sin_cache_inplace(c.positions, query, key, c.d, c.cache, True, arg)
        check(query.reshape(c.t, c.hq, c.d), want_q)
        check(key.reshape(c.t, c.hk, c.d), want_k)
        kept = loc >= 0
        assert torch.equal(k_buffer[loc[kept]], key[kept])
        assert torch.equal(v_buffer[loc[kept]], v0[kept])
        others = torch.ones(pool, dtype=torch.bool, device=DEV)
        others[loc[kept]] = False
        assert (k_buffer[others] == -7.0).all() and (v_buffer[others] == -7.0).all()
        with pytest.raises(ValueError, match="k_scale must be None"):
            rope_rs.apply_rope_with_cos_sin_cache_inplace(
                c.positions, query, key, c.d, c.cache, True, rope_rs.FusedSetKVBufferArg(value, k_buffer, v_buffer, 2.0, None, loc)
            )

    def test_errors_name_the_peers_arguments_and_touch_nothing(self):
        c = ServingCase(seed=6)
        key_cache, value_cache = c.paged(), c.paged()
        before = c.qkv.clone()
        # A cache too narrow for k's heads: rope-host's check, named as vLLM names it.
        narrow = torch.zeros(c.blocks, c.block_size, c.hk + 1, c.d, device=DEV, dtype=c.dtype)
        with pytest.raises(ValueError, match="^key_cache"):
            rope_rs.fused_qk_norm_rope(
                c.qkv, c.hq, c.hk, c.hk, c.d, 1e-6, c.q_weight, c.k_weight, c.cache, True, c.positions,
                key_cache=narrow, value_cache=narrow.clone(), slot_mapping=c.slots,
            )
        with pytest.raises(ValueError, match="^eps"):
            rope_rs.fused_qk_norm_rope(c.qkv, c.hq, c.hk, c.hk, c.d, -1.0, c.q_weight, c.k_weight, c.cache, True, c.positions)
        with pytest.raises(ValueError, match="^slot_mapping"):
            rope_rs.fused_qk_norm_rope(
                c.qkv, c.hq, c.hk, c.hk, c.d, 1e-6, c.q_weight, c.k_weight, c.cache, True, c.positions,
                key_cache=key_cache, value_cache=value_cache, slot_mapping=c.slots[:3],
            )
        # A table of neither float32 nor the tensors' type.
        half = vllm_cache(10000.0, c.d, 4096).to(torch.float16)
        with pytest.raises(ValueError, match="^cos_sin_cache"):
            rope_rs.fused_qk_norm_rope(c.qkv, c.hq, c.hk, c.hk, c.d, 1e-6, c.q_weight, c.k_weight, half, True, c.positions)
        torch.cuda.synchronize()
        assert torch.equal(c.qkv, before)
        assert (key_cache == -7.0).all() and (value_cache == -7.0).all()

    def test_custom_ops_pass_opcheck(self):
        c = ServingCase(t=5, blocks=2, seed=7)
        query, key, value = (x.clone() for x in c.split())
        torch.library.opcheck(
            rope_torch.fused_qk_norm_rope_op,
            (c.qkv.clone(), c.hq, c.hk, c.hk, c.d, 1e-6, c.q_weight, c.k_weight, c.cache, True, c.positions,
             c.paged(), c.paged(), c.slots, "auto", None, None, False, None, False),
        )
        torch.library.opcheck(
            rope_torch.rotary_embedding_op,
            (c.positions, query, key, c.d, c.cache, True, value, c.paged(), c.paged(), c.slots, "auto", None, None, False),
        )

    def test_compiled_serving_step_matches_eager(self):
        """A step as a serving stack compiles it (fullgraph): the projection's output normed,
        rotated and cached in place through the custom operators, then used."""
        c = ServingCase(seed=8)

        def step(qkv, key_cache, value_cache, positions, slots):
            qkv = qkv * 1.5
            rope_rs.fused_qk_norm_rope(
                qkv, c.hq, c.hk, c.hk, c.d, 1e-6, c.q_weight, c.k_weight, c.cache, True, positions,
                key_cache=key_cache, value_cache=value_cache, slot_mapping=slots,
            )
            query, key, value = qkv.split([c.hq * c.d, c.hk * c.d, c.hk * c.d], dim=-1)
            query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
            rope_rs.rotary_embedding(
                positions, query, key, c.d, c.cache, True, value=value, key_cache=key_cache,
                value_cache=value_cache, slot_mapping=slots.flip(0),
            )
            return query + 1, key_cache.float().sum()

        eager_caches = (c.paged(), c.paged())
        want = step(c.qkv, *eager_caches, c.positions, c.slots)
        compiled_caches = (c.paged(), c.paged())
        got = torch.compile(step, fullgraph=True)(c.qkv, *compiled_caches, c.positions, c.slots)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(compiled_caches[0], eager_caches[0]) and torch.equal(compiled_caches[1], eager_caches[1])

    def test_compiled_nvfp4_cache_write_equals_eager(self):
        """``kv_cache_dtype="nvfp4"`` through the custom operator under ``torch.compile(fullgraph=
        True)``: the same packed NVFP4 rows, bit for bit, as the eager call."""
        c = ServingCase(seed=12)
        row = c.d // 2 + c.d // 16
        scales = dict(k_scale=torch.tensor([0.05], device=DEV), v_scale=torch.tensor([0.02], device=DEV))

        def packed():
            shape = (c.blocks, c.block_size, c.hk, row)
            return torch.full(shape, 0x7E, device=DEV, dtype=torch.uint8)

        def step(qkv, key_cache, value_cache, positions, slots):
            qkv = qkv * 1.5
            rope_rs.fused_qk_norm_rope(
                qkv, c.hq, c.hk, c.hk, c.d, 1e-6, c.q_weight, c.k_weight, c.cache, True, positions,
                key_cache=key_cache, value_cache=value_cache, slot_mapping=slots, kv_cache_dtype="nvfp4",
                **scales,
            )
            return qkv + 1

        eager = (packed(), packed())
        want = step(c.qkv, *eager, c.positions, c.slots)
        compiled = (packed(), packed())
        got = torch.compile(step, fullgraph=True)(c.qkv, *compiled, c.positions, c.slots)
        assert torch.equal(got, want)
        assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
        assert (eager[0] != 0x7E).any(), "the step wrote the cache"

    def test_graph_replays_with_new_positions_and_slots(self):
        c = ServingCase(t=64, seed=9)
        qkv, key_cache, value_cache = c.qkv.clone(), c.paged(), c.paged()
        positions, slots = c.positions.clone(), c.slots.clone()

        def step():
            rope_rs.fused_qk_norm_rope(
                qkv, c.hq, c.hk, c.hk, c.d, 1e-6, c.q_weight, c.k_weight, c.cache, True, positions,
                key_cache=key_cache, value_cache=value_cache, slot_mapping=slots, pdl=True,
            )

        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for seed in (10, 11):
            new = ServingCase(t=64, seed=seed)
            new.q_weight, new.k_weight = c.q_weight, c.k_weight  # the weights the graph reads
            qkv.copy_(new.qkv), positions.copy_(new.positions), slots.copy_(new.slots)
            key_cache.fill_(-7.0), value_cache.fill_(-7.0)
            v0 = new.split()[2].clone()
            graph.replay()
            torch.cuda.synchronize()
            want_q, want_k = new.reference("neox", norm=True)
            q, k, _ = new.split(qkv)
            check(q.reshape(new.t, new.hq, new.d), want_q, extra_atol=2e-2)
            check(k.reshape(new.t, new.hk, new.d), want_k, extra_atol=2e-2)
            new.check_paged(key_cache, value_cache, k, v0)


FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def fp8_near(got, want, multiplier, dtype):
    """FP8 bytes `got` (of `dtype`, or uint8) decode to `want * multiplier` (f64, saturated at the
    format's largest value) within one step of the format, and nearly all to the nearest value
    exactly (FlashInfer's quantisation: the value times ``quant_scale``)."""
    decoded = got.view(dtype).to(torch.float64)
    big = FP8_MAX[dtype]
    target = (want.to(torch.float64) * multiplier).clamp(-big, big)
    step = 2.0**-3 if dtype == torch.float8_e4m3fn else 2.0**-2
    tiny = 2.0**-9 if dtype == torch.float8_e4m3fn else 2.0**-16
    torch.testing.assert_close(decoded, target, atol=tiny, rtol=step)
    exact = (decoded == target.to(dtype).to(torch.float64)).double().mean().item()
    assert exact > 0.98, f"only {exact:.4f} of the FP8 bytes are the nearest value"


def as_bytes(x):
    """An FP8 tensor's bytes."""
    return x.view(torch.uint8)


class FlashInferCase:
    """FlashInfer's ``rope_quantize_fp8*`` inputs: q_rope [t, hq, r] and k_rope [t, hk, r] (or
    [t, r] for MLA), v, a float32 cos_sin_cache, pos_ids, and a page table of a few requests
    over `pages` pages of `page_size` (a shuffled ``kv_indices``; some tokens padding, one token
    at a page past its request's own)."""

    def __init__(self, t=29, hq=8, hk=2, r=64, page_size=4, pages=24, dtype=torch.bfloat16, mla=False, seed=0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.t, self.hq, self.hk, self.r, self.dtype = t, hq, hk, r, dtype
        self.q = torch.randn(t, hq, r, device=DEV, generator=g).to(dtype)
        k_shape = (t, r) if mla else (t, hk, r)
        self.k = torch.randn(*k_shape, device=DEV, generator=g).to(dtype)
        self.v = torch.randn(t, hk, r, device=DEV, generator=g).to(dtype)
        self.cache = vllm_cache(10000.0, r, 4096)
        self.pos_ids = torch.randint(0, 4096, (t,), device=DEV, generator=g)
        self.page_size, self.pages = page_size, pages
        # Three requests of 8 pages each, their pages in random order.
        self.kv_indices = torch.randperm(pages, device=DEV, generator=g).int()
        self.kv_indptr = torch.tensor([0, 8, 16, 24], device=DEV, dtype=torch.int32)
        self.batch_indices = (torch.arange(t, device=DEV) % 3).int()
        self.positions = (torch.arange(t, device=DEV) // 3).int()
        self.batch_indices[::7] = -1
        # Past request 1's 8 pages: FlashInfer's kernel would write request 2's page.
        self.positions[4] = 8 * page_size + 1

    def rotated(self, x, style):
        """x [t, h, r] (or [t, r]) rotated at pos_ids in f64."""
        r = self.r
        cos, sin = table_cos_sin(self.pos_ids, self.cache[:, : r // 2], self.cache[:, r // 2 :])
        x3 = x if x.dim() == 3 else x[:, None]
        out = reference(x3[None], cos[None], sin[None], style)[0]
        return out if x.dim() == 3 else out[:, 0]

    def slots(self):
        """Each written token's (token, page, entry) by the page table."""
        out = []
        indptr, indices = self.kv_indptr.tolist(), self.kv_indices.tolist()
        for t, (b, p) in enumerate(zip(self.batch_indices.tolist(), self.positions.tolist())):
            if b < 0:
                continue
            at = indptr[b] + p // self.page_size
            if at < indptr[b + 1]:
                out.append((t, indices[at], p % self.page_size))
        return out


class TestFlashInferQuantize:
    """FlashInfer's ``rope_quantize_fp8``, ``mla_rope_quantize_fp8`` and
    ``rope_quantize_fp8_append_paged_kv_cache`` (rotated parts, GQA/MHA cache), against a
    reference written from FlashInfer's documented semantics: FP8 of the rotated value times
    ``quant_scale``, the cache entry ``positions[t] % page_size`` of page
    ``kv_indices[kv_indptr[b] + positions[t] // page_size]``; eagerly, compiled and from a
    graph."""

    @pytest.mark.parametrize("is_neox", [True, False])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
    @pytest.mark.parametrize("mla", [False, True])
    def test_rope_quantize_fp8(self, is_neox, dtype, fp8, mla):
        c = FlashInferCase(dtype=dtype, mla=mla, seed=int(is_neox) + 2 * int(mla))
        style = "neox" if is_neox else "interleaved"
        q0, k0 = c.q.clone(), c.k.clone()
        fn = rope_rs.mla_rope_quantize_fp8 if mla else rope_rs.rope_quantize_fp8
        q_out, k_out, q_nope_out, k_nope_out = fn(
            c.q, c.k, None, None, c.cache, c.pos_ids, is_neox, fp8, quant_scale_q=1.7, quant_scale_kv=0.37
        )
        assert q_out.dtype == fp8 and k_out.dtype == fp8 and q_out.shape == c.q.shape and k_out.shape == c.k.shape
        assert q_nope_out.shape == (c.t, c.hq, 0) and k_nope_out.shape == c.k.shape[:-1] + (0,)
        assert q_nope_out.dtype == fp8 and k_nope_out.dtype == fp8 and q_nope_out.device == c.q.device
        fp8_near(q_out, c.rotated(c.q, style), 1.7, fp8)
        fp8_near(k_out, c.rotated(c.k, style), 0.37, fp8)
        assert torch.equal(c.q, q0) and torch.equal(c.k, k0), "inputs are only read"

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
    @pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
    @pytest.mark.parametrize("mla", [False, True])
    def test_non_rotary_parts_are_fp8_of_the_scaled_input(self, dtype, fp8, mla):
        # MLA's q as DeepSeek holds it: [t, heads, 512 + 64], the non-rotary 512 then the rotary
        # 64, both parts views of it; k's latent part [t, 512] and its shared rotary head [t, 64].
        # GQA: parts of their own. The non-rotary bytes are PyTorch's own cast of x * scale
        # (the same f32 product, rounded to nearest even), byte for byte.
        c = FlashInferCase(dtype=dtype, mla=mla, seed=21 + int(mla))
        nope_dim = 512 if mla else 96
        if mla:
            q_full = randn(c.t, c.hq, nope_dim + c.r, dtype=dtype)
            q_nope, q_rope = q_full[..., :nope_dim], q_full[..., nope_dim:]
            k_nope = randn(c.t, nope_dim, dtype=dtype)
        else:
            q_nope, q_rope = randn(c.t, c.hq, nope_dim, dtype=dtype), c.q
            k_nope = randn(c.t, c.hk, nope_dim, dtype=dtype)
        inputs = [x.clone() for x in (q_nope, q_rope, k_nope, c.k)]
        fn = rope_rs.mla_rope_quantize_fp8 if mla else rope_rs.rope_quantize_fp8
        q_out, k_out, q_nope_out, k_nope_out = fn(
            q_rope, c.k, q_nope, k_nope, c.cache, c.pos_ids, True, fp8, quant_scale_q=1.7, quant_scale_kv=0.37
        )
        assert q_nope_out.shape == q_nope.shape and k_nope_out.shape == k_nope.shape and q_nope_out.dtype == fp8
        assert torch.equal(as_bytes(q_nope_out), as_bytes((q_nope.float() * 1.7).to(fp8)))
        assert torch.equal(as_bytes(k_nope_out), as_bytes((k_nope.float() * 0.37).to(fp8)))
        fp8_near(q_out, c.rotated(q_rope, "neox"), 1.7, fp8)
        fp8_near(k_out, c.rotated(c.k, "neox"), 0.37, fp8)
        for x, y in zip((q_nope, q_rope, k_nope, c.k), inputs):
            assert torch.equal(x, y), "inputs are only read"

    def test_non_rotary_parts_into_given_outputs_at_strides(self):
        # Outputs given as views of wider buffers (every other head of a [t, 2 h, d] buffer): the
        # bytes between them stay untouched.
        c = FlashInferCase(seed=23)
        q_nope, k_nope = randn(c.t, c.hq, 64, dtype=c.dtype), randn(c.t, c.hk, 64, dtype=c.dtype)
        e4m3 = torch.float8_e4m3fn
        q_buf = torch.full((c.t, 2 * c.hq, 64), 7, device=DEV, dtype=torch.uint8)
        k_buf = torch.full((c.t, 2 * c.hk, 64), 7, device=DEV, dtype=torch.uint8)
        q_nope_out, k_nope_out = q_buf[:, ::2].view(e4m3), k_buf[:, 1::2].view(e4m3)
        rope_rs.rope_quantize_fp8(
            c.q, c.k, q_nope, k_nope, c.cache, c.pos_ids, False, None, 2.0, 0.5,
            q_nope_out=q_nope_out, k_nope_out=k_nope_out,
        )
        assert torch.equal(q_buf[:, ::2], (q_nope.float() * 2.0).to(e4m3).view(torch.uint8))
        assert torch.equal(k_buf[:, 1::2], (k_nope.float() * 0.5).to(e4m3).view(torch.uint8))
        assert (q_buf[:, 1::2] == 7).all() and (k_buf[:, ::2] == 7).all(), "bytes between the heads untouched"

    def test_non_rotary_errors_name_the_argument(self):
        c = FlashInferCase(seed=24)
        q_out = torch.zeros(c.t, c.hq, c.r, device=DEV, dtype=torch.float8_e4m3fn)
        call = lambda **kw: rope_rs.rope_quantize_fp8(  # noqa: E731
            c.q, c.k, kw.pop("q_nope", None), kw.pop("k_nope", None), c.cache, c.pos_ids, True, None, 1.0, 1.0,
            q_rope_out=q_out, **kw,
        )
        with pytest.raises(ValueError, match="^q_nope: .*multiple of 8"):
            call(q_nope=randn(c.t, c.hq, 12, dtype=c.dtype))
        with pytest.raises(ValueError, match="^q_nope: .*heads"):
            call(q_nope=randn(c.t, c.hq + 1, 64, dtype=c.dtype))
        with pytest.raises(ValueError, match="^k_nope: .*features per head"):
            call(q_nope=randn(c.t, c.hq, 64, dtype=c.dtype), k_nope=randn(c.t, c.hk, 32, dtype=c.dtype))
        with pytest.raises(ValueError, match="^q_nope must be"):
            call(q_nope=randn(c.t, c.hq, 64, dtype=torch.float16))
        with pytest.raises(ValueError, match="^q_nope_out must be"):
            call(q_nope=randn(c.t, c.hq, 64, dtype=c.dtype), q_nope_out=torch.empty(c.t, c.hq, 64, device=DEV))
        assert (q_out.view(torch.uint8) == 0).all(), "a refused call writes nothing"

    def test_non_rotary_compiled_and_graph_replay_match_eager(self):
        c = FlashInferCase(t=32, mla=True, seed=25)
        q_nope, k_nope = randn(c.t, c.hq, 512, dtype=c.dtype), randn(c.t, 512, dtype=c.dtype)

        def step(q, k, qn, kn, pos_ids):
            outs = rope_rs.mla_rope_quantize_fp8(q, k, qn * 2, kn, c.cache, pos_ids, True, torch.float8_e5m2)
            return [o.view(torch.uint8).clone() for o in outs]

        want = step(c.q, c.k, q_nope, k_nope, c.pos_ids)
        got = torch.compile(step, fullgraph=True)(c.q, c.k, q_nope, k_nope, c.pos_ids)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        static = [x.clone() for x in (c.q, c.k, q_nope, k_nope, c.pos_ids)]
        step(*static)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(*static)
        new = [randn(*x.shape, dtype=x.dtype) for x in static[:4]] + [torch.randint(0, 4096, (c.t,), device=DEV)]
        for x, y in zip(static, new):
            x.copy_(y)
        graph.replay()
        want = step(*new)
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, want))

    def test_empty_nope_outputs_kept_across_calls_stay_right(self):
        # The zero-feature outputs an eager call hands out again: the same shape, dtype and
        # device each call, replaced once a caller resized one or marked it for autograd.
        c = FlashInferCase(seed=7)
        args = (c.q, c.k, None, None, c.cache, c.pos_ids, True, torch.float8_e4m3fn)
        first = rope_rs.rope_quantize_fp8(*args)[2]
        first.resize_(3, 5)
        second = rope_rs.rope_quantize_fp8(*args)[2]
        assert second.shape == (c.t, c.hq, 0) and second.numel() == 0
        second.requires_grad_(True)
        third = rope_rs.rope_quantize_fp8(*args)[2]
        assert third.shape == (c.t, c.hq, 0) and not third.requires_grad
        e5m2 = rope_rs.rope_quantize_fp8(c.q, c.k, None, None, c.cache, c.pos_ids, True, torch.float8_e5m2)[2]
        assert e5m2.dtype == torch.float8_e5m2 and e5m2.shape == (c.t, c.hq, 0)
        fewer = rope_rs.rope_quantize_fp8(c.q[:3], c.k[:3], None, None, c.cache, c.pos_ids[:3], True)[2]
        assert fewer.shape == (3, c.hq, 0)

    def test_rope_quantize_fp8_into_given_outputs(self):
        c = FlashInferCase(seed=5)
        q_out = torch.full(c.q.shape, 0x11, device=DEV, dtype=torch.uint8).view(torch.float8_e5m2)
        k_out = torch.empty_like(c.k, dtype=torch.float8_e5m2)
        got = rope_rs.rope_quantize_fp8(c.q, c.k, None, None, c.cache, c.pos_ids, q_rope_out=q_out, k_rope_out=k_out)
        assert got[0] is q_out and got[1] is k_out
        fp8_near(q_out, c.rotated(c.q, "neox"), 1.0, torch.float8_e5m2)

    @pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
    @pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
    @pytest.mark.parametrize("is_neox", [True, False])
    def test_append_paged_kv_cache(self, kv_layout, fp8, is_neox):
        c = FlashInferCase(seed=7 + int(is_neox))
        style = "neox" if is_neox else "interleaved"
        shape = (c.pages, c.page_size, c.hk, c.r) if kv_layout == "NHD" else (c.pages, c.hk, c.page_size, c.r)
        k_cache = torch.full(shape, 0x3C, device=DEV, dtype=torch.uint8).view(fp8)
        v_cache = torch.full(shape, 0x3C, device=DEV, dtype=torch.uint8).view(fp8)
        q_out, q_nope_out = rope_rs.rope_quantize_fp8_append_paged_kv_cache(
            c.q, c.k, None, None, c.v, c.cache, c.pos_ids, (k_cache, v_cache), c.kv_indices, c.kv_indptr,
            c.batch_indices, c.positions, is_neox, quantize_dtype=fp8, quant_scale_q=0.8, quant_scale_kv=2.5,
            page_size=c.page_size, kv_layout=kv_layout,
        )
        assert q_out.dtype == fp8 and q_nope_out.shape == (c.t, c.hq, 0)
        fp8_near(q_out, c.rotated(c.q, style), 0.8, fp8)
        k_want = c.rotated(c.k, style)
        heads_first = kv_layout == "HND"
        entry = lambda cache, page, e: cache[page, :, e] if heads_first else cache[page, e]  # noqa: E731
        written = torch.zeros(c.pages, c.page_size, dtype=torch.bool)
        slots = c.slots()
        assert 4 not in [t for t, _, _ in slots], "the token past its request's pages writes nothing"
        for t, page, e in slots:
            fp8_near(entry(k_cache, page, e), k_want[t], 2.5, fp8)
            fp8_near(entry(v_cache, page, e), c.v[t], 2.5, fp8)
            written[page, e] = True
        for cache in (k_cache, v_cache):
            bytes_ = cache.view(torch.uint8)
            rows = bytes_ if not heads_first else bytes_.transpose(1, 2)
            assert (rows[~written.to(DEV)] == 0x3C).all(), "entries outside the table's are untouched"

    def test_int64_page_table_and_errors(self):
        c = FlashInferCase(seed=11)
        shape = (c.pages, c.page_size, c.hk, c.r)
        k_cache = torch.zeros(shape, device=DEV, dtype=torch.float8_e4m3fn)
        v_cache = torch.zeros(shape, device=DEV, dtype=torch.float8_e4m3fn)
        args = lambda **kw: dict(  # noqa: E731
            dict(
                q_rope=c.q, k_rope=c.k, q_nope=None, k_nope=None, v=c.v, cos_sin_cache=c.cache, pos_ids=c.pos_ids,
                paged_kv_cache=(k_cache, v_cache), kv_indices=c.kv_indices.long(), kv_indptr=c.kv_indptr.long(),
                batch_indices=c.batch_indices.long(), positions=c.positions.long(), page_size=c.page_size,
            ),
            **kw,
        )
        rope_rs.rope_quantize_fp8_append_paged_kv_cache(**args())
        k_int64 = k_cache.clone()
        k_cache.zero_()
        rope_rs.rope_quantize_fp8_append_paged_kv_cache(**args(kv_indices=c.kv_indices, kv_indptr=c.kv_indptr))
        assert torch.equal(k_cache.view(torch.uint8), k_int64.view(torch.uint8))
        k_cache.zero_()
        with pytest.raises(ValueError, match="^q_nope"):
            rope_rs.rope_quantize_fp8_append_paged_kv_cache(**args(q_nope=torch.zeros(c.t, c.hq, 12, device=DEV, dtype=c.dtype)))
        with pytest.raises(ValueError, match="^page_size"):
            rope_rs.rope_quantize_fp8_append_paged_kv_cache(**args(page_size=16))
        with pytest.raises(ValueError, match="^paged_kv_cache"):
            rope_rs.rope_quantize_fp8_append_paged_kv_cache(**args(quantize_dtype=torch.float8_e5m2))
        with pytest.raises(ValueError, match="^batch_indices"):
            rope_rs.rope_quantize_fp8_append_paged_kv_cache(**args(batch_indices=c.batch_indices[:3]))
        with pytest.raises(ValueError, match="^quant_scale_kv"):
            rope_rs.rope_quantize_fp8_append_paged_kv_cache(**args(quant_scale_kv=float("inf")))
        with pytest.raises(ValueError, match="^k_rope"):
            rope_rs.rope_quantize_fp8(c.q, c.k[:, :, :32], None, None, c.cache, c.pos_ids)
        torch.cuda.synchronize()
        assert (k_cache.view(torch.uint8) == 0).all(), "a refused call writes nothing"

    def test_custom_ops_pass_opcheck(self):
        # FP8 outputs as uint8 (the operators take either): opcheck's own checks do arithmetic
        # that PyTorch has no FP8 kernels for.
        c = FlashInferCase(t=6, seed=12)
        u8 = torch.uint8
        torch.library.opcheck(
            rope_torch.rope_quantize_fp8_op,
            (c.q, c.k, c.cache, c.pos_ids, True, "float8_e4m3fn", 1.0, 0.5,
             torch.empty_like(c.q, dtype=u8), torch.empty_like(c.k, dtype=u8), False, None, None, None, None),
        )
        q_nope, k_nope = randn(c.t, c.hq, 32, dtype=c.dtype), randn(c.t, c.hk, 32, dtype=c.dtype)
        torch.library.opcheck(
            rope_torch.rope_quantize_fp8_op,
            (c.q, c.k, c.cache, c.pos_ids, True, "float8_e4m3fn", 1.0, 0.5,
             torch.empty_like(c.q, dtype=u8), torch.empty_like(c.k, dtype=u8), False,
             q_nope, torch.empty_like(q_nope, dtype=u8), k_nope, torch.empty_like(k_nope, dtype=u8)),
        )
        shape = (c.pages, c.page_size, c.hk, c.r)
        torch.library.opcheck(
            rope_torch.rope_quantize_fp8_append_paged_kv_cache_op,
            (c.q, c.k, c.v, c.cache, c.pos_ids, torch.zeros(shape, device=DEV, dtype=u8),
             torch.zeros(shape, device=DEV, dtype=u8), c.kv_indices, c.kv_indptr, c.batch_indices, c.positions,
             True, "float8_e4m3fn", 1.0, 0.5, c.page_size, "NHD", torch.empty_like(c.q, dtype=u8), False,
             None, None, None),
        )

    def test_compiled_and_graph_replays_match_eager(self):
        c = FlashInferCase(t=32, seed=13)
        shape = (c.pages, c.page_size, c.hk, c.r)
        e4m3 = torch.float8_e4m3fn

        def step(q, k, v, pos_ids, batch_indices, positions, k_cache, v_cache):
            q_out, _ = rope_rs.rope_quantize_fp8_append_paged_kv_cache(
                q * 2, k, None, None, v, c.cache, pos_ids, (k_cache, v_cache), c.kv_indices, c.kv_indptr,
                batch_indices, positions, quant_scale_kv=0.5, page_size=c.page_size, enable_pdl=True,
            )
            return q_out.float().sum(-1)

        caches = lambda: (torch.zeros(shape, device=DEV, dtype=e4m3), torch.zeros(shape, device=DEV, dtype=e4m3))  # noqa: E731
        inputs = (c.q, c.k, c.v, c.pos_ids, c.batch_indices, c.positions)
        eager_caches = caches()
        want = step(*inputs, *eager_caches)
        compiled_caches = caches()
        got = torch.compile(step, fullgraph=True)(*inputs, *compiled_caches)
        assert torch.equal(got, want)
        for a, b in zip(compiled_caches, eager_caches):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        # A graph replayed with new inputs, positions and batch indices.
        static = [x.clone() for x in inputs]
        graph_caches = caches()
        step(*static, *graph_caches)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(*static, *graph_caches)
        new = FlashInferCase(t=32, seed=14)
        new.batch_indices = new.batch_indices.flip(0).contiguous()
        for x, y in zip(static, (new.q, new.k, new.v, new.pos_ids, new.batch_indices, new.positions)):
            x.copy_(y)
        for cache in graph_caches:
            cache.zero_()
        graph.replay()
        fresh = caches()
        want = step(new.q, new.k, new.v, new.pos_ids, new.batch_indices, new.positions, *fresh)
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        for a, b in zip(graph_caches, fresh):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class TestFlashInferAppendNonRotary:
    """FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache`` with non-rotary parts, against
    its documented semantics: GQA/MHA caches of ``rope_dim + no_rope_dim`` per head (the rotated
    k first, ``k_nope`` after it, ``v`` whole), and MLA's ``(ckv_cache, kpe_cache)`` (``k_nope``
    into ckv, the rotated 2-D ``k_rope`` into kpe); ``q_nope`` into ``q_nope_out``. The parts are
    FP8 of ``x * quant_scale`` byte for byte as PyTorch casts them; entries the table does not
    give are untouched."""

    @staticmethod
    def entry(cache, page, e, heads_first):
        return cache[page, :, e] if heads_first else cache[page, e]

    @staticmethod
    def untouched(cache, written, heads_first=False):
        rows = cache.view(torch.uint8)
        rows = rows.transpose(1, 2) if heads_first else rows
        assert (rows[~written.to(DEV)] == 0x3C).all(), "entries outside the table's are untouched"

    @pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
    @pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
    @pytest.mark.parametrize("is_neox", [True, False])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_gqa_caches_hold_the_rotated_k_then_k_nope(self, kv_layout, fp8, is_neox, dtype):
        c = FlashInferCase(seed=21 + int(is_neox), dtype=dtype)
        nope, sq, skv = 64, 0.8, 2.5
        style = "neox" if is_neox else "interleaved"
        heads_first = kv_layout == "HND"
        width = c.r + nope
        shape = (c.pages, c.page_size, c.hk, width) if not heads_first else (c.pages, c.hk, c.page_size, width)
        k_cache = torch.full(shape, 0x3C, device=DEV, dtype=torch.uint8).view(fp8)
        v_cache = torch.full(shape, 0x3C, device=DEV, dtype=torch.uint8).view(fp8)
        q_nope, k_nope = randn(c.t, c.hq, nope, dtype=dtype), randn(c.t, c.hk, nope, dtype=dtype)
        v = randn(c.t, c.hk, width, dtype=dtype)
        inputs = [x.clone() for x in (c.q, c.k, q_nope, k_nope, v)]
        q_out, q_nope_out = rope_rs.rope_quantize_fp8_append_paged_kv_cache(
            c.q, c.k, q_nope, k_nope, v, c.cache, c.pos_ids, (k_cache, v_cache), c.kv_indices, c.kv_indptr,
            c.batch_indices, c.positions, is_neox, quantize_dtype=fp8, quant_scale_q=sq, quant_scale_kv=skv,
            page_size=c.page_size, kv_layout=kv_layout,
        )
        torch.cuda.synchronize()
        fp8_near(q_out, c.rotated(c.q, style), sq, fp8)
        assert q_nope_out.shape == q_nope.shape and q_nope_out.dtype == fp8
        assert torch.equal(as_bytes(q_nope_out), as_bytes((q_nope.float() * sq).to(fp8)))
        k_want = c.rotated(c.k, style)
        written = torch.zeros(c.pages, c.page_size, dtype=torch.bool)
        for t, page, e in c.slots():
            k_entry, v_entry = self.entry(k_cache, page, e, heads_first), self.entry(v_cache, page, e, heads_first)
            fp8_near(k_entry[:, : c.r], k_want[t], skv, fp8)
            assert torch.equal(as_bytes(k_entry[:, c.r :]), as_bytes((k_nope[t].float() * skv).to(fp8)))
            fp8_near(v_entry[:, : c.r], v[t, :, : c.r], skv, fp8)
            assert torch.equal(as_bytes(v_entry[:, c.r :]), as_bytes((v[t, :, c.r :].float() * skv).to(fp8)))
            written[page, e] = True
        for cache in (k_cache, v_cache):
            self.untouched(cache, written, heads_first)
        for x, y in zip((c.q, c.k, q_nope, k_nope, v), inputs):
            assert torch.equal(x, y), "inputs are only read"

    @pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
    @pytest.mark.parametrize("is_neox", [True, False])
    def test_mla_latent_and_rotated_k_go_to_ckv_and_kpe(self, fp8, is_neox):
        c = FlashInferCase(hq=16, mla=True, seed=25 + int(is_neox))
        nope, sq, skv = 512, 1.3, 0.6
        style = "neox" if is_neox else "interleaved"
        # DeepSeek's q: views of one [t, heads, 512 + 64] tensor.
        q_full = randn(c.t, c.hq, nope + c.r, dtype=c.dtype)
        q_nope, q_rope = q_full[..., :nope], q_full[..., nope:]
        k_nope = randn(c.t, nope, dtype=c.dtype)
        ckv = torch.full((c.pages, c.page_size, nope), 0x3C, device=DEV, dtype=torch.uint8).view(fp8)
        kpe = torch.full((c.pages, c.page_size, c.r), 0x3C, device=DEV, dtype=torch.uint8).view(fp8)
        q_out, q_nope_out = rope_rs.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, c.k, q_nope, k_nope, None, c.cache, c.pos_ids, (ckv, kpe), c.kv_indices, c.kv_indptr,
            c.batch_indices, c.positions, is_neox, quantize_dtype=fp8, quant_scale_q=sq, quant_scale_kv=skv,
            page_size=c.page_size,
        )
        torch.cuda.synchronize()
        fp8_near(q_out, c.rotated(q_rope, style), sq, fp8)
        assert torch.equal(as_bytes(q_nope_out), as_bytes((q_nope.float() * sq).to(fp8)))
        k_want = c.rotated(c.k, style)
        written = torch.zeros(c.pages, c.page_size, dtype=torch.bool)
        for t, page, e in c.slots():
            fp8_near(kpe[page, e], k_want[t], skv, fp8)
            assert torch.equal(as_bytes(ckv[page, e]), as_bytes((k_nope[t].float() * skv).to(fp8)))
            written[page, e] = True
        for cache in (ckv, kpe):
            self.untouched(cache, written)

    def test_errors_name_the_argument_and_write_nothing(self):
        c = FlashInferCase(seed=27)
        e4m3 = torch.float8_e4m3fn
        k_nope, v = randn(c.t, c.hk, 64, dtype=c.dtype), randn(c.t, c.hk, c.r + 64, dtype=c.dtype)
        shape = (c.pages, c.page_size, c.hk, c.r + 64)
        caches = (torch.zeros(shape, device=DEV, dtype=e4m3), torch.zeros(shape, device=DEV, dtype=e4m3))

        def call(**kw):
            args = dict(
                q_rope=c.q, k_rope=c.k, q_nope=None, k_nope=k_nope, v=v, cos_sin_cache=c.cache, pos_ids=c.pos_ids,
                paged_kv_cache=caches, kv_indices=c.kv_indices, kv_indptr=c.kv_indptr,
                batch_indices=c.batch_indices, positions=c.positions, page_size=c.page_size,
            )
            args.update(kw)
            return rope_rs.rope_quantize_fp8_append_paged_kv_cache(**args)

        call()
        for cache in caches:
            cache.zero_()
        narrow = [torch.zeros(c.pages, c.page_size, c.hk, c.r, device=DEV, dtype=e4m3) for _ in range(2)]
        with pytest.raises(ValueError, match=r"^paged_kv_cache\[0\]: head_dim 64 differs .* 128"):
            call(paged_kv_cache=tuple(narrow))
        with pytest.raises(ValueError, match="^v"):
            call(v=c.v)
        with pytest.raises(ValueError, match="^k_nope"):
            call(k_nope=randn(c.t, c.hk, 64, dtype=torch.float16))
        # k_nope's features set the caches' and v's width (rotated + non-rotary): other widths
        # are refused on the first of them checked.
        with pytest.raises(ValueError, match="^v: head_dim 128 differs .* 96"):
            call(k_nope=randn(c.t, c.hk, 32, dtype=c.dtype))
        # MLA: a v, no latent part, a ckv cache of other pages.
        m = FlashInferCase(mla=True, seed=28)
        ckv = torch.zeros(m.pages, m.page_size, 512, device=DEV, dtype=e4m3)
        kpe = torch.zeros(m.pages, m.page_size, m.r, device=DEV, dtype=e4m3)
        latent = randn(m.t, 512, dtype=m.dtype)
        mla = dict(q_rope=m.q, k_rope=m.k, k_nope=latent, v=None, paged_kv_cache=(ckv, kpe))
        call(**mla)
        ckv.zero_(), kpe.zero_()
        with pytest.raises(ValueError, match="^v"):
            call(**dict(mla, v=m.v))
        with pytest.raises(ValueError, match="^k_nope"):
            call(**dict(mla, k_nope=None))
        with pytest.raises(ValueError, match=r"^paged_kv_cache\[0\]"):
            call(**dict(mla, paged_kv_cache=(ckv[:-1], kpe)))
        torch.cuda.synchronize()
        for cache in (*caches, *narrow, ckv, kpe):
            assert (cache.view(torch.uint8) == 0).all(), "a refused call writes nothing"

    def test_mla_compiled_graph_and_opcheck_match_eager(self):
        c = FlashInferCase(t=32, hq=16, mla=True, seed=29)
        e4m3 = torch.float8_e4m3fn
        q_nope, k_nope = randn(c.t, c.hq, 512, dtype=c.dtype), randn(c.t, 512, dtype=c.dtype)

        def step(q, k, q_nope, k_nope, pos_ids, ckv, kpe):
            q_out, q_nope_out = rope_rs.rope_quantize_fp8_append_paged_kv_cache(
                q * 2, k, q_nope, k_nope, None, c.cache, pos_ids, (ckv, kpe), c.kv_indices, c.kv_indptr,
                c.batch_indices, c.positions, quant_scale_kv=0.5, page_size=c.page_size, enable_pdl=True,
            )
            return q_out.float().sum(-1) + q_nope_out.float().sum(-1)

        caches = lambda: (  # noqa: E731
            torch.zeros(c.pages, c.page_size, 512, device=DEV, dtype=e4m3),
            torch.zeros(c.pages, c.page_size, c.r, device=DEV, dtype=e4m3),
        )
        inputs = (c.q, c.k, q_nope, k_nope, c.pos_ids)
        eager = caches()
        want = step(*inputs, *eager)
        compiled = caches()
        got = torch.compile(step, fullgraph=True)(*inputs, *compiled)
        assert torch.equal(got, want)
        for a, b in zip(compiled, eager):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        static, graphed = [x.clone() for x in inputs], caches()
        step(*static, *graphed)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(*static, *graphed)
        new = FlashInferCase(t=32, hq=16, mla=True, seed=30)
        fresh_inputs = (new.q, new.k, randn(c.t, c.hq, 512, dtype=c.dtype), randn(c.t, 512, dtype=c.dtype), new.pos_ids)
        for x, y in zip(static, fresh_inputs):
            x.copy_(y)
        for cache in graphed:
            cache.zero_()
        graph.replay()
        fresh = caches()
        want = step(*fresh_inputs, *fresh)
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        for a, b in zip(graphed, fresh):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        u8 = torch.uint8
        ckv, kpe = (x.view(u8) for x in caches())
        torch.library.opcheck(
            rope_torch.rope_quantize_fp8_append_paged_kv_cache_op,
            (c.q, c.k, None, c.cache, c.pos_ids, kpe, ckv, c.kv_indices, c.kv_indptr, c.batch_indices, c.positions,
             True, "float8_e4m3fn", 1.0, 0.5, c.page_size, "NHD", torch.empty_like(c.q, dtype=u8), False,
             q_nope, torch.empty_like(q_nope, dtype=u8), k_nope),
        )


class TestAutograd:
    @pytest.mark.parametrize("style", STYLES)
    @pytest.mark.parametrize("path", ["apply_rope", "custom_op"])
    def test_gradients_match_the_f64_reference(self, path, style):
        b, s, hq, hk, d, r, theta = 2, 9, 4, 2, 64, 48, 10000.0
        ids = torch.randint(0, 5000, (b, s), device=DEV)
        q, k = randn(b, s, hq, d).requires_grad_(), randn(b, s, hk, d).requires_grad_()
        if path == "apply_rope":
            q_out, k_out = rope_rs.apply_rope(q, k, position_ids=ids, style=style, theta=theta, rotary_dim=r)
        else:
            o = rope_torch.options(q, position_ids=ids, style=style, theta=theta, rotary_dim=r)
            q_out, k_out = torch.ops.rope_rs.rope_qk(q, k, *o)
        up_q, up_k = randn(b, s, hq, d), randn(b, s, hk, d)
        ((q_out * up_q).sum() + (k_out * up_k).sum()).backward()

        q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
        cos, sin = cos_sin(ids, inv_freq64(theta, r))
        ref_q, ref_k = reference(q64, cos, sin, style, r), reference(k64, cos, sin, style, r)
        ((ref_q * up_q.double()).sum() + (ref_k * up_k.double()).sum()).backward()
        check(q_out.detach(), ref_q.detach())
        check(q.grad, q64.grad)
        check(k.grad, k64.grad)

    def test_gradient_of_a_reduction(self):
        """Gradients arriving expanded (stride 0, from a sum) are read correctly."""
        q = randn(2, 5, 3, 32).requires_grad_()
        rope_rs.apply_rope(q, positions=7).sum().backward()
        cos, sin = cos_sin(torch.arange(5, device=DEV).expand(2, 5) + 7, inv_freq64(10000.0, 32))
        check(q.grad, reference(torch.ones_like(q), cos, sin, "neox", backward=True))

    @pytest.mark.parametrize("style", STYLES)
    def test_gradcheck(self, style):
        """torch.autograd.gradcheck and gradgradcheck in f32: RoPE is linear, so finite
        differences are exact but for f32 rounding, which the tolerances cover."""
        q = randn(1, 3, 2, 8).requires_grad_()
        k = randn(1, 3, 1, 8).requires_grad_()

        def f(q, k):
            return rope_rs.apply_rope(q, k, positions=5, style=style, theta=100.0)

        kwargs = {"eps": 1e-2, "atol": 1e-4, "rtol": 1e-3}
        with pytest.warns(UserWarning):  # "not a double precision floating point"
            assert torch.autograd.gradcheck(f, (q, k), **kwargs)
        with pytest.warns(UserWarning):
            assert torch.autograd.gradgradcheck(f, (q, k), **kwargs)

    def test_custom_ops_pass_opcheck(self):
        q, k = randn(2, 4, 3, 32), randn(2, 4, 1, 32)
        ids = torch.randint(0, 100, (2, 4), device=DEV)
        o = tuple(rope_torch.options(q, position_ids=ids, style="interleaved"))
        torch.library.opcheck(rope_torch.rope_op, (q.clone().requires_grad_(),) + o)
        torch.library.opcheck(rope_torch.rope_qk_op, (q.clone().requires_grad_(), k.clone().requires_grad_()) + o)
        torch.library.opcheck(rope_torch.rope_inplace_op, (q.clone(),) + o)
        torch.library.opcheck(rope_torch.rope_qk_inplace_op, (q.clone(), k.clone()) + o)

    def test_in_place_refuses_autograd(self):
        q = randn(2, 4, 3, 32).requires_grad_()
        with pytest.raises(ValueError, match="inplace: in-place rotation is not recorded for autograd"):
            rope_rs.apply_rope(q, inplace=True)


class TestGraphs:
    def test_capture_and_replay_with_new_positions(self):
        b, hq, hk, d, theta, max_position = 8, 4, 2, 64, 10000.0, 4096
        q, k = randn(b, 1, hq, d, dtype=torch.bfloat16), randn(b, 1, hk, d, dtype=torch.bfloat16)
        q2 = randn(b, 1, hq, d, dtype=torch.bfloat16)
        ids = torch.zeros(b, 1, device=DEV, dtype=torch.int64)
        starts = torch.zeros(b, device=DEV, dtype=torch.int32)
        cache = vllm_cache(theta, d, max_position)
        llama3 = dict(FAMILIES["llama3"][1])

        def step():
            rope_rs.apply_rope(q, k, position_ids=ids, theta=theta, inplace=True)
            out = rope_rs.apply_rope(q2, positions=starts, cos_sin_cache=cache)
            scaled = rope_rs.apply_rope(q2, positions=starts, theta=500000.0, scaling=llama3)
            return out, scaled

        # Warm-up on a side stream, as torch.cuda.graph asks: uploads the frequencies once.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, scaled = step()
        f, attention = rope_rs.frequencies(d, theta=500000.0, scaling=llama3)
        for _ in range(3):
            new_q, new_k, new_q2 = randn(*q.shape, dtype=q.dtype), randn(*k.shape, dtype=k.dtype), randn(*q2.shape, dtype=q2.dtype)
            q.copy_(new_q), k.copy_(new_k), q2.copy_(new_q2)
            ids.copy_(torch.randint(0, 1 << 20, (b, 1), device=DEV))
            starts.copy_(torch.randint(0, max_position, (b,), device=DEV))
            graph.replay()
            torch.cuda.synchronize()
            cos, sin = cos_sin(ids, inv_freq64(theta, d))
            check(q, reference(new_q, cos, sin, "neox"))
            check(k, reference(new_k, cos, sin, "neox"))
            check(out, reference(new_q2, *table_cos_sin(starts[:, None], cache[:, : d // 2], cache[:, d // 2 :]), "neox"))
            check(scaled, reference(new_q2, *cos_sin(starts[:, None], torch.tensor(f), attention), "neox"))

    @pytest.mark.parametrize("graph", [False, True])
    def test_programmatic_launch_equals_serialized(self, graph):
        """``pdl=True`` (programmatic dependent launch on sm_90+) gives, bit for bit, what the
        same chain of dependent in-place decode launches gives without it, eagerly and replayed
        from a CUDA graph; through ``apply_rope`` (computed sin/cos, device row offsets) and
        vLLM's ``rotary_embedding`` (a cos_sin_cache). A launch that read before the one
        ahead of it had finished would read stale data and differ."""
        b, hq, hk, d, theta, steps = 64, 32, 8, 128, 10000.0, 20
        cache = vllm_cache(theta, d, 4096, dtype=torch.bfloat16)
        starts = torch.randint(0, 4000, (b,), device=DEV, dtype=torch.int64)
        q0, k0 = randn(b, 1, hq, d, dtype=torch.bfloat16), randn(b, 1, hk, d, dtype=torch.bfloat16)

        def chain(pdl):
            q, k = q0.clone(), k0.clone()
            q2, k2 = q.view(b, hq * d), k.view(b, hk * d)

            def run():
                for _ in range(steps):
                    rope_rs.apply_rope(q, k, positions=starts, theta=theta, inplace=True, pdl=pdl)
                    rope_rs.rotary_embedding(starts, q2, k2, d, cache, True, pdl=pdl)

            run()  # warm-up: uploads the frequencies outside any capture
            q.copy_(q0), k.copy_(k0)
            if graph:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    run()
                q.copy_(q0), k.copy_(k0)
                g.replay()
            else:
                run()
            torch.cuda.synchronize()
            return q.clone(), k.clone()

        want, got = chain(False), chain(True)
        assert not torch.equal(want[0], q0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    def test_first_use_inside_a_capture_is_an_error(self):
        """Frequencies not yet on the device cannot be uploaded inside a capture: a ValueError
        before anything is recorded, not a broken capture."""
        q = randn(2, 1, 4, 64)
        for kwargs in ({"theta": 12345.5}, {"scaling": {"rope_type": "linear", "factor": 3.25}}):
            graph = torch.cuda.CUDAGraph()
            with pytest.raises(ValueError, match="warm-up"):
                with torch.cuda.graph(graph):
                    rope_rs.apply_rope(q, inplace=True, **kwargs)
        rope_rs.apply_rope(q, inplace=True, theta=12345.5)  # outside a capture, fine
        torch.cuda.synchronize()


class TestCompile:
    class Attention(torch.nn.Module):
        """One attention block with RoPE on q and k: rope_rs's, or the f64-free torch formula."""

        def __init__(self, hidden, heads, kv_heads, use_rope_rs):
            super().__init__()
            self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
            self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
            self.out = torch.nn.Linear(hidden, hidden, bias=False)
            self.use_rope_rs = use_rope_rs

        def forward(self, x, position_ids):
            b, s, _ = x.shape
            d = self.head_dim
            q, k, v = self.qkv(x).view(b, s, -1, d).split([self.heads, self.kv_heads, self.kv_heads], dim=2)
            if self.use_rope_rs:
                q, k = rope_rs.apply_rope(q, k, position_ids=position_ids, theta=10000.0)
            else:
                inv_freq = 10000.0 ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
                angle = position_ids[..., None].float() * inv_freq
                cos, sin = angle.cos()[:, :, None], angle.sin()[:, :, None]

                def rotate(t):
                    a, b_ = t[..., : d // 2], t[..., d // 2 :]
                    return torch.cat((a * cos - b_ * sin, b_ * cos + a * sin), -1)

                q, k = rotate(q), rotate(k)
            att = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
            return self.out(att.transpose(1, 2).reshape(b, s, -1))

    def test_compiled_model_step(self):
        torch.manual_seed(0)
        hidden, heads, kv_heads = 256, 4, 2
        ours = self.Attention(hidden, heads, kv_heads, use_rope_rs=True).to(DEV)
        theirs = self.Attention(hidden, heads, kv_heads, use_rope_rs=False).to(DEV)
        theirs.load_state_dict(ours.state_dict())
        compiled = torch.compile(ours, fullgraph=True)
        x = randn(2, 32, hidden)
        position_ids = torch.arange(32, device=DEV).expand(2, 32) + 100
        for module in (compiled, theirs):
            module.zero_grad()
            module(x, position_ids).square().mean().backward()
        want = theirs(x, position_ids)
        torch.testing.assert_close(compiled(x, position_ids), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.qkv.weight.grad, theirs.qkv.weight.grad, atol=1e-5, rtol=1e-3)

    def test_compiled_in_place(self):
        def step(q, k, ids):
            q = q * 2
            rope_rs.apply_rope(q, k, position_ids=ids, style="interleaved", inplace=True)
            return q + 1, k

        q, k = randn(2, 6, 4, 32), randn(2, 6, 2, 32)
        ids = torch.randint(0, 100, (2, 6), device=DEV)
        got_q, got_k = torch.compile(step, fullgraph=True)(q.clone(), k.clone(), ids)
        cos, sin = cos_sin(ids, inv_freq64(10000.0, 32))
        check(got_q, reference(q * 2, cos, sin, "interleaved") + 1)
        check(got_k, reference(k, cos, sin, "interleaved"))

    def test_host_frequencies_compile_into_the_graph_and_scaling_matches_eager(self):
        """A host ``inv_freq`` list reaches the custom operators as floats (no graph break:
        ``fullgraph=True`` compiles); a ``scaling`` dict, carried as JSON text, rotates as the
        eager call does, and both read the frequencies rope-host pinned once."""
        q = randn(2, 6, 4, 32)
        ids = torch.randint(0, 100, (2, 6), device=DEV)
        inv_freq = [0.5**i for i in range(16)]
        got = torch.compile(lambda q, ids: rope_rs.apply_rope(q, position_ids=ids, inv_freq=inv_freq), fullgraph=True)(q, ids)
        cos, sin = cos_sin(ids, torch.tensor(inv_freq, dtype=torch.float64, device=DEV))
        check(got, reference(q, cos, sin, "neox"))
        scaling = {"rope_type": "linear", "factor": 4.0}
        eager = rope_rs.apply_rope(q, position_ids=ids, scaling=scaling)
        compiled = torch.compile(lambda q, ids: rope_rs.apply_rope(q, position_ids=ids, scaling=scaling))(q, ids)
        assert torch.equal(compiled, eager)
        f, _ = rope_rs.frequencies(32, scaling=scaling)
        cos, sin = cos_sin(ids, torch.tensor(f, dtype=torch.float64, device=DEV))
        check(eager, reference(q, cos, sin, "neox"))


    def test_eager_calls_import_nothing_of_torch_compile_until_a_compiled_call(self):
        """In a fresh process, eager calls import none of torch.compile's modules (they cost
        seconds); a compiled call then imports rope_rs.torch, registering the operators, from
        inside dynamo's trace, and agrees with the eager call bit for bit."""
        code = textwrap.dedent(
            """
            import sys, torch, rope_rs
            q = torch.randn(2, 6, 4, 32, device="cuda")
            k = torch.randn(2, 6, 2, 32, device="cuda")
            ids = torch.randint(0, 100, (2, 6), device="cuda")
            before = set(sys.modules)
            want_q, want_k = rope_rs.apply_rope(q, k, position_ids=ids)
            rope_rs.apply_rope(q.clone(), k.clone(), positions=3, inplace=True)
            torch.cuda.synchronize()
            heavy = ("torch._dynamo", "torch._library.custom_ops", "torch._higher_order_ops", "triton", "sympy", "rope_rs.torch")
            imported = sorted(m for m in set(sys.modules) - before if m.startswith(heavy))
            assert not imported, imported

            def step(q, k, ids):
                rope_rs.apply_rope(q, k, position_ids=ids, inplace=True)
                return q, k

            got_q, got_k = torch.compile(step, fullgraph=True)(q.clone(), k.clone(), ids)
            assert "rope_rs.torch" in sys.modules
            assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
            print("ok")
            """
        )
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


class TestStreams:
    def test_explicit_side_stream(self):
        side = torch.cuda.Stream()
        q = randn(4, 16, 64)
        q0 = q.clone()
        side.wait_stream(torch.cuda.current_stream())
        rope_rs.apply_rope(q, positions=3, stream=side.cuda_stream, inplace=True)
        torch.cuda.current_stream().wait_stream(side)
        cos, sin = cos_sin(torch.arange(4, device=DEV)[None] + 3, inv_freq64(10000.0, 64))
        check(q, reference(q0[None], cos, sin, "neox")[0])

    def test_current_stream_by_default(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            q = randn(4, 16, 64)  # written on the side stream, rotated there after it
            q0 = q.clone()
            out = rope_rs.apply_rope(q, positions=3)
            rope_rs.apply_rope(q, positions=3, inplace=True)
        torch.cuda.current_stream().wait_stream(side)
        cos, sin = cos_sin(torch.arange(4, device=DEV)[None] + 3, inv_freq64(10000.0, 64))
        check(out, reference(q0[None], cos, sin, "neox")[0])
        check(q, reference(q0[None], cos, sin, "neox")[0])


class TestExchangeApi:
    """DLPack's C exchange API (``torch.Tensor.__dlpack_c_exchange_api__``): launches on
    PyTorch's current stream borrow tensors through it, with the results and checks of
    ``__dlpack__``."""

    @pytest.fixture
    def exchange(self):
        if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
            pytest.skip(f"torch {torch.__version__} has no __dlpack_c_exchange_api__")
        was = rope_rs._native._set_exchange_api(True)
        yield
        rope_rs._native._set_exchange_api(was)

    @staticmethod
    def both_paths(call):
        """`call()`'s results with the exchange API, then with ``__dlpack__`` alone (same seed)."""
        results = []
        for on in (True, False):
            rope_rs._native._set_exchange_api(on)
            torch.manual_seed(7)
            results.append(call())
        rope_rs._native._set_exchange_api(True)
        torch.cuda.synchronize()
        return results

    def test_torch_tensors_take_the_fast_path(self, exchange):
        q, k = randn(2, 1, 8, 128, dtype=torch.bfloat16), randn(2, 1, 2, 128, dtype=torch.bfloat16)
        assert rope_rs._native._exchange_api_used(q)
        assert rope_rs._native._exchange_api_used(torch.nn.Parameter(q.clone()))
        ids = torch.tensor([[5], [9]], device=DEV)
        before = rope_rs._native._exchange_borrows()
        rope_rs.apply_rope(q, k, position_ids=ids, inplace=True)
        assert rope_rs._native._exchange_borrows() == before + 3  # q, k, position_ids
        before = rope_rs._native._exchange_borrows()
        rope_rs.apply_rope(q, k, position_ids=ids, inplace=True, stream=stream())  # producer_sync
        assert rope_rs._native._exchange_borrows() == before
        rope_rs._native._set_exchange_api(False)
        rope_rs.apply_rope(q, k, position_ids=ids, inplace=True)
        assert rope_rs._native._exchange_borrows() == before

    def test_both_paths_read_the_same_tensors(self, exchange):
        base = randn(6, 4, 16, 64)
        qkv = randn(5, (8 + 2 * 2) * 64, dtype=torch.bfloat16)
        for t in (
            base,
            base.transpose(1, 2),
            base[:, 1:3],
            base[..., :32],
            qkv[:, 8 * 64 : 10 * 64].view(5, 2, 64),
            randn(1, 7, 1, 64),
            randn(4, 1, 64).expand(4, 3, 64),
            torch.arange(12, device=DEV, dtype=torch.int32)[::3],
            randn(0, 4, 64),
            torch.tensor(3, device=DEV),
        ):
            fast = rope_rs._native._dlpack_view(t, producer_sync=False)
            slow = rope_rs._native._dlpack_view(t, producer_sync=True)
            # Strides of extents 1 and 0 address nothing; PyTorch may normalize them in one path.
            def addressed(view):
                ptr, dtype, shape, strides, device = view
                return ptr, dtype, shape, [s if n > 1 else None for n, s in zip(shape, strides)], device

            assert addressed(fast) == addressed(slow), (tuple(t.shape), t.stride(), fast, slow)
            assert fast[0] == t.data_ptr() and fast[2] == list(t.shape)

    def test_results_are_identical_through_both_paths(self, exchange):
        def apply_rope():
            q, k = randn(2, 9, 8, 128, dtype=torch.bfloat16), randn(2, 9, 2, 128, dtype=torch.bfloat16)
            ids = torch.randint(0, 4096, (2, 9), device=DEV)
            out = rope_rs.apply_rope(q, k, position_ids=ids, theta=500000.0)
            rope_rs.apply_rope(q, k, positions=3, inplace=True)
            return (*out, q, k)

        def fused_qkv():
            t, hq, hk, d = 17, 8, 2, 64
            qkv = randn(t, (hq + 2 * hk) * d, dtype=torch.float16)
            q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
            cu = torch.tensor([0, 5, 17], device=DEV, dtype=torch.int32)
            rope_rs.apply_rope(q, k, cu_seqlens=cu, inplace=True)
            return (qkv,)

        def vllm():
            t, h, d = 11, 4, 128
            query, key = randn(t, h * d, dtype=torch.bfloat16), randn(t, h * d, dtype=torch.bfloat16)
            cache = vllm_cache(10000.0, d, 1024)
            positions = torch.randint(0, 1024, (t,), device=DEV)
            rope_rs.rotary_embedding(positions, query, key, d, cache, True)
            return query, key

        def tables():
            q = randn(3, 5, 4, 64)
            inv = inv_freq64(10000.0, 64)
            cos, sin = cos_sin(torch.arange(64, device=DEV)[None], inv)
            return (rope_rs.apply_rope(q, cos=cos[0].float(), sin=sin[0].float(), positions=2),)

        for call in (apply_rope, fused_qkv, vllm, tables):
            fast, slow = self.both_paths(call)
            for a, b in zip(fast, slow):
                assert torch.equal(a, b), call.__name__

    def test_the_current_stream_comes_from_the_exchange_api(self, exchange):
        q = randn(4, 16, 64)
        assert rope_rs._native._current_stream(q) == torch.cuda.current_stream().cuda_stream
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            assert rope_rs._native._current_stream(q) == side.cuda_stream
        assert rope_rs._native._current_stream(torch.zeros(3)) is None  # CPU: no CUDA stream

    def test_host_time_per_decode_call(self, exchange):
        """Prints the host time of a decode-sized in-place call through both paths (the exchange
        API should spare several microseconds per tensor)."""
        import time

        q, k = randn(1, 1, 32, 128, dtype=torch.bfloat16), randn(1, 1, 8, 128, dtype=torch.bfloat16)
        times = {}
        for on in (False, True, False, True):
            rope_rs._native._set_exchange_api(on)
            for _ in range(200):
                rope_rs.apply_rope(q, k, positions=7, inplace=True)
            torch.cuda.synchronize()
            n, t0 = 2000, time.perf_counter()
            for _ in range(n):
                rope_rs.apply_rope(q, k, positions=7, inplace=True)
            times[on] = (time.perf_counter() - t0) / n * 1e6
            torch.cuda.synchronize()
        print(f"\nhost us/call: __dlpack__ {times[False]:.1f}, exchange API {times[True]:.1f}")
        assert times[True] < times[False]


class VllmMlaCase:
    """vLLM's MLA step: a q projection ``[t, heads, 128 + 64]`` whose last 64 features are q_pe, a
    kv projection ``[t, 512 + 64]`` split into kv_c and k_pe (views of one tensor, as
    DeepSeek's ``kv_a_proj`` output), `padded` rows past the tokens (CUDA-graph padding),
    positions, a ``cos_sin_cache`` of the tensors' dtype, and a ``kv_cache`` ``[blocks,
    block_size, 576]`` (FP8 or of the tensors' type) of a sentinel with a slot per token (some
    -1)."""

    def __init__(self, t=37, padded=3, heads=16, block_size=16, blocks=8, dtype=torch.bfloat16, seed=0):
        g = torch.Generator(device=DEV).manual_seed(seed)
        n = t + padded
        self.t, self.r, self.rank, self.dtype = t, 64, 512, dtype
        self.q = torch.randn(n, heads, 128 + 64, device=DEV, generator=g).to(dtype)
        self.kv = torch.randn(n, 512 + 64, device=DEV, generator=g).to(dtype)
        self.q_pe, self.kv_c, self.k_pe = self.q[..., 128:], self.kv[:, :512], self.kv[:, 512:]
        self.cache = vllm_cache(10000.0, 64, 4096, dtype=dtype)
        self.positions = torch.randint(0, 4096, (n,), device=DEV, generator=g)
        slots = torch.randperm(blocks * block_size, device=DEV, generator=g)[:t]
        slots[::6] = -1
        self.slots = slots
        self.shape = (blocks, block_size, 512 + 64)

    def kv_cache(self, dtype):
        """The cache of a sentinel: -7.0 in a 16-bit type, else the byte 0x3C."""
        if dtype in (torch.bfloat16, torch.float16):
            return torch.full(self.shape, -7.0, device=DEV, dtype=dtype)
        return torch.full(self.shape, 0x3C, device=DEV, dtype=torch.uint8).view(dtype)

    def rotated(self, x, style):
        """x [n, heads, 64] (or [n, 64]) rotated at the positions in f64, the first t tokens."""
        x = x[: self.t]
        heads = x.dim() == 3
        x = x if heads else x[:, None]
        cos, sin = table_cos_sin(self.positions[: self.t], self.cache[:, :32], self.cache[:, 32:])
        out = reference(x[None], cos[None], sin[None], style)[0]
        return out if heads else out[:, 0]


class TestVllmMla:
    """vLLM's ``concat_and_cache_mla_rope_fused`` through its signature: q_pe and k_pe rotated in
    place, ``[kv_c | rotated k_pe]`` in each kept slot's row of the one cache (FP8 or the
    tensors' type); eagerly, under ``torch.compile(fullgraph=True)`` and replayed from a CUDA
    graph. The reference is written from vLLM's kernel's semantics (its rows cut to
    ``slot_mapping``'s length, FP8 of ``x / kv_cache_scale``)."""

    @pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    @pytest.mark.parametrize("is_neox", [True, False])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_rotation_and_latent_cache(self, kv_cache_dtype, is_neox, dtype):
        c = VllmMlaCase(dtype=dtype, seed=40 + int(is_neox))
        style = "neox" if is_neox else "interleaved"
        fmt = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
        auto = kv_cache_dtype == "auto"
        kv_cache = c.kv_cache(dtype if auto else torch.uint8 if kv_cache_dtype == "fp8" else fmt)
        q0, kv0 = c.q.clone(), c.kv.clone()
        want_q, want_k = c.rotated(c.q_pe, style), c.rotated(c.k_pe, style)
        scale = torch.tensor([0.5], device=DEV)
        rope_rs.concat_and_cache_mla_rope_fused(
            c.positions, c.q_pe, c.k_pe, c.kv_c, c.cache, is_neox, c.slots, kv_cache, kv_cache_dtype, scale
        )
        torch.cuda.synchronize()
        check(c.q_pe[: c.t], want_q)
        check(c.k_pe[: c.t], want_k)
        assert torch.equal(c.q[: c.t, :, :128], q0[: c.t, :, :128]), "q_nope is untouched"
        assert torch.equal(c.q[c.t :], q0[c.t :]) and torch.equal(c.kv[c.t :], kv0[c.t :]), "padding is untouched"
        assert torch.equal(c.kv_c, kv0[:, :512]), "kv_c is only read"
        rows = kv_cache.view(-1, 576)
        kept = c.slots >= 0
        slots = c.slots[kept]
        if auto:
            # kv_c as it is, the rotated k_pe as rounded into k_pe.
            assert torch.equal(rows[slots, :512], kv0[: c.t, :512][kept])
            assert torch.equal(rows[slots, 512:], c.k_pe[: c.t][kept])
        else:
            fp8_near(rows[slots, :512], kv0[: c.t, :512][kept], 2.0, fmt)
            fp8_near(rows[slots, 512:], want_k[kept], 2.0, fmt)
        others = torch.ones(rows.shape[0], dtype=torch.bool, device=DEV)
        others[slots] = False
        sentinel = c.kv_cache(kv_cache.dtype).view(-1, 576)[0]
        assert (rows[others].view(torch.uint8) == sentinel.view(torch.uint8)).all(), "rows of no kept slot are untouched"

    def test_refused_calls_name_the_argument_and_write_nothing(self):
        c = VllmMlaCase(seed=43)
        q0, kv0 = c.q.clone(), c.kv.clone()
        scale = torch.tensor([0.5], device=DEV)
        call = lambda kv_cache, dtype="fp8", **kw: rope_rs.concat_and_cache_mla_rope_fused(  # noqa: E731
            kw.get("positions", c.positions), c.q_pe, c.k_pe, c.kv_c, c.cache, True, c.slots, kv_cache, dtype,
            kw.get("scale", scale),
        )
        bf16 = torch.zeros(c.shape, device=DEV, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="^kv_cache must be uint8"):
            call(bf16, "fp8")
        with pytest.raises(ValueError, match="^kv_cache must be bfloat16"):
            call(torch.zeros(c.shape, device=DEV, dtype=torch.uint8), "auto")
        narrow = torch.zeros(8, 16, 512 + 32, device=DEV, dtype=torch.uint8)
        with pytest.raises(ValueError, match="^kv_cache"):
            call(narrow)
        cache = c.kv_cache(torch.uint8)
        with pytest.raises(ValueError, match="^kv_cache_scale"):
            call(cache, scale=torch.tensor([0.5], device=DEV, dtype=torch.float16))
        with pytest.raises(ValueError, match="^positions"):
            call(cache, positions=c.positions[:5])
        torch.cuda.synchronize()
        assert torch.equal(c.q, q0) and torch.equal(c.kv, kv0)
        assert (narrow == 0).all() and (cache.view(torch.uint8) == 0x3C).all() and (bf16 == 0).all()

    def test_compiled_graph_and_opcheck_match_eager(self):
        c, fresh = VllmMlaCase(t=32, padded=0, seed=44), VllmMlaCase(t=32, padded=0, seed=45)
        table, scale = c.cache, torch.tensor([0.25], device=DEV)

        def step(q, kv, positions, slots, kv_cache):
            q_pe, kv_c, k_pe = q[..., 128:], kv[:, :512], kv[:, 512:]
            rope_rs.concat_and_cache_mla_rope_fused(
                positions, q_pe, k_pe, kv_c, table, True, slots, kv_cache, "fp8", scale, pdl=True
            )
            return q_pe.float().sum(-1) + k_pe.float().sum(-1)[:, None]

        def inputs(case):
            return case.q.clone(), case.kv.clone(), case.positions.clone(), case.slots.clone()

        eager_cache, compiled_cache = c.kv_cache(torch.uint8), c.kv_cache(torch.uint8)
        want = step(*inputs(c), eager_cache)
        got = torch.compile(step, fullgraph=True)(*inputs(c), compiled_cache)
        assert torch.equal(got, want) and torch.equal(compiled_cache, eager_cache)
        static, graphed = inputs(c), c.kv_cache(torch.uint8)
        step(*static, graphed)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(*static, graphed)
        for x, y in zip(static, inputs(fresh)):
            x.copy_(y)
        graphed.fill_(0x3C)
        graph.replay()
        again = fresh.kv_cache(torch.uint8)
        want = step(*inputs(fresh), again)
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(graphed, again)
        q_pe, k_pe, kv_c = (x.contiguous() for x in (c.q_pe, c.k_pe, c.kv_c))
        torch.library.opcheck(
            rope_torch.concat_and_cache_mla_rope_fused_op,
            (c.positions, q_pe, k_pe, kv_c, table, True, c.slots, c.kv_cache(torch.uint8), "fp8", scale, False),
        )


class TestDualChunk:
    """vLLM's ``DualChunkRotaryEmbedding`` (vllm/model_executor/layers/rotary_embedding.py,
    Qwen2.5-1M's dual chunk attention) against a float64 reference written from that class: its
    caches index keys by ``positions % chunk_len`` and queries by ``positions % chunk_len`` into
    tables of ``arange(chunk_len)`` (``q``), ``(arange(chunk_len) + chunk_len).clamp(max=
    chunk_size)`` (``qc``, also read at ``chunk_len - 1`` for every token), ``arange(chunk_len) +
    chunk_len`` and ``arange(chunk_len) + chunk_size``, angles ``f32(t) * f32(inv_freq)``; the
    query variants concatenated along the last dimension, pass-through features copied."""

    @pytest.mark.parametrize("is_neox", [True, False])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("rotary_dim", [128, 64])
    def test_matches_vllms_definition(self, is_neox, dtype, rotary_dim):
        t, hq, hk, d, chunk_size, local_size, base = 53, 4, 2, 128, 256, 32, 1e6
        span = chunk_size - local_size
        g = torch.Generator(device=DEV).manual_seed(50 + int(is_neox) + rotary_dim)
        query = torch.randn(t, hq * d, device=DEV, generator=g).to(dtype)
        key = torch.randn(t, hk * d, device=DEV, generator=g).to(dtype)
        positions = torch.randint(0, 3000, (t,), device=DEV, generator=g)
        offsets = torch.randint(0, 100, (t,), device=DEV, generator=g)
        q0, k0 = query.clone(), key.clone()
        rope = rope_rs.DualChunkRotaryEmbedding(d, rotary_dim, 32768, base, is_neox, dtype, chunk_size, local_size)
        q_out, k_out = rope(positions, query, key, offsets)
        assert torch.equal(query, q0) and torch.equal(key, k0), "the inputs are unchanged"
        assert q_out.shape == (t, 5 * hq * d) and k_out.shape == (t, hk * d)
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        style = "neox" if is_neox else "interleaved"

        def rotated(x, at):
            angle = (at.to(torch.float32)[:, None] * inv_freq.to(DEV)[None]).to(torch.float64)
            return reference(x.view(1, t, -1, d), angle.cos()[None], angle.sin()[None], style, rotary_dim)[0]

        p = positions + offsets
        within = p % span
        qc = (torch.arange(span, device=DEV) + span).clamp(max=chunk_size)
        variants = [within, qc[within], qc[span - 1].expand(t), within + span, within + chunk_size]
        got = q_out.view(t, 5, hq, d)
        for i, at in enumerate(variants):
            check(got[:, i], rotated(query, at))
        check(k_out.view(t, hk, d), rotated(key, within))


class TestVllmMRotaryEmbedding:
    """vLLM's ``MRotaryEmbedding`` (vllm/model_executor/layers/rotary_embedding/mrope.py,
    Qwen2-VL to Qwen3-VL) against a float64 reference written from its ``forward_native``:
    cos/sin of ``f32(t) * f32(inv_freq)`` gathered at each row of ``positions`` [3, num_tokens],
    then per pair from the temporal, height or width row (``mrope_section`` blocks, or
    ``apply_interleaved_rope``'s ``T H W T H W ...``); ``[num_tokens]`` positions rotate every
    pair there. Pass-through features copied, inputs unchanged."""

    @pytest.mark.parametrize("interleaved", [False, True])
    @pytest.mark.parametrize("is_neox", [True, False])
    @pytest.mark.parametrize("rotary_dim", [128, 64])
    def test_matches_vllms_definition(self, interleaved, is_neox, rotary_dim):
        t, hq, hk, d, base, dtype = 45, 4, 2, 128, 1e6, torch.bfloat16
        sections = [rotary_dim // 8, 3 * rotary_dim // 16, 3 * rotary_dim // 16]
        g = torch.Generator(device=DEV).manual_seed(70 + int(is_neox) + rotary_dim + int(interleaved))
        query = torch.randn(t, hq * d, device=DEV, generator=g).to(dtype)
        key = torch.randn(t, hk * d, device=DEV, generator=g).to(dtype)
        positions = torch.randint(0, 3000, (3, t), device=DEV, generator=g)
        q0, k0 = query.clone(), key.clone()
        rope = rope_rs.MRotaryEmbedding(d, rotary_dim, 32768, base, is_neox, dtype, sections, interleaved)
        q_out, k_out = rope(positions, query, key)
        assert torch.equal(query, q0) and torch.equal(key, k0), "the inputs are unchanged"
        assert q_out.shape == query.shape and k_out.shape == key.shape
        inv_freq = (1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))).to(DEV)
        angle = (positions.to(torch.float32)[..., None] * inv_freq).to(torch.float64)  # [3, t, r/2]
        axes = torch.tensor(mrope_axes(sections, interleaved), device=DEV)
        angle = angle.gather(0, axes.expand(t, -1)[None])[0]
        style = "neox" if is_neox else "interleaved"
        for x, got in ((query, q_out), (key, k_out)):
            want = reference(x.view(1, t, -1, d), angle.cos()[None], angle.sin()[None], style, rotary_dim)[0]
            check(got.view(t, -1, d), want)
        # Text alone: [num_tokens] positions, every pair at the token's position.
        text = positions[0]
        q_out, _ = rope(text, query, key)
        angle = (text.to(torch.float32)[:, None] * inv_freq).to(torch.float64)
        check(q_out.view(t, hq, d), reference(query.view(1, t, hq, d), angle.cos()[None], angle.sin()[None], style, rotary_dim)[0])


def vllm_fope(rope, cos_coef, sin_coef, positions, query, key):
    """vLLM's ``FourierRotaryEmbedding`` (vllm/model_executor/layers/rotary_embedding/fope.py):
    its ``_compute_cos_sin_cache`` (float32 frequencies and einsums, padded with cos 1 and sin 0,
    rounded to the model's dtype) and ``forward_native`` (cos/sin gathered per token and kv
    head, q heads grouped by reshape, ``x cos + rotate_neox(x) sin``) in float64."""
    r, d, kvh = rope.rotary_dim, rope.head_size, rope.num_key_value_heads
    inv_freq = 1.0 / (rope.base ** (torch.arange(0, r, 2, dtype=torch.float32, device=DEV) / r))
    if rope.num_inv_freq is not None:
        inv_freq = inv_freq[: rope.num_inv_freq]
    else:
        inv_freq = inv_freq[inv_freq > 2.0 * torch.pi / rope.max_position_embeddings]
    t = torch.arange(rope.max_position_embeddings, dtype=torch.float32, device=DEV)
    freqs = torch.einsum("j,i -> ji", t, inv_freq)
    if rope.fope_sep_head:
        sin = torch.einsum("htD, hDd -> thd", freqs.sin().expand(kvh, -1, -1), sin_coef.float())
        cos = torch.einsum("htD, hDd -> thd", freqs.cos().expand(kvh, -1, -1), cos_coef.float())
    else:
        sin = torch.einsum("tD, Dd -> td", freqs.sin(), sin_coef[0].float())
        cos = torch.einsum("tD, Dd -> td", freqs.cos(), cos_coef[0].float())
    sin = torch.nn.functional.pad(sin, (0, d // 2 - sin.size(-1)), value=0)
    cos = torch.nn.functional.pad(cos, (0, d // 2 - cos.size(-1)), value=1)
    cache = torch.cat((torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)), -1).to(rope.dtype)
    c, s = cache.index_select(0, positions.flatten()).to(torch.float64).chunk(2, dim=-1)
    q, k = query.unflatten(-1, (-1, d)).to(torch.float64), key.unflatten(-1, (-1, d)).to(torch.float64)
    if c.dim() == 3:
        c, s = c.flatten(0, 1), s.flatten(0, 1)
        q, k = q.reshape(c.size(0), -1, d), k.reshape(c.size(0), -1, d)
    c, s = c.unsqueeze(1), s.unsqueeze(1)
    half = d // 2
    neox = lambda x: torch.cat((-x[..., half:], x[..., :half]), -1)  # noqa: E731
    return (q * c + neox(q) * s).reshape(query.shape), (k * c + neox(k) * s).reshape(key.shape)


class TestVllmFourierRotaryEmbedding:
    """vLLM's ``FourierRotaryEmbedding`` (FoPE) against :func:`vllm_fope`: per-kv-head tables,
    kept frequencies by count or by ``2 pi / max_position_embeddings``, separate or shared heads,
    query and key as views of one packed projection."""

    @pytest.mark.parametrize("sep_head", [True, False])
    @pytest.mark.parametrize("num_inv_freq", [None, 24])
    def test_matches_vllms_definition(self, sep_head, num_inv_freq):
        d, kvh, hq, t, max_pos, dtype = 128, 4, 16, 37, 2048, torch.bfloat16
        g = torch.Generator(device=DEV).manual_seed(90 + int(sep_head) + (num_inv_freq or 0))
        rope = rope_rs.FourierRotaryEmbedding(d, d, max_pos, 10000.0, True, dtype, True, kvh, num_inv_freq, sep_head, 0.1)
        n = rope.kept_inv_freq(torch, DEV).shape[0]
        cos_coef = (0.2 * torch.randn(kvh, n, n, device=DEV, generator=g)).to(dtype)
        sin_coef = (0.2 * torch.randn(kvh, n, n, device=DEV, generator=g)).to(dtype)
        rope.set_coefficients(cos_coef, sin_coef)
        qkv = torch.randn(t, (hq + 2 * kvh) * d, device=DEV, generator=g).to(dtype)
        query, key = qkv[:, : hq * d], qkv[:, hq * d : (hq + kvh) * d]
        positions = torch.randint(0, max_pos, (t,), device=DEV, generator=g)
        q0, k0 = query.clone(), key.clone()
        q_out, k_out = rope(positions, query, key)
        assert torch.equal(query, q0) and torch.equal(key, k0), "the inputs are unchanged"
        want_q, want_k = vllm_fope(rope, cos_coef, sin_coef, positions, query, key)
        # The learned cos and sin reach a few units: bf16 outputs round at that magnitude.
        check(q_out.view(t, hq, d), want_q.view(t, hq, d), extra_atol=5e-2)
        check(k_out.view(t, kvh, d), want_k.view(t, kvh, d), extra_atol=5e-2)


class TestErrors:
    def test_invalid_cuda_arguments_are_value_errors(self):
        q = randn(4, 2, 64)
        with pytest.raises(ValueError, match="k is bfloat16, q is float32"):
            rope_rs.apply_rope(q, randn(4, 2, 64, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="rotary_dim"):
            rope_rs.apply_rope(q, rotary_dim=7)
        with pytest.raises(ValueError, match="q must have a contiguous last dimension"):
            rope_rs.apply_rope(randn(4, 2, 128)[..., ::2])
        with pytest.raises(ValueError, match="^position_ids: "):
            rope_rs.apply_rope(q, position_ids=torch.zeros(5, device=DEV, dtype=torch.int64))
        with pytest.raises(ValueError, match="^out: "):
            rope_rs.apply_rope(q, out=randn(4, 2, 32))
        with pytest.raises(ValueError, match="^positions: position 4099 is past the end of a table"):
            rope_rs.apply_rope(q, positions=4096, cos_sin_cache=vllm_cache(10000.0, 64, 4096))
        with pytest.raises(ValueError, match="q must be a CUDA tensor"):
            rope_rs.apply_rope(torch.zeros(4, 2, 64))
        with pytest.raises(ValueError, match="out: not with autograd"):
            rope_rs.apply_rope(q.clone().requires_grad_(), out=torch.empty_like(q))

    @pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
    def test_tensors_on_two_devices(self):
        with pytest.raises(ValueError, match=r"k is on (cuda:1, q on cuda:0|CUDA device 1)"):
            rope_rs.apply_rope(randn(4, 2, 64), torch.randn(4, 2, 64, device="cuda:1"))


class TestQkNormRopeTraining:
    """``rope_rs.qk_norm_rope``: forward and the fused backward against PyTorch's autograd of
    the same step written in float64 (QK-norm, then the rotation by the cos_sin_cache rows)."""

    @staticmethod
    def step64(x, w, cache, positions, eps, is_neox, gemma):
        """The step in float64: x [t, h, d], w [d]."""
        x = x.to(torch.float64)
        n = x / (x.square().mean(-1, keepdim=True) + eps).sqrt() * (w.to(torch.float64) + (1.0 if gemma else 0.0))
        half = x.shape[-1] // 2
        rows = cache.to(torch.float64)[positions.long()]
        cos, sin = rows[:, None, :half], rows[:, None, half:]
        if is_neox:
            a, b = n[..., :half], n[..., half:]
            return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
        a, b = n[..., 0::2], n[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("is_neox", [True, False])
    @pytest.mark.parametrize("gemma", [False, True])
    @pytest.mark.parametrize("d", [128, 512])  # 512: Gemma 4's global layers
    def test_forward_and_gradients_match_float64_autograd(self, dtype, is_neox, gemma, d):
        torch.manual_seed(int(is_neox) + 2 * int(gemma) + d)
        t, hq, hk, eps = 300, 8, 2, 1e-6
        q = torch.randn(t, hq, d, device=DEV, dtype=dtype, requires_grad=True)
        k = torch.randn(t, hk, d, device=DEV, dtype=dtype, requires_grad=True)
        scale = 0.3 if gemma else 1.0
        qw = (torch.randn(d, device=DEV) * scale + (0.0 if gemma else 1.0)).to(dtype).requires_grad_()
        kw = (torch.randn(d, device=DEV) * scale + (0.0 if gemma else 1.0)).to(dtype).requires_grad_()
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=DEV, dtype=torch.float64) / d))
        angles = torch.arange(4096, device=DEV, dtype=torch.float64)[:, None] * inv
        cache = torch.cat([angles.cos(), angles.sin()], -1).to(torch.float32)
        positions = torch.randint(0, 4096, (t,), device=DEV)
        q_out, k_out = rope_rs.qk_norm_rope(q, k, qw, kw, cache, positions, eps=eps, is_neox=is_neox, gemma=gemma)
        gq_out, gk_out = torch.randn_like(q_out), torch.randn_like(k_out)
        (q_out.float() * gq_out.float()).sum().add((k_out.float() * gk_out.float()).sum()).backward()

        leaves = [x.detach().to(torch.float64).requires_grad_() for x in (q, k, qw, kw)]
        want_q = self.step64(leaves[0], leaves[2], cache, positions, eps, is_neox, gemma)
        want_k = self.step64(leaves[1], leaves[3], cache, positions, eps, is_neox, gemma)
        (want_q * gq_out.double()).sum().add((want_k * gk_out.double()).sum()).backward()
        extra = 0.0 if dtype == torch.float32 else 2e-2
        check(q_out, want_q.detach(), extra_atol=extra)
        check(k_out, want_k.detach(), extra_atol=extra)
        for got, leaf in zip((q, k), leaves[:2]):
            check(got.grad, leaf.grad, extra_atol=1e-4 if dtype == torch.float32 else 3e-2)
        for got, leaf in zip((qw, kw), leaves[2:]):
            # Sums over 300 tokens and the heads: the bound grows with the terms summed.
            bound = 1e-4 * leaf.grad.abs().max().item() + (1e-3 if dtype == torch.float32 else 0.0)
            torch.testing.assert_close(
                got.grad.double(), leaf.grad, atol=bound, rtol=1e-4 if dtype == torch.float32 else 8e-3
            )

    def test_backward_is_deterministic_and_leaves_inputs_alone(self):
        torch.manual_seed(7)
        t, d = 1000, 64
        q = torch.randn(t, 4, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(t, 2, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        qw = torch.ones(d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        kw = torch.ones(d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        cache = torch.randn(2048, d, device=DEV, dtype=torch.float32)
        positions = torch.randint(0, 2048, (t,), device=DEV, dtype=torch.int32)
        q0 = q.detach().clone()
        grads = []
        for _ in range(2):
            for x in (q, k, qw, kw):
                x.grad = None
            q_out, k_out = rope_rs.qk_norm_rope(q, k, qw, kw, cache, positions)
            (q_out.float().square().sum() + k_out.float().sum()).backward()
            grads.append([x.grad.clone() for x in (q, k, qw, kw)])
        assert torch.equal(q.detach(), q0)
        for a, b in zip(*grads):
            assert torch.equal(a, b)


def dit_reference(qkv, q_weight, k_weight, grid, channels, heads, head_dim, eps, base, interleave, is_qk_norm):
    """FlashInfer's ``fused_qk_rmsnorm_rope`` (flashinfer/norm: ``fused_qk_rmsnorm_rope``, its
    kernel ``fusedQKNormRopeKernel``) in f64: q's and k's heads of a token normalised together
    (weights of ``heads * head_dim``), then each head rotated, pair ``j`` (elements ``2j, 2j + 1``
    interleaved, ``j, j + d/2`` NeoX) by frequency ``j`` of the frame's, height's and width's
    ``base ** (-2i / c)`` in that order, at the axis of its first channel ``2j``; v as it is."""
    ppf, pph, ppw = grid
    seq = ppf * pph * ppw
    hq, hk, hv = heads
    x = qkv.reshape(-1, hq + hk + hv, head_dim).to(torch.float64)
    t = torch.arange(x.shape[0], device=DEV) % seq
    pos = torch.stack((t // (pph * ppw), t % (pph * ppw) // ppw, t % ppw))  # [3, tokens]
    freqs, axis = [], []
    for a, c in enumerate(channels):
        freqs += [base ** (-2.0 * i / c) for i in range(c // 2)]
    for j in range(head_dim // 2):
        ch = 2 * j
        axis.append(0 if ch < channels[0] else 1 if ch < channels[0] + channels[1] else 2)
    freqs = torch.tensor(freqs, dtype=torch.float64, device=DEV)
    p = pos[torch.tensor(axis, device=DEV)].T.to(torch.float64)  # [tokens, d/2]
    cos, sin = (p * freqs).cos().unsqueeze(0), (p * freqs).sin().unsqueeze(0)
    outs = []
    for part, w in ((x[:, :hq], q_weight), (x[:, hq : hq + hk], k_weight)):
        if is_qk_norm:
            flat = part.reshape(part.shape[0], -1)
            flat = flat / (flat.square().mean(-1, keepdim=True) + eps).sqrt() * w.to(torch.float64)
            part = flat.reshape(part.shape)
        outs.append(reference(part.unsqueeze(0), cos, sin, "interleaved" if interleave else "neox")[0])
    outs.append(x[:, hq + hk :])
    return outs


class TestDitNormAcrossHeads:
    """``rope_rs.fused_qk_rmsnorm_rope`` (FlashInfer's signature) against the f64 formula of
    FlashInfer's kernel: WAN-like shapes, both pairings, 2-D and 3-D qkv, with and without the
    norm, bf16 and FP8 outputs; given outputs are written."""

    @pytest.mark.parametrize("interleave", [True, False])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    @pytest.mark.parametrize("is_qk_norm", [True, False])
    def test_matches_flashinfer_formula(self, interleave, dtype, is_qk_norm):
        grid, channels, heads, d = (3, 4, 5), (44, 42, 42), (6, 6, 6), 128
        qkv = randn(2, 60, sum(heads) * d, dtype=dtype)
        qw = (1 + 0.2 * randn(heads[0] * d)).to(dtype)
        kw = (1 + 0.2 * randn(heads[1] * d)).to(dtype)
        q, k, v = rope_rs.fused_qk_rmsnorm_rope(
            qkv, qw, kw, ppf=grid[0], pph=grid[1], ppw=grid[2], num_frame_channels=channels[0],
            num_height_channels=channels[1], num_width_channels=channels[2], num_heads_q=heads[0],
            num_heads_k=heads[1], num_heads_v=heads[2], head_dim=d, eps=1e-6, interleave=interleave,
            is_qk_norm=is_qk_norm,
        )
        torch.cuda.synchronize()
        want = dit_reference(qkv, qw, kw, grid, channels, heads, d, 1e-6, 10000.0, interleave, is_qk_norm)
        assert q.shape == (2, 60, heads[0], d) and v.shape == (2, 60, heads[2], d)
        for got, ref in zip((q, k, v), want):
            check(got.reshape(ref.shape), ref)

    def test_fp8_outputs_and_given_buffers(self):
        grid, channels, heads, d = (2, 4, 4), (44, 42, 42), (8, 4, 4), 128
        qkv = randn(64, sum(heads) * d, dtype=torch.bfloat16)
        qw = (1 + 0.2 * randn(heads[0] * d)).to(torch.bfloat16)
        kw = (1 + 0.2 * randn(heads[1] * d)).to(torch.bfloat16)
        outs = [torch.empty(64, h, d, dtype=torch.float8_e4m3fn, device=DEV) for h in heads]
        got = rope_rs.fused_qk_rmsnorm_rope(
            qkv, qw, kw, ppf=grid[0], pph=grid[1], ppw=grid[2], num_frame_channels=channels[0],
            num_height_channels=channels[1], num_width_channels=channels[2], num_heads_q=heads[0],
            num_heads_k=heads[1], num_heads_v=heads[2], head_dim=d, interleave=False,
            output_fp8=True, output_quant_scale=4.0, v_quant_scale=2.0,
            q_out=outs[0], k_out=outs[1], v_out=outs[2],
        )
        torch.cuda.synchronize()
        assert all(g is o for g, o in zip(got, outs))
        want = dit_reference(qkv, qw, kw, grid, channels, heads, d, 1e-6, 10000.0, False, True)
        for g, ref, m in zip(got, want, (4.0, 4.0, 2.0)):
            fp8_near(g, ref, m, torch.float8_e4m3fn)

    def test_compiled_matches_eager(self):
        grid, channels, heads, d = (2, 3, 4), (44, 42, 42), (4, 2, 2), 128
        qkv = randn(48, sum(heads) * d, dtype=torch.bfloat16)
        qw = (1 + 0.2 * randn(heads[0] * d)).to(torch.bfloat16)
        kw = (1 + 0.2 * randn(heads[1] * d)).to(torch.bfloat16)

        def step(x):
            q, k, v = rope_rs.fused_qk_rmsnorm_rope(
                x * 2, qw, kw, ppf=grid[0], pph=grid[1], ppw=grid[2], num_frame_channels=channels[0],
                num_height_channels=channels[1], num_width_channels=channels[2], num_heads_q=heads[0],
                num_heads_k=heads[1], num_heads_v=heads[2], head_dim=d, interleave=False,
            )
            return q + 1, k, v

        got = torch.compile(step, fullgraph=True)(qkv)
        want = step(qkv)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-2, rtol=1e-2)

    def test_refuses_bad_sizes(self):
        qkv = randn(16, 3 * 128, dtype=torch.bfloat16)
        w = torch.ones(128, dtype=torch.bfloat16, device=DEV)
        base = dict(ppf=1, pph=4, ppw=4, num_heads_q=1, num_heads_k=1, num_heads_v=1, head_dim=128)
        with pytest.raises(ValueError, match="sum to"):
            rope_rs.fused_qk_rmsnorm_rope(qkv, w, w, num_frame_channels=40, num_height_channels=42,
                                          num_width_channels=42, **base)
        with pytest.raises(ValueError, match="q_weight"):
            rope_rs.fused_qk_rmsnorm_rope(qkv, w[:64], w, num_frame_channels=44, num_height_channels=42,
                                          num_width_channels=42, **base)
