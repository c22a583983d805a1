//! Element types and tensor/value types.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Element type of a tensor.
///
/// Byte layout (for constants and for every consumer that stores tensors): little-endian,
/// row-major (C order); `Bf16` is the upper 16 bits of an IEEE f32, `F16` is IEEE binary16,
/// `Bool` is one byte that is 0 or 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    /// IEEE binary32.
    F32,
    /// bfloat16 (f32 with the mantissa truncated to 7 bits; conversions round to nearest even).
    Bf16,
    /// IEEE binary16.
    F16,
    /// Signed 64-bit integer.
    I64,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 8-bit integer.
    U8,
    /// Boolean, one byte (0 or 1).
    Bool,
}

impl Dtype {
    /// Every dtype, in declaration order.
    pub const ALL: [Dtype; 7] = [
        Dtype::F32,
        Dtype::Bf16,
        Dtype::F16,
        Dtype::I64,
        Dtype::I32,
        Dtype::U8,
        Dtype::Bool,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::I64 => 8,
            Dtype::U8 | Dtype::Bool => 1,
        }
    }

    /// True for f32, bf16 and f16.
    pub fn is_float(self) -> bool {
        matches!(self, Dtype::F32 | Dtype::Bf16 | Dtype::F16)
    }

    /// True for i64, i32 and u8.
    pub fn is_int(self) -> bool {
        matches!(self, Dtype::I64 | Dtype::I32 | Dtype::U8)
    }

    /// True for floats and integers (everything but bool): the dtypes arithmetic accepts.
    pub fn is_numeric(self) -> bool {
        self != Dtype::Bool
    }

    /// Lower-case name as used in serialised programs and messages (`"bf16"`).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::I64 => "i64",
            Dtype::I32 => "i32",
            Dtype::U8 => "u8",
            Dtype::Bool => "bool",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor's static type: dtype and shape (row-major dims; `[]` is a scalar).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TensorType {
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions, outermost first. Zero-sized dims are allowed.
    pub shape: Vec<usize>,
}

impl TensorType {
    /// A tensor type from a dtype and dims.
    pub fn new(dtype: Dtype, shape: &[usize]) -> Self {
        TensorType {
            dtype,
            shape: shape.to_vec(),
        }
    }

    /// Number of dims.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements (1 for a scalar). Saturates instead of overflowing.
    pub fn numel(&self) -> usize {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .unwrap_or(usize::MAX)
    }

    /// Number of elements, or `None` if it overflows `usize`.
    pub fn checked_numel(&self) -> Option<usize> {
        self.shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
    }

    /// Bytes of the tensor, or `None` if they overflow `usize`. Validation rejects such types,
    /// so on a validated program [`TensorType::nbytes`] is exact.
    pub fn checked_nbytes(&self) -> Option<usize> {
        self.checked_numel()?.checked_mul(self.dtype.size())
    }

    /// Bytes of the tensor: elements × dtype size. Saturates instead of overflowing.
    pub fn nbytes(&self) -> usize {
        self.numel().saturating_mul(self.dtype.size())
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, ShapeDisplay(&self.shape))
    }
}

/// Displays dims as `[1, 8, 968, 256]`.
pub struct ShapeDisplay<'a>(pub &'a [usize]);

impl fmt::Display for ShapeDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// The type of the single value a node produces.
///
/// Only multi-output ops (`split`) produce a `Tuple`; a tuple value may be consumed only by
/// `getitem` nodes and can never be a graph output, so every edge a partitioner cuts is a tensor.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ValueType {
    /// One tensor.
    Tensor(TensorType),
    /// Several tensors, extracted one by one with `getitem`.
    Tuple(Vec<TensorType>),
}

impl ValueType {
    /// The tensor type, or `None` for a tuple.
    pub fn tensor(&self) -> Option<&TensorType> {
        match self {
            ValueType::Tensor(t) => Some(t),
            ValueType::Tuple(_) => None,
        }
    }

    /// True for a tuple.
    pub fn is_tuple(&self) -> bool {
        matches!(self, ValueType::Tuple(_))
    }

    /// Total bytes (sum over tuple elements).
    pub fn nbytes(&self) -> usize {
        match self {
            ValueType::Tensor(t) => t.nbytes(),
            ValueType::Tuple(ts) => ts.iter().fold(0usize, |a, t| a.saturating_add(t.nbytes())),
        }
    }
}

impl From<TensorType> for ValueType {
    fn from(t: TensorType) -> Self {
        ValueType::Tensor(t)
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueType::Tensor(t) => t.fmt(f),
            ValueType::Tuple(ts) => {
                f.write_str("(")?;
                for (i, t) in ts.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    t.fmt(f)?;
                }
                f.write_str(")")
            }
        }
    }
}
