//! Checkpoint tensor names and shapes, generated from a [`Pi05Config`].
//!
//! Two layouts exist in the wild (pi05-model.md §7.3):
//! * **lerobot 0.6.1** (`save_pretrained`): 813 tensors, keys start with `model.`; both `lm_head`s
//!   are present and `embed_tokens` is untied from `paligemma.lm_head` (different values).
//! * **Hub** (openpi's converter, `lerobot/pi05_base`): 812 tensors, no
//!   `…language_model.embed_tokens.weight` — its values are stored as `…paligemma.lm_head.weight`;
//!   keys may lack the `model.` prefix.
//!
//! Programs always use the canonical (lerobot) names; [`key_remap`] maps them to what a Hub file
//! stores, for petite-weights' mapped source to apply.

use crate::config::Pi05Config;

/// Prefix of every canonical key.
pub const MODEL: &str = "model.";
/// SigLIP vision model prefix.
pub const VISION: &str = "model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.";
/// Gemma language model prefix.
pub const LANGUAGE: &str = "model.paligemma_with_expert.paligemma.model.language_model.";
/// Action expert model prefix.
pub const EXPERT: &str = "model.paligemma_with_expert.gemma_expert.model.";
/// The PaliGemma `lm_head` (never used; in Hub files it holds the text embedding).
pub const PALIGEMMA_LM_HEAD: &str = "model.paligemma_with_expert.paligemma.lm_head.weight";
/// The expert's `lm_head` (random, never used).
pub const EXPERT_LM_HEAD: &str = "model.paligemma_with_expert.gemma_expert.lm_head.weight";
/// The text embedding table.
pub const EMBED_TOKENS: &str =
    "model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight";
/// Projector weight `[language.width, vision.hidden]`.
pub const PROJECTOR_WEIGHT: &str =
    "model.paligemma_with_expert.paligemma.model.multi_modal_projector.linear.weight";
/// Projector bias.
pub const PROJECTOR_BIAS: &str =
    "model.paligemma_with_expert.paligemma.model.multi_modal_projector.linear.bias";

/// `VISION` + `suffix`.
pub fn vision(suffix: &str) -> String {
    format!("{VISION}{suffix}")
}
/// SigLIP encoder layer `i`, parameter `suffix` (e.g. `self_attn.q_proj.weight`).
pub fn vision_layer(i: usize, suffix: &str) -> String {
    format!("{VISION}encoder.layers.{i}.{suffix}")
}
/// Language layer `i`, parameter `suffix`.
pub fn language_layer(i: usize, suffix: &str) -> String {
    format!("{LANGUAGE}layers.{i}.{suffix}")
}
/// Expert layer `i`, parameter `suffix`.
pub fn expert_layer(i: usize, suffix: &str) -> String {
    format!("{EXPERT}layers.{i}.{suffix}")
}
/// A tensor of `PI05Pytorch` itself (`action_in_proj.weight`, `time_mlp_in.bias`, ...).
pub fn head(suffix: &str) -> String {
    format!("{MODEL}{suffix}")
}

/// Stored dtype of a tensor in lerobot's `dtype="bfloat16"` mode (§8); in float32 mode every
/// tensor is f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoredDtype {
    /// float32.
    F32,
    /// bfloat16.
    Bf16,
}

impl StoredDtype {
    /// The spelling `pi05-tensors.tsv` uses (`float32` / `bfloat16`).
    pub fn torch_name(self) -> &'static str {
        match self {
            StoredDtype::F32 => "float32",
            StoredDtype::Bf16 => "bfloat16",
        }
    }
}

/// Which part of the model a tensor belongs to (used to check which program reads what).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// `paligemma.lm_head` (unused at inference).
    PaligemmaLmHead,
    /// SigLIP (embeddings, encoder layers, post_layernorm).
    Vision,
    /// Multimodal projector.
    Projector,
    /// Text embedding table.
    Embed,
    /// Gemma language layer.
    Language(usize),
    /// Gemma final norm (unused at inference: only K/V leave the prefix).
    LanguageNorm,
    /// Expert `lm_head` (unused at inference).
    ExpertLmHead,
    /// Expert layer attention + MLP weights.
    Expert(usize),
    /// Expert layer adaRMS `dense` (tabled by the timestep program).
    ExpertAdaRms(usize),
    /// Expert final-norm adaRMS `dense` (tabled by the timestep program).
    ExpertNorm,
    /// `action_in_proj` / `action_out_proj`.
    ActionProj,
    /// `time_mlp_in` / `time_mlp_out`.
    TimeMlp,
}

/// What kind of parameter a tensor is: drives synthetic initialisation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ParamKind {
    /// A linear or conv weight (`fan_in` = input features × kernel area).
    Matrix {
        /// Inputs per output.
        fan_in: usize,
    },
    /// A linear or conv bias.
    Bias {
        /// Inputs of the layer it belongs to.
        fan_in: usize,
    },
    /// An embedding table (token or position); rows of width `width`.
    Embedding {
        /// Row width.
        width: usize,
    },
    /// SigLIP LayerNorm weight (`x̂ * w + b`; the real model initialises it to 1).
    LayerNormWeight,
    /// SigLIP LayerNorm bias (initialised to 0).
    LayerNormBias,
    /// Gemma RMSNorm weight, used as `(1 + w)`; the real model initialises it to 0.
    RmsNormWeight,
    /// An adaRMS `dense` weight (`[3·width, width]`). lerobot initialises it to zeros, which
    /// would make every gate 0 and hide most of the expert from a test; synthetic checkpoints
    /// draw it like a matrix.
    AdaRmsWeight {
        /// Condition width.
        fan_in: usize,
    },
    /// An adaRMS `dense` bias.
    AdaRmsBias {
        /// Condition width.
        fan_in: usize,
    },
}

/// How a synthetic checkpoint fills a tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Every element equals this value.
    Constant(f32),
    /// Independent normal draws with mean 0 and this standard deviation.
    Normal {
        /// Standard deviation.
        std: f32,
    },
}

impl ParamKind {
    /// True for norm weights and biases, which a synthetic checkpoint fills with the real
    /// model's initial constant rather than random values.
    pub fn is_norm(self) -> bool {
        matches!(
            self,
            ParamKind::LayerNormWeight | ParamKind::LayerNormBias | ParamKind::RmsNormWeight
        )
    }

    /// True for biases (linear, conv, adaRMS).
    pub fn is_bias(self) -> bool {
        matches!(
            self,
            ParamKind::Bias { .. } | ParamKind::AdaRmsBias { .. } | ParamKind::LayerNormBias
        )
    }

    /// The fill for a synthetic checkpoint: norms as the real model initialises them (LayerNorm
    /// weight 1, bias 0; Gemma RMSNorm weight 0, since it scales by `1 + w`); everything else
    /// normal with std `1/√fan_in` (embeddings `1/√width`), loud enough that porting mistakes
    /// move actions well above 1e-4 (pi05-model.md §13.10).
    pub fn synthetic_init(self) -> Init {
        let inv_sqrt = |n: usize| Init::Normal {
            std: (1.0 / (n as f64).sqrt()) as f32,
        };
        match self {
            ParamKind::LayerNormWeight => Init::Constant(1.0),
            ParamKind::LayerNormBias | ParamKind::RmsNormWeight => Init::Constant(0.0),
            ParamKind::Matrix { fan_in }
            | ParamKind::Bias { fan_in }
            | ParamKind::AdaRmsWeight { fan_in }
            | ParamKind::AdaRmsBias { fan_in } => inv_sqrt(fan_in),
            ParamKind::Embedding { width } => inv_sqrt(width),
        }
    }
}

/// One tensor of a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    /// Key in the file.
    pub name: String,
    /// Shape (PyTorch order; linear weights are `[out, in]`).
    pub shape: Vec<usize>,
    /// Dtype lerobot's bf16 mode stores it in (all f32 in float32 mode).
    pub bf16_mode_dtype: StoredDtype,
    /// Parameter kind (for initialisation).
    pub kind: ParamKind,
    /// Model part (for program weight-set checks).
    pub part: Part,
}

impl TensorSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

struct Specs(Vec<TensorSpec>);

impl Specs {
    fn push(
        &mut self,
        name: String,
        shape: &[usize],
        dt: StoredDtype,
        kind: ParamKind,
        part: Part,
    ) {
        self.0.push(TensorSpec {
            name,
            shape: shape.to_vec(),
            bf16_mode_dtype: dt,
            kind,
            part,
        });
    }
    /// A linear layer: weight `[out, inp]` then bias `[out]` when `bias`.
    fn linear(
        &mut self,
        prefix: String,
        out: usize,
        inp: usize,
        bias: bool,
        dt: StoredDtype,
        part: Part,
    ) {
        self.push(
            format!("{prefix}.weight"),
            &[out, inp],
            dt,
            ParamKind::Matrix { fan_in: inp },
            part,
        );
        if bias {
            self.push(
                format!("{prefix}.bias"),
                &[out],
                dt,
                ParamKind::Bias { fan_in: inp },
                part,
            );
        }
    }
    fn layer_norm(&mut self, prefix: String, n: usize, part: Part) {
        use StoredDtype::F32;
        self.push(
            format!("{prefix}.weight"),
            &[n],
            F32,
            ParamKind::LayerNormWeight,
            part,
        );
        self.push(
            format!("{prefix}.bias"),
            &[n],
            F32,
            ParamKind::LayerNormBias,
            part,
        );
    }
    fn adarms(&mut self, prefix: String, w: usize, part: Part) {
        use StoredDtype::F32;
        self.push(
            format!("{prefix}.dense.weight"),
            &[3 * w, w],
            F32,
            ParamKind::AdaRmsWeight { fan_in: w },
            part,
        );
        self.push(
            format!("{prefix}.dense.bias"),
            &[3 * w],
            F32,
            ParamKind::AdaRmsBias { fan_in: w },
            part,
        );
    }
}

/// Every tensor of a lerobot 0.6.1 `model.safetensors` for `cfg`, in `state_dict()` order
/// (813 for the real config).
pub fn lerobot_tensors(cfg: &Pi05Config) -> Vec<TensorSpec> {
    use StoredDtype::{Bf16, F32};
    let v = &cfg.vision;
    let l = &cfg.language;
    let e = &cfg.expert;
    let mut s = Specs(Vec::with_capacity(813));

    s.push(
        PALIGEMMA_LM_HEAD.into(),
        &[l.vocab, l.width],
        Bf16,
        ParamKind::Matrix { fan_in: l.width },
        Part::PaligemmaLmHead,
    );
    // SigLIP.
    let p = v.patch_size;
    let fan = 3 * p * p;
    s.push(
        vision("embeddings.patch_embedding.weight"),
        &[v.hidden, 3, p, p],
        F32,
        ParamKind::Matrix { fan_in: fan },
        Part::Vision,
    );
    s.push(
        vision("embeddings.patch_embedding.bias"),
        &[v.hidden],
        F32,
        ParamKind::Bias { fan_in: fan },
        Part::Vision,
    );
    s.push(
        vision("embeddings.position_embedding.weight"),
        &[cfg.patches(), v.hidden],
        F32,
        ParamKind::Embedding { width: v.hidden },
        Part::Vision,
    );
    for i in 0..v.layers {
        let n = |x: &str| vision_layer(i, x);
        s.layer_norm(n("layer_norm1"), v.hidden, Part::Vision);
        for proj in ["k_proj", "v_proj", "q_proj", "out_proj"] {
            s.linear(
                n(&format!("self_attn.{proj}")),
                v.hidden,
                v.hidden,
                true,
                F32,
                Part::Vision,
            );
        }
        s.layer_norm(n("layer_norm2"), v.hidden, Part::Vision);
        s.linear(n("mlp.fc1"), v.mlp, v.hidden, true, F32, Part::Vision);
        s.linear(n("mlp.fc2"), v.hidden, v.mlp, true, F32, Part::Vision);
    }
    s.layer_norm(vision("post_layernorm"), v.hidden, Part::Vision);
    s.linear(
        "model.paligemma_with_expert.paligemma.model.multi_modal_projector.linear".into(),
        l.width,
        v.hidden,
        true,
        F32,
        Part::Projector,
    );
    // Gemma language model.
    s.push(
        EMBED_TOKENS.into(),
        &[l.vocab, l.width],
        Bf16,
        ParamKind::Embedding { width: l.width },
        Part::Embed,
    );
    let (q, kv) = (l.heads * l.head_dim, l.kv_heads * l.head_dim);
    for i in 0..l.depth {
        let n = |x: &str| language_layer(i, x);
        let part = Part::Language(i);
        s.linear(n("self_attn.q_proj"), q, l.width, false, Bf16, part);
        s.linear(n("self_attn.k_proj"), kv, l.width, false, Bf16, part);
        s.linear(n("self_attn.v_proj"), kv, l.width, false, Bf16, part);
        s.linear(n("self_attn.o_proj"), l.width, q, false, Bf16, part);
        s.linear(n("mlp.gate_proj"), l.mlp, l.width, false, Bf16, part);
        s.linear(n("mlp.up_proj"), l.mlp, l.width, false, Bf16, part);
        s.linear(n("mlp.down_proj"), l.width, l.mlp, false, Bf16, part);
        s.push(
            n("input_layernorm.weight"),
            &[l.width],
            F32,
            ParamKind::RmsNormWeight,
            part,
        );
        s.push(
            n("post_attention_layernorm.weight"),
            &[l.width],
            F32,
            ParamKind::RmsNormWeight,
            part,
        );
    }
    s.push(
        format!("{LANGUAGE}norm.weight"),
        &[l.width],
        F32,
        ParamKind::RmsNormWeight,
        Part::LanguageNorm,
    );
    // Action expert.
    s.push(
        EXPERT_LM_HEAD.into(),
        &[l.vocab, e.width],
        Bf16,
        ParamKind::Matrix { fan_in: e.width },
        Part::ExpertLmHead,
    );
    let (q, kv) = (e.heads * e.head_dim, e.kv_heads * e.head_dim);
    for i in 0..e.depth {
        let n = |x: &str| expert_layer(i, x);
        let part = Part::Expert(i);
        s.linear(n("self_attn.q_proj"), q, e.width, false, Bf16, part);
        s.linear(n("self_attn.k_proj"), kv, e.width, false, Bf16, part);
        s.linear(n("self_attn.v_proj"), kv, e.width, false, Bf16, part);
        s.linear(n("self_attn.o_proj"), e.width, q, false, Bf16, part);
        s.linear(n("mlp.gate_proj"), e.mlp, e.width, false, Bf16, part);
        s.linear(n("mlp.up_proj"), e.mlp, e.width, false, Bf16, part);
        s.linear(n("mlp.down_proj"), e.width, e.mlp, false, Bf16, part);
        s.adarms(n("input_layernorm"), e.width, Part::ExpertAdaRms(i));
        s.adarms(
            n("post_attention_layernorm"),
            e.width,
            Part::ExpertAdaRms(i),
        );
    }
    s.adarms(format!("{EXPERT}norm"), e.width, Part::ExpertNorm);
    // PI05Pytorch heads (always f32).
    s.linear(
        head("action_in_proj"),
        e.width,
        cfg.action_dim,
        true,
        F32,
        Part::ActionProj,
    );
    s.linear(
        head("action_out_proj"),
        cfg.action_dim,
        e.width,
        true,
        F32,
        Part::ActionProj,
    );
    s.linear(
        head("time_mlp_in"),
        e.width,
        e.width,
        true,
        F32,
        Part::TimeMlp,
    );
    s.linear(
        head("time_mlp_out"),
        e.width,
        e.width,
        true,
        F32,
        Part::TimeMlp,
    );
    s.0
}

/// A checkpoint layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layout {
    /// lerobot 0.6.1 `save_pretrained`: 813 tensors, `model.` prefix.
    Lerobot,
    /// Hub / openpi-converted: 812 tensors, text embedding stored as `paligemma.lm_head`.
    Hub {
        /// Whether keys keep the `model.` prefix.
        prefixed: bool,
    },
}

/// The name `canonical` is stored under in `layout` (`None`: not stored at all).
pub fn stored_name(canonical: &str, layout: Layout) -> Option<String> {
    match layout {
        Layout::Lerobot => Some(canonical.to_string()),
        Layout::Hub { prefixed } => {
            let name = if canonical == EMBED_TOKENS {
                PALIGEMMA_LM_HEAD
            } else if canonical == PALIGEMMA_LM_HEAD {
                // Its values are stored, but under this name they mean the embedding; the
                // real (untied) lm_head does not exist in a Hub file.
                return None;
            } else {
                canonical
            };
            Some(if prefixed {
                name.to_string()
            } else {
                name.strip_prefix(MODEL).unwrap_or(name).to_string()
            })
        }
    }
}

/// The tensors a `layout` file holds for `cfg`, with the names as stored, in lerobot order.
/// The Hub layout has 812 for the real config.
pub fn layout_tensors(cfg: &Pi05Config, layout: Layout) -> Vec<TensorSpec> {
    let mut specs = lerobot_tensors(cfg);
    if let Layout::Hub { .. } = layout {
        // The embedding's values live at lm_head's position; drop the embed_tokens entry.
        specs.retain(|t| t.name != EMBED_TOKENS);
        for t in &mut specs {
            if t.name == PALIGEMMA_LM_HEAD {
                t.part = Part::Embed;
                t.kind = ParamKind::Embedding {
                    width: cfg.language.width,
                };
            }
        }
        for t in &mut specs {
            let canonical = if t.part == Part::Embed {
                EMBED_TOKENS
            } else {
                &t.name
            };
            t.name = stored_name(canonical, layout).expect("every Hub tensor has a stored name");
        }
    }
    specs
}

/// `(canonical, stored)` for every canonical name a `layout` file stores under another key;
/// plain data for petite-weights' remapping source. Empty for [`Layout::Lerobot`].
pub fn key_remap(cfg: &Pi05Config, layout: Layout) -> Vec<(String, String)> {
    lerobot_tensors(cfg)
        .into_iter()
        .filter_map(|t| {
            let stored = stored_name(&t.name, layout)?;
            (stored != t.name).then_some((t.name, stored))
        })
        .collect()
}

/// Recognises the layout from a file's key set: `embed_tokens` present → lerobot (if it also
/// has `model.` keys); otherwise Hub, prefixed or not. `None` if no known key is present.
pub fn detect_layout<S: AsRef<str>>(names: &[S]) -> Option<Layout> {
    let has = |n: &str| names.iter().any(|x| x.as_ref() == n);
    let strip = |n: &'static str| n.strip_prefix(MODEL).unwrap_or(n);
    if has(EMBED_TOKENS) {
        Some(Layout::Lerobot)
    } else if has(PALIGEMMA_LM_HEAD) {
        Some(Layout::Hub { prefixed: true })
    } else if has(strip(PALIGEMMA_LM_HEAD)) {
        Some(Layout::Hub { prefixed: false })
    } else {
        None
    }
}

/// Canonical tensors inference reads (811 for the real config): everything but both `lm_head`s.
pub fn inference_tensors(cfg: &Pi05Config) -> Vec<TensorSpec> {
    lerobot_tensors(cfg)
        .into_iter()
        .filter(|t| !matches!(t.part, Part::PaligemmaLmHead | Part::ExpertLmHead))
        .collect()
}

/// Stored names a conversion drops from a `layout` file. lerobot: both `lm_head`s (the
/// PaliGemma one is untied from `embed_tokens` in 0.6.1 and holds other values). Hub: only the
/// expert's — the PaliGemma `lm_head` *is* the text embedding there and must be kept (renamed
/// to `embed_tokens`).
pub fn drop_list(layout: Layout) -> Vec<String> {
    let mut out = vec![];
    for n in [PALIGEMMA_LM_HEAD, EXPERT_LM_HEAD] {
        if layout == Layout::Lerobot || n == EXPERT_LM_HEAD {
            out.push(stored_name(n, layout).expect("lm_heads are stored"));
        }
    }
    out
}
