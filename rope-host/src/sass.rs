//! Kernels compiled ahead of time: cubins of the embedded PTX, when the crate was packaged with
//! them (`cargo xtask sass`; the published crate and the wheel carry them, a git checkout does
//! not). A device loads the cubin for its architecture, with no JIT compilation; kernels no
//! cubin holds for it are JIT-compiled from the PTX (`module.rs`).

use rope_kernels::abi::PtxBuild;

use crate::error::{Error, Result};

/// One embedded cubin: the entry points of the PTX build `build` that a device of `arch`
/// (compute capability `major * 10 + minor`) takes from that build, compiled by ptxas for
/// `arch` and compressed with zstd (`bytes` long once decompressed).
#[derive(Debug)]
pub(crate) struct Compiled {
    pub(crate) build: PtxBuild,
    pub(crate) arch: u32,
    pub(crate) bytes: usize,
    pub(crate) zst: &'static [u8],
}

/// The cubins this build embeds (written by the build script from `sass/manifest.txt`; empty
/// without it).
static COMPILED: &[Compiled] = &include!(concat!(env!("OUT_DIR"), "/sass.rs"));

/// The environment variable that, set to `ptx`, makes every context JIT-compile its kernels
/// from the PTX even where a cubin runs: for comparing the two, and for testing the PTX path.
pub const KERNEL_CODE_VAR: &str = "ROPE_KERNEL_CODE";

/// The architectures (`major * 10 + minor`, ascending) the embedded cubins were compiled for;
/// empty when the crate was built without them. A cubin of `sm_XY` runs on devices of compute
/// capability `X.Z` with `Z >= Y`; other devices JIT-compile the PTX.
pub fn compiled_architectures() -> Vec<u32> {
    let mut archs: Vec<u32> = COMPILED.iter().map(|c| c.arch).collect();
    archs.sort_unstable();
    archs.dedup();
    archs
}

/// The cubin among `compiled` that a device of compute capability `capability` runs for the
/// kernels it takes from `build`: of the device's major version, the highest minor version at
/// most the device's.
fn pick(
    compiled: &'static [Compiled],
    capability: (i32, i32),
    build: PtxBuild,
) -> Option<&'static Compiled> {
    let (major, minor) = (
        u32::try_from(capability.0).ok()?,
        u32::try_from(capability.1).ok()?,
    );
    compiled
        .iter()
        .filter(|c| c.build == build && c.arch / 10 == major && c.arch % 10 <= minor)
        .max_by_key(|c| c.arch)
}

/// The embedded cubin a device of `capability` runs for the kernels it takes from `build`,
/// decompressed; `None` when none runs there or [`KERNEL_CODE_VAR`] asks for PTX.
///
/// # Errors
/// [`Error::CorruptKernels`] when the embedded data does not decompress to its recorded size.
pub(crate) fn cubin(capability: (i32, i32), build: PtxBuild) -> Result<Option<Vec<u8>>> {
    if std::env::var(KERNEL_CODE_VAR).is_ok_and(|v| v == "ptx") {
        return Ok(None);
    }
    let Some(c) = pick(COMPILED, capability, build) else {
        return Ok(None);
    };
    decompress(c).map(Some)
}

/// The architecture of the embedded cubin a device of `capability` runs for `build`'s kernels.
pub(crate) fn arch_for(capability: (i32, i32), build: PtxBuild) -> Option<u32> {
    pick(COMPILED, capability, build).map(|c| c.arch)
}

/// `c`'s cubin.
fn decompress(c: &Compiled) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(c.bytes);
    ruzstd::decoding::FrameDecoder::new()
        .decode_all_to_vec(c.zst, &mut out)
        .map_err(|_| Error::CorruptKernels(c.arch))?;
    if out.len() != c.bytes {
        return Err(Error::CorruptKernels(c.arch));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{COMPILED, Compiled, PtxBuild, decompress, pick};

    const fn c(build: PtxBuild, arch: u32) -> Compiled {
        Compiled {
            build,
            arch,
            bytes: 0,
            zst: &[],
        }
    }

    static SET: [Compiled; 7] = [
        c(PtxBuild::Sm80, 80),
        c(PtxBuild::Sm89, 89),
        c(PtxBuild::Sm80, 90),
        c(PtxBuild::Sm90, 90),
        c(PtxBuild::Sm90, 100),
        c(PtxBuild::Sm80, 100),
        c(PtxBuild::Sm90, 120),
    ];

    /// A cubin runs on its major version from its minor version on: never on another major
    /// version, never on a lower minor one.
    #[test]
    fn each_device_runs_the_cubin_of_its_major_version_and_highest_minor_at_most_its_own() {
        for (capability, build, want) in [
            ((8, 0), PtxBuild::Sm80, Some(80)),
            ((8, 6), PtxBuild::Sm80, Some(80)),
            ((8, 9), PtxBuild::Sm80, Some(80)),
            ((8, 9), PtxBuild::Sm89, Some(89)),
            ((8, 6), PtxBuild::Sm89, None),
            ((9, 0), PtxBuild::Sm90, Some(90)),
            ((9, 0), PtxBuild::Sm80, Some(90)),
            ((10, 0), PtxBuild::Sm80, Some(100)),
            ((10, 3), PtxBuild::Sm90, Some(100)),
            ((12, 1), PtxBuild::Sm90, Some(120)),
            ((12, 0), PtxBuild::Sm80, None),
            ((11, 0), PtxBuild::Sm90, None),
            ((7, 5), PtxBuild::Sm80, None),
            ((-1, 0), PtxBuild::Sm80, None),
        ] {
            assert_eq!(
                pick(&SET, capability, build).map(|c| c.arch),
                want,
                "{capability:?} {build:?}"
            );
        }
    }

    /// Every embedded cubin decompresses to its recorded size and is an ELF image.
    #[test]
    fn every_embedded_cubin_decompresses_to_an_elf_of_its_recorded_size() {
        for c in COMPILED {
            let bytes = decompress(c).expect("decompresses");
            assert_eq!(bytes.len(), c.bytes, "sm_{}", c.arch);
            assert_eq!(bytes.get(..4), Some(&b"\x7fELF"[..]), "sm_{}", c.arch);
        }
        let corrupt = Compiled {
            build: PtxBuild::Sm80,
            arch: 80,
            bytes: 4,
            zst: b"not zstd",
        };
        assert!(decompress(&corrupt).is_err());
    }
}
