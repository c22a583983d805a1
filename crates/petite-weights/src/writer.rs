//! A streaming safetensors writer: the whole table is known up front, so the header (and every
//! tensor's offset) is written first and tensor bytes are then streamed in, sequentially or from
//! several threads at once (positional writes), never held in memory.
//!
//! Layout: the JSON header is padded with spaces so the data region starts on a page boundary.
//! Tensors whose size is a multiple of the page size come first, so each starts on a page
//! boundary; then the rest, largest element size first (keeps every tensor aligned to its element
//! size) and, within an element size, large tensors (at least [`LARGE`] bytes) before small ones,
//! so the first odd-sized large tensor also starts on a page boundary (pi0.5 has exactly one: the
//! patch embedding). The file holds exactly the caller's tensors: safetensors requires a
//! contiguous data region, so any further alignment would need filler tensors, which strict
//! loaders (lerobot's `load_state_dict`) reject as unexpected keys. A misaligned large tensor only
//! costs its two partial edge pages when it is released.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::{Dtype, Error, Result, page_size};

/// Tensors of at least this many bytes (and every page-multiple-sized one) start on a page
/// boundary; smaller ones are packed (a pad of up to a page for a 5 KiB tensor would waste more
/// than it saves: its pages are shared with neighbours anyway).
pub const LARGE: u64 = 64 * 1024;

/// Name prefix of the padding tensors the writer inserts; never valid for a caller's tensor.
pub const PAD_PREFIX: &str = "__petite_pad_";

/// One row of the table given to [`SafetensorsWriter::create`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// A table row.
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: &[usize]) -> Self {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }
}

#[derive(Debug)]
struct Slot {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute file offset of the first byte.
    offset: u64,
    len: u64,
    pad: bool,
    written: AtomicU64,
    claimed: AtomicBool,
}

/// Writes one safetensors file. Created under a temporary name next to the output; [`finish`]
/// checks every tensor got exactly its byte count, fsyncs and renames. Dropped without `finish`,
/// it deletes the temporary file, so the final name never holds a partial file.
///
/// [`finish`]: SafetensorsWriter::finish
#[derive(Debug)]
pub struct SafetensorsWriter {
    out: PathBuf,
    tmp: PathBuf,
    file: Option<Target>,
    slots: Vec<Slot>,
    by_name: std::collections::HashMap<String, usize>,
    /// Length of the safetensors bytes (from `base`).
    total_len: u64,
    /// Where the file's first byte is in the target (0 for a file of its own).
    base: u64,
    /// Absolute offset of the data region.
    data_start: u64,
}

/// Where a writer's bytes go.
#[derive(Debug)]
enum Target {
    /// A file of its own, under a temporary name until finished.
    Own(petite_fs::AtomicFile),
    /// A region of a file someone else owns.
    Region(File),
}

fn usize_bytes(spec: &TensorSpec) -> Option<u64> {
    spec.shape
        .iter()
        .try_fold(spec.dtype.size() as u64, |a, &d| a.checked_mul(d as u64))
}

/// The bytes and places of a safetensors file as [`SafetensorsWriter`] lays it out (see the
/// module docs), planned without writing anything: its header (length prefix and padded JSON)
/// and each tensor's offset, so a caller knows a file's size and header before any tensor is
/// read (a `.pte` segment reserved for it, a seal of a file never written).
#[derive(Debug, Clone)]
pub struct SafetensorsLayout {
    header: Vec<u8>,
    /// `(name, dtype, shape, offset from the file's start, len)` in file order.
    rows: Vec<(String, Dtype, Vec<usize>, u64, u64)>,
    total_len: u64,
}

impl SafetensorsLayout {
    /// The layout of `table` with `metadata` for the OS page; `out` only names the file in
    /// errors.
    pub fn plan(out: &Path, table: &[TensorSpec], metadata: &[(String, String)]) -> Result<Self> {
        Self::plan_for_page(out, table, metadata, page_size())
    }

    /// [`SafetensorsLayout::plan`] for pages of `page` bytes.
    pub fn plan_for_page(
        out: &Path,
        table: &[TensorSpec],
        metadata: &[(String, String)],
        page: usize,
    ) -> Result<Self> {
        let shown = out.display().to_string();
        let bad = |t: Option<&str>, reason: String| Error::InvalidTable {
            file: shown.clone(),
            tensor: t.map(str::to_string),
            reason,
        };
        if !page.is_power_of_two() {
            return Err(bad(None, format!("page size {page} is not a power of two")));
        }
        let page = page as u64;
        let mut seen = std::collections::HashSet::new();
        let mut sized = Vec::with_capacity(table.len());
        for t in table {
            if t.name.starts_with(PAD_PREFIX) || t.name == "__metadata__" {
                return Err(bad(Some(&t.name), "reserved name".into()));
            }
            if !seen.insert(t.name.as_str()) {
                return Err(bad(Some(&t.name), "name appears more than once".into()));
            }
            let len = usize_bytes(t).ok_or_else(|| bad(Some(&t.name), "size overflows".into()))?;
            sized.push((t, len));
        }
        // Stable order within each class keeps the caller's order (deterministic output).
        let mut order: Vec<usize> = (0..sized.len()).collect();
        order.sort_by_key(|&i| {
            let (t, len) = sized[i];
            if len > 0 && len.is_multiple_of(page) {
                (0, 0, 0)
            } else {
                (1, 8 - t.dtype.size(), u8::from(len < LARGE.max(page)))
            }
        });
        // Header JSON, padded with spaces so the data region starts on a page boundary.
        let mut obj = serde_json::Map::new();
        if !metadata.is_empty() {
            let m: serde_json::Map<String, serde_json::Value> = metadata
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                .collect();
            obj.insert("__metadata__".into(), m.into());
        }
        let mut off = 0u64;
        let mut rows = Vec::with_capacity(order.len());
        for i in order {
            let (t, len) = sized[i];
            let end = off
                .checked_add(len)
                .ok_or_else(|| bad(Some(&t.name), "file size overflows".into()))?;
            obj.insert(
                t.name.clone(),
                serde_json::json!({
                    "dtype": t.dtype.safetensors_name(),
                    "shape": t.shape,
                    "data_offsets": [off, end],
                }),
            );
            rows.push((t.name.clone(), t.dtype, t.shape.clone(), off, len));
            off = end;
        }
        let mut json = serde_json::to_vec(&obj).expect("a JSON map serializes");
        let padded = crate::page::align_up(8 + json.len() as u64, page) - 8;
        json.resize(padded as usize, b' ');
        let data_start = 8 + padded;
        let mut header = Vec::with_capacity(data_start as usize);
        header.extend_from_slice(&padded.to_le_bytes());
        header.extend_from_slice(&json);
        for r in &mut rows {
            r.3 += data_start;
        }
        Ok(SafetensorsLayout {
            header,
            rows,
            total_len: data_start + off,
        })
    }

    /// The bytes before the data region: the 8-byte header length and the padded JSON.
    pub fn header(&self) -> &[u8] {
        &self.header
    }

    /// Size of the whole file in bytes.
    pub fn total_len(&self) -> u64 {
        self.total_len
    }

    /// `(name, dtype, offset from the file's start, byte length)` of every tensor, in file
    /// order.
    pub fn tensors(&self) -> impl Iterator<Item = (&str, Dtype, u64, u64)> {
        self.rows
            .iter()
            .map(|(n, d, _, off, len)| (n.as_str(), *d, *off, *len))
    }
}

impl SafetensorsWriter {
    /// Plans the layout of `table` (see the module docs) for the OS page, creates
    /// `<out>.petite-tmp` and writes the header. `metadata` goes into `__metadata__`.
    pub fn create(
        out: impl AsRef<Path>,
        table: &[TensorSpec],
        metadata: &[(String, String)],
    ) -> Result<Self> {
        Self::create_for_page(out, table, metadata, page_size())
    }

    /// [`SafetensorsWriter::create`] with the layout planned for pages of `page` bytes (any
    /// power of two: a layout is only a file, it never reaches `madvise`), e.g. a 64 KiB
    /// kernel's layout written on a 4 KiB host.
    pub fn create_for_page(
        out: impl AsRef<Path>,
        table: &[TensorSpec],
        metadata: &[(String, String)],
        page: usize,
    ) -> Result<Self> {
        let out = out.as_ref();
        let layout = SafetensorsLayout::plan_for_page(out, table, metadata, page)?;
        Self::create_laid_out(out, &layout)
    }

    /// [`SafetensorsWriter::create`] of a table already laid out (`layout` planned for `out`).
    pub fn create_laid_out(out: impl AsRef<Path>, layout: &SafetensorsLayout) -> Result<Self> {
        let out = out.as_ref().to_path_buf();
        if out.file_name().is_none() {
            return Err(Error::InvalidTable {
                file: out.display().to_string(),
                tensor: None,
                reason: "output path has no file name".into(),
            });
        }
        let file = petite_fs::AtomicFile::create(&out)?;
        let tmp = file.temp().to_path_buf();
        Self::with_target(out, tmp, Target::Own(file), 0, layout)
    }

    /// A writer of the file `layout` describes into `[base, base + layout.total_len())` of the
    /// open `file` (at `path`, named in errors), e.g. a segment of a `.pte` reserved for it:
    /// the header is written now, the tensors as streamed; [`SafetensorsWriter::finish`]
    /// checks the byte counts and leaves the file to its owner (no rename, no fsync).
    pub fn create_in(
        file: &File,
        path: &Path,
        base: u64,
        layout: &SafetensorsLayout,
    ) -> Result<Self> {
        let dup = file
            .try_clone()
            .map_err(|e| Error::io(path, "duplicate descriptor", e))?;
        Self::with_target(
            path.to_path_buf(),
            path.to_path_buf(),
            Target::Region(dup),
            base,
            layout,
        )
    }

    fn with_target(
        out: PathBuf,
        tmp: PathBuf,
        target: Target,
        base: u64,
        layout: &SafetensorsLayout,
    ) -> Result<Self> {
        let mut slots = Vec::with_capacity(layout.rows.len());
        let mut by_name = std::collections::HashMap::new();
        for (name, dtype, shape, off, len) in &layout.rows {
            by_name.insert(name.clone(), slots.len());
            slots.push(Slot {
                name: name.clone(),
                dtype: *dtype,
                shape: shape.clone(),
                offset: base + off,
                len: *len,
                pad: false,
                written: AtomicU64::new(0),
                claimed: AtomicBool::new(false),
            });
        }
        let w = SafetensorsWriter {
            out,
            tmp: tmp.clone(),
            file: Some(target),
            slots,
            by_name,
            total_len: layout.total_len,
            base,
            data_start: base + layout.header.len() as u64,
        };
        w.file()
            .write_all_at(&layout.header, base)
            .map_err(|e| Error::io(&tmp, "write header", e))?;
        Ok(w)
    }

    /// The tensors in file order (padding excluded): streaming them in this order writes the file
    /// sequentially.
    pub fn order(&self) -> Vec<&str> {
        self.slots
            .iter()
            .filter(|s| !s.pad)
            .map(|s| s.name.as_str())
            .collect()
    }

    /// Offset of the data region in the target file (a page multiple from [`Self::base`]).
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// Final size of the safetensors bytes.
    pub fn total_len(&self) -> u64 {
        self.total_len
    }

    /// Offset of the safetensors bytes in the target file (0 unless [`Self::create_in`]).
    pub fn base(&self) -> u64 {
        self.base
    }

    fn slot(&self, name: &str) -> Result<&Slot> {
        self.by_name
            .get(name)
            .map(|&i| &self.slots[i])
            .filter(|s| !s.pad)
            .ok_or_else(|| Error::MissingTensor {
                file: self.out.display().to_string(),
                name: name.to_string(),
            })
    }

    /// Byte length and absolute file offset of `name`'s data.
    pub fn placement(&self, name: &str) -> Result<(u64, u64)> {
        let s = self.slot(name)?;
        Ok((s.offset, s.len))
    }

    /// The dtype `name` is stored in.
    pub(crate) fn dtype(&self, name: &str) -> Result<Dtype> {
        Ok(self.slot(name)?.dtype)
    }

    /// A sequential sink for `name`'s bytes (`write_all` chunks, then [`TensorSink::finish`]).
    /// Each tensor can be opened once.
    pub fn tensor(&self, name: &str) -> Result<TensorSink<'_>> {
        let s = self.slot(name)?;
        if s.claimed.swap(true, Ordering::SeqCst) {
            return Err(Error::ByteCount {
                file: self.out.display().to_string(),
                tensor: name.to_string(),
                reason: "opened for writing twice".into(),
            });
        }
        Ok(TensorSink {
            w: self,
            slot: s,
            pos: 0,
        })
    }

    /// Writes `bytes` at byte `offset` within `name`'s data (positional, from any thread). Each
    /// byte of every tensor must be written exactly once across all calls; `finish` checks the
    /// totals.
    pub fn write_at(&self, name: &str, offset: u64, bytes: &[u8]) -> Result<()> {
        let s = self.slot(name)?;
        s.claimed.store(true, Ordering::SeqCst);
        self.write_slot(s, offset, bytes)
    }

    fn write_slot(&self, s: &Slot, offset: u64, bytes: &[u8]) -> Result<()> {
        let n = bytes.len() as u64;
        if offset.checked_add(n).is_none_or(|e| e > s.len) {
            return Err(Error::ByteCount {
                file: self.out.display().to_string(),
                tensor: s.name.clone(),
                reason: format!(
                    "write of {n} bytes at {offset} runs past its {} bytes ({:?} {:?})",
                    s.len, s.dtype, s.shape
                ),
            });
        }
        let file = self.file();
        file.write_all_at(bytes, s.offset + offset).map_err(|e| {
            // `bytes` may be a view of a mapped source that was truncated meanwhile.
            crate::fault::efault_on_mapped(&e, bytes)
                .unwrap_or_else(|| Error::io(&self.tmp, "write", e))
        })?;
        let before = s.written.fetch_add(n, Ordering::SeqCst);
        if before + n > s.len {
            return Err(Error::ByteCount {
                file: self.out.display().to_string(),
                tensor: s.name.clone(),
                reason: format!(
                    "{} bytes written, more than its {} bytes",
                    before + n,
                    s.len
                ),
            });
        }
        Ok(())
    }

    /// The open temporary file (e.g. for `sync_file_range`/`posix_fadvise` on written ranges).
    pub fn file(&self) -> &File {
        match self.file.as_ref().expect("file open until finish") {
            Target::Own(f) => f.file(),
            Target::Region(f) => f,
        }
    }

    /// Checks that every tensor received exactly its byte count, fsyncs the file, renames it to
    /// the output name and fsyncs the directory. On error the temporary file is removed.
    pub fn finish(self) -> Result<PathBuf> {
        self.finish_inner(false)
    }

    /// [`SafetensorsWriter::finish`] for a cache file: between the fsync and the rename the
    /// finished file is sealed ([`crate::seal`]: `<out>.seal`), so a file under the final name
    /// always has the seal a later reuse checks.
    pub fn finish_sealed(self) -> Result<PathBuf> {
        self.finish_inner(true)
    }

    fn finish_inner(mut self, seal: bool) -> Result<PathBuf> {
        for s in &self.slots {
            let w = s.written.load(Ordering::SeqCst);
            if w != s.len {
                return Err(Error::ByteCount {
                    file: self.out.display().to_string(),
                    tensor: s.name.clone(),
                    reason: format!(
                        "{w} of its {} bytes written ({:?} {:?})",
                        s.len, s.dtype, s.shape
                    ),
                });
            }
        }
        let file = match self.file.take().expect("file open until finish") {
            Target::Own(f) => f,
            // A region's file belongs to the caller, who makes it durable.
            Target::Region(_) => return Ok(self.out.clone()),
        };
        // Padding tensors are holes (zeros); the length covers a trailing one.
        file.file()
            .set_len(self.total_len)
            .map_err(|e| Error::io(&self.tmp, "set length", e))?;
        // The one durability rule (petite-fs); a cache file is sealed between the fsync and
        // the rename.
        let out = self.out.clone();
        file.commit_with(|tmp| {
            if seal {
                crate::seal::write_for(tmp, &out)?;
            }
            Ok::<(), Error>(())
        })?;
        Ok(self.out.clone())
    }
}

/// Sequential writer of one tensor's bytes, from [`SafetensorsWriter::tensor`]. Writing past the
/// tensor's size is an error; [`TensorSink::finish`] checks the count is exact.
#[derive(Debug)]
pub struct TensorSink<'w> {
    w: &'w SafetensorsWriter,
    slot: &'w Slot,
    pos: u64,
}

impl TensorSink<'_> {
    /// Bytes still expected.
    pub fn remaining(&self) -> u64 {
        self.slot.len - self.pos
    }

    /// Checks that exactly the tensor's byte count was written.
    pub fn finish(self) -> Result<()> {
        if self.pos != self.slot.len {
            return Err(Error::ByteCount {
                file: self.w.out.display().to_string(),
                tensor: self.slot.name.clone(),
                reason: format!("{} of its {} bytes written", self.pos, self.slot.len),
            });
        }
        Ok(())
    }
}

impl Write for TensorSink<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.w
            .write_slot(self.slot, self.pos, buf)
            .map_err(std::io::Error::other)?;
        self.pos += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
