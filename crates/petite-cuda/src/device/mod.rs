//! Device 0: what can run here ([`probe`]), the context, stream, cuBLAS handle and kernels
//! ([`Device`]), and device values ([`DevTensor`]).
//!
//! By concept: here the [`Device`] (opened once: context, stream, cuBLAS handle, the fixed
//! module's kernels) and the load trace; `available` says what can run here, `compile` turns
//! CUDA C into machine code (NVRTC, the kernel cache), `memory` holds device values and their
//! transfers, `launch` launches kernels, `blas` runs cuBLAS GEMMs, and `graph` records and
//! replays CUDA graphs.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{CudaBlas, sys as bsys};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, sys as dsys};
use cudarc::nvrtc::Ptx;

use crate::settings::Settings;
use crate::source::KERNELS;
use crate::{Error, Result, blas, driver};

mod available;
mod blas;
mod compile;
mod graph;
mod launch;
mod memory;
#[cfg(test)]
mod tests;

pub use available::{DeviceInfo, Probe, probe};
pub(crate) use compile::compile_fused;
pub use compile::compile_machine_code;
use compile::ptx_for;
pub use graph::{Graph, Mark};
pub use memory::DevTensor;

/// Where loading spends its time, on stderr, when `on` (`PETITE_CUDA_TRACE`:
/// [`Settings::trace`]).
pub(crate) fn trace(on: bool, msg: std::fmt::Arguments<'_>) {
    if on {
        eprintln!("petite-cuda: {msg}");
    }
}

/// Device 0 with a context, a stream, a cuBLAS handle and the kernels loaded.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: HashMap<&'static str, CudaFunction>,
    info: DeviceInfo,
    pool: Option<dsys::CUmemoryPool>,
    compile_seconds: f64,
    /// Whether kernels launch with programmatic dependent launch ([`Device::raw_launch`]).
    pdl: bool,
    /// What it was opened with.
    settings: Settings,
    /// cuBLAS's workspace, set explicitly so that GEMMs inside a graph capture allocate nothing.
    _workspace: CudaSlice<u8>,
}

/// cuBLAS workspace bytes (what cuBLAS documents for Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("info", &self.info).finish()
    }
}

/// How a GEMM whose operands are f32 is computed (16-bit operands always run on tensor cores
/// with f32 accumulation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum F32Matmul {
    /// Exact f32, no TF32: the parity mode, and what lerobot's eager PyTorch does.
    #[default]
    Exact,
    /// TF32 tensor cores with f32 accumulation: what lerobot's `compile_model=True` sets
    /// (`torch.set_float32_matmul_precision("high")`), for the f32 products of a bf16 program
    /// (its SigLIP), whose error bound is bf16's.
    Tf32,
}

impl Device {
    /// Opens device 0 with this process's `PETITE_CUDA_*` settings ([`Settings::from_env`]; a
    /// malformed one is [`Error::Setting`]): [`Device::open_with`].
    pub fn open() -> Result<Self> {
        Self::open_with(Settings::from_env()?)
    }

    /// Opens device 0 with `settings`: refuses in one line ([`Error::Unavailable`]) where the
    /// driver, a device, cuBLAS or NVRTC is missing; compiles the kernels (once per process).
    pub fn open_with(settings: Settings) -> Result<Self> {
        let probe = probe();
        probe.usable()?;
        let info = probe
            .device
            .clone()
            .ok_or_else(|| Error::Unavailable("the driver reports no device".into()))?;
        let ctx = CudaContext::new(0).map_err(driver("create context on device 0"))?;
        // One stream, in order: cudarc's per-buffer events would only cost time.
        // SAFETY: every buffer of this crate is used on this one stream only.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(driver("create stream"))?;
        let cublas = CudaBlas::new(stream.clone()).map_err(blas("create handle"))?;
        // Plain f32 GEMMs stay exact f32: no TF32 tensor-op math.
        // SAFETY: a valid handle.
        unsafe {
            bsys::cublasSetMathMode(*cublas.handle(), bsys::cublasMath_t::CUBLAS_DEFAULT_MATH)
        }
        .result()
        .map_err(blas("set math mode"))?;
        // SAFETY: uninitialised scratch that only cuBLAS writes.
        let workspace = unsafe { stream.alloc::<u8>(BLAS_WORKSPACE) }
            .map_err(driver("allocate the cuBLAS workspace"))?;
        {
            let (wp, _s) = workspace.device_ptr(&stream);
            // SAFETY: a live buffer of BLAS_WORKSPACE bytes, kept as long as the handle.
            unsafe {
                bsys::cublasSetWorkspace_v2(
                    *cublas.handle(),
                    wp as *mut std::ffi::c_void,
                    BLAS_WORKSPACE,
                )
            }
            .result()
            .map_err(blas("set workspace"))?;
        }
        let (ptx, compile_seconds) = ptx_for(info.compute_capability, &settings)?;
        trace(
            settings.trace,
            format_args!(
                "{} (sm_{}{}) opened, kernels compiled in {compile_seconds:.2} s",
                info.name, info.compute_capability.0, info.compute_capability.1
            ),
        );
        let module = ctx
            .load_module(ptx)
            .map_err(driver("load the kernels' PTX"))?;
        let mut funcs = HashMap::new();
        for k in KERNELS {
            funcs.insert(
                *k,
                module
                    .load_function(k)
                    .map_err(driver(format!("load kernel {k}")))?,
            );
        }
        // Keep freed memory in the pool (default: returned to the OS at every sync), so the
        // steps reuse what the prefix freed without new driver allocations.
        let pool = if ctx.has_async_alloc() {
            let mut pool: dsys::CUmemoryPool = std::ptr::null_mut();
            // SAFETY: valid device and out pointer; the attribute takes a u64.
            unsafe {
                dsys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                    .result()
                    .map_err(driver("default memory pool"))?;
                let mut keep: u64 = u64::MAX;
                dsys::cuMemPoolSetAttribute(
                    pool,
                    dsys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&mut keep as *mut u64).cast(),
                )
                .result()
                .map_err(driver("memory pool release threshold"))?;
            }
            Some(pool)
        } else {
            None
        };
        // Programmatic dependent launch needs sm_90 (on there: session 15's bf16 chunk 31.40 →
        // 30.60 ms on the H200, the same bits; docs/MEASUREMENTS.md).
        let pdl = info.compute_capability.0 >= 9;
        Ok(Device {
            ctx,
            stream,
            blas: cublas,
            funcs,
            info,
            pool,
            compile_seconds,
            pdl,
            settings,
            _workspace: workspace,
        })
    }

    /// Device 0's name, compute capability and memory.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// What it was opened with: the kernel cache, upload threads, trace, profile and tuning its
    /// programs load and run with.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Where loading spends its time, on stderr, when [`Settings::trace`].
    /// Prints `msg` to stderr where [`crate::Settings::trace`] is on (`PETITE_CUDA_TRACE`).
    pub fn trace(&self, msg: std::fmt::Arguments<'_>) {
        trace(self.settings.trace, msg)
    }

    /// Seconds NVRTC took for the kernels when this device was opened (0 when the process had
    /// compiled them already).
    pub fn compile_seconds(&self) -> f64 {
        self.compile_seconds
    }

    /// The stream every launch of this device goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for everything queued.
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver("synchronize"))
    }

    /// The context (for page-locked staging buffers and events).
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device address of `t`'s first element.
    pub(crate) fn ptr(&self, t: &DevTensor) -> u64 {
        let (p, _sync) = t.buf.device_ptr(&self.stream);
        p + t.off as u64
    }

    pub(crate) fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs
            .get(name)
            .ok_or_else(|| Error::Plan(format!("no kernel {name}")))
    }

    /// Loads `names` from a module compiled by [`compile_fused`].
    pub(crate) fn load_functions(&self, ptx: Ptx, names: &[String]) -> Result<Vec<CudaFunction>> {
        let module = self
            .ctx
            .load_module(ptx)
            .map_err(driver("load the fused kernels' PTX"))?;
        let fs = names
            .iter()
            .map(|k| {
                module
                    .load_function(k)
                    .map_err(driver(format!("load kernel {k}")))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(fs)
    }
}
