//! Flatbuffer bytes → [`Program`], with the flatbuffers verifier on. Fields the runtime requires
//! are checked for presence here (a clear error instead of a later null dereference); index and
//! range checks live in [`crate::verify`].

use flatbuffers::{Follow, Vector, VerifierOptions};

use crate::generated::executorch_flatbuffer as fb;
use crate::model::*;
use crate::{Error, Result};

/// The verifier limits: ExecuTorch's defaults (depth 64, 1,000,000 tables, < 2 GiB).
fn verifier_options() -> VerifierOptions {
    VerifierOptions {
        max_depth: 64,
        max_tables: 1_000_000,
        max_apparent_size: 1 << 31,
        ignore_missing_null_terminator: false,
    }
}

/// Decodes a flatbuffer region (the bytes `[0, program_size)` of a `.pte`, extended header
/// included) into an owned [`Program`].
pub fn decode_program(buf: &[u8]) -> Result<Program> {
    if buf.len() < 8 {
        return Err(Error::Truncated {
            what: "flatbuffer".into(),
            len: buf.len() as u64,
            need: 8,
        });
    }
    if !fb::program_buffer_has_identifier(buf) {
        return Err(Error::Identifier {
            found: buf[4..8].try_into().unwrap_or_default(),
        });
    }
    let p = fb::root_as_program_with_opts(&verifier_options(), buf)?;
    let execution_plan = req(p.execution_plan(), "Program.execution_plan")?
        .iter()
        .enumerate()
        .map(|(i, e)| plan(e).map_err(|err| err.within(format!("execution_plan[{i}]"))))
        .collect::<Result<Vec<_>>>()?;
    let constant_buffer = p
        .constant_buffer()
        .map(|v| v.iter().map(|b| bytes(b.storage())).collect())
        .unwrap_or_default();
    let backend_delegate_data = p
        .backend_delegate_data()
        .map(|v| v.iter().map(|b| bytes(b.data())).collect())
        .unwrap_or_default();
    let segments: Vec<DataSegment> = p
        .segments()
        .map(|v| {
            v.iter()
                .map(|s| DataSegment {
                    offset: s.offset(),
                    size: s.size(),
                })
                .collect()
        })
        .unwrap_or_default();
    if p.named_data().is_some() && p.segments().is_none() {
        return Err(Error::invalid(
            "Program.named_data is present but Program.segments is absent (the runtime refuses this)",
        ));
    }
    let constant_segment = p.constant_segment().map(subsegment);
    let mutable_data_segments = p
        .mutable_data_segments()
        .map(|v| v.iter().map(subsegment).collect());
    let named_data = match p.named_data() {
        None => None,
        Some(v) => Some(
            v.iter()
                .enumerate()
                .map(|(i, n)| {
                    Ok(NamedData {
                        key: req(n.key(), &format!("named_data[{i}].key"))?.to_string(),
                        segment_index: n.segment_index(),
                    })
                })
                .collect::<Result<Vec<_>>>()?,
        ),
    };
    Ok(Program {
        version: p.version(),
        execution_plan,
        constant_buffer,
        backend_delegate_data,
        segments,
        constant_segment,
        mutable_data_segments,
        named_data,
    })
}

fn req<T>(v: Option<T>, what: &str) -> Result<T> {
    v.ok_or_else(|| Error::invalid(format!("missing required field {what}")))
}

fn vec<'a, T: Follow<'a> + 'a>(v: Option<Vector<'a, T>>) -> Vec<T::Inner> {
    v.map(|v| v.iter().collect()).unwrap_or_default()
}

fn bytes(v: Option<Vector<'_, u8>>) -> Vec<u8> {
    v.map(|v| v.bytes().to_vec()).unwrap_or_default()
}

fn subsegment(s: fb::SubsegmentOffsets<'_>) -> SubsegmentOffsets {
    SubsegmentOffsets {
        segment_index: s.segment_index(),
        offsets: vec(s.offsets()),
    }
}

fn string(s: Option<&str>) -> Option<String> {
    s.map(str::to_string)
}

fn plan(p: fb::ExecutionPlan<'_>) -> Result<ExecutionPlan> {
    let name = req(p.name(), "name")?.to_string();
    let values = req(p.values(), "values")?
        .iter()
        .enumerate()
        .map(|(i, v)| evalue(v).map_err(|e| e.within(format!("values[{i}]"))))
        .collect::<Result<Vec<_>>>()?;
    let chains = req(p.chains(), "chains")?
        .iter()
        .enumerate()
        .map(|(i, c)| chain(c).map_err(|e| e.within(format!("chains[{i}]"))))
        .collect::<Result<Vec<_>>>()?;
    let operators = p
        .operators()
        .map(|v| {
            v.iter()
                .enumerate()
                .map(|(i, o)| {
                    Ok(Operator {
                        name: req(o.name(), &format!("operators[{i}].name"))?.to_string(),
                        overload: req(o.overload(), &format!("operators[{i}].overload"))?
                            .to_string(),
                    })
                })
                .collect::<Result<Vec<_>>>()
        })
        .transpose()?
        .unwrap_or_default();
    let delegates = req(
        p.delegates(),
        "delegates (must be present even when empty; older runtimes crash without it)",
    )?
    .iter()
    .enumerate()
    .map(|(i, d)| {
        let processed = req(d.processed(), &format!("delegates[{i}].processed"))?;
        Ok(BackendDelegate {
            id: req(d.id(), &format!("delegates[{i}].id"))?.to_string(),
            processed: DataReference {
                location: processed.location(),
                index: processed.index(),
            },
            compile_specs: d
                .compile_specs()
                .map(|v| {
                    v.iter()
                        .map(|s| {
                            Ok(CompileSpec {
                                key: req(s.key(), &format!("delegates[{i}].compile_specs.key"))?
                                    .to_string(),
                                value: bytes(s.value()),
                            })
                        })
                        .collect::<Result<Vec<_>>>()
                })
                .transpose()?
                .unwrap_or_default(),
        })
    })
    .collect::<Result<Vec<_>>>()?;
    Ok(ExecutionPlan {
        name,
        container_meta_type: p.container_meta_type().map(|c| ContainerMetadata {
            encoded_inp_str: string(c.encoded_inp_str()),
            encoded_out_str: string(c.encoded_out_str()),
        }),
        values,
        inputs: vec(Some(req(p.inputs(), "inputs")?)),
        outputs: vec(Some(req(p.outputs(), "outputs")?)),
        chains,
        operators,
        delegates,
        non_const_buffer_sizes: vec(Some(req(
            p.non_const_buffer_sizes(),
            "non_const_buffer_sizes",
        )?)),
        non_const_buffer_device: p.non_const_buffer_device().map(|v| {
            v.iter()
                .map(|d| NonConstBufferDevice {
                    buffer_idx: d.buffer_idx(),
                    device_type: d.device_type(),
                    device_index: d.device_index(),
                })
                .collect()
        }),
    })
}

fn chain(c: fb::Chain<'_>) -> Result<Chain> {
    let instructions = req(c.instructions(), "instructions")?
        .iter()
        .enumerate()
        .map(|(i, ins)| instruction(ins).map_err(|e| e.within(format!("instructions[{i}]"))))
        .collect::<Result<Vec<_>>>()?;
    Ok(Chain {
        inputs: vec(c.inputs()),
        outputs: vec(c.outputs()),
        instructions,
        stacktrace: c.stacktrace().map(|v| {
            v.iter()
                .map(|fl| FrameList {
                    items: fl
                        .items()
                        .map(|fr| {
                            fr.iter()
                                .map(|f| Frame {
                                    filename: string(f.filename()),
                                    lineno: f.lineno(),
                                    name: string(f.name()),
                                    context: string(f.context()),
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                })
                .collect()
        }),
    })
}

fn instruction(i: fb::Instruction<'_>) -> Result<Instruction> {
    use fb::InstructionArguments as A;
    let t = i.instr_args_type();
    let missing = || Error::invalid(format!("instruction of type {t:?} has no arguments table"));
    Ok(match t {
        A::KernelCall => {
            let k = i.instr_args_as_kernel_call().ok_or_else(missing)?;
            Instruction::KernelCall {
                op_index: k.op_index(),
                args: vec(k.args()),
            }
        }
        A::DelegateCall => {
            let d = i.instr_args_as_delegate_call().ok_or_else(missing)?;
            Instruction::DelegateCall {
                delegate_index: d.delegate_index(),
                args: vec(d.args()),
            }
        }
        A::MoveCall => {
            let m = i.instr_args_as_move_call().ok_or_else(missing)?;
            Instruction::MoveCall {
                move_from: m.move_from(),
                move_to: m.move_to(),
            }
        }
        A::JumpFalseCall => {
            let j = i.instr_args_as_jump_false_call().ok_or_else(missing)?;
            Instruction::JumpFalseCall {
                cond_value_index: j.cond_value_index(),
                destination_instruction: j.destination_instruction(),
            }
        }
        A::FreeCall => {
            let f = i.instr_args_as_free_call().ok_or_else(missing)?;
            Instruction::FreeCall {
                value_index: f.value_index(),
            }
        }
        other => {
            return Err(Error::invalid(format!(
                "instruction type {} is not a known instruction",
                other.0
            )));
        }
    })
}

fn evalue(v: fb::EValue<'_>) -> Result<EValue> {
    use fb::KernelTypes as K;
    let t = v.val_type();
    let missing = || Error::invalid(format!("EValue of type {t:?} has no value table"));
    Ok(match t {
        // The runtime accepts a Null whose table is absent.
        K::Null => EValue::Null,
        K::Int => EValue::Int(v.val_as_int().ok_or_else(missing)?.int_val()),
        K::Bool => EValue::Bool(v.val_as_bool().ok_or_else(missing)?.bool_val()),
        K::Double => EValue::Double(v.val_as_double().ok_or_else(missing)?.double_val()),
        K::String => EValue::String(
            req(
                v.val_as_string().ok_or_else(missing)?.string_val(),
                "String.string_val",
            )?
            .to_string(),
        ),
        K::IntList => EValue::IntList(vec(v.val_as_int_list().ok_or_else(missing)?.items())),
        K::DoubleList => {
            EValue::DoubleList(vec(v.val_as_double_list().ok_or_else(missing)?.items()))
        }
        K::BoolList => EValue::BoolList(vec(v.val_as_bool_list().ok_or_else(missing)?.items())),
        K::TensorList => {
            EValue::TensorList(vec(v.val_as_tensor_list().ok_or_else(missing)?.items()))
        }
        K::OptionalTensorList => EValue::OptionalTensorList(vec(v
            .val_as_optional_tensor_list()
            .ok_or_else(missing)?
            .items())),
        K::Tensor => EValue::Tensor(tensor(v.val_as_tensor().ok_or_else(missing)?)?),
        K::NONE => {
            return Err(Error::invalid(
                "EValue has type NONE (the runtime rejects it; None is written as Null)",
            ));
        }
        other => {
            return Err(Error::invalid(format!(
                "EValue type {} is not a known value type",
                other.0
            )));
        }
    })
}

fn tensor(t: fb::Tensor<'_>) -> Result<Tensor> {
    Ok(Tensor {
        scalar_type: t.scalar_type(),
        storage_offset: t.storage_offset(),
        sizes: vec(Some(req(t.sizes(), "Tensor.sizes")?)),
        dim_order: vec(Some(req(t.dim_order(), "Tensor.dim_order")?)),
        requires_grad: t.requires_grad(),
        data_buffer_idx: t.data_buffer_idx(),
        allocation_info: t.allocation_info().map(|a| AllocationDetails {
            memory_id: a.memory_id(),
            memory_offset: (a.memory_offset_low() as u64) | ((a.memory_offset_high() as u64) << 32),
        }),
        layout: t.layout(),
        shape_dynamism: t.shape_dynamism(),
        extra_tensor_info: t.extra_tensor_info().map(|e| ExtraTensorInfo {
            mutable_data_segments_idx: e.mutable_data_segments_idx(),
            fully_qualified_name: string(e.fully_qualified_name()),
            location: e.location(),
            device_type: e.device_type(),
            device_index: e.device_index(),
        }),
    })
}
