//! `exp` and the tanh GELU written once over [`Lanes`] (one f32, or 16 AVX-512 lanes), from
//! IEEE basic operations and fused multiply-adds only, each correctly rounded: so the scalar
//! and the vector path give the same bits on every CPU, and a program's results do not depend
//! on which one ran (libm's `expf`/`tanhf` are neither vectorised nor the same across libms).
//!
//! `exp` is Cephes' `expf` (range reduction by `ln 2` in two parts, a degree-5 polynomial;
//! within 1 ulp of the exact value over the normal range), with `2ⁿ` applied in two exact
//! halves so that results near overflow and in the subnormal range round once.

use super::PAR_MIN;
use rayon::prelude::*;

/// The operations the functions below are written in: one f32 or a vector of them, every
/// operation lane-wise and correctly rounded (so any two implementations agree bit for bit).
trait Lanes: Copy {
    fn splat(v: f32) -> Self;
    fn add(self, o: Self) -> Self;
    fn sub(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn div(self, o: Self) -> Self;
    /// `self · a + b`, rounded once.
    fn mul_add(self, a: Self, b: Self) -> Self;
    /// `self` limited to `[lo, hi]`; a NaN stays NaN.
    fn clamp(self, lo: f32, hi: f32) -> Self;
    /// `self · 2ⁿ`, where `n` is `t`'s bits minus [`MAGIC`]'s, as an integer (`t` is
    /// `n + MAGIC` for `|n| ≤ 150`), applied as two exact power-of-two products.
    fn scale_by(self, t: Self) -> Self;
}

/// `1.5 · 2²³`: adding it to a float below `2²²` in magnitude rounds that float to the
/// nearest integer (ties to even), whose value is then the sum's low mantissa bits.
const MAGIC: f32 = 12_582_912.0;

/// `2^(n >> 1)` and `2^(n − (n >> 1))` as f32 bits, for `n` in `[-150, 128]`: both normal.
#[inline(always)]
fn pow2_halves(n: i32) -> (u32, u32) {
    let h = n >> 1;
    (((h + 127) << 23) as u32, ((n - h + 127) << 23) as u32)
}

impl Lanes for f32 {
    #[inline(always)]
    fn splat(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        self + o
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        self - o
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        self * o
    }
    #[inline(always)]
    fn div(self, o: Self) -> Self {
        self / o
    }
    #[inline(always)]
    fn mul_add(self, a: Self, b: Self) -> Self {
        f32::mul_add(self, a, b)
    }
    #[inline(always)]
    fn clamp(self, lo: f32, hi: f32) -> Self {
        if self < lo {
            lo
        } else if self > hi {
            hi
        } else {
            self
        }
    }
    #[inline(always)]
    fn scale_by(self, t: Self) -> Self {
        let n = t.to_bits().wrapping_sub(MAGIC.to_bits()) as i32;
        let (a, b) = pow2_halves(n);
        self * f32::from_bits(a) * f32::from_bits(b)
    }
}

/// `exp(x)`: Cephes' `expf` in fixed operations (see the module docs). Below −104 it is 0 (the
/// exact value rounds to 0 there too), above 89 it is `inf`, NaN stays NaN.
#[inline(always)]
fn exp<V: Lanes>(x: V) -> V {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 = C1 + C2, C1 with 9 significant bits (so n · C1 is exact).
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5, // Cephes: 5.0000001201E-1, which is 0.5 in f32
    ];
    let x = x.clamp(-104.0, 89.0);
    let t = x.mul_add(V::splat(LOG2E), V::splat(MAGIC));
    let n = t.sub(V::splat(MAGIC));
    let r = n.mul_add(V::splat(-C1), x);
    let r = n.mul_add(V::splat(-C2), r);
    let mut p = V::splat(P[0]);
    for &c in &P[1..] {
        p = p.mul_add(r, V::splat(c));
    }
    let y = p.mul_add(r.mul(r), r.add(V::splat(1.0)));
    y.scale_by(t)
}

/// `gelu(x, approximate="tanh") = 0.5·x·(1 + tanh(u))`, `u = √(2/π)·(x + 0.044715·x³)`, as
/// the equal `x / (1 + exp(−2u))`: one `exp`, and no cancellation in `1 + tanh(u)` for
/// negative `x` (where PyTorch's float evaluation loses relative precision; its results and
/// these agree within a few ulps of the larger of the two, see the tests).
#[inline(always)]
fn gelu<V: Lanes>(x: V) -> V {
    // PyTorch: kBeta = M_SQRT2 * M_2_SQRTPI * 0.5 (computed in double, then cast to float).
    const K_BETA: f32 = (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
    const K_KAPPA: f32 = 0.044715;
    let x3 = x.mul(x).mul(x);
    let u = x3.mul(V::splat(K_KAPPA)).add(x).mul(V::splat(K_BETA));
    let e = exp(u.mul(V::splat(-2.0)));
    x.div(e.add(V::splat(1.0)))
}

/// `exp` (the one implementation shared with the AVX-512 lanes) of one f32.
#[inline]
pub fn exp_scalar(x: f32) -> f32 {
    exp(x)
}

/// The tanh GELU of one f32 (the one implementation shared with the AVX-512 lanes).
#[inline]
pub fn gelu_tanh_scalar(x: f32) -> f32 {
    gelu(x)
}

/// `f` over a slice in place, split across rayon threads when long; on a CPU with AVX-512F
/// sixteen lanes at a time (the same bits as the scalar path).
fn map_in_place(x: &mut [f32], f: Kernel) {
    let run = |c: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        if super::avx512::available() {
            // SAFETY: AVX-512F is present.
            unsafe { x86::map(c, f) };
            return;
        }
        match f {
            Kernel::Exp => c.iter_mut().for_each(|v| *v = exp(*v)),
            Kernel::Gelu => c.iter_mut().for_each(|v| *v = gelu(*v)),
        }
    };
    if x.len() >= PAR_MIN {
        x.par_chunks_mut(PAR_MIN).for_each(run);
    } else {
        run(x);
    }
}

/// Which function [`map_in_place`] maps.
#[derive(Clone, Copy)]
enum Kernel {
    Exp,
    Gelu,
}

/// The tanh GELU in place.
pub fn gelu_tanh(x: &mut [f32]) {
    map_in_place(x, Kernel::Gelu)
}

/// `exp` in place.
pub fn exp_in_place(x: &mut [f32]) {
    map_in_place(x, Kernel::Exp)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Kernel, Lanes, MAGIC, exp, gelu};
    use std::arch::x86_64::*;

    /// Sixteen f32 lanes.
    #[derive(Clone, Copy)]
    struct V16(__m512);

    // SAFETY (every method): these run only inside `map`, whose AVX-512F contract makes the
    // intrinsics valid; they are `inline(always)` so they are compiled into it.
    impl Lanes for V16 {
        #[inline(always)]
        fn splat(v: f32) -> Self {
            V16(unsafe { _mm512_set1_ps(v) })
        }
        #[inline(always)]
        fn add(self, o: Self) -> Self {
            V16(unsafe { _mm512_add_ps(self.0, o.0) })
        }
        #[inline(always)]
        fn sub(self, o: Self) -> Self {
            V16(unsafe { _mm512_sub_ps(self.0, o.0) })
        }
        #[inline(always)]
        fn mul(self, o: Self) -> Self {
            V16(unsafe { _mm512_mul_ps(self.0, o.0) })
        }
        #[inline(always)]
        fn div(self, o: Self) -> Self {
            V16(unsafe { _mm512_div_ps(self.0, o.0) })
        }
        #[inline(always)]
        fn mul_add(self, a: Self, b: Self) -> Self {
            V16(unsafe { _mm512_fmadd_ps(self.0, a.0, b.0) })
        }
        #[inline(always)]
        fn clamp(self, lo: f32, hi: f32) -> Self {
            // max/min return their second operand when one is NaN: the input's NaN stays.
            unsafe {
                let v = _mm512_max_ps(_mm512_set1_ps(lo), self.0);
                V16(_mm512_min_ps(_mm512_set1_ps(hi), v))
            }
        }
        #[inline(always)]
        fn scale_by(self, t: Self) -> Self {
            unsafe {
                let n = _mm512_sub_epi32(
                    _mm512_castps_si512(t.0),
                    _mm512_set1_epi32(MAGIC.to_bits() as i32),
                );
                let h = _mm512_srai_epi32::<1>(n);
                let bias = _mm512_set1_epi32(127);
                let a = _mm512_slli_epi32::<23>(_mm512_add_epi32(h, bias));
                let b = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_sub_epi32(n, h), bias));
                let y = _mm512_mul_ps(self.0, _mm512_castsi512_ps(a));
                V16(_mm512_mul_ps(y, _mm512_castsi512_ps(b)))
            }
        }
    }

    /// `f` over `x` in place, sixteen lanes at a time (the tail masked).
    ///
    /// # Safety
    /// AVX-512F must be available.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn map(x: &mut [f32], f: Kernel) {
        let apply = |v: V16| match f {
            Kernel::Exp => exp(v),
            Kernel::Gelu => gelu(v),
        };
        let mut chunks = x.chunks_exact_mut(16);
        for c in &mut chunks {
            // SAFETY: 16 floats read and written inside `c`.
            unsafe {
                let v = apply(V16(_mm512_loadu_ps(c.as_ptr())));
                _mm512_storeu_ps(c.as_mut_ptr(), v.0);
            }
        }
        let tail = chunks.into_remainder();
        if !tail.is_empty() {
            let m = ((1u32 << tail.len()) - 1) as __mmask16;
            // SAFETY: the mask covers the tail's `len() < 16` elements only.
            unsafe {
                let v = apply(V16(_mm512_maskz_loadu_ps(m, tail.as_ptr())));
                _mm512_mask_storeu_ps(tail.as_mut_ptr(), m, v.0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// PyTorch's formula in f64, in the sigmoid form (the tanh form cancels to 0 in f64 too
    /// for large negative x): the exact value to well below an f32 ulp.
    fn gelu_f64(x: f32) -> f64 {
        let x = x as f64;
        let beta = std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5;
        x / (1.0 + (-2.0 * beta * (x + 0.044715 * x * x * x)).exp())
    }

    /// PyTorch's float evaluation (libm's `tanhf`), which the old kernel was.
    fn gelu_pytorch(x: f32) -> f32 {
        const K_BETA: f32 =
            (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
        0.5 * x * (1.0 + (K_BETA * (x + 0.044715 * x * x * x)).tanh())
    }

    /// Inputs over every range the functions treat differently: a dense grid, every power of
    /// two's neighbourhood, the clamps, the specials.
    fn probe() -> Vec<f32> {
        let mut v: Vec<f32> = (-20_000..=20_000).map(|i| i as f32 * 0.005).collect();
        for e in -149..128 {
            let p = 2f32.powi(e);
            v.extend([p, -p, p * 1.1, -p * 1.7]);
        }
        v.extend([
            0.0,
            -0.0,
            88.72,
            88.73,
            89.0,
            -87.0,
            -103.0,
            -104.0,
            -105.0,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-45,
        ]);
        v
    }

    #[test]
    fn exp_is_within_an_ulp_and_rounds_edges() {
        for x in probe() {
            let got = exp_scalar(x);
            let want = (x as f64).exp();
            if x.is_nan() {
                assert!(got.is_nan());
                continue;
            }
            let w = want as f32;
            if w == 0.0 || w.is_infinite() || w < f32::MIN_POSITIVE {
                // subnormal, zero or overflow: the exact value rounded, within one subnormal step
                assert!(
                    (got as f64 - want).abs() <= 1.5e-45 || got == w,
                    "exp({x:e}) = {got:e}, exact {want:e}"
                );
                continue;
            }
            let ulp = (w.abs() as f64) * f32::EPSILON as f64;
            assert!(
                (got as f64 - want).abs() <= ulp,
                "exp({x:e}) = {got:e}, exact {want:e}"
            );
        }
        assert_eq!(exp_scalar(0.0), 1.0);
        assert_eq!(exp_scalar(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_scalar(f32::INFINITY), f32::INFINITY);
    }

    #[test]
    fn gelu_is_within_a_few_ulps_of_pytorchs_formula() {
        for x in probe() {
            let got = gelu_tanh_scalar(x);
            let want = gelu_f64(x);
            if want.is_nan() || want.is_infinite() {
                assert!(
                    got.is_nan() && want.is_nan() || got as f64 == want,
                    "gelu({x:e}) = {got:e}"
                );
                continue;
            }
            // 4 ulps, plus the rounding of u itself, which exp(-2u) scales by 2|u| (for
            // negative x, where the value is tiny); below 1e-37 (x < -10.6, where -2u passes 89
            // and exp is taken as inf) the result may be 0
            let u = 0.797_884_6 * (x as f64 + 0.044715 * (x as f64).powi(3));
            let ulps = 4.0 + 4.0 * u.abs().min(1e3);
            let tol = (want.abs() * ulps * f32::EPSILON as f64).max(1e-37);
            assert!(
                (got as f64 - want).abs() <= tol,
                "gelu({x:e}) = {got:e}, exact {want:e}"
            );
        }
        // PyTorch's own float evaluation is within 2 ulps of 1 (its `1 + tanh` rounds there)
        for x in probe().into_iter().filter(|x| x.abs() < 1e30) {
            let (a, b) = (gelu_tanh_scalar(x), gelu_pytorch(x));
            assert!(
                (a - b).abs() <= 2.0 * f32::EPSILON * x.abs().max(f32::MIN_POSITIVE),
                "gelu({x:e}) = {a:e}, PyTorch's float formula {b:e}"
            );
        }
        assert_eq!(gelu_tanh_scalar(0.0), 0.0);
        // x = 1: 0.5·(1 + tanh(0.8335600)) = 0.841192; the erf form would be 0.8413447
        assert!((gelu_tanh_scalar(1.0) - 0.841_192).abs() < 1e-6);
        assert!((gelu_tanh_scalar(-2.0) - (-0.045_402_4)).abs() < 1e-6);
        assert_eq!(gelu_tanh_scalar(f32::INFINITY), f32::INFINITY);
        assert!(
            gelu_tanh_scalar(f32::NEG_INFINITY).is_nan(),
            "as PyTorch: -inf · 0"
        );
    }

    /// The slice kernels (AVX-512 where this CPU has it, any length, any tail) give the scalar
    /// functions' bits.
    #[test]
    fn slices_give_the_scalar_bits() {
        let xs = probe();
        for len in [0, 1, 15, 16, 17, 33, xs.len()] {
            let mut g = xs[..len].to_vec();
            gelu_tanh(&mut g);
            let mut e = xs[..len].to_vec();
            exp_in_place(&mut e);
            for (i, &x) in xs[..len].iter().enumerate() {
                assert_eq!(g[i].to_bits(), gelu_tanh_scalar(x).to_bits(), "gelu({x:e})");
                assert_eq!(e[i].to_bits(), exp_scalar(x).to_bits(), "exp({x:e})");
            }
        }
        let mut big = vec![1.0f32; PAR_MIN + 3];
        gelu_tanh(&mut big);
        assert!(big.iter().all(|&y| y == gelu_tanh_scalar(1.0)));
    }
}
