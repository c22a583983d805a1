//! `petite doctor`: what this machine offers the export — architecture and OS page size, the GPU
//! the CUDA driver reports (if any) and which TensorRT builder `--backend tensorrt` would use,
//! found the same way, and every documented `PETITE_*` setting with its value here.
use std::path::PathBuf;

use clap::Args;
use petite::venv::default_trt_python;
use petite_engine::tensorrt::{Tool, ToolSearch};

/// Arguments of `petite doctor`.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// As `petite export --trtexec`.
    #[arg(long, value_name = "PATH")]
    pub trtexec: Option<PathBuf>,
    /// As `petite export --trt-python`.
    #[arg(long, value_name = "PY")]
    pub trt_python: Option<PathBuf>,
}

/// Runs `petite doctor`; fails only on an I/O error printing.
pub fn run(a: DoctorArgs) -> anyhow::Result<()> {
    println!(
        "system: {} {}, page size: {} bytes",
        std::env::consts::OS,
        std::env::consts::ARCH,
        petite_weights::page_size()
    );
    // Each device's lines (the registry's: the CPU's GEMM order and bf16 unit, the GPU and
    // what `--device cuda` needs), in registration order.
    for d in petite::runtimes::devices() {
        for line in d.spec().doctor() {
            println!("{line}");
        }
    }
    let search = ToolSearch {
        trtexec: a.trtexec,
        trt_python: a.trt_python,
        default_python: default_trt_python(),
    };
    match Tool::find(&search) {
        Ok(t) => {
            println!("tensorrt builder: {} ({})", t.info, t.program.display());
            if !t.targets.is_empty() {
                println!("  targets: {}", t.targets.join(", "));
            }
        }
        Err(e) => println!("tensorrt builder: none: {e}"),
    }
    // Every documented setting with its value here; a malformed one is named, not fatal.
    for line in petite::settings::doctor_lines_here() {
        println!("{line}");
    }
    Ok(())
}
