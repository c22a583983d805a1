//! ONNX export of one engine's subgraph, for the TensorRT ONNX parser (opset 17, ops it
//! supports, attention as MatMul → Mul → Add → Softmax → MatMul, the pattern TensorRT fuses).
//!
//! Weights are never loaded: each weight is an initializer whose bytes stay in the mapping file,
//! referenced as ONNX external data (`location` = the mapping file's name in the model's
//! directory, `offset`/`length` = the tensor's bytes), in the dtype the file stores; a `Cast`
//! follows where the subgraph declares another dtype.
//!
//! [`Flavor::F32Twin`] is the same emitter with every bf16/f16 value carried as f32 and rounded
//! through its declared type after each op (a `Cast` pair), so ONNX Runtime's CPU kernels (which
//! mostly lack bf16) compute what the engine computes; the conformance tier checks it against
//! the reference executor.

mod pb;

use std::collections::BTreeMap;
use std::path::Path;

use petite_graph::{BinaryOp, CompareOp, Dtype, LogicalOp, NodeId, Op, Program, ReduceOp, UnaryOp};
use petite_weights::Header;

pub use pb::Msg;

use crate::{Error, Result};

/// ONNX opset the models use (TensorRT 10's parser supports it; has LayerNormalization).
pub const OPSET: i64 = 17;
/// ONNX IR version matching opset 17.
pub const IR_VERSION: i64 = 8;

/// Which model to emit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// For TensorRT: bf16 values stay bf16.
    TensorRt,
    /// For ONNX Runtime on CPU: bf16/f16 values carried as f32, rounded after each op.
    F32Twin,
}

/// Where a weight's bytes are in the mapping file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightLocation {
    /// Stored dtype.
    pub dtype: Dtype,
    /// Stored shape.
    pub shape: Vec<usize>,
    /// Absolute file offset of the first byte.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
}

/// Locates every tensor of a mapping file from its header (no bytes read).
pub fn locations(header: &Header) -> BTreeMap<String, WeightLocation> {
    header
        .entries
        .iter()
        .map(|e| {
            (
                e.name.clone(),
                WeightLocation {
                    dtype: e.dtype,
                    shape: e.shape.clone(),
                    offset: (header.data_start + e.begin) as u64,
                    len: (e.end - e.begin) as u64,
                },
            )
        })
        .collect()
}

const FLOAT: i64 = 1;
const UINT8: i64 = 2;
const INT32: i64 = 6;
const INT64: i64 = 7;
const BOOL: i64 = 9;
const FLOAT16: i64 = 10;
const BFLOAT16: i64 = 16;

/// ONNX `TensorProto.DataType` of a graph dtype.
pub fn onnx_type(d: Dtype) -> i64 {
    match d {
        Dtype::F32 => FLOAT,
        Dtype::Bf16 => BFLOAT16,
        Dtype::F16 => FLOAT16,
        Dtype::I64 => INT64,
        Dtype::I32 => INT32,
        Dtype::U8 => UINT8,
        Dtype::Bool => BOOL,
    }
}

fn stored_type(d: Dtype) -> Option<i64> {
    Some(match d {
        Dtype::F32 => FLOAT,
        Dtype::Bf16 => BFLOAT16,
        Dtype::F16 => FLOAT16,
        Dtype::I64 => INT64,
        Dtype::I32 => INT32,
        Dtype::U8 => UINT8,
        Dtype::Bool => BOOL,
    })
}

fn dims(shape: &[usize]) -> Vec<i64> {
    shape.iter().map(|&d| d as i64).collect()
}

fn value_info(name: &str, elem: i64, shape: &[usize]) -> Msg {
    let mut sh = Msg::new();
    for &d in shape {
        sh.msg(1, Msg::new().int(1, d as i64));
    }
    let mut tt = Msg::new();
    tt.int(1, elem).msg(2, &sh);
    let mut ty = Msg::new();
    ty.msg(1, &tt);
    let mut vi = Msg::new();
    vi.str(1, name).msg(2, &ty);
    vi
}

enum Attr {
    I(i64),
    F(f32),
    Ints(Vec<i64>),
}

/// How [`emit_with`] writes a model, beyond its [`Flavor`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmitOptions<'a> {
    /// Which model to emit.
    pub flavor: Flavor,
    /// `linear` as `Gemm(x, W, b, transB=1)` (inputs of rank ≠ 2 reshaped to 2-D around it)
    /// instead of `MatMul(x, Transpose(W))`. For ONNX Runtime: it constant-folds a `Transpose`
    /// of an initializer into a transposed copy held in memory, one per `linear` node — for a
    /// weight shared by ten steps, ten copies — where `Gemm` reads the stored weight as it is.
    pub gemm_linear: bool,
    /// The graph's name.
    pub graph_name: &'a str,
}

impl EmitOptions<'_> {
    /// What [`emit`] uses: `MatMul(x, Transpose(W))`, graph `petite_engine`.
    pub fn engine(flavor: Flavor) -> Self {
        EmitOptions {
            flavor,
            gemm_linear: false,
            graph_name: "petite_engine",
        }
    }
}

struct Emitter<'a> {
    p: &'a Program,
    flavor: Flavor,
    gemm_linear: bool,
    weights: &'a BTreeMap<String, WeightLocation>,
    location: &'a str,
    nodes: Vec<Msg>,
    inits: Vec<Msg>,
    names: Vec<String>,
    fresh: usize,
}

impl Emitter<'_> {
    /// Element type a value of declared dtype `d` has in this flavour.
    fn ty(&self, d: Dtype) -> i64 {
        match (self.flavor, d) {
            (Flavor::F32Twin, Dtype::Bf16 | Dtype::F16) => FLOAT,
            _ => onnx_type(d),
        }
    }

    fn tmp(&mut self) -> String {
        self.fresh += 1;
        format!("_t{}", self.fresh)
    }

    fn node(&mut self, op: &str, ins: &[&str], outs: &[&str], attrs: Vec<(&str, Attr)>) {
        let mut n = Msg::new();
        for i in ins {
            n.str(1, i);
        }
        for o in outs {
            n.str(2, o);
        }
        n.str(3, &format!("{}_{}", op, self.nodes.len()));
        n.str(4, op);
        for (name, a) in attrs {
            let mut m = Msg::new();
            m.str(1, name);
            match a {
                Attr::I(v) => m.int(3, v).int(20, 2),
                Attr::F(v) => m.float(2, v).int(20, 1),
                Attr::Ints(v) => m.packed_ints(8, &v).int(20, 7),
            };
            n.msg(5, &m);
        }
        self.nodes.push(n);
    }

    /// One op with a fresh output; returns the output name.
    fn op(&mut self, op: &str, ins: &[&str], attrs: Vec<(&str, Attr)>) -> String {
        let o = self.tmp();
        self.node(op, ins, &[&o], attrs);
        o
    }

    fn init_raw(&mut self, elem: i64, shape: &[usize], raw: &[u8]) -> String {
        let name = self.tmp();
        let mut t = Msg::new();
        t.packed_ints(1, &dims(shape))
            .int(2, elem)
            .str(8, &name)
            .bytes(9, raw);
        self.inits.push(t);
        name
    }

    fn const_i64(&mut self, v: &[i64]) -> String {
        let raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.init_raw(INT64, &[v.len()], &raw)
    }

    fn const_f32(&mut self, v: f32) -> String {
        self.init_raw(FLOAT, &[], &v.to_le_bytes())
    }

    fn cast(&mut self, x: &str, to: i64) -> String {
        self.op("Cast", &[x], vec![("to", Attr::I(to))])
    }

    /// Input `i` of node `id` as f32 (cast if its flavour type is not).
    fn in_f32(&mut self, id: NodeId, i: usize) -> String {
        let v = self.p.node(id).inputs[i];
        let name = self.names[v.index()].clone();
        let d = self.dtype(v);
        if self.ty(d) == FLOAT {
            name
        } else {
            self.cast(&name, FLOAT)
        }
    }

    fn dtype(&self, v: NodeId) -> Dtype {
        self.p.node(v).tensor().map_or(Dtype::F32, |t| t.dtype)
    }

    fn input(&self, id: NodeId, i: usize) -> String {
        self.names[self.p.node(id).inputs[i].index()].clone()
    }

    /// Writes `x` (f32) as the node's value: rounded to its declared float dtype.
    fn finish_f32(&mut self, id: NodeId, x: &str) {
        let out = self.names[id.index()].clone();
        let d = self.dtype(id);
        match (self.flavor, d) {
            (_, Dtype::F32) => self.node("Identity", &[x], &[&out], vec![]),
            (Flavor::TensorRt, d) => {
                self.node("Cast", &[x], &[&out], vec![("to", Attr::I(onnx_type(d)))])
            }
            (Flavor::F32Twin, d) => {
                let r = self.cast(x, onnx_type(d));
                self.node("Cast", &[&r], &[&out], vec![("to", Attr::I(FLOAT))]);
            }
        }
    }

    /// Writes `x`, already in the node's flavour type, as the node's value.
    fn finish_native(&mut self, id: NodeId, x: &str) {
        let out = self.names[id.index()].clone();
        self.node("Identity", &[x], &[&out], vec![]);
    }

    fn unsupported(&self, id: NodeId, reason: impl Into<String>) -> Error {
        Error::Unsupported {
            node: self.p.describe(id),
            reason: reason.into(),
        }
    }

    /// A weight as an initializer with external data in the mapping file; a row range points
    /// at just its rows' bytes (one contiguous range, row-major), so the model carries only them.
    fn weight(&mut self, id: NodeId, name: &str, rows: Option<[usize; 2]>) -> Result<()> {
        let t = self
            .p
            .node(id)
            .tensor()
            .cloned()
            .ok_or_else(|| self.unsupported(id, "weight declared as a tuple"))?;
        let loc = self.weights.get(name).ok_or_else(|| Error::Weight {
            tensor: name.to_string(),
            expected: t.to_string(),
            found: "no such tensor in the mapping file".into(),
        })?;
        let stored = stored_type(loc.dtype).unwrap_or(FLOAT);
        let float_ok = t.dtype.is_float() && loc.dtype.is_float();
        let shape_ok = match rows {
            None => loc.shape == t.shape,
            Some([a, b]) => {
                !loc.shape.is_empty()
                    && a < b
                    && b <= loc.shape[0]
                    && t.shape.first() == Some(&(b - a))
                    && loc.shape[1..] == t.shape[1..]
            }
        };
        if !shape_ok || !(float_ok || stored == onnx_type(t.dtype)) {
            return Err(Error::Weight {
                tensor: name.to_string(),
                expected: t.to_string(),
                found: format!(
                    "{}{}",
                    loc.dtype.safetensors_name(),
                    petite_graph::ShapeDisplay(&loc.shape)
                ),
            });
        }
        let (init, offset, len) = match rows {
            None => (format!("w:{name}"), loc.offset, loc.len),
            Some([a, b]) => {
                let row = loc.len / loc.shape[0] as u64;
                (
                    format!("w:{}", petite_graph::weight_display(name, rows)),
                    loc.offset + a as u64 * row,
                    (b - a) as u64 * row,
                )
            }
        };
        let mut tp = Msg::new();
        tp.packed_ints(1, &dims(&t.shape))
            .int(2, stored)
            .str(8, &init);
        for (k, v) in [
            ("location", self.location.to_string()),
            ("offset", offset.to_string()),
            ("length", len.to_string()),
        ] {
            tp.msg(13, Msg::new().str(1, k).str(2, &v));
        }
        tp.int(14, 1);
        self.inits.push(tp);
        let want = self.ty(t.dtype);
        if stored == want && stored == onnx_type(t.dtype) {
            self.finish_native(id, &init);
        } else if t.dtype.is_float() {
            let f = if stored == FLOAT {
                init
            } else {
                self.cast(&init, FLOAT)
            };
            self.finish_f32(id, &f);
        } else {
            self.finish_native(id, &init);
        }
        Ok(())
    }

    fn constant(&mut self, id: NodeId, data: &[u8]) -> Result<()> {
        let t = self
            .p
            .node(id)
            .tensor()
            .cloned()
            .ok_or_else(|| self.unsupported(id, "constant declared as a tuple"))?;
        let raw: std::borrow::Cow<'_, [u8]> = match (self.flavor, t.dtype) {
            (Flavor::F32Twin, d @ (Dtype::Bf16 | Dtype::F16)) => petite_dtype::widen_le(d, data)
                .unwrap_or_default()
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<u8>>()
                .into(),
            _ => data.into(),
        };
        let c = self.init_raw(self.ty(t.dtype), &t.shape, &raw);
        self.finish_native(id, &c);
        Ok(())
    }

    fn emit(&mut self, id: NodeId) -> Result<()> {
        let n = self.p.node(id);
        let out_d = self.dtype(id);
        let float = out_d.is_float();
        match &n.op {
            Op::Input { .. } => {}
            Op::Weight { name, rows } => self.weight(id, &name.clone(), *rows)?,
            Op::Constant { data } => self.constant(id, &data.clone())?,
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
                let ms = self.op(
                    "ReduceMean",
                    &[&sq],
                    vec![("axes", Attr::Ints(vec![-1])), ("keepdims", Attr::I(1))],
                );
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
            Op::Concat { axis } => {
                let ins: Vec<String> = (0..n.inputs.len()).map(|i| self.input(id, i)).collect();
                let refs: Vec<&str> = ins.iter().map(String::as_str).collect();
                let y = self.op("Concat", &refs, vec![("axis", Attr::I(*axis as i64))]);
                self.finish_native(id, &y);
            }
            Op::Slice {
                axis,
                start,
                end,
                step,
            } => {
                let x = self.input(id, 0);
                let s = self.const_i64(&[*start as i64]);
                let e = self.const_i64(&[*end as i64]);
                let a = self.const_i64(&[*axis as i64]);
                let st = self.const_i64(&[*step as i64]);
                let y = self.op("Slice", &[&x, &s, &e, &a, &st], vec![]);
                self.finish_native(id, &y);
            }
            Op::Reshape { shape } => {
                let x = self.input(id, 0);
                let s = self.const_i64(&dims(shape));
                let y = self.op("Reshape", &[&x, &s], vec![]);
                self.finish_native(id, &y);
            }
            Op::Permute { perm } => {
                let x = self.input(id, 0);
                let perm = perm.iter().map(|&p| p as i64).collect();
                let y = self.op("Transpose", &[&x], vec![("perm", Attr::Ints(perm))]);
                self.finish_native(id, &y);
            }
            Op::Expand { shape } => {
                let x = self.input(id, 0);
                let s = self.const_i64(&dims(shape));
                let y = self.op("Expand", &[&x, &s], vec![]);
                self.finish_native(id, &y);
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
                    ReduceOp::Mean => {
                        self.op("ReduceMean", &[&x], vec![("axes", Attr::Ints(ax)), kd])
                    }
                    ReduceOp::Max => {
                        self.op("ReduceMax", &[&x], vec![("axes", Attr::Ints(ax)), kd])
                    }
                };
                if float {
                    self.finish_f32(id, &y);
                } else {
                    self.finish_native(id, &y);
                }
            }
            Op::Split { axis, sizes } => {
                let x = self.input(id, 0);
                let s = self.const_i64(&sizes.iter().map(|&v| v as i64).collect::<Vec<_>>());
                let outs: Vec<String> = (0..sizes.len())
                    .map(|i| format!("{}_{i}", self.names[id.index()]))
                    .collect();
                let refs: Vec<&str> = outs.iter().map(String::as_str).collect();
                self.node(
                    "Split",
                    &[&x, &s],
                    &refs,
                    vec![("axis", Attr::I(*axis as i64))],
                );
            }
            Op::GetItem { index } => {
                let src = format!("{}_{index}", self.input(id, 0));
                self.finish_native(id, &src);
            }
        }
        Ok(())
    }
}

/// Emits `program` as an ONNX model. `weights` locates each weight in the mapping file, which the
/// model references as `location` (a file name in the model's directory).
pub fn emit(
    program: &Program,
    weights: &BTreeMap<String, WeightLocation>,
    location: &str,
    flavor: Flavor,
) -> Result<Vec<u8>> {
    emit_with(program, weights, location, &EmitOptions::engine(flavor))
}

/// [`emit`] with explicit [`EmitOptions`]. Every weight node is one initializer (external data
/// in `location`); a program that declares each weight once (petite-graph's builder does, also
/// across [`petite_graph::Builder::inline`]d copies) stores each weight once however many nodes
/// read it.
pub fn emit_with(
    program: &Program,
    weights: &BTreeMap<String, WeightLocation>,
    location: &str,
    opts: &EmitOptions<'_>,
) -> Result<Vec<u8>> {
    let mut v = Vec::new();
    emit_to(program, weights, location, opts, &mut v)?;
    Ok(v)
}

/// [`emit_with`] written to `out` as it is encoded (the bytes are the same): what the whole-
/// policy export uses, so the model is held in memory once (its nodes and initializers as
/// encoded messages), not three times (nodes, graph, model). Returns the bytes written.
pub fn emit_to(
    program: &Program,
    weights: &BTreeMap<String, WeightLocation>,
    location: &str,
    opts: &EmitOptions<'_>,
    out: &mut dyn std::io::Write,
) -> Result<u64> {
    let flavor = opts.flavor;
    program.validate()?;
    let order = program.topo_order()?;
    let names: Vec<String> = program
        .ids()
        .map(|id| match &program.node(id).op {
            Op::Input { name } => name.clone(),
            _ => format!("_n{}", id.0),
        })
        .collect();
    let mut e = Emitter {
        p: program,
        flavor,
        gemm_linear: opts.gemm_linear,
        weights,
        location,
        nodes: Vec::new(),
        inits: Vec::new(),
        names,
        fresh: 0,
    };
    let roots: Vec<NodeId> = program.outputs.iter().map(|o| o.value).collect();
    let live = program.ancestors(&roots);
    for id in order {
        if live[id.index()] {
            e.emit(id)?;
        }
    }
    // Outputs by their program names, through an Identity from the value.
    let mut outs = Vec::new();
    for o in &program.outputs {
        let t = program
            .node(o.value)
            .tensor()
            .cloned()
            .unwrap_or_else(|| petite_graph::TensorType::new(Dtype::F32, &[]));
        let src = e.names[o.value.index()].clone();
        if src != o.name {
            e.node("Identity", &[&src], &[&o.name], vec![]);
        }
        outs.push(value_info(&o.name, e.ty(t.dtype), &t.shape));
    }
    let mut graph_tail = Msg::new();
    graph_tail.str(2, opts.graph_name);
    let mut io_infos = Msg::new();
    for &id in &program.inputs {
        let t = program
            .node(id)
            .tensor()
            .cloned()
            .unwrap_or_else(|| petite_graph::TensorType::new(Dtype::F32, &[]));
        io_infos.msg(
            11,
            &value_info(&e.names[id.index()], e.ty(t.dtype), &t.shape),
        );
    }
    for o in &outs {
        io_infos.msg(12, o);
    }
    // GraphProto: nodes (1), name (2), initializers (5), inputs (11), outputs (12); streamed
    // field by field, so the model is never held twice (its length is known up front).
    let graph_len: usize = e
        .nodes
        .iter()
        .map(|n| pb::field_len(1, n.0.len()))
        .sum::<usize>()
        + graph_tail.0.len()
        + e.inits
            .iter()
            .map(|t| pb::field_len(5, t.0.len()))
            .sum::<usize>()
        + io_infos.0.len();
    let mut head = Msg::new();
    head.int(1, IR_VERSION)
        .str(2, "petite")
        .str(3, env!("CARGO_PKG_VERSION"));
    let mut tail = Msg::new();
    tail.msg(8, Msg::new().str(1, "").int(2, OPSET));
    let io = |e: std::io::Error| Error::Io {
        path: "(ONNX model)".into(),
        op: "write",
        source: e,
    };
    let mut n = 0u64;
    let mut put = |b: &[u8]| -> Result<()> {
        n += b.len() as u64;
        out.write_all(b).map_err(io)
    };
    put(&head.0)?;
    put(&pb::field_header(7, graph_len))?;
    for m in &e.nodes {
        put(&pb::field_header(1, m.0.len()))?;
        put(&m.0)?;
    }
    put(&graph_tail.0)?;
    for t in &e.inits {
        put(&pb::field_header(5, t.0.len()))?;
        put(&t.0)?;
    }
    put(&io_infos.0)?;
    put(&tail.0)?;
    Ok(n)
}

/// Writes `bytes` to `path` (petite-fs: temporary name, fsync, rename, fsync of the directory).
pub fn write_model(path: &Path, bytes: &[u8]) -> Result<()> {
    Ok(petite_fs::write(path, bytes)?)
}
