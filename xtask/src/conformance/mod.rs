//! `cargo xtask conformance [--full]`: checks petite's outputs with software nobody here wrote
//! (ExecuTorch's runtime and deserializer, lerobot's PyTorch PI05), each in a venv under target/.
//! One module per tier so they grow independently.

use anyhow::Result;

mod pte;

/// Options of the conformance task.
#[derive(clap::Args)]
pub struct Args {
    /// Also run the heavy tier (executorch==1.5.1 with torch, ~5 GB install).
    #[arg(long)]
    pub full: bool,
}

/// Runs every conformance tier.
pub fn run(args: &Args) -> Result<()> {
    pte::run(args.full)?;
    Ok(())
}
