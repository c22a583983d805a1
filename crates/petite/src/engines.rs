//! What the export needs of built engines: their compile specs and payloads as the `.pte` and
//! `report.json` store them. Which backends exist, and what each one supports, is
//! [`crate::backends`].

use std::path::PathBuf;

use petite_engine::BuiltEngine;
use petite_engine::reference;

/// The delegate compile specs of engine `e`, as the `.pte` stores them.
pub fn compile_specs(e: &BuiltEngine) -> Vec<petite_pte::model::CompileSpec> {
    e.compile_specs
        .iter()
        .map(|c| petite_pte::model::CompileSpec {
            key: c.key.clone(),
            value: c.value.clone(),
        })
        .collect()
}

/// The compile specs of engine `e` for `report.json`: `{key: value as text}` (the values petite
/// writes are ASCII).
pub fn compile_specs_json(e: &BuiltEngine) -> serde_json::Value {
    e.compile_specs
        .iter()
        .map(|c| {
            let v = String::from_utf8_lossy(&c.value).into_owned();
            (c.key.clone(), serde_json::Value::String(v))
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// Where an engine's payload is: `(file, offset, len)`.
pub fn payload(e: &BuiltEngine) -> (PathBuf, u64, u64) {
    (e.payload.path.clone(), e.payload.offset, e.payload.len)
}

/// Backend id of reference engines.
pub const REFERENCE_ID: &str = reference::BACKEND_ID;
