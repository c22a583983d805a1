//! Input files and checkpoints: every problem is one error naming the tensor, expected, found.
mod common;

use common::{T, f32s, raw, write};
use petite_pi05::inputs::{Inputs, check_weights, open_checkpoint};
use petite_pi05::names::{self, Layout};
use petite_pi05::{Pi05Config, Precision, build_all};
use petite_weights::WeightSource;

fn err_with(cfg: &Pi05Config, edit: impl FnOnce(&mut Vec<T>)) -> String {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("inputs.safetensors");
    let mut t = common::inputs(cfg);
    edit(&mut t);
    write(&p, &t);
    Inputs::from_file(&p, cfg).unwrap_err().to_string()
}

fn has(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "`{msg}` lacks `{p}`");
    }
}

#[test]
fn valid_inputs_read_back() {
    let cfg = Pi05Config::small();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("inputs.safetensors");
    write(&p, &common::inputs(&cfg));
    let i = Inputs::from_file(&p, &cfg).unwrap();
    assert_eq!(i.images.len(), 2 * 3 * 28 * 28);
    assert_eq!(i.images[1], 1.0 / 6.5 - 1.0);
    assert_eq!(i.tokens[3], 3);
    assert_eq!(i.token_mask, [1, 1, 1, 1, 1, 1, 1, 0]);
    assert_eq!(i.noise.len(), cfg.chunk * cfg.action_dim);
    // A bool mask is accepted too.
    let mut t = common::inputs(&cfg);
    t[1] = raw("image_masks", "BOOL", &[2], vec![1, 0]);
    write(&p, &t);
    assert_eq!(Inputs::from_file(&p, &cfg).unwrap().image_masks, [1, 0]);
}

#[test]
fn bad_inputs_name_tensor_expected_found() {
    let cfg = Pi05Config::small();
    let m = err_with(&cfg, |t| {
        t.remove(4);
    });
    has(
        &m,
        &[
            "inputs.safetensors",
            "`noise`",
            "F32 [5,6]",
            "no such tensor",
        ],
    );
    let m = err_with(&cfg, |t| {
        t[0] = f32s("images", &[2, 3, 28, 27], vec![0.0; 2 * 3 * 28 * 27])
    });
    has(
        &m,
        &[
            "`images`",
            "expected F32 [2,3,28,28]",
            "found F32 [2,3,28,27]",
        ],
    );
    let m = err_with(&cfg, |t| t[2] = raw("tokens", "I32", &[8], vec![0; 32]));
    has(&m, &["`tokens`", "expected I64 [8]", "found I32 [8]"]);
    let m = err_with(&cfg, |t| t[3] = raw("token_mask", "F32", &[8], vec![0; 32]));
    has(&m, &["`token_mask`", "U8 or BOOL [8]", "found F32 [8]"]);
    let m = err_with(&cfg, |t| {
        t[2] = raw(
            "tokens",
            "I64",
            &[8],
            (0..8i64).flat_map(|i| (i * 100).to_le_bytes()).collect(),
        )
    });
    has(&m, &["`tokens`", "ids in 0..300", "found 300 at index 3"]);
    let m = err_with(&cfg, |t| t[1] = raw("image_masks", "U8", &[2], vec![1, 2]));
    has(&m, &["`image_masks`", "0 or 1", "2 at index 1"]);
    let m = err_with(&cfg, |t| {
        t[4] = f32s(
            "noise",
            &[5, 6],
            (0..30).map(|i| if i == 7 { f32::NAN } else { 0.0 }),
        )
    });
    has(&m, &["`noise`", "finite", "NaN at index 7"]);
}

/// A checkpoint of `layout` for `cfg` with every tensor filled with its index (so values can
/// be traced), written as F32.
fn checkpoint(
    cfg: &Pi05Config,
    layout: Layout,
    edit: impl FnOnce(&mut Vec<T>),
) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut t: Vec<T> = names::layout_tensors(cfg, layout)
        .into_iter()
        .enumerate()
        .map(|(i, s)| f32s(&s.name, &s.shape, std::iter::repeat_n(i as f32, s.numel())))
        .collect();
    edit(&mut t);
    write(&dir.path().join("model.safetensors"), &t);
    dir
}

#[test]
fn checkpoints_of_both_layouts_open_under_canonical_names() {
    let cfg = Pi05Config::small();
    let progs = build_all(&cfg, Precision::F32).unwrap();
    for layout in [
        Layout::Lerobot,
        Layout::Hub { prefixed: true },
        Layout::Hub { prefixed: false },
    ] {
        let dir = checkpoint(&cfg, layout, |_| {});
        let ck = open_checkpoint(dir.path().join("model.safetensors")).unwrap();
        check_weights(
            &ck,
            "m",
            [&progs.prefix, &progs.step, &progs.timestep_table],
        )
        .unwrap();
        let emb = ck
            .tensor(names::EMBED_TOKENS)
            .unwrap()
            .to_f32_vec()
            .unwrap();
        // lerobot: embed_tokens is its own tensor; Hub: the values of paligemma.lm_head (index 0).
        let want = if layout == Layout::Lerobot {
            names::lerobot_tensors(&cfg)
                .iter()
                .position(|t| t.name == names::EMBED_TOKENS)
                .unwrap() as f32
        } else {
            0.0
        };
        assert!(emb.iter().all(|v| *v == want), "{layout:?}");
    }
}

#[test]
fn bad_checkpoints_name_the_tensor() {
    let cfg = Pi05Config::small();
    let progs = build_all(&cfg, Precision::F32).unwrap();
    let all = [&progs.prefix, &progs.step, &progs.timestep_table];
    let q = names::expert_layer(1, "self_attn.q_proj.weight");
    let check = |edit: &dyn Fn(&mut Vec<T>)| {
        let dir = checkpoint(&cfg, Layout::Lerobot, |t| edit(t));
        let ck = open_checkpoint(dir.path().join("model.safetensors")).unwrap();
        check_weights(&ck, "model.safetensors", all)
            .unwrap_err()
            .to_string()
    };
    let m = check(&|t| t.retain(|x| x.name != q));
    has(
        &m,
        &["model.safetensors", &q, "shape [64,32]", "no such tensor"],
    );
    let m = check(&|t| {
        let i = t.iter().position(|x| x.name == q).unwrap();
        t[i] = f32s(&q, &[64, 31], vec![0.0; 64 * 31]);
    });
    has(&m, &[&q, "expected shape [64,32]", "found shape [64,31]"]);
    let m = check(&|t| {
        let i = t.iter().position(|x| x.name == q).unwrap();
        t[i] = raw(&q, "I32", &[64, 32], vec![0; 64 * 32 * 4]);
    });
    has(&m, &[&q, "F32, BF16 or F16", "found dtype I32"]);
    // Not a pi0.5 checkpoint at all.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.safetensors");
    write(&p, &[f32s("foo", &[1], [0.0])]);
    let m = open_checkpoint(&p).unwrap_err().to_string();
    has(&m, &["x.safetensors", "pi0.5 checkpoint"]);
}
