//! Small Linux helpers: per-engine peak memory and keeping written output out of the page cache.

use std::fs::File;
use std::os::fd::AsRawFd;

/// Resets this process's peak RSS (`VmHWM`) so the next reading is the peak of what follows
/// (`/proc/self/clear_refs`, value 5, Linux ≥ 4.0). Returns false where that is not possible.
pub(crate) fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", b"5").is_ok()
}

/// Writes back `[offset, offset + len)` of `file` and drops it from the page cache, so a
/// multi-GiB output does not sit in memory as dirty or cached pages (under a memory cgroup
/// they are charged to the writer). Best effort: errors are ignored, the data is already written.
pub(crate) fn flush_and_drop(file: &File, offset: u64, len: u64) {
    if len == 0 {
        return;
    }
    let fd = file.as_raw_fd();
    // SAFETY: plain syscalls on an fd we own; no memory is passed.
    unsafe {
        libc::sync_file_range(
            fd,
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WAIT_BEFORE
                | libc::SYNC_FILE_RANGE_WRITE
                | libc::SYNC_FILE_RANGE_WAIT_AFTER,
        );
        libc::posix_fadvise(
            fd,
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        );
    }
}
