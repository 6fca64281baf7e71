//! The launch contract between the host library and the kernels: the option enums, the kernel
//! names, the codes passed as `u32` arguments, and the limits both sides assume. One
//! definition, used by both (`rope-host` re-exports the public enums).

/// Threads per block of every kernel launch. 128 rather than 256: the last blocks of a launch
/// then hold half the work, so fewer multiprocessors sit idle while they finish (on an H200 the
/// 16-bit NeoX cases gained 0.5-1.5 points of copy bandwidth: docs/perf.md v19).
pub const BLOCK_THREADS: u32 = 128;

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

/// Forward rotation, or its gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// `y = R(angle) x`.
    Forward,
    /// `dx = R(angle)^T dy = R(-angle) dy`, the gradient of the forward pass.
    Backward,
}

/// Element types the kernels load and store (arithmetic is `f32`, rounded once on store).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (the top half of an `f32`).
    BF16,
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
    /// `cos[pos * half + i]`, `sin[pos * half + i]` from tables of `table_positions` rows; a
    /// position outside `0..table_positions` yields NaN outputs.
    Table,
    /// `cos`/`sin` of `pos * inv_freq[i]` computed by [`crate::math::rope_cos_sin`], with
    /// `inv_freq` an `f64` array of `half` frequencies.
    Theta,
}

/// Where the position of token `(b, s)` comes from, passed as the `positions` argument
/// together with the pointer `pos_ptr` and the scalar `pos_base`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PositionCode {
    /// `pos = pos_base + s`; `pos_ptr` is unused.
    Offset = 0,
    /// `pos = row_offsets[b] + s`, `pos_ptr` pointing at `batch` `u32`.
    RowOffsets = 1,
    /// `pos = ids[s]`, `pos_ptr` pointing at `seq` `i32`.
    IdsI32Shared = 2,
    /// `pos = ids[b * seq + s]`, `pos_ptr` pointing at `batch * seq` `i32`.
    IdsI32PerRow = 3,
    /// `pos = ids[s]`, `pos_ptr` pointing at `seq` `i64`.
    IdsI64Shared = 4,
    /// `pos = ids[b * seq + s]`, `pos_ptr` pointing at `batch * seq` `i64`.
    IdsI64PerRow = 5,
    /// Packed sequences (`batch = 1`, token `t = s`): `pos = t - cu_seqlens[i] + offsets[i]`
    /// for the sequence `i` holding `t`; `pos_ptr` points at `pos_count + 1` `u32`
    /// (`cu_seqlens`), `pos_aux` at `pos_count` `u32` offsets or is null (no offsets).
    Varlen = 6,
}

impl PositionCode {
    /// Decodes a kernel argument; `None` for an unknown code.
    #[inline(always)]
    pub fn from_u32(code: u32) -> Option<Self> {
        match code {
            0 => Some(Self::Offset),
            1 => Some(Self::RowOffsets),
            2 => Some(Self::IdsI32Shared),
            3 => Some(Self::IdsI32PerRow),
            4 => Some(Self::IdsI64Shared),
            5 => Some(Self::IdsI64PerRow),
            6 => Some(Self::Varlen),
            _ => None,
        }
    }
}

/// How wide a kernel's memory accesses are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// The preferred width, [`preferred_lanes`] elements per access, when every tensor address
    /// and stride is aligned to it and the pairs (and pass-through elements) split into groups
    /// of that many.
    Wide,
    /// Fewer lanes, chosen at run time (1, 2, or for 16-bit interleaved 4 elements; 1 only for
    /// NeoX pairs): a separate kernel, so the common wide kernel carries none of these paths'
    /// registers.
    Narrow,
}

/// Elements per access of the [`Access::Wide`] kernels: 16 bytes, except for NeoX pairs of
/// 16-bit elements, 8 bytes. A work item then rotates at most four pairs per head, so a token
/// has twice as many items, which is what filled the GPU best on an H200 (NeoX bf16 prefill
/// 87% of copy against 80% with 16-byte accesses; docs/perf.md v11).
pub const fn preferred_lanes(style: RopeStyle, elem_size: usize) -> u32 {
    match (style, elem_size) {
        (RopeStyle::Neox, 2) => 4,
        _ => (16 / elem_size) as u32,
    }
}

/// One kernel entry point: `rope_{style}_{source}_{direction}_{dtype}`, for example
/// `rope_neox_theta_fwd_f32`, with the suffix `_narrow` for [`Access::Narrow`]. Every
/// combination exists and has the same parameter list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelName {
    /// Pairing.
    pub style: RopeStyle,
    /// Sin/cos source.
    pub source: SinCosSource,
    /// Forward or backward.
    pub direction: Direction,
    /// Element type.
    pub dtype: DType,
    /// Access width.
    pub access: Access,
}

/// Calls `$m!` with every kernel as
/// `wide symbol, narrow symbol: Style, Source, Direction, DType, storage type;`:
/// the one list from which the kernel crate defines the entry points and [`KernelName`] its
/// table, so the two cannot disagree.
macro_rules! for_each_kernel {
    ($m:ident) => {
        $m! {
            rope_interleaved_table_fwd_f32, rope_interleaved_table_fwd_f32_narrow: Interleaved, Table, Forward, F32, f32;
            rope_interleaved_table_bwd_f32, rope_interleaved_table_bwd_f32_narrow: Interleaved, Table, Backward, F32, f32;
            rope_interleaved_theta_fwd_f32, rope_interleaved_theta_fwd_f32_narrow: Interleaved, Theta, Forward, F32, f32;
            rope_interleaved_theta_bwd_f32, rope_interleaved_theta_bwd_f32_narrow: Interleaved, Theta, Backward, F32, f32;
            rope_neox_table_fwd_f32, rope_neox_table_fwd_f32_narrow: Neox, Table, Forward, F32, f32;
            rope_neox_table_bwd_f32, rope_neox_table_bwd_f32_narrow: Neox, Table, Backward, F32, f32;
            rope_neox_theta_fwd_f32, rope_neox_theta_fwd_f32_narrow: Neox, Theta, Forward, F32, f32;
            rope_neox_theta_bwd_f32, rope_neox_theta_bwd_f32_narrow: Neox, Theta, Backward, F32, f32;
            rope_interleaved_table_fwd_f16, rope_interleaved_table_fwd_f16_narrow: Interleaved, Table, Forward, F16, Half;
            rope_interleaved_table_bwd_f16, rope_interleaved_table_bwd_f16_narrow: Interleaved, Table, Backward, F16, Half;
            rope_interleaved_theta_fwd_f16, rope_interleaved_theta_fwd_f16_narrow: Interleaved, Theta, Forward, F16, Half;
            rope_interleaved_theta_bwd_f16, rope_interleaved_theta_bwd_f16_narrow: Interleaved, Theta, Backward, F16, Half;
            rope_neox_table_fwd_f16, rope_neox_table_fwd_f16_narrow: Neox, Table, Forward, F16, Half;
            rope_neox_table_bwd_f16, rope_neox_table_bwd_f16_narrow: Neox, Table, Backward, F16, Half;
            rope_neox_theta_fwd_f16, rope_neox_theta_fwd_f16_narrow: Neox, Theta, Forward, F16, Half;
            rope_neox_theta_bwd_f16, rope_neox_theta_bwd_f16_narrow: Neox, Theta, Backward, F16, Half;
            rope_interleaved_table_fwd_bf16, rope_interleaved_table_fwd_bf16_narrow: Interleaved, Table, Forward, BF16, Bf16;
            rope_interleaved_table_bwd_bf16, rope_interleaved_table_bwd_bf16_narrow: Interleaved, Table, Backward, BF16, Bf16;
            rope_interleaved_theta_fwd_bf16, rope_interleaved_theta_fwd_bf16_narrow: Interleaved, Theta, Forward, BF16, Bf16;
            rope_interleaved_theta_bwd_bf16, rope_interleaved_theta_bwd_bf16_narrow: Interleaved, Theta, Backward, BF16, Bf16;
            rope_neox_table_fwd_bf16, rope_neox_table_fwd_bf16_narrow: Neox, Table, Forward, BF16, Bf16;
            rope_neox_table_bwd_bf16, rope_neox_table_bwd_bf16_narrow: Neox, Table, Backward, BF16, Bf16;
            rope_neox_theta_fwd_bf16, rope_neox_theta_fwd_bf16_narrow: Neox, Theta, Forward, BF16, Bf16;
            rope_neox_theta_bwd_bf16, rope_neox_theta_bwd_bf16_narrow: Neox, Theta, Backward, BF16, Bf16;
        }
    };
}
#[cfg_attr(not(target_arch = "nvptx64"), allow(unused_imports))]
pub(crate) use for_each_kernel;

impl KernelName {
    /// The blocks per multiprocessor this kernel's launch bounds promise (its `.minnctapersm`):
    /// 1280 threads' worth for the wide NeoX kernels of 16-bit elements, which then fit in 48
    /// registers without spilling (on an H200 partial rotary gained 4-5.5 points of copy
    /// bandwidth, the full-width cases lost 0-1.3: docs/perf.md v15), [`MIN_BLOCKS_PER_SM`]
    /// (1024 threads) otherwise. f16 with computed sin/cos stays at 1024 threads: at 48
    /// registers it spilled and ran 3% slower.
    pub const fn min_blocks_per_sm(self) -> u32 {
        match (self.style, self.access, self.dtype, self.source) {
            (RopeStyle::Neox, Access::Wide, DType::BF16, _)
            | (RopeStyle::Neox, Access::Wide, DType::F16, SinCosSource::Table) => {
                1280 / BLOCK_THREADS
            }
            _ => MIN_BLOCKS_PER_SM,
        }
    }
}

/// Defines [`KernelName::ALL`] and [`KernelName::symbol`] from the kernel list.
macro_rules! kernel_table {
    ($($sym:ident, $narrow:ident: $style:ident, $src:ident, $dir:ident, $dt:ident, $t:ty;)*) => {
        impl KernelName {
            /// Every kernel, in the order the host loads them.
            pub const ALL: [KernelName; 2 * [$(stringify!($sym)),*].len()] = [$(
                KernelName {
                    style: RopeStyle::$style,
                    source: SinCosSource::$src,
                    direction: Direction::$dir,
                    dtype: DType::$dt,
                    access: Access::Wide,
                },
                KernelName {
                    style: RopeStyle::$style,
                    source: SinCosSource::$src,
                    direction: Direction::$dir,
                    dtype: DType::$dt,
                    access: Access::Narrow,
                },
            )*];

            /// The exported PTX symbol; the match is exhaustive, so an option without a kernel
            /// does not compile.
            pub const fn symbol(self) -> &'static str {
                match (self.style, self.source, self.direction, self.dtype, self.access) {
                    $(
                        (RopeStyle::$style, SinCosSource::$src, Direction::$dir, DType::$dt,
                            Access::Wide) => stringify!($sym),
                        (RopeStyle::$style, SinCosSource::$src, Direction::$dir, DType::$dt,
                            Access::Narrow) => stringify!($narrow),
                    )*
                }
            }
        }
    };
}
for_each_kernel!(kernel_table);

/// A table-building kernel (`kernels-gpu/src/table.rs`): `rope_table_{dtype}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TableKernelName {
    /// Element type of the tables.
    pub dtype: DType,
}

/// Calls `$m!` with every table kernel as `symbol: DType, storage type;`.
macro_rules! for_each_table_kernel {
    ($m:ident) => {
        $m! {
            rope_table_f32: F32, f32;
            rope_table_f16: F16, Half;
            rope_table_bf16: BF16, Bf16;
        }
    };
}
#[cfg_attr(not(target_arch = "nvptx64"), allow(unused_imports))]
pub(crate) use for_each_table_kernel;

/// Defines [`TableKernelName::ALL`] and [`TableKernelName::symbol`] from the kernel list.
macro_rules! table_kernel_table {
    ($($sym:ident: $dt:ident, $t:ty;)*) => {
        impl TableKernelName {
            /// Every table kernel.
            pub const ALL: [TableKernelName; [$(stringify!($sym)),*].len()] =
                [$(TableKernelName { dtype: DType::$dt }),*];

            /// The exported PTX symbol.
            pub const fn symbol(self) -> &'static str {
                match self.dtype {
                    $(DType::$dt => stringify!($sym),)*
                }
            }
        }
    };
}
for_each_table_kernel!(table_kernel_table);

/// Every exported symbol of the PTX module: the RoPE kernels, then the table builders.
pub fn all_symbols() -> impl Iterator<Item = &'static str> {
    KernelName::ALL.into_iter().map(KernelName::symbol).chain(
        TableKernelName::ALL
            .into_iter()
            .map(TableKernelName::symbol),
    )
}
