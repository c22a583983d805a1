//! The fusion planner's switches ([`Options`]): the measured defaults, each kept to compare
//! against (tests, `examples/nvrtc_bench.rs`, [`crate::Tuning`]).

use super::fused_attention_queries;
#[cfg(doc)]
use super::{Attend, Group, plan_opts, rows_unrolled};
use crate::Tuning;

/// How [`plan_opts`] fuses: the defaults, each switch there to compare against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// bf16 attentions of up to this many queries run as the fused attention kernels
    /// ([`Attend`]; 0: none, as on GPUs without bf16 tensor-core `mma`, before sm_80).
    pub attention_queries: usize,
    /// Two independent groups with only products between them share a launch
    /// ([`Group::with`]): a full-size bf16 chunk 24.96 → 24.78 ms on the H200, the same bits
    /// (session 23 of docs/MEASUREMENTS.md). Off only in tests.
    pub pairs: bool,
    /// Slice starts are kernel parameters ([`Group::offsets`]); off bakes them in as literals
    /// (one kernel a distinct set: [`Tuning::offset_params`]).
    pub offset_params: bool,
    /// A prologue kernel's row loops take four elements a trip ([`rows_unrolled`]) and its
    /// statistics four loads at a time (`norm_stats4`): the same bits. On by default: a
    /// full-size bf16 chunk 25.25/25.17 → 24.27/23.98 ms on the H200 (0.961×, bit-identical
    /// actions; issue 49, docs/MEASUREMENTS.md). Off only to compare.
    pub unrolled_rows: bool,
    /// Linears of at most [`super::WQ_ROWS`] bf16 rows read a quantized weight's codes
    /// themselves ([`super::Role::WeightOnly`], `pt_wq_gemm`: bf16 `mma`, sm_80 and later);
    /// off, every quantized weight is dequantized and cuBLAS runs the product.
    pub weight_only: bool,
}

impl Options {
    /// The defaults, fusing bf16 attentions of up to `attention_queries` queries.
    pub fn new(attention_queries: usize) -> Self {
        Options {
            attention_queries,
            pairs: true,
            offset_params: true,
            unrolled_rows: true,
            weight_only: true,
        }
    }

    /// What a device of compute capability `cc` plans with `tuning`: its attention query
    /// limit ([`fused_attention_queries`], unless `tuning` sets one), slice starts as
    /// `tuning` says, and weight-only products where it has bf16 `mma` (sm_80 and later).
    pub fn for_device(cc: (i32, i32), tuning: &Tuning) -> Self {
        Options {
            offset_params: tuning.offset_params,
            weight_only: cc.0 >= 8,
            ..Options::new(
                tuning
                    .attention_queries
                    .unwrap_or_else(|| fused_attention_queries(cc)),
            )
        }
    }
}
