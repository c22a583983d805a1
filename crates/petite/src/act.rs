//! `petite act`: a bundle run from a raw observation the way lerobot 0.6.1 runs the policy —
//! preprocessor (state normalization, the state's 256 bins written into the prompt, the prompt
//! tokenized, images resized with padding and scaled to [-1, 1], absent cameras masked) →
//! the exported programs → postprocessor (slice to the real action width, unnormalize,
//! relative actions made absolute). Every step follows `policy.json`, which the export wrote
//! from the lerobot folder; nothing is guessed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use petite_pi05::lerobot::STATE_KEY;
use petite_pi05::policy::PolicySpec;
use safetensors::{Dtype, SafeTensors};

use crate::policy::{Array, Observation, OpenOptions, Options, Policy, Timing};
use crate::{Error, Result};

pub use crate::settings::TOKENIZER_ENV;

/// Settings of one `petite act` run.
#[derive(Debug, Clone)]
pub struct ActOptions {
    /// The export (`prefix.pte` + `step.pte`, or `pi05.onnx`, and `policy.json`).
    pub dir: PathBuf,
    /// The observation safetensors (lerobot's keys).
    pub observation: PathBuf,
    /// The task (else the observation's metadata `task`).
    pub task: Option<String>,
    /// A `tokenizer.json` (else `$PETITE_TOKENIZER`, else the Hugging Face cache).
    pub tokenizer: Option<PathBuf>,
    /// Noise safetensors (`noise`), used unless the observation has `noise`.
    pub noise: Option<PathBuf>,
    /// Seed of the noise when neither file has it.
    pub seed: u64,
    /// Python for portable (ExecuTorch) or ONNX bundles.
    pub python: Option<PathBuf>,
    /// Where a bundle of petite's engines runs (`cuda`: GPU 0 through petite-cuda; portable and
    /// ONNX bundles run on the CPU only).
    pub device: crate::runtimes::Device,
    /// Calls after the first, on the same observation, for their latency ([`ActResult::timing`]).
    pub repeat: usize,
    /// Real-time chunking's settings, used when the observation file holds
    /// `rtc.prev_chunk_left_over` (model space, f32 `[rows, cols]`).
    pub rtc: RtcSettings,
}

/// `petite act`'s real-time-chunking flags (see [`crate::policy::Rtc`]).
#[derive(Debug, Clone, Default)]
pub struct RtcSettings {
    /// Actions executed while the chunk is computed (required with a leftover).
    pub inference_delay: Option<usize>,
    /// Rows guided by the leftover (default: the export's).
    pub execution_horizon: Option<usize>,
    /// The prefix-attention schedule (default: the export's).
    pub schedule: Option<crate::policy::Schedule>,
    /// The guidance's upper bound (default: the export's).
    pub max_guidance_weight: Option<f32>,
}

/// The observation file's key of RTC's leftover.
pub const RTC_LEFTOVER_KEY: &str = "rtc.prev_chunk_left_over";

/// What one run produced.
#[derive(Debug, Clone)]
pub struct ActResult {
    /// f32 `[chunk, action_dim]`, unnormalized.
    pub actions: Vec<f32>,
    /// The chunk length.
    pub chunk: usize,
    /// The real action width.
    pub action_dim: usize,
    /// How many actions lerobot executes before planning again.
    pub n_action_steps: usize,
    /// The prompt's token ids `[tokens]` (right-padded).
    pub tokens: Vec<i64>,
    /// 1 for a real token.
    pub token_mask: Vec<u8>,
    /// The prompt as tokenized.
    pub prompt: String,
    /// Which runtime ran the programs.
    pub runtime: String,
    /// The export id of the bundle.
    pub export_id: String,
    /// Seconds to open the policy, then each call's [`Timing`] (the first, then the repeats).
    pub timing: (f64, Vec<Timing>),
}

fn obs_err(file: &Path, key: &str, expected: impl Into<String>, found: impl Into<String>) -> Error {
    Error::input(
        file,
        format!(
            "`{key}`: expected {}, found {}",
            expected.into(),
            found.into()
        ),
    )
}

/// The observation file as a [`Observation`] and the call's [`Options`]: every key checked
/// against the policy's cameras (an unknown key is refused naming it), the task from `--task`
/// or the file's metadata, the noise from the file, `--noise` or the seed.
fn read_observation(opts: &ActOptions, spec: &PolicySpec) -> Result<(Observation, Options)> {
    let file = &opts.observation;
    let r = spec
        .runner
        .as_ref()
        .ok_or_else(|| Error::Internal("read_observation needs a lerobot interface".into()))?;
    let (chunk, max_action_dim) = (spec.model.chunk, spec.model.action_dim);
    let bytes = std::fs::read(file).map_err(|e| Error::io(file, "read", e))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::input(file, format!("not a safetensors file: {e}")))?;
    let (_, meta) =
        SafeTensors::read_metadata(&bytes).map_err(|e| Error::input(file, e.to_string()))?;
    let tensors: HashMap<String, _> = st.tensors().into_iter().collect();
    let is_camera = |k: &str| r.cameras.iter().any(|c| c.key == k);
    for k in tensors.keys() {
        if k != STATE_KEY && k != "noise" && k != RTC_LEFTOVER_KEY && !is_camera(k) {
            let cams: Vec<&str> = r.cameras.iter().map(|c| c.key.as_str()).collect();
            return Err(obs_err(
                file,
                k,
                format!(
                    "one of {STATE_KEY}, noise, {RTC_LEFTOVER_KEY}, {}",
                    cams.join(", ")
                ),
                "an unknown key",
            ));
        }
    }
    let array = |t: &safetensors::tensor::TensorView<'_>| -> Option<Array> {
        let shape = t.shape().to_vec();
        match t.dtype() {
            Dtype::F32 => Some(Array::F32 {
                shape,
                data: t
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            }),
            Dtype::U8 => Some(Array::U8 {
                shape,
                data: t.data().to_vec(),
            }),
            _ => None,
        }
    };
    let mut obs = Observation::default();
    for (k, t) in &tensors {
        let a = array(t).ok_or_else(|| {
            obs_err(
                file,
                k,
                "float32 or uint8 values",
                format!("{:?} {:?}", t.dtype(), t.shape()),
            )
        })?;
        if k == STATE_KEY {
            obs.state = Some(a);
        } else if k != "noise" && k != RTC_LEFTOVER_KEY {
            obs.images.insert(k.clone(), a);
        }
    }
    obs.task = opts
        .task
        .clone()
        .or_else(|| {
            meta.metadata()
                .as_ref()
                .and_then(|m| m.get("task").cloned())
        })
        .ok_or_else(|| {
            Error::input(
                file,
                "no task: give --task TEXT or the file's metadata key `task`",
            )
        })?;
    // Noise: the observation's, else --noise, else seeded.
    let noise_of = |t: &safetensors::tensor::TensorView<'_>, f: &Path| -> Result<Vec<f32>> {
        let (c, w) = (chunk, max_action_dim);
        match (t.dtype(), t.shape(), array(t)) {
            (Dtype::F32, [a, b], Some(Array::F32 { data, .. })) if *a == c && *b == w => Ok(data),
            (d, s, _) => Err(obs_err(
                f,
                "noise",
                format!("f32 [{c}, {w}]"),
                format!("{d:?} {s:?}"),
            )),
        }
    };
    let noise = if let Some(t) = tensors.get("noise") {
        Some(noise_of(t, file)?)
    } else if let Some(nf) = &opts.noise {
        let nb = std::fs::read(nf).map_err(|e| Error::io(nf, "read", e))?;
        let ns = SafeTensors::deserialize(&nb)
            .map_err(|e| Error::input(nf, format!("not a safetensors file: {e}")))?;
        let t = ns.tensor("noise").map_err(|_| {
            obs_err(
                nf,
                "noise",
                format!("f32 [{chunk}, {max_action_dim}]"),
                "nothing",
            )
        })?;
        Some(noise_of(&t, nf)?)
    } else {
        None
    };
    let rtc = match tensors.get(RTC_LEFTOVER_KEY) {
        None => {
            if opts.rtc.inference_delay.is_some() {
                return Err(Error::Usage(format!(
                    "--inference-delay: real-time chunking needs the previous chunk's leftover as `{RTC_LEFTOVER_KEY}` in {}",
                    file.display()
                )));
            }
            None
        }
        Some(t) => {
            let a = array(t).ok_or_else(|| {
                obs_err(
                    file,
                    RTC_LEFTOVER_KEY,
                    "float32 values",
                    format!("{:?} {:?}", t.dtype(), t.shape()),
                )
            })?;
            let s = &opts.rtc;
            Some(crate::policy::Rtc {
                prev_chunk_left_over: a,
                inference_delay: s.inference_delay.ok_or_else(|| {
                    Error::Usage(format!(
                        "{} holds `{RTC_LEFTOVER_KEY}`: give --inference-delay N (the actions executed while the chunk is computed)",
                        file.display()
                    ))
                })?,
                execution_horizon: s.execution_horizon,
                schedule: s.schedule,
                max_guidance_weight: s.max_guidance_weight,
            })
        }
    };
    let options = Options {
        seed: noise.is_none().then_some(opts.seed),
        noise,
        rtc,
    };
    Ok((obs, options))
}

/// Runs `petite act`: checks the bundle (one export), reads and checks the observation file
/// (before any weight is read), opens the export as a [`Policy`] (the programs opened with
/// whichever runtime it needs) and returns one chunk.
pub fn act(opts: &ActOptions) -> Result<ActResult> {
    // `--device cuda` where CUDA cannot run is refused before anything is read.
    opts.device.check()?;
    let dir = &opts.dir;
    let spec = crate::bundle::check_bundle(dir)?.ok_or_else(|| {
        Error::input(
            dir,
            "no policy.json: export from the lerobot policy folder with this petite",
        )
    })?;
    if spec.runner.is_none() {
        return Err(Error::input(
            &dir.join(crate::layout::POLICY),
            "no lerobot interface (exported from bare weights): export from the lerobot policy folder (config.json + model.safetensors) to run it with `petite act`",
        ));
    }
    let file = &opts.observation;
    let in_file = |e: Error| match e {
        Error::Observation { key, reason } => Error::input(file, format!("`{key}`: {reason}")),
        e => e,
    };
    let (obs, options) = read_observation(opts, &spec)?;
    crate::policy::check_observation(&spec, &obs).map_err(in_file)?;
    let opened = std::time::Instant::now();
    let policy = Policy::open(
        dir,
        &OpenOptions {
            device: opts.device,
            tokenizer: opts.tokenizer.clone(),
            python: opts.python.clone(),
            seed: Some(opts.seed),
            queue: 1,
        },
    )?;
    let open_s = opened.elapsed().as_secs_f64();
    let (c, first) = policy.act_timed(&obs, &options).map_err(in_file)?;
    let mut calls = vec![first];
    for _ in 0..opts.repeat {
        let (again, t) = policy.act_timed(&obs, &options)?;
        if (options.seed.is_some() || options.noise.is_some()) && again != c {
            return Err(Error::Internal(
                "a repeated call with the same observation and noise gave another chunk".into(),
            ));
        }
        calls.push(t);
    }
    let info = policy.info();
    Ok(ActResult {
        actions: c.actions,
        chunk: c.chunk,
        action_dim: c.action_dim,
        n_action_steps: c.n_action_steps,
        tokens: c.tokens,
        token_mask: c.token_mask,
        prompt: c.prompt,
        runtime: info.runtime.clone(),
        export_id: info.export_id.clone(),
        timing: (open_s, calls),
    })
}

/// Writes `action` f32 `[chunk, action_dim]` (and the prompt's tokens and mask, for checking)
/// to `out` (petite-fs: temporary name, fsync, rename), with `n_action_steps` and the export id as
/// metadata.
pub fn write_result(out: &Path, r: &ActResult) -> Result<()> {
    use safetensors::tensor::TensorView;
    let a: Vec<u8> = r.actions.iter().flat_map(|v| v.to_le_bytes()).collect();
    let t: Vec<u8> = r.tokens.iter().flat_map(|v| v.to_le_bytes()).collect();
    fn view<'a>(out: &Path, d: Dtype, s: Vec<usize>, b: &'a [u8]) -> Result<TensorView<'a>> {
        TensorView::new(d, s, b).map_err(|e| Error::Internal(format!("{}: {e}", out.display())))
    }
    let tensors = vec![
        (
            "action",
            view(out, Dtype::F32, vec![r.chunk, r.action_dim], &a)?,
        ),
        (
            "observation.language.tokens",
            view(out, Dtype::I64, vec![r.tokens.len()], &t)?,
        ),
        (
            "observation.language.attention_mask",
            view(out, Dtype::BOOL, vec![r.token_mask.len()], &r.token_mask)?,
        ),
    ];
    let meta: HashMap<String, String> = [
        ("n_action_steps".to_string(), r.n_action_steps.to_string()),
        ("export_id".to_string(), r.export_id.clone()),
    ]
    .into();
    let bytes = safetensors::serialize(tensors, Some(meta))
        .map_err(|e| Error::Internal(format!("{}: {e}", out.display())))?;
    Ok(petite_fs::write(out, &bytes)?)
}
