//! The lerobot policy tier: real lerobot 0.6.1 policy folders in, a deployable bundle out.
//! `conformance/lerobot/make_policy_folders.py` (in the lerobot venv) saves each case as a user
//! gets it — `PI05Policy.save_pretrained` plus the pre/post-processors' `save_pretrained`, small
//! sizes, a small trained tokenizer; one case as a Hub-style folder — and runs lerobot's own
//! preprocessor → `predict_action_chunk` (fixed noise) → postprocessor on raw observations.
//! Then, per case and backend (reference engines, portable in ExecuTorch's runtime, onnx in ONNX
//! Runtime), f32:
//! `petite export --checkpoint <folder> --config petite.json` and `petite act` on the same raw
//! observation must give lerobot's actions within 1e-4 × max(1, |action|) each, and its prompt
//! tokens and attention mask exactly. A NaN, a length mismatch or a missing tensor fails.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use safetensors::{Dtype, SafeTensors};

use crate::util;

/// The generator, relative to the workspace root.
const SCRIPT: &str = "conformance/lerobot/make_policy_folders.py";
/// The cases it writes (one folder each under the output).
const CASES: [&str; 2] = ["libero_like_mean_std", "hub_quantiles"];
/// Per action: |petite − lerobot| ≤ this × max(1, |lerobot|).
const BOUND: f32 = 1e-4;

/// Runs the tier.
pub fn run() -> Result<()> {
    let root = util::root();
    let python = super::Venv::Lerobot.python()?;
    let pte_python = super::Venv::Pte.python()?;
    let ort_python = super::Venv::Ort.python()?;
    let petite = util::conformance_petite()?;
    let out = util::target_dir().join("conformance-policy");
    let result = (|| -> Result<()> {
        util::run(
            Command::new(&python)
                .arg(root.join(SCRIPT))
                .arg("--out")
                .arg(&out),
        )?;
        for case in CASES {
            let dir = out.join(case);
            for backend in ["reference", "portable", "onnx"] {
                let bundle = dir.join(backend);
                util::run(
                    Command::new(&petite)
                        .args(["export", "--dtype", "f32", "--backend", backend])
                        .arg("--checkpoint")
                        .arg(dir.join("policy"))
                        .arg("--config")
                        .arg(dir.join("petite.json"))
                        .arg("--out")
                        .arg(&bundle),
                )?;
                let acted = dir.join(format!("{backend}-act.safetensors"));
                let mut act = Command::new(&petite);
                act.arg("act")
                    .arg("--dir")
                    .arg(&bundle)
                    .arg("--observation")
                    .arg(dir.join("observation.safetensors"))
                    .arg("--out")
                    .arg(&acted);
                match backend {
                    "portable" => {
                        act.arg("--python").arg(&pte_python);
                    }
                    "onnx" => {
                        act.arg("--python").arg(&ort_python);
                    }
                    _ => {}
                }
                util::run(&mut act)?;
                let err = compare(&dir.join("expected.safetensors"), &acted)
                    .with_context(|| format!("{case} ({backend})"))?;
                eprintln!(
                    "xtask: policy: {case} ({backend}, f32): actions within {err:.2e} × max(1, |a|) of lerobot's pipeline (bound {BOUND:e}); tokens and mask identical"
                );
            }
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&out);
    result
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// A tensor's values as f64 (f32, i64, u8/bool), with its dtype checked against `want`.
fn values(st: &SafeTensors<'_>, file: &Path, name: &str, want: &[Dtype]) -> Result<Vec<f64>> {
    let t = st
        .tensor(name)
        .with_context(|| format!("{}: no tensor `{name}`", file.display()))?;
    ensure!(
        want.contains(&t.dtype()),
        "{}: `{name}` is {:?}, expected one of {want:?}",
        file.display(),
        t.dtype()
    );
    let b = t.data();
    Ok(match t.dtype() {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        Dtype::I64 => b
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f64)
            .collect(),
        _ => b.iter().map(|&v| v as f64).collect(),
    })
}

/// The largest |petite − lerobot| / max(1, |lerobot|) over the actions; fails past [`BOUND`],
/// on any non-finite value, a length mismatch, or a token or mask that differs.
fn compare(expected: &Path, acted: &Path) -> Result<f64> {
    let (eb, ab) = (read(expected)?, read(acted)?);
    let e = SafeTensors::deserialize(&eb).with_context(|| expected.display().to_string())?;
    let a = SafeTensors::deserialize(&ab).with_context(|| acted.display().to_string())?;
    let want = values(&e, expected, "action", &[Dtype::F32])?;
    let got = values(&a, acted, "action", &[Dtype::F32])?;
    ensure!(
        !want.is_empty() && want.len() == got.len(),
        "{} actions from petite act, {} from lerobot",
        got.len(),
        want.len()
    );
    let mut worst = 0f64;
    for (i, (&w, &g)) in want.iter().zip(&got).enumerate() {
        ensure!(
            w.is_finite() && g.is_finite(),
            "action {i}: petite {g}, lerobot {w} (not finite)"
        );
        let rel = (g - w).abs() / w.abs().max(1.0);
        worst = worst.max(rel);
        if rel > BOUND as f64 {
            bail!(
                "action {i}: petite {g}, lerobot {w}: off by {rel:.3e} × max(1, |a|) > {BOUND:e}"
            );
        }
    }
    for (mine, theirs, kinds) in [
        ("observation.language.tokens", "tokens", &[Dtype::I64][..]),
        (
            "observation.language.attention_mask",
            "token_mask",
            &[Dtype::BOOL, Dtype::U8][..],
        ),
    ] {
        let g = values(&a, acted, mine, kinds)?;
        let w = values(&e, expected, theirs, &[Dtype::I64, Dtype::U8, Dtype::BOOL])?;
        ensure!(
            !w.is_empty() && g == w,
            "{mine}: petite {g:?}, lerobot {w:?}"
        );
    }
    Ok(worst)
}
