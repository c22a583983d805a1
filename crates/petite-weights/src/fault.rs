//! Mapped files that change under the process: a SIGBUS becomes a one-line error naming the file.
//!
//! Reading a page of a `MAP_SHARED` file mapping that lies past the file's current end (another
//! process truncated it) or whose device failed raises SIGBUS, which by default kills the
//! process with no message (exit 135, "Bus error"). Every mapping this crate makes registers its
//! address range, its path and its [`Role`] in a process-wide table that grows as needed and
//! never loses an entry ([`Registration`], removed on drop); [`install_sigbus_handler`] (the `petite` binary calls it once at start)
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
//! cleared by the next run, which overwrites it). A SIGBUS that is not a mapped-file fault
//! (`si_code` other than `BUS_ADRERR`/`BUS_OBJERR`, e.g. one sent by `kill`) or at an address no
//! registration covers is not ours to explain: it goes to the action installed before ours (its
//! handler, or the default re-raised, so the process dies of SIGBUS as before: a core for a real
//! bug).

use std::path::Path;
use std::sync::Once;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU8, AtomicUsize, Ordering};

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

/// Slots per chunk of the table. The table grows by whole chunks, which are never freed (the
/// handler may be reading one), so its size is the most mappings ever alive at once, rounded up
/// to a chunk: a few for an export, one per engine segment for `petite verify` (≈125 at full
/// size with a 32 MiB cap).
const SLOTS: usize = 64;
/// Path bytes kept per slot; a longer path is shown cut, ending in "...".
const PATH_BYTES: usize = 512;

/// Slot states, in the low two bits of `Slot::state`; the bits above count the slot's reuses,
/// so a handler that read a slot while it was freed and taken again (for another file) sees the
/// count change and looks again instead of naming the other file.
const FREE: usize = 0;
const BUSY: usize = 1;
const LIVE: usize = 2;
const STATE_MASK: usize = 3;
const GENERATION: usize = 4;

/// One registered mapping. Every field is atomic so that the handler, which may interrupt any
/// thread at any point (including one registering or dropping a mapping), never reads memory
/// another thread is writing non-atomically. `state` orders it: fields are written while BUSY
/// and published by the Release store of LIVE; the handler reads them after an Acquire load of
/// LIVE and checks that `state` is unchanged afterwards (a sequence lock).
struct Slot {
    state: AtomicUsize,
    start: AtomicUsize,
    len: AtomicUsize,
    role: AtomicU8,
    path_len: AtomicUsize,
    path: [AtomicU8; PATH_BYTES],
}

impl Slot {
    const fn new() -> Slot {
        Slot {
            state: AtomicUsize::new(FREE),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            role: AtomicU8::new(0),
            path_len: AtomicUsize::new(0),
            path: [const { AtomicU8::new(0) }; PATH_BYTES],
        }
    }
}

/// A block of slots; blocks form a list that only grows (pushed at the head with a CAS), so the
/// handler walks it with plain atomic loads, never meeting freed memory.
struct Chunk {
    slots: [Slot; SLOTS],
    next: AtomicPtr<Chunk>,
}

/// The first chunk lives in static memory: a process with few mappings never allocates.
static FIRST: Chunk = Chunk {
    slots: [const { Slot::new() }; SLOTS],
    next: AtomicPtr::new(std::ptr::null_mut()),
};
/// Chunks added when every slot was taken (leaked on purpose, see [`SLOTS`]).
static GROWN: AtomicPtr<Chunk> = AtomicPtr::new(std::ptr::null_mut());

/// Every chunk: the static one, then those grown (newest first).
fn chunks() -> impl Iterator<Item = &'static Chunk> {
    let grown = std::iter::successors(
        // SAFETY: pointers in the list come from `Box::leak` and are never freed.
        unsafe { GROWN.load(Ordering::Acquire).as_ref() },
        // SAFETY: as above.
        |c| unsafe { c.next.load(Ordering::Acquire).as_ref() },
    );
    std::iter::once(&FIRST).chain(grown)
}

/// Every slot of every chunk.
fn slots() -> impl Iterator<Item = &'static Slot> {
    chunks().flat_map(|c| c.slots.iter())
}

/// Set by the first thread whose fault the handler explains.
static REPORTED: AtomicBool = AtomicBool::new(false);
/// Whether stderr was a terminal when the handler was installed (a progress bar may be mid-line:
/// the message then starts on a new line).
static STDERR_TTY: AtomicBool = AtomicBool::new(false);

/// The SIGBUS action in place before ours, written once before ours is installed and only read
/// afterwards: a SIGBUS that is not a mapped-file fault of ours goes to it.
struct Previous(std::cell::UnsafeCell<std::mem::MaybeUninit<libc::sigaction>>);
// SAFETY: written once, inside `install_sigbus_handler`'s `Once`, before the handler that reads
// it exists (published by the `sigaction` call that installs the handler); read-only afterwards.
unsafe impl Sync for Previous {}
static PREVIOUS: Previous = Previous(std::cell::UnsafeCell::new(std::mem::MaybeUninit::zeroed()));

/// A mapping's entry in the table, removed on drop. Drop it before unmapping (declare it
/// before the mapping in a struct: fields drop in order), so the range is never listed for
/// memory that another mapping may reuse.
pub struct Registration {
    slot: Option<&'static Slot>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("listed", &self.slot.is_some())
            .finish()
    }
}

impl Registration {
    /// Registers `len` bytes at `start` as a mapping of `path` in `role`. Never fails: the
    /// table grows when every slot is taken, so every mapping is listed.
    pub fn new(start: *const u8, len: usize, path: &Path, role: Role) -> Registration {
        if len == 0 {
            return Registration { slot: None };
        }
        loop {
            for s in slots() {
                let cur = s.state.load(Ordering::Relaxed);
                if cur & STATE_MASK != FREE {
                    continue;
                }
                let busy = (cur & !STATE_MASK).wrapping_add(GENERATION) | BUSY;
                if s.state
                    .compare_exchange(cur, busy, Ordering::Acquire, Ordering::Relaxed)
                    .is_err()
                {
                    continue;
                }
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
                s.state
                    .store((busy & !STATE_MASK) | LIVE, Ordering::Release);
                return Registration { slot: Some(s) };
            }
            // Every slot is taken: add a chunk and look again (another thread may take some of
            // its slots first; the loop then adds another).
            let chunk: &'static Chunk = Box::leak(Box::new(Chunk {
                slots: [const { Slot::new() }; SLOTS],
                next: AtomicPtr::new(std::ptr::null_mut()),
            }));
            let mut head = GROWN.load(Ordering::Acquire);
            loop {
                chunk.next.store(head, Ordering::Relaxed);
                match GROWN.compare_exchange(
                    head,
                    chunk as *const Chunk as *mut Chunk,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => break,
                    Err(h) => head = h,
                }
            }
        }
    }

    /// Whether the mapping is listed (false only for an empty range, which cannot fault).
    pub fn is_listed(&self) -> bool {
        self.slot.is_some()
    }

    /// Changes the role shown for this mapping.
    pub fn set_role(&self, role: Role) {
        if let Some(s) = self.slot {
            s.role.store(role as u8, Ordering::Relaxed);
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(s) = self.slot {
            // Same generation, BUSY then FREE: a handler reading the slot meanwhile sees the
            // state change and does not use what it read.
            let g = s.state.load(Ordering::Relaxed) & !STATE_MASK;
            s.state.store(g | BUSY, Ordering::Release);
            s.start.store(0, Ordering::Relaxed);
            s.len.store(0, Ordering::Relaxed);
            s.state.store(g | FREE, Ordering::Release);
        }
    }
}

/// The registered mapping holding `addr`, as (path, role); for ordinary (non-signal) code.
pub fn mapped_file_at(addr: usize) -> Option<(std::path::PathBuf, Role)> {
    let hit = lookup(addr)?;
    let path = std::path::PathBuf::from(std::ffi::OsString::from(
        String::from_utf8_lossy(&hit.path[..hit.path_len]).into_owned(),
    ));
    Some((path, hit.role))
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

/// Slots in the table now (it grows by whole chunks and never shrinks).
pub fn capacity() -> usize {
    chunks().count() * SLOTS
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

/// A consistent copy of one registered mapping, taken by [`lookup`] (on the stack: the handler
/// may use it).
struct Hit {
    offset: usize,
    role: Role,
    path: [u8; PATH_BYTES],
    path_len: usize,
}

/// The message for a fault at `hit` (into `out`).
fn message(hit: &Hit, out: &mut Buf) {
    if STDERR_TTY.load(Ordering::Relaxed) {
        out.push(b"\n");
    }
    out.push(b"petite: error: ");
    out.push(hit.role.name().as_bytes());
    out.push(b" changed or truncated while it was being read: ");
    out.push(&hit.path[..hit.path_len]);
    out.push(b" (SIGBUS reading byte ");
    out.push_num(hit.offset);
    out.push(b": the file is shorter than when it was opened, or its device failed; nothing was published; re-run once it is stable)\n");
}

/// The registered mapping holding `addr`, copied while its slot did not change (a slot freed
/// and reused meanwhile is read again, so the copy never mixes two files).
fn lookup(addr: usize) -> Option<Hit> {
    'slots: for s in slots() {
        loop {
            let before = s.state.load(Ordering::Acquire);
            if before & STATE_MASK != LIVE {
                continue 'slots;
            }
            let (start, len) = (
                s.start.load(Ordering::Relaxed),
                s.len.load(Ordering::Relaxed),
            );
            if !(addr >= start && addr - start < len) {
                if s.state.load(Ordering::Acquire) == before {
                    continue 'slots;
                }
                continue;
            }
            let mut hit = Hit {
                offset: addr - start,
                role: Role::from_u8(s.role.load(Ordering::Relaxed)),
                path: [0; PATH_BYTES],
                path_len: s.path_len.load(Ordering::Relaxed).min(PATH_BYTES),
            };
            for (d, c) in hit.path.iter_mut().zip(&s.path[..hit.path_len]) {
                *d = c.load(Ordering::Relaxed);
            }
            std::sync::atomic::fence(Ordering::Acquire);
            if s.state.load(Ordering::Relaxed) == before {
                return Some(hit);
            }
        }
    }
    None
}

/// Whether a SIGBUS with this `si_code` can be a read of a mapped file's missing page: the
/// kernel reports those (file truncated under the mapping, or the page-in's I/O failed) as
/// `BUS_ADRERR`; `BUS_OBJERR` is an object-specific hardware error. Alignment faults, memory
/// poisoning and a SIGBUS sent by `kill`/`raise` (code ≤ 0) are someone else's.
fn is_mapped_file_fault(code: libc::c_int) -> bool {
    code == libc::BUS_ADRERR || code == libc::BUS_OBJERR
}

/// Hands a SIGBUS that is not ours to the action installed before ours: its handler if it had
/// one (in a Rust binary, std's stack-overflow handler, which resets the default action for a
/// fault it does not explain); a sent signal that was ignored stays ignored; otherwise the
/// default action is restored and the signal re-raised (blocked while this handler runs, it is
/// delivered as soon as this returns), so the process dies of SIGBUS as if petite's handler did
/// not exist (a core for a real bug).
///
/// # Safety
/// Only from the signal handler, with the kernel's arguments.
unsafe fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: PREVIOUS was written before our handler was installed and is read-only now.
    let prev = unsafe { (*PREVIOUS.0.get()).assume_init_ref() };
    let h = prev.sa_sigaction;
    // SAFETY: the kernel's siginfo_t, valid for the handler's duration.
    let sent = unsafe { (*info).si_code } <= 0;
    if h == libc::SIG_IGN && sent {
        return; // ignored before ours: still ignored
    }
    if h != libc::SIG_DFL && h != libc::SIG_IGN {
        if prev.sa_flags & libc::SA_SIGINFO != 0 {
            // SAFETY: an SA_SIGINFO handler has this three-argument form.
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                unsafe { std::mem::transmute(h) };
            f(sig, info, ctx);
        } else {
            // SAFETY: a plain handler has the one-argument form.
            let f: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(h) };
            f(sig);
        }
        return;
    }
    // SAFETY: sigaction and raise are async-signal-safe; `sa` is a live, initialised local.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
        libc::raise(libc::SIGBUS);
    }
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for a handler installed with SA_SIGINFO;
    // `si_addr` reads the faulting address field of a SIGBUS's siginfo.
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    let hit = if is_mapped_file_fault(code) {
        lookup(addr)
    } else {
        None
    };
    match hit {
        Some(_) if REPORTED.swap(true, Ordering::SeqCst) => {
            // Another thread faulted first and is writing the message and exiting: one line,
            // not one per thread. Wait for the exit (pause is async-signal-safe).
            loop {
                // SAFETY: pause takes no arguments; the process ends in the other thread's
                // `_exit`.
                unsafe { libc::pause() };
            }
        }
        Some(hit) => {
            let mut m = Buf { b: [0; 1024], n: 0 };
            message(&hit, &mut m);
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
        // SAFETY: called from the handler with the kernel's arguments.
        None => unsafe { chain(sig, info, ctx) },
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
        // The action it replaces is kept in PREVIOUS (written here, before the handler that
        // reads it exists) and gets every SIGBUS that is not ours.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_sigbus as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGBUS, &sa, (*PREVIOUS.0.get()).as_mut_ptr());
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(hit: &Hit) -> String {
        let mut m = Buf { b: [0; 1024], n: 0 };
        message(hit, &mut m);
        String::from_utf8_lossy(&m.b[..m.n]).into_owned()
    }

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
        let hit = lookup(base + 10).expect("registered");
        assert_eq!(hit.offset, 10);
        assert!(lookup(base + 64).is_none_or(|h| h.path[..h.path_len] != *b"/x/ck.safetensors"));
        assert!(
            text(&hit).starts_with(
                "petite: error: checkpoint changed or truncated while it was being read: \
                 /x/ck.safetensors (SIGBUS reading byte 10:"
            ),
            "{}",
            text(&hit)
        );
        r.set_role(Role::MappingFile);
        assert!(text(&lookup(base).unwrap()).contains("mapping file changed"));
        drop(r);
        assert!(lookup(base + 10).is_none());
    }

    #[test]
    fn long_paths_are_cut() {
        let a = [0u8; 8];
        let long = "d/".repeat(400);
        let r = Registration::new(a.as_ptr(), a.len(), Path::new(&long), Role::File);
        let t = text(&lookup(a.as_ptr() as usize).unwrap());
        assert!(
            t.contains("/d/d... (SIGBUS") && t.ends_with("stable)\n"),
            "{t}"
        );
        drop(r);
    }

    /// More mappings than one chunk holds (verify maps each engine segment: ≈125 at full size
    /// with a 32 MiB cap), each found under its own name; freed slots are reused.
    #[test]
    fn two_hundred_mappings_are_all_listed() {
        let bufs: Vec<[u8; 16]> = vec![[0; 16]; 200];
        let regs: Vec<Registration> = bufs
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let p = format!("/engines/{i}.bin");
                Registration::new(b.as_ptr(), b.len(), Path::new(&p), Role::EngineFile)
            })
            .collect();
        assert!(regs.iter().all(Registration::is_listed));
        assert!(capacity() >= 200, "{}", capacity());
        for (i, b) in bufs.iter().enumerate() {
            let hit = lookup(b.as_ptr() as usize + 3).expect("listed");
            assert_eq!(
                std::str::from_utf8(&hit.path[..hit.path_len]).unwrap(),
                format!("/engines/{i}.bin")
            );
            assert_eq!(hit.offset, 3);
        }
        let cap = capacity();
        drop(regs);
        let again: Vec<Registration> = bufs
            .iter()
            .map(|b| Registration::new(b.as_ptr(), b.len(), Path::new("/again"), Role::File))
            .collect();
        assert_eq!(
            capacity(),
            cap,
            "freed slots are reused, the table does not grow"
        );
        drop(again);
    }

    /// A slot freed and taken again for another file changes its generation, so a reader that
    /// started on the old registration can tell.
    #[test]
    fn a_reused_slot_has_a_new_generation() {
        let a = [0u8; 8];
        let r = Registration::new(a.as_ptr(), 8, Path::new("/first"), Role::File);
        let slot = r.slot.unwrap();
        let g1 = slot.state.load(Ordering::Relaxed);
        drop(r);
        // Take slots until this one is reused (others may be taken by concurrent tests).
        let mut held = Vec::new();
        loop {
            let r = Registration::new(a.as_ptr(), 8, Path::new("/second"), Role::File);
            if std::ptr::eq(r.slot.unwrap(), slot) {
                let g2 = slot.state.load(Ordering::Relaxed);
                assert_eq!(g2 & STATE_MASK, LIVE);
                assert_ne!(g1, g2);
                break;
            }
            held.push(r);
            assert!(held.len() < 10_000);
        }
    }

    #[test]
    fn only_mapped_file_faults_are_ours() {
        assert!(is_mapped_file_fault(libc::BUS_ADRERR));
        assert!(is_mapped_file_fault(libc::BUS_OBJERR));
        assert!(!is_mapped_file_fault(libc::BUS_ADRALN));
        assert!(!is_mapped_file_fault(libc::SI_USER));
        assert!(!is_mapped_file_fault(libc::SI_TKILL));
    }
}
