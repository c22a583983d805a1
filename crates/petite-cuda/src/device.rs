//! Device 0: what can run here ([`probe`]), the context, stream, cuBLAS handle and kernels
//! ([`Device`]), and device values ([`DevTensor`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::{CudaBlas, sys as bsys};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, sys as dsys,
};
use cudarc::nvrtc::{CompileOptions, Ptx};
use petite_graph::Dtype;
use petite_reference::Tensor;

use crate::plan::{BLOCK, Gemm, PtrParams, grid_for};
use crate::source::{KERNELS, module_source};
use crate::{Error, Result, blas, driver};

/// What [`probe`] found: each library's version, or why it is missing, and device 0.
#[derive(Debug, Clone)]
pub struct Probe {
    /// The driver's CUDA version (`13.0`), or why there is none.
    pub driver: std::result::Result<String, String>,
    /// cuBLAS's version, or why it is missing.
    pub cublas: std::result::Result<String, String>,
    /// NVRTC's version, or why it is missing.
    pub nvrtc: std::result::Result<String, String>,
    /// Device 0, when the driver has one.
    pub device: Option<DeviceInfo>,
}

impl Probe {
    /// `Ok` when [`Device::open`] can work here; else the one-line reason.
    pub fn usable(&self) -> Result<()> {
        let missing = |what: &str, r: &std::result::Result<String, String>| {
            r.as_ref().err().map(|e| format!("{what}: {e}"))
        };
        if let Some(m) = missing("driver", &self.driver)
            .or_else(|| missing("cuBLAS", &self.cublas))
            .or_else(|| missing("NVRTC", &self.nvrtc))
        {
            return Err(Error::Unavailable(m));
        }
        if self.device.is_none() {
            return Err(Error::Unavailable("the driver reports no device".into()));
        }
        Ok(())
    }
}

/// Device 0 as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device name.
    pub name: String,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Device memory, bytes.
    pub total_memory: u64,
    /// The most shared memory a block may ask for (the opt-in limit: 227 KiB on an H100/H200,
    /// ~99 KiB on consumer GPUs), bytes.
    pub max_shared_per_block: u32,
}

/// Looks for the driver, cuBLAS and NVRTC libraries and device 0, loading each library only
/// if present (cudarc's loaded functions panic when their library is missing). Never panics.
pub fn probe() -> Probe {
    // SAFETY: each call only tries to dlopen the library by its usual names.
    let have_driver = unsafe { dsys::is_culib_present() };
    let have_blas = unsafe { bsys::is_culib_present() };
    let have_nvrtc = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    let driver = if !have_driver {
        Err("no libcuda (the NVIDIA driver) found".to_string())
    } else {
        cudarc::driver::result::init()
            .map_err(|e| format!("cuInit failed: {e}"))
            .and_then(|_| {
                let mut v = 0;
                // SAFETY: the library is present and initialised; `v` is a valid out pointer.
                unsafe { dsys::cuDriverGetVersion(&mut v) }
                    .result()
                    .map_err(|e| format!("cuDriverGetVersion: {e}"))?;
                Ok(format!("{}.{}", v / 1000, (v % 1000) / 10))
            })
    };
    let cublas = if !have_blas {
        Err("no libcublas found".to_string())
    } else {
        let get = |t| {
            let mut v = 0;
            // SAFETY: the library is present; `v` is a valid out pointer.
            unsafe { bsys::cublasGetProperty(t, &mut v) }
                .result()
                .map(|_| v)
                .map_err(|e| format!("cublasGetProperty: {e}"))
        };
        use bsys::libraryPropertyType_t as P;
        (|| {
            Ok(format!(
                "{}.{}.{}",
                get(P::MAJOR_VERSION)?,
                get(P::MINOR_VERSION)?,
                get(P::PATCH_LEVEL)?
            ))
        })()
    };
    let nvrtc = if !have_nvrtc {
        Err("no libnvrtc found".to_string())
    } else {
        let (mut a, mut b) = (0, 0);
        // SAFETY: the library is present; both are valid out pointers.
        unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) }
            .result()
            .map(|_| format!("{a}.{b}"))
            .map_err(|e| format!("nvrtcVersion: {e}"))
    };
    let device = driver.as_ref().ok().and_then(|_| device_info().ok());
    Probe {
        driver,
        cublas,
        nvrtc,
        device,
    }
}

fn device_info() -> Result<DeviceInfo> {
    use cudarc::driver::result::device;
    let n = device::get_count().map_err(driver("cuDeviceGetCount"))?;
    if n < 1 {
        return Err(Error::Unavailable("the driver reports no device".into()));
    }
    let dev = device::get(0).map_err(driver("cuDeviceGet"))?;
    let attr = |a| {
        // SAFETY: `dev` came from cuDeviceGet after cuInit.
        unsafe { device::get_attribute(dev, a) }.map_err(driver("cuDeviceGetAttribute"))
    };
    let major = attr(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    // SAFETY: as above.
    let total = unsafe { device::total_mem(dev) }.map_err(driver("cuDeviceTotalMem"))?;
    // Unknown: 0, so nothing that needs more than the default is launched.
    let shared =
        attr(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .unwrap_or(0);
    Ok(DeviceInfo {
        name: device::get_name(dev).unwrap_or_default(),
        compute_capability: (major, minor),
        total_memory: total as u64,
        max_shared_per_block: u32::try_from(shared).unwrap_or(0),
    })
}

/// The kernels module for compute capability `cc`, kept for the process: NVRTC runs once.
fn ptx_for(cc: (i32, i32)) -> Result<(Ptx, f64)> {
    compile_cached(cc, &module_source(), "petite_kernels.cu")
}

/// A program's fused kernels compiled for `cc` (any thread: needs NVRTC, not the context).
pub(crate) fn compile_fused(cc: (i32, i32), source: &str) -> Result<(Ptx, f64)> {
    compile_cached(cc, source, "petite_fused.cu")
}

/// Compiles `source` for the device of compute capability `cc` with petite's arithmetic
/// options, once per process per source (reference engines of one shape share their fused
/// kernels). Machine code (CUBIN for `sm_XY`) when NVRTC knows the architecture, so the driver
/// has nothing to JIT at load (a first-run cost of seconds for many fused modules); else PTX
/// for `compute_XY`, which the driver compiles.
fn compile_cached(cc: (i32, i32), source: &str, name: &str) -> Result<(Ptx, f64)> {
    compile_cached_in(cc, source, name, crate::kcache::dir())
}

/// Compilations run in this process through [`compile_cached_in`] (its check).
#[cfg(test)]
static COMPILED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// [`compile_cached`] with the disk cache in `disk` (`None`: none). One thread compiles a
/// source; any other asking for it meanwhile waits for that image instead of compiling it
/// again (`petite verify`'s two stages each open a device, and each needs the fixed module).
/// A failure is not kept: the next request tries again.
fn compile_cached_in(
    cc: (i32, i32),
    source: &str,
    name: &str,
    disk: Option<std::path::PathBuf>,
) -> Result<(Ptx, f64)> {
    /// An image by (compute capability, source), or the compilation under way.
    type Cell = Arc<OnceLock<std::result::Result<(Ptx, f64), String>>>;
    type Cells = HashMap<((i32, i32), String), Cell>;
    static CACHE: OnceLock<Mutex<Cells>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (cc, source.to_string());
    let cell = cache
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(key.clone())
        .or_default()
        .clone();
    let mut here = false;
    let done = cell.get_or_init(|| {
        here = true;
        #[cfg(test)]
        COMPILED.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        compile_uncached(cc, source, name, disk).map_err(|e| e.to_string())
    });
    match done {
        // Seconds only for the request that compiled: the others found it compiled.
        Ok((image, secs)) => Ok((image.clone(), if here { *secs } else { 0.0 })),
        Err(e) => {
            let mut map = cache.lock().unwrap_or_else(|p| p.into_inner());
            if map.get(&key).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                map.remove(&key);
            }
            Err(Error::Compile(e.clone()))
        }
    }
}

/// `source` from the disk cache in `disk` when it holds it, else compiled (and written there).
fn compile_uncached(
    cc: (i32, i32),
    source: &str,
    name: &str,
    disk: Option<std::path::PathBuf>,
) -> Result<(Ptx, f64)> {
    let t0 = std::time::Instant::now();
    let opts = cubin_options(cc);
    // Machine code from an earlier process, when the disk cache holds it ([`crate::kcache`]).
    let cached = nvrtc_version()
        .ok()
        .and_then(|v| Some(disk?.join(crate::kcache::file_name(&v, cc, &opts, source))));
    if let Some(code) = cached
        .as_deref()
        .and_then(|p| crate::kcache::read(p, source))
    {
        trace(format_args!("{name}: machine code from the disk cache"));
        return Ok((Ptx::from_binary(code), 0.0));
    }
    let image = match compile_cubin(cc, source, name) {
        Ok(bin) => {
            if let Some(p) = &cached
                && let Err(e) = crate::kcache::write(p, source, &bin)
            {
                trace(format_args!("{}: not cached: {e}", p.display()));
            }
            Ptx::from_binary(bin)
        }
        Err(_) => {
            let arch: &'static str =
                Box::leak(format!("compute_{}{}", cc.0, cc.1).into_boxed_str());
            let opts = CompileOptions {
                // Exact f32 division and square root, no flush to zero, no contraction into
                // FMAs: the reference executor's arithmetic, op for op.
                ftz: Some(false),
                prec_div: Some(true),
                prec_sqrt: Some(true),
                fmad: Some(false),
                arch: Some(arch),
                name: Some(name.into()),
                ..Default::default()
            };
            cudarc::nvrtc::compile_ptx_with_opts(source, opts)
                .map_err(|e| Error::Compile(e.to_string()))?
        }
    };
    Ok((image, t0.elapsed().as_secs_f64()))
}

/// NVRTC's options for machine code for `sm_XY` (the same arithmetic as the PTX path).
fn cubin_options(cc: (i32, i32)) -> Vec<String> {
    vec![
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--prec-sqrt=true".to_string(),
        "--fmad=false".to_string(),
        format!("--gpu-architecture=sm_{}{}", cc.0, cc.1),
    ]
}

/// NVRTC's version, `major.minor` (part of the disk cache's key).
fn nvrtc_version() -> Result<String> {
    let (mut a, mut b) = (0, 0);
    // SAFETY: both are valid out pointers; fails cleanly where the library is missing.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) }
        .result()
        .map(|_| format!("{a}.{b}"))
        .map_err(|e| Error::Compile(format!("nvrtcVersion: {e}")))
}

/// Where loading spends its time, on stderr, when `PETITE_CUDA_TRACE` is set.
pub(crate) fn trace(msg: std::fmt::Arguments<'_>) {
    static ON: OnceLock<bool> = OnceLock::new();
    if *ON.get_or_init(|| std::env::var_os("PETITE_CUDA_TRACE").is_some()) {
        eprintln!("petite-cuda: {msg}");
    }
}

/// `source` compiled by NVRTC to machine code for `sm_XY` with the runtime's options, as a
/// program's load does but past both caches (no device needed, only libnvrtc): what
/// `examples/nvrtc_bench.rs` times.
pub fn compile_machine_code(cc: (i32, i32), source: &str) -> Result<Vec<u8>> {
    compile_cubin(cc, source, "petite_bench.cu")
}

/// NVRTC straight to machine code for `sm_XY` (the same options as the PTX path).
fn compile_cubin(cc: (i32, i32), source: &str, name: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    let src = std::ffi::CString::new(source).map_err(|e| Error::Compile(e.to_string()))?;
    let nm = std::ffi::CString::new(name).map_err(|e| Error::Compile(e.to_string()))?;
    let prog =
        result::create_program(&src, Some(&nm)).map_err(|e| Error::Compile(e.to_string()))?;
    let opts = cubin_options(cc);
    // SAFETY: `prog` is a live program created above and destroyed once below; the size
    // query precedes a buffer of that size.
    let out = unsafe {
        let r = result::compile_program(prog, &opts)
            .map_err(|e| Error::Compile(e.to_string()))
            .and_then(|()| {
                let mut n: usize = 0;
                sys::nvrtcGetCUBINSize(prog, &mut n)
                    .result()
                    .map_err(|e| Error::Compile(format!("CUBIN size: {e}")))?;
                let mut buf = vec![0u8; n];
                sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast())
                    .result()
                    .map_err(|e| Error::Compile(format!("CUBIN: {e}")))?;
                Ok(buf)
            });
        let _ = result::destroy_program(prog);
        r
    };
    match out {
        Ok(b) if !b.is_empty() => Ok(b),
        Ok(_) => Err(Error::Compile("empty CUBIN".into())),
        Err(e) => Err(e),
    }
}

/// A value on the device: a byte buffer shared by the values that alias it (reshapes), its
/// dtype and shape (row-major, dense).
#[derive(Clone)]
pub struct DevTensor {
    pub(crate) buf: Arc<CudaSlice<u8>>,
    pub(crate) off: usize,
    dtype: Dtype,
    shape: Vec<usize>,
}

impl std::fmt::Debug for DevTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevTensor({}{:?})", self.dtype.name(), self.shape)
    }
}

impl DevTensor {
    /// Dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }
    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Bytes.
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
    /// The same bytes with another shape of as many elements.
    /// The `shape` value starting `byte_off` bytes into this one's buffer (a part of a
    /// batched weight or GEMM output).
    pub(crate) fn view(&self, byte_off: usize, shape: &[usize]) -> DevTensor {
        DevTensor {
            buf: self.buf.clone(),
            off: self.off + byte_off,
            dtype: self.dtype,
            shape: shape.to_vec(),
        }
    }

    pub(crate) fn reshaped(&self, shape: &[usize]) -> DevTensor {
        DevTensor {
            buf: self.buf.clone(),
            off: self.off,
            dtype: self.dtype,
            shape: shape.to_vec(),
        }
    }
}

/// A point on the device's stream ([`Device::mark`]).
pub struct Mark(cudarc::driver::CudaEvent);

impl Mark {
    /// Milliseconds of device time from `self` to `later` (waits for both).
    pub fn ms_to(&self, later: &Mark) -> Result<f64> {
        self.0
            .elapsed_ms(&later.0)
            .map(f64::from)
            .map_err(driver("event elapsed time"))
    }
}

/// A captured sequence of the stream's work, replayed as one CUDA graph launch.
pub struct Graph(cudarc::driver::CudaGraph);

impl Graph {
    /// Queues one replay on the stream it was captured from.
    pub fn launch(&self) -> Result<()> {
        self.0.launch().map_err(driver("launch graph"))
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
    /// Looped GEMMs as one pointer-batched GEMM ([`Device::gemm_loops`]).
    ptr_batch: bool,
    /// cuBLAS's workspace, set explicitly so that GEMMs inside a graph capture allocate nothing.
    _workspace: CudaSlice<u8>,
}

/// A kernel's arguments for [`Device::launch`]: a pointer to each value, in the kernel's
/// parameter order (what `cuLaunchKernelEx` takes); the values outlive the launch (`'a`).
pub(crate) struct Args<'a> {
    ptrs: Vec<*mut std::ffi::c_void>,
    _values: std::marker::PhantomData<&'a ()>,
}

impl<'a> Args<'a> {
    fn new() -> Self {
        Args {
            ptrs: Vec::with_capacity(16),
            _values: std::marker::PhantomData,
        }
    }

    /// Appends the next parameter (its bytes are copied at launch).
    pub(crate) fn arg<T>(&mut self, v: &'a T) -> &mut Self {
        self.ptrs.push((v as *const T).cast_mut().cast());
        self
    }
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
    /// Opens device 0: refuses in one line ([`Error::Unavailable`]) where the driver, a device,
    /// cuBLAS or NVRTC is missing; compiles the kernels (once per process).
    pub fn open() -> Result<Self> {
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
        let (ptx, compile_seconds) = ptx_for(info.compute_capability)?;
        trace(format_args!(
            "{} (sm_{}{}) opened, kernels compiled in {compile_seconds:.2} s",
            info.name, info.compute_capability.0, info.compute_capability.1
        ));
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
        // Programmatic dependent launch needs sm_90; `PETITE_CUDA_NO_PDL=1` turns it off.
        let pdl =
            info.compute_capability.0 >= 9 && std::env::var_os("PETITE_CUDA_NO_PDL").is_none();
        Ok(Device {
            ctx,
            stream,
            blas: cublas,
            funcs,
            info,
            pool,
            compile_seconds,
            pdl,
            ptr_batch: std::env::var_os("PETITE_CUDA_NO_PTR_BATCH").is_none(),
            _workspace: workspace,
        })
    }

    /// Device 0's name, compute capability and memory.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
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

    /// The most bytes this process's buffers held at once since the last
    /// [`Device::reset_peak`] (the stream-ordered pool's high-water mark; `None` without one),
    /// plus the most the driver reserved for CUDA graphs' own buffers (a captured program's
    /// values, kept between its replays).
    pub fn peak_bytes(&self) -> Option<u64> {
        let pool = self.pool_attr(dsys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?;
        // What the graphs hold now counts even where a reset left the mark below it; a driver
        // that cannot say leaves the pool's figure (graphs then counted as none).
        let graph = |a| self.graph_attr(a).unwrap_or(0);
        let graphs = graph(dsys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH).max(
            graph(dsys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT),
        );
        Some(pool + graphs)
    }

    fn graph_attr(&self, a: dsys::CUgraphMem_attribute) -> Option<u64> {
        let mut v: u64 = 0;
        // SAFETY: a valid device; these attributes are u64.
        unsafe {
            dsys::cuDeviceGetGraphMemAttribute(self.ctx.cu_device(), a, (&mut v as *mut u64).cast())
        }
        .result()
        .ok()?;
        Some(v)
    }

    /// Bytes the buffers hold now.
    pub fn used_bytes(&self) -> Option<u64> {
        self.pool_attr(dsys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    /// Starts a new high-water mark for [`Device::peak_bytes`].
    pub fn reset_peak(&self) -> Result<()> {
        if let Some(pool) = self.pool {
            let mut zero: u64 = 0;
            // SAFETY: a valid pool; the attribute takes a u64 (only 0 is allowed).
            unsafe {
                dsys::cuMemPoolSetAttribute(
                    pool,
                    dsys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                    (&mut zero as *mut u64).cast(),
                )
            }
            .result()
            .map_err(driver("reset the pool's high-water mark"))?;
        }
        let mut zero: u64 = 0;
        // SAFETY: a valid device; the attribute takes a u64 (only 0 is allowed).
        unsafe {
            dsys::cuDeviceSetGraphMemAttribute(
                self.ctx.cu_device(),
                dsys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_HIGH,
                (&mut zero as *mut u64).cast(),
            )
        }
        .result()
        .map_err(driver("reset the graphs' high-water mark"))?;
        Ok(())
    }

    fn pool_attr(&self, a: dsys::CUmemPool_attribute) -> Option<u64> {
        let pool = self.pool?;
        let mut v: u64 = 0;
        // SAFETY: a valid pool; these attributes are u64.
        unsafe { dsys::cuMemPoolGetAttribute(pool, a, (&mut v as *mut u64).cast()) }
            .result()
            .ok()?;
        Some(v)
    }

    /// (free, total) device memory as the driver reports it.
    pub fn mem_info(&self) -> Result<(u64, u64)> {
        let (f, t) = self.ctx.mem_get_info().map_err(driver("cuMemGetInfo"))?;
        Ok((f as u64, t as u64))
    }

    /// A new uninitialised buffer for `dtype[shape]`.
    pub fn alloc(&self, dtype: Dtype, shape: &[usize]) -> Result<DevTensor> {
        let n: usize = shape.iter().product::<usize>() * dtype.size();
        // SAFETY: uninitialised device memory; every caller writes it before reading.
        let buf = unsafe { self.stream.alloc::<u8>(n.max(1)) }
            .map_err(driver(format!("allocate {n} bytes")))?;
        Ok(DevTensor {
            buf: Arc::new(buf),
            off: 0,
            dtype,
            shape: shape.to_vec(),
        })
    }

    /// A new zeroed buffer.
    pub fn zeros(&self, dtype: Dtype, shape: &[usize]) -> Result<DevTensor> {
        let n: usize = shape.iter().product::<usize>() * dtype.size();
        let buf = self
            .stream
            .alloc_zeros::<u8>(n.max(1))
            .map_err(driver(format!("allocate {n} bytes")))?;
        Ok(DevTensor {
            buf: Arc::new(buf),
            off: 0,
            dtype,
            shape: shape.to_vec(),
        })
    }

    /// Copies little-endian element bytes to a new device value (waits for the copy).
    pub fn upload_bytes(&self, dtype: Dtype, shape: &[usize], bytes: &[u8]) -> Result<DevTensor> {
        let t = self.alloc(dtype, shape)?;
        if bytes.len() != t.bytes() {
            return Err(Error::Plan(format!(
                "{} bytes for {}{shape:?}",
                bytes.len(),
                dtype.name()
            )));
        }
        if !bytes.is_empty() {
            let mut buf =
                Arc::into_inner(t.buf).ok_or_else(|| Error::Plan("shared new buffer".into()))?;
            self.stream
                .memcpy_htod(bytes, &mut buf)
                .map_err(driver("copy to the device"))?;
            self.synchronize()?;
            return Ok(DevTensor {
                buf: Arc::new(buf),
                off: 0,
                dtype,
                shape: shape.to_vec(),
            });
        }
        Ok(t)
    }

    /// A host tensor on the device.
    pub fn upload(&self, t: &Tensor) -> Result<DevTensor> {
        self.upload_bytes(t.dtype(), t.shape(), &t.to_bytes())
    }

    /// A device value back on the host (waits for the stream).
    pub fn download(&self, t: &DevTensor) -> Result<Tensor> {
        let mut bytes = vec![0u8; t.bytes()];
        if !bytes.is_empty() {
            let view = t.buf.slice(t.off..t.off + t.bytes());
            self.stream
                .memcpy_dtoh(&view, &mut bytes)
                .map_err(driver("copy to the host"))?;
        }
        self.synchronize()?;
        Ok(Tensor::from_bytes(t.dtype(), t.shape(), &bytes)?)
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

    /// Launches `f` (a kernel of [`Device::load_functions`]) with `cfg`, `args` pushing
    /// its arguments.
    pub(crate) fn launch_fn<'a>(
        &'a self,
        f: &'a CudaFunction,
        cfg: LaunchConfig,
        args: impl FnOnce(&mut Args<'a>),
    ) -> Result<()> {
        let mut a = Args::new();
        args(&mut a);
        // SAFETY: generated kernels take (n, input pointers…, output pointer), pushed by the
        // caller in that order; every pointer is a live buffer of this device sized for n.
        unsafe { self.raw_launch(f, cfg, None, a) }.map_err(driver("launch a fused kernel"))
    }

    /// [`Device::launch_fn`] in thread-block clusters of `cluster` blocks along x (sm_90 and
    /// later; `None`: no cluster), with `cfg`'s dynamic shared memory allowed past the 48 KiB
    /// default.
    pub(crate) fn launch_cluster_fn<'a>(
        &'a self,
        f: &'a CudaFunction,
        cfg: LaunchConfig,
        cluster: Option<u32>,
        args: impl FnOnce(&mut Args<'a>),
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(driver("bind the context"))?;
        f.set_attribute(
            dsys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            i32::try_from(cfg.shared_mem_bytes)
                .map_err(|_| Error::Plan("shared memory past i32".into()))?,
        )
        .map_err(driver("allow a kernel's shared memory"))?;
        let mut a = Args::new();
        args(&mut a);
        // SAFETY: as for `launch_fn`: the caller pushes the kernel's parameters in order, each
        // pointer a live buffer of this device sized for what the kernel reads and writes.
        unsafe { self.raw_launch(f, cfg, cluster, a) }.map_err(driver("launch a cluster kernel"))
    }

    /// `f` on this device's stream. Where the device has it (sm_90 and later), with
    /// programmatic dependent launch: the kernel may be scheduled while the one before it
    /// still runs — every kernel of this crate waits for its predecessor's completion and
    /// memory (`griddepcontrol.wait`, [`crate::source`]'s `PT_PDL`) before it reads or
    /// writes, and lets its successor be scheduled once all its blocks run — so the gap
    /// between two small kernels of a step shrinks; what each computes is unchanged.
    ///
    /// # Safety
    /// `args` must match `f`'s parameters and every pointer in them be valid for what `f`
    /// reads and writes with `cfg`.
    unsafe fn raw_launch(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        cluster: Option<u32>,
        mut args: Args<'_>,
    ) -> std::result::Result<(), cudarc::driver::DriverError> {
        self.ctx.bind_to_thread()?;
        // SAFETY: a zeroed attribute is a valid plain-data value; the id and the flag are set.
        let mut attrs: [dsys::CUlaunchAttribute; 2] = unsafe { std::mem::zeroed() };
        let mut n = 0;
        if self.pdl {
            attrs[n].id =
                dsys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if let Some(x) = cluster {
            attrs[n].id = dsys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim.x = x;
            attrs[n].value.clusterDim.y = 1;
            attrs[n].value.clusterDim.z = 1;
            n += 1;
        }
        let lc = dsys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: if n > 0 {
                attrs.as_mut_ptr()
            } else {
                std::ptr::null_mut()
            },
            numAttrs: n as u32,
        };
        // SAFETY: `lc` and `attr` live across the call; the caller vouches for `args`.
        unsafe {
            dsys::cuLaunchKernelEx(
                &lc,
                f.cu_function(),
                args.ptrs.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
    }

    /// A grid-stride launch over `n` elements.
    pub(crate) fn cfg_elems(n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (grid_for(n), 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// One block a row.
    pub(crate) fn cfg_rows(rows: usize) -> Result<LaunchConfig> {
        let r = u32::try_from(rows.max(1))
            .map_err(|_| Error::Plan(format!("{rows} rows exceed the grid")))?;
        Ok(LaunchConfig {
            grid_dim: (r, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// Launches kernel `name` with `cfg`, `args` pushing its arguments.
    pub(crate) fn launch<'a>(
        &'a self,
        name: &str,
        cfg: LaunchConfig,
        args: impl FnOnce(&mut Args<'a>),
    ) -> Result<()> {
        let f = self.func(name)?;
        let mut a = Args::new();
        args(&mut a);
        // SAFETY: the argument lists match the kernels' signatures (see `program.rs`), and every
        // pointer is a live buffer of this device large enough for what the kernel indexes.
        unsafe { self.raw_launch(f, cfg, None, a) }.map_err(driver(format!("launch {name}")))
    }

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
        // `PETITE_CUDA_NO_PTR_BATCH=1`: one GEMM a run (to compare).
        if loops <= 1 || g.m == 0 || g.n == 0 || !self.ptr_batch {
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

    /// A timing event recorded on the stream now (CUDA events: device time, not host time).
    pub fn mark(&self) -> Result<Mark> {
        let e = self
            .ctx
            .new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver("create event"))?;
        e.record(&self.stream).map_err(driver("record event"))?;
        Ok(Mark(e))
    }

    /// Captures the work `f` queues on the stream (nothing runs) into a [`Graph`]: `f` must not
    /// wait for the device; buffers it allocates and frees become the graph's own.
    pub fn capture<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<(R, Graph)> {
        self.stream
            .begin_capture(dsys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("begin capture"))?;
        let r = f();
        let g = self
            .stream
            .end_capture(dsys::CUgraphInstantiate_flags(0))
            .map_err(driver("end capture"));
        let r = r?;
        let g = g?.ok_or_else(|| Error::Plan("captured an empty graph".into()))?;
        Ok((r, Graph(g)))
    }

    /// Queues a copy of `src`'s bytes into `dst` (same dtype and element count).
    pub fn copy(&self, src: &DevTensor, dst: &DevTensor) -> Result<()> {
        if src.dtype() != dst.dtype() || src.numel() != dst.numel() {
            return Err(Error::Plan(format!("copy {src:?} into {dst:?}")));
        }
        if src.bytes() == 0 {
            return Ok(());
        }
        // SAFETY: both live buffers of at least `bytes` past their pointers, on this stream.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(
                self.ptr(dst),
                self.ptr(src),
                src.bytes(),
                self.stream.cu_stream(),
            )
        }
        .map_err(driver("copy on the device"))
    }

    /// Sets every byte of `t` to zero.
    pub(crate) fn memset_zero(&self, t: &DevTensor) -> Result<()> {
        if t.bytes() == 0 {
            return Ok(());
        }
        // SAFETY: a live buffer of at least `bytes` past `ptr`.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                self.ptr(t),
                0,
                t.bytes(),
                self.stream.cu_stream(),
            )
        }
        .map_err(driver("memset"))
    }

    pub(crate) fn push_u64<'a>(b: &mut Args<'a>, v: &'a u64) {
        b.arg(v);
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// The NVRTC tests fail, never skip, where libnvrtc cannot be loaded.
    fn assert_nvrtc_loads() {
        // SAFETY: only asks whether the dynamic library can be loaded.
        assert!(
            unsafe { cudarc::nvrtc::sys::is_culib_present() },
            "libnvrtc not found on the library path"
        );
    }

    /// Threads asking for one source at once (as `petite verify`'s two stages ask for the fixed
    /// module) get one compilation: one of them compiles and reports its seconds, the others
    /// wait for that image. Needs libnvrtc (the nvrtc tier runs it); no disk cache.
    #[test]
    #[ignore = "needs libnvrtc: cargo xtask conformance --only nvrtc"]
    fn concurrent_requests_for_one_source_compile_it_once() {
        assert_nvrtc_loads();
        use std::sync::atomic::Ordering;
        // A source no cache of this process holds: the fused prelude and a kernel of its own.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let src = format!(
            "{}extern \"C\" __global__ void pt_once_{nanos}(float* p) {{ PT_PDL(); p[threadIdx.x] = bf2f(f2bf(p[threadIdx.x])); }}\n",
            crate::source::fused_prelude()
        );
        let before = COMPILED.load(Ordering::SeqCst);
        let threads = 4;
        let start = std::sync::Barrier::new(threads);
        let seconds: Vec<f64> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        compile_cached_in((9, 0), &src, "petite_test.cu", None)
                            .expect("compiles")
                            .1
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        assert_eq!(COMPILED.load(Ordering::SeqCst) - before, 1, "{seconds:?}");
        assert_eq!(
            seconds.iter().filter(|&&s| s > 0.0).count(),
            1,
            "{seconds:?}"
        );
        // Asked again: the image kept, no compilation.
        let (_, again) = compile_cached_in((9, 0), &src, "petite_test.cu", None).unwrap();
        assert_eq!((again, COMPILED.load(Ordering::SeqCst) - before), (0.0, 1));
        // A source NVRTC refuses is an error each time it is asked for, never kept.
        let bad = format!("{src}this is not CUDA {nanos}\n");
        for _ in 0..2 {
            let e = compile_cached_in((9, 0), &bad, "petite_test.cu", None).unwrap_err();
            assert!(matches!(e, Error::Compile(_)), "{e}");
        }
        assert_eq!(COMPILED.load(Ordering::SeqCst) - before, 3);
    }

    /// NVRTC — nobody here wrote it; no GPU needed — compiles the fixed module, the attention module and every fused
    /// kernel source that `fuse::plan` generates for pi0.5's full-size bf16 and f32 programs,
    /// to machine code for the H200 (`sm_90`) and Jetson Orin (`sm_87`), with the options the
    /// runtime uses. Needs libnvrtc on the library path: `cargo xtask conformance --only nvrtc`
    /// installs it (pip) and runs this; without it the test fails, it never skips.
    #[test]
    #[ignore = "needs libnvrtc: cargo xtask conformance --only nvrtc"]
    fn nvrtc_compiles_every_generated_source_for_sm90_and_sm87() {
        assert_nvrtc_loads();
        let mut sources = vec![
            ("module".to_string(), module_source()),
            (
                "attention module".to_string(),
                crate::source::attention_module_source(),
            ),
        ];
        for (name, p) in &crate::pi05_programs() {
            // As run by default, with every bf16 attention fused, and with unrolled rows
            // (`PETITE_CUDA_UNROLL_ROWS=1`).
            for (queries, rows) in [(0, false), (usize::MAX, false), (0, true)] {
                let o = crate::fuse::Options {
                    unrolled_rows: rows,
                    ..crate::fuse::Options::new(queries)
                };
                let f = crate::fuse::plan_program(p, o).unwrap();
                let at = f.attention_kernels.map_or(f.kernels.len(), |[a, ..]| a);
                assert!(
                    f.kernels[..at]
                        .iter()
                        .all(|k| f.source.contains(k.as_str()))
                );
                assert!(!f.source.contains("pt_attn_"));
                if queries > 0 && f.attentions.is_empty() {
                    continue;
                }
                sources.push((
                    format!(
                        "{name} ({} kernels, attention up to {queries} queries{})",
                        f.kernels.len(),
                        if rows { ", unrolled rows" } else { "" }
                    ),
                    f.source,
                ));
            }
        }
        for cc in [(9, 0), (8, 7)] {
            for (what, src) in &sources {
                let image = compile_cubin(cc, src, "petite_test.cu")
                    .unwrap_or_else(|e| panic!("sm_{}{} {what}: {e}", cc.0, cc.1));
                eprintln!("sm_{}{} {what}: {} bytes of CUBIN", cc.0, cc.1, image.len());
                // Compile time follows code size: an unrolled loop over the dtype switches
                // once made the fixed module 1 MB and 16 s to compile (229 KB, ~1.6 s now).
                if what == "module" {
                    assert!(
                        image.len() < 512 << 10,
                        "sm_{}{}: the fixed module grew to {} bytes of CUBIN",
                        cc.0,
                        cc.1,
                        image.len()
                    );
                }
            }
        }
    }
}
