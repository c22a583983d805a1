//! The conversion and transpose engine: a stored weight is read from its source in bands of
//! about 8 MiB, converted element by element (same dtype copied; f32 → bf16/f16 rounded by
//! petite-dtype's one rule; narrow → wide exact) and, where the lowering stores it transposed,
//! transposed in cache-sized tiles; each band gives its source pages back behind itself.

use std::io::Write;
use std::path::Path;

use petite_dtype::bf16_bits;
use petite_graph::Dtype;
use petite_weights::{TensorView, WeightSource};

use crate::{Error, Result, StoredWeight};

/// One element conversion, monomorphised so the band kernels inline it: `I` source bytes in,
/// `O` stored bytes out (little-endian).
trait Elem {
    const I: usize;
    const O: usize;
    fn conv(s: &[u8], d: &mut [u8]);
}

/// Same dtype: the bytes are copied.
struct Same<const N: usize>;
impl<const N: usize> Elem for Same<N> {
    const I: usize = N;
    const O: usize = N;
    #[inline(always)]
    fn conv(s: &[u8], d: &mut [u8]) {
        d.copy_from_slice(s);
    }
}

#[inline(always)]
fn f32_of(s: &[u8]) -> f32 {
    f32::from_le_bytes([s[0], s[1], s[2], s[3]])
}
#[inline(always)]
fn bf16_of(s: &[u8]) -> f32 {
    petite_dtype::bf16_bits_to_f32(u16::from_le_bytes([s[0], s[1]]))
}
#[inline(always)]
fn f16_of(s: &[u8]) -> f32 {
    petite_dtype::f16_bits_to_f32(u16::from_le_bytes([s[0], s[1]]))
}

macro_rules! float_elem {
    ($name:ident, $i:expr, $o:expr, |$s:ident, $d:ident| $body:expr) => {
        struct $name;
        impl Elem for $name {
            const I: usize = $i;
            const O: usize = $o;
            #[inline(always)]
            fn conv($s: &[u8], $d: &mut [u8]) {
                $body
            }
        }
    };
}
// f32 → bf16/f16 round to nearest even (`half`'s conversions, as since the crate's first
// version); narrow → wide is exact.
float_elem!(F32Bf16, 4, 2, |s, d| d
    .copy_from_slice(&bf16_bits(f32_of(s)).to_le_bytes()));
float_elem!(F32F16, 4, 2, |s, d| d
    .copy_from_slice(&petite_dtype::f16_bits(f32_of(s)).to_le_bytes()));
float_elem!(Bf16F32, 2, 4, |s, d| d
    .copy_from_slice(&bf16_of(s).to_le_bytes()));
float_elem!(F16F32, 2, 4, |s, d| d
    .copy_from_slice(&f16_of(s).to_le_bytes()));
float_elem!(Bf16F16, 2, 2, |s, d| d
    .copy_from_slice(&petite_dtype::f16_bits(bf16_of(s)).to_le_bytes()));
float_elem!(F16Bf16, 2, 2, |s, d| d
    .copy_from_slice(&bf16_bits(f16_of(s)).to_le_bytes()));

/// Which [`Elem`] a (source, stored) dtype pair uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Conv {
    Same1,
    Same2,
    Same4,
    Same8,
    F32Bf16,
    F32F16,
    Bf16F32,
    F16F32,
    Bf16F16,
    F16Bf16,
}

impl Conv {
    /// Same dtype copies bytes; float ↔ float converts; anything else does not convert.
    fn of(from: Dtype, to: Dtype) -> Option<Conv> {
        if from == to {
            return Some(match from.size() {
                1 => Conv::Same1,
                2 => Conv::Same2,
                4 => Conv::Same4,
                _ => Conv::Same8,
            });
        }
        Some(match (from, to) {
            (Dtype::F32, Dtype::Bf16) => Conv::F32Bf16,
            (Dtype::F32, Dtype::F16) => Conv::F32F16,
            (Dtype::Bf16, Dtype::F32) => Conv::Bf16F32,
            (Dtype::F16, Dtype::F32) => Conv::F16F32,
            (Dtype::Bf16, Dtype::F16) => Conv::Bf16F16,
            (Dtype::F16, Dtype::Bf16) => Conv::F16Bf16,
            _ => return None,
        })
    }
}

/// Calls generic `$f::<E>(args)` with the [`Elem`] of `$conv`.
macro_rules! with_elem {
    ($conv:expr, $f:ident($($a:expr),*)) => {
        match $conv {
            Conv::Same1 => $f::<Same<1>>($($a),*),
            Conv::Same2 => $f::<Same<2>>($($a),*),
            Conv::Same4 => $f::<Same<4>>($($a),*),
            Conv::Same8 => $f::<Same<8>>($($a),*),
            Conv::F32Bf16 => $f::<F32Bf16>($($a),*),
            Conv::F32F16 => $f::<F32F16>($($a),*),
            Conv::Bf16F32 => $f::<Bf16F32>($($a),*),
            Conv::F16F32 => $f::<F16F32>($($a),*),
            Conv::Bf16F16 => $f::<Bf16F16>($($a),*),
            Conv::F16Bf16 => $f::<F16Bf16>($($a),*),
        }
    };
}

fn convert_plain<E: Elem>(src: &[u8], out: &mut [u8]) {
    for (s, d) in src.chunks_exact(E::I).zip(out.chunks_exact_mut(E::O)) {
        E::conv(s, d);
    }
}

/// Side of the square tiles the transposing kernel walks: a tile's source rows and stored rows
/// (64 cache lines each at most) stay in L1 while it is converted.
const TILE: usize = 16;

/// Converts rows `i0..i1` × columns `j0..j1` of the row-major `[_, c]` tensor `src` into `out`,
/// transposed: source element `(i, j)` goes to element `(j - j0) * h + i` of `out`.
/// Tiled so reads and writes both stay in cache (a column-by-column gather misses on every
/// element).
fn transpose_block<E: Elem>(
    src: &[u8],
    c: usize,
    (i0, i1): (usize, usize),
    (j0, j1): (usize, usize),
    out: &mut [u8],
    h: usize,
) {
    // One tile converted into `tmp` (stored-row-major, in L1), then copied out row by row.
    let mut tmp = [0u8; TILE * TILE * 8];
    for ib in (i0..i1).step_by(TILE) {
        let n = (ib + TILE).min(i1) - ib;
        for jb in (j0..j1).step_by(TILE) {
            let m = (jb + TILE).min(j1) - jb;
            for ii in 0..n {
                let at = ((ib + ii) * c + jb) * E::I;
                let row = &src[at..at + m * E::I];
                for (jj, s) in row.chunks_exact(E::I).enumerate() {
                    let t = (jj * TILE + ii) * E::O;
                    E::conv(s, &mut tmp[t..t + E::O]);
                }
            }
            for jj in 0..m {
                let o = ((jb + jj - j0) * h + ib) * E::O;
                let t = jj * TILE * E::O;
                out[o..o + n * E::O].copy_from_slice(&tmp[t..t + n * E::O]);
            }
        }
    }
}

/// Source bytes one band (one unit of work) reads: bounds the output buffer a band holds,
/// whatever the tensor's size.
pub(crate) const BAND: usize = 8 << 20;

/// Source bytes of whole rows a column band reads before unmapping them: bounds the mapped
/// source pages.
const UNMAP: usize = 2 << 20;

/// One band of a stored weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Band {
    /// Elements `start..end` of an untransposed tensor.
    Plain { start: usize, end: usize },
    /// Source columns `j0..j1` of a transposed `[r, c]` tensor: stored rows `j0..j1`, one
    /// contiguous run of the output, read as one segment of every source row. (Cutting by source
    /// rows instead reads contiguously but scatters the output into `c` short writes per band:
    /// measured slower at full size, 46 s vs 17 s.)
    Cols { j0: usize, j1: usize },
}

/// How a stored weight is read, converted and placed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layout {
    conv: Conv,
    /// Source `[r, c]` when transposed (the stored shape is `[c, r]`); `(1, numel)` otherwise.
    r: usize,
    c: usize,
    transpose: bool,
}

impl Layout {
    pub(crate) fn new(w: &StoredWeight, from: Dtype) -> Result<Layout> {
        let conv = Conv::of(from, w.dtype).ok_or_else(|| Error::Weight {
            name: w.name.clone(),
            reason: format!(
                "stored as {}, which does not convert to {}",
                from.safetensors_name(),
                w.dtype
            ),
        })?;
        let (r, c) = if w.transpose {
            match w.shape.as_slice() {
                [c, r] => (*r, *c),
                s => {
                    return Err(Error::Weight {
                        name: w.name.clone(),
                        reason: format!("stored transposed, so 2-D, but its shape is {s:?}"),
                    });
                }
            }
        } else {
            (1, w.shape.iter().product())
        };
        Ok(Layout {
            conv,
            r,
            c,
            transpose: w.transpose,
        })
    }

    fn src_size(&self) -> usize {
        with_elem!(self.conv, in_size())
    }

    fn out_size(&self) -> usize {
        with_elem!(self.conv, out_size())
    }

    /// The bands of this weight, each about `band` source bytes, in output order.
    pub(crate) fn bands(&self, band: usize) -> Vec<Band> {
        let es = self.src_size();
        let (r, c) = (self.r, self.c);
        let mut out = Vec::new();
        if r == 0 || c == 0 {
            return out;
        }
        let per = if self.transpose {
            (band / (r * es)).clamp(1, c)
        } else {
            (band / es).max(1)
        };
        let mut s = 0;
        while s < c {
            let e = (s + per).min(c);
            out.push(if self.transpose {
                Band::Cols { j0: s, j1: e }
            } else {
                Band::Plain { start: s, end: e }
            });
            s = e;
        }
        out
    }

    /// Converts `b` of `src` into `buf` (cleared) and hands the stored bytes to `emit` as
    /// (offset within the stored tensor, bytes). Column bands read a slice of every source row,
    /// and each fault also maps the cached pages around it (fault-around, large folios: a
    /// whole row and more), so rows are unmapped from `unmap` a group at a time as the band moves
    /// down; they stay in the page cache for the next band.
    pub(crate) fn run(
        &self,
        src: &[u8],
        b: Band,
        buf: &mut Vec<u8>,
        unmap: (&dyn WeightSource, &str),
        emit: &mut dyn FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let (es, os) = (self.src_size(), self.out_size());
        let (r, c) = (self.r, self.c);
        buf.clear();
        match b {
            Band::Plain { start, end } => {
                buf.resize((end - start) * os, 0);
                with_elem!(
                    self.conv,
                    convert_plain(&src[start * es..end * es], buf.as_mut_slice())
                );
                emit((start * os) as u64, buf)
            }
            Band::Cols { j0, j1 } => {
                buf.resize((j1 - j0) * r * os, 0);
                let group = (UNMAP / (c * es)).max(1).div_ceil(TILE) * TILE;
                let (weights, name) = unmap;
                for g0 in (0..r).step_by(group) {
                    let g1 = (g0 + group).min(r);
                    with_elem!(
                        self.conv,
                        transpose_block(src, c, (g0, g1), (j0, j1), buf.as_mut_slice(), r)
                    );
                    if j1 - j0 < c {
                        weights.unmap_range(name, g0 * c * es, g1 * c * es)?;
                    }
                }
                emit((j0 * r * os) as u64, buf)
            }
        }
    }

    /// Gives back the source pages band `b` has finished with. Plain bands round by address
    /// (the mapping is page-aligned with the file): the page shared with the next band or a
    /// neighbouring tensor is kept, the one shared with the previous band dropped, so no page is
    /// read from disk twice. A column band's rows were unmapped as it went and stay cached for
    /// the next band; the whole tensor is released after its last band.
    pub(crate) fn release(
        &self,
        weights: &dyn WeightSource,
        name: &str,
        src: &[u8],
        b: Band,
        page: usize,
    ) -> Result<()> {
        let es = self.src_size();
        let base = src.as_ptr() as usize;
        let (s, e) = match b {
            Band::Plain { start, end } => (start * es, end * es),
            Band::Cols { j0, j1 } if j0 == 0 && j1 == self.c => (0, src.len()),
            Band::Cols { .. } => return Ok(()),
        };
        let a = if s > 0 {
            (base + s) / page * page
        } else {
            (base + s).div_ceil(page) * page
        }
        .saturating_sub(base);
        let z = if e == src.len() {
            e
        } else {
            ((base + e) / page * page).saturating_sub(base)
        };
        if z > a {
            weights.release_range(name, a, z)?;
        }
        Ok(())
    }

    /// The source bytes to ask for ahead of band `b` (readahead, `MADV_WILLNEED`): a plain
    /// band's own bytes; for the first column band the whole tensor, which every column band
    /// reads a slice of (faulted in row by row it would be read synchronously).
    pub(crate) fn lead(&self, b: Band) -> std::ops::Range<usize> {
        let es = self.src_size();
        match b {
            Band::Plain { start, end } => start * es..end * es,
            Band::Cols { j0: 0, .. } => 0..self.r * self.c * es,
            Band::Cols { .. } => 0..0,
        }
    }
}

fn in_size<E: Elem>() -> usize {
    E::I
}

fn out_size<E: Elem>() -> usize {
    E::O
}

pub(crate) fn ahead(
    weights: &dyn WeightSource,
    name: &str,
    r: std::ops::Range<usize>,
) -> Result<()> {
    if r.end > r.start {
        weights.prefetch_range(name, r.start, r.end)?;
    }
    Ok(())
}

/// Checks `view` against the stored weight `w` (shape as the program declares it).
pub(crate) fn checked_view<'a>(
    weights: &'a dyn WeightSource,
    w: &StoredWeight,
) -> Result<TensorView<'a>> {
    let view = weights.tensor(&w.name)?;
    let mut want = w.shape.clone();
    if w.transpose {
        want.reverse();
    }
    if view.shape != want.as_slice() {
        return Err(Error::Weight {
            name: w.name.clone(),
            reason: format!(
                "expected shape {want:?} (as the program declares), found {:?}",
                view.shape
            ),
        });
    }
    Ok(view)
}

/// Writes one weight (converted, transposed where stored so) to the sequential writer `w`, a
/// band at a time, releasing the source pages behind itself.
pub(crate) fn write_weight(
    w: &mut impl Write,
    weights: &dyn WeightSource,
    sw: &StoredWeight,
    dest: &Path,
) -> Result<()> {
    let view = checked_view(weights, sw)?;
    let lay = Layout::new(sw, view.dtype)?;
    let page = petite_weights::page_size();
    let mut buf = Vec::new();
    let bands = lay.bands(BAND);
    for (k, &b) in bands.iter().enumerate() {
        if k == 0 {
            ahead(weights, &sw.name, lay.lead(b))?;
        }
        if let Some(&n) = bands.get(k + 1) {
            ahead(weights, &sw.name, lay.lead(n))?;
        }
        lay.run(
            view.bytes,
            b,
            &mut buf,
            (weights, &sw.name),
            &mut |_, bytes| {
                w.write_all(bytes).map_err(|e| Error::Io {
                    path: dest.to_path_buf(),
                    op: "write weight",
                    source: e,
                })
            },
        )?;
        lay.release(weights, &sw.name, view.bytes, b, page)?;
    }
    weights.release(&[&sw.name])?;
    Ok(())
}
