//! The candle custom op: one RoPE launch through `Rope::run_raw` on candle's stream and buffers.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice};
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, InplaceOp1, InplaceOp2, InplaceOp3, Layout, Shape,
    Tensor,
};
use rope_host::cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use rope_host::{
    DType, DeviceAxisMap, Direction, Frequencies, IdsShape, IntType, RawBuf, RawInts, RawIo, RawOp,
    RawPositions, RawSinCos, RawTensor, RawTensors, Rope, RopeConfig, RopeStyle, TableShape,
};

use crate::error::{Error, invalid};
use crate::layout::{Axes, contiguous, to_rope};

/// Where sin/cos come from, inside an op.
#[derive(Clone, Debug)]
pub(crate) enum Source {
    /// Tables passed as the op's second and third tensors, `[rows, r/2]` or `[batch, rows, r/2]`.
    Tables,
    /// Computed in the kernel from `theta`.
    Computed {
        /// The frequency base.
        theta: f64,
    },
    /// Computed in the kernel from uploaded frequencies (any scaling family).
    Frequencies(Arc<Frequencies>),
}

/// Where positions come from, inside an op.
#[derive(Clone, Debug)]
pub(crate) enum Pos {
    /// `p = offset + s`.
    Offset(u32),
    /// Device ids passed as the op's second tensor: `[seq]` or `[batch, seq]`.
    Ids,
    /// Multi-axis positions passed as the op's second tensor, `[n_axes, batch, seq]` or
    /// `[n_axes, batch * seq]`, each pair's axis from the map.
    MultiAxis(Arc<DeviceAxisMap>),
}

/// Where a launch writes: a fresh contiguous tensor, or `xs` itself (any strides).
enum Target<'a, T> {
    /// `out <- rope(x)`.
    New {
        x: &'a CudaSlice<T>,
        out: &'a mut CudaSlice<T>,
    },
    /// `x <- rope(x)`.
    InPlace(&'a mut CudaSlice<T>),
}

/// One RoPE launch: the style, axes, rotated width, direction and sources.
#[derive(Clone, Debug)]
pub(crate) struct RopeCandleOp {
    pub(crate) style: RopeStyle,
    pub(crate) axes: Axes,
    pub(crate) rotary_dim: Option<u32>,
    pub(crate) direction: Direction,
    pub(crate) source: Source,
    pub(crate) pos: Pos,
}

impl RopeCandleOp {
    /// The same op rotating the other way: the gradient of this one.
    pub(crate) fn reversed(&self) -> Self {
        let direction = match self.direction {
            Direction::Forward => Direction::Backward,
            Direction::Backward => Direction::Forward,
        };
        Self {
            direction,
            ..self.clone()
        }
    }

    fn name_of(&self) -> &'static str {
        match self.direction {
            Direction::Forward => "rope-rs",
            Direction::Backward => "rope-rs-backward",
        }
    }

    /// rope-host's config for head size `head_dim`.
    fn config(&self, head_dim: usize) -> Result<RopeConfig, Error> {
        let head_dim = u32::try_from(head_dim)
            .map_err(|_| invalid("xs", format!("head_dim {head_dim} exceeds u32")))?;
        let mut builder = RopeConfig::builder(head_dim, self.style).direction(self.direction);
        if let Some(r) = self.rotary_dim {
            builder = builder.rotary_dim(r);
        }
        Ok(builder.build()?)
    }

    /// Launches on candle's stream: `xs` (any strides) into a new contiguous tensor.
    fn launch(
        &self,
        xs: (&CudaStorage, &Layout),
        tables: Option<[(&CudaStorage, &Layout); 2]>,
        ids: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape), Error> {
        let (storage, layout) = xs;
        match &storage.slice {
            CudaStorageSlice::F32(s) => {
                self.launch_typed(s, DType::F32, layout, tables, ids, storage)
            }
            CudaStorageSlice::F16(s) => {
                self.launch_typed(s, DType::F16, layout, tables, ids, storage)
            }
            CudaStorageSlice::BF16(s) => {
                self.launch_typed(s, DType::BF16, layout, tables, ids, storage)
            }
            _ => Err(invalid(
                "xs",
                format!("dtype {:?}: only f32, f16 and bf16", storage.dtype()),
            )),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_typed<T: DeviceRepr + candle_core::cuda_backend::CudaDType>(
        &self,
        x: &CudaSlice<T>,
        dtype: DType,
        layout: &Layout,
        tables: Option<[(&CudaStorage, &Layout); 2]>,
        ids: Option<(&CudaStorage, &Layout)>,
        storage: &CudaStorage,
    ) -> Result<(CudaStorage, Shape), Error> {
        let device: &CudaDevice = &storage.device;
        let shape = layout.shape().clone();
        let elems = shape.elem_count();
        // SAFETY: the launch below writes every element of `out` (out of place, rotated pairs
        // and passed-through features alike) before anything reads it; candle's stream orders
        // any later read after that launch.
        let mut out = unsafe { device.alloc::<T>(elems) }?;
        let target = Target::New { x, out: &mut out };
        self.launch_into(target, dtype, layout, tables, ids, device)?;
        Ok((CudaStorage::wrap_cuda_slice(out, device.clone()), shape))
    }

    /// Launches on candle's stream, rotating `xs` (any strides without overlap) where it is.
    fn launch_in_place(
        &self,
        storage: &mut CudaStorage,
        layout: &Layout,
        tables: Option<[(&CudaStorage, &Layout); 2]>,
        ids: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(), Error> {
        let device = storage.device.clone();
        let dtype = storage.dtype();
        match &mut storage.slice {
            CudaStorageSlice::F32(s) => {
                let target = Target::InPlace(s);
                self.launch_into(target, DType::F32, layout, tables, ids, &device)
            }
            CudaStorageSlice::F16(s) => {
                let target = Target::InPlace(s);
                self.launch_into(target, DType::F16, layout, tables, ids, &device)
            }
            CudaStorageSlice::BF16(s) => {
                let target = Target::InPlace(s);
                self.launch_into(target, DType::BF16, layout, tables, ids, &device)
            }
            _ => Err(invalid(
                "xs",
                format!("dtype {dtype:?}: only f32, f16 and bf16"),
            )),
        }
    }

    /// Binds, describes and launches into `target`; the guards end with this call.
    fn launch_into<T: DeviceRepr>(
        &self,
        target: Target<'_, T>,
        dtype: DType,
        layout: &Layout,
        tables: Option<[(&CudaStorage, &Layout); 2]>,
        ids: Option<(&CudaStorage, &Layout)>,
        device: &CudaDevice,
    ) -> Result<(), Error> {
        let stream = device.cuda_stream();
        let rope = rope_for(device)?;
        let input = to_rope("xs", layout, self.axes)?;
        let output = contiguous("xs", layout.shape(), self.axes)?;
        let [batch, seq, _, head_dim] = self.axes.bshd("xs", layout.dims())?;
        let config = self.config(head_dim)?;
        let rotary_dim = config.rotary_dim();
        let mut guards = Vec::new();
        let io = match target {
            Target::New { x, out } => {
                let out_len = out.len();
                let (x_ptr, x_guard) = x.device_ptr(&stream);
                let (out_ptr, out_guard) = out.device_ptr_mut(&stream);
                guards.extend([x_guard, out_guard]);
                RawIo::OutOfPlace {
                    input: RawTensor {
                        buf: RawBuf {
                            ptr: x_ptr,
                            len: x.len(),
                        },
                        layout: input,
                    },
                    output: RawTensor {
                        buf: RawBuf {
                            ptr: out_ptr,
                            len: out_len,
                        },
                        layout: output,
                    },
                }
            }
            Target::InPlace(x) => {
                let len = x.len();
                let (ptr, guard) = x.device_ptr_mut(&stream);
                guards.push(guard);
                RawIo::InPlace(RawTensor {
                    buf: RawBuf { ptr, len },
                    layout: input,
                })
            }
        };

        let mut row_offsets: Option<CudaSlice<i64>> = None;
        let sincos = match (&self.source, tables) {
            (Source::Tables, Some([(cos, cos_l), (sin, sin_l)])) => {
                let (cos_buf, table_dtype, rows, batched) =
                    table_buf("cos", cos, cos_l, rotary_dim, &stream, &mut guards)?;
                let (sin_buf, sin_dtype, sin_rows, _) =
                    table_buf("sin", sin, sin_l, rotary_dim, &stream, &mut guards)?;
                if sin_dtype != table_dtype || sin_rows != rows || sin_l.dims() != cos_l.dims() {
                    return Err(invalid("sin", "must have cos's shape and dtype"));
                }
                if table_dtype != dtype && table_dtype != DType::F32 {
                    return Err(invalid("cos", "tables are xs's dtype or f32"));
                }
                let max_position = if batched {
                    if cos_l.dims()[0] != batch {
                        return Err(invalid("cos", "a batched table has xs's batch rows"));
                    }
                    // Batch row b reads table rows b * rows + s: row offsets on the device.
                    let offsets: Vec<i64> = (0..batch).map(|b| (b * rows) as i64).collect();
                    row_offsets = Some(
                        stream
                            .clone_htod(&offsets)
                            .map_err(|e| Error::Rope(e.into()))?,
                    );
                    batch * rows
                } else {
                    rows
                };
                RawSinCos::Table {
                    cos: cos_buf,
                    sin: sin_buf,
                    dtype: table_dtype,
                    shape: TableShape {
                        max_position,
                        rotary_dim,
                    },
                }
            }
            (Source::Computed { theta }, None) => {
                rope.prepare(*theta, rotary_dim)?;
                RawSinCos::Computed { theta: *theta }
            }
            (Source::Frequencies(f), None) => f.raw(),
            _ => return Err(invalid("sincos", "tables go with Source::Tables only")),
        };
        let _offsets_guard;
        let positions = match (&self.pos, ids, &row_offsets) {
            (&Pos::Offset(o), None, None) => RawPositions::Offset(o),
            (Pos::Offset(0), None, Some(offsets)) => {
                let (ptr, guard) = offsets.device_ptr(&stream);
                _offsets_guard = guard;
                RawPositions::RowOffsets(RawInts {
                    buf: RawBuf { ptr, len: batch },
                    ty: IntType::I64,
                })
            }
            (Pos::Ids, Some((ids, ids_l)), None) => {
                let shape = ids_shape(ids_l.dims(), batch, seq)?;
                let ids = ids_buf("ids", ids, ids_l, &stream, &mut guards)?;
                RawPositions::Ids { ids, shape }
            }
            (Pos::MultiAxis(axes), Some((p, p_l)), None) => {
                multi_axis_shape(p_l.dims(), axes.n_axes(), batch, seq)?;
                RawPositions::MultiAxis {
                    positions: ids_buf("positions", p, p_l, &stream, &mut guards)?,
                    axes: axes.raw(),
                }
            }
            _ => return Err(invalid("positions", "unsupported combination with tables")),
        };
        let op = RawOp {
            config,
            dtype,
            positions,
            sincos,
        };
        // SAFETY: `stream` is candle's stream of this device and `rope` was made on it, so the
        // context matches; every address comes from a `CudaSlice` of that device with its
        // length in elements of the stated type (tables and ids through `table_buf`/`ids_buf`,
        // which add only in-range start offsets); the guards (`guards`, `_offsets_guard`) order
        // the launch after earlier work on the buffers and live until it is queued; an
        // out-of-place `out` is fresh, so nothing else writes it; an in-place `xs` is borrowed
        // mutably from candle's storage (candle checked that no source shares it, and rope-host
        // checks that its strides do not overlap); `row_offsets` and the frequencies were
        // uploaded on this same stream before the launch.
        unsafe { rope.run_raw(&op, RawTensors::Q(io), stream.cu_stream()) }?;
        Ok(())
    }
}

/// How position ids of dims `dims` cover `batch` rows of `seq` tokens: `[seq]` shared by the
/// rows, or `[batch, seq]`.
pub(crate) fn ids_shape(dims: &[usize], batch: usize, seq: usize) -> Result<IdsShape, Error> {
    match dims {
        [s] if *s == seq => Ok(IdsShape::Shared),
        [b, s] if *b == batch && *s == seq => Ok(IdsShape::PerRow),
        d => Err(invalid(
            "ids",
            format!("expected [seq] or [batch, seq] = [{batch}, {seq}], got {d:?}"),
        )),
    }
}

/// Checks that multi-axis positions of dims `dims` hold `n_axes` rows of one position per
/// token of `batch` rows of `seq`: `[n_axes, batch, seq]` or `[n_axes, batch * seq]`.
pub(crate) fn multi_axis_shape(
    dims: &[usize],
    n_axes: u32,
    batch: usize,
    seq: usize,
) -> Result<(), Error> {
    let n = n_axes as usize;
    match dims {
        [a, b, s] if (*a, *b, *s) == (n, batch, seq) => Ok(()),
        [a, t] if *a == n && Some(*t) == batch.checked_mul(seq) => Ok(()),
        d => Err(invalid(
            "positions",
            format!(
                "expected [n_axes, batch, seq] = [{n}, {batch}, {seq}] or [n_axes, batch * seq], got {d:?}"
            ),
        )),
    }
}

/// A table's buffer from its start offset, its dtype, rows, and whether it is batched.
fn table_buf<'a>(
    arg: &'static str,
    storage: &'a CudaStorage,
    layout: &Layout,
    rotary_dim: u32,
    stream: &'a Arc<rope_host::cudarc::driver::CudaStream>,
    guards: &mut Vec<rope_host::cudarc::driver::SyncOnDrop<'a>>,
) -> Result<(RawBuf, DType, usize, bool), Error> {
    let half = rotary_dim as usize / 2;
    let (rows, batched) = match layout.dims() {
        [t, h] if *h == half => (*t, false),
        [_, t, h] if *h == half => (*t, true),
        d => {
            return Err(invalid(
                arg,
                format!("expected [rows, {half}] or [batch, rows, {half}], got {d:?}"),
            ));
        }
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| invalid(arg, "tables must be contiguous"))?;
    let (ptr, size, guard, dtype) = match &storage.slice {
        CudaStorageSlice::F32(s) => {
            let (p, g) = s.device_ptr(stream);
            (p, 4, g, DType::F32)
        }
        CudaStorageSlice::F16(s) => {
            let (p, g) = s.device_ptr(stream);
            (p, 2, g, DType::F16)
        }
        CudaStorageSlice::BF16(s) => {
            let (p, g) = s.device_ptr(stream);
            (p, 2, g, DType::BF16)
        }
        _ => return Err(invalid(arg, "tables are f32, f16 or bf16")),
    };
    guards.push(guard);
    let buf = RawBuf {
        ptr: ptr + (start * size) as u64,
        len: end - start,
    };
    Ok((buf, dtype, rows, batched))
}

/// Positions (i32 or i64, contiguous) from their start offset; errors name `arg`.
fn ids_buf<'a>(
    arg: &'static str,
    storage: &'a CudaStorage,
    layout: &Layout,
    stream: &'a Arc<rope_host::cudarc::driver::CudaStream>,
    guards: &mut Vec<rope_host::cudarc::driver::SyncOnDrop<'a>>,
) -> Result<RawInts, Error> {
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| invalid(arg, "positions must be contiguous"))?;
    let (ptr, size, guard, ty) = match &storage.slice {
        CudaStorageSlice::I32(s) => {
            let (p, g) = s.device_ptr(stream);
            (p, 4, g, IntType::I32)
        }
        CudaStorageSlice::I64(s) => {
            let (p, g) = s.device_ptr(stream);
            (p, 8, g, IntType::I64)
        }
        _ => return Err(invalid(arg, "positions are i32 or i64")),
    };
    guards.push(guard);
    Ok(RawInts {
        buf: RawBuf {
            ptr: ptr + (start * size) as u64,
            len: end - start,
        },
        ty,
    })
}

/// The process's `Rope` for candle device `device`'s stream ([`rope_host::shared::on_stream`]).
fn rope_for(device: &CudaDevice) -> Result<Arc<Rope>, Error> {
    Ok(rope_host::shared::on_stream(&device.cuda_stream())?)
}

/// The error `cpu_fwd` returns: the ops themselves run on CUDA only.
fn cpu_error(op: &RopeCandleOp) -> candle_core::Error {
    invalid(
        "xs",
        format!(
            "{}: the custom op runs on CUDA tensors only; rope-candle's functions send CPU \
             tensors to candle_nn::rotary_emb instead",
            op.name_of()
        ),
    )
    .into()
}

impl CustomOp1 for RopeCandleOp {
    fn name(&self) -> &'static str {
        self.name_of()
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(cpu_error(self))
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        Ok(self.launch((s, l), None, None)?)
    }

    fn bwd(&self, _: &Tensor, _: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(grad.apply_op1(self.reversed())?))
    }
}

impl CustomOp2 for RopeCandleOp {
    fn name(&self) -> &'static str {
        self.name_of()
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(cpu_error(self))
    }

    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        l: &Layout,
        ids: &CudaStorage,
        ids_l: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        Ok(self.launch((s, l), None, Some((ids, ids_l)))?)
    }

    fn bwd(
        &self,
        _: &Tensor,
        ids: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.apply_op2(ids, self.reversed())?), None))
    }
}

impl CustomOp3 for RopeCandleOp {
    fn name(&self) -> &'static str {
        self.name_of()
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(cpu_error(self))
    }

    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        l: &Layout,
        cos: &CudaStorage,
        cos_l: &Layout,
        sin: &CudaStorage,
        sin_l: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        Ok(self.launch((s, l), Some([(cos, cos_l), (sin, sin_l)]), None)?)
    }

    /// The gradient of `xs` only: cos and sin get none (they are constants in every model
    /// this serves).
    fn bwd(
        &self,
        _: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.apply_op3(cos, sin, self.reversed())?), None, None))
    }
}

impl InplaceOp1 for RopeCandleOp {
    fn name(&self) -> &'static str {
        self.name_of()
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        Err(cpu_error(self))
    }

    fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> candle_core::Result<()> {
        Ok(self.launch_in_place(s, l, None, None)?)
    }
}

/// In place with position ids as the source.
impl InplaceOp2 for RopeCandleOp {
    fn name(&self) -> &'static str {
        self.name_of()
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        Err(cpu_error(self))
    }

    fn cuda_fwd(
        &self,
        s: &mut CudaStorage,
        l: &Layout,
        ids: &CudaStorage,
        ids_l: &Layout,
    ) -> candle_core::Result<()> {
        Ok(self.launch_in_place(s, l, None, Some((ids, ids_l)))?)
    }
}

/// In place with cos and sin tables as the sources.
impl InplaceOp3 for RopeCandleOp {
    fn name(&self) -> &'static str {
        self.name_of()
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        Err(cpu_error(self))
    }

    fn cuda_fwd(
        &self,
        s: &mut CudaStorage,
        l: &Layout,
        cos: &CudaStorage,
        cos_l: &Layout,
        sin: &CudaStorage,
        sin_l: &Layout,
    ) -> candle_core::Result<()> {
        Ok(self.launch_in_place(s, l, Some([(cos, cos_l), (sin, sin_l)]), None)?)
    }
}
