//! The inputs of a verification: seeded ones (the safetensors file the drivers read is
//! [`crate::bundle`]'s).

use petite_pi05::Pi05Config;
use petite_pi05::inputs::Inputs;

/// Deterministic inputs for `cfg`: images uniform in [-1, 1], every camera present, tokens
/// uniform over the vocabulary with the last quarter padded, noise standard normal.
pub fn seeded_inputs(cfg: &Pi05Config, seed: u64) -> Inputs {
    let mut state = seed ^ 0x6a09_e667_f3bc_c909;
    let mut next = move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut unit = move || (next() >> 11) as f64 / (1u64 << 53) as f64;
    let s = cfg.vision.image_size;
    let images = (0..cfg.cameras * 3 * s * s)
        .map(|_| (unit() * 2.0 - 1.0) as f32)
        .collect();
    let real = (cfg.tokens - cfg.tokens / 4).max(1);
    let tokens = (0..cfg.tokens)
        .map(|_| ((unit() * cfg.language.vocab as f64) as i64).min(cfg.language.vocab as i64 - 1))
        .collect();
    let token_mask = (0..cfg.tokens).map(|i| u8::from(i < real)).collect();
    let noise = (0..cfg.chunk * cfg.action_dim)
        .map(|_| {
            let (u1, u2) = (unit().max(1e-300), unit());
            ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
        })
        .collect();
    Inputs {
        images,
        image_masks: vec![1; cfg.cameras],
        tokens,
        token_mask,
        noise,
        guidance: petite_pi05::rtc::Guidance::none(cfg),
    }
}
