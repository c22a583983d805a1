#![doc = include_str!("../README.md")]
//!
//! ## API map
//!
//! A [`Program`] is a list of [`Node`]s; each node holds an [`Op`] (attributes included), the
//! ids of the values it reads and the [`ValueType`] of the one value it produces, so a value's
//! id *is* its producer's id. Sources are nodes too: graph inputs ([`Op::Input`]), weights
//! referenced by checkpoint name with shape and dtype but no bytes ([`Op::Weight`]), and small
//! inline constants ([`Op::Constant`]). The only multi-output op, [`Op::Split`], produces a
//! tuple that is consumed exclusively through [`Op::GetItem`] nodes, so every edge between
//! nodes that a partitioner can cut is a plain tensor.
//!
//! Programs are written with the [`Builder`] (types inferred and checked per node, errors
//! naming the node's id, op and label), checked with [`Program::validate`], walked with the
//! iterative [`Program::topo_order`] / [`Program::ancestors`], cut with
//! [`Program::subprogram`], and serialised with serde deterministically (vectors only; no hash
//! maps). The exact semantics of every op — input order, shapes, broadcasting, dtype rules, axis
//! conventions — are documented on [`Op`] and in the [`op`] module. Failures are [`Error`]s
//! naming the node ([`NodeDesc`]).
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod builder;
mod dtype;
mod error;
mod hex;
mod node;
pub mod op;
mod program;
pub mod quant;

pub use builder::Builder;
pub use dtype::{Dtype, ShapeDisplay, TensorType, ValueType};
pub use error::{Error, Result};
pub use node::{NodeDesc, NodeId, ValueId};
pub use op::{
    BinaryOp, CompareOp, LogicalOp, Op, ReduceOp, UnaryOp, broadcast_shapes, broadcasts_to,
};
pub use program::{GraphOutput, Node, Program, SubProgram, WeightInfo, weight_display};
