//! The portable-lowering tier (petite-portable): petite's programs as plain ExecuTorch kernel
//! calls, run by ExecuTorch's own runtime. Light (always, the `pte` venv: executorch-numpy-runtime
//! 1.4.0): every per-op case of `petite-portable`'s `op_cases` test against the reference
//! executor's outputs; then, per golden case of testdata/pi05, `petite lower` writes timesteps,
//! prefix and step `.pte`s and `run_pi05_portable.py` runs the timestep table, the prefix once and
//! the step 10 times, comparing with lerobot's golden actions (max abs error <= 1e-4, f32).
//! Then the exporter's own output: per golden case `petite export --backend portable` (f32 and
//! bf16) and `petite verify` (which runs the files in the runtime through its embedded copy of
//! the same driver) within 1e-4 of the f32 reference in f32, and the driver against lerobot's
//! goldens: f32 export <= 1e-4 of lerobot's f32 actions; bf16 export <= [`BF16_BOUND`] of both
//! lerobot's f32 and bf16 actions (portable kernels compute in bf16, see docs/GUIDE.md, Backends: portable).
//! `--full`: the same files in executorch 1.5.1's runtime (the pte tier's heavy venv).

use std::path::Path;
use std::process::Command;

use anyhow::Result;

use crate::util;

const OPS_SCRIPT: &str = "conformance/executorch/run_portable_ops.py";
const PI05_SCRIPT: &str = "conformance/executorch/run_pi05_portable.py";
/// The pte tier's heavy venv, same list so the venv is shared (`--no-cache-dir` keeps pip's
/// ~3 GB cache off the disk).
/// bf16 portable export vs lerobot (f32 or bf16 mode). Measured max: 2.95e-2 vs f32 and 2.46e-2
/// vs bf16 (two_cams_mqa); lerobot's own bf16-vs-f32 is 8e-3 – 9.6e-3. Portable bf16 kernels
/// round inside mm/bmm and every elementwise op, where lerobot's bf16 mode keeps SigLIP, norms and
/// accumulations in f32, so the noise is larger. Loose on purpose: the f32 checks (<= 1e-4) are
/// what catch lowering mistakes; this one catches broken bf16 numerics (garbage, wrong casts).
/// Across CPUs: lerobot's side is committed; on petite's side only the timestep table has
/// per-CPU code (FMA in `gemm`): exported on a CPU without FMA (`qemu-x86_64 -cpu Westmere`) the
/// errors vs f32 were 2.95e-2 / 9.7e-3 / 8.1e-3 (native 2.95e-2 / 1.04e-2 / 7.3e-3).
const BF16_BOUND: &str = "5e-2";
const CASES: &[&str] = super::GOLDENS;

/// `run_pi05_portable.py` on the `.pte` files in `dir` with golden case `case_dir`'s inputs and
/// expected actions; the caller adds the runtime and what to compare.
fn pi05_driver(python: &Path, case_dir: &Path, dir: &Path) -> Command {
    let mut cmd = Command::new(python);
    cmd.arg(util::root().join(PI05_SCRIPT))
        .arg(dir)
        .arg("--inputs")
        .arg(case_dir.join("inputs.safetensors"))
        .arg("--expected")
        .arg(case_dir.join("expected.safetensors"));
    cmd
}

/// Runs the tier.
pub fn run(full: bool) -> Result<()> {
    let root = util::root();
    let out = root.join("target").join("portable-conformance");
    let ops = out.join("ops");
    let ops_s = ops.to_string_lossy().into_owned();
    util::run(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args(["test", "--workspace", "--test", "op_cases"])
            .env("PETITE_PORTABLE_CASES", &ops_s)
            .current_dir(&root),
    )?;
    let mut pythons = vec![(super::Venv::Pte.python()?, "numpy")];
    if full {
        pythons.push((super::Venv::PteFull.python()?, "torch"));
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
            util::petite(&[
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
    // The exporter's portable output, f32 and bf16, per case.
    let mut exports = Vec::new();
    for case in CASES {
        let case_dir = root.join("testdata").join("pi05").join(case);
        for dtype in ["f32", "bf16"] {
            let dir = out.join("export").join(format!("{case}-{dtype}"));
            util::petite(&[
                "export",
                "--backend",
                "portable",
                "--dtype",
                dtype,
                "--config",
                &case_dir.join("config.json").to_string_lossy(),
                "--checkpoint",
                &case_dir.join("model.safetensors").to_string_lossy(),
                "--out",
                &dir.to_string_lossy(),
            ])?;
            exports.push((case_dir.clone(), dir, dtype));
        }
    }
    for (python, runtime) in &pythons {
        util::run(
            Command::new(python)
                .arg(root.join(OPS_SCRIPT))
                .arg(&ops)
                .args(["--runtime", runtime]),
        )?;
        for (case_dir, dir) in &dirs {
            util::run(pi05_driver(python, case_dir, dir).args(["--runtime", runtime]))?;
        }
        for (case_dir, dir, dtype) in &exports {
            let keys: &[(&str, &str)] = if *dtype == "f32" {
                // The f32 parity bound; measured 4.8e-7 – 8.6e-7. ExecuTorch's portable kernels
                // have no per-CPU paths; petite's timestep table does (FMA), by f32 ulps only.
                &[("actions", "1e-4")]
            } else {
                &[("actions", BF16_BOUND), ("actions_bf16", BF16_BOUND)]
            };
            for (key, tol) in keys {
                util::run(pi05_driver(python, case_dir, dir).args([
                    "--key",
                    key,
                    "--tol",
                    tol,
                    "--runtime",
                    runtime,
                ]))?;
            }
        }
    }
    // `petite verify` itself (numpy runtime, its embedded driver) on the f32 exports.
    let numpy_python = &pythons[0].0;
    for (case_dir, dir, dtype) in &exports {
        if *dtype != "f32" {
            continue;
        }
        util::petite(&[
            "verify",
            "--dir",
            &dir.to_string_lossy(),
            "--config",
            &case_dir.join("config.json").to_string_lossy(),
            "--checkpoint",
            &case_dir.join("model.safetensors").to_string_lossy(),
            "--inputs",
            &case_dir.join("inputs.safetensors").to_string_lossy(),
            "--python",
            &numpy_python.to_string_lossy(),
            // f32 export vs petite's f32 reference, both computed in this run (2.7e-7 – 7.2e-7).
            "--max-error",
            "1e-4",
        ])?;
    }
    Ok(())
}
