//! What a process keeps for front ends that own no [`Rope`] (the Python bindings, candle's
//! ops): one handle per device or stream, and frequency vectors and axis maps pinned on the
//! device.
//!
//! Front ends launch with [`Rope::run_raw`] on their caller's stream, so every vector such a
//! launch reads is pinned: uploaded once, complete before any launch reads it, and never freed
//! (a launch on another stream, or a CUDA graph captured with it and replayed at any later
//! time, may read it). The upload happens at first use, which a capture forbids: a
//! synchronous copy from host memory cannot be recorded, and PyTorch's captures refuse it
//! process-wide. So a first use on a capturing stream is an [`crate::Error::Invalid`] naming the
//! argument, raised before anything is recorded; the same call made once before capturing
//! (a warm-up run) makes the capture work.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys::CUstream;
use cudarc::driver::{CudaContext, CudaStream};

use crate::device::{StreamOverlap, capturing};
use crate::error::{Result, invalid};
use crate::freq::{AngleMode, Frequencies, InvFreq, check_default_frequencies};
use crate::handle::Rope;
use crate::module::open_device;
use crate::positions::{AxisMap, DeviceAxisMap};

/// A context and a stream of it, by their driver handles (each entry holds an `Arc` of its
/// stream, and so of its context, so neither handle is reused while the entry lives).
type StreamKey = (usize, usize);

/// A pinned vector's identity: its context, the `inv_freq` bits, the attention factor bits
/// and the angle mode.
type FreqKey = (usize, Vec<u64>, u64, u32);

/// The handles of [`primary`], by device ordinal and overlap.
static PRIMARY: Mutex<BTreeMap<(usize, StreamOverlap), Arc<Rope>>> = Mutex::new(BTreeMap::new());

/// The handles of [`on_stream`].
static ON_STREAM: Mutex<Vec<(StreamKey, Arc<Rope>)>> = Mutex::new(Vec::new());

/// The vectors of [`frequencies`].
static PINNED: Mutex<BTreeMap<FreqKey, Arc<Frequencies>>> = Mutex::new(BTreeMap::new());

/// A pinned axis map's identity: its context, its number of axes and each pair's axis.
type MapKey = (usize, u32, Vec<u8>);

/// The maps of [`axis_map`].
static MAPS: Mutex<BTreeMap<MapKey, Arc<DeviceAxisMap>>> = Mutex::new(BTreeMap::new());

/// `m` locked, whatever a panicking holder left (every map stays consistent between
/// statements).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The process's handle for device `ordinal`'s primary context (the one the CUDA runtime, and
/// so PyTorch, allocates in) with launches overlapping as `overlap` says; made on first use
/// and kept. Its own stream is the context's default stream, used only for uploads: launches
/// go to the caller's stream through [`Rope::run_raw`].
///
/// # Errors
/// [`crate::Error::NoDriver`] without a driver; [`crate::Error::Driver`] when the device does not open or
/// cannot be queried.
pub fn primary(ordinal: usize, overlap: StreamOverlap) -> Result<Arc<Rope>> {
    let mut ropes = lock(&PRIMARY);
    if let Some(rope) = ropes.get(&(ordinal, overlap)) {
        return Ok(rope.clone());
    }
    let ctx = open_device(ordinal)?;
    // SAFETY: cudarc's event tracking orders cudarc's own slices between streams. The only
    // slices of this context object are rope-host's frequency vectors: pinned ones (this
    // module's and `Rope::prepare`'s) are complete before any launch reads them, never
    // written again and never freed; a handle's unpinned vectors are read only by launches on
    // its own stream and freed in that stream's order. No event is needed, and events recorded
    // while the caller captures a CUDA graph would break the capture.
    unsafe { ctx.disable_event_tracking() };
    let rope = Arc::new(Rope::new(ctx.default_stream())?.with_overlap(overlap));
    ropes.insert((ordinal, overlap), rope.clone());
    Ok(rope)
}

/// The process's handle for launches on `stream` (a framework's own stream, such as a candle
/// device's), without overlap; made on first use and kept.
///
/// # Errors
/// [`crate::Error::Driver`] when the device cannot be queried.
pub fn on_stream(stream: &Arc<CudaStream>) -> Result<Arc<Rope>> {
    let key = (
        stream.context().cu_ctx() as usize,
        stream.cu_stream() as usize,
    );
    let mut ropes = lock(&ON_STREAM);
    if let Some((_, rope)) = ropes.iter().find(|(k, _)| *k == key) {
        return Ok(rope.clone());
    }
    let rope = Arc::new(Rope::new(stream.clone())?);
    ropes.push((key, rope.clone()));
    Ok(rope)
}

/// Pins the default frequencies of `theta` for `rotary_dim` features on `rope`
/// ([`Rope::prepare`]) for a launch on `stream`, checking them before their upload (pinned
/// ones were checked then).
///
/// # Safety
/// `stream` is a live stream of `rope`'s context (it is queried for a capture).
///
/// # Errors
/// [`crate::Error::Invalid`] naming `theta` or `rotary_dim` as [`Rope::prepare`], and naming `arg`
/// when they are not pinned yet and `stream` is capturing a graph; [`crate::Error::Driver`] when the
/// upload fails.
pub unsafe fn prepare(
    rope: &Rope,
    (theta, rotary_dim): (f64, u32),
    stream: CUstream,
    arg: &'static str,
) -> Result<()> {
    rope.pin_default(theta, rotary_dim, || {
        check_default_frequencies(theta, rotary_dim)?;
        // SAFETY: the caller's promise.
        unsafe { check_not_capturing(rope.stream().context(), stream, arg) }
    })
}

/// The pinned device copy of `inv_freq` with its attention factor and angle mode on `rope`'s
/// context, uploaded at first use ([`Rope::frequencies_from`], which checks them) for a
/// launch on `stream`.
///
/// # Safety
/// `stream` is a live stream of `rope`'s context (it is queried for a capture).
///
/// # Errors
/// [`crate::Error::Invalid`] naming `arg` when the vector is not pinned yet and `stream` is capturing
/// a graph, and as [`Rope::frequencies_from`]; [`crate::Error::Driver`] when the upload fails.
pub unsafe fn frequencies(
    rope: &Rope,
    (inv_freq, attention_factor, angle): (&[f64], f64, AngleMode),
    stream: CUstream,
    arg: &'static str,
) -> Result<Arc<Frequencies>> {
    let ctx = rope.stream().context();
    let key: FreqKey = (
        ctx.cu_ctx() as usize,
        inv_freq.iter().map(|f| f.to_bits()).collect(),
        attention_factor.to_bits(),
        angle as u32,
    );
    let mut pinned = lock(&PINNED);
    if let Some(f) = pinned.get(&key) {
        return Ok(f.clone());
    }
    // SAFETY: the caller's promise.
    unsafe { check_not_capturing(ctx, stream, arg) }?;
    let f = Arc::new(rope.frequencies_from(InvFreq::F64(inv_freq), attention_factor, angle)?);
    pinned.insert(key, f.clone());
    Ok(f)
}

/// The pinned device copy of `map` on `rope`'s context, uploaded at first use
/// ([`Rope::axis_map`]) for a launch on `stream` (the axes of
/// [`crate::RawPositions::MultiAxis`]).
///
/// # Safety
/// `stream` is a live stream of `rope`'s context (it is queried for a capture).
///
/// # Errors
/// [`crate::Error::Invalid`] naming `arg` when the map is not pinned yet and `stream` is
/// capturing a graph; [`crate::Error::Driver`] when the upload fails.
pub unsafe fn axis_map(
    rope: &Rope,
    map: &AxisMap,
    stream: CUstream,
    arg: &'static str,
) -> Result<Arc<DeviceAxisMap>> {
    let ctx = rope.stream().context();
    let key: MapKey = (ctx.cu_ctx() as usize, map.n_axes(), map.axes().to_vec());
    let mut maps = lock(&MAPS);
    if let Some(m) = maps.get(&key) {
        return Ok(m.clone());
    }
    // SAFETY: the caller's promise.
    unsafe { check_not_capturing(ctx, stream, arg) }?;
    let m = Arc::new(rope.axis_map(map)?);
    maps.insert(key, m.clone());
    Ok(m)
}

/// `Ok` when `stream` of `ctx` may see an upload now; else [`crate::Error::Invalid`] naming `arg`.
///
/// # Safety
/// `stream` is a live stream of `ctx`.
unsafe fn check_not_capturing(
    ctx: &CudaContext,
    stream: CUstream,
    arg: &'static str,
) -> Result<()> {
    // SAFETY: the caller's promise.
    if unsafe { capturing(ctx, stream) } {
        return Err(invalid(
            arg,
            "these frequencies (or this axis map) are uploaded to the GPU on first use, which \
             cannot happen while the stream is capturing a CUDA graph; make the same call once \
             before capturing (a warm-up run)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    /// Invalid default frequencies are refused before any device is touched.
    #[test]
    fn invalid_theta_is_refused_before_the_device() {
        let e = check_default_frequencies(-1.0, 64).expect_err("negative theta");
        assert!(matches!(e, Error::Invalid { arg: "theta", .. }), "{e}");
        let e = check_default_frequencies(1e4, 3).expect_err("odd rotary_dim");
        assert!(
            matches!(
                e,
                Error::Invalid {
                    arg: "rotary_dim",
                    ..
                }
            ),
            "{e}"
        );
        check_default_frequencies(1e4, 128).expect("Llama's defaults");
    }
}
