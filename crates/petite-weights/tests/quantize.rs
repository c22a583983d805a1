//! Quantizing conversion (issue 51): a float weight given a code dtype is written as its codes
//! plus `NAME.qscale`, row by row while streaming; bytes equal petite-dtype's rule applied to
//! each row; the planned seal matches; a copy of a quantized file stays the same; a non-finite
//! row is refused naming tensor and row, and nothing is left under the output name.

use std::io::Write;

use petite_dtype::quant::{Quant, scale_name};
use petite_weights::{
    ConvertOptions, Dtype, MappedSafetensors, SafetensorsWriter, Selection, TensorSpec,
    WeightSource, convert, seal_of,
};

/// Rows of different magnitudes (one outlier row), odd row length, bf16 and f32 sources.
fn write_src(path: &std::path::Path, rows: usize, row: usize, poison: bool) {
    let table = vec![
        TensorSpec::new("w", Dtype::F32, &[rows, row]),
        TensorSpec::new("v", Dtype::Bf16, &[rows / 2 + 1, row]),
        TensorSpec::new("norm", Dtype::F32, &[row]),
    ];
    let w = SafetensorsWriter::create(path, &table, &[]).unwrap();
    let val = |r: usize, c: usize| -> f32 {
        let x = ((r * 31 + c * 17) % 101) as f32 / 50.0 - 1.0;
        if r == 3 {
            x * 300.0
        } else {
            x * (1.0 + r as f32 / 7.0)
        }
    };
    for t in &table {
        let (n, m) = (t.shape[0], t.shape.get(1).copied().unwrap_or(1));
        let mut bytes = Vec::new();
        for r in 0..n {
            for c in 0..m {
                let mut x = val(r, c);
                if poison && t.name == "w" && r == 5 && c == 2 {
                    x = f32::NAN;
                }
                match t.dtype {
                    Dtype::F32 => bytes.extend_from_slice(&x.to_le_bytes()),
                    _ => bytes.extend_from_slice(&petite_dtype::bf16_bits(x).to_le_bytes()),
                }
            }
        }
        let mut s = w.tensor(&t.name).unwrap();
        s.write_all(&bytes).unwrap();
        s.finish().unwrap();
    }
    w.finish().unwrap();
}

fn opts(chunk: usize, q: Quant) -> ConvertOptions {
    let d = Dtype::of_quant(q);
    ConvertOptions {
        selection: Selection::All,
        chunk_bytes: chunk,
        dtypes: [("w".to_string(), d), ("v".to_string(), d)]
            .into_iter()
            .collect(),
        seal: true,
        ..ConvertOptions::default()
    }
}

#[test]
fn codes_and_scales_follow_the_row_rule() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.safetensors");
    let (rows, row) = (40, 333);
    write_src(&src, rows, row, false);
    let m = MappedSafetensors::open(&src).unwrap();
    for q in Quant::ALL {
        // Chunks smaller than a row, of a few rows, and larger than the tensor.
        for chunk in [100, 4 * row * 4 + 3, 1 << 20] {
            let out = d.path().join(format!("{q}-{chunk}.safetensors"));
            let o = opts(chunk, q);
            let planned = seal_of(&m, &out, &o).unwrap();
            convert(&m, &out, &o).unwrap();
            let written = std::fs::read_to_string(petite_weights::seal::sidecar(&out)).unwrap();
            assert_eq!(
                planned, written,
                "{q} chunk {chunk}: seal_of plans the written bytes"
            );
            let o_m = MappedSafetensors::open(&out).unwrap();
            for name in ["w", "v"] {
                let srcv = m.tensor(name).unwrap();
                let codes = o_m.tensor(name).unwrap();
                let scales = o_m.tensor(&scale_name(name)).unwrap();
                assert_eq!(codes.dtype, Dtype::of_quant(q));
                assert_eq!(codes.shape, srcv.shape);
                assert_eq!((scales.dtype, scales.shape), (Dtype::F32, &srcv.shape[..1]));
                let es = srcv.dtype.size();
                for r in 0..srcv.shape[0] {
                    let wide: Vec<f32> = srcv.bytes[r * row * es..(r + 1) * row * es]
                        .chunks_exact(es)
                        .map(|c| petite_dtype::f32_from_le(srcv.dtype, c).unwrap())
                        .collect();
                    let mut want = Vec::new();
                    let s = q.quantize_row(&wide, &mut want).unwrap();
                    assert_eq!(
                        &codes.bytes[r * row..(r + 1) * row],
                        &want[..],
                        "{name} row {r}"
                    );
                    assert_eq!(
                        scales.bytes[r * 4..r * 4 + 4],
                        s.to_le_bytes(),
                        "{name} {r}"
                    );
                }
            }
            // The norm stays a float (bf16, the default target).
            assert_eq!(o_m.tensor("norm").unwrap().dtype, Dtype::Bf16);
            // Converting the quantized file again copies codes and scales: same bytes, same seal.
            let again = d.path().join(format!("{q}-{chunk}-again.safetensors"));
            // (The scales are not selected: they go with their weight.)
            let o2 = ConvertOptions {
                selection: Selection::Keep(vec!["w".into(), "v".into(), "norm".into()]),
                ..o.clone()
            };
            assert_eq!(seal_of(&o_m, &again, &o2).unwrap(), planned);
            convert(&o_m, &again, &o2).unwrap();
            assert_eq!(std::fs::read(&again).unwrap(), std::fs::read(&out).unwrap());
        }
    }
}

#[test]
fn a_non_finite_row_is_refused_naming_tensor_and_row() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.safetensors");
    write_src(&src, 12, 9, true);
    let m = MappedSafetensors::open(&src).unwrap();
    let out = d.path().join("out.safetensors");
    let e = convert(&m, &out, &opts(64, Quant::Int8))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`w` row 5") && e.contains("int8") && e.contains("not finite"),
        "{e}"
    );
    assert!(!out.exists());
    let e = seal_of(&m, &out, &opts(64, Quant::Fp8E4M3))
        .unwrap_err()
        .to_string();
    assert!(e.contains("`w` row 5") && e.contains("fp8"), "{e}");
}

/// A source that happens to hold a tensor named like a quantized weight's scales: the scales
/// written are the ones computed from the weight's rows, never that tensor's values.
#[test]
fn scales_are_computed_even_where_the_source_has_a_tensor_of_their_name() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.safetensors");
    let table = vec![
        TensorSpec::new("w", Dtype::F32, &[4, 8]),
        TensorSpec::new(scale_name("w"), Dtype::F32, &[4]),
    ];
    let w = SafetensorsWriter::create(&src, &table, &[]).unwrap();
    let values: Vec<f32> = (0..32).map(|i| i as f32 / 8.0 - 2.0).collect();
    for (t, v) in table.iter().zip([values.clone(), vec![999.0; 4]]) {
        let mut s = w.tensor(&t.name).unwrap();
        let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        s.write_all(&b).unwrap();
        s.finish().unwrap();
    }
    w.finish().unwrap();
    let m = MappedSafetensors::open(&src).unwrap();
    let out = d.path().join("out.safetensors");
    let o = ConvertOptions {
        selection: Selection::Keep(vec!["w".into()]),
        dtypes: [("w".to_string(), Dtype::I8)].into_iter().collect(),
        ..ConvertOptions::default()
    };
    convert(&m, &out, &o).unwrap();
    let got = MappedSafetensors::open(&out).unwrap();
    let s = got.tensor(&scale_name("w")).unwrap();
    for (r, row) in values.chunks(8).enumerate() {
        let want = Quant::Int8.row_scale(row).unwrap();
        assert_eq!(s.bytes[r * 4..r * 4 + 4], want.to_le_bytes(), "row {r}");
    }
}
