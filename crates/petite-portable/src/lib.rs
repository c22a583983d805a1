//! petite-portable: petite-graph programs as ExecuTorch `.pte` methods made of portable kernel
//! calls (`aten::mm.out`, `aten::_softmax.out`, …), with no delegate, so any ExecuTorch runtime on
//! any CPU runs them — and ExecuTorch's own runtime can check petite's programs end to end.
//!
//! * [`lower()`]: ops → kernel calls with full schema argument lists ([`lower::Lowered`]).
//! * [`plan()`]: one planned buffer, memory reused by value lifetime (greedy by size).
//! * [`export_portable`]: writes a one-method `.pte`; each weight is converted (and transposed
//!   where the lowering stores it so) straight into the constant segment, in bounded chunks from
//!   the mapped [`WeightSource`]: written once, never all in memory.
//! * [`write_mapping`] + [`write_program`]: the exporter's two stages — every weight once in the
//!   exact dtype and layout the `.pte` stores (a cacheable mapping file), then `.pte` files with
//!   several methods whose constants are regions of that file, copied in-kernel
//!   (`copy_file_range`).
//!
//! Knows nothing of pi0.5. Only operators registered by both `executorch-numpy-runtime` 1.4.0
//! and the `executorch` 1.5.1 pybindings are emitted ([`OPERATORS`]).
#![deny(missing_docs)]

pub mod lower;
pub mod plan;

use std::io::Write;
use std::path::{Path, PathBuf};

use petite_graph::{Dtype, Program};
use petite_pte::model::ScalarType;
use petite_pte::{MethodBuilder, ProgramBuilder, SegmentData, WriteOptions, WriteSummary};
use petite_weights::{
    Dtype as WDtype, MappedSafetensors, SafetensorsWriter, TensorSpec, WeightSource,
};
use serde::Serialize;

pub use lower::{Lowered, lower};
pub use plan::{MemoryPlan, PlanStats, plan};

use lower::{Arg, Storage};

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

/// ExecuTorch scalar type of a petite dtype.
pub fn scalar_type(d: Dtype) -> ScalarType {
    match d {
        Dtype::F32 => ScalarType::FLOAT,
        Dtype::Bf16 => ScalarType::BFLOAT16,
        Dtype::F16 => ScalarType::HALF,
        Dtype::I64 => ScalarType::LONG,
        Dtype::I32 => ScalarType::INT,
        Dtype::U8 => ScalarType::BYTE,
        Dtype::Bool => ScalarType::BOOL,
    }
}

/// A tensor of the method's signature.
#[derive(Debug, Clone, Serialize)]
pub struct IoSpec {
    /// Graph input/output name.
    pub name: String,
    /// petite dtype name (`f32`, `bool`, …).
    pub dtype: &'static str,
    /// Shape.
    pub shape: Vec<usize>,
}

/// What an export produced (also written next to the `.pte` by the CLI as JSON).
#[derive(Debug, Clone, Serialize)]
pub struct ExportReport {
    /// Method name (`forward`).
    pub method: String,
    /// Inputs in call order.
    pub inputs: Vec<IoSpec>,
    /// Outputs in return order.
    pub outputs: Vec<IoSpec>,
    /// Memory-plan figures.
    pub plan: PlanStats,
    /// Bytes of the constant segment (weights and constants, padding included).
    pub constant_bytes: u64,
    /// Distinct operators called.
    pub operators: Vec<String>,
    /// Size of the written file (0 when only planned).
    pub file_bytes: u64,
}

fn io_specs(l: &Lowered, v: &[(String, usize)]) -> Vec<IoSpec> {
    v.iter()
        .map(|(n, s)| IoSpec {
            name: n.clone(),
            dtype: l.slots[*s].dtype.name(),
            shape: l.slots[*s].shape.clone(),
        })
        .collect()
}

fn report(method: &str, l: &Lowered, p: &MemoryPlan) -> ExportReport {
    let mut constant_bytes = 0u64;
    for s in &l.slots {
        if !s.is_planned() {
            constant_bytes = constant_bytes.div_ceil(16) * 16 + s.nbytes();
        }
    }
    ExportReport {
        method: method.into(),
        inputs: io_specs(l, &l.inputs),
        outputs: io_specs(l, &l.outputs),
        plan: p.stats,
        constant_bytes,
        operators: l.operators(),
        file_bytes: 0,
    }
}

/// Name of the method [`export_portable`] writes.
pub const METHOD: &str = "forward";

/// Lowers and plans without touching weights: what [`export_portable`] would write.
pub fn plan_portable(program: &Program) -> Result<ExportReport> {
    let l = lower(program)?;
    let p = plan(&l);
    Ok(report(METHOD, &l, &p))
}

/// Builds method `name` from a lowered program and its plan; `constant[s]` is the
/// `data_buffer_idx` of constant slot `s`.
fn build_method(name: &str, l: &Lowered, p: &MemoryPlan, constant: &[u32]) -> MethodBuilder {
    let mut m = MethodBuilder::new(name);
    m.set_planned_buffers(&[p.stats.planned_bytes.max(plan::ALIGN)]);
    let mut vi = vec![0i32; l.slots.len()];
    for (s, slot) in l.slots.iter().enumerate() {
        let st = scalar_type(slot.dtype);
        let sizes: Vec<i32> = slot.shape.iter().map(|&d| d as i32).collect();
        vi[s] = match p.offsets[s] {
            Some(off) => m.planned_tensor_at(st, &sizes, 1, off),
            None => m.constant_tensor(st, &sizes, constant[s]),
        };
    }
    for c in &l.calls {
        let mut args: Vec<i32> = c
            .args
            .iter()
            .map(|a| match a {
                Arg::T(s) => vi[*s],
                Arg::Int(x) => m.int(*x),
                Arg::Double(x) => m.double(*x),
                Arg::Bool(x) => m.bool(*x),
                Arg::Str(x) => m.value(petite_pte::model::EValue::String((*x).to_string())),
                Arg::Null => m.null(),
                Arg::Ints(v) => m.int_list(v),
                Arg::Tensors(v) => {
                    let items: Vec<i32> = v.iter().map(|&s| vi[s]).collect();
                    m.tensor_list(&items)
                }
            })
            .collect();
        match c.outs.as_slice() {
            [o] => args.push(vi[*o]),
            outs => {
                let items: Vec<i32> = outs.iter().map(|&s| vi[s]).collect();
                let tl = m.tensor_list(&items);
                args.push(tl);
            }
        }
        m.kernel_call(c.name, c.overload, &args);
    }
    let ins: Vec<i32> = l.inputs.iter().map(|(_, s)| vi[*s]).collect();
    let outs: Vec<i32> = l.outputs.iter().map(|(_, s)| vi[*s]).collect();
    m.inputs(&ins);
    m.outputs(&outs);
    m
}

fn same_dtype(from: WDtype, to: Dtype) -> bool {
    matches!(
        (from, to),
        (WDtype::F32, Dtype::F32)
            | (WDtype::Bf16, Dtype::Bf16)
            | (WDtype::F16, Dtype::F16)
            | (WDtype::I64, Dtype::I64)
            | (WDtype::I32, Dtype::I32)
            | (WDtype::U8, Dtype::U8)
            | (WDtype::Bool, Dtype::Bool)
    )
}

/// Converts `src` elements (dtype `from`) to `to`, appending little-endian bytes to `out`.
/// Same dtype copies bytes; float ↔ float converts (f32 → bf16/f16 round to nearest even).
fn convert_into(src: &[u8], from: WDtype, to: Dtype, out: &mut Vec<u8>) -> bool {
    let same = same_dtype(from, to);
    if same {
        out.extend_from_slice(src);
        return true;
    }
    if !from.is_float() || !to.is_float() {
        return false;
    }
    let f = |c: &[u8]| -> f32 {
        match from {
            WDtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            WDtype::Bf16 => f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16),
            _ => half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32(),
        }
    };
    for c in src.chunks_exact(from.size()) {
        let x = f(c);
        match to {
            Dtype::F32 => out.extend_from_slice(&x.to_le_bytes()),
            Dtype::Bf16 => out.extend_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes()),
            _ => out.extend_from_slice(&half::f16::from_f32(x).to_bits().to_le_bytes()),
        }
    }
    true
}

/// Chunk of source bytes converted at a time.
const CHUNK: usize = 8 << 20;

/// Writes one weight (converted, optionally transposed) to `w`, in bounded chunks.
fn write_weight(
    w: &mut impl Write,
    weights: &dyn WeightSource,
    name: &str,
    to: Dtype,
    shape: &[usize],
    transpose: bool,
    dest: &Path,
) -> Result<()> {
    let view = weights.tensor(name)?;
    let stored: Vec<usize> = if transpose {
        shape.iter().rev().copied().collect()
    } else {
        shape.to_vec()
    };
    if view.shape != stored.as_slice() {
        return Err(Error::Weight {
            name: name.into(),
            reason: format!(
                "expected shape {stored:?} (as the program declares), found {:?}",
                view.shape
            ),
        });
    }
    let es = view.dtype.size();
    let io = |e| Error::Io {
        path: dest.to_path_buf(),
        op: "write weight",
        source: e,
    };
    let bad = || Error::Weight {
        name: name.into(),
        reason: format!(
            "stored as {}, which does not convert to {to}",
            view.dtype.safetensors_name()
        ),
    };
    let mut buf = Vec::with_capacity(CHUNK.min(view.bytes.len()) * 2 + 16);
    if !transpose {
        for (i, c) in view.bytes.chunks(CHUNK).enumerate() {
            buf.clear();
            if !convert_into(c, view.dtype, to, &mut buf) {
                return Err(bad());
            }
            w.write_all(&buf).map_err(io)?;
            let start = i * CHUNK;
            weights.release_range(name, start, start + c.len())?;
        }
    } else {
        // [r, c] stored → [c, r] written, a block of output rows at a time.
        let (r, c) = (stored[0], stored[1]);
        let block = (CHUNK / (r * es).max(1)).clamp(1, c.max(1));
        let mut gathered = Vec::with_capacity(block * r * es);
        let mut c0 = 0;
        while c0 < c {
            let c1 = (c0 + block).min(c);
            gathered.clear();
            for j in c0..c1 {
                for i in 0..r {
                    let at = (i * c + j) * es;
                    gathered.extend_from_slice(&view.bytes[at..at + es]);
                }
            }
            buf.clear();
            if !convert_into(&gathered, view.dtype, to, &mut buf) {
                return Err(bad());
            }
            w.write_all(&buf).map_err(io)?;
            c0 = c1;
        }
    }
    weights.release(&[name])?;
    Ok(())
}

/// A weight as a `.pte` stores it: checkpoint tensor `name` converted to `dtype` and stored with
/// `shape` (the checkpoint's shape reversed when `transpose`). `key` names it in a mapping file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredWeight {
    /// Name in a mapping file ([`stored_key`]).
    pub key: String,
    /// Checkpoint tensor name.
    pub name: String,
    /// Stored as the transpose of the checkpoint tensor.
    pub transpose: bool,
    /// Stored dtype (the program's).
    pub dtype: Dtype,
    /// Stored shape.
    pub shape: Vec<usize>,
}

impl StoredWeight {
    /// Bytes stored.
    pub fn nbytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size() as u64
    }
}

/// Mapping-file name of a stored weight: the checkpoint name, the stored dtype and `T` when
/// transposed (one checkpoint tensor may be stored in several ways).
pub fn stored_key(name: &str, transpose: bool, dtype: Dtype) -> String {
    format!("{name}#{dtype}{}", if transpose { "#T" } else { "" })
}

/// Every weight the methods read, once per stored form, in first-use order.
pub fn stored_weights(methods: &[&Lowered]) -> Vec<StoredWeight> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for l in methods {
        for s in &l.slots {
            if let Storage::Weight { name, transpose } = &s.storage {
                let key = stored_key(name, *transpose, s.dtype);
                if seen.insert(key.clone()) {
                    out.push(StoredWeight {
                        key,
                        name: name.clone(),
                        transpose: *transpose,
                        dtype: s.dtype,
                        shape: s.shape.clone(),
                    });
                }
            }
        }
    }
    out
}

/// petite-weights' dtype of a petite-graph dtype.
fn weights_dtype(d: Dtype) -> WDtype {
    match d {
        Dtype::F32 => WDtype::F32,
        Dtype::Bf16 => WDtype::Bf16,
        Dtype::F16 => WDtype::F16,
        Dtype::I64 => WDtype::I64,
        Dtype::I32 => WDtype::I32,
        Dtype::U8 => WDtype::U8,
        Dtype::Bool => WDtype::Bool,
    }
}

/// Checks from headers only (no tensor bytes read) that `weights` holds every stored weight
/// with the right shape and a dtype that converts to the stored one.
pub fn check_weights(table: &[StoredWeight], weights: &dyn WeightSource) -> Result<()> {
    for w in table {
        let info = weights.info(&w.name)?;
        let mut want = w.shape.clone();
        if w.transpose {
            want.reverse();
        }
        if info.shape != want {
            return Err(Error::Weight {
                name: w.name.clone(),
                reason: format!("expected shape {want:?}, found {:?}", info.shape),
            });
        }
        let ok = info.dtype.is_float() && w.dtype.is_float() || same_dtype(info.dtype, w.dtype);
        if !ok {
            return Err(Error::Weight {
                name: w.name.clone(),
                reason: format!(
                    "stored as {}, the program wants {}",
                    info.dtype.safetensors_name(),
                    w.dtype
                ),
            });
        }
    }
    Ok(())
}

/// Writes every stored weight of `table` into a safetensors mapping file at `path` in the exact
/// bytes a `.pte` stores (converted, transposed), one tensor at a time in bounded chunks, through
/// petite-weights' streaming writer (temporary name, fsync, rename: the final name never holds a
/// partial file). `progress(done, total)` is called after each tensor. Returns the file's size.
pub fn write_mapping(
    table: &[StoredWeight],
    weights: &dyn WeightSource,
    path: &Path,
    metadata: &[(String, String)],
    progress: &mut dyn FnMut(u64, u64),
) -> Result<u64> {
    check_weights(table, weights)?;
    let specs: Vec<TensorSpec> = table
        .iter()
        .map(|w| TensorSpec::new(&w.key, weights_dtype(w.dtype), &w.shape))
        .collect();
    let writer = SafetensorsWriter::create(path, &specs, metadata)?;
    let total: u64 = table.iter().map(StoredWeight::nbytes).sum();
    let mut done = 0;
    for w in table {
        let mut sink = writer.tensor(&w.key)?;
        write_weight(
            &mut sink,
            weights,
            &w.name,
            w.dtype,
            &w.shape,
            w.transpose,
            path,
        )?;
        sink.finish()?;
        done += w.nbytes();
        progress(done, total);
    }
    let len = writer.total_len();
    writer.finish()?;
    Ok(len)
}

/// Where the weights' bytes come from when a `.pte` is written.
#[derive(Clone, Copy)]
pub enum Constants<'a> {
    /// A mapping file from [`write_mapping`] with every stored weight: each is a region of it,
    /// copied into the `.pte` in-kernel (`copy_file_range`).
    Mapping(&'a MappedSafetensors),
    /// Any source: each weight converted (and transposed) straight into the `.pte`.
    Stream(&'a dyn WeightSource),
}

/// One method of a `.pte` to write.
#[derive(Clone, Copy)]
pub struct MethodSpec<'a> {
    /// Method name.
    pub name: &'a str,
    /// The lowered program.
    pub lowered: &'a Lowered,
    /// Its memory plan.
    pub plan: &'a MemoryPlan,
}

/// Writes a `.pte` with `methods` (each with its own planned buffer; constants shared: a weight
/// read by two methods is stored once) to `out` (temporary name, then rename). Every weight is
/// checked before the file is created; each is written into the `.pte` exactly once.
pub fn write_program(
    methods: &[MethodSpec<'_>],
    constants: Constants<'_>,
    out: &Path,
    opts: WriteOptions,
) -> Result<(Vec<ExportReport>, WriteSummary)> {
    let lows: Vec<&Lowered> = methods.iter().map(|m| m.lowered).collect();
    let table = stored_weights(&lows);
    match constants {
        Constants::Stream(w) => check_weights(&table, w)?,
        Constants::Mapping(map) => {
            for w in &table {
                let info = map.info(&w.key)?;
                if info.dtype != weights_dtype(w.dtype) || info.shape != w.shape {
                    return Err(Error::Weight {
                        name: w.key.clone(),
                        reason: format!(
                            "{} holds {} {:?}, the program stores {} {:?}",
                            map.path().display(),
                            info.dtype.safetensors_name(),
                            info.shape,
                            w.dtype,
                            w.shape
                        ),
                    });
                }
            }
        }
    }
    let index: std::collections::HashMap<&str, usize> = table
        .iter()
        .enumerate()
        .map(|(i, w)| (w.key.as_str(), i))
        .collect();
    let mut pb = ProgramBuilder::new();
    let mut stored_idx: Vec<Option<u32>> = vec![None; table.len()];
    let mut reports = Vec::with_capacity(methods.len());
    for m in methods {
        let l = m.lowered;
        let mut constant = vec![0u32; l.slots.len()];
        for (s, slot) in l.slots.iter().enumerate() {
            if m.plan.offsets[s].is_some() {
                continue;
            }
            constant[s] = match &slot.storage {
                Storage::Constant(bytes) => pb.add_constant(bytes),
                Storage::Weight { name, transpose } => {
                    let i = index[stored_key(name, *transpose, slot.dtype).as_str()];
                    match stored_idx[i] {
                        Some(c) => c,
                        None => {
                            let data = match constants {
                                Constants::Mapping(map) => {
                                    let r = map.file_range(&table[i].key)?;
                                    SegmentData::file_region(
                                        map.path(),
                                        r.start as u64,
                                        (r.end - r.start) as u64,
                                    )
                                }
                                Constants::Stream(_) => SegmentData::Deferred {
                                    id: i as u64,
                                    len: table[i].nbytes(),
                                },
                            };
                            let c = pb.add_constant_data(data);
                            stored_idx[i] = Some(c);
                            c
                        }
                    }
                }
                Storage::Input(_) | Storage::Activation => {
                    unreachable!("planned slots have offsets")
                }
            };
        }
        pb.add_method(build_method(m.name, l, m.plan, &constant))?;
        reports.push(report(m.name, l, m.plan));
    }
    let summary = match constants {
        Constants::Mapping(_) => pb.write(out, opts)?,
        Constants::Stream(weights) => {
            let mut fill = |id: u64, mut dst: &mut dyn Write| -> std::io::Result<()> {
                let w = &table[id as usize];
                write_weight(
                    &mut dst,
                    weights,
                    &w.name,
                    w.dtype,
                    &w.shape,
                    w.transpose,
                    out,
                )
                .map_err(std::io::Error::other)
            };
            pb.write_streamed(out, opts, &mut fill)?
        }
    };
    for r in &mut reports {
        r.file_bytes = summary.file_len;
    }
    Ok((reports, summary))
}

/// Lowers `program`, plans its memory and writes a `.pte` with one method, `forward`, to
/// `out_path` (temporary name, then rename). Weights are read from `weights` by name and
/// converted (and transposed where stored so) straight into the constant segment, each written
/// once. Every error (unsupported op or dtype, missing or mis-shaped weight) is raised before
/// `out_path` is touched.
pub fn export_portable(
    program: &Program,
    weights: &dyn WeightSource,
    out_path: impl AsRef<Path>,
) -> Result<ExportReport> {
    let l = lower(program)?;
    let p = plan(&l);
    let (mut reports, _) = write_program(
        &[MethodSpec {
            name: METHOD,
            lowered: &l,
            plan: &p,
        }],
        Constants::Stream(weights),
        out_path.as_ref(),
        WriteOptions::default(),
    )?;
    Ok(reports.remove(0))
}
