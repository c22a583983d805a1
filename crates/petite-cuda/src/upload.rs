//! Weights to the device in pieces through page-locked staging buffers. One thread asks for
//! the pieces' pages in order, a bounded window ahead (`MADV_WILLNEED`: the disk sees one
//! sequential stream of large requests); reader threads copy or convert pieces into staging
//! buffers; the device's thread copies each full buffer up while the next ones fill. Before, one
//! copy from pageable memory through the driver did reading, converting and copying in turn.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;

use cudarc::driver::{CudaEvent, PinnedHostSlice};
use petite_graph::Dtype;
use petite_weights::{WeightSource, convert_into};

use crate::device::{DevTensor, Device};
use crate::{Error, Result, driver};

/// Declared-dtype bytes one staging buffer holds.
const PIECE: usize = 8 << 20;

/// Stored bytes whose pages are asked for ahead of the readers.
const AHEAD: usize = 128 << 20;

/// One weight's upload: its stored bytes and the device value they become.
pub(crate) struct Job<'a> {
    /// The weight's name (for errors, prefetching and releasing pages).
    pub name: &'a str,
    /// The stored bytes to upload (a row range's, or the whole tensor's).
    pub bytes: &'a [u8],
    /// Offset of `bytes` in the tensor's stored bytes.
    pub start: usize,
    /// The dtype `bytes` are stored in.
    pub stored: Dtype,
    /// Where they go (its dtype is the declared one).
    pub dst: DevTensor,
    /// Release the whole tensor's pages once uploaded (else only `start..start + len`).
    pub whole: bool,
}

/// Reader threads: `PETITE_CUDA_UPLOAD_THREADS` ([`crate::Settings::upload_threads`]), else up
/// to 4 (the disk measured above gained nothing past 4 readers; conversion is cheap next to
/// reading).
fn threads(set: Option<std::num::NonZeroUsize>) -> usize {
    set.map_or_else(
        || {
            std::thread::available_parallelism()
                .map_or(1, |t| t.get())
                .min(4)
        },
        |n| n.get(),
    )
}

/// A staging buffer and the event that says its last copy up has finished.
struct Staging {
    buf: PinnedHostSlice<u8>,
    done: CudaEvent,
}

/// Checks that `stored` bytes of `len` can become `declared`'s `numel` elements.
fn check(name: &str, len: usize, stored: Dtype, declared: Dtype, numel: usize) -> Result<()> {
    if stored != declared && !(stored.is_float() && declared.is_float()) {
        return Err(Error::Plan(format!(
            "weight {name:?}: stored as {} but declared {}; only float weights convert",
            stored.name(),
            declared.name()
        )));
    }
    if !len.is_multiple_of(stored.size()) || len / stored.size() != numel {
        return Err(Error::Plan(format!(
            "weight {name:?}: {len} stored {} bytes for {numel} elements",
            stored.name()
        )));
    }
    Ok(())
}

/// Uploads every job (in the declared dtypes), with `release` giving each weight's host pages
/// back once all of it is staged. Returns when every copy has finished.
pub(crate) fn upload(
    dev: &Device,
    jobs: &[Job<'_>],
    source: &dyn WeightSource,
    release: bool,
) -> Result<()> {
    let mut pieces = Vec::new();
    let mut left = vec![0usize; jobs.len()];
    for (i, j) in jobs.iter().enumerate() {
        check(
            j.name,
            j.bytes.len(),
            j.stored,
            j.dst.dtype(),
            j.dst.numel(),
        )?;
        let per = (PIECE / j.dst.dtype().size()).max(1);
        let n = j.dst.numel();
        let mut a = 0;
        while a < n {
            pieces.push((i, a, (a + per).min(n)));
            left[i] += 1;
            a += per;
        }
        if n == 0 && release {
            release_job(source, j)?;
        }
    }
    if pieces.is_empty() {
        return Ok(());
    }
    let pieces = &pieces[..];
    let threads = threads(dev.settings().upload_threads).min(pieces.len());
    let ctx = dev.context();
    let (free_tx, free_rx) = mpsc::channel::<Staging>();
    for _ in 0..2 * threads {
        // SAFETY: staging bytes are written by a reader before any copy reads them.
        let buf = unsafe { ctx.alloc_pinned_with_flags::<u8>(PIECE, 0) }
            .map_err(driver(format!("allocate {PIECE} page-locked bytes")))?;
        let done = ctx.new_event(None).map_err(driver("create an event"))?;
        // The receiver is alive (held below).
        let _ = free_tx.send(Staging { buf, done });
    }
    let free_rx = Mutex::new(free_rx);
    let (full_tx, full_rx) = mpsc::channel::<Result<(usize, Staging)>>();
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for _ in 0..threads {
            let full_tx = full_tx.clone();
            let (free_rx, next) = (&free_rx, &next);
            s.spawn(move || {
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(i, a, b)) = pieces.get(k) else {
                        break;
                    };
                    // Stops when the uploader has stopped (its sender is gone).
                    let Ok(mut st) = free_rx
                        .lock()
                        .map_err(drop)
                        .and_then(|r| r.recv().map_err(drop))
                    else {
                        break;
                    };
                    let j = &jobs[i];
                    let (es, ds) = (j.stored.size(), j.dst.dtype().size());
                    let src = &j.bytes[a * es..b * es];
                    let filled = st
                        .buf
                        .as_mut_slice()
                        .map_err(driver("stage weight bytes"))
                        .map(|out| {
                            convert_into(j.stored, j.dst.dtype(), src, &mut out[..(b - a) * ds])
                        });
                    if full_tx.send(filled.map(|()| (k, st))).is_err() {
                        break;
                    }
                }
            });
        }
        drop(full_tx);
        // One thread asks for the pieces' pages in order, at most AHEAD stored bytes past what
        // the readers have taken: the disk sees one sequential stream of large requests (several
        // readers each faulting their own piece measured slower than one reader).
        let (next, stop) = (&next, &stop);
        s.spawn(move || {
            let mut consumed_to = 0usize; // stored bytes of the pieces before `next`
            let mut counted = 0usize; // pieces counted into `consumed_to`
            let mut ahead = 0usize; // stored bytes asked for
            for &(i, a, b) in pieces {
                let j = &jobs[i];
                let es = j.stored.size();
                loop {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let taken = next.load(Ordering::Relaxed).min(pieces.len());
                    while counted < taken {
                        let (ci, ca, cb) = pieces[counted];
                        consumed_to += (cb - ca) * jobs[ci].stored.size();
                        counted += 1;
                    }
                    if ahead <= consumed_to + AHEAD {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_micros(500));
                }
                // Only a hint: a refusal leaves the pages to fault in one by one.
                let _ = source.prefetch_range(j.name, j.start + a * es, j.start + b * es);
                ahead += (b - a) * es;
            }
        });
        // Runs on this thread (the device's); dropping `free_tx` and `full_rx` on return stops
        // the readers.
        let mut uploader = move || -> Result<()> {
            let mut inflight: VecDeque<Staging> = VecDeque::new();
            for _ in 0..pieces.len() {
                let (k, st) = full_rx
                    .recv()
                    .map_err(|_| Error::Plan("an upload thread stopped".into()))??;
                let (i, a, b) = pieces[k];
                let j = &jobs[i];
                let ds = j.dst.dtype().size();
                let bytes = st.buf.as_slice().map_err(driver("staged weight bytes"))?;
                // SAFETY: the destination lies inside a live device buffer (`dst` was made by
                // this device; `a..b` are its elements); the staging buffer is not written again
                // until `done` has fired.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        dev.ptr(&j.dst) + (a * ds) as u64,
                        &bytes[..(b - a) * ds],
                        dev.stream().cu_stream(),
                    )
                }
                .map_err(driver(format!("copy weight {:?} to the device", j.name)))?;
                st.done
                    .record(dev.stream())
                    .map_err(driver("record an event"))?;
                inflight.push_back(st);
                left[i] -= 1;
                if left[i] == 0 && release {
                    release_job(source, j)?;
                }
                // Buffers whose copies are done go back to the readers; at most `threads`
                // wait on the stream.
                while inflight
                    .front()
                    .is_some_and(|f| inflight.len() > threads || f.done.is_complete())
                {
                    if let Some(f) = inflight.pop_front() {
                        f.done.synchronize().map_err(driver("wait for a copy"))?;
                        let _ = free_tx.send(f);
                    }
                }
            }
            dev.synchronize()
        };
        let r = uploader();
        stop.store(true, Ordering::Relaxed);
        r
    })
}

fn release_job(source: &dyn WeightSource, j: &Job<'_>) -> Result<()> {
    if j.whole {
        source.release(&[j.name])?;
    } else {
        source.release_range(j.name, j.start, j.start + j.bytes.len())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_conversion_rounds_like_the_reference() {
        let x = 1.0f32 + 1.0 / 256.0 + 1.0 / 1024.0; // between two bf16s, nearer the upper
        let mut b = [0u8; 2];
        convert_into(Dtype::F32, Dtype::Bf16, &x.to_le_bytes(), &mut b);
        let back = petite_dtype::bf16_bits_to_f32(u16::from_le_bytes(b));
        assert_eq!(back, petite_dtype::round_through_bf16(x));
        let mut same = [0u8; 4];
        convert_into(Dtype::F32, Dtype::F32, &[1, 2, 3, 4], &mut same);
        assert_eq!(same, [1, 2, 3, 4]);
        // converted piece by piece (as the readers do) = element by element
        let xs: Vec<u8> = (0..200_000)
            .flat_map(|i| (i as f32 * 0.37).to_le_bytes())
            .collect();
        let mut all = vec![0u8; 200_000 * 2];
        for (src, out) in xs.chunks(4 * 4099).zip(all.chunks_mut(2 * 4099)) {
            convert_into(Dtype::F32, Dtype::Bf16, src, out);
        }
        for (i, c) in all.chunks_exact(2).enumerate() {
            let want = petite_dtype::bf16_bits(i as f32 * 0.37);
            assert_eq!(u16::from_le_bytes([c[0], c[1]]), want, "{i}");
        }
    }

    #[test]
    fn only_float_weights_convert_and_lengths_must_match() {
        let e = check("w", 8, Dtype::I64, Dtype::F32, 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"w\"") && e.contains("only float weights convert"),
            "{e}"
        );
        assert!(check("w", 8, Dtype::F32, Dtype::Bf16, 2).is_ok());
        assert!(check("w", 8, Dtype::I64, Dtype::I64, 1).is_ok());
        let e = check("w", 6, Dtype::F32, Dtype::Bf16, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("6 stored f32 bytes for 2 elements"), "{e}");
    }
}
