//! Reading a `.pte`: header, flatbuffer (verified), structural checks, and segment access by
//! region. Only the flatbuffer region is read into memory; segments stay in the file.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::header::{self, Layout};
use crate::model::Program;
use crate::{Error, Result, decode, verify};

/// The largest flatbuffer region accepted (flatbuffers' own limit).
const MAX_PROGRAM_SIZE: u64 = (1 << 31) - 1;
/// Bytes read to parse the header.
const HEAD_LEN: usize = 64;

/// Parses, verifies and checks a whole `.pte` held in memory (tests, fuzzing, small files).
pub fn read_bytes(bytes: &[u8]) -> Result<(Program, Layout)> {
    let head = &bytes[..bytes.len().min(HEAD_LEN)];
    let layout = header::parse(head, bytes.len() as u64)?;
    if layout.program_size > MAX_PROGRAM_SIZE {
        return Err(Error::invalid(format!(
            "flatbuffer region of {} bytes exceeds the 2 GiB flatbuffer limit",
            layout.program_size
        )));
    }
    let program = decode::decode_program(&bytes[..layout.program_size as usize])?;
    verify::verify_program(&program)?;
    verify::verify_layout(&program, &layout)?;
    Ok((program, layout))
}

/// An open, verified `.pte` file.
#[derive(Debug)]
pub struct PteFile {
    path: PathBuf,
    file: File,
    layout: Layout,
    program: Program,
}

impl PteFile {
    /// Opens and fully verifies `path`; segment bytes are not read.
    pub fn open(path: impl AsRef<Path>) -> Result<PteFile> {
        let path = path.as_ref();
        Self::open_inner(path).map_err(|e| e.in_file(path))
    }

    fn open_inner(path: &Path) -> Result<PteFile> {
        let file = File::open(path).map_err(|e| Error::io(path, "open", e))?;
        let file_len = file
            .metadata()
            .map_err(|e| Error::io(path, "stat", e))?
            .len();
        let mut head = vec![0u8; (file_len as usize).min(HEAD_LEN)];
        file.read_exact_at(&mut head, 0)
            .map_err(|e| Error::io(path, "read header", e))?;
        let layout = header::parse(&head, file_len)?;
        if layout.program_size > MAX_PROGRAM_SIZE {
            return Err(Error::invalid(format!(
                "flatbuffer region of {} bytes exceeds the 2 GiB flatbuffer limit{}",
                layout.program_size,
                if layout.header.is_none() {
                    " (a file this large needs an eh00 header and segments)"
                } else {
                    ""
                }
            )));
        }
        let mut fb = vec![0u8; layout.program_size as usize];
        file.read_exact_at(&mut fb, 0)
            .map_err(|e| Error::io(path, "read program", e))?;
        let program = decode::decode_program(&fb)?;
        verify::verify_program(&program)?;
        verify::verify_layout(&program, &layout)?;
        Ok(PteFile {
            path: path.to_path_buf(),
            file,
            layout,
            program,
        })
    }

    /// The decoded program.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// Header and layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Absolute file offset and size of segment `i`.
    pub fn segment_range(&self, i: usize) -> Result<(u64, u64)> {
        let s = self.program.segments.get(i).ok_or_else(|| {
            Error::invalid(format!(
                "segment {i} is out of range ({} segments)",
                self.program.segments.len()
            ))
        })?;
        Ok((self.layout.segment_base_offset + s.offset, s.size))
    }

    /// The segment index a named-data key points at.
    pub fn named_segment(&self, key: &str) -> Option<usize> {
        self.program
            .named_data
            .as_ref()?
            .iter()
            .find(|n| n.key == key)
            .map(|n| n.segment_index as usize)
    }

    /// Reads `buf.len()` bytes of segment `i` starting at `offset` within the segment.
    pub fn read_segment_at(&self, i: usize, offset: u64, buf: &mut [u8]) -> Result<()> {
        let (start, size) = self.segment_range(i)?;
        if offset
            .checked_add(buf.len() as u64)
            .is_none_or(|e| e > size)
        {
            return Err(Error::invalid(format!(
                "read of {} bytes at {offset} runs past segment {i} ({size} bytes)",
                buf.len()
            )));
        }
        self.file
            .read_exact_at(buf, start + offset)
            .map_err(|e| Error::io(&self.path, "read segment", e))
    }

    /// Streams segment `i` into `out` through a bounded buffer; returns the bytes copied.
    pub fn copy_segment(&self, i: usize, out: &mut impl Write) -> Result<u64> {
        let (_, size) = self.segment_range(i)?;
        let mut buf = vec![0u8; (1 << 20).min(size as usize)];
        let mut done = 0u64;
        while done < size {
            let n = ((size - done) as usize).min(buf.len());
            self.read_segment_at(i, done, &mut buf[..n])?;
            out.write_all(&buf[..n])
                .map_err(|e| Error::io(&self.path, "write segment copy", e))?;
            done += n as u64;
        }
        Ok(done)
    }
}
