//! `Policy::act_model`, the lerobot plugin's entry: what lerobot's PI05 preprocessor emits (its
//! float images, its tokens and attention mask) in, the model-space chunk out — through the same
//! owner thread as `act`, so the chunk `act` computes for an observation is the one `act_model`
//! computes for that observation's preprocessed form; bad input refused naming the key, the
//! policy usable afterwards. And what the export writes for lerobot beside the programs.
//! (lerobot's numerics through this entry are the `lerobot-policy` conformance tier's.)

mod common;

use std::path::Path;

use common::{Scratch, petite};
use petite::policy::{
    ActionChunk, Array, Ints, MASK_KEY, ModelInputs, OpenOptions, Options, Policy, TOKENS_KEY,
};

use common::policy::{FRONT, exported, observation};

fn open(dir: &Path, tok: &Path) -> Policy {
    Policy::open(
        dir,
        &OpenOptions {
            tokenizer: Some(tok.to_path_buf()),
            ..OpenOptions::default()
        },
    )
    .unwrap()
}

fn seeded(seed: u64) -> Options {
    Options {
        seed: Some(seed),
        ..Options::default()
    }
}

/// What lerobot's preprocessor makes of `observation(k, task)`: the uint8 image as float32
/// CHW / 255 with a batch dimension, `act`'s prompt tokens and mask.
fn preprocessed(k: u8, c: &ActionChunk) -> ModelInputs {
    let Array::U8 { data, .. } = &observation(k, "unused").images[FRONT] else {
        unreachable!()
    };
    let (h, w) = (48, 64);
    let mut chw = vec![0f32; data.len()];
    for y in 0..h {
        for x in 0..w {
            for ch in 0..3 {
                chw[ch * h * w + y * w + x] = data[(y * w + x) * 3 + ch] as f32 / 255.0;
            }
        }
    }
    let mut m = ModelInputs {
        tokens: Ints::new(&[1, c.tokens.len()], c.tokens.clone()),
        attention_mask: Ints::new(
            &[1, c.token_mask.len()],
            c.token_mask.iter().map(|&v| v as i64).collect(),
        ),
        ..ModelInputs::default()
    };
    m.images
        .insert(FRONT.into(), Array::f32(&[1, 3, h, w], chw));
    m
}

#[test]
fn act_model_gives_the_model_chunk_of_the_preprocessed_observation() {
    let s = Scratch::new("model");
    let (dir, tok) = exported(&s);
    let p = open(&dir, &tok);
    let a = p.act(&observation(1, "pick"), &seeded(0)).unwrap();
    let b = p.act(&observation(2, "place"), &seeded(0)).unwrap();
    assert_ne!(a.model, b.model);
    let m = p.act_model(&preprocessed(1, &a), &seeded(0)).unwrap();
    assert_eq!((m.chunk, m.action_dim, m.n_action_steps), (6, 4, 3));
    assert_eq!(m.model, a.model);
    let m2 = p.try_act_model(&preprocessed(2, &b), &seeded(0)).unwrap();
    assert_eq!(m2.model, b.model);
    // Explicit noise: the seed's noise given as values is the same chunk; other noise another.
    let model = petite_pi05::policy::PolicySpec::read(&dir.join("policy.json"))
        .unwrap()
        .model;
    let noise = petite::policy::seeded_noise(0, model.chunk * model.action_dim);
    let given = Options {
        noise: Some(noise.clone()),
        ..Options::default()
    };
    assert_eq!(
        p.act_model(&preprocessed(1, &a), &given).unwrap().model,
        a.model
    );
    let other = Options {
        noise: Some(noise.iter().map(|v| -v).collect()),
        ..Options::default()
    };
    assert_ne!(
        p.act_model(&preprocessed(1, &a), &other).unwrap().model,
        a.model
    );
}

#[test]
fn bad_model_inputs_are_refused_by_key_and_the_policy_stays_usable() {
    let s = Scratch::new("model-bad");
    let (dir, tok) = exported(&s);
    let p = open(&dir, &tok);
    let a = p.act(&observation(3, "pick"), &seeded(5)).unwrap();
    let good = preprocessed(3, &a);
    let with = |f: &dyn Fn(&mut ModelInputs)| {
        let mut m = good.clone();
        f(&mut m);
        m
    };
    let cases: Vec<(ModelInputs, &str)> = vec![
        (
            with(&|m| {
                m.tokens = Ints::new(&[2, 12], vec![0; 24]);
            }),
            "`observation.language.tokens`: a batch of 2 observations",
        ),
        (
            with(&|m| m.tokens = Ints::new(&[1, 11], vec![0; 11])),
            "`observation.language.tokens`: expected [12] (or [1, 12]), found [1, 11]",
        ),
        (
            with(&|m| m.tokens.data[4] = 96),
            "`observation.language.tokens`: expected ids in 0..96, found 96 at 4",
        ),
        (
            with(&|m| m.attention_mask.data[0] = 2),
            "`observation.language.attention_mask`: expected 0/1 (bool) values, found 2 at 0",
        ),
        (
            with(&|m| m.attention_mask = Ints::new(&[1, 12], vec![1; 11])),
            "`observation.language.attention_mask`: expected 12 values for its shape [1, 12], found 11",
        ),
        (
            with(&|m| {
                m.images
                    .insert(FRONT.into(), Array::u8(&[48, 64, 3], vec![0; 48 * 64 * 3]));
            }),
            "`observation.images.front`: expected float32 [3, H, W] or [H, W, 3] in [0, 1]",
        ),
        (
            with(&|m| {
                m.images
                    .insert(FRONT.into(), Array::f32(&[2, 3, 4, 4], vec![0.5; 96]));
            }),
            "`observation.images.front`: a batch of 2 observations",
        ),
        (
            with(&|m| {
                m.images
                    .insert(FRONT.into(), Array::f32(&[3, 4, 4], vec![f32::NAN; 48]));
            }),
            "`observation.images.front`: expected finite values, found NaN at 0",
        ),
        (
            with(&|m| {
                m.images.insert(
                    "observation.images.wrist".into(),
                    Array::f32(&[3, 2, 2], vec![0.0; 12]),
                );
            }),
            "`observation.images.wrist`: expected one of",
        ),
        (with(&|m| m.images.clear()), "no camera image"),
    ];
    for (m, want) in cases {
        let e = p.act_model(&m, &seeded(5)).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(want), "{msg}\n  wanted: {want}");
        assert!(!msg.contains('\n'), "one line: {msg}");
        assert_eq!(p.act_model(&good, &seeded(5)).unwrap().model, a.model);
    }
    // The keys are lerobot's.
    assert_eq!(
        (TOKENS_KEY, MASK_KEY),
        (
            "observation.language.tokens",
            "observation.language.attention_mask"
        )
    );
}

#[test]
fn the_export_writes_a_lerobot_config_of_type_petite_and_never_into_the_policy_folder() {
    let s = Scratch::new("model-config");
    let (dir, _) = exported(&s);
    let c: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(c["type"], "petite");
    assert_eq!(
        (c["chunk_size"].as_u64(), c["n_action_steps"].as_u64()),
        (Some(6), Some(3))
    );
    assert_eq!(
        c["input_features"][FRONT]["shape"],
        serde_json::json!([3, 48, 64])
    );
    assert_eq!(
        c["output_features"]["action"]["shape"],
        serde_json::json!([4])
    );
    let spec = petite_pi05::policy::PolicySpec::read(&dir.join("policy.json")).unwrap();
    assert_eq!(c["export_id"], spec.export_id.as_str());
    // The fixture's folder has no processor files: none are made up.
    assert!(!dir.join("policy_preprocessor.json").exists());

    // Exporting into the policy folder itself is refused before anything is written.
    let ck = s.0.join("policy");
    let before = std::fs::read(ck.join("config.json")).unwrap();
    let o = petite()
        .args(["export", "--dtype", "f32", "--checkpoint"])
        .arg(&ck)
        .arg("--config")
        .arg(common::case("two_cams_mqa").join("config.json"))
        .arg("--out")
        .arg(&ck)
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("is the lerobot policy folder"), "{err}");
    assert_eq!(std::fs::read(ck.join("config.json")).unwrap(), before);
    assert!(!ck.join("prefix.pte").exists());
}
