//! The Pythons of the runtimes nobody here wrote (ONNX Runtime, ExecuTorch's), one lookup rule
//! for both.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

pub use crate::settings::{ORT_PYTHON_ENV, PYTHON_ENV};

fn no_ort(detail: &str) -> Error {
    Error::Unavailable(format!(
        "{detail}: ONNX exports run in ONNX Runtime, which needs a Python with onnxruntime and \
         numpy. Pass --python PATH or set ${ORT_PYTHON_ENV}; `cargo xtask conformance --only \
         onnx` builds one at target/venv-ort, or by hand: python3 -m venv V && V/bin/pip \
         install onnxruntime==1.31.1 numpy"
    ))
}

/// The Python to run ONNX exports with: `explicit`, else `$PETITE_ORT_PYTHON`, else the venv
/// `cargo xtask conformance` builds in this workspace (`target/venv-ort`, if present).
/// Checked: it must import onnxruntime and numpy.
pub fn find_ort_python(explicit: Option<&Path>) -> Result<PathBuf> {
    find_runtime_python(explicit, &ORT_RUNTIME)
}

/// A runtime nobody here wrote, run in a Python child: where its Python is looked for and what
/// it must import (one lookup rule for every such runtime).
struct PyRuntime {
    /// The environment variable naming its Python.
    env: &'static str,
    /// The workspace venv `cargo xtask conformance` builds for it, under `target/`.
    venv: &'static str,
    /// What the Python must import (`import {imports}`), the first one named in errors.
    imports: &'static str,
    /// The one-line refusal, what it is and how to get one, after `detail`.
    missing: fn(&str) -> Error,
}

const ORT_RUNTIME: PyRuntime = PyRuntime {
    env: ORT_PYTHON_ENV,
    venv: "venv-ort",
    imports: "onnxruntime, numpy",
    missing: no_ort,
};

const ET_RUNTIME: PyRuntime = PyRuntime {
    env: PYTHON_ENV,
    venv: "venv-pte",
    imports: "executorch_numpy_runtime, numpy",
    missing: no_python,
};

/// `explicit`, else `$env`, else the workspace venv if present; checked by importing.
fn find_runtime_python(explicit: Option<&Path>, rt: &PyRuntime) -> Result<PathBuf> {
    let settings = crate::settings::current()?;
    let python = match (explicit, settings.path(rt.env)) {
        (Some(p), _) => p.to_path_buf(),
        (None, Some(p)) => p.to_path_buf(),
        (None, None) => crate::venv::workspace_venv_python(rt.venv)
            .ok_or_else(|| (rt.missing)("no Python given"))?,
    };
    let out = std::process::Command::new(&python)
        .args(["-c", &format!("import {}", rt.imports)])
        .output()
        .map_err(|e| (rt.missing)(&format!("{}: cannot start: {e}", python.display())))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("").to_string();
        let first = rt.imports.split(',').next().unwrap_or(rt.imports);
        return Err((rt.missing)(&format!(
            "{}: cannot import {first} ({last})",
            python.display()
        )));
    }
    Ok(python)
}

fn no_python(detail: &str) -> Error {
    Error::Unavailable(format!(
        "{detail}: portable .pte files run in ExecuTorch's runtime, which needs a Python 3.12 \
         with executorch-numpy-runtime 1.4.0 and numpy. Pass --python PATH or set \
         ${PYTHON_ENV}; `cargo xtask conformance` builds one at target/venv-pte, or by hand: \
         python3.12 -m venv V && V/bin/pip install executorch-numpy-runtime==1.4.0"
    ))
}

/// The Python to run portable programs with: `explicit`, else `$PETITE_PYTHON`, else the venv
/// `cargo xtask conformance` builds in this workspace (if present). Checked: it must import
/// executorch-numpy-runtime.
pub fn find_python(explicit: Option<&Path>) -> Result<PathBuf> {
    find_runtime_python(explicit, &ET_RUNTIME)
}
