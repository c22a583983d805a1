//! The CUDA C every module starts with: integer types, dtype codes and the exact bf16/f16
//! loads and stores, programmatic-dependent-launch macros, and asynchronous copies into shared
//! memory.

pub(super) const PRELUDE: &str = r#"
#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2
#define DT_I64 3
#define DT_I32 4
#define DT_U8 5
#define DT_BOOL 6
#define DT_I8 7
#define DT_F8E4M3 8
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
// A member's byte offset, a constant (the parameter blocks' layout checks): NVRTC has no
// <cstddef>, and no __builtin_offsetof before 13.4 (its front end's __INTADDR__ there).
#if defined(__CUDACC_RTC__) && (__CUDACC_VER_MAJOR__ * 100 + __CUDACC_VER_MINOR__ < 1304)
#define PT_OFFSETOF(T, m) ((unsigned long long)__INTADDR__(&((T*)0)->m))
#else
#define PT_OFFSETOF(T, m) __builtin_offsetof(T, m)
#endif

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

/// Asynchronous copies into shared memory (`cp.async`, sm_80 and later; plain copies before)
/// and the bf16 tensor-core product (`at_mma`), after [`PRELUDE`] in the fixed module
/// (`pt_attn_tf32`'s copies, `pt_wq_gemm`'s products) and in every fused source (the attention
/// module's kernels use both).
pub(super) const CP_ASYNC: &str = r#"
// d += a·b on the tensor cores: m16n8k16, bf16 operands, f32 accumulation (sm_80 and later;
// the host launches its callers only there).
__device__ __forceinline__ void at_mma(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

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
