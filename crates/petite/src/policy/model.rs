//! [`Policy::act_model`]: the model alone, on what lerobot's preprocessor emits.
//!
//! lerobot's PI05 `predict_action_chunk` reads, from the preprocessed batch, the camera images
//! (`_preprocess_images`: float32 `[B, 3, H, W]` or `[B, H, W, 3]` as the processors leave them,
//! resized with padding and scaled to [-1, 1] inside the model; cameras the config lists but the
//! batch lacks masked), `observation.language.tokens` and `observation.language.attention_mask`.
//! The state is not read: the preprocessor's tokenizer step has already written it into the
//! prompt. [`Policy::act_model`] takes exactly those, does the image steps lerobot does inside
//! the model, and returns `predict_action_chunk`'s output: the chunk in model space
//! (normalized), sliced to the real action width. It is the entry of the lerobot plugin
//! (`python/lerobot_policy_petite`), where lerobot's own processors run around it.

use std::collections::BTreeMap;

use petite_pi05::inputs::Inputs;

use super::{Array, Options, Policy, expected, observation};
use crate::{Error, Result};

/// lerobot's key of the prompt's token ids.
pub const TOKENS_KEY: &str = "observation.language.tokens";
/// lerobot's key of the prompt's attention mask.
pub const MASK_KEY: &str = "observation.language.attention_mask";

/// Integer values (token ids, a mask as 0/1) with their shape.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Ints {
    /// The shape.
    pub shape: Vec<usize>,
    /// `shape.iter().product()` values.
    pub data: Vec<i64>,
}

impl Ints {
    /// An integer array.
    pub fn new(shape: &[usize], data: Vec<i64>) -> Self {
        Ints {
            shape: shape.to_vec(),
            data,
        }
    }
}

/// What lerobot's PI05 preprocessor emits and its `predict_action_chunk` reads: each camera's
/// image by key (f32 `[3, H, W]` or `[H, W, 3]` in [0, 1], any size, a leading batch dimension
/// of 1 allowed; cameras the policy lists but this lacks are masked), the prompt's token ids
/// (`observation.language.tokens`, `[tokens]` or `[1, tokens]`) and attention mask
/// (`observation.language.attention_mask`, same shape, 0/1).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ModelInputs {
    /// Camera images by key.
    pub images: BTreeMap<String, Array>,
    /// `observation.language.tokens`.
    pub tokens: Ints,
    /// `observation.language.attention_mask` (1 for a real token).
    pub attention_mask: Ints,
}

/// The model-space chunk: lerobot's `predict_action_chunk` output for one observation.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelChunk {
    /// f32 `[chunk, action_dim]`: normalized, unpadded.
    pub model: Vec<f32>,
    /// Actions a chunk.
    pub chunk: usize,
    /// The real action width.
    pub action_dim: usize,
    /// How many actions lerobot executes before planning again.
    pub n_action_steps: usize,
}

impl Policy {
    /// One model-space chunk for what lerobot's preprocessor emitted (see [`ModelInputs`]):
    /// every key checked (one error naming it; the policy stays usable), images resized, padded
    /// and scaled as lerobot's PI05 does inside the model, missing cameras masked, the programs
    /// run on the owner thread (the same queue as [`Policy::act`]), the output sliced to the real
    /// action width. No normalization either way: lerobot's processors do that around it.
    pub fn act_model(&self, inputs: &ModelInputs, opts: &Options) -> Result<ModelChunk> {
        self.act_model_with(inputs, opts, false)
    }

    /// As [`Policy::act_model`], but refused at once with [`Error::Busy`] when the queue is
    /// full.
    pub fn try_act_model(&self, inputs: &ModelInputs, opts: &Options) -> Result<ModelChunk> {
        self.act_model_with(inputs, opts, true)
    }

    fn act_model_with(
        &self,
        inputs: &ModelInputs,
        opts: &Options,
        no_wait: bool,
    ) -> Result<ModelChunk> {
        let prepared = self.prepare_model(inputs)?;
        let noise = self.noise(opts)?;
        let guidance = self.guidance(opts.rtc.as_ref())?;
        let (raw, _) = self.run(
            Inputs {
                noise,
                guidance,
                ..prepared
            },
            no_wait,
        )?;
        let (cfg, r) = (&self.cfg, &self.runner);
        if raw.len() != cfg.chunk * cfg.action_dim {
            return Err(Error::Internal(format!(
                "the programs gave {} action values, expected {}",
                raw.len(),
                cfg.chunk * cfg.action_dim
            )));
        }
        if let Some(i) = raw.iter().position(|v| !v.is_finite()) {
            return Err(Error::input(
                &self.dir,
                format!(
                    "the programs' actions are not finite: {} at index {i}",
                    raw[i]
                ),
            ));
        }
        let model = raw
            .chunks_exact(cfg.action_dim)
            .flat_map(|row| row[..r.action_dim].iter().copied())
            .collect();
        Ok(ModelChunk {
            model,
            chunk: cfg.chunk,
            action_dim: r.action_dim,
            n_action_steps: r.n_action_steps,
        })
    }

    /// The checks and image steps of [`Policy::act_model`]; the noise left empty.
    fn prepare_model(&self, inputs: &ModelInputs) -> Result<Inputs> {
        let (cfg, r) = (&self.cfg, &self.runner);
        for k in inputs.images.keys() {
            if !r.cameras.iter().any(|c| &c.key == k) {
                let cams: Vec<&str> = r.cameras.iter().map(|c| c.key.as_str()).collect();
                return Err(expected(
                    k,
                    format!("one of {}", cams.join(", ")),
                    "an unknown camera key",
                ));
            }
        }
        let res = cfg.vision.image_size;
        let plane = 3 * res * res;
        let mut present = Vec::new();
        let mut missing = 0;
        for c in &r.cameras {
            let Some(a) = inputs.images.get(&c.key) else {
                missing += 1;
                continue;
            };
            present.push(model_image(&c.key, a, res)?);
        }
        let (images, image_masks) = super::stacked(r, &present, missing, plane, "a batch")?;

        let tokens = row(TOKENS_KEY, &inputs.tokens, cfg.tokens)?;
        if let Some(i) = tokens
            .iter()
            .position(|&t| t < 0 || t as usize >= cfg.language.vocab)
        {
            return Err(expected(
                TOKENS_KEY,
                format!("ids in 0..{}", cfg.language.vocab),
                format!("{} at {i}", tokens[i]),
            ));
        }
        let mask = row(MASK_KEY, &inputs.attention_mask, cfg.tokens)?;
        if let Some(i) = mask.iter().position(|&m| m != 0 && m != 1) {
            return Err(expected(
                MASK_KEY,
                "0/1 (bool) values",
                format!("{} at {i}", mask[i]),
            ));
        }
        Ok(Inputs {
            images,
            image_masks,
            tokens,
            token_mask: mask.into_iter().map(|m| m as u8).collect(),
            noise: Vec::new(),
            guidance: petite_pi05::rtc::Guidance::none(&self.cfg),
        })
    }
}

/// `[n]` or `[1, n]` integers: the values; a batch of more than one refused.
fn row(key: &str, a: &Ints, n: usize) -> Result<Vec<i64>> {
    let want = format!("[{n}] (or [1, {n}])");
    if super::elements(&a.shape) != Some(a.data.len()) {
        return Err(expected(
            key,
            format!("{} {:?}", super::values_for(&a.shape), a.shape),
            a.data.len(),
        ));
    }
    match a.shape.as_slice() {
        [m] if *m == n => Ok(a.data.clone()),
        [1, m] if *m == n => Ok(a.data.clone()),
        [b, _] if *b > 1 => Err(observation(
            key,
            format!(
                "a batch of {b} observations ({:?}): petite runs one observation a call (batch size 1); send them one at a time",
                a.shape
            ),
        )),
        s => Err(expected(key, want, format!("{s:?}"))),
    }
}

/// One camera's image as lerobot's PI05 takes it inside the model: f32 `[3, H, W]` or
/// `[H, W, 3]` (channels first when the first dimension is 3, as lerobot decides), resized with
/// padding to `res`, scaled to [-1, 1].
fn model_image(key: &str, a: &Array, res: usize) -> Result<Vec<f32>> {
    let want = "float32 [3, H, W] or [H, W, 3] in [0, 1] (as lerobot's preprocessor leaves it)";
    let s = a.unbatched(key, 3)?;
    let data = match a {
        Array::F32 { data, .. } => data,
        Array::U8 { .. } => {
            return Err(expected(
                key,
                format!(
                    "{want}: lerobot's model casts uint8 to float without scaling; give float32 in [0, 1]"
                ),
                a.describe(),
            ));
        }
    };
    if super::elements(&s) != Some(data.len()) {
        return Err(expected(key, super::values_for(&s), data.len()));
    }
    let (h, w, chw) = match s.as_slice() {
        [3, h, w] if *h > 0 && *w > 0 => (*h, *w, data.clone()),
        [h, w, 3] if *h > 0 && *w > 0 => {
            let (h, w) = (*h, *w);
            let mut chw = vec![0f32; data.len()];
            for y in 0..h {
                for x in 0..w {
                    for ch in 0..3 {
                        chw[ch * h * w + y * w + x] = data[(y * w + x) * 3 + ch];
                    }
                }
            }
            (h, w, chw)
        }
        _ => return Err(expected(key, want, a.describe())),
    };
    if let Some(i) = chw.iter().position(|v| !v.is_finite()) {
        return Err(expected(key, "finite values", format!("{} at {i}", chw[i])));
    }
    Ok(super::lerobot::prepare_image(&chw, h, w, res))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_rows_take_one_observation() {
        assert_eq!(
            row("t", &Ints::new(&[1, 3], vec![2, 5, 0]), 3).unwrap(),
            [2, 5, 0]
        );
        let e = row("t", &Ints::new(&[2, 3], vec![0; 6]), 3)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`t`") && e.contains("a batch of 2"), "{e}");
        let e = row("t", &Ints::new(&[4], vec![0; 4]), 3)
            .unwrap_err()
            .to_string();
        assert!(e.contains("[3]") && e.contains("[4]"), "{e}");
    }

    #[test]
    fn channels_last_images_match_channels_first() {
        let (h, w) = (5, 7);
        let chw: Vec<f32> = (0..3 * h * w).map(|i| (i % 11) as f32 / 11.0).collect();
        let mut hwc = vec![0f32; chw.len()];
        for c in 0..3 {
            for y in 0..h {
                for x in 0..w {
                    hwc[(y * w + x) * 3 + c] = chw[c * h * w + y * w + x];
                }
            }
        }
        let a = model_image("k", &Array::f32(&[3, h, w], chw), 8).unwrap();
        let b = model_image("k", &Array::f32(&[1, h, w, 3], hwc), 8).unwrap();
        assert_eq!(a, b);
        assert!(a.iter().any(|&v| v != -1.0));
        let e = model_image("k", &Array::u8(&[h, w, 3], vec![0; h * w * 3]), 8)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`k`") && e.contains("float32"), "{e}");
    }
}
