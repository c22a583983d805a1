//! The products cuBLAS runs: linears (and their bias pass), matmuls read through views, the
//! patch convolution; and the dequantization of a quantized weight the linear then reads.

use petite_graph::{Dtype, NodeId, TensorType};

use super::{DeviceProgram, Slot, err};
use crate::Result;
use crate::device::{DevTensor, Device};
#[cfg(doc)]
use crate::fuse::Role;
use crate::plan::{ConvParams, Gemm, MatOperand};
use crate::source::dtype_code;

/// `pt_wq_gemm`'s block: its tile loads assume 256 threads (x's 64 rows × 4 threads, the
/// codes' 128 rows × 2, eight warps of 16 features).
const WQ_THREADS: u32 = 256;

impl<'d> DeviceProgram<'d> {
    /// `y = x·wᵀ (+ b)`: f32 straight into y; bf16/f16 without bias straight into y (cuBLAS
    /// rounds the f32 accumulator once); with a bias through an f32 accumulator and one
    /// rounding after the add.
    pub(super) fn linear(
        &self,
        x: &DevTensor,
        w: &DevTensor,
        b: Option<&DevTensor>,
        out_ty: &TensorType,
    ) -> Result<DevTensor> {
        let dev = self.dev;
        let k = *x.shape().last().unwrap_or(&1);
        let n = w.shape()[0];
        let rows = x.numel() / k.max(1);
        let dt = out_ty.dtype;
        let g = Gemm::linear(rows, k, n)?;
        let out = dev.alloc(dt, &out_ty.shape)?;
        if k == 0 {
            dev.memset_zero(&out)?;
        }
        let acc = if dt == Dtype::F32 || b.is_none() {
            if k > 0 {
                dev.gemm(
                    &g,
                    dev.ptr(w),
                    dev.ptr(x),
                    x.dtype(),
                    dev.ptr(&out),
                    dt,
                    self.f32_matmul,
                )?;
            }
            if b.is_none() {
                return Ok(out);
            }
            out.clone()
        } else {
            let acc = dev.alloc(Dtype::F32, &out_ty.shape)?;
            if k == 0 {
                dev.memset_zero(&acc)?;
            } else {
                dev.gemm(
                    &g,
                    dev.ptr(w),
                    dev.ptr(x),
                    x.dtype(),
                    dev.ptr(&acc),
                    Dtype::F32,
                    self.f32_matmul,
                )?;
            }
            acc
        };
        self.bias(&acc, b, rows, n, &out)?;
        Ok(out)
    }

    /// A quantized weight in its declared dtype ([`petite_graph::Op::Dequantize`]): `codes`
    /// (`i8` or `f8e4m3`, axis 0 the rows) times each row's f32 scale, rounded once, as the
    /// reference executor does (the same bits). The result is a value like any other: freed
    /// after its last reader, so only the codes stay resident between runs.
    pub(super) fn dequantize(
        &self,
        codes: &DevTensor,
        scale: &DevTensor,
        out_ty: &TensorType,
    ) -> Result<DevTensor> {
        let dev = self.dev;
        let rows = codes.shape().first().copied().unwrap_or(1);
        let per = codes.numel().checked_div(rows).unwrap_or(0);
        if !codes.dtype().is_quant_code()
            || scale.dtype() != Dtype::F32
            || scale.numel() != rows
            || out_ty.shape.iter().product::<usize>() != codes.numel()
        {
            return Err(err(format!(
                "dequantize of {:?} codes with {:?} scales into {}{:?}",
                codes,
                scale,
                out_ty.dtype.name(),
                out_ty.shape
            )));
        }
        let out = dev.alloc(out_ty.dtype, &out_ty.shape)?;
        let (pc, ps, po) = (dev.ptr(codes), dev.ptr(scale), dev.ptr(&out));
        let vec = i32::from(per % 8 == 0 && pc % 8 == 0 && po % 16 == 0);
        let (r, n) = (rows as i64, per as i64);
        let (dc, dout) = (dtype_code(codes.dtype()), dtype_code(out_ty.dtype));
        let threads = if vec == 1 {
            codes.numel().div_ceil(8)
        } else {
            codes.numel()
        };
        dev.launch("pt_dequant", Device::cfg_elems(threads), |bl| {
            bl.arg(&r).arg(&n).arg(&dc).arg(&dout).arg(&vec);
            Device::push_u64(bl, &pc);
            Device::push_u64(bl, &ps);
            Device::push_u64(bl, &po);
        })?;
        Ok(out)
    }

    /// `y = x·dequant(W)ᵀ (+ b)` for a weight whose dequantize no kernel runs
    /// ([`Role::WeightOnly`]): `pt_wq_gemm` reads the codes and scales itself (the same bf16
    /// weight values as [`DeviceProgram::dequantize`] gives, multiplied on the tensor cores),
    /// split along K so that ~256 blocks share the weight's bytes; `pt_wq_sum` adds the splits
    /// in order and the bias, rounding once. Rows, alignment or dtypes it does not take (a
    /// view's offset) go through the dequantized weight and cuBLAS instead.
    pub(super) fn linear_wq(
        &self,
        x: &DevTensor,
        codes: &DevTensor,
        scale: &DevTensor,
        b: Option<&DevTensor>,
        out_ty: &TensorType,
    ) -> Result<DevTensor> {
        let dev = self.dev;
        let (n, k) = match codes.shape() {
            [n, k] => (*n, *k),
            s => return Err(err(format!("codes of shape {s:?} for a linear"))),
        };
        let rows = x.numel().checked_div(k).unwrap_or(0);
        let (px, pc, ps) = (dev.ptr(x), dev.ptr(codes), dev.ptr(scale));
        if !codes.dtype().is_quant_code() {
            return Err(err(format!("{codes:?} is not quantized codes")));
        }
        if rows == 0
            || rows > crate::fuse::WQ_ROWS
            || x.dtype() != Dtype::Bf16
            || !k.is_multiple_of(32)
            || px % 16 != 0
            || pc % 16 != 0
        {
            let wt = TensorType {
                dtype: Dtype::Bf16,
                shape: codes.shape().to_vec(),
            };
            let w = self.dequantize(codes, scale, &wt)?;
            return self.linear(x, &w, b, out_ty);
        }
        if scale.dtype() != Dtype::F32 || scale.numel() != n {
            return Err(err(format!("{scale:?} scales for {n} rows of codes")));
        }
        let grid = crate::plan::wq_grid(n, k)
            .ok_or_else(|| err(format!("no pt_wq_gemm grid for {n} × {k}")))?;
        let (tiles, splits) = (grid.tiles, grid.splits);
        let part = dev.alloc(Dtype::F32, &[splits, rows, n])?;
        let pp = dev.ptr(&part);
        let (m, nn, kk, kc) = (rows as i64, n as i64, k as i64, grid.kc as i64);
        let dc = dtype_code(codes.dtype());
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (
                u32::try_from(tiles).map_err(|_| err(format!("{n} features")))?,
                splits as u32,
                1,
            ),
            block_dim: (WQ_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        dev.launch("pt_wq_gemm", cfg, |bl| {
            bl.arg(&m).arg(&nn).arg(&kk).arg(&kc).arg(&dc);
            Device::push_u64(bl, &px);
            Device::push_u64(bl, &pc);
            Device::push_u64(bl, &ps);
            Device::push_u64(bl, &pp);
        })?;
        let out = dev.alloc(out_ty.dtype, &out_ty.shape)?;
        let (sp, has) = (splits as i64, i32::from(b.is_some()));
        let db = b.map_or(0, |t| dtype_code(t.dtype()));
        let dout = dtype_code(out_ty.dtype);
        let (pb, po) = (b.map_or(0, |t| dev.ptr(t)), dev.ptr(&out));
        dev.launch("pt_wq_sum", Device::cfg_elems(rows * n), |bl| {
            bl.arg(&m).arg(&nn).arg(&sp).arg(&has).arg(&db).arg(&dout);
            Device::push_u64(bl, &pp);
            Device::push_u64(bl, &pb);
            Device::push_u64(bl, &po);
        })?;
        Ok(out)
    }

    /// `out[r, c] = acc[r, c] + bias[c]` rounded to out's dtype (acc and out may alias).
    pub(super) fn bias(
        &self,
        acc: &DevTensor,
        b: Option<&DevTensor>,
        rows: usize,
        n: usize,
        out: &DevTensor,
    ) -> Result<()> {
        let dev = self.dev;
        let (r, nn) = (rows as i64, n as i64);
        let has = i32::from(b.is_some());
        let db = b.map_or(0, |t| dtype_code(t.dtype()));
        let dout = dtype_code(out.dtype());
        let (pa, pb, po) = (dev.ptr(acc), b.map_or(0, |t| dev.ptr(t)), dev.ptr(out));
        dev.launch("pt_bias", Device::cfg_elems(rows * n), |bl| {
            bl.arg(&r).arg(&nn).arg(&has).arg(&db).arg(&dout);
            Device::push_u64(bl, &pa);
            Device::push_u64(bl, &pb);
            Device::push_u64(bl, &po);
        })
    }

    /// Batched matmul with broadcast batch dims, each operand read in place through its
    /// strides where the fusion plan found a view ([`crate::fuse::StridedView`]): one
    /// strided-batched GEMM when the batch offsets are uniform, else one GEMM a batch.
    /// Matmul `id`, its operands read through their views. With `into` (the type of the
    /// head-merging permute reading its `[1, H, Q, D]` result, [`Role::Transposed`]), the
    /// GEMMs write `[1, Q, H, D]` directly: a leading dimension of `H·D`, `D` between heads.
    pub(super) fn matmul(
        &self,
        id: NodeId,
        slots: &[Slot],
        out_ty: &TensorType,
        into: Option<&TensorType>,
    ) -> Result<DevTensor> {
        if let Some(a) = self.fusion.attentions.get(&id) {
            return self.attend(a, slots, out_ty, into);
        }
        let dev = self.dev;
        let mut ops: Vec<(&DevTensor, MatOperand)> = Vec::with_capacity(2);
        for j in 0..2 {
            let (t, view) = self.in_place(id, j, slots)?;
            let m = match view {
                Some(w) => MatOperand::from_view(&w.shape, &w.strides)?,
                None => MatOperand::dense(t.shape())?,
            };
            ops.push((t, m));
        }
        let (ta, a) = (&ops[0].0, &ops[0].1);
        let (tb, b) = (&ops[1].0, &ops[1].1);
        let ob = &out_ty.shape[..out_ty.shape.len() - 2];
        let oa = a.batch_offsets(ob)?;
        let obb = b.batch_offsets(ob)?;
        let (m, k, n) = (a.rows, a.cols, b.cols);
        let nb = oa.len();
        let out = dev.alloc(out_ty.dtype, &into.unwrap_or(out_ty).shape)?;
        // Row stride and batch stride of the output (batches are heads when transposed).
        let (ldc, sc) = match into {
            Some(_) => (nb * n, n),
            None => (n, m * n),
        };
        if k == 0 {
            dev.memset_zero(&out)?;
            return Ok(out);
        }
        let es = ta.dtype().size() as u64;
        let os = out_ty.dtype.size() as u64;
        let (pa, pb, po) = (dev.ptr(ta), dev.ptr(tb), dev.ptr(&out));
        let mut g = crate::plan::matmul_gemm(a, b)?;
        g.ldc = i32::try_from(ldc).map_err(|_| err(format!("output row stride {ldc}")))?;
        let (sa, sb) = (
            oa.get(1).copied().unwrap_or(0),
            obb.get(1).copied().unwrap_or(0),
        );
        let uniform = nb > 0
            && oa.iter().enumerate().all(|(i, &x)| x == i as i64 * sa)
            && obb.iter().enumerate().all(|(i, &y)| y == i as i64 * sb);
        if uniform {
            let g = g.batched(nb, sb, sa, sc as i64)?;
            dev.gemm(&g, pb, pa, ta.dtype(), po, out_ty.dtype, self.f32_matmul)?;
        } else {
            for i in 0..nb {
                dev.gemm(
                    &g,
                    pb + obb[i] as u64 * es,
                    pa + oa[i] as u64 * es,
                    ta.dtype(),
                    po + (i * sc) as u64 * os,
                    out_ty.dtype,
                    self.f32_matmul,
                )?;
            }
        }
        Ok(out)
    }

    /// Convolution as im2col + one GEMM (f32 accumulator) + bias + a move to NCHW.
    pub(super) fn conv2d(
        &self,
        x: &DevTensor,
        w: &DevTensor,
        b: Option<&DevTensor>,
        stride: [usize; 2],
        padding: [usize; 2],
        out_ty: &TensorType,
    ) -> Result<DevTensor> {
        let dev = self.dev;
        let (n, c, h, wd) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
        let (o, kh, kw) = (w.shape()[0], w.shape()[2], w.shape()[3]);
        let (oh, ow) = (out_ty.shape[2], out_ty.shape[3]);
        let kk = c * kh * kw;
        let rows = n * oh * ow;
        let cols = dev.alloc(x.dtype(), &[rows, kk])?;
        let prm = ConvParams {
            n: n as i64,
            c: c as i64,
            h: h as i64,
            w: wd as i64,
            kh: kh as i64,
            kw: kw as i64,
            oh: oh as i64,
            ow: ow as i64,
            sh: stride[0] as i64,
            sw: stride[1] as i64,
            ph: padding[0] as i64,
            pw: padding[1] as i64,
            dt: dtype_code(x.dtype()),
        };
        let (px, pc) = (dev.ptr(x), dev.ptr(&cols));
        dev.launch("pt_im2col", Device::cfg_elems(rows * kk), |bl| {
            bl.arg(&prm);
            Device::push_u64(bl, &px);
            Device::push_u64(bl, &pc);
        })?;
        let acc = dev.alloc(Dtype::F32, &[n, oh * ow, o])?;
        let g = Gemm::linear(rows, kk, o)?;
        dev.gemm(
            &g,
            dev.ptr(w),
            dev.ptr(&cols),
            x.dtype(),
            dev.ptr(&acc),
            Dtype::F32,
            self.f32_matmul,
        )?;
        self.bias(&acc, b, rows, o, &acc)?;
        // [N, OH·OW, O] → [N, O, OH, OW], rounded once to the output dtype.
        let dims = [n, o, oh, ow];
        let st = vec![(oh * ow * o) as i64, 1, (ow * o) as i64, o as i64];
        self.strided_copy(&acc, &dims, st, 0, out_ty.dtype)
    }
}
