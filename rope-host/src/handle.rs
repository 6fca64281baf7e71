//! The [`Rope`] handle: the stream launches go to, the context's loaded module, the device
//! facts the planner needs and the frequency vectors already on the device.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use rope_kernels::abi::{KernelName, Mapping};

use crate::config::RopeConfig;
use crate::device::{DeviceFacts, StreamOverlap};
use crate::error::{Result, invalid};
use crate::freq::{AngleMode, Frequencies, FrequencySpec, InvFreq, check_attention_factor};
use crate::module::{KernelCode, Module, module_for};
use crate::sincos::RawSinCos;
use crate::tuning::FusedKernels;

/// Per-thread resources of one kernel as compiled for the device; see [`Rope::resources`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelResources {
    /// The kernel's PTX symbol.
    pub name: &'static str,
    /// Registers per thread.
    pub registers: i32,
    /// Local memory per thread in bytes; non-zero means spills or stack arrays.
    pub local_bytes: i32,
    /// Static shared memory per block in bytes.
    pub shared_bytes: i32,
    /// Blocks of `BLOCK_THREADS` threads that fit one multiprocessor at once.
    pub blocks_per_sm: u32,
    /// Whether the code came from an embedded cubin or the JIT-compiled PTX.
    pub code: KernelCode,
}

/// Default frequency vectors a [`Rope`] keeps for launches on its own stream, most recently
/// used first; an older one is freed, ordered after the launches that used it, when a new one
/// needs the room. Vectors given to [`Rope::prepare`] are kept apart and never freed.
pub const FREQUENCY_CACHE: usize = 16;

/// A default frequency vector on the device: its `(theta bits, rotary_dim)` key, the buffer and
/// its device address.
type FreqEntry = ((u64, u32), CudaSlice<f64>, u64);

/// The default frequency vectors of a [`Rope`].
#[derive(Debug, Default)]
struct FreqCache {
    /// Prepared vectors: read by captured graphs or other streams, so kept for the handle's
    /// lifetime.
    pinned: Vec<FreqEntry>,
    /// Vectors used by launches on the handle's stream alone, most recently used first, at most
    /// [`FREQUENCY_CACHE`].
    recent: Vec<FreqEntry>,
}

/// Where a launch that reads a default frequency vector runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FreqUse {
    /// On the handle's own stream: a vector may be uploaded on first use, and freed later in
    /// stream order (unless the stream is capturing a graph: then it must be prepared).
    OwnStream,
    /// On another stream ([`Rope::run_raw`]): the vector must have been prepared.
    OtherStream,
}

/// Runs RoPE kernels on one stream. Cheap to create: every `Rope` of a context shares its
/// kernels, each loaded (and JIT-compiled by the driver) the first time a launch of that
/// context needs it, so a process compiles only the kernels it launches.
#[derive(Debug)]
pub struct Rope {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) module: Arc<Module>,
    pub(crate) facts: DeviceFacts,
    /// Default frequency vectors on the device, by `(theta bits, rotary_dim)`.
    inv_freq: Mutex<FreqCache>,
    /// How launches may overlap the kernel before them.
    overlap: StreamOverlap,
    /// The fused kernels launches take: chosen per launch unless pinned
    /// ([`Rope::with_fused_kernels`]).
    pub(crate) fused_kernels: FusedKernels,
    /// Whether programmatic one-head launches read ahead ([`Rope::with_read_ahead`]).
    read_ahead: bool,
}

impl Rope {
    /// Prepares to launch on `stream`. Loads no kernel: each loads at its first launch in the
    /// stream's context (which reports a driver that cannot load it).
    ///
    /// # Errors
    /// [`crate::Error::Driver`] when the device cannot be queried.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let ctx = stream.context();
        let module = module_for(ctx)?;
        let facts = DeviceFacts::query(ctx)?;
        Ok(Self {
            stream,
            module,
            facts,
            inv_freq: Mutex::new(FreqCache::default()),
            overlap: StreamOverlap::None,
            fused_kernels: FusedKernels::Auto,
            read_ahead: false,
        })
    }

    /// The handle with its launches overlapping the kernel before them as `overlap` says (see
    /// [`StreamOverlap`]; [`StreamOverlap::None`] for a new handle). Applies to every launch of
    /// this handle, [`Rope::run_raw`]'s on other streams included.
    #[must_use]
    pub fn with_overlap(mut self, overlap: StreamOverlap) -> Self {
        self.overlap = overlap;
        self
    }

    /// The handle with its fused launches pinned to `kernels` where those can serve them
    /// (tests and benchmarks reach kernels the planner keeps for other shapes or devices this
    /// way); [`FusedKernels::Auto`], the planner's choice, for a new handle.
    #[doc(hidden)]
    #[must_use]
    pub fn with_fused_kernels(mut self, kernels: FusedKernels) -> Self {
        self.fused_kernels = kernels;
        self
    }

    /// The handle with its programmatic launches of the one-head RoPE kernels (decode steps with
    /// [`StreamOverlap::Programmatic`] on compute capability 9.0 and newer) reading ahead: each
    /// lets the launch after it start at once, and reads its positions, frequencies and sin/cos
    /// tables before waiting for the kernel before it, so that those reads overlap it; q and k
    /// are still read after the wait. Other launches are unchanged.
    ///
    /// # Safety
    /// For every launch of this handle with [`StreamOverlap::Programmatic`], nothing that the
    /// kernel before it on its stream does writes that launch's position arrays, frequency
    /// vector or sin/cos tables (a rotation after the kernel that computes its positions would
    /// read stale ones): write them earlier, on the stream or before it, as a decode loop does
    /// when it prepares its step's positions before the model's kernels.
    #[must_use]
    pub unsafe fn with_read_ahead(mut self) -> Self {
        self.read_ahead = true;
        self
    }

    /// Whether a launch of `kernel` reads ahead: the handle asked for it, the kernel is a
    /// one-head RoPE kernel and its launch is programmatic.
    pub(crate) fn reads_ahead(&self, kernel: KernelName) -> bool {
        self.read_ahead
            && kernel.mapping == Mapping::ONE_HEAD
            && self.overlap_for(kernel.symbol()) == StreamOverlap::Programmatic
    }

    /// How this handle's launches may overlap the kernel before them.
    pub fn overlap(&self) -> StreamOverlap {
        self.overlap
    }

    /// The overlap a launch of the kernel `symbol` gets: [`StreamOverlap::Programmatic`] only
    /// where the handle asks for it and the kernel was loaded from the build that waits for the
    /// previous grid.
    pub(crate) fn overlap_for(&self, symbol: &'static str) -> StreamOverlap {
        match self.overlap {
            StreamOverlap::Programmatic if self.module.dependent_launch(symbol) => {
                StreamOverlap::Programmatic
            }
            _ => StreamOverlap::None,
        }
    }

    /// The stream launches go to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Blocks of `BLOCK_THREADS` threads of `kernel` that one multiprocessor holds at once.
    pub(crate) fn blocks_per_sm(&self, kernel: KernelName) -> u32 {
        self.module.blocks_per_sm(kernel.symbol())
    }

    /// Uploads the default frequencies of `theta` for `rotary_dim` rotated features now and
    /// keeps them for the handle's lifetime, so that no launch with
    /// [`crate::SinCos::Computed`] `{ theta }` uploads or frees them. Required before capturing
    /// such launches in a CUDA graph (an upload from host memory cannot be captured, and a graph
    /// may be replayed at any later time) and before [`Rope::run_raw`] with
    /// [`crate::RawSinCos::Computed`] (other streams are not ordered after a free).
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `theta` or `rotary_dim` as a launch would;
    /// [`crate::Error::Driver`] when the upload fails.
    pub fn prepare(&self, theta: f64, rotary_dim: u32) -> Result<()> {
        self.pin_default(theta, rotary_dim, || {
            crate::freq::check_default_frequencies(theta, rotary_dim)
        })
    }

    /// Pins the default frequencies of `theta` for `rotary_dim` features, calling `may_upload`
    /// (which checks them) before an upload: none when they are pinned already or recent, which
    /// were checked when they were uploaded.
    pub(crate) fn pin_default(
        &self,
        theta: f64,
        rotary_dim: u32,
        may_upload: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let key = (theta.to_bits(), rotary_dim);
        let mut cache = self.freq_cache();
        if cache.pinned.iter().any(|(k, ..)| *k == key) {
            return Ok(());
        }
        let entry = match cache.recent.iter().position(|(k, ..)| *k == key) {
            Some(i) => cache.recent.remove(i),
            None => {
                may_upload()?;
                self.upload_inv_freq(key)?
            }
        };
        cache.pinned.push(entry);
        Ok(())
    }

    /// The address of the device copy of `inv_freq(theta, rotary_dim)` for a launch `on` a
    /// stream: prepared vectors first, then the recent ones (uploaded on first use); complete on
    /// the device when this returns.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `theta` when the vector was not prepared and the launch
    /// runs on another stream or the handle's stream is capturing a graph;
    /// [`crate::Error::Driver`] when the upload or the capture query fails.
    pub(crate) fn inv_freq(&self, theta: f64, rotary_dim: u32, on: FreqUse) -> Result<u64> {
        let key = (theta.to_bits(), rotary_dim);
        let mut cache = self.freq_cache();
        if let Some((.., ptr)) = cache.pinned.iter().find(|(k, ..)| *k == key) {
            return Ok(*ptr);
        }
        // SAFETY: the handle's own stream is a live stream of its context.
        let capturing = on == FreqUse::OwnStream
            && unsafe { crate::device::capturing(self.stream.context(), self.stream.cu_stream()) };
        if on == FreqUse::OtherStream || capturing {
            return Err(invalid(
                "theta",
                format!(
                    "call Rope::prepare({theta}, {rotary_dim}) first: launches captured in a \
                     graph or run on other streams read only prepared frequencies"
                ),
            ));
        }
        let entry = match cache.recent.iter().position(|(k, ..)| *k == key) {
            Some(i) => cache.recent.remove(i),
            None => self.upload_inv_freq(key)?,
        };
        let ptr = entry.2;
        // Dropping the oldest frees it in the stream's order, after the launches that read it.
        cache.recent.truncate(FREQUENCY_CACHE - 1);
        cache.recent.insert(0, entry);
        Ok(ptr)
    }

    /// The device address of the default frequency vector a launch of `sincos` reads
    /// ([`RawSinCos::default_frequencies`]; 0 when it reads none), uploaded or found as
    /// [`Rope::inv_freq`] does: the I/O of a launch, done before its arguments are encoded.
    ///
    /// # Errors
    /// As [`Rope::inv_freq`].
    pub(crate) fn launch_inv_freq(
        &self,
        sincos: &RawSinCos,
        config: &RopeConfig,
        on: FreqUse,
    ) -> Result<u64> {
        match sincos.default_frequencies(config) {
            Some((theta, rotary_dim)) => self.inv_freq(theta, rotary_dim, on),
            None => Ok(0),
        }
    }

    /// The frequency cache, whatever a panicking holder left (its entries stay consistent).
    fn freq_cache(&self) -> std::sync::MutexGuard<'_, FreqCache> {
        self.inv_freq
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Uploads the default frequencies of `key = (theta bits, rotary_dim)`, complete on the
    /// device when this returns, so any stream may read them.
    fn upload_inv_freq(&self, (bits, rotary_dim): (u64, u32)) -> Result<FreqEntry> {
        let host = crate::freq::inv_freq(f64::from_bits(bits), rotary_dim);
        let f = self.stream.clone_htod(&host)?;
        self.stream.synchronize()?;
        // The vector is never written again, so no read needs ordering after this one.
        let ptr = f.device_ptr(&self.stream).0;
        Ok(((bits, rotary_dim), f, ptr))
    }

    /// Computes `spec`'s frequencies in `f64` and uploads them.
    ///
    /// # Errors
    /// As [`FrequencySpec::build`]; [`crate::Error::Driver`] when the upload fails.
    pub fn frequencies(&self, spec: &FrequencySpec) -> Result<Frequencies> {
        let (inv_freq, attention_factor) = spec.build()?;
        self.upload_frequencies(&inv_freq, spec.rotary_dim, attention_factor, spec.angle)
    }

    /// Uploads a frequency vector the caller computed, `rotary_dim = 2 * inv_freq.len()`, with
    /// its attention factor and angle mode: for models whose framework computed `inv_freq`
    /// itself. With [`AngleMode::F32Compat`], an `f32` vector as PyTorch holds it reproduces the
    /// model's angles `f32(p) * inv_freq[i]` exactly.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `inv_freq` when it is empty, when `2 * len` overflows a
    /// `u32`, or when an entry is not finite, negative or above `2^20` (the bounds
    /// [`FrequencySpec::build`] holds every family to; zero leaves a pair as it is), and `attention_factor` when it lies
    /// outside `[1e-3, 1e3]`; [`crate::Error::Driver`] when the upload fails.
    pub fn frequencies_from(
        &self,
        inv_freq: InvFreq<'_>,
        attention_factor: f64,
        angle: AngleMode,
    ) -> Result<Frequencies> {
        let (inv_freq, rotary_dim) = inv_freq.checked()?;
        let attention_factor = check_attention_factor(attention_factor)?;
        self.upload_frequencies(&inv_freq, rotary_dim, attention_factor, angle)
    }

    /// Uploads an axis map for [`crate::Positions::MultiAxis`]; complete on the device when
    /// this returns, so launches on any stream (and captured graphs) may read it.
    ///
    /// # Errors
    /// [`crate::Error::Driver`] when the upload fails.
    pub fn axis_map(&self, map: &crate::AxisMap) -> Result<crate::DeviceAxisMap> {
        let axes = self.stream.clone_htod(map.axes())?;
        self.stream.synchronize()?;
        Ok(crate::DeviceAxisMap {
            axes,
            n_axes: map.n_axes(),
            item_axes: map.item_axes(),
        })
    }

    /// Uploads checked frequencies, complete on the device when this returns, so launches on
    /// any stream may read them.
    fn upload_frequencies(
        &self,
        inv_freq: &[f64],
        rotary_dim: u32,
        attention_factor: f64,
        angle: AngleMode,
    ) -> Result<Frequencies> {
        let inv_freq = self.stream.clone_htod(inv_freq)?;
        self.stream.synchronize()?;
        Ok(Frequencies {
            inv_freq,
            rotary_dim,
            attention_factor,
            angle,
        })
    }

    /// Loads every kernel now, rather than each at its first launch (from the embedded cubins
    /// where they run on this device, in milliseconds; else the driver compiles each from the
    /// embedded PTX: seconds to a minute in all, unless its compute cache holds them).
    /// For processes that capture launches into CUDA graphs on a driver older than CUDA 12.3,
    /// which cannot load a module while a stream captures (newer drivers load the kernel of a
    /// captured launch as they would any other).
    ///
    /// # Errors
    /// [`crate::Error::Driver`] when a kernel does not load.
    pub fn load_all_kernels(&self) -> Result<()> {
        rope_kernels::abi::all_symbols().try_for_each(|name| self.module.function(name).map(drop))
    }

    /// Where the code of the kernel exported as `symbol` (one of
    /// `rope_kernels::abi::all_symbols()`) comes from on this device: an embedded cubin, or the
    /// PTX. Loads the kernel if no launch has yet.
    ///
    /// # Errors
    /// [`crate::Error::MissingKernel`] for a symbol no build holds; [`crate::Error::Driver`]
    /// when the kernel does not load.
    pub fn kernel_code(&self, symbol: &str) -> Result<KernelCode> {
        let name = rope_kernels::abi::all_symbols()
            .find(|s| *s == symbol)
            .ok_or(crate::Error::MissingKernel("(unknown symbol)"))?;
        self.module.code(name)
    }

    /// What each kernel takes on this device: registers per thread and local memory (spills)
    /// per thread, as compiled (ahead of time, or by the driver's JIT compiler from the PTX),
    /// and where its code came from. Loads every kernel not loaded yet.
    ///
    /// # Errors
    /// [`crate::Error::Driver`] when a kernel does not load or an attribute query fails.
    pub fn resources(&self) -> Result<Vec<KernelResources>> {
        rope_kernels::abi::all_symbols()
            .map(|name| {
                let f = self.module.function(name)?;
                Ok(KernelResources {
                    name,
                    registers: f.num_regs()?,
                    local_bytes: f.local_size_bytes()?,
                    shared_bytes: f.shared_size_bytes()?,
                    blocks_per_sm: self.module.blocks_per_sm(name),
                    code: self.module.code(name)?,
                })
            })
            .collect()
    }
}
