//! `cargo xtask bench <what>`: whole-process benchmarks run under `memcap`, each reporting its
//! figures as ratios against a floor measured in the same run. One module per benchmark.

use anyhow::Result;

/// The benchmarks.
#[derive(clap::Subcommand)]
pub enum BenchCmd {}

/// Runs one benchmark.
pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {}
}
