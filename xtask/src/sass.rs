//! `cargo xtask sass`: the committed PTX compiled ahead of time to SASS (cubins) by
//! ptxas from NVIDIA's PyPI wheel at a pinned version, zstd-compressed into `rope-host/sass/`
//! (ignored by git; `cargo package` and the wheel take it, see docs/perf/decisions.md).
//!
//! Each module is the entry points that a device of one architecture takes from one PTX build
//! (the newest build it runs where that build holds the kernel, sm_80's otherwise: the rule of
//! `rope-host`'s `module.rs`), compiled for that architecture. `rope-host/sass/manifest.txt`
//! lists them with the FNV-1a hash of the compressed PTX file each came from; `rope-host`'s
//! build script embeds only modules whose PTX is the one it embeds. It fails unless every cubin holds its
//! entry points (CI runs it before packaging).

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

use rope_kernels::abi::{PtxBuild, all_symbols};

use crate::ptx::{entries_where, ptx_path, unpack, zst_path};
use crate::root;

/// NVIDIA's PyPI package of ptxas and its pinned version: CUDA 13.0, the compiler of the R580
/// drivers' JIT, so a cubin holds the code the driver would compile from the PTX (ptxas 12.9's
/// made some plain kernels up to 1.2 points of copy slower on an H200; docs/perf/decisions.md).
/// Its cubins load on drivers of CUDA 13 (R580 and newer); older drivers refuse them, and the
/// kernels come from the PTX there.
const PTXAS_PACKAGE: &str = "nvidia-cuda-nvcc==13.0.88";

/// The environment variable naming a ptxas to use instead of the pinned one from PyPI.
const PTXAS_VAR: &str = "ROPE_PTXAS";

/// The zstd level of the compressed cubins (the slowest, smallest; decoding speed does not
/// depend on it).
const ZSTD_LEVEL: i32 = 19;

/// The architectures compiled for. A cubin runs on devices of its major version and a minor
/// version at least its own, so sm_80's serves sm_86 and sm_87 devices, and with sm_89's fused
/// kernels sm_89 ones. Others (sm_110, or a newer major) JIT-compile the PTX.
pub const ARCHS: [u32; 5] = [80, 89, 90, 100, 120];

/// The newest PTX build a device of architecture `arch` (major * 10 + minor) runs.
fn newest_build(arch: u32) -> PtxBuild {
    let (major, minor) = (arch / 10, arch % 10);
    PtxBuild::newest_for((major as i32, minor as i32))
}

/// Whether a device of `arch` takes `symbol` from `build`.
fn takes(arch: u32, build: PtxBuild, symbol: &str) -> bool {
    let newest = newest_build(arch);
    let from = if newest.holds(symbol) {
        newest
    } else {
        PtxBuild::Sm80
    };
    from == build
}

/// One module to compile: the entry points of `build` that a device of `arch` takes from it.
/// Devices of sm_89 take sm_80's kernels from the sm_80 cubin, so that pair is not compiled.
fn modules() -> Vec<(PtxBuild, u32)> {
    let mut out = Vec::new();
    for arch in ARCHS {
        for build in [PtxBuild::Sm80, PtxBuild::Sm89, PtxBuild::Sm90] {
            let own = !(arch == 89 && build == PtxBuild::Sm80);
            if own && all_symbols().any(|s| takes(arch, build, s)) {
                out.push((build, arch));
            }
        }
    }
    out
}

/// The file name of a module: `sm80-sm_90.cubin.zst` is sm_80's PTX compiled for sm_90.
fn file_name(build: PtxBuild, arch: u32) -> String {
    let b = match build {
        PtxBuild::Sm80 => "sm80",
        PtxBuild::Sm89 => "sm89",
        PtxBuild::Sm90 => "sm90",
    };
    format!("{b}-sm_{arch}.cubin.zst")
}

/// FNV-1a, 64 bits: the manifest's fingerprint of a compressed PTX file (the build script
/// computes the same over the file it embeds).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

pub fn run() -> Result<()> {
    let ptxas = ptxas()?;
    let version = Command::new(&ptxas).arg("--version").output()?;
    let version = String::from_utf8_lossy(&version.stdout);
    println!(
        "ptxas: {} ({})",
        ptxas.display(),
        version.lines().last().unwrap_or("?")
    );
    let out_dir = root().join("rope-host/sass");
    let scratch = root().join("target/sass-ptx");
    fs::create_dir_all(&out_dir)?;
    fs::create_dir_all(&scratch)?;
    // The manifest first, so that no build embeds a module while it is replaced.
    for old in fs::read_dir(&out_dir)? {
        let old = old?.path();
        if old.file_name().is_some_and(|n| n == "manifest.txt") {
            fs::remove_file(old)?;
        }
    }
    for old in fs::read_dir(&out_dir)? {
        fs::remove_file(old?.path())?;
    }
    let jobs = modules();
    let threads = std::thread::available_parallelism().map_or(2, usize::from);
    let results: Vec<Result<String>> = std::thread::scope(|s| {
        let jobs = &jobs;
        let handles: Vec<_> = (0..threads.min(jobs.len()))
            .map(|t| {
                let (ptxas, out_dir, scratch) = (&ptxas, &out_dir, &scratch);
                s.spawn(move || {
                    jobs.iter()
                        .enumerate()
                        .filter(|(i, _)| i % threads == t)
                        .map(|(_, &(build, arch))| compile(ptxas, build, arch, scratch, out_dir))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| {
                h.join()
                    .unwrap_or_else(|_| vec![Err(anyhow::anyhow!("a ptxas thread panicked"))])
            })
            .collect()
    });
    let mut manifest = String::from(
        "# rope-host's compiled kernels, written by `cargo xtask sass`: compressed PTX file, its FNV-1a 64 hash, architecture, cubin bytes, file\n",
    );
    let mut lines: Vec<String> = results.into_iter().collect::<Result<_>>()?;
    lines.sort();
    for line in lines {
        println!("{line}");
        writeln!(manifest, "{line}")?;
    }
    // Written last and renamed into place: a build reading the folder meanwhile sees either no
    // manifest or every module it lists.
    let tmp = out_dir.join("manifest.txt.tmp");
    fs::write(&tmp, manifest)?;
    fs::rename(&tmp, out_dir.join("manifest.txt"))?;
    println!("wrote {} modules in {}", jobs.len(), out_dir.display());
    Ok(())
}

/// Compiles the entry points of `build` that devices of `arch` take from it, checks that the
/// cubin holds each, writes it compressed into `out_dir` and returns its manifest line.
fn compile(
    ptxas: &Path,
    build: PtxBuild,
    arch: u32,
    scratch: &Path,
    out_dir: &Path,
) -> Result<String> {
    // The compressed file is what `rope-host` embeds: compiled from it, and named by its hash.
    let path = root().join(zst_path(build));
    let packed_ptx = fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let ptx = unpack(&packed_ptx)?;
    let keep = |s: &str| takes(arch, build, s);
    let subset = entries_where(&ptx, keep);
    let name = file_name(build, arch);
    let input = scratch.join(name.replace(".cubin.zst", ".ptx"));
    let cubin = scratch.join(name.replace(".zst", ""));
    fs::write(&input, &subset)?;
    let status = Command::new(ptxas)
        .arg(format!("-arch=sm_{arch}"))
        .arg(&input)
        .arg("-o")
        .arg(&cubin)
        .status()
        .with_context(|| format!("running {}", ptxas.display()))?;
    ensure!(
        status.success(),
        "ptxas failed on {} for sm_{arch}",
        ptx_path(build)
    );
    let bytes = fs::read(&cubin)?;
    let symbols: Vec<&str> = all_symbols().filter(|s| keep(s)).collect();
    ensure!(!symbols.is_empty(), "{name}: no entry points");
    for symbol in &symbols {
        let mut needle = symbol.as_bytes().to_vec();
        needle.push(0);
        ensure!(
            bytes.windows(needle.len()).any(|w| w == needle.as_slice()),
            "{name} lacks the entry point {symbol}"
        );
    }
    let packed = zstd::bulk::compress(&bytes, ZSTD_LEVEL)?;
    fs::write(out_dir.join(&name), &packed)?;
    let file = Path::new(&zst_path(build))
        .file_name()
        .and_then(|f| f.to_str())
        .unwrap_or_default()
        .to_owned();
    Ok(format!(
        "{file} {:016x} sm_{arch} {} {name}",
        fnv1a64(&packed_ptx),
        bytes.len()
    ))
}

/// The ptxas to run: `$ROPE_PTXAS`, else the pinned one from PyPI, installed into a venv under
/// `target/` on first use (needs python3 with venv and pip, and network access to PyPI).
fn ptxas() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(PTXAS_VAR) {
        return Ok(PathBuf::from(p));
    }
    let venv = root().join("target/ptxas-venv");
    let python = venv.join("bin/python");
    let find = || -> Option<PathBuf> {
        let out = Command::new(&python)
            .args([
                "-c",
                "import os, nvidia\n\
                 for p in nvidia.__path__:\n\
                 \tfor d, _, files in os.walk(p):\n\
                 \t\tif d.endswith('bin') and 'ptxas' in files: print(os.path.join(d, 'ptxas'))",
            ])
            .output()
            .ok()?;
        let p = PathBuf::from(String::from_utf8(out.stdout).ok()?.lines().next()?.trim());
        p.is_file().then_some(p)
    };
    let pinned = venv.join(PTXAS_PACKAGE.replace("==", "-"));
    if pinned.is_file()
        && let Some(p) = find()
    {
        return Ok(p);
    }
    let ok = Command::new("python3")
        .args(["-m", "venv"])
        .arg(&venv)
        .status()?
        .success()
        && Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", PTXAS_PACKAGE])
            .status()?
            .success();
    if !ok {
        bail!(
            "could not install {PTXAS_PACKAGE} into {} (or set {PTXAS_VAR})",
            venv.display()
        );
    }
    fs::write(&pinned, "")?;
    find().with_context(|| format!("{PTXAS_PACKAGE} installed no ptxas"))
}

#[cfg(test)]
mod tests {
    use super::{ARCHS, PtxBuild, all_symbols, modules, newest_build, takes};

    /// Every kernel a device of each compiled architecture launches is in a module of its
    /// major version and at most its minor one, compiled from the build the device takes the
    /// kernel from (sm_89 devices take sm_80's kernels from the sm_80 cubin).
    #[test]
    fn every_kernel_of_each_architecture_is_in_a_module_it_runs() {
        let mods = modules();
        for arch in ARCHS {
            for s in all_symbols() {
                let newest = newest_build(arch);
                let build = if newest.holds(s) {
                    newest
                } else {
                    PtxBuild::Sm80
                };
                let found = mods.iter().any(|&(b, a)| {
                    b == build && a / 10 == arch / 10 && a <= arch && takes(a, b, s)
                });
                assert!(found, "sm_{arch}: {s}");
            }
        }
        assert!(!mods.contains(&(PtxBuild::Sm80, 89)));
    }
}
