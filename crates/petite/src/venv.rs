//! The workspace venvs of the Python children (TensorRT-RTX's builder, ONNX Runtime,
//! ExecuTorch): found from the running binary, never from the build machine's paths.

use std::path::PathBuf;

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
