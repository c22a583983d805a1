//! Helpers shared by tasks: running cargo and other processes, workspace paths, Python venvs.
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The workspace root (xtask lives one level below it).
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask has a parent")
        .to_path_buf()
}

/// Runs `cargo ARGS` in the workspace root, failing on a non-zero exit.
pub fn cargo(args: &[&str]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    run(Command::new(cargo).args(args).current_dir(root()))
}

/// Runs a command, echoing it, failing on a non-zero exit.
pub fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("xtask: {cmd:?}");
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

/// A Python virtual environment under `target/venv-<name>`, created with python3.12 (pyenv) and
/// the given pip requirements. A stamp file records the requirements, so a venv is rebuilt when
/// they change and reused otherwise. Returns the venv's `python` path.
#[allow(dead_code)] // used by the conformance tiers as they land
pub fn venv(name: &str, requirements: &[&str]) -> Result<PathBuf> {
    let dir = root().join("target").join(format!("venv-{name}"));
    let python = dir.join("bin").join("python");
    let stamp = dir.join("petite-requirements.txt");
    let wanted = requirements.join("\n");
    if python.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(&wanted) {
        return Ok(python);
    }
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    let base = python312()?;
    run(Command::new(&base).args(["-m", "venv"]).arg(&dir))?;
    run(Command::new(&python).args(["-m", "pip", "install", "--quiet", "--upgrade", "pip"]))?;
    run(Command::new(&python)
        .args(["-m", "pip", "install", "--quiet"])
        .args(requirements))?;
    std::fs::write(&stamp, wanted).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(python)
}

/// Finds a Python 3.12 interpreter: `$PETITE_PYTHON312`, pyenv's 3.12.x, or `python3.12` on PATH.
fn python312() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("PETITE_PYTHON312") {
        return Ok(PathBuf::from(p));
    }
    let home = std::env::var("HOME").unwrap_or_default();
    let versions = PathBuf::from(home).join(".pyenv").join("versions");
    if let Ok(entries) = std::fs::read_dir(&versions) {
        let mut found: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("3.12"))
            .map(|e| e.path().join("bin").join("python3.12"))
            .filter(|p| p.exists())
            .collect();
        found.sort();
        if let Some(p) = found.pop() {
            return Ok(p);
        }
    }
    if Command::new("python3.12").arg("--version").output().is_ok() {
        return Ok(PathBuf::from("python3.12"));
    }
    bail!("no Python 3.12 found: install it (pyenv install 3.12) or set PETITE_PYTHON312")
}

/// The `memcap` tool: `$PETITE_MEMCAP`, else `shared/tools/memcap` beside the workspace (where
/// sessions and CI find `shared/`), else `/work/shared/tools/memcap`.
pub fn memcap() -> PathBuf {
    if let Ok(p) = std::env::var("PETITE_MEMCAP") {
        return PathBuf::from(p);
    }
    let beside = root()
        .join("..")
        .join("shared")
        .join("tools")
        .join("memcap");
    if beside.exists() {
        return beside;
    }
    PathBuf::from("/work/shared/tools/memcap")
}
