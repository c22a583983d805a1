//! `cargo xtask bench onnx`: the whole-policy ONNX export at full size. The synthetic full
//! pi0.5 (written with `petite pi05 synth` if missing) is exported with `petite export
//! --backend onnx` under `memcap --limit LIMIT --drop-caches` (wall, peak RSS of the process,
//! cgroup peak); the model then runs in ONNX Runtime CPU (`conformance/onnxruntime/
//! run_pi05_onnx.py` in `target/venv-ort`, `--runs` chunks after the session is created) and
//! `petite pi05 run` (the reference executor) runs on the same checkpoint and inputs, both under
//! memcap (measuring only); the driver is handed the reference's actions as `--expected`, so the
//! run reports the max |ORT − reference| through max_abs_diff's rule. The export's files are
//! deleted at the end unless `--keep` (13.4 GB in f32). `--lerobot`: lerobot 0.6.1's PyTorch
//! CPU `sample_actions` on the same checkpoint and inputs, in the same run, for comparison.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::util;

/// Options of the ONNX benchmark.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Full-size lerobot-layout checkpoint (written with `petite pi05 synth` if missing).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Numerics of the export (bf16 is exported and measured, not run: ONNX Runtime's CPU
    /// provider has no bf16 Gemm).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Memory cap of the export (page cache included).
    #[arg(long, default_value = "512MiB")]
    pub limit: String,
    /// Timed ONNX Runtime chunks after the session is created.
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
    /// ONNX Runtime without prepacking (no packed copy of each weight per node that reads it;
    /// the ten steps read each step weight ten times).
    #[arg(long)]
    pub no_prepack: bool,
    /// Memory cap of the ONNX Runtime process (page cache included; a run whose anonymous
    /// memory outgrows it is killed rather than pushing the machine into its OOM killer).
    #[arg(long, default_value = "18GiB")]
    pub ort_limit: String,
    /// Skip `petite pi05 run` (then no error against the reference is reported).
    #[arg(long)]
    pub no_reference: bool,
    /// Also run lerobot's PyTorch CPU f32 `sample_actions` on the same checkpoint (lerobot
    /// layout) and inputs, in the same run (`target/venv-lerobot`, under memcap with this cap;
    /// the full model peaks near 20 GiB).
    #[arg(long, value_name = "LIMIT", num_args = 0..=1, default_missing_value = "21GiB")]
    pub lerobot: Option<String>,
    /// Keep the export under target/bench-onnx/out.
    #[arg(long)]
    pub keep: bool,
}

/// Runs the benchmark.
pub fn run(a: &Args) -> Result<()> {
    let root = util::root();
    let petite = util::release_petite()?;
    let python = crate::conformance::Venv::Ort.python()?;
    let dir = root.join("target").join("bench-onnx");
    std::fs::create_dir_all(&dir)?;
    let json = dir.join("memcap.json");
    let checkpoint = match &a.checkpoint {
        Some(c) => c.clone(),
        None => util::full_checkpoint(&petite)?,
    };
    let inputs = dir.join("inputs.safetensors");
    super::pi05_run::write_inputs(&inputs)?;
    let out = dir.join("out");
    let _ = std::fs::remove_dir_all(&out);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;

    let e = util::memcap_run(
        &["--limit", &a.limit, "--drop-caches"],
        Command::new(&petite)
            .args([
                "export",
                "--backend",
                "onnx",
                "--dtype",
                &a.dtype,
                "--checkpoint",
            ])
            .arg(&checkpoint)
            .arg("--out")
            .arg(&out),
        &json,
    )?;
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json"))?)?;
    let o = &report["onnx"];
    println!(
        "bench onnx: full-size pi0.5, {}, checkpoint {}",
        a.dtype,
        checkpoint.display()
    );
    println!(
        "  export (memcap --limit {} --drop-caches): {:.1} s, peak RSS {:.1} MiB, cgroup peak {:.1} MiB; protobuf {} B, {} initializers, {:.2} GiB of weights ({} initializers / {:.2} GiB page-aligned)",
        a.limit,
        e.wall_s,
        mib(e.peak_rss),
        mib(e.peak_cgroup),
        o["model_bytes"],
        o["initializers"],
        gib(o["weight_bytes"].as_u64().unwrap_or(0)),
        o["initializers_page_aligned"],
        gib(o["weight_bytes_page_aligned"].as_u64().unwrap_or(0)),
    );
    for s in report["stages"].as_array().into_iter().flatten() {
        println!(
            "    {:<9} {:>6.1} s  peak RSS {:>6.1} MiB  anon {:>6.1} MiB",
            s["name"].as_str().unwrap_or(""),
            s["seconds"].as_f64().unwrap_or(f64::NAN),
            mib(s["peak_rss"].as_u64().unwrap_or(0)),
            mib(s["peak_anon"].as_u64().unwrap_or(0)),
        );
    }
    if a.dtype != "f32" {
        if !a.keep {
            std::fs::remove_dir_all(&out)?;
        }
        return Ok(());
    }

    let actions = dir.join("reference-actions.safetensors");
    if !a.no_reference {
        let p = util::memcap_measure(
            &[],
            &super::pi05_run::petite_run(&petite, &checkpoint, &inputs, &actions),
            &json,
        )?;
        if p.exit != 0 {
            bail!("petite pi05 run failed (exit {})", p.exit);
        }
        println!(
            "  petite pi05 run (reference executor, f32): {:.1} s per chunk (whole process), peak RSS {:.2} GiB",
            p.wall_s,
            gib(p.peak_rss)
        );
    }
    let mut cmd = Command::new(&python);
    cmd.arg(root.join("conformance/onnxruntime/run_pi05_onnx.py"))
        .arg(&out)
        .arg("--inputs")
        .arg(&inputs)
        .args(["--runs", &a.runs.to_string()]);
    if a.no_prepack {
        cmd.arg("--no-prepack");
    }
    if !a.no_reference {
        cmd.arg("--expected")
            .arg(&actions)
            .args(["--key", "actions", "--tol", "1e-4"]);
    }
    let r = util::memcap_measure(&["--limit", &a.ort_limit], &cmd, &json)?;
    if r.oom_killed {
        bail!(
            "ONNX Runtime outgrew --ort-limit {} and was killed",
            a.ort_limit
        );
    }
    let line = r
        .stdout
        .lines()
        .rev()
        .find(|s| s.trim_start().starts_with('{'))
        .with_context(|| format!("the ONNX Runtime driver printed no JSON (exit {})", r.exit))?;
    let v: serde_json::Value = serde_json::from_str(line)?;
    println!(
        "  ONNX Runtime ({}, prepacking {}): session {:.1} s, run {} s per chunk, whole process {:.1} s, peak RSS {:.2} GiB (after session creation {:.2} GiB); max |ORT - reference| {}",
        v["runtime"].as_str().unwrap_or("?"),
        v["prepacking"],
        v["session_s"].as_f64().unwrap_or(f64::NAN),
        v["run_s"],
        r.wall_s,
        gib(r.peak_rss),
        gib(v["peak_rss_bytes_after_session"].as_u64().unwrap_or(0)),
        v["max_abs_err_actions"],
    );
    if !a.keep {
        std::fs::remove_dir_all(&out)?;
    }
    if let Some(limit) = &a.lerobot {
        let py = super::pi05_run::venv()?;
        let mut cmd = Command::new(&py);
        cmd.arg(root.join(super::pi05_run::SCRIPT))
            .arg("--checkpoint")
            .arg(&checkpoint)
            .arg("--inputs")
            .arg(&inputs)
            .args(["--runs", "1", "--warmup", "0", "--threads", "2"]);
        if !a.no_reference {
            cmd.arg("--expected").arg(&actions);
        }
        // No exit check: the script exits 1 when its own 1e-6 comparison fails, figures kept.
        let l = util::memcap_measure(&["--limit", limit], &cmd, &json)?;
        if l.oom_killed {
            bail!("lerobot outgrew --lerobot {limit} and was killed");
        }
        let line = l
            .stdout
            .lines()
            .rev()
            .find(|s| s.trim_start().starts_with('{'))
            .with_context(|| format!("lerobot bench printed no JSON (exit {})", l.exit))?;
        let v: serde_json::Value = serde_json::from_str(line)?;
        println!(
            "  lerobot sample_actions (torch CPU f32, 2 threads): load {} s, {} s per chunk, whole process {:.1} s, peak RSS {:.2} GiB; max |lerobot - reference| {}",
            v["load_s"],
            v["s_per_chunk_median"],
            l.wall_s,
            gib(l.peak_rss),
            v["max_abs_diff_vs_expected"],
        );
    }
    if r.exit != 0 {
        bail!(
            "the ONNX Runtime run failed or missed 1e-4 (exit {})",
            r.exit
        );
    }
    Ok(())
}
