//! Property tests (small case counts): random DAGs stay valid under storage reordering, walk in
//! a valid order and round-trip through JSON; broadcasting agrees with a direct definition.

use petite_graph::{Builder, Dtype, GraphOutput, Node, NodeId, Program, broadcast_shapes};
use proptest::prelude::*;

/// Builds a random elementwise/shape DAG over `[2, 3]` f32 tensors from a recipe.
fn build(recipe: &[(u8, usize, usize)]) -> Program {
    let mut b = Builder::new();
    let mut vals = vec![
        b.input("a", Dtype::F32, &[2, 3]).unwrap(),
        b.weight("w", Dtype::F32, &[3]).unwrap(),
    ];
    for (i, &(kind, x, y)) in recipe.iter().enumerate() {
        let x = vals[x % vals.len()];
        let y = vals[y % vals.len()];
        b.push_scope(format!("n{i}"));
        let v = match kind % 6 {
            0 => b.add(x, y),
            1 => b.mul(x, y),
            2 => b.silu(x),
            3 => b.add_scalar(x, 0.5),
            4 => {
                // split + getitem, then re-concat: exercises tuples.
                let last = b.shape(x).unwrap().len() as isize - 1;
                let dim = b.shape(x).unwrap()[last as usize];
                if dim >= 2 {
                    let parts = b.split(x, last, &[1, dim - 1]).unwrap();
                    b.concat(&[parts[1], parts[0]], last)
                } else {
                    b.neg(x)
                }
            }
            _ => b.sub(y, x),
        }
        .unwrap();
        b.pop_scope();
        vals.push(v);
    }
    let last = *vals.last().unwrap();
    b.output("out", last).unwrap();
    b.finish().unwrap()
}

/// Stores the nodes in a permuted order, remapping every id.
fn permute_storage(p: &Program, perm: &[usize]) -> Program {
    // perm[new] = old
    let mut new_of = vec![0u32; perm.len()];
    for (new, &old) in perm.iter().enumerate() {
        new_of[old] = new as u32;
    }
    let map = |id: NodeId| NodeId(new_of[id.index()]);
    Program {
        nodes: perm
            .iter()
            .map(|&old| {
                let n = &p.nodes[old];
                Node {
                    op: n.op.clone(),
                    inputs: n.inputs.iter().map(|&v| map(v)).collect(),
                    ty: n.ty.clone(),
                    label: n.label.clone(),
                    recompute: n.recompute,
                }
            })
            .collect(),
        inputs: p.inputs.iter().map(|&v| map(v)).collect(),
        outputs: p
            .outputs
            .iter()
            .map(|o| GraphOutput {
                name: o.name.clone(),
                value: map(o.value),
            })
            .collect(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn reordered_dags_validate_and_walk(
        recipe in proptest::collection::vec((any::<u8>(), any::<usize>(), any::<usize>()), 1..40),
        seed in any::<u64>(),
    ) {
        let p = build(&recipe);
        // A deterministic pseudo-random permutation from the seed.
        let n = p.len();
        let mut perm: Vec<usize> = (0..n).collect();
        let mut s = seed | 1;
        for i in (1..n).rev() {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            perm.swap(i, (s % (i as u64 + 1)) as usize);
        }
        let q = permute_storage(&p, &perm);
        q.validate().unwrap();
        let order = q.topo_order().unwrap();
        prop_assert_eq!(order.len(), n);
        let mut pos = vec![usize::MAX; n];
        for (k, id) in order.iter().enumerate() {
            pos[id.index()] = k;
        }
        for (i, node) in q.nodes.iter().enumerate() {
            for v in &node.inputs {
                prop_assert!(pos[v.index()] < pos[i]);
            }
        }
        // Same consumers, up to renaming.
        let cp = p.consumers();
        let cq = q.consumers();
        for (old, consumers) in cp.iter().enumerate() {
            let mut a: Vec<u32> = consumers.iter().map(|c| perm.iter().position(|&o| o == c.index()).unwrap() as u32).collect();
            a.sort_unstable();
            let new = perm.iter().position(|&o| o == old).unwrap();
            let b: Vec<u32> = cq[new].iter().map(|c| c.0).collect();
            prop_assert_eq!(a, b);
        }
        let json = q.to_json().unwrap();
        let back = Program::from_json(&json).unwrap();
        prop_assert_eq!(&back, &q);
        prop_assert_eq!(back.to_json().unwrap(), json);
    }

    #[test]
    fn broadcast_matches_definition(
        a in proptest::collection::vec(1usize..4, 0..4),
        b in proptest::collection::vec(1usize..4, 0..4),
    ) {
        let r = a.len().max(b.len());
        let pad = |s: &[usize]| -> Vec<usize> {
            std::iter::repeat_n(1, r - s.len()).chain(s.iter().copied()).collect()
        };
        let (pa, pb) = (pad(&a), pad(&b));
        let ok = pa.iter().zip(&pb).all(|(x, y)| x == y || *x == 1 || *y == 1);
        match broadcast_shapes(&a, &b) {
            Ok(s) => {
                prop_assert!(ok);
                let want: Vec<usize> = pa.iter().zip(&pb).map(|(x, y)| *x.max(y)).collect();
                prop_assert_eq!(&s, &want);
                prop_assert_eq!(broadcast_shapes(&b, &a).unwrap(), s);
            }
            Err(_) => prop_assert!(!ok),
        }
    }
}

/// A small valid program whose JSON the mutation test corrupts.
fn seed_json() -> String {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[2, 4]).unwrap();
    let w = b.weight("w", Dtype::F32, &[3, 4]).unwrap();
    let y = b.linear(x, w, None).unwrap();
    let parts = b.split(y, 1, &[1, 2]).unwrap();
    let c = b.concat(&[parts[1], parts[0]], -1).unwrap();
    let m = b.constant_f32(&[3], &[1.0, 2.0, 3.0]).unwrap();
    let z = b.mul(c, m).unwrap();
    let s = b.slice(z, 0, 0, 1, 1).unwrap();
    let r = b.reshape(s, &[3]).unwrap();
    b.output("r", r).unwrap();
    b.finish().unwrap().to_json().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Corrupting digits of a valid program's JSON never panics: it parses and validates, or
    /// one of the two returns an error.
    #[test]
    fn corrupted_json_never_panics(edits in proptest::collection::vec((any::<usize>(), 0u8..10), 1..6)) {
        let json = seed_json();
        let mut bytes = json.into_bytes();
        let digits: Vec<usize> = bytes
            .iter()
            .enumerate()
            .filter(|(_, c)| c.is_ascii_digit())
            .map(|(i, _)| i)
            .collect();
        for (at, d) in edits {
            bytes[digits[at % digits.len()]] = b'0' + d;
        }
        let text = String::from_utf8(bytes).unwrap();
        if let Ok(p) = Program::from_json(&text) {
            let _ = p.validate();
            let _ = p.topo_order();
            let _ = p.to_string();
        }
    }
}
