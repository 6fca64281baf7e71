//! The driver probe and the per-context module cache (the PTX itself: `ptx.rs`).

use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;
use rope_kernels::abi::{BLOCK_THREADS, PtxBuild};

use crate::error::{Error, Result};
use crate::ptx::{entry_module, probe_module, ptx};
use crate::sass;

/// The environment variable that caps the builds a context takes kernels from: `sm_80` takes
/// every kernel from [`PtxBuild::Sm80`]'s [`ptx`], `sm_89` the fused ones from
/// [`PtxBuild::Sm89`]'s and the rest from sm_80's, even where a newer build would run: for
/// testing the older kernels on a newer GPU. Other values are ignored.
pub const PTX_ARCH_VAR: &str = "ROPE_PTX_ARCH";

/// Opens device `ordinal` (its primary context), or explains why it cannot.
///
/// # Errors
/// [`Error::NoDriver`](crate::Error::NoDriver) when the CUDA driver library is missing (no
/// panic, unlike calling cudarc directly; with the `dynamic-loading` feature, the default);
/// [`Error::Driver`](crate::Error::Driver) when the driver has no such device.
pub fn open_device(ordinal: usize) -> Result<Arc<CudaContext>> {
    probe_driver()?;
    Ok(CudaContext::new(ordinal)?)
}

/// Checks that the driver library can be loaded, when cudarc loads it at run time.
#[cfg(feature = "dynamic-loading")]
fn probe_driver() -> Result<()> {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library by its usual names
    // and closes it again; it has no preconditions.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::NoDriver(
            "libcuda could not be loaded; install an NVIDIA driver to run on a GPU",
        ));
    }
    Ok(())
}

/// Without `dynamic-loading`, another crate chose how cudarc reaches the driver (candle links
/// it, so a program without it does not start); there is nothing to probe.
#[cfg(not(feature = "dynamic-loading"))]
fn probe_driver() -> Result<()> {
    Ok(())
}

/// The kernels of one context, each loaded the first time a launch (or a query) needs it:
/// from the embedded cubin of the kernel's build for this device where there is one (loaded
/// whole, once, with no compilation; see [`crate::sass`]), else JIT-compiled by the driver from
/// the PTX, one small module per entry point ([`entry_module`]), so that a process compiles
/// only the entry points it uses.
#[derive(Debug)]
pub(crate) struct Module {
    ctx: Arc<CudaContext>,
    /// The device's compute capability.
    capability: (i32, i32),
    /// The newest build this device runs and the driver accepts (see [`Module::load`]); a
    /// kernel it holds comes from it, every other from sm_80's [`ptx`].
    build: PtxBuild,
    /// The kernels loaded so far.
    functions: Mutex<Vec<(&'static str, Arc<Loaded>)>>,
    /// The cubin module of each build looked up so far; `None` where no embedded cubin runs on
    /// this device or the driver refused it.
    cubins: Mutex<Vec<(PtxBuild, Option<Arc<CudaModule>>)>>,
}

/// Where a loaded kernel's machine code came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelCode {
    /// An embedded cubin compiled ahead of time for `sm_{arch}` (`major * 10 + minor`).
    Sass {
        /// The architecture the cubin was compiled for.
        arch: u32,
    },
    /// The embedded PTX, JIT-compiled by the driver.
    Ptx,
}

/// One kernel function and how many blocks of it one multiprocessor holds.
#[derive(Debug)]
struct Loaded {
    /// The function; it keeps its module alive.
    function: CudaFunction,
    /// Where its code came from.
    code: KernelCode,
    /// Blocks of `BLOCK_THREADS` threads resident per multiprocessor (at least 1), from the
    /// driver's occupancy calculation for the registers the JIT compiler gave the kernel.
    blocks_per_sm: u32,
    /// The driver's answers for other block shapes, `((threads, shared bytes), blocks)`, asked
    /// once each (a launch plans with them; the answer never changes).
    blocks_at: Mutex<Vec<((u32, u32), u32)>>,
}

/// The newest embedded build a device of compute capability `capability` runs, capped by
/// [`PTX_ARCH_VAR`]'s value `cap` when it names an older one.
fn newest_build(capability: (i32, i32), cap: Option<&str>) -> PtxBuild {
    let newest = PtxBuild::newest_for(capability);
    let cap = match cap {
        Some("sm_80") => PtxBuild::Sm80,
        Some("sm_89") => PtxBuild::Sm89,
        _ => PtxBuild::Sm90,
    };
    newest.min(cap)
}

impl Module {
    /// The loaded function exported as `symbol` (one of `rope_kernels::abi::all_symbols`),
    /// loaded now if no launch has needed it yet: from [`Module::build`] where that build holds
    /// it, else from sm_80's.
    ///
    /// # Errors
    /// [`crate::Error::MissingKernel`] when the build holds no such entry point;
    /// [`crate::Error::Driver`] when the driver cannot load it.
    fn loaded(&self, symbol: &'static str) -> Result<Arc<Loaded>> {
        let mut functions = self
            .functions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some((_, l)) = functions.iter().find(|(s, _)| *s == symbol) {
            return Ok(l.clone());
        }
        let build = if self.build.holds(symbol) {
            self.build
        } else {
            PtxBuild::Sm80
        };
        let compiled = self
            .cubin(build)?
            .and_then(|(m, arch)| Some((m.load_function(symbol).ok()?, arch)));
        let (function, code) = match compiled {
            Some((f, arch)) => (f, KernelCode::Sass { arch }),
            None => {
                let text = entry_module(ptx(build)?, symbol).ok_or(Error::MissingKernel(symbol))?;
                let f = self
                    .ctx
                    .load_module(Ptx::from_src(text))?
                    .load_function(symbol)?;
                (f, KernelCode::Ptx)
            }
        };
        // The occupancy query needs the context current on this thread (cudarc binds it for
        // module loads, but another thread may have loaded the module this function came from).
        self.ctx.bind_to_thread()?;
        let blocks_per_sm = function
            .occupancy_max_active_blocks_per_multiprocessor(BLOCK_THREADS, 0, None)?
            .max(1);
        let loaded = Arc::new(Loaded {
            function,
            code,
            blocks_per_sm,
            blocks_at: Mutex::new(Vec::new()),
        });
        functions.push((symbol, loaded.clone()));
        Ok(loaded)
    }

    /// The cubin module of `build`'s kernels on this device and the architecture it was
    /// compiled for, loaded on first use; `None` where no embedded cubin runs here or the
    /// driver refuses it (the kernels then come from the PTX).
    ///
    /// # Errors
    /// [`crate::Error::CorruptKernels`] when the embedded cubin does not decompress.
    fn cubin(&self, build: PtxBuild) -> Result<Option<(Arc<CudaModule>, u32)>> {
        let mut cubins = self
            .cubins
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let cached = cubins
            .iter()
            .find(|(b, _)| *b == build)
            .map(|(_, m)| m.clone());
        let module = match cached {
            Some(m) => m,
            None => {
                let m = sass::cubin(self.capability, build)?
                    .and_then(|bytes| self.ctx.load_module(Ptx::from_binary(bytes)).ok());
                cubins.push((build, m.clone()));
                m
            }
        };
        Ok(module.zip(sass::arch_for(self.capability, build)))
    }

    /// Where the code of the kernel exported as `symbol` comes from, loading it if no launch
    /// has yet.
    ///
    /// # Errors
    /// As [`Module::loaded`].
    pub(crate) fn code(&self, symbol: &'static str) -> Result<KernelCode> {
        Ok(self.loaded(symbol)?.code)
    }

    /// The function exported as `symbol`, one of `rope_kernels::abi::all_symbols()`.
    ///
    /// # Errors
    /// As [`Module::loaded`].
    pub(crate) fn function(&self, symbol: &'static str) -> Result<CudaFunction> {
        Ok(self.loaded(symbol)?.function.clone())
    }

    /// Whether the function exported as `symbol` may be launched with programmatic stream
    /// serialization: it comes from the sm_90 build ([`ptx`]) and waits for the previous grid.
    pub(crate) fn dependent_launch(&self, symbol: &'static str) -> bool {
        self.build == PtxBuild::Sm90 && self.build.holds(symbol)
    }

    /// Blocks of `BLOCK_THREADS` threads of the kernel `symbol` that one multiprocessor of
    /// this device holds at once (at least 1), loading the kernel if no launch has yet; 1 when
    /// it cannot be loaded (its launch then fails at [`Module::function`] with the reason).
    pub(crate) fn blocks_per_sm(&self, symbol: &'static str) -> u32 {
        self.loaded(symbol).map_or(1, |l| l.blocks_per_sm)
    }

    /// Blocks of `threads` threads and `shared_bytes` of dynamic shared memory of the kernel
    /// `symbol` that one multiprocessor of this device holds at once (the driver's occupancy
    /// calculation; at least 1).
    ///
    /// # Errors
    /// As [`Module::loaded`], and [`crate::Error::Driver`] when the query fails.
    pub(crate) fn blocks_per_sm_at(
        &self,
        symbol: &'static str,
        threads: u32,
        shared_bytes: u32,
    ) -> Result<u32> {
        let loaded = self.loaded(symbol)?;
        let mut known = loaded
            .blocks_at
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let shape = (threads, shared_bytes);
        if let Some(&(_, blocks)) = known.iter().find(|(s, _)| *s == shape) {
            return Ok(blocks);
        }
        // As in `loaded`: the query needs the context current on this thread.
        self.ctx.bind_to_thread()?;
        let blocks = loaded
            .function
            .occupancy_max_active_blocks_per_multiprocessor(threads, shared_bytes as usize, None)?
            .max(1);
        known.push((shape, blocks));
        Ok(blocks)
    }

    /// Whether the rows kernels ([`rope_kernels::abi::Mapping::Rows`]) run: they come from
    /// the sm_90 build (elsewhere they are stubs that trap).
    pub(crate) fn bulk_rows(&self) -> bool {
        self.build == PtxBuild::Sm90
    }

    /// The kernels of `ctx`, none loaded yet: they come from the newest build the device runs
    /// (sm_90's from compute capability 9.0 on, sm_89's on 8.9; [`PTX_ARCH_VAR`] may cap it),
    /// or from sm_80's where the driver rejects that build's PTX ISA (an empty module
    /// of the build's header tells, compiling nothing) or the build lacks the kernel.
    fn load(ctx: &Arc<CudaContext>) -> Result<Self> {
        use cudarc::driver::sys::CUdevice_attribute::{
            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR as MAJOR,
            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR as MINOR,
        };
        let capability = (ctx.attribute(MAJOR)?, ctx.attribute(MINOR)?);
        let cap = std::env::var(PTX_ARCH_VAR).ok();
        let newest = newest_build(capability, cap.as_deref());
        let build = if newest == PtxBuild::Sm80
            || ctx
                .load_module(Ptx::from_src(probe_module(newest)?))
                .is_ok()
        {
            newest
        } else {
            PtxBuild::Sm80
        };
        Ok(Self {
            ctx: ctx.clone(),
            capability,
            build,
            functions: Mutex::new(Vec::new()),
            cubins: Mutex::new(Vec::new()),
        })
    }
}

/// Modules alive in this process, one per context; dead entries are pruned on lookup.
static CACHE: Mutex<Vec<Weak<Module>>> = Mutex::new(Vec::new());

/// The module of `ctx`, loaded on first use and shared while any handle holds it.
pub(crate) fn module_for(ctx: &Arc<CudaContext>) -> Result<Arc<Module>> {
    let mut cache = CACHE
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    cache.retain(|w| w.strong_count() > 0);
    if let Some(m) = cache
        .iter()
        .filter_map(Weak::upgrade)
        .find(|m| Arc::ptr_eq(&m.ctx, ctx))
    {
        return Ok(m);
    }
    let m = Arc::new(Module::load(ctx)?);
    cache.push(Arc::downgrade(&m));
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::newest_build;
    use rope_kernels::abi::PtxBuild;

    #[test]
    fn each_device_takes_the_newest_build_it_runs_unless_capped() {
        for (capability, cap, want) in [
            ((8, 0), None, PtxBuild::Sm80),
            ((8, 6), None, PtxBuild::Sm80),
            ((8, 9), None, PtxBuild::Sm89),
            ((9, 0), None, PtxBuild::Sm90),
            ((12, 0), None, PtxBuild::Sm90),
            ((9, 0), Some("sm_89"), PtxBuild::Sm89),
            ((9, 0), Some("sm_80"), PtxBuild::Sm80),
            ((8, 9), Some("sm_80"), PtxBuild::Sm80),
            // A cap only lowers the build.
            ((8, 0), Some("sm_89"), PtxBuild::Sm80),
            ((9, 0), Some("sm_100"), PtxBuild::Sm90),
        ] {
            assert_eq!(
                newest_build(capability, cap),
                want,
                "{capability:?} {cap:?}"
            );
        }
    }
}
