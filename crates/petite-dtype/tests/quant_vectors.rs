//! petite_dtype::quant against vectors numpy and ml_dtypes wrote
//! (`xtask/src/conformance/weights_check.py quant-vectors`; the weights conformance tier
//! regenerates them and fails if they differ from this committed file): FP8 E4M3 encoding of
//! 42k values (delicate bit patterns, FP8's whole range, ties of both parities, saturation),
//! every code's value, and the per-row INT8 and FP8 quantization of rows with outlier channels,
//! a zero row, FP8-subnormal magnitudes and exact INT8 ties — scales and codes bit for bit.

use petite_dtype::Quant;
use petite_dtype::quant::{f8e4m3_bits, f8e4m3_bits_to_f32};

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        assert!(self.0.len() >= n, "the vectors file ends early");
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        a
    }
    fn u32(&mut self) -> usize {
        u32::from_le_bytes(self.take(4).try_into().unwrap()) as usize
    }
    fn f32s(&mut self, n: usize) -> Vec<f32> {
        self.take(4 * n)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
}

#[test]
fn quantization_matches_numpy_and_ml_dtypes_bit_for_bit() {
    let mut r = Reader(include_bytes!("data/quant_vectors.bin"));
    let n = r.u32();
    let xs = r.f32s(n);
    let want = r.take(n).to_vec();
    let mut nans = 0;
    for (&x, &w) in xs.iter().zip(&want) {
        let got = f8e4m3_bits(x);
        if x.is_nan() {
            // NaN stays NaN (ml_dtypes writes its own NaN code).
            assert!(f8e4m3_bits_to_f32(got).is_nan() && f8e4m3_bits_to_f32(w).is_nan());
            nans += 1;
        } else {
            assert_eq!(got, w, "{x:e} ({:#010x})", x.to_bits());
        }
    }
    assert!(n > 40_000 && nans > 0);

    let values = r.f32s(256);
    for (b, &v) in values.iter().enumerate() {
        let got = f8e4m3_bits_to_f32(b as u8);
        assert!(
            got.to_bits() == v.to_bits() || (got.is_nan() && v.is_nan()),
            "code {b:#04x}: {got} against {v}"
        );
    }

    let (rows, cols) = (r.u32(), r.u32());
    let data = r.f32s(rows * cols);
    for q in [Quant::Int8, Quant::Fp8E4M3] {
        let scales = r.f32s(rows);
        let codes = r.take(rows * cols).to_vec();
        for (i, row) in data.chunks_exact(cols).enumerate() {
            let mut got = Vec::new();
            let s = q.quantize_row(row, &mut got).unwrap();
            assert_eq!(s.to_bits(), scales[i].to_bits(), "{q} row {i}: scale");
            assert_eq!(got, codes[i * cols..][..cols], "{q} row {i}: codes");
        }
    }
    assert!(r.0.is_empty(), "the vectors file is longer than read");
}
