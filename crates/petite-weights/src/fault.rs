//! Mapped files that change under the process: a SIGBUS becomes a one-line error naming the file.
//!
//! Reading a page of a `MAP_SHARED` file mapping that lies past the file's current end (another
//! process truncated it) or whose device failed raises SIGBUS, which by default kills the
//! process with no message (exit 135, "Bus error"). Every mapping this crate makes registers its
//! address range, its path and its [`Role`] in a fixed process-wide table ([`Registration`],
//! removed on drop); [`install_sigbus_handler`] (the `petite` binary calls it once at start)
//! installs a handler that looks the faulting address up, writes
//!
//! ```text
//! petite: error: checkpoint changed or truncated while it was being read: PATH (...)
//! ```
//!
//! to stderr with `write(2)` and ends the process with `_exit(`[`EXIT_CODE`]`)` (74, `EX_IOERR`
//! of `sysexits.h`). The handler only loads atomics, formats into a stack buffer and calls the
//! async-signal-safe `write`, `sigaction` and `_exit`: no allocation, no lock, and it removes
//! nothing, so temporary files stay where they were (every writer's temporary name is fixed or
//! cleared by the next run, which overwrites it). A SIGBUS at an address no registration covers
//! is not ours to explain: the handler restores the default action and returns, so the fault
//! repeats and the process dies of SIGBUS as before (a core for a real bug).

use std::path::Path;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicUsize, Ordering};

/// Exit code of a process ended by a SIGBUS on a registered mapping (`EX_IOERR`). `petite`
/// also exits with it when an input's identity changed between stage boundaries, so both ways
/// an input can change under an export end alike.
pub const EXIT_CODE: i32 = 74;

/// What a mapped file is, for the message ("checkpoint changed or truncated ...").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// Any mapped file.
    File = 0,
    /// A checkpoint file or shard.
    Checkpoint = 1,
    /// A mapping file (the converted weight cache).
    MappingFile = 2,
    /// An engine file.
    EngineFile = 3,
    /// A `.pte` program.
    Program = 4,
}

impl Role {
    const ALL: [Role; 5] = [
        Role::File,
        Role::Checkpoint,
        Role::MappingFile,
        Role::EngineFile,
        Role::Program,
    ];

    /// The role's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Role::File => "mapped file",
            Role::Checkpoint => "checkpoint",
            Role::MappingFile => "mapping file",
            Role::EngineFile => "engine file",
            Role::Program => ".pte program",
        }
    }

    fn from_u8(v: u8) -> Role {
        Role::ALL.get(v as usize).copied().unwrap_or(Role::File)
    }
}

/// Slots in the table: the mappings alive at once (checkpoint shards, the mapping file, an
/// engine file or two, two `.pte` files). A mapping made while every slot is taken still works;
/// only its SIGBUS keeps the default action.
const SLOTS: usize = 128;
/// Path bytes kept per slot; a longer path is shown cut, ending in "...".
const PATH_BYTES: usize = 512;

const FREE: u32 = 0;
const BUSY: u32 = 1;
const LIVE: u32 = 2;

/// One registered mapping. Every field is atomic so that the handler, which may interrupt any
/// thread at any point (including one registering or dropping a mapping), never reads memory
/// another thread is writing non-atomically. `state` orders it: fields are written while BUSY
/// and published by the Release store of LIVE; the handler reads them after an Acquire load of
/// LIVE.
struct Slot {
    state: AtomicU32,
    start: AtomicUsize,
    len: AtomicUsize,
    role: AtomicU8,
    path_len: AtomicUsize,
    path: [AtomicU8; PATH_BYTES],
}

impl Slot {
    const fn new() -> Slot {
        Slot {
            state: AtomicU32::new(FREE),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            role: AtomicU8::new(0),
            path_len: AtomicUsize::new(0),
            path: [const { AtomicU8::new(0) }; PATH_BYTES],
        }
    }
}

static TABLE: [Slot; SLOTS] = [const { Slot::new() }; SLOTS];
/// Registrations refused because every slot was taken (for tests and diagnostics).
static OVERFLOWS: AtomicUsize = AtomicUsize::new(0);
/// Set by the first thread whose fault the handler explains.
static REPORTED: AtomicBool = AtomicBool::new(false);
/// Whether stderr was a terminal when the handler was installed (a progress bar may be mid-line:
/// the message then starts on a new line).
static STDERR_TTY: AtomicBool = AtomicBool::new(false);

/// A mapping's entry in the table, removed on drop. Drop it before unmapping (declare it
/// before the mapping in a struct: fields drop in order), so the range is never listed for
/// memory that another mapping may reuse.
#[derive(Debug)]
pub struct Registration {
    slot: Option<usize>,
}

impl Registration {
    /// Registers `len` bytes at `start` as a mapping of `path` in `role`. Never fails: with
    /// every slot taken the mapping is simply not listed.
    pub fn new(start: *const u8, len: usize, path: &Path, role: Role) -> Registration {
        if len == 0 {
            return Registration { slot: None };
        }
        for (i, s) in TABLE.iter().enumerate() {
            if s.state
                .compare_exchange(FREE, BUSY, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                s.start.store(start as usize, Ordering::Relaxed);
                s.len.store(len, Ordering::Relaxed);
                s.role.store(role as u8, Ordering::Relaxed);
                let bytes = path.as_os_str().as_encoded_bytes();
                let n = bytes.len().min(PATH_BYTES);
                for (d, &b) in s.path.iter().zip(bytes) {
                    d.store(b, Ordering::Relaxed);
                }
                if bytes.len() > PATH_BYTES {
                    for d in &s.path[PATH_BYTES - 3..] {
                        d.store(b'.', Ordering::Relaxed);
                    }
                }
                s.path_len.store(n, Ordering::Relaxed);
                s.state.store(LIVE, Ordering::Release);
                return Registration { slot: Some(i) };
            }
        }
        OVERFLOWS.fetch_add(1, Ordering::Relaxed);
        Registration { slot: None }
    }

    /// Whether the mapping is listed (false only when every slot was taken).
    pub fn is_listed(&self) -> bool {
        self.slot.is_some()
    }

    /// Changes the role shown for this mapping.
    pub fn set_role(&self, role: Role) {
        if let Some(i) = self.slot {
            TABLE[i].role.store(role as u8, Ordering::Relaxed);
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            let s = &TABLE[i];
            s.state.store(BUSY, Ordering::Release);
            s.start.store(0, Ordering::Relaxed);
            s.len.store(0, Ordering::Relaxed);
            s.state.store(FREE, Ordering::Release);
        }
    }
}

/// The registered mapping holding `addr`, as (path, role); for ordinary (non-signal) code.
pub fn mapped_file_at(addr: usize) -> Option<(std::path::PathBuf, Role)> {
    let (s, _) = lookup(addr)?;
    let n = s.path_len.load(Ordering::Relaxed).min(PATH_BYTES);
    let bytes: Vec<u8> = s.path[..n]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .collect();
    let path = std::path::PathBuf::from(std::ffi::OsString::from(
        String::from_utf8_lossy(&bytes).into_owned(),
    ));
    Some((path, Role::from_u8(s.role.load(Ordering::Relaxed))))
}

/// What a system call that failed with `e` while reading `buf` means when `buf` lies in a
/// registered mapping and `e` is `EFAULT`: the kernel could not read the mapped pages, i.e. the
/// mapped file was truncated under the process (the syscall's form of the SIGBUS a plain read
/// gets). `Some(Error::Changed)` naming the mapped file then; `None` otherwise.
pub fn efault_on_mapped(e: &std::io::Error, buf: &[u8]) -> Option<crate::Error> {
    if e.raw_os_error() != Some(libc::EFAULT) {
        return None;
    }
    let (path, role) = mapped_file_at(buf.as_ptr() as usize)?;
    Some(crate::Error::Changed {
        role: role.name(),
        file: path.display().to_string(),
        what: "reading its mapped bytes failed with EFAULT: the file is shorter than when it \
               was opened"
            .into(),
    })
}

/// Registrations refused so far because the table was full.
pub fn overflows() -> usize {
    OVERFLOWS.load(Ordering::Relaxed)
}

/// A fixed buffer the handler formats into (no allocation).
struct Buf {
    b: [u8; 1024],
    n: usize,
}

impl Buf {
    fn push(&mut self, s: &[u8]) {
        for &c in s {
            if self.n < self.b.len() {
                self.b[self.n] = c;
                self.n += 1;
            }
        }
    }

    fn push_num(&mut self, mut v: usize) {
        let mut d = [0u8; 20];
        let mut i = d.len();
        loop {
            i -= 1;
            d[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.push(&d[i..]);
    }
}

/// The message for a fault at byte `offset` of slot `s`'s mapping (into `out`).
fn message(s: &Slot, offset: usize, out: &mut Buf) {
    if STDERR_TTY.load(Ordering::Relaxed) {
        out.push(b"\n");
    }
    out.push(b"petite: error: ");
    out.push(
        Role::from_u8(s.role.load(Ordering::Relaxed))
            .name()
            .as_bytes(),
    );
    out.push(b" changed or truncated while it was being read: ");
    let n = s.path_len.load(Ordering::Relaxed).min(PATH_BYTES);
    for c in &s.path[..n] {
        out.push(&[c.load(Ordering::Relaxed)]);
    }
    out.push(b" (SIGBUS reading byte ");
    out.push_num(offset);
    out.push(b": the file is shorter than when it was opened, or its device failed; nothing was published; re-run once it is stable)\n");
}

/// The registered mapping holding `addr`: its slot and the byte's offset in it.
fn lookup(addr: usize) -> Option<(&'static Slot, usize)> {
    for s in &TABLE {
        if s.state.load(Ordering::Acquire) != LIVE {
            continue;
        }
        let (start, len) = (
            s.start.load(Ordering::Relaxed),
            s.len.load(Ordering::Relaxed),
        );
        if addr >= start && addr - start < len {
            return Some((s, addr - start));
        }
    }
    None
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for a handler installed with SA_SIGINFO;
    // `si_addr` reads the faulting address field of a SIGBUS's siginfo.
    let addr = unsafe { (*info).si_addr() } as usize;
    match lookup(addr) {
        Some(_) if REPORTED.swap(true, Ordering::SeqCst) => {
            // Another thread faulted first and is writing the message and exiting: one line,
            // not one per thread. Wait for the exit (pause is async-signal-safe).
            loop {
                // SAFETY: pause takes no arguments; the process ends in the other thread's
                // `_exit`.
                unsafe { libc::pause() };
            }
        }
        Some((s, off)) => {
            let mut m = Buf { b: [0; 1024], n: 0 };
            message(s, off, &mut m);
            let mut done = 0;
            while done < m.n {
                // SAFETY: write(2) is async-signal-safe; the pointer and length lie within the
                // stack buffer `m`.
                let w = unsafe {
                    libc::write(
                        2,
                        m.b[done..m.n].as_ptr() as *const libc::c_void,
                        m.n - done,
                    )
                };
                if w <= 0 {
                    break;
                }
                done += w as usize;
            }
            // SAFETY: _exit is async-signal-safe and ends the process at once (no destructors,
            // no atexit handlers, no stdio flush: nothing that could lock or allocate).
            unsafe { libc::_exit(EXIT_CODE) }
        }
        None => {
            // Not a registered mapping: restore the default action; returning re-executes the
            // faulting access, which now kills the process with SIGBUS as if no handler existed.
            // SAFETY: sigaction is async-signal-safe; `sa` is a live, fully initialised local.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = libc::SIG_DFL;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
            }
        }
    }
}

/// Installs the SIGBUS handler (once per process; later calls do nothing). Binaries call it
/// at start; a library never installs it on its own.
pub fn install_sigbus_handler() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: isatty takes no pointers.
        STDERR_TTY.store(unsafe { libc::isatty(2) } == 1, Ordering::Relaxed);
        // SAFETY: installs `on_sigbus`, which only does async-signal-safe work (see the module
        // docs), with a zeroed then initialised sigaction; SA_SIGINFO selects the three-argument
        // form that `on_sigbus` has. SIGBUS stays blocked while it runs (no SA_NODEFER), so a
        // fault inside the handler gets the kernel's default action instead of recursing.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigbus as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_finds_registered_ranges_and_forgets_dropped_ones() {
        let a = [0u8; 64];
        let r = Registration::new(
            a.as_ptr(),
            a.len(),
            Path::new("/x/ck.safetensors"),
            Role::Checkpoint,
        );
        assert!(r.is_listed());
        let base = a.as_ptr() as usize;
        let (s, off) = lookup(base + 10).expect("registered");
        assert_eq!(off, 10);
        assert!(lookup(base + 64).is_none_or(|(o, _)| !std::ptr::eq(o, s)));
        let mut m = Buf { b: [0; 1024], n: 0 };
        message(s, off, &mut m);
        let text = String::from_utf8_lossy(&m.b[..m.n]).into_owned();
        assert!(
            text.starts_with(
                "petite: error: checkpoint changed or truncated while it was being read: \
                 /x/ck.safetensors (SIGBUS reading byte 10:"
            ),
            "{text}"
        );
        r.set_role(Role::MappingFile);
        let mut m = Buf { b: [0; 1024], n: 0 };
        message(s, 0, &mut m);
        assert!(String::from_utf8_lossy(&m.b[..m.n]).contains("mapping file changed"));
        drop(r);
        assert!(lookup(base + 10).is_none());
    }

    #[test]
    fn long_paths_are_cut() {
        let a = [0u8; 8];
        let long = "d/".repeat(400);
        let r = Registration::new(a.as_ptr(), a.len(), Path::new(&long), Role::File);
        let (s, _) = lookup(a.as_ptr() as usize).unwrap();
        let mut m = Buf { b: [0; 1024], n: 0 };
        message(s, 0, &mut m);
        let text = String::from_utf8_lossy(&m.b[..m.n]).into_owned();
        assert!(
            text.contains("/d/d... (SIGBUS") && text.ends_with("stable)\n"),
            "{text}"
        );
        drop(r);
    }
}
