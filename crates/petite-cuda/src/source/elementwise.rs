//! The elementwise kernel `pt_ew`: its parameter block, the per-op arithmetic that fused
//! kernels share, and the strided kernel itself.

use super::layout::{Layout, layout};

pub(super) const EW_STRUCT: &str = r#"
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

pub(super) const EW_FUNCS: &str = r#"

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

pub(super) const EW: &str = r#"
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

/// `pt_ew`'s block ([`EW_STRUCT`]).
#[rustfmt::skip] // a table: the C struct's fields, in its order
pub(super) fn ew_params() -> Layout {
    layout!(EwParams {
        n, rank, op, cls, contig, da, db, dc, dout, scalar, scalar_lhs, fs, is, dims, sa, sb, sc,
        so, oa, ob, oc, oo
    })
}
