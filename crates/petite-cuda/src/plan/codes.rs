//! The codes the kernels and their parameter blocks share with the host: dtype codes (`DT_*` in
//! the CUDA C), `pt_ew`'s op codes and the most dims a launch indexes. They live with the
//! parameter blocks that carry them; [`crate::source`] writes the same numbers into the CUDA C
//! (its tests check the `#define`s against these).

use petite_graph::{BinaryOp, CompareOp, Dtype, LogicalOp, UnaryOp};

/// Most dims a strided launch indexes (pi0.5's programs use at most 5).
pub const MAX_RANK: usize = 8;

/// The dtype code kernels use (`DT_*` in the source).
pub fn dtype_code(d: Dtype) -> i32 {
    match d {
        Dtype::F32 => 0,
        Dtype::Bf16 => 1,
        Dtype::F16 => 2,
        Dtype::I64 => 3,
        Dtype::I32 => 4,
        Dtype::U8 => 5,
        Dtype::Bool => 6,
        Dtype::I8 => 7,
        Dtype::F8E4M3 => 8,
    }
}

/// What `pt_ew` computes per element (its `op` parameter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EwOp {
    /// `out = a` converted to the output dtype (copies, casts, layout moves).
    Copy,
    /// `a (op) b`, or with a scalar in place of `b` (or of `a`).
    Binary(BinaryOp),
    /// `a (cmp) b` → bool.
    Compare(CompareOp),
    /// `a && b`, `a || b` on bools.
    Logical(LogicalOp),
    /// `!a`.
    Not,
    /// `f(a)`.
    Unary(UnaryOp),
    /// `a ? b : c`.
    Where,
}

impl EwOp {
    /// The op code of the kernel's switch.
    pub fn code(self) -> i32 {
        match self {
            EwOp::Copy => 0,
            EwOp::Binary(k) => match k {
                BinaryOp::Add => 1,
                BinaryOp::Sub => 2,
                BinaryOp::Mul => 3,
                BinaryOp::Div => 4,
            },
            EwOp::Compare(k) => match k {
                CompareOp::Lt => 10,
                CompareOp::Le => 11,
                CompareOp::Eq => 12,
                CompareOp::Ne => 13,
                CompareOp::Gt => 14,
                CompareOp::Ge => 15,
            },
            EwOp::Logical(LogicalOp::And) => 20,
            EwOp::Logical(LogicalOp::Or) => 21,
            EwOp::Not => 22,
            EwOp::Unary(k) => match k {
                UnaryOp::Neg => 30,
                UnaryOp::Exp => 31,
                UnaryOp::Sqrt => 32,
                UnaryOp::Rsqrt => 33,
                UnaryOp::Sin => 34,
                UnaryOp::Cos => 35,
                UnaryOp::Tanh => 36,
                UnaryOp::GeluTanh => 37,
                UnaryOp::Silu => 38,
            },
            EwOp::Where => 40,
        }
    }
}
