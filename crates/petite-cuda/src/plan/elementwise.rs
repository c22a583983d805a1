//! `pt_ew`'s parameter block ([`EwParams`]): an op over strided operands ([`Operand`]).

use super::{EwOp, MAX_RANK, dtype_code};
use super::{broadcast_strides, contiguous_strides, fill};
use crate::{Error, Result};
use petite_graph::Dtype;

/// `pt_ew`'s parameter block (mirrors `struct EwParams` field for field).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EwParams {
    /// Elements of the iteration space.
    pub n: i64,
    /// Dims of the iteration space.
    pub rank: i32,
    /// [`EwOp::code`].
    pub op: i32,
    /// 0: compute in f32; 1: in wrapping i64.
    pub cls: i32,
    /// 1 when every operand is dense in the iteration order (no index math).
    pub contig: i32,
    /// Dtype code of `a`.
    pub da: i32,
    /// Dtype code of `b`.
    pub db: i32,
    /// Dtype code of `c`.
    pub dc: i32,
    /// Dtype code of the output.
    pub dout: i32,
    /// 1: `b` is the scalar `fs`/`is`.
    pub scalar: i32,
    /// 1: the scalar is the left operand.
    pub scalar_lhs: i32,
    /// The scalar for float math (already rounded to the operand's dtype).
    pub fs: f32,
    /// The scalar for integer math.
    pub is: i64,
    /// Iteration dims.
    pub dims: [i64; MAX_RANK],
    /// Element strides of `a`, `b`, `c` and the output.
    pub sa: [i64; MAX_RANK],
    /// See `sa`.
    pub sb: [i64; MAX_RANK],
    /// See `sa`.
    pub sc: [i64; MAX_RANK],
    /// See `sa`.
    pub so: [i64; MAX_RANK],
    /// Element offsets of `a`, `b`, `c` and the output.
    pub oa: i64,
    /// See `oa`.
    pub ob: i64,
    /// See `oa`.
    pub oc: i64,
    /// See `oa`.
    pub oo: i64,
}

// SAFETY: plain old data, laid out as the kernel's struct (repr(C), same field order and types).
unsafe impl cudarc::driver::DeviceRepr for EwParams {}

/// One strided operand of an elementwise launch: its dtype, strides over the iteration space
/// and element offset.
#[derive(Debug, Clone)]
pub struct Operand {
    /// Dtype.
    pub dtype: Dtype,
    /// Element strides, one per iteration dim.
    pub strides: Vec<i64>,
    /// Element offset of the first element.
    pub offset: i64,
}

impl Operand {
    /// A contiguous tensor of `shape` broadcast over the iteration space `dims`.
    pub fn broadcast(dtype: Dtype, shape: &[usize], dims: &[usize]) -> Result<Self> {
        Ok(Operand {
            dtype,
            strides: broadcast_strides(shape, dims)?,
            offset: 0,
        })
    }
}

impl EwParams {
    /// Parameters of `op` over iteration space `dims`: operands (one to three) and the output.
    pub fn new(op: EwOp, dims: &[usize], ins: &[Operand], out: &Operand) -> Result<Self> {
        if dims.len() > MAX_RANK {
            return Err(Error::Plan(format!(
                "{} dims; kernels index at most {MAX_RANK}",
                dims.len()
            )));
        }
        if ins.is_empty() || ins.len() > 3 {
            return Err(Error::Plan(format!("{} operands (1 to 3)", ins.len())));
        }
        let dense = contiguous_strides(dims);
        let is_dense = |o: &Operand| {
            o.offset == 0
                && o.strides.len() == dims.len()
                && o.strides
                    .iter()
                    .zip(&dense)
                    .zip(dims)
                    .all(|((s, d), &n)| n == 1 || s == d)
        };
        let contig = ins.iter().all(is_dense) && is_dense(out);
        let cls = match op {
            EwOp::Where => i32::from(!ins[1].dtype.is_float()),
            _ => i32::from(!ins[0].dtype.is_float()),
        };
        let mut p = EwParams {
            n: dims.iter().product::<usize>() as i64,
            rank: dims.len() as i32,
            op: op.code(),
            cls,
            contig: i32::from(contig),
            da: dtype_code(ins[0].dtype),
            db: ins.get(1).map_or(0, |o| dtype_code(o.dtype)),
            dc: ins.get(2).map_or(0, |o| dtype_code(o.dtype)),
            dout: dtype_code(out.dtype),
            scalar: 0,
            scalar_lhs: 0,
            fs: 0.0,
            is: 0,
            dims: [1; MAX_RANK],
            sa: [0; MAX_RANK],
            sb: [0; MAX_RANK],
            sc: [0; MAX_RANK],
            so: [0; MAX_RANK],
            oa: ins[0].offset,
            ob: ins.get(1).map_or(0, |o| o.offset),
            oc: ins.get(2).map_or(0, |o| o.offset),
            oo: out.offset,
        };
        let dims_i: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        fill(&mut p.dims, &dims_i);
        for (k, o) in ins.iter().chain(std::iter::once(out)).enumerate() {
            if o.strides.len() != dims.len() {
                return Err(Error::Plan(format!(
                    "operand {k}: {} strides for {} dims",
                    o.strides.len(),
                    dims.len()
                )));
            }
        }
        fill(&mut p.sa, &ins[0].strides);
        if let Some(o) = ins.get(1) {
            fill(&mut p.sb, &o.strides);
        }
        if let Some(o) = ins.get(2) {
            fill(&mut p.sc, &o.strides);
        }
        fill(&mut p.so, &out.strides);
        Ok(p)
    }

    /// With a scalar operand `s` (`x op s`, or `s op x` when `lhs`), converted as the op's
    /// docs say: for bf16/f16 operands rounded to that dtype first.
    pub fn with_scalar(mut self, s: f64, lhs: bool, dtype: Dtype) -> Self {
        self.scalar = 1;
        self.scalar_lhs = i32::from(lhs);
        self.fs = match dtype {
            Dtype::Bf16 => petite_dtype::round_through_bf16(s as f32),
            Dtype::F16 => half::f16::from_f32(s as f32).to_f32(),
            _ => s as f32,
        };
        self.is = s as i64;
        self
    }
}
