//! Structural checks beyond the flatbuffers verifier: every index in range, every planned tensor
//! inside its buffer, every segment inside the file and no two overlapping. These are the rules the
//! runtime enforces (or silently breaks on), checked up front with messages that say where.

use std::collections::BTreeSet;

use crate::header::Layout;
use crate::model::*;
use crate::{Error, Result};

/// Longest `name.overload` the runtime's operator lookup buffer holds.
const MAX_OPERATOR_NAME: usize = 100;
/// Highest tensor rank the runtime supports.
const MAX_RANK: usize = 16;

/// Checks a program on its own (no file): indices, tensors, planned memory, constants.
pub fn verify_program(p: &Program) -> Result<()> {
    if !p.constant_buffer.is_empty()
        && p.constant_segment
            .as_ref()
            .is_some_and(|c| c.offsets.len() > 1)
    {
        return Err(Error::invalid(
            "both constant_buffer and constant_segment hold constants (the runtime allows only one)",
        ));
    }
    let nseg = p.segments.len();
    for (i, s) in p.segments.iter().enumerate() {
        s.offset.checked_add(s.size).ok_or_else(|| {
            Error::invalid(format!(
                "segments[{i}]: offset {} + size {} overflows",
                s.offset, s.size
            ))
        })?;
    }
    // Constant tensors' byte ranges are checked per tensor below; here the table itself.
    let constant_seg_size = match &p.constant_segment {
        Some(c) if c.offsets.len() > 1 => {
            let seg = p.segments.get(c.segment_index as usize).ok_or_else(|| {
                Error::invalid(format!(
                    "constant_segment.segment_index {} is out of range ({nseg} segments)",
                    c.segment_index
                ))
            })?;
            for (k, &o) in c.offsets.iter().enumerate() {
                if o > seg.size {
                    return Err(Error::invalid(format!(
                        "constant_segment.offsets[{k}] = {o} lies beyond the constant segment ({} bytes)",
                        seg.size
                    )));
                }
            }
            Some(seg.size)
        }
        _ => None,
    };
    if let Some(m) = &p.mutable_data_segments {
        for (k, s) in m.iter().enumerate() {
            if s.segment_index as usize >= nseg {
                return Err(Error::invalid(format!(
                    "mutable_data_segments[{k}].segment_index {} is out of range ({nseg} segments)",
                    s.segment_index
                )));
            }
        }
    }
    if let Some(nd) = &p.named_data {
        let mut keys = BTreeSet::new();
        for (k, n) in nd.iter().enumerate() {
            if n.segment_index as usize >= nseg {
                return Err(Error::invalid(format!(
                    "named_data[{k}] (key {:?}): segment_index {} is out of range ({nseg} segments)",
                    n.key, n.segment_index
                )));
            }
            if !keys.insert(n.key.as_str()) {
                return Err(Error::invalid(format!(
                    "named_data[{k}]: key {:?} appears twice",
                    n.key
                )));
            }
        }
    }
    let mut names = BTreeSet::new();
    for (i, plan) in p.execution_plan.iter().enumerate() {
        if !names.insert(plan.name.as_str()) {
            return Err(Error::invalid(format!(
                "execution_plan[{i}]: method name {:?} appears twice",
                plan.name
            )));
        }
        verify_plan(p, plan, constant_seg_size)
            .map_err(|e| e.within(format!("method {:?} (execution_plan[{i}])", plan.name)))?;
    }
    Ok(())
}

fn check_index(i: i64, len: usize, what: &str) -> Result<()> {
    if i < 0 || i as u64 >= len as u64 {
        return Err(Error::invalid(format!(
            "{what} {i} is out of range (0..{len})"
        )));
    }
    Ok(())
}

fn verify_plan(p: &Program, plan: &ExecutionPlan, constant_seg_size: Option<u64>) -> Result<()> {
    let nv = plan.values.len();
    if plan.chains.is_empty() {
        return Err(Error::invalid(
            "chains is empty (the runtime needs at least one)",
        ));
    }
    if plan.non_const_buffer_sizes.is_empty() {
        return Err(Error::invalid(
            "non_const_buffer_sizes is empty (slot 0 is reserved and must be present)",
        ));
    }
    for (k, &s) in plan.non_const_buffer_sizes.iter().enumerate() {
        if s < 0 {
            return Err(Error::invalid(format!(
                "non_const_buffer_sizes[{k}] = {s} is negative"
            )));
        }
    }
    for &i in &plan.inputs {
        check_index(i as i64, nv, "input value index")?;
    }
    for &i in &plan.outputs {
        check_index(i as i64, nv, "output value index")?;
    }
    for (vi, v) in plan.values.iter().enumerate() {
        verify_value(p, plan, v, constant_seg_size)
            .map_err(|e| e.within(format!("values[{vi}]")))?;
    }
    for (k, op) in plan.operators.iter().enumerate() {
        let full = op.name.len() + 1 + op.overload.len();
        if op.name.is_empty() || full >= MAX_OPERATOR_NAME {
            return Err(Error::invalid(format!(
                "operators[{k}] {:?}.{:?}: name must be non-empty and shorter than {MAX_OPERATOR_NAME} bytes",
                op.name, op.overload
            )));
        }
    }
    for (k, d) in plan.delegates.iter().enumerate() {
        let (len, list) = match d.processed.location {
            DataLocation::INLINE => (p.backend_delegate_data.len(), "backend_delegate_data"),
            DataLocation::SEGMENT => (p.segments.len(), "segments"),
            other => {
                return Err(Error::invalid(format!(
                    "delegates[{k}] ({}): unknown data location {}",
                    d.id, other.0
                )));
            }
        };
        if d.processed.index as usize >= len {
            return Err(Error::invalid(format!(
                "delegates[{k}] ({}): processed data index {} is out of range ({len} entries in {list})",
                d.id, d.processed.index
            )));
        }
    }
    if let Some(devs) = &plan.non_const_buffer_device {
        for d in devs {
            if d.buffer_idx < 1 {
                return Err(Error::invalid(format!(
                    "non_const_buffer_device buffer_idx {} must be >= 1",
                    d.buffer_idx
                )));
            }
            check_index(
                d.buffer_idx as i64,
                plan.non_const_buffer_sizes.len(),
                "non_const_buffer_device buffer_idx",
            )?;
        }
    }
    for (ci, chain) in plan.chains.iter().enumerate() {
        let ni = chain.instructions.len();
        for (ii, ins) in chain.instructions.iter().enumerate() {
            let at = |e: Error| e.within(format!("chains[{ci}].instructions[{ii}]"));
            match ins {
                Instruction::KernelCall { op_index, args } => {
                    check_index(*op_index as i64, plan.operators.len(), "operator index")
                        .map_err(at)?;
                    for &a in args {
                        check_index(a as i64, nv, "kernel argument value index").map_err(at)?;
                    }
                }
                Instruction::DelegateCall {
                    delegate_index,
                    args,
                } => {
                    check_index(
                        *delegate_index as i64,
                        plan.delegates.len(),
                        "delegate index",
                    )
                    .map_err(at)?;
                    for &a in args {
                        check_index(a as i64, nv, "delegate argument value index").map_err(at)?;
                    }
                }
                Instruction::MoveCall { move_from, move_to } => {
                    check_index(*move_from as i64, nv, "move_from value index").map_err(at)?;
                    check_index(*move_to as i64, nv, "move_to value index").map_err(at)?;
                }
                Instruction::JumpFalseCall {
                    cond_value_index,
                    destination_instruction,
                } => {
                    check_index(*cond_value_index as i64, nv, "condition value index")
                        .map_err(at)?;
                    check_index(*destination_instruction as i64, ni, "jump destination")
                        .map_err(at)?;
                }
                Instruction::FreeCall { value_index } => {
                    check_index(*value_index as i64, nv, "free value index").map_err(at)?;
                }
            }
        }
    }
    Ok(())
}

fn verify_value(
    p: &Program,
    plan: &ExecutionPlan,
    v: &EValue,
    constant_seg_size: Option<u64>,
) -> Result<()> {
    let vals = &plan.values;
    match v {
        EValue::IntList(items) => {
            for &i in items {
                check_index(i, vals.len(), "IntList item (a value index)")?;
                if !matches!(vals[i as usize], EValue::Int(_)) {
                    return Err(Error::invalid(format!(
                        "IntList item {i} points at a {} value; IntList items are indices of Int values",
                        vals[i as usize].kind()
                    )));
                }
            }
        }
        EValue::TensorList(items) => {
            for &i in items {
                check_index(i as i64, vals.len(), "TensorList item")?;
                if !matches!(vals[i as usize], EValue::Tensor(_)) {
                    return Err(Error::invalid(format!(
                        "TensorList item {i} points at a {} value, expected a Tensor",
                        vals[i as usize].kind()
                    )));
                }
            }
        }
        EValue::OptionalTensorList(items) => {
            for &i in items {
                check_index(i as i64, vals.len(), "OptionalTensorList item")?;
                if !matches!(vals[i as usize], EValue::Tensor(_) | EValue::Null) {
                    return Err(Error::invalid(format!(
                        "OptionalTensorList item {i} points at a {} value, expected a Tensor or Null",
                        vals[i as usize].kind()
                    )));
                }
            }
        }
        EValue::Tensor(t) => verify_tensor(p, plan, t, constant_seg_size)?,
        _ => {}
    }
    Ok(())
}

fn verify_tensor(
    p: &Program,
    plan: &ExecutionPlan,
    t: &Tensor,
    constant_seg_size: Option<u64>,
) -> Result<()> {
    if element_size(t.scalar_type).is_none() {
        return Err(Error::invalid(format!(
            "tensor has unknown scalar_type {}",
            t.scalar_type.0
        )));
    }
    if t.sizes.len() > MAX_RANK {
        return Err(Error::invalid(format!(
            "tensor rank {} exceeds {MAX_RANK}",
            t.sizes.len()
        )));
    }
    if t.dim_order.len() != t.sizes.len() {
        return Err(Error::invalid(format!(
            "tensor dim_order has {} entries but sizes has {}",
            t.dim_order.len(),
            t.sizes.len()
        )));
    }
    let mut seen = [false; MAX_RANK];
    for &d in &t.dim_order {
        if d as usize >= t.sizes.len() || std::mem::replace(&mut seen[d as usize], true) {
            return Err(Error::invalid(format!(
                "tensor dim_order {:?} is not a permutation of 0..{}",
                t.dim_order,
                t.sizes.len()
            )));
        }
    }
    if t.storage_offset != 0 {
        return Err(Error::invalid(format!(
            "tensor storage_offset is {}, must be 0",
            t.storage_offset
        )));
    }
    match t.shape_dynamism {
        TensorShapeDynamism::STATIC | TensorShapeDynamism::DYNAMIC_BOUND => {}
        other => {
            return Err(Error::invalid(format!(
                "tensor shape_dynamism {:?} is not supported by the runtime",
                other
            )));
        }
    }
    let nbytes = t.nbytes().ok_or_else(|| {
        Error::invalid(format!(
            "tensor sizes {:?} are negative or overflow",
            t.sizes
        ))
    })?;
    let external = t
        .extra_tensor_info
        .as_ref()
        .is_some_and(|e| e.location == TensorDataLocation::EXTERNAL);
    if let Some(a) = t.allocation_info {
        let n = plan.non_const_buffer_sizes.len();
        if a.memory_id == 0 || a.memory_id as usize >= n {
            return Err(Error::invalid(format!(
                "tensor memory_id {} is out of range: memory ids are 1-based and there are {} planned buffers",
                a.memory_id,
                n - 1
            )));
        }
        let size = plan.non_const_buffer_sizes[a.memory_id as usize] as u64;
        if a.memory_offset
            .checked_add(nbytes)
            .is_none_or(|end| end > size)
        {
            return Err(Error::invalid(format!(
                "tensor at offset {} ({nbytes} bytes) does not fit planned buffer {} of {size} bytes",
                a.memory_offset, a.memory_id
            )));
        }
        // A planned tensor lives where its buffer lives: ExecuTorch tags device tensors and
        // backs their buffer with that device's memory; a tag that disagrees with the buffer
        // would hand a host pointer to device code or the reverse.
        let buffer_device = plan
            .non_const_buffer_device
            .iter()
            .flatten()
            .find(|d| d.buffer_idx as u32 == a.memory_id)
            .map_or((DeviceType::CPU, 0), |d| (d.device_type, d.device_index));
        let tensor_device = t
            .extra_tensor_info
            .as_ref()
            .map_or((DeviceType::CPU, 0), |e| (e.device_type, e.device_index));
        if buffer_device != tensor_device {
            return Err(Error::invalid(format!(
                "tensor in planned buffer {} is tagged {:?}:{} but the buffer is on {:?}:{}",
                a.memory_id, tensor_device.0, tensor_device.1, buffer_device.0, buffer_device.1
            )));
        }
    } else if t.data_buffer_idx > 0 && !external {
        let idx = t.data_buffer_idx as usize;
        if let Some(seg_size) = constant_seg_size {
            let offs = &p
                .constant_segment
                .as_ref()
                .expect("constant segment size implies a constant segment")
                .offsets;
            let off = *offs.get(idx).ok_or_else(|| {
                Error::invalid(format!(
                    "tensor data_buffer_idx {idx} is out of range ({} constant offsets)",
                    offs.len()
                ))
            })?;
            if off.checked_add(nbytes).is_none_or(|end| end > seg_size) {
                return Err(Error::invalid(format!(
                    "constant tensor data_buffer_idx {idx} at offset {off} ({nbytes} bytes) runs past the constant segment ({seg_size} bytes)"
                )));
            }
        } else if idx >= p.constant_buffer.len() {
            return Err(Error::invalid(format!(
                "tensor data_buffer_idx {idx} refers to constant data, but the program has none"
            )));
        }
    }
    Ok(())
}

/// Checks a program's segments against the file they are in: inside the file, inside
/// `segment_data_size`, no overlaps, and no segment data without an extended header.
pub fn verify_layout(p: &Program, layout: &Layout) -> Result<()> {
    let data_size = layout.header.and_then(|h| h.segment_data_size);
    let mut ranges: Vec<(u64, u64, usize)> = Vec::new();
    for (i, s) in p.segments.iter().enumerate() {
        let end = s
            .offset
            .checked_add(s.size)
            .ok_or_else(|| Error::invalid(format!("segments[{i}]: offset + size overflows")))?;
        if s.size == 0 {
            continue;
        }
        if layout.header.is_none() {
            return Err(Error::Header(format!(
                "segments[{i}] holds {} bytes but the file has no eh00 extended header at byte 8 \
                 (the header is missing or corrupt; the runtime would read the segment from the wrong place)",
                s.size
            )));
        }
        if let Some(ds) = data_size
            && end > ds
        {
            return Err(Error::invalid(format!(
                "segments[{i}] ends at {end}, past segment_data_size {ds}"
            )));
        }
        let inside_file = layout
            .segment_base_offset
            .checked_add(end)
            .is_some_and(|e| e <= layout.file_len);
        if !inside_file {
            return Err(Error::invalid(format!(
                "segments[{i}] (offset {} size {}) lies outside the {}-byte file (segment base {})",
                s.offset, s.size, layout.file_len, layout.segment_base_offset
            )));
        }
        ranges.push((s.offset, end, i));
    }
    ranges.sort();
    for w in ranges.windows(2) {
        let (a, b) = (w[0], w[1]);
        if b.0 < a.1 {
            return Err(Error::invalid(format!(
                "segments[{}] [{}, {}) and segments[{}] [{}, {}) overlap",
                a.2, a.0, a.1, b.2, b.0, b.1
            )));
        }
    }
    Ok(())
}
