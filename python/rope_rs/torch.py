"""rope-rs for PyTorch: autograd, ``torch.compile``, CUDA graphs and Hugging Face's formula.

What it adds to the native call for ``torch.Tensor`` arguments:

- the launch goes to PyTorch's current stream of the tensors' device, and out-of-place outputs
  are allocated with ``torch.empty_like`` (so inside ``torch.cuda.graph`` they come from the
  graph's memory pool);
- ``RopeFunction``, a ``torch.autograd.Function`` whose backward is the transposed rotation
  (``backward=True``), used by :func:`apply_rope` when q or k requires grad;
- the custom operators ``torch.ops.rope_rs.rope``/``rope_qk`` (out of place, with autograd) and
  ``rope_``/``rope_qk_`` (in place), each with a fake implementation, used by :func:`apply_rope`
  under ``torch.compile``;
- :func:`apply_rotary_pos_emb`, Hugging Face's function of the same name on rope-rs's kernels;
- the in-place operators ``torch.ops.rope_rs.rotary_embedding_`` and ``fused_qk_norm_rope_``,
  which ``rope_rs.rotary_embedding``, ``apply_rope_with_cos_sin_cache_inplace`` and
  ``fused_qk_norm_rope`` (the serving drop-ins, with their KV-cache writes) become under
  ``torch.compile``, and ``rope_quantize_fp8_`` and ``rope_quantize_fp8_append_paged_kv_cache_``
  (FlashInfer's drop-ins); each marks every tensor it writes (outputs and caches) mutated.

Importing this module registers the custom operators, which imports ``torch.compile``'s
machinery (seconds in a fresh process). ``rope_rs.apply_rope`` does not import it for eager
calls: it dispatches ``torch.Tensor``s to ``rope_rs._torch_eager`` (everything here but the
operators), which imports this module only under ``torch.compile``. Import it yourself to call
``torch.ops.rope_rs.*`` directly or to load a program that holds them (``torch.export``).

Written for PyTorch 2.4 or newer (``torch.library.custom_op``), tested with 2.11.

``scaling=`` dicts reach the operators as JSON text, since custom operators take no dicts
(rope-host reads the text, computes the frequencies and keeps them on the device). Under
``torch.compile`` that conversion runs outside the graph (a graph break, an error with
``fullgraph=True``): pass ``inv_freq`` (a host list of floats, or the model's own ``inv_freq``
buffer with ``angle="f32"``) or ``theta`` there instead.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple, get_type_hints

import torch
from torch import Tensor

from rope_rs import _native
from rope_rs._torch_eager import (
    _TENSOR_FIELDS,
    Options,
    RopeFunction,
    _gradient,
    _launch,
    _rotated,
    _scaling_json,
    _stream,
    apply_rope,
    apply_rotary_pos_emb,
    options,
)

__all__ = ["apply_rope", "apply_rotary_pos_emb", "RopeFunction", "Options", "options"]

# `options`'s conversion of a `scaling=` dict, which torch.compile runs outside its graphs.
scaling_json_outside_graph = torch.compiler.disable(_scaling_json)

# The schema type of each `Options` field's type.
_SCHEMA_TYPES = {
    int: "int",
    bool: "bool",
    str: "str",
    Optional[Tensor]: "Tensor?",
    Optional[str]: "str?",
    Optional[float]: "float?",
    Optional[int]: "int?",
    Optional[List[float]]: "float[]?",
    Optional[List[int]]: "int[]?",
}

# The custom operators. Their schemas list the tensors to rotate, then the `Options` fields.
_OPTIONS_SCHEMA = ", ".join(f"{_SCHEMA_TYPES[t]} {f}" for f, t in get_type_hints(Options).items())


def _rope_impl(q: Tensor, *o: Any) -> Tensor:
    return _rotated(q, None, Options(*o))[0]


def _rope_qk_impl(q: Tensor, k: Tensor, *o: Any) -> Tuple[Tensor, Tensor]:
    q_out, k_out = _rotated(q, k, Options(*o))
    return q_out, k_out


def _rope_inplace_impl(q: Tensor, *o: Any) -> None:
    _launch(q, None, None, None, Options(*o))


def _rope_qk_inplace_impl(q: Tensor, k: Tensor, *o: Any) -> None:
    _launch(q, k, None, None, Options(*o))


rope_op = torch.library.custom_op(
    "rope_rs::rope", _rope_impl, mutates_args=(), schema=f"(Tensor q, {_OPTIONS_SCHEMA}) -> Tensor"
)
rope_qk_op = torch.library.custom_op(
    "rope_rs::rope_qk", _rope_qk_impl, mutates_args=(), schema=f"(Tensor q, Tensor k, {_OPTIONS_SCHEMA}) -> (Tensor, Tensor)"
)
rope_inplace_op = torch.library.custom_op(
    "rope_rs::rope_", _rope_inplace_impl, mutates_args=("q",), schema=f"(Tensor(a!) q, {_OPTIONS_SCHEMA}) -> ()"
)
rope_qk_inplace_op = torch.library.custom_op(
    "rope_rs::rope_qk_",
    _rope_qk_inplace_impl,
    mutates_args=("q", "k"),
    schema=f"(Tensor(a!) q, Tensor(b!) k, {_OPTIONS_SCHEMA}) -> ()",
)


@rope_op.register_fake
def _(q: Tensor, *o: Any) -> Tensor:
    return torch.empty_like(q)


@rope_qk_op.register_fake
def _(q: Tensor, k: Tensor, *o: Any) -> Tuple[Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k)


@rope_inplace_op.register_fake
def _(q: Tensor, *o: Any) -> None:
    return None


@rope_qk_inplace_op.register_fake
def _(q: Tensor, k: Tensor, *o: Any) -> None:
    return None


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    """Keeps the options of a launch for its backward: tensors saved, the rest as attributes."""
    rotated = 2 if len(inputs) == len(Options._fields) + 2 else 1
    o = Options(*inputs[rotated:])
    ctx.save_for_backward(*(getattr(o, f) for f in _TENSOR_FIELDS))
    ctx.options = o._replace(**{f: None for f in _TENSOR_FIELDS})
    ctx.rotated = rotated


def _saved_options(ctx: Any) -> Options:
    return ctx.options._replace(**dict(zip(_TENSOR_FIELDS, ctx.saved_tensors))).flipped()


def _rope_backward(ctx: Any, grad: Tensor) -> Tuple[Any, ...]:
    o = _saved_options(ctx)
    return (rope_op(_gradient(grad), *o),) + (None,) * len(Options._fields)


def _rope_qk_backward(ctx: Any, grad_q: Optional[Tensor], grad_k: Optional[Tensor]) -> Tuple[Any, ...]:
    o = _saved_options(ctx)
    grad_q, grad_k = _gradient(grad_q), _gradient(grad_k)
    if grad_q is not None and grad_k is not None:
        dq, dk = rope_qk_op(grad_q, grad_k, *o)
    else:
        dq = None if grad_q is None else rope_op(grad_q, *o)
        dk = None if grad_k is None else rope_op(grad_k, *o)
    return (dq, dk) + (None,) * len(Options._fields)


rope_op.register_autograd(_rope_backward, setup_context=_setup_context)
rope_qk_op.register_autograd(_rope_qk_backward, setup_context=_setup_context)


# The serving drop-ins (rope_rs.rotary_embedding, apply_rope_with_cos_sin_cache_inplace,
# fused_qk_norm_rope and concat_and_cache_mla_rope_fused) under torch.compile: in place, each written tensor marked mutated (the
# rotated ones and the caches), launched on the current stream of the first tensor's device.
_CACHE_SCHEMA = (
    "Tensor(c!)? key_cache, Tensor(d!)? value_cache, Tensor? slot_mapping, str kv_cache_dtype, "
    "Tensor? k_scale, Tensor? v_scale, bool pdl"
)


def _rotary_embedding_impl(
    positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int, cos_sin_cache: Tensor,
    is_neox: bool, value: Optional[Tensor], key_cache: Optional[Tensor], value_cache: Optional[Tensor],
    slot_mapping: Optional[Tensor], kv_cache_dtype: str, k_scale: Optional[Tensor], v_scale: Optional[Tensor],
    pdl: bool,
) -> None:
    with torch.cuda.device(query.device):
        _native.rotary_embedding(
            positions, query, key, head_size, cos_sin_cache, is_neox, value=value, key_cache=key_cache,
            value_cache=value_cache, slot_mapping=slot_mapping, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale,
            v_scale=v_scale, stream=_stream(query), producer_sync=False, pdl=pdl,
        )


def _fused_qk_norm_rope_impl(
    qkv: Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int, head_dim: int, eps: float,
    q_weight: Tensor, k_weight: Tensor, cos_sin_cache: Tensor, is_neox: bool, position_ids: Tensor,
    key_cache: Optional[Tensor], value_cache: Optional[Tensor], slot_mapping: Optional[Tensor],
    kv_cache_dtype: str, k_scale: Optional[Tensor], v_scale: Optional[Tensor], pdl: bool,
    mrope_section: Optional[List[int]], mrope_interleaved: bool,
) -> None:
    with torch.cuda.device(qkv.device):
        _native.fused_qk_norm_rope(
            qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache, is_neox,
            position_ids, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping,
            kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, v_scale=v_scale, stream=_stream(qkv),
            producer_sync=False, pdl=pdl, mrope_section=mrope_section, mrope_interleaved=mrope_interleaved,
        )


def _concat_and_cache_mla_rope_fused_impl(
    positions: Tensor, q_pe: Tensor, k_pe: Tensor, kv_c: Tensor, cos_sin_cache: Tensor, is_neox: bool,
    slot_mapping: Tensor, kv_cache: Tensor, kv_cache_dtype: str, kv_cache_scale: Tensor, pdl: bool,
) -> None:
    with torch.cuda.device(q_pe.device):
        _native.concat_and_cache_mla_rope_fused(
            positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_dtype,
            kv_cache_scale, q_pe.shape[-1], stream=_stream(q_pe), producer_sync=False, pdl=pdl,
        )


rotary_embedding_op = torch.library.custom_op(
    "rope_rs::rotary_embedding_",
    _rotary_embedding_impl,
    mutates_args=("query", "key", "key_cache", "value_cache"),
    schema=(
        "(Tensor positions, Tensor(a!) query, Tensor(b!)? key, int head_size, Tensor cos_sin_cache, "
        f"bool is_neox, Tensor? value, {_CACHE_SCHEMA}) -> ()"
    ),
)
concat_and_cache_mla_rope_fused_op = torch.library.custom_op(
    "rope_rs::concat_and_cache_mla_rope_fused_",
    _concat_and_cache_mla_rope_fused_impl,
    mutates_args=("q_pe", "k_pe", "kv_cache"),
    schema=(
        "(Tensor positions, Tensor(a!) q_pe, Tensor(b!) k_pe, Tensor kv_c, Tensor cos_sin_cache, bool is_neox, "
        "Tensor slot_mapping, Tensor(c!) kv_cache, str kv_cache_dtype, Tensor kv_cache_scale, bool pdl) -> ()"
    ),
)
fused_qk_norm_rope_op = torch.library.custom_op(
    "rope_rs::fused_qk_norm_rope_",
    _fused_qk_norm_rope_impl,
    mutates_args=("qkv", "key_cache", "value_cache"),
    schema=(
        "(Tensor(a!) qkv, int num_heads_q, int num_heads_k, int num_heads_v, int head_dim, float eps, "
        "Tensor q_weight, Tensor k_weight, Tensor cos_sin_cache, bool is_neox, Tensor position_ids, "
        f"{_CACHE_SCHEMA}, int[]? mrope_section, bool mrope_interleaved) -> ()"
    ),
)


# FlashInfer's fused_qk_rmsnorm_rope under torch.compile: the norm across heads and the rotation
# of q and k into q_out and k_out (both marked mutated; rope_rs.dit builds the rest with torch).
def _qk_norm_across_rope_impl(
    q: Tensor, k: Tensor, q_out: Tensor, k_out: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor],
    cos_sin_cache: Tensor, positions: Tensor, sections: List[int], head_size: int, eps: float, is_neox: bool,
    fp8_multiplier: Optional[float],
) -> None:
    with torch.cuda.device(q.device):
        _native._qk_norm_across_rope(
            q, k, q_out, k_out, q_weight, k_weight, cos_sin_cache, positions, sections, head_size, eps, is_neox,
            fp8_multiplier, _stream(q),
        )


qk_norm_across_rope_op = torch.library.custom_op(
    "rope_rs::qk_norm_across_rope_",
    _qk_norm_across_rope_impl,
    mutates_args=("q_out", "k_out"),
    schema=(
        "(Tensor q, Tensor k, Tensor(a!) q_out, Tensor(b!) k_out, Tensor? q_weight, Tensor? k_weight, "
        "Tensor cos_sin_cache, Tensor positions, int[] sections, int head_size, float eps, bool is_neox, "
        "float? fp8_multiplier) -> ()"
    ),
)


@qk_norm_across_rope_op.register_fake
def _(*args: Any) -> None:
    return None


# FlashInfer's rope_quantize_fp8 and rope_quantize_fp8_append_paged_kv_cache under
# torch.compile: the FP8 outputs (allocated by the caller) and the caches are marked mutated.
def _rope_quantize_fp8_impl(
    q_rope: Tensor, k_rope: Tensor, cos_sin_cache: Tensor, pos_ids: Tensor, is_neox: bool, quantize_dtype: str,
    quant_scale_q: float, quant_scale_kv: float, q_rope_out: Tensor, k_rope_out: Tensor, pdl: bool,
    q_nope: Optional[Tensor], q_nope_out: Optional[Tensor], k_nope: Optional[Tensor], k_nope_out: Optional[Tensor],
) -> None:
    with torch.cuda.device(q_rope.device):
        _native.rope_quantize_fp8(
            q_rope, k_rope, cos_sin_cache, pos_ids, is_neox, q_rope.shape[-1], quantize_dtype, quant_scale_q,
            quant_scale_kv, q_rope_out, k_rope_out, _stream(q_rope), False, pdl, q_nope, q_nope_out, k_nope,
            k_nope_out,
        )


def _rope_quantize_fp8_append_impl(
    q_rope: Tensor, k_rope: Tensor, v: Optional[Tensor], cos_sin_cache: Tensor, pos_ids: Tensor, k_cache: Tensor,
    v_cache: Tensor, kv_indices: Tensor, kv_indptr: Tensor, batch_indices: Tensor, positions: Tensor, is_neox: bool,
    quantize_dtype: str, quant_scale_q: float, quant_scale_kv: float, page_size: int, kv_layout: str,
    q_rope_out: Tensor, pdl: bool, q_nope: Optional[Tensor], q_nope_out: Optional[Tensor], k_nope: Optional[Tensor],
) -> None:
    with torch.cuda.device(q_rope.device):
        _native.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k_rope, v, cos_sin_cache, pos_ids, k_cache, v_cache, kv_indices, kv_indptr, batch_indices,
            positions, is_neox, q_rope.shape[-1], quantize_dtype, quant_scale_q, quant_scale_kv, page_size,
            kv_layout, q_rope_out, _stream(q_rope), False, pdl, q_nope, q_nope_out, k_nope,
        )


rope_quantize_fp8_op = torch.library.custom_op(
    "rope_rs::rope_quantize_fp8_",
    _rope_quantize_fp8_impl,
    mutates_args=("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out"),
    schema=(
        "(Tensor q_rope, Tensor k_rope, Tensor cos_sin_cache, Tensor pos_ids, bool is_neox, str quantize_dtype, "
        "float quant_scale_q, float quant_scale_kv, Tensor(a!) q_rope_out, Tensor(b!) k_rope_out, bool pdl, "
        "Tensor? q_nope, Tensor(c!)? q_nope_out, Tensor? k_nope, Tensor(d!)? k_nope_out) -> ()"
    ),
)
rope_quantize_fp8_append_paged_kv_cache_op = torch.library.custom_op(
    "rope_rs::rope_quantize_fp8_append_paged_kv_cache_",
    _rope_quantize_fp8_append_impl,
    mutates_args=("k_cache", "v_cache", "q_rope_out", "q_nope_out"),
    schema=(
        "(Tensor q_rope, Tensor k_rope, Tensor? v, Tensor cos_sin_cache, Tensor pos_ids, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor kv_indices, Tensor kv_indptr, Tensor batch_indices, Tensor positions, "
        "bool is_neox, str quantize_dtype, float quant_scale_q, float quant_scale_kv, int page_size, str kv_layout, "
        "Tensor(c!) q_rope_out, bool pdl, Tensor? q_nope, Tensor(d!)? q_nope_out, Tensor? k_nope) -> ()"
    ),
)


@rope_quantize_fp8_op.register_fake
def _(*args: Any) -> None:
    return None


@rope_quantize_fp8_append_paged_kv_cache_op.register_fake
def _(*args: Any) -> None:
    return None


@concat_and_cache_mla_rope_fused_op.register_fake
def _(*args: Any) -> None:
    return None


@rotary_embedding_op.register_fake
def _(*args: Any) -> None:
    return None


@fused_qk_norm_rope_op.register_fake
def _(*args: Any) -> None:
    return None
