#![doc = include_str!("../README.md")]
//!
//! ## API map
//!
//! * [`plan`]: the planner (its docs give the algorithm step by step).
//! * [`PartitionOptions`]: cap, crossing limit, positional recompute, engine overhead, and the
//!   [`CostModel`] ([`DefaultCost`] unless replaced).
//! * [`Plan`]: [`Engine`]s in build order (with [`EngineInput`]s / [`EngineOutput`]s),
//!   [`Boundary`]s, [`WeightUse`]s; [`Plan::engine_program`] extracts one engine as an
//!   [`EngineProgram`].
//! * [`Error`]: every failure, naming the setting or node.
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
