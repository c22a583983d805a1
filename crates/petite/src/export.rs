//! The export: checkpoint → mapping file (converted once, reused while the source is unchanged)
//! → prefix and step programs → plans → engines built one at a time (weights released after
//! their last engine) → `prefix.pte` and `step.pte` (each engine stored once as named data
//! streamed from its file; the timestep table as constant data of `step.pte`) → engine files
//! removed unless kept. Every stage is measured ([`crate::memory`]) into `report.json`.
//!
//! Files under `--out`: `prefix.pte`, `step.pte`, `report.json`, `cache/mapping-<key>.safetensors`
//! (the bf16 mapping file, kept for the next run), `engines/` (only while building, or with
//! `--keep-engines`). Finished engine files are named by a hash of their subgraph, the
//! checkpoint's identity and the backend settings, so an interrupted export re-run with the same
//! arguments reuses them.
//!
//! `.pte` layout (what [`crate::verify`] reads back): method `forward` has one planned tensor
//! value per value crossing an engine boundary, the program's inputs and outputs in the order of
//! petite-pi05's program interfaces, and one delegate call per engine in plan order (args: the
//! engine's inputs then outputs, in its program's order). `step.pte` has a second method,
//! `timestep_table`, whose only output is the f32 `[steps, R]` table as a constant tensor.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use petite_engine::{BuiltEngine, EngineBuilder, EngineJob, WeightBytes};
use petite_graph::{Dtype, Program, ValueId};
use petite_partition::{PartitionOptions, Plan};
use petite_pi05::inputs::{CanonicalCheckpoint, check_weights, open_checkpoint};
use petite_pi05::programs::io;
use petite_pi05::{Pi05Config, Precision, build_all};
use petite_pte::model::ScalarType;
use petite_pte::{
    DelegateSpec, MethodBuilder, Processed, ProgramBuilder, SegmentData, WriteOptions,
};
use petite_reference::Executor;
use petite_weights::{
    ConvertOptions, MappedSafetensors, Selection, TargetDtype, TensorInfo, TensorView, WeightSource,
};
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::engines::{self, Backend, BackendOptions};
use crate::memory::{Recorder, human, status};
use crate::{Error, Result};

/// Method name of the main method of each `.pte`.
pub const METHOD: &str = "forward";
/// Method of `step.pte` returning the timestep table.
pub const TABLE_METHOD: &str = "timestep_table";
/// Alignment of engine segments in the `.pte`: a file-format choice (4 KiB, the smallest Linux
/// page), not the OS page; `verify` maps whole files, so 16/64 KiB-page kernels read it as well.
pub const ENGINE_ALIGNMENT: u64 = 4096;
/// Default engine cap when neither `--engine-cap` nor a backend-driven budget sets one.
pub const DEFAULT_ENGINE_CAP: u64 = 512 << 20;
/// Memory of the mapping-file conversion (a few 8 MiB chunks per thread, two threads).
const CONVERT_BYTES: u64 = 48 << 20;
/// Memory of the portable mapping file's banded transpose+convert: per thread an 8 MiB source
/// band with its rows mapped (unmapped 2 MiB behind) and its converted output, plus readahead
/// of the weight; measured 62 MiB above the process base at full size (`memcap`, README).
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
}

impl ExportOptions {
    /// Defaults for the given paths: reference backend, bf16, 512 MiB cap, no budget.
    pub fn new(checkpoint: &Path, config: Option<&Path>, out: &Path) -> Self {
        ExportOptions {
            checkpoint: checkpoint.to_path_buf(),
            config: config.map(Path::to_path_buf),
            out: out.to_path_buf(),
            backend: Backend::Reference,
            backend_options: BackendOptions::default(),
            engine_cap: None,
            memory_budget: None,
            precision: Precision::Bf16,
            keep_engines: false,
            progress: true,
            handle_ctrl_c: false,
            pause_after_engine: None,
        }
    }
}

/// What an export produced.
#[derive(Debug, Clone)]
pub struct ExportResult {
    /// `prefix.pte`.
    pub prefix_pte: PathBuf,
    /// `step.pte`.
    pub step_pte: PathBuf,
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

fn check_interrupt() -> Result<()> {
    if INTERRUPTED.load(Ordering::SeqCst) {
        Err(Error::Interrupted)
    } else {
        Ok(())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Identity of a checkpoint's files: size, modification time and a hash of each header (the
/// header pins every tensor's name, dtype, shape and offset). Cheap: no tensor bytes are read.
pub fn source_key(files: &[PathBuf]) -> Result<String> {
    let mut h = Sha256::new();
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
        h.update(md.len().to_le_bytes());
        h.update(mtime.to_le_bytes());
        let mut file = std::fs::File::open(f).map_err(|e| Error::io(f, "open", e))?;
        let mut n = [0u8; 8];
        file.read_exact(&mut n)
            .map_err(|e| Error::io(f, "read header length", e))?;
        let n = u64::from_le_bytes(n).min(petite_weights::MAX_HEADER_LEN);
        let mut header = Vec::new();
        file.take(n)
            .read_to_end(&mut header)
            .map_err(|e| Error::io(f, "read header", e))?;
        h.update(n.to_le_bytes());
        h.update(&header);
    }
    Ok(hex(&h.finalize()))
}

/// The export's weights: bf16-declared weights from the mapping file, the rest (f32 weights of
/// lerobot's bf16 mode: SigLIP, projector, norms, time/action heads) from the checkpoint.
pub struct ExportWeights {
    mapping: Option<MappedSafetensors>,
    from_mapping: BTreeSet<String>,
    checkpoint: CanonicalCheckpoint,
}

impl std::fmt::Debug for ExportWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportWeights")
            .field("from_mapping", &self.from_mapping.len())
            .finish()
    }
}

impl ExportWeights {
    fn pick(&self, name: &str) -> &dyn WeightSource {
        match &self.mapping {
            Some(m) if self.from_mapping.contains(name) => m,
            _ => &self.checkpoint,
        }
    }
}

impl WeightSource for ExportWeights {
    fn names(&self) -> Vec<String> {
        self.checkpoint.names()
    }
    fn info(&self, name: &str) -> petite_weights::Result<TensorInfo> {
        self.pick(name).info(name)
    }
    fn tensor(&self, name: &str) -> petite_weights::Result<TensorView<'_>> {
        self.pick(name).tensor(name)
    }
    fn release(&self, names: &[&str]) -> petite_weights::Result<()> {
        let (m, c): (Vec<&str>, Vec<&str>) = names
            .iter()
            .partition(|n| self.mapping.is_some() && self.from_mapping.contains(**n));
        if let Some(map) = &self.mapping
            && !m.is_empty()
        {
            map.release(&m)?;
        }
        if !c.is_empty() {
            self.checkpoint.release(&c)?;
        }
        Ok(())
    }
    fn release_range(&self, name: &str, start: usize, end: usize) -> petite_weights::Result<()> {
        self.pick(name).release_range(name, start, end)
    }
    fn prefetch_range(&self, name: &str, start: usize, end: usize) -> petite_weights::Result<()> {
        self.pick(name).prefetch_range(name, start, end)
    }
    fn files(&self) -> Vec<PathBuf> {
        let mut f = self.checkpoint.files();
        if let Some(m) = &self.mapping {
            f.push(m.path().to_path_buf());
        }
        f
    }
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

/// Whether `dir` accepts new files (a probe file is created and removed).
fn check_writable(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "create output directory", e))?;
    let probe = dir.join(format!(".petite-probe-{}", std::process::id()));
    std::fs::File::create(&probe).map_err(|e| Error::io(dir, "write into output directory", e))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// The weights that go to the mapping file, each with its dtype there: a name goes when the
/// backend wants every read of it from the mapping file in one dtype; a name the backend reads
/// from the checkpoint anywhere stays there. A name wanted in two dtypes is an error naming it.
fn mapping_selection(
    programs: &[&Program],
    builder: &dyn EngineBuilder,
) -> Result<Vec<(String, Dtype)>> {
    let mut wanted: BTreeMap<String, Dtype> = BTreeMap::new();
    let mut checkpoint_read = BTreeSet::new();
    for p in programs {
        for w in p.weights() {
            match builder.mapping_dtype(w.dtype) {
                None => {
                    checkpoint_read.insert(w.name);
                }
                Some(d) => {
                    let slot = *wanted.entry(w.name.clone()).or_insert(d);
                    if slot != d {
                        return Err(Error::Usage(format!(
                            "weight `{}` is read as {} and as {}: the {} builder reads both \
                             from the mapping file, which holds one copy",
                            w.name,
                            slot.name(),
                            d.name(),
                            builder.backend_id()
                        )));
                    }
                }
            }
        }
    }
    Ok(wanted
        .into_iter()
        .filter(|(n, _)| !checkpoint_read.contains(n))
        .collect())
}

/// The mapping file for `selection` of `ck`: reused when a file for the same source identity
/// and selection exists and opens, else converted (temporary name, renamed).
fn mapping_file(
    ck: &CanonicalCheckpoint,
    source: &str,
    selection: &[(String, Dtype)],
    cache: &Path,
    progress: bool,
) -> Result<(MappedSafetensors, bool, petite_weights::ConvertReport)> {
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    h.update(b"|bf16|");
    for (n, d) in selection {
        h.update(n.as_bytes());
        // bf16 entries hash as before per-tensor dtypes existed (same key, same file name).
        if *d != Dtype::Bf16 {
            h.update([1]);
            h.update(d.name().as_bytes());
        }
        h.update([0]);
    }
    let key = hex(&h.finalize());
    let path = mapping_path(cache, &key);
    if let Some(m) = current_mapping(&path, &key, selection.iter().map(|(n, _)| n.as_str())) {
        let rep = petite_weights::ConvertReport {
            tensors: selection.len(),
            dropped: vec![],
            bytes_read: 0,
            bytes_written: 0,
            seconds: 0.0,
        };
        return Ok((m, true, rep));
    }
    clear_stale_mappings(cache, &path)?;
    let opts = ConvertOptions {
        dtype: TargetDtype::Bf16,
        selection: Selection::Keep(selection.iter().map(|(n, _)| n.clone()).collect()),
        threads: 2,
        progress,
        metadata: vec![("petite.mapping_key".to_string(), key)],
        dtypes: selection
            .iter()
            .filter(|(_, d)| *d != Dtype::Bf16)
            .map(|(n, d)| (n.clone(), petite_reference::weights_dtype(*d)))
            .collect(),
        ..ConvertOptions::default()
    };
    let rep = petite_weights::convert(ck, &path, &opts)?;
    Ok((MappedSafetensors::open(&path)?, false, rep))
}

/// Where the mapping file for `key` lives under `cache`.
fn mapping_path(cache: &Path, key: &str) -> PathBuf {
    cache.join(format!("mapping-{}.safetensors", &key[..16]))
}

/// The mapping file at `path` if an earlier run wrote it under `key` (which covers the source
/// files, dtype and selection) and it holds every tensor in `names`; anything else is rewritten.
fn current_mapping<'a>(
    path: &Path,
    key: &str,
    mut names: impl Iterator<Item = &'a str>,
) -> Option<MappedSafetensors> {
    let m = MappedSafetensors::open(path).ok()?;
    let meta_ok = m
        .header()
        .metadata
        .iter()
        .any(|(k, v)| k == "petite.mapping_key" && v == key);
    (meta_ok && names.all(|n| m.info(n).is_ok())).then_some(m)
}

/// Creates `cache` and removes its mapping files other than `keep`: they belong to another
/// source (or dtype), and one output directory holds one mapping file.
fn clear_stale_mappings(cache: &Path, keep: &Path) -> Result<()> {
    std::fs::create_dir_all(cache).map_err(|e| Error::io(cache, "create cache directory", e))?;
    if let Ok(rd) = std::fs::read_dir(cache) {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with("mapping-") && e.path() != keep {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    Ok(())
}

/// The timestep table (`[steps, time_row_len]` f32 values, and the row length), run once on
/// the reference executor: every backend stores the table, so the adaRMS weights it reads stay
/// out of the `.pte` files.
fn timestep_values(
    progs: &petite_pi05::Programs,
    weights: &dyn WeightSource,
    cfg: &Pi05Config,
) -> Result<(Vec<f32>, usize)> {
    let outs = Executor::new(&progs.timestep_table, weights)?.run(BTreeMap::new())?;
    let table = outs
        .get(io::TIMESTEP_TABLE)
        .and_then(|t| t.float_values())
        .map(|v| v.into_owned())
        .ok_or_else(|| Error::Usage("timestep table program produced no f32 table".into()))?;
    Ok((table, petite_pi05::programs::time_row_len(cfg)))
}

/// `report.json`'s content: the fields every backend's report starts with (version, what was
/// exported from what, backend, dtype), then the backend's own `rest`, in its order.
fn report_json(
    opts: &ExportOptions,
    checkpoint: serde_json::Value,
    rest: serde_json::Value,
) -> serde_json::Value {
    let mut report = json!({
        "petite_version": env!("CARGO_PKG_VERSION"),
        "checkpoint": checkpoint,
        "config": opts.config.as_ref().map(|p| p.display().to_string()),
        "backend": opts.backend.name(),
        "dtype": match opts.precision { Precision::Bf16 => "bf16", Precision::F32 => "f32" },
    });
    if let (Some(m), serde_json::Value::Object(rest)) = (report.as_object_mut(), rest) {
        m.extend(rest);
    }
    report
}

/// What stage `save` of either backend starts with: a progress bar of one tick per `.pte`,
/// durable writes (fsync before the rename) and the two output paths.
struct SaveTargets {
    pb: ProgressBar,
    wopts: WriteOptions,
    prefix_pte: PathBuf,
    step_pte: PathBuf,
}

impl SaveTargets {
    fn new(opts: &ExportOptions) -> Self {
        SaveTargets {
            pb: bar(opts.progress, 2, "save"),
            wopts: WriteOptions {
                fsync: true,
                ..WriteOptions::default()
            },
            prefix_pte: opts.out.join("prefix.pte"),
            step_pte: opts.out.join("step.pte"),
        }
    }

    /// Writes `report` as `report.json` next to the programs and returns the export's result.
    fn finish(
        self,
        opts: &ExportOptions,
        report: serde_json::Value,
        table: String,
        engines_reused: usize,
        engines_built: usize,
    ) -> Result<ExportResult> {
        let report_path = opts.out.join("report.json");
        crate::report::write_json(&report_path, &report)?;
        Ok(ExportResult {
            prefix_pte: self.prefix_pte,
            step_pte: self.step_pte,
            report: report_path,
            report_json: report,
            table,
            engines_reused,
            engines_built,
        })
    }
}

/// Adds method `forward` for `program` run as `engines` (each stored once as named data).
fn forward_method(
    pb: &mut ProgramBuilder,
    program: &Program,
    engines: &[BuiltEngine],
) -> Result<()> {
    let mut m = MethodBuilder::new(METHOD);
    let mut values: BTreeMap<ValueId, i32> = BTreeMap::new();
    let mut value_of = |m: &mut MethodBuilder, v: ValueId| -> Result<i32> {
        if let Some(&i) = values.get(&v) {
            return Ok(i);
        }
        let t = program.node(v).tensor().ok_or_else(|| {
            Error::Usage(format!(
                "value {v} crossing an engine boundary is not a tensor"
            ))
        })?;
        let sizes: Vec<i32> = t.shape.iter().map(|&d| d as i32).collect();
        let i = m.planned_tensor(petite_portable::scalar_type(t.dtype), &sizes)?;
        values.insert(v, i);
        Ok(i)
    };
    let mut inputs = Vec::new();
    for &id in &program.inputs {
        inputs.push(value_of(&mut m, id)?);
    }
    for e in engines {
        let (path, offset, len) = engines::payload(e);
        let seg = pb.add_named_data(
            &e.name,
            SegmentData::file_region(path, offset, len),
            ENGINE_ALIGNMENT,
        )?;
        let d = m.delegate(DelegateSpec {
            id: e.backend_id.clone(),
            processed: Processed::Segment(seg),
            compile_specs: engines::compile_specs(e),
        });
        let mut args = Vec::new();
        for &v in e.input_values.iter().chain(&e.output_values) {
            args.push(value_of(&mut m, v)?);
        }
        m.delegate_call(d, &args);
    }
    let mut outputs = Vec::new();
    for o in &program.outputs {
        outputs.push(value_of(&mut m, o.value)?);
    }
    m.inputs(&inputs);
    m.outputs(&outputs);
    pb.add_method(m)?;
    Ok(())
}

/// Builds (or reuses) every engine of `plan`, in order, releasing weights after their last
/// engine. Returns the engines and, per engine, `(reused, seconds)`.
#[allow(clippy::too_many_arguments)]
fn build_engines(
    tag: &str,
    plan: &Plan,
    program: &Program,
    weights: &ExportWeights,
    builder: &dyn EngineBuilder,
    identity: &str,
    dir: &Path,
    opts: &ExportOptions,
    pb: &ProgressBar,
) -> Result<(Vec<BuiltEngine>, Vec<serde_json::Value>)> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "create engine directory", e))?;
    let last_use = engines::last_uses(plan);
    let mut built = Vec::with_capacity(plan.engines.len());
    let mut records = Vec::with_capacity(plan.engines.len());
    for (i, e) in plan.engines.iter().enumerate() {
        check_interrupt()?;
        let sub = plan.engine_program(program, i)?;
        let mut h = Sha256::new();
        h.update(builder.settings().as_bytes());
        h.update(b"|");
        h.update(identity.as_bytes());
        h.update(b"|");
        h.update(sub.program.to_json()?.as_bytes());
        let name = format!("{tag}_{i:03}_{}", &hex(&h.finalize())[..16]);
        let job = EngineJob {
            index: i,
            name: &name,
            program: &sub.program,
            input_values: &sub.input_values,
            output_values: &sub.output_values,
        };
        pb.set_message(name.clone());
        let t = std::time::Instant::now();
        let path = dir.join(builder.file_name(&name));
        let (eng, reused) = match builder.reuse(&path, &job) {
            Some(b) => (b, true),
            None => (builder.build(&job, weights, dir)?, false),
        };
        if !last_use[i].is_empty() {
            engines::release_weights(weights, &last_use[i])?;
        }
        let wb = WeightBytes::of_engine(program, e);
        records.push(json!({
            "name": name,
            "weight_bytes": e.weight_bytes,
            "weight_bytes_16bit": wb.half,
            "weight_bytes_32bit": wb.full,
            "build_memory_estimate": builder.memory().bytes(wb),
            "file_bytes": eng.file_bytes,
            "over_cap": e.over_cap,
            "reused": reused,
            "seconds": t.elapsed().as_secs_f64(),
            "rss_after": status().map(|s| s.rss),
            "builder_peak_rss_bytes": eng.stats.map(|s| s.builder_peak_rss_bytes),
            "build_s": eng.stats.map(|s| s.build_s),
            "plan_bytes": eng.stats.map(|s| s.plan_bytes),
            "compile_specs": engines::compile_specs_json(&eng),
        }));
        built.push(eng);
        pb.inc(1);
        if let Some(d) = opts.pause_after_engine {
            std::thread::sleep(d);
        }
    }
    Ok((built, records))
}

/// Runs the export. Every check that can refuse (config, checkpoint layout and contents,
/// budget, output directory) runs before any file is written.
pub fn export(opts: &ExportOptions) -> Result<ExportResult> {
    if opts.handle_ctrl_c {
        install_sigint();
    }
    let rec = Recorder::start(Duration::from_millis(10));

    // --- load: config, checkpoint, programs, plans, budget ---------------------------------
    let st = rec.begin("load");
    let cfg = match &opts.config {
        Some(p) => Pi05Config::from_json_file(p)?,
        None => Pi05Config::default(),
    };
    let ck = open_checkpoint(&opts.checkpoint)?;
    let names = ck.inner().names();
    let layout = petite_pi05::names::detect_layout(&names);
    let shards = ck.inner().shards().len();
    let progs = build_all(&cfg, opts.precision)?;
    check_weights(
        &ck,
        &opts.checkpoint.display().to_string(),
        [&progs.timestep_table, &progs.prefix, &progs.step],
    )?;
    let ck_files = ck.files();
    for out_name in ["prefix.pte", "step.pte", "report.json"] {
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
    let checkpoint_desc = json!({
        "path": opts.checkpoint.display().to_string(),
        "layout": layout_name,
        "shards": shards,
        "files": ck_files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>(),
    });
    if opts.backend == Backend::Portable {
        return export_portable(
            opts,
            rec,
            st,
            &cfg,
            ck,
            &progs,
            &ck_files,
            base,
            checkpoint_desc,
        );
    }
    if opts.backend == Backend::TensorRt && opts.precision != Precision::Bf16 {
        return Err(Error::Usage(
            "--backend tensorrt exports bf16 programs only (lerobot's bf16 mode); use --dtype bf16"
                .into(),
        ));
    }
    // Finds and probes the backend's tool: a missing builder is refused before any work.
    let builder = opts.backend.builder(&opts.backend_options)?;
    let memory = builder.memory();
    // On an integrated GPU (Jetson) the export shares the device's one memory pool: with no cap
    // or budget given, the budget is what is available now.
    let mut memory_budget = opts.memory_budget;
    if opts.backend == Backend::TensorRt && opts.engine_cap.is_none() && memory_budget.is_none() {
        let gpu = petite_engine::gpu::probe();
        if let Some(b) = petite_engine::gpu::default_memory_budget(gpu.as_ref()) {
            eprintln!(
                "petite: integrated GPU ({}): memory budget {} (MemAvailable); pass --memory-budget or --engine-cap to choose",
                gpu.map(|g| g.name).unwrap_or_default(),
                human(b)
            );
            memory_budget = Some(b);
        }
    }
    let engine_cap = match (opts.engine_cap, memory_budget) {
        (Some(c), _) => c,
        (None, Some(b)) => memory
            .cap_for(b.saturating_sub(base))
            .unwrap_or(DEFAULT_ENGINE_CAP),
        (None, None) => DEFAULT_ENGINE_CAP,
    };
    if engine_cap == 0 {
        return Err(Error::Budget(format!(
            "memory budget {} leaves no room for an engine: the process already uses {}",
            human(memory_budget.unwrap_or(0)),
            human(base)
        )));
    }
    let popts = PartitionOptions::new(engine_cap);
    let prefix_plan = petite_partition::plan(&progs.prefix, &popts)?;
    let step_plan = petite_partition::plan(&progs.step, &popts)?;
    let largest = prefix_plan
        .max_engine_weight_bytes()
        .max(step_plan.max_engine_weight_bytes());
    // The costliest engine to build under the backend's memory model (by dtype mix).
    let mut engine_need = 0u64;
    for (plan, program) in [(&prefix_plan, &progs.prefix), (&step_plan, &progs.step)] {
        builder.check_plan(program, plan)?; // e.g. a weight-streaming budget below one layer
        for e in &plan.engines {
            engine_need = engine_need.max(memory.bytes(WeightBytes::of_engine(program, e)));
        }
    }
    let build_need = engine_need.max(CONVERT_BYTES);
    let need = base + build_need;
    if let Some(b) = memory_budget
        && need > b
    {
        return Err(Error::Budget(format!(
            "memory budget {} is too small: the process base is {} and the largest step needs {} \
             more ({} building an engine of up to {} weights under engine cap {}; conversion \
             {}), {} in all; nothing was done",
            human(b),
            human(base),
            human(build_need),
            builder.info(),
            human(largest),
            human(engine_cap),
            human(CONVERT_BYTES),
            human(need)
        )));
    }
    check_writable(&opts.out)?;
    let identity = format!("{}|{:?}", source_key(&ck_files)?, opts.precision);
    rec.end(st, false);
    check_interrupt()?;

    // --- convert: the mapping file ---------------------------------------------------------
    let st = rec.begin("convert");
    let all_programs = [&progs.timestep_table, &progs.prefix, &progs.step];
    let selection = mapping_selection(&all_programs, builder.as_ref())?;
    let cache = opts.out.join("cache");
    let (mapping, mapping_reused, conv) = if selection.is_empty() {
        (None, true, None)
    } else {
        let (m, reused, rep) = mapping_file(&ck, &identity, &selection, &cache, opts.progress)?;
        (Some(m), reused, Some(rep))
    };
    let mapping_path = mapping.as_ref().map(|m| m.path().to_path_buf());
    if let Some(p) = &mapping_path {
        builder.attach_mapping(p)?;
    }
    let mapping_bytes = mapping.as_ref().map(|m| m.mapped_len() as u64).unwrap_or(0);
    let weights = ExportWeights {
        mapping,
        from_mapping: selection.iter().map(|(n, _)| n.clone()).collect(),
        checkpoint: ck,
    };
    rec.end(st, mapping_reused);
    check_interrupt()?;

    // --- timestep table (reference executor, once) -----------------------------------------
    let st = rec.begin("timestep");
    let (table, r) = timestep_values(&progs, &weights, &cfg)?;
    rec.end(st, false);

    // --- engines -----------------------------------------------------------------------------
    let st = rec.begin("engines");
    let engines_dir = opts.out.join("engines");
    let n = (prefix_plan.engines.len() + step_plan.engines.len()) as u64;
    let pb = bar(opts.progress, n, "engines");
    let (prefix_engines, prefix_rec) = build_engines(
        "prefix",
        &prefix_plan,
        &progs.prefix,
        &weights,
        builder.as_ref(),
        &identity,
        &engines_dir,
        opts,
        &pb,
    )?;
    let (step_engines, step_rec) = build_engines(
        "step",
        &step_plan,
        &progs.step,
        &weights,
        builder.as_ref(),
        &identity,
        &engines_dir,
        opts,
        &pb,
    )?;
    pb.finish_and_clear();
    let reused = prefix_rec
        .iter()
        .chain(&step_rec)
        .filter(|r| r["reused"] == true)
        .count();
    let built = prefix_rec.len() + step_rec.len() - reused;
    rec.end(st, built == 0);
    check_interrupt()?;

    // --- save: prefix.pte, step.pte -----------------------------------------------------------
    let st = rec.begin("save");
    let save = SaveTargets::new(opts);
    let (pb, wopts) = (&save.pb, save.wopts);
    let (prefix_pte, step_pte) = (&save.prefix_pte, &save.step_pte);
    let mut p = ProgramBuilder::new();
    forward_method(&mut p, &progs.prefix, &prefix_engines)?;
    let prefix_sum = p.write(prefix_pte, wopts)?;
    pb.inc(1);
    let mut p = ProgramBuilder::new();
    forward_method(&mut p, &progs.step, &step_engines)?;
    let bytes: Vec<u8> = table.iter().flat_map(|v| v.to_le_bytes()).collect();
    let idx = p.add_constant(&bytes);
    let mut tm = MethodBuilder::new(TABLE_METHOD);
    let tv = tm.constant_tensor(ScalarType::FLOAT, &[cfg.steps as i32, r as i32], idx);
    tm.outputs(&[tv]);
    p.add_method(tm)?;
    let step_sum = p.write(step_pte, wopts)?;
    pb.finish_and_clear();
    if !opts.keep_engines {
        for e in prefix_engines.iter().chain(&step_engines) {
            let _ = std::fs::remove_file(&e.file);
        }
        // Only petite's own files live there (engines, TensorRT's ONNX models, logs, timing
        // cache, the mapping-file link).
        let _ = std::fs::remove_dir_all(&engines_dir);
    }
    rec.end(st, false);

    // --- report ------------------------------------------------------------------------------
    let stages = rec.stages();
    let total = rec.elapsed();
    let weight_bytes = prefix_plan.weight_bytes + step_plan.weight_bytes + {
        progs.timestep_table.weight_bytes() as u64
    };
    let engine_bytes: u64 = prefix_engines
        .iter()
        .chain(&step_engines)
        .map(|e| e.file_bytes)
        .sum();
    let pte_bytes = prefix_sum.file_len + step_sum.file_len;
    let mapping_written = if mapping_reused { 0 } else { mapping_bytes };
    let written_logical = mapping_written + pte_bytes + engine_bytes;
    let table_text = crate::report::table(&stages, total);
    let report = report_json(
        opts,
        checkpoint_desc,
        json!({
            "engine_cap": engine_cap,
            "memory_budget": memory_budget,
            "memory_estimate": need,
            "builder": builder.info().to_string(),
            "builder_settings": builder.settings(),
            "build_memory_model": memory,
            "mapping": {
                "path": mapping_path.map(|p| p.display().to_string()),
                "reused": mapping_reused,
                "bytes": mapping_bytes,
                "tensors": selection.len(),
                "convert_seconds": conv.as_ref().map(|c| c.seconds),
            },
            "programs": {
                "prefix": {"pte": prefix_pte.display().to_string(), "bytes": prefix_sum.file_len,
                            "engines": prefix_rec, "weight_bytes": prefix_plan.weight_bytes},
                "step": {"pte": step_pte.display().to_string(), "bytes": step_sum.file_len,
                          "engines": step_rec, "weight_bytes": step_plan.weight_bytes,
                          "timestep_table": [cfg.steps, r]},
            },
            "engines": {"built": built, "reused": reused, "bytes": engine_bytes,
                         "kept": opts.keep_engines},
            "stages": stages,
            "totals": {
                "seconds": total,
                "weight_bytes": weight_bytes,
                "bytes_written_files": written_logical,
                "bytes_written_storage": stages.iter().map(|s| s.bytes_written).sum::<u64>(),
                "bytes_read_storage": stages.iter().map(|s| s.bytes_read).sum::<u64>(),
                "written_per_weight_byte_mapping_plus_pte":
                    (mapping_written + pte_bytes) as f64 / weight_bytes.max(1) as f64,
                "written_per_weight_byte_all_files":
                    written_logical as f64 / weight_bytes.max(1) as f64,
                "peak_rss": stages.iter().map(|s| s.peak_rss).max(),
                "peak_anon": stages.iter().map(|s| s.peak_anon).max(),
            },
        }),
    );
    save.finish(opts, report, table_text, reused, built)
}

/// File next to a portable `.pte` describing its methods' inputs, outputs and memory plans
/// (what a driver needs to feed it; `petite verify` and the conformance driver read it).
pub fn spec_path(pte: &Path) -> PathBuf {
    let mut s = pte.as_os_str().to_owned();
    s.push(".json");
    PathBuf::from(s)
}

/// `--backend portable`: the same stages and bounds as the engine backends, without engines.
/// load (checks, programs, lowering of prefix and step to portable kernel calls, memory plans:
/// every refusal happens here, before any file) → convert (the mapping file: every weight once,
/// in the program's dtype and the layout the `.pte` stores, streamed tensor by tensor; reused
/// while the checkpoint is unchanged) → timestep table (once, on the reference executor, as the
/// engine backends do: the adaRMS weights it reads, 0.44 GiB at full size, stay out of the
/// `.pte`) → save (`prefix.pte` = method `forward`; `step.pte` = `forward` + `timestep_table`,
/// a kernel call returning the table; constants are regions of the mapping file copied
/// in-kernel, so each weight byte is written into the `.pte` once and never passes through
/// memory).
#[allow(clippy::too_many_arguments)]
fn export_portable(
    opts: &ExportOptions,
    rec: Recorder,
    st: crate::memory::Stage,
    cfg: &Pi05Config,
    ck: CanonicalCheckpoint,
    progs: &petite_pi05::Programs,
    ck_files: &[PathBuf],
    base: u64,
    checkpoint_desc: serde_json::Value,
) -> Result<ExportResult> {
    let build_need = PORTABLE_CONVERT_BYTES;
    let need = base + build_need;
    if let Some(b) = opts.memory_budget
        && need > b
    {
        return Err(Error::Budget(format!(
            "memory budget {} is too small: the process base is {} and converting the weights \
             one at a time needs {} more, {} in all; nothing was done",
            human(b),
            human(base),
            human(build_need),
            human(need)
        )));
    }
    if opts.engine_cap.is_some() {
        return Err(Error::Usage(
            "--engine-cap does not apply to --backend portable (it builds no engines)".into(),
        ));
    }
    let lower = |what: &str, p: &Program| {
        petite_portable::lower(p).map_err(|e| {
            Error::Usage(format!(
                "{what} program: {e}; --backend portable cannot export it (nothing was written)"
            ))
        })
    };
    let l_prefix = lower("prefix", &progs.prefix)?;
    let l_step = lower("step", &progs.step)?;
    let (p_prefix, p_step) = (
        petite_portable::plan(&l_prefix),
        petite_portable::plan(&l_step),
    );
    let table = petite_portable::stored_weights(&[&l_prefix, &l_step]);
    // Row-range weights (the sharded token embedding) are served as just their rows.
    let ck_rows = petite_portable::row_source(&[&progs.prefix, &progs.step], &ck)?;
    petite_portable::check_weights(&table, &ck_rows)?;
    check_writable(&opts.out)?;
    let identity = format!("{}|{:?}", source_key(ck_files)?, opts.precision);
    rec.end(st, false);
    check_interrupt()?;

    // --- convert: every stored weight once, in the .pte's dtype and layout -----------------
    let st = rec.begin("convert");
    let mut h = Sha256::new();
    h.update(identity.as_bytes());
    h.update(b"|portable|");
    for w in &table {
        h.update(format!("{}|{:?}|", w.key, w.shape).as_bytes());
    }
    let key = hex(&h.finalize());
    let cache = opts.out.join("cache");
    let path = mapping_path(&cache, &key);
    let reuse = current_mapping(&path, &key, table.iter().map(|w| w.key.as_str()));
    let mapping_reused = reuse.is_some();
    let mapping = match reuse {
        Some(m) => m,
        None => {
            clear_stale_mappings(&cache, &path)?;
            let total: u64 = table.iter().map(|w| w.nbytes()).sum();
            let pb = bar(opts.progress, total, "convert");
            petite_portable::write_mapping(
                &table,
                &ck_rows,
                &path,
                &[("petite.mapping_key".to_string(), key.clone())],
                &mut |done, _| {
                    pb.set_position(done);
                },
            )?;
            pb.finish_and_clear();
            MappedSafetensors::open(&path)?
        }
    };
    let mapping_bytes = mapping.mapped_len() as u64;
    rec.end(st, mapping_reused);
    check_interrupt()?;

    // --- timestep table (reference executor, once) -----------------------------------------
    let st = rec.begin("timestep");
    let (steps_table, r) = timestep_values(progs, &ck, cfg)?;
    let mut b = petite_graph::Builder::new();
    let c = b.constant_f32(&[cfg.steps, r], &steps_table)?;
    b.output(io::TIMESTEP_TABLE, c)?;
    let l_table = petite_portable::lower(&b.finish()?)?;
    let p_table = petite_portable::plan(&l_table);
    rec.end(st, false);
    check_interrupt()?;

    // --- save: prefix.pte, step.pte (+ their method descriptions) ------------------------------
    let st = rec.begin("save");
    let save = SaveTargets::new(opts);
    let (pb, wopts) = (&save.pb, save.wopts);
    let (prefix_pte, step_pte) = (&save.prefix_pte, &save.step_pte);
    let constants = petite_portable::Constants::Mapping(&mapping);
    let (prefix_rep, prefix_sum) = petite_portable::write_program(
        &[petite_portable::MethodSpec {
            name: METHOD,
            lowered: &l_prefix,
            plan: &p_prefix,
        }],
        constants,
        prefix_pte,
        wopts,
    )?;
    pb.inc(1);
    let (step_rep, step_sum) = petite_portable::write_program(
        &[
            petite_portable::MethodSpec {
                name: METHOD,
                lowered: &l_step,
                plan: &p_step,
            },
            petite_portable::MethodSpec {
                name: TABLE_METHOD,
                lowered: &l_table,
                plan: &p_table,
            },
        ],
        constants,
        step_pte,
        wopts,
    )?;
    for (pte, reps) in [(prefix_pte, &prefix_rep), (step_pte, &step_rep)] {
        crate::report::write_json(&spec_path(pte), &json!({ "methods": reps }))?;
    }
    pb.finish_and_clear();
    rec.end(st, false);
    drop(mapping);

    // --- report ------------------------------------------------------------------------------
    let stages = rec.stages();
    let total = rec.elapsed();
    let weight_bytes: u64 = table.iter().map(|w| w.nbytes()).sum();
    let pte_bytes = prefix_sum.file_len + step_sum.file_len;
    let mapping_written = if mapping_reused { 0 } else { mapping_bytes };
    let in_kernel = prefix_sum.bytes_copied_in_kernel + step_sum.bytes_copied_in_kernel;
    let table_text = crate::report::table(&stages, total);
    let program_json =
        |pte: &Path, sum: &petite_pte::WriteSummary, reps: &[petite_portable::ExportReport]| {
            json!({"pte": pte.display().to_string(), "bytes": sum.file_len,
               "bytes_copied_in_kernel": sum.bytes_copied_in_kernel,
               "methods": reps})
        };
    let report = report_json(
        opts,
        checkpoint_desc,
        json!({
            "memory_budget": opts.memory_budget,
            "memory_estimate": need,
            "mapping": {
                "path": path.display().to_string(),
                "reused": mapping_reused,
                "bytes": mapping_bytes,
                "tensors": table.len(),
            },
            "programs": {
                "prefix": program_json(prefix_pte, &prefix_sum, &prefix_rep),
                "step": program_json(step_pte, &step_sum, &step_rep),
                "timestep_table": [cfg.steps, r],
            },
            "stages": stages,
            "totals": {
                "seconds": total,
                "weight_bytes": weight_bytes,
                "weight_bytes_copied_in_kernel": in_kernel,
                "bytes_written_files": mapping_written + pte_bytes,
                "bytes_written_storage": stages.iter().map(|s| s.bytes_written).sum::<u64>(),
                "bytes_read_storage": stages.iter().map(|s| s.bytes_read).sum::<u64>(),
                "written_per_weight_byte_mapping_plus_pte":
                    (mapping_written + pte_bytes) as f64 / weight_bytes.max(1) as f64,
                "written_per_weight_byte_pte": pte_bytes as f64 / weight_bytes.max(1) as f64,
                "peak_rss": stages.iter().map(|s| s.peak_rss).max(),
                "peak_anon": stages.iter().map(|s| s.peak_anon).max(),
            },
        }),
    );
    save.finish(opts, report, table_text, 0, 0)
}
