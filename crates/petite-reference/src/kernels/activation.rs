//! SiLU with PyTorch's exact formula (f32, libm's `exp`: the timestep table exported into
//! `step.pte` is computed with it, so it stays as it is). The tanh GELU is in `vmath`.

use super::PAR_MIN;
use rayon::prelude::*;

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

/// silu in place.
pub fn silu(x: &mut [f32]) {
    map_in_place(x, silu_scalar)
}

#[cfg(test)]
mod tests {
    use super::*;

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
