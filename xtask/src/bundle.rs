//! `cargo xtask gpu-bundle`: release test executables, the demo, the benchmark and a runner in
//! one folder.

use std::fs;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{Context, Result, ensure};

use crate::{cargo, root};

/// What may travel to the GPU machine in one call.
const MAX_BYTES: u64 = 64 * 1024 * 1024;

const RUNNER: &str = r#"#!/bin/sh
# Runs every bundled test executable, then the demo, on a GPU machine with no Rust toolchain.
# ROPE_REQUIRE_GPU=1 turns "no GPU, skipped" into a failure, so the GPU tests cannot pass
# without running. Exits non-zero if anything failed.
#
# run.sh --sanitize [TOOL...]: runs the tests (not the demo) under compute-sanitizer with each
# TOOL (default: memcheck), failing on any reported error; ROPE_GPU_CASES (default 300 there)
# caps the random cases of each GPU property test, since the sanitizer slows kernels by orders
# of magnitude.
cd "$(dirname "$0")" || exit 1
export ROPE_REQUIRE_GPU=1
status=0
if [ "$1" = "--sanitize" ]; then
    shift
    tools=${*:-memcheck}
    export ROPE_GPU_CASES=${ROPE_GPU_CASES:-300}
    for tool in $tools; do
        for t in tests/*; do
            echo "== compute-sanitizer --tool $tool $t"
            compute-sanitizer --tool "$tool" --error-exitcode 1 --print-limit 20 \
                --require-cuda-init no "$t" --test-threads=1 || status=1
        done
    done
    echo "== bundle exit status: $status"
    exit $status
fi
for t in tests/*; do
    echo "== $t"
    "$t" --test-threads=4 || status=1
done
echo "== rope-demo"
./rope-demo || status=1
echo "== bundle exit status: $status"
exit $status
"#;

pub fn run() -> Result<()> {
    crate::ptx::run(true).context("the committed PTX must match the kernels before bundling")?;
    let out = root().join("gpu-bundle");
    if out.exists() {
        fs::remove_dir_all(&out)?;
    }
    fs::create_dir_all(out.join("tests"))?;

    let tests = executables(&[
        "test",
        "--workspace",
        "--exclude",
        "xtask",
        "--release",
        "--no-run",
    ])?;
    for exe in &tests {
        copy(exe, &out.join("tests"))?;
    }
    let bins = executables(&["build", "--release", "--package", "rope-demo", "--bins"])?;
    for name in ["rope-demo", "rope-bench"] {
        let exe = bins
            .iter()
            .find(|p| p.file_stem().is_some_and(|s| s == name))
            .with_context(|| format!("the build produced no {name} executable: {bins:?}"))?;
        copy(exe, &out)?;
    }

    let runner = out.join("run.sh");
    fs::write(&runner, RUNNER)?;
    make_executable(&runner)?;

    let total = dir_size(&out)?;
    ensure!(
        total < MAX_BYTES,
        "gpu-bundle is {total} bytes, over the {MAX_BYTES}-byte limit"
    );
    println!(
        "gpu-bundle/: {} test executables, rope-demo and rope-bench, {:.1} MiB; on the GPU machine run gpu-bundle/run.sh (tests, demo), gpu-bundle/rope-bench (benchmark)",
        tests.len(),
        total as f64 / (1024.0 * 1024.0)
    );
    Ok(())
}

/// Runs a cargo build command and returns the executables it produced.
fn executables(args: &[&str]) -> Result<Vec<PathBuf>> {
    let mut child = cargo()
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .stdout(Stdio::piped())
        .spawn()
        .context("running cargo")?;
    let stdout = child.stdout.take().context("cargo's stdout")?;
    let mut found = Vec::new();
    for line in std::io::BufReader::new(stdout).lines() {
        let msg: serde_json::Value = serde_json::from_str(&line?)?;
        if let ("compiler-artifact", Some(exe)) = (
            msg["reason"].as_str().unwrap_or_default(),
            msg["executable"].as_str(),
        ) {
            found.push(PathBuf::from(exe));
        }
    }
    ensure!(child.wait()?.success(), "cargo {} failed", args.join(" "));
    Ok(found)
}

fn copy(exe: &Path, dir: &Path) -> Result<()> {
    let name = exe.file_name().context("executable without a name")?;
    fs::copy(exe, dir.join(name)).with_context(|| format!("copying {}", exe.display()))?;
    Ok(())
}

#[cfg(unix)]
fn make_executable(path: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))?;
    Ok(())
}

#[cfg(not(unix))]
fn make_executable(_: &Path) -> Result<()> {
    Ok(())
}

fn dir_size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            dir_size(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}
