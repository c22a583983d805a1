//! The ONNX emitter without Python: every engine of the small pi0.5 programs emits in both
//! flavours, each weight is external data at its exact place in the mapping file, and a weight
//! the mapping lacks (or holds with another shape) is a clear error. The models themselves are
//! checked by onnx.checker and ONNX Runtime in `cargo xtask conformance` (onnx tier).
mod common;

use petite_engine::Error;
use petite_engine::onnx::{Flavor, emit, locations};
use petite_partition::{PartitionOptions, plan};
use petite_pi05::{Pi05Config, Precision, PrefixOptions, build_all, build_prefix_with};
use petite_weights::MappedSafetensors;

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The external_data entry `key = value` as protobuf bytes (StringStringEntryProto in field 13).
fn entry(key: &str, value: &str) -> Vec<u8> {
    let mut inner = vec![0x0a, key.len() as u8];
    inner.extend_from_slice(key.as_bytes());
    inner.push(0x12);
    inner.push(value.len() as u8);
    inner.extend_from_slice(value.as_bytes());
    let mut out = vec![0x6a, inner.len() as u8];
    out.extend(inner);
    out
}

#[test]
fn every_small_engine_emits_with_weights_as_external_data_in_place() {
    let cfg = Pi05Config::small();
    let dir = tempfile::tempdir().unwrap();
    let ck = common::small_checkpoint(&cfg, dir.path());
    let src = MappedSafetensors::open(&ck).unwrap();
    let locs = locations(src.header());
    for prec in [Precision::F32, Precision::Bf16] {
        let progs = build_all(&cfg, prec).unwrap();
        for program in [&progs.prefix, &progs.step] {
            let pl = plan(
                program,
                &PartitionOptions::new(program.weight_bytes() as u64 / 3),
            )
            .unwrap();
            for i in 0..pl.engines.len() {
                let sub = pl.engine_program(program, i).unwrap();
                for flavor in [Flavor::TensorRt, Flavor::F32Twin] {
                    let m = emit(&sub.program, &locs, "model.safetensors", flavor).unwrap();
                    assert!(contains(&m, b"petite"));
                    for w in sub.program.weights() {
                        let r = src.file_range(&w.name).unwrap();
                        assert!(contains(&m, format!("w:{}", w.name).as_bytes()));
                        assert!(
                            contains(&m, &entry("offset", &r.start.to_string())),
                            "{}",
                            w.name
                        );
                        assert!(
                            contains(&m, &entry("length", &r.len().to_string())),
                            "{}",
                            w.name
                        );
                    }
                    // Weight bytes are not in the model: it is far smaller than its weights.
                    assert!((m.len() as u64) < 64 * 1024 + pl.engines[i].weight_bytes / 4);
                }
            }
        }
    }
}

#[test]
fn a_weight_missing_from_the_mapping_or_misshapen_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (program, path) = common::chain(dir.path(), 2, 64);
    let src = MappedSafetensors::open(&path).unwrap();
    let mut locs = locations(src.header());
    locs.remove("w1");
    let e = emit(&program, &locs, "x", Flavor::TensorRt).unwrap_err();
    assert!(
        matches!(&e, Error::Weight { tensor, .. } if tensor == "w1"),
        "{e}"
    );
    let mut locs = locations(src.header());
    locs.get_mut("w0").unwrap().shape = vec![32, 128];
    let e = emit(&program, &locs, "x", Flavor::TensorRt)
        .unwrap_err()
        .to_string();
    assert!(e.contains("w0") && e.contains("[32, 128]"), "{e}");
}

/// A row-range weight (a token-embedding shard) is external data covering exactly its rows.
#[test]
fn a_row_range_weight_is_external_data_of_just_its_rows() {
    let cfg = Pi05Config::small();
    let dir = tempfile::tempdir().unwrap();
    let ck = common::small_checkpoint(&cfg, dir.path());
    let src = MappedSafetensors::open(&ck).unwrap();
    let locs = locations(src.header());
    let program = build_prefix_with(
        &cfg,
        Precision::Bf16,
        &PrefixOptions {
            max_embedding_shard_bytes: 16 * cfg.language.width * 2,
        },
    )
    .unwrap();
    let pl = plan(
        &program,
        &PartitionOptions::new(program.weight_bytes() as u64 / 3),
    )
    .unwrap();
    let mut ranges = 0;
    for i in 0..pl.engines.len() {
        let sub = pl.engine_program(&program, i).unwrap();
        let m = emit(&sub.program, &locs, "model.safetensors", Flavor::TensorRt).unwrap();
        for w in sub.program.weights() {
            let Some([a, b]) = w.rows else { continue };
            ranges += 1;
            let r = src.file_range(&w.name).unwrap();
            let info = petite_weights::WeightSource::info(&src, &w.name).unwrap();
            let row = r.len() / info.shape[0];
            assert!(contains(&m, format!("w:{}[{a}..{b}]", w.name).as_bytes()));
            assert!(contains(
                &m,
                &entry("offset", &(r.start + a * row).to_string())
            ));
            assert!(contains(&m, &entry("length", &((b - a) * row).to_string())));
        }
    }
    assert_eq!(ranges, cfg.language.vocab.div_ceil(16));
}

/// A mapping file holding weight `w` [3, 4] as `q` codes (every byte 1) and its scales.
fn quantized_mapping(dir: &std::path::Path, q: petite_graph::quant::Quant) -> MappedSafetensors {
    use petite_graph::Dtype;
    use petite_weights::{SafetensorsWriter, TensorSpec};
    let file = dir.join(format!("{q}.safetensors"));
    let table = [
        TensorSpec::new("w", Dtype::of_quant(q), &[3, 4]),
        TensorSpec::new("w.qscale", Dtype::F32, &[3]),
    ];
    let wr = SafetensorsWriter::create(&file, &table, &[]).unwrap();
    for t in &table {
        let mut s = wr.tensor(&t.name).unwrap();
        std::io::Write::write_all(
            &mut s,
            &vec![1u8; t.dtype.size() * t.shape.iter().product::<usize>()],
        )
        .unwrap();
        s.finish().unwrap();
    }
    wr.finish().unwrap();
    MappedSafetensors::open(&file).unwrap()
}

/// A quantized weight's codes feed their `DequantizeLinear` straight from the initializer (as
/// TensorRT requires of a quantized constant: no Identity between).
#[test]
fn quantized_codes_feed_dequantize_linear_directly() {
    use petite_graph::{Builder, Dtype, quant};
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[2, 4]).unwrap();
    let w = b.weight("w", Dtype::Bf16, &[3, 4]).unwrap();
    let y = b.linear(x, w, None).unwrap();
    b.output("y", y).unwrap();
    let p = b.finish().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for q in quant::Quant::ALL {
        let (qp, _) = quant::quantize_weights(&p, q, |_| true).unwrap();
        let src = quantized_mapping(dir.path(), q);
        for flavor in [Flavor::TensorRt, Flavor::F32Twin] {
            let model = emit(&qp, &locations(src.header()), "m.data", flavor).unwrap();
            // A NodeProto whose first input is the codes' initializer and which has a second
            // input (the scale): the dequantize. An Identity from the initializer would be
            // followed by its output (field 2) instead.
            let mut inputs = vec![0x0a, 3];
            inputs.extend_from_slice(b"w:w");
            inputs.push(0x0a);
            assert!(contains(&model, &inputs), "{q} {flavor:?}");
            assert!(contains(&model, b"DequantizeLinear"), "{q} {flavor:?}");
        }
    }
}

/// One protobuf field's value: a varint, or a length-delimited run of bytes.
enum Wire<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
}

/// The fields of one protobuf message, in order (enough of the wire format for ONNX graphs:
/// varints, length-delimited, 32- and 64-bit fixed values skipped).
fn fields(mut b: &[u8]) -> Vec<(u64, Wire<'_>)> {
    fn varint(b: &mut &[u8]) -> u64 {
        let (mut v, mut shift) = (0u64, 0);
        loop {
            let byte = b[0];
            *b = &b[1..];
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return v;
            }
            shift += 7;
        }
    }
    let mut out = Vec::new();
    while !b.is_empty() {
        let key = varint(&mut b);
        let value = match key & 7 {
            0 => Wire::Varint(varint(&mut b)),
            2 => {
                let n = varint(&mut b) as usize;
                let (v, rest) = b.split_at(n);
                b = rest;
                Wire::Bytes(v)
            }
            1 => {
                b = &b[8..];
                continue;
            }
            5 => {
                b = &b[4..];
                continue;
            }
            w => panic!("wire type {w}"),
        };
        out.push((key >> 3, value));
    }
    out
}

/// A NodeProto read back: op type, inputs, outputs and its integer attributes.
#[derive(Debug)]
struct NodeRead {
    op: String,
    inputs: Vec<String>,
    outputs: Vec<String>,
    ints: Vec<(String, i64)>,
}

/// The nodes of a ModelProto's graph.
fn nodes(model: &[u8]) -> Vec<NodeRead> {
    let text = |b: &[u8]| String::from_utf8(b.to_vec()).unwrap();
    let graph = fields(model)
        .into_iter()
        .find_map(|(f, v)| match (f, v) {
            (7, Wire::Bytes(g)) => Some(g),
            _ => None,
        })
        .expect("a graph");
    let mut out = Vec::new();
    for (f, v) in fields(graph) {
        let (1, Wire::Bytes(n)) = (f, v) else {
            continue;
        };
        let mut node = NodeRead {
            op: String::new(),
            inputs: vec![],
            outputs: vec![],
            ints: vec![],
        };
        for (f, v) in fields(n) {
            match (f, v) {
                (1, Wire::Bytes(s)) => node.inputs.push(text(s)),
                (2, Wire::Bytes(s)) => node.outputs.push(text(s)),
                (4, Wire::Bytes(s)) => node.op = text(s),
                (5, Wire::Bytes(a)) => {
                    let (mut name, mut i) = (String::new(), None);
                    for (f, v) in fields(a) {
                        match (f, v) {
                            (1, Wire::Bytes(s)) => name = text(s),
                            (3, Wire::Varint(x)) => i = Some(x as i64),
                            _ => {}
                        }
                    }
                    if let Some(i) = i {
                        node.ints.push((name, i));
                    }
                }
                _ => {}
            }
        }
        out.push(node);
    }
    out
}

/// For TensorRT a bf16 dequantize is spelled in bf16: its f32 scale cast to bf16 first (once per
/// scale), `DequantizeLinear` giving bf16 with nothing after it but the value's Identity — the
/// form TensorRT-RTX's INT8 path builds (the f32 form failed in its compiler; `cargo xtask
/// conformance --only tensorrt` builds both formats). ONNX Runtime's f32 twin keeps the f32
/// dequantize and rounds after it. Either way the model declares opset 19 (a bf16 scale and FP8
/// codes are 19's).
#[test]
fn a_bf16_dequantize_for_tensorrt_takes_a_bf16_scale() {
    use petite_graph::{Builder, Dtype, quant};
    let mut b = Builder::new();
    let x1 = b.input("x1", Dtype::Bf16, &[2, 4]).unwrap();
    let x2 = b.input("x2", Dtype::Bf16, &[2, 4]).unwrap();
    let w = b.weight("w", Dtype::Bf16, &[3, 4]).unwrap();
    let y1 = b.linear(x1, w, None).unwrap();
    let y2 = b.linear(x2, w, None).unwrap();
    b.output("y1", y1).unwrap();
    b.output("y2", y2).unwrap();
    let p = b.finish().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for q in quant::Quant::ALL {
        let (qp, _) = quant::quantize_weights(&p, q, |_| true).unwrap();
        assert_eq!(petite_engine::onnx::opset_for(&qp).0, 19, "{q}");
        let src = quantized_mapping(dir.path(), q);
        for flavor in [Flavor::TensorRt, Flavor::F32Twin] {
            let model = emit(&qp, &locations(src.header()), "m.data", flavor).unwrap();
            let ns = nodes(&model);
            let producer = |v: &str| ns.iter().find(|n| n.outputs.iter().any(|o| o == v));
            let readers = |v: &str| -> Vec<&NodeRead> {
                ns.iter()
                    .filter(|n| n.inputs.iter().any(|i| i == v))
                    .collect()
            };
            let dqs: Vec<&NodeRead> = ns.iter().filter(|n| n.op == "DequantizeLinear").collect();
            assert!(!dqs.is_empty(), "{q} {flavor:?}: no DequantizeLinear");
            let to_bf16 = ("to".to_string(), 16);
            let scale_casts = ns
                .iter()
                .filter(|n| n.op == "Cast" && n.ints.contains(&to_bf16))
                .filter(|n| {
                    readers(&n.outputs[0])
                        .iter()
                        .all(|r| r.op == "DequantizeLinear")
                })
                .count();
            for dq in &dqs {
                assert_eq!(
                    dq.inputs[0], "w:w",
                    "{q} {flavor:?}: codes straight from the initializer"
                );
                let scale = producer(&dq.inputs[1]);
                let after = readers(&dq.outputs[0]);
                match flavor {
                    Flavor::TensorRt => {
                        let cast = scale.expect("the scale is computed");
                        assert_eq!(cast.op, "Cast", "{q}: {cast:?}");
                        assert!(cast.ints.contains(&to_bf16), "{q}: {cast:?}");
                        assert!(after.iter().all(|n| n.op == "Identity"), "{q}: {after:?}");
                    }
                    Flavor::F32Twin => {
                        assert!(scale.is_none_or(|s| s.op != "Cast"), "{q}: {scale:?}");
                        assert!(after.iter().all(|n| n.op == "Cast"), "{q}: {after:?}");
                    }
                }
            }
            let want = if flavor == Flavor::TensorRt { 1 } else { 0 };
            assert_eq!(scale_casts, want, "{q} {flavor:?}: casts of the scale");
        }
    }
}
