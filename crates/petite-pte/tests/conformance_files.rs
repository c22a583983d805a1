//! Writes the `.pte` files the ExecuTorch conformance tier checks (`cargo xtask conformance`):
//! `target/pte-conformance/*.pte` plus `manifest.json` with, per file, what the flatc decode must
//! show and, per runnable method, inputs and expected outputs computed here in plain f64 math.
//! The files are also verified by petite's own reader in this test. Tolerances (`atol`): 1e-5 for
//! sums of ≤ 16 products of values in [-1, 1] (f32 rounding in the runtime vs f64 here, ~1e-6),
//! 1e-4 where an erf approximation (~1e-7) and a variance enter; the f64 side does not depend on
//! the CPU and ExecuTorch's portable kernels have no per-CPU paths.

use std::path::PathBuf;

use petite_pte::model::*;
use petite_pte::{
    DelegateSpec, MethodBuilder, Processed, ProgramBuilder, PteFile, SegmentData, WriteOptions,
};
use serde_json::{Value, json};

mod common;

fn out_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/pte-conformance")
}

use common::f32_bytes;

/// Deterministic pseudo-random values in [-1, 1).
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(747796405).wrapping_add(2891336453);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            ((s >> 8) as f32 / (1u32 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Row-major `a[m,k] @ b[k,n]`.
fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0f64;
            for t in 0..k {
                acc += a[i * k + t] as f64 * b[t * n + j] as f64;
            }
            out[i * n + j] = acc as f32;
        }
    }
    out
}

fn transpose(a: &[f32], m: usize, n: usize) -> Vec<f32> {
    let mut t = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            t[j * m + i] = a[i * n + j];
        }
    }
    t
}

fn softmax_rows(a: &[f32], n: usize) -> Vec<f32> {
    a.chunks(n)
        .flat_map(|row| {
            let mx = row.iter().cloned().fold(f32::MIN, f32::max) as f64;
            let e: Vec<f64> = row.iter().map(|&x| (x as f64 - mx).exp()).collect();
            let s: f64 = e.iter().sum();
            e.into_iter().map(move |x| (x / s) as f32)
        })
        .collect()
}

fn tensor_json(shape: &[i32], data: &[f32]) -> Value {
    json!({"dtype": "float32", "shape": shape, "data": data})
}

fn const_tensor(
    pb: &mut ProgramBuilder,
    m: &mut MethodBuilder,
    shape: &[i32],
    data: &[f32],
) -> i32 {
    let idx = pb.add_constant(&f32_bytes(data));
    m.constant_tensor(ScalarType::FLOAT, shape, idx)
}

fn planned(m: &mut MethodBuilder, shape: &[i32]) -> i32 {
    m.planned_tensor(ScalarType::FLOAT, shape).unwrap()
}

/// `y = x @ w + b` with `aten::mm.out` + `aten::add.out` (the samples' model).
fn tiny_linear(pb: &mut ProgramBuilder) -> Value {
    let w: Vec<f32> = (0..12).map(|i| i as f32 / 10.0).collect();
    let b = [1.0f32, -1.0, 0.5, 2.0];
    let mut m = MethodBuilder::new("forward");
    let wv = const_tensor(pb, &mut m, &[3, 4], &w);
    let bv = const_tensor(pb, &mut m, &[4], &b);
    let x = planned(&mut m, &[2, 3]);
    let mm = planned(&mut m, &[2, 4]);
    let out = planned(&mut m, &[2, 4]);
    let alpha = m.int(1);
    m.kernel_call("aten::mm", "out", &[x, wv, mm, mm]);
    m.kernel_call("aten::add", "out", &[mm, bv, alpha, out, out]);
    m.inputs(&[x]);
    m.outputs(&[out]);
    pb.add_method(m).unwrap();
    let xd = [1.0f32, 2.0, 3.0, 0.5, -1.0, 4.0];
    let y: Vec<f32> = matmul(&xd, &w, 2, 3, 4)
        .iter()
        .enumerate()
        .map(|(i, v)| v + b[i % 4])
        .collect();
    json!({"name": "forward", "run": true, "atol": 1e-5,
           "inputs": [tensor_json(&[2, 3], &xd)], "outputs": [tensor_json(&[2, 4], &y)]})
}

/// A linear layer with `aten::addmm.out` (beta and alpha materialised as Int values).
fn linear_addmm(pb: &mut ProgramBuilder) -> Value {
    let (i, o, n) = (16usize, 8usize, 5usize);
    let wt = values(i * o, 1);
    let b = values(o, 2);
    let mut m = MethodBuilder::new("linear");
    let wv = const_tensor(pb, &mut m, &[i as i32, o as i32], &wt);
    let bv = const_tensor(pb, &mut m, &[o as i32], &b);
    let x = planned(&mut m, &[n as i32, i as i32]);
    let out = planned(&mut m, &[n as i32, o as i32]);
    let beta = m.int(1);
    let alpha = m.int(1);
    m.kernel_call("aten::addmm", "out", &[bv, x, wv, beta, alpha, out, out]);
    m.inputs(&[x]);
    m.outputs(&[out]);
    pb.add_method(m).unwrap();
    let xd = values(n * i, 3);
    let y: Vec<f32> = matmul(&xd, &wt, n, i, o)
        .iter()
        .enumerate()
        .map(|(k, v)| v + b[k % o])
        .collect();
    json!({"name": "linear", "run": true, "atol": 1e-5,
           "inputs": [tensor_json(&[n as i32, i as i32], &xd)],
           "outputs": [tensor_json(&[n as i32, o as i32], &y)]})
}

/// Single-head attention: q/k/v projections with `aten::mm.out`, `aten::permute_copy.out` (an
/// IntList of Int value indices), `aten::mul.Scalar_out` (a Double), `aten::_softmax.out` (Int +
/// Bool), a final `aten::view_copy.out` to a flat vector.
fn attention(pb: &mut ProgramBuilder) -> Value {
    let (s, d) = (4usize, 8usize);
    let (si, di) = (s as i32, d as i32);
    let wq = values(d * d, 11);
    let wk = values(d * d, 12);
    let wv = values(d * d, 13);
    let mut m = MethodBuilder::new("attention");
    let cq = const_tensor(pb, &mut m, &[di, di], &wq);
    let ck = const_tensor(pb, &mut m, &[di, di], &wk);
    let cv = const_tensor(pb, &mut m, &[di, di], &wv);
    let x = planned(&mut m, &[si, di]);
    let q = planned(&mut m, &[si, di]);
    let k = planned(&mut m, &[si, di]);
    let v = planned(&mut m, &[si, di]);
    let kt = planned(&mut m, &[di, si]);
    let scores = planned(&mut m, &[si, si]);
    let scaled = planned(&mut m, &[si, si]);
    let probs = planned(&mut m, &[si, si]);
    let ctx = planned(&mut m, &[si, di]);
    let flat = planned(&mut m, &[si * di]);
    m.kernel_call("aten::mm", "out", &[x, cq, q, q]);
    m.kernel_call("aten::mm", "out", &[x, ck, k, k]);
    m.kernel_call("aten::mm", "out", &[x, cv, v, v]);
    let dims = m.int_list(&[1, 0]);
    m.kernel_call("aten::permute_copy", "out", &[k, dims, kt, kt]);
    m.kernel_call("aten::mm", "out", &[q, kt, scores, scores]);
    let scale = 1.0 / (d as f64).sqrt();
    let sc = m.double(scale);
    m.kernel_call("aten::mul", "Scalar_out", &[scores, sc, scaled, scaled]);
    let dim = m.int(-1);
    let half = m.bool(false);
    m.kernel_call("aten::_softmax", "out", &[scaled, dim, half, probs, probs]);
    m.kernel_call("aten::mm", "out", &[probs, v, ctx, ctx]);
    let size = m.int_list(&[(s * d) as i64]);
    m.kernel_call("aten::view_copy", "out", &[ctx, size, flat, flat]);
    m.inputs(&[x]);
    m.outputs(&[flat]);
    pb.add_method(m).unwrap();

    let xd = values(s * d, 14);
    let qd = matmul(&xd, &wq, s, d, d);
    let kd = matmul(&xd, &wk, s, d, d);
    let vd = matmul(&xd, &wv, s, d, d);
    let sd: Vec<f32> = matmul(&qd, &transpose(&kd, s, d), s, d, s)
        .iter()
        .map(|x| (*x as f64 * scale) as f32)
        .collect();
    let p = softmax_rows(&sd, s);
    let y = matmul(&p, &vd, s, s, d);
    json!({"name": "attention", "run": true, "atol": 1e-5,
           "inputs": [tensor_json(&[si, di], &xd)], "outputs": [tensor_json(&[si * di], &y)]})
}

/// `aten::native_layer_norm.out` (three outs returned as one TensorList) then `aten::gelu.out`
/// with its `approximate` string argument.
fn layer_norm_gelu(pb: &mut ProgramBuilder) -> Value {
    let (n, c) = (3usize, 8usize);
    let g = values(c, 21);
    let bb = values(c, 22);
    let mut m = MethodBuilder::new("layer_norm_gelu");
    let gv = const_tensor(pb, &mut m, &[c as i32], &g);
    let bv = const_tensor(pb, &mut m, &[c as i32], &bb);
    let x = planned(&mut m, &[n as i32, c as i32]);
    let o0 = planned(&mut m, &[n as i32, c as i32]);
    let o1 = planned(&mut m, &[n as i32, 1]);
    let o2 = planned(&mut m, &[n as i32, 1]);
    let y = planned(&mut m, &[n as i32, c as i32]);
    let shape = m.int_list(&[c as i64]);
    let eps = 1e-5;
    let e = m.double(eps);
    let outs = m.tensor_list(&[o0, o1, o2]);
    m.kernel_call(
        "aten::native_layer_norm",
        "out",
        &[x, shape, gv, bv, e, o0, o1, o2, outs],
    );
    let approx = m.value(EValue::String("none".into()));
    m.kernel_call("aten::gelu", "out", &[o0, approx, y, y]);
    m.inputs(&[x]);
    m.outputs(&[y]);
    pb.add_method(m).unwrap();

    let xd = values(n * c, 23);
    let mut yd = Vec::with_capacity(n * c);
    for row in xd.chunks(c) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / c as f64;
        let rstd = 1.0 / (var + eps).sqrt();
        for (j, &v) in row.iter().enumerate() {
            let ln = (v as f64 - mean) * rstd * g[j] as f64 + bb[j] as f64;
            let gelu = 0.5 * ln * (1.0 + erf(ln / std::f64::consts::SQRT_2));
            yd.push(gelu as f32);
        }
    }
    json!({"name": "layer_norm_gelu", "run": true, "atol": 1e-4,
           "inputs": [tensor_json(&[n as i32, c as i32], &xd)],
           "outputs": [tensor_json(&[n as i32, c as i32], &yd)]})
}

/// erf by Abramowitz–Stegun 7.1.26 refined with a series for small |x| (accuracy ~1e-7, enough
/// for the 1e-4 tolerance).
fn erf(x: f64) -> f64 {
    if x.abs() < 2.0 {
        // Maclaurin series.
        let mut sum = x;
        let mut term = x;
        let x2 = x * x;
        for n in 1..60 {
            term *= -x2 / n as f64;
            sum += term / (2 * n + 1) as f64;
        }
        return sum * 2.0 / std::f64::consts::PI.sqrt();
    }
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let y = 1.0
        - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
            + 0.254829592)
            * t
            * (-x * x).exp();
    y.copysign(x)
}

fn write(name: &str, pb: ProgramBuilder, methods: Vec<Value>, extra: Value) -> Value {
    let path = out_dir().join(name);
    pb.write(&path, WriteOptions::default()).unwrap();
    let f = PteFile::open(&path).unwrap();
    let p = f.program();
    let mut entry = json!({
        "file": name,
        "methods": methods,
        "method_names": p.execution_plan.iter().map(|e| e.name.clone()).collect::<Vec<_>>(),
        "num_segments": p.segments.len(),
        "named_data": p.named_data.iter().flatten()
            .map(|n| json!({"key": n.key, "segment_index": n.segment_index})).collect::<Vec<_>>(),
        "segment_base_offset": f.layout().segment_base_offset,
    });
    if let (Value::Object(e), Value::Object(x)) = (&mut entry, extra) {
        e.extend(x);
    }
    entry
}

#[test]
fn write_conformance_files() {
    std::fs::create_dir_all(out_dir()).unwrap();
    let mut files = Vec::new();

    // The samples' model rebuilt from its facts: its flatc JSON must equal the sample's.
    files.push(write(
        "tiny_linear_golden.pte",
        common::rebuild_tiny_linear(),
        vec![],
        json!({"golden_flatc_json": "tiny_linear.flatc.json"}),
    ));

    let mut pb = ProgramBuilder::new();
    let m = tiny_linear(&mut pb);
    files.push(write("tiny_linear.pte", pb, vec![m], json!({})));

    let mut pb = ProgramBuilder::new();
    let ms = vec![
        linear_addmm(&mut pb),
        attention(&mut pb),
        layer_norm_gelu(&mut pb),
    ];
    files.push(write("blocks.pte", pb, ms, json!({})));

    // One engine stored once as named data, used by delegates in two methods; plus a delegate
    // whose blob is a segment of its own. Not runnable (no TensorRTBackend in these runtimes):
    // decoded and checked structurally only.
    let dir = tempfile::tempdir().unwrap();
    let engine = dir.path().join("engine.plan");
    std::fs::write(
        &engine,
        values(1000, 99)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
    )
    .unwrap();
    let mut pb = ProgramBuilder::new();
    let eng = pb
        .add_named_data("engine-0", SegmentData::file(&engine).unwrap(), 4096)
        .unwrap();
    pb.name_segment("engine-0-alias", eng).unwrap();
    let blob = pb
        .add_segment(SegmentData::bytes(b"TR03engine-0".to_vec()), 16)
        .unwrap();
    for name in ["prefix", "step"] {
        let mut m = MethodBuilder::new(name);
        let x = planned(&mut m, &[2, 2]);
        let y = planned(&mut m, &[2, 2]);
        let d = m.delegate(DelegateSpec {
            id: "TensorRTBackend".into(),
            processed: Processed::Segment(blob),
            compile_specs: vec![CompileSpec {
                key: "device_id".into(),
                value: vec![0],
            }],
        });
        m.delegate_call(d, &[x, y]);
        m.inputs(&[x]);
        m.outputs(&[y]);
        pb.add_method(m).unwrap();
    }
    files.push(write(
        "delegate_named_data.pte",
        pb,
        vec![
            json!({"name": "prefix", "run": false}),
            json!({"name": "step", "run": false}),
        ],
        json!({"segment_alignment": {"0": 4096}}),
    ));

    let manifest = json!({"files": files});
    let tmp = out_dir().join("manifest.json.tmp");
    std::fs::write(&tmp, serde_json::to_string_pretty(&manifest).unwrap()).unwrap();
    std::fs::rename(&tmp, out_dir().join("manifest.json")).unwrap();
}
