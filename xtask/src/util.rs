//! Helpers shared by tasks: running cargo and other processes, workspace paths, Python venvs.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{Context, Result, bail};

/// The workspace root (xtask lives one level below it).
pub fn root() -> PathBuf {
    // A prebuilt xtask carried to another machine (the GPU tier and bench on a lent GPU) is
    // pointed at its copy of the tree.
    if let Some(r) = std::env::var_os("XTASK_ROOT") {
        return PathBuf::from(r);
    }
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

/// Cargo's target directory (`CARGO_TARGET_DIR`, else `<root>/target`).
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target"))
}

/// Prints the space free on the filesystem of the target directory (through `df`, so nothing is
/// assumed about the platform's statfs layout); a failure to ask is printed, never fatal.
pub fn report_disk(when: &str) {
    let dir = target_dir();
    let probe = if dir.exists() { dir } else { root() };
    let out = Command::new("df").args(["-Pk"]).arg(&probe).output();
    let free_kib = out.ok().and_then(|o| {
        let text = String::from_utf8_lossy(&o.stdout).into_owned();
        let line = text.lines().nth(1)?.to_owned();
        line.split_whitespace().nth(3)?.parse::<u64>().ok()
    });
    match free_kib {
        Some(k) => {
            let gib = k as f64 / (1024.0 * 1024.0);
            eprintln!("disk {when}: {gib:.1} GiB free under {}", probe.display());
            if gib < 30.0 {
                eprintln!(
                    "warning: a fresh CI run writes ~22 GB under target/; with {gib:.1} GiB free it \
                     can stop at 'No space left on device'"
                );
            }
        }
        None => eprintln!(
            "disk {when}: could not read the free space of {}",
            probe.display()
        ),
    }
}

/// `petite ARGS` from the build the conformance tiers run ([`conformance_petite`]), in the
/// workspace root.
pub fn petite(args: &[&str]) -> Result<()> {
    run(Command::new(conformance_petite()?)
        .args(args)
        .current_dir(root()))
}

/// The build directory whose `petite` and `examples/` the conformance tiers run, when not the
/// release build (see [`conformance_from_test_build`]).
static CONFORMANCE_BUILD: OnceLock<PathBuf> = OnceLock::new();

/// Points the conformance tiers at the test-profile build (`target/debug`: optimised, debug
/// assertions and overflow checks on) that `cargo test --workspace` has just made, instead of a
/// release build. `cargo xtask ci` does: the release build compiled the whole workspace once more
/// (~6 min of CI) for programs that run small goldens. Exported bytes do not depend on the
/// profile (the aarch64 tier compares them with a release cross build).
pub fn conformance_from_test_build() -> Result<()> {
    let dir = target_dir().join("debug");
    let petite = dir.join("petite");
    if !petite.exists() {
        bail!(
            "{} is missing: run `cargo test --workspace` first",
            petite.display()
        );
    }
    // Set once; a second call finds the same directory.
    let _ = CONFORMANCE_BUILD.set(dir);
    Ok(())
}

/// Whether the conformance tiers run the test-profile build ([`conformance_from_test_build`]):
/// what they build themselves (the Python package's wheel) then uses the same profile.
pub fn conformance_uses_test_build() -> bool {
    CONFORMANCE_BUILD.get().is_some()
}

/// The `petite` binary the conformance tiers run: the test-profile build after
/// [`conformance_from_test_build`], else the release build (built here).
pub fn conformance_petite() -> Result<PathBuf> {
    match CONFORMANCE_BUILD.get() {
        Some(dir) => Ok(dir.join("petite")),
        None => release_petite(),
    }
}

/// The petite package's example `name`, from the same build as [`conformance_petite`].
pub fn conformance_example(name: &str) -> Result<PathBuf> {
    let dir = match CONFORMANCE_BUILD.get() {
        Some(dir) => dir.clone(),
        None => {
            cargo(&["build", "--release", "-p", "petite", "--example", name])?;
            target_dir().join("release")
        }
    };
    let exe = dir.join("examples").join(name);
    if !exe.exists() {
        bail!("{} is missing", exe.display());
    }
    Ok(exe)
}

/// The full-size synthetic f32 pi0.5 (lerobot layout, 15.4 GiB) at `target/pi05-full`, written
/// with `petite pi05 synth` by `petite` (a binary) when missing; the benches and `export-pi05`
/// share it.
pub fn full_checkpoint(petite: &Path) -> Result<PathBuf> {
    let dir = root().join("target").join("pi05-full");
    let ck = dir.join("model.safetensors");
    if !ck.exists() {
        eprintln!("xtask: no {}; synthesizing it (15.4 GiB)", ck.display());
        run(Command::new(petite)
            .args(["pi05", "synth", "--out"])
            .arg(&dir))?;
    }
    Ok(ck)
}

/// Builds the release `petite` binary and returns its path (benchmarks and the export task run
/// it as a separate process, under memcap).
pub fn release_petite() -> Result<PathBuf> {
    cargo(&["build", "--release", "-p", "petite"])?;
    Ok(target_dir().join("release").join("petite"))
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

/// Runs a command without echoing it or its output unless it fails (then both are in the
/// error): for loops of many short runs whose lines would drown the log.
pub fn run_quiet(cmd: &mut Command) -> Result<()> {
    let out = cmd.output().with_context(|| format!("starting {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// A Python virtual environment under `target/venv-<name>`, created with python3.12 (pyenv) and
/// the given pip requirements. A stamp file records the requirements, so a venv is rebuilt when
/// they change and reused otherwise. Returns the venv's `python` path.
///
/// Safe to call from several threads: calls for one venv run one at a time, so a tier asking for
/// a venv that [`prefetch_venvs`] is still building waits for it and then reuses it.
pub fn venv(name: &str, requirements: &[&str]) -> Result<PathBuf> {
    let lock = {
        let mut locks = VENV_LOCKS.lock().unwrap_or_else(|e| e.into_inner());
        locks.entry(name.to_string()).or_default().clone()
    };
    let _held = lock.lock().unwrap_or_else(|e| e.into_inner());
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

/// One lock per venv name (see [`venv`]).
static VENV_LOCKS: Mutex<BTreeMap<String, Arc<Mutex<()>>>> = Mutex::new(BTreeMap::new());

/// Builds these venvs (name, requirements) one after another in a background thread, so pip's
/// downloads and installs overlap whatever the caller compiles meanwhile (`cargo xtask ci`: ~8 min
/// of pip beside clippy and the test build). Whoever needs one calls [`venv`] as usual and waits
/// only for what is not finished. A failure here is printed and otherwise ignored: the venv is
/// built again, in the foreground and with its error, when it is asked for.
pub fn prefetch_venvs(venvs: Vec<(String, Vec<String>)>) {
    std::thread::spawn(move || {
        for (name, reqs) in venvs {
            let reqs: Vec<&str> = reqs.iter().map(String::as_str).collect();
            if let Err(e) = venv(&name, &reqs) {
                eprintln!(
                    "xtask: building venv-{name} ahead failed ({e:#}); it is built again when needed"
                );
            }
        }
    });
}

/// Finds a Python 3.12 interpreter: `$PETITE_PYTHON312`, pyenv's 3.12.x, or `python3.12` on PATH.
pub fn python312() -> Result<PathBuf> {
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

/// One command's figures from `memcap --json`, and what it printed on stdout.
#[derive(Debug, Clone, Default)]
pub struct MemcapRun {
    /// The command's exit status (137 when the kernel killed it).
    pub exit: i64,
    /// The cap was hit and a process was killed.
    pub oom_killed: bool,
    /// Largest peak RSS of any single process.
    pub peak_rss: u64,
    /// The cgroup's peak charge (anonymous + page cache + kernel).
    pub peak_cgroup: u64,
    /// Wall-clock seconds.
    pub wall_s: f64,
    /// The command's stdout (also echoed); its stderr passes straight through.
    pub stdout: String,
}

/// Runs `cmd` under `memcap OPTS` (e.g. `["--limit", "512MiB", "--drop-caches"]`), with memcap's
/// report in `json`, and fails unless the command exited 0. Every benchmark measures through this.
pub fn memcap_run(opts: &[&str], cmd: &Command, json: &Path) -> Result<MemcapRun> {
    let r = memcap_measure(opts, cmd, json)?;
    if r.exit != 0 {
        bail!(
            "{:?} failed under memcap (exit {}, oom_killed {})",
            cmd,
            r.exit,
            r.oom_killed
        );
    }
    Ok(r)
}

/// [`memcap_run`] without the exit check, for commands whose non-zero exit still carries figures.
pub fn memcap_measure(opts: &[&str], cmd: &Command, json: &Path) -> Result<MemcapRun> {
    let mut c = Command::new(memcap());
    c.args(opts)
        .arg("--quiet")
        .arg("--json")
        .arg(json)
        .arg("--")
        .arg(cmd.get_program())
        .args(cmd.get_args());
    if let Some(dir) = cmd.get_current_dir() {
        c.current_dir(dir);
    }
    eprintln!("xtask: {c:?}");
    let out = c
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("starting {}", memcap().display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{stdout}");
    let v: serde_json::Value = serde_json::from_slice(
        &std::fs::read(json)
            .with_context(|| format!("reading memcap's report {}", json.display()))?,
    )
    .with_context(|| format!("parsing memcap's report {}", json.display()))?;
    Ok(MemcapRun {
        exit: v["exit"].as_i64().unwrap_or(-1),
        oom_killed: v["oom_killed"].as_bool().unwrap_or(false),
        peak_rss: v["peak_rss_bytes"].as_u64().unwrap_or(0),
        peak_cgroup: v["peak_cgroup_bytes"].as_u64().unwrap_or(0),
        wall_s: v["wall_s"].as_f64().unwrap_or(f64::NAN),
        stdout,
    })
}
