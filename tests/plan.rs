//! `petite plan` end to end: the full-size pi0.5 programs plan without a checkpoint, the JSON is
//! the same on every run, engines stay within the cap (or are marked), bad input is named.
use std::process::Command;

fn petite(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_petite"))
        .args(args)
        .output()
        .expect("run petite")
}

#[test]
fn plan_json_is_deterministic_and_within_cap() {
    for (program, cap, cap_bytes) in [
        ("prefix", "512MiB", 512u64 << 20),
        ("step", "256MiB", 256 << 20),
    ] {
        let args = ["plan", "--program", program, "--engine-cap", cap, "--json"];
        let a = petite(&args);
        assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
        let b = petite(&args);
        assert_eq!(a.stdout, b.stdout, "{program}: JSON differs between runs");
        let plan: serde_json::Value = serde_json::from_slice(&a.stdout).unwrap();
        let engines = plan["engines"].as_array().unwrap();
        assert!(engines.len() > 1, "{program} at {cap} must split");
        for e in engines {
            let w = e["weight_bytes"].as_u64().unwrap();
            assert!(w <= cap_bytes || e["over_cap"].as_bool().unwrap(), "{e}");
        }
        assert_eq!(
            plan["boundaries"].as_array().unwrap().len(),
            engines.len() - 1
        );
    }
}

#[test]
fn plan_table_lists_engines_and_boundaries() {
    let out = petite(&["plan", "--program", "step", "--engine-cap", "256MiB"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("boundaries (bytes crossing each cut):"),
        "{text}"
    );
    assert!(text.contains("expert.layers"), "{text}");
}

#[test]
fn plan_bad_input_is_named() {
    let out = petite(&["plan", "--program", "prefix", "--engine-cap", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("engine_cap"));
    let out = petite(&["plan", "--program", "prefix", "--engine-cap", "1KiB"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("smallest possible engine") && err.contains("node %"),
        "{err}"
    );
    let out = petite(&["plan", "--program", "prefix", "--engine-cap", "5 furlongs"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("furlongs"));
}

/// Settings are parsed before any work: a malformed `PETITE_*` value, or a `--tune` that is
/// unknown or off the GPU path, exits 2 with one line naming it; `petite doctor` lists every
/// setting and names a malformed or removed one instead of refusing it.
#[test]
fn malformed_settings_and_tune_are_usage_errors_and_doctor_names_them() {
    let run = |envs: &[(&str, &str)], args: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_petite"));
        c.env("RUST_BACKTRACE", "0").args(args);
        for (k, v) in envs {
            c.env(k, v);
        }
        c.output().expect("run petite")
    };
    let plan = ["plan", "--program", "step", "--json"];
    for (k, v) in [
        ("PETITE_CUDA_UPLOAD_THREADS", "abc"),
        ("PETITE_CUDA_PROFILE", "yes"),
        ("PETITE_KEEP_MIB", "-1"),
        ("PETITE_CPU_AMX", "maybe"),
    ] {
        let o = run(&[(k, v)], &plan);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{k}={v}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains(k) && err.contains("is not a value it takes"),
            "{err}"
        );
    }
    // `0` is off everywhere (it once turned the CUDA profile on).
    let o = run(
        &[("PETITE_CUDA_PROFILE", "0"), ("PETITE_CPU_PROFILE", "0")],
        &plan,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // A removed name is ignored, and said so.
    let o = run(&[("PETITE_CUDA_NO_PDL", "1")], &plan);
    assert!(o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("ignoring the removed PETITE_CUDA_NO_PDL"));
    let tune = |t: &str| {
        let o = run(
            &[],
            &[
                "pi05",
                "run",
                "--checkpoint",
                "/none",
                "--inputs",
                "/none",
                "--out",
                "/none",
                "--tune",
                t,
            ],
        );
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    for bad in ["pairs=off", "fuse=0", "attention_queries=some"] {
        let (code, err) = tune(bad);
        assert_eq!(code, Some(2), "{bad}: {err}");
        assert!(
            err.contains("--tune") && err.contains(bad.split('=').next().unwrap()),
            "{err}"
        );
    }
    let (code, err) = tune("fuse=off");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("--tune are for the GPU path"), "{err}");
    let o = run(
        &[
            ("PETITE_CUDA_UPLOAD_THREADS", "abc"),
            ("PETITE_CUDA_NO_PDL", "1"),
        ],
        &["doctor"],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for name in [
        "PETITE_CUDA_CACHE",
        "PETITE_CPU_AMX",
        "PETITE_KEEP_MIB",
        "PETITE_TRTEXEC",
    ] {
        assert!(out.contains(name), "{name}: {out}");
    }
    assert!(
        out.contains("invalid: PETITE_CUDA_UPLOAD_THREADS=\"abc\""),
        "{out}"
    );
    assert!(out.contains("ignored: PETITE_CUDA_NO_PDL=1"), "{out}");
}
