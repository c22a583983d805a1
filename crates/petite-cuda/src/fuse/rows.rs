//! What a row kernel (a norm, a last-axis softmax) reads as it loads its input: a widening
//! cast read in place through its input's dtype, a mask added and a 16-bit scaling folded
//! into the softmax ([`Folded`]).

use petite_graph::{Dtype, NodeId, Op, Program};

#[cfg(doc)]
use super::Fusion;
use super::StridedView;
use crate::plan::contiguous_strides;

/// What a softmax kernel computes as it loads its input ([`Fusion::masks`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Folded {
    /// The mask added (f32, broadcast over `[B, H, Q, K]`).
    pub mask: NodeId,
    /// A 16-bit `x · s` before the widening cast: `s` (rounded to that dtype, as the fused
    /// kernel rounds a scalar) and the dtype its product is rounded to.
    pub scale: Option<(f32, Dtype)>,
}

/// A norm, or a softmax over the last axis: one block a row, loading through the input's dtype.
pub(super) fn row_kernel(p: &Program, id: NodeId) -> bool {
    let node = p.node(id);
    match node.op {
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => true,
        Op::Softmax { axis } => p
            .node(node.inputs[0])
            .tensor()
            .is_some_and(|t| axis + 1 == t.shape.len()),
        _ => false,
    }
}

/// `(x, mask)` when softmax `sm` reads `x + mask` over `[B, H, Q, K]` (the sum read by it
/// alone, not an output; `x` f32 of that shape, `mask` f32 broadcast to it): what the softmax
/// kernel computes as it loads, in the same f32 arithmetic.
pub(super) fn masked(
    p: &Program,
    sm: NodeId,
    live_consumers: &dyn Fn(NodeId) -> usize,
    is_output: &[bool],
) -> Option<(NodeId, NodeId)> {
    let add = p.node(sm).inputs[0];
    let node = p.node(add);
    if !matches!(
        node.op,
        Op::Binary {
            kind: petite_graph::BinaryOp::Add
        }
    ) || live_consumers(add) != 1
        || is_output[add.index()]
    {
        return None;
    }
    let out = node.tensor()?;
    if out.shape.len() != 4 || out.dtype != Dtype::F32 {
        return None;
    }
    let full = |v: NodeId| p.node(v).tensor().is_some_and(|t| t.shape == out.shape);
    let mask = |v: NodeId| {
        p.node(v).tensor().is_some_and(|t| {
            t.dtype == Dtype::F32
                && t.shape.len() <= 4
                && t.shape
                    .iter()
                    .rev()
                    .zip(out.shape.iter().rev())
                    .all(|(&m, &o)| m == o || m == 1)
        })
    };
    let (a, b) = (node.inputs[0], node.inputs[1]);
    if full(a) && mask(b) {
        Some((a, b))
    } else if full(b) && mask(a) {
        Some((b, a))
    } else {
        None
    }
}

/// `(x, s, dtype)` when `v = x · s` (a scalar multiply) in a 16-bit float dtype, read by one
/// live node and not an output; `s` rounded to that dtype as the fused kernel rounds it.
pub(super) fn scaled(
    p: &Program,
    v: NodeId,
    live_consumers: &dyn Fn(NodeId) -> usize,
    is_output: &[bool],
) -> Option<(NodeId, f32, Dtype)> {
    let node = p.node(v);
    let Op::BinaryScalar {
        kind: petite_graph::BinaryOp::Mul,
        scalar,
        ..
    } = node.op
    else {
        return None;
    };
    let d = node.tensor()?.dtype;
    let x = node.inputs[0];
    if p.node(x).tensor()?.dtype != d || live_consumers(v) != 1 || is_output[v.index()] {
        return None;
    }
    let s = match d {
        Dtype::Bf16 => petite_dtype::round_through_bf16(scalar as f32),
        Dtype::F16 => half::f16::from_f32(scalar as f32).to_f32(),
        _ => return None,
    };
    Some((x, s, d))
}

/// `x` as an in-place read of its input when `x` is a widening cast (bf16/f16 → f32) read by
/// one live node and not a program output.
pub(super) fn widened(
    p: &Program,
    x: NodeId,
    live_consumers: &dyn Fn(NodeId) -> usize,
    is_output: &[bool],
) -> Option<StridedView> {
    let node = p.node(x);
    let Op::Cast { to: Dtype::F32 } = node.op else {
        return None;
    };
    let base = node.inputs[0];
    let from = p.node(base).tensor()?.dtype;
    if !matches!(from, Dtype::Bf16 | Dtype::F16) || live_consumers(x) != 1 || is_output[x.index()] {
        return None;
    }
    let shape = node.tensor()?.shape.clone();
    Some(StridedView {
        base,
        strides: contiguous_strides(&shape),
        shape,
    })
}
