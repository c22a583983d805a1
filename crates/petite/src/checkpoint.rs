//! What `--checkpoint` names, resolved once for `export` and `verify`: a lerobot pi0.5 policy
//! folder (or a training output holding one), a folder with petite's own `config.json`, or
//! weights alone.

use std::path::{Path, PathBuf};

use petite_pi05::Pi05Config;
use petite_pi05::inputs::CanonicalCheckpoint;
use petite_pi05::lerobot::{ConfigKind, LerobotConfig, check_weights_against, open_folder};
use petite_pi05::policy::Runner;
use petite_weights::WeightSource;

use crate::Result;

/// A `--checkpoint` (and `--config`) resolved.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The model config of the call.
    pub cfg: Pi05Config,
    /// Where the weights are (a file, an index or a folder).
    pub weights: PathBuf,
    /// The lerobot folder's config and runner metadata, when the checkpoint is one.
    pub lerobot: Option<(LerobotConfig, Runner)>,
}

impl Resolved {
    /// The interface in one line, for printing before any work (`None`: not a lerobot folder).
    pub fn describe(&self) -> Option<String> {
        self.lerobot.as_ref().map(|(lr, _)| lr.describe())
    }

    /// Warnings to print (the folder's own, and normalization stats missing).
    pub fn warnings(&self) -> Vec<String> {
        let Some((lr, runner)) = &self.lerobot else {
            return vec![];
        };
        let mut w = lr.warnings.clone();
        for (what, n) in [
            ("state", &runner.state_norm),
            ("action", &runner.action_norm),
        ] {
            if n.stats.is_empty() && n.from != "IDENTITY in normalization_mapping" {
                w.push(format!("{what} normalization is identity: {}", n.from));
            }
        }
        w
    }
}

/// Resolves `checkpoint` (+ `config`): a lerobot pi0.5 folder gives the interface (and, with
/// `config`, the model sizes, whose interface fields must agree); a folder with petite's
/// `config.json` and no `config` given uses it; otherwise `config` or the real pi0.5.
/// `state_padded`: lerobot 0.4.x's padded state prompt.
pub fn resolve(checkpoint: &Path, config: Option<&Path>, state_padded: bool) -> Result<Resolved> {
    let sizes = config.map(Pi05Config::from_json_file).transpose()?;
    let folder = open_folder(checkpoint)?;
    match folder {
        Some(f) if f.kind == ConfigKind::LerobotPi05 => {
            let file = f.config_path.display().to_string();
            let lr = LerobotConfig::from_json(&f.json, &file)?;
            let sizes_name = config.map(|p| p.display().to_string()).unwrap_or_default();
            let cfg = lr.to_pi05(&file, sizes.as_ref().map(|s| (s, sizes_name.as_str())))?;
            let runner = Runner::from_folder(&f.dir, &lr, state_padded)?;
            Ok(Resolved {
                cfg,
                weights: f.dir,
                lerobot: Some((lr, runner)),
            })
        }
        Some(f) if f.kind == ConfigKind::Petite && sizes.is_none() && f.dir == checkpoint => {
            Ok(Resolved {
                cfg: Pi05Config::from_json_file(&f.config_path)?,
                weights: checkpoint.to_path_buf(),
                lerobot: None,
            })
        }
        _ => Ok(Resolved {
            cfg: sizes.unwrap_or_default(),
            weights: checkpoint.to_path_buf(),
            lerobot: None,
        }),
    }
}

/// The lerobot folder's config checked against the opened weights (a no-op for other
/// checkpoints): one line naming the field, its value, the tensor and its shape.
pub fn check_against_weights(r: &Resolved, ck: &CanonicalCheckpoint) -> Result<()> {
    if let Some((lr, _)) = &r.lerobot {
        let stored = ck.inner().names();
        check_weights_against(
            lr,
            &r.cfg,
            ck as &dyn WeightSource,
            &stored,
            &r.weights.display().to_string(),
        )?;
    }
    Ok(())
}
