//! bf16 linears on Intel AMX (AMX-BF16): `out[m×n] += x[m×k] · w[n×k]ᵀ` where both `x` and `w`
//! hold bf16 values, with f32 accumulation — what a bf16 program's linear computes.
//!
//! Why: a bf16 program's linears are most of a CPU `petite verify`'s time, and one AMX
//! instruction does 16·16·32 multiply-adds, many times what the AVX-512 FMA path does per cycle.
//!
//! Order: the product of two bf16 values is exact in f32, so the only difference from
//! [`super::matmul::gemm_f32`]'s result is the order in which the unit sums the products (its own,
//! pairs at a time, inputs and outputs below f32's normal range flushed to zero) — the result is
//! deterministic on one CPU, but another CPU (without AMX) gives results a few f32 ulps apart.
//! So it runs only where a caller allows CPU-dependent bf16 sums (the executor's
//! `cpu_bf16_products`), never for bytes that are exported.
//!
//! Layout: the product is computed transposed, `outᵀ = w · xᵀ`. The weight's rows are the A
//! tiles, read in place from its (mapped) storage — a weight is never copied or packed; `x` is
//! packed once per call into the B tiles' pair layout. Tasks take [`NC`] weight rows each and
//! cut the depth into blocks of [`KB`], so the task's weight panel stays in L2 while every row
//! block of `x` passes over it; each block's sums are added to `out` (depth tails under 32 run
//! as plain f32 multiply-adds).

use super::matmul::SendPtr;
use rayon::prelude::*;
use std::arch::asm;
use std::sync::OnceLock;

/// Depth of one tile step (bf16 elements: 64 bytes a tile row).
const TK: usize = 32;
/// Depth per block: a task's weight panel, `NC × KB` bf16, is 512 KiB (L2).
const KB: usize = 2048;
/// Weight rows (output columns) per task.
const NC: usize = 128;
/// u32 pairs per packed tile (16 rows of 64 bytes).
const TILE: usize = 256;

/// Whether this CPU and OS run AMX-BF16 (checked once: CPUID, then the Linux permission to use
/// the tile data state, which a process must ask for). `PETITE_CPU_AMX=off` (or `0`) turns it off,
/// for measuring against the f32 path ([`crate::settings`]; a malformed value has already failed
/// the run in [`crate::Executor::run`]).
pub(super) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        let unit = crate::settings::current().unwrap_or_default().amx;
        if unit == crate::settings::Unit::Off {
            return false;
        }
        cpu_has_amx_bf16() && os_grants_tiles()
    })
}

fn cpu_has_amx_bf16() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    if __cpuid(0).eax < 7 {
        return false;
    }
    let l7 = __cpuid_count(7, 0);
    // EDX bit 22: AMX-BF16; bit 24: AMX-TILE.
    (l7.edx >> 22) & 1 == 1 && (l7.edx >> 24) & 1 == 1
}

#[cfg(target_os = "linux")]
fn os_grants_tiles() -> bool {
    /// `arch_prctl` request for permission to use an extended state component.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    /// The AMX tile data state component.
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: `arch_prctl(ARCH_REQ_XCOMP_PERM, 18)` only records a permission for this process
    // (all its threads) and returns 0, or an error when the kernel or CPU does not support it;
    // it reads and writes no memory of ours.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn os_grants_tiles() -> bool {
    false
}

/// `out[m×n] += x[m×k] · w[n×k]ᵀ` (all row-major; `out` holds the bias or zeros). Returns
/// false, with `out` untouched, when some `x` value is not a bf16 (its low 16 bits not zero):
/// then the caller runs the f32 path.
///
/// The caller guarantees [`available`], `x.len() == m·k`, `w.len() == n·k`, `out.len() == m·n`,
/// all non-zero.
pub(super) fn linear(out: &mut [f32], x: &[f32], m: usize, k: usize, w: &[u16], n: usize) -> bool {
    assert!(
        available() && x.len() == m * k && w.len() == n * k && out.len() == m * n,
        "amx::linear: caller broke its contract"
    );
    let steps = k / TK;
    // x row tiles, a whole number of pairs (a B pair covers 32 rows; rows past m are zero).
    let mtiles = m.div_ceil(32) * 2;
    let Some(xp) = pack_x(x, m, k, steps, mtiles) else {
        return false;
    };
    let dst = SendPtr(out.as_mut_ptr());
    let tasks = n.div_ceil(NC);
    let run = |t: usize| {
        let cols = t * NC..((t + 1) * NC).min(n);
        // SAFETY: AMX is available (asserted); `xp` is the packing of `x` for `steps` and
        // `mtiles`; `w` is n×k and `out` m×n (asserted); the task writes only output columns
        // `cols`, disjoint from every other task's, and `out` outlives the tasks.
        unsafe { task(dst.get(), x, &xp, w, m, k, n, cols) };
    };
    if tasks > 1 {
        (0..tasks).into_par_iter().for_each(run);
    } else {
        run(0);
    }
    true
}

/// `x` as B tiles: tile `(mt, s)` holds rows `16·mt ..` at depth `32·s ..` in the unit's pair
/// layout — u32 `(mt·steps + s)·256 + kp·16 + i` is `bf16(x[r][c]) | bf16(x[r][c+1]) << 16`
/// for `r = 16·mt + i` (zero when `r ≥ m`), `c = 32·s + 2·kp`. A bf16 is its f32's upper half,
/// so packing is a shift; `None` when some value (depth tail included) has a non-zero lower half.
fn pack_x(x: &[f32], m: usize, k: usize, steps: usize, mtiles: usize) -> Option<Vec<u32>> {
    let mut packed = vec![0u32; mtiles * steps * TILE];
    let per_tile_row = (steps * TILE).max(1);
    let exact = |mt: usize, tiles: &mut [u32]| -> bool {
        let mut low = 0u32;
        for i in 0..16 {
            let r = mt * 16 + i;
            if r >= m {
                break;
            }
            let row = &x[r * k..(r + 1) * k];
            for (s, tile) in tiles.chunks_exact_mut(TILE).enumerate() {
                let src = &row[s * TK..(s + 1) * TK];
                for kp in 0..16 {
                    let (a, b) = (src[2 * kp].to_bits(), src[2 * kp + 1].to_bits());
                    low |= (a | b) & 0xffff;
                    tile[kp * 16 + i] = (a >> 16) | (b & 0xffff_0000);
                }
            }
            for v in &row[steps * TK..] {
                low |= v.to_bits() & 0xffff;
            }
        }
        low == 0
    };
    let ok = if steps == 0 {
        (0..mtiles).all(|mt| exact(mt, &mut []))
    } else {
        packed
            .par_chunks_mut(per_tile_row)
            .enumerate()
            .with_min_len(4)
            .map(|(mt, tiles)| exact(mt, tiles))
            .reduce(|| true, |a, b| a && b)
    };
    ok.then_some(packed)
}

/// The tile configuration (palette 1): tmm0–3 the four 16×16 f32 sums, tmm4–5 two A tiles
/// (16 weight rows × 32 depth), tmm6–7 two B tiles (16 depth pairs × 16 x rows); each 16 rows
/// of 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = {
    let mut c = TileConfig {
        palette: 1,
        start_row: 0,
        reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
    };
    let mut t = 0;
    while t < 8 {
        c.colsb[t] = 64;
        c.rows[t] = 16;
        t += 1;
    }
    c
};

/// Output columns `cols` (weight rows), every x row and the whole depth.
///
/// # Safety
/// AMX-BF16 available and permitted; `out` points to an m×n row-major buffer of which nothing
/// else touches columns `cols` meanwhile; `cols` inside `0..n`, non-empty; `w.len() == n·k`,
/// `x.len() == m·k`; `xp` is [`pack_x`]'s packing of `x` for `steps = k / 32` and a whole
/// number of tile pairs of rows covering `m`.
#[allow(clippy::too_many_arguments)]
unsafe fn task(
    out: *mut f32,
    x: &[f32],
    xp: &[u32],
    w: &[u16],
    m: usize,
    k: usize,
    n: usize,
    cols: std::ops::Range<usize>,
) {
    let steps = k / TK;
    if steps > 0 {
        let mtiles = xp.len() / (steps * TILE);
        // A tiles: 16-row groups of the task's weight rows, in pairs, copied per depth block
        // into 1 KiB tiles ([group][step][16 rows][32]): contiguous loads, few pages; rows past
        // the task's last (a short group, a missing pair half) stay zero.
        let groups = (cols.end - cols.start).div_ceil(16);
        let pairs = groups.div_ceil(2);
        let block_steps = (KB / TK).min(steps);
        let mut panel = vec![0u16; 2 * pairs * block_steps * 2 * TILE];
        let mut sums = [0f32; 4 * TILE];
        // SAFETY: palette 1 with 8 tiles is what AMX-BF16 CPUs support; the config is 64 bytes.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly)) };
        for kb in (0..steps).step_by(KB / TK) {
            let ke = (kb + KB / TK).min(steps);
            let bs = ke - kb;
            for r in cols.clone() {
                let (g, i) = ((r - cols.start) / 16, (r - cols.start) % 16);
                let src = &w[r * k + kb * TK..r * k + ke * TK];
                for (s, piece) in src.chunks_exact(TK).enumerate() {
                    let at = ((g * bs + s) * 16 + i) * TK;
                    panel[at..at + TK].copy_from_slice(piece);
                }
            }
            for mb in 0..mtiles / 2 {
                let b0 = xp[(2 * mb) * steps * TILE..].as_ptr();
                let b1 = xp[(2 * mb + 1) * steps * TILE..].as_ptr();
                for p in 0..pairs {
                    let a0 = panel[(2 * p) * bs * 2 * TILE..].as_ptr();
                    let a1 = panel[(2 * p + 1) * bs * 2 * TILE..].as_ptr();
                    // SAFETY: A tiles read 1 KiB at tile (group, s − kb) of the panel (groups
                    // 2p, 2p + 1 < 2·pairs, s − kb < bs ≤ block_steps); B tiles read 1 KiB at
                    // tile (mt, s) of `xp`, inside it (s < steps, mt < mtiles); the stores
                    // write the 4 KiB of `sums`.
                    unsafe {
                        asm!(
                            "tilezero tmm0",
                            "tilezero tmm1",
                            "tilezero tmm2",
                            "tilezero tmm3",
                            options(nostack, nomem)
                        );
                        for s in kb..ke {
                            asm!(
                                "tileloadd tmm4, [{a0} + {sa}*1]",
                                "tileloadd tmm5, [{a1} + {sa}*1]",
                                "tileloadd tmm6, [{b0} + {sb}*1]",
                                "tileloadd tmm7, [{b1} + {sb}*1]",
                                "tdpbf16ps tmm0, tmm4, tmm6",
                                "tdpbf16ps tmm1, tmm4, tmm7",
                                "tdpbf16ps tmm2, tmm5, tmm6",
                                "tdpbf16ps tmm3, tmm5, tmm7",
                                a0 = in(reg) a0.add((s - kb) * 2 * TILE),
                                a1 = in(reg) a1.add((s - kb) * 2 * TILE),
                                b0 = in(reg) b0.add(s * TILE),
                                b1 = in(reg) b1.add(s * TILE),
                                sa = in(reg) 64usize,
                                sb = in(reg) 64usize,
                                options(nostack, readonly)
                            );
                        }
                        let c = sums.as_mut_ptr();
                        asm!(
                            "tilestored [{c0} + {s}*1], tmm0",
                            "tilestored [{c1} + {s}*1], tmm1",
                            "tilestored [{c2} + {s}*1], tmm2",
                            "tilestored [{c3} + {s}*1], tmm3",
                            c0 = in(reg) c,
                            c1 = in(reg) c.add(TILE),
                            c2 = in(reg) c.add(2 * TILE),
                            c3 = in(reg) c.add(3 * TILE),
                            s = in(reg) 64usize,
                            options(nostack)
                        );
                    }
                    // Sum tile q = (ga, gb): [jn·16 + im] = Σ w[row jn of group 2p + ga]·x[row
                    // 16·(2mb + gb) + im]; added to out[x row][weight row].
                    for (q, tile) in sums.chunks_exact(TILE).enumerate() {
                        let (ga, gb) = (q / 2, q % 2);
                        let r0 = cols.start + (2 * p + ga) * 16;
                        let i0 = (2 * mb + gb) * 16;
                        for im in 0..16.min(m.saturating_sub(i0)) {
                            for jn in 0..16.min(cols.end.saturating_sub(r0)) {
                                // SAFETY: x row i0 + im < m, weight row r0 + jn < cols.end ≤ n.
                                unsafe { *out.add((i0 + im) * n + r0 + jn) += tile[jn * 16 + im] };
                            }
                        }
                    }
                }
            }
        }
        // SAFETY: releases this thread's tile state (AMX available).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
    let tail = steps * TK;
    if tail < k {
        for i in 0..m {
            let xr = &x[i * k + tail..(i + 1) * k];
            for j in cols.clone() {
                let wr = &w[j * k + tail..(j + 1) * k];
                let mut acc = 0f32;
                for (a, &b) in xr.iter().zip(wr) {
                    acc = a.mul_add(petite_dtype::bf16_bits_to_f32(b), acc);
                }
                // SAFETY: row i < m, column j < n; columns `cols` are this task's alone.
                unsafe { *out.add(i * n + j) += acc };
            }
        }
    }
}
