//! Launch planning: the parameter blocks the kernels read, strides, grid sizes and the GEMM
//! shapes of linear layers, batched matmuls and attention. Pure host code, so it is tested
//! where there is no GPU.

use crate::source::{EwOp, MAX_RANK, dtype_code};
use crate::{Error, Result};
use cudarc::driver::LaunchConfig;
use petite_graph::Dtype;

/// Threads a block for every kernel (a multiple of 32: the block reductions assume whole warps).
pub const BLOCK: u32 = 256;

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

fn fill(dst: &mut [i64; MAX_RANK], src: &[i64]) {
    dst[..src.len()].copy_from_slice(src);
}

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

/// `pt_attn_tf32`'s parameter block (mirrors `struct TfAttnParams`): element strides of q
/// `[B, H, Q, D]`, K and v `[B, KVH, K, D]` (batch, head, row; each row contiguous) and the
/// output (batch, head, query; its rows contiguous), the sizes, the 64-row tiles a head.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TfAttnParams {
    /// q's batch, head and query strides.
    pub qs: [i64; 3],
    /// K's batch, head and key strides.
    pub ks: [i64; 3],
    /// v's batch, head and key strides.
    pub vs: [i64; 3],
    /// The output's batch, head and query strides.
    pub os: [i64; 3],
    /// Query heads.
    pub h: i32,
    /// Key/value heads (dividing `h`).
    pub kvh: i32,
    /// Queries.
    pub nq: i32,
    /// Keys.
    pub nk: i32,
    /// q/k head dim.
    pub d: i32,
    /// v head dim.
    pub dv: i32,
    /// Tiles of 64 queries a head.
    pub tiles: i32,
    /// The logits' scale.
    pub scale: f32,
}

// SAFETY: plain `#[repr(C)]` data mirroring the kernel's struct.
unsafe impl cudarc::driver::DeviceRepr for TfAttnParams {}

/// Most keys `pt_attn_tf32` takes (four warps' quarters of 64, all staged at once).
pub const TF32_ATTN_MAX_KEYS: usize = 256;
/// Largest head dim `pt_attn_tf32` takes (q and v; the fragments' registers).
pub const TF32_ATTN_MAX_DIM: usize = 80;

/// The `pt_attn_tf32` launch of an f32 attention without a mask over `[b, h, nq, d]` queries
/// and `[b, kvh, nk, d]` keys (v's head dim `dv`), each operand's `[batch, head, row]` element
/// strides given (rows contiguous) and the output's: grid, 512 threads, shared memory for q's
/// 64 rows and all of K and v (or the four key quarters' partial results, if larger). `None`
/// where the kernel does not apply (head dims not multiples of 8 or past
/// [`TF32_ATTN_MAX_DIM`], more than [`TF32_ATTN_MAX_KEYS`] keys, q/K/v rows not 16-byte
/// multiples (all three are staged 16 bytes a copy), heads not a multiple of the KV heads,
/// more shared memory than `max_smem`, sizes past 32 bits, nothing to do), and the unfused
/// GEMMs and softmax run.
#[allow(clippy::too_many_arguments)]
pub fn tf32_attention_launch(
    [b, h, kvh, nq, nk, d, dv]: [usize; 7],
    q: [i64; 3],
    k: [i64; 3],
    v: [i64; 3],
    o: [i64; 3],
    scale: f32,
    max_smem: usize,
) -> Option<(TfAttnParams, LaunchConfig)> {
    let dims_fit = |x: usize| x > 0 && x <= TF32_ATTN_MAX_DIM && x.is_multiple_of(8);
    if b == 0
        || nq == 0
        || nk == 0
        || nk > TF32_ATTN_MAX_KEYS
        || kvh == 0
        || !h.is_multiple_of(kvh)
        || !dims_fit(d)
        || !dims_fit(dv)
        || q.iter().chain(&k).chain(&v).any(|s| s % 4 != 0)
    {
        return None;
    }
    let i = |x: usize| i32::try_from(x).ok();
    let tiles = nq.div_ceil(64);
    let blocks = u32::try_from(b.checked_mul(h)?.checked_mul(tiles)?).ok()?;
    let nkp = nk.div_ceil(64) * 64;
    let (dp, vp) = (d + 4, dv + 4);
    let floats = 64 * dp + (nkp * (dp + vp)).max(2 * 64 * 4 + 64 * 4 * vp);
    let smem = floats * 4;
    if smem > max_smem {
        return None;
    }
    Some((
        TfAttnParams {
            qs: q,
            ks: k,
            vs: v,
            os: o,
            h: i(h)?,
            kvh: i(kvh)?,
            nq: i(nq)?,
            nk: i(nk)?,
            d: i(d)?,
            dv: i(dv)?,
            tiles: i(tiles)?,
            scale,
        },
        LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: smem as u32,
        },
    ))
}

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

/// `pt_attn_logits`/`pt_attn_pv`'s parameter block ([`crate::fuse::Attend`]): field for field
/// the `AttnParams` of [`crate::source`]'s attention kernels. Strides are in elements.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnParams {
    /// Keys.
    pub nk: i64,
    /// Keys in K's and v's first piece (`nk`: one piece).
    pub n0: i64,
    /// Query rows a group (`H·Q` when all heads share K and v, else `Q`).
    pub rpg: i64,
    /// Row tiles of 16 a group.
    pub tiles: i64,
    /// Query heads.
    pub h: i64,
    /// Queries.
    pub q: i64,
    /// 1 when all heads read one K and v (their head strides are 0): a group is a batch.
    pub shared: i32,
    /// q's and k's head dim (a multiple of 16).
    pub d: i32,
    /// Key splits of `pt_attn_logits` (32 keys each).
    pub splits: i32,
    /// Dtype code the scaled logits are rounded to (f32: not rounded).
    pub dscale: i32,
    /// Multiplies the bf16 logits.
    pub scale: f32,
    /// A mask is added.
    pub has_mask: i32,
    /// v's head dim (a multiple of 32, at most 256).
    pub dv: i32,
    /// Key blocks of `pt_attn_pv` (128 keys each).
    pub splits2: i32,
    /// q's strides along B, H, Q.
    pub qsb: i64,
    /// See `qsb`.
    pub qsh: i64,
    /// See `qsb`.
    pub qsq: i64,
    /// k's strides along B, H, K (its first piece).
    pub ksb: i64,
    /// See `ksb`.
    pub ksh: i64,
    /// See `ksb` (both pieces).
    pub ksk: i64,
    /// k's second piece's strides along B, H.
    pub k1sb: i64,
    /// See `k1sb`.
    pub k1sh: i64,
    /// v's strides along B, H, K (its first piece).
    pub vsb: i64,
    /// See `vsb`.
    pub vsh: i64,
    /// See `vsb` (both pieces).
    pub vsk: i64,
    /// v's second piece's strides along B, H.
    pub v1sb: i64,
    /// See `v1sb`.
    pub v1sh: i64,
    /// The mask's strides along B, H, Q, K (0 where broadcast).
    pub msb: i64,
    /// See `msb`.
    pub msh: i64,
    /// See `msb`.
    pub msq: i64,
    /// See `msb`.
    pub msk: i64,
    /// The output's strides along B, H, Q (its last dim contiguous).
    pub osb: i64,
    /// See `osb`.
    pub osh: i64,
    /// See `osb`.
    pub osq: i64,
}
// SAFETY: as for EwParams.
unsafe impl cudarc::driver::DeviceRepr for AttnParams {}

/// A fused attention's operands: `(shape, element strides)` of q `[B, H, Q, D]`, of k seen
/// as kᵀ `[B, H, D, K]` and of v `[B, H, K, Dv]` (head-repeated K/V as head stride 0), the
/// mask's `[H, Q, sb, sh, sq, sk]` (as `pt_softmax` takes it), the scaling folded in, and the
/// output's strides along B, H, Q.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape<'a> {
    /// q.
    pub q: (&'a [usize], &'a [i64]),
    /// kᵀ.
    pub k: (&'a [usize], &'a [i64]),
    /// v.
    pub v: (&'a [usize], &'a [i64]),
    /// The mask's heads, queries and strides.
    pub mask: [i64; 6],
    /// The scaling and the dtype its product is rounded to.
    pub scale: Option<(f32, Dtype)>,
    /// Output strides along B, H, Q.
    pub out: [i64; 3],
    /// With K and v each two pieces along the keys (kᵀ's and v's strides those of their
    /// contiguous concat): the first pieces' keys.
    pub n0: Option<usize>,
}

/// A planned fused attention: the parameters, both launches, and the scratch rows (`B·H·Q`:
/// f32 logits of `nk` and `splits` (max, sum) pairs each).
#[derive(Debug, Clone, Copy)]
pub struct AttnLaunch {
    /// The kernels' parameters.
    pub params: AttnParams,
    /// `pt_attn_logits`: (row tiles, key splits), 128 threads.
    pub logits: LaunchConfig,
    /// `pt_attn_pv`: (row tiles, Dv / 32), 256 threads.
    pub pv: LaunchConfig,
    /// `pt_attn_cl`, the whole attention in one launch, where it fits ([`attention_cluster`]):
    /// ([`ATTN_CLUSTER`] key blocks, tiles of 32 rows), 512 threads, its dynamic shared memory;
    /// launched in clusters of [`ATTN_CLUSTER`] blocks along x.
    pub cluster: Option<LaunchConfig>,
    /// Scratch rows.
    pub rows: usize,
    /// Row tiles (`pt_attn_pv`'s counters; its partial products are `tiles · splits2 · 16 · dv`).
    pub tiles: usize,
}

/// Plans a fused attention over `s` on a device of compute capability `cc`; refuses what the
/// kernels cannot index (the fusion plan only picks what they can).
pub fn attention_launch(s: AttnShape<'_>, cc: (i32, i32)) -> Result<AttnLaunch> {
    let bad = |m: String| Error::Plan(format!("fused attention: {m}"));
    if cc.0 < 8 {
        return Err(bad(format!(
            "needs sm_80 or later, not sm_{}{}",
            cc.0, cc.1
        )));
    }
    let (qs, qst) = s.q;
    let (ks, kst) = s.k;
    let (vs, vst) = s.v;
    if qs.len() != 4 || ks.len() != 4 || vs.len() != 4 {
        return Err(bad("operands of rank 4 only".into()));
    }
    let (b, h, nq, d) = (qs[0], qs[1], qs[2], qs[3]);
    let (nk, dv) = (ks[3], vs[3]);
    if ks[..3] != [b, h, d] || vs[..3] != [b, h, nk] {
        return Err(bad(format!("q {qs:?}, kᵀ {ks:?}, v {vs:?} disagree")));
    }
    if qst[3] != 1 || kst[2] != 1 || vst[3] != 1 {
        return Err(bad("head dims not contiguous".into()));
    }
    if !attention_dims_fit(d, dv) || nk == 0 || nq == 0 {
        return Err(bad(format!("head dims {d}/{dv}, {nq} queries, {nk} keys")));
    }
    // Rows are read 16 bytes at a time.
    if !attention_strides_fit(qst, kst, vst) {
        return Err(bad(format!(
            "q {qst:?}, kᵀ {kst:?} or v {vst:?} rows not 8 elements apart"
        )));
    }
    let shared = kst[1] == 0 && vst[1] == 0;
    let (groups, rpg) = if shared { (b, h * nq) } else { (b * h, nq) };
    let tiles = rpg.div_ceil(16);
    let splits = nk.div_ceil(32);
    let splits2 = nk.div_ceil(128);
    // The kernels index in 32 bits: every element they address must be below 2^31.
    let reach = |dims: &[usize], st: &[i64]| -> u128 {
        dims.iter()
            .zip(st)
            .map(|(&n, &x)| n.saturating_sub(1) as u128 * x.unsigned_abs() as u128)
            .sum::<u128>()
            + 1
    };
    let m = s.mask;
    let scratch = [
        (b * h * nq) as u128 * nk as u128,
        (groups * tiles * splits2 * 16 * dv) as u128,
        reach(qs, qst),
        reach(ks, kst),
        reach(vs, vst),
        reach(&[b, h, nq, nk], &m[2..]),
        reach(&[b, h, nq, dv], &s.out),
    ];
    if scratch.iter().any(|&x| x >= 1 << 31) {
        return Err(bad(format!(
            "{scratch:?} elements reach past 32-bit indices"
        )));
    }
    let n = |v: usize, what: &str| {
        u32::try_from(v).map_err(|_| bad(format!("{v} {what} exceed the grid")))
    };
    let blocks = n(groups * tiles, "row tiles")?;
    let (splits32, blocks2) = (n(splits, "key splits")?, n(splits2, "key blocks")?);
    if splits32 > 65_535 {
        return Err(bad(format!("{nk} keys")));
    }
    // Each piece is contiguous like the concat: its batch and head strides scale with its keys.
    let piece = |x: i64, n: usize| -> Result<i64> {
        if x % nk as i64 != 0 {
            return Err(bad(format!("a stride of {x} over {nk} concatenated keys")));
        }
        Ok(x / nk as i64 * n as i64)
    };
    let n0 = s.n0.unwrap_or(nk);
    if n0 == 0 || n0 > nk {
        return Err(bad(format!(
            "pieces of {n0} and {} keys",
            nk.wrapping_sub(n0)
        )));
    }
    let split = |st: &[i64]| -> Result<[i64; 4]> {
        if n0 == nk {
            return Ok([st[0], st[1], st[0], st[1]]);
        }
        Ok([
            piece(st[0], n0)?,
            piece(st[1], n0)?,
            piece(st[0], nk - n0)?,
            piece(st[1], nk - n0)?,
        ])
    };
    let (kp, vp) = (split(kst)?, split(vst)?);
    let (scale, dscale) = match s.scale {
        Some((x, dt)) => (x, dtype_code(dt)),
        None => (1.0, dtype_code(Dtype::F32)),
    };
    let params = AttnParams {
        nk: nk as i64,
        n0: n0 as i64,
        rpg: rpg as i64,
        tiles: tiles as i64,
        h: h as i64,
        q: nq as i64,
        shared: i32::from(shared),
        d: i32::try_from(d).map_err(|_| bad(format!("head dim {d}")))?,
        splits: splits32 as i32,
        dscale,
        scale,
        has_mask: 1,
        dv: dv as i32,
        splits2: blocks2 as i32,
        qsb: qst[0],
        qsh: qst[1],
        qsq: qst[2],
        ksb: kp[0],
        ksh: kp[1],
        ksk: kst[3],
        k1sb: kp[2],
        k1sh: kp[3],
        vsb: vp[0],
        vsh: vp[1],
        vsk: vst[2],
        v1sb: vp[2],
        v1sh: vp[3],
        msb: m[2],
        msh: m[3],
        msq: m[4],
        msk: m[5],
        osb: s.out[0],
        osh: s.out[1],
        osq: s.out[2],
    };
    let cfg = |grid: (u32, u32), threads: u32| LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let cluster = match attention_cluster(nk, dv, cc) {
        Some(bytes) => {
            let rows = n(groups * rpg.div_ceil(32), "row tiles")?;
            (rows <= 65_535).then_some(LaunchConfig {
                grid_dim: (ATTN_CLUSTER, rows, 1),
                block_dim: (512, 1, 1),
                shared_mem_bytes: bytes,
            })
        }
        None => None,
    };
    Ok(AttnLaunch {
        params,
        logits: cfg((blocks, splits32), 128),
        pv: cfg((blocks, blocks2), 256),
        cluster,
        rows: groups * rpg,
        tiles: groups * tiles,
    })
}

/// Blocks of a `pt_attn_cl` cluster (its `AT_CL`): each holds an eighth of the keys, so the
/// row statistics and the partial products are exchanged through distributed shared memory
/// instead of global memory (a portable cluster size).
pub const ATTN_CLUSTER: u32 = 8;

/// Keys a `pt_attn_cl` block holds (its `AT_CL_KC`): an eighth of `nk`, rounded up to 64.
pub fn attention_cluster_keys(nk: usize) -> usize {
    nk.div_ceil(ATTN_CLUSTER as usize).div_ceil(64) * 64
}

/// `pt_attn_cl`'s dynamic shared memory for `nk` keys and v's head dim `dv`, where the one-launch
/// attention runs: sm_90 or later (clusters), at most 1,024 keys (128 a block) and `dv` a
/// multiple of 128; `None` elsewhere (the two launches run). The layout is the kernel's: q's 32
/// rows, K's (or the f32 partial products, rows of `dv + 8`, whichever is larger), v's (rows
/// of 264 bf16), p, and the row statistics.
pub fn attention_cluster(nk: usize, dv: usize, cc: (i32, i32)) -> Option<u32> {
    if cc.0 < 9 || nk == 0 || nk > 1024 || !dv.is_multiple_of(128) || dv > 256 {
        return None;
    }
    let kc = attention_cluster_keys(nk);
    let row = (256 + 8) * 2;
    let bytes =
        32 * row + (kc * row).max(32 * (dv + 8) * 4) + kc * row + 64 * (kc + 8) + 1024 + 256 + 256;
    u32::try_from(bytes).ok()
}

/// Head dims the fused attention kernels take: q/k's a multiple of 16, v's of 32, both at most
/// 256 (a row of each in shared memory).
pub fn attention_dims_fit(d: usize, dv: usize) -> bool {
    d > 0 && d <= 256 && d.is_multiple_of(16) && dv > 0 && dv <= 256 && dv.is_multiple_of(32)
}

/// Strides the fused attention kernels read (rows 16 bytes at a time): q `[B, H, Q, D]`, kᵀ
/// `[B, H, D, K]` and v `[B, H, K, Dv]` with their head dims contiguous and every other
/// stride a multiple of 8 elements.
pub fn attention_strides_fit(q: &[i64], k: &[i64], v: &[i64]) -> bool {
    let eight = |xs: &[i64]| xs.iter().all(|x| x % 8 == 0);
    q.len() == 4
        && k.len() == 4
        && v.len() == 4
        && q[3] == 1
        && k[2] == 1
        && v[3] == 1
        && eight(&q[..3])
        && eight(&[k[0], k[1], k[3]])
        && eight(&v[..3])
}

#[cfg(test)]
mod tests {
    #[test]
    fn pointer_arrays_step_runs_then_batches_as_the_strided_form_does() {
        // SigLIP's logits GEMM: 16 heads a batch, 3 cameras as runs.
        let g = Gemm::linear(256, 72, 256)
            .unwrap()
            .batched(16, 72, 72, 256 * 256)
            .unwrap();
        let p = PtrParams::new(
            &g,
            [1000, 2000, 3000],
            [4, 4, 4],
            3,
            [884_736, 884_736, 16 * 65_536],
        );
        assert_eq!((p.batch, p.n), (16, 48));
        for run in 0..3i64 {
            for h in 0..16i64 {
                let want = [
                    1000 + 4 * (run * 884_736 + h * 72),
                    2000 + 4 * (run * 884_736 + h * 72),
                    3000 + 4 * (run * 16 * 65_536 + h * 65_536),
                ]
                .map(|x| x as u64);
                assert_eq!(p.at(run * 16 + h), want, "run {run}, head {h}");
            }
        }
        // bf16 operands, f32 result: byte steps follow each operand's element size.
        let q = PtrParams::new(&g, [0, 0, 0], [2, 2, 4], 2, [10, 20, 30]);
        assert_eq!(q.at(17), [20 + 2 * 72, 40 + 2 * 72, 120 + 4 * 65_536]);
    }

    use super::*;

    #[test]
    fn broadcast_strides_follow_numpy() {
        assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(
            broadcast_strides(&[3, 1], &[2, 3, 4]).unwrap(),
            vec![0, 1, 0]
        );
        assert_eq!(broadcast_strides(&[], &[2, 2]).unwrap(), vec![0, 0]);
        assert_eq!(broadcast_strides(&[1, 4], &[1, 4]).unwrap(), vec![0, 1]);
        assert!(broadcast_strides(&[3], &[4]).is_err());
        assert!(broadcast_strides(&[1, 2, 3], &[2, 3]).is_err());
    }

    #[test]
    fn ew_params_are_contiguous_only_without_broadcast_or_offset() {
        let d = [2, 3];
        let same = Operand::broadcast(Dtype::F32, &d, &d).unwrap();
        let row = Operand::broadcast(Dtype::F32, &[3], &d).unwrap();
        let out = Operand::broadcast(Dtype::Bf16, &d, &d).unwrap();
        let p = EwParams::new(
            EwOp::Binary(petite_graph::BinaryOp::Add),
            &d,
            &[same.clone(), same.clone()],
            &out,
        )
        .unwrap();
        assert_eq!((p.contig, p.n, p.rank, p.dout), (1, 6, 2, 1));
        let p = EwParams::new(
            EwOp::Binary(petite_graph::BinaryOp::Add),
            &d,
            &[same, row],
            &out,
        )
        .unwrap();
        assert_eq!((p.contig, p.sb[0], p.sb[1]), (0, 0, 1));
        let p = EwParams::new(EwOp::Copy, &[2; 9], std::slice::from_ref(&out), &out);
        assert!(p.is_err(), "rank 9 is refused, not truncated");
    }

    #[test]
    fn scalars_are_rounded_to_the_operand_dtype_first() {
        let d = [1];
        let o = Operand::broadcast(Dtype::Bf16, &d, &d).unwrap();
        let p = EwParams::new(
            EwOp::Binary(petite_graph::BinaryOp::Mul),
            &d,
            std::slice::from_ref(&o),
            &o,
        )
        .unwrap()
        .with_scalar(2048f64.sqrt(), false, Dtype::Bf16);
        assert_eq!(p.fs, 45.25, "lerobot's bf16 embed_scale");
        assert_eq!(p.scalar, 1);
    }

    #[test]
    fn param_blocks_have_the_c_layout() {
        // i64 n; 4 ints; 4 ints; 2 ints + float; (pad) i64; 5 arrays of 8 i64; 4 i64.
        assert_eq!(
            std::mem::size_of::<EwParams>(),
            8 + 16 + 16 + 12 + 4 + 8 + 5 * 64 + 32
        );
        assert_eq!(std::mem::offset_of!(EwParams, is), 56);
        assert_eq!(std::mem::offset_of!(EwParams, dims), 64);
        assert_eq!(std::mem::size_of::<NormParams>(), 56);
        assert_eq!(std::mem::offset_of!(SoftmaxParams, h), 40);
        assert_eq!(std::mem::size_of::<RopeParams>(), 24 + 3 * 64);
        // 6 i64; 4 ints, a float, 3 ints; 20 i64.
        assert_eq!(std::mem::offset_of!(AttnParams, qsb), 80);
        assert_eq!(std::mem::size_of::<AttnParams>(), 80 + 20 * 8);
    }

    #[test]
    fn fused_attention_groups_heads_sharing_kv_and_tiles_rows_and_keys() {
        // pi0.5's step: 8 query heads over one KV head (head stride 0), 50 queries, 1,018 keys.
        let (q, qs) = ([1, 8, 50, 256], [102_400, 256, 2_048, 1]);
        let (k, ks) = ([1, 8, 256, 1_018], [260_608, 0, 1, 256]);
        let (v, vs) = ([1, 8, 1_018, 256], [260_608, 0, 256, 1]);
        fn shape_of<'a>(
            (q, qs): (&'a [usize], &'a [i64]),
            k: &'a [usize],
            v: &'a [usize],
            ks: &'a [i64],
            vs: &'a [i64],
        ) -> AttnShape<'a> {
            AttnShape {
                q: (q, qs),
                k: (k, ks),
                v: (v, vs),
                mask: [8, 50, 0, 0, 1_018, 1],
                scale: Some((0.0625, Dtype::Bf16)),
                out: [102_400, 256, 2_048],
                n0: None,
            }
        }
        let shape = |ks, vs| shape_of((&q, &qs), &k, &v, ks, vs);
        let l = attention_launch(shape(&ks, &vs), (9, 0)).unwrap();
        let p = l.params;
        // One group of 400 rows: 25 tiles of 16; 32 splits of 32 keys; 8 blocks of 128.
        assert_eq!((p.shared, p.rpg, p.tiles, p.splits), (1, 400, 25, 32));
        assert_eq!((p.splits2, p.dv, l.tiles), (8, 256, 25));
        assert_eq!(
            (l.logits.grid_dim, l.pv.grid_dim),
            ((25, 32, 1), (25, 8, 1))
        );
        assert_eq!(
            (l.logits.block_dim.0, l.pv.block_dim.0, l.rows),
            (128, 256, 400)
        );
        assert_eq!((p.ksk, p.vsk, p.n0, p.nk), (256, 256, 1_018, 1_018));
        assert_eq!(
            (p.osh, p.osq, p.dscale),
            (256, 2_048, dtype_code(Dtype::Bf16))
        );
        // On sm_90 also as one launch: clusters of 8 blocks of 128 keys, 13 tiles of 32 rows,
        // 162,304 bytes of shared memory a block (under the H200's 227 KiB).
        let c = l.cluster.expect("one launch on sm_90");
        assert_eq!((c.grid_dim, c.block_dim.0), ((8, 13, 1), 512));
        assert_eq!(attention_cluster_keys(1_018), 128);
        assert_eq!(c.shared_mem_bytes, 162_304);
        assert!(c.shared_mem_bytes <= 227 << 10);
        assert_eq!(attention_cluster(1_024, 256, (9, 0)), Some(162_304));
        // Not before sm_90, past 1,024 keys, or with v's head dim not a multiple of 128.
        assert!(
            attention_launch(shape(&ks, &vs), (8, 7))
                .unwrap()
                .cluster
                .is_none()
        );
        assert_eq!(attention_cluster(1_025, 256, (9, 0)), None);
        assert_eq!(attention_cluster(1_018, 64, (9, 0)), None);
        // Few keys: 64 a block (the blocks past them hold none), and the partial products'
        // 32 rows of dv + 8 floats outgrow K's rows.
        assert_eq!(attention_cluster_keys(1), 64);
        assert_eq!(
            attention_cluster(1, 256, (9, 0)),
            Some(32 * 528 + 32 * 264 * 4 + 64 * 528 + 64 * 72 + 1_536)
        );
        // The step's K/V as the prefix's 968 keys and its own 50, read in place.
        let l = attention_launch(
            AttnShape {
                n0: Some(968),
                ..shape(&ks, &vs)
            },
            (9, 0),
        )
        .unwrap();
        assert_eq!(
            (l.params.n0, l.params.ksb, l.params.k1sb),
            (968, 247_808, 12_800)
        );
        assert_eq!(
            (l.params.ksh, l.params.vsk, l.params.v1sb),
            (0, 256, 12_800)
        );
        // Own KV heads: a group a head (8 groups of 50 rows: 4 tiles each).
        let l = attention_launch(
            shape(&[2_084_864, 260_608, 1, 256], &[2_084_864, 260_608, 256, 1]),
            (8, 7),
        )
        .unwrap();
        assert_eq!((l.params.shared, l.params.rpg, l.params.tiles), (0, 50, 4));
        assert_eq!(l.logits.grid_dim, (32, 32, 1));
        // No bf16 mma before sm_80; rows not 16 bytes apart and unpadded dims refused.
        assert!(attention_launch(shape(&ks, &vs), (7, 5)).is_err());
        assert!(attention_launch(shape(&[260_608, 0, 1, 260], &vs), (9, 0)).is_err());
        assert!(attention_launch(shape(&ks, &[260_608, 0, 252, 1]), (9, 0)).is_err());
        let q2 = [1, 8, 50, 24];
        let s = AttnShape {
            q: (&q2, &qs),
            ..shape(&ks, &vs)
        };
        assert!(attention_launch(s, (9, 0)).is_err());
    }

    #[test]
    fn linear_maps_row_major_to_cublas_column_major() {
        // y[5, 3] = x[5, 4] · w[3, 4]ᵀ → C[3×5] = wᵀ… with lda = ldb = 4, ldc = 3.
        let g = Gemm::linear(5, 4, 3).unwrap();
        assert_eq!(
            (g.trans_a, g.trans_b, g.m, g.n, g.k),
            (true, false, 3, 5, 4)
        );
        assert_eq!((g.lda, g.ldb, g.ldc), (4, 4, 3));
        let g = Gemm::matmul(5, 4, 3).unwrap();
        assert_eq!((g.m, g.n, g.k, g.lda, g.ldb, g.ldc), (3, 5, 4, 3, 4, 3));
        assert_eq!(g.flops(), 2.0 * 60.0);
    }

    #[test]
    fn flops_count_the_dense_ops_only() {
        let mut b = petite_graph::Builder::new();
        let x = b.input("x", Dtype::F32, &[3, 4]).unwrap();
        let w = b.weight("w", Dtype::F32, &[5, 4]).unwrap();
        let y = b.linear(x, w, None).unwrap();
        let z = b.exp(y).unwrap();
        b.output("z", z).unwrap();
        let p = b.finish().unwrap();
        assert_eq!(program_flops(&p), 2.0 * 3.0 * 5.0 * 4.0);
    }

    #[test]
    fn attention_batches_query_groups_over_kv_heads() {
        // pi0.5's prefix at full size: 8 query heads, 1 KV head, 968 tokens, head dim 256.
        let (l, pv) = attention_gemms(1, 8, 1, 968, 968, 256, 256).unwrap();
        assert_eq!((l.m, l.n, l.k, l.batch), (968, 8 * 968, 256, 1));
        assert_eq!((pv.m, pv.n, pv.k, pv.batch), (256, 8 * 968, 968, 1));
        let (l, _) = attention_gemms(2, 4, 2, 3, 5, 8, 8).unwrap();
        assert_eq!(
            (l.batch, l.stride_a, l.stride_b, l.stride_c),
            (4, 40, 48, 30)
        );
        assert!(attention_gemms(1, 3, 2, 1, 1, 1, 1).is_err());
    }

    #[test]
    fn attention_per_head_reads_split_heads_and_writes_merged_ones() {
        // SigLIP: 16 heads of 72 split out of [256, 1152] rows, written as [256, 16, 72].
        let split = HeadLayout { ld: 1152, head: 72 };
        let (l, pv) =
            attention_gemms_per_head(16, 16, 256, 256, 72, 72, [split, split, split, split])
                .unwrap()
                .unwrap();
        // logitsᵀ [K, Q] = k [K, D] · qᵀ, a head a batch, every leading dimension the row stride.
        assert!(l.trans_a && !l.trans_b);
        assert_eq!(
            (l.m, l.n, l.k, l.lda, l.ldb, l.ldc),
            (256, 256, 72, 1152, 1152, 256)
        );
        assert_eq!(
            (l.batch, l.stride_a, l.stride_b, l.stride_c),
            (16, 72, 72, 256 * 256)
        );
        assert!(!pv.trans_a && !pv.trans_b);
        assert_eq!(
            (pv.m, pv.n, pv.k, pv.lda, pv.ldb, pv.ldc),
            (72, 256, 256, 1152, 256, 1152)
        );
        assert_eq!(
            (pv.batch, pv.stride_a, pv.stride_b, pv.stride_c),
            (16, 72, 256 * 256, 72)
        );
        // One KV head shared by all: batch stride 0.
        let dense = |s: usize, d: usize| HeadLayout {
            ld: d as i64,
            head: (s * d) as i64,
        };
        let (l, pv) = attention_gemms_per_head(
            8,
            1,
            5,
            7,
            4,
            4,
            [
                dense(5, 4),
                dense(7, 4),
                dense(7, 4),
                HeadLayout { ld: 32, head: 4 },
            ],
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (l.stride_a, l.stride_b, pv.stride_a, pv.ldc, pv.stride_c),
            (0, 20, 0, 32, 4)
        );
        // Two KV heads for four query heads: no one stride reaches them.
        assert!(
            attention_gemms_per_head(4, 2, 5, 7, 4, 4, [dense(5, 4); 4])
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn tf32_attention_launches_take_siglips_shape_and_refuse_the_rest() {
        let h200 = 232_448;
        // SigLIP: 3 cameras × 16 heads × 256 queries and keys, head dim 72, q/k/v split from
        // [3, 256, 1152] rows in place; the output merged back to [3, 256, 16, 72].
        let s = [256 * 1152, 72, 1152];
        let (p, cfg) = tf32_attention_launch(
            [3, 16, 16, 256, 256, 72, 72],
            s,
            s,
            s,
            s,
            0.117_851_13,
            h200,
        )
        .unwrap();
        assert_eq!((p.tiles, p.d, p.dv, p.nk), (4, 72, 72, 256));
        assert_eq!(cfg.grid_dim, (3 * 16 * 4, 1, 1));
        // q's 64 rows, then K's and v's 256, each of 76 floats.
        assert_eq!(cfg.shared_mem_bytes, (64 + 2 * 256) * 76 * 4);
        // 100 queries: two tiles; KV heads shared by two query heads; one key: the partial
        // results (4 quarters × 64 rows of 12 floats, and their statistics) outgrow the staging.
        let (p, cfg) =
            tf32_attention_launch([1, 4, 2, 100, 1, 16, 8], s, s, s, s, 1.0, h200).unwrap();
        assert_eq!((p.tiles, p.kvh), (2, 2));
        assert_eq!(cfg.shared_mem_bytes, (64 * 20 + 512 + 256 * 12) * 4);
        for (dims, ks, max) in [
            ([3, 16, 16, 256, 256, 68, 72], s, h200),
            ([3, 16, 16, 256, 256, 72, 88], s, h200),
            ([3, 16, 16, 256, 257, 72, 72], s, h200),
            ([3, 16, 3, 256, 256, 72, 72], s, h200),
            ([3, 16, 16, 0, 256, 72, 72], s, h200),
            ([3, 16, 16, 256, 256, 72, 72], [256 * 1152, 72, 1150], h200),
            ([3, 16, 16, 256, 256, 72, 72], s, 100 << 10),
        ] {
            assert!(
                tf32_attention_launch(dims, s, ks, s, s, 1.0, max).is_none(),
                "{dims:?}"
            );
        }
        // q's rows are staged 16 bytes a copy too.
        let odd = [256 * 1152, 72, 1150];
        let siglip = [3, 16, 16, 256, 256, 72, 72];
        assert!(tf32_attention_launch(siglip, odd, s, s, s, 1.0, h200).is_none());
    }
}
