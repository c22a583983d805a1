//! `pt_attn_tf32`: the one-launch f32 attention without a mask whose products run as TF32.

use super::layout::{Layout, layout, with_checks};

/// `pt_attn_tf32`: f32 attention without a mask — SigLIP's, 256 queries and keys of head dim 72
/// a camera and head — where the program's f32 products run as TF32 (lerobot's compiled mode,
/// [`crate::F32Matmul::Tf32`]), in one launch instead of a logits GEMM, a softmax over f32
/// logits written to memory and read back, and a PV GEMM. A block takes 64 query rows of one
/// head with q, all of K (at most 256 keys) and all of v staged in shared memory (`cp.async`, v
/// arriving while the logits are computed); warp `4·rt + kq` takes rows `16·rt ..` against keys
/// `64·kq ..`: `s = (q·kᵀ)·scale` on the tensor cores (`mma.sync` m16n8k8 TF32, f32
/// accumulation), its rows' max and `exp(s - max)`, and `exp(s - max)·v` from the logits'
/// accumulator registers (keys permuted within each 8 on both operands); the four key quarters'
/// (max, exp-sum, product) are then combined in a fixed order, divided by the sum. Against the
/// unfused TF32 chain only the roundings of the probabilities (TF32 before, not after, the
/// division) and where the max is taken differ; no scratch, the same bits every run.
///
/// In pieces: the first ends with `TfAttnParams`, which [`text`] follows with its layout's
/// checks.
pub(super) const TF32_ATTN: [&str; 2] = [
    r#"
struct TfAttnParams {
  i64 qsb, qsh, qsq, ksb, ksh, ksk, vsb, vsh, vsk, osb, osh, osq;
  int h, kvh, nq, nk, d, dv, tiles; float scale;
};
"#,
    r#"#define TA_DMAX 80
__device__ __forceinline__ unsigned ta_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void ta_mma(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}
// `rows` rows of `cols` floats (a multiple of 4) from src (rows `st` apart; those from `valid`
// on zeros) into dst (rows cols + 4 apart: conflict-free fragment reads for cols a multiple of
// 8), 16 bytes a copy.
__device__ __forceinline__ void ta_rows(float* dst, const float* src, i64 st, int rows, int valid, int cols) {
  const int ch = cols / 4;
  for (int e = threadIdx.x; e < rows * ch; e += blockDim.x) {
    const int r = e / ch, x = e - r * ch;
    at_cp16(dst + r * (cols + 4) + x * 4, src + (i64)(r < valid ? r : 0) * st + x * 4, r < valid);
  }
}
// Grid (batches · heads · tiles of 64 rows), 512 threads; dynamic shared memory: q's 64 rows,
// K's and v's keys (rounded up to 64), then the four key quarters' partial results.
extern "C" __global__ __launch_bounds__(512) void pt_attn_tf32(TfAttnParams p, const float* q, const float* k,
    const float* v, float* out) {
  PT_PDL();
  extern __shared__ __align__(16) float ta_smem[];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int rt = w >> 2, kq = w & 3;
  const int tile = (int)blockIdx.x % p.tiles, bh = (int)blockIdx.x / p.tiles;
  const int b = bh / p.h, h = bh - b * p.h, kh = h / (p.h / p.kvh);
  const int dp = p.d + 4, vp = p.dv + 4, nkp = (p.nk + 63) / 64 * 64, q0 = tile * 64;
  float* qs = ta_smem;
  float* ks = qs + 64 * dp;
  float* vs = ks + nkp * dp;
  ta_rows(qs, q + b * p.qsb + h * p.qsh + (i64)q0 * p.qsq, p.qsq, 64, p.nq - q0, p.d);
  ta_rows(ks, k + b * p.ksb + kh * p.ksh, p.ksk, nkp, p.nk, p.d);
  at_cp_commit();
  ta_rows(vs, v + b * p.vsb + kh * p.vsh, p.vsk, nkp, p.nk, p.dv);
  at_cp_commit();
  at_cp_wait<1>();
  __syncthreads();
  // s[t][2i + e]: row 16·rt + g + 8i, key 64·kq + 8t + 2c + e.
  const int j0 = 64 * kq;
  const bool any = j0 < p.nk;
  float s[8][4];
#pragma unroll
  for (int t = 0; t < 8; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.0f;
  if (any) {
    const float* qa = qs + (16 * rt + g) * dp + c;
#pragma unroll
    for (int dd = 0; dd < TA_DMAX / 8; ++dd)
      if (dd * 8 < p.d) {
        const unsigned a0 = ta_tf32(qa[dd * 8]), a1 = ta_tf32(qa[8 * dp + dd * 8]);
        const unsigned a2 = ta_tf32(qa[dd * 8 + 4]), a3 = ta_tf32(qa[8 * dp + dd * 8 + 4]);
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          const float* kr = ks + (j0 + t * 8 + g) * dp + dd * 8 + c;
          ta_mma(s[t], a0, a1, a2, a3, ta_tf32(kr[0]), ta_tf32(kr[4]));
        }
      }
  }
  float m[2] = {-PT_INF, -PT_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
  for (int t = 0; t < 8; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = j0 + t * 8 + 2 * c + (e & 1);
      const float x = j < p.nk ? s[t][e] * p.scale : -PT_INF;
      s[t][e] = x;
      m[e >> 1] = fmaxf(m[e >> 1], x);
    }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    m[i] = fmaxf(m[i], __shfl_xor_sync(0xffffffffu, m[i], 1));
    m[i] = fmaxf(m[i], __shfl_xor_sync(0xffffffffu, m[i], 2));
  }
  float o[TA_DMAX / 8][4];
#pragma unroll
  for (int n = 0; n < TA_DMAX / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  at_cp_wait<0>();
  __syncthreads();
  if (any) {
#pragma unroll
    for (int t = 0; t < 8; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float x = s[t][e] == -PT_INF ? 0.0f : expf(s[t][e] - m[e >> 1]);
        s[t][e] = x;
        l[e >> 1] += x;
      }
      // Keys 8t + 2c and 8t + 2c + 1 stand for the fragment's depth slots c and c + 4.
      const unsigned a0 = ta_tf32(s[t][0]), a1 = ta_tf32(s[t][2]), a2 = ta_tf32(s[t][1]), a3 = ta_tf32(s[t][3]);
      const float* v0 = vs + (j0 + t * 8 + 2 * c) * vp + g;
#pragma unroll
      for (int n = 0; n < TA_DMAX / 8; ++n)
        if (n * 8 < p.dv) ta_mma(o[n], a0, a1, a2, a3, ta_tf32(v0[n * 8]), ta_tf32(v0[n * 8 + vp]));
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  // Each warp's rows: (max, exp-sum) and the product, in the K/v area.
  __syncthreads();
  float* ml = ks;
  float* op = ks + 2 * 64 * 4;
  if (c == 0)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = 16 * rt + g + 8 * i;
      ml[(r * 4 + kq) * 2] = m[i];
      ml[(r * 4 + kq) * 2 + 1] = l[i];
    }
#pragma unroll
  for (int n = 0; n < TA_DMAX / 8; ++n)
    if (n * 8 < p.dv)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float* dst = op + ((16 * rt + g + 8 * i) * 4 + kq) * vp + n * 8 + 2 * c;
        dst[0] = o[n][2 * i];
        dst[1] = o[n][2 * i + 1];
      }
  __syncthreads();
  float* ob = out + b * p.osb + h * p.osh;
  for (int e = threadIdx.x; e < 64 * p.dv; e += blockDim.x) {
    const int r = e / p.dv, x = e - r * p.dv;
    if (q0 + r >= p.nq) continue;
    const float* mr = ml + r * 8;
    const float mm = fmaxf(fmaxf(mr[0], mr[2]), fmaxf(mr[4], mr[6]));
    float sum = 0.0f, acc = 0.0f;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const float f = mr[2 * kk] == -PT_INF ? 0.0f : expf(mr[2 * kk] - mm);
      sum += mr[2 * kk + 1] * f;
      acc += op[(r * 4 + kk) * vp + x] * f;
    }
    ob[(i64)(q0 + r) * p.osq + x] = acc / sum;
  }
}
"#,
];

/// [`TF32_ATTN`] with `TfAttnParams`'s layout checks after its definition.
pub(super) fn text() -> String {
    with_checks(&TF32_ATTN, &[tf_attn_params()])
}

/// `pt_attn_tf32`'s block: its stride arrays are spelled as C fields, one a stride.
#[rustfmt::skip] // a table: the C struct's fields, in its order
pub(super) fn tf_attn_params() -> Layout {
    layout!(TfAttnParams {
        qs => [qsb, qsh, qsq], ks => [ksb, ksh, ksk], vs => [vsb, vsh, vsk],
        os => [osb, osh, osq], h, kvh, nq, nk, d, dv, tiles, scale
    })
}
