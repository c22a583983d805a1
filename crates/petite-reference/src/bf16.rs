//! bf16 rounding exactly as PyTorch's `c10::BFloat16` does it: round to nearest, ties to even,
//! every NaN becomes the canonical quiet NaN `0x7FC0`. Used wherever a program casts to bf16 and
//! when a weight declared bf16 is stored as f32 (how `--dtype bf16` runs from an f32 checkpoint).

use half::bf16;

/// Rounds an f32 to bf16 bits (round to nearest even; NaN → `0x7FC0`, like PyTorch).
#[inline]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7FC0;
    }
    let bits = x.to_bits();
    let lsb = (bits >> 16) & 1;
    // Adding 0x7FFF + lsb carries into the upper half exactly when the lower half is above the
    // midpoint, or at the midpoint with an odd upper half (ties to even). Overflow rounds to inf.
    (bits.wrapping_add(0x7FFF + lsb) >> 16) as u16
}

/// Rounds an f32 to bf16 (see [`f32_to_bf16_bits`]).
#[inline]
pub fn f32_to_bf16(x: f32) -> bf16 {
    bf16::from_bits(f32_to_bf16_bits(x))
}

/// Rounds an f32 through bf16 and back: the value a bf16 cast leaves in an f32 computation.
#[inline]
pub fn round_f32_through_bf16(x: f32) -> f32 {
    f32::from_bits((f32_to_bf16_bits(x) as u32) << 16)
}

/// Widens bf16 bits to f32 (exact).
#[inline]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Rounds every element of `src` into `dst` (same length).
pub fn f32_slice_to_bf16(src: &[f32], dst: &mut [bf16]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f32_to_bf16(s);
    }
}

/// Widens every element of `src` into `dst` (same length).
pub fn bf16_slice_to_f32(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16_bits_to_f32(s.to_bits());
    }
}

/// Rounds an f32 slice through bf16 in place.
pub fn round_slice_through_bf16(x: &mut [f32]) {
    for v in x {
        *v = round_f32_through_bf16(*v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rne_hand_picked_bit_patterns() {
        let cases: &[(u32, u16)] = &[
            (0x3F80_0000, 0x3F80), // 1.0 exact
            (0x3F80_8000, 0x3F80), // tie, even upper half stays
            (0x3F81_8000, 0x3F82), // tie, odd upper half rounds up to even
            (0x3F80_8001, 0x3F81), // just above the tie rounds up
            (0x3F80_7FFF, 0x3F80), // just below the tie rounds down
            (0xBF81_8000, 0xBF82), // negative tie, odd → away to even
            (0x7F7F_FFFF, 0x7F80), // f32::MAX rounds to +inf
            (0x7F80_0000, 0x7F80), // +inf stays
            (0xFF80_0000, 0xFF80), // -inf stays
            (0x0000_8000, 0x0000), // subnormal tie to even (zero)
            (0x0001_8000, 0x0002), // subnormal tie, odd → up
            (0x8000_0000, 0x8000), // -0 keeps its sign
            (0x7FC0_0000, 0x7FC0), // quiet NaN
            (0x7F80_0001, 0x7FC0), // signalling NaN whose payload would round away → canonical
            (0xFFFF_FFFF, 0x7FC0), // negative NaN with full payload → canonical
        ];
        for &(x, want) in cases {
            let got = f32_to_bf16_bits(f32::from_bits(x));
            assert_eq!(
                got, want,
                "f32 bits {x:#010x}: got {got:#06x}, want {want:#06x}"
            );
        }
    }

    #[test]
    fn agrees_with_half_on_finite_values() {
        // `half` also rounds to nearest even; they differ only in NaN payloads.
        let mut x = 0x0012_3457u32;
        for _ in 0..100_000 {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let f = f32::from_bits(x);
            if f.is_nan() {
                continue;
            }
            assert_eq!(
                f32_to_bf16_bits(f),
                half::bf16::from_f32(f).to_bits(),
                "{x:#x}"
            );
        }
    }

    #[test]
    fn round_trip_is_idempotent() {
        for &v in &[0.1f32, -3.7, 1e-30, 65504.0, 3.0e38] {
            let r = round_f32_through_bf16(v);
            assert_eq!(round_f32_through_bf16(r).to_bits(), r.to_bits());
        }
    }
}
