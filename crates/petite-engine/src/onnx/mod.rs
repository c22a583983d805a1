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

mod dense;
mod elementwise;
mod layout;
mod norm;
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
/// The opset of a model holding quantized codes: 19 is the first whose `DequantizeLinear` takes
/// `float8e4m3fn` codes and a bf16 scale (the ops petite emits mean the same from 17 to 19 on
/// its dtypes).
pub const OPSET_QUANT: i64 = 19;
/// ONNX IR version matching opset 19 (the first with the float8 types).
pub const IR_VERSION_QUANT: i64 = 9;

/// The (opset, IR version) a model of `program` declares: [`OPSET`] unless it holds quantized
/// codes ([`OPSET_QUANT`]).
pub fn opset_for(program: &Program) -> (i64, i64) {
    let quant = program.ids().any(|id| {
        program
            .node(id)
            .tensor()
            .is_some_and(|t| t.dtype.is_quant_code())
    });
    if quant {
        (OPSET_QUANT, IR_VERSION_QUANT)
    } else {
        (OPSET, IR_VERSION)
    }
}

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
const INT8: i64 = 3;
const FLOAT8E4M3FN: i64 = 17;

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
        Dtype::I8 => INT8,
        Dtype::F8E4M3 => FLOAT8E4M3FN,
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
        Dtype::I8 => INT8,
        Dtype::F8E4M3 => FLOAT8E4M3FN,
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
    /// The model's opset ([`opset_for`]): from 18 on, `ReduceMean`/`ReduceMax` take their
    /// axes as an input.
    opset: i64,
    /// [`Flavor::TensorRt`]: each f32 scale's cast to its dequantize's dtype, by the scale's
    /// value name (a weight shared by the steps is dequantized once a step, cast once).
    scale_casts: BTreeMap<(String, i64), String>,
}

impl Emitter<'_> {
    /// `ReduceMean`/`ReduceMax` of `x` over `axes`, spelled for the model's opset.
    fn reduce_axes(&mut self, op: &str, x: &str, axes: Vec<i64>, keepdims: bool) -> String {
        let kd = ("keepdims", Attr::I(i64::from(keepdims)));
        if self.opset >= 18 {
            let a = self.const_i64(&axes);
            self.op(op, &[x, &a], vec![kd])
        } else {
            self.op(op, &[x], vec![("axes", Attr::Ints(axes)), kd])
        }
    }

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
        if t.dtype.is_quant_code() {
            // Codes feed their `DequantizeLinear` straight from the initializer: TensorRT takes
            // a quantized constant only as a DQ's input (no Identity between).
            self.names[id.index()] = init;
            return Ok(());
        }
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

    /// Node `id` as ONNX nodes: sources here, every other op by its family (`dense`, `norm`,
    /// `elementwise`, `layout`), as petite-reference's executor dispatches `eval`.
    fn emit(&mut self, id: NodeId) -> Result<()> {
        let op = &self.p.node(id).op;
        match op {
            Op::Input { .. } => Ok(()),
            Op::Weight { name, rows } => self.weight(id, &name.clone(), *rows),
            Op::Constant { data } => self.constant(id, &data.clone()),
            Op::Linear | Op::MatMul | Op::Conv2d { .. } => self.emit_dense(id, op),
            Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
            | Op::Softmax { .. }
            | Op::Rope
            | Op::Attention { .. }
            | Op::Embedding => self.emit_norm(id, op),
            Op::Binary { .. }
            | Op::BinaryScalar { .. }
            | Op::Compare { .. }
            | Op::Logical { .. }
            | Op::Not
            | Op::Unary { .. }
            | Op::Cast { .. }
            | Op::Dequantize { .. }
            | Op::Where
            | Op::CumSum { .. }
            | Op::Reduce { .. } => self.emit_elementwise(id, op),
            Op::Concat { .. }
            | Op::Slice { .. }
            | Op::Reshape { .. }
            | Op::Permute { .. }
            | Op::Expand { .. }
            | Op::Split { .. }
            | Op::GetItem { .. } => self.emit_layout(id, op),
        }
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
        opset: opset_for(program).0,
        scale_casts: BTreeMap::new(),
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
    let (opset, ir_version) = opset_for(program);
    let mut head = Msg::new();
    head.int(1, ir_version)
        .str(2, "petite")
        .str(3, env!("CARGO_PKG_VERSION"));
    let mut tail = Msg::new();
    tail.msg(8, Msg::new().str(1, "").int(2, opset));
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
