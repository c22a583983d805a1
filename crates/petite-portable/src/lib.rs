//! petite-portable: petite-graph programs as ExecuTorch `.pte` methods made of portable kernel
//! calls (`aten::mm.out`, `aten::_softmax.out`, …), with no delegate, so any ExecuTorch runtime on
//! any CPU runs them — and ExecuTorch's own runtime can check petite's programs end to end.
//!
//! * [`lower()`]: ops → kernel calls with full schema argument lists ([`lower::Lowered`]).
//! * [`plan()`]: one planned buffer, memory reused by value lifetime (greedy by size).
//! * [`export_portable`]: writes the `.pte`; weights go to the constant segment through a
//!   temporary file, one tensor at a time from the mapped [`WeightSource`] (never all in memory).
//!
//! Knows nothing of pi0.5. Only operators registered by both `executorch-numpy-runtime` 1.4.0
//! and the `executorch` 1.5.1 pybindings are emitted ([`OPERATORS`]).
#![deny(missing_docs)]

pub mod lower;
pub mod plan;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use petite_graph::{Dtype, Program};
use petite_pte::model::{ScalarType, SubsegmentOffsets};
use petite_pte::{MethodBuilder, ProgramBuilder, Segment, SegmentData, WriteOptions};
use petite_weights::{Dtype as WDtype, WeightSource};
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

fn report(l: &Lowered, p: &MemoryPlan) -> ExportReport {
    let mut constant_bytes = 0u64;
    for s in &l.slots {
        if !s.is_planned() {
            constant_bytes = constant_bytes.div_ceil(16) * 16 + s.nbytes();
        }
    }
    ExportReport {
        method: "forward".into(),
        inputs: io_specs(l, &l.inputs),
        outputs: io_specs(l, &l.outputs),
        plan: p.stats,
        constant_bytes,
        operators: l.operators(),
        file_bytes: 0,
    }
}

/// Lowers and plans without touching weights: what [`export_portable`] would write.
pub fn plan_portable(program: &Program) -> Result<ExportReport> {
    let l = lower(program)?;
    let p = plan(&l);
    Ok(report(&l, &p))
}

/// Builds the `forward` method from a lowered program and its plan. Constant slots get
/// `data_buffer_idx` 1, 2, … in slot order (the constant segment is written in that order).
fn build_method(l: &Lowered, p: &MemoryPlan) -> MethodBuilder {
    let mut m = MethodBuilder::new("forward");
    m.set_planned_buffers(&[p.stats.planned_bytes.max(plan::ALIGN)]);
    let mut vi = vec![0i32; l.slots.len()];
    let mut next_const = 1u32;
    for (s, slot) in l.slots.iter().enumerate() {
        let st = scalar_type(slot.dtype);
        let sizes: Vec<i32> = slot.shape.iter().map(|&d| d as i32).collect();
        vi[s] = match p.offsets[s] {
            Some(off) => m.planned_tensor_at(st, &sizes, 1, off),
            None => {
                let idx = next_const;
                next_const += 1;
                m.constant_tensor(st, &sizes, idx)
            }
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
    tmp: &Path,
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
        path: tmp.to_path_buf(),
        op: "write constants",
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

/// Removes a file when dropped (the constants' temporary file).
struct TempFile(PathBuf);
impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Lowers `program`, plans its memory and writes a `.pte` with one method, `forward`, to
/// `out_path` (temporary name, then rename). Weights are read from `weights` by name, converted to
/// the program's dtypes and streamed through a temporary constants file next to the output.
/// Every error (unsupported op or dtype, missing or mis-shaped weight) is raised before
/// `out_path` is touched.
pub fn export_portable(
    program: &Program,
    weights: &dyn WeightSource,
    out_path: impl AsRef<Path>,
) -> Result<ExportReport> {
    let out_path = out_path.as_ref();
    let l = lower(program)?;
    let p = plan(&l);
    // Check every weight before writing anything.
    for s in &l.slots {
        if let Storage::Weight { name, transpose } = &s.storage {
            let info = weights.info(name)?;
            let mut want = s.shape.clone();
            if *transpose {
                want.reverse();
            }
            if info.shape != want {
                return Err(Error::Weight {
                    name: name.clone(),
                    reason: format!("expected shape {want:?}, found {:?}", info.shape),
                });
            }
            let ok = info.dtype.is_float() && s.dtype.is_float() || same_dtype(info.dtype, s.dtype);
            if !ok {
                return Err(Error::Weight {
                    name: name.clone(),
                    reason: format!(
                        "stored as {}, the program wants {}",
                        info.dtype.safetensors_name(),
                        s.dtype
                    ),
                });
            }
        }
    }
    let dir = out_path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let fname = out_path
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out.pte".into());
    let tmp = TempFile(dir.join(format!(".{fname}.constants.{}", std::process::id())));
    let io = |op, e| Error::Io {
        path: tmp.0.clone(),
        op,
        source: e,
    };
    let file = File::create(&tmp.0).map_err(|e| io("create", e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let mut offsets = vec![0u64];
    let mut len = 0u64;
    for s in &l.slots {
        if s.is_planned() {
            continue;
        }
        if offsets.len() > 1 {
            let pad = len.div_ceil(16) * 16 - len;
            w.write_all(&vec![0u8; pad as usize])
                .map_err(|e| io("write", e))?;
            len += pad;
        }
        offsets.push(len);
        match &s.storage {
            Storage::Constant(bytes) => w.write_all(bytes).map_err(|e| io("write", e))?,
            Storage::Weight { name, transpose } => {
                write_weight(&mut w, weights, name, s.dtype, &s.shape, *transpose, &tmp.0)?
            }
            _ => unreachable!("planned slots are skipped"),
        }
        len += s.nbytes();
    }
    w.flush().map_err(|e| io("flush", e))?;
    drop(w);

    let mut pb = ProgramBuilder::new();
    pb.add_method(build_method(&l, &p))?;
    let (mut prog, mut segments) = pb.build()?;
    if offsets.len() > 1 {
        // The builder added no constants, so it wrote no constant segment: ours goes first.
        segments.insert(
            0,
            Segment {
                data: SegmentData::file_region(&tmp.0, 0, len),
                alignment: 1,
            },
        );
        prog.constant_segment = Some(SubsegmentOffsets {
            segment_index: 0,
            offsets,
        });
    }
    let summary = petite_pte::write_pte(out_path, &prog, &segments, WriteOptions::default())?;
    let mut r = report(&l, &p);
    r.file_bytes = summary.file_len;
    Ok(r)
}
