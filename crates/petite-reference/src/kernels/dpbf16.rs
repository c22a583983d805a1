//! bf16 linears on AVX512-BF16's dot-product instruction: `out[m×n] += x[m×k] · w[n×k]ᵀ`
//! where both `x` and `w` hold bf16 values, with f32 sums — what a bf16 program's linear
//! computes, on CPUs without AMX.
//!
//! Why: one `vdpbf16ps` does 32 bf16 multiply-adds where an f32 FMA does 16, at the same
//! instruction rate on AMD's Zen 4 (measured: 1.7 G instructions/s a core for both), so a bf16
//! program's linears take half the f32 path's instructions. Intel's AVX512-BF16 cores measured
//! it at half the FMA's rate (no gain), so it is chosen only on AMD CPUs unless
//! `PETITE_CPU_DPBF16=on` forces it (`off` turns it off).
//!
//! Order: the product of two bf16 values is exact in f32; the instruction adds a lane's two
//! products of a depth pair to its sum (with inputs and outputs below f32's normal range
//! flushed to zero), and a tile adds its sums over a depth block to `out` — so, like
//! [`super::amx`], the result is deterministic on one CPU but a few f32 ulps from the exact
//! path's, and runs only where a caller allows it (`linear_bf16_any_order`), never for bytes that
//! are exported.
//!
//! Layout: the output is vectorised along its columns as in [`super::avx512`] (12-row × 32-column
//! tiles, 24 accumulators), each lane consuming a depth pair of its weight row. `x` is packed
//! once per call into depth pairs, 12 rows interleaved (a tile's 12 broadcasts read one line);
//! the weight is packed per task and depth block into 32-wide panels of pairs (a 16 × 16
//! transpose of 32-bit pairs in registers), `KP` pairs deep, so a tile's `x` rows stay in L1
//! and the task's panels in L2.

use super::avx512::mask;
use super::matmul::{SendPtr, near_equal_pieces};
use rayon::prelude::*;
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// Output columns per tile (two 16-lane vectors).
const NB: usize = 32;
/// Output rows per tile (24 accumulators of the 32 vector registers).
const MR: usize = 12;
/// Depth pairs per block (1,024 deep): a tile's `x` rows, 24 KiB, stay in L1 while the tile
/// streams its 64 KiB weight panel from L2 (128, 256 and 1,024 pairs measured within 5%).
const KP: usize = 512;
/// Column blocks per task when `x` has many rows: the task's packed panels, 512 KiB, stay in L2.
const TASK_BLOCKS: usize = 8;
/// Column blocks per task for a short `x` (fewer than `8·MR` rows), where packing dominates.
const TASK_BLOCKS_SHORT: usize = 4;

/// Whether [`linear`] runs here: AVX512-BF16 (with AVX512-F and -BW) present, and the CPU an
/// AMD one or `PETITE_CPU_DPBF16=on`; `PETITE_CPU_DPBF16=off` (or `0`) turns it off
/// ([`crate::settings`]). Checked once.
pub(super) fn available() -> bool {
    use crate::settings::Unit;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(
        || match crate::settings::current().unwrap_or_default().dpbf16 {
            Unit::Off => false,
            Unit::On => has_instructions(),
            Unit::Auto => has_instructions() && is_amd(),
        },
    )
}

/// Whether this CPU has the instructions [`linear`] uses (whatever its vendor).
pub(super) fn has_instructions() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512bf16")
}

fn is_amd() -> bool {
    let v = std::arch::x86_64::__cpuid(0);
    let mut name = [0u8; 12];
    name[..4].copy_from_slice(&v.ebx.to_le_bytes());
    name[4..8].copy_from_slice(&v.edx.to_le_bytes());
    name[8..].copy_from_slice(&v.ecx.to_le_bytes());
    &name == b"AuthenticAMD"
}

/// Row tiles of `m` rows: `⌈m/12⌉` tiles of near-equal height (50 rows: five of 10, not four of
/// 12 and one of 2), as (first row, rows).
fn row_tiles(m: usize) -> Vec<(usize, usize)> {
    near_equal_pieces(m, m.div_ceil(MR).max(1))
}

/// `out[m×n] = (accumulate ? out : 0) + x[m×k] · w[n×k]ᵀ` (all row-major). Without
/// `accumulate` the first depth block stores its sums: adding them to a fresh zeroed buffer would
/// read each page before writing it, and a write to a page first read from the kernel's zero page
/// is a fault and a TLB shootdown across cores (measured: a fifth of the time of a 968 × 16384
/// output). Returns false, with `out` untouched, when some `x` value is not a bf16 (its low 16 bits not zero): then the
/// caller runs the f32 path.
///
/// # Panics
/// When the caller broke the contract: [`has_instructions`], `x.len() == m·k`,
/// `w.len() == n·k`, `out.len() == m·n`, all non-zero.
pub(super) fn linear(
    out: &mut [f32],
    x: &[f32],
    m: usize,
    k: usize,
    w: &[u16],
    n: usize,
    accumulate: bool,
) -> bool {
    assert!(
        has_instructions()
            && m > 0
            && k > 0
            && n > 0
            && x.len() == m * k
            && w.len() == n * k
            && out.len() == m * n,
        "dpbf16::linear: caller broke its contract"
    );
    let kp = k.div_ceil(2);
    let tiles = row_tiles(m);
    let Some(xp) = pack_x(x, k, &tiles) else {
        return false;
    };
    let blocks = n.div_ceil(NB);
    let tb = if m >= 8 * MR {
        TASK_BLOCKS
    } else {
        TASK_BLOCKS_SHORT
    };
    let groups = blocks.div_ceil(tb);
    // Row tiles are split too when there are few column groups, so each thread has several tasks.
    let parts = 8usize.div_ceil(groups).min(tiles.len());
    let per = tiles.len().div_ceil(parts);
    let tasks: Vec<(usize, usize)> = (0..groups)
        .flat_map(|g| (0..tiles.len()).step_by(per).map(move |t| (g, t)))
        .collect();
    let dst = SendPtr(out.as_mut_ptr());
    let run = |&(g, t0): &(usize, usize)| {
        let cols = g * tb * NB..((g + 1) * tb * NB).min(n);
        let ts = &tiles[t0..(t0 + per).min(tiles.len())];
        // SAFETY: the instructions are present (asserted); `xp` is `pack_x`'s packing of `x`
        // for `tiles` (tile i at `i·MR·kp`), `w` is n×k and `out` m×n (asserted); the task
        // writes only the rows of its tiles in columns `cols`, disjoint from every other
        // task's, and `out` outlives the tasks.
        unsafe {
            task(
                dst.get(),
                &xp[t0 * MR * kp..],
                ts,
                w,
                k,
                n,
                cols,
                accumulate,
            )
        };
    };
    if tasks.len() > 1 {
        tasks.par_iter().for_each(run);
    } else {
        tasks.iter().for_each(run);
    }
    true
}

/// `x` as depth pairs, row tile by row tile: u32 `(i·kp + p)·MR + r` is `bf16(x[s + r][2p]) |
/// bf16(x[s + r][2p + 1]) << 16` for tile `i` = (s, rows), `r < rows` (zero past `k`, and for
/// `r ≥ rows`). A bf16 is its f32's upper half, so packing is a shift; `None` when some value has
/// a non-zero lower half.
fn pack_x(x: &[f32], k: usize, tiles: &[(usize, usize)]) -> Option<Vec<u32>> {
    let kp = k.div_ceil(2);
    let mut packed = vec![0u32; tiles.len() * MR * kp];
    let ok = packed
        .par_chunks_mut(MR * kp)
        .zip(tiles)
        .map(|(dst, &(s, rows))| {
            let mut low = 0u32;
            for r in 0..rows {
                let row = &x[(s + r) * k..(s + r + 1) * k];
                for (p, pair) in row.chunks(2).enumerate() {
                    let a = pair[0].to_bits();
                    let b = pair.get(1).map_or(0, |v| v.to_bits());
                    low |= (a | b) & 0xffff;
                    dst[p * MR + r] = (a >> 16) | (b & 0xffff_0000);
                }
            }
            low == 0
        })
        .reduce(|| true, |a, b| a && b);
    ok.then_some(packed)
}

/// Columns `cols` of the rows of `tiles`, every depth block in turn (the first stored unless
/// `accumulate`).
///
/// # Safety
/// [`has_instructions`]; `xp` starts with the packing of `tiles` (tile i at `i·MR·kp`,
/// `kp = ⌈k/2⌉`); `w.len() == n·k`; `out` points to an m×n row-major buffer (every tile's rows
/// `< m`) of which nothing else touches these rows and columns meanwhile; `cols` inside `0..n`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn task(
    out: *mut f32,
    xp: &[u32],
    tiles: &[(usize, usize)],
    w: &[u16],
    k: usize,
    n: usize,
    cols: std::ops::Range<usize>,
    accumulate: bool,
) {
    let kp = k.div_ceil(2);
    let nblocks = (cols.end - cols.start).div_ceil(NB);
    let mut panel = vec![0u32; nblocks * KP.min(kp) * NB];
    for p0 in (0..kp).step_by(KP) {
        let pc = KP.min(kp - p0);
        for b in 0..nblocks {
            let j = cols.start + b * NB;
            let wd = NB.min(cols.end - j);
            pack_w(&mut panel[b * pc * NB..][..pc * NB], w, k, j, wd, p0, pc);
        }
        for (i, &(s, rows)) in tiles.iter().enumerate() {
            let a = xp[(i * kp + p0) * MR..].as_ptr();
            for b in 0..nblocks {
                let j = cols.start + b * NB;
                let wd = NB.min(cols.end - j);
                let t = Tile {
                    a,
                    b: panel[b * pc * NB..].as_ptr(),
                    pc,
                    // SAFETY: row s < m, column j < n of the m×n output.
                    d: unsafe { out.add(s * n + j) },
                    d_rs: n,
                    m0: mask(wd),
                    m1: mask(wd.saturating_sub(16)),
                    store: p0 == 0 && !accumulate,
                };
                // SAFETY: the tile reads `pc` pair steps of `x` (MR u32 each, inside `xp`) and of
                // the panel (32 u32 each, inside block b's), and adds to output rows s..s+rows,
                // columns j..j+wd (masked), which this task owns.
                unsafe { tile_rows(rows, t) };
            }
        }
    }
}

/// `panel[p·32 + c]` = the pair of weight row `j + c` at depth `2·(p0 + p)` (its two bf16 bits,
/// the first in the low half; zero past `k`) for `c < wd`, zero for the other columns: rows are
/// loaded 16 pairs (64 bytes) at a time and transposed 16 × 16 as 32-bit lanes.
#[target_feature(enable = "avx512f,avx512bw")]
fn pack_w(panel: &mut [u32], w: &[u16], k: usize, j: usize, wd: usize, p0: usize, pc: usize) {
    if wd < NB {
        panel.fill(0);
    }
    for c0 in (0..wd).step_by(16) {
        for p in (0..pc).step_by(16) {
            // depth elements of this piece (≤ 32), from depth 2·(p0 + p)
            let d0 = 2 * (p0 + p);
            let de = 32.min(k - d0);
            let lanes = if de >= 32 { u32::MAX } else { (1u32 << de) - 1 };
            let mut r = [_mm512_setzero_ps(); 16];
            for (i, v) in r.iter_mut().enumerate().take(wd - c0) {
                let row = &w[(j + c0 + i) * k + d0..][..de];
                // SAFETY: the mask reads the first `de` u16 of `row`, all inside it.
                *v = unsafe {
                    _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(lanes, row.as_ptr().cast()))
                };
            }
            super::avx512::transpose16(&mut r);
            for (q, v) in r.iter().enumerate().take(pc - p) {
                let o = &mut panel[(p + q) * NB + c0..][..16];
                // SAFETY: 16 u32 written inside `o`, which is 16 long.
                unsafe { _mm512_storeu_ps(o.as_mut_ptr().cast(), *v) };
            }
        }
    }
}

/// One tile's operands: `x` pairs at `a` (MR a step), weight pairs at `b` (32 a step), `pc`
/// steps; the output at `d` (row stride `d_rs`), lanes outside `m0`/`m1` untouched, the sums
/// stored (`store`) or added.
#[derive(Clone, Copy)]
struct Tile {
    a: *const u32,
    b: *const u32,
    pc: usize,
    d: *mut f32,
    d_rs: usize,
    m0: __mmask16,
    m1: __mmask16,
    store: bool,
}

/// [`tile`] for `r` (1..=MR) rows.
///
/// # Safety
/// As [`tile`]'s, for `R = r`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tile_rows(r: usize, t: Tile) {
    // SAFETY: as the function's contract states.
    unsafe {
        match r {
            12 => tile::<12>(t),
            11 => tile::<11>(t),
            10 => tile::<10>(t),
            9 => tile::<9>(t),
            8 => tile::<8>(t),
            7 => tile::<7>(t),
            6 => tile::<6>(t),
            5 => tile::<5>(t),
            4 => tile::<4>(t),
            3 => tile::<3>(t),
            2 => tile::<2>(t),
            _ => tile::<1>(t),
        }
    }
}

/// `R × 32` outputs: per output the dot-product chain from zero over the tile's `pc` depth
/// pairs, then stored (`store`) or added to the output.
///
/// # Safety
/// AVX512-BF16; `a + p·MR + r` readable for `p < pc`, `r < R`; `b + p·32 + lane` readable for
/// `p < pc`, lanes 0..32; `d + r·d_rs + lane` readable and writable for `r < R` and every lane
/// set in `m0` (0..16) / `m1` (16..32).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tile<const R: usize>(t: Tile) {
    let mut acc0 = [_mm512_setzero_ps(); R];
    let mut acc1 = [_mm512_setzero_ps(); R];
    for p in 0..t.pc {
        // SAFETY: as the function's contract states; a 512-bit value is 32 bf16 either way.
        unsafe {
            let bp = t.b.add(p * NB);
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(bp.add(16).cast()));
            let ap = t.a.add(p * MR);
            for r in 0..R {
                let a: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(r) as i32));
                acc0[r] = _mm512_dpbf16_ps(acc0[r], a, b0);
                acc1[r] = _mm512_dpbf16_ps(acc1[r], a, b1);
            }
        }
    }
    // SAFETY: as the function's contract states.
    unsafe { write_tile!(acc0, acc1, R, t.d, t.d_rs, t.m0, t.m1, t.store) };
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                petite_dtype::round_through_bf16((s % 2001) as f32 / 1000.0 - 1.0)
            })
            .collect()
    }

    /// Every tile height, column tails, odd depths and several depth blocks, against f64 sums of
    /// the exact products: within the bound of any f32 summation order (the products are exact;
    /// `k + 2` roundings of at most half an ulp of the running magnitude each).
    #[test]
    fn dot_products_are_within_the_summation_bound() {
        if !has_instructions() {
            // Nothing to run here; what can be checked is that it is never chosen.
            assert!(!available());
            return;
        }
        for (m, k, n) in [
            (1, 1, 1),
            (13, 3, 17),
            (50, 257, 40),
            (97, 300, 65),
            (30, 1025, 33),
        ] {
            let x = seq(m * k, 1);
            let bits: Vec<u16> = seq(n * k, 2)
                .iter()
                .map(|&v| petite_dtype::bf16_bits(v))
                .collect();
            for accumulate in [true, false] {
                // accumulating onto a bias; or not, over values that must be ignored
                let bias = if accumulate { seq(n, 3) } else { vec![0.0; n] };
                let mut out: Vec<f32> = if accumulate {
                    (0..m).flat_map(|_| bias.iter().copied()).collect()
                } else {
                    vec![f32::NAN; m * n]
                };
                assert!(linear(&mut out, &x, m, k, &bits, n, accumulate));
                for i in 0..m {
                    for j in 0..n {
                        let (mut exact, mut mag) = (bias[j] as f64, (bias[j] as f64).abs());
                        for p in 0..k {
                            let t = x[i * k + p] as f64
                                * petite_dtype::bf16_bits_to_f32(bits[j * k + p]) as f64;
                            exact += t;
                            mag += t.abs();
                        }
                        let g = out[i * n + j] as f64;
                        let bound = (k + 2) as f64 * f32::EPSILON as f64 / 2.0 * mag;
                        assert!(
                            g.is_finite() && (g - exact).abs() <= bound,
                            "{m}x{k}x{n} ({i}, {j}): {g} vs {exact}, bound {bound:e}"
                        );
                    }
                }
            }
        }
    }

    /// An `x` value that is not a bf16 makes it decline, leaving `out` as it was.
    #[test]
    fn declines_f32_activations() {
        if !has_instructions() {
            // Nothing to run here; what can be checked is that it is never chosen.
            assert!(!available());
            return;
        }
        let (m, k, n) = (20, 40, 8);
        let mut x = seq(m * k, 4);
        x[m * k - 1] = 1.0 + f32::EPSILON;
        let bits = vec![0x3f80u16; n * k];
        let mut out = vec![7.0f32; m * n];
        assert!(!linear(&mut out, &x, m, k, &bits, n, true));
        assert!(out.iter().all(|&v| v == 7.0));
    }

    #[test]
    fn row_tiles_are_balanced_and_cover_the_rows() {
        assert_eq!(
            row_tiles(50),
            vec![(0, 10), (10, 10), (20, 10), (30, 10), (40, 10)]
        );
        assert_eq!(row_tiles(12), vec![(0, 12)]);
        assert_eq!(row_tiles(13), vec![(0, 7), (7, 6)]);
        for m in 1..200 {
            let t = row_tiles(m);
            assert_eq!(t.iter().map(|t| t.1).sum::<usize>(), m);
            assert!(t.iter().all(|t| (1..=MR).contains(&t.1)));
        }
    }
}
