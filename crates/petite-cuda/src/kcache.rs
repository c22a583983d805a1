//! Compiled kernels kept on disk between processes. NVRTC spends seconds on petite's kernel
//! module and each engine's fused kernels at every start, the same machine code each time; a
//! file per (NVRTC version, architecture, options, source) holds that code for the next run.
//!
//! A file is its source and its machine code: one is only used when the stored source equals
//! the one asked for (no trust in the name's hash alone) and its length fields add up. Files are
//! written under a temporary name and renamed, so a reader never sees half of one; anything
//! unreadable is a miss and the kernels are compiled again. The cache is where
//! [`crate::Settings::kernel_cache`] says: `PETITE_CUDA_CACHE` (`off` for none), else
//! `$XDG_CACHE_HOME/petite/cuda`, else `$HOME/.cache/petite/cuda`.

use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

const MAGIC: &[u8; 8] = b"PTCUBIN1";

/// What the kernel cache holds: where it is (`None`: off, or no home known) and its compiled
/// modules' count and bytes (0 where the folder does not exist yet). Why: a machine's first
/// run of a program compiles every kernel with NVRTC (seconds); `petite doctor` says whether
/// this one has them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelCache {
    /// The folder ([`crate::Settings::kernel_cache`]).
    pub dir: Option<PathBuf>,
    /// Compiled modules (`*.cubin` files) in it.
    pub modules: usize,
    /// Their bytes.
    pub bytes: u64,
}

/// The kernel cache `settings` name ([`KernelCache`]).
pub fn kernel_cache(settings: &crate::Settings) -> KernelCache {
    let dir = settings.kernel_cache.clone();
    let (modules, bytes) = dir.as_deref().map_or((0, 0), contents);
    KernelCache {
        dir,
        modules,
        bytes,
    }
}

/// The `*.cubin` files directly in `dir` and their bytes (an unreadable folder holds none).
fn contents(dir: &Path) -> (usize, u64) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (0, 0);
    };
    entries
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "cubin"))
        .filter_map(|e| e.metadata().ok().filter(|m| m.is_file()))
        .fold((0, 0), |(n, b), m| (n + 1, b + m.len()))
}

/// The file name for machine code compiled from `source` by NVRTC `nvrtc` for `sm_XY` with
/// `options`.
pub(crate) fn file_name(nvrtc: &str, cc: (i32, i32), options: &[String], source: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"petite-cuda cubin\0");
    h.update(nvrtc.as_bytes());
    h.update(format!("\0sm_{}{}\0", cc.0, cc.1).as_bytes());
    for o in options {
        h.update(o.as_bytes());
        h.update(b"\0");
    }
    h.update(source.as_bytes());
    let d = h.finalize();
    let hex: String = d.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!("{hex}-sm{}{}.cubin", cc.0, cc.1)
}

/// The machine code in `path` if it was compiled from `source`; `None` for anything else
/// (missing, another source, truncated, foreign).
pub(crate) fn read(path: &Path, source: &str) -> Option<Vec<u8>> {
    let data = std::fs::read(path).ok()?;
    let rest = data.strip_prefix(MAGIC.as_slice())?;
    let (n, rest) = rest.split_first_chunk::<8>()?;
    let n = usize::try_from(u64::from_le_bytes(*n)).ok()?;
    let (src, rest) = rest.split_at_checked(n)?;
    if src != source.as_bytes() {
        return None;
    }
    let (m, code) = rest.split_first_chunk::<8>()?;
    let m = usize::try_from(u64::from_le_bytes(*m)).ok()?;
    (m == code.len() && m > 0).then(|| code.to_vec())
}

/// Writes `code` compiled from `source` to `path` (temporary file, then rename). Errors are
/// returned for the caller to report; a failed write leaves no file under `path`.
pub(crate) fn write(path: &Path, source: &str, code: &[u8]) -> std::io::Result<()> {
    let parent = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("cubin");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = parent.join(format!(".{name}.{}.{nanos}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(MAGIC)?;
        f.write_all(&(source.len() as u64).to_le_bytes())?;
        f.write_all(source.as_bytes())?;
        f.write_all(&(code.len() as u64).to_le_bytes())?;
        f.write_all(code)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("petite-kcache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn a_file_is_used_only_for_its_own_source_and_whole() {
        let d = scratch("roundtrip");
        let opts = vec!["--fmad=false".to_string()];
        let name = file_name("13.0", (9, 0), &opts, "kernel a");
        // Every part of the key changes the name.
        assert_ne!(name, file_name("13.1", (9, 0), &opts, "kernel a"));
        assert_ne!(name, file_name("13.0", (8, 7), &opts, "kernel a"));
        assert_ne!(name, file_name("13.0", (9, 0), &[], "kernel a"));
        assert_ne!(name, file_name("13.0", (9, 0), &opts, "kernel b"));
        assert!(name.ends_with("-sm90.cubin"), "{name}");
        let p = d.join("sub").join(&name);
        assert_eq!(read(&p, "kernel a"), None);
        write(&p, "kernel a", b"\x7fELF code").unwrap();
        assert_eq!(read(&p, "kernel a").as_deref(), Some(&b"\x7fELF code"[..]));
        // Another source under the same name (a hash collision, a hand-copied file): a miss.
        assert_eq!(read(&p, "kernel b"), None);
        // Truncated anywhere: a miss, never a short image.
        let full = std::fs::read(&p).unwrap();
        for cut in [0, 4, 8, 12, 16, 20, full.len() - 1] {
            std::fs::write(&p, &full[..cut]).unwrap();
            assert_eq!(read(&p, "kernel a"), None, "cut at {cut}");
        }
        // No temporary files are left beside it.
        let left: Vec<_> = std::fs::read_dir(d.join("sub"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left.len(), 1, "{left:?}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_cache_counts_its_compiled_modules_only() {
        let d = scratch("contents");
        assert_eq!(contents(&d), (0, 0), "a folder not made yet holds none");
        write(&d.join(file_name("13.0", (9, 0), &[], "a")), "a", b"1234").unwrap();
        write(&d.join(file_name("13.0", (9, 0), &[], "b")), "b", b"12").unwrap();
        std::fs::write(d.join("notes.txt"), b"not a module").unwrap();
        std::fs::create_dir_all(d.join("sub.cubin")).unwrap();
        let (n, bytes) = contents(&d);
        assert_eq!(n, 2);
        // Each file: magic, two lengths, the source and the code.
        assert_eq!(bytes, 2 * (8 + 8 + 8) + 1 + 4 + 1 + 2);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_write_that_cannot_happen_leaves_nothing() {
        let d = scratch("blocked");
        std::fs::create_dir_all(&d).unwrap();
        // The parent is a file: the write fails and no file appears.
        let f = d.join("file");
        std::fs::write(&f, b"x").unwrap();
        assert!(write(&f.join("k.cubin"), "s", b"code").is_err());
        // The target is a directory: the rename fails and the temporary file is removed.
        let target = d.join("k.cubin");
        std::fs::create_dir_all(target.join("inside")).unwrap();
        assert!(write(&target, "s", b"code").is_err());
        let names: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
