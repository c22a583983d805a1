//! GEMM through the `gemm` crate: f32 inputs, f32 accumulation, in one summation order whatever
//! the shape, the thread count or the CPU (see [`gemm_f32`]): threads split the output into
//! blocks (`gemm_is_thread_count_independent`), the depth is cut into fixed chunks of
//! [`DEPTH_CHUNK`] (below `gemm`'s smallest cache-derived depth block, so its own blocking,
//! which depends on the CPU's cache sizes, never cuts further), and the shapes for which `gemm`
//! switches to kernels whose order depends on the vector width (`m·n ≤ 256`, `m ≤ 1`, `n ≤ 1`,
//! `k ≤ 2`) run through a plain fused-multiply-add loop of the same order instead
//! (`gemm_follows_one_summation_order_whatever_the_shape`). So exported bytes that come from this
//! executor (`step.pte`'s timestep table) are the same on x86-64 and aarch64.
//!
//! Soundness: the only `unsafe` is the call into `gemm::gemm`, which reads and writes through raw
//! pointers and strides. Every [`MatRef`] is checked when it is made (private fields, checked
//! arithmetic), so any view a safe caller can hold lies inside its slice and has strides that fit
//! in `isize`; [`gemm_f32`] checks the shapes against each other and the output length with
//! checked arithmetic before it reaches the unsafe call.

use crate::{Result, kerr};
use gemm::Parallelism;
use rayon::prelude::*;

/// A strided read-only matrix view: element (r, c) is `data[r * rs + c * cs]`.
///
/// Made only through [`MatRef::new`] / [`MatRef::row_major`], which refuse a view whose furthest
/// element lies outside `data` (computed with checked arithmetic) or whose strides do not fit in
/// `isize`; [`MatRef::t`] keeps both properties. So every value of this type is safe to hand to
/// the unsafe GEMM.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a> MatRef<'a> {
    /// A `rows × cols` view of `data` with row stride `rs` and column stride `cs` (elements).
    ///
    /// Errors when a stride does not fit in `isize`, or when the view is not empty and its
    /// furthest element, `(rows - 1) * rs + (cols - 1) * cs`, overflows `usize` or is not below
    /// `data.len()`. An empty view (`rows` or `cols` zero) reads nothing and needs only the
    /// stride check.
    pub fn new(data: &'a [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Result<Self> {
        let bad = |why: &str| {
            kerr(
                "gemm",
                format!(
                    "{rows}x{cols} view with strides ({rs}, {cs}) over {} elements: {why}",
                    data.len()
                ),
            )
        };
        if isize::try_from(rs).is_err() || isize::try_from(cs).is_err() {
            return Err(bad("a stride does not fit in isize"));
        }
        if rows != 0 && cols != 0 {
            let last = (rows - 1)
                .checked_mul(rs)
                .zip((cols - 1).checked_mul(cs))
                .and_then(|(a, b)| a.checked_add(b));
            match last {
                None => return Err(bad("the furthest element's offset overflows")),
                Some(l) if l >= data.len() => {
                    return Err(bad(&format!("the furthest element is at offset {l}")));
                }
                Some(_) => {}
            }
        }
        Ok(MatRef {
            data,
            rows,
            cols,
            rs,
            cs,
        })
    }

    /// A contiguous row-major `rows × cols` matrix over the start of `data` (which may be
    /// longer). Errors as [`MatRef::new`] does.
    pub fn row_major(data: &'a [f32], rows: usize, cols: usize) -> Result<Self> {
        Self::new(data, rows, cols, cols, 1)
    }

    /// The transpose (a view; no copy). It reads the same elements, so it stays in bounds.
    pub fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// (row stride, column stride), in elements.
    pub fn strides(&self) -> (usize, usize) {
        (self.rs, self.cs)
    }

    /// The slice the view reads (every element of the view lies inside it).
    #[cfg(target_arch = "x86_64")]
    pub(super) fn data(&self) -> &'a [f32] {
        self.data
    }

    /// (row stride, column stride) as `gemm` takes them. [`MatRef::new`] checked that both fit,
    /// so this never errs; it converts rather than casts so that it could not wrap if it did.
    fn strides_isize(&self) -> Result<(isize, isize)> {
        match (isize::try_from(self.rs), isize::try_from(self.cs)) {
            (Ok(rs), Ok(cs)) => Ok((rs, cs)),
            _ => Err(kerr("gemm", "a stride does not fit in isize")),
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
pub(super) struct SendPtr(pub(super) *mut f32);
// SAFETY: a raw pointer is neither Send nor Sync only as a lint against accidental sharing. This
// one is used only inside `gemm_f32` and `avx512::gemm`, to hand disjoint output blocks of one exclusively borrowed
// `dst` to rayon tasks, all of which finish before `gemm_f32` returns (and so before the borrow
// ends); no two tasks write the same element and nothing reads `dst` meanwhile.
unsafe impl Send for SendPtr {}
// SAFETY: as for `Send` above: tasks share the pointer value, never an element.
unsafe impl Sync for SendPtr {}
impl SendPtr {
    /// The pointer (a method, so closures capture the whole `Sync` wrapper).
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}

/// Largest depth chunk: `gemm` 0.19 blocks the depth by `max(512, cache-derived).min(k)`, so a
/// call with `k ≤ 512` is never cut, on any CPU.
pub const DEPTH_CHUNK: usize = 512;

/// The depth `0..k` as `ceil(k / DEPTH_CHUNK)` near-equal chunks `(start, length)` (the first
/// ones one longer): each at most [`DEPTH_CHUNK`], none of 1 or 2 when `k > 2` (which `gemm`
/// would compute with its ISA-ordered outer-product kernel).
pub fn depth_chunks(k: usize) -> Vec<(usize, usize)> {
    near_equal_pieces(k, k.div_ceil(DEPTH_CHUNK).max(1))
}

/// `0..len` in `pieces` consecutive pieces whose lengths differ by at most one (the longer
/// first), as (start, length).
pub(super) fn near_equal_pieces(len: usize, pieces: usize) -> Vec<(usize, usize)> {
    let (q, r) = (len / pieces, len % pieces);
    let mut start = 0;
    (0..pieces)
        .map(|i| {
            let l = q + usize::from(i < r);
            let c = (start, l);
            start += l;
            c
        })
        .collect()
}

/// Largest output tile (`m·n`) `gemm` 0.19 computes with its horizontal (dot-product) kernels,
/// whose summation order follows the vector width.
const SMALL_OUTPUT: usize = 16 * 16;

/// Shapes `gemm` 0.19 would hand to kernels whose order depends on the ISA (horizontal kernels,
/// GEMV, the `k ≤ 2` outer product).
fn ordered_by_isa(m: usize, k: usize, n: usize) -> bool {
    k <= 2 || m <= 1 || n <= 1 || m * n <= SMALL_OUTPUT
}

/// `dst[m×n] (row-major, contiguous) = (accumulate ? dst : 0) + lhs[m×k] · rhs[k×n]`.
///
/// Summation order, the same on every CPU with fused multiply-add (x86-64 with FMA, aarch64):
/// each output is `(…((d + s₀) + s₁) + …)` where `d` is the output (or the first chunk's sum
/// when not accumulating) and `sᵢ` the fused-multiply-add chain, from zero, over depth chunk
/// `i` of [`depth_chunks`]. `parallel` lets `gemm` use the rayon pool; inside an outer parallel
/// loop pass `false`.
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
    if m.checked_mul(n) != Some(dst.len()) {
        return Err(kerr(
            "gemm",
            format!("dst has {} elements, expected {m}x{n}", dst.len()),
        ));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            dst.fill(0.0);
        }
        return Ok(());
    }
    if ordered_by_isa(m, k, n) {
        fma_loop(dst, lhs, rhs, accumulate);
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if lhs.cs == 1 && super::avx512::available() {
        super::avx512::gemm(dst, lhs, super::avx512::Rhs::F32(rhs), accumulate, parallel);
        return Ok(());
    }
    let (lhs_rs, lhs_cs) = lhs.strides_isize()?;
    let (rhs_rs, rhs_cs) = rhs.strides_isize()?;
    // dst.len() == m * n and a slice holds at most isize::MAX bytes, so n fits.
    let dst_rs = isize::try_from(n).map_err(|_| kerr("gemm", "n does not fit in isize"))?;
    // Threads take whole output blocks (independent single-threaded GEMMs, work-stealing, no
    // barriers: robust on a shared machine). Block boundaries depend only on the shape, and
    // within a block gemm's depth loop is fixed, so results never depend on the thread count.
    let split = if parallel {
        split_for(m, n)
    } else {
        Split::None
    };
    let chunks = depth_chunks(k);
    let dst_ptr = SendPtr(dst.as_mut_ptr());
    let block = |i0: usize, mi: usize, j0: usize, nj: usize| {
        // SAFETY: `gemm::gemm` reads lhs (mi×k from row i0) and rhs (k×nj from column j0) and
        // writes dst (mi×nj at (i0, j0)) through these pointers and strides.
        // - In bounds: `MatRef::new` checked, with checked arithmetic, that every element of each
        //   full view lies inside its slice, and the sub-views start at row i0 < m of lhs and
        //   column j0 < n of rhs, so `add(i0 * rs)` / `add(j0 * cs)` stay in the slice (their
        //   products are at most the checked furthest offset, so they do not overflow) and so
        //   does every element the call reads. dst is m×n contiguous (length checked above),
        //   i0 + mi <= m and j0 + nj <= n, so every element written is inside dst.
        // - Strides are the checked `isize` conversions, not casts.
        // - Aliasing: dst is `&mut` (exclusive), lhs and rhs are shared borrows that cannot
        //   alias it; distinct blocks write disjoint elements and all finish before we return.
        // - dst is initialised f32, so reading it when `accumulate` is fine.
        // - Depth chunks: chunk (p0, kc) reads lhs columns p0..p0+kc and rhs rows p0..p0+kc,
        //   which lie inside the checked k×… views (p0 + kc <= k), so `add(p0 * cs)` /
        //   `add(p0 * rs)` are offsets of elements of the same views.
        for (c, &(p0, kc)) in chunks.iter().enumerate() {
            debug_assert!(!ordered_by_isa(mi, kc, nj), "{mi}x{kc}x{nj}");
            unsafe {
                gemm::gemm(
                    mi,
                    nj,
                    kc,
                    dst_ptr.get().add(i0 * n + j0),
                    1,
                    dst_rs,
                    accumulate || c > 0,
                    lhs.data.as_ptr().add(i0 * lhs.rs + p0 * lhs.cs),
                    lhs_cs,
                    lhs_rs,
                    rhs.data.as_ptr().add(j0 * rhs.cs + p0 * rhs.rs),
                    rhs_cs,
                    rhs_rs,
                    1.0,
                    1.0,
                    false,
                    false,
                    false,
                    Parallelism::None,
                );
            }
        }
    };
    match split {
        Split::None => block(0, m, 0, n),
        Split::Cols(nb) => cut(n, nb, m)
            .into_par_iter()
            .for_each(|(j0, nj)| block(0, m, j0, nj)),
        Split::Rows(mb) => cut(m, mb, n)
            .into_par_iter()
            .for_each(|(i0, mi)| block(i0, mi, 0, n)),
    }
    Ok(())
}

/// `len` cut into blocks of `size` as `(start, length)`; a last block that `gemm` would run
/// with an ISA-ordered kernel (width 1, or at most [`SMALL_OUTPUT`] outputs against the
/// `other` dimension) joins the one before it. A function of the shape only.
fn cut(len: usize, size: usize, other: usize) -> Vec<(usize, usize)> {
    let mut v: Vec<(usize, usize)> = (0..len)
        .step_by(size)
        .map(|s| (s, size.min(len - s)))
        .collect();
    if v.len() > 1
        && let Some(&(_, last)) = v.last()
        && (last <= 1 || last * other <= SMALL_OUTPUT)
    {
        v.pop();
        if let Some(prev) = v.last_mut() {
            prev.1 += last;
        }
    }
    v
}

/// The order [`gemm_f32`] promises, as a plain loop: per output, fused multiply-adds over each
/// depth chunk from zero, each chunk's sum added to the output in turn. For the shapes `gemm`
/// would run with ISA-ordered kernels (small, so the loop's speed does not matter).
fn fma_loop(dst: &mut [f32], lhs: MatRef<'_>, rhs: MatRef<'_>, accumulate: bool) {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    let chunks = depth_chunks(k);
    for i in 0..m {
        for j in 0..n {
            let o = &mut dst[i * n + j];
            for &(p0, kc) in &chunks {
                let mut acc = 0.0f32;
                for p in p0..p0 + kc {
                    let a = lhs.data[i * lhs.rs + p * lhs.cs];
                    let b = rhs.data[p * rhs.rs + j * rhs.cs];
                    acc = a.mul_add(b, acc);
                }
                *o = if p0 == 0 && !accumulate {
                    acc
                } else {
                    *o + acc
                };
            }
        }
    }
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
    linear_of(x, rows, Weight::F32(w), n, bias, false)
}

/// [`linear`] with the weight as bf16 bits (`[n×k]`, as a bf16 export stores it): the result
/// is [`linear`]'s on the exactly widened weight, bit for bit. On AVX-512 the bits are widened
/// while the product packs them, so no f32 copy of the weight is made.
pub fn linear_bf16(
    x: &[f32],
    rows: usize,
    w: &[u16],
    n: usize,
    bias: Option<&[f32]>,
) -> Result<Vec<f32>> {
    linear_of(x, rows, Weight::Bf16(w), n, bias, false)
}

/// [`linear_bf16`] for a caller that accepts sums in the CPU's own order: when every `x` value
/// is a bf16 (a bf16 program's activations), the product runs on the CPU's bf16 unit where there
/// is one ([`cpu_bf16_unit`]) — bf16 products are exact in f32, so the result differs from
/// [`linear_bf16`]'s only by f32 rounding of the sums, but it is not the same bits on every CPU.
/// Elsewhere it is [`linear_bf16`]. Never for bytes that are exported.
pub fn linear_bf16_any_order(
    x: &[f32],
    rows: usize,
    w: &[u16],
    n: usize,
    bias: Option<&[f32]>,
) -> Result<Vec<f32>> {
    linear_of(x, rows, Weight::Bf16(w), n, bias, true)
}

/// The unit [`linear_bf16_any_order`] runs on here, if not the exact f32 path: AMX-BF16's tile
/// unit (present, permitted by the OS, not turned off with `PETITE_CPU_AMX=off`), else
/// AVX512-BF16's dot products (on AMD CPUs, where they double the f32 FMA's multiply-add rate;
/// `PETITE_CPU_DPBF16=on|off` overrides).
pub fn cpu_bf16_unit() -> Option<Bf16Unit> {
    #[cfg(target_arch = "x86_64")]
    {
        if super::amx::available() {
            return Some(Bf16Unit::AmxTiles);
        }
        if super::dpbf16::available() {
            return Some(Bf16Unit::Avx512DotProducts);
        }
    }
    None
}

/// A CPU unit for bf16 products ([`cpu_bf16_unit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Unit {
    /// Intel AMX-BF16 (`tdpbf16ps`).
    AmxTiles,
    /// AVX512-BF16 (`vdpbf16ps`).
    Avx512DotProducts,
}

impl std::fmt::Display for Bf16Unit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Bf16Unit::AmxTiles => "AMX-BF16 tile unit",
            Bf16Unit::Avx512DotProducts => "AVX512-BF16 dot products",
        })
    }
}

/// A linear's `[n×k]` weight as stored.
#[derive(Clone, Copy)]
enum Weight<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

fn linear_of(
    x: &[f32],
    rows: usize,
    w: Weight<'_>,
    n: usize,
    bias: Option<&[f32]>,
    any_order: bool,
) -> Result<Vec<f32>> {
    let w_len = match w {
        Weight::F32(w) => w.len(),
        Weight::Bf16(w) => w.len(),
    };
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
    if n.checked_mul(k) != Some(w_len) {
        return Err(kerr(
            "linear",
            format!("weight has {w_len} elements, expected [{n}, {k}]"),
        ));
    }
    let len = rows
        .checked_mul(n)
        .ok_or_else(|| kerr("linear", format!("{rows}x{n} output overflows")))?;
    let mut out = vec![0.0f32; len];
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
    let lhs = MatRef::row_major(x, rows, k)?;
    let widened: Vec<f32>;
    let w = match w {
        Weight::F32(w) => w,
        Weight::Bf16(bits) => {
            #[cfg(target_arch = "x86_64")]
            if any_order && k > 0 && n > 0 {
                let done = match cpu_bf16_unit() {
                    Some(Bf16Unit::AmxTiles) => super::amx::linear(&mut out, x, rows, k, bits, n),
                    Some(Bf16Unit::Avx512DotProducts) => {
                        super::dpbf16::linear(&mut out, x, rows, k, bits, n, accumulate)
                    }
                    None => false,
                };
                if done {
                    return Ok(out);
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = any_order;
            #[cfg(target_arch = "x86_64")]
            if !ordered_by_isa(rows, k, n) && super::avx512::available() {
                // The checks above: x is rows×k (row stride k, column stride 1), bits n×k.
                let rhs = super::avx512::Rhs::Bf16T { bits, k, n };
                super::avx512::gemm(&mut out, lhs, rhs, accumulate, true);
                return Ok(out);
            }
            widened = bits
                .par_iter()
                .with_min_len(1 << 15)
                .map(|&b| petite_dtype::bf16_bits_to_f32(b))
                .collect();
            &widened
        }
    };
    gemm_f32(
        &mut out,
        lhs,
        MatRef::row_major(w, n, k)?.t(),
        accumulate,
        true,
    )?;
    Ok(out)
}

/// Batched matmul `a[batch, m, k] · b[batch, k, n]` → `[batch, m, n]`, where a batch index maps
/// to an offset in each operand (`a_off[i]`, `b_off[i]`, elements) so broadcast batches share
/// storage. Consecutive batches sharing their rhs run as one product; products run in parallel
/// when there are several, a single one parallelises inside.
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
    let len = batch
        .checked_mul(m)
        .and_then(|x| x.checked_mul(n))
        .ok_or_else(|| kerr("matmul", format!("{batch}x{m}x{n} output overflows")))?;
    let mut out = vec![0.0f32; len];
    if len == 0 {
        return Ok(out);
    }
    // Consecutive batches that read the same rhs and whose lhs follow each other in memory (the
    // query heads of one KV head, broadcast over the heads) are one product of their stacked
    // rows: the rhs is packed once for all of them. Each output is its own fused-multiply-add
    // chain whatever the number of rows, so this gives every batch's bits.
    let mut runs: Vec<(usize, usize)> = Vec::new(); // (first batch, batches)
    for i in 0..batch {
        match runs.last_mut() {
            Some((first, count))
                if b_off[*first] == b_off[i]
                    && Some(a_off[i])
                        == m.checked_mul(k)
                            .and_then(|mk| mk.checked_mul(*count))
                            .and_then(|o| o.checked_add(a_off[*first])) =>
            {
                *count += 1
            }
            _ => runs.push((i, 1)),
        }
    }
    let one = |(first, count): (usize, usize), dst: &mut [f32], parallel: bool| -> Result<()> {
        let rows = m * count;
        let aa = a
            .get(a_off[first]..)
            .ok_or_else(|| kerr("matmul", format!("batch {first}: lhs offset out of range")))?;
        let bb = b
            .get(b_off[first]..)
            .ok_or_else(|| kerr("matmul", format!("batch {first}: rhs offset out of range")))?;
        gemm_f32(
            dst,
            MatRef::row_major(aa, rows, k)?,
            MatRef::row_major(bb, k, n)?,
            false,
            parallel,
        )
    };
    if let [run] = runs[..] {
        one(run, &mut out[..], true)?;
    } else {
        let mut parts: Vec<((usize, usize), &mut [f32])> = Vec::with_capacity(runs.len());
        let mut rest = &mut out[..];
        for &run in &runs {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(run.1 * m * n);
            parts.push((run, head));
            rest = tail;
        }
        parts
            .into_par_iter()
            .try_for_each(|(run, dst)| one(run, dst, false))?;
    }
    Ok(out)
}

/// Shapes `(m, k, n)` of [`summation_order_check`]: each of `gemm`'s shape-chosen paths and
/// both sides of its thresholds.
pub const ORDER_SHAPES: [(usize, usize, usize); 17] = [
    (10, 24, 24),
    (10, 16, 16),
    (16, 16, 16),
    (10, 32, 32),
    (1, 600, 300),
    (300, 600, 1),
    (70, 2, 70),
    (70, 1, 70),
    (3, 1000, 70),
    (20, 513, 40),
    (20, 514, 40),
    (10, 1024, 96),
    (64, 1100, 64),
    (24, 1537, 300),
    (300, 40, 1025),
    (1025, 40, 70),
    (1000, 40, 100),
];

/// Checks on this machine that [`gemm_f32`] follows the summation order it documents, bit for
/// bit, against an independent `mul_add` loop: every shape of [`ORDER_SHAPES`], seeded output or
/// not, rhs row-major or transposed (as linear weights are), split across threads or not.
/// Returns the number of shapes checked, or the first mismatch.
pub fn summation_order_check() -> std::result::Result<usize, String> {
    fn view(r: Result<MatRef<'_>>) -> std::result::Result<MatRef<'_>, String> {
        r.map_err(|e| e.to_string())
    }
    let seq = |len: usize, seed: u32| -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                ((s >> 8) as f32 / (1u32 << 24) as f32) - 0.5
            })
            .collect()
    };
    for &(m, k, n) in &ORDER_SHAPES {
        let a = seq(m * k, 11);
        let b = seq(k * n, 12);
        let mut bt = vec![0.0f32; k * n];
        for p in 0..k {
            for j in 0..n {
                bt[j * k + p] = b[p * n + j];
            }
        }
        let bias = seq(m * n, 13);
        for seed in [None, Some(&bias[..])] {
            // The order, spelled out: per output, fused multiply-adds from zero over each depth
            // chunk, each chunk's sum added to the output in turn.
            let mut want = seed.map_or_else(|| vec![0.0f32; m * n], <[f32]>::to_vec);
            for i in 0..m {
                for j in 0..n {
                    for (c, &(p0, kc)) in depth_chunks(k).iter().enumerate() {
                        let mut acc = 0.0f32;
                        for p in p0..p0 + kc {
                            acc = a[i * k + p].mul_add(b[p * n + j], acc);
                        }
                        let o = &mut want[i * n + j];
                        *o = if c == 0 && seed.is_none() {
                            acc
                        } else {
                            *o + acc
                        };
                    }
                }
            }
            for (parallel, transposed) in [(false, false), (true, false), (true, true)] {
                let mut d = seed.map_or_else(|| vec![7.0f32; m * n], <[f32]>::to_vec);
                let rhs = if transposed {
                    view(MatRef::row_major(&bt, n, k))?.t()
                } else {
                    view(MatRef::row_major(&b, k, n))?
                };
                gemm_f32(
                    &mut d,
                    view(MatRef::row_major(&a, m, k))?,
                    rhs,
                    seed.is_some(),
                    parallel,
                )
                .map_err(|e| e.to_string())?;
                if let Some(at) = d
                    .iter()
                    .zip(&want)
                    .position(|(x, y)| x.to_bits() != y.to_bits())
                {
                    return Err(format!(
                        "{m}x{k}x{n} (parallel {parallel}, transposed {transposed}, seeded {}): output {at} is {:e}, the order gives {:e}",
                        seed.is_some(),
                        d[at],
                        want[at]
                    ));
                }
            }
        }
    }
    Ok(ORDER_SHAPES.len())
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

    /// `n` pseudo-random values in [-0.5, 0.5) from `seed` (an LCG: the same on every CPU).
    pub(super) fn seq(n: usize, seed: u32) -> Vec<f32> {
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

    /// Bit for bit the order [`gemm_f32`] documents, on both sides of every path `gemm` would
    /// otherwise choose by shape (its ISA-dependent small-matrix kernels: `m·n ≤ 256`, `m ≤ 1`,
    /// `n ≤ 1`, `k ≤ 2`; its cache-dependent depth blocking above 512; thread blocks with a
    /// narrow tail): the result depends on the inputs only, not on the CPU's vector width or
    /// cache sizes. `petite doctor` runs the same check on the machine it runs on.
    #[test]
    fn gemm_follows_one_summation_order_whatever_the_shape() {
        assert_eq!(summation_order_check(), Ok(ORDER_SHAPES.len()));
    }

    #[test]
    fn depth_chunks_cover_the_depth_in_near_equal_pieces() {
        for k in [1, 2, 3, 511, 512, 513, 514, 1024, 1025, 1537, 16384] {
            let c = depth_chunks(k);
            assert_eq!(c.len(), k.div_ceil(DEPTH_CHUNK));
            assert_eq!(c[0].0, 0);
            assert!(c.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0));
            assert_eq!(c.last().map(|&(s, l)| s + l), Some(k));
            assert!(
                c.iter()
                    .all(|&(_, l)| l <= DEPTH_CHUNK && (k <= 2 || l > 2)),
                "{k}: {c:?}"
            );
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
                        MatRef::row_major(&a, m, k).unwrap(),
                        MatRef::row_major(&b, k, n).unwrap(),
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
            MatRef::row_major(&a, m, k).unwrap(),
            MatRef::row_major(&b, k, n).unwrap(),
            false,
            false,
        )
        .unwrap();
        gemm_f32(
            &mut d2,
            MatRef::row_major(&a, m, k).unwrap(),
            MatRef::row_major(&b, k, n).unwrap(),
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

    /// Batches that share their rhs run as one product of stacked rows: each batch's bits are
    /// those of its own product (runs of 3, 2 and 1 shared rhs; lhs in order and out of order).
    #[test]
    fn batches_sharing_a_rhs_give_their_own_bits() {
        let (m, k, n) = (37usize, 40usize, 70usize);
        let val = |i: usize| ((i * 7919) % 1009) as f32 / 1009.0 - 0.5;
        let a: Vec<f32> = (0..6 * m * k).map(val).collect();
        let b: Vec<f32> = (0..2 * k * n).map(|i| val(i + 13)).collect();
        let b_off = [0, 0, 0, k * n, k * n, 0];
        for a_off in [
            [0, 1, 2, 3, 4, 5].map(|i| i * m * k),
            [5, 4, 3, 2, 1, 0].map(|i| i * m * k),
        ] {
            let y = matmul_batched(&a, &a_off, &b, &b_off, m, k, n).unwrap();
            assert_eq!(y.len(), 6 * m * n);
            for i in 0..6 {
                let mut want = vec![0.0f32; m * n];
                gemm_f32(
                    &mut want,
                    MatRef::row_major(&a[a_off[i]..], m, k).unwrap(),
                    MatRef::row_major(&b[b_off[i]..], k, n).unwrap(),
                    false,
                    false,
                )
                .unwrap();
                let got = &y[i * m * n..][..m * n];
                assert!(got.iter().all(|x| x.is_finite()));
                let same = got
                    .iter()
                    .zip(&want)
                    .all(|(x, w)| x.to_bits() == w.to_bits());
                assert!(same, "batch {i} of {a_off:?} differs");
            }
        }
    }

    #[test]
    fn shape_errors_not_panics() {
        assert!(linear(&[1., 2., 3.], 1, &[1., 2.], 1, None).is_err());
        assert!(linear(&[1., 2.], 1, &[1., 2.], 1, Some(&[1., 2.])).is_err());
        // a view larger than its slice is refused when it is made
        assert!(MatRef::row_major(&[1.0; 3], 2, 2).is_err());
        // shapes that do not chain, and a dst of the wrong length
        let a = [1.0; 4];
        let (a2, a3) = (
            MatRef::row_major(&a, 2, 2).unwrap(),
            MatRef::row_major(&a, 1, 3).unwrap(),
        );
        let mut d = vec![0.0; 4];
        assert!(gemm_f32(&mut d, a2, a3, false, false).is_err());
        assert!(gemm_f32(&mut d[..3], a2, a2, false, false).is_err());
        assert!(gemm_f32(&mut d, a2, a2, false, false).is_ok());
    }
}

#[cfg(test)]
mod soundness {
    //! No safe call reaches the unsafe GEMM with geometry outside its slices or strides that do
    //! not fit in `isize`.
    use super::*;
    use proptest::prelude::*;

    /// What `MatRef::new` must answer, computed in u128 (no overflow possible).
    fn in_bounds(len: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> bool {
        let fits = rs <= isize::MAX as usize && cs <= isize::MAX as usize;
        if rows == 0 || cols == 0 {
            return fits;
        }
        // each product is below 2^128; their sum may not be, and then it is out of bounds
        let last = ((rows as u128 - 1) * rs as u128).checked_add((cols as u128 - 1) * cs as u128);
        fits && last.is_some_and(|l| l < len as u128)
    }

    #[test]
    fn overflowing_geometry_is_refused() {
        let one = [1.0f32; 1];
        let big = isize::MAX as usize;
        // (rows-1)*rs + (cols-1)*cs = (2^64 - 2) + 2 wraps to 0 < 1: a plain `+` let this through.
        assert!(MatRef::new(&one, 3, 2, big, 2).is_err());
        // the product itself overflows
        assert!(MatRef::new(&one, 4, 1, big, 1).is_err());
        assert!(MatRef::new(&one, usize::MAX, 2, 2, 0).is_err());
        // strides that `as isize` would turn negative, even where the offset is 0
        assert!(MatRef::new(&one, 1, 1, usize::MAX, 1).is_err());
        assert!(MatRef::new(&one, 1, 1, 1, big + 1).is_err());
        assert!(MatRef::new(&one, 0, 5, usize::MAX, 1).is_err());
        // the transpose of a refused view cannot be made: t() only takes a checked view
        assert!(MatRef::new(&one, 2, 1, 1, 1).is_err());
        assert!(MatRef::new(&one, 1, 2, 1, 1).is_err());
        // the largest strides that fit are fine where they are not used
        assert!(MatRef::new(&one, 1, 1, big, big).is_ok());
        // one element short / exactly enough
        let six = [0.0f32; 6];
        assert!(MatRef::new(&six, 2, 3, 4, 1).is_err()); // furthest offset 6
        assert!(MatRef::new(&six, 2, 3, 3, 1).is_ok()); // furthest offset 5
    }

    #[test]
    fn dst_length_overflow_is_refused() {
        // Broadcast (zero-stride) views may be arbitrarily large over one element, so m * n can
        // overflow: 2^32 * 2^32 wraps to 0, which must not match an empty dst.
        let one = [1.0f32; 1];
        let lhs = MatRef::new(&one, 1 << 32, 1, 0, 0).unwrap();
        let rhs = MatRef::new(&one, 1, 1 << 32, 0, 0).unwrap();
        let mut dst: [f32; 0] = [];
        assert!(gemm_f32(&mut dst, lhs, rhs, false, false).is_err());
        assert!(gemm_f32(&mut dst, lhs, rhs, true, true).is_err());
    }

    #[test]
    fn oversized_shapes_in_wrappers_are_errors() {
        assert!(matmul_batched(&[], &[0, 0], &[], &[0, 0], 1 << 32, 0, 1 << 32).is_err());
        assert!(matmul_batched(&[1.0], &[0], &[1.0], &[0], 1, 1, 2).is_err());
        assert!(linear(&[1.0], 1, &[1.0], usize::MAX, None).is_err());
    }

    #[test]
    fn broadcast_views_compute() {
        // zero strides are legal: every element reads the same value
        let a = [2.0f32];
        let b = [3.0f32, 5.0];
        let lhs = MatRef::new(&a, 3, 4, 0, 0).unwrap();
        let rhs = MatRef::new(&b, 4, 2, 0, 1).unwrap();
        let mut d = vec![0.0; 6];
        gemm_f32(&mut d, lhs, rhs, false, false).unwrap();
        assert_eq!(d, vec![24.0, 40.0, 24.0, 40.0, 24.0, 40.0]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Whatever kernel this CPU runs (the AVX-512 one here when the CPU has it, with its
        /// column masks, row tails, packed or in-place rhs and depth chunks), `gemm_f32` gives
        /// the plain loop's bits.
        #[test]
        fn gemm_gives_the_plain_loops_bits(
            m in 1usize..40, k in 3usize..1100, n in 2usize..80,
            rt in any::<bool>(), acc in any::<bool>(), par in any::<bool>(),
        ) {
            let seq = super::tests::seq;
            let a = seq(m * k, 7);
            let b = seq(k * n, 8);
            let lhs = MatRef::row_major(&a, m, k).unwrap();
            // rt: b read as the transpose of an n×k matrix (a linear's weight)
            let rhs = if rt {
                MatRef::row_major(&b, n, k).unwrap().t()
            } else {
                MatRef::row_major(&b, k, n).unwrap()
            };
            let seed = seq(m * n, 9);
            let mut want = seed.clone();
            fma_loop(&mut want, lhs, rhs, acc);
            let mut got = seed;
            gemm_f32(&mut got, lhs, rhs, acc, par).unwrap();
            let bad = got.iter().zip(&want).position(|(x, y)| x.to_bits() != y.to_bits());
            prop_assert!(bad.is_none(), "{}x{}x{} at {:?}", m, k, n, bad);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// Tall products (on AVX-512: the lhs row tiles copied into panels, 16-block tasks),
        /// f32 or bf16 weight, bias or not: the plain loop's bits on the (widened) weight.
        #[test]
        fn tall_products_give_the_plain_loops_bits(
            m in 96usize..230, k in 3usize..1100, n in 2usize..600,
            bf16 in any::<bool>(), bias in any::<bool>(),
        ) {
            let seq = super::tests::seq;
            let x = seq(m * k, 3);
            let bits: Vec<u16> = seq(n * k, 4).iter().map(|&v| petite_dtype::bf16_bits(v)).collect();
            let w: Vec<f32> = if bf16 {
                bits.iter().map(|&b| petite_dtype::bf16_bits_to_f32(b)).collect()
            } else {
                seq(n * k, 4)
            };
            let b = seq(n, 5);
            let mut want = vec![0.0f32; m * n];
            if bias {
                want.chunks_exact_mut(n).for_each(|r| r.copy_from_slice(&b));
            }
            let lhs = MatRef::row_major(&x, m, k).unwrap();
            fma_loop(&mut want, lhs, MatRef::row_major(&w, n, k).unwrap().t(), bias);
            let bias = bias.then_some(b.as_slice());
            let got = if bf16 {
                linear_bf16(&x, m, &bits, n, bias).unwrap()
            } else {
                linear(&x, m, &w, n, bias).unwrap()
            };
            let bad = got.iter().zip(&want).position(|(p, q)| p.to_bits() != q.to_bits());
            prop_assert!(bad.is_none(), "{}x{}x{} at {:?}", m, k, n, bad);
        }
    }

    /// `|got − exact| ≤ (k + 2)·2⁻²⁴·(|bias| + Σ|xᵢ·wᵢ|)` per output, the exact value and the
    /// sum of magnitudes in f64: the bound of any f32 summation order of exact products.
    fn within_any_order_bound(
        got: &[f32],
        x: &[f32],
        m: usize,
        w: &[f32],
        n: usize,
        bias: Option<&[f32]>,
    ) -> std::result::Result<(), String> {
        let k = x.len() / m;
        if got.len() != m * n {
            return Err(format!("{} outputs, expected {}", got.len(), m * n));
        }
        for i in 0..m {
            for j in 0..n {
                let b = bias.map_or(0.0, |b| b[j] as f64);
                let (mut exact, mut mag) = (b, b.abs());
                for p in 0..k {
                    let t = x[i * k + p] as f64 * w[j * k + p] as f64;
                    exact += t;
                    mag += t.abs();
                }
                let g = got[i * n + j] as f64;
                let bound = (k + 2) as f64 * f32::EPSILON as f64 / 2.0 * mag;
                if !g.is_finite() || (g - exact).abs() > bound {
                    return Err(format!("({i}, {j}): {g} vs exact {exact}, bound {bound:e}"));
                }
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// bf16 activations and weights in any order (on AMX-BF16 CPUs the tile unit; its
        /// depth blocks, 16-row weight tails, x row padding and depth tails): within the error
        /// bound of any f32 summation of the exact products, and, where the tiles are not used,
        /// `linear_bf16`'s bits.
        #[test]
        fn any_order_bf16_is_within_the_summation_bound(
            m in 1usize..70, k in 1usize..300, n in 1usize..300, bias in any::<bool>(),
            deep in any::<bool>(),
        ) {
            let k = if deep { k + 2040 } else { k };
            let n = if deep { n.min(40) } else { n };
            let seq = super::tests::seq;
            let round = |v: Vec<f32>| -> Vec<f32> {
                v.into_iter().map(petite_dtype::round_through_bf16).collect()
            };
            let x = round(seq(m * k, 11));
            let bits: Vec<u16> = seq(n * k, 12).iter().map(|&v| petite_dtype::bf16_bits(v)).collect();
            let wide: Vec<f32> = bits.iter().map(|&b| petite_dtype::bf16_bits_to_f32(b)).collect();
            let b = seq(n, 13);
            let bias = bias.then_some(b.as_slice());
            let got = linear_bf16_any_order(&x, m, &bits, n, bias).unwrap();
            prop_assert!(within_any_order_bound(&got, &x, m, &wide, n, bias).is_ok(),
                "{}x{}x{}: {:?}", m, k, n, within_any_order_bound(&got, &x, m, &wide, n, bias));
            if cpu_bf16_unit().is_none() {
                let want = linear_bf16(&x, m, &bits, n, bias).unwrap();
                prop_assert!(got.iter().zip(&want).all(|(p, q)| p.to_bits() == q.to_bits()));
            }
        }
    }

    /// An `x` that is not all bf16 values never reaches the tile unit: the result is
    /// `linear_bf16`'s, bit for bit (a tile product would round `x` to bf16 first).
    #[test]
    fn any_order_with_f32_activations_is_the_exact_path() {
        let (m, k, n) = (40, 200, 70);
        let seq = super::tests::seq;
        let mut x: Vec<f32> = seq(m * k, 14)
            .into_iter()
            .map(petite_dtype::round_through_bf16)
            .collect();
        x[m * k - 1] = 1.0 + f32::EPSILON; // one value, the last, not a bf16
        let bits: Vec<u16> = seq(n * k, 15)
            .iter()
            .map(|&v| petite_dtype::bf16_bits(v))
            .collect();
        let got = linear_bf16_any_order(&x, m, &bits, n, None).unwrap();
        let want = linear_bf16(&x, m, &bits, n, None).unwrap();
        assert!(
            got.iter()
                .zip(&want)
                .all(|(p, q)| p.to_bits() == q.to_bits())
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// A bf16 weight (widened while packed, on AVX-512) gives `linear`'s bits on the
        /// widened f32 weight, whatever the shape, bias or tail.
        #[test]
        fn bf16_weight_gives_the_widened_weights_bits(
            m in 1usize..30, k in 1usize..1100, n in 1usize..80, bias in any::<bool>(),
        ) {
            let bits: Vec<u16> = (0..n * k)
                .map(|i| petite_dtype::bf16_bits(((i * 37 % 101) as f32 - 50.0) / 64.0))
                .collect();
            let wide: Vec<f32> = bits.iter().map(|&b| petite_dtype::bf16_bits_to_f32(b)).collect();
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0).collect();
            let b: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
            let bias = bias.then_some(b.as_slice());
            let want = linear(&x, m, &wide, n, bias).unwrap();
            let got = linear_bf16(&x, m, &bits, n, bias).unwrap();
            let bad = got.iter().zip(&want).position(|(p, q)| p.to_bits() != q.to_bits());
            prop_assert!(bad.is_none(), "{}x{}x{} at {:?}", m, k, n, bad);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Over the whole usize range, `new` accepts exactly the views the u128 oracle accepts.
        #[test]
        fn new_agrees_with_u128_oracle(
            len in 0usize..64,
            rows in prop_oneof![0usize..8, any::<usize>()],
            cols in prop_oneof![0usize..8, any::<usize>()],
            rs in prop_oneof![0usize..16, any::<usize>(), Just(isize::MAX as usize), Just(isize::MAX as usize + 1)],
            cs in prop_oneof![0usize..16, any::<usize>(), Just(isize::MAX as usize), Just(isize::MAX as usize + 1)],
        ) {
            let data = vec![0.0f32; len];
            prop_assert_eq!(
                MatRef::new(&data, rows, cols, rs, cs).is_ok(),
                in_bounds(len, rows, cols, rs, cs),
                "{}x{} strides ({}, {}) over {}", rows, cols, rs, cs, len
            );
        }

        /// Valid strided views (padding, transposes, zero strides) over slices of exactly the
        /// needed length compute the product the element formula defines.
        #[test]
        fn valid_views_compute_the_product(
            m in 1usize..9, k in 1usize..9, n in 1usize..9,
            lpad in 0usize..3, rpad in 0usize..3,
            lt in any::<bool>(), rt in any::<bool>(), lzero in any::<bool>(),
            acc in any::<bool>(), par in any::<bool>(),
        ) {
            // lhs m×k: row-major with padded rows, or the transpose of a padded k×m, or all-zero
            // strides (one broadcast element)
            let (lrs, lcs) = if lzero { (0, 0) } else if lt { (1, m + lpad) } else { (k + lpad, 1) };
            let (rrs, rcs) = if rt { (1, k + rpad) } else { (n + rpad, 1) };
            let llen = (m - 1) * lrs + (k - 1) * lcs + 1;
            let rlen = (k - 1) * rrs + (n - 1) * rcs + 1;
            let a: Vec<f32> = (0..llen).map(|i| (i % 7) as f32 - 3.0).collect();
            let b: Vec<f32> = (0..rlen).map(|i| (i % 5) as f32 * 0.5 - 1.0).collect();
            // one element fewer is refused
            prop_assert!(MatRef::new(&a[..llen - 1], m, k, lrs, lcs).is_err());
            prop_assert!(MatRef::new(&b[..rlen - 1], k, n, rrs, rcs).is_err());
            let lhs = MatRef::new(&a, m, k, lrs, lcs).unwrap();
            let rhs = MatRef::new(&b, k, n, rrs, rcs).unwrap();
            let mut d: Vec<f32> = (0..m * n).map(|i| i as f32).collect();
            let seed = d.clone();
            gemm_f32(&mut d, lhs, rhs, acc, par).unwrap();
            for i in 0..m {
                for j in 0..n {
                    // small integers and halves: exact in f32 whatever the summation order
                    // (up to the sign of a zero, hence `==` rather than bits)
                    let mut want = if acc { seed[i * n + j] } else { 0.0 };
                    for p in 0..k {
                        want += a[i * lrs + p * lcs] * b[p * rrs + j * rcs];
                    }
                    prop_assert!(d[i * n + j] == want, "({}, {}): {} vs {}", i, j, d[i * n + j], want);
                }
            }
        }
    }
}
