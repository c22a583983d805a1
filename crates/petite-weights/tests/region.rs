//! A safetensors file stored inside another file (an engine in a `.pte` segment) maps as a
//! region: the same tensors, bytes and errors as the file on its own.

use petite_weights::{
    Dtype, Error, MappedSafetensors, Role, SafetensorsWriter, TensorSpec, WeightSource,
};

fn write_st(path: &std::path::Path) -> Vec<u8> {
    let specs = [
        TensorSpec::new("a", Dtype::F32, &[3, 1000]),
        TensorSpec::new("b", Dtype::Bf16, &[7]),
    ];
    let w = SafetensorsWriter::create(path, &specs, &[("k".into(), "v".into())]).unwrap();
    let a: Vec<u8> = (0..3000u32)
        .flat_map(|i| (i as f32).to_le_bytes())
        .collect();
    w.write_at("a", 0, &a).unwrap();
    w.write_at("b", 0, &[1u8; 14]).unwrap();
    w.finish().unwrap();
    std::fs::read(path).unwrap()
}

#[test]
fn a_region_reads_like_the_whole_file() {
    let dir = tempfile::tempdir().unwrap();
    let st = write_st(&dir.path().join("e.safetensors"));
    // Offsets around and off page boundaries, as `.pte` segments may sit.
    for offset in [0usize, 1, 100, 4096, 4097, 12_345] {
        let outer = dir.path().join(format!("outer-{offset}.bin"));
        let mut bytes = vec![0xAAu8; offset];
        bytes.extend_from_slice(&st);
        bytes.extend_from_slice(&[0x55; 333]);
        std::fs::write(&outer, &bytes).unwrap();
        let m = MappedSafetensors::open_region(&outer, Role::File, offset as u64, st.len() as u64)
            .unwrap();
        let whole = MappedSafetensors::open(dir.path().join("e.safetensors")).unwrap();
        assert_eq!(m.names(), whole.names());
        for n in ["a", "b"] {
            let (x, y) = (m.tensor(n).unwrap(), whole.tensor(n).unwrap());
            assert_eq!(
                (x.dtype, x.shape, x.bytes),
                (y.dtype, y.shape, y.bytes),
                "{offset} {n}"
            );
            let r = m.file_range(n).unwrap();
            assert_eq!(&bytes[r.clone()], y.bytes, "file_range is the outer file's");
        }
        assert_eq!(m.header().metadata, whole.header().metadata);
        // Releasing and re-reading gives the same bytes (pages fault back in from the file).
        m.release(&["a", "b"]).unwrap();
        m.release_range("a", 0, 4000).unwrap();
        m.unmap_range("a", 10, 9000).unwrap();
        m.prefetch_range("a", 0, 12_000).unwrap();
        assert_eq!(
            m.tensor("a").unwrap().bytes,
            whole.tensor("a").unwrap().bytes
        );
        assert!(m.resident_bytes().unwrap() <= m.mapped_len() + 4096);
    }
}

#[test]
fn a_region_past_the_file_or_cut_short_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("e.safetensors");
    let st = write_st(&path);
    let n = st.len() as u64;
    let e = MappedSafetensors::open_region(&path, Role::File, 1, n).unwrap_err();
    assert!(matches!(e, Error::Truncated { .. }), "{e}");
    assert!(e.to_string().contains("runs past the end"), "{e}");
    let e = MappedSafetensors::open_region(&path, Role::File, 0, n - 1).unwrap_err();
    assert!(e.to_string().contains("bytes 0.."), "names the region: {e}");
    let e = MappedSafetensors::open_region(&path, Role::File, u64::MAX, 2).unwrap_err();
    assert!(matches!(e, Error::Truncated { .. }), "{e}");
}
