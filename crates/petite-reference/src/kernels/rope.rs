//! Rotary position embedding, transformers' default rope with `rotate_half` (non-interleaved
//! halves): `x·cos + rotate_half(x)·sin`, `rotate_half([a, b]) = [−b, a]`.

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

/// Applies the rotation in place to `x` laid out `[b, h, s, d]` with tables `[bt, s, d]`,
/// `bt ∈ {1, b}` (one table shared by all heads, as transformers unsqueezes it).
/// `out = (x·cos) + (rotate_half(x)·sin)`, each product rounded in f32 before the sum.
#[allow(clippy::too_many_arguments)]
pub fn rotary_halves(
    x: &mut [f32],
    b: usize,
    h: usize,
    s: usize,
    d: usize,
    cos: &[f32],
    sin: &[f32],
) -> Result<()> {
    if !d.is_multiple_of(2) {
        return Err(kerr("rotary", format!("head dim {d} is odd")));
    }
    if x.len() != b * h * s * d {
        return Err(kerr(
            "rotary",
            format!(
                "input has {} elements, expected [{b}, {h}, {s}, {d}]",
                x.len()
            ),
        ));
    }
    let table = s * d;
    let bt = if cos.len() == table && b != 1 { 1 } else { b };
    if cos.len() != bt * table || sin.len() != cos.len() {
        return Err(kerr(
            "rotary",
            format!(
                "cos/sin have {}/{} elements, expected [{b} or 1, {s}, {d}]",
                cos.len(),
                sin.len()
            ),
        ));
    }
    let half = d / 2;
    for bi in 0..b {
        let tb = if bt == 1 { 0 } else { bi * table };
        for hi in 0..h {
            for si in 0..s {
                let base = ((bi * h + hi) * s + si) * d;
                let row = &mut x[base..base + d];
                let c = &cos[tb + si * d..tb + si * d + d];
                let sn = &sin[tb + si * d..tb + si * d + d];
                for i in 0..half {
                    let (x1, x2) = (row[i], row[i + half]);
                    row[i] = x1 * c[i] + (-x2) * sn[i];
                    row[i + half] = x2 * c[i + half] + x1 * sn[i + half];
                }
            }
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
        rotary_halves(&mut x, 1, 1, 1, 4, &[0., 1., 0., 1.], &[1., 0., 1., 0.]).unwrap();
        assert_eq!(x, vec![-3.0, 2.0, 1.0, 4.0]);
        // two heads share the table; batch 2 with a shared table
        let mut y = vec![1.0f32, 2., 3., 4., 1., 2., 3., 4.];
        rotary_halves(&mut y, 2, 1, 1, 4, &[0., 1., 0., 1.], &[1., 0., 1., 0.]).unwrap();
        assert_eq!(&y[4..], &[-3.0, 2.0, 1.0, 4.0]);
        assert!(rotary_halves(&mut y, 1, 1, 1, 3, &[0.; 3], &[0.; 3]).is_err());
    }
}
