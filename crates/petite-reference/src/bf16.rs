//! The executor's whole-tensor bf16 rounding, over petite-dtype's one rule (round to nearest
//! even, NaN stays NaN): used when a program casts to bf16 and when a weight declared bf16 is
//! stored as f32 (how `--dtype bf16` runs from an f32 checkpoint).

use petite_dtype::round_through_bf16;

/// Rounds an f32 slice through bf16 in place.
pub fn round_slice_through_bf16(x: &mut [f32]) {
    for v in x {
        *v = round_through_bf16(*v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_every_element() {
        let mut r = [
            1.0f32,
            f32::from_bits(0x3f80_8001),
            -0.0,
            f32::NAN,
            f32::MAX,
        ];
        round_slice_through_bf16(&mut r);
        assert_eq!(
            r[..3].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            [0x3f80_0000, 0x3f81_0000, 0x8000_0000]
        );
        assert!(r[3].is_nan());
        assert_eq!(
            r[4],
            f32::INFINITY,
            "f32::MAX rounds past bf16's largest finite value"
        );
    }
}
