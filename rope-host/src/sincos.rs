//! Where each (position, pair)'s cosine and sine come from: the public [`SinCos`] option, its
//! validation, what it uploads (the default frequencies of `Computed`, once per `Rope`) and how
//! it encodes into the kernel's `cos`, `sin`, `table_stride`, `table_rows`, `table_elem`,
//! `inv_freq`, `angle_mode` and `cs_scale` arguments (the kernel's side is `cos_sin` in
//! `rope-kernels/src/rope.rs`).

use cudarc::driver::CudaView;
use rope_kernels::abi::{DType, SinCosSource, TableElem, planned_table_fits};

use crate::bind::{Binder, RawBuf};
use crate::config::{RopeConfig, RopeElem};
use crate::error::{Result, invalid};
use crate::freq::{AngleMode, Frequencies, check_theta};

/// The rows and rotary width of a cos/sin table: what it was built for.
///
/// [`crate::SinCosTables`] carry theirs; users who bring their own buffers state it, so that a
/// table built for another `rotary_dim` (whose length may still divide evenly) is rejected
/// rather than read with the wrong frequencies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TableShape {
    /// Rows: positions `0..max_position`.
    pub max_position: usize,
    /// The rotated features the table serves: its rows hold `rotary_dim / 2` cosines and as
    /// many sines.
    pub rotary_dim: u32,
}

/// Where the cosine and sine of each (position, pair) come from. Tables have the element type
/// of the tensors (the type system rules out a mismatch).
#[derive(Debug)]
pub enum SinCos<'a, T> {
    /// Tables `cos[p, i]`, `sin[p, i]`, row-major `[max_position, rotary_dim / 2]` each.
    Table {
        /// `cos(p * inv_freq_i)` at `[p * rotary_dim/2 + i]`.
        cos: CudaView<'a, T>,
        /// `sin(p * inv_freq_i)` at `[p * rotary_dim/2 + i]`.
        sin: CudaView<'a, T>,
        /// Rows and rotary width of both tables.
        shape: TableShape,
    },
    /// vLLM's and FlashInfer's `cos_sin_cache [max_position, rotary_dim]`: row `p` holds the
    /// `rotary_dim / 2` cosines, then the `rotary_dim / 2` sines.
    CosSinCache {
        /// The cache.
        cache: CudaView<'a, T>,
        /// Its rows and rotary width.
        shape: TableShape,
    },
    /// [`SinCos::Table`] in `f32` whatever the tensors' type: `f16`/`bf16` tensors then rotate
    /// by cos/sin rounded to `f32` rather than to their own 8- or 11-bit significand (a bf16
    /// table stores `cos(15962)` as the cosine of a nearby angle).
    TableF32 {
        /// `cos(p * inv_freq_i)` at `[p * rotary_dim/2 + i]`.
        cos: CudaView<'a, f32>,
        /// `sin(p * inv_freq_i)` at `[p * rotary_dim/2 + i]`.
        sin: CudaView<'a, f32>,
        /// Rows and rotary width of both tables.
        shape: TableShape,
    },
    /// [`SinCos::CosSinCache`] in `f32` whatever the tensors' type (FlashInfer requires an `f32`
    /// cache; vLLM keeps it in `f32`).
    CosSinCacheF32 {
        /// The cache.
        cache: CudaView<'a, f32>,
        /// Its rows and rotary width.
        shape: TableShape,
    },
    /// Computed in the kernel: `inv_freq_i = theta^(-2i / rotary_dim)` on the host in `f64`,
    /// the angle in `f64` and `cos`/`sin` within one `f32` ulp (see `rope_kernels::math`).
    Computed {
        /// The frequency base, finite and positive (commonly 10 000, or 500 000 for Llama 3).
        theta: f64,
    },
    /// Computed in the kernel from a frequency vector of any scaling family, with its angle
    /// mode and attention factor ([`crate::Rope::frequencies`]).
    Frequencies(&'a Frequencies),
}

/// [`SinCos`] with device buffers given by address: what [`crate::Rope::run_raw`] takes and
/// what the safe API reduces [`SinCos`] to. Tables hold `dtype` elements: the tensors' element
/// type, or `f32` with any.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RawSinCos {
    /// As [`SinCos::Table`] and [`SinCos::TableF32`].
    Table {
        /// The cosines.
        cos: RawBuf,
        /// The sines.
        sin: RawBuf,
        /// Their element type.
        dtype: DType,
        /// Rows and rotary width of both.
        shape: TableShape,
    },
    /// As [`SinCos::CosSinCache`] and [`SinCos::CosSinCacheF32`].
    CosSinCache {
        /// The cache.
        cache: RawBuf,
        /// Its element type.
        dtype: DType,
        /// Its rows and rotary width.
        shape: TableShape,
    },
    /// As [`SinCos::Computed`].
    Computed {
        /// The frequency base.
        theta: f64,
    },
    /// As [`SinCos::Frequencies`]: `rotary_dim / 2` `f64` frequencies at `inv_freq`
    /// ([`crate::Frequencies::raw`]).
    Frequencies {
        /// The frequencies.
        inv_freq: RawBuf,
        /// The rotated features they are for.
        rotary_dim: u32,
        /// How the kernels form angles from them.
        angle: AngleMode,
        /// The factor multiplying cos and sin.
        attention_factor: f32,
    },
}

/// What validation found: the kernels' sin/cos source and the table geometry (zero for
/// computed sin/cos).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SinCosPlan {
    pub(crate) source: SinCosSource,
    /// The tables' element type ([`TableElem::Tensors`] for computed sin/cos).
    pub(crate) table_elem: TableElem,
    /// Elements per table row.
    pub(crate) table_stride: u64,
    /// Table rows.
    pub(crate) table_rows: u64,
}

/// The encoded sin/cos arguments.
pub(crate) struct SinCosArgs {
    pub(crate) cos: u64,
    pub(crate) sin: u64,
    pub(crate) table_stride: u64,
    pub(crate) table_rows: u64,
    pub(crate) table_elem: u32,
    pub(crate) inv_freq: u64,
    pub(crate) angle_mode: u32,
    pub(crate) cs_scale: f32,
}

impl<T> SinCos<'_, T> {
    /// Reduces the option to its launch-time form; device buffers must belong to the binder's
    /// context.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `sincos` for a buffer from another CUDA context.
    pub(crate) fn bind<'s>(&'s self, binder: &mut Binder<'s>) -> Result<RawSinCos>
    where
        T: RopeElem,
    {
        let table = |cos, sin, dtype, shape| RawSinCos::Table {
            cos,
            sin,
            dtype,
            shape,
        };
        let cache = |cache, dtype, shape| RawSinCos::CosSinCache {
            cache,
            dtype,
            shape,
        };
        Ok(match self {
            Self::Table { cos, sin, shape } => table(
                binder.read("sincos.cos", cos)?,
                binder.read("sincos.sin", sin)?,
                T::DTYPE,
                *shape,
            ),
            Self::TableF32 { cos, sin, shape } => table(
                binder.read("sincos.cos", cos)?,
                binder.read("sincos.sin", sin)?,
                DType::F32,
                *shape,
            ),
            Self::CosSinCache { cache: c, shape } => {
                cache(binder.read("sincos", c)?, T::DTYPE, *shape)
            }
            Self::CosSinCacheF32 { cache: c, shape } => {
                cache(binder.read("sincos", c)?, DType::F32, *shape)
            }
            Self::Computed { theta } => RawSinCos::Computed { theta: *theta },
            Self::Frequencies(f) => {
                binder.read::<f64, _>("sincos", &f.inv_freq)?;
                f.raw()
            }
        })
    }
}

impl RawSinCos {
    /// Whether the fused token-heads kernels may read these tables with `pairs`
    /// entries per item ([`planned_table_fits`], which mirrors their reads): always for sin/cos
    /// computed in the kernels; for tables, when each spans fewer than 2^32 elements and, where
    /// an item's entries make a vector, both tables and their row stride are aligned to it.
    pub(crate) fn planned_table_fits(
        &self,
        plan: &SinCosPlan,
        config: &RopeConfig,
        pairs: u32,
    ) -> bool {
        let Some((cos, sin, dtype)) = self.table_addresses(config) else {
            return true;
        };
        planned_table_fits(
            (cos, sin),
            (plan.table_rows, plan.table_stride),
            (u64::from(pairs), dtype.size() as u64),
        )
    }

    /// The addresses the kernels read cos and sin at, and the tables' element type; `None` for
    /// sin/cos computed in the kernels. A `cos_sin_cache` row holds `half` cosines, then as many
    /// sines.
    fn table_addresses(&self, config: &RopeConfig) -> Option<(u64, u64, DType)> {
        match *self {
            Self::Table {
                cos, sin, dtype, ..
            } => Some((cos.ptr, sin.ptr, dtype)),
            Self::CosSinCache { cache, dtype, .. } => {
                let sines = u64::from(config.half()) * dtype.size() as u64;
                Some((cache.ptr, cache.ptr + sines, dtype))
            }
            Self::Computed { .. } | Self::Frequencies { .. } => None,
        }
    }

    /// Checks the source against the configuration and element type; tables must hold every
    /// position up to `max_implicit` (the largest implicit or packed position, when known).
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `sincos` (a table of another rotary width, rows or
    /// length that disagree with its shape, misaligned), `theta` (not finite and positive, or a
    /// frequency above `2^20`: see [`crate::FrequencySpec::build`]) or
    /// `positions` (past the end of the table).
    pub(crate) fn check(
        &self,
        config: &RopeConfig,
        dtype: DType,
        max_implicit: Option<u64>,
    ) -> Result<SinCosPlan> {
        let half = config.half() as u64;
        let plan = match *self {
            Self::Table {
                cos,
                sin,
                dtype: tables,
                shape,
            } => {
                let elem = table_elem(tables, dtype)?;
                check_shape(&shape, config)?;
                for (name, b) in [("sincos.cos", cos), ("sincos.sin", sin)] {
                    check_table_buf(name, b, &shape, half, tables.size() as u64)?;
                }
                table_plan(elem, half, &shape)
            }
            Self::CosSinCache {
                cache,
                dtype: tables,
                shape,
            } => {
                let elem = table_elem(tables, dtype)?;
                check_shape(&shape, config)?;
                check_table_buf("sincos", cache, &shape, 2 * half, tables.size() as u64)?;
                table_plan(elem, 2 * half, &shape)
            }
            Self::Computed { theta } => {
                check_theta(theta, config.rotary_dim())?;
                computed_plan()
            }
            Self::Frequencies { rotary_dim, .. } => {
                if rotary_dim != config.rotary_dim() {
                    return Err(invalid(
                        "sincos",
                        format!(
                            "frequencies for rotary_dim {rotary_dim}, the config rotates {}",
                            config.rotary_dim()
                        ),
                    ));
                }
                computed_plan()
            }
        };
        if let (Some(max), true) = (max_implicit, plan.source != SinCosSource::Theta)
            && max >= plan.table_rows
        {
            let rows = plan.table_rows;
            return Err(invalid(
                "positions",
                format!("position {max} is past the end of a table of {rows} positions"),
            ));
        }
        Ok(plan)
    }

    /// The device memory the kernel reads for sin/cos, as `(address, bytes)` ranges, for the
    /// overlap checks against written tensors (at most two; no allocation, this runs on every
    /// launch).
    pub(crate) fn device_reads(&self) -> [Option<(u64, u64)>; 2] {
        let bytes = |b: RawBuf, es: u64| Some((b.ptr, (b.len as u64).saturating_mul(es)));
        match *self {
            Self::Table {
                cos, sin, dtype, ..
            } => {
                let es = dtype.size() as u64;
                [bytes(cos, es), bytes(sin, es)]
            }
            Self::CosSinCache { cache, dtype, .. } => [bytes(cache, dtype.size() as u64), None],
            Self::Computed { .. } => [None, None],
            Self::Frequencies { inv_freq, .. } => [bytes(inv_freq, 8), None],
        }
    }

    /// The default frequency vector a launch reads, `(theta, rotary_dim)`: for `Computed`,
    /// whose vector the handle uploads (or finds prepared) before the launch is encoded.
    pub(crate) fn default_frequencies(&self, config: &RopeConfig) -> Option<(f64, u32)> {
        match *self {
            Self::Computed { theta } => Some((theta, config.rotary_dim())),
            _ => None,
        }
    }

    /// Encodes the kernel's sin/cos arguments; `inv_freq` is the device address of the
    /// [`RawSinCos::default_frequencies`] vector (0 when the launch reads none).
    pub(crate) fn encode(
        &self,
        plan: &SinCosPlan,
        config: &RopeConfig,
        inv_freq: u64,
    ) -> SinCosArgs {
        let mut args = SinCosArgs {
            cos: 0,
            sin: 0,
            table_stride: plan.table_stride,
            table_rows: plan.table_rows,
            table_elem: plan.table_elem as u32,
            inv_freq: 0,
            angle_mode: AngleMode::Exact as u32,
            cs_scale: 1.0,
        };
        if let Some((cos, sin, _)) = self.table_addresses(config) {
            (args.cos, args.sin) = (cos, sin);
        }
        match *self {
            Self::Table { .. } | Self::CosSinCache { .. } => {}
            Self::Computed { .. } => args.inv_freq = inv_freq,
            Self::Frequencies {
                inv_freq,
                angle,
                attention_factor,
                ..
            } => {
                args.inv_freq = inv_freq.ptr;
                args.angle_mode = angle as u32;
                args.cs_scale = attention_factor;
            }
        }
        args
    }
}

/// The kernels' table element type for tables of `tables` elements with tensors of `dtype`.
fn table_elem(tables: DType, dtype: DType) -> Result<TableElem> {
    match (tables, dtype) {
        (t, d) if t == d => Ok(TableElem::Tensors),
        (DType::F32, _) => Ok(TableElem::F32),
        _ => Err(invalid(
            "sincos",
            format!(
                "tables of {tables:?} with {dtype:?} tensors: tables must be f32 or the tensors' type"
            ),
        )),
    }
}

/// The plan of a table with rows of `row` elements.
fn table_plan(table_elem: TableElem, row: u64, shape: &TableShape) -> SinCosPlan {
    SinCosPlan {
        source: SinCosSource::Table,
        table_elem,
        table_stride: row,
        table_rows: shape.max_position as u64,
    }
}

/// The plan of in-kernel sin/cos.
fn computed_plan() -> SinCosPlan {
    SinCosPlan {
        source: SinCosSource::Theta,
        table_elem: TableElem::Tensors,
        table_stride: 0,
        table_rows: 0,
    }
}

/// A table's stated shape serves the configuration.
fn check_shape(shape: &TableShape, config: &RopeConfig) -> Result<()> {
    if shape.rotary_dim != config.rotary_dim() {
        return Err(invalid(
            "sincos",
            format!(
                "a table for rotary_dim {}, the config rotates {}",
                shape.rotary_dim,
                config.rotary_dim()
            ),
        ));
    }
    if shape.max_position == 0 {
        return Err(invalid("sincos", "a table needs max_position >= 1"));
    }
    Ok(())
}

/// One table buffer holds exactly the stated rows of `row` elements and is aligned.
fn check_table_buf(
    name: &'static str,
    b: RawBuf,
    shape: &TableShape,
    row: u64,
    es: u64,
) -> Result<()> {
    let want = (shape.max_position as u64).checked_mul(row);
    if want != Some(b.len as u64) {
        return Err(invalid(
            name,
            format!(
                "holds {} elements, {} rows of {row} need {}",
                b.len,
                shape.max_position,
                want.map_or("more than u64::MAX".into(), |w| w.to_string())
            ),
        ));
    }
    if !b.ptr.is_multiple_of(es) {
        return Err(invalid(name, format!("is not aligned to {es} bytes")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RopeStyle;
    use crate::error::Error;

    fn config(head_dim: u32, rotary_dim: u32) -> RopeConfig {
        RopeConfig::builder(head_dim, RopeStyle::Neox)
            .rotary_dim(rotary_dim)
            .build()
            .expect("valid")
    }

    fn arg(r: Result<SinCosPlan>) -> &'static str {
        match r {
            Err(Error::Invalid { arg, .. }) => arg,
            other => panic!("expected Error::Invalid, got {other:?}"),
        }
    }

    fn table(rows: usize, rotary_dim: u32, len: usize) -> RawSinCos {
        RawSinCos::Table {
            cos: RawBuf { ptr: 0, len },
            sin: RawBuf { ptr: 1 << 20, len },
            dtype: DType::F32,
            shape: TableShape {
                max_position: rows,
                rotary_dim,
            },
        }
    }

    #[test]
    fn rejects_a_table_of_another_rotary_width() {
        // A [4, 64] table has as many elements as a [8, 32] one: its stated width decides.
        let cfg = config(128, 128);
        table(4, 128, 256)
            .check(&cfg, DType::F32, None)
            .expect("fits");
        assert_eq!(
            arg(table(8, 64, 256).check(&cfg, DType::F32, None)),
            "sincos"
        );
        let cache = RawSinCos::CosSinCache {
            cache: RawBuf { ptr: 0, len: 512 },
            dtype: DType::F32,
            shape: TableShape {
                max_position: 8,
                rotary_dim: 64,
            },
        };
        assert_eq!(arg(cache.check(&cfg, DType::F32, None)), "sincos");
    }

    #[test]
    fn rejects_lengths_that_disagree_with_the_shape() {
        let cfg = config(8, 8);
        assert_eq!(
            arg(table(10, 8, 36).check(&cfg, DType::F32, None)),
            "sincos.cos"
        );
        assert_eq!(arg(table(0, 8, 0).check(&cfg, DType::F32, None)), "sincos");
    }

    #[test]
    fn tables_must_hold_the_largest_implicit_position() {
        let cfg = config(4, 4);
        let t = table(10, 4, 20);
        t.check(&cfg, DType::F32, Some(9))
            .expect("ten rows hold position 9");
        assert_eq!(arg(t.check(&cfg, DType::F32, Some(10))), "positions");
        let cache = RawSinCos::CosSinCache {
            cache: RawBuf { ptr: 0, len: 40 },
            dtype: DType::F32,
            shape: TableShape {
                max_position: 10,
                rotary_dim: 4,
            },
        };
        let plan = cache.check(&cfg, DType::F32, Some(9)).expect("fits");
        assert_eq!((plan.table_stride, plan.table_rows), (4, 10));
    }

    #[test]
    fn rejects_non_finite_or_non_positive_theta() {
        let cfg = config(4, 4);
        for theta in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e-300] {
            let r = RawSinCos::Computed { theta }.check(&cfg, DType::F32, None);
            assert_eq!(arg(r), "theta", "{theta}");
        }
    }

    #[test]
    fn f32_tables_serve_16_bit_tensors_and_other_types_do_not() {
        let cfg = config(8, 8);
        let t = table(10, 8, 40);
        let plan = t.check(&cfg, DType::F32, None).expect("f32");
        assert_eq!(
            (plan.source, plan.table_elem),
            (SinCosSource::Table, TableElem::Tensors)
        );
        for dtype in [DType::F16, DType::BF16] {
            let plan = t.check(&cfg, dtype, None).expect("f32 tables");
            assert_eq!(
                (plan.source, plan.table_elem),
                (SinCosSource::Table, TableElem::F32)
            );
        }
        let bf16 = RawSinCos::CosSinCache {
            cache: RawBuf { ptr: 0, len: 80 },
            dtype: DType::BF16,
            shape: TableShape {
                max_position: 10,
                rotary_dim: 8,
            },
        };
        let plan = bf16.check(&cfg, DType::BF16, None).expect("same");
        assert_eq!(
            (plan.source, plan.table_elem),
            (SinCosSource::Table, TableElem::Tensors)
        );
        assert_eq!(arg(bf16.check(&cfg, DType::F16, None)), "sincos");
        assert_eq!(arg(bf16.check(&cfg, DType::F32, None)), "sincos");
    }
}
