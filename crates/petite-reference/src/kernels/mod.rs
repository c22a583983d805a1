//! Kernels over plain slices and shapes (row-major, contiguous unless strides are given).
//!
//! All math is f32 (reductions accumulate in f64 where PyTorch accumulates in a wider type or
//! a cascade, so results sit at least as close to the exact value). Each kernel's result depends
//! only on its arguments: reduction orders are fixed and independent of thread count. The one
//! exception is asked for by name: [`linear_bf16_any_order`] (bf16 activations × bf16 weights)
//! sums on the CPU's bf16 unit where there is one (AMX-BF16's tiles, or AVX512-BF16's dot products
//! on AMD CPUs), in that unit's order — the same bits run to run on one CPU, not across CPUs.

/// Stores (`store`) or adds a register tile's `R × 32` sums (`acc0` lanes 0..16, `acc1` lanes
/// 16..32 of each row) into the output at `d` (row stride `d_rs`), lanes outside `m0` / `m1`
/// untouched. A macro, not a function, so the accumulators stay in registers (a shared
/// `#[target_feature]` function was not inlined, and the bf16 tile ran 2.4× slower). The caller
/// is an `unsafe` AVX-512F context where `d + r·d_rs + lane` is readable and writable for
/// `r < R` and every set lane.
#[cfg(target_arch = "x86_64")]
macro_rules! write_tile {
    ($acc0:expr, $acc1:expr, $r:expr, $d:expr, $d_rs:expr, $m0:expr, $m1:expr, $store:expr) => {
        for r in 0..$r {
            let d = $d.add(r * $d_rs);
            if $store {
                _mm512_mask_storeu_ps(d, $m0, $acc0[r]);
                _mm512_mask_storeu_ps(d.add(16), $m1, $acc1[r]);
            } else {
                let o0 = _mm512_maskz_loadu_ps($m0, d);
                let o1 = _mm512_maskz_loadu_ps($m1, d.add(16));
                _mm512_mask_storeu_ps(d, $m0, _mm512_add_ps(o0, $acc0[r]));
                _mm512_mask_storeu_ps(d.add(16), $m1, _mm512_add_ps(o1, $acc1[r]));
            }
        }
    };
}

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
