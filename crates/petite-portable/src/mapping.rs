//! The exporter's mapping file: every stored weight once, in the exact bytes a `.pte` stores,
//! converted in bands by two threads through petite-weights' streaming writer.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use petite_weights::writeback::WriteBehind;
use petite_weights::{SafetensorsLayout, SafetensorsWriter, TensorSpec, WeightSource};

use crate::convert::{BAND, Band, Layout, ahead, checked_view};
use crate::{Error, Result, StoredWeight, check_weights};

/// Threads converting bands of the mapping file (the target has 2 cores).
const MAPPING_THREADS: usize = 2;

/// Writes every stored weight of `table` into a safetensors mapping file at `path` in the exact
/// bytes a `.pte` stores (converted, transposed), through petite-weights' streaming writer
/// (temporary name, fsync, seal `<path>.seal`, rename: the final name never holds a partial
/// file, nor one built from a source that changed meanwhile). Work is cut into
/// bands of about 8 MiB of source, converted by two threads and written at their final
/// offsets; each band gives its source pages back behind itself, so memory stays a few bands
/// whatever the tensor's size. `progress(done, total)` is called as bands finish. Returns the
/// file's size.
pub fn write_mapping(
    table: &[StoredWeight],
    weights: &dyn WeightSource,
    path: &Path,
    metadata: &[(String, String)],
    progress: &mut dyn FnMut(u64, u64),
) -> Result<u64> {
    write_mapping_with(
        table,
        weights,
        path,
        metadata,
        progress,
        BAND,
        MAPPING_THREADS,
    )
}

pub(crate) fn write_mapping_with(
    table: &[StoredWeight],
    weights: &dyn WeightSource,
    path: &Path,
    metadata: &[(String, String)],
    progress: &mut dyn FnMut(u64, u64),
    band: usize,
    threads: usize,
) -> Result<u64> {
    check_weights(table, weights)?;
    let writer = SafetensorsWriter::create(path, &specs(table), metadata)?;
    let index = key_index(table);
    let mut places = Vec::with_capacity(table.len());
    for key in writer.order() {
        places.push((index[key], writer.placement(key)?.0));
    }
    convert_bands(
        &Bands {
            table,
            places: &places,
            weights,
            fd: writer.file().as_fd(),
            write: &|t, off, _, seg| Ok(writer.write_at(&table[t].key, off, seg)?),
            done: &|_| Ok(()),
            band,
            threads,
        },
        progress,
    )?;
    let len = writer.total_len();
    // A cache file: published only if the source did not change while it was read, and sealed
    // (petite-weights' `seal`) for the next run's reuse check.
    weights.check_unchanged()?;
    writer.finish_sealed()?;
    Ok(len)
}

/// Converts the stored weights `places` names (`(index in table, absolute offset)`, in file
/// order) straight into their places in `file` (a `.pte` laid out with them; `path` names it in
/// errors): the banded two-thread conversion of [`write_mapping`] (readahead, `pwrite`,
/// write-behind, source pages released behind), each weight written once. `done(t)` is called
/// (from a converting thread) once every byte of `table[t]` is written, so a caller can record
/// finished weights for a resumed run. The file is not synced.
pub fn write_weights_at(
    table: &[StoredWeight],
    places: &[(usize, u64)],
    weights: &dyn WeightSource,
    file: &File,
    path: &Path,
    progress: &mut dyn FnMut(u64, u64),
    done: &(dyn Fn(usize) -> Result<()> + Sync),
) -> Result<()> {
    convert_bands(
        &Bands {
            table,
            places,
            weights,
            fd: file.as_fd(),
            write: &|_, _, at, seg| {
                file.write_all_at(seg, at).map_err(|e| Error::Io {
                    path: path.to_path_buf(),
                    op: "write weight",
                    source: e,
                })
            },
            done,
            band: BAND,
            threads: MAPPING_THREADS,
        },
        progress,
    )
}

/// The seal ([`petite_weights::seal`]) of the mapping file [`write_mapping`] would write at
/// `path` for `table` with `metadata`, without writing it: its planned header and the stored
/// bytes of the ranges a seal samples, read where they already are (`read(t, offset, buf)`:
/// bytes from `offset` of `table[t]` as stored, e.g. from a `.pte` holding them). A few MiB are
/// read.
pub fn mapping_seal(
    table: &[StoredWeight],
    path: &Path,
    metadata: &[(String, String)],
    read: &mut ReadStored<'_>,
) -> Result<String> {
    let layout = SafetensorsLayout::plan(path, &specs(table), metadata)?;
    let index = key_index(table);
    let header = layout.header();
    let tensors: Vec<(usize, u64, u64)> = layout
        .tensors()
        .map(|(k, _, start, len)| (index[k], start, len))
        .collect();
    let mut read_at = |off: u64, buf: &mut [u8]| -> std::io::Result<()> {
        let mut filled = 0usize;
        while filled < buf.len() {
            let p = off + filled as u64;
            let rest = buf.len() - filled;
            let k = if p < header.len() as u64 {
                let k = (header.len() - p as usize).min(rest);
                buf[filled..filled + k].copy_from_slice(&header[p as usize..p as usize + k]);
                k
            } else {
                // The data region is contiguous: the tensor holding `p`.
                let i = tensors.partition_point(|t| t.1 + t.2 <= p);
                let &(t, start, len) = tensors
                    .get(i)
                    .ok_or_else(|| std::io::Error::other("read past the planned file"))?;
                let k = ((start + len - p) as usize).min(rest);
                read(t, p - start, &mut buf[filled..filled + k])?;
                k
            };
            filled += k;
        }
        Ok(())
    };
    petite_weights::seal::line(layout.total_len(), &mut read_at).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        op: "seal the planned mapping file",
        source: e,
    })
}

fn specs(table: &[StoredWeight]) -> Vec<TensorSpec> {
    table
        .iter()
        .map(|w| TensorSpec::new(&w.key, w.dtype, &w.shape))
        .collect()
}

fn key_index(table: &[StoredWeight]) -> HashMap<&str, usize> {
    table
        .iter()
        .enumerate()
        .map(|(i, w)| (w.key.as_str(), i))
        .collect()
}

/// Reads bytes of a stored weight: `(index in table, offset within it, buffer)`.
pub type ReadStored<'a> = dyn FnMut(usize, u64, &mut [u8]) -> std::io::Result<()> + 'a;

/// Writes bytes of a stored weight: `(index in table, offset within it, absolute offset, bytes)`.
type WriteStored<'a> = dyn Fn(usize, u64, u64, &[u8]) -> Result<()> + Sync + 'a;

/// One banded conversion: which weights go where, and how bytes are written.
struct Bands<'a> {
    table: &'a [StoredWeight],
    /// `(index in table, absolute offset in the file behind `fd`)`, in file order.
    places: &'a [(usize, u64)],
    weights: &'a dyn WeightSource,
    /// The file written (for write-behind).
    fd: BorrowedFd<'a>,
    /// Writes bytes of a stored weight: `(index in table, offset within it, absolute offset,
    /// bytes)`.
    write: &'a WriteStored<'a>,
    /// A weight's every byte is written.
    done: &'a (dyn Fn(usize) -> Result<()> + Sync),
    band: usize,
    threads: usize,
}

/// Converts every weight of `b.places` in bands of about `b.band` source bytes on `b.threads`
/// threads, in file order (so the output is written nearly sequentially); each band gives its
/// source pages back behind itself, so memory stays a few bands whatever the tensor's size.
fn convert_bands(b: &Bands<'_>, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
    let (table, weights) = (b.table, b.weights);
    let mut layouts = Vec::with_capacity(table.len());
    for w in table {
        layouts.push(Layout::new(w, weights.info(&w.name)?.dtype)?);
    }
    let mut items: Vec<(usize, Band)> = Vec::new();
    let mut at = vec![0u64; table.len()];
    for &(t, a) in b.places {
        at[t] = a;
        items.extend(layouts[t].bands(b.band).into_iter().map(|x| (t, x)));
    }
    let left: Vec<AtomicUsize> = (0..table.len()).map(|_| AtomicUsize::new(0)).collect();
    for (t, _) in &items {
        left[*t].fetch_add(1, Ordering::Relaxed);
    }
    let total: u64 = b.places.iter().map(|&(t, _)| table[t].nbytes()).sum();
    let page = petite_weights::page_size();
    let next = AtomicUsize::new(0);
    let done = AtomicU64::new(0);
    let failed = AtomicBool::new(false);
    let first_err: Mutex<Option<Error>> = Mutex::new(None);
    // Takes bands until none is left or a thread failed; returns after each band when `once`.
    let work = |buf: &mut Vec<u8>, flusher: &mut WriteBehind, once: bool| {
        while !failed.load(Ordering::Relaxed) {
            let k = next.fetch_add(1, Ordering::Relaxed);
            let Some(&(t, band)) = items.get(k) else {
                return false;
            };
            let (w, lay) = (&table[t], &layouts[t]);
            let res = (|| -> Result<()> {
                if k == 0 {
                    ahead(weights, &w.name, lay.lead(band))?;
                }
                // Readahead for the next band (of this tensor or the next one).
                if let Some(&(t2, b2)) = items.get(k + 1) {
                    ahead(weights, &table[t2].name, layouts[t2].lead(b2))?;
                }
                let view = checked_view(weights, w)?;
                let mut bytes = 0u64;
                lay.run(
                    view.bytes,
                    band,
                    buf,
                    (weights, &w.name),
                    &mut |off, seg| {
                        bytes += seg.len() as u64;
                        (b.write)(t, off, at[t] + off, seg)?;
                        flusher.push(at[t] + off, seg.len() as u64);
                        Ok(())
                    },
                )?;
                lay.release(weights, &w.name, view.bytes, band, page)?;
                if left[t].fetch_sub(1, Ordering::AcqRel) == 1 {
                    weights.release(&[&w.name])?;
                    (b.done)(t)?;
                }
                done.fetch_add(bytes, Ordering::Relaxed);
                Ok(())
            })();
            if let Err(e) = res {
                failed.store(true, Ordering::Relaxed);
                first_err.lock().expect("no panics").get_or_insert(e);
                return false;
            }
            if once {
                return true;
            }
        }
        false
    };
    std::thread::scope(|scope| {
        for _ in 1..b.threads.max(1) {
            scope.spawn(|| work(&mut Vec::new(), &mut WriteBehind::new(b.fd, 4), false));
        }
        // This thread converts too, reporting progress between its bands.
        let (mut buf, mut flusher) = (Vec::new(), WriteBehind::new(b.fd, 4));
        while work(&mut buf, &mut flusher, true) {
            progress(done.load(Ordering::Relaxed), total);
        }
    });
    if let Some(e) = first_err.into_inner().expect("no panics") {
        return Err(e);
    }
    progress(done.load(Ordering::Relaxed), total);
    Ok(())
}
