//! The CUDA C source of petite-cuda's kernels, compiled by NVRTC at first use (once per process).
//!
//! One module holds every kernel. Kernels take dtype and op codes as run-time parameters (the
//! branch is uniform across a launch, so it costs next to nothing) instead of one instantiation
//! per node: a program needs one NVRTC compile, not one per op signature. Every float op loads
//! its operands as f32 (bf16/f16 widened exactly), computes in f32 (reductions in f64, as the
//! reference executor does) and rounds once to the output dtype (round-to-nearest-even). No
//! header is included: bf16 and f16 conversions are written out, so NVRTC needs no include path
//! (a Jetson's or a pip-installed libnvrtc works as well as a toolkit's).
//!
//! By concept: this file assembles the modules ([`module_source`], [`fused_prelude`],
//! [`attention_module_source`]) and holds the codes the kernels share with the host; the
//! CUDA C text lies by kernel family: `prelude` (types, dtype loads and stores, launch
//! dependencies, `cp.async`), `elementwise` (`pt_ew` and its per-op arithmetic), `rows`
//! (norms and softmax), `misc` (RoPE, gather, cumsum, reductions, im2col, GEMM pointer arrays,
//! bias), `tf32_attention` (`pt_attn_tf32`) and `attention` (the fused bf16 attention);
//! `layout` checks, in the CUDA C, that each parameter struct there lays out as its
//! `#[repr(C)]` block in [`crate::plan`] (`static_assert`s from `offset_of!`).

use petite_graph::{BinaryOp, CompareOp, Dtype, LogicalOp, UnaryOp};

mod attention;
mod elementwise;
mod layout;
mod misc;
mod prelude;
mod rows;
#[cfg(test)]
mod tests;
mod tf32_attention;

use elementwise::{EW, EW_FUNCS, EW_STRUCT, ew_params};
use prelude::{CP_ASYNC, PRELUDE};
use rows::{norm_funcs, rows};

/// Most dims a strided launch indexes (pi0.5's programs use at most 5).
pub const MAX_RANK: usize = 8;

/// Kernel entry points of the module, as [`module_source`] defines them.
pub const KERNELS: &[&str] = &[
    "pt_ew",
    "pt_norm",
    "pt_softmax",
    "pt_rope",
    "pt_gather",
    "pt_cumsum",
    "pt_cumsum_i",
    "pt_reduce",
    "pt_im2col",
    "pt_bias",
    "pt_ptrs",
    "pt_attn_tf32",
];

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

/// What generated (fused) kernels build on: the dtype loads and stores, `pt_ew`'s per-op
/// arithmetic and `pt_norm`'s formula, so a fused kernel computes each op exactly as `pt_ew`
/// (and a prologue norm as `pt_norm`) does.
pub fn fused_prelude() -> String {
    let mut s = String::with_capacity(8 << 10);
    s.push_str(PRELUDE);
    s.push_str(CP_ASYNC);
    s.push_str(EW_FUNCS);
    s.push_str(&norm_funcs());
    s
}

/// The whole module's CUDA C source. `MAX_RANK` is baked in; the parameter structs mirror
/// [`crate::plan::EwParams`] and friends field for field.
pub fn module_source() -> String {
    let mut s = String::with_capacity(16 << 10);
    s.push_str(&format!("#define MAXR {MAX_RANK}\n"));
    s.push_str(PRELUDE);
    s.push_str(CP_ASYNC);
    s.push_str(EW_STRUCT);
    s.push_str(&ew_params().checks());
    s.push_str(EW_FUNCS);
    s.push_str(EW);
    s.push_str(&norm_funcs());
    s.push_str(&rows());
    s.push_str(&misc::text());
    s.push_str(&tf32_attention::text());
    s
}

/// The fused attention kernels' source ([`crate::fuse::Attend`]; entry points
/// [`ATTENTION_KERNELS`]), after [`fused_prelude`]: a module of its own, compiled only where a
/// program fuses an attention (beside the weights' upload; programs without one pay nothing
/// for it), and once a process however many programs do.
pub fn attention_module_source() -> String {
    let mut s = fused_prelude();
    s.push_str(&attention::text());
    s
}

/// Entry points of [`attention_module_source`].
pub const ATTENTION_KERNELS: [&str; 3] = ["pt_attn_logits", "pt_attn_pv", "pt_attn_cl"];
