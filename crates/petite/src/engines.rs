//! Everything the export knows about petite-engine, in one place (its API is young): which
//! backends exist, what building one engine costs in memory, the settings that key a reusable
//! engine file, building one engine, and recognising a finished engine file from an earlier run.

use std::path::{Path, PathBuf};

use petite_engine::reference::{self, ReferenceBuilder, ReferenceEngine};
use petite_engine::{BuiltEngine, EngineBuilder, EngineJob, FileRegion};
use petite_weights::WeightSource;

use crate::{Error, Result};

/// An engine backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// petite's CPU reference engines (runs here; what the tests and verify use).
    Reference,
    /// TensorRT engines (ONNX + `trtexec` in a child process); needs TensorRT on this machine.
    TensorRt,
    /// No engines: every op as an ExecuTorch portable kernel call (petite-portable), runnable by
    /// any ExecuTorch runtime on any CPU. The export takes its own path ([`crate::export`]).
    Portable,
}

impl std::str::FromStr for Backend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "reference" => Ok(Backend::Reference),
            "tensorrt" => Ok(Backend::TensorRt),
            "portable" => Ok(Backend::Portable),
            other => Err(format!(
                "expected `reference` or `tensorrt` (engines), or `portable`, found `{other}`"
            )),
        }
    }
}

impl Backend {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Reference => "reference",
            Backend::TensorRt => "tensorrt",
            Backend::Portable => "portable",
        }
    }

    /// Bytes of host memory building one engine reading `weight_bytes` of weights needs, beyond
    /// the process's own base. Reference: the builder streams weights in 4 MiB chunks, so its cost
    /// does not grow with the engine (plus the engine's program JSON, well under 8 MiB).
    /// TensorRT: the builder holds the network's weights several times over
    /// ([`petite_partition::TORCH_TRT_BUILD_MULTIPLIER`]).
    pub fn build_bytes(self, weight_bytes: u64) -> u64 {
        match self {
            Backend::Reference => 16 << 20,
            // Converting/transposing one weight at a time in 8 MiB chunks (source block,
            // gathered copy, converted copy), whatever the weight's size.
            Backend::Portable => 32 << 20,
            Backend::TensorRt => {
                weight_bytes.saturating_mul(petite_partition::TORCH_TRT_BUILD_MULTIPLIER)
            }
        }
    }

    /// The largest engine cap whose engines build within `available` bytes, if the backend's
    /// cost grows with the engine (`None`: any cap fits).
    pub fn cap_for(self, available: u64) -> Option<u64> {
        match self {
            Backend::Reference | Backend::Portable => None,
            Backend::TensorRt => Some(available / petite_partition::TORCH_TRT_BUILD_MULTIPLIER),
        }
    }

    /// Everything about the backend that changes an engine file's bytes (part of the reuse key).
    pub fn settings(self) -> String {
        match self {
            Backend::Reference => format!("{}|{}", reference::BACKEND_ID, reference::FORMAT),
            Backend::TensorRt => format!("{}|TR01", petite_engine::tensorrt::BACKEND_ID),
            Backend::Portable => "portable".to_string(),
        }
    }

    /// File name of engine `name` in the engines directory.
    pub fn file_name(self, name: &str) -> String {
        match self {
            Backend::Reference => format!("{name}{}", reference::SUFFIX),
            Backend::TensorRt => format!("{name}.tr01"),
            Backend::Portable => format!("{name}.portable"),
        }
    }

    /// Checks, before any work, that the backend can build here (TensorRT: `trtexec` found via
    /// `$PETITE_TRTEXEC` or `PATH`).
    pub fn check_available(self) -> Result<()> {
        match self {
            Backend::Reference | Backend::Portable => Ok(()),
            Backend::TensorRt => {
                petite_engine::tensorrt::find_trtexec()?;
                Ok(())
            }
        }
    }

    /// Whether engines read every weight from the mapping file (TensorRT's ONNX models point
    /// into it) rather than only the bf16-declared ones.
    pub fn needs_full_mapping(self) -> bool {
        self == Backend::TensorRt
    }

    /// The builder of this backend; TensorRT needs the mapping file its ONNX models point into.
    pub fn builder(self, mapping: Option<&Path>) -> Result<Box<dyn EngineBuilder>> {
        match self {
            Backend::Reference => Ok(Box::new(ReferenceBuilder::default())),
            Backend::TensorRt => {
                let m = mapping.ok_or_else(|| {
                    Error::Usage(
                        "--backend tensorrt needs a mapping file (use --dtype bf16)".into(),
                    )
                })?;
                Ok(Box::new(petite_engine::tensorrt::TensorRtBuilder::new(m)?))
            }
            Backend::Portable => Err(Error::Usage(
                "the portable backend builds no engines".into(),
            )),
        }
    }
}

/// Builds one engine.
pub fn build(
    builder: &dyn EngineBuilder,
    job: &EngineJob<'_>,
    weights: &dyn WeightSource,
    dir: &Path,
) -> Result<BuiltEngine> {
    Ok(builder.build(job, weights, dir)?)
}

/// A finished engine file from an earlier run, if `path` is one this backend wrote for `job`
/// (opens and checks it: format, subgraph equal to the job's, every weight present).
pub fn reuse(backend: Backend, path: &Path, job: &EngineJob<'_>) -> Option<BuiltEngine> {
    match backend {
        Backend::Reference => {
            let e = ReferenceEngine::open(path).ok()?;
            if e.program() != job.program {
                return None;
            }
            let file_bytes = std::fs::metadata(path).ok()?.len();
            let (inputs, outputs) = petite_engine::bindings(job.program);
            Some(BuiltEngine {
                index: job.index,
                name: job.name.to_string(),
                backend_id: reference::BACKEND_ID.to_string(),
                file: path.to_path_buf(),
                file_bytes,
                inputs,
                outputs,
                payload: FileRegion {
                    path: path.to_path_buf(),
                    offset: 0,
                    len: file_bytes,
                },
                input_values: job.input_values.to_vec(),
                output_values: job.output_values.to_vec(),
            })
        }
        Backend::TensorRt => {
            // The name carries the hash of subgraph + weights + settings; the blob must parse.
            let (h, _) = petite_engine::tensorrt::blob::read(path).ok()?;
            let (inputs, outputs) = petite_engine::bindings(job.program);
            Some(BuiltEngine {
                index: job.index,
                name: job.name.to_string(),
                backend_id: petite_engine::tensorrt::BACKEND_ID.to_string(),
                file: path.to_path_buf(),
                file_bytes: h.total_len,
                inputs,
                outputs,
                payload: FileRegion {
                    path: path.to_path_buf(),
                    offset: 0,
                    len: h.total_len,
                },
                input_values: job.input_values.to_vec(),
                output_values: job.output_values.to_vec(),
            })
        }
        Backend::Portable => None,
    }
}

/// Where an engine's payload is: `(file, offset, len)`.
pub fn payload(e: &BuiltEngine) -> (PathBuf, u64, u64) {
    (e.payload.path.clone(), e.payload.offset, e.payload.len)
}

/// The reference engine format: `__metadata__` keys of an engine file.
pub fn reference_meta_keys() -> (&'static str, &'static str, &'static str) {
    (
        reference::META_FORMAT,
        reference::FORMAT,
        reference::META_PROGRAM,
    )
}

/// Backend id of reference engines.
pub const REFERENCE_ID: &str = reference::BACKEND_ID;

/// For each engine of `plan`, the weights (whole tensors and row ranges) whose last reader it is.
pub fn last_uses(plan: &petite_partition::Plan) -> Vec<Vec<&petite_partition::WeightUse>> {
    petite_engine::last_uses(plan)
}

/// Releases the pages of `uses` (a row range releases only its rows' bytes).
pub fn release_weights(
    source: &dyn WeightSource,
    uses: &[&petite_partition::WeightUse],
) -> Result<()> {
    Ok(petite_engine::release_weights(source, uses)?)
}
