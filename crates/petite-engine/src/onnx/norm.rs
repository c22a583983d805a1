//! Normalisation and attention: layer and RMS norms, softmax, rotary embedding, attention (MatMul →
//! Mul → Add → Softmax → MatMul, the pattern TensorRT fuses), embedding lookup.

use super::*;

impl Emitter<'_> {
    /// Normalisation and attention: the node `id` (op `op`) as ONNX nodes.
    pub(super) fn emit_norm(&mut self, id: NodeId, op: &Op) -> Result<()> {
        let n = self.p.node(id);
        match op {
            Op::LayerNorm { eps } => {
                let (x, w, b) = (self.in_f32(id, 0), self.in_f32(id, 1), self.in_f32(id, 2));
                let y = self.op(
                    "LayerNormalization",
                    &[&x, &w, &b],
                    vec![("axis", Attr::I(-1)), ("epsilon", Attr::F(*eps as f32))],
                );
                self.finish_f32(id, &y);
            }
            Op::RmsNorm { eps } => {
                let x = self.in_f32(id, 0);
                let sq = self.op("Mul", &[&x, &x], vec![]);
                let ms = self.reduce_axes("ReduceMean", &sq, vec![-1], true);
                let e = self.const_f32(*eps as f32);
                let a = self.op("Add", &[&ms, &e], vec![]);
                let s = self.op("Sqrt", &[&a], vec![]);
                let r = self.op("Reciprocal", &[&s], vec![]);
                let mut y = self.op("Mul", &[&x, &r], vec![]);
                if n.inputs.len() > 1 {
                    let w = self.in_f32(id, 1);
                    let one = self.const_f32(1.0);
                    let w1 = self.op("Add", &[&w, &one], vec![]);
                    y = self.op("Mul", &[&y, &w1], vec![]);
                }
                self.finish_f32(id, &y);
            }
            Op::Softmax { axis } => {
                let x = self.in_f32(id, 0);
                let y = self.op("Softmax", &[&x], vec![("axis", Attr::I(*axis as i64))]);
                self.finish_f32(id, &y);
            }
            Op::Rope => {
                let x = self.in_f32(id, 0);
                let cos = self.in_f32(id, 1);
                let sin = self.in_f32(id, 2);
                let t = self
                    .p
                    .node(n.inputs[0])
                    .tensor()
                    .cloned()
                    .unwrap_or_else(|| petite_graph::TensorType::new(Dtype::F32, &[]));
                let d = *t.shape.last().unwrap_or(&0);
                let rank = t.shape.len() as i64;
                let halves = self.const_i64(&[(d / 2) as i64, (d / 2) as i64]);
                let (x1, x2) = (self.tmp(), self.tmp());
                self.node(
                    "Split",
                    &[&x, &halves],
                    &[&x1, &x2],
                    vec![("axis", Attr::I(rank - 1))],
                );
                let nx2 = self.op("Neg", &[&x2], vec![]);
                let rot = self.op("Concat", &[&nx2, &x1], vec![("axis", Attr::I(rank - 1))]);
                let a = self.op("Mul", &[&x, &cos], vec![]);
                let b = self.op("Mul", &[&rot, &sin], vec![]);
                let y = self.op("Add", &[&a, &b], vec![]);
                self.finish_f32(id, &y);
            }
            Op::Attention { scale } => {
                let q = self.in_f32(id, 0);
                let mut k = self.in_f32(id, 1);
                let mut v = self.in_f32(id, 2);
                let qs = self.p.node(n.inputs[0]).tensor().map(|t| t.shape.clone());
                let ks = self.p.node(n.inputs[1]).tensor().map(|t| t.shape.clone());
                let vs = self.p.node(n.inputs[2]).tensor().map(|t| t.shape.clone());
                let (Some(qs), Some(ks), Some(vs)) = (qs, ks, vs) else {
                    return Err(self.unsupported(id, "tuple operand"));
                };
                let (h, kvh) = (qs[1], ks[1]);
                if h != kvh {
                    // GQA: repeat each KV head H/KVH times (head h reads KV head h / (H/KVH)).
                    let g = h / kvh;
                    for (t, s) in [(&mut k, &ks), (&mut v, &vs)] {
                        let ax = self.const_i64(&[2]);
                        let u = self.op("Unsqueeze", &[t.as_str(), &ax], vec![]);
                        let shape = self.const_i64(&[
                            s[0] as i64,
                            s[1] as i64,
                            g as i64,
                            s[2] as i64,
                            s[3] as i64,
                        ]);
                        let e = self.op("Expand", &[&u, &shape], vec![]);
                        let flat =
                            self.const_i64(&[s[0] as i64, h as i64, s[2] as i64, s[3] as i64]);
                        *t = self.op("Reshape", &[&e, &flat], vec![]);
                    }
                }
                let kt = self.op(
                    "Transpose",
                    &[&k],
                    vec![("perm", Attr::Ints(vec![0, 1, 3, 2]))],
                );
                let qk = self.op("MatMul", &[&q, &kt], vec![]);
                let sc = self.const_f32(*scale as f32);
                let mut logits = self.op("Mul", &[&qk, &sc], vec![]);
                if n.inputs.len() > 3 {
                    let m = self.in_f32(id, 3);
                    logits = self.op("Add", &[&logits, &m], vec![]);
                }
                let p = self.op("Softmax", &[&logits], vec![("axis", Attr::I(-1))]);
                let y = self.op("MatMul", &[&p, &v], vec![]);
                self.finish_f32(id, &y);
            }
            Op::Embedding => {
                let (t, i) = (self.input(id, 0), self.input(id, 1));
                let y = self.op("Gather", &[&t, &i], vec![("axis", Attr::I(0))]);
                self.finish_native(id, &y);
            }
            other => unreachable!("{} is not a norm op", other.name()),
        }
        Ok(())
    }
}
