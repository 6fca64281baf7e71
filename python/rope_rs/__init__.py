"""rope-rs: rotary position embedding (RoPE) for NVIDIA GPUs, with kernels written in Rust.

Tensors cross by DLPack (``torch.Tensor`` and anything else with ``__dlpack__`` and
``__dlpack_device__`` on CUDA); nothing here links against PyTorch, and the package imports
without it. With ``torch.Tensor`` arguments, launches go to PyTorch's current stream, outputs
come from ``torch.empty_like``, autograd and ``torch.compile`` work (see ``rope_rs.torch``)::

    import torch, rope_rs
    q = torch.randn(1, 4096, 32, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    q_rot, k_rot = rope_rs.apply_rope(q, k, theta=500000.0)   # new tensors
    rope_rs.apply_rope(q, k, theta=500000.0, inplace=True)     # rotates q and k themselves

Drop-ins, a one-line change from the original: ``rotary_embedding`` and ``fused_qk_norm_rope``
(vLLM; both also write vLLM's paged KV cache in the same launch when given one),
``apply_rope_with_cos_sin_cache_inplace`` (FlashInfer's, and SGLang's with its
``FusedSetKVBufferArg``), ``rope_quantize_fp8``, ``mla_rope_quantize_fp8`` and
``rope_quantize_fp8_append_paged_kv_cache`` (FlashInfer's; the cache form for the rotated
features) and
``apply_rotary_pos_emb`` (Hugging Face). For training, ``qk_norm_rope`` fuses the QK-norm and
the rotation forward and backward. ``frequencies`` shows the frequencies a call computes
sin/cos from.
"""

import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple, Union

from rope_rs import _native
from rope_rs._native import __version__, frequencies

__all__ = [
    "__version__",
    "DualChunkRotaryEmbedding",
    "FourierRotaryEmbedding",
    "FusedSetKVBufferArg",
    "MRotaryEmbedding",
    "apply_rope",
    "apply_rope_with_cos_sin_cache_inplace",
    "apply_rotary_pos_emb",
    "concat_and_cache_mla_rope_fused",
    "frequencies",
    "fused_qk_norm_rope",
    "fused_qk_rmsnorm_rope",
    "mla_rope_quantize_fp8",
    "qk_norm_rope",
    "rope_quantize_fp8",
    "rope_quantize_fp8_append_paged_kv_cache",
    "rotary_embedding",
]


def _torch_of(x: Any) -> Any:
    """The torch module if `x` is a ``torch.Tensor`` (torch is never imported here: a tensor of
    it exists only once it was)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch
    return None


def _empty_like(x: Any, arg: str, name: str) -> Any:
    """A new array like `x` (named `arg`) from its own library (the array API's
    ``__array_namespace__().empty_like``), for the output `name`."""
    if not hasattr(x, "__dlpack__"):
        raise TypeError(
            f"{arg} must be a tensor supporting DLPack (__dlpack__ and __dlpack_device__), got {type(x).__name__}"
        )
    namespace = getattr(x, "__array_namespace__", None)
    if namespace is None:
        raise TypeError(
            f"{name}: an out-of-place call on {type(x).__name__} needs {name}= (an output tensor), "
            "or inplace=True"
        )
    return namespace().empty_like(x)


def apply_rope(
    q: Any,
    k: Any = None,
    *,
    positions: Union[int, Any, None] = None,
    position_ids: Any = None,
    cu_seqlens: Any = None,
    layout: Optional[str] = None,
    style: str = "neox",
    theta: Optional[float] = None,
    cos_sin_cache: Any = None,
    cos: Any = None,
    sin: Any = None,
    inv_freq: Any = None,
    attention_factor: Optional[float] = None,
    angle: Optional[str] = None,
    scaling: Optional[dict] = None,
    rotary_dim: Optional[int] = None,
    inplace: bool = False,
    out: Any = None,
    k_out: Any = None,
    backward: bool = False,
    stream: Optional[int] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    pdl: bool = False,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    axes_dim: Optional[Sequence[int]] = None,
) -> Any:
    """Rotates q (and k) by rotary position embedding (RoPE) on the GPU.

    Returns the rotated q, or ``(q, k)`` rotated when k is given: new tensors by default
    (``inplace=False``; ``out=``/``k_out=`` receive them when given), q and k themselves with
    ``inplace=True``.

    Tensors: CUDA tensors of one device, passed by DLPack. q and k are float32, float16 or
    bfloat16, any strides but a contiguous last dimension: ``[batch, seq, heads, head_dim]``
    (``layout="bshd"``, the default for 4-D), ``[seq, batch, heads, head_dim]`` (``"sbhd"``),
    ``[batch, heads, seq, head_dim]`` (``"bhsd"``, Hugging Face's) or packed
    ``[tokens, heads, head_dim]`` (3-D, ``"thd"``). k has q's dtype, batch and seq, and any head
    count (GQA, MQA); views of one fused QKV tensor work in place.

    Positions (one of; integer tensors are contiguous int32 or int64 on q's device):
      - ``positions``: an int, token ``s`` at ``positions + s`` (default 0); or a tensor
        ``[batch]`` of per-row start positions, ``positions[b] + s`` (decoding with a KV cache);
      - ``position_ids``: ``[seq]`` (shared by all rows, also ``[tokens]`` for 3-D tensors) or
        ``[batch, seq]``, one position per token;
      - ``cu_seqlens``: ``[num_seqs + 1]`` cumulative lengths of packed sequences (3-D tensors):
        token ``t`` of sequence ``i`` at ``t - cu_seqlens[i]``, plus ``positions[i]`` when
        ``positions`` is a tensor ``[num_seqs]`` (tokens already cached);
      - ``cu_seqlens`` with ``cp_size`` > 1 and ``cp_rank``: packed sequences split over
        context-parallel ranks as Megatron-LM and Transformer Engine split them. ``cu_seqlens``
        bounds the *whole* sequences (each length divisible by ``2 * cp_size``); q holds this
        rank's ``L / cp_size`` tokens of each sequence of whole length ``L``, chunks ``cp_rank``
        and ``2 * cp_size - 1 - cp_rank`` of its ``2 * cp_size`` equal chunks, and their
        positions are derived in the kernel (no ``positions`` or ``position_ids``);
      - ``position_ids`` with ``mrope_section``: mRoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).
        ``position_ids`` is ``[3, batch, seq]`` (or ``[3, tokens]`` for 3-D tensors), a row of
        temporal, height and width positions; ``mrope_section`` gives the pairs of each axis
        (summing to ``rotary_dim / 2``, as in the model's ``rope_scaling``), in blocks in that
        order, or with ``mrope_interleaved=True`` in Qwen3-VL's ``T H W T H W ...`` order.
        Each pair rotates at its axis's position;
      - ``position_ids`` with ``axes_dim``: N-D axial RoPE (FLUX's ``EmbedND``, video DiTs).
        ``position_ids`` is ``[n_axes, batch, seq]`` (or ``[n_axes, tokens]``), ``axes_dim`` one
        to four even widths summing to ``rotary_dim``: axis ``a`` owns ``axes_dim[a] / 2``
        consecutive pairs, rotated at that axis's position with ``theta ** (-2i /
        axes_dim[a])`` (from ``theta``; a table or ``inv_freq`` must hold the axes' own).

    sin/cos (one of):
      - ``theta`` (default 10000): ``inv_freq[i] = theta ** (-2i / rotary_dim)``, cos and sin
        computed in the kernel (angle in float64, cos/sin within one float32 ulp);
      - ``scaling``: a Hugging Face ``rope_scaling`` dict (transformers 5's ``rope_parameters``),
        ``rope_type`` "default", "linear", "dynamic", "ntk" (vLLM's), "yarn", "longrope",
        "llama3" or "proportional" (Gemma 4: the whole head rotates, ``partial_rotary_factor``
        is the share of pairs with nonzero frequencies) with the config's own keys
        (``factor``, ``original_max_position_embeddings``, ``beta_fast``, ..., ``rope_theta``
        and ``partial_rotary_factor`` too); add ``max_position_embeddings`` (the
        config's top-level field) and ``seq_len`` (the current length) where the family reads
        them (dynamic; yarn and longrope without ``factor``; longrope's long factors). ``theta``
        is its base. YaRN's and LongRoPE's attention factor scales cos and sin, as HF does;
      - ``inv_freq``: ``[rotary_dim / 2]`` frequencies, a CUDA tensor (float64 read as given;
        PyTorch tensors of other dtypes are converted) or floats on the host, with
        ``attention_factor`` (default 1) multiplying cos and sin;
      - ``cos_sin_cache``: ``[max_position, rotary_dim]``, each row the cosines then the sines
        (vLLM's and FlashInfer's cache);
      - ``cos`` and ``sin``: ``[max_position, rotary_dim / 2]`` each.
      Tables are float32 or q's dtype; a position outside a table makes that token's outputs
      NaN (never a read outside it). ``angle="f32"`` forms angles as PyTorch models do,
      ``f32(p) * f32(inv_freq)`` rounded to float32 (with a model's own float32 ``inv_freq``, its
      angles exactly), instead of exactly (``"exact"``, the default).

    ``style``: ``"neox"`` rotates pairs ``(x[i], x[i + r/2])`` (GPT-NeoX, Llama: rotate-half),
    ``"interleaved"`` pairs ``(x[2i], x[2i+1])`` (GPT-J). ``rotary_dim`` (default: the width the
    table or frequencies serve, else head_dim) rotates the first ``rotary_dim`` features of each
    head and leaves the rest (copied out of place). ``backward=True`` applies the transposed
    rotation, the gradient of the forward one.

    Streams: the kernel is launched asynchronously on ``stream`` (a ``CUstream`` handle as an
    int); by default PyTorch's current stream for ``torch.Tensor`` arguments, else 0 (the legacy
    default stream). The tensors must stay allocated until the kernel has run on that stream
    (PyTorch does this for tensors used on their own stream), and nothing else may write them,
    or read what is written, meanwhile. Frequencies computed on the host (``scaling``,
    ``inv_freq`` floats, ``angle="f32"``, and each ``theta``'s) are uploaded once per process on
    first use: inside a CUDA graph capture that raises ValueError, so make the same call once
    before capturing. ``pdl=True`` asks for programmatic dependent launch (compute capability
    9.0 and newer): the launch may start before the kernel ahead of it on the stream has
    completed, and waits for it before touching memory; the results are the same. It applies
    to decode-sized launches (every head its own block row); others, and older GPUs, launch as
    usual. Captured in a CUDA graph it needs a driver of CUDA 12.3 or newer.

    PyTorch: with q or k requiring grad, the call is recorded for autograd (its backward is
    ``backward=True`` on the gradients); under ``torch.compile`` it becomes the custom operators
    ``torch.ops.rope_rs.*``. See ``rope_rs.torch``. Other DLPack producers get out-of-place
    outputs from their array-API namespace (``__array_namespace__().empty_like``), or pass
    ``out=``.

    Raises TypeError for an argument of the wrong Python type, ValueError naming the argument for
    an invalid tensor or option (CPU tensors, wrong dtype, mismatched shapes, a non-contiguous
    last dimension, tensors on different devices, contradicting options; nothing is launched
    then), RuntimeError when the CUDA driver fails.
    """
    torch = _torch_of(q)
    direct = None if torch is None else _direct(torch, q, k, inv_freq, out, k_out, stream)
    if torch is not None and direct is None:
        # Not rope_rs.torch: its custom operators import torch.compile's machinery (seconds).
        from rope_rs import _torch_eager

        # The options both paths take as they are (rope_rs._torch_eager reads their names and
        # defaults from this signature).
        opts = dict(
            positions=positions,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            layout=layout,
            style=style,
            theta=theta,
            cos_sin_cache=cos_sin_cache,
            cos=cos,
            sin=sin,
            inv_freq=inv_freq,
            attention_factor=attention_factor,
            angle=angle,
            scaling=scaling,
            rotary_dim=rotary_dim,
            backward=backward,
            cp_size=cp_size,
            cp_rank=cp_rank,
            pdl=pdl,
            mrope_section=mrope_section,
            mrope_interleaved=mrope_interleaved,
            axes_dim=axes_dim,
        )
        return _torch_eager.apply_rope(q, k, opts, inplace=inplace, out=out, k_out=k_out, stream=stream)
    if inplace:
        if out is not None or k_out is not None:
            raise ValueError("out: inplace=True rotates q and k themselves; give out and k_out only out of place")
    else:
        if out is None:
            out = torch.empty_like(q) if torch is not None else _empty_like(q, "q", "out")
        if k is not None and k_out is None:
            k_out = torch.empty_like(k) if torch is not None else _empty_like(k, "k", "k_out")
    launch_stream, sync = direct if direct is not None else (0 if stream is None else stream, True)
    # By position, in the native signature's order: the native call parses positions faster
    # than keywords.
    _native.apply_rope(
        q, k, out, k_out, positions, position_ids, cu_seqlens, layout, style, theta, cos_sin_cache, cos, sin,
        inv_freq, attention_factor, angle, scaling, rotary_dim, backward, launch_stream, sync, cp_size, cp_rank, pdl,
        None if mrope_section is None else [int(n) for n in mrope_section], mrope_interleaved,
        None if axes_dim is None else [int(n) for n in axes_dim],
    )
    q_res, k_res = (q, k) if inplace else (out, k_out)
    return q_res if k is None else (q_res, k_res)


def _direct(
    torch: Any, q: Any, k: Any, inv_freq: Any, out: Any, k_out: Any, stream: Optional[int]
) -> Optional[Tuple[int, bool]]:
    """For ``torch.Tensor`` arguments: the stream of a launch that needs nothing of
    ``rope_rs._torch_eager`` and whether the producers must order their writes before it; None
    when the call needs that layer: under ``torch.compile``, for autograd, for an ``inv_freq``
    tensor to convert, for outputs that require grad, for a device other than the current one
    (PyTorch exports tensors by DLPack from the current device only), or with a torch without
    DLPack's C exchange API (which gives the current stream here)."""
    if not q.is_cuda or torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)):
        return None
    if isinstance(inv_freq, torch.Tensor) and (inv_freq.dtype != torch.float64 or inv_freq.device != q.device):
        return None
    if (out is not None and out.requires_grad) or (k_out is not None and k_out.requires_grad):
        return None
    if q.get_device() != torch.cuda.current_device():
        return None
    if stream is not None:
        return stream, True
    current = _native._current_stream(q)
    return None if current is None else (current, False)


def _eager_stream(x: Any, stream: Optional[int]) -> Optional[Tuple[int, bool]]:
    """For a drop-in's first tensor `x`: the stream to launch on and whether the producers must
    order their writes before it: `stream` (they must), else PyTorch's current stream for a CUDA
    ``torch.Tensor`` (where they are ordered already), else 0, the legacy default stream (they
    must). None when `x` is a ``torch.Tensor`` traced by ``torch.compile``: the call must then go
    through a custom operator of ``rope_rs.torch``."""
    torch = _torch_of(x)
    if torch is not None and torch.compiler.is_compiling():
        return None
    if stream is not None:
        return stream, True
    if torch is not None and x.is_cuda:
        # By the DLPack C exchange API when torch has it (no stream object built), else torch's.
        current = _native._current_stream(x)
        return (torch.cuda.current_stream(x.device).cuda_stream if current is None else current), False
    return 0, True


def rotary_embedding(
    positions: Any,
    query: Any,
    key: Any,
    head_size: int,
    cos_sin_cache: Any,
    is_neox: bool,
    *,
    value: Any = None,
    key_cache: Any = None,
    value_cache: Any = None,
    slot_mapping: Any = None,
    kv_cache_dtype: str = "auto",
    k_scale: Any = None,
    v_scale: Any = None,
    stream: Optional[int] = None,
    pdl: bool = False,
) -> None:
    """vLLM's ``rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)``:
    rotates query and key in place; with ``key_cache``, ``value_cache`` and ``slot_mapping`` it
    also writes the rotated key and ``value`` into vLLM's paged KV cache in the same launch
    (what ``reshape_and_cache_flash`` does after the rotation).

    ``positions``: int32/int64 ``[num_tokens]``; ``query`` and ``key``: ``[num_tokens,
    num_heads * head_size]`` (or ``[num_tokens, num_heads, head_size]``), any row stride, a
    contiguous last dimension (views of one QKV tensor are fine); ``key`` may be None without a
    cache; ``cos_sin_cache``: ``[max_position, rotary_dim]``, cos half then sin half, float32 or
    query's dtype; ``is_neox``: rotate-half pairs, else interleaved. The first ``rotary_dim``
    features of each head rotate.

    Cache write: ``value`` like key; ``key_cache`` and ``value_cache`` ``[num_blocks,
    block_size, num_kv_heads, head_size]`` (vLLM's layout, any strides with contiguous heads,
    the same for both); token ``t`` goes to row ``slot_mapping[t] % block_size`` of block
    ``slot_mapping[t] // block_size``, a negative slot writes nothing. ``kv_cache_dtype``
    ``"auto"`` stores query's dtype, ``"fp8"``/``"fp8_e4m3"`` FP8 E4M3 of ``x / k_scale`` and
    ``x / v_scale`` (float32 tensors, one element or one per kv head) into uint8 or
    float8_e4m3fn caches, ``"fp8_e5m2"`` FP8 E5M2 into uint8 or float8_e5m2 caches,
    ``"nvfp4"`` NVFP4 into vLLM's packed uint8 caches ``[num_blocks, block_size, num_kv_heads,
    head_size // 2 + head_size // 16]``: each head's row its E2M1 codes, two a byte (the even
    element in the low four bits), then one E4M3 scale per 16 elements, ``b = e4m3(max|x| /
    (6 * scale))`` and codes ``e2m1(x / (b * scale))`` with ``scale`` k's or v's global scale
    (``k_scale``, ``v_scale``), so ``x ~ code * b * scale`` (whole-head rotations;
    ``head_size`` a multiple of 16, of 32 with ``is_neox``, rows of a multiple of 4 bytes). With
    a cache too, the features past ``rotary_dim`` are stored as they are.

    Launched on ``stream``, by default PyTorch's current stream (as vLLM's op); ``pdl`` as in
    ``apply_rope``. Under ``torch.compile`` it is the custom operator
    ``torch.ops.rope_rs.rotary_embedding_``. Raises as ``apply_rope``.
    """
    launch = _eager_stream(query, stream)
    if launch is None:
        import rope_rs.torch as ops  # registers the operators (once; dynamo runs the import)

        ops.rotary_embedding_op(
            positions, query, key, head_size, cos_sin_cache, is_neox, value, key_cache, value_cache,
            slot_mapping, kv_cache_dtype, k_scale, v_scale, pdl,
        )
        return
    stream, sync = launch
    _native.rotary_embedding(
        positions, query, key, head_size, cos_sin_cache, is_neox, value, key_cache, value_cache, slot_mapping,
        kv_cache_dtype, k_scale, v_scale, stream, sync, pdl,
    )


def concat_and_cache_mla_rope_fused(
    positions: Any,
    q_pe: Any,
    k_pe: Any,
    kv_c: Any,
    cos_sin_cache: Any,
    is_neox: bool,
    slot_mapping: Any,
    kv_cache: Any,
    kv_cache_dtype: str,
    kv_cache_scale: Any,
    *,
    stream: Optional[int] = None,
    pdl: bool = False,
) -> None:
    """vLLM's ``concat_and_cache_mla_rope_fused(positions, q_pe, k_pe, kv_c, cos_sin_cache,
    is_neox, slot_mapping, kv_cache, kv_cache_dtype, kv_cache_scale)``: MLA's (DeepSeek's)
    rotation and latent-cache write in one launch.

    Rotates ``q_pe`` ``[num_tokens, num_heads, rot_dim]`` and the shared ``k_pe`` ``[num_tokens,
    rot_dim]`` in place at ``positions`` (int32/int64 ``[num_tokens]``) with ``cos_sin_cache``
    ``[max_position, rot_dim]`` (cos half then sin half, float32 or q_pe's dtype); ``is_neox``:
    rotate-half pairs, else interleaved. Each token's ``kv_c`` ``[num_tokens, kv_lora_rank]``
    and rotated ``k_pe`` go to row ``slot % block_size`` of block ``slot // block_size`` of
    ``kv_cache`` ``[num_blocks, block_size, kv_lora_rank + rot_dim]`` (latent features first),
    ``slot = slot_mapping[t]`` (int32/int64); a negative slot writes nothing. ``kv_cache_dtype``
    ``"auto"`` stores q_pe's dtype (``kv_cache_scale`` unused), ``"fp8"``/``"fp8_e4m3"`` FP8 E4M3
    of ``x / kv_cache_scale`` (float32, one element) into a uint8 or float8_e4m3fn cache,
    ``"fp8_e5m2"`` E5M2.

    As in vLLM, only the first ``slot_mapping.shape[0]`` tokens are taken (the rest is CUDA-graph
    padding). Unlike vLLM's kernel, tokens with a negative slot still have their ``q_pe`` and
    ``k_pe`` rotated (vLLM leaves them as they were); rotation runs in float32 and rounds once.
    ``k_pe`` may be a view of the same projection as ``kv_c`` (``kv[..., kv_lora_rank:]``).

    Launched on ``stream``, by default PyTorch's current stream; ``pdl`` as in ``apply_rope``.
    Under ``torch.compile`` it is ``torch.ops.rope_rs.concat_and_cache_mla_rope_fused_``.
    Raises as ``apply_rope``.
    """
    n = _rows(slot_mapping)
    if n is not None and _rows(q_pe) not in (None, n):
        positions, q_pe, k_pe, kv_c = positions[:n], q_pe[:n], k_pe[:n], kv_c[:n]
    launch = _eager_stream(q_pe, stream)
    if launch is None:
        import rope_rs.torch as ops  # registers the operators (once; dynamo runs the import)

        ops.concat_and_cache_mla_rope_fused_op(
            positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_dtype,
            kv_cache_scale, pdl,
        )
        return
    stream, sync = launch
    _native.concat_and_cache_mla_rope_fused(
        positions, q_pe, k_pe, kv_c, cos_sin_cache, is_neox, slot_mapping, kv_cache, kv_cache_dtype,
        kv_cache_scale, _last_extent(q_pe), stream, sync, pdl,
    )


def _rows(x: Any) -> Optional[int]:
    """`x`'s first extent, or None for an object without a shape (the native call names it)."""
    shape = getattr(x, "shape", None)
    return int(shape[0]) if shape is not None and len(shape) > 0 else None


def _last_extent(x: Any) -> int:
    """`x`'s last extent (0 without a shape: the native call then refuses `x` by name)."""
    shape = getattr(x, "shape", None)
    return int(shape[-1]) if shape is not None and len(shape) > 0 else 0


@dataclass
class FusedSetKVBufferArg:
    """SGLang's ``FusedSetKVBufferArg``: what :func:`apply_rope_with_cos_sin_cache_inplace`
    writes into the token pool beside the rotation. ``value``: ``[num_tokens, num_kv_heads *
    head_size]``; ``k_buffer``, ``v_buffer``: ``[pool_size, num_kv_heads * head_size]`` (or 3-D),
    of the tensors' dtype; ``cache_loc``: int64/int32 ``[num_tokens]``, the pool row of each
    token (negative: not written); ``k_scale`` and ``v_scale`` must be None. SGLang's own class
    works as well (any object with these attributes)."""

    value: Any
    k_buffer: Any
    v_buffer: Any
    k_scale: Optional[float]
    v_scale: Optional[float]
    cache_loc: Any


def apply_rope_with_cos_sin_cache_inplace(
    positions: Any,
    query: Any,
    key: Any,
    head_size: int,
    cos_sin_cache: Any,
    is_neox: bool = True,
    fused_set_kv_buffer_arg: Any = None,
    enable_pdl: bool = False,
    *,
    stream: Optional[int] = None,
    pdl: bool = False,
) -> None:
    """FlashInfer's ``apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size,
    cos_sin_cache, is_neox=True)`` and SGLang's, which adds ``fused_set_kv_buffer_arg`` and
    ``enable_pdl``: rotates query ``[nnz, num_q_heads * head_size]`` and key ``[nnz,
    num_k_heads * head_size]`` in place at ``positions`` ``[nnz]`` with ``cos_sin_cache``
    ``[max_seq_len, rotary_dim]`` (cosines, then sines; the peers require float32, rope-rs also
    takes query's dtype), as :func:`rotary_embedding`. With ``fused_set_kv_buffer_arg``
    (:class:`FusedSetKVBufferArg`, or SGLang's), the rotated key and its ``value`` go into row
    ``cache_loc[t]`` of ``k_buffer`` and ``v_buffer`` in the same launch. Launched on PyTorch's current stream unless ``stream`` is given;
    ``enable_pdl`` (or ``pdl``) as ``pdl`` in ``apply_rope``. Under ``torch.compile`` it is
    ``torch.ops.rope_rs.rotary_embedding_``.
    """
    pdl = pdl or enable_pdl
    a = fused_set_kv_buffer_arg
    if _eager_torch(query) and _native._apply_rope_with_cos_sin_cache_inplace_eager(
        positions, query, key, head_size, cos_sin_cache, is_neox, a, pdl, stream
    ):
        return
    launch = _eager_stream(query, stream)
    if launch is None:
        if a is not None and (a.k_scale is not None or a.v_scale is not None):
            raise ValueError("fused_set_kv_buffer_arg.k_scale must be None (as in SGLang's kernel)")
        rotary_embedding(
            positions, query, key, head_size, cos_sin_cache, is_neox,
            value=None if a is None else a.value,
            key_cache=None if a is None else a.k_buffer,
            value_cache=None if a is None else a.v_buffer,
            slot_mapping=None if a is None else a.cache_loc,
            pdl=pdl,
        )
        return
    stream, sync = launch
    _native.apply_rope_with_cos_sin_cache_inplace(
        positions, query, key, head_size, cos_sin_cache, is_neox, a, stream, sync, pdl
    )


def fused_qk_norm_rope(
    qkv: Any,
    num_heads_q: int,
    num_heads_k: int,
    num_heads_v: int,
    head_dim: int,
    eps: float,
    q_weight: Any,
    k_weight: Any,
    cos_sin_cache: Any,
    is_neox: bool,
    position_ids: Any,
    *,
    key_cache: Any = None,
    value_cache: Any = None,
    slot_mapping: Any = None,
    kv_cache_dtype: str = "auto",
    k_scale: Any = None,
    v_scale: Any = None,
    stream: Optional[int] = None,
    pdl: bool = False,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
) -> None:
    """vLLM's ``fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps,
    q_weight, k_weight, cos_sin_cache, is_neox, position_ids)``: in place on the packed ``qkv``
    ``[num_tokens, (num_heads_q + num_heads_k + num_heads_v) * head_dim]``, every q and k head is
    RMS-normalised, ``x / sqrt(mean(x**2) + eps) * weight`` (``q_weight``, ``k_weight``:
    ``[head_dim]`` of qkv's dtype), then rotated at ``position_ids`` ``[num_tokens]``
    (int32/int64) with ``cos_sin_cache`` ``[max_position, rotary_dim]`` (the first
    ``rotary_dim`` features of each head rotate, those past them are normalised only); computed
    in float32 and rounded once. v is left as it is.

    With ``key_cache``, ``value_cache`` and ``slot_mapping`` (and ``kv_cache_dtype``,
    ``k_scale``, ``v_scale``), the normalised, rotated k and the v heads also go into vLLM's
    paged KV cache in the same launch, as :func:`rotary_embedding` describes.

    With ``mrope_section`` (and ``mrope_interleaved``), as ``apply_rope``'s, ``position_ids`` is
    mRoPE's ``[3, num_tokens]``: Qwen3-VL's QK-norm with interleaved mRoPE in one launch (a
    rope-rs extension; vLLM's kernel takes one position per token).

    Launched on ``stream``, by default PyTorch's current stream; ``pdl`` as in ``apply_rope``.
    Under ``torch.compile`` it is ``torch.ops.rope_rs.fused_qk_norm_rope_``. Raises as
    ``apply_rope``.
    """
    section = None if mrope_section is None else [int(n) for n in mrope_section]
    launch = _eager_stream(qkv, stream)
    if launch is None:
        import rope_rs.torch as ops  # registers the operators (once; dynamo runs the import)

        ops.fused_qk_norm_rope_op(
            qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache,
            is_neox, position_ids, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, pdl,
            section, bool(mrope_interleaved),
        )
        return
    stream, sync = launch
    _native.fused_qk_norm_rope(
        qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache, is_neox,
        position_ids, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, stream, sync, pdl,
        section, mrope_interleaved,
    )


def _nope(x: Any) -> Any:
    """A non-rotary part with features, else None (FlashInfer's zero-feature tensors carry
    nothing)."""
    return x if x is not None and x.shape[-1] != 0 else None


def _quantize_dtype(torch: Any, quantize_dtype: Any, outs: Tuple[Any, ...]) -> Any:
    """FlashInfer's choice of the FP8 type: `quantize_dtype`, else the first output's, else
    float8_e4m3fn."""
    if quantize_dtype is None:
        quantize_dtype = torch.float8_e4m3fn
        for o in outs:
            if o is not None:
                quantize_dtype = o.dtype
                break
    if quantize_dtype is not torch.float8_e4m3fn and quantize_dtype is not torch.float8_e5m2:
        raise ValueError(f"quantize_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {quantize_dtype}")
    return quantize_dtype


def _torch_tensors(q_rope: Any, fn: str) -> Any:
    torch = _torch_of(q_rope)
    if torch is None:
        raise TypeError(f"{fn}: q_rope must be a torch.Tensor, got {type(q_rope).__name__}")
    return torch


def _nope_out(out: Any, nope: Any, rope_out: Any, dtype: Any) -> Any:
    """The output of a non-rotary part: `out` if given, else one of `nope`'s shape
    (FlashInfer's ``empty_like``), or without `nope` the rotated part's output's zero-feature
    view (the shape FlashInfer allocates; eager calls get one kept per shape from the native
    call)."""
    if out is not None:
        return out
    if nope is not None:
        return nope.new_empty(nope.shape, dtype=dtype)
    return rope_out[..., :0]


def _eager_torch(x: Any) -> bool:
    """Whether `x` is a ``torch.Tensor`` of an eager call (not traced by ``torch.compile``):
    then a drop-in hands FlashInfer's arguments whole to its native eager call."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and not torch.compiler.is_compiling()


def rope_quantize_fp8(
    q_rope: Any,
    k_rope: Any,
    q_nope: Any,
    k_nope: Any,
    cos_sin_cache: Any,
    pos_ids: Any,
    is_neox: bool = True,
    quantize_dtype: Any = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    q_rope_out: Any = None,
    k_rope_out: Any = None,
    q_nope_out: Any = None,
    k_nope_out: Any = None,
    enable_pdl: bool = False,
    *,
    stream: Optional[int] = None,
) -> Tuple[Any, Any, Any, Any]:
    """FlashInfer's ``rope_quantize_fp8`` for ``torch.Tensor``s: rotates ``q_rope`` ``[nnz,
    num_qo_heads, rope_dim]`` and ``k_rope`` ``[nnz, num_kv_heads, rope_dim]`` (``[nnz,
    rope_dim]`` for MLA) at ``pos_ids`` ``[nnz]`` with ``cos_sin_cache`` ``[max_seq_len,
    rope_dim]`` (cosines, then sines; float32 as FlashInfer asks, or q_rope's dtype) and returns
    ``(q_rope_out, k_rope_out, q_nope_out, k_nope_out)``: FP8 (``quantize_dtype``,
    float8_e4m3fn or float8_e5m2; by default the first output's type, else E4M3) of ``x *
    quant_scale_q`` and ``x * quant_scale_kv``, rounded to nearest even and saturated, one
    launch. The non-rotary parts ``q_nope`` ``[nnz, num_qo_heads, no_rope_dim]`` and ``k_nope``
    (``[nnz, num_kv_heads, no_rope_dim]``, or ``[nnz, no_rope_dim]`` for MLA; ``no_rope_dim`` a
    multiple of 16 bytes) are stored unrotated into ``q_nope_out`` and ``k_nope_out`` as FP8 of
    ``x * quant_scale_q`` and ``x * quant_scale_kv`` in the same launch. Outputs not given are
    allocated; with no ``q_nope``/``k_nope`` their outputs have no features (zero-element
    tensors that successive calls may share).
    ``enable_pdl`` as ``pdl`` in ``apply_rope``. Under ``torch.compile`` it is
    ``torch.ops.rope_rs.rope_quantize_fp8_``.
    """
    if _eager_torch(q_rope):
        outs = _native._rope_quantize_fp8_eager(
            q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox, quantize_dtype, quant_scale_q,
            quant_scale_kv, q_rope_out, k_rope_out, q_nope_out, k_nope_out, enable_pdl, stream,
        )
        if outs is not None:
            return outs
    torch = _torch_tensors(q_rope, "rope_quantize_fp8")
    dtype = _quantize_dtype(torch, quantize_dtype, (q_rope_out, k_rope_out, q_nope_out, k_nope_out))
    if q_rope_out is None:
        q_rope_out = torch.empty_like(q_rope, dtype=dtype)
    if k_rope_out is None:
        k_rope_out = torch.empty_like(k_rope, dtype=dtype)
    launch = _eager_stream(q_rope, stream)
    q_nope_out = _nope_out(q_nope_out, q_nope, q_rope_out, dtype)
    k_nope_out = _nope_out(k_nope_out, k_nope, k_rope_out, dtype)
    # The non-rotary parts that have features, with their outputs (None: nothing to store).
    q_nope, k_nope = _nope(q_nope), _nope(k_nope)
    q_part_out = None if q_nope is None else q_nope_out
    k_part_out = None if k_nope is None else k_nope_out
    name = "float8_e5m2" if dtype == torch.float8_e5m2 else "float8_e4m3fn"
    if launch is None:
        import rope_rs.torch as ops  # registers the operators (once; dynamo runs the import)

        ops.rope_quantize_fp8_op(
            q_rope, k_rope, cos_sin_cache, pos_ids, is_neox, name, float(quant_scale_q), float(quant_scale_kv),
            q_rope_out, k_rope_out, enable_pdl, q_nope, q_part_out, k_nope, k_part_out,
        )
    else:
        stream, sync = launch
        _native.rope_quantize_fp8(
            q_rope, k_rope, cos_sin_cache, pos_ids, is_neox, q_rope.shape[-1], name, quant_scale_q, quant_scale_kv,
            q_rope_out, k_rope_out, stream, sync, enable_pdl, q_nope, q_part_out, k_nope, k_part_out,
        )
    return q_rope_out, k_rope_out, q_nope_out, k_nope_out


def mla_rope_quantize_fp8(
    q_rope: Any,
    k_rope: Any,
    q_nope: Any,
    k_nope: Any,
    cos_sin_cache: Any,
    pos_ids: Any,
    is_neox: bool = True,
    quantize_dtype: Any = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    q_rope_out: Any = None,
    k_rope_out: Any = None,
    q_nope_out: Any = None,
    k_nope_out: Any = None,
    enable_pdl: bool = False,
    *,
    stream: Optional[int] = None,
) -> Tuple[Any, Any, Any, Any]:
    """FlashInfer's ``mla_rope_quantize_fp8``: :func:`rope_quantize_fp8` with MLA's 2-D
    ``k_rope`` ``[nnz, rope_dim]`` (one shared head)."""
    return rope_quantize_fp8(
        q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox, quantize_dtype, quant_scale_q,
        quant_scale_kv, q_rope_out, k_rope_out, q_nope_out, k_nope_out, enable_pdl, stream=stream,
    )


def rope_quantize_fp8_append_paged_kv_cache(
    q_rope: Any,
    k_rope: Any,
    q_nope: Any,
    k_nope: Any,
    v: Any,
    cos_sin_cache: Any,
    pos_ids: Any,
    paged_kv_cache: Tuple[Any, Any],
    kv_indices: Any,
    kv_indptr: Any,
    batch_indices: Any,
    positions: Any,
    is_neox: bool = True,
    quantize_dtype: Any = None,
    quant_scale_q: float = 1.0,
    quant_scale_kv: float = 1.0,
    page_size: int = 16,
    kv_layout: str = "NHD",
    q_rope_out: Any = None,
    q_nope_out: Any = None,
    enable_pdl: bool = False,
    *,
    stream: Optional[int] = None,
) -> Tuple[Any, Any]:
    """FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache`` in one launch: q as
    :func:`rope_quantize_fp8` (into ``q_rope_out``, ``q_nope`` into ``q_nope_out``), and k and v
    as FP8 of ``x * quant_scale_kv`` into the paged caches. GQA/MHA (3-D ``k_rope``):
    ``paged_kv_cache = (k_cache, v_cache)``, ``[max_pages, page_size, num_kv_heads, head_dim]``
    (``kv_layout="NHD"``) or ``[max_pages, num_kv_heads, page_size, head_dim]`` (``"HND"``) of
    the FP8 type, ``head_dim = rope_dim + no_rope_dim``: each k head's rotated features at
    ``[:rope_dim]``, its ``k_nope`` features after them, and ``v`` (``[nnz, num_kv_heads,
    head_dim]``) whole. MLA (2-D ``k_rope`` ``[nnz, rope_dim]``, ``v`` None): ``paged_kv_cache =
    (ckv_cache, kpe_cache)``, ``[max_pages, page_size, no_rope_dim]`` and ``[max_pages,
    page_size, rope_dim]``: ``k_nope`` ``[nnz, no_rope_dim]`` into ``ckv_cache``, the rotated k
    into ``kpe_cache``. Token ``t`` of request ``b = batch_indices[t]`` at ``positions[t]`` goes
    to entry ``positions[t] % page_size`` of page ``kv_indices[kv_indptr[b] + positions[t] //
    page_size]``; a negative ``b`` (padding) writes nothing, and so does an entry outside the
    request's pages or the arrays (device metadata is checked before it addresses anything;
    FlashInfer does not check it). Returns ``(q_rope_out, q_nope_out)``. Under
    ``torch.compile`` it is ``torch.ops.rope_rs.rope_quantize_fp8_append_paged_kv_cache_``.
    """
    if _eager_torch(q_rope):
        outs = _native._rope_quantize_fp8_append_eager(
            q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, paged_kv_cache, kv_indices, kv_indptr,
            batch_indices, positions, is_neox, quantize_dtype, quant_scale_q, quant_scale_kv, page_size, kv_layout,
            q_rope_out, q_nope_out, enable_pdl, stream,
        )
        if outs is not None:
            return outs
    torch = _torch_tensors(q_rope, "rope_quantize_fp8_append_paged_kv_cache")
    mla = k_rope.dim() == 2
    if mla and v is not None:
        raise ValueError("v: MLA's form (2-D k_rope) takes no v: pass None")
    if not mla and v is None:
        raise ValueError("v: GQA/MHA expects a V tensor")
    if len(paged_kv_cache) != 2:
        raise ValueError("paged_kv_cache must be a tuple of 2 tensors")
    # rope-host's k cache takes the rotated k, its v cache v or (MLA) k's latent part.
    k_cache, v_cache = paged_kv_cache if not mla else paged_kv_cache[::-1]
    dtype = _quantize_dtype(torch, quantize_dtype, (q_rope_out, q_nope_out))
    if k_cache.dtype != dtype or v_cache.dtype != dtype:
        raise ValueError(f"paged_kv_cache: expected {dtype}, got k={k_cache.dtype}, v={v_cache.dtype}")
    if q_rope_out is None:
        q_rope_out = torch.empty_like(q_rope, dtype=dtype)
    launch = _eager_stream(q_rope, stream)
    q_nope_out = _nope_out(q_nope_out, q_nope, q_rope_out, dtype)
    q_nope, k_nope = _nope(q_nope), _nope(k_nope)
    q_part_out = None if q_nope is None else q_nope_out
    if mla and k_nope is None:
        raise ValueError("k_nope: MLA's form writes k's latent features into ckv_cache; pass them")
    # FlashInfer's own conversions (no copy for int32 tensors).
    kv_indices, kv_indptr, batch_indices, positions = [
        t if t.dtype == torch.int32 else t.int() for t in (kv_indices, kv_indptr, batch_indices, positions)
    ]
    name = "float8_e5m2" if dtype == torch.float8_e5m2 else "float8_e4m3fn"
    if launch is None:
        import rope_rs.torch as ops  # registers the operators (once; dynamo runs the import)

        ops.rope_quantize_fp8_append_paged_kv_cache_op(
            q_rope, k_rope, v, cos_sin_cache, pos_ids, k_cache, v_cache, kv_indices, kv_indptr, batch_indices,
            positions, is_neox, name, float(quant_scale_q), float(quant_scale_kv), page_size, kv_layout, q_rope_out,
            enable_pdl, q_nope, q_part_out, k_nope,
        )
    else:
        stream, sync = launch
        _native.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k_rope, v, cos_sin_cache, pos_ids, k_cache, v_cache, kv_indices, kv_indptr, batch_indices,
            positions, is_neox, q_rope.shape[-1], name, quant_scale_q, quant_scale_kv, page_size, kv_layout,
            q_rope_out, stream, sync, enable_pdl, q_nope, q_part_out, k_nope,
        )
    return q_rope_out, q_nope_out


def apply_rotary_pos_emb(
    q: Any, k: Any, cos: Any, sin: Any, position_ids: Any = None, unsqueeze_dim: int = 1
) -> Tuple[Any, Any]:
    """Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin, position_ids=None,
    unsqueeze_dim=1)`` (``transformers.models.llama.modeling_llama``) for ``torch.Tensor``s:
    returns new ``(q_embed, k_embed)``, differentiable. See
    ``rope_rs.torch.apply_rotary_pos_emb``; to patch a model::

        import transformers.models.llama.modeling_llama as llama
        llama.apply_rotary_pos_emb = rope_rs.apply_rotary_pos_emb
    """
    eager = _HF_EAGER[0] if _HF_EAGER else _hf_eager()
    return eager(q, k, cos, sin, position_ids, unsqueeze_dim)


# `_torch_eager.apply_rotary_pos_emb` once imported (the import needs torch, and a model calls
# this function once per layer).
_HF_EAGER: list = []


def _hf_eager() -> Any:
    from rope_rs import _torch_eager

    _HF_EAGER[:] = [_torch_eager.apply_rotary_pos_emb]
    return _HF_EAGER[0]


# Last: the module reads rope_rs.apply_rope when called.
from rope_rs.dual_chunk import DualChunkRotaryEmbedding  # noqa: E402
from rope_rs.mrope import MRotaryEmbedding  # noqa: E402
from rope_rs.fope import FourierRotaryEmbedding  # noqa: E402
from rope_rs.dit import fused_qk_rmsnorm_rope  # noqa: E402
from rope_rs.training import qk_norm_rope  # noqa: E402
