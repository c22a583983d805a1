//! `petite verify`: run an export's .pte files (engines here; portable ones in ExecuTorch's
//! runtime) or its ONNX model (in ONNX Runtime) and compare with the f32 reference.
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use petite::verify::{VerifyOptions, verify};

/// Arguments of `petite verify`.
#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// The export directory: prefix.pte and step.pte (engine and portable exports) or
    /// pi05.onnx (`--backend onnx`). `--pte-dir` is the former name, still accepted.
    #[arg(long, alias = "pte-dir")]
    pub dir: PathBuf,
    /// The original checkpoint (for the f32 reference).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// pi0.5 config JSON (default: the real pi0.5).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Inputs safetensors (images, image_masks, tokens, token_mask, noise); default: seeded.
    #[arg(long)]
    pub inputs: Option<PathBuf>,
    /// Seed of the generated inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Python 3.12 with executorch-numpy-runtime, for portable .pte files (`--backend
    /// portable`), which run in ExecuTorch's runtime in a separate process (default:
    /// $PETITE_PYTHON, else the workspace's target/venv-pte built by `cargo xtask conformance`);
    /// for an ONNX export (`--backend onnx`: pi05.onnx, no .pte) a Python with onnxruntime and
    /// numpy, which runs it in ONNX Runtime (default: $PETITE_ORT_PYTHON, else target/venv-ort).
    /// Refused for an engine export, whose engines run here.
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// Fail (exit 1) when the max abs action error exceeds this. Default: by the export's dtype
    /// in its report.json — 1e-4 for f32 (it matches the reference to ~1e-6), 5e-2 for bf16 (the
    /// bf16-vs-f32 bound every bf16 export meets) and when no report records it. Non-finite
    /// actions always fail.
    #[arg(long)]
    pub max_error: Option<f32>,
    /// Where the engines and the f32 reference run: `cpu` (the reference executor) or `cuda`
    /// (GPU 0 through petite-cuda; refused before any work where CUDA cannot run).
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: petite::runtimes::Device,
    /// How the export's engines and the f32 reference share the machine: `auto` runs them at
    /// once on `--device cuda` when the GPU's free memory holds both (they then read the disk
    /// together), else one after the other; `serial` always one after the other (the engines'
    /// memory is given back before the reference takes its own); `concurrent` always at once.
    #[arg(long, value_enum, default_value = "auto")]
    pub stages: petite::verify::Stages,
    /// A/B only (`cargo xtask bench gpu-verify --variant`), with `--device cuda`: KEY=VALUE of
    /// petite-cuda's tuning (fuse=on|off, offsets=params|literal, attention_queries=N|all|off, host_gather=on|off|all).
    #[arg(long = "tune", value_name = "KEY=VALUE", hide = true)]
    pub tune: Vec<String>,
    /// Also write the export's actions here (safetensors `actions`, f32 `[chunk, action_dim]`,
    /// as `petite pi05 run --out` writes the reference's), whether or not they are within the
    /// bound: to compare two runs of one export (the GPU's and the CPU's) directly.
    #[arg(long, value_name = "PATH")]
    pub actions_out: Option<PathBuf>,
}

/// Runs `petite verify`.
pub fn run(a: VerifyArgs) -> anyhow::Result<()> {
    // One line, before anything is read.
    if !a.tune.is_empty() && !a.device.spec().tunable() {
        return Err(petite::Error::Usage(format!(
            "--tune is for the GPU path: add --device {}",
            petite::runtimes::tunable_names()
        ))
        .into());
    }
    a.device.check()?;
    let r = verify(&VerifyOptions {
        dir: a.dir.clone(),
        checkpoint: a.checkpoint,
        config: a.config,
        inputs: a.inputs,
        seed: a.seed,
        python: a.python,
        max_error: a.max_error,
        device: a.device,
        stages: a.stages,
    })
    .with_context(|| format!("verify of {}", a.dir.display()))?;
    if let Some(out) = &a.actions_out {
        let path = petite_pi05::run::write_actions(out, &r.cfg, &r.actions)?;
        println!("actions written to {}", path.display());
    }
    let report = a.dir.join(petite::layout::REPORT);
    if let Some((q, groups)) = &r.weight_groups {
        println!(
            "{q} weights, one scale per output channel: their error against the checkpoint by \
             layer group"
        );
        println!(
            "  {:<18} {:>7} {:>13} {:>10} {:>13} {:>10}",
            "group", "tensors", "params", "rel. RMS", "row rel. RMS", "max abs"
        );
        for g in groups {
            println!(
                "  {:<18} {:>7} {:>13} {:>10.3e} {:>13.3e} {:>10.3e}",
                g.group, g.tensors, g.params, g.rel_rms, g.row_rel_rms, g.max_abs
            );
        }
    }
    println!(
        "max abs action error: {:e} (bound {:e}: {}; max |reference action| {:.3}; {})",
        r.max_abs_error,
        r.max_error,
        r.bound_source,
        r.max_abs_reference,
        if report.is_file() {
            format!("recorded in {}", report.display())
        } else {
            "not recorded: no report.json".to_string()
        }
    );
    if !r.within_bound {
        anyhow::bail!(
            "max abs action error {:e} exceeds the bound {:e} ({})",
            r.max_abs_error,
            r.max_error,
            r.bound_source
        );
    }
    Ok(())
}
