"""Tests of rope_rs that need no GPU: import, argument checking, DLPack capsule handling."""

import sys

import numpy as np
import pytest

import rope_rs


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


def test_imports():
    assert rope_rs.__version__
    assert callable(rope_rs.apply_rope)
    assert callable(rope_rs.rotary_embedding)
    assert "stream" in rope_rs.apply_rope.__doc__


def test_cpu_tensor_is_a_value_error_naming_q():
    q = np.zeros((2, 8, 4, 16), dtype=np.float32)
    with pytest.raises(ValueError, match=r"q must be a CUDA tensor \(DLPack device type 2\), got CPU"):
        rope_rs.apply_rope(q)


def test_cpu_k_is_named():
    # q is checked first; a CUDA-looking q whose capsule is CPU memory is refused by its contents.
    q = PretendCuda(np.zeros((8, 4, 16), dtype=np.float32))
    with pytest.raises(ValueError, match=r"^q must be a CUDA tensor"):
        rope_rs.apply_rope(q, np.zeros((8, 4, 16), dtype=np.float32))


def test_non_dlpack_objects_are_type_errors():
    with pytest.raises(TypeError, match="q must be a tensor supporting DLPack"):
        rope_rs.apply_rope([[1.0, 2.0]])
    with pytest.raises(TypeError, match="query must be a tensor supporting DLPack"):
        rope_rs.rotary_embedding(None, "query", None, 8, None, True)
    with pytest.raises(TypeError, match='did not return an unused "dltensor" capsule'):
        rope_rs.apply_rope(NotACapsule())


def test_wrong_option_types_are_type_errors():
    q = np.zeros((8, 4, 16), dtype=np.float32)
    with pytest.raises(TypeError):
        rope_rs.apply_rope(q, positions="zero")
    with pytest.raises(TypeError):
        rope_rs.apply_rope(q, backward="yes")


def test_invalid_options_are_value_errors():
    q = np.zeros((8, 4, 16), dtype=np.float32)
    with pytest.raises(ValueError, match="style must be"):
        rope_rs.apply_rope(PretendCuda(q), style="llama")
    with pytest.raises(ValueError, match="positions must be an offset"):
        rope_rs.apply_rope(PretendCuda(q), positions=-1)
    with pytest.raises(ValueError, match="not both"):
        rope_rs.apply_rope(PretendCuda(q), positions=3, position_ids=q)


def test_capsule_is_released_and_stream_is_passed():
    array = np.zeros((8, 4, 16), dtype=np.float32)
    q = PretendCuda(array)
    before = sys.getrefcount(array)
    for _ in range(100):
        with pytest.raises(ValueError):
            rope_rs.apply_rope(q, stream=1234)
    # numpy's capsule holds a reference to the array until its deleter runs: none leaked.
    assert sys.getrefcount(array) == before
    # Stream 0 (the legacy default stream) is passed to the producer as DLPack's 1.
    assert q.streams[0] == 1234
    with pytest.raises(ValueError):
        rope_rs.apply_rope(q)
    assert q.streams[-1] == 1
