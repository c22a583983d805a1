//! `PetiteReference` engines on GPU 0: each engine's subgraph run by petite-cuda, its weights
//! uploaded once from the mapped `.pte`.

use std::collections::BTreeMap;
use std::path::Path;

use petite_engine::reference::ReferenceEngine;
use petite_engine::{EngineRuntime, HostTensor, IoBinding};
use petite_reference::Tensor;

use super::{Device, Runtime, open_cuda};
use crate::{Error, Result};

pub(super) fn make() -> Result<Box<dyn Runtime>> {
    Ok(Box::new(CudaReference(open_cuda()?)))
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
            .map_err(Error::cuda(path.display().to_string()))?;
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
        inputs: BTreeMap<String, HostTensor>,
    ) -> petite_engine::Result<BTreeMap<String, HostTensor>> {
        let inputs = inputs
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_reference()?)))
            .collect::<petite_engine::Result<BTreeMap<String, Tensor>>>()?;
        let outs = self
            .program
            .run(inputs)
            .map_err(|e| petite_engine::Error::Runtime {
                runtime: "petite-cuda".into(),
                source: Box::new(e),
            })?;
        Ok(outs.into_iter().map(|(n, t)| (n, t.into())).collect())
    }
}
