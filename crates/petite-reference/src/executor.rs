//! The executor: runs a [`Program`] node by node in topological order.
//!
//! Values are freed after their last consumer (graph outputs are kept); inputs at their last
//! use are moved rather than copied. Weights are never held converted: each use reads the
//! source's view and converts just that tensor (an aligned f32 tensor declared f32 is used in
//! place), and after a weight's last reader the source may give its pages back.
//! Nodes no output depends on are not run.

use crate::kernels::{self, Conv2dParams, Reduce, SdpaShape};
use crate::tensor::{Data, Tensor};
use crate::{Error, Result};
use half::{bf16, f16};
use petite_dtype::{bf16_bits_to_f32, round_through_bf16, to_bf16};
use petite_graph::{
    BinaryOp, CompareOp, Dtype, LogicalOp, NodeId, Op, Program, ReduceOp, ShapeDisplay, TensorType,
    UnaryOp,
};
use petite_weights::WeightSource;
use rayon::prelude::*;
use std::borrow::Cow;
use std::collections::BTreeMap;

#[cfg(target_endian = "big")]
compile_error!("petite-reference reads little-endian weight bytes in place");

/// A weight source with no tensors, for programs that declare no weights.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoWeights;

impl WeightSource for NoWeights {
    fn names(&self) -> Vec<String> {
        Vec::new()
    }
    fn info(&self, name: &str) -> petite_weights::Result<petite_weights::TensorInfo> {
        Err(petite_weights::Error::MissingTensor {
            file: "<no weights>".into(),
            name: name.into(),
        })
    }
    fn tensor(&self, name: &str) -> petite_weights::Result<petite_weights::TensorView<'_>> {
        Err(petite_weights::Error::MissingTensor {
            file: "<no weights>".into(),
            name: name.into(),
        })
    }
    fn release(&self, _names: &[&str]) -> petite_weights::Result<()> {
        Ok(())
    }
}

/// What one run held and where its time went.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RunStats {
    /// Wall seconds per op name (`"linear"`, `"attention"`, …), summed over nodes; weight
    /// conversion is charged to the op that reads the weight.
    pub op_seconds: BTreeMap<&'static str, f64>,
    /// Nodes evaluated (inputs and dead nodes excluded).
    pub nodes_run: usize,
    /// Peak bytes of values held between nodes (inputs, intermediates, outputs; at their
    /// dtype's size), counted right after each node, before its inputs are freed. Excludes
    /// kernel scratch and per-use weight conversions (at most a few of the largest weights).
    pub peak_value_bytes: usize,
}

fn slot_bytes(s: &Slot) -> usize {
    match s {
        Slot::Tensor(t) => t.numel() * t.dtype().size(),
        Slot::Tuple(ts) => ts.iter().map(|t| t.numel() * t.dtype().size()).sum(),
        Slot::Empty | Slot::Weight => 0,
    }
}

enum Slot {
    Empty,
    Tensor(Tensor),
    Tuple(Vec<Tensor>),
    /// A weight node's value: read from the source at each use.
    Weight,
}

/// Runs one program against one weight source. Cheap to build; reusable across runs.
pub struct Executor<'a> {
    program: &'a Program,
    weights: &'a dyn WeightSource,
    order: Vec<NodeId>,
    live: Vec<bool>,
    /// Distinct consuming live nodes per value.
    uses: Vec<u32>,
    is_output: Vec<bool>,
    release_weights: bool,
    /// Whether a bf16 × bf16 linear must sum in the f32 path's order ([`Executor::exact_bf16`]).
    exact_bf16: bool,
    /// Live weights in the order the run first reads them: (position in `order` of the first
    /// reader, name, stored byte range), for readahead.
    ahead: Vec<(usize, String, std::ops::Range<usize>)>,
    /// The next program's weights ([`Executor::read_ahead_into`]): asked for once this run has
    /// asked for its own last weight.
    then: Vec<(String, std::ops::Range<usize>)>,
}

/// Weight bytes asked for ahead of the node being run (`MADV_WILLNEED`): a mapped checkpoint
/// read from disk then arrives while the cores compute, instead of faulting in synchronously
/// at each weight's first use. A few of the largest weights, so the pages asked for stay
/// cached until read.
const READAHEAD_BYTES: usize = 256 << 20;

impl<'a> Executor<'a> {
    /// Validates `program` and prepares its order. Weights are looked up at run time.
    pub fn new(program: &'a Program, weights: &'a dyn WeightSource) -> Result<Self> {
        program.validate()?;
        let order = program.topo_order()?;
        let roots: Vec<NodeId> = program.outputs.iter().map(|o| o.value).collect();
        let live = program.ancestors(&roots);
        let mut uses = vec![0u32; program.len()];
        for (i, cs) in program.consumers().iter().enumerate() {
            uses[i] = cs.iter().filter(|c| live[c.index()]).count() as u32;
        }
        let mut is_output = vec![false; program.len()];
        for o in &program.outputs {
            is_output[o.value.index()] = true;
        }
        let mut at = vec![usize::MAX; program.len()];
        for (i, id) in order.iter().enumerate() {
            at[id.index()] = i;
        }
        let consumers = program.consumers();
        // A weight the source cannot describe is left out here; its read fails with the error.
        // A table read only by row gathers is not read ahead whole (the token embedding is 2 GiB
        // in f32, of which a prompt reads a few hundred rows): the gather asks for its rows.
        let gathered_only = |v: NodeId| {
            consumers[v.index()]
                .iter()
                .filter(|c| live[c.index()])
                .all(|&c| {
                    let n = program.node(c);
                    matches!(n.op, Op::Embedding) && n.inputs.first() == Some(&v)
                })
        };
        let mut ahead: Vec<_> = program
            .weights()
            .into_iter()
            .filter(|w| live[w.node.index()] && !gathered_only(w.node))
            .filter_map(|w| {
                let first = consumers[w.node.index()]
                    .iter()
                    .filter(|c| live[c.index()])
                    .map(|c| at[c.index()])
                    .min()?;
                let size = weights.info(&w.name).ok()?.dtype.size();
                Some((first, w.stored_range(size)?, w.name))
            })
            .map(|(first, range, name)| (first, name, range))
            .collect();
        ahead.sort_by_key(|a| a.0);
        Ok(Executor {
            program,
            weights,
            order,
            live,
            uses,
            is_output,
            release_weights: true,
            exact_bf16: false,
            ahead,
            then: Vec::new(),
        })
    }

    /// Asks the source for every weight `next` reads (the program run after this one, on the
    /// same source) once this run has asked for its own last one, so that its first run finds
    /// them read instead of reading each at first use: a chunk's steps after its prefix (the
    /// action expert's 1.2 GB in f32; measured cold on a full-size `petite verify`, the first
    /// step 0.79 / 1.01 s → 0.64 / 0.65 s, the others 0.32–0.41 s). They arrive while this run's
    /// last layers compute; the pages are cache, not this process's memory, until read.
    pub fn read_ahead_into(mut self, next: &Executor<'_>) -> Self {
        self.then = next
            .ahead
            .iter()
            .map(|(_, n, r)| (n.clone(), r.clone()))
            .collect();
        self
    }

    /// Whether to ask the source to release a weight's pages after its last reader
    /// (default on; the bytes stay readable, they fault back in from the file).
    pub fn release_weights(mut self, on: bool) -> Self {
        self.release_weights = on;
        self
    }

    /// Whether a linear of bf16 activations and a bf16 weight sums exactly as the f32 path does
    /// on every CPU (`true`), or may run on the CPU's bf16 tile unit (AMX-BF16), whose sums are
    /// rounded in another order (default: `false`, the fast way; the products are exact either
    /// way, so results differ by f32 rounding of sums and stay within every bf16 bound). Turn it
    /// on for results that become exported bytes, so that they do not depend on the CPU.
    pub fn exact_bf16(mut self, on: bool) -> Self {
        self.exact_bf16 = on;
        self
    }

    /// Runs the program. `inputs` must hold exactly the program's inputs, each with its
    /// declared dtype and shape; returns every graph output by name.
    pub fn run(&self, inputs: BTreeMap<String, Tensor>) -> Result<BTreeMap<String, Tensor>> {
        self.run_with_stats(inputs).map(|(out, _)| out)
    }

    /// [`Executor::run`], also reporting how much the run held (see [`RunStats`]).
    pub fn run_with_stats(
        &self,
        mut inputs: BTreeMap<String, Tensor>,
    ) -> Result<(BTreeMap<String, Tensor>, RunStats)> {
        let p = self.program;
        let mut stats = RunStats::default();
        let mut held = vec![0usize; p.len()];
        let mut live_bytes = 0usize;
        let mut slots: Vec<Slot> = (0..p.len()).map(|_| Slot::Empty).collect();
        for &id in &p.inputs {
            let name = p.input_name(id).unwrap_or_default().to_string();
            let want = p.node(id).tensor().cloned().ok_or_else(|| Error::Input {
                name: name.clone(),
                message: "declared as a tuple".into(),
            })?;
            let t = inputs.remove(&name).ok_or_else(|| Error::Input {
                name: name.clone(),
                message: format!("missing (expected {want})"),
            })?;
            if t.dtype() != want.dtype || t.shape() != want.shape.as_slice() {
                return Err(Error::Input {
                    name,
                    message: format!(
                        "expected {want}, found {}{}",
                        t.dtype(),
                        ShapeDisplay(t.shape())
                    ),
                });
            }
            if !self.live[id.index()] {
                continue; // nothing reads it
            }
            held[id.index()] = t.numel() * t.dtype().size();
            live_bytes += held[id.index()];
            slots[id.index()] = Slot::Tensor(t);
        }
        if let Some(extra) = inputs.keys().next() {
            return Err(Error::Input {
                name: extra.clone(),
                message: "not an input of this program".into(),
            });
        }
        let mut remaining = self.uses.clone();
        // `PETITE_CPU_PROFILE`: time by op kind and the slowest nodes, printed after the run. A
        // malformed CPU setting fails the run here, before any kernel reads one.
        let profile = crate::settings::current()?.profile;
        let mut slowest: Vec<(f64, NodeId)> = Vec::new();
        // Readahead: `asked` weights of `ahead` requested, the first `reached` of them read.
        let (mut asked, mut reached, mut window) = (0usize, 0usize, 0usize);
        let mut then_asked = false;
        for (at, &id) in self.order.iter().enumerate() {
            if !self.live[id.index()] {
                continue;
            }
            while reached < self.ahead.len() && self.ahead[reached].0 <= at {
                if reached < asked {
                    window -= self.ahead[reached].2.len();
                }
                reached += 1;
            }
            while asked < self.ahead.len() && (asked < reached || window < READAHEAD_BYTES) {
                let (_, name, r) = &self.ahead[asked];
                self.weights
                    .prefetch_range(name, r.start, r.end)
                    .map_err(|e| Error::Tensor(format!("weight {name:?}: {e}")))?;
                if asked >= reached {
                    window += r.len();
                }
                asked += 1;
            }
            if asked == self.ahead.len() && !then_asked {
                then_asked = true;
                for (name, r) in &self.then {
                    self.weights
                        .prefetch_range(name, r.start, r.end)
                        .map_err(|e| Error::Tensor(format!("weight {name:?}: {e}")))?;
                }
            }
            let node = p.node(id);
            if !matches!(node.op, Op::Input { .. }) {
                let mut cx = Ctx {
                    ex: self,
                    slots: &mut slots,
                    remaining: &remaining,
                    id,
                };
                let t0 = std::time::Instant::now();
                let out = cx.eval().map_err(|e| self.node_err(id, e))?;
                let secs = t0.elapsed().as_secs_f64();
                *stats.op_seconds.entry(node.op.name()).or_insert(0.0) += secs;
                if profile {
                    slowest.push((secs, id));
                }
                self.check_type(id, &out)?;
                held[id.index()] = slot_bytes(&out);
                live_bytes += held[id.index()];
                stats.nodes_run += 1;
                slots[id.index()] = out;
            }
            stats.peak_value_bytes = stats.peak_value_bytes.max(live_bytes);
            let mut seen: Vec<NodeId> = Vec::with_capacity(node.inputs.len());
            for &v in &node.inputs {
                if seen.contains(&v) {
                    continue;
                }
                seen.push(v);
                remaining[v.index()] -= 1;
                if remaining[v.index()] == 0 && !self.is_output[v.index()] {
                    if matches!(slots[v.index()], Slot::Weight)
                        && self.release_weights
                        && let Op::Weight { name, rows } = &p.node(v).op
                    {
                        self.release_weight(v, name, *rows)
                            .map_err(|e| self.node_err(v, e))?;
                    }
                    slots[v.index()] = Slot::Empty;
                    live_bytes -= std::mem::take(&mut held[v.index()]);
                }
            }
            if remaining[id.index()] == 0 && !self.is_output[id.index()] {
                slots[id.index()] = Slot::Empty;
                live_bytes -= std::mem::take(&mut held[id.index()]);
            }
        }
        let mut out = BTreeMap::new();
        for o in &p.outputs {
            let t = match &slots[o.value.index()] {
                Slot::Tensor(t) => t.clone(),
                Slot::Weight => {
                    let cx = Ctx {
                        ex: self,
                        slots: &mut Vec::new(),
                        remaining: &remaining,
                        id: o.value,
                    };
                    cx.weight_tensor(o.value)
                        .map_err(|e| self.node_err(o.value, e))?
                }
                _ => {
                    return Err(
                        self.node_err(o.value, Error::Tensor("output was not computed".into()))
                    );
                }
            };
            out.insert(o.name.clone(), t);
        }
        if profile {
            let mut by: Vec<_> = stats.op_seconds.iter().collect();
            by.sort_by(|a, b| b.1.total_cmp(a.1));
            let total: f64 = by.iter().map(|(_, s)| **s).sum();
            let top: Vec<String> = by
                .iter()
                .take(8)
                .map(|(op, s)| format!("{op} {:.1}", *s * 1e3))
                .collect();
            slowest.sort_by(|a, b| b.0.total_cmp(&a.0));
            let nodes: Vec<String> = slowest
                .iter()
                .take(6)
                .map(|(s, id)| {
                    let n = p.node(*id);
                    format!("{id} {} -> {} {:.1}", n.op.name(), n.ty, s * 1e3)
                })
                .collect();
            eprintln!(
                "petite-reference profile: {} nodes, {:.1} ms: {} (ms); slowest: {}",
                stats.nodes_run,
                total * 1e3,
                top.join(", "),
                nodes.join(", ")
            );
        }
        Ok((out, stats))
    }

    /// Gives back the pages of weight node `v`: the whole tensor, or only its row range's bytes
    /// (other row ranges of the same tensor may still be read, here or by a later engine).
    fn release_weight(&self, v: NodeId, name: &str, rows: Option<[usize; 2]>) -> Result<()> {
        let tensor_err = |e: petite_weights::Error| Error::Tensor(e.to_string());
        let Some(_) = rows else {
            return self.weights.release(&[name]).map_err(tensor_err);
        };
        let info = self.weights.info(name).map_err(tensor_err)?;
        let w = self
            .program
            .weights()
            .into_iter()
            .find(|w| w.node == v)
            .ok_or_else(|| Error::Tensor(format!("{v} is not a weight")))?;
        let range = w
            .stored_range(info.dtype.size())
            .ok_or_else(|| Error::Tensor(format!("weight {name:?}: byte range overflows")))?;
        self.weights
            .release_range(name, range.start, range.end)
            .map_err(tensor_err)
    }

    fn node_err(&self, id: NodeId, e: Error) -> Error {
        match e {
            Error::Node { .. } => e,
            other => Error::Node {
                node: self.program.describe(id),
                message: other.to_string(),
            },
        }
    }

    fn check_type(&self, id: NodeId, out: &Slot) -> Result<()> {
        let want = &self.program.node(id).ty;
        let ok = match out {
            Slot::Tensor(t) => want.admits_tensor(t.dtype(), t.shape()),
            Slot::Tuple(ts) => want.admits_tuple(ts.iter().map(|t| (t.dtype(), t.shape()))),
            Slot::Weight => true,
            _ => false,
        };
        if ok {
            Ok(())
        } else {
            Err(Error::Node {
                node: self.program.describe(id),
                message: format!("executor produced a value that is not the declared {want}"),
            })
        }
    }
}

/// Everything one node's evaluation sees.
struct Ctx<'e, 'a> {
    ex: &'e Executor<'a>,
    slots: &'e mut Vec<Slot>,
    remaining: &'e [u32],
    id: NodeId,
}

fn err(msg: impl Into<String>) -> Error {
    Error::Tensor(msg.into())
}

fn tensor_type(p: &Program, v: NodeId) -> Result<&TensorType> {
    p.node(v)
        .tensor()
        .ok_or_else(|| err(format!("{v} is a tuple where a tensor is needed")))
}

/// Converts a weight view to f32 values as the program declares it: stored f32 declared bf16
/// is rounded to bf16 (nearest even) first; bf16/f16 storage is widened exactly.
fn view_to_f32<'v>(bytes: &'v [u8], stored: Dtype, declared: Dtype) -> Result<Cow<'v, [f32]>> {
    const CHUNK: usize = 1 << 16;
    let mut out: Vec<f32>;
    match stored {
        Dtype::F32 => {
            if declared == Dtype::F32
                && let Ok(s) = bytemuck::try_cast_slice::<u8, f32>(bytes)
            {
                return Ok(Cow::Borrowed(s));
            }
            out = vec![0.0; bytes.len() / 4];
            out.par_chunks_mut(CHUNK)
                .zip(bytes.par_chunks(CHUNK * 4))
                .for_each(|(o, b)| {
                    for (x, c) in o.iter_mut().zip(b.chunks_exact(4)) {
                        *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                });
        }
        Dtype::Bf16 => {
            out = vec![0.0; bytes.len() / 2];
            out.par_chunks_mut(CHUNK)
                .zip(bytes.par_chunks(CHUNK * 2))
                .for_each(|(o, b)| {
                    for (x, c) in o.iter_mut().zip(b.chunks_exact(2)) {
                        *x = bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]]));
                    }
                });
        }
        Dtype::F16 => {
            out = bytes
                .chunks_exact(2)
                .map(|c| petite_dtype::f16_bits_to_f32(u16::from_le_bytes([c[0], c[1]])))
                .collect();
        }
        other => {
            return Err(err(format!(
                "stored as {} but declared {declared}; only float weights convert",
                other.safetensors_name()
            )));
        }
    }
    match (declared, stored) {
        (Dtype::Bf16, Dtype::Bf16) | (Dtype::F16, Dtype::F16) | (Dtype::F32, _) => {}
        (Dtype::Bf16, _) => out
            .par_chunks_mut(CHUNK)
            .for_each(|c| c.iter_mut().for_each(|x| *x = round_through_bf16(*x))),
        (Dtype::F16, _) => out.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32()),
        (d, _) => return Err(err(format!("declared {d}, which is not a float dtype"))),
    }
    Ok(Cow::Owned(out))
}

macro_rules! with_data {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            Data::F32($v) => Data::F32($body),
            Data::Bf16($v) => Data::Bf16($body),
            Data::F16($v) => Data::F16($body),
            Data::I64($v) => Data::I64($body),
            Data::I32($v) => Data::I32($body),
            Data::U8($v) => Data::U8($body),
            Data::Bool($v) => Data::Bool($body),
            Data::I8($v) => Data::I8($body),
            Data::F8E4M3($v) => Data::F8E4M3($body),
        }
    };
}

impl<'a> Ctx<'_, 'a> {
    fn p(&self) -> &'a Program {
        self.ex.program
    }

    fn input(&self, i: usize) -> NodeId {
        self.p().node(self.id).inputs[i]
    }

    fn ty(&self, i: usize) -> Result<&TensorType> {
        tensor_type(self.ex.program, self.input(i))
    }

    fn out_ty(&self) -> Result<&TensorType> {
        tensor_type(self.ex.program, self.id)
    }

    /// True if this node is the last reader of input `i` and reads it once: it may be moved.
    fn can_take(&self, i: usize) -> bool {
        let v = self.input(i);
        let node = self.p().node(self.id);
        self.remaining[v.index()] == 1
            && !self.ex.is_output[v.index()]
            && node.inputs.iter().filter(|&&x| x == v).count() == 1
    }

    fn weight_view(&self, v: NodeId) -> Result<(petite_weights::TensorView<'_>, &TensorType)> {
        let Op::Weight { name, rows } = &self.p().node(v).op else {
            return Err(err(format!("{v} is not a weight")));
        };
        let declared = tensor_type(self.ex.program, v)?;
        let view = self
            .ex
            .weights
            .tensor(name)
            .map_err(|e| err(format!("weight {name:?}: {e}")))?;
        if let &Some([start, end]) = rows {
            return row_view(view, declared, start, end);
        }
        if view.bytes.len() != view.numel().saturating_mul(view.dtype.size()) {
            return Err(err(format!(
                "weight {name:?}: source returned {} bytes for {} {}",
                view.bytes.len(),
                view.dtype.safetensors_name(),
                ShapeDisplay(view.shape)
            )));
        }
        if view.shape != declared.shape.as_slice() {
            return Err(err(format!(
                "weight {name:?}: declared {declared}, stored with shape {}",
                ShapeDisplay(view.shape)
            )));
        }
        Ok((view, declared))
    }

    fn weight_f32(&self, v: NodeId) -> Result<Cow<'_, [f32]>> {
        let (view, declared) = self.weight_view(v)?;
        view_to_f32(view.bytes, view.dtype, declared.dtype)
            .map_err(|e| err(format!("weight {:?}: {e}", view.name)))
    }

    /// The stored bits of `v` when it is a weight stored and declared bf16 (and 2-byte
    /// aligned in its file): a product can widen them itself, with no f32 copy.
    fn bf16_weight_bits(&self, v: NodeId) -> Result<Option<&[u16]>> {
        if !matches!(self.slots[v.index()], Slot::Weight) {
            return Ok(None);
        }
        let (view, declared) = self.weight_view(v)?;
        if view.dtype != Dtype::Bf16 || declared.dtype != Dtype::Bf16 {
            return Ok(None);
        }
        Ok(bytemuck::try_cast_slice::<u8, u16>(view.bytes).ok())
    }

    fn weight_tensor(&self, v: NodeId) -> Result<Tensor> {
        let (view, declared) = self.weight_view(v)?;
        if declared.dtype.is_float() {
            let vals = view_to_f32(view.bytes, view.dtype, declared.dtype)?;
            return Tensor::from_f32_as(declared.dtype, &declared.shape, vals.into_owned());
        }
        if view.dtype != declared.dtype {
            return Err(err(format!(
                "weight {:?}: declared {declared}, stored as {}",
                view.name,
                view.dtype.safetensors_name()
            )));
        }
        Tensor::from_bytes(declared.dtype, &declared.shape, view.bytes)
    }

    /// Input `i` as f32 values (borrowed when possible).
    fn floats(&self, i: usize) -> Result<Cow<'_, [f32]>> {
        let v = self.input(i);
        match &self.slots[v.index()] {
            Slot::Tensor(t) => t.float_values().ok_or_else(|| {
                err(format!(
                    "input {i}: expected a float tensor, found {}",
                    t.dtype()
                ))
            }),
            Slot::Weight => self.weight_f32(v),
            _ => Err(err(format!("input {i} ({v}) is not available"))),
        }
    }

    /// Input `i` as owned f32 values (moved out when this is its last use).
    fn take_floats(&mut self, i: usize) -> Result<Vec<f32>> {
        if self.can_take(i) {
            let v = self.input(i);
            if let Slot::Tensor(_) = &self.slots[v.index()]
                && let Slot::Tensor(t) = std::mem::replace(&mut self.slots[v.index()], Slot::Empty)
            {
                return t.into_float_values().map_err(|t| {
                    err(format!(
                        "input {i}: expected a float tensor, found {}",
                        t.dtype()
                    ))
                });
            }
        }
        Ok(self.floats(i)?.into_owned())
    }

    /// Input `i` as a tensor (borrowed unless it is a weight, which is materialised).
    fn tensor(&self, i: usize) -> Result<Cow<'_, Tensor>> {
        let v = self.input(i);
        match &self.slots[v.index()] {
            Slot::Tensor(t) => Ok(Cow::Borrowed(t)),
            Slot::Weight => Ok(Cow::Owned(self.weight_tensor(v)?)),
            _ => Err(err(format!("input {i} ({v}) is not a tensor"))),
        }
    }

    fn take_tensor(&mut self, i: usize) -> Result<Tensor> {
        if self.can_take(i) {
            let v = self.input(i);
            if let Slot::Tensor(_) = &self.slots[v.index()]
                && let Slot::Tensor(t) = std::mem::replace(&mut self.slots[v.index()], Slot::Empty)
            {
                return Ok(t);
            }
        }
        Ok(self.tensor(i)?.into_owned())
    }

    fn finish_float(&self, v: Vec<f32>) -> Result<Slot> {
        let t = self.out_ty()?;
        Ok(Slot::Tensor(Tensor::from_f32_as(t.dtype, &t.shape, v)?))
    }

    /// Evaluates the current node: dispatch to its op family's kernels.
    fn eval(&mut self) -> Result<Slot> {
        let op = &self.p().node(self.id).op;
        match op {
            Op::Input { .. } | Op::Weight { .. } | Op::Constant { .. } => self.eval_sources(op),
            Op::Linear | Op::MatMul | Op::Conv2d { .. } => self.eval_dense(op),
            Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
            | Op::Softmax { .. }
            | Op::Rope
            | Op::Attention { .. }
            | Op::Embedding => self.eval_attention(op),
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
            | Op::Reduce { .. } => self.eval_elementwise(op),
            Op::Concat { .. }
            | Op::Slice { .. }
            | Op::Reshape { .. }
            | Op::Permute { .. }
            | Op::Expand { .. }
            | Op::Split { .. }
            | Op::GetItem { .. } => self.eval_layout(op),
        }
    }

    /// Graph sources: inputs (bound before the run), weights (read lazily by their consumers),
    /// inline constants.
    fn eval_sources(&mut self, op: &Op) -> Result<Slot> {
        match op {
            Op::Input { .. } => Err(err("inputs are bound before the run")),
            Op::Weight { .. } => Ok(Slot::Weight),
            Op::Constant { data } => {
                let t = self.out_ty()?;
                Ok(Slot::Tensor(Tensor::from_bytes(t.dtype, &t.shape, data)?))
            }
            other => Err(err(format!("{} is not a sources op", other.name()))),
        }
    }

    /// Dense products: linear layers, batched matmuls, the patch-embedding convolution.
    fn eval_dense(&mut self, op: &Op) -> Result<Slot> {
        let n_in = self.p().node(self.id).inputs.len();
        match op {
            Op::Linear => {
                let xt = self.ty(0)?;
                let wt = self.ty(1)?;
                let n = wt.shape[0];
                let rows: usize = xt.shape[..xt.rank() - 1].iter().product();
                let x = self.floats(0)?;
                let b = if n_in == 3 {
                    Some(self.floats(2)?)
                } else {
                    None
                };
                let any_order = !self.ex.exact_bf16 && xt.dtype == Dtype::Bf16;
                let y = match self.bf16_weight_bits(self.input(1))? {
                    Some(bits) if any_order => {
                        kernels::linear_bf16_any_order(&x, rows, bits, n, b.as_deref())?
                    }
                    Some(bits) => kernels::linear_bf16(&x, rows, bits, n, b.as_deref())?,
                    None => kernels::linear(&x, rows, &self.floats(1)?, n, b.as_deref())?,
                };
                self.finish_float(y)
            }
            Op::MatMul => {
                let (at, bt) = (self.ty(0)?.clone(), self.ty(1)?.clone());
                let (ra, rb) = (at.rank(), bt.rank());
                let (m, k, n) = (at.shape[ra - 2], at.shape[ra - 1], bt.shape[rb - 1]);
                let out_t = self.out_ty()?.clone();
                let ob = &out_t.shape[..out_t.rank() - 2];
                let sa = kernels::broadcast_strides(&at.shape[..ra - 2], ob)?;
                let sb = kernels::broadcast_strides(&bt.shape[..rb - 2], ob)?;
                let nb: usize = ob.iter().product();
                let (mut ao, mut bo) = (Vec::with_capacity(nb), Vec::with_capacity(nb));
                for i in 0..nb {
                    let (mut rem, mut oa, mut obb) = (i, 0, 0);
                    for d in (0..ob.len()).rev() {
                        let ix = rem % ob[d];
                        rem /= ob[d];
                        oa += ix * sa[d];
                        obb += ix * sb[d];
                    }
                    ao.push(oa * m * k);
                    bo.push(obb * k * n);
                }
                let a = self.floats(0)?;
                let b = self.floats(1)?;
                let y = kernels::matmul_batched(&a, &ao, &b, &bo, m, k, n)?;
                self.finish_float(y)
            }
            Op::Conv2d { stride, padding } => {
                let (xt, wt) = (self.ty(0)?, self.ty(1)?);
                let params = Conv2dParams {
                    n: xt.shape[0],
                    c: xt.shape[1],
                    h: xt.shape[2],
                    w: xt.shape[3],
                    o: wt.shape[0],
                    kh: wt.shape[2],
                    kw: wt.shape[3],
                    stride: *stride,
                    padding: *padding,
                };
                let x = self.floats(0)?;
                let w = self.floats(1)?;
                let b = if n_in == 3 {
                    Some(self.floats(2)?)
                } else {
                    None
                };
                let y = kernels::conv2d(&x, &w, b.as_deref(), params)?;
                self.finish_float(y)
            }
            other => Err(err(format!("{} is not a dense op", other.name()))),
        }
    }

    /// Normalisations, attention and its parts (softmax, rotary embedding, SDPA) and embedding
    /// lookups.
    fn eval_attention(&mut self, op: &Op) -> Result<Slot> {
        let n_in = self.p().node(self.id).inputs.len();
        match op {
            Op::LayerNorm { eps } => {
                let d = *self.ty(0)?.shape.last().unwrap_or(&1);
                let w = self.floats(1)?.into_owned();
                let b = self.floats(2)?.into_owned();
                let mut x = self.take_floats(0)?;
                kernels::layer_norm(&mut x, d, Some(&w), Some(&b), *eps as f32)?;
                self.finish_float(x)
            }
            Op::RmsNorm { eps } => {
                let d = *self.ty(0)?.shape.last().unwrap_or(&1);
                let w = if n_in == 2 {
                    Some(self.floats(1)?.into_owned())
                } else {
                    None
                };
                let mut x = self.take_floats(0)?;
                kernels::rms_norm(&mut x, d, w.as_deref(), 1.0, *eps as f32)?;
                self.finish_float(x)
            }
            Op::Softmax { axis } => {
                let xt = self.ty(0)?.clone();
                let r = xt.rank();
                let mut x = self.take_floats(0)?;
                if *axis + 1 == r {
                    kernels::softmax_lastdim(&mut x, xt.shape[r - 1])?;
                } else {
                    let mut perm: Vec<usize> = (0..r).filter(|&d| d != *axis).collect();
                    perm.push(*axis);
                    let (mut y, ys) = kernels::permute(&x, &xt.shape, &perm)?;
                    kernels::softmax_lastdim(&mut y, xt.shape[*axis])?;
                    let mut inv = vec![0; r];
                    for (i, &p) in perm.iter().enumerate() {
                        inv[p] = i;
                    }
                    x = kernels::permute(&y, &ys, &inv)?.0;
                }
                self.finish_float(x)
            }
            Op::Rope => {
                let xs = self.ty(0)?.shape.clone();
                let (cs, ss) = (self.ty(1)?.shape.clone(), self.ty(2)?.shape.clone());
                let c = self.floats(1)?.into_owned();
                let s = self.floats(2)?.into_owned();
                let mut x = self.take_floats(0)?;
                kernels::rotary_halves(&mut x, &xs, (&c, &cs), (&s, &ss))?;
                self.finish_float(x)
            }
            Op::Attention { scale } => {
                let (qt, kt, vt) = (self.ty(0)?, self.ty(1)?, self.ty(2)?);
                let shape = SdpaShape {
                    b: qt.shape[0],
                    h: qt.shape[1],
                    kvh: kt.shape[1],
                    sq: qt.shape[2],
                    sk: kt.shape[2],
                    d: qt.shape[3],
                    dv: vt.shape[3],
                };
                let mask_dims = if n_in == 4 {
                    let ms = &self.ty(3)?.shape;
                    let mut dims = [1usize; 4];
                    dims[4 - ms.len()..].copy_from_slice(ms);
                    Some(dims)
                } else {
                    None
                };
                let q = self.floats(0)?;
                let k = self.floats(1)?;
                let v = self.floats(2)?;
                let m = if n_in == 4 {
                    Some(self.floats(3)?)
                } else {
                    None
                };
                let mask = m.as_deref().zip(mask_dims);
                let y = kernels::sdpa(&q, &k, &v, mask, shape, *scale as f32, false)?;
                self.finish_float(y)
            }
            Op::Embedding => self.embedding(),
            other => Err(err(format!(
                "{} is not a normalisation or attention op",
                other.name()
            ))),
        }
    }

    /// Elementwise maps (arithmetic, comparisons, logic, casts, select), scans and reductions.
    fn eval_elementwise(&mut self, op: &Op) -> Result<Slot> {
        match op {
            Op::Binary { kind } => self.binary(*kind),
            Op::BinaryScalar {
                kind,
                scalar,
                scalar_lhs,
            } => self.binary_scalar(*kind, *scalar, *scalar_lhs),
            Op::Compare { kind } => self.compare(*kind),
            Op::Logical { kind } => {
                let (a, b) = (self.tensor(0)?, self.tensor(1)?);
                let (Data::Bool(x), Data::Bool(y)) = (a.data(), b.data()) else {
                    return Err(err("logical ops need bool inputs"));
                };
                let f = match kind {
                    LogicalOp::And => |p: bool, q: bool| p && q,
                    LogicalOp::Or => |p: bool, q: bool| p || q,
                };
                let (o, s) = kernels::map_binary(x, a.shape(), y, b.shape(), f)?;
                Ok(Slot::Tensor(Tensor::bool(&s, o)?))
            }
            Op::Not => {
                let t = self.take_tensor(0)?;
                let (shape, data) = t.into_parts();
                let Data::Bool(mut v) = data else {
                    return Err(err("not needs a bool input"));
                };
                v.iter_mut().for_each(|b| *b = !*b);
                Ok(Slot::Tensor(Tensor::bool(&shape, v)?))
            }
            Op::Unary { kind } => self.unary(*kind),
            Op::Cast { to } => {
                let t = self.take_tensor(0)?;
                Ok(Slot::Tensor(cast(t, *to)?))
            }
            Op::Dequantize { to } => {
                let c = self.tensor(0)?;
                let s = self.tensor(1)?;
                let scale = s
                    .as_f32()
                    .ok_or_else(|| err("dequantize: the scale must be f32"))?;
                Ok(Slot::Tensor(dequantize(&c, scale, *to)?))
            }
            Op::Where => {
                let c = self.tensor(0)?;
                let a = self.tensor(1)?;
                let b = self.tensor(2)?;
                let Data::Bool(cv) = c.data() else {
                    return Err(err("where: condition must be bool"));
                };
                let out_shape: Vec<usize>;
                macro_rules! sel {
                    ($var:ident) => {{
                        let Data::$var(bv) = b.data() else {
                            return Err(err("where: branches differ in dtype"));
                        };
                        let Data::$var(av) = a.data() else {
                            unreachable!()
                        };
                        let (o, s) = kernels::map_ternary(
                            (cv, c.shape()),
                            (av, a.shape()),
                            (bv, b.shape()),
                            |c, x, y| if c { x } else { y },
                        )?;
                        out_shape = s;
                        Data::$var(o)
                    }};
                }
                let data = match a.dtype() {
                    Dtype::F32 => sel!(F32),
                    Dtype::Bf16 => sel!(Bf16),
                    Dtype::F16 => sel!(F16),
                    Dtype::I64 => sel!(I64),
                    Dtype::I32 => sel!(I32),
                    Dtype::U8 => sel!(U8),
                    Dtype::Bool => sel!(Bool),
                    Dtype::I8 => sel!(I8),
                    Dtype::F8E4M3 => sel!(F8E4M3),
                };
                Ok(Slot::Tensor(Tensor::new(&out_shape, data)?))
            }
            Op::CumSum { axis } => {
                let t = self.tensor(0)?;
                let shape = t.shape().to_vec();
                let out = match t.data() {
                    Data::I64(v) => Data::I64(kernels::cumsum_i64(v, &shape, *axis)?),
                    Data::I32(v) => {
                        let w: Vec<i64> = v.iter().map(|&x| x as i64).collect();
                        Data::I32(
                            kernels::cumsum_i64(&w, &shape, *axis)?
                                .into_iter()
                                .map(|x| x as i32)
                                .collect(),
                        )
                    }
                    Data::U8(v) => {
                        let w: Vec<i64> = v.iter().map(|&x| x as i64).collect();
                        Data::U8(
                            kernels::cumsum_i64(&w, &shape, *axis)?
                                .into_iter()
                                .map(|x| x as u8)
                                .collect(),
                        )
                    }
                    Data::Bool(_) => return Err(err("cumsum of bool (cast first)")),
                    _ => {
                        let x = t.float_values().unwrap_or_default();
                        let y = kernels::cumsum_f32(&x, &shape, *axis)?;
                        return self.finish_float(y);
                    }
                };
                Ok(Slot::Tensor(Tensor::new(&shape, out)?))
            }
            Op::Reduce { kind, axes, .. } => self.reduce(*kind, axes),
            other => Err(err(format!("{} is not a elementwise op", other.name()))),
        }
    }

    /// Layout: concatenation, slicing, reshapes, permutations, broadcasts, splits and tuple
    /// access.
    fn eval_layout(&mut self, op: &Op) -> Result<Slot> {
        let n_in = self.p().node(self.id).inputs.len();
        match op {
            Op::Concat { axis } => {
                let ts: Vec<Cow<'_, Tensor>> =
                    (0..n_in).map(|i| self.tensor(i)).collect::<Result<_>>()?;
                macro_rules! cat {
                    ($var:ident) => {{
                        let parts = ts
                            .iter()
                            .map(|t| match t.data() {
                                Data::$var(v) => Ok((v.as_slice(), t.shape())),
                                _ => Err(err("concat inputs differ in dtype")),
                            })
                            .collect::<Result<Vec<_>>>()?;
                        let (o, s) = kernels::concat(&parts, *axis)?;
                        Tensor::new(&s, Data::$var(o))?
                    }};
                }
                let t = match ts[0].dtype() {
                    Dtype::F32 => cat!(F32),
                    Dtype::Bf16 => cat!(Bf16),
                    Dtype::F16 => cat!(F16),
                    Dtype::I64 => cat!(I64),
                    Dtype::I32 => cat!(I32),
                    Dtype::U8 => cat!(U8),
                    Dtype::Bool => cat!(Bool),
                    Dtype::I8 => cat!(I8),
                    Dtype::F8E4M3 => cat!(F8E4M3),
                };
                Ok(Slot::Tensor(t))
            }
            Op::Slice {
                axis,
                start,
                end,
                step,
            } => {
                let t = self.tensor(0)?;
                let shape = t.shape().to_vec();
                let out_shape: Vec<usize>;
                let data = with_data!(t.data(), v => {
                    let (o, s) = kernels::slice_axis(v, &shape, *axis, *start, *end, *step)?;
                    out_shape = s;
                    o
                });
                Ok(Slot::Tensor(Tensor::new(&out_shape, data)?))
            }
            Op::Reshape { shape } => Ok(Slot::Tensor(self.take_tensor(0)?.reshape(shape)?)),
            Op::Permute { perm } => {
                let t = self.tensor(0)?;
                let shape = t.shape().to_vec();
                let out_shape: Vec<usize>;
                let data = with_data!(t.data(), v => {
                    let (o, s) = kernels::permute(v, &shape, perm)?;
                    out_shape = s;
                    o
                });
                Ok(Slot::Tensor(Tensor::new(&out_shape, data)?))
            }
            Op::Expand { shape } => {
                let t = self.tensor(0)?;
                let data = with_data!(t.data(), v => kernels::broadcast_to(v, t.shape(), shape)?);
                Ok(Slot::Tensor(Tensor::new(shape, data)?))
            }
            Op::Split { axis, sizes } => {
                let t = self.tensor(0)?;
                let shape = t.shape().to_vec();
                let mut pieces = Vec::with_capacity(sizes.len());
                let mut start = 0;
                for &len in sizes {
                    let s_out: Vec<usize>;
                    let data = with_data!(t.data(), v => {
                        let (o, s) = kernels::slice_axis(v, &shape, *axis, start, start + len, 1)?;
                        s_out = s;
                        o
                    });
                    pieces.push(Tensor::new(&s_out, data)?);
                    start += len;
                }
                Ok(Slot::Tuple(pieces))
            }
            Op::GetItem { index } => {
                let v = self.input(0);
                // The tuple's last reader moves its piece out instead of copying it.
                if self.can_take(0)
                    && let Slot::Tuple(ts) = &mut self.slots[v.index()]
                    && *index < ts.len()
                {
                    let piece = std::mem::replace(&mut ts[*index], Tensor::f32(&[0], Vec::new())?);
                    return Ok(Slot::Tensor(piece));
                }
                match &self.slots[v.index()] {
                    Slot::Tuple(ts) => ts
                        .get(*index)
                        .cloned()
                        .map(Slot::Tensor)
                        .ok_or_else(|| err(format!("tuple has no element {index}"))),
                    _ => Err(err("getitem input is not a tuple")),
                }
            }
            other => Err(err(format!("{} is not a layout op", other.name()))),
        }
    }
    fn binary(&mut self, kind: BinaryOp) -> Result<Slot> {
        let at = self.ty(0)?.clone();
        let bt = self.ty(1)?.clone();
        if at.dtype == Dtype::Bf16 && bt.dtype == Dtype::Bf16 && self.out_ty()?.dtype == Dtype::Bf16
        {
            // One pass over the bf16 values: each widened, combined in f32 and rounded, as
            // the path below does through f32 copies of both operands and of the result
            // (the same bits; bf16 programs' products and residuals spent ~1 s of a
            // full-size verify in those copies).
            let (a, b) = (self.tensor(0)?, self.tensor(1)?);
            if let (Data::Bf16(x), Data::Bf16(y)) = (a.data(), b.data()) {
                // Generic over the arithmetic, so each kind's loop has it inlined.
                fn map(
                    (x, xs): (&[bf16], &[usize]),
                    (y, ys): (&[bf16], &[usize]),
                    f: impl Fn(f32, f32) -> f32 + Sync,
                ) -> Result<(Vec<bf16>, Vec<usize>)> {
                    let w = |v: bf16| bf16_bits_to_f32(v.to_bits());
                    kernels::map_binary(x, xs, y, ys, |p, q| to_bf16(f(w(p), w(q))))
                }
                let (l, r) = ((x.as_slice(), &at.shape[..]), (y.as_slice(), &bt.shape[..]));
                let (o, shape) = match kind {
                    BinaryOp::Add => map(l, r, |p, q| p + q),
                    BinaryOp::Sub => map(l, r, |p, q| p - q),
                    BinaryOp::Mul => map(l, r, |p, q| p * q),
                    BinaryOp::Div => map(l, r, |p, q| p / q),
                }?;
                return Ok(Slot::Tensor(Tensor::new(&shape, Data::Bf16(o))?));
            }
        }
        if at.dtype.is_float() {
            let a = self.floats(0)?;
            let b = self.floats(1)?;
            let f = match kind {
                BinaryOp::Add => |x: f32, y: f32| x + y,
                BinaryOp::Sub => |x: f32, y: f32| x - y,
                BinaryOp::Mul => |x: f32, y: f32| x * y,
                BinaryOp::Div => |x: f32, y: f32| x / y,
            };
            let (o, _) = kernels::map_binary(&a, &at.shape, &b, &bt.shape, f)?;
            return self.finish_float(o);
        }
        let (a, b) = (self.tensor(0)?, self.tensor(1)?);
        macro_rules! int {
            ($var:ident, $t:ty) => {{
                let (Data::$var(x), Data::$var(y)) = (a.data(), b.data()) else {
                    return Err(err("binary operands differ in dtype"));
                };
                let f = match kind {
                    BinaryOp::Add => |p: $t, q: $t| p.wrapping_add(q),
                    BinaryOp::Sub => |p: $t, q: $t| p.wrapping_sub(q),
                    BinaryOp::Mul => |p: $t, q: $t| p.wrapping_mul(q),
                    BinaryOp::Div => return Err(err("integer division is not defined")),
                };
                let (o, s) = kernels::map_binary(x, a.shape(), y, b.shape(), f)?;
                Tensor::new(&s, Data::$var(o))?
            }};
        }
        let t = match at.dtype {
            Dtype::I64 => int!(I64, i64),
            Dtype::I32 => int!(I32, i32),
            Dtype::U8 => int!(U8, u8),
            d => return Err(err(format!("binary arithmetic on {d}"))),
        };
        Ok(Slot::Tensor(t))
    }

    fn binary_scalar(&mut self, kind: BinaryOp, scalar: f64, lhs: bool) -> Result<Slot> {
        let dt = self.ty(0)?.dtype;
        if dt.is_float() {
            // The scalar is first converted to x's dtype.
            let s = match dt {
                Dtype::Bf16 => round_through_bf16(scalar as f32),
                Dtype::F16 => f16::from_f32(scalar as f32).to_f32(),
                _ => scalar as f32,
            };
            let mut x = self.take_floats(0)?;
            let f = |v: f32| {
                let (p, q) = if lhs { (s, v) } else { (v, s) };
                match kind {
                    BinaryOp::Add => p + q,
                    BinaryOp::Sub => p - q,
                    BinaryOp::Mul => p * q,
                    BinaryOp::Div => p / q,
                }
            };
            x.par_chunks_mut(1 << 15)
                .for_each(|c| c.iter_mut().for_each(|v| *v = f(*v)));
            return self.finish_float(x);
        }
        let t = self.take_tensor(0)?;
        let (shape, data) = t.into_parts();
        macro_rules! int {
            ($v:expr, $t:ty) => {{
                let s = scalar as $t;
                let mut v = $v;
                for x in v.iter_mut() {
                    let (p, q) = if lhs { (s, *x) } else { (*x, s) };
                    *x = match kind {
                        BinaryOp::Add => p.wrapping_add(q),
                        BinaryOp::Sub => p.wrapping_sub(q),
                        BinaryOp::Mul => p.wrapping_mul(q),
                        BinaryOp::Div => return Err(err("integer division is not defined")),
                    };
                }
                v
            }};
        }
        let data = match data {
            Data::I64(v) => Data::I64(int!(v, i64)),
            Data::I32(v) => Data::I32(int!(v, i32)),
            Data::U8(v) => Data::U8(int!(v, u8)),
            d => return Err(err(format!("scalar arithmetic on {}", d.dtype()))),
        };
        Ok(Slot::Tensor(Tensor::new(&shape, data)?))
    }

    fn compare(&mut self, kind: CompareOp) -> Result<Slot> {
        fn f<T: PartialOrd>(kind: CompareOp) -> impl Fn(T, T) -> bool + Sync {
            move |a, b| match kind {
                CompareOp::Lt => a < b,
                CompareOp::Le => a <= b,
                CompareOp::Eq => a == b,
                CompareOp::Ne => a != b,
                CompareOp::Gt => a > b,
                CompareOp::Ge => a >= b,
            }
        }
        let (a, b) = (self.tensor(0)?, self.tensor(1)?);
        let (o, s) = match (a.data(), b.data()) {
            (Data::I64(x), Data::I64(y)) => {
                kernels::map_binary(x, a.shape(), y, b.shape(), f(kind))?
            }
            (Data::I32(x), Data::I32(y)) => {
                kernels::map_binary(x, a.shape(), y, b.shape(), f(kind))?
            }
            (Data::U8(x), Data::U8(y)) => kernels::map_binary(x, a.shape(), y, b.shape(), f(kind))?,
            (Data::Bool(x), Data::Bool(y)) => {
                kernels::map_binary(x, a.shape(), y, b.shape(), f(kind))?
            }
            _ if a.dtype() == b.dtype() && a.dtype().is_float() => {
                let (x, y) = (
                    a.float_values().unwrap_or_default(),
                    b.float_values().unwrap_or_default(),
                );
                kernels::map_binary(&x, a.shape(), &y, b.shape(), f(kind))?
            }
            _ => return Err(err("compare operands differ in dtype")),
        };
        Ok(Slot::Tensor(Tensor::bool(&s, o)?))
    }

    fn unary(&mut self, kind: UnaryOp) -> Result<Slot> {
        let dt = self.ty(0)?.dtype;
        if !dt.is_float() {
            if kind != UnaryOp::Neg {
                return Err(err(format!("unary op on {dt}")));
            }
            let t = self.take_tensor(0)?;
            let (shape, data) = t.into_parts();
            let data = match data {
                Data::I64(v) => Data::I64(v.into_iter().map(i64::wrapping_neg).collect()),
                Data::I32(v) => Data::I32(v.into_iter().map(i32::wrapping_neg).collect()),
                d => return Err(err(format!("neg of {}", d.dtype()))),
            };
            return Ok(Slot::Tensor(Tensor::new(&shape, data)?));
        }
        let mut x = self.take_floats(0)?;
        match kind {
            UnaryOp::GeluTanh => kernels::gelu_tanh(&mut x),
            UnaryOp::Silu => kernels::silu(&mut x),
            _ => {
                let f: fn(f32) -> f32 = match kind {
                    UnaryOp::Neg => |v| -v,
                    UnaryOp::Exp => f32::exp,
                    UnaryOp::Sqrt => f32::sqrt,
                    UnaryOp::Rsqrt => |v| 1.0 / v.sqrt(),
                    UnaryOp::Sin => f32::sin,
                    UnaryOp::Cos => f32::cos,
                    UnaryOp::Tanh => f32::tanh,
                    UnaryOp::GeluTanh => kernels::gelu_tanh_scalar,
                    UnaryOp::Silu => kernels::silu_scalar,
                };
                x.par_chunks_mut(1 << 15)
                    .for_each(|c| c.iter_mut().for_each(|v| *v = f(*v)));
            }
        }
        self.finish_float(x)
    }

    fn embedding(&mut self) -> Result<Slot> {
        let it = self.tensor(1)?;
        let idx: Vec<i64> = match it.data() {
            Data::I64(v) => v.clone(),
            Data::I32(v) => v.iter().map(|&x| x as i64).collect(),
            d => {
                return Err(err(format!(
                    "indices must be i64 or i32, found {}",
                    d.dtype()
                )));
            }
        };
        drop(it);
        let tt = self.ty(0)?.clone();
        let (rows, d) = (tt.shape[0], tt.shape[1]);
        let table = self.input(0);
        if matches!(self.slots[table.index()], Slot::Weight) && tt.dtype.is_float() {
            // Read only the rows asked for, straight from the weight's bytes, all asked for
            // first (`MADV_WILLNEED`) so that rows still on disk are read at once, not one by one.
            let (view, declared) = self.weight_view(table)?;
            let es = view.dtype.size();
            if let Op::Weight { name, rows: sliced } = &self.p().node(table).op {
                let first = sliced.map_or(0, |[start, _]| start);
                let mut asked = idx.clone();
                asked.sort_unstable();
                asked.dedup();
                for &i in asked
                    .iter()
                    .filter(|&&i| i >= 0 && (i as u64) < rows as u64)
                {
                    let at = (first + i as usize) * d * es;
                    self.ex
                        .weights
                        .prefetch_range(name, at, at + d * es)
                        .map_err(|e| err(format!("weight {name:?}: {e}")))?;
                }
            }
            let mut out = Vec::with_capacity(idx.len() * d);
            for (pos, &i) in idx.iter().enumerate() {
                if i < 0 || i as u64 >= rows as u64 {
                    return Err(err(format!(
                        "index {i} at position {pos} is outside [0, {rows})"
                    )));
                }
                let r = i as usize;
                let bytes = &view.bytes[r * d * es..(r + 1) * d * es];
                out.extend_from_slice(&view_to_f32(bytes, view.dtype, declared.dtype)?);
            }
            return self.finish_float(out);
        }
        let t = self.tensor(0)?;
        let data = with_data!(t.data(), v => kernels::gather_rows(v, rows, d, &idx)?);
        let s = self.out_ty()?.shape.clone();
        Ok(Slot::Tensor(Tensor::new(&s, data)?))
    }

    fn reduce(&mut self, kind: ReduceOp, axes: &[usize]) -> Result<Slot> {
        let xt = self.ty(0)?.clone();
        let r = xt.rank();
        let mut perm: Vec<usize> = (0..r).filter(|d| !axes.contains(d)).collect();
        perm.extend_from_slice(axes);
        let n: usize = axes.iter().map(|&a| xt.shape[a]).product();
        let outer: usize = xt.numel() / n.max(1);
        let flat = [
            if n == 0 {
                perm.iter()
                    .take(r - axes.len())
                    .map(|&d| xt.shape[d])
                    .product()
            } else {
                outer
            },
            n,
        ];
        let t = self.tensor(0)?;
        let out_shape = self.out_ty()?.shape.clone();
        if xt.dtype.is_float() {
            let x = t.float_values().unwrap_or_default();
            let (y, _) = kernels::permute(&x, &xt.shape, &perm)?;
            let op = match kind {
                ReduceOp::Sum => Reduce::Sum,
                ReduceOp::Mean => Reduce::Mean,
                ReduceOp::Max => Reduce::Max,
            };
            let o = kernels::reduce_f32(&y, &flat, 1, op)?;
            drop(t);
            return self.finish_float(o);
        }
        macro_rules! int {
            ($v:expr, $var:ident) => {{
                let (y, _) = kernels::permute($v, &xt.shape, &perm)?;
                let mut o = Vec::with_capacity(flat[0]);
                for row in 0..flat[0] {
                    let s = &y[row * n..(row + 1) * n];
                    o.push(match kind {
                        ReduceOp::Sum => s.iter().fold(0, |a: _, &b| b.wrapping_add(a)),
                        ReduceOp::Max => *s
                            .iter()
                            .max()
                            .ok_or_else(|| err("max over an empty axis"))?,
                        ReduceOp::Mean => return Err(err("mean of integers")),
                    });
                }
                Data::$var(o)
            }};
        }
        let data = match t.data() {
            Data::I64(v) => int!(v, I64),
            Data::I32(v) => int!(v, I32),
            Data::U8(v) => int!(v, U8),
            d => return Err(err(format!("reduce of {}", d.dtype()))),
        };
        Ok(Slot::Tensor(Tensor::new(&out_shape, data)?))
    }
}

/// `Cast` semantics: float → bf16/f16 rounds to nearest even; float → int truncates toward
/// zero; anything → bool is `x != 0`; bool → number is 0 or 1.
pub fn cast(t: Tensor, to: Dtype) -> Result<Tensor> {
    if t.dtype() == to {
        return Ok(t);
    }
    if t.dtype().is_quant_code() || to.is_quant_code() {
        return Err(Error::Tensor(format!(
            "no cast from {} to {to}: quantized codes are only dequantized",
            t.dtype()
        )));
    }
    let (shape, data) = t.into_parts();
    enum Mid {
        F(Vec<f32>),
        I(Vec<i64>),
        B(Vec<bool>),
    }
    let mid = match data {
        Data::F32(v) => Mid::F(v),
        Data::Bf16(v) => Mid::F(v.iter().map(|x| bf16_bits_to_f32(x.to_bits())).collect()),
        Data::F16(v) => Mid::F(
            v.iter()
                .map(|x| petite_dtype::f16_bits_to_f32(x.to_bits()))
                .collect(),
        ),
        Data::I64(v) => Mid::I(v),
        Data::I32(v) => Mid::I(v.into_iter().map(i64::from).collect()),
        Data::U8(v) => Mid::I(v.into_iter().map(i64::from).collect()),
        Data::Bool(v) => Mid::B(v),
        Data::I8(_) | Data::F8E4M3(_) => unreachable!("refused above"),
    };
    let as_f32 = |m: &Mid| -> Vec<f32> {
        match m {
            Mid::F(v) => v.clone(),
            Mid::I(v) => v.iter().map(|&x| x as f32).collect(),
            Mid::B(v) => v.iter().map(|&b| if b { 1.0 } else { 0.0 }).collect(),
        }
    };
    let as_i64 = |m: &Mid| -> Vec<i64> {
        match m {
            Mid::F(v) => v.iter().map(|&x| x as i64).collect(),
            Mid::I(v) => v.clone(),
            Mid::B(v) => v.iter().map(|&b| b as i64).collect(),
        }
    };
    let data = match to {
        Dtype::F32 | Dtype::Bf16 | Dtype::F16 => {
            return Tensor::from_f32_as(to, &shape, as_f32(&mid));
        }
        Dtype::I64 => Data::I64(as_i64(&mid)),
        Dtype::I32 => Data::I32(match &mid {
            Mid::F(v) => v.iter().map(|&x| x as i32).collect(),
            m => as_i64(m).into_iter().map(|x| x as i32).collect(),
        }),
        Dtype::U8 => Data::U8(match &mid {
            Mid::F(v) => v.iter().map(|&x| x as u8).collect(),
            m => as_i64(m).into_iter().map(|x| x as u8).collect(),
        }),
        Dtype::Bool => Data::Bool(match mid {
            Mid::F(v) => v.iter().map(|&x| x != 0.0).collect(),
            Mid::I(v) => v.iter().map(|&x| x != 0).collect(),
            Mid::B(v) => v,
        }),
        Dtype::I8 | Dtype::F8E4M3 => unreachable!("refused above"),
    };
    Tensor::new(&shape, data)
}

/// `codes · scale[row]` in f32, rounded once to `to` ([`Op::Dequantize`]): each row of `codes`
/// (axis 0) times its scale, by [`petite_dtype::quant::Quant::dequantize`], written straight in
/// `to` (no f32 copy of the weight beside the result).
fn dequantize(codes: &Tensor, scale: &[f32], to: Dtype) -> Result<Tensor> {
    let err = |m: String| Error::Tensor(format!("dequantize: {m}"));
    let rows = *codes
        .shape()
        .first()
        .ok_or_else(|| err("codes of rank 0".into()))?;
    if scale.len() != rows {
        return Err(err(format!(
            "{} scales for {rows} rows of codes",
            scale.len()
        )));
    }
    let per = codes.numel().checked_div(rows).unwrap_or(0).max(1);
    let q = codes
        .dtype()
        .quant()
        .ok_or_else(|| err(format!("{} is not a quantized code dtype", codes.dtype())))?;
    /// Each row of `codes` (`per` codes, the code's byte by `byte`) times its scale, rounded by
    /// `round`.
    fn rows_as<C: Copy + Sync, T: Copy + Default + Send>(
        codes: &[C],
        byte: impl Fn(C) -> u8 + Send + Sync,
        per: usize,
        scale: &[f32],
        q: petite_dtype::quant::Quant,
        round: impl Fn(f32) -> T + Send + Sync,
    ) -> Vec<T> {
        let mut out = vec![T::default(); codes.len()];
        out.par_chunks_mut(per)
            .zip(codes.par_chunks(per))
            .zip(scale.par_iter())
            .for_each(|((o, c), &s)| {
                for (y, &b) in o.iter_mut().zip(c) {
                    *y = round(q.dequantize(byte(b), s));
                }
            });
        out
    }
    fn to_dtype<C: Copy + Sync>(
        codes: &[C],
        byte: impl Fn(C) -> u8 + Send + Sync,
        per: usize,
        scale: &[f32],
        q: petite_dtype::quant::Quant,
        to: Dtype,
    ) -> Option<Data> {
        Some(match to {
            Dtype::F32 => Data::F32(rows_as(codes, byte, per, scale, q, |x| x)),
            Dtype::Bf16 => Data::Bf16(rows_as(codes, byte, per, scale, q, to_bf16)),
            Dtype::F16 => Data::F16(rows_as(codes, byte, per, scale, q, f16::from_f32)),
            _ => return None,
        })
    }
    let data = match codes.data() {
        Data::I8(v) => to_dtype(v, |b| b as u8, per, scale, q, to),
        Data::F8E4M3(v) => to_dtype(v, |b| b, per, scale, q, to),
        _ => unreachable!("quant() is Some only for code dtypes"),
    }
    .ok_or_else(|| err(format!("to {to}: expected a float dtype")))?;
    Tensor::new(codes.shape(), data)
}

/// Convenience: builds an [`Executor`] and runs it once.
pub fn run(
    program: &Program,
    weights: &dyn WeightSource,
    inputs: BTreeMap<String, Tensor>,
) -> Result<BTreeMap<String, Tensor>> {
    Executor::new(program, weights)?.run(inputs)
}

/// Rows `start..end` of a stored tensor as a view shaped like the declared slice: one
/// contiguous byte range (row-major), no copy.
fn row_view<'a>(
    view: petite_weights::TensorView<'a>,
    declared: &'a TensorType,
    start: usize,
    end: usize,
) -> Result<(petite_weights::TensorView<'a>, &'a TensorType)> {
    let name = view.name;
    let stored_rows = view.shape.first().copied().unwrap_or(0);
    if view.shape.is_empty()
        || end > stored_rows
        || view.shape[1..] != declared.shape[1..]
        || declared.shape.first() != Some(&(end - start))
    {
        return Err(err(format!(
            "weight {name:?}: rows [{start}, {end}) declared {declared}, stored with shape {}",
            ShapeDisplay(view.shape)
        )));
    }
    let row_bytes = view.shape[1..].iter().product::<usize>() * view.dtype.size();
    if view.bytes.len() != stored_rows * row_bytes {
        return Err(err(format!(
            "weight {name:?}: source returned {} bytes for {} {}",
            view.bytes.len(),
            view.dtype.safetensors_name(),
            ShapeDisplay(view.shape)
        )));
    }
    Ok((
        petite_weights::TensorView {
            name,
            dtype: view.dtype,
            shape: &declared.shape,
            bytes: &view.bytes[start * row_bytes..end * row_bytes],
        },
        declared,
    ))
}
