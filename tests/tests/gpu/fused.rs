//! The fused kernels (`Rope::run_fused`) against the f64 reference: random shapes, both
//! pairings, table and computed sin/cos, explicit and implicit positions, the q/k norm, every
//! q and k destination, caches of both orders and both formats with padded, missing and
//! out-of-range slots; cache bytes outside the written slots keep their poison. A graph
//! replays a captured launch with new data and slots. Random cases also go through
//! `Rope::run_fused_raw`, the entry by address.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rope_harness::case::TestElem;
use rope_harness::fused::*;
use rope_host::cudarc::driver::CudaContext;
use rope_host::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use rope_host::{Fp8Format, FusedKernels, Rope, RopeStyle};
use rope_tests::gpu::{case_cap, gpu_or_skip, pinned_for, pinned_handles};

use super::super::report;

fn run_cases<T: TestElem>(name: &str, cases: u64) {
    let Some((stream, _)) = gpu_or_skip(name) else {
        return;
    };
    let handles = pinned_handles(&stream);
    let cases = cases.min(case_cap());
    let mut worst = Worst::default();
    // Every twentieth case at prefill size, the rest small (see `Size`).
    for seed in 0..cases {
        let size = if seed % 20 == 19 {
            Size::Large
        } else {
            Size::Small
        };
        let c = Case::random_sized(seed * 7919 + size_of::<T>() as u64, size_of::<T>(), size);
        let (kernels, rope) = &handles[pinned_for(seed)];
        match check_case::<T>(&c, &stream, rope) {
            Ok(w) => worst.merge(w),
            Err(e) => panic!("{name}: seed {seed}, fused kernels {kernels:?}: {e}"),
        }
    }
    report(&format!(
        "{name}: {cases} cases over every fused kernel choice, {} values checked, largest \
         error {:.3} of its bound",
        worst.checked, worst.ratio
    ));
}

/// How a test draws its random cases: case `j` is [`Case::random_sized`] of seed `base + j *
/// stride` (plus the element size), changed by `change` with a generator of that seed `^ xor`.
struct Draws<F> {
    base: u64,
    stride: u64,
    xor: u64,
    change: F,
}

/// Random fused cases drawn by `draws`, through both entries and every kernel choice, every
/// fifth case prefill-sized; panics naming the case on the first mismatch with the f64
/// reference and reports the worst error, the cases described by `what`.
fn run_drawn<T: TestElem, F: Fn(u64, &mut Case, &mut StdRng)>(
    name: &str,
    cases: u64,
    what: &str,
    draws: Draws<F>,
) {
    let Some((stream, _)) = gpu_or_skip(name) else {
        return;
    };
    let handles = pinned_handles(&stream);
    let mut worst = Worst::default();
    for j in 0..cases.min(case_cap()) {
        let size = if j % 5 == 4 { Size::Large } else { Size::Small };
        let seed = draws.base + j * draws.stride + size_of::<T>() as u64;
        let mut c = Case::random_sized(seed, size_of::<T>(), size);
        let mut rng = StdRng::seed_from_u64(seed ^ draws.xor);
        (draws.change)(j, &mut c, &mut rng);
        let entry = if j % 2 == 0 { Entry::Views } else { Entry::Raw };
        let (kernels, rope) = &handles[pinned_for(j)];
        match check_case_on::<T>(&c, &stream, rope, entry) {
            Ok(w) => worst.merge(w),
            Err(e) => panic!("{name}: case {j}, fused kernels {kernels:?}: {e}"),
        }
    }
    report(&format!(
        "{name}: {what}, {} values checked, largest error {:.3} of its bound",
        worst.checked, worst.ratio
    ));
}

/// Partial rotations on the fused kernels (GLM-4's and Phi's half-head rotary with a q/k norm):
/// random cases of every mode but FlashInfer's forms, heads of 64, 96, 128, 256 or 512
/// features of which the first half or quarter rotate, through both entries and every kernel
/// choice (partial heads of 16-bit elements take the four-heads kernels at prefill or pinned to
/// four heads, the others two heads a thread), every fifth case prefill-sized. Every output and cache element matches the f64 reference: the rotated
/// features rotated, those past them normalised with the norm, else as they were.
fn run_partial<T: TestElem>(name: &str, cases: u64) {
    let change = |_: u64, c: &mut Case, rng: &mut StdRng| {
        // Heads of whole 16-byte accesses, a multiple of 32 features: their half and quarter
        // rotate in whole accesses, and the rest is whole groups.
        c.d = [64, 96, 128, 256, 512][rng.random_range(0..5)];
        if !c.norm_fits(size_of::<T>()) {
            c.norm = None;
        }
        c.rotary = c.d / [2, 4][rng.random_range(0..2)];
        c.plain_fp8();
    };
    let draws = Draws {
        base: 0x9a_0000,
        stride: 151,
        xor: 0x5eed,
        change,
    };
    run_drawn::<T, _>(name, cases, "partial rotations", draws);
}

/// Norms over more than a warp's accesses of a head (Gemma 4's global layers: heads of 512;
/// `f32` heads of 256 interleaved or 512: 64 or 128 accesses), which the four-heads kernels
/// sum across the head's warps: random cases of both pairings and weightings, every q output
/// and k mode, caches of the tensors' type or FP8, positions by offset, ids or multi-axis
/// maps, table and computed sin/cos, through both entries and every kernel choice (these norms
/// take the four-heads kernels whatever is pinned), every fifth case prefill-sized. Every
/// output and cache element matches the f64 reference.
fn run_long_norm<T: TestElem>(name: &str, cases: u64) {
    let change = |j: u64, c: &mut Case, rng: &mut StdRng| {
        c.d = if size_of::<T>() == 4 && j % 3 == 1 {
            c.style = RopeStyle::Interleaved;
            256
        } else {
            512
        };
        c.rotary = c.d;
        c.norm = Some(if rng.random_bool(0.5) {
            rope_host::NormWeight::Plain
        } else {
            rope_host::NormWeight::OnePlus
        });
        c.plain_fp8();
        if rng.random_bool(0.3) {
            c.axes = Some(AxesCase::mrope(rng, c.d / 2, c.tokens(), j % 2 == 1));
        }
    };
    let draws = Draws {
        base: 0x10_0000,
        stride: 173,
        xor: 0x104d,
        change,
    };
    run_drawn::<T, _>(name, cases, "norms across a head's warps", draws);
}

#[test]
fn fused_norm_of_heads_wider_than_a_warp_matches_reference_bf16() {
    run_long_norm::<rope_host::half::bf16>(
        "fused_norm_of_heads_wider_than_a_warp_matches_reference_bf16",
        30,
    );
}

#[test]
fn fused_norm_of_heads_wider_than_a_warp_matches_reference_f16() {
    run_long_norm::<rope_host::half::f16>(
        "fused_norm_of_heads_wider_than_a_warp_matches_reference_f16",
        15,
    );
}

#[test]
fn fused_norm_of_heads_wider_than_a_warp_matches_reference_f32() {
    run_long_norm::<f32>(
        "fused_norm_of_heads_wider_than_a_warp_matches_reference_f32",
        15,
    );
}

/// The norm across heads (diffusion transformers: each token's q, and its k, normalised as
/// one vector of all its heads, weights of `heads * d`) with the rotation: random cases of both
/// weightings, heads of 64, 96, 128, 256 or 512 features (those wider than a warp's accesses
/// in segments of whole warps), 1 to 24 q and k heads (8 of the widest), q and k in place, out of place or FP8 (either format, scale arrays or
/// multipliers), positions by offset, per-token ids or multi-axis maps (video models' axes),
/// table and computed sin/cos, through both entries, every fifth case prefill-sized. Every
/// output matches the f64 reference: the token's heads normalised together, then each
/// rotated.
fn run_across<T: TestElem>(name: &str, cases: u64) {
    let change = |j: u64, c: &mut Case, rng: &mut StdRng| {
        c.scope = rope_host::NormScope::AcrossHeads;
        c.d = [64, 96, 128, 256, 512][rng.random_range(0..5)];
        c.rotary = c.d;
        c.norm = Some(if rng.random_bool(0.5) {
            rope_host::NormWeight::Plain
        } else {
            rope_host::NormWeight::OnePlus
        });
        if j % 5 != 4 {
            c.hq = rng.random_range(1..=24);
            c.hk = if rng.random_bool(0.5) {
                c.hq
            } else {
                rng.random_range(1..=24)
            };
        }
        // Heads of more than a warp's accesses (two or four warps each): at most 8 a
        // tensor, which a block of 512 threads holds.
        if c.d * size_of::<T>() > 512 {
            (c.hq, c.hk) = (c.hq.min(8), c.hk.min(8));
        }
        (c.cache, c.nope) = (None, 0);
        if matches!(c.k, KMode::CacheOnly) {
            c.k = KMode::Out;
        }
        if rng.random_bool(0.4) {
            c.axes = Some(AxesCase::mrope(rng, c.d / 2, c.tokens(), j % 2 == 1));
        }
    };
    let draws = Draws {
        base: 0xac_0000,
        stride: 191,
        xor: 0xacac,
        change,
    };
    run_drawn::<T, _>(name, cases, "norm across heads", draws);
}

/// NVFP4 caches (FP4 E2M1 codes with an E4M3 scale per 16 elements and a global scale):
/// random cases of both pairings, heads of 64, 96, 128, 256 or 512 features (interleaved also
/// 48 and 80, whole blocks that NeoX would split across its halves), with and without the norm,
/// every q output and k in place, out of place or only cached, positions by offset, ids or
/// multi-axis maps, global scales per tensor or per kv head, padded and out-of-range slots,
/// both cache orders, through both entries and every kernel choice (NVFP4 caches take their
/// four-heads kernels whatever is pinned), every fifth case prefill-sized. Each block scale is
/// one of the two E4M3 values around its block's reference maximum times `1 / (6 scale)`, each
/// code one of the two E2M1 values around its reference value over the stored block scale and
/// the global scale, and no byte outside the written slots changes.
fn run_nvfp4<T: TestElem>(name: &str, cases: u64) {
    let change = |j: u64, c: &mut Case, rng: &mut StdRng| {
        let dims: &[usize] = match c.style {
            RopeStyle::Neox => &[64, 96, 128, 256, 512],
            RopeStyle::Interleaved => &[48, 64, 80, 96, 128, 256, 512],
        };
        if j % 5 != 4 {
            c.d = dims[rng.random_range(0..dims.len())];
        }
        if !c.norm_fits(size_of::<T>()) {
            c.norm = None;
        }
        c.nvfp4_cache(rng);
        if rng.random_bool(0.3) {
            c.axes = Some(AxesCase::mrope(rng, c.d / 2, c.tokens(), j % 2 == 1));
        }
    };
    let draws = Draws {
        base: 0xf4_0000,
        stride: 211,
        xor: 0xf4f4,
        change,
    };
    run_drawn::<T, _>(name, cases, "NVFP4 caches", draws);
}

#[test]
fn fused_nvfp4_cache_matches_reference_bf16() {
    run_nvfp4::<rope_host::half::bf16>("fused_nvfp4_cache_matches_reference_bf16", 40);
}

#[test]
fn fused_nvfp4_cache_matches_reference_f16() {
    run_nvfp4::<rope_host::half::f16>("fused_nvfp4_cache_matches_reference_f16", 20);
}

#[test]
fn fused_nvfp4_cache_matches_reference_f32() {
    run_nvfp4::<f32>("fused_nvfp4_cache_matches_reference_f32", 20);
}

#[test]
fn fused_norm_across_heads_matches_reference_bf16() {
    run_across::<rope_host::half::bf16>("fused_norm_across_heads_matches_reference_bf16", 40);
}

#[test]
fn fused_norm_across_heads_matches_reference_f16() {
    run_across::<rope_host::half::f16>("fused_norm_across_heads_matches_reference_f16", 20);
}

#[test]
fn fused_norm_across_heads_matches_reference_f32() {
    run_across::<f32>("fused_norm_across_heads_matches_reference_f32", 20);
}

/// Multi-axis positions on the fused kernels (Qwen3-VL: QK-norm with interleaved mRoPE):
/// random cases of every mode, FlashInfer's forms included, with mRoPE positions (sections in
/// blocks or interleaved, text tokens with every axis at one position), every kernel choice,
/// both entries, every fifth case prefill-sized. Every output and cache element matches the
/// f64 reference, each pair at its axis's position.
fn run_multi_axis<T: TestElem>(name: &str, cases: u64) {
    let change = |j: u64, c: &mut Case, rng: &mut StdRng| {
        c.axes = Some(AxesCase::mrope(rng, c.rotary / 2, c.tokens(), j % 2 == 1));
    };
    let draws = Draws {
        base: 0xa5_0000,
        stride: 173,
        xor: 0xa5a5,
        change,
    };
    run_drawn::<T, _>(name, cases, "mRoPE positions", draws);
}

#[test]
fn fused_multi_axis_positions_match_reference_bf16() {
    run_multi_axis::<rope_host::half::bf16>("fused_multi_axis_positions_match_reference_bf16", 40);
}

#[test]
fn fused_multi_axis_positions_match_reference_f32() {
    run_multi_axis::<f32>("fused_multi_axis_positions_match_reference_f32", 20);
}

#[test]
fn fused_partial_rotations_match_reference_bf16() {
    run_partial::<rope_host::half::bf16>("fused_partial_rotations_match_reference_bf16", 60);
}

#[test]
fn fused_partial_rotations_match_reference_f16() {
    run_partial::<rope_host::half::f16>("fused_partial_rotations_match_reference_f16", 30);
}

#[test]
fn fused_partial_rotations_match_reference_f32() {
    run_partial::<f32>("fused_partial_rotations_match_reference_f32", 30);
}

/// [`Rope::run_fused_raw`], the entry front ends call with their own memory, on random cases
/// of every mode (outputs, FP8, caches, norms, tables): every output and cache byte matches
/// the f64 reference as through the views' entry.
#[test]
fn fused_raw_entry_matches_reference() {
    fn run<T: TestElem>(name: &str, cases: u64) {
        let Some((stream, _)) = gpu_or_skip(name) else {
            return;
        };
        let handles = pinned_handles(&stream);
        let mut worst = Worst::default();
        for seed in 0..cases.min(case_cap()) {
            let c = Case::random(seed * 104_729 + 3, size_of::<T>());
            let (kernels, rope) = &handles[pinned_for(seed)];
            match check_case_on::<T>(&c, &stream, rope, Entry::Raw) {
                Ok(w) => worst.merge(w),
                Err(e) => panic!("{name}: seed {seed}, fused kernels {kernels:?}: {e}"),
            }
        }
        report(&format!(
            "{name}: {} values checked, largest error {:.3} of its bound",
            worst.checked, worst.ratio
        ));
    }
    run::<f32>("fused_raw_entry_matches_reference_f32", 60);
    run::<rope_host::half::bf16>("fused_raw_entry_matches_reference_bf16", 60);
}

/// FP8 caches with k's and v's scales of each granularity (one for the tensor or one per kv
/// head, random values), in all four pairings, beside an FP8 q of either granularity: every
/// byte of every valid slot of both caches is the reference's E4M3 encoding of `value /
/// scale` with the scale of its own head, every other cache byte keeps its poison, and every
/// FP8 q byte encodes its head's value with its own scale. Every sixth case is prefill-sized
/// (the four-heads and rows kernels). Reports each pairing's cases and checked values.
fn run_fp8_granularities<T: TestElem>(name: &str, cases_per_pairing: u64) {
    let Some((stream, _)) = gpu_or_skip(name) else {
        return;
    };
    let handles = pinned_handles(&stream);
    // The cap spread over the four pairings.
    let cases = cases_per_pairing.min(case_cap().div_ceil(4));
    let granularity = |per_head: bool| if per_head { "per head" } else { "per tensor" };
    for (pairing, (k_per_head, v_per_head)) in
        [(false, false), (true, false), (false, true), (true, true)]
            .into_iter()
            .enumerate()
    {
        let mut worst = Worst::default();
        for j in 0..cases {
            let size = if j % 6 == 5 { Size::Large } else { Size::Small };
            let seed = 0xf8_0000 + pairing as u64 * 10_007 + j * 31 + size_of::<T>() as u64;
            let mut c = Case::random_sized(seed, size_of::<T>(), size);
            let mut rng = StdRng::seed_from_u64(seed ^ 0xcafe);
            let mut cache = c
                .cache
                .take()
                .unwrap_or_else(|| CacheCase::random(&mut rng, c.tokens()));
            (cache.fp8, cache.k_per_head, cache.v_per_head) = (true, k_per_head, v_per_head);
            c.cache = Some(cache);
            // q's granularity alternates every two cases (so prefill-sized cases take both),
            // and every fourth case from the second has no norm (where the rows kernels scale
            // FP8 stores apart from the norm's factor).
            c.q = QMode::Fp8 {
                per_head: (j / 2) % 2 == 1,
            };
            if j % 4 == 1 {
                c.norm = None;
            }
            // Scale arrays of E4M3 and slot mappings (the FlashInfer forms have their own test).
            c.plain_fp8();
            let (kernels, rope) = &handles[pinned_for(pairing as u64 * cases + j)];
            match check_case::<T>(&c, &stream, rope) {
                Ok(w) => worst.merge(w),
                Err(e) => panic!(
                    "{name}: k {}, v {}: case {j}, fused kernels {kernels:?}: {e}",
                    granularity(k_per_head),
                    granularity(v_per_head)
                ),
            }
        }
        report(&format!(
            "{name}: k scale {}, v scale {}: {cases} cases (q FP8 per tensor and per head), {} \
             values checked, largest error {:.3} of its bound",
            granularity(k_per_head),
            granularity(v_per_head),
            worst.checked,
            worst.ratio
        ));
    }
}

#[test]
fn fused_fp8_scales_of_each_granularity_match_reference_bf16() {
    run_fp8_granularities::<rope_host::half::bf16>(
        "fused_fp8_scales_of_each_granularity_match_reference_bf16",
        16,
    );
}

#[test]
fn fused_fp8_scales_of_each_granularity_match_reference_f16() {
    run_fp8_granularities::<rope_host::half::f16>(
        "fused_fp8_scales_of_each_granularity_match_reference_f16",
        8,
    );
}

#[test]
fn fused_fp8_scales_of_each_granularity_match_reference_f32() {
    run_fp8_granularities::<f32>(
        "fused_fp8_scales_of_each_granularity_match_reference_f32",
        8,
    );
}

/// FlashInfer's forms on the fused kernels: caches addressed by a page table (shuffled pages,
/// padding tokens, negative positions, requests past `kv_indptr`, entries past a request's
/// pages or past `kv_indices`, pages past the cache), FP8 of E4M3 and E5M2, multipliers by value
/// (`x * quant_scale`), k into an FP8 output without a cache, and non-rotary parts beside q's
/// and k's FP8 outputs or, k's, into the cache after each head's rotated features (v as wide)
/// or into a latent cache (FlashInfer's `q_nope`, `k_nope`, MLA's `ckv_cache`; two cases in
/// five; a third of those caches of the tensors' type, as vLLM's MLA cache with
/// `kv_cache_dtype="auto"`). Every written
/// byte matches the reference's encoding, the slots the reference finds no entry for (and
/// every byte outside the table's slots, and between the non-rotary heads) keep their poison;
/// through both entries and every kernel choice, every fifth case prefill-sized.
fn run_flashinfer_forms<T: TestElem>(name: &str, cases: u64) {
    let change = |j: u64, c: &mut Case, rng: &mut StdRng| {
        if !c.takes_flashinfer_forms() {
            // Whole heads the token-heads kernels take (the norm sums 32 accesses of them at
            // most).
            (c.d, c.rotary) = (128, 128);
        }
        c.fp8 = if j.is_multiple_of(2) {
            Fp8Format::E5m2
        } else {
            Fp8Format::E4m3
        };
        c.multipliers = j % 3 != 2;
        c.q = QMode::Fp8 {
            per_head: j % 4 == 3,
        };
        if j % 6 == 5 {
            // k into an FP8 output, no cache.
            (c.cache, c.k) = (
                None,
                KMode::Fp8 {
                    per_head: j % 4 == 1,
                },
            );
        } else {
            let mut cache = c
                .cache
                .take()
                .unwrap_or_else(|| CacheCase::random(rng, c.tokens()));
            let (table, slots) =
                PageTableCase::random(rng, c.tokens(), (cache.num_blocks, cache.block_size));
            (cache.page_table, cache.slots, cache.fp8) = (Some(table), slots, true);
            c.cache = Some(cache);
            if matches!(c.k, KMode::Fp8 { .. }) {
                c.k = KMode::CacheOnly;
            }
        }
        if j % 5 < 2 {
            // Multiples of one 16-byte access of every element type.
            c.nope = [16, 136, 512][j as usize % 3];
            // k's part into the cache: after the rotated features (v as wide), or a latent
            // cache of its own (no v).
            if let Some(cache) = &mut c.cache {
                cache.nope = match j % 4 {
                    0 | 3 => CacheNope::AfterRotated,
                    _ => CacheNope::Latent,
                };
                // One such cache in three of the tensors' type: the part stored as it is.
                cache.fp8 = j % 3 != 1;
            }
        }
    };
    let draws = Draws {
        base: 0xf1_0000,
        stride: 131,
        xor: 0xbeef,
        change,
    };
    let what = "page tables, E4M3 and E5M2, multipliers, FP8 k, non-rotary parts beside the \
                outputs and into the caches";
    run_drawn::<T, _>(name, cases, what, draws);
}

#[test]
fn fused_flashinfer_forms_match_reference_bf16() {
    run_flashinfer_forms::<rope_host::half::bf16>(
        "fused_flashinfer_forms_match_reference_bf16",
        120,
    );
}

#[test]
fn fused_flashinfer_forms_match_reference_f16() {
    run_flashinfer_forms::<rope_host::half::f16>("fused_flashinfer_forms_match_reference_f16", 60);
}

#[test]
fn fused_flashinfer_forms_match_reference_f32() {
    run_flashinfer_forms::<f32>("fused_flashinfer_forms_match_reference_f32", 60);
}

/// FlashInfer's forms on k's side alone at prefill (k's part into the cache after the rotated
/// features or into a latent cache, page tables, E5M2 caches, multipliers), with q in place or
/// into its output: 4096 tokens of 32 q heads, which the
/// planner launches as two (q's heads alone on the four-heads or rows kernels, then the rest on
/// the forms' kernels with q empty). Handles of the planner's choice and pinned to four heads,
/// both entries; every written byte matches the reference as in
/// [`run_flashinfer_forms`].
fn run_q_apart<T: TestElem>(name: &str, cases: u64) {
    let Some((stream, _)) = gpu_or_skip(name) else {
        return;
    };
    let handles = pinned_handles(&stream);
    let splitting = [FusedKernels::Auto, FusedKernels::FourHeads];
    let mut worst = Worst::default();
    let cases = cases.min(case_cap());
    for j in 0..cases {
        let seed = 0xa9_0000 + j * 137 + size_of::<T>() as u64;
        let mut c = Case::random_sized(seed, size_of::<T>(), Size::Large);
        let mut rng = StdRng::seed_from_u64(seed ^ 0xa9a9);
        // Heads of 128 at 4096 tokens: many waves of q's threads in every pairing and type.
        (c.batch, c.seq, c.hq, c.d, c.rotary) = (1, 4096, 32, 128, 128);
        if !c.norm_fits(size_of::<T>()) {
            c.norm = None;
        }
        c.ids = Some(
            (0..c.tokens())
                .map(|_| rng.random_range(0..MAX_POSITION as i64))
                .collect(),
        );
        c.q = if j % 2 == 0 {
            QMode::InPlace
        } else {
            QMode::Out
        };
        c.fp8 = if j.is_multiple_of(2) {
            Fp8Format::E5m2
        } else {
            Fp8Format::E4m3
        };
        c.multipliers = j % 3 != 2;
        if matches!(c.k, KMode::Fp8 { .. }) {
            c.k = KMode::CacheOnly;
        }
        let mut cache = CacheCase::random(&mut rng, c.tokens());
        cache.fp8 = true;
        if j % 2 == 1 {
            let (table, slots) =
                PageTableCase::random(&mut rng, c.tokens(), (cache.num_blocks, cache.block_size));
            (cache.page_table, cache.slots) = (Some(table), slots);
        }
        if j % 4 < 3 {
            c.nope = [16, 136][j as usize % 2];
            cache.nope = if j % 2 == 0 {
                CacheNope::AfterRotated
            } else {
                CacheNope::Latent
            };
            cache.fp8 = j % 3 != 1;
        }
        c.cache = Some(cache);
        let entry = if j % 2 == 0 { Entry::Views } else { Entry::Raw };
        let choice = splitting[j as usize % splitting.len()];
        let (kernels, rope) = handles
            .iter()
            .find(|(k, _)| *k == choice)
            .expect("a handle of every choice");
        match check_case_on::<T>(&c, &stream, rope, entry) {
            Ok(w) => worst.merge(w),
            Err(e) => panic!("{name}: case {j}, fused kernels {kernels:?}: {e}"),
        }
    }
    report(&format!(
        "{name}: {cases} prefill cases with q apart from k's FlashInfer forms, {} values \
         checked, largest error {:.3} of its bound",
        worst.checked, worst.ratio
    ));
}

#[test]
fn fused_q_apart_from_flashinfer_forms_matches_reference_bf16() {
    run_q_apart::<rope_host::half::bf16>(
        "fused_q_apart_from_flashinfer_forms_matches_reference_bf16",
        8,
    );
}

#[test]
fn fused_q_apart_from_flashinfer_forms_matches_reference_f32() {
    run_q_apart::<f32>(
        "fused_q_apart_from_flashinfer_forms_matches_reference_f32",
        6,
    );
}

/// k only cached (`KOut::CacheOnly`) without a `KvCache` is refused naming `k`, whatever q's
/// head count (no heads once reached a panic), and leaves every buffer as it was.
#[test]
fn fused_cache_only_k_without_a_cache_is_refused_and_outputs_untouched() {
    let name = "fused_cache_only_k_without_a_cache_is_refused_and_outputs_untouched";
    let Some((stream, rope)) = gpu_or_skip(name) else {
        return;
    };
    for (seed, hq) in [(1u64, 0usize), (2, 1), (3, 4)] {
        let mut c = Case::random(seed, 2);
        (c.hq, c.k, c.cache) = (hq, KMode::CacheOnly, None);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut data = Data::<rope_host::half::bf16>::random(&c, &mut rng);
        // No allocation is empty: q of no heads (and its per-head scales) get one spare element.
        if data.q.is_empty() {
            data.q.push(rope_host::half::bf16::ZERO);
        }
        if data.q_scale.is_empty() {
            data.q_scale.push(1.0);
        }
        let mut dev = upload(&c, &data, &stream, &rope).expect("upload");
        let snapshot = |dev: &Device<rope_host::half::bf16>| {
            let t = [&dev.q, &dev.q_out, &dev.k].map(|b| stream.clone_dtoh(b).expect("download"));
            let bits: Vec<u16> = t.iter().flatten().map(|v| v.to_bits()).collect();
            (bits, stream.clone_dtoh(&dev.q8).expect("download"))
        };
        let before = snapshot(&dev);
        match launch(&c, &data, &mut dev, &rope) {
            Err(rope_host::Error::Invalid { arg: "k", .. }) => {}
            other => panic!("{name}: {hq} q heads: expected Invalid naming k, got {other:?}"),
        }
        assert!(before == snapshot(&dev), "{name}: a buffer changed ({c:?})");
    }
    report(&format!(
        "{name}: 3 descriptions refused, buffers unchanged"
    ));
}

#[test]
fn fused_f32_matches_reference() {
    run_cases::<f32>("fused_f32_matches_reference", 250);
}

#[test]
fn fused_f16_matches_reference() {
    run_cases::<rope_host::half::f16>("fused_f16_matches_reference", 250);
}

#[test]
fn fused_bf16_matches_reference() {
    run_cases::<rope_host::half::bf16>("fused_bf16_matches_reference", 250);
}

/// A launch captured in a CUDA graph replays with the device data of the moment: new inputs,
/// positions and slots give the reference of the new case (caches of the tensors' type, FP8
/// and NVFP4).
#[test]
fn fused_launch_replays_in_a_graph_with_new_data() {
    let Some((shared, _)) = gpu_or_skip("fused_launch_replays_in_a_graph_with_new_data") else {
        return;
    };
    let ctx = CudaContext::new(shared.context().ordinal()).expect("device 0");
    // SAFETY: this context object serves this test alone, on one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().expect("stream");
    let rope = Rope::new(stream.clone()).expect("handle");
    // The last two seeds write NVFP4 caches (their block scales poisoned again too).
    for (seed, nvfp4) in [
        (3u64, false),
        (11, false),
        (17, false),
        (29, false),
        (5, true),
        (23, true),
    ] {
        let mut c = Case::random(seed, 2);
        if nvfp4 {
            c.d = 128;
            c.nvfp4_cache(&mut StdRng::seed_from_u64(seed));
            // Inline scales go by address; this test launches views.
            if let Some(cc) = &mut c.cache {
                cc.nvfp4_inline = false;
            }
        }
        c.ids = Some((0..c.tokens()).map(|t| t as i64).collect());
        c.table = false;
        c.q = QMode::Out;
        // The replay uploads new slots and scales: a multiplier by value or a page table
        // would keep the captured ones.
        c.multipliers = false;
        if let Some(cc) = &mut c.cache {
            cc.page_table = None;
        }
        let data = Data::<rope_host::half::bf16>::random(&c, &mut StdRng::seed_from_u64(seed));
        let mut dev = upload(&c, &data, &stream, &rope).expect("upload");
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .expect("capture");
        launch(&c, &data, &mut dev, &rope).expect("captured launch");
        let graph = stream
            .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
            .expect("end capture")
            .expect("a graph");
        // New inputs, positions and slots, same shapes: replay, then check against them.
        let mut next = c.clone();
        let mut rng = StdRng::seed_from_u64(seed + 1000);
        next.ids = Some(
            (0..c.tokens())
                .map(|_| rng.random_range(0..MAX_POSITION as i64))
                .collect(),
        );
        if let (Some(cc), Some(nc)) = (&c.cache, &mut next.cache) {
            let mut slots: Vec<i64> = (0..(cc.num_blocks * cc.block_size) as i64).collect();
            slots.reverse();
            nc.slots = slots[..c.tokens()].to_vec();
            nc.slots[0] = -1;
        }
        let new = Data::<rope_host::half::bf16>::random(&next, &mut rng);
        stream.memcpy_htod(&new.q, &mut dev.q).expect("q");
        stream.memcpy_htod(&new.k, &mut dev.k).expect("k");
        stream.memcpy_htod(&new.v, &mut dev.v).expect("v");
        stream.memcpy_htod(&new.q_w, &mut dev.q_w).expect("q_w");
        stream.memcpy_htod(&new.k_w, &mut dev.k_w).expect("k_w");
        stream
            .memcpy_htod(&new.k_scale, &mut dev.k_scale)
            .expect("k_scale");
        stream
            .memcpy_htod(&new.v_scale, &mut dev.v_scale)
            .expect("v_scale");
        let ids = next.ids.clone().expect("ids");
        stream.memcpy_htod(&ids, &mut dev.ids).expect("ids");
        if let Some(nc) = &next.cache {
            stream
                .memcpy_htod(&nc.slots, &mut dev.slots)
                .expect("slots");
            let [nk, nv] = cache_lens(&next);
            stream
                .memcpy_htod(&vec![rope_host::half::bf16::poison(); nk], &mut dev.k_cache)
                .expect("k cache");
            stream
                .memcpy_htod(&vec![rope_host::half::bf16::poison(); nv], &mut dev.v_cache)
                .expect("v cache");
            stream
                .memcpy_htod(&vec![POISON; nk], &mut dev.k_cache8)
                .expect("k cache8");
            stream
                .memcpy_htod(&vec![POISON; nv], &mut dev.v_cache8)
                .expect("v cache8");
            stream
                .memcpy_htod(&vec![POISON; nk / 16], &mut dev.k_block_scales)
                .expect("k block scales");
            stream
                .memcpy_htod(&vec![POISON; nv / 16], &mut dev.v_block_scales)
                .expect("v block scales");
        }
        graph.launch().expect("replay");
        stream.synchronize().expect("sync");
        // The replay read k in place as the new data; verify against the new case.
        let worst =
            verify(&next, &new, &dev, &stream).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        report(&format!(
            "fused graph replay (seed {seed}): {} values, largest error {:.3} of its bound",
            worst.checked, worst.ratio
        ));
    }
}

/// With sin/cos from a table, a token whose position lies outside the table (negative, past
/// its rows, or past them by a multiple of 2^32, which a 32-bit row offset would wrap onto a
/// row) gets NaN in every rotated output element, and every other token gets exactly what the
/// same launch gives with all positions inside: prefill-sized and small NeoX launches, each on
/// every fused kernel choice ([`pinned_handles`]: the item loop, two and four heads per thread,
/// the rows kernels where they serve).
#[test]
fn fused_positions_outside_the_table_give_nan_tokens_and_leave_the_others_alone() {
    let name = "fused_positions_outside_the_table_give_nan_tokens_and_leave_the_others_alone";
    let Some((stream, _)) = gpu_or_skip(name) else {
        return;
    };
    let handles = pinned_handles(&stream);
    let rows = (MAX_POSITION + 32) as i64;
    let outside = [
        -1,
        -3,
        rows,
        rows + 7,
        (1 << 32) + 5,
        i64::from(u32::MAX),
        i64::MIN,
    ];
    let mut nan_tokens = 0;
    let sized = [(5u64, Size::Large), (6, Size::Small), (7, Size::Large)];
    for ((seed, size), (kernels, rope)) in sized
        .into_iter()
        .flat_map(|c| handles.iter().map(move |h| (c, h)))
    {
        let mut c = Case::random_sized(seed, 2, size);
        (c.style, c.table, c.q, c.k, c.cache) =
            (RopeStyle::Neox, true, QMode::Out, KMode::Out, None);
        let inside: Vec<i64> = (0..c.tokens() as i64).map(|t| t % rows).collect();
        let mut ids = inside.clone();
        for (t, id) in ids.iter_mut().enumerate().filter(|(t, _)| t % 5 == 1) {
            *id = outside[t % outside.len()];
        }
        let outputs = |ids: &[i64]| {
            let mut c = c.clone();
            c.ids = Some(ids.to_vec());
            let mut rng = StdRng::seed_from_u64(seed);
            let data = Data::<rope_host::half::bf16>::random(&c, &mut rng);
            let mut dev = upload(&c, &data, &stream, rope).expect("upload");
            launch(&c, &data, &mut dev, rope).expect("launch");
            (
                stream.clone_dtoh(&dev.q_out).expect("q"),
                stream.clone_dtoh(&dev.k_out).expect("k"),
            )
        };
        let (want, got) = (outputs(&inside), outputs(&ids));
        for (tensor, heads, w, g) in [("q", c.hq, &want.0, &got.0), ("k", c.hk, &want.1, &got.1)] {
            let per_token = heads * c.d;
            for (t, id) in ids.iter().enumerate() {
                let span = t * per_token..(t + 1) * per_token;
                if (0..rows).contains(id) {
                    let same = w[span.clone()]
                        .iter()
                        .zip(&g[span])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "seed {seed}, {kernels:?}: {tensor} of token {t} (position {id}) differs from the launch with positions inside"
                    );
                } else {
                    nan_tokens += 1;
                    let nan = g[span].iter().all(|v| v.is_nan());
                    assert!(
                        nan,
                        "seed {seed}, {kernels:?}: {tensor} of token {t} (position {id} outside the table) is not all NaN"
                    );
                }
            }
        }
    }
    report(&format!(
        "{name}: {nan_tokens} token tensors of positions outside the table all NaN, the others unchanged"
    ));
}
