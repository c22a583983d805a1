//! Kernels over plain slices and shapes (row-major, contiguous unless strides are given).
//!
//! All math is f32 (reductions accumulate in f64 where PyTorch accumulates in a wider type or
//! a cascade, so results sit at least as close to the exact value). Each kernel's result depends
//! only on its arguments: reduction orders are fixed and independent of thread count. The one
//! exception is asked for by name: [`linear_bf16_any_order`] (bf16 activations × bf16 weights)
//! sums on the CPU's bf16 unit where there is one (AMX-BF16's tiles, or AVX512-BF16's dot products
//! on AMD CPUs), in that unit's order — the same bits run to run on one CPU, not across CPUs.

mod activation;
#[cfg(target_arch = "x86_64")]
mod amx;
mod attention;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod conv;
#[cfg(target_arch = "x86_64")]
mod dpbf16;
mod elementwise;
mod matmul;
mod norm;
mod rope;
mod shape;
mod vmath;

pub use activation::{silu, silu_scalar};
pub use attention::{SdpaShape, sdpa, softmax_lastdim};
pub use conv::{Conv2dParams, conv2d, conv2d_out_hw};
pub use elementwise::{broadcast_shape, broadcast_strides, broadcast_to, map_binary, map_ternary};
pub use matmul::{
    Bf16Unit, DEPTH_CHUNK, MatRef, ORDER_SHAPES, cpu_bf16_unit, depth_chunks, gemm_f32, linear,
    linear_bf16, linear_bf16_any_order, matmul_batched, summation_order_check,
};
pub use norm::{layer_norm, rms_norm};
pub use rope::{rope_cos_sin, rope_inv_freq, rotary_halves};
pub use shape::{
    Reduce, concat, cumsum_f32, cumsum_i64, gather_rows, permute, reduce_f32, slice_axis,
};
pub use vmath::{exp_in_place, exp_scalar, gelu_tanh, gelu_tanh_scalar};

/// Number of elements of a shape (1 for a scalar).
pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Elements above `PAR_MIN` are worth splitting across rayon threads (memory-bound maps).
pub(crate) const PAR_MIN: usize = 1 << 15;
