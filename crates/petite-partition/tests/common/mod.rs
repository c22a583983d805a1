//! An independent checker of plan invariants, shared by the test files.
#![allow(dead_code)]

use petite_graph::{NodeId, Op, Program};
use petite_partition::{PartitionOptions, Plan, plan};

/// Value ids whose cone reaches back only to inputs and constants (recomputed, independently).
pub fn input_only(p: &Program) -> Vec<bool> {
    let order = p.topo_order().unwrap();
    let mut io = vec![false; p.len()];
    for id in order {
        let n = p.node(id);
        io[id.index()] = !n.op.is_source()
            && n.inputs.iter().all(|v| {
                matches!(p.node(*v).op, Op::Input { .. } | Op::Constant { .. }) || io[v.index()]
            });
    }
    io
}

/// Checks every rule the plan must satisfy; panics with a message naming what broke.
pub fn check(p: &Program, plan: &Plan, cap: u64, limit: u64) {
    let n = p.len();
    let io = input_only(p);
    let mut primary: Vec<Option<usize>> = vec![None; n];
    let mut rank = vec![0usize; n];
    for (i, id) in p.topo_order().unwrap().into_iter().enumerate() {
        rank[id.index()] = i;
    }
    for (e, eng) in plan.engines.iter().enumerate() {
        assert_eq!(eng.index, e);
        for w in eng.nodes.windows(2) {
            assert!(
                rank[w[0].index()] < rank[w[1].index()],
                "engine {e}: nodes out of order"
            );
        }
        let recomputed: std::collections::BTreeSet<NodeId> =
            eng.recomputed.iter().copied().collect();
        for &id in &eng.nodes {
            if recomputed.contains(&id) {
                assert!(
                    io[id.index()],
                    "engine {e} recomputes {id}, which is not input-only"
                );
                continue;
            }
            assert!(
                primary[id.index()].is_none(),
                "{id} is computed by two engines"
            );
            primary[id.index()] = Some(e);
        }
    }
    for id in p.ids() {
        if !p.node(id).op.is_source() {
            assert!(
                primary[id.index()].is_some(),
                "{id} is computed by no engine"
            );
        }
    }
    let mut member = vec![usize::MAX; n];
    for (e, eng) in plan.engines.iter().enumerate() {
        for &id in &eng.nodes {
            member[id.index()] = e;
        }
        let inside = |v: NodeId| member[v.index()] == e;
        let mut weights = Vec::new();
        for &id in &eng.nodes {
            let node = p.node(id);
            if let Op::GetItem { .. } = node.op {
                assert!(
                    inside(node.inputs[0]),
                    "engine {e}: getitem {id} without its producer"
                );
            }
            for &v in &node.inputs {
                match p.node(v).op {
                    Op::Weight { .. } => weights.push(v),
                    Op::Constant { .. } => {}
                    Op::Input { .. } => assert!(
                        eng.inputs.iter().any(|i| i.value == v && i.from.is_none()),
                        "engine {e}: program input {v} not listed"
                    ),
                    _ if inside(v) => {}
                    _ => {
                        let i = eng
                            .inputs
                            .iter()
                            .find(|i| i.value == v)
                            .unwrap_or_else(|| panic!("engine {e}: {v} read but not received"));
                        let from = i.from.expect("crossing value has a producer engine");
                        assert!(from < e, "engine {e}: {v} comes from later engine {from}");
                        assert_eq!(primary[v.index()], Some(from));
                        assert!(!p.node(v).ty.is_tuple(), "a tuple crosses into engine {e}");
                        assert!(
                            plan.engines[from].outputs.iter().any(|o| o.value == v),
                            "engine {from} does not output {v}"
                        );
                        if io[v.index()] {
                            assert!(
                                (p.node(v).ty.nbytes() as u64) <= limit,
                                "engine {e}: input-only {v} of {} bytes crosses (limit {limit})",
                                p.node(v).ty.nbytes()
                            );
                            assert!(
                                !(plan.recompute_positional && p.node(v).recompute),
                                "engine {e}: input-only {v} is marked recompute but crosses"
                            );
                        }
                    }
                }
            }
        }
        weights.sort();
        weights.dedup();
        assert_eq!(weights, eng.weights, "engine {e}: weight list");
        let bytes: u64 = weights.iter().map(|w| p.node(*w).ty.nbytes() as u64).sum();
        assert_eq!(bytes, eng.weight_bytes);
        if bytes > cap {
            assert!(eng.over_cap);
            let readers: Vec<NodeId> = eng
                .nodes
                .iter()
                .copied()
                .filter(|&id| {
                    p.node(id)
                        .inputs
                        .iter()
                        .any(|v| matches!(p.node(*v).op, Op::Weight { .. }))
                })
                .collect();
            assert_eq!(
                readers.len(),
                1,
                "engine {e} is over the cap with several weight readers"
            );
            let alone: u64 = p
                .node(readers[0])
                .inputs
                .iter()
                .filter(|v| matches!(p.node(**v).op, Op::Weight { .. }))
                .map(|v| p.node(*v).ty.nbytes() as u64)
                .sum();
            assert!(alone > cap, "engine {e} is over the cap but its group fits");
        } else {
            assert!(!eng.over_cap);
        }
    }
    // Weights' last use.
    for w in &plan.weights {
        let readers: Vec<usize> = plan
            .engines
            .iter()
            .filter(|e| e.weights.contains(&w.node))
            .map(|e| e.index)
            .collect();
        assert_eq!(readers, w.engines);
        assert_eq!(readers.last().copied(), w.last_engine);
    }
    // Program outputs are produced by some engine (or are sources).
    for o in &p.outputs {
        if p.node(o.value).op.is_source() {
            continue;
        }
        let e = primary[o.value.index()].unwrap();
        assert!(
            plan.engines[e]
                .outputs
                .iter()
                .any(|x| x.value == o.value && x.program_output),
            "output {} not returned by engine {e}",
            o.name
        );
    }
    // Boundaries: exactly the values produced at or before and read after.
    assert_eq!(plan.boundaries.len(), plan.engines.len().saturating_sub(1));
    for b in &plan.boundaries {
        let mut expect: Vec<NodeId> = Vec::new();
        for eng in &plan.engines[b.after + 1..] {
            for i in &eng.inputs {
                if let Some(f) = i.from
                    && f <= b.after
                {
                    expect.push(i.value);
                }
            }
        }
        expect.sort();
        expect.dedup();
        assert_eq!(expect, b.values, "boundary after {}", b.after);
        let bytes: u64 = expect.iter().map(|v| p.node(*v).ty.nbytes() as u64).sum();
        assert_eq!(bytes, b.bytes);
    }
    // Every engine extracts as a valid standalone program.
    for e in 0..plan.engines.len() {
        plan.engine_program(p, e)
            .unwrap_or_else(|err| panic!("engine {e}: {err}"));
    }
}

/// Plans with the default cost model and checks the result.
pub fn plan_checked(p: &Program, cap: u64, limit: u64) -> Plan {
    let opts = PartitionOptions::new(cap).crossing_limit(limit);
    let plan = plan(p, &opts).unwrap();
    check(p, &plan, cap, limit);
    plan
}
