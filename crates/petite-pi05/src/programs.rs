//! The pi0.5 inference programs as petite-graph graphs: the timestep table, the prefix and the
//! denoising step. Building reads no weight bytes: weights are declared by name, shape and dtype.
//!
//! Numerics follow lerobot 0.6.1 `PI05Pytorch.sample_actions` (pi05-model.md §2–§8): masks,
//! positions and rotary tables are computed inside the programs from their inputs; in
//! [`Precision::Bf16`] the casts sit where lerobot's `dtype="bfloat16"` mode puts them.
//!
//! Interfaces (batch 1, no batch axis on the public inputs):
//! * `timestep_table`: no inputs → `timestep_table` f32 `[steps, R]`: per step, every expert
//!   adaRMS modulation — for each layer `[in_scale, in_shift, in_gate, post_scale, post_shift,
//!   post_gate]` (each `expert.width`), then the final norm's `[scale, shift]`
//!   (R = depth·6·w + 2·w). The final norm's gate is never used, so it is not stored.
//! * `prefix`: `images` f32 `[cameras,3,H,W]`, `image_masks` u8 `[cameras]`, `tokens` i64
//!   `[tokens]`, `token_mask` u8 `[tokens]` → `prefix_k_{i}` / `prefix_v_{i}`
//!   `[1, kv_heads, P, head_dim]` (K after RoPE) for every layer, `prefix_pad_mask` bool `[P]`.
//! * `step`: `x_t` f32 `[chunk, action_dim]`, `time_row` f32 `[R]`, `prefix_k_{i}`,
//!   `prefix_v_{i}`, `prefix_pad_mask`, and real-time chunking's guidance (see
//!   [`crate::rtc`]): `rtc_prev` f32 `[chunk, action_dim]`, `rtc_weights` f32 `[chunk, 1]`,
//!   `rtc_step` f32 `[2]` (`[t, g]`) → `x_next` f32 `[chunk, action_dim]` (the Euler update
//!   `x_t + dt·(v_t − g·(rtc_prev − (x_t − t·v_t))·rtc_weights)` folded in; all zeros is the
//!   plain step, bit for bit).
//! * `policy` ([`build_policy`]): the whole inference as one program — `images`, `image_masks`,
//!   `tokens`, `token_mask`, `noise` f32 `[chunk, action_dim]`, `rtc_prev`, `rtc_weights` and
//!   `rtc_steps` f32 `[steps, 2]` → `actions` f32 `[chunk, action_dim]`: the prefix once, then
//!   the step inlined `steps` times (each weight declared once, so every copy reads the same
//!   one), the timestep table a constant.

use std::collections::HashMap;

use petite_graph::{Builder, Dtype, Program, ValueId};

use crate::config::Pi05Config;
use crate::names::{self, StoredDtype};
use crate::{Error, Result};

/// lerobot's additive mask fill (`OPENPI_ATTENTION_MASK_VALUE`); -inf would turn padded query
/// rows into NaN (§13.11).
pub const MASK_FILL: f64 = -2.3819763e38;

/// Numeric mode of the programs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Everything f32 (lerobot `dtype="float32"`): the parity reference.
    F32,
    /// lerobot's `dtype="bfloat16"` mode: transformer weights and activations bf16; SigLIP,
    /// projector, norms, adaRMS, action/time heads f32 (§8).
    Bf16,
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(format!("expected `f32` or `bf16`, found `{other}`")),
        }
    }
}

/// Input and output names of the programs.
pub mod io {
    /// Prefix input: camera images f32 `[cameras, 3, H, W]` in [-1, 1].
    pub const IMAGES: &str = "images";
    /// Prefix input: u8 `[cameras]`, 1 = present.
    pub const IMAGE_MASKS: &str = "image_masks";
    /// Prefix input: i64 `[tokens]`.
    pub const TOKENS: &str = "tokens";
    /// Prefix input: u8 `[tokens]`, 1 = real token (right padding).
    pub const TOKEN_MASK: &str = "token_mask";
    /// Prefix output / step input: bool `[P]`.
    pub const PREFIX_PAD_MASK: &str = "prefix_pad_mask";
    /// Step input: f32 `[chunk, action_dim]`.
    pub const X_T: &str = "x_t";
    /// Step input: this step's row of the timestep table, f32 `[R]`.
    pub const TIME_ROW: &str = "time_row";
    /// Step output: f32 `[chunk, action_dim]`.
    pub const X_NEXT: &str = "x_next";
    /// Timestep-table output: f32 `[steps, R]`.
    pub const TIMESTEP_TABLE: &str = "timestep_table";
    /// Policy input: x at t = 1, f32 `[chunk, action_dim]`.
    pub const NOISE: &str = "noise";
    /// Step and policy input (RTC): the previous chunk's leftover, zero-padded, f32
    /// `[chunk, action_dim]`.
    pub const RTC_PREV: &str = "rtc_prev";
    /// Step and policy input (RTC): the schedule's weight per row, f32 `[chunk, 1]`.
    pub const RTC_WEIGHTS: &str = "rtc_weights";
    /// Step input (RTC): this step's time and guidance weight, f32 `[2]`.
    pub const RTC_STEP: &str = "rtc_step";
    /// Policy input (RTC): every step's `rtc_step`, f32 `[steps, 2]`.
    pub const RTC_STEPS: &str = "rtc_steps";
    /// Policy output: f32 `[chunk, action_dim]` after the last Euler step (model space).
    pub const ACTIONS: &str = "actions";
    /// Layer `i`'s prefix keys (after RoPE).
    pub fn prefix_k(i: usize) -> String {
        format!("prefix_k_{i}")
    }
    /// Layer `i`'s prefix values.
    pub fn prefix_v(i: usize) -> String {
        format!("prefix_v_{i}")
    }
}

/// Width of one timestep-table row: `depth·6·w + 2·w`.
pub fn time_row_len(cfg: &Pi05Config) -> usize {
    cfg.expert.depth * 6 * cfg.expert.width + 2 * cfg.expert.width
}

/// The time sinusoid lerobot feeds `time_mlp_in`, `[steps, expert.width]`: computed in f64
/// exactly as `create_sinusoidal_pos_embedding` does (torch `linspace`, then `min·(max/min)^f`,
/// `1/period·2·π`, times the f32 timestep), then rounded to f32.
pub fn time_sinusoid(cfg: &Pi05Config) -> Vec<f32> {
    let half = cfg.expert.width / 2;
    // torch.linspace(0, 1, n) in f64: the first half counts up from start, the rest down
    // from end, with step (end - start) / (n - 1).
    let fraction: Vec<f64> = (0..half)
        .map(|i| {
            if half == 1 {
                return 0.0;
            }
            let step = 1.0 / (half - 1) as f64;
            if i < half / 2 {
                i as f64 * step
            } else {
                1.0 - step * (half - 1 - i) as f64
            }
        })
        .collect();
    let (lo, hi) = (cfg.time_min_period, cfg.time_max_period);
    let scaling: Vec<f64> = fraction
        .iter()
        .map(|f| 1.0 / (lo * (hi / lo).powf(*f)) * 2.0 * std::f64::consts::PI)
        .collect();
    let mut out = Vec::with_capacity(cfg.steps * cfg.expert.width);
    for t in cfg.timesteps() {
        let t = t as f64;
        out.extend(scaling.iter().map(|s| (s * t).sin() as f32));
        out.extend(scaling.iter().map(|s| (s * t).cos() as f32));
    }
    out
}

/// RoPE inverse frequencies as the model holds them: f32 `1 / θ^(2j/d)`; in bf16 mode the
/// buffer is rounded to bf16 (lerobot converts buffers too, §8).
pub fn inv_freq(cfg: &Pi05Config, precision: Precision) -> Vec<f32> {
    let d = cfg.language.head_dim;
    (0..d / 2)
        .map(|j| {
            // transformers: arange(0, d, 2).float() / d, then base ** that, then 1.0 / that,
            // all in f32.
            let e = (2 * j) as f32 / d as f32;
            let v = 1.0f32 / (cfg.language.rope_theta as f32).powf(e);
            match precision {
                Precision::F32 => v,
                Precision::Bf16 => petite_dtype::round_through_bf16(v),
            }
        })
        .collect()
}

/// Program-building context: the builder, the checkpoint's shapes and the precision.
struct Ctx {
    b: Builder,
    specs: HashMap<String, (Vec<usize>, StoredDtype)>,
    prec: Precision,
}

impl Ctx {
    fn new(cfg: &Pi05Config, prec: Precision) -> Result<Self> {
        cfg.validate()?;
        let specs = names::lerobot_tensors(cfg)
            .into_iter()
            .map(|t| (t.name, (t.shape, t.bf16_mode_dtype)))
            .collect();
        Ok(Ctx {
            b: Builder::new(),
            specs,
            prec,
        })
    }

    /// Dtype of transformer activations.
    fn act(&self) -> Dtype {
        match self.prec {
            Precision::F32 => Dtype::F32,
            Precision::Bf16 => Dtype::Bf16,
        }
    }

    /// Declares checkpoint tensor `name` with its real shape, in the dtype this precision
    /// computes with (f32, or lerobot's bf16-mode dtype).
    fn weight(&mut self, name: &str) -> Result<ValueId> {
        let (shape, dtype) = self.weight_decl(name)?;
        Ok(self.b.weight(name, dtype, &shape)?)
    }

    /// Shape and program dtype of checkpoint tensor `name` (see [`Ctx::weight`]).
    fn weight_decl(&self, name: &str) -> Result<(Vec<usize>, Dtype)> {
        let (shape, stored) = self
            .specs
            .get(name)
            .ok_or_else(|| Error::UnknownWeight(name.to_string()))?;
        let dtype = match (self.prec, stored) {
            (Precision::Bf16, StoredDtype::Bf16) => Dtype::Bf16,
            _ => Dtype::F32,
        };
        Ok((shape.clone(), dtype))
    }

    fn linear(&mut self, x: ValueId, prefix: &str, bias: bool) -> Result<ValueId> {
        let w = self.weight(&format!("{prefix}.weight"))?;
        let bias = if bias {
            Some(self.weight(&format!("{prefix}.bias"))?)
        } else {
            None
        };
        Ok(self.b.linear(x, w, bias)?)
    }

    fn cast(&mut self, x: ValueId, to: Dtype) -> Result<ValueId> {
        if self.b.dtype(x)? == to {
            Ok(x)
        } else {
            Ok(self.b.cast(x, to)?)
        }
    }

    /// `[1, S, n·d]` → `[1, n, S, d]`.
    fn split_heads(&mut self, x: ValueId, n: usize, d: usize) -> Result<ValueId> {
        let s = self.b.shape(x)?[1];
        let r = self.b.reshape(x, &[1, s, n, d])?;
        Ok(self.b.permute(r, &[0, 2, 1, 3])?)
    }

    /// `[1, n, S, d]` → `[1, S, n·d]`.
    fn merge_heads(&mut self, x: ValueId) -> Result<ValueId> {
        let sh = self.b.shape(x)?.to_vec();
        let p = self.b.permute(x, &[0, 2, 1, 3])?;
        Ok(self.b.reshape(p, &[1, sh[2], sh[1] * sh[3]])?)
    }

    /// cos/sin tables `[1, 1, S, d]` in the activation dtype for i64 positions `[S]`
    /// (transformers' default rotary embedding: f32 `inv_freq ⊗ pos`, duplicated halves).
    fn rope_tables(&mut self, cfg: &Pi05Config, positions: ValueId) -> Result<(ValueId, ValueId)> {
        let d = cfg.language.head_dim;
        let s = self.b.shape(positions)?[0];
        let inv = inv_freq(cfg, self.prec);
        let inv = self.b.constant_f32(&[1, d / 2], &inv)?;
        let pos = self.b.cast(positions, Dtype::F32)?;
        let pos = self.b.reshape(pos, &[s, 1])?;
        let freqs = self.b.mul(pos, inv)?;
        let emb = self.b.concat(&[freqs, freqs], -1)?;
        let mut out = [emb; 2];
        for (k, o) in out.iter_mut().enumerate() {
            let t = if k == 0 {
                self.b.cos(emb)?
            } else {
                self.b.sin(emb)?
            };
            let t = self.cast(t, self.act())?;
            let t = self.b.reshape(t, &[1, 1, s, d])?;
            // Never crosses an engine boundary: each engine rebuilds it from the positions.
            *o = self.b.mark_recompute(t)?;
        }
        Ok((out[0], out[1]))
    }

    /// Additive f32 mask `[1, 1, Q, K]` from a bool "may attend" matrix `[Q, K]`.
    fn additive_mask(&mut self, allowed: ValueId) -> Result<ValueId> {
        let sh = self.b.shape(allowed)?.to_vec();
        let zero = self.b.scalar(Dtype::F32, 0.0)?;
        let fill = self.b.scalar(Dtype::F32, MASK_FILL)?;
        let m = self.b.select(allowed, zero, fill)?;
        let m = self.b.reshape(m, &[1, 1, sh[0], sh[1]])?;
        // Never crosses an engine boundary: each engine rebuilds it from the inputs.
        Ok(self.b.mark_recompute(m)?)
    }

    /// Rotary embedding. bf16 activations follow torch's eager op order
    /// (`x·cos + rotate_half(x)·sin`, each op rounded to bf16); f32 uses the fused op.
    fn rope(&mut self, x: ValueId, cos: ValueId, sin: ValueId) -> Result<ValueId> {
        if self.b.dtype(x)? != Dtype::Bf16 {
            return Ok(self.b.rope(x, cos, sin)?);
        }
        let d = *self.b.shape(x)?.last().expect("rank 4") as isize;
        let x1 = self.b.slice(x, -1, 0, d / 2, 1)?;
        let x2 = self.b.slice(x, -1, d / 2, d, 1)?;
        let n2 = self.b.neg(x2)?;
        let rot = self.b.concat(&[n2, x1], -1)?;
        let a = self.b.mul(x, cos)?;
        let r = self.b.mul(rot, sin)?;
        Ok(self.b.add(a, r)?)
    }

    /// Attention with an additive f32 mask. f32 uses the fused op; bf16 follows transformers'
    /// eager attention: `q·kᵀ` and the scaling rounded to bf16, `+ mask` and softmax in f32,
    /// probabilities rounded to bf16, `p·v` in bf16 (KV heads repeated for GQA).
    fn attend(
        &mut self,
        q: ValueId,
        k: ValueId,
        v: ValueId,
        mask: Option<ValueId>,
        scale: f64,
    ) -> Result<ValueId> {
        if self.b.dtype(q)? != Dtype::Bf16 {
            return Ok(self.b.attention(q, k, v, mask, scale)?);
        }
        let h = self.b.shape(q)?[1];
        let ks = self.b.shape(k)?.to_vec();
        let rep = h / ks[1];
        let repeat = |c: &mut Ctx, t: ValueId| -> Result<ValueId> {
            if rep == 1 {
                return Ok(t);
            }
            let sh = c.b.shape(t)?.to_vec();
            let r = c.b.reshape(t, &[sh[0], sh[1], 1, sh[2], sh[3]])?;
            let r = c.b.expand(r, &[sh[0], sh[1], rep, sh[2], sh[3]])?;
            Ok(c.b.reshape(r, &[sh[0], sh[1] * rep, sh[2], sh[3]])?)
        };
        let k = repeat(self, k)?;
        let v = repeat(self, v)?;
        let kt = self.b.transpose(k, 2, 3)?;
        let logits = self.b.matmul(q, kt)?;
        let logits = self.b.mul_scalar(logits, scale)?;
        let mut logits = self.b.cast(logits, Dtype::F32)?;
        if let Some(m) = mask {
            logits = self.b.add(logits, m)?;
        }
        let p = self.b.softmax(logits, -1)?;
        let p = self.b.cast(p, Dtype::Bf16)?;
        Ok(self.b.matmul(p, v)?)
    }

    /// Gated MLP `down(gelu_tanh(gate(x)) · up(x))`.
    fn gemma_mlp(&mut self, x: ValueId, prefix: &str) -> Result<ValueId> {
        let g = self.linear(x, &format!("{prefix}.gate_proj"), false)?;
        let g = self.b.gelu_tanh(g)?;
        let u = self.linear(x, &format!("{prefix}.up_proj"), false)?;
        let h = self.b.mul(g, u)?;
        self.linear(h, &format!("{prefix}.down_proj"), false)
    }

    /// adaRMS: `(rms(x)·(1 + scale) + shift)` computed in f32, cast to x's dtype.
    fn ada_rms(&mut self, x: ValueId, eps: f64, scale: ValueId, shift: ValueId) -> Result<ValueId> {
        let dt = self.b.dtype(x)?;
        let xf = self.cast(x, Dtype::F32)?;
        let n = self.b.rms_norm(xf, None, eps)?;
        let s1 = self.b.add_scalar(scale, 1.0)?;
        let n = self.b.mul(n, s1)?;
        let n = self.b.add(n, shift)?;
        self.cast(n, dt)
    }
}

/// Builds the timestep-table program (see the module doc for its layout).
pub fn build_timestep_table(cfg: &Pi05Config, precision: Precision) -> Result<Program> {
    let mut c = Ctx::new(cfg, precision)?;
    let w = cfg.expert.width;
    let emb = time_sinusoid(cfg);
    c.b.push_scope("time");
    let emb = c.b.constant_f32(&[cfg.steps, w], &emb)?;
    // time_mlp_* are f32 in both modes.
    let h = c.linear(emb, &names::head("time_mlp_in"), true)?;
    let h = c.b.silu(h)?;
    let h = c.linear(h, &names::head("time_mlp_out"), true)?;
    let cond = c.b.silu(h)?;
    c.b.pop_scope();
    let mut parts = Vec::with_capacity(2 * cfg.expert.depth + 1);
    for i in 0..cfg.expert.depth {
        c.b.push_scope(format!("expert.layers.{i}"));
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            let m = c.linear(
                cond,
                &names::expert_layer(i, &format!("{norm}.dense")),
                true,
            )?;
            parts.push(m);
        }
        c.b.pop_scope();
    }
    c.b.push_scope("expert.norm");
    let m = c.linear(cond, &format!("{}norm.dense", names::EXPERT), true)?;
    let m = c.b.slice(m, 1, 0, (2 * w) as isize, 1)?;
    c.b.pop_scope();
    parts.push(m);
    let table = c.b.concat(&parts, 1)?;
    c.b.output(io::TIMESTEP_TABLE, table)?;
    Ok(c.b.finish()?)
}

/// Default [`PrefixOptions::max_embedding_shard_bytes`]: 64 MiB, the size of pi0.5's largest
/// other bf16 weight (a Gemma MLP matrix, `[16384, 2048]`), so the embedding shards are no
/// harder to place under an engine cap than the layers are. pi0.5's table (1004.5 MiB in bf16)
/// becomes 16 shards (32 in f32); every small config's table fits in one.
pub const DEFAULT_EMBEDDING_SHARD_BYTES: usize = 64 << 20;

/// Options of the prefix program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixOptions {
    /// Largest row shard of the token embedding table, in bytes of the program's dtype for it:
    /// a larger table is read as row ranges ([`petite_graph::Builder::embedding_sharded`]) so
    /// that no engine has to hold all of it. A table that fits stays one plain embedding.
    pub max_embedding_shard_bytes: usize,
}

impl Default for PrefixOptions {
    fn default() -> Self {
        PrefixOptions {
            max_embedding_shard_bytes: DEFAULT_EMBEDDING_SHARD_BYTES,
        }
    }
}

/// Builds the prefix program: SigLIP + projector + text embedding + the language model up to
/// the last layer's K/V, with the default [`PrefixOptions`].
pub fn build_prefix(cfg: &Pi05Config, precision: Precision) -> Result<Program> {
    build_prefix_with(cfg, precision, &PrefixOptions::default())
}

/// [`build_prefix`] with explicit options.
pub fn build_prefix_with(
    cfg: &Pi05Config,
    precision: Precision,
    opts: &PrefixOptions,
) -> Result<Program> {
    let mut c = Ctx::new(cfg, precision)?;
    let v = &cfg.vision;
    let l = &cfg.language;
    let (cams, np, vh) = (cfg.cameras, cfg.patches(), v.hidden);
    let images = c.b.input(
        io::IMAGES,
        Dtype::F32,
        &[cams, 3, v.image_size, v.image_size],
    )?;
    let image_masks = c.b.input(io::IMAGE_MASKS, Dtype::U8, &[cams])?;
    let tokens = c.b.input(io::TOKENS, Dtype::I64, &[cfg.tokens])?;
    let token_mask = c.b.input(io::TOKEN_MASK, Dtype::U8, &[cfg.tokens])?;

    // ---- SigLIP (f32 in both modes), all cameras as one batch.
    c.b.push_scope("vision");
    let pw = c.weight(&names::vision("embeddings.patch_embedding.weight"))?;
    let pb = c.weight(&names::vision("embeddings.patch_embedding.bias"))?;
    let p = v.patch_size;
    let x = c.b.conv2d(images, pw, Some(pb), [p, p], [0, 0])?;
    let x = c.b.reshape(x, &[cams, vh, np])?;
    let x = c.b.permute(x, &[0, 2, 1])?;
    let pos = c.weight(&names::vision("embeddings.position_embedding.weight"))?;
    let mut x = c.b.add(x, pos)?;
    let (vheads, vhd) = (v.heads, cfg.vision_head_dim());
    for i in 0..v.layers {
        c.b.push_scope(format!("layers.{i}"));
        let n = |s: &str| names::vision_layer(i, s);
        let lw = c.weight(&n("layer_norm1.weight"))?;
        let lb = c.weight(&n("layer_norm1.bias"))?;
        let h = c.b.layer_norm(x, lw, lb, v.eps)?;
        let mut qkv = [h; 3];
        for (k, proj) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
            let t = c.linear(h, &n(&format!("self_attn.{proj}")), true)?;
            let t = c.b.reshape(t, &[cams, np, vheads, vhd])?;
            qkv[k] = c.b.permute(t, &[0, 2, 1, 3])?;
        }
        let a = c.attend(qkv[0], qkv[1], qkv[2], None, (vhd as f64).powf(-0.5))?;
        let a = c.b.permute(a, &[0, 2, 1, 3])?;
        let a = c.b.reshape(a, &[cams, np, vh])?;
        let a = c.linear(a, &n("self_attn.out_proj"), true)?;
        x = c.b.add(x, a)?;
        let lw = c.weight(&n("layer_norm2.weight"))?;
        let lb = c.weight(&n("layer_norm2.bias"))?;
        let h = c.b.layer_norm(x, lw, lb, v.eps)?;
        let h = c.linear(h, &n("mlp.fc1"), true)?;
        let h = c.b.gelu_tanh(h)?;
        let h = c.linear(h, &n("mlp.fc2"), true)?;
        x = c.b.add(x, h)?;
        c.b.pop_scope();
    }
    let lw = c.weight(&names::vision("post_layernorm.weight"))?;
    let lb = c.weight(&names::vision("post_layernorm.bias"))?;
    let x = c.b.layer_norm(x, lw, lb, v.eps)?;
    c.b.pop_scope();
    c.b.push_scope("projector");
    let img = c.linear(
        x,
        "model.paligemma_with_expert.paligemma.model.multi_modal_projector.linear",
        true,
    )?;
    let img = c.b.reshape(img, &[cams * np, l.width])?;
    c.b.pop_scope();

    // ---- Text embedding × √width in the table's dtype (45.25 in bf16).
    c.b.push_scope("embed");
    let (shape, dtype) = c.weight_decl(names::EMBED_TOKENS)?;
    let t = c.b.embedding_sharded(
        names::EMBED_TOKENS,
        dtype,
        &shape,
        tokens,
        opts.max_embedding_shard_bytes,
    )?;
    let t = c.b.mul_scalar(t, (l.width as f64).sqrt())?;
    // The concat promotes to f32 (image features are f32).
    let t = c.cast(t, Dtype::F32)?;
    let x = c.b.concat(&[img, t], 0)?;
    let plen = cfg.prefix_len();
    let x = c.b.reshape(x, &[1, plen, l.width])?;
    // The language model casts its input to its weights' dtype.
    let mut x = c.cast(x, c.act())?;
    c.b.pop_scope();

    // ---- Pad mask, positions, 2-D mask (prefix-LM: all valid tokens see each other).
    c.b.push_scope("masks");
    let im = c.b.cast(image_masks, Dtype::Bool)?;
    let im = c.b.reshape(im, &[cams, 1])?;
    let im = c.b.expand(im, &[cams, np])?;
    let im = c.b.reshape(im, &[cams * np])?;
    let tm = c.b.cast(token_mask, Dtype::Bool)?;
    let pad = c.b.concat(&[im, tm], 0)?;
    let pad_i = c.b.cast(pad, Dtype::I64)?;
    let cum = c.b.cumsum(pad_i, 0)?;
    let positions = c.b.sub_scalar(cum, 1.0)?;
    let rows = c.b.reshape(pad, &[plen, 1])?;
    let cols = c.b.reshape(pad, &[1, plen])?;
    let allowed = c.b.and(rows, cols)?;
    let mask = c.additive_mask(allowed)?;
    let (cos, sin) = c.rope_tables(cfg, positions)?;
    c.b.pop_scope();

    // ---- Language model; only K/V leave, so the last layer stops after them.
    let (h, kvh, hd) = (l.heads, l.kv_heads, l.head_dim);
    for i in 0..l.depth {
        c.b.push_scope(format!("language.layers.{i}"));
        let n = |s: &str| names::language_layer(i, s);
        let nw = c.weight(&n("input_layernorm.weight"))?;
        let hn = c.b.rms_norm(x, Some(nw), l.eps)?;
        let k = c.linear(hn, &n("self_attn.k_proj"), false)?;
        let k = c.split_heads(k, kvh, hd)?;
        let k = c.rope(k, cos, sin)?;
        let vv = c.linear(hn, &n("self_attn.v_proj"), false)?;
        let vv = c.split_heads(vv, kvh, hd)?;
        c.b.output(&io::prefix_k(i), k)?;
        c.b.output(&io::prefix_v(i), vv)?;
        if i + 1 < l.depth {
            let q = c.linear(hn, &n("self_attn.q_proj"), false)?;
            let q = c.split_heads(q, h, hd)?;
            let q = c.rope(q, cos, sin)?;
            let a = c.attend(q, k, vv, Some(mask), (hd as f64).powf(-0.5))?;
            let a = c.merge_heads(a)?;
            let a = c.linear(a, &n("self_attn.o_proj"), false)?;
            x = c.b.add(x, a)?;
            let nw = c.weight(&n("post_attention_layernorm.weight"))?;
            let hn = c.b.rms_norm(x, Some(nw), l.eps)?;
            let m = c.gemma_mlp(hn, &n("mlp"))?;
            x = c.b.add(x, m)?;
        }
        c.b.pop_scope();
    }
    c.b.output(io::PREFIX_PAD_MASK, pad)?;
    Ok(c.b.finish()?)
}

/// Builds the step program: one Euler step of the action expert over the prefix K/V.
pub fn build_step(cfg: &Pi05Config, precision: Precision) -> Result<Program> {
    let mut c = Ctx::new(cfg, precision)?;
    let e = &cfg.expert;
    let (w, chunk, plen) = (e.width, cfg.chunk, cfg.prefix_len());
    let (h, kvh, hd) = (e.heads, e.kv_heads, e.head_dim);
    let act = c.act();
    let x_t = c.b.input(io::X_T, Dtype::F32, &[chunk, cfg.action_dim])?;
    let row = c.b.input(io::TIME_ROW, Dtype::F32, &[time_row_len(cfg)])?;
    let mut pk = Vec::with_capacity(e.depth);
    let mut pv = Vec::with_capacity(e.depth);
    for i in 0..e.depth {
        pk.push(c.b.input(&io::prefix_k(i), act, &[1, kvh, plen, hd])?);
        pv.push(c.b.input(&io::prefix_v(i), act, &[1, kvh, plen, hd])?);
    }
    let pad = c.b.input(io::PREFIX_PAD_MASK, Dtype::Bool, &[plen])?;
    let rtc_prev =
        c.b.input(io::RTC_PREV, Dtype::F32, &[chunk, cfg.action_dim])?;
    let rtc_weights = c.b.input(io::RTC_WEIGHTS, Dtype::F32, &[chunk, 1])?;
    let rtc_step = c.b.input(io::RTC_STEP, Dtype::F32, &[2])?;

    // Slice `row` at block `k` (each `w` wide).
    let block = |c: &mut Ctx, k: usize| -> Result<ValueId> {
        Ok(c.b.slice(row, 0, (k * w) as isize, ((k + 1) * w) as isize, 1)?)
    };

    c.b.push_scope("masks");
    // Action tokens see every valid prefix token and each other (one block).
    let cols = c.b.reshape(pad, &[1, plen])?;
    let cols = c.b.expand(cols, &[chunk, plen])?;
    let ones = c.b.full(Dtype::Bool, &[chunk, chunk], 1.0)?;
    let allowed = c.b.concat(&[cols, ones], 1)?;
    let mask = c.additive_mask(allowed)?;
    let pad_i = c.b.cast(pad, Dtype::I64)?;
    let offset = c.b.sum(pad_i, &[0], false)?;
    let ar = c.b.arange_i64(chunk)?;
    let positions = c.b.add(ar, offset)?;
    let (cos, sin) = c.rope_tables(cfg, positions)?;
    c.b.pop_scope();

    c.b.push_scope("action_in");
    let a = c.linear(x_t, &names::head("action_in_proj"), true)?;
    let a = c.b.reshape(a, &[1, chunk, w])?;
    let mut x = c.cast(a, act)?;
    c.b.pop_scope();

    for i in 0..e.depth {
        c.b.push_scope(format!("expert.layers.{i}"));
        let n = |s: &str| names::expert_layer(i, s);
        let base = 6 * i;
        let (s1, t1, g1) = (
            block(&mut c, base)?,
            block(&mut c, base + 1)?,
            block(&mut c, base + 2)?,
        );
        let hn = c.ada_rms(x, e.eps, s1, t1)?;
        let g1 = c.cast(g1, act)?;
        let q = c.linear(hn, &n("self_attn.q_proj"), false)?;
        let q = c.split_heads(q, h, hd)?;
        let q = c.rope(q, cos, sin)?;
        let k = c.linear(hn, &n("self_attn.k_proj"), false)?;
        let k = c.split_heads(k, kvh, hd)?;
        let k = c.rope(k, cos, sin)?;
        let vv = c.linear(hn, &n("self_attn.v_proj"), false)?;
        let vv = c.split_heads(vv, kvh, hd)?;
        let k = c.b.concat(&[pk[i], k], 2)?;
        let vv = c.b.concat(&[pv[i], vv], 2)?;
        let att = c.attend(q, k, vv, Some(mask), (hd as f64).powf(-0.5))?;
        let att = c.merge_heads(att)?;
        let o = c.linear(att, &n("self_attn.o_proj"), false)?;
        let o = c.b.mul(o, g1)?;
        x = c.b.add(x, o)?;
        let (s2, t2, g2) = (
            block(&mut c, base + 3)?,
            block(&mut c, base + 4)?,
            block(&mut c, base + 5)?,
        );
        let hn = c.ada_rms(x, e.eps, s2, t2)?;
        let g2 = c.cast(g2, act)?;
        let m = c.gemma_mlp(hn, &n("mlp"))?;
        let m = c.b.mul(m, g2)?;
        x = c.b.add(x, m)?;
        c.b.pop_scope();
    }

    c.b.push_scope("action_out");
    let base = 6 * e.depth;
    let (s, t) = (block(&mut c, base)?, block(&mut c, base + 1)?);
    let y = c.ada_rms(x, e.eps, s, t)?;
    let y = c.cast(y, Dtype::F32)?;
    let y = c.b.reshape(y, &[chunk, w])?;
    let v = c.linear(y, &names::head("action_out_proj"), true)?;
    // RTC guidance, in lerobot's order of operations: x1 = x_t − t·v; err = (prev − x1)·w;
    // v ← v − g·err. Zeros make it `v − 0 = v`.
    c.b.push_scope("rtc");
    let t = c.b.slice(rtc_step, 0, 0, 1, 1)?;
    let t = c.b.reshape(t, &[1, 1])?;
    let g = c.b.slice(rtc_step, 0, 1, 2, 1)?;
    let g = c.b.reshape(g, &[1, 1])?;
    let tv = c.b.mul(v, t)?;
    let x1 = c.b.sub(x_t, tv)?;
    let err = c.b.sub(rtc_prev, x1)?;
    let err = c.b.mul(err, rtc_weights)?;
    let correction = c.b.mul(err, g)?;
    let v = c.b.sub(v, correction)?;
    c.b.pop_scope();
    let dv = c.b.mul_scalar(v, cfg.dt() as f64)?;
    let x_next = c.b.add(x_t, dv)?;
    c.b.pop_scope();
    c.b.output(io::X_NEXT, x_next)?;
    Ok(c.b.finish()?)
}

/// All three programs of one config.
#[derive(Debug, Clone)]
pub struct Programs {
    /// The timestep table (run once).
    pub timestep_table: Program,
    /// The prefix (run once per observation).
    pub prefix: Program,
    /// One denoising step (run `steps` times).
    pub step: Program,
}

/// Builds all three programs.
pub fn build_all(cfg: &Pi05Config, precision: Precision) -> Result<Programs> {
    Ok(Programs {
        timestep_table: build_timestep_table(cfg, precision)?,
        prefix: build_prefix(cfg, precision)?,
        step: build_step(cfg, precision)?,
    })
}

/// The whole policy as one program (interface in the module doc): `progs.prefix` once, then
/// `progs.step` inlined `cfg.steps` times ([`Builder::inline`], which declares each weight once,
/// so the ten steps share theirs), step `k` reading row `k` of `table` — the f32 `[steps, R]`
/// timestep table, computed beforehand (it depends on the weights only) and stored as one
/// constant. Runs exactly what [`crate::run::run_model`] orchestrates, as one graph.
pub fn build_policy(cfg: &Pi05Config, progs: &Programs, table: &[f32]) -> Result<Program> {
    let r = time_row_len(cfg);
    if table.len() != cfg.steps * r {
        return Err(Error::Internal(format!(
            "timestep table: expected {} x {r} values, found {}",
            cfg.steps,
            table.len()
        )));
    }
    let mut b = Builder::new();
    let mut bound: std::collections::BTreeMap<&str, ValueId> = Default::default();
    for &id in &progs.prefix.inputs {
        let name = progs.prefix.input_name(id).unwrap_or_default();
        let t = progs
            .prefix
            .node(id)
            .tensor()
            .ok_or_else(|| Error::Internal(format!("prefix input `{name}` is not a tensor")))?;
        bound.insert(name, b.input(name, t.dtype, &t.shape)?);
    }
    let noise = b.input(io::NOISE, Dtype::F32, &[cfg.chunk, cfg.action_dim])?;
    let rtc_prev = b.input(io::RTC_PREV, Dtype::F32, &[cfg.chunk, cfg.action_dim])?;
    let rtc_weights = b.input(io::RTC_WEIGHTS, Dtype::F32, &[cfg.chunk, 1])?;
    let rtc_steps = b.input(io::RTC_STEPS, Dtype::F32, &[cfg.steps, 2])?;
    let prefix_out = b.inline(&progs.prefix, &bound, "prefix")?;
    b.push_scope("timestep_table");
    let tab = b.constant_f32(&[cfg.steps, r], table)?;
    b.pop_scope();
    let mut x = noise;
    for k in 0..cfg.steps {
        let scope = format!("step.{k}");
        b.push_scope(&scope);
        let row = b.slice(tab, 0, k as isize, k as isize + 1, 1)?;
        let row = b.reshape(row, &[r])?;
        let rtc_step = b.slice(rtc_steps, 0, k as isize, k as isize + 1, 1)?;
        let rtc_step = b.reshape(rtc_step, &[2])?;
        b.pop_scope();
        let mut ins: std::collections::BTreeMap<&str, ValueId> =
            prefix_out.iter().map(|(n, &v)| (n.as_str(), v)).collect();
        ins.insert(io::X_T, x);
        ins.insert(io::TIME_ROW, row);
        ins.insert(io::RTC_PREV, rtc_prev);
        ins.insert(io::RTC_WEIGHTS, rtc_weights);
        ins.insert(io::RTC_STEP, rtc_step);
        let out = b.inline(&progs.step, &ins, &scope)?;
        x = *out
            .get(io::X_NEXT)
            .ok_or_else(|| Error::Internal("step program has no x_next output".into()))?;
    }
    b.output(io::ACTIONS, x)?;
    Ok(b.finish()?)
}
