//! The safetensors tier for petite-weights, in the `weights` venv (safetensors, numpy, ml_dtypes):
//! Python's safetensors writes a float32 checkpoint with delicate values; `petite convert` turns it
//! into bf16 and f16; Python's safetensors reader must load both, and every value must equal
//! ml_dtypes'/numpy's round-to-nearest-even cast bit for bit. Also regenerates the bf16 test
//! vectors and the FP8/per-row quantization vectors and checks they equal the committed ones that
//! petite-weights' and petite-dtype's tests use.

use std::process::Command;

use anyhow::{Result, bail};

use crate::util;

const SCRIPT: &str = "xtask/src/conformance/weights_check.py";
const VECTORS: &str = "crates/petite-weights/tests/data/bf16_vectors.bin";
const QUANT_VECTORS: &str = "crates/petite-dtype/tests/data/quant_vectors.bin";

/// The venv's packages (ml_dtypes' bfloat16 cast is RNE, like PyTorch's; see the script).
pub const REQUIREMENTS: &[&str] = &["safetensors==0.7.0", "numpy==2.3.5", "ml_dtypes==0.5.4"];

/// Runs the tier.
pub fn run() -> Result<()> {
    let root = util::root();
    let python = super::Venv::Weights.python()?;
    let dir = root.join("target").join("weights-conformance");
    std::fs::create_dir_all(&dir)?;
    let script = root.join(SCRIPT);

    let fresh = dir.join("bf16_vectors.bin");
    util::run(
        Command::new(&python)
            .arg(&script)
            .arg("vectors")
            .arg(&fresh),
    )?;
    if std::fs::read(&fresh)? != std::fs::read(root.join(VECTORS))? {
        bail!(
            "{VECTORS} differs from what {SCRIPT} generates now (copy {} over it and review)",
            fresh.display()
        );
    }

    // The FP8 and per-row quantization vectors petite-dtype's tests read.
    let fresh = dir.join("quant_vectors.bin");
    util::run(
        Command::new(&python)
            .arg(&script)
            .arg("quant-vectors")
            .arg(&fresh),
    )?;
    if std::fs::read(&fresh)? != std::fs::read(root.join(QUANT_VECTORS))? {
        bail!(
            "{QUANT_VECTORS} differs from what {SCRIPT} generates now (copy {} over it and review)",
            fresh.display()
        );
    }

    let src = dir.join("src.safetensors");
    util::run(
        Command::new(&python)
            .arg(&script)
            .arg("make-source")
            .arg(&src),
    )?;
    let outs = [
        ("bf16", dir.join("out-bf16.safetensors")),
        ("f16", dir.join("out-f16.safetensors")),
    ];
    for (dtype, out) in &outs {
        let (src_s, out_s) = (src.display().to_string(), out.display().to_string());
        util::petite(&[
            "convert",
            "--checkpoint",
            &src_s,
            "--out",
            &out_s,
            "--dtype",
            dtype,
            "--drop",
            "head.lm_head.weight",
            "--chunk",
            "1MiB",
        ])?;
    }
    util::run(
        Command::new(&python)
            .arg(&script)
            .arg("check")
            .arg(&src)
            .arg(&outs[0].1)
            .arg(&outs[1].1),
    )?;
    Ok(())
}
