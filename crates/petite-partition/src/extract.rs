//! One engine of a plan as a standalone program, for a backend to build.

use std::collections::BTreeSet;

use petite_graph::{GraphOutput, Node, NodeId, Op, Program, ValueId};

use crate::planner::Plan;
use crate::{Error, Result};

/// An engine as a standalone, validated program, with the mapping of its interface back to the
/// original program's values.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineProgram {
    /// The engine's program: its inputs are the engine's inputs (program inputs keep their
    /// names, values from earlier engines are named `v<id>`), its weights and constants are
    /// copied in, its outputs are the engine's outputs, named `v<id>`.
    pub program: Program,
    /// For each graph input of `program`, in order, the original value it stands for.
    pub input_values: Vec<ValueId>,
    /// For each graph output of `program`, in order, the original value it returns.
    pub output_values: Vec<ValueId>,
}

impl Plan {
    /// Extracts engine `index` from `program` (the program the plan was made for).
    pub fn engine_program(&self, program: &Program, index: usize) -> Result<EngineProgram> {
        let engine = self.engines.get(index).ok_or(Error::NoSuchEngine {
            index,
            count: self.engines.len(),
        })?;
        if program.len() != self.program_nodes {
            return Err(Error::Mismatch(format!(
                "the plan is for a program of {} nodes, this one has {}",
                self.program_nodes,
                program.len()
            )));
        }
        let len = program.len();
        let mut map: Vec<Option<NodeId>> = vec![None; len];
        let mut sub = Program::new();
        let mut names: BTreeSet<String> = BTreeSet::new();
        let mut input_values = Vec::with_capacity(engine.inputs.len());
        for inp in &engine.inputs {
            let p = program.get(inp.value).ok_or_else(|| {
                Error::Mismatch(format!("engine {index} input {} does not exist", inp.value))
            })?;
            let mut name = match &p.op {
                Op::Input { name } => name.clone(),
                _ => format!("v{}", inp.value.0),
            };
            while names.contains(&name) {
                name.push('_');
            }
            names.insert(name.clone());
            let id = NodeId(sub.nodes.len() as u32);
            sub.nodes.push(Node {
                op: Op::Input { name },
                inputs: Vec::new(),
                ty: p.ty.clone(),
                label: p.label.clone(),
                recompute: false,
            });
            sub.inputs.push(id);
            input_values.push(inp.value);
            map[inp.value.index()] = Some(id);
        }
        for &id in &engine.nodes {
            let n = program.get(id).ok_or_else(|| {
                Error::Mismatch(format!("engine {index} node {id} does not exist"))
            })?;
            let mut inputs = Vec::with_capacity(n.inputs.len());
            for &v in &n.inputs {
                if let Some(m) = map[v.index()] {
                    inputs.push(m);
                    continue;
                }
                let p = program.node(v);
                if !matches!(p.op, Op::Weight { .. } | Op::Constant { .. }) {
                    return Err(Error::Mismatch(format!(
                        "engine {index}: {} reads {}, which the engine neither computes nor receives",
                        program.describe(id),
                        program.describe(v)
                    )));
                }
                let m = NodeId(sub.nodes.len() as u32);
                sub.nodes.push(p.clone());
                map[v.index()] = Some(m);
                inputs.push(m);
            }
            let m = NodeId(sub.nodes.len() as u32);
            sub.nodes.push(Node {
                op: n.op.clone(),
                inputs,
                ty: n.ty.clone(),
                label: n.label.clone(),
                recompute: n.recompute,
            });
            map[id.index()] = Some(m);
        }
        let mut output_values = Vec::with_capacity(engine.outputs.len());
        for o in &engine.outputs {
            let m = map[o.value.index()].ok_or_else(|| {
                Error::Mismatch(format!(
                    "engine {index} outputs {}, which it does not compute",
                    o.value
                ))
            })?;
            sub.outputs.push(GraphOutput {
                name: format!("v{}", o.value.0),
                value: m,
            });
            output_values.push(o.value);
        }
        sub.validate()?;
        Ok(EngineProgram {
            program: sub,
            input_values,
            output_values,
        })
    }
}
