//! The launch contract between the host library and the kernels: the codes passed as `u32`
//! kernel arguments, and the limits both sides assume. One definition, used by both.

/// Threads per block of every RoPE kernel launch.
pub const BLOCK_THREADS: u32 = 256;

/// How the sin/cos of a (position, pair) is obtained, passed as the `sincos` argument.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SinCosCode {
    /// Read `cos[pos * half + i]` and `sin[pos * half + i]` from tables of `table_positions`
    /// rows of `half` values; a position outside `0..table_positions` yields NaN outputs.
    Table = 0,
    /// Compute `cos`/`sin` of `pos * theta^(-2i/rotary_dim)` with [`crate::math::rope_cos_sin`].
    Theta = 1,
}

impl SinCosCode {
    /// Decodes a kernel argument; `None` for an unknown code.
    #[inline(always)]
    pub fn from_u32(code: u32) -> Option<Self> {
        match code {
            0 => Some(Self::Table),
            1 => Some(Self::Theta),
            _ => None,
        }
    }
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
            _ => None,
        }
    }
}

/// The kernel entry points, one per (style, direction, dtype). Their exported names are
/// [`KernelName::symbol`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelName {
    /// `rope_interleaved_fwd_f32`
    InterleavedFwdF32,
    /// `rope_interleaved_bwd_f32`
    InterleavedBwdF32,
    /// `rope_neox_fwd_f32`
    NeoxFwdF32,
    /// `rope_neox_bwd_f32`
    NeoxBwdF32,
}

impl KernelName {
    /// Every kernel, in the order the host loads them.
    pub const ALL: [KernelName; 4] = [
        Self::InterleavedFwdF32,
        Self::InterleavedBwdF32,
        Self::NeoxFwdF32,
        Self::NeoxBwdF32,
    ];

    /// The exported PTX symbol.
    pub const fn symbol(self) -> &'static str {
        match self {
            Self::InterleavedFwdF32 => "rope_interleaved_fwd_f32",
            Self::InterleavedBwdF32 => "rope_interleaved_bwd_f32",
            Self::NeoxFwdF32 => "rope_neox_fwd_f32",
            Self::NeoxBwdF32 => "rope_neox_bwd_f32",
        }
    }
}
