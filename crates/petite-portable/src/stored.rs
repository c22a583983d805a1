//! The weights a `.pte` stores: each checkpoint tensor in the dtype and layout (transposed or
//! not) the lowered methods read it, once per stored form, and the header-only check that a
//! source holds them.

use petite_graph::Dtype;
use petite_weights::WeightSource;

use crate::lower::Storage;
use crate::{Error, Lowered, Result};

/// A weight as a `.pte` stores it: checkpoint tensor `name` converted to `dtype` and stored with
/// `shape` (the checkpoint's shape reversed when `transpose`). `key` names it in a mapping file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredWeight {
    /// Name in a mapping file ([`stored_key`]).
    pub key: String,
    /// Checkpoint tensor name.
    pub name: String,
    /// Stored as the transpose of the checkpoint tensor.
    pub transpose: bool,
    /// Stored dtype (the program's).
    pub dtype: Dtype,
    /// Stored shape.
    pub shape: Vec<usize>,
}

impl StoredWeight {
    /// Bytes stored.
    pub fn nbytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size() as u64
    }
}

/// Mapping-file name of a stored weight: the checkpoint name, the stored dtype and `T` when
/// transposed (one checkpoint tensor may be stored in several ways).
pub fn stored_key(name: &str, transpose: bool, dtype: Dtype) -> String {
    format!("{name}#{dtype}{}", if transpose { "#T" } else { "" })
}

/// Every weight the methods read, once per stored form, in first-use order.
pub fn stored_weights(methods: &[&Lowered]) -> Vec<StoredWeight> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for l in methods {
        for s in &l.slots {
            if let Storage::Weight { name, transpose } = &s.storage {
                let key = stored_key(name, *transpose, s.dtype);
                if seen.insert(key.clone()) {
                    out.push(StoredWeight {
                        key,
                        name: name.clone(),
                        transpose: *transpose,
                        dtype: s.dtype,
                        shape: s.shape.clone(),
                    });
                }
            }
        }
    }
    out
}

/// Checks from headers only (no tensor bytes read) that `weights` holds every stored weight
/// with the right shape and a dtype that converts to the stored one.
pub fn check_weights(table: &[StoredWeight], weights: &dyn WeightSource) -> Result<()> {
    for w in table {
        let info = weights.info(&w.name)?;
        let mut want = w.shape.clone();
        if w.transpose {
            want.reverse();
        }
        if info.shape != want {
            return Err(Error::Weight {
                name: w.name.clone(),
                reason: format!("expected shape {want:?}, found {:?}", info.shape),
            });
        }
        let ok = info.dtype.is_float() && w.dtype.is_float() || info.dtype == w.dtype;
        if !ok {
            return Err(Error::Weight {
                name: w.name.clone(),
                reason: format!(
                    "stored as {}, the program wants {}",
                    info.dtype.safetensors_name(),
                    w.dtype
                ),
            });
        }
    }
    Ok(())
}
