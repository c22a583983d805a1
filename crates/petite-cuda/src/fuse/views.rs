//! Operands read in place through strides: a matmul's or attention's operand followed back
//! through reshapes, permutes and expands ([`reshape_strides`]).

use petite_graph::{NodeId, Op, Program};

use super::StridedView;
use crate::plan::contiguous_strides;

/// Element strides of a `shape` view of a tensor with `old` dims and element strides `st`, or
/// `None` when no strides express it (the reshape would need a copy). Dims are matched in
/// chunks whose elements are evenly spaced in memory.
pub fn reshape_strides(old: &[usize], st: &[i64], new: &[usize]) -> Option<Vec<i64>> {
    let numel: usize = old.iter().product();
    if numel != new.iter().product::<usize>() {
        return None;
    }
    if numel == 0 || old.is_empty() {
        return Some(contiguous_strides(new));
    }
    let mut out = vec![0i64; new.len()];
    let mut vd = new.len() as isize - 1;
    let mut base = *st.last()?;
    let (mut tn, mut vn) = (1usize, 1usize);
    for td in (0..old.len()).rev() {
        tn *= old[td];
        let chunk_ends = td == 0 || (old[td - 1] != 1 && st[td - 1] != tn as i64 * base);
        if chunk_ends {
            while vd >= 0 && (vn < tn || new[vd as usize] == 1) {
                out[vd as usize] = vn as i64 * base;
                vn *= new[vd as usize];
                vd -= 1;
            }
            if vn != tn {
                return None;
            }
            if td > 0 {
                base = st[td - 1];
                tn = 1;
                vn = 1;
            }
        }
    }
    (vd == -1).then_some(out)
}

/// Follows matmul `mm`'s operand `j` back through single-consumer reshapes, permutes and
/// expands to a value it can read in place, composing their strides; `None` when there is no
/// such chain or a reshape would need a copy. Returns the view and the chain's nodes.
pub(super) fn operand_view(
    p: &Program,
    mm: NodeId,
    j: usize,
    live_consumers: &dyn Fn(NodeId) -> usize,
    is_output: &[bool],
) -> Option<(StridedView, Vec<NodeId>)> {
    let mut chain = Vec::new();
    let mut x = p.node(mm).inputs[j];
    while matches!(
        p.node(x).op,
        Op::Reshape { .. } | Op::Permute { .. } | Op::Expand { .. }
    ) && live_consumers(x) == 1
        && !is_output[x.index()]
    {
        chain.push(x);
        x = p.node(x).inputs[0];
    }
    if chain.is_empty() || p.node(x).tensor().is_none() {
        return None;
    }
    let shape = p.node(x).tensor()?.shape.clone();
    let strides = contiguous_strides(&shape);
    let (shape, strides) = compose(p, shape, strides, &chain)?;
    Some((
        StridedView {
            base: x,
            shape,
            strides,
        },
        chain,
    ))
}

/// The shape and strides of a value laid out as `(shape, strides)` seen through `chain`
/// (reshapes, permutes and expands, the last applied first); `None` when a reshape would
/// need a copy.
fn compose(
    p: &Program,
    mut shape: Vec<usize>,
    mut strides: Vec<i64>,
    chain: &[NodeId],
) -> Option<(Vec<usize>, Vec<i64>)> {
    for &v in chain.iter().rev() {
        match &p.node(v).op {
            Op::Reshape { shape: to } => {
                strides = reshape_strides(&shape, &strides, to)?;
                shape = to.clone();
            }
            Op::Permute { perm } => {
                shape = perm.iter().map(|&d| shape[d]).collect();
                strides = perm.iter().map(|&d| strides[d]).collect();
            }
            Op::Expand { shape: to } => {
                let off = to.len().checked_sub(shape.len())?;
                let mut st = vec![0i64; to.len()];
                for (d, &s) in shape.iter().enumerate() {
                    st[d + off] = if s == 1 && to[d + off] != 1 {
                        0
                    } else {
                        strides[d]
                    };
                }
                shape = to.clone();
                strides = st;
            }
            _ => return None,
        }
    }
    Some((shape, strides))
}

/// `v` read whole (its own shape, contiguous).
pub(super) fn whole(p: &Program, v: NodeId) -> StridedView {
    let shape = p
        .node(v)
        .tensor()
        .map(|t| t.shape.clone())
        .unwrap_or_default();
    StridedView {
        base: v,
        strides: contiguous_strides(&shape),
        shape,
    }
}
