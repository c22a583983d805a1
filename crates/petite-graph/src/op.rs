//! The operator set and its type rules.
//!
//! # Conventions shared by every op
//! * Every node produces exactly one value (a tensor, or a tuple for `split`). Inputs are listed
//!   in [`crate::Node::inputs`] in the order each op's doc gives.
//! * Axes stored in ops are non-negative (`0..rank`); the [`crate::Builder`] accepts negative
//!   axes (`-1` = last) and normalises them.
//! * "Broadcast" means numpy broadcasting: shapes are right-aligned, missing leading dims count
//!   as 1, and each dim pair must be equal or contain a 1; the result takes the larger.
//! * Dtypes are never promoted implicitly: operands that must "agree" must have the same dtype,
//!   and programs insert explicit [`Op::Cast`]s (as lerobot does with `.to(dtype)`).
//! * Float numerics: executors compute each op in at least f32 precision and round the result
//!   once to the output dtype (round-to-nearest-even for bf16/f16). Ops documented as "computed
//!   in f32" (norms, softmax, attention) upcast their inputs first. Integer arithmetic wraps.
//! * Shapes are static; zero-sized dims are legal.

use crate::dtype::{Dtype, ShapeDisplay, TensorType, ValueType};
use serde::{Deserialize, Serialize};

/// Elementwise binary arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BinaryOp {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b` (floats only).
    Div,
}

/// Elementwise comparison producing `bool`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompareOp {
    /// `a < b`
    Lt,
    /// `a <= b`
    Le,
    /// `a == b`
    Eq,
    /// `a != b`
    Ne,
    /// `a > b`
    Gt,
    /// `a >= b`
    Ge,
}

/// Elementwise logical op on `bool`s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogicalOp {
    /// `a && b`
    And,
    /// `a || b`
    Or,
}

/// Elementwise unary math.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnaryOp {
    /// `-x` (floats and signed ints).
    Neg,
    /// `e^x`
    Exp,
    /// `sqrt(x)`
    Sqrt,
    /// `1 / sqrt(x)`
    Rsqrt,
    /// `sin(x)` (radians)
    Sin,
    /// `cos(x)` (radians)
    Cos,
    /// `tanh(x)`
    Tanh,
    /// GELU, tanh approximation (PyTorch `gelu(approximate="tanh")`, `gelu_pytorch_tanh`):
    /// `0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³)))`.
    GeluTanh,
    /// SiLU / swish: `x · sigmoid(x)` = `x / (1 + e^-x)`.
    Silu,
}

/// Reduction kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReduceOp {
    /// Sum (floats and ints; ints wrap).
    Sum,
    /// Arithmetic mean (floats only), accumulated in f32.
    Mean,
    /// Maximum (floats and ints); reducing a zero-sized axis is a runtime error.
    Max,
}

/// An operation. Each node holds one `Op`, its inputs (value ids, in the order documented per
/// variant) and the type of the value it produces.
///
/// Sources (`Input`, `Weight`, `Constant`) have no inputs; their type is declared, not inferred.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// A named graph input; the node's declared type is the input's type. Listed, in call order,
    /// in [`crate::Program::inputs`].
    Input {
        /// Unique input name.
        name: String,
    },
    /// A weight referenced by its checkpoint tensor name. The declared dtype is the dtype the
    /// program consumes (a weight source converts if the checkpoint stores another); the shape
    /// must equal the checkpoint's. No bytes are held: planning never reads weights.
    ///
    /// With `rows = Some([start, end])` the node is rows `start..end` of axis 0 of the checkpoint
    /// tensor and its declared shape is the slice's (`[end − start, rest…]`, `rest` as stored).
    /// Row-major storage makes those rows one contiguous byte range, so a source hands out a
    /// sub-view without copying and an engine holds only those bytes: this is how a weight
    /// larger than an engine cap (pi0.5's 1 GiB token embedding) is split across engines.
    Weight {
        /// Checkpoint tensor name. Unique within a program unless `rows` is set; row ranges of
        /// one name must not overlap.
        name: String,
        /// Row range `[start, end)` of axis 0 (non-empty), or `None` for the whole tensor.
        /// Omitted from JSON when `None`, so whole-tensor programs serialise as before.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rows: Option<[usize; 2]>,
    },
    /// A small inline tensor (e.g. an `inv_freq` table, an `arange`, a scalar). `data` holds
    /// exactly `numel × dtype size` bytes in the layout of [`Dtype`]. Serialised as hex.
    Constant {
        /// Little-endian row-major element bytes.
        #[serde(with = "crate::hex")]
        data: Vec<u8>,
    },

    /// `y = x · Wᵀ (+ b)`. Inputs `[x, weight]` or `[x, weight, bias]`:
    /// x `[..., in]` (rank ≥ 1), weight `[out, in]` (PyTorch layout), bias `[out]`.
    /// All same float dtype. Output `[..., out]`, that dtype.
    Linear,
    /// (Batched) matrix product. Inputs `[a, b]`: a `[..., M, K]`, b `[..., K, N]`, both rank ≥ 2,
    /// the leading (batch) dims broadcast. Same float dtype. Output `[broadcast..., M, N]`.
    MatMul,
    /// 2-D convolution, NCHW, no dilation, one group, zero padding on both sides of each
    /// spatial dim. Inputs `[x, weight]` or `[x, weight, bias]`: x `[N, C, H, W]`,
    /// weight `[O, C, KH, KW]`, bias `[O]`; same float dtype. Output `[N, O, H', W']` with
    /// `H' = (H + 2·padding[0] − KH) / stride[0] + 1` (floor), likewise W'.
    Conv2d {
        /// `[stride_h, stride_w]`, each ≥ 1.
        stride: [usize; 2],
        /// `[pad_h, pad_w]` zeros added on both sides.
        padding: [usize; 2],
    },
    /// Layer norm over the last dim, computed in f32:
    /// `(x − mean) / sqrt(var + eps) · weight + bias` with the biased variance.
    /// Inputs `[x, weight, bias]`: x `[..., D]` (rank ≥ 1), weight `[D]`, bias `[D]`, all float
    /// (dtypes may differ). Output: x's shape and dtype.
    LayerNorm {
        /// Added to the variance.
        eps: f64,
    },
    /// Gemma RMS norm over the last dim, computed in f32:
    /// `x · rsqrt(mean(x²) + eps) · (1 + weight)`; without a weight input it is
    /// `x · rsqrt(mean(x²) + eps)` (the weightless norm inside adaRMS).
    /// Inputs `[x]` or `[x, weight]`: x `[..., D]` (rank ≥ 1) float, weight `[D]` float (any
    /// float dtype). Output: x's shape and dtype (lerobot: computed in fp32, cast back).
    RmsNorm {
        /// Added to the mean square.
        eps: f64,
    },
    /// Elementwise `a (op) b` with broadcasting. Inputs `[a, b]`, same numeric (non-bool) dtype;
    /// `Div` needs floats. Output: broadcast shape, that dtype.
    Binary {
        /// Which operation.
        kind: BinaryOp,
    },
    /// Elementwise op with a scalar: `x (op) scalar`, or `scalar (op) x` when `scalar_lhs`
    /// (e.g. `1 − t`). Input `[x]`, numeric; the scalar is converted to x's dtype first —
    /// for floats rounded to f32, then (bf16/f16) to nearest even, so `mul_scalar(bf16 x,
    /// √2048)` multiplies by 45.25 as lerobot's bf16 `embed_scale` does; integer dtypes require
    /// an integral scalar. Output: x's shape and dtype.
    BinaryScalar {
        /// Which operation.
        kind: BinaryOp,
        /// The scalar operand.
        scalar: f64,
        /// True: `scalar (op) x`; false: `x (op) scalar`.
        scalar_lhs: bool,
    },
    /// Elementwise comparison with broadcasting. Inputs `[a, b]`, same dtype (any; `false <
    /// true`). Output: broadcast shape, `bool`.
    Compare {
        /// Which comparison.
        kind: CompareOp,
    },
    /// Elementwise logical and/or with broadcasting. Inputs `[a, b]`, both `bool`. Output
    /// broadcast shape, `bool`.
    Logical {
        /// Which operation.
        kind: LogicalOp,
    },
    /// Logical not. Input `[x]` `bool`. Output same shape, `bool`.
    Not,
    /// Elementwise unary math. Input `[x]`: float (`Neg` also accepts i64/i32). Output: x's
    /// shape and dtype.
    Unary {
        /// Which function.
        kind: UnaryOp,
    },
    /// Softmax along `axis`, computed in f32 (max-subtracted). Input `[x]` float. Output: x's
    /// shape and dtype.
    Softmax {
        /// Normalised axis.
        axis: usize,
    },
    /// Rotary position embedding, `rotate_half` (halves, not interleaved):
    /// `y = x·cos + rotate_half(x)·sin`, `rotate_half(x) = cat(−x[..., D/2:], x[..., :D/2])`.
    /// Inputs `[x, cos, sin]`: x `[..., D]` with D even; cos and sin must broadcast to exactly
    /// x's shape (e.g. `[B, 1, S, D]` for x `[B, H, S, D]`); all same float dtype.
    /// Output: x's shape and dtype.
    Rope,
    /// Scaled dot-product attention with grouped/multi-query KV heads.
    /// Inputs `[q, k, v]` or `[q, k, v, mask]`: q `[B, H, Q, D]`, k `[B, KVH, K, D]`,
    /// v `[B, KVH, K, Dv]`, `H % KVH == 0`, query head `h` reads KV head `h / (H / KVH)`;
    /// q/k/v same float dtype; mask (optional) any float dtype, additive, broadcastable to
    /// `[B, H, Q, K]`. Computed in f32: `softmax(q·kᵀ·scale + mask, over K) · v`.
    /// Output `[B, H, Q, Dv]`, q's dtype.
    Attention {
        /// Multiplies the logits (usually `D^-0.5`); explicit so nothing is implied.
        scale: f64,
    },
    /// Row gather. Inputs `[table, indices]`: table `[V, D]` any dtype, indices any shape `S`,
    /// i64 or i32, each in `0..V` (checked at run time). Output `S + [D]`, table's dtype.
    Embedding,
    /// Concatenation along `axis`. Inputs: one or more tensors, same dtype and rank, equal dims
    /// except `axis`. Output: dims summed along `axis`.
    Concat {
        /// Normalised axis.
        axis: usize,
    },
    /// Strided slice of one axis: elements `start, start+step, …` below `end`.
    /// Input `[x]`; requires `start <= end <= dim`, `step >= 1` (the builder clamps
    /// Python-style bounds). Output dim `ceil((end − start) / step)`, other dims unchanged.
    Slice {
        /// Normalised axis.
        axis: usize,
        /// First index.
        start: usize,
        /// One past the last index considered.
        end: usize,
        /// Stride, ≥ 1.
        step: usize,
    },
    /// Row-major reinterpretation of the dims (also unsqueeze/squeeze/flatten). Input `[x]`;
    /// element count must be unchanged. Output: `shape`, x's dtype.
    Reshape {
        /// New dims.
        shape: Vec<usize>,
    },
    /// Axis permutation: output dim `i` is input dim `perm[i]` (torch `permute`; a transpose
    /// is a permutation swapping two axes). Input `[x]`. Output x's dtype.
    Permute {
        /// A permutation of `0..rank`.
        perm: Vec<usize>,
    },
    /// Broadcast to `shape` (torch `expand` / numpy `broadcast_to`): x's dims, right-aligned,
    /// must each be 1 or equal to the target's; rank may grow. Input `[x]`. Output `shape`.
    Expand {
        /// Target dims.
        shape: Vec<usize>,
    },
    /// A weight-only quantized weight back in a float dtype (issue 51): `y[r, …] =
    /// code[r, …] · scale[r]`, computed in f32 and rounded once to `to`. Inputs `[codes,
    /// scale]`: codes `[R, …]` (rank ≥ 1) of a quantized code dtype (`i8`: the integer; `f8e4m3`:
    /// its FP8 value), scale `[R]` f32, one a row (an output channel of a linear weight, see
    /// [`petite_dtype::quant`]). Output: codes' shape, dtype `to` (a float). The only op that reads
    /// codes; a backend lowers it to its dequantize (ONNX `DequantizeLinear` on axis 0) or fuses
    /// it into the product that reads its output.
    Dequantize {
        /// Float dtype of the output.
        to: Dtype,
    },
    /// Dtype conversion. Input `[x]`. Float → bf16/f16: round to nearest even; float → int:
    /// truncate toward zero (out of range is undefined); anything → bool: `x != 0`;
    /// bool → number: 0 or 1. Output: x's shape, dtype `to`.
    Cast {
        /// Target dtype.
        to: Dtype,
    },
    /// Inclusive cumulative sum along `axis`. Input `[x]` numeric (cast bools first). Output:
    /// x's shape and dtype.
    CumSum {
        /// Normalised axis.
        axis: usize,
    },
    /// `cond ? a : b` elementwise with broadcasting of all three. Inputs `[cond, a, b]`:
    /// cond `bool`; a and b the same dtype. Output: broadcast shape, a's dtype.
    Where,
    /// Reduction over `axes`. Input `[x]`. `axes` sorted, unique, each `< rank`; an empty list
    /// is rejected. Output: reduced dims removed, or kept as 1 when `keepdim`; x's dtype.
    Reduce {
        /// Which reduction.
        kind: ReduceOp,
        /// Sorted, unique normalised axes.
        axes: Vec<usize>,
        /// Keep reduced dims as size 1.
        keepdim: bool,
    },
    /// Split along `axis` into consecutive pieces of `sizes` (which sum to the dim). Input
    /// `[x]`. Output: a **tuple** of tensors; consume each piece through a `GetItem`.
    Split {
        /// Normalised axis.
        axis: usize,
        /// Piece lengths, in order.
        sizes: Vec<usize>,
    },
    /// Element `index` of a tuple. Input `[tuple]` (a `Split` output). Output: that tensor.
    GetItem {
        /// Tuple index.
        index: usize,
    },
}

impl Op {
    /// Short stable name used in messages (`"linear"`, `"add"`, `"lt"`, …).
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Weight { .. } => "weight",
            Op::Constant { .. } => "constant",
            Op::Linear => "linear",
            Op::MatMul => "matmul",
            Op::Conv2d { .. } => "conv2d",
            Op::LayerNorm { .. } => "layer_norm",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Binary { kind } | Op::BinaryScalar { kind, .. } => match kind {
                BinaryOp::Add => "add",
                BinaryOp::Sub => "sub",
                BinaryOp::Mul => "mul",
                BinaryOp::Div => "div",
            },
            Op::Compare { kind } => match kind {
                CompareOp::Lt => "lt",
                CompareOp::Le => "le",
                CompareOp::Eq => "eq",
                CompareOp::Ne => "ne",
                CompareOp::Gt => "gt",
                CompareOp::Ge => "ge",
            },
            Op::Logical { kind } => match kind {
                LogicalOp::And => "and",
                LogicalOp::Or => "or",
            },
            Op::Not => "not",
            Op::Unary { kind } => match kind {
                UnaryOp::Neg => "neg",
                UnaryOp::Exp => "exp",
                UnaryOp::Sqrt => "sqrt",
                UnaryOp::Rsqrt => "rsqrt",
                UnaryOp::Sin => "sin",
                UnaryOp::Cos => "cos",
                UnaryOp::Tanh => "tanh",
                UnaryOp::GeluTanh => "gelu_tanh",
                UnaryOp::Silu => "silu",
            },
            Op::Softmax { .. } => "softmax",
            Op::Rope => "rope",
            Op::Attention { .. } => "attention",
            Op::Embedding => "embedding",
            Op::Concat { .. } => "concat",
            Op::Slice { .. } => "slice",
            Op::Reshape { .. } => "reshape",
            Op::Permute { .. } => "permute",
            Op::Expand { .. } => "expand",
            Op::Cast { .. } => "cast",
            Op::Dequantize { .. } => "dequantize",
            Op::CumSum { .. } => "cumsum",
            Op::Where => "where",
            Op::Reduce { kind, .. } => match kind {
                ReduceOp::Sum => "sum",
                ReduceOp::Mean => "mean",
                ReduceOp::Max => "max",
            },
            Op::Split { .. } => "split",
            Op::GetItem { .. } => "getitem",
        }
    }

    /// True for `Input`, `Weight` and `Constant`: nodes with no inputs and a declared type.
    pub fn is_source(&self) -> bool {
        matches!(
            self,
            Op::Input { .. } | Op::Weight { .. } | Op::Constant { .. }
        )
    }

    /// True if the op produces a tuple (consumed only through `GetItem`).
    pub fn is_multi_output(&self) -> bool {
        matches!(self, Op::Split { .. })
    }

    /// Inclusive range of accepted input counts (`usize::MAX` = unbounded).
    pub fn arity(&self) -> (usize, usize) {
        match self {
            Op::Input { .. } | Op::Weight { .. } | Op::Constant { .. } => (0, 0),
            Op::Linear | Op::Conv2d { .. } => (2, 3),
            Op::LayerNorm { .. } => (3, 3),
            Op::RmsNorm { .. } => (1, 2),
            Op::Binary { .. } | Op::Compare { .. } | Op::Logical { .. } => (2, 2),
            Op::MatMul | Op::Embedding | Op::Dequantize { .. } => (2, 2),
            Op::Rope | Op::Where => (3, 3),
            Op::Attention { .. } => (3, 4),
            Op::Concat { .. } => (1, usize::MAX),
            Op::BinaryScalar { .. }
            | Op::Not
            | Op::Unary { .. }
            | Op::Softmax { .. }
            | Op::Slice { .. }
            | Op::Reshape { .. }
            | Op::Permute { .. }
            | Op::Expand { .. }
            | Op::Cast { .. }
            | Op::CumSum { .. }
            | Op::Reduce { .. }
            | Op::Split { .. }
            | Op::GetItem { .. } => (1, 1),
        }
    }

    /// Infers the type of the value this op produces from its inputs' types.
    ///
    /// Returns `Ok(None)` for sources (their type is declared). `Err` carries a message saying
    /// which input is wrong, what was expected and what was found; callers add the node.
    pub fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<Option<ValueType>, String> {
        let (lo, hi) = self.arity();
        if inputs.len() < lo || inputs.len() > hi {
            let expected = if lo == hi {
                format!("{lo}")
            } else if hi == usize::MAX {
                format!("at least {lo}")
            } else {
                format!("{lo} to {hi}")
            };
            return Err(format!(
                "expected {expected} inputs, found {}",
                inputs.len()
            ));
        }
        if let Op::GetItem { index } = self {
            return match inputs[0] {
                ValueType::Tuple(ts) => match ts.get(*index) {
                    Some(t) => Ok(Some(ValueType::Tensor(t.clone()))),
                    None => Err(format!(
                        "index {index} out of range for a tuple of {} elements",
                        ts.len()
                    )),
                },
                ValueType::Tensor(t) => Err(format!(
                    "input 0: expected a tuple (output of a multi-output op), found tensor {t}"
                )),
            };
        }
        let mut ts: Vec<&TensorType> = Vec::with_capacity(inputs.len());
        for (i, v) in inputs.iter().enumerate() {
            match v {
                ValueType::Tensor(t) => ts.push(t),
                ValueType::Tuple(_) => {
                    return Err(format!(
                        "input {i}: expected a tensor, found tuple {v} (use getitem)"
                    ));
                }
            }
        }
        let out = infer_tensor(self, &ts)?;
        if let Some(ty) = &out {
            let pieces: &[TensorType] = match ty {
                ValueType::Tensor(t) => std::slice::from_ref(t),
                ValueType::Tuple(ts) => ts,
            };
            for t in pieces {
                if t.checked_nbytes().is_none() {
                    return Err(format!("result {t} is too large (its byte size overflows)"));
                }
            }
        }
        Ok(out)
    }
}

fn tt(dtype: Dtype, shape: Vec<usize>) -> TensorType {
    TensorType { dtype, shape }
}

fn shp(s: &[usize]) -> ShapeDisplay<'_> {
    ShapeDisplay(s)
}

fn need_float(i: usize, what: &str, t: &TensorType) -> std::result::Result<(), String> {
    if t.dtype.is_float() {
        Ok(())
    } else {
        Err(format!(
            "input {i} ({what}): expected a float dtype (f32, bf16, f16), found {}",
            t.dtype
        ))
    }
}

fn need_dtype(i: usize, what: &str, t: &TensorType, d: Dtype) -> std::result::Result<(), String> {
    if t.dtype == d {
        Ok(())
    } else {
        Err(format!(
            "input {i} ({what}): expected dtype {d} (same as input 0), found {}",
            t.dtype
        ))
    }
}

fn need_min_rank(
    i: usize,
    what: &str,
    t: &TensorType,
    r: usize,
) -> std::result::Result<(), String> {
    if t.rank() >= r {
        Ok(())
    } else {
        Err(format!(
            "input {i} ({what}): expected rank >= {r}, found shape {}",
            shp(&t.shape)
        ))
    }
}

fn need_axis(axis: usize, rank: usize) -> std::result::Result<(), String> {
    if axis < rank {
        Ok(())
    } else {
        Err(format!("axis {axis} out of range for rank {rank}"))
    }
}

/// Numpy broadcast of two shapes.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> std::result::Result<Vec<usize>, String> {
    let r = a.len().max(b.len());
    let mut out = vec![0; r];
    for i in 0..r {
        let da = if i + a.len() >= r {
            a[i + a.len() - r]
        } else {
            1
        };
        let db = if i + b.len() >= r {
            b[i + b.len() - r]
        } else {
            1
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(format!(
                "shapes {} and {} do not broadcast (dim {i} of the result: {da} vs {db})",
                shp(a),
                shp(b)
            ));
        };
    }
    Ok(out)
}

/// True if `from` broadcasts to exactly `to`.
pub fn broadcasts_to(from: &[usize], to: &[usize]) -> bool {
    from.len() <= to.len()
        && from
            .iter()
            .rev()
            .zip(to.iter().rev())
            .all(|(&f, &t)| f == t || f == 1)
}

fn infer_tensor(op: &Op, t: &[&TensorType]) -> std::result::Result<Option<ValueType>, String> {
    if !matches!(op, Op::Dequantize { .. })
        && let Some((i, c)) = t.iter().enumerate().find(|(_, c)| c.dtype.is_quant_code())
    {
        return Err(format!(
            "input {i}: {} codes are read only by dequantize (dequantize the weight first)",
            c.dtype
        ));
    }
    let out = match op {
        Op::Input { .. } | Op::Weight { .. } | Op::Constant { .. } => return Ok(None),
        Op::GetItem { .. } => unreachable!("handled by Op::infer"),
        Op::Linear => {
            let (x, w) = (t[0], t[1]);
            need_float(0, "x", x)?;
            need_min_rank(0, "x", x, 1)?;
            need_dtype(1, "weight", w, x.dtype)?;
            let inn = x.shape[x.rank() - 1];
            if w.rank() != 2 || w.shape[1] != inn {
                return Err(format!(
                    "input 1 (weight): expected shape [out, {inn}] for x {}, found {}",
                    shp(&x.shape),
                    shp(&w.shape)
                ));
            }
            let outf = w.shape[0];
            if let Some(b) = t.get(2) {
                need_dtype(2, "bias", b, x.dtype)?;
                if b.shape != [outf] {
                    return Err(format!(
                        "input 2 (bias): expected shape [{outf}], found {}",
                        shp(&b.shape)
                    ));
                }
            }
            let mut s = x.shape.clone();
            *s.last_mut().expect("rank >= 1") = outf;
            tt(x.dtype, s)
        }
        Op::MatMul => {
            let (a, b) = (t[0], t[1]);
            need_float(0, "a", a)?;
            need_min_rank(0, "a", a, 2)?;
            need_min_rank(1, "b", b, 2)?;
            need_dtype(1, "b", b, a.dtype)?;
            let (m, k) = (a.shape[a.rank() - 2], a.shape[a.rank() - 1]);
            let (k2, n) = (b.shape[b.rank() - 2], b.shape[b.rank() - 1]);
            if k != k2 {
                return Err(format!(
                    "contraction dims differ: a {} has K = {k}, b {} has K = {k2}",
                    shp(&a.shape),
                    shp(&b.shape)
                ));
            }
            let mut s = broadcast_shapes(&a.shape[..a.rank() - 2], &b.shape[..b.rank() - 2])
                .map_err(|e| format!("batch dims: {e}"))?;
            s.push(m);
            s.push(n);
            tt(a.dtype, s)
        }
        Op::Conv2d { stride, padding } => {
            let (x, w) = (t[0], t[1]);
            need_float(0, "x", x)?;
            need_dtype(1, "weight", w, x.dtype)?;
            if x.rank() != 4 {
                return Err(format!(
                    "input 0 (x): expected [N, C, H, W], found {}",
                    shp(&x.shape)
                ));
            }
            if w.rank() != 4 || w.shape[1] != x.shape[1] {
                return Err(format!(
                    "input 1 (weight): expected [O, {}, KH, KW], found {}",
                    x.shape[1],
                    shp(&w.shape)
                ));
            }
            if stride[0] == 0 || stride[1] == 0 {
                return Err(format!("stride must be >= 1, found {stride:?}"));
            }
            let o = w.shape[0];
            if let Some(b) = t.get(2) {
                need_dtype(2, "bias", b, x.dtype)?;
                if b.shape != [o] {
                    return Err(format!(
                        "input 2 (bias): expected shape [{o}], found {}",
                        shp(&b.shape)
                    ));
                }
            }
            let mut s = vec![x.shape[0], o, 0, 0];
            for d in 0..2 {
                let full = padding[d]
                    .checked_mul(2)
                    .and_then(|p| p.checked_add(x.shape[2 + d]))
                    .ok_or_else(|| format!("padding {padding:?} overflows"))?;
                let k = w.shape[2 + d];
                if k == 0 || full < k {
                    return Err(format!(
                        "kernel {} larger than padded input {} (x {}, padding {padding:?})",
                        shp(&w.shape[2..]),
                        full,
                        shp(&x.shape)
                    ));
                }
                s[2 + d] = (full - k) / stride[d] + 1;
            }
            tt(x.dtype, s)
        }
        Op::LayerNorm { .. } => {
            let x = t[0];
            need_float(0, "x", x)?;
            need_min_rank(0, "x", x, 1)?;
            let d = x.shape[x.rank() - 1];
            for (i, what) in [(1, "weight"), (2, "bias")] {
                need_float(i, what, t[i])?;
                if t[i].shape != [d] {
                    return Err(format!(
                        "input {i} ({what}): expected shape [{d}], found {}",
                        shp(&t[i].shape)
                    ));
                }
            }
            x.clone()
        }
        Op::RmsNorm { .. } => {
            let x = t[0];
            need_float(0, "x", x)?;
            need_min_rank(0, "x", x, 1)?;
            let d = x.shape[x.rank() - 1];
            if let Some(w) = t.get(1) {
                need_float(1, "weight", w)?;
                if w.shape != [d] {
                    return Err(format!(
                        "input 1 (weight): expected shape [{d}], found {}",
                        shp(&w.shape)
                    ));
                }
            }
            x.clone()
        }
        Op::Binary { kind } => {
            let (a, b) = (t[0], t[1]);
            if !a.dtype.is_numeric() {
                return Err("input 0: expected a numeric dtype, found bool".into());
            }
            if *kind == BinaryOp::Div {
                need_float(0, "a", a)?;
            }
            need_dtype(1, "b", b, a.dtype)?;
            tt(a.dtype, broadcast_shapes(&a.shape, &b.shape)?)
        }
        Op::BinaryScalar { kind, scalar, .. } => {
            let x = t[0];
            if !x.dtype.is_numeric() {
                return Err("input 0: expected a numeric dtype, found bool".into());
            }
            if *kind == BinaryOp::Div {
                need_float(0, "x", x)?;
            }
            if x.dtype.is_int() && (scalar.fract() != 0.0 || !scalar.is_finite()) {
                return Err(format!(
                    "scalar {scalar} is not an integer but x is {}",
                    x.dtype
                ));
            }
            x.clone()
        }
        Op::Compare { .. } => {
            let (a, b) = (t[0], t[1]);
            need_dtype(1, "b", b, a.dtype)?;
            tt(Dtype::Bool, broadcast_shapes(&a.shape, &b.shape)?)
        }
        Op::Logical { .. } => {
            for (i, x) in t.iter().enumerate() {
                need_bool(i, x)?;
            }
            tt(Dtype::Bool, broadcast_shapes(&t[0].shape, &t[1].shape)?)
        }
        Op::Not => {
            need_bool(0, t[0])?;
            t[0].clone()
        }
        Op::Unary { kind } => {
            let x = t[0];
            let ok = x.dtype.is_float()
                || (*kind == UnaryOp::Neg && matches!(x.dtype, Dtype::I64 | Dtype::I32));
            if !ok {
                return Err(format!(
                    "input 0: {} needs a float dtype{}, found {}",
                    op.name(),
                    if *kind == UnaryOp::Neg {
                        " or i64/i32"
                    } else {
                        ""
                    },
                    x.dtype
                ));
            }
            x.clone()
        }
        Op::Softmax { axis } => {
            need_float(0, "x", t[0])?;
            need_axis(*axis, t[0].rank())?;
            t[0].clone()
        }
        Op::Rope => {
            let x = t[0];
            need_float(0, "x", x)?;
            need_min_rank(0, "x", x, 1)?;
            let d = x.shape[x.rank() - 1];
            if !d.is_multiple_of(2) {
                return Err(format!(
                    "input 0 (x): last dim must be even for rotate_half, found {}",
                    shp(&x.shape)
                ));
            }
            for (i, what) in [(1, "cos"), (2, "sin")] {
                need_dtype(i, what, t[i], x.dtype)?;
                if !broadcasts_to(&t[i].shape, &x.shape) {
                    return Err(format!(
                        "input {i} ({what}): expected a shape that broadcasts to x {}, found {}",
                        shp(&x.shape),
                        shp(&t[i].shape)
                    ));
                }
            }
            x.clone()
        }
        Op::Attention { .. } => {
            let (q, k, v) = (t[0], t[1], t[2]);
            need_float(0, "q", q)?;
            need_dtype(1, "k", k, q.dtype)?;
            need_dtype(2, "v", v, q.dtype)?;
            for (i, what, x) in [
                (0, "q [B, H, Q, D]", q),
                (1, "k [B, KVH, K, D]", k),
                (2, "v [B, KVH, K, Dv]", v),
            ] {
                if x.rank() != 4 {
                    return Err(format!(
                        "input {i}: expected {what}, found {}",
                        shp(&x.shape)
                    ));
                }
            }
            let (b, h, nq, d) = (q.shape[0], q.shape[1], q.shape[2], q.shape[3]);
            let (kvh, nk) = (k.shape[1], k.shape[2]);
            if k.shape[0] != b || k.shape[3] != d {
                return Err(format!(
                    "input 1 (k): expected [{b}, KVH, K, {d}] for q {}, found {}",
                    shp(&q.shape),
                    shp(&k.shape)
                ));
            }
            if kvh == 0 || !h.is_multiple_of(kvh) {
                return Err(format!(
                    "query heads {h} must be a multiple of kv heads {kvh} (q {}, k {})",
                    shp(&q.shape),
                    shp(&k.shape)
                ));
            }
            if v.shape[0] != b || v.shape[1] != kvh || v.shape[2] != nk {
                return Err(format!(
                    "input 2 (v): expected [{b}, {kvh}, {nk}, Dv] matching k {}, found {}",
                    shp(&k.shape),
                    shp(&v.shape)
                ));
            }
            if let Some(m) = t.get(3) {
                need_float(3, "mask", m)?;
                let full = [b, h, nq, nk];
                if !broadcasts_to(&m.shape, &full) {
                    return Err(format!(
                        "input 3 (mask): expected a shape broadcastable to [B, H, Q, K] = {}, found {}",
                        shp(&full),
                        shp(&m.shape)
                    ));
                }
            }
            tt(q.dtype, vec![b, h, nq, v.shape[3]])
        }
        Op::Embedding => {
            let (table, idx) = (t[0], t[1]);
            if table.rank() != 2 {
                return Err(format!(
                    "input 0 (table): expected [V, D], found {}",
                    shp(&table.shape)
                ));
            }
            if !matches!(idx.dtype, Dtype::I64 | Dtype::I32) {
                return Err(format!(
                    "input 1 (indices): expected dtype i64 or i32, found {}",
                    idx.dtype
                ));
            }
            let mut s = idx.shape.clone();
            s.push(table.shape[1]);
            tt(table.dtype, s)
        }
        Op::Concat { axis } => {
            let first = t[0];
            need_axis(*axis, first.rank())?;
            let mut s = first.shape.clone();
            for (i, x) in t.iter().enumerate().skip(1) {
                need_dtype(i, "tensor", x, first.dtype)?;
                let same_rest = x.rank() == first.rank()
                    && x.shape
                        .iter()
                        .zip(&first.shape)
                        .enumerate()
                        .all(|(d, (a, b))| d == *axis || a == b);
                if !same_rest {
                    return Err(format!(
                        "input {i}: expected shape {} except along axis {axis}, found {}",
                        shp(&first.shape),
                        shp(&x.shape)
                    ));
                }
                s[*axis] = s[*axis]
                    .checked_add(x.shape[*axis])
                    .ok_or_else(|| format!("concatenated dim {axis} overflows"))?;
            }
            tt(first.dtype, s)
        }
        Op::Slice {
            axis,
            start,
            end,
            step,
        } => {
            let x = t[0];
            need_axis(*axis, x.rank())?;
            let dim = x.shape[*axis];
            if *step == 0 || start > end || *end > dim {
                return Err(format!(
                    "expected 0 <= start <= end <= {dim} and step >= 1 on axis {axis} of {}, found start {start}, end {end}, step {step}",
                    shp(&x.shape)
                ));
            }
            let mut s = x.shape.clone();
            s[*axis] = (end - start).div_ceil(*step);
            tt(x.dtype, s)
        }
        Op::Reshape { shape } => {
            let x = t[0];
            let out = tt(x.dtype, shape.clone());
            if out.checked_numel().is_none() || out.numel() != x.numel() {
                return Err(format!(
                    "cannot reshape {} ({} elements) to {} ({} elements)",
                    shp(&x.shape),
                    x.numel(),
                    shp(shape),
                    out.numel()
                ));
            }
            out
        }
        Op::Permute { perm } => {
            let x = t[0];
            let mut seen = vec![false; x.rank()];
            let valid = perm.len() == x.rank()
                && perm
                    .iter()
                    .all(|&p| p < seen.len() && !std::mem::replace(&mut seen[p], true));
            if !valid {
                return Err(format!(
                    "perm {perm:?} is not a permutation of 0..{} (x {})",
                    x.rank(),
                    shp(&x.shape)
                ));
            }
            tt(x.dtype, perm.iter().map(|&p| x.shape[p]).collect())
        }
        Op::Expand { shape } => {
            let x = t[0];
            if !broadcasts_to(&x.shape, shape) {
                return Err(format!("cannot expand {} to {}", shp(&x.shape), shp(shape)));
            }
            tt(x.dtype, shape.clone())
        }
        Op::Cast { to } => {
            if t[0].dtype.is_quant_code() || to.is_quant_code() {
                return Err(format!(
                    "no cast from {} to {to}: quantized codes are read only by dequantize",
                    t[0].dtype
                ));
            }
            tt(*to, t[0].shape.clone())
        }
        Op::Dequantize { to } => {
            let (c, s) = (t[0], t[1]);
            if !c.dtype.is_quant_code() {
                return Err(format!(
                    "input 0 (codes): expected a quantized code dtype (i8, f8e4m3), found {}",
                    c.dtype
                ));
            }
            need_min_rank(0, "codes", c, 1)?;
            if s.dtype != Dtype::F32 || s.shape != [c.shape[0]] {
                return Err(format!(
                    "input 1 (scale): expected f32[{}] (one scale a row of codes {}), found {}{}",
                    c.shape[0],
                    shp(&c.shape),
                    s.dtype,
                    shp(&s.shape)
                ));
            }
            if !to.is_float() {
                return Err(format!("dequantize to {to}: expected a float dtype"));
            }
            tt(*to, c.shape.clone())
        }
        Op::CumSum { axis } => {
            let x = t[0];
            if !x.dtype.is_numeric() {
                return Err(
                    "input 0: cumsum needs a numeric dtype, found bool (cast first)".into(),
                );
            }
            need_axis(*axis, x.rank())?;
            x.clone()
        }
        Op::Where => {
            let (c, a, b) = (t[0], t[1], t[2]);
            need_bool(0, c)?;
            if b.dtype != a.dtype {
                return Err(format!(
                    "input 2 (b): expected dtype {} (same as input 1), found {}",
                    a.dtype, b.dtype
                ));
            }
            let s = broadcast_shapes(&c.shape, &a.shape)?;
            tt(a.dtype, broadcast_shapes(&s, &b.shape)?)
        }
        Op::Reduce {
            kind,
            axes,
            keepdim,
        } => {
            let x = t[0];
            match kind {
                ReduceOp::Mean => need_float(0, "x", x)?,
                _ if !x.dtype.is_numeric() => {
                    return Err("input 0: expected a numeric dtype, found bool".into());
                }
                _ => {}
            }
            if axes.is_empty() || axes.windows(2).any(|w| w[0] >= w[1]) {
                return Err(format!(
                    "axes must be non-empty, sorted and unique, found {axes:?}"
                ));
            }
            for &a in axes {
                need_axis(a, x.rank())?;
            }
            let mut s = Vec::with_capacity(x.rank());
            for (d, &n) in x.shape.iter().enumerate() {
                if axes.contains(&d) {
                    if *keepdim {
                        s.push(1);
                    }
                } else {
                    s.push(n);
                }
            }
            tt(x.dtype, s)
        }
        Op::Split { axis, sizes } => {
            let x = t[0];
            need_axis(*axis, x.rank())?;
            let total = sizes.iter().try_fold(0usize, |a, &n| a.checked_add(n));
            if sizes.is_empty() || total != Some(x.shape[*axis]) {
                return Err(format!(
                    "sizes {sizes:?} must be non-empty and sum to dim {} of axis {axis} of {}",
                    x.shape[*axis],
                    shp(&x.shape)
                ));
            }
            let pieces = sizes
                .iter()
                .map(|&n| {
                    let mut s = x.shape.clone();
                    s[*axis] = n;
                    tt(x.dtype, s)
                })
                .collect();
            return Ok(Some(ValueType::Tuple(pieces)));
        }
    };
    Ok(Some(ValueType::Tensor(out)))
}

fn need_bool(i: usize, t: &TensorType) -> std::result::Result<(), String> {
    if t.dtype == Dtype::Bool {
        Ok(())
    } else {
        Err(format!("input {i}: expected dtype bool, found {}", t.dtype))
    }
}
