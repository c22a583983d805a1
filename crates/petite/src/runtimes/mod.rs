//! The one registration point for engine runtimes: which delegate backend runs on which device,
//! and how its engines are opened from a `.pte` segment. `petite verify` and `petite act` ask
//! [`runtime`] for each delegate's backend id and the `--device` given. Values between engines
//! are [`Value`]s: host tensors, or values a runtime keeps on its device — a runtime with a
//! device opens a whole method at once ([`Runtime::open_method`]) so that its values never
//! cross host memory between engines, and only the policy's edges upload and download. A new
//! runtime is its module here (a [`Runtime`] whose engines implement [`EngineRuntime`]), its
//! `mod` line and one line in [`RUNTIMES`].

mod cpu_reference;
mod cuda_reference;

use std::path::Path;

use petite_engine::{EngineRuntime, HostTensor};
use petite_graph::Dtype;

use crate::engines::REFERENCE_ID;
use crate::{Error, Result};

/// Where petite runs its own programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Device {
    /// The reference executor on the CPU (runs everywhere).
    #[default]
    Cpu,
    /// petite-cuda on GPU 0 (needs the NVIDIA driver, cuBLAS and NVRTC at run time).
    Cuda,
}

impl Device {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

/// Opens CUDA device 0 for `--device cuda` with this process's settings
/// ([`crate::settings::current`]: the environment's, and `--tune`), or refuses in one line (what
/// is missing) before any work is done.
pub fn open_cuda() -> Result<petite_cuda::Device> {
    let settings = crate::settings::current()?.cuda;
    petite_cuda::Device::open_with(settings).map_err(Error::cuda("--device cuda"))
}

/// Refuses `device` in one line where it cannot run here (for `cuda`: no driver, cuBLAS,
/// NVRTC or device), without opening it: what a command checks before any other work.
pub fn check_device(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda => petite_cuda::probe()
            .usable()
            .map_err(Error::cuda("--device cuda")),
    }
}

/// Runs the engines of one delegate backend on one device.
pub trait Runtime {
    /// Where it runs.
    fn device(&self) -> Device;
    /// What `report.json` calls it.
    fn describe(&self) -> String;
    /// Opens the engine stored at `[offset, offset + len)` of `path` (a `.pte` segment).
    /// `release`: give the host pages of its weights back once they are no longer needed.
    fn open<'s>(
        &'s self,
        path: &Path,
        offset: u64,
        len: u64,
        release: bool,
    ) -> Result<Box<dyn EngineRuntime + 's>>;

    /// Opens a whole method, its values kept on the runtime's device between engines; `None`
    /// (the default) for a runtime whose engines take host tensors, one by one through
    /// [`Runtime::open`].
    fn open_method<'s>(
        &'s self,
        _method: &MethodSpec<'_>,
    ) -> Option<Result<Box<dyn ResidentMethod + 's>>> {
        None
    }

    /// `t` as this runtime's value (a host tensor stays one where the runtime has no device).
    fn upload(&self, t: HostTensor) -> Result<Value> {
        Ok(Value::Host(t))
    }

    /// `v` on the host.
    fn download(&self, v: Value) -> Result<HostTensor> {
        match v {
            Value::Host(t) => Ok(t),
            Value::Resident(_) => Err(Error::Internal(format!(
                "{} holds no device values",
                self.describe()
            ))),
        }
    }
}

/// A value between engines: on the host, or kept by the runtime that made it (on its device;
/// only that runtime reads it — [`Runtime::download`] brings it to the host). Cloning a
/// resident value shares it.
#[derive(Clone)]
pub enum Value {
    /// Host memory.
    Host(HostTensor),
    /// The runtime's own (a `petite_cuda::DevTensor` for petite-cuda).
    Resident(std::sync::Arc<dyn std::any::Any + Send + Sync>),
}

/// One method of a `.pte` (a chain of delegate calls), described for a runtime that opens it
/// whole ([`Runtime::open_method`]).
pub struct MethodSpec<'a> {
    /// The `.pte`.
    pub path: &'a Path,
    /// Each engine: its segment index and the segment's byte range in `path`, in first-use order.
    pub engines: Vec<(usize, u64, u64)>,
    /// The calls in order: the engine's segment index, then its arguments (value ids: the
    /// engine's inputs in binding order, then its outputs).
    pub calls: Vec<(usize, Vec<i32>)>,
    /// The method's inputs: value id, dtype, shape.
    pub inputs: Vec<(i32, Dtype, Vec<usize>)>,
    /// The method's outputs: value id, dtype, shape.
    pub outputs: Vec<(i32, Dtype, Vec<usize>)>,
}

/// A method opened whole by a runtime: values stay where the runtime keeps them.
pub trait ResidentMethod {
    /// Runs the method on its inputs (in order); returns its outputs (in order). An output may
    /// be a buffer the method reuses: it is valid until this method runs again.
    fn run(&self, inputs: Vec<Value>) -> Result<Vec<Value>>;

    /// Reports what the last run found wrong that the runtime checks only once its work is
    /// done (petite-cuda: an embedding index out of range), waiting for that work. A runtime
    /// may defer such checks from [`ResidentMethod::run`] to here (or to the next run), so that
    /// a caller queues later work (the steps after the prefix) without waiting.
    fn finish(&self) -> Result<()> {
        Ok(())
    }
}

type Make = fn() -> Result<Box<dyn Runtime>>;

/// Every runtime: (delegate backend id, device, constructor). One line a runtime.
pub const RUNTIMES: &[(&str, Device, Make)] = &[
    (REFERENCE_ID, Device::Cpu, cpu_reference::make),
    (REFERENCE_ID, Device::Cuda, cuda_reference::make),
];

/// The runtime for `backend_id` engines on `device`; an error naming what runs where when none
/// is registered, or when the device cannot run here.
pub fn runtime(backend_id: &str, device: Device) -> Result<Box<dyn Runtime>> {
    let found = RUNTIMES
        .iter()
        .find(|(id, d, _)| *id == backend_id && *d == device);
    match found {
        Some((_, _, make)) => make(),
        None => {
            let known: Vec<String> = RUNTIMES
                .iter()
                .map(|(id, d, _)| format!("`{id}` on {}", d.name()))
                .collect();
            Err(Error::Usage(format!(
                "no runtime runs `{backend_id}` engines on {}; registered: {}",
                device.name(),
                known.join(", ")
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_backends_are_refused_by_name() {
        let e = runtime("TensorRTBackend", Device::Cpu)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("TensorRTBackend") && e.contains("PetiteReference"),
            "{e}"
        );
    }

    #[test]
    fn cuda_without_a_driver_is_refused_in_one_line() {
        // Where a GPU is present this checks nothing (the gpu conformance tier covers it).
        if petite_cuda::probe().usable().is_ok() {
            return;
        }
        let e = runtime(REFERENCE_ID, Device::Cuda)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with("--device cuda: CUDA is not available here"),
            "{e}"
        );
        assert_eq!(e.lines().count(), 1, "{e}");
    }
}
