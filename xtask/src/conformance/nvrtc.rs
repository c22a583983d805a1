//! The nvrtc tier: NVIDIA's runtime compiler (the `nvidia-cuda-nvrtc` wheel from PyPI, in a venv
//! under target/; no GPU, no driver) compiles the CUDA C that petite-cuda generates — its fixed
//! kernel module and every fused kernel of pi0.5's full-size bf16 and f32 programs — to machine
//! code for the H200 (`sm_90`) and Jetson Orin (`sm_87`), with the runtime's options. It runs
//! petite-cuda's ignored tests `nvrtc_compiles_every_generated_source_for_sm90_and_sm87` and
//! `concurrent_requests_for_one_source_compile_it_once` with the wheel's library directory on
//! the loader's path.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util;

/// Pinned: NVRTC 13.5 (petite-cuda loads CUDA 13 libraries).
pub const REQUIREMENTS: &[&str] = &["nvidia-cuda-nvrtc==13.5.37"];

/// The directory holding `libnvrtc.so.13` inside the venv.
fn nvrtc_dir(venv_python: &Path) -> Result<PathBuf> {
    let venv = venv_python
        .parent()
        .and_then(Path::parent)
        .context("venv python has no venv directory")?;
    let lib = venv.join("lib");
    for py in std::fs::read_dir(&lib).with_context(|| format!("reading {}", lib.display()))? {
        let dir = py?.path().join("site-packages/nvidia/cu13/lib");
        if dir.join("libnvrtc.so.13").exists() {
            return Ok(dir);
        }
    }
    bail!("no libnvrtc.so.13 under {}", lib.display())
}

/// The directory holding the pinned `libnvrtc.so.13`, its venv made first if missing.
pub(crate) fn lib_dir() -> Result<PathBuf> {
    nvrtc_dir(&super::Venv::Nvrtc.python()?)
}

/// Runs the tier.
pub fn run() -> Result<()> {
    let dir = lib_dir()?;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    util::run(
        Command::new(cargo)
            .args(["test", "--workspace", "--lib", "--"])
            .args(["--ignored", "--exact", "--nocapture"])
            .arg("device::tests::nvrtc_compiles_every_generated_source_for_sm90_and_sm87")
            .arg("device::tests::concurrent_requests_for_one_source_compile_it_once")
            .env("LD_LIBRARY_PATH", &dir)
            .current_dir(util::root()),
    )?;
    eprintln!("nvrtc tier: passed (NVRTC from {})", dir.display());
    Ok(())
}
