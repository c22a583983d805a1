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
    // The reference executor's GEMM (and so step.pte's timestep table) in its one summation
    // order on this CPU: what makes exports byte-identical across x86-64 and aarch64.
    match petite_reference::kernels::summation_order_check() {
        Ok(n) => println!("gemm: the documented summation order, bit for bit ({n} shapes)"),
        Err(e) => println!("gemm: NOT the documented summation order: {e}"),
    }
    // bf16 programs' linears on the CPU (verify, act, pi05 run --dtype bf16): the tile unit
    // where there is one; the timestep table never uses it.
    match petite_reference::kernels::cpu_bf16_unit() {
        Some(unit) => println!(
            "bf16 linears: {unit} (sums in the unit's order; PETITE_CPU_AMX=off / PETITE_CPU_DPBF16=off for the exact path)"
        ),
        None => println!(
            "bf16 linears: the exact f32 path (no AMX-BF16 here, no AVX512-BF16 on an AMD CPU, or turned off)"
        ),
    }
    match petite_engine::gpu::probe() {
        Some(g) => println!(
            "gpu: {} (compute capability {}.{}, {:.1} GiB, {})",
            g.name,
            g.compute_capability.0,
            g.compute_capability.1,
            g.total_memory as f64 / (1u64 << 30) as f64,
            if g.integrated {
                "integrated: shares host memory"
            } else {
                "discrete"
            }
        ),
        None => println!("gpu: none (no CUDA driver library, or no device)"),
    }
    // What `--device cuda` needs: the driver, cuBLAS, NVRTC and a device (each loaded at run
    // time; petite runs without them).
    let p = petite_cuda::probe();
    let show = |r: &Result<String, String>| match r {
        Ok(v) => v.clone(),
        Err(e) => format!("missing ({e})"),
    };
    println!(
        "cuda runtime (--device cuda): {}; driver {}, cuBLAS {}, NVRTC {}{}",
        match p.usable() {
            Ok(()) => "can run here".to_string(),
            Err(e) => format!("cannot run here: {e}"),
        },
        show(&p.driver),
        show(&p.cublas),
        show(&p.nvrtc),
        p.device.as_ref().map_or(String::new(), |d| format!(
            "; device 0: {}, compute capability {}.{}",
            d.name, d.compute_capability.0, d.compute_capability.1
        ))
    );
    // Where compiled kernels are kept between runs: without them a program's first load runs
    // NVRTC over all of its kernels (seconds on a fresh machine).
    // A malformed `PETITE_CUDA_*` value is named in the settings block below.
    let kc = petite_cuda::kernel_cache(&petite_cuda::Settings::from_env().unwrap_or_default());
    match &kc.dir {
        Some(d) => println!(
            "cuda kernel cache: {} ({} compiled modules, {:.1} MiB; a program whose kernels are not there is compiled by NVRTC when it loads; PETITE_CUDA_CACHE=DIR moves it, =off turns it off)",
            d.display(),
            kc.modules,
            kc.bytes as f64 / (1u64 << 20) as f64
        ),
        None => println!(
            "cuda kernel cache: none (PETITE_CUDA_CACHE=off, or no HOME/XDG_CACHE_HOME): every run compiles its kernels with NVRTC"
        ),
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
