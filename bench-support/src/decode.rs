//! A serving loop's decode step, eager and inside a CUDA graph: batch 64, one token each, 32 q
//! and 8 k heads of 128 bf16 in place, positions on the device (explicit ids or per-row
//! offsets, `i64` as vLLM passes them), sin/cos computed in the kernel or read from a bf16
//! `cos_sin_cache`, each timed per launch next to a device copy of the same bytes, and each
//! again with programmatic dependent launch (`StreamOverlap::Programmatic`, rows marked `PDL`),
//! and with it reading ahead (`Rope::with_read_ahead`, rows marked `PDL, read-ahead`).

use std::sync::Arc;

use rope_host::cudarc::driver::sys::{
    CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use rope_host::cudarc::driver::{CudaContext, CudaStream};
use rope_host::half::bf16;
use rope_host::{
    DeviceInts, IdsShape, Io, Layout, Positions, QkIo, Rope, RopeConfig, RopeOp, RopeStyle, SinCos,
    StreamOverlap, TableFormat, TensorMut,
};

use crate::timing::quartiles;

/// Launches per timed region, and per graph.
pub(crate) const LAUNCHES: usize = 100;
/// Timed regions per variant (after one untimed); the median is reported.
const REGIONS: usize = 21;
const THETA: f64 = 500_000.0;
/// Decode shape: batch rows (one token each), q heads, k heads, head size.
const BATCH: usize = 64;
const HQ: usize = 32;
const HK: usize = 8;
const D: usize = 128;

/// One decode variant's time per launch.
#[derive(Clone, Debug, serde::Serialize)]
pub struct DecodeRow {
    /// What was launched: `copy`, or `{ids|row offsets}, {computed|cos_sin_cache}`, with `,
    /// PDL` for programmatic dependent launch.
    pub variant: String,
    /// Median per launch of 100 launches enqueued back to back, in µs.
    pub eager_us: f64,
    /// Median per launch of a graph of 100 launches, in µs.
    pub graph_us: f64,
}

/// Measures the copy and every (positions, sin/cos) variant on device `ordinal`, NeoX pairs,
/// in a context object of its own with cudarc's event tracking off (graph capture needs it
/// off; see the README's section on CUDA graphs).
///
/// # Errors
/// Any driver or launch error.
pub fn decode_in_graphs(ordinal: usize) -> anyhow::Result<Vec<DecodeRow>> {
    let ctx = CudaContext::new(ordinal)?;
    // SAFETY: this context object is used by this function alone, on one stream.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream()?;
    let handles = Handles::new(&stream, THETA, D as u32)?;
    let qn = BATCH * HQ * D;
    let kn = BATCH * HK * D;
    let fill = |n: usize, k: f32| -> Vec<bf16> {
        (0..n)
            .map(|i| bf16::from_f32((i as f32 * k).sin()))
            .collect()
    };
    let mut q = stream.clone_htod(&fill(qn, 0.37))?;
    let mut k = stream.clone_htod(&fill(kn, 0.53))?;
    let mut copy_dst = stream.alloc_zeros::<bf16>(qn + kn)?;
    let copy_src = stream.clone_htod(&fill(qn + kn, 0.11))?;
    let positions: Vec<i64> = (1000..1000 + BATCH as i64).collect();
    let ids = stream.clone_htod(&positions)?;
    let offsets = stream.clone_htod(&positions)?;
    let cache = handles.get(StreamOverlap::None).build_tables::<bf16>(
        THETA,
        D as u32,
        2048,
        TableFormat::Combined,
    )?;
    stream.synchronize()?;

    let config = RopeConfig::builder(D as u32, RopeStyle::Neox).build()?;
    // A RoPE variant: positions by row offsets (else ids), sin/cos from the cache (else
    // computed), and the launches' overlap (the last: programmatic, reading ahead).
    type Launch = (bool, bool, (StreamOverlap, bool));
    // `None` is the copy.
    let variants: Vec<(String, Option<Launch>)> =
        std::iter::once(("copy of the same bytes".into(), None))
            .chain(
                [
                    ("", (StreamOverlap::None, false)),
                    (", PDL", (StreamOverlap::Programmatic, false)),
                    (", PDL, read-ahead", (StreamOverlap::Programmatic, true)),
                ]
                .into_iter()
                .flat_map(|(o, overlap)| {
                    [("ids", false), ("row offsets", true)]
                        .into_iter()
                        .flat_map(move |(p, by_row)| {
                            [("computed", false), ("cos_sin_cache", true)].map(move |(t, table)| {
                                (format!("{p}, {t}{o}"), Some((by_row, table, overlap)))
                            })
                        })
                }),
            )
            .collect();
    let mut run = |variant: Option<Launch>| -> anyhow::Result<()> {
        let Some((by_row, table, (overlap, read_ahead))) = variant else {
            return Ok(stream.memcpy_dtod(&copy_src, &mut copy_dst)?);
        };
        let rope = if read_ahead {
            &handles.read_ahead
        } else {
            handles.get(overlap)
        };
        let positions = if by_row {
            Positions::RowOffsets(DeviceInts::I64(offsets.as_view()))
        } else {
            Positions::Ids {
                ids: DeviceInts::I64(ids.as_view()),
                shape: IdsShape::PerRow,
            }
        };
        let sincos = if table {
            cache.sincos()
        } else {
            SinCos::Computed { theta: THETA }
        };
        let op = RopeOp {
            config,
            positions,
            sincos,
        };
        let io = |data, heads| {
            Io::InPlace(TensorMut {
                data,
                layout: Layout::bshd(BATCH, 1, heads, D),
            })
        };
        let qk = QkIo::Separate {
            q: io(q.as_view_mut(), HQ),
            k: io(k.as_view_mut(), HK),
        };
        Ok(rope.run_qk(&op, qk)?)
    };
    let mut graphs = Vec::new();
    for (_, v) in &variants {
        run(*v)?; // warm-up
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let captured = (0..LAUNCHES).try_for_each(|_| run(*v));
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        captured?;
        graphs.push(graph?.ok_or_else(|| anyhow::anyhow!("the capture recorded nothing"))?);
    }
    // Every region times each variant eager and in its graph, the variants in a rotating order,
    // so that clock drift over the run falls on all of them alike.
    let mut times = vec![(Vec::new(), Vec::new()); variants.len()];
    for i in 0..=REGIONS {
        for j in (0..variants.len()).map(|j| (i + j) % variants.len()) {
            let v = variants[j].1;
            let eager = per_launch(&ctx, &stream, &mut || {
                (0..LAUNCHES).try_for_each(|_| run(v))
            })?;
            let graph = per_launch(&ctx, &stream, &mut || Ok(graphs[j].launch()?))?;
            if i > 0 {
                times[j].0.push(eager);
                times[j].1.push(graph);
            }
        }
    }
    Ok(variants
        .into_iter()
        .zip(times)
        .map(|((variant, _), (eager, graph))| DecodeRow {
            variant,
            eager_us: quartiles(eager)[1],
            graph_us: quartiles(graph)[1],
        })
        .collect())
}

/// One handle per [`StreamOverlap`] on one stream, and a programmatic one that reads ahead
/// ([`Rope::with_read_ahead`]), each with the default frequencies of `(theta, rotary_dim)`
/// prepared (graph capture needs them).
pub(crate) struct Handles {
    serial: Rope,
    programmatic: Rope,
    /// Programmatic, reading ahead.
    pub(crate) read_ahead: Rope,
}

impl Handles {
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        theta: f64,
        rotary_dim: u32,
    ) -> anyhow::Result<Self> {
        let handle = |overlap| -> anyhow::Result<Rope> {
            let rope = Rope::new(stream.clone())?
                .with_overlap(overlap)
                .with_fused_kernels(crate::device::kernels_from_env());
            rope.prepare(theta, rotary_dim)?;
            Ok(rope)
        };
        // SAFETY: the benchmark writes its positions and tables once, before any timed launch
        // (and synchronizes); no kernel before a launch writes them.
        let read_ahead = unsafe { handle(StreamOverlap::Programmatic)?.with_read_ahead() };
        Ok(Self {
            serial: handle(StreamOverlap::None)?,
            programmatic: handle(StreamOverlap::Programmatic)?,
            read_ahead,
        })
    }

    /// Prepares `theta`'s frequencies for `rotary_dim` rotated features on every handle too.
    pub(crate) fn prepare(&self, theta: f64, rotary_dim: u32) -> anyhow::Result<()> {
        for rope in [&self.serial, &self.programmatic, &self.read_ahead] {
            rope.prepare(theta, rotary_dim)?;
        }
        Ok(())
    }

    /// The handle whose launches overlap as `overlap` says.
    pub(crate) fn get(&self, overlap: StreamOverlap) -> &Rope {
        match overlap {
            StreamOverlap::None => &self.serial,
            StreamOverlap::Programmatic => &self.programmatic,
        }
    }
}

/// Microseconds per launch of `run`, which enqueues [`LAUNCHES`] launches, between two events.
pub(crate) fn per_launch(
    ctx: &Arc<CudaContext>,
    stream: &Arc<CudaStream>,
    run: &mut dyn FnMut() -> anyhow::Result<()>,
) -> anyhow::Result<f64> {
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let (start, end) = (ctx.new_event(flags)?, ctx.new_event(flags)?);
    start.record(stream)?;
    run()?;
    end.record(stream)?;
    end.synchronize()?;
    Ok(f64::from(start.elapsed_ms(&end)?) * 1e3 / LAUNCHES as f64)
}
