//! Tests of operands read in place: free views, reshape strides, repeated K/V heads, widening
//! casts and folded masks, fused attentions.

use super::*;

#[test]
fn a_permute_moving_only_unit_dims_is_a_free_view() {
    let mut b = Builder::new();
    let v = b.input("v", Dtype::Bf16, &[1, 50, 1, 256]).unwrap();
    let k = b.input("k", Dtype::Bf16, &[1, 50, 2, 256]).unwrap();
    let vp = b.permute(v, &[0, 2, 1, 3]).unwrap();
    let kp = b.permute(k, &[0, 2, 1, 3]).unwrap();
    b.output("v", vp).unwrap();
    b.output("k", kp).unwrap();
    let p = b.finish().unwrap();
    assert!(moves_only_unit_dims(&p, vp));
    assert!(!moves_only_unit_dims(&p, kp));
    let f = plan_all(&p);
    assert_eq!(f.role[vp.index()], Role::Plain);
    assert!(matches!(f.role[kp.index()], Role::Root(_)));
}

#[test]
fn pi05s_bf16_attentions_run_whole_up_to_the_query_limit() {
    let cfg = petite_pi05::Pi05Config::default();
    let bf16 = petite_pi05::build_all(&cfg, petite_pi05::Precision::Bf16).unwrap();
    let softmaxes = |p: &Program| {
        p.ids()
            .filter(|&i| matches!(p.node(i).op, Op::Softmax { .. }))
            .count()
    };
    let step = &bf16.step;
    let f = plan_queries(step, 128);
    assert!(softmaxes(step) > 0);
    assert_eq!(f.attentions.len(), softmaxes(step), "every step attention");
    for (&pv, a) in &f.attentions {
        assert!(matches!(f.role[pv.index()], Role::Plain | Role::Transposed));
        assert_eq!(f.role[a.logits.index()], Role::Attended);
        let cast = step.node(pv).inputs[0];
        assert_eq!(f.role[cast.index()], Role::Attended);
        assert_eq!(f.role[step.node(cast).inputs[0].index()], Role::Attended);
        // One KV head read by all 8 query heads in place: head stride 0.
        assert_eq!(f.views[&(a.logits, 1)].strides[1], 0);
        assert_eq!(f.views[&(pv, 1)].strides[1], 0);
        assert!(matches!(a.scale, Some((_, Dtype::Bf16))));
        // The prefix's K/V and the step's own, read where they lie (no concat).
        let (kv, n0) = a.pieces.expect("K/V read as two pieces");
        assert_eq!(n0, step.node(kv[0]).tensor().unwrap().shape[2]);
        for m in [a.logits, pv] {
            let concat = f.views[&(m, 1)].base;
            assert!(matches!(step.node(concat).op, Op::Concat { axis: 2 }));
            assert_eq!(f.role[concat.index()], Role::Attended);
        }
    }
    // The prefix's 968 queries stay three launches unless asked; 0 fuses none.
    let prefix = &bf16.prefix;
    assert!(plan_queries(prefix, 128).attentions.is_empty());
    assert_eq!(
        plan_queries(prefix, usize::MAX).attentions.len(),
        softmaxes(prefix)
    );
    // Their kernels are the last three, loaded from the attention module (compiled once a
    // process), never from the program's own source.
    let [l, pv, cl] = f.attention_kernels.expect("attention kernels");
    assert_eq!(
        (&*f.kernels[l], &*f.kernels[pv], &*f.kernels[cl]),
        ("pt_attn_logits", "pt_attn_pv", "pt_attn_cl")
    );
    assert_eq!(cl + 1, f.kernels.len());
    assert!(!f.source.contains("pt_attn"));
    // SigLIP's f32 out/fc1/fc2 linears have their biases added by the groups reading them
    // (q/k/v are read by the attention op: their own bias pass).
    let folded = plan_queries(prefix, 0).biases.len();
    assert!(folded >= 3 * 27, "{folded} biases folded");
    let none = plan_queries(step, 0);
    assert!(none.attentions.is_empty() && none.attention_kernels.is_none());
    assert!(!none.role.contains(&Role::Attended));
    assert!(!none.source.contains("pt_attn"));
    // f32 attention is its own op, never this chain.
    let f32 = petite_pi05::build_all(&cfg, petite_pi05::Precision::F32).unwrap();
    assert!(plan_queries(&f32.step, usize::MAX).attentions.is_empty());
}

#[test]
fn reshape_strides_view_what_torch_views_and_refuse_the_rest() {
    // Dense: any reshape is a view.
    assert_eq!(
        reshape_strides(&[2, 3, 4], &[12, 4, 1], &[6, 4]),
        Some(vec![4, 1])
    );
    assert_eq!(
        reshape_strides(&[1, 1, 5, 4], &[20, 20, 4, 1], &[1, 1, 1, 5, 4]),
        Some(vec![20, 20, 20, 4, 1])
    );
    // Merging a broadcast (stride 0) head dim with a size-1 dim stays a view (a size-1
    // dim's stride is never used).
    assert_eq!(
        reshape_strides(&[1, 1, 8, 5, 4], &[20, 20, 0, 4, 1], &[1, 8, 5, 4]),
        Some(vec![0, 0, 4, 1])
    );
    // A transposed matrix cannot be flattened without a copy.
    assert_eq!(reshape_strides(&[3, 4], &[1, 3], &[12]), None);
    assert_eq!(reshape_strides(&[3, 4], &[4, 1], &[5, 2]), None);
}

/// Grouped-query attention as the bf16 programs write it: K/V concatenated with the
/// prefix's, heads repeated by expand, K transposed; both matmul operands become views.
#[test]
fn repeated_and_transposed_kv_heads_are_read_in_place() {
    let mut b = Builder::new();
    let q = b.input("q", Dtype::Bf16, &[1, 8, 5, 4]).unwrap();
    let pk = b.input("pk", Dtype::Bf16, &[1, 1, 7, 4]).unwrap();
    let k = b.input("k", Dtype::Bf16, &[1, 1, 5, 4]).unwrap();
    let kk = b.concat(&[pk, k], 2).unwrap();
    let r = b.reshape(kk, &[1, 1, 1, 12, 4]).unwrap();
    let e = b.expand(r, &[1, 1, 8, 12, 4]).unwrap();
    let k8 = b.reshape(e, &[1, 8, 12, 4]).unwrap();
    let kt = b.permute(k8, &[0, 1, 3, 2]).unwrap();
    let logits = b.matmul(q, kt).unwrap();
    b.output("logits", logits).unwrap();
    let p = b.finish().unwrap();
    let f = plan_all(&p);
    let v = &f.views[&(logits, 1)];
    assert_eq!(v.base, kk);
    assert_eq!(v.shape, vec![1, 8, 4, 12]);
    assert_eq!(v.strides, vec![0, 0, 1, 4]);
    let m = crate::plan::MatOperand::from_view(&v.shape, &v.strides).unwrap();
    assert_eq!(m.trans_ld(), (true, 4));
    assert_eq!(m.batch_offsets(&[1, 8]).unwrap(), vec![0; 8]);
    for n in [r, e, k8, kt] {
        assert_eq!(f.role[n.index()], Role::View);
    }
    // The concat is still computed (once, 12 rows, not 8 × 12).
    assert!(matches!(f.role[kk.index()], Role::Root(_)));
    assert!(!f.views.contains_key(&(logits, 0)), "q is read as it is");
}

#[test]
fn row_kernels_read_widening_casts_in_place_fold_masks_and_narrow_into_their_cast() {
    // rms_norm(cast_f32(x_bf16)); softmax(cast_f32(l_bf16) + mask) read by a bf16 cast.
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[1, 3, 8]).unwrap();
    let l = b.input("l", Dtype::Bf16, &[1, 2, 3, 5]).unwrap();
    let mask = b.input("mask", Dtype::F32, &[1, 1, 3, 5]).unwrap();
    let xw = b.cast(x, Dtype::F32).unwrap();
    let n = b.rms_norm(xw, None, 1e-6).unwrap();
    b.output("n", n).unwrap();
    let ls = b.mul_scalar(l, 0.1).unwrap();
    let lw = b.cast(ls, Dtype::F32).unwrap();
    let s = b.add(lw, mask).unwrap();
    let sm = b.softmax(s, -1).unwrap();
    let out = b.cast(sm, Dtype::Bf16).unwrap();
    b.output("p", out).unwrap();
    let p = b.finish().unwrap();
    let f = plan_all(&p);
    let (n_id, p_id) = (n, out);
    let norm_in = p.node(n_id).inputs[0];
    assert_eq!(
        f.role[norm_in.index()],
        Role::View,
        "the widening cast is never run"
    );
    assert_eq!(f.views[&(n_id, 0)].base, p.node(norm_in).inputs[0]);
    let sm_id = p.node(p_id).inputs[0];
    assert_eq!(f.role[sm_id.index()], Role::Narrowed);
    assert_eq!(
        f.role[p_id.index()],
        Role::Plain,
        "the cast runs the softmax"
    );
    let add = p.node(sm_id).inputs[0];
    assert_eq!(
        f.role[add.index()],
        Role::View,
        "the mask add is the softmax's"
    );
    let [lw_id, mask_id] = [p.node(add).inputs[0], p.node(add).inputs[1]];
    assert_eq!(f.role[lw_id.index()], Role::View);
    let ls_id = p.node(lw_id).inputs[0];
    assert_eq!(
        f.role[ls_id.index()],
        Role::View,
        "the bf16 scaling is the softmax's"
    );
    assert_eq!(
        f.views[&(sm_id, 0)].base,
        p.node(ls_id).inputs[0],
        "reads l in place"
    );
    assert_eq!(f.masks[&sm_id].mask, mask_id);
    assert_eq!(
        f.masks[&sm_id].scale,
        Some((petite_dtype::round_through_bf16(0.1), Dtype::Bf16)),
        "the scalar rounded to bf16 first, as the fused kernel rounds it"
    );
    assert!(f.groups.is_empty(), "nothing left to fuse: {:?}", f.role);
}

#[test]
fn a_widening_cast_read_twice_or_narrowing_is_computed() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[2, 8]).unwrap();
    let y = b.input("y", Dtype::Bf16, &[2, 8]).unwrap();
    let xn = b.cast(x, Dtype::Bf16).unwrap();
    let yw = b.cast(y, Dtype::F32).unwrap();
    let n1 = b.rms_norm(xn, None, 1e-6).unwrap();
    let n2 = b.rms_norm(yw, None, 1e-6).unwrap();
    b.output("n1", n1).unwrap();
    b.output("n2", n2).unwrap();
    b.output("yw", yw).unwrap();
    let p = b.finish().unwrap();
    let f = plan_all(&p);
    assert!(f.views.is_empty(), "{:?}", f.views);
    assert!(f.masks.is_empty());
}

#[test]
fn a_head_merging_permute_runs_the_product_it_permutes() {
    for batch in [1, 2] {
        let mut b = Builder::new();
        let pr = b.input("p", Dtype::Bf16, &[batch, 4, 5, 6]).unwrap();
        let v = b.input("v", Dtype::Bf16, &[batch, 4, 6, 8]).unwrap();
        let q = b.input("q", Dtype::F32, &[batch, 4, 5, 8]).unwrap();
        let mm = b.matmul(pr, v).unwrap();
        let pm = b.permute(mm, &[0, 2, 1, 3]).unwrap();
        b.output("o", pm).unwrap();
        let at = b.attention(q, q, q, None, 0.5).unwrap();
        let pa = b.permute(at, &[0, 2, 1, 3]).unwrap();
        b.output("a", pa).unwrap();
        let p = b.finish().unwrap();
        let f = plan_all(&p);
        // A matmul's GEMM batches heads only; attention steps through B itself.
        let want = if batch == 1 {
            Role::Transposed
        } else {
            Role::Plain
        };
        assert_eq!(f.role[mm.index()], want, "batch {batch}");
        assert_eq!(f.role[at.index()], Role::Transposed, "batch {batch}");
        assert_eq!(f.role[pa.index()], Role::Plain, "the permute runs it");
    }
    // Another permute, or a second reader, keeps the product's own buffer.
    let mut b = Builder::new();
    let q = b.input("q", Dtype::F32, &[1, 4, 5, 8]).unwrap();
    let at = b.attention(q, q, q, None, 0.5).unwrap();
    let pa = b.permute(at, &[0, 1, 3, 2]).unwrap();
    b.output("a", pa).unwrap();
    let at2 = b.attention(q, q, q, None, 0.5).unwrap();
    let pb = b.permute(at2, &[0, 2, 1, 3]).unwrap();
    b.output("b", pb).unwrap();
    b.output("at2", at2).unwrap();
    let p = b.finish().unwrap();
    let f = plan_all(&p);
    assert_eq!(f.role[at.index()], Role::Plain);
    assert_eq!(f.role[at2.index()], Role::Plain);
}

#[test]
fn attention_reads_heads_split_out_of_a_projection_in_place() {
    // [B, S, H·D] → [B, S, H, D] → [B, H, S, D], as SigLIP splits q, k and v.
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[3, 5, 4 * 8]).unwrap();
    let split = |b: &mut Builder| {
        let r = b.reshape(x, &[3, 5, 4, 8]).unwrap();
        (r, b.permute(r, &[0, 2, 1, 3]).unwrap())
    };
    let (rq, q) = split(&mut b);
    let (_, k) = split(&mut b);
    let (_, v) = split(&mut b);
    let at = b.attention(q, k, v, None, 0.5).unwrap();
    b.output("a", at).unwrap();
    let p = b.finish().unwrap();
    let f = plan_all(&p);
    for (j, t) in [q, k, v].into_iter().enumerate() {
        let w = &f.views[&(at, j)];
        assert_eq!(w.base, x);
        assert_eq!(w.shape, vec![3, 4, 5, 8]);
        assert_eq!(w.strides, vec![5 * 32, 8, 32, 1], "operand {j}");
        assert_eq!(f.role[t.index()], Role::View);
    }
    assert_eq!(f.role[rq.index()], Role::View);
    // A transposed k (last stride not 1) is not a row-major head block: computed.
    let mut b = Builder::new();
    let q = b.input("q", Dtype::F32, &[1, 2, 5, 8]).unwrap();
    let kt = b.input("kt", Dtype::F32, &[1, 2, 8, 5]).unwrap();
    let k = b.permute(kt, &[0, 1, 3, 2]).unwrap();
    let at = b.attention(q, k, q, None, 0.5).unwrap();
    b.output("a", at).unwrap();
    let p = b.finish().unwrap();
    let f = plan_all(&p);
    assert!(!f.views.contains_key(&(at, 1)));
    assert!(matches!(f.role[k.index()], Role::Root(_)));
}

/// Issue 51: in pi0.5's quantized step (50 rows) every dequantized weight is read by its linear
/// from the codes ([`Role::WeightOnly`]: no bf16 copy of the expert's weights); in the prefix
/// (hundreds of rows) none is, so cuBLAS runs those products on the dequantized weight.
#[test]
fn pi05s_quantized_step_reads_codes_and_its_prefix_dequantizes() {
    let cfg = petite_pi05::Pi05Config::default();
    let bf16 = petite_pi05::build_all(&cfg, petite_pi05::Precision::Bf16).unwrap();
    for q in [
        petite_graph::quant::Quant::Int8,
        petite_graph::quant::Quant::Fp8E4M3,
    ] {
        let (progs, done) = petite_pi05::quant::quantize(&bf16, q, &[]).unwrap();
        assert!(!done.names.is_empty());
        for (name, p, weight_only) in [
            ("step", &progs.step, true),
            ("prefix", &progs.prefix, false),
        ] {
            let f = plan_all(p);
            let dq: Vec<_> = p
                .ids()
                .filter(|&i| matches!(p.node(i).op, Op::Dequantize { .. }))
                .collect();
            assert!(!dq.is_empty(), "{q} {name}: no dequantize");
            for i in dq {
                assert_eq!(
                    f.role[i.index()] == Role::WeightOnly,
                    weight_only,
                    "{q} {name}: {}",
                    p.describe(i)
                );
            }
            // Without bf16 `mma` (before sm_80) every weight is dequantized.
            let off = Options::for_device((7, 5), &crate::Tuning::default());
            assert!(!off.weight_only);
            let f = plan_program(p, off).unwrap();
            assert!(!f.role.contains(&Role::WeightOnly), "{q} {name}");
        }
    }
}
