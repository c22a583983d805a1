//! The GPU on this machine, if any, through the CUDA driver API (cudarc, with `libcuda` loaded
//! at run time): petite builds without CUDA and runs where there is none. Used to pick what a
//! TensorRT builder targets and, on an integrated GPU (Jetson) whose memory is the host's, the
//! export's default memory budget.

use crate::tensorrt::{DEFAULT_RTX_TARGET, Tool};

/// What the driver reports of device 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Device name.
    pub name: String,
    /// Compute capability `(major, minor)`.
    pub compute_capability: (i32, i32),
    /// Device memory in bytes (on an integrated GPU: the shared pool).
    pub total_memory: u64,
    /// True for an integrated GPU sharing host memory (Jetson).
    pub integrated: bool,
}

impl GpuInfo {
    /// The compute capability as a TensorRT-RTX target name (`sm86`).
    pub fn target(&self) -> String {
        format!(
            "sm{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }
}

/// Device 0, or `None` when there is no driver library, no device, or the driver fails.
/// Never panics: cudarc's dynamically loaded functions panic when `libcuda` is missing, so
/// its presence is checked first. Asked once per process (driver start-up is not free; the
/// target and the default budget both ask), the answer kept.
pub fn probe() -> Option<GpuInfo> {
    static GPU: std::sync::OnceLock<Option<GpuInfo>> = std::sync::OnceLock::new();
    GPU.get_or_init(query).clone()
}

fn query() -> Option<GpuInfo> {
    use cudarc::driver::{result, sys};
    // SAFETY: only tries to dlopen the driver library by its usual names; no symbol is called.
    if !unsafe { sys::is_culib_present() } {
        return None;
    }
    result::init().ok()?;
    if result::device::get_count().ok()? < 1 {
        return None;
    }
    let dev = result::device::get(0).ok()?;
    let attr = |a| {
        // SAFETY: `dev` was returned by `cuDeviceGet` after a successful `cuInit`.
        unsafe { result::device::get_attribute(dev, a) }.ok()
    };
    let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let integrated = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED)? != 0;
    // SAFETY: as above.
    let total_memory = unsafe { result::device::total_mem(dev) }.ok()? as u64;
    Some(GpuInfo {
        name: result::device::get_name(dev).unwrap_or_default(),
        compute_capability: (major, minor),
        total_memory,
        integrated,
    })
}

/// The target TensorRT-RTX builds for when none is given: the GPU present if the tool offers
/// it, else [`DEFAULT_RTX_TARGET`]. Says on stderr which, and why.
pub fn default_rtx_target(tool: &Tool) -> String {
    match probe() {
        Some(g) if tool.targets.contains(&g.target()) => {
            eprintln!(
                "petite: TensorRT-RTX target {} (the GPU present: {})",
                g.target(),
                g.name
            );
            g.target()
        }
        Some(g) => {
            eprintln!(
                "petite: TensorRT-RTX target {DEFAULT_RTX_TARGET}: the GPU present ({}, {}) is not \
                 one {} builds for ({}); pass --trt-target to choose",
                g.name,
                g.target(),
                tool.info,
                tool.targets.join(", ")
            );
            DEFAULT_RTX_TARGET.to_string()
        }
        None => {
            eprintln!(
                "petite: TensorRT-RTX target {DEFAULT_RTX_TARGET} (no GPU found; the nearest to \
                 Jetson Orin's sm87); pass --trt-target to choose"
            );
            DEFAULT_RTX_TARGET.to_string()
        }
    }
}

/// `MemAvailable` of `/proc/meminfo` text, in bytes.
pub fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The export's memory budget when none is given: on an integrated GPU (Jetson), whose memory is
/// the host's one pool, what the kernel says is available now; elsewhere none (a discrete GPU's
/// memory is not where the export runs).
pub fn default_memory_budget(gpu: Option<&GpuInfo>) -> Option<u64> {
    if !gpu?.integrated {
        return None;
    }
    mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes_and_only_integrated_gpus_get_a_default_budget() {
        let text = "MemTotal:        7999999 kB\nMemFree:  100 kB\nMemAvailable:    6000000 kB\n";
        assert_eq!(mem_available(text), Some(6_000_000 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        assert_eq!(mem_available("MemAvailable: lots kB\n"), None);
        let discrete = GpuInfo {
            name: "H200".into(),
            compute_capability: (9, 0),
            total_memory: 140 << 30,
            integrated: false,
        };
        assert_eq!(default_memory_budget(Some(&discrete)), None);
        assert_eq!(default_memory_budget(None), None);
        let orin = GpuInfo {
            integrated: true,
            compute_capability: (8, 7),
            ..discrete
        };
        assert_eq!(orin.target(), "sm87");
        // This machine's own /proc/meminfo stands in for a Jetson's.
        assert!(default_memory_budget(Some(&orin)).is_some_and(|b| b > 0));
    }
}
