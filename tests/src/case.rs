//! One RoPE problem, run on the GPU and by the f64 reference: the unit of the property tests
//! and of the demo.

use std::sync::Arc;

use anyhow::Result;
use ndarray::{Array2, Array4, ArrayView4};
use rand::{RngExt, SeedableRng, rngs::StdRng};
use rope_host::cudarc::driver::{CudaSlice, CudaStream};
use rope_host::{
    Direction, IdsShape, Io, Layout, PositionIds, Positions, Rope, RopeConfig, RopeOp, RopeStyle,
    SinCos,
};

use crate::reference::{self, RefSinCos};

/// The value written into outputs before a launch; any element still holding it afterwards was
/// never written. A NaN with a payload the kernels never produce.
pub const POISON: f32 = f32::from_bits(0x7fc0_dead);

/// Where sin/cos come from in a case.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    /// f32 tables of `max_position` rows built from `theta`.
    Table { theta: f64, max_position: usize },
    /// Computed in the kernel from `theta`.
    Theta(f64),
}

/// How positions are given in a case.
#[derive(Clone, Debug, PartialEq)]
pub enum PosCase {
    /// `offset + s`.
    Offset(u32),
    /// `offsets[b] + s`.
    RowOffsets(Vec<u32>),
    /// Explicit ids (`[seq]` or `[batch, seq]`), uploaded as `i64` if `wide`, else `i32`.
    Ids {
        ids: Vec<i64>,
        wide: bool,
        shape: IdsShape,
    },
}

/// A complete RoPE problem with its random input drawn from `seed`.
#[derive(Clone, Debug)]
pub struct Case {
    pub style: RopeStyle,
    pub direction: Direction,
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub source: Source,
    pub positions: PosCase,
    pub in_place: bool,
    pub seed: u64,
}

impl Case {
    /// Elements of the tensor.
    pub fn len(&self) -> usize {
        self.batch * self.seq * self.heads * self.head_dim
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The input, uniform in `[-4, 4)`, drawn from the seed.
    pub fn input(&self) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(self.seed);
        (0..self.len())
            .map(|_| rng.random_range(-4.0f32..4.0))
            .collect()
    }

    /// The position of every token, `[batch, seq]`.
    pub fn resolved_positions(&self) -> Array2<i64> {
        Array2::from_shape_fn((self.batch, self.seq), |(b, s)| match &self.positions {
            PosCase::Offset(o) => *o as i64 + s as i64,
            PosCase::RowOffsets(offsets) => offsets[b] as i64 + s as i64,
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
        })
    }

    /// The f32 tables the GPU reads (f64 tables rounded once), `None` for computed sin/cos.
    pub fn f32_tables(&self) -> Option<(Vec<f32>, Vec<f32>)> {
        match self.source {
            Source::Table {
                theta,
                max_position,
            } => {
                let (c, s) = reference::tables(theta, self.head_dim, max_position);
                Some((
                    c.iter().map(|&v| v as f32).collect(),
                    s.iter().map(|&v| v as f32).collect(),
                ))
            }
            Source::Theta(_) => None,
        }
    }

    /// The f64 reference output for input `x`. Table cases use the f32 table values the GPU
    /// reads, so the comparison measures the kernel, not the table's rounding.
    pub fn reference(&self, x: &[f32]) -> Array4<f64> {
        let shape = (self.batch, self.seq, self.heads, self.head_dim);
        let x64 = Array4::from_shape_vec(shape, x.iter().map(|&v| v as f64).collect())
            .expect("input length matches the shape");
        let src = match (&self.source, self.f32_tables()) {
            (Source::Table { max_position, .. }, Some((c, s))) => {
                let widen = |t: Vec<f32>| {
                    Array2::from_shape_vec(
                        (*max_position, self.head_dim / 2),
                        t.into_iter().map(f64::from).collect(),
                    )
                    .expect("table length matches")
                };
                RefSinCos::Table {
                    cos: widen(c),
                    sin: widen(s),
                }
            }
            (Source::Theta(theta), _) => RefSinCos::Theta(*theta),
            (Source::Table { .. }, None) => unreachable!("table cases have tables"),
        };
        reference::rope(
            x64.view(),
            self.resolved_positions().view(),
            self.style,
            self.direction,
            &src,
        )
    }

    /// The library's configuration for this case.
    pub fn config(&self) -> rope_host::Result<RopeConfig> {
        RopeConfig::builder(self.head_dim as u32, self.style)
            .direction(self.direction)
            .build()
    }

    /// Uploads the input (and tables, ids), poisons the output, and returns the device-side
    /// case ready to launch.
    pub fn upload(&self, stream: &Arc<CudaStream>) -> Result<DeviceCase> {
        let x = stream.clone_htod(&self.input())?;
        let out = if self.in_place {
            None
        } else {
            Some(stream.clone_htod(&vec![POISON; self.len()])?)
        };
        let tables = match self.f32_tables() {
            Some((c, s)) => Some((stream.clone_htod(&c)?, stream.clone_htod(&s)?)),
            None => None,
        };
        let ids = match &self.positions {
            PosCase::Ids {
                ids, wide: true, ..
            } => Some(DeviceIds::I64(stream.clone_htod(ids)?)),
            PosCase::Ids {
                ids, wide: false, ..
            } => {
                let narrow: Vec<i32> = ids.iter().map(|&v| v as i32).collect();
                Some(DeviceIds::I32(stream.clone_htod(&narrow)?))
            }
            _ => None,
        };
        Ok(DeviceCase {
            case: self.clone(),
            x,
            out,
            tables,
            ids,
        })
    }
}

/// Explicit ids on the device.
#[derive(Debug)]
pub enum DeviceIds {
    I32(CudaSlice<i32>),
    I64(CudaSlice<i64>),
}

/// A case's buffers on the device.
#[derive(Debug)]
pub struct DeviceCase {
    pub case: Case,
    pub x: CudaSlice<f32>,
    pub out: Option<CudaSlice<f32>>,
    pub tables: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    pub ids: Option<DeviceIds>,
}

impl DeviceCase {
    /// Launches the case once (asynchronously).
    pub fn launch(&mut self, rope: &Rope) -> rope_host::Result<()> {
        let c = &self.case;
        let sincos = match (&c.source, &self.tables) {
            (Source::Theta(theta), _) => SinCos::Computed { theta: *theta },
            (Source::Table { .. }, Some((cos, sin))) => SinCos::Table {
                cos: cos.as_view(),
                sin: sin.as_view(),
            },
            (Source::Table { .. }, None) => unreachable!("uploaded with tables"),
        };
        let positions = match (&c.positions, &self.ids) {
            (PosCase::Offset(o), _) => Positions::Offset(*o),
            (PosCase::RowOffsets(offsets), _) => Positions::RowOffsets(offsets),
            (PosCase::Ids { shape, .. }, Some(DeviceIds::I32(ids))) => Positions::Ids {
                ids: PositionIds::I32(ids.as_view()),
                shape: *shape,
            },
            (PosCase::Ids { shape, .. }, Some(DeviceIds::I64(ids))) => Positions::Ids {
                ids: PositionIds::I64(ids.as_view()),
                shape: *shape,
            },
            (PosCase::Ids { .. }, None) => unreachable!("uploaded with ids"),
        };
        let op = RopeOp {
            config: c.config()?,
            layout: Layout::bshd(c.batch, c.seq, c.heads, c.head_dim),
            positions,
            sincos,
        };
        let io = match &mut self.out {
            None => Io::InPlace(self.x.as_view_mut()),
            Some(out) => Io::OutOfPlace {
                input: self.x.as_view(),
                output: out.as_view_mut(),
            },
        };
        rope.run(&op, io)
    }

    /// The rotated tensor, copied back (synchronizes the stream).
    pub fn result(&self, stream: &Arc<CudaStream>) -> Result<Vec<f32>> {
        let v = stream.clone_dtoh(self.out.as_ref().unwrap_or(&self.x))?;
        Ok(v)
    }
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

/// Tolerance of an f32 output element whose pair inputs are `a`, `b`: 8 f32 units of
/// `2^-24 (|a| + |b|)`. Rounding the inputs' products and sum costs at most 3 such units and
/// cos/sin within one ulp at most 2 more.
pub fn f32_tolerance(a: f64, b: f64) -> f64 {
    8.0 * f64::from(f32::EPSILON) / 2.0 * (a.abs() + b.abs()) + 1e-30
}

/// Compares `got` with `want`. NaN in the reference (a position outside the table) must be
/// NaN in the output, and no output may hold [`POISON`]. Returns `Err` describing the first
/// element that fails.
pub fn compare(
    case: &Case,
    x: &[f32],
    got: &[f32],
    want: ArrayView4<'_, f64>,
) -> Result<Comparison, String> {
    let d = case.head_dim;
    let mut cmp = Comparison::default();
    for (idx, (&g, &w)) in got.iter().zip(want.iter()).enumerate() {
        if g.to_bits() == POISON.to_bits() {
            return Err(format!("element {idx} was never written"));
        }
        if w.is_nan() {
            if !g.is_nan() {
                return Err(format!(
                    "element {idx}: expected NaN (position outside the table), got {g}"
                ));
            }
            continue;
        }
        let (head, e) = (idx / d * d, idx % d);
        let i = match case.style {
            RopeStyle::Interleaved => e / 2,
            RopeStyle::Neox => e % (d / 2),
        };
        let (ia, ib) = reference::pair(case.style, i, d);
        let tol = f32_tolerance(x[head + ia] as f64, x[head + ib] as f64);
        let err = (g as f64 - w).abs();
        if err.is_nan() || err > tol {
            return Err(format!(
                "element {idx}: got {g}, reference {w}, error {err:.3e} > tolerance {tol:.3e}"
            ));
        }
        cmp.max_abs_err = cmp.max_abs_err.max(err);
        cmp.worst_ratio = cmp.worst_ratio.max(err / tol);
        cmp.checked += 1;
    }
    Ok(cmp)
}
