//! Tests of how nodes are grouped and launched: kernels shared, pairs, prologues, a group's
//! first, sibling linears, folded biases.

use super::*;

#[test]
fn two_independent_groups_with_a_product_between_are_one_launch() {
    // The step's order: q = x·Wq, its RoPE-like chain, k = x·Wk, its chain, both read by a
    // product after.
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[4, 8]).unwrap();
    let wq = b.input("wq", Dtype::Bf16, &[16, 8]).unwrap();
    let wk = b.input("wk", Dtype::Bf16, &[8, 8]).unwrap();
    let c = b.input("c", Dtype::Bf16, &[4, 1]).unwrap();
    let q = b.linear(x, wq, None).unwrap();
    let qr = b.mul(q, c).unwrap();
    let k = b.linear(x, wk, None).unwrap();
    let kr = b.mul(k, c).unwrap();
    let kt = b.permute(kr, &[1, 0]).unwrap();
    let qk = b.reshape(qr, &[8, 8]).unwrap();
    let m = b.matmul(qk, kt).unwrap();
    b.output("m", m).unwrap();
    let p = b.finish().unwrap();
    let f = plan_pairing(&p);
    let (Role::Root(ga), Role::Root(gb)) = (f.role[qr.index()], f.role[kr.index()]) else {
        panic!("{:?} {:?}", f.role[qr.index()], f.role[kr.index()]);
    };
    let (a, bb) = (&f.groups[ga], &f.groups[gb]);
    assert!(a.absorbed && !bb.absorbed && bb.with == Some(ga) && a.with.is_none());
    assert_eq!(
        bb.blocks,
        crate::plan::grid_for(32) + crate::plan::grid_for(64)
    );
    let name = &f.kernels[bb.kernel.unwrap()];
    let src = &f.source[f.source.find(&format!("void {name}(")).unwrap()..];
    let src = &src[..src.find("\n}\n").unwrap()];
    let own = crate::plan::grid_for(32);
    assert!(src.contains(&format!("if (blockIdx.x < {own}u)")), "{src}");
    assert!(src.contains("void* po, i64 qn, const void* q0"), "{src}");
    let (mine, theirs) = src[src.find("if (blockIdx").unwrap()..]
        .split_once("} else {")
        .unwrap();
    assert!(
        mine.contains("i < n;") && !mine.contains("q0") && !mine.contains("gridDim"),
        "{src}"
    );
    assert!(theirs.contains("i < qn;") && theirs.contains("qo)[i]") && !theirs.contains("p0"));
    // The second reading the first: two launches.
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[4, 8]).unwrap();
    let w = b.input("w", Dtype::Bf16, &[8, 8]).unwrap();
    let c = b.input("c", Dtype::Bf16, &[4, 8]).unwrap();
    let y = b.mul(x, c).unwrap();
    let z = b.linear(y, w, None).unwrap();
    let zz = b.add(z, y).unwrap();
    let out = b.linear(zz, w, None).unwrap();
    b.output("o", out).unwrap();
    let p = b.finish().unwrap();
    let f = plan_pairing(&p);
    assert!(f.groups.iter().all(|g| g.with.is_none() && !g.absorbed));
}

#[test]
fn a_rope_chain_is_one_kernel_and_a_reshape_stays_a_free_view() {
    let (p, [y, yr, m, x1]) = rope_program();
    let f = plan_all(&p);
    let Role::Root(g) = f.role[y.index()] else {
        panic!("the add roots the chain: {:?}", f.role[y.index()]);
    };
    assert_eq!(f.role[x1.index()], Role::Inlined);
    assert_eq!(
        f.role[yr.index()],
        Role::View,
        "a reshape feeding a matmul is read in place, never a kernel"
    );
    // The output cast is its own group (the matmul between is not fusible).
    assert!(matches!(f.role[m.index()], Role::Root(_)));
    let grp = &f.groups[g];
    assert_eq!(grp.nodes, 7, "slice, slice, neg, concat, mul, mul, add");
    // Reads x, cos, sin: each once, whatever the coordinates it is read at.
    let names: Vec<&str> = grp
        .leaves
        .iter()
        .map(|&l| p.input_name(l).unwrap())
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");
    for n in ["x", "cos", "sin"] {
        assert!(names.contains(&n), "{names:?}");
    }
    assert_eq!(f.kernels.len(), 2);
}

#[test]
fn identical_groups_share_one_kernel() {
    let mut b = Builder::new();
    let mut outs = Vec::new();
    for i in 0..4 {
        let x = b.input(&format!("x{i}"), Dtype::F32, &[4, 8]).unwrap();
        let y = b.mul_scalar(x, 2.0).unwrap();
        let y = b.cast(y, Dtype::Bf16).unwrap();
        outs.push(y);
    }
    for (i, y) in outs.into_iter().enumerate() {
        b.output(&format!("y{i}"), y).unwrap();
    }
    let p = b.finish().unwrap();
    let f = plan_pairing(&p);
    assert_eq!(f.groups.len(), 4);
    assert!(f.groups.iter().all(|g| g.nodes == 2));
    // Independent, so launched two at a time ([`Group::with`]): both launches one kernel.
    let launched: Vec<&Group> = f.groups.iter().filter(|g| !g.absorbed).collect();
    assert_eq!(launched.len(), 2);
    assert!(
        launched
            .iter()
            .all(|g| g.kernel == Some(0) && g.with.is_some())
    );
    assert_eq!(f.kernels.len(), 1, "one kernel for four identical chains");
}

#[test]
fn an_f32_linears_bias_is_added_by_the_one_group_reading_it() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[3, 8]).unwrap();
    let r = b.input("r", Dtype::F32, &[3, 4]).unwrap();
    let w = b.weight("w", Dtype::F32, &[4, 8]).unwrap();
    let bias = b.weight("b", Dtype::F32, &[4]).unwrap();
    let y = b.linear(x, w, Some(bias)).unwrap();
    let z = b.add(y, r).unwrap();
    let z = b.gelu_tanh(z).unwrap();
    b.output("z", z).unwrap();
    // Read by a second group too: its bias stays its own pass.
    let y2 = b.linear(x, w, Some(bias)).unwrap();
    let u = b.add(y2, r).unwrap();
    b.output("u", u).unwrap();
    let v = b.mul(y2, r).unwrap();
    let v = b.cast(v, Dtype::Bf16).unwrap();
    b.output("v", v).unwrap();
    let p = b.finish().unwrap();
    let f = plan_all(&p);
    assert_eq!(f.biases.get(&y), Some(&bias));
    assert!(!f.biases.contains_key(&y2));
    let Role::Root(g) = f.role[z.index()] else {
        panic!("gelu roots the group");
    };
    let grp = &f.groups[g];
    assert!(grp.leaves.contains(&y) && grp.leaves.contains(&bias));
    // The product loaded, then one f32 add of the bias (its column), then the group's ops.
    let j = grp.leaves.iter().position(|&l| l == y).unwrap();
    let jb = grp.leaves.iter().position(|&l| l == bias).unwrap();
    let name = &f.kernels[grp.kernel.unwrap()];
    let body = &f.source[f.source.find(&format!("void {name}(")).unwrap()..];
    let load = format!("ldf(p{j}, 0 + c0 * 4LL + c1 * 1LL, DT_F32)");
    let at = body.find(&load).expect("the product loaded");
    let lb = format!("ldf(p{jb}, 0 + c1 * 1LL, DT_F32)");
    assert!(body[at..].contains(&lb), "{body}");
    // A bf16 linear (its output rounded after the bias) keeps its own pass.
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[3, 8]).unwrap();
    let w = b.weight("w", Dtype::Bf16, &[4, 8]).unwrap();
    let bias = b.weight("b", Dtype::Bf16, &[4]).unwrap();
    let y = b.linear(x, w, Some(bias)).unwrap();
    let z = b.gelu_tanh(y).unwrap();
    b.output("z", z).unwrap();
    assert!(plan_all(&b.finish().unwrap()).biases.is_empty());
}

#[test]
fn linears_of_one_input_and_weight_shape_are_siblings() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[1, 5, 4]).unwrap();
    let mut outs = Vec::new();
    for (name, n) in [("q", 8), ("k", 2), ("v", 2)] {
        let w = b.weight(name, Dtype::Bf16, &[n, 4]).unwrap();
        outs.push(b.linear(x, w, None).unwrap());
    }
    // Same shape but a different input: not a sibling.
    let y = b.input("y", Dtype::Bf16, &[1, 5, 4]).unwrap();
    let w = b.weight("o", Dtype::Bf16, &[2, 4]).unwrap();
    outs.push(b.linear(y, w, None).unwrap());
    // A weight read twice is not batched (its buffer is its own).
    let shared = b.weight("shared", Dtype::Bf16, &[8, 4]).unwrap();
    outs.push(b.linear(x, shared, None).unwrap());
    let t = b.transpose(shared, 0, 1).unwrap();
    outs.push(t);
    for (i, o) in outs.into_iter().enumerate() {
        b.output(&format!("o{i}"), o).unwrap();
    }
    let p = b.finish().unwrap();
    let roots: Vec<NodeId> = p.outputs.iter().map(|o| o.value).collect();
    let live = p.ancestors(&roots);
    let groups = siblings(&p, &live);
    assert_eq!(groups.len(), 1, "{groups:?}");
    let names: Vec<String> = groups[0]
        .weights
        .iter()
        .map(|&w| match &p.node(w).op {
            Op::Weight { name, .. } => name.clone(),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(names, ["k", "v"]);
    assert!(groups[0].biases.is_none());
}

#[test]
fn f32_projections_into_one_attention_are_not_siblings() {
    // SigLIP's shape of it: q/k/v f32 linears with biases, each reshaped to heads and
    // permuted into one attention. Stacking them as one wide TF32 GEMM doubled a golden's bf16
    // error (docs/MEASUREMENTS.md, session 23), so f32 linears are never siblings.
    let (b_, t, heads, hd) = (2, 4, 2, 4);
    let d = heads * hd;
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[b_, t, d]).unwrap();
    let mut proj = Vec::new();
    for name in ["q", "k", "v"] {
        let w = b.weight(&format!("{name}.w"), Dtype::F32, &[d, d]).unwrap();
        let bias = b.weight(&format!("{name}.b"), Dtype::F32, &[d]).unwrap();
        let l = b.linear(x, w, Some(bias)).unwrap();
        let r = b.reshape(l, &[b_, t, heads, hd]).unwrap();
        proj.push(b.permute(r, &[0, 2, 1, 3]).unwrap());
    }
    let a = b.attention(proj[0], proj[1], proj[2], None, 0.5).unwrap();
    let m = b.permute(a, &[0, 2, 1, 3]).unwrap();
    b.output("o", m).unwrap();
    let p = b.finish().unwrap();
    let live = vec![true; p.len()];
    assert!(siblings(&p, &live).is_empty());
}

/// adaRMS as pi0.5's step writes it: `cast_bf16(rms(cast_f32(x)) · (1 + scale) + shift)`.
fn ada_rms(norm_out: bool) -> (Program, NodeId, NodeId) {
    let (norm_shape, mod_shape) = (&[1, 3, 8], &[1, 1, 8]);
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, norm_shape).unwrap();
    let scale = b.input("scale", Dtype::F32, mod_shape).unwrap();
    let shift = b.input("shift", Dtype::F32, mod_shape).unwrap();
    let xf = b.cast(x, Dtype::F32).unwrap();
    let n = b.rms_norm(xf, None, 1e-6).unwrap();
    let s1 = b.add_scalar(scale, 1.0).unwrap();
    let m = b.mul(n, s1).unwrap();
    let m = b.add(m, shift).unwrap();
    let y = b.cast(m, Dtype::Bf16).unwrap();
    b.output("y", y).unwrap();
    if norm_out {
        b.output("n", n).unwrap();
    }
    (b.finish().unwrap(), n, y)
}

#[test]
fn a_norm_read_only_by_its_own_elements_is_its_groups_prologue() {
    let (p, n, y) = ada_rms(false);
    let f = plan_all(&p);
    assert_eq!(f.role[n.index()], Role::Prologue);
    let Role::Root(g) = f.role[y.index()] else {
        panic!("the cast roots the group: {:?}", f.role[y.index()]);
    };
    let grp = &f.groups[g];
    assert_eq!(grp.prologue, Some(n));
    assert!(!grp.leaves.contains(&n), "the norm has no buffer to read");
    // The widening cast is still read in place by the norm, inside the fused kernel.
    assert_eq!(f.views[&(n, 0)].base, p.node(p.node(n).inputs[0]).inputs[0]);
    let name = &f.kernels[grp.kernel.unwrap()];
    let src = &f.source;
    let at = src
        .find(&format!("void {name}(NormParams np"))
        .expect("row kernel signature");
    let body = &src[at..];
    assert!(body.contains("norm_stats(np, nx, base, shd, &nm, &nr);"));
    // The norm's f32 value is used as stored (f32: unrounded), then the group's ops.
    assert!(body.contains("const float nv = (norm_elem(np, nx, nw, nb, base, jj, nm, nr));"));
    assert!(src.contains("__device__ __forceinline__ float norm_elem("));
}

/// A gated residual sum `x + g·o` (bf16) read by an adaRMS norm's group and, later, by the
/// next residual sum; `read_by_group`: the sum is also a leaf of the norm's own group.
fn residual_then_norm(read_by_group: bool) -> (Program, NodeId, NodeId, NodeId) {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[1, 3, 8]).unwrap();
    let o = b.input("o", Dtype::Bf16, &[1, 3, 8]).unwrap();
    let g = b.input("g", Dtype::Bf16, &[1, 1, 8]).unwrap();
    let go = b.mul(o, g).unwrap();
    let sum = b.add(x, go).unwrap();
    let sf = b.cast(sum, Dtype::F32).unwrap();
    let n = b.rms_norm(sf, None, 1e-6).unwrap();
    let m = b.mul_scalar(n, 2.0).unwrap();
    let m = if read_by_group {
        let sf2 = b.cast(sum, Dtype::F32).unwrap();
        b.add(m, sf2).unwrap()
    } else {
        m
    };
    // Read by a product, as a step's q/k/v projections read it.
    let y = b.cast(m, Dtype::Bf16).unwrap();
    let w = b.input("w", Dtype::Bf16, &[8, 8]).unwrap();
    let z = b.linear(y, w, None).unwrap();
    let next = b.add(sum, z).unwrap();
    b.output("next", next).unwrap();
    (b.finish().unwrap(), sum, y, n)
}

#[test]
fn a_sum_read_by_a_prologue_norm_is_computed_first_by_its_kernel() {
    let (p, sum, y, n) = residual_then_norm(false);
    let f = plan_all(&p);
    assert_eq!(f.role[n.index()], Role::Prologue);
    let (Role::Root(gs), Role::Root(gy)) = (f.role[sum.index()], f.role[y.index()]) else {
        panic!("{:?} {:?}", f.role[sum.index()], f.role[y.index()]);
    };
    assert!(f.groups[gs].absorbed && !f.groups[gy].absorbed);
    assert_eq!(f.groups[gy].first, Some(gs));
    assert_eq!(f.groups[gs].root, sum);
    let name = &f.kernels[f.groups[gy].kernel.unwrap()];
    let at = f.source.find(&format!("void {name}(")).unwrap();
    let src = &f.source[at..];
    let src = &src[..src.find("\n}\n").unwrap()];
    // The sum's leaves and output follow po; its elements are stored before the barrier
    // that precedes the norm's statistics (which read them through nx).
    let leaves = f.groups[gs].leaves.len();
    assert!(src.contains("void* po, const void* q0"), "{src}");
    assert!(
        src.contains(&format!("const void* q{}, void* qo)", leaves - 1)),
        "{src}"
    );
    let store = src.find("qo)[i] =").unwrap();
    let barrier = src.find("__syncthreads();\n  float nm, nr;").unwrap();
    assert!(
        store < barrier && barrier < src.find("norm_stats(").unwrap(),
        "{src}"
    );
    let first = &src[src.find('{').unwrap()..barrier];
    assert!(!first.contains("p0") && !first.contains("po)"), "{src}");
    // Read by its own norm's group too (other rows' elements may not be written yet), it
    // stays a launch of its own.
    let (p, sum, _, _) = residual_then_norm(true);
    let f = plan_all(&p);
    let Role::Root(gs) = f.role[sum.index()] else {
        panic!()
    };
    assert!(!f.groups[gs].absorbed);
    assert!(f.groups.iter().all(|g| g.first.is_none()));
}

#[test]
fn a_norm_read_by_a_product_roots_a_group_that_computes_its_input_sum_first() {
    // The prefix's order: a residual sum, a norm read only by a linear, the sum read again.
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[1, 3, 8]).unwrap();
    let o = b.input("o", Dtype::Bf16, &[1, 3, 8]).unwrap();
    let w = b.input("w", Dtype::Bf16, &[8, 8]).unwrap();
    let sum = b.add(x, o).unwrap();
    let n = b.rms_norm(sum, None, 1e-6).unwrap();
    let z = b.linear(n, w, None).unwrap();
    let next = b.add(sum, z).unwrap();
    b.output("next", next).unwrap();
    let p = b.finish().unwrap();
    let f = plan_all(&p);
    let (Role::Root(gn), Role::Root(gs)) = (f.role[n.index()], f.role[sum.index()]) else {
        panic!("{:?} {:?}", f.role[n.index()], f.role[sum.index()]);
    };
    let grp = &f.groups[gn];
    assert_eq!((grp.root, grp.prologue, grp.first), (n, Some(n), Some(gs)));
    assert!(f.groups[gs].absorbed && grp.leaves.is_empty());
    let name = &f.kernels[grp.kernel.unwrap()];
    let src = &f.source[f.source.find(&format!("void {name}(")).unwrap()..];
    let src = &src[..src.find("\n}\n").unwrap()];
    // The norm's value stored as `pt_norm` stores it (rounded once to its dtype).
    assert!(
        src.contains("const float nv = bf2f(f2bf(norm_elem("),
        "{src}"
    );
    assert!(
        src.contains("((unsigned short*)po)[i] = f2bf(nv);"),
        "{src}"
    );
    // A norm whose input is not a fused value stays `pt_norm`.
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[1, 3, 8]).unwrap();
    let w = b.input("w", Dtype::Bf16, &[8, 8]).unwrap();
    let n = b.rms_norm(x, None, 1e-6).unwrap();
    let z = b.linear(n, w, None).unwrap();
    b.output("z", z).unwrap();
    let p = b.finish().unwrap();
    assert_eq!(plan_all(&p).role[n.index()], Role::Plain);
}

#[test]
fn a_norm_read_off_its_own_elements_or_by_an_output_stays_a_kernel() {
    // The group's root broadcasts the norm over a leading dim: read at other elements.
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[3, 8]).unwrap();
    let e = b.input("e", Dtype::F32, &[2, 3, 8]).unwrap();
    let n = b.rms_norm(x, None, 1e-6).unwrap();
    let y = b.mul(e, n).unwrap();
    b.output("y", y).unwrap();
    let p = b.finish().unwrap();
    let f = plan_all(&p);
    assert_eq!(f.role[n.index()], Role::Plain);
    assert!(f.groups.iter().all(|g| g.prologue.is_none()));
    // A norm that is an output is materialized.
    let (p, n, _) = ada_rms(true);
    assert_eq!(plan_all(&p).role[n.index()], Role::Plain);
}
