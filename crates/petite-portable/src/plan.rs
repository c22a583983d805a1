//! Memory planning: every planned tensor (inputs and kernel outputs) gets an offset in one buffer
//! (`memory_id` 1). Tensors whose lifetimes (first write .. last read, in call order) are disjoint
//! share bytes. Placement is petite-pte's one lifetime planner ([`petite_pte::lifetime`]) taking
//! the largest first, each at the lowest 16-aligned offset that overlaps no already-placed tensor
//! alive at the same time (EXIR's greedy planner does the same), which in practice lands close to
//! the largest live set.

use petite_pte::lifetime::{self, Lifetime, Order, aligned};
use serde::Serialize;

use crate::lower::{Arg, Lowered};

/// Alignment of planned tensors (EXIR's `ALIGNMENT`; petite-pte's `PLANNED_ALIGNMENT`).
pub const ALIGN: u64 = petite_pte::builder::PLANNED_ALIGNMENT;

/// The plan of one method.
#[derive(Debug, Clone)]
pub struct MemoryPlan {
    /// Offset of each slot in buffer 1 (`None` for constants).
    pub offsets: Vec<Option<u64>>,
    /// Lifetime of each planned slot: `(first, last)` call indices (inclusive).
    pub lifetimes: Vec<Option<(usize, usize)>>,
    /// Figures for reports.
    pub stats: PlanStats,
}

/// How good the plan is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PlanStats {
    /// Size of the planned buffer.
    pub planned_bytes: u64,
    /// Sum of the (aligned) sizes of every planned tensor: what no reuse would cost.
    pub sum_bytes: u64,
    /// The largest sum of (aligned) sizes of tensors alive at the same call: a lower bound
    /// for any plan.
    pub max_live_bytes: u64,
    /// Number of planned tensors.
    pub planned_tensors: usize,
    /// Number of kernel calls.
    pub calls: usize,
}

/// Plans the method's memory.
pub fn plan(l: &Lowered) -> MemoryPlan {
    let n = l.slots.len();
    let end = l.calls.len();
    let mut life: Vec<Option<(usize, usize)>> = vec![None; n];
    let touch = |life: &mut Vec<Option<(usize, usize)>>, s: usize, at: usize| {
        life[s] = Some(match life[s] {
            None => (at, at),
            Some((a, b)) => (a.min(at), b.max(at)),
        });
    };
    for (_, s) in &l.inputs {
        touch(&mut life, *s, 0);
    }
    for (i, c) in l.calls.iter().enumerate() {
        for a in &c.args {
            match a {
                Arg::T(s) => touch(&mut life, *s, i),
                Arg::Tensors(v) => v.iter().for_each(|&s| touch(&mut life, s, i)),
                _ => {}
            }
        }
    }
    for (_, s) in &l.outputs {
        touch(&mut life, *s, end);
    }
    for (s, slot) in l.slots.iter().enumerate() {
        if !slot.is_planned() {
            life[s] = None;
        } else if life[s].is_none() {
            // An unused graph input still needs its bytes (the runtime copies into it).
            life[s] = Some((0, 0));
        }
    }
    let size = |s: usize| aligned(l.slots[s].nbytes());
    let planned: Vec<usize> = (0..n).filter(|&s| life[s].is_some()).collect();
    let lifetimes: Vec<Lifetime> = planned
        .iter()
        .map(|&s| {
            let (first, last) = life[s].expect("planned");
            Lifetime {
                bytes: size(s),
                first,
                last,
            }
        })
        .collect();
    let sum: u64 = lifetimes.iter().map(|t| t.bytes).sum();
    let max_live = lifetime::max_live(&lifetimes);
    // The one lifetime planner (petite-pte's), largest first as EXIR's greedy planner.
    let placement = lifetime::place(&lifetimes, Order::LargestFirst);
    let mut offsets: Vec<Option<u64>> = vec![None; n];
    for (&s, &off) in planned.iter().zip(&placement.offsets) {
        offsets[s] = Some(off);
    }
    let total = placement.end;
    MemoryPlan {
        offsets,
        lifetimes: life,
        stats: PlanStats {
            planned_bytes: total,
            sum_bytes: sum,
            max_live_bytes: max_live,
            planned_tensors: planned.len(),
            calls: end,
        },
    }
}

/// Checks a plan: every pair of planned tensors alive at the same call occupies disjoint bytes,
/// and everything fits the buffer. Quadratic; for tests.
pub fn check(l: &Lowered, p: &MemoryPlan) -> Result<(), String> {
    let items: Vec<(usize, u64, u64, usize, usize)> = p
        .offsets
        .iter()
        .enumerate()
        .filter_map(|(s, o)| {
            let (a, b) = p.lifetimes[s]?;
            Some((s, (*o)?, l.slots[s].nbytes(), a, b))
        })
        .collect();
    for (i, x) in items.iter().enumerate() {
        if x.1 % ALIGN != 0 || x.1 + x.2 > p.stats.planned_bytes {
            return Err(format!("slot {} at {} (+{}) is misplaced", x.0, x.1, x.2));
        }
        for y in &items[i + 1..] {
            let time = x.3 <= y.4 && y.3 <= x.4;
            let space = x.1 < y.1 + y.2 && y.1 < x.1 + x.2;
            if time && space && x.2 > 0 && y.2 > 0 {
                return Err(format!(
                    "slots {} and {} overlap while both alive",
                    x.0, y.0
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use petite_graph::{Builder, Dtype};

    use super::*;

    /// A residual MLP stack: wide temporaries that die quickly, a narrow stream that lives on.
    #[test]
    fn plan_is_overlap_free_and_close_to_the_largest_live_set() {
        let mut b = Builder::new();
        let mut x = b.input("x", Dtype::F32, &[16, 32]).unwrap();
        for i in 0..12 {
            let w1 = b
                .weight(&format!("w1.{i}"), Dtype::F32, &[128, 32])
                .unwrap();
            let w2 = b
                .weight(&format!("w2.{i}"), Dtype::F32, &[32, 128])
                .unwrap();
            let h = b.linear(x, w1, None).unwrap();
            let h = b.gelu_tanh(h).unwrap();
            let h = b.linear(h, w2, None).unwrap();
            let n = b.rms_norm(h, None, 1e-6).unwrap();
            x = b.add(x, n).unwrap();
        }
        b.output("y", x).unwrap();
        let prog = b.finish().unwrap();
        let l = crate::lower(&prog).unwrap();
        let p = plan(&l);
        check(&l, &p).unwrap();
        let s = p.stats;
        assert!(s.planned_bytes >= s.max_live_bytes);
        assert!(
            s.planned_bytes as f64 <= 1.5 * s.max_live_bytes as f64,
            "{s:?}"
        );
        // Reuse is real: far below the no-reuse total.
        assert!(s.planned_bytes * 5 < s.sum_bytes, "{s:?}");
        // Inputs and outputs are planned; weights are not.
        assert!(p.offsets[l.inputs[0].1].is_some());
        assert!(p.offsets[l.outputs[0].1].is_some());
        assert_eq!(
            p.offsets.iter().filter(|o| o.is_none()).count(),
            l.slots.iter().filter(|s| !s.is_planned()).count()
        );
    }

    #[test]
    fn check_catches_an_overlap() {
        let mut b = Builder::new();
        let x = b.input("x", Dtype::F32, &[4]).unwrap();
        let y = b.exp(x).unwrap();
        let z = b.add(x, y).unwrap();
        b.output("z", z).unwrap();
        let l = crate::lower(&b.finish().unwrap()).unwrap();
        let mut p = plan(&l);
        check(&l, &p).unwrap();
        // Put exp's output on top of x while both are alive.
        let (xs, ys) = (l.inputs[0].1, l.calls[0].outs[0]);
        p.offsets[ys] = p.offsets[xs];
        assert!(check(&l, &p).is_err());
    }
}
