//! `cargo xtask gpu-bundle`: release test executables, the demo, the benchmark and a runner in
//! one folder; with the Python package's wheel, tests, benchmark and runner in `python/` when
//! the wheel was built (the README's Set up commands). The executables travel compressed with
//! `xz` (each embeds the PTX text, which compresses about tenfold); `run.sh` unpacks them.

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
#
# run.sh --unpack: only unpacks the executables (each travels as NAME.xz; every mode unpacks
# first), for running rope-bench or one test executable by hand.
#
# run.sh --quick: the same tests with fewer random cases (ROPE_GPU_CASES, default 24 here, 8 on
# the older builds) and 8 test threads, and no demo: every test and kernel choice reached in a
# few minutes of a short device session, as a first pass before the full run.
cd "$(dirname "$0")" || exit 1
for packed in rope-bench.xz rope-demo.xz tests/*.xz; do
    [ -f "$packed" ] || continue
    [ -f "${packed%.xz}" ] || xz --decompress --keep "$packed" || exit 1
    chmod +x "${packed%.xz}"
done
[ "$1" = "--unpack" ] && exit 0
export ROPE_REQUIRE_GPU=1
status=0
executables=$(ls tests/* | grep -v '\.xz$')
threads=4
older_cases=${ROPE_GPU_CASES:-}
if [ "$1" = "--quick" ]; then
    threads=8
    export ROPE_GPU_CASES=${ROPE_GPU_CASES:-24}
    older_cases=${older_cases:-8}
fi
if [ "$1" = "--sanitize" ]; then
    shift
    tools=${*:-memcheck}
    export ROPE_GPU_CASES=${ROPE_GPU_CASES:-300}
    for tool in $tools; do
        for t in $executables; do
            echo "== compute-sanitizer --tool $tool $t"
            compute-sanitizer --tool "$tool" --error-exitcode 1 --print-limit 20 \
                --require-cuda-init no "$t" --test-threads=1 || status=1
        done
    done
    echo "== bundle exit status: $status"
    exit $status
fi
# The fused tests spread their random cases over handles pinned to every fused kernel choice
# (the item loop, two and four heads per thread, the rows kernels), so one run reaches them all.
for t in $executables; do
    echo "== $t"
    "$t" --test-threads=$threads || status=1
done
# The fused kernels' tests (and the programmatic-launch chains, then ordered) again on the older
# builds a newer device otherwise never loads: sm_89's (hardware FP8 stores, no grid dependency
# control) and sm_80's (FP8 stores rounded in software).
for arch in sm_89 sm_80; do
    for t in $executables; do
        echo "== ROPE_PTX_ARCH=$arch $t fused programmatic"
        ROPE_PTX_ARCH=$arch ROPE_GPU_CASES=${older_cases:-$ROPE_GPU_CASES} \
            "$t" --test-threads=$threads fused programmatic || status=1
    done
done
if [ "$1" != "--quick" ]; then
    echo "== rope-demo"
    ./rope-demo || status=1
fi
echo "== bundle exit status: $status"
exit $status
"#;

const PYTHON_RUNNER: &str = r#"#!/bin/sh
# Runs the Python package's tests on a GPU machine without network access, with $PYTHON
# (default python3), which must have torch (transformers is used where present): `pip install
# --target` of the bundled wheel (no index, no dependencies) into a fresh folder put on
# PYTHONPATH, with $PYTHON's own pip or, when it has none (virtual environments made by uv), the
# pip of a throwaway venv made from it. pytest comes from $PYTHON, else from the bundled wheels.
# Without any pip the wheel is unzipped there instead (said so). ROPE_REQUIRE_GPU=1 makes a
# missing GPU or torch fail the GPU tests rather than skip them. Extra arguments go to pytest.
#
# python/run.sh --bench [ARGS]: runs python/bench.py instead (rope_rs against copy_).
# python/run.sh --first-call: runs python/first_call.py (a fresh process's first apply_rope).
cd "$(dirname "$0")" || exit 1
PYTHON=${PYTHON:-python3}
site=$(mktemp -d) || exit 1
pip=""
if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    pip="$PYTHON"
elif "$PYTHON" -m venv "$site.venv" 2>/dev/null && "$site.venv/bin/python" -m pip --version >/dev/null 2>&1; then
    pip="$site.venv/bin/python"
fi
wheels=rope_rs-*.whl
"$PYTHON" -c "import pytest" 2>/dev/null || wheels="$wheels wheels/*.whl"
if [ -n "$pip" ]; then
    # shellcheck disable=SC2086
    "$pip" -m pip install --quiet --no-index --no-deps --target "$site" $wheels || exit 1
    echo "pip installed $(ls rope_rs-*.whl) into $site"
else
    echo "no pip for $PYTHON: unzipping the wheels onto PYTHONPATH instead"
    for wheel in $wheels; do
        [ -f "$wheel" ] && { "$PYTHON" -m zipfile -e "$wheel" "$site" || exit 1; }
    done
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" ROPE_REQUIRE_GPU=1
if [ "$1" = "--bench" ]; then
    shift
    exec "$PYTHON" bench.py "$@"
fi
if [ "$1" = "--first-call" ]; then
    exec "$PYTHON" first_call.py
fi
exec "$PYTHON" -m pytest tests -q -p no:cacheprovider "$@"
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

    pack(&out)?;
    let runner = out.join("run.sh");
    fs::write(&runner, RUNNER)?;
    make_executable(&runner)?;
    let python = python(&out.join("python"))?;

    let total = dir_size(&out)?;
    ensure!(
        total < MAX_BYTES,
        "gpu-bundle is {total} bytes, over the {MAX_BYTES}-byte limit"
    );
    println!(
        "gpu-bundle/: {} test executables, rope-demo and rope-bench{}, {:.1} MiB; on the GPU machine run gpu-bundle/run.sh (tests, demo), gpu-bundle/run.sh --unpack then gpu-bundle/rope-bench (benchmark){}",
        tests.len(),
        if python {
            ", the Python wheel and tests"
        } else {
            ""
        },
        total as f64 / (1024.0 * 1024.0),
        if python {
            ", PYTHON=/path/to/python-with-torch gpu-bundle/python/run.sh [--bench]"
        } else {
            ""
        }
    );
    Ok(())
}

/// Builds the Python package's wheel now, with the README's command (maturin from
/// `target/ci-venv`, into a fresh `target/wheels`), and gathers it, its tests, its benchmark,
/// pytest's wheels (downloaded with `target/ci-venv`'s pip, for machines without pytest) and
/// `run.sh` in `dir`; `false`, with a note, without `target/ci-venv`'s maturin. A wheel built
/// earlier is never taken: it may embed other kernels than the executables beside it.
fn python(dir: &Path) -> Result<bool> {
    let venv = root().join("target/ci-venv/bin");
    if !venv.join("maturin").exists() {
        println!(
            "note: no maturin in {}: make it with the README's Set up commands to bundle the Python wheel and tests",
            venv.display()
        );
        return Ok(false);
    }
    let wheels = root().join("target/wheels");
    if wheels.exists() {
        fs::remove_dir_all(&wheels)?;
    }
    let path = std::env::join_paths(std::iter::once(venv.clone()).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))?;
    let status = std::process::Command::new(venv.join("maturin"))
        .current_dir(root())
        .env("PATH", path)
        .args([
            "build",
            "--release",
            "--zig",
            "--compatibility",
            "manylinux2014",
            "-m",
            "python/Cargo.toml",
            "-o",
        ])
        .arg(&wheels)
        .status()
        .context("running maturin")?;
    ensure!(status.success(), "maturin build failed: {status}");
    let wheel = fs::read_dir(&wheels)?
        .filter_map(|e| e.ok())
        .find(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("rope_rs-") && name.ends_with(".whl")
        })
        .with_context(|| format!("maturin wrote no rope_rs wheel in {}", wheels.display()))?;
    fs::create_dir_all(dir.join("tests"))?;
    copy(&wheel.path(), dir)?;
    copy(&root().join("python/bench.py"), dir)?;
    copy(&root().join("python/first_call.py"), dir)?;
    for entry in fs::read_dir(root().join("python/tests"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "py") {
            copy(&path, &dir.join("tests"))?;
        }
    }
    let pip = root().join("target/ci-venv/bin/python");
    let downloaded = pip.exists()
        && std::process::Command::new(&pip)
            .args([
                "-m",
                "pip",
                "download",
                "--quiet",
                "--only-binary=:all:",
                "--dest",
            ])
            .arg(dir.join("wheels"))
            .arg("pytest")
            .status()
            .is_ok_and(|s| s.success());
    if !downloaded {
        println!(
            "note: pytest's wheels not bundled (no {} or no network): python/run.sh needs pytest on the GPU machine",
            pip.display()
        );
    }
    let runner = dir.join("run.sh");
    fs::write(&runner, PYTHON_RUNNER)?;
    make_executable(&runner)?;
    Ok(true)
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

/// Compresses every executable in `dir` and `dir/tests` with `xz` (each `NAME` becomes
/// `NAME.xz`; `run.sh` unpacks them on the GPU machine).
fn pack(dir: &Path) -> Result<()> {
    let mut files = Vec::new();
    for d in [dir.to_path_buf(), dir.join("tests")] {
        for entry in fs::read_dir(&d)? {
            let path = entry?.path();
            if path.is_file() {
                files.push(path);
            }
        }
    }
    let status = std::process::Command::new("xz")
        .args(["--threads=0", "-6"])
        .args(&files)
        .status()
        .context("running xz to compress the bundle's executables (install xz-utils)")?;
    ensure!(status.success(), "xz failed on {files:?}");
    Ok(())
}

/// Copies the file `exe` into `dir` under its own name.
fn copy(exe: &Path, dir: &Path) -> Result<()> {
    let name = exe.file_name().context("a file without a name")?;
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
