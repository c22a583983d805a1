//! petite-engine: builds each engine of a partition plan from memory-mapped weights straight to a
//! file on disk, one or a few engines at a time, and gives each weight's pages back once the last
//! engine that reads it is built. Knows nothing of the `.pte` layout or of pi0.5.
//!
//! - [`EngineBuilder`]: the seam. Builds one planned engine into a file under an engine
//!   directory and returns what a `.pte` writer needs ([`BuiltEngine`]: backend id, I/O
//!   bindings, and the delegate payload as a [`FileRegion`], never a `Vec` of the engine).
//! - [`EngineRuntime`]: runs a built engine, for backends that can run on this machine, on
//!   [`HostTensor`]s (dtype, shape, bytes: no executor's own type).
//! - [`reference`](mod@reference): the engine file is a safetensors file (the subgraph as JSON in
//!   `__metadata__`, its weights in the declared dtype, page-aligned), executed by
//!   petite-reference with its weights mapped from the file.
//! - [`tensorrt`]: one ONNX model per engine ([`onnx`]; weights as external data pointing into
//!   the mapping file), built by `trtexec` in a child process, wrapped as the `TensorRTBackend`
//!   `TR01` delegate blob ([`tensorrt::blob`]).
//! - [`build_plan`]: the driver (engines started in plan order, up to `jobs` at once; release
//!   after last use and reports in plan order; per-engine time, size and peak memory).
#![deny(missing_docs)]

mod build;
pub mod gpu;
mod host;
pub mod onnx;
pub mod reference;
pub mod settings;
mod sys;
pub mod tensorrt;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use build::{
    BuildOptions, BuildReport, DamagedNotice, EngineNamer, EngineReport, RssFigures, build_plan,
    engine_name, last_uses, release_weights,
};
pub use host::HostTensor;
pub use petite_graph::Dtype;
use petite_graph::{Program, ValueId};
use petite_weights::WeightSource;
use serde::{Deserialize, Serialize};

/// Errors of this crate. Every error raised while building an engine is wrapped in
/// [`Error::Engine`], which names the engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Building or running one engine failed; names the engine, the cause follows.
    #[error("{engine}: {source}")]
    Engine {
        /// `engine <index> (<name>)`.
        engine: String,
        /// What went wrong.
        #[source]
        source: Box<Error>,
    },
    /// A weight the engine reads is missing from the source or has another shape, or a dtype
    /// the backend cannot convert.
    #[error("weight `{tensor}`: expected {expected}, found {found}")]
    Weight {
        /// Checkpoint tensor name.
        tensor: String,
        /// What the engine's program declares.
        expected: String,
        /// What the source holds.
        found: String,
    },
    /// An I/O operation failed.
    #[error("{path}: {op}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// An engine file is not what this backend writes.
    #[error("{path}: not a valid {backend} engine file: {reason}")]
    InvalidEngineFile {
        /// The file.
        path: String,
        /// The backend whose format was expected.
        backend: &'static str,
        /// Expected vs found.
        reason: String,
    },
    /// A graph op (or a form of it) the backend cannot express.
    #[error("{node}: {reason}")]
    Unsupported {
        /// The node (id, op, label).
        node: petite_graph::NodeDesc,
        /// Why.
        reason: String,
    },
    /// A setting or call order the backend cannot honour (says what to do instead).
    #[error("{0}")]
    Usage(String),
    /// A runtime failed running an engine (its own error kept as the source, so a caller can
    /// look into it: a weight that changed under a GPU upload, say).
    #[error("{runtime}: {source}")]
    Runtime {
        /// The runtime (and what it was doing).
        runtime: String,
        /// The runtime's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// [`BuildOptions::stop`] asked to stop before engine `index`; the engines before it are
    /// finished on disk.
    #[error("stopped before engine {index}")]
    Stopped {
        /// The first engine not built.
        index: usize,
    },
    /// The TensorRT backend failed (its own errors: [`tensorrt::TensorRtError`]).
    #[error(transparent)]
    TensorRt(#[from] tensorrt::TensorRtError),
    /// The plan does not fit the program.
    #[error(transparent)]
    Partition(#[from] petite_partition::Error),
    /// The engine's program is invalid.
    #[error(transparent)]
    Graph(#[from] petite_graph::Error),
    /// Reading or writing weights failed (names the file and tensor).
    #[error(transparent)]
    Weights(#[from] petite_weights::Error),
    /// The reference executor failed (names the node).
    #[error(transparent)]
    Reference(#[from] petite_reference::Error),
}

impl From<petite_fs::Error> for Error {
    fn from(e: petite_fs::Error) -> Self {
        let petite_fs::Error::Io { path, op, source } = e;
        Error::io(&path, op, source)
    }
}

impl Error {
    pub(crate) fn io(path: &Path, op: &'static str, source: std::io::Error) -> Self {
        Error::Io {
            path: path.display().to_string(),
            op,
            source,
        }
    }

    /// Wraps `self` with the engine's name (once: an already wrapped error is kept).
    pub(crate) fn in_engine(self, index: usize, name: &str) -> Self {
        match self {
            e @ Error::Engine { .. } => e,
            other => Error::Engine {
                engine: format!("engine {index} ({name})"),
                source: Box::new(other),
            },
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One input or output of a built engine, in call order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoBinding {
    /// Binding name (the engine program's input/output name).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Static shape.
    pub shape: Vec<usize>,
    /// True for an input.
    pub is_input: bool,
}

/// A byte range of a file: how a delegate payload is handed to the `.pte` writer, which streams
/// it from disk instead of holding it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRegion {
    /// The file.
    pub path: PathBuf,
    /// First byte.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// One compile spec of a delegate: a key and raw value bytes, passed verbatim to the runtime
/// backend's `init()` (ExecuTorch's `CompileSpec`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompileSpec {
    /// Key, e.g. `weight_streaming_budget`.
    pub key: String,
    /// Value bytes, in the encoding the backend parses.
    pub value: Vec<u8>,
}

/// What building one engine produced: everything a `.pte` writer needs, and the file it is in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BuiltEngine {
    /// Position in build (and run) order.
    pub index: usize,
    /// Engine name, unique within a build (`engine_<index>`).
    pub name: String,
    /// Backend id as the runtime registers it (`PetiteReference`, `TensorRTBackend`).
    pub backend_id: String,
    /// The engine file (for the reference backend: the payload itself; for TensorRT: the blob).
    pub file: PathBuf,
    /// Its size in bytes.
    pub file_bytes: u64,
    /// Inputs, in call order.
    pub inputs: Vec<IoBinding>,
    /// Outputs, in return order.
    pub outputs: Vec<IoBinding>,
    /// The delegate payload's bytes.
    pub payload: FileRegion,
    /// For each input, the value of the partitioned program it stands for.
    pub input_values: Vec<ValueId>,
    /// For each output, the value of the partitioned program it returns.
    pub output_values: Vec<ValueId>,
    /// What building it cost (absent for an engine reused from an earlier run, or a builder
    /// that runs in-process).
    #[serde(default)]
    pub stats: Option<BuildStats>,
    /// The delegate's compile specs (empty for most backends; TensorRT's weight-streaming
    /// budget). Not part of the engine file: a reused engine gets the current run's.
    #[serde(default)]
    pub compile_specs: Vec<CompileSpec>,
}

/// The tool that builds a backend's engines: recorded in `report.json` and part of every
/// engine's reuse key, so that an engine built by another tool (or another TensorRT) is rebuilt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuilderInfo {
    /// Tool name (`petite-reference`, `tensorrt-rtx`, `trtexec`).
    pub name: String,
    /// Its version (`1.7.1.116`; trtexec: the TensorRT version it reports).
    pub version: String,
}

impl std::fmt::Display for BuilderInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.name, self.version)
    }
}

/// What one engine build cost, measured on the builder's own process.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BuildStats {
    /// Peak resident set of the builder process (`wait4`'s `ru_maxrss`), bytes.
    pub builder_peak_rss_bytes: u64,
    /// Wall-clock seconds of the build (child process start to exit).
    pub build_s: f64,
    /// Bytes of the engine the builder wrote (TensorRT: the serialized plan).
    pub plan_bytes: u64,
}

/// Weight bytes of one engine by stored dtype: what a builder's memory grows with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightBytes {
    /// bf16 and f16 weights.
    pub half: u64,
    /// f32 weights (and any other dtype, counted at its size).
    pub full: u64,
}

impl WeightBytes {
    /// Weight bytes of one planned engine, read from the whole program (no engine program is
    /// extracted): the weights among `engine.weights`, by declared dtype.
    pub fn of_engine(program: &Program, engine: &petite_partition::Engine) -> Self {
        let nodes: std::collections::BTreeSet<_> = engine.weights.iter().collect();
        let mut w = WeightBytes::default();
        for info in program.weights().iter().filter(|w| nodes.contains(&w.node)) {
            let b = info.bytes as u64;
            if info.dtype.size() == 2 {
                w.half += b;
            } else {
                w.full += b;
            }
        }
        w
    }

    /// All of them.
    pub fn total(&self) -> u64 {
        self.half + self.full
    }
}

/// Host memory one engine build needs beyond the calling process: `base` plus a multiple of the
/// engine's weight bytes per dtype class. The TensorRT figures are fitted to measured builder
/// peaks (`tensorrt::RTX_BUILD_MEMORY`); the reference builder streams, so only `base`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BuildMemory {
    /// Bytes needed whatever the engine (the tool itself).
    pub base: u64,
    /// Bytes per byte of 16-bit weights.
    pub per_half_byte: f64,
    /// Bytes per byte of 32-bit weights.
    pub per_full_byte: f64,
}

impl BuildMemory {
    /// Bytes needed to build an engine holding `w`.
    pub fn bytes(&self, w: WeightBytes) -> u64 {
        self.base
            + (w.half as f64 * self.per_half_byte).ceil() as u64
            + (w.full as f64 * self.per_full_byte).ceil() as u64
    }

    /// The largest engine cap (weight bytes per engine) whose every engine builds within
    /// `available` bytes whatever its dtype mix; `None` when the cost does not grow with the
    /// engine (any cap fits), `Some(0)` when not even the tool fits.
    pub fn cap_for(&self, available: u64) -> Option<u64> {
        let per = self.per_half_byte.max(self.per_full_byte);
        if per <= 0.0 {
            return None;
        }
        Some((available.saturating_sub(self.base) as f64 / per) as u64)
    }

    /// How many builds of `engines` can run at once within `available` bytes: the largest `n`
    /// whose `n` costliest builds fit together (whichever engines end up running at once, their
    /// sum is at most that). 0 when not even the costliest fits alone; `engines.len()` (at least
    /// 1) when all fit together.
    pub fn builders_within(&self, available: u64, engines: &[WeightBytes]) -> usize {
        let mut needs: Vec<u64> = engines.iter().map(|&w| self.bytes(w)).collect();
        needs.sort_unstable_by(|a, b| b.cmp(a));
        let mut sum = 0u64;
        let fit = needs
            .iter()
            .take_while(|&&need| {
                sum = sum.saturating_add(need);
                sum <= available
            })
            .count();
        if engines.is_empty() { 1 } else { fit }
    }
}

/// One engine to build: its standalone program (from `Plan::engine_program`) and its place.
#[derive(Debug, Clone, Copy)]
pub struct EngineJob<'a> {
    /// Position in the plan.
    pub index: usize,
    /// Engine name (file stem).
    pub name: &'a str,
    /// The engine's program: inputs, weights by name, outputs.
    pub program: &'a Program,
    /// For each graph input of `program`, the original value.
    pub input_values: &'a [ValueId],
    /// For each graph output of `program`, the original value.
    pub output_values: &'a [ValueId],
}

impl<'a> EngineJob<'a> {
    /// The job of engine `index` of a plan, named `name`: its subgraph as
    /// `Plan::engine_program` cut it.
    pub fn of(index: usize, name: &'a str, sub: &'a petite_partition::EngineProgram) -> Self {
        EngineJob {
            index,
            name,
            program: &sub.program,
            input_values: &sub.input_values,
            output_values: &sub.output_values,
        }
    }
}

/// The seam between planning and a backend: builds one engine from mapped weights into a file
/// under `dir`. Implementations stream weights (memory O(chunk), not O(engine)), write under a
/// temporary name, seal the finished file ([`petite_weights::seal::write_for`], which
/// [`reuse_engine`] checks) and rename, and remove partial files on error.
///
/// Everything an orchestrator needs to know about a backend is asked here (which weights it
/// reads from the mapping file and in which dtype, what a build costs in memory, which
/// settings key a reusable engine file, the file names, recognising a finished file), so a new
/// backend is one implementation of this trait and one registration line in the exporter.
/// `Sync`: [`build_plan`] runs several builds of one builder at once ([`BuildOptions::jobs`]).
pub trait EngineBuilder: Sync {
    /// Backend id written into the `.pte` delegate.
    fn backend_id(&self) -> &str;
    /// The tool that builds (recorded in reports; part of [`EngineBuilder::settings`]).
    fn info(&self) -> BuilderInfo;
    /// Everything about this builder that changes an engine file's bytes: part of every
    /// engine's reuse key.
    fn settings(&self) -> String;
    /// File name of engine `name` in the engine directory.
    fn file_name(&self, name: &str) -> String;
    /// Host memory one build needs beyond the calling process.
    fn memory(&self) -> BuildMemory;
    /// The dtype in which a weight the programs declare `declared` is in this backend's
    /// mapping file, or `None` when this backend reads it from the checkpoint (converting as it
    /// goes). The mapping file's seal is the weights' fingerprint in the export id, written or
    /// not ([`EngineBuilder::needs_mapping_file`]).
    fn mapping_dtype(&self, declared: Dtype) -> Option<Dtype>;
    /// Whether builds read the mapping file (TensorRT's engines point into it). `false`: the
    /// builder streams every weight from the checkpoint, and the file is never written.
    fn needs_mapping_file(&self) -> bool {
        true
    }
    /// Whether a build quantizes a code weight from the checkpoint's float rows itself, with its
    /// scales (a whole weight's: `W` and `W.qscale` in one engine). `false`: quantized weights
    /// come from a mapping file the export writes first.
    fn quantizes_in_build(&self) -> bool {
        false
    }
    /// The builder's way of writing an engine straight into a region of another file (a
    /// `.pte` segment), when an engine's size is known before any weight is read; `None`
    /// (the default): engines are files of their own.
    fn in_place(&self) -> Option<&dyn InPlaceBuilder> {
        None
    }
    /// Hands the builder the mapping file (after conversion, before the first build); builders
    /// whose engines point into it (TensorRT's ONNX external data) read its header here.
    fn attach_mapping(&self, mapping: &Path) -> Result<()> {
        let _ = mapping;
        Ok(())
    }
    /// A finished engine file from an earlier run, if `path` is one this builder wrote for
    /// `job` (the file name already carries the hash of subgraph, weights and settings; this
    /// checks that the file is whole).
    fn reuse(&self, path: &Path, job: &EngineJob<'_>) -> Option<BuiltEngine>;
    /// Builds `job` into a file under `dir`.
    fn build(
        &self,
        job: &EngineJob<'_>,
        weights: &dyn WeightSource,
        dir: &Path,
    ) -> Result<BuiltEngine>;
    /// Refuses, before any work, a plan of `program` this builder's settings cannot serve (a
    /// TensorRT weight-streaming budget below one layer's weights). The default accepts all.
    fn check_plan(&self, program: &Program, plan: &petite_partition::Plan) -> Result<()> {
        let _ = (program, plan);
        Ok(())
    }
    /// The CUDA device (index) this backend's engines run on, `None` for the host CPU. An
    /// exporter plans such delegates' inputs and outputs in that device's memory, as ExecuTorch
    /// plans a device-tagged delegate (see petite's `--placement`). The default is the host.
    fn device(&self) -> Option<u8> {
        None
    }
}

/// Engines written into a region of a file someone else owns ([`EngineBuilder::in_place`]):
/// each engine's bytes are written once, at their final place.
pub trait InPlaceBuilder {
    /// The size of `job`'s engine, from its subgraph and its weights' table (no weight read).
    fn engine_len(&self, job: &EngineJob<'_>, weights: &dyn WeightSource) -> Result<u64>;
    /// Writes `job`'s engine, streamed from `weights`, into `[offset, offset + len)` of `file`
    /// (at `path`, named in errors), where `len` is [`InPlaceBuilder::engine_len`]; returns
    /// `len`. Durability is the file owner's.
    fn write_engine(
        &self,
        job: &EngineJob<'_>,
        weights: &dyn WeightSource,
        file: &std::fs::File,
        path: &Path,
        offset: u64,
    ) -> Result<u64>;
}

/// What an earlier run left at an engine's path ([`reuse_engine`]).
#[derive(Debug)]
pub enum Reuse {
    /// No file there: build it.
    Absent,
    /// A whole engine file for the job: use it.
    Reused(Box<BuiltEngine>),
    /// A file that must not be trusted (says why: truncated, wrong size, checksum, not this
    /// backend's format): rebuild it.
    Damaged(String),
}

/// Whether the file at `path` is a finished engine for `job` that can be reused: its seal
/// (length and checksum recorded when the builder wrote it, [`petite_weights::seal`]) must
/// match, then the backend's own [`EngineBuilder::reuse`] check. Builders seal every engine
/// file before giving it its final name; a file without a seal is damaged.
pub fn reuse_engine(builder: &dyn EngineBuilder, path: &Path, job: &EngineJob<'_>) -> Reuse {
    if std::fs::symlink_metadata(path).is_err() {
        return Reuse::Absent;
    }
    if let Err(why) = petite_weights::seal::check(path) {
        return Reuse::Damaged(why);
    }
    match builder.reuse(path, job) {
        Some(e) => Reuse::Reused(Box::new(e)),
        None => Reuse::Damaged(format!(
            "not a {} engine file for this subgraph",
            builder.backend_id()
        )),
    }
}

/// Runs a built engine (for backends that can run on this machine), on [`HostTensor`]s: the
/// seam belongs to no executor, each runtime converts at its edge.
pub trait EngineRuntime {
    /// The engine's input bindings.
    fn inputs(&self) -> &[IoBinding];
    /// The engine's output bindings.
    fn outputs(&self) -> &[IoBinding];
    /// Runs once: `inputs` holds exactly the input bindings by name; returns every output by
    /// name.
    fn run(&self, inputs: BTreeMap<String, HostTensor>) -> Result<BTreeMap<String, HostTensor>>;
}

/// A [`BuiltEngine`] for `job` whose payload is the whole of `file` (what reuse checks return).
pub fn whole_file_engine(
    job: &EngineJob<'_>,
    backend_id: &str,
    file: &Path,
    file_bytes: u64,
    stats: Option<BuildStats>,
) -> BuiltEngine {
    let (inputs, outputs) = bindings(job.program);
    BuiltEngine {
        index: job.index,
        name: job.name.to_string(),
        backend_id: backend_id.to_string(),
        file: file.to_path_buf(),
        file_bytes,
        inputs,
        outputs,
        payload: FileRegion {
            path: file.to_path_buf(),
            offset: 0,
            len: file_bytes,
        },
        input_values: job.input_values.to_vec(),
        output_values: job.output_values.to_vec(),
        stats,
        compile_specs: Vec::new(),
    }
}

/// The I/O bindings of a program: its inputs then its outputs.
pub fn bindings(program: &Program) -> (Vec<IoBinding>, Vec<IoBinding>) {
    let mut ins = Vec::with_capacity(program.inputs.len());
    for &id in &program.inputs {
        let n = program.node(id);
        if let Some(t) = n.tensor() {
            ins.push(IoBinding {
                name: program.input_name(id).unwrap_or_default().to_string(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                is_input: true,
            });
        }
    }
    let mut outs = Vec::with_capacity(program.outputs.len());
    for o in &program.outputs {
        if let Some(t) = program.node(o.value).tensor() {
            outs.push(IoBinding {
                name: o.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                is_input: false,
            });
        }
    }
    (ins, outs)
}

/// Runs built engines in order, passing values between them by their original value ids, the
/// way the `.pte` program will: `inputs` are the partitioned program's inputs (by value id);
/// returns every engine output by value id. `open` makes a runtime for each engine.
pub fn run_engines<R: EngineRuntime>(
    engines: &[BuiltEngine],
    open: impl Fn(&BuiltEngine) -> Result<R>,
    mut values: BTreeMap<ValueId, HostTensor>,
) -> Result<BTreeMap<ValueId, HostTensor>> {
    for e in engines {
        let rt = open(e).map_err(|err| err.in_engine(e.index, &e.name))?;
        let mut ins = BTreeMap::new();
        for (b, v) in e.inputs.iter().zip(&e.input_values) {
            let t = values.get(v).cloned().ok_or_else(|| {
                Error::Reference(petite_reference::Error::Input {
                    name: b.name.clone(),
                    message: format!("value {v} was not produced by an earlier engine"),
                })
                .in_engine(e.index, &e.name)
            })?;
            ins.insert(b.name.clone(), t);
        }
        let mut outs = rt.run(ins).map_err(|err| err.in_engine(e.index, &e.name))?;
        for (b, v) in e.outputs.iter().zip(&e.output_values) {
            if let Some(t) = outs.remove(&b.name) {
                values.insert(*v, t);
            }
        }
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// The n costliest builds must fit together: the model's base counts once per builder, and
    /// the dtype mix sets each engine's cost.
    #[test]
    fn builders_within_counts_the_costliest_engines_together() {
        let m = tensorrt::RTX_BUILD_MEMORY;
        let half = |mib: u64| WeightBytes {
            half: mib * MIB,
            full: 0,
        };
        // 128 MiB of bf16 weights: 336 + 3.15 * 128 = 739.2 MiB a build.
        let one = m.bytes(half(128));
        assert_eq!(one, 336 * MIB + (128.0 * 3.15 * MIB as f64).ceil() as u64);
        let engines = [half(128), half(64), half(128), half(32)];
        assert_eq!(m.builders_within(one - 1, &engines), 0);
        assert_eq!(m.builders_within(one, &engines), 1);
        assert_eq!(m.builders_within(2 * one - 1, &engines), 1);
        assert_eq!(m.builders_within(2 * one, &engines), 2);
        // The third costliest is the 64 MiB engine.
        let third = m.bytes(half(64));
        assert_eq!(m.builders_within(2 * one + third, &engines), 3);
        assert_eq!(m.builders_within(u64::MAX, &engines), 4);
        // f32 weights cost less per byte than bf16 ones under this model.
        let full = WeightBytes {
            half: 0,
            full: 128 * MIB,
        };
        assert_eq!(m.builders_within(one + m.bytes(full), &[full, full]), 2);
        assert_eq!(m.builders_within(0, &[]), 1);
    }
}
