//! Kernel launches: argument lists ([`Args`]), grid shapes, and launches with programmatic
//! dependent launch or as thread-block clusters.

use cudarc::driver::{CudaFunction, LaunchConfig, sys as dsys};

use super::Device;
use crate::plan::{BLOCK, grid_for};
use crate::{Error, Result, driver};

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

impl Device {
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

    pub(crate) fn push_u64<'a>(b: &mut Args<'a>, v: &'a u64) {
        b.arg(v);
    }
}
