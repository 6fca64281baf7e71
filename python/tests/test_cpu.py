"""Tests of rope_rs that need no GPU and no PyTorch: import, argument checking, the frequencies
of the scaling families, DLPack capsule handling, DLPack's C exchange API (a fake producer).

Most argument checks run before the device is touched, so they are exercised here on fake CUDA
tensors: DLPack capsules built with ctypes that describe CUDA memory at addresses nothing ever
reads. Every call on them must fail its checks (the one valid call runs only without a driver).
"""

import ctypes
import ctypes.util
import math
import os
import subprocess
import sys

import pytest

import rope_rs


def numpy():
    """numpy, the CPU DLPack producer of some tests (skipped without it)."""
    return pytest.importorskip("numpy")


def close(got, want, rtol):
    """Every `got[i]` within `rtol` of `want[i]`."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= rtol * abs(w), (i, g, w)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_DLTENSOR = b"dltensor"  # the capsule keeps a pointer to this name

DTYPES = {
    "float32": (2, 32),
    "float16": (2, 16),
    "bfloat16": (4, 16),
    "float64": (2, 64),
    "int32": (0, 32),
    "int64": (0, 64),
    "uint8": (1, 8),
    "float8_e4m3fn": (10, 8),
}


class FakeCuda:
    """A DLPack producer describing a CUDA tensor at an address nothing reads. Each fake gets
    its own 1 GiB-aligned address so that fakes never overlap."""

    _next = 1 << 40

    def __init__(self, shape, dtype="float32", strides=None, device=0):
        self.shape, self.dtype, self.strides, self.device = tuple(shape), dtype, strides, device
        self.ptr = FakeCuda._next
        FakeCuda._next += 1 << 30
        self.keep = []  # the structures behind handed-out capsules
        self.streams = []

    def __dlpack_device__(self):
        return (2, self.device)

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        ndim = len(self.shape)
        shape = (ctypes.c_int64 * ndim)(*self.shape)
        strides = None if self.strides is None else (ctypes.c_int64 * ndim)(*self.strides)
        code, bits = DTYPES[self.dtype]
        managed = DLManagedTensor()
        managed.dl_tensor = DLTensor(
            self.ptr,
            DLDevice(2, self.device),
            ndim,
            DLDataType(code, bits, 1),
            shape,
            strides,
            0,
        )
        self.keep.append((shape, strides, managed))
        return _capsule_new(ctypes.addressof(managed), _DLTENSOR, None)


class PretendCuda:
    """Says it lives on CUDA but hands out numpy's (CPU) capsule: exercises the capsule path."""

    def __init__(self, array):
        self.array = array
        self.streams = []

    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        return self.array.__dlpack__()


class NotACapsule:
    def __dlpack_device__(self):
        return (2, 0)

    def __dlpack__(self, stream=None):
        return object()


def has_driver():
    """Whether libcuda loads here (then a valid call on fake tensors would launch)."""
    for name in ("libcuda.so.1", "libcuda.so", ctypes.util.find_library("cuda")):
        if name is None:
            continue
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            pass
    return False


def q4(dtype="float32"):
    return FakeCuda((2, 16, 4, 64), dtype)


def ints(n, dtype="int64"):
    return FakeCuda((n,), dtype)


class Serving:
    """Fake tensors of a serving step: a packed QKV of 7 tokens, 4 q and 2 kv heads of 64."""

    t, hq, hk, d = 7, 4, 2, 64

    def __init__(self, dtype="bfloat16"):
        self.qkv = FakeCuda((self.t, (self.hq + 2 * self.hk) * self.d), dtype)
        self.w = FakeCuda((self.d,), dtype)
        self.cache = FakeCuda((4096, self.d), "float32")
        self.ids = ints(self.t)

    def caches(self, dtype="bfloat16", shape=None):
        shape = shape or (3, 16, self.hk, self.d)
        return FakeCuda(shape, dtype), FakeCuda(shape, dtype)

    def fused(self, **kw):
        args = dict(num_heads_q=self.hq, num_heads_k=self.hk, num_heads_v=self.hk, head_dim=self.d, eps=1e-6)
        args.update({k: kw.pop(k) for k in list(kw) if k in args})
        rope_rs.fused_qk_norm_rope(
            self.qkv, args["num_heads_q"], args["num_heads_k"], args["num_heads_v"], args["head_dim"],
            args["eps"], kw.pop("q_weight", self.w), self.w, self.cache, True, self.ids, **kw,
        )


class TestServingArguments:
    """The serving drop-ins check their arguments before the device, naming them as the peers
    do."""

    def test_packed_heads_must_add_up(self):
        with pytest.raises(ValueError, match=r"qkv holds 8 heads of 64 elements per token, .* is 9"):
            Serving().fused(num_heads_q=5)
        with pytest.raises(ValueError, match="qkv rows of 512 elements are not whole heads of head_size 48"):
            Serving().fused(head_dim=48)

    def test_mrope_positions_are_checked(self):
        s = Serving()
        with pytest.raises(ValueError, match="mrope_section must have three entries"):
            s.fused(mrope_section=[16, 16])
        with pytest.raises(ValueError, match=r"position_ids must be \[3, batch, seq\] or \[3, tokens\]"):
            s.fused(mrope_section=[8, 12, 12])
        s.ids = FakeCuda((3, s.t), "int64")
        with pytest.raises(ValueError, match=r"mrope_section: \[8, 8, 8\] sums to 24, rotary_dim / 2 is 32"):
            s.fused(mrope_section=[8, 8, 8], mrope_interleaved=True)

    def test_norm_weights_are_checked(self):
        s = Serving()
        with pytest.raises(ValueError, match=r"q_weight must be bfloat16 \(the tensors' type\), got float32"):
            s.fused(q_weight=FakeCuda((64,), "float32"))
        with pytest.raises(ValueError, match=r"q_weight must be \[64\], got shape \[32\]"):
            s.fused(q_weight=FakeCuda((32,), "bfloat16"))

    def test_cache_arguments_go_together(self):
        s = Serving()
        k, v = s.caches()
        with pytest.raises(ValueError, match="key_cache, value_cache and slot_mapping go together"):
            s.fused(key_cache=k, value_cache=v)
        with pytest.raises(ValueError, match="kv_cache_dtype must be"):
            s.fused(key_cache=k, value_cache=v, slot_mapping=ints(7), kv_cache_dtype="fp8_e3m4")
        with pytest.raises(ValueError, match="describe a cache write"):
            s.fused(kv_cache_dtype="fp8")
        with pytest.raises(ValueError, match="v_scale: given k_scale"):
            s.fused(key_cache=k, value_cache=v, slot_mapping=ints(7), k_scale=FakeCuda((1,)))

    def test_cache_types_follow_kv_cache_dtype(self):
        s = Serving()
        k8, v8 = s.caches("uint8")
        with pytest.raises(ValueError, match=r'key_cache must be bfloat16 \(kv_cache_dtype="auto"\), got uint8'):
            s.fused(key_cache=k8, value_cache=v8, slot_mapping=ints(7))
        k, v = s.caches()
        with pytest.raises(ValueError, match="key_cache must be uint8 or float8_e4m3fn"):
            s.fused(key_cache=k, value_cache=v, slot_mapping=ints(7), kv_cache_dtype="fp8",
                    k_scale=FakeCuda((1,)), v_scale=FakeCuda((1,)))
        with pytest.raises(ValueError, match="an FP8 or NVFP4 cache needs k_scale and v_scale"):
            s.fused(key_cache=k8, value_cache=v8, slot_mapping=ints(7), kv_cache_dtype="fp8")
        e4m3 = s.caches("float8_e4m3fn")
        with pytest.raises(ValueError, match="k_scale must be float32, got float16"):
            s.fused(key_cache=e4m3[0], value_cache=e4m3[1], slot_mapping=ints(7), kv_cache_dtype="fp8_e4m3",
                    k_scale=FakeCuda((1,), "float16"), v_scale=FakeCuda((1,)))

    def test_nvfp4_caches_are_packed_uint8_rows_with_global_scales(self):
        """``kv_cache_dtype="nvfp4"``: uint8 caches of vLLM's packed rows (``head_size // 2 +
        head_size // 16`` bytes a head) and float32 global scales, each refused by name."""
        s = Serving()
        scales = dict(k_scale=FakeCuda((1,)), v_scale=FakeCuda((1,)))
        k, v = s.caches()
        with pytest.raises(ValueError, match=r'key_cache must be uint8 \(kv_cache_dtype="nvfp4"\), got bfloat16'):
            s.fused(key_cache=k, value_cache=v, slot_mapping=ints(7), kv_cache_dtype="nvfp4", **scales)
        k8, v8 = s.caches("uint8")
        with pytest.raises(ValueError, match=r"key_cache holds 64 bytes a head; an NVFP4 cache holds .* = 36"):
            s.fused(key_cache=k8, value_cache=v8, slot_mapping=ints(7), kv_cache_dtype="nvfp4", **scales)
        packed = s.caches("uint8", shape=(3, 16, s.hk, s.d // 2 + s.d // 16))
        with pytest.raises(ValueError, match="an FP8 or NVFP4 cache needs k_scale and v_scale"):
            s.fused(key_cache=packed[0], value_cache=packed[1], slot_mapping=ints(7), kv_cache_dtype="nvfp4")
        with pytest.raises(ValueError, match='or "nvfp4", got "fp4"'):
            s.fused(key_cache=packed[0], value_cache=packed[1], slot_mapping=ints(7), kv_cache_dtype="fp4")

    def test_caches_share_a_layout_and_have_a_known_rank(self):
        s = Serving()
        k, _ = s.caches()
        other = FakeCuda((3, 16, s.hk, s.d), "bfloat16", strides=(16 * s.hk * s.d * 2, s.hk * s.d, s.d, 1))
        with pytest.raises(ValueError, match="value_cache must have key_cache's shape and strides"):
            s.fused(key_cache=k, value_cache=other, slot_mapping=ints(7))
        k5, v5 = s.caches(shape=(1, 3, 16, s.hk, s.d))
        with pytest.raises(ValueError, match=r"key_cache must be \[num_blocks, block_size, num_kv_heads, head_size\]"):
            s.fused(key_cache=k5, value_cache=v5, slot_mapping=ints(7))
        with pytest.raises(ValueError, match="slot_mapping must be one-dimensional"):
            s.fused(key_cache=k, value_cache=s.caches()[1], slot_mapping=FakeCuda((7, 1), "int64"))

    def test_rotary_embedding_cache_needs_key_and_value(self):
        s = Serving()
        q, kk = FakeCuda((7, 4 * 64), "bfloat16"), FakeCuda((7, 2 * 64), "bfloat16")
        k, v = s.caches()
        with pytest.raises(ValueError, match="value: is only read to fill a KV cache"):
            rope_rs.rotary_embedding(s.ids, q, kk, 64, s.cache, True, value=FakeCuda((7, 128), "bfloat16"))
        with pytest.raises(ValueError, match="key and value: a KV cache write needs both"):
            rope_rs.rotary_embedding(s.ids, q, kk, 64, s.cache, True, key_cache=k, value_cache=v, slot_mapping=ints(7))
        with pytest.raises(ValueError, match="value is float16, query is bfloat16"):
            rope_rs.rotary_embedding(s.ids, q, kk, 64, s.cache, True, value=FakeCuda((7, 128), "float16"),
                                     key_cache=k, value_cache=v, slot_mapping=ints(7))

    def test_sglang_argument_is_read_by_its_fields(self):
        s = Serving()
        q, kk, v = FakeCuda((7, 4 * 64), "bfloat16"), FakeCuda((7, 2 * 64), "bfloat16"), FakeCuda((7, 128), "bfloat16")
        pool = FakeCuda((100, 2 * 64), "bfloat16")
        with pytest.raises(TypeError, match="fused_set_kv_buffer_arg must have value, k_buffer"):
            rope_rs.apply_rope_with_cos_sin_cache_inplace(s.ids, q, kk, 64, s.cache, True, object())
        arg = rope_rs.FusedSetKVBufferArg(v, pool, FakeCuda((100, 128), "bfloat16"), 0.5, None, ints(7))
        with pytest.raises(ValueError, match="fused_set_kv_buffer_arg.k_scale must be None"):
            rope_rs.apply_rope_with_cos_sin_cache_inplace(s.ids, q, kk, 64, s.cache, True, arg)
        narrow = FakeCuda((100, 100), "bfloat16")
        arg = rope_rs.FusedSetKVBufferArg(v, narrow, narrow, None, None, ints(7))
        with pytest.raises(ValueError, match="fused_set_kv_buffer_arg.k_buffer rows of 100 elements are not whole heads"):
            rope_rs.apply_rope_with_cos_sin_cache_inplace(s.ids, q, kk, 64, s.cache, True, arg)


class Mla:
    """Fake tensors of vLLM's MLA step: 7 tokens, 16 heads of q_pe of 64, kv_c of 512, an FP8
    kv_cache [3, 16, 576]."""

    t, h, r, rank = 7, 16, 64, 512

    def __init__(self):
        self.q_pe = FakeCuda((self.t, self.h, self.r), "bfloat16")
        self.k_pe = FakeCuda((self.t, self.r), "bfloat16")
        self.kv_c = FakeCuda((self.t, self.rank), "bfloat16")
        self.cache = FakeCuda((4096, self.r), "float32")
        self.kv_cache = FakeCuda((3, 16, self.rank + self.r), "uint8")
        self.scale = FakeCuda((1,), "float32")

    def call(self, **kw):
        args = dict(
            positions=ints(self.t), q_pe=self.q_pe, k_pe=self.k_pe, kv_c=self.kv_c, cos_sin_cache=self.cache,
            is_neox=True, slot_mapping=ints(self.t), kv_cache=self.kv_cache, kv_cache_dtype="fp8",
            kv_cache_scale=self.scale,
        )
        args.update(kw)
        rope_rs.concat_and_cache_mla_rope_fused(**args)


class TestMlaArguments:
    """vLLM's ``concat_and_cache_mla_rope_fused`` checks its arguments before the device, naming
    them as vLLM does."""

    def test_the_cache_type_follows_kv_cache_dtype(self):
        m = Mla()
        with pytest.raises(ValueError, match=r'^kv_cache must be bfloat16 \(kv_cache_dtype="auto"\), got uint8'):
            m.call(kv_cache_dtype="auto")
        with pytest.raises(ValueError, match="kv_cache_dtype must be"):
            m.call(kv_cache_dtype="fp8_e3m4")

    def test_the_cache_holds_fp8_rows_wide_enough_for_both_parts(self):
        m = Mla()
        with pytest.raises(ValueError, match=r"^kv_cache must be uint8 or float8_e4m3fn \(the FP8 format asked\), got bfloat16"):
            m.call(kv_cache=FakeCuda((3, 16, 576), "bfloat16"))
        with pytest.raises(ValueError, match=r"^kv_cache rows hold 500 elements: no room after the 512 latent features \(kv_c's\)"):
            m.call(kv_cache=FakeCuda((3, 16, 500), "uint8"))
        with pytest.raises(ValueError, match=r"^kv_cache must be \[max_pages, page_size, dim\]"):
            m.call(kv_cache=FakeCuda((3, 16, 1, 576), "uint8"))
        strided = FakeCuda((3, 16, 576), "uint8", strides=(16 * 1152, 1152, 2))
        with pytest.raises(ValueError, match="^kv_cache must have a contiguous last dimension"):
            m.call(kv_cache=strided)

    def test_scale_slots_and_inputs_are_named(self):
        m = Mla()
        with pytest.raises(ValueError, match="^kv_cache_scale must be float32, got float16"):
            m.call(kv_cache_scale=FakeCuda((1,), "float16"))
        with pytest.raises(ValueError, match="^slot_mapping must be one-dimensional"):
            m.call(slot_mapping=FakeCuda((7, 1), "int64"))
        with pytest.raises(ValueError, match="^k_pe is float16, q_pe is bfloat16"):
            m.call(k_pe=FakeCuda((7, 64), "float16"))
        with pytest.raises(ValueError, match="^kv_c must be bfloat16"):
            m.call(kv_c=FakeCuda((7, 512), "float32"))
        with pytest.raises(ValueError, match="^kv_c must be a tensor"):
            m.call(kv_c=object())

    @pytest.mark.skipif(has_driver(), reason="a valid call would launch on the fake addresses")
    def test_a_valid_call_reaches_the_driver(self):
        with pytest.raises(RuntimeError, match="no CUDA driver"):
            Mla().call()
        with pytest.raises(RuntimeError, match="no CUDA driver"):
            Mla().call(kv_cache=FakeCuda((3, 16, 576), "float8_e4m3fn"), kv_cache_dtype="fp8_e4m3", is_neox=False)
        # "auto": a cache of the tensors' type; the scale is not read (vLLM's rule).
        with pytest.raises(RuntimeError, match="no CUDA driver"):
            Mla().call(kv_cache=FakeCuda((3, 16, 576), "bfloat16"), kv_cache_dtype="auto",
                       kv_cache_scale=FakeCuda((1,), "float16"))


class TestDualChunk:
    """vLLM's ``DualChunkRotaryEmbedding``: its sizes are checked when made, and it takes
    ``torch.Tensor``s only."""

    def test_sizes_vllm_could_not_serve_are_refused(self):
        make = rope_rs.DualChunkRotaryEmbedding
        assert make(128, 64, 32768, 1e6, True, None, chunk_size=8192, local_size=1024).chunk_len == 7168
        with pytest.raises(ValueError, match=r"local_size must lie in \[0, chunk_size\)"):
            make(128, 128, 32768, 1e6, True, None, chunk_size=1024, local_size=1024)
        with pytest.raises(ValueError, match="rotary_dim must be even"):
            make(128, 130, 32768, 1e6, True, None, chunk_size=8192, local_size=1024)
        with pytest.raises(ValueError, match="max_position_embeddings must be positive"):
            make(128, 128, 0, 1e6, True, None, chunk_size=8192, local_size=1024)

    def test_other_tensors_are_type_errors(self):
        rope = rope_rs.DualChunkRotaryEmbedding(64, 64, 4096, 1e4, True, None, 256, 32)
        with pytest.raises(TypeError, match="must be torch.Tensors"):
            rope(ints(7), FakeCuda((7, 4 * 64), "bfloat16"), FakeCuda((7, 64), "bfloat16"))


class TestMRotaryEmbedding:
    """vLLM's ``MRotaryEmbedding``: what vLLM's class asserts is refused when made, and it takes
    ``torch.Tensor``s only."""

    def test_sections_vllm_asserts_are_checked(self):
        make = rope_rs.MRotaryEmbedding
        assert make(128, 128, 32768, 1e6, True, None, [16, 24, 24], True).mrope_section == [16, 24, 24]
        with pytest.raises(ValueError, match=r"mrope_section must be three pair counts summing to rotary_dim / 2 = 64"):
            make(128, 128, 32768, 1e6, True, None, [16, 24, 16])
        with pytest.raises(ValueError, match="mrope_section must be three pair counts"):
            make(128, 128, 32768, 1e6, True, None, [32, 32])
        with pytest.raises(ValueError, match="rotary_dim must be even"):
            make(128, 129, 32768, 1e6, True, None)
        with pytest.raises(ValueError, match="max_position_embeddings must be positive"):
            make(128, 128, 0, 1e6, True, None)

    def test_other_tensors_are_type_errors(self):
        rope = rope_rs.MRotaryEmbedding(64, 64, 4096, 1e4, True, None, [8, 12, 12])
        with pytest.raises(TypeError, match="must be torch.Tensors"):
            rope(FakeCuda((3, 7), "int64"), FakeCuda((7, 4 * 64), "bfloat16"), FakeCuda((7, 64), "bfloat16"))


class TestFourierRotaryEmbedding:
    """vLLM's ``FourierRotaryEmbedding``: sizes vLLM's class could not serve are refused when
    made, and it takes ``torch.Tensor``s only."""

    def test_sizes_are_checked(self):
        make = rope_rs.FourierRotaryEmbedding
        assert make(128, 128, 4096, 1e4, True, None, True, 8, None, True, 0.0).num_key_value_heads == 8
        with pytest.raises(ValueError, match="rotary_dim must be even"):
            make(128, 127, 4096, 1e4, True, None, True, 8, None, True, 0.0)
        with pytest.raises(ValueError, match="num_key_value_heads must be positive"):
            make(128, 128, 4096, 1e4, True, None, True, 0, None, True, 0.0)
        with pytest.raises(ValueError, match=r"num_inv_freq must lie in 1..=64, got 65"):
            make(128, 128, 4096, 1e4, True, None, True, 8, 65, True, 0.0)

    def test_other_tensors_are_type_errors(self):
        rope = rope_rs.FourierRotaryEmbedding(64, 64, 4096, 1e4, True, None, True, 2, None, True, 0.0)
        with pytest.raises(TypeError, match="must be torch.Tensors"):
            rope.set_coefficients(FakeCuda((2, 16, 16)), FakeCuda((2, 16, 16)))
        with pytest.raises(TypeError, match="must be torch.Tensors"):
            rope(ints(7), FakeCuda((7, 4 * 64), "bfloat16"), FakeCuda((7, 2 * 64), "bfloat16"))


class TestImport:
    def test_imports_without_torch(self):
        code = "import sys, rope_rs; assert 'torch' not in sys.modules, 'rope_rs imported torch'"
        subprocess.run([sys.executable, "-c", code], check=True)

    def test_api_and_docs(self):
        assert rope_rs.__version__
        for name in rope_rs.__all__:
            assert getattr(rope_rs, name).__doc__ or name == "__version__", name
        for name in ("apply_rope", "rotary_embedding", "apply_rope_with_cos_sin_cache_inplace", "fused_qk_norm_rope", "frequencies"):
            assert getattr(rope_rs._native, name).__doc__, name
        assert "stream" in rope_rs.apply_rope.__doc__
        assert "rope_type" in rope_rs._native.SCALING_KEYS


class TestTensors:
    def test_qk_norm_rope_takes_torch_tensors_only(self):
        np = numpy()
        x = np.zeros((4, 2, 64), dtype=np.float32)
        w = np.ones(64, dtype=np.float32)
        with pytest.raises(TypeError, match=r"qk_norm_rope: q must be a torch.Tensor, got ndarray"):
            rope_rs.qk_norm_rope(x, x, w, w, np.zeros((8, 64), dtype=np.float32), np.zeros(4, dtype=np.int64))

    def test_cpu_tensor_is_a_value_error_naming_q(self):
        np = numpy()
        q = np.zeros((2, 8, 4, 16), dtype=np.float32)
        for inplace in (True, False):  # out of place: numpy's empty_like, then the check
            with pytest.raises(ValueError, match=r"q must be a CUDA tensor \(DLPack device type 2\), got CPU"):
                rope_rs.apply_rope(q, inplace=inplace)

    def test_cpu_k_is_named(self):
        np = numpy()
        with pytest.raises(ValueError, match=r"^k must be a CUDA tensor .* got CPU"):
            rope_rs.apply_rope(q4(), np.zeros((2, 16, 2, 64), dtype=np.float32), inplace=True)

    def test_non_dlpack_objects_are_type_errors(self):
        for inplace in (True, False):
            with pytest.raises(TypeError, match="q must be a tensor supporting DLPack"):
                rope_rs.apply_rope([[1.0, 2.0]], inplace=inplace)
        with pytest.raises(TypeError, match="query must be a tensor supporting DLPack"):
            rope_rs.rotary_embedding(None, "query", None, 8, None, True)
        with pytest.raises(TypeError, match='did not return an unused "dltensor" capsule'):
            rope_rs.apply_rope(NotACapsule(), inplace=True)

    def test_out_of_place_needs_a_namespace_or_out(self):
        with pytest.raises(TypeError, match="out: an out-of-place call on FakeCuda needs out="):
            rope_rs.apply_rope(q4())
        with pytest.raises(ValueError, match="out: inplace=True rotates q and k themselves"):
            rope_rs.apply_rope(q4(), out=q4(), inplace=True)

    def test_dtypes_must_match(self):
        with pytest.raises(ValueError, match="q must be float32, float16 or bfloat16, got float64"):
            rope_rs.apply_rope(q4("float64"), inplace=True)
        with pytest.raises(ValueError, match="k is bfloat16, q is float32"):
            rope_rs.apply_rope(q4(), FakeCuda((2, 16, 2, 64), "bfloat16"), inplace=True)
        with pytest.raises(ValueError, match="out is float16, q is float32"):
            rope_rs.apply_rope(q4(), out=q4("float16"))
        with pytest.raises(ValueError, match="k_out: given without k"):
            rope_rs.apply_rope(q4(), out=q4(), k_out=q4())

    def test_devices_must_match(self):
        with pytest.raises(ValueError, match="k is on CUDA device 1, the tensors to rotate on device 0"):
            rope_rs.apply_rope(q4(), FakeCuda((2, 16, 2, 64), device=1), inplace=True)
        with pytest.raises(ValueError, match="position_ids is on CUDA device 3"):
            rope_rs.apply_rope(q4(), position_ids=FakeCuda((16,), "int64", device=3), inplace=True)

    def test_layouts_and_strides(self):
        with pytest.raises(ValueError, match=r'q must be \[batch, heads, seq, head_dim\] for layout "bhsd"'):
            rope_rs.apply_rope(FakeCuda((16, 4, 64)), layout="bhsd", inplace=True)
        with pytest.raises(ValueError, match='layout must be "bshd", "sbhd", "bhsd" or "thd"'):
            rope_rs.apply_rope(q4(), layout="bsd", inplace=True)
        strided = FakeCuda((16, 4, 64), strides=(512, 128, 2))
        with pytest.raises(ValueError, match="q must have a contiguous last dimension"):
            rope_rs.apply_rope(strided, inplace=True)
        with pytest.raises(ValueError, match="head_dim"):
            rope_rs.apply_rope(FakeCuda((16, 4, 7)), inplace=True)
        with pytest.raises(ValueError, match="rotary_dim"):
            rope_rs.apply_rope(q4(), rotary_dim=66, inplace=True)
        with pytest.raises(ValueError, match="rotary_dim"):
            rope_rs.apply_rope(q4(), rotary_dim=7, inplace=True)

    def test_vllm_rows_are_whole_heads(self):
        query = FakeCuda((8, 4 * 64), "bfloat16")
        cache = FakeCuda((4096, 64), "float32")
        with pytest.raises(ValueError, match="query rows of 256 elements are not whole heads of head_size 48"):
            rope_rs.rotary_embedding(ints(8), query, None, 48, cache, True)
        with pytest.raises(ValueError, match="key is float32, query is bfloat16"):
            rope_rs.apply_rope_with_cos_sin_cache_inplace(ints(8), query, FakeCuda((8, 64)), 64, cache)


class TestPositions:
    def test_exclusive_arguments(self):
        q = q4()
        with pytest.raises(ValueError, match="positions: give positions .* or position_ids"):
            rope_rs.apply_rope(q, positions=3, position_ids=ints(16), inplace=True)
        with pytest.raises(ValueError, match="position_ids: give position_ids or cu_seqlens"):
            rope_rs.apply_rope(q, position_ids=ints(16), cu_seqlens=ints(3), inplace=True)
        with pytest.raises(ValueError, match="with cu_seqlens, give per-sequence offsets as a tensor"):
            rope_rs.apply_rope(q, positions=5, cu_seqlens=ints(3), inplace=True)
        with pytest.raises(ValueError, match="positions must be an offset in 0..2"):
            rope_rs.apply_rope(q, positions=-1, inplace=True)

    def test_context_parallel_splits_are_checked(self):
        q, packed = q4(), FakeCuda((16, 4, 64))
        with pytest.raises(ValueError, match="cp_size: a context-parallel split needs cu_seqlens"):
            rope_rs.apply_rope(q, cp_size=2, inplace=True)
        with pytest.raises(ValueError, match="cp_size: with a context-parallel split, positions come from cu_seqlens"):
            rope_rs.apply_rope(packed, positions=ints(2), cu_seqlens=ints(3), cp_size=2, inplace=True)
        with pytest.raises(ValueError, match="cp_rank: must be below cp_size 4, got 4"):
            rope_rs.apply_rope(packed, cu_seqlens=ints(3), cp_size=4, cp_rank=4, inplace=True)
        with pytest.raises(ValueError, match="cp_size: must lie in 1..=65536, got 0"):
            rope_rs.apply_rope(packed, cu_seqlens=ints(3), cp_size=0, inplace=True)

    def test_mrope_arguments_are_checked(self):
        q, axes = q4(), FakeCuda((3, 2, 16), "int64")
        with pytest.raises(ValueError, match="mrope_section must have three entries"):
            rope_rs.apply_rope(q, position_ids=axes, mrope_section=[16, 16], inplace=True)
        with pytest.raises(ValueError, match="mrope_section: per-axis positions come from position_ids"):
            rope_rs.apply_rope(q, positions=3, mrope_section=[8, 12, 12], inplace=True)
        with pytest.raises(ValueError, match="mrope_interleaved: given without mrope_section"):
            rope_rs.apply_rope(q, position_ids=ints(16), mrope_interleaved=True, inplace=True)
        with pytest.raises(ValueError, match=r"position_ids must be \[3, batch, seq\] or \[3, tokens\]"):
            rope_rs.apply_rope(q, position_ids=FakeCuda((2, 16), "int64"), mrope_section=[8, 12, 12], inplace=True)
        with pytest.raises(ValueError, match=r"position_ids must be int32 or int64, got float32"):
            rope_rs.apply_rope(q, position_ids=FakeCuda((3, 2, 16)), mrope_section=[8, 12, 12], inplace=True)
        # Heads of 64: 32 pairs, which the sections must sum to.
        with pytest.raises(ValueError, match=r"mrope_section: \[8, 8, 8\] sums to 24, rotary_dim / 2 is 32"):
            rope_rs.apply_rope(q, position_ids=axes, mrope_section=[8, 8, 8], inplace=True)
        with pytest.raises(ValueError, match=r"mrope_section: \[8, 8, 8\] sums to 24"):
            rope_rs.apply_rope(q, position_ids=axes, mrope_section=[8, 8, 8], mrope_interleaved=True, inplace=True)

    def test_axial_arguments_are_checked(self):
        q, axes = q4(), FakeCuda((3, 2, 16), "int64")
        with pytest.raises(ValueError, match="axes_dim: give mrope_section or axes_dim, not both"):
            rope_rs.apply_rope(q, position_ids=axes, mrope_section=[8, 12, 12], axes_dim=[16, 24, 24], inplace=True)
        with pytest.raises(ValueError, match="axes_dim must have 1 to 4 entries"):
            rope_rs.apply_rope(q, position_ids=axes, axes_dim=[8] * 8, inplace=True)
        with pytest.raises(ValueError, match=r"axes_dim: per-axis positions come from position_ids, \[2, batch, seq\]"):
            rope_rs.apply_rope(q, positions=4, axes_dim=[32, 32], inplace=True)
        with pytest.raises(ValueError, match=r"position_ids must be \[2, batch, seq\] or \[2, tokens\]"):
            rope_rs.apply_rope(q, position_ids=axes, axes_dim=[32, 32], inplace=True)
        with pytest.raises(ValueError, match="scaling: not with axes_dim"):
            rope_rs.apply_rope(q, position_ids=axes, axes_dim=[16, 24, 24], scaling={"rope_type": "linear", "factor": 2.0}, inplace=True)
        # Widths that are not even name axes_dim.
        with pytest.raises(ValueError, match="^axes_dim: every axis needs an even, nonzero width"):
            rope_rs.apply_rope(q, position_ids=axes, axes_dim=[15, 25, 24], inplace=True)

    def test_wrong_types(self):
        q = q4()
        with pytest.raises(TypeError, match="positions must be an int"):
            rope_rs.apply_rope(q, positions="zero", inplace=True)
        with pytest.raises(TypeError, match="positions must be an int"):
            rope_rs.apply_rope(q, positions=True, inplace=True)
        with pytest.raises(TypeError):
            rope_rs.apply_rope(q, backward="yes", inplace=True)

    def test_position_tensors_are_checked(self):
        q = q4()
        with pytest.raises(ValueError, match="positions must be int32 or int64, got float32"):
            rope_rs.apply_rope(q, positions=FakeCuda((2,), "float32"), inplace=True)
        with pytest.raises(ValueError, match=r"positions must be one-dimensional \[batch\]"):
            rope_rs.apply_rope(q, positions=FakeCuda((2, 1), "int32"), inplace=True)
        with pytest.raises(ValueError, match=r"cu_seqlens must be one-dimensional \[num_seqs \+ 1\]"):
            rope_rs.apply_rope(FakeCuda((16, 4, 64)), cu_seqlens=FakeCuda((2, 3), "int32"), inplace=True)
        with pytest.raises(ValueError, match="position_ids must be contiguous"):
            rope_rs.apply_rope(q, position_ids=FakeCuda((2, 16), "int64", strides=(1, 2)), inplace=True)


class TestSinCos:
    def test_exclusive_sources(self):
        q, cache = q4(), FakeCuda((4096, 64))
        with pytest.raises(ValueError, match="cos and sin: give both tables or neither"):
            rope_rs.apply_rope(q, cos=FakeCuda((4096, 32)), inplace=True)
        with pytest.raises(ValueError, match="give one sin/cos source"):
            rope_rs.apply_rope(q, cos_sin_cache=cache, inv_freq=[1.0] * 32, inplace=True)
        with pytest.raises(ValueError, match=r"theta: unused with cos_sin_cache"):
            rope_rs.apply_rope(q, cos_sin_cache=cache, theta=1e4, inplace=True)
        with pytest.raises(ValueError, match="theta: unused with inv_freq"):
            rope_rs.apply_rope(q, inv_freq=[1.0] * 32, theta=1e4, inplace=True)
        with pytest.raises(ValueError, match="attention_factor: give it inside scaling"):
            rope_rs.apply_rope(q, scaling={"rope_type": "linear", "factor": 2}, attention_factor=1.2, inplace=True)
        with pytest.raises(ValueError, match="attention_factor: only with inv_freq"):
            rope_rs.apply_rope(q, attention_factor=1.2, inplace=True)
        with pytest.raises(ValueError, match="attention_factor must lie in"):
            rope_rs.apply_rope(q, inv_freq=[1.0] * 32, attention_factor=0.0, inplace=True)
        with pytest.raises(ValueError, match='angle must be "exact" or "f32"'):
            rope_rs.apply_rope(q, angle="f16", inplace=True)
        with pytest.raises(ValueError, match='style must be "neox" or "interleaved"'):
            rope_rs.apply_rope(q, style="llama", inplace=True)

    def test_tables_are_checked(self):
        q = q4("bfloat16")
        with pytest.raises(ValueError, match="cos_sin_cache must be float32, float16 or bfloat16, got int32"):
            rope_rs.apply_rope(q, cos_sin_cache=FakeCuda((4096, 64), "int32"), inplace=True)
        with pytest.raises(ValueError, match="cos_sin_cache must be float32 or the tensors' bfloat16, got float16"):
            rope_rs.apply_rope(q, cos_sin_cache=FakeCuda((4096, 64), "float16"), inplace=True)
        with pytest.raises(ValueError, match=r"sin is float32 \[4096, 16\], cos is float32 \[4096, 32\]"):
            rope_rs.apply_rope(q, cos=FakeCuda((4096, 32)), sin=FakeCuda((4096, 16)), inplace=True)
        with pytest.raises(ValueError, match="inv_freq on the device must be float64"):
            rope_rs.apply_rope(q, inv_freq=FakeCuda((32,), "float32"), inplace=True)
        with pytest.raises(TypeError, match="inv_freq must be a CUDA float64 tensor or a sequence of floats"):
            rope_rs.apply_rope(q, inv_freq="fast", inplace=True)

    def test_invalid_frequencies_name_their_argument(self):
        q = q4()
        with pytest.raises(ValueError, match="theta: must be finite and positive"):
            rope_rs.apply_rope(q, theta=-1.0, inplace=True)
        with pytest.raises(ValueError, match=r"scaling: factor must lie in \[2\^-20, 2\^20\]"):
            rope_rs.apply_rope(q, scaling={"rope_type": "linear", "factor": 0.0}, inplace=True)
        with pytest.raises(ValueError, match='scaling: unknown key "facter"'):
            rope_rs.apply_rope(q, scaling={"rope_type": "linear", "facter": 2}, inplace=True)
        with pytest.raises(TypeError, match="scaling must be a dict"):
            rope_rs.apply_rope(q, scaling=[("rope_type", "linear")], inplace=True)

    @pytest.mark.skipif(has_driver(), reason="a valid call would launch on the fake addresses")
    def test_a_valid_call_reaches_the_driver(self):
        with pytest.raises(RuntimeError, match="no CUDA driver"):
            rope_rs.apply_rope(q4(), FakeCuda((2, 16, 2, 64)), position_ids=FakeCuda((2, 16), "int32"), inplace=True)


def default_inv_freq(theta, r):
    return [theta ** (-2.0 * i / r) for i in range(r // 2)]


class TestFrequencies:
    """The host-side frequencies against the published formulas (Hugging Face's, in float64)."""

    def test_default_and_partial(self):
        f, a = rope_rs.frequencies(128, theta=500000.0)
        assert a == 1.0
        close(f, default_inv_freq(500000.0, 128), 1e-15)
        f, _ = rope_rs.frequencies(128, scaling={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25})
        close(f, default_inv_freq(1e4, 32), 1e-15)
        f, _ = rope_rs.frequencies(128, rotary_dim=64, angle="f32")
        assert len(f) == 32

    def test_linear_and_dynamic(self):
        f, _ = rope_rs.frequencies(64, scaling={"rope_type": "linear", "factor": 4.0})
        close(f, [v / 4 for v in default_inv_freq(1e4, 64)], 1e-15)
        d, factor, max_pos, seq_len = 64, 2.0, 4096, 10000
        scaling = {"rope_type": "dynamic", "factor": factor, "max_position_embeddings": max_pos}
        f, _ = rope_rs.frequencies(d, scaling=scaling)
        close(f, default_inv_freq(1e4, d), 1e-15)
        f, _ = rope_rs.frequencies(d, scaling={**scaling, "seq_len": seq_len})
        base = 1e4 * ((factor * seq_len / max_pos) - (factor - 1)) ** (d / (d - 2))
        close(f, default_inv_freq(base, d), 1e-13)

    def test_llama3(self):
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        f, a = rope_rs.frequencies(128, theta=500000.0, scaling=scaling)
        want = []
        for base in default_inv_freq(500000.0, 128):
            wavelen = 2 * math.pi / base
            if wavelen < 8192 / 4.0:
                want.append(base)
            elif wavelen > 8192 / 1.0:
                want.append(base / 8.0)
            else:
                smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
                want.append((1 - smooth) * base / 8.0 + smooth * base)
        close(f, want, 1e-14)
        assert a == 1.0

    def test_yarn(self):
        d, theta, factor, original = 64, 1e4, 16.0, 4096
        f, a = rope_rs.frequencies(
            d, theta=theta, scaling={"type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        )
        assert a == pytest.approx(0.1 * math.log(factor) + 1.0, rel=1e-15)

        def correction_dim(rotations):
            return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = max(math.floor(correction_dim(32)), 0), min(math.ceil(correction_dim(1)), d - 1)
        want = []
        for i, extrapolation in enumerate(default_inv_freq(theta, d)):
            ramp = min(max((i - low) / (high - low), 0.0), 1.0)
            want.append(extrapolation / factor * ramp + extrapolation * (1 - ramp))
        close(f, want, 1e-14)
        # DeepSeek's mscale form: equal mscale and mscale_all_dim give 1.
        _, a = rope_rs.frequencies(
            d,
            scaling={"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        )
        assert a == 1.0

    def test_ntk(self):
        # vLLM's NTKScalingRotaryEmbedding, with gte-multilingual's {"type": "ntk", "factor": 8}
        # (rope_theta 20000, head_dim 64): the frequencies of base theta * factor divided by
        # factor ** (2 / d); with mixed_b, those of theta divided by exp(a * m ** mixed_b).
        d, theta, factor = 64, 20000.0, 8.0
        f, a = rope_rs.frequencies(d, theta=theta, scaling={"type": "ntk", "factor": factor})
        close(f, [b / factor ** (2 / d) for b in default_inv_freq(theta * factor, d)], 1e-14)
        assert a == 1.0
        mixed_b = 0.75
        f, _ = rope_rs.frequencies(d, theta=theta, scaling={"type": "ntk", "factor": factor, "mixed_b": mixed_b})
        slope = math.log(factor) / (d / 2) ** mixed_b
        want = [b / math.exp(slope * (i + 1) ** mixed_b) for i, b in enumerate(default_inv_freq(theta, d))]
        close(f, want, 1e-14)

    def test_proportional(self):
        # transformers' _compute_proportional_rope_parameters with Gemma 4's full-attention
        # layers' rope_parameters (global_head_dim 512): the first int(0.25 * 512 // 2) = 64
        # pairs take the whole head's default frequencies, the other 192 zero.
        d = 512
        f, a = rope_rs.frequencies(d, scaling={"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6})
        assert len(f) == d // 2 and a == 1.0
        close(f[:64], default_inv_freq(1e6, d)[:64], 1e-15)
        assert list(f[64:]) == [0.0] * 192

    def test_longrope(self):
        d = 32
        short, long = [1.0 + i / 16 for i in range(d // 2)], [2.0 + i / 8 for i in range(d // 2)]
        scaling = {
            "rope_type": "longrope",
            "short_factor": short,
            "long_factor": long,
            "original_max_position_embeddings": 4096,
            "max_position_embeddings": 131072,
        }
        base = default_inv_freq(1e4, d)
        f, a = rope_rs.frequencies(d, scaling=scaling)
        close(f, [b / e for b, e in zip(base, short)], 1e-15)
        assert a == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-15)
        f, _ = rope_rs.frequencies(d, scaling={**scaling, "seq_len": 4097})
        close(f, [b / e for b, e in zip(base, long)], 1e-15)

    def test_scaling_errors(self):
        with pytest.raises(ValueError, match="scaling: llama3 needs low_freq_factor"):
            rope_rs.frequencies(128, scaling={"rope_type": "llama3", "factor": 8.0})
        with pytest.raises(TypeError, match='scaling: entry "factor" must be a number, got a str'):
            rope_rs.frequencies(128, scaling={"rope_type": "linear", "factor": "8"})
        with pytest.raises(ValueError, match='rope_type must be "default"'):
            rope_rs.frequencies(128, scaling={"rope_type": "ntk_by_parts"})
        with pytest.raises(ValueError, match="scaling: ntk needs factor"):
            rope_rs.frequencies(128, scaling={"rope_type": "ntk"})
        with pytest.raises(ValueError, match="scaling: longrope needs short_factor"):
            rope_rs.frequencies(128, scaling={"rope_type": "longrope", "original_max_position_embeddings": 4096, "factor": 2})
        with pytest.raises(ValueError, match="short_factor has 2 entries, rotary_dim / 2 is 64"):
            rope_rs.frequencies(
                128,
                scaling={
                    "rope_type": "longrope",
                    "short_factor": [1, 1],
                    "long_factor": [1, 1],
                    "original_max_position_embeddings": 4096,
                    "factor": 2,
                },
            )


class TestCapsules:
    def test_capsule_is_released_and_stream_is_passed(self):
        np = numpy()
        array = np.zeros((8, 4, 16), dtype=np.float32)
        q = PretendCuda(array)
        before = sys.getrefcount(array)
        for _ in range(100):
            with pytest.raises(ValueError):
                rope_rs.apply_rope(q, stream=1234, inplace=True)
        # numpy's capsule holds a reference to the array until its deleter runs: none leaked.
        assert sys.getrefcount(array) == before
        # Stream 0 (the legacy default stream) is passed to the producer as DLPack's 1.
        assert q.streams[0] == 1234
        with pytest.raises(ValueError):
            rope_rs.apply_rope(q, inplace=True)
        assert q.streams[-1] == 1

    def test_every_tensor_is_asked_for_the_launch_stream(self):
        q, k, out, ids = q4(), FakeCuda((2, 16, 2, 64)), q4(), FakeCuda((16,), "float32")
        with pytest.raises(ValueError, match="position_ids must be int32 or int64"):
            rope_rs.apply_rope(q, k, out=out, k_out=FakeCuda((2, 16, 2, 64)), position_ids=ids, stream=77)
        assert [t.streams for t in (q, k, out, ids)] == [[77]] * 4


# A fake producer of DLPack's C exchange API (`__dlpack_c_exchange_api__`, DLPack 1.3): the
# table of dlpack.h built with ctypes, its functions Python callbacks. It describes the same
# fake CUDA tensors as FakeCuda, so both borrowing paths can be compared without a GPU.


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLPackExchangeAPIHeader(ctypes.Structure):
    pass


DLPackExchangeAPIHeader._fields_ = [
    ("version", DLPackVersion),
    ("prev_api", ctypes.POINTER(DLPackExchangeAPIHeader)),
]

DLTENSOR_FROM_PY_OBJECT_NO_SYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(DLTensor))
CURRENT_WORK_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p))


class DLPackExchangeAPI(ctypes.Structure):
    _fields_ = [
        ("header", DLPackExchangeAPIHeader),
        ("managed_tensor_allocator", ctypes.c_void_p),
        ("managed_tensor_from_py_object_no_sync", ctypes.c_void_p),
        ("managed_tensor_to_py_object_no_sync", ctypes.c_void_p),
        ("dltensor_from_py_object_no_sync", DLTENSOR_FROM_PY_OBJECT_NO_SYNC),
        ("current_work_stream", CURRENT_WORK_STREAM),
    ]


_EXCHANGE = b"dlpack_exchange_api"  # the capsule keeps a pointer to this name
_LIVE = {}  # id(obj) -> obj, for the callbacks (CPython's id is the PyObject* they receive)
FAKE_STREAM = 0x5000


def _fill(obj_ptr, out):
    obj = _LIVE.get(obj_ptr)
    if obj is None or obj.fail:
        return -1  # (without an exception set: rope_rs must cope with that too)
    obj.fast_calls += 1
    ndim = len(obj.shape)
    shape = (ctypes.c_int64 * ndim)(*obj.shape)
    strides = (ctypes.c_int64 * ndim)(*(obj.strides or row_major(obj.shape)))
    obj.keep.append((shape, strides))  # alive as long as the object, as the API promises
    code, bits = DTYPES[obj.dtype]
    out[0] = DLTensor(obj.ptr, DLDevice(2, obj.device), ndim, DLDataType(code, bits, 1), shape, strides, 0)
    return 0


def _stream(device_type, device_id, out):
    out[0] = FAKE_STREAM + device_id if device_type == 2 else None
    return 0


_FILL = DLTENSOR_FROM_PY_OBJECT_NO_SYNC(_fill)
_STREAM = CURRENT_WORK_STREAM(_stream)


def row_major(shape):
    strides, n = [], 1
    for extent in reversed(shape):
        strides.append(n)
        n *= max(extent, 1)
    return tuple(reversed(strides))


def exchange_type(major=1, fill=True, prev=None):
    """A FakeCuda subclass whose type holds an exchange table of version `major`.1 (linking to
    the table `prev`), with `dltensor_from_py_object_no_sync` unless not `fill`."""
    api = DLPackExchangeAPI()
    api.header.version = DLPackVersion(major, 3)
    if prev is not None:
        api.header.prev_api = ctypes.pointer(prev.api.header)
    if fill:
        api.dltensor_from_py_object_no_sync = _FILL
    api.current_work_stream = _STREAM

    class FastCuda(FakeCuda):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.fast_calls, self.fail = 0, False
            _LIVE[id(self)] = self

    FastCuda.api = api  # kept alive with the type, as a producer's static table
    FastCuda.__dlpack_c_exchange_api__ = _capsule_new(ctypes.addressof(api), _EXCHANGE, None)
    return FastCuda


FastCuda = exchange_type()


class TestExchangeApi:
    def test_the_table_has_the_headers_layout(self):
        assert ctypes.sizeof(DLPackExchangeAPIHeader) == 16
        assert ctypes.sizeof(DLPackExchangeAPI) == 56
        assert DLPackExchangeAPI.dltensor_from_py_object_no_sync.offset == 40
        assert DLPackExchangeAPI.current_work_stream.offset == 48

    def test_the_fast_path_reads_what_dlpack_reads(self):
        for shape, strides, dtype in (
            ((2, 16, 4, 64), None, "float32"),
            ((6, 4, 8), (64, 8, 1), "bfloat16"),
            ((1, 5, 1, 8), (40, 8, 8, 1), "float16"),
            ((9,), None, "int64"),
            ((0, 3), None, "int32"),
        ):
            t = FastCuda(shape, dtype, strides=strides, device=1)
            before = rope_rs._native._exchange_borrows()
            fast = rope_rs._native._dlpack_view(t, producer_sync=False)
            assert rope_rs._native._exchange_borrows() == before + 1
            assert (t.fast_calls, t.streams) == (1, [])
            slow = rope_rs._native._dlpack_view(t, producer_sync=True)
            assert t.streams == [1]  # producer_sync: __dlpack__(stream=) as before
            assert fast == slow == (t.ptr, dtype, list(shape), list(strides or row_major(shape)), 1)

    def test_launch_checks_are_the_same_on_both_paths(self):
        for sync in (True, False):
            q, k, out, ids = FastCuda((2, 16, 4, 64)), FastCuda((2, 16, 2, 64)), FastCuda((2, 16, 4, 64)), FastCuda((16,))
            with pytest.raises(ValueError, match="^position_ids must be int32 or int64, got float32"):
                rope_rs._native.apply_rope(q, k, out=out, position_ids=ids, producer_sync=sync)
            fast = [t.fast_calls for t in (q, k, out, ids)]
            assert fast == ([0] * 4 if sync else [1] * 4), sync
            with pytest.raises(ValueError, match="^k is bfloat16, q is float32"):
                rope_rs._native.apply_rope(q, FastCuda((2, 16, 2, 64), "bfloat16"), producer_sync=sync)
            with pytest.raises(ValueError, match="^q must have a contiguous last dimension"):
                rope_rs._native.apply_rope(FastCuda((2, 16, 4, 64), strides=(8192, 512, 128, 2)), producer_sync=sync)
            with pytest.raises(ValueError, match="^q has a negative stride -4096"):
                rope_rs._native.apply_rope(FastCuda((2, 16, 4, 64), strides=(-4096, 256, 64, 1)), producer_sync=sync)
            with pytest.raises(ValueError, match="^k is on CUDA device 1, the tensors to rotate on device 0"):
                rope_rs._native.apply_rope(q, FastCuda((2, 16, 2, 64), device=1), producer_sync=sync)

    def test_a_failing_producer_falls_back_to_dlpack(self):
        t = FastCuda((4, 8))
        t.fail = True
        assert rope_rs._native._dlpack_view(t, producer_sync=False)[2] == [4, 8]
        assert t.streams == [-1]  # __dlpack__(stream=-1): no synchronization, as asked

    def test_other_major_versions_and_missing_functions_fall_back(self):
        for cls in (exchange_type(major=2), exchange_type(major=0), exchange_type(fill=False)):
            t = cls((4, 8))
            assert not rope_rs._native._exchange_api_used(t)
            assert rope_rs._native._dlpack_view(t, producer_sync=False)[2] == [4, 8]
            assert (t.fast_calls, t.streams) == (0, [-1])
            assert rope_rs._native._current_stream(t) is None

    def test_a_newer_table_links_to_version_1(self):
        newer = exchange_type(major=2, prev=FastCuda)
        t = newer((4, 8))
        assert rope_rs._native._exchange_api_used(t)
        rope_rs._native._dlpack_view(t, producer_sync=False)
        assert (t.fast_calls, t.streams) == (1, [])

    def test_types_without_a_capsule_use_dlpack(self):
        class Wrong(FakeCuda):
            __dlpack_c_exchange_api__ = 12345  # an int (an early draft), not a capsule

        for t in (q4(), Wrong((4, 8))):
            assert not rope_rs._native._exchange_api_used(t)
            assert rope_rs._native._current_stream(t) is None
            rope_rs._native._dlpack_view(t, producer_sync=False)
            assert t.streams == [-1]

    def test_the_current_stream_is_the_producers(self):
        assert rope_rs._native._current_stream(FastCuda((4, 8), device=3)) == FAKE_STREAM + 3

    def test_it_can_be_switched_off(self):
        t = FastCuda((4, 8))
        assert rope_rs._native._exchange_api_used(t)
        assert rope_rs._native._set_exchange_api(False)
        try:
            assert not rope_rs._native._exchange_api_used(t)
            assert rope_rs._native._current_stream(t) is None
            rope_rs._native._dlpack_view(t, producer_sync=False)
            assert (t.fast_calls, t.streams) == (0, [-1])
        finally:
            assert not rope_rs._native._set_exchange_api(True)
        code = "import rope_rs, test_cpu; assert not rope_rs._native._exchange_api_used(test_cpu.FastCuda((4, 8)))"
        env = dict(os.environ, ROPE_RS_NO_DLPACK_C_API="1")
        subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=os.path.dirname(__file__))


class TestDitFrequencies:
    """``rope_rs.fused_qk_rmsnorm_rope``'s frequency table, as FlashInfer's host code builds it
    (``compute_adjusted_freq_host``): each axis's ``base ** (-2i / channels)``, frames then
    height then width, YaRN's blend with ``factor``; and its refusal of non-torch tensors."""

    def test_axes_in_order_each_of_its_own_width(self):
        from rope_rs.dit import axis_frequencies

        close(axis_frequencies((4, 2, 2), 10000.0, 1.0, 0.0, 0.0), [1.0, 0.01, 1.0, 1.0], 1e-15)

    def test_yarn_blend_divides_the_frequencies_past_low(self):
        from rope_rs.dit import axis_frequencies

        # i = 0 below the ramp keeps its frequency, i = 1 at its top is divided by the factor.
        close(axis_frequencies((4, 2, 2), 10000.0, 2.0, 0.0, 1.0), [1.0, 0.005, 1.0, 1.0], 1e-15)

    def test_refuses_other_than_torch_tensors(self):
        with pytest.raises(TypeError, match="qkv"):
            rope_rs.fused_qk_rmsnorm_rope(
                object(), None, None, ppf=1, pph=1, ppw=1, num_frame_channels=2, num_height_channels=2,
                num_width_channels=2, num_heads_q=1, num_heads_k=1, num_heads_v=1, head_dim=6,
            )
