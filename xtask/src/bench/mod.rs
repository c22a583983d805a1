//! `cargo xtask bench <what>`: whole-process benchmarks run under `memcap`, each reporting its
//! figures as ratios against a floor measured in the same run. One module per benchmark.

use anyhow::Result;

mod convert;
mod engine;
pub(crate) mod gpu;
mod gpu_verify;
mod nvrtc;
mod onnx;
mod pi05_run;
mod policy;
mod pte;
mod synth;

/// The benchmarks.
#[derive(clap::Subcommand)]
pub enum BenchCmd {
    /// `petite convert` of the full-size synthetic pi0.5 checkpoint (f32 → bf16) under memcap.
    Convert(convert::Args),
    /// petite-engine: every engine of the full-size pi0.5 prefix built under a 512 MiB cap, vs dd.
    Engine(engine::Args),
    /// petite-pte: ≥ 4 GiB of delegate data streamed into a .pte under a 64 MiB cap, vs cp.
    Pte(pte::Args),
    /// `petite pi05 synth` of the full-size pi0.5 under a 512 MiB cap, vs a dd floor.
    Synth(synth::Args),
    /// Seconds per chunk: `petite pi05 run` (full size, f32) vs lerobot PyTorch CPU f32.
    Pi05Run(pi05_run::Args),
    /// pi0.5 chunks on CUDA GPU 0 (petite-cuda, full size, bf16 and f32): median latency (CUDA
    /// events), prefix/steps split, peak device memory, beside the FLOP/bandwidth floor.
    Gpu(gpu::Args),
    /// A resident policy acting in a loop (`petite act --repeat`): each call's median and p99
    /// against the chunk alone, open and first call; on a GPU beside `pi05 run` (same weights).
    Policy(policy::Args),
    /// Full-size `petite verify --device cuda` of a bf16 export: wall time with an empty and a
    /// warm kernel cache, the page cache dropped (needs a GPU).
    GpuVerify(gpu_verify::Args),
    /// NVRTC's time for the kernel sources a cold full-size pi0.5 run on a GPU compiles (no GPU
    /// needed): the plan before session 25, today's, and with unrolled rows.
    Nvrtc(nvrtc::Args),
    /// `petite export --backend onnx` at full size under memcap, then the model in ONNX Runtime
    /// CPU beside `petite pi05 run` on the same inputs (seconds per chunk, peaks, max error).
    Onnx(onnx::Args),
}

/// Runs one benchmark.
pub fn run(cmd: BenchCmd) -> Result<()> {
    match cmd {
        BenchCmd::Convert(a) => convert::run(&a),
        BenchCmd::Engine(a) => engine::run(&a),
        BenchCmd::Pte(a) => pte::run(&a),
        BenchCmd::Synth(a) => synth::run(&a),
        BenchCmd::Pi05Run(a) => pi05_run::run(&a),
        BenchCmd::Onnx(a) => onnx::run(&a),
        BenchCmd::Gpu(a) => gpu::run(&a),
        BenchCmd::Nvrtc(a) => nvrtc::run(&a),
        BenchCmd::GpuVerify(a) => gpu_verify::run(&a),
        BenchCmd::Policy(a) => policy::run(&a),
    }
}
