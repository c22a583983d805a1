#![doc = include_str!("../README.md")]
//!
//! ## API map
//!
//! * [`lower()`]: ops → kernel calls with full schema argument lists ([`lower::Lowered`]).
//! * [`plan()`]: one planned buffer, memory reused by value lifetime (greedy by size).
//! * [`plan_portable`]: lower + plan from shapes alone, the [`ExportReport`] an export would give.
//! * [`export_portable`]: writes a one-method `.pte`; each weight is converted (and transposed
//!   where the lowering stores it so) straight into the constant segment, in bounded chunks from
//!   the mapped [`WeightSource`]: written once, never all in memory.
//! * [`write_mapping`] + [`write_program`]: the exporter's two stages — every weight once in the
//!   exact dtype and layout the `.pte` stores (a cacheable mapping file; transposes in tiled
//!   column bands, two threads, source pages unmapped behind), then `.pte` files with
//!   several methods whose constants are regions of that file, copied in-kernel
//!   (`copy_file_range`).
//! * [`Error`]: every failure, naming the node, op or weight.
//!
//! Only operators registered by both `executorch-numpy-runtime` 1.4.0 and the `executorch` 1.5.1
//! pybindings are emitted ([`OPERATORS`]).
#![deny(missing_docs)]
#![forbid(unsafe_code)]

pub mod lower;
pub mod plan;
#[cfg(test)]
mod stream_tests;

use std::io::Write;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use petite_graph::{Dtype, Program};
use petite_pte::model::ScalarType;
use petite_pte::{MethodBuilder, ProgramBuilder, SegmentData, WriteOptions, WriteSummary};
use petite_weights::writeback::WriteBehind;
use petite_weights::{MappedSafetensors, SafetensorsWriter, TensorSpec, TensorView, WeightSource};
use serde::Serialize;

pub use lower::{Lowered, lower, row_source};
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

/// One element conversion, monomorphised so the band kernels inline it: `I` source bytes in,
/// `O` stored bytes out (little-endian).
trait Elem {
    const I: usize;
    const O: usize;
    fn conv(s: &[u8], d: &mut [u8]);
}

/// Same dtype: the bytes are copied.
struct Same<const N: usize>;
impl<const N: usize> Elem for Same<N> {
    const I: usize = N;
    const O: usize = N;
    #[inline(always)]
    fn conv(s: &[u8], d: &mut [u8]) {
        d.copy_from_slice(s);
    }
}

#[inline(always)]
fn f32_of(s: &[u8]) -> f32 {
    f32::from_le_bytes([s[0], s[1], s[2], s[3]])
}
#[inline(always)]
fn bf16_of(s: &[u8]) -> f32 {
    petite_dtype::bf16_bits_to_f32(u16::from_le_bytes([s[0], s[1]]))
}
#[inline(always)]
fn f16_of(s: &[u8]) -> f32 {
    petite_dtype::f16_bits_to_f32(u16::from_le_bytes([s[0], s[1]]))
}

use petite_dtype::bf16_bits;

macro_rules! float_elem {
    ($name:ident, $i:expr, $o:expr, |$s:ident, $d:ident| $body:expr) => {
        struct $name;
        impl Elem for $name {
            const I: usize = $i;
            const O: usize = $o;
            #[inline(always)]
            fn conv($s: &[u8], $d: &mut [u8]) {
                $body
            }
        }
    };
}
// f32 → bf16/f16 round to nearest even (`half`'s conversions, as since the crate's first
// version); narrow → wide is exact.
float_elem!(F32Bf16, 4, 2, |s, d| d
    .copy_from_slice(&bf16_bits(f32_of(s)).to_le_bytes()));
float_elem!(F32F16, 4, 2, |s, d| d
    .copy_from_slice(&petite_dtype::f16_bits(f32_of(s)).to_le_bytes()));
float_elem!(Bf16F32, 2, 4, |s, d| d
    .copy_from_slice(&bf16_of(s).to_le_bytes()));
float_elem!(F16F32, 2, 4, |s, d| d
    .copy_from_slice(&f16_of(s).to_le_bytes()));
float_elem!(Bf16F16, 2, 2, |s, d| d
    .copy_from_slice(&petite_dtype::f16_bits(bf16_of(s)).to_le_bytes()));
float_elem!(F16Bf16, 2, 2, |s, d| d
    .copy_from_slice(&bf16_bits(f16_of(s)).to_le_bytes()));

/// Which [`Elem`] a (source, stored) dtype pair uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Conv {
    Same1,
    Same2,
    Same4,
    Same8,
    F32Bf16,
    F32F16,
    Bf16F32,
    F16F32,
    Bf16F16,
    F16Bf16,
}

impl Conv {
    /// Same dtype copies bytes; float ↔ float converts; anything else does not convert.
    fn of(from: Dtype, to: Dtype) -> Option<Conv> {
        if from == to {
            return Some(match from.size() {
                1 => Conv::Same1,
                2 => Conv::Same2,
                4 => Conv::Same4,
                _ => Conv::Same8,
            });
        }
        Some(match (from, to) {
            (Dtype::F32, Dtype::Bf16) => Conv::F32Bf16,
            (Dtype::F32, Dtype::F16) => Conv::F32F16,
            (Dtype::Bf16, Dtype::F32) => Conv::Bf16F32,
            (Dtype::F16, Dtype::F32) => Conv::F16F32,
            (Dtype::Bf16, Dtype::F16) => Conv::Bf16F16,
            (Dtype::F16, Dtype::Bf16) => Conv::F16Bf16,
            _ => return None,
        })
    }
}

/// Calls generic `$f::<E>(args)` with the [`Elem`] of `$conv`.
macro_rules! with_elem {
    ($conv:expr, $f:ident($($a:expr),*)) => {
        match $conv {
            Conv::Same1 => $f::<Same<1>>($($a),*),
            Conv::Same2 => $f::<Same<2>>($($a),*),
            Conv::Same4 => $f::<Same<4>>($($a),*),
            Conv::Same8 => $f::<Same<8>>($($a),*),
            Conv::F32Bf16 => $f::<F32Bf16>($($a),*),
            Conv::F32F16 => $f::<F32F16>($($a),*),
            Conv::Bf16F32 => $f::<Bf16F32>($($a),*),
            Conv::F16F32 => $f::<F16F32>($($a),*),
            Conv::Bf16F16 => $f::<Bf16F16>($($a),*),
            Conv::F16Bf16 => $f::<F16Bf16>($($a),*),
        }
    };
}

fn convert_plain<E: Elem>(src: &[u8], out: &mut [u8]) {
    for (s, d) in src.chunks_exact(E::I).zip(out.chunks_exact_mut(E::O)) {
        E::conv(s, d);
    }
}

/// Side of the square tiles the transposing kernel walks: a tile's source rows and stored rows
/// (64 cache lines each at most) stay in L1 while it is converted.
const TILE: usize = 16;

/// Converts rows `i0..i1` × columns `j0..j1` of the row-major `[_, c]` tensor `src` into `out`,
/// transposed: source element `(i, j)` goes to element `(j - j0) * h + i` of `out`.
/// Tiled so reads and writes both stay in cache (a column-by-column gather misses on every
/// element).
fn transpose_block<E: Elem>(
    src: &[u8],
    c: usize,
    (i0, i1): (usize, usize),
    (j0, j1): (usize, usize),
    out: &mut [u8],
    h: usize,
) {
    // One tile converted into `tmp` (stored-row-major, in L1), then copied out row by row.
    let mut tmp = [0u8; TILE * TILE * 8];
    for ib in (i0..i1).step_by(TILE) {
        let n = (ib + TILE).min(i1) - ib;
        for jb in (j0..j1).step_by(TILE) {
            let m = (jb + TILE).min(j1) - jb;
            for ii in 0..n {
                let at = ((ib + ii) * c + jb) * E::I;
                let row = &src[at..at + m * E::I];
                for (jj, s) in row.chunks_exact(E::I).enumerate() {
                    let t = (jj * TILE + ii) * E::O;
                    E::conv(s, &mut tmp[t..t + E::O]);
                }
            }
            for jj in 0..m {
                let o = ((jb + jj - j0) * h + ib) * E::O;
                let t = jj * TILE * E::O;
                out[o..o + n * E::O].copy_from_slice(&tmp[t..t + n * E::O]);
            }
        }
    }
}

/// Source bytes one band (one unit of work) reads: bounds the output buffer a band holds,
/// whatever the tensor's size.
const BAND: usize = 8 << 20;

/// Source bytes of whole rows a column band reads before unmapping them: bounds the mapped
/// source pages.
const UNMAP: usize = 2 << 20;

/// One band of a stored weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Band {
    /// Elements `start..end` of an untransposed tensor.
    Plain { start: usize, end: usize },
    /// Source columns `j0..j1` of a transposed `[r, c]` tensor: stored rows `j0..j1`, one
    /// contiguous run of the output, read as one segment of every source row. (Cutting by source
    /// rows instead reads contiguously but scatters the output into `c` short writes per band:
    /// measured slower at full size, 46 s vs 17 s.)
    Cols { j0: usize, j1: usize },
}

/// How a stored weight is read, converted and placed.
#[derive(Debug, Clone, Copy)]
struct Layout {
    conv: Conv,
    /// Source `[r, c]` when transposed (the stored shape is `[c, r]`); `(1, numel)` otherwise.
    r: usize,
    c: usize,
    transpose: bool,
}

impl Layout {
    fn new(w: &StoredWeight, from: Dtype) -> Result<Layout> {
        let conv = Conv::of(from, w.dtype).ok_or_else(|| Error::Weight {
            name: w.name.clone(),
            reason: format!(
                "stored as {}, which does not convert to {}",
                from.safetensors_name(),
                w.dtype
            ),
        })?;
        let (r, c) = if w.transpose {
            match w.shape.as_slice() {
                [c, r] => (*r, *c),
                s => {
                    return Err(Error::Weight {
                        name: w.name.clone(),
                        reason: format!("stored transposed, so 2-D, but its shape is {s:?}"),
                    });
                }
            }
        } else {
            (1, w.shape.iter().product())
        };
        Ok(Layout {
            conv,
            r,
            c,
            transpose: w.transpose,
        })
    }

    fn src_size(&self) -> usize {
        with_elem!(self.conv, in_size())
    }

    fn out_size(&self) -> usize {
        with_elem!(self.conv, out_size())
    }

    /// The bands of this weight, each about `band` source bytes, in output order.
    fn bands(&self, band: usize) -> Vec<Band> {
        let es = self.src_size();
        let (r, c) = (self.r, self.c);
        let mut out = Vec::new();
        if r == 0 || c == 0 {
            return out;
        }
        let per = if self.transpose {
            (band / (r * es)).clamp(1, c)
        } else {
            (band / es).max(1)
        };
        let mut s = 0;
        while s < c {
            let e = (s + per).min(c);
            out.push(if self.transpose {
                Band::Cols { j0: s, j1: e }
            } else {
                Band::Plain { start: s, end: e }
            });
            s = e;
        }
        out
    }

    /// Converts `b` of `src` into `buf` (cleared) and hands the stored bytes to `emit` as
    /// (offset within the stored tensor, bytes). Column bands read a slice of every source row,
    /// and each fault also maps the cached pages around it (fault-around, large folios: a
    /// whole row and more), so rows are unmapped from `unmap` a group at a time as the band moves
    /// down; they stay in the page cache for the next band.
    fn run(
        &self,
        src: &[u8],
        b: Band,
        buf: &mut Vec<u8>,
        unmap: (&dyn WeightSource, &str),
        emit: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let (es, os) = (self.src_size(), self.out_size());
        let (r, c) = (self.r, self.c);
        buf.clear();
        match b {
            Band::Plain { start, end } => {
                buf.resize((end - start) * os, 0);
                with_elem!(
                    self.conv,
                    convert_plain(&src[start * es..end * es], buf.as_mut_slice())
                );
                emit((start * os) as u64, buf)
            }
            Band::Cols { j0, j1 } => {
                buf.resize((j1 - j0) * r * os, 0);
                let group = (UNMAP / (c * es)).max(1).div_ceil(TILE) * TILE;
                let (weights, name) = unmap;
                for g0 in (0..r).step_by(group) {
                    let g1 = (g0 + group).min(r);
                    with_elem!(
                        self.conv,
                        transpose_block(src, c, (g0, g1), (j0, j1), buf.as_mut_slice(), r)
                    );
                    if j1 - j0 < c {
                        weights.unmap_range(name, g0 * c * es, g1 * c * es)?;
                    }
                }
                emit((j0 * r * os) as u64, buf)
            }
        }
    }

    /// Gives back the source pages band `b` has finished with. Plain bands round by address
    /// (the mapping is page-aligned with the file): the page shared with the next band or a
    /// neighbouring tensor is kept, the one shared with the previous band dropped, so no page is
    /// read from disk twice. A column band's rows were unmapped as it went and stay cached for
    /// the next band; the whole tensor is released after its last band.
    fn release(
        &self,
        weights: &dyn WeightSource,
        name: &str,
        src: &[u8],
        b: Band,
        page: usize,
    ) -> Result<()> {
        let es = self.src_size();
        let base = src.as_ptr() as usize;
        let (s, e) = match b {
            Band::Plain { start, end } => (start * es, end * es),
            Band::Cols { j0, j1 } if j0 == 0 && j1 == self.c => (0, src.len()),
            Band::Cols { .. } => return Ok(()),
        };
        let a = if s > 0 {
            (base + s) / page * page
        } else {
            (base + s).div_ceil(page) * page
        }
        .saturating_sub(base);
        let z = if e == src.len() {
            e
        } else {
            ((base + e) / page * page).saturating_sub(base)
        };
        if z > a {
            weights.release_range(name, a, z)?;
        }
        Ok(())
    }

    /// The source bytes to ask for ahead of band `b` (readahead, `MADV_WILLNEED`): a plain
    /// band's own bytes; for the first column band the whole tensor, which every column band
    /// reads a slice of (faulted in row by row it would be read synchronously).
    fn lead(&self, b: Band) -> std::ops::Range<usize> {
        let es = self.src_size();
        match b {
            Band::Plain { start, end } => start * es..end * es,
            Band::Cols { j0: 0, .. } => 0..self.r * self.c * es,
            Band::Cols { .. } => 0..0,
        }
    }
}

fn in_size<E: Elem>() -> usize {
    E::I
}

fn out_size<E: Elem>() -> usize {
    E::O
}

fn ahead(weights: &dyn WeightSource, name: &str, r: std::ops::Range<usize>) -> Result<()> {
    if r.end > r.start {
        weights.prefetch_range(name, r.start, r.end)?;
    }
    Ok(())
}

/// Checks `view` against the stored weight `w` (shape as the program declares it).
fn checked_view<'a>(weights: &'a dyn WeightSource, w: &StoredWeight) -> Result<TensorView<'a>> {
    let view = weights.tensor(&w.name)?;
    let mut want = w.shape.clone();
    if w.transpose {
        want.reverse();
    }
    if view.shape != want.as_slice() {
        return Err(Error::Weight {
            name: w.name.clone(),
            reason: format!(
                "expected shape {want:?} (as the program declares), found {:?}",
                view.shape
            ),
        });
    }
    Ok(view)
}

/// Writes one weight (converted, transposed where stored so) to the sequential writer `w`, a
/// band at a time, releasing the source pages behind itself.
fn write_weight(
    w: &mut impl Write,
    weights: &dyn WeightSource,
    sw: &StoredWeight,
    dest: &Path,
) -> Result<()> {
    let view = checked_view(weights, sw)?;
    let lay = Layout::new(sw, view.dtype)?;
    let page = petite_weights::page_size();
    let mut buf = Vec::new();
    let bands = lay.bands(BAND);
    for (k, &b) in bands.iter().enumerate() {
        if k == 0 {
            ahead(weights, &sw.name, lay.lead(b))?;
        }
        if let Some(&n) = bands.get(k + 1) {
            ahead(weights, &sw.name, lay.lead(n))?;
        }
        lay.run(
            view.bytes,
            b,
            &mut buf,
            (weights, &sw.name),
            &mut |_, bytes| {
                w.write_all(bytes).map_err(|e| Error::Io {
                    path: dest.to_path_buf(),
                    op: "write weight",
                    source: e,
                })
            },
        )?;
        lay.release(weights, &sw.name, view.bytes, b, page)?;
    }
    weights.release(&[&sw.name])?;
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
        let ok = info.dtype.is_float() && w.dtype.is_float() || info.dtype == w.dtype;
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

/// Threads converting bands of the mapping file (the target has 2 cores).
const MAPPING_THREADS: usize = 2;

/// Writes every stored weight of `table` into a safetensors mapping file at `path` in the exact
/// bytes a `.pte` stores (converted, transposed), through petite-weights' streaming writer
/// (temporary name, fsync, seal `<path>.seal`, rename: the final name never holds a partial
/// file, nor one built from a source that changed meanwhile). Work is cut into
/// bands of about 8 MiB of source, converted by two threads and written at their final
/// offsets; each band gives its source pages back behind itself, so memory stays a few bands
/// whatever the tensor's size. `progress(done, total)` is called as bands finish. Returns the
/// file's size.
pub fn write_mapping(
    table: &[StoredWeight],
    weights: &dyn WeightSource,
    path: &Path,
    metadata: &[(String, String)],
    progress: &mut dyn FnMut(u64, u64),
) -> Result<u64> {
    write_mapping_with(
        table,
        weights,
        path,
        metadata,
        progress,
        BAND,
        MAPPING_THREADS,
    )
}

fn write_mapping_with(
    table: &[StoredWeight],
    weights: &dyn WeightSource,
    path: &Path,
    metadata: &[(String, String)],
    progress: &mut dyn FnMut(u64, u64),
    band: usize,
    threads: usize,
) -> Result<u64> {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

    check_weights(table, weights)?;
    let specs: Vec<TensorSpec> = table
        .iter()
        .map(|w| TensorSpec::new(&w.key, w.dtype, &w.shape))
        .collect();
    let writer = SafetensorsWriter::create(path, &specs, metadata)?;
    let index: std::collections::HashMap<&str, usize> = table
        .iter()
        .enumerate()
        .map(|(i, w)| (w.key.as_str(), i))
        .collect();
    // Bands in file order, so the output is written (nearly) sequentially.
    let mut layouts = Vec::with_capacity(table.len());
    for w in table {
        layouts.push(Layout::new(w, weights.info(&w.name)?.dtype)?);
    }
    let mut items: Vec<(usize, Band)> = Vec::new();
    for key in writer.order() {
        let t = index[key];
        items.extend(layouts[t].bands(band).into_iter().map(|b| (t, b)));
    }
    let left: Vec<AtomicUsize> = (0..table.len()).map(|_| AtomicUsize::new(0)).collect();
    for (t, _) in &items {
        left[*t].fetch_add(1, Ordering::Relaxed);
    }
    let total: u64 = table.iter().map(StoredWeight::nbytes).sum();
    let page = petite_weights::page_size();
    let next = AtomicUsize::new(0);
    let done = AtomicU64::new(0);
    let failed = AtomicBool::new(false);
    let first_err: Mutex<Option<Error>> = Mutex::new(None);
    // Takes bands until none is left or a thread failed; returns after each band when `once`.
    let fd = writer.file().as_fd();
    let work = |buf: &mut Vec<u8>, flusher: &mut WriteBehind, once: bool| {
        while !failed.load(Ordering::Relaxed) {
            let k = next.fetch_add(1, Ordering::Relaxed);
            let Some(&(t, b)) = items.get(k) else {
                return false;
            };
            let (w, lay) = (&table[t], &layouts[t]);
            let res = (|| -> Result<()> {
                if k == 0 {
                    ahead(weights, &w.name, lay.lead(b))?;
                }
                // Readahead for the next band (of this tensor or the next one).
                if let Some(&(t2, b2)) = items.get(k + 1) {
                    ahead(weights, &table[t2].name, layouts[t2].lead(b2))?;
                }
                let view = checked_view(weights, w)?;
                let (at, _) = writer.placement(&w.key)?;
                let mut bytes = 0u64;
                lay.run(view.bytes, b, buf, (weights, &w.name), &mut |off, seg| {
                    bytes += seg.len() as u64;
                    writer.write_at(&w.key, off, seg)?;
                    flusher.push(at + off, seg.len() as u64);
                    Ok(())
                })?;
                lay.release(weights, &w.name, view.bytes, b, page)?;
                if left[t].fetch_sub(1, Ordering::AcqRel) == 1 {
                    weights.release(&[&w.name])?;
                }
                done.fetch_add(bytes, Ordering::Relaxed);
                Ok(())
            })();
            if let Err(e) = res {
                failed.store(true, Ordering::Relaxed);
                first_err.lock().expect("no panics").get_or_insert(e);
                return false;
            }
            if once {
                return true;
            }
        }
        false
    };
    std::thread::scope(|scope| {
        for _ in 1..threads.max(1) {
            scope.spawn(|| work(&mut Vec::new(), &mut WriteBehind::new(fd, 4), false));
        }
        // This thread converts too, reporting progress between its bands.
        let (mut buf, mut flusher) = (Vec::new(), WriteBehind::new(fd, 4));
        while work(&mut buf, &mut flusher, true) {
            progress(done.load(Ordering::Relaxed), total);
        }
    });
    if let Some(e) = first_err.into_inner().expect("no panics") {
        return Err(e);
    }
    progress(done.load(Ordering::Relaxed), total);
    let len = writer.total_len();
    // A cache file: published only if the source did not change while it was read, and sealed
    // (petite-weights' `seal`) for the next run's reuse check.
    weights.check_unchanged()?;
    writer.finish_sealed()?;
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
    write_program_with(methods, constants, &[], out, opts)
}

/// [`write_program`] with small named-data blobs added (`(key, bytes)`, e.g. the exporter's
/// export id), which no method reads.
pub fn write_program_with(
    methods: &[MethodSpec<'_>],
    constants: Constants<'_>,
    named: &[(&str, &[u8])],
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
                if info.dtype != w.dtype || info.shape != w.shape {
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
    for (key, bytes) in named {
        pb.add_named_data(
            key,
            petite_pte::SegmentData::Bytes(std::sync::Arc::from(*bytes)),
            16,
        )?;
    }
    let summary = match constants {
        Constants::Mapping(_) => pb.write(out, opts)?,
        Constants::Stream(weights) => {
            let mut fill = |id: u64, mut dst: &mut dyn Write| -> std::io::Result<()> {
                let w = &table[id as usize];
                write_weight(&mut dst, weights, w, out).map_err(std::io::Error::other)
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
    let sliced = row_source(&[program], weights)?;
    let (mut reports, _) = write_program(
        &[MethodSpec {
            name: METHOD,
            lowered: &l,
            plan: &p,
        }],
        Constants::Stream(&sliced),
        out_path.as_ref(),
        WriteOptions::default(),
    )?;
    Ok(reports.remove(0))
}
