//! 2-D convolution (NCHW, groups = 1, dilation 1) as im2col + one GEMM per image.

use super::matmul::{MatRef, gemm_f32};
use crate::{Result, kerr};

/// Geometry of a conv2d call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dParams {
    /// Batch.
    pub n: usize,
    /// Input channels.
    pub c: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels.
    pub o: usize,
    /// Kernel height.
    pub kh: usize,
    /// Kernel width.
    pub kw: usize,
    /// Stride (height, width).
    pub stride: [usize; 2],
    /// Zero padding (height, width), both sides.
    pub padding: [usize; 2],
}

/// Output height and width, or an error if the kernel does not fit.
pub fn conv2d_out_hw(p: &Conv2dParams) -> Result<(usize, usize)> {
    let dim = |inp: usize, k: usize, s: usize, pad: usize, what: &str| -> Result<usize> {
        if s == 0 {
            return Err(kerr("conv2d", format!("{what} stride is zero")));
        }
        let padded = inp + 2 * pad;
        if k == 0 || padded < k {
            return Err(kerr(
                "conv2d",
                format!("kernel {what} {k} does not fit padded input {what} {padded}"),
            ));
        }
        Ok((padded - k) / s + 1)
    };
    Ok((
        dim(p.h, p.kh, p.stride[0], p.padding[0], "height")?,
        dim(p.w, p.kw, p.stride[1], p.padding[1], "width")?,
    ))
}

/// `F.conv2d(x[n,c,h,w], weight[o,c,kh,kw], bias[o])` → `[n, o, oh, ow]`.
pub fn conv2d(
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    p: Conv2dParams,
) -> Result<Vec<f32>> {
    let (oh, ow) = conv2d_out_hw(&p)?;
    let Conv2dParams {
        n,
        c,
        h,
        w,
        o,
        kh,
        kw,
        stride: [sh, sw],
        padding: [ph, pw],
    } = p;
    if x.len() != n * c * h * w {
        return Err(kerr(
            "conv2d",
            format!(
                "input has {} elements, expected [{n}, {c}, {h}, {w}]",
                x.len()
            ),
        ));
    }
    let ckk = c * kh * kw;
    if weight.len() != o * ckk {
        return Err(kerr(
            "conv2d",
            format!(
                "weight has {} elements, expected [{o}, {c}, {kh}, {kw}]",
                weight.len()
            ),
        ));
    }
    if let Some(b) = bias
        && b.len() != o
    {
        return Err(kerr(
            "conv2d",
            format!("bias has {} elements, expected [{o}]", b.len()),
        ));
    }
    let npix = oh * ow;
    let mut out = vec![0.0f32; n * o * npix];
    let mut cols = vec![0.0f32; ckk * npix];
    for img in 0..n {
        let xi = &x[img * c * h * w..(img + 1) * c * h * w];
        for ci in 0..c {
            for ky in 0..kh {
                for kx in 0..kw {
                    let row = (ci * kh + ky) * kw + kx;
                    let dst = &mut cols[row * npix..(row + 1) * npix];
                    for oy in 0..oh {
                        let iy = (oy * sh + ky) as isize - ph as isize;
                        for ox in 0..ow {
                            let ix = (ox * sw + kx) as isize - pw as isize;
                            dst[oy * ow + ox] =
                                if iy >= 0 && ix >= 0 && (iy as usize) < h && (ix as usize) < w {
                                    xi[(ci * h + iy as usize) * w + ix as usize]
                                } else {
                                    0.0
                                };
                        }
                    }
                }
            }
        }
        let oi = &mut out[img * o * npix..(img + 1) * o * npix];
        if let Some(b) = bias {
            for (oc, chunk) in oi.chunks_exact_mut(npix).enumerate() {
                chunk.fill(b[oc]);
            }
        }
        gemm_f32(
            oi,
            MatRef::row_major(weight, o, ckk)?,
            MatRef::row_major(&cols, ckk, npix)?,
            bias.is_some(),
            true,
        )?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patch_embedding_hand() {
        // 1 image, 1 channel, 4x4, kernel 2 stride 2 → 2x2 patches; weight sums the patch.
        let x: Vec<f32> = (1..=16).map(|v| v as f32).collect();
        let p = Conv2dParams {
            n: 1,
            c: 1,
            h: 4,
            w: 4,
            o: 2,
            kh: 2,
            kw: 2,
            stride: [2, 2],
            padding: [0, 0],
        };
        // channel 0 sums, channel 1 takes the top-left pixel; bias [0, 100]
        let wgt = [1., 1., 1., 1., 1., 0., 0., 0.];
        let y = conv2d(&x, &wgt, Some(&[0., 100.]), p).unwrap();
        assert_eq!(y, vec![14., 22., 46., 54., 101., 103., 109., 111.]);
    }

    #[test]
    fn padding_and_stride_one_match_naive() {
        let p = Conv2dParams {
            n: 2,
            c: 2,
            h: 5,
            w: 4,
            o: 3,
            kh: 3,
            kw: 2,
            stride: [2, 1],
            padding: [1, 1],
        };
        let x: Vec<f32> = (0..p.n * p.c * p.h * p.w)
            .map(|i| ((i * 7) % 11) as f32 - 5.0)
            .collect();
        let wgt: Vec<f32> = (0..p.o * p.c * p.kh * p.kw)
            .map(|i| ((i * 5) % 7) as f32 - 3.0)
            .collect();
        let (oh, ow) = conv2d_out_hw(&p).unwrap();
        assert_eq!((oh, ow), (3, 5));
        let y = conv2d(&x, &wgt, None, p).unwrap();
        for img in 0..p.n {
            for oc in 0..p.o {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut acc = 0.0f32;
                        for ci in 0..p.c {
                            for ky in 0..p.kh {
                                for kx in 0..p.kw {
                                    let iy = (oy * 2 + ky) as i64 - 1;
                                    let ix = (ox + kx) as i64 - 1;
                                    if iy < 0 || ix < 0 || iy >= p.h as i64 || ix >= p.w as i64 {
                                        continue;
                                    }
                                    acc += x[((img * p.c + ci) * p.h + iy as usize) * p.w
                                        + ix as usize]
                                        * wgt[((oc * p.c + ci) * p.kh + ky) * p.kw + kx];
                                }
                            }
                        }
                        assert_eq!(y[((img * p.o + oc) * oh + oy) * ow + ox], acc);
                    }
                }
            }
        }
        assert!(conv2d(&x, &wgt[1..], None, p).is_err());
        assert!(conv2d_out_hw(&Conv2dParams { kh: 9, ..p }).is_err());
    }
}
