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
    // whose stderr is a pipe.
    fault::install_sigbus_handler();
    let byte = &view.bytes[100] as *const u8;
    // SAFETY: the read faults (the page is gone) and the handler ends the child.
    let (status, msg) = in_child(|| unsafe {
        std::ptr::read_volatile(byte);
    });
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

/// Runs `f` in a forked child whose stderr is a pipe; returns (wait status, what it wrote).
/// `f` must end the process (a handled SIGBUS, a signal, `_exit`).
fn in_child(f: impl FnOnce()) -> (i32, String) {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a live array of two ints, as pipe needs.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: fork in a test process; the child does only async-signal-safe work in `f` and
    // never returns into the test harness (`_exit(1)` if `f` returns).
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: child side: valid descriptors from pipe.
        unsafe { libc::dup2(fds[1], 2) };
        f();
        // SAFETY: ends the child without running the harness.
        unsafe { libc::_exit(1) };
    }
    // SAFETY: parent side: close our copy of the write end; own the read end.
    unsafe { libc::close(fds[1]) };
    let mut rd = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fds[0]) });
    let mut msg = String::new();
    rd.read_to_string(&mut msg).unwrap();
    let mut status = 0;
    // SAFETY: waits for our own child; `status` is a live int.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    (status, msg)
}

/// 200 engine files mapped at once (more than the table's first chunk; verify maps each engine
/// segment of a `.pte` separately): a truncated one is still a one-line error naming it, not a
/// crash. Before the table grew, mappings past its 128 fixed slots were not listed and their
/// SIGBUS killed the process.
#[test]
fn a_fault_in_the_two_hundredth_mapping_names_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let maps: Vec<MappedSafetensors> = (0..200)
        .map(|i| {
            let p = dir.path().join(format!("engine-{i:03}.safetensors"));
            write_source(&p);
            MappedSafetensors::open_as(&p, Role::EngineFile).unwrap()
        })
        .collect();
    assert!(fault::capacity() >= 200);
    let last = dir.path().join("engine-199.safetensors");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&last)
        .unwrap()
        .set_len(4096)
        .unwrap();
    fault::install_sigbus_handler();
    let byte = &maps[199].tensor("w").unwrap().bytes[8] as *const u8;
    // SAFETY: the read faults (the page is gone) and the handler ends the child.
    let (status, msg) = in_child(|| unsafe {
        std::ptr::read_volatile(byte);
    });
    assert!(libc::WIFEXITED(status), "child status {status:#x}: {msg}");
    assert_eq!(libc::WEXITSTATUS(status), fault::EXIT_CODE, "{msg}");
    assert!(
        msg.starts_with(&format!(
            "petite: error: engine file changed or truncated while it was being read: {} \
             (SIGBUS reading byte 4104:",
            last.display()
        )),
        "{msg}"
    );
    assert_eq!(msg.lines().count(), 1, "{msg}");
}

/// A SIGBUS that is not a mapped-file fault (sent with `kill`, `si_code` SI_USER) is not
/// explained as one: it goes to the action before ours (here Rust's own stack-overflow handler,
/// which restores the default action and returns), so the child either goes on or dies of
/// SIGBUS, but never prints petite's message or exits with 74.
#[test]
fn a_sigbus_sent_by_kill_is_not_ours() {
    fault::install_sigbus_handler();
    // SAFETY: raise is async-signal-safe.
    let (status, msg) = in_child(|| unsafe {
        libc::raise(libc::SIGBUS);
    });
    let ours = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == fault::EXIT_CODE;
    assert!(!ours, "child status {status:#x}: {msg}");
    assert!(
        (libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 1)
            || (libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGBUS),
        "child status {status:#x}: {msg}"
    );
    assert!(msg.is_empty(), "{msg}");
}

/// An action installed before petite's handler (a runtime's crash reporter, say) still gets
/// what is not ours. Runs in a fresh process (this test binary re-run on this test alone),
/// because the handler is installed once per process.
#[test]
fn an_earlier_sigbus_handler_is_chained() {
    const CHILD: &str = "PETITE_SIGBUS_CHAIN_CHILD";
    if std::env::var_os(CHILD).is_some() {
        extern "C" fn earlier(_: libc::c_int) {
            let m = b"earlier handler ran\n";
            // SAFETY: write and _exit are async-signal-safe; `m` is a live buffer.
            unsafe {
                libc::write(2, m.as_ptr() as *const libc::c_void, m.len());
                libc::_exit(42);
            }
        }
        // SAFETY: installs a one-argument handler with a zeroed, initialised sigaction.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = earlier as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
        }
        fault::install_sigbus_handler();
        // SAFETY: raise is async-signal-safe; our handler chains to `earlier`, which exits.
        unsafe { libc::raise(libc::SIGBUS) };
        unreachable!("the earlier handler exits");
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "an_earlier_sigbus_handler_is_chained",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(42), "{err}");
    assert!(err.contains("earlier handler ran"), "{err}");
}
