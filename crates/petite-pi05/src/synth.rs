//! Synthetic pi0.5 checkpoints: every tensor of a layout, f32, filled as
//! [`ParamKind::synthetic_init`](crate::names::ParamKind::synthetic_init) says (norms at the real
//! model's initial constants, everything else seeded normal draws), streamed to disk so the
//! full-size 15.4 GiB model needs only a few MiB of memory.
//!
//! **Values are a pure function of `(seed, canonical tensor name, element index)`**: each element
//! index is hashed with the tensor's key (a counter-based generator), and element pairs go
//! through Box–Muller computed with basic float operations only. So the bytes do not depend on the thread count or the chunking, and the
//! same canonical tensor holds the same values in both layouts (a Hub file's
//! `paligemma.lm_head.weight` equals a lerobot file's `embed_tokens.weight` for the same seed),
//! which lets tests compare the two layouts of one model.
//!
//! Memory stays bounded: generator threads fill a fixed pool of 4 MiB chunk buffers; one writer
//! writes them in file order; a flush thread asks the kernel to start writeback of each written
//! range and, once more than `inflight_bytes` are in flight, waits for the oldest range and drops
//! its pages from the page cache (dirty and cached output would otherwise grow until the cgroup's limit forces reclaim).

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, mpsc};
use std::time::Instant;

use petite_weights::writeback::WriteBehind;
use petite_weights::{Dtype, SafetensorsWriter, TensorSpec as WriterSpec};

use crate::config::Pi05Config;
use crate::names::{self, Init, Layout};
use crate::{Error, Result};

/// File name written inside the output directory.
pub const FILE_NAME: &str = "model.safetensors";

/// Elements per work item (4 MiB of f32): big enough to amortise the syscalls, small enough that
/// the in-flight window is many chunks.
const CHUNK_ELEMS: usize = 1 << 20;

/// Options of [`write_synthetic`].
#[derive(Debug, Clone)]
pub struct SynthOptions {
    /// Seed; the same seed gives the same bytes.
    pub seed: u64,
    /// Worker threads (at least 1); does not change the output.
    pub threads: usize,
    /// Output bytes (all workers together) allowed in writeback before a worker waits for its
    /// oldest chunk and evicts it: bounds the dirty and cached output, i.e. the memory the run
    /// charges beyond its buffers. Larger windows let the disk merge more; does not change the
    /// output.
    pub inflight_bytes: u64,
}

impl Default for SynthOptions {
    fn default() -> Self {
        SynthOptions {
            seed: 0,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get().min(2)),
            inflight_bytes: 64 << 20,
        }
    }
}

/// What [`write_synthetic`] wrote.
#[derive(Debug, Clone)]
pub struct SynthReport {
    /// The file written (`DIR/model.safetensors`).
    pub path: PathBuf,
    /// Tensors written.
    pub tensors: usize,
    /// Tensor data bytes (f32 elements × 4).
    pub data_bytes: u64,
    /// File size (header and alignment padding included).
    pub file_bytes: u64,
    /// Wall time, fsync and rename included.
    pub seconds: f64,
}

/// 64-bit finaliser (Stafford's "mix13", as in SplitMix64): a bijection with full avalanche.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a of the name: spreads tensor names over the key space before mixing with the seed.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The generator key of one tensor: depends on the seed and the tensor's canonical name only.
pub fn tensor_key(seed: u64, canonical: &str) -> u64 {
    mix64(mix64(seed ^ 0x9e37_79b9_7f4a_7c15).wrapping_add(name_hash(canonical)))
}

/// 32-bit integer hash ("lowbias32", bias ≈ 0.17): 32-bit lanes only, so the whole generator
/// vectorises on SSE2 and NEON (a 64-bit multiply would not).
#[inline(always)]
fn h32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// ln(u) for u in (0, 1] from the float's exponent and a series in (m-1)/(m+1) with
/// m in [√½, √2) (absolute error < 1e-6). Basic IEEE operations only, no libm: the result is
/// bit-identical whether the loop is vectorised or not, and on every platform.
#[inline(always)]
fn ln01(u: f32) -> f32 {
    let bits = u.to_bits();
    let e = (bits.wrapping_sub(0x3f35_04f3) as i32) >> 23;
    let m = f32::from_bits(bits.wrapping_sub((e as u32) << 23));
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let p = 1.0 + s2 * (1.0 / 3.0 + s2 * (0.2 + s2 * (1.0 / 7.0 + s2 * (1.0 / 9.0))));
    e as f32 * std::f32::consts::LN_2 + 2.0 * s * p
}

/// sin and cos of x in [0, π/2) by Taylor series (error < 2e-7); basic operations only.
#[inline(always)]
fn sincos_quarter(x: f32) -> (f32, f32) {
    let x2 = x * x;
    let s = x
        * (1.0
            + x2 * (-1.0 / 6.0
                + x2 * (1.0 / 120.0
                    + x2 * (-1.0 / 5040.0
                        + x2 * (1.0 / 362_880.0
                            + x2 * (-1.0 / 39_916_800.0 + x2 * (1.0 / 6_227_020_800.0)))))));
    let c = 1.0
        + x2 * (-0.5
            + x2 * (1.0 / 24.0
                + x2 * (-1.0 / 720.0
                    + x2 * (1.0 / 40_320.0
                        + x2 * (-1.0 / 3_628_800.0 + x2 * (1.0 / 479_001_600.0))))));
    (s, c)
}

/// Two standard normal draws for pair `j` (elements `2j`, `2j+1`) of the tensor keyed
/// `(k0, k1)`: each element index is hashed to 32 bits, then Box–Muller with the angle drawn as a
/// quarter-turn angle plus two sign bits (equivalent to a uniform angle). The radius uses a
/// 24-bit uniform in (0, 1], so |z| ≤ 5.77 — tails a synthetic model does not miss.
#[inline(always)]
fn normal_pair(k0: u32, k1: u32, j: u32) -> (f32, f32) {
    const TWO_NEG24: f32 = 1.0 / (1u32 << 24) as f32;
    let a = h32(h32(j.wrapping_mul(2) ^ k0) ^ k1);
    let b = h32(h32(j.wrapping_mul(2).wrapping_add(1) ^ k0) ^ k1);
    let u1 = ((a >> 8) + 1) as f32 * TWO_NEG24;
    let phi = (b >> 8) as f32 * (TWO_NEG24 * std::f32::consts::FRAC_PI_2);
    let r = (-2.0 * ln01(u1)).sqrt();
    let (s, c) = sincos_quarter(phi);
    (
        f32::from_bits((r * c).to_bits() ^ ((a & 1) << 31)),
        f32::from_bits((r * s).to_bits() ^ ((b & 1) << 31)),
    )
}

/// Fills `out` with elements `start..start + out.len()` of a tensor initialised as `init`
/// (normal draws keyed by `key`). Element `i`'s value depends only on `(key, i)`, so any
/// chunking gives the same bytes. Public so tests can check single values against a file.
pub fn fill(init: Init, key: u64, start: u64, out: &mut [f32]) {
    let Init::Normal { std } = init else {
        if let Init::Constant(c) = init {
            out.fill(c);
        }
        return;
    };
    let k0 = key as u32;
    let mut idx = start;
    let mut o = 0usize;
    while o < out.len() {
        // Element indices beyond 2^32 (no real tensor has them) fold their high half into the key.
        let hi = (idx >> 32) as u32;
        let k1 = (key >> 32) as u32 ^ hi.wrapping_mul(0x9e37_79b9);
        let seg_end = ((u128::from(hi) + 1) << 32) - u128::from(idx);
        let n = (out.len() - o).min(usize::try_from(seg_end).unwrap_or(usize::MAX));
        let seg = &mut out[o..o + n];
        let mut i = 0;
        let lo = idx as u32;
        // An odd start takes the second draw of its pair.
        if lo % 2 == 1 {
            seg[0] = normal_pair(k0, k1, lo / 2).1 * std;
            i = 1;
        }
        let j0 = (lo.wrapping_add(i as u32)) / 2;
        let body = &mut seg[i..];
        let pairs = body.len() / 2;
        fill_pairs(k0, k1, j0, std, &mut body[..2 * pairs]);
        if body.len() % 2 == 1 {
            let last = body.len() - 1;
            body[last] = normal_pair(k0, k1, j0.wrapping_add(pairs as u32)).0 * std;
        }
        idx += n as u64;
        o += n;
    }
}

/// Element pairs `j0..` into `out` (even length), on the widest vector unit present. Every path
/// computes the same IEEE operations on the same values (no FMA contraction), so the bytes are
/// identical on every machine; AVX2 only makes the 32-bit multiplies and the polynomials wider
/// (≈2.5× fewer cycles than the SSE2 baseline).
fn fill_pairs(k0: u32, k1: u32, j0: u32, std: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { fill_pairs_avx2(k0, k1, j0, std, out) };
        return;
    }
    fill_pairs_portable(k0, k1, j0, std, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn fill_pairs_avx2(k0: u32, k1: u32, j0: u32, std: f32, out: &mut [f32]) {
    fill_pairs_portable(k0, k1, j0, std, out);
}

#[inline(always)]
fn fill_pairs_portable(k0: u32, k1: u32, j0: u32, std: f32, out: &mut [f32]) {
    for (dst, j) in out.chunks_exact_mut(2).zip(j0..) {
        let (x, y) = normal_pair(k0, k1, j);
        dst[0] = x * std;
        dst[1] = y * std;
    }
}

/// `vals` as little-endian bytes: a view on little-endian targets (no copy), else a copy into
/// `scratch`.
fn le_bytes<'a>(vals: &'a [f32], scratch: &'a mut Vec<u8>) -> &'a [u8] {
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice(vals)
    } else {
        scratch.clear();
        scratch.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
        scratch
    }
}

struct Item {
    /// Index into the table.
    tensor: usize,
    start: usize,
    end: usize,
}

/// Writes `out_dir/model.safetensors`: every tensor `layout` stores for `cfg`, f32, with the
/// stored names and shapes (see the module docs for the values). The config is validated first
/// and nothing is created if it is inconsistent; the file is written under a temporary name and
/// renamed only when complete, so on any error nothing exists under the final name.
/// `out_dir` is created if missing.
pub fn write_synthetic(
    cfg: &Pi05Config,
    layout: Layout,
    out_dir: &Path,
    opts: &SynthOptions,
) -> Result<SynthReport> {
    cfg.validate()?;
    let t0 = Instant::now();
    let stored = names::layout_tensors(cfg, layout);
    // The canonical name of each stored tensor keys its values (same values in both layouts).
    let canonical: Vec<String> = names::lerobot_tensors(cfg)
        .into_iter()
        .map(|t| t.name)
        .filter(|n| names::stored_name(n, layout).is_some())
        .collect();
    let mut by_stored = std::collections::HashMap::new();
    for c in &canonical {
        let s = names::stored_name(c, layout).expect("filtered to stored names");
        by_stored.insert(s, c.clone());
    }
    let mut table = Vec::with_capacity(stored.len());
    let mut plan = Vec::with_capacity(stored.len());
    for t in &stored {
        let canon = by_stored.get(&t.name).ok_or_else(|| {
            Error::UnknownWeight(format!("{} (no canonical name in this layout)", t.name))
        })?;
        table.push(WriterSpec::new(t.name.clone(), Dtype::F32, &t.shape));
        plan.push((
            t.kind.synthetic_init(),
            tensor_key(opts.seed, canon),
            t.numel(),
        ));
    }

    std::fs::create_dir_all(out_dir).map_err(|source| Error::Io {
        path: out_dir.display().to_string(),
        source,
    })?;
    let path = out_dir.join(FILE_NAME);
    let metadata = vec![
        ("format".to_string(), "pt".to_string()),
        ("petite.synthetic_seed".to_string(), opts.seed.to_string()),
        (
            "petite.layout".to_string(),
            match layout {
                Layout::Lerobot => "lerobot".to_string(),
                Layout::Hub { prefixed: true } => "hub-prefixed".to_string(),
                Layout::Hub { prefixed: false } => "hub".to_string(),
            },
        ),
    ];
    let writer = SafetensorsWriter::create(&path, &table, &metadata)?;

    // Work items in file order, so concurrent workers write close to sequentially.
    let index: std::collections::HashMap<&str, usize> = table
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let mut items = Vec::new();
    let mut data_bytes = 0u64;
    for name in writer.order() {
        let i = index[name];
        let numel = plan[i].2;
        data_bytes += numel as u64 * 4;
        let mut s = 0;
        while s < numel {
            let e = (s + CHUNK_ELEMS).min(numel);
            items.push(Item {
                tensor: i,
                start: s,
                end: e,
            });
            s = e;
        }
    }

    // A pipeline: `threads` generators fill chunk buffers in parallel; this thread writes them in
    // file order and flushes behind. One writer, because buffered writes to one file serialise
    // on its inode lock anyway (two writing threads measured slower than one), and in-order
    // writes let the kernel merge them.
    let threads = opts.threads.max(1);
    let depth = (opts.inflight_bytes / (CHUNK_ELEMS * 4) as u64).max(1) as usize;
    let nbuf = 3 * threads;
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let (done_tx, done_rx) = mpsc::sync_channel::<(usize, Vec<f32>)>(nbuf);
    let (pool_tx, pool_rx) = mpsc::channel::<Vec<f32>>();
    for _ in 0..nbuf {
        pool_tx
            .send(vec![0f32; CHUNK_ELEMS])
            .expect("the receiver is alive");
    }
    let pool_rx = Mutex::new(pool_rx);
    let fd = writer.file().as_fd();
    let result: Result<()> = std::thread::scope(|scope| {
        for _ in 0..threads {
            let done_tx = done_tx.clone();
            let (next, items, plan, pool_rx, stop) = (&next, &items, &plan, &pool_rx, &stop);
            scope.spawn(move || {
                loop {
                    // A buffer first, then an item: every claimed item can be produced, so the
                    // writer never waits for an item whose generator waits for a buffer.
                    let Ok(rx) = pool_rx.lock() else { return };
                    let Ok(mut buf) = rx.recv() else { return };
                    drop(rx);
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some(it) = items.get(k) else { return };
                    let (init, key, _) = plan[it.tensor];
                    fill(init, key, it.start as u64, &mut buf[..it.end - it.start]);
                    if done_tx.send((k, buf)).is_err() {
                        return;
                    }
                }
            });
        }
        drop(done_tx);
        // Writeback runs on its own thread, so submitting and awaiting I/O overlaps the writer's
        // copying. The bounded channel holds the writer back when writeback lags: at most
        // `depth` ranges queued plus `depth` in writeback.
        let (flush_tx, flush_rx) = mpsc::sync_channel::<(u64, u64)>(depth);
        let flush_thread = scope.spawn(move || {
            let mut flusher = WriteBehind::new(fd, depth);
            for (off, len) in flush_rx {
                flusher.push(off, len);
            }
            flusher.finish();
        });
        let mut waiting = HashMap::new();
        let mut scratch = Vec::new();
        let res = (|| -> Result<()> {
            for (k, it) in items.iter().enumerate() {
                let buf = loop {
                    if let Some(b) = waiting.remove(&k) {
                        break b;
                    }
                    let (j, b) = done_rx.recv().map_err(|_| Error::Io {
                        path: path.display().to_string(),
                        source: std::io::Error::other("a generator thread stopped"),
                    })?;
                    waiting.insert(j, b);
                };
                let n = it.end - it.start;
                let name = &table[it.tensor].name;
                let off = it.start as u64 * 4;
                writer.write_at(name, off, le_bytes(&buf[..n], &mut scratch))?;
                let (abs, _) = writer.placement(name)?;
                // The flush thread only stops after this loop; a send cannot fail before.
                let _ = flush_tx.send((abs + off, n as u64 * 4));
                // Generators may have stopped already; the buffer is then simply dropped.
                let _ = pool_tx.send(buf);
            }
            Ok(())
        })();
        // Stop the generators (those waiting for a buffer wake up when the pool closes).
        stop.store(true, Ordering::Relaxed);
        drop(pool_tx);
        drop(done_rx);
        drop(flush_tx);
        let _ = flush_thread.join();
        res
    });
    // On error, dropping the writer deletes the temporary file.
    result?;
    let file_bytes = writer.total_len();
    let path = writer.finish()?;
    Ok(SynthReport {
        path,
        tensors: table.len(),
        data_bytes,
        file_bytes,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector path must give the portable path's exact bits (else files would differ
    /// between machines).
    #[test]
    fn every_code_path_gives_the_same_bits() {
        let (k0, k1) = (0x1234_5678, 0x9abc_def0);
        let mut a = vec![0f32; 4098];
        let mut b = vec![0f32; 4098];
        fill_pairs(k0, k1, 17, 0.02, &mut a);
        fill_pairs_portable(k0, k1, 17, 0.02, &mut b);
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
        let mut s = Vec::new();
        let bytes = le_bytes(&a[..3], &mut s);
        assert_eq!(bytes.len(), 12);
        assert_eq!(&bytes[4..8], &a[1].to_le_bytes());
    }

    #[test]
    fn polynomials_are_accurate() {
        for i in 1..=4096u32 {
            let u = i as f32 / 4096.0;
            assert!(
                (f64::from(ln01(u)) - f64::from(u).ln()).abs() < 2e-6,
                "ln {u}"
            );
            let x = (i - 1) as f32 / 4096.0 * std::f32::consts::FRAC_PI_2;
            let (s, c) = sincos_quarter(x);
            assert!((f64::from(s) - f64::from(x).sin()).abs() < 1e-6, "sin {x}");
            assert!((f64::from(c) - f64::from(x).cos()).abs() < 1e-6, "cos {x}");
        }
    }
}
