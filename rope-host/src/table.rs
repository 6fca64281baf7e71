//! Cos/sin tables built on the GPU. Mirrors `kernels-gpu/src/table.rs`.

use cudarc::driver::{
    CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use kernels_gpu::abi::{BLOCK_THREADS, TableKernelName};

use crate::error::{Result, invalid};
use crate::freq::{AngleMode, Frequencies};
use crate::rope::{Rope, RopeElem, SinCos};

/// How a table pair is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TableFormat {
    /// Two tables `cos`, `sin` of `[max_position, rotary_dim / 2]` ([`SinCos::Table`]).
    Separate,
    /// One `cos_sin_cache [max_position, rotary_dim]`: each row the cosines, then the sines
    /// ([`SinCos::CosSinCache`], vLLM's and FlashInfer's format).
    Combined,
}

/// Tables built by [`Rope::build_tables`], owned on the device.
#[derive(Debug)]
pub enum SinCosTables<T> {
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

impl<T> SinCosTables<T> {
    /// The tables as the sin/cos source of a [`crate::RopeOp`].
    pub fn sincos(&self) -> SinCos<'_, T> {
        match self {
            Self::Separate { cos, sin } => SinCos::Table {
                cos: cos.as_view(),
                sin: sin.as_view(),
            },
            Self::Combined(cache) => SinCos::CosSinCache(cache.as_view()),
        }
    }
}

impl Rope {
    /// Builds the tables of `cos`/`sin(p * theta^(-2i / rotary_dim))` for positions
    /// `0..max_position` on the GPU, with the in-kernel sin/cos arithmetic (angle in `f64`,
    /// within one `f32` ulp) rounded once to `T`; asynchronous on the stream.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `theta` (not finite and positive), `rotary_dim` (zero
    /// or odd) or `max_position` (zero, or a table too large to address);
    /// [`crate::Error::Driver`] when allocation or the launch fails.
    pub fn build_tables<T: RopeElem + ValidAsZeroBits>(
        &self,
        theta: f64,
        rotary_dim: u32,
        max_position: usize,
        format: TableFormat,
    ) -> Result<SinCosTables<T>> {
        if !(theta.is_finite() && theta > 0.0) {
            return Err(invalid(
                "theta",
                format!("must be finite and positive, got {theta}"),
            ));
        }
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
            return Err(invalid(
                "rotary_dim",
                format!("must be even and at least 2, got {rotary_dim}"),
            ));
        }
        let inv_freq = self.inv_freq(theta, rotary_dim)?;
        self.launch_tables(
            &inv_freq,
            rotary_dim,
            (AngleMode::Exact, 1.0),
            max_position,
            format,
        )
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
        self.launch_tables(
            &freqs.inv_freq,
            freqs.rotary_dim,
            mode,
            max_position,
            format,
        )
    }

    /// Allocates the tables and launches the builder.
    fn launch_tables<T: RopeElem + ValidAsZeroBits>(
        &self,
        inv_freq: &CudaSlice<f64>,
        rotary_dim: u32,
        (angle, scale): (AngleMode, f32),
        max_position: usize,
        format: TableFormat,
    ) -> Result<SinCosTables<T>> {
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
        let mut tables = match format {
            TableFormat::Separate => SinCosTables::Separate {
                cos: stream.alloc_zeros::<T>(len / 2)?,
                sin: stream.alloc_zeros::<T>(len / 2)?,
            },
            TableFormat::Combined => SinCosTables::Combined(stream.alloc_zeros::<T>(len)?),
        };
        let es = size_of::<T>() as u64;
        let (cos, sin, row_stride, guards) = match &mut tables {
            SinCosTables::Separate { cos, sin } => {
                let (pc, gc) = cos.device_ptr_mut(stream);
                let (ps, gs) = sin.device_ptr_mut(stream);
                (pc, ps, half as u64, vec![gc, gs])
            }
            SinCosTables::Combined(cache) => {
                let (p, g) = cache.device_ptr_mut(stream);
                (p, p + half as u64 * es, rotary_dim as u64, vec![g])
            }
        };
        let (freq, _gf) = inv_freq.device_ptr(stream);
        let positions = max_position as u64;
        let items = positions * half as u64;
        let config = LaunchConfig {
            grid_dim: (
                items.div_ceil(BLOCK_THREADS as u64).min(i32::MAX as u64) as u32,
                1,
                1,
            ),
            block_dim: (BLOCK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let angle = angle as u32;
        let func = self
            .module
            .function(TableKernelName { dtype: T::DTYPE }.symbol());
        let mut launch = stream.launch_builder(func);
        launch
            .arg(&cos)
            .arg(&sin)
            .arg(&positions)
            .arg(&half)
            .arg(&row_stride)
            .arg(&freq)
            .arg(&angle)
            .arg(&scale);
        // SAFETY: the arguments match `table_kernel!` in kernels-gpu/src/table.rs in order and
        // type (pointers as u64, NonZeroU32 as u32: callers checked rotary_dim >= 2, so
        // half >= 1). The tables were just allocated with `max_position` rows of
        // `row_stride >= half` elements (separate: two buffers of `half` per row; combined: one
        // buffer of `rotary_dim` per row, sines starting `half` in, so cos and sin elements are
        // distinct), and `inv_freq` holds `half` f64. The buffers live in `tables`, returned to
        // the caller; cudarc's drop of a `CudaSlice` waits on the stream, so they outlive the
        // kernel.
        unsafe { launch.launch(config) }?;
        // The guards record the writes on the stream; they end before the tables move out.
        drop(guards);
        Ok(tables)
    }
}
