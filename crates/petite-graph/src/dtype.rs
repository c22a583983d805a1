//! Element types and tensor/value types.

use serde::{Deserialize, Serialize};
use std::fmt;

pub use petite_dtype::Dtype;

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

    /// Whether a tensor of `dtype` and `shape` is of this type: what every executor checks of
    /// the value a node produced.
    pub fn admits_tensor(&self, dtype: Dtype, shape: &[usize]) -> bool {
        matches!(self, ValueType::Tensor(w) if w.dtype == dtype && w.shape == shape)
    }

    /// Whether a tuple of these (dtype, shape) elements is of this type.
    pub fn admits_tuple<'a>(
        &self,
        parts: impl ExactSizeIterator<Item = (Dtype, &'a [usize])>,
    ) -> bool {
        match self {
            ValueType::Tuple(ws) => {
                ws.len() == parts.len()
                    && parts
                        .zip(ws)
                        .all(|((d, s), w)| w.dtype == d && w.shape == s)
            }
            ValueType::Tensor(_) => false,
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A value is of a type only with the same kind, dtype, shape and tuple length.
    #[test]
    fn a_value_is_admitted_only_with_its_declared_dtype_and_shape() {
        let t = ValueType::Tensor(TensorType::new(Dtype::Bf16, &[2, 3]));
        assert!(t.admits_tensor(Dtype::Bf16, &[2, 3]));
        assert!(!t.admits_tensor(Dtype::F32, &[2, 3]));
        assert!(!t.admits_tensor(Dtype::Bf16, &[3, 2]));
        assert!(!t.admits_tensor(Dtype::Bf16, &[2, 3, 1]));
        assert!(!t.admits_tuple([(Dtype::Bf16, &[2usize, 3][..])].into_iter()));
        let u = ValueType::Tuple(vec![
            TensorType::new(Dtype::F32, &[4]),
            TensorType::new(Dtype::I64, &[]),
        ]);
        let parts = |p: &[(Dtype, &'static [usize])]| u.admits_tuple(p.iter().copied());
        assert!(parts(&[(Dtype::F32, &[4]), (Dtype::I64, &[])]));
        assert!(!parts(&[(Dtype::F32, &[4])]), "shorter");
        assert!(!parts(&[
            (Dtype::F32, &[4]),
            (Dtype::I64, &[]),
            (Dtype::I64, &[])
        ]));
        assert!(!parts(&[(Dtype::F32, &[4]), (Dtype::I32, &[])]));
        assert!(!parts(&[(Dtype::F32, &[5]), (Dtype::I64, &[])]));
        assert!(!u.admits_tensor(Dtype::F32, &[4]));
    }
}
