//! One test per planning rule, on small hand-built programs.
mod common;

use common::{check, plan_checked};
use petite_graph::{Builder, Dtype, NodeId, Op, Program};
use petite_partition::{Error, PartitionOptions, plan};

const F: Dtype = Dtype::F32;

/// x → linear(w0) → split → [getitem 0 → linear(w1)], [getitem 1 built late → linear(w2)] → add.
fn split_program() -> (Program, NodeId, Vec<NodeId>) {
    let mut b = Builder::new();
    let x = b.input("x", F, &[4, 8]).unwrap();
    let w0 = b.weight("w0", F, &[8, 8]).unwrap();
    let y = b.linear(x, w0, None).unwrap();
    let t = b
        .node(
            Op::Split {
                axis: 1,
                sizes: vec![4, 4],
            },
            &[y],
        )
        .unwrap();
    let g0 = b.node(Op::GetItem { index: 0 }, &[t]).unwrap();
    let w1 = b.weight("w1", F, &[8, 4]).unwrap();
    let a = b.linear(g0, w1, None).unwrap();
    // The second getitem comes after other work in node order.
    let g1 = b.node(Op::GetItem { index: 1 }, &[t]).unwrap();
    let w2 = b.weight("w2", F, &[8, 4]).unwrap();
    let c = b.linear(g1, w2, None).unwrap();
    let s = b.add(a, c).unwrap();
    b.output("y", s).unwrap();
    (b.finish().unwrap(), t, vec![g0, g1])
}

fn engine_of(plan: &petite_partition::Plan, id: NodeId) -> usize {
    plan.engines
        .iter()
        .find(|e| e.nodes.contains(&id) && !e.recomputed.contains(&id))
        .map(|e| e.index)
        .unwrap()
}

#[test]
fn getitems_stay_with_their_multi_output_producer() {
    let (p, split, items) = split_program();
    // Caps from "one weight per engine" up: the split group may land on either side of a cut,
    // but never apart.
    for cap in [128, 256, 384, 512] {
        let plan = plan_checked(&p, cap, 64 << 10);
        let e = engine_of(&plan, split);
        for &g in &items {
            assert_eq!(
                engine_of(&plan, g),
                e,
                "cap {cap}: getitem {g} left split {split}"
            );
        }
        if cap < 512 {
            assert!(plan.engines.len() > 1, "cap {cap} must split the program");
        }
    }
}

/// Three linears in a row, each adding an input-only mask `[16, 32]` f32 (2048 bytes) made from
/// input `m`, plus a small input-only row `[32]` (128 bytes).
fn mask_program() -> (Program, NodeId, NodeId) {
    let mut b = Builder::new();
    let x = b.input("x", F, &[16, 32]).unwrap();
    let m = b.input("m", Dtype::U8, &[16]).unwrap();
    b.push_scope("masks");
    let mf = b.cast(m, F).unwrap();
    let mf = b.reshape(mf, &[16, 1]).unwrap();
    let mask = b.expand(mf, &[16, 32]).unwrap();
    let row = b.arange_i64(32).unwrap();
    let row = b.cast(row, F).unwrap();
    b.pop_scope();
    let mut h = x;
    for i in 0..3 {
        let w = b.weight(&format!("w{i}"), F, &[32, 32]).unwrap();
        h = b.linear(h, w, None).unwrap();
        h = b.add(h, mask).unwrap();
        h = b.add(h, row).unwrap();
    }
    b.output("y", h).unwrap();
    (b.finish().unwrap(), mask, row)
}

#[test]
fn large_input_only_value_is_recomputed_in_each_engine() {
    let (p, mask, row) = mask_program();
    let plan = plan_checked(&p, 4096, 1024);
    assert_eq!(plan.engines.len(), 3);
    assert_eq!(engine_of(&plan, mask), 0);
    for e in &plan.engines[1..] {
        assert_eq!(e.recomputed_values, vec![mask], "engine {}", e.index);
        assert!(e.nodes.contains(&mask));
        assert!(e.inputs.iter().all(|i| i.value != mask));
        // The mask is rebuilt from the program input, not received.
        assert!(e.inputs.iter().any(|i| p.input_name(i.value) == Some("m")));
    }
    assert!(plan.boundaries.iter().all(|b| !b.values.contains(&mask)));
    // The small row (128 bytes ≤ 1024) crosses instead of being recomputed.
    for e in &plan.engines[1..] {
        assert!(e.inputs.iter().any(|i| i.value == row && i.from == Some(0)));
    }
    assert!(
        plan.engines[0]
            .outputs
            .iter()
            .any(|o| o.value == row && o.last_reader == Some(2))
    );
}

#[test]
fn input_only_value_below_the_limit_crosses() {
    let (p, mask, _) = mask_program();
    let plan = plan_checked(&p, 4096, 2048);
    assert_eq!(plan.engines.len(), 3);
    for e in &plan.engines[1..] {
        assert!(e.recomputed.is_empty() && e.recomputed_values.is_empty());
        assert!(
            e.inputs
                .iter()
                .any(|i| i.value == mask && i.from == Some(0))
        );
    }
    assert!(plan.boundaries.iter().all(|b| b.values.contains(&mask)));
    // Limit 0 recomputes even the small row.
    let plan = plan_checked(&p, 4096, 0);
    assert!(
        plan.engines[1..]
            .iter()
            .all(|e| e.recomputed_values.len() == 2)
    );
}

#[test]
fn atomic_group_over_the_cap_gets_an_engine_of_its_own() {
    let mut b = Builder::new();
    let x = b.input("x", F, &[4, 8]).unwrap();
    let w0 = b.weight("w0", F, &[8, 8]).unwrap(); // 256 B
    let h = b.linear(x, w0, None).unwrap();
    let big = b.weight("big", F, &[64, 8]).unwrap(); // 2048 B
    let h = b.linear(h, big, None).unwrap();
    let h = b.slice(h, 1, 0, 8, 1).unwrap();
    let w2 = b.weight("w2", F, &[8, 8]).unwrap();
    let h = b.linear(h, w2, None).unwrap();
    let w3 = b.weight("w3", F, &[8, 8]).unwrap();
    let h = b.linear(h, w3, None).unwrap();
    b.output("y", h).unwrap();
    let p = b.finish().unwrap();
    let plan = plan_checked(&p, 512, 64 << 10);
    let over: Vec<_> = plan.engines.iter().filter(|e| e.over_cap).collect();
    assert_eq!(over.len(), 1);
    assert_eq!(over[0].weights, vec![big]);
    assert_eq!(over[0].weight_bytes, 2048);
    for e in plan.engines.iter().filter(|e| !e.over_cap) {
        assert!(e.weight_bytes <= 512);
    }
    // w2 and w3 share an engine after the big one; w0 is before it.
    assert_eq!(plan.engines.len(), 3);
    assert_eq!(plan.engines[2].weights, vec![w2, w3]);
}

#[test]
fn shared_weight_is_released_after_its_last_engine() {
    let mut b = Builder::new();
    let x = b.input("x", F, &[4, 8]).unwrap();
    let ws = b.weight("shared", F, &[8, 8]).unwrap();
    let w1 = b.weight("w1", F, &[8, 8]).unwrap();
    let w2 = b.weight("w2", F, &[8, 8]).unwrap();
    let h = b.linear(x, ws, None).unwrap();
    let h = b.linear(h, w1, None).unwrap();
    let h = b.linear(h, w2, None).unwrap();
    let h = b.linear(h, ws, None).unwrap();
    b.output("y", h).unwrap();
    let p = b.finish().unwrap();
    let plan = plan_checked(&p, 256, 64 << 10);
    assert_eq!(plan.engines.len(), 4);
    let shared = plan.weights.iter().find(|w| w.name == "shared").unwrap();
    assert_eq!(shared.engines, vec![0, 3]);
    assert_eq!(shared.last_engine, Some(3));
    let w1u = plan.weights.iter().find(|w| w.node == w1).unwrap();
    assert_eq!(w1u.last_engine, Some(1));
    // With room for two weights, the shared one is charged once per engine.
    let plan = plan_checked(&p, 512, 64 << 10);
    assert_eq!(plan.engines.len(), 2);
    assert_eq!(
        plan.weights.iter().find(|w| w.node == ws).unwrap().engines,
        vec![0, 1]
    );
    // All four together read 768 distinct bytes, not 1024.
    let plan = plan_checked(&p, 768, 64 << 10);
    assert_eq!(plan.engines.len(), 1);
    assert_eq!(plan.engines[0].weight_bytes, 768);
}

#[test]
fn cuts_prefer_few_crossing_bytes() {
    // Layers: wide = linear(x) [4, 64]; x = x + linear(wide) [4, 8]. Inside a layer 1 KiB
    // crosses; between layers 128 B. Cap = two layers' weights.
    let mut b = Builder::new();
    let mut x = b.input("x", F, &[4, 8]).unwrap();
    let mut residuals = Vec::new();
    for i in 0..6 {
        let up = b.weight(&format!("up{i}"), F, &[64, 8]).unwrap();
        let down = b.weight(&format!("down{i}"), F, &[8, 64]).unwrap();
        let wide = b.linear(x, up, None).unwrap();
        let d = b.linear(wide, down, None).unwrap();
        x = b.add(x, d).unwrap();
        residuals.push(x);
    }
    b.output("y", x).unwrap();
    let p = b.finish().unwrap();
    // 3 engines are needed either way. Filling each engine up to the cap (10340 B: two and a
    // half layers) would cut inside layers, where 1 KiB + 128 B cross; only layer-aligned cuts
    // carry 128 B.
    let plan = plan_checked(&p, 2 * 4096 + 2048 + 100, 64 << 10);
    assert_eq!(plan.engines.len(), 3);
    for bd in &plan.boundaries {
        assert_eq!(bd.bytes, 128, "boundary {bd:?}");
        assert_eq!(bd.values.len(), 1);
        assert!(residuals.contains(&bd.values[0]));
    }
}

#[test]
fn same_program_same_plan_bytes() {
    let (p, _, _) = mask_program();
    let opts = PartitionOptions::new(4096).crossing_limit(1024);
    let a = plan(&p, &opts).unwrap().to_json().unwrap();
    let b = plan(&p, &opts).unwrap().to_json().unwrap();
    assert_eq!(a, b);
    let round = Program::from_json(&p.to_json().unwrap()).unwrap();
    let c = plan(&round, &opts).unwrap().to_json().unwrap();
    assert_eq!(a, c);
    let back = petite_partition::Plan::from_json(&a).unwrap();
    assert_eq!(back.to_json().unwrap(), a);
}

#[test]
fn bad_options_and_programs_are_named() {
    let (p, _, _) = mask_program();
    let e = plan(&p, &PartitionOptions::new(0)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::InvalidOption {
                setting: "engine_cap",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("engine_cap"));
    let e = plan(&p, &PartitionOptions::new(100)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::CapTooSmall { bytes: 4096, .. }), "{msg}");
    assert!(
        msg.contains("engine_cap") && msg.contains("linear"),
        "{msg}"
    );

    // A cycle: the first linear reads the last add.
    let mut cyc = p.clone();
    let last = cyc.outputs[0].value;
    let first_linear = cyc
        .ids()
        .find(|&i| matches!(cyc.node(i).op, Op::Linear))
        .unwrap();
    cyc.nodes[first_linear.index()].inputs[0] = last;
    let msg = plan(&cyc, &PartitionOptions::new(4096))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("cycle") && msg.contains('%'), "{msg}");

    // A dangling value.
    let mut dang = p.clone();
    dang.nodes[first_linear.index()].inputs[0] = NodeId(9999);
    let msg = plan(&dang, &PartitionOptions::new(4096))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("%9999") && msg.contains("linear"), "{msg}");

    // A plan used with another program.
    let plan_a = plan(&p, &PartitionOptions::new(4096)).unwrap();
    let (q, _, _) = split_program();
    assert!(matches!(
        plan_a.engine_program(&q, 0),
        Err(Error::Mismatch(_))
    ));
    assert!(matches!(
        plan_a.engine_program(&p, 99),
        Err(Error::NoSuchEngine { index: 99, .. })
    ));
}

#[test]
fn million_node_chain_plans_without_recursion() {
    // Run on a small stack: any recursion over the chain would overflow it.
    std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(|| {
            let mut b = Builder::new();
            let mut x = b.input("x", F, &[1, 1]).unwrap();
            for i in 0..1_000_000usize {
                x = if i % 100_000 == 0 {
                    let w = b.weight(&format!("w{i}"), F, &[1, 1]).unwrap();
                    b.linear(x, w, None).unwrap()
                } else {
                    b.neg(x).unwrap()
                };
            }
            b.output("y", x).unwrap();
            let p = b.finish().unwrap();
            assert!(p.len() > 1_000_000);
            let plan = plan(&p, &PartitionOptions::new(4)).unwrap();
            assert_eq!(plan.engines.len(), 10);
            let total: usize = plan.engines.iter().map(|e| e.nodes.len()).sum();
            assert_eq!(total, 1_000_000);
            assert!(
                plan.boundaries
                    .iter()
                    .all(|bd| bd.bytes == 4 && bd.values.len() == 1)
            );
            check(&p, &plan, 4, 64 << 10);
        })
        .unwrap()
        .join()
        .unwrap();
}

#[test]
fn marked_and_rope_table_operands_are_recomputed_whatever_their_size() {
    // Two small input-only values (128 B, under a 1 KiB limit): `row` marked `recompute`, and
    // `cos`/`sin` read by fused rope ops. Both are recomputed, not received; unmarked, with
    // positional recompute off, they cross like any small value.
    let mut b = Builder::new();
    let x = b.input("x", F, &[1, 1, 4, 32]).unwrap();
    let pos = b.input("pos", Dtype::I64, &[4]).unwrap();
    b.push_scope("masks");
    let pf = b.cast(pos, F).unwrap();
    let pf = b.reshape(pf, &[1, 1, 4, 1]).unwrap();
    let emb = b.expand(pf, &[1, 1, 4, 32]).unwrap();
    let cos = b.cos(emb).unwrap();
    let sin = b.sin(emb).unwrap();
    let row = b.arange_i64(32).unwrap();
    let row = b.cast(row, F).unwrap();
    let row = b.mark_recompute(row).unwrap();
    b.pop_scope();
    let mut h = x;
    for i in 0..3 {
        let w = b.weight(&format!("w{i}"), F, &[32, 32]).unwrap();
        h = b.linear(h, w, None).unwrap();
        h = b.rope(h, cos, sin).unwrap();
        h = b.add(h, row).unwrap();
    }
    b.output("y", h).unwrap();
    let p = b.finish().unwrap();
    assert!(p.node(row).recompute && !p.node(cos).recompute);
    // The hint survives JSON, and is absent from it when false.
    let json = p.to_json().unwrap();
    assert_eq!(json.matches("\"recompute\"").count(), 1);
    assert!(Program::from_json(&json).unwrap().node(row).recompute);

    let marked = plan_checked(&p, 4096, 1024);
    assert_eq!(marked.engines.len(), 3);
    for e in &marked.engines[1..] {
        for v in [cos, sin, row] {
            assert!(e.recomputed_values.contains(&v), "engine {}: {v}", e.index);
            assert!(e.inputs.iter().all(|i| i.value != v));
        }
    }
    let off = PartitionOptions::new(4096)
        .crossing_limit(1024)
        .recompute_positional(false);
    let unmarked = plan(&p, &off).unwrap();
    check(&p, &unmarked, 4096, 1024);
    assert!(!unmarked.recompute_positional);
    for e in &unmarked.engines[1..] {
        assert!(e.recomputed_values.is_empty(), "engine {}", e.index);
        for v in [cos, sin, row] {
            assert!(e.inputs.iter().any(|i| i.value == v && i.from == Some(0)));
        }
    }
}
