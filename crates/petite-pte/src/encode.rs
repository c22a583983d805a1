//! [`Program`] → flatbuffer bytes (identifier `ET12`), with the generated builders. The output is
//! a pure function of the program: same program, same bytes.

use flatbuffers::{FlatBufferBuilder, UnionWIPOffset, WIPOffset};

use crate::generated::executorch_flatbuffer as fb;
use crate::model::*;

type B<'a> = FlatBufferBuilder<'a>;

/// Serialises `program` into a finished flatbuffer with the `ET12` identifier (no extended
/// header; see [`crate::header`]).
pub fn encode_program(program: &Program) -> Vec<u8> {
    let mut b = B::with_capacity(4096);
    let plans: Vec<_> = program
        .execution_plan
        .iter()
        .map(|p| plan(&mut b, p))
        .collect();
    let execution_plan = Some(b.create_vector(&plans));
    let bufs: Vec<_> = program
        .constant_buffer
        .iter()
        .map(|d| {
            let storage = Some(b.create_vector(d));
            fb::Buffer::create(&mut b, &fb::BufferArgs { storage })
        })
        .collect();
    let constant_buffer = Some(b.create_vector(&bufs));
    let inl: Vec<_> = program
        .backend_delegate_data
        .iter()
        .map(|d| {
            let data = Some(b.create_vector(d));
            fb::BackendDelegateInlineData::create(
                &mut b,
                &fb::BackendDelegateInlineDataArgs { data },
            )
        })
        .collect();
    let backend_delegate_data = Some(b.create_vector(&inl));
    let segs: Vec<_> = program
        .segments
        .iter()
        .map(|s| {
            fb::DataSegment::create(
                &mut b,
                &fb::DataSegmentArgs {
                    offset: s.offset,
                    size: s.size,
                },
            )
        })
        .collect();
    let segments = Some(b.create_vector(&segs));
    let constant_segment = program
        .constant_segment
        .as_ref()
        .map(|s| subsegment(&mut b, s));
    let mutable_data_segments = program.mutable_data_segments.as_ref().map(|v| {
        let items: Vec<_> = v.iter().map(|s| subsegment(&mut b, s)).collect();
        b.create_vector(&items)
    });
    let named_data = program.named_data.as_ref().map(|v| {
        let items: Vec<_> = v
            .iter()
            .map(|n| {
                let key = Some(b.create_string(&n.key));
                fb::NamedData::create(
                    &mut b,
                    &fb::NamedDataArgs {
                        key,
                        segment_index: n.segment_index,
                    },
                )
            })
            .collect();
        b.create_vector(&items)
    });
    let root = fb::Program::create(
        &mut b,
        &fb::ProgramArgs {
            version: program.version,
            execution_plan,
            constant_buffer,
            backend_delegate_data,
            segments,
            constant_segment,
            mutable_data_segments,
            named_data,
        },
    );
    fb::finish_program_buffer(&mut b, root);
    b.finished_data().to_vec()
}

fn subsegment<'a>(b: &mut B<'a>, s: &SubsegmentOffsets) -> WIPOffset<fb::SubsegmentOffsets<'a>> {
    let offsets = Some(b.create_vector(&s.offsets));
    fb::SubsegmentOffsets::create(
        b,
        &fb::SubsegmentOffsetsArgs {
            segment_index: s.segment_index,
            offsets,
        },
    )
}

fn opt_str<'a>(b: &mut B<'a>, s: &Option<String>) -> Option<WIPOffset<&'a str>> {
    s.as_ref().map(|s| b.create_string(s))
}

fn plan<'a>(b: &mut B<'a>, p: &ExecutionPlan) -> WIPOffset<fb::ExecutionPlan<'a>> {
    let name = Some(b.create_string(&p.name));
    let container_meta_type = p.container_meta_type.as_ref().map(|c| {
        let encoded_inp_str = opt_str(b, &c.encoded_inp_str);
        let encoded_out_str = opt_str(b, &c.encoded_out_str);
        fb::ContainerMetadata::create(
            b,
            &fb::ContainerMetadataArgs {
                encoded_inp_str,
                encoded_out_str,
            },
        )
    });
    let vals: Vec<_> = p.values.iter().map(|v| evalue(b, v)).collect();
    let values = Some(b.create_vector(&vals));
    let inputs = Some(b.create_vector(&p.inputs));
    let outputs = Some(b.create_vector(&p.outputs));
    let ch: Vec<_> = p.chains.iter().map(|c| chain(b, c)).collect();
    let chains = Some(b.create_vector(&ch));
    let ops: Vec<_> = p
        .operators
        .iter()
        .map(|o| {
            let name = Some(b.create_string(&o.name));
            let overload = Some(b.create_string(&o.overload));
            fb::Operator::create(b, &fb::OperatorArgs { name, overload })
        })
        .collect();
    let operators = Some(b.create_vector(&ops));
    let dels: Vec<_> = p.delegates.iter().map(|d| delegate(b, d)).collect();
    let delegates = Some(b.create_vector(&dels));
    let non_const_buffer_sizes = Some(b.create_vector(&p.non_const_buffer_sizes));
    let non_const_buffer_device = p.non_const_buffer_device.as_ref().map(|v| {
        let items: Vec<_> = v
            .iter()
            .map(|d| {
                fb::NonConstBufferDevice::create(
                    b,
                    &fb::NonConstBufferDeviceArgs {
                        buffer_idx: d.buffer_idx,
                        device_type: d.device_type,
                        device_index: d.device_index,
                    },
                )
            })
            .collect();
        b.create_vector(&items)
    });
    fb::ExecutionPlan::create(
        b,
        &fb::ExecutionPlanArgs {
            name,
            container_meta_type,
            values,
            inputs,
            outputs,
            chains,
            operators,
            delegates,
            non_const_buffer_sizes,
            non_const_buffer_device,
        },
    )
}

fn delegate<'a>(b: &mut B<'a>, d: &BackendDelegate) -> WIPOffset<fb::BackendDelegate<'a>> {
    let id = Some(b.create_string(&d.id));
    let processed = Some(fb::BackendDelegateDataReference::create(
        b,
        &fb::BackendDelegateDataReferenceArgs {
            location: d.processed.location,
            index: d.processed.index,
        },
    ));
    let specs: Vec<_> = d
        .compile_specs
        .iter()
        .map(|s| {
            let key = Some(b.create_string(&s.key));
            let value = Some(b.create_vector(&s.value));
            fb::CompileSpec::create(b, &fb::CompileSpecArgs { key, value })
        })
        .collect();
    let compile_specs = Some(b.create_vector(&specs));
    fb::BackendDelegate::create(
        b,
        &fb::BackendDelegateArgs {
            id,
            processed,
            compile_specs,
        },
    )
}

fn chain<'a>(b: &mut B<'a>, c: &Chain) -> WIPOffset<fb::Chain<'a>> {
    let inputs = Some(b.create_vector(&c.inputs));
    let outputs = Some(b.create_vector(&c.outputs));
    let ins: Vec<_> = c.instructions.iter().map(|i| instruction(b, i)).collect();
    let instructions = Some(b.create_vector(&ins));
    let stacktrace = c.stacktrace.as_ref().map(|st| {
        let lists: Vec<_> = st
            .iter()
            .map(|fl| {
                let frames: Vec<_> = fl
                    .items
                    .iter()
                    .map(|f| {
                        let filename = opt_str(b, &f.filename);
                        let name = opt_str(b, &f.name);
                        let context = opt_str(b, &f.context);
                        fb::Frame::create(
                            b,
                            &fb::FrameArgs {
                                filename,
                                lineno: f.lineno,
                                name,
                                context,
                            },
                        )
                    })
                    .collect();
                let items = Some(b.create_vector(&frames));
                fb::FrameList::create(b, &fb::FrameListArgs { items })
            })
            .collect();
        b.create_vector(&lists)
    });
    fb::Chain::create(
        b,
        &fb::ChainArgs {
            inputs,
            outputs,
            instructions,
            stacktrace,
        },
    )
}

fn instruction<'a>(b: &mut B<'a>, i: &Instruction) -> WIPOffset<fb::Instruction<'a>> {
    let (ty, off): (fb::InstructionArguments, WIPOffset<UnionWIPOffset>) = match i {
        Instruction::KernelCall { op_index, args } => {
            let args = Some(b.create_vector(args));
            let o = fb::KernelCall::create(
                b,
                &fb::KernelCallArgs {
                    op_index: *op_index,
                    args,
                },
            );
            (fb::InstructionArguments::KernelCall, o.as_union_value())
        }
        Instruction::DelegateCall {
            delegate_index,
            args,
        } => {
            let args = Some(b.create_vector(args));
            let o = fb::DelegateCall::create(
                b,
                &fb::DelegateCallArgs {
                    delegate_index: *delegate_index,
                    args,
                },
            );
            (fb::InstructionArguments::DelegateCall, o.as_union_value())
        }
        Instruction::MoveCall { move_from, move_to } => {
            let o = fb::MoveCall::create(
                b,
                &fb::MoveCallArgs {
                    move_from: *move_from,
                    move_to: *move_to,
                },
            );
            (fb::InstructionArguments::MoveCall, o.as_union_value())
        }
        Instruction::JumpFalseCall {
            cond_value_index,
            destination_instruction,
        } => {
            let o = fb::JumpFalseCall::create(
                b,
                &fb::JumpFalseCallArgs {
                    cond_value_index: *cond_value_index,
                    destination_instruction: *destination_instruction,
                },
            );
            (fb::InstructionArguments::JumpFalseCall, o.as_union_value())
        }
        Instruction::FreeCall { value_index } => {
            let o = fb::FreeCall::create(
                b,
                &fb::FreeCallArgs {
                    value_index: *value_index,
                },
            );
            (fb::InstructionArguments::FreeCall, o.as_union_value())
        }
    };
    fb::Instruction::create(
        b,
        &fb::InstructionArgs {
            instr_args_type: ty,
            instr_args: Some(off),
        },
    )
}

fn evalue<'a>(b: &mut B<'a>, v: &EValue) -> WIPOffset<fb::EValue<'a>> {
    use fb::KernelTypes as K;
    let (ty, off): (K, WIPOffset<UnionWIPOffset>) = match v {
        EValue::Null => (
            K::Null,
            fb::Null::create(b, &fb::NullArgs {}).as_union_value(),
        ),
        EValue::Int(x) => (
            K::Int,
            fb::Int::create(b, &fb::IntArgs { int_val: *x }).as_union_value(),
        ),
        EValue::Bool(x) => (
            K::Bool,
            fb::Bool::create(b, &fb::BoolArgs { bool_val: *x }).as_union_value(),
        ),
        EValue::Double(x) => (
            K::Double,
            fb::Double::create(b, &fb::DoubleArgs { double_val: *x }).as_union_value(),
        ),
        EValue::String(s) => {
            let string_val = Some(b.create_string(s));
            (
                K::String,
                fb::String::create(b, &fb::StringArgs { string_val }).as_union_value(),
            )
        }
        EValue::IntList(items) => {
            let items = Some(b.create_vector(items));
            (
                K::IntList,
                fb::IntList::create(b, &fb::IntListArgs { items }).as_union_value(),
            )
        }
        EValue::DoubleList(items) => {
            let items = Some(b.create_vector(items));
            (
                K::DoubleList,
                fb::DoubleList::create(b, &fb::DoubleListArgs { items }).as_union_value(),
            )
        }
        EValue::BoolList(items) => {
            let items = Some(b.create_vector(items));
            (
                K::BoolList,
                fb::BoolList::create(b, &fb::BoolListArgs { items }).as_union_value(),
            )
        }
        EValue::TensorList(items) => {
            let items = Some(b.create_vector(items));
            (
                K::TensorList,
                fb::TensorList::create(b, &fb::TensorListArgs { items }).as_union_value(),
            )
        }
        EValue::OptionalTensorList(items) => {
            let items = Some(b.create_vector(items));
            (
                K::OptionalTensorList,
                fb::OptionalTensorList::create(b, &fb::OptionalTensorListArgs { items })
                    .as_union_value(),
            )
        }
        EValue::Tensor(t) => (K::Tensor, tensor(b, t).as_union_value()),
    };
    fb::EValue::create(
        b,
        &fb::EValueArgs {
            val_type: ty,
            val: Some(off),
        },
    )
}

fn tensor<'a>(b: &mut B<'a>, t: &Tensor) -> WIPOffset<fb::Tensor<'a>> {
    let sizes = Some(b.create_vector(&t.sizes));
    let dim_order = Some(b.create_vector(&t.dim_order));
    let allocation_info = t.allocation_info.map(|a| {
        fb::AllocationDetails::create(
            b,
            &fb::AllocationDetailsArgs {
                memory_id: a.memory_id,
                memory_offset_low: a.memory_offset as u32,
                memory_offset_high: (a.memory_offset >> 32) as u32,
            },
        )
    });
    let extra_tensor_info = t.extra_tensor_info.as_ref().map(|e| {
        let fully_qualified_name = opt_str(b, &e.fully_qualified_name);
        fb::ExtraTensorInfo::create(
            b,
            &fb::ExtraTensorInfoArgs {
                mutable_data_segments_idx: e.mutable_data_segments_idx,
                fully_qualified_name,
                location: e.location,
                device_type: e.device_type,
                device_index: e.device_index,
            },
        )
    });
    fb::Tensor::create(
        b,
        &fb::TensorArgs {
            scalar_type: t.scalar_type,
            storage_offset: t.storage_offset,
            sizes,
            dim_order,
            requires_grad: t.requires_grad,
            data_buffer_idx: t.data_buffer_idx,
            allocation_info,
            layout: t.layout,
            shape_dynamism: t.shape_dynamism,
            extra_tensor_info,
        },
    )
}
