//! Attentions: the fused bf16 chain run whole by its `p·v` product ([`crate::fuse::Attend`]),
//! the attention op by cuBLAS GEMMs a head, by the TF32 kernel, or by the attention kernels.

use petite_graph::{Dtype, NodeId, TensorType};

use super::{DeviceProgram, Slot, err};
use crate::Result;
use crate::device::{DevTensor, Device, F32Matmul};
#[cfg(doc)]
use crate::fuse::{Fusion, Role};
#[cfg(doc)]
use crate::plan::SoftmaxParams;
use crate::plan::{
    Gemm, HeadLayout, attention_gemms, attention_gemms_per_head, contiguous_strides,
};

/// The `(batch, head, query)` element strides of an attention result of type `out_ty`
/// (`[B, H, Q, Dv]`) as written dense or, with `into` (the head-merging permute's type),
/// straight into `[B, Q, H, Dv]`: heads Dv apart, queries H·Dv apart.
fn head_strides(out_ty: &TensorType, into: Option<&TensorType>) -> [i64; 3] {
    match into {
        Some(t) => {
            let ts = contiguous_strides(&t.shape);
            [ts[0], ts[2], ts[1]]
        }
        None => {
            let os = contiguous_strides(&out_ty.shape);
            [os[0], os[1], os[2]]
        }
    }
}

/// [`SoftmaxParams`]' mask fields for rows `((b·H + h)·Q + q)` of `[B, H, Q, K]` logits and a
/// mask of shape `ms` (rank ≤ 4, broadcast over its size-1 dims): `[H, Q, sb, sh, sq, sk]`.
pub(super) fn mask_strides(ms: &[usize], h: usize, nq: usize) -> [i64; 6] {
    let mut dims = [1usize; 4];
    dims[4 - ms.len()..].copy_from_slice(ms);
    let [mb, mh, mq, mk] = dims;
    let sk = i64::from(mk != 1);
    let sq = if mq == 1 { 0 } else { mk as i64 };
    let sh = if mh == 1 { 0 } else { (mq * mk) as i64 };
    let sb = if mb == 1 { 0 } else { (mh * mq * mk) as i64 };
    [h as i64, nq as i64, sb, sh, sq, sk]
}

impl<'d> DeviceProgram<'d> {
    /// The bf16 attention `a` (run by its `p·v` matmul, [`crate::fuse::Attend`]): q, k and v read
    /// through the views the plan found ([`crate::fuse::Attend::q`]), the output written as
    /// `out_ty` or, with `into`, heads merged (`[B, Q, H, Dv]`).
    pub(super) fn attend(
        &self,
        a: &crate::fuse::Attend,
        slots: &[Slot],
        out_ty: &TensorType,
        into: Option<&TensorType>,
    ) -> Result<DevTensor> {
        let dev = self.dev;
        let tensor = |n: NodeId| match &slots[n.index()] {
            Slot::T(t) => Ok(t),
            _ => Err(err(format!(
                "attention operand {n} is not an available tensor"
            ))),
        };
        // K and v from their two pieces (their views' layouts are the concats'), or whole.
        let [pk, pk1, pv, pv1] = match a.pieces {
            Some((kv, _)) => [
                dev.ptr(tensor(kv[0])?),
                dev.ptr(tensor(kv[1])?),
                dev.ptr(tensor(kv[2])?),
                dev.ptr(tensor(kv[3])?),
            ],
            None => {
                let (k, v) = (dev.ptr(tensor(a.k.base)?), dev.ptr(tensor(a.v.base)?));
                [k, k, v, v]
            }
        };
        let (q, k, v) = (&a.q, &a.k, &a.v);
        let mask = tensor(a.mask)?;
        let (h, nq) = (q.shape[1], q.shape[2]);
        let out = dev.alloc(out_ty.dtype, &into.unwrap_or(out_ty).shape)?;
        let o = head_strides(out_ty, into);
        let l = crate::plan::attention_launch(
            crate::plan::AttnShape {
                q: (&q.shape, &q.strides),
                k: (&k.shape, &k.strides),
                v: (&v.shape, &v.strides),
                mask: mask_strides(mask.shape(), h, nq),
                scale: a.scale,
                out: o,
                n0: a.pieces.map(|(_, n)| n),
            },
            self.dev.info().compute_capability,
        )?;
        let prm = &l.params;
        let (pq, pm) = (dev.ptr(tensor(q.base)?), dev.ptr(mask));
        if [pq, pk, pk1, pv, pv1].iter().any(|p| p % 16 != 0) {
            return Err(err("fused attention: q, k or v not 16-byte aligned"));
        }
        if out_ty.dtype != Dtype::Bf16 {
            return Err(err("fused attention: a bf16 result only"));
        }
        let [fl, fp, fc] = self
            .fusion
            .attention_kernels
            .map(|k| k.map(|i| &self.fused[i]))
            .ok_or_else(|| err("fused attention: its kernels were not compiled"))?;
        // Where the device grants the cluster kernel's shared memory (consumer GPUs give a
        // block less than an H200's 227 KiB): else the two launches.
        let shared = dev.info().max_shared_per_block;
        if let Some(cfg) = l
            .cluster
            .filter(|c| self.attention_cluster && c.shared_mem_bytes <= shared)
        {
            let po = dev.ptr(&out);
            dev.launch_cluster_fn(fc, cfg, Some(crate::plan::ATTN_CLUSTER), |bl| {
                bl.arg(prm);
                for p in [&pq, &pk, &pk1, &pv, &pv1, &pm, &po] {
                    Device::push_u64(bl, p);
                }
            })?;
            return Ok(out);
        }
        let scratch = dev.alloc(Dtype::F32, &[l.rows, prm.nk as usize])?;
        let stats = dev.alloc(Dtype::F32, &[l.rows, prm.splits as usize, 2])?;
        // Partial products of the key blocks (none with one block), and a counter a tile.
        let parts = if prm.splits2 > 1 {
            l.tiles * prm.splits2 as usize * 16 * prm.dv as usize
        } else {
            0
        };
        let part = dev.alloc(Dtype::F32, &[parts])?;
        let counters = dev.alloc(Dtype::I32, &[l.tiles])?;
        let (pl, ps, po) = (dev.ptr(&scratch), dev.ptr(&stats), dev.ptr(&out));
        let (pp, pc) = (dev.ptr(&part), dev.ptr(&counters));
        dev.launch_fn(fl, l.logits, |bl| {
            bl.arg(prm);
            for p in [&pq, &pk, &pk1, &pm, &pl, &ps, &pc] {
                Device::push_u64(bl, p);
            }
        })?;
        dev.launch_fn(fp, l.pv, |bl| {
            bl.arg(prm);
            for p in [&pl, &ps, &pv, &pv1, &pp, &pc, &po] {
                Device::push_u64(bl, p);
            }
        })?;
        Ok(out)
    }

    /// `softmax(q·kᵀ·scale + mask)·v` in f32: logits by one cuBLAS GEMM (f32 out), the scaled,
    /// masked softmax in place, v widened to f32, the second GEMM in f32. q, k and v are read
    /// where they lie (heads split out of a projection through [`Fusion::views`]) when one head
    /// a batch reaches them ([`attention_gemms_per_head`]), else made dense first. With `into`
    /// ([`Role::Transposed`]) the result is written as `[1, Q, H, Dv]`.
    pub(super) fn attention(
        &self,
        id: NodeId,
        scale: f32,
        slots: &[Slot],
        out_ty: &TensorType,
        into: Option<&TensorType>,
    ) -> Result<DevTensor> {
        let node = self.program.node(id);
        // Each operand: its buffer, shape and element strides.
        let mut ops: Vec<(&DevTensor, Vec<usize>, Vec<i64>)> = Vec::with_capacity(4);
        for j in 0..node.inputs.len() {
            let (t, view) = self.in_place(id, j, slots)?;
            ops.push(match view {
                Some(w) => (t, w.shape.clone(), w.strides.clone()),
                None => (t, t.shape().to_vec(), contiguous_strides(t.shape())),
            });
        }
        let (b, h, nq, d) = (ops[0].1[0], ops[0].1[1], ops[0].1[2], ops[0].1[3]);
        let (kvh, nk) = (ops[1].1[1], ops[1].1[2]);
        let dv = ops[2].1[3];
        let dims = [b, h, nq, nk];
        let mask = ops.get(3).map(|(t, ..)| *t);
        if mask.is_none()
            && self.tf32_attention
            && self.f32_matmul == F32Matmul::Tf32
            && out_ty.dtype == Dtype::F32
            && ops[..3]
                .iter()
                .all(|o| o.0.dtype() == Dtype::F32 && o.2.len() == 4 && o.2[3] == 1)
            && let Some(out) =
                self.tf32_attention_run(&ops, [b, h, kvh, nq, nk, d, dv], scale, out_ty, into)?
        {
            return Ok(out);
        }
        let is_dense = |(t, s, st): &(&DevTensor, Vec<usize>, Vec<i64>)| {
            t.shape() == s.as_slice() && *st == contiguous_strides(s)
        };
        let dense = ops[..3].iter().all(is_dense);
        let dense_layout = |rows: usize, cols: usize| HeadLayout {
            ld: cols as i64,
            head: (rows * cols) as i64,
        };
        // The f32 PV product is the result when the result is f32: written merged (`into`) or
        // dense. A 16-bit result is converted (and moved) from a dense f32 product.
        let direct = out_ty.dtype == Dtype::F32;
        let lo = match into {
            Some(_) if direct => HeadLayout {
                ld: (h * dv) as i64,
                head: dv as i64,
            },
            _ => dense_layout(nq, dv),
        };
        let layout = |st: &[i64]| HeadLayout {
            ld: st[2],
            head: st[1],
        };
        // v's GEMM reads f32: a 16-bit v is widened into a dense copy first.
        let v16 = ops[2].0.dtype() != Dtype::F32;
        let per_head = if !dense || into.is_some() {
            let lv = if v16 {
                dense_layout(nk, dv)
            } else {
                layout(&ops[2].2)
            };
            attention_gemms_per_head(
                h,
                kvh,
                nq,
                nk,
                d,
                dv,
                [layout(&ops[0].2), layout(&ops[1].2), lv, lo],
            )?
        } else {
            None
        };
        let merged = into.is_some() && direct;
        let (q, k, v, gemms, batches) = match per_head {
            Some(g) => {
                let v = if v16 {
                    self.strided_copy(ops[2].0, &ops[2].1, ops[2].2.clone(), 0, Dtype::F32)?
                } else {
                    ops[2].0.clone()
                };
                // One head a GEMM batch, the B batches one after another.
                let vb = if v16 {
                    (kvh * nk * dv) as i64
                } else {
                    ops[2].2[0]
                };
                // A batch's output is H·Q·Dv elements, heads merged or not.
                let ob = (h * nq * dv) as i64;
                let batches = (b, [ops[0].2[0], ops[1].2[0], vb, ob]);
                (ops[0].0.clone(), ops[1].0.clone(), v, g, batches)
            }
            None => {
                // Dense operands, the `H / KVH` query heads of a KV head as one block.
                let dense_of = |o: &(&DevTensor, Vec<usize>, Vec<i64>)| -> Result<DevTensor> {
                    if is_dense(o) {
                        Ok(o.0.clone())
                    } else {
                        self.strided_copy(o.0, &o.1, o.2.clone(), 0, o.0.dtype())
                    }
                };
                let g = attention_gemms(b, h, kvh, nq, nk, d, dv)?;
                (
                    dense_of(&ops[0])?,
                    dense_of(&ops[1])?,
                    dense_of(&ops[2])?,
                    g,
                    (1, [0; 4]),
                )
            }
        };
        let merged = merged && per_head.is_some();
        let shape = if merged {
            into.map_or(&out_ty.shape, |t| &t.shape)
        } else {
            &out_ty.shape
        };
        let out32 = self.attention_run(&q, &k, &v, dims, gemms, batches, mask, scale, shape)?;
        if direct && (merged || into.is_none()) {
            return Ok(out32);
        }
        let os = contiguous_strides(&out_ty.shape);
        let (to, st) = match into {
            Some(t) => (t, vec![os[0], os[2], os[1], os[3]]),
            None => (out_ty, os),
        };
        self.strided_copy(&out32, &to.shape, st, 0, to.dtype)
    }

    /// `pt_attn_tf32` over f32 operands (their buffers, shapes and strides) where it applies,
    /// writing the f32 result in the `[B, H, Q, Dv]` layout or, with `into`, the heads merged
    /// (`[B, Q, H, Dv]`); `None` where it does not apply.
    fn tf32_attention_run(
        &self,
        ops: &[(&DevTensor, Vec<usize>, Vec<i64>)],
        dims: [usize; 7],
        scale: f32,
        out_ty: &TensorType,
        into: Option<&TensorType>,
    ) -> Result<Option<DevTensor>> {
        let st = |j: usize| [ops[j].2[0], ops[j].2[1], ops[j].2[2]];
        let Some((prm, cfg)) = crate::plan::tf32_attention_launch(
            dims,
            st(0),
            st(1),
            st(2),
            head_strides(out_ty, into),
            scale,
            self.dev.info().max_shared_per_block as usize,
        ) else {
            return Ok(None);
        };
        let dev = self.dev;
        let [pq, pk, pv] = [0, 1, 2].map(|j| dev.ptr(ops[j].0));
        // q, K and v are staged 16 bytes a copy.
        if [pq, pk, pv].iter().any(|p| p % 16 != 0) {
            return Ok(None);
        }
        let out = dev.alloc(Dtype::F32, &into.unwrap_or(out_ty).shape)?;
        let po = dev.ptr(&out);
        let f = dev.func("pt_attn_tf32")?;
        dev.launch_cluster_fn(f, cfg, None, |bl| {
            bl.arg(&prm);
            for p in [&pq, &pk, &pv, &po] {
                Device::push_u64(bl, p);
            }
        })?;
        Ok(Some(out))
    }

    /// Attention's GEMMs and softmax over `dims` `[B, H, Q, K]`: f32 logits from q and k, the
    /// scaled, masked softmax in place, then the PV GEMM (v widened to f32 when it is not) into
    /// a new f32 tensor of `out_shape` (laid out as `gpv` writes it). `(n, [q, k, v, out])`:
    /// the GEMMs run `n` times, stepping each operand by its element stride (the logits are
    /// dense): `n` is 1 where the GEMMs batch over B themselves.
    #[allow(clippy::too_many_arguments)]
    fn attention_run(
        &self,
        q: &DevTensor,
        k: &DevTensor,
        v: &DevTensor,
        [b, h, nq, nk]: [usize; 4],
        (gl, gpv): (Gemm, Gemm),
        (loops, [sq, sk, sv, so]): (usize, [i64; 4]),
        mask: Option<&DevTensor>,
        scale: f32,
        out_shape: &[usize],
    ) -> Result<DevTensor> {
        let dev = self.dev;
        let logits = dev.alloc(Dtype::F32, &[b, h, nq, nk])?;
        // Logits elements a run (the logits are dense).
        let per_run = (b / loops.max(1) * h * nq * nk) as i64;
        if gl.k == 0 {
            dev.memset_zero(&logits)?;
        } else {
            dev.gemm_loops(
                &gl,
                [dev.ptr(k), dev.ptr(q), dev.ptr(&logits)],
                q.dtype(),
                Dtype::F32,
                self.f32_matmul,
                loops,
                [sk, sq, per_run],
            )?;
        }
        let m = mask.map(|mt| (mt, mask_strides(mt.shape(), h, nq)));
        self.softmax_rows(&logits, &logits, b * h * nq, nk, (scale, Dtype::F32), m)?;
        let v32 = if v.dtype() == Dtype::F32 {
            v.clone()
        } else {
            self.strided_copy(v, v.shape(), contiguous_strides(v.shape()), 0, Dtype::F32)?
        };
        let out32 = dev.alloc(Dtype::F32, out_shape)?;
        if nk == 0 {
            dev.memset_zero(&out32)?;
        } else {
            dev.gemm_loops(
                &gpv,
                [dev.ptr(&v32), dev.ptr(&logits), dev.ptr(&out32)],
                Dtype::F32,
                Dtype::F32,
                self.f32_matmul,
                loops,
                [sv, per_run, so],
            )?;
        }
        Ok(out32)
    }
}
