//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong reading, verifying or writing a `.pte`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O error on a named file.
    #[error("{path}: {op}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The OS error (shown in the message, so not also chained as a source).
        error: std::io::Error,
    },
    /// Fewer bytes than the format requires.
    #[error("{what} is truncated: {len} bytes, need at least {need}")]
    Truncated {
        /// What was being read.
        what: String,
        /// Bytes available.
        len: u64,
        /// Bytes required.
        need: u64,
    },
    /// Bytes 4..8 are not `ET12`.
    #[error(
        "file identifier is \"{}\" at bytes 4..8, expected \"ET12\" (not an ExecuTorch program)",
        found.escape_ascii()
    )]
    Identifier {
        /// The four bytes found.
        found: [u8; 4],
    },
    /// The `eh00` extended header is malformed or inconsistent with the file.
    #[error("extended header (eh00): {0}")]
    Header(String),
    /// The flatbuffers verifier rejected the program.
    #[error("flatbuffer verification failed: {0}")]
    Flatbuffer(#[from] flatbuffers::InvalidFlatbuffer),
    /// A structural rule is broken (missing field, index out of range, overlapping segments...).
    #[error("{0}")]
    Invalid(String),
    /// The builder was used inconsistently (duplicate key, unknown value...).
    #[error("program builder: {0}")]
    Build(String),
    /// A segment's source does not provide the bytes it promised.
    #[error("segment {index} source {path}: {msg}")]
    Source {
        /// Segment index.
        index: usize,
        /// The source file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// An error while reading one file (wraps the cause with the file name).
    #[error("{path}: {cause}")]
    InFile {
        /// The `.pte` file.
        path: PathBuf,
        /// The cause (shown in the message, so not also chained as a source).
        cause: Box<Error>,
    },
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<petite_fs::Error> for Error {
    fn from(e: petite_fs::Error) -> Self {
        let petite_fs::Error::Io { path, op, source } = e;
        Error::io(path, op, source)
    }
}

impl Error {
    pub(crate) fn invalid(msg: impl Into<String>) -> Error {
        Error::Invalid(msg.into())
    }

    /// Prefixes an `Invalid` error with where it was found (e.g. `execution_plan[0]`).
    pub(crate) fn within(self, place: String) -> Error {
        match self {
            Error::Invalid(m) => Error::Invalid(format!("{place}: {m}")),
            other => other,
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, op: &'static str, source: std::io::Error) -> Error {
        Error::Io {
            path: path.into(),
            op,
            error: source,
        }
    }

    pub(crate) fn in_file(self, path: impl Into<PathBuf>) -> Error {
        let path = path.into();
        if matches!(&self, Error::Io { path: p, .. } if *p == path) {
            return self;
        }
        Error::InFile {
            path,
            cause: Box::new(self),
        }
    }
}
