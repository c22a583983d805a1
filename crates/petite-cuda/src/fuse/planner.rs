//! The fusion planner: which nodes are views, inlined, prologues or roots of fused groups, how
//! groups share kernels and launches, and each group's kernel assembled from its generated
//! body ([`plan_opts`]).

use std::collections::HashMap;
use std::fmt::Write as _;

use petite_graph::{Dtype, NodeId, Op, Program};

#[cfg(doc)]
use super::Attend;
use super::attend::{attend, fused_attention_queries};
use super::codegen::{Gen, Generated, gen_err};
use super::ir::render;
use super::options::Options;
use super::rewrite::{UNROLL, UNROLL_FROM, beside, rows_unrolled, unrolled, with_first};
use super::rows::{masked, row_kernel, scaled, widened};
use super::views::{operand_view, whole};
use super::{Folded, Fusion, Group, Role, read_from};
use crate::Result;
use crate::source::fused_prelude;

/// Nodes one group may compute (bounds the generated source).
const MAX_GROUP: usize = 64;

fn fusible(op: &Op) -> bool {
    matches!(
        op,
        Op::Binary { .. }
            | Op::BinaryScalar { .. }
            | Op::Compare { .. }
            | Op::Logical { .. }
            | Op::Not
            | Op::Unary { .. }
            | Op::Cast { .. }
            | Op::Expand { .. }
            | Op::Where
            | Op::Concat { .. }
            | Op::Slice { .. }
            | Op::Permute { .. }
            | Op::Reshape { .. }
    )
}

/// A permute that moves only dims of size 1 (pi0.5's one-KV-head `[1, S, 1, D]` →
/// `[1, 1, S, D]`): the same bytes in the same order, so unfused it is a free view like a
/// reshape instead of a copy (a launch a layer in the step).
pub fn moves_only_unit_dims(p: &Program, id: NodeId) -> bool {
    let Op::Permute { perm } = &p.node(id).op else {
        return false;
    };
    let Some(x) = p.node(p.node(id).inputs[0]).tensor() else {
        return false;
    };
    let kept: Vec<usize> = perm.iter().copied().filter(|&d| x.shape[d] != 1).collect();
    kept.windows(2).all(|w| w[0] < w[1])
}

/// Plans the fusion of `program`'s `live` nodes; `is_output` marks program outputs (always
/// materialized). bf16 attentions are fused as on an sm_90 device
/// ([`fused_attention_queries`]).
pub fn plan(program: &Program, live: &[bool], is_output: &[bool]) -> Result<Fusion> {
    plan_with(program, live, is_output, fused_attention_queries((9, 0)))
}

/// [`plan`], fusing bf16 attentions of up to `attention_queries` queries ([`Attend`]; 0: none,
/// as on GPUs without bf16 tensor-core `mma`, before sm_80).
pub fn plan_with(
    program: &Program,
    live: &[bool],
    is_output: &[bool],
    attention_queries: usize,
) -> Result<Fusion> {
    plan_opts(program, live, is_output, Options::new(attention_queries))
}

/// [`plan_opts`] of a whole program: every output's ancestor live, its outputs materialized
/// (as [`crate::DeviceProgram::load`] plans it).
pub fn plan_program(program: &Program, options: Options) -> Result<Fusion> {
    let roots: Vec<NodeId> = program.outputs.iter().map(|o| o.value).collect();
    let live = program.ancestors(&roots);
    let mut is_output = vec![false; program.len()];
    for &r in &roots {
        is_output[r.index()] = true;
    }
    plan_opts(program, &live, &is_output, options)
}

/// [`plan`] with `options`.
pub fn plan_opts(
    program: &Program,
    live: &[bool],
    is_output: &[bool],
    options: Options,
) -> Result<Fusion> {
    let Options {
        attention_queries,
        pairs,
        offset_params,
        unrolled_rows,
        weight_only: weight_only_products,
    } = options;
    let order = program.topo_order()?;
    let consumers = program.consumers();
    let n = program.len();
    let mut group_of: Vec<Option<usize>> = vec![None; n];
    let mut size: Vec<usize> = Vec::new();
    let mut roots: Vec<NodeId> = Vec::new();
    let mut role = vec![Role::Plain; n];
    let live_consumers = |v: NodeId| {
        let mut cs: Vec<NodeId> = consumers[v.index()]
            .iter()
            .copied()
            .filter(|c| live[c.index()])
            .collect();
        cs.sort();
        cs.dedup();
        cs.len()
    };
    let mut views = HashMap::new();
    for &id in &order {
        let operands = match program.node(id).op {
            Op::MatMul => 2,
            Op::Attention { .. } => 3,
            _ => 0,
        };
        if !live[id.index()] || operands == 0 {
            continue;
        }
        for j in 0..operands {
            // Attention reads q, k and v as row-major `[S, D]` blocks a head.
            if let Some((v, chain)) = operand_view(program, id, j, &live_consumers, is_output)
                && crate::plan::MatOperand::from_view(&v.shape, &v.strides)
                    .is_ok_and(|m| operands == 2 || (v.shape.len() == 4 && m.col_stride == 1))
            {
                for c in chain {
                    role[c.index()] = Role::View;
                }
                views.insert((id, j), v);
            }
        }
    }
    // Row kernels (norms, last-axis softmax) load their input through its dtype and compute in
    // f32, so a widening cast (bf16/f16 → f32, exact) that feeds only one is read in place; and
    // a softmax read only by a narrowing cast is run by that cast, writing its dtype.
    let mut runs_input = vec![false; n];
    let mut masks = HashMap::new();
    for &id in &order {
        let i = id.index();
        if !live[i] || !row_kernel(program, id) {
            continue;
        }
        let mut x = program.node(id).inputs[0];
        let mut folded = None;
        if let Some((a, m)) = masked(program, id, &live_consumers, is_output)
            && role[m.index()] != Role::View
        {
            role[x.index()] = Role::View;
            views.insert((id, 0), whole(program, a));
            folded = Some(Folded {
                mask: m,
                scale: None,
            });
            x = a;
        }
        if role[x.index()] == Role::Plain
            && let Some(v) = widened(program, x, &live_consumers, is_output)
        {
            role[x.index()] = Role::View;
            let base = v.base;
            views.insert((id, 0), v);
            // Under a folded mask, a 16-bit scaling of the widened value folds in too.
            if let Some(f) = &mut folded
                && let Some((src, s, d)) = scaled(program, base, &live_consumers, is_output)
            {
                role[base.index()] = Role::View;
                views.insert((id, 0), whole(program, src));
                f.scale = Some((s, d));
            }
        }
        if let Some(f) = folded {
            masks.insert(id, f);
        }
        if matches!(program.node(id).op, Op::Softmax { .. })
            && !is_output[i]
            && live_consumers(id) == 1
            && let Some(&c) = consumers[i].iter().find(|c| live[c.index()])
            && matches!(program.node(c).op, Op::Cast { to } if to.is_float())
        {
            role[i] = Role::Narrowed;
            runs_input[c.index()] = true;
        }
    }
    // A head-merging permute of a matmul's or attention's result is written by their GEMM.
    for &id in &order {
        let i = id.index();
        if !live[i]
            || role[i] != Role::Plain
            || !matches!(&program.node(id).op, Op::Permute { perm } if perm == &[0, 2, 1, 3])
        {
            continue;
        }
        let m = program.node(id).inputs[0];
        let producer = program.node(m);
        if matches!(producer.op, Op::MatMul | Op::Attention { .. })
            && role[m.index()] == Role::Plain
            && live_consumers(m) == 1
            && !is_output[m.index()]
            && producer.tensor().is_some_and(|t| {
                // Attention steps through B itself; a matmul's GEMM batches heads only.
                t.shape.len() == 4
                    && (t.shape[0] == 1 || matches!(producer.op, Op::Attention { .. }))
            })
        {
            role[m.index()] = Role::Transposed;
            runs_input[i] = true;
        }
    }
    let mut attentions = HashMap::new();
    for &id in &order {
        if !live[id.index()] || !matches!(role[id.index()], Role::Plain | Role::Transposed) {
            continue;
        }
        if let Some((a, [sm, cast])) = attend(
            program,
            id,
            &role,
            &views,
            &masks,
            &runs_input,
            &live_consumers,
            is_output,
            attention_queries,
        ) {
            for n in [a.logits, sm, cast] {
                role[n.index()] = Role::Attended;
            }
            if a.pieces.is_some() {
                for concat in [a.k.base, a.v.base] {
                    role[concat.index()] = Role::Attended;
                }
            }
            attentions.insert(id, a);
        }
    }
    for &id in order.iter().rev() {
        let i = id.index();
        let node = program.node(id);
        if !live[i]
            || !fusible(&node.op)
            || node.tensor().is_none()
            || role[i] == Role::View
            || role[i] == Role::Attended
            || runs_input[i]
        {
            continue;
        }
        let mut cs: Vec<NodeId> = consumers[i]
            .iter()
            .copied()
            .filter(|c| live[c.index()])
            .collect();
        cs.sort();
        cs.dedup();
        let joined = if is_output[i] || cs.is_empty() {
            None
        } else {
            let g = group_of[cs[0].index()];
            match g {
                Some(g)
                    if cs.iter().all(|c| group_of[c.index()] == Some(g)) && size[g] < MAX_GROUP =>
                {
                    Some(g)
                }
                _ => None,
            }
        };
        match joined {
            Some(g) => {
                group_of[i] = Some(g);
                size[g] += 1;
                role[i] = Role::Inlined;
            }
            None if matches!(node.op, Op::Reshape { .. }) || moves_only_unit_dims(program, id) => {}
            None => {
                let g = roots.len();
                roots.push(id);
                size.push(1);
                group_of[i] = Some(g);
                role[i] = Role::Root(g);
            }
        }
    }
    // An f32 linear with a bias, read by one fused group alone, has the bias added there.
    let mut biases = HashMap::new();
    for &id in &order {
        let i = id.index();
        let node = program.node(id);
        let f32_of = |v: NodeId| {
            program
                .node(v)
                .tensor()
                .is_some_and(|t| t.dtype == Dtype::F32)
        };
        if !live[i]
            || role[i] != Role::Plain
            || is_output[i]
            || !matches!(node.op, Op::Linear)
            || node.inputs.len() != 3
            || !f32_of(id)
            || !f32_of(node.inputs[1])
        {
            continue;
        }
        let mut cs = consumers[i].iter().filter(|c| live[c.index()]);
        let Some(g) = cs.next().and_then(|c| group_of[c.index()]) else {
            continue;
        };
        if cs.all(|c| group_of[c.index()] == Some(g)) {
            biases.insert(id, node.inputs[2]);
        }
    }
    // A norm read only inside one group of its own shape is that group's prologue.
    let mut prologue_of: Vec<Option<NodeId>> = vec![None; roots.len()];
    for &id in &order {
        let i = id.index();
        if !live[i]
            || role[i] != Role::Plain
            || is_output[i]
            || !matches!(
                program.node(id).op,
                Op::LayerNorm { .. } | Op::RmsNorm { .. }
            )
        {
            continue;
        }
        let mut cs = consumers[i].iter().filter(|c| live[c.index()]);
        let Some(g) = cs.next().and_then(|c| group_of[c.index()]) else {
            continue;
        };
        if cs.all(|c| group_of[c.index()] == Some(g))
            && prologue_of[g].is_none()
            && program.node(roots[g]).tensor().map(|t| &t.shape)
                == program.node(id).tensor().map(|t| &t.shape)
        {
            prologue_of[g] = Some(id);
        }
    }
    // A norm left a kernel of its own whose input is a fused group's value (the prefix's
    // residual sums) roots a group of its own, the norm its prologue and nothing after it, so
    // that the sum can be computed first by its kernel (below): the same `norm_stats` and
    // `norm_elem` as `pt_norm`, stored in the norm's dtype, so the same bits.
    let taken: Vec<NodeId> = prologue_of.iter().flatten().copied().collect();
    for &id in &order {
        let i = id.index();
        if !live[i]
            || role[i] != Role::Plain
            || taken.contains(&id)
            || !matches!(
                program.node(id).op,
                Op::LayerNorm { .. } | Op::RmsNorm { .. }
            )
        {
            continue;
        }
        let x = read_from(program, &views, id, 0);
        if matches!(role[x.index()], Role::Root(_)) {
            let g = roots.len();
            roots.push(id);
            size.push(1);
            group_of[i] = Some(g);
            role[i] = Role::Root(g);
            prologue_of.push(Some(id));
        }
    }
    let mut source = fused_prelude();
    let mut kernels: Vec<String> = Vec::new();
    let mut by_body: HashMap<String, usize> = HashMap::new();
    let mut generated = Vec::with_capacity(roots.len());
    for g in 0..roots.len() {
        let generate = |prologue: Option<NodeId>| {
            let mut cg = Gen {
                program,
                group: g,
                group_of: &group_of,
                body: Vec::new(),
                memo: HashMap::new(),
                leaves: Vec::new(),
                vars: 0,
                prologue,
                root_coords: Vec::new(),
                biases: &biases,
                offsets: Vec::new(),
                offset_params,
                unrolled_rows,
                views: &views,
            };
            cg.kernel_body(roots[g]).map(|body| Generated {
                body,
                leaves: cg.leaves,
                prologue,
                offsets: cg.offsets,
            })
        };
        // A prologue read anywhere but at its own element falls back to a plain group.
        let x = match prologue_of[g].map(|n| generate(Some(n))) {
            Some(Ok(x)) => x,
            _ => generate(None)?,
        };
        if let Some(n) = x.prologue
            && n != roots[g]
        {
            role[n.index()] = Role::Prologue;
        }
        generated.push(x);
    }
    // A group whose root is only the input of another group's prologue norm (and read after
    // that group) is computed by that group's kernel, row by row, before the norm's statistics.
    let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(k, &v)| (v, k)).collect();
    let mut first: Vec<Option<usize>> = vec![None; roots.len()];
    let mut absorbed = vec![false; roots.len()];
    for g in 0..roots.len() {
        let Some(n) = generated[g].prologue else {
            continue;
        };
        let x = read_from(program, &views, n, 0);
        let Role::Root(r) = role[x.index()] else {
            continue;
        };
        let numel = |v: NodeId| program.node(v).tensor().map(|t| t.numel());
        let after = consumers[x.index()].iter().all(|&c| {
            !live[c.index()] || c == n || role[c.index()] == Role::View || pos[&c] > pos[&roots[g]]
        });
        if r != g
            && generated[r].prologue.is_none()
            && !absorbed[r]
            && first[r].is_none()
            && numel(x) == numel(roots[g])
            && !generated[g].leaves.contains(&x)
            && after
        {
            first[g] = Some(r);
            absorbed[r] = true;
        }
    }
    // Each group's body (with its first, unrolled where it pays) and its launch's blocks.
    let mut bodies = Vec::with_capacity(roots.len());
    for (g, &root) in roots.iter().enumerate() {
        let (mut body, prologue) = (generated[g].body.clone(), generated[g].prologue);
        if let Some(r) = first[g] {
            body = with_first(&body, &generated[r].body).ok_or_else(|| {
                gen_err(root, program, "a prologue kernel without its statistics")
            })?;
        }
        let numel: usize = program
            .node(root)
            .tensor()
            .map_or(0, |t| t.shape.iter().product());
        let (body, unroll) = match (prologue, numel >= UNROLL_FROM) {
            (None, true) => unrolled(&body).map_or((body, 1), |b| (b, UNROLL)),
            (Some(_), _) if unrolled_rows => (rows_unrolled(&body), 1),
            _ => (body, 1),
        };
        let blocks = crate::plan::grid_for(numel.div_ceil(unroll));
        bodies.push((body, unroll, blocks));
    }
    // Two plain groups launched one after the other (only products between them), the second
    // not reading the first, whose value nothing reads before the second: one launch, the
    // first's elements on blocks after the second's ([`Group::with`]). pi0.5's q and k RoPEs.
    let mut with: Vec<Option<usize>> = vec![None; roots.len()];
    let plain = |g: usize, absorbed: &[bool]| {
        generated[g].prologue.is_none() && first[g].is_none() && !absorbed[g]
    };
    let mut open: Option<usize> = None;
    for &id in &order {
        let Role::Root(g) = role[id.index()] else {
            continue;
        };
        if !live[id.index()] || absorbed[g] {
            continue;
        }
        let pair = open.filter(|&a| {
            // The first's value and the free views of it (reshapes, unit-dim permutes: they
            // only alias its buffer): none read by the second, none read before it.
            let mut aliases = vec![roots[a]];
            let mut k = 0;
            while k < aliases.len() {
                for &c in &consumers[aliases[k].index()] {
                    let free = role[c.index()] == Role::Plain
                        && (matches!(program.node(c).op, Op::Reshape { .. })
                            || moves_only_unit_dims(program, c));
                    if live[c.index()] && free && !aliases.contains(&c) {
                        aliases.push(c);
                    }
                }
                k += 1;
            }
            pairs
                && plain(g, &absorbed)
                && aliases.iter().all(|&v| {
                    !generated[g].leaves.contains(&v)
                        && consumers[v.index()]
                            .iter()
                            .all(|c| !live[c.index()] || aliases.contains(c) || pos[c] > pos[&id])
                })
        });
        match pair {
            Some(a) => {
                with[g] = Some(a);
                absorbed[a] = true;
                open = None;
            }
            None => open = plain(g, &absorbed).then_some(g),
        }
    }
    let mut groups = Vec::with_capacity(roots.len());
    for (g, &root) in roots.iter().enumerate() {
        let Generated {
            leaves,
            prologue,
            offsets,
            ..
        } = generated[g].clone();
        let (mut body, unroll, mut blocks) = bodies[g].clone();
        let mut extra = String::new();
        // The offsets follow every pointer: the group's own (`s…`), then the other's (`t…`).
        let mut offs: String = (0..offsets.len()).map(|j| format!(", i64 s{j}")).collect();
        if let Some(o) = first[g].or(with[g]) {
            for j in 0..generated[o].offsets.len() {
                let _ = write!(offs, ", i64 t{j}");
            }
        }
        if let Some(r) = first[g] {
            for j in 0..generated[r].leaves.len() {
                let _ = write!(extra, ", const void* q{j}");
            }
            extra.push_str(", void* qo");
        }
        if let Some(a) = with[g] {
            let (ga, gb) = (bodies[a].2, blocks);
            body = beside(&body, gb, &bodies[a].0, ga);
            blocks = ga + gb;
            extra.push_str(", i64 qn");
            for j in 0..generated[a].leaves.len() {
                let _ = write!(extra, ", const void* q{j}");
            }
            extra.push_str(", void* qo");
        }
        let params: String = (0..leaves.len())
            .map(|j| format!(", const void* p{j}"))
            .collect();
        let norm = if prologue.is_some() {
            "NormParams np, const void* nx, const void* nw, const void* nb, "
        } else {
            ""
        };
        // The kernel's text but for its name: groups whose texts are equal share one kernel.
        let body = render(&body);
        let text =
            format!("({norm}i64 n{params}, void* po{extra}{offs}) {{\n  PT_PDL();\n{body}}}\n");
        let k = match by_body.get(&text) {
            _ if absorbed[g] => None,
            Some(&k) => Some(k),
            None => {
                let k = kernels.len();
                let name = format!("pt_fused_{k}");
                let _ = write!(source, "extern \"C\" __global__ void {name}{text}");
                kernels.push(name);
                by_body.insert(text, k);
                Some(k)
            }
        };
        groups.push(Group {
            root,
            kernel: k,
            leaves,
            nodes: size[g],
            prologue,
            unroll,
            blocks,
            first: first[g],
            with: with[g],
            absorbed: absorbed[g],
            offsets,
        });
    }
    if weight_only_products {
        weight_only(program, live, &consumers, &mut role);
    }
    let attention_kernels = (!attentions.is_empty()).then(|| {
        let at = kernels.len();
        kernels.extend(crate::source::ATTENTION_KERNELS.map(String::from));
        [at, at + 1, at + 2]
    });
    Ok(Fusion {
        role,
        groups,
        kernels,
        source,
        views,
        masks,
        attentions,
        biases,
        attention_kernels,
    })
}

/// Marks [`Role::WeightOnly`] each live dequantize to bf16 read only (as their weight) by
/// linears of bf16 inputs with at most [`super::WQ_ROWS`] rows and in features a multiple of
/// 32 (`pt_wq_gemm`'s K step), which is not an output.
fn weight_only(program: &Program, live: &[bool], consumers: &[Vec<NodeId>], role: &mut [Role]) {
    for id in program.ids() {
        let node = program.node(id);
        let (Op::Dequantize { to: Dtype::Bf16 }, Some(w)) = (&node.op, node.tensor()) else {
            continue;
        };
        if !live[id.index()]
            || w.shape.len() != 2
            || !w.shape[1].is_multiple_of(32)
            || program.outputs.iter().any(|o| o.value == id)
        {
            continue;
        }
        let readers: Vec<NodeId> = consumers[id.index()]
            .iter()
            .copied()
            .filter(|c| live[c.index()])
            .collect();
        let small_linear = |c: &NodeId| {
            let n = program.node(*c);
            let x = program.node(n.inputs[0]).tensor();
            matches!(n.op, Op::Linear)
                && n.inputs.get(1) == Some(&id)
                && n.inputs[0] != id
                && n.inputs.get(2) != Some(&id)
                && x.is_some_and(|x| {
                    x.dtype == Dtype::Bf16
                        && x.shape.iter().product::<usize>() / w.shape[1].max(1) <= super::WQ_ROWS
                })
        };
        if !readers.is_empty() && readers.iter().all(small_linear) {
            role[id.index()] = Role::WeightOnly;
        }
    }
}
