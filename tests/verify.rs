//! `petite verify`'s accuracy contract end to end: an export whose actions hold NaN fails and
//! says "NaN" (the old fold let a NaN through unless it was last), and without `--max-error`
//! the default bound (`petite::verify::DEFAULT_MAX_ERROR`) applies: above it, exit non-zero.
mod common;

use std::path::{Path, PathBuf};

use common::{Scratch, case, ok, report, verify_cmd};

/// The bias of the last projection (velocity = … + bias): changing one element moves one action
/// column at the first step and, through the next steps' inputs, every action after.
const BIAS: &str = "model.action_out_proj.bias";

/// A copy of golden case `c`'s checkpoint with `BIAS[0]` replaced by `value`, in `dir`.
fn poisoned_checkpoint(c: &Path, dir: &Path, value: f32) -> PathBuf {
    let mut bytes = std::fs::read(c.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let t = &header[BIAS];
    assert_eq!(t["dtype"], "F32", "{t}");
    let start = 8 + n + t["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[start..start + 4].copy_from_slice(&value.to_le_bytes());
    let p = dir.join("poisoned.safetensors");
    std::fs::write(&p, bytes).unwrap();
    p
}

/// Exports golden case `c` from `checkpoint` (f32, so nothing but the poison differs) into `out`.
fn export_from(c: &Path, checkpoint: &Path, out: &Path) {
    ok(common::petite()
        .arg("export")
        .arg("--checkpoint")
        .arg(checkpoint)
        .arg("--config")
        .arg(c.join("config.json"))
        .arg("--out")
        .arg(out)
        .args(["--dtype", "f32"])
        .output()
        .unwrap());
}

fn verify(c: &Path, dir: &Path, extra: &[&str]) -> std::process::Output {
    verify_cmd(c, dir)
        .arg("--inputs")
        .arg(c.join("inputs.safetensors"))
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn actions_holding_nan_fail_and_say_nan() {
    let s = Scratch::new("nan");
    let c = case("two_cams_mqa");
    let ck = poisoned_checkpoint(&c, &s.0, f32::NAN);
    let out = s.0.join("export");
    export_from(&c, &ck, &out);
    // Against the clean checkpoint's f32 reference, with and without a bound: a NaN is never
    // "within" anything.
    for extra in [&[][..], &["--max-error", "1e30"]] {
        let o = verify(&c, &out, extra);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "verify passed NaN actions ({extra:?})");
        assert!(
            err.contains("NaN") && err.contains("index 0 of the actual values"),
            "{err}"
        );
        let v = &report(&out)["verify"];
        assert!(v["max_abs_action_error"].is_null(), "{v}");
        assert!(v["error"].as_str().unwrap().contains("NaN"), "{v}");
        assert_eq!(v["within_bound"], false);
    }
}

#[test]
fn without_max_error_the_default_bound_applies() {
    let s = Scratch::new("bound");
    let c = case("two_cams_mqa");
    // A velocity bias off by 1 moves the actions by ~1: far above the 5e-2 default.
    let ck = poisoned_checkpoint(&c, &s.0, 1.0);
    let out = s.0.join("export");
    export_from(&c, &ck, &out);
    let o = verify(&c, &out, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "verify passed a wrong export");
    assert!(
        err.contains("exceeds --max-error 5e-2"),
        "{err}\n{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let v = &report(&out)["verify"];
    let e = v["max_abs_action_error"].as_f64().unwrap();
    assert!(e > 0.05, "{v}");
    assert_eq!(v["max_error"].as_f64().unwrap(), 5e-2);
    assert_eq!(v["within_bound"], false);
    // A looser explicit bound passes the same files; the bound is recorded.
    ok(verify(&c, &out, &["--max-error", "100"]));
    let v = &report(&out)["verify"];
    assert_eq!(v["within_bound"], true);
    assert_eq!(v["max_error"].as_f64().unwrap(), 100.0);
    assert_eq!(
        petite::verify::DEFAULT_MAX_ERROR,
        5e-2,
        "the README's flags table names this default"
    );
}

/// `--device cuda` where CUDA cannot run (this CI machine: no driver) is refused in one line,
/// before any input is read: paths that do not exist are never reached. Where a GPU is present
/// the gpu conformance tier covers the device path instead, and this checks nothing.
#[test]
fn device_cuda_without_a_driver_is_refused_before_any_work() {
    if petite_cuda::probe().usable().is_ok() {
        return;
    }
    for args in [
        &[
            "verify",
            "--device",
            "cuda",
            "--pte-dir",
            "/nonexistent",
            "--checkpoint",
            "/nonexistent",
        ][..],
        &[
            "pi05",
            "run",
            "--device",
            "cuda",
            "--checkpoint",
            "/nonexistent",
            "--inputs",
            "/nonexistent",
            "--out",
            "/nonexistent/a",
        ][..],
    ] {
        let o = common::petite()
            .env("RUST_BACKTRACE", "0")
            .args(args)
            .output()
            .unwrap();
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        let first = err.lines().next().unwrap_or("");
        assert!(
            first.contains("--device cuda: CUDA is not available here")
                && !err.contains("nonexistent"),
            "{args:?}: {err}"
        );
    }
}
