//! Validation of hand-made (and deserialised) programs, walks, helpers, serde, the 1M chain.

use std::collections::BTreeMap;

use petite_graph::{
    Builder, Dtype, Error, GraphOutput, Node, NodeId, Op, Program, TensorType, UnaryOp, ValueType,
};

fn t(dtype: Dtype, shape: &[usize]) -> ValueType {
    TensorType::new(dtype, shape).into()
}

fn input(name: &str, ty: ValueType) -> Node {
    Node {
        op: Op::Input {
            name: name.to_string(),
        },
        inputs: vec![],
        ty,
        label: None,
        recompute: false,
    }
}

fn neg(x: u32, ty: ValueType) -> Node {
    Node {
        op: Op::Unary { kind: UnaryOp::Neg },
        inputs: vec![NodeId(x)],
        ty,
        label: Some(format!("neg_of_{x}")),
        recompute: false,
    }
}

/// A small program exercising most ops: the pi0.5 prefix mask/positions and one attention.
fn sample() -> Program {
    let mut b = Builder::new();
    let pad = b.input("pad", Dtype::Bool, &[1, 6]).unwrap();
    let x = b.input("x", Dtype::F32, &[1, 6, 8]).unwrap();
    b.push_scope("mask");
    let p = b.cast(pad, Dtype::I64).unwrap();
    let cum = b.cumsum(p, -1).unwrap();
    let pos = b.sub_scalar(cum, 1.0).unwrap();
    let pk = b.unsqueeze(pad, 1).unwrap();
    let pq = b.unsqueeze(pad, 2).unwrap();
    let both = b.and(pk, pq).unwrap();
    let zero = b.scalar(Dtype::F32, 0.0).unwrap();
    let fill = b.scalar(Dtype::F32, -2.3819763e38).unwrap();
    let mask = b.select(both, zero, fill).unwrap();
    let mask = b.unsqueeze(mask, 1).unwrap();
    b.pop_scope();
    b.push_scope("layer0");
    let w = b.weight("layer0.norm.weight", Dtype::F32, &[8]).unwrap();
    let h = b.rms_norm(x, Some(w), 1e-6).unwrap();
    let wqkv = b.weight("layer0.qkv.weight", Dtype::F32, &[24, 8]).unwrap();
    let qkv = b.linear(h, wqkv, None).unwrap();
    let parts = b.chunk(qkv, 3, -1).unwrap();
    let q = b.reshape(parts[0], &[1, 6, 2, 4]).unwrap();
    let q = b.transpose(q, 1, 2).unwrap();
    let k = b.reshape(parts[1], &[1, 6, 2, 4]).unwrap();
    let k = b.transpose(k, 1, 2).unwrap();
    let k = b.slice(k, 1, 0, 1, 1).unwrap();
    let v = b.reshape(parts[2], &[1, 6, 2, 4]).unwrap();
    let v = b.transpose(v, 1, 2).unwrap();
    let v = b.slice(v, 1, 0, 1, 1).unwrap();
    let inv = b.constant_f32(&[2], &[1.0, 0.01]).unwrap();
    let posf = b.cast(pos, Dtype::F32).unwrap();
    let posf = b.unsqueeze(posf, -1).unwrap();
    let ang = b.mul(posf, inv).unwrap();
    let ang = b.concat(&[ang, ang], -1).unwrap();
    let ang = b.unsqueeze(ang, 1).unwrap();
    let cos = b.cos(ang).unwrap();
    let sin = b.sin(ang).unwrap();
    let q = b.rope(q, cos, sin).unwrap();
    let k = b.rope(k, cos, sin).unwrap();
    let o = b.attention(q, k, v, Some(mask), 0.5).unwrap();
    let o = b.transpose(o, 1, 2).unwrap();
    let o = b.reshape(o, &[1, 6, 8]).unwrap();
    let y = b.add(x, o).unwrap();
    let g = b.gelu_tanh(y).unwrap();
    b.pop_scope();
    b.output("y", g).unwrap();
    b.output("k", k).unwrap();
    b.output("positions", pos).unwrap();
    b.finish().unwrap()
}

#[test]
fn sample_validates_and_round_trips_through_json() {
    let p = sample();
    p.validate().unwrap();
    let json = p.to_json().unwrap();
    let back = Program::from_json(&json).unwrap();
    assert_eq!(back, p);
    back.validate().unwrap();
    // Deterministic: same program, same bytes.
    assert_eq!(back.to_json().unwrap(), json);
    assert_eq!(sample().to_json().unwrap(), json);
    // Flattened op tags and hex constants.
    assert!(json.contains("\"op\": \"attention\""), "{json}");
    assert!(json.contains("\"data\": \"0000803f0ad7233c\""), "{json}");
}

#[test]
fn every_op_round_trips_through_json() {
    use petite_graph::{BinaryOp, CompareOp, LogicalOp, ReduceOp};
    let ops = vec![
        Op::Input { name: "a".into() },
        Op::Weight {
            name: "w".into(),
            rows: None,
        },
        Op::Constant {
            data: vec![0, 1, 254, 255],
        },
        Op::Linear,
        Op::MatMul,
        Op::Conv2d {
            stride: [14, 14],
            padding: [0, 1],
        },
        Op::LayerNorm { eps: 1e-6 },
        Op::RmsNorm { eps: 1e-6 },
        Op::Binary {
            kind: BinaryOp::Div,
        },
        Op::BinaryScalar {
            kind: BinaryOp::Sub,
            scalar: 0.1 + 0.2,
            scalar_lhs: true,
        },
        Op::Compare {
            kind: CompareOp::Ge,
        },
        Op::Logical {
            kind: LogicalOp::Or,
        },
        Op::Not,
        Op::Unary {
            kind: UnaryOp::GeluTanh,
        },
        Op::Softmax { axis: 3 },
        Op::Rope,
        Op::Attention {
            scale: 1.0 / 72f64.sqrt(),
        },
        Op::Embedding,
        Op::Concat { axis: 1 },
        Op::Slice {
            axis: 1,
            start: 2,
            end: 9,
            step: 3,
        },
        Op::Reshape {
            shape: vec![1, 2, 3],
        },
        Op::Permute {
            perm: vec![2, 0, 1],
        },
        Op::Expand { shape: vec![4, 5] },
        Op::Cast { to: Dtype::Bf16 },
        Op::CumSum { axis: 0 },
        Op::Where,
        Op::Reduce {
            kind: ReduceOp::Max,
            axes: vec![0, 2],
            keepdim: true,
        },
        Op::Split {
            axis: 1,
            sizes: vec![1, 2],
        },
        Op::GetItem { index: 1 },
    ];
    for op in ops {
        let node = Node {
            op,
            inputs: vec![NodeId(7)],
            ty: t(Dtype::F16, &[2]),
            label: None,
            recompute: false,
        };
        let s = serde_json::to_string(&node).unwrap();
        let back: Node = serde_json::from_str(&s).unwrap();
        assert_eq!(back, node, "{s}");
    }
    // Awkward floats survive bit for bit.
    for v in [
        -2.3819763e38f64,
        1e-6,
        0.1 + 0.2,
        45.254833995939045,
        f64::MIN_POSITIVE,
    ] {
        let op = Op::BinaryScalar {
            kind: BinaryOp::Mul,
            scalar: v,
            scalar_lhs: false,
        };
        let back: Op = serde_json::from_str(&serde_json::to_string(&op).unwrap()).unwrap();
        assert_eq!(back, op);
    }
}

#[test]
fn helpers_consumers_weights_dead_nodes() {
    let p = sample();
    let cons = p.consumers();
    let pad = p.input_by_name("pad").unwrap();
    // pad feeds the cast and two unsqueezes (reshapes).
    assert_eq!(cons[pad.index()].len(), 3);
    for &c in &cons[pad.index()] {
        assert!(p.node(c).inputs.contains(&pad));
    }
    let ws = p.weights();
    assert_eq!(ws.len(), 2);
    assert_eq!(ws[0].name, "layer0.norm.weight");
    assert_eq!(ws[0].bytes, 32);
    assert_eq!(ws[1].name, "layer0.qkv.weight");
    assert_eq!(ws[1].bytes, 24 * 8 * 4);
    assert_eq!(p.weight_bytes(), 32 + 768);
    assert!(p.dead_nodes().is_empty());

    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[2]).unwrap();
    let unused = b.input("unused", Dtype::F32, &[2]).unwrap();
    let a = b.neg(x).unwrap();
    let dead = b.exp(x).unwrap();
    let w = b.weight("w", Dtype::F32, &[2]).unwrap();
    let dead2 = b.mul(dead, w).unwrap();
    b.output("a", a).unwrap();
    let p = b.finish().unwrap();
    assert_eq!(p.dead_nodes(), vec![dead, w, dead2]);
    let live = p.ancestors(&[a]);
    assert!(live[x.index()] && live[a.index()] && !live[unused.index()]);
    // x is read twice by one node: listed once.
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[2]).unwrap();
    let sq = b.mul(x, x).unwrap();
    let p = {
        b.output("sq", sq).unwrap();
        b.finish().unwrap()
    };
    assert_eq!(p.consumers()[x.index()], vec![sq]);
}

#[test]
fn validation_rejects_stored_type_mismatch() {
    let mut p = sample();
    let id = p
        .ids()
        .find(|&i| matches!(p.node(i).op, Op::Linear))
        .unwrap();
    p.nodes[id.index()].ty = t(Dtype::F32, &[1, 6, 25]);
    match p.validate().unwrap_err() {
        Error::TypeMismatch {
            node,
            stored,
            inferred,
        } => {
            assert_eq!(node.id, id);
            assert_eq!(node.op, "linear");
            assert_eq!(node.label.as_deref(), Some("layer0"));
            assert_eq!(stored, t(Dtype::F32, &[1, 6, 25]));
            assert_eq!(inferred, t(Dtype::F32, &[1, 6, 24]));
        }
        e => panic!("{e}"),
    }
}

#[test]
fn validation_rejects_wrong_shapes_and_dtypes() {
    // Weight declared with a shape the linear cannot use.
    let mut p = sample();
    let w = p
        .ids()
        .find(|&i| matches!(&p.node(i).op, Op::Weight { name, .. } if name == "layer0.qkv.weight"))
        .unwrap();
    p.nodes[w.index()].ty = t(Dtype::F32, &[24, 9]);
    let e = p.validate().unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::InvalidNode { .. }), "{msg}");
    assert!(
        msg.contains("(linear \"layer0\")") && msg.contains("[24, 9]"),
        "{msg}"
    );

    // Dtype mismatch on a binary op.
    let p = Program {
        nodes: vec![
            input("a", t(Dtype::F32, &[2])),
            input("b", t(Dtype::Bf16, &[2])),
            Node {
                op: Op::Binary {
                    kind: petite_graph::BinaryOp::Add,
                },
                inputs: vec![NodeId(0), NodeId(1)],
                ty: t(Dtype::F32, &[2]),
                label: Some("resid".into()),
                recompute: false,
            },
        ],
        inputs: vec![NodeId(0), NodeId(1)],
        outputs: vec![],
    };
    let msg = p.validate().unwrap_err().to_string();
    assert_eq!(
        msg,
        "node %2 (add \"resid\"): input 1 (b): expected dtype f32 (same as input 0), found bf16"
    );

    // Constant with the wrong byte count.
    let p = Program {
        nodes: vec![Node {
            op: Op::Constant { data: vec![0; 7] },
            inputs: vec![],
            ty: t(Dtype::F32, &[2]),
            label: None,
            recompute: false,
        }],
        inputs: vec![],
        outputs: vec![],
    };
    let msg = p.validate().unwrap_err().to_string();
    assert!(
        msg.contains("expected 8 bytes") && msg.contains("found 7"),
        "{msg}"
    );

    // Wrong arity.
    let p = Program {
        nodes: vec![
            input("a", t(Dtype::F32, &[2])),
            Node {
                op: Op::Linear,
                inputs: vec![NodeId(0)],
                ty: t(Dtype::F32, &[2]),
                label: None,
                recompute: false,
            },
        ],
        inputs: vec![NodeId(0)],
        outputs: vec![],
    };
    let msg = p.validate().unwrap_err().to_string();
    assert!(msg.contains("expected 2 to 3 inputs, found 1"), "{msg}");
}

#[test]
fn validation_rejects_tuple_without_getitem() {
    let tuple = ValueType::Tuple(vec![
        TensorType::new(Dtype::F32, &[1]),
        TensorType::new(Dtype::F32, &[1]),
    ]);
    let p = Program {
        nodes: vec![
            input("x", t(Dtype::F32, &[2])),
            Node {
                op: Op::Split {
                    axis: 0,
                    sizes: vec![1, 1],
                },
                inputs: vec![NodeId(0)],
                ty: tuple.clone(),
                label: None,
                recompute: false,
            },
            neg(1, t(Dtype::F32, &[1])),
        ],
        inputs: vec![NodeId(0)],
        outputs: vec![],
    };
    match p.validate().unwrap_err() {
        Error::TupleWithoutGetItem {
            node,
            index,
            producer,
        } => {
            assert_eq!(node.id, NodeId(2));
            assert_eq!(index, 0);
            assert_eq!(producer.id, NodeId(1));
            assert_eq!(producer.op, "split");
        }
        e => panic!("{e}"),
    }
    // A tuple as a graph output is refused too.
    let mut p2 = p.clone();
    p2.nodes.pop();
    p2.outputs.push(GraphOutput {
        name: "s".into(),
        value: NodeId(1),
    });
    let msg = p2.validate().unwrap_err().to_string();
    assert!(
        msg.contains("graph output \"s\"") && msg.contains("multi-output"),
        "{msg}"
    );
    // With a getitem it is fine.
    let mut p3 = p2.clone();
    p3.outputs.clear();
    p3.nodes.push(Node {
        op: Op::GetItem { index: 1 },
        inputs: vec![NodeId(1)],
        ty: t(Dtype::F32, &[1]),
        label: None,
        recompute: false,
    });
    p3.outputs.push(GraphOutput {
        name: "s1".into(),
        value: NodeId(2),
    });
    p3.validate().unwrap();
}

#[test]
fn validation_rejects_dangling_values() {
    let p = Program {
        nodes: vec![input("x", t(Dtype::F32, &[2])), neg(5, t(Dtype::F32, &[2]))],
        inputs: vec![NodeId(0)],
        outputs: vec![],
    };
    let e = p.validate().unwrap_err();
    assert!(
        matches!(
            e,
            Error::DanglingValue {
                value: NodeId(5),
                len: 2,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("refers to %5"), "{e}");
    let p = Program {
        nodes: vec![input("x", t(Dtype::F32, &[2]))],
        inputs: vec![NodeId(0)],
        outputs: vec![GraphOutput {
            name: "y".into(),
            value: NodeId(3),
        }],
    };
    let msg = p.validate().unwrap_err().to_string();
    assert!(
        msg.contains("graph output \"y\"") && msg.contains("%3"),
        "{msg}"
    );
}

#[test]
fn validation_rejects_duplicate_names_and_bad_input_lists() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[2]).unwrap();
    b.output("y", x).unwrap();
    let e = b.output("y", x).unwrap_err();
    assert!(
        matches!(e, Error::DuplicateName { kind: "output", .. }),
        "{e}"
    );

    let base = Program {
        nodes: vec![
            input("x", t(Dtype::F32, &[2])),
            input("x", t(Dtype::F32, &[2])),
        ],
        inputs: vec![NodeId(0), NodeId(1)],
        outputs: vec![],
    };
    let e = base.validate().unwrap_err();
    assert!(
        matches!(e, Error::DuplicateName { kind: "input", .. }),
        "{e}"
    );

    let mut p = base.clone();
    p.nodes[1] = input("z", t(Dtype::F32, &[2]));
    p.outputs = vec![
        GraphOutput {
            name: "o".into(),
            value: NodeId(0),
        },
        GraphOutput {
            name: "o".into(),
            value: NodeId(1),
        },
    ];
    let e = p.validate().unwrap_err();
    assert!(
        matches!(e, Error::DuplicateName { kind: "output", .. }),
        "{e}"
    );

    let mut p = base.clone();
    p.nodes[1] = input("z", t(Dtype::F32, &[2]));
    p.inputs = vec![NodeId(0)];
    let msg = p.validate().unwrap_err().to_string();
    assert!(msg.contains("not listed in the program's inputs"), "{msg}");

    let mut p = base.clone();
    p.nodes[1] = neg(0, t(Dtype::F32, &[2]));
    let msg = p.validate().unwrap_err().to_string();
    assert!(msg.contains("not an input node"), "{msg}");

    let w = |name: &str| Node {
        op: Op::Weight {
            name: name.into(),
            rows: None,
        },
        inputs: vec![],
        ty: t(Dtype::F32, &[2]),
        label: None,
        recompute: false,
    };
    let p = Program {
        nodes: vec![w("a"), w("a")],
        inputs: vec![],
        outputs: vec![],
    };
    let e = p.validate().unwrap_err();
    assert!(
        matches!(e, Error::DuplicateName { kind: "weight", .. }),
        "{e}"
    );
}

#[test]
fn cycles_are_detected_and_unsorted_dags_ordered() {
    // 0: input; 1 = neg(2); 2 = neg(1): a cycle.
    let ty = t(Dtype::F32, &[2]);
    let p = Program {
        nodes: vec![
            input("x", ty.clone()),
            neg(2, ty.clone()),
            neg(1, ty.clone()),
        ],
        inputs: vec![NodeId(0)],
        outputs: vec![],
    };
    match p.validate().unwrap_err() {
        Error::Cycle { node, count } => {
            assert_eq!(node.id, NodeId(1));
            assert_eq!(count, 2);
        }
        e => panic!("{e}"),
    }
    // Self loop.
    let p = Program {
        nodes: vec![neg(0, ty.clone())],
        inputs: vec![],
        outputs: vec![],
    };
    assert!(matches!(p.topo_order(), Err(Error::Cycle { .. })));
    // Stored out of order but acyclic: 2 = neg(1), 1 = neg(0)... stored as [neg(2), input, neg(1)]
    let p = Program {
        nodes: vec![
            neg(2, ty.clone()),
            input("x", ty.clone()),
            neg(1, ty.clone()),
        ],
        inputs: vec![NodeId(1)],
        outputs: vec![GraphOutput {
            name: "y".into(),
            value: NodeId(0),
        }],
    };
    assert_eq!(
        p.topo_order().unwrap(),
        vec![NodeId(1), NodeId(2), NodeId(0)]
    );
    p.validate().unwrap();
}

#[test]
fn subprogram_extracts_with_crossing_inputs_and_outputs() {
    let p = sample();
    // Take the layer's nodes from the rms_norm up to the attention (but not the mask code).
    let order = p.topo_order().unwrap();
    let start = order
        .iter()
        .position(|&i| matches!(p.node(i).op, Op::RmsNorm { .. }))
        .unwrap();
    let end = order
        .iter()
        .position(|&i| matches!(p.node(i).op, Op::Attention { .. }))
        .unwrap();
    let set: Vec<NodeId> = order[start..=end]
        .iter()
        .copied()
        .filter(|&i| !matches!(p.node(i).op, Op::Weight { .. } | Op::Constant { .. }))
        .collect();
    let sub = p.subprogram(&set).unwrap();
    sub.program.validate().unwrap();
    // Both weights were pulled in.
    let names: Vec<String> = sub.program.weights().into_iter().map(|w| w.name).collect();
    assert_eq!(names, ["layer0.norm.weight", "layer0.qkv.weight"]);
    // Crossing in: x (keeps its name), the mask and the positions (computed outside).
    let in_names: Vec<&str> = sub
        .program
        .inputs
        .iter()
        .map(|&i| sub.program.input_name(i).unwrap())
        .collect();
    assert_eq!(in_names.len(), sub.input_values.len());
    assert!(in_names.contains(&"x"), "{in_names:?}");
    for (&new, &old) in sub.program.inputs.iter().zip(&sub.input_values) {
        assert_eq!(sub.program.node(new).ty, p.node(old).ty);
    }
    // Crossing out: the attention output (read by the transpose outside) and the graph output "k".
    let out_names: Vec<&str> = sub
        .program
        .outputs
        .iter()
        .map(|o| o.name.as_str())
        .collect();
    assert!(out_names.contains(&"k"), "{out_names:?}");
    let attn = order[end];
    assert!(sub.output_values.contains(&attn));
    assert!(out_names.contains(&format!("v{}", attn.0).as_str()));
    // Node map is consistent.
    for (new, &old) in sub.original.iter().enumerate() {
        let n = &sub.program.nodes[new];
        if !matches!(n.op, Op::Input { .. }) {
            assert_eq!(n.op, p.node(old).op);
        }
    }
    // A split without its getitems is refused.
    let split = p
        .ids()
        .find(|&i| matches!(p.node(i).op, Op::Split { .. }))
        .unwrap();
    let e = p.subprogram(&[split]).unwrap_err();
    assert!(
        e.to_string()
            .contains("keep a split and its getitems together"),
        "{e}"
    );
    let e = p.subprogram(&[NodeId(10_000)]).unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");
}

/// A chain of 1,000,000 nodes validates and walks without recursion (a recursive walk of this
/// depth would overflow the 2 MiB test-thread stack).
#[test]
fn million_node_chain() {
    const N: usize = 1_000_000;
    let mut b = Builder::new();
    let mut v = b.input("x", Dtype::F32, &[]).unwrap();
    for _ in 1..N {
        v = b.neg(v).unwrap();
    }
    b.output("y", v).unwrap();
    let p = b.finish().unwrap();
    assert_eq!(p.len(), N);
    let order = p.topo_order().unwrap();
    assert_eq!(order.len(), N);
    assert_eq!(order[N - 1], v);
    let live = p.ancestors(&[v]);
    assert!(live.iter().all(|&l| l));
    assert!(p.dead_nodes().is_empty());
    drop(p); // keep the test's peak to one chain

    // Same chain stored in reverse order: exercises Kahn's algorithm and the cycle check.
    let ty = t(Dtype::F32, &[]);
    let mut nodes = Vec::with_capacity(N);
    for i in 0..N - 1 {
        // node i reads node i+1; the last node is the input.
        nodes.push(neg(i as u32 + 1, ty.clone()));
    }
    nodes.push(input("x", ty));
    let rev = Program {
        nodes,
        inputs: vec![NodeId(N as u32 - 1)],
        outputs: vec![GraphOutput {
            name: "y".into(),
            value: NodeId(0),
        }],
    };
    rev.validate().unwrap();
    let order = rev.topo_order().unwrap();
    assert_eq!(order[0], NodeId(N as u32 - 1));
    assert_eq!(order[N - 1], NodeId(0));
}

#[test]
fn display_is_one_line_per_node() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[1, 4, 8]).unwrap();
    let w = b.weight("q.weight", Dtype::F32, &[16, 8]).unwrap();
    b.push_scope("layer0");
    let y = b.linear(x, w, None).unwrap();
    b.label(y, "q_proj").unwrap();
    let s = b.softmax(y, -1).unwrap();
    let c = b.constant_f32(&[2], &[1.0, 2.0]).unwrap();
    let _ = c;
    b.pop_scope();
    b.output("s", s).unwrap();
    let p = b.finish().unwrap();
    assert_eq!(
        p.to_string(),
        "%0 = input \"x\" : f32[1, 4, 8]\n\
         %1 = weight \"q.weight\" : f32[16, 8]\n\
         %2 = linear(%0, %1) : f32[1, 4, 16]  # layer0.q_proj\n\
         %3 = softmax[axis=2](%2) : f32[1, 4, 16]  # layer0\n\
         %4 = constant <8 bytes> : f32[2]  # layer0\n\
         output \"s\" = %3\n"
    );
}

/// The partitioner contract: cutting a program at any point of its topological order gives
/// two pieces whose crossing values line up by name (the second piece's `v<id>` inputs are
/// exactly outputs of the first), and together they cover every non-source node once.
#[test]
fn every_two_way_cut_lines_up() {
    let p = sample();
    let order = p.topo_order().unwrap();
    let compute: Vec<NodeId> = order
        .iter()
        .copied()
        .filter(|&i| !p.node(i).op.is_source())
        .collect();
    let mut cuts_tried = 0;
    for cut in 1..compute.len() {
        let (a, b) = compute.split_at(cut);
        // Splits travel with their getitems: skip cuts between them.
        let split_cut = a.iter().any(|&i| p.node(i).op.is_multi_output())
            && b.iter()
                .any(|&i| matches!(p.node(i).op, Op::GetItem { .. }));
        if split_cut {
            assert!(p.subprogram(a).is_err());
            continue;
        }
        let sa = p.subprogram(a).unwrap();
        let sb = p.subprogram(b).unwrap();
        for (&new, &old) in sb.program.inputs.iter().zip(&sb.input_values) {
            let name = sb.program.input_name(new).unwrap();
            if matches!(p.node(old).op, Op::Input { .. }) {
                assert_eq!(Some(name), p.input_name(old));
            } else {
                assert!(
                    sa.program.outputs.iter().any(|o| o.name == name),
                    "cut {cut}: {name} missing from the first piece's outputs"
                );
            }
        }
        let count = |s: &petite_graph::SubProgram| {
            s.program.nodes.iter().filter(|n| !n.op.is_source()).count()
        };
        assert_eq!(count(&sa) + count(&sb), compute.len());
        // Original graph outputs come out of exactly the piece that computes them.
        for o in &p.outputs {
            let in_a = sa.program.output_by_name(&o.name).is_some();
            let in_b = sb.program.output_by_name(&o.name).is_some();
            assert!(in_a ^ in_b, "cut {cut}: output {}", o.name);
        }
        cuts_tried += 1;
    }
    assert!(cuts_tried > 30, "{cuts_tried}");
}

/// Absurd numbers in a deserialised program give errors, never panics or wrapped sizes.
#[test]
fn overflowing_shapes_are_rejected_without_panicking() {
    let big = usize::MAX / 2 + 1;
    let cases: Vec<(Vec<Node>, &str)> = vec![
        (vec![input("x", t(Dtype::F32, &[big, 4]))], "too large"),
        (
            vec![
                input("x", t(Dtype::U8, &[big])),
                Node {
                    op: Op::Concat { axis: 0 },
                    inputs: vec![NodeId(0), NodeId(0), NodeId(0)],
                    ty: t(Dtype::U8, &[1]),
                    label: None,
                    recompute: false,
                },
            ],
            "overflows",
        ),
        (
            vec![
                input("x", t(Dtype::F32, &[1, 1, 4, 4])),
                Node {
                    op: Op::Weight {
                        name: "w".into(),
                        rows: None,
                    },
                    inputs: vec![],
                    ty: t(Dtype::F32, &[1, 1, 2, 2]),
                    label: None,
                    recompute: false,
                },
                Node {
                    op: Op::Conv2d {
                        stride: [1, 1],
                        padding: [usize::MAX, 0],
                    },
                    inputs: vec![NodeId(0), NodeId(1)],
                    ty: t(Dtype::F32, &[1]),
                    label: None,
                    recompute: false,
                },
            ],
            "overflows",
        ),
        (
            vec![
                input("x", t(Dtype::F32, &[4])),
                Node {
                    op: Op::Split {
                        axis: 0,
                        sizes: vec![usize::MAX, 5],
                    },
                    inputs: vec![NodeId(0)],
                    ty: t(Dtype::F32, &[1]),
                    label: None,
                    recompute: false,
                },
            ],
            "sum to dim 4",
        ),
        (
            vec![
                input("x", t(Dtype::F32, &[4])),
                Node {
                    op: Op::Reshape {
                        shape: vec![big, big, 4],
                    },
                    inputs: vec![NodeId(0)],
                    ty: t(Dtype::F32, &[1]),
                    label: None,
                    recompute: false,
                },
            ],
            "cannot reshape",
        ),
        (
            vec![
                input("x", t(Dtype::F32, &[1])),
                Node {
                    op: Op::Expand {
                        shape: vec![big, 4],
                    },
                    inputs: vec![NodeId(0)],
                    ty: t(Dtype::F32, &[1]),
                    label: None,
                    recompute: false,
                },
            ],
            "too large",
        ),
    ];
    for (nodes, want) in cases {
        let p = Program {
            nodes,
            inputs: vec![NodeId(0)],
            outputs: vec![],
        };
        let msg = p.validate().unwrap_err().to_string();
        assert!(msg.contains(want), "{want}: {msg}");
    }
}

/// `Builder::inline`: a step program inlined three times in a chain reads each weight (and row
/// range) once, keeps labels under the prefix and recompute marks, drops dead nodes, and
/// refuses unknown, missing and mistyped bindings by name.
#[test]
fn inline_chains_a_program_and_shares_its_weights() {
    let mut s = Builder::new();
    let x = s.input("x", Dtype::F32, &[2, 4]).unwrap();
    let c = s.input("c", Dtype::F32, &[4]).unwrap();
    s.push_scope("proj");
    let w = s.weight("proj.weight", Dtype::F32, &[4, 4]).unwrap();
    let r = s
        .weight_rows("table", Dtype::F32, &[10, 4], [2, 4])
        .unwrap();
    let y = s.linear(x, w, None).unwrap();
    let y = s.add(y, c).unwrap();
    let m = s.sum(r, &[0], false).unwrap();
    let y = s.add(y, m).unwrap();
    s.mark_recompute(m).unwrap();
    let _dead = s.neg(x).unwrap();
    s.pop_scope();
    s.output("y", y).unwrap();
    let step = s.finish().unwrap();

    let mut b = Builder::new();
    let x0 = b.input("x0", Dtype::F32, &[2, 4]).unwrap();
    let c = b.input("c", Dtype::F32, &[4]).unwrap();
    let mut x = x0;
    for k in 0..3 {
        let ins = BTreeMap::from([("x", x), ("c", c)]);
        x = b.inline(&step, &ins, &format!("step.{k}")).unwrap()["y"];
    }
    b.output("out", x).unwrap();
    let p = b.finish().unwrap();
    let ws = p.weights();
    assert_eq!(ws.len(), 2, "{ws:?}");
    assert_eq!(p.weight_bytes(), 4 * 4 * 4 + 2 * 4 * 4);
    // 3 x (linear, add, reduce, add) + 2 inputs + 2 weights; the dead neg is not copied.
    assert_eq!(p.len(), 3 * 4 + 4, "{p}");
    let labels: Vec<&str> = p.nodes.iter().filter_map(|n| n.label.as_deref()).collect();
    assert!(labels.contains(&"step.2.proj"), "{labels:?}");
    assert_eq!(p.nodes.iter().filter(|n| n.recompute).count(), 3);

    let mut b = Builder::new();
    let x0 = b.input("x0", Dtype::F32, &[2, 4]).unwrap();
    let wrong = b.input("c", Dtype::F32, &[5]).unwrap();
    let e = b
        .inline(&step, &BTreeMap::from([("x", x0)]), "s")
        .unwrap_err();
    assert!(
        e.to_string().contains("\"c\"") && e.to_string().contains("not bound"),
        "{e}"
    );
    let e = b
        .inline(
            &step,
            &BTreeMap::from([("x", x0), ("c", x0), ("z", x0)]),
            "s",
        )
        .unwrap_err();
    assert!(e.to_string().contains("\"z\""), "{e}");
    let e = b
        .inline(&step, &BTreeMap::from([("x", x0), ("c", wrong)]), "s")
        .unwrap_err();
    assert!(
        e.to_string().contains("f32[4]") || e.to_string().contains("[4]"),
        "{e}"
    );
}
