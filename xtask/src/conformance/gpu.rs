//! The gpu tier: petite's programs on CUDA GPU 0 through petite-cuda. It FAILS, never skips,
//! where there is no GPU (run it where one is: not part of `cargo xtask ci`).
//!
//! 1. `petite doctor` must say the CUDA runtime can run here.
//! 2. Every lerobot golden through `petite pi05 run --device cuda`: f32 within 1e-4 of lerobot's
//!    f32 actions, bf16 within the bf16 bound (5e-2) of them.
//! 3. Every golden exported (reference engines, f32 and bf16) and `petite verify --device cuda`:
//!    f32 within 1e-4 of the f32 reference (itself run on the GPU), bf16 within the bf16 bound;
//!    the wall time of each verify printed.
//!
//! 4. With `XTASK_POLICY_GOLDENS` (the gpu-bundle's lerobot policy folders and RTC goldens):
//!    each folder exported (f32, bf16) and acted on the GPU (`petite act --device cuda`), the
//!    plain chunk and the RTC goldens within the lerobot-policy tier's bounds; for the f32
//!    export every RTC golden also through the Python package's `petite.Policy(device="cuda")`
//!    and `petite.Client` against `petite serve --device cuda` (`conformance/lerobot/
//!    gpu_rtc.py`, in `XTASK_GPU_PYTHON`, default `python3`).
//!
//! 5. petite-cuda's GPU tests (`crates/petite-cuda/tests/gpu.rs`: the fused bf16 attention
//!    against the reference executor and the exact f64 attention; an embedding's index check
//!    read back after a CUDA graph).
//!
//! `XTASK_PETITE_BIN` names a prebuilt `petite` and `XTASK_CUDA_TESTS` a prebuilt test binary
//! of `crates/petite-cuda/tests/gpu.rs` (a machine with a GPU but no Rust toolchain); otherwise
//! the release build of this checkout is used and the tests run through cargo.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use petite_weights::{MappedSafetensors, WeightSource};

use crate::util;

/// lerobot f32 vs petite f32 on the GPU.
const F32_BOUND: f32 = 1e-4;
/// The bf16 bound (`petite verify`'s default).
const BF16_BOUND: f32 = 5e-2;

fn f32s(file: &Path, name: &str) -> Result<Vec<f32>> {
    let m = MappedSafetensors::open(file).with_context(|| format!("open {}", file.display()))?;
    let v = m.tensor(name)?;
    ensure!(
        v.dtype == petite_weights::Dtype::F32,
        "{}: {name} is not f32",
        file.display()
    );
    Ok(v.bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// max |a − b|; any NaN/inf, emptiness or length mismatch fails.
pub(crate) fn max_err(a: &[f32], b: &[f32]) -> Result<f32> {
    ensure!(
        !a.is_empty() && a.len() == b.len(),
        "lengths {} vs {}",
        a.len(),
        b.len()
    );
    let mut m = 0f32;
    for (x, y) in a.iter().zip(b) {
        ensure!(
            x.is_finite() && y.is_finite(),
            "non-finite value ({x} vs {y})"
        );
        m = m.max((x - y).abs());
    }
    Ok(m)
}

/// The petite binary the tier runs.
pub(crate) fn petite_bin() -> Result<PathBuf> {
    match std::env::var_os("XTASK_PETITE_BIN") {
        Some(p) => Ok(PathBuf::from(p)),
        None => util::conformance_petite(),
    }
}

fn output(cmd: &mut Command) -> Result<String> {
    eprintln!("xtask: {cmd:?}");
    let o = cmd.output().with_context(|| format!("starting {cmd:?}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    if !o.status.success() {
        bail!("{cmd:?} failed ({}):\n{text}", o.status);
    }
    Ok(text)
}

/// Runs the tier.
pub fn run() -> Result<()> {
    let petite = petite_bin()?;
    let doctor = output(Command::new(&petite).arg("doctor"))?;
    let line = doctor
        .lines()
        .find(|l| l.starts_with("cuda runtime"))
        .unwrap_or("no cuda runtime line");
    println!("gpu: {line}");
    ensure!(
        line.contains("can run here") && !line.contains("cannot"),
        "the gpu tier needs a CUDA GPU (driver, cuBLAS, NVRTC): {line}"
    );
    let mut tests = match std::env::var_os("XTASK_CUDA_TESTS") {
        Some(bin) => Command::new(bin),
        None => {
            let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
            c.args([
                "test",
                "--release",
                "-p",
                "petite-cuda",
                "--test",
                "gpu",
                "--",
            ])
            .current_dir(util::root());
            c
        }
    };
    let text = output(tests.args(["--ignored", "--nocapture", "--test-threads", "1"]))?;
    for l in text
        .lines()
        .filter(|l| l.starts_with("case ") || l.starts_with("test "))
    {
        println!("gpu: {l}");
    }
    let scratch = tempfile::tempdir()?;
    let mut rows = Vec::new();
    let mut failed = Vec::new();
    for case in super::GOLDENS {
        if let Err(e) = one_case(&petite, scratch.path(), case, &mut rows) {
            println!("gpu: {case}: FAILED: {e:#}");
            failed.push(format!("{case}: {e:#}"));
        }
    }
    // lerobot's policy folders and its real-time-chunking goldens, made where lerobot is
    // installed (`cargo xtask gpu-bundle` carries them): the Rust policy on the GPU.
    match std::env::var_os("XTASK_POLICY_GOLDENS") {
        Some(dir) => {
            if let Err(e) = policy_goldens(&petite, scratch.path(), Path::new(&dir), &mut rows) {
                println!("gpu: lerobot policy goldens: FAILED: {e:#}");
                failed.push(format!("lerobot policy goldens: {e:#}"));
            }
        }
        None => println!(
            "gpu: no XTASK_POLICY_GOLDENS (the gpu-bundle's policy-goldens): lerobot's policy folders and RTC goldens not run"
        ),
    }
    for r in &rows {
        println!("  {r}");
    }
    if !failed.is_empty() {
        bail!(
            "gpu tier: {} case(s) failed:\n{}",
            failed.len(),
            failed.join("\n")
        );
    }
    println!("gpu tier: passed ({} checks)", rows.len());
    Ok(())
}

/// The RTC goldens through `petite.Policy` and `petite.Client` on the GPU.
const GPU_RTC: &str = "conformance/lerobot/gpu_rtc.py";

/// Each case folder under `goldens` (conformance/lerobot/make_policy_folders.py and
/// make_rtc_goldens.py): the f32 export acted on the GPU (`petite act --device cuda`) for the
/// plain observation and every RTC golden, each within the lerobot-policy tier's bound of
/// lerobot's pipeline.
fn policy_goldens(
    petite: &Path,
    scratch: &Path,
    goldens: &Path,
    rows: &mut Vec<String>,
) -> Result<()> {
    let tokenizer = goldens.join("tokenizer").join("tokenizer.json");
    for case in super::policy::CASES {
        let dir = goldens.join(case);
        let gs = super::policy::rtc_goldens(&dir)?;
        // f32: every golden within the tier's 1e-4. bf16 (the resident CUDA method's TF32
        // products): the plain chunk and one golden a schedule within the bf16 bound.
        for (dtype, bound) in [("f32", 1e-4f32), ("bf16", BF16_BOUND)] {
            let bundle = scratch.join(format!("{case}-policy-{dtype}"));
            output(&mut super::policy::export_cmd(
                petite,
                &dir,
                &bundle,
                &["--dtype", dtype],
            ))?;
            let act = |obs: &Path, expected: &Path, extra: &[String]| -> Result<f64> {
                let out = scratch.join(format!("{case}-acted.safetensors"));
                output(
                    Command::new(petite)
                        .args(["act", "--device", "cuda", "--dir"])
                        .arg(&bundle)
                        .arg("--observation")
                        .arg(obs)
                        .arg("--tokenizer")
                        .arg(&tokenizer)
                        .args(extra)
                        .arg("--out")
                        .arg(&out),
                )?;
                super::policy::compare_within(expected, &out, bound)
            };
            let plain = act(
                &dir.join("observation.safetensors"),
                &dir.join("expected.safetensors"),
                &[],
            )?;
            // The same call with this golden's (small) token embedding gathered on the host, as
            // a full-size policy's is: the same bits through the method's graph.
            let acted = scratch.join(format!("{case}-acted.safetensors"));
            let by_device = f32s(&acted, "action")?;
            act(
                &dir.join("observation.safetensors"),
                &dir.join("expected.safetensors"),
                &["--tune".into(), "host_gather=all".into()],
            )
            .with_context(|| format!("{case} {dtype}: --tune host_gather=all"))?;
            let by_host = f32s(&acted, "action")?;
            anyhow::ensure!(
                !by_host.is_empty()
                    && by_host.len() == by_device.len()
                    && by_host
                        .iter()
                        .zip(&by_device)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{case} {dtype}: the embedding gathered on the host changed the actions"
            );
            rows.push(format!(
                "policy {case} {dtype}: token embedding gathered on the host, the same bits"
            ));
            let mut worst = 0f64;
            let mut ran = 0;
            for (j, g) in gs.iter().enumerate() {
                if dtype == "bf16" && j % 3 != (j / 3) % 3 {
                    continue;
                }
                let gdir = dir.join("rtc").join(format!("{j:02}"));
                let e = act(
                    &gdir.join("observation.safetensors"),
                    &gdir.join("expected.safetensors"),
                    &[
                        "--inference-delay".into(),
                        g.inference_delay.to_string(),
                        "--execution-horizon".into(),
                        g.execution_horizon.to_string(),
                        "--rtc-schedule".into(),
                        g.schedule.clone(),
                        "--max-guidance-weight".into(),
                        g.max_guidance_weight.to_string(),
                    ],
                )
                .with_context(|| {
                    format!(
                        "{case} {dtype} RTC golden {j} ({} delay {})",
                        g.schedule, g.inference_delay
                    )
                })?;
                worst = worst.max(e);
                ran += 1;
            }
            println!(
                "gpu: {case} petite act --device cuda ({dtype} export of lerobot's folder): plain within {plain:.2e}, {ran} RTC goldens within {worst:.2e} × max(1, |a|) of lerobot's f32 pipeline (bound {bound:e})"
            );
            if dtype == "f32" {
                // The same goldens through the Python package and `petite serve` on the GPU.
                let python = std::env::var("XTASK_GPU_PYTHON").unwrap_or_else(|_| "python3".into());
                let text = output(
                    Command::new(&python)
                        .arg(util::root().join(GPU_RTC))
                        .arg("--petite")
                        .arg(petite)
                        .arg("--export")
                        .arg(&bundle)
                        .arg("--case")
                        .arg(&dir)
                        .arg("--tokenizer")
                        .arg(&tokenizer),
                )
                .with_context(|| format!("{case}: RTC goldens through petite.Policy and serve"))?;
                for l in text.lines().filter(|l| l.starts_with("gpu-rtc: petite")) {
                    println!("gpu: {case} {l}");
                }
                rows.push(format!(
                    "policy {case} f32: Python package and serve, RTC ×{} on cuda",
                    gs.len()
                ));
            }
            rows.push(format!(
                "policy {case} {dtype}: plain {plain:.2e}, RTC ×{ran} {worst:.2e}"
            ));
        }
    }
    Ok(())
}

/// A golden case's `--config` and `--checkpoint` (and with `inputs`, `--inputs`) arguments.
fn golden(dir: &Path, inputs: bool) -> Vec<std::ffi::OsString> {
    let mut a: Vec<std::ffi::OsString> = vec![
        "--config".into(),
        dir.join("config.json").into(),
        "--checkpoint".into(),
        dir.join("model.safetensors").into(),
    ];
    if inputs {
        a.extend(["--inputs".into(), dir.join("inputs.safetensors").into()]);
    }
    a
}

fn one_case(petite: &Path, scratch: &Path, case: &str, rows: &mut Vec<String>) -> Result<()> {
    {
        let dir = util::root().join("testdata/pi05").join(case);
        let expected = dir.join("expected.safetensors");
        let lerobot = f32s(&expected, "actions")?;
        for (dtype, bound) in [("f32", F32_BOUND), ("bf16", BF16_BOUND)] {
            let out = scratch.join(format!("{case}-{dtype}.safetensors"));
            let text = output(
                Command::new(petite)
                    .args(["pi05", "run", "--device", "cuda", "--dtype", dtype])
                    .args(golden(&dir, true))
                    .arg("--out")
                    .arg(&out),
            )?;
            let e = max_err(&f32s(&out, "actions")?, &lerobot)?;
            println!(
                "gpu: {case} pi05 run --device cuda --dtype {dtype}: max |petite − lerobot f32| {e:.3e} (bound {bound:e})"
            );
            ensure!(e <= bound, "{case} {dtype}: {e} > {bound}\n{text}");
            rows.push(format!("pi05 run {case} {dtype}: {e:.3e}"));
        }
        for (dtype, bound) in [("f32", F32_BOUND), ("bf16", BF16_BOUND)] {
            let pte = scratch.join(format!("{case}-{dtype}-pte"));
            output(
                Command::new(petite)
                    .args(["export", "--dtype", dtype])
                    .args(golden(&dir, false))
                    .arg("--out")
                    .arg(&pte),
            )?;
            let t0 = Instant::now();
            let text = output(
                Command::new(petite)
                    .args([
                        "verify",
                        "--device",
                        "cuda",
                        "--max-error",
                        &bound.to_string(),
                    ])
                    .arg("--dir")
                    .arg(&pte)
                    .args(golden(&dir, true)),
            )?;
            let wall = t0.elapsed().as_secs_f64();
            let report: serde_json::Value =
                serde_json::from_slice(&std::fs::read(pte.join("report.json"))?)?;
            let e = report["verify"]["max_abs_action_error"]
                .as_f64()
                .context("report.json: no verify.max_abs_action_error")?;
            ensure!(
                report["verify"]["device"] == "cuda",
                "verify did not run on cuda: {}",
                report["verify"]
            );
            println!(
                "gpu: {case} verify --device cuda ({dtype} export): max abs action error {e:.3e} (bound {bound:e}), {wall:.2} s wall; {}",
                text.lines().last().unwrap_or("")
            );
            rows.push(format!("verify {case} {dtype}: {e:.3e}, {wall:.2} s"));
            ensure!(e <= bound as f64, "{case} verify {dtype}: {e} > {bound}");
        }
        if case == super::GOLDENS[0] {
            quantized(petite, scratch, case, &dir, rows)?;
        }
    }
    Ok(())
}

/// Quantized weights on the GPU (issue 51): `case` exported in bf16 with `--weights int8` and
/// `fp8` (reference engines), acted on by petite-cuda (`pt_dequant` before each linear) and on
/// the CPU. Both run the same dequantized bf16 weights, so they must agree within the bf16
/// bound; and `petite verify --device cuda` holds the mode's own bound against the f32
/// reference of the unquantized checkpoint.
fn quantized(
    petite: &Path,
    scratch: &Path,
    case: &str,
    dir: &Path,
    rows: &mut Vec<String>,
) -> Result<()> {
    for mode in ["int8", "fp8"] {
        let pte = scratch.join(format!("{case}-{mode}-pte"));
        output(
            Command::new(petite)
                .args(["export", "--dtype", "bf16", "--weights", mode])
                .args(golden(dir, false))
                .arg("--out")
                .arg(&pte),
        )?;
        let mut acted = Vec::new();
        // The CPU first: the report then records the GPU's verify.
        for device in ["cpu", "cuda"] {
            let out = scratch.join(format!("{case}-{mode}-{device}.safetensors"));
            let text = output(
                Command::new(petite)
                    .args(["verify", "--device", device, "--dir"])
                    .arg(&pte)
                    .args(golden(dir, true))
                    .arg("--actions-out")
                    .arg(&out),
            )?;
            acted.push(f32s(&out, "actions")?);
            let report: serde_json::Value =
                serde_json::from_slice(&std::fs::read(pte.join("report.json"))?)?;
            let v = &report["verify"];
            ensure!(v["device"] == device, "verify did not run on {device}: {v}");
            let err = v["max_abs_action_error"]
                .as_f64()
                .context("report.json: no verify.max_abs_action_error")?;
            println!(
                "gpu: {case} verify --device {device} ({mode} weights): max abs action error {err:.3e}; {}",
                text.lines().last().unwrap_or("")
            );
            rows.push(format!("verify {case} {mode} on {device}: {err:.3e}"));
        }
        let e = max_err(&acted[1], &acted[0])?;
        println!(
            "gpu: {case} {mode} export on cuda against the same export on the cpu: max {e:.3e} (bound {BF16_BOUND:e})"
        );
        ensure!(
            e <= BF16_BOUND,
            "{case} {mode}: cuda vs cpu {e} > {BF16_BOUND}"
        );
        rows.push(format!("{mode} bundle {case} cuda vs cpu: {e:.3e}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_refuse_nan_and_length_mismatch() {
        assert_eq!(max_err(&[1.0, 2.0], &[1.5, 2.0]).unwrap(), 0.5);
        assert!(max_err(&[f32::NAN], &[0.0]).is_err());
        assert!(max_err(&[1.0], &[1.0, 2.0]).is_err());
        assert!(max_err(&[], &[]).is_err());
    }
}
