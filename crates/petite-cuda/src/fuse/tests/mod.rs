//! The fusion planner's tests, by what they check: `grouping` (groups, launches, prologues,
//! siblings), `source` (the generated text), `passes` (the statement IR's passes on bodies
//! built by hand) and `views` (operands read in place, attentions).

use std::fmt::Write as _;

use super::regs::index_type;
use super::*;
use petite_graph::{Builder, Dtype, Op};

mod grouping;
mod passes;
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

/// `line` of rendered text with each identifier-like word `w` replaced by `f(w)` where that
/// is `Some`: how the tests put values back into, or names out of, generated text.
fn map_words(line: &str, f: impl Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(line.len() + 16);
    let b = line.as_bytes();
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut j = 0;
    while j < b.len() {
        if !word(b[j]) {
            out.push(b[j] as char);
            j += 1;
            continue;
        }
        let start = j;
        while j < b.len() && word(b[j]) {
            j += 1;
        }
        let w = &line[start..j];
        match f(w) {
            Some(x) => out.push_str(&x),
            None => out.push_str(w),
        }
    }
    out
}
