//! cuBLAS GEMMs: the shapes of linears, matmuls read through views and attention's products
//! ([`Gemm`]), a pointer-batched GEMM's pointer arrays ([`PtrParams`]), and the FLOPs a
//! program's dense ops count.

use super::{broadcast_strides, contiguous_strides};
use crate::{Error, Result};

/// `pt_ptrs`'s parameter block (mirrors `struct PtrParams`): the A, B and C pointer arrays of
/// `loops` runs of a strided-batched GEMM, as one pointer-batched GEMM.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PtrParams {
    /// A, B and C of the first problem (device addresses).
    pub base: [u64; 3],
    /// Bytes from one run to the next, per operand.
    pub outer: [i64; 3],
    /// Bytes from one batch to the next within a run, per operand.
    pub inner: [i64; 3],
    /// Batches a run.
    pub batch: i64,
    /// Problems in all (runs × batches).
    pub n: i64,
}

// SAFETY: plain `#[repr(C)]` data mirroring the kernel's struct.
unsafe impl cudarc::driver::DeviceRepr for PtrParams {}

impl PtrParams {
    /// Pointers of `loops` runs of GEMM `g` over elements of `sizes` bytes (A, B, C), the
    /// runs `steps` elements apart.
    pub fn new(g: &Gemm, base: [u64; 3], sizes: [usize; 3], loops: usize, steps: [i64; 3]) -> Self {
        let inner = [g.stride_a, g.stride_b, g.stride_c];
        let batch = g.batch.max(1) as i64;
        PtrParams {
            base,
            outer: std::array::from_fn(|t| steps[t] * sizes[t] as i64),
            inner: std::array::from_fn(|t| inner[t] * sizes[t] as i64),
            batch,
            n: batch * loops as i64,
        }
    }

    /// Problem `i`'s three addresses, as the kernel computes them.
    pub fn at(&self, i: i64) -> [u64; 3] {
        let (l, j) = (i / self.batch, i % self.batch);
        std::array::from_fn(|t| {
            self.base[t].wrapping_add((l * self.outer[t] + j * self.inner[t]) as u64)
        })
    }
}

/// One cuBLAS GEMM in cuBLAS's column-major terms: `C[m×n] = op(A)[m×k] · op(B)[k×n]`, each
/// operand with a leading dimension and a batch stride (elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gemm {
    /// A is transposed.
    pub trans_a: bool,
    /// B is transposed.
    pub trans_b: bool,
    /// Rows of C.
    pub m: i32,
    /// Columns of C.
    pub n: i32,
    /// Inner dim.
    pub k: i32,
    /// Leading dims.
    pub lda: i32,
    /// See `lda`.
    pub ldb: i32,
    /// See `lda`.
    pub ldc: i32,
    /// Batch strides (elements).
    pub stride_a: i64,
    /// See `stride_a`.
    pub stride_b: i64,
    /// See `stride_a`.
    pub stride_c: i64,
    /// Batches.
    pub batch: i32,
}

fn i32_of(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Plan(format!("{what} {v} exceeds cuBLAS's int range")))
}

impl Gemm {
    /// Row-major `y[rows, n] = x[rows, k] · w[n, k]ᵀ` (PyTorch's linear): in column-major
    /// terms `yᵀ[n, rows] = w[n, k] · xᵀ` — A is w transposed (stored k×n col-major), B is x.
    /// Batched over `batch` with the given row-major strides.
    pub fn linear(rows: usize, k: usize, n: usize) -> Result<Self> {
        Ok(Gemm {
            trans_a: true,
            trans_b: false,
            m: i32_of(n, "out features")?,
            n: i32_of(rows, "rows")?,
            k: i32_of(k, "in features")?,
            lda: i32_of(k.max(1), "in features")?,
            ldb: i32_of(k.max(1), "in features")?,
            ldc: i32_of(n.max(1), "out features")?,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            batch: 1,
        })
    }

    /// Row-major `c[m, n] = a[m, k] · b[k, n]` of dense operands: [`matmul_gemm`] of two
    /// row-major matrices (neither transposed).
    pub fn matmul(m: usize, k: usize, n: usize) -> Result<Self> {
        matmul_gemm(&MatOperand::dense(&[m, k])?, &MatOperand::dense(&[k, n])?)
    }

    /// Batched over `batch`, cuBLAS operand strides (A, B, C in cuBLAS's order).
    pub fn batched(mut self, batch: usize, a: i64, b: i64, c: i64) -> Result<Self> {
        self.batch = i32_of(batch, "batch")?;
        self.stride_a = a;
        self.stride_b = b;
        self.stride_c = c;
        Ok(self)
    }

    /// FLOPs (2·m·n·k a batch).
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64 * self.batch as f64
    }
}

/// One matmul operand as cuBLAS reads it: a `[rows, cols]` matrix a batch, with element
/// strides that make it row-major (`col_stride == 1`) or column-major (`row_stride == 1`), so
/// a transposed, head-repeated or reshaped operand is read in place instead of copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatOperand {
    /// Batch dims.
    pub batch: Vec<usize>,
    /// Their element strides (0: broadcast).
    pub batch_strides: Vec<i64>,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Elements between rows.
    pub row_stride: i64,
    /// Elements between columns.
    pub col_stride: i64,
}

impl MatOperand {
    /// A dense row-major tensor.
    pub fn dense(shape: &[usize]) -> Result<Self> {
        Self::from_view(shape, &contiguous_strides(shape))
    }

    /// A strided view; an error when no cuBLAS layout reads it (neither dim unit-stride, or
    /// a leading dimension below what cuBLAS requires).
    pub fn from_view(shape: &[usize], strides: &[i64]) -> Result<Self> {
        let r = shape.len();
        if r < 2 || strides.len() != r {
            return Err(Error::Plan(format!("matmul operand of rank {r}")));
        }
        let (rows, cols) = (shape[r - 2], shape[r - 1]);
        let (mut sr, mut sc) = (strides[r - 2], strides[r - 1]);
        // A dim of size 1 is read at index 0 only: its stride is free.
        if cols <= 1 {
            sc = 1;
        }
        if rows <= 1 {
            sr = if sc == 1 { cols.max(1) as i64 } else { 1 };
        }
        let ok = (sc == 1 && sr >= cols.max(1) as i64) || (sr == 1 && sc >= rows.max(1) as i64);
        if !ok || sr > i32::MAX as i64 || sc > i32::MAX as i64 {
            return Err(Error::Plan(format!(
                "matmul operand {shape:?} with strides {strides:?} is not a cuBLAS layout"
            )));
        }
        Ok(MatOperand {
            batch: shape[..r - 2].to_vec(),
            batch_strides: strides[..r - 2].to_vec(),
            rows,
            cols,
            row_stride: sr,
            col_stride: sc,
        })
    }

    /// cuBLAS's view of this row-major operand as the column-major transpose: (transposed,
    /// leading dimension).
    pub fn trans_ld(&self) -> (bool, i64) {
        if self.col_stride == 1 {
            (false, self.row_stride)
        } else {
            (true, self.col_stride)
        }
    }

    /// Element offset of each batch of `out_batch` (numpy broadcasting of this operand's
    /// batch dims).
    pub fn batch_offsets(&self, out_batch: &[usize]) -> Result<Vec<i64>> {
        let st = broadcast_strides(&self.batch, out_batch)?;
        // broadcast_strides counts in batch elements of a dense batch: rescale by ours.
        let off = out_batch.len() - self.batch.len();
        let mut mine = vec![0i64; out_batch.len()];
        for d in 0..self.batch.len() {
            if st[d + off] != 0 {
                mine[d + off] = self.batch_strides[d];
            }
        }
        let nb: usize = out_batch.iter().product();
        let mut offs = Vec::with_capacity(nb);
        for i in 0..nb {
            let (mut rem, mut o) = (i, 0i64);
            for d in (0..out_batch.len()).rev() {
                let ix = (rem % out_batch[d]) as i64;
                rem /= out_batch[d];
                o += ix * mine[d];
            }
            offs.push(o);
        }
        Ok(offs)
    }
}

/// `c = a · b` over batches of row-major `c` (`m × n`, dense): cuBLAS computes `cᵀ = bᵀ · aᵀ`
/// column-major, so its A is `b` and its B is `a`, each transposed or not by its layout.
pub fn matmul_gemm(a: &MatOperand, b: &MatOperand) -> Result<Gemm> {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    if b.rows != k {
        return Err(Error::Plan(format!("matmul {m}x{k} by {}x{n}", b.rows)));
    }
    let (ta, lda) = b.trans_ld();
    let (tb, ldb) = a.trans_ld();
    Ok(Gemm {
        trans_a: ta,
        trans_b: tb,
        m: i32_of(n, "n")?,
        n: i32_of(m, "m")?,
        k: i32_of(k, "k")?,
        lda: i32_of(lda.max(1) as usize, "lda")?,
        ldb: i32_of(ldb.max(1) as usize, "ldb")?,
        ldc: i32_of(n.max(1), "n")?,
        stride_a: 0,
        stride_b: 0,
        stride_c: 0,
        batch: 1,
    })
}

/// The two GEMMs of grouped-query attention over q `[B, H, Q, D]`, k `[B, KVH, K, D]`,
/// v `[B, KVH, K, Dv]`: the `H / KVH` query heads sharing a KV head are one contiguous block
/// of `g·Q` rows, so logits `[B, H, Q, K]` are one GEMM batched over `B·KVH`, and so is
/// `probs · v`.
pub fn attention_gemms(
    b: usize,
    h: usize,
    kvh: usize,
    q: usize,
    k: usize,
    d: usize,
    dv: usize,
) -> Result<(Gemm, Gemm)> {
    if kvh == 0 || !h.is_multiple_of(kvh) {
        return Err(Error::Plan(format!("{h} heads over {kvh} kv heads")));
    }
    let g = h / kvh;
    let batch = b * kvh;
    // logits block [g·Q, K] = qblock [g·Q, D] · kᵀ: a linear with x = qblock, w = k.
    let logits = Gemm::linear(g * q, d, k)?.batched(
        batch,
        (k * d) as i64,
        (g * q * d) as i64,
        (g * q * k) as i64,
    )?;
    // out block [g·Q, Dv] = probs [g·Q, K] · v [K, Dv]: cuBLAS's A is v, B is probs.
    let pv = Gemm::matmul(g * q, k, dv)?.batched(
        batch,
        (k * dv) as i64,
        (g * q * k) as i64,
        (g * q * dv) as i64,
    )?;
    Ok((logits, pv))
}

/// Where one attention operand's heads lie in memory: row-major `[S, D]` blocks, `ld`
/// elements between rows, `head` elements between heads (0: one head shared by all).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadLayout {
    /// Elements between rows (tokens).
    pub ld: i64,
    /// Elements between heads.
    pub head: i64,
}

/// The two GEMMs of attention batched one head at a time over q `[1, H, Q, D]`, k `[1, KVH,
/// K, D]`, v `[1, KVH, K, Dv]` read in place through [`HeadLayout`]s (heads split out of a
/// projection's `[S, H·D]` rows need no copy), with the f32 logits dense `[H, Q, K]` and the
/// output written through `out` (`[1, Q, H, Dv]` — heads merged — when its `ld` is `H·Dv`).
/// Only where one stride reaches every head's K/V block: `KVH == H` or `KVH == 1`; `None`
/// otherwise.
#[allow(clippy::too_many_arguments)]
pub fn attention_gemms_per_head(
    h: usize,
    kvh: usize,
    q: usize,
    k: usize,
    d: usize,
    dv: usize,
    [lq, lk, lv, lo]: [HeadLayout; 4],
) -> Result<Option<(Gemm, Gemm)>> {
    let kv_step = |l: HeadLayout| match kvh {
        _ if kvh == h => Some(l.head),
        1 => Some(0),
        _ => None,
    };
    let (Some(sk), Some(sv)) = (kv_step(lk), kv_step(lv)) else {
        return Ok(None);
    };
    let ld = |v: i64, what: &str| i32_of(v.max(1) as usize, what);
    // logits [Q, K] = q [Q, D] · kᵀ: a linear with x = q's block, w = k's block.
    let mut logits = Gemm::linear(q, d, k)?;
    logits.lda = ld(lk.ld, "k row stride")?;
    logits.ldb = ld(lq.ld, "q row stride")?;
    let logits = logits.batched(h, sk, lq.head, (q * k) as i64)?;
    // out [Q, Dv] = probs [Q, K] · v [K, Dv]: cuBLAS's A is v, B is probs.
    let mut pv = Gemm::matmul(q, k, dv)?;
    pv.lda = ld(lv.ld, "v row stride")?;
    pv.ldc = ld(lo.ld, "output row stride")?;
    let pv = pv.batched(h, sv, (q * k) as i64, lo.head)?;
    Ok(Some((logits, pv)))
}

/// Multiply-add FLOPs (2 a product) of a program's dense ops — linear, matmul, convolution and
/// attention's two products — from the declared shapes: what a roofline floor is computed
/// from. Elementwise ops are not counted (memory-bound; their bytes are not weights).
pub fn program_flops(p: &petite_graph::Program) -> f64 {
    let [a, b] = program_flops_by_dtype(p);
    a + b
}

/// [`program_flops`] split by the dtype the products read: `[16-bit (bf16/f16), f32]`. A roofline
/// floor takes each part at its own rate: lerobot's bf16 mode keeps SigLIP in f32, whose
/// products run at the f32 rate (no TF32), ~15× below the bf16 tensor-core rate on an H200.
pub fn program_flops_by_dtype(p: &petite_graph::Program) -> [f64; 2] {
    use petite_graph::Op;
    let shape = |v: petite_graph::NodeId| -> Vec<usize> {
        p.node(v)
            .tensor()
            .map(|t| t.shape.clone())
            .unwrap_or_default()
    };
    let numel = |s: &[usize]| s.iter().product::<usize>() as f64;
    let mut by = [0.0f64; 2];
    for n in &p.nodes {
        let out = n.tensor().map(|t| t.shape.clone()).unwrap_or_default();
        let wide = n
            .inputs
            .first()
            .and_then(|&v| p.node(v).tensor())
            .map(|t| t.dtype)
            == Some(petite_graph::Dtype::F32);
        let f = &mut by[usize::from(wide)];
        match &n.op {
            Op::Linear => {
                let k = *shape(n.inputs[0]).last().unwrap_or(&0) as f64;
                *f += 2.0 * numel(&out) * k;
            }
            Op::MatMul => {
                let a = shape(n.inputs[0]);
                *f += 2.0 * numel(&out) * a[a.len() - 1] as f64;
            }
            Op::Conv2d { .. } => {
                let w = shape(n.inputs[1]);
                *f += 2.0 * numel(&out) * (w[1] * w[2] * w[3]) as f64;
            }
            Op::Attention { .. } => {
                let (q, k) = (shape(n.inputs[0]), shape(n.inputs[1]));
                let dv = out[3] as f64;
                *f += 2.0 * (q[0] * q[1] * q[2] * k[2]) as f64 * (q[3] as f64 + dv);
            }
            _ => {}
        }
    }
    by
}

/// `pt_wq_gemm`'s grid for `n` features of `k` in features (a multiple of 32): 128 features a
/// block (`tiles`), K split into `splits` runs of `kc` columns (a multiple of 32) so that the
/// blocks number about [`WQ_BLOCKS`]: each split's f32 partials are written whole, and
/// `pt_wq_sum` adds them in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WqGrid {
    /// Blocks along the features (128 each).
    pub tiles: usize,
    /// Columns of K a split covers (the last may cover fewer).
    pub kc: usize,
    /// Splits along K.
    pub splits: usize,
}

/// The blocks [`wq_grid`] aims at: about two for each of an H100's or H200's 132 multiprocessors,
/// so that every one streams weight bytes.
pub const WQ_BLOCKS: usize = 256;

/// See [`WqGrid`]; `None` where `k` is not a positive multiple of 32 or `n` is 0.
pub fn wq_grid(n: usize, k: usize) -> Option<WqGrid> {
    if n == 0 || k == 0 || !k.is_multiple_of(32) {
        return None;
    }
    let tiles = n.div_ceil(128);
    let steps = k / 32;
    let per = steps.div_ceil(WQ_BLOCKS.div_ceil(tiles).clamp(1, steps));
    Some(WqGrid {
        tiles,
        kc: per * 32,
        splits: steps.div_ceil(per),
    })
}
