//! Where a tensor's elements are: `[batch, seq, heads, head_dim]` dimensions, the element
//! strides of the first three (the last dimension is contiguous) and an element offset from the
//! start of the buffer.

use crate::error::{Result, invalid};

/// The layout of a rotated tensor. Element `(b, s, h, e)` is at
/// `offset + b * stride_batch + s * stride_seq + h * stride_head + e` of its buffer.
///
/// | constructor | shape | strides `(batch, seq, head)` |
/// |---|---|---|
/// | [`Layout::bshd`] | `[batch, seq, heads, d]` | `(seq*heads*d, heads*d, d)` |
/// | [`Layout::sbhd`] | `[seq, batch, heads, d]` (time-major) | `(heads*d, batch*heads*d, d)` |
/// | [`Layout::shd`] | `[seq, heads, d]` (3-D, one batch row) | `(seq*heads*d, heads*d, d)` |
/// | [`Layout::thd`] | `[total_tokens, heads, d]` (packed, see `Positions::Varlen`) | as `shd` |
/// | [`Layout::strided`] | any, last stride 1 | given |
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub(crate) batch: usize,
    pub(crate) seq: usize,
    pub(crate) heads: usize,
    pub(crate) head_dim: usize,
    /// Element strides of batch, seq and head.
    pub(crate) strides: [usize; 3],
    /// Elements from the start of the buffer to element `(0, 0, 0, 0)`.
    pub(crate) offset: usize,
}

impl Layout {
    /// A contiguous row-major `[batch, seq, heads, head_dim]` tensor.
    pub fn bshd(batch: usize, seq: usize, heads: usize, head_dim: usize) -> Self {
        let sh = head_dim;
        let ss = heads.saturating_mul(sh);
        let sb = seq.saturating_mul(ss);
        Self {
            batch,
            seq,
            heads,
            head_dim,
            strides: [sb, ss, sh],
            offset: 0,
        }
    }

    /// A contiguous time-major `[seq, batch, heads, head_dim]` tensor (Megatron's `sbhd`).
    pub fn sbhd(seq: usize, batch: usize, heads: usize, head_dim: usize) -> Self {
        let sh = head_dim;
        let sb = heads.saturating_mul(sh);
        let ss = batch.saturating_mul(sb);
        Self {
            batch,
            seq,
            heads,
            head_dim,
            strides: [sb, ss, sh],
            offset: 0,
        }
    }

    /// A contiguous 3-D `[seq, heads, head_dim]` tensor: one batch row.
    pub fn shd(seq: usize, heads: usize, head_dim: usize) -> Self {
        Self::bshd(1, seq, heads, head_dim)
    }

    /// Packed variable-length sequences `[total_tokens, heads, head_dim]`, as flash-attention's
    /// varlen functions take them; pair with `Positions::Varlen` or `[total_tokens]` ids.
    pub fn thd(total_tokens: usize, heads: usize, head_dim: usize) -> Self {
        Self::shd(total_tokens, heads, head_dim)
    }

    /// Any strided view with a contiguous last dimension: `dims = [batch, seq, heads,
    /// head_dim]`, `strides` in elements, `offset` in elements from the buffer start. For
    /// example the q part of a fused QKV projection `[batch, seq, hq + 2 hk, d]` is
    /// `strided([b, s, hq, d], [s * (hq + 2 hk) * d, (hq + 2 hk) * d, d, 1], 0)` and its k part
    /// the same with `hk` heads at offset `hq * d`.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `layout` when the last stride is not 1 (the kernels
    /// need contiguous heads).
    pub fn strided(dims: [usize; 4], strides: [usize; 4], offset: usize) -> Result<Self> {
        if strides[3] != 1 {
            return Err(invalid(
                "layout",
                format!(
                    "the last dimension must be contiguous (stride 1), got stride {}",
                    strides[3]
                ),
            ));
        }
        let [batch, seq, heads, head_dim] = dims;
        Ok(Self {
            batch,
            seq,
            heads,
            head_dim,
            strides: [strides[0], strides[1], strides[2]],
            offset,
        })
    }

    /// This layout moved `offset` elements into its buffer.
    pub fn with_offset(mut self, offset: usize) -> Self {
        self.offset = offset;
        self
    }

    /// Batch rows.
    pub fn batch(&self) -> usize {
        self.batch
    }
    /// Tokens per batch row.
    pub fn seq(&self) -> usize {
        self.seq
    }
    /// Heads per token.
    pub fn heads(&self) -> usize {
        self.heads
    }
    /// Elements per head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    /// Element strides of the batch, seq and head dimensions.
    pub fn strides(&self) -> [usize; 3] {
        self.strides
    }
    /// Elements from the buffer start to the first element.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.batch == 0 || self.seq == 0 || self.heads == 0 || self.head_dim == 0
    }

    /// Elements from the first addressed element to one past the last (without the offset);
    /// `None` on overflow, zero for an empty tensor.
    pub fn span(&self) -> Option<usize> {
        if self.is_empty() {
            return Some(0);
        }
        let [sb, ss, sh] = self.strides;
        (self.batch - 1)
            .checked_mul(sb)?
            .checked_add((self.seq - 1).checked_mul(ss)?)?
            .checked_add((self.heads - 1).checked_mul(sh)?)?
            .checked_add(self.head_dim)
    }

    /// Elements from the buffer start to one past the last addressed element; `None` on
    /// overflow.
    pub fn end(&self) -> Option<usize> {
        self.span()?.checked_add(self.offset)
    }

    /// Whether no two `(b, s, h, e)` share an element: with the dimensions sorted by stride,
    /// each stride reaches past everything the inner dimensions cover.
    pub(crate) fn is_non_overlapping(&self) -> bool {
        // An empty tensor has no elements, so no two of them can meet, whatever its strides.
        self.is_empty() || footprint_is_disjoint(self, self.head_dim, self.heads, self.strides[2])
    }
}

/// Whether the token grid of `l` (its batch and seq dimensions) never makes two tokens' element
/// sets meet, where each token covers `heads` heads of `head_dim` elements at stride
/// `head_stride`, or, for `heads == 1`, one run of `head_dim` elements.
pub(crate) fn footprint_is_disjoint(
    l: &Layout,
    head_dim: usize,
    heads: usize,
    head_stride: usize,
) -> bool {
    let mut dims = [
        (heads, head_stride),
        (l.seq, l.strides[1]),
        (l.batch, l.strides[0]),
    ];
    dims.sort_by_key(|&(_, stride)| stride);
    let mut covered = head_dim;
    for (n, stride) in dims {
        if n <= 1 {
            continue;
        }
        if stride < covered {
            return false;
        }
        match (n - 1)
            .checked_mul(stride)
            .and_then(|v| v.checked_add(covered))
        {
            Some(c) => covered = c,
            None => return false,
        }
    }
    true
}

/// Whether the q and k layouts, sharing one buffer, address disjoint elements: they must share
/// batch and seq dimensions and strides, each token's q heads and k heads must occupy disjoint
/// element ranges, and tokens must not meet.
pub(crate) fn packed_are_disjoint(q: &Layout, k: &Layout) -> bool {
    if q.batch != k.batch || q.seq != k.seq || q.strides[..2] != k.strides[..2] {
        return false;
    }
    let range = |l: &Layout| -> Option<(usize, usize)> {
        let len = (l.heads.checked_sub(1)?)
            .checked_mul(l.strides[2])?
            .checked_add(l.head_dim)?;
        Some((l.offset, l.offset.checked_add(len)?))
    };
    let (Some((q0, q1)), Some((k0, k1))) = (range(q), range(k)) else {
        return q.is_empty() || k.is_empty();
    };
    if q0 < k1 && k0 < q1 {
        return false;
    }
    q.is_non_overlapping()
        && k.is_non_overlapping()
        && footprint_is_disjoint(q, q1.max(k1) - q0.min(k0), 1, 0)
}

/// Whether two layouts of `es`-byte elements starting at addresses `a.0` and `b.0` (views of one
/// buffer, such as column ranges of its rows) address no common element: each rebased to the
/// lower address, they are checked as packed tensors are ([`packed_are_disjoint`]). False when
/// the addresses lie a fraction of an element apart or the rebased offsets overflow.
pub(crate) fn apart_in_one_buffer(a: (u64, &Layout), b: (u64, &Layout), es: usize) -> bool {
    let low = a.0.min(b.0);
    let rebased = |(ptr, l): (u64, &Layout)| -> Option<Layout> {
        let bytes = usize::try_from(ptr - low).ok()?;
        let elements = bytes.is_multiple_of(es).then_some(bytes / es)?;
        Some(Layout {
            offset: l.offset.checked_add(elements)?,
            ..*l
        })
    };
    match (rebased(a), rebased(b)) {
        (Some(a), Some(b)) => packed_are_disjoint(&a, &b),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standard_layouts_do_not_overlap() {
        for l in [
            Layout::bshd(3, 5, 7, 8),
            Layout::sbhd(5, 3, 7, 8),
            Layout::thd(11, 2, 4),
        ] {
            assert!(l.is_non_overlapping(), "{l:?}");
        }
        assert_eq!(Layout::bshd(3, 5, 7, 8).span(), Some(3 * 5 * 7 * 8));
        assert_eq!(Layout::sbhd(5, 3, 7, 8).span(), Some(3 * 5 * 7 * 8));
    }

    #[test]
    fn broadcast_and_short_strides_overlap() {
        let head_stride_too_small =
            Layout::strided([1, 4, 2, 8], [64, 16, 4, 1], 0).expect("valid");
        assert!(!head_stride_too_small.is_non_overlapping());
        let broadcast_seq = Layout::strided([2, 4, 2, 8], [16, 0, 8, 1], 0).expect("valid");
        assert!(!broadcast_seq.is_non_overlapping());
    }

    #[test]
    fn rejects_non_contiguous_last_dimension() {
        assert!(Layout::strided([1, 1, 1, 4], [4, 4, 4, 2], 0).is_err());
    }

    /// vLLM's MLA rows `[blocks 3, rows 4, 512 + 64]` of 2-byte elements, read as a latent view
    /// (columns 0..512, at the buffer's address) and a rotated-k view (columns 512..576, 1024
    /// bytes further): apart; columns that meet, a distance of half an element, or blocks whose
    /// rows run into the next block's are not.
    #[test]
    fn column_ranges_of_one_buffers_rows_are_apart_when_their_columns_are() {
        let row = 576;
        let view = |width: usize, block: usize| {
            Layout::strided([3, 4, 1, width], [block, row, width, 1], 0).expect("valid")
        };
        let (latent, rotated) = (view(512, 4 * row), view(64, 4 * row));
        let base = 1u64 << 40;
        assert!(apart_in_one_buffer(
            (base, &latent),
            (base + 1024, &rotated),
            2
        ));
        assert!(apart_in_one_buffer(
            (base + 1024, &rotated),
            (base, &latent),
            2
        ));
        assert!(!apart_in_one_buffer(
            (base, &latent),
            (base + 1022, &rotated),
            2
        ));
        assert!(!apart_in_one_buffer(
            (base, &latent),
            (base + 1025, &rotated),
            2
        ));
        let short = (view(512, 3 * row), view(64, 3 * row));
        assert!(!apart_in_one_buffer(
            (base, &short.0),
            (base + 1024, &short.1),
            2
        ));
    }

    #[test]
    fn q_and_k_views_of_a_fused_qkv_buffer_are_disjoint() {
        // [batch 2, seq 3, hq 4 + hk 2 + hv 2 heads, d 8]
        let (hq, hk, d) = (4, 2, 8);
        let token = (hq + 2 * hk) * d;
        let q = Layout::strided([2, 3, hq, d], [3 * token, token, d, 1], 0).expect("valid");
        let k = Layout::strided([2, 3, hk, d], [3 * token, token, d, 1], hq * d).expect("valid");
        assert!(packed_are_disjoint(&q, &k));
        // k overlapping q's last head is refused.
        assert!(!packed_are_disjoint(&q, &k.with_offset((hq - 1) * d)));
    }
}
