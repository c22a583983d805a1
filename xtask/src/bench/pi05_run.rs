//! `cargo xtask bench pi05-run`: seconds per action chunk of `petite pi05 run` (full-size pi0.5,
//! f32, reference executor) next to lerobot 0.6.1's PyTorch CPU float32 `sample_actions`
//! (`conformance/lerobot/bench_sample_actions.py` in `target/venv-lerobot`), same checkpoint,
//! same inputs, same run. Both run under `memcap` (measuring only) for their peaks; lerobot is
//! also given petite's actions as `--expected`, so the run reports their max |Δ| at full size.
//!
//! Both are timed with their weights in memory: lerobot's chunk excludes its load (it reads the
//! whole checkpoint into its tensors), so before each petite run the checkpoint is read once
//! into the page cache, untimed, and reported beside it. petite itself gives each weight's
//! pages back after its last use, so every run starts from that read.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use petite_weights::{Dtype, SafetensorsWriter, TensorSpec};

pub(super) const SCRIPT: &str = "conformance/lerobot/bench_sample_actions.py";

/// Options of the pi0.5 run benchmark.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Full-size lerobot-layout checkpoint (written with `petite pi05 synth` if missing).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Timed chunks of each (lerobot's after `--warmup`; petite's one process each): medians.
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
    /// Untimed lerobot warm-up chunks.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// torch threads (petite's reference executor uses all cores).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
}

fn memcap(cmd: &Command, json: &Path) -> Result<crate::util::MemcapRun> {
    // No exit check: the lerobot script exits 1 when its own 1e-6 comparison fails, and its
    // figures are still wanted.
    crate::util::memcap_measure(&[], cmd, json)
}

/// Inputs of the real config (3 cameras 224², 200 tokens of which 48 real, chunk 50 × 32):
/// deterministic, images in [-1, 1], one camera masked.
pub(super) fn write_inputs(path: &Path) -> Result<()> {
    write_inputs_for(path, &[1, 0, 1], 200, 48, 50)
}

/// Deterministic inputs for the real pi0.5 at other settings: one image a slot of `masks` (0: an
/// empty slot), `tokens` of which the first `real` are real, noise `[chunk, 32]`.
pub(super) fn write_inputs_for(
    path: &Path,
    masks: &[u8],
    tokens: usize,
    real: usize,
    chunk: usize,
) -> Result<()> {
    let cams = masks.len();
    let table = [
        TensorSpec::new("images", Dtype::F32, &[cams, 3, 224, 224]),
        TensorSpec::new("image_masks", Dtype::U8, &[cams]),
        TensorSpec::new("tokens", Dtype::I64, &[tokens]),
        TensorSpec::new("token_mask", Dtype::U8, &[tokens]),
        TensorSpec::new("noise", Dtype::F32, &[chunk, 32]),
    ];
    let w = SafetensorsWriter::create(path, &table, &[])?;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let unit = |b: u64| (b >> 40) as f32 / (1u64 << 24) as f32;
    let images: Vec<u8> = (0..cams * 3 * 224 * 224)
        .flat_map(|_| (unit(next()) * 2.0 - 1.0).to_le_bytes())
        .collect();
    w.write_at("images", 0, &images)?;
    w.write_at("image_masks", 0, masks)?;
    let ids: Vec<u8> = (0..tokens)
        .flat_map(|i| {
            let t = if i < real { 2 + next() % 257_000 } else { 0 };
            (t as i64).to_le_bytes()
        })
        .collect();
    w.write_at("tokens", 0, &ids)?;
    let mask: Vec<u8> = (0..tokens).map(|i| u8::from(i < real)).collect();
    w.write_at("token_mask", 0, &mask)?;
    // Standard normal noise (Box–Muller), as the sampler draws it.
    let noise: Vec<u8> = (0..chunk * 32)
        .flat_map(|_| {
            let (u1, u2) = (unit(next()).max(1e-7), unit(next()));
            ((-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()).to_le_bytes()
        })
        .collect();
    w.write_at("noise", 0, &noise)?;
    w.finish()?;
    Ok(())
}

/// `petite pi05 run` in f32 on the reference executor: `checkpoint`, `inputs` → `out`.
pub(super) fn petite_run(petite: &Path, checkpoint: &Path, inputs: &Path, out: &Path) -> Command {
    let mut c = Command::new(petite);
    c.args(["pi05", "run", "--dtype", "f32", "--checkpoint"])
        .arg(checkpoint)
        .arg("--inputs")
        .arg(inputs)
        .arg("--out")
        .arg(out);
    c
}

/// `target/venv-lerobot`, the lerobot tier's venv (built from the same pinned requirements).
pub(super) fn venv() -> Result<PathBuf> {
    crate::conformance::Venv::Lerobot.python()
}

/// Runs the benchmark.
pub fn run(a: &Args) -> Result<()> {
    let root = crate::util::root();
    let petite = crate::util::release_petite()?;
    let dir = root.join("target").join("bench-pi05-run");
    std::fs::create_dir_all(&dir)?;
    let json = dir.join("memcap.json");
    let checkpoint = match &a.checkpoint {
        Some(c) => c.clone(),
        None => crate::util::full_checkpoint(&petite)?,
    };
    let inputs = dir.join("inputs.safetensors");
    let actions = dir.join("actions.safetensors");
    write_inputs(&inputs)?;
    let python = venv()?;

    let mut walls = Vec::new();
    let mut warm_s = Vec::new();
    let mut p = None;
    for _ in 0..a.runs.max(1) {
        warm_s.push(read_into_page_cache(&checkpoint)?);
        let r = memcap(&petite_run(&petite, &checkpoint, &inputs, &actions), &json)?;
        if r.exit != 0 {
            bail!("petite pi05 run failed (exit {})", r.exit);
        }
        walls.push(r.wall_s);
        p = Some(r);
    }
    let p = p.context("no petite run")?;
    let petite_s = median(&mut walls);
    let l = memcap(
        Command::new(&python)
            .arg(root.join(SCRIPT))
            .arg("--checkpoint")
            .arg(&checkpoint)
            .arg("--inputs")
            .arg(&inputs)
            .arg("--expected")
            .arg(&actions)
            .args(["--runs", &a.runs.to_string()])
            .args(["--warmup", &a.warmup.to_string()])
            .args(["--threads", &a.threads.to_string()]),
        &json,
    )?;
    // The script exits 1 when the actions differ by more than 1e-6 but still prints its JSON.
    let line = l
        .stdout
        .lines()
        .rev()
        .find(|s| s.trim_start().starts_with('{'))
        .with_context(|| format!("lerobot bench printed no JSON (exit {})", l.exit))?;
    let v: serde_json::Value = serde_json::from_str(line)?;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let lerobot_s = v["s_per_chunk_median"].as_f64().unwrap_or(f64::NAN);
    println!(
        "bench pi05-run: full-size pi0.5, f32, checkpoint {}",
        checkpoint.display()
    );
    println!(
        "  petite pi05 run: {petite_s:.1} s per chunk (median of {}: {}; whole process: open, timestep table, prefix, Euler steps), peak RSS {:.2} GiB; checkpoint read into the page cache before each, untimed: {} s",
        walls.len(),
        walls
            .iter()
            .map(|w| format!("{w:.1}"))
            .collect::<Vec<_>>()
            .join(", "),
        gib(p.peak_rss),
        warm_s
            .iter()
            .map(|w| format!("{w:.1}"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    for s in p.stdout.lines() {
        println!("    {s}");
    }
    println!(
        "  lerobot sample_actions (torch CPU f32, {} threads): {lerobot_s:.1} s per chunk (median of {}; load {} s), peak RSS {:.2} GiB",
        a.threads,
        a.runs,
        v["load_s"],
        gib(l.peak_rss)
    );
    println!(
        "  ratio (petite / lerobot): {:.2}; max |actions Δ| {}",
        petite_s / lerobot_s,
        v["max_abs_diff_vs_expected"]
    );
    Ok(())
}

/// Reads `path` once, start to end (into the page cache, as lerobot's load reads it into its
/// tensors); returns the seconds it took.
fn read_into_page_cache(path: &Path) -> Result<f64> {
    use std::io::Read;
    let t = std::time::Instant::now();
    let mut f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut buf = vec![0u8; 8 << 20];
    while f
        .read(&mut buf)
        .with_context(|| format!("reading {}", path.display()))?
        > 0
    {}
    Ok(t.elapsed().as_secs_f64())
}

/// The median (the mean of the middle two for an even count).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
