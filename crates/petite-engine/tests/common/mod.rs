//! Shared test helpers: small pi0.5 checkpoints and inputs, a chain model of page-multiple
//! weights, and running built engines.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use petite_engine::reference::ReferenceEngine;
use petite_engine::{BuiltEngine, HostTensor, run_engines};
use petite_graph::{Builder, Dtype, Program, ValueId};
use petite_pi05::Pi05Config;
use petite_pi05::names::Layout;
use petite_pi05::synth::{SynthOptions, write_synthetic};
use petite_reference::Tensor;
use petite_weights::{SafetensorsWriter, TensorSpec};

// The workspace's one stand-in-tool writer (see its docs for the ETXTBSY race it avoids).
#[path = "../../../../tests/common/tool.rs"]
mod tool;
#[allow(unused_imports)] // not every test file runs a stand-in tool
pub use tool::write_tool;

/// Writes the f32 lerobot-layout synthetic checkpoint of `cfg` into `dir`.
pub fn small_checkpoint(cfg: &Pi05Config, dir: &Path) -> PathBuf {
    write_synthetic(
        cfg,
        Layout::Lerobot,
        dir,
        &SynthOptions {
            seed: 7,
            threads: 1,
            ..SynthOptions::default()
        },
    )
    .unwrap()
    .path
}

/// Deterministic prefix inputs for `cfg` (second camera present, last tokens padded).
pub fn prefix_inputs(cfg: &Pi05Config) -> BTreeMap<String, Tensor> {
    let s = cfg.vision.image_size;
    let n = cfg.cameras * 3 * s * s;
    let images: Vec<f32> = (0..n)
        .map(|i| ((i * 37 % 200) as f32 / 100.0) - 1.0)
        .collect();
    let tokens: Vec<i64> = (0..cfg.tokens)
        .map(|i| ((i * 13 + 5) % cfg.language.vocab) as i64)
        .collect();
    let mask: Vec<u8> = (0..cfg.tokens)
        .map(|i| u8::from(i + 2 < cfg.tokens))
        .collect();
    let mut m = BTreeMap::new();
    m.insert(
        "images".into(),
        Tensor::f32(&[cfg.cameras, 3, s, s], images).unwrap(),
    );
    m.insert(
        "image_masks".into(),
        Tensor::u8(&[cfg.cameras], vec![1; cfg.cameras]).unwrap(),
    );
    m.insert("tokens".into(), Tensor::i64(&[cfg.tokens], tokens).unwrap());
    m.insert(
        "token_mask".into(),
        Tensor::u8(&[cfg.tokens], mask).unwrap(),
    );
    m
}

/// Inputs of `program` given by name, keyed by value id.
pub fn by_value(program: &Program, named: &BTreeMap<String, Tensor>) -> BTreeMap<ValueId, Tensor> {
    program
        .inputs
        .iter()
        .map(|&id| {
            let name = program.input_name(id).unwrap();
            (id, named[name].clone())
        })
        .collect()
}

/// Runs reference engines in order; returns the program's outputs by name.
pub fn run_built(
    program: &Program,
    engines: &[BuiltEngine],
    inputs: &BTreeMap<String, Tensor>,
) -> BTreeMap<String, Tensor> {
    let host = by_value(program, inputs)
        .into_iter()
        .map(|(v, t)| (v, HostTensor::from(t)))
        .collect();
    let vals = run_engines(engines, |e| ReferenceEngine::open(&e.file), host).unwrap();
    program
        .outputs
        .iter()
        .map(|o| (o.name.clone(), vals[&o.value].to_reference().unwrap()))
        .collect()
}

/// Asserts two output maps are equal bit for bit (floats compared by bits).
pub fn assert_bit_equal(what: &str, a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}"
    );
    for (k, x) in a {
        let y = &b[k];
        assert_eq!(x.dtype(), y.dtype(), "{what}: {k}");
        assert_eq!(x.shape(), y.shape(), "{what}: {k}");
        assert_eq!(x.to_bytes(), y.to_bytes(), "{what}: output {k} differs");
    }
}

/// A chain `x → linear(w0) → … → linear(w_{n-1}) → linear(w0)` of `[d, d]` f32 weights (w0 is
/// read first and last), plus its weight file (values `i·1e-3` patterns, page-multiple tensors
/// when `d·d·4` is). Returns the program and the file.
pub fn chain(dir: &Path, n: usize, d: usize) -> (Program, PathBuf) {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[2, d]).unwrap();
    let mut h = x;
    let mut ws = Vec::new();
    for i in 0..n {
        let w = b.weight(&format!("w{i}"), Dtype::F32, &[d, d]).unwrap();
        ws.push(w);
        h = b.linear(h, w, None).unwrap();
        h = b.tanh(h).unwrap();
    }
    h = b.linear(h, ws[0], None).unwrap();
    b.output("y", h).unwrap();
    let p = b.finish().unwrap();
    let path = dir.join("chain.safetensors");
    let table: Vec<TensorSpec> = (0..n)
        .map(|i| TensorSpec::new(format!("w{i}"), Dtype::F32, &[d, d]))
        .collect();
    let w = SafetensorsWriter::create(&path, &table, &[]).unwrap();
    for (i, t) in table.iter().enumerate() {
        let vals: Vec<u8> = (0..d * d)
            .flat_map(|k| ((((k * 7 + i * 3) % 23) as f32 - 11.0) * 2e-3).to_le_bytes())
            .collect();
        let mut s = w.tensor(&t.name).unwrap();
        s.write_all(&vals).unwrap();
        s.finish().unwrap();
    }
    w.finish().unwrap();
    (p, path)
}
