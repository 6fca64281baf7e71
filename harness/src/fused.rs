//! The fused kernels' GPU harness (`Rope::run_fused`): a random fused case (`Case`, with its
//! cache in `CacheCase`), its host data (`Data`) uploaded (`upload`) and launched (`launch`),
//! and every output and cache byte compared with the f64 reference (`verify`, by
//! [`crate::tolerance`] for values and the E4M3 or E5M2 bracket for FP8 bytes); the fused GPU
//! tests drive it.

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rope_host::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use rope_host::{
    CacheAddress, CacheData, CacheLayout, CacheNonRotary, DeviceInts, Fp8Format, Fp8Scale, FusedIo,
    FusedOp, IdsShape, IntType, KOut, KvCache, Layout, NonRotary, NonRotaryCache, NormScope,
    NormWeight, Nvfp4Cache, PageTable, Positions, QOut, QkNorm, RawBuf, RawCacheAddress,
    RawCacheData, RawCacheNonRotary, RawFp8Scale, RawFusedIo, RawFusedOp, RawInts, RawIo, RawKOut,
    RawKvCache, RawNonRotary, RawNvfp4Cache, RawOp, RawPageTable, RawPositions, RawQOut, RawQkNorm,
    RawSinCos, RawTensor, Rope, RopeConfig, RopeOp, RopeStyle, SinCos, TableData, TableFormat,
    TableShape, Tensor, TensorMut,
};
use rope_kernels::math::{e2m1_to_f32, e4m3_to_f32, e5m2_to_f32};
use rope_reference::fused::{
    ElementScale, e2m1_bracket, e4m3_bracket, e5m2_bracket, page_table_slot, rms_norm, rotate_head,
};
use rope_reference::reference::inv_freq;

use crate::elem::TestElem;
use crate::tolerance::{self, Rotated};

pub const THETA: f64 = 10_000.0;
/// Positions stay below this (the tables' rows).
pub const MAX_POSITION: usize = 96;
/// The byte FP8 caches and outputs hold before a launch (the E4M3 value 61440 is not: 0x7b is
/// 2^8 * 1.375 = 352, a value a launch may write, so only bytes outside the written slots are
/// compared with it).
pub const POISON: u8 = 0x7b;

/// Where q goes.
#[derive(Clone, Copy, Debug)]
pub enum QMode {
    InPlace,
    Out,
    Fp8 { per_head: bool },
}

/// Where k goes.
#[derive(Clone, Copy, Debug)]
pub enum KMode {
    InPlace,
    Out,
    CacheOnly,
    /// An FP8 output (cases without a cache).
    Fp8 {
        per_head: bool,
    },
}

/// One random fused case.
#[derive(Clone, Debug)]
pub struct Case {
    pub style: RopeStyle,
    pub d: usize,
    /// The rotated features of each head, the first `rotary` of `d` (`d` but for partial
    /// rotations, whose features past them are normalised and stored unrotated).
    pub rotary: usize,
    pub batch: usize,
    pub seq: usize,
    pub hq: usize,
    pub hk: usize,
    /// Per-token ids, or an offset.
    pub ids: Option<Vec<i64>>,
    /// Multi-axis positions instead (mRoPE): they replace `ids` and `offset`.
    pub axes: Option<AxesCase>,
    pub offset: i64,
    pub table: bool,
    pub norm: Option<NormWeight>,
    /// Which features the norm normalises together: each head, or all of a token's heads of
    /// q (and of k) with weights of `heads * d`.
    pub scope: NormScope,
    pub q: QMode,
    pub k: KMode,
    pub cache: Option<CacheCase>,
    /// The format of every FP8 store of the case.
    pub fp8: Fp8Format,
    /// FP8 scales passed as multipliers by value (`1 / scale[0]`, FlashInfer's `quant_scale`)
    /// rather than as scale arrays.
    pub multipliers: bool,
    /// Features per head of the non-rotary parts stored beside q's and k's FP8 outputs
    /// (FlashInfer's `q_nope`, `k_nope`; 0: none), each part in a tensor of its own whose
    /// output heads are [`NOPE_PAD`] bytes apart.
    pub nope: usize,
    pub seed: u64,
}

/// Multi-axis positions of a case: pair `i` of token `t` rotates at `ids[map[i] * tokens + t]`.
#[derive(Clone, Debug)]
pub struct AxesCase {
    /// Rows of `ids` (1 to 4).
    pub n_axes: u32,
    /// Each rotated pair's axis (`rotary / 2` entries).
    pub map: Vec<u8>,
    /// `n_axes` rows of the tokens' positions.
    pub ids: Vec<i64>,
}

impl AxesCase {
    /// mRoPE of `half` pairs at `tokens` tokens: sections of about a quarter, three eighths and
    /// three eighths of the pairs, in blocks or interleaved, and random positions below
    /// [`MAX_POSITION`] (the first token of each five a text token: every axis at one
    /// position).
    pub fn mrope(rng: &mut StdRng, half: usize, tokens: usize, interleaved: bool) -> Self {
        let s1 = 3 * half / 8;
        let sections = [(half - 2 * s1) as u32, s1 as u32, s1 as u32];
        let map = if interleaved {
            rope_host::AxisMap::mrope_interleaved(sections, 2 * half as u32)
        } else {
            rope_host::AxisMap::mrope(sections, 2 * half as u32)
        }
        .expect("sections that sum to the pairs")
        .axes()
        .to_vec();
        let mut ids: Vec<i64> = (0..3 * tokens)
            .map(|_| rng.random_range(0..MAX_POSITION as i64))
            .collect();
        for t in (0..tokens).step_by(5) {
            (ids[tokens + t], ids[2 * tokens + t]) = (ids[t], ids[t]);
        }
        Self {
            n_axes: 3,
            map,
            ids,
        }
    }
}

/// Bytes between the heads of a non-rotary part's FP8 output (poisoned, never written).
pub const NOPE_PAD: usize = 16;

/// Where a cache case stores k's non-rotary part (the case's `nope` features of each k head;
/// see [`rope_host::NonRotaryCache`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheNope {
    /// Nowhere: the cache holds the rotated heads alone.
    None,
    /// After each k cache head's rotated features; v's heads and v's cache heads as wide.
    AfterRotated,
    /// Into the cache's v buffer as a latent cache of k's heads of `nope` features (MLA); no v.
    Latent,
}

/// A paged cache: FP8 or of the tensors' type, heads-first or rows-first blocks, and each
/// token's slot.
#[derive(Clone, Debug)]
pub struct CacheCase {
    pub fp8: bool,
    /// NVFP4 instead ([`Case::nvfp4_cache`]; `fp8` then false): codes in the FP8 caches'
    /// buffers, block scales in buffers of their own or, with `nvfp4_inline`, after each head's
    /// codes in the same rows (vLLM's packed form; launched by address).
    pub nvfp4: bool,
    pub nvfp4_inline: bool,
    pub heads_first: bool,
    pub block_size: usize,
    pub num_blocks: usize,
    pub slots: Vec<i64>,
    /// k's FP8 scales: one per kv head, or one for the tensor.
    pub k_per_head: bool,
    /// v's, drawn apart from k's.
    pub v_per_head: bool,
    /// Addressed by FlashInfer's page table rather than by `slots`; `slots` then holds the
    /// slot the reference finds for each token (`-1`: none).
    pub page_table: Option<PageTableCase>,
    /// Where k's non-rotary part goes (FP8 caches of FlashInfer's forms).
    pub nope: CacheNope,
}

/// A FlashInfer page table (all `i32`): see [`rope_host::PageTable`].
#[derive(Clone, Debug)]
pub struct PageTableCase {
    pub batch_indices: Vec<i32>,
    pub positions: Vec<i32>,
    pub kv_indptr: Vec<i32>,
    pub kv_indices: Vec<i32>,
}

impl PageTableCase {
    /// A table of 1-3 requests over the cache's `num_blocks` pages (each page in at most one
    /// request, in random order, at times one past the cache or negative), and for each token a
    /// distinct (request, position): mostly inside its request's pages, at times padding (a
    /// negative request), a request past `kv_indptr`, a negative position or one past the
    /// request's pages. Returns the table and each token's slot by
    /// [`rope_reference::fused::page_table_slot`] (`-1` for none).
    pub fn random(
        rng: &mut StdRng,
        tokens: usize,
        (num_blocks, block_size): (usize, usize),
    ) -> (Self, Vec<i64>) {
        let requests = rng.random_range(1..=3usize);
        let mut pages: Vec<i32> = (0..num_blocks as i32).collect();
        for i in (1..pages.len()).rev() {
            pages.swap(i, rng.random_range(0..=i));
        }
        match rng.random_range(0..4) {
            0 => pages.push(num_blocks as i32),
            1 => pages.push(-1),
            _ => {}
        }
        // Split the pages among the requests.
        let mut kv_indptr = vec![0i32];
        for r in 0..requests {
            let left = pages.len() - *kv_indptr.last().expect("one") as usize;
            let take = if r + 1 == requests {
                left
            } else {
                rng.random_range(0..=left)
            };
            kv_indptr.push(kv_indptr[r] + take as i32);
        }
        let mut used = std::collections::HashSet::new();
        let mut batch_indices = Vec::with_capacity(tokens);
        let mut positions = Vec::with_capacity(tokens);
        for _ in 0..tokens {
            let (b, p) = loop {
                let b = match rng.random_range(0..12) {
                    0 => -1,
                    1 => requests as i32,
                    _ => rng.random_range(0..requests as i32),
                };
                let own = if (0..requests as i32).contains(&b) {
                    (kv_indptr[b as usize + 1] - kv_indptr[b as usize]) as usize * block_size
                } else {
                    block_size
                };
                let p = match rng.random_range(0..12) {
                    0 => -1,
                    1 => (own + rng.random_range(0..block_size)) as i32,
                    _ => rng.random_range(0..own.max(1)) as i32,
                };
                // Distinct (request, position) pairs address distinct slots.
                if b < 0 || p < 0 || used.insert((b, p)) {
                    break (b, p);
                }
            };
            batch_indices.push(b);
            positions.push(p);
        }
        let table = PageTableCase {
            batch_indices,
            positions,
            kv_indptr,
            kv_indices: pages,
        };
        let slots = (0..tokens)
            .map(|t| {
                page_table_slot(
                    (&table.kv_indices, &table.kv_indptr),
                    (&table.batch_indices, &table.positions),
                    block_size,
                    t,
                )
                .map_or(-1, |(page, entry)| (page * block_size + entry) as i64)
            })
            .collect();
        (table, slots)
    }
}

impl CacheCase {
    /// A cache of a few blocks more than `tokens` need, its slots distinct and in random
    /// order, some padding (-1) and at times one past the cache; both scale granularities
    /// drawn independently.
    pub fn random(rng: &mut StdRng, tokens: usize) -> Self {
        let block_size: usize = [1, 4, 16][rng.random_range(0..3)];
        let num_blocks = (tokens + 3).div_ceil(block_size) + rng.random_range(0..3);
        let capacity = num_blocks * block_size;
        let mut free: Vec<i64> = (0..capacity as i64).collect();
        let slots = (0..tokens)
            .map(|_| match rng.random_range(0..10) {
                0 | 1 => -1,
                2 => capacity as i64 + rng.random_range(0..5),
                _ => free.swap_remove(rng.random_range(0..free.len())),
            })
            .collect();
        let mut c = CacheCase {
            fp8: rng.random_bool(0.5),
            nvfp4: false,
            nvfp4_inline: false,
            heads_first: rng.random_bool(0.5),
            block_size,
            num_blocks,
            slots,
            k_per_head: rng.random_bool(0.5),
            v_per_head: rng.random_bool(0.5),
            page_table: None,
            nope: CacheNope::None,
        };
        if rng.random_bool(0.3) {
            let (table, slots) = PageTableCase::random(rng, tokens, (num_blocks, block_size));
            (c.page_table, c.slots) = (Some(table), slots);
        }
        c
    }
}

/// How large a random case is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Size {
    /// A few tokens and heads: decode-sized launches, fewer threads than a GPU holds at once.
    Small,
    /// Thousands of tokens and 17-23 q and k heads (odd counts leave a thread's second head
    /// empty): prefill-sized launches, more threads than any of this project's GPUs holds at
    /// once. The planner gives both sizes the fused two-heads kernels (NeoX 16-bit launches of
    /// this size the four-heads kernels); handles pinned to the other kernels
    /// (`Rope::with_fused_kernels`) take them on the item loop, the rows kernels and the other
    /// number of heads per thread.
    Large,
}

/// The accesses of a head the fused norm sums over, rounded up to a power of two: the rotated
/// pairs in groups of the widest access the head's shape allows (the preferred width, halved
/// until the pairs divide into it; the harness's tensors are aligned to it).
fn norm_accesses(style: RopeStyle, dtype_size: usize, d: usize) -> usize {
    let half = d / 2;
    let fits = |lanes: usize| match style {
        RopeStyle::Neox => half.is_multiple_of(lanes),
        RopeStyle::Interleaved => lanes.is_multiple_of(2) && d.is_multiple_of(lanes),
    };
    let mut lanes = rope_kernels::abi::preferred_lanes(style, dtype_size) as usize;
    while lanes > 1 && !fits(lanes) {
        lanes /= 2;
    }
    let pairs = match style {
        RopeStyle::Neox => lanes,
        RopeStyle::Interleaved => lanes / 2,
    };
    (half / pairs).next_power_of_two()
}

impl Case {
    pub fn random(seed: u64, dtype_size: usize) -> Self {
        Self::random_sized(seed, dtype_size, Size::Small)
    }

    pub fn random_sized(seed: u64, dtype_size: usize, size: Size) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let style = if rng.random_bool(0.5) {
            RopeStyle::Neox
        } else {
            RopeStyle::Interleaved
        };
        // Head size 84 leaves 16-bit heads (42 pairs) and f32 NeoX heads without a whole number
        // of 16-byte accesses, so small cases also reach the narrow kernels; 96 and 512 are
        // models' own (512: Gemma 4's global layers).
        let d = match size {
            Size::Small => [64, 80, 84, 96, 128, 128, 256, 512][rng.random_range(0..8)],
            Size::Large => [64, 128][rng.random_range(0..2)],
        };
        let (batch, seq): (usize, usize) = match size {
            Size::Small => (rng.random_range(1..=3), rng.random_range(1..=9)),
            Size::Large => (rng.random_range(1..=2), rng.random_range(2500..=3000)),
        };
        let tokens = batch * seq;
        // Large cases take ids below the tables' positions (offsets would run past them).
        let ids = (size == Size::Large || rng.random_bool(0.6)).then(|| {
            (0..tokens)
                .map(|_| rng.random_range(0..MAX_POSITION as i64))
                .collect()
        });
        // The norm sums over at most 32 accesses of a head (f32 interleaved heads of 256 and
        // most heads of 512 take more).
        let norm_ok = norm_accesses(style, dtype_size, d) <= 32;
        let norm = match rng.random_range(0..3) {
            1 if norm_ok => Some(NormWeight::Plain),
            2 if norm_ok => Some(NormWeight::OnePlus),
            _ => None,
        };
        let q = match rng.random_range(0..4) {
            0 => QMode::InPlace,
            1 => QMode::Out,
            n => QMode::Fp8 { per_head: n == 3 },
        };
        let cache = rng
            .random_bool(0.7)
            .then(|| CacheCase::random(&mut rng, tokens));
        let mut k = match (rng.random_range(0..3), &cache) {
            (0, _) => KMode::InPlace,
            (1, _) | (_, None) => KMode::Out,
            _ => KMode::CacheOnly,
        };
        let fp8 = if rng.random_bool(0.5) {
            Fp8Format::E4m3
        } else {
            Fp8Format::E5m2
        };
        let multipliers = rng.random_bool(0.3);
        if cache.is_none() && rng.random_bool(0.3) {
            k = KMode::Fp8 {
                per_head: rng.random_bool(0.5),
            };
        }
        let mut case = Case {
            style,
            d,
            rotary: d,
            batch,
            seq,
            hq: match size {
                Size::Small => rng.random_range(1..=5),
                Size::Large => rng.random_range(16..=20),
            },
            hk: rng.random_range(1..=3),
            ids,
            axes: None,
            offset: rng.random_range(0..32),
            table: rng.random_bool(0.5),
            norm,
            scope: NormScope::PerHead,
            q,
            k,
            cache,
            fp8,
            multipliers,
            nope: 0,
            seed,
        };
        if !case.takes_flashinfer_forms() {
            case.plain_fp8();
        }
        case
    }

    /// Whether the case's launches take the token-heads kernels, which alone store FlashInfer's
    /// forms (page tables, E5M2, multipliers, an FP8 k output): the harness's tensors and tables
    /// are aligned, so heads of a multiple of 8 elements take the widest accesses in every style
    /// and type.
    pub fn takes_flashinfer_forms(&self) -> bool {
        self.d.is_multiple_of(8)
    }

    /// Whether the norm's sum spans this case's heads of `dtype_size`-byte elements: at most 32
    /// accesses of a head at the widest access its pairing allows.
    pub fn norm_fits(&self, dtype_size: usize) -> bool {
        norm_accesses(self.style, dtype_size, self.d) <= 32
    }

    /// Drops the case's FlashInfer forms: E4M3 of scale arrays, k not to an FP8 output, and a
    /// page table's slots as a slot mapping (the same slots).
    pub fn plain_fp8(&mut self) {
        (self.fp8, self.multipliers) = (Fp8Format::E4m3, false);
        if matches!(self.k, KMode::Fp8 { .. }) {
            self.k = KMode::Out;
        }
        if let Some(c) = &mut self.cache {
            c.page_table = None;
        }
    }

    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }

    /// Makes the case's cache NVFP4 (drawing one where it has none): the whole head rotated,
    /// slot mappings, global scale arrays, no FlashInfer form.
    pub fn nvfp4_cache(&mut self, rng: &mut StdRng) {
        let tokens = self.tokens();
        let cc = self
            .cache
            .get_or_insert_with(|| CacheCase::random(rng, tokens));
        (cc.fp8, cc.nvfp4, cc.nope) = (false, true, CacheNope::None);
        // Inline scales where a head's row (codes and scales) keeps the codes 4-byte aligned.
        cc.nvfp4_inline = (self.d / 2 + self.d / 16).is_multiple_of(4) && rng.random_bool(0.4);
        self.rotary = self.d;
        self.nope = 0;
        if matches!(self.k, KMode::Fp8 { .. }) {
            self.k = KMode::CacheOnly;
        }
        self.plain_fp8();
    }

    /// The norm weights of a tensor of `heads` heads: `d`, or `heads * d` across heads.
    pub fn weights_len(&self, heads: usize) -> usize {
        match self.scope {
            NormScope::PerHead => self.d,
            NormScope::AcrossHeads => heads * self.d,
        }
    }

    pub fn position(&self, t: usize) -> i64 {
        match &self.ids {
            Some(ids) => ids[t],
            None => self.offset + (t % self.seq) as i64,
        }
    }

    /// The position of rotated pair `i` of token `t`: its axis's with multi-axis positions,
    /// else the token's.
    pub fn pair_position(&self, t: usize, i: usize) -> i64 {
        match &self.axes {
            Some(a) => a.ids[a.map[i] as usize * self.tokens() + t],
            None => self.position(t),
        }
    }

    /// An NVFP4 case's codes layout (elements), its block scales' byte strides, and where the
    /// scales start in their buffer: a scale pool laid out as the codes (bytes over 16), or
    /// inline, each head's `d / 16` scales after its `d / 2` bytes of codes in rows of
    /// `d / 2 + d / 16` bytes (block, row, head order; the scales from byte `d / 2` of the codes'
    /// buffer).
    pub fn nvfp4_layout(&self, cc: &CacheCase) -> (CacheLayout, [usize; 3], usize) {
        if !cc.nvfp4_inline {
            let l = self.cache_layout(cc);
            return (l, l.nvfp4_scale_strides(), 0);
        }
        let row = self.d / 2 + self.d / 16;
        let bytes = [cc.block_size * self.hk * row, self.hk * row, row];
        let codes = CacheLayout {
            num_blocks: cc.num_blocks,
            block_size: cc.block_size,
            kv_heads: self.hk,
            head_dim: self.d,
            strides: bytes.map(|b| 2 * b),
        };
        (codes, bytes, self.d / 2)
    }

    /// Where k's non-rotary part goes in the case's cache.
    pub fn cache_nope(&self) -> CacheNope {
        self.cache.as_ref().map_or(CacheNope::None, |c| c.nope)
    }

    /// Elements of each k cache head, v head and v cache head: the rotated `d`, and k's
    /// non-rotary features after them ([`CacheNope::AfterRotated`]).
    pub fn cache_width(&self) -> usize {
        match self.cache_nope() {
            CacheNope::AfterRotated => self.d + self.nope,
            CacheNope::None | CacheNope::Latent => self.d,
        }
    }

    pub fn cache_layout(&self, c: &CacheCase) -> CacheLayout {
        self.heads_layout(c, self.cache_width())
    }

    /// The latent cache's layout ([`CacheNope::Latent`]): k's heads of `nope` features.
    pub fn latent_layout(&self, c: &CacheCase) -> CacheLayout {
        self.heads_layout(c, self.nope)
    }

    /// A cache of `c`'s blocks and order, k's heads of `width` elements.
    fn heads_layout(&self, c: &CacheCase, width: usize) -> CacheLayout {
        if c.heads_first {
            CacheLayout::blocks_heads_rows(c.num_blocks, c.block_size, self.hk, width)
        } else {
            CacheLayout::blocks_rows_heads(c.num_blocks, c.block_size, self.hk, width)
        }
    }
}

/// Host data of a case: inputs, weights and scales.
pub struct Data<T> {
    pub q: Vec<T>,
    pub k: Vec<T>,
    pub v: Vec<T>,
    pub q_w: Vec<T>,
    pub k_w: Vec<T>,
    pub q_scale: Vec<f32>,
    pub k_scale: Vec<f32>,
    pub v_scale: Vec<f32>,
    /// The non-rotary parts (`[tokens, heads, nope]`; empty without them).
    pub q_nope: Vec<T>,
    pub k_nope: Vec<T>,
}

impl<T: TestElem> Data<T> {
    pub fn random(c: &Case, rng: &mut StdRng) -> Self {
        let vals = |rng: &mut StdRng, n: usize, lo: f64, hi: f64| -> Vec<T> {
            (0..n)
                .map(|_| T::from_f64(rng.random_range(lo..hi)))
                .collect()
        };
        let per_token = |h: usize| c.tokens() * h * c.d;
        let (wlo, whi) = match c.norm {
            Some(NormWeight::OnePlus) => (-0.5, 0.5),
            _ => (0.5, 1.5),
        };
        let scales = |rng: &mut StdRng, n: usize| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(0.01f32..0.2)).collect()
        };
        let heads = |per_head: bool, h: usize| if per_head { h } else { 1 };
        let (k_heads, v_heads) = match (&c.cache, c.k) {
            (Some(cc), _) => (heads(cc.k_per_head, c.hk), heads(cc.v_per_head, c.hk)),
            (None, KMode::Fp8 { per_head }) => (heads(per_head, c.hk), 1),
            (None, _) => (1, 1),
        };
        let q_heads = match c.q {
            QMode::Fp8 { per_head } => heads(per_head, c.hq),
            _ => 1,
        };
        let (q_scale, k_scale, v_scale) = (
            scales(rng, q_heads),
            scales(rng, k_heads),
            scales(rng, v_heads),
        );
        let (q, k, v) = (
            vals(rng, per_token(c.hq), -2.0, 2.0),
            vals(rng, per_token(c.hk), -2.0, 2.0),
            vals(rng, c.tokens() * c.hk * c.cache_width(), -2.0, 2.0),
        );
        let (q_w, k_w) = (
            vals(rng, c.weights_len(c.hq), wlo, whi),
            vals(rng, c.weights_len(c.hk), wlo, whi),
        );
        // Drawn last, so that cases without parts draw what they drew before.
        let nope = |rng: &mut StdRng, h: usize| vals(rng, c.tokens() * h * c.nope, -40.0, 40.0);
        let (q_nope, k_nope) = (nope(rng, c.hq), nope(rng, c.hk));
        Data {
            q,
            k,
            v,
            q_w,
            k_w,
            q_scale,
            k_scale,
            v_scale,
            q_nope,
            k_nope,
        }
    }
}

/// The largest error of a case's checked outputs, as a share of its bound.
#[derive(Clone, Copy, Debug, Default)]
pub struct Worst {
    pub ratio: f64,
    pub checked: usize,
}

impl Worst {
    pub fn add(&mut self, err: f64, bound: f64) {
        self.ratio = self.ratio.max(err / bound);
        self.checked += 1;
    }

    /// Takes in another case's worst.
    pub fn merge(&mut self, other: Worst) {
        self.ratio = self.ratio.max(other.ratio);
        self.checked += other.checked;
    }
}

/// Device buffers of one case.
pub struct Device<T> {
    pub q: CudaSlice<T>,
    pub q_out: CudaSlice<T>,
    pub q8: CudaSlice<u8>,
    pub k: CudaSlice<T>,
    pub k_out: CudaSlice<T>,
    pub k8: CudaSlice<u8>,
    pub v: CudaSlice<T>,
    pub q_w: CudaSlice<T>,
    pub k_w: CudaSlice<T>,
    pub q_scale: CudaSlice<f32>,
    pub k_scale: CudaSlice<f32>,
    pub v_scale: CudaSlice<f32>,
    /// The token ids, or the rows of multi-axis positions.
    pub ids: CudaSlice<i64>,
    /// The multi-axis map on the device.
    pub axis_map: Option<rope_host::DeviceAxisMap>,
    pub slots: CudaSlice<i64>,
    pub k_cache: CudaSlice<T>,
    pub v_cache: CudaSlice<T>,
    pub k_cache8: CudaSlice<u8>,
    pub v_cache8: CudaSlice<u8>,
    /// NVFP4 caches' block scales (poisoned; a byte per 16 cache elements).
    pub k_block_scales: CudaSlice<u8>,
    pub v_block_scales: CudaSlice<u8>,
    /// The page table's `batch_indices`, `positions`, `kv_indptr`, `kv_indices`.
    pub page_table: Option<[CudaSlice<i32>; 4]>,
    /// The non-rotary parts and their FP8 outputs (poisoned; [`nope_layouts`]).
    pub q_nope: CudaSlice<T>,
    pub k_nope: CudaSlice<T>,
    pub q_nope8: CudaSlice<u8>,
    pub k_nope8: CudaSlice<u8>,
    pub tables: Option<rope_host::SinCosTables<T>>,
}

/// Elements of the case's k cache and v cache (0 without a cache): v's is the latent cache
/// with [`CacheNope::Latent`].
pub fn cache_lens(c: &Case) -> [usize; 2] {
    let Some(cc) = &c.cache else {
        return [0; 2];
    };
    let slots = cc.num_blocks * cc.block_size * c.hk;
    let v_width = match cc.nope {
        CacheNope::Latent => c.nope,
        CacheNope::None | CacheNope::AfterRotated => c.cache_width(),
    };
    [slots * c.cache_width(), slots * v_width]
}

pub fn upload<T: TestElem>(
    c: &Case,
    data: &Data<T>,
    stream: &Arc<CudaStream>,
    rope: &Rope,
) -> Result<Device<T>, String> {
    let e = |e: rope_host::cudarc::driver::DriverError| e.to_string();
    let poison_t = |n: usize| -> Result<CudaSlice<T>, String> {
        stream.clone_htod(&vec![T::poison(); n.max(1)]).map_err(e)
    };
    let poison_u8 = |n: usize| stream.clone_htod(&vec![POISON; n.max(1)]).map_err(e);
    let ids: Vec<i64> = match &c.axes {
        Some(a) => a.ids.clone(),
        None => (0..c.tokens()).map(|t| c.position(t)).collect(),
    };
    let axis_map = c
        .axes
        .as_ref()
        .map(|a| rope.axis_map(&rope_host::AxisMap::new(a.n_axes, a.map.clone())?))
        .transpose()
        .map_err(|e| e.to_string())?;
    let slots = c.cache.as_ref().map_or(vec![0], |cc| cc.slots.clone());
    let tables = if c.table {
        Some(
            rope.build_tables::<T>(
                THETA,
                c.rotary as u32,
                MAX_POSITION + 32,
                TableFormat::Separate,
            )
            .map_err(|e| e.to_string())?,
        )
    } else {
        rope.prepare(THETA, c.rotary as u32)
            .map_err(|e| e.to_string())?;
        None
    };
    Ok(Device {
        q: stream.clone_htod(&data.q).map_err(e)?,
        q_out: poison_t(data.q.len())?,
        q8: poison_u8(data.q.len())?,
        k: stream.clone_htod(&data.k).map_err(e)?,
        k_out: poison_t(data.k.len())?,
        k8: poison_u8(data.k.len())?,
        v: stream.clone_htod(&data.v).map_err(e)?,
        q_w: stream.clone_htod(&data.q_w).map_err(e)?,
        k_w: stream.clone_htod(&data.k_w).map_err(e)?,
        q_scale: stream.clone_htod(&data.q_scale).map_err(e)?,
        k_scale: stream.clone_htod(&data.k_scale).map_err(e)?,
        v_scale: stream.clone_htod(&data.v_scale).map_err(e)?,
        ids: stream.clone_htod(&ids).map_err(e)?,
        axis_map,
        slots: stream.clone_htod(&slots).map_err(e)?,
        k_cache: poison_t(cache_lens(c)[0])?,
        v_cache: poison_t(cache_lens(c)[1])?,
        k_cache8: poison_u8(cache_lens(c)[0])?,
        v_cache8: poison_u8(cache_lens(c)[1])?,
        k_block_scales: poison_u8(cache_lens(c)[0] / 16)?,
        v_block_scales: poison_u8(cache_lens(c)[1] / 16)?,
        page_table: match c.cache.as_ref().and_then(|cc| cc.page_table.as_ref()) {
            Some(t) => {
                let up = |v: &Vec<i32>| stream.clone_htod(v).map_err(e);
                Some([
                    up(&t.batch_indices)?,
                    up(&t.positions)?,
                    up(&t.kv_indptr)?,
                    // An empty kv_indices still needs an allocation to point at.
                    stream
                        .clone_htod(if t.kv_indices.is_empty() {
                            &[0][..]
                        } else {
                            &t.kv_indices
                        })
                        .map_err(e)?,
                ])
            }
            None => None,
        },
        q_nope: stream.clone_htod(&pad_one(&data.q_nope)).map_err(e)?,
        k_nope: stream.clone_htod(&pad_one(&data.k_nope)).map_err(e)?,
        q_nope8: poison_u8(nope_layouts(c, c.hq).1.end().unwrap_or(0))?,
        k_nope8: poison_u8(nope_layouts(c, c.hk).1.end().unwrap_or(0))?,
        tables,
    })
}

/// `x`, or one zero element where it is empty (every upload needs an allocation).
fn pad_one<T: TestElem>(x: &[T]) -> Vec<T> {
    if x.is_empty() {
        vec![T::from_f64(0.0)]
    } else {
        x.to_vec()
    }
}

/// The layouts of a non-rotary part of `heads` heads: its input `[batch, seq, heads, nope]`,
/// contiguous, and its FP8 output, whose heads are [`NOPE_PAD`] bytes apart.
pub fn nope_layouts(c: &Case, heads: usize) -> (Layout, Layout) {
    let input = Layout::bshd(c.batch, c.seq, heads, c.nope);
    let head = c.nope + NOPE_PAD;
    let strides = [c.seq * heads * head, heads * head, head, 1];
    let output = Layout::strided([c.batch, c.seq, heads, c.nope], strides, 0)
        .expect("a layout of the case's dimensions");
    (input, output)
}

/// The FP8 scale of a destination: its scale array (one, or one per head), or with
/// `c.multipliers` the multiplier `1 / host[0]` by value.
pub fn scale_of<'a>(
    c: &Case,
    per_head: bool,
    (host, s): (&[f32], &'a CudaSlice<f32>),
) -> Fp8Scale<'a> {
    if c.multipliers {
        Fp8Scale::Multiplier(1.0 / host[0])
    } else if per_head {
        Fp8Scale::PerHead(s.as_view())
    } else {
        Fp8Scale::PerTensor(s.as_view())
    }
}

/// A page table's four arrays' lengths as the launch passes them (`kv_indices` may be empty
/// though its allocation is not).
fn page_table_lens(t: &PageTableCase) -> [usize; 4] {
    [
        t.batch_indices.len(),
        t.positions.len(),
        t.kv_indptr.len(),
        t.kv_indices.len(),
    ]
}

/// Where the case's cache takes k's non-rotary part, if it does.
fn cache_nope_into(c: &Case, cc: &CacheCase) -> Option<NonRotaryCache> {
    match cc.nope {
        CacheNope::None => None,
        CacheNope::AfterRotated => Some(NonRotaryCache::AfterRotated),
        CacheNope::Latent => Some(NonRotaryCache::Latent(c.latent_layout(cc))),
    }
}

/// v's layout (`[batch, seq, kv_heads, cache_width]`), for a case with a cache and without a
/// latent one.
fn v_layout(c: &Case) -> Option<Layout> {
    let latent = c.cache_nope() == CacheNope::Latent;
    (c.cache.is_some() && !latent).then(|| Layout::bshd(c.batch, c.seq, c.hk, c.cache_width()))
}

/// Launches the case on `rope` (its stream), reading and writing `dev` (`data`: the host copy
/// of its scales, for multipliers).
pub fn launch<T: TestElem>(
    c: &Case,
    data: &Data<T>,
    dev: &mut Device<T>,
    rope: &Rope,
) -> rope_host::Result<()> {
    let config = RopeConfig::builder(c.d as u32, c.style)
        .rotary_dim(c.rotary as u32)
        .build()?;
    let positions = match (&dev.axis_map, &c.ids) {
        (Some(axes), _) => Positions::MultiAxis {
            positions: DeviceInts::I64(dev.ids.as_view()),
            axes,
        },
        (None, Some(_)) => Positions::Ids {
            ids: DeviceInts::I64(dev.ids.as_view()),
            shape: IdsShape::PerRow,
        },
        (None, None) => Positions::Offset(c.offset as u32),
    };
    let sincos = match &dev.tables {
        Some(t) => t.sincos(),
        None => SinCos::Computed { theta: THETA },
    };
    let norm = c.norm.map(|weight| QkNorm {
        q_weight: dev.q_w.as_view(),
        k_weight: dev.k_w.as_view(),
        eps: 1e-6,
        weight,
        scope: c.scope,
    });
    let op = FusedOp {
        rope: RopeOp {
            config,
            positions,
            sincos,
        },
        norm,
    };
    let lq = Layout::bshd(c.batch, c.seq, c.hq, c.d);
    let lk = Layout::bshd(c.batch, c.seq, c.hk, c.d);
    let q = match c.q {
        QMode::InPlace => QOut::InPlace(TensorMut {
            data: dev.q.as_view_mut(),
            layout: lq,
        }),
        QMode::Out => QOut::OutOfPlace {
            input: Tensor {
                data: dev.q.as_view(),
                layout: lq,
            },
            output: TensorMut {
                data: dev.q_out.as_view_mut(),
                layout: lq,
            },
        },
        QMode::Fp8 { per_head } => QOut::Fp8 {
            input: Tensor {
                data: dev.q.as_view(),
                layout: lq,
            },
            output: TensorMut {
                data: dev.q8.as_view_mut(),
                layout: lq,
            },
            scale: scale_of(c, per_head, (&data.q_scale, &dev.q_scale)),
            format: c.fp8,
            non_rotary: (c.nope > 0).then(|| {
                let (input, output) = nope_layouts(c, c.hq);
                NonRotary {
                    input: Tensor {
                        data: dev.q_nope.as_view(),
                        layout: input,
                    },
                    output: TensorMut {
                        data: dev.q_nope8.as_view_mut(),
                        layout: output,
                    },
                }
            }),
        },
    };
    let k = match c.k {
        KMode::InPlace => KOut::InPlace(TensorMut {
            data: dev.k.as_view_mut(),
            layout: lk,
        }),
        KMode::Out => KOut::OutOfPlace {
            input: Tensor {
                data: dev.k.as_view(),
                layout: lk,
            },
            output: TensorMut {
                data: dev.k_out.as_view_mut(),
                layout: lk,
            },
        },
        KMode::CacheOnly => KOut::CacheOnly(Tensor {
            data: dev.k.as_view(),
            layout: lk,
        }),
        KMode::Fp8 { per_head } => KOut::Fp8 {
            input: Tensor {
                data: dev.k.as_view(),
                layout: lk,
            },
            output: TensorMut {
                data: dev.k8.as_view_mut(),
                layout: lk,
            },
            scale: scale_of(c, per_head, (&data.k_scale, &dev.k_scale)),
            format: c.fp8,
            non_rotary: (c.nope > 0).then(|| {
                let (input, output) = nope_layouts(c, c.hk);
                NonRotary {
                    input: Tensor {
                        data: dev.k_nope.as_view(),
                        layout: input,
                    },
                    output: TensorMut {
                        data: dev.k_nope8.as_view_mut(),
                        layout: output,
                    },
                }
            }),
        },
    };
    let address = match (
        &dev.page_table,
        c.cache.as_ref().and_then(|cc| cc.page_table.as_ref()),
    ) {
        (Some([b, p, indptr, indices]), Some(t)) => CacheAddress::PageTable(PageTable {
            batch_indices: b.as_view(),
            positions: p.as_view(),
            kv_indptr: indptr.as_view(),
            kv_indices: indices.slice(0..t.kv_indices.len()),
        }),
        _ => CacheAddress::Slots(DeviceInts::I64(dev.slots.as_view())),
    };
    let (k_nope, _) = nope_layouts(c, c.hk);
    let cache = c.cache.as_ref().map(|cc| KvCache {
        non_rotary: cache_nope_into(c, cc).map(|into| CacheNonRotary {
            input: Tensor {
                data: dev.k_nope.as_view(),
                layout: k_nope,
            },
            into,
        }),
        address,
        layout: c.cache_layout(cc),
        data: if cc.nvfp4 {
            CacheData::Nvfp4 {
                k: Nvfp4Cache {
                    codes: dev.k_cache8.as_view_mut(),
                    block_scales: dev.k_block_scales.as_view_mut(),
                    scale: scale_of(c, cc.k_per_head, (&data.k_scale, &dev.k_scale)),
                },
                v: Nvfp4Cache {
                    codes: dev.v_cache8.as_view_mut(),
                    block_scales: dev.v_block_scales.as_view_mut(),
                    scale: scale_of(c, cc.v_per_head, (&data.v_scale, &dev.v_scale)),
                },
                scale_strides: c.nvfp4_layout(cc).1,
            }
        } else if cc.fp8 {
            CacheData::Fp8 {
                k: dev.k_cache8.as_view_mut(),
                v: dev.v_cache8.as_view_mut(),
                k_scale: scale_of(c, cc.k_per_head, (&data.k_scale, &dev.k_scale)),
                v_scale: scale_of(c, cc.v_per_head, (&data.v_scale, &dev.v_scale)),
                format: c.fp8,
            }
        } else {
            CacheData::Elem {
                k: dev.k_cache.as_view_mut(),
                v: dev.v_cache.as_view_mut(),
            }
        },
    });
    let v = v_layout(c).map(|layout| Tensor {
        data: dev.v.as_view(),
        layout,
    });
    rope.run_fused(&op, FusedIo::Separate { q, k, v }, cache)
}

/// Launches the case through [`Rope::run_fused_raw`] on `stream` (the handle's own), every
/// buffer of `dev` given by address: what a front end owning its memory does.
pub fn launch_raw<T: TestElem>(
    c: &Case,
    data: &Data<T>,
    dev: &mut Device<T>,
    rope: &Rope,
    stream: &Arc<CudaStream>,
) -> rope_host::Result<()> {
    fn buf<E>(s: &CudaSlice<E>, stream: &CudaStream) -> RawBuf {
        RawBuf {
            ptr: s.device_ptr(stream).0,
            len: s.len(),
        }
    }
    let b = |s: &CudaSlice<T>| buf(s, stream);
    let config = RopeConfig::builder(c.d as u32, c.style)
        .rotary_dim(c.rotary as u32)
        .build()?;
    let ids = RawInts {
        buf: buf(&dev.ids, stream),
        ty: IntType::I64,
    };
    let positions = match (&dev.axis_map, &c.ids) {
        (Some(axes), _) => RawPositions::MultiAxis {
            positions: ids,
            axes: axes.raw(),
        },
        (None, Some(_)) => RawPositions::Ids {
            ids,
            shape: IdsShape::PerRow,
        },
        (None, None) => RawPositions::Offset(c.offset as u32),
    };
    let sincos = match dev.tables.as_ref().map(|t| t.data()) {
        Some(TableData::Separate { cos, sin }) => RawSinCos::Table {
            cos: b(cos),
            sin: b(sin),
            dtype: T::DTYPE,
            shape: TableShape {
                max_position: MAX_POSITION + 32,
                rotary_dim: c.rotary as u32,
            },
        },
        Some(TableData::Combined(_)) => unreachable!("built separate"),
        None => RawSinCos::Computed { theta: THETA },
    };
    let op = RawFusedOp {
        rope: RawOp {
            config,
            dtype: T::DTYPE,
            positions,
            sincos,
        },
        norm: c.norm.map(|weight| RawQkNorm {
            q_weight: b(&dev.q_w),
            k_weight: b(&dev.k_w),
            eps: 1e-6,
            weight,
            scope: c.scope,
        }),
    };
    let scale = |per_head: bool, (host, s): (&[f32], &CudaSlice<f32>)| {
        if c.multipliers {
            RawFp8Scale::Multiplier(1.0 / host[0])
        } else if per_head {
            RawFp8Scale::PerHead(buf(s, stream))
        } else {
            RawFp8Scale::PerTensor(buf(s, stream))
        }
    };
    let tensor = |buf, layout| RawTensor { buf, layout };
    let raw_nope = |heads, x: &CudaSlice<T>, out: &CudaSlice<u8>| {
        (c.nope > 0).then(|| {
            let (input, output) = nope_layouts(c, heads);
            RawNonRotary {
                input: tensor(b(x), input),
                output: tensor(buf(out, stream), output),
            }
        })
    };
    let lq = Layout::bshd(c.batch, c.seq, c.hq, c.d);
    let lk = Layout::bshd(c.batch, c.seq, c.hk, c.d);
    let q = match c.q {
        QMode::InPlace => RawQOut::Elem(RawIo::InPlace(tensor(b(&dev.q), lq))),
        QMode::Out => RawQOut::Elem(RawIo::OutOfPlace {
            input: tensor(b(&dev.q), lq),
            output: tensor(b(&dev.q_out), lq),
        }),
        QMode::Fp8 { per_head } => RawQOut::Fp8 {
            input: tensor(b(&dev.q), lq),
            output: tensor(buf(&dev.q8, stream), lq),
            scale: scale(per_head, (&data.q_scale, &dev.q_scale)),
            format: c.fp8,
            non_rotary: raw_nope(c.hq, &dev.q_nope, &dev.q_nope8),
        },
    };
    let k = match c.k {
        KMode::InPlace => RawKOut::Elem(RawIo::InPlace(tensor(b(&dev.k), lk))),
        KMode::Out => RawKOut::Elem(RawIo::OutOfPlace {
            input: tensor(b(&dev.k), lk),
            output: tensor(b(&dev.k_out), lk),
        }),
        KMode::CacheOnly => RawKOut::CacheOnly(tensor(b(&dev.k), lk)),
        KMode::Fp8 { per_head } => RawKOut::Fp8 {
            input: tensor(b(&dev.k), lk),
            output: tensor(buf(&dev.k8, stream), lk),
            scale: scale(per_head, (&data.k_scale, &dev.k_scale)),
            format: c.fp8,
            non_rotary: raw_nope(c.hk, &dev.k_nope, &dev.k_nope8),
        },
    };
    let address = match (
        &dev.page_table,
        c.cache.as_ref().and_then(|cc| cc.page_table.as_ref()),
    ) {
        (Some(arrays), Some(t)) => {
            let [b, p, indptr, indices] = arrays.each_ref().map(|a| buf(a, stream));
            let [_, _, _, indices_len] = page_table_lens(t);
            RawCacheAddress::PageTable(RawPageTable {
                batch_indices: b,
                positions: p,
                kv_indptr: indptr,
                kv_indices: RawBuf {
                    len: indices_len,
                    ..indices
                },
            })
        }
        _ => RawCacheAddress::Slots(RawInts {
            buf: buf(&dev.slots, stream),
            ty: IntType::I64,
        }),
    };
    let cache = c.cache.as_ref().map(|cc| RawKvCache {
        non_rotary: cache_nope_into(c, cc).map(|into| RawCacheNonRotary {
            input: tensor(b(&dev.k_nope), nope_layouts(c, c.hk).0),
            into,
        }),
        address,
        layout: if cc.nvfp4 {
            c.nvfp4_layout(cc).0
        } else {
            c.cache_layout(cc)
        },
        data: if cc.nvfp4 {
            let (_, scale_strides, at) = c.nvfp4_layout(cc);
            // Inline scales: the codes' buffer from the first scale on.
            let scales = |codes: &CudaSlice<u8>, own: &CudaSlice<u8>| {
                if cc.nvfp4_inline {
                    let b = buf(codes, stream);
                    RawBuf {
                        ptr: b.ptr + at as u64,
                        len: b.len - at,
                    }
                } else {
                    buf(own, stream)
                }
            };
            RawCacheData::Nvfp4 {
                k: RawNvfp4Cache {
                    codes: buf(&dev.k_cache8, stream),
                    block_scales: scales(&dev.k_cache8, &dev.k_block_scales),
                    scale: scale(cc.k_per_head, (&data.k_scale, &dev.k_scale)),
                },
                v: RawNvfp4Cache {
                    codes: buf(&dev.v_cache8, stream),
                    block_scales: scales(&dev.v_cache8, &dev.v_block_scales),
                    scale: scale(cc.v_per_head, (&data.v_scale, &dev.v_scale)),
                },
                scale_strides,
            }
        } else if cc.fp8 {
            RawCacheData::Fp8 {
                k: buf(&dev.k_cache8, stream),
                v: buf(&dev.v_cache8, stream),
                k_scale: scale(cc.k_per_head, (&data.k_scale, &dev.k_scale)),
                v_scale: scale(cc.v_per_head, (&data.v_scale, &dev.v_scale)),
                format: c.fp8,
            }
        } else {
            RawCacheData::Elem {
                k: b(&dev.k_cache),
                v: b(&dev.v_cache),
            }
        },
    });
    let v = v_layout(c).map(|layout| tensor(b(&dev.v), layout));
    let io = RawFusedIo::Separate { q, k, v };
    // SAFETY: every buffer is a live allocation of the handle's context holding the length
    // given, used only by this launch on the handle's own stream (the case's uploads were
    // ordered before it on the same stream); computed sin/cos were prepared by `upload`.
    unsafe { rope.run_fused_raw(&op, io, cache, stream.cu_stream()) }
}

/// The cos/sin of every pair of token `t`, each at its position ([`Case::pair_position`]):
/// from the downloaded table, or exact.
pub fn cos_sin(c: &Case, table: Option<&(Vec<f64>, Vec<f64>)>, t: usize) -> (Vec<f64>, Vec<f64>) {
    let half = c.rotary / 2;
    let freqs = inv_freq(THETA, c.rotary);
    (0..half)
        .map(|i| {
            let p = c.pair_position(t, i);
            match table {
                Some((cos, sin)) => (cos[p as usize * half + i], sin[p as usize * half + i]),
                None => ((p as f64 * freqs[i]).cos(), (p as f64 * freqs[i]).sin()),
            }
        })
        .unzip()
}

/// Checks an output of the tensors' type against the reference by the one rule
/// ([`crate::tolerance`]), with the norm's term when the case normalises.
pub fn check_elem<T: TestElem>(
    c: &Case,
    got: T,
    want: f64,
    scale: ElementScale,
    worst: &mut Worst,
) -> Result<(), f64> {
    let g = got.to_f64();
    let element = Rotated {
        want,
        pair: scale.pair,
        norm_terms: c.norm.map(|_| scale.terms),
    };
    let (err, bound) = tolerance::check::<T>(g, &element);
    worst.add(err, bound);
    if err <= bound { Ok(()) } else { Err(g) }
}

/// Checks an FP8 byte of the case's format: one of the two values around `want * m`, `m` the
/// destination's multiplier (`1 / scale`, or the multiplier by value: `1 / host_scale`
/// rounded to `f32`, as the launch passed it).
pub fn check_fp8(c: &Case, got: u8, want: f64, scale: f32, worst: &mut Worst) -> Result<(), f64> {
    let m = if c.multipliers {
        f64::from(1.0 / scale)
    } else {
        1.0 / f64::from(scale)
    };
    let (g, (lo, hi)) = match c.fp8 {
        Fp8Format::E4m3 => (f64::from(e4m3_to_f32(got)), e4m3_bracket(want * m)),
        Fp8Format::E5m2 => (f64::from(e5m2_to_f32(got)), e5m2_bracket(want * m)),
    };
    worst.add(if g >= lo && g <= hi { 0.0 } else { 2.0 }, 1.0);
    if g >= lo && g <= hi { Ok(()) } else { Err(g) }
}

/// The reference of head `h` of token `t` of a tensor with `heads` heads: normalised (q and k
/// with a norm) and rotated (q and k), with each element's [`ElementScale`].
pub fn reference_head<T: TestElem>(
    c: &Case,
    x: &[T],
    heads: usize,
    (t, h): (usize, usize),
    w: Option<&[T]>,
    table: Option<&(Vec<f64>, Vec<f64>)>,
) -> (Vec<f64>, Vec<ElementScale>) {
    let at = (t * heads + h) * c.d;
    let f64s = |v: &[T]| -> Vec<f64> { v.iter().map(|v| v.to_f64()).collect() };
    let mut head = f64s(&x[at..at + c.d]);
    if let (Some(weight), Some(w)) = (c.norm, w) {
        let one_plus = weight == NormWeight::OnePlus;
        head = match c.scope {
            NormScope::PerHead => rms_norm(&head, &f64s(w), 1e-6, one_plus),
            // The token's heads normalised as one vector, then this head's features.
            NormScope::AcrossHeads => {
                let token = (t * heads) * c.d;
                let all = rms_norm(
                    &f64s(&x[token..token + heads * c.d]),
                    &f64s(w),
                    1e-6,
                    one_plus,
                );
                all[h * c.d..(h + 1) * c.d].to_vec()
            }
        };
    }
    let (cos, sin) = cos_sin(c, table, t);
    // The first `rotary` features rotated; the rest as they are (normalised with the norm).
    let (mut y, mut scale) = rotate_head(&head[..c.rotary], c.style, &cos, &sin);
    for &x in &head[c.rotary..] {
        y.push(x);
        scale.push(ElementScale {
            pair: (x, 0.0),
            terms: x.abs(),
        });
    }
    (y, scale)
}

/// Runs and checks one case; returns the worst error ratio.
pub fn check_case<T: TestElem>(
    c: &Case,
    stream: &Arc<CudaStream>,
    rope: &Rope,
) -> Result<Worst, String> {
    check_case_on::<T>(c, stream, rope, Entry::Views)
}

/// Which entry a case launches through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    /// [`Rope::run_fused`], with cudarc views.
    Views,
    /// [`Rope::run_fused_raw`], by address.
    Raw,
}

/// [`check_case`] through `entry`.
pub fn check_case_on<T: TestElem>(
    c: &Case,
    stream: &Arc<CudaStream>,
    rope: &Rope,
    entry: Entry,
) -> Result<Worst, String> {
    let mut rng = StdRng::seed_from_u64(c.seed ^ 0x5eed);
    let data = Data::<T>::random(c, &mut rng);
    let mut dev = upload(c, &data, stream, rope)?;
    // Scales between the codes of one buffer are two views of it: by address only.
    let inline = c.cache.as_ref().is_some_and(|cc| cc.nvfp4_inline);
    let entry = if inline { Entry::Raw } else { entry };
    match entry {
        Entry::Views => launch(c, &data, &mut dev, rope),
        Entry::Raw => launch_raw(c, &data, &mut dev, rope, stream),
    }
    .map_err(|e| format!("launch: {e}"))?;
    verify(c, &data, &dev, stream)
}

/// Compares every output and cache byte of a launched case with the reference.
pub fn verify<T: TestElem>(
    c: &Case,
    data: &Data<T>,
    dev: &Device<T>,
    stream: &Arc<CudaStream>,
) -> Result<Worst, String> {
    let e = |e: rope_host::cudarc::driver::DriverError| e.to_string();
    let table = match &dev.tables {
        Some(t) => match t.data() {
            TableData::Separate { cos, sin } => {
                let down = |s| -> Result<Vec<f64>, String> {
                    Ok(stream
                        .clone_dtoh(s)
                        .map_err(e)?
                        .iter()
                        .map(|v: &T| v.to_f64())
                        .collect())
                };
                Some((down(cos)?, down(sin)?))
            }
            TableData::Combined(_) => unreachable!("built separate"),
        },
        None => None,
    };
    let table = table.as_ref();
    let mut worst = Worst::default();
    let fail = |what: &str, t: usize, h: usize, i: usize, got: f64, want: f64| {
        format!("{what} token {t} head {h} element {i}: got {got}, want {want} ({c:?})")
    };
    // q.
    let q_got_t = match c.q {
        QMode::InPlace => Some(stream.clone_dtoh(&dev.q).map_err(e)?),
        QMode::Out => Some(stream.clone_dtoh(&dev.q_out).map_err(e)?),
        QMode::Fp8 { .. } => None,
    };
    let q8 = stream.clone_dtoh(&dev.q8).map_err(e)?;
    for t in 0..c.tokens() {
        for h in 0..c.hq {
            let (want, scale) = reference_head(c, &data.q, c.hq, (t, h), Some(&data.q_w), table);
            for i in 0..c.d {
                let at = (t * c.hq + h) * c.d + i;
                let r = match (&q_got_t, c.q) {
                    (Some(got), _) => check_elem(c, got[at], want[i], scale[i], &mut worst),
                    (None, QMode::Fp8 { per_head }) => {
                        let s = data.q_scale[if per_head && !c.multipliers { h } else { 0 }];
                        check_fp8(c, q8[at], want[i], s, &mut worst)
                    }
                    _ => unreachable!(),
                };
                r.map_err(|g| fail("q", t, h, i, g, want[i]))?;
            }
        }
    }
    // k in its tensor (or its FP8 output); unchanged when only cached or quantised.
    let k_got = match c.k {
        KMode::InPlace | KMode::CacheOnly | KMode::Fp8 { .. } => {
            stream.clone_dtoh(&dev.k).map_err(e)?
        }
        KMode::Out => stream.clone_dtoh(&dev.k_out).map_err(e)?,
    };
    let k8 = stream.clone_dtoh(&dev.k8).map_err(e)?;
    for t in 0..c.tokens() {
        for h in 0..c.hk {
            let (want, scale) = reference_head(c, &data.k, c.hk, (t, h), Some(&data.k_w), table);
            for i in 0..c.d {
                let at = (t * c.hk + h) * c.d + i;
                if matches!(c.k, KMode::CacheOnly | KMode::Fp8 { .. })
                    && k_got[at].bits() != data.k[at].bits()
                {
                    return Err(format!("k changed at {at} ({c:?})"));
                }
                if let KMode::Fp8 { per_head } = c.k {
                    let s = data.k_scale[if per_head && !c.multipliers { h } else { 0 }];
                    check_fp8(c, k8[at], want[i], s, &mut worst)
                        .map_err(|g| fail("k FP8", t, h, i, g, want[i]))?;
                } else if !matches!(c.k, KMode::CacheOnly) {
                    check_elem(c, k_got[at], want[i], scale[i], &mut worst)
                        .map_err(|g| fail("k", t, h, i, g, want[i]))?;
                }
            }
        }
    }
    verify_nope(c, data, dev, stream, &mut worst)?;
    let Some(cc) = &c.cache else {
        return Ok(worst);
    };
    if cc.nvfp4 {
        verify_nvfp4(c, data, dev, stream, table, &mut worst)?;
        return Ok(worst);
    }
    let layout = c.cache_layout(cc);
    let latent = c.latent_layout(cc);
    let capacity = (cc.num_blocks * cc.block_size) as i64;
    let (kc, vc, kc8, vc8) = (
        stream.clone_dtoh(&dev.k_cache).map_err(e)?,
        stream.clone_dtoh(&dev.v_cache).map_err(e)?,
        stream.clone_dtoh(&dev.k_cache8).map_err(e)?,
        stream.clone_dtoh(&dev.v_cache8).map_err(e)?,
    );
    let [k_len, v_len] = cache_lens(c);
    let (mut k_written, mut v_written) = (vec![false; k_len], vec![false; v_len]);
    let (width, nope) = (c.cache_width(), c.nope);
    for t in 0..c.tokens() {
        let slot = cc.slots[t];
        if slot < 0 || slot >= capacity {
            continue;
        }
        let (block, row) = (slot as usize / cc.block_size, slot as usize % cc.block_size);
        let head_at = |l: &CacheLayout, h: usize| {
            block * l.strides[0] + row * l.strides[1] + h * l.strides[2]
        };
        for h in 0..c.hk {
            let (k_want, k_scale_terms) =
                reference_head(c, &data.k, c.hk, (t, h), Some(&data.k_w), table);
            let scale_of = |per_head: bool| if per_head && !c.multipliers { h } else { 0 };
            let (ks, vs) = (
                data.k_scale[scale_of(cc.k_per_head)],
                data.v_scale[scale_of(cc.v_per_head)],
            );
            let k_nope_elem = |i: usize| data.k_nope[(t * c.hk + h) * nope + i];
            let k_nope = |i: usize| k_nope_elem(i).to_f64();
            // k's head: the rotated features, then (after them) its non-rotary part: FP8 of it
            // with k's scale, or as it is into a cache of the tensors' type.
            for i in 0..width {
                let at = head_at(&layout, h) + i;
                k_written[at] = true;
                if i >= c.d && cc.fp8 {
                    check_fp8(c, kc8[at], k_nope(i - c.d), ks, &mut worst)
                        .map_err(|g| fail("k cache non-rotary", t, h, i, g, k_nope(i - c.d)))?;
                } else if i >= c.d {
                    if kc[at].bits() != k_nope_elem(i - c.d).bits() {
                        let (g, w) = (kc[at].to_f64(), k_nope(i - c.d));
                        return Err(fail("k cache non-rotary", t, h, i, g, w));
                    }
                } else if cc.fp8 {
                    check_fp8(c, kc8[at], k_want[i], ks, &mut worst)
                        .map_err(|g| fail("k cache", t, h, i, g, k_want[i]))?;
                } else {
                    check_elem(c, kc[at], k_want[i], k_scale_terms[i], &mut worst)
                        .map_err(|g| fail("k cache", t, h, i, g, k_want[i]))?;
                }
            }
            if cc.nope == CacheNope::Latent {
                // k's part into the latent cache, with k's scale (or as it is).
                for i in 0..nope {
                    let at = head_at(&latent, h) + i;
                    v_written[at] = true;
                    if cc.fp8 {
                        check_fp8(c, vc8[at], k_nope(i), ks, &mut worst)
                            .map_err(|g| fail("latent cache", t, h, i, g, k_nope(i)))?;
                    } else if vc[at].bits() != k_nope_elem(i).bits() {
                        return Err(fail("latent cache", t, h, i, vc[at].to_f64(), k_nope(i)));
                    }
                }
                continue;
            }
            // v's head, as wide as k's cache head, unchanged.
            for i in 0..width {
                let at = head_at(&layout, h) + i;
                v_written[at] = true;
                let x = data.v[(t * c.hk + h) * width + i];
                if cc.fp8 {
                    check_fp8(c, vc8[at], x.to_f64(), vs, &mut worst)
                        .map_err(|g| fail("v cache", t, h, i, g, x.to_f64()))?;
                } else if vc[at].bits() != x.bits() {
                    return Err(fail("v cache", t, h, i, vc[at].to_f64(), x.to_f64()));
                }
            }
        }
    }
    // Every element outside the written slots keeps its poison, in both formats' caches.
    for (what, written, elems, bytes) in
        [("k", &k_written, &kc, &kc8), ("v", &v_written, &vc, &vc8)]
    {
        for (at, w) in written.iter().enumerate() {
            let elem_written = !cc.fp8 && *w;
            let fp8_written = cc.fp8 && *w;
            if !elem_written && elems[at].bits() != T::poison().bits() {
                return Err(format!(
                    "{what} cache element {at} written outside the slots ({c:?})"
                ));
            }
            if !fp8_written && bytes[at] != POISON {
                return Err(format!(
                    "{what} FP8 cache byte {at} written outside the slots ({c:?})"
                ));
            }
        }
    }
    Ok(worst)
}

/// An NVFP4 cache's codes and block scales against the reference (see
/// [`rope_host::Nvfp4Cache`]): for each written head's block of 16 elements `x` (k's reference
/// rotation, v's input), with `m = 1 / scale`, the block's scale one of the two E4M3 values
/// around `max |x| * m / 6`, and, with `b` that scale as stored, each code one of the two E2M1
/// values around `x * m / b` (zero where `b` is 0); every byte outside the written slots keeps
/// its poison.
fn verify_nvfp4<T: TestElem>(
    c: &Case,
    data: &Data<T>,
    dev: &Device<T>,
    stream: &Arc<CudaStream>,
    table: Option<&(Vec<f64>, Vec<f64>)>,
    worst: &mut Worst,
) -> Result<(), String> {
    let e = |e: rope_host::cudarc::driver::DriverError| e.to_string();
    let cc = c.cache.as_ref().ok_or("an NVFP4 case has a cache")?;
    let (layout, scale_strides, scales_at) = c.nvfp4_layout(cc);
    let capacity = (cc.num_blocks * cc.block_size) as i64;
    // Inline scales are read from the codes' buffer.
    let scales_of = |codes: &CudaSlice<u8>, own: &CudaSlice<u8>| {
        stream
            .clone_dtoh(if cc.nvfp4_inline { codes } else { own })
            .map_err(e)
    };
    let caches = [
        (
            "k",
            stream.clone_dtoh(&dev.k_cache8).map_err(e)?,
            scales_of(&dev.k_cache8, &dev.k_block_scales)?,
            &data.k_scale,
            cc.k_per_head,
        ),
        (
            "v",
            stream.clone_dtoh(&dev.v_cache8).map_err(e)?,
            scales_of(&dev.v_cache8, &dev.v_block_scales)?,
            &data.v_scale,
            cc.v_per_head,
        ),
    ];
    for (what, codes, scales, global, per_head) in &caches {
        let (mut code_written, mut scale_written) =
            (vec![false; codes.len()], vec![false; scales.len()]);
        for t in 0..c.tokens() {
            let slot = cc.slots[t];
            if slot < 0 || slot >= capacity {
                continue;
            }
            let (block, row) = (slot as usize / cc.block_size, slot as usize % cc.block_size);
            for h in 0..c.hk {
                let want: Vec<f64> = if *what == "k" {
                    reference_head(c, &data.k, c.hk, (t, h), Some(&data.k_w), table).0
                } else {
                    let at = (t * c.hk + h) * c.d;
                    data.v[at..at + c.d].iter().map(|x| x.to_f64()).collect()
                };
                let m = 1.0 / f64::from(global[if *per_head { h } else { 0 }]);
                let head =
                    block * layout.strides[0] + row * layout.strides[1] + h * layout.strides[2];
                let scale_head = scales_at
                    + block * scale_strides[0]
                    + row * scale_strides[1]
                    + h * scale_strides[2];
                for (b, x) in want.chunks(16).enumerate() {
                    let at = scale_head + b;
                    scale_written[at] = true;
                    let top = x.iter().fold(0.0f64, |a, v| a.max(v.abs()));
                    let (lo, hi) = e4m3_bracket(top * m / 6.0);
                    let got = f64::from(e4m3_to_f32(scales[at]));
                    let ok = got >= lo && got <= hi;
                    worst.add(if ok { 0.0 } else { 2.0 }, 1.0);
                    if !ok {
                        return Err(format!(
                            "{what} NVFP4 block scale token {t} head {h} block {b}: got {got}, \
                             want {} ({c:?})",
                            top * m / 6.0
                        ));
                    }
                    for (i, x) in x.iter().enumerate() {
                        let e = head + 16 * b + i;
                        code_written[e / 2] = true;
                        let code = (codes[e / 2] >> (4 * (e % 2))) & 0xf;
                        let g = f64::from(e2m1_to_f32(code));
                        let (lo, hi) = if got == 0.0 {
                            (0.0, 0.0)
                        } else {
                            e2m1_bracket(x * m / got)
                        };
                        let ok = g >= lo && g <= hi;
                        worst.add(if ok { 0.0 } else { 2.0 }, 1.0);
                        if !ok {
                            return Err(format!(
                                "{what} NVFP4 code token {t} head {h} element {}: got {g}, want \
                                 {} (block scale {got}) ({c:?})",
                                16 * b + i,
                                x * m / got
                            ));
                        }
                    }
                }
            }
        }
        if cc.nvfp4_inline {
            // One buffer: a byte is written as a code or as a scale.
            for (w, s) in code_written.iter_mut().zip(&scale_written) {
                *w |= *s;
            }
            scale_written.clone_from(&code_written);
        }
        for (bytes, written, kind) in [
            (codes, &code_written, "code"),
            (scales, &scale_written, "block scale"),
        ] {
            if let Some(at) = (0..bytes.len()).find(|&at| !written[at] && bytes[at] != POISON) {
                return Err(format!(
                    "{what} NVFP4 {kind} byte {at} written outside the slots ({c:?})"
                ));
            }
        }
    }
    Ok(())
}

/// The non-rotary parts' FP8 outputs (of q's and of k's FP8 outputs, when the case has parts):
/// each element the FP8 of `x * m` with its rotated part's scale ([`check_fp8`]), and the
/// bytes between the heads still poisoned.
fn verify_nope<T: TestElem>(
    c: &Case,
    data: &Data<T>,
    dev: &Device<T>,
    stream: &Arc<CudaStream>,
    worst: &mut Worst,
) -> Result<(), String> {
    let e = |e: rope_host::cudarc::driver::DriverError| e.to_string();
    let parts = [
        match c.q {
            QMode::Fp8 { per_head } => Some((
                "q non-rotary",
                c.hq,
                per_head,
                &data.q_nope,
                &dev.q_nope8,
                &data.q_scale,
            )),
            _ => None,
        },
        match c.k {
            KMode::Fp8 { per_head } => Some((
                "k non-rotary",
                c.hk,
                per_head,
                &data.k_nope,
                &dev.k_nope8,
                &data.k_scale,
            )),
            _ => None,
        },
    ];
    for (what, heads, per_head, x, out, scales) in
        parts.into_iter().flatten().filter(|_| c.nope > 0)
    {
        let got = stream.clone_dtoh(out).map_err(e)?;
        let (_, layout) = nope_layouts(c, heads);
        let mut written = vec![false; got.len()];
        for t in 0..c.tokens() {
            for h in 0..heads {
                let s = scales[if per_head && !c.multipliers { h } else { 0 }];
                for i in 0..c.nope {
                    let at = t * layout.strides()[1] + h * layout.strides()[2] + i;
                    written[at] = true;
                    let want = x[(t * heads + h) * c.nope + i].to_f64();
                    check_fp8(c, got[at], want, s, worst).map_err(|g| {
                        format!("{what} token {t} head {h} element {i}: got {g}, want {want} x m ({c:?})")
                    })?;
                }
            }
        }
        if let Some(at) = (0..got.len()).find(|&at| !written[at] && got[at] != POISON) {
            return Err(format!(
                "{what} output byte {at} written between the heads ({c:?})"
            ));
        }
    }
    Ok(())
}
