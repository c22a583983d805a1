//! The small policy the policy-runtime tests share (`tests/policy.rs`, `tests/serve.rs`): the
//! golden `two_cams_mqa` as a lerobot folder, exported, with a word-level tokenizer, and its
//! observations.

use std::collections::BTreeMap;
use std::path::PathBuf;

use petite::policy::{Array, Observation};
use serde_json::json;

use super::{Scratch, case, ok, petite};

const CASE: &str = "two_cams_mqa";
pub const FRONT: &str = "observation.images.front";
pub const STATE: &str = "observation.state";

/// A lerobot folder for the golden `two_cams_mqa` (one real camera + one empty, state 5,
/// action 4, chunk 6, max_action_dim 8), exported in f32 with the reference backend; and a
/// word-level tokenizer whose ids fit the golden's 96-token vocabulary.
pub fn exported(s: &Scratch) -> (PathBuf, PathBuf) {
    let ck = s.0.join("policy");
    std::fs::create_dir_all(&ck).unwrap();
    let cfg = json!({
        "type": "pi05",
        "n_obs_steps": 1,
        "input_features": {
            FRONT: {"type": "VISUAL", "shape": [3, 48, 64]},
            STATE: {"type": "STATE", "shape": [5]}
        },
        "output_features": {"action": {"type": "ACTION", "shape": [4]}},
        "chunk_size": 6, "n_action_steps": 3, "max_action_dim": 8, "max_state_dim": 8,
        "num_inference_steps": 10, "image_resolution": [32, 32], "empty_cameras": 1,
        "tokenizer_max_length": 12,
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "IDENTITY", "ACTION": "IDENTITY"}
    });
    std::fs::write(ck.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(
        case(CASE).join("model.safetensors"),
        ck.join("model.safetensors"),
    )
    .unwrap();
    let out = s.0.join("out");
    ok(petite()
        .args(["export", "--dtype", "f32", "--checkpoint"])
        .arg(&ck)
        .arg("--config")
        .arg(case(CASE).join("config.json"))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap());
    let mut vocab = serde_json::Map::new();
    for (i, w) in [
        "<pad>", "[UNK]", "Task", ":", "State", ",", ";", "Action", "pick", "place",
    ]
    .iter()
    .enumerate()
    {
        vocab.insert(w.to_string(), json!(i));
    }
    for b in -1..=40 {
        vocab.insert(b.to_string(), json!(10 + b + 1));
    }
    let tok = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    let tok_path = s.0.join("tokenizer.json");
    std::fs::write(&tok_path, tok.to_string()).unwrap();
    (out, tok_path)
}

/// An observation: a u8 `[48, 64, 3]` front image whose pixels depend on `k`, a state, a task.
pub fn observation(k: u8, task: &str) -> Observation {
    let img: Vec<u8> = (0..48 * 64 * 3)
        .map(|i| ((i * 7 + k as usize * 31) % 251) as u8)
        .collect();
    let mut images = BTreeMap::new();
    images.insert(FRONT.to_string(), Array::u8(&[48, 64, 3], img));
    Observation {
        images,
        state: Some(Array::f32(
            &[5],
            (0..5)
                .map(|i| 0.1 * i as f32 - 0.2 + 0.05 * k as f32)
                .collect(),
        )),
        task: task.to_string(),
    }
}
