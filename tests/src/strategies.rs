//! proptest strategies for random RoPE problems: odd and single-element dimensions included.

use proptest::prelude::*;
use rope_host::{Direction, IdsShape, RopeStyle};

use rope_host::TableFormat;

use rope_reference::case::{Case, DTypeCase, KCase, LayoutKind, PosCase, Source};

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
                .prop_map(|(heads, v_heads)| KCase::Fused { heads, v_heads })
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
        proptest::collection::vec(0..=max_offset, batch)
            .prop_map(PosCase::RowOffsets)
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
    proptest::strategy::Union::new(kinds).boxed()
}

/// Packed sequences over `total` tokens: up to five cuts (empty sequences allowed) and
/// optional offsets below 16.
pub fn varlen(total: usize) -> impl Strategy<Value = PosCase> {
    (
        proptest::collection::vec(0..=total as u32, 0..5),
        any::<bool>(),
        proptest::collection::vec(0u32..16, 6),
    )
        .prop_map(move |(mut cuts, with_offsets, offsets)| {
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
            }
        })
}

/// A random valid case: every style, direction, dtype, layout, rotary size, k form, sin/cos
/// source and format, position kind, in or out of place. Table cases cover their implicit
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
                    (0usize..3)
                        .prop_map(move |extra| Source::Table {
                            theta,
                            max_position: limit as usize + extra,
                            format,
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
