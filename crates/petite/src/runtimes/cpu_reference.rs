//! `PetiteReference` engines on the CPU: mapped in place from the `.pte`, run by
//! petite-reference.

use std::path::Path;

use petite_engine::EngineRuntime;
use petite_engine::reference::ReferenceEngine;

use super::{Device, Runtime};
use crate::Result;

pub(super) fn make() -> Result<Box<dyn Runtime>> {
    Ok(Box::new(CpuReference))
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
