//! What an export (or a plan alone) says of each method: its signature, memory plan, constant
//! bytes and operators ([`ExportReport`], written next to a `.pte` as JSON).

use petite_graph::Program;
use serde::Serialize;

use crate::{Lowered, MemoryPlan, PlanStats, Result, lower, plan};

/// A tensor of the method's signature.
#[derive(Debug, Clone, Serialize)]
pub struct IoSpec {
    /// Graph input/output name.
    pub name: String,
    /// petite dtype name (`f32`, `bool`, …).
    pub dtype: &'static str,
    /// Shape.
    pub shape: Vec<usize>,
}

/// What an export produced (also written next to the `.pte` by the CLI as JSON).
#[derive(Debug, Clone, Serialize)]
pub struct ExportReport {
    /// Method name (`forward`).
    pub method: String,
    /// Inputs in call order.
    pub inputs: Vec<IoSpec>,
    /// Outputs in return order.
    pub outputs: Vec<IoSpec>,
    /// Memory-plan figures.
    pub plan: PlanStats,
    /// Bytes of the constant segment (weights and constants, padding included).
    pub constant_bytes: u64,
    /// Distinct operators called.
    pub operators: Vec<String>,
    /// Size of the written file (0 when only planned).
    pub file_bytes: u64,
}

fn io_specs(l: &Lowered, v: &[(String, usize)]) -> Vec<IoSpec> {
    v.iter()
        .map(|(n, s)| IoSpec {
            name: n.clone(),
            dtype: l.slots[*s].dtype.name(),
            shape: l.slots[*s].shape.clone(),
        })
        .collect()
}

pub(crate) fn report(method: &str, l: &Lowered, p: &MemoryPlan) -> ExportReport {
    let mut constant_bytes = 0u64;
    for s in &l.slots {
        if !s.is_planned() {
            constant_bytes = constant_bytes.div_ceil(16) * 16 + s.nbytes();
        }
    }
    ExportReport {
        method: method.into(),
        inputs: io_specs(l, &l.inputs),
        outputs: io_specs(l, &l.outputs),
        plan: p.stats,
        constant_bytes,
        operators: l.operators(),
        file_bytes: 0,
    }
}

/// Name of the method [`crate::export_portable`] writes.
pub const METHOD: &str = "forward";

/// Lowers and plans without touching weights: what [`crate::export_portable`] would write.
pub fn plan_portable(program: &Program) -> Result<ExportReport> {
    let l = lower(program)?;
    let p = plan(&l);
    Ok(report(METHOD, &l, &p))
}
