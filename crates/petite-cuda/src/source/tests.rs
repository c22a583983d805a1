//! Tests of the module sources: every kernel defined once, balanced braces, op and dtype
//! codes matching the CUDA C.

use super::*;
use petite_graph::{Dtype, LogicalOp};

#[test]
fn the_module_defines_every_kernel_once_and_its_braces_balance() {
    let s = module_source();
    for k in KERNELS {
        let decl = format!(" void {k}(");
        assert_eq!(s.matches(&decl).count(), 1, "{k}");
    }
    // And every kernel the module defines is listed (the device loads only the listed ones).
    for def in s.split("__global__ ").skip(1) {
        let after = def.split_once("void ").map_or("", |(_, a)| a);
        let name = after.split('(').next().unwrap_or("");
        assert!(KERNELS.contains(&name), "{name} is not in KERNELS");
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
        (Dtype::I8, "DT_I8"),
        (Dtype::F8E4M3, "DT_F8E4M3"),
    ] {
        assert!(s.contains(&format!("#define {name} {}\n", dtype_code(d))));
    }
}

/// The `#[repr(C)]` blocks mirrored in CUDA C, as [`layout`] lists them.
fn layouts() -> Vec<layout::Layout> {
    vec![
        elementwise::ew_params(),
        rows::norm_params(),
        rows::softmax_params(),
        misc::rope_params(),
        misc::conv_params(),
        misc::ptr_params(),
        tf32_attention::tf_attn_params(),
        attention::attn_params(),
    ]
}

/// Struct `name`'s definition in `src` (its body between the braces) and the text after it.
fn struct_in<'a>(src: &'a str, name: &str) -> (&'a str, &'a str) {
    let at = src
        .find(&format!("struct {name} {{"))
        .unwrap_or_else(|| panic!("struct {name}"));
    let open = at + src[at..].find('{').unwrap() + 1;
    let close = open + src[open..].find("};\n").unwrap();
    (&src[open..close], &src[close + 3..])
}

/// The fields of a CUDA C struct body (`i64 a, b[MAXR]; int c;`) with the offsets and size C
/// gives them (natural alignment), computed here without a compiler.
fn c_layout(body: &str) -> (Vec<(String, usize)>, usize) {
    let (mut at, mut align, mut fields) = (0usize, 1usize, Vec::new());
    for decl in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
        let (ty, names) = decl.split_once(' ').unwrap();
        let size = match ty {
            "i64" | "u64" => 8,
            "int" | "float" => 4,
            other => panic!("type {other}"),
        };
        align = align.max(size);
        for name in names.split(',').map(str::trim) {
            let (name, n) = match name.split_once('[') {
                Some((f, len)) => match len.trim_end_matches(']') {
                    "MAXR" => (f, MAX_RANK),
                    len => (f, len.parse().unwrap()),
                },
                None => (name, 1),
            };
            at = at.next_multiple_of(size);
            fields.push((name.to_string(), at));
            at += size * n;
        }
    }
    (fields, at.next_multiple_of(align))
}

/// The `(field, number)` pairs of the `static_assert`s right after a struct (`sizeof` as
/// field `""`).
fn asserted(after: &str, name: &str) -> Vec<(String, usize)> {
    after
        .lines()
        .map_while(|l| l.strip_prefix("static_assert("))
        .map(|l| {
            let (what, rest) = l.split_once(" == ").unwrap();
            let n: usize = rest.split_once(',').unwrap().0.parse().unwrap();
            let field = match what.strip_prefix(&format!("PT_OFFSETOF({name}, ")) {
                Some(f) => f.trim_end_matches(')').to_string(),
                None => {
                    assert_eq!(what, format!("sizeof({name})"));
                    String::new()
                }
            };
            (field, n)
        })
        .collect()
}

#[test]
fn every_parameter_struct_is_followed_by_checks_of_its_rust_layout() {
    let (module, attn, fused) = (module_source(), attention_module_source(), fused_prelude());
    let mut checked = 0;
    for l in layouts() {
        let src = if l.name == "AttnParams" {
            &attn
        } else {
            &module
        };
        let (body, after) = struct_in(src, l.name);
        // The C struct, laid out by C's rules, is the Rust block, field for field.
        let (c_fields, c_size) = c_layout(body);
        let rust: Vec<(String, usize)> =
            l.fields.iter().map(|(f, o)| (f.to_string(), *o)).collect();
        assert_eq!(c_fields, rust, "{}", l.name);
        assert_eq!(c_size, l.size, "{}", l.name);
        // What the source asserts is that layout: NVRTC checks the struct against it.
        let mut want = vec![(String::new(), l.size)];
        want.extend(rust);
        assert_eq!(asserted(after, l.name), want, "{}", l.name);
        checked += 1;
    }
    assert_eq!(checked, 8);
    // The numbers are Rust's own, a few spelled out (arrays spelled as C fields included).
    use crate::plan::{AttnParams, EwParams, NormParams, TfAttnParams};
    use std::mem::offset_of;
    let find = |src: &str, name: &str, field: &str| {
        let (_, after) = struct_in(src, name);
        asserted(after, name)
            .into_iter()
            .find(|(f, _)| f == field)
            .unwrap()
            .1
    };
    assert_eq!(find(&module, "EwParams", "is"), offset_of!(EwParams, is));
    assert_eq!(find(&module, "EwParams", ""), size_of::<EwParams>());
    assert_eq!(
        find(&fused, "NormParams", "offset"),
        offset_of!(NormParams, offset)
    );
    assert_eq!(
        find(&module, "TfAttnParams", "osq"),
        offset_of!(TfAttnParams, os) + 16
    );
    assert_eq!(
        find(&attn, "AttnParams", "osq"),
        offset_of!(AttnParams, osq)
    );
    // Every parameter struct of every module is checked.
    for src in [&module, &attn, &fused] {
        for (k, _) in src.match_indices("\nstruct ") {
            let name = src[k + 8..].split_once(' ').unwrap().0;
            let (_, after) = struct_in(src, name);
            assert!(
                after.starts_with(&format!("static_assert(sizeof({name})")),
                "{name}"
            );
        }
    }
    assert!(module.contains("#define PT_OFFSETOF(T, m)"));
}
