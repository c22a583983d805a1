//! The runtime conformance suite: every engine builder of `petite::backends::BACKENDS` that can
//! build here, paired with every runtime of `petite::runtimes::RUNTIMES` that runs its engines
//! on a device that can run here (the CPU always; CUDA where a GPU, its driver, cuBLAS and NVRTC
//! are present), runs the same checks — a builder or runtime left out is said on stdout with
//! why, never passed silently:
//! - the op cases (petite-portable's `tests/common/cases.rs`, shared with its ExecuTorch
//!   conformance) built into engines and opened from a region of a larger file, as from a `.pte`
//!   segment, give the reference executor's outputs bit for bit;
//! - running an engine twice gives the same bits;
//! - an input missing, of the wrong shape or of the wrong dtype is an error naming the input;
//! - a delegate backend id no runtime runs is refused naming the file and what is registered.
//!
//! A new builder or runtime registered in `BACKENDS` or `RUNTIMES` is covered with no change
//! here.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use petite::backends::{BACKENDS, BackendOptions, Output};
use petite::runtimes::{RUNTIMES, Runtime, devices, runtime, runtime_for};
use petite_engine::{EngineBuilder, EngineJob, HostTensor};
use petite_graph::{Builder, Dtype, Program};
use petite_reference::{Executor, MemoryWeights, Tensor};

#[path = "../crates/petite-portable/tests/common/cases.rs"]
mod cases;

/// Where each engine's bytes start in the file a runtime opens: a page in, as a `.pte` segment
/// is (so a runtime that ignored the offset would read the filler).
const SEGMENT_OFFSET: u64 = 4096;

/// Builds `program`'s one engine from `weights` with `builder` and copies it into `dir/NAME.seg`
/// at [`SEGMENT_OFFSET`] after filler bytes; returns the file and the engine's byte length.
fn engine_segment(
    builder: &dyn EngineBuilder,
    dir: &Path,
    name: &str,
    program: &Program,
    weights: &MemoryWeights,
) -> (PathBuf, u64) {
    let outputs: Vec<_> = program.outputs.iter().map(|o| o.value).collect();
    let job = EngineJob {
        index: 0,
        name,
        program,
        input_values: &program.inputs,
        output_values: &outputs,
    };
    let engines = dir.join("engines");
    std::fs::create_dir_all(&engines).unwrap();
    let built = builder
        .build(&job, weights, &engines)
        .unwrap_or_else(|e| panic!("{name}: build: {e}"));
    let r = &built.payload;
    let bytes = std::fs::read(&r.path).unwrap();
    let engine = &bytes[r.offset as usize..(r.offset + r.len) as usize];
    let mut file = vec![0xA5u8; SEGMENT_OFFSET as usize];
    file.extend_from_slice(engine);
    let path = dir.join(format!("{name}.seg"));
    std::fs::write(&path, file).unwrap();
    (path, r.len)
}

fn host(inputs: &BTreeMap<String, Tensor>) -> BTreeMap<String, HostTensor> {
    inputs
        .iter()
        .map(|(n, t)| (n.clone(), HostTensor::from(t)))
        .collect()
}

/// A builder that can build here and the runtimes, on devices that can run here, that run its
/// engines (each with its name for messages).
struct Pair {
    backend: &'static str,
    builder: Box<dyn EngineBuilder>,
    runtimes: Vec<(String, Box<dyn Runtime>)>,
}

/// Every engine builder and every runtime that can run here, paired by delegate backend id;
/// each one left out is said on stdout with why (never a silent pass), and the reference
/// builder with the host CPU's runtime is always among them.
fn pairs() -> Vec<Pair> {
    let mut out = Vec::new();
    for backend in BACKENDS {
        if backend.spec().output() != Output::Engines {
            continue;
        }
        let name = backend.name();
        let builder = match backend.builder(&BackendOptions::default(), None) {
            Ok(b) => b,
            Err(e) => {
                println!("builder `{name}`: skipped, it cannot build here ({e})");
                continue;
            }
        };
        if builder.needs_mapping_file() {
            println!(
                "builder `{name}`: skipped, it reads a mapping file (its engines are checked by its own tier)"
            );
            continue;
        }
        let id = builder.backend_id().to_string();
        let mut runtimes = Vec::new();
        for (rid, device, make) in RUNTIMES.iter().filter(|(rid, ..)| *rid == id) {
            let who = format!("`{rid}` on {}", device.name());
            if let Err(e) = device.check() {
                println!("runtime {who}: skipped, the device cannot run here ({e})");
                continue;
            }
            let rt = make().unwrap_or_else(|e| panic!("{who}: {e}"));
            assert_eq!(rt.device(), *device, "{who} says it runs elsewhere");
            runtimes.push((who, rt));
        }
        if runtimes.is_empty() {
            println!("builder `{name}`: no runtime runs its `{id}` engines here");
        }
        out.push(Pair {
            backend: name,
            builder,
            runtimes,
        });
    }
    assert!(
        out.iter()
            .any(|p| p.runtimes.iter().any(|(_, r)| r.device().is_host())),
        "the reference builder and the host CPU's runtime always run"
    );
    out
}

/// Every op case, built by every builder and run by every runtime of its engines that runs
/// here, equals the reference executor bit for bit, and a second run of the same engine equals
/// the first.
#[test]
fn every_runtime_runs_the_op_cases_bit_equal_to_the_reference_and_repeatably() {
    let cases = cases::cases();
    assert!(cases.len() >= 10, "{} op cases", cases.len());
    for pair in pairs() {
        let dir = tempfile::tempdir().unwrap();
        let built: Vec<_> = cases
            .iter()
            .map(|(name, program, weights, inputs)| {
                let expected = Executor::new(program, weights)
                    .unwrap()
                    .run(inputs.clone())
                    .unwrap_or_else(|e| panic!("{name}: reference: {e}"));
                let (path, len) =
                    engine_segment(pair.builder.as_ref(), dir.path(), name, program, weights);
                (name, inputs, expected, path, len)
            })
            .collect();
        for (rt_name, rt) in &pair.runtimes {
            let who = format!("builder `{}`, runtime {rt_name}", pair.backend);
            for (name, inputs, expected, path, len) in &built {
                let engine = rt
                    .open(path, SEGMENT_OFFSET, *len, false)
                    .unwrap_or_else(|e| panic!("{who}, {name}: open: {e}"));
                let first = engine
                    .run(host(inputs))
                    .unwrap_or_else(|e| panic!("{who}, {name}: {e}"));
                let again = engine
                    .run(host(inputs))
                    .unwrap_or_else(|e| panic!("{who}, {name}: second run: {e}"));
                assert_eq!(
                    first.keys().collect::<Vec<_>>(),
                    expected.keys().collect::<Vec<_>>(),
                    "{who}, {name}: outputs"
                );
                for (out, want) in expected {
                    let got = &first[out];
                    assert_eq!(got.dtype(), want.dtype(), "{who}, {name}: {out}'s dtype");
                    assert_eq!(got.shape(), want.shape(), "{who}, {name}: {out}'s shape");
                    assert!(
                        got.bytes() == want.to_bytes().as_slice(),
                        "{who}, {name}: {out} differs from the reference executor's bits"
                    );
                    assert!(
                        again[out].bytes() == got.bytes(),
                        "{who}, {name}: {out} differs between two runs"
                    );
                }
            }
        }
    }
}

/// An input missing, of another shape or of another dtype is an error naming it, on every
/// builder and runtime that run here; the engine stays usable after each.
#[test]
fn every_runtime_names_a_bad_input() {
    let mut b = Builder::new();
    let x = b.input("joint_angles", Dtype::F32, &[2, 3]).unwrap();
    let w = b.weight("w", Dtype::F32, &[4, 3]).unwrap();
    let y = b.linear(x, w, None).unwrap();
    b.output("y", y).unwrap();
    let program = b.finish().unwrap();
    let mut weights = MemoryWeights::new();
    let wv: Vec<f32> = (0..12).map(|i| i as f32 * 0.25 - 1.0).collect();
    weights.insert_f32("w", &[4, 3], &wv).unwrap();
    let good = Tensor::f32(&[2, 3], vec![0.5; 6]).unwrap();
    let bad: [(&str, Option<Tensor>); 3] = [
        ("missing", None),
        ("shape", Some(Tensor::f32(&[3, 2], vec![0.5; 6]).unwrap())),
        ("dtype", Some(Tensor::i64(&[2, 3], vec![1; 6]).unwrap())),
    ];
    for pair in pairs() {
        let dir = tempfile::tempdir().unwrap();
        let (path, len) = engine_segment(
            pair.builder.as_ref(),
            dir.path(),
            "bad_inputs",
            &program,
            &weights,
        );
        for (rt_name, rt) in &pair.runtimes {
            let who = format!("builder `{}`, runtime {rt_name}", pair.backend);
            let engine = rt.open(&path, SEGMENT_OFFSET, len, false).unwrap();
            for (what, t) in &bad {
                let mut inputs = BTreeMap::new();
                if let Some(t) = t {
                    inputs.insert("joint_angles".to_string(), HostTensor::from(t));
                }
                let e = engine
                    .run(inputs)
                    .err()
                    .unwrap_or_else(|| panic!("{who}: a {what} input ran"))
                    .to_string();
                assert!(e.contains("joint_angles"), "{who}, {what}: {e}");
            }
            let mut inputs = BTreeMap::new();
            inputs.insert("joint_angles".to_string(), HostTensor::from(&good));
            engine
                .run(inputs)
                .unwrap_or_else(|e| panic!("{who}: after the refusals: {e}"));
        }
    }
}

/// A delegate backend id no runtime runs is refused on every device, naming the `.pte` file, the
/// id and every registered runtime (backend id and device).
#[test]
fn an_unknown_backend_id_is_refused_naming_the_file_and_what_is_registered() {
    let pte = Path::new("/exports/one/prefix.pte");
    for &device in devices() {
        let e = runtime_for(pte, "NoSuchBackend", device)
            .err()
            .unwrap_or_else(|| panic!("NoSuchBackend opened on {}", device.name()))
            .to_string();
        assert!(e.starts_with("/exports/one/prefix.pte: "), "{e}");
        assert!(
            e.contains(&format!(
                "no runtime runs `NoSuchBackend` engines on {}",
                device.name()
            )),
            "{e}"
        );
        for (id, d, _) in RUNTIMES {
            assert!(e.contains(&format!("`{id}` on {}", d.name())), "{e}");
        }
        assert_eq!(e.lines().count(), 1, "{e}");
        // Without a file to name, the registry's own refusal says the same.
        let e = runtime("NoSuchBackend", device).err().unwrap().to_string();
        assert!(e.starts_with("no runtime runs `NoSuchBackend`"), "{e}");
    }
}
