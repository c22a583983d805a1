//! Fused bf16 attentions: recognizing transformers' eager attention chain ([`Attend`]) that
//! the `p·v` product then computes whole with the attention module's kernels, and up to how
//! many queries a device fuses them ([`fused_attention_queries`]).

use std::collections::HashMap;

use petite_graph::{Dtype, NodeId, Op, Program};

#[cfg(doc)]
use super::Fusion;
use super::views::whole;
use super::{Folded, Role, StridedView};

/// A bf16 attention in transformers' eager op order — `q·kᵀ` (bf16), a 16-bit scaling, a
/// widening cast, `+ mask`, softmax, a cast to bf16, `p·v` — that the `p·v` product computes
/// in two launches (`pt_attn_logits`, `pt_attn_pv`) instead of three (logits GEMM, softmax,
/// PV GEMM) and without the logits and probabilities in memory as bf16: the same roundings,
/// each dot product summed in its own order (as cuBLAS's is). Why: a step's attention (8
/// heads, 50 queries, ~1,000 keys) is latency-bound; its three launches took 28 µs a layer on
/// the H200. q and k are the logits product's operands, v the `p·v` product's operand 1, all
/// read through their views ([`Fusion::views`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Attend {
    /// The logits product `q·kᵀ`.
    pub logits: NodeId,
    /// q `[B, H, Q, D]`, kᵀ `[B, H, D, K]` and v `[B, H, K, Dv]` as the kernels read them (each
    /// a view, or its value whole); with [`Attend::pieces`], k's and v's bases are the concats
    /// (never computed), whose layouts the pieces share.
    pub q: StridedView,
    /// See [`Attend::q`].
    pub k: StridedView,
    /// See [`Attend::q`].
    pub v: StridedView,
    /// The additive f32 mask.
    pub mask: NodeId,
    /// The scaling folded into the softmax ([`Folded::scale`]).
    pub scale: Option<(f32, Dtype)>,
    /// K and v as the key-axis concats of two pieces each (a step's prefix K/V and its own),
    /// read where the pieces lie instead of copied together: `[k₀, k₁, v₀, v₁]` and the keys
    /// of the first pieces. The concats are [`Role::Attended`].
    pub pieces: Option<([NodeId; 4], usize)>,
}

/// Queries up to which a bf16 attention is fused ([`Attend`]) on a device of compute
/// capability `cc`: [`DEFAULT_FUSED_ATTENTION_QUERIES`] on sm_90 and later, where it runs as one
/// launch of thread-block clusters (`pt_attn_cl`: pi0.5's ten steps 13.71 → 11.95 ms on the
/// H200, docs/MEASUREMENTS.md), none before (the two-launch form measured level with the
/// three launches it replaces). [`crate::Tuning::attention_queries`] overrides it at load.
pub fn fused_attention_queries(cc: (i32, i32)) -> usize {
    if cc.0 >= 9 {
        DEFAULT_FUSED_ATTENTION_QUERIES
    } else {
        0
    }
}

/// Queries up to which attentions are fused by default on sm_90: pi0.5's steps (50 queries),
/// not its prefix (~968, past what one cluster's blocks hold of the rows' statistics cheaply).
pub const DEFAULT_FUSED_ATTENTION_QUERIES: usize = 64;

/// The [`Attend`] that matmul `pv` computes, if it is the `p·v` of a bf16 attention chain of
/// at most `max_q` queries whose operands the kernels can read
/// ([`crate::plan::attention_dims_fit`], [`crate::plan::attention_strides_fit`]), and
/// `[softmax, cast]` of that chain.
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    p: &Program,
    pv: NodeId,
    role: &[Role],
    views: &HashMap<(NodeId, usize), StridedView>,
    masks: &HashMap<NodeId, Folded>,
    runs_input: &[bool],
    live_consumers: &dyn Fn(NodeId) -> usize,
    is_output: &[bool],
    max_q: usize,
) -> Option<(Attend, [NodeId; 2])> {
    let bf16 = |v: NodeId| p.node(v).tensor().is_some_and(|t| t.dtype == Dtype::Bf16);
    let single = |v: NodeId| live_consumers(v) == 1 && !is_output[v.index()];
    if !matches!(p.node(pv).op, Op::MatMul) {
        return None;
    }
    let cast = p.node(pv).inputs[0];
    if !bf16(pv)
        || !matches!(p.node(cast).op, Op::Cast { to: Dtype::Bf16 })
        || !runs_input[cast.index()]
        || !single(cast)
    {
        return None;
    }
    let sm = p.node(cast).inputs[0];
    let folded = masks.get(&sm)?;
    let logits = views.get(&(sm, 0))?.base;
    if role[sm.index()] != Role::Narrowed
        || !matches!(p.node(logits).op, Op::MatMul)
        || role[logits.index()] != Role::Plain
        || !single(logits)
        || !bf16(logits)
        || folded.scale.is_some_and(|(_, d)| d != Dtype::Bf16)
    {
        return None;
    }
    let operand = |m: NodeId, j: usize| {
        views
            .get(&(m, j))
            .cloned()
            .unwrap_or_else(|| whole(p, p.node(m).inputs[j]))
    };
    let (q, k, v) = (operand(logits, 0), operand(logits, 1), operand(pv, 1));
    if ![&q, &k, &v]
        .iter()
        .all(|o| o.shape.len() == 4 && bf16(o.base))
    {
        return None;
    }
    let (b, h, nq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let nk = k.shape[3];
    let ok = k.shape[..3] == [b, h, d]
        && v.shape[..3] == [b, h, nk]
        && crate::plan::attention_strides_fit(&q.strides, &k.strides, &v.strides)
        && crate::plan::attention_dims_fit(d, v.shape[3])
        && nk > 0
        && nq > 0
        && nq <= max_q;
    if !ok {
        return None;
    }
    // K and v each a key-axis concat of two bf16 pieces, read by its view chain alone, split at
    // the same key: the kernels read the pieces.
    let halves = |o: &StridedView| -> Option<(NodeId, NodeId, usize)> {
        let node = p.node(o.base);
        let Op::Concat { axis: 2 } = node.op else {
            return None;
        };
        let t = node.tensor()?;
        let dense = |v: NodeId| {
            p.node(v)
                .tensor()
                .is_some_and(|x| x.shape.len() == 4 && x.dtype == Dtype::Bf16)
        };
        (node.inputs.len() == 2
            && single(o.base)
            && role[o.base.index()] == Role::Plain
            && t.shape.len() == 4
            && node.inputs.iter().all(|&v| dense(v)))
        .then(|| {
            let n0 = p.node(node.inputs[0]).tensor().map_or(0, |x| x.shape[2]);
            (node.inputs[0], node.inputs[1], n0)
        })
    };
    let pieces = match (halves(&k), halves(&v)) {
        (Some((k0, k1, n)), Some((v0, v1, m))) if n == m && n > 0 && n < nk => {
            Some(([k0, k1, v0, v1], n))
        }
        _ => None,
    };
    Some((
        Attend {
            logits,
            q,
            k,
            v,
            mask: folded.mask,
            scale: folded.scale,
            pieces,
        },
        [sm, cast],
    ))
}
