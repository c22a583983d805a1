//! The inputs file of `petite pi05 run` and the checkpoint checks done before anything runs.
//!
//! Inputs (batch 1, no batch axis): `images` f32 `[cameras,3,H,W]`, `image_masks` u8
//! `[cameras]`, `tokens` i64 `[tokens]`, `token_mask` u8 `[tokens]`, `noise` f32
//! `[chunk, action_dim]`. Every problem is one error naming the tensor, expected and found.

use std::path::Path;

use petite_graph::Program;
use petite_weights::{Checkpoint, Dtype, KeyMap, MappedSafetensors, Remapped, WeightSource};

use crate::config::Pi05Config;
use crate::names::{self, Layout};
use crate::rtc::Guidance;
use crate::{Error, Result};

/// The inputs of one inference call, validated against a config.
#[derive(Debug, Clone, PartialEq)]
pub struct Inputs {
    /// f32 `[cameras, 3, H, W]`, in [-1, 1].
    pub images: Vec<f32>,
    /// `[cameras]`, 1 = present.
    pub image_masks: Vec<u8>,
    /// `[tokens]`, each in `0..vocab`.
    pub tokens: Vec<i64>,
    /// `[tokens]`, 1 = real token.
    pub token_mask: Vec<u8>,
    /// f32 `[chunk, action_dim]`: x at t = 1.
    pub noise: Vec<f32>,
    /// Real-time chunking's inputs of the steps ([`Guidance::none`] for a plain chunk).
    pub guidance: Guidance,
}

fn bad(file: &str, tensor: &str, expected: String, found: String) -> Error {
    Error::BadTensor {
        file: file.to_string(),
        tensor: tensor.to_string(),
        expected,
        found,
    }
}

fn shape_str(s: &[usize]) -> String {
    format!(
        "[{}]",
        s.iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(",")
    )
}

/// Reads one input tensor, checking dtype (one of `dtypes`) and shape.
fn read_raw<'a>(
    src: &'a MappedSafetensors,
    file: &str,
    name: &str,
    dtypes: &[Dtype],
    shape: &[usize],
) -> Result<&'a [u8]> {
    let want_dt = dtypes
        .iter()
        .map(|d| d.safetensors_name())
        .collect::<Vec<_>>()
        .join(" or ");
    let info = src.info(name).map_err(|_| {
        bad(
            file,
            name,
            format!("{want_dt} {}", shape_str(shape)),
            "no such tensor".into(),
        )
    })?;
    if !dtypes.contains(&info.dtype) || info.shape != shape {
        return Err(bad(
            file,
            name,
            format!("{want_dt} {}", shape_str(shape)),
            format!(
                "{} {}",
                info.dtype.safetensors_name(),
                shape_str(&info.shape)
            ),
        ));
    }
    Ok(src.tensor(name)?.bytes)
}

impl Inputs {
    /// Reads and validates an inputs file for `cfg`.
    pub fn from_file(path: impl AsRef<Path>, cfg: &Pi05Config) -> Result<Self> {
        let path = path.as_ref();
        let file = path.display().to_string();
        let src = MappedSafetensors::open(path)?;
        let s = cfg.vision.image_size;
        let f32s = |b: &[u8]| -> Vec<f32> {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        };
        let masks = [Dtype::U8, Dtype::Bool];
        let images = f32s(read_raw(
            &src,
            &file,
            "images",
            &[Dtype::F32],
            &[cfg.cameras, 3, s, s],
        )?);
        let image_masks = read_raw(&src, &file, "image_masks", &masks, &[cfg.cameras])?.to_vec();
        let tokens: Vec<i64> = read_raw(&src, &file, "tokens", &[Dtype::I64], &[cfg.tokens])?
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let token_mask = read_raw(&src, &file, "token_mask", &masks, &[cfg.tokens])?.to_vec();
        let noise = f32s(read_raw(
            &src,
            &file,
            "noise",
            &[Dtype::F32],
            &[cfg.chunk, cfg.action_dim],
        )?);
        let rtc = ["rtc_prev", "rtc_weights", "rtc_steps"];
        let present: Vec<&str> = rtc
            .iter()
            .copied()
            .filter(|n| src.info(n).is_ok())
            .collect();
        let guidance = match present.len() {
            0 => Guidance::none(cfg),
            3 => Guidance {
                prev: f32s(read_raw(
                    &src,
                    &file,
                    "rtc_prev",
                    &[Dtype::F32],
                    &[cfg.chunk, cfg.action_dim],
                )?),
                weights: f32s(read_raw(
                    &src,
                    &file,
                    "rtc_weights",
                    &[Dtype::F32],
                    &[cfg.chunk],
                )?),
                steps: f32s(read_raw(
                    &src,
                    &file,
                    "rtc_steps",
                    &[Dtype::F32],
                    &[cfg.steps, 2],
                )?),
            },
            _ => {
                let missing = rtc
                    .iter()
                    .find(|n| !present.contains(n))
                    .expect("one missing");
                return Err(bad(
                    &file,
                    missing,
                    "present beside rtc_prev, rtc_weights and rtc_steps (all three or none)".into(),
                    "no such tensor".into(),
                ));
            }
        };
        let inputs = Inputs {
            images,
            image_masks,
            tokens,
            token_mask,
            noise,
            guidance,
        };
        inputs.validate_values(&file, cfg)?;
        Ok(inputs)
    }

    /// Checks values a shape check cannot: masks are 0/1, tokens index the vocabulary, floats
    /// are finite.
    pub fn validate_values(&self, file: &str, cfg: &Pi05Config) -> Result<()> {
        for (name, m) in [
            ("image_masks", &self.image_masks),
            ("token_mask", &self.token_mask),
        ] {
            if let Some((i, v)) = m.iter().enumerate().find(|(_, v)| **v > 1) {
                return Err(bad(
                    file,
                    name,
                    "values 0 or 1".into(),
                    format!("{v} at index {i}"),
                ));
            }
        }
        if let Some((i, t)) = self
            .tokens
            .iter()
            .enumerate()
            .find(|(_, t)| **t < 0 || **t as u64 >= cfg.language.vocab as u64)
        {
            return Err(bad(
                file,
                "tokens",
                format!("ids in 0..{}", cfg.language.vocab),
                format!("{t} at index {i}"),
            ));
        }
        for (name, x) in [
            ("images", &self.images),
            ("noise", &self.noise),
            ("rtc_prev", &self.guidance.prev),
            ("rtc_weights", &self.guidance.weights),
            ("rtc_steps", &self.guidance.steps),
        ] {
            if let Some((i, v)) = x.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(bad(
                    file,
                    name,
                    "finite values".into(),
                    format!("{v} at index {i}"),
                ));
            }
        }
        Ok(())
    }
}

/// The `KeyMap` that shows a `layout` file under canonical (lerobot) names: the Hub's missing
/// `model.` prefix is added and `embed_tokens` is served from `paligemma.lm_head`.
pub fn key_map(layout: Layout) -> KeyMap {
    match layout {
        Layout::Lerobot => KeyMap::default(),
        Layout::Hub { prefixed } => KeyMap {
            prefixes: if prefixed {
                vec![]
            } else {
                vec![(String::new(), names::MODEL.to_string())]
            },
            aliases: vec![(
                names::EMBED_TOKENS.to_string(),
                names::PALIGEMMA_LM_HEAD.to_string(),
            )],
        },
    }
}

/// A checkpoint opened under canonical names, whatever its layout.
pub type CanonicalCheckpoint = Remapped<Checkpoint>;

/// Opens a checkpoint (file, index or directory), recognises its layout and exposes it under
/// canonical names.
pub fn open_checkpoint(path: impl AsRef<Path>) -> Result<CanonicalCheckpoint> {
    let path = path.as_ref();
    let ck = Checkpoint::open(path)?;
    let stored = ck.names();
    let layout = names::detect_layout(&stored).ok_or_else(|| Error::BadTensor {
        file: path.display().to_string(),
        tensor: names::EMBED_TOKENS.to_string(),
        expected: "a pi0.5 checkpoint (lerobot or Hub layout)".into(),
        found: "neither it nor `paligemma.lm_head.weight`".into(),
    })?;
    Ok(Remapped::new(ck, &key_map(layout))?)
}

/// Checks every weight `programs` read exists in `src` with the program's shape (for a row range:
/// the rows exist and the row shape agrees) and a float
/// dtype the reference can read (F32, BF16, F16). One error per problem, naming the tensor.
pub fn check_weights<'a, S: WeightSource>(
    src: &S,
    file: &str,
    programs: impl IntoIterator<Item = &'a Program>,
) -> Result<()> {
    for p in programs {
        let weights = p.weights();
        for w in &weights {
            // A quantized weight's scales are computed from its rows (checked as its codes).
            if let Some(base) = petite_graph::quant::scaled_weight(&w.name)
                && weights
                    .iter()
                    .any(|c| c.name == base && c.dtype.is_quant_code())
            {
                continue;
            }
            let info = src.info(&w.name).map_err(|_| {
                bad(
                    file,
                    &w.name,
                    format!("a tensor of shape {}", shape_str(&w.shape)),
                    "no such tensor".into(),
                )
            })?;
            // A row range reads rows of the full tensor: the rows must exist, the rest agree.
            let (ok, want) = match w.rows {
                None => (
                    info.shape == w.shape,
                    format!("shape {}", shape_str(&w.shape)),
                ),
                Some([a, b]) => (
                    info.shape.first().is_some_and(|&n| b <= n) && info.shape[1..] == w.shape[1..],
                    format!(
                        "at least {b} rows (reads rows [{a}, {b})) of shape {}",
                        shape_str(&w.shape[1..])
                    ),
                ),
            };
            if !ok {
                return Err(bad(
                    file,
                    &w.name,
                    want,
                    format!("shape {}", shape_str(&info.shape)),
                ));
            }
            if !matches!(info.dtype, Dtype::F32 | Dtype::Bf16 | Dtype::F16) {
                return Err(bad(
                    file,
                    &w.name,
                    "dtype F32, BF16 or F16".into(),
                    format!("dtype {}", info.dtype.safetensors_name()),
                ));
            }
        }
    }
    Ok(())
}
