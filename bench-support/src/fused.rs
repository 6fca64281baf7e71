//! The fused kernels (`Rope::run_fused`) at decode (batch 64, one token each) and prefill
//! (8192 tokens), 32 q and 8 kv heads of 128 bf16, NeoX, `i64` device positions and slots, per
//! launch eager and inside a CUDA graph of 100 launches, next to:
//! - a device copy of the bytes each fused variant must move (its own row: q and k for norm +
//!   rope; q, k and v for the cache variants; three quarters of those bytes with FP8 stores),
//! - the unfused sequence: rope-rs's q/k rotation plus device copies of the bytes a separate
//!   norm (q and k read and written) and a separate cache write (k and v) move, at the copy
//!   engine's speed: a lower bound for any unfused sequence of kernels;
//! - each fused variant and the unfused sequence again with programmatic dependent launch
//!   (`StreamOverlap::Programmatic`, rows marked `PDL`; the same launches as the others where
//!   the device has no sm_90 kernels).
//!
//! - a diffusion transformer's step at the same shapes: q and k normalised across all of a
//!   token's heads, then rotated by 3-D axial positions, next to the copy of q and k;
//! - MLA at the same token counts (128 q heads whose last 64 features rotate, one k head of
//!   64 and 512 latent features into FP8 or bf16 caches), next to a copy of its bytes.
//!
//! Sin/cos are computed in the kernels unless [`SINCOS_VAR`] is `table` (a bf16
//! `cos_sin_cache`, vLLM's format).

use std::sync::Arc;

use rope_host::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use rope_host::cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use rope_host::half::bf16;
use rope_host::{
    AxisMap, CacheAddress, CacheData, CacheLayout, CacheNonRotary, DeviceAxisMap, DeviceInts,
    Fp8Format, Fp8Scale, Frequencies, FrequencySpec, FusedGrads, FusedIo, FusedOp, IdsShape, Io,
    KOut, KvCache, Layout, NonRotaryCache, NormScope, NormWeight, Nvfp4Cache, PageTable, Positions,
    QOut, QkIo, QkNorm, Rope, RopeConfig, RopeOp, RopeScaling, RopeStyle, SinCos, SinCosTables,
    StreamOverlap, TableFormat, Tensor, TensorMut,
};
use rope_host::{
    DType, IntType, RawBuf, RawCacheAddress, RawCacheData, RawCacheNonRotary, RawFp8Scale,
    RawFusedIo, RawFusedOp, RawInts, RawIo, RawKOut, RawKvCache, RawOp, RawPositions, RawQOut,
    RawSinCos, RawTensor, TableData,
};

use crate::decode::{Handles, LAUNCHES, per_launch};
use crate::timing::quartiles;

const REGIONS: usize = 11;
const THETA: f64 = 1_000_000.0;
const HQ: usize = 32;
const HK: usize = 8;
/// The heads' features by default ([`HEAD_DIM_VAR`] changes it).
const DEFAULT_D: usize = 128;
/// The DiT row's heads' features (its axes' widths sum to them).
const DIT_D: usize = 128;

/// Environment variable: the fused rows' head size (even, 64 to 512; 128 by default), for
/// rows of wider heads such as Gemma 4's global layers' 512 (their norm sums across warps).
/// Other than 128, the DiT and MLA rows, whose heads are their own, are skipped, and past
/// 256 the NVFP4 rows (their kernels' norm sums within a warp).
pub const HEAD_DIM_VAR: &str = "ROPE_BENCH_FUSED_HEAD_DIM";

/// The heads' features of the fused rows: [`HEAD_DIM_VAR`], else 128.
pub fn head_dim() -> usize {
    static CELL: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CELL.get_or_init(|| {
        std::env::var(HEAD_DIM_VAR)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&d: &usize| d.is_multiple_of(2) && (64..=512).contains(&d))
            .unwrap_or(DEFAULT_D)
    })
}
const BLOCK: usize = 16;
/// Token `t`'s position is `FIRST_POSITION + t % POSITION_SPAN`.
const FIRST_POSITION: i64 = 1000;
const POSITION_SPAN: i64 = 4096;

/// One measured variant of one shape.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FusedRow {
    /// `decode` or `prefill`.
    pub shape: &'static str,
    /// What was launched.
    pub variant: &'static str,
    /// Median per launch of 100 launches enqueued back to back, in µs.
    pub eager_us: f64,
    /// Median per launch inside a graph of 100 launches, in µs.
    pub graph_us: f64,
    /// The copy row of the bytes this variant moves (`None` for copies and the unfused
    /// sequence).
    pub own_copy: Option<&'static str>,
}

/// What a variant launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// A device copy of some of q, k and v's bytes (each read once, written once).
    Copy(Bytes),
    /// q/k RMS norm and rotation, in place.
    NormRope,
    /// Rotation of q in place, k and v into a bf16 cache.
    RopeCache,
    /// Norm, rotation, cache write: everything of a Qwen3 decode step.
    NormRopeCache,
    /// As `NormRopeCache` with FP8 q output and FP8 cache.
    NormRopeCacheFp8,
    /// As `NormRopeCacheFp8` with an NVFP4 cache (E2M1 codes, an E4M3 scale per 16 elements,
    /// one global scale each for k and v).
    NormRopeCacheNvfp4,
    /// FlashInfer's `rope_quantize_fp8_append_paged_kv_cache` form: rotation (no norm) into an
    /// FP8 q output and an FP8 cache of `x * multiplier` by value, the cache addressed by a page
    /// table.
    RopeFp8PageTable,
    /// rope-rs's rotation plus copies of the bytes of a separate norm and cache write.
    Unfused,
    /// The QK-norm + RoPE backward (`Rope::run_fused_backward`) of `NormRope`'s step: the input
    /// and weight gradients from the forward inputs and the output gradients, out of place.
    NormRopeBackward,
    /// A diffusion transformer's step (WAN-style, FlashInfer's `fused_qk_rmsnorm_rope`): q and
    /// k normalised across all of a token's heads (weights of `heads * 128`), then rotated by
    /// 3-D axial positions (a frames x 32 x 32 grid of tokens; axes of 44, 42 and 42 features,
    /// each axis's frequencies `theta^(-2i / axis)`), in place.
    AcrossHeads,
    /// MLA (DeepSeek-V3's shapes, vLLM's `concat_and_cache_mla_rope_fused`): `q_pe`, the last
    /// 64 of each of 128 q heads' 192 features, and `k_pe`, one head of 64, rotated in place;
    /// `k_pe` into the k cache and the 512 latent features into the latent cache (FlashInfer's
    /// `kpe_cache` and `ckv_cache`), E4M3 with a scale or bf16; or into vLLM's one cache
    /// (`[blocks, 16, 512 + 64]`, each row the latent features then the rotated `k_pe`,
    /// launched by address as `concat_and_cache_mla_rope_fused` is).
    Mla { fp8: bool, cache: MlaCache },
    /// `NormRope` (`cache` false) or `NormRopeCache` with the first half of each head rotated
    /// (GLM-4's and Phi's partial rotary): the norm and the stores take whole heads. Sin/cos
    /// computed: left out of runs with a table or a partial rotation of their own.
    HalfRotary { cache: bool },
}

/// The caches of MLA's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MlaCache {
    /// FlashInfer's `kpe_cache` and `ckv_cache`: a tensor each.
    Two,
    /// vLLM's one cache: the latent features and the rotated `k_pe` in each slot's row.
    One,
}

/// How many bytes a copy variant moves: exactly what a fused variant reads (and writes as
/// many of).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bytes {
    /// q and k: norm + rope in place.
    Qk,
    /// q, k and v: q in place, k and v into the cache.
    Qkv,
    /// Three quarters of q, k and v: read as bf16 (2 bytes), written as FP8 (1 byte), so
    /// 3 bytes per element, as a copy of 1.5 bytes per element.
    Qkv3of4,
    /// q read as bf16 and written as FP8 (3 bytes an element), k and v read as bf16 and
    /// written as NVFP4 (2 + 9/16 bytes: half a byte and a sixteenth of a scale byte): as a
    /// copy of `(48 q + 82 (k + v) / 2) / 64` elements of 4 bytes read and written.
    Nvfp4,
    /// MLA's `q_pe`, `k_pe` and latent features (each read and written once, as bf16).
    Mla,
    /// One and a half times q's and k's: the QK-norm + RoPE backward reads the forward inputs
    /// and the output gradients and writes the input gradients (three passes over q and k, as
    /// a copy's read and write of 1.5 times their bytes).
    QkBackward,
}

const COPY_QK: &str = "copy of q, k";
const COPY_QKV: &str = "copy of q, k, v";
const COPY_FP8: &str = "copy of 3/4 of q, k, v";
const COPY_NVFP4: &str = "copy of FP8 q, NVFP4 k, v bytes";
const COPY_MLA: &str = "copy of MLA q_pe, k_pe, latent";
const COPY_BACKWARD: &str = "copy of 1.5 x q, k";

/// MLA's q heads, their features (the rotated `q_pe` last), the rotated features and the
/// latent features of its one k head.
const MLA_HEADS: usize = 128;
const MLA_Q_DIM: usize = 192;
const MLA_ROPE: usize = 64;
const MLA_LATENT: usize = 512;

/// Each variant, its name, the copy of its own bytes, and how its launches overlap the one
/// before (the rotation's, for the unfused sequence).
const VARIANTS: [(Variant, &str, Option<&str>, StreamOverlap); 32] = [
    (
        Variant::AcrossHeads,
        "DiT: norm across heads + 3-D axial rope",
        Some(COPY_QK),
        StreamOverlap::None,
    ),
    (
        Variant::Copy(Bytes::QkBackward),
        COPY_BACKWARD,
        None,
        StreamOverlap::None,
    ),
    (
        Variant::NormRopeBackward,
        "norm + rope backward",
        Some(COPY_BACKWARD),
        StreamOverlap::None,
    ),
    (Variant::Copy(Bytes::Qk), COPY_QK, None, StreamOverlap::None),
    (
        Variant::Copy(Bytes::Qkv),
        COPY_QKV,
        None,
        StreamOverlap::None,
    ),
    (
        Variant::Copy(Bytes::Qkv3of4),
        COPY_FP8,
        None,
        StreamOverlap::None,
    ),
    (
        Variant::NormRope,
        "norm + rope",
        Some(COPY_QK),
        StreamOverlap::None,
    ),
    (
        Variant::RopeCache,
        "rope + cache",
        Some(COPY_QKV),
        StreamOverlap::None,
    ),
    (
        Variant::NormRopeCache,
        "norm + rope + cache",
        Some(COPY_QKV),
        StreamOverlap::None,
    ),
    (
        Variant::NormRopeCacheFp8,
        "norm + rope + FP8 q, cache",
        Some(COPY_FP8),
        StreamOverlap::None,
    ),
    (
        Variant::RopeFp8PageTable,
        "rope + FP8 q, page-table cache",
        Some(COPY_FP8),
        StreamOverlap::None,
    ),
    (
        Variant::Copy(Bytes::Nvfp4),
        COPY_NVFP4,
        None,
        StreamOverlap::None,
    ),
    (
        Variant::NormRopeCacheNvfp4,
        "norm + rope + FP8 q, NVFP4 cache",
        Some(COPY_NVFP4),
        StreamOverlap::None,
    ),
    (
        Variant::HalfRotary { cache: false },
        "norm + rope, half rotary",
        Some(COPY_QK),
        StreamOverlap::None,
    ),
    (
        Variant::HalfRotary { cache: true },
        "norm + rope + cache, half rotary",
        Some(COPY_QKV),
        StreamOverlap::None,
    ),
    (
        Variant::Unfused,
        "unfused: rope + copies",
        Some(COPY_QKV),
        StreamOverlap::None,
    ),
    (
        Variant::NormRope,
        "norm + rope, PDL",
        Some(COPY_QK),
        StreamOverlap::Programmatic,
    ),
    (
        Variant::RopeCache,
        "rope + cache, PDL",
        Some(COPY_QKV),
        StreamOverlap::Programmatic,
    ),
    (
        Variant::NormRopeCache,
        "norm + rope + cache, PDL",
        Some(COPY_QKV),
        StreamOverlap::Programmatic,
    ),
    (
        Variant::NormRopeCacheFp8,
        "norm + rope + FP8 q, cache, PDL",
        Some(COPY_FP8),
        StreamOverlap::Programmatic,
    ),
    (
        Variant::RopeFp8PageTable,
        "rope + FP8 q, page-table cache, PDL",
        Some(COPY_FP8),
        StreamOverlap::Programmatic,
    ),
    (
        Variant::NormRopeCacheNvfp4,
        "norm + rope + FP8 q, NVFP4 cache, PDL",
        Some(COPY_NVFP4),
        StreamOverlap::Programmatic,
    ),
    (
        Variant::Unfused,
        "unfused: rope + copies, PDL",
        Some(COPY_QKV),
        StreamOverlap::Programmatic,
    ),
    (
        Variant::Copy(Bytes::Mla),
        COPY_MLA,
        None,
        StreamOverlap::None,
    ),
    (
        Variant::Mla {
            fp8: true,
            cache: MlaCache::Two,
        },
        "MLA rope + FP8 caches",
        Some(COPY_MLA),
        StreamOverlap::None,
    ),
    (
        Variant::Mla {
            fp8: false,
            cache: MlaCache::Two,
        },
        "MLA rope + bf16 caches",
        Some(COPY_MLA),
        StreamOverlap::None,
    ),
    (
        Variant::Mla {
            fp8: true,
            cache: MlaCache::Two,
        },
        "MLA rope + FP8 caches, PDL",
        Some(COPY_MLA),
        StreamOverlap::Programmatic,
    ),
    (
        Variant::Mla {
            fp8: false,
            cache: MlaCache::Two,
        },
        "MLA rope + bf16 caches, PDL",
        Some(COPY_MLA),
        StreamOverlap::Programmatic,
    ),
    (
        Variant::Mla {
            fp8: true,
            cache: MlaCache::One,
        },
        "MLA rope + vLLM's FP8 cache",
        Some(COPY_MLA),
        StreamOverlap::None,
    ),
    (
        Variant::Mla {
            fp8: false,
            cache: MlaCache::One,
        },
        "MLA rope + vLLM's bf16 cache",
        Some(COPY_MLA),
        StreamOverlap::None,
    ),
    (
        Variant::Mla {
            fp8: true,
            cache: MlaCache::One,
        },
        "MLA rope + vLLM's FP8 cache, PDL",
        Some(COPY_MLA),
        StreamOverlap::Programmatic,
    ),
    (
        Variant::Mla {
            fp8: false,
            cache: MlaCache::One,
        },
        "MLA rope + vLLM's bf16 cache, PDL",
        Some(COPY_MLA),
        StreamOverlap::Programmatic,
    ),
];

/// Device buffers of one shape.
struct Buffers {
    tokens: usize,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    q8: CudaSlice<u8>,
    qkv_src: CudaSlice<bf16>,
    qkv_dst: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    scale: CudaSlice<f32>,
    ids: CudaSlice<i64>,
    slots: CudaSlice<i64>,
    k_cache: CudaSlice<bf16>,
    v_cache: CudaSlice<bf16>,
    k_cache8: CudaSlice<u8>,
    v_cache8: CudaSlice<u8>,
    /// The NVFP4 caches' block scales (their codes in `k_cache8` and `v_cache8`).
    block_scales: (CudaSlice<u8>, CudaSlice<u8>),
    /// FlashInfer's page table of the same slots: `batch_indices` (one request), `positions`,
    /// `kv_indptr`, `kv_indices` (the blocks in reverse order).
    page_table: [CudaSlice<i32>; 4],
    /// MLA's q (`[tokens, 128, 192]`, `q_pe` the last 64 of each head), `k_pe`
    /// (`[tokens, 1, 64]`), the latent features (`[tokens, 1, 512]`) and the caches: k's
    /// (`[blocks, 16, 64]`) and the latent one (`[blocks, 16, 512]`), bf16 and FP8.
    mla_q: CudaSlice<bf16>,
    mla_kpe: CudaSlice<bf16>,
    mla_latent: CudaSlice<bf16>,
    mla_caches: (CudaSlice<bf16>, CudaSlice<bf16>),
    mla_caches8: (CudaSlice<u8>, CudaSlice<u8>),
    /// vLLM's one MLA cache, bf16 and FP8: rows of the latent features, then `k_pe`.
    mla_one: CudaSlice<bf16>,
    mla_one8: CudaSlice<u8>,
    /// The destination of MLA's copy row.
    mla_copy: CudaSlice<bf16>,
    /// The backward's forward inputs of q and k, its input gradients, its weight gradients
    /// and its workspace.
    backward_x: (CudaSlice<bf16>, CudaSlice<bf16>),
    backward_out: (CudaSlice<bf16>, CudaSlice<bf16>),
    backward_w: (CudaSlice<bf16>, CudaSlice<bf16>),
    workspace: CudaSlice<f32>,
    /// The DiT row's weights, positions, axes and frequencies.
    dit: Dit,
    /// The DiT row's A/B knobs ([`DIT_VAR`]), read once.
    dit_knobs: DitKnobs,
    /// vLLM's `cos_sin_cache` when [`SINCOS_VAR`] asks for it, else sin/cos are computed.
    table: Option<SinCosTables<bf16>>,
    /// MLA's `cos_sin_cache` of 64 rotated features when [`SINCOS_VAR`] asks for one.
    mla_table: Option<SinCosTables<bf16>>,
    /// Every launch's configuration: the pairing [`STYLE_VAR`] and the rotated features
    /// [`ROTARY_VAR`] ask for, read once (not in the timed launches).
    config: RopeConfig,
}

/// q and k rotated in place: the fused launches of the norm + rope and DiT rows.
fn qk_in_place<'a>(
    (q, k): (&'a mut CudaSlice<bf16>, &'a mut CudaSlice<bf16>),
    (lq, lk): (Layout, Layout),
) -> FusedIo<'a, bf16> {
    FusedIo::Separate {
        q: QOut::InPlace(TensorMut {
            data: q.as_view_mut(),
            layout: lq,
        }),
        k: KOut::InPlace(TensorMut {
            data: k.as_view_mut(),
            layout: lk,
        }),
        v: None,
    }
}

/// The DiT row's ([`Variant::AcrossHeads`]) device data: q's and k's weights (`heads * 128`
/// each), the tokens' `[3, tokens]` positions on a grid of 32 x 32 tokens a frame, the axial
/// pairs' axes and frequencies.
struct Dit {
    weights: (CudaSlice<bf16>, CudaSlice<bf16>),
    positions: CudaSlice<i64>,
    axes: DeviceAxisMap,
    freqs: Frequencies,
}

/// Environment variable of the DiT row's A/B knobs, comma-separated: `ids` launches it with
/// the fused rows' positions and computed sin/cos instead of the axial ones, `per-head`
/// normalises each head instead of the token's heads.
pub const DIT_VAR: &str = "ROPE_BENCH_DIT";

/// The knobs [`DIT_VAR`] sets.
#[derive(Clone, Copy, Debug, Default)]
struct DitKnobs {
    ids: bool,
    per_head: bool,
}

impl DitKnobs {
    fn from_env() -> Self {
        let v = std::env::var(DIT_VAR).unwrap_or_default();
        let has = |k: &str| v.split(',').any(|x| x == k);
        DitKnobs {
            ids: has("ids"),
            per_head: has("per-head"),
        }
    }
}

/// The DiT row's features per axis (frames, height, width), as WAN splits a head of 128.
const DIT_AXES: [u32; 3] = [44, 42, 42];
/// The DiT row's tokens per frame row and column.
const DIT_SIDE: i64 = 32;
/// The DiT row's frequency base.
const DIT_THETA: f64 = 10_000.0;

impl Dit {
    fn new(rope: &Rope, stream: &Arc<CudaStream>, tokens: usize) -> anyhow::Result<Self> {
        let fill = |n: usize, k: f32| -> Vec<bf16> {
            (0..n)
                .map(|i| bf16::from_f32(1.0 + 0.2 * (i as f32 * k).sin()))
                .collect()
        };
        let t = tokens as i64;
        let grid = |axis: i64, i: i64| match axis {
            0 => i / (DIT_SIDE * DIT_SIDE),
            1 => i / DIT_SIDE % DIT_SIDE,
            _ => i % DIT_SIDE,
        };
        let positions: Vec<i64> = (0..3)
            .flat_map(|a| (0..t).map(move |i| grid(a, i)))
            .collect();
        let spec = FrequencySpec::new(DIT_THETA, DIT_D as u32).scaling(RopeScaling::Axial {
            axes_dim: DIT_AXES.to_vec(),
        });
        Ok(Self {
            weights: (
                stream.clone_htod(&fill(HQ * DIT_D, 0.13))?,
                stream.clone_htod(&fill(HK * DIT_D, 0.17))?,
            ),
            positions: stream.clone_htod(&positions)?,
            axes: rope.axis_map(&AxisMap::axial(&DIT_AXES, DIT_D as u32)?)?,
            freqs: rope.frequencies(&spec)?,
        })
    }
}

/// Environment variable: `table` makes every fused launch read sin/cos from a bf16
/// `cos_sin_cache` (vLLM's format) instead of computing them.
pub const SINCOS_VAR: &str = "ROPE_BENCH_FUSED_SINCOS";

/// Environment variable: `interleaved` makes every fused launch pair GPT-J's way instead of
/// NeoX's, for A/B runs of the interleaved kernels.
pub const STYLE_VAR: &str = "ROPE_BENCH_FUSED_STYLE";

/// Environment variable: a number below 128 rotates only the first that many features of each
/// head (partial rotary: the fused kernels of partial heads), the rest normalised and stored.
pub const ROTARY_VAR: &str = "ROPE_BENCH_FUSED_ROTARY";

/// The rotated features [`ROTARY_VAR`] asks for (the whole head by default).
fn rotary_from_env() -> u32 {
    std::env::var(ROTARY_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&r: &u32| r > 0 && r <= head_dim() as u32)
        .unwrap_or(head_dim() as u32)
}

/// The pairing [`STYLE_VAR`] asks for.
fn style_from_env() -> RopeStyle {
    match std::env::var(STYLE_VAR).as_deref() {
        Ok("interleaved") => RopeStyle::Interleaved,
        _ => RopeStyle::Neox,
    }
}

/// q (`layout`) into the E4M3 bytes `q8` with `scale`: the FP8 q output of the bench's rows.
fn q_fp8<'a>(
    (q, q8): (&'a CudaSlice<bf16>, &'a mut CudaSlice<u8>),
    layout: Layout,
    scale: Fp8Scale<'a>,
) -> QOut<'a, bf16> {
    QOut::Fp8 {
        input: Tensor {
            data: q.as_view(),
            layout,
        },
        output: TensorMut {
            data: q8.as_view_mut(),
            layout,
        },
        scale,
        format: Fp8Format::E4m3,
        non_rotary: None,
    }
}

/// MLA's `q_pe` in `t` tokens of q: the last `MLA_ROPE` of each head's `MLA_Q_DIM` features.
fn mla_q_pe(t: usize) -> rope_host::Result<Layout> {
    Layout::strided(
        [1, t, MLA_HEADS, MLA_ROPE],
        [
            t * MLA_HEADS * MLA_Q_DIM,
            MLA_HEADS * MLA_Q_DIM,
            MLA_Q_DIM,
            1,
        ],
        MLA_Q_DIM - MLA_ROPE,
    )
}

/// An NVFP4 cache of codes and block scales with one global scale.
fn nvfp4_cache<'a>(
    (values, block_scales): (&'a mut CudaSlice<u8>, &'a mut CudaSlice<u8>),
    scale: &'a CudaSlice<f32>,
) -> Nvfp4Cache<'a> {
    Nvfp4Cache {
        codes: values.as_view_mut(),
        block_scales: block_scales.as_view_mut(),
        scale: Fp8Scale::PerTensor(scale.as_view()),
    }
}

impl Buffers {
    fn new(
        stream: &Arc<CudaStream>,
        tokens: usize,
        (table, mla_table): (Option<SinCosTables<bf16>>, Option<SinCosTables<bf16>>),
        config: RopeConfig,
        workspace: usize,
        dit: Dit,
    ) -> anyhow::Result<Self> {
        let fill = |n: usize, k: f32| -> Vec<bf16> {
            (0..n)
                .map(|i| bf16::from_f32((i as f32 * k).sin()))
                .collect()
        };
        let (qn, kn) = (tokens * HQ * head_dim(), tokens * HK * head_dim());
        let blocks = tokens.div_ceil(BLOCK) + 1;
        let cache = blocks * BLOCK * HK * head_dim();
        // The largest copy row: q, k and v, or one and a half times q and k.
        let copied = (qn + 2 * kn).max(3 * (qn + kn) / 2);
        // Slots in reverse order of the blocks, as a paged allocator hands them out.
        let slots: Vec<i64> = (0..tokens as i64)
            .map(|t| (tokens as i64 - 1 - t) + BLOCK as i64)
            .collect();
        Ok(Self {
            tokens,
            q: stream.clone_htod(&fill(qn, 0.37))?,
            k: stream.clone_htod(&fill(kn, 0.53))?,
            v: stream.clone_htod(&fill(kn, 0.29))?,
            q8: stream.alloc_zeros(qn)?,
            qkv_src: stream.clone_htod(&fill(copied, 0.11))?,
            qkv_dst: stream.alloc_zeros(copied)?,
            w: stream.clone_htod(&fill(head_dim(), 0.7))?,
            scale: stream.clone_htod(&[0.05f32])?,
            ids: stream.clone_htod(
                &(0..tokens as i64)
                    .map(|t| FIRST_POSITION + t % POSITION_SPAN)
                    .collect::<Vec<_>>(),
            )?,
            slots: stream.clone_htod(&slots)?,
            k_cache: stream.alloc_zeros(cache)?,
            v_cache: stream.alloc_zeros(cache)?,
            k_cache8: stream.alloc_zeros(cache)?,
            v_cache8: stream.alloc_zeros(cache)?,
            block_scales: (
                stream.alloc_zeros(cache / 16)?,
                stream.alloc_zeros(cache / 16)?,
            ),
            page_table: [
                stream.alloc_zeros(tokens)?,
                stream.clone_htod(&(0..tokens as i32).collect::<Vec<_>>())?,
                stream.clone_htod(&[0, blocks as i32])?,
                stream.clone_htod(&(0..blocks as i32).rev().collect::<Vec<_>>())?,
            ],
            mla_q: stream.clone_htod(&fill(tokens * MLA_HEADS * MLA_Q_DIM, 0.41))?,
            mla_kpe: stream.clone_htod(&fill(tokens * MLA_ROPE, 0.23))?,
            mla_latent: stream.clone_htod(&fill(tokens * MLA_LATENT, 0.31))?,
            mla_caches: (
                stream.alloc_zeros(blocks * BLOCK * MLA_ROPE)?,
                stream.alloc_zeros(blocks * BLOCK * MLA_LATENT)?,
            ),
            mla_caches8: (
                stream.alloc_zeros(blocks * BLOCK * MLA_ROPE)?,
                stream.alloc_zeros(blocks * BLOCK * MLA_LATENT)?,
            ),
            mla_one: stream.alloc_zeros(blocks * BLOCK * (MLA_LATENT + MLA_ROPE))?,
            mla_one8: stream.alloc_zeros(blocks * BLOCK * (MLA_LATENT + MLA_ROPE))?,
            mla_copy: stream
                .alloc_zeros(tokens * (MLA_HEADS * MLA_ROPE + MLA_ROPE + MLA_LATENT))?,
            backward_x: (
                stream.clone_htod(&fill(qn, 0.19))?,
                stream.clone_htod(&fill(kn, 0.43))?,
            ),
            backward_out: (stream.alloc_zeros(qn)?, stream.alloc_zeros(kn)?),
            backward_w: (
                stream.alloc_zeros(head_dim())?,
                stream.alloc_zeros(head_dim())?,
            ),
            workspace: stream.alloc_zeros(workspace)?,
            dit,
            dit_knobs: DitKnobs::from_env(),
            table,
            mla_table,
            config,
        })
    }

    /// Launches MLA's row once ([`Variant::Mla`]): `q_pe` and `k_pe` rotated in place at the
    /// run's pairing, `k_pe` and the latent features into their caches by slot (FlashInfer's
    /// form of the launch: `k_pe` and the latent features in tensors of their own).
    fn run_mla(&mut self, rope: &Rope, fp8: bool) -> anyhow::Result<()> {
        let t = self.tokens;
        let q_pe = mla_q_pe(t)?;
        let blocks = self.mla_caches.0.len() / (BLOCK * MLA_ROPE);
        let op = FusedOp {
            rope: RopeOp {
                config: RopeConfig::builder(MLA_ROPE as u32, self.config.style()).build()?,
                positions: Positions::Ids {
                    ids: DeviceInts::I64(self.ids.as_view()),
                    shape: IdsShape::PerRow,
                },
                sincos: match &self.mla_table {
                    Some(t) => t.sincos(),
                    None => SinCos::Computed { theta: THETA },
                },
            },
            norm: None,
        };
        let io = FusedIo::Separate {
            q: QOut::InPlace(TensorMut {
                data: self.mla_q.as_view_mut(),
                layout: q_pe,
            }),
            k: KOut::InPlace(TensorMut {
                data: self.mla_kpe.as_view_mut(),
                layout: Layout::thd(t, 1, MLA_ROPE),
            }),
            v: None,
        };
        let data = if fp8 {
            CacheData::Fp8 {
                k: self.mla_caches8.0.as_view_mut(),
                v: self.mla_caches8.1.as_view_mut(),
                k_scale: Fp8Scale::PerTensor(self.scale.as_view()),
                v_scale: Fp8Scale::PerTensor(self.scale.as_view()),
                format: Fp8Format::E4m3,
            }
        } else {
            CacheData::Elem {
                k: self.mla_caches.0.as_view_mut(),
                v: self.mla_caches.1.as_view_mut(),
            }
        };
        let cache = KvCache {
            non_rotary: Some(CacheNonRotary {
                input: Tensor {
                    data: self.mla_latent.as_view(),
                    layout: Layout::thd(t, 1, MLA_LATENT),
                },
                into: NonRotaryCache::Latent(CacheLayout::blocks_rows_heads(
                    blocks, BLOCK, 1, MLA_LATENT,
                )),
            }),
            address: CacheAddress::Slots(DeviceInts::I64(self.slots.as_view())),
            layout: CacheLayout::blocks_rows_heads(blocks, BLOCK, 1, MLA_ROPE),
            data,
        };
        Ok(rope.run_fused(&op, io, Some(cache))?)
    }

    /// Launches MLA's row into vLLM's one cache once ([`MlaCache::One`]): as [`Self::run_mla`],
    /// `k_pe` into the last 64 columns of each slot's row and the latent features into the first
    /// 512, by address (the safe API holds no two views of one buffer).
    fn run_mla_one_cache(
        &mut self,
        rope: &Rope,
        stream: &Arc<CudaStream>,
        fp8: bool,
    ) -> anyhow::Result<()> {
        let t = self.tokens;
        let raw = |ptr: u64, len: usize| RawBuf { ptr, len };
        let q_pe = mla_q_pe(t)?;
        let sincos = match self.mla_table.as_ref().map(|t| (t.data(), t.shape())) {
            Some((TableData::Combined(cache), shape)) => RawSinCos::CosSinCache {
                cache: raw(cache.device_ptr(stream).0, cache.len()),
                dtype: DType::BF16,
                shape,
            },
            Some((TableData::Separate { cos, sin }, shape)) => RawSinCos::Table {
                cos: raw(cos.device_ptr(stream).0, cos.len()),
                sin: raw(sin.device_ptr(stream).0, sin.len()),
                dtype: DType::BF16,
                shape,
            },
            None => RawSinCos::Computed { theta: THETA },
        };
        let op = RawFusedOp {
            rope: RawOp {
                config: RopeConfig::builder(MLA_ROPE as u32, self.config.style()).build()?,
                dtype: DType::BF16,
                positions: RawPositions::Ids {
                    ids: RawInts {
                        buf: raw(self.ids.device_ptr(stream).0, self.ids.len()),
                        ty: IntType::I64,
                    },
                    shape: IdsShape::PerRow,
                },
                sincos,
            },
            norm: None,
        };
        let tensor = |s: &CudaSlice<bf16>, layout| RawTensor {
            buf: raw(s.device_ptr(stream).0, s.len()),
            layout,
        };
        let io = RawFusedIo::Separate {
            q: RawQOut::Elem(RawIo::InPlace(tensor(&self.mla_q, q_pe))),
            k: RawKOut::Elem(RawIo::InPlace(tensor(
                &self.mla_kpe,
                Layout::thd(t, 1, MLA_ROPE),
            ))),
            v: None,
        };
        let row = MLA_LATENT + MLA_ROPE;
        let (one, len, es) = if fp8 {
            (self.mla_one8.device_ptr(stream).0, self.mla_one8.len(), 1)
        } else {
            (self.mla_one.device_ptr(stream).0, self.mla_one.len(), 2)
        };
        let blocks = len / (BLOCK * row);
        let columns = |width| CacheLayout {
            strides: [BLOCK * row, row, width],
            ..CacheLayout::blocks_rows_heads(blocks, BLOCK, 1, width)
        };
        let (k, v) = (
            raw(one + (MLA_LATENT * es) as u64, len - MLA_LATENT),
            raw(one, len),
        );
        let data = if fp8 {
            let scale = RawFp8Scale::PerTensor(raw(self.scale.device_ptr(stream).0, 1));
            RawCacheData::Fp8 {
                k,
                v,
                k_scale: scale,
                v_scale: scale,
                format: Fp8Format::E4m3,
            }
        } else {
            RawCacheData::Elem { k, v }
        };
        let cache = RawKvCache {
            address: RawCacheAddress::Slots(RawInts {
                buf: raw(self.slots.device_ptr(stream).0, self.slots.len()),
                ty: IntType::I64,
            }),
            layout: columns(MLA_ROPE),
            data,
            non_rotary: Some(RawCacheNonRotary {
                input: tensor(&self.mla_latent, Layout::thd(t, 1, MLA_LATENT)),
                into: NonRotaryCache::Latent(columns(MLA_LATENT)),
            }),
        };
        // SAFETY: every buffer is this struct's, on `stream`'s context, alive past the launch
        // (the caller synchronizes before dropping them).
        unsafe { rope.run_fused_raw(&op, io, Some(cache), stream.cu_stream()) }?;
        Ok(())
    }

    /// Launches `variant` once.
    fn run(
        &mut self,
        rope: &Rope,
        stream: &Arc<CudaStream>,
        variant: Variant,
    ) -> anyhow::Result<()> {
        let t = self.tokens;
        let (lq, lk) = (
            Layout::thd(t, HQ, head_dim()),
            Layout::thd(t, HK, head_dim()),
        );
        let config = match variant {
            Variant::HalfRotary { .. } => {
                RopeConfig::builder(head_dim() as u32, self.config.style())
                    .rotary_dim(head_dim() as u32 / 2)
                    .build()?
            }
            _ => self.config,
        };
        let rope_op = || RopeOp {
            config,
            positions: Positions::Ids {
                ids: DeviceInts::I64(self.ids.as_view()),
                shape: IdsShape::PerRow,
            },
            sincos: match &self.table {
                Some(t) => t.sincos(),
                None => SinCos::Computed { theta: THETA },
            },
        };
        let norm = |on: bool| {
            on.then(|| QkNorm {
                q_weight: self.w.as_view(),
                k_weight: self.w.as_view(),
                eps: 1e-6,
                weight: NormWeight::Plain,
                scope: NormScope::PerHead,
            })
        };
        let layout = CacheLayout::blocks_rows_heads(
            self.k_cache.len() / (BLOCK * HK * head_dim()),
            BLOCK,
            HK,
            head_dim(),
        );
        match variant {
            Variant::Copy(bytes) => {
                let (qn, kn) = (t * HQ * head_dim(), t * HK * head_dim());
                let n = match bytes {
                    Bytes::Qk => qn + kn,
                    Bytes::Qkv => qn + 2 * kn,
                    Bytes::Qkv3of4 => (qn + 2 * kn) * 3 / 4,
                    Bytes::Nvfp4 => (48 * qn + 82 * kn) / 64,
                    Bytes::Mla => t * (MLA_HEADS * MLA_ROPE + MLA_ROPE + MLA_LATENT),
                    Bytes::QkBackward => 3 * (qn + kn) / 2,
                };
                if bytes == Bytes::Mla {
                    let src = self.mla_q.slice(0..n);
                    let mut dst = self.mla_copy.slice_mut(0..n);
                    return Ok(stream.memcpy_dtod(&src, &mut dst)?);
                }
                let src = self.qkv_src.slice(0..n);
                let mut dst = self.qkv_dst.slice_mut(0..n);
                Ok(stream.memcpy_dtod(&src, &mut dst)?)
            }
            Variant::Unfused => {
                let qk = QkIo::Separate {
                    q: Io::InPlace(TensorMut {
                        data: self.q.as_view_mut(),
                        layout: lq,
                    }),
                    k: Io::InPlace(TensorMut {
                        data: self.k.as_view_mut(),
                        layout: lk,
                    }),
                };
                rope.run_qk(&rope_op(), qk)?;
                // The norm's bytes (q and k), then the cache write's (k and v).
                let (qn, kn) = (t * HQ * head_dim(), t * HK * head_dim());
                let src = self.qkv_src.slice(0..qn + kn);
                let mut dst = self.qkv_dst.slice_mut(0..qn + kn);
                stream.memcpy_dtod(&src, &mut dst)?;
                let src = self.qkv_src.slice(0..2 * kn);
                let mut dst = self.qkv_dst.slice_mut(qn..qn + 2 * kn);
                Ok(stream.memcpy_dtod(&src, &mut dst)?)
            }
            Variant::NormRope | Variant::HalfRotary { cache: false } => {
                let op = FusedOp {
                    rope: rope_op(),
                    norm: norm(true),
                };
                let io = qk_in_place((&mut self.q, &mut self.k), (lq, lk));
                Ok(rope.run_fused(&op, io, None)?)
            }
            Variant::AcrossHeads => {
                let dit = &self.dit;
                // A/B knobs: the fused rows' positions and sin/cos, and a per-head norm.
                let (positions, sincos) = if self.dit_knobs.ids {
                    (
                        Positions::Ids {
                            ids: DeviceInts::I64(self.ids.as_view()),
                            shape: IdsShape::PerRow,
                        },
                        SinCos::Computed { theta: THETA },
                    )
                } else {
                    (
                        Positions::MultiAxis {
                            positions: DeviceInts::I64(dit.positions.as_view()),
                            axes: &dit.axes,
                        },
                        SinCos::Frequencies(&dit.freqs),
                    )
                };
                let norm = if self.dit_knobs.per_head {
                    norm(true)
                } else {
                    Some(QkNorm {
                        q_weight: dit.weights.0.as_view(),
                        k_weight: dit.weights.1.as_view(),
                        eps: 1e-6,
                        weight: NormWeight::Plain,
                        scope: NormScope::AcrossHeads,
                    })
                };
                let op = FusedOp {
                    // Whole heads: partial runs (`ROTARY_VAR`) leave this row out.
                    rope: RopeOp {
                        config,
                        positions,
                        sincos,
                    },
                    norm,
                };
                let io = qk_in_place((&mut self.q, &mut self.k), (lq, lk));
                Ok(rope.run_fused(&op, io, None)?)
            }
            Variant::NormRopeBackward => {
                let op = FusedOp {
                    rope: rope_op(),
                    norm: norm(true),
                };
                let grads = FusedGrads {
                    q_input: Tensor {
                        data: self.backward_x.0.as_view(),
                        layout: lq,
                    },
                    k_input: Tensor {
                        data: self.backward_x.1.as_view(),
                        layout: lk,
                    },
                    q: Io::OutOfPlace {
                        input: Tensor {
                            data: self.q.as_view(),
                            layout: lq,
                        },
                        output: TensorMut {
                            data: self.backward_out.0.as_view_mut(),
                            layout: lq,
                        },
                    },
                    k: Io::OutOfPlace {
                        input: Tensor {
                            data: self.k.as_view(),
                            layout: lk,
                        },
                        output: TensorMut {
                            data: self.backward_out.1.as_view_mut(),
                            layout: lk,
                        },
                    },
                    q_weight: self.backward_w.0.as_view_mut(),
                    k_weight: self.backward_w.1.as_view_mut(),
                    workspace: self.workspace.as_view_mut(),
                };
                Ok(rope.run_fused_backward(&op, grads)?)
            }
            Variant::RopeCache
            | Variant::NormRopeCache
            | Variant::HalfRotary { cache: true }
            | Variant::NormRopeCacheFp8
            | Variant::NormRopeCacheNvfp4 => {
                let nvfp4 = variant == Variant::NormRopeCacheNvfp4;
                let fp8 = variant == Variant::NormRopeCacheFp8 || nvfp4;
                let op = FusedOp {
                    rope: rope_op(),
                    norm: norm(variant != Variant::RopeCache),
                };
                let q = if fp8 {
                    let scale = Fp8Scale::PerTensor(self.scale.as_view());
                    q_fp8((&self.q, &mut self.q8), lq, scale)
                } else {
                    QOut::InPlace(TensorMut {
                        data: self.q.as_view_mut(),
                        layout: lq,
                    })
                };
                let io = FusedIo::Separate {
                    q,
                    k: KOut::CacheOnly(Tensor {
                        data: self.k.as_view(),
                        layout: lk,
                    }),
                    v: Some(Tensor {
                        data: self.v.as_view(),
                        layout: lk,
                    }),
                };
                let data = if nvfp4 {
                    CacheData::Nvfp4 {
                        k: nvfp4_cache((&mut self.k_cache8, &mut self.block_scales.0), &self.scale),
                        v: nvfp4_cache((&mut self.v_cache8, &mut self.block_scales.1), &self.scale),
                        scale_strides: layout.nvfp4_scale_strides(),
                    }
                } else if fp8 {
                    CacheData::Fp8 {
                        k: self.k_cache8.as_view_mut(),
                        v: self.v_cache8.as_view_mut(),
                        k_scale: Fp8Scale::PerTensor(self.scale.as_view()),
                        v_scale: Fp8Scale::PerTensor(self.scale.as_view()),
                        format: Fp8Format::E4m3,
                    }
                } else {
                    CacheData::Elem {
                        k: self.k_cache.as_view_mut(),
                        v: self.v_cache.as_view_mut(),
                    }
                };
                let cache = KvCache {
                    non_rotary: None,
                    address: CacheAddress::Slots(DeviceInts::I64(self.slots.as_view())),
                    layout,
                    data,
                };
                Ok(rope.run_fused(&op, io, Some(cache))?)
            }
            Variant::Mla {
                fp8,
                cache: MlaCache::Two,
            } => self.run_mla(rope, fp8),
            Variant::Mla {
                fp8,
                cache: MlaCache::One,
            } => self.run_mla_one_cache(rope, stream, fp8),
            Variant::RopeFp8PageTable => {
                let op = FusedOp {
                    rope: rope_op(),
                    norm: None,
                };
                let io = FusedIo::Separate {
                    q: q_fp8((&self.q, &mut self.q8), lq, Fp8Scale::Multiplier(20.0)),
                    k: KOut::CacheOnly(Tensor {
                        data: self.k.as_view(),
                        layout: lk,
                    }),
                    v: Some(Tensor {
                        data: self.v.as_view(),
                        layout: lk,
                    }),
                };
                let [batch_indices, positions, kv_indptr, kv_indices] = &self.page_table;
                let cache = KvCache {
                    non_rotary: None,
                    address: CacheAddress::PageTable(PageTable {
                        batch_indices: batch_indices.as_view(),
                        positions: positions.as_view(),
                        kv_indptr: kv_indptr.as_view(),
                        kv_indices: kv_indices.as_view(),
                    }),
                    layout,
                    data: CacheData::Fp8 {
                        k: self.k_cache8.as_view_mut(),
                        v: self.v_cache8.as_view_mut(),
                        k_scale: Fp8Scale::Multiplier(20.0),
                        v_scale: Fp8Scale::Multiplier(20.0),
                        format: Fp8Format::E4m3,
                    },
                };
                Ok(rope.run_fused(&op, io, Some(cache))?)
            }
        }
    }
}

/// Measures every variant at the shapes named in `shapes` (`decode`, `prefill`) on device
/// `ordinal`, in a context object of its own with cudarc's event tracking off (graph capture
/// needs it off). No shapes: no rows.
///
/// # Errors
/// Any driver or launch error.
pub fn fused_rows(ordinal: usize, shapes: &[&str]) -> anyhow::Result<Vec<FusedRow>> {
    if shapes.is_empty() {
        return Ok(Vec::new());
    }
    let ctx = CudaContext::new(ordinal)?;
    // SAFETY: this context object is used by this function alone, on one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream()?;
    let rotary = rotary_from_env();
    let config = RopeConfig::builder(head_dim() as u32, style_from_env())
        .rotary_dim(rotary)
        .build()?;
    let handles = Handles::new(&stream, THETA, rotary)?;
    handles.prepare(THETA, MLA_ROPE as u32)?;
    handles.prepare(THETA, head_dim() as u32 / 2)?;
    let mut rows = Vec::new();
    // FlashInfer's forms, NVFP4 caches, the backward and the DiT row rotate whole heads only: a partial
    // rotation (`ROTARY_VAR`) skips them, and MLA's rows, which rotate whole heads of their own.
    let partial = rotary < head_dim() as u32;
    let table = std::env::var(SINCOS_VAR).as_deref() == Ok("table");
    let own_heads = head_dim() != DEFAULT_D;
    let variants: Vec<_> = VARIANTS
        .into_iter()
        .filter(|(v, ..)| {
            !(own_heads
                && matches!(
                    v,
                    Variant::AcrossHeads | Variant::Mla { .. } | Variant::Copy(Bytes::Mla)
                ))
        })
        // A norm of heads of more than 256 features sums across warps, which the NVFP4
        // kernels do not.
        .filter(|(v, ..)| {
            head_dim() <= 256
                || !matches!(v, Variant::NormRopeCacheNvfp4 | Variant::Copy(Bytes::Nvfp4))
        })
        .filter(|(v, ..)| !((partial || table) && matches!(v, Variant::HalfRotary { .. })))
        .filter(|(v, ..)| {
            !partial
                || !matches!(
                    v,
                    Variant::RopeFp8PageTable
                        | Variant::NormRopeCacheNvfp4
                        | Variant::Copy(Bytes::Nvfp4)
                        | Variant::AcrossHeads
                        | Variant::Mla { .. }
                        | Variant::Copy(Bytes::Mla)
                        | Variant::NormRopeBackward
                        | Variant::Copy(Bytes::QkBackward)
                )
        })
        .collect();
    for (shape, tokens) in [("decode", 64), ("prefill", 8192)] {
        if !shapes.contains(&shape) {
            continue;
        }
        // Rows for every position the launches use.
        let table = (std::env::var(SINCOS_VAR).as_deref() == Ok("table"))
            .then(|| {
                handles.get(StreamOverlap::None).build_tables::<bf16>(
                    THETA,
                    rotary,
                    (FIRST_POSITION + POSITION_SPAN) as usize,
                    TableFormat::Combined,
                )
            })
            .transpose()?;
        let mla_table = (std::env::var(SINCOS_VAR).as_deref() == Ok("table"))
            .then(|| {
                handles.get(StreamOverlap::None).build_tables::<bf16>(
                    THETA,
                    MLA_ROPE as u32,
                    (FIRST_POSITION + POSITION_SPAN) as usize,
                    TableFormat::Combined,
                )
            })
            .transpose()?;
        let workspace = handles
            .get(StreamOverlap::None)
            .fused_backward_workspace(HQ + HK, head_dim());
        let dit = Dit::new(handles.get(StreamOverlap::None), &stream, tokens)?;
        let mut bufs = Buffers::new(&stream, tokens, (table, mla_table), config, workspace, dit)?;
        stream.synchronize()?;
        let mut graphs = Vec::new();
        for &(v, _, _, overlap) in &variants {
            let rope = handles.get(overlap);
            bufs.run(rope, &stream, v)?; // warm-up
            stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
            let captured = (0..LAUNCHES).try_for_each(|_| bufs.run(rope, &stream, v));
            let graph = stream.end_capture(CUgraphInstantiate_flags(0));
            captured?;
            graphs.push(graph?.ok_or_else(|| anyhow::anyhow!("the capture recorded nothing"))?);
        }
        // Rotating order per region, so clock drift falls on every variant alike.
        let mut times = vec![(Vec::new(), Vec::new()); variants.len()];
        for i in 0..=REGIONS {
            for j in (0..variants.len()).map(|j| (i + j) % variants.len()) {
                let (v, _, _, overlap) = variants[j];
                let rope = handles.get(overlap);
                let eager = per_launch(&ctx, &stream, &mut || {
                    (0..LAUNCHES).try_for_each(|_| bufs.run(rope, &stream, v))
                })?;
                let graph = per_launch(&ctx, &stream, &mut || Ok(graphs[j].launch()?))?;
                if i > 0 {
                    times[j].0.push(eager);
                    times[j].1.push(graph);
                }
            }
        }
        rows.extend(
            variants
                .iter()
                .zip(times)
                .map(|((_, name, own_copy, _), (eager, graph))| FusedRow {
                    shape,
                    variant: name,
                    eager_us: quartiles(eager)[1],
                    graph_us: quartiles(graph)[1],
                    own_copy: *own_copy,
                }),
        );
    }
    Ok(rows)
}
