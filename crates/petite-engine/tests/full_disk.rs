//! A disk that fills up during an engine build. Its own test binary (own process), because it
//! lowers RLIMIT_FSIZE for the whole process: writes past the limit fail with EFBIG exactly where
//! a full disk fails with ENOSPC (in `pwrite`, partway through an engine file).

use std::io::Write;

use petite_engine::reference::{ReferenceBuilder, ReferenceEngine};
use petite_engine::{BuildOptions, build_plan};
use petite_graph::{Builder, Dtype};
use petite_partition::{PartitionOptions, plan};
use petite_weights::{MappedSafetensors, SafetensorsWriter, TensorSpec};

#[test]
fn disk_full_midway_names_the_engine_keeps_finished_ones_and_removes_the_partial_one() {
    let dir = tempfile::tempdir().unwrap();
    // Engine 0 reads a 16 KiB weight, engine 1 a 1 MiB one.
    let mut b = Builder::new();
    let x = b.input("x", Dtype::F32, &[2, 64]).unwrap();
    let w0 = b.weight("w0", Dtype::F32, &[64, 64]).unwrap();
    let w1 = b.weight("w1", Dtype::F32, &[4096, 64]).unwrap();
    let h = b.linear(x, w0, None).unwrap();
    let h = b.tanh(h).unwrap();
    let y = b.linear(h, w1, None).unwrap();
    b.output("y", y).unwrap();
    let program = b.finish().unwrap();
    let path = dir.path().join("w.safetensors");
    let table = [
        TensorSpec::new("w0", Dtype::F32, &[64, 64]),
        TensorSpec::new("w1", Dtype::F32, &[4096, 64]),
    ];
    let w = SafetensorsWriter::create(&path, &table, &[]).unwrap();
    for t in &table {
        let n: usize = t.shape.iter().product();
        let mut s = w.tensor(&t.name).unwrap();
        s.write_all(&vec![0x3c; n * 4]).unwrap();
        s.finish().unwrap();
    }
    w.finish().unwrap();
    let pl = plan(&program, &PartitionOptions::new(1 << 20)).unwrap();
    assert_eq!(pl.engines.len(), 2);
    let src = MappedSafetensors::open(&path).unwrap();
    let out = dir.path().join("engines");

    // Every file may grow to 600 KiB: engine 0 (~20 KiB) fits, engine 1 (~1 MiB) does not.
    // SAFETY: no pointers but `&lim`, a live local. SIGXFSZ is ignored so the write returns EFBIG
    // instead of killing us; both settings are process-wide, and this test binary holds only
    // this test, so no other test's writes are limited.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let lim = libc::rlimit {
            rlim_cur: 600 * 1024,
            rlim_max: libc::RLIM_INFINITY,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
    let err = build_plan(
        &pl,
        &program,
        &src,
        &ReferenceBuilder::default(),
        &out,
        &BuildOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("engine 1 (engine_001)"), "{err}");
    assert!(err.to_lowercase().contains("file too large"), "{err}");
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    // The finished engine and its seal; nothing of the partial one.
    assert_eq!(
        names,
        vec![
            "engine_000.ref.safetensors".to_string(),
            "engine_000.ref.safetensors.seal".to_string()
        ]
    );
    ReferenceEngine::open(out.join(&names[0])).unwrap();
    petite_weights::seal::check(&out.join(&names[0])).unwrap();
}
