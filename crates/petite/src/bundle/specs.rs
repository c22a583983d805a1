//! The interface checks of the exports that run in another runtime: the `.pte.json` files of
//! portable ones and the `pi05.onnx.json` of ONNX ones, against the config, before anything
//! runs.

use std::collections::HashMap;
use std::path::Path;

use petite_pi05::Pi05Config;
use petite_pi05::programs::io;
use petite_pte::PteFile;

use super::bad;
use super::delegates::method;
use crate::Result;
use crate::layout::METHOD;

/// Whether `dir` holds an ONNX export (`pi05.onnx`) and no `prefix.pte`.
pub fn is_onnx(dir: &Path) -> bool {
    dir.join(crate::layout::ONNX_MODEL).exists() && !dir.join(crate::layout::PREFIX_PTE).exists()
}

/// Checks `pi05.onnx.json` (the interface `petite export --backend onnx` writes) against `cfg`
/// and ONNX Runtime's CPU provider: a bf16 model is refused before anything runs (that
/// provider has no bf16 `Gemm`/`MatMul` kernels: onnxruntime 1.31.1 fails the session with
/// `NOT_IMPLEMENTED ... Gemm(13)`), and every input and the output must have the shapes the
/// config gives, each mismatch one line naming the tensor.
pub fn check_onnx_spec(dir: &Path, cfg: &Pi05Config) -> Result<()> {
    let spec_path = dir.join(crate::layout::ONNX_SPEC);
    let model = dir.join(crate::layout::ONNX_MODEL);
    if !spec_path.exists() {
        return Err(bad(
            &spec_path,
            "missing: ONNX exports are described by the pi05.onnx.json `petite export \
             --backend onnx` writes next to pi05.onnx; re-run the export",
        ));
    }
    let spec = crate::report::read_json(&spec_path)?;
    match spec["dtype"].as_str() {
        Some("f32") => {}
        other => {
            return Err(bad(
                &model,
                format!(
                    "a {} model: ONNX Runtime's CPU provider has no bf16 Gemm/MatMul kernels, so \
                     it is not run; build it with TensorRT (trtexec --onnx={} --stronglyTyped) \
                     or export with --dtype f32 to verify it in ONNX Runtime",
                    other.unwrap_or("(no dtype)"),
                    model.display()
                ),
            ));
        }
    }
    let s = cfg.vision.image_size;
    let want: Vec<(&str, &str, Vec<usize>)> = vec![
        (io::IMAGES, "f32", vec![cfg.cameras, 3, s, s]),
        (io::IMAGE_MASKS, "u8", vec![cfg.cameras]),
        (io::TOKENS, "i64", vec![cfg.tokens]),
        (io::TOKEN_MASK, "u8", vec![cfg.tokens]),
        (io::NOISE, "f32", vec![cfg.chunk, cfg.action_dim]),
        (io::RTC_PREV, "f32", vec![cfg.chunk, cfg.action_dim]),
        (io::RTC_WEIGHTS, "f32", vec![cfg.chunk, 1]),
        (io::RTC_STEPS, "f32", vec![cfg.steps, 2]),
        (io::ACTIONS, "f32", vec![cfg.chunk, cfg.action_dim]),
    ];
    let all: Vec<&serde_json::Value> = ["inputs", "outputs"]
        .iter()
        .flat_map(|k| spec[*k].as_array().into_iter().flatten())
        .collect();
    for (name, dtype, shape) in want {
        let Some(t) = all.iter().find(|t| t["name"] == name) else {
            return Err(bad(
                &spec_path,
                format!("the model has no `{name}`; was it written by another petite?"),
            ));
        };
        let got: Vec<usize> = t["shape"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| d.as_u64().map(|d| d as usize))
            .collect();
        if got != shape || t["dtype"] != dtype {
            return Err(bad(
                &spec_path,
                format!(
                    "`{name}` is {} {got:?}, the config gives {dtype} {shape:?} (was it exported \
                     with another config?)",
                    t["dtype"].as_str().unwrap_or("?")
                ),
            ));
        }
    }
    Ok(())
}

/// Whether `pte`'s `forward` is portable kernel calls (operators, no delegates).
pub fn is_portable(pte: &PteFile) -> bool {
    method(pte, METHOD).is_ok_and(|p| p.delegates.is_empty() && !p.operators.is_empty())
}

/// Checks the `.pte.json` descriptions of portable files against `cfg` (inputs the config fixes),
/// so a mismatch is named here rather than as a reshape error deep in the driver.
pub fn check_specs(pte_dir: &Path, cfg: &Pi05Config) -> Result<()> {
    let s = cfg.vision.image_size;
    let r = petite_pi05::programs::time_row_len(cfg);
    let want: HashMap<&str, Vec<usize>> = [
        (io::IMAGES, vec![cfg.cameras, 3, s, s]),
        (io::IMAGE_MASKS, vec![cfg.cameras]),
        (io::TOKENS, vec![cfg.tokens]),
        (io::TOKEN_MASK, vec![cfg.tokens]),
        (io::X_T, vec![cfg.chunk, cfg.action_dim]),
        (io::TIME_ROW, vec![r]),
        (io::RTC_PREV, vec![cfg.chunk, cfg.action_dim]),
        (io::RTC_WEIGHTS, vec![cfg.chunk, 1]),
        (io::RTC_STEP, vec![2]),
    ]
    .into_iter()
    .collect();
    for f in ["prefix.pte.json", "step.pte.json"] {
        let p = pte_dir.join(f);
        if !p.exists() {
            return Err(bad(
                &p,
                "missing: portable .pte files are described by the .pte.json files \
                 `petite export --backend portable` writes next to them",
            ));
        }
        let spec = crate::report::read_json(&p)?;
        for m in spec["methods"].as_array().into_iter().flatten() {
            for i in m["inputs"].as_array().into_iter().flatten() {
                let name = i["name"].as_str().unwrap_or_default();
                let shape: Vec<usize> = i["shape"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|d| d.as_u64().map(|d| d as usize))
                    .collect();
                if let Some(w) = want.get(name)
                    && *w != shape
                {
                    return Err(bad(
                        &p,
                        format!(
                            "input `{name}` is {shape:?}, the config gives {w:?} (was it \
                             exported with another config?)"
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}
