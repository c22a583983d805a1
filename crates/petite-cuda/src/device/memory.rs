//! Device values ([`DevTensor`]): allocation, uploads and downloads, copies, and the memory
//! pools' statistics.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, sys as dsys};
use petite_graph::Dtype;
use petite_reference::Tensor;

use super::Device;
use crate::{Error, Result, driver};

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

impl Device {
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

    /// Queues a copy of `bytes` into the first `bytes.len()` bytes of `dst` on the stream,
    /// after the work queued before it. From pageable memory the driver stages `bytes` before
    /// it returns, so the caller may reuse them at once (CUDA's API synchronization behavior).
    pub fn write(&self, dst: &DevTensor, bytes: &[u8]) -> Result<()> {
        if bytes.len() > dst.bytes() {
            return Err(Error::Plan(format!(
                "{} bytes written into {dst:?} of {} bytes",
                bytes.len(),
                dst.bytes()
            )));
        }
        if bytes.is_empty() {
            return Ok(());
        }
        // SAFETY: a live buffer of at least `bytes.len()` past its pointer, on this stream;
        // the source is staged by the driver before the call returns.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(self.ptr(dst), bytes, self.stream.cu_stream())
        }
        .map_err(driver("copy to the device"))
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
}
