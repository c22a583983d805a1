//! cuBLAS GEMMs: one (strided-batched) GEMM, and pointer-batched GEMMs for runs of batches.

use cudarc::cublas::sys as bsys;
use petite_graph::Dtype;

use super::{Device, F32Matmul};
use crate::plan::{Gemm, PtrParams};
use crate::{Error, Result, blas};

/// cuBLAS's data type for a GEMM operand of dtype `d`.
fn blas_type(d: Dtype) -> Result<bsys::cudaDataType> {
    match d {
        Dtype::F32 => Ok(bsys::cudaDataType::CUDA_R_32F),
        Dtype::Bf16 => Ok(bsys::cudaDataType::CUDA_R_16BF),
        Dtype::F16 => Ok(bsys::cudaDataType::CUDA_R_16F),
        other => Err(Error::Plan(format!("GEMM of {}", other.name()))),
    }
}

/// cuBLAS's operation for an operand read transposed or not.
fn blas_op(t: bool) -> bsys::cublasOperation_t {
    if t {
        bsys::cublasOperation_t::CUBLAS_OP_T
    } else {
        bsys::cublasOperation_t::CUBLAS_OP_N
    }
}

/// f32 accumulation; f32 operands as TF32 where the program was set so.
fn compute_type(ab: Dtype, f32: F32Matmul) -> bsys::cublasComputeType_t {
    if ab == Dtype::F32 && f32 == F32Matmul::Tf32 {
        bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
    } else {
        bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F
    }
}

impl Device {
    /// `C = A·B` per [`Gemm`], with `A`, `B` of `ab` and `C` of `c` (f32 accumulation; f32
    /// operands as `f32` says).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm(
        &self,
        g: &Gemm,
        a: u64,
        b: u64,
        ab: Dtype,
        c: u64,
        cd: Dtype,
        f32: F32Matmul,
    ) -> Result<()> {
        if g.m == 0 || g.n == 0 || g.batch == 0 {
            return Ok(());
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: pointers are live device buffers sized by the planner for these dims and
        // strides; alpha/beta are host f32 (the handle's default pointer mode) for 32F compute.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                blas_op(g.trans_a),
                blas_op(g.trans_b),
                g.m,
                g.n,
                g.k,
                (&alpha as *const f32).cast(),
                a as *const std::ffi::c_void,
                blas_type(ab)?,
                g.lda,
                g.stride_a,
                b as *const std::ffi::c_void,
                blas_type(ab)?,
                g.ldb,
                g.stride_b,
                (&beta as *const f32).cast(),
                c as *mut std::ffi::c_void,
                blas_type(cd)?,
                g.ldc,
                g.stride_c,
                g.batch,
                compute_type(ab, f32),
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas(format!(
            "GEMM m={} n={} k={} batch={}",
            g.m, g.n, g.k, g.batch
        )))
    }

    /// [`Device::gemm`] run `loops` times, each operand stepped `steps` elements a run (A, B, C
    /// in cuBLAS's order), as one pointer-batched GEMM (`cublasGemmBatchedEx`, its pointer
    /// arrays written by `pt_ptrs` on the stream) instead of `loops` launches. Why: SigLIP's
    /// attention ran as three strided batches of its 16 heads a camera, six GEMMs a layer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_loops(
        &self,
        g: &Gemm,
        [a, b, c]: [u64; 3],
        ab: Dtype,
        cd: Dtype,
        f32: F32Matmul,
        loops: usize,
        steps: [i64; 3],
    ) -> Result<()> {
        // One GEMM a run where there is nothing to batch.
        if loops <= 1 || g.m == 0 || g.n == 0 {
            for i in 0..loops as u64 {
                let at = |p: u64, st: i64, d: Dtype| p + i * (st as u64) * d.size() as u64;
                self.gemm(
                    g,
                    at(a, steps[0], ab),
                    at(b, steps[1], ab),
                    ab,
                    at(c, steps[2], cd),
                    cd,
                    f32,
                )?;
            }
            return Ok(());
        }
        let prm = PtrParams::new(
            g,
            [a, b, c],
            [ab.size(), ab.size(), cd.size()],
            loops,
            steps,
        );
        let n = prm.n as usize;
        let ptrs = self.alloc(Dtype::I64, &[3 * n])?;
        let out = self.ptr(&ptrs);
        self.launch("pt_ptrs", Self::cfg_elems(n), |bl| {
            bl.arg(&prm);
            Self::push_u64(bl, &out);
        })?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let arr = |t: u64| (out + t * n as u64 * 8) as *const *const std::ffi::c_void;
        // SAFETY: the arrays hold `n` live device addresses each (written above on this
        // stream), sized by the planner as the strided form's; alpha/beta are host f32.
        let st = unsafe {
            bsys::cublasGemmBatchedEx(
                *self.blas.handle(),
                blas_op(g.trans_a),
                blas_op(g.trans_b),
                g.m,
                g.n,
                g.k,
                (&alpha as *const f32).cast(),
                arr(0),
                blas_type(ab)?,
                g.lda,
                arr(1),
                blas_type(ab)?,
                g.ldb,
                (&beta as *const f32).cast(),
                arr(2) as *const *mut std::ffi::c_void,
                blas_type(cd)?,
                g.ldc,
                n as i32,
                compute_type(ab, f32),
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        st.result().map_err(blas(format!(
            "pointer-batched GEMM m={} n={} k={} batch={n}",
            g.m, g.n, g.k
        )))
    }
}
