//! Property tests: kernels against independent naive index arithmetic (small case counts).

use petite_dtype::{bf16_bits, round_through_bf16};
use petite_reference::kernels::{linear, map_binary, permute, slice_axis};
use proptest::prelude::*;

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = i % shape[d];
        i /= shape[d];
    }
    idx
}

/// Two shapes that broadcast: a full shape, and the other with random dims set to 1 and a
/// random number of leading dims dropped.
fn broadcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>, bool)> {
    (1usize..=4)
        .prop_flat_map(|r| {
            (
                prop::collection::vec(1usize..=4, r),
                prop::collection::vec(any::<bool>(), r),
                0..=r,
                any::<bool>(),
            )
        })
        .prop_map(|(full, ones, drop, swap)| {
            let other: Vec<usize> = full
                .iter()
                .zip(&ones)
                .skip(drop)
                .map(|(&d, &one)| if one { 1 } else { d })
                .collect();
            (full, other, swap)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn broadcast_sub_matches_naive((full, other, swap) in broadcast_pair()) {
        let (sa, sb) = if swap { (other.clone(), full.clone()) } else { (full.clone(), other.clone()) };
        let na: usize = sa.iter().product();
        let nb: usize = sb.iter().product();
        let a: Vec<f32> = (0..na).map(|i| i as f32 * 1.5).collect();
        let b: Vec<f32> = (0..nb).map(|i| (i as f32).sqrt()).collect();
        let (o, s) = map_binary(&a, &sa, &b, &sb, |x, y| x - y).unwrap();
        prop_assert_eq!(&s, &full);
        for (i, v) in o.iter().enumerate() {
            let idx = unravel(i, &full);
            let pick = |shape: &[usize]| -> usize {
                let off = full.len() - shape.len();
                let st = strides(shape);
                (0..shape.len()).map(|d| if shape[d] == 1 { 0 } else { idx[d + off] * st[d] }).sum()
            };
            prop_assert_eq!(*v, a[pick(&sa)] - b[pick(&sb)]);
        }
    }

    #[test]
    fn permute_matches_naive_and_inverts(
        shape in prop::collection::vec(1usize..=4, 1..=5),
        seed in any::<u64>(),
    ) {
        let r = shape.len();
        let mut perm: Vec<usize> = (0..r).collect();
        let mut s = seed;
        for i in (1..r).rev() {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            perm.swap(i, (s >> 33) as usize % (i + 1));
        }
        let n: usize = shape.iter().product();
        let x: Vec<u32> = (0..n as u32).collect();
        let (y, ys) = permute(&x, &shape, &perm).unwrap();
        let st = strides(&shape);
        for (i, v) in y.iter().enumerate() {
            let oi = unravel(i, &ys);
            let src: usize = (0..r).map(|d| oi[d] * st[perm[d]]).sum();
            prop_assert_eq!(*v, x[src]);
        }
        let mut inv = vec![0; r];
        for (i, &p) in perm.iter().enumerate() { inv[p] = i; }
        let (z, zs) = permute(&y, &ys, &inv).unwrap();
        prop_assert_eq!(zs, shape);
        prop_assert_eq!(z, x);
    }

    #[test]
    fn slice_matches_naive(len in 1usize..20, inner in 1usize..4, a in 0usize..20, b in 0usize..20, step in 1usize..4) {
        let (start, end) = (a.min(b).min(len), a.max(b).min(len));
        let x: Vec<usize> = (0..2 * len * inner).collect();
        let (y, s) = slice_axis(&x, &[2, len, inner], 1, start, end, step).unwrap();
        let want: Vec<usize> = (0..2)
            .flat_map(|o| (start..end).step_by(step).flat_map(move |i| (0..inner).map(move |j| (o * len + i) * inner + j)))
            .collect();
        prop_assert_eq!(s[1], (end - start).div_ceil(step));
        prop_assert_eq!(y, want);
    }

    #[test]
    fn linear_matches_naive(m in 1usize..24, k in 1usize..70, n in 1usize..40, seed in any::<u32>()) {
        let mut s = seed;
        let mut next = || { s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223); ((s >> 8) as f32 / (1u32 << 24) as f32) - 0.5 };
        let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
        let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
        let b: Vec<f32> = (0..n).map(|_| next()).collect();
        let y = linear(&x, m, &w, n, Some(&b)).unwrap();
        for i in 0..m {
            for j in 0..n {
                let want: f64 = b[j] as f64 + (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64).sum::<f64>();
                // f32 accumulation of k products of values in [-0.5, 0.5] vs f64: the error grows
                // like sqrt(k) ulps whether `gemm` fuses (FMA CPUs) or not; 1e-5·sqrt(k) is ~100×.
                prop_assert!((y[i * n + j] as f64 - want).abs() < 1e-5 * (k as f64).sqrt() + 1e-6);
            }
        }
    }

    #[test]
    fn bf16_rounding_is_nearest_even(bits in any::<u32>()) {
        let x = f32::from_bits(bits);
        let r = round_through_bf16(x);
        if x.is_nan() {
            // A NaN stays a NaN with its sign (never infinity).
            prop_assert!(r.is_nan(), "{bits:#x} -> {:#06x}", bf16_bits(x));
            prop_assert_eq!(bf16_bits(x) & 0x8000, (bits >> 16) as u16 & 0x8000);
        } else if x.is_finite() && r.is_finite() {
            // r is a bf16 value; no bf16 value is strictly closer, ties go to the even one
            let rb = bf16_bits(x);
            let up = f32::from_bits(((rb as u32) + 1) << 16);
            let down = f32::from_bits(((rb as u32).wrapping_sub(1)) << 16);
            let d = (x as f64 - r as f64).abs();
            for nb in [up, down] {
                if nb.is_finite() {
                    let dn = (x as f64 - nb as f64).abs();
                    prop_assert!(d < dn || (d == dn && rb.is_multiple_of(2)), "{x:e} → {r:e}, neighbour {nb:e}");
                }
            }
        }
    }
}
