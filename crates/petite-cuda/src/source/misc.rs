//! The fixed module's other kernels: RoPE, row gather, cumsum, reductions, im2col, a
//! pointer-batched GEMM's pointer arrays, and the bias pass after a GEMM.

use super::layout::{Layout, layout, with_checks};

/// In pieces, each but the last ending with a parameter block's definition (`RopeParams`,
/// `ConvParams`, `PtrParams`), which [`text`] follows with its layout's checks.
pub(super) const MISC: [&str; 4] = [
    r#"
struct RopeParams { i64 n; i64 d; int rank; int dt; i64 dims[MAXR]; i64 sc[MAXR]; i64 ss[MAXR]; };
"#,
    r#"
// y = x·cos + rotate_half(x)·sin, rotate_half(x) = cat(−x[..., D/2:], x[..., :D/2]).
extern "C" __global__ void pt_rope(RopeParams p, const void* x, const void* cs, const void* sn, void* out) {
  PT_PDL();
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += (i64)gridDim.x * blockDim.x) {
    i64 ic = 0, is = 0, j;
    if (p.n < PT_U32_MAX) {
      unsigned r = (unsigned)i;
      for (int d = p.rank - 1; d >= 0; --d) { unsigned k = r % (unsigned)p.dims[d]; r /= (unsigned)p.dims[d]; ic += k * p.sc[d]; is += k * p.ss[d]; }
      j = (unsigned)i % (unsigned)p.d;
    } else {
      i64 r = i;
      for (int d = p.rank - 1; d >= 0; --d) { i64 k = r % p.dims[d]; r /= p.dims[d]; ic += k * p.sc[d]; is += k * p.ss[d]; }
      j = i % p.d;
    }
    i64 half = p.d / 2;
    float rot = j < half ? -ldf(x, i + half, p.dt) : ldf(x, i - half, p.dt);
    stf(out, i, p.dt, ldf(x, i, p.dt) * ldf(cs, ic, p.dt) + rot * ldf(sn, is, p.dt));
  }
}

// Row gather: out[r, :] = table[idx[r], :], element size es bytes; an index outside [0, V)
// sets *err to its position + 1 and writes zeros.
extern "C" __global__ void pt_gather(i64 nidx, i64 v, i64 rowbytes, int di, const void* idx, const unsigned char* table, unsigned char* out, i64* err) {
  PT_PDL();
  i64 total = nidx * rowbytes;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    i64 r = i / rowbytes, c = i % rowbytes;
    i64 k = ldi(idx, r, di);
    if (k < 0 || k >= v) { out[i] = 0; atomicCAS((unsigned long long*)err, 0ull, (unsigned long long)(r + 1)); }
    else out[i] = table[k * rowbytes + c];
  }
}

// Inclusive scan along the middle axis of [outer, n, inner]: one thread a line (f64 / wrapping i64).
extern "C" __global__ void pt_cumsum(i64 outer, i64 n, i64 inner, int dt, const void* x, void* out) {
  PT_PDL();
  i64 line = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (line >= outer * inner) return;
  i64 o = line / inner, in = line % inner;
  i64 base = o * n * inner + in;
  if (isflt(dt)) {
    double acc = 0.0;
    for (i64 k = 0; k < n; ++k) { acc += (double)ldf(x, base + k * inner, dt); stf(out, base + k * inner, dt, (float)acc); }
  } else {
    u64 acc = 0;
    for (i64 k = 0; k < n; ++k) { acc += (u64)ldi(x, base + k * inner, dt); sti(out, base + k * inner, dt, (i64)acc); }
  }
}

// Integer inclusive cumsum, one block a line of n (stride `inner`): each thread sums its run
// of the line, the runs' totals are scanned, then each thread writes its run. Wrapping u64
// sums are exact in any order, so the result is the serial one's.
extern "C" __global__ void pt_cumsum_i(i64 lines, i64 n, i64 inner, int dt, const void* x, void* out) {
  PT_PDL();
  __shared__ u64 sh[1024];
  i64 line = blockIdx.x;
  if (line >= lines) return;
  i64 o = line / inner, in = line % inner;
  i64 base = o * n * inner + in;
  i64 per = (n + blockDim.x - 1) / blockDim.x;
  i64 lo = (i64)threadIdx.x * per, hi = lo + per < n ? lo + per : n;
  u64 acc = 0;
  for (i64 k = lo; k < hi; ++k) acc += (u64)ldi(x, base + k * inner, dt);
  sh[threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    u64 run = 0;
    for (unsigned t = 0; t < blockDim.x; ++t) { u64 v = sh[t]; sh[t] = run; run += v; }
  }
  __syncthreads();
  acc = sh[threadIdx.x];
  for (i64 k = lo; k < hi; ++k) { acc += (u64)ldi(x, base + k * inner, dt); sti(out, base + k * inner, dt, (i64)acc); }
}

// Reduction of each contiguous row of n: kind 0 sum, 1 mean (f64), 2 max (NaN wins).
extern "C" __global__ void pt_reduce(i64 rows, i64 n, int kind, int dt, const void* x, void* out) {
  PT_PDL();
  __shared__ double shd[32];
  __shared__ float shf[32];
  i64 row = blockIdx.x;
  if (row >= rows) return;
  if (isflt(dt)) {
    if (kind == 2) {
      float m = -PT_INF; bool nan = false;
      for (i64 j = threadIdx.x; j < n; j += blockDim.x) { float v = ldf(x, row * n + j, dt); if (v != v) nan = true; m = fmaxf(m, v); }
      float t = block_max_f(nan ? PT_INF : m, shf);
      __syncthreads();
      float anynan = block_sum_f(nan ? 1.0f : 0.0f, shf);
      if (threadIdx.x == 0) stf(out, row, dt, anynan > 0.0f ? __int_as_float(0x7fc00000) : t);
      (void)t;
    } else {
      double s = 0.0;
      for (i64 j = threadIdx.x; j < n; j += blockDim.x) s += (double)ldf(x, row * n + j, dt);
      s = block_sum_d(s, shd);
      if (threadIdx.x == 0) stf(out, row, dt, (float)(kind == 1 ? s / (double)n : s));
    }
  } else {
    // Wrapping sums and maxima are exact in any order: the whole block takes part.
    __shared__ u64 shs[32];
    __shared__ i64 shm[32];
    u64 s = 0; i64 m = (i64)0x8000000000000000ULL;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) { i64 v = ldi(x, row * n + j, dt); s += (u64)v; if (v > m) m = v; }
    for (int o = 16; o > 0; o >>= 1) {
      s += __shfl_xor_sync(0xffffffffu, s, o);
      i64 t = __shfl_xor_sync(0xffffffffu, m, o);
      if (t > m) m = t;
    }
    if ((threadIdx.x & 31) == 0) { shs[threadIdx.x >> 5] = s; shm[threadIdx.x >> 5] = m; }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int k = 1; k < (int)(blockDim.x >> 5); ++k) { s += shs[k]; if (shm[k] > m) m = shm[k]; }
      sti(out, row, dt, kind == 2 ? m : (i64)s);
    }
  }
}

struct ConvParams { i64 n; i64 c; i64 h; i64 w; i64 kh; i64 kw; i64 oh; i64 ow; i64 sh; i64 sw; i64 ph; i64 pw; int dt; };
"#,
    r#"
// cols[(n·OH + y)·OW + x, (c·KH + i)·KW + j] = x[n, c, y·sh + i − ph, x·sw + j − pw] (0 outside).
extern "C" __global__ void pt_im2col(ConvParams p, const void* x, void* cols) {
  PT_PDL();
  i64 k = p.c * p.kh * p.kw;
  i64 total = p.n * p.oh * p.ow * k;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    i64 col = i % k, r = i / k;
    i64 ox = r % p.ow, t = r / p.ow, oy = t % p.oh, ni = t / p.oh;
    i64 j = col % p.kw, t2 = col / p.kw, ii = t2 % p.kh, ci = t2 / p.kh;
    i64 y = oy * p.sh + ii - p.ph, xx = ox * p.sw + j - p.pw;
    float v = 0.0f;
    if (y >= 0 && y < p.h && xx >= 0 && xx < p.w) v = ldf(x, ((ni * p.c + ci) * p.h + y) * p.w + xx, p.dt);
    stf(cols, i, p.dt, v);
  }
}

// A pointer-batched GEMM's A, B and C arrays: for operand t and problem i < n,
// out[t·n + i] = base[t] + (i / batch)·outer[t] + (i % batch)·inner[t] (bytes).
struct PtrParams { u64 base[3]; i64 outer[3]; i64 inner[3]; i64 batch; i64 n; };
"#,
    r#"extern "C" __global__ void pt_ptrs(PtrParams p, u64* out) {
  PT_PDL();
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += (i64)gridDim.x * blockDim.x) {
    const i64 l = i / p.batch, j = i % p.batch;
    for (int t = 0; t < 3; ++t) out[t * p.n + i] = p.base[t] + (u64)(l * p.outer[t] + j * p.inner[t]);
  }
}

// out[r, c] = acc[r, c] (f32) + bias[c], rounded once to the output dtype.
extern "C" __global__ void pt_bias(i64 rows, i64 n, int has_bias, int db, int dout, const float* acc, const void* bias, void* out) {
  PT_PDL();
  i64 total = rows * n;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    float v = acc[i];
    if (has_bias) v += ldf(bias, i % n, db);
    stf(out, i, dout, v);
  }
}

// An FP8 E4M3 ("fn") code as f32, exact: subnormals m·2^-9, normals (1 + m/8)·2^(e-7) built
// from their bits, 0x7f/0xff NaN (petite_dtype::quant's decoding).
__device__ __forceinline__ float pt_f8e4m3(unsigned b) {
  unsigned e = (b >> 3) & 15u, m = b & 7u;
  float mag = (e == 15u && m == 7u) ? __int_as_float(0x7fc00000)
            : e == 0u ? (float)m * 0.001953125f
            : __uint_as_float(((e + 120u) << 23) | (m << 20));
  return (b & 0x80u) ? -mag : mag;
}
__device__ __forceinline__ float pt_code(unsigned b, int dc) {
  return dc == DT_I8 ? (float)(signed char)(unsigned char)b : pt_f8e4m3(b);
}
// code · scale in f32. A NaN code stays its own NaN (sign and payload): the CPU's multiply keeps
// its NaN operand's bits, the GPU's would give the canonical 0x7fffffff.
__device__ __forceinline__ float pt_deq(unsigned b, int dc, float s) {
  const float c = pt_code(b, dc);
  return c != c ? c : c * s;
}

// A quantized weight back in its dtype: out[r, c] = code(codes[r, c]) · scale[r] in f32,
// rounded once to the output dtype (int8 codes as two's complement, fp8 as E4M3). With `vec`
// (rows of a multiple of eight codes, codes 8- and out 16-byte aligned, as every pi0.5 weight's
// are), eight codes a thread: one 8-byte load, one 16-byte store of bf16.
extern "C" __global__ void pt_dequant(i64 rows, i64 per, int dc, int dout, int vec, const unsigned char* codes, const float* scale, void* out) {
  PT_PDL();
  const i64 total = rows * per;
  const i64 step = (i64)gridDim.x * blockDim.x;
  if (vec) {
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g * 8 < total; g += step) {
      const i64 i = g * 8;
      const float s = scale[i / per];
      const uint2 w = *(const uint2*)(codes + i);
      float v[8];
      for (int k = 0; k < 4; ++k) {
        v[k] = pt_deq((w.x >> (8 * k)) & 255u, dc, s);
        v[k + 4] = pt_deq((w.y >> (8 * k)) & 255u, dc, s);
      }
      if (dout == DT_BF16) {
        unsigned h[4];
        for (int k = 0; k < 4; ++k) h[k] = (unsigned)f2bf(v[2 * k]) | ((unsigned)f2bf(v[2 * k + 1]) << 16);
        *(uint4*)((unsigned short*)out + i) = make_uint4(h[0], h[1], h[2], h[3]);
      } else {
        for (int k = 0; k < 8; ++k) stf(out, i + k, dout, v[k]);
      }
    }
    return;
  }
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += step) {
    stf(out, i, dout, pt_deq(codes[i], dc, scale[i / per]));
  }
}

// y = x · dequant(W)ᵀ for at most 64 rows of bf16 x (pi0.5's steps: 50), the weight's codes
// read directly. A block dequantizes a [128 features × 32] tile of codes into shared memory as
// bf16 (code · scale rounded once: pt_dequant's bits) beside x's [64 rows × 32] tile, and its
// eight warps multiply them on the tensor cores, 16 features a warp. Block (bx, s) covers
// features bx·128.. and columns s·kc.. of K (kc a multiple of 32, as k is), and writes its f32
// sums to part[s] (no atomics: pt_wq_sum adds the splits in order, so runs repeat bit for bit).
extern "C" __global__ __launch_bounds__(256) void pt_wq_gemm(i64 m, i64 n, i64 k, i64 kc, int dc, const unsigned short* x, const unsigned char* codes, const float* scale, float* part) {
  PT_PDL();
  __shared__ __align__(16) unsigned short xs[64][40];
  __shared__ __align__(16) unsigned short ws[128][40];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int g = lane >> 2, q = lane & 3;
  const i64 n0 = (i64)blockIdx.x * 128;
  const i64 k_begin = (i64)blockIdx.y * kc;
  const i64 k_end = k_begin + kc < k ? k_begin + kc : k;
  const int mt = (int)((m + 15) / 16);
  float acc[4][2][4];
#pragma unroll
  for (int a = 0; a < 4; ++a)
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[a][b][c] = 0.0f;
  // This thread's loads: x's row t/4, eight columns from (t%4)·8; codes' row t/2, sixteen
  // columns from (t%2)·16.
  const int xr = t >> 2, xc = (t & 3) * 8;
  const int wr = t >> 1, wc = (t & 1) * 16;
  const i64 wn = n0 + wr;
  const float sc = wn < n ? scale[wn] : 0.0f;
  for (i64 k0 = k_begin; k0 < k_end; k0 += 32) {
    uint4 xv = make_uint4(0u, 0u, 0u, 0u);
    if (xr < m) xv = *(const uint4*)(x + xr * k + k0 + xc);
    *(uint4*)&xs[xr][xc] = xv;
    uint4 cv = make_uint4(0u, 0u, 0u, 0u);
    if (wn < n) cv = *(const uint4*)(codes + wn * k + k0 + wc);
    const unsigned words[4] = {cv.x, cv.y, cv.z, cv.w};
    unsigned h[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned w = words[j];
      h[2 * j] = (unsigned)f2bf(pt_deq(w & 255u, dc, sc)) | ((unsigned)f2bf(pt_deq((w >> 8) & 255u, dc, sc)) << 16);
      h[2 * j + 1] = (unsigned)f2bf(pt_deq((w >> 16) & 255u, dc, sc)) | ((unsigned)f2bf(pt_deq(w >> 24, dc, sc)) << 16);
    }
    *(uint4*)&ws[wr][wc] = make_uint4(h[0], h[1], h[2], h[3]);
    *(uint4*)&ws[wr][wc + 8] = make_uint4(h[4], h[5], h[6], h[7]);
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < 32; ks += 16) {
      unsigned b[2][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = warp * 16 + nt * 8 + g;
        b[nt][0] = *(const unsigned*)&ws[col][ks + 2 * q];
        b[nt][1] = *(const unsigned*)&ws[col][ks + 2 * q + 8];
      }
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        if (a < mt) {
          const int r = a * 16 + g;
          const unsigned a0 = *(const unsigned*)&xs[r][ks + 2 * q];
          const unsigned a1 = *(const unsigned*)&xs[r + 8][ks + 2 * q];
          const unsigned a2 = *(const unsigned*)&xs[r][ks + 2 * q + 8];
          const unsigned a3 = *(const unsigned*)&xs[r + 8][ks + 2 * q + 8];
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) at_mma(acc[a][nt], a0, a1, a2, a3, b[nt][0], b[nt][1]);
        }
      }
    }
    __syncthreads();
  }
  float* out = part + (i64)blockIdx.y * m * n;
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    if (a < mt) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const i64 col = n0 + warp * 16 + nt * 8 + 2 * q;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const i64 row = a * 16 + g + hh * 8;
          if (row < m && col < n) out[row * n + col] = acc[a][nt][2 * hh];
          if (row < m && col + 1 < n) out[row * n + col + 1] = acc[a][nt][2 * hh + 1];
        }
      }
    }
  }
}

// pt_wq_gemm's splits added in order (+ bias[c]), rounded once to the output dtype.
extern "C" __global__ void pt_wq_sum(i64 m, i64 n, i64 splits, int has_bias, int db, int dout, const float* part, const void* bias, void* out) {
  PT_PDL();
  const i64 total = m * n;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
    float v = 0.0f;
    for (i64 s = 0; s < splits; ++s) v += part[s * total + i];
    if (has_bias) v += ldf(bias, i % n, db);
    stf(out, i, dout, v);
  }
}
"#,
];

/// [`MISC`] with each parameter block's layout checks after its definition.
pub(super) fn text() -> String {
    with_checks(&MISC, &[rope_params(), conv_params(), ptr_params()])
}

/// `pt_rope`'s block.
#[rustfmt::skip] // a table: the C struct's fields, in its order
pub(super) fn rope_params() -> Layout {
    layout!(RopeParams {
        n, d, rank, dt, dims, sc, ss
    })
}

/// `pt_im2col`'s block.
#[rustfmt::skip] // a table: the C struct's fields, in its order
pub(super) fn conv_params() -> Layout {
    layout!(ConvParams {
        n, c, h, w, kh, kw, oh, ow, sh, sw, ph, pw, dt
    })
}

/// `pt_ptrs`'s block.
#[rustfmt::skip] // a table: the C struct's fields, in its order
pub(super) fn ptr_params() -> Layout {
    layout!(PtrParams {
        base, outer, inner, batch, n
    })
}
