//! The crate's error type.

use crate::dtype::{TensorType, ValueType};
use crate::node::{NodeDesc, NodeId};

/// Everything that can go wrong building, validating, walking or (de)serialising a program.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The op rejects its inputs or attributes (wrong shape, dtype, axis, arity…).
    #[error("{node}: {reason}")]
    InvalidNode {
        /// The offending node.
        node: NodeDesc,
        /// What was expected and what was found.
        reason: String,
    },
    /// A node's stored type differs from the one its op infers from its inputs.
    #[error("{node}: stored type {stored} but its inputs give {inferred}")]
    TypeMismatch {
        /// The offending node.
        node: NodeDesc,
        /// Type recorded in the program.
        stored: ValueType,
        /// Type inferred from the op and its inputs.
        inferred: ValueType,
    },
    /// A node input (or graph output/input) names a value id that does not exist.
    #[error(
        "{node}: input {index} refers to {value}, which does not exist (the program has {len} nodes)"
    )]
    DanglingValue {
        /// The offending node.
        node: NodeDesc,
        /// Position in the node's inputs.
        index: usize,
        /// The missing id.
        value: NodeId,
        /// Number of nodes in the program.
        len: usize,
    },
    /// A multi-output value is consumed by something other than `getitem`.
    #[error(
        "{node}: input {index} is the multi-output value of {producer}; multi-output values may only be consumed through getitem nodes"
    )]
    TupleWithoutGetItem {
        /// The offending consumer.
        node: NodeDesc,
        /// Position in its inputs.
        index: usize,
        /// The multi-output node.
        producer: NodeDesc,
    },
    /// The nodes do not form a DAG.
    #[error(
        "cycle: {node} depends (directly or indirectly) on its own value; {count} nodes are on or behind cycles"
    )]
    Cycle {
        /// One node on a cycle.
        node: NodeDesc,
        /// Nodes that could not be ordered.
        count: usize,
    },
    /// Two graph inputs, graph outputs or weights share a name.
    #[error("duplicate {kind} name {name:?}: used by {first} and {second}")]
    DuplicateName {
        /// `"input"`, `"output"` or `"weight"`.
        kind: &'static str,
        /// The shared name.
        name: String,
        /// First use.
        first: NodeId,
        /// Second use.
        second: NodeId,
    },
    /// A weight name was declared again with a different shape or dtype.
    #[error("weight {name:?} declared as {existing} and again as {requested}")]
    WeightConflict {
        /// Checkpoint tensor name.
        name: String,
        /// First declaration.
        existing: TensorType,
        /// Conflicting declaration.
        requested: TensorType,
    },
    /// The program's input/output lists are inconsistent with its nodes.
    #[error("graph {kind} {name:?}: {reason}")]
    Interface {
        /// `"input"`, `"output"` or `"weight"` (overlapping row ranges of one weight).
        kind: &'static str,
        /// The input/output/weight name (or id when unnamed).
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A subprogram could not be extracted.
    #[error("subprogram: {0}")]
    Subprogram(String),
    /// JSON (de)serialisation failed.
    #[error("program JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
