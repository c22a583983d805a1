//! The `WeightSource` seam: what every consumer of weights (reference executor, engine builders)
//! sees. A source hands out zero-copy views by checkpoint name and can give pages back to the OS.

use crate::Result;

/// Element type of a stored tensor. Only what checkpoints and mapping files hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    /// IEEE binary32.
    F32,
    /// bfloat16 (upper half of an f32).
    Bf16,
    /// IEEE binary16.
    F16,
    /// signed 64-bit integer.
    I64,
    /// signed 32-bit integer.
    I32,
    /// unsigned byte.
    U8,
    /// boolean, one byte per element.
    Bool,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::I64 => 8,
            Dtype::U8 | Dtype::Bool => 1,
        }
    }

    /// The safetensors spelling (`"F32"`, `"BF16"`, ...).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::Bf16 => "BF16",
            Dtype::F16 => "F16",
            Dtype::I64 => "I64",
            Dtype::I32 => "I32",
            Dtype::U8 => "U8",
            Dtype::Bool => "BOOL",
        }
    }
}

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

impl TensorView<'_> {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
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
}
