//! The ONNX tier, in the `ort` venv (`target/venv-ort`: onnx, onnxruntime, numpy; also the
//! Python `petite verify` finds by default for ONNX exports).
//!
//! 1. petite-engine's `tensorrt` backend: for small pi0.5 configs (f32 and bf16 programs,
//!    prefix, step, and the prefix with its token embedding forced into 16-row shards), every
//!    planned engine is emitted as ONNX in both flavours (TensorRT's and the f32 twin); every
//!    model must pass `onnx.checker.check_model(full_check=True)` with its weights as external
//!    data in the bf16 mapping file, and the twin run by ONNX Runtime on CPU must match the
//!    reference executor's outputs for that engine within 1e-4 (bf16 outputs: elements 1–2
//!    bf16 ulps apart are counted and reported, see the script). No TensorRT is involved.
//! 2. `petite export --backend onnx` (the whole policy as one model) per golden case of
//!    testdata/pi05: f32 and bf16 models pass the full checker; the f32 model, one
//!    `session.run` in ONNX Runtime, is within [`F32_BOUND`] of lerobot's f32 actions; the bf16
//!    model is refused by ONNX Runtime's CPU provider (NOT_IMPLEMENTED, what `petite verify`
//!    says before running one); `petite verify` (its embedded copy of the same driver) runs
//!    each f32 model within 1e-4 of petite's f32 reference.
//! 3. Quantized weights (`--weights int8|fp8`, f32 activations): per golden and mode, the
//!    ONNX model (codes as INT8/FLOAT8E4M3FN initializers, `DequantizeLinear` on axis 0; opset
//!    19 for FP8) passes the full checker, and ONNX Runtime's actions are as far from the f32
//!    reference as the reference backend's export of the same mode — to [`QUANT_AGREE`] —
//!    and within the mode's default bound (`petite verify`'s).

use std::process::Command;

use anyhow::Result;

use crate::util;

const SCRIPT: &str = "xtask/src/conformance/onnx_check.py";
const DRIVER: &str = "conformance/onnxruntime/run_pi05_onnx.py";

/// The venv's packages.
pub const REQUIREMENTS: &[&str] = &["onnx==1.23.2", "onnxruntime==1.31.1", "numpy==2.5.5"];

/// The f32 whole-policy model vs lerobot's f32 actions. Measured (ONNX Runtime 1.31.1, this
/// machine): 5.4e-7 / 3.6e-7 / 5.1e-7 (two_cams_mqa / three_cams_masked_gqa /
/// one_cam_mha_unpadded) — the same size as petite's own f32 reference vs lerobot (≤ 6e-7:
/// two f32 summation orders over ten steps). The bound is the workspace's f32 parity bound:
/// ~185x the measured error, and below the smallest real mistake the goldens show (an exact-GELU
/// port, 2.6e-4 – 4.0e-4; testdata/pi05/README.md).
const F32_BOUND: &str = "1e-4";
const CASES: &[&str] = super::GOLDENS;

/// How far the action errors of ONNX Runtime's and the reference executor's runs of one
/// quantized f32 export may differ: both dequantize the same codes exactly (`code · scale` in
/// f32) and then differ only by f32 summation order (measured 3e-8 – 7e-7 on the goldens, CI).
const QUANT_AGREE: f64 = 1e-5;

/// Runs the tier.
pub fn run() -> Result<()> {
    let root = util::root();
    let python = super::Venv::Ort.python()?;
    let dir = root.join("target").join("onnx-conformance");
    let dir_s = dir.display().to_string();
    util::run(
        Command::new(util::conformance_example("onnx_cases")?)
            .arg(&dir_s)
            .current_dir(&root),
    )?;
    util::run(Command::new(&python).arg(root.join(SCRIPT)).arg(&dir))?;

    // The whole policy as one model, per golden case.
    let driver = root.join(DRIVER);
    let python_s = python.display().to_string();
    for case in CASES {
        let case_dir = root.join("testdata").join("pi05").join(case);
        let cfg = case_dir.join("config.json").display().to_string();
        let ck = case_dir.join("model.safetensors").display().to_string();
        let inputs = case_dir.join("inputs.safetensors");
        let inputs_s = inputs.display().to_string();
        // `petite verify` of an export on the case's inputs: an ONNX one in ONNX Runtime (this
        // venv; `--python` is refused for an engine export, whose engines run in petite).
        let verify = |out_s: &str, onnx: bool, extra: &[&str]| -> Result<()> {
            let mut args = vec![
                "verify",
                "--dir",
                out_s,
                "--config",
                &cfg,
                "--checkpoint",
                &ck,
                "--inputs",
                &inputs_s,
            ];
            if onnx {
                args.extend(["--python", python_s.as_str()]);
            }
            args.extend_from_slice(extra);
            util::petite(&args)
        };
        for dtype in ["f32", "bf16"] {
            let out = dir.join("export").join(format!("{case}-{dtype}"));
            let out_s = out.display().to_string();
            util::petite(&[
                "export",
                "--backend",
                "onnx",
                "--dtype",
                dtype,
                "--config",
                &cfg,
                "--checkpoint",
                &ck,
                "--out",
                &out_s,
            ])?;
            let mut cmd = Command::new(&python);
            cmd.arg(&driver)
                .arg(&out)
                .arg("--inputs")
                .arg(&inputs)
                .arg("--check");
            if dtype == "f32" {
                cmd.arg("--expected")
                    .arg(case_dir.join("expected.safetensors"))
                    .args(["--key", "actions", "--tol", F32_BOUND]);
            } else {
                cmd.arg("--probe-bf16");
            }
            util::run(&mut cmd)?;
            if dtype == "f32" {
                // f32 model vs petite's f32 reference, both computed in this run.
                verify(&out_s, true, &["--max-error", "1e-4"])?;
            }
        }
        for q in ["int8", "fp8"] {
            let mut errors = Vec::new();
            for backend in ["onnx", "reference"] {
                let out = dir.join("export").join(format!("{case}-{q}-{backend}"));
                let out_s = out.display().to_string();
                util::petite(&[
                    "export",
                    "--backend",
                    backend,
                    "--dtype",
                    "f32",
                    "--weights",
                    q,
                    "--config",
                    &cfg,
                    "--checkpoint",
                    &ck,
                    "--out",
                    &out_s,
                ])?;
                if backend == "onnx" {
                    util::run(
                        Command::new(&python)
                            .arg(&driver)
                            .arg(&out)
                            .arg("--inputs")
                            .arg(&inputs)
                            .arg("--check"),
                    )?;
                }
                // The mode's default bound.
                verify(&out_s, backend == "onnx", &[])?;
                let report: serde_json::Value =
                    serde_json::from_str(&std::fs::read_to_string(out.join("report.json"))?)?;
                let e = report["verify"]["max_abs_action_error"]
                    .as_f64()
                    .ok_or_else(|| anyhow::anyhow!("{out_s}: no verify.max_abs_action_error"))?;
                errors.push(e);
            }
            let d = (errors[0] - errors[1]).abs();
            println!(
                "onnx: {case} --weights {q}: ONNX Runtime {:.7e}, reference {:.7e} from the f32 \
                 reference (apart {d:.1e}, allowed {QUANT_AGREE:e})",
                errors[0], errors[1]
            );
            anyhow::ensure!(
                d <= QUANT_AGREE,
                "{case} --weights {q}: ONNX Runtime and the reference executor disagree: {errors:?}"
            );
        }
    }
    Ok(())
}
