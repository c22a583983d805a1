//! Tests of the module sources: every kernel defined once, balanced braces, op and dtype
//! codes matching the CUDA C.

use super::*;

#[test]
fn the_module_defines_every_kernel_once_and_its_braces_balance() {
    let s = module_source();
    for k in KERNELS {
        let decl = format!(" void {k}(");
        assert_eq!(s.matches(&decl).count(), 1, "{k}");
    }
    // Braces and parentheses balance outside comments.
    let balanced = |src: &str| {
        let code: String = src
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .collect();
        code.matches('{').count() == code.matches('}').count()
            && code.matches('(').count() == code.matches(')').count()
    };
    assert!(balanced(&s));
    assert!(!s.contains("#include"), "NVRTC must need no include path");
    // The attention kernels: a module of their own, on the fused kernels' prelude.
    let a = attention_module_source();
    assert!(a.starts_with(&fused_prelude()));
    for k in ATTENTION_KERNELS {
        assert_eq!(a.matches(&format!(" void {k}(")).count(), 1, "{k}");
        assert!(
            !s.contains(&format!(" void {k}(")),
            "{k} is not in the fixed module"
        );
    }
    assert!(balanced(&a));
}

#[test]
fn op_codes_are_distinct_and_match_the_kernel_switch() {
    use petite_graph::{BinaryOp::*, CompareOp::*, UnaryOp::*};
    let ops = [
        EwOp::Copy,
        EwOp::Binary(Add),
        EwOp::Binary(Sub),
        EwOp::Binary(Mul),
        EwOp::Binary(Div),
        EwOp::Compare(Lt),
        EwOp::Compare(Le),
        EwOp::Compare(Eq),
        EwOp::Compare(Ne),
        EwOp::Compare(Gt),
        EwOp::Compare(Ge),
        EwOp::Logical(LogicalOp::And),
        EwOp::Logical(LogicalOp::Or),
        EwOp::Not,
        EwOp::Unary(Neg),
        EwOp::Unary(Exp),
        EwOp::Unary(Sqrt),
        EwOp::Unary(Rsqrt),
        EwOp::Unary(Sin),
        EwOp::Unary(Cos),
        EwOp::Unary(Tanh),
        EwOp::Unary(GeluTanh),
        EwOp::Unary(Silu),
        EwOp::Where,
    ];
    let mut codes: Vec<i32> = ops.iter().map(|o| o.code()).collect();
    codes.sort();
    codes.dedup();
    assert_eq!(codes.len(), ops.len());
    let s = module_source();
    for o in ops {
        let c = o.code();
        // every arithmetic/unary code has a case; the rest are tested by range in pt_ew
        if (1..=4).contains(&c) || (30..=38).contains(&c) {
            assert!(s.contains(&format!("case {c}:")), "{o:?}");
        }
    }
    // the f32 GELU constant is PyTorch's kBeta = sqrt(2)·(2/sqrt(pi))·0.5
    let k_beta = (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
    let lit: f32 = "0.7978845608028654".parse().unwrap();
    assert!(s.contains("0.7978845608028654f") && lit == k_beta);
}

#[test]
fn dtype_codes_match_the_defines() {
    let s = module_source();
    for (d, name) in [
        (Dtype::F32, "DT_F32"),
        (Dtype::Bf16, "DT_BF16"),
        (Dtype::F16, "DT_F16"),
        (Dtype::I64, "DT_I64"),
        (Dtype::I32, "DT_I32"),
        (Dtype::U8, "DT_U8"),
        (Dtype::Bool, "DT_BOOL"),
    ] {
        assert!(s.contains(&format!("#define {name} {}\n", dtype_code(d))));
    }
}
