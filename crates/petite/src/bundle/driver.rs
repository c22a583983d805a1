//! Driver scripts embedded in this binary, run in a runtime's Python child: ONNX Runtime for
//! `pi05.onnx`, ExecuTorch's runtime for portable `.pte` files.

use std::path::{Path, PathBuf};

use petite_pi05::Pi05Config;
use petite_pi05::inputs::Inputs;
use petite_pi05::programs::io;
use petite_weights::{FileIdentity, Role};

use super::bad;
use super::specs::{check_onnx_spec, check_specs};
use crate::{Error, Result};

/// The ONNX Runtime driver: the whole policy in one `session.run`.
const ORT_DRIVER_PY: &str = include_str!("../../../../conformance/onnxruntime/run_pi05_onnx.py");

/// The actions of the ONNX Runtime driver's JSON line: numbers, and `"nan"`/`"inf"`/`"-inf"` for
/// what JSON cannot hold (kept as such, so the shared fold fails on them naming the index).
/// `None` when it is not a list of those.
fn driver_actions(v: &serde_json::Value) -> Option<Vec<f32>> {
    v.as_array()?
        .iter()
        .map(|x| match x {
            serde_json::Value::Number(n) => n.as_f64().map(|f| f as f32),
            serde_json::Value::String(s) => s.parse::<f32>().ok().filter(|f| !f.is_finite()),
            _ => None,
        })
        .collect()
}

/// Runs `pi05.onnx` in ONNX Runtime: a separate Python process (`python`) running the driver
/// embedded in this binary, one `session.run` for the whole policy. Returns the actions and the
/// driver's JSON line (without the actions).
pub fn run_onnx(
    dir: &Path,
    cfg: &Pi05Config,
    inputs: &Inputs,
    inputs_file: Option<&Path>,
    python: &Path,
) -> Result<(Vec<f32>, serde_json::Value)> {
    check_onnx_spec(dir, cfg)?;
    let model = dir.join(crate::layout::ONNX_MODEL);
    // The model's files are the files that ran only if they are the same at the end.
    let ids: Vec<(PathBuf, FileIdentity)> = [crate::layout::ONNX_MODEL, crate::layout::ONNX_DATA]
        .iter()
        .map(|n| {
            let p = dir.join(n);
            let md = std::fs::metadata(&p).map_err(|e| Error::io(&p, "stat", e))?;
            Ok((p, FileIdentity::of(&md)))
        })
        .collect::<Result<_>>()?;
    let run = DriverRun {
        scripts: &[("run_pi05_onnx.py", ORT_DRIVER_PY)],
        runtime: "ONNX Runtime",
        start: "start the ONNX Runtime driver",
        // The driver's own refusals are one line; ONNX Runtime's failures end its traceback.
        error_lines: 1,
        blame_run: &model,
        blame_actions: &model,
    };
    let out = run.run(dir, cfg, inputs, inputs_file, python)?;
    for (p, id) in &ids {
        id.check(p, Role::Program)?;
    }
    Ok(out)
}

/// One run of a driver script embedded in this binary, in a runtime's Python child.
struct DriverRun<'a> {
    /// `(file name, text)` written to a scratch directory; the first is run.
    scripts: &'a [(&'a str, &'a str)],
    /// The runtime's name, for errors.
    runtime: &'a str,
    /// What failed when the child cannot start (`start the … driver`).
    start: &'static str,
    /// How many of stderr's last lines an error quotes.
    error_lines: usize,
    /// The file a failed run, and a missing or misshapen result, is reported against.
    blame_run: &'a Path,
    blame_actions: &'a Path,
}

impl DriverRun<'_> {
    /// `SCRIPT TARGET --inputs FILE --print-actions` (the inputs written from `inputs` when no
    /// file is given); returns the actions — `cfg.chunk × cfg.action_dim` of them, a NaN or inf
    /// kept as such — and the driver's JSON line without them, plus the Python used.
    fn run(
        &self,
        target: &Path,
        cfg: &Pi05Config,
        inputs: &Inputs,
        inputs_file: Option<&Path>,
        python: &Path,
    ) -> Result<(Vec<f32>, serde_json::Value)> {
        let tmp = std::env::temp_dir();
        // Removed when dropped, however this run ends.
        let dir = tempfile::Builder::new()
            .prefix("petite-verify-")
            .tempdir_in(&tmp)
            .map_err(|e| Error::io(&tmp, "create a scratch directory in", e))?;
        let scratch = dir.path();
        for (name, text) in self.scripts {
            let p = scratch.join(name);
            std::fs::write(&p, text).map_err(|e| Error::io(&p, "write driver", e))?;
        }
        let inputs_path = match inputs_file {
            Some(p) => p.to_path_buf(),
            None => {
                let p = scratch.join("inputs.safetensors");
                write_inputs(&p, cfg, inputs)?;
                p
            }
        };
        let out = std::process::Command::new(python)
            .arg(scratch.join(self.scripts[0].0))
            .arg(target)
            .arg("--inputs")
            .arg(&inputs_path)
            .arg("--print-actions")
            .output()
            .map_err(|e| Error::io(python, self.start, e))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let mut tail: Vec<&str> = (err.lines().rev())
                .filter(|l| !l.trim().is_empty())
                .take(self.error_lines)
                .map(str::trim_end)
                .collect();
            tail.reverse();
            return Err(bad(
                self.blame_run,
                format!(
                    "{} failed ({}; {}): {}",
                    self.runtime,
                    out.status,
                    python.display(),
                    tail.join("\n").trim()
                ),
            ));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout.lines().last().unwrap_or("");
        let mut j: serde_json::Value = serde_json::from_str(line)?;
        let actions = driver_actions(&j["actions"])
            .ok_or_else(|| bad(self.blame_actions, "the driver returned no actions"))?;
        if actions.len() != cfg.chunk * cfg.action_dim {
            return Err(bad(
                self.blame_actions,
                format!(
                    "{} actions, the config has chunk {} x action_dim {}",
                    actions.len(),
                    cfg.chunk,
                    cfg.action_dim
                ),
            ));
        }
        if let Some(o) = j.as_object_mut() {
            o.remove("actions");
            o.insert("python".into(), python.display().to_string().into());
        }
        Ok((actions, j))
    }
}

/// The runner every portable driver shares (conformance/executorch is the one source).
const ET_RUNNER_PY: &str = include_str!("../../../../conformance/executorch/et_runner.py");
/// The driver: timestep table, prefix once, step `steps` times, in ExecuTorch's runtime.
const DRIVER_PY: &str = include_str!("../../../../conformance/executorch/run_pi05_portable.py");

/// Runs portable `prefix.pte`/`step.pte` in ExecuTorch's runtime: a separate Python process
/// (`python`) running the driver embedded in this binary. Returns the actions and the driver's
/// JSON line (without the actions).
pub fn run_portable(
    pte_dir: &Path,
    cfg: &Pi05Config,
    inputs: &Inputs,
    inputs_file: Option<&Path>,
    python: &Path,
) -> Result<(Vec<f32>, serde_json::Value)> {
    check_specs(pte_dir, cfg)?;
    let (prefix, step) = (
        pte_dir.join(crate::layout::PREFIX_PTE),
        pte_dir.join(crate::layout::STEP_PTE),
    );
    DriverRun {
        scripts: &[
            ("run_pi05_portable.py", DRIVER_PY),
            ("et_runner.py", ET_RUNNER_PY),
        ],
        runtime: "ExecuTorch's runtime",
        start: "start the ExecuTorch driver",
        error_lines: 12,
        blame_run: &prefix,
        blame_actions: &step,
    }
    .run(pte_dir, cfg, inputs, inputs_file, python)
}

/// Writes `inputs` as the safetensors file the driver reads (`petite pi05 run`'s format).
fn write_inputs(path: &Path, cfg: &Pi05Config, inputs: &Inputs) -> Result<()> {
    use petite_weights::{Dtype as W, SafetensorsWriter, TensorSpec};
    let s = cfg.vision.image_size;
    let f32b = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let i64b = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let rows: Vec<(&str, W, Vec<usize>, Vec<u8>)> = vec![
        (
            io::IMAGES,
            W::F32,
            vec![cfg.cameras, 3, s, s],
            f32b(&inputs.images),
        ),
        (
            io::IMAGE_MASKS,
            W::U8,
            vec![cfg.cameras],
            inputs.image_masks.clone(),
        ),
        (io::TOKENS, W::I64, vec![cfg.tokens], i64b(&inputs.tokens)),
        (
            io::TOKEN_MASK,
            W::U8,
            vec![cfg.tokens],
            inputs.token_mask.clone(),
        ),
        (
            "noise",
            W::F32,
            vec![cfg.chunk, cfg.action_dim],
            f32b(&inputs.noise),
        ),
        (
            "rtc_prev",
            W::F32,
            vec![cfg.chunk, cfg.action_dim],
            f32b(&inputs.guidance.prev),
        ),
        (
            "rtc_weights",
            W::F32,
            vec![cfg.chunk],
            f32b(&inputs.guidance.weights),
        ),
        (
            "rtc_steps",
            W::F32,
            vec![cfg.steps, 2],
            f32b(&inputs.guidance.steps),
        ),
    ];
    let specs: Vec<TensorSpec> = rows
        .iter()
        .map(|(n, d, s, _)| TensorSpec::new(*n, *d, s))
        .collect();
    let w = SafetensorsWriter::create(path, &specs, &[])?;
    for (n, _, _, b) in &rows {
        w.write_at(n, 0, b)?;
    }
    w.finish()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ONNX Runtime driver's actions: a NaN or infinity it prints as a string comes back as
    /// that value, so the fold fails on it (never a pass, never a lost element); anything else
    /// that is not a number is no actions at all.
    #[test]
    fn driver_actions_keep_non_finite_values_for_the_fold() {
        let j: serde_json::Value =
            serde_json::from_str(r#"[0.5, "nan", -2, "-inf", "inf"]"#).unwrap();
        let a = driver_actions(&j).unwrap();
        assert_eq!(a.len(), 5);
        assert!(a[1].is_nan() && a[3] == f32::NEG_INFINITY && a[4] == f32::INFINITY);
        let err = petite_reference::max_abs_diff(&a, &[0.5, 0.0, -2.0, 0.0, 0.0])
            .unwrap_err()
            .to_string();
        assert!(err.contains("NaN") && err.contains("index 1"), "{err}");
        for bad in [
            r#"[1, "x"]"#,
            r#"[1, "2.5"]"#,
            r#"[1, null]"#,
            r#"{"a": 1}"#,
        ] {
            let j: serde_json::Value = serde_json::from_str(bad).unwrap();
            assert!(driver_actions(&j).is_none(), "{bad}");
        }
    }
}
