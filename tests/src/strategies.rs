//! proptest strategies for random RoPE problems: odd and single-element dimensions included.

use proptest::prelude::*;
use rope_host::{Direction, FrequencySpec, IdsShape, RopeScaling, RopeStyle, Yarn, YarnBlend};

use rope_host::TableFormat;

use rope_harness::case::{AxesCase, Case, DTypeCase, KCase, LayoutKind, PosCase, Source};

/// Both pairings.
pub fn style() -> impl Strategy<Value = RopeStyle> {
    prop_oneof![Just(RopeStyle::Interleaved), Just(RopeStyle::Neox)]
}

/// Both directions.
pub fn direction() -> impl Strategy<Value = Direction> {
    prop_oneof![Just(Direction::Forward), Just(Direction::Backward)]
}

/// Every element type.
pub fn dtype() -> impl Strategy<Value = DTypeCase> {
    prop_oneof![
        Just(DTypeCase::F32),
        Just(DTypeCase::F16),
        Just(DTypeCase::BF16)
    ]
}

/// Head sizes: the smallest (2), odd pair counts (6, 10), common ones and random even sizes.
pub fn head_dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(2usize),
        Just(6),
        Just(10),
        Just(64),
        Just(128),
        Just(256),
        (1usize..=100).prop_map(|h| 2 * h)
    ]
}

/// `(head_dim, rotary_dim)`: full rotary most of the time, else half or a random even part.
pub fn head_and_rotary_dim() -> impl Strategy<Value = (usize, usize)> {
    head_dim().prop_flat_map(|d| {
        (
            Just(d),
            prop_oneof![
                2 => Just(d),
                1 => Just((d / 2).max(2) / 2 * 2),
                1 => (1..=d / 2).prop_map(|h| 2 * h),
            ],
        )
    })
}

/// `(batch, seq, heads)`: single-element dimensions, odd batches, and many heads.
pub fn dims() -> impl Strategy<Value = (usize, usize, usize)> {
    (
        prop_oneof![Just(1usize), 1usize..=7],
        prop_oneof![Just(1usize), 1usize..=48],
        prop_oneof![Just(1usize), 1usize..=12, 40usize..=130],
    )
}

/// Frequency bases in use (10 000 for most models, 500 000 for Llama 3, 10^6 for Qwen).
pub fn theta() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(10_000.0),
        Just(500_000.0),
        Just(1_000_000.0),
        2.0f64..2.0e6
    ]
}

/// Layouts; strided ones get gaps and an offset, even where interleaved pairs need two-element
/// alignment.
pub fn layout(style: RopeStyle) -> impl Strategy<Value = LayoutKind> {
    let step = if style == RopeStyle::Interleaved {
        2
    } else {
        1
    };
    prop_oneof![
        Just(LayoutKind::Bshd),
        Just(LayoutKind::Sbhd),
        ([0usize..5, 0usize..9, 0usize..9], 0usize..9).prop_map(move |(g, o)| {
            LayoutKind::Strided {
                gaps: [g[0] * step, g[1] * step, g[2] * step],
                offset: o * step,
            }
        }),
    ]
}

/// The k tensor: none, a separate one with GQA/MQA head counts, or fused with q (in place).
pub fn k_case(heads: usize, in_place: bool) -> BoxedStrategy<KCase> {
    let separate = (1..=heads).prop_map(|heads| KCase::Separate { heads });
    if in_place {
        prop_oneof![
            Just(KCase::None),
            separate,
            ((1..=heads), 0usize..=heads)
                .prop_map(|(heads, v_heads)| KCase::Packed { heads, v_heads })
        ]
        .boxed()
    } else {
        prop_oneof![Just(KCase::None), separate].boxed()
    }
}

/// Positions for `batch` rows of `seq` tokens. Ids may fall outside `0..limit` when
/// `allow_outside`; otherwise every position is below `limit`. Packed sequences need batch 1;
/// their offsets stay below 16.
pub fn positions(
    batch: usize,
    seq: usize,
    limit: u32,
    allow_outside: bool,
) -> BoxedStrategy<PosCase> {
    let max_offset = limit.saturating_sub(seq as u32 + 16);
    let id = if allow_outside {
        (-3i64..limit as i64 + 3).boxed()
    } else {
        (0i64..limit as i64).boxed()
    };
    let mut kinds = vec![
        (0..=max_offset).prop_map(PosCase::Offset).boxed(),
        (
            proptest::collection::vec(0..=max_offset, batch),
            any::<bool>(),
        )
            .prop_map(|(offsets, wide)| PosCase::RowOffsets { offsets, wide })
            .boxed(),
        (proptest::collection::vec(id.clone(), seq), any::<bool>())
            .prop_map(|(ids, wide)| PosCase::Ids {
                ids,
                wide,
                shape: IdsShape::Shared,
            })
            .boxed(),
        (proptest::collection::vec(id, batch * seq), any::<bool>())
            .prop_map(|(ids, wide)| PosCase::Ids {
                ids,
                wide,
                shape: IdsShape::PerRow,
            })
            .boxed(),
    ];
    if batch == 1 {
        kinds.push(varlen(seq).boxed());
    }
    if batch == 1 && seq.is_multiple_of(2) {
        // Whole sequences reach `seq * size`: sizes whose positions fit below `limit`.
        let max_size = (limit as usize / seq.max(1)).clamp(1, 8) as u32;
        kinds.push(varlen_context_parallel(seq, max_size).boxed());
    }
    proptest::strategy::Union::new(kinds).boxed()
}

/// Packed sequences over `total` tokens: up to five cuts (empty sequences allowed) and
/// optional offsets below 16.
pub fn varlen(total: usize) -> impl Strategy<Value = PosCase> {
    (
        proptest::collection::vec(0..=total as u32, 0..5),
        any::<bool>(),
        proptest::collection::vec(0u32..16, 6),
        any::<bool>(),
    )
        .prop_map(move |(mut cuts, with_offsets, offsets, wide)| {
            cuts.sort_unstable();
            let cu_seqlens: Vec<u32> = std::iter::once(0)
                .chain(cuts)
                .chain(std::iter::once(total as u32))
                .collect();
            let n = cu_seqlens.len() - 1;
            let offsets = with_offsets.then(|| offsets[..n].to_vec());
            PosCase::Varlen {
                cu_seqlens,
                offsets,
                wide,
            }
        })
}

/// Packed sequences split over 1 to `max_size` context-parallel ranks, with `local` (even)
/// tokens on a random rank: up to four cuts at even local offsets (empty sequences allowed),
/// whole boundaries `size` times the local ones.
pub fn varlen_context_parallel(local: usize, max_size: u32) -> impl Strategy<Value = PosCase> {
    (1..=max_size)
        .prop_flat_map(move |size| {
            (
                Just(size),
                0..size,
                proptest::collection::vec(0..=local as u32 / 2, 0..4),
                any::<bool>(),
            )
        })
        .prop_map(move |(size, rank, mut cuts, wide)| {
            cuts.sort_unstable();
            let cu_seqlens = std::iter::once(0)
                .chain(cuts.into_iter().map(|c| 2 * c))
                .chain(std::iter::once(local as u32))
                .map(|c| c * size)
                .collect();
            PosCase::VarlenContextParallel {
                cu_seqlens,
                size,
                rank,
                wide,
            }
        })
}

/// A random valid case of [`case`]'s made one packed batch row of an even token count, its
/// positions split over context-parallel ranks ([`varlen_context_parallel`]) whose whole
/// sequences mostly fit its table.
pub fn context_parallel_case() -> impl Strategy<Value = Case> {
    case().prop_flat_map(|mut c| {
        c.batch = 1;
        c.seq = (c.seq & !1).max(2);
        let limit = match c.source {
            Source::Table { max_position, .. } => max_position,
            Source::Theta(_) => 1 << 20,
        };
        let max_size = (limit / c.seq).clamp(1, 8) as u32;
        varlen_context_parallel(c.seq, max_size).prop_map(move |positions| Case {
            positions,
            ..c.clone()
        })
    })
}

/// A random valid case: every style, direction, dtype, layout, rotary size, k form, sin/cos
/// source and format (tables in the tensors' type or in `f32`), position kind (device
/// arrays `i32` or `i64`), in or out of place. Table cases cover their implicit
/// positions, and some explicit ids fall outside the table (NaN outputs expected there).
pub fn case() -> impl Strategy<Value = Case> {
    (
        (style(), direction(), dtype(), head_and_rotary_dim()),
        dims(),
        (
            theta(),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            any::<u64>(),
        ),
    )
        .prop_flat_map(
            |((style, direction, dtype, (head_dim, rotary_dim)), (batch, seq, heads), rest)| {
                let (theta, table, combined, in_place, seed) = rest;
                let limit = if table { seq as u32 + 32 } else { 1 << 20 };
                let source = if table {
                    let format = if combined {
                        TableFormat::Combined
                    } else {
                        TableFormat::Separate
                    };
                    (0usize..3, any::<bool>())
                        .prop_map(move |(extra, in_f32)| Source::Table {
                            theta,
                            max_position: limit as usize + extra,
                            format,
                            in_f32,
                        })
                        .boxed()
                } else {
                    Just(Source::Theta(theta)).boxed()
                };
                (
                    positions(batch, seq, limit, table),
                    source,
                    layout(style),
                    k_case(heads, in_place),
                )
                    .prop_map(move |(positions, source, layout, k)| Case {
                        style,
                        direction,
                        dtype,
                        batch,
                        seq,
                        heads,
                        head_dim,
                        rotary_dim,
                        rotary_offset: 0,
                        layout,
                        k,
                        source,
                        positions,
                        in_place,
                        seed,
                    })
            },
        )
}

/// `mrope_section`s of `half` pairs: two random cuts (empty sections allowed).
pub fn mrope_section(half: usize) -> impl Strategy<Value = [usize; 3]> {
    (0..=half, 0..=half).prop_map(move |(a, b)| {
        let (lo, hi) = (a.min(b), a.max(b));
        [lo, hi - lo, half - hi]
    })
}

/// FLUX-style `axes_dim` of `rotary_dim = 2 * half`: 1 to 4 even, nonzero widths.
pub fn axes_dim(half: usize) -> impl Strategy<Value = Vec<usize>> {
    (1..=half.min(4)).prop_flat_map(move |n| {
        proptest::sample::subsequence((1..half).collect::<Vec<_>>(), n - 1).prop_map(move |cuts| {
            let bounds: Vec<usize> = std::iter::once(0)
                .chain(cuts)
                .chain(std::iter::once(half))
                .collect();
            bounds.windows(2).map(|w| 2 * (w[1] - w[0])).collect()
        })
    })
}

/// An axis map of `half` pairs and its number of axes: mRoPE, interleaved mRoPE, axial, or
/// any map of 1 to 4 axes.
pub fn axes(half: usize) -> BoxedStrategy<(AxesCase, usize)> {
    prop_oneof![
        mrope_section(half).prop_map(|s| (AxesCase::Mrope(s), 3)),
        mrope_section(half).prop_map(|s| (AxesCase::MropeInterleaved(s), 3)),
        axes_dim(half).prop_map(|d| {
            let n = d.len();
            (AxesCase::Axial(d), n)
        }),
        (1usize..=4).prop_flat_map(move |n| {
            proptest::collection::vec(0..n as u8, half).prop_map(move |m| (AxesCase::Map(m), n))
        }),
    ]
    .boxed()
}

/// Multi-axis positions for `batch * seq` tokens of `rotary_dim / 2` pairs, each below
/// `limit`, or, when `allow_outside`, now and then outside `0..limit` (NaN for the pairs of
/// that axis with tables).
pub fn multi_axis(
    batch: usize,
    seq: usize,
    rotary_dim: usize,
    limit: u32,
    allow_outside: bool,
) -> BoxedStrategy<PosCase> {
    let id = if allow_outside {
        (-3i64..limit as i64 + 3).boxed()
    } else {
        (0i64..limit as i64).boxed()
    };
    axes(rotary_dim / 2)
        .prop_flat_map(move |(axes, n_axes)| {
            (
                proptest::collection::vec(id.clone(), n_axes * batch * seq),
                any::<bool>(),
            )
                .prop_map(move |(positions, wide)| PosCase::MultiAxis {
                    positions,
                    n_axes,
                    axes: axes.clone(),
                    wide,
                })
        })
        .boxed()
}

/// A [`case`] whose rotated slice starts at a random offset (even for interleaved pairs) and,
/// three times in four, whose positions are multi-axis ([`multi_axis`]).
pub fn sliced_multi_axis_case() -> impl Strategy<Value = Case> {
    (case(), 0usize..4).prop_flat_map(|(case, kind)| {
        let step = match case.style {
            RopeStyle::Interleaved => 2,
            RopeStyle::Neox => 1,
        };
        let free = case.head_dim - case.rotary_dim;
        let (limit, table) = match case.source {
            Source::Table { max_position, .. } => (max_position as u32, true),
            Source::Theta(_) => (1 << 20, false),
        };
        let positions = if kind == 0 {
            Just(case.positions.clone()).boxed()
        } else {
            multi_axis(case.batch, case.seq, case.rotary_dim, limit, table)
        };
        (
            prop_oneof![Just(0usize), Just(free / step), 0..=free / step],
            positions,
        )
            .prop_map(move |(o, positions)| Case {
                rotary_offset: o * step,
                positions,
                ..case.clone()
            })
    })
}

/// Floats of every class, for parameters of the frequency families: zeros of both signs,
/// negatives, subnormals, values at and next to the documented bounds (1, `2^-20`, `2^20`, `1e-3`,
/// `1e3`), huge ones, NaN and infinities, and random values in `[0, 1]`, `(1, 1e7)` and
/// log-uniform over the whole positive and negative range.
pub fn edge_f64() -> BoxedStrategy<f64> {
    let next = |v: f64| f64::from_bits(v.to_bits() + 1);
    let prev = |v: f64| f64::from_bits(v.to_bits() - 1);
    let (min_factor, max_factor) = (2f64.powi(-20), 2f64.powi(20));
    let edges = vec![
        0.0,
        -0.0,
        -1.0,
        1e-320,
        f64::MIN_POSITIVE,
        1e-300,
        prev(min_factor),
        min_factor,
        prev(1e-3),
        1e-3,
        0.5,
        prev(1.0),
        1.0,
        next(1.0),
        1e3,
        next(1e3),
        max_factor,
        next(max_factor),
        1e300,
        f64::MAX,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
    ];
    prop_oneof![
        3 => proptest::sample::select(edges),
        1 => 0.0f64..=1.0,
        1 => 1.0f64..1e7,
        2 => (-330.0f64..=308.0).prop_map(|e| 10f64.powf(e)),
        1 => (-330.0f64..=308.0).prop_map(|e| -(10f64.powf(e))),
    ]
    .boxed()
}

/// Log-uniform in `[lo, hi]` (both positive), endpoints included now and then.
pub fn log_uniform(lo: f64, hi: f64) -> BoxedStrategy<f64> {
    prop_oneof![
        8 => (lo.ln()..=hi.ln()).prop_map(move |l| l.exp().clamp(lo, hi)),
        1 => Just(lo),
        1 => Just(hi),
    ]
    .boxed()
}

/// Integers log-uniform in `[lo, hi]` (`lo >= 1`), endpoints included now and then.
pub fn log_uniform_u64(lo: u64, hi: u64) -> BoxedStrategy<u64> {
    log_uniform(lo as f64, hi as f64)
        // `as` saturates: `hi as f64` may round up past `hi` (for `u64::MAX`, to 2^64).
        .prop_map(move |v| (v.round() as u64).clamp(lo, hi))
        .boxed()
}

/// Integers log-uniform in `[lo, hi]` (`lo >= 1`), endpoints included now and then.
pub fn log_uniform_u32(lo: u32, hi: u32) -> BoxedStrategy<u32> {
    log_uniform_u64(lo.into(), hi.into())
        .prop_map(|v| u32::try_from(v).expect("at most hi"))
        .boxed()
}

/// Lengths of every class for `u64` fields (`seq_len`): 0, 1, 2, the `u32` limit and the
/// `u64` limit.
pub fn edge_u64() -> BoxedStrategy<u64> {
    let max32 = u64::from(u32::MAX);
    proptest::sample::select(vec![0, 1, 2, 3, max32 - 1, max32, max32 + 1, u64::MAX]).boxed()
}

/// Lengths of every class for `u32` fields (context lengths): 0, 1, 2 and the `u32` limit.
pub fn edge_u32() -> BoxedStrategy<u32> {
    proptest::sample::select(vec![0, 1, 2, 3, u32::MAX - 1, u32::MAX]).boxed()
}

/// Mostly a plausible value in `[lo, hi]`, else any value of [`edge_f64`].
fn plausible_or_edge(lo: f64, hi: f64) -> BoxedStrategy<f64> {
    prop_oneof![2 => log_uniform(lo, hi), 1 => edge_f64()].boxed()
}

/// Mostly a plausible length in `[lo, hi]`, else any value of [`edge_u32`].
fn plausible_or_edge_u32(lo: u32, hi: u32) -> BoxedStrategy<u32> {
    prop_oneof![2 => log_uniform_u32(lo, hi), 1 => edge_u32()].boxed()
}

/// Mostly a plausible length in `[lo, hi]`, else any value of [`edge_u64`].
fn plausible_or_edge_u64(lo: u64, hi: u64) -> BoxedStrategy<u64> {
    prop_oneof![2 => log_uniform_u64(lo, hi), 1 => edge_u64()].boxed()
}

/// `n` LongRoPE factors: in `[lo, hi]`, the list one entry longer or shorter now and then, and
/// now and then one entry replaced by `edge`.
fn factor_list(
    n: usize,
    lo: f64,
    hi: f64,
    edge: BoxedStrategy<f64>,
) -> impl Strategy<Value = Vec<f64>> {
    (
        prop_oneof![8 => Just(n), 1 => Just(n + 1), 1 => Just(n.saturating_sub(1))],
        proptest::option::weighted(0.3, (0..n.max(1), edge)),
    )
        .prop_flat_map(move |(len, poke)| {
            proptest::collection::vec(log_uniform(lo, hi), len).prop_map(move |mut list| {
                if let Some((i, v)) = poke
                    && i < list.len()
                {
                    list[i] = v;
                }
                list
            })
        })
}

/// A frequency family for `pairs = rotary_dim / 2` pairs, each float parameter drawn by
/// `value(lo, hi)` from a plausible range `[lo, hi]` (the generators below decide how far
/// outside they go), each length mostly plausible, else from [`edge_u32`] or [`edge_u64`].
fn scaling_with(
    pairs: usize,
    value: fn(f64, f64) -> BoxedStrategy<f64>,
    list_edge: BoxedStrategy<f64>,
) -> BoxedStrategy<RopeScaling> {
    let yarn = (
        (
            value(0.5, 64.0),
            plausible_or_edge_u32(1, 1_000_000),
            value(0.5, 64.0),
            value(0.25, 4.0),
        ),
        (
            proptest::option::of(value(0.1, 2.0)),
            proptest::option::of(value(0.1, 2.0)),
            proptest::option::weighted(0.2, value(0.5, 2.0)),
            (any::<bool>(), any::<bool>()),
        ),
    )
        .prop_map(yarn);
    let longrope = (
        factor_list(pairs, 0.9, 1.5, list_edge.clone()),
        factor_list(pairs, 1.0, 64.0, list_edge),
        proptest::option::weighted(0.3, value(1.0, 64.0)),
        (
            plausible_or_edge_u32(2, 100_000),
            plausible_or_edge_u32(1, 10_000_000),
            plausible_or_edge_u64(1, 10_000_000),
        ),
        proptest::option::weighted(0.2, value(0.5, 2.0)),
    )
        .prop_map(longrope);
    prop_oneof![
        Just(RopeScaling::Default),
        value(0.5, 64.0).prop_map(|factor| RopeScaling::Linear { factor }),
        (
            value(0.5, 64.0),
            plausible_or_edge_u32(1, 1_000_000),
            plausible_or_edge_u64(1, 10_000_000)
        )
            .prop_map(|(factor, max, seq_len)| RopeScaling::DynamicNtk {
                factor,
                max_position_embeddings: max,
                seq_len,
            }),
        value(0.5, 2000.0).prop_map(|alpha| RopeScaling::DynamicNtkAlpha { alpha }),
        (
            value(0.5, 64.0),
            proptest::option::weighted(0.5, value(0.25, 4.0))
        )
            .prop_map(|(factor, mixed_b)| RopeScaling::Ntk { factor, mixed_b }),
        (value(0.05, 1.0), value(0.5, 4.0)).prop_map(|(share, factor)| {
            RopeScaling::Proportional {
                partial_rotary_factor: share,
                factor,
            }
        }),
        proptest::collection::vec(
            prop_oneof![3 => (1u32..=64).prop_map(|w| 2 * w), 1 => edge_u32()],
            0..=5
        )
        .prop_map(|axes_dim| RopeScaling::Axial { axes_dim }),
        yarn,
        (
            value(1.0, 64.0),
            value(0.25, 2.0),
            value(2.0, 16.0),
            plausible_or_edge_u32(1, 1_000_000)
        )
            .prop_map(|(factor, low, high, original)| RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: original,
            }),
        longrope,
    ]
    .boxed()
}

/// Any frequency description, valid or not: `theta` and every float parameter either plausible
/// or from [`edge_f64`], every length either plausible or from [`edge_u32`] or [`edge_u64`],
/// `rotary_dim` odd, zero or even, factor lists of the wrong length now and then.
pub fn frequency_spec_any() -> impl Strategy<Value = FrequencySpec> {
    (
        plausible_or_edge(1.0, 1e7),
        prop_oneof![
            1 => proptest::sample::select(vec![0u32, 1, 2, 3, 4, 7]),
            4 => (1u32..=128).prop_map(|h| 2 * h),
        ],
    )
        .prop_flat_map(|(theta, rotary_dim)| {
            scaling_with(rotary_dim as usize / 2, plausible_or_edge, edge_f64())
                .prop_map(move |scaling| FrequencySpec::new(theta, rotary_dim).scaling(scaling))
        })
}

/// A description inside every documented domain, over wide ranges: `theta` in `(1, 1e7]`,
/// factors over all of `[2^-20, 2^20]`, context lengths over all of `[1, u32::MAX]` (LongRoPE's
/// original context from 2) and sequence lengths over all of `[1, u64::MAX]`, LongRoPE's
/// `factor` given or not, rotation counts in `[2^-20, 2^20]`, `mscale` in `[0, 10]`, attention
/// factors over all of `[1e-3, 1e3]`, `low_freq_factor < high_freq_factor` down to one ulp
/// apart.
pub fn frequency_spec_in_domain() -> impl Strategy<Value = FrequencySpec> {
    let (min_factor, max_factor) = (2f64.powi(-20), 2f64.powi(20));
    let factor = move || log_uniform(min_factor, max_factor);
    let length = || log_uniform_u32(1, u32::MAX);
    let seq_len = || log_uniform_u64(1, u64::MAX);
    let yarn = (
        (factor(), length(), factor(), factor()),
        (
            proptest::option::of(0.0f64..=10.0),
            proptest::option::of(0.0f64..=10.0),
            proptest::option::weighted(0.2, log_uniform(1e-3, 1e3)),
            (any::<bool>(), any::<bool>()),
        ),
    )
        .prop_map(yarn);
    let llama3 = (
        factor(),
        log_uniform(1.0 / 1024.0, 1024.0),
        prop_oneof![
            3 => log_uniform(1.0 + 1e-9, 1024.0).prop_map(Some),
            1 => Just(None),
        ],
        length(),
    )
        .prop_map(|(factor, low, ratio, original)| RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            // `None`: the float right above `low`.
            high_freq_factor: ratio.map_or(f64::from_bits(low.to_bits() + 1), |r| low * r),
            original_max_position_embeddings: original,
        });
    let theta = prop_oneof![
        3 => log_uniform(1.0 + 1e-12, 1e7),
        1 => (1e-12f64..1e-3).prop_map(|e| 1.0 + e),
    ];
    (theta, 1u32..=128).prop_flat_map(move |(theta, half)| {
        let pairs = half as usize;
        let longrope = (
            proptest::collection::vec(factor(), pairs),
            proptest::collection::vec(factor(), pairs),
            proptest::option::of(factor()),
            (log_uniform_u32(2, u32::MAX), length(), seq_len()),
            proptest::option::weighted(0.2, log_uniform(1e-3, 1e3)),
        )
            .prop_map(longrope);
        prop_oneof![
            Just(RopeScaling::Default),
            factor().prop_map(|factor| RopeScaling::Linear { factor }),
            (factor(), length(), seq_len()).prop_map(|(factor, max, seq_len)| {
                RopeScaling::DynamicNtk {
                    factor,
                    max_position_embeddings: max,
                    seq_len,
                }
            }),
            yarn.clone(),
            llama3.clone(),
            longrope,
            log_uniform(1.0, max_factor).prop_map(|alpha| RopeScaling::DynamicNtkAlpha { alpha }),
            (
                log_uniform(1.0, max_factor),
                proptest::option::of(log_uniform(1e-3, 16.0))
            )
                .prop_map(|(factor, mixed_b)| RopeScaling::Ntk { factor, mixed_b }),
            ((1e-6f64..=1.0), factor()).prop_map(|(share, factor)| RopeScaling::Proportional {
                partial_rotary_factor: share,
                factor,
            }),
            (1usize..=4).prop_flat_map(move |n| {
                // `n` axes of random even widths summing to `2 * half` (fewer when half < n).
                proptest::sample::subsequence(
                    (1..pairs).collect::<Vec<_>>(),
                    (n - 1).min(pairs - 1),
                )
                .prop_map(move |cuts| {
                    let bounds: Vec<u32> = std::iter::once(0)
                        .chain(cuts.into_iter().map(|c| c as u32))
                        .chain(std::iter::once(half))
                        .collect();
                    RopeScaling::Axial {
                        axes_dim: bounds.windows(2).map(|w| 2 * (w[1] - w[0])).collect(),
                    }
                })
            }),
        ]
        .prop_map(move |scaling| {
            // Dynamic NTK needs rotary_dim > 2 (its exponent is d / (d - 2)); LongRoPE's
            // lists hold `half` entries.
            let rotary_dim = match scaling {
                RopeScaling::DynamicNtk { .. } | RopeScaling::DynamicNtkAlpha { .. } => {
                    2 * half.max(2)
                }
                RopeScaling::Axial { ref axes_dim } => axes_dim.iter().sum(),
                _ => 2 * half,
            };
            FrequencySpec::new(theta, rotary_dim).scaling(scaling)
        })
    })
}

/// The parameters `((factor, original, beta_fast, beta_slow), (mscale, mscale_all_dim,
/// attention_factor, (truncate, log_blend)))` as a YaRN family.
#[allow(clippy::type_complexity)]
fn yarn(
    ((factor, original, beta_fast, beta_slow), (mscale, all, attention, (truncate, log_blend))): (
        (f64, u32, f64, f64),
        (Option<f64>, Option<f64>, Option<f64>, (bool, bool)),
    ),
) -> RopeScaling {
    RopeScaling::Yarn(Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast,
        beta_slow,
        mscale,
        mscale_all_dim: all,
        attention_factor: attention,
        truncate,
        mscale_coefficient: 0.1,
        blend: if log_blend {
            YarnBlend::Log
        } else {
            YarnBlend::Linear
        },
    })
}

/// The parameters `(short_factor, long_factor, factor, (original, max, seq_len),
/// attention_factor)` as a LongRoPE family.
#[allow(clippy::type_complexity)]
fn longrope(
    (short_factor, long_factor, factor, (original, max, seq_len), attention_factor): (
        Vec<f64>,
        Vec<f64>,
        Option<f64>,
        (u32, u32, u64),
        Option<f64>,
    ),
) -> RopeScaling {
    RopeScaling::LongRope {
        short_factor,
        long_factor,
        factor,
        original_max_position_embeddings: original,
        max_position_embeddings: max,
        seq_len,
        attention_factor,
    }
}

/// A random prefill-sized rotation of the kind the planner gives the fused four-heads kernels
/// (`rope-host`'s "plain rotations at prefill take the fused kernels"): either pairing and
/// direction, every element type, heads of 64 or 128 elements rotated whole or in part (a half
/// or a quarter, from the start or from an offset: in place, the fused kernels take the rotated
/// elements as narrower heads), 24 to 32 q heads alone or with k (separate or packed), 3072 to
/// 4096 tokens; every layout, sin/cos source, position kind and in or out of place as [`case`].
pub fn prefill_case() -> impl Strategy<Value = Case> {
    (
        (
            (dtype(), style()),
            direction(),
            // Rotated elements: (numerator over 4 of the head, offset in eighths of the head).
            prop_oneof![
                2 => Just((4usize, 0usize)),
                1 => Just((2, 0)),
                1 => Just((2, 2)),
                1 => Just((1, 5)),
            ],
        ),
        prop_oneof![Just(64usize), Just(128)],
        prop_oneof![
            Just((1usize, 4096usize)),
            Just((2, 1536)),
            (3072usize..=4096).prop_map(|s| (1, s))
        ],
        24usize..=32,
        (theta(), any::<bool>(), any::<bool>(), any::<u64>()),
    )
        .prop_flat_map(
            |(((dtype, style), direction, rotated), head_dim, (batch, seq), heads, rest)| {
                let (rotary_dim, rotary_offset) =
                    (head_dim * rotated.0 / 4, head_dim * rotated.1 / 8);
                let (theta, table, in_place, seed) = rest;
                let limit = if table { seq as u32 + 32 } else { 1 << 20 };
                let source = if table {
                    any::<bool>()
                        .prop_map(move |in_f32| Source::Table {
                            theta,
                            max_position: limit as usize,
                            format: TableFormat::Separate,
                            in_f32,
                        })
                        .boxed()
                } else {
                    Just(Source::Theta(theta)).boxed()
                };
                let k = k_case(heads.min(8), in_place);
                (
                    positions(batch, seq, limit, table),
                    source,
                    layout(style),
                    k,
                )
                    .prop_map(move |(positions, source, layout, k)| Case {
                        style,
                        direction,
                        dtype,
                        batch,
                        seq,
                        heads,
                        head_dim,
                        rotary_dim,
                        rotary_offset,
                        layout,
                        k,
                        source,
                        positions,
                        in_place,
                        seed,
                    })
            },
        )
}
