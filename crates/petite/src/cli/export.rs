//! `petite export`: a pi0.5 checkpoint → `prefix.pte` + `step.pte` (or, `--backend onnx`, one
//! `pi05.onnx`) in bounded memory.
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use petite::backends::{Backend, BackendOptions, Output};
use petite::export::{ExportOptions, export};
use petite::memory::parse_size;

/// Arguments of `petite export`.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// Checkpoint: a lerobot pi0.5 policy folder (config.json with "type": "pi05" beside
    /// model.safetensors, processors optional; the call's interface comes from it), a training
    /// output holding one (pretrained_model/ or checkpoints/last/pretrained_model), a
    /// .safetensors file, model.safetensors.index.json or a folder of weights (lerobot or Hub
    /// layout, single or sharded).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// pi0.5 config JSON in petite's schema (default: from a lerobot folder, else the real
    /// pi0.5). Beside a lerobot folder it gives the model sizes only (small test models); the
    /// interface fields both define must agree.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// How a lerobot checkpoint writes the state into the prompt: real (lerobot >= 0.5: the real
    /// state's bins) or padded (0.4.x: zero-padded to max_state_dim first). Recorded in
    /// policy.json for `petite act`.
    #[arg(long, value_enum, default_value = "real")]
    pub state_prompt: StatePrompt,
    /// Output directory: prefix.pte, step.pte, report.json, cache/ (mapping file); portable:
    /// also prefix.pte.json, step.pte.json (the methods' inputs and outputs); onnx: pi05.onnx,
    /// pi05.onnx.data (its external data: the mapping file), pi05.onnx.json, report.json.
    #[arg(long)]
    pub out: PathBuf,
    /// Backend (default: reference, which runs here and needs no other software). Each
    /// backend refuses, in one line before any work, a --dtype it does not export and every flag
    /// below marked for other backends. portable and onnx exports are checked with `petite
    /// verify`; onnx writes OUT/pi05.onnx + pi05.onnx.data + pi05.onnx.json.
    #[arg(long, value_enum, default_value = "reference")]
    pub backend: Backend,
    /// tensorrt: TensorRT's trtexec (JetPack: /usr/src/tensorrt/bin/trtexec); else
    /// $PETITE_TRTEXEC; if neither, TensorRT-RTX through --trt-python.
    #[arg(long, value_name = "PATH")]
    pub trtexec: Option<PathBuf>,
    /// tensorrt: a Python with TensorRT-RTX (`pip install tensorrt-rtx-cu13==1.7.1.116`); else
    /// $PETITE_TRT_PYTHON, else target/venv-trt (built by `cargo xtask ci`).
    #[arg(long, value_name = "PY")]
    pub trt_python: Option<PathBuf>,
    /// tensorrt with TensorRT-RTX: the compute capability to build for, e.g. sm86 (default: the
    /// GPU present, else sm86, the nearest to Jetson Orin's sm87, which TensorRT-RTX lacks).
    #[arg(long, value_name = "smXY")]
    pub trt_target: Option<String>,
    /// tensorrt: build weight-streamable engines (trtexec --weightStreaming, TensorRT-RTX
    /// BuilderFlag.WEIGHT_STREAMING) and give every engine this much GPU weight memory at run
    /// time, e.g. 256MiB (the `weight_streaming_budget` compile spec Torch-TensorRT's runtime
    /// reads per engine; at least one layer's weights).
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub weight_streaming_budget: Option<u64>,
    /// reference, tensorrt: weight bytes per engine, e.g. 512MiB (default: from
    /// --memory-budget, else 512MiB).
    #[arg(long, value_parser = parse_size)]
    pub engine_cap: Option<u64>,
    /// Memory budget of the whole export, e.g. 8GiB: picks the engine cap from the backend's
    /// build-memory model and refuses up front, with the numbers, when the plan cannot fit
    /// (tensorrt on an integrated GPU, e.g. a Jetson: default the memory available now).
    #[arg(long, value_parser = parse_size)]
    pub memory_budget: Option<u64>,
    /// tensorrt: how many engines to build at once, each builder in its own process (default:
    /// as many as both the memory budget — the process's own memory plus the costliest engines'
    /// builds together, under the builder's memory model; without --memory-budget, the memory
    /// available now — and the cores allow; printed at the start). Above what --memory-budget
    /// fits: refused before any work. The engines and .pte bytes are those of a build one at a
    /// time.
    #[arg(long, value_name = "N")]
    pub jobs: Option<std::num::NonZeroUsize>,
    /// Numerics: bf16 (lerobot's bfloat16 mode) or f32. Default bf16: what a deployed policy
    /// runs, half the memory (tensorrt exports bf16 only). With --backend portable the kernels
    /// compute in the weights' dtype (bf16 matmuls round inside the kernel; see docs/GUIDE.md, Backends: portable).
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: super::PrecisionArg,
    /// Weight-only quantization for boards with little memory (reference, tensorrt, onnx): int8
    /// or fp8 (E4M3; tensorrt: sm89 and later) codes with one scale per output channel (a bf16
    /// value), computed while the checkpoint streams (no second pass). The rule: the linear layers of Gemma's and the action
    /// expert's blocks; SigLIP, embeddings, norms and the expert's in/out projections keep
    /// --dtype. Default: none (every weight in --dtype). Check the accuracy on your own
    /// checkpoint with `petite verify`.
    #[arg(long, value_name = "int8|fp8", value_parser = parse_quant)]
    pub weights: Option<petite_graph::quant::Quant>,
    /// With --weights: also keep the weights whose names match PATTERN in --dtype (`*` matches
    /// any run of characters, e.g. `*.layers.17.*` or `*down_proj*`). Repeatable; a pattern
    /// matching none of the rule's weights is refused.
    #[arg(long, value_name = "PATTERN", requires = "weights")]
    pub quantize_skip: Vec<String>,
    /// reference, tensorrt: where the delegates' inputs and outputs live: device (as ExecuTorch plans a device
    /// delegate: values between engines in a CUDA buffer, host↔device copies only at the
    /// method's inputs and outputs; what Torch-TensorRT's runtime on a Jetson needs) or host
    /// (one CPU buffer, no copies). Default: where the backend's engines run (device for
    /// tensorrt, host for reference).
    #[arg(long, value_enum)]
    pub placement: Option<petite::export::Placement>,
    /// reference, tensorrt: keep the engine files under OUT/engines after writing the .pte
    /// files (default: removed).
    #[arg(long)]
    pub keep_engines: bool,
    /// Sleep this many milliseconds after each engine (testing interruption).
    #[arg(long, hide = true)]
    pub pause_after_engine_ms: Option<u64>,
}

fn parse_quant(s: &str) -> Result<petite_graph::quant::Quant, String> {
    petite_graph::quant::Quant::parse(s).ok_or_else(|| format!("`{s}`: expected int8 or fp8"))
}

/// How the state is written into the prompt (`--state-prompt`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatePrompt {
    /// lerobot >= 0.5: the real state.
    Real,
    /// lerobot 0.4.x: zero-padded to max_state_dim.
    Padded,
}

/// Runs `petite export`.
pub fn run(a: ExportArgs) -> anyhow::Result<()> {
    let state_padded = a.state_prompt == StatePrompt::Padded;
    let mut o = ExportOptions::new(&a.checkpoint, a.config.as_deref(), &a.out);
    o.state_padded = state_padded;
    o.backend = a.backend;
    o.backend_options = BackendOptions {
        trtexec: a.trtexec.clone(),
        trt_python: a.trt_python.clone(),
        trt_target: a.trt_target.clone(),
        weight_streaming_budget: a.weight_streaming_budget,
    };
    o.engine_cap = a.engine_cap;
    o.memory_budget = a.memory_budget;
    o.jobs = a.jobs.map(std::num::NonZeroUsize::get);
    o.precision = a.dtype.into();
    o.weights = a.weights;
    o.quantize_skip = a.quantize_skip.clone();
    o.keep_engines = a.keep_engines;
    o.placement = a.placement;
    o.handle_ctrl_c = true;
    o.pause_after_engine = a
        .pause_after_engine_ms
        .map(std::time::Duration::from_millis);
    // A --dtype or flag that does not apply to the backend: one line, before anything is read.
    o.check()?;
    // The interface, resolved and printed before any work (the export resolves it again).
    let resolved = petite::checkpoint::resolve(&a.checkpoint, a.config.as_deref(), state_padded)
        .with_context(|| format!("export of {}", a.checkpoint.display()))?;
    if let Some(d) = resolved.describe() {
        println!("{d}");
    }
    for w in resolved.warnings() {
        eprintln!("warning: {w}");
    }
    let r = export(&o).with_context(|| format!("export of {}", a.checkpoint.display()))?;
    print!("{}", r.table);
    let output = a.backend.spec().output();
    if output == Output::Onnx {
        let o = &r.report_json["onnx"];
        println!(
            "onnx: wrote {} ({} B protobuf, opset {}, {} initializers, {} B of weights in {}; report: {})",
            a.out.join(petite::layout::ONNX_MODEL).display(),
            o["model_bytes"],
            o["opset"],
            o["initializers"],
            o["weight_bytes"],
            petite::layout::ONNX_DATA,
            r.report.display()
        );
        return Ok(());
    }
    if output == Output::Portable {
        let m =
            |p: &str| r.report_json["programs"][p]["methods"][0]["plan"]["planned_bytes"].clone();
        println!(
            "portable: wrote {} and {} (planned buffers: prefix {} B, step {} B; report: {})",
            r.prefix_pte.display(),
            r.step_pte.display(),
            m("prefix"),
            m("step"),
            r.report.display()
        );
        return Ok(());
    }
    println!(
        "engines: {} built, {} reused; wrote {} and {} (report: {})",
        r.engines_built,
        r.engines_reused,
        r.prefix_pte.display(),
        r.step_pte.display(),
        r.report.display()
    );
    Ok(())
}
