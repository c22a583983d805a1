//! petite-engine: builds each engine of a partition plan from memory-mapped weights straight to a
//! file on disk, one engine at a time, and gives each weight's pages back once the last engine
//! that reads it is built. Knows nothing of the `.pte` layout or of pi0.5.
//!
//! - [`EngineBuilder`]: the seam. Builds one planned engine into a file under an engine
//!   directory and returns what a `.pte` writer needs ([`BuiltEngine`]: backend id, I/O
//!   bindings, and the delegate payload as a [`FileRegion`], never a `Vec` of the engine).
//! - [`EngineRuntime`]: runs a built engine, for backends that can run on this machine.
//! - [`reference`]: the engine file is a safetensors file (the subgraph as JSON in
//!   `__metadata__`, its weights in the declared dtype, page-aligned), executed by
//!   petite-reference with its weights mapped from the file.
//! - [`tensorrt`]: one ONNX model per engine ([`onnx`]; weights as external data pointing into
//!   the mapping file), built by `trtexec` in a child process, wrapped as the `TensorRTBackend`
//!   `TR01` delegate blob ([`tensorrt::blob`]).
//! - [`build_plan`]: the sequential driver (plan order, release after last use, per-engine time,
//!   size and peak memory).
#![deny(missing_docs)]

mod build;
pub mod onnx;
pub mod reference;
mod sys;
pub mod tensorrt;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use build::{
    BuildOptions, BuildReport, EngineReport, RssFigures, build_plan, engine_name, last_uses,
    release_weights,
};
pub use petite_graph::Dtype;
use petite_graph::{Program, ValueId};
use petite_reference::Tensor;
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
    /// TensorRT (its `trtexec`) is not available on this machine.
    #[error("TensorRT is not available: {what}. {hint}")]
    TensorRtMissing {
        /// What was looked for and not found.
        what: String,
        /// How to point petite at it.
        hint: String,
    },
    /// The TensorRT build ran and failed (non-zero exit, killed, or no plan written).
    #[error("TensorRT build failed ({status}); last output:\n{log_tail}")]
    TensorRtBuild {
        /// Exit status or signal.
        status: String,
        /// The end of trtexec's output.
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

/// What building one engine produced: everything a `.pte` writer needs, and the file it is in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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

/// The seam between planning and a backend: builds one engine from mapped weights into a file
/// under `dir`. Implementations stream weights (memory O(chunk), not O(engine)), write under a
/// temporary name and rename, and remove partial files on error.
pub trait EngineBuilder {
    /// Backend id written into the `.pte` delegate.
    fn backend_id(&self) -> &str;
    /// Builds `job` into a file under `dir`.
    fn build(
        &self,
        job: &EngineJob<'_>,
        weights: &dyn WeightSource,
        dir: &Path,
    ) -> Result<BuiltEngine>;
}

/// Runs a built engine (for backends that can run on this machine).
pub trait EngineRuntime {
    /// The engine's bindings.
    fn inputs(&self) -> &[IoBinding];
    /// The engine's output bindings.
    fn outputs(&self) -> &[IoBinding];
    /// Runs once: `inputs` holds exactly the input bindings by name; returns every output by
    /// name.
    fn run(&self, inputs: BTreeMap<String, Tensor>) -> Result<BTreeMap<String, Tensor>>;
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
    mut values: BTreeMap<ValueId, Tensor>,
) -> Result<BTreeMap<ValueId, Tensor>> {
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
