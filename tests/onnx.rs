//! `petite export --backend onnx` end to end on the lerobot golden cases, as separate processes:
//! the files (one model, its external data = the mapping file, its interface), the interface
//! against the golden `inputs.safetensors`, each weight stored once and none inside the
//! protobuf, a re-run reusing the data file in place with identical bytes, and the bad-input
//! contract of export and verify. Running the model in ONNX Runtime (and comparing with
//! lerobot's goldens) needs a Python venv, so it lives in the onnx tier of `cargo xtask
//! conformance` (`xtask/src/conformance/onnx.rs`), which CI runs after these tests.
mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{Scratch, case, ok, report, verify_cmd};
use petite_weights::{MappedSafetensors, WeightSource};

fn export_cmd(c: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut cmd = common::export_cmd(c, out);
    cmd.args(["--backend", "onnx"]).args(extra);
    cmd
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn count(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).filter(|w| *w == needle).count()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn onnx_export_writes_one_model_with_each_weight_once() {
    for dtype in ["f32", "bf16"] {
        for name in ["two_cams_mqa", "three_cams_masked_gqa"] {
            let s = Scratch::new(&format!("ok-{dtype}-{name}"));
            let c = case(name);
            ok(export_cmd(&c, &s.0, &["--dtype", dtype]).output().unwrap());
            let r = report(&s.0);
            assert_eq!(r["backend"], "onnx");
            assert_eq!(r["dtype"], dtype);
            assert!(!s.0.join("prefix.pte").exists() && !s.0.join("step.pte").exists());
            // The mapping file became the external data: nothing left in the cache.
            let cached: Vec<_> = std::fs::read_dir(s.0.join("cache")).unwrap().collect();
            assert!(cached.is_empty(), "{cached:?}");
            assert!(s.0.join("pi05.onnx.data.seal").exists());

            // The interface: exactly the golden inputs' names, dtypes and shapes, in order, then
            // real-time chunking's guidance.
            let spec = json(&s.0.join("pi05.onnx.json"));
            assert_eq!(spec["opset"], 17);
            assert_eq!(spec["ir_version"], 8);
            assert_eq!(spec["dtype"], dtype);
            assert_eq!(spec["external_data"], serde_json::json!(["pi05.onnx.data"]));
            assert_eq!(spec["runtimes"]["onnxruntime_cpu"], dtype == "f32");
            let golden = MappedSafetensors::open(c.join("inputs.safetensors")).unwrap();
            let names: Vec<&str> = spec["inputs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["name"].as_str().unwrap())
                .collect();
            assert_eq!(
                names,
                [
                    "images",
                    "image_masks",
                    "tokens",
                    "token_mask",
                    "noise",
                    "rtc_prev",
                    "rtc_weights",
                    "rtc_steps"
                ]
            );
            let cfg = petite_pi05::Pi05Config::from_json_file(c.join("config.json")).unwrap();
            for (i, shape) in spec["inputs"].as_array().unwrap()[5..].iter().zip([
                vec![cfg.chunk, cfg.action_dim],
                vec![cfg.chunk, 1],
                vec![cfg.steps, 2],
            ]) {
                assert_eq!(i["dtype"], "f32", "{i}");
                assert_eq!(
                    serde_json::from_value::<Vec<usize>>(i["shape"].clone()).unwrap(),
                    shape
                );
            }
            for i in &spec["inputs"].as_array().unwrap()[..5] {
                let info = golden.info(i["name"].as_str().unwrap()).unwrap();
                let shape: Vec<usize> = serde_json::from_value(i["shape"].clone()).unwrap();
                assert_eq!(shape, info.shape, "{i}");
                assert_eq!(i["dtype"], info.dtype.name(), "{i}");
            }
            let out = &spec["outputs"][0];
            assert_eq!(out["name"], "actions");
            assert_eq!(out["dtype"], "f32");
            let want: Vec<usize> = MappedSafetensors::open(c.join("expected.safetensors"))
                .unwrap()
                .info("actions")
                .unwrap()
                .shape;
            let got: Vec<usize> = serde_json::from_value(out["shape"].clone()).unwrap();
            assert_eq!(got, want);

            // Each weight the prefix and step read is one initializer (ten steps, one copy),
            // each pointing into pi05.onnx.data, whose bytes are not inside the protobuf.
            let cfg = petite_pi05::Pi05Config::from_json_file(c.join("config.json")).unwrap();
            let prec = dtype.parse().unwrap();
            let progs = petite_pi05::build_all(&cfg, prec).unwrap();
            let distinct = progs.prefix.weights().len() + progs.step.weights().len();
            assert_eq!(r["onnx"]["initializers"], distinct, "{}", r["onnx"]);
            let model = std::fs::read(s.0.join("pi05.onnx")).unwrap();
            assert_eq!(count(&model, b"pi05.onnx.data"), distinct);
            assert_eq!(r["onnx"]["model_bytes"], model.len());
            let data = MappedSafetensors::open(s.0.join("pi05.onnx.data")).unwrap();
            let mut largest = data.names();
            largest.sort_by_key(|n| std::cmp::Reverse(data.tensor(n).unwrap().bytes.len()));
            for n in largest.iter().take(3) {
                let b = data.tensor(n).unwrap().bytes;
                let probe = &b[b.len() / 2..b.len() / 2 + 64];
                assert_eq!(count(&model, probe), 0, "{n}'s bytes are inside pi05.onnx");
            }
            // Every weight is in the data file in the dtype the program declares.
            for w in progs.prefix.weights().iter().chain(&progs.step.weights()) {
                assert_eq!(data.info(&w.name).unwrap().dtype, w.dtype, "{}", w.name);
            }
            assert!(r["onnx"]["initializers_page_aligned"].as_u64().unwrap() > 0);
        }
    }
}

#[test]
fn rerun_reuses_the_data_file_in_place_with_identical_bytes() {
    let s = Scratch::new("rerun");
    let c = case("two_cams_mqa");
    ok(export_cmd(&c, &s.0, &["--dtype", "f32"]).output().unwrap());
    let model = std::fs::read(s.0.join("pi05.onnx")).unwrap();
    let data = std::fs::read(s.0.join("pi05.onnx.data")).unwrap();
    assert_eq!(report(&s.0)["mapping"]["reused"], false);
    ok(export_cmd(&c, &s.0, &["--dtype", "f32"]).output().unwrap());
    let r = report(&s.0);
    assert_eq!(r["mapping"]["reused"], true);
    assert_eq!(r["onnx"]["data_moved_from_cache"], false);
    assert_eq!(model, std::fs::read(s.0.join("pi05.onnx")).unwrap());
    assert_eq!(data, std::fs::read(s.0.join("pi05.onnx.data")).unwrap());
    // Another dtype: a new mapping file, published over the old one.
    ok(export_cmd(&c, &s.0, &["--dtype", "bf16"]).output().unwrap());
    let r = report(&s.0);
    assert_eq!(r["mapping"]["reused"], false);
    assert_eq!(json(&s.0.join("pi05.onnx.json"))["dtype"], "bf16");
    assert_ne!(data, std::fs::read(s.0.join("pi05.onnx.data")).unwrap());
    // A damaged data file is rebuilt, not reused.
    let p = s.0.join("pi05.onnx.data");
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len - 4096)
        .unwrap();
    let o = ok(export_cmd(&c, &s.0, &["--dtype", "bf16"]).output().unwrap());
    assert!(stderr(&o).contains("is damaged"), "{}", stderr(&o));
    assert_eq!(report(&s.0)["mapping"]["reused"], false);
    assert_eq!(std::fs::metadata(&p).unwrap().len(), len);
}

#[test]
fn bad_input_is_refused_before_any_file_is_written() {
    let s = Scratch::new("bad");
    let c = case("two_cams_mqa");
    let other = case("three_cams_masked_gqa");
    let out = s.0.join("out");
    let cases: Vec<(Command, &[&str])> = vec![
        (
            export_cmd(&c, &out, &["--engine-cap", "1MiB"]),
            &["--engine-cap does not apply to --backend onnx"],
        ),
        (
            export_cmd(&c, &out, &["--placement", "device"]),
            &["--placement device", "--backend onnx", "drop --placement"],
        ),
        (
            {
                let mut cmd = export_cmd(&c, &out, &[]);
                cmd.arg("--memory-budget").arg("1MiB");
                cmd
            },
            &["memory budget", "too small", "nothing was done"],
        ),
        (
            {
                // A config whose shapes the checkpoint does not have.
                let mut cmd = common::petite();
                cmd.arg("export")
                    .args(["--backend", "onnx"])
                    .arg("--checkpoint")
                    .arg(c.join("model.safetensors"))
                    .arg("--config")
                    .arg(other.join("config.json"))
                    .arg("--out")
                    .arg(&out);
                cmd
            },
            &["model.safetensors", "expected"],
        ),
    ];
    for (mut cmd, want) in cases {
        let o = cmd.output().unwrap();
        let err = stderr(&o);
        assert!(!o.status.success(), "should fail");
        for e in want {
            assert!(err.contains(e), "expected `{e}` in:\n{err}");
        }
        assert!(!err.contains("panicked"), "{err}");
        assert!(!out.exists(), "{} created: {err}", out.display());
    }
}

#[test]
fn verify_refuses_what_onnx_runtime_cannot_run_before_running() {
    let c = case("two_cams_mqa");
    // bf16: refused by the model's dtype, before any Python is looked for.
    let s = Scratch::new("verify-bf16");
    ok(export_cmd(&c, &s.0, &["--dtype", "bf16"]).output().unwrap());
    let o = verify_cmd(&c, &s.0)
        .arg("--python")
        .arg(s.0.join("no-such-python"))
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(!o.status.success());
    for e in [
        "bf16 model",
        "no bf16 Gemm/MatMul",
        "--dtype f32",
        "trtexec",
    ] {
        assert!(err.contains(e), "expected `{e}` in:\n{err}");
    }
    assert!(report(&s.0).get("verify").is_none());

    let s = Scratch::new("verify-f32");
    ok(export_cmd(&c, &s.0, &["--dtype", "f32"]).output().unwrap());
    // No onnxruntime: says what to install and where.
    for python in [s.0.join("no-such-python"), "/bin/false".into()] {
        let o = verify_cmd(&c, &s.0)
            .arg("--python")
            .arg(&python)
            .output()
            .unwrap();
        let err = stderr(&o);
        assert!(!o.status.success());
        // One line says what failed and what to do.
        let line = err
            .lines()
            .find(|l| l.contains("onnxruntime"))
            .unwrap_or("");
        for e in [
            python.to_str().unwrap(),
            "--python",
            "PETITE_ORT_PYTHON",
            "target/venv-ort",
        ] {
            assert!(line.contains(e), "expected `{e}` in one line of:\n{err}");
        }
    }
    // A config the model was not exported with: the tensor named, expected and found.
    let other = case("three_cams_masked_gqa");
    let o = common::petite()
        .arg("verify")
        .arg("--pte-dir")
        .arg(&s.0)
        .arg("--checkpoint")
        .arg(other.join("model.safetensors"))
        .arg("--config")
        .arg(other.join("config.json"))
        .arg("--python")
        .arg(s.0.join("no-such-python"))
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(!o.status.success());
    for e in [
        "pi05.onnx.json",
        "`images`",
        "[2, 3, 32, 32]",
        "[3, 3, 28, 28]",
    ] {
        assert!(err.contains(e), "expected `{e}` in:\n{err}");
    }
    assert!(report(&s.0).get("verify").is_none());
}
