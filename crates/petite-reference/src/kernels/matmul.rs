//! GEMM through the `gemm` crate: f32 inputs, f32 accumulation. Threads split the output into
//! blocks; the depth loop (and so every output's summation order) does not depend on the thread
//! count, which `gemm_is_thread_count_independent` checks.

use crate::{Result, kerr};
use gemm::Parallelism;
use rayon::prelude::*;

/// A strided read-only matrix view: element (r, c) is `data[r * rs + c * cs]`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    /// Backing storage.
    pub data: &'a [f32],
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Row stride (elements).
    pub rs: usize,
    /// Column stride (elements).
    pub cs: usize,
}

impl<'a> MatRef<'a> {
    /// A contiguous row-major `rows × cols` matrix.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Self {
        MatRef {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose (a view; no copy).
    pub fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    fn check(&self, what: &str) -> Result<()> {
        if self.rows == 0 || self.cols == 0 {
            return Ok(());
        }
        let last = (self.rows - 1)
            .checked_mul(self.rs)
            .and_then(|a| (self.cols - 1).checked_mul(self.cs).map(|b| a + b));
        match last {
            Some(l) if l < self.data.len() => Ok(()),
            _ => Err(kerr(
                "gemm",
                format!(
                    "{what}: {}x{} view with strides ({}, {}) exceeds its {} elements",
                    self.rows,
                    self.cols,
                    self.rs,
                    self.cs,
                    self.data.len()
                ),
            )),
        }
    }
}

/// How a parallel GEMM is cut into independent blocks (a function of the shape only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Split {
    None,
    /// Column blocks of this width.
    Cols(usize),
    /// Row blocks of this height.
    Rows(usize),
}

/// About 8 blocks: enough to balance two (or a few) threads, few enough that re-packing the
/// shared operand per block stays a few percent.
fn split_for(m: usize, n: usize) -> Split {
    const MIN_WORK: usize = 1 << 16; // below ~64k outputs a single call is fastest
    if m * n < MIN_WORK {
        Split::None
    } else if n >= 512 {
        Split::Cols((n / 8).next_multiple_of(64).clamp(256, 2048))
    } else if m >= 128 {
        Split::Rows((m / 8).next_multiple_of(16).max(64))
    } else {
        Split::None
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only to hand disjoint output blocks of one exclusively borrowed buffer to
// rayon tasks that all finish before `gemm_f32` returns.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `dst[m×n] (row-major, contiguous) = (accumulate ? dst : 0) + lhs[m×k] · rhs[k×n]`.
///
/// `parallel` lets `gemm` use the rayon pool; inside an outer parallel loop pass `false`.
pub fn gemm_f32(
    dst: &mut [f32],
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    accumulate: bool,
    parallel: bool,
) -> Result<()> {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    if rhs.rows != k {
        return Err(kerr(
            "gemm",
            format!("lhs is {m}x{k} but rhs is {}x{n}", rhs.rows),
        ));
    }
    if dst.len() != m * n {
        return Err(kerr(
            "gemm",
            format!("dst has {} elements, expected {m}x{n}", dst.len()),
        ));
    }
    lhs.check("lhs")?;
    rhs.check("rhs")?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return Ok(());
    }
    // Threads take whole output blocks (independent single-threaded GEMMs, work-stealing, no
    // barriers: robust on a shared machine). Block boundaries depend only on the shape, and
    // within a block gemm's depth loop is fixed, so results never depend on the thread count.
    let split = if parallel {
        split_for(m, n)
    } else {
        Split::None
    };
    let dst_ptr = SendPtr(dst.as_mut_ptr());
    let block = |i0: usize, mi: usize, j0: usize, nj: usize| {
        // SAFETY: every view was bounds-checked above for its full extent, and (i0, mi, j0, nj)
        // lies inside m×n; dst is exclusively borrowed, row stride n, column stride 1, and
        // distinct blocks write disjoint elements.
        unsafe {
            gemm::gemm(
                mi,
                nj,
                k,
                dst_ptr.get().add(i0 * n + j0),
                1,
                n as isize,
                accumulate,
                lhs.data.as_ptr().add(i0 * lhs.rs),
                lhs.cs as isize,
                lhs.rs as isize,
                rhs.data.as_ptr().add(j0 * rhs.cs),
                rhs.cs as isize,
                rhs.rs as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                Parallelism::None,
            );
        }
    };
    match split {
        Split::None => block(0, m, 0, n),
        Split::Cols(nb) => (0..n.div_ceil(nb))
            .into_par_iter()
            .for_each(|b| block(0, m, b * nb, nb.min(n - b * nb))),
        Split::Rows(mb) => (0..m.div_ceil(mb))
            .into_par_iter()
            .for_each(|b| block(b * mb, mb.min(m - b * mb), 0, n)),
    }
    Ok(())
}

/// PyTorch `F.linear`: `x[rows×k] · w[n×k]ᵀ (+ bias[n])` → `[rows×n]`.
///
/// The bias seeds the output and the product is accumulated onto it (what `addmm` does).
pub fn linear(
    x: &[f32],
    rows: usize,
    w: &[f32],
    n: usize,
    bias: Option<&[f32]>,
) -> Result<Vec<f32>> {
    if rows == 0 {
        return Ok(Vec::new());
    }
    if !x.len().is_multiple_of(rows) {
        return Err(kerr(
            "linear",
            format!("input of {} elements is not {rows} rows", x.len()),
        ));
    }
    let k = x.len() / rows;
    if w.len() != n * k {
        return Err(kerr(
            "linear",
            format!("weight has {} elements, expected [{n}, {k}]", w.len()),
        ));
    }
    let mut out = vec![0.0f32; rows * n];
    let accumulate = if let Some(b) = bias {
        if b.len() != n {
            return Err(kerr(
                "linear",
                format!("bias has {} elements, expected [{n}]", b.len()),
            ));
        }
        for row in out.chunks_exact_mut(n) {
            row.copy_from_slice(b);
        }
        true
    } else {
        false
    };
    gemm_f32(
        &mut out,
        MatRef::row_major(x, rows, k),
        MatRef::row_major(w, n, k).t(),
        accumulate,
        true,
    )?;
    Ok(out)
}

/// Batched matmul `a[batch, m, k] · b[batch, k, n]` → `[batch, m, n]`, where a batch index maps
/// to an offset in each operand (`a_off[i]`, `b_off[i]`, elements) so broadcast batches share
/// storage. Batches run in parallel when there are several; a single one parallelises inside.
pub fn matmul_batched(
    a: &[f32],
    a_off: &[usize],
    b: &[f32],
    b_off: &[usize],
    m: usize,
    k: usize,
    n: usize,
) -> Result<Vec<f32>> {
    use rayon::prelude::*;
    if a_off.len() != b_off.len() {
        return Err(kerr(
            "matmul",
            "operand batch offset lists differ in length",
        ));
    }
    let batch = a_off.len();
    let mut out = vec![0.0f32; batch * m * n];
    if m * n == 0 {
        return Ok(out);
    }
    let one = |(i, dst): (usize, &mut [f32]), parallel: bool| -> Result<()> {
        let aa = a
            .get(a_off[i]..)
            .ok_or_else(|| kerr("matmul", format!("batch {i}: lhs offset out of range")))?;
        let bb = b
            .get(b_off[i]..)
            .ok_or_else(|| kerr("matmul", format!("batch {i}: rhs offset out of range")))?;
        gemm_f32(
            dst,
            MatRef::row_major(aa, m, k),
            MatRef::row_major(bb, k, n),
            false,
            parallel,
        )
    };
    if batch == 1 {
        one((0, &mut out[..]), true)?;
    } else {
        out.par_chunks_mut(m * n)
            .enumerate()
            .try_for_each(|x| one(x, false))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut o = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    o[i * n + j] += a[i * k + p] as f64 * b[p * n + j] as f64;
                }
            }
        }
        o
    }

    fn seq(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                ((s >> 8) as f32 / (1u32 << 24) as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn linear_hand_computed() {
        // x = [[1,2],[3,4]], w = [[1,0],[0,1],[1,1]], b = [10,20,30]
        let y = linear(
            &[1., 2., 3., 4.],
            2,
            &[1., 0., 0., 1., 1., 1.],
            3,
            Some(&[10., 20., 30.]),
        )
        .unwrap();
        assert_eq!(y, vec![11., 22., 33., 13., 24., 37.]);
        let y = linear(&[1., 2.], 1, &[2., 3.], 1, None).unwrap();
        assert_eq!(y, vec![8.]);
    }

    #[test]
    fn linear_matches_naive_on_odd_shapes() {
        let (m, k, n) = (37, 129, 65);
        let x = seq(m * k, 1);
        let w = seq(n * k, 2);
        let y = linear(&x, m, &w, n, None).unwrap();
        let mut wt = vec![0.0; k * n];
        for i in 0..n {
            for p in 0..k {
                wt[p * n + i] = w[i * k + p];
            }
        }
        let r = naive(&x, &wt, m, k, n);
        for (a, b) in y.iter().zip(&r) {
            assert!((*a as f64 - b).abs() < 1e-4, "{a} vs {b}");
        }
    }

    #[test]
    fn gemm_is_thread_count_independent() {
        for (m, k, n) in [
            (200, 700, 300),
            (300, 130, 1100),
            (97, 64, 700),
            (600, 100, 300),
        ] {
            let a = seq(m * k, 5);
            let b = seq(k * n, 6);
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut d = vec![0.0; m * n];
                pool.install(|| {
                    gemm_f32(
                        &mut d,
                        MatRef::row_major(&a, m, k),
                        MatRef::row_major(&b, k, n),
                        false,
                        true,
                    )
                    .unwrap()
                });
                d
            };
            let (one, two, five) = (run(1), run(2), run(5));
            assert!(
                one.iter()
                    .zip(&two)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{m}x{k}x{n}"
            );
            assert!(
                one.iter()
                    .zip(&five)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "{m}x{k}x{n}"
            );
            let want = naive(&a, &b, m, k, n);
            assert!(
                one.iter()
                    .zip(&want)
                    .all(|(x, y)| (*x as f64 - y).abs() < 1e-4)
            );
        }
        let (m, k, n) = (200, 700, 300);
        let a = seq(m * k, 3);
        let b = seq(k * n, 4);
        let mut d1 = vec![0.0; m * n];
        let mut d2 = vec![0.0; m * n];
        gemm_f32(
            &mut d1,
            MatRef::row_major(&a, m, k),
            MatRef::row_major(&b, k, n),
            false,
            false,
        )
        .unwrap();
        gemm_f32(
            &mut d2,
            MatRef::row_major(&a, m, k),
            MatRef::row_major(&b, k, n),
            false,
            true,
        )
        .unwrap();
        assert!(d1.iter().zip(&d2).all(|(x, y)| x.to_bits() == y.to_bits()));
    }

    #[test]
    fn batched_with_broadcast_offsets() {
        // two batches of a (2x2) times one shared b (2x1)
        let a = [1., 2., 3., 4., 5., 6., 7., 8.];
        let b = [1., 1.];
        let y = matmul_batched(&a, &[0, 4], &b, &[0, 0], 2, 2, 1).unwrap();
        assert_eq!(y, vec![3., 7., 11., 15.]);
    }

    #[test]
    fn shape_errors_not_panics() {
        assert!(linear(&[1., 2., 3.], 1, &[1., 2.], 1, None).is_err());
        assert!(linear(&[1., 2.], 1, &[1., 2.], 1, Some(&[1., 2.])).is_err());
        let mut d = vec![0.0; 4];
        assert!(
            gemm_f32(
                &mut d,
                MatRef::row_major(&[1.0; 3], 2, 2),
                MatRef::row_major(&[1.0; 4], 2, 2),
                false,
                false
            )
            .is_err()
        );
    }
}
