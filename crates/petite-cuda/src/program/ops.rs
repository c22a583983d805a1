//! Launches of the fixed module's kernels: elementwise and strided copies, slices and splits,
//! norms, softmaxes and reductions.

use petite_graph::{Dtype, NodeId, ReduceOp, TensorType};

use super::attention::mask_strides;
use super::{DeviceProgram, Slot, err};
use crate::Result;
use crate::device::{DevTensor, Device};
#[cfg(doc)]
use crate::fuse::Fusion;
use crate::plan::{EwParams, Operand, SoftmaxParams, contiguous_strides};
use crate::source::{EwOp, dtype_code};

impl<'d> DeviceProgram<'d> {
    pub(super) fn ew_launch(&self, p: EwParams, ins: &[&DevTensor], out: &DevTensor) -> Result<()> {
        if p.n == 0 {
            return Ok(());
        }
        let dev = self.dev;
        let ptrs: Vec<u64> = ins.iter().map(|t| dev.ptr(t)).collect();
        let pa = ptrs[0];
        let pb = ptrs.get(1).copied().unwrap_or(0);
        let pc = ptrs.get(2).copied().unwrap_or(0);
        let po = dev.ptr(out);
        dev.launch("pt_ew", Device::cfg_elems(p.n as usize), |b| {
            b.arg(&p);
            Device::push_u64(b, &pa);
            Device::push_u64(b, &pb);
            Device::push_u64(b, &pc);
            Device::push_u64(b, &po);
        })
    }

    /// An elementwise op with numpy broadcasting of every input to the output's shape.
    pub(super) fn ew(
        &self,
        op: EwOp,
        ins: &[&DevTensor],
        out_ty: &TensorType,
        scalar: Option<(f64, bool, Dtype)>,
    ) -> Result<DevTensor> {
        let shape = &out_ty.shape;
        let ops = ins
            .iter()
            .map(|t| Operand::broadcast(t.dtype(), t.shape(), shape))
            .collect::<Result<Vec<_>>>()?;
        let out = self.dev.alloc(out_ty.dtype, shape)?;
        let o = Operand::broadcast(out_ty.dtype, shape, shape)?;
        let mut p = EwParams::new(op, shape, &ops, &o)?;
        if let Some((s, lhs, d)) = scalar {
            p = p.with_scalar(s, lhs, d);
        }
        self.ew_launch(p, ins, &out)?;
        Ok(out)
    }

    /// Copies `x` to a new dense tensor of `dtype`: `dims` with element strides `strides` from
    /// offset `offset` of x.
    pub(super) fn strided_copy(
        &self,
        x: &DevTensor,
        dims: &[usize],
        strides: Vec<i64>,
        offset: i64,
        dtype: Dtype,
    ) -> Result<DevTensor> {
        let out = self.dev.alloc(dtype, dims)?;
        let i = Operand {
            dtype: x.dtype(),
            strides,
            offset,
        };
        let o = Operand::broadcast(dtype, dims, dims)?;
        self.ew_launch(EwParams::new(EwOp::Copy, dims, &[i], &o)?, &[x], &out)?;
        Ok(out)
    }

    pub(super) fn slice(
        &self,
        x: &DevTensor,
        axis: usize,
        start: usize,
        step: usize,
        out_shape: &[usize],
    ) -> Result<DevTensor> {
        let mut st = contiguous_strides(x.shape());
        let off = start as i64 * st[axis];
        st[axis] *= step as i64;
        self.strided_copy(x, out_shape, st, off, x.dtype())
    }

    pub(super) fn split(&self, x: &DevTensor, axis: usize, sizes: &[usize]) -> Result<Slot> {
        let mut pieces = Vec::with_capacity(sizes.len());
        let mut start = 0;
        for &len in sizes {
            let mut s = x.shape().to_vec();
            s[axis] = len;
            pieces.push(self.slice(x, axis, start, 1, &s)?);
            start += len;
        }
        Ok(Slot::Tuple(pieces))
    }

    pub(super) fn norm(
        &self,
        id: NodeId,
        slots: &[Slot],
        out_ty: &TensorType,
    ) -> Result<DevTensor> {
        let dev = self.dev;
        let (prm, [px, pw, pb]) = self.norm_args(id, slots, out_ty.dtype)?;
        let out = dev.alloc(out_ty.dtype, &out_ty.shape)?;
        if prm.rows == 0 || prm.d == 0 {
            return Ok(out);
        }
        let po = dev.ptr(&out);
        dev.launch("pt_norm", Device::cfg_rows(prm.rows as usize)?, |bl| {
            bl.arg(&prm);
            Device::push_u64(bl, &px);
            Device::push_u64(bl, &pw);
            Device::push_u64(bl, &pb);
            Device::push_u64(bl, &po);
        })?;
        Ok(out)
    }

    pub(super) fn softmax_rows(
        &self,
        x: &DevTensor,
        out: &DevTensor,
        rows: usize,
        n: usize,
        scale: (f32, Dtype),
        mask: Option<(&DevTensor, [i64; 6])>,
    ) -> Result<()> {
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let dev = self.dev;
        let ms = mask.map_or([1, 1, 0, 0, 0, 0], |m| m.1);
        let prm = SoftmaxParams {
            rows: rows as i64,
            n: n as i64,
            dx: dtype_code(x.dtype()),
            dout: dtype_code(out.dtype()),
            has_mask: i32::from(mask.is_some()),
            dm: mask.map_or(0, |m| dtype_code(m.0.dtype())),
            scale: scale.0,
            dscale: dtype_code(scale.1),
            h: ms[0],
            q: ms[1],
            msb: ms[2],
            msh: ms[3],
            msq: ms[4],
            msk: ms[5],
        };
        let (px, pm, po) = (dev.ptr(x), mask.map_or(0, |m| dev.ptr(m.0)), dev.ptr(out));
        dev.launch("pt_softmax", Device::cfg_rows(rows)?, |bl| {
            bl.arg(&prm);
            Device::push_u64(bl, &px);
            Device::push_u64(bl, &pm);
            Device::push_u64(bl, &po);
        })
    }

    /// Softmax node `sm` of `x`, with the mask the fusion plan folded into it, if any
    /// ([`Fusion::masks`]: rank 4, last axis).
    pub(super) fn softmax_node(
        &self,
        sm: NodeId,
        axis: usize,
        x: &DevTensor,
        slots: &[Slot],
        out_ty: &TensorType,
    ) -> Result<DevTensor> {
        let Some(f) = self.fusion.masks.get(&sm) else {
            return self.softmax(x, axis, out_ty);
        };
        let Slot::T(mt) = &slots[f.mask.index()] else {
            return Err(err(format!("mask {} is not an available tensor", f.mask)));
        };
        let s = x.shape();
        let out = self.dev.alloc(out_ty.dtype, &out_ty.shape)?;
        let strides = mask_strides(mt.shape(), s[1], s[2]);
        let scale = f.scale.unwrap_or((1.0, Dtype::F32));
        self.softmax_rows(
            x,
            &out,
            s[0] * s[1] * s[2],
            s[3],
            scale,
            Some((mt, strides)),
        )?;
        Ok(out)
    }

    fn softmax(&self, x: &DevTensor, axis: usize, out_ty: &TensorType) -> Result<DevTensor> {
        let s = x.shape();
        let r = s.len();
        if axis + 1 == r {
            let out = self.dev.alloc(out_ty.dtype, &out_ty.shape)?;
            let n = s[r - 1];
            self.softmax_rows(x, &out, x.numel() / n.max(1), n, (1.0, Dtype::F32), None)?;
            return Ok(out);
        }
        // Move the axis last, softmax, move it back.
        let mut perm: Vec<usize> = (0..r).filter(|&d| d != axis).collect();
        perm.push(axis);
        let xs = contiguous_strides(s);
        let pdims: Vec<usize> = perm.iter().map(|&d| s[d]).collect();
        let moved = self.strided_copy(
            x,
            &pdims,
            perm.iter().map(|&d| xs[d]).collect(),
            0,
            x.dtype(),
        )?;
        let n = s[axis];
        self.softmax_rows(
            &moved,
            &moved,
            moved.numel() / n.max(1),
            n,
            (1.0, Dtype::F32),
            None,
        )?;
        let mut inv = vec![0; r];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        let ms = contiguous_strides(&pdims);
        self.strided_copy(
            &moved,
            s,
            inv.iter().map(|&i| ms[i]).collect(),
            0,
            out_ty.dtype,
        )
    }

    /// Reduction over `axes`: those axes moved last (a copy unless they already are), then one
    /// block a row.
    pub(super) fn reduce(
        &self,
        x: &DevTensor,
        kind: ReduceOp,
        axes: &[usize],
        out_ty: &TensorType,
    ) -> Result<DevTensor> {
        let s = x.shape();
        let r = s.len();
        let mut perm: Vec<usize> = (0..r).filter(|d| !axes.contains(d)).collect();
        perm.extend_from_slice(axes);
        let n: usize = axes.iter().map(|&a| s[a]).product();
        let rows: usize = perm[..r - axes.len()].iter().map(|&d| s[d]).product();
        if n == 0 && kind == ReduceOp::Max {
            return Err(err("max over an empty axis"));
        }
        let moved = if perm.iter().enumerate().all(|(i, &p)| i == p) {
            x.clone()
        } else {
            let xs = contiguous_strides(s);
            let pdims: Vec<usize> = perm.iter().map(|&d| s[d]).collect();
            self.strided_copy(
                x,
                &pdims,
                perm.iter().map(|&d| xs[d]).collect(),
                0,
                x.dtype(),
            )?
        };
        let out = self.dev.alloc(out_ty.dtype, &out_ty.shape)?;
        if rows == 0 {
            return Ok(out);
        }
        let kind = match kind {
            ReduceOp::Sum => 0i32,
            ReduceOp::Mean => 1,
            ReduceOp::Max => 2,
        };
        let (rr, nn, d) = (rows as i64, n as i64, dtype_code(x.dtype()));
        let dev = self.dev;
        let (px, po) = (dev.ptr(&moved), dev.ptr(&out));
        dev.launch("pt_reduce", Device::cfg_rows(rows)?, |bl| {
            bl.arg(&rr).arg(&nn).arg(&kind).arg(&d);
            Device::push_u64(bl, &px);
            Device::push_u64(bl, &po);
        })?;
        Ok(out)
    }
}
