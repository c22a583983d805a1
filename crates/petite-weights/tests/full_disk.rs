//! A disk that fills up mid-conversion. Its own test binary (own process), because it lowers
//! RLIMIT_FSIZE for the whole process: writes past the limit then fail with EFBIG, exactly where a
//! full disk fails with ENOSPC (in `pwrite`, partway through the output).

use std::io::Write;

use petite_weights::{
    ConvertOptions, Dtype, MappedSafetensors, SafetensorsWriter, Selection, TargetDtype,
    TensorSpec, convert,
};

#[test]
fn output_disk_full_midway_fails_cleanly_and_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let src_p = dir.path().join("src.safetensors");
    let table = vec![
        TensorSpec::new("a", Dtype::F32, &[64 * 1024]),
        TensorSpec::new("b", Dtype::F32, &[64 * 1024]),
    ];
    let w = SafetensorsWriter::create(&src_p, &table, &[]).unwrap();
    for t in &table {
        let mut s = w.tensor(&t.name).unwrap();
        s.write_all(&vec![0x3f; 256 * 1024]).unwrap();
        s.finish().unwrap();
    }
    w.finish().unwrap();
    let before = std::fs::read(&src_p).unwrap();
    let src = MappedSafetensors::open(&src_p).unwrap();

    // The output would be ~260 KiB; allow 150 KiB: the header and part of the data fit.
    // SAFETY: no pointers but `&lim`, a live local. SIGXFSZ is ignored so the write returns EFBIG
    // instead of killing us; both settings are process-wide, and this test binary holds only
    // this test, so no other test's writes are limited.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let lim = libc::rlimit {
            rlim_cur: 150 * 1024,
            rlim_max: libc::RLIM_INFINITY,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
    let out = dir.path().join("out.safetensors");
    let opts = ConvertOptions {
        dtype: TargetDtype::Bf16,
        selection: Selection::All,
        chunk_bytes: 16 * 1024,
        threads: 2,
        progress: false,
        metadata: vec![],
        dtypes: Default::default(),
        seal: false,
    };
    let e = convert(&src, &out, &opts).unwrap_err().to_string();
    assert!(e.contains("out.safetensors") && e.contains("write"), "{e}");
    assert!(!out.exists(), "nothing under the final name");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        left,
        vec![std::ffi::OsString::from("src.safetensors")],
        "temp file removed"
    );
    assert_eq!(std::fs::read(&src_p).unwrap(), before, "source untouched");
}
