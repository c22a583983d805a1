//! A typed builder for programs: methods with values, exact kernel-call argument lists, delegates,
//! planned memory, constants, segments and named data. It produces a [`Program`] plus the segment
//! sources, which [`crate::write_pte`] streams into the file.
//!
//! Segment order follows EXIR: the constant segment first (if any constants), then segments in
//! the order they were added. A segment added once can be used by any number of delegates and
//! named-data keys, so an engine is stored once however many delegates use it.

use std::collections::BTreeMap;
use std::path::Path;

use crate::lifetime::{Lifetime, Order};
use crate::model::*;
use crate::writer::{
    FillFn, Segment, SegmentData, WriteOptions, WriteSummary, write_pte, write_pte_streamed,
};
use crate::{Error, Result};

/// Alignment of tensors inside the constant segment (EXIR's `ALIGNMENT`).
pub const CONSTANT_ALIGNMENT: usize = 16;
/// Alignment of planned tensors inside a planned buffer (the planner's, [`crate::lifetime`]).
pub use crate::lifetime::PLANNED_ALIGNMENT;

/// A segment added to a [`ProgramBuilder`] (resolved to a segment index when built).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct SegmentId(usize);

/// Where a delegate's processed blob lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Processed {
    /// In a segment (the normal case: streamed, aligned).
    Segment(SegmentId),
    /// Inline in `backend_delegate_data[index]` (small blobs; not 16-byte aligned, see the
    /// format doc's trap 12).
    Inline(u32),
}

/// A delegate to add to a method.
#[derive(Clone, Debug)]
pub struct DelegateSpec {
    /// Backend registry name, e.g. `TensorRTBackend`.
    pub id: String,
    /// Where the processed blob lives.
    pub processed: Processed,
    /// Passed verbatim to the backend's `init()`.
    pub compile_specs: Vec<CompileSpec>,
}

/// Builds a whole program.
#[derive(Debug, Default)]
pub struct ProgramBuilder {
    methods: Vec<MethodBuilder>,
    /// Constant bytes not yet moved into `constant_parts`.
    constants: Vec<u8>,
    /// Earlier constant-segment pieces (in-memory runs and file regions), in order.
    constant_parts: Vec<SegmentData>,
    /// Bytes in `constant_parts`.
    constant_parts_len: u64,
    constant_offsets: Vec<u64>,
    segments: Vec<Segment>,
    named: BTreeMap<String, SegmentId>,
    named_order: Vec<String>,
    inline: Vec<Vec<u8>>,
}

impl ProgramBuilder {
    /// An empty program.
    pub fn new() -> ProgramBuilder {
        ProgramBuilder {
            constant_offsets: vec![0],
            ..Default::default()
        }
    }

    /// Adds constant tensor bytes to the constant segment; returns the `data_buffer_idx` for
    /// [`MethodBuilder::constant_tensor`]. Constants are held in memory until written: they are
    /// meant for small tensors; large ones go in with [`ProgramBuilder::add_constant_data`].
    pub fn add_constant(&mut self, bytes: &[u8]) -> u32 {
        self.pad_constants();
        self.constant_offsets
            .push(self.constant_parts_len + self.constants.len() as u64);
        self.constants.extend_from_slice(bytes);
        (self.constant_offsets.len() - 1) as u32
    }

    /// Adds a constant tensor whose bytes come from `data` (a file region, or deferred data
    /// streamed by [`crate::write_pte_streamed`]'s callback), so a large weight goes into the
    /// constant segment without passing through memory. Returns the `data_buffer_idx`.
    pub fn add_constant_data(&mut self, data: SegmentData) -> u32 {
        self.pad_constants();
        if !self.constants.is_empty() {
            let run = std::mem::take(&mut self.constants);
            self.constant_parts_len += run.len() as u64;
            self.constant_parts.push(SegmentData::bytes(run));
        }
        self.constant_offsets.push(self.constant_parts_len);
        self.constant_parts_len += data.len();
        self.constant_parts.push(data);
        (self.constant_offsets.len() - 1) as u32
    }

    /// Pads the constant segment to [`CONSTANT_ALIGNMENT`] before the next constant (EXIR pads
    /// between tensors, not before the first).
    fn pad_constants(&mut self) {
        if self.constant_offsets.len() > 1 {
            let total = self.constant_parts_len + self.constants.len() as u64;
            let pad = total.next_multiple_of(CONSTANT_ALIGNMENT as u64) - total;
            self.constants
                .resize(self.constants.len() + pad as usize, 0);
        }
    }

    /// Adds a segment (e.g. an engine file region); usable by delegates and named data.
    pub fn add_segment(&mut self, data: SegmentData, alignment: u64) -> Result<SegmentId> {
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(Error::Build(format!(
                "segment alignment {alignment} is not a power of two"
            )));
        }
        self.segments.push(Segment { data, alignment });
        Ok(SegmentId(self.segments.len() - 1))
    }

    /// Adds named data: a new segment under `key`. Keys are unique.
    pub fn add_named_data(
        &mut self,
        key: &str,
        data: SegmentData,
        alignment: u64,
    ) -> Result<SegmentId> {
        self.check_key(key)?;
        let id = self.add_segment(data, alignment)?;
        self.name_segment(key, id)?;
        Ok(id)
    }

    /// Names an existing segment with another key (several keys may share one segment).
    pub fn name_segment(&mut self, key: &str, segment: SegmentId) -> Result<()> {
        self.check_key(key)?;
        if segment.0 >= self.segments.len() {
            return Err(Error::Build(format!("unknown segment {segment:?}")));
        }
        self.named.insert(key.to_string(), segment);
        self.named_order.push(key.to_string());
        Ok(())
    }

    fn check_key(&self, key: &str) -> Result<()> {
        if key.is_empty() {
            return Err(Error::Build("named data key is empty".into()));
        }
        if self.named.contains_key(key) {
            return Err(Error::Build(format!(
                "named data key {key:?} is already used (each key names one blob)"
            )));
        }
        Ok(())
    }

    /// The segment a named-data key refers to.
    pub fn named_data(&self, key: &str) -> Option<SegmentId> {
        self.named.get(key).copied()
    }

    /// Adds an inline delegate blob; returns its index for [`Processed::Inline`].
    pub fn add_inline_delegate_data(&mut self, bytes: Vec<u8>) -> u32 {
        self.inline.push(bytes);
        (self.inline.len() - 1) as u32
    }

    /// Adds a method.
    pub fn add_method(&mut self, method: MethodBuilder) -> Result<()> {
        if self.methods.iter().any(|m| m.plan.name == method.plan.name) {
            return Err(Error::Build(format!(
                "method {:?} is defined twice",
                method.plan.name
            )));
        }
        self.methods.push(method);
        Ok(())
    }

    /// Resolves ids into indices and returns the program and the segments to stream (in file
    /// order). `program.segments` is filled in by the writer.
    pub fn build(self) -> Result<(Program, Vec<Segment>)> {
        let has_constants = self.constant_offsets.len() > 1;
        let shift = usize::from(has_constants);
        let mut segments = Vec::with_capacity(self.segments.len() + shift);
        if has_constants {
            let mut parts = self.constant_parts;
            if !self.constants.is_empty() {
                parts.push(SegmentData::bytes(self.constants));
            }
            let data = match parts.len() {
                // Only empty constants: an empty in-memory segment, as before parts existed.
                0 => SegmentData::bytes(Vec::<u8>::new()),
                1 => parts.pop().expect("one part"),
                _ => SegmentData::Parts(parts.into()),
            };
            segments.push(Segment { data, alignment: 1 });
        }
        segments.extend(self.segments);
        let seg_index = |id: SegmentId| (id.0 + shift) as u32;
        let mut plans = Vec::with_capacity(self.methods.len());
        for m in self.methods {
            let mut plan = m.plan;
            for (d, spec) in m.delegates.into_iter().enumerate() {
                let processed = match spec.processed {
                    Processed::Segment(id) => {
                        if id.0 + shift >= segments.len() {
                            return Err(Error::Build(format!(
                                "method {:?} delegate {d}: unknown segment {id:?}",
                                plan.name
                            )));
                        }
                        DataReference {
                            location: DataLocation::SEGMENT,
                            index: seg_index(id),
                        }
                    }
                    Processed::Inline(i) => DataReference {
                        location: DataLocation::INLINE,
                        index: i,
                    },
                };
                plan.delegates.push(BackendDelegate {
                    id: spec.id,
                    processed,
                    compile_specs: spec.compile_specs,
                });
            }
            plans.push(plan);
        }
        let named_data = (!self.named_order.is_empty()).then(|| {
            self.named_order
                .iter()
                .map(|k| NamedData {
                    key: k.clone(),
                    segment_index: seg_index(self.named[k]),
                })
                .collect()
        });
        let program = Program {
            version: 0,
            execution_plan: plans,
            constant_buffer: Vec::new(),
            backend_delegate_data: self.inline,
            segments: Vec::new(),
            constant_segment: Some(SubsegmentOffsets {
                segment_index: 0,
                offsets: self.constant_offsets,
            }),
            mutable_data_segments: None,
            named_data,
        };
        Ok((program, segments))
    }

    /// Builds and writes the program to `path` (temporary name, then rename).
    pub fn write(self, path: impl AsRef<Path>, opts: WriteOptions) -> Result<WriteSummary> {
        let (program, segments) = self.build()?;
        write_pte(path, &program, &segments, opts)
    }

    /// [`ProgramBuilder::write`] with the callback that produces deferred constant data.
    pub fn write_streamed(
        self,
        path: impl AsRef<Path>,
        opts: WriteOptions,
        fill: &mut FillFn<'_>,
    ) -> Result<WriteSummary> {
        let (program, segments) = self.build()?;
        write_pte_streamed(path, &program, &segments, opts, fill)
    }
}

/// Builds one method (execution plan).
#[derive(Debug)]
pub struct MethodBuilder {
    plan: ExecutionPlan,
    delegates: Vec<DelegateSpec>,
    operators: BTreeMap<(String, String), i32>,
}

impl MethodBuilder {
    /// A method with one empty chain and only the reserved planned-buffer slot.
    pub fn new(name: &str) -> MethodBuilder {
        MethodBuilder {
            plan: ExecutionPlan {
                name: name.to_string(),
                chains: vec![Chain::default()],
                non_const_buffer_sizes: vec![0],
                ..Default::default()
            },
            delegates: Vec::new(),
            operators: BTreeMap::new(),
        }
    }

    /// Sets the pytree specs (optional for the runtime).
    pub fn container_meta(&mut self, inp: &str, out: &str) {
        self.plan.container_meta_type = Some(ContainerMetadata {
            encoded_inp_str: Some(inp.to_string()),
            encoded_out_str: Some(out.to_string()),
        });
    }

    /// Appends a value; returns its index.
    pub fn value(&mut self, v: EValue) -> i32 {
        self.plan.values.push(v);
        (self.plan.values.len() - 1) as i32
    }

    /// A `Null` value (None).
    pub fn null(&mut self) -> i32 {
        self.value(EValue::Null)
    }

    /// An `Int` value.
    pub fn int(&mut self, x: i64) -> i32 {
        self.value(EValue::Int(x))
    }

    /// A `Bool` value.
    pub fn bool(&mut self, x: bool) -> i32 {
        self.value(EValue::Bool(x))
    }

    /// A `Double` value.
    pub fn double(&mut self, x: f64) -> i32 {
        self.value(EValue::Double(x))
    }

    /// An `int[]` argument: one `Int` value per item, then an `IntList` of their indices (the
    /// runtime's encoding).
    pub fn int_list(&mut self, items: &[i64]) -> i32 {
        let idx: Vec<i64> = items.iter().map(|&x| self.int(x) as i64).collect();
        self.value(EValue::IntList(idx))
    }

    /// A `Tensor[]` value over existing tensor values.
    pub fn tensor_list(&mut self, items: &[i32]) -> i32 {
        self.value(EValue::TensorList(items.to_vec()))
    }

    /// A tensor value as given.
    pub fn tensor(&mut self, t: Tensor) -> i32 {
        self.value(EValue::Tensor(t))
    }

    /// A constant tensor whose bytes were added with [`ProgramBuilder::add_constant`].
    pub fn constant_tensor(
        &mut self,
        scalar_type: ScalarType,
        sizes: &[i32],
        data_buffer_idx: u32,
    ) -> i32 {
        let mut t = Tensor::new(scalar_type, sizes);
        t.data_buffer_idx = data_buffer_idx;
        self.tensor(t)
    }

    /// Declares the planned buffer sizes explicitly (`sizes[k-1]` is buffer `memory_id = k`);
    /// slot 0 stays reserved.
    pub fn set_planned_buffers(&mut self, sizes: &[u64]) {
        self.plan.non_const_buffer_sizes = std::iter::once(0)
            .chain(sizes.iter().map(|&s| s as i64))
            .collect();
    }

    /// A tensor in planned buffer `memory_id` (1-based) at `offset`.
    pub fn planned_tensor_at(
        &mut self,
        scalar_type: ScalarType,
        sizes: &[i32],
        memory_id: u32,
        offset: u64,
    ) -> i32 {
        let mut t = Tensor::new(scalar_type, sizes);
        t.allocation_info = Some(AllocationDetails {
            memory_id,
            memory_offset: offset,
        });
        self.tensor(t)
    }

    /// A tensor placed at the end of planned buffer 1 (16-byte aligned), growing it. A simple
    /// bump plan: no reuse between tensors with disjoint lifetimes.
    pub fn planned_tensor(&mut self, scalar_type: ScalarType, sizes: &[i32]) -> Result<i32> {
        self.planned_tensor_in(1, scalar_type, sizes)
    }

    /// A tensor placed at the end of planned buffer `memory_id` (1-based; buffers up to it are
    /// created empty), 16-byte aligned, growing it — the bump plan of
    /// [`MethodBuilder::planned_tensor`] in any buffer. A tensor in a buffer given a device by
    /// [`MethodBuilder::place_buffer`] carries that device in its `extra_tensor_info`, as
    /// ExecuTorch's memory planner writes it.
    pub fn planned_tensor_in(
        &mut self,
        memory_id: u32,
        scalar_type: ScalarType,
        sizes: &[i32],
    ) -> Result<i32> {
        if memory_id == 0 {
            return Err(Error::Build(format!(
                "method {:?}: planned buffer 0 is reserved",
                self.plan.name
            )));
        }
        let t = Tensor::new(scalar_type, sizes);
        let nbytes = t.nbytes().ok_or_else(|| {
            Error::Build(format!(
                "method {:?}: tensor of sizes {sizes:?} has no byte size",
                self.plan.name
            ))
        })?;
        let k = memory_id as usize;
        if self.plan.non_const_buffer_sizes.len() <= k {
            self.plan.non_const_buffer_sizes.resize(k + 1, 0);
        }
        let used = self.plan.non_const_buffer_sizes[k] as u64;
        let offset = used.div_ceil(PLANNED_ALIGNMENT) * PLANNED_ALIGNMENT;
        self.plan.non_const_buffer_sizes[k] = (offset + nbytes) as i64;
        let v = self.planned_tensor_at(scalar_type, sizes, memory_id, offset);
        let device = self
            .plan
            .non_const_buffer_device
            .iter()
            .flatten()
            .find(|d| d.buffer_idx as u32 == memory_id)
            .copied();
        if let (Some(d), EValue::Tensor(t)) = (device, &mut self.plan.values[v as usize]) {
            t.extra_tensor_info = Some(ExtraTensorInfo {
                mutable_data_segments_idx: 0,
                fully_qualified_name: None,
                location: TensorDataLocation::SEGMENT,
                device_type: d.device_type,
                device_index: d.device_index,
            });
        }
        Ok(v)
    }

    /// Re-plans planned buffer `memory_id` by lifetime, as ExecuTorch's memory planner does: a
    /// tensor is live from the first to the last instruction of the (single, straight-line)
    /// chain that names it — method inputs from the start, method outputs to the end, a tensor
    /// no instruction names for the whole method — and two tensors share bytes only if their
    /// lifetimes are disjoint. First fit in order of first use, 16-byte aligned
    /// ([`crate::lifetime::place`], [`Order::FirstUse`]); the buffer shrinks to the highest end. Call after the chain is complete. Refuses a method with
    /// jumps (lifetimes would not be intervals).
    pub fn reuse_buffer(&mut self, memory_id: u32) -> Result<()> {
        let plan = &mut self.plan;
        let n = plan
            .chains
            .iter()
            .map(|c| c.instructions.len())
            .sum::<usize>();
        let mut live: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
        let touch = |v: usize, at: usize, live: &mut BTreeMap<usize, (usize, usize)>| {
            let e = live.entry(v).or_insert((at, at));
            e.0 = e.0.min(at);
            e.1 = e.1.max(at);
        };
        let values = &plan.values;
        // Tensors a value index stands for (itself, or a list's members).
        let tensors_of = |v: i32| -> Vec<usize> {
            match values.get(v as usize) {
                Some(EValue::Tensor(_)) => vec![v as usize],
                Some(EValue::TensorList(l)) | Some(EValue::OptionalTensorList(l)) => {
                    l.iter().filter(|&&i| i >= 0).map(|&i| i as usize).collect()
                }
                _ => vec![],
            }
        };
        for &v in &plan.inputs {
            for t in tensors_of(v) {
                touch(t, 0, &mut live);
            }
        }
        let mut at = 0;
        for chain in &plan.chains {
            for ins in &chain.instructions {
                at += 1;
                let named: Vec<i32> = match ins {
                    Instruction::KernelCall { args, .. }
                    | Instruction::DelegateCall { args, .. } => args.clone(),
                    Instruction::MoveCall { move_from, move_to } => vec![*move_from, *move_to],
                    Instruction::FreeCall { value_index } => vec![*value_index],
                    Instruction::JumpFalseCall { .. } => {
                        return Err(Error::Build(format!(
                            "method {:?}: planned buffer {memory_id} cannot be re-planned by lifetime in a method with jumps",
                            plan.name
                        )));
                    }
                };
                for v in named {
                    for t in tensors_of(v) {
                        touch(t, at, &mut live);
                    }
                }
            }
        }
        for &v in &plan.outputs {
            for t in tensors_of(v) {
                touch(t, n + 1, &mut live);
            }
        }
        // The buffer's tensors with their sizes and lifetimes, in order of first use.
        let mut items: Vec<(usize, u64, (usize, usize))> = Vec::new();
        for (i, v) in plan.values.iter().enumerate() {
            if let EValue::Tensor(t) = v
                && t.allocation_info.is_some_and(|a| a.memory_id == memory_id)
            {
                let nbytes = t.nbytes().ok_or_else(|| {
                    Error::Build(format!(
                        "method {:?}: value {i} has no byte size",
                        plan.name
                    ))
                })?;
                items.push((i, nbytes, live.get(&i).copied().unwrap_or((0, n + 1))));
            }
        }
        // The one lifetime planner, first fit in order of first use.
        let lifetimes: Vec<Lifetime> = items
            .iter()
            .map(|&(_, bytes, (first, last))| Lifetime { bytes, first, last })
            .collect();
        let placement = crate::lifetime::place(&lifetimes, Order::FirstUse);
        for (&(i, _, _), &offset) in items.iter().zip(&placement.offsets) {
            if let EValue::Tensor(t) = &mut plan.values[i] {
                t.allocation_info = Some(AllocationDetails {
                    memory_id,
                    memory_offset: offset,
                });
            }
        }
        let high = placement.end;
        let k = memory_id as usize;
        if plan.non_const_buffer_sizes.len() <= k {
            plan.non_const_buffer_sizes.resize(k + 1, 0);
        }
        plan.non_const_buffer_sizes[k] = high as i64;
        Ok(())
    }

    /// Puts planned buffer `memory_id` (1-based) on a device: listed in the plan's
    /// `non_const_buffer_device` (ExecuTorch lists only non-CPU buffers there; the runtime backs
    /// them with that device's allocator), and every tensor later planned in it with
    /// [`MethodBuilder::planned_tensor_in`] tagged with the device. Call before planning
    /// tensors in it.
    pub fn place_buffer(&mut self, memory_id: u32, device_type: DeviceType, device_index: i8) {
        let k = memory_id as usize;
        if self.plan.non_const_buffer_sizes.len() <= k {
            self.plan.non_const_buffer_sizes.resize(k + 1, 0);
        }
        let list = self
            .plan
            .non_const_buffer_device
            .get_or_insert_with(Vec::new);
        list.retain(|d| d.buffer_idx as u32 != memory_id);
        list.push(NonConstBufferDevice {
            buffer_idx: memory_id as i32,
            device_type,
            device_index,
        });
        list.sort_by_key(|d| d.buffer_idx);
    }

    /// The index of operator `name.overload`, added on first use.
    pub fn operator(&mut self, name: &str, overload: &str) -> i32 {
        let key = (name.to_string(), overload.to_string());
        if let Some(&i) = self.operators.get(&key) {
            return i;
        }
        self.plan.operators.push(Operator {
            name: name.to_string(),
            overload: overload.to_string(),
        });
        let i = (self.plan.operators.len() - 1) as i32;
        self.operators.insert(key, i);
        i
    }

    /// Appends a kernel call with the exact argument list: one value per schema argument (defaults
    /// materialised) followed by the return value(s), as the runtime's unboxing expects.
    pub fn kernel_call(&mut self, name: &str, overload: &str, args: &[i32]) {
        let op_index = self.operator(name, overload);
        self.instruction(Instruction::KernelCall {
            op_index,
            args: args.to_vec(),
        });
    }

    /// Adds a delegate; returns its index for [`MethodBuilder::delegate_call`].
    pub fn delegate(&mut self, spec: DelegateSpec) -> i32 {
        self.delegates.push(spec);
        (self.delegates.len() - 1) as i32
    }

    /// Appends a delegate call: `args` are the inputs then the outputs.
    pub fn delegate_call(&mut self, delegate_index: i32, args: &[i32]) {
        self.instruction(Instruction::DelegateCall {
            delegate_index,
            args: args.to_vec(),
        });
    }

    /// Appends `values[to] = values[from]`.
    pub fn move_call(&mut self, from: i32, to: i32) {
        self.instruction(Instruction::MoveCall {
            move_from: from,
            move_to: to,
        });
    }

    /// Appends any instruction to the (single) chain.
    pub fn instruction(&mut self, i: Instruction) {
        self.plan.chains[0].instructions.push(i);
    }

    /// Sets the method inputs (value indices).
    pub fn inputs(&mut self, v: &[i32]) {
        self.plan.inputs = v.to_vec();
    }

    /// Sets the method outputs (value indices).
    pub fn outputs(&mut self, v: &[i32]) {
        self.plan.outputs = v.to_vec();
    }

    /// Direct access to the plan being built (for fields without a helper).
    pub fn plan_mut(&mut self) -> &mut ExecutionPlan {
        &mut self.plan
    }
}
