//! A lerobot pi0.5 policy folder as a user hands it over: `config.json` (`"type": "pi05"`, as
//! lerobot 0.6.1's `PreTrainedConfig` writes it, or hand-written as on the Hub) beside
//! `model.safetensors`, with or without the processors' files; or a training output that holds
//! one (`pretrained_model/`, `checkpoints/last/pretrained_model`).
//!
//! The call's interface comes from the folder: nothing in the weights encodes the cameras, the
//! token count, the chunk or the steps, so a wrong guess would export and verify without a
//! word. The config is read leniently (lerobot versions add and drop keys; the Hub's configs
//! were written by hand): unknown keys are ignored, missing ones take 0.6.1's defaults. What
//! changes the graph and is not supported (PEFT adapters, observation history, memory
//! features, pi0's `state_proj`) is refused with the reason, before any work.

use std::path::{Path, PathBuf};

use petite_weights::WeightSource;
use serde_json::Value;

use crate::config::{ExpertConfig, LanguageConfig, Pi05Config, VisionConfig};
use crate::{Error, Result, names};

/// What a `config.json` is, from its keys.
#[derive(Debug, Clone, PartialEq)]
pub enum ConfigKind {
    /// lerobot's pi0.5 (`"type": "pi05"`).
    LerobotPi05,
    /// Another lerobot policy type (`pi0`, `pi0_fast`, `smolvla`, ...).
    OtherLerobot(String),
    /// openpi's own `config.json` (converted Hub folders: `action_horizon`, `precision`, no
    /// `type`).
    Openpi,
    /// petite's own config schema (`vision`, `language`, `expert`).
    Petite,
    /// None of these.
    Unknown,
}

/// Classifies a parsed `config.json`.
pub fn classify(v: &Value) -> ConfigKind {
    match v.get("type") {
        Some(Value::String(t)) if t == "pi05" => ConfigKind::LerobotPi05,
        Some(Value::String(t)) => ConfigKind::OtherLerobot(t.clone()),
        _ if v.get("vision").is_some() && v.get("language").is_some() => ConfigKind::Petite,
        _ if v.get("action_horizon").is_some() || v.get("precision").is_some() => {
            ConfigKind::Openpi
        }
        _ => ConfigKind::Unknown,
    }
}

/// The folder holding a policy's `config.json` under `path`: `path` itself, its
/// `pretrained_model/`, or a training run's `checkpoints/last/pretrained_model/`. `None` when
/// `path` is a file or holds none of them.
pub fn resolve_folder(path: &Path) -> Option<PathBuf> {
    if !path.is_dir() {
        return None;
    }
    [
        path.to_path_buf(),
        path.join("pretrained_model"),
        path.join("checkpoints")
            .join("last")
            .join("pretrained_model"),
    ]
    .into_iter()
    .find(|d| d.join("config.json").is_file())
}

/// One camera slot of the exported call.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CameraSlot {
    /// lerobot's observation key (`observation.images.image`).
    pub key: String,
    /// An `empty_camera_i` slot: never filled, always masked.
    pub empty: bool,
}

/// Normalization modes per feature type (`normalization_mapping`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct NormModes {
    /// Images (`IDENTITY` is the only mode supported).
    pub visual: String,
    /// `observation.state`.
    pub state: String,
    /// `action`.
    pub action: String,
}

/// The lerobot pi0.5 config fields inference depends on, resolved (defaults filled in, empty
/// cameras merged).
#[derive(Debug, Clone, PartialEq)]
pub struct LerobotConfig {
    /// Camera slots in order: the VISUAL input features, then the missing `empty_camera_i`.
    pub cameras: Vec<CameraSlot>,
    /// Square model image side (`image_resolution`).
    pub image_resolution: usize,
    /// `tokenizer_max_length`.
    pub tokens: usize,
    /// `chunk_size`.
    pub chunk: usize,
    /// `n_action_steps`.
    pub n_action_steps: usize,
    /// `num_inference_steps`.
    pub steps: usize,
    /// `max_state_dim`.
    pub max_state_dim: usize,
    /// `max_action_dim`.
    pub max_action_dim: usize,
    /// Real state width (`observation.state` shape; default `max_state_dim`).
    pub state_dim: usize,
    /// Real action width (`action` shape; default `max_action_dim`).
    pub action_dim: usize,
    /// `min_period`.
    pub min_period: f64,
    /// `max_period`.
    pub max_period: f64,
    /// `paligemma_variant`.
    pub paligemma_variant: String,
    /// `action_expert_variant`.
    pub action_expert_variant: String,
    /// `dtype` (`float32` or `bfloat16`; informational: petite's `--dtype` decides).
    pub dtype: String,
    /// `normalization_mapping`.
    pub norm: NormModes,
    /// `use_relative_actions`.
    pub use_relative_actions: bool,
    /// `relative_exclude_joints`.
    pub relative_exclude_joints: Vec<String>,
    /// `action_feature_names`.
    pub action_feature_names: Option<Vec<String>>,
    /// `rtc_config` (real-time chunking's defaults), or lerobot's defaults when it is null.
    pub rtc: crate::rtc::RtcDefaults,
    /// Warnings to print.
    pub warnings: Vec<String>,
}

/// lerobot's prefix of camera features.
pub const IMAGE_PREFIX: &str = "observation.images.";
/// lerobot's state feature.
pub const STATE_KEY: &str = "observation.state";
/// lerobot's action feature.
pub const ACTION_KEY: &str = "action";

fn refuse(file: &str, reason: impl Into<String>) -> Error {
    Error::Refused {
        file: file.to_string(),
        reason: reason.into(),
    }
}

fn field(file: &str, name: &str, expected: &str, found: &Value) -> Error {
    let mut f = found.to_string();
    if f.len() > 60 {
        f.truncate(60);
        f.push('…');
    }
    Error::ConfigField {
        origin: file.to_string(),
        field: name.to_string(),
        expected: expected.to_string(),
        found: f,
    }
}

/// A field that may be absent or null (→ `None`).
fn opt<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v.get(name).filter(|x| !x.is_null())
}

fn usize_or(v: &Value, file: &str, name: &str, default: usize) -> Result<usize> {
    match opt(v, name) {
        None => Ok(default),
        Some(x) => x
            .as_u64()
            .filter(|&n| n > 0)
            .map(|n| n as usize)
            .ok_or_else(|| field(file, name, "a positive integer", x)),
    }
}

fn f64_or(v: &Value, file: &str, name: &str, default: f64) -> Result<f64> {
    match opt(v, name) {
        None => Ok(default),
        Some(x) => x
            .as_f64()
            .filter(|f| f.is_finite() && *f > 0.0)
            .ok_or_else(|| field(file, name, "a positive number", x)),
    }
}

fn bool_or(v: &Value, file: &str, name: &str, default: bool) -> Result<bool> {
    match opt(v, name) {
        None => Ok(default),
        Some(x) => x
            .as_bool()
            .ok_or_else(|| field(file, name, "true or false", x)),
    }
}

fn string_or(v: &Value, file: &str, name: &str, default: &str) -> Result<String> {
    match opt(v, name) {
        None => Ok(default.to_string()),
        Some(x) => x
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| field(file, name, "a string", x)),
    }
}

/// The width of a feature (`shape` `[n]`) if the feature is listed.
fn feature_dim(
    features: Option<&Value>,
    file: &str,
    group: &str,
    key: &str,
) -> Result<Option<usize>> {
    let Some(f) = features.and_then(|m| m.get(key)) else {
        return Ok(None);
    };
    let name = format!("{group}.{key}.shape");
    match f.get("shape").and_then(Value::as_array).map(Vec::as_slice) {
        Some([n]) if n.as_u64().is_some_and(|n| n > 0) => Ok(n.as_u64().map(|n| n as usize)),
        _ => Err(field(
            file,
            &name,
            "a one-element list [n]",
            f.get("shape").unwrap_or(&Value::Null),
        )),
    }
}

impl LerobotConfig {
    /// Parses a lerobot pi0.5 `config.json` (already known to have `"type": "pi05"`).
    /// `file` names it in errors.
    pub fn from_json(v: &Value, file: &str) -> Result<Self> {
        if !v.is_object() {
            return Err(field(file, "(top level)", "a JSON object", v));
        }
        // Refusals first: they say why nothing else matters.
        if bool_or(v, file, "use_peft", false)? {
            return Err(refuse(
                file,
                "`use_peft: true`: the folder holds a PEFT adapter, not a policy; merge the adapter first (peft's merge_and_unload, then save_pretrained)",
            ));
        }
        let n_obs = usize_or(v, file, "n_obs_steps", 1)?;
        if n_obs != 1 {
            return Err(refuse(
                file,
                format!("`n_obs_steps: {n_obs}`: pi0.5 takes one observation; only 1 is exported"),
            ));
        }
        for mem in ["use_visual_memory", "use_proprioceptive_memory"] {
            if bool_or(v, file, mem, false)? {
                return Err(refuse(
                    file,
                    format!(
                        "`{mem}: true`: memory features change the graph and the prompt; not supported"
                    ),
                ));
            }
        }
        let warnings = Vec::new();
        let rtc = match opt(v, "rtc_config") {
            None => crate::rtc::RtcDefaults::default(),
            Some(r) => {
                let d = crate::rtc::RtcDefaults::default();
                let at = |n: &str| format!("rtc_config.{n}");
                let schedule = match opt(r, "prefix_attention_schedule") {
                    None => d.schedule,
                    Some(x) => x.as_str().and_then(|s| s.parse().ok()).ok_or_else(|| {
                        field(
                            file,
                            &at("prefix_attention_schedule"),
                            "ZEROS, ONES, LINEAR or EXP",
                            x,
                        )
                    })?,
                };
                let max_guidance_weight = match opt(r, "max_guidance_weight") {
                    None => d.max_guidance_weight,
                    Some(x) => x
                        .as_f64()
                        .filter(|f| f.is_finite() && *f > 0.0)
                        .map(|f| f as f32)
                        .ok_or_else(|| {
                            field(file, &at("max_guidance_weight"), "a positive number", x)
                        })?,
                };
                let execution_horizon = match opt(r, "execution_horizon") {
                    None => d.execution_horizon,
                    Some(x) => x.as_u64().map(|n| n as usize).ok_or_else(|| {
                        field(file, &at("execution_horizon"), "an integer ≥ 0", x)
                    })?,
                };
                crate::rtc::RtcDefaults {
                    schedule,
                    max_guidance_weight,
                    execution_horizon,
                    from: format!("{file}: rtc_config"),
                }
            }
        };
        let res = match opt(v, "image_resolution") {
            None => 224,
            Some(x) => match x.as_array().map(Vec::as_slice) {
                Some([h, w]) if h.as_u64().is_some_and(|h| h > 0) && h == w => {
                    h.as_u64().unwrap_or(0) as usize
                }
                Some([h, w]) if h.is_u64() && w.is_u64() => {
                    return Err(refuse(
                        file,
                        format!(
                            "`image_resolution: [{h}, {w}]` is not square; pi0.5 (SigLIP) takes square images only"
                        ),
                    ));
                }
                _ => return Err(field(file, "image_resolution", "a list [side, side]", x)),
            },
        };
        let max_state_dim = usize_or(v, file, "max_state_dim", 32)?;
        let max_action_dim = usize_or(v, file, "max_action_dim", 32)?;
        let inputs = opt(v, "input_features");
        let outputs = opt(v, "output_features");
        let mut cameras = Vec::new();
        if let Some(m) = inputs {
            let m = m
                .as_object()
                .ok_or_else(|| field(file, "input_features", "an object", m))?;
            for (k, f) in m {
                let ty = f.get("type").and_then(Value::as_str).unwrap_or("");
                if ty == "VISUAL" {
                    if !k.starts_with(IMAGE_PREFIX) {
                        return Err(field(
                            file,
                            &format!("input_features.{k}"),
                            &format!("a VISUAL key starting with `{IMAGE_PREFIX}`"),
                            &Value::String(k.clone()),
                        ));
                    }
                    cameras.push(CameraSlot {
                        key: k.clone(),
                        empty: k.starts_with(&format!("{IMAGE_PREFIX}empty_camera_")),
                    });
                }
            }
        }
        let empty = match opt(v, "empty_cameras") {
            None => 0,
            Some(x) => x
                .as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| field(file, "empty_cameras", "a non-negative integer", x))?,
        };
        for i in 0..empty {
            let key = format!("{IMAGE_PREFIX}empty_camera_{i}");
            if !cameras.iter().any(|c| c.key == key) {
                cameras.push(CameraSlot { key, empty: true });
            }
        }
        if cameras.is_empty() {
            return Err(field(
                file,
                "input_features",
                "at least one VISUAL feature (or empty_cameras > 0)",
                inputs.unwrap_or(&Value::Null),
            ));
        }
        let state_dim =
            feature_dim(inputs, file, "input_features", STATE_KEY)?.unwrap_or(max_state_dim);
        let action_dim =
            feature_dim(outputs, file, "output_features", ACTION_KEY)?.unwrap_or(max_action_dim);
        if state_dim > max_state_dim {
            return Err(field(
                file,
                "input_features.observation.state.shape",
                &format!("at most max_state_dim ({max_state_dim})"),
                &Value::from(state_dim),
            ));
        }
        if action_dim > max_action_dim {
            return Err(field(
                file,
                "output_features.action.shape",
                &format!("at most max_action_dim ({max_action_dim})"),
                &Value::from(action_dim),
            ));
        }
        let chunk = usize_or(v, file, "chunk_size", 50)?;
        let n_action_steps = usize_or(v, file, "n_action_steps", 50)?;
        if n_action_steps > chunk {
            return Err(field(
                file,
                "n_action_steps",
                &format!("at most chunk_size ({chunk})"),
                &Value::from(n_action_steps),
            ));
        }
        let mapping = opt(v, "normalization_mapping");
        let mode = |kind: &str, default: &str| -> Result<String> {
            let Some(m) = mapping else {
                return Ok(default.to_string());
            };
            match m.get(kind) {
                None | Some(Value::Null) => Ok(default.to_string()),
                Some(Value::String(s)) if NORM_MODES.contains(&s.as_str()) => Ok(s.clone()),
                Some(x) => Err(field(
                    file,
                    &format!("normalization_mapping.{kind}"),
                    &format!("one of {}", NORM_MODES.join(", ")),
                    x,
                )),
            }
        };
        let norm = NormModes {
            visual: mode("VISUAL", "IDENTITY")?,
            state: mode("STATE", "QUANTILES")?,
            action: mode("ACTION", "QUANTILES")?,
        };
        if norm.visual != "IDENTITY" {
            return Err(refuse(
                file,
                format!(
                    "`normalization_mapping.VISUAL: {}`: only IDENTITY images are supported (pi0.5 scales images to [-1, 1] itself)",
                    norm.visual
                ),
            ));
        }
        let strings = |name: &str| -> Result<Option<Vec<String>>> {
            match opt(v, name) {
                None => Ok(None),
                Some(x) => x
                    .as_array()
                    .and_then(|a| a.iter().map(|s| s.as_str().map(str::to_string)).collect())
                    .map(Some)
                    .ok_or_else(|| field(file, name, "a list of strings", x)),
            }
        };
        let cfg = LerobotConfig {
            cameras,
            image_resolution: res,
            tokens: usize_or(v, file, "tokenizer_max_length", 200)?,
            chunk,
            n_action_steps,
            steps: usize_or(v, file, "num_inference_steps", 10)?,
            max_state_dim,
            max_action_dim,
            state_dim,
            action_dim,
            min_period: f64_or(v, file, "min_period", 4e-3)?,
            max_period: f64_or(v, file, "max_period", 4.0)?,
            paligemma_variant: string_or(v, file, "paligemma_variant", "gemma_2b")?,
            action_expert_variant: string_or(v, file, "action_expert_variant", "gemma_300m")?,
            dtype: string_or(v, file, "dtype", "float32")?,
            norm,
            use_relative_actions: bool_or(v, file, "use_relative_actions", false)?,
            relative_exclude_joints: strings("relative_exclude_joints")?
                .unwrap_or_else(|| vec!["gripper".to_string()]),
            action_feature_names: strings("action_feature_names")?,
            rtc,
            warnings,
        };
        Ok(cfg)
    }

    /// The model config: sizes from the variant names (`gemma_2b` VLM, `gemma_300m` expert,
    /// SigLIP So400m/14), or from `sizes` (a petite config given beside the folder: how tests
    /// use small models), whose interface fields must then agree with the folder's.
    pub fn to_pi05(&self, file: &str, sizes: Option<(&Pi05Config, &str)>) -> Result<Pi05Config> {
        let mut cfg = match sizes {
            Some((s, _)) => s.clone(),
            None => {
                let mut c = Pi05Config {
                    language: gemma(file, "paligemma_variant", &self.paligemma_variant, true)?,
                    ..Pi05Config::default()
                };
                let e = gemma(
                    file,
                    "action_expert_variant",
                    &self.action_expert_variant,
                    false,
                )?;
                c.expert = ExpertConfig {
                    width: e.width,
                    depth: e.depth,
                    heads: e.heads,
                    kv_heads: e.kv_heads,
                    head_dim: e.head_dim,
                    mlp: e.mlp,
                    eps: e.eps,
                };
                if !self.image_resolution.is_multiple_of(c.vision.patch_size) {
                    return Err(refuse(
                        file,
                        format!(
                            "`image_resolution` is {}: SigLIP So400m/14 takes a multiple of its patch size 14",
                            self.image_resolution
                        ),
                    ));
                }
                c.vision = VisionConfig {
                    image_size: self.image_resolution,
                    ..c.vision
                };
                c
            }
        };
        let pairs: [(&str, &str, f64, f64); 7] = [
            (
                "image_resolution",
                "vision.image_size",
                self.image_resolution as f64,
                cfg.vision.image_size as f64,
            ),
            (
                "cameras (VISUAL input_features + empty_cameras)",
                "cameras",
                self.cameras.len() as f64,
                cfg.cameras as f64,
            ),
            (
                "tokenizer_max_length",
                "tokens",
                self.tokens as f64,
                cfg.tokens as f64,
            ),
            ("chunk_size", "chunk", self.chunk as f64, cfg.chunk as f64),
            (
                "max_action_dim",
                "action_dim",
                self.max_action_dim as f64,
                cfg.action_dim as f64,
            ),
            (
                "num_inference_steps",
                "steps",
                self.steps as f64,
                cfg.steps as f64,
            ),
            (
                "min_period",
                "time_min_period",
                self.min_period,
                cfg.time_min_period,
            ),
        ];
        if let Some((_, sizes_file)) = sizes {
            let mut all = pairs.to_vec();
            all.push((
                "max_period",
                "time_max_period",
                self.max_period,
                cfg.time_max_period,
            ));
            for (lf, pf, a, b) in all {
                if a != b {
                    return Err(refuse(
                        file,
                        format!(
                            "`{lf}` is {a} but {sizes_file} has `{pf}` {b}; the two configs must agree"
                        ),
                    ));
                }
            }
        }
        cfg.vision.image_size = self.image_resolution;
        cfg.cameras = self.cameras.len();
        cfg.tokens = self.tokens;
        cfg.chunk = self.chunk;
        cfg.action_dim = self.max_action_dim;
        cfg.steps = self.steps;
        cfg.time_min_period = self.min_period;
        cfg.time_max_period = self.max_period;
        cfg.validate().map_err(|e| match e {
            Error::InvalidConfig {
                field,
                expected,
                found,
            } => Error::ConfigField {
                origin: file.to_string(),
                field: format!("{field} (as resolved from this folder)"),
                expected,
                found,
            },
            other => other,
        })?;
        Ok(cfg)
    }

    /// The resolved interface, for printing before any work.
    pub fn describe(&self) -> String {
        let cams: Vec<String> = self
            .cameras
            .iter()
            .map(|c| {
                let k = c.key.strip_prefix(IMAGE_PREFIX).unwrap_or(&c.key);
                if c.empty {
                    format!("{k} (empty)")
                } else {
                    k.to_string()
                }
            })
            .collect();
        format!(
            "lerobot pi0.5 policy: cameras [{}], image {}x{}, tokens {}, chunk {} (n_action_steps {}), steps {}, state {} (max {}), action {} (max {}), normalization state {} / action {}{}",
            cams.join(", "),
            self.image_resolution,
            self.image_resolution,
            self.tokens,
            self.chunk,
            self.n_action_steps,
            self.steps,
            self.state_dim,
            self.max_state_dim,
            self.action_dim,
            self.max_action_dim,
            self.norm.state,
            self.norm.action,
            if self.use_relative_actions {
                ", relative actions"
            } else {
                ""
            },
        )
    }
}

/// The normalization modes lerobot 0.6.1 defines.
pub const NORM_MODES: [&str; 5] = ["IDENTITY", "MEAN_STD", "MIN_MAX", "QUANTILES", "QUANTILE10"];

/// `get_gemma_config` of lerobot (openpi's `gemma.get_config`) for the two variants lerobot
/// accepts; anything else is refused naming `name`.
fn gemma(file: &str, name: &str, variant: &str, vlm: bool) -> Result<LanguageConfig> {
    let (width, mlp) = match variant {
        "gemma_2b" => (2048, 16384),
        "gemma_300m" if !vlm => (1024, 4096),
        "gemma_300m" => {
            return Err(refuse(
                file,
                format!(
                    "`{name}: gemma_300m`: the PaliGemma projector is fixed at 2048 outputs, so only gemma_2b works as the VLM"
                ),
            ));
        }
        other => {
            return Err(field(
                file,
                name,
                "gemma_2b or gemma_300m (lerobot's variants)",
                &Value::String(other.to_string()),
            ));
        }
    };
    Ok(LanguageConfig {
        width,
        depth: 18,
        heads: 8,
        kv_heads: 1,
        head_dim: 256,
        mlp,
        vocab: 257152,
        eps: 1e-6,
        rope_theta: 10000.0,
    })
}

/// Checks the folder's config against its weights before any work: each mismatch is one line
/// naming the config field, its value, the tensor and its shape. Refuses a pi0 checkpoint
/// (`state_proj`). `src` is the checkpoint under canonical names; `stored` its names as stored.
pub fn check_weights_against(
    lr: &LerobotConfig,
    cfg: &Pi05Config,
    src: &dyn WeightSource,
    stored: &[String],
    file: &str,
) -> Result<()> {
    if stored.iter().any(|n| n.ends_with("state_proj.weight")) {
        return Err(refuse(
            file,
            "holds `state_proj.weight`: this is a pi0 checkpoint (pi0 feeds the state through state_proj); petite exports pi0.5",
        ));
    }
    let shape = |name: &str| src.info(name).ok().map(|i| i.shape);
    let mismatch = |what: String, tensor: &str, found: Option<Vec<usize>>| {
        refuse(
            file,
            format!(
                "{what}, but tensor `{tensor}` {}",
                match found {
                    Some(s) => format!("has shape {s:?}"),
                    None => "is missing".into(),
                }
            ),
        )
    };
    let t = names::head("action_in_proj.weight");
    let s = shape(&t);
    if s.as_deref() != Some(&[cfg.expert.width, lr.max_action_dim][..]) {
        let what = match &s {
            Some(v) if v.len() == 2 && v[0] == cfg.expert.width => {
                format!("`max_action_dim` is {}", lr.max_action_dim)
            }
            _ => format!(
                "the action expert width is {} (`action_expert_variant` {})",
                cfg.expert.width, lr.action_expert_variant
            ),
        };
        return Err(mismatch(what, &t, s));
    }
    let t = names::vision("embeddings.position_embedding.weight");
    let s = shape(&t);
    let rows = cfg.patches();
    if s.as_ref().and_then(|v| v.first()) != Some(&rows) {
        return Err(mismatch(
            format!(
                "`image_resolution` is {} ({rows} SigLIP positions of {}x{} patches)",
                lr.image_resolution, cfg.vision.patch_size, cfg.vision.patch_size
            ),
            &t,
            s,
        ));
    }
    let t = names::EMBED_TOKENS;
    let s = shape(t);
    if s.as_ref().and_then(|v| v.first()) != Some(&cfg.language.vocab) {
        return Err(mismatch(
            format!("the vocabulary is {} rows", cfg.language.vocab),
            t,
            s,
        ));
    }
    let count = |prefix: &str| {
        let mut n = 0;
        while stored
            .iter()
            .any(|x| x.contains(&format!("{prefix}layers.{n}.")))
        {
            n += 1;
        }
        n
    };
    let strip = |p: &'static str| p.strip_prefix(names::MODEL).unwrap_or(p);
    for (what, prefix, want) in [
        (
            "`paligemma_variant`",
            strip(names::LANGUAGE),
            cfg.language.depth,
        ),
        (
            "`action_expert_variant`",
            strip(names::EXPERT),
            cfg.expert.depth,
        ),
    ] {
        let found = count(prefix);
        if found != want {
            return Err(refuse(
                file,
                format!(
                    "{what} has {want} layers, but the checkpoint has {found} (`{prefix}layers.N.*`)"
                ),
            ));
        }
    }
    let t = names::expert_layer(0, "input_layernorm.dense.weight");
    if shape(&t).is_none() {
        return Err(mismatch(
            "pi0.5's action expert uses adaRMS norms".into(),
            &t,
            None,
        ));
    }
    Ok(())
}

/// What a `--checkpoint` path turned out to be, when it is a folder with a `config.json`.
#[derive(Debug, Clone)]
pub struct Folder {
    /// The folder holding `config.json` and the weights.
    pub dir: PathBuf,
    /// Its `config.json`.
    pub config_path: PathBuf,
    /// The parsed `config.json`.
    pub json: Value,
    /// What kind of config it is.
    pub kind: ConfigKind,
}

/// Reads the folder under `path` ([`resolve_folder`]) and refuses what petite cannot export:
/// adapter-only folders, other lerobot policy types (named), openpi-converted folders (saying
/// which flags to give). `Ok(None)`: `path` is no such folder (a file, or a folder of weights
/// only).
pub fn open_folder(path: &Path) -> Result<Option<Folder>> {
    let Some(dir) = resolve_folder(path) else {
        return Ok(None);
    };
    let config_path = dir.join("config.json");
    let file = config_path.display().to_string();
    let text = std::fs::read_to_string(&config_path).map_err(|source| Error::Io {
        path: file.clone(),
        source,
    })?;
    let json: Value = serde_json::from_str(&text).map_err(|e| Error::ConfigJson {
        origin: file.clone(),
        message: e.to_string(),
    })?;
    let kind = classify(&json);
    match &kind {
        ConfigKind::OtherLerobot(t) => {
            return Err(refuse(
                &file,
                format!("a lerobot `{t}` policy; petite exports `pi05` policies only"),
            ));
        }
        ConfigKind::Openpi => {
            return Err(refuse(
                &file,
                "an openpi-converted folder (openpi's config, no lerobot `type`): it does not say the cameras or the token count; give `--config petite.json` (cameras, tokens, chunk, action_dim, steps) and `--checkpoint` the model.safetensors file",
            ));
        }
        ConfigKind::LerobotPi05 | ConfigKind::Petite | ConfigKind::Unknown => {}
    }
    if dir.join("adapter_config.json").is_file() && !dir.join("model.safetensors").is_file() {
        return Err(refuse(
            &dir.display().to_string(),
            "holds a PEFT adapter (adapter_config.json) and no model.safetensors; merge the adapter first (peft's merge_and_unload, then save_pretrained)",
        ));
    }
    Ok(Some(Folder {
        dir,
        config_path,
        json,
        kind,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn libero() -> Value {
        json!({
            "type": "pi05",
            "input_features": {
                "observation.images.image": {"type": "VISUAL", "shape": [3, 256, 256]},
                "observation.images.image2": {"type": "VISUAL", "shape": [3, 256, 256]},
                "observation.state": {"type": "STATE", "shape": [8]}
            },
            "output_features": {"action": {"type": "ACTION", "shape": [7]}},
            "n_action_steps": 10, "chunk_size": 10, "empty_cameras": 1,
            "tokenizer_max_length": 48, "some_future_key": {"x": 1}
        })
    }

    fn err(v: Value) -> String {
        LerobotConfig::from_json(&v, "c.json")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn hub_style_config_merges_empty_cameras_and_takes_defaults() {
        let c = LerobotConfig::from_json(&libero(), "c.json").unwrap();
        let keys: Vec<_> = c
            .cameras
            .iter()
            .map(|c| (c.key.as_str(), c.empty))
            .collect();
        assert_eq!(
            keys,
            [
                ("observation.images.image", false),
                ("observation.images.image2", false),
                ("observation.images.empty_camera_0", true)
            ]
        );
        assert_eq!(
            (c.tokens, c.chunk, c.steps, c.image_resolution),
            (48, 10, 10, 224)
        );
        assert_eq!((c.state_dim, c.action_dim, c.max_action_dim), (8, 7, 32));
        assert_eq!(c.norm.state, "QUANTILES");
        let cfg = c.to_pi05("c.json", None).unwrap();
        assert_eq!((cfg.cameras, cfg.tokens, cfg.chunk), (3, 48, 10));
        assert_eq!((cfg.language.width, cfg.expert.width), (2048, 1024));
        assert!(
            c.describe().contains("empty_camera_0 (empty)"),
            "{}",
            c.describe()
        );
    }

    #[test]
    fn an_empty_camera_already_listed_is_not_added_twice() {
        let mut v = libero();
        v["input_features"]["observation.images.empty_camera_0"] =
            json!({"type": "VISUAL", "shape": [3, 224, 224]});
        let c = LerobotConfig::from_json(&v, "c.json").unwrap();
        assert_eq!(c.cameras.len(), 3);
        assert!(c.cameras[2].empty);
    }

    #[test]
    fn refusals_name_the_field() {
        let mut v = libero();
        v["use_peft"] = json!(true);
        assert!(err(v).contains("use_peft: true`: the folder holds a PEFT adapter"));
        let mut v = libero();
        v["n_obs_steps"] = json!(2);
        assert!(err(v).contains("n_obs_steps: 2"));
        let mut v = libero();
        v["use_visual_memory"] = json!(true);
        assert!(err(v).contains("use_visual_memory: true"));
        let mut v = libero();
        v["image_resolution"] = json!([224, 256]);
        assert!(err(v).contains("`image_resolution: [224, 256]` is not square"));
        let mut v = libero();
        v["paligemma_variant"] = json!("gemma_2b_lora");
        let c = LerobotConfig::from_json(&v, "c.json").unwrap();
        let e = c.to_pi05("c.json", None).unwrap_err().to_string();
        assert!(
            e.contains("`paligemma_variant`") && e.contains("gemma_2b_lora"),
            "{e}"
        );
        let mut v = libero();
        v["normalization_mapping"] = json!({"STATE": "ZSCORE"});
        assert!(err(v).contains("normalization_mapping.STATE"));
        let mut v = libero();
        v["chunk_size"] = json!("ten");
        assert!(err(v).contains("`chunk_size`: expected a positive integer, found \"ten\""));
    }

    #[test]
    fn rtc_config_gives_the_rtc_defaults() {
        let c = LerobotConfig::from_json(&libero(), "c.json").unwrap();
        assert_eq!(c.rtc, crate::rtc::RtcDefaults::default());
        let mut v = libero();
        v["rtc_config"] = json!({"enabled": true, "prefix_attention_schedule": "EXP",
            "max_guidance_weight": 5.0, "execution_horizon": 8, "debug": false});
        let c = LerobotConfig::from_json(&v, "c.json").unwrap();
        assert!(c.warnings.is_empty());
        assert_eq!(
            (
                c.rtc.schedule,
                c.rtc.max_guidance_weight,
                c.rtc.execution_horizon
            ),
            (crate::rtc::Schedule::Exp, 5.0, 8)
        );
        v["rtc_config"]["prefix_attention_schedule"] = json!("COSINE");
        let e = LerobotConfig::from_json(&v, "c.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("rtc_config.prefix_attention_schedule"), "{e}");
    }

    #[test]
    fn sizes_config_must_agree_on_the_interface() {
        let c = LerobotConfig::from_json(&libero(), "c.json").unwrap();
        let mut small = Pi05Config::small();
        small.vision.image_size = 224;
        small.cameras = 3;
        small.tokens = 48;
        small.chunk = 10;
        small.action_dim = 32;
        let cfg = c.to_pi05("c.json", Some((&small, "p.json"))).unwrap();
        assert_eq!(cfg.language, small.language);
        small.tokens = 200;
        let e = c
            .to_pi05("c.json", Some((&small, "p.json")))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "c.json: `tokenizer_max_length` is 48 but p.json has `tokens` 200; the two configs must agree"
        );
    }

    #[test]
    fn config_kinds() {
        assert_eq!(
            classify(&json!({"type": "pi0"})),
            ConfigKind::OtherLerobot("pi0".into())
        );
        assert_eq!(classify(&json!({"action_horizon": 10})), ConfigKind::Openpi);
        assert_eq!(
            classify(&serde_json::to_value(Pi05Config::small()).unwrap()),
            ConfigKind::Petite
        );
        assert_eq!(classify(&libero()), ConfigKind::LerobotPi05);
    }
}
