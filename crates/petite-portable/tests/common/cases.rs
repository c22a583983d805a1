//! The op cases: one tiny program per op (and per interesting dtype/attribute) with its weights
//! and inputs. Shared through `#[path]` by petite-portable's `op_cases` (lowered to portable
//! `.pte`s, run by ExecuTorch in the conformance tier) and petite's `runtimes` suite (built into
//! reference engines, run by every registered runtime), so both check the same programs.
#![allow(dead_code)]

use std::collections::BTreeMap;

use petite_graph::{Builder, Dtype, Program};
use petite_reference::{Data, MemoryWeights, Tensor};

/// A case: its name, program, weights and inputs by name.
pub type Case = (
    &'static str,
    Program,
    MemoryWeights,
    BTreeMap<String, Tensor>,
);

/// Deterministic values in [lo, hi).
fn vals(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = ((s >> 40) as f32) / ((1u64 << 24) as f32);
            lo + (hi - lo) * u
        })
        .collect()
}

fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

struct C {
    b: Builder,
    w: MemoryWeights,
    ins: BTreeMap<String, Tensor>,
    seed: u64,
}

impl C {
    fn new() -> C {
        C {
            b: Builder::new(),
            w: MemoryWeights::new(),
            ins: BTreeMap::new(),
            seed: 1,
        }
    }
    fn next(&mut self) -> u64 {
        self.seed += 1;
        self.seed
    }
    /// A float input of `dtype` with values in [lo, hi).
    fn fin(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        lo: f32,
        hi: f32,
    ) -> petite_graph::ValueId {
        let v = vals(numel(shape), self.next(), lo, hi);
        self.ins.insert(
            name.into(),
            Tensor::from_f32_as(dtype, shape, v).expect("tensor"),
        );
        self.b.input(name, dtype, shape).expect("input")
    }
    fn tin(&mut self, name: &str, t: Tensor) -> petite_graph::ValueId {
        let id = self.b.input(name, t.dtype(), t.shape()).expect("input");
        self.ins.insert(name.into(), t);
        id
    }
    /// A weight stored as f32 in the source, declared as `dtype` by the program.
    fn wt(&mut self, name: &str, dtype: Dtype, shape: &[usize]) -> petite_graph::ValueId {
        let v = vals(numel(shape), self.next(), -0.5, 0.5);
        self.w.insert_f32(name, shape, &v).expect("weight");
        self.b.weight(name, dtype, shape).expect("weight")
    }
    fn done(mut self, name: &'static str, outs: &[petite_graph::ValueId]) -> Case {
        for (i, &o) in outs.iter().enumerate() {
            self.b.output(&format!("y{i}"), o).expect("output");
        }
        (name, self.b.finish().expect("program"), self.w, self.ins)
    }
}

/// Every case.
pub fn cases() -> Vec<Case> {
    use Dtype::*;
    let mut v = Vec::new();
    for (name, d) in [("linear_f32", F32), ("linear_bf16", Bf16)] {
        let mut c = C::new();
        let x = c.fin("x", d, &[2, 3, 5], -1.0, 1.0);
        let w = c.wt("w", d, &[4, 5]);
        let b = c.wt("b", d, &[4]);
        let y = c.b.linear(x, w, Some(b)).unwrap();
        let w2 = c.wt("w2", d, &[3, 4]);
        let y2 = c.b.linear(y, w2, None).unwrap();
        v.push(c.done(name, &[y, y2]));
    }
    {
        let mut c = C::new();
        let x = c.fin("x", F32, &[3, 5], -1.0, 1.0);
        let w = c.fin("w", F32, &[4, 5], -1.0, 1.0);
        let y = c.b.linear(x, w, None).unwrap();
        v.push(c.done("linear_activation_weight", &[y]));
    }
    {
        let mut c = C::new();
        let a = c.fin("a", F32, &[3, 4], -1.0, 1.0);
        let b = c.fin("b", F32, &[4, 5], -1.0, 1.0);
        let y = c.b.matmul(a, b).unwrap();
        let a4 = c.fin("a4", F32, &[2, 1, 3, 4], -1.0, 1.0);
        let b4 = c.fin("b4", F32, &[3, 4, 5], -1.0, 1.0);
        let y4 = c.b.matmul(a4, b4).unwrap();
        v.push(c.done("matmul", &[y, y4]));
    }
    {
        let mut c = C::new();
        let x = c.fin("x", F32, &[2, 3, 7, 6], -1.0, 1.0);
        let w = c.wt("w", F32, &[4, 3, 3, 2]);
        let b = c.wt("b", F32, &[4]);
        let y = c.b.conv2d(x, w, Some(b), [2, 1], [1, 0]).unwrap();
        let y2 = c.b.conv2d(x, w, None, [1, 2], [0, 1]).unwrap();
        v.push(c.done("conv2d", &[y, y2]));
    }
    for (name, d) in [("layer_norm_f32", F32), ("layer_norm_bf16", Bf16)] {
        let mut c = C::new();
        let x = c.fin("x", d, &[2, 3, 8], -2.0, 2.0);
        let w = c.wt("w", F32, &[8]);
        let b = c.wt("b", d, &[8]);
        let y = c.b.layer_norm(x, w, b, 1e-6).unwrap();
        v.push(c.done(name, &[y]));
    }
    for (name, d) in [("rms_norm_f32", F32), ("rms_norm_bf16", Bf16)] {
        let mut c = C::new();
        let x = c.fin("x", d, &[3, 16], -2.0, 2.0);
        let w = c.wt("w", F32, &[16]);
        let y = c.b.rms_norm(x, Some(w), 1e-6).unwrap();
        let y2 = c.b.rms_norm(x, None, 1e-5).unwrap();
        v.push(c.done(name, &[y, y2]));
    }
    {
        let mut c = C::new();
        let a = c.fin("a", F32, &[2, 3, 4], -1.0, 1.0);
        let b = c.fin("b", F32, &[3, 1], 0.5, 2.0);
        let y0 = c.b.add(a, b).unwrap();
        let y1 = c.b.sub(a, b).unwrap();
        let y2 = c.b.mul(a, b).unwrap();
        let y3 = c.b.div(a, b).unwrap();
        let i = c.tin("i", Tensor::i64(&[4], vec![3, -2, 7, 0]).unwrap());
        let j = c.tin("j", Tensor::i64(&[2, 1], vec![5, -1]).unwrap());
        let y4 = c.b.add(i, j).unwrap();
        let y5 = c.b.mul(i, j).unwrap();
        v.push(c.done("binary", &[y0, y1, y2, y3, y4, y5]));
    }
    for (name, d) in [("binary_scalar_f32", F32), ("binary_scalar_bf16", Bf16)] {
        let mut c = C::new();
        let x = c.fin("x", d, &[2, 5], 0.5, 2.0);
        let ys = vec![
            c.b.add_scalar(x, 0.3).unwrap(),
            c.b.sub_scalar(x, 1.7).unwrap(),
            c.b.mul_scalar(x, 2048f64.sqrt()).unwrap(),
            c.b.div_scalar(x, 3.0).unwrap(),
            c.b.rsub_scalar(1.0, x).unwrap(),
            c.b.rdiv_scalar(3.0, x).unwrap(),
        ];
        v.push(c.done(name, &ys));
    }
    {
        let mut c = C::new();
        let x = c.tin("x", Tensor::i64(&[4], vec![3, -2, 7, 0]).unwrap());
        let ys = vec![
            c.b.add_scalar(x, 2.0).unwrap(),
            c.b.rsub_scalar(1.0, x).unwrap(),
            c.b.mul_scalar(x, -3.0).unwrap(),
        ];
        v.push(c.done("binary_scalar_i64", &ys));
    }
    {
        let mut c = C::new();
        let a = c.tin(
            "a",
            Tensor::f32(&[2, 3], vec![1., 2., 3., 4., 5., 6.]).unwrap(),
        );
        let b = c.tin("b", Tensor::f32(&[3], vec![2., 2., 5.]).unwrap());
        let ys = vec![
            c.b.lt(a, b).unwrap(),
            c.b.le(a, b).unwrap(),
            c.b.eq(a, b).unwrap(),
            c.b.ne(a, b).unwrap(),
            c.b.gt(a, b).unwrap(),
            c.b.ge(a, b).unwrap(),
        ];
        let i = c.tin("i", Tensor::i64(&[3], vec![1, 5, 2]).unwrap());
        let j = c.tin("j", Tensor::i64(&[2, 1], vec![2, 5]).unwrap());
        let mut ys = ys;
        ys.push(c.b.le(i, j).unwrap());
        ys.push(c.b.eq(i, j).unwrap());
        v.push(c.done("compare", &ys));
    }
    {
        let mut c = C::new();
        let a = c.tin(
            "a",
            Tensor::bool(&[2, 2], vec![true, false, true, false]).unwrap(),
        );
        let b = c.tin("b", Tensor::bool(&[2], vec![true, false]).unwrap());
        let y0 = c.b.and(a, b).unwrap();
        let y1 = c.b.or(a, b).unwrap();
        let y2 = c.b.not(a).unwrap();
        v.push(c.done("logical", &[y0, y1, y2]));
    }
    for (name, d) in [("unary_f32", F32), ("unary_bf16", Bf16)] {
        let mut c = C::new();
        let x = c.fin("x", d, &[3, 7], -3.0, 3.0);
        let p = c.fin("p", d, &[3, 7], 0.1, 4.0);
        let ys = vec![
            c.b.neg(x).unwrap(),
            c.b.exp(x).unwrap(),
            c.b.sqrt(p).unwrap(),
            c.b.rsqrt(p).unwrap(),
            c.b.sin(x).unwrap(),
            c.b.cos(x).unwrap(),
            c.b.tanh(x).unwrap(),
            c.b.gelu_tanh(x).unwrap(),
            c.b.silu(x).unwrap(),
        ];
        v.push(c.done(name, &ys));
    }
    {
        let mut c = C::new();
        let x = c.tin("x", Tensor::i64(&[3], vec![4, -9, 0]).unwrap());
        let y = c.b.neg(x).unwrap();
        v.push(c.done("neg_i64", &[y]));
    }
    for (name, d) in [("softmax_f32", F32), ("softmax_bf16", Bf16)] {
        let mut c = C::new();
        let x = c.fin("x", d, &[2, 5, 3], -4.0, 4.0);
        let y = c.b.softmax(x, 1).unwrap();
        let y2 = c.b.softmax(x, -1).unwrap();
        v.push(c.done(name, &[y, y2]));
    }
    {
        let mut c = C::new();
        let x = c.fin("x", F32, &[1, 2, 3, 8], -1.0, 1.0);
        let cs = c.fin("cos", F32, &[1, 1, 3, 8], -1.0, 1.0);
        let sn = c.fin("sin", F32, &[1, 1, 3, 8], -1.0, 1.0);
        let y = c.b.rope(x, cs, sn).unwrap();
        v.push(c.done("rope", &[y]));
    }
    for (name, d) in [("attention_f32", F32), ("attention_bf16", Bf16)] {
        let mut c = C::new();
        let q = c.fin("q", d, &[1, 4, 3, 8], -1.0, 1.0);
        let k = c.fin("k", d, &[1, 2, 5, 8], -1.0, 1.0);
        let vv = c.fin("v", d, &[1, 2, 5, 6], -1.0, 1.0);
        let mut mask = vec![0f32; 15];
        mask[4] = -2.3819763e38;
        mask[8] = -2.3819763e38;
        let m = c.tin("mask", Tensor::f32(&[1, 1, 3, 5], mask).unwrap());
        let y = c.b.attention(q, k, vv, Some(m), 8f64.powf(-0.5)).unwrap();
        let q2 = c.fin("q2", d, &[2, 2, 3, 4], -1.0, 1.0);
        let k2 = c.fin("k2", d, &[2, 2, 4, 4], -1.0, 1.0);
        let v2 = c.fin("v2", d, &[2, 2, 4, 4], -1.0, 1.0);
        let y2 = c.b.attention(q2, k2, v2, None, 0.5).unwrap();
        v.push(c.done(name, &[y, y2]));
    }
    {
        let mut c = C::new();
        let t = c.wt("table", F32, &[10, 4]);
        let i = c.tin("i", Tensor::i64(&[2, 3], vec![0, 9, 3, 3, 1, 5]).unwrap());
        let j = c.tin("j", Tensor::new(&[2], Data::I32(vec![7, 2])).unwrap());
        let y = c.b.embedding(t, i).unwrap();
        let y2 = c.b.embedding(t, j).unwrap();
        v.push(c.done("embedding", &[y, y2]));
    }
    for (name, d) in [
        ("embedding_sharded_f32", F32),
        ("embedding_sharded_bf16", Bf16),
    ] {
        // A 10-row table read as 4 row ranges (3 rows = the shard size): each range is a
        // constant of just its rows, selected with compare/and/where.
        let mut c = C::new();
        let vals = vals(40, c.next(), -0.5, 0.5);
        c.w.insert_f32("table", &[10, 4], &vals).expect("weight");
        let i = c.tin("i", Tensor::i64(&[2, 3], vec![0, 9, 3, 5, 6, 2]).unwrap());
        let y =
            c.b.embedding_sharded("table", d, &[10, 4], i, 3 * 4 * d.size())
                .unwrap();
        assert_eq!(c.b.program().weights().len(), 4);
        v.push(c.done(name, &[y]));
    }
    {
        let mut c = C::new();
        let a = c.fin("a", F32, &[2, 1, 3], -1.0, 1.0);
        let b = c.fin("b", F32, &[2, 4, 3], -1.0, 1.0);
        let y = c.b.concat(&[a, b, a], 1).unwrap();
        let s = c.b.slice(b, 1, 1, 4, 2).unwrap();
        let r = c.b.reshape(b, &[3, 8]).unwrap();
        let p = c.b.permute(b, &[2, 0, 1]).unwrap();
        let e = c.b.expand(a, &[5, 2, 4, 3]).unwrap();
        let parts = c.b.split(b, 1, &[1, 3]).unwrap();
        v.push(c.done("shape_ops", &[y, s, r, p, e, parts[0], parts[1]]));
    }
    {
        let mut c = C::new();
        let x = c.tin(
            "x",
            Tensor::f32(&[5], vec![-2.7, -0.0, 0.5, 1.5, 3.99]).unwrap(),
        );
        let bl = c.tin("bl", Tensor::bool(&[3], vec![true, false, true]).unwrap());
        let u = c.tin("u", Tensor::u8(&[3], vec![0, 1, 7]).unwrap());
        let i = c.tin("i", Tensor::i64(&[2], vec![-3, 9]).unwrap());
        let ys = vec![
            c.b.cast(x, Bf16).unwrap(),
            c.b.cast(x, I64).unwrap(),
            c.b.cast(x, Bool).unwrap(),
            c.b.cast(bl, F32).unwrap(),
            c.b.cast(u, Bool).unwrap(),
            c.b.cast(i, F32).unwrap(),
            c.b.cast(bl, I64).unwrap(),
        ];
        v.push(c.done("cast", &ys));
    }
    {
        let mut c = C::new();
        let i = c.tin("i", Tensor::i64(&[2, 3], vec![1, 0, 1, 1, 1, 0]).unwrap());
        let x = c.fin("x", F32, &[2, 3], -1.0, 1.0);
        let y = c.b.cumsum(i, 1).unwrap();
        let y2 = c.b.cumsum(x, 0).unwrap();
        let cond = c.tin("cond", Tensor::bool(&[3], vec![true, false, true]).unwrap());
        let z = c.fin("z", F32, &[2, 1], -1.0, 1.0);
        let w = c.b.select(cond, x, z).unwrap();
        v.push(c.done("cumsum_where", &[y, y2, w]));
    }
    for (name, d) in [("reduce_f32", F32), ("reduce_bf16", Bf16)] {
        let mut c = C::new();
        let x = c.fin("x", d, &[2, 3, 4], -1.0, 1.0);
        let ys = vec![
            c.b.sum(x, &[1], false).unwrap(),
            c.b.mean(x, &[-1], true).unwrap(),
            c.b.max(x, &[0, 2], false).unwrap(),
        ];
        v.push(c.done(name, &ys));
    }
    {
        let mut c = C::new();
        let x = c.fin("x", F32, &[2, 3], -1.0, 1.0);
        let k = c.b.constant_f32(&[3], &[1.0, -2.0, 0.5]).unwrap();
        let y = c.b.mul(x, k).unwrap();
        v.push(c.done("passthrough_constant", &[x, k, y, y]));
    }
    v
}
