//! What keeps an export's output directory consistent when something else happens at the same
//! time (issue 13): one writer per directory ([`OutputDir`], an advisory `flock`), inputs that
//! must not change while they are read ([`Watch`]), caches that are checked before they are
//! trusted ([`reusable`]), and outputs published only once all of that held ([`publish`]).
//!
//! The SIGBUS side (a mapped input truncated under the process) lives in petite-weights'
//! `fault` module; the binary installs its handler at start.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use petite_weights::{FileIdentity, MappedSafetensors, Role};

use crate::layout;
use crate::{Error, Result};

/// The lock file in an output directory.
pub const LOCK_FILE: &str = layout::LOCK;
/// What temporary files of petite's writers have in their names (every write through
/// petite-fs: `<name>.petite-tmp`; staged outputs: `.<name>.petite-tmp-staged`).
use petite_fs::TMP_MARK;
/// The environment variable naming a test stop point (see [`stop_point`]).
pub const STOP_ENV: &str = "PETITE_TEST_STOP_AT";

/// An output directory this process holds: an exclusive `flock` on `OUT/.petite.lock`, held
/// until drop (or the process's end, however it ends: the kernel drops a dead holder's lock,
/// so a lock left by a killed export never blocks the next one). The lock file holds the
/// holder's pid, for the message a second writer gets.
#[derive(Debug)]
pub struct OutputDir {
    _lock: File,
}

impl OutputDir {
    /// Creates `out` if needed and locks it, failing at once if another process holds it
    /// (naming its pid); then removes what killed runs left (temporary files under `out`,
    /// `out/cache`, `out/engines`, which no live writer owns now) and any `prefix.pte` /
    /// `step.pte` of an earlier run that petite-pte's verifier refuses (one-line notice each).
    pub fn claim(out: &Path) -> Result<OutputDir> {
        std::fs::create_dir_all(out).map_err(|e| Error::io(out, "create output directory", e))?;
        let path = out.join(LOCK_FILE);
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::io(out, "write into output directory", e))?;
        // SAFETY: flock takes no pointers; `f` owns the descriptor for the whole call. The
        // descriptor is close-on-exec (std's default), so builder child processes never hold it.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(Error::io(&path, "lock", e));
            }
            return Err(Error::Locked {
                dir: out.display().to_string(),
                pid: holder_pid(&mut f),
            });
        }
        let res = (|| {
            f.set_len(0)?;
            f.rewind()?;
            writeln!(f, "{}", std::process::id())
        })();
        res.map_err(|e| Error::io(&path, "write", e))?;
        clear_temporaries(out);
        for name in layout::PTES {
            let p = out.join(name);
            if p.exists()
                && let Err(e) = petite_pte::PteFile::open(&p)
            {
                eprintln!(
                    "petite: {}: left by an earlier run and refused by the .pte verifier ({e}); removed it",
                    p.display()
                );
                let _ = std::fs::remove_file(&p);
                let _ = std::fs::remove_file(layout::spec_path(&p));
            }
        }
        Ok(OutputDir { _lock: f })
    }
}

/// The pid in a lock file another process holds (it writes it right after locking: a few
/// tries cover that moment).
fn holder_pid(f: &mut File) -> Option<u32> {
    for _ in 0..20 {
        let mut s = String::new();
        if f.rewind().is_ok()
            && f.read_to_string(&mut s).is_ok()
            && let Ok(pid) = s.trim().parse()
        {
            return Some(pid);
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    None
}

/// Removes petite's temporary files under `out`, `out/cache` and `out/engines` (the caller
/// holds the directory's lock, so no live writer owns one).
fn clear_temporaries(out: &Path) {
    for dir in layout::temp_dirs(out) {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().contains(TMP_MARK)
                && e.file_type().is_ok_and(|t| t.is_file())
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// The input files an export or verification reads, each with the identity it had when it was
/// opened; [`Watch::check`] at every stage boundary and before publishing.
#[derive(Debug, Default, Clone)]
pub struct Watch {
    files: Vec<(PathBuf, Role, FileIdentity)>,
}

impl Watch {
    /// Watches the files of `src` (checkpoint shards, mapping file).
    pub fn add(&mut self, src: &MappedSafetensors) {
        self.files
            .push((src.path().to_path_buf(), src.role(), src.identity()));
    }

    /// Watches every shard of a checkpoint (identities of when they were opened), checked
    /// once now: the end of the load stage.
    pub fn of_checkpoint(ck: &petite_pi05::inputs::CanonicalCheckpoint) -> Result<Watch> {
        let mut w = Watch::default();
        for s in ck.inner().shards() {
            w.add(s);
        }
        w.check()?;
        Ok(w)
    }

    /// Errs when a watched file is no longer the file that was opened.
    pub fn check(&self) -> Result<()> {
        for (p, role, id) in &self.files {
            id.check(p, *role)?;
        }
        Ok(())
    }
}

/// Whether the cache file at `path` (`what`: "mapping file", ...) may be reused: absent → no,
/// silently; its seal matches (length + checksum recorded when it was written) → yes; else
/// it is damaged: a one-line notice, the file and its seal are removed, no.
pub fn reusable(path: &Path, what: &str) -> bool {
    if std::fs::symlink_metadata(path).is_err() {
        return false;
    }
    match petite_weights::seal::check(path) {
        Ok(()) => true,
        Err(why) => {
            damaged(path, what, &why);
            let _ = std::fs::remove_file(path);
            petite_weights::seal::remove(path);
            false
        }
    }
}

/// The one-line notice for a damaged cache file that is rebuilt.
pub fn damaged(path: &Path, what: &str, why: &str) {
    eprintln!(
        "petite: {what} {} is damaged ({why}); rebuilding it",
        path.display()
    );
}

/// Gives the staged outputs their final names (each `(staged, final)`, in order), once the
/// watched inputs are checked unchanged and every staged `.pte` passes petite-pte's verifier;
/// on any failure the staged files are removed and nothing is renamed.
pub fn publish(watch: &Watch, files: &[(PathBuf, PathBuf)]) -> Result<()> {
    let checked = watch.check().and_then(|()| {
        for (s, f) in files {
            if f.extension().is_some_and(|e| e == "pte") {
                petite_pte::PteFile::open(s).map_err(|e| Error::BadPte {
                    path: f.display().to_string(),
                    reason: format!("the file just written fails the verifier: {e}"),
                })?;
            }
        }
        Ok(())
    });
    if let Err(e) = checked {
        for (s, _) in files {
            let _ = std::fs::remove_file(s);
        }
        return Err(e);
    }
    for (s, f) in files {
        std::fs::rename(s, f).map_err(|e| Error::io(f, "rename", e))?;
    }
    // The renames on disk (the staged files were made durable by their writers).
    if let Some(dir) = files.first().and_then(|(_, f)| f.parent()) {
        petite_fs::sync_dir(dir)?;
    }
    Ok(())
}

/// A test hook: when `$PETITE_TEST_STOP_AT` equals `point`, the process stops itself
/// (`SIGSTOP`) there, so a test can change its inputs at a known point and resume it with
/// `SIGCONT`. Points: `convert` (start of the convert stage), `engine:prefix:N` /
/// `engine:step:N` (after engine N of that program is built or reused), `weights:TAG:G` (the
/// portable export, after weight group G of program TAG), `verify` (`.pte` files mapped),
/// `convert-cli` (`petite convert`, source opened). Internal, no setting
/// ([`crate::settings::INTERNAL`]); with [`crate::settings`], the crate's only read of the
/// environment.
pub fn stop_point(point: &str) {
    if std::env::var_os(STOP_ENV).is_some_and(|v| v == point) {
        // SAFETY: raise takes no pointers; SIGSTOP stops the process until SIGCONT.
        unsafe { libc::raise(libc::SIGSTOP) };
    }
}
