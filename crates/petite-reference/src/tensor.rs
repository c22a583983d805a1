//! Owned tensors: the executor's values, inputs and outputs.

use crate::{Error, Result};
use half::{bf16, f16};
use petite_dtype::{bf16_bits_to_f32, to_bf16};
use petite_graph::{Dtype, ShapeDisplay};
use rayon::prelude::*;
use std::borrow::Cow;

/// Elements per rayon task for conversions (memory-bound; small tensors stay on one thread).
const PAR_MIN: usize = 1 << 15;

/// Element storage, one variant per [`Dtype`].
#[derive(Debug, Clone, PartialEq)]
pub enum Data {
    /// f32.
    F32(Vec<f32>),
    /// bf16.
    Bf16(Vec<bf16>),
    /// f16.
    F16(Vec<f16>),
    /// i64.
    I64(Vec<i64>),
    /// i32.
    I32(Vec<i32>),
    /// u8.
    U8(Vec<u8>),
    /// bool.
    Bool(Vec<bool>),
    /// i8: quantized weight codes.
    I8(Vec<i8>),
    /// FP8 E4M3 bits: quantized weight codes.
    F8E4M3(Vec<u8>),
}

impl Data {
    /// The element type.
    pub fn dtype(&self) -> Dtype {
        match self {
            Data::F32(_) => Dtype::F32,
            Data::Bf16(_) => Dtype::Bf16,
            Data::F16(_) => Dtype::F16,
            Data::I64(_) => Dtype::I64,
            Data::I32(_) => Dtype::I32,
            Data::U8(_) => Dtype::U8,
            Data::Bool(_) => Dtype::Bool,
            Data::I8(_) => Dtype::I8,
            Data::F8E4M3(_) => Dtype::F8E4M3,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::Bf16(v) => v.len(),
            Data::F16(v) => v.len(),
            Data::I64(v) => v.len(),
            Data::I32(v) => v.len(),
            Data::U8(v) => v.len(),
            Data::Bool(v) => v.len(),
            Data::I8(v) => v.len(),
            Data::F8E4M3(v) => v.len(),
        }
    }

    /// True if there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A dense row-major tensor: shape plus owned data.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    shape: Vec<usize>,
    data: Data,
}

impl Tensor {
    /// A tensor from a shape and data; the element count must match.
    pub fn new(shape: &[usize], data: Data) -> Result<Self> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(Error::Tensor(format!(
                "{} data of {} elements does not fill shape {}",
                data.dtype(),
                data.len(),
                ShapeDisplay(shape)
            )));
        }
        Ok(Tensor {
            shape: shape.to_vec(),
            data,
        })
    }

    /// An f32 tensor.
    pub fn f32(shape: &[usize], v: Vec<f32>) -> Result<Self> {
        Self::new(shape, Data::F32(v))
    }

    /// An i64 tensor.
    pub fn i64(shape: &[usize], v: Vec<i64>) -> Result<Self> {
        Self::new(shape, Data::I64(v))
    }

    /// A bool tensor.
    pub fn bool(shape: &[usize], v: Vec<bool>) -> Result<Self> {
        Self::new(shape, Data::Bool(v))
    }

    /// A u8 tensor.
    pub fn u8(shape: &[usize], v: Vec<u8>) -> Result<Self> {
        Self::new(shape, Data::U8(v))
    }

    /// Decodes little-endian row-major bytes (the layout of [`Dtype`]).
    pub fn from_bytes(dtype: Dtype, shape: &[usize], bytes: &[u8]) -> Result<Self> {
        let n: usize = shape.iter().product();
        if bytes.len() != n * dtype.size() {
            return Err(Error::Tensor(format!(
                "{} bytes do not hold a {dtype}{} tensor ({} bytes expected)",
                bytes.len(),
                ShapeDisplay(shape),
                n * dtype.size()
            )));
        }
        fn rd<const N: usize, T>(b: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
            b.chunks_exact(N)
                .map(|c| f(c.try_into().expect("chunk of N")))
                .collect()
        }
        let data = match dtype {
            Dtype::F32 => Data::F32(rd(bytes, f32::from_le_bytes)),
            Dtype::Bf16 => Data::Bf16(rd(bytes, |b| bf16::from_bits(u16::from_le_bytes(b)))),
            Dtype::F16 => Data::F16(rd(bytes, |b| f16::from_bits(u16::from_le_bytes(b)))),
            Dtype::I64 => Data::I64(rd(bytes, i64::from_le_bytes)),
            Dtype::I32 => Data::I32(rd(bytes, i32::from_le_bytes)),
            Dtype::U8 => Data::U8(bytes.to_vec()),
            Dtype::Bool => {
                if let Some(p) = bytes.iter().position(|&b| b > 1) {
                    return Err(Error::Tensor(format!(
                        "bool byte {} at element {p} is not 0 or 1",
                        bytes[p]
                    )));
                }
                Data::Bool(bytes.iter().map(|&b| b == 1).collect())
            }
            Dtype::I8 => Data::I8(bytes.iter().map(|&b| b as i8).collect()),
            Dtype::F8E4M3 => Data::F8E4M3(bytes.to_vec()),
        };
        Self::new(shape, data)
    }

    /// Encodes as little-endian row-major bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        match &self.data {
            Data::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::Bf16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
            Data::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
            Data::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::U8(v) => v.clone(),
            Data::Bool(v) => v.iter().map(|&b| b as u8).collect(),
            Data::I8(v) => v.iter().map(|&b| b as u8).collect(),
            Data::F8E4M3(v) => v.clone(),
        }
    }

    /// The dims.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        self.data.dtype()
    }

    /// The data.
    pub fn data(&self) -> &Data {
        &self.data
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Splits into shape and data.
    pub fn into_parts(self) -> (Vec<usize>, Data) {
        (self.shape, self.data)
    }

    /// Same data under another shape of equal element count.
    pub fn reshape(self, shape: &[usize]) -> Result<Self> {
        Self::new(shape, self.data)
    }

    /// The f32 data, if this is an f32 tensor.
    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            Data::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The i64 data, if this is an i64 tensor.
    pub fn as_i64(&self) -> Option<&[i64]> {
        match &self.data {
            Data::I64(v) => Some(v),
            _ => None,
        }
    }

    /// Float elements widened to f32 (borrowed when already f32); `None` for non-floats.
    pub fn float_values(&self) -> Option<Cow<'_, [f32]>> {
        Some(match &self.data {
            Data::F32(v) => Cow::Borrowed(v.as_slice()),
            Data::Bf16(v) => Cow::Owned(
                v.par_iter()
                    .with_min_len(PAR_MIN)
                    .map(|x| bf16_bits_to_f32(x.to_bits()))
                    .collect(),
            ),
            Data::F16(v) => Cow::Owned(
                v.iter()
                    .map(|x| petite_dtype::f16_bits_to_f32(x.to_bits()))
                    .collect(),
            ),
            _ => return None,
        })
    }

    /// Float elements as an owned f32 vector (moved, not copied, when already f32).
    pub fn into_float_values(self) -> std::result::Result<Vec<f32>, Self> {
        match self.data {
            Data::F32(v) => Ok(v),
            Data::Bf16(_) | Data::F16(_) => {
                Ok(self.float_values().map(Cow::into_owned).unwrap_or_default())
            }
            _ => Err(self),
        }
    }

    /// A float tensor of `dtype` from f32 results, rounding once (nearest even) for bf16/f16.
    pub fn from_f32_as(dtype: Dtype, shape: &[usize], v: Vec<f32>) -> Result<Self> {
        let data = match dtype {
            Dtype::F32 => Data::F32(v),
            Dtype::Bf16 => Data::Bf16(
                v.par_iter()
                    .with_min_len(PAR_MIN)
                    .map(|&x| to_bf16(x))
                    .collect(),
            ),
            Dtype::F16 => Data::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
            other => {
                return Err(Error::Tensor(format!(
                    "cannot store float results as {other}"
                )));
            }
        };
        Self::new(shape, data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_every_dtype() {
        for dtype in Dtype::ALL {
            let bytes: Vec<u8> = (0..dtype.size() * 6).map(|i| (i % 2) as u8).collect();
            let t = Tensor::from_bytes(dtype, &[2, 3], &bytes).unwrap();
            assert_eq!(t.dtype(), dtype);
            assert_eq!(t.to_bytes(), bytes, "{dtype}");
        }
        assert!(Tensor::from_bytes(Dtype::F32, &[2], &[0; 7]).is_err());
        assert!(Tensor::from_bytes(Dtype::Bool, &[1], &[2]).is_err());
        assert!(Tensor::f32(&[3], vec![1.0; 2]).is_err());
    }

    #[test]
    fn float_results_round_once() {
        let t = Tensor::from_f32_as(
            Dtype::Bf16,
            &[2],
            vec![1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0],
        )
        .unwrap();
        // ties: 1+2^-8 → 1.0 (even), 1+3·2^-8 → 1+2^-6
        assert_eq!(
            t.float_values().unwrap().as_ref(),
            &[1.0, 1.0 + 4.0 / 256.0]
        );
        assert!(Tensor::from_f32_as(Dtype::I64, &[1], vec![1.0]).is_err());
    }
}
