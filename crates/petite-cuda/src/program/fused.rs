//! Launches of the fusion plan's generated kernels: fused groups (with their prologue norms)
//! and sibling linears run as one GEMM.

use petite_graph::{Dtype, NodeId, Op};

use super::{DeviceProgram, Slot, err};
use crate::Result;
use crate::device::{DevTensor, Device};
#[cfg(doc)]
use crate::fuse::Fusion;
use crate::plan::{Gemm, NormParams};
use crate::source::dtype_code;

impl<'d> DeviceProgram<'d> {
    /// Sibling group `g`'s linears as one strided-batched GEMM over their side-by-side
    /// weights (the shared input read at batch stride 0), then each part's bias as
    /// [`DeviceProgram::linear`] adds it; returns each linear's output, a part of one buffer.
    pub(super) fn run_siblings(&self, g: usize, slots: &[Slot]) -> Result<Vec<DevTensor>> {
        let dev = self.dev;
        let sg = &self.siblings[g];
        let first = self.program.node(sg.linears[0]);
        let x = match &slots[first.inputs[0].index()] {
            Slot::T(t) => t,
            _ => return Err(err("sibling input is not available")),
        };
        let out_ty = first.tensor().ok_or_else(|| err("tuple linear"))?;
        let (wm, bm) = &self.merged[g];
        let (parts, n, k) = (wm.shape()[0], wm.shape()[1], wm.shape()[2]);
        let rows = x.numel() / k.max(1);
        let dt = out_ty.dtype;
        let mut all = vec![parts];
        all.extend_from_slice(&out_ty.shape);
        let out = dev.alloc(dt, &all)?;
        let per = rows * n;
        let gm = Gemm::linear(rows, k, n)?.batched(parts, (n * k) as i64, 0, per as i64)?;
        let acc = if dt == Dtype::F32 || bm.is_none() {
            out.clone()
        } else {
            dev.alloc(Dtype::F32, &all)?
        };
        if k == 0 {
            dev.memset_zero(&acc)?;
        } else {
            dev.gemm(
                &gm,
                dev.ptr(wm),
                dev.ptr(x),
                x.dtype(),
                dev.ptr(&acc),
                acc.dtype(),
                self.f32_matmul,
            )?;
        }
        let views: Vec<DevTensor> = (0..parts)
            .map(|i| out.view(i * per * dt.size(), &out_ty.shape))
            .collect();
        if let Some(b) = bm {
            for (i, o) in views.iter().enumerate() {
                let a = acc.view(i * per * acc.dtype().size(), &out_ty.shape);
                let bi = b.view(i * n * b.dtype().size(), &[n]);
                self.bias(&a, Some(&bi), rows, n, o)?;
            }
        }
        Ok(views)
    }

    /// One launch of fused group `g`'s kernel, writing root `id`'s value.
    pub(super) fn run_fused(&self, g: usize, id: NodeId, slots: &[Slot]) -> Result<Slot> {
        let group = &self.fusion.groups[g];
        let t = self
            .program
            .node(id)
            .tensor()
            .ok_or_else(|| err("fused tuple"))?;
        let dev = self.dev;
        let mut ptrs: Vec<u64> = Vec::with_capacity(group.leaves.len() + 1);
        for &l in &group.leaves {
            match &slots[l.index()] {
                Slot::T(x) => ptrs.push(dev.ptr(x)),
                _ => return Err(err(format!("fused input {l} is not available"))),
            }
        }
        let out = dev.alloc(t.dtype, &t.shape)?;
        let n = out.numel() as i64;
        if n == 0 || group.absorbed {
            // An absorbed group's value is written by the launch of the group it is first in.
            return Ok(Slot::T(out));
        }
        ptrs.push(dev.ptr(&out));
        // The group computed first, or beside, by this launch: its leaves and output.
        let mut beside_n = None;
        if let Some(f) = group.first.or(group.with) {
            let other = &self.fusion.groups[f];
            for &l in other.leaves.iter().chain([&other.root]) {
                match &slots[l.index()] {
                    Slot::T(x) => ptrs.push(dev.ptr(x)),
                    _ => return Err(err(format!("fused input {l} is not available"))),
                }
            }
            if group.with.is_some() {
                let t = self
                    .program
                    .node(other.root)
                    .tensor()
                    .ok_or_else(|| err("fused tuple"))?;
                beside_n = Some((t.numel() as i64, group.leaves.len() + 1));
            }
        }
        let f = &self.fused[group
            .kernel
            .ok_or_else(|| err("an absorbed group launched"))?];
        // Slice starts after every pointer: the group's own, then its first's or beside's.
        let offsets = self.fusion.launch_offsets(g);
        let Some(norm) = group.prologue else {
            let cfg = cudarc::driver::LaunchConfig {
                grid_dim: (group.blocks, 1, 1),
                block_dim: (crate::plan::BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            return dev
                .launch_fn(f, cfg, |b| {
                    b.arg(&n);
                    for (j, p) in ptrs.iter().enumerate() {
                        // The beside group's `qn` precedes its pointers.
                        if let Some((qn, at)) = &beside_n
                            && j == *at
                        {
                            b.arg(qn);
                        }
                        Device::push_u64(b, p);
                    }
                    for o in offsets {
                        b.arg(o);
                    }
                })
                .map(|()| Slot::T(out));
        };
        // One block a row of the prologue norm, its parameters and operands first.
        let (prm, nptrs) = self.norm_args(norm, slots, t.dtype)?;
        dev.launch_fn(f, Device::cfg_rows(prm.rows as usize)?, |b| {
            b.arg(&prm);
            for p in &nptrs {
                Device::push_u64(b, p);
            }
            b.arg(&n);
            for p in &ptrs {
                Device::push_u64(b, p);
            }
            for o in offsets {
                b.arg(o);
            }
        })?;
        Ok(Slot::T(out))
    }

    /// Operand `j` of node `id` as it is read: the buffer (a view's base where the fusion plan
    /// reads the operand in place, [`Fusion::views`]) and that view.
    pub(super) fn in_place<'s>(
        &'s self,
        id: NodeId,
        j: usize,
        slots: &'s [Slot],
    ) -> Result<(&'s DevTensor, Option<&'s crate::fuse::StridedView>)> {
        let view = self.fusion.views.get(&(id, j));
        let v = crate::fuse::read_from(&self.program, &self.fusion.views, id, j);
        match &slots[v.index()] {
            Slot::T(t) => Ok((t, view)),
            _ => Err(err(format!("input {j} ({v}) is not available"))),
        }
    }

    /// `pt_norm`'s parameters and `[x, weight, bias]` pointers (0 where absent) for norm node
    /// `id` over its operands (x possibly read through a widening cast's input), writing `dout`.
    pub(super) fn norm_args(
        &self,
        id: NodeId,
        slots: &[Slot],
        dout: Dtype,
    ) -> Result<(NormParams, [u64; 3])> {
        let node = self.program.node(id);
        let (kind, eps) = match node.op {
            Op::LayerNorm { eps } => (0, eps),
            Op::RmsNorm { eps } => (1, eps),
            _ => return Err(err("not a norm")),
        };
        let mut ins: [Option<&DevTensor>; 3] = [None; 3];
        for (j, i) in ins.iter_mut().enumerate().take(node.inputs.len()) {
            *i = Some(self.in_place(id, j, slots)?.0);
        }
        let x = ins[0].ok_or_else(|| err("norm without input"))?;
        let (w, b) = (ins[1], ins[2]);
        let d = *x.shape().last().unwrap_or(&1);
        let prm = NormParams {
            rows: (x.numel() / d.max(1)) as i64,
            d: d as i64,
            kind,
            has_w: i32::from(w.is_some()),
            has_b: i32::from(b.is_some()),
            dx: dtype_code(x.dtype()),
            dw: w.map_or(0, |t| dtype_code(t.dtype())),
            db: b.map_or(0, |t| dtype_code(t.dtype())),
            dout: dtype_code(dout),
            eps: eps as f32,
            offset: 1.0,
        };
        let dev = self.dev;
        let ptr = |t: Option<&DevTensor>| t.map_or(0, |t| dev.ptr(t));
        Ok((prm, [dev.ptr(x), ptr(w), ptr(b)]))
    }
}
