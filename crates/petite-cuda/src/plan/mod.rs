//! Launch planning: the parameter blocks the kernels read, strides, grid sizes and the GEMM
//! shapes of linear layers, batched matmuls and attention. Pure host code, so it is tested
//! where there is no GPU.
//!
//! By concept: grids and strides here; `elementwise` (`pt_ew`'s parameter block), `params`
//! (the norm, softmax, RoPE and im2col blocks), `gemm` (cuBLAS GEMM shapes, pointer arrays,
//! FLOP counts) and `attention` (the attention kernels' launches).

use crate::{Error, Result};

mod attention;
mod codes;
mod elementwise;
mod gemm;
mod params;

pub use codes::{EwOp, MAX_RANK, dtype_code};
#[cfg(test)]
mod tests;

pub use attention::{
    ATTN_CLUSTER, AttnLaunch, AttnParams, AttnShape, TF32_ATTN_MAX_DIM, TF32_ATTN_MAX_KEYS,
    TfAttnParams, attention_cluster, attention_cluster_keys, attention_dims_fit, attention_launch,
    attention_strides_fit, tf32_attention_launch,
};
pub use elementwise::{EwParams, Operand};
pub use gemm::{
    Gemm, HeadLayout, MatOperand, PtrParams, WQ_BLOCKS, WqGrid, attention_gemms,
    attention_gemms_per_head, matmul_gemm, program_flops, program_flops_by_dtype, wq_grid,
};
pub use params::{ConvParams, NormParams, RopeParams, SoftmaxParams};

/// Threads a block for every kernel (a multiple of 32: the block reductions assume whole warps).
pub const BLOCK: u32 = 256;

/// Why no fused kernel sees a quantized weight's codes (`i8`, `f8e4m3`, issue 51): validation
/// lets only [`petite_graph::Op::Dequantize`] read them, and the planner never fuses it
/// (`pt_dequant` runs it on its own).
pub(crate) const CODES_UNFUSED: &str =
    "quantized weight codes are read only by dequantize (validation), which is never fused";

/// Blocks of a grid-stride launch over `n` elements: enough to fill an H200 many times over,
/// never more than the grid's x limit.
pub fn grid_for(n: usize) -> u32 {
    let want = n.div_ceil(BLOCK as usize).max(1);
    want.min(132 * 64) as u32
}

/// Row-major strides (in elements) of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<i64> {
    let mut st = vec![0i64; shape.len()];
    let mut acc = 1i64;
    for d in (0..shape.len()).rev() {
        st[d] = acc;
        acc *= shape[d] as i64;
    }
    st
}

/// Strides that read a contiguous tensor of shape `shape` broadcast to `out` (numpy rules,
/// right-aligned; 0 along broadcast dims).
pub fn broadcast_strides(shape: &[usize], out: &[usize]) -> Result<Vec<i64>> {
    if shape.len() > out.len() {
        return Err(Error::Plan(format!(
            "cannot broadcast {shape:?} to {out:?}: more dims"
        )));
    }
    let own = contiguous_strides(shape);
    let lead = out.len() - shape.len();
    let mut st = vec![0i64; out.len()];
    for (d, &n) in shape.iter().enumerate() {
        let o = out[lead + d];
        if n == o {
            st[lead + d] = if n == 1 { 0 } else { own[d] };
        } else if n != 1 {
            return Err(Error::Plan(format!(
                "cannot broadcast {shape:?} to {out:?} (dim {d})"
            )));
        }
    }
    Ok(st)
}

fn fill(dst: &mut [i64; MAX_RANK], src: &[i64]) {
    dst[..src.len()].copy_from_slice(src);
}
