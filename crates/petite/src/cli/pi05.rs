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
    f32_matmul: Option<petite::runtimes::F32Matmul>,
    /// A/B only (`cargo xtask bench gpu --variant`), with `--device cuda`: KEY=VALUE of
    /// petite-cuda's tuning (fuse=on|off, offsets=params|literal, attention_queries=N|all|off, host_gather=on|off|all),
    /// recorded in `--timing-json` as "tuning".
    #[arg(long = "tune", value_name = "KEY=VALUE", hide = true)]
    pub(crate) tune: Vec<String>,
}

fn run_cmd(a: RunArgs) -> anyhow::Result<()> {
    // `--device cuda` where CUDA cannot run is refused before any work; then the device runs
    // the model its own way (the registry's: `petite::runtimes`).
    a.device.check()?;
    let run = petite::runtimes::ModelRun {
        checkpoint: &a.checkpoint,
        config: a.config.as_deref(),
        inputs: &a.inputs,
        out: &a.out,
        precision: a.dtype.into(),
        repeat: a.repeat,
        warmup: a.warmup,
        timing_json: a.timing_json.as_deref(),
        f32_matmul: a.f32_matmul,
        tuned: !a.tune.is_empty(),
    };
    a.device
        .spec()
        .run_model(&run, &mut |line| println!("{line}"))?;
    Ok(())
}
