//! Writes the ONNX conformance cases for `cargo xtask conformance` (the `onnx` tier): for small
//! pi0.5 configs (f32 and bf16 programs, prefix and step), every planned engine as an ONNX model
//! in both flavours, with its inputs and the reference executor's outputs for that engine.
//!
//! `cargo run -p petite --example onnx_cases -- OUT_DIR`

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use petite_engine::onnx::{Flavor, emit, locations, write_model};
use petite_engine::tensorrt::link_weights;
use petite_graph::ValueId;
use petite_partition::{PartitionOptions, plan};
use petite_pi05::names::Layout;
use petite_pi05::synth::{SynthOptions, write_synthetic};
use petite_pi05::{
    Pi05Config, Precision, PrefixOptions, build_all, build_prefix_with, programs::io,
};
use petite_reference::{Executor, Tensor};
use petite_weights::{ConvertOptions, MappedSafetensors, SafetensorsWriter, TensorSpec, convert};

fn save(path: &Path, tensors: &[(String, &Tensor)]) {
    let table: Vec<TensorSpec> = tensors
        .iter()
        .map(|(n, t)| TensorSpec::new(n.clone(), t.dtype(), t.shape()))
        .collect();
    let w = SafetensorsWriter::create(path, &table, &[]).unwrap();
    for (n, t) in tensors {
        let mut s = w.tensor(n).unwrap();
        s.write_all(&t.to_bytes()).unwrap();
        s.finish().unwrap();
    }
    w.finish().unwrap();
}

fn main() {
    let out = std::path::PathBuf::from(std::env::args().nth(1).expect("usage: onnx_cases OUT_DIR"));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    let cfg = Pi05Config::small();
    let ck = write_synthetic(
        &cfg,
        Layout::Lerobot,
        &out.join("ck"),
        &SynthOptions {
            seed: 3,
            threads: 1,
            ..SynthOptions::default()
        },
    )
    .unwrap()
    .path;
    // The bf16 mapping file, as `petite convert` makes it.
    let mapping = out.join("weights.safetensors");
    convert(
        &MappedSafetensors::open(&ck).unwrap(),
        &mapping,
        &ConvertOptions {
            progress: None,
            ..ConvertOptions::default()
        },
    )
    .unwrap();
    let src = MappedSafetensors::open(&mapping).unwrap();
    let locs = locations(src.header());
    let mut manifest = Vec::new();
    for prec in [Precision::F32, Precision::Bf16] {
        let progs = build_all(&cfg, prec).unwrap();
        let table = Executor::new(&progs.timestep_table, &src)
            .unwrap()
            .run(BTreeMap::new())
            .unwrap()
            .remove(io::TIMESTEP_TABLE)
            .unwrap();
        let s = cfg.vision.image_size;
        let mut pin = BTreeMap::new();
        let n = cfg.cameras * 3 * s * s;
        pin.insert(
            io::IMAGES.to_string(),
            Tensor::f32(
                &[cfg.cameras, 3, s, s],
                (0..n)
                    .map(|i| ((i * 29 % 200) as f32 / 100.0) - 1.0)
                    .collect(),
            )
            .unwrap(),
        );
        pin.insert(
            io::IMAGE_MASKS.to_string(),
            Tensor::u8(&[cfg.cameras], vec![1; cfg.cameras]).unwrap(),
        );
        pin.insert(
            io::TOKENS.to_string(),
            Tensor::i64(
                &[cfg.tokens],
                (0..cfg.tokens)
                    .map(|i| (i * 17 % cfg.language.vocab) as i64)
                    .collect(),
            )
            .unwrap(),
        );
        pin.insert(
            io::TOKEN_MASK.to_string(),
            Tensor::u8(
                &[cfg.tokens],
                (0..cfg.tokens)
                    .map(|i| u8::from(i + 3 < cfg.tokens))
                    .collect(),
            )
            .unwrap(),
        );
        let prefix_out = petite_reference::run(&progs.prefix, &src, pin.clone()).unwrap();
        let mut sin = prefix_out.clone();
        sin.insert(
            io::X_T.into(),
            Tensor::f32(
                &[cfg.chunk, cfg.action_dim],
                (0..cfg.chunk * cfg.action_dim)
                    .map(|i| ((i * 5 % 13) as f32 - 6.0) / 6.0)
                    .collect(),
            )
            .unwrap(),
        );
        let r = table.shape()[1];
        sin.insert(
            io::TIME_ROW.into(),
            Tensor::f32(&[r], table.float_values().unwrap()[..r].to_vec()).unwrap(),
        );
        // Real-time chunking's guidance, not zero, so ONNX Runtime runs its operations too.
        let rows = cfg.chunk - 1;
        let guidance = petite_pi05::rtc::Guidance::new(
            &cfg,
            &petite_pi05::rtc::Rtc {
                prev_chunk_left_over: (0..rows * 3).map(|i| (i % 5) as f32 * 0.25).collect(),
                rows,
                cols: 3,
                inference_delay: 1,
                execution_horizon: rows,
                schedule: petite_pi05::rtc::Schedule::Linear,
                max_guidance_weight: 10.0,
            },
        )
        .unwrap();
        for (n, t) in guidance.step_tensors(&cfg, 1).unwrap() {
            sin.insert(n.into(), t);
        }
        // The prefix again with its token embedding forced into 16-row shards (row-range
        // weights: external data of just those rows, selected with where).
        let es = if prec == Precision::F32 { 4 } else { 2 };
        let sharded = build_prefix_with(
            &cfg,
            prec,
            &PrefixOptions {
                max_embedding_shard_bytes: 16 * cfg.language.width * es,
            },
        )
        .unwrap();
        for (what, program, inputs) in [
            ("prefix", &progs.prefix, &pin),
            ("step", &progs.step, &sin),
            ("prefix_sharded", &sharded, &pin),
        ] {
            let case = format!(
                "{what}-{}",
                if prec == Precision::F32 {
                    "f32"
                } else {
                    "bf16"
                }
            );
            // Models sit next to the mapping file: onnx.checker refuses external data behind a
            // hard link or a symlink.
            let dir = out.clone();
            let loc = link_weights(&mapping, &dir).unwrap();
            let pl = plan(
                program,
                &PartitionOptions::new(program.weight_bytes() as u64 / 3),
            )
            .unwrap();
            let mut vals: BTreeMap<ValueId, Tensor> = program
                .inputs
                .iter()
                .map(|&id| (id, inputs[program.input_name(id).unwrap()].clone()))
                .collect();
            for i in 0..pl.engines.len() {
                let sub = pl.engine_program(program, i).unwrap();
                let name = format!("{case}.engine_{i:03}");
                for (flavor, suffix) in [(Flavor::F32Twin, "f32twin"), (Flavor::TensorRt, "trt")] {
                    let bytes = emit(&sub.program, &locs, &loc, flavor).unwrap();
                    write_model(&dir.join(format!("{name}.{suffix}.onnx")), &bytes).unwrap();
                }
                let mut ins = BTreeMap::new();
                for (&id, v) in sub.program.inputs.iter().zip(&sub.input_values) {
                    ins.insert(
                        sub.program.input_name(id).unwrap().to_string(),
                        vals[v].clone(),
                    );
                }
                let outs = petite_reference::run(&sub.program, &src, ins.clone()).unwrap();
                let mut io_t: Vec<(String, &Tensor)> =
                    ins.iter().map(|(k, t)| (format!("in/{k}"), t)).collect();
                io_t.extend(outs.iter().map(|(k, t)| (format!("out/{k}"), t)));
                save(&dir.join(format!("{name}.io.safetensors")), &io_t);
                for (o, v) in sub.program.outputs.iter().zip(&sub.output_values) {
                    vals.insert(*v, outs[&o.name].clone());
                }
                manifest.push(name);
            }
            eprintln!("{case}: {} engines", pl.engines.len());
        }
    }
    std::fs::write(out.join("manifest.txt"), manifest.join("\n") + "\n").unwrap();
}
