//! The portable-lowering tier (petite-portable): petite's programs as plain ExecuTorch kernel
//! calls, run by ExecuTorch's own runtime. Light (always, the `pte` venv: executorch-numpy-runtime
//! 1.4.0): every per-op case of `petite-portable`'s `op_cases` test against the reference
//! executor's outputs; then, per golden case of testdata/pi05, `petite lower` writes timesteps,
//! prefix and step `.pte`s and `run_pi05_portable.py` runs the timestep table, the prefix once and
//! the step 10 times, comparing with lerobot's golden actions (max abs error <= 1e-4, f32).
//! `--full`: the same files in executorch 1.5.1's runtime (the pte tier's heavy venv).

use std::process::Command;

use anyhow::Result;

use crate::{codegen, util};

const OPS_SCRIPT: &str = "conformance/executorch/run_portable_ops.py";
const PI05_SCRIPT: &str = "conformance/executorch/run_pi05_portable.py";
/// The pte tier's heavy venv, same list so the venv is shared (`--no-cache-dir` keeps pip's
/// ~3 GB cache off the disk).
const FULL_REQUIREMENTS: &[&str] = &["--no-cache-dir", "executorch==1.5.1", "torch==2.13.0"];
const CASES: &[&str] = &[
    "two_cams_mqa",
    "three_cams_masked_gqa",
    "one_cam_mha_unpadded",
];

/// Runs the tier.
pub fn run(full: bool) -> Result<()> {
    let root = util::root();
    let out = root.join("target").join("portable-conformance");
    let ops = out.join("ops");
    let ops_s = ops.to_string_lossy().into_owned();
    util::run(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["test", "-p", "petite-portable", "--test", "op_cases"])
            .env("PETITE_PORTABLE_CASES", &ops_s)
            .current_dir(&root),
    )?;
    let mut pythons = vec![(util::venv("pte", codegen::PTE_VENV_REQUIREMENTS)?, "numpy")];
    if full {
        pythons.push((util::venv("pte-full", FULL_REQUIREMENTS)?, "torch"));
    }
    let mut dirs = Vec::new();
    for case in CASES {
        let case_dir = root.join("testdata").join("pi05").join(case);
        let dir = out.join("pi05").join(case);
        std::fs::create_dir_all(&dir)?;
        for program in ["timesteps", "prefix", "step"] {
            let cfg = case_dir.join("config.json");
            let ck = case_dir.join("model.safetensors");
            let pte = dir.join(format!("{program}.pte"));
            util::cargo(&[
                "run",
                "--release",
                "-q",
                "-p",
                "petite",
                "--",
                "lower",
                "--config",
                &cfg.to_string_lossy(),
                "--checkpoint",
                &ck.to_string_lossy(),
                "--program",
                program,
                "--out",
                &pte.to_string_lossy(),
            ])?;
        }
        dirs.push((case_dir, dir));
    }
    for (python, runtime) in &pythons {
        util::run(
            Command::new(python)
                .arg(root.join(OPS_SCRIPT))
                .arg(&ops)
                .args(["--runtime", runtime]),
        )?;
        for (case_dir, dir) in &dirs {
            util::run(
                Command::new(python)
                    .arg(root.join(PI05_SCRIPT))
                    .arg(case_dir)
                    .arg(dir)
                    .args(["--runtime", runtime]),
            )?;
        }
    }
    Ok(())
}
