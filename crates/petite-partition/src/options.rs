//! Options and the cost model.

use petite_graph::{NodeId, Program, ValueId};

use crate::{Error, Result};

/// Default [`PartitionOptions::crossing_limit`]: input-only values up to 64 KiB cross between
/// engines; larger ones are recomputed (passing a small value is cheaper than recomputing it).
pub const DEFAULT_CROSSING_LIMIT: u64 = 64 * 1024;

/// Default [`PartitionOptions::engine_overhead`]: one more engine is preferred to a cut that
/// carries 16 MiB more than the cheapest alternative. A transformer's residual stream is a few
/// MiB and its MLP activations tens of MiB, so cuts land between layers rather than inside them.
pub const DEFAULT_ENGINE_OVERHEAD: u64 = 16 << 20;

/// Torch-TensorRT's `ENGINE_COMPILATION_MEMORY_USAGE_MULTIPLIER`: a TensorRT build needs up to
/// about 4× the engine's weights in host memory. The default build-memory estimate uses it.
pub const TORCH_TRT_BUILD_MULTIPLIER: u64 = 4;

/// What the planner knows about one finished engine when it asks for a build-memory estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineCost {
    /// Weight bytes the engine reads (each weight once).
    pub weight_bytes: u64,
    /// Bytes of the values crossing in from earlier engines.
    pub input_bytes: u64,
    /// Bytes of the values the engine hands to later engines.
    pub output_bytes: u64,
    /// Nodes the engine computes (recomputed ones included).
    pub nodes: usize,
}

/// Sizes the planner works with. Backends that store weights in another dtype than the program
/// declares, or whose builds need another multiple of the weights, supply their own.
pub trait CostModel {
    /// Bytes a weight node adds to every engine that reads it. Default: its declared
    /// `numel × dtype size`.
    fn weight_bytes(&self, program: &Program, weight: NodeId) -> u64 {
        program.node(weight).ty.nbytes() as u64
    }

    /// Bytes of a value when it crosses between engines; decides recompute vs. cross and the
    /// crossing figures. Default: `numel × dtype size`.
    fn value_bytes(&self, program: &Program, value: ValueId) -> u64 {
        program.node(value).ty.nbytes() as u64
    }

    /// Estimated host memory to build one engine. Default: [`TORCH_TRT_BUILD_MULTIPLIER`] × its
    /// weights plus its input and output tensors.
    fn build_bytes(&self, engine: &EngineCost) -> u64 {
        engine
            .weight_bytes
            .saturating_mul(TORCH_TRT_BUILD_MULTIPLIER)
            .saturating_add(engine.input_bytes)
            .saturating_add(engine.output_bytes)
    }
}

/// The default [`CostModel`]: declared sizes, 4× build multiplier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DefaultCost;

impl CostModel for DefaultCost {}

/// Settings of [`crate::plan`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartitionOptions<C = DefaultCost> {
    /// Maximum weight bytes per engine (≥ 1). Only an atomic group that is larger on its own
    /// may exceed it, in an engine of its own.
    pub engine_cap: u64,
    /// Input-only values larger than this are recomputed in each engine that reads them; smaller
    /// ones cross. Any value is accepted (`u64::MAX` disables recompute, `0` recomputes all).
    pub crossing_limit: u64,
    /// Positional operands — input-only values the program marks
    /// [`petite_graph::Node::recompute`], or reads as a fused `rope`'s cos/sin tables or an
    /// `attention` mask — are recomputed in every engine that reads them whatever their size.
    /// They are what Torch-TensorRT's recompute fix was for (crossing masks broke engine
    /// builds), they read no weights and cost a few elementwise ops, and small ones (pi0.5's
    /// step rotary tables are 25 KiB) would otherwise cross under the 64 KiB default.
    /// Default `true`; `false` leaves them to `crossing_limit` alone.
    pub recompute_positional: bool,
    /// What one more engine costs, in crossing bytes: the planner minimises
    /// `engines × engine_overhead + Σ bytes crossing the cuts`. `u64::MAX` means "fewest engines
    /// first"; `0` means "least crossing, however many engines".
    pub engine_overhead: u64,
    /// Sizes of weights and values, and the build-memory estimate.
    pub cost: C,
}

impl PartitionOptions<DefaultCost> {
    /// Options with this cap, the default crossing limit and the default cost model.
    pub fn new(engine_cap: u64) -> Self {
        PartitionOptions {
            engine_cap,
            crossing_limit: DEFAULT_CROSSING_LIMIT,
            recompute_positional: true,
            engine_overhead: DEFAULT_ENGINE_OVERHEAD,
            cost: DefaultCost,
        }
    }
}

impl<C> PartitionOptions<C> {
    /// The same options with another crossing limit.
    pub fn crossing_limit(mut self, bytes: u64) -> Self {
        self.crossing_limit = bytes;
        self
    }

    /// The same options with positional-operand recompute on or off (see
    /// [`PartitionOptions::recompute_positional`]).
    pub fn recompute_positional(mut self, on: bool) -> Self {
        self.recompute_positional = on;
        self
    }

    /// The same options with another engine overhead.
    pub fn engine_overhead(mut self, bytes: u64) -> Self {
        self.engine_overhead = bytes;
        self
    }

    /// The same options with another cost model.
    pub fn with_cost<D: CostModel>(self, cost: D) -> PartitionOptions<D> {
        PartitionOptions {
            engine_cap: self.engine_cap,
            crossing_limit: self.crossing_limit,
            recompute_positional: self.recompute_positional,
            engine_overhead: self.engine_overhead,
            cost,
        }
    }

    /// Checks the ranges.
    pub fn check(&self) -> Result<()> {
        if self.engine_cap == 0 {
            return Err(Error::InvalidOption {
                setting: "engine_cap",
                expected: "at least 1 byte of weights per engine".into(),
                found: "0".into(),
            });
        }
        Ok(())
    }
}
