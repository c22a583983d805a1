//! `petite act`: run an exported bundle from a raw lerobot observation, with lerobot's pre- and
//! post-processing (see `petite::act`).
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use petite::act::{ActOptions, act, write_result};

/// Arguments of `petite act`.
#[derive(Args, Debug)]
pub struct ActArgs {
    /// The export directory: prefix.pte + step.pte (or pi05.onnx) and policy.json.
    /// `--pte-dir` is the former name, still accepted.
    #[arg(long, alias = "pte-dir")]
    pub dir: PathBuf,
    /// Observation safetensors with lerobot's keys: observation.images.<key> (float32 [3,H,W]
    /// in [0,1] or uint8 [H,W,3]; a camera left out is masked), observation.state (f32
    /// [state_dim]), optionally noise (f32 [chunk, max_action_dim]) and, for real-time
    /// chunking, rtc.prev_chunk_left_over (the previous chunk's unexecuted actions in model
    /// space, f32 [rows, cols]; then --inference-delay is required).
    #[arg(long)]
    pub observation: PathBuf,
    /// The task (default: the observation file's metadata key `task`).
    #[arg(long)]
    pub task: Option<String>,
    /// tokenizer.json (default: $PETITE_TOKENIZER, else the Hugging Face cache's snapshot of
    /// the bundle's tokenizer id).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Noise safetensors (`noise`, f32 [chunk, max_action_dim]), unless the observation has it.
    #[arg(long, conflicts_with = "seed")]
    pub noise: Option<PathBuf>,
    /// Seed of the noise when no file gives it.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Python for a portable bundle (executorch-numpy-runtime) or an ONNX one (onnxruntime);
    /// as `petite verify --python` (refused for an engine bundle).
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// Where a bundle of petite's engines runs: `cpu` (the reference executor) or `cuda` (GPU 0
    /// through petite-cuda; refused before any work where CUDA cannot run). Portable and ONNX
    /// bundles run on the CPU.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: petite::runtimes::Device,
    /// Calls after the first, on the same observation with the same noise, for latency: each
    /// must give the same chunk; the median and p99 of the call and of the chunk alone are
    /// printed (and written by --timing-json).
    #[arg(long, default_value_t = 0)]
    pub repeat: usize,
    /// Write the timings as JSON: seconds to open, the first call, and each call's
    /// preprocess/queued/chunk/postprocess/total seconds.
    #[arg(long)]
    pub timing_json: Option<PathBuf>,
    /// Real-time chunking: actions the robot executes while the chunk is computed (lerobot's
    /// `inference_delay`).
    #[arg(long, help_heading = "Real-time chunking")]
    pub inference_delay: Option<usize>,
    /// Rows of the chunk guided by the leftover (default: the export's, from its policy
    /// folder's `rtc_config`, else lerobot's 10).
    #[arg(long, help_heading = "Real-time chunking")]
    pub execution_horizon: Option<usize>,
    /// How the guidance fades: ZEROS, ONES, LINEAR or EXP (default: the export's, else LINEAR).
    #[arg(long, help_heading = "Real-time chunking")]
    pub rtc_schedule: Option<petite::policy::Schedule>,
    /// The guidance's upper bound (default: the export's, else 10).
    #[arg(long, help_heading = "Real-time chunking")]
    pub max_guidance_weight: Option<f32>,
    /// Output safetensors: `action` f32 [chunk, action_dim] (unnormalized; metadata
    /// n_action_steps), plus the prompt's tokens and attention mask.
    #[arg(long)]
    pub out: PathBuf,
    /// A/B only (`cargo xtask bench policy`), with `--device cuda`: KEY=VALUE of petite-cuda's
    /// tuning (fuse=on|off, offsets=params|literal, attention_queries=N|all|off,
    /// host_gather=on|off|all).
    #[arg(long = "tune", value_name = "KEY=VALUE", hide = true)]
    pub tune: Vec<String>,
}

/// Runs `petite act`.
pub fn run(a: ActArgs) -> anyhow::Result<()> {
    // One line, before anything is read.
    a.device.check()?;
    let r = act(&ActOptions {
        dir: a.dir.clone(),
        observation: a.observation.clone(),
        task: a.task,
        tokenizer: a.tokenizer,
        noise: a.noise,
        seed: a.seed.unwrap_or(0),
        python: a.python,
        device: a.device,
        repeat: a.repeat,
        rtc: petite::act::RtcSettings {
            inference_delay: a.inference_delay,
            execution_horizon: a.execution_horizon,
            schedule: a.rtc_schedule,
            max_guidance_weight: a.max_guidance_weight,
        },
    })
    .with_context(|| format!("act with {}", a.dir.display()))?;
    write_result(&a.out, &r).with_context(|| format!("writing {}", a.out.display()))?;
    let (open_s, calls) = &r.timing;
    if a.repeat > 0 {
        let rest = &calls[1..];
        let ms = |f: &dyn Fn(&petite::policy::Timing) -> f64| {
            let v: Vec<f64> = rest.iter().map(|t| f(t) * 1e3).collect();
            (petite::report::median(&v), percentile(&v, 0.99))
        };
        let (tm, tp) = ms(&|t| t.total);
        let (cm, cp) = ms(&|t| t.chunk);
        let (om, op) = ms(&|t| t.total - t.chunk);
        println!(
            "{} calls: {tm:.3} ms a call (p99 {tp:.3}), the chunk alone {cm:.3} ms (p99 {cp:.3}), overhead {om:.3} ms (p99 {op:.3}); open {:.3} s, first call {:.3} ms",
            rest.len(),
            open_s,
            calls[0].total * 1e3
        );
    }
    if let Some(path) = &a.timing_json {
        let each: Vec<serde_json::Value> = calls
            .iter()
            .map(|t| {
                serde_json::json!({
                    "preprocess_s": t.preprocess, "queued_s": t.queued, "chunk_s": t.chunk,
                    "postprocess_s": t.postprocess, "total_s": t.total,
                })
            })
            .collect();
        let j = serde_json::json!({
            "open_s": open_s,
            "first_call_s": calls[0].total,
            "device": a.device.name(),
            "runtime": r.runtime,
            "calls": each,
        });
        std::fs::write(path, serde_json::to_string_pretty(&j)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    println!(
        "wrote {}: action [{}, {}] (execute the first {}); {} prompt tokens; ran on {}",
        a.out.display(),
        r.chunk,
        r.action_dim,
        r.n_action_steps,
        r.token_mask.iter().filter(|&&m| m == 1).count(),
        r.runtime
    );
    Ok(())
}

/// The `q` quantile of `v` (nearest rank; NaN for none).
fn percentile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    let k = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[k - 1]
}
