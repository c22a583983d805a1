//! petite-weights: memory-mapped safetensors checkpoints, streamed f32 → bf16 conversion and
//! page residency control. Knows nothing of graphs, engines or pi0.5.
#![deny(missing_docs)]

mod source;

pub use source::{Dtype, TensorInfo, TensorView, WeightSource};

/// Errors of this crate; each names the file and, where relevant, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor the caller asked for is not in the source.
    #[error("{file}: no tensor named `{name}`")]
    MissingTensor {
        /// The file (or index) searched.
        file: String,
        /// The tensor name.
        name: String,
    },
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
