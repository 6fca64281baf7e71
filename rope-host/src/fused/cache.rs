//! The cache write of a fused launch, as the safe API takes it: the layout of a paged cache
//! ([`CacheLayout`]), its data in the tensors' type, FP8 or NVFP4 ([`CacheData`],
//! [`Nvfp4Cache`]), each token's slot ([`CacheAddress`], [`PageTable`]) and k's non-rotary part
//! ([`CacheNonRotary`]), together a [`KvCache`]. Their checks are in `cache_checks.rs`.

use cudarc::driver::{CudaView, CudaViewMut};

use super::{Fp8Format, Fp8Scale};
use crate::op::Tensor;
use crate::positions::DeviceInts;

/// The element layout of a paged KV cache (one for k's cache and v's): slot `s` is row
/// `s % block_size` of block `s / block_size`, and element `e` of head `h` of that row is at
/// `block * strides[0] + row * strides[1] + h * strides[2] + e`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLayout {
    /// Blocks (pages).
    pub num_blocks: usize,
    /// Rows (tokens) per block.
    pub block_size: usize,
    /// Heads per row: k's heads.
    pub kv_heads: usize,
    /// Elements per head: the config's `head_dim`.
    pub head_dim: usize,
    /// Element strides of a block, a row and a head.
    pub strides: [usize; 3],
}

impl CacheLayout {
    /// vLLM's `[num_blocks, block_size, kv_heads, head_dim]` (FlashAttention's paged layout,
    /// FlashInfer's NHD), contiguous.
    pub fn blocks_rows_heads(
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        Self {
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            strides: [
                block_size * kv_heads * head_dim,
                kv_heads * head_dim,
                head_dim,
            ],
        }
    }

    /// The byte strides of NVFP4 block scales laid out as this layout's elements, one byte per
    /// 16 elements (a scale pool mirroring the codes', as TensorRT-LLM's): the strides over 16.
    pub fn nvfp4_scale_strides(&self) -> [usize; 3] {
        self.strides.map(|s| s / 16)
    }

    /// `[num_blocks, kv_heads, block_size, head_dim]` (FlashInfer's HND), contiguous.
    pub fn blocks_heads_rows(
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        Self {
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            strides: [
                kv_heads * block_size * head_dim,
                head_dim,
                block_size * head_dim,
            ],
        }
    }
}

/// The caches k and v are written into: in the tensors' type, as FP8, or as NVFP4.
#[derive(Debug)]
pub enum CacheData<'a, T> {
    /// Elements of the tensors' type.
    Elem {
        /// k's cache.
        k: CudaViewMut<'a, T>,
        /// v's cache.
        v: CudaViewMut<'a, T>,
    },
    /// FP8 bits, `fp8(value / scale)` (or `fp8(value * multiplier)`).
    Fp8 {
        /// k's cache.
        k: CudaViewMut<'a, u8>,
        /// v's cache.
        v: CudaViewMut<'a, u8>,
        /// Per tensor or per kv head, or a multiplier.
        k_scale: Fp8Scale<'a>,
        /// Per tensor or per kv head, or a multiplier.
        v_scale: Fp8Scale<'a>,
        /// E4M3 or E5M2, both caches.
        format: Fp8Format,
    },
    /// NVFP4 ([`Nvfp4Cache`]): FP4 E2M1 codes with an FP8 E4M3 scale per 16 elements and a
    /// global scale. Stored by four-heads kernels of their own: whole-head rotations, slot
    /// mappings, no non-rotary part, tensors below 2^32 elements at the widest access.
    Nvfp4 {
        /// k's cache.
        k: Nvfp4Cache<'a>,
        /// v's cache.
        v: Nvfp4Cache<'a>,
        /// Byte strides of a block, a row and a head in both caches' block scales (each head's
        /// `head_dim / 16` scales consecutive bytes); [`CacheLayout::nvfp4_scale_strides`] for
        /// scales laid out as the codes.
        scale_strides: [usize; 3],
    },
}

/// One NVFP4 cache (k's or v's), two-level as TensorRT-LLM's: each block of 16 consecutive
/// elements `x` of a head (k rotated and normalised as stored elsewhere, v as read) is stored
/// with `m = 1 / scale` as the block scale `b = e4m3(max |x_e| * m / 6)` (nearest even,
/// saturating at 448) and the codes `e2m1(x_e * m / b)` (nearest even, saturating at 6;
/// zeros where `b` is 0), so that `x_e ~ e2m1_e * b * scale`.
///
/// Layout: the [`CacheLayout`] gives each element's offset `e` in elements (so its strides
/// are twice the codes' byte strides: multiples of 8; `head_dim` a multiple of 16, and of 32
/// for NeoX pairs so that no block spans the two halves' vectors). Its code is byte `e / 2` of
/// `codes` (the low four bits for even `e`, bit 3 the sign; torch's `float4_e2m1fn_x2` order),
/// `codes` aligned to 4 bytes. Block `b` (elements `16 b .. 16 b + 16`) of head `h` in slot
/// `(block, row)` has its scale at byte `block * s[0] + row * s[1] + h * s[2] + b` of
/// `block_scales`, `s` the [`CacheData::Nvfp4`]'s `scale_strides`. (Scales inside the codes'
/// rows, as vLLM's packed NVFP4 cache keeps them, are one buffer: [`super::RawNvfp4Cache`].)
#[derive(Debug)]
pub struct Nvfp4Cache<'a> {
    /// The E2M1 codes, two a byte.
    pub codes: CudaViewMut<'a, u8>,
    /// The E4M3 block scales, one per 16 elements.
    pub block_scales: CudaViewMut<'a, u8>,
    /// The global scale (per tensor or per kv head, in device memory).
    pub scale: Fp8Scale<'a>,
}

/// Which cache slot each token's k and v go to. Device data: a slot outside the cache (or a
/// page-table entry outside its arrays) is skipped, never written.
#[derive(Debug)]
pub enum CacheAddress<'a> {
    /// vLLM's `slot_mapping`: one slot per token (`batch * seq`, `i32` or `i64`); a negative
    /// slot (padding) writes nothing.
    Slots(DeviceInts<'a>),
    /// FlashInfer's page table ([`PageTable`]).
    PageTable(PageTable<'a>),
}

/// FlashInfer's paged-KV addressing (`append_paged_kv_cache`,
/// `rope_quantize_fp8_append_paged_kv_cache`), all `i32`: token `t` of request `b =
/// batch_indices[t]` at position `p = positions[t]` in it goes to entry `p % page_size` of page
/// `kv_indices[kv_indptr[b] + p / page_size]` (`page_size` the layout's `block_size`). A
/// negative `b` (padding) writes nothing; so does a negative position or page, a request
/// without an entry in `kv_indptr`, or a page entry outside `kv_indptr[b] .. kv_indptr[b + 1]`
/// or `kv_indices` (FlashInfer's kernel does not check these).
#[derive(Debug)]
pub struct PageTable<'a> {
    /// The request of each token (`batch * seq`).
    pub batch_indices: CudaView<'a, i32>,
    /// Each token's position in its request (`batch * seq`).
    pub positions: CudaView<'a, i32>,
    /// Request `b`'s pages are entries `kv_indptr[b] .. kv_indptr[b + 1]` of `kv_indices`
    /// (requests + 1 entries).
    pub kv_indptr: CudaView<'a, i32>,
    /// Page numbers.
    pub kv_indices: CudaView<'a, i32>,
}

/// The paged-cache write of a fused launch.
#[derive(Debug)]
pub struct KvCache<'a, T> {
    /// Where each token's k and v go.
    pub address: CacheAddress<'a>,
    /// The layout of both caches.
    pub layout: CacheLayout,
    /// The caches.
    pub data: CacheData<'a, T>,
    /// k's features outside the rotation, written into a cache with the rotated ones.
    pub non_rotary: Option<CacheNonRotary<'a, T>>,
}

/// k's features outside the rotation in a tensor of their own (FlashInfer's `k_nope` in
/// `rope_quantize_fp8_append_paged_kv_cache`, vLLM's MLA `kv_c`), written unrotated into a cache
/// in the same launch as the rotated ones, for each token that has a slot: `fp8(x / scale)` or
/// `fp8(x * multiplier)` in the cache's format with k's scale ([`CacheData::Fp8`]), or as they
/// are ([`CacheData::Elem`]; a latent cache's address then aligned to 16 bytes).
///
/// Layout: `input` is `[batch, seq, kv_heads, nope_dim]` with k's batch, seq and heads, tokens
/// at one stride, as [`super::NonRotary`]'s input (`nope_dim`, strides and offset multiples of one
/// 16-byte access; q's non-rotary part, if any, of the same `nope_dim`). Runs on the
/// token-heads kernels of FlashInfer's forms.
#[derive(Debug)]
pub struct CacheNonRotary<'a, T> {
    /// Read only.
    pub input: Tensor<'a, T>,
    /// Which cache it goes to.
    pub into: NonRotaryCache,
}

/// Where [`CacheNonRotary`]'s part goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NonRotaryCache {
    /// GQA/MHA (FlashInfer's `k_cache` heads of `rope_dim + no_rope_dim`): each cache head
    /// holds `head_dim + nope_dim` elements (the [`CacheLayout`]'s `head_dim`), k's rotated
    /// features at `0..head_dim`, the part at `head_dim..`. v is as wide: its input heads hold
    /// `head_dim + nope_dim` elements, all stored into v's cache (in its format, with v's scale).
    AfterRotated,
    /// MLA (FlashInfer's `(ckv_cache, kpe_cache)`): the part goes into the cache's `v` buffer
    /// (the latent cache, `ckv_cache`), laid out by this layout (`kv_heads` k's heads, `head_dim`
    /// the part's `nope_dim`, the k cache's `num_blocks` and `block_size`), and the rotated k
    /// into the cache's `k` buffer (`kpe_cache`). The launch has no v; an FP8 cache stores the
    /// part with `k_scale` (the cache's `v_scale` is not used). Where the two layouts share their
    /// blocks, rows and block and row strides (vLLM's one MLA cache, `[num_blocks, block_size,
    /// kv_lora_rank + rot_dim]` with `k` and `v` its columns) and the part is a whole number of
    /// heads wide, one launch stores it with q's and k's heads.
    Latent(CacheLayout),
}
