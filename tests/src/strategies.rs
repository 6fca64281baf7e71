//! proptest strategies for random RoPE problems: odd and single-element dimensions included.

use proptest::prelude::*;
use rope_host::{Direction, IdsShape, RopeStyle};

use crate::case::{Case, PosCase, Source};

/// Both pairings.
pub fn style() -> impl Strategy<Value = RopeStyle> {
    prop_oneof![Just(RopeStyle::Interleaved), Just(RopeStyle::Neox)]
}

/// Both directions.
pub fn direction() -> impl Strategy<Value = Direction> {
    prop_oneof![Just(Direction::Forward), Just(Direction::Backward)]
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

/// Positions for `batch` rows of `seq` tokens. Ids may fall outside `0..limit` when
/// `allow_outside`; otherwise every position is below `limit`.
pub fn positions(
    batch: usize,
    seq: usize,
    limit: u32,
    allow_outside: bool,
) -> impl Strategy<Value = PosCase> {
    let max_offset = limit.saturating_sub(seq as u32);
    let id = if allow_outside {
        (-3i64..limit as i64 + 3).boxed()
    } else {
        (0i64..limit as i64).boxed()
    };
    prop_oneof![
        (0..=max_offset).prop_map(PosCase::Offset),
        proptest::collection::vec(0..=max_offset, batch).prop_map(PosCase::RowOffsets),
        (proptest::collection::vec(id.clone(), seq), any::<bool>()).prop_map(|(ids, wide)| {
            PosCase::Ids {
                ids,
                wide,
                shape: IdsShape::Shared,
            }
        }),
        (proptest::collection::vec(id, batch * seq), any::<bool>()).prop_map(|(ids, wide)| {
            PosCase::Ids {
                ids,
                wide,
                shape: IdsShape::PerRow,
            }
        }),
    ]
}

/// A random valid case: every style, direction, sin/cos source, position kind, in or out of
/// place. Table cases cover their implicit positions exactly or with room to spare, and some of
/// their explicit ids fall outside the table (NaN outputs expected there).
pub fn case() -> impl Strategy<Value = Case> {
    (
        style(),
        direction(),
        head_dim(),
        dims(),
        theta(),
        any::<bool>(),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_flat_map(
            |(style, direction, head_dim, (batch, seq, heads), theta, table, in_place, seed)| {
                let limit = if table { seq as u32 + 16 } else { 1 << 20 };
                let source = if table {
                    (Just(limit as usize), 0usize..3)
                        .prop_map(move |(l, extra)| Source::Table {
                            theta,
                            max_position: l + extra,
                        })
                        .boxed()
                } else {
                    Just(Source::Theta(theta)).boxed()
                };
                (positions(batch, seq, limit, table), source).prop_map(
                    move |(positions, source)| Case {
                        style,
                        direction,
                        batch,
                        seq,
                        heads,
                        head_dim,
                        source,
                        positions,
                        in_place,
                        seed,
                    },
                )
            },
        )
}
