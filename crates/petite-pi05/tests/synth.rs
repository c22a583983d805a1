//! Synthetic checkpoints: names/shapes/dtypes per layout as read back by petite-weights' mapped
//! reader, determinism (seed, thread count, chunking), statistics, and bad input.

use std::collections::BTreeMap;
use std::path::Path;

use petite_pi05::Pi05Config;
use petite_pi05::names::{self, Init, Layout, ParamKind};
use petite_pi05::synth::{self, SynthOptions, write_synthetic};
use petite_weights::{Dtype, MappedSafetensors, WeightSource};

const LAYOUTS: [Layout; 3] = [
    Layout::Lerobot,
    Layout::Hub { prefixed: false },
    Layout::Hub { prefixed: true },
];

/// The small test config with a vocabulary big enough that the embedding spans two generator
/// chunks (1.28 M elements), so thread-count independence is exercised across chunks.
fn cfg() -> Pi05Config {
    let mut c = Pi05Config::small();
    c.language.vocab = 20_000;
    c
}

fn opts(seed: u64, threads: usize) -> SynthOptions {
    SynthOptions {
        seed,
        threads,
        // A small window, so the tests exercise waiting and evicting.
        inflight_bytes: 8 << 20,
    }
}

fn write(dir: &Path, c: &Pi05Config, layout: Layout, seed: u64, threads: usize) -> Vec<u8> {
    let r = write_synthetic(c, layout, dir, &opts(seed, threads)).expect("synth");
    assert_eq!(r.path, dir.join("model.safetensors"));
    let bytes = std::fs::read(&r.path).unwrap();
    assert_eq!(bytes.len() as u64, r.file_bytes);
    bytes
}

fn floats(src: &MappedSafetensors, name: &str) -> Vec<f32> {
    src.tensor(name)
        .unwrap()
        .as_f32()
        .expect("f32, aligned")
        .to_vec()
}

#[test]
fn real_config_has_813_lerobot_and_812_hub_tensors() {
    let c = Pi05Config::default();
    assert_eq!(names::layout_tensors(&c, Layout::Lerobot).len(), 813);
    let hub = names::layout_tensors(&c, Layout::Hub { prefixed: false });
    assert_eq!(hub.len(), 812);
    // Real Hub files (openpi's converter) drop the `model.` prefix on every key.
    assert!(hub.iter().all(|t| !t.name.starts_with("model.")));
    let bytes: usize = names::layout_tensors(&c, Layout::Lerobot)
        .iter()
        .map(|t| t.numel() * 4)
        .sum();
    assert_eq!(
        bytes, 16_573_619_264,
        "pi05-model.md §7: all-f32 bytes of 813 tensors"
    );
}

#[test]
fn every_layout_reads_back_with_exact_names_shapes_dtypes() {
    let c = cfg();
    let tmp = tempfile::tempdir().unwrap();
    for layout in LAYOUTS {
        let dir = tmp.path().join(format!("{layout:?}"));
        write(&dir, &c, layout, 7, 2);
        let src = MappedSafetensors::open(dir.join("model.safetensors")).unwrap();
        let want: BTreeMap<String, Vec<usize>> = names::layout_tensors(&c, layout)
            .into_iter()
            .map(|t| (t.name, t.shape))
            .collect();
        let mut got = src.names();
        got.sort();
        assert_eq!(
            got,
            want.keys().cloned().collect::<Vec<_>>(),
            "{layout:?}: names"
        );
        for (name, shape) in &want {
            let info = src.info(name).unwrap();
            assert_eq!(info.dtype, Dtype::F32, "{name}");
            assert_eq!(&info.shape, shape, "{name}");
        }
        let expected = match layout {
            Layout::Lerobot => names::lerobot_tensors(&c).len(),
            Layout::Hub { .. } => names::lerobot_tensors(&c).len() - 1,
        };
        assert_eq!(want.len(), expected);
        if let Layout::Hub { prefixed } = layout {
            assert!(
                !src.names()
                    .iter()
                    .any(|n| n.ends_with("embed_tokens.weight"))
            );
            assert_eq!(
                src.names().iter().all(|n| n.starts_with("model.")),
                prefixed
            );
        }
        // The layout is detectable from the key set, as a loader will do.
        assert_eq!(names::detect_layout(&src.names()), Some(layout));
    }
}

#[test]
fn same_seed_same_bytes_for_any_thread_count_and_other_seed_differs() {
    let c = cfg();
    let tmp = tempfile::tempdir().unwrap();
    let a = write(&tmp.path().join("a"), &c, Layout::Lerobot, 42, 1);
    let b = write(&tmp.path().join("b"), &c, Layout::Lerobot, 42, 2);
    let d = write(&tmp.path().join("d"), &c, Layout::Lerobot, 42, 5);
    assert!(a == b, "1 vs 2 threads differ");
    assert!(a == d, "1 vs 5 threads differ");
    let e = write(&tmp.path().join("e"), &c, Layout::Lerobot, 43, 2);
    assert_eq!(a.len(), e.len());
    assert!(a != e, "seed 42 and 43 wrote the same bytes");
    // Rewriting over an existing file replaces it with the same bytes.
    let again = write(&tmp.path().join("a"), &c, Layout::Lerobot, 42, 2);
    assert!(a == again);
}

#[test]
fn values_do_not_depend_on_chunking() {
    let init = Init::Normal { std: 0.5 };
    let key = synth::tensor_key(3, "model.x.weight");
    let mut whole = vec![0f32; 10_001];
    synth::fill(init, key, 0, &mut whole);
    // Odd and even starts, odd lengths, single elements.
    let mut pieces = vec![0f32; whole.len()];
    let cuts = [
        0usize, 1, 2, 5, 8, 9, 1000, 1001, 4097, 9999, 10_000, 10_001,
    ];
    for w in cuts.windows(2) {
        synth::fill(init, key, w[0] as u64, &mut pieces[w[0]..w[1]]);
    }
    assert!(whole == pieces);
    // Indices past 2^32 are still filled (and differ from the low ones).
    let mut hi = vec![0f32; 6];
    synth::fill(init, key, (1u64 << 32) - 3, &mut hi);
    assert!(hi.iter().all(|v| v.is_finite() && *v != 0.0));
    let mut lo = vec![0f32; 3];
    synth::fill(init, key, 0, &mut lo);
    assert_ne!(&hi[3..], &lo[..]);
}

#[test]
fn layouts_of_one_seed_hold_the_same_model() {
    let c = cfg();
    let tmp = tempfile::tempdir().unwrap();
    write(&tmp.path().join("l"), &c, Layout::Lerobot, 9, 2);
    let hub = Layout::Hub { prefixed: false };
    write(&tmp.path().join("h"), &c, hub, 9, 2);
    let l = MappedSafetensors::open(tmp.path().join("l/model.safetensors")).unwrap();
    let h = MappedSafetensors::open(tmp.path().join("h/model.safetensors")).unwrap();
    for t in names::lerobot_tensors(&c) {
        let Some(stored) = names::stored_name(&t.name, hub) else {
            continue;
        };
        assert!(
            floats(&l, &t.name) == floats(&h, &stored),
            "{} vs {stored}",
            t.name
        );
    }
    // The Hub lm_head is the text embedding, not lerobot's (untied) lm_head.
    let hub_head = floats(&h, "paligemma_with_expert.paligemma.lm_head.weight");
    assert!(hub_head == floats(&l, names::EMBED_TOKENS));
    assert!(hub_head != floats(&l, names::PALIGEMMA_LM_HEAD));
}

#[test]
fn statistics_match_the_init_and_norms_are_as_initialised() {
    let c = cfg();
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), &c, Layout::Lerobot, 1, 2);
    let src = MappedSafetensors::open(tmp.path().join("model.safetensors")).unwrap();
    let (mut pooled_n, mut pooled_m4) = (0f64, 0f64);
    let mut checked_large = 0;
    for t in names::lerobot_tensors(&c) {
        let v = floats(&src, &t.name);
        assert_eq!(v.len(), t.numel());
        match t.kind.synthetic_init() {
            Init::Constant(k) => {
                assert!(t.kind.is_norm(), "{}", t.name);
                assert!(v.iter().all(|&x| x == k), "{}: not all {k}", t.name);
                match t.kind {
                    ParamKind::LayerNormWeight => assert_eq!(k, 1.0),
                    ParamKind::LayerNormBias | ParamKind::RmsNormWeight => assert_eq!(k, 0.0),
                    _ => unreachable!(),
                }
            }
            Init::Normal { std } => {
                let n = v.len() as f64;
                let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
                let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
                let s = std as f64;
                assert!(v.iter().all(|x| x.is_finite() && x.abs() <= 5.8 * std));
                // 6 standard errors: a real bias fails, chance essentially never does.
                assert!(mean.abs() < 6.0 * s / n.sqrt(), "{}: mean {mean}", t.name);
                let rel = (var.sqrt() / s - 1.0).abs();
                assert!(
                    rel < 6.0 / (2.0 * n).sqrt() + 1e-3,
                    "{}: std {} vs {s}",
                    t.name,
                    var.sqrt()
                );
                if v.len() >= 100_000 {
                    checked_large += 1;
                    assert!(rel < 0.01, "{}", t.name);
                }
                pooled_n += n;
                pooled_m4 += v.iter().map(|&x| (x as f64 / s).powi(4)).sum::<f64>();
            }
        }
    }
    assert!(checked_large >= 3);
    // A normal has kurtosis 3 (a uniform 1.8, a Laplace 6).
    let kurt = pooled_m4 / pooled_n;
    assert!((kurt - 3.0).abs() < 0.05, "kurtosis {kurt}");
}

#[test]
fn bad_config_is_a_clear_error_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let mut c = Pi05Config::small();
    c.expert.depth = c.language.depth + 1;
    let e = write_synthetic(&c, Layout::Lerobot, &out, &opts(0, 2)).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("expert.depth"), "{msg}");
    assert!(!out.exists(), "output directory created for a bad config");

    let mut c = Pi05Config::small();
    c.vision.patch_size = 13;
    let msg = write_synthetic(&c, Layout::Lerobot, &out, &opts(0, 2))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("patch_size"), "{msg}");
    assert!(!out.exists());
}

#[test]
fn unwritable_output_leaves_nothing_under_the_final_name() {
    let tmp = tempfile::tempdir().unwrap();
    // The output "directory" is a file: creating it fails before anything is written.
    let blocker = tmp.path().join("file");
    std::fs::write(&blocker, b"x").unwrap();
    let e = write_synthetic(&cfg(), Layout::Lerobot, &blocker, &opts(0, 2)).unwrap_err();
    assert!(e.to_string().contains("file"), "{e}");
    assert_eq!(std::fs::read(&blocker).unwrap(), b"x");
    // A directory squatting on the final name makes the rename fail: the temporary file is
    // removed and the squatter is untouched.
    let out = tmp.path().join("out");
    std::fs::create_dir_all(out.join("model.safetensors/keep")).unwrap();
    assert!(write_synthetic(&cfg(), Layout::Lerobot, &out, &opts(0, 2)).is_err());
    let left: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("model.safetensors")]);
    assert!(out.join("model.safetensors/keep").is_dir());
}
