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
    // SAFETY: neither call takes a pointer; `fd` comes from the borrowed `file`, so it is open
    // and names that file for the whole call. Errors are ignored on purpose (see above).
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

/// How a measured child process ended: its exit status, its peak RSS and its wall time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChildRun {
    /// Exit status as `waitpid` reports it.
    pub status: std::process::ExitStatus,
    /// The child's peak resident set (`ru_maxrss` from `wait4`), in bytes.
    pub peak_rss_bytes: u64,
    /// Wall-clock seconds from spawn to exit.
    pub seconds: f64,
}

/// Runs `cmd` to completion and reaps it with `wait4`, so the child's own peak RSS comes back
/// with its status (a builder's memory is measured where it is spent, not guessed).
/// `stdin`, if given, is written to the child's standard input and closed (the TensorRT-RTX
/// driver arrives that way).
pub(crate) fn run_measured(
    cmd: &mut std::process::Command,
    stdin: Option<&[u8]>,
) -> std::io::Result<ChildRun> {
    use std::io::Write;
    use std::os::unix::process::ExitStatusExt;
    let t = std::time::Instant::now();
    cmd.stdin(if stdin.is_some() {
        std::process::Stdio::piped()
    } else {
        std::process::Stdio::null()
    });
    let mut child = cmd.spawn()?;
    if let (Some(bytes), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // A child that exits without reading gives EPIPE: its status tells what happened.
        let _ = pipe.write_all(bytes);
    }
    let pid = child.id() as libc::pid_t;
    let mut status: libc::c_int = 0;
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: `pid` is our own un-reaped child (std's `Child` never waited on it); the
        // pointers are to live locals of the right types.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if r == pid {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    // The child is reaped: dropping `Child` does not wait again.
    drop(child);
    Ok(ChildRun {
        status: std::process::ExitStatus::from_raw(status),
        peak_rss_bytes: (usage.ru_maxrss.max(0) as u64) * 1024,
        seconds: t.elapsed().as_secs_f64(),
    })
}
