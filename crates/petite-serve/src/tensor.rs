//! Typed tensors on the wire: [`pb::Tensor`] (dtype, shape, little-endian bytes) to and from
//! [`Array`], with every disagreement between the three refused by name.

use crate::pb::{Dtype, Tensor};
use crate::{Error, Result};

/// The values of one decoded tensor, row-major, with their shape: what a [`crate::Backend`]
/// receives (the dtypes a policy takes; any other is refused while decoding).
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    /// f32 values.
    F32 {
        /// The shape.
        shape: Vec<usize>,
        /// `shape.iter().product()` values.
        data: Vec<f32>,
    },
    /// u8 values.
    U8 {
        /// The shape.
        shape: Vec<usize>,
        /// `shape.iter().product()` values.
        data: Vec<u8>,
    },
}

impl Array {
    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        match self {
            Array::F32 { shape, .. } | Array::U8 { shape, .. } => shape,
        }
    }

    /// `F32 [3, 224, 224]`: how refusals name what was sent.
    pub fn describe(&self) -> String {
        let kind = match self {
            Array::F32 { .. } => "F32",
            Array::U8 { .. } => "U8",
        };
        format!("{kind} {:?}", self.shape())
    }
}

fn bad(key: &str, reason: impl Into<String>) -> Error {
    Error::Tensor {
        key: key.to_string(),
        reason: reason.into(),
    }
}

impl Tensor {
    /// An f32 tensor (little-endian bytes whatever the host's order).
    pub fn from_f32(shape: &[usize], data: &[f32]) -> Tensor {
        Tensor {
            dtype: Dtype::Float32 as i32,
            shape: shape.iter().map(|&d| d as u64).collect(),
            data: data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }

    /// A u8 tensor.
    pub fn from_u8(shape: &[usize], data: &[u8]) -> Tensor {
        Tensor {
            dtype: Dtype::Uint8 as i32,
            shape: shape.iter().map(|&d| d as u64).collect(),
            data: data.to_vec(),
        }
    }

    /// The values, after checking that the dtype is one a policy takes and that the bytes are
    /// exactly `product(shape) × size(dtype)`; `key` names the tensor in the error.
    pub fn decode(&self, key: &str) -> Result<Array> {
        self.clone().into_array(key)
    }

    /// [`Tensor::decode`], keeping the bytes of a u8 tensor (a camera's image) instead of
    /// copying them: what the server does with each request.
    pub fn into_array(self, key: &str) -> Result<Array> {
        let (dtype, shape) = self.checked(key)?;
        Ok(match dtype {
            Dtype::Float32 => Array::F32 {
                shape,
                data: f32s(&self.data),
            },
            _ => Array::U8 {
                shape,
                data: self.data,
            },
        })
    }

    /// The dtype and shape, once the bytes are checked against them.
    fn checked(&self, key: &str) -> Result<(Dtype, Vec<usize>)> {
        let (dtype, size) = match Dtype::try_from(self.dtype) {
            Ok(Dtype::Float32) => (Dtype::Float32, 4),
            Ok(Dtype::Uint8) => (Dtype::Uint8, 1),
            Ok(Dtype::Unspecified) => {
                return Err(bad(key, "no dtype: set DTYPE_FLOAT32 or DTYPE_UINT8"));
            }
            Err(_) => {
                return Err(bad(
                    key,
                    format!(
                        "unknown dtype {}: expected DTYPE_FLOAT32 or DTYPE_UINT8",
                        self.dtype
                    ),
                ));
            }
        };
        let mut shape = Vec::with_capacity(self.shape.len());
        let mut count = 1usize;
        for &d in &self.shape {
            let d = usize::try_from(d).ok();
            match d.and_then(|d| count.checked_mul(d).map(|c| (d, c))) {
                Some((d, c)) => {
                    shape.push(d);
                    count = c;
                }
                None => {
                    return Err(bad(
                        key,
                        format!("shape {:?} has too many elements", self.shape),
                    ));
                }
            }
        }
        let want = count.checked_mul(size);
        if want != Some(self.data.len()) {
            return Err(bad(
                key,
                format!(
                    "shape {:?} of {} needs {} bytes, found {}",
                    self.shape,
                    if size == 4 { "float32" } else { "uint8" },
                    want.map_or_else(|| "more than memory".to_string(), |w| w.to_string()),
                    self.data.len()
                ),
            ));
        }
        Ok((dtype, shape))
    }
}

/// Little-endian f32 bytes (a whole number of them: checked) as values.
fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

impl From<&Array> for Tensor {
    fn from(a: &Array) -> Tensor {
        match a {
            Array::F32 { shape, data } => Tensor::from_f32(shape, data),
            Array::U8 { shape, data } => Tensor::from_u8(shape, data),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_round_trip_and_disagreements_are_refused_by_key() {
        let f = Array::F32 {
            shape: vec![2, 3],
            data: vec![1.5, -0.0, f32::MIN_POSITIVE, 3.0, 4.25, -7.0],
        };
        assert_eq!(Tensor::from(&f).decode("x").unwrap(), f);
        let u = Array::U8 {
            shape: vec![1, 2, 2, 3],
            data: (0..12).collect(),
        };
        assert_eq!(Tensor::from(&u).decode("x").unwrap(), u);
        // Little-endian on the wire.
        assert_eq!(Tensor::from_f32(&[1], &[1.0]).data, [0, 0, 0x80, 0x3f]);
        // A scalar is one element.
        assert_eq!(
            Tensor::from_f32(&[], &[2.0]).decode("s").unwrap(),
            Array::F32 {
                shape: vec![],
                data: vec![2.0]
            }
        );

        let msg = |t: Tensor| t.decode("observation.state").unwrap_err().to_string();
        let mut short = Tensor::from_f32(&[5], &[0.0; 5]);
        short.data.pop();
        assert_eq!(
            msg(short),
            "`observation.state`: shape [5] of float32 needs 20 bytes, found 19"
        );
        let mut unknown = Tensor::from_f32(&[5], &[0.0; 5]);
        unknown.dtype = 9;
        assert!(msg(unknown).contains("unknown dtype 9"));
        let mut unset = Tensor::from_f32(&[5], &[0.0; 5]);
        unset.dtype = 0;
        assert!(msg(unset).contains("no dtype"));
        let huge = Tensor {
            dtype: Dtype::Uint8 as i32,
            shape: vec![u64::MAX, 2],
            data: vec![],
        };
        assert!(msg(huge).contains("too many elements"));
        let overflow = Tensor {
            dtype: Dtype::Float32 as i32,
            shape: vec![1 << 62],
            data: vec![],
        };
        assert!(msg(overflow).contains("more than memory"));
    }
}
