//! Data-movement kernels (gather, concat, slice, permute) and axis scans/reductions.
//! Generic over the element type so integer, bool and bf16 tensors move without conversion.

use super::numel;
use crate::{Result, kerr};

fn split_axis(shape: &[usize], axis: usize, kernel: &'static str) -> Result<(usize, usize, usize)> {
    if axis >= shape.len() {
        return Err(kerr(
            kernel,
            format!("axis {axis} out of range for shape {shape:?}"),
        ));
    }
    Ok((
        shape[..axis].iter().product(),
        shape[axis],
        shape[axis + 1..].iter().product(),
    ))
}

fn check_len(kernel: &'static str, len: usize, shape: &[usize]) -> Result<()> {
    if len != numel(shape) {
        return Err(kerr(
            kernel,
            format!("input has {len} elements but shape {shape:?}"),
        ));
    }
    Ok(())
}

/// Embedding lookup: rows `idx` of `table[rows, d]` → `[idx.len(), d]`. Only the rows asked
/// for are read (a 257k-row vocabulary is never converted whole).
pub fn gather_rows<T: Copy>(table: &[T], rows: usize, d: usize, idx: &[i64]) -> Result<Vec<T>> {
    if table.len() != rows * d {
        return Err(kerr(
            "gather",
            format!("table has {} elements, expected [{rows}, {d}]", table.len()),
        ));
    }
    let mut out = Vec::with_capacity(idx.len() * d);
    for (pos, &i) in idx.iter().enumerate() {
        if i < 0 || i as u64 >= rows as u64 {
            return Err(kerr(
                "gather",
                format!("index {i} at position {pos} is outside [0, {rows})"),
            ));
        }
        let r = i as usize;
        out.extend_from_slice(&table[r * d..(r + 1) * d]);
    }
    Ok(out)
}

/// Inclusive cumulative sum along `axis` in i64 (wrapping, as the IR's integer arithmetic).
pub fn cumsum_i64(x: &[i64], shape: &[usize], axis: usize) -> Result<Vec<i64>> {
    check_len("cumsum", x.len(), shape)?;
    let (outer, n, inner) = split_axis(shape, axis, "cumsum")?;
    let mut out = x.to_vec();
    for o in 0..outer {
        for i in 0..inner {
            let mut acc = 0i64;
            for a in 0..n {
                let k = (o * n + a) * inner + i;
                acc = acc.wrapping_add(x[k]);
                out[k] = acc;
            }
        }
    }
    Ok(out)
}

/// Inclusive cumulative sum along `axis` in f32, accumulated in f64 (PyTorch's CPU accumulate
/// type for float) and rounded per output.
pub fn cumsum_f32(x: &[f32], shape: &[usize], axis: usize) -> Result<Vec<f32>> {
    check_len("cumsum", x.len(), shape)?;
    let (outer, n, inner) = split_axis(shape, axis, "cumsum")?;
    let mut out = x.to_vec();
    for o in 0..outer {
        for i in 0..inner {
            let mut acc = 0f64;
            for a in 0..n {
                let k = (o * n + a) * inner + i;
                acc += x[k] as f64;
                out[k] = acc as f32;
            }
        }
    }
    Ok(out)
}

/// Concatenates tensors along `axis`; all other dims must agree.
pub fn concat<T: Copy>(parts: &[(&[T], &[usize])], axis: usize) -> Result<(Vec<T>, Vec<usize>)> {
    let Some(&(_, first)) = parts.first() else {
        return Err(kerr("concat", "no inputs"));
    };
    let mut shape = first.to_vec();
    split_axis(&shape, axis, "concat")?;
    shape[axis] = 0;
    for (i, &(data, s)) in parts.iter().enumerate() {
        check_len("concat", data.len(), s)?;
        let same = s.len() == first.len()
            && s.iter()
                .zip(first)
                .enumerate()
                .all(|(d, (a, b))| d == axis || a == b);
        if !same {
            return Err(kerr(
                "concat",
                format!("input {i} has shape {s:?}, incompatible with {first:?} along axis {axis}"),
            ));
        }
        shape[axis] += s[axis];
    }
    let outer: usize = shape[..axis].iter().product();
    let inner: usize = shape[axis + 1..].iter().product();
    let mut out = Vec::with_capacity(numel(&shape));
    for o in 0..outer {
        for &(data, s) in parts {
            let chunk = s[axis] * inner;
            out.extend_from_slice(&data[o * chunk..(o + 1) * chunk]);
        }
    }
    Ok((out, shape))
}

/// `x[..., start:end:step, ...]` along `axis` (`start <= end <= dim`, `step >= 1`).
pub fn slice_axis<T: Copy>(
    x: &[T],
    shape: &[usize],
    axis: usize,
    start: usize,
    end: usize,
    step: usize,
) -> Result<(Vec<T>, Vec<usize>)> {
    check_len("slice", x.len(), shape)?;
    let (outer, n, inner) = split_axis(shape, axis, "slice")?;
    if step == 0 || start > end || end > n {
        return Err(kerr(
            "slice",
            format!("range {start}..{end} step {step} invalid for axis {axis} of size {n}"),
        ));
    }
    let len = (end - start).div_ceil(step);
    let mut out = Vec::with_capacity(outer * len * inner);
    for o in 0..outer {
        for a in (start..end).step_by(step) {
            let k = (o * n + a) * inner;
            out.extend_from_slice(&x[k..k + inner]);
        }
    }
    let mut s = shape.to_vec();
    s[axis] = len;
    Ok((out, s))
}

/// Permutes dims: output dim `i` is input dim `perm[i]`.
pub fn permute<T: Copy>(x: &[T], shape: &[usize], perm: &[usize]) -> Result<(Vec<T>, Vec<usize>)> {
    check_len("permute", x.len(), shape)?;
    let nd = shape.len();
    let mut seen = vec![false; nd];
    if perm.len() != nd
        || perm
            .iter()
            .any(|&p| p >= nd || std::mem::replace(&mut seen[p], true))
    {
        return Err(kerr(
            "permute",
            format!("{perm:?} is not a permutation of {nd} dims"),
        ));
    }
    let mut in_strides = vec![1usize; nd];
    for d in (0..nd.saturating_sub(1)).rev() {
        in_strides[d] = in_strides[d + 1] * shape[d + 1];
    }
    let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
    let strides: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
    let total = x.len();
    let mut out = Vec::with_capacity(total);
    if total == 0 {
        return Ok((out, out_shape));
    }
    // odometer over the output; the innermost dim is a strided copy
    let last = nd.saturating_sub(1);
    let (ln, ls) = if nd == 0 {
        (1, 0)
    } else {
        (out_shape[last], strides[last])
    };
    if nd >= 2 && strides[last - 1] == 1 && ls != 1 {
        return Ok((transpose_last_two(x, &out_shape, &strides), out_shape));
    }
    let mut idx = vec![0usize; nd];
    let mut base = 0usize;
    loop {
        if ls == 1 {
            out.extend_from_slice(&x[base..base + ln]);
        } else {
            for j in 0..ln {
                out.push(x[base + j * ls]);
            }
        }
        // advance dims above the last
        if !odometer_step(&mut idx[..last], &mut base, &out_shape[..last], &strides) {
            return Ok((out, out_shape));
        }
    }
}

/// Advances `idx` over `dims` (the last fastest) and `base` by the matching `strides`; false
/// once every index has wrapped back to zero (the walk is over).
fn odometer_step(idx: &mut [usize], base: &mut usize, dims: &[usize], strides: &[usize]) -> bool {
    for d in (0..dims.len()).rev() {
        idx[d] += 1;
        *base += strides[d];
        if idx[d] < dims[d] {
            return true;
        }
        *base -= strides[d] * idx[d];
        idx[d] = 0;
    }
    false
}

/// [`permute`] where the output's last two dims are a transpose: the second-to-last is the
/// input's contiguous one (`strides[nd - 2] == 1`), the last is strided. Copied in 32 × 32 tiles
/// that stay in L1, instead of a strided read for every element (a bf16 step's `kᵀ`, 8 heads of
/// 1,018 × 256, took 2.7 ms a layer element by element).
fn transpose_last_two<T: Copy>(x: &[T], out_shape: &[usize], strides: &[usize]) -> Vec<T> {
    const TILE: usize = 32;
    let nd = out_shape.len();
    let (rows, cols, cs) = (out_shape[nd - 2], out_shape[nd - 1], strides[nd - 1]);
    let outer = &out_shape[..nd - 2];
    let mut out = vec![x[0]; x.len()];
    let mut idx = vec![0usize; outer.len()];
    let mut base = 0usize;
    for dst in out.chunks_mut(rows * cols) {
        for r0 in (0..rows).step_by(TILE) {
            for c0 in (0..cols).step_by(TILE) {
                for c in c0..(c0 + TILE).min(cols) {
                    let src = &x[base + c * cs..];
                    for r in r0..(r0 + TILE).min(rows) {
                        dst[r * cols + c] = src[r];
                    }
                }
            }
        }
        odometer_step(&mut idx, &mut base, outer, strides);
    }
    out
}

/// A reduction over one axis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduce {
    /// Σ (accumulated in f64, in index order).
    Sum,
    /// Σ / n.
    Mean,
    /// Maximum (NaN propagates).
    Max,
    /// Minimum (NaN propagates).
    Min,
}

/// Reduces `axis` away (the caller decides whether to keep it as a 1).
pub fn reduce_f32(x: &[f32], shape: &[usize], axis: usize, op: Reduce) -> Result<Vec<f32>> {
    check_len("reduce", x.len(), shape)?;
    let (outer, n, inner) = split_axis(shape, axis, "reduce")?;
    if n == 0 && matches!(op, Reduce::Max | Reduce::Min) {
        return Err(kerr("reduce", "max/min over an empty axis"));
    }
    let mut out = vec![0.0f32; outer * inner];
    for o in 0..outer {
        for i in 0..inner {
            let it = (0..n).map(|a| x[(o * n + a) * inner + i]);
            out[o * inner + i] = match op {
                Reduce::Sum => it.map(f64::from).sum::<f64>() as f32,
                Reduce::Mean => (it.map(f64::from).sum::<f64>() / n as f64) as f32,
                Reduce::Max => it.fold(f32::NEG_INFINITY, |m, v| {
                    if v.is_nan() || m.is_nan() {
                        f32::NAN
                    } else {
                        m.max(v)
                    }
                }),
                Reduce::Min => it.fold(f32::INFINITY, |m, v| {
                    if v.is_nan() || m.is_nan() {
                        f32::NAN
                    } else {
                        m.min(v)
                    }
                }),
            };
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_hand() {
        let t = [0., 1., 10., 11., 20., 21.];
        assert_eq!(
            gather_rows(&t, 3, 2, &[2, 0, 2]).unwrap(),
            vec![20., 21., 0., 1., 20., 21.]
        );
        assert!(gather_rows(&t, 3, 2, &[3]).is_err());
        assert!(gather_rows(&t, 3, 2, &[-1]).is_err());
    }

    #[test]
    fn cumsum_hand() {
        // positions = cumsum(pad) - 1 for pad [1,1,0,1] → cumsum [1,2,2,3]
        assert_eq!(
            cumsum_i64(&[1, 1, 0, 1], &[4], 0).unwrap(),
            vec![1, 2, 2, 3]
        );
        // along axis 0 of [[1,2],[3,4]]
        assert_eq!(
            cumsum_i64(&[1, 2, 3, 4], &[2, 2], 0).unwrap(),
            vec![1, 2, 4, 6]
        );
        assert_eq!(
            cumsum_f32(&[0.5, 0.25, 1.0], &[1, 3], 1).unwrap(),
            vec![0.5, 0.75, 1.75]
        );
        assert_eq!(
            cumsum_i64(&[i64::MAX, 1], &[2], 0).unwrap(),
            vec![i64::MAX, i64::MIN]
        );
        assert!(cumsum_i64(&[1], &[1], 1).is_err());
    }

    #[test]
    fn concat_slice_hand() {
        let (o, s) = concat(
            &[(&[1, 2, 3, 4][..], &[2, 2][..]), (&[5, 6][..], &[2, 1][..])],
            1,
        )
        .unwrap();
        assert_eq!(s, vec![2, 3]);
        assert_eq!(o, vec![1, 2, 5, 3, 4, 6]);
        assert!(concat(&[(&[1, 2][..], &[2][..]), (&[5, 6][..], &[1, 2][..])], 0).is_err());
        let (o, s) = slice_axis(&o, &s, 1, 1, 3, 1).unwrap();
        assert_eq!((o, s), (vec![2, 5, 4, 6], vec![2, 2]));
        let (o, s) = slice_axis(&[0, 1, 2, 3, 4], &[5], 0, 0, 5, 2).unwrap();
        assert_eq!((o, s), (vec![0, 2, 4], vec![3]));
        assert!(slice_axis(&[0, 1], &[2], 0, 1, 3, 1).is_err());
    }

    #[test]
    fn permute_hand() {
        // [2,3] transpose
        let (o, s) = permute(&[1, 2, 3, 4, 5, 6], &[2, 3], &[1, 0]).unwrap();
        assert_eq!((o, s), (vec![1, 4, 2, 5, 3, 6], vec![3, 2]));
        // [1,2,2,2] → swap dims 1 and 2 ([B,S,H,D] → [B,H,S,D])
        let x: Vec<i32> = (0..8).collect();
        let (o, s) = permute(&x, &[1, 2, 2, 2], &[0, 2, 1, 3]).unwrap();
        assert_eq!((o, s), (vec![0, 1, 4, 5, 2, 3, 6, 7], vec![1, 2, 2, 2]));
        assert!(permute(&x, &[1, 2, 2, 2], &[0, 1, 1, 3]).is_err());
        let (o, _) = permute(&[7], &[], &[]).unwrap();
        assert_eq!(o, vec![7]);
    }

    /// Transposes of the last two output dims past one 32 × 32 tile (ragged edges, outer dims
    /// in any order) equal the element-by-element gather.
    #[test]
    fn tiled_transposes_equal_the_gather() {
        let shape = [2usize, 3, 70, 45];
        let x: Vec<u32> = (0..shape.iter().product::<usize>() as u32).collect();
        let st = [3 * 70 * 45, 70 * 45, 45, 1];
        for perm in [[0usize, 1, 3, 2], [1, 0, 3, 2], [2, 0, 3, 1], [1, 2, 3, 0]] {
            let (y, ys) = permute(&x, &shape, &perm).unwrap();
            assert_eq!(ys, perm.map(|p| shape[p]).to_vec());
            let mut i = 0;
            for a in 0..ys[0] {
                for b in 0..ys[1] {
                    for c in 0..ys[2] {
                        for d in 0..ys[3] {
                            let src = a * st[perm[0]]
                                + b * st[perm[1]]
                                + c * st[perm[2]]
                                + d * st[perm[3]];
                            assert_eq!(y[i], x[src], "{perm:?} at {i}");
                            i += 1;
                        }
                    }
                }
            }
            assert_eq!(i, x.len());
        }
    }

    #[test]
    fn reduce_hand() {
        let x = [1.0f32, 2., 3., 4., 5., 6.];
        assert_eq!(
            reduce_f32(&x, &[2, 3], 1, Reduce::Sum).unwrap(),
            vec![6., 15.]
        );
        assert_eq!(
            reduce_f32(&x, &[2, 3], 0, Reduce::Mean).unwrap(),
            vec![2.5, 3.5, 4.5]
        );
        assert_eq!(
            reduce_f32(&x, &[2, 3], 1, Reduce::Max).unwrap(),
            vec![3., 6.]
        );
        assert_eq!(
            reduce_f32(&x, &[2, 3], 0, Reduce::Min).unwrap(),
            vec![1., 2., 3.]
        );
        assert!(reduce_f32(&[1.0, f32::NAN], &[2], 0, Reduce::Max).unwrap()[0].is_nan());
    }
}
