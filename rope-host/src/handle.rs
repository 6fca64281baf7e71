//! The [`Rope`] handle: the stream launches go to, the context's loaded module, the device
//! facts the planner needs and the frequency vectors already on the device.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, sys::CUdevice_attribute};
use kernels_gpu::abi::KernelName;

use crate::error::Result;
use crate::freq::{AngleMode, Frequencies, FrequencySpec, InvFreq, check_attention_factor};
use crate::module::{Module, module_for};

/// What the launch planner knows of the device, queried once per [`Rope`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceFacts {
    /// Streaming multiprocessors.
    pub(crate) sm_count: u32,
    /// Threads one multiprocessor holds at once (2048 on sm_80 and sm_90, 1536 on sm_86 and
    /// sm_89).
    pub(crate) threads_per_sm: u32,
}

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
}

/// A default frequency vector on the device: its `(theta bits, rotary_dim)` key, the buffer and
/// its device address.
type FreqEntry = ((u64, u32), Arc<CudaSlice<f64>>, u64);

/// Runs RoPE kernels on one stream. Cheap to create: the module is loaded once per context and
/// shared by every `Rope` of that context.
#[derive(Debug)]
pub struct Rope {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) module: Arc<Module>,
    pub(crate) facts: DeviceFacts,
    /// Default frequency vectors already on the device, by `(theta bits, rotary_dim)`.
    inv_freq: Mutex<Vec<FreqEntry>>,
}

impl Rope {
    /// Prepares to launch on `stream`, loading the PTX module into its context on first use.
    ///
    /// # Errors
    /// [`crate::Error::Driver`] when the module does not load (for example a driver too old for
    /// the PTX) or the device cannot be queried.
    pub fn new(stream: Arc<CudaStream>) -> Result<Self> {
        let ctx = stream.context();
        let module = module_for(ctx)?;
        let attribute = |a| -> Result<u32> { Ok(ctx.attribute(a)?.max(1) as u32) };
        let facts = DeviceFacts {
            sm_count: attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            threads_per_sm: attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
            )?,
        };
        Ok(Self {
            stream,
            module,
            facts,
            inv_freq: Mutex::new(Vec::new()),
        })
    }

    /// The stream launches go to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Blocks of `BLOCK_THREADS` threads of `kernel` that one multiprocessor holds at once.
    pub(crate) fn blocks_per_sm(&self, kernel: KernelName) -> u32 {
        self.module.blocks_per_sm(kernel.symbol())
    }

    /// The device copy of `inv_freq(theta, rotary_dim)` and its address, uploaded on first use.
    ///
    /// # Errors
    /// [`crate::Error::Driver`] when the upload fails.
    pub(crate) fn inv_freq(
        &self,
        theta: f64,
        rotary_dim: u32,
    ) -> Result<(Arc<CudaSlice<f64>>, u64)> {
        let key = (theta.to_bits(), rotary_dim);
        let mut cache = self
            .inv_freq
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((_, f, addr)) = cache.iter().find(|(k, ..)| *k == key) {
            return Ok((f.clone(), *addr));
        }
        let f = Arc::new(
            self.stream
                .clone_htod(&crate::freq::inv_freq(theta, rotary_dim))?,
        );
        // The vector is never written again, so no read needs ordering after this one.
        let addr = f.device_ptr(&self.stream).0;
        cache.push((key, f.clone(), addr));
        Ok((f, addr))
    }

    /// Computes `spec`'s frequencies in `f64` and uploads them.
    ///
    /// # Errors
    /// As [`FrequencySpec::build`]; [`crate::Error::Driver`] when the upload fails.
    pub fn frequencies(&self, spec: &FrequencySpec) -> Result<Frequencies> {
        let (inv_freq, attention_factor) = spec.build()?;
        Ok(Frequencies {
            inv_freq: self.stream.clone_htod(&inv_freq)?,
            rotary_dim: spec.rotary_dim,
            attention_factor,
            angle: spec.angle,
        })
    }

    /// Uploads a frequency vector the caller computed, `rotary_dim = 2 * inv_freq.len()`, with
    /// its attention factor and angle mode: for models whose framework computed `inv_freq`
    /// itself. With [`AngleMode::F32Compat`], an `f32` vector as PyTorch holds it reproduces the
    /// model's angles `f32(p) * inv_freq[i]` exactly.
    ///
    /// # Errors
    /// [`crate::Error::Invalid`] naming `inv_freq` when it is empty, when `2 * len` overflows a
    /// `u32`, or when an entry is not finite and positive or above `2^20` (the bound
    /// [`FrequencySpec::build`] holds every family to), and `attention_factor` when it lies
    /// outside `[1e-3, 1e3]`; [`crate::Error::Driver`] when the upload fails.
    pub fn frequencies_from(
        &self,
        inv_freq: InvFreq<'_>,
        attention_factor: f64,
        angle: AngleMode,
    ) -> Result<Frequencies> {
        let (inv_freq, rotary_dim) = inv_freq.checked()?;
        let attention_factor = check_attention_factor(attention_factor)?;
        Ok(Frequencies {
            inv_freq: self.stream.clone_htod(&inv_freq)?,
            rotary_dim,
            attention_factor,
            angle,
        })
    }

    /// What the driver's JIT compiler allotted each kernel on this device: registers per
    /// thread and local memory (spills) per thread, the resource report of the PTX.
    ///
    /// # Errors
    /// [`crate::Error::Driver`] when an attribute query fails.
    pub fn resources(&self) -> Result<Vec<KernelResources>> {
        kernels_gpu::abi::all_symbols()
            .map(|name| {
                let f = self.module.function(name);
                Ok(KernelResources {
                    name,
                    registers: f.num_regs()?,
                    local_bytes: f.local_size_bytes()?,
                    shared_bytes: f.shared_size_bytes()?,
                    blocks_per_sm: self.module.blocks_per_sm(name),
                })
            })
            .collect()
    }
}
