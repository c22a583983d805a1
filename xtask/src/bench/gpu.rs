//! `cargo xtask bench gpu`: pi0.5 chunks on CUDA GPU 0 through petite-cuda (full size, bf16 with
//! its f32 products as TF32 and exact, and f32): per-chunk latency (median of the timed chunks after warm-up, CUDA events) with the
//! prefix/steps split and peak device memory, beside the physical floor of the same programs —
//! their dense FLOPs at the GPU's matrix rate for the dtype each product reads (bf16, or f32 for
//! the f32 products, SigLIP's in lerobot's bf16 mode, or TF32 where they run so) and their
//! weight bytes at its memory
//! bandwidth, both measured in the same run with PyTorch on the same GPU when python3 has a
//! CUDA torch (else the H200 datasheet's rates, said so).
//!
//! Run it where there is a GPU (the lent H200: a prebuilt `petite` through `XTASK_PETITE_BIN`,
//! the tree through `XTASK_ROOT`); it fails without one.
//!
//! `--variant NAME:ITEM,…` (repeatable) measures the same binary under other options: an ITEM
//! `key=value` is petite's hidden `--tune key=value` (`fuse=off`, `offsets=literal`,
//! `attention_queries=N|all|off`), checked against the `"tuning"` its timing JSON records; an
//! ITEM `PETITE_X=V` is environment, for a documented setting only (README "Settings"; a removed
//! switch is refused, naming its measurement in docs/MEASUREMENTS.md). `--rounds N` runs every
//! (variant, dtype) N times, the order reversed every other round, so that variants are
//! compared within one call, alternating, as these machines' noise needs; each variant's
//! actions are compared with the first's (bits, or the largest difference).
//!
//! `--settings` measures bf16 (TF32) at issue 49's three settings instead — lerobot's defaults
//! (3 cameras, 200 tokens, chunk 50), LIBERO-like (2 cameras + 1 empty slot, 48 tokens, chunk
//! 10) and the public ports' (2 cameras, chunk 10) — each with its own config (`petite pi05
//! default-config` changed in cameras, tokens and chunk), inputs and floor, in one table with the
//! issue's goal beside each.

use std::process::Command;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::util;

/// Options of the GPU benchmark.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Full-size lerobot-layout checkpoint (written with `petite pi05 synth` if missing).
    #[arg(long)]
    pub checkpoint: Option<std::path::PathBuf>,
    /// Timed chunks a dtype (after `--warmup`).
    #[arg(long, default_value_t = 20)]
    pub chunks: usize,
    /// Untimed warm-up chunks.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Numerics to measure: `bf16` (its f32 products as TF32, `petite pi05 run`'s default),
    /// `bf16-exact` (its f32 products exact f32) and `f32`.
    #[arg(long, value_delimiter = ',', default_value = "bf16,bf16-exact,f32")]
    pub dtypes: Vec<String>,
    /// Keep the inputs (`inputs.safetensors`), each run's actions (`RUN-actions.safetensors`)
    /// and timing JSON (`RUN.json`) in this directory instead of a temporary one.
    #[arg(long)]
    pub keep: Option<std::path::PathBuf>,
    /// A variant to measure beside the others: `NAME:ITEM,ITEM` (`key=value`: `petite --tune
    /// key=value`; `PETITE_X=V`: a documented setting in the environment; `NAME:` for none).
    /// Repeatable; without any, one variant `default`. The first is the baseline of the
    /// summary's ratios and action comparisons.
    #[arg(long = "variant", value_parser = parse_variant)]
    pub variants: Vec<Variant>,
    /// Rounds of every (variant, dtype), the order reversed every other round.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Instead of the dtypes at lerobot's settings: bf16 (TF32) at each of [`SETTINGS`] —
    /// lerobot's defaults, LIBERO-like and the public ports' — each beside its own floor.
    #[arg(long, conflicts_with_all = ["variants", "dtypes", "rounds"])]
    pub settings: bool,
}

/// A setting of the real pi0.5 the `--settings` table measures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Setting {
    /// Its name in the table.
    pub name: &'static str,
    /// One entry a camera slot: 1 a camera, 0 an always-empty slot (masked).
    pub masks: &'static [u8],
    /// Language tokens, and how many of them are real.
    pub tokens: (usize, usize),
    /// Actions a chunk.
    pub chunk: usize,
    /// Issue 49's goal for the chunk on the H200, ms (`None`: to beat the public ports).
    pub goal_ms: Option<f64>,
}

/// Issue 49's settings: lerobot's defaults (3 cameras, 200 tokens, chunk 50), LIBERO-like (2
/// cameras + 1 empty slot, 48 tokens, chunk 10) and the public ports' (2 cameras, chunk 10; their
/// prompt length is not published: 48 tokens, as LIBERO's).
pub const SETTINGS: [Setting; 3] = [
    Setting {
        name: "lerobot-defaults",
        masks: &[1, 1, 1],
        tokens: (200, 48),
        chunk: 50,
        goal_ms: Some(15.0),
    },
    Setting {
        name: "libero-like",
        masks: &[1, 1, 0],
        tokens: (48, 48),
        chunk: 10,
        goal_ms: Some(12.0),
    },
    Setting {
        name: "public-ports",
        masks: &[1, 1],
        tokens: (48, 48),
        chunk: 10,
        goal_ms: None,
    },
];

/// `default` (the real pi0.5's config as `petite pi05 default-config` prints it) at `s`.
fn setting_config(default: &Value, s: &Setting) -> Result<Value> {
    let mut c = default.clone();
    let o = c
        .as_object_mut()
        .context("petite pi05 default-config did not print an object")?;
    for (k, v) in [
        ("cameras", s.masks.len()),
        ("tokens", s.tokens.0),
        ("chunk", s.chunk),
    ] {
        if !o.contains_key(k) {
            bail!("petite pi05 default-config has no {k:?}");
        }
        o.insert(k.into(), v.into());
    }
    Ok(c)
}

/// One round of a (variant, dtype): its (chunk, prefix, steps) medians and its actions' file.
type Round = ([f64; 3], std::path::PathBuf);

/// `key=value VAR=VALUE`, or `(none)`.
pub(crate) fn env_text(v: &Variant) -> String {
    if v.env.is_empty() && v.tune.is_empty() {
        return "(none)".into();
    }
    v.tune
        .iter()
        .chain(&v.env)
        .map(|(k, x)| format!("{k}={x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A named set of options for the `petite` runs ([`Args::variants`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Variant {
    /// Its name in the tables (letters, digits, `-`, `_`, `.`).
    pub name: String,
    /// `(key, value)` pairs passed as `--tune key=value`.
    pub tune: Vec<(String, String)>,
    /// `(VAR, VALUE)` pairs of documented settings, set in the environment.
    pub env: Vec<(String, String)>,
}

impl Variant {
    /// `--tune key=value` for each of [`Variant::tune`].
    pub(crate) fn tune_args(&self) -> Vec<String> {
        self.tune
            .iter()
            .flat_map(|(k, v)| ["--tune".to_string(), format!("{k}={v}")])
            .collect()
    }
}

/// `variants`, or one variant `default` with no options where none were given.
pub(crate) fn or_default(variants: &[Variant]) -> Vec<Variant> {
    if variants.is_empty() {
        return vec![Variant {
            name: "default".into(),
            tune: Vec::new(),
            env: Vec::new(),
        }];
    }
    variants.to_vec()
}

/// The names README's "Settings" table documents (its rows' first cells).
pub(crate) fn documented_settings(readme: &str) -> Vec<String> {
    let Some(at) = readme.find("\n## Settings\n") else {
        return Vec::new();
    };
    readme[at + 1..]
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_string)
        .collect()
}

/// Where docs/MEASUREMENTS.md's "Switches decided (issue 52)" section decides `name`: its row.
pub(crate) fn decided(measurements: &str, name: &str) -> Option<String> {
    let at = measurements.find("## Switches decided (issue 52)")?;
    measurements[at..]
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .find(|l| l.starts_with(&format!("| `{name}`")))
        .map(|l| l.trim().to_string())
}

/// `NAME:ITEM,ITEM` (or `NAME:`), the settings and decisions read from the tree's README and
/// docs/MEASUREMENTS.md ([`parse_variant_with`]).
pub(crate) fn parse_variant(s: &str) -> std::result::Result<Variant, String> {
    let root = util::root();
    let read = |p: &str| std::fs::read_to_string(root.join(p)).unwrap_or_default();
    parse_variant_with(
        s,
        &documented_settings(&read("README.md")),
        &read("docs/MEASUREMENTS.md"),
    )
}

/// `NAME:ITEM,ITEM`: an ITEM `key=value` (lower case) becomes `--tune key=value`; `PETITE_X=V`
/// is environment when `settings` documents `PETITE_X`, else refused — naming its row of
/// `measurements`' "Switches decided (issue 52)" when it was decided there.
pub(crate) fn parse_variant_with(
    s: &str,
    settings: &[String],
    measurements: &str,
) -> std::result::Result<Variant, String> {
    let (name, rest) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected NAME:ITEM,… (or NAME: for none)"))?;
    let ok = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
    if name.is_empty() || !name.chars().all(ok) {
        return Err(format!(
            "{s:?}: a variant's name is letters, digits, '-', '_' or '.'"
        ));
    }
    let (mut tune, mut env) = (Vec::new(), Vec::new());
    for kv in rest.split(',').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("{s:?}: {kv:?} is not KEY=VALUE"))?;
        let lower = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_';
        if k.starts_with("PETITE_") {
            if !settings.iter().any(|n| n == k) {
                return Err(match decided(measurements, k) {
                    Some(row) => format!(
                        "{s:?}: {k} is no setting any more (docs/MEASUREMENTS.md, \"Switches decided (issue 52)\": {row})"
                    ),
                    None => format!(
                        "{s:?}: {k} is not a documented setting (README \"Settings\": {})",
                        settings.join(", ")
                    ),
                });
            }
            env.push((k.to_string(), v.to_string()));
        } else if !k.is_empty() && k.chars().all(lower) {
            tune.push((k.to_string(), v.to_string()));
        } else {
            return Err(format!(
                "{s:?}: {k:?} is neither a --tune key (fuse, offsets, attention_queries, host_gather) nor a PETITE_ setting"
            ));
        }
    }
    Ok(Variant {
        name: name.to_string(),
        tune,
        env,
    })
}

/// Checks that a run applied `v`'s tuning: each key's value in the timing JSON's `"tuning"`
/// (a variant that never reached the child once cost a GPU session four calls).
pub(crate) fn check_tuning(v: &Variant, timing: &Value) -> Result<()> {
    for (k, want) in &v.tune {
        let got = timing["tuning"][k.as_str()].as_str().unwrap_or("(missing)");
        let want = if k == "attention_queries" && want == "0" {
            "off"
        } else {
            want.as_str()
        };
        if got != want {
            bail!(
                "variant {}: asked {k}={want}, the run recorded {k}={got}",
                v.name
            );
        }
    }
    Ok(())
}

/// Every (variant, dtype) of `rounds` rounds in run order: variants outermost, the whole order
/// reversed in odd rounds (A B, B A, A B, …).
pub(crate) fn schedule(
    variants: usize,
    dtypes: usize,
    rounds: usize,
) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::with_capacity(variants * dtypes * rounds);
    for r in 0..rounds {
        let mut order: Vec<(usize, usize)> = (0..variants)
            .flat_map(|v| (0..dtypes).map(move |d| (v, d)))
            .collect();
        if r % 2 == 1 {
            order.reverse();
        }
        out.extend(order.into_iter().map(|(v, d)| (r, v, d)));
    }
    out
}

/// The `actions` f32 values of a `petite pi05 run --out` file.
fn actions(path: &std::path::Path) -> Result<Vec<f32>> {
    let bytes = std::fs::read(path).with_context(|| format!("read {}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .with_context(|| format!("parse {}", path.display()))?;
    let t = st
        .tensor("actions")
        .with_context(|| format!("{}: no actions", path.display()))?;
    if t.dtype() != safetensors::Dtype::F32 || t.data().is_empty() {
        bail!("{}: actions are not a non-empty f32 tensor", path.display());
    }
    Ok(t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// How `b`'s actions compare with `a`'s: `bit-identical` or the largest difference (through
/// the gpu tier's [`crate::conformance::gpu::max_err`]: a length mismatch, emptiness or a
/// non-finite value fails).
fn compare_actions(a: &[f32], b: &[f32]) -> Result<String> {
    let d = crate::conformance::gpu::max_err(a, b)?;
    if a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()) {
        return Ok("bit-identical".into());
    }
    Ok(format!("max abs difference {d:.3e}"))
}

/// What PyTorch measures on the GPU: dense bf16 and f32 matmul rates and a copy's bandwidth.
const PEAKS_PY: &str = r#"
import json, torch
torch.backends.cuda.matmul.allow_tf32 = False
def rate(dtype, n=8192, reps=10):
    a = torch.randn(n, n, device="cuda", dtype=dtype); b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3): a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): a @ b
    e.record(); torch.cuda.synchronize()
    return 2 * n**3 * reps / (s.elapsed_time(e) / 1e3)
x = torch.empty(1 << 31, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda.synchronize(); s.record()
for _ in range(10): y.copy_(x)
e.record(); torch.cuda.synchronize()
bw = 2 * x.numel() * 10 / (s.elapsed_time(e) / 1e3)
f32 = rate(torch.float32)
torch.backends.cuda.matmul.allow_tf32 = True
tf32 = rate(torch.float32)
print(json.dumps({"bf16_flops": rate(torch.bfloat16), "f32_flops": f32, "tf32_flops": tf32, "copy_bytes_per_s": bw, "device": torch.cuda.get_device_name()}))
"#;

/// The GPU's rates a floor is computed from.
struct Peaks {
    /// Dense bf16 matmul, FLOP/s.
    bf16: f64,
    /// Dense f32 matmul without TF32, FLOP/s.
    f32: f64,
    /// Dense f32 matmul with TF32, FLOP/s.
    tf32: f64,
    /// Device-to-device copy, bytes/s (read + write).
    copy: f64,
    /// Where the figures come from.
    source: String,
}

/// H200 SXM datasheet rates (bf16, f32, TF32, bandwidth), used only when PyTorch cannot measure.
const DATASHEET: [f64; 4] = [989e12, 67e12, 494e12, 4.8e12];

fn peaks() -> Peaks {
    let out = Command::new("python3").args(["-c", PEAKS_PY]).output();
    if let Ok(o) = out
        && o.status.success()
        && let Ok(v) = serde_json::from_slice::<Value>(&o.stdout)
    {
        let g = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        return Peaks {
            bf16: g("bf16_flops"),
            f32: g("f32_flops"),
            tf32: g("tf32_flops"),
            copy: g("copy_bytes_per_s"),
            source: format!("measured with PyTorch on {}", v["device"]),
        };
    }
    let [bf16, f32, tf32, copy] = DATASHEET;
    Peaks {
        bf16,
        f32,
        tf32,
        copy,
        source: "H200 datasheet (PyTorch could not measure here)".into(),
    }
}

/// The physical floor of a run's chunk, ms, from its timing JSON: each product at its own
/// rate — f32 products (all of them in f32 mode; SigLIP in lerobot's bf16 mode) at the f32 rate,
/// or TF32's when they run as TF32, 16-bit ones at the bf16 rate — or its weights' bytes at the
/// copy bandwidth, whichever is longer, for the prefix and each step.
fn floor_ms(pk: &Peaks, v: &Value, f32_matmul: &str) -> Result<f64> {
    let steps = num(v, "steps")?;
    let f32_rate = if f32_matmul == "tf32" {
        pk.tf32
    } else {
        pk.f32
    };
    let floor_s = |flops: f64, flops_f32: f64, bytes: f64| {
        ((flops - flops_f32) / pk.bf16 + flops_f32 / f32_rate).max(bytes / pk.copy)
    };
    let floor = floor_s(
        num(v, "prefix_flops")?,
        num(v, "prefix_flops_f32")?,
        num(v, "prefix_weight_bytes")?,
    ) + steps
        * floor_s(
            num(v, "step_flops")?,
            num(v, "step_flops_f32")?,
            num(v, "step_weight_bytes")?,
        );
    Ok(floor * 1e3)
}

/// `--settings`: one bf16 (TF32) run a setting, each beside its own floor, in one table.
fn run_settings(
    a: &Args,
    petite: &std::path::Path,
    ck: &std::path::Path,
    dir: &std::path::Path,
    pk: &Peaks,
) -> Result<()> {
    let out = Command::new(petite)
        .args(["pi05", "default-config"])
        .output()
        .context("petite pi05 default-config")?;
    if !out.status.success() {
        bail!(
            "petite pi05 default-config failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let default: Value =
        serde_json::from_slice(&out.stdout).context("petite pi05 default-config's JSON")?;
    let mut rows = Vec::new();
    for s in &SETTINGS {
        let config = dir.join(format!("{}-config.json", s.name));
        std::fs::write(
            &config,
            serde_json::to_string_pretty(&setting_config(&default, s)?)?,
        )?;
        let inputs = dir.join(format!("{}-inputs.safetensors", s.name));
        super::pi05_run::write_inputs_for(&inputs, s.masks, s.tokens.0, s.tokens.1, s.chunk)?;
        let json = dir.join(format!("{}.json", s.name));
        util::run(
            Command::new(petite)
                .args([
                    "pi05",
                    "run",
                    "--device",
                    "cuda",
                    "--dtype",
                    "bf16",
                    "--f32-matmul",
                    "tf32",
                ])
                .arg("--config")
                .arg(&config)
                .arg("--checkpoint")
                .arg(ck)
                .arg("--inputs")
                .arg(&inputs)
                .arg("--out")
                .arg(dir.join(format!("{}-actions.safetensors", s.name)))
                .args(["--repeat", &a.chunks.to_string()])
                .args(["--warmup", &a.warmup.to_string()])
                .arg("--timing-json")
                .arg(&json),
        )?;
        let v: Value = serde_json::from_slice(&std::fs::read(&json)?)?;
        println!("gpu bench: {}: {}", s.name, serde_json::to_string(&v)?);
        let floor = floor_ms(pk, &v, "tf32")?;
        let median = num(&v, "median_chunk_ms")?;
        if !(median.is_finite() && median > 0.0 && floor > 0.0) {
            bail!(
                "{}: unusable figures: median {median} ms, floor {floor} ms",
                s.name
            );
        }
        let empty = s.masks.iter().filter(|&&m| m == 0).count();
        rows.push(format!(
            "| {} | {} ({} empty) | {} ({} real) | {} | {median:.2} | {:.2} | {:.2} | {floor:.2} | {:.1}× | {} |",
            s.name,
            s.masks.len(),
            empty,
            s.tokens.0,
            s.tokens.1,
            s.chunk,
            num(&v, "median_prefix_ms")?,
            num(&v, "median_steps_ms")?,
            median / floor,
            s.goal_ms.map_or_else(|| "ahead of the ports".to_string(), |g| format!("≤ {g} ms{}", if median <= g { " (met)" } else { "" })),
        ));
    }
    println!(
        "\n| setting | camera slots | tokens | chunk | chunk ms (median) | prefix ms | 10 steps ms | floor ms | × floor | goal (H200) |\n|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in rows {
        println!("{r}");
    }
    Ok(())
}

fn num(v: &Value, k: &str) -> Result<f64> {
    v[k].as_f64()
        .with_context(|| format!("timing JSON has no {k}"))
}

/// Runs the benchmark.
pub fn run(a: &Args) -> Result<()> {
    let petite = crate::conformance::petite_bin()?;
    let ck = match &a.checkpoint {
        Some(p) => p.clone(),
        None => util::full_checkpoint(&petite)?,
    };
    let tmp = tempfile::tempdir()?;
    let dir = match &a.keep {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
            d.as_path()
        }
        None => tmp.path(),
    };
    let pk = peaks();
    println!(
        "gpu bench: rates {}: bf16 matmul {:.0} TFLOP/s, f32 matmul {:.1} TFLOP/s (TF32 {:.0}), copy {:.2} TB/s",
        pk.source,
        pk.bf16 / 1e12,
        pk.f32 / 1e12,
        pk.tf32 / 1e12,
        pk.copy / 1e12
    );
    if a.settings {
        return run_settings(a, &petite, &ck, dir, &pk);
    }
    let inputs = dir.join("inputs.safetensors");
    super::pi05_run::write_inputs(&inputs)?;
    let variants = or_default(&a.variants);
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let mut names = std::collections::HashSet::new();
    if let Some(v) = variants.iter().find(|v| !names.insert(&v.name)) {
        bail!("--variant {:?} given twice", v.name);
    }
    let runs = a
        .dtypes
        .iter()
        .map(|run| match run.as_str() {
            "bf16" => Ok((run.as_str(), "bf16", "tf32")),
            "bf16-exact" => Ok((run.as_str(), "bf16", "exact")),
            "f32" => Ok((run.as_str(), "f32", "exact")),
            other => bail!("--dtypes: unknown {other:?} (bf16, bf16-exact, f32)"),
        })
        .collect::<Result<Vec<_>>>()?;
    let many = variants.len() > 1 || a.rounds > 1;
    let mut rows = Vec::new();
    // By (variant, dtype): each round's (chunk, prefix, steps) medians and its actions' file.
    let mut got: std::collections::BTreeMap<(usize, usize), Vec<Round>> = Default::default();
    for (round, vi, di) in schedule(variants.len(), runs.len(), a.rounds) {
        let variant = &variants[vi];
        let (run, dtype, f32_matmul) = runs[di];
        let label = if many {
            format!("{}-{run}-r{round}", variant.name)
        } else {
            run.to_string()
        };
        let json = dir.join(format!("{label}.json"));
        let out = dir.join(format!("{label}-actions.safetensors"));
        let mut cmd = Command::new(&petite);
        cmd.args(["pi05", "run", "--device", "cuda", "--dtype", dtype])
            .args(["--f32-matmul", f32_matmul])
            .arg("--checkpoint")
            .arg(&ck)
            .arg("--inputs")
            .arg(&inputs)
            .arg("--out")
            .arg(&out)
            .args(["--repeat", &a.chunks.to_string()])
            .args(["--warmup", &a.warmup.to_string()])
            .arg("--timing-json")
            .arg(&json);
        cmd.args(variant.tune_args());
        for (k, v) in &variant.env {
            cmd.env(k, v);
        }
        if many {
            println!("gpu bench: {label}: environment {}", env_text(variant));
        }
        util::run(&mut cmd)?;
        let v: Value = serde_json::from_slice(&std::fs::read(&json)?)?;
        check_tuning(variant, &v)?;
        // Each product at its own rate: f32 products (all of them in f32 mode; SigLIP in
        // lerobot's bf16 mode) at the f32 rate, or TF32's when they run as TF32, 16-bit ones at
        // the bf16 rate.
        let floor_ms = floor_ms(&pk, &v, f32_matmul)?;
        let median = num(&v, "median_chunk_ms")?;
        if !(median.is_finite() && median > 0.0 && floor_ms > 0.0) {
            bail!("{label}: unusable figures: median {median} ms, floor {floor_ms} ms");
        }
        let (prefix, steps_ms) = (num(&v, "median_prefix_ms")?, num(&v, "median_steps_ms")?);
        let gib = |k: &str| num(&v, k).map(|b| b / (1u64 << 30) as f64);
        rows.push(format!(
            "| petite-cuda {label} | {median:.2} | {prefix:.2} | {steps_ms:.2} | {:.2} | {:.2} | {:.2} | {floor_ms:.2} | {:.1}× |",
            num(&v, "median_wall_ms")?,
            gib("weight_bytes")?,
            gib("peak_pool_bytes")?,
            median / floor_ms
        ));
        got.entry((vi, di))
            .or_default()
            .push(([median, prefix, steps_ms], out));
        println!("gpu bench: {label}: {}", serde_json::to_string(&v)?);
    }
    println!(
        "\n| run | chunk ms (median) | prefix ms | 10 steps ms | wall ms | weights GiB | peak buffers GiB | floor ms | × floor |\n|---|---|---|---|---|---|---|---|---|"
    );
    for r in rows {
        println!("{r}");
    }
    if many {
        println!(
            "\n| variant | environment | run | chunk ms (each round) | prefix ms | 10 steps ms | chunk × {} | actions against {} |\n|---|---|---|---|---|---|---|---|",
            variants[0].name, variants[0].name
        );
        let median = |x: &mut Vec<f64>| {
            x.sort_by(f64::total_cmp);
            x[x.len() / 2]
        };
        for (di, (run, ..)) in runs.iter().enumerate() {
            let base = &got[&(0, di)];
            let base_chunk = median(&mut base.iter().map(|r| r.0[0]).collect());
            let base_actions = actions(&base[0].1)?;
            for (vi, variant) in variants.iter().enumerate() {
                let mine = &got[&(vi, di)];
                let each = |k: usize| {
                    mine.iter()
                        .map(|r| format!("{:.2}", r.0[k]))
                        .collect::<Vec<_>>()
                        .join(" / ")
                };
                let chunk = median(&mut mine.iter().map(|r| r.0[0]).collect());
                // Every round's actions against the baseline's first round.
                let mut cmp = Vec::new();
                for r in mine {
                    cmp.push(compare_actions(&base_actions, &actions(&r.1)?)?);
                }
                cmp.dedup();
                println!(
                    "| {} | {} | {run} | {} | {} | {} | {:.3} | {} |",
                    variant.name,
                    env_text(variant),
                    each(0),
                    each(1),
                    each(2),
                    chunk / base_chunk,
                    cmp.join("; ")
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_setting_is_the_real_config_with_its_cameras_tokens_and_chunk() {
        let default = serde_json::json!({"cameras": 3, "tokens": 200, "chunk": 50, "steps": 10});
        let c = setting_config(&default, &SETTINGS[1]).unwrap();
        assert_eq!(
            c,
            serde_json::json!({"cameras": 3, "tokens": 48, "chunk": 10, "steps": 10})
        );
        assert_eq!(
            setting_config(&default, &SETTINGS[2]).unwrap()["cameras"],
            2
        );
        assert!(setting_config(&serde_json::json!({"chunk": 1}), &SETTINGS[0]).is_err());
        // The inputs match: one image and mask a slot, tokens, noise [chunk, 32].
        let dir = tempfile::tempdir().unwrap();
        for s in &SETTINGS {
            let p = dir.path().join(format!("{}.safetensors", s.name));
            crate::bench::pi05_run::write_inputs_for(&p, s.masks, s.tokens.0, s.tokens.1, s.chunk)
                .unwrap();
            let f = petite_weights::MappedSafetensors::open(&p).unwrap();
            let shape = |n: &str| {
                let e = f.header().entries.iter().find(|e| e.name == n).unwrap();
                e.shape.clone()
            };
            assert_eq!(shape("images"), [s.masks.len(), 3, 224, 224]);
            assert_eq!(shape("image_masks"), [s.masks.len()]);
            assert_eq!(shape("tokens"), [s.tokens.0]);
            assert_eq!(shape("noise"), [s.chunk, 32]);
            let bytes = std::fs::read(&p).unwrap();
            assert_eq!(&bytes[f.file_range("image_masks").unwrap()], s.masks);
        }
    }

    #[test]
    fn variants_parse_and_refuse_what_is_not_one() {
        let settings = ["PETITE_CUDA_TRACE".to_string()];
        let measurements = "# m\n## Switches decided (issue 52)\n\n| `PETITE_CUDA_NO_PDL` | removed | session 15: 31.40 → 30.60 ms |\n\n## Next\n";
        let parse = |s: &str| parse_variant_with(s, &settings, measurements);
        let v = parse("literal:offsets=literal,attention_queries=all,PETITE_CUDA_TRACE=1").unwrap();
        assert_eq!(v.name, "literal");
        assert_eq!(
            v.tune,
            [
                ("offsets".to_string(), "literal".to_string()),
                ("attention_queries".to_string(), "all".to_string())
            ]
        );
        assert_eq!(v.env, [("PETITE_CUDA_TRACE".to_string(), "1".to_string())]);
        assert_eq!(
            v.tune_args(),
            [
                "--tune",
                "offsets=literal",
                "--tune",
                "attention_queries=all"
            ]
        );
        assert_eq!(
            env_text(&v),
            "offsets=literal attention_queries=all PETITE_CUDA_TRACE=1"
        );
        let main = parse("main:").unwrap();
        assert!(main.env.is_empty() && main.tune.is_empty());
        assert_eq!(env_text(&main), "(none)");
        // A removed switch names its measurement; an unknown one the documented settings.
        let e = parse("pdl:PETITE_CUDA_NO_PDL=1").unwrap_err();
        assert!(
            e.contains("Switches decided (issue 52)") && e.contains("session 15"),
            "{e}"
        );
        let e = parse("x:PETITE_CUDA_NO_SUCH=1").unwrap_err();
        assert!(
            e.contains("not a documented setting") && e.contains("PETITE_CUDA_TRACE"),
            "{e}"
        );
        for bad in [
            "main",
            ":x=1",
            "a b:x=1",
            "a:x",
            "a:=1",
            "a:x-y=1",
            "a:Fuse=off",
            "a:HOME=/",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_run_that_did_not_apply_its_tuning_fails() {
        let v = parse_variant_with("q:attention_queries=0,fuse=off", &[], "").unwrap();
        let ok = serde_json::json!({"tuning": {"fuse": "off", "offsets": "params", "attention_queries": "off"}});
        check_tuning(&v, &ok).unwrap();
        let not = serde_json::json!({"tuning": {"fuse": "on", "attention_queries": "off"}});
        assert!(check_tuning(&v, &not).is_err());
        assert!(check_tuning(&v, &serde_json::json!({})).is_err());
    }

    #[test]
    fn the_readme_documents_settings_and_measurements_decide_switches() {
        // The tree's own files: what `parse_variant` reads.
        let root = util::root();
        let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
        let settings = documented_settings(&readme);
        assert!(
            settings.iter().any(|s| s == "PETITE_CUDA_PROFILE"),
            "{settings:?}"
        );
        assert!(
            !settings.iter().any(|s| s == "PETITE_CUDA_NO_PDL"),
            "{settings:?}"
        );
        let m = std::fs::read_to_string(root.join("docs/MEASUREMENTS.md")).unwrap();
        for removed in [
            "PETITE_CUDA_NO_PDL",
            "PETITE_CUDA_UNROLL_ROWS",
            "PETITE_CUDA_NO_FUSE",
        ] {
            assert!(decided(&m, removed).is_some(), "{removed}");
        }
    }

    #[test]
    fn rounds_alternate_the_order() {
        // Two variants, one dtype, three rounds: A B, B A, A B.
        let order: Vec<(usize, usize)> =
            schedule(2, 1, 3).iter().map(|&(r, v, _)| (r, v)).collect();
        assert_eq!(order, [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1)]);
        // Every (variant, dtype) once a round.
        let s = schedule(3, 2, 2);
        assert_eq!(s.len(), 12);
        for r in 0..2 {
            let mut in_round: Vec<(usize, usize)> =
                s.iter().filter(|x| x.0 == r).map(|x| (x.1, x.2)).collect();
            in_round.sort();
            in_round.dedup();
            assert_eq!(in_round.len(), 6);
        }
    }

    #[test]
    fn actions_compare_as_bits_or_the_largest_difference_and_refuse_nan() {
        assert_eq!(
            compare_actions(&[1.0, 2.0], &[1.0, 2.0]).unwrap(),
            "bit-identical"
        );
        assert_eq!(
            compare_actions(&[1.0, 2.0], &[1.0, 2.5]).unwrap(),
            "max abs difference 5.000e-1"
        );
        // -0.0 and 0.0 are equal values, not equal bits.
        assert_eq!(
            compare_actions(&[0.0], &[-0.0]).unwrap(),
            "max abs difference 0.000e0"
        );
        assert!(compare_actions(&[1.0], &[f32::NAN]).is_err());
        assert!(compare_actions(&[1.0], &[1.0, 2.0]).is_err());
        assert!(compare_actions(&[], &[]).is_err());
    }
}
