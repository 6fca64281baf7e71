//! The launch contract between the host library and the kernels: the option enums, the kernel
//! names, the codes passed as `u32` arguments, and the limits both sides assume. One
//! definition, used by both (`rope-host` re-exports the public enums).

use core::num::{NonZeroU32, NonZeroU64};

/// Threads per block of every kernel launch. 128 rather than 256: the last blocks of a launch
/// then hold half the work, so fewer multiprocessors sit idle while they finish, which made the
/// 16-bit NeoX launches faster (docs/perf/decisions.md).
pub const BLOCK_THREADS: u32 = 128;

/// The most work items (tokens times accesses per head) of one fused launch in the item loop
/// (`heads_per_chunk` not 0): the fused kernels index them in 32 bits, and with at most this
/// many items (and the grid of blocks they fill) an index plus the grid's stride stays below
/// 2^32.
pub const MAX_FUSED_ITEMS: u64 = 1 << 30;

/// The most warps in one block of the fused token-heads kernels ([`Mapping::TokenHeads`]): a
/// token's warps (q's, then k's, then v's) are cut into the fewest equal blocks of at most this many,
/// each block computing the token's cos/sin once for its q and k warps. At prefill a cap of
/// five (12 warps as 4 + 4 + 4, 10 as 5 + 5) is faster than one of four (10 as 4 + 4 + 2) or
/// six (12 as 6 + 6), and than whole tokens in one block, where every warp waits at the
/// barrier for the block's cos/sin (docs/perf/decisions.md).
pub const TOKEN_HEADS_MAX_WARPS: u32 = 5;

/// Blocks of [`BLOCK_THREADS`] that must fit on one multiprocessor at once, unless
/// [`KernelName::min_blocks_per_sm`] asks for more: `cargo xtask ptx` writes it as
/// `.minnctapersm` with `.maxntid` into every entry point (rustc has no launch-bounds
/// attribute), so ptxas keeps each kernel within `65536 / 1024 = 64` registers and 1024 threads
/// stay resident per multiprocessor.
pub const MIN_BLOCKS_PER_SM: u32 = 1024 / BLOCK_THREADS;

/// Which elements of a head form a rotated pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// GPT-J / RoFormer: pair `i` is `(x[2i], x[2i + 1])`.
    Interleaved,
    /// GPT-NeoX / Llama "rotate half": pair `i` is `(x[i], x[i + rotary_dim/2])`.
    Neox,
}

impl RopeStyle {
    /// The pairs a work item of accesses of `lanes` elements rotates: `lanes` NeoX pairs (an
    /// access reads `lanes` first halves, another as many second halves), `lanes / 2`
    /// interleaved ones. (Inline, host-side: the kernels name their pairing by type.)
    #[inline]
    pub const fn pairs_per_item(self, lanes: u32) -> u32 {
        match self {
            Self::Neox => lanes,
            Self::Interleaved => lanes / 2,
        }
    }
}

/// Forward rotation, or its gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// `y = R(angle) x`.
    Forward,
    /// `dx = R(angle)^T dy = R(-angle) dy`, the gradient of the forward pass.
    Backward,
}

impl Direction {
    /// The RoPE kernels' `sin_sign` argument ([`crate::plain_kernel_params!`]): `+1.0` forward,
    /// `-1.0` backward, since `R(-angle)` is `R(angle)` with `sin` negated (exactly: the
    /// product by `-1.0` only flips the sign bit).
    #[inline(always)]
    pub const fn sin_sign(self) -> f32 {
        match self {
            Self::Forward => 1.0,
            Self::Backward => -1.0,
        }
    }
}

/// Element types the kernels load and store (arithmetic is `f32`, rounded once on store). The
/// table builder takes one as its `dtype` argument (`DType::F16 as u32`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// IEEE binary32.
    F32 = 0,
    /// IEEE binary16.
    F16 = 1,
    /// bfloat16 (the top half of an `f32`).
    BF16 = 2,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
        }
    }
}

/// Where a kernel takes cos/sin from; each source has its own kernels, so the table kernels
/// carry none of the registers of the in-kernel sin/cos.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SinCosSource {
    /// `cos[pos * table_stride + i]`, `sin[pos * table_stride + i]` from tables with
    /// `table_rows` rows, of the element type the `table_elem` argument gives ([`TableElem`]);
    /// a position outside `0..table_rows` yields NaN outputs.
    Table,
    /// `cos`/`sin` of `pos * inv_freq[i]` computed by [`crate::math::rope_cos_sin`], with
    /// `inv_freq` an `f64` array of `half` frequencies.
    Theta,
}

/// The element type of a table kernel's `cos` and `sin` tables, passed as its `table_elem`
/// argument: one kernel per tensor element type reads either, the choice a uniform branch
/// around its table reads (kernels of their own per table type had doubled the table kernels
/// for no speed: docs/perf/decisions.md). `f32` tensors read `f32` tables whatever the code.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TableElem {
    /// The tensors' element type (and kernels that read no table).
    Tensors = 0,
    /// `f32`, for `f16`/`bf16` tensors rotated by cos/sin not rounded to their type.
    F32 = 1,
}

/// Where the position of token `(b, s)` comes from, passed as the `position_code` argument
/// together with the pointer `pos_ptr` and the scalar `pos_base`. Device arrays hold `i32` or
/// `i64` as the code says; their values are not trusted: a position outside a table gives NaN
/// outputs, and malformed `cu_seqlens` give wrong positions but no access outside the arrays.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PositionCode {
    /// `pos = pos_base + s`; `pos_ptr` is unused.
    Offset = 0,
    /// `pos = row_offsets[b] + s`, `pos_ptr` pointing at `batch` `i32`.
    RowOffsetsI32 = 1,
    /// `pos = row_offsets[b] + s`, `pos_ptr` pointing at `batch` `i64`.
    RowOffsetsI64 = 2,
    /// `pos = ids[s]`, `pos_ptr` pointing at `seq` `i32`.
    IdsI32Shared = 3,
    /// `pos = ids[b * seq + s]`, `pos_ptr` pointing at `batch * seq` `i32`.
    IdsI32PerRow = 4,
    /// `pos = ids[s]`, `pos_ptr` pointing at `seq` `i64`.
    IdsI64Shared = 5,
    /// `pos = ids[b * seq + s]`, `pos_ptr` pointing at `batch * seq` `i64`.
    IdsI64PerRow = 6,
    /// Packed sequences (`batch = 1`, token `t = s`): `pos = t - cu_seqlens[i] + offsets[i]`
    /// for the sequence `i` holding `t`; `pos_ptr` points at `pos_count + 1` `i32`
    /// (`cu_seqlens`), `pos_aux` at `pos_count` `i32` offsets or is null (no offsets).
    /// `pos_base` holds a [`ContextParallelSplit`] ([`ContextParallelSplit::to_base`]; 0 for
    /// none): with more than one rank, `cu_seqlens` are the whole sequences' boundaries and
    /// the position is [`ContextParallelSplit::position`]'s (offsets are not read).
    VarlenI32 = 7,
    /// As [`PositionCode::VarlenI32`] with `i64` arrays.
    VarlenI64 = 8,
    /// Multi-axis positions whose work-item groups each lie on one axis (mRoPE's and FLUX's
    /// maps when their sections are multiples of the pairs per item): the positions array of
    /// [`PositionCode::MultiAxisI32`], the axes given per rotating group by the [`GroupAxes`]
    /// in `pos_base` instead of per pair by `pos_aux` (not read). A work item reads the one
    /// position of its group's axis, `min(axis, pos_count - 1)`.
    GroupAxesI32 = 9,
    /// As [`PositionCode::GroupAxesI32`] with an `i64` array.
    GroupAxesI64 = 10,
    /// Multi-axis positions (mRoPE, N-D axial RoPE): `pos_ptr` points at `pos_count` rows of
    /// `tokens` `i32` (`[n_axes, batch * seq]`, row `a` holding axis `a`'s position of token
    /// `b * seq + s`), `pos_aux` at `half` `u8` axis indices: pair `j` rotates by the position
    /// of axis `min(axes[j], pos_count - 1)` (the clamp keeps malformed device maps inside the
    /// array). `pos_count` is 1 to [`MAX_AXES`]. The largest codes: the kernels test
    /// `code >= MultiAxisI32` for the per-pair path.
    MultiAxisI32 = 11,
    /// As [`PositionCode::MultiAxisI32`] with an `i64` array.
    MultiAxisI64 = 12,
}

/// The most position axes of [`PositionCode::MultiAxisI32`] and [`PositionCode::MultiAxisI64`].
pub const MAX_AXES: u32 = 4;

impl PositionCode {
    /// Decodes a kernel argument; `None` for an unknown code.
    #[inline(always)]
    pub fn from_u32(code: u32) -> Option<Self> {
        Some(match code {
            0 => Self::Offset,
            1 => Self::RowOffsetsI32,
            2 => Self::RowOffsetsI64,
            3 => Self::IdsI32Shared,
            4 => Self::IdsI32PerRow,
            5 => Self::IdsI64Shared,
            6 => Self::IdsI64PerRow,
            7 => Self::VarlenI32,
            8 => Self::VarlenI64,
            9 => Self::GroupAxesI32,
            10 => Self::GroupAxesI64,
            11 => Self::MultiAxisI32,
            12 => Self::MultiAxisI64,
            _ => return None,
        })
    }
}

/// How wide the accesses of an item-loop kernel are ([`Mapping::ItemLoop`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Width {
    /// [`preferred_lanes`] elements per access, when every tensor address and stride is
    /// aligned to it and the pairs (and pass-through elements) split into groups of that many.
    Preferred,
    /// Fewer lanes, chosen at run time (1, 2, or for 16-bit interleaved 4 elements; 1 only for
    /// NeoX pairs): kernels of their own, so that the preferred-width kernels carry none of
    /// these paths' registers.
    Narrow,
}

/// Heads of one tensor that each thread of the token-heads mapping ([`Mapping::TokenHeads`])
/// takes: consecutive heads `U m .. U m + U` of the same token and pairs, which share the
/// thread's index splits, position, cos/sin, norm weights and cache slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ThreadHeads {
    /// One head: the RoPE kernels' (`_one_head`).
    One,
    /// Two heads: the fused kernels' (`_two_heads`), for every pairing and element type.
    Two,
    /// Four heads: the fused kernels `_four_heads` ([`FusedKernelName::four_heads`]), for
    /// launches of many waves (prefill): the thread's
    /// set-up, its share of the block's cos/sin and its norm weights serve four heads, where
    /// those launches are bound by the instructions they issue. Against two heads per thread,
    /// four made prefill clearly faster on devices of high DRAM bandwidth, and with FP8 stores
    /// on every device, and about as fast otherwise; as kernels of their own, which leave the
    /// two-heads kernels at their lower register cap, they made prefill and decode a little
    /// faster again (docs/perf/decisions.md). At decode two heads per thread keep each
    /// thread's chain short.
    Four,
}

impl ThreadHeads {
    /// The heads, `U`.
    pub const fn count(self) -> u32 {
        match self {
            Self::One => 1,
            Self::Two => 2,
            Self::Four => 4,
        }
    }
}

/// How a kernel's threads cover a launch's work: the thread mapping and, for the item loop,
/// the access width (every other mapping accesses at the preferred width,
/// [`preferred_lanes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mapping {
    /// A grid-stride loop over work items, a (token, group of pairs) each, every item rotating
    /// the heads of its block row's chunk (`heads_per_chunk`), at this width.
    ItemLoop(Width),
    /// No loop: one thread per ([`ThreadHeads`] heads of one tensor, group) of each token, its
    /// loads issued before its position and cos/sin. The RoPE kernels take one head, for
    /// launches whose grid gives every head a block row of its own (`heads_per_chunk = 1`:
    /// decode steps and other small launches) and that copy no pass-through elements, on the
    /// item loop's grid. The fused kernels take two or four, on a grid of their own: one block
    /// row per token (`blockIdx.z * gridDim.y + blockIdx.y`), and on `blockIdx.x` the token's
    /// warps of q's threads, then k's, then v's (`q_warps`, `k_warps`, `v_warps` of
    /// [`crate::fused_kernel_params!`]; each tensor's `heads.div_ceil(U) * groups` threads
    /// form warps of their own) in blocks of at most [`TOKEN_HEADS_MAX_WARPS`] warps; at
    /// decode and prefill alike, where every tensor spans fewer than 2^32 elements and the
    /// tables fit [`planned_table_fits`].
    TokenHeads(ThreadHeads),
    /// The fused NeoX kernels of 16-bit elements and heads of [`ROWS_HEAD_DIM`] elements for
    /// sm_90 ([`FusedKernelName::rows`]): a persistent grid whose blocks walk tokens
    /// `blockIdx.x, blockIdx.x + gridDim.x, ..`; the bulk copy engine brings each token's rows
    /// of q's, k's and v's heads (each tensor's heads contiguous) into one of the block's
    /// shared buffers, up to [`ROWS_MAX_STAGES`] tokens ahead, and each warp takes
    /// [`ROWS_HEADS_STEPS`] steps over heads of one tensor, [`ROWS_GROUPS`] lanes per head
    /// and four pairs per lane. The RoPE kernels have none: a [`KernelName`] of this mapping
    /// names its one-head kernel.
    Rows,
}

impl Mapping {
    /// The item loop at the preferred width.
    pub const WIDE: Self = Self::ItemLoop(Width::Preferred);
    /// The item loop at a narrower width.
    pub const NARROW: Self = Self::ItemLoop(Width::Narrow);
    /// The RoPE kernels' one head per thread.
    pub const ONE_HEAD: Self = Self::TokenHeads(ThreadHeads::One);
    /// The fused kernels' two heads per thread.
    pub const TWO_HEADS: Self = Self::TokenHeads(ThreadHeads::Two);
    /// The fused kernels' four heads per thread.
    pub const FOUR_HEADS: Self = Self::TokenHeads(ThreadHeads::Four);

    /// A distinct number per mapping, the kernels' const generic parameter.
    pub const fn code(self) -> u8 {
        match self {
            Self::ItemLoop(Width::Preferred) => 0,
            Self::ItemLoop(Width::Narrow) => 1,
            Self::TokenHeads(ThreadHeads::One) => 2,
            Self::TokenHeads(ThreadHeads::Two) => 3,
            Self::TokenHeads(ThreadHeads::Four) => 4,
            Self::Rows => 5,
        }
    }
}

/// The head size of the rows kernels ([`Mapping::Rows`]).
pub const ROWS_HEAD_DIM: u32 = 128;

/// Lanes per head of the rows kernels ([`Mapping::Rows`]): four NeoX pairs each.
pub const ROWS_GROUPS: u32 = ROWS_HEAD_DIM / 8;

/// Heads a warp of the rows kernels ([`Mapping::Rows`]) holds per step.
pub const ROWS_HEADS_PER_STEP: u32 = 32 / ROWS_GROUPS;

/// Steps over heads each warp of the rows kernels ([`Mapping::Rows`]) takes per token, so
/// `ROWS_HEADS_STEPS *` [`ROWS_HEADS_PER_STEP`] heads per warp.
pub const ROWS_HEADS_STEPS: u32 = 4;

/// The most warps in one block of the rows kernels ([`Mapping::Rows`]): every warp of a token
/// and the producer warp.
pub const ROWS_MAX_WARPS: u32 = 24;

/// The most token buffers a block of the rows kernels ([`Mapping::Rows`]) holds (one mbarrier
/// each, in the [`ROWS_DATA_OFFSET`] bytes before the buffers).
pub const ROWS_MAX_STAGES: u32 = 4;

/// Bytes after the rows in each token buffer of the rows kernels ([`Mapping::Rows`]): the
/// token's cos and sin in `f32`, `ROWS_HEAD_DIM / 2` pairs.
pub const ROWS_COS_SIN_BYTES: u32 = 4 * ROWS_HEAD_DIM;

/// Where the rows kernels' token buffers start in their dynamic shared memory (bytes): the
/// mbarriers come first, a "full" and an "empty" one per buffer. The kernels find their
/// buffers' count from the launch's dynamic shared memory: `(bytes - ROWS_DATA_OFFSET) /
/// (bytes of a token's rows +` [`ROWS_COS_SIN_BYTES`]`)`.
pub const ROWS_DATA_OFFSET: u32 = 128;

/// Elements per access at the preferred width ([`Width::Preferred`]): 16 bytes, except for NeoX
/// pairs of 16-bit elements, 8 bytes. A work item then rotates at most four pairs per head, so a token
/// has twice as many items, which fills the GPU better at prefill than 16-byte accesses
/// (docs/perf/decisions.md).
pub const fn preferred_lanes(style: RopeStyle, elem_size: usize) -> u32 {
    match (style, elem_size) {
        (RopeStyle::Neox, 2) => 4,
        _ => (16 / elem_size) as u32,
    }
}

/// Where pass-through group `g` (the `g`-th run of `lanes` elements of a head outside the
/// rotated slice `rotary_offset..rotary_offset + rotary_dim`, in element order) starts,
/// relative to the tensors' kernel pointers, which point `rotary_offset` elements into each
/// head: elements `0..rotary_offset` come first, then those after the slice. With
/// `rotary_offset`, `rotary_dim` and `head_dim - rotary_dim` multiples of `lanes` (as the host's
/// choice of `lanes` ensures), the groups `0..(head_dim - rotary_dim) / lanes` cover every
/// pass-through element once, each group aligned to `lanes` elements.
#[inline(always)]
pub const fn pass_through_start(g: u32, lanes: u32, rotary_offset: u32, rotary_dim: u32) -> isize {
    let p = g * lanes;
    let skip = if p < rotary_offset { 0 } else { rotary_dim };
    (p + skip) as isize - rotary_offset as isize
}

/// The axis whose position pair `j` of a multi-axis launch takes: the map's entry, clamped to
/// the last of `n_axes` axes (a malformed device map then reads inside the positions array).
#[inline(always)]
pub fn clamped_axis(entry: u8, n_axes: u32) -> u32 {
    u32::from(entry).min(n_axes.saturating_sub(1))
}

/// The position axis of each rotating work-item group of a multi-axis launch whose groups
/// each lie on one axis, for [`PositionCode::GroupAxesI32`]: group `g` (pairs
/// `g * pairs..(g + 1) * pairs`) on axis `bits >> 2 g & 3`, at most [`GroupAxes::MAX_GROUPS`]
/// groups. Passed as the kernel's `pos_base`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupAxes(u64);

impl GroupAxes {
    /// The most groups `pos_base` holds, two bits each.
    pub const MAX_GROUPS: usize = 32;

    /// The groups of `pairs` consecutive pairs of `map` (pair `j` on axis `map[j]`); `None`
    /// when the pairs of some group take different axes, `map` does not split into at most
    /// [`GroupAxes::MAX_GROUPS`] whole groups, or an axis is above 3.
    #[inline]
    pub fn new(map: &[u8], pairs: usize) -> Option<Self> {
        if pairs == 0 || !map.len().is_multiple_of(pairs) || map.len() / pairs > Self::MAX_GROUPS {
            return None;
        }
        let mut bits = 0u64;
        for (g, group) in map.chunks(pairs).enumerate() {
            let axis = group[0];
            if u32::from(axis) >= MAX_AXES || group.iter().any(|&a| a != axis) {
                return None;
            }
            bits |= u64::from(axis) << (2 * g);
        }
        Some(Self(bits))
    }

    /// The kernel's `pos_base`.
    #[inline]
    pub fn to_base(self) -> i64 {
        self.0 as i64
    }

    /// The axis of rotating group `group` (below [`GroupAxes::MAX_GROUPS`]) under the groups
    /// encoded in `base` ([`GroupAxes::to_base`]).
    #[inline(always)]
    pub fn axis_in_base(base: i64, group: u32) -> u32 {
        (base as u64).wrapping_shr(2 * group) as u32 & 3
    }
}

/// A context-parallel split of packed sequences, as Megatron-LM and Transformer Engine balance
/// causal attention over `size` ranks: each whole sequence (of a length divisible by
/// `2 * size`) is cut into `2 * size` equal chunks and rank `rank` holds chunks `rank` and
/// `2 * size - 1 - rank`, back to back, so its local part of a sequence of whole length `L` has
/// `L / size` tokens, the first half at positions `rank * L / (2 size) + s` and the second at
/// `(2 size - 1 - rank) * L / (2 size) + s - L / (2 size)`. The rank's packed tensor holds
/// the local parts of all sequences; `cu_seqlens` are the whole sequences' boundaries (local
/// ones times `size`). Passed in `pos_base` of the varlen position codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ContextParallelSplit {
    /// Ranks, at least 1 (1: no split).
    pub size: NonZeroU32,
    /// This rank, below `size` (the host checks; a larger one only gives wrong positions).
    pub rank: u32,
}

impl ContextParallelSplit {
    /// No split: positions as [`PositionCode::VarlenI32`] gives them without one.
    pub const NONE: Self = Self {
        size: NonZeroU32::MIN,
        rank: 0,
    };

    /// The kernel's `pos_base`: `size` in the high 32 bits, `rank` in the low ones.
    #[inline(always)]
    pub const fn to_base(self) -> i64 {
        ((self.size.get() as u64) << 32 | self.rank as u64) as i64
    }

    /// Decodes `pos_base`; a size of 0 (a base of 0) is no split.
    #[inline(always)]
    pub fn from_base(base: i64) -> Self {
        let size = NonZeroU32::new((base as u64 >> 32) as u32).unwrap_or(NonZeroU32::MIN);
        Self {
            size,
            rank: base as u32,
        }
    }

    /// The largest whole-sequence boundary `c` that still starts a local part at or before
    /// local token `t`: `c / size <= t` exactly when `c <= (t + 1) * size - 1` (for `c >= 0`),
    /// so the search over `cu_seqlens` needs no division (for one rank, `t` itself).
    #[inline(always)]
    pub fn search_bound(self, t: u64) -> i64 {
        let size = u64::from(self.size.get());
        (t.wrapping_add(1).wrapping_mul(size).wrapping_sub(1)) as i64
    }

    /// The position of local token `t` in the sequence whose whole boundaries are
    /// `start..end` (see the type's documentation). Malformed boundaries (negative, decreasing,
    /// lengths not divisible by `2 * size`) give wrong positions, never a trap.
    #[inline(always)]
    pub fn position(self, t: u64, start: i64, end: i64) -> i64 {
        let size = NonZeroU64::from(self.size);
        let local = |c: i64| (c as u64 / size) as i64;
        let (first, last) = (local(start), local(end));
        let s = (t as i64).wrapping_sub(first);
        let chunk = last.wrapping_sub(first) / 2;
        let rank = i64::from(self.rank);
        let chunk_index = if s < chunk {
            rank
        } else {
            // The second chunk, `2 size - 1 - rank`, minus the first chunk's length already
            // counted in `s`.
            2 * i64::from(self.size.get()) - 2 - rank
        };
        s.wrapping_add(chunk_index.wrapping_mul(chunk))
    }
}

/// One kernel entry point: `rope_{style}_{source}_{dtype}`, for example `rope_neox_theta_f32`
/// with the suffix `_narrow` for [`Mapping::NARROW`] and `_one_head` for [`Mapping::ONE_HEAD`].
/// Every combination exists; all have the parameter list of [`crate::plain_kernel_params!`]. Both
/// directions run the same kernel: the direction is its `sin_sign` argument
/// ([`Direction::sin_sign`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelName {
    /// Pairing.
    pub style: RopeStyle,
    /// Sin/cos source.
    pub source: SinCosSource,
    /// Element type.
    pub dtype: DType,
    /// Thread mapping and access width.
    pub mapping: Mapping,
}

/// Calls `$m!` with every kernel as
/// `wide symbol, [narrow symbol], one-head symbol: Style, Source, DType, storage type;`:
/// the one list from which the kernel crate defines the entry points and [`KernelName`] its
/// table, so the two cannot disagree. The brackets are empty where the wide kernel takes the
/// narrow accesses too ([`KernelName::narrow_in_wide`]).
macro_rules! for_each_kernel {
    ($m:ident) => {
        $m! {
            rope_interleaved_table_f32, [], rope_interleaved_table_f32_one_head: Interleaved, Table, F32, f32;
            rope_interleaved_theta_f32, [rope_interleaved_theta_f32_narrow], rope_interleaved_theta_f32_one_head: Interleaved, Theta, F32, f32;
            rope_neox_table_f32, [], rope_neox_table_f32_one_head: Neox, Table, F32, f32;
            rope_neox_theta_f32, [rope_neox_theta_f32_narrow], rope_neox_theta_f32_one_head: Neox, Theta, F32, f32;
            rope_interleaved_table_f16, [rope_interleaved_table_f16_narrow], rope_interleaved_table_f16_one_head: Interleaved, Table, F16, Half;
            rope_interleaved_theta_f16, [rope_interleaved_theta_f16_narrow], rope_interleaved_theta_f16_one_head: Interleaved, Theta, F16, Half;
            rope_neox_table_f16, [rope_neox_table_f16_narrow], rope_neox_table_f16_one_head: Neox, Table, F16, Half;
            rope_neox_theta_f16, [rope_neox_theta_f16_narrow], rope_neox_theta_f16_one_head: Neox, Theta, F16, Half;
            rope_interleaved_table_bf16, [rope_interleaved_table_bf16_narrow], rope_interleaved_table_bf16_one_head: Interleaved, Table, BF16, Bf16;
            rope_interleaved_theta_bf16, [rope_interleaved_theta_bf16_narrow], rope_interleaved_theta_bf16_one_head: Interleaved, Theta, BF16, Bf16;
            rope_neox_table_bf16, [rope_neox_table_bf16_narrow], rope_neox_table_bf16_one_head: Neox, Table, BF16, Bf16;
            rope_neox_theta_bf16, [rope_neox_theta_bf16_narrow], rope_neox_theta_bf16_one_head: Neox, Theta, BF16, Bf16;
        }
    };
}
#[cfg_attr(not(target_arch = "nvptx64"), allow(unused_imports))]
pub(crate) use for_each_kernel;

/// Calls `$m!` with `{ $($pass)* }` and the parameters the RoPE and the fused entry points share,
/// in launch order, as `name: kind` pairs, followed by `$($more)*` (the RoPE entry points add
/// [`crate::plain_kernel_params!`]'s `sin_sign`, the fused ones
/// [`crate::fused_kernel_params!`]'s). This list is the one definition of that part of the kernels' ABI: the kernel crate generates each entry
/// point's signature and its parameter struct from it, and `rope-host` the host struct whose
/// bytes a launch passes, so the two sides cannot disagree on order or type.
///
/// Kinds, with their device and host types: `elem_ptr` (`*const T` / `u64`), `elem_ptr_mut`
/// (`*mut T` / `u64`), `f64_ptr` (`*const f64` / `u64`), `byte_ptr` (`*const u8` / `u64`),
/// `nonzero_u32` (`NonZeroU32` / `u32`), and the scalars `u32`, `u64`, `i64`, `f32` as
/// themselves. `T` is the kernel's element type.
///
/// Parameters, per tensor `n` in 0 (q) and 1 (k, `heads1 = 0` when absent): `xn`, `outn`,
/// `headsn` and the element strides `xn_stride_*`, `outn_stride_*` of
/// `[batch, seq, heads, head_dim]` (last dimension contiguous). `tokens = batch * seq`; `seq`
/// and `groups` with the magic numbers and shifts of their [`crate::divide::Divisor`]s;
/// `heads_per_chunk`: heads (of both tensors together) handled by one `blockIdx.y`;
/// `groups = rot_groups + pass-through groups`, `rot_groups = half / pairs_per_item` with
/// `pairs_per_item = lanes` (NeoX) or `lanes / 2` (interleaved), and
/// `(head_dim - rotary_dim) / lanes` pass-through groups out of place (0 in place);
/// `rotary_offset`: the first rotated feature of a head (DeepSeek's MLA rotates a slice after the
/// others), a multiple of `lanes`; `xn` and `outn` then point `rotary_offset` elements into their
/// first head, and pass-through elements are addressed relative to that (elements
/// `0..rotary_offset` and `rotary_offset + rotary_dim..head_dim` pass through); `cos`, `sin`,
/// `table_stride` (elements per row), `table_rows` and `table_elem` (a [`TableElem`] code, the
/// tables' element type) for table kernels; `inv_freq`,
/// `angle_mode` (a [`crate::math::AngleMode`] code) and `cs_scale` (the attention factor
/// multiplying cos and sin) for computed sin/cos (the other source's pointers are unused and
/// may be null); `position_code`, a [`PositionCode`], with `pos_ptr`, `pos_aux`, `pos_count` and
/// `pos_base`.
#[macro_export]
macro_rules! rope_kernel_params {
    ($m:ident { $($pass:tt)* } $($more:tt)*) => {
        $m! {
            { $($pass)* }
            x0: elem_ptr,
            out0: elem_ptr_mut,
            heads0: u32,
            x0_stride_batch: u64,
            x0_stride_seq: u64,
            x0_stride_head: u64,
            out0_stride_batch: u64,
            out0_stride_seq: u64,
            out0_stride_head: u64,
            x1: elem_ptr,
            out1: elem_ptr_mut,
            heads1: u32,
            x1_stride_batch: u64,
            x1_stride_seq: u64,
            x1_stride_head: u64,
            out1_stride_batch: u64,
            out1_stride_seq: u64,
            out1_stride_head: u64,
            tokens: u64,
            seq: nonzero_u32,
            seq_magic: u32,
            seq_shift: u32,
            heads_per_chunk: u32,
            groups: nonzero_u32,
            groups_magic: u32,
            groups_shift: u32,
            rot_groups: u32,
            half: u32,
            rotary_dim: u32,
            rotary_offset: u32,
            lanes: u32,
            cos: byte_ptr,
            sin: byte_ptr,
            table_stride: u64,
            table_rows: u64,
            table_elem: u32,
            inv_freq: f64_ptr,
            angle_mode: u32,
            cs_scale: f32,
            position_code: u32,
            pos_ptr: byte_ptr,
            pos_aux: byte_ptr,
            pos_count: u32,
            pos_base: i64,
            $($more)*
        }
    };
}

/// Calls `$m!` with `{ $($pass)* }` and the parameter list of every RoPE entry point
/// (`rope-kernels/src/rope.rs`): [`crate::rope_kernel_params!`]'s, then `sin_sign`, `+1.0` for the
/// forward rotation and `-1.0` for its gradient ([`Direction::sin_sign`]), which multiplies
/// every `sin` (so one kernel serves both directions), and `read_ahead`: 1 where the one-head
/// kernels ([`Mapping::ONE_HEAD`]) may read positions, frequencies and tables before they wait
/// for the grid before them, and let the grid after them start at once
/// (`griddepcontrol.launch_dependents`); 0 for every other launch, and the other kernels do
/// not read it. Last `common_launch`: 1 where a one-head launch is decode's common launch
/// ([`common_one_head_launch`]), on which the one-head kernels of tables run the copy of their
/// body compiled for it (those of computed sin/cos recognise the launch themselves); 0 for
/// every other launch (the other kernels do not read it). The fused kernels take
/// [`crate::rope_kernel_params!`]'s, and their own `sin_sign` last
/// ([`crate::fused_kernel_params!`]).
#[macro_export]
macro_rules! plain_kernel_params {
    ($m:ident { $($pass:tt)* }) => {
        $crate::rope_kernel_params! {
            $m { $($pass)* }
            sin_sign: f32,
            read_ahead: u32,
            common_launch: u32,
        }
    };
}

/// Calls `$m!` with `{ $($pass)* }` and the parameter list of every table-building entry point
/// (`rope-kernels/src/table.rs`), as [`crate::rope_kernel_params!`] does for the RoPE kernels.
///
/// `cos` and `sin` receive `rows` rows of `row_stride >= half` elements of `dtype` (a
/// [`DType`] code); `inv_freq` holds `half` `f64`; `angle_mode` is a [`crate::math::AngleMode`]
/// code and `scale` multiplies both.
#[macro_export]
macro_rules! table_kernel_params {
    ($m:ident { $($pass:tt)* }) => {
        $m! {
            { $($pass)* }
            cos: byte_ptr_mut,
            sin: byte_ptr_mut,
            dtype: u32,
            rows: u64,
            half: nonzero_u32,
            row_stride: u64,
            inv_freq: f64_ptr,
            angle_mode: u32,
            scale: f32,
        }
    };
}

/// The device type of a parameter kind of [`crate::rope_kernel_params!`] for element type `$t`.
#[macro_export]
macro_rules! device_param_type {
    (elem_ptr, $t:ty) => { *const $t };
    (elem_ptr_mut, $t:ty) => { *mut $t };
    (f64_ptr, $t:ty) => { *const f64 };
    (byte_ptr, $t:ty) => { *const u8 };
    (byte_ptr_mut, $t:ty) => { *mut u8 };
    (nonzero_u32, $t:ty) => { ::core::num::NonZeroU32 };
    (u32, $t:ty) => { u32 };
    (u64, $t:ty) => { u64 };
    (i64, $t:ty) => { i64 };
    (f32, $t:ty) => { f32 };
}

/// The host type of a parameter kind of [`crate::rope_kernel_params!`]: device pointers as `u64`
/// (`CUdeviceptr`), `NonZeroU32` as `u32`, scalars as themselves. Each has the size and
/// alignment of its device type, so the launch copies it bit for bit.
#[macro_export]
macro_rules! host_param_type {
    (elem_ptr) => {
        u64
    };
    (elem_ptr_mut) => {
        u64
    };
    (f64_ptr) => {
        u64
    };
    (byte_ptr) => {
        u64
    };
    (byte_ptr_mut) => {
        u64
    };
    (nonzero_u32) => {
        u32
    };
    (u32) => {
        u32
    };
    (u64) => {
        u64
    };
    (i64) => {
        i64
    };
    (f32) => {
        f32
    };
}

impl KernelName {
    /// Whether the wide kernel of these tensors and sin/cos takes the narrow accesses too, so
    /// that there is no `_narrow` entry point: for `f32` tensors with tables, whose narrow
    /// paths fit beside the wide one in its registers without spilling. Elsewhere they made
    /// the wide kernel spill, so they have kernels of their own (docs/perf/decisions.md).
    pub const fn narrow_in_wide(dtype: DType, source: SinCosSource) -> bool {
        matches!((dtype, source), (DType::F32, SinCosSource::Table))
    }

    /// The blocks per multiprocessor this kernel's launch bounds promise (its `.minnctapersm`):
    /// 1280 threads' worth for the wide NeoX kernels of 16-bit elements, which then fit in 48
    /// registers without spilling (partial rotary then runs clearly faster, the full-width
    /// cases at most a little slower), [`MIN_BLOCKS_PER_SM`] (1024 threads) otherwise. f16 with
    /// computed sin/cos stays at 1024 threads: at 48 registers it spilled and ran slower
    /// (docs/perf/decisions.md).
    pub const fn min_blocks_per_sm(self) -> u32 {
        match (self.style, self.mapping, self.dtype, self.source) {
            (RopeStyle::Neox, Mapping::WIDE, DType::BF16, _)
            | (RopeStyle::Neox, Mapping::WIDE, DType::F16, SinCosSource::Table) => {
                1280 / BLOCK_THREADS
            }
            _ => MIN_BLOCKS_PER_SM,
        }
    }
}

/// Defines [`KernelName::ALL`] and [`KernelName::symbol`] from the kernel list.
macro_rules! kernel_table {
    (
        $($sym:ident, [$($narrow:ident)?], $one_head:ident:
            $style:ident, $src:ident, $dt:ident, $t:ty;)*
    ) => {
        impl KernelName {
            /// Every kernel, in the order the host loads them.
            pub const ALL: [KernelName; [$(stringify!($sym), $(stringify!($narrow),)?
                stringify!($one_head)),*].len()] = [$(
                KernelName {
                    style: RopeStyle::$style,
                    source: SinCosSource::$src,
                    dtype: DType::$dt,
                    mapping: Mapping::WIDE,
                },
                $(KernelName {
                    style: RopeStyle::$style,
                    source: SinCosSource::$src,
                    dtype: DType::$dt,
                    mapping: kernel_table!(@narrow $narrow),
                },)?
                KernelName {
                    style: RopeStyle::$style,
                    source: SinCosSource::$src,
                    dtype: DType::$dt,
                    mapping: Mapping::ONE_HEAD,
                },
            )*];

            /// The exported PTX symbol; the match is exhaustive, so an option without a kernel
            /// does not compile. (Inline, as every host-side function here: the kernels' PTX
            /// holds no code of it.)
            #[inline]
            pub const fn symbol(self) -> &'static str {
                match (self.style, self.source, self.dtype, self.mapping) {
                    // The RoPE kernels take one head per thread.
                    (_, _, _, Mapping::TWO_HEADS | Mapping::FOUR_HEADS | Mapping::Rows) => {
                        KernelName {
                            mapping: Mapping::ONE_HEAD,
                            ..self
                        }
                        .symbol()
                    }
                    $(
                        (RopeStyle::$style, SinCosSource::$src, DType::$dt, Mapping::WIDE) => {
                            stringify!($sym)
                        }
                        $((RopeStyle::$style, SinCosSource::$src, DType::$dt, Mapping::NARROW) => {
                            stringify!($narrow)
                        })?
                        (RopeStyle::$style, SinCosSource::$src, DType::$dt, Mapping::ONE_HEAD) => {
                            stringify!($one_head)
                        }
                    )*
                    // The narrow accesses of kernels without a narrow entry point.
                    (_, _, _, Mapping::NARROW) => KernelName {
                        mapping: Mapping::WIDE,
                        ..self
                    }
                    .symbol(),
                }
            }
        }
    };
    (@narrow $narrow:ident) => {
        Mapping::NARROW
    };
}
for_each_kernel!(kernel_table);

/// The exported symbol of the table builder (`rope-kernels/src/table.rs`), one kernel for every
/// element type (its `dtype` argument, [`crate::table_kernel_params!`]).
pub const TABLE_KERNEL: &str = "rope_table";

/// Every exported symbol of the PTX module: the RoPE kernels, the table builder, the fused
/// kernels, the QK-norm + RoPE backward's, then the across-heads norm + RoPE kernels.
pub fn all_symbols() -> impl Iterator<Item = &'static str> {
    KernelName::ALL
        .into_iter()
        .map(KernelName::symbol)
        .chain([TABLE_KERNEL])
        .chain(
            FusedKernelName::ALL
                .into_iter()
                .map(FusedKernelName::symbol),
        )
        .chain(
            NormGradKernelName::ALL
                .into_iter()
                .map(NormGradKernelName::symbol),
        )
        .chain(NormGradKernelName::WEIGHTS)
        .chain(
            NormAcrossKernelName::ALL
                .into_iter()
                .map(NormAcrossKernelName::symbol),
        )
}

/// The normalisation a fused kernel applies to each q and k head before rotating it, passed as
/// its `norm` argument.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormCode {
    /// No normalisation.
    None = 0,
    /// RMS normalisation times the weight: `x_e / sqrt(mean(x^2) + eps) * w_e`.
    Rms = 1,
    /// RMS normalisation times one plus the weight (Gemma): `... * (1 + w_e)`.
    RmsOnePlus = 2,
}

impl NormCode {
    /// Decodes a kernel argument; `None` for an unknown code.
    #[inline(always)]
    pub fn from_u32(code: u32) -> Option<Self> {
        Some(match code {
            0 => Self::None,
            1 => Self::Rms,
            2 => Self::RmsOnePlus,
            _ => return None,
        })
    }
}

/// How a fused kernel stores an output, passed as its `q_format`, `k_format` and
/// `cache_format` arguments. An FP8 store rounds the value times its multiplier (`1 / scale`
/// with a scale array, else the launch's multiplier argument) to nearest even, saturating.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FormatCode {
    /// The tensors' element type.
    Elem = 0,
    /// FP8 E4M3 (`e4m3fn`), saturated at ±448 ([`crate::math::f32_to_e4m3`]).
    E4m3 = 1,
    /// FP8 E5M2, saturated at ±57344 ([`crate::math::f32_to_e5m2`]).
    E5m2 = 2,
    /// NVFP4 (a cache's format, in the entry points of [`FusedForms::Nvfp4`] alone, which store
    /// their cache so whatever the code; see [`crate::nvfp4_kernel_params!`]).
    Nvfp4 = 3,
}

/// Where a fused kernel finds each token's cache slot, passed as its `slot_mode` argument.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotCode {
    /// `slots[t]` (`i64` where `slots_wide` is 1, else `i32`): vLLM's `slot_mapping`.
    Slots = 0,
    /// FlashInfer's page table (see [`crate::fused_kernel_params!`]).
    PageTable = 1,
}

/// The 16-byte accesses of a non-rotary part a thread of FlashInfer's forms' kernels takes,
/// all loaded before any is stored (see [`crate::fused_forms_kernel_params!`]): one access per
/// thread kept too few bytes in flight to reach a copy's speed on parts of hundreds of features
/// (MLA's 512).
pub const NOPE_ACCESSES_PER_THREAD: u32 = 4;

/// Where a fused launch of FlashInfer's forms stores its cached non-rotary parts: the bits of its
/// `nope_cached` argument (see [`crate::fused_forms_kernel_params!`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NopeCached(pub u32);

impl NopeCached {
    /// No part is cached: k's part (if any) goes to `k_nope_out` at its token and head strides.
    pub const NONE: Self = Self(0);
    /// k's part goes into a cache at `k_nope_out`, by the token's slot, at the
    /// `nope_cache_stride_*` strides.
    pub const K: u32 = 1;
    /// v's heads hold `head_dim + nope_dim` features: those from `head_dim` on go into `v_cache`
    /// at element `head_dim` of the slot's head, at the cache's strides.
    pub const V: u32 = 2;

    /// Whether `bit` is set.
    pub const fn has(self, bit: u32) -> bool {
        self.0 & bit != 0
    }
}

/// Whether the fused token-heads kernels ([`Mapping::TokenHeads`]) may read a launch's tables,
/// which they read with 32-bit row offsets and, where an item's `pairs` entries of `entry_bytes` make 4, 8 or 16 bytes, with one
/// vector access per table and no alignment test: each table spans fewer than 2^32 elements
/// (`rows * stride`), and for such vectors both tables' addresses (`cos`, `sin`, in
/// bytes) and the row stride in bytes are multiples of the vector's size. Sin/cos computed in
/// the kernels have no tables and always fit (the host passes `rows` 0).
pub const fn planned_table_fits(
    (cos, sin): (u64, u64),
    (rows, stride): (u64, u64),
    (pairs, entry_bytes): (u64, u64),
) -> bool {
    let bytes = pairs * entry_bytes;
    let below_2_32 = match rows.checked_mul(stride) {
        Some(elements) => elements < 1 << 32,
        None => false,
    };
    below_2_32
        && (!planned_table_vectors(pairs, entry_bytes)
            || (cos | sin | stride.wrapping_mul(entry_bytes)) % bytes == 0)
}

/// Whether an item's `pairs` table entries of `entry_bytes` each make one vector access per
/// table in the kernels of [`planned_table_fits`]: 4, 8 or 16 bytes.
pub const fn planned_table_vectors(pairs: u64, entry_bytes: u64) -> bool {
    matches!(pairs * entry_bytes, 4 | 8 | 16)
}

/// Whether a one-head launch ([`Mapping::ONE_HEAD`]) is decode's common launch, whose kernel
/// runs a copy of its body that reads neither the position code nor the sin/cos source's
/// options again: positions are `i64` ids per token ([`PositionCode::IdsI64PerRow`], which the
/// row offsets of one-token rows also become), and either sin/cos are computed with `f64`
/// angles ([`crate::math::AngleMode::Exact`]) or the tables hold the tensors' element type
/// (`table_elem_bytes == elem_bytes`) and fit [`planned_table_fits`] for the item's `pairs`
/// entries, so that their rows are read with 32-bit offsets and no alignment test.
/// `(cos, sin)`, `(rows, stride)` and `angle_mode` are the launch's table and angle arguments
/// ([`crate::plain_kernel_params!`]).
pub const fn common_one_head_launch(
    position_code: u32,
    source: SinCosSource,
    angle_mode: u32,
    ((cos, sin), (rows, stride)): ((u64, u64), (u64, u64)),
    (pairs, elem_bytes, table_elem_bytes): (u64, u64, u64),
) -> bool {
    position_code == PositionCode::IdsI64PerRow as u32
        && match source {
            SinCosSource::Table => {
                table_elem_bytes == elem_bytes
                    && planned_table_fits((cos, sin), (rows, stride), (pairs, elem_bytes))
            }
            SinCosSource::Theta => angle_mode == crate::math::AngleMode::Exact as u32,
        }
}

/// One fused entry point (`rope-kernels/src/fused.rs`): `rope_fused_{style}_{source}_{dtype}`,
/// for example `rope_fused_neox_theta_bf16`, with the suffix `_narrow` for [`Mapping::NARROW`],
/// `_two_heads` for [`Mapping::TWO_HEADS`] (a thread per two heads and one access: launches at
/// the preferred width whose tensors span fewer than 2^32 elements and whose tables fit
/// [`planned_table_fits`]), `_four_heads` for [`Mapping::FOUR_HEADS`] and `_rows` for
/// [`Mapping::Rows`] (NeoX, `f16` and `bf16` only); the two-heads kernels of FlashInfer's
/// forms ([`FusedForms::FlashInfer`]) end in `_two_heads_flashinfer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FusedKernelName {
    /// Pairing.
    pub style: RopeStyle,
    /// Sin/cos source.
    pub source: SinCosSource,
    /// Element type of the inputs.
    pub dtype: DType,
    /// Thread mapping and access width.
    pub mapping: Mapping,
    /// Which stores the kernel has.
    pub forms: FusedForms,
}

/// The stores a fused kernel has beyond the tensors' type and FP8 E4M3 of scale arrays into
/// slot-mapped caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FusedForms {
    /// None beyond those.
    Plain,
    /// FlashInfer's forms too: page-table caches, E5M2, multipliers by value, an FP8 k output;
    /// the two-heads mapping only, with [`crate::fused_forms_kernel_params!`]'s parameters.
    FlashInfer,
    /// Heads longer than the rotation (partial rotary with a norm, a cache or FP8): the
    /// features past `rotary_dim` normalised and stored as the others, unrotated; the
    /// two-heads mapping (`_two_heads_partial`), and for 16-bit elements the four-heads one
    /// (`_four_heads_partial`, at 72 registers: at 64 four heads a thread spilled).
    Partial,
    /// An NVFP4 cache ([`NVFP4_BLOCK`]-element blocks of FP4 E2M1 values, each block with an
    /// FP8 E4M3 scale, under a global scale): the four-heads mapping only (`_four_heads_nvfp4`,
    /// with [`crate::nvfp4_kernel_params!`]'s parameters), so that the blocks' maxima and the
    /// conversions weigh on no other launch.
    Nvfp4,
    /// A per-head norm over more than a warp's accesses of a head (64 or 128 groups: heads of
    /// 512 16-bit elements, `f32` heads of 256 interleaved or of 512), summed across the head's
    /// warps: the four-heads mapping only (`_four_heads_long_norm`), so that the cross-warp sum
    /// weighs on no other launch.
    LongNorm,
}

/// The symbol [`FusedKernelName::symbol`] gives NVFP4 kernels that do not exist (mappings other
/// than four heads): no build holds it.
pub const NVFP4_UNAVAILABLE: &str = "rope_fused_nvfp4_unavailable";

/// The symbol [`FusedKernelName::symbol`] gives kernels of norms across a head's warps that do
/// not exist (mappings other than four heads): no build holds it.
pub const LONG_NORM_UNAVAILABLE: &str = "rope_fused_long_norm_unavailable";

/// Elements under one NVFP4 block scale: a cache head's elements `16 b .. 16 b + 16` share
/// scale `b`.
pub const NVFP4_BLOCK: u32 = 16;

impl FusedKernelName {
    /// The registers per thread the token-heads and rows kernels ([`Mapping::TokenHeads`],
    /// [`Mapping::Rows`]) are held to (their `.maxnreg`, with `.maxntid` of
    /// [`TOKEN_HEADS_MAX_WARPS`] warps), `None` for the other kernels: 48 for the NeoX
    /// two-heads kernels of 16-bit elements, whose loads are all they keep in flight, so that
    /// more threads hold more bytes in flight (no spills on sm_90); 64 for the other two-heads
    /// kernels (the interleaved 16-bit ones spilled at 48) and for the four-heads kernels (no
    /// spills on sm_90 but a few bytes in the `f32`-table ones once a warp barrier precedes the
    /// norm's shuffles; at 72, five blocks of five warps per multiprocessor instead of six,
    /// norm + rope was slower at prefill); 80 for the four-heads kernels of NVFP4 caches, whose
    /// blocks' maxima (held from the warp's shuffles to the stores), scales and codes of all
    /// four heads at once spilled below (sm_90); 72 for the four-heads kernels of norms across
    /// a head's warps ([`FusedForms::LongNorm`]), which spilled at 64; 72 for the rows kernels ([`Mapping::Rows`], `.maxntid`
    /// of [`ROWS_MAX_WARPS`] warps), which spill nothing there, where at 64 they spilled and ran
    /// the FP8 prefill slower, and four blocks of up to seven warps still fit an sm_90
    /// multiprocessor's 64 Ki registers (docs/perf/decisions.md).
    pub const fn token_heads_registers(self) -> Option<u32> {
        match self.mapping {
            Mapping::TWO_HEADS if self.neox_16_bit() => Some(48),
            Mapping::FOUR_HEADS if matches!(self.forms, FusedForms::Nvfp4) => Some(80),
            Mapping::FOUR_HEADS
                if matches!(self.forms, FusedForms::LongNorm | FusedForms::Partial) =>
            {
                Some(72)
            }
            Mapping::TWO_HEADS | Mapping::FOUR_HEADS => Some(64),
            Mapping::Rows => Some(72),
            _ => None,
        }
    }

    /// Whether this is a kernel of NeoX pairs of 16-bit elements without FlashInfer's forms:
    /// those whose two-heads kernels keep a lower register cap and that have rows kernels.
    const fn neox_16_bit(self) -> bool {
        matches!(
            (self.style, self.dtype, self.forms),
            (RopeStyle::Neox, DType::F16 | DType::BF16, FusedForms::Plain)
        )
    }

    /// The rows kernel ([`Mapping::Rows`]) of this two-heads kernel, if it has one: the NeoX
    /// kernels of 16-bit elements without FlashInfer's forms.
    pub const fn rows(self) -> Option<Self> {
        match self.mapping {
            Mapping::TWO_HEADS if self.neox_16_bit() => Some(FusedKernelName {
                mapping: Mapping::Rows,
                ..self
            }),
            _ => None,
        }
    }

    /// The threads one block of this kernel may hold (its `.maxntid`), for the token-heads and
    /// rows kernels.
    pub const fn max_block_threads(self) -> u32 {
        match self.mapping {
            Mapping::Rows => 32 * ROWS_MAX_WARPS,
            _ => 32 * TOKEN_HEADS_MAX_WARPS,
        }
    }

    /// The four-heads kernel ([`Mapping::FOUR_HEADS`]) of this two-heads kernel, if it has one:
    /// every pairing and element type of whole heads without FlashInfer's forms, and partial
    /// heads of 16-bit elements (docs/perf/decisions.md).
    pub const fn four_heads(self) -> Option<Self> {
        match (self.mapping, self.forms, self.dtype) {
            (Mapping::TWO_HEADS, FusedForms::Plain, _)
            | (Mapping::TWO_HEADS, FusedForms::Partial, DType::F16 | DType::BF16) => {
                Some(FusedKernelName {
                    mapping: Mapping::FOUR_HEADS,
                    ..self
                })
            }
            _ => None,
        }
    }
}

/// Calls `$m!` with every fused kernel as `wide symbol, narrow symbol, two-heads symbol,
/// two-heads symbol of FlashInfer's forms: Style, Source, DType, storage type;`, then `@four_heads` and every four-heads kernel as
/// `symbol: Style, Source, DType, storage type;`, then `@rows` and every rows kernel (NeoX) as
/// `symbol: Source, DType, storage type;`, then `@partial` and every two-heads kernel of partial
/// heads ([`FusedForms::Partial`]) as `symbol: Style, Source, DType, storage type;`, then
/// `@partial_four` and every four-heads kernel of partial heads alike, then
/// `@nvfp4` and every four-heads kernel of NVFP4 caches ([`FusedForms::Nvfp4`]) alike, then
/// `@long_norm` and every four-heads kernel of norms across a head's warps
/// ([`FusedForms::LongNorm`]) alike.
macro_rules! for_each_fused_kernel {
    ($m:ident) => {
        $m! {
            rope_fused_interleaved_table_f32, rope_fused_interleaved_table_f32_narrow, rope_fused_interleaved_table_f32_two_heads, rope_fused_interleaved_table_f32_two_heads_flashinfer: Interleaved, Table, F32, f32;
            rope_fused_interleaved_theta_f32, rope_fused_interleaved_theta_f32_narrow, rope_fused_interleaved_theta_f32_two_heads, rope_fused_interleaved_theta_f32_two_heads_flashinfer: Interleaved, Theta, F32, f32;
            rope_fused_neox_table_f32, rope_fused_neox_table_f32_narrow, rope_fused_neox_table_f32_two_heads, rope_fused_neox_table_f32_two_heads_flashinfer: Neox, Table, F32, f32;
            rope_fused_neox_theta_f32, rope_fused_neox_theta_f32_narrow, rope_fused_neox_theta_f32_two_heads, rope_fused_neox_theta_f32_two_heads_flashinfer: Neox, Theta, F32, f32;
            rope_fused_interleaved_table_f16, rope_fused_interleaved_table_f16_narrow, rope_fused_interleaved_table_f16_two_heads, rope_fused_interleaved_table_f16_two_heads_flashinfer: Interleaved, Table, F16, Half;
            rope_fused_interleaved_theta_f16, rope_fused_interleaved_theta_f16_narrow, rope_fused_interleaved_theta_f16_two_heads, rope_fused_interleaved_theta_f16_two_heads_flashinfer: Interleaved, Theta, F16, Half;
            rope_fused_neox_table_f16, rope_fused_neox_table_f16_narrow, rope_fused_neox_table_f16_two_heads, rope_fused_neox_table_f16_two_heads_flashinfer: Neox, Table, F16, Half;
            rope_fused_neox_theta_f16, rope_fused_neox_theta_f16_narrow, rope_fused_neox_theta_f16_two_heads, rope_fused_neox_theta_f16_two_heads_flashinfer: Neox, Theta, F16, Half;
            rope_fused_interleaved_table_bf16, rope_fused_interleaved_table_bf16_narrow, rope_fused_interleaved_table_bf16_two_heads, rope_fused_interleaved_table_bf16_two_heads_flashinfer: Interleaved, Table, BF16, Bf16;
            rope_fused_interleaved_theta_bf16, rope_fused_interleaved_theta_bf16_narrow, rope_fused_interleaved_theta_bf16_two_heads, rope_fused_interleaved_theta_bf16_two_heads_flashinfer: Interleaved, Theta, BF16, Bf16;
            rope_fused_neox_table_bf16, rope_fused_neox_table_bf16_narrow, rope_fused_neox_table_bf16_two_heads, rope_fused_neox_table_bf16_two_heads_flashinfer: Neox, Table, BF16, Bf16;
            rope_fused_neox_theta_bf16, rope_fused_neox_theta_bf16_narrow, rope_fused_neox_theta_bf16_two_heads, rope_fused_neox_theta_bf16_two_heads_flashinfer: Neox, Theta, BF16, Bf16;
            @four_heads
            rope_fused_interleaved_table_f32_four_heads: Interleaved, Table, F32, f32;
            rope_fused_interleaved_theta_f32_four_heads: Interleaved, Theta, F32, f32;
            rope_fused_neox_table_f32_four_heads: Neox, Table, F32, f32;
            rope_fused_neox_theta_f32_four_heads: Neox, Theta, F32, f32;
            rope_fused_interleaved_table_f16_four_heads: Interleaved, Table, F16, Half;
            rope_fused_interleaved_theta_f16_four_heads: Interleaved, Theta, F16, Half;
            rope_fused_neox_table_f16_four_heads: Neox, Table, F16, Half;
            rope_fused_neox_theta_f16_four_heads: Neox, Theta, F16, Half;
            rope_fused_interleaved_table_bf16_four_heads: Interleaved, Table, BF16, Bf16;
            rope_fused_interleaved_theta_bf16_four_heads: Interleaved, Theta, BF16, Bf16;
            rope_fused_neox_table_bf16_four_heads: Neox, Table, BF16, Bf16;
            rope_fused_neox_theta_bf16_four_heads: Neox, Theta, BF16, Bf16;
            @rows
            rope_fused_neox_table_f16_rows: Table, F16, Half;
            rope_fused_neox_theta_f16_rows: Theta, F16, Half;
            rope_fused_neox_table_bf16_rows: Table, BF16, Bf16;
            rope_fused_neox_theta_bf16_rows: Theta, BF16, Bf16;
            @partial
            rope_fused_interleaved_table_f32_two_heads_partial: Interleaved, Table, F32, f32;
            rope_fused_interleaved_theta_f32_two_heads_partial: Interleaved, Theta, F32, f32;
            rope_fused_neox_table_f32_two_heads_partial: Neox, Table, F32, f32;
            rope_fused_neox_theta_f32_two_heads_partial: Neox, Theta, F32, f32;
            rope_fused_interleaved_table_f16_two_heads_partial: Interleaved, Table, F16, Half;
            rope_fused_interleaved_theta_f16_two_heads_partial: Interleaved, Theta, F16, Half;
            rope_fused_neox_table_f16_two_heads_partial: Neox, Table, F16, Half;
            rope_fused_neox_theta_f16_two_heads_partial: Neox, Theta, F16, Half;
            rope_fused_interleaved_table_bf16_two_heads_partial: Interleaved, Table, BF16, Bf16;
            rope_fused_interleaved_theta_bf16_two_heads_partial: Interleaved, Theta, BF16, Bf16;
            rope_fused_neox_table_bf16_two_heads_partial: Neox, Table, BF16, Bf16;
            rope_fused_neox_theta_bf16_two_heads_partial: Neox, Theta, BF16, Bf16;
            @partial_four
            rope_fused_interleaved_table_f16_four_heads_partial: Interleaved, Table, F16, Half;
            rope_fused_interleaved_theta_f16_four_heads_partial: Interleaved, Theta, F16, Half;
            rope_fused_neox_table_f16_four_heads_partial: Neox, Table, F16, Half;
            rope_fused_neox_theta_f16_four_heads_partial: Neox, Theta, F16, Half;
            rope_fused_interleaved_table_bf16_four_heads_partial: Interleaved, Table, BF16, Bf16;
            rope_fused_interleaved_theta_bf16_four_heads_partial: Interleaved, Theta, BF16, Bf16;
            rope_fused_neox_table_bf16_four_heads_partial: Neox, Table, BF16, Bf16;
            rope_fused_neox_theta_bf16_four_heads_partial: Neox, Theta, BF16, Bf16;
            @nvfp4
            rope_fused_interleaved_table_f32_four_heads_nvfp4: Interleaved, Table, F32, f32;
            rope_fused_interleaved_theta_f32_four_heads_nvfp4: Interleaved, Theta, F32, f32;
            rope_fused_neox_table_f32_four_heads_nvfp4: Neox, Table, F32, f32;
            rope_fused_neox_theta_f32_four_heads_nvfp4: Neox, Theta, F32, f32;
            rope_fused_interleaved_table_f16_four_heads_nvfp4: Interleaved, Table, F16, Half;
            rope_fused_interleaved_theta_f16_four_heads_nvfp4: Interleaved, Theta, F16, Half;
            rope_fused_neox_table_f16_four_heads_nvfp4: Neox, Table, F16, Half;
            rope_fused_neox_theta_f16_four_heads_nvfp4: Neox, Theta, F16, Half;
            rope_fused_interleaved_table_bf16_four_heads_nvfp4: Interleaved, Table, BF16, Bf16;
            rope_fused_interleaved_theta_bf16_four_heads_nvfp4: Interleaved, Theta, BF16, Bf16;
            rope_fused_neox_table_bf16_four_heads_nvfp4: Neox, Table, BF16, Bf16;
            rope_fused_neox_theta_bf16_four_heads_nvfp4: Neox, Theta, BF16, Bf16;
            @long_norm
            rope_fused_interleaved_table_f32_four_heads_long_norm: Interleaved, Table, F32, f32;
            rope_fused_interleaved_theta_f32_four_heads_long_norm: Interleaved, Theta, F32, f32;
            rope_fused_neox_table_f32_four_heads_long_norm: Neox, Table, F32, f32;
            rope_fused_neox_theta_f32_four_heads_long_norm: Neox, Theta, F32, f32;
            rope_fused_interleaved_table_f16_four_heads_long_norm: Interleaved, Table, F16, Half;
            rope_fused_interleaved_theta_f16_four_heads_long_norm: Interleaved, Theta, F16, Half;
            rope_fused_neox_table_f16_four_heads_long_norm: Neox, Table, F16, Half;
            rope_fused_neox_theta_f16_four_heads_long_norm: Neox, Theta, F16, Half;
            rope_fused_interleaved_table_bf16_four_heads_long_norm: Interleaved, Table, BF16, Bf16;
            rope_fused_interleaved_theta_bf16_four_heads_long_norm: Interleaved, Theta, BF16, Bf16;
            rope_fused_neox_table_bf16_four_heads_long_norm: Neox, Table, BF16, Bf16;
            rope_fused_neox_theta_bf16_four_heads_long_norm: Neox, Theta, BF16, Bf16;
        }
    };
}
#[cfg_attr(not(target_arch = "nvptx64"), allow(unused_imports))]
pub(crate) use for_each_fused_kernel;

/// Defines [`FusedKernelName::ALL`] and [`FusedKernelName::symbol`] from the kernel list.
macro_rules! fused_kernel_table {
    (
        $($sym:ident, $narrow:ident, $two_heads:ident, $forms:ident: $style:ident, $src:ident, $dt:ident, $t:ty;)*
        @four_heads $($four:ident: $fstyle:ident, $fsrc:ident, $fdt:ident, $ft:ty;)*
        @rows $($rows:ident: $rsrc:ident, $rdt:ident, $rt:ty;)*
        @partial $($ptwo:ident: $pstyle:ident, $psrc:ident, $pdt:ident, $pt:ty;)*
        @partial_four $($pfour:ident: $qstyle:ident, $qsrc:ident, $qdt:ident, $qt:ty;)*
        @nvfp4 $($nfour:ident: $nstyle:ident, $nsrc:ident, $ndt:ident, $nt:ty;)*
        @long_norm $($lfour:ident: $lstyle:ident, $lsrc:ident, $ldt:ident, $lt:ty;)*
    ) => {
        impl FusedKernelName {
            /// Every fused kernel.
            pub const ALL: [FusedKernelName; 4 * [$(stringify!($sym)),*].len()
                + [$(stringify!($four)),*].len() + [$(stringify!($rows)),*].len()
                + [$(stringify!($ptwo)),*].len() + [$(stringify!($pfour)),*].len()
                + [$(stringify!($nfour)),*].len()
                + [$(stringify!($lfour)),*].len()] = [$(
                FusedKernelName {
                    style: RopeStyle::$style,
                    source: SinCosSource::$src,
                    dtype: DType::$dt,
                    mapping: Mapping::WIDE,
                    forms: FusedForms::Plain,
                },
                FusedKernelName {
                    style: RopeStyle::$style,
                    source: SinCosSource::$src,
                    dtype: DType::$dt,
                    mapping: Mapping::NARROW,
                    forms: FusedForms::Plain,
                },
                FusedKernelName {
                    style: RopeStyle::$style,
                    source: SinCosSource::$src,
                    dtype: DType::$dt,
                    mapping: Mapping::TWO_HEADS,
                    forms: FusedForms::Plain,
                },
                FusedKernelName {
                    style: RopeStyle::$style,
                    source: SinCosSource::$src,
                    dtype: DType::$dt,
                    mapping: Mapping::TWO_HEADS,
                    forms: FusedForms::FlashInfer,
                },
            )* $(
                FusedKernelName {
                    style: RopeStyle::$fstyle,
                    source: SinCosSource::$fsrc,
                    dtype: DType::$fdt,
                    mapping: Mapping::FOUR_HEADS,
                    forms: FusedForms::Plain,
                },
            )* $(
                FusedKernelName {
                    style: RopeStyle::Neox,
                    source: SinCosSource::$rsrc,
                    dtype: DType::$rdt,
                    mapping: Mapping::Rows,
                    forms: FusedForms::Plain,
                },
            )* $(
                FusedKernelName {
                    style: RopeStyle::$pstyle,
                    source: SinCosSource::$psrc,
                    dtype: DType::$pdt,
                    mapping: Mapping::TWO_HEADS,
                    forms: FusedForms::Partial,
                },
            )* $(
                FusedKernelName {
                    style: RopeStyle::$qstyle,
                    source: SinCosSource::$qsrc,
                    dtype: DType::$qdt,
                    mapping: Mapping::FOUR_HEADS,
                    forms: FusedForms::Partial,
                },
            )* $(
                FusedKernelName {
                    style: RopeStyle::$nstyle,
                    source: SinCosSource::$nsrc,
                    dtype: DType::$ndt,
                    mapping: Mapping::FOUR_HEADS,
                    forms: FusedForms::Nvfp4,
                },
            )* $(
                FusedKernelName {
                    style: RopeStyle::$lstyle,
                    source: SinCosSource::$lsrc,
                    dtype: DType::$ldt,
                    mapping: Mapping::FOUR_HEADS,
                    forms: FusedForms::LongNorm,
                },
            )*];

            /// The exported PTX symbol.
            #[inline]
            pub const fn symbol(self) -> &'static str {
                const P: FusedForms = FusedForms::Plain;
                const FI: FusedForms = FusedForms::FlashInfer;
                const PART: FusedForms = FusedForms::Partial;
                const NV: FusedForms = FusedForms::Nvfp4;
                const LONG: FusedForms = FusedForms::LongNorm;
                match (self.style, self.source, self.dtype, self.mapping, self.forms) {
                    $(
                        (RopeStyle::$style, SinCosSource::$src, DType::$dt, Mapping::WIDE, P) =>
                            stringify!($sym),
                        (RopeStyle::$style, SinCosSource::$src, DType::$dt, Mapping::NARROW, P) =>
                            stringify!($narrow),
                        (RopeStyle::$style, SinCosSource::$src, DType::$dt, Mapping::TWO_HEADS, P) =>
                            stringify!($two_heads),
                        (RopeStyle::$style, SinCosSource::$src, DType::$dt, Mapping::TWO_HEADS, FI) =>
                            stringify!($forms),
                    )*
                    $(
                        (RopeStyle::$fstyle, SinCosSource::$fsrc, DType::$fdt, Mapping::FOUR_HEADS, P) =>
                            stringify!($four),
                    )*
                    $(
                        (RopeStyle::Neox, SinCosSource::$rsrc, DType::$rdt, Mapping::Rows, P) =>
                            stringify!($rows),
                    )*
                    $(
                        (RopeStyle::$pstyle, SinCosSource::$psrc, DType::$pdt, Mapping::TWO_HEADS, PART) =>
                            stringify!($ptwo),
                    )*
                    $(
                        (RopeStyle::$qstyle, SinCosSource::$qsrc, DType::$qdt, Mapping::FOUR_HEADS, PART) =>
                            stringify!($pfour),
                    )*
                    $(
                        (RopeStyle::$nstyle, SinCosSource::$nsrc, DType::$ndt, Mapping::FOUR_HEADS, NV) =>
                            stringify!($nfour),
                    )*
                    $(
                        (RopeStyle::$lstyle, SinCosSource::$lsrc, DType::$ldt, Mapping::FOUR_HEADS, LONG) =>
                            stringify!($lfour),
                    )*
                    // NVFP4 caches and norms across a head's warps have four-heads kernels
                    // alone: the name of any other is one no build holds (the planner refuses
                    // such launches; loading it would fail naming it).
                    (_, _, _, _, NV) => NVFP4_UNAVAILABLE,
                    (_, _, _, _, LONG) => LONG_NORM_UNAVAILABLE,
                    // Partial heads have two-heads kernels, and four-heads kernels of 16-bit
                    // elements: the others are named as their two-heads kernel's.
                    (_, _, _, _, PART) => FusedKernelName {
                        mapping: Mapping::TWO_HEADS,
                        ..self
                    }
                    .symbol(),
                    // FlashInfer's forms have two-heads kernels alone; kernels without rows
                    // kernels take two heads per thread.
                    (_, _, _, _, FI) | (_, _, _, Mapping::ONE_HEAD | Mapping::Rows, _) => {
                        FusedKernelName {
                            mapping: Mapping::TWO_HEADS,
                            ..self
                        }
                        .symbol()
                    }
                }
            }
        }
    };
}
for_each_fused_kernel!(fused_kernel_table);

impl FusedKernelName {
    /// The fused kernel exported as `symbol`, if one is.
    #[inline]
    pub fn from_symbol(symbol: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.symbol() == symbol)
    }
}

/// The PTX builds `rope-host` embeds, oldest first, and which entry points each holds: a device
/// takes each kernel from the newest build it runs that holds it. Both `cargo xtask ptx` (which
/// keeps only these entry points in each file) and the host's module loader ask
/// [`PtxBuild::holds`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PtxBuild {
    /// Every kernel, for sm_80 (Ampere) and newer.
    Sm80,
    /// The fused token-heads and rows kernels again, for sm_89 (Ada): their FP8 stores use the
    /// paired hardware conversion (the NVFP4 kernels' block scales too).
    Sm89,
    /// The fused token-heads and rows kernels and the one-head kernels again, for sm_90
    /// (Hopper) and newer: the paired FP8 conversion, and programmatic dependent launch
    /// ([`takes_dependent_launch`]).
    Sm90,
}

impl PtxBuild {
    /// The newest build a device of compute capability `(major, minor)` runs: sm_90's from 9.0
    /// on, sm_89's on 8.9, sm_80's below. The host takes a kernel from it where it holds the
    /// kernel, from sm_80's otherwise; `cargo xtask sass` compiles by the same rule.
    #[inline]
    pub fn newest_for(capability: (i32, i32)) -> PtxBuild {
        match capability {
            c if c >= (9, 0) => PtxBuild::Sm90,
            c if c >= (8, 9) => PtxBuild::Sm89,
            _ => PtxBuild::Sm80,
        }
    }

    /// Whether this build holds the entry point `symbol` (one of [`all_symbols`]).
    #[inline]
    pub fn holds(self, symbol: &str) -> bool {
        match self {
            PtxBuild::Sm80 => true,
            PtxBuild::Sm89 => rebuilt_fused(symbol),
            PtxBuild::Sm90 => takes_dependent_launch(symbol),
        }
    }
}

/// Whether `symbol` is a fused kernel the sm_89 and sm_90 builds hold again: the token-heads
/// kernels ([`Mapping::TokenHeads`]) and the rows kernels ([`Mapping::Rows`]), which the planner
/// takes for every launch whose tensors, cache and tables allow them. The item-loop kernels
/// ([`Mapping::ItemLoop`], either width), the fallback for layouts that do not allow the
/// preferred width, tensors of 2^32 elements or more, caches of more than 2^32 slots and tables
/// the token-heads kernels cannot read, come from the sm_80 build on every device: rebuilt, they
/// were half of the newer builds' code, for launches that rarely happen (docs/perf/decisions.md).
#[inline]
fn rebuilt_fused(symbol: &str) -> bool {
    FusedKernelName::from_symbol(symbol).is_some_and(|k| !matches!(k.mapping, Mapping::ItemLoop(_)))
}

/// Whether the kernel exported as `symbol` takes part in programmatic dependent launch when
/// built for sm_90: the fused kernels but the item-loop ones, and the RoPE kernels of one head per
/// thread ([`Mapping::ONE_HEAD`]: decode steps, where a launch is short enough for the previous
/// one's tail to matter). Their sm_90 code waits for the previous grid before its first global
/// access; the sm_90 build keeps only these entry points, and the host launches only these with
/// the attribute.
#[inline]
pub fn takes_dependent_launch(symbol: &str) -> bool {
    rebuilt_fused(symbol)
        || KernelName::ALL
            .into_iter()
            .any(|k| k.mapping == Mapping::ONE_HEAD && k.symbol() == symbol)
}

/// Calls `$m!` with `{ $($pass)* }` and the parameter list of every fused entry point
/// (`rope-kernels/src/fused.rs`): those of [`crate::rope_kernel_params!`], then the fused ones.
///
/// The RoPE parameters keep their meaning, with: the full head rotated (`rotary_dim =
/// head_dim`, `rotary_offset = 0`); `groups` a power of two of at least `rot_groups` (the
/// items of a token and head share a segment of a warp for the normalisation's sum; items
/// `rot_groups..groups` only take part in it); `out0` addressed in elements of `q_format`
/// (bytes for FP8) at `out0`'s strides; `out1` null when k's rotated heads are not written back
/// to a tensor. Then: `v` with `heads_v` heads at its strides (copied to the cache only);
/// `head_dim`; `norm` (a [`NormCode`]) with `q_norm_weight`, `k_norm_weight` (`head_dim`
/// elements each) and `norm_eps`; `q_format` (a [`FormatCode`]) with `q_scale` (`f32`, index
/// `head * q_scale_step`); `slots` (null: no cache write; else `tokens` `i64` when `slots_wide`
/// is 1, `i32` when 0: token `t`'s cache slot, skipped when negative or at least
/// `cache_slots`), `k_cache`, `v_cache` addressed in elements of `cache_format` as
/// `(slot / block_size) * cache_stride_block + (slot % block_size) * cache_stride_slot + head *
/// cache_stride_head + e` (`block_magic`, `block_shift` from [`crate::divide::Divisor::new`]),
/// with `k_scale` indexed by `head * k_scale_step` and `v_scale` by `head * v_scale_step` (each
/// step 0 for one scale in all, 1 for one per head: k's and v's granularity are their own); for
/// the token-heads kernels ([`Mapping::TokenHeads`]), `q_warps`,
/// `k_warps` and `v_warps`, the warps of each token's threads for q's, k's and v's heads (0 for
/// a tensor the launch stores nothing of, and for the other kernels, which do not read them);
/// for the four-heads kernels ([`Mapping::FOUR_HEADS`]), `prefetch_tokens`: how many tokens ahead
/// each thread asks L2 for the lines of the heads its place takes in token `token +
/// prefetch_tokens` (0: none; the other kernels do not read it); last `sin_sign`, as the RoPE
/// kernels' ([`Direction::sin_sign`]): `-1.0` only where nothing is normalised, quantised or
/// cached (a plain backward rotation).
#[macro_export]
macro_rules! fused_kernel_params {
    ($m:ident { $($pass:tt)* } $($more:tt)*) => {
        $crate::rope_kernel_params! {
            $m { $($pass)* }
            v: elem_ptr,
            heads_v: u32,
            v_stride_batch: u64,
            v_stride_seq: u64,
            v_stride_head: u64,
            head_dim: u32,
            norm: u32,
            q_norm_weight: elem_ptr,
            k_norm_weight: elem_ptr,
            norm_eps: f32,
            q_format: u32,
            q_scale: byte_ptr,
            q_scale_step: u32,
            slots: byte_ptr,
            slots_wide: u32,
            k_cache: byte_ptr_mut,
            v_cache: byte_ptr_mut,
            cache_stride_block: u64,
            cache_stride_slot: u64,
            cache_stride_head: u64,
            block_size: nonzero_u32,
            block_magic: u32,
            block_shift: u32,
            cache_slots: u64,
            cache_format: u32,
            k_scale: byte_ptr,
            v_scale: byte_ptr,
            k_scale_step: u32,
            v_scale_step: u32,
            q_warps: u32,
            k_warps: u32,
            v_warps: u32,
            prefetch_tokens: u32,
            sin_sign: f32,
            $($more)*
        }
    };
}

/// Calls `$m!` with `{ $($pass)* }` and the parameter list of the fused entry points of
/// FlashInfer's forms ([`FusedForms::FlashInfer`]): those of [`crate::fused_kernel_params!`],
/// then `q_multiplier`, `k_multiplier`, `v_multiplier` (the FP8 multipliers of q's output, of
/// k's output or cache and of v's cache where their scale pointer is null: FlashInfer's `x *
/// quant_scale`); `k_format` (a [`FormatCode`]): `out1`'s elements, FP8 taking k's scale (then
/// the launch has no cache); `slot_mode` (a [`SlotCode`]), and for [`SlotCode::PageTable`]:
/// `slots` holds `tokens` `i32` request indices `b` (negative: padding), `page_positions`
/// `tokens` `i32` positions `p` in the request, `kv_indptr` `kv_requests + 1` and `kv_indices`
/// `kv_pages` `i32`, and token `t`'s slot is `kv_indices[kv_indptr[b] + p / block_size] *
/// block_size + p % block_size`, none (the token writes no cache) for a negative `b`, `p`, or
/// page, `b >= kv_requests`, or a page entry outside `kv_indptr[b] .. kv_indptr[b + 1]` or
/// `kv_indices`. Then FlashInfer's non-rotary parts (`q_nope`, `k_nope`): blocks of a token's
/// row from `rope_blocks` on take them, `nope_accesses` accesses of `16 / size_of::<T>()`
/// elements per head, `nope_threads` threads a head (`nope_magic`, `nope_shift`: its
/// [`crate::divide::Divisor`]), thread `i` of a head taking accesses `i + j * nope_threads`
/// below `nope_accesses` for `j` below [`NOPE_ACCESSES_PER_THREAD`], over q's heads (when
/// `q_nope` is not null) then k's (when `k_nope` is not null), the same heads as the rotated
/// parts; token `t`'s head `h` starts at element `t * stride_token + h * stride_head` of its
/// input and at that byte of its output (`q_nope_out`, `k_nope_out`), stored as FP8 of
/// `x * m` in the format and with the multiplier of its rotated part's FP8 output, unrotated.
/// `nope_cached` ([`NopeCached`] bits) sends parts into the cache instead, in its format with
/// k's (v's) scale or multiplier, for tokens that have a slot (`(block, row)` of
/// [`crate::fused_kernel_params!`]): with [`NopeCached::K`], k's part goes to `k_nope_out +
/// block * nope_cache_stride_block + row * nope_cache_stride_slot + h * nope_cache_stride_head`
/// (bytes); with [`NopeCached::V`], v's heads, `head_dim + nope_dim` wide at v's strides, add
/// their features from `head_dim` on as a third part after k's, into `v_cache` at element
/// `head_dim` of the head's cache entry.
/// The other fused entry points take none of these: every parameter byte is copied at each
/// launch, and these made every decode launch slower.
#[macro_export]
macro_rules! fused_forms_kernel_params {
    ($m:ident { $($pass:tt)* }) => {
        $crate::fused_kernel_params! {
            $m { $($pass)* }
            q_multiplier: f32,
            k_multiplier: f32,
            v_multiplier: f32,
            k_format: u32,
            slot_mode: u32,
            page_positions: byte_ptr,
            kv_indptr: byte_ptr,
            kv_indices: byte_ptr,
            kv_requests: u32,
            kv_pages: u32,
            rope_blocks: u32,
            nope_threads: nonzero_u32,
            nope_magic: u32,
            nope_shift: u32,
            nope_accesses: u32,
            q_nope: elem_ptr,
            q_nope_stride_token: u32,
            q_nope_stride_head: u32,
            q_nope_out: byte_ptr_mut,
            q_nope_out_stride_token: u32,
            q_nope_out_stride_head: u32,
            k_nope: elem_ptr,
            k_nope_stride_token: u32,
            k_nope_stride_head: u32,
            k_nope_out: byte_ptr_mut,
            k_nope_out_stride_token: u32,
            k_nope_out_stride_head: u32,
            nope_cached: u32,
            nope_cache_stride_block: u64,
            nope_cache_stride_slot: u64,
            nope_cache_stride_head: u64,
        }
    };
}

/// Calls `$m!` with `{ $($pass)* }` and the parameter list of the fused entry points of NVFP4
/// caches ([`FusedForms::Nvfp4`]): those of [`crate::fused_kernel_params!`], with the cache
/// as NVFP4 (`cache_format` not read): element `e` of the cache (the offset the cache strides
/// give, in elements) is the FP4 E2M1 code in byte `e / 2` of `k_cache` (`v_cache`), the low
/// four bits for even `e`; the block scales (FP8 E4M3) of head `h` in slot `(block, row)` are
/// bytes `block * scale_stride_block + row * scale_stride_slot + h * scale_stride_head + b` of
/// `k_block_scales` (`v_block_scales`), `b` the head's block of [`NVFP4_BLOCK`] elements; `k_scale`
/// and `v_scale` (at their steps) are the global scales `s`. A block `x` of a head (k's
/// rotated, v's as read) is stored with `m = 1 / s` as `b = e4m3(max_e |x_e| * m / 6)` and
/// `e2m1(x_e * m / b)` (zeros where `b` is 0), so that `x_e ~ e2m1 * b * s`.
#[macro_export]
macro_rules! nvfp4_kernel_params {
    ($m:ident { $($pass:tt)* }) => {
        $crate::fused_kernel_params! {
            $m { $($pass)* }
            k_block_scales: byte_ptr_mut,
            v_block_scales: byte_ptr_mut,
            scale_stride_block: u64,
            scale_stride_slot: u64,
            scale_stride_head: u64,
        }
    };
}

/// One entry point of the QK-norm + RoPE backward (`rope-kernels/src/fused/grad.rs`):
/// `rope_norm_grad_{style}_{source}_{dtype}`, with the parameter list of
/// [`crate::norm_grad_kernel_params!`]; every combination exists. Its launch is followed by the
/// weights entry point of its element type ([`NormGradKernelName::weights_symbol`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NormGradKernelName {
    /// Pairing.
    pub style: RopeStyle,
    /// Sin/cos source.
    pub source: SinCosSource,
    /// Element type of the tensors and the weights.
    pub dtype: DType,
}

/// Threads per block of the backward's weights kernels: 32 warps that each sum every 32nd
/// `partials` row of 32 features.
pub const NORM_GRAD_WEIGHTS_THREADS: u32 = 1024;

/// Features of one weights block (one per lane of a warp).
pub const NORM_GRAD_WEIGHTS_FEATURES: u32 = 32;

/// q's or k's heads each thread of a gradient entry point (and of an across-heads entry point)
/// takes at every token, for elements of `elem_size` bytes: four of 16-bit elements, two of
/// `f32` (the same registers for the loads). Their loads are issued together, and the token's
/// cos/sin, found once by the block, serve them all.
pub const fn token_warps_heads_per_thread(elem_size: usize) -> u32 {
    if elem_size == 4 { 2 } else { 4 }
}

/// Heads each thread of a gradient entry point takes at every token where a head spans
/// segments of whole warps (64 or 128 groups): two, whose terms, held across the barrier where
/// the segment's warps meet, stay in registers (four spilled).
pub const NORM_GRAD_SEGMENT_HEADS_PER_THREAD: u32 = 2;

/// Threads one block of a gradient entry point may hold (its `.maxntid`): a token's five warps
/// of 32 q and 8 k heads of 128, within the static shared memory of its staging buffer
/// (`intrinsics::stage`).
pub const NORM_GRAD_MAX_THREADS: u32 = 160;

/// Registers a thread of a gradient entry point may take (its `.maxnreg`): three blocks of
/// [`NORM_GRAD_MAX_THREADS`] on a multiprocessor.
pub const NORM_GRAD_MAX_REGISTERS: u32 = 128;

/// `f32` values of the block's shared buffer (the kernels' 4 KiB buffer): a gradient launch
/// takes `2 * head_dim` of them, the two cos/sin buffers of its tokens and then its q and k
/// weight sums; an across-heads launch `head_dim` of cos/sin and one sum per warp.
pub const SHARED_BUFFER_F32: u32 = 1024;

/// Calls `$m!` with every gradient entry point of the QK-norm + RoPE backward as `symbol:
/// Style, Source, DType, storage type;`, then `@weights` and every weights entry point as
/// `symbol: DType, storage type;`: the one list from which the kernel crate defines them and
/// [`NormGradKernelName`] its table.
macro_rules! for_each_norm_grad_kernel {
    ($m:ident) => {
        $m! {
            rope_norm_grad_interleaved_table_f32: Interleaved, Table, F32, f32;
            rope_norm_grad_interleaved_theta_f32: Interleaved, Theta, F32, f32;
            rope_norm_grad_neox_table_f32: Neox, Table, F32, f32;
            rope_norm_grad_neox_theta_f32: Neox, Theta, F32, f32;
            rope_norm_grad_interleaved_table_f16: Interleaved, Table, F16, Half;
            rope_norm_grad_interleaved_theta_f16: Interleaved, Theta, F16, Half;
            rope_norm_grad_neox_table_f16: Neox, Table, F16, Half;
            rope_norm_grad_neox_theta_f16: Neox, Theta, F16, Half;
            rope_norm_grad_interleaved_table_bf16: Interleaved, Table, BF16, Bf16;
            rope_norm_grad_interleaved_theta_bf16: Interleaved, Theta, BF16, Bf16;
            rope_norm_grad_neox_table_bf16: Neox, Table, BF16, Bf16;
            rope_norm_grad_neox_theta_bf16: Neox, Theta, BF16, Bf16;
            @weights
            rope_norm_grad_weights_f32: F32, f32;
            rope_norm_grad_weights_f16: F16, Half;
            rope_norm_grad_weights_bf16: BF16, Bf16;
        }
    };
}
#[cfg_attr(not(target_arch = "nvptx64"), allow(unused_imports))]
pub(crate) use for_each_norm_grad_kernel;

/// Defines [`NormGradKernelName::ALL`], [`NormGradKernelName::symbol`] and
/// [`NormGradKernelName::weights_symbol`] from the kernel list.
macro_rules! norm_grad_kernel_table {
    (
        $($sym:ident: $style:ident, $src:ident, $dt:ident, $t:ty;)*
        @weights $($weights:ident: $wdt:ident, $wt:ty;)*
    ) => {
        impl NormGradKernelName {
            /// Every gradient entry point.
            pub const ALL: [NormGradKernelName; [$(stringify!($sym)),*].len()] = [$(
                NormGradKernelName {
                    style: RopeStyle::$style,
                    source: SinCosSource::$src,
                    dtype: DType::$dt,
                },
            )*];

            /// Every weights entry point, one per element type.
            pub const WEIGHTS: [&'static str; [$(stringify!($weights)),*].len()] =
                [$(stringify!($weights)),*];

            /// The exported PTX symbol.
            #[inline]
            pub const fn symbol(self) -> &'static str {
                match (self.style, self.source, self.dtype) {
                    $((RopeStyle::$style, SinCosSource::$src, DType::$dt) => stringify!($sym),)*
                }
            }

            /// The exported symbol of the weights entry point of this kernel's element type.
            #[inline]
            pub const fn weights_symbol(self) -> &'static str {
                match self.dtype {
                    $(DType::$wdt => stringify!($weights),)*
                }
            }
        }
    };
}
for_each_norm_grad_kernel!(norm_grad_kernel_table);

/// Calls `$m!` with `{ $($pass)* }` and the parameter list of every gradient entry point of the
/// QK-norm + RoPE backward (`rope-kernels/src/fused/grad.rs`): those of
/// [`crate::rope_kernel_params!`], then its own.
///
/// The RoPE parameters describe the output gradients `gy` (`x0`, `x1`: q's and k's, `heads1 =
/// 0` without k) and the input gradients written (`out0`, `out1`, equal to `x0`, `x1` in place),
/// with the whole head rotated (`rotary_dim = head_dim`, `rotary_offset = 0`), `rot_groups =
/// half / pairs` threads holding a head's pairs in a segment of `groups` lanes (the power of
/// two at or above it, at most 32), `heads_per_chunk` the heads of one warp: `32 / groups`
/// segments times [`token_warps_heads_per_thread`]. Then: `q_in`, `k_in`, the forward step's
/// inputs (before the norm), with their element strides; `norm` (a [`NormCode`], not `None`),
/// `q_norm_weight`, `k_norm_weight` (`head_dim` elements each) and `norm_eps`, the forward
/// step's; `q_warps`, the warps of q's heads in each token's sequence of warps (k's follow);
/// `partials`, `f32` rows of `head_dim`, two per block (see the
/// module); `sin_sign`, that of the rotation `R^T` the gradient applies: `-1.0` for a forward
/// step rotated forward.
#[macro_export]
macro_rules! norm_grad_kernel_params {
    ($m:ident { $($pass:tt)* }) => {
        $crate::rope_kernel_params! {
            $m { $($pass)* }
            q_in: elem_ptr,
            q_in_stride_batch: u64,
            q_in_stride_seq: u64,
            q_in_stride_head: u64,
            k_in: elem_ptr,
            k_in_stride_batch: u64,
            k_in_stride_seq: u64,
            k_in_stride_head: u64,
            norm: u32,
            q_norm_weight: elem_ptr,
            k_norm_weight: elem_ptr,
            norm_eps: f32,
            q_warps: u32,
            partials: byte_ptr_mut,
            sin_sign: f32,
        }
    };
}

/// Calls `$m!` with `{ $($pass)* }` and the parameter list of the backward's weights entry
/// points: `partials` (`(q_rows + k_rows) * head_dim` `f32`: q's rows, then k's), `q_rows`,
/// `k_rows`, `head_dim`, and the gradients written, `q_grad` and `k_grad` (`head_dim` elements
/// of the kernel's type; null: not written).
#[macro_export]
macro_rules! norm_grad_weights_kernel_params {
    ($m:ident { $($pass:tt)* }) => {
        $m! {
            { $($pass)* }
            partials: byte_ptr,
            q_rows: u32,
            k_rows: u32,
            head_dim: u32,
            q_grad: elem_ptr_mut,
            k_grad: elem_ptr_mut,
        }
    };
}

/// One entry point of the normalisation across heads with RoPE
/// (`rope-kernels/src/fused/across.rs`, diffusion transformers):
/// `rope_norm_across_{style}_{source}_{dtype}`, with the parameter list of
/// [`crate::norm_across_kernel_params!`]; every combination exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NormAcrossKernelName {
    /// Pairing.
    pub style: RopeStyle,
    /// Sin/cos source.
    pub source: SinCosSource,
    /// Element type of the tensors and the weights.
    pub dtype: DType,
}

/// Threads one block of an across-heads entry point may hold (its `.maxntid`): the warps of
/// q's and k's heads at one token, or of one of them (and at least `half` threads).
pub const NORM_ACROSS_MAX_THREADS: u32 = 512;

/// Registers a thread of an across-heads entry point may take (its `.maxnreg`): six blocks of
/// a token's five warps (32 q and 8 k heads of 128) on a multiprocessor. Uncapped, they took
/// 72 to 76 and ran markedly slower (docs/perf/decisions.md).
pub const NORM_ACROSS_MAX_REGISTERS: u32 = 64;

/// Calls `$m!` with every across-heads entry point as `symbol: Style, Source, DType, storage
/// type;`: the one list from which the kernel crate defines them and [`NormAcrossKernelName`]
/// its table.
macro_rules! for_each_norm_across_kernel {
    ($m:ident) => {
        $m! {
            rope_norm_across_interleaved_table_f32: Interleaved, Table, F32, f32;
            rope_norm_across_interleaved_theta_f32: Interleaved, Theta, F32, f32;
            rope_norm_across_neox_table_f32: Neox, Table, F32, f32;
            rope_norm_across_neox_theta_f32: Neox, Theta, F32, f32;
            rope_norm_across_interleaved_table_f16: Interleaved, Table, F16, Half;
            rope_norm_across_interleaved_theta_f16: Interleaved, Theta, F16, Half;
            rope_norm_across_neox_table_f16: Neox, Table, F16, Half;
            rope_norm_across_neox_theta_f16: Neox, Theta, F16, Half;
            rope_norm_across_interleaved_table_bf16: Interleaved, Table, BF16, Bf16;
            rope_norm_across_interleaved_theta_bf16: Interleaved, Theta, BF16, Bf16;
            rope_norm_across_neox_table_bf16: Neox, Table, BF16, Bf16;
            rope_norm_across_neox_theta_bf16: Neox, Theta, BF16, Bf16;
        }
    };
}
#[cfg_attr(not(target_arch = "nvptx64"), allow(unused_imports))]
pub(crate) use for_each_norm_across_kernel;

/// Defines [`NormAcrossKernelName::ALL`] and [`NormAcrossKernelName::symbol`] from the kernel
/// list.
macro_rules! norm_across_kernel_table {
    ($($sym:ident: $style:ident, $src:ident, $dt:ident, $t:ty;)*) => {
        impl NormAcrossKernelName {
            /// Every across-heads entry point.
            pub const ALL: [NormAcrossKernelName; [$(stringify!($sym)),*].len()] = [$(
                NormAcrossKernelName {
                    style: RopeStyle::$style,
                    source: SinCosSource::$src,
                    dtype: DType::$dt,
                },
            )*];

            /// The exported PTX symbol.
            #[inline]
            pub const fn symbol(self) -> &'static str {
                match (self.style, self.source, self.dtype) {
                    $((RopeStyle::$style, SinCosSource::$src, DType::$dt) => stringify!($sym),)*
                }
            }
        }
    };
}
for_each_norm_across_kernel!(norm_across_kernel_table);

/// Calls `$m!` with `{ $($pass)* }` and the parameter list of every across-heads entry point
/// (`rope-kernels/src/fused/across.rs`): those of [`crate::rope_kernel_params!`], then its own.
///
/// The RoPE parameters describe q (`x0`, `out0`) and k (`x1`, `out1`; `heads1 = 0` without k),
/// with the whole head rotated (`rotary_dim = head_dim`, `rotary_offset = 0`), `rot_groups =
/// half / pairs` threads holding a head's pairs in a segment of `groups` lanes (the power of
/// two at or above it, at most 32), `heads_per_chunk` the heads of one warp: `32 / groups`
/// segments times [`token_warps_heads_per_thread`]; an output in FP8 is addressed in bytes.
/// Then: `norm` (a [`NormCode`]), `q_norm_weight` and `k_norm_weight` (`heads * head_dim`
/// elements each: the token's features of the tensor) and `norm_eps`; `prefetch_tokens`, how
/// many tokens ahead each block asks L2 for its tensor's heads (0: none); `q_format`,
/// `k_format` (a [`FormatCode`]: the tensors' type, E4M3 or E5M2) with each FP8 output's
/// scale array (null: the multiplier by value), its step (0: one scale, 1: one per head) and
/// multiplier.
#[macro_export]
macro_rules! norm_across_kernel_params {
    ($m:ident { $($pass:tt)* }) => {
        $crate::rope_kernel_params! {
            $m { $($pass)* }
            norm: u32,
            q_norm_weight: elem_ptr,
            k_norm_weight: elem_ptr,
            norm_eps: f32,
            prefetch_tokens: u32,
            q_format: u32,
            q_scale: byte_ptr,
            q_scale_step: u32,
            q_multiplier: f32,
            k_format: u32,
            k_scale: byte_ptr,
            k_scale_step: u32,
            k_multiplier: f32,
        }
    };
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::{vec, vec::Vec};

    use super::*;

    /// A xorshift64 generator from `seed` (non-zero): each call gives the next state modulo `n`.
    fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
        move |n| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        }
    }

    /// A narrow entry point exists exactly for the kernels whose wide kernel does not take
    /// the narrow accesses, and their narrow accesses name the wide symbol; every symbol is
    /// distinct.
    #[test]
    fn narrow_kernels_exist_unless_the_wide_kernel_takes_their_accesses() {
        for wide in KernelName::ALL
            .into_iter()
            .filter(|k| k.mapping == Mapping::WIDE)
        {
            let narrow = KernelName {
                mapping: Mapping::NARROW,
                ..wide
            };
            let folded = KernelName::narrow_in_wide(wide.dtype, wide.source);
            assert_eq!(KernelName::ALL.contains(&narrow), !folded, "{wide:?}");
            assert_eq!(narrow.symbol() == wide.symbol(), folded, "{wide:?}");
        }
        let mut symbols: Vec<&str> = all_symbols().collect();
        let count = symbols.len();
        symbols.sort_unstable();
        symbols.dedup();
        assert_eq!(symbols.len(), count);
    }

    /// For every head size, rotated width, offset and access width the host accepts (`lanes`
    /// dividing the offset, the rotated width and the pass-through count), the pass-through
    /// groups cover exactly
    /// the elements outside the rotated slice, each once, in whole aligned runs inside the head.
    #[test]
    fn pass_through_groups_cover_the_rest_of_the_head_once() {
        for head_dim in (2..=40u32).step_by(2) {
            for rotary_dim in (2..=head_dim).step_by(2) {
                for offset in 0..=head_dim - rotary_dim {
                    for lanes in [1u32, 2, 4, 8] {
                        let rest = head_dim - rotary_dim;
                        if !offset.is_multiple_of(lanes)
                            || !rotary_dim.is_multiple_of(lanes)
                            || !rest.is_multiple_of(lanes)
                        {
                            continue;
                        }
                        let mut seen = [0u32; 40];
                        for g in 0..rest / lanes {
                            let e0 = pass_through_start(g, lanes, offset, rotary_dim);
                            let first = e0 + offset as isize;
                            assert!(first >= 0 && (first as u32).is_multiple_of(lanes));
                            let run = first as usize..first as usize + lanes as usize;
                            assert!(
                                run.end <= head_dim as usize,
                                "{head_dim} {rotary_dim} {offset}"
                            );
                            seen[run].iter_mut().for_each(|n| *n += 1);
                        }
                        for (e, &n) in seen.iter().enumerate().take(head_dim as usize) {
                            let rotated = (offset..offset + rotary_dim).contains(&(e as u32));
                            assert_eq!(
                                n,
                                u32::from(!rotated),
                                "element {e} of d {head_dim}, r {rotary_dim} at {offset}, lanes {lanes}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// For whole sequences of random lengths divisible by `2 * size`, every rank's tokens get
    /// the positions of the chunks it holds (cut here from the whole sequence, not computed by
    /// formula), the ranks together cover each whole position once, and the search bound
    /// finds the right sequence for every local token.
    #[test]
    fn context_parallel_ranks_hold_their_two_chunks_of_every_sequence() {
        let mut next = xorshift(0x2545_f491_4f6c_dd1du64);
        for size in 1..=8u32 {
            for _ in 0..20 {
                let lens: Vec<i64> = (0..1 + next(4))
                    .map(|_| (next(5) * 2 * u64::from(size)) as i64)
                    .collect();
                let cu: Vec<i64> = core::iter::once(0)
                    .chain(lens.iter().scan(0, |c, l| {
                        *c += l;
                        Some(*c)
                    }))
                    .collect();
                let mut seen: Vec<Vec<u32>> = lens.iter().map(|&l| vec![0; l as usize]).collect();
                for rank in 0..size {
                    let split = ContextParallelSplit {
                        size: NonZeroU32::new(size).expect("size >= 1"),
                        rank,
                    };
                    let local_total = cu[cu.len() - 1] / i64::from(size);
                    let mut t = 0u64;
                    for (i, &len) in lens.iter().enumerate() {
                        let chunk = (len / (2 * i64::from(size))) as usize;
                        let whole: Vec<i64> = (0..len).collect();
                        let mine = whole
                            .chunks(chunk.max(1))
                            .enumerate()
                            .filter(|(c, _)| {
                                chunk > 0 && (*c as u32 == rank || *c as u32 == 2 * size - 1 - rank)
                            })
                            .flat_map(|(_, v)| v.to_vec());
                        for want in mine {
                            let bound = split.search_bound(t);
                            let found = cu[..cu.len() - 1]
                                .iter()
                                .rposition(|&c| c <= bound)
                                .expect("cu starts at 0");
                            // Empty sequences share their start with the next one: the search
                            // lands on the last sequence starting there, which is `i`.
                            assert_eq!(found, i, "size {size} rank {rank} token {t}");
                            let got = split.position(t, cu[i], cu[i + 1]);
                            assert_eq!(got, want, "size {size} rank {rank} token {t}");
                            seen[i][got as usize] += 1;
                            t += 1;
                        }
                    }
                    assert_eq!(t as i64, local_total);
                }
                assert!(
                    seen.iter().flatten().all(|&n| n == 1),
                    "{lens:?} size {size}"
                );
            }
        }
        let split = ContextParallelSplit {
            size: NonZeroU32::new(3).expect("3"),
            rank: 2,
        };
        assert_eq!(ContextParallelSplit::from_base(split.to_base()), split);
        assert_eq!(
            ContextParallelSplit::from_base(0),
            ContextParallelSplit::NONE
        );
    }

    /// Every map whose groups of `pairs` pairs each take one axis decodes, group by group, to
    /// its own axes through the kernel's `pos_base`; any other map (a group of two axes, a
    /// partial group, more than 32 groups) has no group axes.
    #[test]
    fn group_axes_in_pos_base_give_every_group_its_map_axis() {
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15u64);
        for _ in 0..4000 {
            let pairs = 1usize << next(4);
            let groups = 1 + next(40) as usize;
            let mut map: Vec<u8> = (0..groups * pairs).map(|j| (j / pairs) as u8 % 4).collect();
            for a in map.iter_mut() {
                if next(8) == 0 {
                    *a = next(4) as u8;
                }
            }
            if next(8) == 0 {
                map.pop();
            }
            let whole = map.len().is_multiple_of(pairs) && map.len() / pairs <= 32;
            let uniform = map.chunks(pairs).all(|g| g.iter().all(|&a| a == g[0]));
            match GroupAxes::new(&map, pairs) {
                Some(g) => {
                    assert!(whole && uniform, "{map:?} {pairs}");
                    for (j, &a) in map.iter().enumerate() {
                        let got = GroupAxes::axis_in_base(g.to_base(), (j / pairs) as u32);
                        assert_eq!(got, u32::from(a), "{map:?} {pairs}");
                    }
                }
                None => assert!(!(whole && uniform), "{map:?} {pairs}"),
            }
        }
        assert_eq!(GroupAxes::new(&[0, 4], 1), None);
        assert_eq!(GroupAxes::new(&[], 1).map(GroupAxes::to_base), Some(0));
        assert_eq!(GroupAxes::new(&[1, 1], 0), None);
        assert_eq!(
            GroupAxes::new(&[3; 32], 1).map(GroupAxes::to_base),
            Some(-1)
        );
        assert_eq!(GroupAxes::new(&[3; 33], 1), None);
    }

    #[test]
    fn axis_entries_are_clamped_to_the_last_axis() {
        for n_axes in 1..=MAX_AXES {
            for entry in 0..=255u8 {
                let a = clamped_axis(entry, n_axes);
                assert!(a < n_axes);
                if u32::from(entry) < n_axes {
                    assert_eq!(a, u32::from(entry));
                }
            }
        }
    }
}
