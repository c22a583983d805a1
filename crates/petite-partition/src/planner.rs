//! The plan and the planning algorithm.

use std::collections::VecDeque;

use petite_graph::{NodeId, Op, Program, ValueId};
use serde::{Deserialize, Serialize};

use crate::options::{CostModel, EngineCost, PartitionOptions};
use crate::unionfind::UnionFind;
use crate::{Error, Result};

/// A value an engine reads that it does not compute itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineInput {
    /// The value (its producer's node id in the program).
    pub value: ValueId,
    /// Its size (cost model).
    pub bytes: u64,
    /// The engine that produces it, or `None` for a program input.
    pub from: Option<usize>,
}

/// A value an engine hands on: to later engines, to the caller, or both.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineOutput {
    /// The value.
    pub value: ValueId,
    /// Its size (cost model).
    pub bytes: u64,
    /// True if the program returns it.
    pub program_output: bool,
    /// The last engine that reads it, if a later engine does.
    pub last_reader: Option<usize>,
}

/// One engine: a set of nodes built and run as a unit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Engine {
    /// Position in build (and run) order.
    pub index: usize,
    /// Every node the engine computes, in a topological order of the program; includes the
    /// [`Engine::recomputed`] ones. Weights and constants are not listed here (see
    /// [`Engine::weights`]; constants are copied into each engine that reads them).
    pub nodes: Vec<NodeId>,
    /// The input-only nodes this engine computes although another engine computes them too
    /// (recomputing them is cheaper than passing their large values).
    pub recomputed: Vec<NodeId>,
    /// The large input-only values this engine recomputes instead of receiving.
    pub recomputed_values: Vec<ValueId>,
    /// Values read but not computed here: program inputs and values from earlier engines,
    /// ascending by id.
    pub inputs: Vec<EngineInput>,
    /// Values computed here that later engines read or the program returns, ascending by id.
    pub outputs: Vec<EngineOutput>,
    /// Weight nodes read, ascending by id.
    pub weights: Vec<NodeId>,
    /// Bytes of those weights (each once).
    pub weight_bytes: u64,
    /// Bytes of the inputs that come from earlier engines.
    pub input_bytes: u64,
    /// Bytes of the outputs that later engines read.
    pub output_bytes: u64,
    /// The cost model's build-memory estimate.
    pub build_bytes: u64,
    /// True if the engine reads more than the cap: it then holds one atomic group that is
    /// larger than the cap on its own, and no other weights.
    pub over_cap: bool,
    /// Label of the first node that is not recomputed (for reports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_label: Option<String>,
    /// Label of the last node that is not recomputed (for reports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_label: Option<String>,
}

/// What crosses between engine `after` and engine `after + 1`: every value produced by an
/// engine `≤ after` and read by an engine `> after` (it must be kept alive across the cut).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Boundary {
    /// The engine before the cut.
    pub after: usize,
    /// The values, ascending by id.
    pub values: Vec<ValueId>,
    /// Their total size.
    pub bytes: u64,
}

/// One weight of the program and the engines that read it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightUse {
    /// The `Weight` node.
    pub node: NodeId,
    /// Checkpoint tensor name.
    pub name: String,
    /// The row range of the checkpoint tensor this node reads ([`Op::Weight`]), `None` (and
    /// absent from JSON) for the whole tensor. Each range is its own entry, with its own last
    /// engine: releasing it gives back only those rows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<[usize; 2]>,
    /// Size (cost model; only the rows' bytes for a row range).
    pub bytes: u64,
    /// Engines that read it, ascending.
    pub engines: Vec<usize>,
    /// The last of them: the weight's pages can be released once this engine is built.
    /// `None` if no node reads the weight.
    pub last_engine: Option<usize>,
}

/// The result of [`plan`]: engines in build order, what crosses between them, and each
/// weight's last use. Serialises deterministically (vectors only).
///
/// Every computed node is in exactly one engine's `nodes` outside its `recomputed` list. A
/// program output that is itself a program input or constant is produced by no engine; the
/// caller passes it through.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// The cap the plan was made for.
    pub engine_cap: u64,
    /// The crossing limit the plan was made for.
    pub crossing_limit: u64,
    /// Whether positional operands (rope tables, attention masks) were always recomputed.
    pub recompute_positional: bool,
    /// The engine overhead the plan was made for.
    pub engine_overhead: u64,
    /// Node count of the program (a cheap check that a plan fits its program).
    pub program_nodes: usize,
    /// All weight bytes of the program (each weight once).
    pub weight_bytes: u64,
    /// The engines, in build order.
    pub engines: Vec<Engine>,
    /// One entry per cut (`engines.len() − 1`).
    pub boundaries: Vec<Boundary>,
    /// Every weight node of the program, ascending by id.
    pub weights: Vec<WeightUse>,
}

impl Plan {
    /// Pretty JSON; the same plan always gives the same bytes.
    pub fn to_json(&self) -> Result<String> {
        Ok(serde_json::to_string_pretty(self)?)
    }

    /// Parses [`Plan::to_json`] output.
    pub fn from_json(s: &str) -> Result<Plan> {
        Ok(serde_json::from_str(s)?)
    }

    /// The largest engine's weight bytes.
    pub fn max_engine_weight_bytes(&self) -> u64 {
        self.engines
            .iter()
            .map(|e| e.weight_bytes)
            .max()
            .unwrap_or(0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Input,
    Weight,
    Constant,
    /// A computed value whose producers reach back only to inputs and constants.
    InputOnly,
    /// Any other computed value.
    Main,
}

const NONE: u32 = u32::MAX;

/// Plans `program` under `options`.
///
/// How, in linear time and with iterative walks only:
/// 1. The program is validated (a cycle, dangling value or bad node is an error naming it)
///    and ordered topologically; each multi-output producer is followed directly by its
///    getitems, so the two form one contiguous *atomic group*.
/// 2. Input-only nodes are set aside; the other computed nodes, in that order, are cut into
///    contiguous segments. Each segment reads ≤ `engine_cap` weight bytes (each weight once),
///    or holds only one weight-reading group (the over-cap case). Among such cuttings, dynamic
///    programming (a two-pointer window and a monotone deque) picks the one with the least
///    `engines × engine_overhead + Σ crossing bytes` (activation values only: large input-only
///    values are recomputed, small ones are at most `crossing_limit` each).
/// 3. Each input-only node goes to the first engine that reads it (a multi-output one with its
///    getitems). An engine reading an input-only value larger than `crossing_limit` from
///    elsewhere — or, with `recompute_positional`, one it reads as a rope table or attention
///    mask — recomputes that value's whole producer cone itself; other ones cross.
/// 4. Inputs, outputs, boundaries, weights and last uses are derived from the assignment.
pub fn plan<C: CostModel>(program: &Program, options: &PartitionOptions<C>) -> Result<Plan> {
    options.check()?;
    program.validate()?;
    let order = program.topo_order()?;
    let n = program.len();
    let cost = &options.cost;
    let cap = options.engine_cap;

    let mut rank = vec![0u32; n];
    for (i, id) in order.iter().enumerate() {
        rank[id.index()] = i as u32;
    }
    let consumers = program.consumers();

    // ---- Classify.
    let mut kind = vec![Kind::Main; n];
    for &id in &order {
        let node = program.node(id);
        kind[id.index()] = match node.op {
            Op::Input { .. } => Kind::Input,
            Op::Weight { .. } => Kind::Weight,
            Op::Constant { .. } => Kind::Constant,
            _ => {
                let input_only = node.inputs.iter().all(|v| {
                    matches!(
                        kind[v.index()],
                        Kind::Input | Kind::Constant | Kind::InputOnly
                    )
                });
                if input_only {
                    Kind::InputOnly
                } else {
                    Kind::Main
                }
            }
        };
    }

    // ---- Positional operands: input-only values the program marks `recompute` or that are
    // read as a fused rope's cos/sin or an attention mask.
    let mut positional = vec![false; n];
    if options.recompute_positional {
        for id in program.ids() {
            let node = program.node(id);
            if node.recompute && kind[id.index()] == Kind::InputOnly {
                positional[id.index()] = true;
            }
            let slots: &[usize] = match node.op {
                Op::Rope => &[1, 2],
                Op::Attention { .. } => &[3],
                _ => &[],
            };
            for &i in slots {
                if let Some(&v) = node.inputs.get(i)
                    && kind[v.index()] == Kind::InputOnly
                {
                    positional[v.index()] = true;
                }
            }
        }
    }

    // ---- Weight table (node order).
    let mut weight_index = vec![NONE; n];
    let mut weight_nodes: Vec<NodeId> = Vec::new();
    let mut weight_bytes: Vec<u64> = Vec::new();
    for id in program.ids() {
        if kind[id.index()] == Kind::Weight {
            weight_index[id.index()] = weight_nodes.len() as u32;
            weight_nodes.push(id);
            weight_bytes.push(cost.weight_bytes(program, id));
        }
    }

    // ---- Main order: topological, getitems right after their multi-output producer.
    let mut groups = UnionFind::new(n);
    let mut main: Vec<NodeId> = Vec::new();
    let mut emitted = vec![false; n];
    for &id in &order {
        if kind[id.index()] != Kind::Main || emitted[id.index()] {
            continue;
        }
        main.push(id);
        emitted[id.index()] = true;
        if program.node(id).ty.is_tuple() {
            // Validation guarantees every consumer of a tuple is a getitem.
            for &g in &consumers[id.index()] {
                groups.union(id.0, g.0);
                if !emitted[g.index()] {
                    main.push(g);
                    emitted[g.index()] = true;
                }
            }
        }
    }

    // ---- Units (atomic groups, contiguous in `main`) and their weights.
    let mut unit_of = vec![NONE; n];
    let mut unit_start: Vec<usize> = Vec::new();
    for (pos, &id) in main.iter().enumerate() {
        let new_unit = pos == 0 || groups.find(id.0) != groups.find(main[pos - 1].0);
        if new_unit {
            unit_start.push(pos);
        }
        unit_of[id.index()] = (unit_start.len() - 1) as u32;
    }
    let units = unit_start.len();
    unit_start.push(main.len());
    let mut unit_w_start: Vec<usize> = Vec::with_capacity(units + 1);
    let mut unit_w: Vec<u32> = Vec::new();
    let mut unit_bytes: Vec<u64> = Vec::with_capacity(units);
    let mut stamp = vec![NONE; weight_nodes.len()];
    for u in 0..units {
        unit_w_start.push(unit_w.len());
        let mut bytes = 0u64;
        for &id in &main[unit_start[u]..unit_start[u + 1]] {
            for &v in &program.node(id).inputs {
                let w = weight_index[v.index()];
                if w != NONE && stamp[w as usize] != u as u32 {
                    stamp[w as usize] = u as u32;
                    unit_w.push(w);
                    bytes = bytes.saturating_add(weight_bytes[w as usize]);
                }
            }
        }
        unit_bytes.push(bytes);
    }
    unit_w_start.push(unit_w.len());

    // The smallest weight-reading group must fit, or the cap is nonsense.
    if let Some(u) = (0..units)
        .filter(|&u| unit_bytes[u] > 0)
        .min_by_key(|&u| (unit_bytes[u], u))
        && unit_bytes[u] > cap
    {
        return Err(Error::CapTooSmall {
            cap,
            node: program.describe(main[unit_start[u]]),
            bytes: unit_bytes[u],
        });
    }

    // ---- Bytes crossing each cut position (cut c lies before unit c), activations only.
    let mut diff = vec![0i128; units + 2];
    for &id in &main {
        if program.node(id).ty.is_tuple() {
            continue;
        }
        let p = unit_of[id.index()];
        let last = consumers[id.index()]
            .iter()
            .map(|c| unit_of[c.index()])
            .filter(|&u| u != NONE)
            .max();
        if let Some(q) = last
            && q > p
        {
            let b = cost.value_bytes(program, id) as i128;
            diff[p as usize + 1] += b;
            diff[q as usize + 1] -= b;
        }
    }
    let mut cut = vec![0u128; units + 1];
    let mut acc = 0i128;
    for c in 0..=units {
        acc += diff[c];
        cut[c] = acc.max(0) as u128;
    }

    // ---- Segment the units: fewest engines, then least crossing.
    let segments = segment(
        units,
        &unit_w_start,
        &unit_w,
        &unit_bytes,
        &weight_bytes,
        &cut,
        cap,
        options.engine_overhead,
    );

    let mut engine_of = vec![NONE; n];
    for (e, &(a, b)) in segments.iter().enumerate() {
        for &id in &main[unit_start[a]..unit_start[b]] {
            engine_of[id.index()] = e as u32;
        }
    }
    let mut engines_n = segments.len();
    let has_input_only = kind.contains(&Kind::InputOnly);
    if engines_n == 0 && has_input_only {
        engines_n = 1;
    }

    // ---- Input-only nodes go to their first reader's engine (reverse topological order).
    for &id in order.iter().rev() {
        if kind[id.index()] != Kind::InputOnly {
            continue;
        }
        let demand = consumers[id.index()]
            .iter()
            .map(|c| engine_of[c.index()])
            .min()
            .unwrap_or((engines_n - 1) as u32);
        engine_of[id.index()] = demand;
        if program.node(id).ty.is_tuple() {
            for &g in &consumers[id.index()] {
                engine_of[g.index()] = demand;
            }
        }
    }

    // ---- Per engine: primary nodes, recomputed cones, inputs.
    let mut primary: Vec<Vec<NodeId>> = vec![Vec::new(); engines_n];
    for &id in &order {
        if matches!(kind[id.index()], Kind::Main | Kind::InputOnly) {
            primary[engine_of[id.index()] as usize].push(id);
        }
    }
    let mut member = vec![NONE; n]; // engine index + marks membership (primary or recomputed)
    let mut seen = vec![NONE; n];
    let mut engines: Vec<Engine> = Vec::with_capacity(engines_n);
    let mut crossing_inputs: Vec<Vec<(ValueId, usize)>> = vec![Vec::new(); engines_n];
    let mut stack: Vec<NodeId> = Vec::new();
    for (e, prim) in primary.iter().enumerate() {
        let tag = e as u32;
        for &id in prim {
            member[id.index()] = tag;
        }
        let mut recomputed: Vec<NodeId> = Vec::new();
        let mut recomputed_values: Vec<ValueId> = Vec::new();
        for &id in prim {
            for &v in &program.node(id).inputs {
                if kind[v.index()] != Kind::InputOnly
                    || member[v.index()] == tag
                    || (!positional[v.index()]
                        && cost.value_bytes(program, v) <= options.crossing_limit)
                {
                    continue;
                }
                recomputed_values.push(v);
                member[v.index()] = tag;
                stack.push(v);
                while let Some(x) = stack.pop() {
                    recomputed.push(x);
                    for &y in &program.node(x).inputs {
                        if kind[y.index()] == Kind::InputOnly && member[y.index()] != tag {
                            member[y.index()] = tag;
                            stack.push(y);
                        }
                    }
                }
            }
        }
        recomputed.sort_unstable_by_key(|x| rank[x.index()]);
        recomputed_values.sort_unstable_by_key(|x| rank[x.index()]);
        let mut nodes: Vec<NodeId> = Vec::with_capacity(prim.len() + recomputed.len());
        nodes.extend_from_slice(prim);
        nodes.extend_from_slice(&recomputed);
        nodes.sort_unstable_by_key(|x| rank[x.index()]);

        let mut inputs: Vec<EngineInput> = Vec::new();
        let mut weights: Vec<NodeId> = Vec::new();
        for &id in &nodes {
            for &v in &program.node(id).inputs {
                if seen[v.index()] == tag {
                    continue;
                }
                seen[v.index()] = tag;
                match kind[v.index()] {
                    Kind::Input => inputs.push(EngineInput {
                        value: v,
                        bytes: cost.value_bytes(program, v),
                        from: None,
                    }),
                    Kind::Weight => weights.push(v),
                    Kind::Constant => {}
                    Kind::InputOnly | Kind::Main => {
                        if member[v.index()] != tag {
                            let from = engine_of[v.index()] as usize;
                            inputs.push(EngineInput {
                                value: v,
                                bytes: cost.value_bytes(program, v),
                                from: Some(from),
                            });
                            crossing_inputs[from].push((v, e));
                        }
                    }
                }
            }
        }
        inputs.sort_unstable_by_key(|i| i.value);
        weights.sort_unstable();
        let wbytes = weights.iter().fold(0u64, |a, w| {
            a.saturating_add(weight_bytes[weight_index[w.index()] as usize])
        });
        let input_bytes = inputs
            .iter()
            .filter(|i| i.from.is_some())
            .fold(0u64, |a, i| a.saturating_add(i.bytes));
        let first_label = prim.first().and_then(|&x| program.node(x).label.clone());
        let last_label = prim.last().and_then(|&x| program.node(x).label.clone());
        engines.push(Engine {
            index: e,
            nodes,
            recomputed,
            recomputed_values,
            inputs,
            outputs: Vec::new(),
            weights,
            weight_bytes: wbytes,
            input_bytes,
            output_bytes: 0,
            build_bytes: 0,
            over_cap: wbytes > cap,
            first_label,
            last_label,
        });
    }

    // ---- Outputs and boundaries.
    let mut last_reader = vec![NONE; n];
    for list in &crossing_inputs {
        for &(v, reader) in list {
            let r = &mut last_reader[v.index()];
            if *r == NONE || *r < reader as u32 {
                *r = reader as u32;
            }
        }
    }
    let mut is_output = vec![false; n];
    for o in &program.outputs {
        is_output[o.value.index()] = true;
    }
    let mut boundary_values: Vec<Vec<ValueId>> = vec![Vec::new(); engines_n.saturating_sub(1)];
    for (e, list) in crossing_inputs.iter_mut().enumerate() {
        list.sort_unstable();
        list.dedup_by_key(|x| x.0);
        let mut outputs: Vec<EngineOutput> = list
            .iter()
            .map(|&(v, _)| v)
            .chain(program.outputs.iter().map(|o| o.value).filter(|v| {
                matches!(kind[v.index()], Kind::Main | Kind::InputOnly)
                    && engine_of[v.index()] as usize == e
            }))
            .map(|v| EngineOutput {
                value: v,
                bytes: cost.value_bytes(program, v),
                program_output: is_output[v.index()],
                last_reader: (last_reader[v.index()] != NONE)
                    .then_some(last_reader[v.index()] as usize),
            })
            .collect();
        outputs.sort_unstable_by_key(|o| o.value);
        outputs.dedup_by_key(|o| o.value);
        let mut out_bytes = 0u64;
        for o in &outputs {
            if let Some(last) = o.last_reader {
                out_bytes = out_bytes.saturating_add(o.bytes);
                for b in boundary_values.iter_mut().take(last).skip(e) {
                    b.push(o.value);
                }
            }
        }
        let eng = &mut engines[e];
        eng.outputs = outputs;
        eng.output_bytes = out_bytes;
        eng.build_bytes = cost.build_bytes(&EngineCost {
            weight_bytes: eng.weight_bytes,
            input_bytes: eng.input_bytes,
            output_bytes: out_bytes,
            nodes: eng.nodes.len(),
        });
    }
    let boundaries = boundary_values
        .into_iter()
        .enumerate()
        .map(|(after, mut values)| {
            values.sort_unstable();
            let bytes = values
                .iter()
                .fold(0u64, |a, &v| a.saturating_add(cost.value_bytes(program, v)));
            Boundary {
                after,
                values,
                bytes,
            }
        })
        .collect();

    // ---- Weights and their last use.
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); weight_nodes.len()];
    for eng in &engines {
        for w in &eng.weights {
            readers[weight_index[w.index()] as usize].push(eng.index);
        }
    }
    let weights: Vec<WeightUse> = weight_nodes
        .iter()
        .zip(readers)
        .enumerate()
        .map(|(i, (&node, engines))| {
            let (name, rows) = match &program.node(node).op {
                Op::Weight { name, rows } => (name.clone(), *rows),
                _ => (String::new(), None),
            };
            WeightUse {
                node,
                name,
                rows,
                bytes: weight_bytes[i],
                last_engine: engines.last().copied(),
                engines,
            }
        })
        .collect();

    Ok(Plan {
        engine_cap: cap,
        crossing_limit: options.crossing_limit,
        recompute_positional: options.recompute_positional,
        engine_overhead: options.engine_overhead,
        program_nodes: n,
        weight_bytes: weight_bytes.iter().fold(0u64, |a, &b| a.saturating_add(b)),
        engines,
        boundaries,
        weights,
    })
}

/// Cuts units `0..units` into contiguous segments `[a, b)`.
///
/// A segment is allowed if its distinct weights total ≤ `cap`, or if at most one of its units
/// reads weights (a group over the cap on its own). Allowed segments ending at `i` start in a
/// window `[lo(i), i)` whose ends only move right, so a monotone deque over
/// `key(j) = best(j) + overhead + crossing at cut j` finds each `best(i)` in amortised O(1).
/// Ties go to the later cut.
#[allow(clippy::too_many_arguments)]
fn segment(
    units: usize,
    unit_w_start: &[usize],
    unit_w: &[u32],
    unit_bytes: &[u64],
    weight_bytes: &[u64],
    cut: &[u128],
    cap: u64,
    overhead: u64,
) -> Vec<(usize, usize)> {
    if units == 0 {
        return Vec::new();
    }
    // Σ over ≤ 2^32 units of (u64 + u64) fits in u128.
    let mut best: Vec<u128> = vec![0; units + 1];
    let mut key: Vec<u128> = vec![0; units + 1];
    let mut choice = vec![0usize; units + 1];
    let mut count = vec![0u32; weight_bytes.len()];
    let mut window_bytes: u128 = 0;
    let mut heavy = 0usize;
    let mut lo = 0usize;
    let mut deque: VecDeque<usize> = VecDeque::new();
    let cap = cap as u128;
    for i in 1..=units {
        let j = i - 1;
        key[j] = best[j] + overhead as u128 + if j == 0 { 0 } else { cut[j] };
        while deque.back().is_some_and(|&b| key[b] >= key[j]) {
            deque.pop_back();
        }
        deque.push_back(j);
        // Add unit i−1 to the window.
        for &w in &unit_w[unit_w_start[j]..unit_w_start[j + 1]] {
            if count[w as usize] == 0 {
                window_bytes += weight_bytes[w as usize] as u128;
            }
            count[w as usize] += 1;
        }
        if unit_bytes[j] > 0 {
            heavy += 1;
        }
        while window_bytes > cap && heavy > 1 {
            for &w in &unit_w[unit_w_start[lo]..unit_w_start[lo + 1]] {
                count[w as usize] -= 1;
                if count[w as usize] == 0 {
                    window_bytes -= weight_bytes[w as usize] as u128;
                }
            }
            if unit_bytes[lo] > 0 {
                heavy -= 1;
            }
            lo += 1;
        }
        while deque.front().is_some_and(|&f| f < lo) {
            deque.pop_front();
        }
        // The window always holds j = i − 1 (a single unit is always allowed).
        let f = deque.front().copied().unwrap_or(j);
        best[i] = key[f];
        choice[i] = f;
    }
    let mut segments = Vec::new();
    let mut i = units;
    while i > 0 {
        let j = choice[i];
        segments.push((j, i));
        i = j;
    }
    segments.reverse();
    segments
}
