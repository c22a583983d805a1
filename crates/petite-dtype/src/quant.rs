//! Weight-only quantization: a weight's rows (output channels) stored as 8-bit codes with one f32
//! scale a row, symmetric (zero is code 0).
//!
//! Why per row: a linear layer's output channel `o` is `Σᵢ x[i]·w[o, i]`, so a row's scale
//! factors out of its sum and the runtime dequantizes (or folds the scale after the product)
//! exactly. Trained LLM weights have outlier channels; one scale for the whole tensor would spend
//! the 8 bits on them and round every other row to a few codes.
//!
//! The scale of a row is `amax / max` in f32 (`amax` the largest |w| of the row, `max` the
//! format's largest code: 127, or 448 for FP8 E4M3) rounded up to the next bf16 value, and `1`
//! for a row of zeros. Why bf16: a code (8 significant bits at most) times a bf16 scale (8) is
//! exact in f32, so a backend that dequantizes in bf16 (TensorRT's `DequantizeLinear` with a
//! bf16 scale, the only form its INT8 path builds with bf16 activations) rounds the same exact
//! product the reference executor does: every backend computes the same weight. Up, so the
//! largest |w| still maps into the codes' range (the loss: at most 2⁻⁸ of the range). A code is
//! `w / scale` in f32, clamped to `±max`, then rounded to nearest even (INT8: an integer; FP8: the
//! E4M3 "fn" encoding, no infinities, NaN `S.1111.111`). The clamp matters: `w / scale` can exceed
//! `max` by an ulp, and E4M3's conversions turn overflow into NaN. These are the rules numpy and
//! ml_dtypes compute with `np.clip(w / s, -max, max)` then `np.rint` or `.astype(float8_e4m3fn)`;
//! `crates/petite-dtype/tests/quant_vectors.rs` checks every rule against vectors they wrote.

use std::fmt;

/// Suffix of a quantized weight's scale tensor: weight `W`'s codes keep its name, its scales
/// (f32, one a row of axis 0) are `W.qscale`, in the mapping file and in programs alike.
pub const SCALE_SUFFIX: &str = ".qscale";

/// The name of weight `name`'s scale tensor ([`SCALE_SUFFIX`]).
pub fn scale_name(name: &str) -> String {
    format!("{name}{SCALE_SUFFIX}")
}

/// The weight whose scale tensor `name` would be (the inverse of [`scale_name`]): `None` for a
/// name without [`SCALE_SUFFIX`]. Whether that weight is quantized is the caller's question
/// (a program's codes, a converter's targets).
pub fn scaled_weight(name: &str) -> Option<&str> {
    name.strip_suffix(SCALE_SUFFIX).filter(|b| !b.is_empty())
}

/// An 8-bit weight format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Quant {
    /// Signed 8-bit integers, codes −127…127 (−128 unused, so the range is symmetric).
    Int8,
    /// FP8 E4M3 ("fn": finite, no infinities), magnitudes up to 448.
    Fp8E4M3,
}

/// A weight row holds a value that is not finite: index `.0` of the row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NonFinite(pub usize);

impl fmt::Display for NonFinite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "element {} of the row is not finite", self.0)
    }
}

impl std::error::Error for NonFinite {}

impl Quant {
    /// Every format.
    pub const ALL: [Quant; 2] = [Quant::Int8, Quant::Fp8E4M3];

    /// The name `--weights` takes (`"int8"`, `"fp8"`).
    pub fn name(self) -> &'static str {
        match self {
            Quant::Int8 => "int8",
            Quant::Fp8E4M3 => "fp8",
        }
    }

    /// The format named `s` (see [`Quant::name`]).
    pub fn parse(s: &str) -> Option<Quant> {
        Quant::ALL.into_iter().find(|q| q.name() == s)
    }

    /// The largest magnitude a code holds.
    pub fn max(self) -> f32 {
        match self {
            Quant::Int8 => 127.0,
            Quant::Fp8E4M3 => 448.0,
        }
    }

    /// A row's scale: [`Quant::scale_for`] its largest magnitude.
    pub fn row_scale(self, row: &[f32]) -> Result<f32, NonFinite> {
        let mut amax = 0f32;
        for (i, &w) in row.iter().enumerate() {
            if !w.is_finite() {
                return Err(NonFinite(i));
            }
            amax = amax.max(w.abs());
        }
        Ok(self.scale_for(amax))
    }

    /// The scale of a row (or tensor) whose largest magnitude is `amax` (finite, ≥ 0): `amax /
    /// max` rounded up to a bf16 value (the module's rules), `1` for `0`.
    pub fn scale_for(self, amax: f32) -> f32 {
        if amax == 0.0 {
            return 1.0;
        }
        let b = (amax / self.max()).to_bits();
        // Positive and finite: clearing the low 16 bits and stepping one bf16 ulp is the ceiling.
        f32::from_bits(if b & 0xFFFF == 0 { b } else { (b | 0xFFFF) + 1 })
    }

    /// The code of `w` under `scale` (an INT8 code as its two's-complement byte).
    #[inline]
    pub fn quantize(self, w: f32, scale: f32) -> u8 {
        let v = (w / scale).clamp(-self.max(), self.max());
        match self {
            Quant::Int8 => (v.round_ties_even() as i8) as u8,
            Quant::Fp8E4M3 => f8e4m3_bits(v),
        }
    }

    /// The value code `b` stands for under `scale`: `code · scale` in f32.
    #[inline]
    pub fn dequantize(self, b: u8, scale: f32) -> f32 {
        let code = match self {
            Quant::Int8 => b as i8 as f32,
            Quant::Fp8E4M3 => f8e4m3_bits_to_f32(b),
        };
        code * scale
    }

    /// Appends `row`'s codes to `out` and returns its scale: the whole of a row's quantization,
    /// one pass to find the scale and one to encode (a row is at most a few KiB, in cache).
    pub fn quantize_row(self, row: &[f32], out: &mut Vec<u8>) -> Result<f32, NonFinite> {
        let scale = self.row_scale(row)?;
        out.extend(row.iter().map(|&w| self.quantize(w, scale)));
        Ok(scale)
    }
}

impl fmt::Display for Quant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// f32 → FP8 E4M3 ("fn") bits: magnitudes of 448 and more (infinities too) saturate to ±448,
/// the rest round to nearest, ties to even (below 2⁻⁶ to a multiple of 2⁻⁹, the subnormals); NaN
/// is `0x7F` with x's sign.
pub fn f8e4m3_bits(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    if x.is_nan() {
        return sign | 0x7f;
    }
    let a = x.abs();
    if a >= 448.0 {
        return sign | 0x7e;
    }
    if a < 2f32.powi(-6) {
        // Subnormals (and the rounding up into the smallest normal, code 8): multiples of 2⁻⁹;
        // scaling by 2⁹ is exact.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127; // −6 ≤ exp ≤ 8
    let mant = bits & 0x7f_ffff;
    let (keep, rest) = (mant >> 20, mant & 0xf_ffff);
    let up = rest > 0x8_0000 || (rest == 0x8_0000 && keep & 1 == 1);
    // A carry out of the mantissa moves into the exponent, as the codes are ordered; the largest
    // value below 448 rounds at most to 448 (0x7e).
    let code = (((exp + 7) as u32) << 3) + keep + u32::from(up);
    sign | code as u8
}

/// FP8 E4M3 ("fn") bits → f32, exact; `0x7F`/`0xFF` are NaN.
pub fn f8e4m3_bits_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, mant) = (((b >> 3) & 0xf) as i32, (b & 7) as f32);
    if exp == 15 && b & 7 == 7 {
        return f32::NAN.copysign(sign);
    }
    let mag = if exp == 0 {
        mant * 2f32.powi(-9)
    } else {
        (1.0 + mant / 8.0) * 2f32.powi(exp - 7)
    };
    sign * mag
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_names_invert() {
        assert_eq!(scaled_weight(&scale_name("a.weight")), Some("a.weight"));
        assert_eq!(scaled_weight("a.weight"), None);
        assert_eq!(scaled_weight(SCALE_SUFFIX), None);
    }

    #[test]
    fn fp8_codes_round_trip_and_are_ordered() {
        let mut last = -1.0f32;
        for b in 0u8..0x7f {
            let v = f8e4m3_bits_to_f32(b);
            assert_eq!(f8e4m3_bits(v), b, "{b:#x}");
            assert_eq!(f8e4m3_bits(-v), b | 0x80, "{b:#x}");
            assert!(v > last, "{b:#x}");
            last = v;
        }
        assert_eq!(last, 448.0);
        assert!(f8e4m3_bits_to_f32(0x7f).is_nan());
        assert_eq!(f8e4m3_bits(1e9), 0x7e);
        assert_eq!(f8e4m3_bits(f32::NEG_INFINITY), 0xfe);
    }

    #[test]
    fn a_row_scales_to_its_largest_magnitude() {
        let row = [0.5, -2.54, 1.0, 0.0];
        for q in Quant::ALL {
            let mut codes = Vec::new();
            let s = q.quantize_row(&row, &mut codes).unwrap();
            assert_eq!(s, q.scale_for(2.54));
            assert_eq!(codes[3], 0);
            for (&w, &c) in row.iter().zip(&codes) {
                // Half a code's step at most (INT8: the step is the scale; FP8: 2⁻³ relative).
                let bound = match q {
                    Quant::Int8 => s / 2.0,
                    Quant::Fp8E4M3 => w.abs() / 16.0 + s * 2f32.powi(-10),
                };
                assert!((q.dequantize(c, s) - w).abs() <= bound * 1.0001, "{q} {w}");
            }
        }
        assert_eq!(Quant::Int8.row_scale(&[0.0; 3]), Ok(1.0));
        assert_eq!(Quant::Int8.scale_for(127.0), 1.0, "exact quotients stay");
        assert_eq!(Quant::Fp8E4M3.scale_for(448.0 * 3.0), 3.0);
    }

    /// A scale is the smallest bf16 value at or above `amax / max`: exact in bf16 (its low 16
    /// bits clear), never below the quotient, and one bf16 step below it is.
    #[test]
    fn scales_are_the_bf16_ceiling_of_the_quotient() {
        let mut x = 0x3c23_d70au32; // xorshift over f32 bit patterns of positive finite amax
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let amax = f32::from_bits(x & 0x7eff_ffff);
            if amax == 0.0 {
                continue;
            }
            for q in Quant::ALL {
                let s = q.scale_for(amax);
                let quotient = amax / q.max();
                assert_eq!(s.to_bits() & 0xffff, 0, "{amax:e} {q}: {s:e} not bf16");
                assert!(s >= quotient, "{amax:e} {q}: {s:e} < {quotient:e}");
                let below = f32::from_bits(s.to_bits() - 0x1_0000);
                assert!(below < quotient, "{amax:e} {q}: {below:e} would do");
                assert!(q.quantize(amax, s) == q.quantize(q.max(), 1.0) || amax / s < q.max());
            }
        }
        assert_eq!(
            Quant::Fp8E4M3.row_scale(&[1.0, f32::NAN]),
            Err(NonFinite(1))
        );
        assert_eq!(Quant::parse("fp8"), Some(Quant::Fp8E4M3));
        assert_eq!(Quant::parse("int4"), None);
    }
}
