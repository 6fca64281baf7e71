//! `cargo xtask ptx [--check]`.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};

use rope_kernels::abi::PtxBuild;

use crate::{cargo, root};

const TARGET: &str = "nvptx64-nvidia-cuda";

/// One PTX build: the GPU architecture rustc targets, the committed file (`rope-host` embeds
/// its zstd-compressed copy, [`zst_path`]), and the target directory (one per architecture, so
/// the builds do not rebuild each other).
struct Arch {
    cpu: &'static str,
    /// Extra target features: the PTX ISA version the architecture's instructions need.
    features: &'static str,
    path: &'static str,
    dir: &'static str,
    /// Which build this is: the entry points kept are those it holds ([`PtxBuild::holds`]),
    /// only those whose code differs from the sm_80 build's, so that every binary embedding the
    /// files grows by the least.
    build: PtxBuild,
}

/// The builds: every kernel for sm_80 (Ampere and newer); the fused kernels again for sm_89
/// (Ada), where their `cfg(target_feature = "sm_89")` code uses an instruction sm_80 lacks (the
/// paired FP8 conversion); the fused and one-head kernels again for sm_90 (Hopper and newer),
/// where they also take part in programmatic dependent launch (`griddepcontrol`). The host
/// takes each kernel from the newest build the device runs.
const ARCHS: [Arch; 3] = [
    Arch {
        cpu: "sm_80",
        features: "",
        path: "rope-host/ptx/kernels.ptx",
        dir: "ptx",
        build: PtxBuild::Sm80,
    },
    Arch {
        cpu: "sm_89",
        // `cvt.rn.satfinite.e4m3x2.f32` needs PTX ISA 8.1 on sm_89 (7.8 on sm_90).
        features: " -Ctarget-feature=+ptx81",
        path: "rope-host/ptx/kernels_sm89.ptx",
        dir: "ptx-sm89",
        build: PtxBuild::Sm89,
    },
    Arch {
        cpu: "sm_90",
        // The rows kernels' bulk copies and mbarriers need PTX ISA 8.0 (`griddepcontrol` and
        // the paired FP8 conversion 7.8, the version rustc's LLVM writes for sm_90 by default).
        features: " -Ctarget-feature=+ptx80",
        path: "rope-host/ptx/kernels_sm90.ptx",
        dir: "ptx-sm90",
        build: PtxBuild::Sm90,
    },
];

pub fn run(check: bool) -> Result<()> {
    // The three builds at once: each is mostly one long single-threaded codegen.
    let built: Vec<Result<String>> = std::thread::scope(|s| {
        let handles: Vec<_> = ARCHS.iter().map(|arch| s.spawn(|| build(arch))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("a PTX build thread panicked")))
            })
            .collect()
    });
    for (arch, ptx) in ARCHS.iter().zip(built) {
        let ptx = ptx?;
        let path = root().join(arch.path);
        let packed_path = root().join(zst_path(arch.build));
        let name = arch.path;
        if check {
            let committed =
                fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            ensure!(
                committed == ptx,
                "{name} is stale: it does not match rope-kernels's source; run `cargo xtask ptx` and commit it"
            );
            let packed = fs::read(&packed_path)
                .with_context(|| format!("reading {}", packed_path.display()))?;
            ensure!(
                unpack(&packed)? == ptx,
                "{}.zst is stale: it does not hold {name}; run `cargo xtask ptx` and commit it",
                name
            );
            println!(
                "{name} and its .zst are up to date ({} lines)",
                ptx.lines().count()
            );
        } else {
            fs::write(&path, &ptx).with_context(|| format!("writing {}", path.display()))?;
            let packed = pack(&ptx)?;
            fs::write(&packed_path, &packed)
                .with_context(|| format!("writing {}", packed_path.display()))?;
            println!(
                "wrote {name} ({} lines; {} bytes compressed)",
                ptx.lines().count(),
                packed.len()
            );
        }
    }
    Ok(())
}

/// The zstd level of the compressed PTX `rope-host` embeds (the slowest, smallest: the
/// packages' size is what counts; decoding speed does not depend on the level).
const ZSTD_LEVEL: i32 = 19;

/// `ptx` compressed as two zstd frames: the text before the first entry point (the header a
/// module probe needs, which `rope-host` decompresses alone, quickly) and the rest.
fn pack(ptx: &str) -> Result<Vec<u8>> {
    let split = ptx.find("\n.visible ").map_or(ptx.len(), |at| at + 1);
    let mut packed = zstd::bulk::compress(&ptx.as_bytes()[..split], ZSTD_LEVEL)?;
    packed.extend(zstd::bulk::compress(&ptx.as_bytes()[split..], ZSTD_LEVEL)?);
    Ok(packed)
}

/// The text of a compressed PTX file (every frame).
pub fn unpack(packed: &[u8]) -> Result<String> {
    let bytes = zstd::stream::decode_all(packed)?;
    String::from_utf8(bytes).context("compressed PTX that is not UTF-8")
}

/// Builds the kernel crate to PTX for `arch` and returns the checked text. The flags go to
/// every crate of the build, `core` included, so they all agree.
fn build(arch: &Arch) -> Result<String> {
    let target_dir = root().join("target").join(arch.dir);
    let rustflags = format!(
        "-Zunstable-options -Cpanic=immediate-abort -Ctarget-cpu={}{}",
        arch.cpu, arch.features
    );
    let status = cargo()
        .args([
            "rustc",
            "--package",
            "rope-kernels",
            "--lib",
            "--release",
            "--target",
            TARGET,
        ])
        .arg("-Zbuild-std=core")
        .arg("--target-dir")
        .arg(&target_dir)
        .args(["--", "--emit=asm"])
        .env("RUSTFLAGS", rustflags)
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .status()
        .with_context(|| format!("running cargo for the {} PTX build", arch.cpu))?;
    ensure!(status.success(), "the {} PTX build failed", arch.cpu);
    let deps = target_dir.join(TARGET).join("release").join("deps");
    let mut ptx = fs::read_to_string(newest_asm(&deps)?)?;
    validate(&ptx)?;
    if arch.build != PtxBuild::Sm80 {
        ptx = entries_only(&ptx, arch.build);
    }
    Ok(with_launch_bounds(&ptx))
}

/// `ptx` with only the entry points `build` holds: the module header and global declarations
/// before the first entry stay (rustc's PTX has nothing else outside entries).
fn entries_only(ptx: &str, build: PtxBuild) -> String {
    entries_where(ptx, |symbol| build.holds(symbol))
}

/// `ptx` with only the entry points whose names `keep` accepts, and the header before the
/// first entry.
pub fn entries_where(ptx: &str, keep: impl Fn(&str) -> bool) -> String {
    let mut out = String::with_capacity(ptx.len());
    let mut kept = true;
    for line in ptx.lines() {
        if let Some(rest) = line.strip_prefix(".visible .entry ") {
            kept = keep(rest.split('(').next().unwrap_or_default());
        }
        if kept {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The committed PTX file of `build`, relative to the workspace root.
pub fn ptx_path(build: PtxBuild) -> &'static str {
    ARCHS
        .iter()
        .find(|a| a.build == build)
        .map_or("rope-host/ptx/kernels.ptx", |a| a.path)
}

/// The committed zstd-compressed copy of [`ptx_path`]`(build)`: what `rope-host` embeds and
/// packages (the text is for reading and diffs).
pub fn zst_path(build: PtxBuild) -> String {
    format!("{}.zst", ptx_path(build))
}

/// The most recently written `rope_kernels-*.s` (cargo keeps older ones from other flags).
fn newest_asm(deps: &Path) -> Result<PathBuf> {
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in fs::read_dir(deps).with_context(|| format!("listing {}", deps.display()))? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with("rope_kernels-") && name.ends_with(".s") {
            let modified = fs::metadata(&path)?.modified()?;
            if best.as_ref().is_none_or(|(t, _)| modified > *t) {
                best = Some((modified, path));
            }
        }
    }
    best.map(|(_, p)| p)
        .context("the PTX build wrote no rope_kernels-*.s")
}

/// Adds each entry point's launch bounds ([`launch_bounds`]: `.maxntid BLOCK_THREADS, 1, 1`
/// and `.minnctapersm`, the kernel's [`KernelName::min_blocks_per_sm`] or
/// [`MIN_BLOCKS_PER_SM`] for the table builders and the fused item loops; `.maxntid` and
/// `.maxnreg` for the fused token-heads kernels) between its parameter list and its body: the
/// launch bounds rustc cannot express.
///
/// [`KernelName::min_blocks_per_sm`]: rope_kernels::abi::KernelName::min_blocks_per_sm
/// [`MIN_BLOCKS_PER_SM`]: rope_kernels::abi::MIN_BLOCKS_PER_SM
fn with_launch_bounds(ptx: &str) -> String {
    let mut out = String::with_capacity(ptx.len() + 4096);
    let mut blocks = None;
    for line in ptx.lines() {
        out.push_str(line);
        out.push('\n');
        if let Some(rest) = line.strip_prefix(".visible .entry ") {
            blocks = Some(launch_bounds(rest.split('(').next().unwrap_or_default()));
        } else if let (Some(bounds), ")") = (&blocks, line.trim()) {
            out.push_str(bounds);
            blocks = None;
        }
    }
    out
}

/// The launch-bound directives of the entry point `symbol`: for the fused token-heads kernels,
/// whose blocks hold up to `TOKEN_HEADS_MAX_WARPS` warps of a token, `.maxntid` of that many
/// threads and `.maxnreg` (their `token_heads_registers`); for the QK-norm + RoPE backward's
/// gradient kernels `.maxntid NORM_GRAD_MAX_THREADS` and `.maxnreg NORM_GRAD_MAX_REGISTERS`,
/// and for its weights kernels `.maxntid
/// NORM_GRAD_WEIGHTS_THREADS`; for the across-heads kernels `.maxntid NORM_ACROSS_MAX_THREADS`
/// and `.maxnreg NORM_ACROSS_MAX_REGISTERS`; for the others `.maxntid BLOCK_THREADS` and `.minnctapersm`.
fn launch_bounds(symbol: &str) -> String {
    use rope_kernels::abi::{
        BLOCK_THREADS, FusedKernelName, NORM_ACROSS_MAX_REGISTERS, NORM_ACROSS_MAX_THREADS,
        NORM_GRAD_MAX_REGISTERS, NORM_GRAD_MAX_THREADS, NORM_GRAD_WEIGHTS_THREADS,
        NormAcrossKernelName, NormGradKernelName,
    };
    if let Some(k) = FusedKernelName::from_symbol(symbol)
        && let Some(regs) = k.token_heads_registers()
    {
        let threads = k.max_block_threads();
        return format!(".maxntid {threads}, 1, 1\n.maxnreg {regs}\n");
    }
    if NormGradKernelName::WEIGHTS.contains(&symbol) {
        return format!(".maxntid {NORM_GRAD_WEIGHTS_THREADS}, 1, 1\n");
    }
    if NormAcrossKernelName::ALL
        .iter()
        .any(|k| k.symbol() == symbol)
    {
        return format!(
            ".maxntid {NORM_ACROSS_MAX_THREADS}, 1, 1\n.maxnreg {NORM_ACROSS_MAX_REGISTERS}\n"
        );
    }
    if NormGradKernelName::ALL.iter().any(|k| k.symbol() == symbol) {
        return format!(
            ".maxntid {NORM_GRAD_MAX_THREADS}, 1, 1\n.maxnreg {NORM_GRAD_MAX_REGISTERS}\n"
        );
    }
    format!(
        ".maxntid {BLOCK_THREADS}, 1, 1\n.minnctapersm {}\n",
        min_blocks_per_sm(symbol)
    )
}

/// The `.minnctapersm` of the entry point `symbol`.
fn min_blocks_per_sm(symbol: &str) -> u32 {
    use rope_kernels::abi::{KernelName, MIN_BLOCKS_PER_SM};
    KernelName::ALL
        .into_iter()
        .find(|k| k.symbol() == symbol)
        .map_or(MIN_BLOCKS_PER_SM, KernelName::min_blocks_per_sm)
}

/// Rejects PTX that would fail to load or run slowly: unresolved functions, panic machinery,
/// local memory (arrays the compiler could not keep in registers), missing entry points.
fn validate(ptx: &str) -> Result<()> {
    for (needle, why) in [
        (
            ".extern",
            "an unresolved external function (a core call that was not inlined)",
        ),
        (
            "panic",
            "panic machinery (a check that was not proven away)",
        ),
        (
            ".local",
            "local memory (an array indexed at run time, or a spill)",
        ),
    ] {
        // The one `.extern` allowed: the rows kernels' dynamic shared memory.
        let allowed = |l: &str| l.trim_start().starts_with(".extern .shared");
        if let Some(line) = ptx.lines().find(|l| l.contains(needle) && !allowed(l)) {
            bail!("the PTX contains {why}: `{}`", line.trim());
        }
    }
    for symbol in rope_kernels::abi::all_symbols() {
        let entry = format!(".visible .entry {symbol}(");
        ensure!(
            ptx.contains(&entry),
            "the PTX lacks the entry point {symbol}"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{entries_only, launch_bounds, min_blocks_per_sm, with_launch_bounds};
    use rope_kernels::abi::{
        BLOCK_THREADS, FusedKernelName, KernelName, Mapping, PtxBuild, all_symbols,
        takes_dependent_launch,
    };

    /// An entry point as rustc writes it: name, parameter list, body.
    fn entry(name: &str) -> String {
        format!(".visible .entry {name}(\n\t.param .u64 {name}_param_0\n)\n{{\n\tret;\n}}\n")
    }

    /// What `with_launch_bounds` should make of [`entry`] with the directives `bounds`.
    fn bounded(name: &str, bounds: &str) -> String {
        format!(
            ".visible .entry {name}(\n\t.param .u64 {name}_param_0\n)\n{bounds}{{\n\tret;\n}}\n"
        )
    }

    #[test]
    fn the_partial_builds_keep_the_header_and_exactly_their_entries() {
        let header = ".version 8.1\n.target sm_89\n.address_size 64\n";
        let ptx: String = std::iter::once(header.to_string())
            .chain(all_symbols().map(entry))
            .collect();
        // The fused kernels but the item-loop ones.
        let fused: String = std::iter::once(header.to_string())
            .chain(
                FusedKernelName::ALL
                    .iter()
                    .filter(|k| !matches!(k.mapping, Mapping::ItemLoop(_)))
                    .map(|k| entry(k.symbol())),
            )
            .collect();
        assert_eq!(entries_only(&ptx, PtxBuild::Sm89), fused);
        assert!(fused.contains(".entry rope_fused_neox_theta_bf16_two_heads("));
        assert!(fused.contains(".entry rope_fused_neox_theta_bf16_four_heads("));
        assert!(fused.contains(".entry rope_fused_neox_theta_bf16_four_heads_nvfp4("));
        assert!(!fused.contains(".entry rope_fused_neox_theta_bf16("));
        assert!(!fused.contains(".entry rope_fused_neox_theta_bf16_narrow("));
        let dependent = entries_only(&ptx, PtxBuild::Sm90);
        let kept: Vec<&str> = dependent
            .lines()
            .filter_map(|l| l.strip_prefix(".visible .entry "))
            .map(|l| l.split('(').next().unwrap_or_default())
            .collect();
        // The one-head kernels, then the fused ones, in the full build's order.
        let want: Vec<&str> = all_symbols()
            .filter(|s| takes_dependent_launch(s))
            .collect();
        assert_eq!(kept, want);
        let one_head = KernelName::ALL
            .iter()
            .filter(|k| k.mapping == Mapping::ONE_HEAD);
        let fused = FusedKernelName::ALL
            .iter()
            .filter(|k| !matches!(k.mapping, Mapping::ItemLoop(_)));
        assert_eq!(kept.len(), one_head.count() + fused.count());
        assert!(kept.contains(&"rope_neox_table_bf16_one_head"));
        assert!(kept.contains(&"rope_fused_neox_table_bf16_two_heads"));
        assert!(!kept.contains(&"rope_neox_table_bf16"));
        assert!(!kept.contains(&"rope_fused_neox_table_bf16_narrow"));
        assert!(!kept.contains(&"rope_fused_neox_table_bf16"));
        assert!(dependent.starts_with(header));
    }

    #[test]
    fn every_entry_gets_the_bounds_its_kernel_name_asks_for() {
        let ptx: String = all_symbols().map(entry).collect();
        let want: String = all_symbols()
            .map(|s| bounded(s, &launch_bounds(s)))
            .collect();
        assert_eq!(with_launch_bounds(&ptx), want);
        // The fused token-heads kernels: blocks of up to five warps; 48 registers for the NeoX
        // 16-bit two-heads ones, 64 for the others; the fused item loops 1024
        // threads resident.
        for (symbol, bounds) in [
            (
                "rope_fused_neox_theta_bf16_two_heads",
                ".maxntid 160, 1, 1\n.maxnreg 48\n",
            ),
            (
                "rope_fused_neox_table_f16_two_heads",
                ".maxntid 160, 1, 1\n.maxnreg 48\n",
            ),
            (
                "rope_fused_neox_theta_bf16_four_heads",
                ".maxntid 160, 1, 1\n.maxnreg 64\n",
            ),
            (
                "rope_fused_neox_table_f16_four_heads",
                ".maxntid 160, 1, 1\n.maxnreg 64\n",
            ),
            (
                "rope_fused_interleaved_theta_bf16_two_heads",
                ".maxntid 160, 1, 1\n.maxnreg 64\n",
            ),
            (
                "rope_fused_neox_theta_f32_two_heads",
                ".maxntid 160, 1, 1\n.maxnreg 64\n",
            ),
            (
                "rope_fused_neox_theta_bf16",
                ".maxntid 128, 1, 1\n.minnctapersm 8\n",
            ),
        ] {
            assert_eq!(launch_bounds(symbol), bounds, "{symbol}");
        }
        // The wide NeoX 16-bit kernels keep 1280 threads resident, f16 computed excepted; the
        // others 1024.
        for (symbol, threads) in [
            ("rope_neox_table_bf16", 1280),
            ("rope_neox_theta_bf16", 1280),
            ("rope_neox_table_f16", 1280),
            ("rope_neox_theta_f16", 1024),
            ("rope_neox_table_bf16_narrow", 1024),
            ("rope_interleaved_table_bf16", 1024),
            ("rope_table", 1024),
        ] {
            assert_eq!(
                min_blocks_per_sm(symbol) * BLOCK_THREADS,
                threads,
                "{symbol}"
            );
        }
    }
}
