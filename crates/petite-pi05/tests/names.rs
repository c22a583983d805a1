//! Tensor names and shapes against the real lerobot 0.6.1 state dict (pi05-tensors.tsv).
use petite_pi05::Pi05Config;
use petite_pi05::names::*;
use std::collections::HashSet;

const TSV: &str = include_str!("data/pi05-tensors.tsv");

#[test]
fn real_config_reproduces_the_real_state_dict() {
    let specs = lerobot_tensors(&Pi05Config::default());
    let lines: Vec<&str> = TSV.lines().collect();
    assert_eq!(lines.len(), 813);
    assert_eq!(specs.len(), 813);
    for (i, (spec, line)) in specs.iter().zip(&lines).enumerate() {
        let shape = format!(
            "[{}]",
            spec.shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        let ours = format!(
            "{}\t{}\t{}",
            spec.name,
            shape,
            spec.bf16_mode_dtype.torch_name()
        );
        assert_eq!(&ours, line, "row {i}");
    }
    let params: usize = specs.iter().map(|t| t.numel()).sum();
    assert_eq!(params, 4_143_404_816);
}

#[test]
fn hub_layout_has_812_and_remaps_the_embedding() {
    let cfg = Pi05Config::default();
    for prefixed in [true, false] {
        let layout = Layout::Hub { prefixed };
        let hub = layout_tensors(&cfg, layout);
        assert_eq!(hub.len(), 812);
        let names: HashSet<&str> = hub.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names.len(), 812);
        assert!(hub.iter().all(|t| t.name.starts_with("model.") == prefixed));
        let remap = key_remap(&cfg, layout);
        let lm = if prefixed {
            PALIGEMMA_LM_HEAD.to_string()
        } else {
            PALIGEMMA_LM_HEAD
                .strip_prefix("model.")
                .unwrap()
                .to_string()
        };
        assert!(remap.contains(&(EMBED_TOKENS.to_string(), lm.clone())));
        // Every inference tensor resolves to a stored name of the Hub file with equal shape.
        let shapes: std::collections::HashMap<&str, &Vec<usize>> =
            hub.iter().map(|t| (t.name.as_str(), &t.shape)).collect();
        for t in inference_tensors(&cfg) {
            let stored = stored_name(&t.name, layout).unwrap();
            assert_eq!(shapes.get(stored.as_str()), Some(&&t.shape), "{}", t.name);
        }
        assert_eq!(
            detect_layout(&hub.iter().map(|t| t.name.clone()).collect::<Vec<_>>()),
            Some(layout)
        );
        assert_eq!(drop_list(layout).len(), 1);
        assert!(drop_list(layout)[0].ends_with("gemma_expert.lm_head.weight"));
        if prefixed {
            assert_eq!(remap.len(), 1);
        } else {
            assert_eq!(remap.len(), 812);
        }
    }
    let lerobot: Vec<String> = lerobot_tensors(&cfg).into_iter().map(|t| t.name).collect();
    assert_eq!(detect_layout(&lerobot), Some(Layout::Lerobot));
    assert!(key_remap(&cfg, Layout::Lerobot).is_empty());
    assert_eq!(
        drop_list(Layout::Lerobot),
        [PALIGEMMA_LM_HEAD, EXPERT_LM_HEAD]
    );
}

#[test]
fn inference_needs_811() {
    let cfg = Pi05Config::default();
    let inf = inference_tensors(&cfg);
    assert_eq!(inf.len(), 811);
    let params: usize = inf.iter().map(|t| t.numel()).sum();
    assert_eq!(params, 3_353_433_872);
}

#[test]
fn synthetic_init_matches_the_real_norm_init() {
    let cfg = Pi05Config::small();
    let specs = lerobot_tensors(&cfg);
    for t in &specs {
        let init = t.kind.synthetic_init();
        if t.name.ends_with("layernorm.weight") && t.name.contains("language_model")
            || t.name.ends_with("language_model.norm.weight")
        {
            assert_eq!(init, Init::Constant(0.0), "{}", t.name);
        } else if t.name.contains("vision_model") && t.name.contains("norm") {
            let want = if t.name.ends_with(".weight") {
                1.0
            } else {
                0.0
            };
            assert_eq!(init, Init::Constant(want), "{}", t.name);
        } else {
            assert!(
                matches!(init, Init::Normal { std } if std > 0.0 && std < 1.0),
                "{}",
                t.name
            );
            assert!(!t.kind.is_norm());
        }
    }
    let n_norm = specs.iter().filter(|t| t.kind.is_norm()).count();
    // SigLIP: 2 LayerNorms (w+b) per layer + post; language: 2 per layer + final.
    assert_eq!(
        n_norm,
        cfg.vision.layers * 4 + 2 + cfg.language.depth * 2 + 1
    );
}
