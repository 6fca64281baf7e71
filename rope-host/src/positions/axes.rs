//! Which position axis each rotated pair takes its position from ([`super::Positions::MultiAxis`]):
//! the checked host map ([`AxisMap`], with the published mRoPE, interleaved mRoPE and FLUX
//! layouts), its upload ([`DeviceAxisMap`]) and its raw form ([`RawAxisMap`]).

use cudarc::driver::{CudaSlice, DevicePtr};
use rope_kernels::abi::{GroupAxes, MAX_AXES};

use crate::bind::RawBuf;
use crate::error::{Result, invalid};

/// Which position axis each rotated pair `j < rotary_dim / 2` takes its position from, for
/// [`super::Positions::MultiAxis`]; checked on construction (every entry below `n_axes`, `n_axes` in
/// `1..=4`) and uploaded once by [`crate::Rope::axis_map`].
///
/// ```
/// use rope_host::AxisMap;
/// // Qwen2.5-VL-7B: head_dim 128, mrope_section [16, 24, 24].
/// let map = AxisMap::mrope([16, 24, 24], 128)?;
/// assert_eq!((map.n_axes(), &map.axes()[14..18]), (3, &[0, 0, 1, 1][..]));
/// # Ok::<(), rope_host::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AxisMap {
    n_axes: u32,
    axes: Vec<u8>,
}

impl AxisMap {
    /// A map of `n_axes` axes, `axes[j]` the axis of pair `j`.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `axes` when `n_axes` is outside `1..=4`, the map is
    /// empty or an entry is not below `n_axes`.
    pub fn new(n_axes: u32, axes: Vec<u8>) -> Result<Self> {
        if !(1..=MAX_AXES).contains(&n_axes) {
            return Err(invalid(
                "axes",
                format!("n_axes must lie in 1..={MAX_AXES}, got {n_axes}"),
            ));
        }
        if axes.is_empty() {
            return Err(invalid("axes", "the map must cover at least one pair"));
        }
        if let Some((j, a)) = axes
            .iter()
            .enumerate()
            .find(|(_, a)| u32::from(**a) >= n_axes)
        {
            return Err(invalid(
                "axes",
                format!("pair {j} takes axis {a}, but there are {n_axes} axes"),
            ));
        }
        Ok(Self { n_axes, axes })
    }

    /// Qwen2-VL's and Qwen2.5-VL's mRoPE: `mrope_section = [s_t, s_h, s_w]` with
    /// `s_t + s_h + s_w = rotary_dim / 2`; pairs `0..s_t` take the temporal position (axis 0),
    /// the next `s_h` the height (axis 1), the last `s_w` the width (axis 2).
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `mrope_section` when the sections do not sum to
    /// `rotary_dim / 2`, and `rotary_dim` when it is odd or below 2.
    pub fn mrope(mrope_section: [u32; 3], rotary_dim: u32) -> Result<Self> {
        let half = check_sections(mrope_section, rotary_dim)?;
        let axes = (0..half)
            .map(|j| {
                if j < mrope_section[0] {
                    0
                } else if j < mrope_section[0] + mrope_section[1] {
                    1
                } else {
                    2
                }
            })
            .collect();
        Self::new(3, axes)
    }

    /// Qwen3-VL's interleaved mRoPE (`mrope_interleaved`), as transformers'
    /// `apply_interleaved_mrope` assigns it: pair `j` takes the height (axis 1) when
    /// `j % 3 == 1` and `j < 3 s_h`, the width (axis 2) when `j % 3 == 2` and `j < 3 s_w`, and
    /// the temporal position (axis 0) otherwise (`[T H W T H W ... T T]`).
    ///
    /// # Errors
    /// As [`AxisMap::mrope`].
    pub fn mrope_interleaved(mrope_section: [u32; 3], rotary_dim: u32) -> Result<Self> {
        let half = check_sections(mrope_section, rotary_dim)?;
        let axes = (0..half)
            .map(|j| match j % 3 {
                1 if j < 3 * mrope_section[1] => 1,
                2 if j < 3 * mrope_section[2] => 2,
                _ => 0,
            })
            .collect();
        Self::new(3, axes)
    }

    /// FLUX's N-D axial RoPE (`EmbedND`): axis `a` owns a contiguous block of
    /// `axes_dim[a] / 2` pairs, in axis order. Its frequencies, `theta^(-2i / axes_dim[a])`
    /// within each block, come from [`crate::RopeScaling::Axial`].
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `axes_dim` when it has no entry or more than 4, an
    /// entry is odd or zero, or the entries do not sum to `rotary_dim`.
    pub fn axial(axes_dim: &[u32], rotary_dim: u32) -> Result<Self> {
        check_axes_dim(axes_dim, rotary_dim)?;
        let axes = axes_dim
            .iter()
            .enumerate()
            .flat_map(|(a, &d)| std::iter::repeat_n(a as u8, d as usize / 2))
            .collect();
        Self::new(axes_dim.len() as u32, axes)
    }

    /// Number of position axes (rows of the positions array).
    pub fn n_axes(&self) -> u32 {
        self.n_axes
    }

    /// The axis of each pair.
    pub fn axes(&self) -> &[u8] {
        &self.axes
    }

    /// What a launch needs of the map to read one position per work item where it can.
    pub fn item_axes(&self) -> ItemAxes {
        ItemAxes {
            groups: ItemAxes::PAIRS.map(|pairs| GroupAxes::new(&self.axes, pairs as usize)),
        }
    }
}

/// An axis map's groups of 1, 2 and 4 consecutive pairs (the pairs of one work item, by access
/// width) where each group lies on one axis: a launch whose work items' pairs all share an axis
/// reads one position per item, as one-position launches do, instead of one per pair through
/// the map. [`ItemAxes::UNKNOWN`] for a map known only by address: every pair then reads its
/// axis from the map. Made by [`AxisMap::item_axes`]; the map's [`DeviceAxisMap::raw`] carries
/// it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ItemAxes {
    groups: [Option<GroupAxes>; 3],
}

impl ItemAxes {
    /// Nothing known of the map's contents.
    pub const UNKNOWN: Self = Self { groups: [None; 3] };

    /// The pairs per work item of each entry (1, 2 or 4: `preferred_lanes` is at most 4 NeoX
    /// pairs or 8 interleaved elements).
    const PAIRS: [u32; 3] = [1, 2, 4];

    /// The groups' axes for `pairs` pairs per work item, when each group lies on one axis.
    pub(crate) fn for_pairs(self, pairs: u32) -> Option<GroupAxes> {
        let i = Self::PAIRS.iter().position(|&p| p == pairs)?;
        *self.groups.get(i)?
    }
}

/// Checks `mrope_section` against `rotary_dim`; returns `rotary_dim / 2`.
fn check_sections(sections: [u32; 3], rotary_dim: u32) -> Result<u32> {
    if rotary_dim < 2 || !rotary_dim.is_multiple_of(2) {
        return Err(invalid(
            "rotary_dim",
            format!("must be even and at least 2, got {rotary_dim}"),
        ));
    }
    let sum: u64 = sections.iter().map(|&s| u64::from(s)).sum();
    if sum != u64::from(rotary_dim / 2) {
        return Err(invalid(
            "mrope_section",
            format!(
                "{sections:?} sums to {sum}, rotary_dim / 2 is {}",
                rotary_dim / 2
            ),
        ));
    }
    Ok(rotary_dim / 2)
}

/// Checks FLUX's `axes_dim` against `rotary_dim`: 1 to 4 even, nonzero entries summing to it.
pub(crate) fn check_axes_dim(axes_dim: &[u32], rotary_dim: u32) -> Result<()> {
    if !(1..=MAX_AXES as usize).contains(&axes_dim.len()) {
        return Err(invalid(
            "axes_dim",
            format!("needs 1 to {MAX_AXES} axes, got {}", axes_dim.len()),
        ));
    }
    if let Some(d) = axes_dim.iter().find(|&&d| d == 0 || !d.is_multiple_of(2)) {
        return Err(invalid(
            "axes_dim",
            format!("every axis needs an even, nonzero width, got {d} in {axes_dim:?}"),
        ));
    }
    let sum: u64 = axes_dim.iter().map(|&d| u64::from(d)).sum();
    if sum != u64::from(rotary_dim) {
        return Err(invalid(
            "axes_dim",
            format!("{axes_dim:?} sums to {sum}, rotary_dim is {rotary_dim}"),
        ));
    }
    Ok(())
}

/// An [`AxisMap`] on the device, made by [`crate::Rope::axis_map`]: complete when made, so
/// launches on any stream (and captured graphs) may read it.
#[derive(Debug)]
pub struct DeviceAxisMap {
    pub(crate) axes: CudaSlice<u8>,
    pub(crate) n_axes: u32,
    pub(crate) item_axes: ItemAxes,
}

impl DeviceAxisMap {
    /// Number of position axes.
    pub fn n_axes(&self) -> u32 {
        self.n_axes
    }

    /// Pairs covered (`rotary_dim / 2` of the launches it serves).
    pub fn pairs(&self) -> usize {
        self.axes.len()
    }

    /// The map by address, for [`super::RawPositions::MultiAxis`].
    pub fn raw(&self) -> RawAxisMap {
        let stream = self.axes.stream();
        // The map is never written after its upload, so no later use needs ordering after the
        // read this records.
        let ptr = self.axes.device_ptr(stream).0;
        RawAxisMap {
            axes: RawBuf {
                ptr,
                len: self.axes.len(),
            },
            n_axes: self.n_axes,
            item_axes: self.item_axes,
        }
    }
}

/// An axis map given by address: `axes.len` `u8` axis indices at `axes.ptr`, for `n_axes`
/// axes. Its values are device data: the kernel clamps each to `n_axes - 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawAxisMap {
    /// One `u8` per pair.
    pub axes: RawBuf,
    /// Rows of the positions array, 1 to 4.
    pub n_axes: u32,
    /// The map's groups of pairs that lie on one axis ([`AxisMap::item_axes`] of the map at
    /// `axes`), or [`ItemAxes::UNKNOWN`]. Groups that disagree with the device map give wrong
    /// positions, never an access outside the arrays.
    pub item_axes: ItemAxes,
}
