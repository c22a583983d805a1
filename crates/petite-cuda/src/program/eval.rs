//! One node's evaluation: the launch its role in the fusion plan and its op call for.

use petite_graph::{NodeId, Op, TensorType, ValueType};

use super::{DeviceProgram, Slot, err};
use crate::device::{DevTensor, Device};
use crate::fuse::Role;
use crate::plan::{EwParams, Operand, RopeParams, contiguous_strides};
use crate::source::{EwOp, dtype_code};
use crate::{Error, Result};

impl<'d> DeviceProgram<'d> {
    pub(super) fn node_err(&self, id: NodeId, e: Error) -> Error {
        match e {
            Error::Node { .. } => e,
            other => Error::Node {
                node: self.program.describe(id),
                message: other.to_string(),
            },
        }
    }

    pub(super) fn check_type(&self, id: NodeId, out: &Slot) -> Result<()> {
        let want = &self.program.node(id).ty;
        let ok = match out {
            Slot::T(t) => want.admits_tensor(t.dtype(), t.shape()),
            Slot::Tuple(ts) => want.admits_tuple(ts.iter().map(|t| (t.dtype(), t.shape()))),
            _ => false,
        };
        if ok {
            Ok(())
        } else {
            Err(Error::Node {
                node: self.program.describe(id),
                message: format!("produced a value that is not the declared {want}"),
            })
        }
    }

    pub(super) fn eval(
        &self,
        id: NodeId,
        slots: &[Slot],
        gather_err: Option<&DevTensor>,
    ) -> Result<Slot> {
        let p = &self.program;
        let node = p.node(id);
        let input = |i: usize| -> Result<&DevTensor> {
            let v = node.inputs[i];
            match &slots[v.index()] {
                Slot::T(t) => Ok(t),
                _ => Err(err(format!("input {i} ({v}) is not an available tensor"))),
            }
        };
        let out_ty: &TensorType = match &node.ty {
            ValueType::Tensor(t) => t,
            ValueType::Tuple(_) => {
                if let Op::Split { axis, sizes } = &node.op {
                    return self.split(input(0)?, *axis, sizes);
                }
                return Err(err("tuple result"));
            }
        };
        match node.op {
            Op::MatMul => return Ok(Slot::T(self.matmul(id, slots, out_ty, None)?)),
            Op::Attention { scale } => {
                return Ok(Slot::T(self.attention(
                    id,
                    scale as f32,
                    slots,
                    out_ty,
                    None,
                )?));
            }
            _ => {}
        }
        // A head-merging permute runs the product it permutes, which writes its layout.
        if let Op::Permute { .. } = node.op
            && self.fusion.role[node.inputs[0].index()] == Role::Transposed
        {
            let m = node.inputs[0];
            let m_ty = p
                .node(m)
                .tensor()
                .ok_or_else(|| err("a transposed tuple"))?;
            return Ok(Slot::T(match p.node(m).op {
                Op::MatMul => self.matmul(m, slots, m_ty, Some(out_ty))?,
                Op::Attention { scale } => {
                    self.attention(m, scale as f32, slots, m_ty, Some(out_ty))?
                }
                _ => return Err(err("a transposed node that is not a matmul or attention")),
            }));
        }
        // Operand `i` of node `c`; one read in place (a widening cast's input) is the view's base.
        let operand = |c: NodeId, i: usize| self.in_place(c, i, slots).map(|(t, _)| t);
        if let Op::Cast { .. } = node.op
            && self.fusion.role[node.inputs[0].index()] == Role::Narrowed
        {
            let sm = node.inputs[0];
            let Op::Softmax { axis } = p.node(sm).op else {
                return Err(err("a narrowed node that is not a softmax"));
            };
            return Ok(Slot::T(self.softmax_node(
                sm,
                axis,
                operand(sm, 0)?,
                slots,
                out_ty,
            )?));
        }
        // A linear reading a quantized weight's codes itself ([`Role::WeightOnly`]).
        if let Op::Linear = node.op
            && let Some(&wv) = node.inputs.get(1)
            && self.fusion.role[wv.index()] == Role::WeightOnly
        {
            let dq = p.node(wv);
            let source = |j: usize| match dq.inputs.get(j).map(|v| &slots[v.index()]) {
                Some(Slot::T(t)) => Ok(t),
                _ => Err(err(format!(
                    "the weight's dequantize input {j} is not available"
                ))),
            };
            let b = match self.fusion.biases.contains_key(&id) {
                true => None,
                false if node.inputs.len() > 2 => Some(operand(id, 2)?),
                false => None,
            };
            return Ok(Slot::T(self.linear_wq(
                operand(id, 0)?,
                source(0)?,
                source(1)?,
                b,
                out_ty,
            )?));
        }
        let dev = self.dev;
        let n_in = node.inputs.len();
        let ins: Vec<&DevTensor> = (0..n_in)
            .map(|i| operand(id, i))
            .collect::<Result<_>>()
            .or_else(|e| {
                if let Op::GetItem { .. } = node.op {
                    Ok(Vec::new())
                } else {
                    Err(e)
                }
            })?;
        let out_shape = &out_ty.shape;
        let dt = out_ty.dtype;
        Ok(Slot::T(match &node.op {
            Op::Input { .. } | Op::Weight { .. } | Op::Constant { .. } => {
                return Err(err("sources are bound before the run"));
            }
            Op::Linear => {
                // A bias the fused group reading this linear adds is not added here.
                let b = match self.fusion.biases.contains_key(&id) {
                    true => None,
                    false => ins.get(2).copied(),
                };
                self.linear(ins[0], ins[1], b, out_ty)?
            }
            Op::MatMul => return Err(err("matmul is evaluated above")),
            Op::Conv2d { stride, padding } => self.conv2d(
                ins[0],
                ins[1],
                ins.get(2).copied(),
                *stride,
                *padding,
                out_ty,
            )?,
            Op::LayerNorm { .. } | Op::RmsNorm { .. } => self.norm(id, slots, out_ty)?,
            Op::Softmax { axis } => self.softmax_node(id, *axis, ins[0], slots, out_ty)?,
            Op::Rope => {
                let (x, c, s) = (ins[0], ins[1], ins[2]);
                let out = dev.alloc(dt, out_shape)?;
                let prm = RopeParams::new(dt, x.shape(), c.shape(), s.shape())?;
                let (px, pc, ps, po) = (dev.ptr(x), dev.ptr(c), dev.ptr(s), dev.ptr(&out));
                dev.launch("pt_rope", Device::cfg_elems(x.numel()), |b| {
                    b.arg(&prm);
                    Device::push_u64(b, &px);
                    Device::push_u64(b, &pc);
                    Device::push_u64(b, &ps);
                    Device::push_u64(b, &po);
                })?;
                out
            }
            Op::Attention { .. } => return Err(err("attention is evaluated above")),
            Op::Embedding => {
                let (table, idx) = (ins[0], ins[1]);
                let out = dev.alloc(dt, out_shape)?;
                let nidx = idx.numel() as i64;
                let v = table.shape()[0] as i64;
                let rowbytes = (table.shape()[1] * table.dtype().size()) as i64;
                let di = dtype_code(idx.dtype());
                let e = gather_err.ok_or_else(|| err("no gather error flag"))?;
                let (pi, pt, po, pe) = (dev.ptr(idx), dev.ptr(table), dev.ptr(&out), dev.ptr(e));
                dev.launch("pt_gather", Device::cfg_elems(out.bytes()), |b| {
                    b.arg(&nidx).arg(&v).arg(&rowbytes).arg(&di);
                    Device::push_u64(b, &pi);
                    Device::push_u64(b, &pt);
                    Device::push_u64(b, &po);
                    Device::push_u64(b, &pe);
                })?;
                out
            }
            Op::Binary { kind } => self.ew(EwOp::Binary(*kind), &ins, out_ty, None)?,
            Op::BinaryScalar {
                kind,
                scalar,
                scalar_lhs,
            } => self.ew(
                EwOp::Binary(*kind),
                &ins,
                out_ty,
                Some((*scalar, *scalar_lhs, ins[0].dtype())),
            )?,
            Op::Compare { kind } => self.ew(EwOp::Compare(*kind), &ins, out_ty, None)?,
            Op::Logical { kind } => self.ew(EwOp::Logical(*kind), &ins, out_ty, None)?,
            Op::Not => self.ew(EwOp::Not, &ins, out_ty, None)?,
            Op::Unary { kind } => self.ew(EwOp::Unary(*kind), &ins, out_ty, None)?,
            Op::Cast { .. } | Op::Expand { .. } => self.ew(EwOp::Copy, &ins, out_ty, None)?,
            Op::Where => self.ew(EwOp::Where, &ins, out_ty, None)?,
            Op::Dequantize { .. } => self.dequantize(ins[0], ins[1], out_ty)?,
            Op::CumSum { axis } => {
                let x = ins[0];
                let s = x.shape();
                let outer: usize = s[..*axis].iter().product();
                let inner: usize = s[*axis + 1..].iter().product();
                let n = s[*axis];
                let out = dev.alloc(dt, out_shape)?;
                let (o, nn, ii, d) = (outer as i64, n as i64, inner as i64, dtype_code(dt));
                let (px, po) = (dev.ptr(x), dev.ptr(&out));
                // Integers: a block a line (exact in any order); floats: a thread a line, in
                // order (f64 running sum).
                let (name, cfg, lines) = if dt.is_float() {
                    ("pt_cumsum", Device::cfg_elems(outer * inner), o)
                } else {
                    ("pt_cumsum_i", Device::cfg_rows(outer * inner)?, o * ii)
                };
                if outer * inner > 0 {
                    dev.launch(name, cfg, |b| {
                        b.arg(&lines).arg(&nn).arg(&ii).arg(&d);
                        Device::push_u64(b, &px);
                        Device::push_u64(b, &po);
                    })?;
                }
                out
            }
            Op::Reduce { kind, axes, .. } => self.reduce(ins[0], *kind, axes, out_ty)?,
            Op::Concat { axis } => {
                let out = dev.alloc(dt, out_shape)?;
                let ost = contiguous_strides(out_shape);
                let mut start = 0usize;
                for x in &ins {
                    let o = Operand {
                        dtype: dt,
                        strides: ost.clone(),
                        offset: start as i64 * ost[*axis],
                    };
                    let i = Operand::broadcast(x.dtype(), x.shape(), x.shape())?;
                    self.ew_launch(EwParams::new(EwOp::Copy, x.shape(), &[i], &o)?, &[x], &out)?;
                    start += x.shape()[*axis];
                }
                out
            }
            Op::Slice {
                axis,
                start,
                end: _,
                step,
            } => self.slice(ins[0], *axis, *start, *step, out_shape)?,
            Op::Reshape { shape } => ins[0].reshaped(shape),
            Op::Permute { .. } if crate::fuse::moves_only_unit_dims(p, id) => {
                ins[0].reshaped(out_shape)
            }
            Op::Permute { perm } => {
                let x = ins[0];
                let xs = contiguous_strides(x.shape());
                let i = Operand {
                    dtype: x.dtype(),
                    strides: perm.iter().map(|&d| xs[d]).collect(),
                    offset: 0,
                };
                let out = dev.alloc(dt, out_shape)?;
                let o = Operand::broadcast(dt, out_shape, out_shape)?;
                self.ew_launch(EwParams::new(EwOp::Copy, out_shape, &[i], &o)?, &[x], &out)?;
                out
            }
            Op::Split { .. } => return Err(err("split yields a tuple")),
            Op::GetItem { index } => {
                let v = node.inputs[0];
                match &slots[v.index()] {
                    Slot::Tuple(ts) => ts
                        .get(*index)
                        .cloned()
                        .ok_or_else(|| err(format!("tuple has no element {index}")))?,
                    _ => return Err(err("getitem input is not a tuple")),
                }
            }
        }))
    }
}
