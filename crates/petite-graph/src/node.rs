//! A node's identity: its id (which also names its value) and how messages name it. Its own
//! module so that the error type and the program both use it without importing each other.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Index of a node in [`crate::Program::nodes`]. Every node produces exactly one value, so the same id
/// also names that value (see [`ValueId`]). Displays as `%12`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub u32);

/// The value a node produces; identical to the producing node's id, so a value's producer is
/// `NodeId` itself and no separate value table exists.
pub type ValueId = NodeId;

impl NodeId {
    /// Position in [`crate::Program::nodes`].
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// Identifies a node in messages: id, op and the builder's label, e.g.
/// `node %812 (linear "language.layers.3.attn.q_proj")`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeDesc {
    /// The node's id.
    pub id: NodeId,
    /// The op's short name.
    pub op: &'static str,
    /// Label attached by the builder, if any.
    pub label: Option<String>,
}

impl fmt::Display for NodeDesc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.label {
            Some(l) => write!(f, "node {} ({} {l:?})", self.id, self.op),
            None => write!(f, "node {} ({})", self.id, self.op),
        }
    }
}
