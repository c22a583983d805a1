//! Row kernels: the norms' statistics and formula (shared with the fused prologue norms),
//! `pt_norm` and `pt_softmax`.

use super::layout::{Layout, layout, with_checks};

/// The norms' row statistics and per-element formula: `pt_norm` and the fused kernels that
/// compute a norm as their prologue share them, so both give the same bits.
///
/// In pieces: the first ends with `NormParams`, which [`norm_funcs`] follows with its layout's
/// checks.
pub(super) const NORM_FUNCS: [&str; 2] = [
    r#"
struct NormParams { i64 rows; i64 d; int kind; int has_w; int has_b; int dx; int dw; int db; int dout; float eps; float offset; };
"#,
    r#"
// Row statistics, by the whole block: layer norm's f32 mean and 1/std (mean and biased variance
// summed in f64), or RMS norm's 1/rms (*a unused).
__device__ __forceinline__ void norm_stats(const NormParams& p, const void* x, i64 base, double* shd, float* a, float* r) {
  double s = 0.0;
  if (p.kind == 0) {
    for (i64 j = threadIdx.x; j < p.d; j += blockDim.x) s += (double)ldf(x, base + j, p.dx);
    double mean = block_sum_d(s, shd) / (double)p.d;
    double v = 0.0;
    for (i64 j = threadIdx.x; j < p.d; j += blockDim.x) { double c = (double)ldf(x, base + j, p.dx) - mean; v += c * c; }
    double var = block_sum_d(v, shd) / (double)p.d;
    *a = (float)mean;
    *r = 1.0f / sqrtf((float)var + p.eps);
  } else {
    for (i64 j = threadIdx.x; j < p.d; j += blockDim.x) { double v = (double)ldf(x, base + j, p.dx); s += v * v; }
    float ms = (float)(block_sum_d(s, shd) / (double)p.d);
    *a = 0.0f;
    *r = 1.0f / sqrtf(ms + p.eps);
  }
}

// `norm_stats` for an input of dtype DT and a norm of kind KIND (0 layer, 1 RMS) known when
// the kernel is generated, with four loads issued before their adds (`fuse::rows_unrolled`):
// each thread adds the same values in the same order, so the same bits.
template <int DT, int KIND> __device__ __forceinline__ void norm_stats4(const NormParams& p, const void* x, i64 base, double* shd, float* a, float* r) {
  const i64 bd = blockDim.x;
  double s = 0.0;
  i64 j = threadIdx.x;
  if (KIND == 0) {
    for (; j + 3 * bd < p.d; j += 4 * bd) {
      const float x0 = ldf(x, base + j, DT), x1 = ldf(x, base + j + bd, DT);
      const float x2 = ldf(x, base + j + 2 * bd, DT), x3 = ldf(x, base + j + 3 * bd, DT);
      s += (double)x0; s += (double)x1; s += (double)x2; s += (double)x3;
    }
    for (; j < p.d; j += bd) s += (double)ldf(x, base + j, DT);
    double mean = block_sum_d(s, shd) / (double)p.d;
    double v = 0.0;
    j = threadIdx.x;
    for (; j + 3 * bd < p.d; j += 4 * bd) {
      const float x0 = ldf(x, base + j, DT), x1 = ldf(x, base + j + bd, DT);
      const float x2 = ldf(x, base + j + 2 * bd, DT), x3 = ldf(x, base + j + 3 * bd, DT);
      double c = (double)x0 - mean; v += c * c;
      c = (double)x1 - mean; v += c * c;
      c = (double)x2 - mean; v += c * c;
      c = (double)x3 - mean; v += c * c;
    }
    for (; j < p.d; j += bd) { double c = (double)ldf(x, base + j, DT) - mean; v += c * c; }
    double var = block_sum_d(v, shd) / (double)p.d;
    *a = (float)mean;
    *r = 1.0f / sqrtf((float)var + p.eps);
  } else {
    for (; j + 3 * bd < p.d; j += 4 * bd) {
      const float x0 = ldf(x, base + j, DT), x1 = ldf(x, base + j + bd, DT);
      const float x2 = ldf(x, base + j + 2 * bd, DT), x3 = ldf(x, base + j + 3 * bd, DT);
      double v = (double)x0; s += v * v;
      v = (double)x1; s += v * v;
      v = (double)x2; s += v * v;
      v = (double)x3; s += v * v;
    }
    for (; j < p.d; j += bd) { double v = (double)ldf(x, base + j, DT); s += v * v; }
    float ms = (float)(block_sum_d(s, shd) / (double)p.d);
    *a = 0.0f;
    *r = 1.0f / sqrtf(ms + p.eps);
  }
}

// `norm_elem` for dtypes and a kind known when the kernel is generated (DW, DB: -1 where the
// norm has no weight or bias): the same operations, without the switches between a load and
// its use (`fuse::rows_unrolled`).
template <int DX, int KIND, int DW, int DB> __device__ __forceinline__ float norm_elem4(const NormParams& p, const void* x, const void* w, const void* b, i64 base, i64 j, float a, float r) {
  float y;
  if (KIND == 0) {
    y = (ldf(x, base + j, DX) - a) * r;
    if (DW >= 0) y *= ldf(w, j, DW);
    if (DB >= 0) y += ldf(b, j, DB);
  } else {
    y = ldf(x, base + j, DX) * r;
    if (DW >= 0) y = y * (p.offset + ldf(w, j, DW));
  }
  return y;
}

// Element j of the row at `base`, in f32, before it is stored in the norm's dtype.
__device__ __forceinline__ float norm_elem(const NormParams& p, const void* x, const void* w, const void* b, i64 base, i64 j, float a, float r) {
  float y;
  if (p.kind == 0) {
    y = (ldf(x, base + j, p.dx) - a) * r;
    if (p.has_w) y *= ldf(w, j, p.dw);
    if (p.has_b) y += ldf(b, j, p.db);
  } else {
    y = ldf(x, base + j, p.dx) * r;
    if (p.has_w) y = y * (p.offset + ldf(w, j, p.dw));
  }
  return y;
}
"#,
];

/// In pieces: the first ends with `SoftmaxParams`, which [`rows`] follows with its layout's
/// checks.
pub(super) const ROWS: [&str; 2] = [
    r#"
// One block a row: layer norm (kind 0, mean and biased variance in f64) or RMS norm (kind 1).
extern "C" __global__ void pt_norm(NormParams p, const void* x, const void* w, const void* b, void* out) {
  PT_PDL();
  __shared__ double shd[32];
  i64 row = blockIdx.x;
  if (row >= p.rows) return;
  const i64 base = row * p.d;
  float a, r;
  norm_stats(p, x, base, shd, &a, &r);
  for (i64 j = threadIdx.x; j < p.d; j += blockDim.x) stf(out, base + j, p.dout, norm_elem(p, x, w, b, base, j, a, r));
}

struct SoftmaxParams {
  i64 rows; i64 n; int dx; int dout; int has_mask; int dm; float scale; int dscale;
  i64 h; i64 q; i64 msb; i64 msh; i64 msq; i64 msk;
};
"#,
    r#"
// Softmax input j of a row: x·scale (rounded to dscale when a 16-bit scaling was folded in),
// plus the mask.
__device__ __forceinline__ float sm_in(const SoftmaxParams& p, const void* x, const void* mask, i64 base, i64 mbase, i64 j) {
  float v = ldf(x, base + j, p.dx) * p.scale;
  if (p.dscale == DT_BF16) v = bf2f(f2bf(v));
  else if (p.dscale == DT_F16) v = h2f(f2h(v));
  if (p.has_mask) v += ldf(mask, mbase + j * p.msk, p.dm);
  return v;
}

// Longest row `pt_softmax` keeps in shared memory (16 KiB a block).
#define SM_HELD 4096

// One block a row of n: y = softmax(x·scale + mask) in f32, max-subtracted. Row r is
// ((b·H + h)·Q + q) when a mask is given (its strides broadcast it over [B, H, Q, K]).
extern "C" __global__ void pt_softmax(SoftmaxParams p, const void* x, const void* mask, void* out) {
  PT_PDL();
  __shared__ float shf[32];
  i64 row = blockIdx.x;
  if (row >= p.rows) return;
  const i64 base = row * p.n;
  i64 mbase = 0;
  if (p.has_mask) {
    i64 qi = row % p.q; i64 t = row / p.q; i64 hi = t % p.h; i64 bi = t / p.h;
    mbase = bi * p.msb + hi * p.msh + qi * p.msq;
  }
  float m = -PT_INF;
  if (p.n <= SM_HELD) {
    // The row kept in shared memory: read once, exp'd once (registers would need the loops
    // unrolled, and with the dtype switches inlined that made the module 5x larger and 10x
    // slower to compile). Each thread visits its own elements in the order the loops below do,
    // so the max, the sum and every output are the same bits.
    __shared__ float held[SM_HELD];
    for (i64 j = threadIdx.x; j < p.n; j += blockDim.x) {
      float v = sm_in(p, x, mask, base, mbase, j);
      held[j] = v;
      m = fmaxf(m, v);
    }
    m = block_max_f(m, shf);
    float s = 0.0f;
    for (i64 j = threadIdx.x; j < p.n; j += blockDim.x) {
      float e = expf(held[j] - m);
      held[j] = e;
      s += e;
    }
    s = block_sum_f(s, shf);
    for (i64 j = threadIdx.x; j < p.n; j += blockDim.x) stf(out, base + j, p.dout, held[j] / s);
    return;
  }
  for (i64 j = threadIdx.x; j < p.n; j += blockDim.x) {
    float v = sm_in(p, x, mask, base, mbase, j);
    m = fmaxf(m, v);
  }
  m = block_max_f(m, shf);
  float s = 0.0f;
  for (i64 j = threadIdx.x; j < p.n; j += blockDim.x) {
    float v = sm_in(p, x, mask, base, mbase, j);
    s += expf(v - m);
  }
  s = block_sum_f(s, shf);
  for (i64 j = threadIdx.x; j < p.n; j += blockDim.x) {
    float v = sm_in(p, x, mask, base, mbase, j);
    stf(out, base + j, p.dout, expf(v - m) / s);
  }
}
"#,
];

/// [`NORM_FUNCS`] with `NormParams`'s layout checks after its definition.
pub(super) fn norm_funcs() -> String {
    with_checks(&NORM_FUNCS, &[norm_params()])
}

/// [`ROWS`] with `SoftmaxParams`'s layout checks after its definition.
pub(super) fn rows() -> String {
    with_checks(&ROWS, &[softmax_params()])
}

/// `pt_norm`'s block (and a fused prologue norm's).
#[rustfmt::skip] // a table: the C struct's fields, in its order
pub(super) fn norm_params() -> Layout {
    layout!(NormParams {
        rows, d, kind, has_w, has_b, dx, dw, db, dout, eps, offset
    })
}

/// `pt_softmax`'s block.
#[rustfmt::skip] // a table: the C struct's fields, in its order
pub(super) fn softmax_params() -> Layout {
    layout!(SoftmaxParams {
        rows, n, dx, dout, has_mask, dm, scale, dscale, h, q, msb, msh, msq, msk
    })
}
