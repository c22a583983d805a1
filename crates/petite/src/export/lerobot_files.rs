//! What lerobot needs beside the programs to load an export as a policy of its own (the
//! `lerobot_policy_petite` plugin): the policy folder's processor files, copied as they are —
//! `policy_preprocessor.json`, `policy_postprocessor.json` and the state `.safetensors` files
//! their steps name — so that lerobot's `make_pre_post_processors(cfg, pretrained_path=OUT)`
//! rebuilds the folder's own pipelines; and a lerobot `config.json` of `type` `petite`, which
//! lerobot's `PreTrainedConfig.from_pretrained` parses into the plugin's config (strictly: only
//! keys the plugin's `PetiteConfig` declares).
//!
//! Each file is written under a temporary name and renamed (`petite_fs::write`); the source
//! folder is only read.

use std::path::{Path, PathBuf};

use petite_pi05::lerobot::{ConfigKind, open_folder};
use petite_pi05::policy::Runner;
use serde_json::{Map, Value, json};

use crate::{Error, Result};

/// The processors' files lerobot's `make_pre_post_processors` reads from a pretrained path.
pub const PROCESSORS: [&str; 2] = ["policy_preprocessor.json", "policy_postprocessor.json"];
/// lerobot's config file.
pub const CONFIG: &str = "config.json";
/// The policy type the plugin registers.
pub const POLICY_TYPE: &str = "petite";

/// Refuses an output directory that is the lerobot policy folder itself (its `config.json`
/// would be replaced): checked before the export writes anything.
pub fn check_output(checkpoint: &Path, out: &Path) -> Result<()> {
    let Some(f) = open_folder(checkpoint)? else {
        return Ok(());
    };
    if f.kind != ConfigKind::LerobotPi05 {
        return Ok(());
    }
    if let (Ok(a), Ok(b)) = (f.dir.canonicalize(), out.canonicalize())
        && a == b
    {
        return Err(Error::Usage(format!(
            "--out {} is the lerobot policy folder: the export writes a config.json of its own there; export into another folder",
            out.display()
        )));
    }
    Ok(())
}

/// Writes the processor files and the `petite` `config.json` into `out` when `checkpoint` is a
/// lerobot pi0.5 folder (`runner`: its interface, as `policy.json` records it); returns the
/// files written (none for other checkpoints). A folder without processor files gets the
/// config alone (lerobot's pipelines then have to be made by the caller).
pub fn write(
    checkpoint: &Path,
    out: &Path,
    runner: &Runner,
    export_id: &str,
) -> Result<Vec<PathBuf>> {
    let Some(f) = open_folder(checkpoint)? else {
        return Ok(vec![]);
    };
    if f.kind != ConfigKind::LerobotPi05 {
        return Ok(vec![]);
    }
    let mut written = Vec::new();
    for name in PROCESSORS {
        let src = f.dir.join(name);
        if !src.is_file() {
            continue;
        }
        let text = std::fs::read(&src).map_err(|e| Error::io(&src, "read", e))?;
        let json: Value = serde_json::from_slice(&text).map_err(|e| Error::BadJson {
            path: src.display().to_string(),
            reason: e.to_string(),
        })?;
        for state in state_files(&src, &json)? {
            let from = f.dir.join(&state);
            let bytes = std::fs::read(&from).map_err(|e| Error::io(&from, "read", e))?;
            let to = out.join(&state);
            petite_fs::write(&to, &bytes)?;
            written.push(to);
        }
        let to = out.join(name);
        petite_fs::write(&to, &text)?;
        written.push(to);
    }
    let to = out.join(CONFIG);
    crate::report::write_json(&to, &config(&f.json, runner, export_id))?;
    written.push(to);
    Ok(written)
}

/// The `state_file` names a processor's steps give: plain file names in the folder (anything
/// with a path in it refused, so nothing is read or written outside the two folders).
fn state_files(path: &Path, json: &Value) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let steps = json.get("steps").and_then(Value::as_array);
    for step in steps.into_iter().flatten() {
        let Some(name) = step.get("state_file") else {
            continue;
        };
        let Some(name) = name.as_str() else {
            if name.is_null() {
                continue;
            }
            return Err(Error::input(
                path,
                format!("a step's state_file is {name}, not a file name"),
            ));
        };
        let plain = Path::new(name)
            .file_name()
            .is_some_and(|n| n == std::ffi::OsStr::new(name));
        if !plain || name == "." || name == ".." {
            return Err(Error::input(
                path,
                format!("a step's state_file `{name}` is not a file name in the folder"),
            ));
        }
        out.push(name.to_string());
    }
    Ok(out)
}

/// lerobot's `config.json` for the export: `type` `petite`, the folder's features (what lerobot's
/// scripts check observations against), the chunk's sizes, its `rtc_config`, the export id. The
/// device is the CPU (every backend's runtime runs there; `device="cuda"` when opening, or
/// `--policy.device=cuda`, for a CUDA export).
fn config(src: &Value, runner: &Runner, export_id: &str) -> Value {
    let mut c = Map::new();
    c.insert("type".into(), json!(POLICY_TYPE));
    c.insert("n_obs_steps".into(), json!(1));
    let input = src
        .get("input_features")
        .filter(|v| v.as_object().is_some_and(|o| !o.is_empty()))
        .cloned()
        .unwrap_or_else(|| {
            let mut m = Map::new();
            for cam in runner.cameras.iter().filter(|c| !c.empty) {
                let r = runner.image_resolution;
                m.insert(
                    cam.key.clone(),
                    json!({"type": "VISUAL", "shape": [3, r, r]}),
                );
            }
            m.insert(
                petite_pi05::lerobot::STATE_KEY.into(),
                json!({"type": "STATE", "shape": [runner.state_dim]}),
            );
            Value::Object(m)
        });
    c.insert("input_features".into(), input);
    let output = src
        .get("output_features")
        .filter(|v| v.as_object().is_some_and(|o| !o.is_empty()))
        .cloned()
        .unwrap_or_else(|| json!({"action": {"type": "ACTION", "shape": [runner.action_dim]}}));
    c.insert("output_features".into(), output);
    c.insert("device".into(), json!("cpu"));
    c.insert("chunk_size".into(), json!(runner.chunk));
    c.insert("n_action_steps".into(), json!(runner.n_action_steps));
    c.insert(
        "rtc_config".into(),
        src.get("rtc_config").cloned().unwrap_or(Value::Null),
    );
    c.insert("export_id".into(), json!(export_id));
    Value::Object(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_files_are_plain_names() {
        let p = Path::new("policy_preprocessor.json");
        let ok = json!({"steps": [
            {"registry_name": "to_batch_processor"},
            {"registry_name": "normalizer_processor", "state_file": "a_step_3.safetensors"},
            {"registry_name": "x", "state_file": null},
        ]});
        assert_eq!(state_files(p, &ok).unwrap(), ["a_step_3.safetensors"]);
        for bad in ["../x.safetensors", "/etc/x", "sub/x.safetensors", ".."] {
            let j = json!({"steps": [{"state_file": bad}]});
            let e = state_files(p, &j).unwrap_err().to_string();
            assert!(e.contains(bad), "{bad}: {e}");
        }
    }
}
