//! The statement IR's passes on small bodies built by hand, each checked on the text it
//! renders: renaming maps identifiers (not words of text), [`with_first`] inserts before the
//! statistics' declaration as a statement, and unrolling interleaves whole statements.

use super::*;
use crate::fuse::ir::{Decl, Expr, Grid, Head, Ident, Init, Local, Name, Operand, Side, Stmt};
use crate::fuse::ir::{cat, render};
use crate::fuse::rewrite::stats_decl;

fn leaf(j: usize) -> Ident {
    Name::Operand(Side::Own, Operand::Leaf(j)).into()
}

fn var(k: usize) -> Ident {
    Name::Var(k).into()
}

/// `float v1 = ldf(p0, i + s0, DT_F32); ((float*)po)[i] = v1;`: a load at an offset and a
/// store (`+ i` in the load's text is a word `i`, not the identifier).
fn load_store() -> Vec<Stmt> {
    let load = cat![
        "ldf(",
        leaf(0),
        ", ",
        Local::I,
        " + ",
        Name::Offset(Side::Own, 0),
        ", DT_F32)"
    ];
    vec![
        Stmt::decl(false, "float", var(1), load),
        Stmt::Store {
            ptr: Name::Operand(Side::Own, Operand::Out).into(),
            ty: "float",
            index: Local::I.into(),
            value: var(1).into(),
        },
    ]
}

/// A plain group's body: one grid-stride loop over [`load_store`].
fn plain() -> Vec<Stmt> {
    vec![Stmt::Loop(Head::grid_stride(), load_store())]
}

const GRID_LOOP: &str = "for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {";

#[test]
fn a_plain_body_renders_as_the_generator_wrote_it() {
    assert_eq!(
        render(&plain()),
        format!(
            "  {GRID_LOOP}\n    float v1 = ldf(p0, i + s0, DT_F32);\n    ((float*)po)[i] = v1;\n  }}\n"
        )
    );
    // Text is never read as names: a word `p0` in text stays, the identifier renders.
    let e = cat!["f(p0, ", leaf(0), ")"];
    assert_eq!(e.to_string(), "f(p0, p0)");
    assert_eq!(e, cat!["f(p0, ", leaf(0), ")", ""]);
}

#[test]
fn beside_renames_the_other_bodys_operands_offsets_n_and_grid() {
    let out = render(&beside(&plain(), 2, &plain(), 3));
    let want = [
        "  if (blockIdx.x < 2u) {",
        "  const dim3 pg(2u);",
        "  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)pg.x * blockDim.x) {",
        "    float v1 = ldf(p0, i + s0, DT_F32);",
        "    ((float*)po)[i] = v1;",
        "  }",
        "  } else {",
        "  const dim3 qb(blockIdx.x - 2u), qg(3u);",
        "  for (i64 i = (i64)qb.x * blockDim.x + threadIdx.x; i < qn; i += (i64)qg.x * blockDim.x) {",
        "    float v1 = ldf(q0, i + t0, DT_F32);",
        "    ((float*)qo)[i] = v1;",
        "  }",
        "  }",
    ];
    assert_eq!(out, want.join("\n") + "\n");
}

/// A prologue kernel's header: its statistics declared and computed, then its row loop.
fn prologue() -> Vec<Stmt> {
    let (np, base) = (Local::Np, Local::Base);
    vec![
        Stmt::decl(true, "i64", base, cat![Local::Row, " * ", np, ".d"]),
        stats_decl(),
        Stmt::Eval(cat![
            "norm_stats(",
            np,
            ", &",
            Local::Nm,
            ", &",
            Local::Nr,
            ")"
        ]),
        Stmt::Loop(
            Head::row(),
            vec![
                Stmt::decl(true, "i64", Local::I, cat![base, " + ", Local::Jj]),
                Stmt::Store {
                    ptr: Name::Operand(Side::Own, Operand::Out).into(),
                    ty: "float",
                    index: Local::I.into(),
                    value: Local::Nm.into(),
                },
            ],
        ),
    ]
}

#[test]
fn with_first_inserts_before_the_statistics_declaration() {
    let out = render(&with_first(&prologue(), &plain()).unwrap());
    let want = [
        "  const i64 base = row * np.d;",
        "  for (i64 jj = threadIdx.x; jj < np.d; jj += blockDim.x) {",
        "    const i64 i = base + jj;",
        "    float v1 = ldf(q0, i + t0, DT_F32);",
        "    ((float*)qo)[i] = v1;",
        "  }",
        "  __syncthreads();",
        "  float nm, nr;",
        "  norm_stats(np, &nm, &nr);",
        "  for (i64 jj = threadIdx.x; jj < np.d; jj += blockDim.x) {",
        "    const i64 i = base + jj;",
        "    ((float*)po)[i] = nm;",
        "  }",
    ];
    assert_eq!(out, want.join("\n") + "\n");
    // The declaration is found as a statement: one of other names, or another type, is not it.
    let mut other = prologue();
    other[1] = Stmt::Decl(Decl {
        konst: false,
        ty: "double",
        names: vec![
            (Local::Nm.into(), Init::None),
            (Local::Nr.into(), Init::None),
        ],
    });
    assert!(with_first(&other, &plain()).is_none());
    // `first` must be one grid-stride loop.
    assert!(with_first(&prologue(), &load_store()).is_none());
    assert!(with_first(&prologue(), &prologue()).is_none());
}

/// `line` with its per-element words (`i`, `r`, `jj`, `nv`, `cN`, `vN`) suffixed `_k`: the
/// rendered text's oracle for an unrolled copy.
fn suffixed(line: &str, k: usize) -> String {
    map_words(line, |w| {
        let numbered =
            |c: char| w.len() > 1 && w.starts_with(c) && w[1..].bytes().all(|b| b.is_ascii_digit());
        let ours = matches!(w, "i" | "r" | "jj" | "nv") || numbered('v') || numbered('c');
        ours.then(|| format!("{w}_{k}"))
    })
}

#[test]
fn unrolled_interleaves_the_copies_statements_loads_first() {
    assert_eq!(UNROLL, 4);
    let out = render(&unrolled(&plain()).unwrap());
    let mut want = vec![
        "  const i64 st = (i64)gridDim.x * blockDim.x;".to_string(),
        "  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;".into(),
        "  for (; i + 3 * st < n; i += 4 * st) {".into(),
        "    const i64 i_0 = i + 0 * st, i_1 = i + 1 * st, i_2 = i + 2 * st, i_3 = i + 3 * st;"
            .into(),
    ];
    let inner = [
        "    float v1 = ldf(p0, i + s0, DT_F32);",
        "    ((float*)po)[i] = v1;",
    ];
    for l in inner {
        want.extend((0..UNROLL).map(|k| suffixed(l, k)));
    }
    want.push("  }".into());
    want.push("  for (; i < n; i += st) {".into());
    want.extend(inner.map(String::from));
    want.push("  }".into());
    assert_eq!(out, want.join("\n") + "\n");
    assert!(out.contains("v1_3 = ldf(p0, i_3 + s0,"), "{out}");
    // A loop holding a branch is not unrolled.
    let mut branchy = load_store();
    branchy.push(Stmt::Arms(vec![(
        crate::fuse::ir::Arm::Block,
        vec![Stmt::Assign {
            to: var(1),
            value: "1.0f".into(),
        }],
    )]));
    assert!(unrolled(&[Stmt::Loop(Head::grid_stride(), branchy)]).is_none());
    assert!(unrolled(&prologue()).is_none());
}

#[test]
fn unrolled_row_loops_compute_each_element_by_the_same_lines() {
    let (i, jj, base, r) = (Local::I, Local::Jj, Local::Base, Local::R);
    let q = |o: Operand| -> Ident { Name::Operand(Side::Other, o).into() };
    let c1: Ident = Name::Coord(1).into();
    let straight = vec![
        Stmt::decl(true, "i64", i, cat![base, " + ", jj]),
        Stmt::decl(false, "unsigned", r, cat!["(unsigned)", i]),
        Stmt::DivMod {
            ty: "unsigned",
            coord: c1,
            rem: r.into(),
            by: "8u".into(),
        },
        Stmt::decl(
            false,
            "float",
            var(1),
            cat!["ldf(", q(Operand::Leaf(0)), ", ", c1, " * 1LL, DT_BF16)"],
        ),
        Stmt::Store {
            ptr: q(Operand::Out),
            ty: "unsigned short",
            index: i.into(),
            value: cat!["f2bf(", var(1), ")"],
        },
    ];
    let branchy = vec![
        Stmt::decl(true, "i64", i, cat![base, " + ", jj]),
        Stmt::Decl(Decl {
            konst: false,
            ty: "float",
            names: vec![(var(1), Init::None)],
        }),
        Stmt::Arms(vec![(
            crate::fuse::ir::Arm::If(cat![i, " < 3LL"]),
            vec![Stmt::Assign {
                to: var(1),
                value: "1.0f".into(),
            }],
        )]),
    ];
    let body = vec![
        Stmt::Shared {
            ty: "double",
            name: Local::Shd.into(),
            len: 32,
        },
        Stmt::decl(true, "i64", base, cat![Local::Row, " * ", Local::Np, ".d"]),
        Stmt::Loop(Head::row(), straight),
        Stmt::Barrier,
        Stmt::Loop(Head::row(), branchy),
    ];
    let out = render(&rows_unrolled(&body));
    // The straight-line loop: four copies a trip, then the remainder as it was.
    let inner = [
        "    const i64 i = base + jj;",
        "    unsigned r = (unsigned)i;",
        "    unsigned c1 = r % 8u; r /= 8u;",
        "    float v1 = ldf(q0, c1 * 1LL, DT_BF16);",
        "    ((unsigned short*)qo)[i] = f2bf(v1);",
    ];
    let lines: Vec<&str> = out.lines().collect();
    let trip = lines
        .iter()
        .position(|l| l.starts_with("    const i64 jj_0 = jj"))
        .unwrap();
    assert_eq!(
        lines[trip - 4..trip],
        [
            "  {",
            "  const i64 bd = blockDim.x;",
            "  i64 jj = threadIdx.x;",
            "  for (; jj + 3 * bd < np.d; jj += 4 * bd) {"
        ]
    );
    for (n, want) in inner.iter().enumerate() {
        for k in 0..UNROLL {
            // Copy k is the line with its own names suffixed `_k`, and nothing else.
            let got = lines[trip + 1 + n * UNROLL + k];
            assert_eq!(got, suffixed(want, k));
            let back = map_words(got, |w| {
                w.strip_suffix(&format!("_{k}")).map(str::to_string)
            });
            assert_eq!(back, *want);
        }
    }
    let rest = out.find("  for (; jj < np.d; jj += bd) {\n").unwrap();
    assert!(out[rest..].starts_with(&format!(
        "  for (; jj < np.d; jj += bd) {{\n{}\n  }}\n  }}\n",
        inner.join("\n")
    )));
    // The loop holding a branch is left as it was, and so is everything outside loops.
    assert!(out.ends_with("  __syncthreads();\n  for (i64 jj = threadIdx.x; jj < np.d; jj += blockDim.x) {\n    const i64 i = base + jj;\n    float v1;\n    if (i < 3LL) {\n    v1 = 1.0f;\n    }\n  }\n"));
    assert!(out.starts_with("  __shared__ double shd[32];\n  const i64 base = row * np.d;\n"));
    assert_eq!(out.matches('{').count(), out.matches('}').count());
}

#[test]
fn an_expression_renders_its_identifiers_and_text_in_order() {
    let x: Expr = cat![
        "(",
        Grid::BlockIdx,
        ".x + ",
        Name::Offset(Side::Other, 2),
        ")"
    ];
    assert_eq!(x.to_string(), "(blockIdx.x + t2)");
    let mut y = x.clone();
    y.map_ids(&|id: Ident| Ident {
        copy: Some(1),
        ..id
    });
    assert_eq!(y.to_string(), "(blockIdx_1.x + t2_1)");
    assert!(Expr::from("0").is_zero() && !cat!["0", Local::I].is_zero());
}
