//! Programs: nodes, graph inputs/outputs, validation, walks and analysis helpers.

use crate::dtype::{Dtype, TensorType, ValueType};
use crate::error::{Error, Result};
use crate::node::{NodeDesc, NodeId, ValueId};
use crate::op::Op;
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::fmt;

/// One operation and the value it produces.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Node {
    /// What the node computes (attributes included). Flattened in JSON:
    /// `{"op": "linear", "inputs": [..], "ty": ..}`.
    #[serde(flatten)]
    pub op: Op,
    /// Input values, in the order the op documents.
    pub inputs: Vec<ValueId>,
    /// Type of the produced value (declared for sources, inferred otherwise).
    pub ty: ValueType,
    /// Human label for messages and debugging (e.g. `language.layers.3.attn.q_proj`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// Partitioning hint: when this value is input-only (computed from program inputs and
    /// constants alone, like an attention mask or a rotary table), every engine that reads it
    /// recomputes it instead of receiving it across an engine boundary, whatever its size.
    /// Ignored on values that read weights. Absent from JSON when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub recompute: bool,
}

impl Node {
    /// The produced tensor type, or `None` for a tuple.
    pub fn tensor(&self) -> Option<&TensorType> {
        self.ty.tensor()
    }
}

/// A named graph output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GraphOutput {
    /// Unique output name.
    pub name: String,
    /// The tensor value returned.
    pub value: ValueId,
}

/// One `Weight` node of a name during validation: its row range and id.
type WeightUseRows = (Option<[usize; 2]>, NodeId);

/// A weight a program reads, as reported by [`Program::weights`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightInfo {
    /// The `Weight` node.
    pub node: NodeId,
    /// Checkpoint tensor name.
    pub name: String,
    /// Declared dtype.
    pub dtype: Dtype,
    /// Declared shape (the slice's when `rows` is set).
    pub shape: Vec<usize>,
    /// `numel × dtype size` of the declared shape: only the slice's bytes for a row range.
    pub bytes: usize,
    /// Row range `[start, end)` of the checkpoint tensor's axis 0, or `None` for all of it.
    pub rows: Option<[usize; 2]>,
}

impl WeightInfo {
    /// The byte range of this weight inside the checkpoint tensor's data when the checkpoint
    /// stores `stored_elem_size`-byte elements: everything for a whole weight (given the
    /// checkpoint's element count, which equals the declared one), the rows' contiguous bytes
    /// for a row range (row-major). `None` if it overflows.
    pub fn stored_range(&self, stored_elem_size: usize) -> Option<std::ops::Range<usize>> {
        let row: usize = self
            .shape
            .iter()
            .skip(1)
            .try_fold(1usize, |a, &d| a.checked_mul(d))?;
        let row_bytes = row.checked_mul(stored_elem_size)?;
        match self.rows {
            None => {
                let n = self
                    .shape
                    .iter()
                    .try_fold(1usize, |a, &d| a.checked_mul(d))?;
                Some(0..n.checked_mul(stored_elem_size)?)
            }
            Some([a, b]) => Some(a.checked_mul(row_bytes)?..b.checked_mul(row_bytes)?),
        }
    }

    /// `name` or `name[start..end]`, for messages and reports.
    pub fn display_name(&self) -> String {
        weight_display(&self.name, self.rows)
    }
}

/// `name` or `name[start..end]`: how messages name a (row range of a) weight.
pub fn weight_display(name: &str, rows: Option<[usize; 2]>) -> String {
    match rows {
        None => name.to_string(),
        Some([a, b]) => format!("{name}[{a}..{b}]"),
    }
}

/// A dataflow program: nodes (each producing one value), the ordered graph inputs and the named
/// graph outputs. Serialises deterministically (vectors only, no maps).
///
/// A program built by [`crate::Builder`] lists its nodes in a topological order; a deserialised
/// or hand-edited one need not, so consumers call [`Program::topo_order`] (or `validate`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Program {
    /// All nodes; `NodeId(i)` is `nodes[i]`.
    pub nodes: Vec<Node>,
    /// The `Input` nodes in call order (each appears exactly once).
    pub inputs: Vec<NodeId>,
    /// Named outputs in return order.
    pub outputs: Vec<GraphOutput>,
}

/// Result of [`Program::subprogram`]: the new program and how its ids map to the original's.
#[derive(Debug, Clone, PartialEq)]
pub struct SubProgram {
    /// The extracted, validated program.
    pub program: Program,
    /// For each node of `program` (by index), the original node it copies.
    pub original: Vec<NodeId>,
    /// For each graph input of `program` (in order), the original value it stands for.
    pub input_values: Vec<ValueId>,
    /// For each graph output of `program` (in order), the original value it returns.
    pub output_values: Vec<ValueId>,
}

impl Program {
    /// An empty program.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// True if there are no nodes.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The node with this id. Panics on an id from another program; use [`Program::get`] for
    /// untrusted ids.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id.index()]
    }

    /// The node with this id, if it exists.
    pub fn get(&self, id: NodeId) -> Option<&Node> {
        self.nodes.get(id.index())
    }

    /// Ids of all nodes in storage order.
    pub fn ids(&self) -> impl ExactSizeIterator<Item = NodeId> + '_ {
        (0..self.nodes.len() as u32).map(NodeId)
    }

    /// A node's description for messages (id, op, label). Out-of-range ids describe as `?`.
    pub fn describe(&self, id: NodeId) -> NodeDesc {
        match self.get(id) {
            Some(n) => NodeDesc {
                id,
                op: n.op.name(),
                label: n.label.clone(),
            },
            None => NodeDesc {
                id,
                op: "?",
                label: None,
            },
        }
    }

    /// Name of a graph input node (`None` if the node is not an `Input`).
    pub fn input_name(&self, id: NodeId) -> Option<&str> {
        match &self.get(id)?.op {
            Op::Input { name } => Some(name),
            _ => None,
        }
    }

    /// The graph input with this name.
    pub fn input_by_name(&self, name: &str) -> Option<NodeId> {
        self.inputs
            .iter()
            .copied()
            .find(|&i| self.input_name(i) == Some(name))
    }

    /// The graph output with this name.
    pub fn output_by_name(&self, name: &str) -> Option<ValueId> {
        self.outputs
            .iter()
            .find(|o| o.name == name)
            .map(|o| o.value)
    }

    /// For each value (indexed by node), the nodes that consume it: ascending, each consumer
    /// listed once even if it reads the value several times. Graph outputs are not nodes and
    /// are not listed. Ids that do not exist are ignored (validation reports them).
    pub fn consumers(&self) -> Vec<Vec<NodeId>> {
        let mut out: Vec<Vec<NodeId>> = vec![Vec::new(); self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            let me = NodeId(i as u32);
            for &v in &n.inputs {
                if let Some(list) = out.get_mut(v.index())
                    && list.last() != Some(&me)
                {
                    list.push(me);
                }
            }
        }
        out
    }

    /// The weights the program declares, in node order, with byte sizes.
    pub fn weights(&self) -> Vec<WeightInfo> {
        self.ids()
            .filter_map(|id| {
                let n = self.node(id);
                match (&n.op, n.tensor()) {
                    (Op::Weight { name, rows }, Some(t)) => Some(WeightInfo {
                        node: id,
                        name: name.clone(),
                        dtype: t.dtype,
                        shape: t.shape.clone(),
                        bytes: t.nbytes(),
                        rows: *rows,
                    }),
                    _ => None,
                }
            })
            .collect()
    }

    /// Sum of [`Program::weights`] byte sizes.
    pub fn weight_bytes(&self) -> usize {
        self.weights()
            .iter()
            .fold(0usize, |a, w| a.saturating_add(w.bytes))
    }

    /// A topological order of all nodes (every node after its inputs), iterative.
    ///
    /// If the stored order is already topological it is returned unchanged (the builder's
    /// case); otherwise Kahn's algorithm, smallest ready id first, so the result is
    /// deterministic. Errors on dangling inputs and cycles.
    pub fn topo_order(&self) -> Result<Vec<NodeId>> {
        self.check_dangling()?;
        let sorted = self
            .nodes
            .iter()
            .enumerate()
            .all(|(i, n)| n.inputs.iter().all(|v| v.index() < i));
        if sorted {
            return Ok(self.ids().collect());
        }
        let n = self.nodes.len();
        let consumers = self.consumers();
        let mut pending: Vec<usize> = self
            .nodes
            .iter()
            .map(|node| {
                let mut ins: Vec<NodeId> = node.inputs.clone();
                ins.sort_unstable();
                ins.dedup();
                ins.len()
            })
            .collect();
        let mut ready: BinaryHeap<Reverse<NodeId>> = self
            .ids()
            .filter(|id| pending[id.index()] == 0)
            .map(Reverse)
            .collect();
        let mut order = Vec::with_capacity(n);
        while let Some(Reverse(id)) = ready.pop() {
            order.push(id);
            for &c in &consumers[id.index()] {
                pending[c.index()] -= 1;
                if pending[c.index()] == 0 {
                    ready.push(Reverse(c));
                }
            }
        }
        if order.len() != n {
            let stuck = pending.iter().position(|&p| p > 0).unwrap_or(0);
            return Err(Error::Cycle {
                node: self.describe(NodeId(stuck as u32)),
                count: n - order.len(),
            });
        }
        Ok(order)
    }

    /// Marks every node the given values depend on (the values included), iteratively.
    /// Indexed by node. Ids that do not exist are ignored.
    pub fn ancestors(&self, roots: &[ValueId]) -> Vec<bool> {
        let mut seen = vec![false; self.nodes.len()];
        let mut stack: Vec<NodeId> = Vec::new();
        for &r in roots {
            if let Some(s) = seen.get_mut(r.index())
                && !*s
            {
                *s = true;
                stack.push(r);
            }
        }
        while let Some(id) = stack.pop() {
            for &v in &self.node(id).inputs {
                if let Some(s) = seen.get_mut(v.index())
                    && !*s
                {
                    *s = true;
                    stack.push(v);
                }
            }
        }
        seen
    }

    /// Nodes no graph output depends on (dead work), ascending. Graph inputs count as live.
    pub fn dead_nodes(&self) -> Vec<NodeId> {
        let roots: Vec<NodeId> = self.outputs.iter().map(|o| o.value).collect();
        let live = self.ancestors(&roots);
        self.ids()
            .filter(|&id| !live[id.index()] && !matches!(self.node(id).op, Op::Input { .. }))
            .collect()
    }

    fn check_dangling(&self) -> Result<()> {
        let len = self.nodes.len();
        for (i, n) in self.nodes.iter().enumerate() {
            for (index, &v) in n.inputs.iter().enumerate() {
                if v.index() >= len {
                    return Err(Error::DanglingValue {
                        node: self.describe(NodeId(i as u32)),
                        index,
                        value: v,
                        len,
                    });
                }
            }
        }
        Ok(())
    }

    /// Checks the whole program: ids in range, a DAG, every node's type equal to the type its
    /// op infers (shapes, dtypes, attributes), tuples consumed only by `getitem`, source
    /// nodes' declarations (constant byte counts, tensor types), unique input/output/weight
    /// names, `inputs` listing each `Input` node exactly once, outputs naming tensor values.
    /// Iterative; linear in the program size.
    pub fn validate(&self) -> Result<()> {
        let order = self.topo_order()?;
        for &id in &order {
            self.check_node(id)?;
        }
        self.check_interface()
    }

    /// Checks one node against its inputs (assumes the ids exist).
    fn check_node(&self, id: NodeId) -> Result<()> {
        let n = self.node(id);
        let mut tys: Vec<&ValueType> = Vec::with_capacity(n.inputs.len());
        for (index, &v) in n.inputs.iter().enumerate() {
            let p = self.node(v);
            if p.ty.is_tuple() && !matches!(n.op, Op::GetItem { .. }) {
                return Err(Error::TupleWithoutGetItem {
                    node: self.describe(id),
                    index,
                    producer: self.describe(v),
                });
            }
            tys.push(&p.ty);
        }
        let inferred = n.op.infer(&tys).map_err(|reason| Error::InvalidNode {
            node: self.describe(id),
            reason,
        })?;
        match inferred {
            Some(t) => {
                if t != n.ty {
                    return Err(Error::TypeMismatch {
                        node: self.describe(id),
                        stored: n.ty.clone(),
                        inferred: t,
                    });
                }
            }
            None => check_source(&n.op, &n.ty).map_err(|reason| Error::InvalidNode {
                node: self.describe(id),
                reason,
            })?,
        }
        Ok(())
    }

    /// Several `Weight` nodes share `name`: each must be a row range, the ranges disjoint, and
    /// all of one dtype and row shape (they are pieces of one checkpoint tensor).
    fn check_weight_rows(&self, name: &str, uses: &mut [WeightUseRows]) -> Result<()> {
        uses.sort_by_key(|&(r, id)| (r.map(|[a, b]| (a, b)), id));
        let row_type = |id: NodeId| {
            self.node(id)
                .tensor()
                .map(|t| (t.dtype, t.shape.get(1..).map(<[usize]>::to_vec)))
        };
        for w in uses.windows(2) {
            let ((r0, first), (r1, second)) = (w[0], w[1]);
            if r0 == r1 {
                return Err(Error::DuplicateName {
                    kind: "weight",
                    name: name.to_string(),
                    first,
                    second,
                });
            }
            let overlap = match (r0, r1) {
                (Some([_, e0]), Some([s1, _])) => s1 < e0,
                _ => true,
            };
            if overlap {
                return Err(Error::Interface {
                    kind: "weight",
                    name: name.to_string(),
                    reason: format!(
                        "{} ({}) and {} ({}) read overlapping rows; row ranges of one weight must be disjoint",
                        self.describe(first),
                        weight_display(name, r0),
                        self.describe(second),
                        weight_display(name, r1)
                    ),
                });
            }
            if row_type(first) != row_type(second) {
                return Err(Error::Interface {
                    kind: "weight",
                    name: name.to_string(),
                    reason: format!(
                        "{} and {} are row ranges of one tensor but declare different dtypes or row shapes",
                        self.describe(first),
                        self.describe(second)
                    ),
                });
            }
        }
        Ok(())
    }

    fn check_interface(&self) -> Result<()> {
        let mut listed: BTreeMap<&str, NodeId> = BTreeMap::new();
        let mut seen = vec![false; self.nodes.len()];
        for &i in &self.inputs {
            let name = match self.get(i).map(|n| &n.op) {
                Some(Op::Input { name }) => name.as_str(),
                _ => {
                    return Err(Error::Interface {
                        kind: "input",
                        name: i.to_string(),
                        reason: format!(
                            "listed in inputs but is {}, not an input node",
                            self.describe(i)
                        ),
                    });
                }
            };
            if let Some(&first) = listed.get(name) {
                return Err(Error::DuplicateName {
                    kind: "input",
                    name: name.to_string(),
                    first,
                    second: i,
                });
            }
            listed.insert(name, i);
            seen[i.index()] = true;
        }
        let mut weights: BTreeMap<&str, Vec<WeightUseRows>> = BTreeMap::new();
        for id in self.ids() {
            match &self.node(id).op {
                Op::Input { name } if !seen[id.index()] => {
                    return Err(Error::Interface {
                        kind: "input",
                        name: name.clone(),
                        reason: format!(
                            "{} is not listed in the program's inputs",
                            self.describe(id)
                        ),
                    });
                }
                Op::Weight { name, rows } => {
                    weights.entry(name).or_default().push((*rows, id));
                }
                _ => {}
            }
        }
        for (name, mut uses) in weights {
            if uses.len() > 1 {
                self.check_weight_rows(name, &mut uses)?;
            }
        }
        let mut outs: BTreeMap<&str, NodeId> = BTreeMap::new();
        for o in &self.outputs {
            match self.get(o.value) {
                None => {
                    return Err(Error::Interface {
                        kind: "output",
                        name: o.name.clone(),
                        reason: format!(
                            "refers to {}, which does not exist (the program has {} nodes)",
                            o.value,
                            self.nodes.len()
                        ),
                    });
                }
                Some(n) if n.ty.is_tuple() => {
                    return Err(Error::Interface {
                        kind: "output",
                        name: o.name.clone(),
                        reason: format!(
                            "{} produces a multi-output value; output a getitem of it",
                            self.describe(o.value)
                        ),
                    });
                }
                Some(_) => {}
            }
            if let Some(&first) = outs.get(o.name.as_str()) {
                return Err(Error::DuplicateName {
                    kind: "output",
                    name: o.name.clone(),
                    first,
                    second: o.value,
                });
            }
            outs.insert(&o.name, o.value);
        }
        Ok(())
    }

    /// Extracts the given nodes as a standalone program.
    ///
    /// Values produced outside the set and read inside become graph inputs (an original graph
    /// input keeps its name, any other value is named `v<id>`), except `Weight` and `Constant`
    /// nodes, which are copied in (a weight belongs to whichever piece reads it). Values
    /// produced inside and read outside, or returned by the original program, become graph
    /// outputs (original output names are kept, one output per name; others are `v<id>`).
    /// Nodes keep their relative topological order. A multi-output value may not cross the
    /// boundary: keep a `split` and all its `getitem`s together.
    pub fn subprogram(&self, nodes: &[NodeId]) -> Result<SubProgram> {
        let order = self.topo_order()?;
        let len = self.nodes.len();
        let mut inside = vec![false; len];
        for &id in nodes {
            if id.index() >= len {
                return Err(Error::Subprogram(format!(
                    "{id} does not exist (the program has {len} nodes)"
                )));
            }
            inside[id.index()] = true;
        }
        // Pull in sources that inside nodes read.
        for &id in nodes {
            for &v in &self.node(id).inputs {
                if matches!(self.node(v).op, Op::Weight { .. } | Op::Constant { .. }) {
                    inside[v.index()] = true;
                }
            }
        }
        let consumers = self.consumers();
        let mut map: Vec<Option<NodeId>> = vec![None; len];
        let mut sub = Program::new();
        let mut original = Vec::new();
        let mut input_values = Vec::new();
        let push = |sub: &mut Program, original: &mut Vec<NodeId>, node: Node, from: NodeId| {
            let id = NodeId(sub.nodes.len() as u32);
            sub.nodes.push(node);
            original.push(from);
            id
        };
        for &id in &order {
            if !inside[id.index()] {
                continue;
            }
            let n = self.node(id);
            let mut ins = Vec::with_capacity(n.inputs.len());
            for &v in &n.inputs {
                if let Some(m) = map[v.index()] {
                    ins.push(m);
                    continue;
                }
                let p = self.node(v);
                if p.ty.is_tuple() {
                    return Err(Error::Subprogram(format!(
                        "{} reads the multi-output value of {}, which is outside the set; keep a split and its getitems together",
                        self.describe(id),
                        self.describe(v)
                    )));
                }
                let name = match &p.op {
                    Op::Input { name } => name.clone(),
                    _ => format!("v{}", v.0),
                };
                let input = Node {
                    op: Op::Input { name },
                    inputs: Vec::new(),
                    ty: p.ty.clone(),
                    label: p.label.clone(),
                    recompute: false,
                };
                let new = push(&mut sub, &mut original, input, v);
                sub.inputs.push(new);
                input_values.push(v);
                map[v.index()] = Some(new);
                ins.push(new);
            }
            let node = Node {
                op: n.op.clone(),
                inputs: ins,
                ty: n.ty.clone(),
                label: n.label.clone(),
                recompute: n.recompute,
            };
            let new = push(&mut sub, &mut original, node, id);
            if let Op::Input { .. } = n.op {
                sub.inputs.push(new);
                input_values.push(id);
            }
            map[id.index()] = Some(new);
        }
        let mut output_values = Vec::new();
        let mut named: BTreeMap<NodeId, Vec<&str>> = BTreeMap::new();
        for o in &self.outputs {
            named.entry(o.value).or_default().push(&o.name);
        }
        for &id in &order {
            let Some(new) = map[id.index()] else { continue };
            if !inside[id.index()] {
                continue; // a value that came in as an input
            }
            let crosses = consumers[id.index()].iter().any(|c| !inside[c.index()]);
            let names = named.get(&id);
            if !crosses && names.is_none() {
                continue;
            }
            if self.node(id).ty.is_tuple() {
                return Err(Error::Subprogram(format!(
                    "the multi-output value of {} is read outside the set; keep a split and its getitems together",
                    self.describe(id)
                )));
            }
            match names {
                Some(ns) => {
                    for n in ns {
                        sub.outputs.push(GraphOutput {
                            name: (*n).to_string(),
                            value: new,
                        });
                        output_values.push(id);
                    }
                    if crosses && !ns.contains(&format!("v{}", id.0).as_str()) {
                        // Also read by other pieces: those find it under the generic name.
                        sub.outputs.push(GraphOutput {
                            name: format!("v{}", id.0),
                            value: new,
                        });
                        output_values.push(id);
                    }
                }
                None => {
                    sub.outputs.push(GraphOutput {
                        name: format!("v{}", id.0),
                        value: new,
                    });
                    output_values.push(id);
                }
            }
        }
        sub.validate()?;
        Ok(SubProgram {
            program: sub,
            original,
            input_values,
            output_values,
        })
    }

    /// Serialises to pretty JSON (deterministic: same program, same bytes).
    pub fn to_json(&self) -> Result<String> {
        Ok(serde_json::to_string_pretty(self)?)
    }

    /// Parses JSON written by [`Program::to_json`]. Does not validate; call
    /// [`Program::validate`] on untrusted input.
    pub fn from_json(s: &str) -> Result<Program> {
        Ok(serde_json::from_str(s)?)
    }
}

impl fmt::Display for Program {
    /// A line-per-node text form for debugging and golden tests, e.g.
    /// `%7 = linear(%5, %6) : f32[1, 4, 16]  # layer0.q_proj`, then `output "y" = %7`.
    /// Constants show their byte count, not their bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, n) in self.nodes.iter().enumerate() {
            write!(f, "%{i} = {}", n.op.name())?;
            let attrs = match &n.op {
                Op::Constant { data } => format!(" <{} bytes>", data.len()),
                Op::Input { name } | Op::Weight { name, rows: None } => format!(" {name:?}"),
                Op::Weight {
                    name,
                    rows: Some([a, b]),
                } => format!(" {name:?}[{a}..{b}]"),
                op => match serde_json::to_value(op) {
                    Ok(serde_json::Value::Object(m)) => {
                        let parts: Vec<String> = m
                            .iter()
                            .filter(|(k, _)| k.as_str() != "op")
                            .map(|(k, v)| format!("{k}={v}"))
                            .collect();
                        if parts.is_empty() {
                            String::new()
                        } else {
                            format!("[{}]", parts.join(", "))
                        }
                    }
                    _ => String::new(),
                },
            };
            f.write_str(&attrs)?;
            if !n.op.is_source() {
                f.write_str("(")?;
                for (k, v) in n.inputs.iter().enumerate() {
                    if k > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{v}")?;
                }
                f.write_str(")")?;
            }
            write!(f, " : {}", n.ty)?;
            if let Some(l) = &n.label {
                write!(f, "  # {l}")?;
            }
            writeln!(f)?;
        }
        for o in &self.outputs {
            writeln!(f, "output {:?} = {}", o.name, o.value)?;
        }
        Ok(())
    }
}

/// Checks a source node's declared type.
pub(crate) fn check_source(op: &Op, ty: &ValueType) -> std::result::Result<(), String> {
    let Some(t) = ty.tensor() else {
        return Err(format!("a source must produce a tensor, found tuple {ty}"));
    };
    if t.checked_nbytes().is_none() {
        return Err(format!(
            "declared type {t} is too large (its byte size overflows)"
        ));
    }
    if let Op::Weight {
        rows: Some([a, b]), ..
    } = op
    {
        if a >= b {
            return Err(format!(
                "weight row range [{a}, {b}) is empty or reversed; expected start < end"
            ));
        }
        if t.shape.first() != Some(&(b - a)) {
            return Err(format!(
                "weight rows [{a}, {b}) declare {t}; expected {} rows on axis 0",
                b - a
            ));
        }
    }
    if let Op::Constant { data } = op {
        let expected = t.numel().checked_mul(t.dtype.size());
        if expected != Some(data.len()) {
            return Err(format!(
                "constant {t}: expected {} bytes (elements × {} bytes), found {}",
                t.numel().saturating_mul(t.dtype.size()),
                t.dtype.size(),
                data.len()
            ));
        }
        if t.dtype == Dtype::Bool
            && let Some(b) = data.iter().find(|&&b| b > 1)
        {
            return Err(format!("bool constant holds byte {b}; expected 0 or 1"));
        }
    }
    Ok(())
}
