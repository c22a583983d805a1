//! `petite pi05 run --device cuda` (the programs on GPU 0, K/V resident, optional timed repeats)
//! and the device's `petite doctor` lines.

use petite_pi05::Precision;

use super::policy::{ChunkTimes, CudaPolicy};
use crate::runtimes::{F32Matmul, ModelRun};
use crate::{Error, Result};

/// `what` as the context of `e` (the cause kept whole).
fn context<E: std::error::Error + Send + Sync + 'static>(
    what: impl Into<String>,
) -> impl FnOnce(E) -> Error {
    let what = what.into();
    move |e| Error::Context {
        what,
        source: Box::new(e),
    }
}

/// petite-cuda's error as it is (no context of petite's).
fn bare(e: petite_cuda::Error) -> Error {
    Error::CudaCall(Box::new(e))
}

/// `petite pi05 run` on `dev`.
pub(super) fn run_model(
    dev: &petite_cuda::Device,
    a: &ModelRun<'_>,
    say: &mut dyn FnMut(String),
) -> Result<()> {
    let cfg = match a.config {
        Some(p) => petite_pi05::Pi05Config::from_json_file(p)?,
        None => petite_pi05::Pi05Config::default(),
    };
    let ck = petite_pi05::inputs::open_checkpoint(a.checkpoint)?;
    let precision = a.precision;
    let progs = petite_pi05::build_all(&cfg, precision)?;
    petite_pi05::inputs::check_weights(
        &ck,
        &a.checkpoint.display().to_string(),
        [&progs.timestep_table, &progs.prefix, &progs.step],
    )?;
    drop(progs);
    let inputs = petite_pi05::inputs::Inputs::from_file(a.inputs, &cfg)?;
    let f32_matmul = a.f32_matmul.unwrap_or(match precision {
        Precision::Bf16 => F32Matmul::Tf32,
        Precision::F32 => F32Matmul::Exact,
    });
    let dtype = match precision {
        Precision::Bf16 => "bf16",
        Precision::F32 => "f32",
    };
    dev.reset_peak().map_err(bare)?;
    let math = match f32_matmul {
        F32Matmul::Exact => petite_cuda::F32Matmul::Exact,
        F32Matmul::Tf32 => petite_cuda::F32Matmul::Tf32,
    };
    let policy = CudaPolicy::load(dev, &cfg, &ck, precision, math)
        .map_err(context("loading onto the GPU"))?;
    let (actions, first) = policy.chunk(&inputs)?;
    if let Some((i, v)) = actions.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(Error::Refused(format!(
            "actions are not finite ({v} at index {i}); nothing written"
        )));
    }
    petite_weights::WeightSource::check_unchanged(&ck)?;
    petite_pi05::run::write_actions(a.out, &cfg, &actions)?;
    let info = dev.info().clone();
    say(format!(
        "pi05 run: wrote {} on {} (cuda, {}, f32 products {}); load {:.3} s (kernels compiled in {:.3} s), first chunk {:.3} ms (prefix {:.3} ms, steps {:.3} ms)",
        a.out.display(),
        info.name,
        dtype,
        f32_matmul.name(),
        policy.load_seconds,
        dev.compile_seconds(),
        first.total_ms,
        first.prefix_ms,
        first.steps_ms
    ));
    let mut figures = serde_json::json!({
        "device": info.name,
        "compute_capability": format!("{}.{}", info.compute_capability.0, info.compute_capability.1),
        "dtype": dtype,
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
        dev.reset_peak().map_err(bare)?;
        let mut times = Vec::with_capacity(a.repeat);
        for _ in 0..a.repeat {
            let (again, t) = policy.chunk(&inputs)?;
            if again != actions {
                return Err(Error::Refused(
                    "a repeated chunk gave other actions than the first".into(),
                ));
            }
            times.push(t);
        }
        let pick = |f: fn(&ChunkTimes) -> f64| {
            crate::report::median(&times.iter().map(f).collect::<Vec<_>>())
        };
        let (total, prefix, steps, wall) = (
            pick(|t| t.total_ms),
            pick(|t| t.prefix_ms),
            pick(|t| t.steps_ms),
            pick(|t| t.wall_ms),
        );
        let peak = dev.peak_bytes();
        let (free, all) = dev.mem_info().map_err(bare)?;
        say(format!(
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
        ));
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
    if let Some(p) = a.timing_json {
        let text = serde_json::to_string_pretty(&figures)
            .map_err(context(format!("writing {}", p.display())))?;
        std::fs::write(p, text).map_err(context(format!("writing {}", p.display())))?;
    }
    Ok(())
}

/// The device's `petite doctor` lines: the GPU the CUDA driver reports, what `--device cuda`
/// needs (the driver, cuBLAS, NVRTC and a device, each loaded at run time; petite runs without
/// them) and where compiled kernels are kept between runs.
pub(super) fn doctor() -> Vec<String> {
    let mut lines = Vec::new();
    lines.push(match petite_engine::gpu::probe() {
        Some(g) => format!(
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
        None => "gpu: none (no CUDA driver library, or no device)".to_string(),
    });
    let p = petite_cuda::probe();
    let show = |r: &std::result::Result<String, String>| match r {
        Ok(v) => v.clone(),
        Err(e) => format!("missing ({e})"),
    };
    lines.push(format!(
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
    ));
    // Without compiled kernels kept, a program's first load runs NVRTC over all of its kernels
    // (seconds on a fresh machine). A malformed `PETITE_CUDA_*` value is named in the settings
    // block of `petite doctor`.
    let kc = petite_cuda::kernel_cache(&petite_cuda::Settings::from_env().unwrap_or_default());
    lines.push(match &kc.dir {
        Some(d) => format!(
            "cuda kernel cache: {} ({} compiled modules, {:.1} MiB; a program whose kernels are not there is compiled by NVRTC when it loads; PETITE_CUDA_CACHE=DIR moves it, =off turns it off)",
            d.display(),
            kc.modules,
            kc.bytes as f64 / (1u64 << 20) as f64
        ),
        None => "cuda kernel cache: none (PETITE_CUDA_CACHE=off, or no HOME/XDG_CACHE_HOME): every run compiles its kernels with NVRTC".to_string(),
    });
    lines
}
