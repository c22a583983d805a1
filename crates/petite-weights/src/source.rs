//! The `WeightSource` seam: what every consumer of weights (reference executor, engine builders)
//! sees. A source hands out zero-copy views by checkpoint name and can give pages back to the OS.

use crate::{Error, Result};

pub use petite_dtype::Dtype;

/// A borrowed, zero-copy view of one tensor's bytes (little-endian, row-major).
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// The name the caller asked for (after layout remapping it may be stored under another).
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape; empty for a scalar.
    pub shape: &'a [usize],
    /// The raw bytes; `bytes.len() == shape.product() * dtype.size()`.
    pub bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The elements as `f32`, zero-copy: `None` unless the dtype is F32 and the bytes are 4-byte
    /// aligned (files written by petite always are; odd third-party files may not be).
    pub fn as_f32(&self) -> Option<&'a [f32]> {
        self.typed(Dtype::F32)
    }

    /// The elements as bf16, zero-copy: `None` unless the dtype is BF16 and 2-byte aligned.
    pub fn as_bf16(&self) -> Option<&'a [half::bf16]> {
        self.typed(Dtype::Bf16)
    }

    /// The elements as f16, zero-copy: `None` unless the dtype is F16 and 2-byte aligned.
    pub fn as_f16(&self) -> Option<&'a [half::f16]> {
        self.typed(Dtype::F16)
    }

    fn typed<T: bytemuck::Pod>(&self, want: Dtype) -> Option<&'a [T]> {
        if self.dtype != want || cfg!(target_endian = "big") {
            return None;
        }
        bytemuck::try_cast_slice(self.bytes).ok()
    }

    /// A copy of the elements widened to `f32`, for any float dtype and any alignment (exact: every
    /// bf16 and f16 value is an f32 value).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>> {
        let b = self.bytes;
        petite_dtype::widen_le(self.dtype, b).ok_or_else(|| Error::WrongDtype {
            tensor: self.name.to_string(),
            expected: "a float dtype (F32, BF16, F16)",
            found: self.dtype,
        })
    }
}

/// Shape and type of a tensor without touching its bytes (planning never faults a page in).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Element type.
    pub dtype: Dtype,
    /// Shape; empty for a scalar.
    pub shape: Vec<usize>,
}

/// Where weights come from. Implementations are memory-mapped files; views borrow the mapping.
pub trait WeightSource: Sync {
    /// Names of all tensors, sorted (deterministic).
    fn names(&self) -> Vec<String>;
    /// Shape and dtype of `name`, read from the header only.
    fn info(&self, name: &str) -> Result<TensorInfo>;
    /// A zero-copy view of `name`'s bytes. Faults pages in lazily as they are read.
    fn tensor(&self, name: &str) -> Result<TensorView<'_>>;
    /// Gives the pages of these tensors back to the OS (their bytes stay readable: pages fault
    /// back in from the file). Called after the last reader of each tensor is done.
    fn release(&self, names: &[&str]) -> Result<()>;

    /// Gives back the pages of `name` that lie within bytes `start..end` of its data, rounding
    /// outward to whole pages (a neighbour sharing an edge page just faults it back in). Streaming
    /// readers (conversion) call it behind themselves. The default does nothing.
    fn release_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        let _ = (name, start, end);
        Ok(())
    }

    /// Unmaps the pages of `name` within bytes `start..end` from this process (rounding outward
    /// to whole pages) but leaves them in the page cache: for readers that come back to them soon,
    /// such as a transposing reader walking a weight column band by column band, whose faults
    /// also map neighbouring cached pages. The default does nothing.
    fn unmap_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        let _ = (name, start, end);
        Ok(())
    }

    /// The files this source reads (so writers can refuse to replace one). Default: none known.
    fn files(&self) -> Vec<std::path::PathBuf> {
        Vec::new()
    }

    /// Errs ([`crate::Error::Changed`]) when a file this source reads is no longer the one it
    /// opened (size, modification time or inode changed): whatever was computed from it must not
    /// be published. Sources over files check each; wrappers ask their inner source. The default
    /// (in-memory sources) has nothing to check.
    fn check_unchanged(&self) -> Result<()> {
        Ok(())
    }

    /// Hints that bytes `start..end` of `name` will be read soon (`MADV_WILLNEED`: readahead
    /// starts now instead of page fault by page fault). The default does nothing.
    fn prefetch_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        let _ = (name, start, end);
        Ok(())
    }
}
