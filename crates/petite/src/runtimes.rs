//! The one registration point for engine runtimes: which delegate backend runs on which device,
//! and how its engines are opened from a `.pte` segment. `petite verify` asks [`runtime`] for
//! the delegate's backend id and the `--device` given; a new runtime is its module plus one
//! line in [`RUNTIMES`].

use std::collections::BTreeMap;
use std::path::Path;

use petite_engine::reference::ReferenceEngine;
use petite_engine::{EngineRuntime, IoBinding};
use petite_reference::Tensor;

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

/// Opens CUDA device 0 for `--device cuda`, or refuses in one line (what is missing) before any
/// work is done.
pub fn open_cuda() -> Result<petite_cuda::Device> {
    petite_cuda::Device::open().map_err(|e| Error::Usage(format!("--device cuda: {e}")))
}

/// Refuses `device` in one line where it cannot run here (for `cuda`: no driver, cuBLAS,
/// NVRTC or device), without opening it: what a command checks before any other work.
pub fn check_device(device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda => petite_cuda::probe()
            .usable()
            .map_err(|e| Error::Usage(format!("--device cuda: {e}"))),
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
}

type Make = fn() -> Result<Box<dyn Runtime>>;

/// Every runtime: (delegate backend id, device, constructor). One line a runtime.
pub const RUNTIMES: &[(&str, Device, Make)] = &[
    (REFERENCE_ID, Device::Cpu, || Ok(Box::new(CpuReference))),
    (REFERENCE_ID, Device::Cuda, || {
        Ok(Box::new(CudaReference(open_cuda()?)))
    }),
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

/// Reference engines on the CPU: mapped in place from the `.pte`, run by petite-reference.
struct CpuReference;

impl Runtime for CpuReference {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn describe(&self) -> String {
        "petite reference engines".into()
    }
    fn open<'s>(
        &'s self,
        path: &Path,
        offset: u64,
        len: u64,
        release: bool,
    ) -> Result<Box<dyn EngineRuntime + 's>> {
        let e = ReferenceEngine::open_region(path, offset, len)?;
        Ok(Box::new(e.releasing_weights(release)))
    }
}

/// Reference engines on the GPU: the engine's subgraph, its weights uploaded once from the
/// mapped `.pte` (the mapping is dropped once they are on the device), run by petite-cuda.
struct CudaReference(petite_cuda::Device);

struct CudaEngine<'d> {
    program: petite_cuda::DeviceProgram<'d>,
    inputs: Vec<IoBinding>,
    outputs: Vec<IoBinding>,
}

impl Runtime for CudaReference {
    fn device(&self) -> Device {
        Device::Cuda
    }
    fn describe(&self) -> String {
        let i = self.0.info();
        format!(
            "petite reference engines on CUDA (petite-cuda; {}, compute capability {}.{})",
            i.name, i.compute_capability.0, i.compute_capability.1
        )
    }
    fn open<'s>(
        &'s self,
        path: &Path,
        offset: u64,
        len: u64,
        _release: bool,
    ) -> Result<Box<dyn EngineRuntime + 's>> {
        let e = ReferenceEngine::open_region(path, offset, len)?;
        let program = petite_cuda::DeviceProgram::load(&self.0, e.program(), e.file(), true)
            .map_err(|err| Error::Usage(format!("{}: {err}", path.display())))?;
        let (inputs, outputs) = petite_engine::bindings(e.program());
        Ok(Box::new(CudaEngine {
            program,
            inputs,
            outputs,
        }))
    }
}

impl EngineRuntime for CudaEngine<'_> {
    fn inputs(&self) -> &[IoBinding] {
        &self.inputs
    }
    fn outputs(&self) -> &[IoBinding] {
        &self.outputs
    }
    fn run(
        &self,
        inputs: BTreeMap<String, Tensor>,
    ) -> petite_engine::Result<BTreeMap<String, Tensor>> {
        self.program
            .run(inputs)
            .map_err(|e| petite_engine::Error::Usage(format!("petite-cuda: {e}")))
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
