//! Sibling linears: linears of one input and weight shape run as one batched GEMM
//! ([`Siblings`]).

use petite_graph::{Dtype, NodeId, Op, Program};

/// Linears reading one input, with 16-bit weights (and biases) of one shape and dtype read by
/// them alone: their weights are uploaded side by side and their GEMMs run as one strided batch
/// (`k`/`v` and `gate`/`up` projections: one launch instead of two). Not for f32 weights: on
/// the H200 the batched f32 GEMMs were slower (f32 chunk 143.9 → 146.3 ms), bf16 faster (53.4 →
/// 50.9 ms). cuBLAS may sum a batched GEMM in another order than two single ones, so batched
/// and unbatched bf16 runs differ at bf16's rounding noise (1.1e-2 on full-size actions).
///
/// f32 linears are never batched or stacked: a wide TF32 GEMM over SigLIP's q/k/v (one launch
/// instead of three) kept full-size pi0.5's bits for 0.16 ms a chunk but doubled the
/// two_cams_mqa golden's bf16 error (1.09e-2 → 2.21e-2 of lerobot's f32; session 23 of
/// docs/MEASUREMENTS.md), so that path was removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Siblings {
    /// The linears, in program order.
    pub linears: Vec<NodeId>,
    /// Their weights, in the same order.
    pub weights: Vec<NodeId>,
    /// Their biases, when they have them.
    pub biases: Option<Vec<NodeId>>,
}

/// Finds [`Siblings`] among `program`'s live linears.
pub fn siblings(program: &Program, live: &[bool]) -> Vec<Siblings> {
    let consumers = program.consumers();
    let only_reader = |w: NodeId, by: NodeId| {
        matches!(program.node(w).op, Op::Weight { .. })
            && consumers[w.index()]
                .iter()
                .all(|&c| c == by || !live[c.index()])
    };
    let mut groups: Vec<(String, Siblings)> = Vec::new();
    for id in program.ids() {
        let node = program.node(id);
        if !live[id.index()] || !matches!(node.op, Op::Linear) {
            continue;
        }
        let (x, w) = (node.inputs[0], node.inputs[1]);
        let b = node.inputs.get(2).copied();
        let wdt = program.node(w).tensor().map(|t| t.dtype);
        let sixteen = matches!(wdt, Some(Dtype::Bf16 | Dtype::F16));
        if !sixteen || !only_reader(w, id) || b.is_some_and(|b| !only_reader(b, id)) {
            continue;
        }
        let ty = |v: NodeId| program.node(v).ty.to_string();
        let key = format!(
            "{x} {} {} {}",
            ty(w),
            b.map(ty).unwrap_or_default(),
            node.ty
        );
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => {
                g.linears.push(id);
                g.weights.push(w);
                if let (Some(bs), Some(b)) = (g.biases.as_mut(), b) {
                    bs.push(b);
                }
            }
            None => groups.push((
                key,
                Siblings {
                    linears: vec![id],
                    weights: vec![w],
                    biases: b.map(|b| vec![b]),
                },
            )),
        }
    }
    groups
        .into_iter()
        .map(|(_, g)| g)
        .filter(|g| g.linears.len() > 1)
        .collect()
}
