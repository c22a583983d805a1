//! An owned mirror of ExecuTorch's `program.fbs`: what the reader decodes into and what the
//! encoder serialises. Field names follow the schema so a program can be compared field by field
//! with a `flatc --json` dump. Vectors the runtime requires (or that EXIR always writes) are plain
//! `Vec`s and are always written, even when empty; fields whose absence means something are
//! `Option`s.

pub use crate::generated::executorch_flatbuffer::{
    DataLocation, DeviceType, ScalarType, TensorDataLocation, TensorShapeDynamism,
};

/// The root table: one execution plan per method, plus where the big bytes live.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Program {
    /// Schema version; EXIR writes 0 and the runtime ignores it.
    pub version: u32,
    /// One plan per method.
    pub execution_plan: Vec<ExecutionPlan>,
    /// Deprecated inline constant storage (kept so old files round-trip; writers leave it empty).
    pub constant_buffer: Vec<Vec<u8>>,
    /// Inline delegate blobs, referenced by `DataLocation::INLINE`.
    pub backend_delegate_data: Vec<Vec<u8>>,
    /// Segments after the flatbuffer; offsets are relative to `segment_base_offset`.
    pub segments: Vec<DataSegment>,
    /// Constant tensors: one segment, per-tensor offsets (`offsets[0]` is a placeholder).
    pub constant_segment: Option<SubsegmentOffsets>,
    /// Initial values of mutable (planned) tensors.
    pub mutable_data_segments: Option<Vec<SubsegmentOffsets>>,
    /// Blobs for backends, by key.
    pub named_data: Option<Vec<NamedData>>,
}

/// One method.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct ExecutionPlan {
    /// Method name, e.g. `forward`.
    pub name: String,
    /// Pytree specs of inputs and outputs (optional for the runtime).
    pub container_meta_type: Option<ContainerMetadata>,
    /// The value table; everything else refers to values by index.
    pub values: Vec<EValue>,
    /// Value indices of the method inputs.
    pub inputs: Vec<i32>,
    /// Value indices of the method outputs.
    pub outputs: Vec<i32>,
    /// Instruction chains (the runtime requires at least one).
    pub chains: Vec<Chain>,
    /// Operators referenced by kernel calls.
    pub operators: Vec<Operator>,
    /// Backend delegates referenced by delegate calls (always written, even empty).
    pub delegates: Vec<BackendDelegate>,
    /// Planned buffer sizes in bytes; index 0 is reserved (0).
    pub non_const_buffer_sizes: Vec<i64>,
    /// Per-buffer device placement (absent means all CPU).
    pub non_const_buffer_device: Option<Vec<NonConstBufferDevice>>,
}

/// Pytree specs as strings.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct ContainerMetadata {
    /// Input spec.
    pub encoded_inp_str: Option<String>,
    /// Output spec.
    pub encoded_out_str: Option<String>,
}

/// One entry of the value table.
#[derive(Clone, Debug, PartialEq)]
pub enum EValue {
    /// None (the schema's `Null` table; type `NONE` is invalid).
    Null,
    /// A 64-bit integer.
    Int(i64),
    /// A boolean.
    Bool(bool),
    /// A double.
    Double(f64),
    /// A tensor.
    Tensor(Tensor),
    /// A string.
    String(String),
    /// Value indices of `Int` values (not literal integers).
    IntList(Vec<i64>),
    /// Literal doubles.
    DoubleList(Vec<f64>),
    /// Literal booleans.
    BoolList(Vec<bool>),
    /// Value indices of tensors.
    TensorList(Vec<i32>),
    /// Value indices of tensors or nulls.
    OptionalTensorList(Vec<i32>),
}

impl EValue {
    /// The schema's name of this variant (as `flatc --json` prints it).
    pub fn kind(&self) -> &'static str {
        match self {
            EValue::Null => "Null",
            EValue::Int(_) => "Int",
            EValue::Bool(_) => "Bool",
            EValue::Double(_) => "Double",
            EValue::Tensor(_) => "Tensor",
            EValue::String(_) => "String",
            EValue::IntList(_) => "IntList",
            EValue::DoubleList(_) => "DoubleList",
            EValue::BoolList(_) => "BoolList",
            EValue::TensorList(_) => "TensorList",
            EValue::OptionalTensorList(_) => "OptionalTensorList",
        }
    }
}

/// A tensor value: shape, dtype and where its data lives.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Element type.
    pub scalar_type: ScalarType,
    /// Must be 0.
    pub storage_offset: i32,
    /// Shape (upper bound for `DYNAMIC_BOUND`).
    pub sizes: Vec<i32>,
    /// Dimension order, same length as `sizes`; `0..n` is contiguous.
    pub dim_order: Vec<u8>,
    /// Ignored by the runtime.
    pub requires_grad: bool,
    /// Index into `constant_segment.offsets` (0 = no constant data).
    pub data_buffer_idx: u32,
    /// Planned memory location (`None` for constants and unplanned I/O).
    pub allocation_info: Option<AllocationDetails>,
    /// Always 0 (strided).
    pub layout: i8,
    /// Static or bounded-dynamic shape.
    pub shape_dynamism: TensorShapeDynamism,
    /// External data / device placement.
    pub extra_tensor_info: Option<ExtraTensorInfo>,
}

impl Tensor {
    /// A static, contiguous tensor with no data and no planned memory.
    pub fn new(scalar_type: ScalarType, sizes: &[i32]) -> Tensor {
        Tensor {
            scalar_type,
            storage_offset: 0,
            sizes: sizes.to_vec(),
            dim_order: (0..sizes.len() as u8).collect(),
            requires_grad: false,
            data_buffer_idx: 0,
            allocation_info: None,
            layout: 0,
            shape_dynamism: TensorShapeDynamism::STATIC,
            extra_tensor_info: None,
        }
    }

    /// Number of elements, or `None` on a negative size or overflow.
    pub fn numel(&self) -> Option<u64> {
        self.sizes.iter().try_fold(1u64, |acc, &s| {
            u64::try_from(s).ok().and_then(|s| acc.checked_mul(s))
        })
    }

    /// Size in bytes, or `None` for an unknown dtype, a negative size or overflow.
    pub fn nbytes(&self) -> Option<u64> {
        self.numel()?
            .checked_mul(element_size(self.scalar_type)? as u64)
    }
}

/// Bytes per element of a scalar type (`None` for values the schema does not define).
pub fn element_size(t: ScalarType) -> Option<usize> {
    Some(match t {
        ScalarType::BYTE | ScalarType::CHAR | ScalarType::BOOL => 1,
        ScalarType::QINT8 | ScalarType::QUINT8 | ScalarType::QUINT4X2 | ScalarType::QUINT2X4 => 1,
        ScalarType::FLOAT8E5M2
        | ScalarType::FLOAT8E4M3FN
        | ScalarType::FLOAT8E5M2FNUZ
        | ScalarType::FLOAT8E4M3FNUZ => 1,
        ScalarType::SHORT | ScalarType::HALF | ScalarType::BFLOAT16 | ScalarType::BITS16 => 2,
        ScalarType::UINT16 => 2,
        ScalarType::INT | ScalarType::FLOAT | ScalarType::QINT32 | ScalarType::UINT32 => 4,
        ScalarType::LONG | ScalarType::DOUBLE | ScalarType::UINT64 => 8,
        _ => return None,
    })
}

/// Planned memory: buffer `memory_id` (1-based) at byte `memory_offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocationDetails {
    /// 1-based index into `non_const_buffer_sizes`.
    pub memory_id: u32,
    /// Byte offset in that buffer (split into low/high u32 halves on disk).
    pub memory_offset: u64,
}

/// Extra tensor information (external data, device).
#[derive(Clone, Debug, PartialEq)]
pub struct ExtraTensorInfo {
    /// Index into mutable data segment offsets.
    pub mutable_data_segments_idx: u64,
    /// Key of EXTERNAL data.
    pub fully_qualified_name: Option<String>,
    /// SEGMENT or EXTERNAL.
    pub location: TensorDataLocation,
    /// Device type.
    pub device_type: DeviceType,
    /// Device index.
    pub device_index: i8,
}

/// A chain of instructions.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Chain {
    /// Unused by the runtime (written empty).
    pub inputs: Vec<i32>,
    /// Unused by the runtime (written empty).
    pub outputs: Vec<i32>,
    /// Executed in order.
    pub instructions: Vec<Instruction>,
    /// Optional debug stack traces, parallel to `instructions`.
    pub stacktrace: Option<Vec<FrameList>>,
}

/// One instruction.
#[derive(Clone, Debug, PartialEq)]
pub enum Instruction {
    /// Run operator `op_index` with the value indices `args` (schema args, then returns).
    KernelCall {
        /// Index into `operators`.
        op_index: i32,
        /// Value indices.
        args: Vec<i32>,
    },
    /// Run delegate `delegate_index` with `args` = inputs then outputs.
    DelegateCall {
        /// Index into `delegates`.
        delegate_index: i32,
        /// Value indices.
        args: Vec<i32>,
    },
    /// `values[move_to] = values[move_from]`.
    MoveCall {
        /// Source value index.
        move_from: i32,
        /// Destination value index.
        move_to: i32,
    },
    /// Jump to `destination_instruction` if `values[cond_value_index]` is false.
    JumpFalseCall {
        /// Condition value index.
        cond_value_index: i32,
        /// Instruction index in the chain.
        destination_instruction: i32,
    },
    /// Free the data of a dynamic tensor.
    FreeCall {
        /// Value index.
        value_index: i32,
    },
}

/// A debug frame.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Frame {
    /// File name.
    pub filename: Option<String>,
    /// Line number.
    pub lineno: i32,
    /// Function name.
    pub name: Option<String>,
    /// Source text.
    pub context: Option<String>,
}

/// The stack of one instruction.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct FrameList {
    /// Frames.
    pub items: Vec<Frame>,
}

/// An operator; the runtime looks up `name.overload` in its kernel registry.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Operator {
    /// e.g. `aten::mm`.
    pub name: String,
    /// e.g. `out`.
    pub overload: String,
}

/// A lowered subgraph run by a backend.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct BackendDelegate {
    /// Backend registry name, e.g. `TensorRTBackend`.
    pub id: String,
    /// Where the processed blob lives.
    pub processed: DataReference,
    /// Passed verbatim to the backend's `init()`.
    pub compile_specs: Vec<CompileSpec>,
}

/// Location of a delegate blob: INLINE → `backend_delegate_data[index]`, SEGMENT → `segments[index]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct DataReference {
    /// INLINE or SEGMENT.
    pub location: DataLocation,
    /// Index into the list the location names.
    pub index: u32,
}

/// A backend compile option.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct CompileSpec {
    /// Key.
    pub key: String,
    /// Raw value bytes.
    pub value: Vec<u8>,
}

/// Device of one planned buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NonConstBufferDevice {
    /// 1-based buffer index.
    pub buffer_idx: i32,
    /// Device type.
    pub device_type: DeviceType,
    /// Device index.
    pub device_index: i8,
}

/// A segment: `size` bytes at `segment_base_offset + offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct DataSegment {
    /// Offset relative to the segment base.
    pub offset: u64,
    /// Size in bytes, excluding padding.
    pub size: u64,
}

/// Offsets of sub-buffers inside one segment.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct SubsegmentOffsets {
    /// Index into `segments`.
    pub segment_index: u32,
    /// Byte offsets inside that segment.
    pub offsets: Vec<u64>,
}

/// A key naming one segment (several keys may share a segment).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct NamedData {
    /// The key backends ask for.
    pub key: String,
    /// Index into `segments`.
    pub segment_index: u32,
}
