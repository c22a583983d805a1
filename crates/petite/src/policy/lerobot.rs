//! lerobot 0.6.1's processors for pi0.5, as petite runs them around the exported programs:
//! normalization of the state and unnormalization of the actions, the state's bins written into
//! the prompt, the prompt tokenized, images resized with padding and scaled to [-1, 1]. Each
//! follows lerobot's operation order (in f32 where lerobot computes in f32), so that
//! [`crate::policy::Policy`] matches lerobot's whole pipeline.

use std::path::{Path, PathBuf};

use petite_pi05::policy::Norm;

use crate::{Error, Result};

pub use crate::settings::TOKENIZER_ENV;
/// lerobot's normalizer epsilon (`NormalizerProcessorStep.eps`).
const EPS: f32 = 1e-8;

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

/// lerobot's `TokenizerProcessorStep` with its tokenizer loaded once (special tokens added as
/// the tokenizer defines them, truncated to the model's length, right-padded with the pad id).
pub struct Tokenizer {
    path: PathBuf,
    tok: tokenizers::Tokenizer,
    pad: i64,
    max_len: usize,
}

impl Tokenizer {
    /// Loads `path` (a `tokenizer.json`) for prompts of `max_len` tokens.
    pub fn load(path: &Path, max_len: usize) -> Result<Self> {
        let bad = |m: String| Error::input(path, m);
        let mut tok = tokenizers::Tokenizer::from_file(path).map_err(|e| bad(e.to_string()))?;
        tok.with_truncation(Some(tokenizers::TruncationParams {
            max_length: max_len,
            ..Default::default()
        }))
        .map_err(|e| bad(e.to_string()))?;
        tok.with_padding(None);
        let pad = tok
            .get_padding()
            .map(|p| p.pad_id)
            .or_else(|| tok.token_to_id("<pad>"))
            .unwrap_or(0) as i64;
        Ok(Tokenizer {
            path: path.to_path_buf(),
            tok,
            pad,
            max_len,
        })
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The ids of `text` and the attention mask, `max_len` each.
    pub fn encode(&self, text: &str) -> Result<(Vec<i64>, Vec<u8>)> {
        let enc = self
            .tok
            .encode(text, true)
            .map_err(|e| Error::input(&self.path, e.to_string()))?;
        let mut ids: Vec<i64> = enc.get_ids().iter().map(|&i| i as i64).collect();
        ids.truncate(self.max_len);
        let n = ids.len();
        ids.resize(self.max_len, self.pad);
        let mask = (0..self.max_len).map(|i| u8::from(i < n)).collect();
        Ok((ids, mask))
    }
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
