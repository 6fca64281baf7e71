//! The public description of a RoPE operation: the tensors and how they are read and written,
//! and [`RopeOp`], which bundles the configuration ([`crate::RopeConfig`]) with the position
//! and sin/cos options ([`crate::Positions`], [`crate::SinCos`]).

use cudarc::driver::{CudaView, CudaViewMut};

use crate::config::RopeConfig;
use crate::layout::Layout;
use crate::positions::Positions;
use crate::sincos::SinCos;

/// A read-only tensor: a device buffer and where in it the elements are.
#[derive(Debug)]
pub struct Tensor<'a, T> {
    /// The buffer.
    pub data: CudaView<'a, T>,
    /// The layout inside it.
    pub layout: Layout,
}

/// A written tensor: a device buffer and where in it the elements are.
#[derive(Debug)]
pub struct TensorMut<'a, T> {
    /// The buffer.
    pub data: CudaViewMut<'a, T>,
    /// The layout inside it.
    pub layout: Layout,
}

/// One rotated tensor: in place, or from an input into an output of the same dimensions (the
/// strides may differ).
#[derive(Debug)]
pub enum Io<'a, T> {
    /// `x <- rope(x)`.
    InPlace(TensorMut<'a, T>),
    /// `output <- rope(input)`; the two must not overlap. Pass-through elements are copied.
    OutOfPlace {
        /// Read only.
        input: Tensor<'a, T>,
        /// Written only.
        output: TensorMut<'a, T>,
    },
}

/// q and k rotated by one launch, sharing each token's sin/cos (GQA/MQA head counts may
/// differ).
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // Built once per launch and consumed at once.
pub enum QkIo<'a, T> {
    /// q and k in their own buffers, each in or out of place.
    Separate {
        /// The query tensor.
        q: Io<'a, T>,
        /// The key tensor.
        k: Io<'a, T>,
    },
    /// q and k as two layouts in one buffer, rotated in place: the q and k parts of a packed
    /// QKV projection. Their elements must not meet.
    Packed {
        /// The buffer holding both.
        data: CudaViewMut<'a, T>,
        /// The query layout in it.
        q: Layout,
        /// The key layout in it.
        k: Layout,
    },
}

/// A complete RoPE operation except the tensors it rotates.
#[derive(Debug)]
pub struct RopeOp<'a, T> {
    /// Head size, rotated features, pairing and direction.
    pub config: RopeConfig,
    /// Where positions come from.
    pub positions: Positions<'a>,
    /// Where sin/cos come from.
    pub sincos: SinCos<'a, T>,
}
