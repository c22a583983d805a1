//! Sibling linears: linears of one input and weight shape run as one batched GEMM, or as one
//! wide GEMM whose column slices are their values ([`Siblings`]).

use petite_graph::{Dtype, NodeId, Op, Program};

#[cfg(doc)]
use super::restride;
use super::{Fusion, Role};

/// Linears reading one input, with 16-bit weights (and biases) of one shape and dtype read by
/// them alone: their weights are uploaded side by side and their GEMMs run as one strided batch
/// (`k`/`v` and `gate`/`up` projections: one launch instead of two). Not for f32 weights: on
/// the H200 the batched f32 GEMMs were slower (f32 chunk 143.9 → 146.3 ms), bf16 faster (53.4 →
/// 50.9 ms). cuBLAS may sum a batched GEMM in another order than two single ones, so batched
/// and unbatched bf16 runs differ at bf16's rounding noise (1.1e-2 on full-size actions).
///
/// f32 linears of one shape whose values are only read in place ([`Role::View`] chains into
/// attention operands: SigLIP's q/k/v) may be [`Siblings::columns`] instead (where `in_place`
/// says so; `DeviceProgram` only with `PETITE_CUDA_COLUMNS=1`): one GEMM over their stacked
/// weights writes all their output columns side by side (one wide GEMM fills the GPU where
/// three 768 × 1,152 ones left it half idle), one bias pass, and each linear's value is its
/// column slice, its readers' views restrided ([`restride`]). Opt-in: on the H200 the wide
/// TF32 GEMM kept full-size pi0.5's bits for 0.16 ms a chunk but doubled a golden's bf16 error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Siblings {
    /// The linears, in program order.
    pub linears: Vec<NodeId>,
    /// Their weights, in the same order.
    pub weights: Vec<NodeId>,
    /// Their biases, when they have them.
    pub biases: Option<Vec<NodeId>>,
    /// One GEMM writing `[rows, parts · n]`, each linear's value a column slice (f32 weights
    /// whose values are only read through views), instead of a batch writing `[parts, rows, n]`.
    pub columns: bool,
}

/// Whether every reader of `l`'s value reads it through a view into an attention's operand
/// (whose per-head GEMMs take any row stride), so a column slice can serve as its value.
pub fn read_in_place_by_attentions(
    p: &Program,
    fusion: &Fusion,
    consumers: &[Vec<NodeId>],
    live: &[bool],
    is_output: &[bool],
    l: NodeId,
) -> bool {
    let mut cs = consumers[l.index()]
        .iter()
        .filter(|c| live[c.index()])
        .peekable();
    let mut views = fusion.views.iter().filter(|(_, v)| v.base == l).peekable();
    !is_output[l.index()]
        && cs.peek().is_some()
        && cs.all(|&c| fusion.role[c.index()] == Role::View)
        && views.peek().is_some()
        && views.all(|(&(c, _), _)| matches!(p.node(c).op, Op::Attention { .. }))
}

/// Finds [`Siblings`] among `program`'s live linears; `in_place(l)`: every reader of linear
/// `l`'s value reads it through a view that a column slice's strides can serve.
pub fn siblings(
    program: &Program,
    live: &[bool],
    in_place: &dyn Fn(NodeId) -> bool,
) -> Vec<Siblings> {
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
        let columns = wdt == Some(Dtype::F32) && in_place(id);
        if !(sixteen || columns) || !only_reader(w, id) || b.is_some_and(|b| !only_reader(b, id)) {
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
                    columns,
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
