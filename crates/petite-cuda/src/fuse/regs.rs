//! Register values as the generator writes them in C: a value's register type, the
//! conversions `ldf`/`ldi` make, the rounding a store then a load would give, exact float
//! literals and index types. Why apart from `codegen`: these say how a dtype lives in a
//! register, whatever the op; the generator only chooses which to apply.

use petite_graph::Dtype;

use super::ir::{Expr, cat};

/// C type of a value held in registers: floats as `float` (already rounded to their dtype),
/// integers and bools as `i64` (the stored value).
pub(super) fn is_f(d: Dtype) -> bool {
    d.is_float()
}

/// The prelude's macro for dtype `d`'s code (`DT_BF16`).
pub(super) fn dt_macro(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "DT_F32",
        Dtype::Bf16 => "DT_BF16",
        Dtype::F16 => "DT_F16",
        Dtype::I64 => "DT_I64",
        Dtype::I32 => "DT_I32",
        Dtype::U8 => "DT_U8",
        Dtype::Bool => "DT_BOOL",
        Dtype::I8 | Dtype::F8E4M3 => unreachable!("{}", crate::plan::CODES_UNFUSED),
    }
}

/// `ldf` of a register value of dtype `d`.
pub(super) fn as_f(v: &Expr, d: Dtype) -> Expr {
    if is_f(d) {
        v.clone()
    } else {
        cat!["((float)", v, ")"]
    }
}

/// `ldi` of a register value of dtype `d`.
pub(super) fn as_i(v: &Expr, d: Dtype) -> Expr {
    if is_f(d) {
        cat!["((i64)", v, ")"]
    } else {
        v.clone()
    }
}

/// `x` between the text `open` and `close`.
pub(super) fn wrap(open: &str, x: Expr, close: &str) -> Expr {
    cat![open, x, close]
}

/// The register value `stf(out, d, x)` then `ldf`/`ldi` would give.
pub(super) fn store_f(x: Expr, d: Dtype) -> Expr {
    match d {
        Dtype::F32 => wrap("(", x, ")"),
        Dtype::Bf16 => wrap("bf2f(f2bf(", x, "))"),
        Dtype::F16 => wrap("h2f(f2h(", x, "))"),
        Dtype::I64 => wrap("((i64)(", x, "))"),
        Dtype::I32 => wrap("((i64)(int)(i64)(", x, "))"),
        Dtype::U8 => wrap("((i64)(unsigned char)(i64)(", x, "))"),
        Dtype::Bool => wrap("(((", x, ") != 0.0f) ? 1LL : 0LL)"),
        Dtype::I8 | Dtype::F8E4M3 => unreachable!("{}", crate::plan::CODES_UNFUSED),
    }
}

/// The register value `sti(out, d, x)` then `ldf`/`ldi` would give.
pub(super) fn store_i(x: Expr, d: Dtype) -> Expr {
    match d {
        Dtype::F32 => wrap("((float)(", x, "))"),
        Dtype::Bf16 => wrap("bf2f(f2bf((float)(", x, ")))"),
        Dtype::F16 => wrap("h2f(f2h((float)(", x, ")))"),
        Dtype::I64 => wrap("(", x, ")"),
        Dtype::I32 => wrap("((i64)(int)(", x, "))"),
        Dtype::U8 => wrap("((i64)(unsigned char)(", x, "))"),
        Dtype::Bool => wrap("(((", x, ") != 0) ? 1LL : 0LL)"),
        Dtype::I8 | Dtype::F8E4M3 => unreachable!("{}", crate::plan::CODES_UNFUSED),
    }
}

/// The C type and literal suffix for index arithmetic over a value of `numel` elements: 32-bit
/// below 2³¹ elements, else 64-bit.
pub(super) fn index_type(numel: usize) -> (&'static str, &'static str) {
    if numel < (1 << 31) {
        ("unsigned", "u")
    } else {
        ("i64", "LL")
    }
}

/// An f32 literal with these exact bits.
pub(super) fn f32_lit(x: f32) -> String {
    format!("__uint_as_float({:#010x}u)", x.to_bits())
}

/// Coordinates of an input broadcast (numpy, right-aligned) to coordinates `c` of the output.
pub(super) fn broadcast(c: &[Expr], in_shape: &[usize]) -> Vec<Expr> {
    let off = c.len() - in_shape.len();
    in_shape
        .iter()
        .enumerate()
        .map(|(j, &s)| {
            if s == 1 {
                "0".into()
            } else {
                c[j + off].clone()
            }
        })
        .collect()
}
