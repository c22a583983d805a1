//! Writer → mapping → views round trips, layout guarantees, and bad-input handling.

use std::io::Write;

use petite_weights::{
    Checkpoint, Dtype, Error, KeyMap, MappedSafetensors, Remapped, SafetensorsWriter, TensorSpec,
    WeightSource, page_size,
};
use proptest::prelude::*;

fn fill(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect()
}

/// Tensors the writer promises to start on a page boundary.
/// Sizes the writer guarantees a page-aligned start for (odd-sized large tensors only get one
/// when they come first after the page multiples).
fn paged(len: usize) -> bool {
    len > 0 && len.is_multiple_of(page_size())
}

fn nbytes(t: &TensorSpec) -> usize {
    t.shape.iter().product::<usize>() * t.dtype.size()
}

/// Writes `table` with deterministic contents through the sequential sink API.
fn write(path: &std::path::Path, table: &[TensorSpec]) -> Vec<Vec<u8>> {
    let w = SafetensorsWriter::create(path, table, &[("k".into(), "v".into())]).unwrap();
    let data: Vec<Vec<u8>> = table
        .iter()
        .enumerate()
        .map(|(i, t)| fill(nbytes(t), i as u64))
        .collect();
    for name in w.order() {
        let i = table.iter().position(|t| t.name == name).unwrap();
        let mut sink = w.tensor(name).unwrap();
        for chunk in data[i].chunks(1000) {
            sink.write_all(chunk).unwrap();
        }
        sink.finish().unwrap();
    }
    w.finish().unwrap();
    data
}

#[test]
fn layout_page_aligns_large_tensors_and_views_are_typed() {
    let page = page_size();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w.safetensors");
    let table = vec![
        TensorSpec::new("odd_big_a", Dtype::Bf16, &[30, page + 1]),
        TensorSpec::new("small_bf16", Dtype::Bf16, &[3]),
        TensorSpec::new("paged", Dtype::F32, &[page]),
        TensorSpec::new("odd_big_b", Dtype::F32, &[page + 3]),
        TensorSpec::new("small_f32", Dtype::F32, &[5]),
        TensorSpec::new("scalar_i64", Dtype::I64, &[]),
        TensorSpec::new("empty", Dtype::F16, &[0, 4]),
    ];
    let data = write(&p, &table);
    let m = MappedSafetensors::open(&p).unwrap();
    let mut names: Vec<String> = table.iter().map(|t| t.name.clone()).collect();
    names.sort();
    assert_eq!(m.names(), names);
    // The file holds exactly the caller's tensors: no filler keys a strict loader would reject.
    assert_eq!(m.header().entries.len(), table.len());
    assert_eq!(m.header().data_start % page, 0);
    assert_eq!(m.file_range("paged").unwrap().start % page, 0);
    for (t, d) in table.iter().zip(&data) {
        let v = m.tensor(&t.name).unwrap();
        assert_eq!(v.bytes, &d[..], "{}", t.name);
        assert_eq!(v.shape, &t.shape[..]);
        let r = m.file_range(&t.name).unwrap();
        if paged(r.len()) {
            assert_eq!(r.start % page, 0, "{} starts on a page", t.name);
        }
        assert_eq!(
            r.start % t.dtype.size(),
            0,
            "{} aligned to its element",
            t.name
        );
    }
    let f = m.tensor("small_f32").unwrap();
    let typed = f.as_f32().unwrap();
    assert_eq!(typed.to_vec(), f.to_f32_vec().unwrap());
    assert!(f.as_bf16().is_none());
    let b = m.tensor("small_bf16").unwrap();
    let widened = b.to_f32_vec().unwrap();
    for (x, y) in b.as_bf16().unwrap().iter().zip(&widened) {
        assert_eq!(x.to_f32().to_bits(), y.to_bits());
    }
    assert!(matches!(
        m.tensor("scalar_i64").unwrap().to_f32_vec(),
        Err(Error::WrongDtype { .. })
    ));
    let e = m.tensor("nope").unwrap_err().to_string();
    assert!(e.contains("w.safetensors") && e.contains("`nope`"), "{e}");
}

/// With one element size among the odd-sized tensors (a bf16 mapping file, an f32 checkpoint),
/// the first large odd-sized tensor follows the page multiples and so starts on a page too.
#[test]
fn first_odd_sized_large_tensor_starts_on_a_page() {
    let page = page_size();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w.safetensors");
    let table = vec![
        TensorSpec::new("small", Dtype::Bf16, &[7]),
        TensorSpec::new("patch", Dtype::Bf16, &[1152, 3, 14, 14]),
        TensorSpec::new("paged", Dtype::Bf16, &[page, 2]),
    ];
    write(&p, &table);
    let m = MappedSafetensors::open(&p).unwrap();
    assert_eq!(m.header().entries.len(), 3);
    assert_eq!(m.file_range("paged").unwrap().start % page, 0);
    assert_eq!(m.file_range("patch").unwrap().start % page, 0);
}

#[test]
fn positional_writes_from_threads() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w.safetensors");
    let table = vec![
        TensorSpec::new("a", Dtype::F32, &[100_000]),
        TensorSpec::new("b", Dtype::Bf16, &[77_777]),
    ];
    let w = SafetensorsWriter::create(&p, &table, &[]).unwrap();
    let data: Vec<Vec<u8>> = table.iter().map(|t| fill(nbytes(t), 9)).collect();
    std::thread::scope(|s| {
        for (t, d) in table.iter().zip(&data) {
            for (k, chunk) in d.chunks(4096 * 3).enumerate() {
                let w = &w;
                s.spawn(move || w.write_at(&t.name, (k * 4096 * 3) as u64, chunk).unwrap());
            }
        }
    });
    w.finish().unwrap();
    let m = MappedSafetensors::open(&p).unwrap();
    assert_eq!(m.tensor("a").unwrap().bytes, &data[0][..]);
    assert_eq!(m.tensor("b").unwrap().bytes, &data[1][..]);
}

#[test]
fn writer_checks_byte_counts_and_leaves_no_partial_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w.safetensors");
    let table = vec![TensorSpec::new("a", Dtype::F32, &[4])];
    let w = SafetensorsWriter::create(&p, &table, &[]).unwrap();
    let mut s = w.tensor("a").unwrap();
    s.write_all(&[0; 12]).unwrap();
    assert!(
        s.write_all(&[0; 8]).is_err(),
        "writing past the tensor fails"
    );
    let e = s.finish().unwrap_err().to_string();
    assert!(e.contains("`a`") && e.contains("12 of its 16"), "{e}");
    assert!(w.tensor("a").is_err(), "a tensor opens once");
    let e = w.finish().unwrap_err().to_string();
    assert!(e.contains("12 of its 16 bytes"), "{e}");
    assert!(!p.exists());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "temp file removed"
    );

    let dup = vec![
        TensorSpec::new("a", Dtype::F32, &[4]),
        TensorSpec::new("a", Dtype::F32, &[4]),
    ];
    assert!(matches!(
        SafetensorsWriter::create(&p, &dup, &[]),
        Err(Error::InvalidTable { .. })
    ));
    // A read-only directory: creation fails cleanly, nothing under the final name.
    let ro = dir.path().join("missing-dir").join("w.safetensors");
    assert!(matches!(
        SafetensorsWriter::create(&ro, &table, &[]),
        Err(Error::Io { .. })
    ));
    assert!(!ro.exists());
}

#[test]
fn truncated_file_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w.safetensors");
    write(&p, &[TensorSpec::new("a", Dtype::F32, &[4096])]);
    let len = std::fs::metadata(&p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(len - 10).unwrap();
    let e = MappedSafetensors::open(&p).unwrap_err().to_string();
    assert!(
        e.contains("w.safetensors") && e.contains("`a`") && e.contains("run past"),
        "{e}"
    );
    f.set_len(5).unwrap();
    let e = MappedSafetensors::open(&p).unwrap_err().to_string();
    assert!(e.contains("truncated"), "{e}");
}

#[test]
fn sharded_checkpoint_through_its_index() {
    let dir = tempfile::tempdir().unwrap();
    let d1 = write(
        &dir.path().join("s1.safetensors"),
        &[TensorSpec::new("x.a", Dtype::F32, &[3])],
    );
    let d2 = write(
        &dir.path().join("s2.safetensors"),
        &[
            TensorSpec::new("x.b", Dtype::Bf16, &[5]),
            TensorSpec::new("x.c", Dtype::I32, &[2]),
        ],
    );
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(
        &index,
        r#"{"metadata":{},"weight_map":{"x.a":"s1.safetensors","x.b":"s2.safetensors","x.c":"s2.safetensors"}}"#,
    )
    .unwrap();
    let c = Checkpoint::open(dir.path()).unwrap();
    assert_eq!(c.names(), vec!["x.a", "x.b", "x.c"]);
    assert_eq!(c.tensor("x.a").unwrap().bytes, &d1[0][..]);
    assert_eq!(c.tensor("x.c").unwrap().bytes, &d2[1][..]);
    c.release(&["x.a", "x.b"]).unwrap();
    assert_eq!(c.tensor("x.b").unwrap().bytes, &d2[0][..]);

    // Remapping: a missing prefix, and one tensor standing in for another.
    let map = KeyMap {
        prefixes: vec![("x.".into(), "model.x.".into())],
        aliases: vec![("model.tied".into(), "model.x.a".into())],
    };
    let r = Remapped::new(Checkpoint::open(&index).unwrap(), &map).unwrap();
    assert_eq!(
        r.names(),
        vec!["model.tied", "model.x.a", "model.x.b", "model.x.c"]
    );
    let v = r.tensor("model.tied").unwrap();
    assert_eq!(v.name, "model.tied");
    assert_eq!(v.bytes, &d1[0][..]);
    assert!(r.tensor("x.a").is_err());
    let bad = KeyMap {
        prefixes: vec![],
        aliases: vec![("t".into(), "absent".into())],
    };
    assert!(Remapped::new(Checkpoint::open(&index).unwrap(), &bad).is_err());

    // A missing shard, and a shard that lacks a tensor the index places in it.
    std::fs::write(
        &index,
        r#"{"weight_map":{"x.a":"s1.safetensors","x.z":"gone.safetensors"}}"#,
    )
    .unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(
        e.contains("gone.safetensors") && e.contains("x.z") && e.contains("missing"),
        "{e}"
    );
    std::fs::write(&index, r#"{"weight_map":{"x.q":"s1.safetensors"}}"#).unwrap();
    let e = Checkpoint::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("x.q") && e.contains("s1.safetensors"), "{e}");
}

fn dtype() -> impl Strategy<Value = Dtype> {
    prop_oneof![
        Just(Dtype::F32),
        Just(Dtype::Bf16),
        Just(Dtype::F16),
        Just(Dtype::I64),
        Just(Dtype::I32),
        Just(Dtype::U8),
        Just(Dtype::Bool),
    ]
}

fn table() -> impl Strategy<Value = Vec<TensorSpec>> {
    prop::collection::vec((dtype(), prop::collection::vec(0usize..70, 0..4)), 0..12).prop_map(
        |rows| {
            rows.into_iter()
                .enumerate()
                .map(|(i, (d, mut s))| {
                    // Some tensors large enough to exercise page alignment.
                    if i % 4 == 0 && !s.is_empty() {
                        s[0] *= 97;
                    }
                    TensorSpec::new(format!("t{i}.w"), d, &s)
                })
                .collect()
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    /// write → map → read equals input, for random tables.
    #[test]
    fn write_map_read_round_trip(table in table()) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("p.safetensors");
        let data = write(&p, &table);
        let m = MappedSafetensors::open(&p).unwrap();
        prop_assert_eq!(m.names().len(), table.len());
        prop_assert_eq!(m.header().entries.len(), table.len());
        for (t, d) in table.iter().zip(&data) {
            let v = m.tensor(&t.name).unwrap();
            prop_assert_eq!(v.dtype, t.dtype);
            prop_assert_eq!(v.shape, &t.shape[..]);
            prop_assert_eq!(v.bytes, &d[..]);
            let info = m.info(&t.name).unwrap();
            prop_assert_eq!(info.shape, t.shape.clone());
            let r = m.file_range(&t.name).unwrap();
            prop_assert_eq!(r.start % t.dtype.size(), 0);
            if paged(r.len()) {
                prop_assert_eq!(r.start % page_size(), 0);
            }
        }
    }
}
