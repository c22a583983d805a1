//! Seals of cache files: what a file held when it was written, recorded in a sidecar
//! `<file>.seal`, so that a later run reusing the file tells a whole one from a truncated,
//! extended or overwritten one before trusting it.
//!
//! A seal is the file's length and a SHA-256 over it: the whole file up to [`FULL_LIMIT`]
//! (16 MiB; every test file, the small engines), else its first [`HEAD`] bytes (1 MiB: every
//! header petite writes, the pi0.5 mapping file's 0.2 MiB included), [`SAMPLES`] blocks of
//! [`BLOCK`] bytes evenly spread over the rest, and its last block: 5.1 MiB read whatever the
//! size. So a wrong length, any damage to a header and any damage to a sampled block are
//! caught; a flipped byte between the samples of a large file is not. The full alternative
//! reads every byte on each reuse: on a 7.4 GB file (the full-size bf16 mapping file's size)
//! here, SHA-256 of all of it took 19.8–23.4 s from disk and 8.9–9.2 s with much of it cached
//! (`examples/seal_cost.rs`, 2 cores shared with other work), against 0.005–0.013 s for the
//! sampled check and 0.03 s to write the seal, while converting the whole mapping file takes
//! ~12 s: a full check would cost more than rebuilding. The failures seen in practice (a killed
//! copy, a full disk, a file rewritten by another tool, a stray `truncate`) all change the
//! length or a header.
//!
//! The seal is written before the file gets its final name ([`write_for`] hashes the temporary
//! file), so a file under its final name without a seal was not finished by petite; reuse then
//! treats it as damaged. Reads use `pread`, never a mapping, so checking a truncated file
//! cannot fault.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// Files up to this size are hashed whole.
pub const FULL_LIMIT: u64 = 16 << 20;
/// Bytes hashed at the start of a larger file.
pub const HEAD: u64 = 1 << 20;
/// Size of a sampled block.
pub const BLOCK: u64 = 64 << 10;
/// Blocks sampled between the head and the last block.
pub const SAMPLES: u64 = 64;

const FORMAT: &str = "petite-seal/1";

/// The sidecar of `path`: `<path>.seal`.
pub fn sidecar(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".seal");
    PathBuf::from(s)
}

/// The byte ranges a seal of a `len`-byte file hashes, in order.
fn ranges(len: u64) -> Vec<(u64, u64)> {
    if len <= FULL_LIMIT {
        return vec![(0, len)];
    }
    let mut r = vec![(0, HEAD)];
    let span = len - HEAD - BLOCK;
    for i in 0..SAMPLES {
        let off = HEAD + span * i / SAMPLES;
        r.push((off, BLOCK));
    }
    r.push((len - BLOCK, BLOCK));
    r
}

/// The seal line of the open file `f`.
fn compute(f: &File) -> std::io::Result<String> {
    let len = f.metadata()?.len();
    line(len, &mut |off, buf| f.read_exact_at(buf, off))
}

/// The seal line of `len` bytes at `offset` of the open file `f` (a region of a larger file,
/// e.g. one segment of a `.pte` written in place), hashed as a file of those bytes would be.
pub fn of_region(f: &File, offset: u64, len: u64) -> std::io::Result<String> {
    line(len, &mut |off, buf| f.read_exact_at(buf, offset + off))
}

/// The seal line of a `len`-byte file whose bytes `read_at(offset, buf)` gives (fills `buf`
/// from `offset`): what [`write_for`] records for such a file, computed without the file (the
/// export id of a backend that never writes its mapping file is the seal it would have had).
/// Only the sampled ranges are asked for, in pieces of at most 1 MiB.
pub fn line(
    len: u64,
    read_at: &mut dyn FnMut(u64, &mut [u8]) -> std::io::Result<()>,
) -> std::io::Result<String> {
    let mut h = Sha256::new();
    h.update(len.to_le_bytes());
    let mut buf = vec![0u8; 1 << 20];
    for (off, n) in ranges(len) {
        let mut done = 0;
        while done < n {
            let k = (n - done).min(buf.len() as u64) as usize;
            read_at(off + done, &mut buf[..k])?;
            h.update(&buf[..k]);
            done += k as u64;
        }
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(format!(
        "{FORMAT} len={len} sampled={} sha256={hex}\n",
        u8::from(len > FULL_LIMIT)
    ))
}

/// Seals `data` (a finished file, usually still under its temporary name) as `target`: writes
/// `target.seal` (petite-fs: temporary name, fsync, rename, fsync of the directory).
pub fn write_for(data: &Path, target: &Path) -> Result<()> {
    let f = File::open(data).map_err(|e| Error::io(data, "open to seal", e))?;
    let line = compute(&f).map_err(|e| Error::io(data, "read to seal", e))?;
    petite_fs::write(sidecar(target), line.as_bytes())?;
    Ok(())
}

/// Seals `path` in place (`write_for(path, path)`).
pub fn write(path: &Path) -> Result<()> {
    write_for(path, path)
}

/// Whether `path` is the file its seal describes; `Err` says why not, in words ("no seal",
/// "42 bytes, sealed at 4096", "its sampled SHA-256 differs from its seal").
pub fn check(path: &Path) -> std::result::Result<(), String> {
    let side = sidecar(path);
    let want = std::fs::read_to_string(&side).map_err(|_| {
        format!(
            "no seal ({} is missing: not finished by petite, or older)",
            side.display()
        )
    })?;
    let f = File::open(path).map_err(|e| format!("cannot open it: {e}"))?;
    let len = f
        .metadata()
        .map_err(|e| format!("cannot stat it: {e}"))?
        .len();
    let sealed_len = want
        .split_whitespace()
        .find_map(|w| w.strip_prefix("len="))
        .and_then(|v| v.parse::<u64>().ok());
    match sealed_len {
        None => return Err(format!("its seal {} is unreadable", side.display())),
        Some(l) if l != len => return Err(format!("{len} bytes, sealed at {l}")),
        Some(_) => {}
    }
    let have = compute(&f).map_err(|e| format!("cannot read it: {e}"))?;
    if have != want {
        let how = if len > FULL_LIMIT {
            "its SHA-256 over the header and sampled blocks"
        } else {
            "its SHA-256"
        };
        return Err(format!("{how} differs from its seal"));
    }
    Ok(())
}

/// Removes `path`'s seal, if any.
pub fn remove(path: &Path) {
    let _ = std::fs::remove_file(sidecar(path));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_small_files_whole_and_sample_large_ones() {
        assert_eq!(ranges(100), vec![(0, 100)]);
        assert_eq!(ranges(FULL_LIMIT), vec![(0, FULL_LIMIT)]);
        let len = 7_400_000_000;
        let r = ranges(len);
        assert_eq!(r.len() as u64, SAMPLES + 2);
        assert_eq!(r[0], (0, HEAD));
        assert_eq!(*r.last().unwrap(), (len - BLOCK, BLOCK));
        assert!(
            r.windows(2)
                .all(|w| w[0].0 + w[0].1 <= w[1].0 || w[1].0 == len - BLOCK)
        );
        let read: u64 = r.iter().map(|x| x.1).sum();
        assert_eq!(read, HEAD + (SAMPLES + 1) * BLOCK);
    }

    #[test]
    fn damage_of_each_kind_is_named() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f.bin");
        std::fs::write(&p, vec![7u8; 10_000]).unwrap();
        assert!(check(&p).unwrap_err().starts_with("no seal"));
        write(&p).unwrap();
        check(&p).unwrap();
        // A flipped byte anywhere in a small file.
        let mut b = std::fs::read(&p).unwrap();
        b[5_000] ^= 1;
        std::fs::write(&p, &b).unwrap();
        assert_eq!(check(&p).unwrap_err(), "its SHA-256 differs from its seal");
        b[5_000] ^= 1;
        std::fs::write(&p, &b).unwrap();
        check(&p).unwrap();
        // Truncated, extended.
        std::fs::write(&p, &b[..4096]).unwrap();
        assert_eq!(check(&p).unwrap_err(), "4096 bytes, sealed at 10000");
        b.push(0);
        std::fs::write(&p, &b).unwrap();
        assert_eq!(check(&p).unwrap_err(), "10001 bytes, sealed at 10000");
        // A seal for a temporary file, written under the final name's sidecar.
        let tmp = d.path().join("g.tmp");
        let fin = d.path().join("g.bin");
        std::fs::write(&tmp, b"abc").unwrap();
        write_for(&tmp, &fin).unwrap();
        std::fs::rename(&tmp, &fin).unwrap();
        check(&fin).unwrap();
        remove(&fin);
        assert!(check(&fin).is_err());
    }
}
