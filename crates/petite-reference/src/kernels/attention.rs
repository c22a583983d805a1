//! Softmax and scaled-dot-product attention (eager transformers order: `q·kᵀ`, then `· scale`,
//! then `+ mask`, softmax in f32, then `· v`), with grouped KV heads. Two GEMMs per KV group (the
//! query heads that share a KV head stacked as rows); groups run in parallel, each output's
//! arithmetic is the same whatever the grouping or the thread count.

use super::matmul::{MatRef, gemm_f32};
use crate::bf16::round_slice_through_bf16;
use crate::{Result, kerr};
use rayon::prelude::*;

/// Softmax over rows of `d` elements, in place: `e = exp(x − max)`, `y = e · (1/Σe)` (PyTorch's
/// CPU order; Σ accumulated in f64, left to right). A row of equal values (e.g. fully masked
/// with a finite fill) becomes uniform.
pub fn softmax_lastdim(x: &mut [f32], d: usize) -> Result<()> {
    if x.is_empty() {
        return Ok(());
    }
    if d == 0 || !x.len().is_multiple_of(d) {
        return Err(kerr(
            "softmax",
            format!("input of {} elements is not rows of {d}", x.len()),
        ));
    }
    if x.len() >= super::PAR_MIN {
        x.par_chunks_mut(d).for_each(softmax_row);
    } else {
        x.chunks_mut(d).for_each(softmax_row);
    }
    Ok(())
}

/// One row of [`softmax_lastdim`], in place.
fn softmax_row(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = 1.0 / sum as f32;
    row.iter_mut().for_each(|v| *v *= inv);
}

/// Shapes of one attention call: `q [b, h, sq, d]`, `k [b, kvh, sk, d]`, `v [b, kvh, sk, dv]`,
/// output `[b, h, sq, dv]`; query head `i` reads KV head `i / (h / kvh)` (repeat_kv order).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SdpaShape {
    /// Batch.
    pub b: usize,
    /// Query heads.
    pub h: usize,
    /// KV heads; must divide `h`.
    pub kvh: usize,
    /// Query length.
    pub sq: usize,
    /// Key/value length.
    pub sk: usize,
    /// q/k head dim.
    pub d: usize,
    /// v head dim.
    pub dv: usize,
}

/// Scaled-dot-product attention.
///
/// `mask` is additive, `[mb, mh, mq, sk]` with `mb ∈ {1, b}`, `mh ∈ {1, h}`, `mq ∈ {1, sq}`
/// (given as `(data, [mb, mh, mq, mk])`, `mk ∈ {1, sk}`). With `bf16_intermediates` the scores,
/// scaled scores and probabilities are rounded through bf16 where a bf16 eager run rounds them
/// (matmul output, the scale product, the softmax output cast back to the query dtype).
pub fn sdpa(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<(&[f32], [usize; 4])>,
    shape: SdpaShape,
    scale: f32,
    bf16_intermediates: bool,
) -> Result<Vec<f32>> {
    let SdpaShape {
        b,
        h,
        kvh,
        sq,
        sk,
        d,
        dv,
    } = shape;
    if kvh == 0 || !h.is_multiple_of(kvh) {
        return Err(kerr(
            "sdpa",
            format!("{h} query heads are not a multiple of {kvh} KV heads"),
        ));
    }
    let want = |name: &str, got: usize, dims: [usize; 4]| -> Result<()> {
        if got != dims.iter().product::<usize>() {
            return Err(kerr(
                "sdpa",
                format!("{name} has {got} elements, expected {dims:?}"),
            ));
        }
        Ok(())
    };
    want("q", q.len(), [b, h, sq, d])?;
    want("k", k.len(), [b, kvh, sk, d])?;
    want("v", v.len(), [b, kvh, sk, dv])?;
    let mask = match mask {
        None => None,
        Some((m, [mb, mh, mq, mk])) => {
            let ok = (mb == 1 || mb == b)
                && (mh == 1 || mh == h)
                && (mq == 1 || mq == sq)
                && (mk == 1 || mk == sk);
            if !ok {
                return Err(kerr(
                    "sdpa",
                    format!(
                        "mask {:?} does not broadcast to [{b}, {h}, {sq}, {sk}]",
                        [mb, mh, mq, mk]
                    ),
                ));
            }
            want("mask", m.len(), [mb, mh, mq, mk])?;
            // strides (0 where broadcast)
            let sk_s = usize::from(mk != 1);
            let sq_s = if mq == 1 { 0 } else { mk };
            let sh_s = if mh == 1 { 0 } else { mq * mk };
            let sb_s = if mb == 1 { 0 } else { mh * mq * mk };
            Some((m, [sb_s, sh_s, sq_s, sk_s]))
        }
    };
    let group = h / kvh;
    let mut out = vec![0.0f32; b * h * sq * dv];
    if out.is_empty() {
        return Ok(out);
    }
    // The query heads that share a KV head are contiguous in `q` and `out`, so each KV group is
    // two GEMMs of `group · sq` rows (one `kᵀ` panel and one `v` read for all its heads rather
    // than once per head). Every output is its own fused-multiply-add chain whatever the number
    // of rows, so this gives the per-head products bit for bit.
    let groups = b * kvh;
    let one = |(idx, dst): (usize, &mut [f32]), parallel: bool| -> Result<()> {
        let (bi, g) = (idx / kvh, idx % kvh);
        let rows = group * sq;
        let qg = &q[(bi * h + g * group) * sq * d..][..rows * d];
        let kh = &k[(bi * kvh + g) * sk * d..][..sk * d];
        let vh = &v[(bi * kvh + g) * sk * dv..][..sk * dv];
        let mut scores = vec![0.0f32; rows * sk];
        gemm_f32(
            &mut scores,
            MatRef::row_major(qg, rows, d)?,
            MatRef::row_major(kh, sk, d)?.t(),
            false,
            parallel,
        )?;
        // Row `r` is query `r % sq` of head `g·group + r / sq`; everything up to the PV product
        // is row-local.
        let row_fn = |(r, row): (usize, &mut [f32])| {
            if bf16_intermediates {
                round_slice_through_bf16(row);
            }
            row.iter_mut().for_each(|s| *s *= scale);
            if bf16_intermediates {
                round_slice_through_bf16(row);
            }
            if let Some((m, [sb, sh, sqs, sks])) = mask {
                let (hi, qi) = (g * group + r / sq, r % sq);
                let base = bi * sb + hi * sh + qi * sqs;
                for (ki, s) in row.iter_mut().enumerate() {
                    *s += m[base + ki * sks];
                }
            }
            softmax_row(row);
            if bf16_intermediates {
                round_slice_through_bf16(row);
            }
        };
        if parallel && scores.len() >= super::PAR_MIN {
            scores.par_chunks_mut(sk).enumerate().for_each(row_fn);
        } else {
            scores.chunks_mut(sk).enumerate().for_each(row_fn);
        }
        gemm_f32(
            dst,
            MatRef::row_major(&scores, rows, sk)?,
            MatRef::row_major(vh, sk, dv)?,
            false,
            parallel,
        )
    };
    if groups == 1 {
        one((0, &mut out[..]), true)?;
    } else {
        out.par_chunks_mut(group * sq * dv)
            .enumerate()
            .try_for_each(|x| one(x, false))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_hand() {
        let mut x = vec![0.0f32, (2.0f32).ln(), -2.38e38, 5.0, 5.0, 5.0];
        softmax_lastdim(&mut x, 3).unwrap();
        assert!((x[0] - 1.0 / 3.0).abs() < 1e-7 && (x[1] - 2.0 / 3.0).abs() < 1e-7);
        assert_eq!(x[2], 0.0);
        assert!(x[3..].iter().all(|&p| (p - 1.0 / 3.0).abs() < 1e-7));
        assert!(softmax_lastdim(&mut x, 4).is_err());
    }

    /// Independent naive attention with explicit repeat_kv, for comparison.
    #[allow(clippy::too_many_arguments)]
    fn naive(q: &[f32], k: &[f32], v: &[f32], mask: &[f32], s: SdpaShape, scale: f32) -> Vec<f32> {
        let mut out = vec![0.0f32; s.b * s.h * s.sq * s.dv];
        for bi in 0..s.b {
            for hi in 0..s.h {
                let g = hi * s.kvh / s.h;
                for qi in 0..s.sq {
                    let mut sc: Vec<f64> = (0..s.sk)
                        .map(|ki| {
                            let dot: f64 = (0..s.d)
                                .map(|j| {
                                    q[((bi * s.h + hi) * s.sq + qi) * s.d + j] as f64
                                        * k[((bi * s.kvh + g) * s.sk + ki) * s.d + j] as f64
                                })
                                .sum();
                            dot * scale as f64 + mask[(bi * s.sq + qi) * s.sk + ki] as f64
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    sc.iter_mut().for_each(|x| *x = (*x - mx).exp());
                    let sum: f64 = sc.iter().sum();
                    for j in 0..s.dv {
                        let mut acc = 0.0f64;
                        for ki in 0..s.sk {
                            acc +=
                                sc[ki] / sum * v[((bi * s.kvh + g) * s.sk + ki) * s.dv + j] as f64;
                        }
                        out[((bi * s.h + hi) * s.sq + qi) * s.dv + j] = acc as f32;
                    }
                }
            }
        }
        out
    }

    fn seq(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                ((s >> 8) as f32 / (1u32 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// q, k and v of shape `s`, from seeds `seed`, `seed + 1`, `seed + 2`.
    fn qkv(s: SdpaShape, seed: u32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        (
            seq(s.b * s.h * s.sq * s.d, seed),
            seq(s.b * s.kvh * s.sk * s.d, seed + 1),
            seq(s.b * s.kvh * s.sk * s.dv, seed + 2),
        )
    }

    #[test]
    fn gqa_with_mask_matches_naive() {
        let s = SdpaShape {
            b: 2,
            h: 4,
            kvh: 2,
            sq: 5,
            sk: 7,
            d: 8,
            dv: 6,
        };
        let (q, k, v) = qkv(s, 1);
        // mask [b, 1, sq, sk]: block the last two keys for batch 0, and everything for row 0 of
        // batch 1 (a fully masked row becomes uniform, as with lerobot's finite fill)
        let mut mask = vec![0.0f32; s.b * s.sq * s.sk];
        for qi in 0..s.sq {
            mask[qi * s.sk + 5] = -2.381_976_3e38;
            mask[qi * s.sk + 6] = -2.381_976_3e38;
        }
        for ki in 0..s.sk {
            mask[s.sq * s.sk + ki] = -2.381_976_3e38;
        }
        let scale = 1.0 / (s.d as f32).sqrt();
        let got = sdpa(&q, &k, &v, Some((&mask, [2, 1, 5, 7])), s, scale, false).unwrap();
        let want = naive(&q, &k, &v, &mask, s, scale);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() < 1e-5, "{i}: {a} vs {b}");
        }
        assert!(sdpa(&q, &k, &v, None, SdpaShape { kvh: 3, ..s }, 1.0, false).is_err());
        assert!(sdpa(&q, &k, &v, Some((&mask, [2, 1, 5, 6])), s, 1.0, false).is_err());
    }

    /// A KV group's heads run as one product of `group · sq` rows: the same bits as each head
    /// alone (a different tiling, thread split and packing path; one order per output).
    #[test]
    fn grouped_heads_give_each_heads_bits() {
        let s = SdpaShape {
            b: 2,
            h: 8,
            kvh: 2,
            sq: 37,
            sk: 70,
            d: 40,
            dv: 24,
        };
        let (q, k, v) = qkv(s, 4);
        // a per-head mask [b, h, sq, sk], some keys blocked
        let mask: Vec<f32> = seq(s.b * s.h * s.sq * s.sk, 7)
            .into_iter()
            .map(|x| if x > 0.6 { -2.381_976_3e38 } else { x })
            .collect();
        for bf16 in [false, true] {
            let got = sdpa(
                &q,
                &k,
                &v,
                Some((&mask, [s.b, s.h, s.sq, s.sk])),
                s,
                0.3,
                bf16,
            )
            .unwrap();
            assert_eq!(got.len(), s.b * s.h * s.sq * s.dv);
            assert!(got.iter().all(|x| x.is_finite()));
            let one = SdpaShape {
                b: 1,
                h: 1,
                kvh: 1,
                ..s
            };
            for bi in 0..s.b {
                for hi in 0..s.h {
                    let g = hi / (s.h / s.kvh);
                    let head = bi * s.h + hi;
                    let want = sdpa(
                        &q[head * s.sq * s.d..][..s.sq * s.d],
                        &k[(bi * s.kvh + g) * s.sk * s.d..][..s.sk * s.d],
                        &v[(bi * s.kvh + g) * s.sk * s.dv..][..s.sk * s.dv],
                        Some((
                            &mask[head * s.sq * s.sk..][..s.sq * s.sk],
                            [1, 1, s.sq, s.sk],
                        )),
                        one,
                        0.3,
                        bf16,
                    )
                    .unwrap();
                    let got = &got[head * s.sq * s.dv..][..s.sq * s.dv];
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "batch {bi} head {hi} (bf16 {bf16}) differs");
                }
            }
        }
    }

    #[test]
    fn one_key_returns_its_value() {
        let s = SdpaShape {
            b: 1,
            h: 2,
            kvh: 1,
            sq: 1,
            sk: 1,
            d: 2,
            dv: 3,
        };
        let o = sdpa(
            &[1., 2., 3., 4.],
            &[5., 6.],
            &[7., 8., 9.],
            None,
            s,
            0.5,
            false,
        )
        .unwrap();
        assert_eq!(o, vec![7., 8., 9., 7., 8., 9.]);
    }
}
