//! `RowSlices`: row ranges of another source's tensors exposed as tensors of their own, so a
//! consumer that handles whole tensors (an engine writer, a constant-segment writer) stores just
//! the rows a graph node reads without knowing about ranges.

use std::collections::BTreeMap;

use crate::{Error, Result, TensorInfo, TensorView, WeightSource};

/// One exposed row range.
#[derive(Debug, Clone)]
struct Slice {
    /// The tensor in the inner source.
    name: String,
    /// Rows `[start, end)` of its axis 0.
    rows: [usize; 2],
    /// The slice's shape (`[end − start, rest…]`).
    shape: Vec<usize>,
    /// Bytes per row in the stored dtype.
    row_bytes: usize,
}

/// A [`WeightSource`] that passes every tensor of `inner` through and adds keys naming a
/// contiguous row range (axis 0) of one of them. Row-major storage makes a row range one
/// contiguous byte range, so views are sub-slices of the inner view (no copy) and releasing a
/// key releases only its rows' pages (rounded outward to pages by the inner source; pages a
/// neighbouring range still needs fault back in from the file).
#[derive(Debug)]
pub struct RowSlices<'a, S: WeightSource + ?Sized> {
    inner: &'a S,
    slices: BTreeMap<String, Slice>,
}

impl<'a, S: WeightSource + ?Sized> RowSlices<'a, S> {
    /// Wraps `inner` with no extra keys.
    pub fn new(inner: &'a S) -> Self {
        RowSlices {
            inner,
            slices: BTreeMap::new(),
        }
    }

    /// Exposes rows `rows[0]..rows[1]` of `name` as `key` (reads only the inner header). The
    /// range must be non-empty and within the tensor; `key` must not name an inner tensor or
    /// another range of different rows.
    pub fn add(&mut self, key: &str, name: &str, rows: [usize; 2]) -> Result<()> {
        let info = self.inner.info(name)?;
        let bad = |reason: String| {
            Error::Selection(format!(
                "rows {rows:?} of tensor `{name}` as `{key}`: {reason}"
            ))
        };
        let [start, end] = rows;
        let Some(&n) = info.shape.first() else {
            return Err(bad("the tensor is a scalar".into()));
        };
        if start >= end || end > n {
            return Err(bad(format!(
                "expected a non-empty range within its {n} rows"
            )));
        }
        if key != name && self.inner.info(key).is_ok() {
            return Err(bad("the key names a tensor of the source".into()));
        }
        let row_bytes = info.shape[1..].iter().product::<usize>() * info.dtype.size();
        let mut shape = info.shape.clone();
        shape[0] = end - start;
        let slice = Slice {
            name: name.to_string(),
            rows,
            shape,
            row_bytes,
        };
        if let Some(old) = self.slices.get(key)
            && (old.name != slice.name || old.rows != slice.rows)
        {
            return Err(bad(format!(
                "the key already names rows {:?} of `{}`",
                old.rows, old.name
            )));
        }
        self.slices.insert(key.to_string(), slice);
        Ok(())
    }

    /// The inner source.
    pub fn inner(&self) -> &'a S {
        self.inner
    }
}

impl<S: WeightSource + ?Sized> WeightSource for RowSlices<'_, S> {
    fn names(&self) -> Vec<String> {
        let mut n = self.inner.names();
        n.extend(self.slices.keys().cloned());
        n.sort();
        n.dedup();
        n
    }

    fn info(&self, name: &str) -> Result<TensorInfo> {
        match self.slices.get(name) {
            None => self.inner.info(name),
            Some(s) => Ok(TensorInfo {
                dtype: self.inner.info(&s.name)?.dtype,
                shape: s.shape.clone(),
            }),
        }
    }

    fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let Some(s) = self.slices.get(name) else {
            return self.inner.tensor(name);
        };
        let v = self.inner.tensor(&s.name)?;
        let [a, b] = s.rows;
        let bytes = v
            .bytes
            .get(a * s.row_bytes..b * s.row_bytes)
            .ok_or_else(|| {
                Error::Selection(format!(
                    "tensor `{}`: rows [{a}, {b}) lie outside its {} bytes",
                    s.name,
                    v.bytes.len()
                ))
            })?;
        Ok(TensorView {
            name: v.name,
            dtype: v.dtype,
            shape: &s.shape,
            bytes,
        })
    }

    fn release(&self, names: &[&str]) -> Result<()> {
        for &n in names {
            match self.slices.get(n) {
                None => self.inner.release(&[n])?,
                Some(s) => self.inner.release_range(
                    &s.name,
                    s.rows[0] * s.row_bytes,
                    s.rows[1] * s.row_bytes,
                )?,
            }
        }
        Ok(())
    }

    fn release_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        match self.slices.get(name) {
            None => self.inner.release_range(name, start, end),
            Some(s) => {
                let base = s.rows[0] * s.row_bytes;
                let len = (s.rows[1] - s.rows[0]) * s.row_bytes;
                self.inner
                    .release_range(&s.name, base + start.min(len), base + end.min(len))
            }
        }
    }

    fn unmap_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        match self.slices.get(name) {
            None => self.inner.unmap_range(name, start, end),
            Some(s) => {
                let base = s.rows[0] * s.row_bytes;
                let len = (s.rows[1] - s.rows[0]) * s.row_bytes;
                self.inner
                    .unmap_range(&s.name, base + start.min(len), base + end.min(len))
            }
        }
    }

    fn files(&self) -> Vec<std::path::PathBuf> {
        self.inner.files()
    }

    fn check_unchanged(&self) -> Result<()> {
        self.inner.check_unchanged()
    }

    fn prefetch_range(&self, name: &str, start: usize, end: usize) -> Result<()> {
        match self.slices.get(name) {
            None => self.inner.prefetch_range(name, start, end),
            Some(s) => {
                let base = s.rows[0] * s.row_bytes;
                let len = (s.rows[1] - s.rows[0]) * s.row_bytes;
                self.inner
                    .prefetch_range(&s.name, base + start.min(len), base + end.min(len))
            }
        }
    }
}
