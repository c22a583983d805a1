//! One safetensors file, memory-mapped read-only. Views borrow the mapping; nothing is copied and a
//! tensor's pages become resident only while something reads them.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, UncheckedAdvice};
use std::sync::Mutex;

use crate::fault::{Registration, Role};
use crate::header::{Header, HeaderEntry, parse_header};
use crate::writer::PAD_PREFIX;
use crate::{Error, FileIdentity, Result, TensorInfo, TensorView, WeightSource, page, page_size};

/// A mapped safetensors file. The mapping is `MAP_SHARED` and read-only, so giving pages back with
/// `MADV_DONTNEED` never loses data: they fault back in from the file.
///
/// As with any mapping, the file must not be changed by anyone else while it is mapped: if
/// another process truncates it, reading a page past the new end raises SIGBUS. The mapping is
/// registered with [`crate::fault`], so where the binary installed its handler that SIGBUS ends
/// the process with a one-line error naming the file and exit code
/// [`crate::fault::EXIT_CODE`]; without the handler it kills the process. If another process
/// writes to it, views see the new bytes; [`MappedSafetensors::check_unchanged`] tells (size,
/// modification time, inode against those of `open`). Bounds never depend on the bytes after
/// `open`: the header is parsed once into owned values and every view is sliced from the
/// fixed-length mapping with checked ranges.
#[derive(Debug)]
pub struct MappedSafetensors {
    path: PathBuf,
    file: File,
    identity: FileIdentity,
    role: Role,
    // Declared before `map`: unregistered before the range is unmapped.
    reg: Registration,
    map: Mmap,
    /// File offset of the first mapped byte (page-aligned; 0 for a whole file).
    map_off: usize,
    /// File offset of the safetensors data (the region's start; 0 for a whole file).
    start: usize,
    header: Header,
    by_name: HashMap<String, usize>,
    names: Vec<String>,
    /// Page size releases round to: the OS page unless [`MappedSafetensors::with_page_size`].
    page: usize,
    /// File ranges already given back (page-aligned), swept again by later releases nearby
    /// ([`FOLIO_SPAN`]).
    released: Mutex<Vec<std::ops::Range<usize>>>,
}

/// The largest page-cache folio a fault maps at once (the PMD size of 4 KiB pages: ext4 and
/// tmpfs build large folios, and a fault on one byte of a cached folio maps all of it). Reading
/// a small tensor after its neighbours were given back maps their pages again; each release
/// therefore also unmaps the already-released ranges within the naturally aligned spans of this
/// size around it. Measured: a converter that releases weight by weight kept ~2 MiB mapped
/// around each small tensor lying between two large ones, most of its peak RSS
/// (docs/MEASUREMENTS.md, the portable export).
pub const FOLIO_SPAN: usize = 2 << 20;

impl MappedSafetensors {
    /// Opens and maps `path`, validating its header (see [`crate::parse_header`]). Tensor bytes are
    /// not read.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::open_inner(path.as_ref(), Role::File, None)
    }

    /// [`MappedSafetensors::open`], naming the file as `role` in a SIGBUS message and in
    /// [`Error::Changed`].
    pub fn open_as(path: impl AsRef<Path>, role: Role) -> Result<Self> {
        Self::open_inner(path.as_ref(), role, None)
    }

    /// Opens and maps a safetensors file stored at `[offset, offset + len)` of `path` (e.g. an
    /// engine stored in a `.pte` segment), validating its header; tensor bytes are not read and
    /// views, releases and residency work as for a whole file (offsets stay the file's).
    pub fn open_region(path: impl AsRef<Path>, role: Role, offset: u64, len: u64) -> Result<Self> {
        Self::open_inner(path.as_ref(), role, Some((offset, len)))
    }

    fn open_inner(path: &Path, role: Role, region: Option<(u64, u64)>) -> Result<Self> {
        let path = path.to_path_buf();
        let file = File::open(&path).map_err(|e| Error::io(&path, "open", e))?;
        let md = file.metadata().map_err(|e| Error::io(&path, "stat", e))?;
        let identity = FileIdentity::of(&md);
        let file_len = md.len();
        let shown = match region {
            Some((o, l)) => format!("{} bytes {o}..{}", path.display(), o.saturating_add(l)),
            None => path.display().to_string(),
        };
        let (start, len) = region.unwrap_or((0, file_len));
        if start.checked_add(len).is_none_or(|end| end > file_len) {
            return Err(Error::Truncated {
                file: shown,
                reason: format!("the region runs past the end of the {file_len}-byte file"),
            });
        }
        if len < 8 {
            return Err(Error::Truncated {
                file: shown,
                reason: format!("{len} bytes, shorter than the 8-byte header length prefix"),
            });
        }
        let page = page_size() as u64;
        let map_off = start / page * page;
        let (skip, map_len) = ((start - map_off) as usize, (start + len - map_off) as usize);
        // SAFETY: `MmapOptions::map` is unsafe because the `&[u8]` it hands out is only
        // immutable if no one changes the file while it is mapped. petite opens sources
        // read-only and never writes them; the contract (see the type's docs) is that no other
        // process does either. If one truncates the file anyway, touching a page past the new
        // end raises SIGBUS (registered below: the binary's handler ends the process with an
        // error naming the file); if one writes to it, views read the new bytes
        // (`check_unchanged` tells). Neither can make a view reach outside the mapping: the
        // header is parsed once, into owned values, and views are slices of the fixed-length
        // mapping. The offset is page-aligned and offset + length lies inside the file (checked
        // above).
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(map_off)
                .len(map_len)
                .map(&file)
        }
        .map_err(|e| Error::io(&path, "mmap", e))?;
        let reg = Registration::new(map.as_ptr(), map.len(), &path, role);
        let (map_off, start) = (map_off as usize, start as usize);
        let header = parse_header(&shown, &map[skip..])?;
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
            identity,
            role,
            reg,
            map,
            map_off,
            start,
            header,
            by_name,
            names,
            page: page_size(),
            released: Mutex::new(Vec::new()),
        })
    }

    /// Rounds releases to `page` instead of the OS page: a power-of-two multiple of it
    /// ([`page::check`]), so that a 4 KiB host runs the release paths of a 16 or 64 KiB kernel
    /// (the tests do), or a caller releases in coarser units.
    pub fn with_page_size(mut self, page: usize) -> Result<Self> {
        self.page = page::check(page)?;
        Ok(self)
    }

    /// The page size releases round to.
    pub fn page_size(&self) -> usize {
        self.page
    }

    /// The file this maps.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's identity when it was opened (of the descriptor that was mapped).
    pub fn identity(&self) -> FileIdentity {
        self.identity
    }

    /// What the file is, in messages.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Names the file as `role` from now on (SIGBUS message, [`Error::Changed`]).
    pub fn set_role(&mut self, role: Role) {
        self.role = role;
        self.reg.set_role(role);
    }

    /// The validated header (entries in file order, metadata, data start).
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// Size of the mapping (the whole file, or the region rounded out to a page) in bytes.
    pub fn mapped_len(&self) -> usize {
        self.map.len()
    }

    /// File offset one past the last mapped byte.
    fn map_end(&self) -> usize {
        self.map_off + self.map.len()
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
        let s = self.start + self.header.data_start;
        Ok(s + e.begin..s + e.end)
    }

    /// Unmaps `[start, end)` (absolute file offsets; `start` on a page) from this process
    /// (`MADV_DONTNEED`), clamped to the mapping. The pages stay in the page cache.
    fn unmap(&self, start: usize, end: usize) -> Result<()> {
        let (start, end) = (start.max(self.map_off), end.min(self.map_end()));
        if start >= end {
            return Ok(());
        }
        debug_assert!(start.is_multiple_of(page_size()));
        // SAFETY: `unchecked_advise_range` is unsafe because DONTNEED on a private or anonymous
        // mapping zeroes the pages. This mapping is a read-only MAP_SHARED file mapping: DONTNEED
        // only unmaps the pages and a later read faults the same bytes back in from the page
        // cache or the file, so live views observe no change, under the same contract as `open`
        // (if another process truncated the file meanwhile, that read raises SIGBUS: see `open`).
        // The range lies inside the mapping (clamped above), which matters because DONTNEED
        // beyond it would hit whatever else is mapped there and memmap2 checks only `start` and
        // the length apart; callers pass page-aligned starts (tensor ranges rounded to pages,
        // released ranges, spans of a page multiple).
        unsafe {
            self.map.unchecked_advise_range(
                UncheckedAdvice::DontNeed,
                start - self.map_off,
                end - start,
            )
        }
        .map_err(|e| Error::io(&self.path, "madvise(DONTNEED)", e))
    }

    /// Drops `[start, end)` (absolute file offsets, page-aligned) from this process
    /// ([`Self::unmap`]) and then from the page cache (`POSIX_FADV_DONTNEED`, which only drops
    /// pages no longer mapped, hence the order).
    fn drop_pages(&self, start: usize, end: usize) -> Result<()> {
        if start >= end {
            return Ok(());
        }
        self.unmap(start, end)?;
        // SAFETY: posix_fadvise takes no pointers; `self.file` owns the fd and is open for as long
        // as `self`. It only drops clean, unmapped pages from the page cache.
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
        insert_merged(&mut self.released_ranges(), start..end);
        Ok(())
    }

    fn released_ranges(&self) -> std::sync::MutexGuard<'_, Vec<std::ops::Range<usize>>> {
        // A poisoned list is still a list of ranges that were given back.
        self.released.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Unmaps (`MADV_DONTNEED` only: they stay in the page cache) the already-released ranges
    /// inside the [`FOLIO_SPAN`]-aligned spans around `near` (absolute file offsets), where a
    /// fault on a neighbour may have mapped them back in as part of a large folio. Pages of
    /// tensors not yet released are left alone.
    fn sweep(&self, near: std::ops::Range<usize>) -> Result<()> {
        let span = FOLIO_SPAN.max(self.page);
        let lo = (near.start / span * span).max(self.map_off);
        let hi = near
            .end
            .div_ceil(span)
            .saturating_mul(span)
            .min(self.map_end());
        let hits: Vec<std::ops::Range<usize>> = self
            .released_ranges()
            .iter()
            .filter(|r| r.start < hi && r.end > lo)
            .map(|r| r.start.max(lo)..r.end.min(hi))
            .collect();
        for r in hits {
            self.unmap(r.start, r.end)?;
        }
        Ok(())
    }

    /// Bytes of `[start, end)` (absolute file offsets) resident in this process's page tables or
    /// the page cache, per `mincore` (whole pages).
    pub fn resident_bytes_in(&self, start: usize, end: usize) -> Result<usize> {
        let page = page_size();
        let end = end.min(self.map_end());
        let start = (start / page * page).max(self.map_off);
        if start >= end {
            return Ok(0);
        }
        let pages = (end - start).div_ceil(page);
        let mut vec = vec![0u8; pages];
        // SAFETY: mincore reads no memory of ours and writes one byte per page of the range into
        // `vec`. The range lies within our mapping (end clamped to its length above), its start
        // is page-aligned (the mapping starts on a page and `start` is rounded down to one), and
        // `vec` has `ceil(len / page)` bytes. It only asks the kernel about residency, so a
        // truncated file (beyond the new end) is reported, not faulted in.
        let rc = unsafe {
            libc::mincore(
                self.map.as_ptr().add(start - self.map_off) as *mut libc::c_void,
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
        self.resident_bytes_in(self.map_off, self.map_end())
    }
}

/// Adds `r` to `list` (sorted, disjoint, not touching), merging it with the ranges it overlaps
/// or touches, so the list stays as long as the number of separate released regions.
fn insert_merged(list: &mut Vec<std::ops::Range<usize>>, r: std::ops::Range<usize>) {
    if r.start >= r.end {
        return;
    }
    // First range that ends at or after r.start (could touch or overlap r).
    let i = list.partition_point(|x| x.end < r.start);
    let mut j = i;
    let mut m = r;
    while j < list.len() && list[j].start <= m.end {
        m = m.start.min(list[j].start)..m.end.max(list[j].end);
        j += 1;
    }
    list.splice(i..j, std::iter::once(m));
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
        let s = self.start - self.map_off + self.header.data_start;
        Ok(TensorView {
            name: &e.name,
            dtype: e.dtype,
            shape: &e.shape,
            bytes: &self.map[s + e.begin..s + e.end],
        })
    }

    /// Rounds each tensor's range inward to whole pages, so a page shared with a neighbour that
    /// may still be in use stays resident (at most one page per tensor edge); then unmaps the
    /// released ranges nearby that a large folio may have mapped back in ([`FOLIO_SPAN`]).
    fn release(&self, names: &[&str]) -> Result<()> {
        for n in names {
            let whole = self.file_range(n)?;
            let r = page::inward(whole.clone(), self.page);
            self.drop_pages(r.start, r.end)?;
            self.sweep(whole)?;
        }
        Ok(())
    }

    fn release_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        let r = self.file_range(name)?;
        let s = r.start + start.min(r.len());
        let e = r.start + end.min(r.len());
        // Rounded to this mapping's page (a multiple of the OS page, so every bound is an OS page
        // boundary too), clamped to what is mapped.
        let p = page::outward(s..e, self.page, self.map_end());
        self.drop_pages(p.start.max(self.map_off), p.end)?;
        self.sweep(p)
    }

    fn unmap_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        let r = self.file_range(name)?;
        let p = page::outward(
            r.start + start.min(r.len())..r.start + end.min(r.len()),
            self.page,
            self.map_end(),
        );
        self.unmap(p.start, p.end)
    }

    fn files(&self) -> Vec<PathBuf> {
        vec![self.path.clone()]
    }

    /// The path still names the file `open` mapped, with the same size and modification time.
    fn check_unchanged(&self) -> Result<()> {
        self.identity.check(&self.path, self.role)
    }

    fn prefetch_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        let r = self.file_range(name)?;
        let s = r.start + start.min(r.len());
        let e = r.start + end.min(r.len());
        if s < e {
            self.map
                .advise_range(memmap2::Advice::WillNeed, s - self.map_off, e - s)
                .map_err(|err| Error::io(&self.path, "madvise(WILLNEED)", err))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::insert_merged;

    #[test]
    fn released_ranges_merge_into_the_same_set_of_offsets() {
        // Against a bitmap over 0..64, for a fixed pseudo-random sequence of inserts.
        let mut list = Vec::new();
        let mut set = [false; 64];
        let mut x = 0x9e37_79b9u32;
        for _ in 0..500 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let a = (x % 64) as usize;
            let b = (a + (x >> 8) as usize % 6).min(64);
            insert_merged(&mut list, a..b);
            set[a..b].iter_mut().for_each(|v| *v = true);
            // sorted, disjoint and not touching, and exactly the set's offsets
            assert!(list.windows(2).all(|w| w[0].end < w[1].start), "{list:?}");
            assert!(list.iter().all(|r| r.start < r.end));
            let mut got = [false; 64];
            for r in &list {
                got[r.clone()].iter_mut().for_each(|v| *v = true);
            }
            assert_eq!(got, set);
        }
    }
}
