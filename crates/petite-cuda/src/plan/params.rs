//! The parameter blocks of the norm, softmax, RoPE and im2col kernels, laid out as the CUDA C
//! structs are.

use super::{MAX_RANK, dtype_code};
use super::{broadcast_strides, fill};
use crate::{Error, Result};
use petite_graph::Dtype;

/// `pt_norm`'s parameter block.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NormParams {
    /// Rows.
    pub rows: i64,
    /// Row length.
    pub d: i64,
    /// 0 layer norm, 1 RMS norm.
    pub kind: i32,
    /// A weight is given.
    pub has_w: i32,
    /// A bias is given.
    pub has_b: i32,
    /// Dtype codes: x, weight, bias, output.
    pub dx: i32,
    /// See `dx`.
    pub dw: i32,
    /// See `dx`.
    pub db: i32,
    /// See `dx`.
    pub dout: i32,
    /// Added to the variance / mean square.
    pub eps: f32,
    /// RMS norm: `x·r·(offset + w)` (Gemma's 1).
    pub offset: f32,
}
// SAFETY: as for EwParams.
unsafe impl cudarc::driver::DeviceRepr for NormParams {}

/// `pt_softmax`'s parameter block.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SoftmaxParams {
    /// Rows.
    pub rows: i64,
    /// Row length.
    pub n: i64,
    /// Dtype code of x.
    pub dx: i32,
    /// Dtype code of the output.
    pub dout: i32,
    /// A mask is given.
    pub has_mask: i32,
    /// Dtype code of the mask.
    pub dm: i32,
    /// Multiplies x before the mask is added.
    pub scale: f32,
    /// Dtype code `x·scale` is rounded to before the mask is added (a 16-bit scaling op folded
    /// in); f32 (0): not rounded.
    pub dscale: i32,
    /// Heads (rows are `(b·H + h)·Q + q`).
    pub h: i64,
    /// Queries.
    pub q: i64,
    /// Mask strides along B, H, Q, K (0 where broadcast).
    pub msb: i64,
    /// See `msb`.
    pub msh: i64,
    /// See `msb`.
    pub msq: i64,
    /// See `msb`.
    pub msk: i64,
}
// SAFETY: as for EwParams.
unsafe impl cudarc::driver::DeviceRepr for SoftmaxParams {}

/// `pt_rope`'s parameter block.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RopeParams {
    /// Elements of x.
    pub n: i64,
    /// Last dim of x.
    pub d: i64,
    /// Rank of x.
    pub rank: i32,
    /// Dtype code (x, cos, sin and the output share it).
    pub dt: i32,
    /// x's dims.
    pub dims: [i64; MAX_RANK],
    /// cos's strides broadcast over x.
    pub sc: [i64; MAX_RANK],
    /// sin's strides broadcast over x.
    pub ss: [i64; MAX_RANK],
}
// SAFETY: as for EwParams.
unsafe impl cudarc::driver::DeviceRepr for RopeParams {}

impl RopeParams {
    /// For x of `shape` and cos/sin of their shapes.
    pub fn new(dtype: Dtype, shape: &[usize], cos: &[usize], sin: &[usize]) -> Result<Self> {
        if shape.len() > MAX_RANK || shape.is_empty() {
            return Err(Error::Plan(format!("rope over {shape:?}")));
        }
        let mut p = RopeParams {
            n: shape.iter().product::<usize>() as i64,
            d: *shape.last().unwrap_or(&1) as i64,
            rank: shape.len() as i32,
            dt: dtype_code(dtype),
            dims: [1; MAX_RANK],
            sc: [0; MAX_RANK],
            ss: [0; MAX_RANK],
        };
        let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        fill(&mut p.dims, &dims);
        fill(&mut p.sc, &broadcast_strides(cos, shape)?);
        fill(&mut p.ss, &broadcast_strides(sin, shape)?);
        Ok(p)
    }
}

/// `pt_im2col`'s parameter block.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ConvParams {
    /// Batch.
    pub n: i64,
    /// Channels.
    pub c: i64,
    /// Height.
    pub h: i64,
    /// Width.
    pub w: i64,
    /// Kernel height.
    pub kh: i64,
    /// Kernel width.
    pub kw: i64,
    /// Output height.
    pub oh: i64,
    /// Output width.
    pub ow: i64,
    /// Stride (h).
    pub sh: i64,
    /// Stride (w).
    pub sw: i64,
    /// Padding (h).
    pub ph: i64,
    /// Padding (w).
    pub pw: i64,
    /// Dtype code of x (and the columns).
    pub dt: i32,
}
// SAFETY: as for EwParams.
unsafe impl cudarc::driver::DeviceRepr for ConvParams {}
