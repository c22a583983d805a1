//! [`HostTensor`]: the values an [`EngineRuntime`](crate::EngineRuntime) takes and returns —
//! an element type, a shape and little-endian row-major bytes in host memory, owned by no
//! executor. A runtime converts at its edge (the CPU reference to and from
//! [`petite_reference::Tensor`], a GPU runtime by uploading the bytes), so the seam does not
//! belong to any one of them.

use petite_graph::{Dtype, ShapeDisplay};
use petite_reference::Tensor;

use crate::{Error, Result};

/// A dense row-major tensor in host memory: dtype, shape, little-endian bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostTensor {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl HostTensor {
    /// A tensor from its parts; the byte count must be the shape's element count times the
    /// dtype's size.
    pub fn new(dtype: Dtype, shape: &[usize], bytes: Vec<u8>) -> Result<Self> {
        let want = shape.iter().product::<usize>() * dtype.size();
        if bytes.len() != want {
            return Err(Error::Usage(format!(
                "{} bytes do not hold a {dtype}{} tensor ({want} bytes expected)",
                bytes.len(),
                ShapeDisplay(shape)
            )));
        }
        Ok(HostTensor {
            dtype,
            shape: shape.to_vec(),
            bytes,
        })
    }

    /// The element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// The dims.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The little-endian row-major bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The CPU reference executor's tensor of the same value.
    pub fn to_reference(&self) -> Result<Tensor> {
        Ok(Tensor::from_bytes(self.dtype, &self.shape, &self.bytes)?)
    }
}

impl From<&Tensor> for HostTensor {
    fn from(t: &Tensor) -> Self {
        HostTensor {
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            bytes: t.to_bytes(),
        }
    }
}

impl From<Tensor> for HostTensor {
    fn from(t: Tensor) -> Self {
        HostTensor::from(&t)
    }
}

impl TryFrom<&HostTensor> for Tensor {
    type Error = Error;
    fn try_from(t: &HostTensor) -> Result<Tensor> {
        t.to_reference()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_the_reference_tensor() {
        let t = Tensor::f32(&[2, 2], vec![1.0, -2.5, f32::NAN, 0.0]).unwrap();
        let h = HostTensor::from(&t);
        assert_eq!(
            (h.dtype(), h.shape(), h.bytes().len()),
            (Dtype::F32, &[2, 2][..], 16)
        );
        let back = h.to_reference().unwrap();
        assert_eq!(back.to_bytes(), t.to_bytes());
        let e = HostTensor::new(Dtype::I64, &[3], vec![0; 8])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("8 bytes") && e.contains("24 bytes expected"),
            "{e}"
        );
    }
}
