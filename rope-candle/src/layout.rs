//! candle's `Layout` (shape, strides, start offset) as rope-host's `Layout::strided`.

use candle_core::Layout as CandleLayout;

use crate::error::{Error, invalid};

/// Which axis of a 4-D candle tensor is batch, sequence, heads and head features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axes {
    /// `[batch, heads, seq, head_dim]`, as `candle_nn::rotary_emb::{rope, rope_i}` take `xs`.
    Bhsd,
    /// `[batch, seq, heads, head_dim]`, as `candle_nn::rotary_emb::rope_thd` takes `xs`.
    Bshd,
}

impl Axes {
    /// The candle dimension holding batch, sequence, heads and head features, in that order.
    fn order(self) -> [usize; 4] {
        match self {
            Axes::Bhsd => [0, 2, 1, 3],
            Axes::Bshd => [0, 1, 2, 3],
        }
    }

    /// `[batch, seq, heads, head_dim]` of a tensor with candle dimensions `dims`.
    pub(crate) fn bshd(self, arg: &'static str, dims: &[usize]) -> Result<[usize; 4], Error> {
        let dims: &[usize; 4] = dims
            .try_into()
            .map_err(|_| invalid(arg, format!("expected 4 dimensions, got {dims:?}")))?;
        Ok(self.order().map(|i| dims[i]))
    }
}

/// rope-host's view of `layout` (no copy): the same elements, with rope-host's axes.
///
/// # Errors
/// [`Error::Invalid`] naming `arg` when the tensor is not 4-D or its head features are not
/// contiguous (last stride other than 1, which the kernels need).
pub(crate) fn to_rope(
    arg: &'static str,
    layout: &CandleLayout,
    axes: Axes,
) -> Result<rope_host::Layout, Error> {
    let dims = axes.bshd(arg, layout.dims())?;
    let stride = layout.stride();
    let order = axes.order();
    let strides = order.map(|i| stride[i]);
    if dims[3] > 1 && strides[3] != 1 {
        return Err(invalid(
            arg,
            format!("the last dimension must be contiguous (stride 1), got strides {stride:?}"),
        ));
    }
    // A single-feature head has any last stride; rope-host asks for 1, which addresses the same
    // element.
    let strides = [strides[0], strides[1], strides[2], 1];
    Ok(rope_host::Layout::strided(
        dims,
        strides,
        layout.start_offset(),
    )?)
}

/// The contiguous candle layout of `shape`, as rope-host's view with `axes`.
pub(crate) fn contiguous(
    arg: &'static str,
    shape: &candle_core::Shape,
    axes: Axes,
) -> Result<rope_host::Layout, Error> {
    to_rope(arg, &CandleLayout::contiguous(shape.clone()), axes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bhsd_transposed_view_keeps_strides_and_offset() {
        // A [2, 3, 5, 8] tensor narrowed along seq from element 1: offset 8, strides unchanged.
        let l = CandleLayout::contiguous((2, 3, 6, 8))
            .narrow(2, 1, 5)
            .unwrap();
        let r = to_rope("xs", &l, Axes::Bhsd).unwrap();
        let expected = rope_host::Layout::strided([2, 5, 3, 8], [144, 8, 48, 1], 8).unwrap();
        assert_eq!(r, expected);
    }

    #[test]
    fn rejects_non_contiguous_features_and_wrong_rank() {
        let l = CandleLayout::contiguous((2, 3, 4, 8))
            .transpose(2, 3)
            .unwrap();
        let err = to_rope("xs", &l, Axes::Bshd).unwrap_err();
        assert!(matches!(err, Error::Invalid { arg: "xs", .. }), "{err}");
        let l = CandleLayout::contiguous((3, 4, 8));
        let err = to_rope("xs", &l, Axes::Bshd).unwrap_err();
        assert!(matches!(err, Error::Invalid { arg: "xs", .. }), "{err}");
    }
}
