//! `cargo xtask bench gpu-verify`: the wall time of a full-size `petite verify --device cuda`
//! (the goal: under 15 s) — a bf16 reference export of the synthetic checkpoint checked
//! against the f32 reference, both on GPU 0 — with an empty kernel cache (a fresh machine's first
//! run: NVRTC compiles every kernel) and with a warm one, the two alternating a round at a time,
//! the page cache dropped before each run where this process may (root), as on a machine whose
//! disk has not just read the files. `--variant NAME:ITEM,…` (as `bench gpu`'s: `key=value` is
//! petite's `--tune key=value`, `PETITE_X=V` a documented setting) measures variants beside each
//! other, each with its own warm cache. Run it where there
//! is a GPU (the lent H200: `bash .gpu/run.sh xtask bench gpu-verify`); it fails without one.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};

use super::gpu::{Variant, env_text, or_default, parse_variant, schedule};
use crate::util;

/// Options of the verify benchmark.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Full-size lerobot-layout checkpoint (written with `petite pi05 synth` if missing).
    #[arg(long)]
    pub checkpoint: Option<std::path::PathBuf>,
    /// Rounds of every (variant; empty kernel cache, warm kernel cache), the order reversed
    /// every other round.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// A variant: `NAME:ITEM,…` (`key=value`: `--tune key=value`; `PETITE_X=V`: a documented
    /// setting in the environment). Repeatable; without any, one variant `default`.
    #[arg(long = "variant", value_parser = parse_variant)]
    pub variants: Vec<Variant>,
}

/// Drops the page cache (`sync`, then 3 to `drop_caches`); whether it could.
fn drop_page_cache() -> bool {
    let synced = Command::new("sync").status().is_ok_and(|s| s.success());
    synced && std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// One `petite verify --device cuda` with kernels cached in `cache`: wall seconds, the max abs
/// action error and each stage's seconds from the export's report.
fn verify(
    petite: &Path,
    dir: &Path,
    ck: &Path,
    cache: &Path,
    variant: &Variant,
) -> Result<(f64, f64, String)> {
    let mut cmd = Command::new(petite);
    cmd.args(["verify", "--device", "cuda", "--dir"])
        .arg(dir)
        .arg("--checkpoint")
        .arg(ck)
        .args(variant.tune_args())
        .env("PETITE_CUDA_CACHE", cache);
    for (k, v) in &variant.env {
        cmd.env(k, v);
    }
    let t0 = Instant::now();
    util::run(&mut cmd)?;
    let wall = t0.elapsed().as_secs_f64();
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("report.json"))?)?;
    let v = &report["verify"];
    if v["device"] != "cuda" {
        bail!("verify did not run on cuda: {v}");
    }
    let e = v["max_abs_action_error"]
        .as_f64()
        .context("report.json: no verify.max_abs_action_error")?;
    let stages = v["stages"]
        .as_array()
        .map(|s| {
            s.iter()
                .map(|st| {
                    format!(
                        "{} {:.2} s",
                        st["name"].as_str().unwrap_or("?"),
                        st["seconds"].as_f64().unwrap_or(f64::NAN)
                    )
                })
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default();
    Ok((wall, e, stages))
}

/// Runs the benchmark.
pub fn run(a: &Args) -> Result<()> {
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let petite = crate::conformance::petite_bin()?;
    let ck = match &a.checkpoint {
        Some(p) => p.clone(),
        None => util::full_checkpoint(&petite)?,
    };
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("export");
    util::run(
        Command::new(&petite)
            .args(["export", "--dtype", "bf16", "--checkpoint"])
            .arg(&ck)
            .arg("--out")
            .arg(&dir),
    )?;
    let variants = or_default(&a.variants);
    // Each variant's warm cache: filled by one untimed run.
    let warm = |vi: usize| tmp.path().join(format!("kernels-warm-{vi}"));
    for (vi, v) in variants.iter().enumerate() {
        verify(&petite, &dir, &ck, &warm(vi), v)?;
    }
    let mut rows = Vec::new();
    for (round, vi, ki) in schedule(variants.len(), 2, a.rounds) {
        let variant = &variants[vi];
        let (kind, cache) = match ki {
            0 => (
                "empty",
                tmp.path().join(format!("kernels-empty-{vi}-{round}")),
            ),
            _ => ("warm", warm(vi)),
        };
        let dropped = drop_page_cache();
        let (wall, e, stages) = verify(&petite, &dir, &ck, &cache, variant)?;
        println!(
            "gpu-verify: round {round}, {} (environment {}), {kind} kernel cache: {wall:.2} s wall, max abs action error {e:.3e}; {stages}{}",
            variant.name,
            env_text(variant),
            if dropped {
                ""
            } else {
                " (page cache NOT dropped: not root?)"
            }
        );
        rows.push(format!(
            "| {round} | {} | {kind} | {} | {wall:.2} | {stages} | {e:.3e} |",
            variant.name,
            if dropped { "dropped" } else { "kept" }
        ));
    }
    println!(
        "\n| round | variant | kernel cache | page cache | wall s | stages | max abs action error |\n|---|---|---|---|---|---|---|"
    );
    for r in rows {
        println!("{r}");
    }
    Ok(())
}
