//! `petite verify`'s accuracy contract end to end: an export whose actions hold NaN fails and
//! says "NaN" (the old fold let a NaN through unless it was last), and without `--max-error`
//! the default bound follows the export's dtype (`petite::verify::default_bound`: 1e-4 for f32,
//! 5e-2 for bf16 or unrecorded): above it, exit non-zero.
mod common;

use std::path::{Path, PathBuf};

use common::{Scratch, case, ok, report, verify_cmd};

/// The bias of the last projection (velocity = … + bias): changing one element moves one action
/// column at the first step and, through the next steps' inputs, every action after.
const BIAS: &str = "model.action_out_proj.bias";

/// A copy of golden case `c`'s checkpoint with `BIAS[0]` replaced by `poison(BIAS[0])`, in `dir`.
fn poisoned_checkpoint(c: &Path, dir: &Path, poison: impl Fn(f32) -> f32) -> PathBuf {
    let mut bytes = std::fs::read(c.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let t = &header[BIAS];
    assert_eq!(t["dtype"], "F32", "{t}");
    let start = 8 + n + t["data_offsets"][0].as_u64().unwrap() as usize;
    let old = f32::from_le_bytes(bytes[start..start + 4].try_into().unwrap());
    bytes[start..start + 4].copy_from_slice(&poison(old).to_le_bytes());
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
    let ck = poisoned_checkpoint(&c, &s.0, |_| f32::NAN);
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
fn without_max_error_the_default_bound_follows_the_dtype() {
    let s = Scratch::new("bound");
    let c = case("two_cams_mqa");
    // A velocity bias off by 1e-2 moves the actions by about that: far above the f32 export's
    // 1e-4 default, well inside the bf16 bound 5e-2.
    let ck = poisoned_checkpoint(&c, &s.0, |b| b + 1e-2);
    let out = s.0.join("export");
    export_from(&c, &ck, &out);
    let o = verify(&c, &out, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "verify passed a wrong f32 export");
    assert!(
        err.contains("exceeds the bound 1e-4 (f32 export (report.json))"),
        "{err}\n{}",
        String::from_utf8_lossy(&o.stdout)
    );
    common::error_line(&err);
    let v = &report(&out)["verify"];
    let e = v["max_abs_action_error"].as_f64().unwrap();
    assert!(e > 1e-3 && e < 5e-2, "{v}");
    assert_eq!(v["max_error"].as_f64().unwrap(), 1e-4);
    assert_eq!(v["within_bound"], false);
    // A looser explicit bound passes the same files; the bound and its source are recorded.
    let o = verify(&c, &out, &["--max-error", "5e-2"]);
    ok(o.clone());
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("bound 5e-2: --max-error"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let v = &report(&out)["verify"];
    assert_eq!(v["within_bound"], true);
    assert_eq!(v["max_error"].as_f64().unwrap(), 5e-2);
    assert_eq!(v["bound"], "--max-error");
    // Without report.json the dtype is unknown: the bf16 bound, said so.
    std::fs::remove_file(out.join("report.json")).unwrap();
    let o = verify(&c, &out, &[]);
    ok(o.clone());
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("dtype not recorded"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    // An unreadable report is an error naming it, never replaced by `{}`.
    std::fs::write(out.join("report.json"), "{not json").unwrap();
    let o = verify(&c, &out, &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(common::error_line(&err).contains("report.json"), "{err}");
    assert_eq!(
        std::fs::read_to_string(out.join("report.json")).unwrap(),
        "{not json",
        "left as it was"
    );
    assert_eq!(petite::verify::DEFAULT_MAX_ERROR, 5e-2);
    assert_eq!(petite::verify::F32_MAX_ERROR, 1e-4);
}

/// `--stages concurrent` runs the engines and the f32 reference in two threads: the same actions
/// and reference, bit for bit, as one after the other, and the report says which ran; `auto` on
/// the CPU runs them at once where the machine's memory holds both.
#[test]
fn stages_at_once_give_the_same_bits_as_one_after_the_other() {
    use petite::verify::{Stages, VerifyOptions, verify};
    let s = Scratch::new("stages");
    let c = case("two_cams_mqa");
    let out = s.0.join("export");
    export_from(&c, &c.join("model.safetensors"), &out);
    let run = |stages| {
        let r = verify(&VerifyOptions {
            dir: out.clone(),
            checkpoint: c.join("model.safetensors"),
            config: Some(c.join("config.json")),
            inputs: Some(c.join("inputs.safetensors")),
            seed: 0,
            python: None,
            max_error: None,
            device: petite::runtimes::Device::default(),
            stages,
        })
        .unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(!r.actions.is_empty() && r.actions.len() == r.reference.len());
        (bits(&r.actions), bits(&r.reference), r.json)
    };
    let (a1, r1, j1) = run(Stages::Serial);
    let (a2, r2, j2) = run(Stages::Concurrent);
    assert_eq!(a1, a2, "actions");
    assert_eq!(r1, r2, "reference");
    assert_eq!(j1["stages_at_once"], false);
    assert_eq!(j2["stages_at_once"], true);
    for j in [&j1, &j2] {
        let names: Vec<_> = j["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(names, ["pte", "reference"], "{j}");
    }
    // Auto on the CPU: at once where the machine's memory holds both stages (6 GiB), and the
    // report says so either way.
    let (a3, r3, j) = run(Stages::Auto);
    assert_eq!((a3, r3), (a1, r1), "auto's bits");
    let why = j["stages_why"].as_str().unwrap();
    let roomy = petite::memory::machine_memory().is_some_and(|(_, m)| m >= 6 << 30);
    assert_eq!(j["stages_at_once"], roomy, "{why}");
    assert!(why.contains("on the CPU"), "{j}");
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
