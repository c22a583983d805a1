//! Which file an input is, and whether it is still that file: device, inode, size and
//! modification time, captured when the input is opened and compared again at stage
//! boundaries, so outputs built from an input that changed are refused instead of published.

use std::fs::Metadata;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use crate::fault::Role;
use crate::{Error, Result};

/// A file's identity at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    /// Device holding the file.
    pub dev: u64,
    /// Inode number.
    pub ino: u64,
    /// Size in bytes.
    pub len: u64,
    /// Modification time, nanoseconds since the epoch.
    pub mtime_ns: i128,
}

impl FileIdentity {
    /// The identity in `md` (from `File::metadata` of the open file, or `std::fs::metadata`).
    pub fn of(md: &Metadata) -> Self {
        FileIdentity {
            dev: md.dev(),
            ino: md.ino(),
            len: md.len(),
            mtime_ns: md.mtime() as i128 * 1_000_000_000 + md.mtime_nsec() as i128,
        }
    }

    /// The identity of the file at `path` now.
    pub fn of_path(path: &Path) -> std::io::Result<Self> {
        std::fs::metadata(path).map(|m| Self::of(&m))
    }

    /// What differs from `self` in `now` (`None`: the path no longer names a file), in words;
    /// `None` when nothing does.
    pub fn change(&self, now: Option<&FileIdentity>) -> Option<String> {
        let Some(n) = now else {
            return Some("it was removed".into());
        };
        if (n.dev, n.ino) != (self.dev, self.ino) {
            return Some("another file now has its name (replaced)".into());
        }
        if n.len != self.len {
            return Some(format!("size {} → {} bytes", self.len, n.len));
        }
        if n.mtime_ns != self.mtime_ns {
            return Some("modified in place (same size, new modification time)".into());
        }
        None
    }

    /// Errs ([`Error::Changed`]) when the file at `path` is no longer this one.
    pub fn check(&self, path: &Path, role: Role) -> Result<()> {
        let now = Self::of_path(path).ok();
        match self.change(now.as_ref()) {
            None => Ok(()),
            Some(what) => Err(Error::Changed {
                role: role.name(),
                file: path.display().to_string(),
                what,
            }),
        }
    }
}
