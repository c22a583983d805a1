//! An in-memory [`WeightSource`], for tests and small synthetic programs.

use petite_weights::{Dtype, Error, Result, TensorInfo, TensorView, WeightSource};
use std::collections::BTreeMap;
use std::sync::Mutex;

struct Entry {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// Weights held in memory by name; records which names were released, in order.
#[derive(Default)]
pub struct MemoryWeights {
    tensors: BTreeMap<String, Entry>,
    released: Mutex<Vec<String>>,
}

impl MemoryWeights {
    /// An empty source.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) a tensor from raw little-endian bytes; the byte count must match.
    pub fn insert_bytes(
        &mut self,
        name: &str,
        dtype: Dtype,
        shape: &[usize],
        bytes: Vec<u8>,
    ) -> Result<()> {
        let n: usize = shape.iter().product();
        if bytes.len() != n * dtype.size() {
            return Err(Error::MissingTensor {
                file: format!(
                    "<memory: {} bytes given for {} [{n} elements]>",
                    bytes.len(),
                    dtype.safetensors_name()
                ),
                name: name.into(),
            });
        }
        self.tensors.insert(
            name.into(),
            Entry {
                name: name.into(),
                dtype,
                shape: shape.to_vec(),
                bytes,
            },
        );
        Ok(())
    }

    /// Adds an f32 tensor.
    pub fn insert_f32(&mut self, name: &str, shape: &[usize], values: &[f32]) -> Result<()> {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.insert_bytes(name, Dtype::F32, shape, bytes)
    }

    /// Adds a bf16 tensor given as raw bf16 bit patterns.
    pub fn insert_bf16_bits(&mut self, name: &str, shape: &[usize], bits: &[u16]) -> Result<()> {
        let bytes = bits.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.insert_bytes(name, Dtype::Bf16, shape, bytes)
    }

    /// Names passed to `release` so far, in call order.
    pub fn released(&self) -> Vec<String> {
        self.released.lock().map(|r| r.clone()).unwrap_or_default()
    }

    fn entry(&self, name: &str) -> Result<&Entry> {
        self.tensors.get(name).ok_or_else(|| Error::MissingTensor {
            file: "<memory>".into(),
            name: name.into(),
        })
    }
}

impl WeightSource for MemoryWeights {
    fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    fn info(&self, name: &str) -> Result<TensorInfo> {
        let e = self.entry(name)?;
        Ok(TensorInfo {
            dtype: e.dtype,
            shape: e.shape.clone(),
        })
    }

    fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let e = self.entry(name)?;
        Ok(TensorView {
            name: &e.name,
            dtype: e.dtype,
            shape: &e.shape,
            bytes: &e.bytes,
        })
    }

    fn release(&self, names: &[&str]) -> Result<()> {
        if let Ok(mut r) = self.released.lock() {
            r.extend(names.iter().map(|n| n.to_string()));
        }
        Ok(())
    }
}
