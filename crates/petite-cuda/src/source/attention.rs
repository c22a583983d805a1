//! The fused bf16 attention kernels (`pt_attn_logits`, `pt_attn_pv`, `pt_attn_cl`), compiled as
//! their own module ([`super::attention_module_source`]).

use super::layout::{Layout, layout, with_checks};

/// bf16 attention as transformers' eager op order computes it — `l = bf16(q·kᵀ)`,
/// `s = round(l·scale)`, `f = s + mask` in f32, `p = bf16(softmax(f))`, `out = bf16(p·v)` — in
/// two launches instead of a logits GEMM, a softmax and a PV GEMM ([`crate::fuse::Attend`]).
/// Both products run on the tensor cores (`mma.sync` m16n8k16, f32 accumulation); only the
/// summation order of each dot product differs from cuBLAS's. `pt_attn_logits` writes `f` and
/// each 64-key split's row max and exp-sum; `pt_attn_pv` combines the splits' statistics in a
/// fixed order (so every run gives the same bits), forms `p` exactly as `pt_softmax` does
/// (`exp(f - max) / sum`, rounded to bf16) and multiplies by v. K and v may come in two pieces
/// along the keys (a concat of the prefix's K/V and the step's own, read in place).
///
/// In pieces: the first ends with `AttnParams`, which [`text`] follows with its layout's checks.
pub(super) const ATTN: [&str; 2] = [
    r#"
struct AttnParams {
  i64 nk; i64 n0; i64 rpg; i64 tiles; i64 h; i64 q;
  int shared; int d; int splits; int dscale; float scale; int has_mask; int dv; int splits2;
  i64 qsb, qsh, qsq;
  i64 ksb, ksh, ksk, k1sb, k1sh;
  i64 vsb, vsh, vsk, v1sb, v1sh;
  i64 msb, msh, msq, msk;
  i64 osb, osh, osq;
};
"#,
    r#"// Keys a pt_attn_logits block covers (AT_KS / 4 a warp: AT_NT n-tiles of 8; small blocks, many
// of them: more warps a scheduler to hide each one's latency); keys a pt_attn_pv block covers, and
// the part of them each of its two v buffers holds; the longest head dims; shared-memory row
// padding (keeps the fragment loads free of bank conflicts). Every global read is issued
// before any is waited for (cp.async), and indices are 32-bit (the plan checks that every
// offset fits): these kernels are latency-bound, few warps a scheduler.
#define AT_KS 32
#define AT_NT (AT_KS / 32)
#define AT_KS2 128
#define AT_VC 32
#define AT_DMAX 256
#define AT_PAD 8

// Row r of group gi: its batch, head and query.
__device__ __forceinline__ void at_row(const AttnParams& p, int gi, int r, int& b, int& h, int& qi) {
  if (p.shared) { b = gi; h = r / (int)p.q; qi = r - h * (int)p.q; }
  else { b = gi / (int)p.h; h = gi - b * (int)p.h; qi = r; }
}
// Row j of K (or of v) for batch b, head h: in the first piece below n0, else in the second.
__device__ __forceinline__ const unsigned short* at_key(const AttnParams& p, const void* k0, const void* k1,
    int b, int h, int j, bool v) {
  int sb = (int)(v ? p.vsb : p.ksb), sh = (int)(v ? p.vsh : p.ksh), sk = (int)(v ? p.vsk : p.ksk);
  if (j < (int)p.n0) return (const unsigned short*)k0 + (b * sb + h * sh + j * sk);
  int sb1 = (int)(v ? p.v1sb : p.k1sb), sh1 = (int)(v ? p.v1sh : p.k1sh);
  return (const unsigned short*)k1 + (b * sb1 + h * sh1 + (j - (int)p.n0) * sk);
}
__device__ __forceinline__ unsigned at_u32(const unsigned short* s) { return *(const unsigned*)s; }
// Stages rows j0 .. j0 + rows of K (or of v: all dv columns) into buf, 16 bytes a copy, and
// commits them as one group. Thread t copies column chunk t % ch of every (blockDim / ch)-th
// row when ch (chunks a row) divides the block (no division a copy), else any chunk.
__device__ __forceinline__ void at_stage(const AttnParams& p, const void* k0, const void* k1, int b0, int h0,
    int j0, int rows, unsigned short (*buf)[AT_DMAX + AT_PAD], bool v) {
  const int ch = (v ? p.dv : p.d) / 8, nt = blockDim.x, nk = (int)p.nk, n0 = (int)p.n0;
  const int sk = (int)(v ? p.vsk : p.ksk);
  // Row j is base0 + j·sk below n0, else base1 + j·sk (the second piece's rows from n0).
  const unsigned short* base0 = at_key(p, k0, k1, b0, h0, 0, v);
  const unsigned short* base1 = n0 < nk ? at_key(p, k0, k1, b0, h0, n0, v) - n0 * sk : base0;
  if (nt % ch == 0) {
    const int x = threadIdx.x % ch, step = nt / ch;
    for (int r = threadIdx.x / ch; r < rows; r += step) {
      int j = j0 + r < nk ? j0 + r : nk - 1;
      at_cp16(&buf[r][x * 8], (j < n0 ? base0 : base1) + (j * sk + x * 8), j0 + r < nk);
    }
  } else {
    for (int e = threadIdx.x; e < rows * ch; e += nt) {
      int r = e / ch, x = e - r * ch, j = j0 + r < nk ? j0 + r : nk - 1;
      at_cp16(&buf[r][x * 8], (j < n0 ? base0 : base1) + (j * sk + x * 8), j0 + r < nk);
    }
  }
  at_cp_commit();
}

// Grid (groups·tiles, splits), 128 threads: 16 query rows against AT_KS keys, both staged in
// shared memory. Writes f = round(bf16(q·k)·scale) + mask (rows of nk in L) and each row's
// (max, sum exp(f - max)) over the split's keys (stats[row·splits + split]). Block (0, 0) also
// zeroes pt_attn_pv's tile counters (that kernel starts once this one has ended).
extern "C" __global__ __launch_bounds__(128) void pt_attn_logits(AttnParams p, const void* qp, const void* k0,
    const void* k1, const void* mask, float* L, float2* stats, unsigned* counters) {
  PT_PDL();
  __shared__ __align__(16) unsigned short qs[16][AT_DMAX + AT_PAD];
  __shared__ __align__(16) unsigned short ks[AT_KS][AT_DMAX + AT_PAD];
  __shared__ float red[4][16];
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int tiles = (int)p.tiles, rpg = (int)p.rpg, nk = (int)p.nk;
  const int gi = blockIdx.x / tiles, r0 = (blockIdx.x - gi * tiles) * 16;
  const int split = blockIdx.y;
  if (blockIdx.x == 0 && blockIdx.y == 0)
    for (unsigned i = threadIdx.x; i < gridDim.x; i += blockDim.x) counters[i] = 0;
  int b0, h0, q0;
  at_row(p, gi, 0, b0, h0, q0);
  const int ch = p.d / 8;
  for (int e = threadIdx.x; e < 16 * ch; e += 128) {
    int r = e / ch, x = e - r * ch, b, h, qi;
    at_row(p, gi, r0 + r < rpg ? r0 + r : rpg - 1, b, h, qi);
    at_cp16(&qs[r][x * 8], (const unsigned short*)qp + (b * (int)p.qsb + h * (int)p.qsh + qi * (int)p.qsq + x * 8), r0 + r < rpg);
  }
  const int j0 = split * AT_KS;
  at_stage(p, k0, k1, b0, h0, j0, AT_KS, ks, false);
  // The mask for this thread's (row, key) pairs, read while the tiles arrive.
  int rr[2], hh[2], qq[2], b = b0;
  for (int i = 0; i < 2; ++i) {
    rr[i] = r0 + g + 8 * i;
    at_row(p, gi, rr[i] < rpg ? rr[i] : rpg - 1, b, hh[i], qq[i]);
  }
  const int jw = j0 + w * (8 * AT_NT);
  float mk[2][2 * AT_NT];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float* mrow = (const float*)mask + (b * (int)p.msb + hh[i] * (int)p.msh + qq[i] * (int)p.msq);
#pragma unroll
    for (int t = 0; t < AT_NT; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        int j = jw + t * 8 + 2 * c + e;
        mk[i][2 * t + e] = (p.has_mask && j < nk) ? mrow[j * (int)p.msk] : 0.0f;
      }
  }
  at_cp_wait<0>();
  __syncthreads();
  float acc[AT_NT][4];
#pragma unroll
  for (int t = 0; t < AT_NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
  for (int d = 0; d < p.d; d += 16) {
    const int o = d + 2 * c;
    unsigned a0 = at_u32(&qs[g][o]), a1 = at_u32(&qs[g + 8][o]), a2 = at_u32(&qs[g][o + 8]), a3 = at_u32(&qs[g + 8][o + 8]);
#pragma unroll
    for (int t = 0; t < AT_NT; ++t) {
      const int kr = w * (8 * AT_NT) + t * 8 + g;
      at_mma(acc[t], a0, a1, a2, a3, at_u32(&ks[kr][o]), at_u32(&ks[kr][o + 8]));
    }
  }
  // acc[t][2i + e] is row g + 8i, key jw + 8t + 2c + e.
  float f[2][2 * AT_NT], mx[2] = {-PT_INF, -PT_INF};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float* lrow = L + (gi * rpg + rr[i]) * nk;
#pragma unroll
    for (int t = 0; t < AT_NT; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        int j = jw + t * 8 + 2 * c + e;
        float v = bf2f(f2bf(acc[t][2 * i + e])) * p.scale;
        if (p.dscale == DT_BF16) v = bf2f(f2bf(v));
        else if (p.dscale == DT_F16) v = h2f(f2h(v));
        v = j < nk ? v + mk[i][2 * t + e] : -PT_INF;
        f[i][2 * t + e] = v;
        mx[i] = fmaxf(mx[i], v);
        if (j < nk && rr[i] < rpg) lrow[j] = v;
      }
  }
  float m[2], s[2];
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    if (c == 0) red[w][g + 8 * i] = mx[i];
  }
  __syncthreads();
  for (int i = 0; i < 2; ++i) {
    m[i] = fmaxf(fmaxf(red[0][g + 8 * i], red[1][g + 8 * i]), fmaxf(red[2][g + 8 * i], red[3][g + 8 * i]));
    float t = 0.0f;
    if (m[i] != -PT_INF)
      for (int k = 0; k < 2 * AT_NT; ++k) t += expf(f[i][k] - m[i]);
    t += __shfl_xor_sync(0xffffffffu, t, 1);
    t += __shfl_xor_sync(0xffffffffu, t, 2);
    s[i] = t;
  }
  __syncthreads();
  for (int i = 0; i < 2; ++i)
    if (c == 0) red[w][g + 8 * i] = s[i];
  __syncthreads();
  if (w == 0 && c == 0)
    for (int i = 0; i < 2; ++i)
      if (rr[i] < rpg) {
        int r = g + 8 * i;
        stats[(gi * rpg + rr[i]) * p.splits + split] = make_float2(m[i], red[0][r] + red[1][r] + red[2][r] + red[3][r]);
      }
}

// Grid (groups·tiles, splits2), 256 threads: 16 query rows, AT_KS2 keys, all dv columns (warp
// w the columns 32w..32w+31). The rows' max and sum from the splits' statistics (16 threads a
// row, a fixed reduction tree); p = exp(f - max) / sum as pt_softmax computes it, rounded to
// bf16, once per element into shared memory; v staged AT_VC keys at a time into two buffers
// (the next arriving while one is used); p·v on the tensor cores. With several key blocks a
// tile, each writes its f32 partial product and the last to finish (a counter per tile) sums
// them in key order, so every run gives the same bits; out = bf16(sum).
extern "C" __global__ __launch_bounds__(256) void pt_attn_pv(AttnParams p, const float* L, const float2* stats,
    const void* v0, const void* v1, float* part, unsigned* counters, unsigned short* out) {
  PT_PDL();
  __shared__ __align__(16) unsigned short ps[16][AT_KS2 + AT_PAD];
  __shared__ __align__(16) unsigned short vs[2][AT_VC][AT_DMAX + AT_PAD];
  __shared__ float mrow[16], srow[16];
  __shared__ unsigned last;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int tiles = (int)p.tiles, rpg = (int)p.rpg, nk = (int)p.nk, dv = p.dv;
  const int gi = blockIdx.x / tiles, r0 = (blockIdx.x - gi * tiles) * 16;
  const int split = blockIdx.y, j0 = split * AT_KS2;
  int b0, h0, q0;
  at_row(p, gi, 0, b0, h0, q0);
  at_stage(p, v0, v1, b0, h0, j0, AT_VC, vs[0], true);
  {
    // 16 threads a row, each a split (and every 16th after it).
    const int r = threadIdx.x >> 4, l = threadIdx.x & 15;
    const float2* st = stats + (gi * rpg + (r0 + r < rpg ? r0 + r : rpg - 1)) * p.splits;
    float m = -PT_INF;
    for (int k = l; k < p.splits; k += 16) m = fmaxf(m, st[k].x);
    for (int o = 8; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float s = 0.0f;
    for (int k = l; k < p.splits; k += 16) if (st[k].x != -PT_INF) s += st[k].y * expf(st[k].x - m);
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (l == 0) { mrow[r] = m; srow[r] = s; }
  }
  __syncthreads();
  {
    // Rows u and u + 8 (u = threadIdx.x / AT_KS2 ... ), key j0 + threadIdx.x % AT_KS2: loads first.
    const int jj = threadIdx.x % AT_KS2, u0 = threadIdx.x / AT_KS2, rs = 256 / AT_KS2;
    const bool key = j0 + jj < nk;
    float lv[16 / (256 / AT_KS2)];
#pragma unroll
    for (int k = 0; k < 16 / rs; ++k) {
      int u = u0 + k * rs;
      lv[k] = (r0 + u < rpg && key) ? L[(gi * rpg + r0 + u) * nk + j0 + jj] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < 16 / rs; ++k) {
      int u = u0 + k * rs;
      ps[u][jj] = (r0 + u < rpg && key) ? f2bf(expf(lv[k] - mrow[u]) / srow[u]) : (unsigned short)0;
    }
  }
  float acc[4][4];
  for (int t = 0; t < 4; ++t) for (int e = 0; e < 4; ++e) acc[t][e] = 0.0f;
  int cur = 0;
  for (int kc = 0; kc < AT_KS2 && j0 + kc < nk; kc += AT_VC, cur ^= 1) {
    const bool more = kc + AT_VC < AT_KS2 && j0 + kc + AT_VC < nk;
    if (more) at_stage(p, v0, v1, b0, h0, j0 + kc + AT_VC, AT_VC, vs[cur ^ 1], true);
    if (more) at_cp_wait<1>(); else at_cp_wait<0>();
    __syncthreads();
    if (32 * w < dv)
#pragma unroll
      for (int k = 0; k < AT_VC; k += 16) {
        const int o = kc + k + 2 * c;
        unsigned a0 = at_u32(&ps[g][o]), a1 = at_u32(&ps[g + 8][o]), a2 = at_u32(&ps[g][o + 8]), a3 = at_u32(&ps[g + 8][o + 8]);
#pragma unroll
        for (int t = 0; t < 4; t += 2) {
          // Four 8x8 tiles of v, transposed into the B fragments of two n-tiles.
          const int mi = lane >> 3;
          const unsigned short* src = &vs[cur][k + (mi & 1) * 8 + (lane & 7)][32 * w + 8 * t + (mi >> 1) * 8];
          unsigned addr = (unsigned)__cvta_generic_to_shared(src), b[4];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
          asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
            : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(addr));
#else
          b[0] = b[1] = b[2] = b[3] = 0;
#endif
          at_mma(acc[t], a0, a1, a2, a3, b[0], b[1]);
          at_mma(acc[t + 1], a0, a1, a2, a3, b[2], b[3]);
        }
      }
    __syncthreads();
  }
  // acc[t][2i + e] is row g + 8i, column 32w + 8t + 2c + e.
  if (p.splits2 == 1) {
    if (32 * w < dv)
      for (int i = 0; i < 2; ++i) {
        int row = r0 + g + 8 * i, b, h, qi;
        if (row >= rpg) continue;
        at_row(p, gi, row, b, h, qi);
        unsigned short* o = out + (b * (int)p.osb + h * (int)p.osh + qi * (int)p.osq + 32 * w + 2 * c);
        for (int t = 0; t < 4; ++t)
          *(unsigned*)(o + 8 * t) = (unsigned)f2bf(acc[t][2 * i]) | ((unsigned)f2bf(acc[t][2 * i + 1]) << 16);
      }
    return;
  }
  const int n = 16 * dv;
  float* mine = part + (blockIdx.x * p.splits2 + split) * n;
  if (32 * w < dv)
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 2; ++i)
        *(float2*)&mine[(g + 8 * i) * dv + 32 * w + 8 * t + 2 * c] = make_float2(acc[t][2 * i], acc[t][2 * i + 1]);
  // The block's writes, then one thread's fence and count (the last block's fence after it
  // orders its reads after every other block's writes).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(&counters[blockIdx.x], 1u) == (unsigned)(p.splits2 - 1);
    if (last) __threadfence();
  }
  __syncthreads();
  if (!last) return;
  // Element e = threadIdx.x + 256u of the tile (16 · dv ≤ 4,096 of them): four blocks'
  // partials loaded for every element at once, then added in key order.
  const float* all = part + blockIdx.x * p.splits2 * n;
  float v[16];
#pragma unroll
  for (int u = 0; u < 16; ++u) v[u] = 0.0f;
  for (int k0 = 0; k0 < p.splits2; k0 += 4) {
    float x[4][16];
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int u = 0; u < 16; ++u) {
        int e = threadIdx.x + 256 * u;
        x[k][u] = (k0 + k < p.splits2 && e < n) ? __ldcg(&all[(k0 + k) * n + e]) : 0.0f;
      }
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int u = 0; u < 16; ++u) if (k0 + k < p.splits2) v[u] += x[k][u];
  }
#pragma unroll
  for (int u = 0; u < 16; ++u) {
    int e = threadIdx.x + 256 * u, r = e / dv, col = e - r * dv, row = r0 + r, b, h, qi;
    if (e >= n || row >= rpg) continue;
    at_row(p, gi, row, b, h, qi);
    out[b * (int)p.osb + h * (int)p.osh + qi * (int)p.osq + col] = f2bf(v[u]);
  }
}

// Thread-block clusters (sm_90): this block's rank, a barrier over the cluster that orders
// shared-memory writes before the other blocks' reads (and one that orders nothing), and reads
// of another block's shared memory (`p` is this block's address of the same variable).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned at_cl_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void at_cl_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void at_cl_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}
__device__ __forceinline__ unsigned at_cl_map(const void* p, unsigned rank) {
  unsigned a = (unsigned)__cvta_generic_to_shared(p), r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
  return r;
}
__device__ __forceinline__ float2 at_cl_ld2(unsigned a) {
  float2 v;
  asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ float4 at_cl_ld4(unsigned a) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a) : "memory");
  return v;
}
#endif

// The whole attention in one launch on sm_90: grid (AT_CL, groups·tiles of 32 rows), clusters
// of AT_CL blocks along x, 512 threads, the plan's dynamic shared memory. Block `rank` of a
// cluster holds keys rank·kc .. rank·kc + kc (kc = AT_CL_KC(nk) ≤ 128) of 32 query rows: q,
// its K and its v staged at once (cp.async); f = round(bf16(q·k)·scale) + mask on the tensor
// cores, each row's local (max, exp-sum); the cluster's statistics combined in rank order
// through distributed shared memory (every block the same values); p = exp(f - max) / sum
// rounded to bf16 as pt_softmax does; p·v; the f32 partial products summed in rank order, each
// block an eighth of the columns. No scratch in global memory, and every run the same bits.
// Warp w: rows 16·(w / 8) .., keys (w % 8)·kc / 8 .. for the logits, columns (w % 8)·dv / 8 ..
// for p·v (so dv a multiple of 128). Many warps, short chains: the kernel is latency-bound.
#define AT_CL 8
#define AT_CL_KC(nk) ((((nk) + AT_CL - 1) / AT_CL + 63) / 64 * 64)
extern "C" __global__ __launch_bounds__(512) void pt_attn_cl(AttnParams p, const void* qp, const void* k0,
    const void* k1, const void* v0, const void* v1, const void* mask, unsigned short* out) {
  PT_PDL();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char at_smem[];
  typedef unsigned short Row[AT_DMAX + AT_PAD];
  const int nk = (int)p.nk, rpg = (int)p.rpg, dv = p.dv, kc = AT_CL_KC(nk), kp = kc + AT_PAD;
  // The partial products' row stride: 8 floats of padding keep a warp's stores conflict-free.
  const int ds = dv + 8;
  const int tiles = (rpg + 31) / 32, gi = blockIdx.y / tiles, r0 = (blockIdx.y - gi * tiles) * 32;
  const unsigned rank = at_cl_rank();
  const int j0 = (int)rank * kc;
  // q (32 rows), K (kc rows; then the f32 partial products), v (kc rows), p (bf16), and the
  // row statistics.
  Row* qs = (Row*)at_smem;
  Row* ks = qs + 32;
  const int area = kc * (int)sizeof(Row) > 32 * ds * 4 ? kc * (int)sizeof(Row) : 32 * ds * 4;
  Row* vs = (Row*)((unsigned char*)ks + area);
  unsigned short* ps = (unsigned short*)(vs + kc);
  float* red = (float*)(ps + 32 * kp);
  float2* st = (float2*)(red + 256);
  float* mrow = (float*)(st + 32);
  float* srow = mrow + 32;
  float* part = (float*)ks;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int rt = w >> 3, kq = w & 7, nt = kc / 64, kw = kq * (kc / 8);
  int b0, h0, q0;
  at_row(p, gi, 0, b0, h0, q0);
  const int ch = p.d / 8;
  for (int e = threadIdx.x; e < 32 * ch; e += 512) {
    int r = e / ch, x = e - r * ch, b, h, qi;
    at_row(p, gi, r0 + r < rpg ? r0 + r : rpg - 1, b, h, qi);
    at_cp16(&qs[r][x * 8], (const unsigned short*)qp + (b * (int)p.qsb + h * (int)p.qsh + qi * (int)p.qsq + x * 8), r0 + r < rpg);
  }
  at_stage(p, k0, k1, b0, h0, j0, kc, ks, false);
  at_stage(p, v0, v1, b0, h0, j0, kc, vs, true);
  int rr[2], hh[2], qq[2], b = b0;
  for (int i = 0; i < 2; ++i) {
    rr[i] = r0 + rt * 16 + g + 8 * i;
    at_row(p, gi, rr[i] < rpg ? rr[i] : rpg - 1, b, hh[i], qq[i]);
  }
  float mk[2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float* mr = (const float*)mask + (b * (int)p.msb + hh[i] * (int)p.msh + qq[i] * (int)p.msq);
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        int j = j0 + kw + t * 8 + 2 * c + e;
        mk[i][2 * t + e] = (t < nt && p.has_mask && j < nk) ? mr[j * (int)p.msk] : 0.0f;
      }
  }
  at_cp_wait<1>();
  __syncthreads();
  float acc[2][4];
#pragma unroll
  for (int t = 0; t < 2; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
  const int ra = rt * 16 + g;
  for (int d = 0; d < p.d; d += 16) {
    const int o = d + 2 * c;
    unsigned a0 = at_u32(&qs[ra][o]), a1 = at_u32(&qs[ra + 8][o]), a2 = at_u32(&qs[ra][o + 8]), a3 = at_u32(&qs[ra + 8][o + 8]);
#pragma unroll
    for (int t = 0; t < 2; ++t)
      if (t < nt) {
        const int kr = kw + t * 8 + g;
        at_mma(acc[t], a0, a1, a2, a3, at_u32(&ks[kr][o]), at_u32(&ks[kr][o + 8]));
      }
  }
  // acc[t][2i + e] is row ra + 8i, key j0 + kw + 8t + 2c + e.
  float f[2][4], mx[2] = {-PT_INF, -PT_INF};
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        int j = j0 + kw + t * 8 + 2 * c + e;
        float v = bf2f(f2bf(acc[t][2 * i + e])) * p.scale;
        if (p.dscale == DT_BF16) v = bf2f(f2bf(v));
        else if (p.dscale == DT_F16) v = h2f(f2h(v));
        v = (t < nt && j < nk) ? v + mk[i][2 * t + e] : -PT_INF;
        f[i][2 * t + e] = v;
        mx[i] = fmaxf(mx[i], v);
      }
  float m[2];
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    if (c == 0) red[kq * 32 + ra + 8 * i] = mx[i];
  }
  __syncthreads();
  float s[2];
  for (int i = 0; i < 2; ++i) {
    const int r = ra + 8 * i;
    float mm = red[r];
#pragma unroll
    for (int k = 1; k < 8; ++k) mm = fmaxf(mm, red[k * 32 + r]);
    m[i] = mm;
    float t = 0.0f;
    if (mm != -PT_INF)
#pragma unroll
      for (int k = 0; k < 4; ++k) t += expf(f[i][k] - mm);
    t += __shfl_xor_sync(0xffffffffu, t, 1);
    t += __shfl_xor_sync(0xffffffffu, t, 2);
    s[i] = t;
  }
  __syncthreads();
  for (int i = 0; i < 2; ++i)
    if (c == 0) red[kq * 32 + ra + 8 * i] = s[i];
  __syncthreads();
  if (kq == 0 && c == 0)
    for (int i = 0; i < 2; ++i) {
      const int r = ra + 8 * i;
      float ss = red[r];
#pragma unroll
      for (int k = 1; k < 8; ++k) ss += red[k * 32 + r];
      st[r] = make_float2(m[i], ss);
    }
  // Every block's statistics, combined in rank order (each block computes the same).
  at_cl_sync();
  if (threadIdx.x < 32) {
    float2 sv[AT_CL];
#pragma unroll
    for (int k = 0; k < AT_CL; ++k) sv[k] = at_cl_ld2(at_cl_map(&st[threadIdx.x], k));
    float mm = -PT_INF, ss = 0.0f;
#pragma unroll
    for (int k = 0; k < AT_CL; ++k) mm = fmaxf(mm, sv[k].x);
#pragma unroll
    for (int k = 0; k < AT_CL; ++k) if (sv[k].x != -PT_INF) ss += sv[k].y * expf(sv[k].x - mm);
    mrow[threadIdx.x] = mm;
    srow[threadIdx.x] = ss;
  }
  __syncthreads();
  for (int i = 0; i < 2; ++i) {
    const int r = ra + 8 * i;
    const float mm = mrow[r], ss = srow[r];
#pragma unroll
    for (int t = 0; t < 2; ++t)
      if (t < nt) {
        const int jl = kw + t * 8 + 2 * c;
        unsigned short pe[2];
#pragma unroll
        for (int e = 0; e < 2; ++e)
          pe[e] = (rr[i] < rpg && j0 + jl + e < nk) ? f2bf(expf(f[i][2 * t + e] - mm) / ss) : (unsigned short)0;
        *(unsigned*)&ps[r * kp + jl] = (unsigned)pe[0] | ((unsigned)pe[1] << 16);
      }
  }
  at_cp_wait<0>();
  __syncthreads();
  // p·v: warp w's 16 rows, columns cb .. cb + dv / 8.
  const int nt2 = dv / 64, cb = kq * (dv / 8);
  float o[4][4];
#pragma unroll
  for (int t = 0; t < 4; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
  for (int k = 0; k < kc; k += 16) {
    const int oo = k + 2 * c;
    unsigned a0 = at_u32(&ps[ra * kp + oo]), a1 = at_u32(&ps[(ra + 8) * kp + oo]);
    unsigned a2 = at_u32(&ps[ra * kp + oo + 8]), a3 = at_u32(&ps[(ra + 8) * kp + oo + 8]);
#pragma unroll
    for (int t = 0; t < 4; t += 2)
      if (t < nt2) {
        const int mi = lane >> 3;
        const unsigned short* src = &vs[k + (mi & 1) * 8 + (lane & 7)][cb + 8 * t + (mi >> 1) * 8];
        unsigned addr = (unsigned)__cvta_generic_to_shared(src), bf[4];
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
          : "=r"(bf[0]), "=r"(bf[1]), "=r"(bf[2]), "=r"(bf[3]) : "r"(addr));
        at_mma(o[t], a0, a1, a2, a3, bf[0], bf[1]);
        at_mma(o[t + 1], a0, a1, a2, a3, bf[2], bf[3]);
      }
  }
  // The partial products over K's rows (the logits read them before the barriers above).
#pragma unroll
  for (int t = 0; t < 4; ++t)
    if (t < nt2)
      for (int i = 0; i < 2; ++i)
        *(float2*)&part[(ra + 8 * i) * ds + cb + 8 * t + 2 * c] = make_float2(o[t][2 * i], o[t][2 * i + 1]);
  at_cl_sync();
  // This block's eighth of the columns, summed over the blocks in rank order, 4 at a time.
  const int cw = dv / AT_CL, c4 = cw / 4;
  for (int e = threadIdx.x; e < 32 * c4; e += 512) {
    const int r = e / c4, col = (int)rank * cw + (e - r * c4) * 4, row = r0 + r;
    float4 x[AT_CL];
#pragma unroll
    for (int k = 0; k < AT_CL; ++k) x[k] = at_cl_ld4(at_cl_map(&part[r * ds + col], k));
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int k = 0; k < AT_CL; ++k) {
      sum.x += x[k].x; sum.y += x[k].y; sum.z += x[k].z; sum.w += x[k].w;
    }
    if (row < rpg) {
      int bb, h, qi;
      at_row(p, gi, row, bb, h, qi);
      unsigned short* dst = out + (bb * (int)p.osb + h * (int)p.osh + qi * (int)p.osq + col);
      *(uint2*)dst = make_uint2((unsigned)f2bf(sum.x) | ((unsigned)f2bf(sum.y) << 16),
                                (unsigned)f2bf(sum.z) | ((unsigned)f2bf(sum.w) << 16));
    }
  }
  // No block leaves while another may still read its shared memory. A relaxed arrival: every
  // read of another block's shared memory above has completed (its value was summed and
  // stored), and the default release would make each thread first wait for its global stores
  // (`MEMBAR.ALL.GPU` in the SASS) for no reader.
  at_cl_sync_relaxed();
#endif
}
"#,
];

/// [`ATTN`] with `AttnParams`'s layout checks after its definition.
pub(super) fn text() -> String {
    with_checks(&ATTN, &[attn_params()])
}

/// The fused attention kernels' block.
#[rustfmt::skip] // a table: the C struct's fields, in its order
pub(super) fn attn_params() -> Layout {
    layout!(AttnParams {
        nk, n0, rpg, tiles, h, q, shared, d, splits, dscale, scale, has_mask, dv, splits2, qsb,
        qsh, qsq, ksb, ksh, ksk, k1sb, k1sh, vsb, vsh, vsk, v1sb, v1sh, msb, msh, msq, msk, osb,
        osh, osq
    })
}
