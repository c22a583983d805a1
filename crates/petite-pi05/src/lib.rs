//! petite-pi05: pi0.5 only — its config (real and small), the checkpoint tensor names of both
//! layouts, and the programs (prefix, step, timestep table) built as petite-graph graphs.
//! Nothing here reads weight bytes: programs hold names and shapes.
#![deny(missing_docs)]

pub mod config;
pub mod inputs;
pub mod lerobot;
pub mod names;
pub mod policy;
pub mod programs;
pub mod quant;
pub mod rtc;
pub mod run;
pub mod synth;

pub use config::{ExpertConfig, LanguageConfig, Pi05Config, VisionConfig};
pub use programs::{
    DEFAULT_EMBEDDING_SHARD_BYTES, Precision, PrefixOptions, Programs, build_all, build_policy,
    build_prefix, build_prefix_with, build_step, build_timestep_table,
};

/// Errors of this crate; each names the file, field or tensor and what was expected.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Config text is not JSON.
    #[error("{origin}: not valid JSON: {message}")]
    ConfigJson {
        /// Where the text came from.
        origin: String,
        /// serde_json's message (with line and column).
        message: String,
    },
    /// A config field read from a file is missing, mistyped, unknown or inconsistent.
    #[error("{origin}: config field `{field}`: expected {expected}, found {found}")]
    ConfigField {
        /// Where the config came from.
        origin: String,
        /// Dotted field path, e.g. `expert.heads`.
        field: String,
        /// What the field should be.
        expected: String,
        /// What it is.
        found: String,
    },
    /// A config (built in code) is inconsistent.
    #[error("invalid config: field `{field}`: expected {expected}, found {found}")]
    InvalidConfig {
        /// Dotted field path.
        field: String,
        /// What the field should be.
        expected: String,
        /// What it is.
        found: String,
    },
    /// An input or checkpoint tensor is missing or has the wrong dtype, shape or values.
    #[error("{file}: tensor `{tensor}`: expected {expected}, found {found}")]
    BadTensor {
        /// The file.
        file: String,
        /// The tensor.
        tensor: String,
        /// What it should be.
        expected: String,
        /// What it is.
        found: String,
    },
    /// Reading or writing weights/tensors failed (the error names the file and tensor).
    #[error(transparent)]
    Weights(#[from] petite_weights::Error),
    /// The reference executor failed (its error names the node or input).
    #[error("reference executor: {0}")]
    Reference(#[from] petite_reference::Error),
    /// An input petite does not export, with the reason (a PEFT adapter, a pi0 checkpoint, a
    /// config that disagrees with the weights, ...).
    #[error("{file}: {reason}")]
    Refused {
        /// The file or folder.
        file: String,
        /// Why, and what to do.
        reason: String,
    },
    /// Something that should not happen did (a bug), or an output-path conflict.
    #[error("{0}")]
    Internal(String),
    /// A real-time-chunking request is not one the policy can take.
    #[error("rtc: `{field}`: expected {expected}, found {found}")]
    Rtc {
        /// The field (`prev_chunk_left_over`, `max_guidance_weight`, …).
        field: String,
        /// What it should be.
        expected: String,
        /// What it is.
        found: String,
    },
    /// A program asked for a tensor the config's checkpoint does not have (a builder bug).
    #[error("no checkpoint tensor named `{0}` for this config")]
    UnknownWeight(String),
    /// petite-graph rejected a node (its error names the node, op and label).
    #[error("building a program: {0}")]
    Graph(#[from] petite_graph::Error),
    /// `--quantize-skip` names no weight the rule quantizes (a typo would keep everything).
    #[error("--quantize-skip `{0}` matches no weight that --weights quantizes")]
    QuantizeSkip(String),
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
