//! A human-oriented summary of a verified `.pte` (what `petite inspect` prints).

use std::fmt::Write;

use crate::header::Layout;
use crate::model::*;

/// A tensor's description for listings.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Value index.
    pub index: i32,
    /// Kind of value (`Tensor`, `Int`...).
    pub kind: &'static str,
    /// Scalar type name (tensors only).
    pub dtype: Option<String>,
    /// Shape (tensors only).
    pub shape: Vec<i32>,
}

/// One method.
#[derive(Clone, Debug, PartialEq)]
pub struct MethodSummary {
    /// Name.
    pub name: String,
    /// Inputs.
    pub inputs: Vec<TensorInfo>,
    /// Outputs.
    pub outputs: Vec<TensorInfo>,
    /// Number of values.
    pub values: usize,
    /// Instruction counts by kind, e.g. `("KernelCall", 3)`.
    pub instructions: Vec<(String, usize)>,
    /// `name.overload` of each operator.
    pub operators: Vec<String>,
    /// Delegates.
    pub delegates: Vec<DelegateSummary>,
    /// Planned buffer sizes (without the reserved slot 0).
    pub planned_buffers: Vec<i64>,
    /// Where each planned buffer lives, parallel to `planned_buffers`: `host`, or the device
    /// `non_const_buffer_device` names (e.g. `CUDA:0`).
    pub buffer_devices: Vec<String>,
}

/// One delegate.
#[derive(Clone, Debug, PartialEq)]
pub struct DelegateSummary {
    /// Backend id.
    pub backend: String,
    /// Size of the processed blob.
    pub size: u64,
    /// `segment N` or `inline N`.
    pub location: String,
    /// Compile spec keys.
    pub compile_specs: Vec<String>,
}

/// One segment.
#[derive(Clone, Debug, PartialEq)]
pub struct SegmentSummary {
    /// Absolute file offset.
    pub file_offset: u64,
    /// Size.
    pub size: u64,
    /// What uses it (constants, delegate, named data key...).
    pub used_by: Vec<String>,
}

/// The whole file.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    /// File size.
    pub file_len: u64,
    /// Whether the file has an `eh00` header.
    pub extended_header: bool,
    /// Flatbuffer region size.
    pub program_size: u64,
    /// Segment base offset.
    pub segment_base_offset: u64,
    /// Methods.
    pub methods: Vec<MethodSummary>,
    /// Named data: key, segment index, size.
    pub named_data: Vec<(String, u32, u64)>,
    /// Segments.
    pub segments: Vec<SegmentSummary>,
}

fn value_info(plan: &ExecutionPlan, index: i32) -> TensorInfo {
    match plan.values.get(index as usize) {
        Some(EValue::Tensor(t)) => TensorInfo {
            index,
            kind: "Tensor",
            dtype: Some(
                t.scalar_type
                    .variant_name()
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("ScalarType({})", t.scalar_type.0)),
            ),
            shape: t.sizes.clone(),
        },
        Some(v) => TensorInfo {
            index,
            kind: v.kind(),
            dtype: None,
            shape: Vec::new(),
        },
        None => TensorInfo {
            index,
            kind: "<out of range>",
            dtype: None,
            shape: Vec::new(),
        },
    }
}

/// Summarises a program in its file layout.
pub fn summarize(p: &Program, layout: &Layout) -> Summary {
    let mut used_by: Vec<Vec<String>> = vec![Vec::new(); p.segments.len()];
    if let Some(c) = &p.constant_segment
        && c.offsets.len() > 1
        && let Some(u) = used_by.get_mut(c.segment_index as usize)
    {
        u.push(format!("constants ({} tensors)", c.offsets.len() - 1));
    }
    let mut named_data = Vec::new();
    for n in p.named_data.iter().flatten() {
        let size = p
            .segments
            .get(n.segment_index as usize)
            .map_or(0, |s| s.size);
        named_data.push((n.key.clone(), n.segment_index, size));
        if let Some(u) = used_by.get_mut(n.segment_index as usize) {
            u.push(format!("named data {:?}", n.key));
        }
    }
    let methods = p
        .execution_plan
        .iter()
        .map(|plan| {
            let mut counts: Vec<(String, usize)> = Vec::new();
            for ins in plan.chains.iter().flat_map(|c| &c.instructions) {
                let k = match ins {
                    Instruction::KernelCall { .. } => "KernelCall",
                    Instruction::DelegateCall { .. } => "DelegateCall",
                    Instruction::MoveCall { .. } => "MoveCall",
                    Instruction::JumpFalseCall { .. } => "JumpFalseCall",
                    Instruction::FreeCall { .. } => "FreeCall",
                };
                match counts.iter_mut().find(|(n, _)| n == k) {
                    Some((_, c)) => *c += 1,
                    None => counts.push((k.to_string(), 1)),
                }
            }
            let delegates = plan
                .delegates
                .iter()
                .enumerate()
                .map(|(di, d)| {
                    let (size, location) = match d.processed.location {
                        DataLocation::SEGMENT => {
                            let i = d.processed.index as usize;
                            if let Some(u) = used_by.get_mut(i) {
                                u.push(format!("delegate {}[{di}] ({})", plan.name, d.id));
                            }
                            (
                                p.segments.get(i).map_or(0, |s| s.size),
                                format!("segment {i}"),
                            )
                        }
                        _ => {
                            let i = d.processed.index as usize;
                            (
                                p.backend_delegate_data.get(i).map_or(0, |b| b.len() as u64),
                                format!("inline {i}"),
                            )
                        }
                    };
                    DelegateSummary {
                        backend: d.id.clone(),
                        size,
                        location,
                        compile_specs: d.compile_specs.iter().map(|c| c.key.clone()).collect(),
                    }
                })
                .collect();
            MethodSummary {
                name: plan.name.clone(),
                inputs: plan.inputs.iter().map(|&i| value_info(plan, i)).collect(),
                outputs: plan.outputs.iter().map(|&i| value_info(plan, i)).collect(),
                values: plan.values.len(),
                instructions: counts,
                operators: plan
                    .operators
                    .iter()
                    .map(|o| {
                        if o.overload.is_empty() {
                            o.name.clone()
                        } else {
                            format!("{}.{}", o.name, o.overload)
                        }
                    })
                    .collect(),
                delegates,
                planned_buffers: plan
                    .non_const_buffer_sizes
                    .iter()
                    .skip(1)
                    .copied()
                    .collect(),
                buffer_devices: (1..plan.non_const_buffer_sizes.len())
                    .map(|k| {
                        plan.non_const_buffer_device
                            .iter()
                            .flatten()
                            .find(|d| d.buffer_idx as usize == k)
                            .map_or("host".to_string(), |d| {
                                format!("{:?}:{}", d.device_type, d.device_index)
                            })
                    })
                    .collect(),
            }
        })
        .collect();
    let segments = p
        .segments
        .iter()
        .zip(used_by)
        .map(|(s, u)| SegmentSummary {
            file_offset: layout.segment_base_offset + s.offset,
            size: s.size,
            used_by: u,
        })
        .collect();
    Summary {
        file_len: layout.file_len,
        extended_header: layout.header.is_some(),
        program_size: layout.program_size,
        segment_base_offset: layout.segment_base_offset,
        methods,
        named_data,
        segments,
    }
}

fn tensor_text(t: &TensorInfo) -> String {
    match &t.dtype {
        Some(d) => format!("#{} {d}{:?}", t.index, t.shape),
        None => format!("#{} {}", t.index, t.kind),
    }
}

impl Summary {
    /// A plain-text listing.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "file: {} bytes, program {} bytes, {}, segment base {}",
            self.file_len,
            self.program_size,
            if self.extended_header {
                "eh00 header"
            } else {
                "no extended header"
            },
            self.segment_base_offset
        );
        for m in &self.methods {
            let _ = writeln!(s, "method {:?} ({} values)", m.name, m.values);
            let ins: Vec<_> = m.inputs.iter().map(tensor_text).collect();
            let outs: Vec<_> = m.outputs.iter().map(tensor_text).collect();
            let _ = writeln!(s, "  inputs:  {}", ins.join(", "));
            let _ = writeln!(s, "  outputs: {}", outs.join(", "));
            let counts: Vec<_> = m
                .instructions
                .iter()
                .map(|(k, n)| format!("{n} {k}"))
                .collect();
            let _ = writeln!(s, "  instructions: {}", counts.join(", "));
            if !m.operators.is_empty() {
                let _ = writeln!(s, "  operators: {}", m.operators.join(", "));
            }
            for d in &m.delegates {
                let _ = writeln!(
                    s,
                    "  delegate {}: {} bytes in {}{}",
                    d.backend,
                    d.size,
                    d.location,
                    if d.compile_specs.is_empty() {
                        String::new()
                    } else {
                        format!(", compile specs {}", d.compile_specs.join(", "))
                    }
                );
            }
            let buffers: Vec<String> = (m.planned_buffers.iter().zip(&m.buffer_devices))
                .map(|(n, d)| format!("{n} ({d})"))
                .collect();
            let _ = writeln!(s, "  planned buffers: [{}]", buffers.join(", "));
        }
        for (k, seg, size) in &self.named_data {
            let _ = writeln!(s, "named data {k:?}: segment {seg}, {size} bytes");
        }
        for (i, g) in self.segments.iter().enumerate() {
            let _ = writeln!(
                s,
                "segment {i}: offset {} size {} ({})",
                g.file_offset,
                g.size,
                if g.used_by.is_empty() {
                    "unused".to_string()
                } else {
                    g.used_by.join("; ")
                }
            );
        }
        s
    }
}
