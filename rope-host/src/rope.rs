//! RoPE launches: [`Rope::run`] and [`Rope::run_qk`]. Mirrors `rope-kernels/src/rope.rs`.
//!
//! # Formula
//! For head `h` of token `(b, s)` at position `p`, pair `i < r/2` (`r = rotary_dim`, by default
//! `head_dim`) rotates by `angle = p * inv_freq_i`, `inv_freq_i = theta^(-2i/r)`:
//! forward `(a, b) -> (a cos - b sin, b cos + a sin)`, backward `(a, b) -> (a cos + b sin,
//! b cos - a sin)` (the gradient: the transposed rotation). Pairs are `(x[2i], x[2i+1])` for
//! [`RopeStyle::Interleaved`](crate::RopeStyle::Interleaved) and `(x[i], x[i + r/2])` for
//! [`RopeStyle::Neox`](crate::RopeStyle::Neox); elements `r..head_dim` pass through unchanged.
//!
//! # A launch
//! Every launch reads as four steps: **bind** (views reduced to their raw forms, addresses and
//! lengths, each checked to belong to the `Rope`'s context: `bind.rs`; [`Rope::run_raw`] starts
//! from raw forms), **plan** (pure validation and the grid: `plan/`), **encode** (the kernel's
//! arguments, `RopeArgs`, from the plan and the options' encodings) and **launch**.

use cudarc::driver::sys::CUstream;
use rope_kernels::abi::{DType, Mapping, TableElem, common_one_head_launch};

use crate::bind::{Binder, RawBuf};
use crate::config::{RopeConfig, RopeElem};
use crate::error::Result;
use crate::handle::{FreqUse, Rope};
use crate::kernel_args::RopeArgs;
use crate::layout::Layout;
use crate::op::{Io, QkIo, RopeOp};
use crate::plan::{Grid, Plan, Request, TensorReq, plan};
use crate::positions::{PositionArgs, PositionsPlan, RawPositions};
use crate::sincos::{RawSinCos, SinCosArgs, SinCosPlan};

/// A tensor given by address, for [`Rope::run_raw`]: `buf.len` elements at `buf.ptr` of the
/// operation's element type, the tensor at `layout` inside them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawTensor {
    /// The buffer.
    pub buf: RawBuf,
    /// The layout inside it.
    pub layout: Layout,
}

/// One rotated tensor given by address: in place, or from an input into an output of the same
/// dimensions (as [`Io`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawIo {
    /// `x <- rope(x)`.
    InPlace(RawTensor),
    /// `output <- rope(input)`; the two must not overlap.
    OutOfPlace {
        /// Read only.
        input: RawTensor,
        /// Written only.
        output: RawTensor,
    },
}

/// The tensors of a [`Rope::run_raw`] launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawTensors {
    /// q alone.
    Q(RawIo),
    /// q and k in their own buffers (as [`QkIo::Separate`]).
    Separate {
        /// The query tensor.
        q: RawIo,
        /// The key tensor.
        k: RawIo,
    },
    /// q and k as two layouts in one buffer, rotated in place (as [`QkIo::Packed`]).
    Packed {
        /// The buffer holding both.
        buf: RawBuf,
        /// The query layout in it.
        q: Layout,
        /// The key layout in it.
        k: Layout,
    },
}

/// A complete operation given by addresses, for [`Rope::run_raw`]: what [`RopeOp`] is for the
/// safe API, with the element type of the tensors stated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RawOp {
    /// Head size, rotated features, pairing and direction.
    pub config: RopeConfig,
    /// The tensors' element type.
    pub dtype: DType,
    /// Where positions come from.
    pub positions: RawPositions,
    /// Where sin/cos come from.
    pub sincos: RawSinCos,
}

impl From<RawIo> for TensorReq {
    fn from(io: RawIo) -> Self {
        match io {
            RawIo::InPlace(t) => TensorReq {
                x: t.buf,
                x_layout: t.layout,
                out: None,
            },
            RawIo::OutOfPlace { input, output } => TensorReq {
                x: input.buf,
                x_layout: input.layout,
                out: Some((output.buf, output.layout)),
            },
        }
    }
}

impl Rope {
    /// Validates `op` with one tensor and launches the rotation; asynchronous on the stream.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] for an invalid description (nothing is launched and no output
    /// is touched); [`crate::Error::Driver`] when the launch fails.
    pub fn run<T: RopeElem>(&self, op: &RopeOp<'_, T>, mut q: Io<'_, T>) -> Result<()> {
        let mut binder = Binder::new(&self.stream);
        let q = bind_io(&mut binder, ("q", "q.output"), &mut q)?;
        self.launch_bound(op, binder, q, None, false)
    }

    /// Validates `op` with q and k and rotates both in one launch, computing or loading each
    /// token's sin/cos once for the heads of both; asynchronous on the stream.
    ///
    /// # Errors
    /// As [`Rope::run`]; also [`crate::Error::Invalid`] naming `k` when k's batch or seq
    /// differ from q's, or packed layouts share elements.
    pub fn run_qk<T: RopeElem>(&self, op: &RopeOp<'_, T>, mut qk: QkIo<'_, T>) -> Result<()> {
        let mut binder = Binder::new(&self.stream);
        let (q, k, packed) = match &mut qk {
            QkIo::Separate { q, k } => {
                let q = bind_io(&mut binder, ("q", "q.output"), q)?;
                (q, bind_io(&mut binder, ("k", "k.output"), k)?, false)
            }
            QkIo::Packed { data, q, k } => {
                let x = binder.write("q", data)?;
                let tensor = |x_layout| TensorReq {
                    x,
                    x_layout,
                    out: None,
                };
                (tensor(*q), tensor(*k), true)
            }
        };
        self.launch_bound(op, binder, q, Some(k), packed)
    }

    /// Validates `op` and launches it on `stream`, with every buffer given by address: the entry
    /// for memory and streams that other frameworks own (PyTorch's tensors and current stream,
    /// candle with its own cudarc, a C++ engine). Everything [`Rope::run_qk`] validates is
    /// validated here too, on the addresses and lengths given; asynchronous on `stream`.
    ///
    /// # Safety
    /// The caller promises what the safe API's types prove:
    /// - `stream` is a live stream of this `Rope`'s CUDA context (`rope.stream().context()`),
    ///   and every address is device memory of that context (or, for an empty tensor, any
    ///   value);
    /// - every [`RawBuf`] holds `len` elements of its type (the tensors' `op.dtype`, a table's
    ///   `dtype`, position arrays' `IntType`, `f64` frequencies) from `ptr`, allocated and not
    ///   freed until the kernel has finished on `stream`;
    /// - nothing else writes the buffers while the kernel runs, and nothing reads the written
    ///   tensors until it has finished (order other streams after `stream`);
    /// - buffers the launch only reads ([`RawSinCos::Frequencies`] from
    ///   [`crate::Frequencies::raw`] included) are complete before the kernel starts on `stream`.
    ///
    /// With [`RawSinCos::Computed`], call [`Rope::prepare`] first (its upload is then already
    /// complete, and nothing is uploaded during the call).
    ///
    /// # Errors
    /// As [`Rope::run_qk`], except that nothing checks contexts; [`crate::Error::Driver`] when
    /// the launch fails.
    pub unsafe fn run_raw(&self, op: &RawOp, tensors: RawTensors, stream: CUstream) -> Result<()> {
        let (q, k, packed) = match tensors {
            RawTensors::Q(q) => (q.into(), None, false),
            RawTensors::Separate { q, k } => (q.into(), Some(k.into()), false),
            RawTensors::Packed { buf, q, k } => {
                let tensor = |x_layout| TensorReq {
                    x: buf,
                    x_layout,
                    out: None,
                };
                (tensor(q), Some(tensor(k)), true)
            }
        };
        let req = Request {
            config: op.config,
            dtype: op.dtype,
            q,
            k,
            packed,
            positions: op.positions,
            sincos: op.sincos,
        };
        // SAFETY: the caller's promises are `launch`'s.
        unsafe { self.launch(&req, stream, FreqUse::OtherStream) }
    }

    /// Binds the options, then launches on the `Rope`'s stream. `binder` holds the tensors'
    /// pointer guards and takes the options'; it is dropped after the launch is enqueued.
    fn launch_bound<'s, T: RopeElem>(
        &self,
        op: &'s RopeOp<'_, T>,
        mut binder: Binder<'s>,
        q: TensorReq,
        k: Option<TensorReq>,
        packed: bool,
    ) -> Result<()> {
        let req = Request {
            config: op.config,
            dtype: T::DTYPE,
            q,
            k,
            packed,
            positions: op.positions.bind(&mut binder)?,
            sincos: op.sincos.bind(&mut binder)?,
        };
        // SAFETY: the stream is the `Rope`'s; the binder checked that every view belongs to its
        // context and holds each view's length; the views borrow their buffers until this
        // returns and the guards, dropped after the launch, order later uses of them after it;
        // cudarc's views are complete when handed out (their writes ordered by the guards).
        unsafe { self.launch(&req, self.stream.cu_stream(), FreqUse::OwnStream) }?;
        drop(binder);
        Ok(())
    }

    /// Plans, encodes and launches `req` on `stream` (the handle's own, or another: `on`).
    ///
    /// # Safety
    /// The promises of [`Rope::run_raw`] for `req`'s addresses and `stream`.
    unsafe fn launch(&self, req: &Request, stream: CUstream, on: FreqUse) -> Result<()> {
        if let Some((fused, plan)) = self.rotation_on_fused(req) {
            // SAFETY: the fused request holds `req`'s addresses and nothing else; the caller's
            // promises for them and `stream` are `launch_fused`'s.
            return unsafe { self.launch_fused_plan(&fused, &plan, stream, on) };
        }
        let Some(plan) = plan(req, &self.facts, &|kernel| self.blocks_per_sm(kernel))? else {
            return Ok(()); // Empty tensors: nothing to rotate.
        };
        let positions = req.positions.encode(&plan.positions);
        let inv_freq = self.launch_inv_freq(&req.sincos, &req.config, on)?;
        let sincos = req.sincos.encode(&plan.sincos, &req.config, inv_freq);
        let args = encode(req, &plan, &positions, &sincos);
        let args = RopeArgs {
            read_ahead: u32::from(self.reads_ahead(plan.kernel)),
            common_launch: u32::from(common_launch(&plan, &args)),
            ..args
        };
        let function = self.module.function(plan.kernel.symbol())?;
        // SAFETY: `RopeArgs` and the entry points' parameters come from the one list in
        // `rope_kernels::rope_kernel_params!`, so they agree in order and type. `plan` proved,
        // from the lengths the caller promises: each tensor's buffer holds its layout's end, so
        // every head of every token is in bounds; written layouts never map two elements to one
        // address, and written regions overlap no other tensor, table, position array or
        // frequency vector (fused q and k: disjoint element sets); pointers and strides are
        // aligned to `lanes` elements and `lanes` divides the pairs and pass-through elements
        // as `groups` counts them; seq, groups and heads are non-zero (empty launches returned
        // above), their magic numbers and shifts from `Divisor::new`; tables hold
        // `table_rows` rows of `table_stride >= half` elements of the source's type, and
        // every other position is bounds-checked by the kernel, or `inv_freq` holds `half` f64
        // (the handle frees its own vectors only in its stream's order, and never prepared ones,
        // the only ones other streams and captured graphs may read); position arrays have the lengths
        // their code names (multi-axis: `n_axes` in 1..=4 rows of `batch * seq` and a map of
        // `half` bytes, whose values the kernel clamps); the pointers start `rotary_offset`
        // elements into the first head, `RopeConfig` proved `rotary_offset + rotary_dim <=
        // head_dim` and `lanes` divides the offset; the grid keeps blockIdx.y *
        // heads_per_chunk below q.heads + k.heads.
        // The function was loaded in the context the stream belongs to.
        // With programmatic overlap the function comes from the sm_90 build (`overlap_for`).
        unsafe {
            args.launch(
                self.stream.context(),
                &function,
                plan.grid.config,
                stream,
                self.overlap_for(plan.kernel.symbol()),
            )
        }
    }
}

/// Binds one [`Io`]: its buffers checked to belong to the binder's context, reduced to
/// addresses (`names`: the argument names of its input and output).
pub(crate) fn bind_io<'s, T>(
    binder: &mut Binder<'s>,
    (x_name, out_name): (&'static str, &'static str),
    io: &'s mut Io<'_, T>,
) -> Result<TensorReq> {
    Ok(match io {
        Io::InPlace(t) => TensorReq {
            x: binder.write(x_name, &mut t.data)?,
            x_layout: t.layout,
            out: None,
        },
        Io::OutOfPlace { input, output } => TensorReq {
            x: binder.read(x_name, &input.data)?,
            x_layout: input.layout,
            out: Some((binder.write(out_name, &mut output.data)?, output.layout)),
        },
    })
}

/// One tensor's kernel arguments.
#[derive(Clone, Copy)]
struct TensorArgs {
    x: u64,
    out: u64,
    heads: u32,
    x_strides: [u64; 3],
    out_strides: [u64; 3],
}

impl TensorArgs {
    /// No tensor: what an absent k passes (no heads, so nothing of it is addressed).
    const ABSENT: Self = Self {
        x: 0,
        out: 0,
        heads: 0,
        x_strides: [0; 3],
        out_strides: [0; 3],
    };

    /// The arguments of a validated tensor with `es`-byte elements: pointers at the first
    /// rotated element (`rotary_offset`) of its first head, its output equal to its input in
    /// place.
    fn of(t: &TensorReq, es: u64, rotary_offset: u32) -> Self {
        let (out, out_layout) = t.out.unwrap_or((t.x, t.x_layout));
        // Wrapping: an empty k beside a non-empty q may carry any offset; the kernel addresses
        // none of its elements. The pointers start at the first rotated element of the first
        // head (the kernel addresses pass-through elements relative to it).
        let first = |addr: u64, offset: usize| {
            let first = (offset as u64).wrapping_add(u64::from(rotary_offset));
            addr.wrapping_add(first.wrapping_mul(es))
        };
        Self {
            x: first(t.x.ptr, t.x_layout.offset),
            out: first(out.ptr, out_layout.offset),
            heads: t.x_layout.heads as u32,
            x_strides: t.x_layout.strides.map(|s| s as u64),
            out_strides: out_layout.strides.map(|s| s as u64),
        }
    }
}

/// The kernel's arguments of a planned request with offset positions and computed sin/cos'
/// null frequency pointer, for the planner's tests.
#[cfg(test)]
pub(crate) fn encode_for_test(req: &Request, plan: &Plan) -> RopeArgs {
    let positions = PositionArgs {
        position_code: 0,
        pos_ptr: 0,
        pos_aux: 0,
        pos_count: 0,
        pos_base: 0,
    };
    let sincos = SinCosArgs {
        cos: 0,
        sin: 0,
        table_stride: 0,
        table_rows: 0,
        table_elem: 0,
        inv_freq: 0,
        angle_mode: 0,
        cs_scale: 1.0,
    };
    encode(req, plan, &positions, &sincos)
}

/// Whether the launch of `req` (planned as `plan`, frequencies at a stand-in address) is
/// marked as decode's common one-head launch, for the planner's tests.
#[cfg(test)]
pub(crate) fn common_launch_for_test(req: &Request, plan: &Plan) -> bool {
    let positions = req.positions.encode(&plan.positions);
    let sincos = req.sincos.encode(&plan.sincos, &req.config, 1 << 12);
    common_launch(plan, &encode(req, plan, &positions, &sincos))
}

/// The kernel's arguments from the validated request, its plan and the options' encodings.
fn encode(req: &Request, plan: &Plan, positions: &PositionArgs, sincos: &SinCosArgs) -> RopeArgs {
    let work = Work {
        grid: &plan.grid,
        tokens: plan.tokens,
        rot_groups: plan.rot_groups,
        lanes: plan.lanes,
    };
    encode_work(req, &work, positions, sincos)
}

/// Whether a planned launch with arguments `args` is decode's common one-head launch
/// ([`common_one_head_launch`], judged on the arguments the kernel reads), whose kernel then
/// runs the copy of its body compiled for it.
fn common_launch(plan: &Plan, args: &RopeArgs) -> bool {
    let kernel = plan.kernel;
    let elem_bytes = kernel.dtype.size() as u64;
    // `f32` tensors read `f32` tables whatever the code.
    let table_elem_bytes = if args.table_elem == TableElem::F32 as u32 {
        4
    } else {
        elem_bytes
    };
    let pairs = kernel.style.pairs_per_item(plan.lanes);
    kernel.mapping == Mapping::ONE_HEAD
        && common_one_head_launch(
            args.position_code,
            kernel.source,
            args.angle_mode,
            ((args.cos, args.sin), (args.table_rows, args.table_stride)),
            (u64::from(pairs), elem_bytes, table_elem_bytes),
        )
}

/// What a launch's arguments take from its plan: the grid, the tokens, the rotating groups
/// and the access width (the RoPE and the fused kernels' plans both have them).
pub(crate) struct Work<'g> {
    pub(crate) grid: &'g Grid,
    pub(crate) tokens: u64,
    pub(crate) rot_groups: u32,
    pub(crate) lanes: u32,
}

impl Rope {
    /// The RoPE arguments of a planned launch of `req` doing `work`: its positions and sin/cos
    /// encoded by their plans, computed frequencies uploaded for the stream `on` says
    /// ([`Rope::launch_inv_freq`]). The fused, backward and across-heads launches start here.
    pub(crate) fn rope_args(
        &self,
        req: &Request,
        work: &Work<'_>,
        (positions, sincos): (&PositionsPlan, &SinCosPlan),
        on: FreqUse,
    ) -> Result<RopeArgs> {
        let positions = req.positions.encode(positions);
        let inv_freq = self.launch_inv_freq(&req.sincos, &req.config, on)?;
        let sincos = req.sincos.encode(sincos, &req.config, inv_freq);
        Ok(encode_work(req, work, &positions, &sincos))
    }
}

/// The RoPE kernels' arguments from a validated request, its work and the options' encodings.
fn encode_work(
    req: &Request,
    work: &Work<'_>,
    positions: &PositionArgs,
    sincos: &SinCosArgs,
) -> RopeArgs {
    let es = req.dtype.size() as u64;
    let offset = req.config.rotary_offset();
    let q = TensorArgs::of(&req.q, es, offset);
    let k = req
        .k
        .map_or(TensorArgs::ABSENT, |k| TensorArgs::of(&k, es, offset));
    let grid = work.grid;
    RopeArgs {
        x0: q.x,
        out0: q.out,
        heads0: q.heads,
        x0_stride_batch: q.x_strides[0],
        x0_stride_seq: q.x_strides[1],
        x0_stride_head: q.x_strides[2],
        out0_stride_batch: q.out_strides[0],
        out0_stride_seq: q.out_strides[1],
        out0_stride_head: q.out_strides[2],
        x1: k.x,
        out1: k.out,
        heads1: k.heads,
        x1_stride_batch: k.x_strides[0],
        x1_stride_seq: k.x_strides[1],
        x1_stride_head: k.x_strides[2],
        out1_stride_batch: k.out_strides[0],
        out1_stride_seq: k.out_strides[1],
        out1_stride_head: k.out_strides[2],
        tokens: work.tokens,
        seq: grid.seq.divisor.get(),
        seq_magic: grid.seq.magic,
        seq_shift: grid.seq.shift,
        heads_per_chunk: grid.heads_per_chunk,
        groups: grid.groups.divisor.get(),
        groups_magic: grid.groups.magic,
        groups_shift: grid.groups.shift,
        rot_groups: work.rot_groups,
        half: req.config.half(),
        rotary_dim: req.config.rotary_dim(),
        rotary_offset: req.config.rotary_offset(),
        lanes: work.lanes,
        cos: sincos.cos,
        sin: sincos.sin,
        table_stride: sincos.table_stride,
        table_rows: sincos.table_rows,
        table_elem: sincos.table_elem,
        inv_freq: sincos.inv_freq,
        angle_mode: sincos.angle_mode,
        cs_scale: sincos.cs_scale,
        position_code: positions.position_code,
        pos_ptr: positions.pos_ptr,
        pos_aux: positions.pos_aux,
        pos_count: positions.pos_count,
        pos_base: positions.pos_base,
        sin_sign: req.config.direction().sin_sign(),
        read_ahead: 0,
        common_launch: 0,
    }
}
