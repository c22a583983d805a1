//! Test helpers: a minimal safetensors writer (independent of petite-weights, so the tests
//! check our reading against the format itself).
#![allow(dead_code)]

use std::path::Path;

/// One tensor: name, safetensors dtype string, shape, little-endian bytes.
pub struct T {
    pub name: String,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

pub fn f32s(name: &str, shape: &[usize], v: impl IntoIterator<Item = f32>) -> T {
    T {
        name: name.into(),
        dtype: "F32",
        shape: shape.to_vec(),
        bytes: v.into_iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

pub fn raw(name: &str, dtype: &'static str, shape: &[usize], bytes: Vec<u8>) -> T {
    T {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        bytes,
    }
}

pub fn write(path: &Path, tensors: &[T]) {
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for t in tensors {
        header.insert(
            t.name.clone(),
            serde_json::json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [off, off + t.bytes.len()]}),
        );
        off += t.bytes.len();
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    for t in tensors {
        out.extend_from_slice(&t.bytes);
    }
    std::fs::write(path, out).unwrap();
}

/// Valid inputs for `cfg`: deterministic values, last token padded, camera 0 present.
pub fn inputs(cfg: &petite_pi05::Pi05Config) -> Vec<T> {
    let s = cfg.vision.image_size;
    let n_img = cfg.cameras * 3 * s * s;
    let mut token_mask = vec![1u8; cfg.tokens];
    *token_mask.last_mut().unwrap() = 0;
    vec![
        f32s(
            "images",
            &[cfg.cameras, 3, s, s],
            (0..n_img).map(|i| ((i % 13) as f32 / 6.5) - 1.0),
        ),
        raw("image_masks", "U8", &[cfg.cameras], vec![1; cfg.cameras]),
        raw(
            "tokens",
            "I64",
            &[cfg.tokens],
            (0..cfg.tokens as i64)
                .flat_map(|i| (i % cfg.language.vocab as i64).to_le_bytes())
                .collect(),
        ),
        raw("token_mask", "U8", &[cfg.tokens], token_mask),
        f32s(
            "noise",
            &[cfg.chunk, cfg.action_dim],
            (0..cfg.chunk * cfg.action_dim).map(|i| ((i * 7 % 11) as f32 - 5.0) / 3.0),
        ),
    ]
}
