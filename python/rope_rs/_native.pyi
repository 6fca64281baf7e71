"""Type stubs of the native module ``rope_rs._native`` (the calls under ``rope_rs``'s functions:
explicit outputs, explicit stream, no PyTorch)."""

from typing import Any, Literal, Optional, Sequence, Tuple, Union

__version__: str
SCALING_KEYS: list[str]

def apply_rope(
    q: Any,
    k: Optional[Any] = None,
    out: Optional[Any] = None,
    k_out: Optional[Any] = None,
    positions: Union[int, Any, None] = None,
    position_ids: Optional[Any] = None,
    cu_seqlens: Optional[Any] = None,
    layout: Optional[Literal["bshd", "sbhd", "bhsd", "thd"]] = None,
    style: Literal["neox", "interleaved"] = "neox",
    theta: Optional[float] = None,
    cos_sin_cache: Optional[Any] = None,
    cos: Optional[Any] = None,
    sin: Optional[Any] = None,
    inv_freq: Union[Any, Sequence[float], None] = None,
    attention_factor: Optional[float] = None,
    angle: Optional[Literal["exact", "f32"]] = None,
    scaling: Optional[dict[str, Any]] = None,
    rotary_dim: Optional[int] = None,
    backward: bool = False,
    stream: int = 0,
    producer_sync: bool = True,
    cp_size: int = 1,
    cp_rank: int = 0,
    pdl: bool = False,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
    axes_dim: Optional[Sequence[int]] = None,
) -> None:
    """Rotates q (and k) by RoPE on ``stream``: into ``out``/``k_out`` when given, else in place.

    q, k, out, k_out: CUDA DLPack tensors (float32/float16/bfloat16) by ``layout``: "bshd"
    ``[batch, seq, heads, head_dim]`` (4-D default), "sbhd", "bhsd", or "thd" ``[tokens, heads,
    head_dim]`` (3-D); contiguous last dimension. Positions: ``positions`` (int offset or
    ``[batch]`` tensor), ``position_ids`` (``[seq]`` or ``[batch, seq]``) or ``cu_seqlens``
    (``[num_seqs + 1]``, with ``positions`` ``[num_seqs]`` offsets). sin/cos: ``theta``,
    ``scaling`` (HF rope_scaling dict), ``inv_freq`` (CUDA float64 or host floats, with
    ``attention_factor``), ``cos_sin_cache`` ``[max_position, rotary_dim]`` or ``cos``/``sin``
    ``[max_position, rotary_dim / 2]``. ``stream``: a ``CUstream`` handle (0: legacy default);
    ``producer_sync=False`` passes ``stream=-1`` to ``__dlpack__`` (the caller ordered the writes).
    ``cp_size``/``cp_rank``: context-parallel split of ``cu_seqlens`` sequences. ``pdl``:
    programmatic dependent launch (sm_90+, decode-sized launches; same results).
    ``mrope_section`` (three pair counts) makes ``position_ids`` mRoPE's ``[3, batch, seq]`` or
    ``[3, tokens]``, in blocks or (``mrope_interleaved``) Qwen3-VL's interleaved order;
    ``axes_dim`` (FLUX's) makes it ``[n_axes, ...]`` with axial frequencies from ``theta``.
    Raises TypeError, ValueError naming the argument, RuntimeError (CUDA driver).
    """

def concat_and_cache_mla_rope_fused(
    positions: Any,
    q_pe: Any,
    k_pe: Any,
    kv_c: Any,
    cos_sin_cache: Any,
    is_neox: bool,
    slot_mapping: Any,
    kv_cache: Any,
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
    kv_cache_scale: Any,
    rot_dim: int,
    stream: int = 0,
    producer_sync: bool = True,
    pdl: bool = False,
) -> None:
    """vLLM's ``concat_and_cache_mla_rope_fused``: rotates ``q_pe`` ``[num_tokens, num_heads,
    rot_dim]`` and ``k_pe`` ``[num_tokens, rot_dim]`` in place and writes ``[kv_c | rotated
    k_pe]`` into ``kv_cache`` ``[num_blocks, block_size, kv_lora_rank + rot_dim]`` at
    ``slot_mapping``, in q_pe's dtype ("auto") or FP8 of ``x / kv_cache_scale``. Every token row
    is taken (``rope_rs.concat_and_cache_mla_rope_fused`` cuts them to ``slot_mapping``'s
    length).
    """

def rotary_embedding(
    positions: Any,
    query: Any,
    key: Optional[Any],
    head_size: int,
    cos_sin_cache: Any,
    is_neox: bool,
    value: Optional[Any] = None,
    key_cache: Optional[Any] = None,
    value_cache: Optional[Any] = None,
    slot_mapping: Optional[Any] = None,
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4"] = "auto",
    k_scale: Optional[Any] = None,
    v_scale: Optional[Any] = None,
    stream: int = 0,
    producer_sync: bool = True,
    pdl: bool = False,
) -> None:
    """vLLM's ``rotary_embedding``: rotates query and key ``[num_tokens, num_heads * head_size]``
    in place at ``positions`` ``[num_tokens]`` with ``cos_sin_cache`` ``[max_position,
    rotary_dim]``; with ``key_cache``, ``value_cache`` (``[num_blocks, block_size, kv_heads,
    head_size]``) and ``slot_mapping`` also writes the rotated key and ``value`` into them."""

def apply_rope_with_cos_sin_cache_inplace(
    positions: Any,
    query: Any,
    key: Optional[Any],
    head_size: int,
    cos_sin_cache: Any,
    is_neox: bool = True,
    fused_set_kv_buffer_arg: Optional[Any] = None,
    stream: int = 0,
    producer_sync: bool = True,
    pdl: bool = False,
) -> None:
    """SGLang's (and FlashInfer's) ``apply_rope_with_cos_sin_cache_inplace``: as
    ``rotary_embedding``, and with ``fused_set_kv_buffer_arg`` (``value``, ``k_buffer``,
    ``v_buffer``, ``cache_loc``) writes the rotated key and value into pool rows ``cache_loc``."""

def _apply_rope_with_cos_sin_cache_inplace_eager(
    positions: Any,
    query: Any,
    key: Optional[Any],
    head_size: int,
    cos_sin_cache: Any,
    is_neox: bool,
    fused_set_kv_buffer_arg: Any,
    pdl: bool,
    stream: Optional[int],
) -> bool:
    """``rope_rs.apply_rope_with_cos_sin_cache_inplace``'s eager call for ``torch.Tensor``s:
    whether it launched (on ``stream``, else PyTorch's current stream)."""

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
    key_cache: Optional[Any] = None,
    value_cache: Optional[Any] = None,
    slot_mapping: Optional[Any] = None,
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4"] = "auto",
    k_scale: Optional[Any] = None,
    v_scale: Optional[Any] = None,
    stream: int = 0,
    producer_sync: bool = True,
    pdl: bool = False,
    mrope_section: Optional[Sequence[int]] = None,
    mrope_interleaved: bool = False,
) -> None:
    """vLLM's ``fused_qk_norm_rope``: RMS-normalises and rotates the q and k heads of the packed
    ``qkv`` in place; with a cache, also writes k and v into it. ``mrope_section`` makes
    ``position_ids`` mRoPE's ``[3, num_tokens]``."""

def rope_quantize_fp8(
    q_rope: Any,
    k_rope: Any,
    cos_sin_cache: Any,
    pos_ids: Any,
    is_neox: bool,
    rope_dim: int,
    quantize_dtype: Literal["float8_e4m3fn", "float8_e5m2"],
    quant_scale_q: float,
    quant_scale_kv: float,
    q_rope_out: Any,
    k_rope_out: Any,
    stream: int = 0,
    producer_sync: bool = True,
    pdl: bool = False,
    q_nope: Any = None,
    q_nope_out: Any = None,
    k_nope: Any = None,
    k_nope_out: Any = None,
) -> None:
    """FlashInfer's ``rope_quantize_fp8``: rotates q_rope and k_rope into FP8 ``q_rope_out``
    and ``k_rope_out`` of ``x * quant_scale``, and stores the non-rotary parts ``q_nope`` and
    ``k_nope`` (when given, with their outputs) as FP8 of ``x * quant_scale``, unrotated."""

def rope_quantize_fp8_append_paged_kv_cache(
    q_rope: Any,
    k_rope: Any,
    v: Optional[Any],
    cos_sin_cache: Any,
    pos_ids: Any,
    k_cache: Any,
    v_cache: Any,
    kv_indices: Any,
    kv_indptr: Any,
    batch_indices: Any,
    positions: Any,
    is_neox: bool,
    rope_dim: int,
    quantize_dtype: Literal["float8_e4m3fn", "float8_e5m2"],
    quant_scale_q: float,
    quant_scale_kv: float,
    page_size: int,
    kv_layout: Literal["NHD", "HND"],
    q_rope_out: Any,
    stream: int = 0,
    producer_sync: bool = True,
    pdl: bool = False,
    q_nope: Any = None,
    q_nope_out: Any = None,
    k_nope: Any = None,
) -> None:
    """FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache``: q into FP8 ``q_rope_out``
    (``q_nope`` into ``q_nope_out``), the rotated k, ``k_nope`` after it and v into FP8 paged
    caches by the page table (GQA/MHA), or with ``v`` None the rotated k into ``k_cache``
    (``kpe_cache``) and ``k_nope`` into ``v_cache`` (``ckv_cache``, MLA)."""

def _rope_quantize_fp8_eager(
    q_rope: Any,
    k_rope: Any,
    q_nope: Optional[Any],
    k_nope: Optional[Any],
    cos_sin_cache: Any,
    pos_ids: Any,
    is_neox: bool,
    quantize_dtype: Optional[Any],
    quant_scale_q: float,
    quant_scale_kv: float,
    q_rope_out: Optional[Any],
    k_rope_out: Optional[Any],
    q_nope_out: Optional[Any],
    k_nope_out: Optional[Any],
    enable_pdl: bool,
    stream: Optional[int],
) -> Optional[Tuple[Any, Any, Any, Any]]:
    """``rope_rs.rope_quantize_fp8``'s eager call for ``torch.Tensor``s (FlashInfer's arguments
    as given): the four outputs after the launch, or None where the wrapper takes the call."""

def _rope_quantize_fp8_append_eager(
    q_rope: Any,
    k_rope: Any,
    q_nope: Optional[Any],
    k_nope: Optional[Any],
    v: Optional[Any],
    cos_sin_cache: Any,
    pos_ids: Any,
    paged_kv_cache: Any,
    kv_indices: Any,
    kv_indptr: Any,
    batch_indices: Any,
    positions: Any,
    is_neox: bool,
    quantize_dtype: Optional[Any],
    quant_scale_q: float,
    quant_scale_kv: float,
    page_size: int,
    kv_layout: str,
    q_rope_out: Optional[Any],
    q_nope_out: Optional[Any],
    enable_pdl: bool,
    stream: Optional[int],
) -> Optional[Tuple[Any, Any]]:
    """``rope_rs.rope_quantize_fp8_append_paged_kv_cache``'s eager call for ``torch.Tensor``s:
    ``(q_rope_out, q_nope_out)`` after the launch, or None where the wrapper takes the call."""

def _hf_key(q: Any, cos: Any, sin: Any, unsqueeze_dim: int) -> Optional[Tuple[int, int, int, int, int, int]]:
    """The key under which ``rope_rs._torch_eager`` keeps the tables made of ``cos`` and ``sin``
    for ``q``; None when they cannot be read as CUDA tensors or the shapes do not fit."""

def _apply_rotary_pos_emb_eager(q: Any, k: Optional[Any], unsqueeze_dim: int, kept: Tuple[Any, ...]) -> Optional[Tuple[Any, Any]]:
    """Hugging Face's drop-in with the kept tables ``kept``: new ``(q_embed, k_embed)``, or None
    where the Python function decides."""

def frequencies(
    head_dim: int,
    *,
    theta: Optional[float] = None,
    scaling: Optional[dict[str, Any]] = None,
    rotary_dim: Optional[int] = None,
    angle: Optional[Literal["exact", "f32"]] = None,
) -> Tuple[list[float], float]:
    """``(inv_freq, attention_factor)`` that ``apply_rope`` computes sin/cos from for these
    arguments, in float64 on the host."""

# Private: the DLPack C exchange API (``__dlpack_c_exchange_api__``), for rope_rs and its tests.

def _current_stream(tensor: Any) -> Optional[int]:
    """The producer's current work stream on ``tensor``'s CUDA device by its type's exchange API,
    or None (no usable API, switched off, not CUDA, or the producer failed)."""

def _exchange_api_used(tensor: Any) -> bool:
    """Whether ``tensor``'s type has an exchange API rope_rs uses (and it is switched on)."""

def _set_exchange_api(enabled: bool) -> bool:
    """Switches the exchange API on or off for this process; returns whether it was on."""

def _exchange_borrows() -> int:
    """Tensors borrowed through the exchange API in this process."""

def _dlpack_view(
    tensor: Any, *, producer_sync: bool, arg: str = "tensor"
) -> Tuple[int, str, list[int], list[int], int]:
    """``(address, dtype, shape, strides, device)`` as a launch with ``producer_sync`` reads
    ``tensor``."""

def _qk_norm_rope(
    q: Any,
    k: Any,
    q_out: Any,
    k_out: Any,
    q_weight: Any,
    k_weight: Any,
    cos_sin_cache: Any,
    positions: Any,
    head_size: int,
    eps: float,
    is_neox: bool,
    gemma: bool,
    stream: int,
) -> None:
    """The forward step of ``rope_rs.qk_norm_rope``: q and k normalised and rotated into
    ``q_out`` and ``k_out``."""

def _qk_norm_across_rope(
    q: Any,
    k: Any,
    q_out: Any,
    k_out: Any,
    q_weight: Optional[Any],
    k_weight: Optional[Any],
    cos_sin_cache: Any,
    positions: Any,
    sections: list[int],
    head_size: int,
    eps: float,
    is_neox: bool,
    fp8_multiplier: Optional[float],
    stream: int,
) -> None:
    """The launch of ``rope_rs.fused_qk_rmsnorm_rope``: q and k normalised across each token's
    heads (no norm without weights) and rotated at ``[3, tokens]`` positions whose pairs take
    their axis in blocks of ``sections``, into ``q_out`` and ``k_out`` (E4M3 of ``x *
    fp8_multiplier`` with one)."""

def _qk_norm_rope_workspace(tensor: Any, heads: int, head_size: int) -> int:
    """The float32 workspace ``_qk_norm_rope_backward`` needs on ``tensor``'s device."""

def _qk_norm_rope_backward(
    q: Any,
    k: Any,
    grad_q: Any,
    grad_k: Any,
    grad_q_input: Any,
    grad_k_input: Any,
    q_weight: Any,
    k_weight: Any,
    grad_q_weight: Any,
    grad_k_weight: Any,
    workspace: Any,
    cos_sin_cache: Any,
    positions: Any,
    head_size: int,
    eps: float,
    is_neox: bool,
    gemma: bool,
    stream: int,
) -> None:
    """The backward of ``rope_rs.qk_norm_rope``: the input and weight gradients."""
