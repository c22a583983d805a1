//! Residency: map a file, touch every page, release half the tensors. Own test binary, so no
//! other test maps files in this process meanwhile.

use std::io::Write;

use petite_weights::{
    Dtype, MappedSafetensors, SafetensorsWriter, TensorSpec, WeightSource, page_size, residency,
};

fn checksum(b: &[u8]) -> u64 {
    b.iter()
        .fold(0u64, |h, &x| h.wrapping_mul(1_099_511_628_211) ^ x as u64)
}

#[test]
fn release_drops_rss_by_the_released_tensors_and_they_still_read() {
    let page = page_size();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("r.safetensors");
    // Page-multiple tensors, odd-sized large ones (page-aligned start, ragged end) and small ones.
    let mut table = Vec::new();
    for i in 0..8 {
        table.push(TensorSpec::new(
            format!("big{i}"),
            Dtype::F32,
            &[256 * 1024 + i * 1024],
        ));
        table.push(TensorSpec::new(
            format!("odd{i}"),
            Dtype::Bf16,
            &[20 * page + 2 * i + 1],
        ));
        table.push(TensorSpec::new(format!("small{i}"), Dtype::F32, &[3 + i]));
    }
    let w = SafetensorsWriter::create(&p, &table, &[]).unwrap();
    for (k, t) in table.iter().enumerate() {
        let n: usize = t.shape.iter().product::<usize>() * t.dtype.size();
        let mut s = w.tensor(&t.name).unwrap();
        s.write_all(&(0..n).map(|j| (j * 31 + k) as u8).collect::<Vec<u8>>())
            .unwrap();
        s.finish().unwrap();
    }
    w.finish().unwrap();

    let m = MappedSafetensors::open(&p).unwrap();
    let names = m.names();
    let sums: Vec<u64> = names
        .iter()
        .map(|n| checksum(m.tensor(n).unwrap().bytes))
        .collect();
    let full = m.process_resident_bytes().expect("procfs");
    // Every page of the file is mapped in (header + all data); reading /proc itself touches none.
    let file_pages = m.mapped_len().div_ceil(page) as u64;
    assert_eq!(
        full,
        file_pages * page as u64,
        "all pages resident after touching"
    );
    let before_status = residency::rss().unwrap();

    let released: Vec<&str> = names.iter().map(String::as_str).step_by(2).collect();
    let expect: u64 = released
        .iter()
        .map(|n| m.file_range(n).unwrap().len() as u64)
        .sum();
    m.release(&released).unwrap();
    let after = m.process_resident_bytes().unwrap();
    let dropped = full - after;
    let slack = (released.len() * page) as u64;
    eprintln!("mapping RSS {full} → {after}: dropped {dropped}, released tensors hold {expect}");
    assert!(
        dropped <= expect && dropped + slack >= expect,
        "released {expect} bytes of tensors, mapping RSS dropped {dropped} (slack {slack})"
    );
    // The process-wide RssFile figure moves the same way (approximately: per-CPU counters).
    let after_status = residency::rss().unwrap();
    assert!(
        before_status.file - after_status.file + slack * 4 >= expect,
        "RssFile {} → {}",
        before_status.file,
        after_status.file
    );

    // Released tensors fault back in with the same bytes; kept ones were never dropped.
    for (n, s) in names.iter().zip(&sums) {
        assert_eq!(checksum(m.tensor(n).unwrap().bytes), *s, "{n}");
    }
    assert_eq!(m.process_resident_bytes().unwrap(), full);
}
