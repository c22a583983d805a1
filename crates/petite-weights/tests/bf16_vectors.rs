//! Bit-exact bf16 rounding against committed vectors produced by ml_dtypes' float32 → bfloat16
//! cast (round-to-nearest-even, the same rounding as PyTorch's `.to(torch.bfloat16)`), by
//! `xtask/src/conformance/weights_check.py vectors`. `cargo xtask conformance` regenerates them
//! and fails if they no longer match this file. ml_dtypes stands in for torch (a ~1 GB install).
//!
//! NaN is the one place the rules differ: ml_dtypes gives `0x7FC0` with the sign, petite (through
//! `half`) keeps the sign and the upper payload with the quiet bit set. Both are NaN, which is all
//! a weight's NaN means; for NaN inputs the check is NaN-ness and sign, bit-exact elsewhere.

use std::io::Write;

use petite_weights::{
    ConvertOptions, Dtype, MappedSafetensors, SafetensorsWriter, Selection, TargetDtype,
    TensorSpec, WeightSource, convert,
};

/// `(f32 bits, expected bf16 bits)` from the committed file.
fn vectors() -> Vec<(u32, u16)> {
    let raw = include_bytes!("data/bf16_vectors.bin");
    let n = u32::from_le_bytes(raw[..4].try_into().unwrap()) as usize;
    assert_eq!(raw.len(), 4 + 6 * n, "vector file framing");
    let xs = &raw[4..4 + 4 * n];
    let ys = &raw[4 + 4 * n..];
    (0..n)
        .map(|i| {
            (
                u32::from_le_bytes(xs[4 * i..4 * i + 4].try_into().unwrap()),
                u16::from_le_bytes(ys[2 * i..2 * i + 2].try_into().unwrap()),
            )
        })
        .collect()
}

/// petite's bf16 bits `got` for f32 bits `x` agree with ml_dtypes' `want` (see the module doc).
fn agrees(x: u32, got: u16, want: u16) -> bool {
    if f32::from_bits(x).is_nan() {
        let nan = |b: u16| b & 0x7fff > 0x7f80;
        nan(got) && nan(want) && got & 0x8000 == want & 0x8000
    } else {
        got == want
    }
}

#[test]
fn rounding_matches_ml_dtypes_bit_for_bit() {
    let v = vectors();
    assert!(v.len() > 40_000);
    let bad: Vec<_> = v
        .iter()
        .filter(|&&(x, y)| !agrees(x, petite_dtype::bf16_bits(f32::from_bits(x)), y))
        .take(5)
        .map(|&(x, y)| {
            format!(
                "{x:#010x} -> {:#06x}, want {y:#06x}",
                petite_dtype::bf16_bits(f32::from_bits(x))
            )
        })
        .collect();
    assert!(bad.is_empty(), "{bad:?}");
    let nans = v
        .iter()
        .filter(|(x, _)| f32::from_bits(*x).is_nan())
        .count();
    assert!(
        nans >= 5,
        "the vectors must hold NaN payloads, found {nans}"
    );
}

#[test]
fn streamed_conversion_matches_the_vectors() {
    let v = vectors();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("v.safetensors");
    let w = SafetensorsWriter::create(&src, &[TensorSpec::new("v", Dtype::F32, &[v.len()])], &[])
        .unwrap();
    let mut s = w.tensor("v").unwrap();
    for (x, _) in &v {
        s.write_all(&x.to_le_bytes()).unwrap();
    }
    s.finish().unwrap();
    w.finish().unwrap();
    let out = dir.path().join("o.safetensors");
    let opts = ConvertOptions {
        dtype: TargetDtype::Bf16,
        selection: Selection::All,
        chunk_bytes: 12_345, // odd chunk size: chunk edges fall mid-page
        threads: 2,
        progress: false,
        metadata: vec![],
        dtypes: Default::default(),
        seal: false,
    };
    convert(&MappedSafetensors::open(&src).unwrap(), &out, &opts).unwrap();
    let m = MappedSafetensors::open(&out).unwrap();
    let got = m.tensor("v").unwrap();
    let got = got.as_bf16().unwrap();
    for (g, (x, y)) in got.iter().zip(&v) {
        assert!(
            agrees(*x, g.to_bits(), *y),
            "{x:#010x} -> {:#06x}",
            g.to_bits()
        );
    }
}
