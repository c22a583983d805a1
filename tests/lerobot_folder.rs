//! `--checkpoint` as a lerobot pi0.5 policy folder, end to end through the binary: the interface
//! printed and taken from `config.json` (the golden's weights, lerobot's own, with a lerobot
//! config beside them and the sizes from `--config`), `policy.json` and the export id, training
//! output layouts, and every refusal as one line naming the file, field or tensor. lerobot's
//! numerics through `petite act` are the `lerobot-policy` conformance tier's.

mod common;

use std::path::{Path, PathBuf};

use common::{Scratch, case, ok, petite};
use serde_json::{Value, json};

const CASE: &str = "two_cams_mqa";

/// A lerobot config for the golden `two_cams_mqa` (32 px, 2 camera slots, 12 tokens, chunk 6,
/// max_action_dim 8): one real camera + one empty, state 5, action 4, MEAN_STD.
fn lerobot_config() -> Value {
    json!({
        "type": "pi05",
        "n_obs_steps": 1,
        "input_features": {
            "observation.images.front": {"type": "VISUAL", "shape": [3, 48, 64]},
            "observation.state": {"type": "STATE", "shape": [5]}
        },
        "output_features": {"action": {"type": "ACTION", "shape": [4]}},
        "chunk_size": 6, "n_action_steps": 3, "max_action_dim": 8, "max_state_dim": 8,
        "num_inference_steps": 10, "image_resolution": [32, 32], "empty_cameras": 1,
        "tokenizer_max_length": 12,
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"},
        "optimizer_lr": 2.5e-05, "a_key_from_a_newer_lerobot": true
    })
}

/// A folder `dir` holding `config` and the golden's weights.
fn folder(dir: &Path, config: &Value) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(
        case(CASE).join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    dir.to_path_buf()
}

fn export(ck: &Path, out: &Path) -> std::process::Output {
    petite()
        .args(["export", "--dtype", "f32", "--checkpoint"])
        .arg(ck)
        .arg("--config")
        .arg(case(CASE).join("config.json"))
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

/// The failure's message (stderr), after asserting the run failed with exit code 1 and left no
/// output directory behind.
fn refused(o: std::process::Output, out: &Path) -> String {
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(!out.join("prefix.pte").exists(), "{err}");
    err
}

#[test]
fn a_lerobot_folder_exports_with_its_interface_and_verifies() {
    let s = Scratch::new("folder");
    let ck = folder(&s.0.join("policy"), &lerobot_config());
    let out = s.0.join("out");
    let o = ok(export(&ck, &out));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.starts_with("lerobot pi0.5 policy: cameras [front, empty_camera_0 (empty)], image 32x32, tokens 12, chunk 6 (n_action_steps 3), steps 10, state 5 (max 8), action 4 (max 8), normalization state MEAN_STD / action MEAN_STD"),
        "{stdout}"
    );
    let policy: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("policy.json")).unwrap()).unwrap();
    let r = &policy["runner"];
    assert_eq!(r["cameras"][1]["key"], "observation.images.empty_camera_0");
    assert_eq!(r["cameras"][1]["empty"], true);
    assert_eq!(
        (r["state_dim"].as_u64(), r["action_dim"].as_u64()),
        (Some(5), Some(4))
    );
    assert_eq!(r["tokenizer"], "google/paligemma-3b-pt-224");
    // No processors in the folder: identity, and said so.
    assert_eq!(r["state_norm"]["mode"], "IDENTITY");
    assert!(
        r["state_norm"]["from"]
            .as_str()
            .unwrap()
            .contains("no stats")
    );
    let id = policy["export_id"].as_str().unwrap();
    assert_eq!(id.len(), 32);
    // verify takes the folder too and runs with its interface; `--actions-out` writes the
    // actions in the shape of the config verify resolved (the folder's chunk and action dims).
    let acts = s.0.join("actions.safetensors");
    ok(petite()
        .args(["verify", "--max-error", "1e-4", "--pte-dir"])
        .arg(&out)
        .arg("--checkpoint")
        .arg(&ck)
        .arg("--config")
        .arg(case(CASE).join("config.json"))
        .arg("--actions-out")
        .arg(&acts)
        .output()
        .unwrap());
    let bytes = std::fs::read(&acts).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let a = st.tensor("actions").unwrap();
    assert_eq!(a.shape(), [6, 8]);
    let vals: Vec<f32> = a
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert!(vals.iter().all(|v| v.is_finite()) && vals.iter().any(|&v| v != 0.0));
    // A training output resolves to its pretrained_model.
    let run = s.0.join("run");
    folder(
        &run.join("checkpoints/last/pretrained_model"),
        &lerobot_config(),
    );
    let o = ok(export(&run, &s.0.join("out2")));
    assert!(String::from_utf8_lossy(&o.stdout).contains("cameras [front, empty_camera_0 (empty)]"));
    // Same inputs, same export id (and bytes).
    let p2: Value =
        serde_json::from_str(&std::fs::read_to_string(s.0.join("out2/policy.json")).unwrap())
            .unwrap();
    assert_eq!(p2["export_id"], policy["export_id"]);
}

#[test]
fn files_of_two_exports_are_refused_by_every_reader() {
    let s = Scratch::new("mixed");
    let ck = folder(&s.0.join("policy"), &lerobot_config());
    let (a, b) = (s.0.join("a"), s.0.join("b"));
    ok(export(&ck, &a));
    let mut other = lerobot_config();
    other["num_inference_steps"] = json!(5);
    let mut sizes: Value =
        serde_json::from_str(&std::fs::read_to_string(case(CASE).join("config.json")).unwrap())
            .unwrap();
    sizes["steps"] = json!(5);
    std::fs::write(s.0.join("sizes5.json"), sizes.to_string()).unwrap();
    let ck5 = folder(&s.0.join("policy5"), &other);
    ok(petite()
        .args(["export", "--dtype", "f32", "--checkpoint"])
        .arg(&ck5)
        .arg("--config")
        .arg(s.0.join("sizes5.json"))
        .arg("--out")
        .arg(&b)
        .output()
        .unwrap());
    // A policy.json of another export beside a consistent pair.
    let c = s.0.join("c");
    ok(export(&ck, &c));
    std::fs::copy(b.join("policy.json"), c.join("policy.json")).unwrap();
    let o = petite()
        .args(["verify", "--pte-dir"])
        .arg(&c)
        .arg("--checkpoint")
        .arg(&ck)
        .arg("--config")
        .arg(case(CASE).join("config.json"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("policy.json: export id ")
            && err.contains("the files come from different exports"),
        "{err}"
    );
    // The ONNX backend carries the same id in pi05.onnx.json.
    let d = s.0.join("d");
    ok(petite()
        .args([
            "export",
            "--dtype",
            "f32",
            "--backend",
            "onnx",
            "--checkpoint",
        ])
        .arg(&ck)
        .arg("--config")
        .arg(case(CASE).join("config.json"))
        .arg("--out")
        .arg(&d)
        .output()
        .unwrap());
    let read = |p: PathBuf| -> Value {
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    };
    let (spec, policy) = (read(d.join("pi05.onnx.json")), read(d.join("policy.json")));
    assert_eq!(spec["export_id"], policy["export_id"]);
    assert_eq!(policy["backend"], "onnx");
    std::fs::copy(b.join("step.pte"), a.join("step.pte")).unwrap();
    for args in [
        vec!["inspect".into(), a.join("prefix.pte").display().to_string()],
        vec![
            "verify".into(),
            "--pte-dir".into(),
            a.display().to_string(),
            "--checkpoint".into(),
            ck.display().to_string(),
            "--config".into(),
            case(CASE).join("config.json").display().to_string(),
        ],
        vec![
            "act".into(),
            "--pte-dir".into(),
            a.display().to_string(),
            "--observation".into(),
            "x.safetensors".into(),
            "--out".into(),
            s.0.join("act.safetensors").display().to_string(),
        ],
    ] {
        let o = petite().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("step.pte: export id ")
                && err.contains("the files come from different exports"),
            "{args:?}: {err}"
        );
    }
}

/// A change to a config.
type Edit = Box<dyn Fn(&mut Value)>;

#[test]
fn bad_folders_are_refused_with_one_line_naming_the_cause() {
    let s = Scratch::new("refusals");
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "pi0",
            Box::new(|c| c["type"] = json!("pi0")),
            "a lerobot `pi0` policy; petite exports `pi05` policies only",
        ),
        (
            "peft",
            Box::new(|c| c["use_peft"] = json!(true)),
            "`use_peft: true`: the folder holds a PEFT adapter, not a policy; merge the adapter first",
        ),
        (
            "obs",
            Box::new(|c| c["n_obs_steps"] = json!(2)),
            "`n_obs_steps: 2`: pi0.5 takes one observation; only 1 is exported",
        ),
        (
            "memory",
            Box::new(|c| c["use_visual_memory"] = json!(true)),
            "`use_visual_memory: true`: memory features change the graph and the prompt; not supported",
        ),
        (
            "nonsquare",
            Box::new(|c| c["image_resolution"] = json!([32, 48])),
            "`image_resolution: [32, 48]` is not square",
        ),
        (
            "action_dim",
            Box::new(|c| c["max_action_dim"] = json!(7)),
            "`action_dim` 8",
        ),
        (
            "tokens",
            Box::new(|c| c["tokenizer_max_length"] = json!(20)),
            "`tokenizer_max_length` is 20 but",
        ),
        (
            "openpi",
            Box::new(|c| {
                *c = json!({"action_dim": 32, "action_horizon": 10, "precision": "bfloat16"})
            }),
            "an openpi-converted folder (openpi's config, no lerobot `type`)",
        ),
    ];
    for (name, edit, want) in cases {
        let mut c = lerobot_config();
        edit(&mut c);
        let ck = folder(&s.0.join(name), &c);
        let out = s.0.join(format!("{name}-out"));
        let err = refused(export(&ck, &out), &out);
        assert!(err.contains(want), "{name}: {err}");
        assert!(err.contains("config.json"), "{name}: names the file: {err}");
    }
    // Without --config the variant sizes meet the small weights: the config-vs-weights check
    // names the field, the tensor and its shape.
    let ck = folder(&s.0.join("variants32"), &lerobot_config());
    let out = s.0.join("variants32-out");
    let o = petite()
        .args(["export", "--checkpoint"])
        .arg(&ck)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let err = refused(o, &out);
    assert!(
        err.contains("config.json: `image_resolution` is 32: SigLIP So400m/14 takes a multiple of its patch size 14"),
        "{err}"
    );
    let mut c = lerobot_config();
    c["image_resolution"] = json!([224, 224]);
    let ck = folder(&s.0.join("variants"), &c);
    let out = s.0.join("variants-out");
    let o = petite()
        .args(["export", "--checkpoint"])
        .arg(&ck)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let err = refused(o, &out);
    assert!(
        err.contains("the action expert width is 1024 (`action_expert_variant` gemma_300m), but tensor `model.action_in_proj.weight` has shape [32, 8]"),
        "{err}"
    );
}

#[test]
fn a_pi0_checkpoint_is_refused_by_its_state_proj() {
    let s = Scratch::new("pi0");
    let ck = folder(&s.0.join("policy"), &lerobot_config());
    let bytes = std::fs::read(ck.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let extra = vec![0u8; 4 * 32 * 8];
    let mut tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> =
        st.tensors().into_iter().collect();
    tensors.push((
        "model.state_proj.weight".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![32, 8], &extra).unwrap(),
    ));
    let out_bytes = safetensors::serialize(tensors, None).unwrap();
    std::fs::write(ck.join("model.safetensors"), out_bytes).unwrap();
    let out = s.0.join("out");
    let err = refused(export(&ck, &out), &out);
    assert!(
        err.contains("holds `state_proj.weight`: this is a pi0 checkpoint"),
        "{err}"
    );
}

#[test]
fn act_refuses_bad_observations_naming_the_key() {
    let s = Scratch::new("act");
    let ck = folder(&s.0.join("policy"), &lerobot_config());
    let out = s.0.join("out");
    ok(export(&ck, &out));
    let write = |name: &str, tensors: Vec<(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)>| {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(k, d, s, b)| {
                (
                    k.to_string(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        let p = s.0.join(name);
        std::fs::write(&p, safetensors::serialize(views, None).unwrap()).unwrap();
        p
    };
    use safetensors::Dtype::{F32, U8};
    let state = ("observation.state", F32, vec![5], vec![0u8; 20]);
    let img = (
        "observation.images.front",
        U8,
        vec![10, 12, 3],
        vec![7u8; 360],
    );
    let cases = [
        (
            write(
                "unknown.safetensors",
                vec![
                    state.clone(),
                    img.clone(),
                    ("observation.images.back", U8, vec![2, 2, 3], vec![0; 12]),
                ],
            ),
            "`observation.images.back`: expected one of observation.state, noise, rtc.prev_chunk_left_over, observation.images.front, observation.images.empty_camera_0, found an unknown key",
        ),
        (
            write("nostate.safetensors", vec![img.clone()]),
            "`observation.state`: expected f32 [5], found nothing",
        ),
        (
            write(
                "shape.safetensors",
                vec![
                    state.clone(),
                    (
                        "observation.images.front",
                        F32,
                        vec![10, 12, 3],
                        vec![0; 1440],
                    ),
                ],
            ),
            "`observation.images.front`: expected float32 [3, H, W] in [0, 1] or uint8 [H, W, 3], found F32 [10, 12, 3]",
        ),
        (
            write("ok.safetensors", vec![state.clone(), img.clone()]),
            "no tokenizer.json for `google/paligemma-3b-pt-224`: give --tokenizer FILE or $PETITE_TOKENIZER",
        ),
    ];
    for (obs, want) in cases {
        let o = petite()
            .env_remove("PETITE_TOKENIZER")
            .env("HF_HUB_CACHE", s.0.join("no-hf-cache"))
            .args(["act", "--task", "pick", "--pte-dir"])
            .arg(&out)
            .arg("--observation")
            .arg(&obs)
            .arg("--out")
            .arg(s.0.join("act.safetensors"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains(want), "{}: {err}", obs.display());
        assert!(!s.0.join("act.safetensors").exists());
    }
}
