//! MLA into vLLM's one cache (`[num_blocks, block_size, kv_lora_rank + rot_dim]`, each row the
//! latent features then the rotated `k_pe`; by address, as `concat_and_cache_mla_rope_fused`
//! launches it) against the same launch into FlashInfer's two caches (`ckv_cache`,
//! `kpe_cache`) on the same data. The one cache's launch stores the latent part as v's heads
//! with the plain kernels (`rope-host/src/fused/latent.rs`), the two caches' stores it on
//! FlashInfer's forms' kernels (checked against the f64 reference in `fused.rs`): `q_pe`, `k_pe`
//! and every byte of the caches must be equal, bit for bit, poison included where no token
//! writes (padding slots and slots no token has).

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rope_harness::case::TestElem;
use rope_harness::fused::{MAX_POSITION, THETA};
use rope_host::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use rope_host::{
    CacheLayout, Fp8Format, IdsShape, IntType, Layout, NonRotaryCache, RawBuf, RawCacheAddress,
    RawCacheData, RawCacheNonRotary, RawFp8Scale, RawFusedIo, RawFusedOp, RawInts, RawIo, RawKOut,
    RawKvCache, RawOp, RawPositions, RawQOut, RawSinCos, RawTensor, Rope, RopeConfig, RopeStyle,
    TableShape,
};
use rope_tests::gpu::{case_cap, gpu_or_skip, pinned_for, pinned_handles};

use super::super::report;

/// MLA's rotated features per head (`q_pe`, `k_pe`).
const ROPE_DIM: usize = 64;

/// One random MLA launch.
struct Case {
    style: RopeStyle,
    tokens: usize,
    heads: usize,
    /// Features of each q head: `q_pe` is the last `ROPE_DIM`.
    q_dim: usize,
    latent: usize,
    block_size: usize,
    num_blocks: usize,
    /// Each token's slot (negative: padding).
    slots: Vec<i64>,
    ids: Vec<i64>,
    /// FP8 E4M3 caches of `x / scale`, else of the tensors' type.
    fp8: Option<f32>,
    table: bool,
}

impl Case {
    fn random(j: u64, es: usize) -> Self {
        let mut rng = StdRng::seed_from_u64(0x3a1a_0000 + j * 131 + es as u64);
        let style = if rng.random_bool(0.5) {
            RopeStyle::Neox
        } else {
            RopeStyle::Interleaved
        };
        // Every fourth case at prefill (the four-heads kernels), the others at decode.
        let (tokens, heads): (usize, usize) = if j % 4 == 3 {
            (rng.random_range(2048..4100), rng.random_range(16..=128))
        } else {
            (rng.random_range(1..=96), rng.random_range(1..=128))
        };
        let q_dim = [ROPE_DIM, 128 + ROPE_DIM, 192][rng.random_range(0..3usize)];
        let latent = [ROPE_DIM, 256, 512][rng.random_range(0..3usize)];
        let block_size = [1, 16, 64][rng.random_range(0..3usize)];
        let num_blocks = tokens.div_ceil(block_size) + rng.random_range(0..3usize);
        let cache_slots = (num_blocks * block_size) as i64;
        // Distinct slots in random order; some tokens padding, some past the cache.
        let mut free: Vec<i64> = (0..cache_slots).collect();
        let slots = (0..tokens)
            .map(|_| match rng.random_range(0..16u32) {
                0 => -1,
                1 => cache_slots + rng.random_range(0..4i64),
                _ if !free.is_empty() => free.swap_remove(rng.random_range(0..free.len())),
                _ => -1,
            })
            .collect();
        let ids = (0..tokens)
            .map(|_| rng.random_range(0..MAX_POSITION as i64))
            .collect();
        Self {
            style,
            tokens,
            heads,
            q_dim,
            latent,
            block_size,
            num_blocks,
            slots,
            ids,
            fp8: rng.random_bool(0.5).then(|| rng.random_range(0.01f32..0.1)),
            table: rng.random_bool(0.5),
        }
    }

    fn rows(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

/// A device buffer's address and length.
fn raw<E: DeviceRepr>(s: &CudaSlice<E>, stream: &Arc<CudaStream>) -> RawBuf {
    RawBuf {
        ptr: s.device_ptr(stream).0,
        len: s.len(),
    }
}

/// The caches of one launch: vLLM's one (`rows` rows of `latent + ROPE_DIM`), or FlashInfer's two.
enum Caches<E> {
    One(CudaSlice<E>),
    Two {
        kpe: CudaSlice<E>,
        ckv: CudaSlice<E>,
    },
}

/// Runs `c` on `rope` with q and k in place in `q` and `k`, into `caches` (elements `E`: the
/// tensors' type, or FP8 bytes when `c.fp8`).
#[allow(clippy::too_many_arguments)]
fn launch<T: TestElem, E: DeviceRepr>(
    c: &Case,
    rope: &Rope,
    stream: &Arc<CudaStream>,
    (q, k, kv_c): (&CudaSlice<T>, &CudaSlice<T>, &CudaSlice<T>),
    (ids, slots, scale, table): (
        &CudaSlice<i64>,
        &CudaSlice<i64>,
        &CudaSlice<f32>,
        &CudaSlice<T>,
    ),
    caches: &Caches<E>,
) -> rope_host::Result<()> {
    let t = c.tokens;
    let q_pe = Layout::strided(
        [1, t, c.heads, ROPE_DIM],
        [t * c.heads * c.q_dim, c.heads * c.q_dim, c.q_dim, 1],
        c.q_dim - ROPE_DIM,
    )?;
    let op = RawFusedOp {
        rope: RawOp {
            config: RopeConfig::builder(ROPE_DIM as u32, c.style).build()?,
            dtype: T::DTYPE,
            positions: RawPositions::Ids {
                ids: RawInts {
                    buf: raw(ids, stream),
                    ty: IntType::I64,
                },
                shape: IdsShape::PerRow,
            },
            sincos: if c.table {
                RawSinCos::CosSinCache {
                    cache: raw(table, stream),
                    dtype: T::DTYPE,
                    shape: TableShape {
                        max_position: MAX_POSITION,
                        rotary_dim: ROPE_DIM as u32,
                    },
                }
            } else {
                RawSinCos::Computed { theta: THETA }
            },
        },
        norm: None,
    };
    let io = RawFusedIo::Separate {
        q: RawQOut::Elem(RawIo::InPlace(RawTensor {
            buf: raw(q, stream),
            layout: q_pe,
        })),
        k: RawKOut::Elem(RawIo::InPlace(RawTensor {
            buf: raw(k, stream),
            layout: Layout::thd(t, 1, ROPE_DIM),
        })),
        v: None,
    };
    let es = if c.fp8.is_some() { 1 } else { size_of::<T>() } as u64;
    let (k_buf, v_buf, k_layout, latent_layout) = match caches {
        Caches::One(one) => {
            let row = c.latent + ROPE_DIM;
            let strides = |inner| [c.block_size * row, row, inner];
            let one = raw(one, stream);
            (
                RawBuf {
                    ptr: one.ptr + c.latent as u64 * es,
                    len: one.len - c.latent,
                },
                one,
                CacheLayout {
                    strides: strides(ROPE_DIM),
                    ..CacheLayout::blocks_rows_heads(c.num_blocks, c.block_size, 1, ROPE_DIM)
                },
                CacheLayout {
                    strides: strides(c.latent),
                    ..CacheLayout::blocks_rows_heads(c.num_blocks, c.block_size, 1, c.latent)
                },
            )
        }
        Caches::Two { kpe, ckv } => (
            raw(kpe, stream),
            raw(ckv, stream),
            CacheLayout::blocks_rows_heads(c.num_blocks, c.block_size, 1, ROPE_DIM),
            CacheLayout::blocks_rows_heads(c.num_blocks, c.block_size, 1, c.latent),
        ),
    };
    let data = match c.fp8 {
        Some(_) => RawCacheData::Fp8 {
            k: k_buf,
            v: v_buf,
            k_scale: RawFp8Scale::PerTensor(raw(scale, stream)),
            v_scale: RawFp8Scale::PerTensor(raw(scale, stream)),
            format: Fp8Format::E4m3,
        },
        None => RawCacheData::Elem { k: k_buf, v: v_buf },
    };
    let cache = RawKvCache {
        address: RawCacheAddress::Slots(RawInts {
            buf: raw(slots, stream),
            ty: IntType::I64,
        }),
        layout: k_layout,
        data,
        non_rotary: Some(RawCacheNonRotary {
            input: RawTensor {
                buf: raw(kv_c, stream),
                layout: Layout::thd(t, 1, c.latent),
            },
            into: NonRotaryCache::Latent(latent_layout),
        }),
    };
    // SAFETY: every buffer lives on this stream's context until the caller synchronizes.
    unsafe { rope.run_fused_raw(&op, io, Some(cache), stream.cu_stream()) }
}

/// Runs `c` into the one cache (on `one_rope`) and into the two (on `two_rope`) from the same
/// inputs and poisoned caches of elements `E` (`poison` each, compared by `bits_of`), and
/// compares everything written.
fn compare<T: TestElem, E: DeviceRepr + ValidAsZeroBits + Copy>(
    c: &Case,
    (one_rope, two_rope): (&Rope, &Rope),
    stream: &Arc<CudaStream>,
    (poison, bits_of): (E, fn(E) -> u64),
) -> Result<usize, String> {
    let e = |e: rope_host::cudarc::driver::DriverError| e.to_string();
    let h = |e: rope_host::Error| e.to_string();
    let mut rng = StdRng::seed_from_u64(c.tokens as u64 * 7 + c.heads as u64);
    let mut vals = |n: usize| -> Vec<T> {
        (0..n)
            .map(|_| T::from_f64(rng.random_range(-4.0..4.0)))
            .collect()
    };
    let (q_host, k_host, kv_host) = (
        vals(c.tokens * c.heads * c.q_dim),
        vals(c.tokens * ROPE_DIM),
        vals(c.tokens * c.latent),
    );
    let half = ROPE_DIM / 2;
    let table_host: Vec<T> = (0..MAX_POSITION)
        .flat_map(|p| {
            let angle = |i: usize| p as f64 * THETA.powf(-2.0 * i as f64 / ROPE_DIM as f64);
            let cos = (0..half).map(move |i| T::from_f64(angle(i).cos()));
            let sin = (0..half).map(move |i| T::from_f64(angle(i).sin()));
            cos.chain(sin).collect::<Vec<_>>()
        })
        .collect();
    let up = |v: &[T]| stream.clone_htod(v).map_err(e);
    let (q1, q2, k1, k2, kv_c) = (
        up(&q_host)?,
        up(&q_host)?,
        up(&k_host)?,
        up(&k_host)?,
        up(&kv_host)?,
    );
    let ids = stream.clone_htod(&c.ids).map_err(e)?;
    let slots = stream.clone_htod(&c.slots).map_err(e)?;
    let scale = stream.clone_htod(&[c.fp8.unwrap_or(1.0)]).map_err(e)?;
    let table = up(&table_host)?;
    let poisoned = |n: usize| stream.clone_htod(&vec![poison; n]).map_err(e);
    let one = Caches::One(poisoned(c.rows() * (c.latent + ROPE_DIM))?);
    let two = Caches::Two {
        kpe: poisoned(c.rows() * ROPE_DIM)?,
        ckv: poisoned(c.rows() * c.latent)?,
    };
    let arrays = (&ids, &slots, &scale, &table);
    launch(c, one_rope, stream, (&q1, &k1, &kv_c), arrays, &one).map_err(h)?;
    launch(c, two_rope, stream, (&q2, &k2, &kv_c), arrays, &two).map_err(h)?;
    let down_t = |s: &CudaSlice<T>| stream.clone_dtoh(s).map_err(e);
    let bits = |v: Vec<T>| v.into_iter().map(T::bits).collect::<Vec<_>>();
    if bits(down_t(&q1)?) != bits(down_t(&q2)?) {
        return Err("q_pe differs between the one cache's launch and the two caches'".into());
    }
    if bits(down_t(&k1)?) != bits(down_t(&k2)?) {
        return Err("k_pe differs between the one cache's launch and the two caches'".into());
    }
    let (Caches::One(one), Caches::Two { kpe, ckv }) = (&one, &two) else {
        unreachable!("built above")
    };
    let down = |s: &CudaSlice<E>| {
        let v = stream.clone_dtoh(s).map_err(e)?;
        Ok::<_, String>(v.into_iter().map(bits_of).collect::<Vec<_>>())
    };
    let (one, kpe, ckv) = (down(one)?, down(kpe)?, down(ckv)?);
    let row = c.latent + ROPE_DIM;
    for s in 0..c.rows() {
        let r = &one[s * row..(s + 1) * row];
        if r[..c.latent] != ckv[s * c.latent..(s + 1) * c.latent] {
            return Err(format!(
                "slot {s}: latent columns differ from ckv_cache's row"
            ));
        }
        if r[c.latent..] != kpe[s * ROPE_DIM..(s + 1) * ROPE_DIM] {
            return Err(format!(
                "slot {s}: k_pe columns differ from kpe_cache's row"
            ));
        }
    }
    let written = c
        .slots
        .iter()
        .filter(|&&s| (0..c.rows() as i64).contains(&s));
    Ok(written.count())
}

fn run<T: TestElem>(name: &str, cases: u64) {
    let Some((stream, rope)) = gpu_or_skip(name) else {
        return;
    };
    let handles = pinned_handles(&stream);
    // Launches on a stream of the caller's (the entry by address) read prepared frequencies.
    for r in std::iter::once(&*rope).chain(handles.iter().map(|(_, r)| r)) {
        r.prepare(THETA, ROPE_DIM as u32).expect("frequencies");
    }
    let cases = cases.min(case_cap());
    let mut slots = 0;
    for j in 0..cases {
        let c = Case::random(j, size_of::<T>());
        let (kernels, pinned) = &handles[pinned_for(j)];
        let outcome = match c.fp8 {
            Some(_) => compare::<T, u8>(&c, (pinned, &rope), &stream, (0xa5, u64::from)),
            None => compare::<T, T>(&c, (pinned, &rope), &stream, (T::poison(), T::bits)),
        };
        match outcome {
            Ok(n) => slots += n,
            Err(why) => panic!(
                "{name}: case {j} ({:?}, {} tokens, {} heads of {}, latent {}, blocks {} x {}, \
                 FP8 {:?}, table {}), one cache on {kernels:?}: {why}",
                c.style,
                c.tokens,
                c.heads,
                c.q_dim,
                c.latent,
                c.num_blocks,
                c.block_size,
                c.fp8,
                c.table
            ),
        }
    }
    report(&format!(
        "{name}: {cases} cases, {slots} slots written, every byte equal to the two caches' launch"
    ));
}

#[test]
fn mla_into_one_cache_equals_the_two_caches_launch_bf16() {
    run::<rope_host::half::bf16>("mla_into_one_cache_equals_the_two_caches_launch_bf16", 24);
}

#[test]
fn mla_into_one_cache_equals_the_two_caches_launch_f16() {
    run::<rope_host::half::f16>("mla_into_one_cache_equals_the_two_caches_launch_f16", 12);
}

#[test]
fn mla_into_one_cache_equals_the_two_caches_launch_f32() {
    run::<f32>("mla_into_one_cache_equals_the_two_caches_launch_f32", 12);
}
