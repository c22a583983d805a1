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
//! [`attention_module_source`]) and re-exports the codes the kernels share with the host (they
//! live with the parameter blocks, `plan::codes`); the
//! CUDA C text lies by kernel family: `prelude` (types, dtype loads and stores, launch
//! dependencies, `cp.async`), `elementwise` (`pt_ew` and its per-op arithmetic), `rows`
//! (norms and softmax), `misc` (RoPE, gather, cumsum, reductions, im2col, GEMM pointer arrays,
//! bias), `tf32_attention` (`pt_attn_tf32`) and `attention` (the fused bf16 attention);
//! `layout` checks, in the CUDA C, that each parameter struct there lays out as its
//! `#[repr(C)]` block in [`crate::plan`] (`static_assert`s from `offset_of!`).

pub use crate::plan::{EwOp, MAX_RANK, dtype_code};

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
    "pt_dequant",
    "pt_wq_gemm",
    "pt_wq_sum",
    "pt_ptrs",
    "pt_attn_tf32",
];

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
