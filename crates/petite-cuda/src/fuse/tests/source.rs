//! Tests of the generated text: rounding, index widths, unrolled loops, slice starts as
//! parameters against literals.

use super::*;

#[test]
fn big_straight_line_groups_are_unrolled_with_each_copy_renamed() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[1024, 1024]).unwrap();
    let y = b.input("y", Dtype::Bf16, &[1024, 1024]).unwrap();
    let m = b.mul(x, y).unwrap();
    let r = b.add(m, x).unwrap();
    b.output("r", r).unwrap();
    // The same chain below `UNROLL_FROM`, and a branching one (RoPE's concat) above it.
    let s = b.input("s", Dtype::Bf16, &[8, 1024]).unwrap();
    let s2 = b.mul(s, s).unwrap();
    b.output("s", s2).unwrap();
    let h1 = b.slice(x, -1, 0, 512, 1).unwrap();
    let h2 = b.slice(x, -1, 512, 1024, 1).unwrap();
    let rot = b.concat(&[h2, h1], -1).unwrap();
    let rr = b.mul(rot, y).unwrap();
    b.output("rot", rr).unwrap();
    let p = b.finish().unwrap();
    let f = plan_all(&p);
    let unroll_of = |v: NodeId| match f.role[v.index()] {
        Role::Root(g) => f.groups[g].unroll,
        other => panic!("{other:?}"),
    };
    assert_eq!(unroll_of(r), UNROLL);
    assert_eq!(unroll_of(s2), 1);
    assert_eq!(unroll_of(rr), 1);
    let Role::Root(g) = f.role[r.index()] else {
        unreachable!()
    };
    let name = &f.kernels[f.groups[g].kernel.unwrap()];
    let src = f.source.split(&format!("void {name}(")).nth(1).unwrap();
    let src = src.split("\n}\n").next().unwrap();
    let (fast, tail) = src.split_once("for (; i < n; i += st)").unwrap();
    // Every copy's loads come before any copy's store, each copy with its own names.
    let last_load = fast.rfind("ldf(").unwrap();
    let first_store = fast.find("po)[").unwrap();
    assert!(last_load < first_store, "{fast}");
    for k in 0..UNROLL {
        assert!(fast.contains(&format!("po)[i_{k}]")), "{fast}");
        assert!(fast.contains(&format!("v1_{k} = ldf(p")), "{fast}");
    }
    assert!(!fast.contains(" v1 ") && !fast.contains("[i]"), "{fast}");
    assert!(
        tail.contains("po)[i] =") && tail.contains(" v1 = "),
        "{tail}"
    );
}

#[test]
fn generated_source_rounds_each_op_and_balances() {
    let (p, [..]) = rope_program();
    let f = plan_all(&p);
    let src = &f.source;
    for k in &f.kernels {
        assert_eq!(src.matches(&format!("void {k}(")).count(), 1, "{k}");
    }
    let open = src.matches('{').count();
    assert_eq!(open, src.matches('}').count(), "braces balance");
    // bf16 intermediates are rounded as a store would round them.
    assert!(
        src.contains("bf2f(f2bf(ew_f(30"),
        "neg rounded to bf16:\n{src}"
    );
    // The concat picks its piece by the last coordinate.
    assert!(src.contains("if (c3 < 4LL)"), "{src}");
}

#[test]
fn coordinates_are_divided_in_32_bits_below_2_pow_31_elements() {
    assert_eq!(index_type((1 << 31) - 1), ("unsigned", "u"));
    assert_eq!(index_type(1 << 31), ("i64", "LL"));
    // A non-power-of-two shape (pi0.5's 968 prefix tokens), reshaped inside the group.
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[968, 6]).unwrap();
    let e = b.exp(x).unwrap();
    let r = b.reshape(e, &[968, 2, 3]).unwrap();
    let y = b.neg(r).unwrap();
    b.output("y", y).unwrap();
    let p = b.finish().unwrap();
    let f = plan_all(&p);
    assert_eq!(f.kernels.len(), 1, "{}", f.source);
    assert!(
        f.source.contains("unsigned r = (unsigned)i;"),
        "{}",
        f.source
    );
    assert!(
        f.source.contains("unsigned c2 = r % 3u; r /= 3u;"),
        "{}",
        f.source
    );
    assert!(
        f.source.contains("(v1 / 6u)") && f.source.contains("% 6u)"),
        "{}",
        f.source
    );
    assert!(!f.source.contains("LL; r /="), "{}", f.source);
}

fn literal(o: Options) -> Options {
    Options {
        offset_params: false,
        ..o
    }
}

/// Kernel `k`'s parameter list and body (its text but for the name).
fn kernel_text(f: &Fusion, k: usize) -> (&str, &str) {
    let head = format!("extern \"C\" __global__ void {}(", f.kernels[k]);
    let at = f.source.find(&head).expect("kernel in source") + head.len();
    let rest = &f.source[at..];
    let sig = rest.find(") {\n").expect("signature");
    let end = rest.find("\n}\n").expect("kernel end");
    (&rest[..sig], &rest[sig..end])
}

/// Each launched group's kernel with its slice starts as parameters, the values it is
/// launched with put back as literals, is the kernel the generator writes with literals.
fn offsets_are_literals_put_back(p: &Program, fp: &Fusion, fl: &Fusion) -> usize {
    assert_eq!(fp.groups.len(), fl.groups.len());
    let mut launched = 0;
    for (g, (gp, gl)) in fp.groups.iter().zip(&fl.groups).enumerate() {
        assert_eq!(
            (
                gp.root,
                &gp.leaves,
                gp.prologue,
                gp.first,
                gp.with,
                gp.absorbed
            ),
            (
                gl.root,
                &gl.leaves,
                gl.prologue,
                gl.first,
                gl.with,
                gl.absorbed
            )
        );
        assert!(gl.offsets.is_empty() && gp.offsets.iter().all(|&o| o > 0));
        let (Some(kp), Some(kl)) = (gp.kernel, gl.kernel) else {
            assert!(gp.absorbed && gp.kernel.is_none() && gl.kernel.is_none());
            continue;
        };
        launched += 1;
        let other = gp
            .first
            .or(gp.with)
            .map_or(&[][..], |o| &fp.groups[o].offsets);
        // What the launch passes, in order: the signature's `s…` then `t…`.
        let passed: Vec<i64> = fp.launch_offsets(g).copied().collect();
        assert_eq!(passed.len(), gp.offsets.len() + other.len());
        let (own, theirs) = passed.split_at(gp.offsets.len());
        let (sig_p, body_p) = kernel_text(fp, kp);
        let (sig_l, body_l) = kernel_text(fl, kl);
        let mut sig = sig_l.to_string();
        for j in 0..gp.offsets.len() {
            let _ = write!(sig, ", i64 s{j}");
        }
        for j in 0..other.len() {
            let _ = write!(sig, ", i64 t{j}");
        }
        assert_eq!(sig_p, sig, "{}", p.describe(gp.root));
        let put_back: String = body_p
            .lines()
            .map(|l| {
                map_words(l, |w| {
                    let (table, j) = match w.split_at_checked(1) {
                        Some(("s", j)) => (own, j),
                        Some(("t", j)) => (theirs, j),
                        _ => return None,
                    };
                    let j: usize = j.parse().ok()?;
                    Some(format!("{}LL", table[j]))
                }) + "\n"
            })
            .collect();
        assert_eq!(
            put_back.trim_end(),
            body_l.trim_end(),
            "{}",
            p.describe(gp.root)
        );
    }
    launched
}

#[test]
fn slice_starts_as_parameters_are_the_literal_kernels_launched_with_their_values() {
    for (name, p) in &crate::pi05_programs() {
        let o = Options::new(fused_attention_queries((9, 0)));
        let (fp, fl) = (plan_o(p, o), plan_o(p, literal(o)));
        let launched = offsets_are_literals_put_back(p, &fp, &fl);
        assert!(launched > 0, "{name}");
        eprintln!(
            "{name}: {launched} launches, kernels {} with literal starts, {} with parameters",
            fl.kernels.len(),
            fp.kernels.len()
        );
        if name.ends_with("step") {
            // The 36 adaRMS prologues (and the residual sums they compute first)
            // differ only in their layer's offsets into the modulation table.
            assert!(fl.kernels.len() >= 40, "{}", fl.kernels.len());
            assert!(fp.kernels.len() <= 16, "{}", fp.kernels.len());
            // The residual sums computed first read the gate's offsets as `t…`.
            assert!(
                fp.groups
                    .iter()
                    .any(|g| { g.first.is_some_and(|o| !fp.groups[o].offsets.is_empty()) })
            );
        }
    }
}

#[test]
fn unrolled_rows_change_only_the_prologue_kernels_text() {
    for (name, p) in &crate::pi05_programs() {
        if !name.ends_with("timestep_table") {
            // Rolled (the default before issue 49) against unrolled (the default now).
            let o = Options {
                unrolled_rows: false,
                ..Options::new(fused_attention_queries((9, 0)))
            };
            let f = plan_o(p, o);
            let fu = plan_o(
                p,
                Options {
                    unrolled_rows: true,
                    ..o
                },
            );
            assert_eq!(f.kernels.len(), fu.kernels.len());
            let mut prologues = 0;
            for (g, gu) in f.groups.iter().zip(&fu.groups) {
                assert_eq!(
                    (g.root, &g.leaves, g.prologue, g.first, g.kernel, &g.offsets),
                    (
                        gu.root,
                        &gu.leaves,
                        gu.prologue,
                        gu.first,
                        gu.kernel,
                        &gu.offsets
                    )
                );
                let Some(k) = g.kernel else { continue };
                let (a, b) = (kernel_text(&f, k), kernel_text(&fu, k));
                assert_eq!(a.0, b.0, "the same parameters");
                if g.prologue.is_none() {
                    assert_eq!(a.1, b.1, "{}", p.describe(g.root));
                    continue;
                }
                prologues += 1;
                assert!(a.1.contains("norm_stats(") && a.1.contains("norm_elem("));
                assert!(b.1.contains("norm_stats4<") && b.1.contains("norm_elem4<"));
                assert!(b.1.contains("jj_3"), "{}", p.describe(g.root));
            }
            assert!(prologues > 0);
        }
    }
}

#[test]
fn slices_of_one_table_at_other_offsets_share_one_kernel() {
    let mut b = Builder::new();
    let table = b.input("table", Dtype::F32, &[4, 96]).unwrap();
    let x = b.input("x", Dtype::Bf16, &[4, 32]).unwrap();
    let mut outs = Vec::new();
    for start in [0isize, 32, 64] {
        let s = b.slice(table, 1, start, start + 32, 1).unwrap();
        let s = b.cast(s, Dtype::Bf16).unwrap();
        let y = b.mul(x, s).unwrap();
        outs.push(y);
    }
    for (i, y) in outs.into_iter().enumerate() {
        b.output(&format!("y{i}"), y).unwrap();
    }
    let p = b.finish().unwrap();
    let o = Options {
        pairs: false,
        ..Options::new(0)
    };
    let (fp, fl) = (plan_o(&p, o), plan_o(&p, literal(o)));
    let mut offsets: Vec<(&[i64], Option<usize>)> = fp
        .groups
        .iter()
        .map(|g| (&g.offsets[..], g.kernel))
        .collect();
    offsets.sort();
    let k: Vec<&[i64]> = offsets.iter().map(|o| o.0).collect();
    assert_eq!(k, [&[][..], &[32][..], &[64][..]]);
    // Start 0 reads the table as it is; the others one kernel, two launches.
    assert_eq!(fp.kernels.len(), 2, "{}", fp.source);
    assert_eq!(fl.kernels.len(), 3);
    assert_eq!(offsets[1].1, offsets[2].1);
    assert_ne!(offsets[0].1, offsets[1].1);
    assert_eq!(offsets_are_literals_put_back(&p, &fp, &fl), 3);
}
