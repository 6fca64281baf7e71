//! `cargo xtask ptx [--check]`.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};

use crate::{cargo, root};

/// Flags for every crate of the PTX build, `core` included, so they all agree.
const RUSTFLAGS: &str = "-Zunstable-options -Cpanic=immediate-abort -Ctarget-cpu=sm_80";
const TARGET: &str = "nvptx64-nvidia-cuda";
/// The committed PTX, embedded by `rope-host`.
pub const PTX_PATH: &str = "rope-host/ptx/kernels.ptx";

pub fn run(check: bool) -> Result<()> {
    let ptx = build()?;
    let path = root().join(PTX_PATH);
    if check {
        let committed =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        ensure!(
            committed == ptx,
            "{PTX_PATH} is stale: it does not match rope-kernels's source; run `cargo xtask ptx` and commit it"
        );
        println!("{PTX_PATH} is up to date ({} lines)", ptx.lines().count());
    } else {
        fs::write(&path, &ptx).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {PTX_PATH} ({} lines)", ptx.lines().count());
    }
    Ok(())
}

/// Builds the kernel crate to PTX and returns the checked text.
fn build() -> Result<String> {
    let target_dir = root().join("target").join("ptx");
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
        .env("RUSTFLAGS", RUSTFLAGS)
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .status()
        .context("running cargo for the PTX build")?;
    ensure!(status.success(), "the PTX build failed");
    let deps = target_dir.join(TARGET).join("release").join("deps");
    let ptx = fs::read_to_string(newest_asm(&deps)?)?;
    validate(&ptx)?;
    Ok(with_launch_bounds(&ptx))
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

/// Adds `.maxntid BLOCK_THREADS, 1, 1` and `.minnctapersm` (the kernel's
/// [`KernelName::min_blocks_per_sm`], [`MIN_BLOCKS_PER_SM`] for the table builders) to every
/// entry point, between its parameter list and its body: the launch bounds rustc cannot
/// express.
///
/// [`KernelName::min_blocks_per_sm`]: rope_kernels::abi::KernelName::min_blocks_per_sm
/// [`MIN_BLOCKS_PER_SM`]: rope_kernels::abi::MIN_BLOCKS_PER_SM
fn with_launch_bounds(ptx: &str) -> String {
    use rope_kernels::abi::BLOCK_THREADS;
    let mut out = String::with_capacity(ptx.len() + 4096);
    let mut blocks = None;
    for line in ptx.lines() {
        out.push_str(line);
        out.push('\n');
        if let Some(rest) = line.strip_prefix(".visible .entry ") {
            blocks = Some(min_blocks_per_sm(
                rest.split('(').next().unwrap_or_default(),
            ));
        } else if let (Some(n), ")") = (blocks, line.trim()) {
            out.push_str(&format!(
                ".maxntid {BLOCK_THREADS}, 1, 1\n.minnctapersm {n}\n"
            ));
            blocks = None;
        }
    }
    out
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
        if let Some(line) = ptx.lines().find(|l| l.contains(needle)) {
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
    use super::{min_blocks_per_sm, with_launch_bounds};
    use rope_kernels::abi::{BLOCK_THREADS, all_symbols};

    /// An entry point as rustc writes it: name, parameter list, body.
    fn entry(name: &str) -> String {
        format!(".visible .entry {name}(\n\t.param .u64 {name}_param_0\n)\n{{\n\tret;\n}}\n")
    }

    /// What `with_launch_bounds` should make of [`entry`] with `blocks` per multiprocessor.
    fn bounded(name: &str, blocks: u32) -> String {
        format!(
            ".visible .entry {name}(\n\t.param .u64 {name}_param_0\n)\n\
             .maxntid {BLOCK_THREADS}, 1, 1\n.minnctapersm {blocks}\n{{\n\tret;\n}}\n"
        )
    }

    #[test]
    fn every_entry_gets_the_bounds_its_kernel_name_asks_for() {
        let ptx: String = all_symbols().map(entry).collect();
        let want: String = all_symbols()
            .map(|s| bounded(s, min_blocks_per_sm(s)))
            .collect();
        assert_eq!(with_launch_bounds(&ptx), want);
        // The wide NeoX 16-bit kernels keep 1280 threads resident, f16 computed excepted; the
        // others 1024.
        for (symbol, threads) in [
            ("rope_neox_table_fwd_bf16", 1280),
            ("rope_neox_theta_bwd_bf16", 1280),
            ("rope_neox_table_fwd_f16", 1280),
            ("rope_neox_theta_fwd_f16", 1024),
            ("rope_neox_table_fwd_bf16_narrow", 1024),
            ("rope_interleaved_table_fwd_bf16", 1024),
            ("rope_table_bf16", 1024),
        ] {
            assert_eq!(
                min_blocks_per_sm(symbol) * BLOCK_THREADS,
                threads,
                "{symbol}"
            );
        }
    }
}
