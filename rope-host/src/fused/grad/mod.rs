//! The QK-norm + RoPE backward: [`Rope::run_fused_backward`] (views) and
//! [`Rope::run_fused_backward_raw`] (addresses). Mirrors `rope-kernels/src/fused/grad.rs`.
//!
//! # Formula
//! The forward step is the fused launch of a [`super::FusedOp`] with a [`super::QkNorm`]: for
//! each q and k head `x` of `d = head_dim` features, `r = 1 / sqrt(sum_e x_e^2 / d + eps)`,
//! `n = x r`, `y = R (n * w')` (`w' = w`, or `1 + w` for [`super::NormWeight::OnePlus`]; `R`
//! the rotation at the token's position). From the gradient `gy` of its outputs and its inputs
//! `x`, the backward writes, per head, `gx_e = r (gz_e w'_e - n_e c)` with `gz = R^T gy` and
//! `c = r (sum_e gz_e w'_e x_e) / d`, and per weight vector `gw_e = sum over tokens and heads of
//! gz_e n_e` (q's heads for q's weights, k's for k's), all in `f32`, each output rounded once.
//!
//! # A launch
//! Two kernels on the stream: the gradient kernel writes `gx` and one row of `f32` partial
//! weight sums per block into the workspace, then the weights kernel sums the rows in a fixed
//! order into the weights' gradients (the same launch gives the same bits every time). As
//! [`Rope::run_fused`]: bind, plan (validation, access width, grid), encode, launch.

mod plan;

use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaViewMut, LaunchConfig};
use rope_kernels::abi::{
    NORM_GRAD_WEIGHTS_FEATURES, NORM_GRAD_WEIGHTS_THREADS, NormGradKernelName,
};

use super::raw::RawFusedOp;
use super::request::{FusedRequest, NopeParts, RawNorm};
use super::{FusedOp, QkNorm};
use crate::bind::{Binder, RawBuf};
use crate::config::RopeElem;
use crate::device::StreamOverlap;
use crate::error::{Result, invalid};
use crate::handle::{FreqUse, Rope};
use crate::kernel_args::{NormGradArgs, NormGradWeightsArgs, RopeArgs};
use crate::layout::Layout;
use crate::op::{Io, Tensor};
use crate::plan::Request;
use crate::rope::{RawIo, RawTensor, Work, bind_io};

pub(super) use plan::{GradPlan, max_grad_blocks, plan_grad};

/// The tensors of a QK-norm + RoPE backward ([`Rope::run_fused_backward`]).
#[derive(Debug)]
pub struct FusedGrads<'a, T> {
    /// The forward step's q input, before its norm (`[batch, seq, heads, head_dim]`).
    pub q_input: Tensor<'a, T>,
    /// The forward step's k input, before its norm.
    pub k_input: Tensor<'a, T>,
    /// q's gradients: the forward output's read, the input's written (over it in place, or
    /// into an output of its dimensions).
    pub q: Io<'a, T>,
    /// k's gradients, as q's.
    pub k: Io<'a, T>,
    /// The gradient of q's norm weights, `head_dim` elements, written.
    pub q_weight: CudaViewMut<'a, T>,
    /// The gradient of k's norm weights, `head_dim` elements, written.
    pub k_weight: CudaViewMut<'a, T>,
    /// Scratch for the weights' partial sums: at least
    /// [`Rope::fused_backward_workspace`] `f32`.
    pub workspace: CudaViewMut<'a, f32>,
}

/// [`FusedGrads`] by address, for [`Rope::run_fused_backward_raw`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawFusedGrads {
    /// The forward step's q input, before its norm.
    pub q_input: RawTensor,
    /// The forward step's k input, before its norm.
    pub k_input: RawTensor,
    /// q's gradients (the output's read, the input's written).
    pub q: RawIo,
    /// k's gradients.
    pub k: RawIo,
    /// The gradient of q's norm weights, `head_dim` elements of the tensors' type.
    pub q_weight: RawBuf,
    /// The gradient of k's norm weights.
    pub k_weight: RawBuf,
    /// Scratch, `f32`: at least [`Rope::fused_backward_workspace`] elements.
    pub workspace: RawBuf,
}

/// A backward launch by address: the fused request of the gradients (q and k's gradients as
/// the rotated tensors, the norm) and the rest.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GradRequest {
    pub(crate) fused: FusedRequest,
    /// The forward step's norm (also `fused.norm`, for its checks).
    pub(crate) norm: RawNorm,
    pub(crate) q_input: (RawBuf, Layout),
    pub(crate) k_input: (RawBuf, Layout),
    pub(crate) q_weight: RawBuf,
    pub(crate) k_weight: RawBuf,
    pub(crate) workspace: RawBuf,
}

/// The fused request of a backward: its gradients as the rotated tensors.
fn fused_request(rope: Request, norm: RawNorm) -> FusedRequest {
    FusedRequest {
        rope,
        q_fp8: None,
        k_fp8: None,
        k_written: true,
        v: None,
        norm: Some(norm),
        cache: None,
        nope: NopeParts::default(),
    }
}

/// The error of a backward without a norm.
fn no_norm() -> crate::Error {
    invalid(
        "norm",
        "the fused backward is the QK-norm's and the rotation's; a rotation alone runs backward \
         through Rope::run with Direction::Backward",
    )
}

impl Rope {
    /// The `f32` scratch [`Rope::run_fused_backward`] needs for `heads` q and k heads (both
    /// together) of `head_dim` features: two rows of `head_dim` partial sums (q's and k's) per
    /// block of its grid, at most a full complement of blocks on every multiprocessor of the
    /// device or one per head.
    pub fn fused_backward_workspace(&self, heads: usize, head_dim: usize) -> usize {
        max_grad_blocks(&self.facts, heads).saturating_mul(2 * head_dim)
    }

    /// Validates and launches the backward of a fused QK-norm + RoPE step (`op`, the forward
    /// step's, with its norm): the gradients of q's and k's inputs and of both norm weights
    /// (see the module documentation for the formula). Asynchronous on the stream, allocating
    /// and synchronizing nothing (with computed sin/cos, call [`Rope::prepare`] first to
    /// capture it in a CUDA graph).
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming the offending argument (nothing is launched and no
    /// output is touched): as [`Rope::run_fused`] for `op` and the gradients, and `norm`
    /// without a norm, `config` for a partial or backward rotation, `q_input`/`k_input` for
    /// inputs whose dimensions differ from the gradients' or that meet a written tensor,
    /// `q_weight`/`k_weight` for weight gradients of the wrong length, `workspace` when it is
    /// too small; [`crate::Error::Driver`] when a launch fails.
    pub fn run_fused_backward<T: RopeElem>(
        &self,
        op: &FusedOp<'_, T>,
        mut grads: FusedGrads<'_, T>,
    ) -> Result<()> {
        let mut binder = Binder::new(&self.stream);
        let norm = op.norm.as_ref().ok_or_else(no_norm)?;
        let req = bind(&mut binder, op, norm, &mut grads)?;
        // SAFETY: the stream is the `Rope`'s; the binder checked every view's context and
        // holds its length; the guards, dropped after the launch, order later uses after it.
        unsafe { self.launch_grad(&req, self.stream.cu_stream(), FreqUse::OwnStream) }?;
        drop(binder);
        Ok(())
    }

    /// [`Rope::run_fused_backward`] by address, on `stream`, for memory and streams other
    /// frameworks own; everything is validated as there, on the addresses and lengths given.
    ///
    /// # Safety
    /// The promises of [`Rope::run_fused_raw`] for `op` and the gradients, and: the inputs
    /// and weight gradients hold `len` elements of `op.rope.dtype`, the workspace `len` `f32`,
    /// at `ptr` in the context of `stream`, alive until both kernels have finished on it, and
    /// nothing else touches what the launch writes meanwhile.
    ///
    /// # Errors
    /// As [`Rope::run_fused_backward`], except that nothing checks contexts.
    pub unsafe fn run_fused_backward_raw(
        &self,
        op: &RawFusedOp,
        grads: &RawFusedGrads,
        stream: CUstream,
    ) -> Result<()> {
        let norm = op.norm.as_ref().ok_or_else(no_norm)?;
        let rope = Request {
            config: op.rope.config,
            dtype: op.rope.dtype,
            q: grads.q.into(),
            k: Some(grads.k.into()),
            packed: false,
            positions: op.rope.positions,
            sincos: op.rope.sincos,
        };
        let norm = norm.raw();
        let req = GradRequest {
            fused: fused_request(rope, norm),
            norm,
            q_input: (grads.q_input.buf, grads.q_input.layout),
            k_input: (grads.k_input.buf, grads.k_input.layout),
            q_weight: grads.q_weight,
            k_weight: grads.k_weight,
            workspace: grads.workspace,
        };
        // SAFETY: the caller's promises are `launch_grad`'s.
        unsafe { self.launch_grad(&req, stream, FreqUse::OtherStream) }
    }

    /// Plans, encodes and launches a backward request on `stream`.
    ///
    /// # Safety
    /// Every address of `req` is device memory of this context holding the length given,
    /// alive and not used by others until both kernels have finished on `stream`, a live
    /// stream of this context.
    unsafe fn launch_grad(&self, req: &GradRequest, stream: CUstream, on: FreqUse) -> Result<()> {
        let blocks = |k: NormGradKernelName, threads: u32| {
            self.module
                .blocks_per_sm_at(k.symbol(), threads, 0)
                .unwrap_or(1)
        };
        let Some(plan) = plan_grad(req, &self.facts, &blocks)? else {
            return Ok(());
        };
        let rope = &req.fused.rope;
        let work = Work {
            grid: &plan.grid,
            tokens: plan.tokens,
            rot_groups: plan.groups,
            lanes: plan.lanes,
        };
        let plans = (&plan.positions, &plan.sincos);
        let (args, weights) = encode(req, &plan, self.rope_args(rope, &work, plans, on)?);
        let context = self.stream.context();
        let function = self.module.function(plan.kernel.symbol())?;
        let weights_function = self.module.function(plan.kernel.weights_symbol())?;
        // SAFETY: `NormGradArgs` comes from `norm_grad_kernel_params!`, the entry points' list,
        // and `NormGradWeightsArgs` from `norm_grad_weights_kernel_params!`. The plan proved what
        // their `# Safety` asks: every tensor, input, weight and gradient holds what its layout
        // addresses, aligned to `lanes`; written regions overlap nothing else; the whole head
        // rotates with `rot_groups = half / pairs` threads in segments of the power of two at
        // or above it, at most 32, `heads_per_chunk` their slots per warp times
        // `token_warps_heads_per_thread`, in blocks of whole warps of at least `half` threads;
        // or 64 or 128 groups in segments of whole warps, `heads_per_chunk` the heads of one,
        // in blocks of whole segments with `2 half` and each warp's sums within the shared
        // buffer; at most `NORM_GRAD_MAX_THREADS` threads, with `4 half` and `2 head_dim`
        // within the shared buffer; the workspace holds two rows per block (the weights kernel reads those rows,
        // after the gradient kernel on the same stream); positions and sin/cos as for
        // `Rope::run`. Both functions were loaded in this context and wait for nothing.
        unsafe {
            args.launch(
                context,
                &function,
                plan.grid.config,
                stream,
                StreamOverlap::None,
            )?;
            weights.launch(
                context,
                &weights_function,
                weights_config(rope.config.head_dim()),
                stream,
                StreamOverlap::None,
            )
        }
    }
}

/// Reduces the views to a [`GradRequest`] of addresses, each checked to belong to the
/// binder's context.
fn bind<'s, T: RopeElem>(
    binder: &mut Binder<'s>,
    op: &'s FusedOp<'_, T>,
    norm: &'s QkNorm<'_, T>,
    grads: &'s mut FusedGrads<'_, T>,
) -> Result<GradRequest> {
    let q = bind_io(binder, ("q", "q.output"), &mut grads.q)?;
    let k = bind_io(binder, ("k", "k.output"), &mut grads.k)?;
    let rope = Request {
        config: op.rope.config,
        dtype: T::DTYPE,
        q,
        k: Some(k),
        packed: false,
        positions: op.rope.positions.bind(binder)?,
        sincos: op.rope.sincos.bind(binder)?,
    };
    let norm = RawNorm {
        q_weight: binder.read("norm.q_weight", &norm.q_weight)?,
        k_weight: binder.read("norm.k_weight", &norm.k_weight)?,
        eps: norm.eps,
        code: norm.weight.code(),
        scope: norm.scope,
    };
    Ok(GradRequest {
        fused: fused_request(rope, norm),
        norm,
        q_input: (
            binder.read("q_input", &grads.q_input.data)?,
            grads.q_input.layout,
        ),
        k_input: (
            binder.read("k_input", &grads.k_input.data)?,
            grads.k_input.layout,
        ),
        q_weight: binder.write("q_weight", &mut grads.q_weight)?,
        k_weight: binder.write("k_weight", &mut grads.k_weight)?,
        workspace: binder.write("workspace", &mut grads.workspace)?,
    })
}

/// The weights kernel's grid: a block per 32 features of q's and of k's weights.
fn weights_config(head_dim: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (head_dim.div_ceil(NORM_GRAD_WEIGHTS_FEATURES), 2, 1),
        block_dim: (NORM_GRAD_WEIGHTS_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The two kernels' arguments from a validated request, its plan and its RoPE arguments.
fn encode(
    req: &GradRequest,
    plan: &GradPlan,
    rope: RopeArgs,
) -> (NormGradArgs, NormGradWeightsArgs) {
    let es = req.fused.rope.dtype.size() as u64;
    let input =
        |(buf, l): (RawBuf, Layout)| (buf.ptr + l.offset as u64 * es, l.strides.map(|s| s as u64));
    let (q_in, q_strides) = input(req.q_input);
    let (k_in, k_strides) = input(req.k_input);
    let norm = req.norm;
    macro_rules! with_rope {
        ({ $r:ident } $($param:ident: $kind:ident,)*) => {
            NormGradArgs {
                $($param: $r.$param,)*
                q_in,
                q_in_stride_batch: q_strides[0],
                q_in_stride_seq: q_strides[1],
                q_in_stride_head: q_strides[2],
                k_in,
                k_in_stride_batch: k_strides[0],
                k_in_stride_seq: k_strides[1],
                k_in_stride_head: k_strides[2],
                norm: norm.code as u32,
                q_norm_weight: norm.q_weight.ptr,
                k_norm_weight: norm.k_weight.ptr,
                norm_eps: norm.eps,
                q_warps: plan.q_warps,
                partials: req.workspace.ptr,
                // The transposed rotation of the forward step's.
                sin_sign: -req.fused.rope.config.direction().sin_sign(),
            }
        };
    }
    let args = rope_kernels::rope_kernel_params!(with_rope { rope });
    let weights = NormGradWeightsArgs {
        partials: req.workspace.ptr,
        q_rows: plan.blocks,
        k_rows: plan.blocks,
        head_dim: req.fused.rope.config.head_dim(),
        q_grad: req.q_weight.ptr,
        k_grad: req.k_weight.ptr,
    };
    (args, weights)
}
