//! Layer norm and RMS norm over the last axis. Row statistics accumulate in f64 in a fixed
//! order (per row, left to right), so a row's result depends only on that row.

use super::PAR_MIN;
use crate::{Result, kerr};
use rayon::prelude::*;

fn check(kernel: &'static str, x: &[f32], d: usize, p: Option<&[f32]>, name: &str) -> Result<()> {
    if !x.is_empty() && (d == 0 || !x.len().is_multiple_of(d)) {
        return Err(kerr(
            kernel,
            format!("input of {} elements is not rows of {d}", x.len()),
        ));
    }
    if let Some(p) = p
        && p.len() != d
    {
        return Err(kerr(
            kernel,
            format!("{name} has {} elements, expected [{d}]", p.len()),
        ));
    }
    Ok(())
}

fn rows_mut(x: &mut [f32], d: usize, f: impl Fn(&mut [f32]) + Sync + Send) {
    if x.is_empty() || d == 0 {
        return;
    }
    if x.len() >= PAR_MIN {
        x.par_chunks_mut(d).for_each(f);
    } else {
        x.chunks_mut(d).for_each(f);
    }
}

/// `F.layer_norm` over the last `d` elements, in place:
/// `(x − mean)·rsqrt(var + eps)·w + b` with the biased variance.
pub fn layer_norm(
    x: &mut [f32],
    d: usize,
    weight: Option<&[f32]>,
    bias: Option<&[f32]>,
    eps: f32,
) -> Result<()> {
    check("layer_norm", x, d, weight, "weight")?;
    check("layer_norm", x, d, bias, "bias")?;
    rows_mut(x, d, |row| {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
        let var = row
            .iter()
            .map(|&v| {
                let c = v as f64 - mean;
                c * c
            })
            .sum::<f64>()
            / d as f64;
        let mean = mean as f32;
        let rstd = 1.0 / (var as f32 + eps).sqrt();
        for (i, v) in row.iter_mut().enumerate() {
            let mut y = (*v - mean) * rstd;
            if let Some(w) = weight {
                y *= w[i];
            }
            if let Some(b) = bias {
                y += b[i];
            }
            *v = y;
        }
    });
    Ok(())
}

/// RMS norm over the last `d` elements, in place, as Gemma computes it in f32:
/// `y = x·rsqrt(mean(x²) + eps)`, then `y·(offset + w)` if a weight is given.
/// Gemma uses `offset = 1` (weights stored as deltas from one); plain RMSNorm uses 0.
pub fn rms_norm(
    x: &mut [f32],
    d: usize,
    weight: Option<&[f32]>,
    offset: f32,
    eps: f32,
) -> Result<()> {
    check("rms_norm", x, d, weight, "weight")?;
    rows_mut(x, d, |row| {
        let ms = (row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / d as f64) as f32;
        let r = 1.0 / (ms + eps).sqrt();
        match weight {
            Some(w) => row
                .iter_mut()
                .zip(w)
                .for_each(|(v, &w)| *v = (*v * r) * (offset + w)),
            None => row.iter_mut().for_each(|v| *v *= r),
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_norm_hand() {
        // row [1,2,3,4]: mean 2.5, var 1.25, rstd = 1/sqrt(1.25) = 0.894427
        let mut x = vec![1.0f32, 2., 3., 4.];
        layer_norm(
            &mut x,
            4,
            Some(&[1., 2., 1., 1.]),
            Some(&[0., 0., 0., 10.]),
            0.0,
        )
        .unwrap();
        let r = 0.894_427_2f32;
        let want = [-1.5 * r, -0.5 * r * 2.0, 0.5 * r, 1.5 * r + 10.0];
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        // constant row → zeros (eps keeps it finite)
        let mut x = vec![5.0f32; 3];
        layer_norm(&mut x, 3, None, None, 1e-6).unwrap();
        assert_eq!(x, vec![0.0; 3]);
    }

    #[test]
    fn rms_norm_gemma_offset() {
        // row [3,4]: mean(x²) = 12.5, r = 1/sqrt(12.5) = 0.2828427
        let mut x = vec![3.0f32, 4.0, 1.0, 1.0];
        rms_norm(&mut x, 2, Some(&[0.0, 1.0]), 1.0, 0.0).unwrap();
        let r = 0.282_842_7f32;
        assert!((x[0] - 3.0 * r).abs() < 1e-6);
        assert!((x[1] - 4.0 * r * 2.0).abs() < 1e-6);
        assert!((x[2] - 1.0).abs() < 1e-6 && (x[3] - 2.0).abs() < 1e-6);
        let mut y = vec![3.0f32, 4.0];
        rms_norm(&mut y, 2, None, 1.0, 0.0).unwrap();
        assert!((y[1] - 4.0 * r).abs() < 1e-6);
        assert!(rms_norm(&mut y, 3, None, 1.0, 0.0).is_err());
        assert!(rms_norm(&mut y, 2, Some(&[1.0]), 1.0, 0.0).is_err());
    }
}
