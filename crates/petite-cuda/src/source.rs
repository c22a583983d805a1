//! The CUDA C source of petite-cuda's kernels, compiled by NVRTC at first use (once per process).
//!
//! One module holds every kernel. Kernels take dtype and op codes as run-time parameters (the
//! branch is uniform across a launch, so it costs next to nothing) instead of one instantiation
//! per node: a program needs one NVRTC compile, not one per op signature. Every float op loads
//! its operands as f32 (bf16/f16 widened exactly), computes in f32 (reductions in f64, as the
//! reference executor does) and rounds once to the output dtype (round-to-nearest-even). No
//! header is included: bf16 and f16 conversions are written out, so NVRTC needs no include path
//! (a Jetson's or a pip-installed libnvrtc works as well as a toolkit's).

use petite_graph::{BinaryOp, CompareOp, Dtype, LogicalOp, UnaryOp};

/// Most dims a strided launch indexes (pi0.5's programs use at most 5).
pub const MAX_RANK: usize = 8;

/// Kernel entry points of the module, as [`module_source`] defines them.
pub const KERNELS: &[&str] = &[
    "pt_ew",
    "pt_norm",
    "pt_softmax",
    "pt_rope",
    "pt_gather",
    "pt_cumsum",
    "pt_cumsum_i",
    "pt_reduce",
    "pt_im2col",
    "pt_bias",
    "pt_ptrs",
    "pt_attn_tf32",
];

/// The dtype code kernels use (`DT_*` in the source).
pub fn dtype_code(d: Dtype) -> i32 {
    match d {
        Dtype::F32 => 0,
        Dtype::Bf16 => 1,
        Dtype::F16 => 2,
        Dtype::I64 => 3,
        Dtype::I32 => 4,
        Dtype::U8 => 5,
        Dtype::Bool => 6,
    }
}

/// What `pt_ew` computes per element (its `op` parameter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EwOp {
    /// `out = a` converted to the output dtype (copies, casts, layout moves).
    Copy,
    /// `a (op) b`, or with a scalar in place of `b` (or of `a`).
    Binary(BinaryOp),
    /// `a (cmp) b` → bool.
    Compare(CompareOp),
    /// `a && b`, `a || b` on bools.
    Logical(LogicalOp),
    /// `!a`.
    Not,
    /// `f(a)`.
    Unary(UnaryOp),
    /// `a ? b : c`.
    Where,
}

impl EwOp {
    /// The op code of the kernel's switch.
    pub fn code(self) -> i32 {
        match self {
            EwOp::Copy => 0,
            EwOp::Binary(k) => match k {
                BinaryOp::Add => 1,
                BinaryOp::Sub => 2,
                BinaryOp::Mul => 3,
                BinaryOp::Div => 4,
            },
            EwOp::Compare(k) => match k {
                CompareOp::Lt => 10,
                CompareOp::Le => 11,
                CompareOp::Eq => 12,
                CompareOp::Ne => 13,
                CompareOp::Gt => 14,
                CompareOp::Ge => 15,
            },
            EwOp::Logical(LogicalOp::And) => 20,
            EwOp::Logical(LogicalOp::Or) => 21,
            EwOp::Not => 22,
            EwOp::Unary(k) => match k {
                UnaryOp::Neg => 30,
                UnaryOp::Exp => 31,
                UnaryOp::Sqrt => 32,
                UnaryOp::Rsqrt => 33,
                UnaryOp::Sin => 34,
                UnaryOp::Cos => 35,
                UnaryOp::Tanh => 36,
                UnaryOp::GeluTanh => 37,
                UnaryOp::Silu => 38,
            },
            EwOp::Where => 40,
        }
    }
}

/// What generated (fused) kernels build on: the dtype loads and stores, `pt_ew`'s per-op
/// arithmetic and `pt_norm`'s formula, so a fused kernel computes each op exactly as `pt_ew`
/// (and a prologue norm as `pt_norm`) does.
pub fn fused_prelude() -> String {
    let mut s = String::with_capacity(8 << 10);
    s.push_str(PRELUDE);
    s.push_str(CP_ASYNC);
    s.push_str(EW_FUNCS);
    s.push_str(NORM_FUNCS);
    s
}

/// The whole module's CUDA C source. `MAX_RANK` is baked in; the parameter structs mirror
/// [`crate::plan::EwParams`] and friends field for field.
pub fn module_source() -> String {
    let mut s = String::with_capacity(16 << 10);
    s.push_str(&format!("#define MAXR {MAX_RANK}\n"));
    s.push_str(PRELUDE);
    s.push_str(CP_ASYNC);
    s.push_str(EW_STRUCT);
    s.push_str(EW_FUNCS);
    s.push_str(EW);
    s.push_str(NORM_FUNCS);
    s.push_str(ROWS);
    s.push_str(MISC);
    s.push_str(TF32_ATTN);
    s
}

/// The fused attention kernels' source ([`crate::fuse::Attend`]; entry points
/// [`ATTENTION_KERNELS`]), after [`fused_prelude`]: a module of its own, compiled only where a
/// program fuses an attention (beside the weights' upload; programs without one pay nothing
/// for it), and once a process however many programs do.
pub fn attention_module_source() -> String {
    let mut s = fused_prelude();
    s.push_str(ATTN);
    s
}

/// Entry points of [`attention_module_source`].
pub const ATTENTION_KERNELS: [&str; 3] = ["pt_attn_logits", "pt_attn_pv", "pt_attn_cl"];

const PRELUDE: &str = r#"
#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2
#define DT_I64 3
#define DT_I32 4
#define DT_U8 5
#define DT_BOOL 6
#define PT_INF __int_as_float(0x7f800000)
// Programmatic dependent launch (sm_90+): the first statement of every kernel. Lets the next
// kernel be scheduled once every block of this one runs, then waits until the kernel before
// has completed and its memory is visible, before any read or write.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PT_PDL() asm volatile("griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;" ::: "memory")
#else
#define PT_PDL()
#endif
// Below this many elements a kernel's index arithmetic is done in 32 bits.
#define PT_U32_MAX 0x7fffffffLL
typedef long long i64;
typedef unsigned long long u64;

__device__ __forceinline__ float bf2f(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ unsigned short f2bf(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}
__device__ __forceinline__ float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }

__device__ __forceinline__ float ldf(const void* p, i64 i, int dt) {
  switch (dt) {
    case DT_F32: return ((const float*)p)[i];
    case DT_BF16: return bf2f(((const unsigned short*)p)[i]);
    case DT_F16: return h2f(((const unsigned short*)p)[i]);
    case DT_I64: return (float)((const i64*)p)[i];
    case DT_I32: return (float)((const int*)p)[i];
    default: return (float)((const unsigned char*)p)[i];
  }
}
__device__ __forceinline__ i64 ldi(const void* p, i64 i, int dt) {
  switch (dt) {
    case DT_F32: return (i64)((const float*)p)[i];
    case DT_BF16: return (i64)bf2f(((const unsigned short*)p)[i]);
    case DT_F16: return (i64)h2f(((const unsigned short*)p)[i]);
    case DT_I64: return ((const i64*)p)[i];
    case DT_I32: return (i64)((const int*)p)[i];
    default: return (i64)((const unsigned char*)p)[i];
  }
}
__device__ __forceinline__ void stf(void* p, i64 i, int dt, float v) {
  switch (dt) {
    case DT_F32: ((float*)p)[i] = v; break;
    case DT_BF16: ((unsigned short*)p)[i] = f2bf(v); break;
    case DT_F16: ((unsigned short*)p)[i] = f2h(v); break;
    case DT_I64: ((i64*)p)[i] = (i64)v; break;
    case DT_I32: ((int*)p)[i] = (int)(i64)v; break;
    case DT_U8: ((unsigned char*)p)[i] = (unsigned char)(i64)v; break;
    default: ((unsigned char*)p)[i] = (v != 0.0f) ? 1 : 0; break;
  }
}
__device__ __forceinline__ void sti(void* p, i64 i, int dt, i64 v) {
  switch (dt) {
    case DT_F32: ((float*)p)[i] = (float)v; break;
    case DT_BF16: ((unsigned short*)p)[i] = f2bf((float)v); break;
    case DT_F16: ((unsigned short*)p)[i] = f2h((float)v); break;
    case DT_I64: ((i64*)p)[i] = v; break;
    case DT_I32: ((int*)p)[i] = (int)v; break;
    case DT_U8: ((unsigned char*)p)[i] = (unsigned char)v; break;
    default: ((unsigned char*)p)[i] = (v != 0) ? 1 : 0; break;
  }
}
__device__ __forceinline__ bool isflt(int dt) { return dt <= DT_F16; }

__device__ __forceinline__ float block_sum_f(float v, float* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  __syncthreads();
  if (l == 0) sh[w] = v;
  __syncthreads();
  float t = 0.0f;
  for (int k = 0; k < (int)(blockDim.x >> 5); ++k) t += sh[k];
  return t;
}
__device__ __forceinline__ double block_sum_d(double v, double* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  __syncthreads();
  if (l == 0) sh[w] = v;
  __syncthreads();
  double t = 0.0;
  for (int k = 0; k < (int)(blockDim.x >> 5); ++k) t += sh[k];
  return t;
}
__device__ __forceinline__ float block_max_f(float v, float* sh) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  __syncthreads();
  if (l == 0) sh[w] = v;
  __syncthreads();
  float t = sh[0];
  for (int k = 1; k < (int)(blockDim.x >> 5); ++k) t = fmaxf(t, sh[k]);
  return t;
}
"#;

/// The norms' row statistics and per-element formula: `pt_norm` and the fused kernels that
/// compute a norm as their prologue share them, so both give the same bits.
const NORM_FUNCS: &str = r#"
struct NormParams { i64 rows; i64 d; int kind; int has_w; int has_b; int dx; int dw; int db; int dout; float eps; float offset; };

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
"#;

const EW_STRUCT: &str = r#"
struct EwParams {
  i64 n;
  int rank; int op; int cls; int contig;
  int da; int db; int dc; int dout;
  int scalar; int scalar_lhs; float fs; i64 is;
  i64 dims[MAXR];
  i64 sa[MAXR]; i64 sb[MAXR]; i64 sc[MAXR]; i64 so[MAXR];
  i64 oa; i64 ob; i64 oc; i64 oo;
};
"#;

const EW_FUNCS: &str = r#"

__device__ __forceinline__ float ew_f(int op, float a, float b) {
  switch (op) {
    case 0: return a;
    case 1: return a + b;
    case 2: return a - b;
    case 3: return a * b;
    case 4: return a / b;
    case 30: return -a;
    case 31: return expf(a);
    case 32: return sqrtf(a);
    case 33: return 1.0f / sqrtf(a);
    case 34: return sinf(a);
    case 35: return cosf(a);
    case 36: return tanhf(a);
    case 37: {
      const float kb = 0.7978845608028654f; const float kk = 0.044715f;
      float inner = kb * (a + kk * (a * a * a));
      return 0.5f * a * (1.0f + tanhf(inner));
    }
    case 38: return a / (1.0f + expf(-a));
    default: return 0.0f;
  }
}
__device__ __forceinline__ i64 ew_i(int op, i64 a, i64 b) {
  switch (op) {
    case 0: return a;
    case 1: return (i64)((u64)a + (u64)b);
    case 2: return (i64)((u64)a - (u64)b);
    case 3: return (i64)((u64)a * (u64)b);
    case 30: return (i64)(0ull - (u64)a);
    default: return 0;
  }
}
template <typename T> __device__ __forceinline__ bool ew_cmp(int op, T a, T b) {
  switch (op) {
    case 10: return a < b;
    case 11: return a <= b;
    case 12: return a == b;
    case 13: return a != b;
    case 14: return a > b;
    default: return a >= b;
  }
}

"#;

const EW: &str = r#"
extern "C" __global__ void pt_ew(EwParams p, const void* a, const void* b, const void* c, void* out) {
  PT_PDL();
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += (i64)gridDim.x * blockDim.x) {
    i64 ia = i, ib = i, ic = i, io = i;
    if (!p.contig) {
      ia = p.oa; ib = p.ob; ic = p.oc; io = p.oo;
      if (p.n < PT_U32_MAX) {
        unsigned r = (unsigned)i;
        for (int d = p.rank - 1; d >= 0; --d) {
          i64 x = r % (unsigned)p.dims[d]; r /= (unsigned)p.dims[d];
          ia += x * p.sa[d]; ib += x * p.sb[d]; ic += x * p.sc[d]; io += x * p.so[d];
        }
      } else {
        i64 r = i;
        for (int d = p.rank - 1; d >= 0; --d) {
          i64 x = r % p.dims[d]; r /= p.dims[d];
          ia += x * p.sa[d]; ib += x * p.sb[d]; ic += x * p.sc[d]; io += x * p.so[d];
        }
      }
    }
    int op = p.op;
    if (op == 40) {
      bool cnd = ldi(a, ia, p.da) != 0;
      if (isflt(p.db)) stf(out, io, p.dout, cnd ? ldf(b, ib, p.db) : ldf(c, ic, p.dc));
      else sti(out, io, p.dout, cnd ? ldi(b, ib, p.db) : ldi(c, ic, p.dc));
    } else if (op >= 20 && op <= 22) {
      bool x = ldi(a, ia, p.da) != 0;
      bool r = op == 22 ? !x : (op == 20 ? (x && ldi(b, ib, p.db) != 0) : (x || ldi(b, ib, p.db) != 0));
      sti(out, io, p.dout, r ? 1 : 0);
    } else if (op >= 10 && op <= 15) {
      bool r;
      if (p.cls == 0) r = ew_cmp<float>(op, ldf(a, ia, p.da), ldf(b, ib, p.db));
      else r = ew_cmp<i64>(op, ldi(a, ia, p.da), ldi(b, ib, p.db));
      sti(out, io, p.dout, r ? 1 : 0);
    } else if (p.cls == 0) {
      float x = ldf(a, ia, p.da);
      float y = 0.0f;
      if (p.scalar) { y = p.fs; if (p.scalar_lhs) { float t = x; x = y; y = t; } }
      else if (op >= 1 && op <= 4) y = ldf(b, ib, p.db);
      stf(out, io, p.dout, ew_f(op, x, y));
    } else {
      i64 x = ldi(a, ia, p.da);
      i64 y = 0;
      if (p.scalar) { y = p.is; if (p.scalar_lhs) { i64 t = x; x = y; y = t; } }
      else if (op >= 1 && op <= 4) y = ldi(b, ib, p.db);
      sti(out, io, p.dout, ew_i(op, x, y));
    }
  }
}
"#;

const ROWS: &str = r#"
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
"#;

const MISC: &str = r#"
struct RopeParams { i64 n; i64 d; int rank; int dt; i64 dims[MAXR]; i64 sc[MAXR]; i64 ss[MAXR]; };

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
extern "C" __global__ void pt_ptrs(PtrParams p, u64* out) {
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
"#;

/// Asynchronous copies into shared memory (`cp.async`, sm_80 and later; plain copies before),
/// shared by the attention kernels of the fixed module and of a program's fused source (after
/// [`PRELUDE`] in both).
const CP_ASYNC: &str = r#"
// 16 bytes from global to shared memory without waiting (zeros when !valid; src stays a valid
// address either way).
__device__ __forceinline__ void at_cp16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned d = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(d), "l"(src), "r"(valid ? 16 : 0) : "memory");
#else
  *(uint4*)dst = valid ? *(const uint4*)src : make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void at_cp_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Waits until at most n committed groups are still in flight.
template <int n> __device__ __forceinline__ void at_cp_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" :: "n"(n) : "memory");
#endif
}

"#;

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
const TF32_ATTN: &str = r#"
struct TfAttnParams {
  i64 qsb, qsh, qsq, ksb, ksh, ksk, vsb, vsh, vsk, osb, osh, osq;
  int h, kvh, nq, nk, d, dv, tiles; float scale;
};
#define TA_DMAX 80
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
"#;

/// bf16 attention as transformers' eager op order computes it — `l = bf16(q·kᵀ)`,
/// `s = round(l·scale)`, `f = s + mask` in f32, `p = bf16(softmax(f))`, `out = bf16(p·v)` — in
/// two launches instead of a logits GEMM, a softmax and a PV GEMM ([`crate::fuse::Attend`]).
/// Both products run on the tensor cores (`mma.sync` m16n8k16, f32 accumulation); only the
/// summation order of each dot product differs from cuBLAS's. `pt_attn_logits` writes `f` and
/// each 64-key split's row max and exp-sum; `pt_attn_pv` combines the splits' statistics in a
/// fixed order (so every run gives the same bits), forms `p` exactly as `pt_softmax` does
/// (`exp(f - max) / sum`, rounded to bf16) and multiplies by v. K and v may come in two pieces
/// along the keys (a concat of the prefix's K/V and the step's own, read in place).
const ATTN: &str = r#"
struct AttnParams {
  i64 nk; i64 n0; i64 rpg; i64 tiles; i64 h; i64 q;
  int shared; int d; int splits; int dscale; float scale; int has_mask; int dv; int splits2;
  i64 qsb, qsh, qsq;
  i64 ksb, ksh, ksk, k1sb, k1sh;
  i64 vsb, vsh, vsk, v1sb, v1sh;
  i64 msb, msh, msq, msk;
  i64 osb, osh, osq;
};
// Keys a pt_attn_logits block covers (AT_KS / 4 a warp: AT_NT n-tiles of 8; small blocks, many
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
__device__ __forceinline__ void at_mma(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
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
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_module_defines_every_kernel_once_and_its_braces_balance() {
        let s = module_source();
        for k in KERNELS {
            let decl = format!(" void {k}(");
            assert_eq!(s.matches(&decl).count(), 1, "{k}");
        }
        // Braces and parentheses balance outside comments.
        let balanced = |src: &str| {
            let code: String = src
                .lines()
                .map(|l| l.split("//").next().unwrap_or(""))
                .collect();
            code.matches('{').count() == code.matches('}').count()
                && code.matches('(').count() == code.matches(')').count()
        };
        assert!(balanced(&s));
        assert!(!s.contains("#include"), "NVRTC must need no include path");
        // The attention kernels: a module of their own, on the fused kernels' prelude.
        let a = attention_module_source();
        assert!(a.starts_with(&fused_prelude()));
        for k in ATTENTION_KERNELS {
            assert_eq!(a.matches(&format!(" void {k}(")).count(), 1, "{k}");
            assert!(
                !s.contains(&format!(" void {k}(")),
                "{k} is not in the fixed module"
            );
        }
        assert!(balanced(&a));
    }

    #[test]
    fn op_codes_are_distinct_and_match_the_kernel_switch() {
        use petite_graph::{BinaryOp::*, CompareOp::*, UnaryOp::*};
        let ops = [
            EwOp::Copy,
            EwOp::Binary(Add),
            EwOp::Binary(Sub),
            EwOp::Binary(Mul),
            EwOp::Binary(Div),
            EwOp::Compare(Lt),
            EwOp::Compare(Le),
            EwOp::Compare(Eq),
            EwOp::Compare(Ne),
            EwOp::Compare(Gt),
            EwOp::Compare(Ge),
            EwOp::Logical(LogicalOp::And),
            EwOp::Logical(LogicalOp::Or),
            EwOp::Not,
            EwOp::Unary(Neg),
            EwOp::Unary(Exp),
            EwOp::Unary(Sqrt),
            EwOp::Unary(Rsqrt),
            EwOp::Unary(Sin),
            EwOp::Unary(Cos),
            EwOp::Unary(Tanh),
            EwOp::Unary(GeluTanh),
            EwOp::Unary(Silu),
            EwOp::Where,
        ];
        let mut codes: Vec<i32> = ops.iter().map(|o| o.code()).collect();
        codes.sort();
        codes.dedup();
        assert_eq!(codes.len(), ops.len());
        let s = module_source();
        for o in ops {
            let c = o.code();
            // every arithmetic/unary code has a case; the rest are tested by range in pt_ew
            if (1..=4).contains(&c) || (30..=38).contains(&c) {
                assert!(s.contains(&format!("case {c}:")), "{o:?}");
            }
        }
        // the f32 GELU constant is PyTorch's kBeta = sqrt(2)·(2/sqrt(pi))·0.5
        let k_beta = (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
        let lit: f32 = "0.7978845608028654".parse().unwrap();
        assert!(s.contains("0.7978845608028654f") && lit == k_beta);
    }

    #[test]
    fn dtype_codes_match_the_defines() {
        let s = module_source();
        for (d, name) in [
            (Dtype::F32, "DT_F32"),
            (Dtype::Bf16, "DT_BF16"),
            (Dtype::F16, "DT_F16"),
            (Dtype::I64, "DT_I64"),
            (Dtype::I32, "DT_I32"),
            (Dtype::U8, "DT_U8"),
            (Dtype::Bool, "DT_BOOL"),
        ] {
            assert!(s.contains(&format!("#define {name} {}\n", dtype_code(d))));
        }
    }
}
