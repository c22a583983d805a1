//! `cargo xtask conformance [--full]`: checks petite's outputs with software nobody here wrote
//! (ExecuTorch's runtime and deserializer, lerobot's PyTorch PI05, ONNX Runtime, TensorRT-RTX's
//! parser and builder), each in a venv under target/.
//! One module per tier so they grow independently.

use anyhow::Result;

use crate::util;

mod lerobot;
mod onnx;
mod portable;
mod pte;
mod tensorrt;
mod weights;

/// Options of the conformance task.
#[derive(clap::Args, Default)]
pub struct Args {
    /// Also run the heavy tier (executorch==1.5.1 with torch, ~5 GB install).
    #[arg(long)]
    pub full: bool,
    /// Rewrite testdata/pi05 from lerobot instead of checking it (then review the diff).
    #[arg(long)]
    pub bless_lerobot: bool,
}

/// Runs every conformance tier.
pub fn run(args: &Args) -> Result<()> {
    lerobot::run(args.bless_lerobot)?;
    pte::run(args.full)?;
    weights::run()?;
    onnx::run()?;
    portable::run(args.full)?;
    tensorrt::run()?;
    if args.full {
        // The exporter's own .pte files (TensorRT-style delegates over named data), on a small
        // golden, through ExecuTorch 1.5.1's deserialize_pte_binary (the pte tier made its venv).
        util::cargo(&[
            "run",
            "-q",
            "-p",
            "xtask",
            "--",
            "export-pi05",
            "--small",
            "--executorch-check",
        ])?;
    }
    Ok(())
}
