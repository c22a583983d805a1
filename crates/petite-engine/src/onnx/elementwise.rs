//! Elementwise ops and reductions: binary and scalar arithmetic, comparisons, logic, unary
//! functions, casts, where, cumulative sum, reductions.

use super::*;

impl Emitter<'_> {
    /// Elementwise ops and reductions: the node `id` (op `op`) as ONNX nodes.
    pub(super) fn emit_elementwise(&mut self, id: NodeId, op: &Op) -> Result<()> {
        let n = self.p.node(id);
        let out_d = self.dtype(id);
        let float = out_d.is_float();
        match op {
            Op::Binary { kind } => {
                let opn = match kind {
                    BinaryOp::Add => "Add",
                    BinaryOp::Sub => "Sub",
                    BinaryOp::Mul => "Mul",
                    BinaryOp::Div => "Div",
                };
                if float {
                    let (a, b) = (self.in_f32(id, 0), self.in_f32(id, 1));
                    let y = self.op(opn, &[&a, &b], vec![]);
                    self.finish_f32(id, &y);
                } else {
                    let (a, b) = (self.input(id, 0), self.input(id, 1));
                    let y = self.op(opn, &[&a, &b], vec![]);
                    self.finish_native(id, &y);
                }
            }
            Op::BinaryScalar {
                kind,
                scalar,
                scalar_lhs,
            } => {
                let opn = match kind {
                    BinaryOp::Add => "Add",
                    BinaryOp::Sub => "Sub",
                    BinaryOp::Mul => "Mul",
                    BinaryOp::Div => "Div",
                };
                let (x, s) = if float {
                    let s = *scalar as f32;
                    let s = match out_d {
                        Dtype::Bf16 => petite_dtype::round_through_bf16(s),
                        Dtype::F16 => half::f16::from_f32(s).to_f32(),
                        _ => s,
                    };
                    (self.in_f32(id, 0), self.const_f32(s))
                } else {
                    let raw: Vec<u8> = match out_d {
                        Dtype::I64 => (*scalar as i64).to_le_bytes().to_vec(),
                        Dtype::I32 => (*scalar as i32).to_le_bytes().to_vec(),
                        Dtype::U8 => vec![*scalar as u8],
                        _ => return Err(self.unsupported(id, "scalar op on bool")),
                    };
                    let c = self.init_raw(onnx_type(out_d), &[], &raw);
                    (self.input(id, 0), c)
                };
                let y = if *scalar_lhs {
                    self.op(opn, &[&s, &x], vec![])
                } else {
                    self.op(opn, &[&x, &s], vec![])
                };
                if float {
                    self.finish_f32(id, &y);
                } else {
                    self.finish_native(id, &y);
                }
            }
            Op::Compare { kind } => {
                let d = self.dtype(n.inputs[0]);
                let (mut a, mut b) = (self.input(id, 0), self.input(id, 1));
                if d == Dtype::Bool || d == Dtype::U8 {
                    a = self.cast(&a, INT32);
                    b = self.cast(&b, INT32);
                }
                let y = match kind {
                    CompareOp::Lt => self.op("Less", &[&a, &b], vec![]),
                    CompareOp::Le => self.op("LessOrEqual", &[&a, &b], vec![]),
                    CompareOp::Gt => self.op("Greater", &[&a, &b], vec![]),
                    CompareOp::Ge => self.op("GreaterOrEqual", &[&a, &b], vec![]),
                    CompareOp::Eq => self.op("Equal", &[&a, &b], vec![]),
                    CompareOp::Ne => {
                        let e = self.op("Equal", &[&a, &b], vec![]);
                        self.op("Not", &[&e], vec![])
                    }
                };
                self.finish_native(id, &y);
            }
            Op::Logical { kind } => {
                let (a, b) = (self.input(id, 0), self.input(id, 1));
                let opn = match kind {
                    LogicalOp::And => "And",
                    LogicalOp::Or => "Or",
                };
                let y = self.op(opn, &[&a, &b], vec![]);
                self.finish_native(id, &y);
            }
            Op::Not => {
                let a = self.input(id, 0);
                let y = self.op("Not", &[&a], vec![]);
                self.finish_native(id, &y);
            }
            Op::Unary { kind } => {
                if !float {
                    let a = self.input(id, 0);
                    let y = self.op("Neg", &[&a], vec![]);
                    self.finish_native(id, &y);
                    return Ok(());
                }
                let x = self.in_f32(id, 0);
                let y = match kind {
                    UnaryOp::Neg => self.op("Neg", &[&x], vec![]),
                    UnaryOp::Exp => self.op("Exp", &[&x], vec![]),
                    UnaryOp::Sqrt => self.op("Sqrt", &[&x], vec![]),
                    UnaryOp::Rsqrt => {
                        let s = self.op("Sqrt", &[&x], vec![]);
                        self.op("Reciprocal", &[&s], vec![])
                    }
                    UnaryOp::Sin => self.op("Sin", &[&x], vec![]),
                    UnaryOp::Cos => self.op("Cos", &[&x], vec![]),
                    UnaryOp::Tanh => self.op("Tanh", &[&x], vec![]),
                    UnaryOp::Silu => {
                        let s = self.op("Sigmoid", &[&x], vec![]);
                        self.op("Mul", &[&x, &s], vec![])
                    }
                    UnaryOp::GeluTanh => {
                        // 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
                        let x2 = self.op("Mul", &[&x, &x], vec![]);
                        let x3 = self.op("Mul", &[&x2, &x], vec![]);
                        let c = self.const_f32(0.044715);
                        let t = self.op("Mul", &[&x3, &c], vec![]);
                        let inner = self.op("Add", &[&x, &t], vec![]);
                        let k = self.const_f32((2.0f64 / std::f64::consts::PI).sqrt() as f32);
                        let u = self.op("Mul", &[&inner, &k], vec![]);
                        let th = self.op("Tanh", &[&u], vec![]);
                        let one = self.const_f32(1.0);
                        let p1 = self.op("Add", &[&th, &one], vec![]);
                        let half = self.const_f32(0.5);
                        let hx = self.op("Mul", &[&x, &half], vec![]);
                        self.op("Mul", &[&hx, &p1], vec![])
                    }
                };
                self.finish_f32(id, &y);
            }
            Op::Cast { to } => {
                let from = self.dtype(n.inputs[0]);
                let x = self.input(id, 0);
                if to.is_float() {
                    let f = if self.ty(from) == FLOAT {
                        x
                    } else {
                        self.cast(&x, FLOAT)
                    };
                    self.finish_f32(id, &f);
                } else {
                    let y = self.cast(&x, onnx_type(*to));
                    self.finish_native(id, &y);
                }
            }
            Op::Dequantize { .. } => {
                // codes · scale[row] (ONNX: `(x − 0) · scale` on axis 0), rounded once to the
                // declared dtype, as the reference executor computes it.
                let (c, s) = (self.input(id, 0), self.input(id, 1));
                let half = matches!(out_d, Dtype::Bf16 | Dtype::F16);
                if self.flavor == Flavor::TensorRt && half && self.dtype(n.inputs[1]) == Dtype::F32
                {
                    // In the declared dtype: a scale in it makes `DequantizeLinear` give it
                    // straight, the form TensorRT's INT8 path builds (an f32 scale's f32 result
                    // cast to bf16 fails inside its Myelin compiler). The same bits: scales are
                    // exact in bf16 (petite_dtype::quant) and a code times one is exact in f32,
                    // so both round the same exact product once.
                    let ty = onnx_type(out_d);
                    let key = (s.clone(), ty);
                    let s16 = match self.scale_casts.get(&key) {
                        Some(v) => v.clone(),
                        None => {
                            let v = self.cast(&s, ty);
                            self.scale_casts.insert(key, v.clone());
                            v
                        }
                    };
                    let y = self.op("DequantizeLinear", &[&c, &s16], vec![("axis", Attr::I(0))]);
                    self.finish_native(id, &y);
                } else {
                    let y = self.op("DequantizeLinear", &[&c, &s], vec![("axis", Attr::I(0))]);
                    self.finish_f32(id, &y);
                }
            }
            Op::CumSum { axis } => {
                let mut x = self.input(id, 0);
                let narrow = matches!(out_d, Dtype::U8 | Dtype::Bool);
                if narrow {
                    x = self.cast(&x, INT32);
                }
                let a = self.const_i64(&[*axis as i64]);
                let mut y = self.op("CumSum", &[&x, &a], vec![]);
                if float {
                    // Twin: values are f32; cumsum in f32 then round.
                    self.finish_f32(id, &y);
                } else {
                    if narrow {
                        y = self.cast(&y, onnx_type(out_d));
                    }
                    self.finish_native(id, &y);
                }
            }
            Op::Where => {
                let c = self.input(id, 0);
                let (a, b) = (self.input(id, 1), self.input(id, 2));
                let y = self.op("Where", &[&c, &a, &b], vec![]);
                self.finish_native(id, &y);
            }
            Op::Reduce {
                kind,
                axes,
                keepdim,
            } => {
                let ax: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
                let kd = ("keepdims", Attr::I(i64::from(*keepdim)));
                let x = if float {
                    self.in_f32(id, 0)
                } else {
                    self.input(id, 0)
                };
                let y = match kind {
                    ReduceOp::Sum => {
                        let a = self.const_i64(&ax);
                        self.op("ReduceSum", &[&x, &a], vec![kd])
                    }
                    ReduceOp::Mean => self.reduce_axes("ReduceMean", &x, ax, *keepdim),
                    ReduceOp::Max => self.reduce_axes("ReduceMax", &x, ax, *keepdim),
                };
                if float {
                    self.finish_f32(id, &y);
                } else {
                    self.finish_native(id, &y);
                }
            }
            other => unreachable!("{} is not a elementwise op", other.name()),
        }
        Ok(())
    }
}
