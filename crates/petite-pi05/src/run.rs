//! Running pi0.5 with the reference executor: timestep table, prefix, then the Euler steps —
//! what `petite pi05 run` does, as a library so tests and later stages can call it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use petite_reference::Executor;
pub use petite_reference::Tensor;
use petite_weights::{Dtype, SafetensorsWriter, TensorSpec, WeightSource};

use crate::config::Pi05Config;
use crate::inputs::{Inputs, check_weights, open_checkpoint};
use crate::programs::{Precision, build_all, io, time_row_len};
use crate::{Error, Result};

/// Everything one run produced (the actions plus what the parity tests compare on the way).
#[derive(Debug, Clone)]
pub struct RunResult {
    /// f32 `[chunk, action_dim]`, model space (before un-normalisation).
    pub actions: Vec<f32>,
    /// f32 `[steps, R]`, see [`crate::programs`].
    pub timestep_table: Vec<f32>,
    /// The prefix program's outputs (`prefix_k_{i}`, `prefix_v_{i}`, `prefix_pad_mask`).
    pub prefix: BTreeMap<String, Tensor>,
    /// x after each step (`steps` entries; the last is `actions`).
    pub trajectory: Vec<Vec<f32>>,
    /// Seconds spent in the timestep table, the prefix and all steps.
    pub seconds: [f64; 3],
}

fn output(
    mut outs: BTreeMap<String, Tensor>,
    name: &str,
) -> Result<(Tensor, BTreeMap<String, Tensor>)> {
    let t = outs
        .remove(name)
        .ok_or_else(|| Error::Internal(format!("program produced no output `{name}`")))?;
    Ok((t, outs))
}

fn f32_values(t: Tensor, name: &str) -> Result<Vec<f32>> {
    t.into_float_values()
        .map_err(|t| Error::Internal(format!("output `{name}` is {}, not float", t.dtype())))
}

/// Runs the three programs on `inputs` with weights from `weights` (canonical names).
pub fn run_model(
    cfg: &Pi05Config,
    weights: &dyn WeightSource,
    inputs: &Inputs,
    precision: Precision,
) -> Result<RunResult> {
    let progs = build_all(cfg, precision)?;
    let t0 = Instant::now();
    // Exported bytes (step.pte holds this table): the same on every CPU.
    let outs = Executor::new(&progs.timestep_table, weights)?
        .exact_bf16(true)
        .run(BTreeMap::new())?;
    let (table, _) = output(outs, io::TIMESTEP_TABLE)?;
    let table = f32_values(table, io::TIMESTEP_TABLE)?;
    let t1 = Instant::now();

    let s = cfg.vision.image_size;
    let mut pin = BTreeMap::new();
    pin.insert(
        io::IMAGES.to_string(),
        Tensor::f32(&[cfg.cameras, 3, s, s], inputs.images.clone())?,
    );
    pin.insert(
        io::IMAGE_MASKS.to_string(),
        Tensor::u8(&[cfg.cameras], inputs.image_masks.clone())?,
    );
    pin.insert(
        io::TOKENS.to_string(),
        Tensor::i64(&[cfg.tokens], inputs.tokens.clone())?,
    );
    pin.insert(
        io::TOKEN_MASK.to_string(),
        Tensor::u8(&[cfg.tokens], inputs.token_mask.clone())?,
    );
    // The step re-reads the same weights every step: keep their pages. They are read while the
    // prefix's last layers run.
    let step = Executor::new(&progs.step, weights)?.release_weights(false);
    let prefix = Executor::new(&progs.prefix, weights)?
        .read_ahead_into(&step)
        .run(pin)?;
    let t2 = Instant::now();

    let r = time_row_len(cfg);
    let mut x = inputs.noise.clone();
    let mut trajectory = Vec::with_capacity(cfg.steps);
    for k in 0..cfg.steps {
        let mut sin: BTreeMap<String, Tensor> = prefix.clone();
        sin.insert(
            io::X_T.to_string(),
            Tensor::f32(&[cfg.chunk, cfg.action_dim], x)?,
        );
        sin.insert(
            io::TIME_ROW.to_string(),
            Tensor::f32(&[r], table[k * r..(k + 1) * r].to_vec())?,
        );
        for (name, t) in inputs.guidance.step_tensors(cfg, k)? {
            sin.insert(name.to_string(), t);
        }
        let (xn, _) = output(step.run(sin)?, io::X_NEXT)?;
        x = f32_values(xn, io::X_NEXT)?;
        trajectory.push(x.clone());
    }
    let t3 = Instant::now();
    Ok(RunResult {
        actions: x,
        timestep_table: table,
        prefix,
        trajectory,
        seconds: [
            (t1 - t0).as_secs_f64(),
            (t2 - t1).as_secs_f64(),
            (t3 - t2).as_secs_f64(),
        ],
    })
}

/// Writes `actions` f32 `[chunk, action_dim]` to `out` (temporary name, then rename).
pub fn write_actions(out: &Path, cfg: &Pi05Config, actions: &[f32]) -> Result<PathBuf> {
    let spec = TensorSpec::new("actions", Dtype::F32, &[cfg.chunk, cfg.action_dim]);
    let w = SafetensorsWriter::create(out, &[spec], &[])?;
    let bytes: Vec<u8> = actions.iter().flat_map(|v| v.to_le_bytes()).collect();
    w.write_at("actions", 0, &bytes)?;
    Ok(w.finish()?)
}

/// Paths of one `petite pi05 run`.
#[derive(Debug, Clone)]
pub struct RunFiles<'a> {
    /// Checkpoint (file, index or directory), lerobot or Hub layout.
    pub checkpoint: &'a Path,
    /// Config JSON; `None` = the real pi0.5.
    pub config: Option<&'a Path>,
    /// Inputs safetensors.
    pub inputs: &'a Path,
    /// Output safetensors (`actions`).
    pub out: &'a Path,
}

/// `petite pi05 run`: validates config, checkpoint and inputs before computing anything, runs,
/// writes the actions. Nothing is written under `out` on failure.
pub fn run_files(files: &RunFiles<'_>, precision: Precision) -> Result<RunResult> {
    let cfg = match files.config {
        Some(p) => Pi05Config::from_json_file(p)?,
        None => Pi05Config::default(),
    };
    // Refuse to replace an input with the output (inputs are never modified).
    let canon = |p: &Path| std::fs::canonicalize(p).ok();
    if let Some(out) = canon(files.out) {
        let ins = [Some(files.checkpoint), files.config, Some(files.inputs)];
        if ins
            .iter()
            .flatten()
            .any(|p| canon(p).as_ref() == Some(&out))
        {
            return Err(Error::Internal(format!(
                "{}: the output would overwrite an input",
                files.out.display()
            )));
        }
    }
    let ck = open_checkpoint(files.checkpoint)?;
    let progs = build_all(&cfg, precision)?;
    check_weights(
        &ck,
        &files.checkpoint.display().to_string(),
        [&progs.timestep_table, &progs.prefix, &progs.step],
    )?;
    let inputs = Inputs::from_file(files.inputs, &cfg)?;
    let result = run_model(&cfg, &ck, &inputs, precision)?;
    if let Some((i, v)) = result
        .actions
        .iter()
        .enumerate()
        .find(|(_, v)| !v.is_finite())
    {
        return Err(Error::Internal(format!(
            "actions are not finite ({v} at index {i}); nothing written"
        )));
    }
    // Nothing is written from a checkpoint that changed while it was read.
    ck.check_unchanged()?;
    write_actions(files.out, &cfg, &result.actions)?;
    Ok(result)
}
