//! Shape/dtype inference per op, against hand-computed results, and the build-time errors.

use petite_graph::{Builder, Dtype, Error, Op, TensorType, ValueId};

fn shape(b: &Builder, v: ValueId) -> Vec<usize> {
    b.shape(v).unwrap().to_vec()
}

fn reason(e: Error) -> String {
    match e {
        Error::InvalidNode { reason, .. } => reason,
        other => panic!("expected InvalidNode, got {other:?}"),
    }
}

#[test]
fn linear_with_and_without_bias() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[1, 968, 2048]).unwrap();
    let w = b.weight("q.weight", Dtype::Bf16, &[256, 2048]).unwrap();
    let y = b.linear(x, w, None).unwrap();
    assert_eq!(shape(&b, y), [1, 968, 256]);
    assert_eq!(b.dtype(y).unwrap(), Dtype::Bf16);
    let bias = b.weight("q.bias", Dtype::Bf16, &[256]).unwrap();
    let y = b.linear(x, w, Some(bias)).unwrap();
    assert_eq!(shape(&b, y), [1, 968, 256]);
    assert_eq!(b.program().node(y).inputs, vec![x, w, bias]);
    let v = b.input("v", Dtype::Bf16, &[2048]).unwrap();
    let y = b.linear(v, w, None).unwrap();
    assert_eq!(shape(&b, y), [256]);
}

#[test]
fn linear_errors() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[4, 8]).unwrap();
    let w = b.weight("w", Dtype::F32, &[16, 9]).unwrap();
    let r = reason(b.linear(x, w, None).unwrap_err());
    assert!(
        r.contains("expected shape [out, 8]") && r.contains("[16, 9]"),
        "{r}"
    );
    let w = b.weight("w2", Dtype::Bf16, &[16, 8]).unwrap();
    let r = reason(b.linear(x, w, None).unwrap_err());
    assert!(
        r.contains("expected dtype f32") && r.contains("found bf16"),
        "{r}"
    );
    let w = b.weight("w3", Dtype::F32, &[16, 8]).unwrap();
    let bias = b.weight("b3", Dtype::F32, &[8]).unwrap();
    let r = reason(b.linear(x, w, Some(bias)).unwrap_err());
    assert!(
        r.contains("expected shape [16]") && r.contains("[8]"),
        "{r}"
    );
}

#[test]
fn matmul_broadcasts_batch_dims() {
    let mut b = Builder::new();
    let q = b.input("q", Dtype::F32, &[2, 8, 50, 256]).unwrap();
    let k = b.input("kt", Dtype::F32, &[2, 1, 256, 1018]).unwrap();
    let y = b.matmul(q, k).unwrap();
    assert_eq!(shape(&b, y), [2, 8, 50, 1018]);
    let a = b.input("a", Dtype::F32, &[3, 4]).unwrap();
    let c = b.input("c", Dtype::F32, &[5, 4, 6]).unwrap();
    let y = b.matmul(a, c).unwrap();
    assert_eq!(shape(&b, y), [5, 3, 6]);
    let bad = b.input("bad", Dtype::F32, &[5, 6]).unwrap();
    let r = reason(b.matmul(a, bad).unwrap_err());
    assert!(r.contains("K = 4") && r.contains("K = 5"), "{r}");
    let a2 = b.input("a2", Dtype::F32, &[2, 3, 4]).unwrap();
    let c2 = b.input("c2", Dtype::F32, &[3, 4, 6]).unwrap();
    let r = reason(b.matmul(a2, c2).unwrap_err());
    assert!(r.contains("batch dims"), "{r}");
    let v = b.input("vec", Dtype::F32, &[4]).unwrap();
    let r = reason(b.matmul(v, c).unwrap_err());
    assert!(r.contains("rank >= 2"), "{r}");
}

#[test]
fn conv2d_patch_embedding() {
    let mut b = Builder::new();
    let x = b.input("img", Dtype::F32, &[3, 3, 224, 224]).unwrap();
    let w = b
        .weight("patch.weight", Dtype::F32, &[1152, 3, 14, 14])
        .unwrap();
    let bias = b.weight("patch.bias", Dtype::F32, &[1152]).unwrap();
    let y = b.conv2d(x, w, Some(bias), [14, 14], [0, 0]).unwrap();
    assert_eq!(shape(&b, y), [3, 1152, 16, 16]);
    // padding 1, stride 2, kernel 3 on 7x5: (7+2-3)/2+1 = 4, (5+2-3)/2+1 = 3
    let x = b.input("x", Dtype::F32, &[1, 2, 7, 5]).unwrap();
    let w = b.weight("w", Dtype::F32, &[4, 2, 3, 3]).unwrap();
    let y = b.conv2d(x, w, None, [2, 2], [1, 1]).unwrap();
    assert_eq!(shape(&b, y), [1, 4, 4, 3]);
    let wbad = b.weight("wbad", Dtype::F32, &[4, 3, 3, 3]).unwrap();
    let r = reason(b.conv2d(x, wbad, None, [1, 1], [0, 0]).unwrap_err());
    assert!(r.contains("expected [O, 2, KH, KW]"), "{r}");
    let r = reason(b.conv2d(x, w, None, [0, 1], [0, 0]).unwrap_err());
    assert!(r.contains("stride"), "{r}");
    let big = b.weight("big", Dtype::F32, &[4, 2, 9, 1]).unwrap();
    let r = reason(b.conv2d(x, big, None, [1, 1], [0, 0]).unwrap_err());
    assert!(r.contains("larger than padded input"), "{r}");
}

#[test]
fn norms() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[1, 968, 2048]).unwrap();
    let w = b.weight("ln.weight", Dtype::F32, &[2048]).unwrap();
    let y = b.rms_norm(x, Some(w), 1e-6).unwrap();
    assert_eq!(
        b.tensor(y).unwrap(),
        &TensorType::new(Dtype::Bf16, &[1, 968, 2048])
    );
    let y = b.rms_norm(x, None, 1e-6).unwrap();
    assert_eq!(b.program().node(y).inputs, vec![x]);
    let wbad = b.weight("bad", Dtype::F32, &[1024]).unwrap();
    let r = reason(b.rms_norm(x, Some(wbad), 1e-6).unwrap_err());
    assert!(
        r.contains("expected shape [2048]") && r.contains("[1024]"),
        "{r}"
    );
    let x = b.input("v", Dtype::F32, &[256, 1152]).unwrap();
    let w = b.weight("lnw", Dtype::F32, &[1152]).unwrap();
    let bias = b.weight("lnb", Dtype::F32, &[1152]).unwrap();
    let y = b.layer_norm(x, w, bias, 1e-6).unwrap();
    assert_eq!(shape(&b, y), [256, 1152]);
    let r = reason(b.layer_norm(x, w, wbad, 1e-6).unwrap_err());
    assert!(r.contains("input 2 (bias)"), "{r}");
    let i = b.input("i", Dtype::I64, &[4]).unwrap();
    let r = reason(b.rms_norm(i, None, 1e-6).unwrap_err());
    assert!(
        r.contains("expected a float dtype") && r.contains("i64"),
        "{r}"
    );
}

#[test]
fn elementwise_broadcasting_and_scalars() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[1, 50, 1024]).unwrap();
    let s = b.input("scale", Dtype::F32, &[1, 1, 1024]).unwrap();
    let y = b.mul(x, s).unwrap();
    assert_eq!(shape(&b, y), [1, 50, 1024]);
    let c = b.input("col", Dtype::F32, &[7, 1]).unwrap();
    let r = b.input("row", Dtype::F32, &[3]).unwrap();
    let y = b.sub(c, r).unwrap();
    assert_eq!(shape(&b, y), [7, 3]);
    let sc = b.scalar(Dtype::F32, 2.0).unwrap();
    let y = b.div(sc, c).unwrap();
    assert_eq!(shape(&b, y), [7, 1]);
    let y = b.add_scalar(s, 1.0).unwrap();
    assert_eq!(shape(&b, y), [1, 1, 1024]);
    let y = b.rsub_scalar(1.0, s).unwrap();
    assert_eq!(
        b.program().node(y).op,
        Op::BinaryScalar {
            kind: petite_graph::BinaryOp::Sub,
            scalar: 1.0,
            scalar_lhs: true
        }
    );
    let bad = b.input("bad", Dtype::F32, &[1, 49, 1024]).unwrap();
    let r = reason(b.add(x, bad).unwrap_err());
    assert!(
        r.contains("do not broadcast") && r.contains("50 vs 49"),
        "{r}"
    );
    let h = b.input("h", Dtype::Bf16, &[1, 50, 1024]).unwrap();
    let r = reason(b.add(x, h).unwrap_err());
    assert!(
        r.contains("expected dtype f32") && r.contains("bf16"),
        "{r}"
    );
    let i = b.input("i", Dtype::I64, &[3]).unwrap();
    let y = b.sub_scalar(i, 1.0).unwrap();
    assert_eq!(b.dtype(y).unwrap(), Dtype::I64);
    let r = reason(b.add_scalar(i, 0.5).unwrap_err());
    assert!(r.contains("not an integer"), "{r}");
    let r = reason(b.div(i, i).unwrap_err());
    assert!(r.contains("float"), "{r}");
    let m = b.input("m", Dtype::Bool, &[3]).unwrap();
    assert!(b.add(m, m).is_err());
}

#[test]
fn unary_ops() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::Bf16, &[2, 3]).unwrap();
    for f in [
        Builder::neg,
        Builder::exp,
        Builder::sqrt,
        Builder::rsqrt,
        Builder::sin,
        Builder::cos,
        Builder::tanh,
        Builder::gelu_tanh,
        Builder::silu,
    ] {
        let y = f(&mut b, x).unwrap();
        assert_eq!(b.tensor(y).unwrap(), &TensorType::new(Dtype::Bf16, &[2, 3]));
    }
    let i = b.input("i", Dtype::I64, &[2]).unwrap();
    let y = b.neg(i).unwrap();
    assert_eq!(b.dtype(y).unwrap(), Dtype::I64);
    let r = reason(b.exp(i).unwrap_err());
    assert!(
        r.contains("exp needs a float dtype") && r.contains("i64"),
        "{r}"
    );
}

#[test]
fn compare_logical_where() {
    let mut b = Builder::new();
    let cum = b.input("cum", Dtype::I64, &[1, 968]).unwrap();
    let kq = b.unsqueeze(cum, 1).unwrap(); // [1, 1, 968]
    let qk = b.unsqueeze(cum, 2).unwrap(); // [1, 968, 1]
    let allowed = b.le(kq, qk).unwrap();
    assert_eq!(
        b.tensor(allowed).unwrap(),
        &TensorType::new(Dtype::Bool, &[1, 968, 968])
    );
    for f in [
        Builder::lt,
        Builder::eq,
        Builder::ne,
        Builder::gt,
        Builder::ge,
    ] {
        let y = f(&mut b, kq, qk).unwrap();
        assert_eq!(b.dtype(y).unwrap(), Dtype::Bool);
    }
    let pad = b.input("pad", Dtype::Bool, &[1, 968]).unwrap();
    let p2 = b.unsqueeze(pad, 1).unwrap();
    let both = b.and(allowed, p2).unwrap();
    assert_eq!(shape(&b, both), [1, 968, 968]);
    let either = b.or(both, p2).unwrap();
    let not = b.not(either).unwrap();
    assert_eq!(b.dtype(not).unwrap(), Dtype::Bool);
    let zero = b.scalar(Dtype::F32, 0.0).unwrap();
    let fill = b.scalar(Dtype::F32, -2.3819763e38).unwrap();
    let mask = b.select(not, fill, zero).unwrap();
    assert_eq!(
        b.tensor(mask).unwrap(),
        &TensorType::new(Dtype::F32, &[1, 968, 968])
    );
    let r = reason(b.and(allowed, cum).unwrap_err());
    assert!(
        r.contains("expected dtype bool") && r.contains("i64"),
        "{r}"
    );
    let r = reason(b.select(cum, fill, zero).unwrap_err());
    assert!(r.contains("input 0: expected dtype bool"), "{r}");
    let half = b.scalar(Dtype::Bf16, 0.0).unwrap();
    let r = reason(b.select(not, fill, half).unwrap_err());
    assert!(r.contains("input 2 (b): expected dtype f32"), "{r}");
    let f = b.input("f", Dtype::F32, &[1, 968]).unwrap();
    let r = reason(b.lt(cum, f).unwrap_err());
    assert!(r.contains("expected dtype i64"), "{r}");
}

#[test]
fn softmax_rope_attention() {
    let mut b = Builder::new();
    let q = b.input("q", Dtype::Bf16, &[1, 8, 50, 256]).unwrap();
    let k = b.input("k", Dtype::Bf16, &[1, 1, 1018, 256]).unwrap();
    let v = b.input("v", Dtype::Bf16, &[1, 1, 1018, 256]).unwrap();
    let m = b.input("mask", Dtype::F32, &[1, 1, 50, 1018]).unwrap();
    let o = b.attention(q, k, v, Some(m), 0.0625).unwrap();
    assert_eq!(
        b.tensor(o).unwrap(),
        &TensorType::new(Dtype::Bf16, &[1, 8, 50, 256])
    );
    let o = b.attention(q, k, v, None, 0.0625).unwrap();
    assert_eq!(shape(&b, o), [1, 8, 50, 256]);
    // Dv may differ from D
    let v2 = b.input("v2", Dtype::Bf16, &[1, 1, 1018, 64]).unwrap();
    let o = b.attention(q, k, v2, None, 0.0625).unwrap();
    assert_eq!(shape(&b, o), [1, 8, 50, 64]);
    let k3 = b.input("k3", Dtype::Bf16, &[1, 3, 1018, 256]).unwrap();
    let r = reason(b.attention(q, k3, v, None, 0.0625).unwrap_err());
    assert!(r.contains("multiple of kv heads 3"), "{r}");
    let mbad = b.input("mbad", Dtype::F32, &[1, 1, 50, 1017]).unwrap();
    let r = reason(b.attention(q, k, v, Some(mbad), 0.0625).unwrap_err());
    assert!(
        r.contains("[1, 8, 50, 1018]") && r.contains("[1, 1, 50, 1017]"),
        "{r}"
    );
    let vbad = b.input("vbad", Dtype::Bf16, &[1, 1, 1000, 256]).unwrap();
    let r = reason(b.attention(q, k, vbad, None, 0.0625).unwrap_err());
    assert!(r.contains("input 2 (v)"), "{r}");

    let cos = b.input("cos", Dtype::Bf16, &[1, 1, 50, 256]).unwrap();
    let sin = b.input("sin", Dtype::Bf16, &[1, 1, 50, 256]).unwrap();
    let y = b.rope(q, cos, sin).unwrap();
    assert_eq!(shape(&b, y), [1, 8, 50, 256]);
    let odd = b.input("odd", Dtype::Bf16, &[1, 8, 50, 255]).unwrap();
    let r = reason(b.rope(odd, cos, sin).unwrap_err());
    assert!(r.contains("even"), "{r}");
    let cos_bad = b.input("cos_bad", Dtype::Bf16, &[1, 2, 50, 256]).unwrap();
    let r = reason(b.rope(q, cos_bad, sin).unwrap_err());
    assert!(r.contains("input 1 (cos)"), "{r}");

    let sm = b.softmax(q, -1).unwrap();
    assert_eq!(b.program().node(sm).op, Op::Softmax { axis: 3 });
    let r = reason(b.softmax(q, 4).unwrap_err());
    assert!(r.contains("axis 4 out of range for rank 4"), "{r}");
}

#[test]
fn embedding_gather() {
    let mut b = Builder::new();
    let table = b.weight("embed", Dtype::Bf16, &[257152, 2048]).unwrap();
    let tok = b.input("tokens", Dtype::I64, &[1, 200]).unwrap();
    let e = b.embedding(table, tok).unwrap();
    assert_eq!(
        b.tensor(e).unwrap(),
        &TensorType::new(Dtype::Bf16, &[1, 200, 2048])
    );
    let pos = b.arange_i64(256).unwrap();
    let pe = b.weight("pos", Dtype::F32, &[256, 1152]).unwrap();
    let e = b.embedding(pe, pos).unwrap();
    assert_eq!(shape(&b, e), [256, 1152]);
    let f = b.input("f", Dtype::F32, &[3]).unwrap();
    let r = reason(b.embedding(table, f).unwrap_err());
    assert!(r.contains("i64 or i32") && r.contains("f32"), "{r}");
}

#[test]
fn shape_ops() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[1, 968, 2048]).unwrap();
    let y = b.reshape(x, &[1, 968, 8, 256]).unwrap();
    let y = b.transpose(y, 1, 2).unwrap();
    assert_eq!(shape(&b, y), [1, 8, 968, 256]);
    assert_eq!(
        b.program().node(y).op,
        Op::Permute {
            perm: vec![0, 2, 1, 3]
        }
    );
    let y = b.permute(y, &[3, 0, 2, 1]).unwrap();
    assert_eq!(shape(&b, y), [256, 1, 968, 8]);
    let r = reason(b.permute(y, &[0, 0, 1, 2]).unwrap_err());
    assert!(r.contains("not a permutation"), "{r}");
    let r = reason(b.reshape(x, &[968, 2047]).unwrap_err());
    assert!(
        r.contains("1982464 elements") && r.contains("1981496"),
        "{r}"
    );

    let u = b.unsqueeze(x, -1).unwrap();
    assert_eq!(shape(&b, u), [1, 968, 2048, 1]);
    let s = b.squeeze(x, 0).unwrap();
    assert_eq!(shape(&b, s), [968, 2048]);
    assert!(b.squeeze(x, 1).is_err());

    let a = b.input("a", Dtype::F32, &[1, 256, 2048]).unwrap();
    let c = b.concat(&[a, a, a, x], 1).unwrap();
    assert_eq!(shape(&b, c), [1, 256 * 3 + 968, 2048]);
    let bad = b.input("bad", Dtype::F32, &[1, 256, 1024]).unwrap();
    let r = reason(b.concat(&[a, bad], 1).unwrap_err());
    assert!(
        r.contains("input 1") && r.contains("except along axis 1"),
        "{r}"
    );

    // Python-style slice: x[:, 10:-8:3] on 968 → start 10, end 960, ceil(950/3) = 317
    let sl = b.slice(x, 1, 10, -8, 3).unwrap();
    assert_eq!(shape(&b, sl), [1, 317, 2048]);
    assert_eq!(
        b.program().node(sl).op,
        Op::Slice {
            axis: 1,
            start: 10,
            end: 960,
            step: 3
        }
    );
    let sl = b.slice(x, -1, 1024, isize::MAX, 1).unwrap();
    assert_eq!(shape(&b, sl), [1, 968, 1024]);
    let sl = b.slice(x, 1, 900, 10, 1).unwrap();
    assert_eq!(shape(&b, sl), [1, 0, 2048]);
    let r = reason(b.slice(x, 1, 0, 10, 0).unwrap_err());
    assert!(r.contains("step >= 1"), "{r}");

    let m = b.input("m", Dtype::Bool, &[1, 968]).unwrap();
    let m = b.unsqueeze(m, 1).unwrap();
    let e = b.expand(m, &[1, 50, 968]).unwrap();
    assert_eq!(shape(&b, e), [1, 50, 968]);
    let e = b.expand(m, &[2, 1, 50, 968]).unwrap();
    assert_eq!(shape(&b, e), [2, 1, 50, 968]);
    let r = reason(b.expand(m, &[1, 50, 967]).unwrap_err());
    assert!(
        r.contains("cannot expand [1, 1, 968] to [1, 50, 967]"),
        "{r}"
    );
    let f = b.full(Dtype::Bool, &[1, 50, 50], 1.0).unwrap();
    assert_eq!(
        b.tensor(f).unwrap(),
        &TensorType::new(Dtype::Bool, &[1, 50, 50])
    );
}

#[test]
fn cast_cumsum_reduce() {
    let mut b = Builder::new();
    let pad = b.input("pad", Dtype::Bool, &[1, 968]).unwrap();
    let r = reason(b.cumsum(pad, -1).unwrap_err());
    assert!(r.contains("cast first"), "{r}");
    let p = b.cast(pad, Dtype::I64).unwrap();
    let c = b.cumsum(p, -1).unwrap();
    assert_eq!(b.program().node(c).op, Op::CumSum { axis: 1 });
    let pos = b.sub_scalar(c, 1.0).unwrap();
    assert_eq!(
        b.tensor(pos).unwrap(),
        &TensorType::new(Dtype::I64, &[1, 968])
    );
    let n = b.sum(p, &[-1], false).unwrap();
    assert_eq!(shape(&b, n), [1]);
    let n = b.sum(p, &[-1], true).unwrap();
    assert_eq!(shape(&b, n), [1, 1]);
    let x = b.input("x", Dtype::F32, &[2, 3, 4]).unwrap();
    let m = b.mean(x, &[2, 0], true).unwrap();
    assert_eq!(shape(&b, m), [1, 3, 1]);
    assert_eq!(
        b.program().node(m).op,
        Op::Reduce {
            kind: petite_graph::ReduceOp::Mean,
            axes: vec![0, 2],
            keepdim: true
        }
    );
    let m = b.max(x, &[1], false).unwrap();
    assert_eq!(shape(&b, m), [2, 4]);
    let r = reason(b.mean(p, &[0], false).unwrap_err());
    assert!(r.contains("float"), "{r}");
    let r = reason(b.sum(x, &[1, -2], false).unwrap_err());
    assert!(r.contains("repeated"), "{r}");
    let h = b.cast(x, Dtype::Bf16).unwrap();
    assert_eq!(
        b.tensor(h).unwrap(),
        &TensorType::new(Dtype::Bf16, &[2, 3, 4])
    );
}

#[test]
fn split_and_getitem() {
    let mut b = Builder::new();
    let d = b.input("dense_out", Dtype::F32, &[1, 3072]).unwrap();
    let parts = b.chunk(d, 3, -1).unwrap();
    assert_eq!(parts.len(), 3);
    for (i, &p) in parts.iter().enumerate() {
        assert_eq!(shape(&b, p), [1, 1024]);
        assert_eq!(b.program().node(p).op, Op::GetItem { index: i });
    }
    let split = b.program().node(parts[0]).inputs[0];
    assert!(b.program().node(split).ty.is_tuple());
    let r = b.split(d, 1, &[1000, 2000]).unwrap_err();
    assert!(reason(r).contains("sum to dim 3072"));
    let parts = b.split(d, 1, &[1, 3070, 1]).unwrap();
    assert_eq!(shape(&b, parts[1]), [1, 3070]);
    let r = reason(b.chunk(d, 5, 1).unwrap_err());
    assert!(r.contains("does not divide"), "{r}");
    // A tuple used directly is refused at build time.
    let e = b.neg(split).unwrap_err();
    assert!(matches!(e, Error::TupleWithoutGetItem { .. }), "{e}");
    let e = b.node(Op::GetItem { index: 3 }, &[split]).unwrap_err();
    assert!(reason(e).contains("index 3 out of range"));
    let e = b.node(Op::GetItem { index: 0 }, &[d]).unwrap_err();
    assert!(reason(e).contains("expected a tuple"));
}

#[test]
fn constants_and_weights() {
    let mut b = Builder::new();
    let inv: Vec<f32> = (0..128)
        .map(|i| 10000f32.powf(-(i as f32) / 128.0))
        .collect();
    let c = b.constant_f32(&[128], &inv).unwrap();
    assert_eq!(b.tensor(c).unwrap(), &TensorType::new(Dtype::F32, &[128]));
    let e = b.constant_f32(&[129], &inv).unwrap_err();
    assert!(reason(e).contains("expected 516 bytes"));
    let h = b
        .constant_from_f64(Dtype::Bf16, &[2], &[1.0, 45.254834])
        .unwrap();
    match &b.program().node(h).op {
        // 45.254834 rounds to 45.25 in bf16 = 0x4235
        Op::Constant { data } => assert_eq!(data, &[0x80, 0x3f, 0x35, 0x42]),
        other => panic!("{other:?}"),
    }
    assert!(b.constant_from_f64(Dtype::I64, &[1], &[0.5]).is_err());
    let e = b.constant(Dtype::Bool, &[1], vec![2]).unwrap_err();
    assert!(reason(e).contains("bool constant"));

    let w1 = b
        .weight("model.x.weight", Dtype::Bf16, &[1024, 2048])
        .unwrap();
    let w2 = b
        .weight("model.x.weight", Dtype::Bf16, &[1024, 2048])
        .unwrap();
    assert_eq!(w1, w2);
    let e = b
        .weight("model.x.weight", Dtype::F32, &[1024, 2048])
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("declared as bf16[1024, 2048] and again as f32[1024, 2048]"),
        "{e}"
    );
    let e = b
        .weight("model.x.weight", Dtype::Bf16, &[2048, 1024])
        .unwrap_err();
    assert!(matches!(e, Error::WeightConflict { .. }));
    assert!(matches!(
        b.input("x", Dtype::F32, &[1])
            .and_then(|_| b.input("x", Dtype::F32, &[1])),
        Err(Error::DuplicateName { kind: "input", .. })
    ));
}

#[test]
fn errors_name_the_node_with_its_label() {
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[1, 4, 2048]).unwrap();
    b.push_scope("language");
    let e = b
        .scoped("layers.3.attn", |b| {
            let w = b.weight("q", Dtype::F32, &[2048, 1024])?;
            b.linear(x, w, None)
        })
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.starts_with("node %2 (linear \"language.layers.3.attn\")"),
        "{msg}"
    );
    assert!(
        msg.contains("expected shape [out, 2048]") && msg.contains("[2048, 1024]"),
        "{msg}"
    );
    assert_eq!(b.scope_path(), "language");
    let w = b.weight("q2", Dtype::F32, &[16, 2048]).unwrap();
    let y = b.linear(x, w, None).unwrap();
    b.label(y, "q_proj").unwrap();
    assert_eq!(
        b.program().node(y).label.as_deref(),
        Some("language.q_proj")
    );
    b.pop_scope();
    b.output("y", y).unwrap();
    let p = b.finish().unwrap();
    assert_eq!(
        p.describe(y).to_string(),
        "node %3 (linear \"language.q_proj\")"
    );
}
