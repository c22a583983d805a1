#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![forbid(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// What every temporary file of petite's writers has in its name (`DEST.petite-tmp`, and the
/// staged outputs of an export, `.NAME.petite-tmp-staged`): what the output guard clears.
pub const TMP_MARK: &str = ".petite-tmp";

/// A failed step of writing a file into place.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An OS error at `path` while doing `op` (`"create"`, `"write"`, `"fsync"`, `"rename"`).
    #[error("{}: {op}: {source}", path.display())]
    Io {
        /// The file (the temporary name up to the rename, the final name for the rename).
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
}

impl Error {
    /// The error of `op` at `path`.
    pub fn io(path: impl Into<PathBuf>, op: &'static str, source: std::io::Error) -> Error {
        Error::Io {
            path: path.into(),
            op,
            source,
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The temporary name [`AtomicFile`] writes `dest` under: `DEST.petite-tmp`, same directory.
pub fn temp_path(dest: &Path) -> PathBuf {
    let mut name = dest.as_os_str().to_owned();
    name.push(TMP_MARK);
    PathBuf::from(name)
}

/// A file being written under [`temp_path`]`(dest)`, renamed to `dest` by [`AtomicFile::commit`]
/// (fsync, hook, rename, fsync of the directory); removed if dropped uncommitted.
#[derive(Debug)]
pub struct AtomicFile {
    dest: PathBuf,
    tmp: PathBuf,
    file: Option<File>,
}

impl AtomicFile {
    /// Creates the temporary file for `dest` (replacing a stale one a killed run left).
    pub fn create(dest: impl AsRef<Path>) -> Result<AtomicFile> {
        let dest = dest.as_ref().to_path_buf();
        let tmp = temp_path(&dest);
        // A stale temporary file is ours to replace: its writer is gone (the name is per
        // destination, and a destination has one writer at a time).
        let _ = std::fs::remove_file(&tmp);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| Error::io(&tmp, "create", e))?;
        Ok(AtomicFile {
            dest,
            tmp,
            file: Some(file),
        })
    }

    /// The open temporary file.
    pub fn file(&self) -> &File {
        self.file.as_ref().expect("open until commit")
    }

    /// The open temporary file, for `Write`.
    pub fn file_mut(&mut self) -> &mut File {
        self.file.as_mut().expect("open until commit")
    }

    /// The temporary name (for error messages about writes to it).
    pub fn temp(&self) -> &Path {
        &self.tmp
    }

    /// The final name.
    pub fn dest(&self) -> &Path {
        &self.dest
    }

    /// Makes the file durable and puts it under its final name (fsync, rename, fsync of the
    /// directory). On error the temporary file is removed.
    pub fn commit(self) -> Result<()> {
        self.commit_with(|_| Ok::<(), Error>(()))
    }

    /// [`AtomicFile::commit`] with `hook(temp)` run between the fsync and the rename (a seal of
    /// the finished file); its error aborts the commit (the temporary file is removed).
    pub fn commit_with<E: From<Error>>(
        mut self,
        hook: impl FnOnce(&Path) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let file = self.file.take().expect("open until commit");
        file.sync_all()
            .map_err(|e| Error::io(&self.tmp, "fsync", e))?;
        drop(file);
        hook(&self.tmp)?;
        std::fs::rename(&self.tmp, &self.dest).map_err(|e| Error::io(&self.dest, "rename", e))?;
        // Renamed: nothing left for Drop to remove.
        self.tmp = PathBuf::new();
        sync_dir(parent(&self.dest))?;
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            self.file = None;
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Writes `bytes` to `path` the one way ([`AtomicFile`]: temporary name, fsync, rename, fsync of
/// the directory).
pub fn write(path: impl AsRef<Path>, bytes: &[u8]) -> Result<()> {
    let mut f = AtomicFile::create(path)?;
    let tmp = f.temp().to_path_buf();
    f.file_mut()
        .write_all(bytes)
        .map_err(|e| Error::io(&tmp, "write", e))?;
    f.commit()
}

/// `fsync`s directory `dir` (a rename into it is then on disk).
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, "fsync directory", e))
}

/// The directory a path is in (`.` for a bare name).
fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_puts_the_bytes_under_the_final_name_and_leaves_no_temporary() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("out.json");
        write(&p, b"one").unwrap();
        write(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["out.json"]);
    }

    #[test]
    fn dropped_or_failed_writes_leave_nothing() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.bin");
        // A stale temporary file from a killed run is replaced.
        std::fs::write(temp_path(&p), b"stale").unwrap();
        let f = AtomicFile::create(&p).unwrap();
        assert!(f.temp().to_string_lossy().ends_with("x.bin.petite-tmp"));
        drop(f);
        assert!(!temp_path(&p).exists() && !p.exists());
        // The hook's error aborts the commit.
        let f = AtomicFile::create(&p).unwrap();
        let e = f
            .commit_with(|t| Err(Error::io(t, "seal", std::io::Error::other("no"))))
            .unwrap_err();
        assert!(e.to_string().ends_with("x.bin.petite-tmp: seal: no"), "{e}");
        assert!(!temp_path(&p).exists() && !p.exists());
        // A directory squatting on the final name: the rename fails, naming it.
        std::fs::create_dir(&p).unwrap();
        std::fs::create_dir(p.join("inside")).unwrap();
        let e = write(&p, b"x").unwrap_err();
        assert!(e.to_string().contains("x.bin: rename: "), "{e}");
        assert!(!temp_path(&p).exists());
    }
}
