//! The fused planner's FP8 stores and FlashInfer's forms: scales, multipliers, FP8 q and k
//! outputs, page tables and the kernels those launches take.

use super::*;

#[test]
fn rejects_fp8_scales_of_the_wrong_length() {
    for (len, per_head, ok) in [
        (1, false, true),
        (8, true, true),
        (2, false, false),
        (32, true, false),
    ] {
        let mut r = request(RopeStyle::Neox);
        r.cache.as_mut().expect("cache").store = CacheStore::Fp8(CacheFp8 {
            format: Fp8Format::E4m3,
            k: array_scale("cache.k_scale", 9 << 24, len, per_head),
            v: array_scale("cache.v_scale", 10 << 24, 1, false),
        });
        if ok {
            assert!(plan_of(&r).is_ok(), "{len} {per_head}");
        } else {
            assert_eq!(invalid_arg(&r), "cache.k_scale");
        }
    }
}

/// An FP8 q output is addressed in bytes: its alignment to `lanes` bytes, not elements,
/// decides the width.
#[test]
fn fp8_q_output_is_checked_in_bytes() {
    let mut r = request(RopeStyle::Interleaved);
    let out = Layout::thd(TOKENS, 32, D);
    r.rope.q.out = Some((buf(11 << 24, out.end().expect("small")), out));
    r.q_fp8 = Some(RawFp8 {
        format: Fp8Format::E4m3,
        scale: array_scale("q.scale", 12 << 24, 1, false),
    });
    let p = plan_of(&r).expect("valid").expect("non-empty");
    assert_eq!(p.lanes, 8);
    // An output 4 bytes off a multiple of 8 takes 4-lane accesses.
    r.rope.q.out = Some((buf((11 << 24) + 4, out.end().expect("small")), out));
    let p = plan_of(&r).expect("valid").expect("non-empty");
    assert_eq!((p.lanes, p.kernel.mapping), (4, Mapping::NARROW));
    // Too short by one byte.
    r.rope.q.out = Some((buf(11 << 24, out.end().expect("small") - 1), out));
    assert_eq!(invalid_arg(&r), "q.output");
}

/// k's and v's FP8 cache scales are each passed with their own step between heads (0: one
/// scale, 1: one per head), in all four combinations, beside q's of either granularity; a
/// mixed pair plans like any other.
#[test]
fn k_and_v_scales_keep_their_own_granularity() {
    let scale =
        |arg, ptr, per_head: bool| array_scale(arg, ptr, if per_head { 8 } else { 1 }, per_head);
    for (k_head, v_head, q_head) in [
        (false, false, true),
        (true, false, false),
        (false, true, true),
        (true, true, false),
    ] {
        let mut r = request(RopeStyle::Neox);
        let q_out = Layout::thd(TOKENS, 32, D);
        r.rope.q.out = Some((buf(11 << 24, q_out.end().expect("small")), q_out));
        r.q_fp8 = Some(RawFp8 {
            format: Fp8Format::E4m3,
            scale: array_scale("q.scale", 12 << 24, if q_head { 32 } else { 1 }, q_head),
        });
        r.cache.as_mut().expect("cache").store = CacheStore::Fp8(CacheFp8 {
            format: Fp8Format::E4m3,
            k: scale("cache.k_scale", 9 << 24, k_head),
            v: scale("cache.v_scale", 10 << 24, v_head),
        });
        assert!(plan_of(&r).expect("valid").is_some());
        let want = [
            (12 << 24, u32::from(q_head), 0.0),
            (9 << 24, u32::from(k_head), 0.0),
            (10 << 24, u32::from(v_head), 0.0),
        ];
        assert_eq!(scale_args(&r), want, "k {k_head} v {v_head} q {q_head}");
    }
    let r = request(RopeStyle::Neox);
    assert_eq!(scale_args(&r), [(0, 0, 0.0); 3]);
}

/// Multipliers by value (FlashInfer's `quant_scale`) pass as the kernels' multiplier arguments
/// with a null scale address; k's FP8 output takes k's; a multiplier that is not finite is
/// refused, naming its argument.
#[test]
fn multipliers_pass_by_value_and_must_be_finite() {
    let mut r = request(RopeStyle::Neox);
    r.cache = None;
    r.v = None;
    r.k_written = true;
    let q_out = Layout::thd(TOKENS, 32, D);
    r.rope.q.out = Some((buf(11 << 24, q_out.end().expect("small")), q_out));
    let k_out = Layout::thd(TOKENS, 8, D);
    r.rope.k.as_mut().expect("k").out = Some((buf(12 << 24, k_out.end().expect("small")), k_out));
    let multiplier = |arg, m| RawFp8 {
        format: Fp8Format::E5m2,
        scale: RawScale {
            arg,
            source: ScaleSource::Multiplier(m),
        },
    };
    r.q_fp8 = Some(multiplier("q.scale", 2.0));
    r.k_fp8 = Some(multiplier("k.scale", 0.25));
    assert!(plan_of(&r).expect("valid").is_some());
    assert_eq!(scale_args(&r), [(0, 0, 2.0), (0, 0, 0.25), (0, 0, 0.0)]);
    r.k_fp8 = Some(multiplier("k.scale", f32::INFINITY));
    assert_eq!(invalid_arg(&r), "k.scale");
    r.k_fp8 = Some(multiplier("k.scale", 1.0));
    r.q_fp8 = Some(multiplier("q.scale", f32::NAN));
    assert_eq!(invalid_arg(&r), "q.scale");
}

/// A launch with an FP8 k output never takes the four-heads (or rows) kernels, which have no
/// such store, even where they are pinned: the two-heads kernels serve it.
#[test]
fn fp8_k_output_takes_the_two_heads_kernels() {
    let mut r = with_tokens(RopeStyle::Neox, 8192);
    (r.cache, r.v, r.k_written) = (None, None, true);
    let k = r.rope.k.as_mut().expect("k");
    k.out = Some((buf(1 << 47, k.x_layout.end().expect("fits")), k.x_layout));
    let four = plan_with(&r, FusedKernels::FourHeads)
        .expect("valid")
        .expect("non-empty");
    assert_eq!(
        four.kernel.mapping,
        Mapping::FOUR_HEADS,
        "without FP8, four heads"
    );
    r.k_fp8 = Some(RawFp8 {
        format: Fp8Format::E4m3,
        scale: array_scale("k.scale", 1 << 48, 1, false),
    });
    for choice in [
        FusedKernels::Auto,
        FusedKernels::FourHeads,
        FusedKernels::Rows { stages: 2 },
    ] {
        let p = plan_on(&H200, &r, choice, true);
        assert_eq!(p.kernel.mapping, Mapping::TWO_HEADS, "{choice:?}");
    }
}

/// FlashInfer's forms (here a page table) take the token-heads kernels even where the item loop
/// is pinned, and a launch those kernels cannot take (a q one element off its vector alignment,
/// so narrower accesses) is refused naming the form's argument.
#[test]
fn flashinfer_forms_take_the_token_heads_kernels_or_are_refused() {
    let mut r = request(RopeStyle::Neox);
    r.cache.as_mut().expect("cache").address = RawCacheAddress::PageTable(RawPageTable {
        batch_indices: buf(20 << 24, TOKENS),
        positions: buf(21 << 24, TOKENS),
        kv_indptr: buf(22 << 24, 2),
        kv_indices: buf(23 << 24, 16),
    });
    let p = plan_with(&r, FusedKernels::ItemLoop)
        .expect("valid")
        .expect("non-empty");
    assert_eq!(p.kernel.mapping, Mapping::TWO_HEADS);
    (r.norm, r.rope.q.x.ptr) = (None, r.rope.q.x.ptr + 2);
    assert_eq!(invalid_arg(&r), "cache.kv_indices");
}

/// An FP8 k output is refused beside a cache write (k's scale serves one of them).
#[test]
fn fp8_k_output_excludes_a_cache() {
    let mut r = request(RopeStyle::Neox);
    let k_out = Layout::thd(TOKENS, 8, D);
    r.rope.k.as_mut().expect("k").out = Some((buf(12 << 24, k_out.end().expect("small")), k_out));
    r.k_written = true;
    r.k_fp8 = Some(RawFp8 {
        format: Fp8Format::E4m3,
        scale: array_scale("k.scale", 13 << 24, 1, false),
    });
    assert_eq!(invalid_arg(&r), "k.output");
}

/// A page table's arrays: one request index and one position per token, a `kv_indptr` of at
/// least one entry, each 4-byte aligned; errors name the array.
#[test]
fn page_tables_are_checked_array_by_array() {
    let table = || RawPageTable {
        batch_indices: buf(20 << 24, TOKENS),
        positions: buf(21 << 24, TOKENS),
        kv_indptr: buf(22 << 24, 3),
        kv_indices: buf(23 << 24, 16),
    };
    let with = |t: RawPageTable| {
        let mut r = request(RopeStyle::Neox);
        r.cache.as_mut().expect("cache").address = RawCacheAddress::PageTable(t);
        r
    };
    assert!(plan_of(&with(table())).expect("valid").is_some());
    let mut t = table();
    t.batch_indices.len -= 1;
    assert_eq!(invalid_arg(&with(t)), "cache.batch_indices");
    let mut t = table();
    t.positions.len += 1;
    assert_eq!(invalid_arg(&with(t)), "cache.positions");
    let mut t = table();
    t.kv_indptr.len = 0;
    assert_eq!(invalid_arg(&with(t)), "cache.kv_indptr");
    let mut t = table();
    t.kv_indices.ptr += 2;
    assert_eq!(invalid_arg(&with(t)), "cache.kv_indices");
    // The arrays are read regions: one inside the k cache is refused.
    let mut t = table();
    t.kv_indices.ptr = 7 << 24;
    assert_eq!(invalid_arg(&with(t)), "cache.k");
}

/// A request with q's and k's FP8 outputs and no cache, as FlashInfer's `rope_quantize_fp8`
/// makes it, and the non-rotary parts of `nope_dim` features it stores beside them.
fn with_nope(nope_dim: usize) -> FusedRequest {
    let mut r = request(RopeStyle::Neox);
    (r.cache, r.v, r.norm, r.k_written) = (None, None, None, true);
    let fp8 = |arg| RawFp8 {
        format: Fp8Format::E4m3,
        scale: RawScale {
            arg,
            source: ScaleSource::Multiplier(1.0),
        },
    };
    let (q_out, k_out) = (Layout::thd(TOKENS, 32, D), Layout::thd(TOKENS, 8, D));
    r.rope.q.out = Some((buf(11 << 24, q_out.end().expect("small")), q_out));
    r.rope.k.as_mut().expect("k").out = Some((buf(12 << 24, k_out.end().expect("small")), k_out));
    (r.q_fp8, r.k_fp8) = (Some(fp8("q.scale")), Some(fp8("k.scale")));
    let part = |heads, ptr: u64| {
        let l = Layout::thd(TOKENS, heads, nope_dim);
        let len = l.end().expect("small");
        NopePart {
            input: (buf(ptr, len), l),
            output: (buf(ptr + (1 << 40), len), l),
        }
    };
    r.nope.q = Some(part(32, 30 << 24));
    r.nope.k = Some(part(8, 31 << 24));
    r
}

/// The non-rotary parts take the token-heads kernels of FlashInfer's forms and blocks of their
/// own after each token's: a thread per four 16-byte accesses of every head of both parts.
#[test]
fn non_rotary_parts_take_blocks_after_each_tokens_rotation() {
    let r = with_nope(512);
    let p = plan_with(&r, FusedKernels::ItemLoop)
        .expect("valid")
        .expect("non-empty");
    assert_eq!(p.kernel.mapping, Mapping::TWO_HEADS);
    assert_eq!(p.kernel.forms, rope_kernels::abi::FusedForms::FlashInfer);
    let nope = p.nope.expect("non-rotary blocks");
    let block = u64::from(p.grid.config.block_dim.0);
    // 64 accesses of 8 bf16 per head, four a thread: 16 threads a head.
    assert_eq!((nope.accesses, nope.threads.divisor.get()), (512 / 8, 16));
    let blocks = u64::from(p.grid.config.grid_dim.0 - nope.rope_blocks);
    assert_eq!(blocks, ((32 + 8) * 16u64).div_ceil(block));
    // Without the parts: no such blocks.
    let mut plain = r;
    plain.nope = Default::default();
    let p = plan_of(&plain).expect("valid").expect("non-empty");
    assert!(p.nope.is_none());
}

/// Each part's input and output are checked against the rotated tensor and each other, naming
/// the part's argument.
#[test]
fn non_rotary_parts_are_checked_naming_their_argument() {
    assert!(plan_of(&with_nope(64)).is_ok());
    // Features not a multiple of one 16-byte access (8 bf16).
    assert_eq!(invalid_arg(&with_nope(12)), "q.non_rotary.input");
    // Heads other than the rotated tensor's.
    let mut r = with_nope(64);
    let q = r.nope.q.as_mut().expect("q part");
    q.input.1 = Layout::thd(TOKENS, 16, 64);
    assert_eq!(invalid_arg(&r), "q.non_rotary.input");
    // An output of other dimensions.
    let mut r = with_nope(64);
    r.nope.k.as_mut().expect("k part").output.1 = Layout::thd(TOKENS, 8, 32);
    assert_eq!(invalid_arg(&r), "k.non_rotary.output");
    // k's features other than q's.
    let mut r = with_nope(64);
    let l = Layout::thd(TOKENS, 8, 32);
    r.nope.k = Some(NopePart {
        input: (buf(31 << 24, l.end().expect("small")), l),
        output: (buf((31 << 24) + (1 << 40), l.end().expect("small")), l),
    });
    assert_eq!(invalid_arg(&r), "k.non_rotary.input");
    // A buffer one element short, and one off its 16-byte alignment.
    let mut r = with_nope(64);
    r.nope.q.as_mut().expect("q part").input.0.len -= 1;
    assert_eq!(invalid_arg(&r), "q.non_rotary.input");
    let mut r = with_nope(64);
    r.nope.q.as_mut().expect("q part").output.0.ptr += 4;
    assert_eq!(invalid_arg(&r), "q.non_rotary.output");
    // An output over q's rotated output: the overlap names the first of the two written.
    let mut r = with_nope(64);
    r.nope.q.as_mut().expect("q part").output.0.ptr = 11 << 24;
    assert_eq!(invalid_arg(&r), "q.output");
}

/// A request as FlashInfer's append form makes it with `k_nope` (GQA): q to an FP8 output, k
/// only cached, into FP8 caches whose heads hold the rotated `D` features and `nope_dim` more,
/// v of that width, and k's part of `nope_dim` features after the rotated ones.
fn with_cached_nope(nope_dim: usize) -> FusedRequest {
    let mut r = request(RopeStyle::Neox);
    r.norm = None;
    let q_out = Layout::thd(TOKENS, 32, D);
    r.rope.q.out = Some((buf(11 << 24, q_out.end().expect("small")), q_out));
    r.q_fp8 = Some(RawFp8 {
        format: Fp8Format::E4m3,
        scale: RawScale {
            arg: "q.scale",
            source: ScaleSource::Multiplier(1.0),
        },
    });
    let width = D + nope_dim;
    let c = r.cache.as_mut().expect("cache");
    c.layout = CacheLayout::blocks_rows_heads(16, 16, 8, width);
    let cache_len = 16 * 16 * 8 * width;
    (c.k, c.v) = (buf(7 << 24, cache_len), buf(8 << 24, cache_len));
    fp8_cache(&mut r);
    let v = Layout::thd(TOKENS, 8, width);
    r.v = Some((buf(3 << 24, v.end().expect("small")), v));
    let part = Layout::thd(TOKENS, 8, nope_dim);
    r.nope.cached = Some(CachedNope {
        input: (buf(31 << 24, part.end().expect("small")), part),
        into: NonRotaryCache::AfterRotated,
    });
    r
}

/// [`with_cached_nope`] as MLA's form: one k head of `D` rotated features into the k cache
/// (`kpe_cache`), its 512 latent features into the cache's v buffer (`ckv_cache`), no v.
fn with_latent() -> FusedRequest {
    let mut r = with_cached_nope(512);
    let kpe = CacheLayout::blocks_rows_heads(16, 16, 1, D);
    let ckv = CacheLayout::blocks_rows_heads(16, 16, 1, 512);
    let c = r.cache.as_mut().expect("cache");
    c.layout = kpe;
    (c.k, c.v) = (buf(7 << 24, 16 * 16 * D), buf(8 << 24, 16 * 16 * 512));
    let k = r.rope.k.as_mut().expect("k");
    k.x_layout = Layout::thd(TOKENS, 1, D);
    r.v = None;
    let part = Layout::thd(TOKENS, 1, 512);
    r.nope.cached = Some(CachedNope {
        input: (buf(31 << 24, part.end().expect("small")), part),
        into: NonRotaryCache::Latent(ckv),
    });
    r
}

/// k's part into the cache takes FlashInfer's forms' kernels and blocks after each token's: a
/// thread per 16-byte access of each k head, and (after the rotated features) of each v head's
/// features past them; the arguments send k's part to the k cache after each head's rotated
/// features, or to the latent cache at its own strides.
#[test]
fn cached_non_rotary_parts_take_blocks_for_k_and_v() {
    let r = with_cached_nope(64);
    let p = plan_of(&r).expect("valid").expect("non-empty");
    assert_eq!(p.kernel.forms, rope_kernels::abi::FusedForms::FlashInfer);
    let nope = p.nope.expect("non-rotary blocks");
    // 8 accesses per head, four a thread.
    assert_eq!((nope.accesses, nope.threads.divisor.get()), (8, 2));
    let block = u64::from(p.grid.config.block_dim.0);
    let blocks = u64::from(p.grid.config.grid_dim.0 - nope.rope_blocks);
    assert_eq!(blocks, ((8 + 8) * 2u64).div_ceil(block));
    let a = cached_nope_args(&r, 2).expect("cached");
    assert_eq!((a.part.x, a.part.out), (31 << 24, (7 << 24) + D as u64));
    assert_eq!(a.cached, NopeCached(NopeCached::K | NopeCached::V));
    // Into caches of the tensors' type the part starts `D` elements of 2 bytes into each head.
    let mut elem = with_cached_nope(64);
    elem.cache.as_mut().expect("cache").store = CacheStore::Elem;
    let a = cached_nope_args(&elem, 2).expect("cached");
    assert_eq!(a.part.out, (7 << 24) + 2 * D as u64);
    let width = (D + 64) as u64;
    assert_eq!(a.strides, [16 * 8 * width, 8 * width, width]);
    let r = with_latent();
    let p = plan_of(&r).expect("valid").expect("non-empty");
    let nope = p.nope.expect("non-rotary blocks");
    let blocks = u64::from(p.grid.config.grid_dim.0 - nope.rope_blocks);
    assert_eq!(blocks, 16u64.div_ceil(u64::from(p.grid.config.block_dim.0)));
    let a = cached_nope_args(&r, 2).expect("cached");
    assert_eq!(a.part.out, 8 << 24);
    assert_eq!(a.cached, NopeCached(NopeCached::K));
    assert_eq!(a.strides, [16 * 512, 512, 512]);
}

/// A partial rotation with FlashInfer's forms (here k's non-rotary part into the cache) is
/// refused naming `config`: those forms have kernels of whole heads alone.
#[test]
fn partial_rotations_with_flashinfer_forms_are_refused() {
    let mut r = with_cached_nope(64);
    r.rope.config = RopeConfig::builder(D as u32, RopeStyle::Neox)
        .rotary_dim(64)
        .build()
        .expect("valid");
    assert_eq!(invalid_arg(&r), "config");
}

/// k's part into the cache is checked against k, the caches and v, naming the argument; into
/// caches of the tensors' type as into FP8 ones, a latent cache then aligned to a 16-byte store.
#[test]
fn cached_non_rotary_parts_are_checked_naming_their_argument() {
    assert!(plan_of(&with_cached_nope(64)).is_ok());
    assert!(plan_of(&with_latent()).is_ok());
    // Caches of the tensors' type.
    let mut r = with_cached_nope(64);
    r.cache.as_mut().expect("cache").store = CacheStore::Elem;
    assert!(plan_of(&r).is_ok());
    let mut r = with_latent();
    r.cache.as_mut().expect("cache").store = CacheStore::Elem;
    assert!(plan_of(&r).is_ok());
    // 8 bytes off: one FP8 store's alignment, half of a 16-bit one's.
    let c = r.cache.as_mut().expect("cache");
    c.v.ptr += 8;
    assert_eq!(invalid_arg(&r), "cache.non_rotary.layout");
    let mut r = with_latent();
    r.cache.as_mut().expect("cache").v.ptr += 8;
    assert!(plan_of(&r).is_ok());
    // Features other than q's part's, and heads other than k's.
    let mut r = with_cached_nope(64);
    let l = Layout::thd(TOKENS, 32, 32);
    r.nope.q = Some(NopePart {
        input: (buf(40 << 24, l.end().expect("small")), l),
        output: (buf(41 << 24, l.end().expect("small")), l),
    });
    assert_eq!(invalid_arg(&r), "cache.non_rotary.input");
    let mut r = with_cached_nope(64);
    r.nope.cached.as_mut().expect("part").input.1 = Layout::thd(TOKENS, 4, 64);
    assert_eq!(invalid_arg(&r), "cache.non_rotary.input");
    // Cache heads without room for the part, and a v of the rotated width alone.
    let mut r = with_cached_nope(64);
    r.cache.as_mut().expect("cache").layout = CacheLayout::blocks_rows_heads(16, 16, 8, D);
    assert_eq!(invalid_arg(&r), "cache.k");
    let mut r = with_cached_nope(64);
    r.v = Some((buf(3 << 24, TOKENS * 8 * D), Layout::thd(TOKENS, 8, D)));
    assert_eq!(invalid_arg(&r), "v");
    // MLA: a v, a latent cache of other blocks, heads or width, one off its alignment.
    let mut r = with_latent();
    r.v = Some((buf(3 << 24, TOKENS * D), Layout::thd(TOKENS, 1, D)));
    assert_eq!(invalid_arg(&r), "v");
    for latent in [
        CacheLayout::blocks_rows_heads(8, 16, 1, 512),
        CacheLayout::blocks_rows_heads(16, 16, 2, 256),
    ] {
        let mut r = with_latent();
        r.nope.cached.as_mut().expect("part").into = NonRotaryCache::Latent(latent);
        assert_eq!(invalid_arg(&r), "cache.non_rotary.layout", "{latent:?}");
    }
    let mut r = with_latent();
    r.cache.as_mut().expect("cache").v.ptr += 4;
    assert_eq!(invalid_arg(&r), "cache.non_rotary.layout");
    // A latent cache one byte short.
    let mut r = with_latent();
    r.cache.as_mut().expect("cache").v.len -= 1;
    assert_eq!(invalid_arg(&r), "cache.v");
}

/// vLLM's MLA cache (`[num_blocks, block_size, 512 + D]`): the latent cache and the k cache as
/// column ranges of one buffer's rows, written by one launch as one region; columns that meet
/// are refused as an overlap, naming the k cache.
#[test]
fn latent_and_k_caches_share_one_buffers_rows_when_their_columns_are_apart() {
    let row = 512 + D;
    let one_buffer = |k_column: usize| {
        let mut r = with_latent();
        let rows = CacheLayout {
            num_blocks: 16,
            block_size: 16,
            kv_heads: 1,
            head_dim: D,
            strides: [16 * row, row, row],
        };
        let len = 16 * 16 * row;
        let c = r.cache.as_mut().expect("cache");
        c.layout = rows;
        (c.k, c.v) = (
            buf((7 << 24) + k_column as u64, len - k_column),
            buf(7 << 24, len),
        );
        r.nope.cached.as_mut().expect("part").into = NonRotaryCache::Latent(CacheLayout {
            head_dim: 512,
            ..rows
        });
        r
    };
    let r = one_buffer(512);
    let p = plan_of(&r).expect("valid").expect("non-empty");
    assert!(p.nope.is_some());
    let a = cached_nope_args(&r, 2).expect("cached");
    assert_eq!(
        (a.part.out, a.strides),
        (7 << 24, [16 * row as u64, row as u64, row as u64])
    );
    // The k cache's columns over the latent's last 16.
    assert_eq!(invalid_arg(&one_buffer(512 - 16)), "cache.k");
    // Apart caches in separate buffers still pass, and meeting ones still fail.
    assert!(plan_of(&with_latent()).is_ok());
    let mut r = with_latent();
    r.cache.as_mut().expect("cache").v.ptr = (7 << 24) + 16;
    assert_eq!(invalid_arg(&r), "cache.k");
}

/// vLLM's MLA projection: `kv_c` (k's latent part, read) and `k_pe` (k, rotated in place) as
/// column ranges of one `[tokens, 512 + D]` tensor, one region; columns that meet are refused
/// as an overlap, naming k.
#[test]
fn k_and_its_cached_part_share_one_tensors_rows_when_their_columns_are_apart() {
    let row = 512 + D;
    let projection = |k_column: usize| {
        let mut r = with_latent();
        r.k_written = true;
        let base = 50u64 << 24;
        let len = TOKENS * row;
        let k = r.rope.k.as_mut().expect("k");
        k.x = buf(base + 2 * k_column as u64, len - k_column);
        k.x_layout = Layout::strided([1, TOKENS, 1, D], [len, row, D, 1], 0).expect("small layout");
        let part = Layout::strided([1, TOKENS, 1, 512], [len, row, 512, 1], 0).expect("small");
        r.nope.cached.as_mut().expect("part").input = (buf(base, len), part);
        r
    };
    assert!(plan_of(&projection(512)).is_ok());
    assert_eq!(invalid_arg(&projection(512 - 8)), "k");
    // Apart tensors still pass.
    let mut r = with_latent();
    r.k_written = true;
    assert!(plan_of(&r).is_ok());
}
