//! Pages: the one place that asks the OS for its page size, and the rounding every release and
//! page-aligned layout uses, with the page size as a parameter.
//!
//! Nothing here assumes 4 KiB: x86-64 and Jetson kernels use 4 KiB pages, but aarch64 kernels
//! may be built with 16 KiB or 64 KiB ones. `madvise` wants page-aligned addresses of the *OS*
//! page, so a release rounded to a smaller page would fail with `EINVAL`; one rounded to a
//! larger power-of-two multiple is still valid, only coarser. That is what [`check`] allows,
//! and what lets the tests run every page-dependent path at 4, 16 and 64 KiB on a 4 KiB host.
//!
//! File-format alignments (the `.pte` segment alignment, safetensors' 8-byte header prefix)
//! are not page sizes and do not come from here.

use std::ops::Range;
use std::sync::OnceLock;

use crate::{Error, Result};

/// The OS page size, `sysconf(_SC_PAGESIZE)`, asked once per process.
pub fn page_size() -> usize {
    static PAGE: OnceLock<usize> = OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no memory-safety preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        // POSIX guarantees a positive power of two; a failing sysconf would leave us without a
        // page size at all, and 4096 is the smallest Linux has on any architecture petite runs on.
        usize::try_from(p)
            .ok()
            .filter(|p| p.is_power_of_two())
            .unwrap_or(4096)
    })
}

/// Checks that `page` can stand in for the OS page in releases and layouts: a power of two
/// and a multiple of [`page_size`] (a smaller one would hand `madvise` misaligned addresses).
pub fn check(page: usize) -> Result<usize> {
    let os = page_size();
    if page.is_power_of_two() && page.is_multiple_of(os) {
        Ok(page)
    } else {
        Err(Error::PageSize { page, os })
    }
}

/// The whole pages inside `r` (rounded inward): what a release may give back without touching
/// a page it shares with a neighbour. Empty (`start == end`) when `r` holds no whole page.
pub fn inward(r: Range<usize>, page: usize) -> Range<usize> {
    let start = r.start.div_ceil(page) * page;
    let end = r.end / page * page;
    start..end.max(start)
}

/// The pages touching `r` (rounded outward), the end clamped to `limit` (a mapping's length,
/// which need not be a page multiple). Empty when `r` is empty.
pub fn outward(r: Range<usize>, page: usize, limit: usize) -> Range<usize> {
    if r.start >= r.end {
        return r.start..r.start;
    }
    let start = r.start / page * page;
    let end = (r.end.div_ceil(page) * page).min(limit);
    start..end.max(start)
}

/// `x` rounded up to a multiple of `page`.
pub fn align_up(x: u64, page: u64) -> u64 {
    x.div_ceil(page) * page
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page sizes of Linux on x86-64 and aarch64.
    const PAGES: [usize; 3] = [4 << 10, 16 << 10, 64 << 10];

    #[test]
    fn os_page_is_a_power_of_two_and_accepted() {
        let p = page_size();
        assert!(p.is_power_of_two() && p >= 4096, "{p}");
        assert_eq!(check(p).unwrap(), p);
        assert_eq!(check(p * 16).unwrap(), p * 16);
        let e = check(p / 2).unwrap_err().to_string();
        assert!(e.contains("multiple of the OS page"), "{e}");
        assert!(check(3 * p).is_err(), "not a power of two");
    }

    #[test]
    fn inward_keeps_shared_edge_pages_at_every_page_size() {
        for page in PAGES {
            // A tensor starting mid-page and ending mid-page: its edge pages are shared.
            let r = page / 2..5 * page + 7;
            let i = inward(r.clone(), page);
            assert_eq!(i, page..5 * page, "page {page}");
            assert!(i.start >= r.start && i.end <= r.end);
            assert!(i.start.is_multiple_of(page) && i.end.is_multiple_of(page));
            // Aligned on both ends: all of it.
            assert_eq!(inward(2 * page..4 * page, page), 2 * page..4 * page);
            // Less than a page, or straddling one boundary: nothing.
            assert!(inward(1..page - 1, page).is_empty());
            assert!(inward(page - 3..page + 3, page).is_empty());
            // A range that is a 4 KiB page but not a larger one releases nothing there.
            let four = 4096..8192;
            assert_eq!(inward(four, page).is_empty(), page > 4096, "page {page}");
        }
    }

    #[test]
    fn outward_covers_the_range_and_stays_in_the_mapping() {
        for page in PAGES {
            let limit = 10 * page + 100;
            assert_eq!(outward(page + 1..2 * page + 1, page, limit), page..3 * page);
            // The last page of a file is partial: clamped to the mapping.
            assert_eq!(
                outward(10 * page + 1..10 * page + 50, page, limit),
                10 * page..limit
            );
            assert!(outward(5..5, page, limit).is_empty());
        }
    }
}
