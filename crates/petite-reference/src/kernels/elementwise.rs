//! Elementwise maps with numpy broadcasting (shapes aligned on the right; a dim of 1 stretches).

use super::{PAR_MIN, numel};
use crate::{Result, kerr};
use rayon::prelude::*;

/// The broadcast of two shapes, or an error naming both.
pub fn broadcast_shape(a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(kerr(
                    "broadcast",
                    format!("shapes {a:?} and {b:?} do not broadcast (dim {i}: {da} vs {db})"),
                ));
            }
        };
    }
    Ok(out)
}

/// Element strides of `shape` read as `out` (right-aligned; 0 on broadcast dims).
pub fn broadcast_strides(shape: &[usize], out: &[usize]) -> Result<Vec<usize>> {
    if shape.len() > out.len() {
        return Err(kerr(
            "broadcast",
            format!("{shape:?} has more dims than {out:?}"),
        ));
    }
    let mut strides = vec![0; out.len()];
    let mut s = 1;
    let off = out.len() - shape.len();
    for i in (0..shape.len()).rev() {
        if shape[i] == out[i + off] {
            strides[i + off] = if shape[i] == 1 { 0 } else { s };
        } else if shape[i] != 1 {
            return Err(kerr(
                "broadcast",
                format!("{shape:?} does not broadcast to {out:?}"),
            ));
        }
        s *= shape[i];
    }
    Ok(strides)
}

/// Runs `f(row_offsets, out_row)` over rows of the last dim of `out_shape`, with each operand's
/// starting offset for that row; rows are split across threads for large outputs.
fn for_rows<O: Send>(
    out: &mut [O],
    out_shape: &[usize],
    strides: &[Vec<usize>],
    f: impl Fn(&[usize], &mut [O]) + Sync,
) {
    let last = out_shape.last().copied().unwrap_or(1).max(1);
    let outer = &out_shape[..out_shape.len().saturating_sub(1)];
    let row = |r: usize, dst: &mut [O]| {
        let mut offs = [0usize; 3];
        let mut rem = r;
        for d in (0..outer.len()).rev() {
            let i = rem % outer[d];
            rem /= outer[d];
            for (o, s) in offs.iter_mut().zip(strides) {
                *o += i * s[d];
            }
        }
        f(&offs[..strides.len()], dst);
    };
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(last)
            .enumerate()
            .for_each(|(r, d)| row(r, d));
    } else {
        out.chunks_mut(last)
            .enumerate()
            .for_each(|(r, d)| row(r, d));
    }
}

fn check_len(what: &str, len: usize, shape: &[usize]) -> Result<()> {
    if len != numel(shape) {
        return Err(kerr(
            "elementwise",
            format!("{what} has {len} elements but shape {shape:?}"),
        ));
    }
    Ok(())
}

/// `out[i] = f(a[i'], b[i''])` under broadcasting; returns the data and the output shape.
pub fn map_binary<A: Copy + Sync, B: Copy + Sync, O: Copy + Send + Default>(
    a: &[A],
    a_shape: &[usize],
    b: &[B],
    b_shape: &[usize],
    f: impl Fn(A, B) -> O + Sync,
) -> Result<(Vec<O>, Vec<usize>)> {
    check_len("lhs", a.len(), a_shape)?;
    check_len("rhs", b.len(), b_shape)?;
    let shape = broadcast_shape(a_shape, b_shape)?;
    let mut out = vec![O::default(); numel(&shape)];
    if a_shape == b_shape {
        let body = |(o, (&x, &y)): (&mut O, (&A, &B))| *o = f(x, y);
        if out.len() >= PAR_MIN {
            out.par_iter_mut()
                .zip(a.par_iter().zip(b.par_iter()))
                .for_each(body);
        } else {
            out.iter_mut().zip(a.iter().zip(b.iter())).for_each(body);
        }
        return Ok((out, shape));
    }
    let sa = broadcast_strides(a_shape, &shape)?;
    let sb = broadcast_strides(b_shape, &shape)?;
    let (la, lb) = (
        sa.last().copied().unwrap_or(0),
        sb.last().copied().unwrap_or(0),
    );
    for_rows(&mut out, &shape, &[sa, sb], |offs, dst| {
        for (j, o) in dst.iter_mut().enumerate() {
            *o = f(a[offs[0] + j * la], b[offs[1] + j * lb]);
        }
    });
    Ok((out, shape))
}

/// `out[i] = f(c[i'], a[i''], b[i'''])` under broadcasting (for `where`).
pub fn map_ternary<C: Copy + Sync, A: Copy + Sync, B: Copy + Sync, O: Copy + Send + Default>(
    c: (&[C], &[usize]),
    a: (&[A], &[usize]),
    b: (&[B], &[usize]),
    f: impl Fn(C, A, B) -> O + Sync,
) -> Result<(Vec<O>, Vec<usize>)> {
    check_len("condition", c.0.len(), c.1)?;
    check_len("lhs", a.0.len(), a.1)?;
    check_len("rhs", b.0.len(), b.1)?;
    let shape = broadcast_shape(&broadcast_shape(c.1, a.1)?, b.1)?;
    let sc = broadcast_strides(c.1, &shape)?;
    let sa = broadcast_strides(a.1, &shape)?;
    let sb = broadcast_strides(b.1, &shape)?;
    let l = |s: &Vec<usize>| s.last().copied().unwrap_or(0);
    let (lc, la, lb) = (l(&sc), l(&sa), l(&sb));
    let mut out = vec![O::default(); numel(&shape)];
    for_rows(&mut out, &shape, &[sc, sa, sb], |offs, dst| {
        for (j, o) in dst.iter_mut().enumerate() {
            *o = f(
                c.0[offs[0] + j * lc],
                a.0[offs[1] + j * la],
                b.0[offs[2] + j * lb],
            );
        }
    });
    Ok((out, shape))
}

/// `x` (of `shape`) broadcast to `out_shape` (numpy `broadcast_to`, materialised).
pub fn broadcast_to<T: Copy + Sync + Send + Default>(
    x: &[T],
    shape: &[usize],
    out_shape: &[usize],
) -> Result<Vec<T>> {
    check_len("input", x.len(), shape)?;
    if broadcast_shape(shape, out_shape)? != out_shape {
        return Err(kerr(
            "broadcast",
            format!("{shape:?} does not broadcast to {out_shape:?}"),
        ));
    }
    let s = broadcast_strides(shape, out_shape)?;
    let l = s.last().copied().unwrap_or(0);
    let mut out = vec![T::default(); numel(out_shape)];
    for_rows(&mut out, out_shape, &[s], |offs, dst| {
        for (j, o) in dst.iter_mut().enumerate() {
            *o = x[offs[0] + j * l];
        }
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_shapes() {
        assert_eq!(broadcast_shape(&[2, 1, 3], &[4, 1]).unwrap(), vec![2, 4, 3]);
        assert_eq!(broadcast_shape(&[], &[5]).unwrap(), vec![5]);
        assert!(broadcast_shape(&[2, 3], &[3, 2]).is_err());
        assert_eq!(
            broadcast_strides(&[4, 1], &[2, 4, 3]).unwrap(),
            vec![0, 1, 0]
        );
    }

    #[test]
    fn binary_broadcast_hand() {
        // [[1],[2]] + [10, 20, 30] = [[11,21,31],[12,22,32]]
        let (o, s) = map_binary(
            &[1.0f32, 2.0],
            &[2, 1],
            &[10.0f32, 20.0, 30.0],
            &[3],
            |a, b| a + b,
        )
        .unwrap();
        assert_eq!(s, vec![2, 3]);
        assert_eq!(o, vec![11., 21., 31., 12., 22., 32.]);
        // scalar rhs, comparison to bool
        let (o, _) = map_binary(&[1i64, 5, 3], &[3], &[3i64], &[], |a, b| a <= b).unwrap();
        assert_eq!(o, vec![true, false, true]);
        assert!(map_binary(&[1.0f32; 3], &[3], &[1.0f32; 2], &[2], |a, b| a + b).is_err());
        assert!(map_binary(&[1.0f32; 3], &[4], &[1.0f32], &[1], |a, b| a + b).is_err());
    }

    #[test]
    fn large_broadcast_matches_small_path() {
        let a: Vec<f32> = (0..PAR_MIN * 2).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..64).map(|i| -(i as f32)).collect();
        let (o, s) = map_binary(&a, &[PAR_MIN * 2 / 64, 64], &b, &[64], |x, y| x * y).unwrap();
        assert_eq!(s, vec![PAR_MIN * 2 / 64, 64]);
        for (i, v) in o.iter().enumerate() {
            assert_eq!(*v, a[i] * b[i % 64]);
        }
    }

    #[test]
    fn broadcast_to_hand() {
        let o = broadcast_to(&[1, 2], &[2, 1], &[2, 3]).unwrap();
        assert_eq!(o, vec![1, 1, 1, 2, 2, 2]);
        assert!(broadcast_to(&[1, 2], &[2], &[3]).is_err());
        assert!(broadcast_to(&[1, 2, 3], &[3], &[1]).is_err());
    }

    #[test]
    fn ternary_where_hand() {
        let (o, s) = map_ternary(
            (&[true, false][..], &[2, 1][..]),
            (&[1.0f32, 2.0][..], &[2][..]),
            (&[-1.0f32][..], &[][..]),
            |c, a, b| if c { a } else { b },
        )
        .unwrap();
        assert_eq!(s, vec![2, 2]);
        assert_eq!(o, vec![1.0, 2.0, -1.0, -1.0]);
    }
}
