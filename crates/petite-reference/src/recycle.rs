//! A global allocator that keeps freed large blocks for reuse while programs run.
//!
//! Why: the executor allocates every node's output afresh, and in pi0.5's prefix those are
//! tens of MiB each, the same sizes layer after layer. The system allocator hands a block that
//! large out as fresh pages (glibc `mmap`s anything over 32 MiB and unmaps it on free), so each
//! output is page-faulted in 4 KiB at a time and zeroed by the kernel: a full-size f32 chunk
//! took ~950k faults and 4.6 s of kernel time in 34 s. A kept block is handed out again with its
//! pages still mapped.
//!
//! Bounded: at most [`Recycler::keep_up_to`] bytes are kept (oldest given back first), and
//! nothing is kept until a limit is set, so a process that never runs a program (an export held
//! to tens of MiB) sees the system allocator unchanged. Only blocks of at least
//! [`MIN_BYTES`] are kept; a block is reused only for the same size and alignment, so every
//! block is given back to the system allocator with the layout it was allocated with.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Blocks below this size go straight to the system allocator (its own free lists serve them).
pub const MIN_BYTES: usize = 1 << 20;

/// How many blocks can be kept at once (a fixed array: the allocator must not allocate).
const SLOTS: usize = 64;

#[derive(Clone, Copy)]
struct Block {
    ptr: usize,
    size: usize,
    align: usize,
}

struct Kept {
    /// Oldest first.
    blocks: [Block; SLOTS],
    len: usize,
    bytes: usize,
}

impl Kept {
    /// Takes block `i` out of the list (the order of the others kept).
    fn remove(&mut self, i: usize) -> Block {
        let b = self.blocks[i];
        self.blocks.copy_within(i + 1..self.len, i);
        self.len -= 1;
        self.bytes -= b.size;
        b
    }

    /// Appends `b` as the newest block; the caller has made room (`len < SLOTS`).
    fn push(&mut self, b: Block) {
        self.blocks[self.len] = b;
        self.len += 1;
        self.bytes += b.size;
    }
}

/// A [`GlobalAlloc`] over [`System`] that keeps freed blocks of at least [`MIN_BYTES`] (up to a
/// byte limit, off by default) and hands them out again for the same layout. Install it with
/// `#[global_allocator]` in a binary, then call [`Recycler::keep_up_to`] around program runs.
pub struct Recycler {
    limit: AtomicUsize,
    kept: Mutex<Kept>,
}

impl Default for Recycler {
    fn default() -> Self {
        Self::new()
    }
}

impl Recycler {
    /// A recycler that keeps nothing until [`Recycler::keep_up_to`] is called.
    pub const fn new() -> Self {
        Self {
            limit: AtomicUsize::new(0),
            kept: Mutex::new(Kept {
                blocks: [Block {
                    ptr: 0,
                    size: 0,
                    align: 0,
                }; SLOTS],
                len: 0,
                bytes: 0,
            }),
        }
    }

    /// Keeps up to `bytes` of freed large blocks from now on (0: keep none). Lowering the limit
    /// gives the oldest kept blocks back at once.
    pub fn keep_up_to(&self, bytes: usize) {
        self.limit.store(bytes, Ordering::Relaxed);
        let mut k = self.lock();
        while k.bytes > bytes {
            // SAFETY: every kept block was allocated by `System` with this size and alignment
            // and is owned by the cache alone.
            unsafe { Self::evict_oldest(&mut k) };
        }
    }

    /// Bytes kept now (freed, not yet handed out again).
    pub fn kept_bytes(&self) -> usize {
        self.lock().bytes
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        // Nothing panics while the lock is held; a poisoned lock still holds a consistent cache.
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wanted(&self, layout: Layout) -> bool {
        layout.size() >= MIN_BYTES && self.limit.load(Ordering::Relaxed) > 0
    }

    /// A kept block of exactly this layout, the most recently freed one (its lines are the
    /// likeliest still cached).
    fn take(&self, layout: Layout) -> Option<*mut u8> {
        let mut k = self.lock();
        let i = (0..k.len).rev().find(|&i| {
            let b = k.blocks[i];
            b.size == layout.size() && b.align == layout.align()
        })?;
        Some(k.remove(i).ptr as *mut u8)
    }

    /// # Safety
    /// `k.len > 0`; every kept block is a live `System` allocation of its recorded layout.
    unsafe fn evict_oldest(k: &mut Kept) {
        let b = k.remove(0);
        // SAFETY: per this function's contract the block came from `System` with this layout,
        // and removing it from the cache made this the only owner.
        unsafe {
            System.dealloc(
                b.ptr as *mut u8,
                Layout::from_size_align_unchecked(b.size, b.align),
            )
        };
    }
}

// SAFETY: every block handed out is either fresh from `System` or a kept `System` block of
// exactly the requested size and alignment, owned by nobody else; every block freed goes back
// to `System` with the layout it was allocated with (a kept block is only reused for that
// same layout).
unsafe impl GlobalAlloc for Recycler {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if self.wanted(layout)
            && let Some(p) = self.take(layout)
        {
            return p;
        }
        // SAFETY: the caller's contract (non-zero size) is `System`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if self.wanted(layout)
            && let Some(p) = self.take(layout)
        {
            // SAFETY: `p` is a block of `layout.size()` bytes owned by the caller from now on.
            unsafe { p.write_bytes(0, layout.size()) };
            return p;
        }
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if layout.size() >= MIN_BYTES && layout.size() <= self.limit.load(Ordering::Relaxed) {
            let mut k = self.lock();
            // Read again under the lock: `keep_up_to` may have lowered it meanwhile.
            let limit = self.limit.load(Ordering::Relaxed);
            while k.len > 0 && (k.len == SLOTS || k.bytes + layout.size() > limit) {
                // SAFETY: kept blocks are live `System` blocks of their recorded layouts.
                unsafe { Self::evict_oldest(&mut k) };
            }
            if layout.size() <= limit {
                k.push(Block {
                    ptr: ptr as usize,
                    size: layout.size(),
                    align: layout.align(),
                });
                return;
            }
        }
        // SAFETY: `ptr` came from this allocator with `layout`, so from `System` with it.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if self.limit.load(Ordering::Relaxed) == 0
            || (layout.size() < MIN_BYTES && new_size < MIN_BYTES)
        {
            // SAFETY: the caller's contract is `System`'s; a block below `MIN_BYTES` (or any
            // block while nothing is kept) came from `System` with `layout`.
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // A large block moves through the cache: a new block of the new size (kept or fresh),
        // the bytes copied, the old one freed (and maybe kept).
        // SAFETY: the caller guarantees `new_size` is non-zero and, rounded up to the
        // alignment, does not overflow `isize`.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: `new` has a non-zero size.
        let p = unsafe { self.alloc(new) };
        if !p.is_null() {
            // SAFETY: both blocks are live, distinct and at least this long.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(size: usize) -> Layout {
        Layout::from_size_align(size, 64).unwrap()
    }

    #[test]
    fn keeps_nothing_until_a_limit_is_set() {
        let r = Recycler::new();
        unsafe {
            let p = r.alloc(layout(2 << 20));
            assert!(!p.is_null());
            r.dealloc(p, layout(2 << 20));
        }
        assert_eq!(r.kept_bytes(), 0);
    }

    #[test]
    fn reuses_a_freed_block_of_the_same_layout_only() {
        let r = Recycler::new();
        r.keep_up_to(16 << 20);
        unsafe {
            let a = r.alloc(layout(3 << 20));
            a.write_bytes(7, 3 << 20);
            r.dealloc(a, layout(3 << 20));
            assert_eq!(r.kept_bytes(), 3 << 20);
            // another size or alignment is not served from it
            let other = r.alloc(layout(2 << 20));
            let aligned = r.alloc(Layout::from_size_align(3 << 20, 4096).unwrap());
            assert!(other != a && aligned != a);
            assert_eq!(r.kept_bytes(), 3 << 20);
            // the same layout is, and a zeroed request gets zeros
            let b = r.alloc_zeroed(layout(3 << 20));
            assert_eq!(b, a);
            assert_eq!(r.kept_bytes(), 0);
            assert!(
                std::slice::from_raw_parts(b, 3 << 20)
                    .iter()
                    .all(|&x| x == 0)
            );
            r.dealloc(b, layout(3 << 20));
            r.dealloc(other, layout(2 << 20));
            r.dealloc(aligned, Layout::from_size_align(3 << 20, 4096).unwrap());
        }
        r.keep_up_to(0);
        assert_eq!(r.kept_bytes(), 0);
    }

    #[test]
    fn the_limit_bounds_what_is_kept_oldest_given_back_first() {
        let r = Recycler::new();
        r.keep_up_to(5 << 20);
        unsafe {
            let ps: Vec<*mut u8> = (0..3).map(|_| r.alloc(layout(2 << 20))).collect();
            for &p in &ps {
                r.dealloc(p, layout(2 << 20));
            }
            // 6 MiB freed, 4 MiB kept: the first block was given back
            assert_eq!(r.kept_bytes(), 4 << 20);
            // blocks larger than the limit are never kept, nor those below MIN_BYTES
            let big = r.alloc(layout(6 << 20));
            r.dealloc(big, layout(6 << 20));
            let small = r.alloc(layout(MIN_BYTES - 1));
            r.dealloc(small, layout(MIN_BYTES - 1));
            assert_eq!(r.kept_bytes(), 4 << 20);
            // the most recently freed comes back first
            let q = r.alloc(layout(2 << 20));
            assert_eq!(q, ps[2]);
            r.dealloc(q, layout(2 << 20));
        }
        r.keep_up_to(2 << 20);
        assert_eq!(r.kept_bytes(), 2 << 20);
        r.keep_up_to(0);
        assert_eq!(r.kept_bytes(), 0);
    }

    #[test]
    fn realloc_keeps_the_bytes_across_sizes() {
        let r = Recycler::new();
        r.keep_up_to(64 << 20);
        unsafe {
            let mut p = r.alloc(layout(1000));
            let mut size = 1000;
            for (i, new) in [(0u8, 3 << 20), (1, 5 << 20), (2, 100)] {
                p.write_bytes(i + 1, size.min(new));
                let q = r.realloc(p, layout(size), new);
                assert!(!q.is_null());
                let s = std::slice::from_raw_parts(q, size.min(new));
                assert!(s.iter().all(|&x| x == i + 1), "realloc to {new}");
                p = q;
                size = new;
            }
            r.dealloc(p, layout(size));
        }
        r.keep_up_to(0);
    }

    #[test]
    fn concurrent_use_hands_no_block_out_twice() {
        let r = std::sync::Arc::new(Recycler::new());
        r.keep_up_to(32 << 20);
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let r = r.clone();
                std::thread::spawn(move || {
                    for i in 0..200usize {
                        let l = layout((1 + (i % 3)) << 20);
                        unsafe {
                            let p = r.alloc(l);
                            assert!(!p.is_null());
                            p.write_bytes(t, l.size());
                            std::thread::yield_now();
                            // nobody else wrote into this block meanwhile
                            let s = std::slice::from_raw_parts(p, l.size());
                            assert!(s.iter().step_by(4096).all(|&x| x == t));
                            r.dealloc(p, l);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(r.kept_bytes() <= 32 << 20);
        r.keep_up_to(0);
    }
}
