//! What can run here: the driver, cuBLAS and NVRTC libraries and device 0 ([`probe`]), asked
//! before any work.

use cudarc::cublas::sys as bsys;
use cudarc::driver::sys as dsys;

#[cfg(doc)]
use super::Device;
use crate::{Error, Result, driver};

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
