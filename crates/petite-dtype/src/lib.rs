#![doc = include_str!("../README.md")]
#![deny(missing_docs)]
#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};
use std::fmt;

pub mod quant;
pub use quant::Quant;

/// Element type of a tensor.
///
/// Byte layout (for constants, checkpoints and every consumer that stores tensors):
/// little-endian, row-major (C order); `Bf16` is the upper 16 bits of an IEEE f32, `F16` is IEEE
/// binary16, `Bool` is one byte that is 0 or 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    /// IEEE binary32.
    F32,
    /// bfloat16 (f32 with the mantissa truncated to 7 bits; conversions round to nearest even).
    Bf16,
    /// IEEE binary16.
    F16,
    /// Signed 64-bit integer.
    I64,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 8-bit integer.
    U8,
    /// Boolean, one byte (0 or 1).
    Bool,
    /// Signed 8-bit integer: a quantized weight's codes ([`quant::Quant::Int8`]), read only by
    /// dequantization.
    I8,
    /// FP8 E4M3 ("fn"): a quantized weight's codes ([`quant::Quant::Fp8E4M3`]), read only by
    /// dequantization.
    #[serde(rename = "f8e4m3")]
    F8E4M3,
}

impl Dtype {
    /// Every dtype, in declaration order.
    pub const ALL: [Dtype; 9] = [
        Dtype::F32,
        Dtype::Bf16,
        Dtype::F16,
        Dtype::I64,
        Dtype::I32,
        Dtype::U8,
        Dtype::Bool,
        Dtype::I8,
        Dtype::F8E4M3,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::I64 => 8,
            Dtype::U8 | Dtype::Bool | Dtype::I8 | Dtype::F8E4M3 => 1,
        }
    }

    /// True for f32, bf16 and f16 (the dtypes conversion rounds).
    pub fn is_float(self) -> bool {
        matches!(self, Dtype::F32 | Dtype::Bf16 | Dtype::F16)
    }

    /// True for i64, i32 and u8.
    pub fn is_int(self) -> bool {
        matches!(self, Dtype::I64 | Dtype::I32 | Dtype::U8)
    }

    /// True for floats and integers (not bool, not quantized codes): the dtypes arithmetic
    /// accepts.
    pub fn is_numeric(self) -> bool {
        self.is_float() || self.is_int()
    }

    /// True for i8 and f8e4m3: a quantized weight's codes, which only dequantization reads
    /// (no arithmetic, no conversion).
    pub fn is_quant_code(self) -> bool {
        matches!(self, Dtype::I8 | Dtype::F8E4M3)
    }

    /// The code dtype of a weight quantized to `q`.
    pub fn of_quant(q: quant::Quant) -> Dtype {
        match q {
            quant::Quant::Int8 => Dtype::I8,
            quant::Quant::Fp8E4M3 => Dtype::F8E4M3,
        }
    }

    /// The quantization whose codes this dtype holds.
    pub fn quant(self) -> Option<quant::Quant> {
        match self {
            Dtype::I8 => Some(quant::Quant::Int8),
            Dtype::F8E4M3 => Some(quant::Quant::Fp8E4M3),
            _ => None,
        }
    }

    /// Lower-case name as used in serialised programs and messages (`"bf16"`).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
            Dtype::I64 => "i64",
            Dtype::I32 => "i32",
            Dtype::U8 => "u8",
            Dtype::Bool => "bool",
            Dtype::I8 => "i8",
            Dtype::F8E4M3 => "f8e4m3",
        }
    }

    /// Parses the safetensors spelling; `None` for dtypes petite does not handle (F64, I16, ...).
    pub fn from_safetensors_name(s: &str) -> Option<Dtype> {
        Some(match s {
            "F32" => Dtype::F32,
            "BF16" => Dtype::Bf16,
            "F16" => Dtype::F16,
            "I64" => Dtype::I64,
            "I32" => Dtype::I32,
            "U8" => Dtype::U8,
            "BOOL" => Dtype::Bool,
            "I8" => Dtype::I8,
            "F8_E4M3" => Dtype::F8E4M3,
            _ => return None,
        })
    }

    /// The safetensors spelling (`"F32"`, `"BF16"`, ...).
    pub fn safetensors_name(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::Bf16 => "BF16",
            Dtype::F16 => "F16",
            Dtype::I64 => "I64",
            Dtype::I32 => "I32",
            Dtype::U8 => "U8",
            Dtype::Bool => "BOOL",
            Dtype::I8 => "I8",
            Dtype::F8E4M3 => "F8_E4M3",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// f32 → bf16 bits: round to nearest, ties to even; overflow rounds to infinity; a NaN stays a
/// NaN (sign and upper payload kept, quiet bit set). The only f32 → bf16 rounding in petite.
#[inline]
pub fn bf16_bits(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// f32 → bf16 (see [`bf16_bits`]).
#[inline]
pub fn to_bf16(x: f32) -> half::bf16 {
    half::bf16::from_f32(x)
}

/// bf16 bits → f32, by bits: exact (every bf16 is an f32), and a NaN keeps its sign and payload,
/// signalling ones included, so stored bytes survive a round trip. The only bf16 widening in
/// petite (`half`'s sets the quiet bit).
#[inline]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f16 bits → f32: exact for every number (`half`'s conversion; a NaN comes out quiet, with its
/// payload). The only f16 widening in petite.
#[inline]
pub fn f16_bits_to_f32(b: u16) -> f32 {
    half::f16::from_bits(b).to_f32()
}

/// f32 → f16 bits: round to nearest, ties to even (`half`). The only f32 → f16 rounding.
#[inline]
pub fn f16_bits(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// One stored little-endian float element of `dtype` (`b` holds at least its bytes) widened to
/// f32 by the rules above; `None` for a non-float dtype.
#[inline]
pub fn f32_from_le(dtype: Dtype, b: &[u8]) -> Option<f32> {
    Some(match dtype {
        Dtype::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        Dtype::Bf16 => bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]])),
        Dtype::F16 => f16_bits_to_f32(u16::from_le_bytes([b[0], b[1]])),
        _ => return None,
    })
}

/// Little-endian float elements of `dtype` widened to f32 (a trailing partial element is
/// ignored); `None` for a non-float dtype.
pub fn widen_le(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    if !dtype.is_float() {
        return None;
    }
    Some(
        bytes
            .chunks_exact(dtype.size())
            .map(|c| f32_from_le(dtype, c).unwrap_or(f32::NAN))
            .collect(),
    )
}

/// Appends `x` rounded to the float `dtype` (round to nearest even; f32 as is) to `out` as
/// little-endian bytes; returns false (nothing appended) for a non-float dtype.
#[inline]
pub fn push_le(dtype: Dtype, x: f32, out: &mut Vec<u8>) -> bool {
    match dtype {
        Dtype::F32 => out.extend_from_slice(&x.to_le_bytes()),
        Dtype::Bf16 => out.extend_from_slice(&bf16_bits(x).to_le_bytes()),
        Dtype::F16 => out.extend_from_slice(&f16_bits(x).to_le_bytes()),
        _ => return false,
    }
    true
}

/// Rounds an f32 through bf16 and back: the value a bf16 cast leaves in an f32 computation.
#[inline]
pub fn round_through_bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening_is_exact_and_keeps_bf16_nan_payloads() {
        // A signalling bf16 NaN (quiet bit clear, payload 1) keeps its bits.
        let snan = 0x7f81u16;
        assert_eq!(bf16_bits_to_f32(snan).to_bits(), 0x7f81_0000);
        assert_eq!(bf16_bits(bf16_bits_to_f32(0x3f80)), 0x3f80);
        for d in [Dtype::F32, Dtype::Bf16, Dtype::F16] {
            let mut b = Vec::new();
            for x in [1.5f32, -0.25, 1024.0, 0.0] {
                assert!(push_le(d, x, &mut b));
            }
            assert_eq!(widen_le(d, &b).unwrap(), [1.5, -0.25, 1024.0, 0.0], "{d}");
        }
        assert!(widen_le(Dtype::I64, &[0; 8]).is_none());
        assert!(!push_le(Dtype::U8, 1.0, &mut Vec::new()));
    }

    #[test]
    fn names_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_safetensors_name(d.safetensors_name()), Some(d));
            let json = serde_json::to_string(&d).unwrap();
            assert_eq!(json, format!("\"{}\"", d.name()));
            assert_eq!(serde_json::from_str::<Dtype>(&json).unwrap(), d);
            assert_eq!(
                d.quant().map(Dtype::of_quant),
                d.is_quant_code().then_some(d)
            );
        }
        assert_eq!(Dtype::from_safetensors_name("F64"), None);
    }

    #[test]
    fn bf16_rounding() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        assert_eq!(bf16_bits(-2.0), 0xc000);
        // Ties go to even, in both directions.
        assert_eq!(bf16_bits(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(bf16_bits(f32::from_bits(0x3f81_8000)), 0x3f82);
        // Above the midpoint rounds up; the largest finite values overflow to infinity.
        assert_eq!(bf16_bits(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(bf16_bits(f32::MAX), 0x7f80);
        assert_eq!(bf16_bits(f32::INFINITY), 0x7f80);
        assert_eq!(bf16_bits(f32::NEG_INFINITY), 0xff80);
        // Every NaN stays a NaN, never infinity, whatever its payload.
        for bits in [
            0x7f80_0001u32,
            0x7fc0_0000,
            0xff80_0001,
            0x7fff_ffff,
            0xffff_ffff,
        ] {
            let b = bf16_bits(f32::from_bits(bits));
            assert!(bf16_bits_to_f32(b).is_nan(), "{bits:#x} -> {b:#x}");
        }
        assert!(round_through_bf16(f32::NAN).is_nan());
        assert_eq!(round_through_bf16(1.0 + 1e-3), 1.0);
    }
}
