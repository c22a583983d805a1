//! Project automation: `cargo xtask <command>`. Automation only; the work lives in the crates.
//! One module per task so tasks grow independently.

mod bench;
mod codegen;
mod conformance;
mod export_pi05;
mod util;

use anyhow::Result;
use clap::{Parser, Subcommand};

/// petite's automation tasks.
#[derive(Parser)]
#[command(
    about = "petite automation: the whole test suite, code generation, conformance, benches, the pi0.5 export"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Every check CI runs: rustfmt, clippy (-D warnings), all tests, and the conformance tier
    /// against real ExecuTorch / lerobot software in venvs under target/.
    Ci,
    /// Conformance against real ExecuTorch and lerobot software (venvs under target/).
    Conformance(conformance::Args),
    /// Whole-process benchmarks under memcap.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Regenerate petite-pte's flatbuffers code from the vendored schema (`--check`: fail if stale).
    Codegen(codegen::Args),
    /// The whole pi0.5 export (synthesized full-size checkpoint by default), verified.
    ExportPi05(export_pi05::Args),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Ci => ci(),
        Cmd::Conformance(a) => conformance::run(&a),
        Cmd::Bench(b) => bench::run(b),
        Cmd::Codegen(a) => codegen::run(&a),
        Cmd::ExportPi05(a) => export_pi05::run(&a),
    }
}

fn ci() -> Result<()> {
    util::cargo(&["fmt", "--all", "--", "--check"])?;
    util::cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    util::cargo(&["test", "--workspace"])?;
    conformance::run(&conformance::Args::default())?;
    Ok(())
}
