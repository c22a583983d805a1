//! The streaming convert/transpose against the column-gathering version it replaced (kept here
//! verbatim as the oracle, with its chunked writer) and against a naive element-by-element
//! transpose built on `half`, over odd shapes, band edges and every dtype pair.

use std::io::Write;
use std::path::Path;

use petite_graph::Dtype;
use petite_weights::{MappedSafetensors, SafetensorsWriter, TensorSpec, TensorView, WeightSource};
use proptest::prelude::*;

use super::*;
use crate::convert::{BAND, Layout, write_weight};
use crate::mapping::write_mapping_with;

// ---- the previous implementation (commit 3cb21e2), the oracle ---------------------------------

fn old_convert_into(src: &[u8], from: Dtype, to: Dtype, out: &mut Vec<u8>) -> bool {
    let same = from == to;
    if same {
        out.extend_from_slice(src);
        return true;
    }
    if !from.is_float() || !to.is_float() {
        return false;
    }
    for x in petite_dtype::widen_le(from, src).unwrap() {
        petite_dtype::push_le(to, x, out);
    }
    true
}

/// Chunk of source bytes converted at a time.
const OLD_CHUNK: usize = 8 << 20;

/// Writes one weight (converted, optionally transposed) to `w`, in bounded chunks.
fn old_write_weight(
    w: &mut impl Write,
    weights: &dyn WeightSource,
    name: &str,
    to: Dtype,
    shape: &[usize],
    transpose: bool,
    dest: &Path,
) -> Result<()> {
    let view = weights.tensor(name)?;
    let stored: Vec<usize> = if transpose {
        shape.iter().rev().copied().collect()
    } else {
        shape.to_vec()
    };
    if view.shape != stored.as_slice() {
        return Err(Error::Weight {
            name: name.into(),
            reason: format!(
                "expected shape {stored:?} (as the program declares), found {:?}",
                view.shape
            ),
        });
    }
    let es = view.dtype.size();
    let io = |e| Error::Io {
        path: dest.to_path_buf(),
        op: "write weight",
        source: e,
    };
    let bad = || Error::Weight {
        name: name.into(),
        reason: format!(
            "stored as {}, which does not convert to {to}",
            view.dtype.safetensors_name()
        ),
    };
    let mut buf = Vec::with_capacity(OLD_CHUNK.min(view.bytes.len()) * 2 + 16);
    if !transpose {
        for (i, c) in view.bytes.chunks(OLD_CHUNK).enumerate() {
            buf.clear();
            if !old_convert_into(c, view.dtype, to, &mut buf) {
                return Err(bad());
            }
            w.write_all(&buf).map_err(io)?;
            let start = i * OLD_CHUNK;
            weights.release_range(name, start, start + c.len())?;
        }
    } else {
        // [r, c] stored → [c, r] written, a block of output rows at a time.
        let (r, c) = (stored[0], stored[1]);
        let block = (OLD_CHUNK / (r * es).max(1)).clamp(1, c.max(1));
        let mut gathered = Vec::with_capacity(block * r * es);
        let mut c0 = 0;
        while c0 < c {
            let c1 = (c0 + block).min(c);
            gathered.clear();
            for j in c0..c1 {
                for i in 0..r {
                    let at = (i * c + j) * es;
                    gathered.extend_from_slice(&view.bytes[at..at + es]);
                }
            }
            buf.clear();
            if !old_convert_into(&gathered, view.dtype, to, &mut buf) {
                return Err(bad());
            }
            w.write_all(&buf).map_err(io)?;
            c0 = c1;
        }
    }
    weights.release(&[name])?;
    Ok(())
}

/// The previous `write_mapping`: one tensor at a time through the writer's sequential sinks.
fn old_write_mapping(table: &[StoredWeight], weights: &dyn WeightSource, path: &Path) {
    let specs: Vec<TensorSpec> = table
        .iter()
        .map(|w| TensorSpec::new(&w.key, w.dtype, &w.shape))
        .collect();
    let writer = SafetensorsWriter::create(path, &specs, &[]).unwrap();
    for w in table {
        let mut sink = writer.tensor(&w.key).unwrap();
        old_write_weight(
            &mut sink,
            weights,
            &w.name,
            w.dtype,
            &w.shape,
            w.transpose,
            path,
        )
        .unwrap();
        sink.finish().unwrap();
    }
    writer.finish().unwrap();
}

// ---- helpers ------------------------------------------------------------------------------------

/// Deterministic bytes with the float edge cases mixed in: NaNs with payloads and both signs,
/// infinities, signed zeros, subnormals and exact bf16/f16 rounding ties.
fn bytes(n: usize, size: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let special32 = [
        0x7fc0_0001u32,
        0xffa0_1234,
        0x7f80_0000,
        0xff80_0000,
        0x8000_0000,
        0x0000_0001,
        0x3f80_8000,
        0x3f81_8000,
        0x0080_7fff,
    ];
    let special16 = [0x7e01u16, 0xfc00, 0x7c00, 0x8000, 0x0001, 0x7fc1, 0xff81];
    let mut out = Vec::with_capacity(n * size);
    for _ in 0..n {
        let x = next();
        let pick = (x >> 60) as usize;
        match size {
            4 if pick < special32.len() && x & 1 == 0 => {
                out.extend_from_slice(&special32[pick].to_le_bytes())
            }
            2 if pick < special16.len() && x & 1 == 0 => {
                out.extend_from_slice(&special16[pick].to_le_bytes())
            }
            _ => out.extend_from_slice(&x.to_le_bytes()[..size]),
        }
    }
    out
}

struct Src {
    name: &'static str,
    dtype: Dtype,
    shape: Vec<usize>,
}

/// Writes a checkpoint of `srcs` with seeded contents and maps it.
fn checkpoint(dir: &Path, srcs: &[Src]) -> MappedSafetensors {
    let path = dir.join("ck.safetensors");
    let specs: Vec<TensorSpec> = srcs
        .iter()
        .map(|s| TensorSpec::new(s.name, s.dtype, &s.shape))
        .collect();
    let w = SafetensorsWriter::create(&path, &specs, &[]).unwrap();
    for (k, s) in srcs.iter().enumerate() {
        let n: usize = s.shape.iter().product();
        w.write_at(s.name, 0, &bytes(n, s.dtype.size(), k as u64 + 7))
            .unwrap();
    }
    w.finish().unwrap();
    MappedSafetensors::open(&path).unwrap()
}

fn stored(name: &str, ck: &MappedSafetensors, dtype: Dtype, transpose: bool) -> StoredWeight {
    let mut shape = ck.info(name).unwrap().shape;
    if transpose {
        shape.reverse();
    }
    StoredWeight {
        key: stored_key(name, transpose, dtype),
        name: name.into(),
        transpose,
        dtype,
        shape,
    }
}

fn src(name: &'static str, dtype: Dtype, shape: &[usize]) -> Src {
    Src {
        name,
        dtype,
        shape: shape.to_vec(),
    }
}

// ---- tests --------------------------------------------------------------------------------------

#[test]
fn mapping_file_and_streamed_weights_equal_the_gathering_version() {
    let dir = tempfile::tempdir().unwrap();
    let ck = checkpoint(
        dir.path(),
        &[
            src("tall", Dtype::F32, &[300, 70]),
            src("wide", Dtype::F32, &[30, 257]),
            src("sq", Dtype::F32, &[64, 64]),
            src("b", Dtype::Bf16, &[129, 33]),
            src("h", Dtype::F16, &[17, 5]),
            src("v", Dtype::F32, &[1001]),
            src("i", Dtype::I64, &[7]),
            src("row", Dtype::F32, &[1, 40]),
            src("col", Dtype::F32, &[40, 1]),
        ],
    );
    let table = vec![
        stored("tall", &ck, Dtype::Bf16, true),
        stored("tall", &ck, Dtype::F32, false),
        stored("wide", &ck, Dtype::Bf16, true),
        stored("wide", &ck, Dtype::F32, true),
        stored("sq", &ck, Dtype::F32, true),
        stored("b", &ck, Dtype::F32, true),
        stored("b", &ck, Dtype::F16, true),
        stored("h", &ck, Dtype::Bf16, false),
        stored("h", &ck, Dtype::F32, true),
        stored("v", &ck, Dtype::Bf16, false),
        stored("v", &ck, Dtype::F16, false),
        stored("i", &ck, Dtype::I64, false),
        stored("row", &ck, Dtype::Bf16, true),
        stored("col", &ck, Dtype::Bf16, true),
    ];
    let old = dir.path().join("old.safetensors");
    old_write_mapping(&table, &ck, &old);
    let old_bytes = std::fs::read(&old).unwrap();
    for band in [1, 3, 64, 1000, 4096, 70 * 4 * 7 + 1, BAND] {
        for threads in [1, 2] {
            let new = dir.path().join(format!("new-{band}-{threads}.safetensors"));
            let mut calls = 0;
            let total: u64 = table.iter().map(StoredWeight::nbytes).sum();
            let mut last = 0;
            write_mapping_with(
                &table,
                &ck,
                &new,
                &[],
                &mut |d, t| {
                    assert_eq!(t, total);
                    assert!(d >= last);
                    last = d;
                    calls += 1;
                },
                band,
                threads,
            )
            .unwrap();
            assert_eq!(last, total, "band {band}, threads {threads}");
            assert!(calls >= 1);
            let new_bytes = std::fs::read(&new).unwrap();
            assert!(
                new_bytes == old_bytes,
                "mapping file differs (band {band}, threads {threads})"
            );
        }
    }
    // The sequential path (`export_portable`'s deferred constants).
    for w in &table {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        old_write_weight(
            &mut a,
            &ck,
            &w.name,
            w.dtype,
            &w.shape,
            w.transpose,
            dir.path(),
        )
        .unwrap();
        write_weight(&mut b, &ck, w, dir.path()).unwrap();
        assert!(a == b, "{}: streamed bytes differ", w.key);
    }
}

#[test]
fn weights_written_in_place_equal_the_mapping_file_and_give_its_seal() {
    let dir = tempfile::tempdir().unwrap();
    let ck = checkpoint(
        dir.path(),
        &[
            src("tall", Dtype::F32, &[300, 70]),
            src("big", Dtype::F32, &[4096, 2100]),
            src("v", Dtype::F32, &[1001]),
            src("i", Dtype::I64, &[7]),
        ],
    );
    let table = vec![
        stored("tall", &ck, Dtype::Bf16, true),
        stored("big", &ck, Dtype::Bf16, true),
        stored("v", &ck, Dtype::F16, false),
        stored("i", &ck, Dtype::I64, false),
    ];
    let map = dir.path().join("map.safetensors");
    let meta = [("petite.mapping_key".to_string(), "k".to_string())];
    crate::write_mapping(&table, &ck, &map, &meta, &mut |_, _| {}).unwrap();
    let mapped = MappedSafetensors::open(&map).unwrap();
    // Another file, other places (in another order, with gaps), written in place.
    let pte = dir.path().join("in-place.bin");
    let file = std::fs::File::create_new(&pte).unwrap();
    let mut places = Vec::new();
    let mut at = 77u64;
    for t in [2, 0, 3, 1] {
        places.push((t, at));
        at += table[t].nbytes() + 13;
    }
    let finished = std::sync::Mutex::new(Vec::new());
    crate::write_weights_at(&table, &places, &ck, &file, &pte, &mut |_, _| {}, &|t| {
        finished.lock().unwrap().push(t);
        Ok(())
    })
    .unwrap();
    let mut finished = finished.into_inner().unwrap();
    finished.sort();
    assert_eq!(finished, vec![0, 1, 2, 3]);
    let written = std::fs::read(&pte).unwrap();
    for &(t, at) in &places {
        let r = mapped.file_range(&table[t].key).unwrap();
        let want = &std::fs::read(&map).unwrap()[r];
        assert!(
            &written[at as usize..at as usize + want.len()] == want,
            "{}",
            table[t].key
        );
    }
    let seal = crate::mapping_seal(&table, &map, &meta, &mut |t, off, buf| {
        let at = places.iter().find(|p| p.0 == t).unwrap().1;
        buf.copy_from_slice(&written[(at + off) as usize..(at + off) as usize + buf.len()]);
        Ok(())
    })
    .unwrap();
    assert!(std::fs::metadata(&map).unwrap().len() > petite_weights::seal::FULL_LIMIT);
    assert_eq!(
        seal,
        std::fs::read_to_string(petite_weights::seal::sidecar(&map)).unwrap()
    );
}

#[test]
fn wrong_shapes_and_dtypes_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let ck = checkpoint(
        dir.path(),
        &[src("w", Dtype::F32, &[4, 6]), src("n", Dtype::I32, &[5])],
    );
    let mut bad = stored("w", &ck, Dtype::Bf16, true);
    bad.shape = vec![4, 6];
    let e = write_weight(&mut Vec::new(), &ck, &bad, dir.path()).unwrap_err();
    assert!(
        e.to_string().contains("`w`") && e.to_string().contains("[6, 4]"),
        "{e}"
    );
    let n = stored("n", &ck, Dtype::F32, false);
    let e = write_weight(&mut Vec::new(), &ck, &n, dir.path()).unwrap_err();
    assert!(
        e.to_string().contains("`n`") && e.to_string().contains("I32"),
        "{e}"
    );
    let out = dir.path().join("m.safetensors");
    let e = write_mapping(&[n], &ck, &out, &[], &mut |_, _| {}).unwrap_err();
    assert!(e.to_string().contains("`n`"), "{e}");
    assert!(!out.exists());
}

/// A source that records how many of the mapping's pages are mapped into this process each time
/// a band opens a tensor or is about to give pages back (the most that is ever mapped).
struct Watched<'a> {
    inner: &'a MappedSafetensors,
    peak: std::sync::atomic::AtomicU64,
}

impl Watched<'_> {
    fn look(&self) {
        let r = self.inner.process_resident_bytes().expect("procfs");
        self.peak.fetch_max(r, std::sync::atomic::Ordering::Relaxed);
    }
}

impl WeightSource for Watched<'_> {
    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
    fn info(&self, name: &str) -> petite_weights::Result<petite_weights::TensorInfo> {
        self.inner.info(name)
    }
    fn tensor(&self, name: &str) -> petite_weights::Result<TensorView<'_>> {
        self.look();
        self.inner.tensor(name)
    }
    fn release(&self, names: &[&str]) -> petite_weights::Result<()> {
        self.look();
        self.inner.release(names)
    }
    fn release_range(&self, name: &str, start: usize, end: usize) -> petite_weights::Result<()> {
        self.look();
        self.inner.release_range(name, start, end)
    }
    fn unmap_range(&self, name: &str, start: usize, end: usize) -> petite_weights::Result<()> {
        self.look();
        self.inner.unmap_range(name, start, end)
    }
    fn prefetch_range(&self, name: &str, start: usize, end: usize) -> petite_weights::Result<()> {
        self.inner.prefetch_range(name, start, end)
    }
}

/// A source with nothing in it, for kernels that only unmap.
struct NoSource;

impl WeightSource for NoSource {
    fn names(&self) -> Vec<String> {
        Vec::new()
    }
    fn info(&self, name: &str) -> petite_weights::Result<petite_weights::TensorInfo> {
        Err(petite_weights::Error::MissingTensor {
            file: "(none)".into(),
            name: name.into(),
        })
    }
    fn tensor(&self, name: &str) -> petite_weights::Result<TensorView<'_>> {
        Err(petite_weights::Error::MissingTensor {
            file: "(none)".into(),
            name: name.into(),
        })
    }
    fn release(&self, _: &[&str]) -> petite_weights::Result<()> {
        Ok(())
    }
}

#[test]
fn source_pages_are_released_behind_each_band() {
    let dir = tempfile::tempdir().unwrap();
    // 32 MiB each in f32, a tall and a wide weight, converted in 1 MiB bands.
    let ck = checkpoint(
        dir.path(),
        &[
            src("tall", Dtype::F32, &[16384, 512]),
            src("wide", Dtype::F32, &[256, 32768]),
        ],
    );
    let size = 32u64 << 20;
    let band = 1 << 20;
    for t in [
        stored("tall", &ck, Dtype::Bf16, true),
        stored("wide", &ck, Dtype::Bf16, true),
    ] {
        let w = Watched {
            inner: &ck,
            peak: 0.into(),
        };
        let out = dir.path().join(format!("{}.safetensors", t.name));
        write_mapping_with(
            std::slice::from_ref(&t),
            &w,
            &out,
            &[],
            &mut |_, _| {},
            band,
            1,
        )
        .unwrap();
        let peak = w.peak.into_inner();
        // The gathering version, for contrast: the whole weight ends up mapped.
        let w = Watched {
            inner: &ck,
            peak: 0.into(),
        };
        let old = dir.path().join(format!("{}-old.safetensors", t.name));
        old_write_mapping(std::slice::from_ref(&t), &w, &old);
        let old_peak = w.peak.into_inner();
        eprintln!(
            "{}: at most {peak} bytes mapped (gathering: {old_peak})",
            t.name
        );
        assert!(
            peak <= size / 4,
            "{}: {peak} bytes of the checkpoint mapped at once",
            t.name
        );
        assert!(
            old_peak >= size * 3 / 4,
            "{}: gathering peak {old_peak}",
            t.name
        );
        assert!(std::fs::read(&old).unwrap() == std::fs::read(&out).unwrap());
        std::fs::remove_file(old).unwrap();
        std::fs::remove_file(out).unwrap();
    }
}

/// (source, stored) dtype pairs that convert.
const PAIRS: &[(Dtype, Dtype)] = &[
    (Dtype::F32, Dtype::Bf16),
    (Dtype::F32, Dtype::F32),
    (Dtype::F32, Dtype::F16),
    (Dtype::Bf16, Dtype::F32),
    (Dtype::Bf16, Dtype::Bf16),
    (Dtype::F16, Dtype::F32),
    (Dtype::Bf16, Dtype::F16),
    (Dtype::F16, Dtype::Bf16),
    (Dtype::I64, Dtype::I64),
    (Dtype::U8, Dtype::U8),
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every band layout (any band size, tile edges anywhere) writes each
    /// stored byte exactly once, equal to the old per-element conversion of the source element
    /// the transpose puts there.
    #[test]
    fn bands_equal_a_naive_transpose(
        r in 1usize..90,
        c in 1usize..90,
        pair in 0..PAIRS.len(),
        band_frac in 0.0f64..1.3,
        transpose in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let (from, to) = PAIRS[pair];
        let (es, os) = (from.size(), to.size());
        let src = bytes(r * c, es, seed);
        let w = StoredWeight {
            key: "k".into(),
            name: "w".into(),
            transpose,
            dtype: to,
            shape: if transpose { vec![c, r] } else { vec![r, c] },
        };
        let lay = Layout::new(&w, from).unwrap();
        let band = ((r * c * es) as f64 * band_frac) as usize;
        let mut out = vec![0u8; r * c * os];
        let mut hits = vec![0u8; r * c * os];
        let mut buf = Vec::new();
        let bands = lay.bands(band);
        prop_assert!(!bands.is_empty());
        let mut last_end = 0u64;
        for b in bands {
            let mut ends = Vec::new();
            lay.run(&src, b, &mut buf, (&NoSource, "w"), &mut |off, seg| {
                let o = off as usize;
                out[o..o + seg.len()].copy_from_slice(seg);
                for h in &mut hits[o..o + seg.len()] {
                    *h += 1;
                }
                ends.push((off, off + seg.len() as u64));
                Ok(())
            }).unwrap();
            // Sequential writers get contiguous bytes in order.
            prop_assert_eq!(ends.len(), 1);
            prop_assert_eq!(ends[0].0, last_end);
            last_end = ends[0].1;
        }
        prop_assert!(hits.iter().all(|&h| h == 1));
        let mut want = vec![0u8; r * c * os];
        for i in 0..r {
            for j in 0..c {
                let s = &src[(i * c + j) * es..(i * c + j + 1) * es];
                let at = if transpose { j * r + i } else { i * c + j };
                let mut e = Vec::new();
                prop_assert!(old_convert_into(s, from, to, &mut e));
                want[at * os..(at + 1) * os].copy_from_slice(&e);
            }
        }
        prop_assert!(out == want);
    }
}
