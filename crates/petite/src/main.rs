//! The `petite` command line. Each subcommand lives in its own module under `cli/`.
use clap::{Parser, Subcommand};

mod cli;

/// petite: compile pi0.5 into ExecuTorch `.pte` programs in bounded memory.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Convert a checkpoint to a bf16/f16 safetensors mapping file in bounded memory.
    Convert(cli::convert::ConvertArgs),
    /// pi0.5 tools: synthetic checkpoints, reference runs.
    #[command(subcommand)]
    Pi05(cli::pi05::Pi05Cmd),
    /// Verify a .pte and list its methods, delegates, named data and segments.
    Inspect(cli::inspect::InspectArgs),
    /// Partition a pi0.5 program into engines under a per-engine weight cap (shapes only).
    Plan(cli::plan::PlanArgs),
    /// Export pi0.5 to prefix.pte + step.pte in bounded memory.
    Export(cli::export::ExportArgs),
    /// Lower one pi0.5 program to a portable ExecuTorch .pte (kernel calls, no delegate).
    Lower(cli::lower::LowerArgs),
    /// Run an export's .pte files and compare with the f32 reference (separate process).
    Verify(cli::verify::VerifyArgs),
    /// What this machine offers: the GPU the CUDA driver reports, the TensorRT builder found.
    Doctor(cli::doctor::DoctorArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Convert(a) => cli::convert::run(a),
        Cmd::Pi05(c) => cli::pi05::run(c),
        Cmd::Inspect(a) => cli::inspect::run(a),
        Cmd::Plan(a) => cli::plan::run(a),
        Cmd::Export(a) => cli::export::run(a),
        Cmd::Verify(a) => cli::verify::run(a),
        Cmd::Lower(a) => cli::lower::run(a),
        Cmd::Doctor(a) => cli::doctor::run(a),
    }
}
