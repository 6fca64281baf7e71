//! The launch contract between the host library and the kernels: the option enums, the kernel
//! names, the codes passed as `u32` arguments, and the limits both sides assume. One
//! definition, used by both (`rope-host` re-exports the public enums).

/// Threads per block of every RoPE kernel launch.
pub const BLOCK_THREADS: u32 = 256;

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

/// Element types the kernels load and store (arithmetic is `f32`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// `f32`.
    F32,
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

/// One kernel entry point: `rope_{style}_{source}_{direction}_{dtype}`, for example
/// `rope_neox_theta_fwd_f32`. Every combination exists and has the same parameter list.
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
}

impl KernelName {
    /// Every kernel, in the order the host loads them.
    pub const ALL: [KernelName; 8] = {
        use Direction::*;
        use RopeStyle::*;
        use SinCosSource::*;
        const fn k(style: RopeStyle, source: SinCosSource, direction: Direction) -> KernelName {
            KernelName {
                style,
                source,
                direction,
                dtype: DType::F32,
            }
        }
        [
            k(Interleaved, Table, Forward),
            k(Interleaved, Table, Backward),
            k(Interleaved, Theta, Forward),
            k(Interleaved, Theta, Backward),
            k(Neox, Table, Forward),
            k(Neox, Table, Backward),
            k(Neox, Theta, Forward),
            k(Neox, Theta, Backward),
        ]
    };

    /// The exported PTX symbol; exhaustive, so a new option cannot be left without a kernel.
    pub const fn symbol(self) -> &'static str {
        use Direction::*;
        use RopeStyle::*;
        use SinCosSource::*;
        match (self.style, self.source, self.direction, self.dtype) {
            (Interleaved, Table, Forward, DType::F32) => "rope_interleaved_table_fwd_f32",
            (Interleaved, Table, Backward, DType::F32) => "rope_interleaved_table_bwd_f32",
            (Interleaved, Theta, Forward, DType::F32) => "rope_interleaved_theta_fwd_f32",
            (Interleaved, Theta, Backward, DType::F32) => "rope_interleaved_theta_bwd_f32",
            (Neox, Table, Forward, DType::F32) => "rope_neox_table_fwd_f32",
            (Neox, Table, Backward, DType::F32) => "rope_neox_table_bwd_f32",
            (Neox, Theta, Forward, DType::F32) => "rope_neox_theta_fwd_f32",
            (Neox, Theta, Backward, DType::F32) => "rope_neox_theta_bwd_f32",
        }
    }
}
