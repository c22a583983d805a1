//! Executing programs built with petite-graph's builder.

use petite_graph::{Builder, Dtype, NodeId, Program};
use petite_reference::{Data, Error, Executor, MemoryWeights, NoWeights, Tensor, run};
use std::collections::BTreeMap;

fn inputs(list: Vec<(&str, Tensor)>) -> BTreeMap<String, Tensor> {
    list.into_iter().map(|(n, t)| (n.to_string(), t)).collect()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.float_values().unwrap().into_owned()
}

#[test]
fn linear_gelu_hand_computed() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[2, 2]).unwrap();
    let w = b.weight("w", Dtype::F32, &[3, 2]).unwrap();
    let bias = b.weight("b", Dtype::F32, &[3]).unwrap();
    let y = b.linear(x, w, Some(bias)).unwrap();
    let z = b.mul_scalar(y, 2.0).unwrap();
    b.output("y", y).unwrap();
    b.output("z", z).unwrap();
    let p = b.finish().unwrap();
    let mut ws = MemoryWeights::new();
    ws.insert_f32("w", &[3, 2], &[1., 0., 0., 1., 1., 1.])
        .unwrap();
    ws.insert_f32("b", &[3], &[10., 20., 30.]).unwrap();
    let out = run(
        &p,
        &ws,
        inputs(vec![(
            "x",
            Tensor::f32(&[2, 2], vec![1., 2., 3., 4.]).unwrap(),
        )]),
    )
    .unwrap();
    assert_eq!(f32s(&out["y"]), vec![11., 22., 33., 13., 24., 37.]);
    assert_eq!(f32s(&out["z"]), vec![22., 44., 66., 26., 48., 74.]);
    assert_eq!(out["y"].shape(), &[2, 3]);
    // both weights were released after their last reader
    let mut rel = ws.released();
    rel.sort();
    assert_eq!(rel, vec!["b".to_string(), "w".to_string()]);
}

#[test]
fn positions_mask_and_where_hand_computed() {
    // positions = cumsum(pad) - 1 ; blocked = !(pad_k) ; mask = where(blocked, -2.38e38, 0)
    let mut b = Builder::new();
    let pad = b.input("pad", Dtype::Bool, &[4]).unwrap();
    let pi = b.cast(pad, Dtype::I64).unwrap();
    let cs = b.cumsum(pi, 0).unwrap();
    let pos = b.sub_scalar(cs, 1.0).unwrap();
    let blocked = b.not(pad).unwrap();
    let neg = b.scalar(Dtype::F32, -2.381_976_3e38).unwrap();
    let zero = b.scalar(Dtype::F32, 0.0).unwrap();
    let mask = b.select(blocked, neg, zero).unwrap();
    let n = b.sum(pi, &[0], false).unwrap();
    b.output("pos", pos).unwrap();
    b.output("mask", mask).unwrap();
    b.output("n", n).unwrap();
    let p = b.finish().unwrap();
    let pad_t = Tensor::bool(&[4], vec![true, true, false, true]).unwrap();
    let out = run(&p, &NoWeights, inputs(vec![("pad", pad_t)])).unwrap();
    assert_eq!(out["pos"].as_i64().unwrap(), &[0, 1, 1, 2]);
    assert_eq!(f32s(&out["mask"]), vec![0.0, 0.0, -2.381_976_3e38, 0.0]);
    assert_eq!(out["n"].as_i64().unwrap(), &[3]);
}

#[test]
fn attention_rope_norm_softmax_hand_computed() {
    let mut b = Builder::new();
    // rms_norm of [3, 4] with weight [0, 1] → [3r, 8r], r = 1/sqrt(12.5)
    let x = b.input("x", Dtype::F32, &[1, 2]).unwrap();
    let w = b.constant_f32(&[2], &[0.0, 1.0]).unwrap();
    let n = b.rms_norm(x, Some(w), 0.0).unwrap();
    // softmax over [0, ln 3] = [0.25, 0.75]
    let s_in = b.constant_f32(&[2], &[0.0, 3.0f32.ln()]).unwrap();
    let s = b.softmax(s_in, -1).unwrap();
    // rope with angle π/2 on freq 0: [1,2,3,4] → [-3, 2, 1, 4]
    let q = b.constant_f32(&[1, 1, 1, 4], &[1., 2., 3., 4.]).unwrap();
    let cos = b.constant_f32(&[1, 4], &[0., 1., 0., 1.]).unwrap();
    let sin = b.constant_f32(&[1, 4], &[1., 0., 1., 0.]).unwrap();
    let r = b.rope(q, cos, sin).unwrap();
    // attention: 2 query heads, 1 kv head, keys [1,0],[0,1]; q0 = [0,0] → uniform;
    // mask blocks key 1 for head 1 → picks v0
    let qa = b.constant_f32(&[1, 2, 1, 2], &[0., 0., 5., 5.]).unwrap();
    let k = b.constant_f32(&[1, 1, 2, 2], &[1., 0., 0., 1.]).unwrap();
    let v = b.constant_f32(&[1, 1, 2, 1], &[10., 20.]).unwrap();
    let m = b
        .constant_f32(&[2, 1, 2], &[0., 0., 0., -2.381_976_3e38])
        .unwrap();
    let a = b.attention(qa, k, v, Some(m), 0.5).unwrap();
    for (name, v) in [("n", n), ("s", s), ("r", r), ("a", a)] {
        b.output(name, v).unwrap();
    }
    let p = b.finish().unwrap();
    let out = run(
        &p,
        &NoWeights,
        inputs(vec![("x", Tensor::f32(&[1, 2], vec![3., 4.]).unwrap())]),
    )
    .unwrap();
    let rr = 1.0 / 12.5f32.sqrt();
    assert_eq!(f32s(&out["n"]), vec![3.0 * rr, 4.0 * rr * 2.0]);
    let sm = f32s(&out["s"]);
    // softmax of [ln 1, ln 3]-like logits: one exp (libm) per element, ~1 ulp of 0.75 = 6e-8.
    assert!((sm[0] - 0.25).abs() < 1e-7 && (sm[1] - 0.75).abs() < 1e-7);
    assert_eq!(f32s(&out["r"]), vec![-3., 2., 1., 4.]);
    assert_eq!(f32s(&out["a"]), vec![15., 10.]);
}

#[test]
fn bf16_declared_weight_stored_f32_is_rounded_to_nearest_even() {
    // w = [1 + 2^-8 (a tie: rounds down to 1), 1 + 3·2^-8 (tie: rounds up to 1 + 2^-6)]
    let w_vals = [f32::from_bits(0x3F80_8000), f32::from_bits(0x3F81_8000)];
    let run_with = |declared: Dtype, ws: &MemoryWeights| {
        let mut b = Builder::new();
        let x = b.input("x", declared, &[1, 1]).unwrap();
        let w = b.weight("w", declared, &[2, 1]).unwrap();
        let y = b.linear(x, w, None).unwrap();
        let y = b.cast(y, Dtype::F32).unwrap();
        b.output("y", y).unwrap();
        let p = b.finish().unwrap();
        let x = Tensor::from_f32_as(declared, &[1, 1], vec![1.0]).unwrap();
        f32s(&run(&p, ws, inputs(vec![("x", x)])).unwrap()["y"])
    };
    let mut ws = MemoryWeights::new();
    ws.insert_f32("w", &[2, 1], &w_vals).unwrap();
    assert_eq!(run_with(Dtype::Bf16, &ws), vec![1.0, 1.0 + 4.0 / 256.0]);
    assert_eq!(run_with(Dtype::F32, &ws), w_vals.to_vec());
    // stored bf16, declared f32: widened exactly
    let mut wb = MemoryWeights::new();
    wb.insert_bf16_bits("w", &[2, 1], &[0x3F80, 0x3F82])
        .unwrap();
    assert_eq!(run_with(Dtype::F32, &wb), vec![1.0, 1.0 + 4.0 / 256.0]);
}

#[test]
fn bf16_activations_round_once_per_node() {
    // (1 + 2^-8) is not a bf16: computing 1 + 2^-8 in bf16 gives 1.0, then + 2^-8 again gives 1.0
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[1]).unwrap();
    let y = b.add_scalar(x, 1.0 / 256.0).unwrap();
    let y = b.add_scalar(y, 1.0 / 256.0).unwrap();
    b.output("y", y).unwrap();
    let p = b.finish().unwrap();
    let x = Tensor::from_f32_as(Dtype::Bf16, &[1], vec![1.0]).unwrap();
    let out = run(&p, &NoWeights, inputs(vec![("x", x)])).unwrap();
    assert_eq!(out["y"].dtype(), Dtype::Bf16);
    assert_eq!(f32s(&out["y"]), vec![1.0]);
}

#[test]
fn embedding_reads_rows_from_weight_and_checks_indices() {
    let mut b = Builder::new();
    let t = b.input("tokens", Dtype::I64, &[3]).unwrap();
    let table = b.weight("emb", Dtype::Bf16, &[4, 2]).unwrap();
    let e = b.embedding(table, t).unwrap();
    let e = b.cast(e, Dtype::F32).unwrap();
    b.output("e", e).unwrap();
    let p = b.finish().unwrap();
    let mut ws = MemoryWeights::new();
    let vals: Vec<f32> = vec![0., 1., 10., 11., 20., 21., 30., f32::from_bits(0x3F81_8000)];
    ws.insert_f32("emb", &[4, 2], &vals).unwrap();
    let ok = run(
        &p,
        &ws,
        inputs(vec![("tokens", Tensor::i64(&[3], vec![3, 0, 2]).unwrap())]),
    )
    .unwrap();
    assert_eq!(
        f32s(&ok["e"]),
        vec![30., 1.0 + 4.0 / 256.0, 0., 1., 20., 21.]
    );
    let bad = run(
        &p,
        &ws,
        inputs(vec![("tokens", Tensor::i64(&[3], vec![3, 4, 2]).unwrap())]),
    );
    let msg = bad.unwrap_err().to_string();
    assert!(
        msg.contains("embedding") && msg.contains("index 4"),
        "{msg}"
    );
}

/// Records the readahead an executor asks for.
struct Recording<'a> {
    inner: &'a MemoryWeights,
    asked: std::sync::Mutex<Vec<(String, usize, usize)>>,
}

impl petite_weights::WeightSource for Recording<'_> {
    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
    fn info(&self, name: &str) -> petite_weights::Result<petite_weights::TensorInfo> {
        self.inner.info(name)
    }
    fn tensor(&self, name: &str) -> petite_weights::Result<petite_weights::TensorView<'_>> {
        self.inner.tensor(name)
    }
    fn release(&self, names: &[&str]) -> petite_weights::Result<()> {
        self.inner.release(names)
    }
    fn prefetch_range(&self, name: &str, start: usize, end: usize) -> petite_weights::Result<()> {
        self.asked
            .lock()
            .unwrap()
            .push((name.to_string(), start, end));
        Ok(())
    }
}

/// A table read only by a row gather is never read ahead whole (pi0.5's token embedding is
/// 2 GiB in f32, a prompt reads a few hundred rows of it): the gather asks for its rows; a
/// linear's weight is still read ahead whole.
#[test]
fn gathered_tables_are_read_ahead_by_row() {
    let mut b = Builder::new();
    let t = b.input("tokens", Dtype::I64, &[3]).unwrap();
    let table = b.weight("emb", Dtype::F32, &[1000, 4]).unwrap();
    let e = b.embedding(table, t).unwrap();
    let w = b.weight("w", Dtype::F32, &[2, 4]).unwrap();
    let y = b.linear(e, w, None).unwrap();
    b.output("y", y).unwrap();
    let p = b.finish().unwrap();
    let mut ws = MemoryWeights::new();
    let table_vals: Vec<f32> = (0..4000).map(|i| i as f32).collect();
    ws.insert_f32("emb", &[1000, 4], &table_vals).unwrap();
    ws.insert_f32("w", &[2, 4], &[1., 0., 0., 0., 0., 0., 0., 1.])
        .unwrap();
    let rec = Recording {
        inner: &ws,
        asked: Default::default(),
    };
    let out = Executor::new(&p, &rec)
        .unwrap()
        .run(inputs(vec![(
            "tokens",
            Tensor::i64(&[3], vec![7, 999, 7]).unwrap(),
        )]))
        .unwrap();
    assert_eq!(f32s(&out["y"]), vec![28., 31., 3996., 3999., 28., 31.]);
    let mut asked = rec.asked.into_inner().unwrap();
    asked.sort();
    // rows 7 and 999 (16 bytes each, once each), and the whole of `w`
    assert_eq!(
        asked,
        vec![
            ("emb".to_string(), 7 * 16, 8 * 16),
            ("emb".to_string(), 999 * 16, 1000 * 16),
            ("w".to_string(), 0, 32),
        ]
    );
}

/// `read_ahead_into`: the next program's weights are asked for during this run, after this
/// run's own, whole; the next run asks for them again (cheap when cached), and the results do
/// not change.
#[test]
fn the_next_programs_weights_are_read_ahead_after_this_runs_own() {
    let program = |w: &str, n: usize| {
        let mut b = Builder::new();
        let x = b.input("x", Dtype::F32, &[1, 4]).unwrap();
        let w = b.weight(w, Dtype::F32, &[n, 4]).unwrap();
        let y = b.linear(x, w, None).unwrap();
        b.output("y", y).unwrap();
        b.finish().unwrap()
    };
    let (first, next) = (program("a", 2), program("b", 3));
    let mut ws = MemoryWeights::new();
    ws.insert_f32("a", &[2, 4], &[1., 0., 0., 0., 0., 1., 0., 0.])
        .unwrap();
    ws.insert_f32(
        "b",
        &[3, 4],
        &[0., 0., 1., 0., 0., 0., 0., 1., 1., 1., 1., 1.],
    )
    .unwrap();
    let rec = Recording {
        inner: &ws,
        asked: Default::default(),
    };
    let x = || {
        inputs(vec![(
            "x",
            Tensor::f32(&[1, 4], vec![1., 2., 3., 4.]).unwrap(),
        )])
    };
    let step = Executor::new(&next, &rec).unwrap();
    let out = Executor::new(&first, &rec)
        .unwrap()
        .read_ahead_into(&step)
        .run(x())
        .unwrap();
    assert_eq!(f32s(&out["y"]), vec![1., 2.]);
    assert_eq!(
        std::mem::take(&mut *rec.asked.lock().unwrap()),
        vec![("a".to_string(), 0, 32), ("b".to_string(), 0, 48)]
    );
    assert_eq!(f32s(&step.run(x()).unwrap()["y"]), vec![3., 4., 10.]);
    assert_eq!(
        rec.asked.into_inner().unwrap(),
        vec![("b".to_string(), 0, 48)]
    );
}

#[test]
fn matmul_broadcast_conv_layernorm_split_hand_computed() {
    let mut b = Builder::new();
    let a = b.constant_f32(&[2, 1, 2], &[1., 2., 3., 4.]).unwrap();
    let m = b.constant_f32(&[2, 2], &[1., 0., 0., 2.]).unwrap(); // shared batch
    let mm = b.matmul(a, m).unwrap(); // [[1,4]], [[3,8]]
    let img = b.constant_f32(&[1, 1, 2, 2], &[1., 2., 3., 4.]).unwrap();
    let k = b.weight("k", Dtype::F32, &[1, 1, 2, 2]).unwrap();
    let c = b.conv2d(img, k, None, [2, 2], [0, 0]).unwrap(); // sum = 10
    let ln_x = b.constant_f32(&[2], &[1., 3.]).unwrap();
    let ones = b.constant_f32(&[2], &[1., 1.]).unwrap();
    let zeros = b.constant_f32(&[2], &[0., 0.]).unwrap();
    let ln = b.layer_norm(ln_x, ones, zeros, 0.0).unwrap(); // [-1, 1]
    let parts = b.split(ln_x, 0, &[1, 1]).unwrap();
    let t = b.transpose(mm, 0, 2).unwrap(); // [2,1,2] → [2,1,2] (swap 0 and 2)
    for (n, v) in [("mm", mm), ("c", c), ("ln", ln), ("p1", parts[1]), ("t", t)] {
        b.output(n, v).unwrap();
    }
    let p = b.finish().unwrap();
    let mut ws = MemoryWeights::new();
    ws.insert_f32("k", &[1, 1, 2, 2], &[1., 1., 1., 1.])
        .unwrap();
    let out = run(&p, &ws, BTreeMap::new()).unwrap();
    assert_eq!(f32s(&out["mm"]), vec![1., 4., 3., 8.]);
    assert_eq!(f32s(&out["c"]), vec![10.]);
    assert_eq!(f32s(&out["ln"]), vec![-1., 1.]);
    assert_eq!(f32s(&out["p1"]), vec![3.]);
    assert_eq!(out["t"].shape(), &[2, 1, 2]);
    assert_eq!(f32s(&out["t"]), vec![1., 3., 4., 8.]);
}

#[test]
fn bad_inputs_and_weights_get_named_errors() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[1, 2]).unwrap();
    b.push_scope("proj");
    let w = b.weight("proj.weight", Dtype::F32, &[3, 2]).unwrap();
    let y = b.linear(x, w, None).unwrap();
    b.pop_scope();
    b.output("y", y).unwrap();
    let p = b.finish().unwrap();
    let good_x = || Tensor::f32(&[1, 2], vec![1., 2.]).unwrap();
    // missing input
    let e = run(&p, &NoWeights, BTreeMap::new()).unwrap_err();
    assert!(
        matches!(&e, Error::Input { name, .. } if name == "x"),
        "{e}"
    );
    // wrong shape
    let e = run(
        &p,
        &NoWeights,
        inputs(vec![("x", Tensor::f32(&[2, 1], vec![1., 2.]).unwrap())]),
    )
    .unwrap_err();
    assert!(e.to_string().contains("expected f32[1, 2]"), "{e}");
    // unknown input
    let e = run(
        &p,
        &NoWeights,
        inputs(vec![("x", good_x()), ("z", good_x())]),
    )
    .unwrap_err();
    assert!(e.to_string().contains("\"z\""), "{e}");
    // missing weight: names the node and the tensor
    let e = run(&p, &NoWeights, inputs(vec![("x", good_x())])).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("linear") && msg.contains("proj.weight"),
        "{msg}"
    );
    // weight with a wrong shape
    let mut ws = MemoryWeights::new();
    ws.insert_f32("proj.weight", &[2, 3], &[0.0; 6]).unwrap();
    let msg = run(&p, &ws, inputs(vec![("x", good_x())]))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("declared f32[3, 2]") && msg.contains("[2, 3]"),
        "{msg}"
    );
    // weight stored as an integer type
    let mut wi = MemoryWeights::new();
    wi.insert_bytes("proj.weight", Dtype::I32, &[3, 2], vec![0; 24])
        .unwrap();
    let msg = run(&p, &wi, inputs(vec![("x", good_x())]))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("I32"), "{msg}");
}

#[test]
fn dead_nodes_are_not_run_and_values_are_freed() {
    // the dead branch reads a weight that does not exist: running it would fail
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[2]).unwrap();
    let w = b.weight("missing", Dtype::F32, &[2]).unwrap();
    let _dead = b.add(x, w).unwrap();
    let y = b.neg(x).unwrap();
    b.output("y", y).unwrap();
    let p = b.finish().unwrap();
    let out = Executor::new(&p, &NoWeights)
        .unwrap()
        .run(inputs(vec![(
            "x",
            Tensor::f32(&[2], vec![1., -2.]).unwrap(),
        )]))
        .unwrap();
    assert_eq!(f32s(&out["y"]), vec![-1., 2.]);
    assert!(matches!(out["y"].data(), Data::F32(_)));
}

/// A small transformer block (Gemma-like: RMS norm, q/k/v, RoPE, MQA attention with a padding
/// mask, o_proj, residual, gated gelu MLP) with sizes that exercise the threaded paths.
fn block_program(dtype: Dtype) -> (Program, MemoryWeights) {
    let (s, w, h, kvh, hd, mlp) = (48, 128, 4, 1, 32, 1024);
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[1, s, w]).unwrap();
    let pad = b.input("pad", Dtype::Bool, &[1, s]).unwrap();
    let mut ws = MemoryWeights::new();
    let mut seed = 7u32;
    let mut add_w = |b: &mut Builder, name: &str, shape: &[usize]| {
        let n: usize = shape.iter().product();
        let fan_in = *shape.last().unwrap() as f32;
        let vals: Vec<f32> = (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (((seed >> 8) as f32 / (1u32 << 24) as f32) - 0.5) * 3.4 / fan_in.sqrt()
            })
            .collect();
        ws.insert_f32(name, shape, &vals).unwrap();
        b.weight(name, dtype, shape).unwrap()
    };
    let xd = b.cast(x, dtype).unwrap();
    let ln1 = add_w(&mut b, "ln1", &[w]);
    let h_n = b.rms_norm(xd, Some(ln1), 1e-6).unwrap();
    let wq = add_w(&mut b, "q", &[h * hd, w]);
    let wk = add_w(&mut b, "k", &[kvh * hd, w]);
    let wv = add_w(&mut b, "v", &[kvh * hd, w]);
    let q = b.linear(h_n, wq, None).unwrap();
    let k = b.linear(h_n, wk, None).unwrap();
    let v = b.linear(h_n, wv, None).unwrap();
    let q = b.reshape(q, &[1, s, h, hd]).unwrap();
    let q = b.transpose(q, 1, 2).unwrap();
    let k = b.reshape(k, &[1, s, kvh, hd]).unwrap();
    let k = b.transpose(k, 1, 2).unwrap();
    let v = b.reshape(v, &[1, s, kvh, hd]).unwrap();
    let v = b.transpose(v, 1, 2).unwrap();
    // positions = cumsum(pad) - 1, cos/sin from inv_freq
    let pi = b.cast(pad, Dtype::I64).unwrap();
    let pos = b.cumsum(pi, 1).unwrap();
    let pos = b.sub_scalar(pos, 1.0).unwrap();
    let posf = b.cast(pos, Dtype::F32).unwrap();
    let posf = b.reshape(posf, &[1, s, 1]).unwrap();
    let inv: Vec<f32> = petite_reference::kernels::rope_inv_freq(hd, 10000.0);
    let invc = b.constant_f32(&[1, 1, hd / 2], &inv).unwrap();
    let fr = b.mul(posf, invc).unwrap();
    let emb = b.concat(&[fr, fr], -1).unwrap();
    let cos = b.cos(emb).unwrap();
    let sin = b.sin(emb).unwrap();
    let cos = b.cast(cos, dtype).unwrap();
    let sin = b.cast(sin, dtype).unwrap();
    let cos = b.reshape(cos, &[1, 1, s, hd]).unwrap();
    let sin = b.reshape(sin, &[1, 1, s, hd]).unwrap();
    let q = b.rope(q, cos, sin).unwrap();
    let k = b.rope(k, cos, sin).unwrap();
    // mask: key blocked where pad is false
    let blocked = b.not(pad).unwrap();
    let blocked = b.reshape(blocked, &[1, 1, 1, s]).unwrap();
    let neg = b.scalar(Dtype::F32, -2.381_976_3e38).unwrap();
    let zero = b.scalar(Dtype::F32, 0.0).unwrap();
    let mask = b.select(blocked, neg, zero).unwrap();
    let att = b
        .attention(q, k, v, Some(mask), (hd as f64).powf(-0.5))
        .unwrap();
    let att = b.transpose(att, 1, 2).unwrap();
    let att = b.reshape(att, &[1, s, h * hd]).unwrap();
    let wo = add_w(&mut b, "o", &[w, h * hd]);
    let o = b.linear(att, wo, None).unwrap();
    let r1 = b.add(xd, o).unwrap();
    let ln2 = add_w(&mut b, "ln2", &[w]);
    let h2 = b.rms_norm(r1, Some(ln2), 1e-6).unwrap();
    let wg = add_w(&mut b, "gate", &[mlp, w]);
    let wu = add_w(&mut b, "up", &[mlp, w]);
    let wd = add_w(&mut b, "down", &[w, mlp]);
    let g = b.linear(h2, wg, None).unwrap();
    let g = b.gelu_tanh(g).unwrap();
    let u = b.linear(h2, wu, None).unwrap();
    let gu = b.mul(g, u).unwrap();
    let d = b.linear(gu, wd, None).unwrap();
    let out = b.add(r1, d).unwrap();
    let out = b.cast(out, Dtype::F32).unwrap();
    b.output("out", out).unwrap();
    b.output("k", k).unwrap();
    (b.finish().unwrap(), ws)
}

fn block_inputs() -> BTreeMap<String, Tensor> {
    let (s, w) = (48, 128);
    let x: Vec<f32> = (0..s * w)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let pad: Vec<bool> = (0..s).map(|i| i < 40).collect();
    inputs(vec![
        ("x", Tensor::f32(&[1, s, w], x).unwrap()),
        ("pad", Tensor::bool(&[1, s], pad).unwrap()),
    ])
}

/// Runs `p` cut into two pieces at every `stride`-th position of its node order, feeding the
/// first piece's outputs into the second, and checks each result equals the whole run bit for
/// bit.
fn check_split_equals_whole(p: &Program, ws: &MemoryWeights, stride: usize) {
    let whole = run(p, ws, block_inputs()).unwrap();
    let n = p.len();
    let mut cuts = 0;
    for cut in (1..n).step_by(stride) {
        let a_nodes: Vec<NodeId> = (0..cut as u32).map(NodeId).collect();
        let b_nodes: Vec<NodeId> = (cut as u32..n as u32).map(NodeId).collect();
        let a = p.subprogram(&a_nodes).unwrap();
        let b = p.subprogram(&b_nodes).unwrap();
        let mut avail = block_inputs();
        let a_in: BTreeMap<String, Tensor> = a
            .program
            .inputs
            .iter()
            .map(|&i| {
                let name = a.program.input_name(i).unwrap().to_string();
                let t = avail[&name].clone();
                (name, t)
            })
            .collect();
        let a_out = run(&a.program, ws, a_in).unwrap();
        avail.extend(a_out.clone());
        let b_in: BTreeMap<String, Tensor> = b
            .program
            .inputs
            .iter()
            .map(|&i| {
                let name = b.program.input_name(i).unwrap().to_string();
                let t = avail
                    .get(&name)
                    .unwrap_or_else(|| panic!("cut {cut}: {name}"))
                    .clone();
                (name, t)
            })
            .collect();
        let b_out = run(&b.program, ws, b_in).unwrap();
        for (name, want) in &whole {
            let got = b_out.get(name).or_else(|| a_out.get(name)).unwrap();
            assert_eq!(got.dtype(), want.dtype());
            assert_eq!(got.shape(), want.shape());
            assert_eq!(
                got.to_bytes(),
                want.to_bytes(),
                "cut at {cut}: output {name} differs"
            );
        }
        cuts += 1;
    }
    assert!(cuts >= 5);
}

#[test]
fn split_program_equals_whole_bit_for_bit_f32() {
    let (p, ws) = block_program(Dtype::F32);
    check_split_equals_whole(&p, &ws, 3);
}

#[test]
fn split_program_equals_whole_bit_for_bit_bf16() {
    let (p, ws) = block_program(Dtype::Bf16);
    check_split_equals_whole(&p, &ws, 4);
}

#[test]
fn block_is_deterministic_and_bf16_is_close_to_f32() {
    let (p32, w32) = block_program(Dtype::F32);
    let (p16, w16) = block_program(Dtype::Bf16);
    let a = run(&p32, &w32, block_inputs()).unwrap();
    let a2 = run(&p32, &w32, block_inputs()).unwrap();
    assert_eq!(a["out"].to_bytes(), a2["out"].to_bytes());
    let b = run(&p16, &w16, block_inputs()).unwrap();
    let (x, y) = (f32s(&a["out"]), f32s(&b["out"]));
    // The shared fold: a NaN or a length mismatch fails instead of vanishing in the max.
    let max_err = petite_reference::max_abs_diff(&y, &x).unwrap();
    let max_abs = petite_reference::compare::max_abs(&x).unwrap();
    // bf16 has 8 significant bits: differences are visible but small relative to the values
    assert!(
        max_err > 0.0 && max_err < 0.1 * max_abs,
        "{max_err} vs {max_abs}"
    );
}

#[test]
fn intermediates_are_freed_after_last_use() {
    // a chain of 20 unary ops on 1 MiB values: holding them all would be 21 MiB
    let n = 1 << 18;
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[n]).unwrap();
    let mut v = x;
    for i in 0..20 {
        v = if i % 2 == 0 {
            b.neg(v).unwrap()
        } else {
            b.tanh(v).unwrap()
        };
    }
    b.output("y", v).unwrap();
    let p = b.finish().unwrap();
    let ex = Executor::new(&p, &NoWeights).unwrap();
    let (out, stats) = ex
        .run_with_stats(inputs(vec![(
            "x",
            Tensor::f32(&[n], vec![0.5; n]).unwrap(),
        )]))
        .unwrap();
    assert_eq!(stats.nodes_run, 20);
    // at any moment at most an input and its output are held
    assert_eq!(stats.peak_value_bytes, 2 * 4 * n);
    // black_box: computed at run time by the same libm the executor calls; a release build
    // otherwise folds the chain at compile time, where tanh's last bit may differ.
    let want = (0..20).fold(std::hint::black_box(0.5f32), |a, i| {
        if i % 2 == 0 { -a } else { a.tanh() }
    });
    assert_eq!(f32s(&out["y"])[0], want);
}

#[test]
fn chunk_pieces_are_all_correct_when_each_is_read() {
    // adaRMS-style: chunk a [1, 6] into scale/shift/gate and use all three
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[1, 6]).unwrap();
    let parts = b.chunk(x, 3, -1).unwrap();
    let s = b.add(parts[0], parts[1]).unwrap();
    let s = b.mul(s, parts[2]).unwrap();
    b.output("s", s).unwrap();
    b.output("gate", parts[2]).unwrap();
    let p = b.finish().unwrap();
    let out = run(
        &p,
        &NoWeights,
        inputs(vec![(
            "x",
            Tensor::f32(&[1, 6], vec![1., 2., 3., 4., 5., 6.]).unwrap(),
        )]),
    )
    .unwrap();
    // (1+3)*5, (2+4)*6
    assert_eq!(f32s(&out["s"]), vec![20., 36.]);
    assert_eq!(f32s(&out["gate"]), vec![5., 6.]);
}

#[test]
fn zero_sized_dims_run_without_panicking() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[0, 4]).unwrap();
    let w = b.constant_f32(&[3, 4], &[0.5; 12]).unwrap();
    let y = b.linear(x, w, None).unwrap();
    let y = b.softmax(y, -1).unwrap();
    let y = b.rms_norm(y, None, 1e-6).unwrap();
    let y = b.gelu_tanh(y).unwrap();
    let s = b.sum(y, &[0], false).unwrap();
    b.output("y", y).unwrap();
    b.output("s", s).unwrap();
    let p = b.finish().unwrap();
    let out = run(
        &p,
        &NoWeights,
        inputs(vec![("x", Tensor::f32(&[0, 4], vec![]).unwrap())]),
    )
    .unwrap();
    assert_eq!(out["y"].shape(), &[0, 3]);
    assert_eq!(f32s(&out["s"]), vec![0.0; 3]);
}

#[test]
fn weight_source_returning_short_bytes_is_an_error() {
    struct Short;
    impl petite_weights::WeightSource for Short {
        fn names(&self) -> Vec<String> {
            vec!["w".into()]
        }
        fn info(&self, _: &str) -> petite_weights::Result<petite_weights::TensorInfo> {
            Ok(petite_weights::TensorInfo {
                dtype: Dtype::F32,
                shape: vec![2, 2],
            })
        }
        fn tensor(&self, _: &str) -> petite_weights::Result<petite_weights::TensorView<'_>> {
            Ok(petite_weights::TensorView {
                name: "w",
                dtype: Dtype::F32,
                shape: &[2, 2],
                bytes: &[0u8; 12],
            })
        }
        fn release(&self, _: &[&str]) -> petite_weights::Result<()> {
            Ok(())
        }
    }
    let mut b = Builder::new();
    let t = b.input("t", Dtype::I64, &[1]).unwrap();
    let w = b.weight("w", Dtype::F32, &[2, 2]).unwrap();
    let e = b.embedding(w, t).unwrap();
    b.output("e", e).unwrap();
    let p = b.finish().unwrap();
    let msg = run(
        &p,
        &Short,
        inputs(vec![("t", Tensor::i64(&[1], vec![1]).unwrap())]),
    )
    .unwrap_err()
    .to_string();
    assert!(msg.contains("12 bytes"), "{msg}");
}

/// `Builder::embedding_sharded` equals the plain gather bit for bit, for every id of the table,
/// f32 and bf16 (bf16 rounded from an f32 checkpoint), i64 and i32 ids, several shard sizes.
#[test]
fn sharded_embedding_equals_the_plain_gather_bit_for_bit() {
    let (v, d) = (37usize, 6usize);
    let vals: Vec<f32> = (0..v * d)
        .map(|i| ((i * 7919 % 1013) as f32 - 500.0) / 77.7)
        .collect();
    let mut ws = MemoryWeights::new();
    ws.insert_f32("table", &[v, d], &vals).unwrap();
    for dtype in [Dtype::F32, Dtype::Bf16] {
        for idt in [Dtype::I64, Dtype::I32] {
            let ids: Vec<i64> = (0..v as i64).rev().chain([0, 36, 5, 5]).collect();
            let n = ids.len();
            let t = match idt {
                Dtype::I64 => Tensor::new(&[1, n], Data::I64(ids.clone())).unwrap(),
                _ => Tensor::new(&[1, n], Data::I32(ids.iter().map(|&i| i as i32).collect()))
                    .unwrap(),
            };
            let run_with = |max: usize| {
                let mut b = Builder::new();
                let x = b.input("ids", idt, &[1, n]).unwrap();
                let y = b
                    .embedding_sharded("table", dtype, &[v, d], x, max)
                    .unwrap();
                b.output("y", y).unwrap();
                let p = b.finish().unwrap();
                let shards = p.weights().len();
                let out = Executor::new(&p, &ws)
                    .unwrap()
                    .run(inputs(vec![("ids", t.clone())]))
                    .unwrap();
                (shards, out["y"].to_bytes())
            };
            let (one, plain) = run_with(usize::MAX);
            assert_eq!(one, 1);
            let row = d * dtype.size();
            for max in [row, 2 * row, 5 * row + 1, 18 * row, 36 * row] {
                let (shards, got) = run_with(max);
                assert_eq!(shards, v.div_ceil(max / row), "{dtype} max {max}");
                assert!(got == plain, "{dtype} {idt} max {max}: differs");
            }
        }
    }
}

/// A row-range weight read whole (not through an embedding) is exactly those rows.
#[test]
fn a_row_range_weight_is_the_rows_of_the_checkpoint_tensor() {
    let vals: Vec<f32> = (0..5 * 3).map(|i| i as f32 * 1.5 - 4.0).collect();
    let mut ws = MemoryWeights::new();
    ws.insert_f32("w", &[5, 3], &vals).unwrap();
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[2, 3]).unwrap();
    let w = b.weight_rows("w", Dtype::F32, &[5, 3], [1, 4]).unwrap();
    let y = b.linear(x, w, None).unwrap();
    b.output("y", y).unwrap();
    b.output("w", w).unwrap();
    let p = b.finish().unwrap();
    let xs = vec![1.0, 2.0, -1.0, 0.5, 0.0, 3.0];
    let out = run(
        &p,
        &ws,
        inputs(vec![("x", Tensor::f32(&[2, 3], xs.clone()).unwrap())]),
    )
    .unwrap();
    assert_eq!(f32s(&out["w"]), vals[3..12].to_vec());
    let want: Vec<f32> = (0..2)
        .flat_map(|i| {
            let xs = &xs;
            let vals = &vals;
            (1..4).map(move |r| (0..3).map(|k| xs[i * 3 + k] * vals[r * 3 + k]).sum::<f32>())
        })
        .collect();
    assert_eq!(f32s(&out["y"]), want);
    // A checkpoint with fewer rows than the range is refused, naming the weight.
    let mut short = MemoryWeights::new();
    short.insert_f32("w", &[3, 3], &vals[..9]).unwrap();
    let e = run(
        &p,
        &short,
        inputs(vec![("x", Tensor::f32(&[2, 3], xs).unwrap())]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("\"w\"") && e.contains("rows [1, 4)"), "{e}");
}

/// bf16 arithmetic on two bf16 tensors (run in one pass over their bits) gives the bits of
/// widening both to f32, computing there and rounding once — same shapes and broadcast, with
/// ties, subnormals, infinities and NaN among the values.
#[test]
fn bf16_binary_ops_equal_the_widened_f32_op_rounded_once() {
    let special = [
        1.0f32,
        -0.0,
        f32::from_bits(0x3F80_8000), // a tie between two bf16 neighbours when added to 1
        f32::from_bits(0x0001_0000), // subnormal
        f32::INFINITY,
        f32::NAN,
        3.0e38,
        -7.5,
    ];
    let vals = |n: usize, seed: u32| -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|i| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                if i % 5 == 0 {
                    special[(s >> 8) as usize % special.len()]
                } else {
                    ((s >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 8.0
                }
            })
            .collect()
    };
    // (lhs shape, rhs shape): equal, then broadcast on either side.
    for (sa, sb) in [
        (vec![3, 70, 40], vec![3, 70, 40]),
        (vec![3, 70, 40], vec![40]),
        (vec![70, 1], vec![3, 1, 40]),
    ] {
        let (na, nb) = (sa.iter().product(), sb.iter().product());
        let ta = Tensor::from_f32_as(Dtype::Bf16, &sa, vals(na, 1)).unwrap();
        let tb = Tensor::from_f32_as(Dtype::Bf16, &sb, vals(nb, 2)).unwrap();
        for op in 0..4 {
            let build = |widened: bool| {
                let mut b = Builder::new();
                let x = b.input("a", Dtype::Bf16, &sa).unwrap();
                let y = b.input("b", Dtype::Bf16, &sb).unwrap();
                let (x, y) = if widened {
                    (
                        b.cast(x, Dtype::F32).unwrap(),
                        b.cast(y, Dtype::F32).unwrap(),
                    )
                } else {
                    (x, y)
                };
                let z = match op {
                    0 => b.add(x, y),
                    1 => b.sub(x, y),
                    2 => b.mul(x, y),
                    _ => b.div(x, y),
                }
                .unwrap();
                let z = if widened {
                    b.cast(z, Dtype::Bf16).unwrap()
                } else {
                    z
                };
                b.output("z", z).unwrap();
                b.finish().unwrap()
            };
            let ins = || inputs(vec![("a", ta.clone()), ("b", tb.clone())]);
            let direct = run(&build(false), &NoWeights, ins()).unwrap();
            let widened = run(&build(true), &NoWeights, ins()).unwrap();
            let (Data::Bf16(d), Data::Bf16(w)) = (direct["z"].data(), widened["z"].data()) else {
                panic!("bf16 results expected");
            };
            assert!(!d.is_empty() && d.len() == w.len());
            assert_eq!(direct["z"].shape(), widened["z"].shape());
            let bits = |v: &[half::bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(d), bits(w), "op {op}, shapes {sa:?} and {sb:?}");
        }
    }
}
