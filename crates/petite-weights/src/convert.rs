//! Streamed dtype conversion: a checkpoint in, a page-aligned safetensors mapping file out, in
//! bounded chunks. Peak memory is a few chunks per thread, whatever the checkpoint size: source
//! pages are given back behind the reader, and written output is flushed and evicted behind the
//! writer (on an 8 GB device the page cache shares DRAM with everything else).

use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use petite_dtype::quant::{scale_name, scaled_weight};

use crate::writeback::WriteBehind;
use crate::{Dtype, Error, Result, SafetensorsLayout, SafetensorsWriter, TensorSpec, WeightSource};

/// The float dtype floats are converted to (other dtypes are copied unchanged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetDtype {
    /// bfloat16, round-to-nearest-even (PyTorch's `.to(torch.bfloat16)`).
    Bf16,
    /// IEEE binary16, round-to-nearest-even.
    F16,
}

impl TargetDtype {
    fn dtype(self) -> Dtype {
        match self {
            TargetDtype::Bf16 => Dtype::Bf16,
            TargetDtype::F16 => Dtype::F16,
        }
    }
}

/// Which tensors to write. An entry matches a name exactly, or, when it ends in `*`, every name
/// starting with what precedes the `*`. An entry matching nothing is an error (catches typos).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Selection {
    /// Every tensor.
    #[default]
    All,
    /// Only these.
    Keep(Vec<String>),
    /// All but these.
    Drop(Vec<String>),
}

fn matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(stem) => name.starts_with(stem),
        None => pattern == name,
    }
}

impl Selection {
    /// Applies the selection to `names`, returning `(kept, dropped)`.
    pub fn apply(&self, names: &[String]) -> Result<(Vec<String>, Vec<String>)> {
        let (list, keep) = match self {
            Selection::All => return Ok((names.to_vec(), Vec::new())),
            Selection::Keep(l) => (l, true),
            Selection::Drop(l) => (l, false),
        };
        for p in list {
            if !names.iter().any(|n| matches(p, n)) {
                return Err(Error::Selection(format!(
                    "--{} entry `{p}` matches no tensor in the checkpoint",
                    if keep { "keep" } else { "drop" }
                )));
            }
        }
        Ok(names
            .iter()
            .cloned()
            .partition(|n| list.iter().any(|p| matches(p, n)) == keep))
    }
}

/// A conversion's progress callback: `(source bytes read so far, total source bytes)`.
#[derive(Clone)]
pub struct Progress(Arc<dyn Fn(u64, u64) + Send + Sync>);

impl Progress {
    /// Wraps `f`; it is called from a reporter thread while the conversion runs.
    pub fn new(f: impl Fn(u64, u64) + Send + Sync + 'static) -> Self {
        Progress(Arc::new(f))
    }
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress(..)")
    }
}

/// Options of [`convert`].
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// Target float dtype.
    pub dtype: TargetDtype,
    /// Which tensors to write.
    pub selection: Selection,
    /// Source bytes per work item (bounded memory: about 1.5× this per thread).
    pub chunk_bytes: usize,
    /// Worker threads (2 is enough to overlap reading, converting and writing).
    pub threads: usize,
    /// Told how far the conversion is, about four times a second and once at the end (`None`:
    /// silent). The library prints nothing itself; the caller draws a bar or a log line.
    pub progress: Option<Progress>,
    /// Extra `__metadata__` entries for the output.
    pub metadata: Vec<(String, String)>,
    /// Per-tensor target dtype of float tensors, overriding `dtype` (an exporter whose backend
    /// reads some weights in f32 keeps them f32, widened exactly where stored narrower).
    pub dtypes: std::collections::BTreeMap<String, Dtype>,
    /// Seal the output ([`crate::seal`], before its rename): for cache files a later run
    /// reuses, not for files handed to a user.
    pub seal: bool,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            dtype: TargetDtype::Bf16,
            selection: Selection::All,
            chunk_bytes: 8 << 20,
            threads: default_threads(),
            progress: None,
            metadata: Vec::new(),
            dtypes: std::collections::BTreeMap::new(),
            seal: false,
        }
    }
}

/// What [`convert`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvertReport {
    /// Tensors written.
    pub tensors: usize,
    /// Tensors left out by the selection.
    pub dropped: Vec<String>,
    /// Source bytes read.
    pub bytes_read: u64,
    /// Size of the output file.
    pub bytes_written: u64,
    /// Wall-clock seconds.
    pub seconds: f64,
}

/// Converts `src` bytes of dtype `from` into `out` bytes of dtype `to` (both little-endian).
fn convert_chunk(from: Dtype, to: Dtype, src: &[u8], out: &mut Vec<u8>) {
    out.clear();
    if from == to || !from.is_float() {
        out.extend_from_slice(src);
        return;
    }
    out.resize(src.len() / from.size() * to.size(), 0);
    convert_into(from, to, src, out);
}

/// Writes the float elements `src` (dtype `from`) into `out` as dtype `to` (both
/// little-endian; bf16/f16 rounded to nearest even through f32; copied when the dtypes agree):
/// the one element conversion of this crate's converter, for callers that own the destination
/// (a staging buffer). `out` holds as many elements as `src`; extra bytes are left alone.
pub fn convert_into(from: Dtype, to: Dtype, src: &[u8], out: &mut [u8]) {
    if from == to {
        out[..src.len()].copy_from_slice(src);
        return;
    }
    let widen = |c: &[u8]| -> f32 { petite_dtype::f32_from_le(from, c).unwrap_or(f32::NAN) };
    match (from, to) {
        (Dtype::F32, Dtype::Bf16) => {
            for (o, c) in out.chunks_exact_mut(2).zip(src.chunks_exact(4)) {
                let x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                o.copy_from_slice(&petite_dtype::bf16_bits(x).to_le_bytes());
            }
        }
        (_, Dtype::Bf16) => {
            for (o, c) in out.chunks_exact_mut(2).zip(src.chunks_exact(from.size())) {
                o.copy_from_slice(&petite_dtype::bf16_bits(widen(c)).to_le_bytes());
            }
        }
        (_, Dtype::F16) => {
            for (o, c) in out.chunks_exact_mut(2).zip(src.chunks_exact(from.size())) {
                o.copy_from_slice(&petite_dtype::f16_bits(widen(c)).to_le_bytes());
            }
        }
        (_, Dtype::F32) => {
            for (o, c) in out.chunks_exact_mut(4).zip(src.chunks_exact(from.size())) {
                o.copy_from_slice(&widen(c).to_le_bytes());
            }
        }
        _ => unreachable!("float targets are bf16, f16 or f32"),
    }
}

/// How a tensor of the output is made from the source.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Made<'a> {
    /// Its source tensor's bytes, converted where the dtypes differ.
    Plain,
    /// Codes of the source's float rows (`row` elements each), quantized row by row.
    Codes { row: usize },
    /// The scales of the quantized weight `base` (`row` elements a row): written with its codes.
    Scales { base: &'a str, row: usize },
}

/// How the output's tensor `name` (dtype `to` there) is made from `src`; `target` gives the
/// output dtype of another output tensor (a scale tensor's weight).
fn made<'a, S: WeightSource + ?Sized>(
    src: &S,
    name: &'a str,
    to: Dtype,
    target: impl Fn(&str) -> Option<Dtype>,
) -> Result<Made<'a>> {
    let row_of = |shape: &[usize]| shape.iter().skip(1).product::<usize>();
    if to.is_quant_code() {
        let info = src.info(name)?;
        return Ok(if info.dtype.is_float() {
            Made::Codes {
                row: row_of(&info.shape),
            }
        } else {
            Made::Plain
        });
    }
    // The scales of a weight quantized here are computed, even where the source happens to hold
    // a tensor of that name; those of a weight the source already holds as codes are copied.
    if let Some(base) = scaled_weight(name)
        && target(base).is_some_and(Dtype::is_quant_code)
    {
        let info = src.info(base)?;
        if info.dtype.is_float() {
            return Ok(Made::Scales {
                base,
                row: row_of(&info.shape),
            });
        }
    }
    Ok(Made::Plain)
}

/// Quantizes rows `r0..r1` of the float tensor `name` of `src` (rows of `row` elements) to the
/// codes of `to`: codes appended to `codes`, one scale a row to `scales` (by
/// [`petite_dtype::quant::Quant::quantize_row`]). A row that is not all finite is an error
/// naming the tensor and the row.
fn quantized_rows<S: WeightSource + ?Sized>(
    src: &S,
    name: &str,
    to: Dtype,
    rows: std::ops::Range<usize>,
    row: usize,
    codes: &mut Vec<u8>,
    scales: &mut Vec<f32>,
) -> Result<()> {
    let q = to.quant().expect("a quantized code dtype");
    let view = src.tensor(name)?;
    let es = view.dtype.size();
    let mut wide = Vec::with_capacity(row);
    for r in rows {
        let bytes = &view.bytes[r * row * es..(r + 1) * row * es];
        wide.clear();
        wide.extend(
            bytes
                .chunks_exact(es)
                .map(|c| petite_dtype::f32_from_le(view.dtype, c).unwrap_or(f32::NAN)),
        );
        let s = q.quantize_row(&wide, codes).map_err(|e| Error::Quantize {
            tensor: name.to_string(),
            row: r,
            quant: q.name(),
            reason: e.to_string(),
        })?;
        scales.push(s);
    }
    Ok(())
}

/// What [`convert`] writes at `out` with `opts`: its table (each tensor in its target dtype),
/// the tensors left out, and its `__metadata__`.
#[allow(clippy::type_complexity)]
fn plan<S: WeightSource>(
    src: &S,
    out: &Path,
    opts: &ConvertOptions,
) -> Result<(Vec<TensorSpec>, Vec<String>, Vec<(String, String)>)> {
    let names = src.names();
    let (kept, dropped) = opts.selection.apply(&names)?;
    let target = opts.dtype.dtype();
    let mut table = Vec::with_capacity(kept.len());
    let mut scales = Vec::new();
    for n in &kept {
        let info = src.info(n)?;
        let dtype = if info.dtype.is_float() || info.dtype.is_quant_code() {
            match opts.dtypes.get(n) {
                Some(d) if d.is_float() && info.dtype.is_float() => *d,
                Some(d) if d.is_quant_code() && (info.dtype.is_float() || info.dtype == *d) => {
                    // Codes, and beside them one f32 scale a row (see `quantized_rows`).
                    let rows = *info.shape.first().ok_or_else(|| Error::InvalidTable {
                        file: out.display().to_string(),
                        tensor: Some(n.clone()),
                        reason: "a scalar cannot be quantized by rows".into(),
                    })?;
                    scales.push(TensorSpec {
                        name: scale_name(n),
                        dtype: Dtype::F32,
                        shape: vec![rows],
                    });
                    *d
                }
                Some(d) => {
                    return Err(Error::InvalidTable {
                        file: out.display().to_string(),
                        tensor: Some(n.clone()),
                        reason: format!(
                            "target dtype {} is not a float or quantized code dtype for a {} \
                             tensor",
                            d.safetensors_name(),
                            info.dtype.safetensors_name()
                        ),
                    });
                }
                None if info.dtype.is_float() => target,
                None => info.dtype,
            }
        } else {
            info.dtype
        };
        table.push(TensorSpec {
            name: n.clone(),
            dtype,
            shape: info.shape,
        });
    }
    for s in scales {
        if table.iter().any(|t: &TensorSpec| t.name == s.name) {
            return Err(Error::InvalidTable {
                file: out.display().to_string(),
                tensor: Some(s.name),
                reason: "the scale tensor of a quantized weight is also selected from the source"
                    .into(),
            });
        }
        table.push(s);
    }
    let mut metadata = vec![("format".to_string(), "pt".to_string())];
    metadata.extend(opts.metadata.iter().cloned());
    Ok((table, dropped, metadata))
}

/// The seal line ([`crate::seal`]) of the file [`convert`] would write at `out` with `opts`,
/// computed from `src` without writing it: the planned header and the converted bytes of the
/// ranges a seal samples (every byte of a file up to [`crate::seal::FULL_LIMIT`]). An export
/// whose backend reads the checkpoint directly still identifies the weights' content exactly as
/// an export that wrote the file (same export id), at the cost of a few MiB of reads.
pub fn seal_of<S: WeightSource>(src: &S, out: &Path, opts: &ConvertOptions) -> Result<String> {
    let (table, _, metadata) = plan(src, out, opts)?;
    let layout = SafetensorsLayout::plan(out, &table, &metadata)?;
    let header = layout.header();
    let tensors: Vec<(&str, Dtype, u64, u64)> = layout.tensors().collect();
    let mut failed: Option<Error> = None;
    let mut conv = Vec::new();
    let mut read_at = |off: u64, buf: &mut [u8]| -> std::io::Result<()> {
        let mut filled = 0usize;
        while filled < buf.len() {
            let p = off + filled as u64;
            let rest = buf.len() - filled;
            if p < header.len() as u64 {
                let k = (header.len() - p as usize).min(rest);
                buf[filled..filled + k].copy_from_slice(&header[p as usize..p as usize + k]);
                filled += k;
                continue;
            }
            // The data region is contiguous: the tensor holding `p`.
            let i = tensors.partition_point(|t| t.2 + t.3 <= p);
            let Some(&(name, to, start, len)) = tensors.get(i) else {
                return Err(std::io::Error::other("read past the planned file"));
            };
            let rel = p - start;
            let k = ((len - rel) as usize).min(rest);
            let target = |b: &str| tensors.iter().find(|t| t.0 == b).map(|t| t.1);
            // The planned bytes from `rel` on, and how many lead them in `conv`.
            let step = |conv: &mut Vec<u8>| -> Result<usize> {
                let r = rel as usize;
                match made(src, name, to, target)? {
                    Made::Plain => {
                        let view = src.tensor(name)?;
                        let (from, es, ts) = (view.dtype, view.dtype.size(), to.size() as u64);
                        let (e0, e1) = (rel / ts, (rel + k as u64).div_ceil(ts));
                        let bytes = &view.bytes[e0 as usize * es..e1 as usize * es];
                        convert_chunk(from, to, bytes, conv);
                        Ok((rel % ts) as usize)
                    }
                    Made::Codes { row } => {
                        let (r0, r1) = (r / row.max(1), (r + k).div_ceil(row.max(1)));
                        conv.clear();
                        quantized_rows(src, name, to, r0..r1, row, conv, &mut Vec::new())?;
                        release_rows(src, name, r0..r1, row)?;
                        Ok(r - r0 * row)
                    }
                    Made::Scales { base, row } => {
                        let (r0, r1) = (r / 4, (r + k).div_ceil(4));
                        let codes = target(base).expect("made() saw it");
                        let mut scales = Vec::new();
                        quantized_rows(
                            src,
                            base,
                            codes,
                            r0..r1,
                            row,
                            &mut Vec::new(),
                            &mut scales,
                        )?;
                        // A sample of scales reads a whole row of the weight for each: give
                        // those pages back now (they made the fingerprint's RSS 138 MiB).
                        release_rows(src, base, r0..r1, row)?;
                        conv.clear();
                        conv.extend(scales.iter().flat_map(|s| s.to_le_bytes()));
                        Ok(r - r0 * 4)
                    }
                }
            };
            let skip = match step(&mut conv) {
                Ok(s) => s,
                Err(e) => {
                    failed = Some(e);
                    return Err(std::io::Error::other("source read failed"));
                }
            };
            buf[filled..filled + k].copy_from_slice(&conv[skip..skip + k]);
            filled += k;
        }
        Ok(())
    };
    let line = crate::seal::line(layout.total_len(), &mut read_at);
    match (line, failed) {
        (_, Some(e)) => Err(e),
        (Ok(l), None) => Ok(l),
        (Err(e), None) => Err(Error::io(out, "seal the planned file", e)),
    }
}

/// Gives back the pages of rows `rows` (of `row` elements) of `name` in `src`.
fn release_rows<S: WeightSource + ?Sized>(
    src: &S,
    name: &str,
    rows: std::ops::Range<usize>,
    row: usize,
) -> Result<()> {
    let es = src.info(name)?.dtype.size();
    src.release_range(name, rows.start * row * es, rows.end * row * es)
}

/// Worker threads of a streamed conversion by default: two overlap one thread's reads with the
/// other's conversion and writes; more than four only add contention for one disk.
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get().min(4))
        .unwrap_or(2)
}

/// Source bytes `stream` asks for ahead of the items being converted.
const READ_AHEAD: usize = 64 << 20;

/// How [`stream`] reads, converts and writes.
#[derive(Debug, Clone, Copy)]
pub struct StreamOptions {
    /// Source bytes per work item (memory: about 1.5× this per thread, plus the pages asked
    /// for ahead and the write-behind window).
    pub chunk_bytes: usize,
    /// Worker threads.
    pub threads: usize,
    /// Give each chunk's source pages back once it is written (`false` only for tests that
    /// watch another release).
    pub release_behind: bool,
}

struct Item {
    tensor: usize,
    /// Byte range within the source tensor.
    start: usize,
    end: usize,
    /// The rows of a quantized tensor's item (whole rows: a row's scale needs all of it).
    rows: std::ops::Range<usize>,
}

/// Streams every tensor of `writer` from the tensor of the same name in `src`, converted from
/// its stored dtype to the one `writer` declares (round-to-nearest-even; other dtypes copied),
/// at disk speed in bounded memory: work items of `opts.chunk_bytes` in file order shared by
/// `opts.threads` threads; each pick asks for the pages 64 MiB ahead
/// (`MADV_WILLNEED`, so reads overlap conversion), writes with `pwrite`, starts writeback at
/// once and drops written pages a few items later ([`WriteBehind`]), and gives the source's
/// pages back behind itself. `done` counts source bytes streamed. The writer is not finished.
pub fn stream<S: WeightSource + ?Sized>(
    src: &S,
    writer: &SafetensorsWriter,
    opts: &StreamOptions,
    done: &AtomicU64,
) -> Result<()> {
    // Work items in file order, each about `chunk_bytes` of source.
    let order = writer.order();
    let mut tensors = Vec::with_capacity(order.len());
    let mut items = Vec::new();
    for (i, &name) in order.iter().enumerate() {
        let to = writer.dtype(name)?;
        let how = made(src, name, to, |b| writer.dtype(b).ok())?;
        if let Made::Scales { .. } = how {
            // Written by the items of its weight's codes.
            tensors.push((name, Dtype::F32, to, how));
            continue;
        }
        let info = src.info(name)?;
        let from = info.dtype;
        let len = info.shape.iter().product::<usize>() * from.size();
        if let Made::Codes { row } = how {
            let row_bytes = row * from.size();
            let per = (opts.chunk_bytes / row_bytes.max(1)).max(1);
            let n = info.shape[0];
            let mut r = 0;
            while r < n {
                let e = (r + per).min(n);
                items.push(Item {
                    tensor: i,
                    start: r * row_bytes,
                    end: e * row_bytes,
                    rows: r..e,
                });
                r = e;
            }
        } else {
            let per = (opts.chunk_bytes / from.size()).max(1) * from.size();
            let mut s = 0;
            while s < len {
                let e = (s + per).min(len);
                items.push(Item {
                    tensor: i,
                    start: s,
                    end: e,
                    rows: 0..0,
                });
                s = e;
            }
        }
        tensors.push((name, from, to, how));
    }
    let threads = opts.threads.max(1);
    // Items asked for ahead of the ones being converted: enough to keep the disk busy while
    // the threads convert and write (a few MiB is less than one request's worth on a fast
    // disk), bounded so the asked-for pages stay a small part of a 512 MiB budget.
    let ahead = (READ_AHEAD / opts.chunk_bytes.max(1)).max(threads);
    let ask = |k: usize| -> Result<()> {
        match items.get(k) {
            Some(it) => src.prefetch_range(tensors[it.tensor].0, it.start, it.end),
            None => Ok(()),
        }
    };
    for k in 0..ahead {
        ask(k)?;
    }
    let next = AtomicUsize::new(0);
    let first_err: Mutex<Option<Error>> = Mutex::new(None);
    let fd = writer.file().as_fd();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            let (next, items, tensors, first_err, ask) =
                (&next, &items, &tensors, &first_err, &ask);
            scope.spawn(move || {
                let mut buf = Vec::new();
                let mut scales = Vec::new();
                let mut flusher = WriteBehind::new(fd, 4);
                let mut run = |buf: &mut Vec<u8>, flusher: &mut WriteBehind| -> Result<bool> {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some(it) = items.get(k) else {
                        return Ok(false);
                    };
                    // The items before `k + ahead` were asked for by earlier picks.
                    ask(k + ahead)?;
                    let (name, from, to, how) = tensors[it.tensor];
                    if let Made::Codes { row } = how {
                        buf.clear();
                        scales.clear();
                        quantized_rows(src, name, to, it.rows.clone(), row, buf, &mut scales)?;
                        let off = (it.rows.start * row) as u64;
                        writer.write_at(name, off, buf)?;
                        let (abs, _) = writer.placement(name)?;
                        flusher.push(abs + off, buf.len() as u64);
                        let sname = scale_name(name);
                        let sb: Vec<u8> = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
                        let soff = (it.rows.start * 4) as u64;
                        writer.write_at(&sname, soff, &sb)?;
                        let (sabs, _) = writer.placement(&sname)?;
                        flusher.push(sabs + soff, sb.len() as u64);
                        if opts.release_behind {
                            src.release_range(name, it.start, it.end)?;
                        }
                        done.fetch_add((it.end - it.start) as u64, Ordering::Relaxed);
                        return Ok(true);
                    }
                    let view = src.tensor(name)?;
                    let bytes = &view.bytes[it.start..it.end];
                    let off = (it.start / from.size() * to.size()) as u64;
                    // Bytes kept as they are go from the mapping straight to `pwrite`.
                    let out = if from == to || !from.is_float() {
                        bytes
                    } else {
                        convert_chunk(from, to, bytes, buf);
                        buf.as_slice()
                    };
                    writer.write_at(name, off, out)?;
                    if opts.release_behind {
                        src.release_range(name, it.start, it.end)?;
                    }
                    let (abs, _) = writer.placement(name)?;
                    flusher.push(abs + off, out.len() as u64);
                    done.fetch_add((it.end - it.start) as u64, Ordering::Relaxed);
                    Ok(true)
                };
                loop {
                    if first_err.lock().expect("no panics").is_some() {
                        break;
                    }
                    match run(&mut buf, &mut flusher) {
                        Ok(true) => {}
                        Ok(false) => break,
                        Err(e) => {
                            first_err.lock().expect("no panics").get_or_insert(e);
                            break;
                        }
                    }
                }
                flusher.finish();
            });
        }
    });
    match first_err.into_inner().expect("no panics") {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Converts `src` into a safetensors file at `out`: floats to `opts.dtype` (round-to-nearest-even),
/// other dtypes copied, tensors selected by `opts.selection`, every large tensor on a page
/// boundary. Streams in chunks of `opts.chunk_bytes` on `opts.threads` threads ([`stream`]),
/// giving the source's pages back behind itself. The output is written under a temporary name,
/// fsynced and renamed; on any error nothing is left under `out`, nor when the source changed
/// while it was read ([`WeightSource::check_unchanged`]: [`Error::Changed`]). The source is
/// only read.
pub fn convert<S: WeightSource>(
    src: &S,
    out: &Path,
    opts: &ConvertOptions,
) -> Result<ConvertReport> {
    let t0 = Instant::now();
    // Never replace a file being read: the rename would swap it under the mapping.
    if let Ok(o) = out.canonicalize() {
        for f in src.files() {
            if f.canonicalize().is_ok_and(|f| f == o) {
                return Err(Error::WouldOverwriteSource {
                    out: out.display().to_string(),
                    source_file: f.display().to_string(),
                });
            }
        }
    }
    let (table, dropped, metadata) = plan(src, out, opts)?;
    let writer = SafetensorsWriter::create(out, &table, &metadata)?;
    let mut total_src = 0u64;
    for t in &table {
        // A quantized weight's scales are computed from its rows: no source bytes of their own.
        let target = |b: &str| table.iter().find(|t| t.name == b).map(|t| t.dtype);
        if let Made::Scales { .. } = made(src, &t.name, t.dtype, target)? {
            continue;
        }
        let info = src.info(&t.name)?;
        total_src += (info.shape.iter().product::<usize>() * info.dtype.size()) as u64;
    }

    let done = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let streamed = std::thread::scope(|scope| {
        if let Some(report) = &opts.progress {
            let (done, stop) = (&done, &stop);
            scope.spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(250));
                    (report.0)(done.load(Ordering::Relaxed), total_src);
                }
                (report.0)(done.load(Ordering::Relaxed), total_src);
            });
        }
        let r = stream(
            src,
            &writer,
            &StreamOptions {
                chunk_bytes: opts.chunk_bytes,
                threads: opts.threads,
                release_behind: true,
            },
            &done,
        );
        stop.store(true, Ordering::Relaxed);
        r
    });
    streamed?;
    let bytes_written = writer.total_len();
    // The output is published only if every byte came from the source `src` opened.
    src.check_unchanged()?;
    if opts.seal {
        writer.finish_sealed()?;
    } else {
        writer.finish()?;
    }
    Ok(ConvertReport {
        tensors: table.len(),
        dropped,
        bytes_read: total_src,
        bytes_written,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_rules() {
        let names: Vec<String> = ["a.x", "a.y", "b"].iter().map(|s| s.to_string()).collect();
        let (k, d) = Selection::Drop(vec!["a.*".into()]).apply(&names).unwrap();
        assert_eq!(
            (k, d),
            (vec!["b".to_string()], vec!["a.x".into(), "a.y".into()])
        );
        let (k, _) = Selection::Keep(vec!["a.y".into()]).apply(&names).unwrap();
        assert_eq!(k, vec!["a.y".to_string()]);
        let e = Selection::Drop(vec!["lm_head".into()])
            .apply(&names)
            .unwrap_err();
        assert!(e.to_string().contains("`lm_head` matches no tensor"), "{e}");
    }
}
