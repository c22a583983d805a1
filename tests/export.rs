//! `petite export` + `petite verify` end to end on the lerobot golden cases (small configs), as
//! separate processes like a user runs them: accuracy against the f32 reference, identical bytes
//! for identical inputs, resuming after SIGKILL / Ctrl-C, and the bad-input contract (clear
//! error, nothing under a final name, checkpoint untouched).
mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Scratch, case, ok, outputs, petite, report, verify_cmd};
use petite_pi05::inputs::{Inputs, open_checkpoint};
use petite_pi05::{Pi05Config, Precision};

/// lerobot 0.6.1's own max |actions_bf16 − actions| on these goldens is 7.95e-3 – 9.56e-3
/// (testdata/pi05/README.md). A bf16 export rounds the same weights and activations to the same
/// 8-bit mantissa, so its error against f32 is the same kind and size of noise; where it
/// rounds at slightly different points (fused ops, accumulation order) the noise is independent
/// of lerobot's, which can at most add another ~1e-2. Bound: 2.5e-2, below what the goldens
/// show real mistakes cost (an ignored mask 7–8e-2, a missing embedding scale 3.6–7.7e-2). Both
/// sides (the export and the f32 reference) are computed in this run on this CPU, so per-CPU
/// kernel choices (FMA or not in `gemm`) move both; the bit-for-bit checks below hold on any CPU
/// for the same reason.
const BF16_BOUND: f32 = 2.5e-2;

const CASES: [&str; 3] = [
    "two_cams_mqa",
    "three_cams_masked_gqa",
    "one_cam_mha_unpadded",
];

fn export_cmd(c: &Path, out: &Path, extra: &[&str]) -> Command {
    let mut cmd = common::export_cmd(c, out);
    cmd.args(["--engine-cap", "64KiB"]).args(extra);
    cmd
}

fn export(c: &Path, out: &Path, extra: &[&str]) -> Output {
    ok(export_cmd(c, out, extra).output().unwrap())
}

fn verify(c: &Path, dir: &Path) -> f32 {
    ok(verify_cmd(c, dir)
        .arg("--inputs")
        .arg(c.join("inputs.safetensors"))
        .output()
        .unwrap());
    report(dir)["verify"]["max_abs_action_error"]
        .as_f64()
        .unwrap() as f32
}

#[test]
fn bf16_export_within_bound_f32_export_exact_on_every_golden() {
    let s = Scratch::new("accuracy");
    for name in CASES {
        let c = case(name);
        let bf = s.0.join(format!("{name}-bf16"));
        let o = export(&c, &bf, &[]);
        let r = report(&bf);
        let prefix_engines = r["programs"]["prefix"]["engines"].as_array().unwrap().len();
        assert!(
            prefix_engines >= 2,
            "{name}: a 64 KiB cap splits the prefix"
        );
        assert!(String::from_utf8_lossy(&o.stdout).contains("total"));
        // Each weight read from the checkpoint once and written once, into its `.pte`: no
        // mapping file, no engine files (the partial `.pte`s under engines/ are renamed).
        assert!(!bf.join("engines").exists() && !bf.join("cache").exists());
        assert!(r["mapping"].is_null(), "no mapping file to report");
        assert!(r["totals"]["written_per_weight_byte_all_files"].is_null());
        assert!(r["totals"]["written_per_weight_byte_mapping_plus_pte"].is_null());
        assert!(r["totals"]["written_per_weight_byte_pte"].as_f64().unwrap() > 0.0);
        let err = verify(&c, &bf);
        assert!(
            err > 0.0 && err <= BF16_BOUND,
            "{name}: bf16 export max abs action error {err:e} (bound {BF16_BOUND:e})"
        );

        // The bf16 export runs exactly petite's bf16 numerics: same actions, bit for bit, as
        // the whole (unpartitioned) bf16 programs on the reference executor.
        let cfg = Pi05Config::from_json_file(c.join("config.json")).unwrap();
        let inputs = Inputs::from_file(c.join("inputs.safetensors"), &cfg).unwrap();
        let ck = open_checkpoint(c.join("model.safetensors")).unwrap();
        let whole = petite_pi05::run::run_model(&cfg, &ck, &inputs, Precision::Bf16).unwrap();
        let pte = petite::bundle::run_pte(&bf, &cfg, &inputs, petite::runtimes::Device::default())
            .unwrap()
            .actions;
        assert_eq!(
            pte, whole.actions,
            "{name}: bf16 .pte vs whole bf16 program"
        );

        // In f32, the partitioned export is the f32 reference bit for bit.
        let f = s.0.join(format!("{name}-f32"));
        export(&c, &f, &["--dtype", "f32"]);
        assert_eq!(verify(&c, &f), 0.0, "{name}: f32 export");
    }
}

#[test]
fn pte_files_pass_inspect_and_list_each_engine_once() {
    let s = Scratch::new("inspect");
    let c = case("three_cams_masked_gqa");
    export(&c, &s.0, &[]);
    let r = report(&s.0);
    for prog in ["prefix", "step"] {
        let o = ok(petite()
            .arg("inspect")
            .arg(s.0.join(format!("{prog}.pte")))
            .output()
            .unwrap());
        let text = String::from_utf8_lossy(&o.stdout);
        for e in r["programs"][prog]["engines"].as_array().unwrap() {
            let n = e["name"].as_str().unwrap();
            assert_eq!(
                text.matches(&format!("named data \"{n}\": ")).count(),
                1,
                "{prog}: engine {n} listed once\n{text}"
            );
        }
    }
}

#[test]
fn same_inputs_give_identical_bytes_and_a_rerun_reuses_everything() {
    let s = Scratch::new("determinism");
    let c = case("two_cams_mqa");
    let (a, b) = (s.0.join("a"), s.0.join("b"));
    export(&c, &a, &["--keep-engines"]);
    export(&c, &b, &[]);
    assert_eq!(outputs(&a), outputs(&b));
    // Re-run into the same directory: every engine reused, same bytes (engine files streamed
    // from the checkpoint, with no mapping file, equal the in-place segments of `b`).
    export(&c, &a, &["--keep-engines"]);
    let r = report(&a);
    assert_eq!(r["engines"]["built"], 0, "{r:#}");
    assert!(r["engines"]["reused"].as_u64().unwrap() >= 4);
    assert!(r["mapping"].is_null(), "no mapping file to report: {r:#}");
    assert_eq!(outputs(&a), outputs(&b));
}

/// A copy of golden case `name` in `dir`, whose files' modification times a test may change.
fn copy_case(name: &str, dir: &Path) -> std::path::PathBuf {
    let c = dir.join(name);
    std::fs::create_dir_all(&c).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(case(name).join(f), c.join(f)).unwrap();
    }
    c
}

/// Sets `path`'s modification time `by` later than it is.
fn touch_later(path: &Path, by: Duration) {
    let t = std::fs::metadata(path).unwrap().modified().unwrap();
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(t + by)
        .unwrap();
}

/// Design invariant 4 (no time stamps in content): the same checkpoint gives the same bytes
/// whenever its file was written (a fresh clone, a copy), for every backend that writes
/// `.pte` files — yet a re-run after the checkpoint's file changed reuses nothing of the
/// earlier run (its values may differ under the same header).
#[test]
fn checkpoint_modification_time_reaches_no_output_byte_and_still_forces_a_rebuild() {
    let s = Scratch::new("mtime");
    let c = copy_case("two_cams_mqa", &s.0);
    let model = c.join("model.safetensors");
    // The bytes each backend publishes: the programs, or the ONNX model, its external data
    // (the mapping file, whose header once recorded the modification-time key) and interface.
    let published = |backend: &str, dir: &Path| -> Vec<Vec<u8>> {
        if backend == "onnx" {
            ["pi05.onnx", "pi05.onnx.data", "pi05.onnx.json"]
                .iter()
                .map(|f| std::fs::read(dir.join(f)).unwrap())
                .collect()
        } else {
            let (p, st) = outputs(dir);
            vec![p, st]
        }
    };
    for backend in ["reference", "portable", "onnx"] {
        let (a, b) = (
            s.0.join(format!("{backend}-a")),
            s.0.join(format!("{backend}-b")),
        );
        let keep: &[&str] = if backend == "reference" {
            &["--keep-engines"]
        } else {
            &[]
        };
        // --engine-cap (this file's `export`) applies to the engine backends only.
        let run = |out: &Path, extra: &[&str]| {
            let mut cmd = if backend == "reference" {
                export_cmd(&c, out, extra)
            } else {
                common::export_cmd(&c, out)
            };
            ok(cmd.args(["--backend", backend]).output().unwrap());
        };
        run(&a, keep);
        let before = published(backend, &a);
        touch_later(&model, Duration::from_secs(3600));
        run(&b, &[]);
        assert!(
            before == published(backend, &b),
            "{backend}: the bytes changed with the checkpoint's modification time"
        );
        // Into the first directory again: the checkpoint's file changed, so its engines (onnx:
        // its mapping file, published as pi05.onnx.data) are built again, not reused; the
        // bytes are still the same.
        run(&a, keep);
        let r = report(&a);
        if backend == "reference" {
            assert_eq!(r["engines"]["reused"], 0, "{r:#}");
            assert!(r["engines"]["built"].as_u64().unwrap() >= 4, "{r:#}");
        }
        if backend == "onnx" {
            assert_eq!(r["mapping"]["reused"], false, "{r:#}");
        }
        assert!(
            before == published(backend, &a),
            "{backend}: the re-run's bytes differ"
        );
        // And once more, nothing changed: reused.
        if backend == "onnx" {
            run(&a, keep);
            assert_eq!(report(&a)["mapping"]["reused"], true);
            assert!(before == published(backend, &a));
        }
    }
}

/// Starts a slowed export and waits until `n` engines are finished: segments journaled as on
/// storage in the partial `.pte`s under `engines/` (engines are written in place).
fn start_and_wait_for_engines(c: &Path, out: &Path, n: usize) -> std::process::Child {
    let mut child = export_cmd(c, out, &["--pause-after-engine-ms", "400"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A liveness bound, not a speed test: it fails only when no new engine appears for 120 s,
    // however slow a loaded machine makes each one.
    let (mut t0, mut seen) = (Instant::now(), 0);
    loop {
        let done = std::fs::read_dir(out.join("engines"))
            .map(|rd| {
                rd.flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".journal"))
                    .filter_map(|e| std::fs::read_to_string(e.path()).ok())
                    .map(|j| j.lines().filter(|l| l.starts_with("segment ")).count())
                    .sum::<usize>()
            })
            .unwrap_or(0);
        if done >= n {
            return child;
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("export ended ({st}) before {n} engines were built");
        }
        if done > seen {
            (t0, seen) = (Instant::now(), done);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no new engine for 120 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sigkill_midway_then_rerun_reuses_engines_and_gives_identical_bytes() {
    let s = Scratch::new("sigkill");
    let c = case("three_cams_masked_gqa");
    let clean = s.0.join("clean");
    export(&c, &clean, &[]);
    let out = s.0.join("killed");
    let mut child = start_and_wait_for_engines(&c, &out, 2);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(!out.join("prefix.pte").exists() && !out.join("step.pte").exists());
    export(&c, &out, &[]);
    let r = report(&out);
    assert!(
        r["engines"]["reused"].as_u64().unwrap() >= 2,
        "engines written before the kill are reused: {}",
        r["engines"]
    );
    assert_eq!(outputs(&out), outputs(&clean));
}

#[test]
fn ctrl_c_stops_cleanly_and_the_rerun_resumes() {
    let s = Scratch::new("sigint");
    let c = case("two_cams_mqa");
    let out = s.0.join("out");
    let child = start_and_wait_for_engines(&c, &out, 1);
    // SAFETY: kill takes no pointers. The pid is our own child's, not yet reaped (we wait on it
    // below), so it cannot have been reused by another process.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("interrupted"), "{err}");
    assert!(!out.join("prefix.pte").exists() && !out.join("step.pte").exists());
    export(&c, &out, &[]);
    assert!(report(&out)["engines"]["reused"].as_u64().unwrap() >= 1);
}

fn fingerprint(p: &Path) -> (Vec<u8>, std::time::SystemTime) {
    (
        std::fs::read(p).unwrap(),
        std::fs::metadata(p).unwrap().modified().unwrap(),
    )
}

/// Runs a failing export; asserts a clear message and no final output.
fn refused(cmd: &mut Command, out: &Path, expect: &[&str]) -> String {
    let o = cmd.output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(!o.status.success(), "should fail");
    for e in expect {
        assert!(err.contains(e), "expected `{e}` in:\n{err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    // Exit 2 is clap's refusal of the command line itself (its own usage format); every other
    // failure ends in petite's one error line.
    if o.status.code() != Some(2) {
        common::error_line(&err);
    }
    for f in ["prefix.pte", "step.pte", "report.json"] {
        assert!(!out.join(f).exists(), "{f} written after a failure");
    }
    err
}

#[test]
fn bad_inputs_fail_clearly_write_nothing_and_leave_the_checkpoint_untouched() {
    let s = Scratch::new("bad");
    let c = case("two_cams_mqa");
    let model = c.join("model.safetensors");
    let before = fingerprint(&model);
    let out = s.0.join("out");
    let cmd = |ck: &Path, cfg: &Path, out: &Path, extra: &[&str]| {
        let mut k = petite();
        k.arg("export")
            .arg("--checkpoint")
            .arg(ck)
            .arg("--config")
            .arg(cfg)
            .arg("--out")
            .arg(out)
            .args(extra);
        k
    };
    let cfg = c.join("config.json");

    // Not a pi0.5 checkpoint (the inputs file is valid safetensors).
    refused(
        &mut cmd(&c.join("inputs.safetensors"), &cfg, &out, &[]),
        &out,
        &["pi0.5 checkpoint"],
    );
    // Not safetensors at all.
    refused(&mut cmd(&cfg, &cfg, &out, &[]), &out, &["config.json"]);
    // Partial: one tensor missing.
    let partial = s.0.join("partial.safetensors");
    {
        use petite_weights::{MappedSafetensors, SafetensorsWriter, TensorSpec, WeightSource};
        let src = MappedSafetensors::open(&model).unwrap();
        let missing = "model.paligemma_with_expert.gemma_expert.model.layers.1.mlp.up_proj.weight";
        let names: Vec<String> = src.names().into_iter().filter(|n| n != missing).collect();
        assert_eq!(names.len() + 1, src.names().len());
        let specs: Vec<TensorSpec> = names
            .iter()
            .map(|n| {
                let i = src.info(n).unwrap();
                TensorSpec::new(n, i.dtype, &i.shape)
            })
            .collect();
        let w = SafetensorsWriter::create(&partial, &specs, &[]).unwrap();
        for n in &names {
            w.write_at(n, 0, src.tensor(n).unwrap().bytes).unwrap();
        }
        w.finish().unwrap();
    }
    refused(
        &mut cmd(&partial, &cfg, &out, &[]),
        &out,
        &["layers.1.mlp.up_proj.weight", "no such tensor"],
    );
    // A config that does not match the checkpoint.
    let other = case("three_cams_masked_gqa").join("config.json");
    refused(&mut cmd(&model, &other, &out, &[]), &out, &["expected"]);
    // A budget too small: refused before any work, with the numbers; nothing created.
    let err = refused(
        &mut cmd(&model, &cfg, &out, &["--memory-budget", "1MiB"]),
        &out,
        &["memory budget 1.0 MiB is too small", "process base"],
    );
    assert!(
        !out.exists(),
        "refused budget must not create {}: {err}",
        out.display()
    );
    // An output directory that cannot be created (its parent is a file).
    let blocker = s.0.join("file");
    std::fs::write(&blocker, b"x").unwrap();
    refused(
        &mut cmd(&model, &cfg, &blocker.join("out"), &[]),
        &blocker.join("out"),
        &["create output directory"],
    );
    // A backend that is not available here is refused by name.
    refused(
        &mut cmd(&model, &cfg, &out, &["--backend", "cuda"]),
        &out,
        &[
            "invalid value 'cuda' for '--backend",
            "possible values: reference, tensorrt, portable",
        ],
    );
    assert_eq!(fingerprint(&model), before, "checkpoint modified");
}

#[test]
fn verify_refuses_a_mismatched_config_and_missing_pte() {
    let s = Scratch::new("verify-bad");
    let c = case("two_cams_mqa");
    export(&c, &s.0, &[]);
    let run = |cfg: &Path, dir: &Path| {
        petite()
            .arg("verify")
            // The former name of `--dir`, kept as a hidden alias so old scripts work.
            .arg("--pte-dir")
            .arg(dir)
            .arg("--checkpoint")
            .arg(c.join("model.safetensors"))
            .arg("--config")
            .arg(cfg)
            .output()
            .unwrap()
    };
    let o = run(&case("one_cam_mha_unpadded").join("config.json"), &s.0);
    assert!(!o.status.success());
    let o = run(&c.join("config.json"), &s.0.join("nowhere"));
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("prefix.pte"));
    // Seeded inputs (no --inputs) work too.
    let o = run(&c.join("config.json"), &s.0);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // --python does not apply to an engine bundle (its engines run here): refused in one line,
    // exit 2 (a usage error, as clap's), as every flag that does not apply.
    let o = verify_cmd(&c, &s.0)
        .args(["--python", "/nonexistent/python"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{err}");
    let line = common::error_line(&err);
    assert!(
        line.contains("--python does not apply to an engine bundle")
            && line.contains("drop --python"),
        "{line}"
    );
}

/// A Hub-layout copy of a golden checkpoint split over two shards with an index: detected,
/// exported, and its actions equal the lerobot-layout export's bit for bit.
#[test]
fn sharded_hub_layout_exports_the_same_model() {
    use petite_pi05::names::{Layout, stored_name};
    use petite_weights::{MappedSafetensors, SafetensorsWriter, TensorSpec, WeightSource};
    let s = Scratch::new("hub");
    let c = case("three_cams_masked_gqa");
    let src = MappedSafetensors::open(c.join("model.safetensors")).unwrap();
    let layout = Layout::Hub { prefixed: false };
    let mut entries: Vec<(String, String)> = src
        .names()
        .into_iter()
        .filter_map(|n| Some((stored_name(&n, layout)?, n)))
        .collect();
    entries.sort();
    let hub = s.0.join("hub");
    std::fs::create_dir_all(&hub).unwrap();
    let half = entries.len() / 2;
    let mut map = serde_json::Map::new();
    for (k, part) in [&entries[..half], &entries[half..]].iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", k + 1);
        let specs: Vec<TensorSpec> = part
            .iter()
            .map(|(stored, n)| {
                let i = src.info(n).unwrap();
                TensorSpec::new(stored, i.dtype, &i.shape)
            })
            .collect();
        let w = SafetensorsWriter::create(hub.join(&file), &specs, &[]).unwrap();
        for (stored, n) in part.iter() {
            w.write_at(stored, 0, src.tensor(n).unwrap().bytes).unwrap();
            map.insert(stored.clone(), serde_json::Value::String(file.clone()));
        }
        w.finish().unwrap();
    }
    std::fs::write(
        hub.join("model.safetensors.index.json"),
        serde_json::to_string(&serde_json::json!({"metadata": {}, "weight_map": map})).unwrap(),
    )
    .unwrap();

    let (a, b) = (s.0.join("lerobot"), s.0.join("hub-out"));
    export(&c, &a, &[]);
    ok(petite()
        .arg("export")
        .arg("--checkpoint")
        .arg(&hub)
        .arg("--config")
        .arg(c.join("config.json"))
        .arg("--out")
        .arg(&b)
        .args(["--engine-cap", "64KiB"])
        .output()
        .unwrap());
    let r = report(&b);
    assert_eq!(r["checkpoint"]["shards"], 2, "{}", r["checkpoint"]);
    assert!(
        r["checkpoint"]["layout"]
            .as_str()
            .unwrap()
            .starts_with("hub")
    );
    let cfg = Pi05Config::from_json_file(c.join("config.json")).unwrap();
    let inputs = Inputs::from_file(c.join("inputs.safetensors"), &cfg).unwrap();
    assert_eq!(
        petite::bundle::run_pte(&a, &cfg, &inputs, petite::runtimes::Device::default())
            .unwrap()
            .actions,
        petite::bundle::run_pte(&b, &cfg, &inputs, petite::runtimes::Device::default())
            .unwrap()
            .actions
    );
}

/// The device placement ExecuTorch plans for device delegates (the conformance tier compares it
/// with ExecuTorch's exporter field by field; this checks its invariants on the product's own
/// output): method inputs and outputs in host buffer 1; every delegate argument a CUDA-tagged
/// tensor in buffer 2, the only buffer `non_const_buffer_device` lists; an h2d copy into a fresh
/// device tensor for each delegate use of a method input, a d2h copy after the delegate that
/// produces each method output, no copy between delegates; `target_device=cuda:0` on every
/// delegate.
fn check_device_placement(pte: &Path) {
    use petite_pte::model::{DeviceType, EValue, Instruction};
    let f = petite_pte::PteFile::open(pte).unwrap();
    let plan = &f.program().execution_plan[0];
    assert_eq!(plan.name, "forward");
    let devs = plan
        .non_const_buffer_device
        .as_ref()
        .expect("device buffers");
    assert_eq!(devs.len(), 1);
    assert_eq!(
        (
            devs[0].buffer_idx,
            devs[0].device_type,
            devs[0].device_index
        ),
        (2, DeviceType::CUDA, 0)
    );
    let place = |v: i32| -> (u32, Option<DeviceType>) {
        let EValue::Tensor(t) = &plan.values[v as usize] else {
            panic!("value {v} is not a tensor")
        };
        let a = t.allocation_info.expect("planned");
        (
            a.memory_id,
            t.extra_tensor_info.as_ref().map(|e| e.device_type),
        )
    };
    let host = (1, None);
    let device = (2, Some(DeviceType::CUDA));
    for &v in plan.inputs.iter().chain(&plan.outputs) {
        assert_eq!(place(v), host, "method I/O value {v}");
    }
    let ops: Vec<String> = (plan.operators.iter())
        .map(|o| format!("{}.{}", o.name, o.overload))
        .collect();
    let (mut h2d, mut d2h, mut delegates) = (0, 0, 0);
    let mut copied_inputs = std::collections::BTreeSet::new();
    for ins in &plan.chains[0].instructions {
        match ins {
            Instruction::KernelCall { op_index, args } => {
                let op = &ops[*op_index as usize];
                assert_eq!(args.len(), 3);
                assert_eq!(args[1], args[2], "out is the return value");
                if op == "et_copy::_h2d_copy.out" {
                    assert!(plan.inputs.contains(&args[0]), "h2d from a method input");
                    assert_eq!((place(args[0]), place(args[1])), (host, device));
                    assert!(
                        copied_inputs.insert(args[1]),
                        "a fresh device tensor per use"
                    );
                    h2d += 1;
                } else {
                    assert_eq!(op, "et_copy::_d2h_copy.out");
                    assert!(plan.outputs.contains(&args[1]), "d2h into a method output");
                    assert_eq!((place(args[0]), place(args[1])), (device, host));
                    d2h += 1;
                }
            }
            Instruction::DelegateCall {
                delegate_index,
                args,
            } => {
                for &a in args {
                    assert_eq!(place(a), device, "delegate {delegate_index} arg {a}");
                }
                let d = &plan.delegates[*delegate_index as usize];
                let spec = d.compile_specs.iter().find(|c| c.key == "target_device");
                assert_eq!(spec.map(|c| c.value.as_slice()), Some(&b"cuda:0"[..]));
                delegates += 1;
            }
            other => panic!("unexpected instruction {other:?}"),
        }
    }
    assert!(delegates >= 1 && h2d >= plan.inputs.len().min(1));
    assert_eq!(d2h, plan.outputs.len(), "one d2h per method output");
}

/// A stand-in `trtexec` at `path`: answers `--help` with TensorRT's version banner (how a
/// trtexec is probed), then runs the shell `body`.
fn stand_in(path: &Path, body: &str) -> std::path::PathBuf {
    common::write_tool(
        path,
        &format!(
            "#!/bin/sh\ncase \"$1\" in --help) echo '[TensorRT v100300]'; exit 0;; esac\n{body}\n"
        ),
    )
}

/// `--backend tensorrt` with a stand-in `trtexec` (no TensorRT here): every engine becomes a
/// `TensorRTBackend` delegate stored once; verify refuses to run it by name; without `trtexec`
/// the export is refused before any work.
#[test]
fn tensorrt_backend_with_a_stand_in_trtexec() {
    let s = Scratch::new("trt");
    let c = case("two_cams_mqa");
    let fake = stand_in(
        &s.0.join("trtexec"),
        "for a in \"$@\"; do case \"$a\" in --saveEngine=*) out=\"${a#--saveEngine=}\";; \
         --onnx=*) onnx=\"${a#--onnx=}\";; esac; done\ntest -s \"$onnx\" || exit 3\n\
         head -c 1000 /dev/zero | tr '\\0' 'P' > \"$out\"",
    );

    let out = s.0.join("out");
    let o = export_cmd(&c, &out, &["--backend", "tensorrt"])
        .env("PETITE_TRTEXEC", &fake)
        .output()
        .unwrap();
    ok(o);
    let r = report(&out);
    assert_eq!(r["backend"], "tensorrt");
    assert!(!out.join("engines").exists());
    let o = ok(petite()
        .arg("inspect")
        .arg(out.join("prefix.pte"))
        .output()
        .unwrap());
    let text = String::from_utf8_lossy(&o.stdout);
    let n = r["programs"]["prefix"]["engines"].as_array().unwrap().len();
    assert_eq!(
        text.matches("delegate TensorRTBackend").count(),
        n,
        "{text}"
    );
    let v = verify_cmd(&c, &out).output().unwrap();
    assert!(!v.status.success());
    assert!(String::from_utf8_lossy(&v.stderr).contains("TensorRTBackend"));
    assert_eq!(r["placement"], "device cuda:0");
    for p in ["prefix", "step"] {
        check_device_placement(&out.join(format!("{p}.pte")));
    }

    // --placement host: the engines reused, one host buffer, no copies, no device tags.
    ok(
        export_cmd(&c, &out, &["--backend", "tensorrt", "--placement", "host"])
            .env("PETITE_TRTEXEC", &fake)
            .output()
            .unwrap(),
    );
    let rh = report(&out);
    assert_eq!(rh["placement"], "host");
    for p in ["prefix", "step"] {
        let f = petite_pte::PteFile::open(out.join(format!("{p}.pte"))).unwrap();
        for plan in &f.program().execution_plan {
            assert!(plan.non_const_buffer_device.is_none(), "{p}");
            assert!(plan.operators.is_empty(), "{p}: {:?}", plan.operators);
            assert!(plan.delegates.iter().all(|d| d.compile_specs.is_empty()));
            assert!(plan.non_const_buffer_sizes.len() <= 2);
        }
    }

    assert_eq!(r["builder"], "trtexec TensorRT 10.3.0");
    for p in ["prefix", "step"] {
        for e in r["programs"][p]["engines"].as_array().unwrap() {
            assert_eq!(e["plan_bytes"], 1000, "{e}");
            assert!(e["builder_peak_rss_bytes"].as_u64().unwrap() > 0, "{e}");
            assert!(e["build_s"].as_f64().unwrap() >= 0.0, "{e}");
        }
    }

    // --memory-budget picks TensorRT's cap from the builder's memory model (base + a multiple
    // of the engine's weights per dtype): cap = (budget - process base - model base) / the
    // larger multiple, every engine within it.
    let model = &r["build_memory_model"];
    let (mbase, per) = (
        model["base"].as_u64().unwrap(),
        model["per_full_byte"]
            .as_f64()
            .unwrap()
            .max(model["per_half_byte"].as_f64().unwrap()),
    );
    let budget: u64 = 400 << 20;
    let out3 = s.0.join("out3");
    ok(common::export_cmd(&c, &out3)
        .args(["--backend", "tensorrt", "--memory-budget", "400MiB"])
        .env("PETITE_TRTEXEC", &fake)
        .output()
        .unwrap());
    let r3 = report(&out3);
    let cap = r3["engine_cap"].as_u64().unwrap();
    assert!(
        cap > 0 && cap as f64 <= (budget - mbase) as f64 / per,
        "cap {cap}"
    );
    assert!(r3["memory_estimate"].as_u64().unwrap() <= budget);
    for p in ["prefix", "step"] {
        for e in r3["programs"][p]["engines"].as_array().unwrap() {
            assert!(e["over_cap"] == true || e["weight_bytes"].as_u64().unwrap() <= cap);
        }
    }

    // 24 MiB: the conversion alone needs more; refused with the numbers, nothing created.
    let out4 = s.0.join("out4");
    let o = export_cmd(
        &c,
        &out4,
        &["--backend", "tensorrt", "--memory-budget", "24MiB"],
    )
    .env("PETITE_TRTEXEC", &fake)
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("memory budget 24.0 MiB is too small") && err.contains("conversion"),
        "{err}"
    );
    assert!(!out4.exists());

    // No trtexec: refused up front, nothing written (not even the mapping file).
    let out2 = s.0.join("out2");
    let o = export_cmd(&c, &out2, &["--backend", "tensorrt"])
        .env("PETITE_TRTEXEC", s.0.join("no-such-trtexec"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("TensorRT is not available"));
    assert!(!out2.exists());

    // A crashing builder: named, no .pte under a final name, and a re-run with a working
    // builder finishes.
    let crash = stand_in(&s.0.join("crash"), "kill -SEGV $$");
    let out5 = s.0.join("out5");
    let o = export_cmd(&c, &out5, &["--backend", "tensorrt"])
        .arg("--trtexec")
        .arg(&crash)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("trtexec was killed by signal 11"), "{err}");
    assert!(!out5.join("prefix.pte").exists() && !out5.join("step.pte").exists());
    ok(export_cmd(&c, &out5, &["--backend", "tensorrt"])
        .arg("--trtexec")
        .arg(&fake)
        .output()
        .unwrap());

    // A builder killed after the first engine (SIGKILL, as the OOM killer does): the error
    // names it; the re-run reuses the engine already built and builds the rest.
    let marker = s.0.join("flaky.built-one");
    let flaky = stand_in(
        &s.0.join("flaky"),
        &format!(
            "if [ -e {m} ]; then kill -9 $$; fi\ntouch {m}\nexec {fake} \"$@\"",
            m = marker.display(),
            fake = fake.display()
        ),
    );
    let out6 = s.0.join("out6");
    // One build at a time: "after the first engine" is then the second engine.
    let cap = ["--backend", "tensorrt", "--jobs", "1"];
    let o = export_cmd(&c, &out6, &cap)
        .arg("--trtexec")
        .arg(&flaky)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("engine 1") && err.contains("trtexec was killed by signal 9"),
        "{err}"
    );
    assert!(!out6.join("prefix.pte").exists());
    ok(export_cmd(&c, &out6, &cap)
        .arg("--trtexec")
        .arg(&fake)
        .output()
        .unwrap());
    let r6 = report(&out6);
    assert_eq!(r6["engines"]["reused"], 1, "{}", r6["engines"]);
    assert!(
        r6["engines"]["built"].as_u64().unwrap() >= 2,
        "{}",
        r6["engines"]
    );
}

/// `--jobs`: engines built at once (a stand-in `trtexec` whose plan is the engine's ONNX model,
/// the first engine slowest, so builds overlap and finish out of order) give the engines and
/// `.pte` bytes of a build one at a time, in plan order; the report says how many ran at once.
/// A build that fails stops the others (those running finish and are kept): the error names
/// its engine, and the re-run reuses what finished. A `--jobs` above what `--memory-budget`
/// fits is refused in one line before any work.
#[test]
fn engines_built_at_once_give_the_bytes_of_a_build_one_at_a_time() {
    let s = Scratch::new("jobs");
    let c = case("three_cams_masked_gqa");
    let parse = "for a in \"$@\"; do case \"$a\" in --saveEngine=*) out=\"${a#--saveEngine=}\";; \
                 --onnx=*) onnx=\"${a#--onnx=}\";; esac; done\n";
    let fake = stand_in(
        &s.0.join("trtexec"),
        &format!(
            "{parse}case \"$onnx\" in *_000_*) sleep 0.5;; *) sleep 0.1;; esac\ncat \"$onnx\" > \"$out\""
        ),
    );
    let trt = |out: &Path, trtexec: &Path, jobs: &str| {
        export_cmd(&c, out, &["--backend", "tensorrt", "--jobs", jobs])
            .env("PETITE_TRTEXEC", trtexec)
            .output()
            .unwrap()
    };
    let serial = s.0.join("serial");
    ok(trt(&serial, &fake, "1"));
    let rs = report(&serial);
    assert_eq!(
        (&rs["jobs"], &rs["max_concurrent_builds"]),
        (&1.into(), &1.into())
    );
    let parallel = s.0.join("parallel");
    let o = ok(trt(&parallel, &fake, "3"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("petite: building up to 3 engines at once (--jobs 3"),
        "{err}"
    );
    assert_eq!(outputs(&serial), outputs(&parallel));
    let rp = report(&parallel);
    assert_eq!(rp["jobs"], 3);
    assert!(rp["max_concurrent_builds"].as_u64().unwrap() >= 2, "{rp:#}");
    for p in ["prefix", "step"] {
        let names = |r: &serde_json::Value| -> Vec<serde_json::Value> {
            let e = r["programs"][p]["engines"].as_array().unwrap();
            e.iter().map(|e| e["name"].clone()).collect()
        };
        assert_eq!(names(&rs), names(&rp), "{p}: same engines, same order");
    }
    assert!(
        rp["programs"]["prefix"]["engines"]
            .as_array()
            .unwrap()
            .len()
            >= 3
    );

    // The second engine's build fails while the first (slow) one runs: the export names the
    // failed engine, publishes nothing, and keeps the first; the re-run reuses it.
    let bad = stand_in(
        &s.0.join("bad"),
        &format!(
            "{parse}case \"$onnx\" in *prefix_001_*) exit 7;; esac\nexec {} \"$@\"",
            fake.display()
        ),
    );
    let out = s.0.join("failed");
    let o = trt(&out, &bad, "2");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("engine 1 (prefix_001_") && err.contains("trtexec exited with status 7"),
        "{err}"
    );
    assert!(!out.join("prefix.pte").exists() && !out.join("step.pte").exists());
    ok(trt(&out, &fake, "2"));
    let r = report(&out);
    assert!(
        r["engines"]["reused"].as_u64().unwrap() >= 1,
        "{}",
        r["engines"]
    );
    assert_eq!(outputs(&out), outputs(&serial));

    // Ctrl-C while two builds run: both finish, nothing is published, "interrupted"; the
    // re-run reuses what finished.
    let out = s.0.join("sigint");
    let child = export_cmd(&c, &out, &["--backend", "tensorrt", "--jobs", "2"])
        .env("PETITE_TRTEXEC", &fake)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while std::fs::read_dir(out.join("engines")).map_or(true, |rd| {
        !rd.flatten()
            .any(|e| e.file_name().to_string_lossy().ends_with(".tr01"))
    }) {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no engine in 120 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: kill takes no pointers; the pid is our own child's, not yet reaped.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("interrupted"), "{err}");
    assert!(!out.join("prefix.pte").exists() && !out.join("step.pte").exists());
    ok(trt(&out, &fake, "2"));
    assert!(report(&out)["engines"]["reused"].as_u64().unwrap() >= 1);
    assert_eq!(outputs(&out), outputs(&serial));

    // 900 MiB holds two builds under the builder's model (336 MiB each at this size), not
    // three: refused before anything is created.
    let refused = s.0.join("refused");
    let o = export_cmd(
        &c,
        &refused,
        &[
            "--backend",
            "tensorrt",
            "--memory-budget",
            "900MiB",
            "--jobs",
            "3",
        ],
    )
    .env("PETITE_TRTEXEC", &fake)
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let line = common::error_line(&err);
    assert!(
        line.contains("(--jobs 3: memory budget 900.0 MiB fits 2 builds at once")
            && line.contains("pass --jobs 2 or less"),
        "{line}"
    );
    assert!(!refused.exists());
}

/// `--weight-streaming-budget` with a stand-in `trtexec`: every engine is built with
/// `--weightStreaming` and every delegate of both `.pte` files carries exactly one
/// `weight_streaming_budget` compile spec, the budget as ASCII decimal bytes (Torch-TensorRT's
/// encoding), read back with petite-pte's reader; the budget is not part of the engine file (a
/// re-run with another budget reuses the engines and writes the new spec); a budget below one
/// layer's weights is refused before any work with the size to pass, and that size is accepted.
#[test]
fn weight_streaming_budget_builds_streamable_engines_and_writes_the_compile_spec() {
    let s = Scratch::new("trt-ws");
    let c = case("two_cams_mqa");
    let args_log = s.0.join("trtexec-args");
    let fake = stand_in(
        &s.0.join("trtexec"),
        &format!(
            "echo \"$@\" >> {log}\nfor a in \"$@\"; do case \"$a\" in --saveEngine=*) out=\"${{a#--saveEngine=}}\";; esac; done\n\
             head -c 1000 /dev/zero | tr '\\0' 'P' > \"$out\"",
            log = args_log.display()
        ),
    );
    let specs_of = |pte: &Path| -> Vec<Vec<(String, Vec<u8>)>> {
        let f = petite_pte::PteFile::open(pte).unwrap();
        f.program().execution_plan[0]
            .delegates
            .iter()
            .map(|d| {
                assert_eq!(d.id, "TensorRTBackend");
                (d.compile_specs.iter())
                    .map(|c| (c.key.clone(), c.value.clone()))
                    .collect()
            })
            .collect()
    };

    // Too small: refused before any work, naming the layer and the size to pass.
    let out = s.0.join("out");
    let mut cmd = export_cmd(&c, &out, &["--backend", "tensorrt"]);
    cmd.args(["--weight-streaming-budget", "1KiB"])
        .env("PETITE_TRTEXEC", &fake);
    let err = refused(
        &mut cmd,
        &out,
        &["is below one layer's weights", "in engine"],
    );
    assert!(!out.exists(), "nothing created");
    assert!(!args_log.exists(), "no engine built");
    let last = err.trim().lines().last().unwrap();
    let at = last.find("pass --weight-streaming-budget ").unwrap() + 31;
    let need = last[at..].split(' ').next().unwrap().to_string();
    let kib: u64 = need.strip_suffix("KiB").unwrap().parse().unwrap();
    // One KiB less than the suggestion is still below the layer.
    let mut cmd = export_cmd(&c, &out, &["--backend", "tensorrt"]);
    cmd.args(["--weight-streaming-budget", &format!("{}KiB", kib - 1)])
        .env("PETITE_TRTEXEC", &fake);
    refused(&mut cmd, &out, &["is below one layer's weights"]);

    // The suggested size: built weight-streamable, the spec in every delegate.
    ok(
        export_cmd(&c, &out, &["--backend", "tensorrt", "--keep-engines"])
            .args(["--weight-streaming-budget", &need])
            .env("PETITE_TRTEXEC", &fake)
            .output()
            .unwrap(),
    );
    let log = std::fs::read_to_string(&args_log).unwrap();
    let builds = log.lines().count();
    assert!(builds >= 2, "{log}");
    assert!(
        log.lines().all(|l| l.contains("--weightStreaming")),
        "{log}"
    );
    let value = (kib << 10).to_string().into_bytes();
    for p in ["prefix.pte", "step.pte"] {
        let specs = specs_of(&out.join(p));
        assert!(!specs.is_empty());
        for d in &specs {
            assert_eq!(
                d,
                &vec![
                    ("weight_streaming_budget".to_string(), value.clone()),
                    ("target_device".to_string(), b"cuda:0".to_vec())
                ],
                "{p}"
            );
        }
    }
    let r = report(&out);
    for p in ["prefix", "step"] {
        for e in r["programs"][p]["engines"].as_array().unwrap() {
            assert_eq!(
                e["compile_specs"]["weight_streaming_budget"],
                (kib << 10).to_string(),
                "{e}"
            );
        }
    }

    // Another budget: the same engines (nothing rebuilt), the new spec.
    ok(export_cmd(&c, &out, &["--backend", "tensorrt"])
        .args(["--weight-streaming-budget", "64MiB"])
        .env("PETITE_TRTEXEC", &fake)
        .output()
        .unwrap());
    assert_eq!(
        std::fs::read_to_string(&args_log).unwrap().lines().count(),
        builds
    );
    assert_eq!(report(&out)["engines"]["built"], 0);
    for d in specs_of(&out.join("prefix.pte")) {
        assert_eq!(d[0].1, b"67108864");
    }

    // Without the option: no spec, engines rebuilt without --weightStreaming (another plan).
    let out2 = s.0.join("out2");
    ok(export_cmd(&c, &out2, &["--backend", "tensorrt"])
        .env("PETITE_TRTEXEC", &fake)
        .output()
        .unwrap());
    let log = std::fs::read_to_string(&args_log).unwrap();
    assert!(
        log.lines()
            .skip(builds)
            .all(|l| !l.contains("--weightStreaming"))
    );
    let only_device = vec![("target_device".to_string(), b"cuda:0".to_vec())];
    assert!(
        specs_of(&out2.join("prefix.pte"))
            .iter()
            .all(|d| d == &only_device)
    );

    // verify opens each delegate's engines by its backend id through the runtime registry: no
    // runtime runs TensorRT's here, refused in one line naming the file and what is registered.
    let o = verify_cmd(&c, &out2).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(1), "{err}");
    let line = common::error_line(&err);
    for needle in [
        "prefix.pte",
        "no runtime runs `TensorRTBackend` engines on cpu",
        "registered: `PetiteReference` on cpu",
    ] {
        assert!(line.contains(needle), "{line}");
    }

    // Not a TensorRT export: refused.
    let out3 = s.0.join("out3");
    let mut cmd = export_cmd(&c, &out3, &["--weight-streaming-budget", "64MiB"]);
    refused(
        &mut cmd,
        &out3,
        &[
            "--weight-streaming-budget does not apply to --backend reference",
            "applies to --backend tensorrt only",
        ],
    );
}

/// `--placement device` where the engines run on the CPU (reference): refused by the builder
/// (it has no device); where there are no engines (portable, onnx) `--placement` does not apply
/// at all, `host` included. Each in one line before any work, nothing created.
#[test]
fn device_placement_is_refused_where_nothing_runs_on_a_device() {
    let s = Scratch::new("placement");
    let c = case("two_cams_mqa");
    let cases: [(&str, &str, &[&str]); 3] = [
        (
            "reference",
            "device",
            &["--placement device", "no device", "use --backend tensorrt"],
        ),
        (
            "portable",
            "device",
            &[
                "--placement device does not apply to --backend portable",
                "drop --placement",
            ],
        ),
        (
            "portable",
            "host",
            &[
                "--placement host does not apply to --backend portable",
                "applies to --backend reference|tensorrt only",
            ],
        ),
    ];
    for (backend, placement, needles) in cases {
        let out = s.0.join(format!("{backend}-{placement}"));
        let mut cmd = common::export_cmd(&c, &out);
        cmd.args(["--backend", backend, "--placement", placement]);
        refused(&mut cmd, &out, needles);
        assert!(!out.exists(), "{backend}: nothing created");
    }
    // Host placement is what the reference backend does anyway: accepted.
    ok(export_cmd(&c, &s.0.join("host"), &["--placement", "host"])
        .output()
        .unwrap());
}

/// The one rule for flags that do not apply: every backend-specific flag, and a `--dtype` the
/// backend does not export, is refused by a backend it does not apply to in one line
/// (`petite: error: FLAG does not apply to --backend B: drop FLAG (it applies to --backend ...
/// only)`), exit 2, before any work: the checkpoint named does not exist, and it is not what
/// the error is about.
#[test]
fn inapplicable_flags_are_refused_in_one_line_before_any_work() {
    let s = Scratch::new("inapplicable");
    let missing = s.0.join("no-such-checkpoint");
    let trt: &[&[&str]] = &[
        &["--trtexec", "/nonexistent/trtexec"],
        &["--trt-python", "/nonexistent/python"],
        &["--trt-target", "sm86"],
        &["--weight-streaming-budget", "64MiB"],
        &["--jobs", "2"],
    ];
    let engines: &[&[&str]] = &[
        &["--keep-engines"],
        &["--engine-cap", "1MiB"],
        &["--placement", "host"],
        &["--placement", "device"],
    ];
    let mut cases: Vec<(&str, &[&str])> = Vec::new();
    for backend in ["portable", "onnx"] {
        cases.extend(engines.iter().chain(trt).map(|f| (backend, *f)));
    }
    cases.extend(trt.iter().map(|f| ("reference", *f)));
    cases.push(("tensorrt", &["--dtype", "f32"]));
    for (backend, flag) in cases {
        let out = s.0.join("out");
        let o = petite()
            .arg("export")
            .arg("--checkpoint")
            .arg(&missing)
            .arg("--out")
            .arg(&out)
            .args(["--backend", backend])
            .args(flag)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        // A flag that does not apply is a usage error: exit 2, as clap's own.
        assert_eq!(o.status.code(), Some(2), "{backend} {flag:?}: {err}");
        let line = common::error_line(&err);
        let given = flag.join(" ");
        let head = if flag[0] == "--placement" || flag[0] == "--dtype" {
            given.clone()
        } else {
            flag[0].to_string()
        };
        assert!(
            line.starts_with(&format!(
                "petite: error: {head} does not apply to --backend {backend}"
            )),
            "{backend} {flag:?}: {line}"
        );
        assert!(!line.contains("no-such-checkpoint"), "{line}");
        assert!(!out.exists(), "{backend} {flag:?}: nothing created");
    }
}
