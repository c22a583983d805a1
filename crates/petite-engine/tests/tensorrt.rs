//! TensorRT backend without TensorRT: a stand-in `trtexec` (a shell script written here) records
//! its arguments and writes a plan file; the build wraps it as a TR01 blob, checked field by field.
//! No real TensorRT build runs in these tests.
mod common;

use std::path::{Path, PathBuf};

use petite_engine::tensorrt::{BACKEND_ID, TensorRtBuilder, TensorRtError, Tool, ToolSearch, blob};
use petite_engine::{BuildOptions, EngineBuilder, Error, build_plan};
use petite_partition::{PartitionOptions, plan};
use petite_weights::MappedSafetensors;

/// A stand-in trtexec: answers `--help` with TensorRT's banner (how the version is probed),
/// then runs `body`.
fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    common::write_tool(
        &dir.join(name),
        &format!(
            "#!/bin/sh\ncase \"$1\" in --help) echo '&&&& RUNNING TensorRT.trtexec [TensorRT v100300] # trtexec --help'; exit 0;; esac\n{body}\n"
        ),
    )
}

/// Records its arguments (one per line) and writes a 1000-byte plan to `--saveEngine`.
const FAKE: &str = r#"
for a in "$@"; do echo "$a" >> "$(dirname "$0")/args.txt"; done
echo "--" >> "$(dirname "$0")/args.txt"
for a in "$@"; do case "$a" in --saveEngine=*) out="${a#--saveEngine=}";; --onnx=*) onnx="${a#--onnx=}";; esac; done
test -s "$onnx" || { echo "no onnx model" >&2; exit 3; }
head -c 1000 /dev/zero | tr '\0' 'P' > "$out"
echo "&&&& PASSED stand-in trtexec"
"#;

#[test]
fn stand_in_trtexec_builds_every_engine_into_a_tr01_blob() {
    let dir = tempfile::tempdir().unwrap();
    let (program, path) = common::chain(dir.path(), 3, 64);
    let pl = plan(&program, &PartitionOptions::new(64 * 64 * 4)).unwrap();
    assert!(pl.engines.len() >= 3);
    let src = MappedSafetensors::open(&path).unwrap();
    let tools = dir.path().join("tools");
    std::fs::create_dir_all(&tools).unwrap();
    let mut b = TensorRtBuilder::new(Tool::trtexec(&script(&tools, "trtexec", FAKE)).unwrap());
    b.attach_mapping(&path).unwrap();
    assert_eq!(b.info().to_string(), "trtexec TensorRT 10.3.0");
    b.workspace_mib = 512;
    assert_eq!(b.backend_id(), "TensorRTBackend");
    let out = dir.path().join("engines");
    let rep = build_plan(&pl, &program, &src, &b, &out, &BuildOptions::default()).unwrap();
    let args = std::fs::read_to_string(tools.join("args.txt")).unwrap();
    let runs: Vec<&str> = args.split("--\n").filter(|s| !s.is_empty()).collect();
    assert_eq!(runs.len(), pl.engines.len());
    for (i, (e, run)) in rep.engines.iter().zip(&runs).enumerate() {
        let lines: Vec<&str> = run.lines().collect();
        let name = format!("engine_{i:03}");
        assert_eq!(
            lines,
            vec![
                format!("--onnx={}", out.join(format!("{name}.onnx")).display()).as_str(),
                format!(
                    "--saveEngine={}",
                    out.join(format!("{name}.plan.petite-tmp")).display()
                )
                .as_str(),
                "--stronglyTyped",
                "--skipInference",
                "--memPoolSize=workspace:512M",
                format!("--timingCacheFile={}", out.join("timing.cache").display()).as_str(),
            ]
        );
        assert_eq!(e.backend_id, BACKEND_ID);
        assert_eq!(e.file, out.join(format!("{name}.tr01")));
        assert!(
            !out.join(format!("{name}.plan")).exists(),
            "plan kept twice"
        );
        // The blob, field by field.
        let bytes = std::fs::read(&e.file).unwrap();
        assert_eq!(&bytes[0..4], b"TR01");
        let u32at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        let msize = u32at(8) as usize;
        let eoff = u32at(12) as usize;
        assert_eq!(u32at(4), 32);
        assert_eq!(eoff, (32 + msize).div_ceil(16) * 16);
        assert_eq!(eoff % 16, 0);
        assert_eq!(u64::from_le_bytes(bytes[16..24].try_into().unwrap()), 1000);
        assert_eq!(&bytes[24..32], &[1, 0, 0, 0, 0, 0, 0, 0]);
        assert!(bytes[32 + msize..eoff].iter().all(|&b| b == 0));
        assert!(bytes[eoff..].iter().all(|&b| b == b'P'));
        assert_eq!(bytes.len(), eoff + 1000);
        assert_eq!(e.file_bytes, bytes.len() as u64);
        assert_eq!((e.payload.offset, e.payload.len), (0, bytes.len() as u64));
        let json = std::str::from_utf8(&bytes[32..32 + msize]).unwrap();
        // Key order is load-bearing (the C++ parser scans for io_bindings first).
        let keys = [
            "\"io_bindings\"",
            "\"aliased_io\":[]",
            "\"hardware_compatible\"",
            "\"device_id\"",
            "\"serialized_metadata\"",
            "\"target_platform\"",
        ];
        let pos: Vec<usize> = keys.iter().map(|k| json.find(k).unwrap()).collect();
        assert!(pos.windows(2).all(|w| w[0] < w[1]), "{json}");
        assert!(json.starts_with("{\"io_bindings\":[{\"name\":"), "{json}");
        assert!(!json.contains(' '), "not compact: {json}");
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        let bind = v["io_bindings"].as_array().unwrap();
        assert_eq!(bind.len(), e.inputs.len() + e.outputs.len());
        for (j, b) in e.inputs.iter().chain(&e.outputs).enumerate() {
            assert_eq!(bind[j]["name"], b.name.as_str());
            assert_eq!(bind[j]["is_input"], b.is_input);
            assert_eq!(bind[j]["dtype"], "");
            assert_eq!(bind[j]["shape"], serde_json::json!([]));
        }
        assert_eq!(v["hardware_compatible"], false);
        assert_eq!(v["device_id"], 0);
        // The reader agrees.
        let (h, j2) = blob::read(&e.file).unwrap();
        assert_eq!(j2, json);
        assert_eq!((h.engine_offset as usize, h.engine_size), (eoff, 1000));
    }
}

#[test]
fn a_failing_or_killed_trtexec_names_the_engine_and_leaves_no_partial_files() {
    let dir = tempfile::tempdir().unwrap();
    let (program, path) = common::chain(dir.path(), 2, 64);
    let pl = plan(&program, &PartitionOptions::new(u64::MAX / 4)).unwrap();
    let src = MappedSafetensors::open(&path).unwrap();
    let tools = dir.path().join("tools");
    std::fs::create_dir_all(&tools).unwrap();
    for (what, body, needle) in [
        (
            "fails",
            "echo 'Error[4]: out of memory' >&2; exit 1",
            "trtexec exited with status 1",
        ),
        ("killed", "kill -9 $$", "killed by signal 9"),
        ("no plan", "exit 0", "wrote no plan"),
    ] {
        let b = TensorRtBuilder::new(
            Tool::trtexec(&script(&tools, &what.replace(' ', "_"), body)).unwrap(),
        );
        b.attach_mapping(&path).unwrap();
        let out = dir.path().join(what.replace(' ', "_"));
        let err = build_plan(&pl, &program, &src, &b, &out, &BuildOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("engine 0 (engine_000)"), "{what}: {err}");
        assert!(err.contains(needle), "{what}: {err}");
        if what == "fails" {
            assert!(err.contains("out of memory"), "log tail missing: {err}");
        }
        for e in std::fs::read_dir(&out).unwrap() {
            let n = e.unwrap().file_name().to_string_lossy().into_owned();
            assert!(
                !n.ends_with(".tr01") && !n.contains(".plan"),
                "{what}: left {n}"
            );
        }
    }
}

#[test]
fn a_missing_or_wrong_builder_is_refused_naming_it_and_saying_how_to_get_one() {
    let dir = tempfile::tempdir().unwrap();
    let search = |trtexec: Option<PathBuf>, python: Option<PathBuf>| ToolSearch {
        trtexec,
        trt_python: python,
        default_python: None,
    };
    // An explicit trtexec that is not there.
    let err = Tool::find(&search(Some(dir.path().join("no-trtexec")), None)).unwrap_err();
    assert!(
        matches!(err, Error::TensorRt(TensorRtError::Missing { .. })),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("no-trtexec"), "{msg}");
    assert!(
        msg.contains("tensorrt-rtx-cu13==1.7.1.116") && msg.contains("--trtexec"),
        "the hint names both builders: {msg}"
    );
    // A program that is not trtexec (no TensorRT banner).
    let fake = common::write_tool(&dir.path().join("not-trtexec"), "#!/bin/sh\necho hello\n");
    let msg = Tool::trtexec(&fake).unwrap_err().to_string();
    assert!(
        msg.contains("does not look like TensorRT's trtexec"),
        "{msg}"
    );
    // A Python without tensorrt_rtx (a script that fails the way `import` does).
    let py = common::write_tool(
        &dir.path().join("python"),
        "#!/bin/sh\ncat > /dev/null\necho \"ModuleNotFoundError: No module named 'tensorrt_rtx'\" >&2\nexit 3\n",
    );
    let msg = Tool::find(&search(None, Some(py.clone())))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("cannot import tensorrt_rtx") && msg.contains("No module named"),
        "{msg}"
    );
    // The version banner.
    assert_eq!(
        petite_engine::tensorrt::trtexec_version("[TensorRT v101300] # trtexec").as_deref(),
        Some("10.13.0")
    );
    assert_eq!(petite_engine::tensorrt::trtexec_version("TensorRT"), None);
}

#[test]
fn blob_reader_rejects_broken_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let plan_f = dir.path().join("p.plan");
    std::fs::write(&plan_f, vec![7u8; 100]).unwrap();
    let out = dir.path().join("b.tr01");
    blob::write(&out, "{\"io_bindings\":[]}", &plan_f).unwrap();
    let good = std::fs::read(&out).unwrap();
    type Corrupt = Box<dyn Fn(&mut Vec<u8>)>;
    let cases: Vec<(&str, Corrupt)> = vec![
        ("magic", Box::new(|b| b[0] = b'X')),
        ("metadata_offset", Box::new(|b| b[4] = 8)),
        ("not 16-aligned", Box::new(|b| b[12] += 1)),
        ("runs past", Box::new(|b| b[16] = 200)),
        ("shorter than", Box::new(|b| b.truncate(20))),
        ("runs into", Box::new(|b| b[8] = 60)),
    ];
    for (needle, f) in cases {
        let mut b = good.clone();
        f(&mut b);
        std::fs::write(&out, &b).unwrap();
        let e = blob::read(&out).unwrap_err().to_string();
        assert!(e.contains(needle), "{needle}: {e}");
    }
}

/// The metadata bytes exactly as Torch-TensorRT's serializer writes them: compact JSON
/// (`separators=(",", ":")`), keys in its order, empty dtype/shape per binding, `aliased_io`
/// always present (empty: magic stays TR01), empty `serialized_metadata`.
#[test]
fn metadata_bytes_follow_the_serializer() {
    use petite_engine::{Dtype, IoBinding};
    let b = |name: &str, is_input| IoBinding {
        name: name.into(),
        dtype: Dtype::F32,
        shape: vec![2, 3],
        is_input,
    };
    let json = blob::metadata_json(
        &[b("x", true), b("mask \"q\"", true)],
        &[b("out0", false)],
        0,
        "linux_aarch64",
    );
    assert_eq!(
        json,
        concat!(
            r#"{"io_bindings":[{"name":"x","dtype":"","shape":[],"is_input":true},"#,
            r#"{"name":"mask \"q\"","dtype":"","shape":[],"is_input":true},"#,
            r#"{"name":"out0","dtype":"","shape":[],"is_input":false}],"#,
            r#""aliased_io":[],"hardware_compatible":false,"device_id":0,"#,
            r#""serialized_metadata":"","target_platform":"linux_aarch64"}"#
        )
    );
}

/// The build-memory model `--memory-budget` uses bounds every builder peak measured with
/// TensorRT-RTX on this project's engines (full size at three caps, and the small goldens), and
/// not by so much that budgets are wasted: at most 1.7x a measured peak. (The 256 MiB and
/// 128 MiB rows were measured under memcap limits of 1 GiB and 512 MiB, where the kernel
/// reclaims the builder's clean file pages — the parser's mapped weights — so their RSS peaks
/// sit below what the same builds reach unconstrained; the model, fitted to the unconstrained
/// 512 MiB rows and the goldens, is the conservative side of them.)
#[test]
fn build_memory_model_bounds_every_measured_builder_peak() {
    use petite_engine::WeightBytes;
    let table = include_str!("data/rtx_build_memory.tsv");
    let model = petite_engine::tensorrt::RTX_BUILD_MEMORY;
    let mut rows = 0;
    for line in table
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let f: Vec<&str> = line.split('\t').collect();
        assert_eq!(f.len(), 6, "{line}");
        let n = |i: usize| f[i].parse::<u64>().unwrap();
        let (w, plan, peak) = (
            WeightBytes {
                half: n(2),
                full: n(3),
            },
            n(4),
            n(5),
        );
        let est = model.bytes(w);
        assert!(
            est >= peak,
            "{} {}: model {est} < measured {peak}",
            f[0],
            f[1]
        );
        let slack = 1.7;
        assert!(
            est as f64 <= slack * peak as f64,
            "{} {}: model {est} > {slack} x measured {peak}",
            f[0],
            f[1]
        );
        // Weights stored once in their compute dtype: the plan is no bigger than them.
        assert!(
            plan as f64 <= 1.05 * w.total() as f64 + (8 << 20) as f64,
            "{} {}: plan {plan} for {} weight bytes",
            f[0],
            f[1],
            w.total()
        );
        rows += 1;
    }
    assert_eq!(rows, 16 + 31 + 61 + 6);
    // The cap a 1 GiB budget picks keeps the model's costliest engine within it.
    let cap = model.cap_for(1 << 30).unwrap();
    assert!(cap > 128 << 20, "cap {cap}");
    for w in [
        WeightBytes { half: cap, full: 0 },
        WeightBytes { half: 0, full: cap },
    ] {
        assert!(model.bytes(w) <= 1 << 30);
    }
}

#[test]
fn weight_streaming_spec_is_ascii_decimal_bytes_as_torch_tensorrt_parses_it() {
    use petite_engine::tensorrt::{
        MAX_WEIGHT_STREAMING_BUDGET, WEIGHT_STREAMING_BUDGET_KEY, weight_streaming_spec,
    };
    assert_eq!(WEIGHT_STREAMING_BUDGET_KEY, "weight_streaming_budget");
    for (n, text) in [
        (0u64, "0"),
        (536_870_912, "536870912"),
        (i64::MAX as u64, "9223372036854775807"),
    ] {
        let s = weight_streaming_spec(n).unwrap();
        assert_eq!(s.key, "weight_streaming_budget");
        assert_eq!(s.value, text.as_bytes(), "no sign, no padding, no NUL");
        // What the runtime's std::from_chars over the whole value yields.
        assert!(s.value.iter().all(u8::is_ascii_digit));
        assert_eq!(
            std::str::from_utf8(&s.value)
                .unwrap()
                .parse::<i64>()
                .unwrap() as u64,
            n
        );
    }
    let e = weight_streaming_spec(MAX_WEIGHT_STREAMING_BUDGET + 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot represent"), "{e}");
}

#[test]
fn weight_streaming_budget_below_one_layer_is_refused_with_the_size_to_pass() {
    use petite_engine::tensorrt::largest_layer;
    use petite_graph::{Builder, Dtype};
    // Two layers: linear (w1 [32,16] f32 + bias [32] f32 = 2176 bytes) and linear (w2 [16,32]
    // bf16 = 1024 bytes); the largest layer is the first, weight and bias together.
    let mut g = Builder::new();
    let x = g.input("x", Dtype::F32, &[2, 16]).unwrap();
    let w1 = g.weight("w1", Dtype::F32, &[32, 16]).unwrap();
    let b1 = g.weight("b1", Dtype::F32, &[32]).unwrap();
    let w2 = g.weight("w2", Dtype::Bf16, &[16, 32]).unwrap();
    let h = g.linear(x, w1, Some(b1)).unwrap();
    let h = g.cast(h, Dtype::Bf16).unwrap();
    let y = g.linear(h, w2, None).unwrap();
    g.output("y", y).unwrap();
    let program = g.finish().unwrap();
    let pl = plan(&program, &PartitionOptions::new(1 << 20)).unwrap();
    assert_eq!(pl.engines.len(), 1);
    let (bytes, id) = largest_layer(&program, &pl.engines[0]).unwrap();
    assert_eq!(bytes, 2176);
    assert_eq!(program.describe(id).op, "linear");

    let dir = tempfile::tempdir().unwrap();
    let tool = Tool::trtexec(&script(dir.path(), "trtexec", FAKE)).unwrap();
    let mut b = TensorRtBuilder::new(tool);
    b.check_plan(&program, &pl).unwrap(); // no budget: nothing to check
    b.weight_streaming = true;
    b.weight_streaming_budget = Some(2175);
    let e = b.check_plan(&program, &pl).unwrap_err();
    assert!(matches!(e, Error::Usage(_)), "{e:?}");
    let msg = e.to_string();
    assert!(!msg.contains('\n'), "one line: {msg}");
    assert!(
        msg.contains("2.1 KiB of weights") && msg.contains("pass --weight-streaming-budget 3KiB"),
        "{msg}"
    );
    b.weight_streaming_budget = Some(2176);
    b.check_plan(&program, &pl).unwrap();
    // A budget without streamable engines is a setting error, not silently ignored.
    b.weight_streaming = false;
    assert!(b.check_plan(&program, &pl).is_err());
}

#[test]
fn weight_streaming_builds_pass_the_flag_and_every_engine_carries_the_spec() {
    let dir = tempfile::tempdir().unwrap();
    let (program, path) = common::chain(dir.path(), 3, 64);
    let pl = plan(&program, &PartitionOptions::new(64 * 64 * 4)).unwrap();
    let src = MappedSafetensors::open(&path).unwrap();
    let tools = dir.path().join("tools");
    std::fs::create_dir_all(&tools).unwrap();
    let mut b = TensorRtBuilder::new(Tool::trtexec(&script(&tools, "trtexec", FAKE)).unwrap());
    b.attach_mapping(&path).unwrap();
    let plain_settings = b.settings();
    b.weight_streaming = true;
    b.weight_streaming_budget = Some(1 << 20);
    assert_ne!(
        b.settings(),
        plain_settings,
        "streamable plans are other files"
    );
    let out = dir.path().join("engines");
    let rep = build_plan(&pl, &program, &src, &b, &out, &BuildOptions::default()).unwrap();
    let args = std::fs::read_to_string(tools.join("args.txt")).unwrap();
    let runs: Vec<&str> = args.split("--\n").filter(|s| !s.is_empty()).collect();
    assert_eq!(runs.len(), pl.engines.len());
    assert!(
        runs.iter()
            .all(|r| r.lines().any(|l| l == "--weightStreaming"))
    );
    for e in &rep.engines {
        assert_eq!(e.compile_specs.len(), 1);
        assert_eq!(e.compile_specs[0].key, "weight_streaming_budget");
        assert_eq!(e.compile_specs[0].value, b"1048576");
    }
    // The budget is not in the file: another budget reuses it and carries the new value.
    let before = b.settings();
    b.weight_streaming_budget = Some(4096);
    assert_eq!(b.settings(), before);
    let e = &rep.engines[0];
    let sub = pl.engine_program(&program, 0).unwrap();
    let job = petite_engine::EngineJob::of(0, &e.name, &sub);
    let again = b.reuse(&e.file, &job).expect("reused");
    assert_eq!(again.compile_specs[0].value, b"4096");
}
