//! Activations with PyTorch's exact formulas (f32).

use super::PAR_MIN;
use rayon::prelude::*;

/// `gelu(x, approximate="tanh")` as PyTorch evaluates it:
/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
#[inline]
pub fn gelu_tanh_scalar(x: f32) -> f32 {
    // PyTorch: kBeta = M_SQRT2 * M_2_SQRTPI * 0.5 (computed in double, then cast to float).
    const K_BETA: f32 = (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
    const K_KAPPA: f32 = 0.044715;
    let x_cube = x * x * x;
    let inner = K_BETA * (x + K_KAPPA * x_cube);
    0.5 * x * (1.0 + inner.tanh())
}

/// `silu(x) = x / (1 + exp(-x))`, PyTorch's formula.
#[inline]
pub fn silu_scalar(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn map_in_place(x: &mut [f32], f: fn(f32) -> f32) {
    if x.len() >= PAR_MIN {
        x.par_chunks_mut(PAR_MIN)
            .for_each(|c| c.iter_mut().for_each(|v| *v = f(*v)));
    } else {
        x.iter_mut().for_each(|v| *v = f(*v));
    }
}

/// gelu (tanh approximation) in place.
pub fn gelu_tanh(x: &mut [f32]) {
    map_in_place(x, gelu_tanh_scalar)
}

/// silu in place.
pub fn silu(x: &mut [f32]) {
    map_in_place(x, silu_scalar)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_hand_values() {
        assert_eq!(gelu_tanh_scalar(0.0), 0.0);
        // x = 1: inner = 0.7978845608·1.044715 = 0.8335600; tanh = 0.6823040; 0.5·1.6823040
        assert!((gelu_tanh_scalar(1.0) - 0.841_192).abs() < 1e-6);
        // x = -2: inner = -0.7978845608·(2 + 0.35772) = -1.8810799; tanh = -0.9545976
        assert!((gelu_tanh_scalar(-2.0) - (-0.045_402_4)).abs() < 1e-6);
        // the tanh form differs from erf-gelu (0.8413447 at 1): make sure it is the tanh one
        assert!((gelu_tanh_scalar(1.0) - 0.841_344_7).abs() > 1e-4);
        let mut v = vec![1.0f32; PAR_MIN + 3];
        gelu_tanh(&mut v);
        assert!(v.iter().all(|&y| y == gelu_tanh_scalar(1.0)));
    }

    #[test]
    fn silu_hand_values() {
        assert_eq!(silu_scalar(0.0), 0.0);
        // 1/(1+e^-1) = 0.7310586
        assert!((silu_scalar(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((silu_scalar(-1.0) - (-0.268_941_4)).abs() < 1e-6);
        let mut v = vec![2.0f32, -100.0];
        silu(&mut v);
        assert!((v[0] - 1.761_594_2).abs() < 1e-6);
        assert!(v[1].abs() < 1e-30);
    }
}
