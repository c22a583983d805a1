#![doc = include_str!("../README.md")]
//!
//! ## API map
//!
//! - [`WeightSource`]: the seam every reader of weights goes through.
//! - [`MappedSafetensors`]: one mapped `.safetensors` file as a [`WeightSource`] (zero-copy views).
//! - [`Checkpoint`]: a single file or a sharded checkpoint (`model.safetensors.index.json`).
//! - [`Remapped`]: a source seen through a caller-supplied [`KeyMap`] (layout differences).
//! - [`RowSlices`]: row ranges of a source's tensors exposed as tensors (sharded weights).
//! - [`SafetensorsWriter`]: streams tensors into a page-aligned safetensors file (temp + rename).
//! - [`convert()`]: f32 → bf16/f16 in bounded chunks, dropping the source's pages behind itself.
//! - [`residency`]: how much of a mapping / of this process is resident.
//! - [`page`]: the OS page size (asked once) and the page rounding, page size as a parameter.
//! - [`writeback`]: flushing and evicting written ranges behind a writer.
//! - [`fault`]: a SIGBUS on a mapped file (truncated by another process) becomes a one-line
//!   error naming it; [`FileIdentity`]: whether an input is still the file that was opened;
//!   [`seal`]: length + checksum sidecars that let a reused cache file be trusted.
//! - [`Error`]: every failure, naming the file and tensor.
#![deny(missing_docs)]

mod convert;
pub mod fault;
mod header;
mod identity;
mod mapped;
pub mod page;
mod remap;
pub mod residency;
mod rows;
pub mod seal;
mod sharded;
mod source;
pub mod writeback;
mod writer;

pub use convert::{
    ConvertOptions, ConvertReport, Progress, Selection, StreamOptions, TargetDtype, convert,
    convert_into, default_threads, seal_of, stream,
};
pub use fault::Role;
pub use header::{Header, HeaderEntry, Index, MAX_HEADER_LEN, parse_header, parse_index};
pub use identity::FileIdentity;
pub use mapped::{FOLIO_SPAN, MappedSafetensors};
/// The OS page size (4 KiB on x86-64 and Jetson kernels, 16/64 KiB on some aarch64 ones).
pub use page::page_size;
pub use remap::{KeyMap, Remapped};
pub use rows::RowSlices;
pub use sharded::Checkpoint;
pub use source::{Dtype, TensorInfo, TensorView, WeightSource};
pub use writer::{LARGE, PAD_PREFIX, SafetensorsLayout, SafetensorsWriter, TensorSink, TensorSpec};

/// `n` bytes for people: `6.25 GiB`, `512.0 MiB`, `20.0 KiB`, `100 B` (binary units). The one
/// size formatter of the workspace's messages, here because every crate that prints sizes
/// already depends on this one.
pub fn human_bytes(n: u64) -> String {
    let f = n as f64;
    if n >= 1 << 30 {
        format!("{:.2} GiB", f / (1u64 << 30) as f64)
    } else if n >= 1 << 20 {
        format!("{:.1} MiB", f / (1u64 << 20) as f64)
    } else if n >= 1 << 10 {
        format!("{:.1} KiB", f / 1024.0)
    } else {
        format!("{n} B")
    }
}

/// Errors of this crate; each names the file and, where relevant, the tensor.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor the caller asked for is not in the source.
    #[error("{file}: no tensor named `{name}`")]
    MissingTensor {
        /// The file (or index) searched.
        file: String,
        /// The tensor name.
        name: String,
    },
    /// An I/O operation on a file failed.
    #[error("{file}: {op}: {source}")]
    Io {
        /// The file.
        file: String,
        /// What was being done (`"open"`, `"map"`, `"write"`, ...).
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file is shorter than its own header says (or shorter than the 8-byte length prefix).
    #[error("{file}: truncated: {reason}")]
    Truncated {
        /// The file.
        file: String,
        /// Expected vs found.
        reason: String,
    },
    /// The safetensors header is malformed or lies about the data.
    #[error("{file}: invalid safetensors header{}: {reason}", tensor_suffix(.tensor))]
    InvalidHeader {
        /// The file.
        file: String,
        /// The tensor entry at fault, if one is.
        tensor: Option<String>,
        /// What is wrong: expected vs found.
        reason: String,
    },
    /// A sharded checkpoint's index is malformed.
    #[error("{file}: invalid checkpoint index{}: {reason}", tensor_suffix(.tensor))]
    InvalidIndex {
        /// The index file.
        file: String,
        /// The tensor entry at fault, if one is.
        tensor: Option<String>,
        /// What is wrong.
        reason: String,
    },
    /// A shard named by the index does not exist.
    #[error("{index}: shard `{shard}` (holding `{tensor}`) is missing")]
    MissingShard {
        /// The index file.
        index: String,
        /// The shard file name as written in the index.
        shard: String,
        /// One tensor the index places in it.
        tensor: String,
    },
    /// A tensor's dtype is not what the operation needs.
    #[error("tensor `{tensor}`: expected {expected}, found {found:?}")]
    WrongDtype {
        /// The tensor.
        tensor: String,
        /// What was needed.
        expected: &'static str,
        /// What it is.
        found: Dtype,
    },
    /// A writer was given a table it cannot write (duplicate or reserved name, size overflow).
    #[error("{file}: invalid tensor table{}: {reason}", tensor_suffix(.tensor))]
    InvalidTable {
        /// The output file.
        file: String,
        /// The tensor at fault, if one is.
        tensor: Option<String>,
        /// What is wrong.
        reason: String,
    },
    /// A tensor was written with the wrong number of bytes, or more than once.
    #[error("{file}: tensor `{tensor}`: {reason}")]
    ByteCount {
        /// The output file.
        file: String,
        /// The tensor.
        tensor: String,
        /// Expected vs found.
        reason: String,
    },
    /// The output path is one of the source's files.
    #[error("output {out} is the source file {source_file}: refusing to overwrite the input")]
    WouldOverwriteSource {
        /// The output path given.
        out: String,
        /// The source file it resolves to.
        source_file: String,
    },
    /// A keep/drop list or key map names something the source does not have.
    #[error("{0}")]
    Selection(String),
    /// A page size given for releases or layouts that the OS page cannot stand for.
    #[error(
        "page size {page} is not a power-of-two multiple of the OS page ({os} bytes): releases would hand madvise misaligned addresses"
    )]
    PageSize {
        /// The page size given.
        page: usize,
        /// The OS page size.
        os: usize,
    },
    /// An input file is no longer the file that was opened (size, modification time or inode
    /// changed): whatever was computed from it is not published.
    #[error(
        "{role} changed or truncated while it was being read: {file} ({what}); nothing built from it was published; re-run once it is stable"
    )]
    Changed {
        /// What the file is (`checkpoint`, `mapping file`, ...).
        role: &'static str,
        /// The file.
        file: String,
        /// What changed.
        what: String,
    },
    /// A weight could not be quantized (a row holds a value that is not finite).
    #[error("tensor `{tensor}` row {row}: cannot quantize to {quant}: {reason}")]
    Quantize {
        /// The checkpoint tensor.
        tensor: String,
        /// The row (index on axis 0).
        row: usize,
        /// The format (`int8`, `fp8`).
        quant: &'static str,
        /// Why.
        reason: String,
    },
}

fn tensor_suffix(t: &Option<String>) -> String {
    match t {
        Some(t) => format!(" (tensor `{t}`)"),
        None => String::new(),
    }
}

impl From<petite_fs::Error> for Error {
    fn from(e: petite_fs::Error) -> Self {
        let petite_fs::Error::Io { path, op, source } = e;
        Error::io(&path, op, source)
    }
}

impl Error {
    pub(crate) fn io(file: &std::path::Path, op: &'static str, source: std::io::Error) -> Self {
        Error::Io {
            file: file.display().to_string(),
            op,
            source,
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
