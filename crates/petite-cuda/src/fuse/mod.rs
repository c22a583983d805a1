//! Elementwise fusion: chains of pointwise and layout ops (casts, arithmetic, comparisons,
//! selects, expands, slices, permutes, reshapes, concats) become one generated CUDA C kernel a
//! chain, compiled by NVRTC when the program is loaded.
//!
//! Why: pi0.5's bf16 programs follow torch's eager op order (rotate-half RoPE, adaRMS in f32,
//! repeated K/V heads), so most of their ~1,500 nodes a step are tiny elementwise ops, each a
//! launch of the generic strided kernel. On an H200 the step is launch-bound; fused, each chain
//! is one launch that reads its inputs once and writes one output.
//!
//! Exactness: a fused kernel computes every op with the same device functions as `pt_ew` (the
//! shared prelude) in the same order, and rounds each op's result to that op's dtype, as
//! storing and re-loading it would. So fused and unfused runs give the same bits.
//!
//! A node is inlined into its consumers when it is fusible, not a program output, and every
//! consumer is in one fused group; otherwise a fusible node roots its own group (a reshape
//! never roots one: unfused it is free).
//!
//! By concept: the plan's types are here ([`Fusion`], [`Group`], [`Role`]); `options` holds
//! the planner's switches, `planner` the planner ([`plan_opts`]) that groups nodes, `views`
//! the operands read in place, `rows` what a row kernel folds into its loads, `attend` the
//! fused attentions, `siblings` the linears batched as one GEMM, `codegen` each group's
//! body as statements of [`ir`] (which renders them as CUDA C text, in one place), `regs`
//! how a dtype's value is written in a register, and `rewrite` the passes over those
//! statements (unrolling, pairing).

use std::collections::HashMap;

use petite_graph::{NodeId, Program};

mod attend;
mod codegen;
pub mod ir;
mod options;
mod planner;
mod regs;
mod rewrite;
mod rows;
mod siblings;
#[cfg(test)]
mod tests;
mod views;

pub use attend::{Attend, DEFAULT_FUSED_ATTENTION_QUERIES, fused_attention_queries};
pub use options::Options;
pub use planner::{moves_only_unit_dims, plan, plan_opts, plan_program, plan_with};
pub use rewrite::{UNROLL, UNROLL_FROM, beside, rows_unrolled, unrolled, with_first};
pub use rows::Folded;
pub use siblings::{Siblings, siblings};
pub use views::reshape_strides;

/// How one node runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// On its own (not fusible, or a reshape left as a free view).
    Plain,
    /// Computed inside the kernel of the group whose root consumes it (no buffer).
    Inlined,
    /// The root of fused group `k`: one launch of its kernel writes this node's value.
    Root(usize),
    /// A reshape, permute or expand that a matmul reads in place through strides, or a
    /// widening cast that a row kernel reads in place through its input's dtype
    /// ([`Fusion::views`]): never computed.
    View,
    /// A last-axis softmax whose only reader is a narrowing cast: the cast runs it with its own
    /// dtype as the output (one launch, the same bits: the kernel rounds once either way).
    Narrowed,
    /// A matmul with a `[1, H, Q, D]` result (attention: `[B, H, Q, D]`) whose only reader is
    /// a permute `[0, 2, 1, 3]` (merging heads): the permute runs it, its GEMM writing
    /// `[B, Q, H, D]` directly (a leading dimension of `H·D`) instead of a copy after it.
    Transposed,
    /// A norm whose only readers are in one fused group of its shape: that group's kernel
    /// computes it row by row (one block a row, as `pt_norm`) and applies its own ops to each
    /// element as it is normalized ([`Group::prologue`]).
    Prologue,
    /// The logits product, softmax or narrowing cast of a bf16 attention that the product
    /// reading its probabilities computes whole ([`Fusion::attentions`]): never computed alone.
    Attended,
    /// A dequantize to bf16 whose only readers are linears of at most [`WQ_ROWS`] bf16 rows
    /// (pi0.5's steps): they read its codes and scales themselves (`pt_wq_gemm`), so no bf16
    /// copy of the weight is made; never computed.
    WeightOnly,
}

/// The most rows a linear reads a quantized weight's codes itself ([`Role::WeightOnly`]):
/// `pt_wq_gemm`'s tile holds 64 rows (four `mma` row tiles). Above it (the prefix's ~800
/// rows) the weight is dequantized once and cuBLAS runs the product: its cost is spread over
/// many rows.
pub const WQ_ROWS: usize = 64;

/// A matmul operand read in place: `base`'s buffer seen with `shape` and element `strides`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StridedView {
    /// The materialized value the view reads.
    pub base: NodeId,
    /// The operand's shape.
    pub shape: Vec<usize>,
    /// Element strides (0 where broadcast).
    pub strides: Vec<i64>,
}

/// One fused group: its kernel and the materialized values it reads.
#[derive(Debug, Clone)]
pub struct Group {
    /// The node whose value the kernel writes.
    pub root: NodeId,
    /// Index of the kernel in [`Fusion::kernels`] (groups of the same shape share one); none
    /// for an [`Group::absorbed`] group (another group's launch computes it).
    pub kernel: Option<usize>,
    /// The values the kernel reads, in parameter order.
    pub leaves: Vec<NodeId>,
    /// Nodes computed by the kernel (the root and those inlined into it).
    pub nodes: usize,
    /// A norm ([`Role::Prologue`]) the kernel computes first, one block a row: it is then
    /// launched as a row kernel, with the norm's parameters and operands before `n`.
    pub prologue: Option<NodeId>,
    /// Elements a thread takes per trip of its grid-stride loop ([`unrolled`]): the launch
    /// needs this many times fewer threads.
    pub unroll: usize,
    /// A group this one's kernel computes first, row by row, before its prologue norm's
    /// statistics: the one whose root is the norm's input (pi0.5's residual sums, each read by
    /// the next norm). Its leaves and output follow `po` as `q0…`, `qo` ([`with_first`]).
    pub first: Option<usize>,
    /// A group this one's kernel computes beside it, on the blocks after its own
    /// ([`beside`]): its `n`, leaves and output follow as `qn`, `q0…`, `qo`.
    pub with: Option<usize>,
    /// Blocks of this group's launch when it has no prologue (its own grid-stride loop's, plus
    /// its [`Group::with`]'s).
    pub blocks: u32,
    /// Computed by the kernel of the group that has it as [`Group::first`] or
    /// [`Group::with`]: never launched alone (its output is allocated where its root runs, and
    /// written by that launch).
    pub absorbed: bool,
    /// The slice starts the kernel takes as parameters `s0…` (after its pointers; then its
    /// [`Group::first`]'s or [`Group::with`]'s as `t0…`): why a step's 36 adaRMS prologues,
    /// which differ only in their layer's offsets into the modulation table, are one kernel.
    pub offsets: Vec<i64>,
}

/// The fusion plan of one program.
#[derive(Debug, Clone)]
pub struct Fusion {
    /// By node index.
    pub role: Vec<Role>,
    /// By group index ([`Role::Root`]).
    pub groups: Vec<Group>,
    /// Kernel names, by kernel index.
    pub kernels: Vec<String>,
    /// The CUDA C source of every kernel (with the prelude) but the attention kernels, which
    /// are compiled from their own module ([`crate::source::attention_module_source`]).
    pub source: String,
    /// Operands read in place: (consumer, operand index) → the view (a matmul's through
    /// strides; a norm's or softmax's through the dtype of a widening cast's input).
    pub views: HashMap<(NodeId, usize), StridedView>,
    /// Softmaxes over `[B, H, Q, K]` whose input was `x + mask`, computed by the softmax kernel
    /// as it loads `x` (its operand 0 is then `x`, through [`Fusion::views`]).
    pub masks: HashMap<NodeId, Folded>,
    /// bf16 attentions run whole by their `p·v` product (the key), [`Attend`].
    pub attentions: HashMap<NodeId, Attend>,
    /// f32 linears whose bias (the value) the one fused group reading them adds as it loads
    /// them: the GEMM writes the product and no `pt_bias` pass runs (the same f32 sum, so the
    /// same bits). Why: SigLIP's 203 bias passes took 1.1 ms of a chunk on the H200.
    pub biases: HashMap<NodeId, NodeId>,
    /// Where [`Fusion::kernels`] holds the attention kernels (`pt_attn_logits`, `pt_attn_pv`,
    /// `pt_attn_cl`; the last three, only when there are [`Fusion::attentions`]). Their source
    /// is the same for every program, so it is its own module
    /// ([`crate::source::attention_module_source`]): NVRTC compiles it once a process (~1 s;
    /// `petite verify` has two step engines that fuse attentions), not once a program.
    pub attention_kernels: Option<[usize; 3]>,
}

/// The value operand `j` of node `id` is read from: the base of its view where the plan reads
/// it in place ([`Fusion::views`]), else the operand itself. The planner, the generator (a
/// prologue's operand dtypes) and the launch (`norm_args`) all ask this.
pub fn read_from(
    program: &Program,
    views: &HashMap<(NodeId, usize), StridedView>,
    id: NodeId,
    j: usize,
) -> NodeId {
    views
        .get(&(id, j))
        .map_or(program.node(id).inputs[j], |v| v.base)
}

impl Fusion {
    /// The slice starts group `g`'s launch passes after its pointers, in the kernel's parameter
    /// order: its own (`s0…`), then its [`Group::first`]'s or [`Group::with`]'s (`t0…`).
    pub fn launch_offsets(&self, g: usize) -> impl Iterator<Item = &i64> {
        let group = &self.groups[g];
        let other = group.first.or(group.with).map(|o| &self.groups[o]);
        group
            .offsets
            .iter()
            .chain(other.into_iter().flat_map(|o| o.offsets.iter()))
    }
}
