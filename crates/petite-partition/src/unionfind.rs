//! A disjoint-set forest over `0..n` (path halving, union by size).
//!
//! The planner only asks whether two elements share a set, never which element represents it, so
//! the choice of representative is free.

/// Disjoint sets over the indices `0..n`.
#[derive(Debug, Clone)]
pub(crate) struct UnionFind {
    parent: Vec<u32>,
    size: Vec<u32>,
}

impl UnionFind {
    /// `n` singleton sets.
    pub(crate) fn new(n: usize) -> Self {
        let n = u32::try_from(n).expect("union-find over more than u32::MAX elements");
        Self {
            parent: (0..n).collect(),
            size: vec![1; n as usize],
        }
    }

    /// The representative of `x`'s set; shortens the path on the way (path halving).
    pub(crate) fn find(&mut self, mut x: u32) -> u32 {
        while self.parent[x as usize] != x {
            let grand = self.parent[self.parent[x as usize] as usize];
            self.parent[x as usize] = grand;
            x = grand;
        }
        x
    }

    /// Merges the sets of `a` and `b` (the smaller under the larger); true if they were apart.
    pub(crate) fn union(&mut self, a: u32, b: u32) -> bool {
        let (mut ra, mut rb) = (self.find(a), self.find(b));
        if ra == rb {
            return false;
        }
        if self.size[ra as usize] < self.size[rb as usize] {
            std::mem::swap(&mut ra, &mut rb);
        }
        self.parent[rb as usize] = ra;
        self.size[ra as usize] += self.size[rb as usize];
        true
    }
}

#[cfg(test)]
mod tests {
    use super::UnionFind;

    #[test]
    fn singletons_are_apart() {
        let mut uf = UnionFind::new(4);
        for i in 0..4 {
            assert_eq!(uf.find(i), i);
        }
    }

    #[test]
    fn union_is_transitive_and_idempotent() {
        let mut uf = UnionFind::new(6);
        assert!(uf.union(0, 1));
        assert!(uf.union(2, 1));
        assert!(!uf.union(0, 2));
        assert!(uf.union(4, 5));
        assert_eq!(uf.find(0), uf.find(2));
        assert_eq!(uf.find(4), uf.find(5));
        assert_ne!(uf.find(0), uf.find(4));
        assert_ne!(uf.find(3), uf.find(0));
        assert_ne!(uf.find(3), uf.find(4));
    }

    #[test]
    fn long_chain_agrees_with_a_naive_labelling() {
        // A chain built in the worst order for a naive forest, plus a second set, checked
        // against a relabelling reference.
        let n = 1000u32;
        let mut uf = UnionFind::new(n as usize);
        let mut label: Vec<u32> = (0..n).collect();
        let mut merge = |uf: &mut UnionFind, a: u32, b: u32| {
            uf.union(a, b);
            let (from, to) = (label[b as usize], label[a as usize]);
            for l in label.iter_mut() {
                if *l == from {
                    *l = to;
                }
            }
        };
        for i in (1..500).rev() {
            merge(&mut uf, i, i - 1);
        }
        for i in (501..n).step_by(3) {
            merge(&mut uf, 500, i);
        }
        for a in (0..n).step_by(7) {
            for b in (0..n).step_by(11) {
                assert_eq!(
                    uf.find(a) == uf.find(b),
                    label[a as usize] == label[b as usize],
                    "{a} {b}"
                );
            }
        }
    }
}
