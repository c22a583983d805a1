//! `cargo xtask bench nvrtc`: NVRTC's own time for the kernel sources a cold full-size pi0.5 run
//! on a GPU compiles (`examples/nvrtc_bench.rs`: `pi05 run --dtype bf16`'s and a bf16 export's
//! `verify`'s, each under the plan before session 25, today's, and today's with rolled rows
//! (the default before issue 49), alternating a round at a time), with the pinned libnvrtc
//! from PyPI (the nvrtc tier's venv) — no GPU needed. What an empty kernel cache costs before a program's first launch.

use std::process::Command;

use anyhow::Result;

use crate::util;

/// Options of the NVRTC benchmark.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Target architecture: `sm_90` (H100/H200) or `sm_87` (Jetson Orin).
    #[arg(long, default_value = "sm_90")]
    pub arch: String,
    /// Rounds of every plan, the order reversed every other round.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
}

/// Runs the benchmark.
pub fn run(a: &Args) -> Result<()> {
    let lib = crate::conformance::nvrtc::lib_dir()?;
    util::cargo(&[
        "build",
        "--release",
        "-p",
        "petite",
        "--example",
        "nvrtc_bench",
    ])?;
    let exe = util::target_dir()
        .join("release")
        .join("examples")
        .join("nvrtc_bench");
    util::run(
        Command::new(exe)
            .args(["--arch", &a.arch, "--rounds", &a.rounds.to_string()])
            .env("LD_LIBRARY_PATH", &lib)
            .current_dir(util::root()),
    )
}
