//! Cos/sin tables built on the GPU. Mirrors `rope-kernels/src/table.rs`.

use cudarc::driver::{
    CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop, ValidAsZeroBits,
};
use rope_kernels::abi::{BLOCK_THREADS, TABLE_KERNEL};

use crate::config::RopeElem;
use crate::device::StreamOverlap;
use crate::error::{Result, invalid};
use crate::freq::{AngleMode, Frequencies, check_theta};
use crate::handle::{FreqUse, Rope};
use crate::kernel_args::TableArgs;
use crate::sincos::{SinCos, TableShape};

/// How a table pair is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TableFormat {
    /// Two tables `cos`, `sin` of `[max_position, rotary_dim / 2]` ([`SinCos::Table`]).
    Separate,
    /// One `cos_sin_cache [max_position, rotary_dim]`: each row the cosines, then the sines
    /// ([`SinCos::CosSinCache`], vLLM's and FlashInfer's format).
    Combined,
}

/// The device buffers of [`SinCosTables`].
#[derive(Debug)]
pub enum TableData<T> {
    /// `cos`, `sin` of `[max_position, rotary_dim / 2]`.
    Separate {
        /// Cosines.
        cos: CudaSlice<T>,
        /// Sines.
        sin: CudaSlice<T>,
    },
    /// `cos_sin_cache [max_position, rotary_dim]`.
    Combined(CudaSlice<T>),
}

/// Tables built by [`Rope::build_tables`], owned on the device, with the shape they were built
/// for.
#[derive(Debug)]
pub struct SinCosTables<T> {
    data: TableData<T>,
    shape: TableShape,
}

impl<T> SinCosTables<T> {
    /// Rows and rotary width.
    pub fn shape(&self) -> TableShape {
        self.shape
    }

    /// The device buffers.
    pub fn data(&self) -> &TableData<T> {
        &self.data
    }

    /// The device buffers, taken out.
    pub fn into_data(self) -> TableData<T> {
        self.data
    }

    /// The tables as the sin/cos source of a [`crate::RopeOp`].
    pub fn sincos(&self) -> SinCos<'_, T> {
        let shape = self.shape;
        match &self.data {
            TableData::Separate { cos, sin } => SinCos::Table {
                cos: cos.as_view(),
                sin: sin.as_view(),
                shape,
            },
            TableData::Combined(cache) => SinCos::CosSinCache {
                cache: cache.as_view(),
                shape,
            },
        }
    }
}

impl SinCosTables<f32> {
    /// These `f32` tables as the sin/cos source of an operation on tensors of any element type
    /// ([`SinCos::TableF32`], [`SinCos::CosSinCacheF32`]): `f16`/`bf16` tensors then rotate by
    /// cos/sin rounded to `f32` only.
    pub fn sincos_f32<T>(&self) -> SinCos<'_, T> {
        let shape = self.shape;
        match &self.data {
            TableData::Separate { cos, sin } => SinCos::TableF32 {
                cos: cos.as_view(),
                sin: sin.as_view(),
                shape,
            },
            TableData::Combined(cache) => SinCos::CosSinCacheF32 {
                cache: cache.as_view(),
                shape,
            },
        }
    }
}

impl Rope {
    /// Builds the tables of `cos`/`sin(p * theta^(-2i / rotary_dim))` for positions
    /// `0..max_position` on the GPU, with the in-kernel sin/cos arithmetic (angle in `f64`,
    /// within one `f32` ulp) rounded once to `T`; asynchronous on the stream.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `theta` (not finite and positive, or a frequency above
    /// `2^20`), `rotary_dim` (zero
    /// or odd) or `max_position` (zero, or a table too large to address);
    /// [`crate::Error::Driver`] when allocation or the launch fails.
    pub fn build_tables<T: RopeElem + ValidAsZeroBits>(
        &self,
        theta: f64,
        rotary_dim: u32,
        max_position: usize,
        format: TableFormat,
    ) -> Result<SinCosTables<T>> {
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
            return Err(invalid(
                "rotary_dim",
                format!("must be even and at least 2, got {rotary_dim}"),
            ));
        }
        check_theta(theta, rotary_dim)?;
        let inv_freq = self.inv_freq(theta, rotary_dim, FreqUse::OwnStream)?;
        let shape = TableShape {
            max_position,
            rotary_dim,
        };
        self.launch_tables(inv_freq, shape, (AngleMode::Exact, 1.0), format)
    }

    /// Builds tables from the frequencies of any scaling family: `scale * cos/sin(angle)` with
    /// the angle formed as `freqs.angle()` says and `scale = freqs.attention_factor()`.
    ///
    /// # Errors
    /// As [`Rope::build_tables`] for `max_position`.
    pub fn build_tables_for<T: RopeElem + ValidAsZeroBits>(
        &self,
        freqs: &Frequencies,
        max_position: usize,
        format: TableFormat,
    ) -> Result<SinCosTables<T>> {
        let mode = (freqs.angle, freqs.attention_factor as f32);
        let shape = TableShape {
            max_position,
            rotary_dim: freqs.rotary_dim,
        };
        // The vector is never written after its upload, so no later use needs ordering after
        // the read this records.
        let inv_freq = freqs.inv_freq.device_ptr(&self.stream).0;
        self.launch_tables(inv_freq, shape, mode, format)
    }

    /// Allocates the tables and launches the builder; `inv_freq` is the address of `half`
    /// `f64` frequencies complete on the device.
    fn launch_tables<T: RopeElem + ValidAsZeroBits>(
        &self,
        inv_freq: u64,
        shape: TableShape,
        (angle, scale): (AngleMode, f32),
        format: TableFormat,
    ) -> Result<SinCosTables<T>> {
        let TableShape {
            max_position,
            rotary_dim,
        } = shape;
        let half = rotary_dim / 2;
        let len = max_position
            .checked_mul(rotary_dim as usize)
            .filter(|_| max_position > 0)
            .ok_or_else(|| {
                invalid(
                    "max_position",
                    format!("{max_position} rows cannot be built"),
                )
            })?;
        let stream = &self.stream;
        let mut data = match format {
            TableFormat::Separate => TableData::Separate {
                cos: stream.alloc_zeros::<T>(len / 2)?,
                sin: stream.alloc_zeros::<T>(len / 2)?,
            },
            TableFormat::Combined => TableData::Combined(stream.alloc_zeros::<T>(len)?),
        };
        let es = size_of::<T>() as u64;
        let mut guards: Vec<SyncOnDrop<'_>> = Vec::new();
        let (cos, sin, row_stride) = match &mut data {
            TableData::Separate { cos, sin } => {
                let (pc, gc) = cos.device_ptr_mut(stream);
                let (ps, gs) = sin.device_ptr_mut(stream);
                guards.extend([gc, gs]);
                (pc, ps, half as u64)
            }
            TableData::Combined(cache) => {
                let (p, g) = cache.device_ptr_mut(stream);
                guards.push(g);
                (p, p + half as u64 * es, rotary_dim as u64)
            }
        };
        let rows = max_position as u64;
        let items = rows * half as u64;
        let config = LaunchConfig {
            grid_dim: (
                items.div_ceil(BLOCK_THREADS as u64).min(i32::MAX as u64) as u32,
                1,
                1,
            ),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = TableArgs {
            cos,
            sin,
            dtype: T::DTYPE as u32,
            rows,
            half,
            row_stride,
            inv_freq,
            angle_mode: angle as u32,
            scale,
        };
        let func = self.module.function(TABLE_KERNEL)?;
        // SAFETY: `TableArgs` and the entry points' parameters come from the one list in
        // `rope_kernels::table_kernel_params!`, so they agree in order and type (callers checked
        // rotary_dim >= 2, so the `NonZeroU32` half is >= 1). The tables were just allocated with
        // `max_position` rows of `row_stride >= half` elements (separate: two buffers of `half`
        // per row; combined: one buffer of `rotary_dim` per row, sines starting `half` in, so
        // cos and sin elements are distinct), and `inv_freq` holds `half` f64. The buffers live
        // in `data`, returned to the caller; cudarc's drop of a `CudaSlice` waits on the stream,
        // so they outlive the kernel. The function was loaded in the stream's context.
        unsafe {
            args.launch(
                stream.context(),
                &func,
                config,
                stream.cu_stream(),
                StreamOverlap::None,
            )
        }?;
        // The guards record the writes on the stream; they end before the tables move out.
        drop(guards);
        Ok(SinCosTables { data, shape })
    }
}
