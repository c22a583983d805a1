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
    /// [state_dim]), optionally noise (f32 [chunk, max_action_dim]).
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
    /// Output safetensors: `action` f32 [chunk, action_dim] (unnormalized; metadata
    /// n_action_steps), plus the prompt's tokens and attention mask.
    #[arg(long)]
    pub out: PathBuf,
}

/// Runs `petite act`.
pub fn run(a: ActArgs) -> anyhow::Result<()> {
    // One line, before anything is read.
    petite::runtimes::check_device(a.device)?;
    let r = act(&ActOptions {
        dir: a.dir.clone(),
        observation: a.observation.clone(),
        task: a.task,
        tokenizer: a.tokenizer,
        noise: a.noise,
        seed: a.seed.unwrap_or(0),
        python: a.python,
        device: a.device,
    })
    .with_context(|| format!("act with {}", a.dir.display()))?;
    write_result(&a.out, &r).with_context(|| format!("writing {}", a.out.display()))?;
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
