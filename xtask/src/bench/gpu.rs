//! `cargo xtask bench gpu`: pi0.5 chunks on CUDA GPU 0 through petite-cuda (full size, bf16 with
//! its f32 products as TF32 and exact, and f32): per-chunk latency (median of the timed chunks after warm-up, CUDA events) with the
//! prefix/steps split and peak device memory, beside the physical floor of the same programs —
//! their dense FLOPs at the GPU's matrix rate for the dtype each product reads (bf16, or f32 for
//! the f32 products, SigLIP's in lerobot's bf16 mode, or TF32 where they run so) and their
//! weight bytes at its memory
//! bandwidth, both measured in the same run with PyTorch on the same GPU when python3 has a
//! CUDA torch (else the H200 datasheet's rates, said so).
//!
//! Run it where there is a GPU (the lent H200: a prebuilt `petite` through `PETITE_BIN`, the
//! tree through `XTASK_ROOT`); it fails without one.

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
    let inputs = dir.join("inputs.safetensors");
    super::pi05_run::write_inputs(&inputs)?;
    let pk = peaks();
    println!(
        "gpu bench: rates {}: bf16 matmul {:.0} TFLOP/s, f32 matmul {:.1} TFLOP/s (TF32 {:.0}), copy {:.2} TB/s",
        pk.source,
        pk.bf16 / 1e12,
        pk.f32 / 1e12,
        pk.tf32 / 1e12,
        pk.copy / 1e12
    );
    let mut rows = Vec::new();
    for run in &a.dtypes {
        let (dtype, f32_matmul) = match run.as_str() {
            "bf16" => ("bf16", "tf32"),
            "bf16-exact" => ("bf16", "exact"),
            "f32" => ("f32", "exact"),
            other => bail!("--dtypes: unknown {other:?} (bf16, bf16-exact, f32)"),
        };
        let json = dir.join(format!("{run}.json"));
        let out = dir.join(format!("{run}-actions.safetensors"));
        util::run(
            Command::new(&petite)
                .args(["pi05", "run", "--device", "cuda", "--dtype", dtype])
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
                .arg(&json),
        )?;
        let v: Value = serde_json::from_slice(&std::fs::read(&json)?)?;
        // Each product at its own rate: f32 products (all of them in f32 mode; SigLIP in
        // lerobot's bf16 mode) at the f32 rate, or TF32's when they run as TF32, 16-bit ones at
        // the bf16 rate.
        let steps = num(&v, "steps")?;
        let f32_rate = if f32_matmul == "tf32" {
            pk.tf32
        } else {
            pk.f32
        };
        let floor_s = |flops: f64, flops_f32: f64, bytes: f64| {
            ((flops - flops_f32) / pk.bf16 + flops_f32 / f32_rate).max(bytes / pk.copy)
        };
        let floor = floor_s(
            num(&v, "prefix_flops")?,
            num(&v, "prefix_flops_f32")?,
            num(&v, "prefix_weight_bytes")?,
        ) + steps
            * floor_s(
                num(&v, "step_flops")?,
                num(&v, "step_flops_f32")?,
                num(&v, "step_weight_bytes")?,
            );
        let floor_ms = floor * 1e3;
        let median = num(&v, "median_chunk_ms")?;
        if !(median.is_finite() && median > 0.0 && floor_ms > 0.0) {
            bail!("{run}: unusable figures: median {median} ms, floor {floor_ms} ms");
        }
        let gib = |k: &str| num(&v, k).map(|b| b / (1u64 << 30) as f64);
        rows.push(format!(
            "| petite-cuda {run} | {median:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {floor_ms:.2} | {:.1}× |",
            num(&v, "median_prefix_ms")?,
            num(&v, "median_steps_ms")?,
            num(&v, "median_wall_ms")?,
            gib("weight_bytes")?,
            gib("peak_pool_bytes")?,
            median / floor_ms
        ));
        println!("gpu bench: {run}: {}", serde_json::to_string(&v)?);
    }
    println!(
        "\n| run | chunk ms (median) | prefix ms | 10 steps ms | wall ms | weights GiB | peak buffers GiB | floor ms | × floor |\n|---|---|---|---|---|---|---|---|---|"
    );
    for r in rows {
        println!("{r}");
    }
    Ok(())
}
