//! The export's one registration point for engine backends: which backends exist and how each
//! one's [`EngineBuilder`] is made. Everything else about a backend (reuse check, settings,
//! build-memory model, file names, which weights it reads from the mapping file) is asked of
//! the builder itself, so a new backend is its crate plus one arm in [`Backend::builder`].

use std::path::PathBuf;

use petite_engine::reference::{self, ReferenceBuilder};
use petite_engine::tensorrt::{Tool, ToolKind, ToolSearch};
use petite_engine::{BuiltEngine, EngineBuilder};

use crate::{Error, Result};

/// An engine backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// petite's CPU reference engines (runs here; what the tests and verify use).
    Reference,
    /// TensorRT engines: ONNX per engine, built by trtexec or TensorRT-RTX in a child process.
    #[value(name = "tensorrt")]
    TensorRt,
    /// No engines: every op as an ExecuTorch portable kernel call (petite-portable), runnable by
    /// any ExecuTorch runtime on any CPU. The export takes its own path ([`crate::export`]).
    Portable,
    /// No engines: the whole policy as one ONNX model (`pi05.onnx` + external data) for ONNX
    /// Runtime, TensorRT (`trtexec --onnx`) or any ONNX tool ([`crate::export`]).
    Onnx,
}

/// Backend settings from the command line (only TensorRT has any).
#[derive(Debug, Clone, Default)]
pub struct BackendOptions {
    /// `--trtexec PATH`.
    pub trtexec: Option<PathBuf>,
    /// `--trt-python PY`.
    pub trt_python: Option<PathBuf>,
    /// `--trt-target smXY` (TensorRT-RTX; default: the GPU present, else `sm86`).
    pub trt_target: Option<String>,
    /// `--weight-streaming-budget SIZE`: weight-streamable engines, each given this many bytes
    /// of GPU weight memory at run time (the delegate's `weight_streaming_budget` compile spec).
    pub weight_streaming_budget: Option<u64>,
}

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

impl Backend {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Reference => "reference",
            Backend::TensorRt => "tensorrt",
            Backend::Portable => "portable",
            Backend::Onnx => "onnx",
        }
    }

    /// The builder of this backend, its tool found and probed (so a missing or broken builder
    /// is refused before any work). The portable backend builds no engines.
    pub fn builder(self, o: &BackendOptions) -> Result<Box<dyn EngineBuilder>> {
        if let (Some(_), false) = (o.weight_streaming_budget, self == Backend::TensorRt) {
            return Err(Error::Usage(format!(
                "--weight-streaming-budget applies to --backend tensorrt only (got --backend {})",
                self.name()
            )));
        }
        match self {
            Backend::Reference => Ok(Box::new(ReferenceBuilder::default())),
            Backend::TensorRt => {
                let tool = Tool::find(&ToolSearch {
                    trtexec: o.trtexec.clone(),
                    trt_python: o.trt_python.clone(),
                    default_python: default_trt_python(),
                })?;
                let target = match (&o.trt_target, tool.kind) {
                    (Some(t), ToolKind::Trtexec) => {
                        return Err(Error::Usage(format!(
                            "--trt-target {t}: {} builds for the GPU it runs on; --trt-target is for TensorRT-RTX",
                            tool.info
                        )));
                    }
                    (Some(t), ToolKind::Rtx) => {
                        tool.check_target(t)?;
                        Some(t.clone())
                    }
                    (None, ToolKind::Rtx) => Some(petite_engine::gpu::default_rtx_target(&tool)),
                    (None, ToolKind::Trtexec) => None,
                };
                let mut b = petite_engine::tensorrt::TensorRtBuilder::new(tool);
                if let Some(t) = target {
                    b.target = t;
                }
                if let Some(budget) = o.weight_streaming_budget {
                    petite_engine::tensorrt::weight_streaming_spec(budget)?;
                    b.weight_streaming = true;
                    b.weight_streaming_budget = Some(budget);
                }
                Ok(Box::new(b))
            }
            Backend::Portable | Backend::Onnx => Err(Error::Usage(format!(
                "the {} backend builds no engines",
                self.name()
            ))),
        }
    }
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
