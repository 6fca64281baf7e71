//! Project tasks: `cargo xtask ptx [--check]`, `cargo xtask gpu-bundle`, `cargo xtask bench`,
//! `cargo xtask bench-table`.
//!
//! - `ptx` builds `rope-kernels` for `nvptx64-nvidia-cuda` with the pinned nightly
//!   (`-Zbuild-std=core`, `--emit=asm`, immediate-abort panics, `sm_80`), checks the result,
//!   adds the launch bounds rustc cannot express (`.maxntid`, `.minnctapersm`) and writes
//!   `rope-host/ptx/kernels.ptx` (and the sm_89 and sm_90 builds' files) with the
//!   zstd-compressed copy of each that `rope-host` embeds; `--check` fails if a committed file
//!   differs.
//! - `sass` compiles the committed PTX to cubins with the pinned ptxas from PyPI, checks that
//!   each holds its entry points and writes them zstd-compressed into `rope-host/sass/`
//!   (ignored by git, packaged with the crate and the wheel).
//! - `gpu-bundle` builds every test executable and the demo in release mode and gathers them
//!   with a runner script in `gpu-bundle/`, to copy to a GPU machine without Rust; the bundle
//!   also holds `rope-bench`, and the Python wheel with its tests and runner (`python/run.sh`)
//!   when the wheel was built.
//! - `bench [--json PATH]` builds and runs the benchmark (`src/bin/rope-bench.rs`) on this
//!   machine's GPU.
//! - `bench-table [--json PATH] [--check]` writes the README's benchmark table from a committed
//!   `rope-bench` JSON report (the one its begin marker names, unless `--json` names another);
//!   `--check` fails if the README differs.

mod bench_table;
mod bundle;
mod ptx;
mod sass;

use std::path::PathBuf;

use anyhow::{Result, bail};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["ptx"] => ptx::run(false),
        ["ptx", "--check"] => ptx::run(true),
        ["sass"] => sass::run(),
        ["gpu-bundle"] => bundle::run(),
        ["bench", rest @ ..] => bench(rest),
        ["bench-table", rest @ ..] => bench_table::run(rest),
        _ => bail!(
            "usage: cargo xtask ptx [--check] | cargo xtask sass | cargo xtask gpu-bundle | cargo xtask bench [--json PATH] \
             | cargo xtask bench-table [--json PATH] [--check]"
        ),
    }
}

/// Builds and runs `rope-bench` in release mode with `args`.
fn bench(args: &[&str]) -> Result<()> {
    ptx::run(true)?;
    let status = cargo()
        .args([
            "run",
            "--release",
            "--package",
            "rope-demo",
            "--bin",
            "rope-bench",
            "--",
        ])
        .args(args)
        .status()?;
    anyhow::ensure!(status.success(), "rope-bench failed");
    Ok(())
}

/// The workspace root (the parent of this crate's directory).
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

/// The `cargo` that runs this task (the pinned toolchain's, through rustup).
fn cargo() -> std::process::Command {
    let mut c =
        std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}
