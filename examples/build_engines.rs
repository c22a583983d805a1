//! The full-size measurement driver for `cargo xtask bench engine` (run under `memcap`):
//!
//! * `build_engines convert SRC.safetensors OUT.safetensors` — the bf16 mapping file from a
//!   lerobot-layout f32 checkpoint (both lm_heads dropped, as `petite convert` does).
//! * `build_engines build MAPPING OUT_DIR CAP_MIB reference|onnx` — plans the bf16 pi0.5 prefix
//!   at CAP_MIB per engine and builds every engine in plan order with the reference backend
//!   (`reference`) or emits every engine's TensorRT-flavour ONNX model (`onnx`; weights as
//!   external data, nothing loaded). Prints one JSON line per engine and a summary line with
//!   the peaks a background sampler saw in `/proc/self/status` (VmHWM, RssAnon, RssFile).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use petite_engine::onnx::{Flavor, emit, locations, write_model};
use petite_engine::reference::ReferenceBuilder;
use petite_engine::tensorrt::link_weights;
use petite_engine::{BuildOptions, EngineReport, build_plan, engine_name};
use petite_partition::{PartitionOptions, plan};
use petite_pi05::names::{Layout, drop_list};
use petite_pi05::{Pi05Config, Precision, build_prefix};
use petite_weights::residency::rss;
use petite_weights::{ConvertOptions, MappedSafetensors, Selection, convert};

/// Samples RssAnon and RssFile every 10 ms (VmHWM covers total RSS).
fn sampler(stop: Arc<AtomicBool>, anon: Arc<AtomicU64>, file: Arc<AtomicU64>) {
    while !stop.load(Ordering::Relaxed) {
        if let Some(r) = rss() {
            anon.fetch_max(r.anon, Ordering::Relaxed);
            file.fetch_max(r.file, Ordering::Relaxed);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    match a.get(1).map(String::as_str) {
        Some("convert") => {
            let src = MappedSafetensors::open(&a[2]).unwrap();
            let r = convert(
                &src,
                std::path::Path::new(&a[3]),
                &ConvertOptions {
                    selection: Selection::Drop(drop_list(Layout::Lerobot)),
                    progress: None,
                    ..ConvertOptions::default()
                },
            )
            .unwrap();
            eprintln!("converted: {} bytes in {:.1} s", r.bytes_written, r.seconds);
        }
        Some("build") => {
            let (mapping, out, cap_mib, backend) = (&a[2], &a[3], &a[4], &a[5]);
            let cap: u64 = cap_mib.parse::<u64>().unwrap() << 20;
            let stop = Arc::new(AtomicBool::new(false));
            let anon = Arc::new(AtomicU64::new(0));
            let file = Arc::new(AtomicU64::new(0));
            let h = {
                let (s, an, fi) = (stop.clone(), anon.clone(), file.clone());
                std::thread::spawn(move || sampler(s, an, fi))
            };
            let t0 = Instant::now();
            let cfg = Pi05Config::default();
            let program = build_prefix(&cfg, Precision::Bf16).unwrap();
            let pl = plan(&program, &PartitionOptions::new(cap)).unwrap();
            let t_plan = t0.elapsed().as_secs_f64();
            let src = MappedSafetensors::open(mapping).unwrap();
            let dir = std::path::Path::new(out);
            let t1 = Instant::now();
            let mut written = 0u64;
            if backend == "reference" {
                let cb = |r: &EngineReport| {
                    println!("{}", serde_json::to_string(r).unwrap());
                };
                let rep = build_plan(
                    &pl,
                    &program,
                    &src,
                    &ReferenceBuilder::default(),
                    dir,
                    &BuildOptions {
                        release_after_last_use: true,
                        on_engine: Some(&cb),
                        ..BuildOptions::default()
                    },
                )
                .unwrap();
                written = rep.bytes_written;
            } else {
                // ONNX models next to the mapping file (external data by file name).
                std::fs::create_dir_all(dir).unwrap();
                let loc = link_weights(std::path::Path::new(mapping), dir).unwrap();
                let locs = locations(src.header());
                for i in 0..pl.engines.len() {
                    let t = Instant::now();
                    let sub = pl.engine_program(&program, i).unwrap();
                    let bytes = emit(&sub.program, &locs, &loc, Flavor::TensorRt).unwrap();
                    let p = dir.join(format!("{}.onnx", engine_name(i)));
                    write_model(&p, &bytes).unwrap();
                    written += bytes.len() as u64;
                    println!(
                        "{{\"index\":{i},\"onnx_bytes\":{},\"seconds\":{:.4},\"rss_anon\":{}}}",
                        bytes.len(),
                        t.elapsed().as_secs_f64(),
                        rss().map_or(0, |r| r.anon)
                    );
                }
            }
            let secs = t1.elapsed().as_secs_f64();
            stop.store(true, Ordering::Relaxed);
            h.join().unwrap();
            let r = rss().unwrap();
            println!(
                "{{\"summary\":true,\"backend\":\"{backend}\",\"engines\":{},\"plan_seconds\":{t_plan:.4},\"build_seconds\":{secs:.3},\"bytes_written\":{written},\"weight_bytes\":{},\"vm_hwm\":{},\"peak_rss_anon\":{},\"peak_rss_file\":{}}}",
                pl.engines.len(),
                pl.weight_bytes,
                r.peak,
                anon.load(Ordering::Relaxed).max(r.anon),
                file.load(Ordering::Relaxed).max(r.file),
            );
        }
        _ => panic!(
            "usage: build_engines convert SRC OUT | build MAPPING OUT_DIR CAP_MIB reference|onnx"
        ),
    }
}
