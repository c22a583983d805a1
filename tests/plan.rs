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
