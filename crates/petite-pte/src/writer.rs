//! Writing a `.pte`: the flatbuffer (small, in memory) with the `eh00` header, then each segment
//! streamed from its source at its aligned offset. File sources are copied with
//! `copy_file_range` (in-kernel, no user-space copy), falling back to a bounded buffer, so a
//! segment's bytes are never all in memory. The file is written under a temporary name in the
//! destination directory and renamed into place only when complete.

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::header::{self, SEGMENT_ALIGNMENT, align_up, lcm};
use crate::model::{DataSegment, Program};
use crate::{Error, Result, encode, verify};

/// Size of the fallback copy buffer (and the largest zero-padding write).
const COPY_BUF: usize = 1 << 20;
/// The largest chunk handed to one `copy_file_range` call.
const COPY_CHUNK: usize = 1 << 30;

/// Where a segment's bytes come from.
#[derive(Clone, Debug)]
pub enum SegmentData {
    /// Bytes already in memory (small blobs; shared, not copied, when cloned).
    Bytes(Arc<[u8]>),
    /// `len` bytes of a file starting at `offset`, read at write time.
    File {
        /// Source file (never modified).
        path: PathBuf,
        /// Start of the region.
        offset: u64,
        /// Length of the region.
        len: u64,
    },
    /// Several sources back to back (a constant segment gathered from many file regions).
    Parts(Arc<[SegmentData]>),
    /// `len` bytes produced at write time by the `fill` callback of [`write_pte_streamed`],
    /// which gets `id` and writes straight into the file (a weight converted on the fly is
    /// written once, never staged in a temporary file).
    Deferred {
        /// Passed to the callback.
        id: u64,
        /// Exact number of bytes the callback must write.
        len: u64,
    },
}

impl SegmentData {
    /// In-memory bytes.
    pub fn bytes(b: impl Into<Arc<[u8]>>) -> SegmentData {
        SegmentData::Bytes(b.into())
    }

    /// A whole file (its size is taken now and checked again at write time).
    pub fn file(path: impl AsRef<Path>) -> Result<SegmentData> {
        let path = path.as_ref();
        let len = std::fs::metadata(path)
            .map_err(|e| Error::io(path, "stat segment source", e))?
            .len();
        Ok(SegmentData::File {
            path: path.to_path_buf(),
            offset: 0,
            len,
        })
    }

    /// A region of a file.
    pub fn file_region(path: impl Into<PathBuf>, offset: u64, len: u64) -> SegmentData {
        SegmentData::File {
            path: path.into(),
            offset,
            len,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            SegmentData::Bytes(b) => b.len() as u64,
            SegmentData::File { len, .. } => *len,
            SegmentData::Parts(p) => p.iter().map(SegmentData::len).sum(),
            SegmentData::Deferred { len, .. } => *len,
        }
    }

    /// True for an empty source.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A segment to write: its data and the alignment it needs (the file uses
/// `lcm(128, alignment)`).
#[derive(Clone, Debug)]
pub struct Segment {
    /// The bytes.
    pub data: SegmentData,
    /// Required alignment (a power of two ≥ 1).
    pub alignment: u64,
}

/// What a write produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteSummary {
    /// Total file size.
    pub file_len: u64,
    /// Size of the flatbuffer region (headers included).
    pub program_size: u64,
    /// File offset of the first segment (0 without segment data).
    pub segment_base_offset: u64,
    /// Segment data bytes (padding between segments included).
    pub segment_data_size: u64,
    /// Bytes copied with `copy_file_range`.
    pub bytes_copied_in_kernel: u64,
    /// Bytes copied through the bounded buffer or from memory.
    pub bytes_copied_buffered: u64,
}

impl WriteSummary {
    /// A write's summary before any byte is copied: its layout only.
    fn laid_out(program_size: u64, segment_base_offset: u64, segment_data_size: u64) -> Self {
        WriteSummary {
            file_len: 0,
            program_size,
            segment_base_offset,
            segment_data_size,
            bytes_copied_in_kernel: 0,
            bytes_copied_buffered: 0,
        }
    }
}

/// Options of a write.
#[derive(Clone, Copy, Debug, Default)]
pub struct WriteOptions {
    /// Never use `copy_file_range` (exercises the fallback path).
    pub force_buffered_copy: bool,
}

/// Computes segment offsets (relative to the segment base) for `segments`, in order.
pub fn layout_segments(segments: &[Segment]) -> Result<Vec<DataSegment>> {
    let mut end = 0u64;
    segments
        .iter()
        .enumerate()
        .map(|(i, s)| {
            if s.alignment == 0 || !s.alignment.is_power_of_two() {
                return Err(Error::Build(format!(
                    "segment {i}: alignment {} is not a power of two",
                    s.alignment
                )));
            }
            let offset = align_up(end, lcm(SEGMENT_ALIGNMENT, s.alignment));
            end = offset
                .checked_add(s.data.len())
                .ok_or_else(|| Error::Build(format!("segment {i}: size overflows")))?;
            Ok(DataSegment {
                offset,
                size: s.data.len(),
            })
        })
        .collect()
}

/// Serialises `program` with the given segments into the exact bytes that precede the segment
/// data: the flatbuffer with its header (and the program with `segments` filled in).
fn prepare(program: &Program, segments: &[Segment]) -> Result<(Vec<u8>, Program, u64, u64)> {
    let mut program = program.clone();
    program.segments = layout_segments(segments)?;
    verify::verify_program(&program)?;
    let data_size = program
        .segments
        .iter()
        .map(|s| s.offset + s.size)
        .max()
        .unwrap_or(0);
    let fb = encode::encode_program(&program);
    if fb.len() as u64 >= (1 << 31) - 64 {
        return Err(Error::Build(format!(
            "the program flatbuffer is {} bytes, over the 2 GiB flatbuffer limit: move data into segments",
            fb.len()
        )));
    }
    if data_size == 0 {
        // No segment data: EXIR writes no extended header at all.
        return Ok((fb, program, 0, 0));
    }
    let program_size = (fb.len() + header::PADDED_HEADER_LEN) as u64;
    let base_align = segments
        .iter()
        .fold(SEGMENT_ALIGNMENT, |a, s| lcm(a, s.alignment));
    let base = align_up(program_size, base_align);
    Ok((
        header::insert(&fb, base, data_size),
        program,
        base,
        data_size,
    ))
}

/// Writes `program` and its segments (in order; `program.segments` is replaced by their layout)
/// to `path`, atomically.
pub fn write_pte(
    path: impl AsRef<Path>,
    program: &Program,
    segments: &[Segment],
    opts: WriteOptions,
) -> Result<WriteSummary> {
    write_pte_streamed(path, program, segments, opts, &mut |id, _| {
        Err(std::io::Error::other(format!(
            "deferred segment data {id} needs write_pte_streamed"
        )))
    })
}

/// The callback of [`write_pte_streamed`]: writes the bytes of deferred part `id`.
pub type FillFn<'a> = dyn FnMut(u64, &mut dyn Write) -> std::io::Result<()> + 'a;

/// [`write_pte`] for segments with [`SegmentData::Deferred`] parts: `fill(id, w)` writes each
/// such part's bytes (exactly its `len`, checked) through a bounded buffer into the file.
pub fn write_pte_streamed(
    path: impl AsRef<Path>,
    program: &Program,
    segments: &[Segment],
    opts: WriteOptions,
    fill: &mut FillFn<'_>,
) -> Result<WriteSummary> {
    let path = path.as_ref();
    let (head, _program, base, data_size) = prepare(program, segments)?;
    if path.file_name().is_none() {
        return Err(Error::Build(format!("{} has no file name", path.display())));
    }
    let tmp = petite_fs::AtomicFile::create(path)?;
    let tmp_path = tmp.temp().to_path_buf();
    let mut summary = WriteSummary::laid_out(head.len() as u64, base, data_size);
    let out = tmp.file();
    out.write_all_at(&head, 0)
        .map_err(|e| Error::io(&tmp_path, "write program", e))?;
    let mut pos = head.len() as u64;
    let layout = layout_segments(segments)?;
    let mut buf = Vec::new();
    for (i, (seg, at)) in segments.iter().zip(&layout).enumerate() {
        if seg.data.is_empty() {
            // Nothing to place (and without segment data there is no segment base).
            continue;
        }
        let start = base + at.offset;
        write_zeros(out, &tmp_path, pos, start - pos)?;
        pos = start;
        let mut w = SegWriter {
            index: i,
            out,
            out_path: &tmp_path,
            opts,
            buf: &mut buf,
            fill: &mut *fill,
            summary: &mut summary,
        };
        w.write(&seg.data, pos)?;
        pos += seg.data.len();
    }
    summary.file_len = pos;
    // The file is exactly this long (its temporary name was created exclusively); the one
    // durability rule (petite-fs: fsync, rename, fsync of the directory) puts it in place.
    tmp.commit()?;
    Ok(summary)
}

/// The hooks of [`write_pte_resumable`]: which segments a partial file already holds, how a
/// deferred segment is written in place, and what is recorded once a segment is durable.
pub trait Resume {
    /// The caller's error type (it carries this crate's).
    type Error: From<Error>;
    /// Whether segment `index`, at `[offset, offset + len)` of `file`, already holds its bytes
    /// (the caller checks what it recorded when it [finished](Resume::finished) it); such a
    /// segment is not written again.
    fn done(&mut self, file: &File, index: usize, offset: u64, len: u64) -> bool;
    /// Writes deferred data `id` (a whole segment) into `[offset, offset + len)` of `file`.
    fn fill(
        &mut self,
        id: u64,
        file: &File,
        offset: u64,
        len: u64,
    ) -> std::result::Result<(), Self::Error>;
    /// Writes the deferred parts of a segment gathered from several sources ([`SegmentData::Parts`]),
    /// each at its place in `file` (the writer writes the segment's other parts). Default: refused,
    /// for callers whose deferred data are whole segments.
    fn fill_parts(
        &mut self,
        file: &File,
        parts: &[Placed],
    ) -> std::result::Result<(), Self::Error> {
        let _ = file;
        Err(Error::Build(format!(
            "{} deferred parts inside a segment: this writer resumes whole segments only",
            parts.len()
        ))
        .into())
    }
    /// Every segment is in place; an error here (an input changed meanwhile) leaves the
    /// partial file unrenamed, for a later run.
    fn ready(&mut self) -> std::result::Result<(), Self::Error>;
    /// Segment `index` was written at `[offset, offset + len)` and is on storage: record it.
    fn finished(
        &mut self,
        file: &File,
        index: usize,
        offset: u64,
        len: u64,
    ) -> std::result::Result<(), Self::Error>;
}

/// Where deferred data goes in the file: its id, absolute offset and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    /// The [`SegmentData::Deferred`] id.
    pub id: u64,
    /// Absolute file offset of its first byte.
    pub offset: u64,
    /// Its length.
    pub len: u64,
}

/// Every [`SegmentData::Deferred`] of `segments` (whole segments and parts of a
/// [`SegmentData::Parts`] segment) with its place in the file [`write_pte_resumable`] writes:
/// a caller can fill them before the file is finished (and before the rest of its bytes, such
/// as named data, are known).
pub fn deferred_places(program: &Program, segments: &[Segment]) -> Result<Vec<Placed>> {
    let (_, _, base, _) = prepare(program, segments)?;
    let layout = layout_segments(segments)?;
    let mut out = Vec::new();
    for (seg, at) in segments.iter().zip(&layout) {
        if !seg.data.is_empty() {
            place_deferred(&seg.data, base + at.offset, &mut out);
        }
    }
    Ok(out)
}

fn place_deferred(data: &SegmentData, at: u64, out: &mut Vec<Placed>) {
    match data {
        SegmentData::Deferred { id, len } => out.push(Placed {
            id: *id,
            offset: at,
            len: *len,
        }),
        SegmentData::Parts(parts) => {
            let mut pos = at;
            for p in parts.iter() {
                place_deferred(p, pos, out);
                pos += p.len();
            }
        }
        SegmentData::Bytes(_) | SegmentData::File { .. } => {}
    }
}

/// [`write_pte_streamed`] that a killed run can resume: the file is written in place at
/// `partial` (opened as it is when an earlier run left it, never truncated), each segment the
/// caller says is [done](Resume::done) is kept, every other one written (a whole-segment
/// [`SegmentData::Deferred`] by [`Resume::fill`], the deferred parts of a gathered segment by
/// [`Resume::fill_parts`], straight into the file) and synced before
/// [`Resume::finished`] hears of it; the program and padding are rewritten each time. Complete,
/// the file is cut to its length, synced and renamed to `path` (then the directory synced).
/// On error `partial` stays for the next run.
pub fn write_pte_resumable<R: Resume>(
    partial: &Path,
    path: &Path,
    program: &Program,
    segments: &[Segment],
    opts: WriteOptions,
    resume: &mut R,
) -> std::result::Result<WriteSummary, R::Error> {
    let (head, _program, base, data_size) = prepare(program, segments)?;
    let out = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(partial)
        .map_err(|e| Error::io(partial, "open", e))?;
    let mut summary = WriteSummary::laid_out(head.len() as u64, base, data_size);
    out.write_all_at(&head, 0)
        .map_err(|e| Error::io(partial, "write program", e))?;
    let mut pos = head.len() as u64;
    let layout = layout_segments(segments)?;
    let mut buf = Vec::new();
    let mut nested = |id: u64, _: &mut dyn Write| -> std::io::Result<()> {
        Err(std::io::Error::other(format!(
            "deferred data {id} inside a segment's parts cannot be resumed"
        )))
    };
    for (i, (seg, at)) in segments.iter().zip(&layout).enumerate() {
        if seg.data.is_empty() {
            continue;
        }
        let start = base + at.offset;
        write_zeros(&out, partial, pos, start - pos)?;
        pos = start;
        let len = seg.data.len();
        if !resume.done(&out, i, pos, len) {
            let mut w = SegWriter {
                index: i,
                out: &out,
                out_path: partial,
                opts,
                buf: &mut buf,
                fill: &mut nested,
                summary: &mut summary,
            };
            match &seg.data {
                SegmentData::Deferred { id, .. } => {
                    resume.fill(*id, &out, pos, len)?;
                    w.summary.bytes_copied_buffered += len;
                }
                SegmentData::Parts(parts)
                    if parts
                        .iter()
                        .any(|p| matches!(p, SegmentData::Deferred { .. })) =>
                {
                    let mut deferred = Vec::new();
                    let mut at = pos;
                    for p in parts.iter() {
                        if let SegmentData::Deferred { id, len } = p {
                            deferred.push(Placed {
                                id: *id,
                                offset: at,
                                len: *len,
                            });
                        } else {
                            w.write(p, at)?;
                        }
                        at += p.len();
                    }
                    resume.fill_parts(&out, &deferred)?;
                    w.summary.bytes_copied_buffered += deferred.iter().map(|d| d.len).sum::<u64>();
                }
                data => w.write(data, pos)?,
            }
            out.sync_data()
                .map_err(|e| Error::io(partial, "sync segment", e))?;
            resume.finished(&out, i, pos, len)?;
        }
        pos += len;
    }
    summary.file_len = pos;
    resume.ready()?;
    out.set_len(pos)
        .map_err(|e| Error::io(partial, "set length", e))?;
    out.sync_all().map_err(|e| Error::io(partial, "fsync", e))?;
    std::fs::rename(partial, path).map_err(|e| Error::io(path, "rename", e))?;
    if let Some(dir) = path.parent() {
        petite_fs::sync_dir(dir).map_err(Error::from)?;
    }
    Ok(summary)
}

/// Writes one segment's data (recursively for parts) at a file position.
struct SegWriter<'a, 'f> {
    index: usize,
    out: &'a File,
    out_path: &'a Path,
    opts: WriteOptions,
    buf: &'a mut Vec<u8>,
    fill: &'a mut FillFn<'f>,
    summary: &'a mut WriteSummary,
}

impl SegWriter<'_, '_> {
    fn write(&mut self, data: &SegmentData, pos: u64) -> Result<()> {
        match data {
            SegmentData::Bytes(b) => {
                self.out
                    .write_all_at(b, pos)
                    .map_err(|e| Error::io(self.out_path, "write segment", e))?;
                self.summary.bytes_copied_buffered += b.len() as u64;
            }
            SegmentData::File {
                path: src,
                offset,
                len,
            } => {
                let (k, u) = copy_region(
                    self.index,
                    src,
                    *offset,
                    *len,
                    self.out,
                    self.out_path,
                    pos,
                    self.opts,
                    self.buf,
                )?;
                self.summary.bytes_copied_in_kernel += k;
                self.summary.bytes_copied_buffered += u;
            }
            SegmentData::Parts(parts) => {
                let mut at = pos;
                for p in parts.iter() {
                    self.write(p, at)?;
                    at += p.len();
                }
            }
            SegmentData::Deferred { id, len } => {
                let mut w = std::io::BufWriter::with_capacity(
                    COPY_BUF,
                    PositionedWriter {
                        file: self.out,
                        pos,
                        end: pos + len,
                    },
                );
                let r = (self.fill)(*id, &mut w).and_then(|()| w.flush());
                let written = w.get_ref().pos - pos;
                r.map_err(|e| Error::Source {
                    index: self.index,
                    path: self.out_path.to_path_buf(),
                    msg: format!("deferred data {id}: {e}"),
                })?;
                if written != *len {
                    return Err(Error::Source {
                        index: self.index,
                        path: self.out_path.to_path_buf(),
                        msg: format!("deferred data {id}: {written} bytes written, {len} declared"),
                    });
                }
                self.summary.bytes_copied_buffered += len;
            }
        }
        Ok(())
    }
}

/// A `Write` at a file position that refuses to run past `end` (a fill callback cannot
/// overwrite the next segment).
struct PositionedWriter<'a> {
    file: &'a File,
    pos: u64,
    end: u64,
}

impl Write for PositionedWriter<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.pos + b.len() as u64 > self.end {
            return Err(std::io::Error::other(format!(
                "{} bytes more than declared",
                self.pos + b.len() as u64 - self.end
            )));
        }
        self.file.write_all_at(b, self.pos)?;
        self.pos += b.len() as u64;
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The bytes of a program with only in-memory segments (tests, small programs). Identical to
/// what [`write_pte`] writes.
pub fn to_bytes(program: &Program, segments: &[Segment]) -> Result<Vec<u8>> {
    let (mut out, program, base, _) = prepare(program, segments)?;
    for (seg, at) in segments.iter().zip(&program.segments) {
        let mut b = Vec::new();
        if !in_memory(&seg.data, &mut b) {
            return Err(Error::Build(
                "to_bytes needs in-memory segments; use write_pte for file sources".into(),
            ));
        }
        if b.is_empty() {
            continue;
        }
        out.resize((base + at.offset) as usize, 0);
        out.extend_from_slice(&b);
    }
    Ok(out)
}

/// Appends the bytes of `d` to `out` when they are all in memory (parts of in-memory parts
/// included); false when any piece is a file region or deferred.
fn in_memory(d: &SegmentData, out: &mut Vec<u8>) -> bool {
    match d {
        SegmentData::Bytes(b) => {
            out.extend_from_slice(b);
            true
        }
        SegmentData::Parts(ps) => ps.iter().all(|p| in_memory(p, out)),
        SegmentData::File { .. } | SegmentData::Deferred { .. } => false,
    }
}

fn write_zeros(out: &File, path: &Path, mut pos: u64, mut n: u64) -> Result<()> {
    const ZEROS: [u8; 4096] = [0; 4096];
    while n > 0 {
        let k = n.min(ZEROS.len() as u64) as usize;
        out.write_all_at(&ZEROS[..k], pos)
            .map_err(|e| Error::io(path, "write padding", e))?;
        pos += k as u64;
        n -= k as u64;
    }
    Ok(())
}

/// Copies `len` bytes of `src` at `offset` to `out` at `pos`; returns (in-kernel, buffered) byte
/// counts.
#[allow(clippy::too_many_arguments)]
fn copy_region(
    index: usize,
    src: &Path,
    offset: u64,
    len: u64,
    out: &File,
    out_path: &Path,
    pos: u64,
    opts: WriteOptions,
    buf: &mut Vec<u8>,
) -> Result<(u64, u64)> {
    let source_err = |msg: String| Error::Source {
        index,
        path: src.to_path_buf(),
        msg,
    };
    let f = File::open(src).map_err(|e| source_err(format!("cannot open: {e}")))?;
    let have = f
        .metadata()
        .map_err(|e| source_err(format!("cannot stat: {e}")))?
        .len();
    if offset.checked_add(len).is_none_or(|e| e > have) {
        return Err(source_err(format!(
            "region [{offset}, +{len}) lies outside the {have}-byte file"
        )));
    }
    // Read-ahead hint, as cp gives: the source is read once, front to back.
    // SAFETY: posix_fadvise takes no pointers; `f` is open for the whole call. The advice only
    // affects read-ahead, so its result is ignored.
    unsafe {
        libc::posix_fadvise(
            f.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_SEQUENTIAL,
        );
    }
    let mut done = 0u64;
    let mut in_kernel = 0u64;
    if !opts.force_buffered_copy {
        while done < len {
            let mut off_in = (offset + done) as libc::loff_t;
            let mut off_out = (pos + done) as libc::loff_t;
            let want = ((len - done) as usize).min(COPY_CHUNK);
            // SAFETY: both descriptors are open for the duration of the call and the offset
            // pointers point at live locals; the kernel reads/writes only those.
            let r = unsafe {
                libc::copy_file_range(
                    f.as_raw_fd(),
                    &mut off_in,
                    out.as_raw_fd(),
                    &mut off_out,
                    want,
                    0,
                )
            };
            if r < 0 {
                let err = std::io::Error::last_os_error();
                match err.raw_os_error() {
                    // Not supported here (old kernel, cross-filesystem, special files): fall back.
                    Some(libc::ENOSYS | libc::EXDEV | libc::EOPNOTSUPP | libc::EINVAL)
                    | Some(libc::EBADF | libc::EPERM) => break,
                    Some(libc::EINTR) => continue,
                    _ => return Err(Error::io(out_path, "copy_file_range", err)),
                }
            }
            if r == 0 {
                return Err(source_err(format!(
                    "file ended after {} of {len} bytes (it shrank while being copied)",
                    done
                )));
            }
            done += r as u64;
            in_kernel += r as u64;
        }
    }
    let buffered_start = done;
    if done < len {
        buf.resize(COPY_BUF, 0);
        while done < len {
            let n = ((len - done) as usize).min(COPY_BUF);
            f.read_exact_at(&mut buf[..n], offset + done)
                .map_err(|e| source_err(format!("read failed at {}: {e}", offset + done)))?;
            out.write_all_at(&buf[..n], pos + done)
                .map_err(|e| Error::io(out_path, "write segment", e))?;
            done += n as u64;
        }
    }
    Ok((in_kernel, done - buffered_start))
}
