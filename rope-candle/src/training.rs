//! QK-norm + RoPE for training on candle tensors: [`norm_rope`], a custom op whose forward is
//! one fused launch (`Rope::run_fused_raw`: per-head RMS normalisation, then the rotation,
//! into a new tensor) and whose backward is rope-host's fused backward
//! (`Rope::run_fused_backward_raw`: the gradients of `xs` and of the weights), so gradients flow
//! through `candle_core::backprop`.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaStorage, CudaStorageSlice};
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use rope_host::cudarc::driver::{DevicePtr, DevicePtrMut};
use rope_host::{
    DType, DeviceAxisMap, Layout as RopeLayout, NormWeight, RawBuf, RawFusedGrads, RawFusedIo,
    RawFusedOp, RawIo, RawKOut, RawOp, RawQOut, RawQkNorm, RawTensor, RopeConfig, RopeStyle,
};

use crate::error::{Error, invalid};
use crate::fused::{
    Guards, Held, float_tensor, held_positions, raw_positions, raw_sincos, weight_buf,
};
use crate::layout::{Axes, contiguous, to_rope};
use crate::rich::{Positions, SinCos};

/// A QK-norm + RoPE step of one tensor: `x_e / sqrt(mean_e(x_e^2) + eps) * w'_e` per head
/// (`w' = w`, or `1 + w` with [`NormWeight::OnePlus`]), then the rotation of the whole head.
#[derive(Clone, Debug)]
pub struct NormRopeSpec {
    /// Pairing: rotate-half (NeoX, Llama) or interleaved (GPT-J).
    pub style: RopeStyle,
    /// Which axes of the 4-D tensor are batch, seq, heads and head features.
    pub axes: Axes,
    /// Where sin/cos come from.
    pub sincos: SinCos,
    /// Added to the mean square; finite and not negative.
    pub eps: f32,
    /// How the weights multiply.
    pub weight: NormWeight,
}

/// Positions an op keeps for its backward.
#[derive(Clone, Debug)]
enum OwnedPositions {
    Offset(u32),
    Ids(Tensor),
    MultiAxis(Tensor, Arc<DeviceAxisMap>),
}

impl OwnedPositions {
    fn new(positions: Positions<'_>) -> Self {
        match positions {
            Positions::Offset(o) => OwnedPositions::Offset(o),
            Positions::Ids(t) => OwnedPositions::Ids(t.clone()),
            Positions::MultiAxis { positions, axes } => {
                OwnedPositions::MultiAxis(positions.clone(), axes.clone())
            }
        }
    }

    fn get(&self) -> Positions<'_> {
        match self {
            OwnedPositions::Offset(o) => Positions::Offset(*o),
            OwnedPositions::Ids(t) => Positions::Ids(t),
            OwnedPositions::MultiAxis(positions, axes) => Positions::MultiAxis { positions, axes },
        }
    }
}

/// The tables (cos, sin) and the positions a launch reads, held.
type HeldReads<'t> = (Option<(Held<'t>, Held<'t>)>, Option<Held<'t>>);

/// The custom op: the spec and the positions.
struct NormRopeOp {
    spec: NormRopeSpec,
    positions: OwnedPositions,
}

/// `xs` (4-D, `spec.axes`; f32, f16 or bf16; any strides with the head features contiguous)
/// normalised per head by `weight` (`[head_dim]` of `xs`'s dtype) and rotated at `positions`,
/// as a new contiguous tensor; under `candle_core::backprop` the gradients of `xs` and
/// `weight` come from rope-host's fused backward (the weight's summed in a fixed order). Call
/// it on q and on k with their own weights (Qwen3's, OLMo 2's and Gemma 3's `q_norm`,
/// `k_norm`). CUDA only.
///
/// # Errors
/// A wrapped [`crate::Error`] naming the argument (`xs`, `norm.q_weight` for the weight,
/// `sincos`, `positions`, ...) when a tensor is not on `xs`'s CUDA device or the description
/// is invalid; nothing is launched then.
pub fn norm_rope(
    xs: &Tensor,
    weight: &Tensor,
    spec: &NormRopeSpec,
    positions: Positions<'_>,
) -> candle_core::Result<Tensor> {
    let op = NormRopeOp {
        spec: spec.clone(),
        positions: OwnedPositions::new(positions),
    };
    xs.apply_op2(weight, op)
}

/// A zero-head view at the start of `t`'s buffer: the fused launches' k, which this
/// one-tensor op has none of.
fn no_heads(t: &RawTensor) -> Result<RawTensor, Error> {
    let l = &t.layout;
    let strides = l.strides();
    Ok(RawTensor {
        buf: t.buf,
        layout: RopeLayout::strided(
            [l.batch(), l.seq(), 0, l.head_dim()],
            [strides[0], strides[1], l.head_dim(), 1],
            0,
        )?,
    })
}

/// The tensors' element type.
fn float_dtype(d: candle_core::DType, arg: &'static str) -> Result<DType, Error> {
    match d {
        candle_core::DType::F32 => Ok(DType::F32),
        candle_core::DType::F16 => Ok(DType::F16),
        candle_core::DType::BF16 => Ok(DType::BF16),
        d => Err(invalid(arg, format!("dtype {d:?}: only f32, f16 and bf16"))),
    }
}

impl NormRopeOp {
    /// The rotation's description for heads of `head_dim`, with `tables` and `ids` held.
    fn op<'a>(
        &self,
        g: &mut Guards<'a>,
        rope: &rope_host::Rope,
        held: (Option<&'a (Held<'_>, Held<'_>)>, Option<&'a Held<'_>>),
        (dtype, [batch, seq, _, head_dim]): (DType, [usize; 4]),
        weight: RawBuf,
    ) -> Result<RawFusedOp, Error> {
        let sincos = raw_sincos(g, rope, (&self.spec.sincos, held.0), dtype, head_dim)?;
        let positions = raw_positions(g, self.positions.get(), held.1, (batch, seq))?;
        let head_dim = u32::try_from(head_dim)
            .map_err(|_| invalid("xs", format!("head_dim {head_dim} exceeds u32")))?;
        Ok(RawFusedOp {
            rope: RawOp {
                config: RopeConfig::builder(head_dim, self.spec.style).build()?,
                dtype,
                positions,
                sincos,
            },
            norm: Some(RawQkNorm {
                q_weight: weight,
                k_weight: weight,
                eps: self.spec.eps,
                weight: self.spec.weight,
                scope: rope_host::NormScope::PerHead,
            }),
        })
    }

    /// The tables and positions the launches read, held.
    fn held(&self, device: &candle_core::Device) -> Result<HeldReads<'_>, Error> {
        let tables = match &self.spec.sincos {
            SinCos::Tables { cos, sin } => Some((
                Held::new("cos", cos, device)?,
                Held::new("sin", sin, device)?,
            )),
            _ => None,
        };
        Ok((tables, held_positions(self.positions.get(), device)?))
    }

    /// The forward step into a new contiguous tensor.
    fn forward(
        &self,
        (xs, xl): (&CudaStorage, &Layout),
        (w, wl): (&CudaStorage, &Layout),
    ) -> Result<(CudaStorage, Shape), Error> {
        let device = xs.device.clone();
        let candle_device = candle_core::Device::Cuda(device.clone());
        let stream = device.cuda_stream();
        let rope = rope_host::shared::on_stream(&stream)?;
        let dtype = float_dtype(xs.dtype(), "xs")?;
        if w.dtype() != xs.dtype() {
            return Err(invalid("norm.q_weight", "must have xs's dtype"));
        }
        let dims = self.spec.axes.bshd("xs", xl.dims())?;
        let (tables, ids) = self.held(&candle_device)?;
        let mut g = Guards {
            stream: &stream,
            held: Vec::new(),
        };
        let shape = xl.shape().clone();
        let elems = shape.elem_count();
        let input_layout = to_rope("xs", xl, self.spec.axes)?;
        let output_layout = contiguous("xs", &shape, self.spec.axes)?;
        let (w_start, w_end) = wl
            .contiguous_offsets()
            .ok_or_else(|| invalid("norm.q_weight", "must be contiguous"))?;
        macro_rules! run {
            ($x:expr, $t:ty) => {{
                // SAFETY: the launch below writes every element of `out` before anything reads
                // it; candle's stream orders later reads after that launch.
                let mut out = unsafe { device.alloc::<$t>(elems) }?;
                let w_slice = match &w.slice {
                    CudaStorageSlice::F32(s) if dtype == DType::F32 => s.device_ptr(&stream),
                    CudaStorageSlice::F16(s) if dtype == DType::F16 => s.device_ptr(&stream),
                    CudaStorageSlice::BF16(s) if dtype == DType::BF16 => s.device_ptr(&stream),
                    _ => return Err(invalid("norm.q_weight", "must have xs's dtype")),
                };
                let es = dtype.size() as u64;
                let weight = RawBuf {
                    ptr: w_slice.0 + w_start as u64 * es,
                    len: w_end - w_start,
                };
                let (x_ptr, x_guard) = $x.device_ptr(&stream);
                let out_len = out.len();
                let (out_ptr, out_guard) = out.device_ptr_mut(&stream);
                let input = RawTensor {
                    buf: RawBuf {
                        ptr: x_ptr,
                        len: $x.len(),
                    },
                    layout: input_layout,
                };
                let output = RawTensor {
                    buf: RawBuf {
                        ptr: out_ptr,
                        len: out_len,
                    },
                    layout: output_layout,
                };
                let op = self.op(
                    &mut g,
                    &rope,
                    (tables.as_ref(), ids.as_ref()),
                    (dtype, dims),
                    weight,
                )?;
                let io = RawFusedIo::Separate {
                    q: RawQOut::Elem(RawIo::OutOfPlace { input, output }),
                    k: RawKOut::Elem(RawIo::InPlace(no_heads(&output)?)),
                    v: None,
                };
                // SAFETY: `stream` is candle's stream of `xs`'s device and `rope` was made on
                // it; every address comes from a `CudaSlice` of that device with its length in
                // elements of the type rope-host is told (the weight's start offset within its
                // slice); the guards live until the launch is queued and candle's one stream
                // orders every other use of these buffers; `out` is new.
                unsafe { rope.run_fused_raw(&op, io, None, stream.cu_stream()) }?;
                drop((x_guard, out_guard, w_slice.1));
                drop(g);
                Ok((CudaStorage::wrap_cuda_slice(out, device.clone()), shape))
            }};
        }
        match &xs.slice {
            CudaStorageSlice::F32(s) => run!(s, f32),
            CudaStorageSlice::F16(s) => run!(s, rope_host::half::f16),
            CudaStorageSlice::BF16(s) => run!(s, rope_host::half::bf16),
            _ => Err(invalid("xs", "only f32, f16 and bf16")),
        }
    }

    /// The gradients of `xs` and `weight` from the output's gradient `grad`.
    fn backward(
        &self,
        xs: &Tensor,
        weight: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Tensor), Error> {
        let device = xs.device();
        let candle_core::Device::Cuda(cuda) = device else {
            return Err(invalid("xs", "the backward runs on CUDA tensors only"));
        };
        let grad = grad.contiguous()?;
        let grad_xs = Tensor::zeros(xs.shape(), xs.dtype(), device)?;
        let grad_w = Tensor::zeros(weight.shape(), weight.dtype(), device)?;
        // k has no heads here, but its weight gradient is a buffer of its own.
        let grad_k_w = Tensor::zeros(weight.shape(), weight.dtype(), device)?;
        let dims = self.spec.axes.bshd("xs", xs.dims())?;
        let stream = cuda.cuda_stream();
        let rope = rope_host::shared::on_stream(&stream)?;
        let workspace = Tensor::zeros(
            rope.fused_backward_workspace(dims[2], dims[3]),
            candle_core::DType::F32,
            device,
        )?;
        let dtype = float_dtype(xs.dtype(), "xs")?;
        let held = [
            Held::new("xs", xs, device)?,
            Held::new("grad", &grad, device)?,
            Held::new("grad.xs", &grad_xs, device)?,
            Held::new("norm.q_weight", weight, device)?,
            Held::new("grad.weight", &grad_w, device)?,
            Held::new("grad.k_weight", &grad_k_w, device)?,
            Held::new("workspace", &workspace, device)?,
        ];
        let (tables, ids) = self.held(device)?;
        let mut g = Guards {
            stream: &stream,
            held: Vec::new(),
        };
        let axes = self.spec.axes;
        let x = float_tensor(&mut g, &held[0], dtype, axes)?;
        let gy = float_tensor(&mut g, &held[1], dtype, axes)?;
        let gx = float_tensor(&mut g, &held[2], dtype, axes)?;
        let w = weight_buf(&mut g, &held[3], dtype)?;
        let gw = weight_buf(&mut g, &held[4], dtype)?;
        let gkw = weight_buf(&mut g, &held[5], dtype)?;
        let ws = weight_buf(&mut g, &held[6], DType::F32)?;
        let op = self.op(
            &mut g,
            &rope,
            (tables.as_ref(), ids.as_ref()),
            (dtype, dims),
            w,
        )?;
        let grads = RawFusedGrads {
            q_input: x,
            k_input: no_heads(&x)?,
            q: RawIo::OutOfPlace {
                input: gy,
                output: gx,
            },
            k: RawIo::InPlace(no_heads(&gx)?),
            q_weight: gw,
            k_weight: gkw,
            workspace: ws,
        };
        // SAFETY: as the forward's launch: candle's stream of the tensors' device, on which
        // `rope` was made; every address from a `CudaSlice` of that device (each tensor checked
        // to be on it) with its length in elements of the type rope-host is told; the storage
        // and slice guards live until the launches are queued; the written tensors are new.
        unsafe { rope.run_fused_backward_raw(&op, &grads, stream.cu_stream()) }?;
        drop(g);
        drop(held);
        Ok((grad_xs, grad_w))
    }
}

impl CustomOp2 for NormRopeOp {
    fn name(&self) -> &'static str {
        "rope-candle-norm-rope"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(invalid("xs", "rope_candle::norm_rope runs on CUDA tensors only").into())
    }

    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        Ok(self.forward((xs, xl), (w, wl))?)
    }

    fn bwd(
        &self,
        xs: &Tensor,
        weight: &Tensor,
        _: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let (gx, gw) = self.backward(xs, weight, grad)?;
        Ok((Some(gx), Some(gw)))
    }
}
