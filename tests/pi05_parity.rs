//! `petite pi05 run` (the binary) against lerobot 0.6.1's real PI05 on every golden case in
//! `testdata/pi05/`: max |actions − expected| ≤ 1e-4 in f32. Plus the CLI's failure contract:
//! one clear error naming the tensor, nothing written under `--out`.
mod common;

use std::path::{Path, PathBuf};

use common::Scratch;
use petite_weights::{MappedSafetensors, WeightSource};

fn cases() -> Vec<PathBuf> {
    let root = common::goldens();
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("expected.safetensors").exists())
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no golden cases under {}", root.display());
    v
}

/// petite's f32 actions vs lerobot's committed ones: measured ≤ 6.0e-7; petite's GEMM kernels
/// are picked per CPU (FMA or not), lerobot's ISA noise does not enter (its side is committed).
/// Bound: the f32 parity bound, 1e-4 (an exact-GELU port misses by 2.6e-4 – 4e-4).
const F32_BOUND: f32 = 1e-4;
/// petite's bf16 actions vs lerobot's committed bf16-mode actions: the bf16 roundings of two
/// implementations flip independently (measured ≤ 9.1e-3; lerobot's bf16-vs-f32 gap 8e-3 –
/// 9.6e-3); see `crates/petite-pi05/tests/golden.rs`, which checks all cases.
const BF16_BOUND: f32 = 1.5e-2;

/// max |a − b| through the shared fold: NaN, ±inf or a length mismatch panics with where.
fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    petite_reference::max_abs_diff(a, b).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn the_parity_fold_refuses_nan_inf_and_length_mismatches() {
    let clean = [1.0f32, -2.0, 3.0];
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for i in [0, 1, 2] {
            let mut dirty = clean;
            dirty[i] = bad;
            // An all-NaN output passed the old running-`max` fold.
            for (a, b) in [(&dirty, &clean), (&clean, &dirty), (&[bad; 3], &clean)] {
                assert!(std::panic::catch_unwind(|| max_abs(a, b)).is_err());
            }
        }
    }
    assert!(std::panic::catch_unwind(|| max_abs(&clean, &clean[..2])).is_err());
}

fn petite(case: &Path, inputs: &Path, out: &Path, dtype: &str) -> std::process::Output {
    common::petite()
        .args(["pi05", "run", "--checkpoint"])
        .arg(case.join("model.safetensors"))
        .arg("--config")
        .arg(case.join("config.json"))
        .arg("--inputs")
        .arg(inputs)
        .arg("--out")
        .arg(out)
        .args(["--dtype", dtype])
        .output()
        .unwrap()
}

fn read(path: &Path, name: &str) -> Vec<f32> {
    MappedSafetensors::open(path)
        .unwrap()
        .tensor(name)
        .unwrap()
        .to_f32_vec()
        .unwrap()
}

#[test]
fn cli_f32_matches_lerobot_on_every_golden_case() {
    let scratch = Scratch::new("f32");
    for case in cases() {
        let name = case.file_name().unwrap().to_string_lossy().to_string();
        let out = scratch.0.join(format!("{name}.safetensors"));
        let o = petite(&case, &case.join("inputs.safetensors"), &out, "f32");
        assert!(
            o.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let ours = read(&out, "actions");
        let want = read(&case.join("expected.safetensors"), "actions");
        let err = max_abs(&ours, &want);
        eprintln!("{name}: max |actions - lerobot| = {err:.3e}");
        assert!(
            err <= F32_BOUND,
            "{name}: max abs error {err} > {F32_BOUND:e}"
        );
        // The shape written is [chunk, action_dim].
        let m = MappedSafetensors::open(&out).unwrap();
        let info = m.info("actions").unwrap();
        let cfg = petite_pi05::Pi05Config::from_json_file(case.join("config.json")).unwrap();
        assert_eq!(info.shape, [cfg.chunk, cfg.action_dim]);
    }
}

#[test]
fn cli_bf16_runs_and_stays_near_lerobot_bf16() {
    let scratch = Scratch::new("bf16");
    let case = &cases()[0];
    let out = scratch.0.join("a.safetensors");
    let o = petite(case, &case.join("inputs.safetensors"), &out, "bf16");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let ours = read(&out, "actions");
    let want = read(&case.join("expected.safetensors"), "actions_bf16");
    let err = max_abs(&ours, &want);
    assert!(err <= BF16_BOUND, "bf16 err {err}");
}

#[test]
fn cli_bad_inputs_fail_clearly_and_write_nothing() {
    let scratch = Scratch::new("bad");
    let case = &cases()[0];
    // An inputs file whose `noise` has the wrong shape: copy the header-described tensors by
    // rewriting the file with noise transposed in shape only.
    let src = MappedSafetensors::open(case.join("inputs.safetensors")).unwrap();
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for n in src.names() {
        let t = src.tensor(&n).unwrap();
        let mut shape = t.shape.to_vec();
        if n == "noise" {
            shape.reverse();
        }
        header.insert(
            n.clone(),
            serde_json::json!({"dtype": t.dtype.safetensors_name(), "shape": shape,
                               "data_offsets": [data.len(), data.len() + t.bytes.len()]}),
        );
        data.extend_from_slice(t.bytes);
    }
    let h = serde_json::Value::Object(header).to_string();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(h.as_bytes());
    bytes.extend_from_slice(&data);
    let bad = scratch.0.join("bad_inputs.safetensors");
    std::fs::write(&bad, bytes).unwrap();
    let out = scratch.0.join("out.safetensors");
    let o = petite(case, &bad, &out, "f32");
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("tensor `noise`") && err.contains("expected F32") && err.contains("found F32"),
        "{err}"
    );
    assert!(!out.exists(), "output written on failure");
    let leftovers: Vec<_> = std::fs::read_dir(&scratch.0)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers.len(), 1, "stray files: {leftovers:?}");
    // The output never replaces an input.
    let copy = scratch.0.join("inputs.safetensors");
    std::fs::copy(case.join("inputs.safetensors"), &copy).unwrap();
    let before = std::fs::read(&copy).unwrap();
    let o = petite(case, &copy, &copy, "f32");
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("would overwrite an input"));
    assert_eq!(std::fs::read(&copy).unwrap(), before);
}

#[test]
fn default_config_prints_the_real_config() {
    let o = common::petite()
        .args(["pi05", "default-config"])
        .output()
        .unwrap();
    assert!(o.status.success());
    let text = String::from_utf8(o.stdout).unwrap();
    let cfg = petite_pi05::Pi05Config::from_json_str(&text, "stdout").unwrap();
    assert_eq!(cfg, petite_pi05::Pi05Config::default());
}
