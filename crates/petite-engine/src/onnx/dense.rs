//! Dense products: linear layers, batched matmuls, the patch-embedding convolution (TensorRT:
//! native dtype; the twin: f32, rounded once).

use super::*;

impl Emitter<'_> {
    /// Dense products: the node `id` (op `op`) as ONNX nodes.
    pub(super) fn emit_dense(&mut self, id: NodeId, op: &Op) -> Result<()> {
        let n = self.p.node(id);
        match op {
            Op::Linear | Op::MatMul | Op::Conv2d { .. } => {
                // TensorRT: native dtype (bf16 GEMMs accumulate in f32). Twin: f32, rounded once.
                let native = self.flavor == Flavor::TensorRt;
                let get = |s: &mut Self, i: usize| {
                    if native {
                        s.input(id, i)
                    } else {
                        s.in_f32(id, i)
                    }
                };
                let x = get(self, 0);
                let w = get(self, 1);
                let b = if n.inputs.len() > 2 {
                    Some(get(self, 2))
                } else {
                    None
                };
                let y = match &n.op {
                    Op::Linear if self.gemm_linear => {
                        let xs = self.p.node(n.inputs[0]).tensor().map(|t| t.shape.clone());
                        let ys = self.p.node(id).tensor().map(|t| t.shape.clone());
                        let (Some(xs), Some(ys)) = (xs, ys) else {
                            return Err(self.unsupported(id, "tuple operand"));
                        };
                        let k = *xs.last().unwrap_or(&1) as i64;
                        let x2 = if xs.len() == 2 {
                            x
                        } else {
                            let s = self.const_i64(&[-1, k]);
                            self.op("Reshape", &[&x, &s], vec![])
                        };
                        let mut ins = vec![x2.as_str(), w.as_str()];
                        if let Some(b) = &b {
                            ins.push(b);
                        }
                        let g = self.op("Gemm", &ins, vec![("transB", Attr::I(1))]);
                        if ys.len() == 2 {
                            g
                        } else {
                            let s = self.const_i64(&dims(&ys));
                            self.op("Reshape", &[&g, &s], vec![])
                        }
                    }
                    Op::Linear => {
                        let wt =
                            self.op("Transpose", &[&w], vec![("perm", Attr::Ints(vec![1, 0]))]);
                        let m = self.op("MatMul", &[&x, &wt], vec![]);
                        match b {
                            Some(b) => self.op("Add", &[&m, &b], vec![]),
                            None => m,
                        }
                    }
                    Op::MatMul => self.op("MatMul", &[&x, &w], vec![]),
                    Op::Conv2d { stride, padding } => {
                        let mut ins = vec![x.as_str(), w.as_str()];
                        if let Some(b) = &b {
                            ins.push(b);
                        }
                        let (s, p) = (*stride, *padding);
                        self.op(
                            "Conv",
                            &ins,
                            vec![
                                ("strides", Attr::Ints(vec![s[0] as i64, s[1] as i64])),
                                (
                                    "pads",
                                    Attr::Ints(vec![
                                        p[0] as i64,
                                        p[1] as i64,
                                        p[0] as i64,
                                        p[1] as i64,
                                    ]),
                                ),
                            ],
                        )
                    }
                    _ => unreachable!("matched above"),
                };
                if native {
                    self.finish_native(id, &y);
                } else {
                    self.finish_f32(id, &y);
                }
            }
            other => unreachable!("{} is not a dense op", other.name()),
        }
        Ok(())
    }
}
