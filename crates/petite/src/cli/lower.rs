//! `petite lower`: one pi0.5 program as a portable ExecuTorch `.pte` (plain kernel calls, no
//! delegate), plus `F.pte.json` describing its inputs, outputs and memory plan (what a driver
//! needs to feed it). `--plan-only` lowers and plans without a checkpoint (nothing written).
use std::path::PathBuf;

use anyhow::{Context, Result};
use petite_pi05::programs::{build_prefix, build_step, build_timestep_table};

/// Which program to lower.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Which {
    /// SigLIP + projector + language model → per-layer K/V and the pad mask.
    Prefix,
    /// One denoising step (Euler update folded in).
    Step,
    /// The timestep table (adaRMS modulations per step).
    Timesteps,
}

/// `petite lower`.
#[derive(clap::Args)]
pub struct LowerArgs {
    /// Config JSON (default: the real pi0.5).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Checkpoint (file, index or directory), lerobot or Hub layout.
    #[arg(long, required_unless_present = "plan_only")]
    checkpoint: Option<PathBuf>,
    /// Program to lower.
    #[arg(long, value_enum)]
    program: Which,
    /// Numeric mode (weights and activations in that dtype; portable kernels compute in it).
    /// Default f32: `lower` checks one program against the f32 reference (`petite export
    /// --backend portable` is the deployable path, and defaults to bf16).
    #[arg(long, value_enum, default_value = "f32", alias = "precision")]
    dtype: super::PrecisionArg,
    /// Output `.pte` (a `.pte.json` description is written next to it).
    #[arg(long, required_unless_present = "plan_only")]
    out: Option<PathBuf>,
    /// Only lower and plan (no checkpoint read, nothing written); print the report.
    #[arg(long)]
    plan_only: bool,
}

/// Runs `petite lower`.
pub fn run(a: LowerArgs) -> Result<()> {
    let cfg = match &a.config {
        Some(p) => petite_pi05::Pi05Config::from_json_file(p)?,
        None => petite_pi05::Pi05Config::default(),
    };
    let prog = match a.program {
        Which::Prefix => build_prefix(&cfg, a.dtype.into())?,
        Which::Step => build_step(&cfg, a.dtype.into())?,
        Which::Timesteps => build_timestep_table(&cfg, a.dtype.into())?,
    };
    if a.plan_only {
        let r = petite_portable::plan_portable(&prog)?;
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    let (Some(ck), Some(out)) = (&a.checkpoint, &a.out) else {
        return Err(petite::Error::Usage(
            "--checkpoint and --out are required unless --plan-only".into(),
        )
        .into());
    };
    let canon = |p: &std::path::Path| std::fs::canonicalize(p).ok();
    if canon(out).is_some()
        && [Some(ck), a.config.as_ref()]
            .iter()
            .flatten()
            .any(|p| canon(p) == canon(out))
    {
        return Err(petite::Error::Usage(format!(
            "{}: the output would overwrite an input",
            out.display()
        ))
        .into());
    }
    let weights = petite_pi05::inputs::open_checkpoint(ck)
        .with_context(|| format!("opening {}", ck.display()))?;
    petite_pi05::inputs::check_weights(&weights, &ck.display().to_string(), [&prog])?;
    let r = petite_portable::export_portable(&prog, &weights, out)
        .with_context(|| format!("lowering to {}", out.display()))?;
    let json = out.with_extension("pte.json");
    petite_fs::write(&json, serde_json::to_string_pretty(&r)?.as_bytes())?;
    let s = &r.plan;
    println!(
        "{}: {} bytes, {} kernel calls, {} operators; planned buffer {} B (largest live set {} B, all activations {} B); constants {} B",
        out.display(),
        r.file_bytes,
        s.calls,
        r.operators.len(),
        s.planned_bytes,
        s.max_live_bytes,
        s.sum_bytes,
        r.constant_bytes
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use petite_pi05::Pi05Config;
    use petite_pi05::programs::Precision;

    use super::*;

    /// The full-size pi0.5 prefix plans (shapes only) within 1.5x of its largest live set.
    #[test]
    fn full_size_prefix_plan_is_within_1_5x_of_the_largest_live_set() {
        for precision in [Precision::F32, Precision::Bf16] {
            let prog = build_prefix(&Pi05Config::default(), precision).unwrap();
            let s = petite_portable::plan_portable(&prog).unwrap().plan;
            assert!(s.planned_bytes >= s.max_live_bytes);
            assert!(
                s.planned_bytes as f64 <= 1.5 * s.max_live_bytes as f64,
                "{s:?}"
            );
        }
    }
}
