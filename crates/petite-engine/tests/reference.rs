//! Reference backend: building every planned engine and running them in order from their files
//! equals the unpartitioned reference run, bit for bit; weights are released after their last
//! engine; bad input fails with an error naming the engine and leaves finished engines valid.
mod common;

use std::collections::BTreeMap;
use std::sync::Mutex;

use common::*;
use petite_engine::reference::{ReferenceBuilder, ReferenceEngine};
use petite_engine::{BuildOptions, EngineReport, build_plan};
use petite_partition::{PartitionOptions, plan};
use petite_pi05::{
    Pi05Config, Precision, PrefixOptions, build_all, build_prefix_with, programs::io,
};
use petite_reference::{Executor, Tensor};
use petite_weights::{MappedSafetensors, TensorInfo, TensorView, WeightSource};

/// Step inputs from a prefix run: its K/V and pad mask, a noise x_t and row 0 of the table.
fn step_inputs(
    cfg: &Pi05Config,
    prefix_out: &BTreeMap<String, Tensor>,
    table: &Tensor,
) -> BTreeMap<String, Tensor> {
    let mut m = prefix_out.clone();
    let x: Vec<f32> = (0..cfg.chunk * cfg.action_dim)
        .map(|i| ((i * 11 % 17) as f32 - 8.0) / 8.0)
        .collect();
    m.insert(
        io::X_T.into(),
        Tensor::f32(&[cfg.chunk, cfg.action_dim], x).unwrap(),
    );
    let t = table.float_values().unwrap();
    let r = table.shape()[1];
    m.insert(
        io::TIME_ROW.into(),
        Tensor::f32(&[r], t[..r].to_vec()).unwrap(),
    );
    // Real-time chunking's guidance, not zero, so its operations are exercised too.
    let rows = cfg.chunk - 1;
    let g = petite_pi05::rtc::Guidance::new(
        cfg,
        &petite_pi05::rtc::Rtc {
            prev_chunk_left_over: (0..rows * 3).map(|i| (i % 5) as f32 * 0.25).collect(),
            rows,
            cols: 3,
            inference_delay: 1,
            execution_horizon: rows,
            schedule: petite_pi05::rtc::Schedule::Linear,
            max_guidance_weight: 10.0,
        },
    )
    .unwrap();
    for (n, t) in g.step_tensors(cfg, 1).unwrap() {
        m.insert(n.into(), t);
    }
    m
}

#[test]
fn engines_run_from_files_equal_the_whole_program_bit_for_bit() {
    let cfg = Pi05Config::small();
    let dir = tempfile::tempdir().unwrap();
    let ck = small_checkpoint(&cfg, dir.path());
    let src = MappedSafetensors::open(&ck).unwrap();
    for prec in [Precision::F32, Precision::Bf16] {
        let progs = build_all(&cfg, prec).unwrap();
        let table = Executor::new(&progs.timestep_table, &src)
            .unwrap()
            .run(BTreeMap::new())
            .unwrap()
            .remove(io::TIMESTEP_TABLE)
            .unwrap();
        let pin = prefix_inputs(&cfg);
        let whole_prefix = petite_reference::run(&progs.prefix, &src, pin.clone()).unwrap();
        let sin = step_inputs(&cfg, &whole_prefix, &table);
        let whole_step = petite_reference::run(&progs.step, &src, sin.clone()).unwrap();
        for (what, program, inputs, whole) in [
            ("prefix", &progs.prefix, &pin, &whole_prefix),
            ("step", &progs.step, &sin, &whole_step),
        ] {
            for div in [3u64, 8] {
                let cap = program.weight_bytes() as u64 / div;
                let pl = plan(program, &PartitionOptions::new(cap)).unwrap();
                assert!(pl.engines.len() > 1, "{what} {prec:?}: one engine only");
                let out = dir.path().join(format!("{what}-{prec:?}-{div}"));
                let rep = build_plan(
                    &pl,
                    program,
                    &src,
                    &ReferenceBuilder::default(),
                    &out,
                    &BuildOptions::default(),
                )
                .unwrap();
                assert_eq!(rep.engines.len(), pl.engines.len());
                for (e, r) in rep.engines.iter().zip(&rep.reports) {
                    let len = std::fs::metadata(&e.file).unwrap().len();
                    assert_eq!(len, e.file_bytes);
                    assert_eq!((e.payload.offset, e.payload.len), (0, len));
                    assert_eq!(r.file_bytes, len);
                    assert!(r.seconds >= 0.0);
                    assert!(r.peak_rss.is_some_and(|p| p > 0));
                    // Weights are stored in the declared dtype, page-aligned where page-sized.
                    let f = ReferenceEngine::open(&e.file).unwrap();
                    for w in f.program().weights() {
                        let info = f.file().info(&w.name).unwrap();
                        assert_eq!(info.shape, w.shape);
                        let range = f.file().file_range(&w.name).unwrap();
                        if w.bytes % petite_weights::page_size() == 0 {
                            assert_eq!(range.start % petite_weights::page_size(), 0);
                        }
                    }
                }
                let got = run_built(program, &rep.engines, inputs);
                assert_bit_equal(&format!("{what} {prec:?} cap/{div}"), whole, &got);
            }
        }
    }
}

/// Engines built several at once (`BuildOptions::jobs`) are the engines of a build one at a
/// time: same files byte for byte, same bindings, reported (and released) in plan order, and
/// they run bit-identically to the whole program. A failing engine is named with `jobs` too,
/// and the engines that finished stay valid.
#[test]
fn engines_built_at_once_equal_those_built_one_at_a_time() {
    let cfg = Pi05Config::small();
    let dir = tempfile::tempdir().unwrap();
    let ck = small_checkpoint(&cfg, dir.path());
    let src = MappedSafetensors::open(&ck).unwrap();
    let progs = build_all(&cfg, Precision::Bf16).unwrap();
    let program = &progs.prefix;
    let pl = plan(
        program,
        &PartitionOptions::new(program.weight_bytes() as u64 / 8),
    )
    .unwrap();
    assert!(pl.engines.len() >= 4, "{} engines", pl.engines.len());
    let build = |jobs: usize| {
        let order = Mutex::new(Vec::new());
        let cb = |r: &EngineReport| order.lock().unwrap().push(r.index);
        let out = dir.path().join(format!("jobs-{jobs}"));
        let rep = build_plan(
            &pl,
            program,
            &src,
            &ReferenceBuilder::default(),
            &out,
            &BuildOptions {
                on_engine: Some(&cb),
                jobs,
                ..BuildOptions::default()
            },
        )
        .unwrap();
        let order = order.into_inner().unwrap();
        assert_eq!(
            order,
            (0..pl.engines.len()).collect::<Vec<_>>(),
            "jobs {jobs}"
        );
        rep
    };
    let serial = build(1);
    assert_eq!(serial.max_concurrent, 1);
    let parallel = build(3);
    assert!((1..=3).contains(&parallel.max_concurrent));
    assert_eq!(serial.engines.len(), parallel.engines.len());
    for (a, b) in serial.engines.iter().zip(&parallel.engines) {
        assert_eq!(
            std::fs::read(&a.file).unwrap(),
            std::fs::read(&b.file).unwrap(),
            "{}",
            a.name
        );
        assert_eq!(
            (&a.name, &a.inputs, &a.outputs),
            (&b.name, &b.inputs, &b.outputs)
        );
        assert_eq!(
            (&a.input_values, &a.output_values),
            (&b.input_values, &b.output_values)
        );
    }
    for (a, b) in serial.reports.iter().zip(&parallel.reports) {
        assert_eq!((a.index, &a.released), (b.index, &b.released));
    }
    assert!(parallel.reports.iter().all(|r| !r.peak_is_per_engine));
    let pin = prefix_inputs(&cfg);
    let whole = petite_reference::run(program, &src, pin.clone()).unwrap();
    assert_bit_equal(
        "prefix jobs 3",
        &whole,
        &run_built(program, &parallel.engines, &pin),
    );

    // Engine 2 reads a weight the source lacks: named, with three builds at once.
    let bad = *pl.engines[2]
        .weights
        .iter()
        .find(|w| pl.engines.iter().filter(|e| e.weights.contains(w)).count() == 1)
        .expect("a weight engine 2 alone reads");
    let mut missing = program.clone();
    let petite_graph::Op::Weight { name, .. } = &mut missing.nodes[bad.index()].op else {
        panic!("not a weight")
    };
    *name = "gone".into();
    let out = dir.path().join("failing");
    let err = build_plan(
        &pl,
        &missing,
        &src,
        &ReferenceBuilder::default(),
        &out,
        &BuildOptions {
            jobs: 3,
            ..BuildOptions::default()
        },
    )
    .expect_err("a missing weight")
    .to_string();
    assert!(
        err.contains("engine 2 (engine_002)") && err.contains("gone"),
        "{err}"
    );
    for e in std::fs::read_dir(&out).unwrap().flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            ReferenceEngine::open(&p).unwrap();
            petite_weights::seal::check(&p).unwrap();
        }
    }
}

/// A prefix whose token embedding is split into row shards builds into engines that each store
/// only their rows (as `name[start..end]`), release only those rows after their last engine,
/// and run from their files bit-identically to the unsharded prefix.
#[test]
fn sharded_embedding_engines_store_their_rows_and_equal_the_unsharded_prefix() {
    let cfg = Pi05Config::small();
    let dir = tempfile::tempdir().unwrap();
    let ck = small_checkpoint(&cfg, dir.path());
    let src = MappedSafetensors::open(&ck).unwrap();
    let embed = "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight";
    let full = src.info(embed).unwrap();
    for prec in [Precision::F32, Precision::Bf16] {
        let plain = build_all(&cfg, prec).unwrap().prefix;
        let es = if prec == Precision::F32 { 4 } else { 2 };
        let sharded = build_prefix_with(
            &cfg,
            prec,
            &PrefixOptions {
                max_embedding_shard_bytes: 16 * cfg.language.width * es,
            },
        )
        .unwrap();
        let pin = prefix_inputs(&cfg);
        let whole = petite_reference::run(&plain, &src, pin.clone()).unwrap();
        let cap = sharded.weight_bytes() as u64 / 4;
        let pl = plan(&sharded, &PartitionOptions::new(cap)).unwrap();
        let out = dir.path().join(format!("sharded-{prec:?}"));
        let rep = build_plan(
            &pl,
            &sharded,
            &src,
            &ReferenceBuilder::default(),
            &out,
            &BuildOptions::default(),
        )
        .unwrap();
        let mut rows_seen = Vec::new();
        for e in &rep.engines {
            let f = ReferenceEngine::open(&e.file).unwrap();
            assert!(
                f.file().info(embed).is_err(),
                "{}: holds the whole table",
                e.name
            );
            for w in f.program().weights() {
                assert_eq!(w.rows, None, "engine programs read whole tensors");
                if let Some(r) = w.name.strip_prefix(&format!("{embed}[")) {
                    let (a, b) = r.trim_end_matches(']').split_once("..").unwrap();
                    let (a, b): (usize, usize) = (a.parse().unwrap(), b.parse().unwrap());
                    let info = f.file().info(&w.name).unwrap();
                    assert_eq!(info.shape, vec![b - a, full.shape[1]]);
                    rows_seen.push([a, b]);
                }
            }
        }
        rows_seen.sort();
        assert_eq!(rows_seen.len(), cfg.language.vocab.div_ceil(16));
        assert!(rows_seen.windows(2).all(|w| w[0][1] == w[1][0]));
        // Each range is released once, by name and range, after its own last engine.
        let released: Vec<&String> = rep
            .reports
            .iter()
            .flat_map(|r| &r.released)
            .filter(|n| n.starts_with(embed))
            .collect();
        assert_eq!(released.len(), rows_seen.len());
        assert!(released.iter().all(|n| n.ends_with(']')));
        let got = run_built(&sharded, &rep.engines, &pin);
        assert_bit_equal(&format!("sharded prefix {prec:?}"), &whole, &got);
    }
}

/// A weight source that records the mapping's resident bytes around each `release` call.
struct Recording<'a> {
    inner: &'a MappedSafetensors,
    log: Mutex<Vec<(Vec<String>, u64, u64)>>,
}

impl WeightSource for Recording<'_> {
    fn names(&self) -> Vec<String> {
        self.inner.names()
    }
    fn info(&self, name: &str) -> petite_weights::Result<TensorInfo> {
        self.inner.info(name)
    }
    fn tensor(&self, name: &str) -> petite_weights::Result<TensorView<'_>> {
        self.inner.tensor(name)
    }
    fn release(&self, names: &[&str]) -> petite_weights::Result<()> {
        let before = self.inner.process_resident_bytes().unwrap();
        self.inner.release(names)?;
        let after = self.inner.process_resident_bytes().unwrap();
        self.log.lock().unwrap().push((
            names.iter().map(|s| s.to_string()).collect(),
            before,
            after,
        ));
        Ok(())
    }
    fn release_range(&self, name: &str, start: usize, end: usize) -> petite_weights::Result<()> {
        self.inner.release_range(name, start, end)
    }
}

#[test]
fn mapping_residency_drops_engine_by_engine_after_last_use() {
    let dir = tempfile::tempdir().unwrap();
    // 6 weights of 256 KiB (page multiples), w0 read by the first and the last engine.
    let (program, path) = chain(dir.path(), 6, 256);
    let wbytes = 256 * 256 * 4u64;
    let pl = plan(&program, &PartitionOptions::new(2 * wbytes)).unwrap();
    assert!(pl.engines.len() >= 3, "{} engines", pl.engines.len());
    let src = MappedSafetensors::open(&path).unwrap();
    let rec = Recording {
        inner: &src,
        log: Mutex::new(Vec::new()),
    };
    let after_engine: Mutex<Vec<(usize, u64)>> = Mutex::new(Vec::new());
    let cb = |r: &EngineReport| {
        let res = src.process_resident_bytes().unwrap();
        eprintln!(
            "engine {}: {} weights released, mapping resident {} KiB, RssFile {} KiB",
            r.index,
            r.released.len(),
            res / 1024,
            r.rss_after.map_or(0, |x| x.file / 1024)
        );
        after_engine.lock().unwrap().push((r.index, res));
    };
    // Stream without releasing behind, so only the last-use release gives pages back.
    let builder = ReferenceBuilder {
        release_behind: false,
        ..ReferenceBuilder::default()
    };
    let rep = build_plan(
        &pl,
        &program,
        &rec,
        &builder,
        &dir.path().join("engines"),
        &BuildOptions {
            release_after_last_use: true,
            on_engine: Some(&cb),
            ..BuildOptions::default()
        },
    )
    .unwrap();
    let page = petite_weights::page_size() as u64;
    let log = rec.log.lock().unwrap();
    // w0 is released once, after the last engine, never after the first.
    let w0: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, (n, _, _))| n.contains(&"w0".to_string()))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(w0.len(), 1);
    assert!(rep.reports.last().unwrap().released.contains(&"w0".into()));
    assert!(!rep.reports[0].released.contains(&"w0".into()));
    for (names, before, after) in log.iter() {
        let n = names.len() as u64;
        // Before the release, the released weights were resident (this engine read them) ...
        assert!(
            *before >= n * wbytes,
            "{names:?}: {before} bytes resident before release"
        );
        // ... and the release gave back all of them (only w0, still to be read, may remain).
        // Slack: the kernel's fault-around maps up to 64 KiB of cached neighbours per fault.
        let keep = if names.contains(&"w0".to_string()) {
            0
        } else {
            wbytes
        };
        assert!(
            *after <= keep + 128 * 1024,
            "{names:?}: {after} bytes resident after release (before {before})"
        );
        assert!(before - after >= n * wbytes - 2 * page);
    }
    let after = after_engine.lock().unwrap();
    assert!(after.last().unwrap().1 <= 128 * 1024);

    // The same build without the release keeps everything resident: the drop is the release's.
    let src2 = MappedSafetensors::open(&path).unwrap();
    build_plan(
        &pl,
        &program,
        &src2,
        &builder,
        &dir.path().join("engines2"),
        &BuildOptions {
            release_after_last_use: false,
            on_engine: None,
            ..BuildOptions::default()
        },
    )
    .unwrap();
    assert!(src2.process_resident_bytes().unwrap() >= 6 * wbytes);
}

#[test]
fn release_behind_keeps_residency_near_one_chunk_per_thread() {
    let dir = tempfile::tempdir().unwrap();
    let (program, path) = chain(dir.path(), 4, 2048);
    let pl = plan(&program, &PartitionOptions::new(u64::MAX / 4)).unwrap();
    assert_eq!(pl.engines.len(), 1);
    let src = MappedSafetensors::open(&path).unwrap();
    let peak = Mutex::new(0u64);
    // A source wrapper that samples residency at every chunk release.
    struct Sample<'a>(&'a MappedSafetensors, &'a Mutex<u64>);
    impl WeightSource for Sample<'_> {
        fn names(&self) -> Vec<String> {
            self.0.names()
        }
        fn info(&self, n: &str) -> petite_weights::Result<TensorInfo> {
            self.0.info(n)
        }
        fn tensor(&self, n: &str) -> petite_weights::Result<TensorView<'_>> {
            self.0.tensor(n)
        }
        fn release(&self, n: &[&str]) -> petite_weights::Result<()> {
            self.0.release(n)
        }
        fn release_range(&self, n: &str, s: usize, e: usize) -> petite_weights::Result<()> {
            let r = self.0.process_resident_bytes().unwrap();
            let mut p = self.1.lock().unwrap();
            *p = (*p).max(r);
            self.0.release_range(n, s, e)
        }
    }
    let chunk = 256 * 1024;
    let builder = ReferenceBuilder {
        chunk_bytes: chunk,
        release_behind: true,
        ..ReferenceBuilder::default()
    };
    build_plan(
        &pl,
        &program,
        &Sample(&src, &peak),
        &builder,
        &dir.path().join("e"),
        &BuildOptions::default(),
    )
    .unwrap();
    let peak = *peak.lock().unwrap();
    // 64 MiB of weights streamed; resident at most a chunk per streaming thread plus what one
    // fault maps beyond it (fault-around, or whole large page-cache folios, up to 2 MiB each on
    // recent kernels).
    eprintln!("peak mapping residency while streaming 64 MiB: {peak} bytes");
    assert!(
        peak <= (builder.threads * chunk) as u64 + (12 << 20),
        "peak residency {peak}"
    );
    assert!(peak >= chunk as u64 / 2, "peak residency {peak}");
}

#[test]
fn a_missing_or_misshapen_weight_names_the_engine_and_keeps_finished_engines() {
    let dir = tempfile::tempdir().unwrap();
    let (program, path) = chain(dir.path(), 4, 64);
    let pl = plan(&program, &PartitionOptions::new(64 * 64 * 4)).unwrap();
    assert!(pl.engines.len() >= 3);
    let src = MappedSafetensors::open(&path).unwrap();
    // Engine 1 reads w1: rename it in the program so the source lacks it.
    let bad_engine = pl
        .engines
        .iter()
        .position(|e| e.weights.iter().any(|&w| matches!(&program.node(w).op, petite_graph::Op::Weight { name, .. } if name == "w1")))
        .unwrap();
    let mut missing = program.clone();
    for n in &mut missing.nodes {
        if let petite_graph::Op::Weight { name, .. } = &mut n.op
            && name == "w1"
        {
            *name = "w1_missing".into();
        }
    }
    // A source whose w1 has another shape (same bytes).
    let other = dir.path().join("other.safetensors");
    {
        use std::io::Write;
        let table: Vec<petite_weights::TensorSpec> = ["w0", "w1", "w2", "w3"]
            .iter()
            .map(|n| {
                let shape: &[usize] = if *n == "w1" { &[32, 128] } else { &[64, 64] };
                petite_weights::TensorSpec::new(*n, petite_weights::Dtype::F32, shape)
            })
            .collect();
        let w = petite_weights::SafetensorsWriter::create(&other, &table, &[]).unwrap();
        for t in &table {
            let mut s = w.tensor(&t.name).unwrap();
            s.write_all(&[0u8; 64 * 64 * 4]).unwrap();
            s.finish().unwrap();
        }
        w.finish().unwrap();
    }
    let other = MappedSafetensors::open(&other).unwrap();
    for (what, p, s, needle) in [
        ("missing", &missing, &src, "w1_missing"),
        (
            "shape",
            &program,
            &other,
            "weight `w1`: expected f32[64, 64], found F32[32, 128]",
        ),
    ] {
        let out = dir.path().join(what);
        let err = build_plan(
            &pl,
            p,
            s,
            &ReferenceBuilder::default(),
            &out,
            &BuildOptions::default(),
        );
        let msg = err.expect_err(what).to_string();
        let engine = format!("engine {bad_engine} (engine_{bad_engine:03})");
        assert!(msg.contains(&engine), "{what}: {msg}");
        assert!(msg.contains(needle), "{what}: {msg}");
        // Finished engines are complete and valid; the failing one left nothing behind.
        let mut names: Vec<String> = std::fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        // Each finished engine with its seal.
        let want: Vec<String> = (0..bad_engine)
            .flat_map(|i| {
                let n = format!("engine_{i:03}.ref.safetensors");
                [n.clone(), format!("{n}.seal")]
            })
            .collect();
        assert_eq!(names, want, "{what}");
        for n in names.iter().filter(|n| !n.ends_with(".seal")) {
            ReferenceEngine::open(out.join(n)).unwrap();
            petite_weights::seal::check(&out.join(n)).unwrap();
        }
    }
}

#[test]
fn an_unwritable_engine_directory_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (program, path) = chain(dir.path(), 2, 64);
    let pl = plan(&program, &PartitionOptions::new(u64::MAX / 4)).unwrap();
    let src = MappedSafetensors::open(&path).unwrap();
    // A regular file where the directory should be.
    let blocker = dir.path().join("not-a-dir");
    std::fs::write(&blocker, b"x").unwrap();
    let err = build_plan(
        &pl,
        &program,
        &src,
        &ReferenceBuilder::default(),
        &blocker.join("engines"),
        &BuildOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("not-a-dir/engines"), "{err}");
    assert!(err.contains("create engine directory"), "{err}");
    // An existing directory without write permission (root bypasses modes, so use a file
    // named like the engine's temporary output being a directory instead).
    let out = dir.path().join("ro");
    std::fs::create_dir_all(out.join("engine_000.ref.safetensors.petite-tmp")).unwrap();
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
    assert!(err.contains("engine 0 (engine_000)"), "{err}");
}

#[test]
fn a_corrupt_engine_file_is_rejected_on_open() {
    let dir = tempfile::tempdir().unwrap();
    let (program, path) = chain(dir.path(), 2, 64);
    let pl = plan(&program, &PartitionOptions::new(u64::MAX / 4)).unwrap();
    let src = MappedSafetensors::open(&path).unwrap();
    let rep = build_plan(
        &pl,
        &program,
        &src,
        &ReferenceBuilder::default(),
        &dir.path().join("e"),
        &BuildOptions::default(),
    )
    .unwrap();
    // A weights file is not an engine file.
    let err = ReferenceEngine::open(&path).unwrap_err().to_string();
    assert!(err.contains("petite.engine.format"), "{err}");
    // Truncated engine file.
    let f = &rep.engines[0].file;
    let len = std::fs::metadata(f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(f)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    assert!(ReferenceEngine::open(f).is_err());
}
