//! The rows kernels' part of the fused plan (`fused/rows.rs`).

use super::*;

/// The rows kernels (sm_90 builds) take NeoX 16-bit launches of many waves that store FP8, or
/// any size when pinned, whose stored tensors' token rows are contiguous and 16-byte aligned: a
/// block of every warp of a token (8 heads a warp at 128 elements a head) and the producer warp,
/// two buffers of the three rows after the mbarriers in its shared memory, as many blocks as the
/// device holds at once (at most one per token). Without the sm_90 build, with 16-bit stores,
/// with heads apart, or on a device of less DRAM bandwidth (an H100's), the four-heads kernels
/// keep them.
#[test]
fn rows_kernels_take_fp8_launches_of_many_waves_with_contiguous_rows_on_fast_dram() {
    let plan = |r: &FusedRequest, choice, bulk_rows| plan_on(&H200, r, choice, bulk_rows);
    let mut r = with_tokens(RopeStyle::Neox, 8192);
    assert_eq!(
        plan(&r, FusedKernels::Auto, true).kernel.mapping,
        Mapping::FOUR_HEADS
    );
    // sin/cos from a table, with or without a 16-bit cache: the four-heads kernels, on either
    // device.
    let mut table = r;
    let len = 8192 * D / 2;
    table.rope.sincos = RawSinCos::Table {
        cos: buf(1 << 49, len),
        sin: buf(1 << 50, len),
        dtype: DType::BF16,
        shape: TableShape {
            max_position: 8192,
            rotary_dim: D as u32,
        },
    };
    let mut cacheless = table;
    cacheless.cache = None;
    cacheless.v = None;
    cacheless.k_written = true;
    for t in [&table, &cacheless] {
        assert_eq!(
            plan(t, FusedKernels::Auto, true).kernel.mapping,
            Mapping::FOUR_HEADS
        );
        assert_eq!(
            plan_on(&H100, t, FusedKernels::Auto, true).kernel.mapping,
            Mapping::FOUR_HEADS
        );
    }
    fp8_cache(&mut r);
    let p = plan(&r, FusedKernels::Auto, true);
    assert_eq!(p.kernel.mapping, Mapping::Rows);
    // FP8, with sin/cos computed or from a table: the rows kernels on fast DRAM only.
    let mut both = table;
    both.cache = r.cache;
    assert_eq!(
        plan(&both, FusedKernels::Auto, true).kernel.mapping,
        Mapping::Rows
    );
    for fp8 in [&r, &both] {
        assert_eq!(
            plan_on(&H100, fp8, FusedKernels::Auto, true).kernel.mapping,
            Mapping::FOUR_HEADS
        );
    }
    assert_eq!(
        plan_on(
            &H100,
            &r,
            FusedKernels::Rows {
                stages: ROWS_STAGES
            },
            true
        )
        .kernel
        .mapping,
        Mapping::Rows
    );
    assert_eq!(p.token_warps, [4, 1, 1]);
    assert_eq!(p.grid.config.block_dim, (224, 1, 1));
    assert_eq!(p.grid.config.grid_dim, (132 * 4, 1, 1));
    let buffer = 48 * 128 * 2 + 4 * 128;
    assert_eq!(p.grid.config.shared_mem_bytes, 128 + 2 * buffer);
    // Three buffers where asked; four do not fit 48 KiB, so three.
    for (asked, held) in [(3, 3), (4, 3)] {
        let p = plan(&r, FusedKernels::Rows { stages: asked }, true);
        assert_eq!(p.grid.config.shared_mem_bytes, 128 + held * buffer);
    }
    assert_eq!(
        plan(&r, FusedKernels::Auto, false).kernel.mapping,
        Mapping::FOUR_HEADS
    );
    assert_eq!(
        plan(&with_tokens(RopeStyle::Neox, 64), FusedKernels::Auto, true)
            .kernel
            .mapping,
        Mapping::TWO_HEADS
    );
    let few = plan(
        &with_tokens(RopeStyle::Neox, 64),
        FusedKernels::Rows {
            stages: ROWS_STAGES,
        },
        true,
    );
    assert_eq!(few.kernel.mapping, Mapping::Rows);
    assert_eq!(few.grid.config.grid_dim, (64, 1, 1));
    assert_eq!(
        plan(
            &with_tokens(RopeStyle::Interleaved, 8192),
            FusedKernels::Rows {
                stages: ROWS_STAGES
            },
            true
        )
        .kernel
        .mapping,
        Mapping::FOUR_HEADS
    );
    // q's heads apart (a head stride past head_dim): no whole rows.
    let mut apart = r;
    apart.rope.q.x_layout.strides = [32 * 136, 32 * 136, 136];
    apart.rope.q.x = buf(1 << 40, apart.rope.q.x_layout.end().expect("fits"));
    assert_eq!(
        plan(&apart, FusedKernels::Auto, true).kernel.mapping,
        Mapping::FOUR_HEADS
    );
}
