//! The first call of a fresh process: from opening device 0 to the first launch of one kernel
//! family finished, on a decode step's shape (64 tokens, 32 q and 8 kv heads of 128, bf16,
//! NeoX). The kernels load on demand, so the time counts loading only what this family's first
//! launch takes: the embedded cubin of the device's architecture where there is one, else the
//! driver's compilation of the PTX entries (from its compute cache when that is warm).
//!
//! Only meaningful as the first thing a process does on the GPU: run it in a fresh process
//! (`rope-bench --first-call FAMILY`), once with `CUDA_CACHE_DISABLE=1` and once with a warm
//! cache.

use std::time::Instant;

use rope_host::half::bf16;
use rope_host::{
    CacheAddress, CacheData, CacheLayout, DeviceInts, FusedIo, FusedOp, KOut, KvCache, Layout,
    NormWeight, Positions, QOut, QkIo, QkNorm, Rope, RopeConfig, RopeOp, RopeStyle, SinCos,
    TableFormat, Tensor, TensorMut, open_device,
};
use serde::Serialize;

/// The kernel family a first call launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Family {
    /// q and k rotated in place, sin/cos computed in the kernel (`Rope::run_qk`).
    Rope,
    /// The same with a bf16 sin/cos table built first (`Rope::build_tables`: its kernel too).
    RopeTable,
    /// Norm, rotation and a paged bf16 KV-cache write in one launch (`Rope::run_fused`).
    Fused,
}

impl Family {
    /// The family named `name` (`rope`, `rope-table`, `fused`).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "rope" => Some(Self::Rope),
            "rope-table" => Some(Self::RopeTable),
            "fused" => Some(Self::Fused),
            _ => None,
        }
    }
}

/// Seconds spent in each step of a first call.
#[derive(Clone, Debug, Serialize)]
pub struct FirstCall {
    /// What was launched.
    pub family: Family,
    /// `open_device(0)` and a new stream (the driver's and the context's start).
    pub open_s: f64,
    /// `Rope::new`.
    pub new_s: f64,
    /// The buffers' allocation and upload, the first launch and its completion (loading and
    /// compiling the kernels it takes).
    pub launch_s: f64,
    /// All of it: `open_s + new_s + launch_s`.
    pub total_s: f64,
    /// Whether `CUDA_CACHE_DISABLE=1` was set (the driver compiled without its cache).
    pub cache_disabled: bool,
    /// The architectures of the cubins this build embeds (`rope_host::compiled_architectures`).
    pub compiled: Vec<u32>,
    /// Whether `ROPE_KERNEL_CODE=ptx` made the kernels come from the PTX even so.
    pub forced_ptx: bool,
}

impl FirstCall {
    /// The call as one line of JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}

const TOKENS: usize = 64;
const HQ: usize = 32;
const HK: usize = 8;
const D: usize = 128;

/// Runs `family`'s first call in this process and times its steps.
///
/// # Errors
/// Any error of the device, the handle or the launch.
pub fn first_call(family: Family) -> rope_host::Result<FirstCall> {
    let t0 = Instant::now();
    let ctx = open_device(0)?;
    let stream = ctx.new_stream()?;
    let t1 = Instant::now();
    let rope = Rope::new(stream.clone())?;
    let t2 = Instant::now();
    launch(&rope, family)?;
    stream.synchronize()?;
    let t3 = Instant::now();
    let s = |a: Instant, b: Instant| (b - a).as_secs_f64();
    Ok(FirstCall {
        family,
        open_s: s(t0, t1),
        new_s: s(t1, t2),
        launch_s: s(t2, t3),
        total_s: s(t0, t3),
        cache_disabled: std::env::var("CUDA_CACHE_DISABLE").is_ok_and(|v| v == "1"),
        compiled: rope_host::compiled_architectures(),
        forced_ptx: std::env::var(rope_host::KERNEL_CODE_VAR).is_ok_and(|v| v == "ptx"),
    })
}

/// Allocates the decode step's buffers and launches `family` once on `rope`'s stream.
fn launch(rope: &Rope, family: Family) -> rope_host::Result<()> {
    let stream = rope.stream();
    let ones = |n: usize| stream.clone_htod(&vec![bf16::from_f32(0.5); n]);
    let (lq, lk) = (Layout::thd(TOKENS, HQ, D), Layout::thd(TOKENS, HK, D));
    let mut q = ones(TOKENS * HQ * D)?;
    let mut k = ones(TOKENS * HK * D)?;
    let config = RopeConfig::builder(D as u32, RopeStyle::Neox).build()?;
    let positions = Positions::Offset(100);
    match family {
        Family::Rope | Family::RopeTable => {
            let tables = match family {
                Family::RopeTable => Some(rope.build_tables::<bf16>(
                    10_000.0,
                    D as u32,
                    4096,
                    TableFormat::Separate,
                )?),
                _ => None,
            };
            let sincos = match &tables {
                Some(t) => t.sincos(),
                None => SinCos::Computed { theta: 10_000.0 },
            };
            let op = RopeOp {
                config,
                positions,
                sincos,
            };
            let io = QkIo::Separate {
                q: rope_host::Io::InPlace(TensorMut {
                    data: q.as_view_mut(),
                    layout: lq,
                }),
                k: rope_host::Io::InPlace(TensorMut {
                    data: k.as_view_mut(),
                    layout: lk,
                }),
            };
            rope.run_qk(&op, io)
        }
        Family::Fused => {
            let v = ones(TOKENS * HK * D)?;
            let weight = ones(D)?;
            let blocks = TOKENS.div_ceil(16);
            let mut k_cache = stream.alloc_zeros::<bf16>(blocks * 16 * HK * D)?;
            let mut v_cache = stream.alloc_zeros::<bf16>(blocks * 16 * HK * D)?;
            let slots: Vec<i64> = (0..TOKENS as i64).collect();
            let slots = stream.clone_htod(&slots)?;
            let op = FusedOp {
                rope: RopeOp {
                    config,
                    positions,
                    sincos: SinCos::Computed { theta: 10_000.0 },
                },
                norm: Some(QkNorm {
                    q_weight: weight.as_view(),
                    k_weight: weight.as_view(),
                    eps: 1e-6,
                    weight: NormWeight::Plain,
                    scope: rope_host::NormScope::PerHead,
                }),
            };
            let io = FusedIo::Separate {
                q: QOut::InPlace(TensorMut {
                    data: q.as_view_mut(),
                    layout: lq,
                }),
                k: KOut::CacheOnly(Tensor {
                    data: k.as_view(),
                    layout: lk,
                }),
                v: Some(Tensor {
                    data: v.as_view(),
                    layout: lk,
                }),
            };
            let cache = KvCache {
                non_rotary: None,
                address: CacheAddress::Slots(DeviceInts::I64(slots.as_view())),
                layout: CacheLayout::blocks_rows_heads(blocks, 16, HK, D),
                data: CacheData::Elem {
                    k: k_cache.as_view_mut(),
                    v: v_cache.as_view_mut(),
                },
            };
            rope.run_fused(&op, io, Some(cache))
        }
    }
}
