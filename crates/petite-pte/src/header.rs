//! The `eh00` extended header (format doc §2): inserted into the finished flatbuffer right after
//! its 8-byte prefix, it tells the runtime where the flatbuffer ends and the segments begin.

use crate::{Error, Result};

/// Magic at byte 8.
pub const MAGIC: &[u8; 4] = b"eh00";
/// Header length written (and counted by `program_size`).
pub const HEADER_LEN: u32 = 32;
/// Bytes inserted into the flatbuffer: the header padded to the schema's max alignment (16).
pub const PADDED_HEADER_LEN: usize = 32;
/// ExecuTorch's default segment alignment.
pub const SEGMENT_ALIGNMENT: u64 = 128;
/// Smallest header length the runtime accepts.
const MIN_HEADER_LEN: u32 = 24;

/// The fields of the extended header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtendedHeader {
    /// The header length field (32 when written by EXIR or petite).
    pub header_len: u32,
    /// Size of the flatbuffer region from offset 0, both headers included.
    pub program_size: u64,
    /// File offset of the first segment.
    pub segment_base_offset: u64,
    /// Bytes from the segment base to the end of the last segment (`None` if `header_len < 32`).
    pub segment_data_size: Option<u64>,
}

/// Where the flatbuffer and the segments are in a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The extended header, if the file has one.
    pub header: Option<ExtendedHeader>,
    /// End of the flatbuffer region (the whole file when there is no header).
    pub program_size: u64,
    /// File offset segments are relative to (0 without a header).
    pub segment_base_offset: u64,
    /// File size.
    pub file_len: u64,
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Parses the start of a file (`head` = its first ≥ 40 bytes, or the whole file if shorter) and
/// checks the header against the file size. Refuses what the runtime would silently misread.
pub fn parse(head: &[u8], file_len: u64) -> Result<Layout> {
    if head.len() < 8 || file_len < 8 {
        return Err(Error::Truncated {
            what: "program header".into(),
            len: file_len.min(head.len() as u64),
            need: 8,
        });
    }
    if &head[4..8] != b"ET12" {
        return Err(Error::Identifier {
            found: head[4..8].try_into().expect("4 bytes"),
        });
    }
    let root = u32_at(head, 0) as u64;
    if head.len() < 12 || &head[8..12] != MAGIC {
        if root >= file_len {
            return Err(Error::invalid(format!(
                "root table offset {root} lies outside the {file_len}-byte file"
            )));
        }
        return Ok(Layout {
            header: None,
            program_size: file_len,
            segment_base_offset: 0,
            file_len,
        });
    }
    if head.len() < 40 {
        return Err(Error::Truncated {
            what: "extended header".into(),
            len: head.len() as u64,
            need: 40,
        });
    }
    let header_len = u32_at(head, 12);
    if header_len < MIN_HEADER_LEN {
        return Err(Error::Header(format!(
            "header length {header_len} is below the minimum {MIN_HEADER_LEN}"
        )));
    }
    let program_size = u64_at(head, 16);
    let segment_base_offset = u64_at(head, 24);
    let segment_data_size = (header_len >= 32).then(|| u64_at(head, 32));
    let h = ExtendedHeader {
        header_len,
        program_size,
        segment_base_offset,
        segment_data_size,
    };
    let min_program = 8 + header_len as u64;
    if program_size < min_program {
        return Err(Error::Header(format!(
            "program_size {program_size} is smaller than the headers themselves ({min_program} bytes)"
        )));
    }
    if program_size > file_len {
        return Err(Error::Truncated {
            what: format!("file (eh00 program_size {program_size} exceeds the file size)"),
            len: file_len,
            need: program_size,
        });
    }
    if root < min_program || root >= program_size {
        return Err(Error::Header(format!(
            "root table offset {root} is not inside the flatbuffer after the header ({min_program}..{program_size})"
        )));
    }
    let data = segment_data_size.unwrap_or(0);
    if segment_base_offset != 0 || data != 0 {
        if segment_base_offset < program_size {
            return Err(Error::Header(format!(
                "segment_base_offset {segment_base_offset} lies inside the flatbuffer (program_size {program_size})"
            )));
        }
        let end = segment_base_offset.checked_add(data).ok_or_else(|| {
            Error::Header(format!(
                "segment_base_offset {segment_base_offset} + segment_data_size {data} overflows"
            ))
        })?;
        if end > file_len {
            return Err(Error::Truncated {
                what: format!(
                    "file (eh00: segments end at {end}, base {segment_base_offset} + {data} bytes)"
                ),
                len: file_len,
                need: end,
            });
        }
    }
    Ok(Layout {
        header: Some(h),
        program_size,
        segment_base_offset,
        file_len,
    })
}

/// Inserts the extended header into a finished flatbuffer `fb` (identifier at 4..8): the root
/// offset at byte 0 grows by the inserted length; nothing else moves relative to what it points at.
pub fn insert(fb: &[u8], segment_base_offset: u64, segment_data_size: u64) -> Vec<u8> {
    let program_size = (fb.len() + PADDED_HEADER_LEN) as u64;
    let mut out = Vec::with_capacity(fb.len() + PADDED_HEADER_LEN);
    let root = u32_at(fb, 0) + PADDED_HEADER_LEN as u32;
    out.extend_from_slice(&root.to_le_bytes());
    out.extend_from_slice(&fb[4..8]);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&HEADER_LEN.to_le_bytes());
    out.extend_from_slice(&program_size.to_le_bytes());
    out.extend_from_slice(&segment_base_offset.to_le_bytes());
    out.extend_from_slice(&segment_data_size.to_le_bytes());
    out.resize(8 + PADDED_HEADER_LEN, 0);
    out.extend_from_slice(&fb[8..]);
    out
}

/// Rounds `x` up to a multiple of `a` (a power of two or any positive value).
pub fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Least common multiple (for a segment whose own alignment exceeds the default).
pub fn lcm(a: u64, b: u64) -> u64 {
    fn gcd(mut a: u64, mut b: u64) -> u64 {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    }
    a / gcd(a, b) * b
}
