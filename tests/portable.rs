//! `petite export --backend portable` end to end on the lerobot golden cases, as separate
//! processes: what the files hold (kernel calls only, both methods of `step.pte`, planned memory,
//! every weight written once, straight into its `.pte`, no mapping file), a re-run and a killed
//! run resumed giving identical bytes, and the bad-input contract. Running the files in ExecuTorch's runtime (and
//! comparing with lerobot's goldens) needs a Python venv, so it lives where the repo's other
//! runtime checks live: the portable tier of `cargo xtask conformance`
//! (`xtask/src/conformance/portable.rs`), which CI runs after these tests.
mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{Scratch, case, ok, outputs, report, spawn_stopped, verify_cmd};
use petite_pte::PteFile;

fn export_cmd(c: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut cmd = common::export_cmd(c, out);
    cmd.args(["--backend", "portable"]).args(extra);
    cmd
}

/// `petite verify` of the files in `dir` against golden case `c`, with a `--python` that does
/// not exist: what is refused before (or instead of) running ExecuTorch's runtime.
fn verify_without_python(c: &Path, dir: &Path) -> Output {
    verify_cmd(c, dir)
        .arg("--python")
        .arg(dir.join("no-such-python"))
        .output()
        .unwrap()
}

#[test]
fn portable_export_writes_kernel_calls_and_copies_each_weight_once() {
    for dtype in ["f32", "bf16"] {
        for name in ["two_cams_mqa", "three_cams_masked_gqa"] {
            let s = Scratch::new(&format!("ok-{dtype}-{name}"));
            let c = case(name);
            ok(export_cmd(&c, &s.0, &["--dtype", dtype]).output().unwrap());
            let r = report(&s.0);
            assert_eq!(r["backend"], "portable");
            assert_eq!(r["dtype"], dtype);
            for (file, methods) in [
                ("prefix.pte", &["forward"][..]),
                ("step.pte", &["forward", "timestep_table"][..]),
            ] {
                let pte = PteFile::open(s.0.join(file)).unwrap();
                let plans = &pte.program().execution_plan;
                let names: Vec<&str> = plans.iter().map(|p| p.name.as_str()).collect();
                assert_eq!(names, methods, "{file}");
                for p in plans {
                    assert!(p.delegates.is_empty(), "{file} {}: delegates", p.name);
                    assert!(!p.operators.is_empty(), "{file} {}", p.name);
                    for op in &p.operators {
                        let full = format!("{}.{}", op.name, op.overload);
                        assert!(
                            petite_portable::OPERATORS.contains(&full.as_str()),
                            "{file}: {full} is not a registered portable operator"
                        );
                    }
                }
                // The description a driver feeds the methods by.
                let spec: serde_json::Value = serde_json::from_str(
                    &std::fs::read_to_string(s.0.join(format!("{file}.json"))).unwrap(),
                )
                .unwrap();
                let described: Vec<&str> = spec["methods"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|m| m["method"].as_str().unwrap())
                    .collect();
                assert_eq!(described, methods);
                for m in spec["methods"].as_array().unwrap() {
                    let plan = &m["plan"];
                    let (planned, live) = (
                        plan["planned_bytes"].as_u64().unwrap(),
                        plan["max_live_bytes"].as_u64().unwrap(),
                    );
                    assert!(
                        planned >= live && planned as f64 <= 1.5 * live as f64,
                        "{plan}"
                    );
                }
            }
            // Every weight converted straight into its .pte: no mapping file, no partial left.
            let weights = r["totals"]["weight_bytes"].as_u64().unwrap();
            assert!(weights > 0);
            assert_eq!(r["weights"]["bytes"].as_u64().unwrap(), weights);
            assert_eq!(r["weights"]["resumed"], 0);
            assert_eq!(
                r["totals"]["bytes_written_files"],
                r["programs"]["prefix"]["bytes"].as_u64().unwrap()
                    + r["programs"]["step"]["bytes"].as_u64().unwrap()
            );
            assert!(!s.0.join("cache").exists() && !s.0.join("engines").exists());
            // f32 and bf16 store different bytes.
            let prefix_bytes = r["programs"]["prefix"]["bytes"].as_u64().unwrap();
            assert_eq!(
                prefix_bytes,
                std::fs::metadata(s.0.join("prefix.pte")).unwrap().len()
            );
        }
    }
}

#[test]
fn rerun_and_killed_run_resumed_give_identical_bytes() {
    let s = Scratch::new("rerun");
    let c = case("one_cam_mha_unpadded");
    ok(export_cmd(&c, &s.0, &["--dtype", "f32"]).output().unwrap());
    let first = outputs(&s.0);
    ok(export_cmd(&c, &s.0, &["--dtype", "f32"]).output().unwrap());
    assert_eq!(first, outputs(&s.0));
    // Killed once the prefix's weights are journaled: the re-run keeps them.
    let out = s.0.join("killed");
    let mut child = spawn_stopped(
        &mut export_cmd(&c, &out, &["--dtype", "f32"]),
        "weights:prefix:0",
    );
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!out.join("prefix.pte").exists());
    ok(export_cmd(&c, &out, &["--dtype", "f32"]).output().unwrap());
    let r = report(&out);
    assert!(r["weights"]["resumed"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(first, outputs(&out));
    assert!(!out.join("engines").exists());
    // Another dtype is another export (the partial of the other is not reused).
    ok(export_cmd(&c, &s.0, &["--dtype", "bf16"]).output().unwrap());
    assert_eq!(report(&s.0)["weights"]["resumed"], 0);
    assert_ne!(first.0, std::fs::read(s.0.join("prefix.pte")).unwrap());
}

#[test]
fn bad_input_is_refused_before_any_file_is_written() {
    let s = Scratch::new("bad");
    let c = case("two_cams_mqa");
    let out = s.0.join("out");
    let refused = |extra: &[&str], expect: &[&str]| {
        let o = export_cmd(&c, &out, extra).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(!o.status.success(), "should fail");
        for e in expect {
            assert!(err.contains(e), "expected `{e}` in:\n{err}");
        }
        assert!(!err.contains("panicked"), "{err}");
        assert!(!out.exists(), "{} created: {err}", out.display());
    };
    // Engines do not exist here: an engine cap is a mistake, said so.
    refused(&["--engine-cap", "1MiB"], &["--engine-cap", "portable"]);
    // A budget below the conversion's working set: refused with the numbers.
    refused(
        &["--memory-budget", "1MiB"],
        &["memory budget 1.0 MiB is too small", "process base"],
    );
}

#[test]
fn verify_without_a_runtime_python_says_how_to_get_one() {
    let s = Scratch::new("nopython");
    let c = case("two_cams_mqa");
    ok(export_cmd(&c, &s.0, &["--dtype", "f32"]).output().unwrap());
    let o = verify_without_python(&c, &s.0);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    for e in [
        "no-such-python",
        "executorch-numpy-runtime",
        "--python",
        "PETITE_PYTHON",
        "cargo xtask conformance",
    ] {
        assert!(err.contains(e), "expected `{e}` in:\n{err}");
    }
    // Nothing was recorded for a verification that did not run.
    assert!(report(&s.0).get("verify").is_none());
}

#[test]
fn verify_names_a_config_the_files_were_not_exported_with() {
    let s = Scratch::new("otherconfig");
    let c = case("two_cams_mqa");
    ok(export_cmd(&c, &s.0, &["--dtype", "f32"]).output().unwrap());
    // The checkpoint matches the other config, so only the .pte files disagree.
    let other = case("one_cam_mha_unpadded");
    let o = verify_without_python(&other, &s.0);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("exported with another config") && err.contains("pte.json"),
        "{err}"
    );
}
