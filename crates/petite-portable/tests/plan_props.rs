//! Property test of the memory planner on random kernel-call sequences: no two tensors alive at
//! the same call share bytes, the buffer is at least the largest live set and at most the
//! no-reuse total.

use petite_graph::{Dtype, NodeId};
use petite_portable::lower::{Arg, Call, Lowered, Slot, Storage};
use petite_portable::plan::{check, plan};
use proptest::prelude::*;

fn lowered(
    sizes: &[usize],
    reads: &[(usize, usize)],
    n_inputs: usize,
    n_outputs: usize,
) -> Lowered {
    let mut slots = Vec::new();
    let mut inputs = Vec::new();
    for i in 0..n_inputs {
        slots.push(Slot {
            dtype: Dtype::F32,
            shape: vec![sizes[i % sizes.len()]],
            storage: Storage::Input(i),
        });
        inputs.push((format!("x{i}"), i));
    }
    // One constant, never planned.
    slots.push(Slot {
        dtype: Dtype::F32,
        shape: vec![3],
        storage: Storage::Constant(vec![0; 12]),
    });
    let konst = slots.len() - 1;
    let mut calls = Vec::new();
    for (c, &sz) in sizes.iter().enumerate() {
        slots.push(Slot {
            dtype: if c % 3 == 0 { Dtype::Bf16 } else { Dtype::F32 },
            shape: vec![sz],
            storage: Storage::Activation,
        });
        let out = slots.len() - 1;
        // Read up to two earlier tensors (picked by the strategy) and the constant.
        let (a, b) = reads[c % reads.len()];
        let a = a % out;
        let b = b % out;
        calls.push(Call {
            name: "aten::add",
            overload: "out",
            args: vec![Arg::T(a), Arg::T(b), Arg::T(konst), Arg::T(out)],
            outs: vec![out],
            node: NodeId(0),
        });
    }
    let total = slots.len();
    let outputs = (0..n_outputs.min(sizes.len()))
        .map(|i| (format!("y{i}"), total - 1 - i))
        .collect();
    Lowered {
        slots,
        calls,
        inputs,
        outputs,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn plans_are_valid(
        sizes in prop::collection::vec(0usize..300, 1..60),
        reads in prop::collection::vec((0usize..1000, 0usize..1000), 1..20),
        n_inputs in 1usize..4,
        n_outputs in 1usize..3,
    ) {
        let l = lowered(&sizes, &reads, n_inputs, n_outputs);
        let p = plan(&l);
        prop_assert!(check(&l, &p).is_ok(), "{:?}", check(&l, &p));
        prop_assert!(p.stats.planned_bytes >= p.stats.max_live_bytes);
        prop_assert!(p.stats.planned_bytes <= p.stats.sum_bytes);
        prop_assert!(p.offsets[n_inputs].is_none(), "the constant is not planned");
    }
}
