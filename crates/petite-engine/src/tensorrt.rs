//! The `tensorrt` backend: per engine, an ONNX model (weights as external data pointing into
//! the mapping file, so nothing is loaded), built by a real TensorRT builder in a child process
//! (all builder memory goes back to the OS when it exits, and its peak is measured with
//! `wait4`), and the plan wrapped as the `TensorRTBackend` `TR01` delegate blob, streamed file
//! to file.
//!
//! Two builders ([`Tool`]):
//! - `trtexec` from TensorRT >= 10 (JetPack's; builds for the GPU it runs on):
//!   `trtexec --onnx=E.onnx --saveEngine=E.plan --stronglyTyped --skipInference
//!   --memPoolSize=workspace:<MiB>M --timingCacheFile=<dir>/timing.cache [--weightStreaming]`.
//! - TensorRT-RTX through its Python bindings: the driver [`RTX_DRIVER`] (one copy, in
//!   `python/trt_rtx_build.py`, embedded here) fed to the interpreter on stdin, building for
//!   one compute capability with no GPU needed (`--weight-streaming`: `BuilderFlag.WEIGHT_STREAMING`,
//!   read back from the builder config and reported by the driver).
//!
//! Weight streaming ([`TensorRtBuilder::weight_streaming_budget`]): engines are built
//! weight-streamable and every delegate carries the compile spec [`WEIGHT_STREAMING_BUDGET_KEY`]
//! that Torch-TensorRT's ExecuTorch runtime reads per engine in `init()` (see
//! [`weight_streaming_spec`] for the encoding).
//!
//! Why child processes and not bindings in this process: the only Rust TensorRT binding
//! (`tensorrt-rs`) is dead (TensorRT 5-7, last release 2020) and a C++ shim would need TensorRT's
//! headers at build time; more importantly a builder holds several copies of an engine's
//! weights, and only a process exit guarantees that all of it is returned after each engine.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use petite_graph::{Dtype, NodeId, Op, Program};
use petite_weights::{MappedSafetensors, WeightSource};

use crate::onnx::{Flavor, WeightLocation, emit, locations, write_model};
use crate::{
    BuildMemory, BuildStats, BuilderInfo, BuiltEngine, CompileSpec, EngineBuilder, EngineJob,
    Error, IoBinding, Result,
};

/// Backend id Torch-TensorRT's ExecuTorch runtime registers.
pub const BACKEND_ID: &str = "TensorRTBackend";
pub use crate::settings::{TRT_PYTHON_ENV, TRTEXEC_ENV};
/// The TensorRT-RTX build driver, run once per engine (and once with `--probe`).
pub const RTX_DRIVER: &str = include_str!("../python/trt_rtx_build.py");
/// The pip requirement of the TensorRT-RTX venv (`target/venv-trt`).
pub const RTX_REQUIREMENT: &str = "tensorrt-rtx-cu13==1.7.1.116";
/// Compile spec key of the per-engine weight-streaming budget, as Torch-TensorRT's ExecuTorch
/// runtime reads it (`kWeightStreamingBudgetKey` in `WeightStreamingBudget.h`; the Python
/// partitioner's `WEIGHT_STREAMING_BUDGET_COMPILE_SPEC_KEY`).
pub const WEIGHT_STREAMING_BUDGET_KEY: &str = "weight_streaming_budget";

/// The largest budget the runtime can represent: it parses the value into an `int64_t`.
pub const MAX_WEIGHT_STREAMING_BUDGET: u64 = i64::MAX as u64;

/// The `weight_streaming_budget` compile spec for `bytes` of GPU weight memory per engine.
///
/// Encoding (Torch-TensorRT, `cpp/src/torch_tensorrt/executorch/WeightStreamingBudget.cpp`
/// `parse_weight_streaming_budget`, and `py/torch_tensorrt/executorch/partitioner.py`
/// `normalize_weight_streaming_budget_per_engine`): the budget in bytes as ASCII decimal digits,
/// no sign, no whitespace, no NUL terminator (`str(n).encode("ascii")`; the C++ side runs
/// `std::from_chars` over the whole value and rejects any leftover byte), in `[0, 2^63)`. At
/// most one per delegate (a second is rejected as `InvalidProgram`); absent means TensorRT's
/// automatic budget. The runtime clamps it to the engine's streamable size, and a load-time
/// backend option of the same key takes precedence over it.
pub fn weight_streaming_spec(bytes: u64) -> Result<CompileSpec> {
    if bytes > MAX_WEIGHT_STREAMING_BUDGET {
        return Err(Error::Usage(format!(
            "--weight-streaming-budget {bytes}: above 2^63 - 1 bytes, which Torch-TensorRT's runtime cannot represent; pass a smaller size"
        )));
    }
    Ok(CompileSpec {
        key: WEIGHT_STREAMING_BUDGET_KEY.to_string(),
        value: bytes.to_string().into_bytes(),
    })
}

/// The largest weights one op of `engine` reads (its weight operands together, each once) and
/// that node: TensorRT streams weights layer by layer, so a budget below this cannot hold the
/// layer it runs. `None` when the engine reads no weights.
pub fn largest_layer(
    program: &Program,
    engine: &petite_partition::Engine,
) -> Option<(u64, NodeId)> {
    let mut best: Option<(u64, NodeId)> = None;
    for &id in &engine.nodes {
        let node = program.node(id);
        let mut seen = std::collections::BTreeSet::new();
        let bytes: u64 = node
            .inputs
            .iter()
            .filter(|&&v| seen.insert(v))
            .map(|&v| program.node(v))
            .filter(|n| matches!(n.op, Op::Weight { .. }))
            .filter_map(|n| n.tensor().map(|t| t.nbytes() as u64))
            .sum();
        if bytes > 0 && best.is_none_or(|(b, _)| bytes > b) {
            best = Some((bytes, id));
        }
    }
    best
}

/// `bytes` as a size `--weight-streaming-budget` accepts, rounded up (whole MiB, else KiB).
fn size_at_least(bytes: u64) -> String {
    if bytes >= 1 << 20 {
        format!("{}MiB", bytes.div_ceil(1 << 20))
    } else {
        format!("{}KiB", bytes.div_ceil(1 << 10).max(1))
    }
}

/// Compute capability TensorRT-RTX builds for when no GPU is found (the nearest to Jetson
/// Orin's sm87, which TensorRT-RTX does not offer).
pub const DEFAULT_RTX_TARGET: &str = "sm86";

/// Builder memory of TensorRT-RTX 1.7.1 (Python driver, child peak RSS), fitted to the peaks
/// measured on this project's engines: the 108 full-size engines at caps 512/256/128 MiB and the
/// six small-golden engines (`tests/data/rtx_build_memory.tsv`; a test checks that the model
/// bounds every row, and by how much). The peak is reached while the builder adds the weights to
/// the plan: its own copy of the weights plus the parser's mapped view plus the plan being
/// serialized, about 3× the engine's weights over a ~300 MiB floor (the interpreter, the
/// bindings and compiled kernels). `trtexec` is given the same model: JetPack's builder was not
/// measured here.
pub const RTX_BUILD_MEMORY: BuildMemory = BuildMemory {
    base: 336 << 20,
    per_half_byte: 3.15,
    per_full_byte: 2.95,
};

/// Makes the mapping file visible in `dir` under its own file name (a hard link: no copy, and
/// ONNX tools accept it where they reject absolute paths and symlinks escaping the model's
/// directory; a symlink where hard links cannot cross file systems). Returns the name.
pub fn link_weights(mapping: &Path, dir: &Path) -> Result<String> {
    let name = mapping
        .file_name()
        .ok_or_else(|| {
            Error::io(
                mapping,
                "name mapping file",
                std::io::ErrorKind::InvalidInput.into(),
            )
        })?
        .to_string_lossy()
        .into_owned();
    let target = dir.join(&name);
    // Whether `target` is already the mapping file (false: nothing there yet); another file
    // there is an error.
    let linked = || -> Result<bool> {
        let (Ok(a), Ok(b)) = (std::fs::metadata(mapping), std::fs::metadata(&target)) else {
            return Ok(false);
        };
        use std::os::unix::fs::MetadataExt;
        if a.ino() == b.ino() && a.dev() == b.dev() {
            return Ok(true);
        }
        Err(Error::io(
            &target,
            "link mapping file",
            std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "another file of that name is in the engine directory",
            ),
        ))
    };
    if linked()? {
        return Ok(name);
    }
    let made = match std::fs::hard_link(mapping, &target) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            let abs = mapping
                .canonicalize()
                .map_err(|e| Error::io(mapping, "resolve mapping file", e))?;
            std::os::unix::fs::symlink(abs, &target)
        }
        r => r,
    };
    // Engines built at once race to make the link: one makes it, the others find it made.
    if let Err(e) = made
        && (e.kind() != std::io::ErrorKind::AlreadyExists || !linked()?)
    {
        return Err(Error::io(&target, "link mapping file", e));
    }
    Ok(name)
}

/// Which builder a [`Tool`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolKind {
    /// TensorRT's `trtexec`.
    Trtexec,
    /// TensorRT-RTX's Python bindings, through [`RTX_DRIVER`].
    Rtx,
}

/// A TensorRT builder found on this machine, probed: what it is and which version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tool {
    /// Which builder.
    pub kind: ToolKind,
    /// `trtexec`, or the Python interpreter that has `tensorrt_rtx`.
    pub program: PathBuf,
    /// Name and version (the reuse key and `report.json` carry it).
    pub info: BuilderInfo,
    /// Compute capabilities it can target (`sm86`, ...); empty for `trtexec` (its GPU's).
    pub targets: Vec<String>,
}

/// Where to look for a builder: explicit choices first, then the environment, then defaults.
#[derive(Debug, Clone, Default)]
pub struct ToolSearch {
    /// `--trtexec PATH`.
    pub trtexec: Option<PathBuf>,
    /// `--trt-python PY`.
    pub trt_python: Option<PathBuf>,
    /// The venv Python that `cargo xtask` builds (`target/venv-trt/bin/python`), if any.
    pub default_python: Option<PathBuf>,
}

impl Tool {
    /// Probes `trtexec` at `path` (`trtexec --help` prints `[TensorRT vMMmmpp]`).
    pub fn trtexec(path: &Path) -> Result<Tool> {
        let path = &resolved(path);
        if !path.is_file() {
            return Err(missing(format!("trtexec {} is not a file", path.display())));
        }
        let out = Command::new(path)
            .arg("--help")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| Error::io(path, "run trtexec --help", e))?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let version = trtexec_version(&text).ok_or_else(|| {
            missing(format!(
                "{} does not look like TensorRT's trtexec: `--help` printed no `[TensorRT vNNNNNN]` banner",
                path.display()
            ))
        })?;
        Ok(Tool {
            kind: ToolKind::Trtexec,
            program: path.to_path_buf(),
            info: BuilderInfo {
                name: "trtexec".to_string(),
                version: format!("TensorRT {version}"),
            },
            targets: Vec::new(),
        })
    }

    /// Probes a Python interpreter for `tensorrt_rtx` (runs the driver with `--probe`).
    pub fn rtx(python: &Path) -> Result<Tool> {
        let python = &resolved(python);
        let mut child = Command::new(python)
            .args(["-", "--probe"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                missing(format!(
                    "cannot run the TensorRT-RTX Python {}: {e}",
                    python.display()
                ))
            })?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(RTX_DRIVER.as_bytes())
                .map_err(|e| Error::io(python, "feed the driver", e))?;
        }
        let out = child
            .wait_with_output()
            .map_err(|e| Error::io(python, "probe tensorrt_rtx", e))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let probe = stdout
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok());
        let (Some(p), true) = (probe, out.status.success()) else {
            let err = String::from_utf8_lossy(&out.stderr);
            let last = err
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            let last = last.trim();
            return Err(missing(if last.contains("cannot import tensorrt_rtx") {
                format!("{}: {last}", python.display())
            } else {
                format!(
                    "{} cannot import tensorrt_rtx ({})",
                    python.display(),
                    if last.is_empty() { "no output" } else { last }
                )
            }));
        };
        let version = p["version"].as_str().unwrap_or("unknown").to_string();
        let targets = p["targets"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|t| t.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        Ok(Tool {
            kind: ToolKind::Rtx,
            program: python.to_path_buf(),
            info: BuilderInfo {
                name: "tensorrt-rtx".to_string(),
                version,
            },
            targets,
        })
    }

    /// Finds a builder: `--trtexec`, else `$PETITE_TRTEXEC`, else TensorRT-RTX (`--trt-python`,
    /// else `$PETITE_TRT_PYTHON`, else the default venv), else `trtexec` on `PATH`. An explicit
    /// choice that does not work is an error, not a fall-through.
    pub fn find(search: &ToolSearch) -> Result<Tool> {
        if let Some(p) = &search.trtexec {
            return Tool::trtexec(p);
        }
        let env = crate::settings::Settings::from_env().map_err(|e| Error::Usage(e.to_string()))?;
        if let Some(t) = from_env(TRTEXEC_ENV, env.trtexec.as_deref(), Tool::trtexec) {
            return t;
        }
        if let Some(p) = &search.trt_python {
            return Tool::rtx(p);
        }
        if let Some(t) = from_env(TRT_PYTHON_ENV, env.trt_python.as_deref(), Tool::rtx) {
            return t;
        }
        if let Some(p) = search.default_python.as_ref().filter(|p| p.exists()) {
            return Tool::rtx(p);
        }
        match trtexec_on_path(env.path.as_deref()) {
            Some(p) => Tool::trtexec(&p),
            None => Err(missing(format!(
                "no --trtexec, no ${TRTEXEC_ENV}, no --trt-python, no ${TRT_PYTHON_ENV}{}, and no `trtexec` on PATH",
                search
                    .default_python
                    .as_ref()
                    .map(|p| format!(", no {}", p.display()))
                    .unwrap_or_default()
            ))),
        }
    }

    /// Checks `target` (e.g. `sm86`) against what this builder offers.
    pub fn check_target(&self, target: &str) -> Result<()> {
        match self.kind {
            ToolKind::Trtexec => Ok(()),
            ToolKind::Rtx if self.targets.iter().any(|t| t == target) => Ok(()),
            ToolKind::Rtx => Err(Error::Usage(format!(
                "--trt-target {target}: {} builds for {} only",
                self.info,
                self.targets.join(", ")
            ))),
        }
    }
}

/// `path` made absolute when it is a relative path with a directory part (`target/venv/bin/python`):
/// builders run in the engine directory, where it would not resolve. A bare name (`python3.12`)
/// is left to `PATH`.
fn resolved(path: &Path) -> PathBuf {
    if path.is_relative() && path.components().count() > 1 {
        std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
    } else {
        path.to_path_buf()
    }
}

/// The tool `$var` names (its value `p`), probed with `probe`, if the variable is set; a
/// failure says it came from the variable.
fn from_env(var: &str, p: Option<&Path>, probe: fn(&Path) -> Result<Tool>) -> Option<Result<Tool>> {
    let p = p?;
    Some(probe(p).map_err(|e| match e {
        Error::TensorRt(TensorRtError::Missing { what, .. }) => missing(format!("${var}: {what}")),
        other => other,
    }))
}

/// The TensorRT version in trtexec's banner (`[TensorRT v100300]` → `10.3.0`).
pub fn trtexec_version(text: &str) -> Option<String> {
    let at = text.find("[TensorRT v")? + "[TensorRT v".len();
    let digits: String = text[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let v: u64 = digits.parse().ok()?;
    Some(format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
}

/// `trtexec` on `PATH` (its value `path`), if there is one.
fn trtexec_on_path(path: Option<&std::ffi::OsStr>) -> Option<PathBuf> {
    std::env::split_paths(path?)
        .map(|d| d.join("trtexec"))
        .find(|c| c.is_file())
}

/// Errors only the TensorRT backend raises (wrapped by [`Error::TensorRt`]).
#[derive(Debug, thiserror::Error)]
pub enum TensorRtError {
    /// No TensorRT builder (`trtexec` or TensorRT-RTX) is available on this machine.
    #[error("TensorRT is not available: {what}. {hint}")]
    Missing {
        /// What was looked for and not found.
        what: String,
        /// How to point petite at it.
        hint: String,
    },
    /// The TensorRT build ran and failed (non-zero exit, killed, or no plan written).
    #[error("TensorRT build failed ({status}); last output:\n{log_tail}")]
    Build {
        /// Exit status or signal.
        status: String,
        /// The end of the builder's output.
        log_tail: String,
    },
    /// A delegate blob does not follow the `TR01` layout.
    #[error("TR01 blob {path}: {reason}")]
    Blob {
        /// The blob file.
        path: String,
        /// Expected vs found.
        reason: String,
    },
}

fn missing(what: String) -> Error {
    Error::TensorRt(TensorRtError::Missing {
        what,
        hint: format!(
            "Either install TensorRT-RTX (`python3.12 -m venv V && V/bin/pip install \"{RTX_REQUIREMENT}\"`, \
             then --trt-python V/bin/python or {TRT_PYTHON_ENV}=V/bin/python; `cargo xtask ci` builds \
             target/venv-trt), or install TensorRT >= 10 (its bin/ has trtexec) and pass --trtexec PATH \
             or set {TRTEXEC_ENV}; the `reference` and `portable` backends need no TensorRT"
        ),
    })
}

/// Builds TensorRT engines with a [`Tool`] in a child process per engine.
#[derive(Debug)]
pub struct TensorRtBuilder {
    mapping: OnceLock<(PathBuf, BTreeMap<String, WeightLocation>)>,
    /// The builder to run (found and probed once, by [`Tool::find`] or [`Tool::trtexec`] /
    /// [`Tool::rtx`]).
    pub tool: Tool,
    /// Compute capability for TensorRT-RTX (`sm86`); ignored by `trtexec`.
    pub target: String,
    /// Builder workspace pool limit in MiB.
    pub workspace_mib: u64,
    /// Build weight-streamable engines (`--weightStreaming` / `BuilderFlag.WEIGHT_STREAMING`).
    pub weight_streaming: bool,
    /// GPU weight memory per engine at run time, written into every delegate as the
    /// [`WEIGHT_STREAMING_BUDGET_KEY`] compile spec (needs `weight_streaming`; not part of the
    /// engine file, so changing it reuses the engines).
    pub weight_streaming_budget: Option<u64>,
    /// Timing cache shared by all builds (default `<engine dir>/timing.cache`; trtexec only).
    pub timing_cache: Option<PathBuf>,
    /// `device_id` written into the blob.
    pub device_id: u32,
    /// `target_platform` written into the blob.
    pub target_platform: String,
}

impl TensorRtBuilder {
    /// A builder running `tool`; the mapping file comes with
    /// [`EngineBuilder::attach_mapping`].
    pub fn new(tool: Tool) -> Self {
        TensorRtBuilder {
            mapping: OnceLock::new(),
            tool,
            target: DEFAULT_RTX_TARGET.to_string(),
            workspace_mib: 1024,
            weight_streaming: false,
            weight_streaming_budget: None,
            timing_cache: None,
            device_id: 0,
            target_platform: format!("linux_{}", std::env::consts::ARCH),
        }
    }

    /// The compile specs every delegate of this builder carries.
    pub fn compile_specs(&self) -> Result<Vec<CompileSpec>> {
        match self.weight_streaming_budget {
            Some(b) => Ok(vec![weight_streaming_spec(b)?]),
            None => Ok(Vec::new()),
        }
    }

    fn with_specs(&self, mut e: BuiltEngine) -> Result<BuiltEngine> {
        e.compile_specs = self.compile_specs()?;
        Ok(e)
    }

    fn build_inner(
        &self,
        job: &EngineJob<'_>,
        weights: &dyn WeightSource,
        dir: &Path,
    ) -> Result<BuiltEngine> {
        for w in job.program.weights() {
            crate::reference::check_weight(weights, &w)?;
        }
        // The builder runs in `dir` and is handed paths inside it: make them absolute, or a
        // relative `--out` would resolve twice.
        let dir = &std::path::absolute(dir).map_err(|e| Error::io(dir, "resolve", e))?;
        let (mapping, locs) = self.mapping.get().ok_or_else(|| {
            Error::Usage("the TensorRT builder has no mapping file attached".into())
        })?;
        let loc = link_weights(mapping, dir)?;
        let onnx = dir.join(format!("{}.onnx", job.name));
        write_model(&onnx, &emit(job.program, locs, &loc, Flavor::TensorRt)?)?;
        let tool = &self.tool;
        let plan = dir.join(format!("{}.plan", job.name));
        let plan_tmp = dir.join(format!("{}.plan.petite-tmp", job.name));
        let log = dir.join(format!("{}.build.log", job.name));
        let logf = File::create(&log).map_err(|e| Error::io(&log, "create", e))?;
        let logf2 = logf.try_clone().map_err(|e| Error::io(&log, "dup", e))?;
        let mut cmd = Command::new(&tool.program);
        let mut stdin = None;
        match tool.kind {
            ToolKind::Trtexec => {
                // One cache for every build, also those running at once: trtexec (TensorRT >=
                // 8.6) takes an exclusive file lock on it to read it and to merge its timings in.
                let cache = self
                    .timing_cache
                    .clone()
                    .unwrap_or_else(|| dir.join("timing.cache"));
                cmd.arg(format!("--onnx={}", onnx.display()))
                    .arg(format!("--saveEngine={}", plan_tmp.display()))
                    .arg("--stronglyTyped")
                    .arg("--skipInference")
                    .arg(format!("--memPoolSize=workspace:{}M", self.workspace_mib))
                    .arg(format!("--timingCacheFile={}", cache.display()));
                if self.weight_streaming {
                    cmd.arg("--weightStreaming");
                }
            }
            ToolKind::Rtx => {
                cmd.arg("-")
                    .arg("--onnx")
                    .arg(&onnx)
                    .arg("--plan")
                    .arg(&plan_tmp)
                    .arg("--target")
                    .arg(&self.target)
                    .arg("--workspace-mib")
                    .arg(self.workspace_mib.to_string());
                if self.weight_streaming {
                    cmd.arg("--weight-streaming");
                }
                stdin = Some(RTX_DRIVER.as_bytes());
            }
        }
        cmd.current_dir(dir).stdout(logf).stderr(logf2);
        let tool_name = tool.info.name.clone();
        let run = crate::sys::run_measured(&mut cmd, stdin)
            .map_err(|e| Error::io(&tool.program, "run the TensorRT builder", e))?;
        let fail = |status: String| {
            let _ = std::fs::remove_file(&plan_tmp);
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(20).collect();
            Error::TensorRt(TensorRtError::Build {
                status,
                log_tail: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
            })
        };
        if !run.status.success() {
            use std::os::unix::process::ExitStatusExt;
            let s = match (run.status.code(), run.status.signal()) {
                (Some(c), _) => format!("{tool_name} exited with status {c}"),
                (None, Some(sig)) => format!("{tool_name} was killed by signal {sig}"),
                _ => format!("{tool_name} failed"),
            };
            return Err(fail(s));
        }
        let plan_bytes = match std::fs::metadata(&plan_tmp) {
            Ok(m) if m.len() > 0 => m.len(),
            _ => {
                return Err(fail(format!(
                    "{tool_name} succeeded but wrote no plan to {}",
                    plan_tmp.display()
                )));
            }
        };
        if self.weight_streaming && tool.kind == ToolKind::Rtx {
            // The driver reads the flag back from the builder config and reports it; a plan
            // built without it would load fully resident and ignore the budget.
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let set = text
                .lines()
                .rev()
                .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .and_then(|v| v["weight_streaming"].as_bool());
            if set != Some(true) {
                return Err(fail(format!(
                    "{tool_name} did not report BuilderFlag.WEIGHT_STREAMING set on the build (reported {set:?})"
                )));
            }
        }
        std::fs::rename(&plan_tmp, &plan).map_err(|e| Error::io(&plan, "rename", e))?;
        let (inputs, outputs) = crate::bindings(job.program);
        let blob_path = dir.join(self.file_name(job.name));
        let meta = blob::metadata_json(&inputs, &outputs, self.device_id, &self.target_platform);
        let res = blob::write(&blob_path, &meta, &plan);
        // The blob holds the plan; keep one copy on disk.
        let _ = std::fs::remove_file(&plan);
        let header = res?;
        let stats = BuildStats {
            builder_peak_rss_bytes: run.peak_rss_bytes,
            build_s: run.seconds,
            plan_bytes,
        };
        self.with_specs(crate::whole_file_engine(
            job,
            BACKEND_ID,
            &blob_path,
            header.total_len,
            Some(stats),
        ))
    }
}

impl EngineBuilder for TensorRtBuilder {
    fn backend_id(&self) -> &str {
        BACKEND_ID
    }

    /// The device the blob names (`device_id`): Torch-TensorRT's runtime runs the engine there.
    fn device(&self) -> Option<u8> {
        u8::try_from(self.device_id).ok()
    }

    fn info(&self) -> BuilderInfo {
        self.tool.info.clone()
    }

    fn settings(&self) -> String {
        let target = match self.tool.kind {
            ToolKind::Trtexec => "local-gpu",
            ToolKind::Rtx => self.target.as_str(),
        };
        format!(
            "{BACKEND_ID}|TR01|{}|target={target}|workspace={}M|weight_streaming={}|device={}|{}",
            self.info(),
            self.workspace_mib,
            self.weight_streaming,
            self.device_id,
            self.target_platform
        )
    }

    fn file_name(&self, name: &str) -> String {
        format!("{name}.tr01")
    }

    fn memory(&self) -> BuildMemory {
        RTX_BUILD_MEMORY
    }

    /// Every weight comes from the mapping file, in the dtype the program declares: the ONNX
    /// models point into it, and a weight stored once in its compute dtype is what the plan
    /// holds (no cast for the builder to fold into a second, wider copy).
    fn mapping_dtype(&self, declared: Dtype) -> Option<Dtype> {
        Some(declared)
    }

    fn attach_mapping(&self, mapping: &Path) -> Result<()> {
        let m = MappedSafetensors::open_as(mapping, petite_weights::Role::MappingFile)?;
        let entry = (mapping.to_path_buf(), locations(m.header()));
        if let Err(entry) = self.mapping.set(entry)
            && self.mapping.get().map(|(p, _)| p) != Some(&entry.0)
        {
            return Err(Error::Usage(format!(
                "the TensorRT builder already has a mapping file; cannot attach {}",
                mapping.display()
            )));
        }
        Ok(())
    }

    /// The name carries the hash of subgraph, weights and settings (builder and version
    /// included); the blob must parse and hold a non-empty plan.
    fn reuse(&self, path: &Path, job: &EngineJob<'_>) -> Option<BuiltEngine> {
        let (h, _) = blob::read(path).ok()?;
        if h.engine_size == 0 {
            return None;
        }
        self.with_specs(crate::whole_file_engine(
            job,
            BACKEND_ID,
            path,
            h.total_len,
            None,
        ))
        .ok()
    }

    fn build(
        &self,
        job: &EngineJob<'_>,
        weights: &dyn WeightSource,
        dir: &Path,
    ) -> Result<BuiltEngine> {
        self.build_inner(job, weights, dir)
            .map_err(|e| e.in_engine(job.index, job.name))
    }

    /// With a weight-streaming budget: refuses one below the largest weights one layer of any
    /// engine reads (what TensorRT must hold to run that layer), naming the layer and the size to
    /// pass instead; and one the runtime cannot represent.
    fn check_plan(&self, program: &Program, plan: &petite_partition::Plan) -> Result<()> {
        let Some(budget) = self.weight_streaming_budget else {
            return Ok(());
        };
        weight_streaming_spec(budget)?;
        if !self.weight_streaming {
            return Err(Error::Usage(
                "a weight-streaming budget needs weight-streamable engines (weight_streaming)"
                    .into(),
            ));
        }
        let worst = plan
            .engines
            .iter()
            .filter_map(|e| largest_layer(program, e).map(|(b, id)| (b, id, e.index)))
            .max_by_key(|&(b, _, _)| b);
        if let Some((need, id, engine)) = worst
            && budget < need
        {
            return Err(Error::Usage(format!(
                "--weight-streaming-budget {} is below one layer's weights: {} in engine {engine} reads {} of weights, and TensorRT streams a layer's weights whole; pass --weight-streaming-budget {} or more, or leave it out to keep every weight resident",
                petite_weights::human_bytes(budget),
                program.describe(id),
                petite_weights::human_bytes(need),
                size_at_least(need)
            )));
        }
        Ok(())
    }
}

/// The `TR01` delegate blob (Torch-TensorRT's `executorch/serialization.py` layout).
///
/// ```text
/// 0   4  magic "TR01"
/// 4   4  metadata_offset u32 = 32
/// 8   4  metadata_size   u32
/// 12  4  engine_offset   u32 = align16(32 + metadata_size)
/// 16  8  engine_size     u64
/// 24  8  reserved        01 00 00 00 00 00 00 00
/// 32  M  metadata JSON (compact; keys io_bindings, hardware_compatible, device_id,
///        serialized_metadata, target_platform — in that order, the C++ parser scans for them)
/// ..     zero padding to engine_offset
/// E   N  the TensorRT plan
/// ```
pub mod blob {
    use super::*;

    /// Header size.
    pub const HEADER_LEN: u32 = 32;
    /// Magic of blobs without aliased I/O.
    pub const MAGIC: &[u8; 4] = b"TR01";

    /// The parsed header of a blob.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Header {
        /// Offset of the JSON.
        pub metadata_offset: u32,
        /// Length of the JSON.
        pub metadata_size: u32,
        /// Offset of the plan (multiple of 16).
        pub engine_offset: u32,
        /// Length of the plan.
        pub engine_size: u64,
        /// The 8 reserved bytes.
        pub reserved: [u8; 8],
        /// Length of the whole blob.
        pub total_len: u64,
    }

    /// One binding of the metadata, fields in the serializer's order.
    #[derive(serde::Serialize)]
    struct Binding<'a> {
        name: &'a str,
        dtype: &'a str,
        shape: [u64; 0],
        is_input: bool,
    }

    /// The metadata, keys in the order Torch-TensorRT's serializer writes them and its C++
    /// parser scans for them (serde keeps struct field order).
    #[derive(serde::Serialize)]
    struct Metadata<'a> {
        io_bindings: Vec<Binding<'a>>,
        /// Always written, empty: petite has no aliased I/O (so the magic stays `TR01`).
        aliased_io: [u8; 0],
        hardware_compatible: bool,
        device_id: u32,
        serialized_metadata: &'a str,
        target_platform: &'a str,
    }

    /// The metadata JSON, compact: `io_bindings` (inputs then outputs; dtype/shape empty, as
    /// Torch-TensorRT emits them: the runtime reads them from the engine), `aliased_io` (empty),
    /// `hardware_compatible`, `device_id`, `serialized_metadata` (empty: petite has no pickled
    /// Torch-TRT metadata), `target_platform`.
    pub fn metadata_json(
        inputs: &[IoBinding],
        outputs: &[IoBinding],
        device_id: u32,
        target_platform: &str,
    ) -> String {
        let m = Metadata {
            io_bindings: inputs
                .iter()
                .chain(outputs)
                .map(|b| Binding {
                    name: &b.name,
                    dtype: "",
                    shape: [],
                    is_input: b.is_input,
                })
                .collect(),
            aliased_io: [],
            hardware_compatible: false,
            device_id,
            serialized_metadata: "",
            target_platform,
        };
        serde_json::to_string(&m).expect("plain strings and numbers serialize")
    }

    /// Writes `out` = header + `metadata` + padding + the plan file's bytes (copied file to file,
    /// never held), through a temporary name.
    pub fn write(out: &Path, metadata: &str, plan: &Path) -> Result<Header> {
        let bad = |reason: String| {
            Error::TensorRt(TensorRtError::Blob {
                path: out.display().to_string(),
                reason,
            })
        };
        let mut pf = File::open(plan).map_err(|e| Error::io(plan, "open plan", e))?;
        let engine_size = pf.metadata().map_err(|e| Error::io(plan, "stat", e))?.len();
        let msize = u32::try_from(metadata.len())
            .map_err(|_| bad(format!("metadata of {} bytes exceeds u32", metadata.len())))?;
        let eoff = (HEADER_LEN as u64 + msize as u64).div_ceil(16) * 16;
        let eoff = u32::try_from(eoff).map_err(|_| bad("engine offset exceeds u32".into()))?;
        let mut head = Vec::with_capacity(eoff as usize);
        head.extend_from_slice(MAGIC);
        head.extend_from_slice(&HEADER_LEN.to_le_bytes());
        head.extend_from_slice(&msize.to_le_bytes());
        head.extend_from_slice(&eoff.to_le_bytes());
        head.extend_from_slice(&engine_size.to_le_bytes());
        head.extend_from_slice(&[1, 0, 0, 0, 0, 0, 0, 0]);
        head.extend_from_slice(metadata.as_bytes());
        head.resize(eoff as usize, 0);
        // The one durability rule (petite-fs), sealed before the rename: a blob under its
        // final name always has its seal.
        let mut af = petite_fs::AtomicFile::create(out)?;
        let tmp = af.temp().to_path_buf();
        let f = af.file_mut();
        f.write_all(&head)
            .map_err(|e| Error::io(&tmp, "write", e))?;
        // std::io::copy between files uses copy_file_range on Linux (no user-space buffer).
        let n = std::io::copy(&mut pf, f).map_err(|e| Error::io(&tmp, "copy plan", e))?;
        if n != engine_size {
            return Err(bad(format!(
                "copied {n} plan bytes, expected {engine_size}"
            )));
        }
        af.commit_with(|tmp| Ok::<(), Error>(petite_weights::seal::write_for(tmp, out)?))?;
        Ok(Header {
            metadata_offset: HEADER_LEN,
            metadata_size: msize,
            engine_offset: eoff,
            engine_size,
            reserved: [1, 0, 0, 0, 0, 0, 0, 0],
            total_len: eoff as u64 + engine_size,
        })
    }

    /// Reads and checks a blob's header and metadata the way the C++ parser does
    /// (`metadata_offset >= 32`, `metadata_offset + size <= engine_offset`, `engine_offset % 16
    /// == 0`, `engine_offset + engine_size <= len`). Returns the header and the JSON text.
    pub fn read(path: &Path) -> Result<(Header, String)> {
        let bad = |reason: String| {
            Error::TensorRt(TensorRtError::Blob {
                path: path.display().to_string(),
                reason,
            })
        };
        let mut f = File::open(path).map_err(|e| Error::io(path, "open", e))?;
        let total_len = f.metadata().map_err(|e| Error::io(path, "stat", e))?.len();
        let mut h = [0u8; 32];
        f.read_exact(&mut h).map_err(|_| {
            bad(format!(
                "{total_len} bytes, shorter than the 32-byte header"
            ))
        })?;
        if &h[0..4] != MAGIC {
            return Err(bad(format!("magic {:?}, expected \"TR01\"", &h[0..4])));
        }
        let u32at = |o: usize| u32::from_le_bytes([h[o], h[o + 1], h[o + 2], h[o + 3]]);
        let header = Header {
            metadata_offset: u32at(4),
            metadata_size: u32at(8),
            engine_offset: u32at(12),
            engine_size: u64::from_le_bytes(h[16..24].try_into().expect("8 bytes")),
            reserved: h[24..32].try_into().expect("8 bytes"),
            total_len,
        };
        if header.metadata_offset < HEADER_LEN {
            return Err(bad(format!(
                "metadata_offset {} < 32",
                header.metadata_offset
            )));
        }
        if header.metadata_offset as u64 + header.metadata_size as u64 > header.engine_offset as u64
        {
            return Err(bad("metadata runs into the engine".into()));
        }
        if !header.engine_offset.is_multiple_of(16) {
            return Err(bad(format!(
                "engine_offset {} is not 16-aligned",
                header.engine_offset
            )));
        }
        if header.engine_offset as u64 + header.engine_size > total_len {
            return Err(bad(format!(
                "engine {}+{} runs past the blob's {total_len} bytes",
                header.engine_offset, header.engine_size
            )));
        }
        f.seek(SeekFrom::Start(header.metadata_offset as u64))
            .map_err(|e| Error::io(path, "seek", e))?;
        let mut m = vec![0u8; header.metadata_size as usize];
        f.read_exact(&mut m)
            .map_err(|e| Error::io(path, "read metadata", e))?;
        let json = String::from_utf8(m).map_err(|_| bad("metadata is not UTF-8".into()))?;
        Ok((header, json))
    }
}
