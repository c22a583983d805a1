//! `cargo xtask bench engine`: petite-engine's reference backend builds every engine of the
//! full-size pi0.5 prefix (bf16 program, planned at `--cap-mib` per engine) from the bf16 mapping
//! file under `memcap --limit 512MiB --drop-caches`; must stay within peak RSS 256 MiB and peak
//! RssAnon 128 MiB. Floor in the same run: `dd` copying as many bytes from the mapping file
//! as the engines hold (fsynced), under the same cap. Then the TensorRT flavour's ONNX models are
//! emitted under the same cap (weights as external data: nothing loaded). Outputs are deleted.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util;

/// Options of the engine benchmark.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The f32 lerobot-layout checkpoint the bf16 mapping file is converted from (if missing).
    #[arg(long, default_value = "target/pi05-full/model.safetensors")]
    pub checkpoint: PathBuf,
    /// Per-engine weight cap of the plan, MiB.
    #[arg(long, default_value_t = 512)]
    pub cap_mib: u64,
    /// memcap limit.
    #[arg(long, default_value = "512MiB")]
    pub limit: String,
    /// Keep the mapping file (default: deleted after measuring).
    #[arg(long)]
    pub keep_files: bool,
}

const MIB: f64 = 1048576.0;

fn memcap(limit: &str, json: &Path, prog: &Path, args: &[String]) -> Result<util::MemcapRun> {
    let mut c = Command::new(prog);
    c.args(args);
    util::memcap_run(&["--limit", limit, "--drop-caches"], &c, json)
}

fn summary(stdout: &str) -> Result<serde_json::Value> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["summary"] == true)
        .context("no summary line")
}

/// Runs the benchmark.
pub fn run(a: &Args) -> Result<()> {
    let root = util::root();
    util::cargo(&[
        "build",
        "--release",
        "-q",
        "-p",
        "petite",
        "--example",
        "build_engines",
    ])?;
    let bin = crate::util::target_dir().join("release/examples/build_engines");
    let scratch = root.join("target/engine-scratch");
    std::fs::create_dir_all(&scratch)?;
    let mapping = scratch.join("weights.safetensors");
    let made_mapping = !mapping.exists();
    if made_mapping {
        let ck = root.join(&a.checkpoint);
        if !ck.exists() {
            bail!(
                "{} is missing: run `cargo xtask bench synth --keep-files` first",
                ck.display()
            );
        }
        util::run(Command::new(&bin).arg("convert").arg(&ck).arg(&mapping))?;
    }
    let engines = scratch.join("engines");
    let _ = std::fs::remove_dir_all(&engines);
    let s = |p: &Path| p.display().to_string();
    let cap = a.cap_mib.to_string();

    let build = memcap(
        &a.limit,
        &scratch.join("memcap-build.json"),
        &bin,
        &[
            "build".into(),
            s(&mapping),
            s(&engines),
            cap.clone(),
            "reference".into(),
        ],
    )?;
    let _ = std::fs::remove_dir_all(&engines);
    let sb = summary(&build.stdout)?;
    let written = sb["bytes_written"].as_u64().unwrap_or(0);

    let dd_out = scratch.join("dd.bin");
    let dd = memcap(
        &a.limit,
        &scratch.join("memcap-dd.json"),
        Path::new("dd"),
        &[
            format!("if={}", s(&mapping)),
            format!("of={}", s(&dd_out)),
            "bs=8M".into(),
            "iflag=count_bytes".into(),
            format!("count={written}"),
            "conv=fsync".into(),
            "status=none".into(),
        ],
    )?;
    let _ = std::fs::remove_file(&dd_out);

    let onnx_dir = scratch.join("onnx");
    let onnx = memcap(
        &a.limit,
        &scratch.join("memcap-onnx.json"),
        &bin,
        &[
            "build".into(),
            s(&mapping),
            s(&onnx_dir),
            cap,
            "onnx".into(),
        ],
    )?;
    let _ = std::fs::remove_dir_all(&onnx_dir);
    let so = summary(&onnx.stdout)?;

    println!("per engine (reference backend):");
    println!("  engine  weights MiB  file MiB  seconds  MiB/s  peak RSS MiB  RssFile after MiB");
    for l in build.stdout.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else {
            continue;
        };
        if v["summary"] == true {
            continue;
        }
        let f = v["file_bytes"].as_f64().unwrap_or(0.0);
        let t = v["seconds"].as_f64().unwrap_or(f64::NAN);
        println!(
            "  {:>6}  {:>11.1}  {:>8.1}  {:>7.2}  {:>5.0}  {:>12.1}  {:>17.1}",
            v["index"],
            v["weight_bytes"].as_f64().unwrap_or(0.0) / MIB,
            f / MIB,
            t,
            f / MIB / t,
            v["peak_rss"].as_f64().unwrap_or(0.0) / MIB,
            v["rss_after"]["file"].as_f64().unwrap_or(0.0) / MIB,
        );
    }
    let bs = sb["build_seconds"].as_f64().unwrap_or(f64::NAN);
    let rate = written as f64 / MIB / bs;
    let dd_rate = written as f64 / MIB / dd.wall_s;
    let anon = sb["peak_rss_anon"].as_u64().unwrap_or(u64::MAX);
    println!(
        "build: {} engines, {:.2} GiB written in {bs:.1} s ({rate:.0} MiB/s); memcap wall {:.1} s",
        sb["engines"],
        written as f64 / MIB / 1024.0,
        build.wall_s
    );
    println!(
        "floor: dd of the same bytes from the mapping file (fsynced) {:.1} s ({dd_rate:.0} MiB/s); build/floor throughput {:.2}",
        dd.wall_s,
        rate / dd_rate
    );
    println!(
        "memory (cap {}): peak RSS {:.1} MiB (memcap; VmHWM {:.1}), peak RssAnon {:.1} MiB (sampled), peak RssFile {:.1} MiB, cgroup peak {:.1} MiB (page cache included)",
        a.limit,
        build.peak_rss as f64 / MIB,
        sb["vm_hwm"].as_f64().unwrap_or(0.0) / MIB,
        anon as f64 / MIB,
        sb["peak_rss_file"].as_f64().unwrap_or(0.0) / MIB,
        build.peak_cgroup as f64 / MIB
    );
    println!(
        "onnx (TensorRT flavour): {} models, {:.1} MiB of protobuf in {:.2} s; peak RSS {:.1} MiB, peak RssAnon {:.1} MiB",
        so["engines"],
        so["bytes_written"].as_f64().unwrap_or(0.0) / MIB,
        so["build_seconds"].as_f64().unwrap_or(f64::NAN),
        onnx.peak_rss as f64 / MIB,
        so["peak_rss_anon"].as_f64().unwrap_or(0.0) / MIB
    );
    if made_mapping && !a.keep_files {
        std::fs::remove_file(&mapping)?;
    }
    if build.peak_rss > 256 << 20 || anon > 128 << 20 {
        bail!("over budget: peak RSS must be <= 256 MiB and peak RssAnon <= 128 MiB");
    }
    Ok(())
}
