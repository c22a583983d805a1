//! `petite pi05 ...`
use clap::Subcommand;

/// pi0.5 subcommands.
#[derive(Subcommand)]
pub enum Pi05Cmd {
    /// Print the real pi0.5 config as JSON (the default for every command that takes --config).
    DefaultConfig,
    /// Run pi0.5 on the reference executor: timestep table, prefix, then the Euler steps.
    Run(RunArgs),
    /// Write a synthetic checkpoint (seeded f32, real names and shapes), streamed in bounded memory.
    Synth(SynthArgs),
}

/// Runs a `petite pi05` subcommand.
pub fn run(cmd: Pi05Cmd) -> anyhow::Result<()> {
    match cmd {
        Pi05Cmd::Synth(a) => synth(a),
        Pi05Cmd::DefaultConfig => {
            println!("{}", petite_pi05::Pi05Config::default().to_json_pretty());
            Ok(())
        }
        Pi05Cmd::Run(a) => run_cmd(a),
    }
}

/// Checkpoint layouts `petite pi05 synth` writes.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum SynthLayout {
    /// lerobot 0.6.1 `save_pretrained`: 813 tensors, `model.` prefix.
    Lerobot,
    /// Hub / openpi-converted: 812 tensors, keys without `model.`, the text embedding stored as
    /// `paligemma.lm_head.weight`.
    Hub,
    /// The Hub layout with `model.` kept on every key.
    HubPrefixed,
}

/// `petite pi05 synth`.
#[derive(clap::Args)]
pub struct SynthArgs {
    /// Config JSON (default: the real pi0.5).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Key layout of the file.
    #[arg(long, value_enum, default_value = "lerobot")]
    layout: SynthLayout,
    /// Output directory; `model.safetensors` is written inside it.
    #[arg(long)]
    out: std::path::PathBuf,
    /// Seed (same seed, same bytes, whatever the thread count).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Generator threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Output allowed in writeback before the writer waits and evicts, e.g. 64MiB (bounds memory).
    #[arg(long, default_value = "64MiB", value_parser = petite::memory::parse_size)]
    inflight: u64,
}

fn synth(a: SynthArgs) -> anyhow::Result<()> {
    use petite_pi05::names::Layout;
    let cfg = match &a.config {
        Some(p) => petite_pi05::Pi05Config::from_json_file(p)?,
        None => petite_pi05::Pi05Config::default(),
    };
    let layout = match a.layout {
        SynthLayout::Lerobot => Layout::Lerobot,
        SynthLayout::Hub => Layout::Hub { prefixed: false },
        SynthLayout::HubPrefixed => Layout::Hub { prefixed: true },
    };
    let opts = petite_pi05::synth::SynthOptions {
        seed: a.seed,
        threads: a.threads.max(1),
        inflight_bytes: a.inflight,
    };
    let r = petite_pi05::synth::write_synthetic(&cfg, layout, &a.out, &opts)?;
    let gib = r.file_bytes as f64 / (1u64 << 30) as f64;
    println!(
        "synth: wrote {} ({} tensors, {} bytes = {gib:.2} GiB) in {:.2} s ({:.3} GiB/s)",
        r.path.display(),
        r.tensors,
        r.file_bytes,
        r.seconds,
        gib / r.seconds.max(1e-9)
    );
    Ok(())
}

/// `petite pi05 run`.
#[derive(clap::Args)]
pub struct RunArgs {
    /// Checkpoint: a `.safetensors` file, an index `.json` or a directory (lerobot or Hub layout).
    #[arg(long)]
    checkpoint: std::path::PathBuf,
    /// Config JSON (default: the real pi0.5).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
    /// Inputs: `images`, `image_masks`, `tokens`, `token_mask`, `noise`.
    #[arg(long)]
    inputs: std::path::PathBuf,
    /// Output safetensors holding `actions` f32 [chunk, action_dim].
    #[arg(long)]
    out: std::path::PathBuf,
    /// Numerics: `f32`, or `bf16` (lerobot's bfloat16 mode). Default f32: this is the
    /// reference every export is verified against (`petite export` defaults to bf16, the
    /// deployed mode).
    #[arg(long, value_enum, default_value = "f32")]
    dtype: super::PrecisionArg,
    /// Where to run: `cpu` (the reference executor) or `cuda` (GPU 0 through petite-cuda:
    /// weights uploaded once, the prefix K/V kept on the device across the steps). `cuda` where
    /// CUDA cannot run is refused before any work.
    #[arg(long, value_enum, default_value = "cpu")]
    device: petite::runtimes::Device,
    /// With `--device cuda`: run this many more chunks on the same inputs after `--warmup`, and
    /// report their median latency (CUDA events), prefix/steps split and peak device memory.
    #[arg(long, default_value_t = 0)]
    repeat: usize,
    /// With `--repeat`: untimed chunks first.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// With `--device cuda`: also write the figures as JSON here.
    #[arg(long)]
    timing_json: Option<std::path::PathBuf>,
    /// With `--device cuda`: how products of f32 operands run — `exact` (f32, no TF32: lerobot's
    /// eager PyTorch) or `tf32` (TF32 tensor cores, f32 accumulation: what lerobot's
    /// `compile_model=True` sets with `torch.set_float32_matmul_precision("high")`). Default:
    /// `tf32` for `--dtype bf16` (the f32 SigLIP of lerobot's bf16 mode, inside bf16's error
    /// bound), `exact` for `--dtype f32` (the parity mode).
    #[arg(long, value_enum)]
    f32_matmul: Option<F32MatmulArg>,
    /// A/B only (`cargo xtask bench gpu --variant`), with `--device cuda`: KEY=VALUE of
    /// petite-cuda's tuning (fuse=on|off, offsets=params|literal, attention_queries=N|all|off),
    /// recorded in `--timing-json` as "tuning".
    #[arg(long = "tune", value_name = "KEY=VALUE", hide = true)]
    pub(crate) tune: Vec<String>,
}

/// `--f32-matmul`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum F32MatmulArg {
    /// Exact f32 products.
    Exact,
    /// TF32 tensor cores, f32 accumulation.
    Tf32,
}

impl F32MatmulArg {
    /// The command-line name.
    fn name(self) -> &'static str {
        match self {
            F32MatmulArg::Exact => "exact",
            F32MatmulArg::Tf32 => "tf32",
        }
    }
}

fn run_cmd(a: RunArgs) -> anyhow::Result<()> {
    if a.device == petite::runtimes::Device::Cuda {
        return run_cuda(a);
    }
    if a.repeat > 0 || a.timing_json.is_some() || a.f32_matmul.is_some() || !a.tune.is_empty() {
        return Err(petite::Error::Usage(
            "--repeat, --timing-json, --f32-matmul and --tune are for the GPU path: add --device \
             cuda"
                .into(),
        )
        .into());
    }
    let files = petite_pi05::run::RunFiles {
        checkpoint: &a.checkpoint,
        config: a.config.as_deref(),
        inputs: &a.inputs,
        out: &a.out,
    };
    let r = petite_pi05::run::run_files(&files, a.dtype.into())?;
    let [table, prefix, steps] = r.seconds;
    println!(
        "pi05 run: wrote {} ({} steps); timestep table {table:.3} s, prefix {prefix:.3} s, steps {steps:.3} s, total {:.3} s",
        a.out.display(),
        r.trajectory.len(),
        table + prefix + steps
    );
    Ok(())
}

/// `petite pi05 run --device cuda`: programs on GPU 0, K/V resident, optional timed repeats.
fn run_cuda(a: RunArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    use petite::cuda_run::{CudaPolicy, median};
    petite::runtimes::check_device(a.device)?;
    let dev = petite::runtimes::open_cuda()?;
    let cfg = match &a.config {
        Some(p) => petite_pi05::Pi05Config::from_json_file(p)?,
        None => petite_pi05::Pi05Config::default(),
    };
    let ck = petite_pi05::inputs::open_checkpoint(&a.checkpoint)?;
    let precision: petite_pi05::Precision = a.dtype.into();
    let progs = petite_pi05::build_all(&cfg, precision)?;
    petite_pi05::inputs::check_weights(
        &ck,
        &a.checkpoint.display().to_string(),
        [&progs.timestep_table, &progs.prefix, &progs.step],
    )?;
    drop(progs);
    let inputs = petite_pi05::inputs::Inputs::from_file(&a.inputs, &cfg)?;
    let f32_matmul = a.f32_matmul.unwrap_or(match a.dtype {
        super::PrecisionArg::Bf16 => F32MatmulArg::Tf32,
        super::PrecisionArg::F32 => F32MatmulArg::Exact,
    });
    dev.reset_peak()?;
    let math = match f32_matmul {
        F32MatmulArg::Exact => petite_cuda::F32Matmul::Exact,
        F32MatmulArg::Tf32 => petite_cuda::F32Matmul::Tf32,
    };
    let policy =
        CudaPolicy::load(&dev, &cfg, &ck, precision, math).context("loading onto the GPU")?;
    let (actions, first) = policy.chunk(&inputs)?;
    if let Some((i, v)) = actions.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        anyhow::bail!("actions are not finite ({v} at index {i}); nothing written");
    }
    petite_weights::WeightSource::check_unchanged(&ck)?;
    petite_pi05::run::write_actions(&a.out, &cfg, &actions)?;
    let info = dev.info().clone();
    println!(
        "pi05 run: wrote {} on {} (cuda, {}, f32 products {}); load {:.3} s (kernels compiled in {:.3} s), first chunk {:.3} ms (prefix {:.3} ms, steps {:.3} ms)",
        a.out.display(),
        info.name,
        a.dtype.name(),
        f32_matmul.name(),
        policy.load_seconds,
        dev.compile_seconds(),
        first.total_ms,
        first.prefix_ms,
        first.steps_ms
    );
    let mut figures = serde_json::json!({
        "device": info.name,
        "compute_capability": format!("{}.{}", info.compute_capability.0, info.compute_capability.1),
        "dtype": a.dtype.name(),
        "f32_matmul": f32_matmul.name(),
        "load_seconds": policy.load_seconds,
        "compile_seconds": dev.compile_seconds(),
        "weight_bytes": policy.weight_bytes(),
        "first_chunk_ms": first.total_ms,
        "steps": cfg.steps,
        "prefix_flops": policy.flops[0],
        "step_flops": policy.flops[1],
        "prefix_flops_f32": policy.flops_f32[0],
        "step_flops_f32": policy.flops_f32[1],
        "prefix_weight_bytes": policy.program_weight_bytes()[0],
        "step_weight_bytes": policy.program_weight_bytes()[1],
        // What `--tune` applied, so a bench can check its variant reached this process.
        "tuning": dev
            .settings()
            .tuning
            .describe()
            .into_iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::from(v)))
            .collect::<serde_json::Map<_, _>>(),
    });
    if a.repeat > 0 {
        for _ in 0..a.warmup {
            policy.chunk(&inputs)?;
        }
        dev.reset_peak()?;
        let mut times = Vec::with_capacity(a.repeat);
        for _ in 0..a.repeat {
            let (again, t) = policy.chunk(&inputs)?;
            if again != actions {
                anyhow::bail!("a repeated chunk gave other actions than the first");
            }
            times.push(t);
        }
        let pick = |f: fn(&petite::cuda_run::ChunkTimes) -> f64| {
            median(&times.iter().map(f).collect::<Vec<_>>())
        };
        let (total, prefix, steps, wall) = (
            pick(|t| t.total_ms),
            pick(|t| t.prefix_ms),
            pick(|t| t.steps_ms),
            pick(|t| t.wall_ms),
        );
        let peak = dev.peak_bytes();
        let (free, all) = dev.mem_info()?;
        println!(
            "pi05 run: {} chunks after {} warm-up: median {total:.3} ms a chunk (prefix {prefix:.3} ms, {} steps {steps:.3} ms; wall {wall:.3} ms); weights {:.3} GiB; peak held by petite's buffers during the timed chunks {}; device memory in use {:.3} GiB",
            a.repeat,
            a.warmup,
            cfg.steps,
            policy.weight_bytes() as f64 / (1u64 << 30) as f64,
            peak.map_or("unknown".to_string(), |p| format!(
                "{:.3} GiB",
                p as f64 / (1u64 << 30) as f64
            )),
            (all - free) as f64 / (1u64 << 30) as f64,
        );
        if let Some(o) = figures.as_object_mut() {
            o.insert("chunks".into(), a.repeat.into());
            o.insert("warmup".into(), a.warmup.into());
            o.insert("median_chunk_ms".into(), total.into());
            o.insert("median_prefix_ms".into(), prefix.into());
            o.insert("median_steps_ms".into(), steps.into());
            o.insert("median_wall_ms".into(), wall.into());
            o.insert(
                "chunk_ms".into(),
                times.iter().map(|t| t.total_ms).collect::<Vec<_>>().into(),
            );
            o.insert("peak_pool_bytes".into(), peak.into());
            o.insert("device_used_bytes".into(), (all - free).into());
        }
    }
    if let Some(p) = &a.timing_json {
        std::fs::write(p, serde_json::to_string_pretty(&figures)?)
            .with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(())
}
