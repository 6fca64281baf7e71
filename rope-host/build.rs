//! Embeds the compiled kernels of `sass/`, written by `cargo xtask sass` and packaged with the
//! crate (a git checkout has none: its kernels are JIT-compiled from the PTX). A module is
//! embedded only when the compressed PTX it was compiled from is, byte for byte (the manifest's
//! FNV-1a hash), the `ptx/*.ptx.zst` this crate embeds; stale ones are left out with a warning.
//!
//! Writes `$OUT_DIR/sass.rs`: an array expression of `crate::sass::Compiled`.

use std::error::Error;
use std::fmt::Write as _;
use std::fs;
use std::path::PathBuf;

/// FNV-1a, 64 bits (as `cargo xtask sass` writes it).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn main() -> Result<(), Box<dyn Error>> {
    println!("cargo:rerun-if-changed=sass");
    println!("cargo:rerun-if-changed=ptx");
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let mut code = String::from("[\n");
    if let Ok(manifest) = fs::read_to_string(dir.join("sass/manifest.txt")) {
        for line in manifest
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [ptx, hash, arch, bytes, file] = fields[..] else {
                println!("cargo:warning=sass/manifest.txt: malformed line {line:?}");
                continue;
            };
            let build = match ptx {
                "kernels.ptx.zst" => "Sm80",
                "kernels_sm89.ptx.zst" => "Sm89",
                "kernels_sm90.ptx.zst" => "Sm90",
                _ => {
                    println!("cargo:warning=sass/manifest.txt: unknown PTX {ptx}");
                    continue;
                }
            };
            let source = fs::read(dir.join("ptx").join(ptx))?;
            if format!("{:016x}", fnv1a64(&source)) != hash {
                println!(
                    "cargo:warning=sass/{file} was compiled from another {ptx}; left out (run `cargo xtask sass`)"
                );
                continue;
            }
            let arch: u32 = arch.trim_start_matches("sm_").parse()?;
            let bytes: usize = bytes.parse()?;
            let path = dir.join("sass").join(file);
            writeln!(
                code,
                "    crate::sass::Compiled {{ build: rope_kernels::abi::PtxBuild::{build}, arch: {arch}, bytes: {bytes}, zst: include_bytes!({path:?}) }},"
            )?;
        }
    }
    code.push(']');
    fs::write(out.join("sass.rs"), code)?;
    Ok(())
}
