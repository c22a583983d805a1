//! One safetensors file, memory-mapped read-only. Views borrow the mapping; nothing is copied and a
//! tensor's pages become resident only while something reads them.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, UncheckedAdvice};

use crate::header::{Header, HeaderEntry, parse_header};
use crate::writer::PAD_PREFIX;
use crate::{Error, Result, TensorInfo, TensorView, WeightSource, page_size};

/// A mapped safetensors file. The mapping is `MAP_SHARED` and read-only, so giving pages back with
/// `MADV_DONTNEED` never loses data: they fault back in from the file. (As with any mapping, the
/// file must not be truncated by someone else while it is mapped.)
#[derive(Debug)]
pub struct MappedSafetensors {
    path: PathBuf,
    file: File,
    map: Mmap,
    header: Header,
    by_name: HashMap<String, usize>,
    names: Vec<String>,
}

impl MappedSafetensors {
    /// Opens and maps `path`, validating its header (see [`crate::parse_header`]). Tensor bytes are
    /// not read.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| Error::io(&path, "open", e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io(&path, "stat", e))?
            .len();
        let shown = path.display().to_string();
        if len < 8 {
            return Err(Error::Truncated {
                file: shown,
                reason: format!("{len} bytes, shorter than the 8-byte header length prefix"),
            });
        }
        // SAFETY: the mapping is read-only; petite never writes to a source, and the documented
        // contract is that sources are not truncated while mapped.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, "mmap", e))?;
        let header = parse_header(&shown, &map)?;
        let mut by_name = HashMap::with_capacity(header.entries.len());
        for (i, e) in header.entries.iter().enumerate() {
            by_name.insert(e.name.clone(), i);
        }
        let mut names: Vec<String> = header
            .entries
            .iter()
            .filter(|e| !e.name.starts_with(PAD_PREFIX))
            .map(|e| e.name.clone())
            .collect();
        names.sort();
        Ok(MappedSafetensors {
            path,
            file,
            map,
            header,
            by_name,
            names,
        })
    }

    /// The file this maps.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The validated header (entries in file order, metadata, data start).
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Size of the mapping (the whole file) in bytes.
    pub fn mapped_len(&self) -> usize {
        self.map.len()
    }

    fn entry(&self, name: &str) -> Result<&HeaderEntry> {
        self.by_name
            .get(name)
            .map(|&i| &self.header.entries[i])
            .ok_or_else(|| Error::MissingTensor {
                file: self.path.display().to_string(),
                name: name.to_string(),
            })
    }

    /// Absolute file byte range of `name`'s data.
    pub fn file_range(&self, name: &str) -> Result<std::ops::Range<usize>> {
        let e = self.entry(name)?;
        Ok(self.header.data_start + e.begin..self.header.data_start + e.end)
    }

    /// Drops `[start, end)` (absolute file offsets, already page-aligned) from this process
    /// (`MADV_DONTNEED`) and then from the page cache (`POSIX_FADV_DONTNEED`, which only drops
    /// pages no longer mapped, hence the order).
    fn drop_pages(&self, start: usize, end: usize) -> Result<()> {
        if start >= end {
            return Ok(());
        }
        // SAFETY: read-only MAP_SHARED file mapping: DONTNEED only unmaps the pages, a later read
        // faults in the same bytes from the file, so live views observe no change.
        unsafe {
            self.map
                .unchecked_advise_range(UncheckedAdvice::DontNeed, start, end - start)
        }
        .map_err(|e| Error::io(&self.path, "madvise(DONTNEED)", e))?;
        // SAFETY: plain syscall on an fd we own.
        let rc = unsafe {
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                start as libc::off_t,
                (end - start) as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            )
        };
        if rc != 0 {
            return Err(Error::io(
                &self.path,
                "posix_fadvise(DONTNEED)",
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    /// Bytes of `[start, end)` (absolute file offsets) resident in this process's page tables or
    /// the page cache, per `mincore` (whole pages).
    pub fn resident_bytes_in(&self, start: usize, end: usize) -> Result<usize> {
        let page = page_size();
        let end = end.min(self.map.len());
        let start = start / page * page;
        if start >= end {
            return Ok(0);
        }
        let pages = (end - start).div_ceil(page);
        let mut vec = vec![0u8; pages];
        // SAFETY: the range lies within our mapping, start is page-aligned, and vec has one byte
        // per page.
        let rc = unsafe {
            libc::mincore(
                self.map.as_ptr().add(start) as *mut libc::c_void,
                end - start,
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(Error::io(
                &self.path,
                "mincore",
                std::io::Error::last_os_error(),
            ));
        }
        Ok(vec.iter().filter(|&&b| b & 1 == 1).count() * page)
    }

    /// Bytes of this mapping resident in this process (pages mapped into its page tables), from
    /// `/proc/self/smaps`; `None` without procfs.
    pub fn process_resident_bytes(&self) -> Option<u64> {
        crate::residency::mapping_rss(self.map.as_ptr() as usize)
    }

    /// Bytes of the whole file that are in memory (page cache), per `mincore`.
    pub fn resident_bytes(&self) -> Result<usize> {
        self.resident_bytes_in(0, self.map.len())
    }
}

impl WeightSource for MappedSafetensors {
    fn names(&self) -> Vec<String> {
        self.names.clone()
    }

    fn info(&self, name: &str) -> Result<TensorInfo> {
        let e = self.entry(name)?;
        Ok(TensorInfo {
            dtype: e.dtype,
            shape: e.shape.clone(),
        })
    }

    fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let e = self.entry(name)?;
        let s = self.header.data_start;
        Ok(TensorView {
            name: &e.name,
            dtype: e.dtype,
            shape: &e.shape,
            bytes: &self.map[s + e.begin..s + e.end],
        })
    }

    /// Rounds each tensor's range inward to whole pages, so a page shared with a neighbour that
    /// may still be in use stays resident (at most one page per tensor edge).
    fn release(&self, names: &[&str]) -> Result<()> {
        let page = page_size();
        for n in names {
            let r = self.file_range(n)?;
            self.drop_pages(r.start.div_ceil(page) * page, r.end / page * page)?;
        }
        Ok(())
    }

    fn release_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        let page = page_size();
        let r = self.file_range(name)?;
        let s = r.start + start.min(r.len());
        let e = r.start + end.min(r.len());
        let e = (e.div_ceil(page) * page).min(self.map.len());
        self.drop_pages(s / page * page, e)
    }

    fn unmap_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        let page = page_size();
        let r = self.file_range(name)?;
        let s = (r.start + start.min(r.len())) / page * page;
        let e = ((r.start + end.min(r.len())).div_ceil(page) * page).min(self.map.len());
        if s >= e {
            return Ok(());
        }
        // SAFETY: read-only MAP_SHARED file mapping: DONTNEED only unmaps the pages, a later read
        // faults in the same bytes from the page cache or the file.
        unsafe {
            self.map
                .unchecked_advise_range(UncheckedAdvice::DontNeed, s, e - s)
        }
        .map_err(|e| Error::io(&self.path, "madvise(DONTNEED)", e))
    }

    fn files(&self) -> Vec<PathBuf> {
        vec![self.path.clone()]
    }

    fn prefetch_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        let r = self.file_range(name)?;
        let s = r.start + start.min(r.len());
        let e = r.start + end.min(r.len());
        if s < e {
            self.map
                .advise_range(memmap2::Advice::WillNeed, s, e - s)
                .map_err(|err| Error::io(&self.path, "madvise(WILLNEED)", err))?;
        }
        Ok(())
    }
}
