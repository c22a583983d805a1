//! The export: checkpoint → mapping file (converted once, reused while the source is unchanged)
//! → prefix and step programs → plans → engines built a few at a time, as many as the memory
//! budget and the cores allow (weights released after their last engine) → `prefix.pte` and `step.pte` (each engine stored once as named data
//! streamed from its file; the timestep table as constant data of `step.pte`) → engine files
//! removed unless kept. Every stage is measured ([`crate::memory`]) into `report.json`.
//!
//! A builder that writes engines in place and needs no mapping file (the reference backend,
//! without `--keep-engines`; `in_place.rs`) skips both intermediates (and so does the portable
//! backend, converting each weight into its place in the `.pte`s; `portable.rs`): each weight is read from
//! the checkpoint once and written once, straight into its engine's `.pte` segment. Its
//! convert stage writes nothing and is reported as `fingerprint` (the seal the mapping file
//! would have, for the export id); its `.pte`s are written as `engines/*.pte.partial` with a
//! journal, so a killed run resumes from the finished segments.
//!
//! Files under `--out`: `prefix.pte`, `step.pte`, `report.json`, `cache/mapping-<key>.safetensors`
//! (the mapping file, kept for the next run; tensorrt only), `engines/` (only
//! while building, or with `--keep-engines`). Finished engine files are named by a hash of their
//! subgraph, the checkpoint's identity and the backend settings, so an interrupted export re-run
//! with the same arguments reuses them. `--backend onnx` ([`onnx`]) writes `pi05.onnx`,
//! `pi05.onnx.data` (the mapping file, moved out of `cache/` when published) and
//! `pi05.onnx.json` instead of the `.pte`s.
//!
//! Faults ([`crate::guard`]): `.petite.lock` is locked (one export per `--out`) before the
//! first write; the inputs' identities are checked at every stage boundary and before the
//! `.pte` files, written under staged names, are renamed to their final ones; the mapping file,
//! engine files and a partial `.pte`'s journaled segments are reused only when their seals
//! (length + checksum) match.
//!
//! `.pte` layout (what [`crate::verify`] reads back): method `forward` has one planned tensor
//! value per value crossing an engine boundary, the program's inputs and outputs in the order of
//! petite-pi05's program interfaces, and one delegate call per engine in plan order (args: the
//! engine's inputs then outputs, in its program's order). `step.pte` has a second method,
//! `timestep_table`, whose only output is the f32 `[steps, R]` table as a constant tensor.

mod engine;
mod in_place;
mod lerobot_files;
mod mapping;
pub mod onnx;
mod portable;

use std::collections::BTreeMap;
use std::io::{IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use petite_pi05::inputs::{CanonicalCheckpoint, check_weights, open_checkpoint};
use petite_pi05::programs::io;
use petite_pi05::{Pi05Config, Precision, build_all};
use petite_pte::WriteOptions;
use petite_reference::Executor;
use petite_weights::{MappedSafetensors, WeightSource};
use sha2::{Digest, Sha256};

use crate::backends::{Backend, BackendOptions, Flag, Output};
use crate::guard::{self, OutputDir, Watch};
use crate::layout;
use crate::layout::spec_path;
use crate::memory::{Recorder, StageRecord, status};
use crate::report::{BackendPart, Report, Totals, Written};
use crate::{Error, Result};

pub use crate::layout::{METHOD, TABLE_METHOD};
/// Alignment of engine segments in the `.pte`: a file-format choice (4 KiB, the smallest Linux
/// page), not the OS page; `verify` maps engine regions rounded to the OS page, so 16/64 KiB-page
/// kernels read it as well.
pub const ENGINE_ALIGNMENT: u64 = 4096;
/// Default engine cap when neither `--engine-cap` nor a backend-driven budget sets one.
pub const DEFAULT_ENGINE_CAP: u64 = 512 << 20;
/// Memory of the mapping-file conversion (a few 8 MiB chunks per thread, two threads).
const CONVERT_BYTES: u64 = 48 << 20;
/// Memory of the portable backend's banded transpose+convert into the `.pte`s: per thread an 8 MiB source
/// band with its rows mapped (unmapped 2 MiB behind) and its converted output, plus readahead
/// of the weight; a full-size export's whole peak RSS measured 53 MiB under `memcap`
/// (docs/MEASUREMENTS.md, `--backend portable`).
const PORTABLE_CONVERT_BYTES: u64 = 80 << 20;

/// Settings of one export.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// Checkpoint: file, `model.safetensors.index.json` or directory; lerobot or Hub layout.
    pub checkpoint: PathBuf,
    /// pi0.5 config JSON (`None`: the real pi0.5).
    pub config: Option<PathBuf>,
    /// Output directory (created if missing).
    pub out: PathBuf,
    /// Engine backend.
    pub backend: Backend,
    /// The backend's own settings (TensorRT: which builder, which target).
    pub backend_options: BackendOptions,
    /// Per-engine weight cap (`None`: from the budget, else [`DEFAULT_ENGINE_CAP`]).
    pub engine_cap: Option<u64>,
    /// Whole-process memory budget, checked before any work.
    pub memory_budget: Option<u64>,
    /// How many engines are built at once (`--jobs`; `None`: as many as the memory budget and
    /// the cores allow). Not part of the export id: the engines and `.pte` bytes are those of a
    /// one-at-a-time build.
    pub jobs: Option<usize>,
    /// Numerics of the exported programs (lerobot's bf16 mode or f32).
    pub precision: Precision,
    /// Keep the engine files after the `.pte` files are written.
    pub keep_engines: bool,
    /// Progress bars on stderr (only drawn when it is a terminal).
    pub progress: bool,
    /// Stop cleanly on SIGINT (finished engines kept for a re-run).
    pub handle_ctrl_c: bool,
    /// Sleep this long after each engine (tests interrupt an export midway with it).
    pub pause_after_engine: Option<Duration>,
    /// Where the delegates' inputs and outputs are planned (`None`: the backend's default —
    /// device memory for engines that run on a GPU, host memory otherwise).
    pub placement: Option<Placement>,
    /// lerobot 0.4.x checkpoints: the state is zero-padded to `max_state_dim` before it is
    /// written into the prompt (`policy.json`'s `state_padded`; 0.5+ write the real state).
    pub state_padded: bool,
    /// Weight-only quantization of the rule's weights (`--weights`; `None`: every weight in
    /// the programs' dtype). See [`petite_pi05::quant`].
    pub weights: Option<petite_graph::quant::Quant>,
    /// Weights the rule would quantize that stay float (`--quantize-skip` patterns).
    pub quantize_skip: Vec<String>,
}

/// Where a `.pte`'s delegate inputs and outputs live in memory (`--placement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Placement {
    /// One host (CPU) buffer for every value, no copies: what CPU engines run on, and what
    /// Torch-TensorRT's runtime copies to the GPU and back around every engine call.
    Host,
    /// As ExecuTorch plans a device delegate: values between delegates in a CUDA buffer,
    /// host↔device copies only at the method's inputs and outputs (the default for
    /// `--backend tensorrt`).
    Device,
}

impl ExportOptions {
    /// Defaults for the given paths: reference backend, bf16, 512 MiB cap, no budget.
    pub fn new(checkpoint: &Path, config: Option<&Path>, out: &Path) -> Self {
        ExportOptions {
            checkpoint: checkpoint.to_path_buf(),
            config: config.map(Path::to_path_buf),
            out: out.to_path_buf(),
            backend: Backend::DEFAULT,
            backend_options: BackendOptions::default(),
            engine_cap: None,
            memory_budget: None,
            jobs: None,
            precision: Precision::Bf16,
            keep_engines: false,
            progress: true,
            handle_ctrl_c: false,
            pause_after_engine: None,
            placement: None,
            state_padded: false,
            weights: None,
            quantize_skip: Vec::new(),
        }
    }

    /// The backend-specific flags these options set, each as the command line spells it.
    pub fn flags(&self) -> Vec<(Flag, String)> {
        let mut used = Vec::new();
        if self.engine_cap.is_some() {
            used.push((Flag::EngineCap, Flag::EngineCap.name().to_string()));
        }
        if self.jobs.is_some() {
            used.push((Flag::Jobs, Flag::Jobs.name().to_string()));
        }
        if self.keep_engines {
            used.push((Flag::KeepEngines, Flag::KeepEngines.name().to_string()));
        }
        if let Some(q) = self.weights {
            used.push((Flag::Weights, format!("--weights {q}")));
        }
        if !self.quantize_skip.is_empty() {
            used.push((Flag::QuantizeSkip, Flag::QuantizeSkip.name().to_string()));
        }
        if let Some(p) = self.placement {
            let v = match p {
                Placement::Host => "host",
                Placement::Device => "device",
            };
            used.push((Flag::Placement, format!("--placement {v}")));
        }
        used.extend(
            self.backend_options
                .flags()
                .into_iter()
                .map(|f| (f, f.name().to_string())),
        );
        used
    }

    /// Refuses, in one line, a `--dtype` the backend does not export and any flag that does
    /// not apply to it ([`Backend::check`], the one rule). [`export`] runs it first; the
    /// command line runs it before anything is read.
    pub fn check(&self) -> Result<()> {
        if self.weights.is_none() && !self.quantize_skip.is_empty() {
            return Err(Error::Usage(
                "--quantize-skip applies with --weights int8|fp8 only".into(),
            ));
        }
        self.backend.check(self.precision, &self.flags())
    }

    /// What `policy.json` and `report.json` record as the weights: the quantization, else the
    /// programs' dtype.
    pub fn weights_name(&self) -> &'static str {
        match self.weights {
            Some(q) => q.name(),
            None => dtype_name(self.precision),
        }
    }
}

/// What an export produced.
#[derive(Debug, Clone)]
pub struct ExportResult {
    /// `prefix.pte` (the `.pte` backends; `--backend onnx` writes none).
    pub prefix_pte: PathBuf,
    /// `step.pte` (the `.pte` backends).
    pub step_pte: PathBuf,
    /// Every file the export published, in order (`.pte` backends: `prefix.pte`, `step.pte`
    /// and, portable, their specs; onnx: `pi05.onnx`, `pi05.onnx.data` unless an earlier run's
    /// already was this mapping file, `pi05.onnx.json`).
    pub files: Vec<PathBuf>,
    /// `report.json`.
    pub report: PathBuf,
    /// The full report.
    pub report_json: serde_json::Value,
    /// The summary table.
    pub table: String,
    /// Engines reused from an earlier run.
    pub engines_reused: usize,
    /// Engines built by this run.
    pub engines_built: usize,
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Makes the first SIGINT set a flag the export checks between steps (the second one, with
/// the default action restored, kills as usual).
fn install_sigint() {
    // SAFETY: installing an async-signal-safe handler (one atomic store) with sigaction.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigint as *const () as usize;
        sa.sa_flags = libc::SA_RESETHAND;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut());
    }
}

/// Whether Ctrl-C was pressed (the export stops at the next step).
fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

fn check_interrupt() -> Result<()> {
    if interrupted() {
        Err(Error::Interrupted)
    } else {
        Ok(())
    }
}

/// The inputs' identity, in two strengths. `content` (each file's size and header hash, and
/// the dtype) is what may reach the output's bytes — the export id, the delegates' names —
/// so the same checkpoint gives the same bytes whenever and wherever it was written (design
/// invariant 4: no time stamps in content). `resume` adds each file's modification time and
/// names only what a re-run may reuse (partial `.pte`s, mapping and engine files): a checkpoint
/// rewritten with other values but the same header is then never mistaken for the old one.
#[derive(Debug, Clone, Default)]
pub(crate) struct Identity {
    /// Sizes and header hashes (and the dtype): safe to write into outputs.
    pub(crate) content: String,
    /// `content` plus modification times: keys reuse, never written into outputs.
    pub(crate) resume: String,
}

impl Identity {
    /// The identity of checkpoint `files` exported at `precision`.
    pub(crate) fn of(files: &[PathBuf], precision: &impl std::fmt::Debug) -> Result<Identity> {
        let (content, resume) = source_keys(files)?;
        Ok(Identity {
            content: format!("{content}|{precision:?}"),
            resume: format!("{resume}|{precision:?}"),
        })
    }
}

/// Keys of a checkpoint's files: (sizes and a hash of each header, the same with each file's
/// modification time too). The header pins every tensor's name, dtype, shape and offset.
/// Cheap: no tensor bytes are read.
fn source_keys(files: &[PathBuf]) -> Result<(String, String)> {
    let (mut content, mut resume) = (Sha256::new(), Sha256::new());
    let mut files = files.to_vec();
    files.sort();
    for f in &files {
        let md = std::fs::metadata(f).map_err(|e| Error::io(f, "stat", e))?;
        let mtime = md
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let mut file = std::fs::File::open(f).map_err(|e| Error::io(f, "open", e))?;
        let mut n = [0u8; 8];
        file.read_exact(&mut n)
            .map_err(|e| Error::io(f, "read header length", e))?;
        let n = u64::from_le_bytes(n).min(petite_weights::MAX_HEADER_LEN);
        let mut header = Vec::new();
        file.take(n)
            .read_to_end(&mut header)
            .map_err(|e| Error::io(f, "read header", e))?;
        for (h, with_time) in [(&mut content, false), (&mut resume, true)] {
            h.update(md.len().to_le_bytes());
            if with_time {
                h.update(mtime.to_le_bytes());
            }
            h.update(n.to_le_bytes());
            h.update(&header);
        }
    }
    Ok((
        hex::encode(content.finalize()),
        hex::encode(resume.finalize()),
    ))
}

fn bar(progress: bool, len: u64, what: &str) -> ProgressBar {
    if !progress || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    if let Ok(style) =
        ProgressStyle::with_template("{prefix:>10} [{bar:30}] {pos}/{len} {msg} ({elapsed})")
    {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_prefix(what.to_string());
    pb
}

/// The timestep table: `[steps, row_len]` f32 values.
struct Table {
    values: Vec<f32>,
    row_len: usize,
}

/// The timestep table, run once on the reference executor: every backend stores the table, so
/// the adaRMS weights it reads stay out of the `.pte` files.
fn timestep_values(
    progs: &petite_pi05::Programs,
    weights: &dyn WeightSource,
    cfg: &Pi05Config,
) -> Result<Table> {
    // Exported bytes (step.pte holds this table): the same on every CPU.
    let outs = Executor::new(&progs.timestep_table, weights)?
        .exact_bf16(true)
        .run(BTreeMap::new())?;
    let values = outs
        .get(io::TIMESTEP_TABLE)
        .and_then(|t| t.float_values())
        .map(|v| v.into_owned())
        .ok_or_else(|| Error::Internal("timestep table program produced no f32 table".into()))?;
    Ok(Table {
        values,
        row_len: petite_pi05::programs::time_row_len(cfg),
    })
}

/// `report.json`: the fields every backend's report starts with (version, what was exported
/// from what, dtype), the backend's own part, the stages and the totals — computed here, once,
/// for every backend.
fn report(
    opts: &ExportOptions,
    checkpoint: crate::report::CheckpointReport,
    quantization: Option<&crate::report::QuantReport>,
    saved: &Saved,
    stages: Vec<StageRecord>,
    seconds: f64,
) -> Report {
    let totals = Totals::compute(&stages, seconds, &saved.written);
    Report {
        petite_version: env!("CARGO_PKG_VERSION").into(),
        checkpoint,
        config: opts.config.as_ref().map(|p| p.display().to_string()),
        dtype: dtype_name(opts.precision).into(),
        backend: opts.backend.name().into(),
        part: saved.part.clone(),
        quantization: quantization.cloned(),
        stages,
        totals,
        verify: None,
    }
}

/// `bf16` or `f32`, as `report.json` and `policy.json` record it.
fn dtype_name(p: Precision) -> &'static str {
    match p {
        Precision::Bf16 => "bf16",
        Precision::F32 => "f32",
    }
}

/// What stage `save` of every backend starts with: a progress bar of one tick per program,
/// durable writes (fsync before the rename) and the output paths.
struct SaveTargets {
    pb: ProgressBar,
    wopts: WriteOptions,
    prefix_pte: PathBuf,
    step_pte: PathBuf,
    /// Whether the backend publishes `prefix.pte` and `step.pte` (all but onnx).
    ptes: bool,
    /// Further `(source, final)` renames the backend's save recorded ([`SaveTargets::publish_as`]),
    /// done in order after the `.pte`s.
    extra: std::cell::RefCell<Vec<(PathBuf, PathBuf)>>,
    /// The export id every program file carries and `policy.json` repeats.
    export_id: String,
}

impl SaveTargets {
    fn new(opts: &ExportOptions, export_id: String) -> Self {
        SaveTargets {
            pb: bar(opts.progress, 2, "save"),
            wopts: WriteOptions::default(),
            prefix_pte: opts.out.join(layout::PREFIX_PTE),
            step_pte: opts.out.join(layout::STEP_PTE),
            ptes: opts.backend.spec().output() != Output::Onnx,
            extra: Default::default(),
            export_id,
        }
    }

    /// Records that `from` (a staged file, or a finished cache file moved into the output) is
    /// to be renamed to `to` when the export publishes, after the checks
    /// [`SaveTargets::finish`] runs.
    fn publish_as(&self, from: PathBuf, to: PathBuf) {
        self.extra.borrow_mut().push((from, to));
    }

    /// Where a stage writes `path` (a `.pte` or its spec) before [`SaveTargets::finish`]
    /// publishes it ([`guard::publish`]).
    fn staged(&self, path: &Path) -> PathBuf {
        layout::staged(path)
    }

    /// Publishes the staged programs (and portable specs) under their final names once the
    /// watched inputs are unchanged ([`guard::publish`]), then writes `report` as `report.json`
    /// next to them and returns the export's result.
    fn finish(
        self,
        opts: &ExportOptions,
        watch: &Watch,
        report: Report,
        table: String,
        saved: &Saved,
    ) -> Result<ExportResult> {
        let mut files = Vec::new();
        if self.ptes {
            for f in [&self.prefix_pte, &self.step_pte] {
                files.push((self.staged(f), f.clone()));
                let spec = spec_path(f);
                if self.staged(&spec).exists() {
                    files.push((self.staged(&spec), spec));
                }
            }
        }
        files.extend(self.extra.take());
        guard::publish(watch, &files)?;
        let report_path = opts.out.join(crate::report::FILE);
        report.write(&report_path)?;
        // lerobot's processors and a `petite` config.json, for the lerobot plugin.
        if let Some(r) = &saved.runner {
            let lerobot = lerobot_files::write(&opts.checkpoint, &opts.out, r, &self.export_id)?;
            files.extend(lerobot.into_iter().map(|f| (PathBuf::new(), f)));
        }
        // Last: a bundle with a policy.json is complete, and its id names the programs' export.
        let spec = petite_pi05::policy::PolicySpec {
            format: petite_pi05::policy::FORMAT.into(),
            export_id: self.export_id.clone(),
            backend: opts.backend.name().into(),
            dtype: dtype_name(opts.precision).into(),
            weights: opts.weights_name().into(),
            weight_bytes: saved.weight_bytes,
            host_table_bytes: saved.host_table_bytes,
            model: saved_cfg(saved).clone(),
            runner: saved.runner.clone(),
        };
        let policy_path = opts.out.join(layout::POLICY);
        crate::report::write_json(&policy_path, &serde_json::to_value(&spec)?)?;
        Ok(ExportResult {
            prefix_pte: self.prefix_pte,
            step_pte: self.step_pte,
            report: report_path,
            files: files.into_iter().map(|(_, f)| f).collect(),
            report_json: serde_json::to_value(&report)?,
            table,
            engines_reused: saved.engines_reused,
            engines_built: saved.engines_built,
        })
    }
}

/// What the load stage found, for every backend: the config, the checkpoint (opened, checked
/// against the programs), the programs, and what the report says of the checkpoint.
struct Loaded {
    cfg: Pi05Config,
    ck: CanonicalCheckpoint,
    progs: petite_pi05::Programs,
    /// What `--weights` quantized, for the report.
    quantization: Option<crate::report::QuantReport>,
    ck_files: Vec<PathBuf>,
    /// RSS of the process before any stage's work: what a budget starts from.
    base: u64,
    checkpoint_desc: crate::report::CheckpointReport,
    /// The lerobot folder's runner metadata, when the checkpoint is one.
    runner: Option<petite_pi05::policy::Runner>,
    /// What identifies the export's inputs beside the weights' content (config, backend,
    /// dtype, settings): hashed with the mapping file's seal into the export id.
    id_material: String,
}

fn saved_cfg(s: &Saved) -> &Pi05Config {
    static DEFAULT: std::sync::OnceLock<Pi05Config> = std::sync::OnceLock::new();
    s.cfg
        .as_ref()
        .unwrap_or_else(|| DEFAULT.get_or_init(Pi05Config::default))
}

/// The bytes of `prefix`'s embedding tables petite-cuda gathers on the host
/// ([`petite_cuda::host_gather`]; their indices computed from the program's inputs).
fn host_table_bytes(prefix: &petite_graph::Program) -> Result<u64> {
    let plan = petite_cuda::host_gather::HostGathers::plan(
        prefix,
        petite_cuda::host_gather::MIN_TABLE_BYTES,
        &|_| true,
    )
    .map_err(|e| Error::Internal(format!("planning the host gathers: {e}")))?;
    Ok(plan.map_or(0, |p| p.tables().1))
}

/// What a backend's stages give the report: its part of `report.json`, what it wrote (for the
/// totals) and the engine counts.
struct Saved {
    /// The model config (for `policy.json`), filled in by [`export`].
    cfg: Option<Pi05Config>,
    /// lerobot's runner metadata, filled in by [`export`].
    runner: Option<petite_pi05::policy::Runner>,
    /// The prefix's and step's weight bytes as stored, filled in by [`export`].
    weight_bytes: Option<u64>,
    /// Of `weight_bytes`, the tables a GPU runtime gathers on the host.
    host_table_bytes: Option<u64>,
    part: BackendPart,
    written: Written,
    engines_reused: usize,
    engines_built: usize,
}

/// One backend's share of the export's stages (its load-stage checks are its constructor). The
/// driver, [`export`], runs them in this order for every backend, measures each, checks for
/// Ctrl-C between them and writes `report.json`.
trait Stages {
    /// The convert stage's name in the report: `convert`, or what the backend does there
    /// instead.
    fn convert_stage(&self) -> &'static str {
        "convert"
    }
    /// convert: the mapping file (`identity` pins the checkpoint and dtype); returns whether an
    /// earlier run's file was reused.
    fn convert(&mut self, identity: &Identity) -> Result<bool>;
    /// The mapping file convert produced, if any (watched for changes from then on).
    fn mapping(&self) -> Option<&MappedSafetensors>;
    /// The seal of the weights the programs are made of, for the export id: the one the
    /// mapping file has (or would have) when keyed by the inputs' content identity, if any.
    fn weights_seal(&self) -> Result<Option<String>>;
    /// timestep: the timestep table from this backend's weights.
    fn timestep(&mut self) -> Result<()>;
    /// Whether the backend builds engines (a backend that builds none records no engines
    /// stage). Default: none.
    fn builds_engines(&self) -> bool {
        false
    }
    /// engines: builds (or reuses) every engine; returns whether all were reused. Default:
    /// nothing to build.
    fn engines(&mut self, identity: &Identity) -> Result<bool> {
        let _ = identity;
        Ok(true)
    }
    /// save: `prefix.pte` and `step.pte` (durably, under the staged names of
    /// [`SaveTargets::staged`]; [`SaveTargets::finish`] publishes them).
    fn save(&mut self, save: &SaveTargets) -> Result<()>;
    /// The backend's part of `report.json` and what it wrote (the driver adds the stages and
    /// computes the totals).
    fn report(&self, save: &SaveTargets) -> Saved;
}

/// The load stage's shared part: config, checkpoint layout and contents, programs, and the
/// check that no output would overwrite an input.
fn load(opts: &ExportOptions) -> Result<Loaded> {
    let resolved =
        crate::checkpoint::resolve(&opts.checkpoint, opts.config.as_deref(), opts.state_padded)?;
    let cfg = resolved.cfg.clone();
    let ck = open_checkpoint(&resolved.weights)?;
    crate::checkpoint::check_against_weights(&resolved, &ck)?;
    let names = ck.inner().names();
    let layout = petite_pi05::names::detect_layout(&names);
    let shards = ck.inner().shards().len();
    let progs = build_all(&cfg, opts.precision)?;
    let (progs, quantization) = match opts.weights {
        Some(q) => {
            let (p, done) = petite_pi05::quant::quantize(&progs, q, &opts.quantize_skip)?;
            let r = crate::report::QuantReport {
                weights: q.name().into(),
                skip: opts.quantize_skip.clone(),
                tensors: done.names.len(),
                bytes_before: done.bytes_before as u64,
                bytes_after: done.bytes_after as u64,
            };
            (p, Some(r))
        }
        None => (progs, None),
    };
    check_weights(
        &ck,
        &resolved.weights.display().to_string(),
        [&progs.timestep_table, &progs.prefix, &progs.step],
    )?;
    let ck_files = ck.files();
    lerobot_files::check_output(&opts.checkpoint, &opts.out)?;
    for out_name in layout::OUTPUTS {
        let o = opts.out.join(out_name);
        if let Ok(oc) = o.canonicalize()
            && ck_files
                .iter()
                .chain(opts.config.iter())
                .any(|f| f.canonicalize().ok().as_ref() == Some(&oc))
        {
            return Err(Error::Usage(format!(
                "{}: the output would overwrite an input",
                o.display()
            )));
        }
    }
    let base = status().map(|s| s.rss).unwrap_or(0);
    let layout_name = match layout {
        Some(petite_pi05::names::Layout::Lerobot) => "lerobot".to_string(),
        Some(petite_pi05::names::Layout::Hub { prefixed }) => {
            format!("hub{}", if prefixed { " (model. prefix)" } else { "" })
        }
        None => "unknown".to_string(),
    };
    let checkpoint_desc = crate::report::CheckpointReport {
        path: opts.checkpoint.display().to_string(),
        layout: layout_name,
        shards,
        files: ck_files.iter().map(|f| f.display().to_string()).collect(),
    };
    let runner = resolved.lerobot.map(|(_, r)| r);
    let id_material = format!(
        "{}|{}|{}|{:?}|{:?}|{:?}|{:?}|{}{}",
        env!("CARGO_PKG_VERSION"),
        cfg.to_json_pretty(),
        opts.backend.name(),
        opts.precision,
        opts.engine_cap,
        opts.placement,
        opts.backend_options,
        // Where the folder was is not what the programs are made of.
        runner
            .as_ref()
            .map(|r| {
                let mut r = r.clone();
                r.source.clear();
                serde_json::to_string(&r).unwrap_or_default()
            })
            .unwrap_or_default(),
        // Quantized programs differ (unquantized ones hash as before).
        match opts.weights {
            Some(q) => format!("|weights {q} skip {:?}", opts.quantize_skip),
            None => String::new(),
        },
    );
    Ok(Loaded {
        cfg,
        ck,
        progs,
        quantization,
        ck_files,
        base,
        checkpoint_desc,
        runner,
        id_material,
    })
}

/// Runs the export: load → convert → timestep → engines → save → report, the same stages for
/// every backend. Every check that can refuse (config, checkpoint layout and contents, budget,
/// output directory) runs in load, before any file is written.
pub fn export(opts: &ExportOptions) -> Result<ExportResult> {
    if opts.handle_ctrl_c {
        install_sigint();
    }
    opts.check()?;
    let rec = Recorder::start(Duration::from_millis(10));

    let st = rec.begin("load");
    let loaded = load(opts)?;
    let mut stages: Box<dyn Stages + '_> = match opts.backend.spec().output() {
        Output::Portable => Box::new(portable::PortableStages::plan(&loaded, opts)?),
        Output::Onnx => Box::new(onnx::OnnxStages::plan(&loaded, opts)?),
        Output::Engines => Box::new(engine::EngineStages::plan(&loaded, opts)?),
    };
    // One writer per output directory, taken before the first write (guard).
    let _out = OutputDir::claim(&opts.out)?;
    let mut watch = Watch::of_checkpoint(&loaded.ck)?;
    let identity = Identity::of(&loaded.ck_files, &opts.precision)?;
    rec.end(st, false);
    check_interrupt()?;

    let st = rec.begin(stages.convert_stage());
    guard::stop_point("convert");
    let reused = stages.convert(&identity)?;
    if let Some(m) = stages.mapping() {
        watch.add(m);
    }
    watch.check()?;
    rec.end(st, reused);
    check_interrupt()?;

    let st = rec.begin("timestep");
    stages.timestep()?;
    watch.check()?;
    rec.end(st, false);
    check_interrupt()?;

    if stages.builds_engines() {
        let st = rec.begin("engines");
        let all_reused = stages.engines(&identity)?;
        watch.check()?;
        rec.end(st, all_reused);
        check_interrupt()?;
    }

    let st = rec.begin("save");
    let save = SaveTargets::new(
        opts,
        export_id(&loaded.id_material, stages.weights_seal()?.as_deref()),
    );
    stages.save(&save)?;
    rec.end(st, false);

    let recorded = rec.stages();
    let total = rec.elapsed();
    let mut saved = stages.report(&save);
    saved.cfg = Some(loaded.cfg.clone());
    saved.runner = loaded.runner.clone();
    saved.weight_bytes = Some(
        [&loaded.progs.prefix, &loaded.progs.step]
            .iter()
            .map(|p| p.weight_bytes() as u64)
            .sum(),
    );
    // Engines of the delegate petite-cuda runs on a GPU (`PetiteReference`, the runtime
    // registry's key) gather large embedding tables' rows on the host; other runtimes hold
    // every weight.
    saved.host_table_bytes =
        if opts.backend.spec().delegate_id() == Some(crate::engines::REFERENCE_ID) {
            Some(host_table_bytes(&loaded.progs.prefix)?)
        } else {
            None
        };
    drop(stages);
    let table_text = crate::report::table(&recorded, total);
    let report = report(
        opts,
        loaded.checkpoint_desc.clone(),
        loaded.quantization.as_ref(),
        &saved,
        recorded,
        total,
    );
    save.finish(opts, &watch, report, table_text, &saved)
}

/// Hex digits of an export id (its length is part of every `.pte`'s layout).
const EXPORT_ID_LEN: usize = 32;

/// The export id: a hash of what the programs are made of — the weights' content as the mapping
/// file's seal records it (its length and SHA-256, of all of a small file, sampled in a large
/// one; the seal the file would have where the backend writes none) and `material` (config,
/// backend, settings). Identical inputs give identical bytes, as before; two exports of
/// different weights (even with equal headers, e.g. two training steps) get different ids.
fn export_id(material: &str, seal: Option<&str>) -> String {
    let mut h = Sha256::new();
    h.update(material.as_bytes());
    if let Some(s) = seal {
        h.update(s.as_bytes());
    }
    hex::encode(&h.finalize()[..EXPORT_ID_LEN / 2])
}
