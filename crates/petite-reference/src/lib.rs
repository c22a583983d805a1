//! petite-reference: a CPU executor for petite-graph programs.
//!
//! f32 math (bf16 values are widened, computed in f32 and rounded back to nearest-even), weights
//! read through a [`petite_weights::WeightSource`] and converted per use, GEMMs through the `gemm`
//! crate with rayon. Every node's result depends only on its inputs (fixed reduction orders, no
//! cross-node fusion), so running a program split into parts equals running it whole, bit for bit:
//! that is what makes it the partitioner's oracle. It knows nothing of `.pte`, TensorRT or pi0.5.
#![deny(missing_docs)]

pub mod bf16;
pub mod compare;
mod executor;
pub mod kernels;
mod memory;
pub mod recycle;
pub mod settings;
mod tensor;

pub use compare::{CompareError, max_abs_diff};
pub use executor::{Executor, NoWeights, RunStats, cast, run};
pub use memory::MemoryWeights;
pub use recycle::Recycler;
pub use tensor::{Data, Tensor};

/// Errors of this crate; each names what was expected and what was found.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A node failed; names the node (id, op, label) and what went wrong.
    #[error("{node}: {message}")]
    Node {
        /// The node.
        node: petite_graph::NodeDesc,
        /// What was expected and what was found.
        message: String,
    },
    /// A graph input is missing, unknown, or of the wrong dtype or shape.
    #[error("input {name:?}: {message}")]
    Input {
        /// The input name.
        name: String,
        /// What was expected and what was found.
        message: String,
    },
    /// The program is invalid.
    #[error(transparent)]
    Graph(#[from] petite_graph::Error),
    /// A tensor's data does not fit its declaration.
    #[error("{0}")]
    Tensor(String),
    /// A kernel got buffers or shapes that do not fit together.
    #[error("{kernel}: {message}")]
    Kernel {
        /// The kernel (e.g. `linear`, `sdpa`).
        kernel: &'static str,
        /// What was expected and what was found.
        message: String,
    },
    /// A `PETITE_CPU_*` variable holds a value it does not take ([`settings`]).
    #[error(transparent)]
    Setting(#[from] settings::Invalid),
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Builds an [`Error::Kernel`]; kernels check their preconditions instead of panicking.
pub(crate) fn kerr(kernel: &'static str, message: impl Into<String>) -> Error {
    Error::Kernel {
        kernel,
        message: message.into(),
    }
}
