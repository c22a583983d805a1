//! `cargo xtask gpu-bundle`: what a GPU machine without a Rust toolchain (the lent H200, which
//! reaches no package registry) needs to run the gpu tier and `bench gpu` on this checkout — the
//! release `petite`, a release `xtask`, the release build of petite-cuda's GPU tests and the
//! Python package (`python/petite`, unpacked from its release wheel: the device has no pip
//! registry, so `run.sh` puts it on `PYTHONPATH`) — in one
//! folder (default `.gpu`, which git ignores) with a `run.sh` that points them at each other and
//! at the tree. Carry the folder and run `bash .gpu/run.sh all --dtypes bf16 --rounds 3 --variant
//! main: --variant literal:offsets=literal` from the repository root there. Why: every GPU
//! session so far wrote these steps by hand into untracked scripts, and once passed the
//! variants' environment wrongly (session 20); one tested path does it the same way each time.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util;

/// Options of the bundle.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Where the bundle goes, relative to the repository root (replaced if it exists).
    #[arg(long, default_value = ".gpu")]
    pub out: PathBuf,
}

/// The device tool carries at most 64 MiB with the working tree (6 MiB of tracked files); the
/// bundle keeps below this.
const MAX_BYTES: u64 = 56 << 20;

const RUN_SH: &str = r#"#!/usr/bin/env bash
# Written by `cargo xtask gpu-bundle` (see COMMIT beside it). Run from the repository root of
# the same commit on a machine with a GPU:
#   bash .gpu/run.sh tier              the gpu conformance tier
#   bash .gpu/run.sh bench ARGS...     cargo xtask bench gpu ARGS... (--variant, --rounds, --dtypes)
#   bash .gpu/run.sh all ARGS...       both
#   bash .gpu/run.sh xtask ARGS...     any xtask command (e.g. bench gpu-verify) with the same setup
#   bash .gpu/run.sh profile DIR       the bundle's kernels against pi05 run's (ncu), after
#                                      `run.sh xtask bench policy --device cuda --keep DIR`
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export XTASK_PETITE_BIN="$here/petite" XTASK_CUDA_TESTS="$here/petite-cuda-gpu-tests" XTASK_ROOT="$PWD"
# The Python package (`import petite`), for `bench policy --python python3`.
export PYTHONPATH="$here/python${PYTHONPATH:+:$PYTHONPATH}"
# lerobot's policy folders and RTC goldens (made here, where lerobot is), for the gpu tier.
if [ -d "$here/policy-goldens" ]; then export XTASK_POLICY_GOLDENS="$here/policy-goldens"; fi
head=$(git rev-parse HEAD 2>/dev/null || true)
if [ -n "$head" ] && [ "$head" != "$(cat "$here/COMMIT")" ]; then
  echo "run.sh: this tree is at $head, the bundle was built at $(cat "$here/COMMIT")" >&2
fi
what=${1:-all}
shift || true
case "$what" in
  tier) "$here/xtask" conformance --only gpu ;;
  bench) "$here/xtask" bench gpu "$@" ;;
  all) "$here/xtask" conformance --only gpu && "$here/xtask" bench gpu "$@" ;;
  xtask) "$here/xtask" "$@" ;;
  profile) bash "$here/profile_bundle.sh" "$@" ;;
  *) echo "usage: run.sh tier | bench ARGS... | all ARGS... | xtask ARGS... | profile DIR" >&2; exit 2 ;;
esac
"#;

/// `run.sh profile`'s script and its summary (issue 50 item 0: where the bundle's chunk spends
/// what `pi05 run`'s does not).
const PROFILE_SH: &str = include_str!("profile_bundle.sh");
const NCU_SUM_PY: &str = include_str!("ncu_sum.py");

/// The release build of petite-cuda's `tests/gpu.rs`, from cargo's JSON messages.
fn gpu_tests() -> Result<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["test", "--release", "-p", "petite-cuda", "--test", "gpu"])
        .args(["--no-run", "--message-format=json"])
        .current_dir(util::root());
    eprintln!("xtask: {cmd:?}");
    let out = cmd.output().with_context(|| format!("starting {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    executable(&String::from_utf8_lossy(&out.stdout), "gpu")
}

/// The `executable` of the test artifact of target `name` in cargo's JSON `messages`.
fn executable(messages: &str, name: &str) -> Result<PathBuf> {
    for line in messages.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["reason"] == "compiler-artifact"
            && v["target"]["name"] == name
            && v["profile"]["test"] == true
            && let Some(exe) = v["executable"].as_str()
        {
            return Ok(PathBuf::from(exe));
        }
    }
    bail!("cargo named no test executable for target {name:?}")
}

/// `from` copied to `to` without its debug information (the release profile's line tables:
/// 150 MiB of the three binaries' 168; symbols stay, so backtraces keep their names). Its size.
fn copy(from: &Path, to: &Path) -> Result<u64> {
    std::fs::copy(from, to)
        .with_context(|| format!("copy {} to {}", from.display(), to.display()))?;
    util::run(Command::new("strip").arg("--strip-debug").arg(to))?;
    Ok(std::fs::metadata(to)?.len())
}

/// The Python package's release wheel (maturin, in `target/venv-maturin`), unpacked into
/// `into` (`into/petite/…`) with its extension's debug information stripped. Its size.
fn python_package(into: &Path) -> Result<u64> {
    let root = util::root();
    let python = util::venv("maturin", crate::conformance::policy::MATURIN_REQUIREMENTS)?;
    let maturin = python.with_file_name("maturin");
    let wheels = tempfile::tempdir()?;
    util::run(
        Command::new(&maturin)
            .args([
                "build",
                "--release",
                "--quiet",
                "--auditwheel",
                "skip",
                "-m",
            ])
            .arg(root.join("crates/petite-python/Cargo.toml"))
            .arg("--out")
            .arg(wheels.path())
            .env("CARGO_TARGET_DIR", util::target_dir())
            .current_dir(&root),
    )?;
    let wheel = std::fs::read_dir(wheels.path())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("maturin wrote no wheel")?;
    util::run(
        Command::new(&python)
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(into),
    )?;
    let mut bytes = 0;
    for e in std::fs::read_dir(into.join("petite"))? {
        let p = e?.path();
        if p.extension().is_some_and(|e| e == "so") {
            util::run(Command::new("strip").arg("--strip-debug").arg(&p))?;
        }
        bytes += std::fs::metadata(&p)?.len();
    }
    Ok(bytes)
}

/// lerobot's policy folders and real-time-chunking goldens (the lerobot-policy tier's
/// generators, in the lerobot venv) written into `into`, for the gpu tier on a machine without
/// lerobot. Their size.
fn policy_goldens(into: &Path) -> Result<u64> {
    use crate::conformance::policy::{CASES, RTC_SCRIPT, SCRIPT};
    let root = util::root();
    let python = crate::conformance::Venv::Lerobot.python()?;
    util::run(
        Command::new(&python)
            .arg(root.join(SCRIPT))
            .arg("--out")
            .arg(into),
    )?;
    util::run(
        Command::new(&python)
            .arg(root.join(RTC_SCRIPT))
            .arg("--out")
            .arg(into)
            .args(CASES),
    )?;
    fn size(p: &Path) -> Result<u64> {
        let m = std::fs::symlink_metadata(p)?;
        if !m.is_dir() {
            return Ok(m.len());
        }
        let mut n = 0;
        for e in std::fs::read_dir(p)? {
            n += size(&e?.path())?;
        }
        Ok(n)
    }
    size(into)
}

/// Builds the bundle.
pub fn run(a: &Args) -> Result<()> {
    let root = util::root();
    let out = root.join(&a.out);
    // As a folder (a trailing slash), which it may not be yet.
    let ignored = Command::new("git")
        .args(["check-ignore", "-q"])
        .arg(format!("{}/", out.display()))
        .current_dir(&root)
        .status()
        .is_ok_and(|s| s.success());
    if !ignored {
        bail!(
            "{} is not ignored by git: the device tool would send it with the tree as well as carry it",
            out.display()
        );
    }
    let petite = util::release_petite()?;
    util::cargo(&["build", "--release", "-p", "xtask"])?;
    let xtask = util::target_dir().join("release").join("xtask");
    let tests = gpu_tests()?;
    let head = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(&root)
        .output()
        .context("git rev-parse HEAD")?;
    let commit = String::from_utf8_lossy(&head.stdout).trim().to_string();
    if std::fs::exists(&out)? {
        std::fs::remove_dir_all(&out).with_context(|| format!("remove {}", out.display()))?;
    }
    std::fs::create_dir_all(&out).with_context(|| format!("create {}", out.display()))?;
    let mut bytes = 0;
    for (from, name) in [
        (&petite, "petite"),
        (&xtask, "xtask"),
        (&tests, "petite-cuda-gpu-tests"),
    ] {
        bytes += copy(from, &out.join(name))?;
    }
    bytes += python_package(&out.join("python"))?;
    bytes += policy_goldens(&out.join("policy-goldens"))?;
    std::fs::write(out.join("run.sh"), RUN_SH)?;
    std::fs::write(out.join("profile_bundle.sh"), PROFILE_SH)?;
    std::fs::write(out.join("ncu_sum.py"), NCU_SUM_PY)?;
    std::fs::write(out.join("COMMIT"), format!("{commit}\n"))?;
    let dirty = Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .current_dir(&root)
        .output()
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(true);
    if bytes > MAX_BYTES {
        bail!(
            "the bundle is {:.1} MiB, over the {} MiB the device tool carries beside the tree",
            bytes as f64 / (1u64 << 20) as f64,
            MAX_BYTES >> 20
        );
    }
    println!(
        "gpu-bundle: {} ({:.1} MiB: petite, xtask, petite-cuda-gpu-tests, python/petite, policy-goldens, run.sh) of {commit}{}",
        out.display(),
        bytes as f64 / (1u64 << 20) as f64,
        if dirty {
            " with uncommitted changes (the bundle's binaries hold them; COMMIT does not say so)"
        } else {
            ""
        }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpu_test_executable_is_read_from_cargos_messages() {
        let msgs = concat!(
            r#"{"reason":"compiler-artifact","target":{"name":"petite_cuda"},"profile":{"test":false},"executable":null}"#,
            "\n",
            "not json\n",
            r#"{"reason":"compiler-artifact","target":{"name":"gpu"},"profile":{"test":true},"executable":"/t/release/deps/gpu-0123"}"#,
            "\n",
            r#"{"reason":"build-finished","success":true}"#,
        );
        assert_eq!(
            executable(msgs, "gpu").unwrap(),
            PathBuf::from("/t/release/deps/gpu-0123")
        );
        assert!(executable(msgs, "other").is_err());
    }

    #[test]
    fn run_sh_exports_what_the_tier_and_the_bench_read() {
        for v in ["XTASK_PETITE_BIN=", "XTASK_CUDA_TESTS=", "XTASK_ROOT="] {
            assert!(RUN_SH.contains(v), "{v}");
        }
        assert!(RUN_SH.contains("conformance --only gpu") && RUN_SH.contains("bench gpu"));
        assert!(RUN_SH.contains("profile_bundle.sh") && PROFILE_SH.contains("ncu_sum.py"));
    }
}
