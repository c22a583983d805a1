//! A mapped source truncated by another process while it is mapped (issue 13): a read of its
//! vanished pages is a one-line error naming the file with exit code 74 (SIGBUS, handled), a
//! system call given those pages fails as `Error::Changed` naming it (EFAULT), and
//! `check_unchanged` tells a resized or rewritten file from the one that was opened.
//! Its own test binary: it installs the process-wide SIGBUS handler and forks.

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;

use petite_weights::{
    Dtype, Error, MappedSafetensors, Role, SafetensorsWriter, TensorSpec, WeightSource, fault,
};

/// A file with one 64 KiB f32 tensor `w`, its data starting at 4096 (the header's page).
fn write_source(path: &Path) {
    let t = [TensorSpec::new("w", Dtype::F32, &[16 * 1024])];
    let w = SafetensorsWriter::create(path, &t, &[]).unwrap();
    w.write_at("w", 0, &vec![0x3f; 64 * 1024]).unwrap();
    w.finish().unwrap();
}

#[test]
fn truncated_source_reads_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ck.safetensors");
    write_source(&path);
    let src = MappedSafetensors::open_as(&path, Role::Checkpoint).unwrap();
    src.check_unchanged().unwrap();
    let view = src.tensor("w").unwrap();
    assert_eq!(view.bytes[100], 0x3f);
    let at = view.bytes.as_ptr() as usize - 4096;
    assert_eq!(
        fault::mapped_file_at(at + 4196),
        Some((path.clone(), Role::Checkpoint))
    );

    // Another process truncates it to its header.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let e = src.check_unchanged().unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "checkpoint changed or truncated while it was being read: {} (size 69632 → 4096 \
             bytes); nothing built from it was published; re-run once it is stable",
            path.display()
        )
    );

    // A write from the vanished pages: the kernel cannot read them (EFAULT), no signal.
    let out = dir.path().join("out.safetensors");
    let w = SafetensorsWriter::create(&out, &[TensorSpec::new("w", Dtype::F32, &[16 * 1024])], &[])
        .unwrap();
    match w.write_at("w", 0, view.bytes) {
        Err(Error::Changed { role, file, what }) => {
            assert_eq!(role, "checkpoint");
            assert_eq!(file, path.display().to_string());
            assert!(what.contains("EFAULT"), "{what}");
        }
        other => panic!("expected Changed, got {other:?}"),
    }
    drop(w);
    assert!(!out.exists());

    // A plain read of them: SIGBUS, handled. In a forked child (the handler ends the process),
    // whose stderr is a pipe; the child only calls dup2 and reads one byte before the handler.
    fault::install_sigbus_handler();
    let mut fds = [0; 2];
    // SAFETY: `fds` is a live array of two ints, as pipe needs.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let byte = &view.bytes[100] as *const u8;
    // SAFETY: fork in a test process; the child does only async-signal-safe work (dup2, a
    // volatile read whose SIGBUS the installed handler turns into write + _exit) and never
    // returns into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: child side: valid descriptors from pipe; the read faults (the page is gone),
        // the handler exits. `_exit(1)` only runs if it did not fault.
        unsafe {
            libc::dup2(fds[1], 2);
            std::ptr::read_volatile(byte);
            libc::_exit(1);
        }
    }
    // SAFETY: parent side: close our copy of the write end; own the read end.
    unsafe { libc::close(fds[1]) };
    let mut rd = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fds[0]) });
    let mut msg = String::new();
    rd.read_to_string(&mut msg).unwrap();
    let mut status = 0;
    // SAFETY: waits for our own child; `status` is a live int.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child status {status:#x}: {msg}");
    assert_eq!(libc::WEXITSTATUS(status), fault::EXIT_CODE, "{msg}");
    assert_eq!(
        msg,
        format!(
            "petite: error: checkpoint changed or truncated while it was being read: {} \
             (SIGBUS reading byte 4196: the file is shorter than when it was opened, or its \
             device failed; nothing was published; re-run once it is stable)\n",
            path.display()
        )
    );
}

#[test]
fn a_source_rewritten_in_place_or_replaced_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ck.safetensors");
    write_source(&path);
    let src = MappedSafetensors::open(&path).unwrap();
    // Same size, new modification time (another tool rewrote it).
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(5))
        .unwrap();
    let e = src.check_unchanged().unwrap_err().to_string();
    assert!(
        e.starts_with("mapped file changed or truncated while it was being read: "),
        "{e}"
    );
    assert!(e.contains("modified in place"), "{e}");
    // Replaced by another file under the same name.
    let src = MappedSafetensors::open(&path).unwrap();
    let other = dir.path().join("other.safetensors");
    write_source(&other);
    std::fs::rename(&other, &path).unwrap();
    let e = src.check_unchanged().unwrap_err().to_string();
    assert!(e.contains("replaced"), "{e}");
}
