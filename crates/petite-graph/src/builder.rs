//! The builder: programs written as straight-line code, with types inferred and checked as
//! each node is added, so a mistake fails at the line that made it.

use crate::dtype::{Dtype, TensorType, ValueType};
use crate::error::{Error, Result};
use crate::node::{NodeDesc, NodeId, ValueId};
use crate::op::{BinaryOp, CompareOp, LogicalOp, Op, ReduceOp, UnaryOp};
use crate::program::{GraphOutput, Node, Program};
use std::collections::BTreeMap;

/// Builds a [`Program`].
///
/// Every method that adds a node infers its type and returns its [`ValueId`], or an
/// [`Error::InvalidNode`] naming the op, the would-be node id and the current label (the scope
/// path, see [`Builder::push_scope`]) with expected vs found. Axes are `isize`: negative counts
/// from the end (`-1` = last), as in PyTorch.
///
/// ```
/// use petite_graph::{Builder, Dtype};
/// let mut b = Builder::new();
/// let x = b.input("x", Dtype::F32, &[1, 4, 8])?;
/// b.push_scope("proj");
/// let w = b.weight("proj.weight", Dtype::F32, &[16, 8])?;
/// let y = b.linear(x, w, None)?;
/// b.pop_scope();
/// b.output("y", y)?;
/// let p = b.finish()?;
/// assert_eq!(p.node(y).tensor().unwrap().shape, vec![1, 4, 16]);
/// # Ok::<(), petite_graph::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct Builder {
    prog: Program,
    weights: BTreeMap<String, NodeId>,
    weight_rows: BTreeMap<(String, [usize; 2]), NodeId>,
    inputs: BTreeMap<String, NodeId>,
    outputs: BTreeMap<String, NodeId>,
    scope: Vec<String>,
}

impl Builder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    // ----- labels -------------------------------------------------------------------------

    /// Enters a label scope: nodes added until the matching [`Builder::pop_scope`] are labelled
    /// with the dot-joined scope path (e.g. `language.layers.3.attn`).
    pub fn push_scope(&mut self, name: impl Into<String>) {
        self.scope.push(name.into());
    }

    /// Leaves the innermost scope (no-op at the top level).
    pub fn pop_scope(&mut self) {
        self.scope.pop();
    }

    /// Runs `f` inside scope `name`; the scope is left even when `f` fails.
    pub fn scoped<R>(&mut self, name: impl Into<String>, f: impl FnOnce(&mut Self) -> R) -> R {
        self.push_scope(name);
        let r = f(self);
        self.pop_scope();
        r
    }

    /// The current scope path (`""` at the top level).
    pub fn scope_path(&self) -> String {
        self.scope.join(".")
    }

    /// Labels `v`'s node `<scope>.<name>` (or `name` at the top level), e.g. `q_proj`.
    pub fn label(&mut self, v: ValueId, name: &str) -> Result<ValueId> {
        let full = if self.scope.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.scope_path())
        };
        self.set_label(v, full)
    }

    /// Sets `v`'s node label verbatim.
    pub fn set_label(&mut self, v: ValueId, label: impl Into<String>) -> Result<ValueId> {
        self.check_id("label", v)?;
        self.prog.nodes[v.index()].label = Some(label.into());
        Ok(v)
    }

    /// Marks `v` as recomputed per engine ([`crate::Node::recompute`]): for masks and rotary
    /// tables, which should never cross an engine boundary however small they are.
    pub fn mark_recompute(&mut self, v: ValueId) -> Result<ValueId> {
        self.check_id("mark_recompute", v)?;
        self.prog.nodes[v.index()].recompute = true;
        Ok(v)
    }

    // ----- inspection ---------------------------------------------------------------------

    /// The program built so far.
    pub fn program(&self) -> &Program {
        &self.prog
    }

    /// The type of a value.
    pub fn ty(&self, v: ValueId) -> Result<&ValueType> {
        self.check_id("type query", v)?;
        Ok(&self.prog.nodes[v.index()].ty)
    }

    /// The tensor type of a value (error for a tuple).
    pub fn tensor(&self, v: ValueId) -> Result<&TensorType> {
        match self.ty(v)? {
            ValueType::Tensor(t) => Ok(t),
            ValueType::Tuple(_) => Err(Error::TupleWithoutGetItem {
                node: self.pending("type query"),
                index: 0,
                producer: self.prog.describe(v),
            }),
        }
    }

    /// The shape of a tensor value.
    pub fn shape(&self, v: ValueId) -> Result<&[usize]> {
        Ok(&self.tensor(v)?.shape)
    }

    /// The dtype of a tensor value.
    pub fn dtype(&self, v: ValueId) -> Result<Dtype> {
        Ok(self.tensor(v)?.dtype)
    }

    fn pending(&self, op: &'static str) -> NodeDesc {
        NodeDesc {
            id: NodeId(self.prog.nodes.len() as u32),
            op,
            label: (!self.scope.is_empty()).then(|| self.scope_path()),
        }
    }

    fn err(&self, op: &'static str, reason: impl Into<String>) -> Error {
        Error::InvalidNode {
            node: self.pending(op),
            reason: reason.into(),
        }
    }

    fn check_id(&self, op: &'static str, v: ValueId) -> Result<()> {
        if v.index() < self.prog.nodes.len() {
            Ok(())
        } else {
            Err(Error::DanglingValue {
                node: self.pending(op),
                index: 0,
                value: v,
                len: self.prog.nodes.len(),
            })
        }
    }

    fn rank(&self, op: &'static str, v: ValueId) -> Result<usize> {
        self.check_id(op, v)?;
        match &self.prog.nodes[v.index()].ty {
            ValueType::Tensor(t) => Ok(t.rank()),
            ValueType::Tuple(_) => Err(Error::TupleWithoutGetItem {
                node: self.pending(op),
                index: 0,
                producer: self.prog.describe(v),
            }),
        }
    }

    /// Normalises a PyTorch-style axis for a tensor of `rank` dims.
    fn axis(&self, op: &'static str, axis: isize, rank: usize) -> Result<usize> {
        let r = rank as isize;
        let a = if axis < 0 { axis + r } else { axis };
        if (0..r).contains(&a) {
            Ok(a as usize)
        } else {
            Err(self.err(op, format!("axis {axis} out of range for rank {rank}")))
        }
    }

    // ----- generic ------------------------------------------------------------------------

    /// Adds any non-source op with the given inputs, inferring and checking its type. Every
    /// typed helper below goes through here.
    pub fn node(&mut self, op: Op, inputs: &[ValueId]) -> Result<ValueId> {
        let name = op.name();
        if op.is_source() {
            return Err(self.err(
                name,
                "sources are added with input/weight/constant, which declare their type",
            ));
        }
        let mut tys = Vec::with_capacity(inputs.len());
        for (index, &v) in inputs.iter().enumerate() {
            let Some(p) = self.prog.get(v) else {
                return Err(Error::DanglingValue {
                    node: self.pending(name),
                    index,
                    value: v,
                    len: self.prog.nodes.len(),
                });
            };
            if p.ty.is_tuple() && !matches!(op, Op::GetItem { .. }) {
                return Err(Error::TupleWithoutGetItem {
                    node: self.pending(name),
                    index,
                    producer: self.prog.describe(v),
                });
            }
            tys.push(&p.ty);
        }
        let ty = match op.infer(&tys) {
            Ok(Some(t)) => t,
            Ok(None) => unreachable!("non-source ops always infer a type"),
            Err(reason) => return Err(self.err(name, reason)),
        };
        Ok(self.push(op, inputs.to_vec(), ty))
    }

    fn push(&mut self, op: Op, inputs: Vec<ValueId>, ty: ValueType) -> ValueId {
        let id = NodeId(self.prog.nodes.len() as u32);
        let label = (!self.scope.is_empty()).then(|| self.scope_path());
        self.prog.nodes.push(Node {
            op,
            inputs,
            ty,
            label,
            recompute: false,
        });
        id
    }

    // ----- sources ------------------------------------------------------------------------

    /// Declares a named graph input (inputs are ordered by declaration).
    pub fn input(&mut self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<ValueId> {
        let next = NodeId(self.prog.nodes.len() as u32);
        if let Some(&first) = self.inputs.get(name) {
            return Err(Error::DuplicateName {
                kind: "input",
                name: name.to_string(),
                first,
                second: next,
            });
        }
        let id = self.push(
            Op::Input {
                name: name.to_string(),
            },
            Vec::new(),
            TensorType::new(dtype, shape).into(),
        );
        self.inputs.insert(name.to_string(), id);
        self.prog.inputs.push(id);
        Ok(id)
    }

    /// Declares a weight by checkpoint name. Declaring the same name again returns the same
    /// value when dtype and shape agree, and [`Error::WeightConflict`] otherwise.
    pub fn weight(&mut self, name: &str, dtype: Dtype, shape: &[usize]) -> Result<ValueId> {
        let requested = TensorType::new(dtype, shape);
        if let Some(&id) = self.weights.get(name) {
            let existing = self.prog.node(id).tensor().expect("weights are tensors");
            if *existing != requested {
                return Err(Error::WeightConflict {
                    name: name.to_string(),
                    existing: existing.clone(),
                    requested,
                });
            }
            return Ok(id);
        }
        let id = self.push(
            Op::Weight {
                name: name.to_string(),
                rows: None,
            },
            Vec::new(),
            requested.into(),
        );
        self.weights.insert(name.to_string(), id);
        Ok(id)
    }

    /// Declares rows `start..end` of checkpoint tensor `name`, whose full shape is `full_shape`
    /// (the node's shape is the slice's). Declaring the same range again returns the same value;
    /// overlapping ranges of one name are rejected by [`Builder::finish`] (validation).
    pub fn weight_rows(
        &mut self,
        name: &str,
        dtype: Dtype,
        full_shape: &[usize],
        rows: [usize; 2],
    ) -> Result<ValueId> {
        let [start, end] = rows;
        let Some(&full_rows) = full_shape.first() else {
            return Err(self.err(
                "weight",
                format!("weight {name:?}: a row range needs rank >= 1, the tensor is a scalar"),
            ));
        };
        if start >= end || end > full_rows {
            return Err(self.err(
                "weight",
                format!(
                    "weight {name:?}: rows [{start}, {end}) must be non-empty and within the {full_rows} rows of {}",
                    crate::ShapeDisplay(full_shape)
                ),
            ));
        }
        let mut shape = full_shape.to_vec();
        shape[0] = end - start;
        let requested = TensorType::new(dtype, &shape);
        let key = (name.to_string(), rows);
        if let Some(&id) = self.weight_rows.get(&key) {
            let existing = self.prog.node(id).tensor().expect("weights are tensors");
            if *existing != requested {
                return Err(Error::WeightConflict {
                    name: crate::weight_display(name, Some(rows)),
                    existing: existing.clone(),
                    requested,
                });
            }
            return Ok(id);
        }
        let id = self.push(
            Op::Weight {
                name: name.to_string(),
                rows: Some(rows),
            },
            Vec::new(),
            requested.into(),
        );
        self.weight_rows.insert(key, id);
        Ok(id)
    }

    /// `table[indices]` for checkpoint table `name` (`full_shape = [V, D]`, read as `dtype`),
    /// split into row shards of at most `max_shard_bytes` each (in `dtype`) so no engine has to
    /// hold the whole table. A table that fits is one plain [`Op::Embedding`] of the whole weight
    /// (the program is exactly what [`Builder::embedding`] makes).
    ///
    /// Otherwise `K = ⌈V / max_rows⌉` shards of (as equal as possible) contiguous rows; shard `k`
    /// with rows `[lo, hi)` adds `in_k = (ids >= lo) & (ids < hi)`,
    /// `local_k = where(in_k, ids − lo, 0)`, `g_k = embedding(W[lo..hi], local_k)` and
    /// `acc = where(in_k[…, None], g_k, acc)` (acc starts as `g_0`). Every step selects whole
    /// rows, so the result is bit-identical to the unsharded gather for ids in `0..V`; only
    /// existing ops are used, so every executor and lowering runs it unchanged. Unlike the plain
    /// gather, an id outside `0..V` is not an error: it yields row 0.
    pub fn embedding_sharded(
        &mut self,
        name: &str,
        dtype: Dtype,
        full_shape: &[usize],
        indices: ValueId,
        max_shard_bytes: usize,
    ) -> Result<ValueId> {
        let &[rows, d] = full_shape else {
            return Err(self.err(
                "embedding",
                format!(
                    "table {name:?}: expected a [V, D] table, found {}",
                    crate::ShapeDisplay(full_shape)
                ),
            ));
        };
        let row_bytes = d.saturating_mul(dtype.size());
        if rows.saturating_mul(row_bytes) <= max_shard_bytes || rows == 0 {
            let w = self.weight(name, dtype, full_shape)?;
            return self.embedding(w, indices);
        }
        let max_rows = max_shard_bytes / row_bytes;
        if max_rows == 0 {
            return Err(self.err(
                "embedding",
                format!(
                    "table {name:?}: one row is {row_bytes} bytes, more than the shard size {max_shard_bytes}"
                ),
            ));
        }
        let shards = rows.div_ceil(max_rows);
        let per = rows.div_ceil(shards);
        let idt = self.dtype(indices)?;
        if !matches!(idt, Dtype::I64 | Dtype::I32) {
            return Err(self.err(
                "embedding",
                format!("indices must be i64 or i32, found {idt}"),
            ));
        }
        let zero = self.scalar(idt, 0.0)?;
        let mut acc = None;
        for k in 0..shards {
            let (lo, hi) = (k * per, ((k + 1) * per).min(rows));
            let w = self.weight_rows(name, dtype, full_shape, [lo, hi])?;
            let lo_c = self.scalar(idt, lo as f64)?;
            let hi_c = self.scalar(idt, hi as f64)?;
            let ge = self.ge(indices, lo_c)?;
            let lt = self.lt(indices, hi_c)?;
            let inside = self.and(ge, lt)?;
            let shifted = if lo == 0 {
                indices
            } else {
                self.sub_scalar(indices, lo as f64)?
            };
            let local = self.select(inside, shifted, zero)?;
            let g = self.embedding(w, local)?;
            acc = Some(match acc {
                None => g,
                Some(prev) => {
                    let cond = self.unsqueeze(inside, -1)?;
                    self.select(cond, g, prev)?
                }
            });
        }
        Ok(acc.expect("at least two shards"))
    }

    /// An inline constant from raw little-endian bytes (see [`Dtype`] for the layout).
    pub fn constant(&mut self, dtype: Dtype, shape: &[usize], data: Vec<u8>) -> Result<ValueId> {
        let t = TensorType::new(dtype, shape);
        let op = Op::Constant { data };
        if let Err(reason) = crate::program::check_source(&op, &ValueType::Tensor(t.clone())) {
            return Err(self.err("constant", reason));
        }
        Ok(self.push(op, Vec::new(), t.into()))
    }

    /// An f32 constant.
    pub fn constant_f32(&mut self, shape: &[usize], values: &[f32]) -> Result<ValueId> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.constant(Dtype::F32, shape, data)
    }

    /// An i64 constant.
    pub fn constant_i64(&mut self, shape: &[usize], values: &[i64]) -> Result<ValueId> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.constant(Dtype::I64, shape, data)
    }

    /// A bool constant.
    pub fn constant_bool(&mut self, shape: &[usize], values: &[bool]) -> Result<ValueId> {
        let data = values.iter().map(|&v| v as u8).collect();
        self.constant(Dtype::Bool, shape, data)
    }

    /// A constant of any dtype from f64 values: floats are rounded to f32 and then (bf16/f16)
    /// to nearest even, ints require integral values, bool is `v != 0`.
    pub fn constant_from_f64(
        &mut self,
        dtype: Dtype,
        shape: &[usize],
        values: &[f64],
    ) -> Result<ValueId> {
        let mut data = Vec::with_capacity(values.len() * dtype.size());
        for &v in values {
            if dtype.is_int() && (v.fract() != 0.0 || !v.is_finite()) {
                return Err(self.err(
                    "constant",
                    format!("value {v} is not an integer but dtype is {dtype}"),
                ));
            }
            encode(dtype, v, &mut data);
        }
        self.constant(dtype, shape, data)
    }

    /// A scalar (shape `[]`) constant.
    pub fn scalar(&mut self, dtype: Dtype, value: f64) -> Result<ValueId> {
        self.constant_from_f64(dtype, &[], &[value])
    }

    /// `[0, 1, …, n−1]` as an i64 constant `[n]`.
    pub fn arange_i64(&mut self, n: usize) -> Result<ValueId> {
        let v: Vec<i64> = (0..n as i64).collect();
        self.constant_i64(&[n], &v)
    }

    /// A tensor filled with `value`: a scalar constant expanded to `shape` (no big bytes).
    pub fn full(&mut self, dtype: Dtype, shape: &[usize], value: f64) -> Result<ValueId> {
        let s = self.scalar(dtype, value)?;
        if shape.is_empty() {
            Ok(s)
        } else {
            self.expand(s, shape)
        }
    }

    // ----- outputs ------------------------------------------------------------------------

    /// Declares a named graph output (outputs are ordered by declaration).
    pub fn output(&mut self, name: &str, v: ValueId) -> Result<()> {
        if let Some(&first) = self.outputs.get(name) {
            return Err(Error::DuplicateName {
                kind: "output",
                name: name.to_string(),
                first,
                second: v,
            });
        }
        self.tensor(v).map_err(|e| Error::Interface {
            kind: "output",
            name: name.to_string(),
            reason: e.to_string(),
        })?;
        self.outputs.insert(name.to_string(), v);
        self.prog.outputs.push(GraphOutput {
            name: name.to_string(),
            value: v,
        });
        Ok(())
    }

    /// Copies `p`'s nodes into this program (a call inlined): each input of `p` is bound to the
    /// value `inputs` gives for its name, every node that `p`'s outputs depend on is re-added
    /// (types re-inferred, so a binding of another type fails at the node that reads it), and
    /// the values of `p`'s outputs are returned by name. Weights are declared through
    /// [`Builder::weight`] / [`Builder::weight_rows`], so a weight (or row range) already in this
    /// program is the same value: inlining one program ten times reads each weight once.
    /// Labels are prefixed with `label_prefix` (`"step.3"` → `step.3.expert.layers.0`);
    /// recompute marks are kept. A name in `inputs` that `p` does not take is an error, as is an
    /// input of `p` left unbound.
    pub fn inline(
        &mut self,
        p: &Program,
        inputs: &BTreeMap<&str, ValueId>,
        label_prefix: &str,
    ) -> Result<BTreeMap<String, ValueId>> {
        let iface = |name: &str, reason: String| Error::Interface {
            kind: "input",
            name: name.to_string(),
            reason,
        };
        for name in inputs.keys() {
            if p.input_by_name(name).is_none() {
                return Err(iface(
                    name,
                    "bound, but the inlined program has no such input".into(),
                ));
            }
        }
        let roots: Vec<ValueId> = p.outputs.iter().map(|o| o.value).collect();
        let live = p.ancestors(&roots);
        let mut map: Vec<Option<ValueId>> = vec![None; p.len()];
        for id in p.topo_order()? {
            if !live[id.index()] {
                continue;
            }
            let n = p.node(id);
            let label = match (&n.label, label_prefix.is_empty()) {
                (Some(l), false) => Some(format!("{label_prefix}.{l}")),
                (Some(l), true) => Some(l.clone()),
                (None, false) => Some(label_prefix.to_string()),
                (None, true) => None,
            };
            let t = || {
                n.tensor()
                    .cloned()
                    .ok_or_else(|| self.err(n.op.name(), "tuple source"))
            };
            let v = match &n.op {
                Op::Input { name } => {
                    let v = *inputs.get(name.as_str()).ok_or_else(|| {
                        iface(name, "taken by the inlined program but not bound".into())
                    })?;
                    self.check_id("inline", v)?;
                    let want = t()?;
                    let got = self.tensor(v)?;
                    if *got != want {
                        return Err(iface(
                            name,
                            format!("the program takes {want}, bound to {got}"),
                        ));
                    }
                    map[id.index()] = Some(v);
                    continue;
                }
                Op::Weight { name, rows: None } => {
                    let t = t()?;
                    self.weight(name, t.dtype, &t.shape)?
                }
                Op::Weight {
                    name,
                    rows: Some(rows),
                } => {
                    let t = t()?;
                    // The node holds the slice's shape; rows `[0, end)` are the least the full
                    // tensor has, which is all `weight_rows` checks against.
                    let mut full = t.shape.clone();
                    if let Some(r) = full.first_mut() {
                        *r = rows[1];
                    }
                    self.weight_rows(name, t.dtype, &full, *rows)?
                }
                Op::Constant { data } => {
                    let t = t()?;
                    self.constant(t.dtype, &t.shape, data.clone())?
                }
                op => {
                    let ins: Vec<ValueId> = n
                        .inputs
                        .iter()
                        .map(|i| map[i.index()].expect("inputs come first in topological order"))
                        .collect();
                    self.node(op.clone(), &ins)?
                }
            };
            let node = &mut self.prog.nodes[v.index()];
            // A weight shared with an earlier copy keeps the first copy's label.
            if !matches!(node.op, Op::Weight { .. }) || node.label.is_none() {
                node.label = label;
            }
            node.recompute |= n.recompute;
            map[id.index()] = Some(v);
        }
        Ok(p.outputs
            .iter()
            .map(|o| {
                let v = map[o.value.index()].expect("outputs are live");
                (o.name.clone(), v)
            })
            .collect())
    }

    /// Validates and returns the program.
    pub fn finish(self) -> Result<Program> {
        self.prog.validate()?;
        Ok(self.prog)
    }

    // ----- linear algebra -----------------------------------------------------------------

    /// `x · Wᵀ + b` ([`Op::Linear`]); weight `[out, in]`.
    pub fn linear(
        &mut self,
        x: ValueId,
        weight: ValueId,
        bias: Option<ValueId>,
    ) -> Result<ValueId> {
        match bias {
            Some(b) => self.node(Op::Linear, &[x, weight, b]),
            None => self.node(Op::Linear, &[x, weight]),
        }
    }

    /// (Batched) matrix product ([`Op::MatMul`]).
    pub fn matmul(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.node(Op::MatMul, &[a, b])
    }

    /// NCHW 2-D convolution ([`Op::Conv2d`]).
    pub fn conv2d(
        &mut self,
        x: ValueId,
        weight: ValueId,
        bias: Option<ValueId>,
        stride: [usize; 2],
        padding: [usize; 2],
    ) -> Result<ValueId> {
        let op = Op::Conv2d { stride, padding };
        match bias {
            Some(b) => self.node(op, &[x, weight, b]),
            None => self.node(op, &[x, weight]),
        }
    }

    // ----- norms --------------------------------------------------------------------------

    /// Layer norm over the last dim ([`Op::LayerNorm`]).
    pub fn layer_norm(
        &mut self,
        x: ValueId,
        weight: ValueId,
        bias: ValueId,
        eps: f64,
    ) -> Result<ValueId> {
        self.node(Op::LayerNorm { eps }, &[x, weight, bias])
    }

    /// Gemma RMS norm `x·rsqrt(mean(x²)+eps)·(1+w)`, or weightless ([`Op::RmsNorm`]).
    pub fn rms_norm(&mut self, x: ValueId, weight: Option<ValueId>, eps: f64) -> Result<ValueId> {
        match weight {
            Some(w) => self.node(Op::RmsNorm { eps }, &[x, w]),
            None => self.node(Op::RmsNorm { eps }, &[x]),
        }
    }

    // ----- elementwise --------------------------------------------------------------------

    /// `a + b` with broadcasting.
    pub fn add(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.node(
            Op::Binary {
                kind: BinaryOp::Add,
            },
            &[a, b],
        )
    }

    /// `a - b` with broadcasting.
    pub fn sub(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.node(
            Op::Binary {
                kind: BinaryOp::Sub,
            },
            &[a, b],
        )
    }

    /// `a * b` with broadcasting.
    pub fn mul(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.node(
            Op::Binary {
                kind: BinaryOp::Mul,
            },
            &[a, b],
        )
    }

    /// `a / b` with broadcasting (floats).
    pub fn div(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.node(
            Op::Binary {
                kind: BinaryOp::Div,
            },
            &[a, b],
        )
    }

    fn scalar_op(
        &mut self,
        kind: BinaryOp,
        x: ValueId,
        scalar: f64,
        scalar_lhs: bool,
    ) -> Result<ValueId> {
        self.node(
            Op::BinaryScalar {
                kind,
                scalar,
                scalar_lhs,
            },
            &[x],
        )
    }

    /// `x + s`.
    pub fn add_scalar(&mut self, x: ValueId, s: f64) -> Result<ValueId> {
        self.scalar_op(BinaryOp::Add, x, s, false)
    }

    /// `x - s`.
    pub fn sub_scalar(&mut self, x: ValueId, s: f64) -> Result<ValueId> {
        self.scalar_op(BinaryOp::Sub, x, s, false)
    }

    /// `s - x` (e.g. `1 - t`).
    pub fn rsub_scalar(&mut self, s: f64, x: ValueId) -> Result<ValueId> {
        self.scalar_op(BinaryOp::Sub, x, s, true)
    }

    /// `x * s`.
    pub fn mul_scalar(&mut self, x: ValueId, s: f64) -> Result<ValueId> {
        self.scalar_op(BinaryOp::Mul, x, s, false)
    }

    /// `x / s`.
    pub fn div_scalar(&mut self, x: ValueId, s: f64) -> Result<ValueId> {
        self.scalar_op(BinaryOp::Div, x, s, false)
    }

    /// `s / x`.
    pub fn rdiv_scalar(&mut self, s: f64, x: ValueId) -> Result<ValueId> {
        self.scalar_op(BinaryOp::Div, x, s, true)
    }

    fn unary(&mut self, kind: UnaryOp, x: ValueId) -> Result<ValueId> {
        self.node(Op::Unary { kind }, &[x])
    }

    /// `-x`.
    pub fn neg(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Neg, x)
    }

    /// `e^x`.
    pub fn exp(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Exp, x)
    }

    /// `sqrt(x)`.
    pub fn sqrt(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Sqrt, x)
    }

    /// `1/sqrt(x)`.
    pub fn rsqrt(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Rsqrt, x)
    }

    /// `sin(x)`.
    pub fn sin(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Sin, x)
    }

    /// `cos(x)`.
    pub fn cos(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Cos, x)
    }

    /// `tanh(x)`.
    pub fn tanh(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Tanh, x)
    }

    /// GELU, tanh approximation.
    pub fn gelu_tanh(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::GeluTanh, x)
    }

    /// SiLU `x·sigmoid(x)`.
    pub fn silu(&mut self, x: ValueId) -> Result<ValueId> {
        self.unary(UnaryOp::Silu, x)
    }

    fn compare(&mut self, kind: CompareOp, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.node(Op::Compare { kind }, &[a, b])
    }

    /// `a < b` → bool.
    pub fn lt(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.compare(CompareOp::Lt, a, b)
    }

    /// `a <= b` → bool.
    pub fn le(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.compare(CompareOp::Le, a, b)
    }

    /// `a == b` → bool.
    pub fn eq(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.compare(CompareOp::Eq, a, b)
    }

    /// `a != b` → bool.
    pub fn ne(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.compare(CompareOp::Ne, a, b)
    }

    /// `a > b` → bool.
    pub fn gt(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.compare(CompareOp::Gt, a, b)
    }

    /// `a >= b` → bool.
    pub fn ge(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.compare(CompareOp::Ge, a, b)
    }

    /// Logical and of bools.
    pub fn and(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.node(
            Op::Logical {
                kind: LogicalOp::And,
            },
            &[a, b],
        )
    }

    /// Logical or of bools.
    pub fn or(&mut self, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.node(
            Op::Logical {
                kind: LogicalOp::Or,
            },
            &[a, b],
        )
    }

    /// Logical not of a bool.
    pub fn not(&mut self, x: ValueId) -> Result<ValueId> {
        self.node(Op::Not, &[x])
    }

    /// `cond ? a : b` with broadcasting ([`Op::Where`]).
    pub fn select(&mut self, cond: ValueId, a: ValueId, b: ValueId) -> Result<ValueId> {
        self.node(Op::Where, &[cond, a, b])
    }

    /// Dtype conversion ([`Op::Cast`]).
    pub fn cast(&mut self, x: ValueId, to: Dtype) -> Result<ValueId> {
        self.node(Op::Cast { to }, &[x])
    }

    // ----- transformer pieces -------------------------------------------------------------

    /// Softmax along `axis`.
    pub fn softmax(&mut self, x: ValueId, axis: isize) -> Result<ValueId> {
        let axis = self.axis("softmax", axis, self.rank("softmax", x)?)?;
        self.node(Op::Softmax { axis }, &[x])
    }

    /// Rotary embedding, rotate_half convention ([`Op::Rope`]).
    pub fn rope(&mut self, x: ValueId, cos: ValueId, sin: ValueId) -> Result<ValueId> {
        self.node(Op::Rope, &[x, cos, sin])
    }

    /// Scaled dot-product attention with optional additive mask ([`Op::Attention`]).
    pub fn attention(
        &mut self,
        q: ValueId,
        k: ValueId,
        v: ValueId,
        mask: Option<ValueId>,
        scale: f64,
    ) -> Result<ValueId> {
        let op = Op::Attention { scale };
        match mask {
            Some(m) => self.node(op, &[q, k, v, m]),
            None => self.node(op, &[q, k, v]),
        }
    }

    /// Row gather `table[indices]` ([`Op::Embedding`]).
    pub fn embedding(&mut self, table: ValueId, indices: ValueId) -> Result<ValueId> {
        self.node(Op::Embedding, &[table, indices])
    }

    // ----- shape ops ----------------------------------------------------------------------

    /// Concatenation along `axis`.
    pub fn concat(&mut self, xs: &[ValueId], axis: isize) -> Result<ValueId> {
        let Some(&first) = xs.first() else {
            return Err(self.err("concat", "expected at least 1 input, found 0"));
        };
        let axis = self.axis("concat", axis, self.rank("concat", first)?)?;
        self.node(Op::Concat { axis }, xs)
    }

    /// Python-style slice `x[start:end:step]` on `axis`: negative `start`/`end` count from the
    /// end, and both are clamped to `0..=dim` (use `isize::MAX` for "to the end").
    pub fn slice(
        &mut self,
        x: ValueId,
        axis: isize,
        start: isize,
        end: isize,
        step: usize,
    ) -> Result<ValueId> {
        let rank = self.rank("slice", x)?;
        let axis = self.axis("slice", axis, rank)?;
        let dim = self.shape(x)?[axis] as isize;
        let norm = |i: isize| -> usize {
            let i = if i < 0 { i.saturating_add(dim) } else { i };
            i.clamp(0, dim) as usize
        };
        let (start, end) = (norm(start), norm(end));
        let end = end.max(start);
        self.node(
            Op::Slice {
                axis,
                start,
                end,
                step,
            },
            &[x],
        )
    }

    /// Reshape to `shape` (same element count).
    pub fn reshape(&mut self, x: ValueId, shape: &[usize]) -> Result<ValueId> {
        self.node(
            Op::Reshape {
                shape: shape.to_vec(),
            },
            &[x],
        )
    }

    /// Inserts a size-1 dim at `axis` (in `-(rank+1)..=rank`), as a reshape.
    pub fn unsqueeze(&mut self, x: ValueId, axis: isize) -> Result<ValueId> {
        let rank = self.rank("reshape", x)?;
        let axis = self.axis("reshape", axis, rank + 1)?;
        let mut s = self.shape(x)?.to_vec();
        s.insert(axis, 1);
        self.reshape(x, &s)
    }

    /// Removes the size-1 dim at `axis`, as a reshape.
    pub fn squeeze(&mut self, x: ValueId, axis: isize) -> Result<ValueId> {
        let rank = self.rank("reshape", x)?;
        let axis = self.axis("reshape", axis, rank)?;
        let mut s = self.shape(x)?.to_vec();
        if s[axis] != 1 {
            return Err(self.err(
                "reshape",
                format!("squeeze: expected dim {axis} to be 1, found {}", s[axis]),
            ));
        }
        s.remove(axis);
        self.reshape(x, &s)
    }

    /// Axis permutation ([`Op::Permute`]).
    pub fn permute(&mut self, x: ValueId, perm: &[usize]) -> Result<ValueId> {
        self.node(
            Op::Permute {
                perm: perm.to_vec(),
            },
            &[x],
        )
    }

    /// Swaps two axes, as a permute.
    pub fn transpose(&mut self, x: ValueId, a: isize, b: isize) -> Result<ValueId> {
        let rank = self.rank("permute", x)?;
        let (a, b) = (
            self.axis("permute", a, rank)?,
            self.axis("permute", b, rank)?,
        );
        let mut perm: Vec<usize> = (0..rank).collect();
        perm.swap(a, b);
        self.permute(x, &perm)
    }

    /// Broadcast to `shape` ([`Op::Expand`]).
    pub fn expand(&mut self, x: ValueId, shape: &[usize]) -> Result<ValueId> {
        self.node(
            Op::Expand {
                shape: shape.to_vec(),
            },
            &[x],
        )
    }

    /// Inclusive cumulative sum along `axis`.
    pub fn cumsum(&mut self, x: ValueId, axis: isize) -> Result<ValueId> {
        let axis = self.axis("cumsum", axis, self.rank("cumsum", x)?)?;
        self.node(Op::CumSum { axis }, &[x])
    }

    fn reduce(
        &mut self,
        kind: ReduceOp,
        x: ValueId,
        axes: &[isize],
        keepdim: bool,
    ) -> Result<ValueId> {
        let name = Op::Reduce {
            kind,
            axes: Vec::new(),
            keepdim,
        }
        .name();
        let rank = self.rank(name, x)?;
        let mut norm = Vec::with_capacity(axes.len());
        for &a in axes {
            norm.push(self.axis(name, a, rank)?);
        }
        norm.sort_unstable();
        if norm.windows(2).any(|w| w[0] == w[1]) {
            return Err(self.err(name, format!("axis repeated in {axes:?}")));
        }
        self.node(
            Op::Reduce {
                kind,
                axes: norm,
                keepdim,
            },
            &[x],
        )
    }

    /// Sum over `axes`.
    pub fn sum(&mut self, x: ValueId, axes: &[isize], keepdim: bool) -> Result<ValueId> {
        self.reduce(ReduceOp::Sum, x, axes, keepdim)
    }

    /// Mean over `axes`.
    pub fn mean(&mut self, x: ValueId, axes: &[isize], keepdim: bool) -> Result<ValueId> {
        self.reduce(ReduceOp::Mean, x, axes, keepdim)
    }

    /// Maximum over `axes`.
    pub fn max(&mut self, x: ValueId, axes: &[isize], keepdim: bool) -> Result<ValueId> {
        self.reduce(ReduceOp::Max, x, axes, keepdim)
    }

    /// Splits along `axis` into pieces of `sizes`: adds the `split` node and one `getitem`
    /// per piece, and returns the getitems' values.
    pub fn split(&mut self, x: ValueId, axis: isize, sizes: &[usize]) -> Result<Vec<ValueId>> {
        let axis = self.axis("split", axis, self.rank("split", x)?)?;
        let t = self.node(
            Op::Split {
                axis,
                sizes: sizes.to_vec(),
            },
            &[x],
        )?;
        (0..sizes.len())
            .map(|index| self.node(Op::GetItem { index }, &[t]))
            .collect()
    }

    /// `torch.chunk` into `n` equal pieces along `axis` (the dim must divide by `n`).
    pub fn chunk(&mut self, x: ValueId, n: usize, axis: isize) -> Result<Vec<ValueId>> {
        let rank = self.rank("split", x)?;
        let a = self.axis("split", axis, rank)?;
        let dim = self.shape(x)?[a];
        if n == 0 || !dim.is_multiple_of(n) {
            return Err(self.err(
                "split",
                format!("chunk: dim {dim} of axis {a} does not divide into {n} equal pieces"),
            ));
        }
        self.split(x, axis, &vec![dim / n; n])
    }
}

/// Appends `v` encoded as `dtype` (little-endian).
fn encode(dtype: Dtype, v: f64, out: &mut Vec<u8>) {
    match dtype {
        Dtype::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
        // Via f32, as BinaryScalar converts its scalar, so a constant and a scalar op agree.
        Dtype::Bf16 => out.extend_from_slice(&petite_dtype::bf16_bits(v as f32).to_le_bytes()),
        Dtype::F16 => out.extend_from_slice(&petite_dtype::f16_bits(v as f32).to_le_bytes()),
        Dtype::I64 => out.extend_from_slice(&(v as i64).to_le_bytes()),
        Dtype::I32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
        Dtype::U8 => out.push(v as u8),
        Dtype::Bool => out.push((v != 0.0) as u8),
        Dtype::I8 => out.push(v as i8 as u8),
        Dtype::F8E4M3 => out.push(petite_dtype::quant::f8e4m3_bits(v as f32)),
    }
}
