//! `Pi05Config`: the sizes of a pi0.5 model. The default is the real pi0.5 (lerobot 0.6.1,
//! `gemma_2b` + `gemma_300m`, SigLIP So400m/14); small configs drive the tests.
//!
//! JSON is read by serde derive (unknown and duplicate fields refused) through
//! `serde_path_to_error`, so every error names the full field path (`expert.heads`), the expected
//! form and what was found, on one line.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{Error, Result};

/// SigLIP vision tower sizes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VisionConfig {
    /// Square input image side in pixels.
    pub image_size: usize,
    /// Square patch side (the patch conv's kernel and stride).
    pub patch_size: usize,
    /// Hidden width.
    pub hidden: usize,
    /// Encoder layers.
    pub layers: usize,
    /// Attention heads (head_dim = hidden / heads).
    pub heads: usize,
    /// MLP width (`fc1` out).
    pub mlp: usize,
    /// LayerNorm epsilon.
    pub eps: f64,
}

/// Gemma language model (the prefix expert) sizes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LanguageConfig {
    /// Hidden width.
    pub width: usize,
    /// Decoder layers.
    pub depth: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// Gated MLP width.
    pub mlp: usize,
    /// Vocabulary size (rows of `embed_tokens`).
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
}

/// Action expert (Gemma 300M variant with adaRMS) sizes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertConfig {
    /// Hidden width (also the time-embedding and adaRMS condition width).
    pub width: usize,
    /// Decoder layers; must equal the language depth (layer i attends to language layer i's K/V).
    pub depth: usize,
    /// Query heads; must equal the language's.
    pub heads: usize,
    /// Key/value heads; must equal the language's.
    pub kv_heads: usize,
    /// Per-head width; must equal the language's.
    pub head_dim: usize,
    /// Gated MLP width.
    pub mlp: usize,
    /// RMSNorm epsilon.
    pub eps: f64,
}

/// A whole pi0.5 model plus the fixed shapes of one inference call (batch 1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pi05Config {
    /// SigLIP sizes.
    pub vision: VisionConfig,
    /// Gemma language model sizes.
    pub language: LanguageConfig,
    /// Action expert sizes.
    pub expert: ExpertConfig,
    /// Number of camera images per call (masked cameras included).
    pub cameras: usize,
    /// Text tokens per call (right-padded).
    pub tokens: usize,
    /// Action chunk length (action tokens in the suffix).
    pub chunk: usize,
    /// Action width inside the model (lerobot `max_action_dim`).
    pub action_dim: usize,
    /// Euler steps of the flow-matching sampler.
    pub steps: usize,
    /// Smallest period of the time sinusoid.
    pub time_min_period: f64,
    /// Largest period of the time sinusoid.
    pub time_max_period: f64,
}

impl Default for Pi05Config {
    /// The real pi0.5.
    fn default() -> Self {
        Pi05Config {
            vision: VisionConfig {
                image_size: 224,
                patch_size: 14,
                hidden: 1152,
                layers: 27,
                heads: 16,
                mlp: 4304,
                eps: 1e-6,
            },
            language: LanguageConfig {
                width: 2048,
                depth: 18,
                heads: 8,
                kv_heads: 1,
                head_dim: 256,
                mlp: 16384,
                vocab: 257152,
                eps: 1e-6,
                rope_theta: 10000.0,
            },
            expert: ExpertConfig {
                width: 1024,
                depth: 18,
                heads: 8,
                kv_heads: 1,
                head_dim: 256,
                mlp: 4096,
                eps: 1e-6,
            },
            cameras: 3,
            tokens: 200,
            chunk: 50,
            action_dim: 32,
            steps: 10,
            time_min_period: 0.004,
            time_max_period: 4.0,
        }
    }
}

fn invalid(field: &str, expected: impl Into<String>, found: impl ToString) -> Error {
    Error::InvalidConfig {
        field: field.to_string(),
        expected: expected.into(),
        found: found.to_string(),
    }
}

impl Pi05Config {
    /// A small but structurally complete config for tests: several cameras, padded tokens,
    /// depth > 2 and heads > kv_heads, so the same mistakes that break the real model break it.
    pub fn small() -> Self {
        Pi05Config {
            vision: VisionConfig {
                image_size: 28,
                patch_size: 14,
                hidden: 32,
                layers: 2,
                heads: 4,
                mlp: 48,
                eps: 1e-6,
            },
            language: LanguageConfig {
                width: 64,
                depth: 3,
                heads: 4,
                kv_heads: 2,
                head_dim: 16,
                mlp: 96,
                vocab: 300,
                eps: 1e-6,
                rope_theta: 10000.0,
            },
            expert: ExpertConfig {
                width: 32,
                depth: 3,
                heads: 4,
                kv_heads: 2,
                head_dim: 16,
                mlp: 48,
                eps: 1e-6,
            },
            cameras: 2,
            tokens: 8,
            chunk: 5,
            action_dim: 6,
            steps: 10,
            time_min_period: 0.004,
            time_max_period: 4.0,
        }
    }

    /// Reads and validates a config file. Errors name the file and the field.
    pub fn from_json_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Parses and validates config JSON; `origin` names the text in errors (usually its file).
    ///
    /// serde derive reads it (unknown and duplicate fields refused); `serde_path_to_error`
    /// supplies the failing field's path, and `field_error` turns serde's message into one
    /// line naming the field, the expected form and what was found.
    pub fn from_json_str(text: &str, origin: &str) -> Result<Self> {
        let not_json = |e: serde_json::Error| Error::ConfigJson {
            origin: origin.to_string(),
            message: e.to_string(),
        };
        let mut de = serde_json::Deserializer::from_str(text);
        let cfg: Pi05Config = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            match inner.classify() {
                serde_json::error::Category::Data => field_error(origin, &path, &inner),
                _ => not_json(inner),
            }
        })?;
        // Trailing characters after the object are not JSON either.
        de.end().map_err(not_json)?;
        cfg.validate().map_err(|e| match e {
            Error::InvalidConfig {
                field,
                expected,
                found,
            } => Error::ConfigField {
                origin: origin.to_string(),
                field,
                expected,
                found,
            },
            other => other,
        })?;
        Ok(cfg)
    }

    /// The config as pretty JSON in the documented schema (field order fixed).
    pub fn to_json_pretty(&self) -> String {
        serde_json::to_string_pretty(self).expect("config serialises: plain numbers only")
    }

    /// Checks the sizes are consistent; the first problem found is returned, naming the field,
    /// what it should be and what it is.
    pub fn validate(&self) -> Result<()> {
        let v = &self.vision;
        let l = &self.language;
        let e = &self.expert;
        let sizes: [(&str, usize); 24] = [
            ("vision.image_size", v.image_size),
            ("vision.patch_size", v.patch_size),
            ("vision.hidden", v.hidden),
            ("vision.layers", v.layers),
            ("vision.heads", v.heads),
            ("vision.mlp", v.mlp),
            ("language.width", l.width),
            ("language.depth", l.depth),
            ("language.heads", l.heads),
            ("language.kv_heads", l.kv_heads),
            ("language.head_dim", l.head_dim),
            ("language.mlp", l.mlp),
            ("language.vocab", l.vocab),
            ("expert.width", e.width),
            ("expert.depth", e.depth),
            ("expert.heads", e.heads),
            ("expert.kv_heads", e.kv_heads),
            ("expert.head_dim", e.head_dim),
            ("expert.mlp", e.mlp),
            ("cameras", self.cameras),
            ("tokens", self.tokens),
            ("chunk", self.chunk),
            ("action_dim", self.action_dim),
            ("steps", self.steps),
        ];
        for (field, n) in sizes {
            if n == 0 {
                return Err(invalid(field, "a positive integer", 0));
            }
        }
        let floats = [
            ("vision.eps", v.eps),
            ("language.eps", l.eps),
            ("language.rope_theta", l.rope_theta),
            ("expert.eps", e.eps),
            ("time_min_period", self.time_min_period),
            ("time_max_period", self.time_max_period),
        ];
        for (field, x) in floats {
            if !(x.is_finite() && x > 0.0) {
                return Err(invalid(field, "a positive finite number", x));
            }
        }
        if !v.image_size.is_multiple_of(v.patch_size) {
            return Err(invalid(
                "vision.patch_size",
                format!("a divisor of vision.image_size ({})", v.image_size),
                v.patch_size,
            ));
        }
        if !v.hidden.is_multiple_of(v.heads) {
            return Err(invalid(
                "vision.heads",
                format!("a divisor of vision.hidden ({})", v.hidden),
                v.heads,
            ));
        }
        if !l.heads.is_multiple_of(l.kv_heads) {
            return Err(invalid(
                "language.kv_heads",
                format!("a divisor of language.heads ({})", l.heads),
                l.kv_heads,
            ));
        }
        if !l.head_dim.is_multiple_of(2) {
            return Err(invalid(
                "language.head_dim",
                "an even number (RoPE rotates halves)",
                l.head_dim,
            ));
        }
        let same = [
            ("expert.depth", "language.depth", e.depth, l.depth),
            ("expert.heads", "language.heads", e.heads, l.heads),
            (
                "expert.kv_heads",
                "language.kv_heads",
                e.kv_heads,
                l.kv_heads,
            ),
            (
                "expert.head_dim",
                "language.head_dim",
                e.head_dim,
                l.head_dim,
            ),
        ];
        for (field, other, found, want) in same {
            if found != want {
                return Err(invalid(
                    field,
                    format!("{want} (= {other}: the expert attends to the language model's K/V)"),
                    found,
                ));
            }
        }
        if !e.width.is_multiple_of(2) {
            return Err(invalid(
                "expert.width",
                "an even number (the time sinusoid is half sin, half cos)",
                e.width,
            ));
        }
        if self.time_min_period >= self.time_max_period {
            return Err(invalid(
                "time_min_period",
                format!("less than time_max_period ({})", self.time_max_period),
                self.time_min_period,
            ));
        }
        Ok(())
    }

    /// Patches per image side.
    pub fn patches_per_side(&self) -> usize {
        self.vision.image_size / self.vision.patch_size
    }

    /// Image tokens per camera (SigLIP patches).
    pub fn patches(&self) -> usize {
        self.patches_per_side() * self.patches_per_side()
    }

    /// Prefix length P = cameras × patches + tokens.
    pub fn prefix_len(&self) -> usize {
        self.cameras * self.patches() + self.tokens
    }

    /// SigLIP per-head width.
    pub fn vision_head_dim(&self) -> usize {
        self.vision.hidden / self.vision.heads
    }

    /// The fixed timesteps of the sampler, as float32 values lerobot feeds the model:
    /// `t = 1 + step * (-1/steps)` computed in double, then rounded to f32.
    pub fn timesteps(&self) -> Vec<f32> {
        let dt = -1.0f64 / self.steps as f64;
        (0..self.steps)
            .map(|i| (1.0 + i as f64 * dt) as f32)
            .collect()
    }

    /// The Euler step size `dt = -1/steps` as f32 (lerobot multiplies an f32 tensor by it).
    pub fn dt(&self) -> f32 {
        (-1.0f64 / self.steps as f64) as f32
    }
}

/// At most 40 characters of `s` (a long string value stays one short line).
fn clip(s: &str) -> String {
    match s.char_indices().nth(40) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_string(),
    }
}

/// The form a field of the schema takes, from the default config (which has every field):
/// `expert` is an object, `expert.heads` an integer, `expert.eps` a number.
fn expected_form(field: &str) -> String {
    let schema = serde_json::to_value(Pi05Config::default()).expect("config serialises");
    let mut at = &schema;
    for key in field.split('.') {
        match at.get(key) {
            Some(v) => at = v,
            None => return "a value".into(),
        }
    }
    match at {
        Value::Object(_) => "an object",
        Value::Number(n) if n.is_u64() => "a non-negative integer",
        _ => "a number",
    }
    .into()
}

/// serde's name for what it wanted, in the schema's words.
fn expected_words(serde_expected: &str) -> String {
    match serde_expected {
        "usize" => "a non-negative integer".into(),
        "f64" => "a number".into(),
        s if s.starts_with("struct ") => "an object".into(),
        s => s.to_string(),
    }
}

/// The name between the first pair of backticks of a serde message (`missing field `x``).
fn backticked(message: &str) -> Option<&str> {
    let rest = &message[message.find('`')? + 1..];
    Some(&rest[..rest.find('`')?])
}

/// One config error from a serde data error at `path` (`.` is the top level).
///
/// serde's messages have fixed forms (`missing field `x``, `unknown field `x`, expected one of
/// ...`, `duplicate field `x``, `invalid type: F, expected E`, `invalid value: F, expected E`); a
/// message of another form is kept whole as what was found.
fn field_error(origin: &str, path: &str, e: &serde_json::Error) -> Error {
    let full = e.to_string();
    // serde_json appends the position; the field path replaces it.
    let message = full
        .strip_suffix(&format!(" at line {} column {}", e.line(), e.column()))
        .unwrap_or(&full);
    let join = |name: &str| {
        if path == "." {
            name.to_string()
        } else {
            format!("{path}.{name}")
        }
    };
    let at = || {
        if path == "." {
            "(top level)".to_string()
        } else {
            path.to_string()
        }
    };
    let (field, expected, found) = if let Some(rest) = message.strip_prefix("missing field ") {
        let field = join(backticked(rest).unwrap_or(rest));
        let expected = expected_form(&field);
        (
            field,
            expected,
            "nothing (the field is missing)".to_string(),
        )
    } else if let Some(rest) = message.strip_prefix("duplicate field ") {
        let name = backticked(rest).unwrap_or(rest);
        (
            join(name),
            "the field once".into(),
            format!("`{name}` twice"),
        )
    } else if let Some(rest) = message.strip_prefix("unknown field ") {
        // The path already ends with the unknown key.
        let known = rest
            .split_once(", expected ")
            .map(|(_, k)| k.trim_start_matches("one of ").replace('`', ""))
            .unwrap_or_default();
        (
            at(),
            format!("no such field (known: {known})"),
            "an unknown field".into(),
        )
    } else if let Some(rest) = message
        .strip_prefix("invalid type: ")
        .or_else(|| message.strip_prefix("invalid value: "))
    {
        // `found` may hold the separator (a string value), serde's expected form never does.
        match rest.rsplit_once(", expected ") {
            Some((found, expected)) => (at(), expected_words(expected), clip(found)),
            None => (at(), "a valid value".into(), clip(rest)),
        }
    } else {
        (at(), "a valid value".into(), clip(message))
    };
    Error::ConfigField {
        origin: origin.to_string(),
        field,
        expected,
        found,
    }
}
