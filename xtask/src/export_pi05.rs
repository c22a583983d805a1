//! `cargo xtask export-pi05`: the headline job. With no arguments: synthesizes the full-size
//! pi0.5 checkpoint into `target/pi05-full/` if it is not there (the same cache `bench synth
//! --keep target/pi05-full` fills), exports it with the reference backend into
//! `target/export-pi05/`, verifies it in a separate process, and prints where the files are and
//! the summary. `--checkpoint PATH` for a real lerobot/Hub checkpoint, `--small` for a quick run
//! on a lerobot golden case. `--memcap 512MiB` runs the export under
//! `memcap --limit 512MiB --drop-caches` (verify under `--verify-memcap`, 1GiB; it fails the
//! task above `--max-error`, by default petite's bf16-vs-f32 bound), and `--floor`
//! measures this disk's floor in the same run (dd: read the checkpoint, write the .pte bytes).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::util::MemcapRun;
use anyhow::{Result, bail};

/// Options of `cargo xtask export-pi05`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A real checkpoint (file, index or directory; lerobot or Hub layout).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Its config JSON (default: the real pi0.5).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Quick run on the small lerobot golden case `testdata/pi05/two_cams_mqa`.
    #[arg(long, conflicts_with = "checkpoint")]
    pub small: bool,
    /// Output directory (default: target/export-pi05[-small]).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Run the export under `memcap --limit LIMIT --drop-caches`.
    #[arg(long)]
    pub memcap: Option<String>,
    /// memcap limit of the verify run (only with --memcap).
    #[arg(long, default_value = "1GiB")]
    pub verify_memcap: String,
    /// Skip the verification.
    #[arg(long)]
    pub no_verify: bool,
    /// Fail when the verified max abs action error exceeds this (passed to `petite verify`;
    /// default: petite verify's bound for the export's dtype (1e-4 f32, 5e-2 bf16); for an f32
    /// export).
    #[arg(long, conflicts_with = "no_verify")]
    pub max_error: Option<String>,
    /// Measure the disk floor in the same run (dd read of the checkpoint, dd write of the .pte bytes).
    #[arg(long)]
    pub floor: bool,
    /// Also read both .pte files with ExecuTorch's own `deserialize_pte_binary` (needs the
    /// conformance venv target/venv-pte-full: `cargo xtask conformance --full` creates it; the
    /// deserializer copies named data into memory, so keep this to small exports).
    #[arg(long)]
    pub executorch_check: bool,
    /// Engine backend: reference (default; verified) or tensorrt (TensorRT-RTX from
    /// target/venv-trt, or $PETITE_TRTEXEC; its plans cannot run here, so no verification).
    #[arg(long, default_value = "reference", value_parser = ["reference", "tensorrt", "portable"])]
    pub backend: String,
    /// Extra arguments for `petite export` (e.g. `--keep-engines`), after `--`.
    #[arg(last = true)]
    pub export_args: Vec<String>,
}

/// Runs `cmd`, under memcap when `limit` is set; returns its figures (peaks 0 without memcap).
fn measured(limit: Option<&str>, cmd: &mut Command, json: &Path) -> Result<MemcapRun> {
    let Some(limit) = limit else {
        let t = std::time::Instant::now();
        crate::util::run(cmd)?;
        return Ok(MemcapRun {
            wall_s: t.elapsed().as_secs_f64(),
            ..MemcapRun::default()
        });
    };
    crate::util::memcap_run(&["--limit", limit, "--drop-caches"], cmd, json)
}

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// Runs the task.
pub fn run(a: &Args) -> Result<()> {
    let root = crate::util::root();
    let petite = crate::util::release_petite()?;
    let (checkpoint, config, default_out) = if a.small {
        let c = root.join("testdata/pi05/two_cams_mqa");
        (
            c.join("model.safetensors"),
            Some(c.join("config.json")),
            "export-pi05-small",
        )
    } else if let Some(ck) = &a.checkpoint {
        (ck.clone(), a.config.clone(), "export-pi05")
    } else {
        // The full-size synthetic checkpoint, cached where `bench synth --keep` puts it.
        let ck = crate::util::full_checkpoint(&petite)?;
        (ck, None, "export-pi05")
    };
    let out = a
        .out
        .clone()
        .unwrap_or_else(|| root.join("target").join(default_out));
    std::fs::create_dir_all(&out)?;
    let json = out.join(".memcap.json");

    let mut export = Command::new(&petite);
    export
        .arg("export")
        .arg("--checkpoint")
        .arg(&checkpoint)
        .arg("--out")
        .arg(&out);
    if let Some(c) = &config {
        export.arg("--config").arg(c);
    }
    export.arg("--backend").arg(&a.backend);
    export.args(&a.export_args);
    let e = measured(a.memcap.as_deref(), &mut export, &json)?;
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json"))?)?;

    let v = if a.no_verify {
        None
    } else if a.backend == "tensorrt" {
        eprintln!(
            "xtask: not verifying: TensorRT plans cannot run on this machine (report.json has each engine's builder figures)"
        );
        None
    } else {
        let mut verify = Command::new(&petite);
        verify
            .arg("verify")
            .arg("--dir")
            .arg(&out)
            .arg("--checkpoint")
            .arg(&checkpoint);
        if let Some(c) = &config {
            verify.arg("--config").arg(c);
        }
        // Without --max-error, `petite verify` applies its default bound; above it (or on a
        // NaN) it exits non-zero and so does this task.
        if let Some(m) = &a.max_error {
            verify.arg("--max-error").arg(m);
        }
        let limit = a.memcap.as_ref().map(|_| a.verify_memcap.as_str());
        Some(measured(limit, &mut verify, &json)?)
    };

    let pte_bytes = report["programs"]["prefix"]["bytes"].as_u64().unwrap_or(0)
        + report["programs"]["step"]["bytes"].as_u64().unwrap_or(0);
    let ck_bytes: u64 = report["checkpoint"]["files"]
        .as_array()
        .map(|fs| {
            fs.iter()
                .filter_map(|f| std::fs::metadata(f.as_str()?).ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0);
    println!("export-pi05: {}", checkpoint.display());
    println!(
        "  files: {} and {} ({:.2} GiB), report {}",
        out.join("prefix.pte").display(),
        out.join("step.pte").display(),
        gib(pte_bytes),
        out.join("report.json").display()
    );
    if let Some(stages) = report["stages"].as_array() {
        println!(
            "  {:<10} {:>9} {:>12} {:>12} {:>11} {:>11}",
            "stage", "wall s", "peak RSS GiB", "peak anon", "read GiB", "written GiB"
        );
        for s in stages {
            println!(
                "  {:<10} {:>9.1} {:>12.3} {:>12.3} {:>11.2} {:>11.2}",
                s["name"].as_str().unwrap_or("?"),
                s["seconds"].as_f64().unwrap_or(f64::NAN),
                gib(s["peak_rss"].as_u64().unwrap_or(0)),
                gib(s["peak_anon"].as_u64().unwrap_or(0)),
                gib(s["bytes_read"].as_u64().unwrap_or(0)),
                gib(s["bytes_written"].as_u64().unwrap_or(0)),
            );
        }
    }
    println!("  reference story (A40, one process): load 2.12 / compile 5.64 / save 6.59 GiB peak");
    println!(
        "  export: {:.1} s wall{}",
        e.wall_s,
        match &a.memcap {
            Some(l) => format!(
                ", under memcap {l}: peak cgroup {:.3} GiB, peak RSS {:.3} GiB",
                gib(e.peak_cgroup),
                gib(e.peak_rss)
            ),
            None => String::new(),
        }
    );
    if let Some(b) = report["builder"].as_str() {
        let engines: Vec<&serde_json::Value> = ["prefix", "step"]
            .iter()
            .filter_map(|p| report["programs"][p]["engines"].as_array())
            .flatten()
            .collect();
        let max = |k: &str| engines.iter().filter_map(|e| e[k].as_u64()).max();
        println!(
            "  builder {b}: {} engines, largest plan {}, builder peak RSS {} (engine cap {})",
            engines.len(),
            max("plan_bytes").map_or("-".into(), |v| format!("{:.3} GiB", gib(v))),
            max("builder_peak_rss_bytes").map_or("-".into(), |v| format!("{:.3} GiB", gib(v))),
            report["engine_cap"]
                .as_u64()
                .map_or("-".into(), |v| format!("{:.3} GiB", gib(v)))
        );
    }
    let t = &report["totals"];
    // Each ratio the report has (which ones depends on what the backend writes).
    let ratios: Vec<String> = [
        (
            "written_per_weight_byte_mapping_plus_pte",
            "mapping file + .pte",
        ),
        ("written_per_weight_byte_pte", ".pte"),
        (
            "written_per_weight_byte_all_files",
            "all files incl. engines",
        ),
    ]
    .iter()
    .filter_map(|(k, what)| t[*k].as_f64().map(|v| format!("{v:.3} ({what})")))
    .collect();
    println!(
        "  bytes written per weight byte: {}; weights {:.2} GiB",
        ratios.join(", "),
        gib(t["weight_bytes"].as_u64().unwrap_or(0))
    );
    if let Some(v) = &v {
        let rep: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("report.json"))?)?;
        println!(
            "  verify: max abs action error {:.3e} (export vs f32 reference; bound {:e}), {:.1} s{}",
            rep["verify"]["max_abs_action_error"]
                .as_f64()
                .unwrap_or(f64::NAN),
            rep["verify"]["max_error"].as_f64().unwrap_or(f64::NAN),
            v.wall_s,
            if a.memcap.is_some() {
                format!(
                    ", under memcap {}: peak cgroup {:.3} GiB",
                    a.verify_memcap,
                    gib(v.peak_cgroup)
                )
            } else {
                String::new()
            }
        );
    }
    if a.executorch_check {
        let python = root.join("target/venv-pte-full/bin/python");
        if !python.exists() {
            bail!(
                "--executorch-check: no {} (run `cargo xtask conformance --full` once)",
                python.display()
            );
        }
        crate::util::run(
            Command::new(&python)
                .arg(root.join("xtask/src/export_pi05_check.py"))
                .arg(&out),
        )?;
    }
    if a.floor {
        // The floor: the checkpoint read once (cold cache) plus the .pte bytes written once
        // (fsynced), both with dd at 4 MiB blocks, in this run on this disk.
        let limit = a.memcap.as_deref().or(Some("512MiB"));
        let r = measured(
            limit,
            Command::new("dd")
                .arg(format!("if={}", checkpoint.display()))
                .args(["of=/dev/null", "bs=4M", "status=none"]),
            &json,
        )?;
        let floor_file = out.join(".floor.bin");
        let w = measured(
            limit,
            Command::new("dd")
                .arg("if=/dev/zero")
                .arg(format!("of={}", floor_file.display()))
                .args(["bs=4M", "iflag=count_bytes", "conv=fsync", "status=none"])
                .arg(format!("count={pte_bytes}")),
            &json,
        );
        let _ = std::fs::remove_file(&floor_file);
        let w = w?;
        println!(
            "  floor: dd read of the checkpoint {:.2} GiB in {:.1} s + dd write of {:.2} GiB in {:.1} s = {:.1} s; export / floor = {:.2}",
            gib(ck_bytes),
            r.wall_s,
            gib(pte_bytes),
            w.wall_s,
            r.wall_s + w.wall_s,
            e.wall_s / (r.wall_s + w.wall_s)
        );
    }
    let _ = std::fs::remove_file(&json);
    Ok(())
}
