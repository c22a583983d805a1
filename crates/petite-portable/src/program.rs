//! The `.pte` writer: lowered methods and their memory plans become ExecuTorch methods (planned
//! tensors at their offsets, constants shared between methods), with the weights' bytes from a
//! mapping file (copied in-kernel) or converted straight into the file ([`Constants`]).

use std::io::Write;
use std::path::Path;

use petite_graph::{Dtype, Program};
use petite_pte::model::ScalarType;
use petite_pte::{MethodBuilder, ProgramBuilder, SegmentData, WriteOptions, WriteSummary};
use petite_weights::{MappedSafetensors, WeightSource};

use crate::convert::write_weight;
use crate::lower::{Arg, Storage};
use crate::report::report;
use crate::{
    Error, ExportReport, Lowered, METHOD, MemoryPlan, Result, StoredWeight, check_weights, lower,
    plan, row_source, stored_key, stored_weights,
};

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
        Dtype::I8 => ScalarType::CHAR,
        Dtype::F8E4M3 => ScalarType::FLOAT8E4M3FN,
    }
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

/// Where the weights' bytes come from when a `.pte` is written.
#[derive(Clone, Copy)]
pub enum Constants<'a> {
    /// A mapping file from [`crate::write_mapping`] with every stored weight: each is a region of it,
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
    let Built {
        builder: pb,
        table,
        mut reports,
    } = build_program(
        methods,
        match constants {
            Constants::Mapping(map) => Some(map),
            Constants::Stream(_) => None,
        },
        named,
    )?;
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

/// A `.pte` program before it is written.
pub struct Built {
    /// The program; its constants are the stored weights, in one constant segment.
    pub builder: ProgramBuilder,
    /// The stored weights; a constant that is [`SegmentData::Deferred`] has its index here as id.
    pub table: Vec<StoredWeight>,
    /// Each method's report (`file_bytes` is 0 until the file is written).
    pub reports: Vec<ExportReport>,
}

/// Builds the program of `methods` (constants shared: a weight read by two methods is stored
/// once) with `named` blobs, nothing written: each weight's bytes are a region of `mapping` or,
/// without one, [`SegmentData::Deferred`] data whose id is its index in [`Built::table`] (for a
/// writer that converts it into its place).
pub fn build_program(
    methods: &[MethodSpec<'_>],
    mapping: Option<&MappedSafetensors>,
    named: &[(&str, &[u8])],
) -> Result<Built> {
    let lows: Vec<&Lowered> = methods.iter().map(|m| m.lowered).collect();
    let table = stored_weights(&lows);
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
                            let data = match mapping {
                                Some(map) => {
                                    let r = map.file_range(&table[i].key)?;
                                    SegmentData::file_region(
                                        map.path(),
                                        r.start as u64,
                                        (r.end - r.start) as u64,
                                    )
                                }
                                None => SegmentData::Deferred {
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
    Ok(Built {
        builder: pb,
        table,
        reports,
    })
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
