//! `policy.json`: what a runner needs beside `prefix.pte` and `step.pte` and must not guess —
//! the model config, the export id both programs carry, and (for an export from a lerobot
//! folder) lerobot's pre- and post-processing: camera keys in slot order, image resolution and
//! resize rule, tokenizer and prompt, state and action widths, chunk and `n_action_steps`,
//! normalization modes with the stats copied from the processors' state files, relative
//! actions.

use std::collections::BTreeMap;
use std::path::Path;

use petite_weights::{MappedSafetensors, WeightSource};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::Pi05Config;
use crate::lerobot::{ACTION_KEY, CameraSlot, LerobotConfig, STATE_KEY};
use crate::{Error, Result};

/// The file name beside the programs.
pub const FILE: &str = "policy.json";
/// `format` of the files this version writes.
/// Version 2 (real-time chunking) changed `step.pte`'s inputs (`rtc_prev`, `rtc_weights`,
/// `rtc_step`) and `pi05.onnx`'s, and added `weights` and the runner's `rtc`.
pub const FORMAT: &str = "petite-policy/2";
/// The tokenizer lerobot 0.6.1's pi0.5 preprocessor loads (gated on the Hugging Face Hub).
pub const DEFAULT_TOKENIZER: &str = "google/paligemma-3b-pt-224";
/// lerobot's prompt (`pi05_prepare_state_tokenizer_processor_step`): `{task}` is the task with
/// `_` and newlines replaced by spaces and stripped, `{state}` the bins joined by spaces.
pub const PROMPT_TEMPLATE: &str = "Task: {task}, State: {state};\nAction: ";
/// lerobot's image rule: `resize_with_pad_torch` when the size differs.
pub const RESIZE_RULE: &str = "resize_with_pad: scale by max(w/W, h/H), int sizes, bilinear (align_corners=false, no antialias), clamp [0,1], centred zero pad; then x*2-1; a missing camera is all -1 and masked";

/// A bundle's `policy.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicySpec {
    /// [`FORMAT`].
    pub format: String,
    /// The export's id; `prefix.pte` and `step.pte` (or `pi05.onnx.json`) carry the same.
    pub export_id: String,
    /// The backend that wrote the programs.
    pub backend: String,
    /// `bf16` or `f32`: the activations' dtype.
    pub dtype: String,
    /// How the weights are stored: `bf16` or `f32` (the dtype's; quantized modes name theirs).
    pub weights: String,
    /// Bytes of the weights the prefix and step programs hold as stored (codes and scales for a
    /// quantized mode): what a runtime keeps resident for them — on a GPU, device memory
    /// before any buffer. Absent from bundles written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_bytes: Option<u64>,
    /// Of [`PolicySpec::weight_bytes`], the embedding tables a GPU runtime leaves in the mapped
    /// `.pte` and gathers rows of on the host (petite-cuda's host gathers: pi0.5's token
    /// embedding, 1004.5 MiB in bf16): the weights' device memory is the difference. Absent
    /// from bundles written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_table_bytes: Option<u64>,
    /// The model config the programs were built for.
    pub model: Pi05Config,
    /// lerobot's processing; `None` for an export from a bare checkpoint.
    pub runner: Option<Runner>,
}

/// lerobot's pre- and post-processing for this policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Runner {
    /// The folder's `config.json`.
    pub source: String,
    /// Camera slots in order (`empty`: always masked).
    pub cameras: Vec<CameraSlot>,
    /// Square image side the model takes.
    pub image_resolution: usize,
    /// [`RESIZE_RULE`].
    pub resize: String,
    /// Tokenizer the preprocessor names (a Hugging Face id).
    pub tokenizer: String,
    /// Text tokens (right-padded, truncated).
    pub tokens: usize,
    /// [`PROMPT_TEMPLATE`].
    pub prompt: String,
    /// State bins: `digitize(s, linspace(-1, 1, bins + 1)[:-1]) - 1`.
    pub state_bins: usize,
    /// Whether the state is zero-padded to `max_state_dim` before the prompt (lerobot 0.4.x
    /// checkpoints; 0.5+ write the real state).
    pub state_padded: bool,
    /// Real state width.
    pub state_dim: usize,
    /// `max_state_dim`.
    pub max_state_dim: usize,
    /// Real action width (the model's output is sliced to it).
    pub action_dim: usize,
    /// Actions per chunk.
    pub chunk: usize,
    /// How many of a chunk's actions lerobot executes before planning again.
    pub n_action_steps: usize,
    /// Euler steps.
    pub steps: usize,
    /// State normalization (before the prompt).
    pub state_norm: Norm,
    /// Action unnormalization (after the slice).
    pub action_norm: Norm,
    /// Relative actions: `Some(mask)` adds the raw state to the masked action dims.
    pub relative_action_mask: Option<Vec<bool>>,
    /// Real-time chunking's defaults for calls that leave them out.
    pub rtc: crate::rtc::RtcDefaults,
}

/// One feature's normalization.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Norm {
    /// `IDENTITY`, `MEAN_STD`, `MIN_MAX`, `QUANTILES` or `QUANTILE10`.
    pub mode: String,
    /// The stats the mode reads (`mean`/`std`, `min`/`max`, `q01`/`q99`, `q10`/`q90`), each
    /// the feature's width; empty when the folder has none (then identity).
    pub stats: BTreeMap<String, Vec<f32>>,
    /// Where the stats came from, or why there are none.
    pub from: String,
}

/// The stats a mode reads.
pub fn stat_names(mode: &str) -> &'static [&'static str] {
    match mode {
        "MEAN_STD" => &["mean", "std"],
        "MIN_MAX" => &["min", "max"],
        "QUANTILES" => &["q01", "q99"],
        "QUANTILE10" => &["q10", "q90"],
        _ => &[],
    }
}

/// Finds the step with `registry_name` in `<dir>/<pipeline>.json` and returns its JSON.
fn processor_step(dir: &Path, pipeline: &str, registry: &str) -> Result<Option<Value>> {
    let path = dir.join(format!("{pipeline}.json"));
    if !path.is_file() {
        return Ok(None);
    }
    let file = path.display().to_string();
    let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
        path: file.clone(),
        source,
    })?;
    let v: Value = serde_json::from_str(&text).map_err(|e| Error::ConfigJson {
        origin: file.clone(),
        message: e.to_string(),
    })?;
    let steps = v
        .get("steps")
        .and_then(Value::as_array)
        .ok_or_else(|| Error::ConfigField {
            origin: file.clone(),
            field: "steps".into(),
            expected: "a list of processor steps".into(),
            found: "none".into(),
        })?;
    Ok(steps
        .iter()
        .find(|s| s.get("registry_name").and_then(Value::as_str) == Some(registry))
        .cloned())
}

/// One feature's stats for `mode` from a processor step's state file, or identity when the
/// folder has no processors, no state file, or the file lacks the feature (lerobot passes such
/// a feature through unchanged).
fn norm_from(
    dir: &Path,
    pipeline: &str,
    registry: &str,
    feature: &str,
    mode: &str,
    width: usize,
) -> Result<Norm> {
    let identity = |why: String| Norm {
        mode: "IDENTITY".into(),
        stats: BTreeMap::new(),
        from: why,
    };
    if mode == "IDENTITY" {
        return Ok(identity("IDENTITY in normalization_mapping".into()));
    }
    let Some(step) = processor_step(dir, pipeline, registry)? else {
        return Ok(identity(format!(
            "no `{registry}` step in {pipeline}.json (or no such file): no stats, identity"
        )));
    };
    let Some(state) = step.get("state_file").and_then(Value::as_str) else {
        return Ok(identity(format!(
            "{pipeline}.json's `{registry}` step has no state_file: no stats, identity"
        )));
    };
    let path = dir.join(state);
    let st = MappedSafetensors::open(&path)?;
    let mut stats = BTreeMap::new();
    let file = path.display().to_string();
    for name in stat_names(mode) {
        let key = format!("{feature}.{name}");
        let Ok(t) = st.tensor(&key) else {
            if stats.is_empty() {
                return Ok(identity(format!(
                    "{file} has no `{feature}` stats: identity, as lerobot"
                )));
            }
            return Err(Error::BadTensor {
                file,
                tensor: key,
                expected: format!("the {mode} stats of `{feature}`"),
                found: "no such tensor".into(),
            });
        };
        let values = t.to_f32_vec()?;
        if values.len() != width || values.iter().any(|x| !x.is_finite()) {
            return Err(Error::BadTensor {
                file,
                tensor: key,
                expected: format!("{width} finite values"),
                found: format!("{} values", values.len()),
            });
        }
        stats.insert(name.to_string(), values);
    }
    Ok(Norm {
        mode: mode.to_string(),
        stats,
        from: file,
    })
}

impl Runner {
    /// The runner's part of `policy.json` for the lerobot folder `dir`, config `lr`.
    /// `state_padded`: the checkpoint was trained with lerobot 0.4.x's padded state prompt.
    pub fn from_folder(dir: &Path, lr: &LerobotConfig, state_padded: bool) -> Result<Self> {
        let tok = processor_step(dir, "policy_preprocessor", "tokenizer_processor")?;
        let tokenizer = tok
            .as_ref()
            .and_then(|s| s.get("config"))
            .and_then(|c| c.get("tokenizer_name"))
            .and_then(Value::as_str)
            .unwrap_or(DEFAULT_TOKENIZER)
            .to_string();
        let state_norm = norm_from(
            dir,
            "policy_preprocessor",
            "normalizer_processor",
            STATE_KEY,
            &lr.norm.state,
            lr.state_dim,
        )?;
        let action_norm = norm_from(
            dir,
            "policy_postprocessor",
            "unnormalizer_processor",
            ACTION_KEY,
            &lr.norm.action,
            lr.action_dim,
        )?;
        let relative_action_mask = lr.use_relative_actions.then(|| {
            (0..lr.action_dim)
                .map(|i| match &lr.action_feature_names {
                    None => true,
                    Some(names) => names.get(i).is_none_or(|n| {
                        let n = n.to_lowercase();
                        !lr.relative_exclude_joints
                            .iter()
                            .any(|j| n.contains(&j.to_lowercase()))
                    }),
                })
                .collect()
        });
        Ok(Runner {
            source: dir.join("config.json").display().to_string(),
            cameras: lr.cameras.clone(),
            image_resolution: lr.image_resolution,
            resize: RESIZE_RULE.into(),
            tokenizer,
            tokens: lr.tokens,
            prompt: PROMPT_TEMPLATE.into(),
            state_bins: 256,
            state_padded,
            state_dim: lr.state_dim,
            max_state_dim: lr.max_state_dim,
            action_dim: lr.action_dim,
            chunk: lr.chunk,
            n_action_steps: lr.n_action_steps,
            steps: lr.steps,
            state_norm,
            action_norm,
            relative_action_mask,
            rtc: lr.rtc.clone(),
        })
    }
}

impl PolicySpec {
    /// One line: backend, dtype and, for a lerobot export, the call's interface.
    pub fn summary(&self) -> String {
        let m = &self.model;
        let mut s = format!(
            "{} {} export: {} cameras of {}x{}, {} tokens, chunk {} x {}, {} steps",
            self.backend,
            self.dtype,
            m.cameras,
            m.vision.image_size,
            m.vision.image_size,
            m.tokens,
            m.chunk,
            m.action_dim,
            m.steps
        );
        if let Some(r) = &self.runner {
            let cams: Vec<String> = r
                .cameras
                .iter()
                .map(|c| format!("{}{}", c.key, if c.empty { " (empty)" } else { "" }))
                .collect();
            s.push_str(&format!(
                "; lerobot: [{}], state {}, action {} (n_action_steps {}), tokenizer {}",
                cams.join(", "),
                r.state_dim,
                r.action_dim,
                r.n_action_steps,
                r.tokenizer
            ));
        }
        s
    }

    /// Reads `policy.json` (errors name the file and field).
    pub fn read(path: &Path) -> Result<Self> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: file.clone(),
            source,
        })?;
        // An older bundle's programs lack inputs this version feeds: one line, before the
        // schema's first missing field.
        if let Ok(v) = serde_json::from_str::<Value>(&text)
            && let Some(f) = v.get("format").and_then(Value::as_str)
            && f != FORMAT
            && f.starts_with("petite-policy/")
        {
            return Err(Error::Refused {
                file,
                reason: format!(
                    "format {f}: written by an older petite (this one reads {FORMAT}: real-time chunking changed the step program's inputs); export the policy again"
                ),
            });
        }
        let mut de = serde_json::Deserializer::from_str(&text);
        let spec: PolicySpec =
            serde_path_to_error::deserialize(&mut de).map_err(|e| Error::ConfigField {
                origin: file.clone(),
                field: e.path().to_string(),
                expected: "petite's policy.json schema".into(),
                found: e.inner().to_string(),
            })?;
        if spec.format != FORMAT {
            return Err(Error::ConfigField {
                origin: file,
                field: "format".into(),
                expected: FORMAT.into(),
                found: spec.format,
            });
        }
        Ok(spec)
    }
}
