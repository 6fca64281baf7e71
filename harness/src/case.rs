//! One RoPE problem, run on the GPU and by the f64 reference: the unit of the property tests
//! and of the demo.

use std::fmt::Debug;
use std::sync::Arc;

use anyhow::{Result, ensure};
use ndarray::{Array2, Array3, Array4};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use rope_host::cudarc::driver::{CudaSlice, CudaStream};
use rope_host::{
    AxisMap, ContextParallel, DeviceAxisMap, DeviceInts, Direction, Frequencies, FrequencySpec,
    IdsShape, Io, Layout, Positions, QkIo, Rope, RopeConfig, RopeOp, RopeScaling, RopeStyle,
    SinCos, TableFormat, TableShape, Tensor, TensorMut,
};

pub use crate::elem::TestElem;
use crate::tolerance::{self, Rotated};
use rope_reference::reference::{self, RefSinCos};

/// The element type of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DTypeCase {
    F32,
    F16,
    BF16,
}

/// Evaluates `$body` with the type `$T` set to the element type of `$dtype` (a
/// [`DTypeCase`]): the one place where a case's dtype becomes `f32`, `f16` or `bf16`.
///
/// ```
/// use rope_harness::case::{DTypeCase, TestElem};
/// use rope_harness::with_elem;
///
/// assert_eq!(with_elem!(DTypeCase::BF16, T => T::NAME), "bf16");
/// ```
#[macro_export]
macro_rules! with_elem {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::case::DTypeCase::F32 => {
                type $T = f32;
                $body
            }
            $crate::case::DTypeCase::F16 => {
                type $T = $crate::__private::f16;
                $body
            }
            $crate::case::DTypeCase::BF16 => {
                type $T = $crate::__private::bf16;
                $body
            }
        }
    };
}

/// How a case lays out its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayoutKind {
    /// Contiguous `[batch, seq, heads, d]`.
    Bshd,
    /// Contiguous time-major `[seq, batch, heads, d]`.
    Sbhd,
    /// `[batch, seq, heads, d]` with `gaps` extra elements after each head, token and batch
    /// row, starting `offset` elements into the buffer.
    Strided { gaps: [usize; 3], offset: usize },
}

/// Where sin/cos come from in a case.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Source {
    /// Tables of `max_position` rows built from `theta`, rounded once to the element type, or
    /// to `f32` when `in_f32` (`SinCos::TableF32`/`CosSinCacheF32`).
    Table {
        theta: f64,
        max_position: usize,
        format: TableFormat,
        in_f32: bool,
    },
    /// Computed in the kernel from `theta`.
    Theta(f64),
}

/// How positions are given in a case.
#[derive(Clone, Debug, PartialEq)]
pub enum PosCase {
    /// `offset + s`.
    Offset(u32),
    /// `offsets[b] + s`, uploaded as `i64` if `wide`, else `i32`.
    RowOffsets { offsets: Vec<u32>, wide: bool },
    /// Explicit ids (`[seq]` or `[batch, seq]`), uploaded as `i64` if `wide`, else `i32`.
    Ids {
        ids: Vec<i64>,
        wide: bool,
        shape: IdsShape,
    },
    /// Packed sequences (batch 1): `t - cu_seqlens[i] + offsets[i]`, uploaded as `i64` if
    /// `wide`, else `i32`.
    Varlen {
        cu_seqlens: Vec<u32>,
        offsets: Option<Vec<u32>>,
        wide: bool,
    },
    /// Packed sequences split over `size` context-parallel ranks, this one `rank`:
    /// `cu_seqlens` bound the whole sequences (lengths divisible by `2 * size`; the tensor holds
    /// `cu_seqlens[n] / size` tokens), uploaded as `i64` if `wide`, else `i32`.
    VarlenContextParallel {
        cu_seqlens: Vec<u32>,
        size: u32,
        rank: u32,
        wide: bool,
    },
    /// Multi-axis positions `[n_axes, batch * seq]` (axis-major), uploaded as `i64` if `wide`,
    /// else `i32`, with the axis map of `axes`.
    MultiAxis {
        positions: Vec<i64>,
        n_axes: usize,
        axes: AxesCase,
        wide: bool,
    },
}

/// Which axis each pair of a multi-axis case takes its position from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AxesCase {
    /// Qwen2-VL's `mrope_section` (3 axes).
    Mrope([usize; 3]),
    /// Qwen3-VL's interleaved `mrope_section` (3 axes).
    MropeInterleaved([usize; 3]),
    /// FLUX's `axes_dim`: also the frequencies, `theta^(-2i / axes_dim[a])` per axis.
    Axial(Vec<usize>),
    /// An arbitrary map of `n_axes` axes (one entry per pair).
    Map(Vec<u8>),
}

impl AxesCase {
    /// The host library's map for `rotary_dim`: what the launch uploads.
    pub fn host_map(&self, n_axes: usize, rotary_dim: usize) -> rope_host::Result<AxisMap> {
        let r = rotary_dim as u32;
        let sections = |s: &[usize; 3]| s.map(|v| v as u32);
        match self {
            Self::Mrope(s) => AxisMap::mrope(sections(s), r),
            Self::MropeInterleaved(s) => AxisMap::mrope_interleaved(sections(s), r),
            Self::Axial(d) => AxisMap::axial(&d.iter().map(|&v| v as u32).collect::<Vec<_>>(), r),
            Self::Map(m) => AxisMap::new(n_axes as u32, m.clone()),
        }
    }

    /// The reference's map, from the published formulas ([`reference::mrope_axes`], ...).
    pub fn reference_axes(&self) -> Vec<usize> {
        match self {
            Self::Mrope(s) => reference::mrope_axes(*s),
            Self::MropeInterleaved(s) => reference::mrope_interleaved_axes(*s),
            Self::Axial(d) => reference::axial(d, 1.0).0,
            Self::Map(m) => m.iter().map(|&a| a as usize).collect(),
        }
    }
}

/// The k tensor of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KCase {
    /// q alone.
    None,
    /// A separate k of `heads` heads, in or out of place like q.
    Separate { heads: usize },
    /// q, k and v heads in one `[batch, seq, hq + hk + hv, d]` buffer, q and k rotated in
    /// place; v must stay untouched.
    Packed { heads: usize, v_heads: usize },
}

/// A complete RoPE problem with its random input drawn from `seed`.
#[derive(Clone, Debug)]
pub struct Case {
    pub style: RopeStyle,
    pub direction: Direction,
    pub dtype: DTypeCase,
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    /// The first rotated element of each head.
    pub rotary_offset: usize,
    pub layout: LayoutKind,
    pub k: KCase,
    pub source: Source,
    pub positions: PosCase,
    pub in_place: bool,
    pub seed: u64,
}

/// The result of comparing a GPU output with the reference.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Comparison {
    /// Largest `|got - reference|` over finite reference values.
    pub max_abs_err: f64,
    /// Largest error as a fraction of its tolerance; `<= 1` passes.
    pub worst_ratio: f64,
    /// Elements compared.
    pub checked: usize,
}

impl Comparison {
    /// The worse of two comparisons.
    pub fn merge(self, o: Comparison) -> Comparison {
        Comparison {
            max_abs_err: self.max_abs_err.max(o.max_abs_err),
            worst_ratio: self.worst_ratio.max(o.worst_ratio),
            checked: self.checked + o.checked,
        }
    }
}

impl Case {
    /// The case's configuration.
    pub fn config(&self) -> rope_host::Result<RopeConfig> {
        RopeConfig::builder(self.head_dim as u32, self.style)
            .rotary_dim(self.rotary_dim as u32)
            .rotary_offset(self.rotary_offset as u32)
            .direction(self.direction)
            .build()
    }

    /// Heads of k (zero without k).
    pub fn k_heads(&self) -> usize {
        match self.k {
            KCase::None => 0,
            KCase::Separate { heads } | KCase::Packed { heads, .. } => heads,
        }
    }

    /// Elements RoPE reads, and as many it writes: the rotated ones of every q and k head in
    /// place, every element out of place.
    pub fn touched_elems(&self) -> usize {
        let per_head = if self.in_place {
            self.rotary_dim
        } else {
            self.head_dim
        };
        self.batch * self.seq * (self.heads + self.k_heads()) * per_head
    }

    /// The input layout of a tensor of `heads` heads (q and a separate k).
    pub fn layout(&self, heads: usize) -> Layout {
        let (b, s, d) = (self.batch, self.seq, self.head_dim);
        match self.layout {
            LayoutKind::Bshd => Layout::bshd(b, s, heads, d),
            LayoutKind::Sbhd => Layout::sbhd(s, b, heads, d),
            LayoutKind::Strided {
                gaps: [gh, gs, gb],
                offset,
            } => {
                let sh = d + gh;
                let ss = heads * sh + gs;
                let sb = s * ss + gb;
                Layout::strided([b, s, heads, d], [sb, ss, sh, 1], offset).expect("unit stride")
            }
        }
    }

    /// The layouts of q and k inside the fused buffer, and that buffer's length.
    pub fn packed_layouts(&self) -> (Layout, Layout, usize) {
        let KCase::Packed { heads: hk, v_heads } = self.k else {
            panic!("not a fused case")
        };
        let (b, s, hq, d) = (self.batch, self.seq, self.heads, self.head_dim);
        let token = (hq + hk + v_heads) * d;
        let q = Layout::strided([b, s, hq, d], [s * token, token, d, 1], 0).expect("unit stride");
        let k = Layout::strided([b, s, hk, d], [s * token, token, d, 1], hq * d).expect("unit");
        (q, k, b * s * token)
    }

    /// The position of every token on every axis, `[n_axes, batch, seq]`, and the axis of
    /// every pair (one axis, all pairs on it, for the one-position kinds).
    pub fn resolved_axes(&self) -> (Array3<i64>, Vec<usize>) {
        match &self.positions {
            PosCase::MultiAxis {
                positions,
                n_axes,
                axes,
                ..
            } => (
                Array3::from_shape_fn((*n_axes, self.batch, self.seq), |(a, b, s)| {
                    positions[(a * self.batch + b) * self.seq + s]
                }),
                axes.reference_axes(),
            ),
            _ => {
                let p = self.resolved_positions();
                (
                    p.clone()
                        .into_shape_with_order((1, self.batch, self.seq))
                        .expect("shape"),
                    vec![0; self.rotary_dim / 2],
                )
            }
        }
    }

    /// The frequency of every pair at `theta`: FLUX's per-axis frequencies for axial cases,
    /// `theta^(-2i / rotary_dim)` otherwise.
    pub fn inv_freq(&self, theta: f64) -> Vec<f64> {
        match &self.positions {
            PosCase::MultiAxis {
                axes: AxesCase::Axial(d),
                ..
            } => reference::axial(d, theta).1,
            _ => reference::inv_freq(theta, self.rotary_dim),
        }
    }

    /// Whether the case needs its own frequency vector (axial cases computed in the kernel).
    fn axial_dims(&self) -> Option<&[usize]> {
        match &self.positions {
            PosCase::MultiAxis {
                axes: AxesCase::Axial(d),
                ..
            } => Some(d),
            _ => None,
        }
    }

    /// The position of every token, `[batch, seq]` (for multi-axis cases, axis 0's).
    pub fn resolved_positions(&self) -> Array2<i64> {
        let split = match &self.positions {
            PosCase::VarlenContextParallel {
                cu_seqlens,
                size,
                rank,
                ..
            } => reference::context_parallel_positions(cu_seqlens, *size as usize, *rank as usize),
            _ => Vec::new(),
        };
        Array2::from_shape_fn((self.batch, self.seq), |(b, s)| match &self.positions {
            PosCase::Offset(o) => *o as i64 + s as i64,
            PosCase::RowOffsets { offsets, .. } => offsets[b] as i64 + s as i64,
            PosCase::Ids {
                ids,
                shape: IdsShape::Shared,
                ..
            } => ids[s],
            PosCase::Ids {
                ids,
                shape: IdsShape::PerRow,
                ..
            } => ids[b * self.seq + s],
            PosCase::Varlen {
                cu_seqlens,
                offsets,
                ..
            } => {
                let i = cu_seqlens.partition_point(|&c| c as usize <= s) - 1;
                let i = i.min(cu_seqlens.len() - 2);
                s as i64 - cu_seqlens[i] as i64 + offsets.as_ref().map_or(0, |o| o[i] as i64)
            }
            PosCase::VarlenContextParallel { .. } => split[s],
            PosCase::MultiAxis { positions, .. } => positions[b * self.seq + s],
        })
    }

    /// Random values in `[-4, 4)` rounded to `T`, from the seed and a stream number.
    fn random<T: TestElem>(&self, stream: u64, len: usize) -> Vec<T> {
        let mut rng = StdRng::seed_from_u64(self.seed ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        (0..len)
            .map(|_| T::from_f64(rng.random_range(-4.0..4.0)))
            .collect()
    }

    /// The host tables (cos, sin of `[max_position, rotary_dim / 2]`) rounded to what the
    /// device holds (`T`, or `f32` when `in_f32`), widened back to `f64`.
    fn tables<T: TestElem>(&self) -> Option<(Vec<f64>, Vec<f64>)> {
        match self.source {
            Source::Table {
                theta,
                max_position,
                in_f32,
                ..
            } => {
                let f = self.inv_freq(theta);
                let angle = Array2::from_shape_fn((max_position, self.rotary_dim / 2), |(p, i)| {
                    p as f64 * f[i]
                });
                let (c, s) = (angle.mapv(f64::cos), angle.mapv(f64::sin));
                let round = |v: f64| {
                    if in_f32 {
                        f64::from(v as f32)
                    } else {
                        T::from_f64(v).to_f64()
                    }
                };
                Some((
                    c.iter().map(|&v| round(v)).collect(),
                    s.iter().map(|&v| round(v)).collect(),
                ))
            }
            Source::Theta(_) => None,
        }
    }

    /// The reference's sin/cos source: the table values the GPU reads.
    fn ref_source<T: TestElem>(&self) -> RefSinCos {
        match (self.source, self.tables::<T>()) {
            (Source::Table { max_position, .. }, Some((c, s))) => {
                let table = |t: Vec<f64>| {
                    Array2::from_shape_vec((max_position, self.rotary_dim / 2), t)
                        .expect("table length matches")
                };
                RefSinCos::Table {
                    cos: table(c),
                    sin: table(s),
                }
            }
            (Source::Theta(theta), _) if self.axial_dims().is_some() => RefSinCos::Frequencies {
                inv_freq: self.inv_freq(theta),
                scale: 1.0,
            },
            (Source::Theta(theta), _) => RefSinCos::Theta(theta),
            (Source::Table { .. }, None) => unreachable!("table cases have tables"),
        }
    }

    /// The position arrays on the device: row offsets, ids or `cu_seqlens` (and varlen
    /// offsets), as `i64` or `i32`.
    fn position_arrays(&self, stream: &Arc<CudaStream>) -> Result<Option<DeviceArrays>> {
        let (main, aux, wide): (Vec<i64>, Option<Vec<i64>>, bool) = match &self.positions {
            PosCase::Offset(_) => return Ok(None),
            PosCase::RowOffsets { offsets, wide } => (widen(offsets), None, *wide),
            PosCase::Ids { ids, wide, .. } => (ids.clone(), None, *wide),
            PosCase::Varlen {
                cu_seqlens,
                offsets,
                wide,
            } => (widen(cu_seqlens), offsets.as_deref().map(widen), *wide),
            PosCase::VarlenContextParallel {
                cu_seqlens, wide, ..
            } => (widen(cu_seqlens), None, *wide),
            PosCase::MultiAxis {
                positions, wide, ..
            } => (positions.clone(), None, *wide),
        };
        Ok(Some(if wide {
            let aux = aux.map(|a| stream.clone_htod(&a)).transpose()?;
            DeviceArrays::I64(stream.clone_htod(&main)?, aux)
        } else {
            let narrow = |v: Vec<i64>| v.into_iter().map(|x| x as i32).collect::<Vec<_>>();
            let aux = aux.map(|a| stream.clone_htod(&narrow(a))).transpose()?;
            DeviceArrays::I32(stream.clone_htod(&narrow(main))?, aux)
        }))
    }
}

/// `u32` host values as `i64`.
fn widen(v: &[u32]) -> Vec<i64> {
    v.iter().map(|&x| x as i64).collect()
}

/// The `[batch, seq, heads, head_dim]` elements of `buf` at `layout`, widened to f64.
pub fn gather<T: TestElem>(buf: &[T], l: &Layout) -> Array4<f64> {
    let [sb, ss, sh] = l.strides();
    Array4::from_shape_fn(
        (l.batch(), l.seq(), l.heads(), l.head_dim()),
        |(b, s, h, e)| buf[l.offset() + b * sb + s * ss + h * sh + e].to_f64(),
    )
}

/// Whether each element of a buffer of `len` elements belongs to `layout`.
fn covered(len: usize, l: &Layout) -> Vec<bool> {
    let mut c = vec![false; len];
    let [sb, ss, sh] = l.strides();
    for b in 0..l.batch() {
        for s in 0..l.seq() {
            for h in 0..l.heads() {
                let base = l.offset() + b * sb + s * ss + h * sh;
                c[base..base + l.head_dim()]
                    .iter_mut()
                    .for_each(|v| *v = true);
            }
        }
    }
    c
}

/// Position arrays on the device: the main array (row offsets, ids or `cu_seqlens`) and the
/// varlen offsets, if any.
#[derive(Debug)]
pub enum DeviceArrays {
    I32(CudaSlice<i32>, Option<CudaSlice<i32>>),
    I64(CudaSlice<i64>, Option<CudaSlice<i64>>),
}

impl DeviceArrays {
    /// The main array and the offsets as views.
    fn views(&self) -> (DeviceInts<'_>, Option<DeviceInts<'_>>) {
        match self {
            Self::I32(m, a) => (
                DeviceInts::I32(m.as_view()),
                a.as_ref().map(|a| DeviceInts::I32(a.as_view())),
            ),
            Self::I64(m, a) => (
                DeviceInts::I64(m.as_view()),
                a.as_ref().map(|a| DeviceInts::I64(a.as_view())),
            ),
        }
    }
}

/// Tables on the device, of the tensors' type or of `f32`.
#[derive(Debug)]
pub enum DeviceTables<T> {
    Separate(CudaSlice<T>, CudaSlice<T>),
    Combined(CudaSlice<T>),
    SeparateF32(CudaSlice<f32>, CudaSlice<f32>),
    CombinedF32(CudaSlice<f32>),
}

/// A tensor's buffers on the device: input, and output when out of place.
#[derive(Debug)]
pub struct DeviceTensor<T> {
    pub x: CudaSlice<T>,
    pub out: Option<CudaSlice<T>>,
    pub layout: Layout,
}

/// A case's buffers on the device, with the host inputs they started from.
#[derive(Debug)]
pub struct DeviceCase<T> {
    pub case: Case,
    /// q (for fused cases: the whole q/k/v buffer).
    pub q: DeviceTensor<T>,
    pub k: Option<DeviceTensor<T>>,
    pub tables: Option<DeviceTables<T>>,
    pub ids: Option<DeviceArrays>,
    /// The axis map of a multi-axis case, uploaded at its first launch.
    pub axis_map: Option<DeviceAxisMap>,
    /// The frequencies of an axial case computed in the kernel, uploaded at its first launch.
    pub freqs: Option<Frequencies>,
    /// The host inputs: q (or the fused buffer) and k.
    pub q_host: Vec<T>,
    pub k_host: Vec<T>,
}

impl Case {
    /// Uploads random inputs (and tables, ids), poisons out-of-place outputs, and returns the
    /// device-side case ready to launch.
    pub fn upload<T: TestElem>(&self, stream: &Arc<CudaStream>) -> Result<DeviceCase<T>> {
        let contiguous = |heads| Layout::bshd(self.batch, self.seq, heads, self.head_dim);
        let tensor = |host: &[T], heads: usize, layout: Layout| -> Result<DeviceTensor<T>> {
            let out = if self.in_place {
                None
            } else {
                Some(
                    stream
                        .clone_htod(&vec![T::poison(); contiguous(heads).end().expect("small")])?,
                )
            };
            Ok(DeviceTensor {
                x: stream.clone_htod(host)?,
                out,
                layout,
            })
        };
        let (q, k, q_host, k_host) = if let KCase::Packed { .. } = self.k {
            ensure!(self.in_place, "fused q and k are rotated in place");
            let (ql, _, len) = self.packed_layouts();
            let host = self.random::<T>(0, len);
            (tensor(&host, self.heads, ql)?, None, host, Vec::new())
        } else {
            let ql = self.layout(self.heads);
            let q_host = self.random::<T>(0, ql.end().expect("small"));
            let q = tensor(&q_host, self.heads, ql)?;
            let (k, k_host) = if let KCase::Separate { heads } = self.k {
                let kl = self.layout(heads);
                let k_host = self.random::<T>(1, kl.end().expect("small"));
                (Some(tensor(&k_host, heads, kl)?), k_host)
            } else {
                (None, Vec::new())
            };
            (q, k, q_host, k_host)
        };
        let tables = match (self.tables::<T>(), self.source) {
            (Some((c, s)), Source::Table { format, in_f32, .. }) => {
                let half = self.rotary_dim / 2;
                let (c, s) = match format {
                    TableFormat::Separate => (c, Some(s)),
                    TableFormat::Combined => {
                        let cache = c
                            .chunks(half)
                            .zip(s.chunks(half))
                            .flat_map(|(c, s)| c.iter().chain(s).copied())
                            .collect();
                        (cache, None)
                    }
                };
                Some(if in_f32 {
                    let up = |v: Vec<f64>| {
                        stream.clone_htod(&v.into_iter().map(|x| x as f32).collect::<Vec<_>>())
                    };
                    match s {
                        Some(s) => DeviceTables::SeparateF32(up(c)?, up(s)?),
                        None => DeviceTables::CombinedF32(up(c)?),
                    }
                } else {
                    let up = |v: Vec<f64>| {
                        stream.clone_htod(&v.into_iter().map(T::from_f64).collect::<Vec<_>>())
                    };
                    match s {
                        Some(s) => DeviceTables::Separate(up(c)?, up(s)?),
                        None => DeviceTables::Combined(up(c)?),
                    }
                })
            }
            _ => None,
        };
        let ids = self.position_arrays(stream)?;
        Ok(DeviceCase {
            case: self.clone(),
            q,
            k,
            tables,
            ids,
            axis_map: None,
            freqs: None,
            q_host,
            k_host,
        })
    }
}

/// The operation of `c`, borrowing the device tables and position arrays.
fn make_op<'a, T: TestElem>(
    c: &'a Case,
    tables: &'a Option<DeviceTables<T>>,
    arrays: &'a Option<DeviceArrays>,
    (axis_map, freqs): (&'a Option<DeviceAxisMap>, &'a Option<Frequencies>),
) -> rope_host::Result<RopeOp<'a, T>> {
    let shape = |max_position| TableShape {
        max_position,
        rotary_dim: c.rotary_dim as u32,
    };
    let sincos = match (&c.source, tables) {
        (Source::Theta(_), _) if freqs.is_some() => {
            SinCos::Frequencies(freqs.as_ref().expect("checked"))
        }
        (Source::Theta(theta), _) => SinCos::Computed { theta: *theta },
        (Source::Table { max_position, .. }, Some(t)) => {
            let shape = shape(*max_position);
            match t {
                DeviceTables::Separate(cos, sin) => SinCos::Table {
                    cos: cos.as_view(),
                    sin: sin.as_view(),
                    shape,
                },
                DeviceTables::Combined(cache) => SinCos::CosSinCache {
                    cache: cache.as_view(),
                    shape,
                },
                DeviceTables::SeparateF32(cos, sin) => SinCos::TableF32 {
                    cos: cos.as_view(),
                    sin: sin.as_view(),
                    shape,
                },
                DeviceTables::CombinedF32(cache) => SinCos::CosSinCacheF32 {
                    cache: cache.as_view(),
                    shape,
                },
            }
        }
        (_, None) => unreachable!("uploaded with tables"),
    };
    let views = arrays.as_ref().map(DeviceArrays::views);
    let positions = match (&c.positions, views) {
        (PosCase::Offset(o), _) => Positions::Offset(*o),
        (PosCase::RowOffsets { .. }, Some((offsets, _))) => Positions::RowOffsets(offsets),
        (PosCase::Varlen { .. }, Some((cu_seqlens, offsets))) => Positions::Varlen {
            cu_seqlens,
            offsets,
        },
        (PosCase::VarlenContextParallel { size, rank, .. }, Some((cu_seqlens, _))) => {
            Positions::VarlenContextParallel {
                cu_seqlens,
                split: ContextParallel::new(*size, *rank)?,
            }
        }
        (PosCase::Ids { shape, .. }, Some((ids, _))) => Positions::Ids { ids, shape: *shape },
        (PosCase::MultiAxis { .. }, Some((positions, _))) => Positions::MultiAxis {
            positions,
            axes: axis_map.as_ref().expect("uploaded at launch"),
        },
        (_, None) => unreachable!("uploaded with position arrays"),
    };
    Ok(RopeOp {
        config: c.config()?,
        positions,
        sincos,
    })
}

/// The [`Io`] of a device tensor: in place, or into a contiguous output.
fn io<'a, T>(t: &'a mut DeviceTensor<T>, c: &Case, heads: usize) -> Io<'a, T> {
    match &mut t.out {
        None => Io::InPlace(TensorMut {
            data: t.x.as_view_mut(),
            layout: t.layout,
        }),
        Some(out) => Io::OutOfPlace {
            input: Tensor {
                data: t.x.as_view(),
                layout: t.layout,
            },
            output: TensorMut {
                data: out.as_view_mut(),
                layout: Layout::bshd(c.batch, c.seq, heads, c.head_dim),
            },
        },
    }
}

impl<T: TestElem> DeviceCase<T> {
    /// Launches the case once (asynchronously).
    pub fn launch(&mut self, rope: &Rope) -> rope_host::Result<()> {
        let DeviceCase {
            case,
            q,
            k,
            tables,
            ids,
            axis_map,
            freqs,
            ..
        } = self;
        if let PosCase::MultiAxis { n_axes, axes, .. } = &case.positions
            && axis_map
                .as_ref()
                .is_none_or(|m| m.pairs() != case.rotary_dim / 2)
        {
            *axis_map = Some(rope.axis_map(&axes.host_map(*n_axes, case.rotary_dim)?)?);
        }
        if let (Source::Theta(theta), Some(d)) = (case.source, case.axial_dims())
            && freqs.is_none()
        {
            let spec =
                FrequencySpec::new(theta, case.rotary_dim as u32).scaling(RopeScaling::Axial {
                    axes_dim: d.iter().map(|&v| v as u32).collect(),
                });
            *freqs = Some(rope.frequencies(&spec)?);
        }
        let op = make_op(case, tables, ids, (axis_map, freqs))?;
        match (case.k, k.as_mut()) {
            (KCase::Packed { .. }, _) => {
                let (ql, kl, _) = case.packed_layouts();
                rope.run_qk(
                    &op,
                    QkIo::Packed {
                        data: q.x.as_view_mut(),
                        q: ql,
                        k: kl,
                    },
                )
            }
            (KCase::Separate { heads }, Some(kt)) => rope.run_qk(
                &op,
                QkIo::Separate {
                    q: io(q, case, case.heads),
                    k: io(kt, case, heads),
                },
            ),
            _ => rope.run(&op, io(q, case, case.heads)),
        }
    }

    /// Runs the case on the GPU and checks every output element against the reference, that
    /// no element was left unwritten, and that nothing outside the outputs changed.
    pub fn check(&mut self, rope: &Rope, stream: &Arc<CudaStream>) -> Result<Comparison, String> {
        self.launch(rope)
            .map_err(|e| format!("launch failed: {e}"))?;
        self.verify(stream, None)
    }

    /// Checks the outputs as they are now (after any number of launches of this case, which
    /// for out-of-place cases all write the same values): no element left unwritten (the
    /// poison), nothing outside the outputs changed, and the tokens `samples` (`(b, s)`) of
    /// every output against the reference. In-place inputs are restored and rotated once
    /// first, since each launch rotates them again.
    pub fn check_sampled(
        &mut self,
        rope: &Rope,
        stream: &Arc<CudaStream>,
        samples: &[(usize, usize)],
    ) -> Result<Comparison, String> {
        if self.case.in_place {
            stream
                .memcpy_htod(&self.q_host, &mut self.q.x)
                .map_err(|e| e.to_string())?;
            if let Some(k) = self.k.as_mut() {
                stream
                    .memcpy_htod(&self.k_host, &mut k.x)
                    .map_err(|e| e.to_string())?;
            }
            self.launch(rope)
                .map_err(|e| format!("launch failed: {e}"))?;
        }
        self.verify(stream, Some(samples))
    }

    /// Writes the inputs of `case` (same shapes, sin/cos source and position kind as this
    /// case's) into this case's device buffers, poisons the out-of-place outputs again, and
    /// makes `case` the one the outputs are checked against: new data and positions in the
    /// same memory, as a CUDA graph replay sees them.
    pub fn rewrite(&mut self, case: &Case, stream: &Arc<CudaStream>) -> Result<()> {
        let fresh = case.upload::<T>(stream)?;
        let copy = |from: &CudaSlice<T>, to: &mut CudaSlice<T>| stream.memcpy_dtod(from, to);
        copy(&fresh.q.x, &mut self.q.x)?;
        if let (Some(from), Some(to)) = (&fresh.q.out, &mut self.q.out) {
            copy(from, to)?;
        }
        if let (Some(from), Some(to)) = (&fresh.k, &mut self.k) {
            copy(&from.x, &mut to.x)?;
            if let (Some(a), Some(b)) = (&from.out, &mut to.out) {
                copy(a, b)?;
            }
        }
        match (&fresh.ids, &mut self.ids) {
            (Some(DeviceArrays::I32(m, a)), Some(DeviceArrays::I32(mm, aa))) => {
                stream.memcpy_dtod(m, mm)?;
                if let (Some(a), Some(aa)) = (a, aa) {
                    stream.memcpy_dtod(a, aa)?;
                }
            }
            (Some(DeviceArrays::I64(m, a)), Some(DeviceArrays::I64(mm, aa))) => {
                stream.memcpy_dtod(m, mm)?;
                if let (Some(a), Some(aa)) = (a, aa) {
                    stream.memcpy_dtod(a, aa)?;
                }
            }
            (None, None) => {}
            _ => anyhow::bail!("the new case's position arrays differ in kind"),
        }
        self.case = case.clone();
        self.q_host = fresh.q_host;
        self.k_host = fresh.k_host;
        stream.synchronize()?;
        Ok(())
    }

    /// Checks every output element as it is now against the reference (see
    /// [`DeviceCase::check_sampled`]), without launching.
    pub fn verify_all(&self, stream: &Arc<CudaStream>) -> Result<Comparison, String> {
        self.verify(stream, None)
    }

    /// Compares the device outputs with the reference at `samples` tokens (all if `None`).
    fn verify(
        &self,
        stream: &Arc<CudaStream>,
        samples: Option<&[(usize, usize)]>,
    ) -> Result<Comparison, String> {
        let c = self.case.clone();
        let src = c.ref_source::<T>();
        let fetch = |s: &CudaSlice<T>| stream.clone_dtoh(s).map_err(|e| e.to_string());
        let (positions, axes) = c.resolved_axes();
        // x, the output and the reference at the sampled tokens, as `[tokens, 1, heads, d]`.
        let triple = |host: &[T], layout: &Layout, got: Array4<f64>| {
            let x = gather(host, layout);
            let (x, got, pos) = match samples {
                None => (x, got, positions.clone()),
                Some(tokens) => (
                    pick_tokens(&x, tokens),
                    pick_tokens(&got, tokens),
                    Array3::from_shape_fn((positions.dim().0, tokens.len(), 1), |(a, i, _)| {
                        positions[[a, tokens[i].0, tokens[i].1]]
                    }),
                ),
            };
            let want = reference::rope_axes(
                x.view(),
                pos.view(),
                &axes,
                c.style,
                c.direction,
                &src,
                c.rotary_dim,
                c.rotary_offset,
            );
            (x, got, want)
        };
        let mut cmp = Comparison::default();
        if let KCase::Packed { heads: hk, .. } = c.k {
            let (ql, kl, _) = c.packed_layouts();
            let after = fetch(&self.q.x)?;
            for (layout, heads) in [(ql, c.heads), (kl, hk)] {
                let (x, got, want) = triple(&self.q_host, &layout, gather(&after, &layout));
                cmp = cmp.merge(compare::<T>(&c, &x, &got, &want, heads)?);
            }
            untouched(&self.q_host, &after, &[ql, kl], "the fused buffer")?;
            return Ok(cmp);
        }
        let tensors = [(&self.q, &self.q_host, c.heads)];
        let k = self.k.as_ref().map(|k| (k, &self.k_host, c.k_heads()));
        for (t, host, heads) in tensors.into_iter().chain(k) {
            let after_x = fetch(&t.x)?;
            let got = match &t.out {
                Some(out) => {
                    let out = fetch(out)?;
                    let poison = T::poison().bits();
                    if let Some(i) = out.iter().position(|v| v.bits() == poison) {
                        return Err(format!("output element {i} was never written"));
                    }
                    gather(&out, &Layout::bshd(c.batch, c.seq, heads, c.head_dim))
                }
                None => gather(&after_x, &t.layout),
            };
            let (x, got, want) = triple(host, &t.layout, got);
            cmp = cmp.merge(compare::<T>(&c, &x, &got, &want, heads)?);
            let written: &[Layout] = if t.out.is_some() { &[] } else { &[t.layout] };
            untouched(host, &after_x, written, "the input buffer")?;
        }
        Ok(cmp)
    }
}

/// The tokens `(b, s)` of a `[batch, seq, heads, d]` array, as `[tokens, 1, heads, d]`.
fn pick_tokens(a: &Array4<f64>, tokens: &[(usize, usize)]) -> Array4<f64> {
    let (_, _, h, d) = a.dim();
    Array4::from_shape_fn((tokens.len(), 1, h, d), |(i, _, hh, e)| {
        a[[tokens[i].0, tokens[i].1, hh, e]]
    })
}

/// Checks that every element of `after` outside the `written` layouts equals `before`.
fn untouched<T: TestElem>(
    before: &[T],
    after: &[T],
    written: &[Layout],
    what: &str,
) -> Result<(), String> {
    let mut mask = vec![false; before.len()];
    for l in written {
        for (m, c) in mask.iter_mut().zip(covered(before.len(), l)) {
            *m |= c;
        }
    }
    match (0..before.len()).find(|&i| !mask[i] && before[i].bits() != after[i].bits()) {
        Some(i) => Err(format!(
            "{what} changed at element {i}, outside every output"
        )),
        None => Ok(()),
    }
}

/// Compares one output tensor with the reference by [`crate::tolerance`]'s rule (no norm):
/// rotated elements within [`Rotated::bound`] of the reference; pass-through elements exactly; NaN in the reference (a position outside the table)
/// must be NaN; no output may hold the poison value.
pub fn compare<T: TestElem>(
    case: &Case,
    x: &Array4<f64>,
    got: &Array4<f64>,
    want: &Array4<f64>,
    heads: usize,
) -> Result<Comparison, String> {
    let (r, d, o) = (case.rotary_dim, case.head_dim, case.rotary_offset);
    let poison = T::poison().to_f64().to_bits();
    let mut cmp = Comparison::default();
    for ((idx, &g), &w) in got.indexed_iter().zip(want.iter()) {
        let (b, s, h, e) = idx;
        let at = format!("{} element (b {b}, s {s}, h {h}/{heads}, e {e})", T::NAME);
        if g.to_bits() == poison {
            return Err(format!("{at} was never written"));
        }
        if w.is_nan() {
            if !g.is_nan() {
                return Err(format!(
                    "{at}: expected NaN (position outside the table), got {g}"
                ));
            }
            continue;
        }
        let (err, tol) = if (o..o + r).contains(&e) {
            let i = match case.style {
                RopeStyle::Interleaved => (e - o) / 2,
                RopeStyle::Neox => (e - o) % (r / 2),
            };
            let (ia, ib) = reference::pair(case.style, i, r);
            let (ia, ib) = (ia + o, ib + o);
            let element = Rotated {
                want: w,
                pair: (x[[b, s, h, ia]], x[[b, s, h, ib]]),
                norm_terms: None,
            };
            tolerance::check::<T>(g, &element)
        } else {
            // Pass-through elements are copied: exactly.
            ((g - w).abs(), 0.0)
        };
        if err.is_nan() || err > tol {
            return Err(format!(
                "{at}: got {g}, reference {w}, error {err:.3e} > tolerance {tol:.3e} (d {d}, rotary {r} at {o})"
            ));
        }
        cmp.max_abs_err = cmp.max_abs_err.max((g - w).abs());
        if tol > 0.0 {
            cmp.worst_ratio = cmp.worst_ratio.max(err / tol);
        }
        cmp.checked += 1;
    }
    Ok(cmp)
}

/// Runs `case` with its element type and checks it ([`DeviceCase::check`]).
pub fn run_and_check(
    case: &Case,
    rope: &Rope,
    stream: &Arc<CudaStream>,
) -> Result<Comparison, String> {
    crate::with_elem!(case.dtype, T => {
        let mut dev = case.upload::<T>(stream).map_err(|e| e.to_string())?;
        dev.check(rope, stream)
    })
}
