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

use std::collections::HashMap;
use std::fmt::Write as _;

use petite_graph::{Dtype, NodeId, Op, Program};

use crate::plan::contiguous_strides;
use crate::source::{EwOp, fused_prelude};
use crate::{Error, Result};

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
}

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

/// One kernel running grid-stride body `own` on blocks `[0, gb)` and body `other` on the `ga`
/// blocks after them, each seeing only its own blocks (`blockIdx`, `gridDim`) and `other` its
/// own `n`, leaves and output renamed `qn`, `q0…`, `qo`. Why: a step's q and k RoPEs were two
/// launches of a few microseconds each, back to back with a GEMM between.
pub fn beside(own: &str, gb: u32, other: &str, ga: u32) -> String {
    let mut out = String::with_capacity(own.len() + other.len() + 256);
    let _ = writeln!(out, "  if (blockIdx.x < {gb}u) {{\n  const dim3 pg({gb}u);");
    for l in own.lines() {
        out.push_str(&map_words(l, |w| {
            (w == "gridDim").then(|| "pg".to_string())
        }));
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "  }} else {{\n  const dim3 qb(blockIdx.x - {gb}u), qg({ga}u);"
    );
    for l in other.lines() {
        let l = map_words(l, |w| match w {
            "blockIdx" => Some("qb".to_string()),
            "gridDim" => Some("qg".to_string()),
            "n" => Some("qn".to_string()),
            _ => None,
        });
        out.push_str(&operands_renamed(&l));
        out.push('\n');
    }
    out.push_str("  }\n");
    out
}

/// A prologue kernel's `body` computing `first`'s elements of its row first (`first` a plain
/// group body, its leaves and output renamed `q0…`, `qo`), storing them, then a block barrier
/// so the norm's statistics read them. Why: each of a step's 36 residual sums was a launch of
/// its own just before the norm that reads it (one less launch a sum, the same bits).
pub fn with_first(body: &str, first: &str) -> Option<String> {
    let at = body.find("  float nm, nr;")?;
    let lines: Vec<&str> = first.lines().collect();
    let (head, rest) = lines.split_first()?;
    let (last, inner) = rest.split_last()?;
    if !head.trim_start().starts_with("for (i64 i = ") || last.trim() != "}" {
        return None;
    }
    let mut out = String::with_capacity(body.len() + first.len() + 128);
    out.push_str(&body[..at]);
    out.push_str("  for (i64 jj = threadIdx.x; jj < np.d; jj += blockDim.x) {\n    const i64 i = base + jj;\n");
    for l in inner {
        out.push_str(&operands_renamed(l));
        out.push('\n');
    }
    out.push_str("  }\n  __syncthreads();\n");
    out.push_str(&body[at..]);
    Some(out)
}

/// `line` with a kernel's operands `pN` and `po` renamed `qN` and `qo`, its offsets `sN`
/// renamed `tN`.
fn operands_renamed(line: &str) -> String {
    map_words(line, |w| {
        let numbered =
            |c: char| w.len() > 1 && w.starts_with(c) && w[1..].bytes().all(|b| b.is_ascii_digit());
        if w == "po" || numbered('p') {
            Some(format!("q{}", &w[1..]))
        } else if numbered('s') {
            Some(format!("t{}", &w[1..]))
        } else {
            None
        }
    })
}

/// `line` with each identifier-like word `w` replaced by `f(w)` where that is `Some`.
fn map_words(line: &str, f: impl Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(line.len() + 16);
    let b = line.as_bytes();
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut j = 0;
    while j < b.len() {
        if !word(b[j]) {
            out.push(b[j] as char);
            j += 1;
            continue;
        }
        let start = j;
        while j < b.len() && word(b[j]) {
            j += 1;
        }
        let w = &line[start..j];
        match f(w) {
            Some(x) => out.push_str(&x),
            None => out.push_str(w),
        }
    }
    out
}

/// Elements from which a fused kernel without a prologue is [`unrolled`] ([`UNROLL`] a trip):
/// the prefix's big passes (SigLIP's 3 × 256 × 1,152 residuals up to 968 × 16,384 GELU × up),
/// not the step's latency-bound ones (50 × 4,096 at most).
pub const UNROLL_FROM: usize = 1 << 19;

/// Elements a thread of an [`unrolled`] kernel takes per trip.
pub const UNROLL: usize = 4;

/// `body` (a grid-stride loop over straight-line code, as the generator writes it without a
/// prologue) with each trip taking [`UNROLL`] elements a grid apart, the copies' lines
/// interleaved so that every copy's loads are issued before any copy's store. Why: one 2-byte
/// load in flight per thread left the prefix's big elementwise passes at ~40% of the H200's
/// bandwidth. Each element is computed by the same lines as before (the same bits). `None`
/// when the loop holds a branch (its lines cannot be interleaved).
pub fn unrolled(body: &str) -> Option<String> {
    let lines: Vec<&str> = body.lines().collect();
    let (first, rest) = lines.split_first()?;
    let (last, inner) = rest.split_last()?;
    if !first.trim_start().starts_with("for (i64 i = ")
        || last.trim() != "}"
        || inner.iter().any(|l| l.contains('{') || l.contains('}'))
    {
        return None;
    }
    let u = UNROLL;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "  const i64 st = (i64)gridDim.x * blockDim.x;\n  i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;\n  for (; i + {} * st < n; i += {u} * st) {{",
        u - 1
    );
    interleaved(
        &mut out,
        inner,
        ("i", "st"),
        renamed,
        "for (; i < n; i += st)",
    );
    Some(out)
}

/// The inside of an unrolled trip — `const i64 v_0 = v + 0 * step, …;`, then each of `inner`'s
/// lines [`UNROLL`] times, copy `k` through `rename(line, k)` — closing the trip's loop, and
/// the remainder loop `rest` over `inner` as it is.
fn interleaved(
    out: &mut String,
    inner: &[&str],
    (var, step): (&str, &str),
    rename: fn(&str, usize) -> String,
    rest: &str,
) {
    let decl: Vec<String> = (0..UNROLL)
        .map(|k| format!("{var}_{k} = {var} + {k} * {step}"))
        .collect();
    let _ = writeln!(out, "    const i64 {};", decl.join(", "));
    for l in inner {
        for k in 0..UNROLL {
            let _ = writeln!(out, "{}", rename(l, k));
        }
    }
    let _ = writeln!(out, "  }}\n  {rest} {{");
    for l in inner {
        let _ = writeln!(out, "{l}");
    }
    let _ = writeln!(out, "  }}");
}

/// The row loop of a prologue kernel ([`Group::prologue`]): its residual sum's
/// ([`with_first`]) and its elements'.
const ROW_LOOP: &str = "  for (i64 jj = threadIdx.x; jj < np.d; jj += blockDim.x) {";

/// A prologue kernel's `body` with each straight-line row loop taking [`UNROLL`] elements a
/// trip, `blockDim.x` apart, the copies' lines interleaved so that every copy's loads are
/// issued before any copy's store (the remainder in the loop as it was); the generator then has the
/// statistics computed by `norm_stats4` (four loads before their adds, for the input's dtype
/// and the norm's kind known here instead of switched on in the loop). Why:
/// the SASS of every norm kernel showed one load in flight — each load's use, or a store the
/// compiler cannot prove apart from the next load, waited a memory latency per element; a
/// step's row of 1,024 on 256 threads pays four of them a pass. Each element is computed by the
/// same lines as before and each thread adds in the same order: the same bits. Loops holding
/// a branch (a concat) are left as they are.
pub fn rows_unrolled(body: &str) -> String {
    let u = UNROLL;
    let lines: Vec<&str> = body.lines().collect();
    let mut out = String::with_capacity(body.len() * 5);
    let mut k = 0;
    while k < lines.len() {
        let line = lines[k];
        let end = (line == ROW_LOOP)
            .then(|| lines[k + 1..].iter().position(|l| *l == "  }"))
            .flatten()
            .map(|e| k + 1 + e);
        let Some(end) = end.filter(|&e| {
            lines[k + 1..e]
                .iter()
                .all(|l| !l.contains('{') && !l.contains('}'))
        }) else {
            out.push_str(line);
            out.push('\n');
            k += 1;
            continue;
        };
        let inner = &lines[k + 1..end];
        let _ = writeln!(
            out,
            "  {{\n  const i64 bd = blockDim.x;\n  i64 jj = threadIdx.x;\n  for (; jj + {} * bd < np.d; jj += {u} * bd) {{",
            u - 1
        );
        let rest = "for (; jj < np.d; jj += bd)";
        interleaved(&mut out, inner, ("jj", "bd"), row_renamed, rest);
        out.push_str("  }\n");
        k = end + 1;
    }
    out
}

/// `line` of a row loop with its own names (`jj`, `i`, `r`, `nv`, `cN`, `vN`) suffixed `_k`.
fn row_renamed(line: &str, k: usize) -> String {
    map_words(line, |w| {
        let ours = matches!(w, "jj" | "i" | "r" | "nv")
            || (w.len() > 1
                && (w.starts_with('v') || w.starts_with('c'))
                && w[1..].bytes().all(|c| c.is_ascii_digit()));
        ours.then(|| format!("{w}_{k}"))
    })
}

/// `line` with the loop's own names (`i`, `r`, `cN`, `vN`) suffixed `_k`.
fn renamed(line: &str, k: usize) -> String {
    map_words(line, |w| {
        let ours = w == "i"
            || w == "r"
            || (w.len() > 1
                && (w.starts_with('v') || w.starts_with('c'))
                && w[1..].bytes().all(|c| c.is_ascii_digit()));
        ours.then(|| format!("{w}_{k}"))
    })
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

/// A bf16 attention in transformers' eager op order — `q·kᵀ` (bf16), a 16-bit scaling, a
/// widening cast, `+ mask`, softmax, a cast to bf16, `p·v` — that the `p·v` product computes
/// in two launches (`pt_attn_logits`, `pt_attn_pv`) instead of three (logits GEMM, softmax,
/// PV GEMM) and without the logits and probabilities in memory as bf16: the same roundings,
/// each dot product summed in its own order (as cuBLAS's is). Why: a step's attention (8
/// heads, 50 queries, ~1,000 keys) is latency-bound; its three launches took 28 µs a layer on
/// the H200. q and k are the logits product's operands, v the `p·v` product's operand 1, all
/// read through their views ([`Fusion::views`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Attend {
    /// The logits product `q·kᵀ`.
    pub logits: NodeId,
    /// q `[B, H, Q, D]`, kᵀ `[B, H, D, K]` and v `[B, H, K, Dv]` as the kernels read them (each
    /// a view, or its value whole); with [`Attend::pieces`], k's and v's bases are the concats
    /// (never computed), whose layouts the pieces share.
    pub q: StridedView,
    /// See [`Attend::q`].
    pub k: StridedView,
    /// See [`Attend::q`].
    pub v: StridedView,
    /// The additive f32 mask.
    pub mask: NodeId,
    /// The scaling folded into the softmax ([`Folded::scale`]).
    pub scale: Option<(f32, Dtype)>,
    /// K and v as the key-axis concats of two pieces each (a step's prefix K/V and its own),
    /// read where the pieces lie instead of copied together: `[k₀, k₁, v₀, v₁]` and the keys
    /// of the first pieces. The concats are [`Role::Attended`].
    pub pieces: Option<([NodeId; 4], usize)>,
}

/// Queries up to which a bf16 attention is fused ([`Attend`]) on a device of compute
/// capability `cc`: [`DEFAULT_FUSED_ATTENTION_QUERIES`] on sm_90 and later, where it runs as one
/// launch of thread-block clusters (`pt_attn_cl`: pi0.5's ten steps 13.71 → 11.95 ms on the
/// H200, docs/MEASUREMENTS.md), none before (the two-launch form measured level with the
/// three launches it replaces). `PETITE_CUDA_FUSED_ATTN` = `all`, a number or `off` overrides.
pub fn fused_attention_queries(cc: (i32, i32)) -> usize {
    match std::env::var("PETITE_CUDA_FUSED_ATTN").as_deref() {
        Ok("all") => usize::MAX,
        Ok(n) => n.parse().unwrap_or(0),
        Err(_) if cc.0 >= 9 => DEFAULT_FUSED_ATTENTION_QUERIES,
        Err(_) => 0,
    }
}

/// Queries up to which attentions are fused by default on sm_90: pi0.5's steps (50 queries),
/// not its prefix (~968, past what one cluster's blocks hold of the rows' statistics cheaply).
pub const DEFAULT_FUSED_ATTENTION_QUERIES: usize = 64;

/// What a softmax kernel computes as it loads its input ([`Fusion::masks`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Folded {
    /// The mask added (f32, broadcast over `[B, H, Q, K]`).
    pub mask: NodeId,
    /// A 16-bit `x · s` before the widening cast: `s` (rounded to that dtype, as the fused
    /// kernel rounds a scalar) and the dtype its product is rounded to.
    pub scale: Option<(f32, Dtype)>,
}

/// Element strides of a `shape` view of a tensor with `old` dims and element strides `st`, or
/// `None` when no strides express it (the reshape would need a copy). Dims are matched in
/// chunks whose elements are evenly spaced in memory.
pub fn reshape_strides(old: &[usize], st: &[i64], new: &[usize]) -> Option<Vec<i64>> {
    let numel: usize = old.iter().product();
    if numel != new.iter().product::<usize>() {
        return None;
    }
    if numel == 0 || old.is_empty() {
        return Some(contiguous_strides(new));
    }
    let mut out = vec![0i64; new.len()];
    let mut vd = new.len() as isize - 1;
    let mut base = *st.last()?;
    let (mut tn, mut vn) = (1usize, 1usize);
    for td in (0..old.len()).rev() {
        tn *= old[td];
        let chunk_ends = td == 0 || (old[td - 1] != 1 && st[td - 1] != tn as i64 * base);
        if chunk_ends {
            while vd >= 0 && (vn < tn || new[vd as usize] == 1) {
                out[vd as usize] = vn as i64 * base;
                vn *= new[vd as usize];
                vd -= 1;
            }
            if vn != tn {
                return None;
            }
            if td > 0 {
                base = st[td - 1];
                tn = 1;
                vn = 1;
            }
        }
    }
    (vd == -1).then_some(out)
}

/// Follows matmul `mm`'s operand `j` back through single-consumer reshapes, permutes and
/// expands to a value it can read in place, composing their strides; `None` when there is no
/// such chain or a reshape would need a copy. Returns the view and the chain's nodes.
fn operand_view(
    p: &Program,
    mm: NodeId,
    j: usize,
    live_consumers: &dyn Fn(NodeId) -> usize,
    is_output: &[bool],
) -> Option<(StridedView, Vec<NodeId>)> {
    let mut chain = Vec::new();
    let mut x = p.node(mm).inputs[j];
    while matches!(
        p.node(x).op,
        Op::Reshape { .. } | Op::Permute { .. } | Op::Expand { .. }
    ) && live_consumers(x) == 1
        && !is_output[x.index()]
    {
        chain.push(x);
        x = p.node(x).inputs[0];
    }
    if chain.is_empty() || p.node(x).tensor().is_none() {
        return None;
    }
    let shape = p.node(x).tensor()?.shape.clone();
    let strides = contiguous_strides(&shape);
    let (shape, strides) = compose(p, shape, strides, &chain)?;
    Some((
        StridedView {
            base: x,
            shape,
            strides,
        },
        chain,
    ))
}

/// The shape and strides of a value laid out as `(shape, strides)` seen through `chain`
/// (reshapes, permutes and expands, the last applied first); `None` when a reshape would
/// need a copy.
fn compose(
    p: &Program,
    mut shape: Vec<usize>,
    mut strides: Vec<i64>,
    chain: &[NodeId],
) -> Option<(Vec<usize>, Vec<i64>)> {
    for &v in chain.iter().rev() {
        match &p.node(v).op {
            Op::Reshape { shape: to } => {
                strides = reshape_strides(&shape, &strides, to)?;
                shape = to.clone();
            }
            Op::Permute { perm } => {
                shape = perm.iter().map(|&d| shape[d]).collect();
                strides = perm.iter().map(|&d| strides[d]).collect();
            }
            Op::Expand { shape: to } => {
                let off = to.len().checked_sub(shape.len())?;
                let mut st = vec![0i64; to.len()];
                for (d, &s) in shape.iter().enumerate() {
                    st[d + off] = if s == 1 && to[d + off] != 1 {
                        0
                    } else {
                        strides[d]
                    };
                }
                shape = to.clone();
                strides = st;
            }
            _ => return None,
        }
    }
    Some((shape, strides))
}

/// Every view of `base` ([`Fusion::views`]) recomputed for a buffer laid out with element
/// `strides` instead of densely (a [`Siblings::columns`] member: a column slice of one GEMM's
/// output). An error names the consumer whose view the layout does not allow.
pub fn restride(p: &Program, fusion: &mut Fusion, base: NodeId, strides: &[i64]) -> Result<()> {
    let shape = p
        .node(base)
        .tensor()
        .ok_or_else(|| gen_err(base, p, "tuple value"))?
        .shape
        .clone();
    for (&(c, j), view) in fusion.views.iter_mut() {
        if view.base != base {
            continue;
        }
        let mut chain = Vec::new();
        let mut x = p.node(c).inputs[j];
        while x != base {
            chain.push(x);
            x = p.node(x).inputs[0];
        }
        let (sh, st) = compose(p, shape.clone(), strides.to_vec(), &chain)
            .ok_or_else(|| gen_err(c, p, "a column slice its view cannot read"))?;
        view.shape = sh;
        view.strides = st;
    }
    Ok(())
}

/// Linears reading one input, with 16-bit weights (and biases) of one shape and dtype read by
/// them alone: their weights are uploaded side by side and their GEMMs run as one strided batch
/// (`k`/`v` and `gate`/`up` projections: one launch instead of two). Not for f32 weights: on
/// the H200 the batched f32 GEMMs were slower (f32 chunk 143.9 → 146.3 ms), bf16 faster (53.4 →
/// 50.9 ms). cuBLAS may sum a batched GEMM in another order than two single ones, so batched
/// and unbatched bf16 runs differ at bf16's rounding noise (1.1e-2 on full-size actions).
///
/// f32 linears of one shape whose values are only read in place ([`Role::View`] chains into
/// attention operands: SigLIP's q/k/v) may be [`Siblings::columns`] instead (where `in_place`
/// says so; `DeviceProgram` only with `PETITE_CUDA_COLUMNS=1`): one GEMM over their stacked
/// weights writes all their output columns side by side (one wide GEMM fills the GPU where
/// three 768 × 1,152 ones left it half idle), one bias pass, and each linear's value is its
/// column slice, its readers' views restrided ([`restride`]). Opt-in: on the H200 the wide
/// TF32 GEMM kept full-size pi0.5's bits for 0.16 ms a chunk but doubled a golden's bf16 error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Siblings {
    /// The linears, in program order.
    pub linears: Vec<NodeId>,
    /// Their weights, in the same order.
    pub weights: Vec<NodeId>,
    /// Their biases, when they have them.
    pub biases: Option<Vec<NodeId>>,
    /// One GEMM writing `[rows, parts · n]`, each linear's value a column slice (f32 weights
    /// whose values are only read through views), instead of a batch writing `[parts, rows, n]`.
    pub columns: bool,
}

/// Whether every reader of `l`'s value reads it through a view into an attention's operand
/// (whose per-head GEMMs take any row stride), so a column slice can serve as its value.
pub fn read_in_place_by_attentions(
    p: &Program,
    fusion: &Fusion,
    consumers: &[Vec<NodeId>],
    live: &[bool],
    is_output: &[bool],
    l: NodeId,
) -> bool {
    let mut cs = consumers[l.index()]
        .iter()
        .filter(|c| live[c.index()])
        .peekable();
    let mut views = fusion.views.iter().filter(|(_, v)| v.base == l).peekable();
    !is_output[l.index()]
        && cs.peek().is_some()
        && cs.all(|&c| fusion.role[c.index()] == Role::View)
        && views.peek().is_some()
        && views.all(|(&(c, _), _)| matches!(p.node(c).op, Op::Attention { .. }))
}

/// Finds [`Siblings`] among `program`'s live linears; `in_place(l)`: every reader of linear
/// `l`'s value reads it through a view that a column slice's strides can serve.
pub fn siblings(
    program: &Program,
    live: &[bool],
    in_place: &dyn Fn(NodeId) -> bool,
) -> Vec<Siblings> {
    let consumers = program.consumers();
    let only_reader = |w: NodeId, by: NodeId| {
        matches!(program.node(w).op, Op::Weight { .. })
            && consumers[w.index()]
                .iter()
                .all(|&c| c == by || !live[c.index()])
    };
    let mut groups: Vec<(String, Siblings)> = Vec::new();
    for id in program.ids() {
        let node = program.node(id);
        if !live[id.index()] || !matches!(node.op, Op::Linear) {
            continue;
        }
        let (x, w) = (node.inputs[0], node.inputs[1]);
        let b = node.inputs.get(2).copied();
        let wdt = program.node(w).tensor().map(|t| t.dtype);
        let sixteen = matches!(wdt, Some(Dtype::Bf16 | Dtype::F16));
        let columns = wdt == Some(Dtype::F32) && in_place(id);
        if !(sixteen || columns) || !only_reader(w, id) || b.is_some_and(|b| !only_reader(b, id)) {
            continue;
        }
        let ty = |v: NodeId| program.node(v).ty.to_string();
        let key = format!(
            "{x} {} {} {}",
            ty(w),
            b.map(ty).unwrap_or_default(),
            node.ty
        );
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => {
                g.linears.push(id);
                g.weights.push(w);
                if let (Some(bs), Some(b)) = (g.biases.as_mut(), b) {
                    bs.push(b);
                }
            }
            None => groups.push((
                key,
                Siblings {
                    linears: vec![id],
                    weights: vec![w],
                    biases: b.map(|b| vec![b]),
                    columns,
                },
            )),
        }
    }
    groups
        .into_iter()
        .map(|(_, g)| g)
        .filter(|g| g.linears.len() > 1)
        .collect()
}

/// Nodes one group may compute (bounds the generated source).
const MAX_GROUP: usize = 64;

fn fusible(op: &Op) -> bool {
    matches!(
        op,
        Op::Binary { .. }
            | Op::BinaryScalar { .. }
            | Op::Compare { .. }
            | Op::Logical { .. }
            | Op::Not
            | Op::Unary { .. }
            | Op::Cast { .. }
            | Op::Expand { .. }
            | Op::Where
            | Op::Concat { .. }
            | Op::Slice { .. }
            | Op::Permute { .. }
            | Op::Reshape { .. }
    )
}

/// A permute that moves only dims of size 1 (pi0.5's one-KV-head `[1, S, 1, D]` →
/// `[1, 1, S, D]`): the same bytes in the same order, so unfused it is a free view like a
/// reshape instead of a copy (a launch a layer in the step).
pub fn moves_only_unit_dims(p: &Program, id: NodeId) -> bool {
    let Op::Permute { perm } = &p.node(id).op else {
        return false;
    };
    let Some(x) = p.node(p.node(id).inputs[0]).tensor() else {
        return false;
    };
    let kept: Vec<usize> = perm.iter().copied().filter(|&d| x.shape[d] != 1).collect();
    kept.windows(2).all(|w| w[0] < w[1])
}

/// A norm, or a softmax over the last axis: one block a row, loading through the input's dtype.
fn row_kernel(p: &Program, id: NodeId) -> bool {
    let node = p.node(id);
    match node.op {
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => true,
        Op::Softmax { axis } => p
            .node(node.inputs[0])
            .tensor()
            .is_some_and(|t| axis + 1 == t.shape.len()),
        _ => false,
    }
}

/// `(x, mask)` when softmax `sm` reads `x + mask` over `[B, H, Q, K]` (the sum read by it
/// alone, not an output; `x` f32 of that shape, `mask` f32 broadcast to it): what the softmax
/// kernel computes as it loads, in the same f32 arithmetic.
fn masked(
    p: &Program,
    sm: NodeId,
    live_consumers: &dyn Fn(NodeId) -> usize,
    is_output: &[bool],
) -> Option<(NodeId, NodeId)> {
    let add = p.node(sm).inputs[0];
    let node = p.node(add);
    if !matches!(
        node.op,
        Op::Binary {
            kind: petite_graph::BinaryOp::Add
        }
    ) || live_consumers(add) != 1
        || is_output[add.index()]
    {
        return None;
    }
    let out = node.tensor()?;
    if out.shape.len() != 4 || out.dtype != Dtype::F32 {
        return None;
    }
    let full = |v: NodeId| p.node(v).tensor().is_some_and(|t| t.shape == out.shape);
    let mask = |v: NodeId| {
        p.node(v).tensor().is_some_and(|t| {
            t.dtype == Dtype::F32
                && t.shape.len() <= 4
                && t.shape
                    .iter()
                    .rev()
                    .zip(out.shape.iter().rev())
                    .all(|(&m, &o)| m == o || m == 1)
        })
    };
    let (a, b) = (node.inputs[0], node.inputs[1]);
    if full(a) && mask(b) {
        Some((a, b))
    } else if full(b) && mask(a) {
        Some((b, a))
    } else {
        None
    }
}

/// `(x, s, dtype)` when `v = x · s` (a scalar multiply) in a 16-bit float dtype, read by one
/// live node and not an output; `s` rounded to that dtype as the fused kernel rounds it.
fn scaled(
    p: &Program,
    v: NodeId,
    live_consumers: &dyn Fn(NodeId) -> usize,
    is_output: &[bool],
) -> Option<(NodeId, f32, Dtype)> {
    let node = p.node(v);
    let Op::BinaryScalar {
        kind: petite_graph::BinaryOp::Mul,
        scalar,
        ..
    } = node.op
    else {
        return None;
    };
    let d = node.tensor()?.dtype;
    let x = node.inputs[0];
    if p.node(x).tensor()?.dtype != d || live_consumers(v) != 1 || is_output[v.index()] {
        return None;
    }
    let s = match d {
        Dtype::Bf16 => petite_dtype::round_through_bf16(scalar as f32),
        Dtype::F16 => half::f16::from_f32(scalar as f32).to_f32(),
        _ => return None,
    };
    Some((x, s, d))
}

/// `v` read whole (its own shape, contiguous).
fn whole(p: &Program, v: NodeId) -> StridedView {
    let shape = p
        .node(v)
        .tensor()
        .map(|t| t.shape.clone())
        .unwrap_or_default();
    StridedView {
        base: v,
        strides: contiguous_strides(&shape),
        shape,
    }
}

/// `x` as an in-place read of its input when `x` is a widening cast (bf16/f16 → f32) read by
/// one live node and not a program output.
fn widened(
    p: &Program,
    x: NodeId,
    live_consumers: &dyn Fn(NodeId) -> usize,
    is_output: &[bool],
) -> Option<StridedView> {
    let node = p.node(x);
    let Op::Cast { to: Dtype::F32 } = node.op else {
        return None;
    };
    let base = node.inputs[0];
    let from = p.node(base).tensor()?.dtype;
    if !matches!(from, Dtype::Bf16 | Dtype::F16) || live_consumers(x) != 1 || is_output[x.index()] {
        return None;
    }
    let shape = node.tensor()?.shape.clone();
    Some(StridedView {
        base,
        strides: contiguous_strides(&shape),
        shape,
    })
}

/// The [`Attend`] that matmul `pv` computes, if it is the `p·v` of a bf16 attention chain of
/// at most `max_q` queries whose operands the kernels can read
/// ([`crate::plan::attention_dims_fit`], [`crate::plan::attention_strides_fit`]), and
/// `[softmax, cast]` of that chain.
#[allow(clippy::too_many_arguments)]
fn attend(
    p: &Program,
    pv: NodeId,
    role: &[Role],
    views: &HashMap<(NodeId, usize), StridedView>,
    masks: &HashMap<NodeId, Folded>,
    runs_input: &[bool],
    live_consumers: &dyn Fn(NodeId) -> usize,
    is_output: &[bool],
    max_q: usize,
) -> Option<(Attend, [NodeId; 2])> {
    let bf16 = |v: NodeId| p.node(v).tensor().is_some_and(|t| t.dtype == Dtype::Bf16);
    let single = |v: NodeId| live_consumers(v) == 1 && !is_output[v.index()];
    if !matches!(p.node(pv).op, Op::MatMul) {
        return None;
    }
    let cast = p.node(pv).inputs[0];
    if !bf16(pv)
        || !matches!(p.node(cast).op, Op::Cast { to: Dtype::Bf16 })
        || !runs_input[cast.index()]
        || !single(cast)
    {
        return None;
    }
    let sm = p.node(cast).inputs[0];
    let folded = masks.get(&sm)?;
    let logits = views.get(&(sm, 0))?.base;
    if role[sm.index()] != Role::Narrowed
        || !matches!(p.node(logits).op, Op::MatMul)
        || role[logits.index()] != Role::Plain
        || !single(logits)
        || !bf16(logits)
        || folded.scale.is_some_and(|(_, d)| d != Dtype::Bf16)
    {
        return None;
    }
    let operand = |m: NodeId, j: usize| {
        views
            .get(&(m, j))
            .cloned()
            .unwrap_or_else(|| whole(p, p.node(m).inputs[j]))
    };
    let (q, k, v) = (operand(logits, 0), operand(logits, 1), operand(pv, 1));
    if ![&q, &k, &v]
        .iter()
        .all(|o| o.shape.len() == 4 && bf16(o.base))
    {
        return None;
    }
    let (b, h, nq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
    let nk = k.shape[3];
    let ok = k.shape[..3] == [b, h, d]
        && v.shape[..3] == [b, h, nk]
        && crate::plan::attention_strides_fit(&q.strides, &k.strides, &v.strides)
        && crate::plan::attention_dims_fit(d, v.shape[3])
        && nk > 0
        && nq > 0
        && nq <= max_q;
    if !ok {
        return None;
    }
    // K and v each a key-axis concat of two bf16 pieces, read by its view chain alone, split at
    // the same key: the kernels read the pieces.
    let halves = |o: &StridedView| -> Option<(NodeId, NodeId, usize)> {
        let node = p.node(o.base);
        let Op::Concat { axis: 2 } = node.op else {
            return None;
        };
        let t = node.tensor()?;
        let dense = |v: NodeId| {
            p.node(v)
                .tensor()
                .is_some_and(|x| x.shape.len() == 4 && x.dtype == Dtype::Bf16)
        };
        (node.inputs.len() == 2
            && single(o.base)
            && role[o.base.index()] == Role::Plain
            && t.shape.len() == 4
            && node.inputs.iter().all(|&v| dense(v)))
        .then(|| {
            let n0 = p.node(node.inputs[0]).tensor().map_or(0, |x| x.shape[2]);
            (node.inputs[0], node.inputs[1], n0)
        })
    };
    let pieces = match (halves(&k), halves(&v)) {
        (Some((k0, k1, n)), Some((v0, v1, m))) if n == m && n > 0 && n < nk => {
            Some(([k0, k1, v0, v1], n))
        }
        _ => None,
    };
    Some((
        Attend {
            logits,
            q,
            k,
            v,
            mask: folded.mask,
            scale: folded.scale,
            pieces,
        },
        [sm, cast],
    ))
}

/// How [`plan_opts`] fuses: the defaults, each switch there to compare against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// bf16 attentions of up to this many queries run as the fused attention kernels
    /// ([`Attend`]; 0: none, as on GPUs without bf16 tensor-core `mma`, before sm_80).
    pub attention_queries: usize,
    /// Two independent groups with only products between them share a launch
    /// ([`Group::with`]); `PETITE_CUDA_NO_PAIR=1` turns it off at load.
    pub pairs: bool,
    /// Slice starts are kernel parameters ([`Group::offsets`]); `PETITE_CUDA_NO_OFFSETS=1`
    /// bakes them in as literals (one kernel a distinct set).
    pub offset_params: bool,
    /// A prologue kernel's row loops take four elements a trip ([`rows_unrolled`]) and its
    /// statistics four loads at a time (`norm_stats4`): the same bits. Opt-in,
    /// `PETITE_CUDA_UNROLL_ROWS=1`, until measured on a GPU.
    pub unrolled_rows: bool,
}

impl Options {
    /// The defaults, fusing bf16 attentions of up to `attention_queries` queries.
    pub fn new(attention_queries: usize) -> Self {
        Options {
            attention_queries,
            pairs: true,
            offset_params: true,
            unrolled_rows: false,
        }
    }

    /// [`Options::new`] with the `PETITE_CUDA_*` switches of this process applied.
    pub fn from_env(attention_queries: usize) -> Self {
        let set = |v: &str| std::env::var_os(v).is_some();
        Options {
            attention_queries,
            pairs: !set("PETITE_CUDA_NO_PAIR"),
            offset_params: !set("PETITE_CUDA_NO_OFFSETS"),
            unrolled_rows: std::env::var_os("PETITE_CUDA_UNROLL_ROWS").is_some_and(|v| v == "1"),
        }
    }
}

/// Plans the fusion of `program`'s `live` nodes; `is_output` marks program outputs (always
/// materialized). bf16 attentions are fused as on an sm_90 device
/// ([`fused_attention_queries`]).
pub fn plan(program: &Program, live: &[bool], is_output: &[bool]) -> Result<Fusion> {
    plan_with(program, live, is_output, fused_attention_queries((9, 0)))
}

/// [`plan`], fusing bf16 attentions of up to `attention_queries` queries ([`Attend`]; 0: none,
/// as on GPUs without bf16 tensor-core `mma`, before sm_80).
pub fn plan_with(
    program: &Program,
    live: &[bool],
    is_output: &[bool],
    attention_queries: usize,
) -> Result<Fusion> {
    plan_opts(program, live, is_output, Options::new(attention_queries))
}

/// [`plan_opts`] of a whole program: every output's ancestor live, its outputs materialized
/// (as [`crate::DeviceProgram::load`] plans it).
pub fn plan_program(program: &Program, options: Options) -> Result<Fusion> {
    let roots: Vec<NodeId> = program.outputs.iter().map(|o| o.value).collect();
    let live = program.ancestors(&roots);
    let mut is_output = vec![false; program.len()];
    for &r in &roots {
        is_output[r.index()] = true;
    }
    plan_opts(program, &live, &is_output, options)
}

/// [`plan`] with `options`.
pub fn plan_opts(
    program: &Program,
    live: &[bool],
    is_output: &[bool],
    options: Options,
) -> Result<Fusion> {
    let Options {
        attention_queries,
        pairs,
        offset_params,
        unrolled_rows,
    } = options;
    let order = program.topo_order()?;
    let consumers = program.consumers();
    let n = program.len();
    let mut group_of: Vec<Option<usize>> = vec![None; n];
    let mut size: Vec<usize> = Vec::new();
    let mut roots: Vec<NodeId> = Vec::new();
    let mut role = vec![Role::Plain; n];
    let live_consumers = |v: NodeId| {
        let mut cs: Vec<NodeId> = consumers[v.index()]
            .iter()
            .copied()
            .filter(|c| live[c.index()])
            .collect();
        cs.sort();
        cs.dedup();
        cs.len()
    };
    let mut views = HashMap::new();
    for &id in &order {
        let operands = match program.node(id).op {
            Op::MatMul => 2,
            Op::Attention { .. } => 3,
            _ => 0,
        };
        if !live[id.index()] || operands == 0 {
            continue;
        }
        for j in 0..operands {
            // Attention reads q, k and v as row-major `[S, D]` blocks a head.
            if let Some((v, chain)) = operand_view(program, id, j, &live_consumers, is_output)
                && crate::plan::MatOperand::from_view(&v.shape, &v.strides)
                    .is_ok_and(|m| operands == 2 || (v.shape.len() == 4 && m.col_stride == 1))
            {
                for c in chain {
                    role[c.index()] = Role::View;
                }
                views.insert((id, j), v);
            }
        }
    }
    // Row kernels (norms, last-axis softmax) load their input through its dtype and compute in
    // f32, so a widening cast (bf16/f16 → f32, exact) that feeds only one is read in place; and
    // a softmax read only by a narrowing cast is run by that cast, writing its dtype.
    let mut runs_input = vec![false; n];
    let mut masks = HashMap::new();
    for &id in &order {
        let i = id.index();
        if !live[i] || !row_kernel(program, id) {
            continue;
        }
        let mut x = program.node(id).inputs[0];
        let mut folded = None;
        if let Some((a, m)) = masked(program, id, &live_consumers, is_output)
            && role[m.index()] != Role::View
        {
            role[x.index()] = Role::View;
            views.insert((id, 0), whole(program, a));
            folded = Some(Folded {
                mask: m,
                scale: None,
            });
            x = a;
        }
        if role[x.index()] == Role::Plain
            && let Some(v) = widened(program, x, &live_consumers, is_output)
        {
            role[x.index()] = Role::View;
            let base = v.base;
            views.insert((id, 0), v);
            // Under a folded mask, a 16-bit scaling of the widened value folds in too.
            if let Some(f) = &mut folded
                && let Some((src, s, d)) = scaled(program, base, &live_consumers, is_output)
            {
                role[base.index()] = Role::View;
                views.insert((id, 0), whole(program, src));
                f.scale = Some((s, d));
            }
        }
        if let Some(f) = folded {
            masks.insert(id, f);
        }
        if matches!(program.node(id).op, Op::Softmax { .. })
            && !is_output[i]
            && live_consumers(id) == 1
            && let Some(&c) = consumers[i].iter().find(|c| live[c.index()])
            && matches!(program.node(c).op, Op::Cast { to } if to.is_float())
        {
            role[i] = Role::Narrowed;
            runs_input[c.index()] = true;
        }
    }
    // A head-merging permute of a matmul's or attention's result is written by their GEMM.
    for &id in &order {
        let i = id.index();
        if !live[i]
            || role[i] != Role::Plain
            || !matches!(&program.node(id).op, Op::Permute { perm } if perm == &[0, 2, 1, 3])
        {
            continue;
        }
        let m = program.node(id).inputs[0];
        let producer = program.node(m);
        if matches!(producer.op, Op::MatMul | Op::Attention { .. })
            && role[m.index()] == Role::Plain
            && live_consumers(m) == 1
            && !is_output[m.index()]
            && producer.tensor().is_some_and(|t| {
                // Attention steps through B itself; a matmul's GEMM batches heads only.
                t.shape.len() == 4
                    && (t.shape[0] == 1 || matches!(producer.op, Op::Attention { .. }))
            })
        {
            role[m.index()] = Role::Transposed;
            runs_input[i] = true;
        }
    }
    let mut attentions = HashMap::new();
    for &id in &order {
        if !live[id.index()] || !matches!(role[id.index()], Role::Plain | Role::Transposed) {
            continue;
        }
        if let Some((a, [sm, cast])) = attend(
            program,
            id,
            &role,
            &views,
            &masks,
            &runs_input,
            &live_consumers,
            is_output,
            attention_queries,
        ) {
            for n in [a.logits, sm, cast] {
                role[n.index()] = Role::Attended;
            }
            if a.pieces.is_some() {
                for concat in [a.k.base, a.v.base] {
                    role[concat.index()] = Role::Attended;
                }
            }
            attentions.insert(id, a);
        }
    }
    for &id in order.iter().rev() {
        let i = id.index();
        let node = program.node(id);
        if !live[i]
            || !fusible(&node.op)
            || node.tensor().is_none()
            || role[i] == Role::View
            || role[i] == Role::Attended
            || runs_input[i]
        {
            continue;
        }
        let mut cs: Vec<NodeId> = consumers[i]
            .iter()
            .copied()
            .filter(|c| live[c.index()])
            .collect();
        cs.sort();
        cs.dedup();
        let joined = if is_output[i] || cs.is_empty() {
            None
        } else {
            let g = group_of[cs[0].index()];
            match g {
                Some(g)
                    if cs.iter().all(|c| group_of[c.index()] == Some(g)) && size[g] < MAX_GROUP =>
                {
                    Some(g)
                }
                _ => None,
            }
        };
        match joined {
            Some(g) => {
                group_of[i] = Some(g);
                size[g] += 1;
                role[i] = Role::Inlined;
            }
            None if matches!(node.op, Op::Reshape { .. }) || moves_only_unit_dims(program, id) => {}
            None => {
                let g = roots.len();
                roots.push(id);
                size.push(1);
                group_of[i] = Some(g);
                role[i] = Role::Root(g);
            }
        }
    }
    // An f32 linear with a bias, read by one fused group alone, has the bias added there.
    let mut biases = HashMap::new();
    for &id in &order {
        let i = id.index();
        let node = program.node(id);
        let f32_of = |v: NodeId| {
            program
                .node(v)
                .tensor()
                .is_some_and(|t| t.dtype == Dtype::F32)
        };
        if !live[i]
            || role[i] != Role::Plain
            || is_output[i]
            || !matches!(node.op, Op::Linear)
            || node.inputs.len() != 3
            || !f32_of(id)
            || !f32_of(node.inputs[1])
        {
            continue;
        }
        let mut cs = consumers[i].iter().filter(|c| live[c.index()]);
        let Some(g) = cs.next().and_then(|c| group_of[c.index()]) else {
            continue;
        };
        if cs.all(|c| group_of[c.index()] == Some(g)) {
            biases.insert(id, node.inputs[2]);
        }
    }
    // A norm read only inside one group of its own shape is that group's prologue.
    let mut prologue_of: Vec<Option<NodeId>> = vec![None; roots.len()];
    for &id in &order {
        let i = id.index();
        if !live[i]
            || role[i] != Role::Plain
            || is_output[i]
            || !matches!(
                program.node(id).op,
                Op::LayerNorm { .. } | Op::RmsNorm { .. }
            )
        {
            continue;
        }
        let mut cs = consumers[i].iter().filter(|c| live[c.index()]);
        let Some(g) = cs.next().and_then(|c| group_of[c.index()]) else {
            continue;
        };
        if cs.all(|c| group_of[c.index()] == Some(g))
            && prologue_of[g].is_none()
            && program.node(roots[g]).tensor().map(|t| &t.shape)
                == program.node(id).tensor().map(|t| &t.shape)
        {
            prologue_of[g] = Some(id);
        }
    }
    // A norm left a kernel of its own whose input is a fused group's value (the prefix's
    // residual sums) roots a group of its own, the norm its prologue and nothing after it, so
    // that the sum can be computed first by its kernel (below): the same `norm_stats` and
    // `norm_elem` as `pt_norm`, stored in the norm's dtype, so the same bits.
    let taken: Vec<NodeId> = prologue_of.iter().flatten().copied().collect();
    for &id in &order {
        let i = id.index();
        if !live[i]
            || role[i] != Role::Plain
            || taken.contains(&id)
            || !matches!(
                program.node(id).op,
                Op::LayerNorm { .. } | Op::RmsNorm { .. }
            )
        {
            continue;
        }
        let x = read_from(program, &views, id, 0);
        if matches!(role[x.index()], Role::Root(_)) {
            let g = roots.len();
            roots.push(id);
            size.push(1);
            group_of[i] = Some(g);
            role[i] = Role::Root(g);
            prologue_of.push(Some(id));
        }
    }
    let mut source = fused_prelude();
    let mut kernels: Vec<String> = Vec::new();
    let mut by_body: HashMap<String, usize> = HashMap::new();
    let mut generated = Vec::with_capacity(roots.len());
    for g in 0..roots.len() {
        let generate = |prologue: Option<NodeId>| {
            let mut cg = Gen {
                program,
                group: g,
                group_of: &group_of,
                body: String::new(),
                memo: HashMap::new(),
                leaves: Vec::new(),
                vars: 0,
                prologue,
                root_coords: Vec::new(),
                biases: &biases,
                offsets: Vec::new(),
                offset_params,
                unrolled_rows,
                views: &views,
            };
            cg.kernel_body(roots[g]).map(|body| Generated {
                body,
                leaves: cg.leaves,
                prologue,
                offsets: cg.offsets,
            })
        };
        // A prologue read anywhere but at its own element falls back to a plain group.
        let x = match prologue_of[g].map(|n| generate(Some(n))) {
            Some(Ok(x)) => x,
            _ => generate(None)?,
        };
        if let Some(n) = x.prologue
            && n != roots[g]
        {
            role[n.index()] = Role::Prologue;
        }
        generated.push(x);
    }
    // A group whose root is only the input of another group's prologue norm (and read after
    // that group) is computed by that group's kernel, row by row, before the norm's statistics.
    let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(k, &v)| (v, k)).collect();
    let mut first: Vec<Option<usize>> = vec![None; roots.len()];
    let mut absorbed = vec![false; roots.len()];
    for g in 0..roots.len() {
        let Some(n) = generated[g].prologue else {
            continue;
        };
        let x = read_from(program, &views, n, 0);
        let Role::Root(r) = role[x.index()] else {
            continue;
        };
        let numel = |v: NodeId| program.node(v).tensor().map(|t| t.numel());
        let after = consumers[x.index()].iter().all(|&c| {
            !live[c.index()] || c == n || role[c.index()] == Role::View || pos[&c] > pos[&roots[g]]
        });
        if r != g
            && generated[r].prologue.is_none()
            && !absorbed[r]
            && first[r].is_none()
            && numel(x) == numel(roots[g])
            && !generated[g].leaves.contains(&x)
            && after
        {
            first[g] = Some(r);
            absorbed[r] = true;
        }
    }
    // Each group's body (with its first, unrolled where it pays) and its launch's blocks.
    let mut bodies = Vec::with_capacity(roots.len());
    for (g, &root) in roots.iter().enumerate() {
        let (mut body, prologue) = (generated[g].body.clone(), generated[g].prologue);
        if let Some(r) = first[g] {
            body = with_first(&body, &generated[r].body).ok_or_else(|| {
                gen_err(root, program, "a prologue kernel without its statistics")
            })?;
        }
        let numel: usize = program
            .node(root)
            .tensor()
            .map_or(0, |t| t.shape.iter().product());
        let (body, unroll) = match (prologue, numel >= UNROLL_FROM) {
            (None, true) => unrolled(&body).map_or((body, 1), |b| (b, UNROLL)),
            (Some(_), _) if unrolled_rows => (rows_unrolled(&body), 1),
            _ => (body, 1),
        };
        let blocks = crate::plan::grid_for(numel.div_ceil(unroll));
        bodies.push((body, unroll, blocks));
    }
    // Two plain groups launched one after the other (only products between them), the second
    // not reading the first, whose value nothing reads before the second: one launch, the
    // first's elements on blocks after the second's ([`Group::with`]). pi0.5's q and k RoPEs.
    let mut with: Vec<Option<usize>> = vec![None; roots.len()];
    let plain = |g: usize, absorbed: &[bool]| {
        generated[g].prologue.is_none() && first[g].is_none() && !absorbed[g]
    };
    let mut open: Option<usize> = None;
    for &id in &order {
        let Role::Root(g) = role[id.index()] else {
            continue;
        };
        if !live[id.index()] || absorbed[g] {
            continue;
        }
        let pair = open.filter(|&a| {
            // The first's value and the free views of it (reshapes, unit-dim permutes: they
            // only alias its buffer): none read by the second, none read before it.
            let mut aliases = vec![roots[a]];
            let mut k = 0;
            while k < aliases.len() {
                for &c in &consumers[aliases[k].index()] {
                    let free = role[c.index()] == Role::Plain
                        && (matches!(program.node(c).op, Op::Reshape { .. })
                            || moves_only_unit_dims(program, c));
                    if live[c.index()] && free && !aliases.contains(&c) {
                        aliases.push(c);
                    }
                }
                k += 1;
            }
            pairs
                && plain(g, &absorbed)
                && aliases.iter().all(|&v| {
                    !generated[g].leaves.contains(&v)
                        && consumers[v.index()]
                            .iter()
                            .all(|c| !live[c.index()] || aliases.contains(c) || pos[c] > pos[&id])
                })
        });
        match pair {
            Some(a) => {
                with[g] = Some(a);
                absorbed[a] = true;
                open = None;
            }
            None => open = plain(g, &absorbed).then_some(g),
        }
    }
    let mut groups = Vec::with_capacity(roots.len());
    for (g, &root) in roots.iter().enumerate() {
        let Generated {
            leaves,
            prologue,
            offsets,
            ..
        } = generated[g].clone();
        let (mut body, unroll, mut blocks) = bodies[g].clone();
        let mut extra = String::new();
        // The offsets follow every pointer: the group's own (`s…`), then the other's (`t…`).
        let mut offs: String = (0..offsets.len()).map(|j| format!(", i64 s{j}")).collect();
        if let Some(o) = first[g].or(with[g]) {
            for j in 0..generated[o].offsets.len() {
                let _ = write!(offs, ", i64 t{j}");
            }
        }
        if let Some(r) = first[g] {
            for j in 0..generated[r].leaves.len() {
                let _ = write!(extra, ", const void* q{j}");
            }
            extra.push_str(", void* qo");
        }
        if let Some(a) = with[g] {
            let (ga, gb) = (bodies[a].2, blocks);
            body = beside(&body, gb, &bodies[a].0, ga);
            blocks = ga + gb;
            extra.push_str(", i64 qn");
            for j in 0..generated[a].leaves.len() {
                let _ = write!(extra, ", const void* q{j}");
            }
            extra.push_str(", void* qo");
        }
        let params: String = (0..leaves.len())
            .map(|j| format!(", const void* p{j}"))
            .collect();
        let norm = if prologue.is_some() {
            "NormParams np, const void* nx, const void* nw, const void* nb, "
        } else {
            ""
        };
        // The kernel's text but for its name: groups whose texts are equal share one kernel.
        let text =
            format!("({norm}i64 n{params}, void* po{extra}{offs}) {{\n  PT_PDL();\n{body}}}\n");
        let k = match by_body.get(&text) {
            _ if absorbed[g] => None,
            Some(&k) => Some(k),
            None => {
                let k = kernels.len();
                let name = format!("pt_fused_{k}");
                let _ = write!(source, "extern \"C\" __global__ void {name}{text}");
                kernels.push(name);
                by_body.insert(text, k);
                Some(k)
            }
        };
        groups.push(Group {
            root,
            kernel: k,
            leaves,
            nodes: size[g],
            prologue,
            unroll,
            blocks,
            first: first[g],
            with: with[g],
            absorbed: absorbed[g],
            offsets,
        });
    }
    let attention_kernels = (!attentions.is_empty()).then(|| {
        let at = kernels.len();
        kernels.extend(crate::source::ATTENTION_KERNELS.map(String::from));
        [at, at + 1, at + 2]
    });
    Ok(Fusion {
        role,
        groups,
        kernels,
        source,
        views,
        masks,
        attentions,
        biases,
        attention_kernels,
    })
}

/// One group's generated kernel body and what its launch passes: the values it reads (in
/// parameter order), the prologue norm it computes (if any) and its slice starts.
#[derive(Clone)]
struct Generated {
    body: String,
    leaves: Vec<NodeId>,
    prologue: Option<NodeId>,
    offsets: Vec<i64>,
}

/// C type of a value held in registers: floats as `float` (already rounded to their dtype),
/// integers and bools as `i64` (the stored value).
fn is_f(d: Dtype) -> bool {
    d.is_float()
}

fn dt_macro(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "DT_F32",
        Dtype::Bf16 => "DT_BF16",
        Dtype::F16 => "DT_F16",
        Dtype::I64 => "DT_I64",
        Dtype::I32 => "DT_I32",
        Dtype::U8 => "DT_U8",
        Dtype::Bool => "DT_BOOL",
    }
}

/// `ldf` of a register value of dtype `d`.
fn as_f(v: &str, d: Dtype) -> String {
    if is_f(d) {
        v.to_string()
    } else {
        format!("((float){v})")
    }
}

/// `ldi` of a register value of dtype `d`.
fn as_i(v: &str, d: Dtype) -> String {
    if is_f(d) {
        format!("((i64){v})")
    } else {
        v.to_string()
    }
}

/// The register value `stf(out, d, x)` then `ldf`/`ldi` would give.
fn store_f(x: &str, d: Dtype) -> String {
    match d {
        Dtype::F32 => format!("({x})"),
        Dtype::Bf16 => format!("bf2f(f2bf({x}))"),
        Dtype::F16 => format!("h2f(f2h({x}))"),
        Dtype::I64 => format!("((i64)({x}))"),
        Dtype::I32 => format!("((i64)(int)(i64)({x}))"),
        Dtype::U8 => format!("((i64)(unsigned char)(i64)({x}))"),
        Dtype::Bool => format!("((({x}) != 0.0f) ? 1LL : 0LL)"),
    }
}

/// The register value `sti(out, d, x)` then `ldf`/`ldi` would give.
fn store_i(x: &str, d: Dtype) -> String {
    match d {
        Dtype::F32 => format!("((float)({x}))"),
        Dtype::Bf16 => format!("bf2f(f2bf((float)({x})))"),
        Dtype::F16 => format!("h2f(f2h((float)({x})))"),
        Dtype::I64 => format!("({x})"),
        Dtype::I32 => format!("((i64)(int)({x}))"),
        Dtype::U8 => format!("((i64)(unsigned char)({x}))"),
        Dtype::Bool => format!("((({x}) != 0) ? 1LL : 0LL)"),
    }
}

/// The C type and literal suffix for index arithmetic over a value of `numel` elements: 32-bit
/// below 2³¹ elements, else 64-bit.
fn index_type(numel: usize) -> (&'static str, &'static str) {
    if numel < (1 << 31) {
        ("unsigned", "u")
    } else {
        ("i64", "LL")
    }
}

/// An f32 literal with these exact bits.
fn f32_lit(x: f32) -> String {
    format!("__uint_as_float({:#010x}u)", x.to_bits())
}

/// Coordinates of an input broadcast (numpy, right-aligned) to coordinates `c` of the output.
fn broadcast(c: &[String], in_shape: &[usize]) -> Vec<String> {
    let off = c.len() - in_shape.len();
    in_shape
        .iter()
        .enumerate()
        .map(|(j, &s)| {
            if s == 1 {
                "0".to_string()
            } else {
                c[j + off].clone()
            }
        })
        .collect()
}

struct Gen<'a> {
    program: &'a Program,
    group: usize,
    group_of: &'a [Option<usize>],
    body: String,
    memo: HashMap<(NodeId, Vec<String>), String>,
    leaves: Vec<NodeId>,
    vars: usize,
    /// The norm computed in the kernel's header ([`Role::Prologue`]), held in `nv`.
    prologue: Option<NodeId>,
    /// The root's coordinates: where the prologue may be read.
    root_coords: Vec<String>,
    /// Linears whose bias is added as they are loaded ([`Fusion::biases`]).
    biases: &'a HashMap<NodeId, NodeId>,
    /// Non-zero slice starts read as parameters `s0…` ([`Group::offsets`]); one a value, so
    /// equal starts give equal expressions (and shared loads) as literals would.
    offsets: Vec<i64>,
    /// Starts as parameters; else as literals (`PETITE_CUDA_NO_OFFSETS=1`, and the check that
    /// both forms are the same code).
    offset_params: bool,
    /// The prologue's statistics by `norm_stats4` ([`Options::unrolled_rows`]).
    unrolled_rows: bool,
    /// Operands read in place ([`Fusion::views`]): where the prologue norm reads its input.
    views: &'a HashMap<(NodeId, usize), StridedView>,
}

fn gen_err(id: NodeId, p: &Program, msg: impl std::fmt::Display) -> Error {
    Error::Node {
        node: p.describe(id),
        message: format!("fusion: {msg}"),
    }
}

impl Gen<'_> {
    fn var(&mut self) -> String {
        self.vars += 1;
        format!("v{}", self.vars)
    }

    fn ctype(d: Dtype) -> &'static str {
        if is_f(d) { "float" } else { "i64" }
    }

    /// Slice start `s` (non-zero) as the kernel reads it: a parameter, or a literal.
    fn start(&mut self, s: i64) -> String {
        if !self.offset_params {
            return format!("{s}LL");
        }
        let j = match self.offsets.iter().position(|&o| o == s) {
            Some(j) => j,
            None => {
                self.offsets.push(s);
                self.offsets.len() - 1
            }
        };
        format!("s{j}")
    }

    fn kernel_body(&mut self, root: NodeId) -> Result<String> {
        let t = self
            .program
            .node(root)
            .tensor()
            .ok_or_else(|| gen_err(root, self.program, "tuple result"))?
            .clone();
        let r = t.shape.len();
        let mut coords = Vec::with_capacity(r);
        match self.prologue {
            Some(norm) => {
                // One block a row of the norm: its statistics, then each element normalized as
                // `pt_norm` stores it (rounded to the norm's dtype) and run through the group.
                let d = self
                    .program
                    .node(norm)
                    .tensor()
                    .ok_or_else(|| gen_err(norm, self.program, "tuple norm"))?
                    .dtype;
                // With unrolled rows, the statistics and the element formula for the operands'
                // dtypes (`np.dx`, `dw`, `db` at launch: each view's base where read in place)
                // and the norm's kind, known here.
                let node = self.program.node(norm);
                let mut dts = Vec::with_capacity(3);
                for j in 0..node.inputs.len() {
                    let v = read_from(self.program, self.views, norm, j);
                    let t = self
                        .program
                        .node(v)
                        .tensor()
                        .ok_or_else(|| gen_err(norm, self.program, "tuple norm operand"))?;
                    dts.push(t.dtype);
                }
                let kind = match node.op {
                    Op::LayerNorm { .. } => 0,
                    _ => 1,
                };
                let known = |k: usize| dts.get(k).map_or("-1", |&t| dt_macro(t));
                let floats = dts
                    .iter()
                    .all(|t| matches!(t, Dtype::F32 | Dtype::Bf16 | Dtype::F16));
                let (stats, elem) = if self.unrolled_rows && floats && !dts.is_empty() {
                    (
                        format!("norm_stats4<{}, {kind}>", known(0)),
                        format!(
                            "norm_elem4<{}, {kind}, {}, {}>",
                            known(0),
                            known(1),
                            known(2)
                        ),
                    )
                } else {
                    ("norm_stats".to_string(), "norm_elem".to_string())
                };
                let y = store_f(&format!("{elem}(np, nx, nw, nb, base, jj, nm, nr)"), d);
                let _ = writeln!(
                    self.body,
                    "  __shared__ double shd[32];\n  const i64 row = blockIdx.x;\n  if (row >= np.rows) return;\n  const i64 base = row * np.d;\n  float nm, nr;\n  {stats}(np, nx, base, shd, &nm, &nr);\n  for (i64 jj = threadIdx.x; jj < np.d; jj += blockDim.x) {{\n    const i64 i = base + jj;\n    const float nv = {y};"
                );
            }
            None => {
                let _ = writeln!(
                    self.body,
                    "  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {{"
                );
            }
        }
        // Coordinates by 32-bit division where the value has fewer than 2³¹ elements (a 64-bit
        // division by a constant takes several 64-bit multiplies); every later use widens them
        // to i64.
        let (ity, suf) = index_type(t.shape.iter().product());
        let _ = writeln!(self.body, "    {ity} r = ({ity})i;");
        for d in (0..r).rev() {
            let s = t.shape[d];
            if s == 1 {
                coords.push("0".to_string());
            } else {
                let _ = writeln!(self.body, "    {ity} c{d} = r % {s}{suf}; r /= {s}{suf};");
                coords.push(format!("c{d}"));
            }
        }
        coords.reverse();
        self.root_coords = coords.clone();
        let v = self.value(root, &coords)?;
        let store = match t.dtype {
            Dtype::F32 => format!("((float*)po)[i] = {v};"),
            Dtype::Bf16 => format!("((unsigned short*)po)[i] = f2bf({v});"),
            Dtype::F16 => format!("((unsigned short*)po)[i] = f2h({v});"),
            Dtype::I64 => format!("((i64*)po)[i] = {v};"),
            Dtype::I32 => format!("((int*)po)[i] = (int){v};"),
            Dtype::U8 | Dtype::Bool => format!("((unsigned char*)po)[i] = (unsigned char){v};"),
        };
        let _ = writeln!(self.body, "    {store}\n  }}");
        Ok(std::mem::take(&mut self.body))
    }

    fn emit(&mut self, ty: &str, expr: String) -> String {
        let v = self.var();
        let _ = writeln!(self.body, "    {ty} {v} = {expr};");
        v
    }

    /// The register holding `id`'s value at coordinates `c` (C expressions).
    fn value(&mut self, id: NodeId, c: &[String]) -> Result<String> {
        let key = (id, c.to_vec());
        if let Some(v) = self.memo.get(&key) {
            return Ok(v.clone());
        }
        let p = self.program;
        let node = p.node(id);
        let t = node
            .tensor()
            .ok_or_else(|| gen_err(id, p, "tuple value"))?
            .clone();
        let dt = t.dtype;
        if Some(id) == self.prologue {
            return if c == self.root_coords.as_slice() {
                Ok("nv".to_string())
            } else {
                Err(gen_err(id, p, "a prologue norm read off its own element"))
            };
        }
        let v = if self.group_of[id.index()] != Some(self.group) {
            // A materialized value: load it (dense, row-major).
            let j = match self.leaves.iter().position(|&l| l == id) {
                Some(j) => j,
                None => {
                    self.leaves.push(id);
                    self.leaves.len() - 1
                }
            };
            let st = contiguous_strides(&t.shape);
            let mut idx = String::from("0");
            for (d, cd) in c.iter().enumerate() {
                if cd != "0" && t.shape[d] != 1 {
                    let _ = write!(idx, " + {cd} * {}LL", st[d]);
                }
            }
            let load = if is_f(dt) {
                format!("ldf(p{j}, {idx}, {})", dt_macro(dt))
            } else {
                format!("ldi(p{j}, {idx}, {})", dt_macro(dt))
            };
            let v = self.emit(Self::ctype(dt), load);
            match self.biases.get(&id) {
                // The linear's f32 product plus its bias, one f32 add as `pt_bias` does.
                Some(&b) => {
                    let bt = p
                        .node(b)
                        .tensor()
                        .ok_or_else(|| gen_err(b, p, "tuple bias"))?
                        .shape
                        .clone();
                    let bv = self.value(b, &broadcast(c, &bt))?;
                    self.emit("float", format!("{v} + {bv}"))
                }
                None => v,
            }
        } else {
            self.op_value(id, c, dt)?
        };
        self.memo.insert(key, v.clone());
        Ok(v)
    }

    fn input(&mut self, id: NodeId, k: usize, c: &[String]) -> Result<(String, Dtype)> {
        let p = self.program;
        let x = p.node(id).inputs[k];
        let xt = p
            .node(x)
            .tensor()
            .ok_or_else(|| gen_err(id, p, "tuple input"))?
            .clone();
        let v = self.value(x, &broadcast(c, &xt.shape))?;
        Ok((v, xt.dtype))
    }

    fn op_value(&mut self, id: NodeId, c: &[String], dt: Dtype) -> Result<String> {
        let p = self.program;
        let node = p.node(id);
        let ty = Self::ctype(dt);
        match &node.op {
            Op::Binary { kind } => {
                let (a, da) = self.input(id, 0, c)?;
                let (b, db) = self.input(id, 1, c)?;
                let code = EwOp::Binary(*kind).code();
                let e = if is_f(da) {
                    store_f(
                        &format!("ew_f({code}, {}, {})", as_f(&a, da), as_f(&b, db)),
                        dt,
                    )
                } else {
                    store_i(
                        &format!("ew_i({code}, {}, {})", as_i(&a, da), as_i(&b, db)),
                        dt,
                    )
                };
                Ok(self.emit(ty, e))
            }
            Op::BinaryScalar {
                kind,
                scalar,
                scalar_lhs,
            } => {
                let (a, da) = self.input(id, 0, c)?;
                let code = EwOp::Binary(*kind).code();
                let e = if is_f(da) {
                    let s = match da {
                        Dtype::Bf16 => petite_dtype::round_through_bf16(*scalar as f32),
                        Dtype::F16 => half::f16::from_f32(*scalar as f32).to_f32(),
                        _ => *scalar as f32,
                    };
                    let (x, y) = (as_f(&a, da), f32_lit(s));
                    let (x, y) = if *scalar_lhs { (y, x) } else { (x, y) };
                    store_f(&format!("ew_f({code}, {x}, {y})"), dt)
                } else {
                    let (x, y) = (as_i(&a, da), format!("((i64){}LL)", *scalar as i64));
                    let (x, y) = if *scalar_lhs { (y, x) } else { (x, y) };
                    store_i(&format!("ew_i({code}, {x}, {y})"), dt)
                };
                Ok(self.emit(ty, e))
            }
            Op::Compare { kind } => {
                let (a, da) = self.input(id, 0, c)?;
                let (b, db) = self.input(id, 1, c)?;
                let code = EwOp::Compare(*kind).code();
                let r = if is_f(da) {
                    format!("ew_cmp<float>({code}, {}, {})", as_f(&a, da), as_f(&b, db))
                } else {
                    format!("ew_cmp<i64>({code}, {}, {})", as_i(&a, da), as_i(&b, db))
                };
                Ok(self.emit(ty, store_i(&format!("({r}) ? 1LL : 0LL"), dt)))
            }
            Op::Logical { kind } => {
                let (a, da) = self.input(id, 0, c)?;
                let (b, db) = self.input(id, 1, c)?;
                let op = if EwOp::Logical(*kind).code() == 20 {
                    "&&"
                } else {
                    "||"
                };
                let r = format!("({} != 0) {op} ({} != 0)", as_i(&a, da), as_i(&b, db));
                Ok(self.emit(ty, store_i(&format!("({r}) ? 1LL : 0LL"), dt)))
            }
            Op::Not => {
                let (a, da) = self.input(id, 0, c)?;
                let r = format!("!({} != 0)", as_i(&a, da));
                Ok(self.emit(ty, store_i(&format!("({r}) ? 1LL : 0LL"), dt)))
            }
            Op::Unary { kind } => {
                let (a, da) = self.input(id, 0, c)?;
                let code = EwOp::Unary(*kind).code();
                let e = if is_f(da) {
                    store_f(&format!("ew_f({code}, {}, 0.0f)", as_f(&a, da)), dt)
                } else {
                    store_i(&format!("ew_i({code}, {}, 0)", as_i(&a, da)), dt)
                };
                Ok(self.emit(ty, e))
            }
            Op::Cast { .. } | Op::Expand { .. } => {
                let (a, da) = self.input(id, 0, c)?;
                Ok(self.copy(&a, da, dt))
            }
            Op::Where => {
                let (a, da) = self.input(id, 0, c)?;
                let (b, db) = self.input(id, 1, c)?;
                let (e, de) = self.input(id, 2, c)?;
                let cnd = format!("({} != 0)", as_i(&a, da));
                let r = if is_f(db) {
                    store_f(&format!("{cnd} ? {} : {}", as_f(&b, db), as_f(&e, de)), dt)
                } else {
                    store_i(&format!("{cnd} ? {} : {}", as_i(&b, db), as_i(&e, de)), dt)
                };
                Ok(self.emit(ty, r))
            }
            Op::Slice {
                axis, start, step, ..
            } => {
                let mut ic = c.to_vec();
                let s = if *start == 0 {
                    "0LL".to_string()
                } else {
                    self.start(*start as i64)
                };
                ic[*axis] = match (c[*axis].as_str(), *start, *step) {
                    (x, 0, 1) => x.to_string(),
                    ("0", _, _) => s,
                    (x, _, 1) => format!("({x} + {s})"),
                    (x, _, k) => format!("({s} + {x} * {k}LL)"),
                };
                let x = node.inputs[0];
                let dx = p.node(x).tensor().map(|t| t.dtype).unwrap_or(dt);
                let v = self.value(x, &ic)?;
                Ok(self.copy(&v, dx, dt))
            }
            Op::Permute { perm } => {
                let mut ic = vec![String::new(); perm.len()];
                for (i, &d) in perm.iter().enumerate() {
                    ic[d] = c[i].clone();
                }
                let x = node.inputs[0];
                let dx = p.node(x).tensor().map(|t| t.dtype).unwrap_or(dt);
                let v = self.value(x, &ic)?;
                Ok(self.copy(&v, dx, dt))
            }
            Op::Reshape { shape } => {
                let x = node.inputs[0];
                let xs = p
                    .node(x)
                    .tensor()
                    .ok_or_else(|| gen_err(id, p, "tuple input"))?
                    .shape
                    .clone();
                let ost = contiguous_strides(shape);
                let mut lin = String::from("0");
                for (d, cd) in c.iter().enumerate() {
                    if cd != "0" && shape[d] != 1 {
                        let _ = write!(lin, " + {cd} * {}LL", ost[d]);
                    }
                }
                let (ity, suf) = index_type(shape.iter().product());
                let l = self.emit(ity, format!("({ity})({lin})"));
                let ist = contiguous_strides(&xs);
                let ic: Vec<String> = xs
                    .iter()
                    .enumerate()
                    .map(|(j, &s)| {
                        if s == 1 {
                            "0".to_string()
                        } else if j == 0 {
                            format!("({l} / {}{suf})", ist[j])
                        } else {
                            format!("(({l} / {}{suf}) % {s}{suf})", ist[j])
                        }
                    })
                    .collect();
                self.value(x, &ic)
            }
            Op::Concat { axis } => {
                let out = self.var();
                let _ = writeln!(self.body, "    {ty} {out};");
                let mut start = 0usize;
                let k = node.inputs.len();
                for (j, &x) in node.inputs.iter().enumerate() {
                    let xt = p
                        .node(x)
                        .tensor()
                        .ok_or_else(|| gen_err(id, p, "tuple input"))?
                        .clone();
                    let len = xt.shape[*axis];
                    let end = start + len;
                    let cond = if k == 1 {
                        "{".to_string()
                    } else if j + 1 == k {
                        "else {".to_string()
                    } else if j == 0 {
                        format!("if ({} < {end}LL) {{", c[*axis])
                    } else {
                        format!("else if ({} < {end}LL) {{", c[*axis])
                    };
                    let _ = writeln!(self.body, "    {cond}");
                    let mut ic = c.to_vec();
                    if start > 0 {
                        ic[*axis] = format!("({} - {start}LL)", c[*axis]);
                    }
                    // Values computed inside a branch are not visible after it.
                    let saved = self.memo.clone();
                    let v = self.value(x, &ic)?;
                    let cv = self.copy(&v, xt.dtype, dt);
                    let _ = writeln!(self.body, "    {out} = {cv};\n    }}");
                    self.memo = saved;
                    start = end;
                }
                Ok(out)
            }
            other => Err(gen_err(id, p, format!("{} is not fusible", other.name()))),
        }
    }

    /// `pt_ew`'s copy (op 0) of a register value of dtype `from` into dtype `to`.
    fn copy(&mut self, v: &str, from: Dtype, to: Dtype) -> String {
        if from == to {
            return v.to_string();
        }
        let e = if is_f(from) {
            store_f(&as_f(v, from), to)
        } else {
            store_i(&as_i(v, from), to)
        };
        self.emit(Self::ctype(to), e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use petite_graph::Builder;

    /// bf16 rotate-half RoPE as pi0.5's programs write it, feeding a matmul, plus a reshape
    /// between a fused chain and the matmul.
    fn rope_program() -> (Program, [NodeId; 4]) {
        let mut b = Builder::new();
        let x = b.input("x", Dtype::Bf16, &[1, 2, 4, 8]).unwrap();
        let cos = b.input("cos", Dtype::Bf16, &[1, 1, 4, 8]).unwrap();
        let sin = b.input("sin", Dtype::Bf16, &[1, 1, 4, 8]).unwrap();
        let w = b.input("w", Dtype::Bf16, &[1, 2, 8, 4]).unwrap();
        let x1 = b.slice(x, -1, 0, 4, 1).unwrap();
        let x2 = b.slice(x, -1, 4, 8, 1).unwrap();
        let n2 = b.neg(x2).unwrap();
        let rot = b.concat(&[n2, x1], -1).unwrap();
        let a = b.mul(x, cos).unwrap();
        let r = b.mul(rot, sin).unwrap();
        let y = b.add(a, r).unwrap();
        let yr = b.reshape(y, &[1, 2, 4, 8]).unwrap();
        let m = b.matmul(yr, w).unwrap();
        let m = b.cast(m, Dtype::F32).unwrap();
        b.output("m", m).unwrap();
        (b.finish().unwrap(), [y, yr, m, x1])
    }

    #[test]
    fn big_straight_line_groups_are_unrolled_with_each_copy_renamed() {
        let mut b = Builder::new();
        let x = b.input("x", Dtype::Bf16, &[1024, 1024]).unwrap();
        let y = b.input("y", Dtype::Bf16, &[1024, 1024]).unwrap();
        let m = b.mul(x, y).unwrap();
        let r = b.add(m, x).unwrap();
        b.output("r", r).unwrap();
        // The same chain below `UNROLL_FROM`, and a branching one (RoPE's concat) above it.
        let s = b.input("s", Dtype::Bf16, &[8, 1024]).unwrap();
        let s2 = b.mul(s, s).unwrap();
        b.output("s", s2).unwrap();
        let h1 = b.slice(x, -1, 0, 512, 1).unwrap();
        let h2 = b.slice(x, -1, 512, 1024, 1).unwrap();
        let rot = b.concat(&[h2, h1], -1).unwrap();
        let rr = b.mul(rot, y).unwrap();
        b.output("rot", rr).unwrap();
        let p = b.finish().unwrap();
        let f = plan_all(&p);
        let unroll_of = |v: NodeId| match f.role[v.index()] {
            Role::Root(g) => f.groups[g].unroll,
            other => panic!("{other:?}"),
        };
        assert_eq!(unroll_of(r), UNROLL);
        assert_eq!(unroll_of(s2), 1);
        assert_eq!(unroll_of(rr), 1);
        let Role::Root(g) = f.role[r.index()] else {
            unreachable!()
        };
        let name = &f.kernels[f.groups[g].kernel.unwrap()];
        let src = f.source.split(&format!("void {name}(")).nth(1).unwrap();
        let src = src.split("\n}\n").next().unwrap();
        let (fast, tail) = src.split_once("for (; i < n; i += st)").unwrap();
        // Every copy's loads come before any copy's store, each copy with its own names.
        let last_load = fast.rfind("ldf(").unwrap();
        let first_store = fast.find("po)[").unwrap();
        assert!(last_load < first_store, "{fast}");
        for k in 0..UNROLL {
            assert!(fast.contains(&format!("po)[i_{k}]")), "{fast}");
            assert!(fast.contains(&format!("v1_{k} = ldf(p")), "{fast}");
        }
        assert!(!fast.contains(" v1 ") && !fast.contains("[i]"), "{fast}");
        assert!(
            tail.contains("po)[i] =") && tail.contains(" v1 = "),
            "{tail}"
        );
        assert_eq!(
            renamed("r /= 8u; c2 = i64(c12) + v3 * ri;", 1),
            "r_1 /= 8u; c2_1 = i64(c12_1) + v3_1 * ri;"
        );
    }

    #[test]
    fn f32_projections_read_only_by_an_attention_are_column_siblings_restrided() {
        // SigLIP's shape of it: q/k/v f32 linears with biases, each reshaped to heads and
        // permuted into one attention, its result merged back.
        let (b_, t, heads, hd) = (2, 4, 2, 4);
        let d = heads * hd;
        let mut b = Builder::new();
        let x = b.input("x", Dtype::F32, &[b_, t, d]).unwrap();
        let mut proj = Vec::new();
        for name in ["q", "k", "v"] {
            let w = b.weight(&format!("{name}.w"), Dtype::F32, &[d, d]).unwrap();
            let bias = b.weight(&format!("{name}.b"), Dtype::F32, &[d]).unwrap();
            let l = b.linear(x, w, Some(bias)).unwrap();
            let r = b.reshape(l, &[b_, t, heads, hd]).unwrap();
            proj.push((l, b.permute(r, &[0, 2, 1, 3]).unwrap()));
        }
        let a = b
            .attention(proj[0].1, proj[1].1, proj[2].1, None, 0.5)
            .unwrap();
        let m = b.permute(a, &[0, 2, 1, 3]).unwrap();
        b.output("o", m).unwrap();
        let p = b.finish().unwrap();
        let roots: Vec<_> = p.outputs.iter().map(|o| o.value).collect();
        let live = p.ancestors(&roots);
        let mut is_output = vec![false; p.len()];
        is_output[roots[0].index()] = true;
        let mut f = plan_with(&p, &live, &is_output, 0).unwrap();
        let consumers = p.consumers();
        let in_place =
            |l: NodeId| read_in_place_by_attentions(&p, &f, &consumers, &live, &is_output, l);
        let sg = siblings(&p, &live, &in_place);
        assert_eq!(sg.len(), 1);
        assert!(sg[0].columns && sg[0].biases.is_some());
        assert_eq!(sg[0].linears, proj.iter().map(|x| x.0).collect::<Vec<_>>());
        // k's view before and after: rows 3·d apart instead of d.
        let key = |f: &Fusion| {
            f.views
                .iter()
                .find(|(_, v)| v.base == proj[1].0)
                .map(|(k, v)| (*k, v.clone()))
                .unwrap()
        };
        let (k0, v0) = key(&f);
        assert_eq!(v0.strides, vec![(t * d) as i64, hd as i64, d as i64, 1]);
        let wide = 3 * d;
        restride(&p, &mut f, proj[1].0, &[(t * wide) as i64, wide as i64, 1]).unwrap();
        let (k1, v1) = key(&f);
        assert_eq!((k0, v1.shape.clone()), (k1, v0.shape));
        assert_eq!(
            v1.strides,
            vec![(t * wide) as i64, hd as i64, wide as i64, 1]
        );
        // Read by anything but a view into an attention (here: also an output), no columns.
        let mut is_output2 = is_output.clone();
        is_output2[proj[2].0.index()] = true;
        let in_place2 =
            |l: NodeId| read_in_place_by_attentions(&p, &f, &consumers, &live, &is_output2, l);
        assert!(!in_place2(proj[2].0) && in_place2(proj[0].0));
    }

    #[test]
    fn two_independent_groups_with_a_product_between_are_one_launch() {
        // The step's order: q = x·Wq, its RoPE-like chain, k = x·Wk, its chain, both read by a
        // product after.
        let mut b = Builder::new();
        let x = b.input("x", Dtype::Bf16, &[4, 8]).unwrap();
        let wq = b.input("wq", Dtype::Bf16, &[16, 8]).unwrap();
        let wk = b.input("wk", Dtype::Bf16, &[8, 8]).unwrap();
        let c = b.input("c", Dtype::Bf16, &[4, 1]).unwrap();
        let q = b.linear(x, wq, None).unwrap();
        let qr = b.mul(q, c).unwrap();
        let k = b.linear(x, wk, None).unwrap();
        let kr = b.mul(k, c).unwrap();
        let kt = b.permute(kr, &[1, 0]).unwrap();
        let qk = b.reshape(qr, &[8, 8]).unwrap();
        let m = b.matmul(qk, kt).unwrap();
        b.output("m", m).unwrap();
        let p = b.finish().unwrap();
        let f = plan_pairing(&p);
        let (Role::Root(ga), Role::Root(gb)) = (f.role[qr.index()], f.role[kr.index()]) else {
            panic!("{:?} {:?}", f.role[qr.index()], f.role[kr.index()]);
        };
        let (a, bb) = (&f.groups[ga], &f.groups[gb]);
        assert!(a.absorbed && !bb.absorbed && bb.with == Some(ga) && a.with.is_none());
        assert_eq!(
            bb.blocks,
            crate::plan::grid_for(32) + crate::plan::grid_for(64)
        );
        let name = &f.kernels[bb.kernel.unwrap()];
        let src = &f.source[f.source.find(&format!("void {name}(")).unwrap()..];
        let src = &src[..src.find("\n}\n").unwrap()];
        let own = crate::plan::grid_for(32);
        assert!(src.contains(&format!("if (blockIdx.x < {own}u)")), "{src}");
        assert!(src.contains("void* po, i64 qn, const void* q0"), "{src}");
        let (mine, theirs) = src[src.find("if (blockIdx").unwrap()..]
            .split_once("} else {")
            .unwrap();
        assert!(
            mine.contains("i < n;") && !mine.contains("q0") && !mine.contains("gridDim"),
            "{src}"
        );
        assert!(theirs.contains("i < qn;") && theirs.contains("qo)[i]") && !theirs.contains("p0"));
        // The second reading the first: two launches.
        let mut b = Builder::new();
        let x = b.input("x", Dtype::Bf16, &[4, 8]).unwrap();
        let w = b.input("w", Dtype::Bf16, &[8, 8]).unwrap();
        let c = b.input("c", Dtype::Bf16, &[4, 8]).unwrap();
        let y = b.mul(x, c).unwrap();
        let z = b.linear(y, w, None).unwrap();
        let zz = b.add(z, y).unwrap();
        let out = b.linear(zz, w, None).unwrap();
        b.output("o", out).unwrap();
        let p = b.finish().unwrap();
        let f = plan_pairing(&p);
        assert!(f.groups.iter().all(|g| g.with.is_none() && !g.absorbed));
    }

    #[test]
    fn a_permute_moving_only_unit_dims_is_a_free_view() {
        let mut b = Builder::new();
        let v = b.input("v", Dtype::Bf16, &[1, 50, 1, 256]).unwrap();
        let k = b.input("k", Dtype::Bf16, &[1, 50, 2, 256]).unwrap();
        let vp = b.permute(v, &[0, 2, 1, 3]).unwrap();
        let kp = b.permute(k, &[0, 2, 1, 3]).unwrap();
        b.output("v", vp).unwrap();
        b.output("k", kp).unwrap();
        let p = b.finish().unwrap();
        assert!(moves_only_unit_dims(&p, vp));
        assert!(!moves_only_unit_dims(&p, kp));
        let f = plan_all(&p);
        assert_eq!(f.role[vp.index()], Role::Plain);
        assert!(matches!(f.role[kp.index()], Role::Root(_)));
    }

    fn plan_all(p: &Program) -> Fusion {
        plan_queries(p, fused_attention_queries((9, 0)))
    }

    fn plan_queries(p: &Program, queries: usize) -> Fusion {
        plan_o(
            p,
            Options {
                pairs: false,
                ..Options::new(queries)
            },
        )
    }

    fn plan_o(p: &Program, o: Options) -> Fusion {
        plan_program(p, o).unwrap()
    }

    fn plan_pairing(p: &Program) -> Fusion {
        let roots: Vec<NodeId> = p.outputs.iter().map(|o| o.value).collect();
        let mut out = vec![false; p.len()];
        for o in &p.outputs {
            out[o.value.index()] = true;
        }
        plan_with(
            p,
            &p.ancestors(&roots),
            &out,
            fused_attention_queries((9, 0)),
        )
        .unwrap()
    }

    #[test]
    fn pi05s_bf16_attentions_run_whole_up_to_the_query_limit() {
        let cfg = petite_pi05::Pi05Config::default();
        let bf16 = petite_pi05::build_all(&cfg, petite_pi05::Precision::Bf16).unwrap();
        let softmaxes = |p: &Program| {
            p.ids()
                .filter(|&i| matches!(p.node(i).op, Op::Softmax { .. }))
                .count()
        };
        let step = &bf16.step;
        let f = plan_queries(step, 128);
        assert!(softmaxes(step) > 0);
        assert_eq!(f.attentions.len(), softmaxes(step), "every step attention");
        for (&pv, a) in &f.attentions {
            assert!(matches!(f.role[pv.index()], Role::Plain | Role::Transposed));
            assert_eq!(f.role[a.logits.index()], Role::Attended);
            let cast = step.node(pv).inputs[0];
            assert_eq!(f.role[cast.index()], Role::Attended);
            assert_eq!(f.role[step.node(cast).inputs[0].index()], Role::Attended);
            // One KV head read by all 8 query heads in place: head stride 0.
            assert_eq!(f.views[&(a.logits, 1)].strides[1], 0);
            assert_eq!(f.views[&(pv, 1)].strides[1], 0);
            assert!(matches!(a.scale, Some((_, Dtype::Bf16))));
            // The prefix's K/V and the step's own, read where they lie (no concat).
            let (kv, n0) = a.pieces.expect("K/V read as two pieces");
            assert_eq!(n0, step.node(kv[0]).tensor().unwrap().shape[2]);
            for m in [a.logits, pv] {
                let concat = f.views[&(m, 1)].base;
                assert!(matches!(step.node(concat).op, Op::Concat { axis: 2 }));
                assert_eq!(f.role[concat.index()], Role::Attended);
            }
        }
        // The prefix's 968 queries stay three launches unless asked; 0 fuses none.
        let prefix = &bf16.prefix;
        assert!(plan_queries(prefix, 128).attentions.is_empty());
        assert_eq!(
            plan_queries(prefix, usize::MAX).attentions.len(),
            softmaxes(prefix)
        );
        // Their kernels are the last three, loaded from the attention module (compiled once a
        // process), never from the program's own source.
        let [l, pv, cl] = f.attention_kernels.expect("attention kernels");
        assert_eq!(
            (&*f.kernels[l], &*f.kernels[pv], &*f.kernels[cl]),
            ("pt_attn_logits", "pt_attn_pv", "pt_attn_cl")
        );
        assert_eq!(cl + 1, f.kernels.len());
        assert!(!f.source.contains("pt_attn"));
        // SigLIP's f32 out/fc1/fc2 linears have their biases added by the groups reading them
        // (q/k/v are read by the attention op: their own bias pass).
        let folded = plan_queries(prefix, 0).biases.len();
        assert!(folded >= 3 * 27, "{folded} biases folded");
        let none = plan_queries(step, 0);
        assert!(none.attentions.is_empty() && none.attention_kernels.is_none());
        assert!(!none.role.contains(&Role::Attended));
        assert!(!none.source.contains("pt_attn"));
        // f32 attention is its own op, never this chain.
        let f32 = petite_pi05::build_all(&cfg, petite_pi05::Precision::F32).unwrap();
        assert!(plan_queries(&f32.step, usize::MAX).attentions.is_empty());
    }

    #[test]
    fn an_f32_linears_bias_is_added_by_the_one_group_reading_it() {
        let mut b = Builder::new();
        let x = b.input("x", Dtype::F32, &[3, 8]).unwrap();
        let r = b.input("r", Dtype::F32, &[3, 4]).unwrap();
        let w = b.weight("w", Dtype::F32, &[4, 8]).unwrap();
        let bias = b.weight("b", Dtype::F32, &[4]).unwrap();
        let y = b.linear(x, w, Some(bias)).unwrap();
        let z = b.add(y, r).unwrap();
        let z = b.gelu_tanh(z).unwrap();
        b.output("z", z).unwrap();
        // Read by a second group too: its bias stays its own pass.
        let y2 = b.linear(x, w, Some(bias)).unwrap();
        let u = b.add(y2, r).unwrap();
        b.output("u", u).unwrap();
        let v = b.mul(y2, r).unwrap();
        let v = b.cast(v, Dtype::Bf16).unwrap();
        b.output("v", v).unwrap();
        let p = b.finish().unwrap();
        let f = plan_all(&p);
        assert_eq!(f.biases.get(&y), Some(&bias));
        assert!(!f.biases.contains_key(&y2));
        let Role::Root(g) = f.role[z.index()] else {
            panic!("gelu roots the group");
        };
        let grp = &f.groups[g];
        assert!(grp.leaves.contains(&y) && grp.leaves.contains(&bias));
        // The product loaded, then one f32 add of the bias (its column), then the group's ops.
        let j = grp.leaves.iter().position(|&l| l == y).unwrap();
        let jb = grp.leaves.iter().position(|&l| l == bias).unwrap();
        let name = &f.kernels[grp.kernel.unwrap()];
        let body = &f.source[f.source.find(&format!("void {name}(")).unwrap()..];
        let load = format!("ldf(p{j}, 0 + c0 * 4LL + c1 * 1LL, DT_F32)");
        let at = body.find(&load).expect("the product loaded");
        let lb = format!("ldf(p{jb}, 0 + c1 * 1LL, DT_F32)");
        assert!(body[at..].contains(&lb), "{body}");
        // A bf16 linear (its output rounded after the bias) keeps its own pass.
        let mut b = Builder::new();
        let x = b.input("x", Dtype::Bf16, &[3, 8]).unwrap();
        let w = b.weight("w", Dtype::Bf16, &[4, 8]).unwrap();
        let bias = b.weight("b", Dtype::Bf16, &[4]).unwrap();
        let y = b.linear(x, w, Some(bias)).unwrap();
        let z = b.gelu_tanh(y).unwrap();
        b.output("z", z).unwrap();
        assert!(plan_all(&b.finish().unwrap()).biases.is_empty());
    }

    #[test]
    fn a_rope_chain_is_one_kernel_and_a_reshape_stays_a_free_view() {
        let (p, [y, yr, m, x1]) = rope_program();
        let f = plan_all(&p);
        let Role::Root(g) = f.role[y.index()] else {
            panic!("the add roots the chain: {:?}", f.role[y.index()]);
        };
        assert_eq!(f.role[x1.index()], Role::Inlined);
        assert_eq!(
            f.role[yr.index()],
            Role::View,
            "a reshape feeding a matmul is read in place, never a kernel"
        );
        // The output cast is its own group (the matmul between is not fusible).
        assert!(matches!(f.role[m.index()], Role::Root(_)));
        let grp = &f.groups[g];
        assert_eq!(grp.nodes, 7, "slice, slice, neg, concat, mul, mul, add");
        // Reads x, cos, sin: each once, whatever the coordinates it is read at.
        let names: Vec<&str> = grp
            .leaves
            .iter()
            .map(|&l| p.input_name(l).unwrap())
            .collect();
        assert_eq!(names.len(), 3, "{names:?}");
        for n in ["x", "cos", "sin"] {
            assert!(names.contains(&n), "{names:?}");
        }
        assert_eq!(f.kernels.len(), 2);
    }

    #[test]
    fn generated_source_rounds_each_op_and_balances() {
        let (p, [..]) = rope_program();
        let f = plan_all(&p);
        let src = &f.source;
        for k in &f.kernels {
            assert_eq!(src.matches(&format!("void {k}(")).count(), 1, "{k}");
        }
        let open = src.matches('{').count();
        assert_eq!(open, src.matches('}').count(), "braces balance");
        // bf16 intermediates are rounded as a store would round them.
        assert!(
            src.contains("bf2f(f2bf(ew_f(30"),
            "neg rounded to bf16:\n{src}"
        );
        // The concat picks its piece by the last coordinate.
        assert!(src.contains("if (c3 < 4LL)"), "{src}");
    }

    #[test]
    fn coordinates_are_divided_in_32_bits_below_2_pow_31_elements() {
        assert_eq!(index_type((1 << 31) - 1), ("unsigned", "u"));
        assert_eq!(index_type(1 << 31), ("i64", "LL"));
        // A non-power-of-two shape (pi0.5's 968 prefix tokens), reshaped inside the group.
        let mut b = Builder::new();
        let x = b.input("x", Dtype::Bf16, &[968, 6]).unwrap();
        let e = b.exp(x).unwrap();
        let r = b.reshape(e, &[968, 2, 3]).unwrap();
        let y = b.neg(r).unwrap();
        b.output("y", y).unwrap();
        let p = b.finish().unwrap();
        let f = plan_all(&p);
        assert_eq!(f.kernels.len(), 1, "{}", f.source);
        assert!(
            f.source.contains("unsigned r = (unsigned)i;"),
            "{}",
            f.source
        );
        assert!(
            f.source.contains("unsigned c2 = r % 3u; r /= 3u;"),
            "{}",
            f.source
        );
        assert!(
            f.source.contains("(v1 / 6u)") && f.source.contains("% 6u)"),
            "{}",
            f.source
        );
        assert!(!f.source.contains("LL; r /="), "{}", f.source);
    }

    #[test]
    fn identical_groups_share_one_kernel() {
        let mut b = Builder::new();
        let mut outs = Vec::new();
        for i in 0..4 {
            let x = b.input(&format!("x{i}"), Dtype::F32, &[4, 8]).unwrap();
            let y = b.mul_scalar(x, 2.0).unwrap();
            let y = b.cast(y, Dtype::Bf16).unwrap();
            outs.push(y);
        }
        for (i, y) in outs.into_iter().enumerate() {
            b.output(&format!("y{i}"), y).unwrap();
        }
        let p = b.finish().unwrap();
        let f = plan_pairing(&p);
        assert_eq!(f.groups.len(), 4);
        assert!(f.groups.iter().all(|g| g.nodes == 2));
        // Independent, so launched two at a time ([`Group::with`]): both launches one kernel.
        let launched: Vec<&Group> = f.groups.iter().filter(|g| !g.absorbed).collect();
        assert_eq!(launched.len(), 2);
        assert!(
            launched
                .iter()
                .all(|g| g.kernel == Some(0) && g.with.is_some())
        );
        assert_eq!(f.kernels.len(), 1, "one kernel for four identical chains");
    }

    fn literal(o: Options) -> Options {
        Options {
            offset_params: false,
            ..o
        }
    }

    /// Kernel `k`'s parameter list and body (its text but for the name).
    fn kernel_text(f: &Fusion, k: usize) -> (&str, &str) {
        let head = format!("extern \"C\" __global__ void {}(", f.kernels[k]);
        let at = f.source.find(&head).expect("kernel in source") + head.len();
        let rest = &f.source[at..];
        let sig = rest.find(") {\n").expect("signature");
        let end = rest.find("\n}\n").expect("kernel end");
        (&rest[..sig], &rest[sig..end])
    }

    /// Each launched group's kernel with its slice starts as parameters, the values it is
    /// launched with put back as literals, is the kernel the generator writes with literals.
    fn offsets_are_literals_put_back(p: &Program, fp: &Fusion, fl: &Fusion) -> usize {
        assert_eq!(fp.groups.len(), fl.groups.len());
        let mut launched = 0;
        for (g, (gp, gl)) in fp.groups.iter().zip(&fl.groups).enumerate() {
            assert_eq!(
                (
                    gp.root,
                    &gp.leaves,
                    gp.prologue,
                    gp.first,
                    gp.with,
                    gp.absorbed
                ),
                (
                    gl.root,
                    &gl.leaves,
                    gl.prologue,
                    gl.first,
                    gl.with,
                    gl.absorbed
                )
            );
            assert!(gl.offsets.is_empty() && gp.offsets.iter().all(|&o| o > 0));
            let (Some(kp), Some(kl)) = (gp.kernel, gl.kernel) else {
                assert!(gp.absorbed && gp.kernel.is_none() && gl.kernel.is_none());
                continue;
            };
            launched += 1;
            let other = gp
                .first
                .or(gp.with)
                .map_or(&[][..], |o| &fp.groups[o].offsets);
            // What the launch passes, in order: the signature's `s…` then `t…`.
            let passed: Vec<i64> = fp.launch_offsets(g).copied().collect();
            assert_eq!(passed.len(), gp.offsets.len() + other.len());
            let (own, theirs) = passed.split_at(gp.offsets.len());
            let (sig_p, body_p) = kernel_text(fp, kp);
            let (sig_l, body_l) = kernel_text(fl, kl);
            let mut sig = sig_l.to_string();
            for j in 0..gp.offsets.len() {
                let _ = write!(sig, ", i64 s{j}");
            }
            for j in 0..other.len() {
                let _ = write!(sig, ", i64 t{j}");
            }
            assert_eq!(sig_p, sig, "{}", p.describe(gp.root));
            let put_back: String = body_p
                .lines()
                .map(|l| {
                    map_words(l, |w| {
                        let (table, j) = match w.split_at_checked(1) {
                            Some(("s", j)) => (own, j),
                            Some(("t", j)) => (theirs, j),
                            _ => return None,
                        };
                        let j: usize = j.parse().ok()?;
                        Some(format!("{}LL", table[j]))
                    }) + "\n"
                })
                .collect();
            assert_eq!(
                put_back.trim_end(),
                body_l.trim_end(),
                "{}",
                p.describe(gp.root)
            );
        }
        launched
    }

    #[test]
    fn slice_starts_as_parameters_are_the_literal_kernels_launched_with_their_values() {
        for (name, p) in &crate::pi05_programs() {
            let o = Options::new(fused_attention_queries((9, 0)));
            let (fp, fl) = (plan_o(p, o), plan_o(p, literal(o)));
            let launched = offsets_are_literals_put_back(p, &fp, &fl);
            assert!(launched > 0, "{name}");
            eprintln!(
                "{name}: {launched} launches, kernels {} with literal starts, {} with parameters",
                fl.kernels.len(),
                fp.kernels.len()
            );
            if name.ends_with("step") {
                // The 36 adaRMS prologues (and the residual sums they compute first)
                // differ only in their layer's offsets into the modulation table.
                assert!(fl.kernels.len() >= 40, "{}", fl.kernels.len());
                assert!(fp.kernels.len() <= 16, "{}", fp.kernels.len());
                // The residual sums computed first read the gate's offsets as `t…`.
                assert!(
                    fp.groups
                        .iter()
                        .any(|g| { g.first.is_some_and(|o| !fp.groups[o].offsets.is_empty()) })
                );
            }
        }
    }

    #[test]
    fn unrolled_row_loops_compute_each_element_by_the_same_lines() {
        let body = "  __shared__ double shd[32];\n  const i64 base = row * np.d;\n  for (i64 jj = threadIdx.x; jj < np.d; jj += blockDim.x) {\n    const i64 i = base + jj;\n    unsigned r = (unsigned)i;\n    unsigned c1 = r % 8u; r /= 8u;\n    float v1 = ldf(q0, c1 * 1LL, DT_BF16);\n    ((unsigned short*)qo)[i] = f2bf(v1);\n  }\n  __syncthreads();\n  for (i64 jj = threadIdx.x; jj < np.d; jj += blockDim.x) {\n    const i64 i = base + jj;\n    float v1;\n    if (i < 3LL) {\n    v1 = 1.0f;\n    }\n  }\n";
        let out = rows_unrolled(body);
        // The straight-line loop: four copies a trip, then the remainder as it was.
        let inner = [
            "    const i64 i = base + jj;",
            "    unsigned r = (unsigned)i;",
            "    unsigned c1 = r % 8u; r /= 8u;",
            "    float v1 = ldf(q0, c1 * 1LL, DT_BF16);",
            "    ((unsigned short*)qo)[i] = f2bf(v1);",
        ];
        let lines: Vec<&str> = out.lines().collect();
        let trip = lines
            .iter()
            .position(|l| l.starts_with("    const i64 jj_0 = jj"))
            .unwrap();
        for (n, want) in inner.iter().enumerate() {
            for k in 0..UNROLL {
                let got = lines[trip + 1 + n * UNROLL + k];
                // Copy k is the line with its own names suffixed `_k`, and nothing else.
                assert_eq!(got, row_renamed(want, k));
                let back = map_words(got, |w| {
                    w.strip_suffix(&format!("_{k}")).map(str::to_string)
                });
                assert_eq!(back, *want);
            }
        }
        // Every copy's loads before any store.
        let first_store = lines.iter().position(|l| l.contains(")[i_")).unwrap();
        let last_load = lines
            .iter()
            .rposition(|l| l.contains("ldf(q0, c1_"))
            .unwrap();
        assert!(last_load < first_store);
        let rest = out.find("  for (; jj < np.d; jj += bd) {\n").unwrap();
        assert!(out[rest..].starts_with(&format!(
            "  for (; jj < np.d; jj += bd) {{\n{}\n  }}\n  }}\n",
            inner.join("\n")
        )));
        // The loop holding a branch is left as it was, and so is everything outside loops.
        assert!(out.ends_with("  __syncthreads();\n  for (i64 jj = threadIdx.x; jj < np.d; jj += blockDim.x) {\n    const i64 i = base + jj;\n    float v1;\n    if (i < 3LL) {\n    v1 = 1.0f;\n    }\n  }\n"));
        assert!(out.starts_with("  __shared__ double shd[32];\n  const i64 base = row * np.d;\n"));
        assert_eq!(out.matches('{').count(), out.matches('}').count());
    }

    #[test]
    fn unrolled_rows_change_only_the_prologue_kernels_text() {
        for (name, p) in &crate::pi05_programs() {
            if !name.ends_with("timestep_table") {
                let o = Options::new(fused_attention_queries((9, 0)));
                let f = plan_o(p, o);
                let fu = plan_o(
                    p,
                    Options {
                        unrolled_rows: true,
                        ..o
                    },
                );
                assert_eq!(f.kernels.len(), fu.kernels.len());
                let mut prologues = 0;
                for (g, gu) in f.groups.iter().zip(&fu.groups) {
                    assert_eq!(
                        (g.root, &g.leaves, g.prologue, g.first, g.kernel, &g.offsets),
                        (
                            gu.root,
                            &gu.leaves,
                            gu.prologue,
                            gu.first,
                            gu.kernel,
                            &gu.offsets
                        )
                    );
                    let Some(k) = g.kernel else { continue };
                    let (a, b) = (kernel_text(&f, k), kernel_text(&fu, k));
                    assert_eq!(a.0, b.0, "the same parameters");
                    if g.prologue.is_none() {
                        assert_eq!(a.1, b.1, "{}", p.describe(g.root));
                        continue;
                    }
                    prologues += 1;
                    assert!(a.1.contains("norm_stats(") && a.1.contains("norm_elem("));
                    assert!(b.1.contains("norm_stats4<") && b.1.contains("norm_elem4<"));
                    assert!(b.1.contains("jj_3"), "{}", p.describe(g.root));
                }
                assert!(prologues > 0);
            }
        }
    }

    #[test]
    fn slices_of_one_table_at_other_offsets_share_one_kernel() {
        let mut b = Builder::new();
        let table = b.input("table", Dtype::F32, &[4, 96]).unwrap();
        let x = b.input("x", Dtype::Bf16, &[4, 32]).unwrap();
        let mut outs = Vec::new();
        for start in [0isize, 32, 64] {
            let s = b.slice(table, 1, start, start + 32, 1).unwrap();
            let s = b.cast(s, Dtype::Bf16).unwrap();
            let y = b.mul(x, s).unwrap();
            outs.push(y);
        }
        for (i, y) in outs.into_iter().enumerate() {
            b.output(&format!("y{i}"), y).unwrap();
        }
        let p = b.finish().unwrap();
        let o = Options {
            pairs: false,
            ..Options::new(0)
        };
        let (fp, fl) = (plan_o(&p, o), plan_o(&p, literal(o)));
        let mut offsets: Vec<(&[i64], Option<usize>)> = fp
            .groups
            .iter()
            .map(|g| (&g.offsets[..], g.kernel))
            .collect();
        offsets.sort();
        let k: Vec<&[i64]> = offsets.iter().map(|o| o.0).collect();
        assert_eq!(k, [&[][..], &[32][..], &[64][..]]);
        // Start 0 reads the table as it is; the others one kernel, two launches.
        assert_eq!(fp.kernels.len(), 2, "{}", fp.source);
        assert_eq!(fl.kernels.len(), 3);
        assert_eq!(offsets[1].1, offsets[2].1);
        assert_ne!(offsets[0].1, offsets[1].1);
        assert_eq!(offsets_are_literals_put_back(&p, &fp, &fl), 3);
    }

    #[test]
    fn reshape_strides_view_what_torch_views_and_refuse_the_rest() {
        // Dense: any reshape is a view.
        assert_eq!(
            reshape_strides(&[2, 3, 4], &[12, 4, 1], &[6, 4]),
            Some(vec![4, 1])
        );
        assert_eq!(
            reshape_strides(&[1, 1, 5, 4], &[20, 20, 4, 1], &[1, 1, 1, 5, 4]),
            Some(vec![20, 20, 20, 4, 1])
        );
        // Merging a broadcast (stride 0) head dim with a size-1 dim stays a view (a size-1
        // dim's stride is never used).
        assert_eq!(
            reshape_strides(&[1, 1, 8, 5, 4], &[20, 20, 0, 4, 1], &[1, 8, 5, 4]),
            Some(vec![0, 0, 4, 1])
        );
        // A transposed matrix cannot be flattened without a copy.
        assert_eq!(reshape_strides(&[3, 4], &[1, 3], &[12]), None);
        assert_eq!(reshape_strides(&[3, 4], &[4, 1], &[5, 2]), None);
    }

    /// Grouped-query attention as the bf16 programs write it: K/V concatenated with the
    /// prefix's, heads repeated by expand, K transposed; both matmul operands become views.
    #[test]
    fn repeated_and_transposed_kv_heads_are_read_in_place() {
        let mut b = Builder::new();
        let q = b.input("q", Dtype::Bf16, &[1, 8, 5, 4]).unwrap();
        let pk = b.input("pk", Dtype::Bf16, &[1, 1, 7, 4]).unwrap();
        let k = b.input("k", Dtype::Bf16, &[1, 1, 5, 4]).unwrap();
        let kk = b.concat(&[pk, k], 2).unwrap();
        let r = b.reshape(kk, &[1, 1, 1, 12, 4]).unwrap();
        let e = b.expand(r, &[1, 1, 8, 12, 4]).unwrap();
        let k8 = b.reshape(e, &[1, 8, 12, 4]).unwrap();
        let kt = b.permute(k8, &[0, 1, 3, 2]).unwrap();
        let logits = b.matmul(q, kt).unwrap();
        b.output("logits", logits).unwrap();
        let p = b.finish().unwrap();
        let f = plan_all(&p);
        let v = &f.views[&(logits, 1)];
        assert_eq!(v.base, kk);
        assert_eq!(v.shape, vec![1, 8, 4, 12]);
        assert_eq!(v.strides, vec![0, 0, 1, 4]);
        let m = crate::plan::MatOperand::from_view(&v.shape, &v.strides).unwrap();
        assert_eq!(m.trans_ld(), (true, 4));
        assert_eq!(m.batch_offsets(&[1, 8]).unwrap(), vec![0; 8]);
        for n in [r, e, k8, kt] {
            assert_eq!(f.role[n.index()], Role::View);
        }
        // The concat is still computed (once, 12 rows, not 8 × 12).
        assert!(matches!(f.role[kk.index()], Role::Root(_)));
        assert!(!f.views.contains_key(&(logits, 0)), "q is read as it is");
    }

    #[test]
    fn linears_of_one_input_and_weight_shape_are_siblings() {
        let mut b = Builder::new();
        let x = b.input("x", Dtype::Bf16, &[1, 5, 4]).unwrap();
        let mut outs = Vec::new();
        for (name, n) in [("q", 8), ("k", 2), ("v", 2)] {
            let w = b.weight(name, Dtype::Bf16, &[n, 4]).unwrap();
            outs.push(b.linear(x, w, None).unwrap());
        }
        // Same shape but a different input: not a sibling.
        let y = b.input("y", Dtype::Bf16, &[1, 5, 4]).unwrap();
        let w = b.weight("o", Dtype::Bf16, &[2, 4]).unwrap();
        outs.push(b.linear(y, w, None).unwrap());
        // A weight read twice is not batched (its buffer is its own).
        let shared = b.weight("shared", Dtype::Bf16, &[8, 4]).unwrap();
        outs.push(b.linear(x, shared, None).unwrap());
        let t = b.transpose(shared, 0, 1).unwrap();
        outs.push(t);
        for (i, o) in outs.into_iter().enumerate() {
            b.output(&format!("o{i}"), o).unwrap();
        }
        let p = b.finish().unwrap();
        let roots: Vec<NodeId> = p.outputs.iter().map(|o| o.value).collect();
        let live = p.ancestors(&roots);
        let groups = siblings(&p, &live, &|_| false);
        assert_eq!(groups.len(), 1, "{groups:?}");
        let names: Vec<String> = groups[0]
            .weights
            .iter()
            .map(|&w| match &p.node(w).op {
                Op::Weight { name, .. } => name.clone(),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(names, ["k", "v"]);
        assert!(groups[0].biases.is_none());
    }

    #[test]
    fn row_kernels_read_widening_casts_in_place_fold_masks_and_narrow_into_their_cast() {
        // rms_norm(cast_f32(x_bf16)); softmax(cast_f32(l_bf16) + mask) read by a bf16 cast.
        let mut b = Builder::new();
        let x = b.input("x", Dtype::Bf16, &[1, 3, 8]).unwrap();
        let l = b.input("l", Dtype::Bf16, &[1, 2, 3, 5]).unwrap();
        let mask = b.input("mask", Dtype::F32, &[1, 1, 3, 5]).unwrap();
        let xw = b.cast(x, Dtype::F32).unwrap();
        let n = b.rms_norm(xw, None, 1e-6).unwrap();
        b.output("n", n).unwrap();
        let ls = b.mul_scalar(l, 0.1).unwrap();
        let lw = b.cast(ls, Dtype::F32).unwrap();
        let s = b.add(lw, mask).unwrap();
        let sm = b.softmax(s, -1).unwrap();
        let out = b.cast(sm, Dtype::Bf16).unwrap();
        b.output("p", out).unwrap();
        let p = b.finish().unwrap();
        let f = plan_all(&p);
        let (n_id, p_id) = (n, out);
        let norm_in = p.node(n_id).inputs[0];
        assert_eq!(
            f.role[norm_in.index()],
            Role::View,
            "the widening cast is never run"
        );
        assert_eq!(f.views[&(n_id, 0)].base, p.node(norm_in).inputs[0]);
        let sm_id = p.node(p_id).inputs[0];
        assert_eq!(f.role[sm_id.index()], Role::Narrowed);
        assert_eq!(
            f.role[p_id.index()],
            Role::Plain,
            "the cast runs the softmax"
        );
        let add = p.node(sm_id).inputs[0];
        assert_eq!(
            f.role[add.index()],
            Role::View,
            "the mask add is the softmax's"
        );
        let [lw_id, mask_id] = [p.node(add).inputs[0], p.node(add).inputs[1]];
        assert_eq!(f.role[lw_id.index()], Role::View);
        let ls_id = p.node(lw_id).inputs[0];
        assert_eq!(
            f.role[ls_id.index()],
            Role::View,
            "the bf16 scaling is the softmax's"
        );
        assert_eq!(
            f.views[&(sm_id, 0)].base,
            p.node(ls_id).inputs[0],
            "reads l in place"
        );
        assert_eq!(f.masks[&sm_id].mask, mask_id);
        assert_eq!(
            f.masks[&sm_id].scale,
            Some((petite_dtype::round_through_bf16(0.1), Dtype::Bf16)),
            "the scalar rounded to bf16 first, as the fused kernel rounds it"
        );
        assert!(f.groups.is_empty(), "nothing left to fuse: {:?}", f.role);
    }

    #[test]
    fn a_widening_cast_read_twice_or_narrowing_is_computed() {
        let mut b = Builder::new();
        let x = b.input("x", Dtype::F32, &[2, 8]).unwrap();
        let y = b.input("y", Dtype::Bf16, &[2, 8]).unwrap();
        let xn = b.cast(x, Dtype::Bf16).unwrap();
        let yw = b.cast(y, Dtype::F32).unwrap();
        let n1 = b.rms_norm(xn, None, 1e-6).unwrap();
        let n2 = b.rms_norm(yw, None, 1e-6).unwrap();
        b.output("n1", n1).unwrap();
        b.output("n2", n2).unwrap();
        b.output("yw", yw).unwrap();
        let p = b.finish().unwrap();
        let f = plan_all(&p);
        assert!(f.views.is_empty(), "{:?}", f.views);
        assert!(f.masks.is_empty());
    }

    /// adaRMS as pi0.5's step writes it: `cast_bf16(rms(cast_f32(x)) · (1 + scale) + shift)`.
    fn ada_rms(norm_out: bool) -> (Program, NodeId, NodeId) {
        let (norm_shape, mod_shape) = (&[1, 3, 8], &[1, 1, 8]);
        let mut b = Builder::new();
        let x = b.input("x", Dtype::Bf16, norm_shape).unwrap();
        let scale = b.input("scale", Dtype::F32, mod_shape).unwrap();
        let shift = b.input("shift", Dtype::F32, mod_shape).unwrap();
        let xf = b.cast(x, Dtype::F32).unwrap();
        let n = b.rms_norm(xf, None, 1e-6).unwrap();
        let s1 = b.add_scalar(scale, 1.0).unwrap();
        let m = b.mul(n, s1).unwrap();
        let m = b.add(m, shift).unwrap();
        let y = b.cast(m, Dtype::Bf16).unwrap();
        b.output("y", y).unwrap();
        if norm_out {
            b.output("n", n).unwrap();
        }
        (b.finish().unwrap(), n, y)
    }

    #[test]
    fn a_norm_read_only_by_its_own_elements_is_its_groups_prologue() {
        let (p, n, y) = ada_rms(false);
        let f = plan_all(&p);
        assert_eq!(f.role[n.index()], Role::Prologue);
        let Role::Root(g) = f.role[y.index()] else {
            panic!("the cast roots the group: {:?}", f.role[y.index()]);
        };
        let grp = &f.groups[g];
        assert_eq!(grp.prologue, Some(n));
        assert!(!grp.leaves.contains(&n), "the norm has no buffer to read");
        // The widening cast is still read in place by the norm, inside the fused kernel.
        assert_eq!(f.views[&(n, 0)].base, p.node(p.node(n).inputs[0]).inputs[0]);
        let name = &f.kernels[grp.kernel.unwrap()];
        let src = &f.source;
        let at = src
            .find(&format!("void {name}(NormParams np"))
            .expect("row kernel signature");
        let body = &src[at..];
        assert!(body.contains("norm_stats(np, nx, base, shd, &nm, &nr);"));
        // The norm's f32 value is used as stored (f32: unrounded), then the group's ops.
        assert!(body.contains("const float nv = (norm_elem(np, nx, nw, nb, base, jj, nm, nr));"));
        assert!(src.contains("__device__ __forceinline__ float norm_elem("));
    }

    /// A gated residual sum `x + g·o` (bf16) read by an adaRMS norm's group and, later, by the
    /// next residual sum; `read_by_group`: the sum is also a leaf of the norm's own group.
    fn residual_then_norm(read_by_group: bool) -> (Program, NodeId, NodeId, NodeId) {
        let mut b = Builder::new();
        let x = b.input("x", Dtype::Bf16, &[1, 3, 8]).unwrap();
        let o = b.input("o", Dtype::Bf16, &[1, 3, 8]).unwrap();
        let g = b.input("g", Dtype::Bf16, &[1, 1, 8]).unwrap();
        let go = b.mul(o, g).unwrap();
        let sum = b.add(x, go).unwrap();
        let sf = b.cast(sum, Dtype::F32).unwrap();
        let n = b.rms_norm(sf, None, 1e-6).unwrap();
        let m = b.mul_scalar(n, 2.0).unwrap();
        let m = if read_by_group {
            let sf2 = b.cast(sum, Dtype::F32).unwrap();
            b.add(m, sf2).unwrap()
        } else {
            m
        };
        // Read by a product, as a step's q/k/v projections read it.
        let y = b.cast(m, Dtype::Bf16).unwrap();
        let w = b.input("w", Dtype::Bf16, &[8, 8]).unwrap();
        let z = b.linear(y, w, None).unwrap();
        let next = b.add(sum, z).unwrap();
        b.output("next", next).unwrap();
        (b.finish().unwrap(), sum, y, n)
    }

    #[test]
    fn a_sum_read_by_a_prologue_norm_is_computed_first_by_its_kernel() {
        let (p, sum, y, n) = residual_then_norm(false);
        let f = plan_all(&p);
        assert_eq!(f.role[n.index()], Role::Prologue);
        let (Role::Root(gs), Role::Root(gy)) = (f.role[sum.index()], f.role[y.index()]) else {
            panic!("{:?} {:?}", f.role[sum.index()], f.role[y.index()]);
        };
        assert!(f.groups[gs].absorbed && !f.groups[gy].absorbed);
        assert_eq!(f.groups[gy].first, Some(gs));
        assert_eq!(f.groups[gs].root, sum);
        let name = &f.kernels[f.groups[gy].kernel.unwrap()];
        let at = f.source.find(&format!("void {name}(")).unwrap();
        let src = &f.source[at..];
        let src = &src[..src.find("\n}\n").unwrap()];
        // The sum's leaves and output follow po; its elements are stored before the barrier
        // that precedes the norm's statistics (which read them through nx).
        let leaves = f.groups[gs].leaves.len();
        assert!(src.contains("void* po, const void* q0"), "{src}");
        assert!(
            src.contains(&format!("const void* q{}, void* qo)", leaves - 1)),
            "{src}"
        );
        let store = src.find("qo)[i] =").unwrap();
        let barrier = src.find("__syncthreads();\n  float nm, nr;").unwrap();
        assert!(
            store < barrier && barrier < src.find("norm_stats(").unwrap(),
            "{src}"
        );
        let first = &src[src.find('{').unwrap()..barrier];
        assert!(!first.contains("p0") && !first.contains("po)"), "{src}");
        // Read by its own norm's group too (other rows' elements may not be written yet), it
        // stays a launch of its own.
        let (p, sum, _, _) = residual_then_norm(true);
        let f = plan_all(&p);
        let Role::Root(gs) = f.role[sum.index()] else {
            panic!()
        };
        assert!(!f.groups[gs].absorbed);
        assert!(f.groups.iter().all(|g| g.first.is_none()));
    }

    #[test]
    fn a_norm_read_by_a_product_roots_a_group_that_computes_its_input_sum_first() {
        // The prefix's order: a residual sum, a norm read only by a linear, the sum read again.
        let mut b = Builder::new();
        let x = b.input("x", Dtype::Bf16, &[1, 3, 8]).unwrap();
        let o = b.input("o", Dtype::Bf16, &[1, 3, 8]).unwrap();
        let w = b.input("w", Dtype::Bf16, &[8, 8]).unwrap();
        let sum = b.add(x, o).unwrap();
        let n = b.rms_norm(sum, None, 1e-6).unwrap();
        let z = b.linear(n, w, None).unwrap();
        let next = b.add(sum, z).unwrap();
        b.output("next", next).unwrap();
        let p = b.finish().unwrap();
        let f = plan_all(&p);
        let (Role::Root(gn), Role::Root(gs)) = (f.role[n.index()], f.role[sum.index()]) else {
            panic!("{:?} {:?}", f.role[n.index()], f.role[sum.index()]);
        };
        let grp = &f.groups[gn];
        assert_eq!((grp.root, grp.prologue, grp.first), (n, Some(n), Some(gs)));
        assert!(f.groups[gs].absorbed && grp.leaves.is_empty());
        let name = &f.kernels[grp.kernel.unwrap()];
        let src = &f.source[f.source.find(&format!("void {name}(")).unwrap()..];
        let src = &src[..src.find("\n}\n").unwrap()];
        // The norm's value stored as `pt_norm` stores it (rounded once to its dtype).
        assert!(
            src.contains("const float nv = bf2f(f2bf(norm_elem("),
            "{src}"
        );
        assert!(
            src.contains("((unsigned short*)po)[i] = f2bf(nv);"),
            "{src}"
        );
        // A norm whose input is not a fused value stays `pt_norm`.
        let mut b = Builder::new();
        let x = b.input("x", Dtype::Bf16, &[1, 3, 8]).unwrap();
        let w = b.input("w", Dtype::Bf16, &[8, 8]).unwrap();
        let n = b.rms_norm(x, None, 1e-6).unwrap();
        let z = b.linear(n, w, None).unwrap();
        b.output("z", z).unwrap();
        let p = b.finish().unwrap();
        assert_eq!(plan_all(&p).role[n.index()], Role::Plain);
    }

    #[test]
    fn a_norm_read_off_its_own_elements_or_by_an_output_stays_a_kernel() {
        // The group's root broadcasts the norm over a leading dim: read at other elements.
        let mut b = Builder::new();
        let x = b.input("x", Dtype::F32, &[3, 8]).unwrap();
        let e = b.input("e", Dtype::F32, &[2, 3, 8]).unwrap();
        let n = b.rms_norm(x, None, 1e-6).unwrap();
        let y = b.mul(e, n).unwrap();
        b.output("y", y).unwrap();
        let p = b.finish().unwrap();
        let f = plan_all(&p);
        assert_eq!(f.role[n.index()], Role::Plain);
        assert!(f.groups.iter().all(|g| g.prologue.is_none()));
        // A norm that is an output is materialized.
        let (p, n, _) = ada_rms(true);
        assert_eq!(plan_all(&p).role[n.index()], Role::Plain);
    }

    #[test]
    fn a_head_merging_permute_runs_the_product_it_permutes() {
        for batch in [1, 2] {
            let mut b = Builder::new();
            let pr = b.input("p", Dtype::Bf16, &[batch, 4, 5, 6]).unwrap();
            let v = b.input("v", Dtype::Bf16, &[batch, 4, 6, 8]).unwrap();
            let q = b.input("q", Dtype::F32, &[batch, 4, 5, 8]).unwrap();
            let mm = b.matmul(pr, v).unwrap();
            let pm = b.permute(mm, &[0, 2, 1, 3]).unwrap();
            b.output("o", pm).unwrap();
            let at = b.attention(q, q, q, None, 0.5).unwrap();
            let pa = b.permute(at, &[0, 2, 1, 3]).unwrap();
            b.output("a", pa).unwrap();
            let p = b.finish().unwrap();
            let f = plan_all(&p);
            // A matmul's GEMM batches heads only; attention steps through B itself.
            let want = if batch == 1 {
                Role::Transposed
            } else {
                Role::Plain
            };
            assert_eq!(f.role[mm.index()], want, "batch {batch}");
            assert_eq!(f.role[at.index()], Role::Transposed, "batch {batch}");
            assert_eq!(f.role[pa.index()], Role::Plain, "the permute runs it");
        }
        // Another permute, or a second reader, keeps the product's own buffer.
        let mut b = Builder::new();
        let q = b.input("q", Dtype::F32, &[1, 4, 5, 8]).unwrap();
        let at = b.attention(q, q, q, None, 0.5).unwrap();
        let pa = b.permute(at, &[0, 1, 3, 2]).unwrap();
        b.output("a", pa).unwrap();
        let at2 = b.attention(q, q, q, None, 0.5).unwrap();
        let pb = b.permute(at2, &[0, 2, 1, 3]).unwrap();
        b.output("b", pb).unwrap();
        b.output("at2", at2).unwrap();
        let p = b.finish().unwrap();
        let f = plan_all(&p);
        assert_eq!(f.role[at.index()], Role::Plain);
        assert_eq!(f.role[at2.index()], Role::Plain);
    }

    #[test]
    fn attention_reads_heads_split_out_of_a_projection_in_place() {
        // [B, S, H·D] → [B, S, H, D] → [B, H, S, D], as SigLIP splits q, k and v.
        let mut b = Builder::new();
        let x = b.input("x", Dtype::F32, &[3, 5, 4 * 8]).unwrap();
        let split = |b: &mut Builder| {
            let r = b.reshape(x, &[3, 5, 4, 8]).unwrap();
            (r, b.permute(r, &[0, 2, 1, 3]).unwrap())
        };
        let (rq, q) = split(&mut b);
        let (_, k) = split(&mut b);
        let (_, v) = split(&mut b);
        let at = b.attention(q, k, v, None, 0.5).unwrap();
        b.output("a", at).unwrap();
        let p = b.finish().unwrap();
        let f = plan_all(&p);
        for (j, t) in [q, k, v].into_iter().enumerate() {
            let w = &f.views[&(at, j)];
            assert_eq!(w.base, x);
            assert_eq!(w.shape, vec![3, 4, 5, 8]);
            assert_eq!(w.strides, vec![5 * 32, 8, 32, 1], "operand {j}");
            assert_eq!(f.role[t.index()], Role::View);
        }
        assert_eq!(f.role[rq.index()], Role::View);
        // A transposed k (last stride not 1) is not a row-major head block: computed.
        let mut b = Builder::new();
        let q = b.input("q", Dtype::F32, &[1, 2, 5, 8]).unwrap();
        let kt = b.input("kt", Dtype::F32, &[1, 2, 8, 5]).unwrap();
        let k = b.permute(kt, &[0, 1, 3, 2]).unwrap();
        let at = b.attention(q, k, q, None, 0.5).unwrap();
        b.output("a", at).unwrap();
        let p = b.finish().unwrap();
        let f = plan_all(&p);
        assert!(!f.views.contains_key(&(at, 1)));
        assert!(matches!(f.role[k.index()], Role::Root(_)));
    }
}
