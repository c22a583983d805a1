//! The f32 GEMM on x86-64 CPUs with AVX-512F, in [`super::matmul::gemm_f32`]'s summation order.
//!
//! Why not `gemm`'s own AVX-512 path: `gemm` computes `dst = lhs · rhs` column-major, so a
//! row-major `x · wᵀ` (every linear) makes it gather the weight element by element while it
//! packs it — a third of the prefix's time. Here the output is vectorised along its columns
//! (16 lanes, two vectors per tile), each lhs element is broadcast from its row (read in place
//! for short products; for tall ones from a copy of the 12-row tile in 16-float line pieces,
//! since rows a power-of-two apart would share L1 sets), and the rhs is read in place when its rows are contiguous (`matmul`, `scores · v`) or packed
//! once per depth chunk into 32-wide row panels when they are not (a linear's `wᵀ`, `kᵀ`; a bf16
//! weight is widened there, exactly, so it is never copied to f32 as a whole).
//!
//! Order: every output is a fused-multiply-add chain from zero over each depth chunk of
//! [`super::matmul::depth_chunks`], then added to the output (or stored, for the first chunk
//! when not accumulating) — the order `gemm_f32` documents, so the result is bit for bit the
//! one the `gemm` crate and [`super::matmul`]'s plain loop give. Tiling and threads only
//! decide which core computes an output and when, never how.

use super::matmul::{MatRef, SendPtr, depth_chunks};
use rayon::prelude::*;
use std::arch::x86_64::*;

/// Output columns per tile (two 16-lane vectors).
const NB: usize = 32;
/// Output rows per tile: `2·MR` accumulators, plus two rhs vectors and a broadcast, of the 32
/// vector registers.
const MR: usize = 12;
/// Column blocks per task when the lhs has many rows: the packed rhs of a task (16 · 32 · 512
/// floats, 1 MiB) stays in L2 while every row tile of the task reads it, and each lhs row tile
/// is copied (and read from memory) once per 512 output columns.
const TASK_BLOCKS: usize = 16;
/// Column blocks per task for a short lhs (fewer than `8·MR` rows), where packing the rhs
/// outweighs re-reading the lhs: a smaller panel (256 KiB).
const TASK_BLOCKS_SHORT: usize = 4;
/// Below this many outputs a product runs as one task.
const MIN_PARALLEL: usize = 1 << 14;

/// The right operand of [`gemm`]: an f32 view, or the transpose of a row-major `n×k` matrix of
/// bf16 bits (a bf16 linear's weight as stored), widened exactly while it is packed — no f32
/// copy of the weight is made, and the result is the one of the widened f32 weight.
#[derive(Clone, Copy)]
pub(super) enum Rhs<'a> {
    /// Any f32 view.
    F32(MatRef<'a>),
    /// `rhs[p, j] = widen(bits[j·k + p])`, `k×n`; `bits.len() == n·k`.
    Bf16T {
        /// The `n×k` row-major bits.
        bits: &'a [u16],
        /// Depth.
        k: usize,
        /// Columns of the product (rows of the stored matrix).
        n: usize,
    },
}

impl Rhs<'_> {
    fn cols(&self) -> usize {
        match self {
            Rhs::F32(m) => m.cols(),
            Rhs::Bf16T { n, .. } => *n,
        }
    }
}

/// Whether this CPU can run [`gemm`] (checked once; `is_x86_feature_detected` caches).
pub(super) fn available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
}

/// `dst[m×n] = (accumulate ? dst : 0) + lhs · rhs` in `gemm_f32`'s order. The caller
/// guarantees: [`available`], shapes checked (`lhs` m×k, `rhs` k×n, `dst.len() == m·n`,
/// all non-zero), and `lhs` rows contiguous (column stride 1).
pub(super) fn gemm(
    dst: &mut [f32],
    lhs: MatRef<'_>,
    rhs: Rhs<'_>,
    accumulate: bool,
    parallel: bool,
) {
    let (m, n) = (lhs.rows(), rhs.cols());
    debug_assert!(available() && lhs.strides().1 == 1 && dst.len() == m * n);
    let blocks = n.div_ceil(NB);
    let tb = if m >= 8 * MR {
        TASK_BLOCKS
    } else {
        TASK_BLOCKS_SHORT
    };
    let groups = blocks.div_ceil(tb);
    // Rows are split too when there are few column groups, so that two (or a few) threads
    // have several tasks each; a function of the shape only.
    let row_parts = if parallel && m * n >= MIN_PARALLEL {
        8usize.div_ceil(groups).min(m.div_ceil(MR))
    } else {
        1
    };
    let rows_per = m.div_ceil(row_parts).next_multiple_of(MR);
    let tasks: Vec<(usize, usize)> = (0..groups)
        .flat_map(|g| (0..m).step_by(rows_per).map(move |r| (g, r)))
        .collect();
    let out = SendPtr(dst.as_mut_ptr());
    let task = |&(g, r0): &(usize, usize)| {
        let j0 = g * tb * NB;
        let j1 = (j0 + tb * NB).min(n);
        let r1 = (r0 + rows_per).min(m);
        // SAFETY: AVX-512F is present (`available`, checked by the caller); the tile lies inside
        // the checked shapes (rows r0..r1 ≤ m, columns j0..j1 ≤ n), and tasks write disjoint
        // tiles of `dst`, which outlives them.
        unsafe { run_task(out.get(), lhs, rhs, r0..r1, j0..j1, accumulate) };
    };
    if tasks.len() > 1 && parallel {
        tasks.par_iter().for_each(task);
    } else {
        tasks.iter().for_each(task);
    }
}

/// Rows `rows` × columns `cols` of the output, every depth chunk in turn.
///
/// # Safety
/// AVX-512F must be available; `out` must point to an `m×n` row-major buffer (m = lhs rows,
/// n = rhs cols) that nothing else reads or writes within `rows × cols` meanwhile; `rows` and
/// `cols` must lie inside `0..m` and `0..n`; `lhs` must have column stride 1.
#[target_feature(enable = "avx512f")]
unsafe fn run_task(
    out: *mut f32,
    lhs: MatRef<'_>,
    rhs: Rhs<'_>,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    accumulate: bool,
) {
    let (k, n) = (lhs.cols(), rhs.cols());
    let (lrs, _) = lhs.strides();
    let width = cols.end - cols.start;
    let nblocks = width.div_ceil(NB);
    // rhs rows read in place when contiguous
    let direct = match rhs {
        Rhs::F32(m) if m.strides().1 == 1 => Some(m),
        _ => None,
    };
    let chunks = depth_chunks(k);
    let max_kc = chunks.iter().map(|c| c.1).max().unwrap_or(0);
    let pack_a = rows.end - rows.start >= 8 * MR;
    let mut apanel = if pack_a {
        vec![0.0f32; max_kc.div_ceil(16) * MR * 16]
    } else {
        Vec::new()
    };
    let mut packed = if direct.is_some() {
        Vec::new()
    } else {
        vec![0.0f32; nblocks * max_kc * NB]
    };
    for (c, &(p0, kc)) in chunks.iter().enumerate() {
        let first = c == 0 && !accumulate;
        if direct.is_none() {
            for b in 0..nblocks {
                let j = cols.start + b * NB;
                let w = NB.min(cols.end - j);
                pack(&mut packed[b * kc * NB..][..kc * NB], rhs, p0, kc, j, w);
            }
        }
        let mut i = rows.start;
        while i < rows.end {
            let r = MR.min(rows.end - i);
            // SAFETY: rows i..i+r < m and depth p0..p0+kc ≤ k of lhs, a checked view with
            // column stride 1; the panel holds ⌈max_kc/16⌉·MR·16 floats.
            let a_in = unsafe { lhs.data().as_ptr().add(i * lrs + p0) };
            // A short lhs is read in place (few row tiles: copying them costs more than
            // their rows sharing cache sets).
            let (a, a_rs) = if pack_a {
                // SAFETY: as above.
                unsafe { pack_lhs(&mut apanel, a_in, lrs, r, kc) };
                (apanel.as_ptr(), 16)
            } else {
                (a_in, lrs)
            };
            for b in 0..nblocks {
                let j = cols.start + b * NB;
                let w = NB.min(cols.end - j);
                let (m0, m1) = masks(w);
                // SAFETY (pointer offsets): (p0, j) of rhs, inside its checked view (p0 < k,
                // j < n); the packed panel of block b; output (i, j) < (m, n).
                let (bp, bs) = if let Some(rhs) = direct {
                    let rrs = rhs.strides().0;
                    (unsafe { rhs.data().as_ptr().add(p0 * rrs + j) }, rrs)
                } else {
                    (unsafe { packed.as_ptr().add(b * kc * NB) }, NB)
                };
                let d = unsafe { out.add(i * n + j) };
                let t = Tile {
                    a,
                    a_rs,
                    b: bp,
                    b_rs: bs,
                    kc,
                    d,
                    d_rs: n,
                    m0,
                    m1,
                    first,
                };
                // SAFETY: the tile's reads lie in the lhs panel (rows < r written), in rhs rows p0..p0+kc, columns j..j+w (masked beyond w) or the
                // packed panel; its writes in output rows i..i+r, columns j..j+w (masked).
                unsafe {
                    if pack_a {
                        tile_rows::<true>(r, t)
                    } else {
                        tile_rows::<false>(r, t)
                    }
                }
            }
            i += r;
        }
    }
}

/// An lhs row tile copied into `panel` as 16-float pieces: depth `16·q + e` of row `r`
/// (`r < rows ≤ MR`) at `panel[(q·MR + r)·16 + e]`, zero past `kc`. A tile then reads
/// `MR` consecutive lines per 16 depth steps, whatever the lhs row stride (rows of a
/// power-of-two stride would share L1 sets), and the copy needs no shuffles.
///
/// # Safety
/// AVX-512F; `a + r·rs + p` readable for `r < rows`, `p < kc`; `panel.len() ≥ kc.div_ceil(16)·MR·16`.
#[target_feature(enable = "avx512f")]
unsafe fn pack_lhs(panel: &mut [f32], a: *const f32, rs: usize, rows: usize, kc: usize) {
    debug_assert!(rows <= MR && panel.len() >= kc.div_ceil(16) * MR * 16);
    for (q, p) in (0..kc).step_by(16).enumerate() {
        let k = mask(kc - p);
        for r in 0..rows {
            let o = &mut panel[(q * MR + r) * 16..][..16];
            // SAFETY: the mask reads a[r·rs + p ..][..min(16, kc − p)], inside the caller's
            // range; 16 floats are written inside `o`, which is 16 long.
            unsafe {
                let v = _mm512_maskz_loadu_ps(k, a.add(r * rs + p));
                _mm512_storeu_ps(o.as_mut_ptr(), v);
            }
        }
    }
}

/// [`tile`] for `r` (1..=MR) rows.
///
/// # Safety
/// As [`tile`]'s, for `R = r`.
#[target_feature(enable = "avx512f")]
unsafe fn tile_rows<const PACKED: bool>(r: usize, t: Tile) {
    // SAFETY: as the function's contract states.
    unsafe {
        match r {
            12 if t.m0 == 0xffff && t.m1 == 0xffff => tile::<12, PACKED, true>(t),
            12 => tile::<12, PACKED, false>(t),
            11 => tile::<11, PACKED, false>(t),
            10 => tile::<10, PACKED, false>(t),
            9 => tile::<9, PACKED, false>(t),
            8 => tile::<8, PACKED, false>(t),
            7 => tile::<7, PACKED, false>(t),
            6 => tile::<6, PACKED, false>(t),
            5 => tile::<5, PACKED, false>(t),
            4 => tile::<4, PACKED, false>(t),
            3 => tile::<3, PACKED, false>(t),
            2 => tile::<2, PACKED, false>(t),
            _ => tile::<1, PACKED, false>(t),
        }
    }
}

/// Lane masks of the two vectors of a tile `w` columns wide.
fn masks(w: usize) -> (__mmask16, __mmask16) {
    (mask(w), mask(w.saturating_sub(16)))
}

/// `panel[p·32 + c] = rhs[p0 + p, j + c]` for `c < w`, zero beyond (a 32-wide row panel).
/// A linear's weight (rhs rows strided, contiguous along the depth; f32 or bf16) is transposed
/// 16 × 16 in registers; any other layout is copied element by element.
#[target_feature(enable = "avx512f")]
fn pack(panel: &mut [f32], rhs: Rhs<'_>, p0: usize, kc: usize, j: usize, w: usize) {
    if w < NB {
        panel.fill(0.0);
    }
    match rhs {
        Rhs::F32(m) if m.strides().0 != 1 => {
            let (rs, cs) = m.strides();
            let data = m.data();
            for c in 0..w {
                for p in 0..kc {
                    panel[p * NB + c] = data[(j + c) * cs + (p0 + p) * rs];
                }
            }
        }
        Rhs::F32(m) => {
            let (cs, data) = (m.strides().1, m.data());
            pack_transposed(panel, kc, w, |c, p, pw| {
                let row = &data[(j + c) * cs + p0 + p..][..pw];
                // SAFETY: the mask reads the first `pw` elements of `row`, all inside it.
                unsafe { _mm512_maskz_loadu_ps(mask(pw), row.as_ptr()) }
            });
        }
        Rhs::Bf16T { bits, k, .. } => pack_transposed(panel, kc, w, |c, p, pw| {
            let row = &bits[(j + c) * k + p0 + p..][..pw];
            let mut buf = [0u16; 16];
            let src = if pw == 16 {
                row
            } else {
                buf[..pw].copy_from_slice(row);
                &buf[..]
            };
            // SAFETY: 16 u16 read from `src`, which is 16 long; widening a bf16 is placing its
            // bits in the high half of an f32.
            unsafe {
                let h = _mm256_loadu_si256(src.as_ptr().cast());
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
        }),
    }
}

/// Fills a panel from the 16-wide depth pieces `load(c, p, pw)` of output column `j + c`
/// (its `pw ≤ 16` elements from depth `p0 + p`, zero beyond), transposed 16 × 16 in registers.
#[target_feature(enable = "avx512f")]
fn pack_transposed(
    panel: &mut [f32],
    kc: usize,
    w: usize,
    load: impl Fn(usize, usize, usize) -> __m512,
) {
    for c0 in (0..w).step_by(16) {
        for p in (0..kc).step_by(16) {
            let pw = 16.min(kc - p);
            let mut r = [_mm512_setzero_ps(); 16];
            for (i, v) in r.iter_mut().enumerate().take(w - c0) {
                *v = load(c0 + i, p, pw);
            }
            transpose16(&mut r);
            for (q, v) in r.iter().enumerate().take(pw) {
                let out = &mut panel[(p + q) * NB + c0..][..16];
                // SAFETY: 16 floats written inside `out`, which is 16 long.
                unsafe { _mm512_storeu_ps(out.as_mut_ptr(), *v) };
            }
        }
    }
}

/// The first `n` lanes (n ≤ 16).
pub(super) fn mask(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

/// Transposes 16 rows of 16 floats in place: 4×4 blocks within each 128-bit lane (two unpack
/// stages), then the 4×4 grid of lanes (two lane-shuffle stages).
#[target_feature(enable = "avx512f")]
pub(super) fn transpose16(r: &mut [__m512; 16]) {
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // s[4i + q], lane L: column 4L + q, rows 4i..4i+4.
    let mut s = [_mm512_setzero_ps(); 16];
    for i in 0..4 {
        let (t0, t1) = (_mm512_castps_pd(t[4 * i]), _mm512_castps_pd(t[4 * i + 1]));
        let (t2, t3) = (
            _mm512_castps_pd(t[4 * i + 2]),
            _mm512_castps_pd(t[4 * i + 3]),
        );
        s[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
        s[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
        s[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
        s[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
    for q in 0..4 {
        let (a0, a1, a2, a3) = (s[q], s[4 + q], s[8 + q], s[12 + q]);
        let u0 = _mm512_shuffle_f32x4::<0x44>(a0, a1);
        let u1 = _mm512_shuffle_f32x4::<0xEE>(a0, a1);
        let u2 = _mm512_shuffle_f32x4::<0x44>(a2, a3);
        let u3 = _mm512_shuffle_f32x4::<0xEE>(a2, a3);
        r[q] = _mm512_shuffle_f32x4::<0x88>(u0, u2);
        r[4 + q] = _mm512_shuffle_f32x4::<0xDD>(u0, u2);
        r[8 + q] = _mm512_shuffle_f32x4::<0x88>(u1, u3);
        r[12 + q] = _mm512_shuffle_f32x4::<0xDD>(u1, u3);
    }
}

/// One output tile's operands: `R` rows of `a` (in place, row stride `a_rs`, contiguous along
/// the depth; or packed by [`pack_lhs`]), `kc` rows of `b` (stride `b_rs`, 32 columns, lanes outside `m0`/`m1` not read), the output at
/// `d` (row stride `d_rs`).
#[derive(Clone, Copy)]
struct Tile {
    a: *const f32,
    a_rs: usize,
    b: *const f32,
    b_rs: usize,
    kc: usize,
    d: *mut f32,
    d_rs: usize,
    m0: __mmask16,
    m1: __mmask16,
    first: bool,
}

/// `R × 32` outputs over one depth chunk: per output a fused-multiply-add chain from zero over
/// the chunk, then stored (`first`) or added to the output.
/// `FULL`: both masks are all lanes, so the rhs rows are read with plain loads (the masked
/// loads measured ~10% slower on a full-width 12-row tile; same values, same order).
///
/// # Safety
/// AVX-512F; `a + r·a_rs + p` (in place) or `a + (p/16·MR + r)·16 + p%16` (`PACKED`)
/// readable for `r < R`, `p < kc`; `b + p·b_rs + lane` readable for
/// `p < kc` and every lane set in `m0` (lanes 0..16) / `m1` (lanes 16..32); `d + r·d_rs + lane`
/// readable and writable for the same lanes and `r < R`.
#[target_feature(enable = "avx512f")]
unsafe fn tile<const R: usize, const PACKED: bool, const FULL: bool>(t: Tile) {
    let mut acc0 = [_mm512_setzero_ps(); R];
    let mut acc1 = [_mm512_setzero_ps(); R];
    // One depth step `p` with row 0's lhs element at `a`: both rhs vectors, then per row a
    // broadcast and two FMAs.
    macro_rules! step {
        ($a:expr, $a_rs:expr, $p:expr) => {
            // SAFETY: as the function's contract states (`a + r·a_rs` is row r's element at
            // depth p).
            unsafe {
                let (a, bp) = ($a, t.b.add($p * t.b_rs));
                let (b0, b1) = if FULL {
                    (_mm512_loadu_ps(bp), _mm512_loadu_ps(bp.add(16)))
                } else {
                    (
                        _mm512_maskz_loadu_ps(t.m0, bp),
                        _mm512_maskz_loadu_ps(t.m1, bp.add(16)),
                    )
                };
                for r in 0..R {
                    let a = _mm512_set1_ps(*a.add(r * $a_rs));
                    acc0[r] = _mm512_fmadd_ps(a, b0, acc0[r]);
                    acc1[r] = _mm512_fmadd_ps(a, b1, acc1[r]);
                }
            }
        };
    }
    if PACKED {
        for (q, p0) in (0..t.kc).step_by(16).enumerate() {
            for e in 0..16.min(t.kc - p0) {
                step!(t.a.add(q * MR * 16 + e), 16, p0 + e);
            }
        }
    } else {
        for p in 0..t.kc {
            step!(t.a.add(p), t.a_rs, p);
        }
    }
    // SAFETY: as the function's contract states.
    unsafe { write_tile!(acc0, acc1, R, t.d, t.d_rs, t.m0, t.m1, t.first) };
}
