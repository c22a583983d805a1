//! The `petite` command line.
use clap::Parser;

/// petite: compile pi0.5 into ExecuTorch `.pte` programs in bounded memory.
#[derive(Parser)]
#[command(version, about)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    Ok(())
}
