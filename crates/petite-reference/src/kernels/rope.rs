//! Rotary position embedding, transformers' default rope with `rotate_half` (non-interleaved
//! halves): `x·cos + rotate_half(x)·sin`, `rotate_half([a, b]) = [−b, a]`.

use super::elementwise::{broadcast_shape, broadcast_strides};
use super::numel;
use crate::{Result, kerr};

/// `inv_freq[i] = 1 / theta^((2i as f32) / dim)` for `i < dim/2`, each step in f32 as
/// transformers computes it (`base ** (arange(0, dim, 2).float() / dim)`, then `1.0 / …`).
pub fn rope_inv_freq(dim: usize, theta: f32) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / dim as f32))
        .collect()
}

/// `cos, sin` tables `[positions.len(), 2·inv_freq.len()]`: `freqs = pos·inv_freq` (f32),
/// `emb = cat(freqs, freqs)`.
pub fn rope_cos_sin(positions: &[f32], inv_freq: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let d = 2 * half;
    let mut cos = vec![0.0f32; positions.len() * d];
    let mut sin = vec![0.0f32; positions.len() * d];
    for (p, &pos) in positions.iter().enumerate() {
        for (i, &f) in inv_freq.iter().enumerate() {
            let a = pos * f;
            let (s, c) = (a.sin(), a.cos());
            cos[p * d + i] = c;
            cos[p * d + half + i] = c;
            sin[p * d + i] = s;
            sin[p * d + half + i] = s;
        }
    }
    (cos, sin)
}

/// Applies the rotation in place to `x` (`[..., d]`, `d` even) with `cos`/`sin` tables whose
/// shapes broadcast to x's (e.g. `[b, 1, s, d]` for x `[b, h, s, d]`):
/// `out = (x·cos) + (rotate_half(x)·sin)`, each product rounded in f32 before the sum.
pub fn rotary_halves(
    x: &mut [f32],
    x_shape: &[usize],
    cos: (&[f32], &[usize]),
    sin: (&[f32], &[usize]),
) -> Result<()> {
    let Some(&d) = x_shape.last() else {
        return Err(kerr("rotary", "x is a scalar"));
    };
    if !d.is_multiple_of(2) {
        return Err(kerr("rotary", format!("last dim {d} is odd")));
    }
    if x.len() != numel(x_shape) {
        return Err(kerr(
            "rotary",
            format!("x has {} elements but shape {x_shape:?}", x.len()),
        ));
    }
    for (name, (t, s)) in [("cos", cos), ("sin", sin)] {
        if t.len() != numel(s) {
            return Err(kerr(
                "rotary",
                format!("{name} has {} elements but shape {s:?}", t.len()),
            ));
        }
    }
    let sc = broadcast_strides(cos.1, x_shape)?;
    let ss = broadcast_strides(sin.1, x_shape)?;
    if broadcast_shape(cos.1, x_shape)? != x_shape || broadcast_shape(sin.1, x_shape)? != x_shape {
        return Err(kerr(
            "rotary",
            format!(
                "cos {:?} / sin {:?} do not broadcast to x {x_shape:?}",
                cos.1, sin.1
            ),
        ));
    }
    let nd = x_shape.len();
    let (lc, ls) = (sc[nd - 1], ss[nd - 1]);
    let outer = &x_shape[..nd - 1];
    let half = d / 2;
    for (r, row) in x.chunks_mut(d.max(1)).enumerate() {
        let (mut oc, mut os, mut rem) = (0usize, 0usize, r);
        for k in (0..outer.len()).rev() {
            let i = rem % outer[k];
            rem /= outer[k];
            oc += i * sc[k];
            os += i * ss[k];
        }
        let c = |j: usize| cos.0[oc + j * lc];
        let s = |j: usize| sin.0[os + j * ls];
        for i in 0..half {
            let (x1, x2) = (row[i], row[i + half]);
            row[i] = x1 * c(i) + (-x2) * s(i);
            row[i + half] = x2 * c(i + half) + x1 * s(i + half);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inv_freq_and_tables() {
        let f = rope_inv_freq(4, 10000.0);
        assert_eq!(f[0], 1.0);
        assert!((f[1] - 0.01).abs() < 1e-9); // 10000^(-2/4)
        let (c, s) = rope_cos_sin(&[0.0, 2.0], &f);
        assert_eq!(&c[..4], &[1.0; 4]);
        assert_eq!(&s[..4], &[0.0; 4]);
        assert_eq!(c[4], 2.0f32.cos());
        assert_eq!(c[6], 2.0f32.cos());
        assert_eq!(s[5], 0.02f32.sin());
        assert_eq!(s[7], s[5]);
    }

    #[test]
    fn rotates_halves_not_pairs() {
        // d = 4, one position with angle π/2 for freq 0 and 0 for freq 1:
        // cos = [0, 1, 0, 1], sin = [1, 0, 1, 0]; x = [1, 2, 3, 4] (halves [1,2] and [3,4])
        // out[0] = x0·0 − x2·1 = −3; out[1] = x1·1 − x3·0 = 2; out[2] = x2·0 + x0·1 = 1; out[3] = 4
        let mut x = vec![1.0f32, 2., 3., 4.];
        let (c, s) = ([0., 1., 0., 1.], [1., 0., 1., 0.]);
        rotary_halves(&mut x, &[1, 1, 1, 4], (&c, &[1, 1, 4]), (&s, &[4])).unwrap();
        assert_eq!(x, vec![-3.0, 2.0, 1.0, 4.0]);
        // batch 2 with one table for both
        let mut y = vec![1.0f32, 2., 3., 4., 1., 2., 3., 4.];
        rotary_halves(&mut y, &[2, 1, 1, 4], (&c, &[1, 1, 1, 4]), (&s, &[1, 4])).unwrap();
        assert_eq!(&y[4..], &[-3.0, 2.0, 1.0, 4.0]);
        assert!(rotary_halves(&mut y, &[2, 1, 4], (&c, &[2, 4]), (&s, &[4])).is_err());
        let mut z = vec![0.0f32; 3];
        assert!(rotary_halves(&mut z, &[3], (&[0.0; 3], &[3]), (&[0.0; 3], &[3])).is_err());
    }
}
