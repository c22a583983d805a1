//! The exporter's mapping file: every stored weight once, in the exact bytes a `.pte` stores,
//! converted in bands by two threads through petite-weights' streaming writer.

use std::os::fd::AsFd;
use std::path::Path;

use petite_weights::writeback::WriteBehind;
use petite_weights::{SafetensorsWriter, TensorSpec, WeightSource};

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
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

    check_weights(table, weights)?;
    let specs: Vec<TensorSpec> = table
        .iter()
        .map(|w| TensorSpec::new(&w.key, w.dtype, &w.shape))
        .collect();
    let writer = SafetensorsWriter::create(path, &specs, metadata)?;
    let index: std::collections::HashMap<&str, usize> = table
        .iter()
        .enumerate()
        .map(|(i, w)| (w.key.as_str(), i))
        .collect();
    // Bands in file order, so the output is written (nearly) sequentially.
    let mut layouts = Vec::with_capacity(table.len());
    for w in table {
        layouts.push(Layout::new(w, weights.info(&w.name)?.dtype)?);
    }
    let mut items: Vec<(usize, Band)> = Vec::new();
    for key in writer.order() {
        let t = index[key];
        items.extend(layouts[t].bands(band).into_iter().map(|b| (t, b)));
    }
    let left: Vec<AtomicUsize> = (0..table.len()).map(|_| AtomicUsize::new(0)).collect();
    for (t, _) in &items {
        left[*t].fetch_add(1, Ordering::Relaxed);
    }
    let total: u64 = table.iter().map(StoredWeight::nbytes).sum();
    let page = petite_weights::page_size();
    let next = AtomicUsize::new(0);
    let done = AtomicU64::new(0);
    let failed = AtomicBool::new(false);
    let first_err: Mutex<Option<Error>> = Mutex::new(None);
    // Takes bands until none is left or a thread failed; returns after each band when `once`.
    let fd = writer.file().as_fd();
    let work = |buf: &mut Vec<u8>, flusher: &mut WriteBehind, once: bool| {
        while !failed.load(Ordering::Relaxed) {
            let k = next.fetch_add(1, Ordering::Relaxed);
            let Some(&(t, b)) = items.get(k) else {
                return false;
            };
            let (w, lay) = (&table[t], &layouts[t]);
            let res = (|| -> Result<()> {
                if k == 0 {
                    ahead(weights, &w.name, lay.lead(b))?;
                }
                // Readahead for the next band (of this tensor or the next one).
                if let Some(&(t2, b2)) = items.get(k + 1) {
                    ahead(weights, &table[t2].name, layouts[t2].lead(b2))?;
                }
                let view = checked_view(weights, w)?;
                let (at, _) = writer.placement(&w.key)?;
                let mut bytes = 0u64;
                lay.run(view.bytes, b, buf, (weights, &w.name), &mut |off, seg| {
                    bytes += seg.len() as u64;
                    writer.write_at(&w.key, off, seg)?;
                    flusher.push(at + off, seg.len() as u64);
                    Ok(())
                })?;
                lay.release(weights, &w.name, view.bytes, b, page)?;
                if left[t].fetch_sub(1, Ordering::AcqRel) == 1 {
                    weights.release(&[&w.name])?;
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
        for _ in 1..threads.max(1) {
            scope.spawn(|| work(&mut Vec::new(), &mut WriteBehind::new(fd, 4), false));
        }
        // This thread converts too, reporting progress between its bands.
        let (mut buf, mut flusher) = (Vec::new(), WriteBehind::new(fd, 4));
        while work(&mut buf, &mut flusher, true) {
            progress(done.load(Ordering::Relaxed), total);
        }
    });
    if let Some(e) = first_err.into_inner().expect("no panics") {
        return Err(e);
    }
    progress(done.load(Ordering::Relaxed), total);
    let len = writer.total_len();
    // A cache file: published only if the source did not change while it was read, and sealed
    // (petite-weights' `seal`) for the next run's reuse check.
    weights.check_unchanged()?;
    writer.finish_sealed()?;
    Ok(len)
}
