//! petite-partition: splits a petite-graph [`Program`](petite_graph::Program) into engines that
//! each build within a memory cap, and says in which order to build them and when each weight
//! is no longer needed.
//!
//! A backend that compiles a whole program at once needs several times the program's weights in
//! host memory; built engine by engine, it needs several times one engine's. [`plan`] works on
//! shapes and weight *names* only (it never touches weight bytes), in time linear in the program,
//! with iterative walks only. The rules (see [`plan`] for details):
//!
//! * **Cap.** Each engine reads at most `engine_cap` bytes of weights, unless a single atomic
//!   group reads more on its own; it then gets an engine whose only weights are its own, marked
//!   [`Engine::over_cap`].
//! * **Atomic groups.** A multi-output producer and all its `getitem`s stay in one engine, so
//!   only plain tensors cross engine boundaries.
//! * **Recompute.** A value computed only from program inputs and constants (attention masks,
//!   positions, rotary tables) and larger than `crossing_limit` is recomputed inside every engine
//!   that reads it instead of crossing; everything else crosses as an engine output/input.
//! * **Cheap cuts.** The plan minimises `engines × engine_overhead + bytes crossing the cuts`,
//!   so cuts land where little crosses (for a transformer: between layers, where only the
//!   residual stream crosses, not inside attention or the MLP).
//! * **Deterministic.** Same program and options, same [`Plan`], byte for byte as JSON.
//!
//! The crate knows no backend, no file format and no model.
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod extract;
mod options;
mod planner;

pub use extract::EngineProgram;
pub use options::{
    CostModel, DEFAULT_CROSSING_LIMIT, DEFAULT_ENGINE_OVERHEAD, DefaultCost, EngineCost,
    PartitionOptions, TORCH_TRT_BUILD_MULTIPLIER,
};
pub use planner::{Boundary, Engine, EngineInput, EngineOutput, Plan, WeightUse, plan};

use petite_graph::NodeDesc;

/// Everything that can go wrong planning or using a plan. Messages name the setting or node.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A [`PartitionOptions`] field is out of range.
    #[error("partition option `{setting}`: expected {expected}, found {found}")]
    InvalidOption {
        /// The field name.
        setting: &'static str,
        /// The accepted range.
        expected: String,
        /// The value given.
        found: String,
    },
    /// Not even the smallest atomic group that reads weights fits the cap, so every engine
    /// would be over it: almost certainly a unit mistake in the cap.
    #[error(
        "partition option `engine_cap` = {cap} bytes is smaller than the smallest possible engine: {node} alone reads {bytes} bytes of weights"
    )]
    CapTooSmall {
        /// The cap.
        cap: u64,
        /// The node of the smallest weight-reading group.
        node: NodeDesc,
        /// Its weight bytes.
        bytes: u64,
    },
    /// The program is not a valid DAG (cycle, dangling value, bad types…); the graph error
    /// names the node.
    #[error("invalid program: {0}")]
    Graph(#[from] petite_graph::Error),
    /// An engine index beyond the plan.
    #[error("engine {index} does not exist (the plan has {count} engines)")]
    NoSuchEngine {
        /// Requested index.
        index: usize,
        /// Engines in the plan.
        count: usize,
    },
    /// The plan does not describe this program (it was made for another one, or edited).
    #[error("plan does not fit the program: {0}")]
    Mismatch(String),
    /// Plan JSON could not be (de)serialised.
    #[error("plan JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
