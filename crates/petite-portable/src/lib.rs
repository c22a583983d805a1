#![doc = include_str!("../README.md")]
//!
//! ## API map
//!
//! * [`lower()`]: ops → kernel calls with full schema argument lists ([`lower::Lowered`]).
//! * [`plan()`]: one planned buffer, memory reused by value lifetime (greedy by size).
//! * [`plan_portable`]: lower + plan from shapes alone, the [`ExportReport`] an export would give.
//! * [`export_portable`]: writes a one-method `.pte`; each weight is converted (and transposed
//!   where the lowering stores it so) straight into the constant segment, in bounded chunks from
//!   the mapped [`petite_weights::WeightSource`]: written once, never all in memory.
//! * [`build_program`] + [`write_weights_at`] + [`mapping_seal`]: what `petite export` uses —
//!   a `.pte` of several methods laid out with its weights as deferred constants, then every
//!   weight converted once, in the exact dtype and layout the `.pte` stores (transposes in
//!   tiled column bands, two threads, source pages unmapped behind), straight into its place;
//!   the seal a mapping file of those bytes would have, read from where they are.
//! * [`write_mapping`] + [`write_program`]: the same weights as a cacheable mapping file (the
//!   same banded converter), then `.pte` files whose constants are regions of it, copied
//!   in-kernel (`copy_file_range`).
//! * [`Error`]: every failure, naming the node, op or weight.
//!
//! Only operators registered by both `executorch-numpy-runtime` 1.4.0 and the `executorch` 1.5.1
//! pybindings are emitted ([`OPERATORS`]).
#![deny(missing_docs)]
#![forbid(unsafe_code)]

mod convert;
pub mod lower;
mod mapping;
pub mod plan;
mod program;
mod report;
mod stored;
#[cfg(test)]
mod stream_tests;

use std::path::PathBuf;

pub use lower::{Lowered, lower, row_source};
pub use mapping::{ReadStored, mapping_seal, write_mapping, write_weights_at};
pub use plan::{MemoryPlan, PlanStats, plan};
pub use program::{
    Built, Constants, MethodSpec, build_program, export_portable, scalar_type, write_program,
    write_program_with,
};
pub use report::{ExportReport, IoSpec, METHOD, plan_portable};
pub use stored::{StoredWeight, check_weights, stored_key, stored_weights};

/// Errors of this crate: each names the node/op, tensor or file involved.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An op, dtype or shape the portable kernels do not cover.
    #[error("{node}: op `{op}` has no portable lowering: {reason}")]
    Unsupported {
        /// The node (id, op, label).
        node: String,
        /// The op's name.
        op: &'static str,
        /// What is missing.
        reason: String,
    },
    /// The program is invalid.
    #[error("invalid program: {0}")]
    Graph(petite_graph::Error),
    /// A weight is missing, has the wrong shape, or a dtype that cannot be converted.
    #[error("weight `{name}`: {reason}")]
    Weight {
        /// Checkpoint name.
        name: String,
        /// What is wrong (expected vs found).
        reason: String,
    },
    /// Reading weights failed.
    #[error(transparent)]
    Weights(#[from] petite_weights::Error),
    /// Building or writing the `.pte` failed.
    #[error(transparent)]
    Pte(#[from] petite_pte::Error),
    /// File I/O.
    #[error("{path}: {op}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The cause.
        source: std::io::Error,
    },
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Every operator the lowering can emit. All are registered by `executorch-numpy-runtime`
/// 1.4.0 and the `executorch` 1.5.1 pybindings (see the registered-ops lists); a test checks
/// that the lowering emits nothing else.
pub const OPERATORS: &[&str] = &[
    "aten::_softmax.out",
    "aten::_to_copy.out",
    "aten::add.Scalar_out",
    "aten::add.out",
    "aten::addmm.out",
    "aten::amax.out",
    "aten::bmm.out",
    "aten::cat.out",
    "aten::clone.out",
    "aten::convolution.out",
    "aten::cos.out",
    "aten::cumsum.out",
    "aten::div.Scalar_out",
    "aten::div.out",
    "aten::embedding.out",
    "aten::eq.Tensor_out",
    "aten::exp.out",
    "aten::expand_copy.out",
    "aten::ge.Tensor_out",
    "aten::gelu.out",
    "aten::gt.Tensor_out",
    "aten::le.Tensor_out",
    "aten::logical_and.out",
    "aten::logical_not.out",
    "aten::logical_or.out",
    "aten::lt.Tensor_out",
    "aten::mean.out",
    "aten::mm.out",
    "aten::mul.Scalar_out",
    "aten::mul.out",
    "aten::native_layer_norm.out",
    "aten::ne.Tensor_out",
    "aten::neg.out",
    "aten::permute_copy.out",
    "aten::rsqrt.out",
    "aten::rsub.Scalar_out",
    "aten::sigmoid.out",
    "aten::sin.out",
    "aten::slice_copy.Tensor_out",
    "aten::sqrt.out",
    "aten::sub.Scalar_out",
    "aten::sub.out",
    "aten::sum.IntList_out",
    "aten::tanh.out",
    "aten::view_copy.out",
    "aten::where.self_out",
];
