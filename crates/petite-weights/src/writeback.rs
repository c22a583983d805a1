//! Write-behind for streamed output files: writeback of each written range starts at once, and
//! once a few newer ranges follow it is awaited and its pages dropped from the page cache, so
//! dirty and cached output stays a few ranges however large the file (one 8 GB pool on a
//! Jetson holds both the page cache and the model).

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Ranges of one file written but not yet retired. Used by the converter, the synthetic
/// checkpoint writer and the portable mapping file; one per writing thread.
///
/// It borrows the file's descriptor, so the file stays open (and its number cannot be reused by
/// another file) for as long as this value lives.
#[derive(Debug)]
pub struct WriteBehind<'fd> {
    fd: BorrowedFd<'fd>,
    depth: usize,
    pending: VecDeque<(u64, u64)>,
}

impl<'fd> WriteBehind<'fd> {
    /// Write-behind on `fd`, retiring a range once `depth` newer ones are pending.
    pub fn new(fd: BorrowedFd<'fd>, depth: usize) -> WriteBehind<'fd> {
        WriteBehind {
            fd,
            depth,
            pending: VecDeque::new(),
        }
    }

    /// Records `len` bytes written at `off`: starts their writeback and retires the oldest
    /// ranges beyond `depth`.
    pub fn push(&mut self, off: u64, len: u64) {
        // SAFETY: sync_file_range takes no pointers; `self.fd` is borrowed, so it is open and
        // names the caller's file for the whole call. Errors (a range beyond the file, an
        // offset the casts turned negative) only cost the early writeback, so they are ignored;
        // the writer's final fsync reports real I/O errors.
        unsafe {
            libc::sync_file_range(
                self.fd.as_raw_fd(),
                off as i64,
                len as i64,
                libc::SYNC_FILE_RANGE_WRITE,
            );
        }
        self.pending.push_back((off, len));
        while self.pending.len() > self.depth {
            self.retire();
        }
    }

    /// Retires every pending range (also done on drop).
    pub fn finish(&mut self) {
        while !self.pending.is_empty() {
            self.retire();
        }
    }

    /// Awaits the oldest range's writeback and evicts its pages.
    fn retire(&mut self) {
        if let Some((off, len)) = self.pending.pop_front() {
            // SAFETY: as in `push`: no pointers, a borrowed (so open) fd, errors ignored on
            // purpose (posix_fadvise only advises; failing, it leaves pages cached).
            unsafe {
                libc::sync_file_range(
                    self.fd.as_raw_fd(),
                    off as i64,
                    len as i64,
                    libc::SYNC_FILE_RANGE_WAIT_BEFORE
                        | libc::SYNC_FILE_RANGE_WRITE
                        | libc::SYNC_FILE_RANGE_WAIT_AFTER,
                );
                libc::posix_fadvise(
                    self.fd.as_raw_fd(),
                    off as i64,
                    len as i64,
                    libc::POSIX_FADV_DONTNEED,
                );
            }
        }
    }
}

impl Drop for WriteBehind<'_> {
    fn drop(&mut self) {
        self.finish();
    }
}
