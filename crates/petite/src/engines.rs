//! What the export needs of built engines (their compile specs and payloads as the `.pte` and
//! `report.json` store them) and the workspace venv lookup of every Python child. Which
//! backends exist, and what each one supports, is [`crate::backends`].

use std::path::PathBuf;

use petite_engine::BuiltEngine;
use petite_engine::reference;

pub use crate::backends::{Backend, BackendOptions};

/// The venv `cargo xtask` builds for TensorRT-RTX, when this binary runs from a workspace's
/// `target/` ([`workspace_venv_python`]); `None` for a copied or installed binary.
pub fn default_trt_python() -> Option<PathBuf> {
    workspace_venv_python("venv-trt")
}

/// `target/<venv>/bin/python` of the workspace this binary runs from: found from the running
/// executable (`target/<profile>/petite`, `target/<triple>/<profile>/petite`), beside it first,
/// never from the build machine's path (a binary copied to a Jetson or installed with `cargo
/// install` has no workspace, and gets `None`). The one lookup of a workspace venv for every
/// Python child (TensorRT-RTX, ONNX Runtime, ExecuTorch).
pub fn workspace_venv_python(venv: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let beside = dir.join(venv).join("bin/python");
    if beside.exists() {
        return Some(beside);
    }
    dir.ancestors()
        .find(|a| a.file_name().is_some_and(|n| n == "target"))
        .map(|t| t.join(venv).join("bin/python"))
        .filter(|p| p.exists())
}

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

#[cfg(test)]
mod tests {
    /// Found from the running executable (this test binary lives under `target/`), never from
    /// the path the crate was built at: present venvs are found, absent ones are `None`.
    #[test]
    fn workspace_venvs_are_found_from_the_executable() {
        assert_eq!(super::workspace_venv_python("no-such-venv-here"), None);
        let target = std::env::current_exe()
            .unwrap()
            .ancestors()
            .find(|a| a.file_name().is_some_and(|n| n == "target"))
            .map(std::path::Path::to_path_buf)
            .expect("tests run from a target directory");
        let venv = target.join("venv-workspace-lookup-test/bin");
        std::fs::create_dir_all(&venv).unwrap();
        std::fs::write(venv.join("python"), "").unwrap();
        let found = super::workspace_venv_python("venv-workspace-lookup-test");
        std::fs::remove_dir_all(target.join("venv-workspace-lookup-test")).unwrap();
        assert_eq!(found, Some(venv.join("python")));
    }
}
