//! The ONNX tier for petite-engine's `tensorrt` backend, in the `onnx` venv (onnx, onnxruntime,
//! numpy): for small pi0.5 configs (f32 and bf16 programs, prefix, step, and the prefix with its
//! token embedding forced into 16-row shards), every planned engine is emitted as ONNX in both
//! flavours (TensorRT's and the f32 twin); every model must pass
//! `onnx.checker.check_model(full_check=True)` with its weights as external data in the bf16
//! mapping file, and the twin run by ONNX Runtime on CPU must match the reference executor's
//! outputs for that engine within 1e-4 (bf16 outputs: elements 1–2 bf16 ulps apart are counted
//! and reported, see the script). No TensorRT is involved.

use std::process::Command;

use anyhow::Result;

use crate::util;

const SCRIPT: &str = "xtask/src/conformance/onnx_check.py";

/// The venv's packages.
pub const REQUIREMENTS: &[&str] = &["onnx==1.23.2", "onnxruntime==1.31.1", "numpy==2.5.5"];

/// Runs the tier.
pub fn run() -> Result<()> {
    let root = util::root();
    let python = util::venv("onnx", REQUIREMENTS)?;
    let dir = root.join("target").join("onnx-conformance");
    let dir_s = dir.display().to_string();
    util::cargo(&[
        "run",
        "--release",
        "--quiet",
        "-p",
        "petite-engine",
        "--example",
        "onnx_cases",
        "--",
        &dir_s,
    ])?;
    util::run(Command::new(&python).arg(root.join(SCRIPT)).arg(&dir))?;
    Ok(())
}
