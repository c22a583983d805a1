//! pi0.5 programs (small and full size): every rule holds, masks and rotary tables never cross,
//! cuts inside the language model carry only the residual stream.
mod common;

use common::{check, plan_checked};
use petite_graph::{NodeId, Program};
use petite_partition::{PartitionOptions, Plan, plan};
use petite_pi05::{Pi05Config, Precision, build_prefix, build_step};

const MIB: u64 = 1 << 20;

/// Attention masks and rotary cos/sin tables of a program: the values of the builder's `masks`
/// scope that are read outside it.
fn masks_and_tables(p: &Program) -> Vec<NodeId> {
    let in_masks = |id: NodeId| {
        p.node(id)
            .label
            .as_deref()
            .is_some_and(|l| l.starts_with("masks"))
    };
    let consumers = p.consumers();
    p.ids()
        .filter(|&id| in_masks(id) && consumers[id.index()].iter().any(|&c| !in_masks(c)))
        .collect()
}

/// Masks and rotary tables above the crossing limit never cross; returns how many tables are
/// above it (the ones that must be recomputed) and how many cross (small ones).
fn assert_no_large_table_crosses(p: &Program, plan: &Plan) -> (usize, usize) {
    let tables = masks_and_tables(p);
    assert!(!tables.is_empty());
    let large = |v: NodeId| p.node(v).ty.nbytes() as u64 > plan.crossing_limit;
    let mut crossing = 0;
    for e in &plan.engines {
        for i in &e.inputs {
            if i.from.is_some() && tables.contains(&i.value) {
                assert!(
                    !large(i.value),
                    "engine {}: mask/rotary table {} crosses in",
                    e.index,
                    p.describe(i.value)
                );
                crossing += 1;
            }
        }
    }
    (tables.iter().filter(|&&t| large(t)).count(), crossing)
}

#[test]
fn small_programs_plan_under_every_cap() {
    let cfg = Pi05Config::small();
    for prec in [Precision::F32, Precision::Bf16] {
        for (name, p) in [
            ("prefix", build_prefix(&cfg, prec).unwrap()),
            ("step", build_step(&cfg, prec).unwrap()),
        ] {
            let total = p.weight_bytes() as u64;
            for div in [1, 2, 5, 20] {
                let cap = total / div;
                // Tiny caps leave some single weights over the cap: allowed, marked.
                let plan = plan_checked(&p, cap, 64);
                assert!(!plan.engines.is_empty(), "{name} {prec:?} cap {cap}");
                if div > 1 {
                    assert!(plan.engines.len() > 1, "{name} {prec:?} cap {cap}");
                }
                assert_eq!(
                    assert_no_large_table_crosses(&p, &plan).1,
                    0,
                    "{name} {prec:?}"
                );
            }
        }
    }
}

#[test]
fn small_language_model_is_cut_between_layers() {
    let cfg = Pi05Config::small();
    let p = build_prefix(&cfg, Precision::F32).unwrap();
    let layer: u64 = p
        .weights()
        .iter()
        .filter(|w| w.name.contains("language_model.layers.0."))
        .map(|w| w.bytes as u64)
        .sum();
    assert!(layer > 0);
    let residual = [1, cfg.prefix_len(), cfg.language.width];
    // At this size weights are tiny next to activations, so let crossing bytes alone decide
    // (at full size the default overhead, 16 MiB, is 4 residuals; an MLP cut carries 9).
    let opts = PartitionOptions::new(layer + layer / 2)
        .crossing_limit(64)
        .engine_overhead(0);
    let plan = plan(&p, &opts).unwrap();
    check(&p, &plan, opts.engine_cap, 64);
    let mut inside = 0;
    for b in &plan.boundaries {
        let before = plan.engines[b.after].last_label.as_deref().unwrap_or("");
        let after = plan.engines[b.after + 1]
            .first_label
            .as_deref()
            .unwrap_or("");
        if before.starts_with("language.layers") && after.starts_with("language.layers") {
            inside += 1;
            // Only the residual stream crosses (plus ≤ 64-byte input-only values).
            let big: Vec<_> = b
                .values
                .iter()
                .filter(|v| p.node(**v).ty.nbytes() > 64)
                .collect();
            let desc: Vec<String> = b
                .values
                .iter()
                .map(|v| format!("{} {}", p.describe(*v), p.node(*v).ty))
                .collect();
            assert_eq!(big.len(), 1, "boundary {b:?} {desc:?} {before} | {after}");
            assert_eq!(p.node(*big[0]).tensor().unwrap().shape, residual);
        }
    }
    assert!(
        inside >= 1,
        "no cut inside the language model: {:?}",
        plan.boundaries
    );
}

fn full_size(name: &str, p: &Program) {
    let mut total_recomputed = 0;
    for cap in [256 * MIB, 512 * MIB, 1024 * MIB] {
        let opts = PartitionOptions::new(cap);
        let plan = plan(p, &opts).unwrap();
        check(p, &plan, cap, opts.crossing_limit);
        let (large, small_crossing) = assert_no_large_table_crosses(p, &plan);
        assert!(large > 0, "{name}: the attention mask is above the limit");
        // Positional operands are recomputed whatever their size: with the default options no
        // mask or rotary table crosses at all (the step's 25 KiB tables included).
        assert_eq!(small_crossing, 0, "{name} cap {cap}: a small table crosses");
        for e in &plan.engines {
            assert!(
                e.weight_bytes <= cap || e.over_cap,
                "{name} cap {cap}: engine {} has {} bytes",
                e.index,
                e.weight_bytes
            );
            total_recomputed += e.recomputed_values.len();
        }
        let crossing: Vec<u64> = plan.boundaries.iter().map(|b| b.bytes).collect();
        eprintln!(
            "{name} cap {} MiB: {} engines, over cap: {:?}, small tables crossing: {small_crossing}, crossing bytes per boundary: {:?}",
            cap / MIB,
            plan.engines.len(),
            plan.engines
                .iter()
                .filter(|e| e.over_cap)
                .map(|e| (e.index, e.weight_bytes))
                .collect::<Vec<_>>(),
            crossing
        );
        // Same plan again, byte for byte.
        assert_eq!(
            plan.to_json().unwrap(),
            petite_partition::plan(p, &opts).unwrap().to_json().unwrap()
        );
        // Without positional recompute, the crossing limit alone decides: tables at or below
        // it may cross (the step's rotary tables do, where the step is cut), larger ones never.
        let opts = opts.recompute_positional(false);
        let plan = petite_partition::plan(p, &opts).unwrap();
        check(p, &plan, cap, opts.crossing_limit);
        let (_, crossing) = assert_no_large_table_crosses(p, &plan);
        eprintln!(
            "{name} cap {} MiB without positional recompute: {crossing} small tables cross",
            cap / MIB
        );
    }
    assert!(total_recomputed > 0);
}

#[test]
fn full_size_prefix_plans_at_256m_512m_1g() {
    let p = build_prefix(&Pi05Config::default(), Precision::Bf16).unwrap();
    full_size("prefix", &p);
}

#[test]
fn full_size_step_plans_at_256m_512m_1g() {
    let p = build_step(&Pi05Config::default(), Precision::Bf16).unwrap();
    full_size("step", &p);
}
