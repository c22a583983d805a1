//! Graph → kernel calls. Each petite-graph op becomes one or more ExecuTorch portable ATen
//! out-variant calls with their full schema argument lists; composite ops (RMS norm, rope,
//! attention, SiLU) become sequences of registered kernels. Nothing here touches weight bytes.

use std::collections::HashMap;

use petite_graph::{BinaryOp, CompareOp, Dtype, LogicalOp, NodeId, Op, Program, ReduceOp, UnaryOp};

use crate::{Error, Result};

/// Where a kernel-level tensor's data lives.
#[derive(Debug, Clone, PartialEq)]
pub enum Storage {
    /// Graph input number `i` (planned memory; the runtime copies the caller's data in).
    Input(usize),
    /// A checkpoint weight in the constant segment; `transpose` stores a 2-D weight as its
    /// transpose (linear weights `[out, in]` become `[in, out]` so `mm` needs no runtime copy).
    Weight {
        /// The name a weight source serves it under: the checkpoint tensor's, or
        /// `tensor[start..end]` for a row-range weight ([`Op::Weight`]), which [`row_source`]
        /// serves as just those rows.
        name: String,
        /// Store `[r, c]` as `[c, r]`.
        transpose: bool,
    },
    /// Small inline bytes in the constant segment (graph constants, scalars made tensors).
    Constant(Vec<u8>),
    /// Produced by a kernel call: planned memory.
    Activation,
}

/// A tensor of the lowered method.
#[derive(Debug, Clone)]
pub struct Slot {
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Data placement.
    pub storage: Storage,
}

impl Slot {
    /// Bytes of the tensor.
    pub fn nbytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size() as u64
    }
    /// True for tensors in planned memory.
    pub fn is_planned(&self) -> bool {
        matches!(self.storage, Storage::Input(_) | Storage::Activation)
    }
}

/// One kernel-call argument (value kinds of the ExecuTorch schema).
#[derive(Debug, Clone, PartialEq)]
pub enum Arg {
    /// A tensor slot.
    T(usize),
    /// `int` / integral `Scalar`.
    Int(i64),
    /// `float` / floating `Scalar`.
    Double(f64),
    /// `bool`.
    Bool(bool),
    /// `str`.
    Str(&'static str),
    /// `None`.
    Null,
    /// `int[]` (emitted as Int values plus an IntList of their indices).
    Ints(Vec<i64>),
    /// `Tensor[]`.
    Tensors(Vec<usize>),
}

/// One kernel call: operator, schema arguments (out tensors included, in schema position) and
/// the returned out tensors (appended by the emitter: one index, or a TensorList for several).
#[derive(Debug, Clone)]
pub struct Call {
    /// e.g. `aten::mm`.
    pub name: &'static str,
    /// e.g. `out`.
    pub overload: &'static str,
    /// Every schema argument in order.
    pub args: Vec<Arg>,
    /// Out tensors (written by the call).
    pub outs: Vec<usize>,
    /// The graph node this call implements (for messages).
    pub node: NodeId,
}

/// A whole lowered method.
#[derive(Debug, Clone)]
pub struct Lowered {
    /// All tensors.
    pub slots: Vec<Slot>,
    /// Kernel calls in execution order.
    pub calls: Vec<Call>,
    /// Input slots in call order, with their graph names.
    pub inputs: Vec<(String, usize)>,
    /// Output slots in return order, with their graph names.
    pub outputs: Vec<(String, usize)>,
}

impl Lowered {
    /// Every distinct operator (`name.overload`) the method calls, sorted.
    pub fn operators(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .calls
            .iter()
            .map(|c| format!("{}.{}", c.name, c.overload))
            .collect();
        v.sort();
        v.dedup();
        v
    }
}

struct Lowerer<'p> {
    prog: &'p Program,
    slots: Vec<Slot>,
    calls: Vec<Call>,
    val: Vec<Option<usize>>,
    weights: HashMap<(String, bool), usize>,
    node: NodeId,
}

fn floats(d: Dtype) -> bool {
    d.is_float()
}

/// Rounds `x` to what `dtype` holds (f32 first, then bf16/f16 round-to-nearest-even), so a
/// Scalar argument means exactly what petite-graph's `BinaryScalar` says.
fn round_scalar(x: f64, dtype: Dtype) -> f64 {
    let f = x as f32;
    match dtype {
        Dtype::Bf16 => petite_dtype::round_through_bf16(f) as f64,
        Dtype::F16 => half::f16::from_f32(f).to_f32() as f64,
        _ => f as f64,
    }
}

impl<'p> Lowerer<'p> {
    fn err(&self, reason: impl Into<String>) -> Error {
        Error::Unsupported {
            node: self.prog.describe(self.node).to_string(),
            op: self.prog.node(self.node).op.name(),
            reason: reason.into(),
        }
    }

    fn slot(&mut self, dtype: Dtype, shape: &[usize], storage: Storage) -> usize {
        self.slots.push(Slot {
            dtype,
            shape: shape.to_vec(),
            storage,
        });
        self.slots.len() - 1
    }

    fn act(&mut self, dtype: Dtype, shape: &[usize]) -> usize {
        self.slot(dtype, shape, Storage::Activation)
    }

    fn ty(&self, s: usize) -> (Dtype, Vec<usize>) {
        (self.slots[s].dtype, self.slots[s].shape.clone())
    }

    fn input(&mut self, i: usize) -> usize {
        let v = self.prog.node(self.node).inputs[i];
        match self.val[v.index()] {
            Some(s) => s,
            // Weights are materialised on first use (untransposed here).
            None => self
                .weight_slot(v, false)
                .expect("inputs are lowered before their consumers"),
        }
    }

    fn call(
        &mut self,
        name: &'static str,
        overload: &'static str,
        args: Vec<Arg>,
        outs: Vec<usize>,
    ) {
        self.calls.push(Call {
            name,
            overload,
            args,
            outs,
            node: self.node,
        });
    }

    /// `op(self, ..., *, out)` with one out tensor, which is created with `dtype`/`shape`.
    fn simple(
        &mut self,
        name: &'static str,
        overload: &'static str,
        mut args: Vec<Arg>,
        dtype: Dtype,
        shape: &[usize],
    ) -> usize {
        let o = self.act(dtype, shape);
        args.push(Arg::T(o));
        self.call(name, overload, args, vec![o]);
        o
    }

    fn cast(&mut self, s: usize, to: Dtype) -> usize {
        let (d, shape) = self.ty(s);
        if d == to {
            return s;
        }
        // aten::_to_copy.out(Tensor self, *, bool non_blocking=False, MemoryFormat? memory_format=None, Tensor(a!) out)
        self.simple(
            "aten::_to_copy",
            "out",
            vec![Arg::T(s), Arg::Bool(false), Arg::Null],
            to,
            &shape,
        )
    }

    fn view(&mut self, s: usize, shape: &[usize]) -> usize {
        let (d, old) = self.ty(s);
        if old == shape {
            return s;
        }
        // aten::view_copy.out(Tensor self, SymInt[] size, *, Tensor(a!) out)
        self.simple(
            "aten::view_copy",
            "out",
            vec![Arg::T(s), ints(shape)],
            d,
            shape,
        )
    }

    fn permute(&mut self, s: usize, perm: &[usize]) -> usize {
        let (d, old) = self.ty(s);
        let shape: Vec<usize> = perm.iter().map(|&p| old[p]).collect();
        // aten::permute_copy.out(Tensor self, int[] dims, *, Tensor(a!) out)
        self.simple(
            "aten::permute_copy",
            "out",
            vec![Arg::T(s), ints(perm)],
            d,
            &shape,
        )
    }

    fn expand(&mut self, s: usize, shape: &[usize]) -> usize {
        let (d, old) = self.ty(s);
        if old == shape {
            return s;
        }
        // aten::expand_copy.out(Tensor self, SymInt[] size, *, bool implicit=False, Tensor(a!) out)
        self.simple(
            "aten::expand_copy",
            "out",
            vec![Arg::T(s), ints(shape), Arg::Bool(false)],
            d,
            shape,
        )
    }

    fn slice(&mut self, s: usize, axis: usize, start: usize, end: usize, step: usize) -> usize {
        let (d, mut shape) = self.ty(s);
        shape[axis] = (end - start).div_ceil(step);
        // aten::slice_copy.Tensor_out(Tensor self, int dim=0, SymInt? start=None, SymInt? end=None, SymInt step=1, *, Tensor(a!) out)
        self.simple(
            "aten::slice_copy",
            "Tensor_out",
            vec![
                Arg::T(s),
                Arg::Int(axis as i64),
                Arg::Int(start as i64),
                Arg::Int(end as i64),
                Arg::Int(step as i64),
            ],
            d,
            &shape,
        )
    }

    fn cat(&mut self, parts: &[usize], axis: usize) -> usize {
        let (d, mut shape) = self.ty(parts[0]);
        shape[axis] = parts.iter().map(|&p| self.slots[p].shape[axis]).sum();
        // aten::cat.out(Tensor[] tensors, int dim=0, *, Tensor(a!) out)
        self.simple(
            "aten::cat",
            "out",
            vec![Arg::Tensors(parts.to_vec()), Arg::Int(axis as i64)],
            d,
            &shape,
        )
    }

    fn bin(&mut self, kind: BinaryOp, a: usize, b: usize) -> usize {
        let d = self.slots[a].dtype;
        let shape = petite_graph::op::broadcast_shapes(&self.slots[a].shape, &self.slots[b].shape)
            .expect("validated program");
        let (name, mut args) = match kind {
            // aten::add.out(Tensor self, Tensor other, *, Scalar alpha=1, Tensor(a!) out)
            BinaryOp::Add => ("aten::add", vec![Arg::T(a), Arg::T(b), Arg::Int(1)]),
            BinaryOp::Sub => ("aten::sub", vec![Arg::T(a), Arg::T(b), Arg::Int(1)]),
            // aten::mul.out(Tensor self, Tensor other, *, Tensor(a!) out)
            BinaryOp::Mul => ("aten::mul", vec![Arg::T(a), Arg::T(b)]),
            BinaryOp::Div => ("aten::div", vec![Arg::T(a), Arg::T(b)]),
        };
        let o = self.act(d, &shape);
        args.push(Arg::T(o));
        self.call(name, "out", args, vec![o]);
        o
    }

    fn scalar_arg(d: Dtype, x: f64) -> Arg {
        if floats(d) {
            Arg::Double(round_scalar(x, d))
        } else {
            Arg::Int(x as i64)
        }
    }

    fn bin_scalar(&mut self, kind: BinaryOp, x: usize, s: f64) -> usize {
        let (d, shape) = self.ty(x);
        let sc = Self::scalar_arg(d, s);
        let (name, overload, args) = match kind {
            // aten::add.Scalar_out(Tensor self, Scalar other, Scalar alpha=1, *, Tensor(a!) out)
            BinaryOp::Add => ("aten::add", "Scalar_out", vec![Arg::T(x), sc, Arg::Int(1)]),
            BinaryOp::Sub => ("aten::sub", "Scalar_out", vec![Arg::T(x), sc, Arg::Int(1)]),
            // aten::mul.Scalar_out(Tensor self, Scalar other, *, Tensor(a!) out)
            BinaryOp::Mul => ("aten::mul", "Scalar_out", vec![Arg::T(x), sc]),
            BinaryOp::Div => ("aten::div", "Scalar_out", vec![Arg::T(x), sc]),
        };
        self.simple(name, overload, args, d, &shape)
    }

    fn unary(&mut self, name: &'static str, x: usize) -> usize {
        let (d, shape) = self.ty(x);
        self.simple(name, "out", vec![Arg::T(x)], d, &shape)
    }

    fn scalar_tensor(&mut self, d: Dtype, x: f64) -> usize {
        let x = round_scalar(x, d);
        let bytes = match d {
            Dtype::F32 => (x as f32).to_le_bytes().to_vec(),
            Dtype::Bf16 => half::bf16::from_f64(x).to_bits().to_le_bytes().to_vec(),
            Dtype::F16 => half::f16::from_f64(x).to_bits().to_le_bytes().to_vec(),
            Dtype::I64 => (x as i64).to_le_bytes().to_vec(),
            Dtype::I32 => (x as i32).to_le_bytes().to_vec(),
            Dtype::U8 => vec![x as u8],
            Dtype::Bool => vec![(x != 0.0) as u8],
            Dtype::I8 => vec![x as i8 as u8],
            Dtype::F8E4M3 => vec![petite_dtype::quant::f8e4m3_bits(x as f32)],
        };
        self.slot(d, &[], Storage::Constant(bytes))
    }

    fn mm(&mut self, a: usize, b: usize) -> usize {
        let (d, sa) = self.ty(a);
        let sb = self.slots[b].shape.clone();
        // aten::mm.out(Tensor self, Tensor mat2, *, Tensor(a!) out)
        self.simple(
            "aten::mm",
            "out",
            vec![Arg::T(a), Arg::T(b)],
            d,
            &[sa[0], sb[1]],
        )
    }

    fn bmm(&mut self, a: usize, b: usize) -> usize {
        let (d, sa) = self.ty(a);
        let sb = self.slots[b].shape.clone();
        // aten::bmm.out(Tensor self, Tensor mat2, *, Tensor(a!) out)
        self.simple(
            "aten::bmm",
            "out",
            vec![Arg::T(a), Arg::T(b)],
            d,
            &[sa[0], sa[1], sb[2]],
        )
    }

    /// Casts `x` to f32 when it is a narrower float: the ops documented "computed in f32".
    fn upcast(&mut self, x: usize) -> usize {
        self.cast(x, Dtype::F32)
    }

    fn weight_slot(&mut self, v: NodeId, transpose: bool) -> Option<usize> {
        let n = self.prog.node(v);
        let Op::Weight { name, rows } = &n.op else {
            return None;
        };
        let t = n.tensor()?;
        let name = &petite_graph::weight_display(name, *rows);
        let key = (name.clone(), transpose);
        if let Some(&s) = self.weights.get(&key) {
            return Some(s);
        }
        let mut shape = t.shape.clone();
        if transpose {
            shape.reverse();
        }
        let s = self.slot(
            t.dtype,
            &shape,
            Storage::Weight {
                name: name.clone(),
                transpose,
            },
        );
        self.weights.insert(key, s);
        Some(s)
    }

    fn check_float_dtype(&self, d: Dtype) -> Result<()> {
        if floats(d) {
            Ok(())
        } else {
            Err(self.err(format!("dtype {d} is not a float dtype")))
        }
    }

    fn lower_node(&mut self, id: NodeId) -> Result<Option<usize>> {
        self.node = id;
        let node = self.prog.node(id);
        let out_ty = node.tensor().cloned();
        let ins: Vec<NodeId> = node.inputs.clone();
        let o = match &node.op {
            Op::Input { .. } => {
                let pos = self
                    .prog
                    .inputs
                    .iter()
                    .position(|&i| i == id)
                    .ok_or_else(|| self.err("input node is not listed in the program inputs"))?;
                let t = out_ty.expect("inputs are tensors");
                self.slot(t.dtype, &t.shape, Storage::Input(pos))
            }
            Op::Weight { .. } => {
                // Materialised on first use (a linear consumer wants it transposed).
                return Ok(None);
            }
            Op::Constant { data } => {
                let t = out_ty.expect("constants are tensors");
                self.slot(t.dtype, &t.shape, Storage::Constant(data.clone()))
            }
            Op::Linear => {
                let x = self.input(0);
                let (d, xs) = self.ty(x);
                self.check_float_dtype(d)?;
                let inn = *xs.last().expect("rank >= 1");
                let rows: usize = xs[..xs.len() - 1].iter().product();
                let wt = match self.weight_slot(ins[1], true) {
                    Some(w) => w,
                    None => {
                        let w = self.input(1);
                        self.permute(w, &[1, 0])
                    }
                };
                let outf = self.slots[wt].shape[1];
                let x2 = self.view(x, &[rows, inn]);
                let y = if ins.len() == 3 {
                    let b = self.input(2);
                    // aten::addmm.out(Tensor self, Tensor mat1, Tensor mat2, *, Scalar beta=1, Scalar alpha=1, Tensor(a!) out)
                    self.simple(
                        "aten::addmm",
                        "out",
                        vec![Arg::T(b), Arg::T(x2), Arg::T(wt), Arg::Int(1), Arg::Int(1)],
                        d,
                        &[rows, outf],
                    )
                } else {
                    self.mm(x2, wt)
                };
                let mut os = xs.clone();
                *os.last_mut().expect("rank >= 1") = outf;
                self.view(y, &os)
            }
            Op::MatMul => {
                let (a, b) = (self.input(0), self.input(1));
                let (d, sa) = self.ty(a);
                self.check_float_dtype(d)?;
                let sb = self.slots[b].shape.clone();
                let t = out_ty.expect("tensor");
                let r = t.shape.len();
                let batch = &t.shape[..r - 2];
                let nb: usize = batch.iter().product();
                let (m, k, n) = (sa[sa.len() - 2], sa[sa.len() - 1], sb[sb.len() - 1]);
                if r == 2 {
                    self.mm(a, b)
                } else {
                    let mut ea = batch.to_vec();
                    ea.extend([m, k]);
                    let mut eb = batch.to_vec();
                    eb.extend([k, n]);
                    let a = self.expand(a, &ea);
                    let b = self.expand(b, &eb);
                    let a3 = self.view(a, &[nb, m, k]);
                    let b3 = self.view(b, &[nb, k, n]);
                    let y = self.bmm(a3, b3);
                    self.view(y, &t.shape)
                }
            }
            Op::Conv2d { stride, padding } => {
                let x = self.input(0);
                let d = self.slots[x].dtype;
                if d != Dtype::F32 {
                    return Err(self.err(format!(
                        "dtype {d}: petite lowers conv2d for f32 only (cast around it)"
                    )));
                }
                let w = self
                    .weight_slot(ins[1], false)
                    .unwrap_or_else(|| self.input(1));
                let b = if ins.len() == 3 {
                    Arg::T(self.input(2))
                } else {
                    Arg::Null
                };
                let t = out_ty.expect("tensor");
                // aten::convolution.out(Tensor input, Tensor weight, Tensor? bias, SymInt[] stride, SymInt[] padding, SymInt[] dilation, bool transposed, SymInt[] output_padding, SymInt groups, *, Tensor(a!) out)
                self.simple(
                    "aten::convolution",
                    "out",
                    vec![
                        Arg::T(x),
                        Arg::T(w),
                        b,
                        ints(stride),
                        ints(padding),
                        ints(&[1, 1]),
                        Arg::Bool(false),
                        ints(&[0, 0]),
                        Arg::Int(1),
                    ],
                    d,
                    &t.shape,
                )
            }
            Op::LayerNorm { eps } => {
                let x0 = self.input(0);
                let d = self.slots[x0].dtype;
                let x = self.upcast(x0);
                let w = self.input(1);
                let w = self.upcast(w);
                let b = self.input(2);
                let b = self.upcast(b);
                let shape = self.slots[x].shape.clone();
                let dim = *shape.last().expect("rank >= 1");
                let mut stat = shape.clone();
                *stat.last_mut().expect("rank >= 1") = 1;
                let o0 = self.act(Dtype::F32, &shape);
                let o1 = self.act(Dtype::F32, &stat);
                let o2 = self.act(Dtype::F32, &stat);
                // aten::native_layer_norm.out(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps, *, Tensor(a!) out0, Tensor(b!) out1, Tensor(c!) out2)
                self.call(
                    "aten::native_layer_norm",
                    "out",
                    vec![
                        Arg::T(x),
                        ints(&[dim]),
                        Arg::T(w),
                        Arg::T(b),
                        Arg::Double(*eps),
                        Arg::T(o0),
                        Arg::T(o1),
                        Arg::T(o2),
                    ],
                    vec![o0, o1, o2],
                );
                self.cast(o0, d)
            }
            Op::RmsNorm { eps } => {
                let x0 = self.input(0);
                let d = self.slots[x0].dtype;
                let x = self.upcast(x0);
                let shape = self.slots[x].shape.clone();
                let last = shape.len() - 1;
                let sq = self.bin(BinaryOp::Mul, x, x);
                let mut stat = shape.clone();
                stat[last] = 1;
                // aten::mean.out(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None, Tensor(a!) out)
                let ms = self.simple(
                    "aten::mean",
                    "out",
                    vec![Arg::T(sq), ints(&[last]), Arg::Bool(true), Arg::Null],
                    Dtype::F32,
                    &stat,
                );
                let ms = self.bin_scalar(BinaryOp::Add, ms, *eps);
                let r = self.unary("aten::rsqrt", ms);
                let mut y = self.bin(BinaryOp::Mul, x, r);
                if ins.len() == 2 {
                    let w = self.input(1);
                    let w = self.upcast(w);
                    let w1 = self.bin_scalar(BinaryOp::Add, w, 1.0);
                    y = self.bin(BinaryOp::Mul, y, w1);
                }
                self.cast(y, d)
            }
            Op::Binary { kind } => {
                let (a, b) = (self.input(0), self.input(1));
                self.bin(*kind, a, b)
            }
            Op::BinaryScalar {
                kind,
                scalar,
                scalar_lhs,
            } => {
                let x = self.input(0);
                let (d, shape) = self.ty(x);
                match (kind, scalar_lhs) {
                    (BinaryOp::Add | BinaryOp::Mul, _) | (_, false) => {
                        self.bin_scalar(*kind, x, *scalar)
                    }
                    (BinaryOp::Sub, true) => {
                        // aten::rsub.Scalar_out(Tensor self, Scalar other, Scalar alpha=1, *, Tensor(a!) out) = other - self
                        self.simple(
                            "aten::rsub",
                            "Scalar_out",
                            vec![Arg::T(x), Self::scalar_arg(d, *scalar), Arg::Int(1)],
                            d,
                            &shape,
                        )
                    }
                    (BinaryOp::Div, true) => {
                        let s = self.scalar_tensor(d, *scalar);
                        self.bin(BinaryOp::Div, s, x)
                    }
                }
            }
            Op::Compare { kind } => {
                let (a, b) = (self.input(0), self.input(1));
                let name = match kind {
                    CompareOp::Lt => "aten::lt",
                    CompareOp::Le => "aten::le",
                    CompareOp::Eq => "aten::eq",
                    CompareOp::Ne => "aten::ne",
                    CompareOp::Gt => "aten::gt",
                    CompareOp::Ge => "aten::ge",
                };
                let t = out_ty.expect("tensor");
                // aten::lt.Tensor_out(Tensor self, Tensor other, *, Tensor(a!) out)
                self.simple(
                    name,
                    "Tensor_out",
                    vec![Arg::T(a), Arg::T(b)],
                    Dtype::Bool,
                    &t.shape,
                )
            }
            Op::Logical { kind } => {
                let (a, b) = (self.input(0), self.input(1));
                let name = match kind {
                    LogicalOp::And => "aten::logical_and",
                    LogicalOp::Or => "aten::logical_or",
                };
                let t = out_ty.expect("tensor");
                self.simple(
                    name,
                    "out",
                    vec![Arg::T(a), Arg::T(b)],
                    Dtype::Bool,
                    &t.shape,
                )
            }
            Op::Not => {
                let x = self.input(0);
                self.unary("aten::logical_not", x)
            }
            Op::Unary { kind } => {
                let x = self.input(0);
                match kind {
                    UnaryOp::Neg => self.unary("aten::neg", x),
                    UnaryOp::Exp => self.unary("aten::exp", x),
                    UnaryOp::Sqrt => self.unary("aten::sqrt", x),
                    UnaryOp::Rsqrt => self.unary("aten::rsqrt", x),
                    UnaryOp::Sin => self.unary("aten::sin", x),
                    UnaryOp::Cos => self.unary("aten::cos", x),
                    UnaryOp::Tanh => self.unary("aten::tanh", x),
                    UnaryOp::GeluTanh => {
                        let (d, shape) = self.ty(x);
                        // aten::gelu.out(Tensor self, *, str approximate='none', Tensor(a!) out)
                        self.simple(
                            "aten::gelu",
                            "out",
                            vec![Arg::T(x), Arg::Str("tanh")],
                            d,
                            &shape,
                        )
                    }
                    UnaryOp::Silu => {
                        // No silu kernel is registered: x · sigmoid(x).
                        let s = self.unary("aten::sigmoid", x);
                        self.bin(BinaryOp::Mul, x, s)
                    }
                }
            }
            Op::Softmax { axis } => {
                let x0 = self.input(0);
                let d = self.slots[x0].dtype;
                let x = self.upcast(x0);
                let shape = self.slots[x].shape.clone();
                // aten::_softmax.out(Tensor self, int dim, bool half_to_float, *, Tensor(a!) out)
                let y = self.simple(
                    "aten::_softmax",
                    "out",
                    vec![Arg::T(x), Arg::Int(*axis as i64), Arg::Bool(false)],
                    Dtype::F32,
                    &shape,
                );
                self.cast(y, d)
            }
            Op::Rope => {
                let x0 = self.input(0);
                let d = self.slots[x0].dtype;
                let x = self.upcast(x0);
                let c = self.input(1);
                let c = self.upcast(c);
                let s = self.input(2);
                let s = self.upcast(s);
                let shape = self.slots[x].shape.clone();
                let last = shape.len() - 1;
                let dd = shape[last];
                let x1 = self.slice(x, last, 0, dd / 2, 1);
                let x2 = self.slice(x, last, dd / 2, dd, 1);
                let nx2 = self.unary("aten::neg", x2);
                let rh = self.cat(&[nx2, x1], last);
                let a = self.bin(BinaryOp::Mul, x, c);
                let b = self.bin(BinaryOp::Mul, rh, s);
                let y = self.bin(BinaryOp::Add, a, b);
                self.cast(y, d)
            }
            Op::Attention { scale } => {
                let q0 = self.input(0);
                let d = self.slots[q0].dtype;
                let q = self.upcast(q0);
                let k = self.input(1);
                let k = self.upcast(k);
                let v = self.input(2);
                let v = self.upcast(v);
                let (qs, ks, vs) = (
                    self.slots[q].shape.clone(),
                    self.slots[k].shape.clone(),
                    self.slots[v].shape.clone(),
                );
                let (b, h, nq, dh) = (qs[0], qs[1], qs[2], qs[3]);
                let (kvh, nk, dv) = (ks[1], ks[2], vs[3]);
                let g = h / kvh;
                // Query head h reads KV head h / g: with heads grouped consecutively, q viewed
                // as [B·KVH, g·Q, D] multiplies each KV head's keys without repeating them.
                let q3 = self.view(q, &[b * kvh, g * nq, dh]);
                let kt = self.permute(k, &[0, 1, 3, 2]);
                let kt3 = self.view(kt, &[b * kvh, dh, nk]);
                let sc = self.bmm(q3, kt3);
                let sc = self.bin_scalar(BinaryOp::Mul, sc, *scale);
                let mut sc4 = self.view(sc, &[b, h, nq, nk]);
                if ins.len() == 4 {
                    let m = self.input(3);
                    let m = self.upcast(m);
                    sc4 = self.bin(BinaryOp::Add, sc4, m);
                }
                let p = self.simple(
                    "aten::_softmax",
                    "out",
                    vec![Arg::T(sc4), Arg::Int(3), Arg::Bool(false)],
                    Dtype::F32,
                    &[b, h, nq, nk],
                );
                let p3 = self.view(p, &[b * kvh, g * nq, nk]);
                let v3 = self.view(v, &[b * kvh, nk, dv]);
                let y = self.bmm(p3, v3);
                let y = self.view(y, &[b, h, nq, dv]);
                self.cast(y, d)
            }
            Op::Embedding => {
                let table = self
                    .weight_slot(ins[0], false)
                    .unwrap_or_else(|| self.input(0));
                let idx = self.input(1);
                let t = out_ty.expect("tensor");
                // aten::embedding.out(Tensor weight, Tensor indices, SymInt padding_idx=-1, bool scale_grad_by_freq=False, bool sparse=False, *, Tensor(a!) out)
                self.simple(
                    "aten::embedding",
                    "out",
                    vec![
                        Arg::T(table),
                        Arg::T(idx),
                        Arg::Int(-1),
                        Arg::Bool(false),
                        Arg::Bool(false),
                    ],
                    t.dtype,
                    &t.shape,
                )
            }
            Op::Concat { axis } => {
                let parts: Vec<usize> = (0..ins.len()).map(|i| self.input(i)).collect();
                self.cat(&parts, *axis)
            }
            Op::Slice {
                axis,
                start,
                end,
                step,
            } => {
                let x = self.input(0);
                self.slice(x, *axis, *start, *end, *step)
            }
            Op::Reshape { shape } => {
                let x = self.input(0);
                let t = self.view(x, shape);
                if t == x {
                    // Same shape: still a distinct value (a copy keeps lifetimes simple).
                    self.clone_slot(x)
                } else {
                    t
                }
            }
            Op::Permute { perm } => {
                let x = self.input(0);
                self.permute(x, perm)
            }
            Op::Expand { shape } => {
                let x = self.input(0);
                let t = self.expand(x, shape);
                if t == x { self.clone_slot(x) } else { t }
            }
            Op::Dequantize { .. } => {
                return Err(self.err(
                    "quantized weights have no portable kernel here (ExecuTorch's \
                     dequantize_per_channel is not linked): export with `--weights bf16`",
                ));
            }
            Op::Cast { to } => {
                let x = self.input(0);
                let t = self.cast(x, *to);
                if t == x { self.clone_slot(x) } else { t }
            }
            Op::CumSum { axis } => {
                let x = self.input(0);
                let (d, shape) = self.ty(x);
                // aten::cumsum.out(Tensor self, int dim, *, ScalarType? dtype=None, Tensor(a!) out)
                self.simple(
                    "aten::cumsum",
                    "out",
                    vec![Arg::T(x), Arg::Int(*axis as i64), Arg::Null],
                    d,
                    &shape,
                )
            }
            Op::Where => {
                let (c, a, b) = (self.input(0), self.input(1), self.input(2));
                let t = out_ty.expect("tensor");
                // aten::where.self_out(Tensor condition, Tensor self, Tensor other, *, Tensor(a!) out)
                self.simple(
                    "aten::where",
                    "self_out",
                    vec![Arg::T(c), Arg::T(a), Arg::T(b)],
                    t.dtype,
                    &t.shape,
                )
            }
            Op::Reduce {
                kind,
                axes,
                keepdim,
            } => {
                let x0 = self.input(0);
                let d = self.slots[x0].dtype;
                let t = out_ty.expect("tensor");
                let x = if *kind == ReduceOp::Max || !floats(d) {
                    x0
                } else {
                    self.upcast(x0)
                };
                let cd = self.slots[x].dtype;
                let y = match kind {
                    // aten::sum.IntList_out(Tensor self, int[1]? dim, bool keepdim=False, *, ScalarType? dtype=None, Tensor(a!) out)
                    ReduceOp::Sum => self.simple(
                        "aten::sum",
                        "IntList_out",
                        vec![Arg::T(x), ints(axes), Arg::Bool(*keepdim), Arg::Null],
                        cd,
                        &t.shape,
                    ),
                    ReduceOp::Mean => self.simple(
                        "aten::mean",
                        "out",
                        vec![Arg::T(x), ints(axes), Arg::Bool(*keepdim), Arg::Null],
                        cd,
                        &t.shape,
                    ),
                    // aten::amax.out(Tensor self, int[1] dim=[], bool keepdim=False, *, Tensor(a!) out)
                    ReduceOp::Max => self.simple(
                        "aten::amax",
                        "out",
                        vec![Arg::T(x), ints(axes), Arg::Bool(*keepdim)],
                        cd,
                        &t.shape,
                    ),
                };
                self.cast(y, d)
            }
            Op::Split { .. } => {
                // Pieces are sliced by their getitem nodes (no tuple values at kernel level).
                return Ok(None);
            }
            Op::GetItem { index } => {
                let split = ins[0];
                let (axis, sizes) = match &self.prog.node(split).op {
                    Op::Split { axis, sizes } => (*axis, sizes.clone()),
                    other => {
                        return Err(self.err(format!(
                            "getitem of a {} (only split produces tuples)",
                            other.name()
                        )));
                    }
                };
                let src_id = self.prog.node(split).inputs[0];
                let src = match self.val[src_id.index()] {
                    Some(s) => s,
                    None => self.weight_slot(src_id, false).expect("lowered before"),
                };
                let start: usize = sizes[..*index].iter().sum();
                self.slice(src, axis, start, start + sizes[*index], 1)
            }
        };
        Ok(Some(o))
    }

    fn clone_slot(&mut self, x: usize) -> usize {
        let (d, shape) = self.ty(x);
        // aten::clone.out(Tensor self, *, MemoryFormat? memory_format=None, Tensor(a!) out)
        self.simple("aten::clone", "out", vec![Arg::T(x), Arg::Null], d, &shape)
    }
}

fn ints<T: Copy + TryInto<i64>>(xs: &[T]) -> Arg {
    Arg::Ints(
        xs.iter()
            .map(|&x| x.try_into().ok().expect("dims fit in i64"))
            .collect(),
    )
}

/// Rank limit of the runtime's tensor parser.
const MAX_RANK: usize = 16;

/// `weights` as the lowered `programs` read them: every row-range weight is served under the
/// name its constant slot carries (`tensor[start..end]`) as a sub-view of just those rows
/// (releases and unmaps of it touch only those rows); everything else passes through. Wrap the
/// source with this before [`crate::check_weights`], [`crate::write_mapping`] or
/// [`crate::write_program`] when a program has row ranges.
pub fn row_source<'a>(
    programs: &[&Program],
    weights: &'a dyn petite_weights::WeightSource,
) -> Result<petite_weights::RowSlices<'a, dyn petite_weights::WeightSource + 'a>> {
    let mut sliced = petite_weights::RowSlices::new(weights);
    for p in programs {
        for w in p.weights() {
            if let Some(rows) = w.rows {
                sliced.add(&w.display_name(), &w.name, rows)?;
            }
        }
    }
    Ok(sliced)
}

/// Lowers a validated program to kernel calls. Errors name the node and op that has no portable
/// equivalent (or a dtype/rank the lowering refuses); nothing is written.
pub fn lower(prog: &Program) -> Result<Lowered> {
    prog.validate().map_err(Error::Graph)?;
    let order = prog.topo_order().map_err(Error::Graph)?;
    let live = prog.ancestors(&prog.outputs.iter().map(|o| o.value).collect::<Vec<_>>());
    let mut l = Lowerer {
        prog,
        slots: Vec::new(),
        calls: Vec::new(),
        val: vec![None; prog.len()],
        weights: HashMap::new(),
        node: NodeId(0),
    };
    for &id in &order {
        let node = prog.node(id);
        // Dead nodes are skipped (graph inputs are kept so the method's signature is whole).
        if !live[id.index()] && !matches!(node.op, Op::Input { .. }) {
            continue;
        }
        if let Some(t) = node.tensor()
            && t.shape.len() > MAX_RANK
        {
            l.node = id;
            return Err(l.err(format!(
                "rank {} exceeds the runtime's limit of {MAX_RANK}",
                t.shape.len()
            )));
        }
        let s = l.lower_node(id)?;
        l.val[id.index()] = s;
    }
    let inputs = prog
        .inputs
        .iter()
        .map(|&i| {
            (
                prog.input_name(i).unwrap_or("?").to_string(),
                l.val[i.index()].expect("inputs lowered"),
            )
        })
        .collect();
    let mut outputs = Vec::new();
    let mut used = std::collections::HashSet::new();
    for o in &prog.outputs {
        l.node = o.value;
        let s = match l.val[o.value.index()] {
            Some(s) => s,
            // A weight returned directly.
            None => l
                .weight_slot(o.value, false)
                .ok_or_else(|| l.err("output has no tensor value"))?,
        };
        // Outputs must be planned and distinct: copy inputs, constants and repeats.
        let s = if l.slots[s].storage != Storage::Activation || !used.insert(s) {
            let c = l.clone_slot(s);
            used.insert(c);
            c
        } else {
            s
        };
        outputs.push((o.name.clone(), s));
    }
    Ok(Lowered {
        slots: l.slots,
        calls: l.calls,
        inputs,
        outputs,
    })
}
