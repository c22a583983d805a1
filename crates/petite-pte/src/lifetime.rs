//! The one lifetime memory planner of petite's `.pte` writers: tensors with a byte size and a
//! lifetime (first .. last use, inclusive, in instruction order) get offsets in one planned
//! buffer; two tensors share bytes only when their lifetimes are disjoint. Placement is first
//! fit at the lowest [`PLANNED_ALIGNMENT`]-aligned offset that overlaps no placed tensor alive
//! at the same time, taking the tensors in a [`Order`]: largest first (EXIR's greedy planner;
//! petite-portable's methods) or in order of first use (ExecuTorch's lifetime re-plan of a
//! delegate buffer; [`crate::MethodBuilder::reuse_buffer`]).
//!
//! What a tensor's lifetime is depends on the program's form (kernel calls of a lowered method,
//! instructions of a built one) and is computed by each caller; where the bytes go is decided
//! here.

/// Alignment of planned tensors inside a planned buffer: every offset this planner gives is a
/// multiple of it (ExecuTorch's planned tensors are 16-byte aligned, EXIR's `ALIGNMENT`).
pub const PLANNED_ALIGNMENT: u64 = 16;

/// One tensor to place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifetime {
    /// Its size in bytes.
    pub bytes: u64,
    /// First use (inclusive).
    pub first: usize,
    /// Last use (inclusive).
    pub last: usize,
}

impl Lifetime {
    /// Whether `self` and `other` are alive at a common instruction.
    pub fn overlaps(&self, other: &Lifetime) -> bool {
        self.first <= other.last && other.first <= self.last
    }
}

/// The order tensors are placed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Largest (aligned size) first; ties by first use, then by index.
    LargestFirst,
    /// By first use; ties by index.
    FirstUse,
}

/// Where the tensors went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The offset of each tensor, in the order they were given.
    pub offsets: Vec<u64>,
    /// The highest `offset + bytes`: the buffer's size.
    pub end: u64,
}

/// `n` rounded up to [`PLANNED_ALIGNMENT`].
pub fn aligned(n: u64) -> u64 {
    n.div_ceil(PLANNED_ALIGNMENT) * PLANNED_ALIGNMENT
}

/// Places `items` in one buffer (see the module documentation).
pub fn place(items: &[Lifetime], order: Order) -> Placement {
    let mut idx: Vec<usize> = (0..items.len()).collect();
    match order {
        Order::LargestFirst => idx.sort_by_key(|&i| {
            (
                std::cmp::Reverse(aligned(items[i].bytes)),
                items[i].first,
                i,
            )
        }),
        Order::FirstUse => idx.sort_by_key(|&i| (items[i].first, i)),
    }
    let mut offsets = vec![0u64; items.len()];
    let mut placed: Vec<(u64, u64, Lifetime)> = Vec::new(); // (offset, end, lifetime)
    let mut busy: Vec<(u64, u64)> = Vec::new();
    let mut end = 0u64;
    for i in idx {
        let it = items[i];
        busy.clear();
        busy.extend(
            placed
                .iter()
                .filter(|p| p.2.overlaps(&it))
                .map(|p| (p.0, p.1)),
        );
        busy.sort_unstable();
        // Offsets are aligned, so a gap fits `bytes` exactly when it fits them aligned.
        let mut offset = 0u64;
        for &(o, e) in &busy {
            if offset + it.bytes <= o {
                break;
            }
            offset = offset.max(aligned(e));
        }
        offsets[i] = offset;
        placed.push((offset, offset + it.bytes, it));
        end = end.max(offset + it.bytes);
    }
    Placement { offsets, end }
}

/// The largest sum of sizes of tensors alive at one instruction: a lower bound for any plan.
pub fn max_live(items: &[Lifetime]) -> u64 {
    let Some(last) = items.iter().map(|l| l.last).max() else {
        return 0;
    };
    let mut delta = vec![0i128; last + 2];
    for l in items {
        delta[l.first] += l.bytes as i128;
        delta[l.last + 1] -= l.bytes as i128;
    }
    let (mut cur, mut max) = (0i128, 0i128);
    for d in &delta {
        cur += d;
        max = max.max(cur);
    }
    max as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lt(bytes: u64, first: usize, last: usize) -> Lifetime {
        Lifetime { bytes, first, last }
    }

    #[test]
    fn disjoint_lifetimes_share_bytes_and_live_ones_do_not() {
        let items = [lt(100, 0, 1), lt(40, 2, 3), lt(10, 1, 2)];
        for order in [Order::LargestFirst, Order::FirstUse] {
            let p = place(&items, order);
            for (i, a) in items.iter().enumerate() {
                assert_eq!(p.offsets[i] % PLANNED_ALIGNMENT, 0);
                for (j, b) in items.iter().enumerate().skip(i + 1) {
                    let space = p.offsets[i] < p.offsets[j] + b.bytes
                        && p.offsets[j] < p.offsets[i] + a.bytes;
                    assert!(!(a.overlaps(b) && space), "{order:?}: {i} and {j}");
                }
            }
        }
        // Largest first: 100 at 0, 10 above it (aligned), 40 back at 0.
        assert_eq!(place(&items, Order::LargestFirst).offsets, [0, 0, 112]);
        assert_eq!(max_live(&items), 110);
        assert_eq!(max_live(&[]), 0);
    }
}
