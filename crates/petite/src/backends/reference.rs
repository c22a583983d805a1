//! `--backend reference`: petite's CPU reference engines, built in-process.

use petite_engine::EngineBuilder;
use petite_engine::reference::{BACKEND_ID, ReferenceBuilder};
use petite_graph::quant::Quant;

use super::{BackendOptions, BackendSpec, Flag, Output};
use crate::Result;

pub(super) struct Reference;

impl BackendSpec for Reference {
    fn name(&self) -> &'static str {
        "reference"
    }
    fn help(&self) -> &'static str {
        "petite's CPU reference engines (runs here; what the tests and verify use)"
    }
    fn output(&self) -> Output {
        Output::Engines
    }
    fn flags(&self) -> &'static [Flag] {
        &[
            Flag::EngineCap,
            Flag::KeepEngines,
            Flag::Placement,
            Flag::Weights,
            Flag::QuantizeSkip,
        ]
    }
    fn builder(&self, _: &BackendOptions, _: Option<Quant>) -> Result<Box<dyn EngineBuilder>> {
        Ok(Box::new(ReferenceBuilder::default()))
    }
    fn delegate_id(&self) -> Option<&'static str> {
        Some(BACKEND_ID)
    }
}
