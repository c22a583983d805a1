//! `petite act`: a bundle run from a raw observation the way lerobot 0.6.1 runs the policy —
//! preprocessor (state normalization, the state's 256 bins written into the prompt, the prompt
//! tokenized, images resized with padding and scaled to [-1, 1], absent cameras masked) →
//! the exported programs → postprocessor (slice to the real action width, unnormalize,
//! relative actions made absolute). Every step follows `policy.json`, which the export wrote
//! from the lerobot folder; nothing is guessed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use petite_pi05::Pi05Config;
use petite_pi05::inputs::Inputs;
use petite_pi05::lerobot::STATE_KEY;
use petite_pi05::policy::{Norm, PolicySpec, Runner};
use safetensors::{Dtype, SafeTensors};

use crate::{Error, Result};

pub use crate::settings::TOKENIZER_ENV;
/// lerobot's normalizer epsilon (`NormalizerProcessorStep.eps`).
const EPS: f32 = 1e-8;

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
}

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

/// lerobot's normalization of `x` by `n` (in its f32 operation order); identity without stats.
pub fn normalize(x: &[f32], n: &Norm) -> Vec<f32> {
    let s = |k: &str| n.stats.get(k);
    match n.mode.as_str() {
        "MEAN_STD" => match (s("mean"), s("std")) {
            (Some(m), Some(sd)) => x
                .iter()
                .zip(m.iter().zip(sd))
                .map(|(&v, (&m, &sd))| (v - m) / (sd + EPS))
                .collect(),
            _ => x.to_vec(),
        },
        mode => {
            let (lo, hi) = match mode {
                "MIN_MAX" => ("min", "max"),
                "QUANTILES" => ("q01", "q99"),
                "QUANTILE10" => ("q10", "q90"),
                _ => return x.to_vec(),
            };
            match (s(lo), s(hi)) {
                (Some(lo), Some(hi)) => x
                    .iter()
                    .zip(lo.iter().zip(hi))
                    .map(|(&v, (&lo, &hi))| {
                        let d = if hi - lo == 0.0 { EPS } else { hi - lo };
                        2.0 * (v - lo) / d - 1.0
                    })
                    .collect(),
                _ => x.to_vec(),
            }
        }
    }
}

/// lerobot's inverse of [`normalize`].
pub fn unnormalize(x: &[f32], n: &Norm) -> Vec<f32> {
    let s = |k: &str| n.stats.get(k);
    let w = x.len();
    match n.mode.as_str() {
        "MEAN_STD" => match (s("mean"), s("std")) {
            (Some(m), Some(sd)) => (0..w).map(|i| x[i] * sd[i] + m[i]).collect(),
            _ => x.to_vec(),
        },
        mode => {
            let (lo, hi) = match mode {
                "MIN_MAX" => ("min", "max"),
                "QUANTILES" => ("q01", "q99"),
                "QUANTILE10" => ("q10", "q90"),
                _ => return x.to_vec(),
            };
            match (s(lo), s(hi)) {
                (Some(lo), Some(hi)) => (0..w)
                    .map(|i| {
                        let d = if hi[i] - lo[i] == 0.0 {
                            EPS
                        } else {
                            hi[i] - lo[i]
                        };
                        if mode == "MIN_MAX" {
                            (x[i] + 1.0) / 2.0 * d + lo[i]
                        } else {
                            (x[i] + 1.0) * d / 2.0 + lo[i]
                        }
                    })
                    .collect(),
                _ => x.to_vec(),
            }
        }
    }
}

/// `np.digitize(s, np.linspace(-1, 1, bins + 1)[:-1]) - 1`: −1 below −1, up to `bins − 1`.
/// The edges `−1 + 2i/bins` are exact in binary for 256 bins; compared in f64 as numpy does.
pub fn state_bins(s: &[f32], bins: usize) -> Vec<i64> {
    s.iter()
        .map(|&v| {
            let v = v as f64;
            let below = (0..bins)
                .filter(|&i| -1.0 + 2.0 * i as f64 / bins as f64 <= v)
                .count();
            below as i64 - 1
        })
        .collect()
}

/// lerobot's prompt: the task cleaned (stripped, `_` and newlines to spaces) and the bins.
pub fn prompt(task: &str, bins: &[i64]) -> String {
    let cleaned = task.trim().replace(['_', '\n'], " ");
    let state: Vec<String> = bins.iter().map(ToString::to_string).collect();
    format!("Task: {cleaned}, State: {};\nAction: ", state.join(" "))
}

/// Bilinear resize of one CHW f32 plane set to `oh × ow`, as PyTorch's `F.interpolate(mode=
/// "bilinear", align_corners=False)` without antialias computes it on the CPU (f32 source
/// index `scale·(dst+0.5)−0.5`, clamped at 0).
fn bilinear(img: &[f32], c: usize, h: usize, w: usize, oh: usize, ow: usize) -> Vec<f32> {
    let idx = |insz: usize, outsz: usize, d: usize| -> (usize, usize, f32) {
        let scale = insz as f32 / outsz as f32;
        let src = (scale * (d as f32 + 0.5) - 0.5).max(0.0);
        let i0 = src as usize;
        let i1 = if i0 < insz - 1 { i0 + 1 } else { i0 };
        (i0, i1, src - i0 as f32)
    };
    let ys: Vec<_> = (0..oh).map(|y| idx(h, oh, y)).collect();
    let xs: Vec<_> = (0..ow).map(|x| idx(w, ow, x)).collect();
    let mut out = vec![0f32; c * oh * ow];
    for ch in 0..c {
        let p = &img[ch * h * w..(ch + 1) * h * w];
        for (y, &(y0, y1, ly)) in ys.iter().enumerate() {
            for (x, &(x0, x1, lx)) in xs.iter().enumerate() {
                let (hy, hx) = (1.0 - ly, 1.0 - lx);
                out[ch * oh * ow + y * ow + x] = hy * (hx * p[y0 * w + x0] + lx * p[y0 * w + x1])
                    + ly * (hx * p[y1 * w + x0] + lx * p[y1 * w + x1]);
            }
        }
    }
    out
}

/// lerobot's `resize_with_pad_torch` on a CHW f32 image in [0, 1] (scale by the larger ratio,
/// `int` sizes, bilinear, clamp, centred zero padding), then `x·2 − 1`.
pub fn prepare_image(img: &[f32], h: usize, w: usize, res: usize) -> Vec<f32> {
    let resized;
    let (rh, rw, src) = if h == res && w == res {
        (h, w, img)
    } else {
        let ratio = (w as f64 / res as f64).max(h as f64 / res as f64);
        let (rh, rw) = ((h as f64 / ratio) as usize, (w as f64 / ratio) as usize);
        resized = bilinear(img, 3, h, w, rh, rw)
            .into_iter()
            .map(|v| v.clamp(0.0, 1.0))
            .collect::<Vec<_>>();
        (rh, rw, resized.as_slice())
    };
    let (top, left) = ((res - rh) / 2, (res - rw) / 2);
    let mut out = vec![-1f32; 3 * res * res];
    for ch in 0..3 {
        for y in 0..rh {
            for x in 0..rw {
                out[ch * res * res + (y + top) * res + x + left] =
                    src[ch * rh * rw + y * rw + x] * 2.0 - 1.0;
            }
        }
    }
    out
}

/// The `tokenizer.json` to use: `explicit`, `$PETITE_TOKENIZER`, a folder named by the bundle's
/// tokenizer id, or the Hugging Face cache's snapshot of it; else one line saying where to get
/// it.
pub fn find_tokenizer(explicit: Option<&Path>, id: &str) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    let settings = crate::settings::current()?;
    if let Some(p) = settings.tokenizer {
        return Ok(p);
    }
    let local = Path::new(id).join("tokenizer.json");
    if local.is_file() {
        return Ok(local);
    }
    if let Some(hub) = settings.hf_hub {
        let snaps = hub
            .join(format!("models--{}", id.replace('/', "--")))
            .join("snapshots");
        if let Ok(entries) = std::fs::read_dir(&snaps) {
            let mut found: Vec<PathBuf> = entries
                .filter_map(|e| e.ok())
                .map(|e| e.path().join("tokenizer.json"))
                .filter(|p| p.is_file())
                .collect();
            found.sort();
            if let Some(p) = found.pop() {
                return Ok(p);
            }
        }
    }
    Err(Error::Unavailable(format!(
        "no tokenizer.json for `{id}`: give --tokenizer FILE or ${TOKENIZER_ENV}, or download it into the Hugging Face cache (`hf download {id} tokenizer.json`; the PaliGemma tokenizer is gated: accept its license on the Hub first)"
    )))
}

/// Tokenizes `text` as lerobot's `TokenizerProcessorStep` (special tokens added as the
/// tokenizer defines them, truncated to `max_len`, right-padded with the pad id); returns ids
/// and the attention mask.
pub fn tokenize(path: &Path, text: &str, max_len: usize) -> Result<(Vec<i64>, Vec<u8>)> {
    let usage = |m: String| Error::input(path, m);
    let mut tok = tokenizers::Tokenizer::from_file(path).map_err(|e| usage(e.to_string()))?;
    tok.with_truncation(Some(tokenizers::TruncationParams {
        max_length: max_len,
        ..Default::default()
    }))
    .map_err(|e| usage(e.to_string()))?;
    tok.with_padding(None);
    let enc = tok.encode(text, true).map_err(|e| usage(e.to_string()))?;
    let pad = tok
        .get_padding()
        .map(|p| p.pad_id)
        .or_else(|| tok.token_to_id("<pad>"))
        .unwrap_or(0) as i64;
    let mut ids: Vec<i64> = enc.get_ids().iter().map(|&i| i as i64).collect();
    ids.truncate(max_len);
    let n = ids.len();
    ids.resize(max_len, pad);
    let mask = (0..max_len).map(|i| u8::from(i < n)).collect();
    Ok((ids, mask))
}

/// One tensor of the observation file as f32 (uint8 images are scaled by 1/255, as lerobot's
/// datasets and environments do), with its shape.
fn read_f32(t: &safetensors::tensor::TensorView<'_>) -> Option<Vec<f32>> {
    let b = t.data();
    match t.dtype() {
        Dtype::F32 => Some(
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        Dtype::U8 => Some(b.iter().map(|&v| v as f32 / 255.0).collect()),
        _ => None,
    }
}

/// The bundle's runner metadata, or a refusal saying why there is none.
fn runner_of(spec: &PolicySpec, dir: &Path) -> Result<Runner> {
    spec.runner.clone().ok_or_else(|| {
        Error::input(
            &dir.join(crate::layout::POLICY),
            "no lerobot interface (exported from bare weights): export from the lerobot policy folder (config.json + model.safetensors) to run it with `petite act`",
        )
    })
}

/// The model inputs for `cfg` from the observation file, following `r`; returns the inputs,
/// the raw state and the prompt.
fn preprocess(
    opts: &ActOptions,
    cfg: &Pi05Config,
    r: &Runner,
) -> Result<(Inputs, Vec<f32>, String)> {
    let file = &opts.observation;
    let bytes = std::fs::read(file).map_err(|e| Error::io(file, "read", e))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| Error::input(file, format!("not a safetensors file: {e}")))?;
    let (_, meta) =
        SafeTensors::read_metadata(&bytes).map_err(|e| Error::input(file, e.to_string()))?;
    let tensors: HashMap<String, _> = st.tensors().into_iter().collect();
    for k in tensors.keys() {
        let known = k == STATE_KEY || k == "noise" || r.cameras.iter().any(|c| &c.key == k);
        if !known {
            let cams: Vec<&str> = r.cameras.iter().map(|c| c.key.as_str()).collect();
            return Err(obs_err(
                file,
                k,
                format!("one of {STATE_KEY}, noise, {}", cams.join(", ")),
                "an unknown key",
            ));
        }
    }
    // State.
    let state_t = tensors
        .get(STATE_KEY)
        .ok_or_else(|| obs_err(file, STATE_KEY, format!("f32 [{}]", r.state_dim), "nothing"))?;
    let state = match (state_t.dtype(), state_t.shape()) {
        (Dtype::F32, [n]) if *n == r.state_dim => read_f32(state_t).unwrap_or_default(),
        (d, s) => {
            return Err(obs_err(
                file,
                STATE_KEY,
                format!("f32 [{}]", r.state_dim),
                format!("{d:?} {s:?}"),
            ));
        }
    };
    if let Some(i) = state.iter().position(|v| !v.is_finite()) {
        return Err(obs_err(
            file,
            STATE_KEY,
            "finite values",
            format!("{} at {i}", state[i]),
        ));
    }
    let mut norm_state = normalize(&state, &r.state_norm);
    if r.state_padded {
        norm_state.resize(r.max_state_dim, 0.0);
    }
    // Images: present cameras first (config order), then the missing ones masked, as lerobot.
    let res = cfg.vision.image_size;
    let plane = 3 * res * res;
    let mut present = Vec::new();
    let mut missing = 0;
    for c in &r.cameras {
        let Some(t) = tensors.get(&c.key) else {
            missing += 1;
            continue;
        };
        let (h, w, chw) = match (t.dtype(), t.shape()) {
            (Dtype::F32, [3, h, w]) if *h > 0 && *w > 0 => {
                (*h, *w, read_f32(t).unwrap_or_default())
            }
            (Dtype::U8, [h, w, 3]) if *h > 0 && *w > 0 => {
                let hwc = read_f32(t).unwrap_or_default();
                let mut chw = vec![0f32; hwc.len()];
                for y in 0..*h {
                    for x in 0..*w {
                        for ch in 0..3 {
                            chw[ch * h * w + y * w + x] = hwc[(y * w + x) * 3 + ch];
                        }
                    }
                }
                (*h, *w, chw)
            }
            (d, s) => {
                return Err(obs_err(
                    file,
                    &c.key,
                    "float32 [3, H, W] in [0, 1] or uint8 [H, W, 3]",
                    format!("{d:?} {s:?}"),
                ));
            }
        };
        if let Some(i) = chw.iter().position(|v| !v.is_finite()) {
            return Err(obs_err(
                file,
                &c.key,
                "finite values",
                format!("{} at {i}", chw[i]),
            ));
        }
        present.push(prepare_image(&chw, h, w, res));
    }
    if present.is_empty() {
        return Err(Error::input(
            file,
            format!(
                "no camera image: at least one of {} is needed (lerobot refuses an observation without images)",
                r.cameras
                    .iter()
                    .filter(|c| !c.empty)
                    .map(|c| c.key.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    let mut images = Vec::with_capacity(cfg.cameras * plane);
    let mut image_masks = Vec::with_capacity(cfg.cameras);
    for p in &present {
        images.extend_from_slice(p);
        image_masks.push(1);
    }
    images.extend(std::iter::repeat_n(-1f32, missing * plane));
    image_masks.extend(std::iter::repeat_n(0, missing));
    // Prompt and tokens (after every check of the observation).
    let task = opts
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
                "no task: give --task TEXT or the file's metadata key `task`".to_string(),
            )
        })?;
    let text = prompt(&task, &state_bins(&norm_state, r.state_bins));
    let tok_path = find_tokenizer(opts.tokenizer.as_deref(), &r.tokenizer)?;
    let (tokens, token_mask) = tokenize(&tok_path, &text, cfg.tokens)?;
    if let Some(t) = tokens
        .iter()
        .find(|&&t| t < 0 || t as usize >= cfg.language.vocab)
    {
        return Err(Error::input(
            &tok_path,
            format!(
                "token id {t} is outside the model's vocabulary ({}): the wrong tokenizer?",
                cfg.language.vocab
            ),
        ));
    }
    // Noise: the observation's, else --noise, else seeded.
    let want = cfg.chunk * cfg.action_dim;
    let noise_from = |t: &safetensors::tensor::TensorView<'_>, f: &Path| -> Result<Vec<f32>> {
        match (t.dtype(), t.shape()) {
            (Dtype::F32, [a, b]) if *a == cfg.chunk && *b == cfg.action_dim => {
                let v = read_f32(t).unwrap_or_default();
                if v.iter().any(|x| !x.is_finite()) {
                    return Err(obs_err(f, "noise", "finite values", "NaN or inf"));
                }
                Ok(v)
            }
            (d, s) => Err(obs_err(
                f,
                "noise",
                format!("f32 [{}, {}]", cfg.chunk, cfg.action_dim),
                format!("{d:?} {s:?}"),
            )),
        }
    };
    let noise = if let Some(t) = tensors.get("noise") {
        noise_from(t, file)?
    } else if let Some(nf) = &opts.noise {
        let nb = std::fs::read(nf).map_err(|e| Error::io(nf, "read", e))?;
        let ns = SafeTensors::deserialize(&nb)
            .map_err(|e| Error::input(nf, format!("not a safetensors file: {e}")))?;
        let t = ns.tensor("noise").map_err(|_| {
            obs_err(
                nf,
                "noise",
                format!("f32 [{}, {}]", cfg.chunk, cfg.action_dim),
                "nothing",
            )
        })?;
        noise_from(&t, nf)?
    } else {
        crate::verify::seeded_inputs(cfg, opts.seed).noise
    };
    debug_assert_eq!(noise.len(), want);
    Ok((
        Inputs {
            images,
            image_masks,
            tokens,
            token_mask,
            noise,
        },
        state,
        text,
    ))
}

/// Runs `petite act`: checks the bundle (one export), preprocesses the observation, runs the
/// programs with whichever runtime the bundle needs, and post-processes the actions.
pub fn act(opts: &ActOptions) -> Result<ActResult> {
    // `--device cuda` where CUDA cannot run is refused before anything is read.
    crate::runtimes::check_device(opts.device)?;
    let dir = &opts.dir;
    let spec = crate::bundle::check_bundle(dir)?.ok_or_else(|| {
        Error::input(
            dir,
            "no policy.json: export from the lerobot policy folder with this petite".to_string(),
        )
    })?;
    let r = runner_of(&spec, dir)?;
    let cfg = spec.model.clone();
    cfg.validate()?;
    let (inputs, raw_state, text) = preprocess(opts, &cfg, &r)?;
    let bundle =
        crate::bundle::BundleRunner::prepare(dir, &cfg, opts.python.as_deref(), opts.device)?;
    let (raw, ran) = bundle.run(&cfg, &inputs, None)?;
    let runtime = ran["runtime"].as_str().unwrap_or_default().to_string();
    if raw.len() != cfg.chunk * cfg.action_dim {
        return Err(Error::input(
            dir,
            format!(
                "the programs gave {} action values, expected {}",
                raw.len(),
                cfg.chunk * cfg.action_dim
            ),
        ));
    }
    if let Some(i) = raw.iter().position(|v| !v.is_finite()) {
        return Err(Error::input(
            dir,
            format!(
                "the programs' actions are not finite: {} at index {i}",
                raw[i]
            ),
        ));
    }
    let mut actions = Vec::with_capacity(cfg.chunk * r.action_dim);
    for row in raw.chunks_exact(cfg.action_dim) {
        let mut a = unnormalize(&row[..r.action_dim], &r.action_norm);
        if let Some(mask) = &r.relative_action_mask {
            for (i, m) in mask.iter().enumerate() {
                if *m && i < raw_state.len() {
                    a[i] += raw_state[i];
                }
            }
        }
        actions.extend(a);
    }
    Ok(ActResult {
        actions,
        chunk: cfg.chunk,
        action_dim: r.action_dim,
        n_action_steps: r.n_action_steps,
        tokens: inputs.tokens,
        token_mask: inputs.token_mask,
        prompt: text,
        runtime,
        export_id: spec.export_id,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_follow_numpy_digitize() {
        // Values numpy gives (checked): below -1 → -1; -1 exactly → 0; -0.99 ≥ -1 + 1/128 → 1;
        // just under 1 → 255; 1 and above → 255.
        assert_eq!(
            state_bins(&[-1.5, -1.0, -0.99, 0.0, 0.999, 1.0, 3.0], 256),
            [-1, 0, 1, 128, 255, 255, 255]
        );
    }

    #[test]
    fn prompt_is_lerobots() {
        assert_eq!(
            prompt("  pick_up\nthe cube ", &[3, -1]),
            "Task: pick up the cube, State: 3 -1;\nAction: "
        );
    }

    #[test]
    fn resize_with_pad_keeps_aspect_and_centres() {
        // A 2x4 image into 4x4: resized to 2x4 (ratio 1), one row of padding above and below.
        let img: Vec<f32> = (0..24).map(|i| (i % 8) as f32 / 8.0).collect();
        let out = prepare_image(&img, 2, 4, 4);
        assert_eq!(out.len(), 48);
        assert_eq!(&out[0..4], &[-1.0; 4]);
        assert_eq!(out[4], img[0] * 2.0 - 1.0);
        assert_eq!(&out[12..16], &[-1.0; 4]);
    }

    #[test]
    fn quantiles_round_trip() {
        let n = Norm {
            mode: "QUANTILES".into(),
            stats: [
                ("q01".into(), vec![0.0, 1.0]),
                ("q99".into(), vec![2.0, 1.0]),
            ]
            .into(),
            from: String::new(),
        };
        assert_eq!(normalize(&[1.0, 1.0], &n), vec![0.0, -1.0]);
        let back = unnormalize(&normalize(&[1.5, 1.0], &n), &n);
        assert!(
            (back[0] - 1.5).abs() < 1e-6 && (back[1] - 1.0).abs() < 1e-6,
            "{back:?}"
        );
    }
}
