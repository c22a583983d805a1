//! The fusion planner's tests, by what they check: `grouping` (groups, launches, prologues,
//! siblings), `source` (the generated text) and `views` (operands read in place, attentions).

use std::fmt::Write as _;

use super::codegen::index_type;
use super::rewrite::{map_words, renamed, row_renamed};
use super::*;
use petite_graph::{Builder, Dtype, Op};

mod grouping;
mod source;
mod views;

/// bf16 rotate-half RoPE as pi0.5's programs write it, feeding a matmul, plus a reshape
/// between a fused chain and the matmul.
fn rope_program() -> (Program, [NodeId; 4]) {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[1, 2, 4, 8]).unwrap();
    let cos = b.input("cos", Dtype::Bf16, &[1, 1, 4, 8]).unwrap();
    let sin = b.input("sin", Dtype::Bf16, &[1, 1, 4, 8]).unwrap();
    let w = b.input("w", Dtype::Bf16, &[1, 2, 8, 4]).unwrap();
    let x1 = b.slice(x, -1, 0, 4, 1).unwrap();
    let x2 = b.slice(x, -1, 4, 8, 1).unwrap();
    let n2 = b.neg(x2).unwrap();
    let rot = b.concat(&[n2, x1], -1).unwrap();
    let a = b.mul(x, cos).unwrap();
    let r = b.mul(rot, sin).unwrap();
    let y = b.add(a, r).unwrap();
    let yr = b.reshape(y, &[1, 2, 4, 8]).unwrap();
    let m = b.matmul(yr, w).unwrap();
    let m = b.cast(m, Dtype::F32).unwrap();
    b.output("m", m).unwrap();
    (b.finish().unwrap(), [y, yr, m, x1])
}

fn plan_all(p: &Program) -> Fusion {
    plan_queries(p, fused_attention_queries((9, 0)))
}

/// Unpaired launches and rolled row loops: the kernel texts these tests spell out.
fn plan_queries(p: &Program, queries: usize) -> Fusion {
    plan_o(
        p,
        Options {
            pairs: false,
            unrolled_rows: false,
            ..Options::new(queries)
        },
    )
}

fn plan_o(p: &Program, o: Options) -> Fusion {
    plan_program(p, o).unwrap()
}

fn plan_pairing(p: &Program) -> Fusion {
    let roots: Vec<NodeId> = p.outputs.iter().map(|o| o.value).collect();
    let mut out = vec![false; p.len()];
    for o in &p.outputs {
        out[o.value.index()] = true;
    }
    plan_with(
        p,
        &p.ancestors(&roots),
        &out,
        fused_attention_queries((9, 0)),
    )
    .unwrap()
}
