//! Streamed conversion: values, selection, layout, bad output paths, source untouched.

use std::io::Write;

use petite_weights::{
    ConvertOptions, Dtype, MappedSafetensors, SafetensorsWriter, Selection, TargetDtype,
    TensorSpec, WeightSource, convert, page_size,
};

fn f32s(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            match i % 97 {
                0 => f32::NAN,
                1 => f32::INFINITY,
                2 => -0.0,
                3 => f32::from_bits(1),               // smallest subnormal
                _ => f32::from_bits(x & 0xbfff_ffff), // finite, any magnitude
            }
        })
        .collect()
}

fn write_src(path: &std::path::Path) -> Vec<(TensorSpec, Vec<u8>)> {
    let big = page_size() * 20 + 5; // odd-sized, several chunks at the chunk size used below
    let specs = vec![
        (TensorSpec::new("enc.w", Dtype::F32, &[big]), 1),
        (TensorSpec::new("enc.b", Dtype::F32, &[7]), 2),
        (TensorSpec::new("lm_head.weight", Dtype::F32, &[64, 2]), 3),
        (TensorSpec::new("steps", Dtype::I64, &[3]), 4),
        (TensorSpec::new("already", Dtype::Bf16, &[9]), 5),
    ];
    let data: Vec<(TensorSpec, Vec<u8>)> = specs
        .into_iter()
        .map(|(t, seed)| {
            let n: usize = t.shape.iter().product();
            let bytes: Vec<u8> = match t.dtype {
                Dtype::F32 => f32s(n, seed).iter().flat_map(|x| x.to_le_bytes()).collect(),
                _ => (0..n * t.dtype.size())
                    .map(|i| (i as u8).wrapping_mul(37))
                    .collect(),
            };
            (t, bytes)
        })
        .collect();
    let table: Vec<TensorSpec> = data.iter().map(|(t, _)| t.clone()).collect();
    let w = SafetensorsWriter::create(path, &table, &[]).unwrap();
    for (t, b) in &data {
        let mut s = w.tensor(&t.name).unwrap();
        s.write_all(b).unwrap();
        s.finish().unwrap();
    }
    w.finish().unwrap();
    data
}

fn opts(dtype: TargetDtype, selection: Selection) -> ConvertOptions {
    ConvertOptions {
        dtype,
        selection,
        chunk_bytes: 4096, // many chunks, several per tensor, two threads racing
        threads: 2,
        progress: None,
        metadata: vec![],
        dtypes: Default::default(),
        seal: false,
    }
}

#[test]
fn f32_to_bf16_rounds_every_element_and_drops_what_was_asked() {
    let dir = tempfile::tempdir().unwrap();
    let src_p = dir.path().join("src.safetensors");
    let data = write_src(&src_p);
    let before = std::fs::read(&src_p).unwrap();
    let src = MappedSafetensors::open(&src_p).unwrap();
    let out = dir.path().join("out.safetensors");
    let rep = convert(
        &src,
        &out,
        &opts(TargetDtype::Bf16, Selection::Drop(vec!["lm_head.*".into()])),
    )
    .unwrap();
    assert_eq!(rep.dropped, vec!["lm_head.weight".to_string()]);
    assert_eq!(rep.tensors, 4);
    assert_eq!(std::fs::read(&src_p).unwrap(), before, "source untouched");
    let m = MappedSafetensors::open(&out).unwrap();
    assert_eq!(m.names(), vec!["already", "enc.b", "enc.w", "steps"]);
    for (t, bytes) in &data {
        if t.name == "lm_head.weight" {
            assert!(m.tensor(&t.name).is_err());
            continue;
        }
        let v = m.tensor(&t.name).unwrap();
        assert_eq!(v.shape, &t.shape[..]);
        match t.dtype {
            Dtype::F32 => {
                assert_eq!(v.dtype, Dtype::Bf16);
                let got = v.as_bf16().unwrap();
                for (k, (g, c)) in got.iter().zip(bytes.chunks_exact(4)).enumerate() {
                    let x = f32::from_le_bytes(c.try_into().unwrap());
                    assert_eq!(
                        g.to_bits(),
                        petite_dtype::bf16_bits(x),
                        "{} [{k}] = {x}",
                        t.name
                    );
                }
            }
            _ => {
                assert_eq!(v.dtype, t.dtype, "non-f32 dtypes keep theirs");
                assert_eq!(v.bytes, &bytes[..]);
            }
        }
        let r = m.file_range(&t.name).unwrap();
        if !r.is_empty() && r.len().is_multiple_of(page_size()) {
            assert_eq!(r.start % page_size(), 0, "{} starts on a page", t.name);
        }
        assert_eq!(
            r.start % v.dtype.size(),
            0,
            "{} aligned to its element",
            t.name
        );
    }
}

#[test]
fn f32_to_f16_matches_half() {
    let dir = tempfile::tempdir().unwrap();
    let src_p = dir.path().join("src.safetensors");
    let data = write_src(&src_p);
    let src = MappedSafetensors::open(&src_p).unwrap();
    let out = dir.path().join("out.safetensors");
    convert(
        &src,
        &out,
        &opts(
            TargetDtype::F16,
            Selection::Keep(vec!["enc.w".into(), "already".into()]),
        ),
    )
    .unwrap();
    let m = MappedSafetensors::open(&out).unwrap();
    assert_eq!(m.names(), vec!["already", "enc.w"]);
    let v = m.tensor("enc.w").unwrap();
    for (g, c) in v.as_f16().unwrap().iter().zip(data[0].1.chunks_exact(4)) {
        let x = f32::from_le_bytes(c.try_into().unwrap());
        let want = half::f16::from_f32(x);
        assert!(
            g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
            "{x}"
        );
    }
    // bf16 → f16 goes through f32 exactly once.
    let a = m.tensor("already").unwrap();
    for (g, c) in a.as_f16().unwrap().iter().zip(data[4].1.chunks_exact(2)) {
        let x = half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
        let want = half::f16::from_f32(x);
        assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()));
    }
}

#[test]
fn bad_outputs_fail_cleanly_and_leave_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let src_p = dir.path().join("src.safetensors");
    write_src(&src_p);
    let before = std::fs::read(&src_p).unwrap();
    let src = MappedSafetensors::open(&src_p).unwrap();
    // Unknown drop entry.
    let out = dir.path().join("out.safetensors");
    let e = convert(
        &src,
        &out,
        &opts(TargetDtype::Bf16, Selection::Drop(vec!["nope".into()])),
    )
    .unwrap_err();
    assert!(e.to_string().contains("`nope`"), "{e}");
    assert!(!out.exists());
    // The source itself as the output.
    let e = convert(&src, &src_p, &opts(TargetDtype::Bf16, Selection::All)).unwrap_err();
    assert!(e.to_string().contains("refusing to overwrite"), "{e}");
    // A directory that does not exist.
    let out = dir.path().join("no/such/dir/out.safetensors");
    assert!(convert(&src, &out, &opts(TargetDtype::Bf16, Selection::All)).is_err());
    assert_eq!(std::fs::read(&src_p).unwrap(), before, "source untouched");
}

/// Per-tensor target dtypes: an f32 tensor kept f32 is copied bit for bit (NaN payloads,
/// subnormals and all), a bf16 tensor widened to f32 is exact, the others follow `dtype`; a
/// non-float target is refused naming the tensor, and nothing is left under the output name.
#[test]
fn per_tensor_dtypes_keep_f32_bit_exact_and_widen_bf16_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let src_p = dir.path().join("src.safetensors");
    let data = write_src(&src_p);
    let src = MappedSafetensors::open(&src_p).unwrap();
    let out = dir.path().join("out.safetensors");
    let mut o = opts(TargetDtype::Bf16, Selection::All);
    o.dtypes.insert("enc.w".into(), Dtype::F32);
    o.dtypes.insert("already".into(), Dtype::F32);
    convert(&src, &out, &o).unwrap();
    let m = MappedSafetensors::open(&out).unwrap();
    let bytes_of = |n: &str| &data.iter().find(|(t, _)| t.name == n).unwrap().1;
    let w = m.tensor("enc.w").unwrap();
    assert_eq!(w.dtype, Dtype::F32);
    assert_eq!(w.bytes, &bytes_of("enc.w")[..], "f32 kept f32 is a copy");
    let a = m.tensor("already").unwrap();
    assert_eq!(a.dtype, Dtype::F32);
    let widened: Vec<u8> = bytes_of("already")
        .chunks_exact(2)
        .flat_map(|c| ((u16::from_le_bytes([c[0], c[1]]) as u32) << 16).to_le_bytes())
        .collect();
    assert_eq!(a.bytes, &widened[..], "bf16 → f32 is exact");
    assert_eq!(m.tensor("enc.b").unwrap().dtype, Dtype::Bf16);
    assert_eq!(m.tensor("steps").unwrap().dtype, Dtype::I64);

    let out2 = dir.path().join("bad.safetensors");
    let mut bad = opts(TargetDtype::Bf16, Selection::All);
    bad.dtypes.insert("enc.b".into(), Dtype::I64);
    let err = convert(&src, &out2, &bad).unwrap_err().to_string();
    assert!(
        err.contains("enc.b") && err.contains("not a float or quantized code dtype"),
        "{err}"
    );
    assert!(!out2.exists());
}

/// `seal_of` gives the seal `convert` writes, without the file: for a file hashed whole (small)
/// and for a sampled one (> 16 MiB; odd tensor sizes put sampled blocks across tensor edges
/// and mid-element), with mixed target dtypes and an integer tensor copied.
#[test]
fn seal_of_matches_the_seal_of_the_written_file() {
    let d = tempfile::tempdir().unwrap();
    for (case, big) in [("small", 1000usize), ("sampled", 9_000_001)] {
        let src = d.path().join(format!("{case}-src.safetensors"));
        let table = vec![
            TensorSpec::new("a", Dtype::F32, &[big]),
            TensorSpec::new("b", Dtype::F32, &[3, 333]),
            TensorSpec::new("c", Dtype::I64, &[5]),
            TensorSpec::new("d", Dtype::F32, &[big / 3 + 1]),
        ];
        let w = SafetensorsWriter::create(&src, &table, &[]).unwrap();
        for t in &table {
            let n: usize = t.shape.iter().product();
            let bytes: Vec<u8> = match t.dtype {
                Dtype::F32 => f32s(n, n as u32)
                    .iter()
                    .flat_map(|x| x.to_le_bytes())
                    .collect(),
                _ => (0..n * 8).map(|i| i as u8).collect(),
            };
            let mut s = w.tensor(&t.name).unwrap();
            s.write_all(&bytes).unwrap();
            s.finish().unwrap();
        }
        w.finish().unwrap();
        let m = MappedSafetensors::open(&src).unwrap();
        let out = d.path().join(format!("{case}-out.safetensors"));
        let opts = ConvertOptions {
            selection: Selection::Drop(vec!["b".into()]),
            dtypes: [("d".to_string(), Dtype::F32)].into_iter().collect(),
            metadata: vec![("k".into(), "v".into())],
            seal: true,
            ..ConvertOptions::default()
        };
        let planned = petite_weights::seal_of(&m, &out, &opts).unwrap();
        assert!(!out.exists(), "seal_of writes nothing");
        convert(&m, &out, &opts).unwrap();
        let written = std::fs::read_to_string(petite_weights::seal::sidecar(&out)).unwrap();
        assert_eq!(planned, written, "{case}");
        let len = std::fs::metadata(&out).unwrap().len();
        assert_eq!(len > petite_weights::seal::FULL_LIMIT, case == "sampled");
    }
}
