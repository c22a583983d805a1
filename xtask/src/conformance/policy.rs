//! The lerobot policy tier: real lerobot 0.6.1 policy folders in, a deployable bundle out.
//! `conformance/lerobot/make_policy_folders.py` (in the lerobot venv) saves each case as a user
//! gets it — `PI05Policy.save_pretrained` plus the pre/post-processors' `save_pretrained`, small
//! sizes, a small trained tokenizer; one case as a Hub-style folder — and runs lerobot's own
//! preprocessor → `predict_action_chunk` (fixed noise) → postprocessor on raw observations.
//! Then, per case and backend (reference engines, portable in ExecuTorch's runtime, onnx in ONNX
//! Runtime), f32 (and, on the reference engines, bf16 with `--weights int8` and `fp8` within
//! their bounds):
//! `petite export --checkpoint <folder> --config petite.json` and `petite act` on the same raw
//! observation must give lerobot's actions within 1e-4 × max(1, |action|) each, and its prompt
//! tokens and attention mask exactly. A NaN, a length mismatch or a missing tensor fails.
//!
//! Then the Python package, installed into the lerobot venv as a user installs it (`pip install
//! crates/petite-python`: pip runs its `pyproject.toml`'s maturin build, in the profile of the
//! `petite` the tier runs, in the workspace's target directory), and
//! `conformance/lerobot/python_policy.py` opens one `petite.Policy` per case (the reference
//! export) and calls it over the case's loop of observations (`loop.safetensors`, lerobot's
//! pipeline on each, written by the generator): `act` and `predict_action_chunk` within the same
//! bound, tokens identical, bad observations refused by key, the GIL released while a chunk
//! runs, and the per-call overhead over `Policy::act` in Rust measured; then `petite.Client`
//! against `petite serve` of the same export: answers equal to the in-process policy's, bad
//! input refused by key, four threads on one client, the transport's time measured, SIGTERM.
//! Then `petite.ActionLoop` (`conformance/lerobot/action_loop.py`): two robots at 30 Hz for 5 s on
//! one `petite serve`, an action every tick after the first chunk, each chunk guided by the
//! previous one's unexecuted rows with the delay measured, each reply its own request's.
//!
//! Then the lerobot plugin (`python/lerobot_policy_petite`), pip-installed into the same venv,
//! driven through lerobot's own API (`conformance/lerobot/plugin_policy.py`): lerobot finds type
//! `petite`, `make_policy` opens the reference export, `make_pre_post_processors` reads the
//! processor files the export copied, and `select_action` over each case's loop equals lerobot's
//! PI05 `select_action` (same noise) within the same bound, before and after the postprocessor.
//! Then lerobot's own real-time-chunking rollout drives the plugin (`conformance/lerobot/
//! rtc_engine.py`: `build_rollout_context`, `RTCInferenceEngine`, `BaseStrategy` at 30 Hz for 5 s
//! with a scripted robot): an action every tick after the first chunk, each later chunk guided by
//! the previous one's leftover with the delay lerobot measured, equal to lerobot's PI05 on the
//! same call.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use safetensors::{Dtype, SafeTensors};

use crate::util;

/// The generator, relative to the workspace root.
pub(crate) const SCRIPT: &str = "conformance/lerobot/make_policy_folders.py";
/// The cases it writes (one folder each under the output).
pub(crate) const CASES: [&str; 2] = ["libero_like_mean_std", "hub_quantiles"];
/// Per action: |petite − lerobot| ≤ this × max(1, |lerobot|).
const BOUND: f32 = 1e-4;
/// lerobot's real-time chunking on the folders the first script wrote.
pub(crate) const RTC_SCRIPT: &str = "conformance/lerobot/make_rtc_goldens.py";

/// One RTC golden's settings (`rtc.safetensors`'s metadata).
pub(crate) struct RtcGolden {
    pub schedule: String,
    pub inference_delay: usize,
    pub execution_horizon: usize,
    pub max_guidance_weight: f32,
    pub differs: bool,
}

/// The case's RTC goldens, in order; refused unless at least one of every schedule weights
/// some row (a no-op RTC must fail the comparison).
pub(crate) fn rtc_goldens(case_dir: &Path) -> Result<Vec<RtcGolden>> {
    let path = case_dir.join("rtc.safetensors");
    let bytes = read(&path)?;
    let (_, meta) =
        SafeTensors::read_metadata(&bytes).with_context(|| path.display().to_string())?;
    let text = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("rtc").cloned())
        .with_context(|| format!("{}: no `rtc` metadata", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let g: Vec<RtcGolden> = v
        .as_array()
        .context("`rtc` metadata is not a list")?
        .iter()
        .map(|m| -> Result<RtcGolden> {
            let n = |k: &str| {
                m[k].as_f64()
                    .with_context(|| format!("golden without `{k}`"))
            };
            Ok(RtcGolden {
                schedule: m["schedule"]
                    .as_str()
                    .context("golden without `schedule`")?
                    .to_string(),
                inference_delay: n("inference_delay")? as usize,
                execution_horizon: n("execution_horizon")? as usize,
                max_guidance_weight: n("max_guidance_weight")? as f32,
                differs: m["differs"].as_bool().context("golden without `differs`")?,
            })
        })
        .collect::<Result<_>>()?;
    for s in ["ZEROS", "ONES", "LINEAR", "EXP"] {
        ensure!(
            g.iter().any(|g| g.schedule == s && g.differs),
            "{}: no {s} golden that moves the chunk",
            path.display()
        );
    }
    Ok(g)
}

/// `petite export ARGS` of case folder `dir`'s lerobot policy (with its `petite.json`) into
/// `bundle`.
pub(crate) fn export_cmd(petite: &Path, dir: &Path, bundle: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(petite);
    cmd.arg("export")
        .args(args)
        .arg("--checkpoint")
        .arg(dir.join("policy"))
        .arg("--config")
        .arg(dir.join("petite.json"))
        .arg("--out")
        .arg(bundle);
    cmd
}

/// `petite act` of `bundle` on `observation`, its actions (and tokens) into `out`.
fn act_cmd(petite: &Path, bundle: &Path, observation: &Path, out: &Path) -> Command {
    let mut cmd = Command::new(petite);
    cmd.arg("act")
        .arg("--dir")
        .arg(bundle)
        .arg("--observation")
        .arg(observation)
        .arg("--out")
        .arg(out);
    cmd
}

/// Quantized weights from a lerobot folder (issue 51): the case exported bf16 with `--weights
/// int8` and `fp8` (reference engines), acted on by `petite act` and compared with lerobot's
/// f32 pipeline within the mode's bound (`petite verify`'s: `INT8_MAX_ERROR` 1e-1,
/// `FP8_MAX_ERROR` 5e-1), tokens and mask identical; `report.json` must say what it quantized.
fn quantized(petite: &Path, dir: &Path) -> Result<()> {
    for (mode, bound) in [("int8", 1e-1f32), ("fp8", 5e-1)] {
        let bundle = dir.join(format!("reference-{mode}"));
        util::run_quiet(&mut export_cmd(
            petite,
            dir,
            &bundle,
            &["--dtype", "bf16", "--weights", mode],
        ))?;
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(bundle.join("report.json"))?)?;
        let q = &report["quantization"];
        ensure!(
            q["weights"] == mode && q["tensors"].as_u64().is_some_and(|t| t > 0),
            "{}: report.json quantization {q}",
            bundle.display()
        );
        let acted = dir.join(format!("reference-{mode}-act.safetensors"));
        util::run_quiet(&mut act_cmd(
            petite,
            &bundle,
            &dir.join("observation.safetensors"),
            &acted,
        ))?;
        let err = compare_within(&dir.join("expected.safetensors"), &acted, bound)
            .with_context(|| format!("{} (--weights {mode})", dir.display()))?;
        eprintln!(
            "xtask: policy: {} (reference, bf16, --weights {mode}: {} weights): actions within {err:.2e} × max(1, |a|) of lerobot's f32 pipeline (bound {bound:e}); tokens and mask identical",
            dir.file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            q["tensors"]
        );
    }
    Ok(())
}

/// The Python package's crate (its `pyproject.toml` beside), relative to the workspace root.
const PYTHON_CRATE: &str = "crates/petite-python/Cargo.toml";
/// The package's test, run in the lerobot venv.
const PYTHON_TEST: &str = "conformance/lerobot/python_policy.py";
/// `petite.ActionLoop` (robot-side real-time chunking) over `petite serve`: two robots at 30 Hz.
const ACTION_LOOP_TEST: &str = "conformance/lerobot/action_loop.py";
/// The lerobot plugin's distribution (`lerobot_policy_petite`), relative to the workspace root.
const PLUGIN: &str = "python/lerobot_policy_petite";
/// Its test through lerobot's API, run in the lerobot venv.
const PLUGIN_TEST: &str = "conformance/lerobot/plugin_policy.py";
/// lerobot's own real-time-chunking rollout (`lerobot.rollout`: `build_rollout_context`,
/// `RTCInferenceEngine`, `BaseStrategy`) driving the plugin with a scripted robot, run in the
/// lerobot venv after [`PLUGIN_TEST`].
const RTC_ENGINE_TEST: &str = "conformance/lerobot/rtc_engine.py";
/// The maturin the package's PEP 517 build uses, installed into the lerobot venv.
pub(crate) const MATURIN_REQUIREMENTS: &[&str] = &["maturin==1.16.0"];

/// Runs the tier.
pub fn run() -> Result<()> {
    let root = util::root();
    let python = super::Venv::Lerobot.python()?;
    let pte_python = super::Venv::Pte.python()?;
    let ort_python = super::Venv::Ort.python()?;
    let petite = util::conformance_petite()?;
    let out = util::target_dir().join("conformance-policy");
    let result = (|| -> Result<()> {
        let start = Instant::now();
        util::run(
            Command::new(&python)
                .arg(root.join(SCRIPT))
                .arg("--out")
                .arg(&out),
        )?;
        util::run(
            Command::new(&python)
                .arg(root.join(RTC_SCRIPT))
                .arg("--out")
                .arg(&out)
                .args(CASES),
        )?;
        eprintln!(
            "xtask: policy: lerobot wrote the folders and its outputs (with its RTC goldens) in {:.0} s",
            start.elapsed().as_secs_f64()
        );
        for case in CASES {
            let dir = out.join(case);
            for backend in ["reference", "portable", "onnx"] {
                let bundle = dir.join(backend);
                util::run(&mut export_cmd(
                    &petite,
                    &dir,
                    &bundle,
                    &["--dtype", "f32", "--backend", backend],
                ))?;
                let acted = dir.join(format!("{backend}-act.safetensors"));
                let mut act = act_cmd(
                    &petite,
                    &bundle,
                    &dir.join("observation.safetensors"),
                    &acted,
                );
                match backend {
                    "portable" => {
                        act.arg("--python").arg(&pte_python);
                    }
                    "onnx" => {
                        act.arg("--python").arg(&ort_python);
                    }
                    _ => {}
                }
                util::run(&mut act)?;
                let err = compare(&dir.join("expected.safetensors"), &acted)
                    .with_context(|| format!("{case} ({backend})"))?;
                eprintln!(
                    "xtask: policy: {case} ({backend}, f32): actions within {err:.2e} × max(1, |a|) of lerobot's pipeline (bound {BOUND:e}); tokens and mask identical"
                );
                // Real-time chunking: every golden on the reference engines, one per schedule
                // (each with another delay) in the other runtimes.
                let goldens = rtc_goldens(&dir)?;
                let mut worst = 0f64;
                let mut ran = Vec::new();
                for (j, g) in goldens.iter().enumerate() {
                    if backend != "reference" && j % 3 != (j / 3) % 3 {
                        continue;
                    }
                    let gdir = dir.join("rtc").join(format!("{j:02}"));
                    let acted = gdir.join(format!("{backend}-act.safetensors"));
                    let mut act = act_cmd(
                        &petite,
                        &bundle,
                        &gdir.join("observation.safetensors"),
                        &acted,
                    );
                    act.args(["--inference-delay", &g.inference_delay.to_string()])
                        .args(["--execution-horizon", &g.execution_horizon.to_string()])
                        .args(["--rtc-schedule", &g.schedule])
                        .args(["--max-guidance-weight", &g.max_guidance_weight.to_string()]);
                    match backend {
                        "portable" => {
                            act.arg("--python").arg(&pte_python);
                        }
                        "onnx" => {
                            act.arg("--python").arg(&ort_python);
                        }
                        _ => {}
                    }
                    util::run_quiet(&mut act)?;
                    let err =
                        compare(&gdir.join("expected.safetensors"), &acted).with_context(|| {
                            format!(
                                "{case} ({backend}) RTC golden {j}: {} delay {}",
                                g.schedule, g.inference_delay
                            )
                        })?;
                    worst = worst.max(err);
                    ran.push(format!("{} d{}", g.schedule, g.inference_delay));
                }
                eprintln!(
                    "xtask: policy: {case} ({backend}, f32): {} real-time-chunking goldens (lerobot's RTC: {}) through petite act within {worst:.2e} × max(1, |a|) (bound {BOUND:e})",
                    ran.len(),
                    ran.join(", ")
                );
            }
            quantized(&petite, &dir)?;
        }
        python_package(&python, &out, &petite)?;
        plugin(&python, &out)
    })();
    let _ = std::fs::remove_dir_all(&out);
    result
}

/// The Python package, installed into the lerobot venv (`python`) as a user installs it —
/// `pip install crates/petite-python`, pip running the package's own PEP 517 build
/// (`pyproject.toml` → maturin) — then its test over every case's loop (the reference exports
/// under `out`), with `petite` serving them to `petite.Client`.
fn python_package(python: &Path, out: &Path, petite: &Path) -> Result<()> {
    let root = util::root();
    // The pinned maturin in the venv itself, so the build uses it (`--no-build-isolation`)
    // rather than whatever version pip would fetch for an isolated build.
    util::run(
        Command::new(python)
            .args(["-m", "pip", "install", "--quiet"])
            .args(MATURIN_REQUIREMENTS),
    )?;
    // The profile of the petite the tier runs. In CI that is the test build `cargo test
    // --workspace` made: the package is built with the same settings, so only pyo3, numpy and
    // the module itself are compiled here. maturin's PEP 517 backend reads its build options
    // from MATURIN_PEP517_ARGS (split as a shell would).
    let profile: Vec<String> = if util::conformance_uses_test_build() {
        test_profile_as_dev(&root)?
    } else {
        vec!["--profile".into(), "release".into()]
    };
    let quoted: Vec<String> = profile
        .iter()
        .map(|a| format!("'{}'", a.replace('\'', "'\\''")))
        .collect();
    let bin = python.parent().context("the venv's python has no folder")?;
    let venv_path = match std::env::var_os("PATH") {
        Some(p) => std::env::join_paths(
            std::iter::once(bin.to_path_buf()).chain(std::env::split_paths(&p)),
        )?,
        None => bin.as_os_str().to_owned(),
    };
    let package = root.join(PYTHON_CRATE);
    let package = package.parent().context("the Python crate has no folder")?;
    let start = Instant::now();
    util::run(
        Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "--force-reinstall",
            ])
            .arg(package)
            .env("MATURIN_PEP517_ARGS", quoted.join(" "))
            // The backend runs the `maturin` executable the venv's pip installed beside it.
            .env("PATH", venv_path)
            .env("CARGO_TARGET_DIR", util::target_dir())
            .current_dir(&root),
    )?;
    eprintln!(
        "xtask: policy: pip installed {} (its PEP 517 build, maturin) in the lerobot venv in {:.0} s",
        package.display(),
        start.elapsed().as_secs_f64()
    );
    let start = Instant::now();
    util::run(
        Command::new(python)
            .arg(root.join(PYTHON_TEST))
            .arg("--out")
            .arg(out)
            .arg("--petite")
            .arg(petite)
            .args(CASES),
    )?;
    eprintln!(
        "xtask: policy: the Python package's test took {:.0} s",
        start.elapsed().as_secs_f64()
    );
    let start = Instant::now();
    util::run(
        Command::new(python)
            .arg(root.join(ACTION_LOOP_TEST))
            .arg("--out")
            .arg(out)
            .arg("--petite")
            .arg(petite)
            .args(CASES),
    )?;
    eprintln!(
        "xtask: policy: petite.ActionLoop over petite serve took {:.0} s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The lerobot plugin (`python/lerobot_policy_petite`), installed into the lerobot venv as a
/// user installs it beside the `petite` package (`pip install`, no dependencies fetched: lerobot
/// and petite are there), then its test through lerobot's own API over every case's reference
/// export ([`PLUGIN_TEST`]).
fn plugin(python: &Path, out: &Path) -> Result<()> {
    let root = util::root();
    let start = Instant::now();
    util::run(
        Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "--force-reinstall",
            ])
            .arg(root.join(PLUGIN))
            .current_dir(&root),
    )?;
    eprintln!(
        "xtask: policy: pip installed {PLUGIN} in the lerobot venv in {:.0} s",
        start.elapsed().as_secs_f64()
    );
    util::run(
        Command::new(python)
            .arg(root.join(PLUGIN_TEST))
            .arg("--out")
            .arg(out)
            .args(CASES),
    )?;
    let start = Instant::now();
    util::run(
        Command::new(python)
            .arg(root.join(RTC_ENGINE_TEST))
            .arg("--out")
            .arg(out)
            .args(CASES),
    )?;
    eprintln!(
        "xtask: policy: lerobot's RTC rollout over the plugin took {:.0} s",
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

/// maturin arguments that build with the test profile's settings. maturin builds through `cargo
/// rustc`, where `--profile test` means test mode (a test harness, not the module), so the dev
/// profile is named and given the test profile's settings from the workspace's Cargo.toml
/// (`--config profile.dev.opt-level=2`, …): cargo keys artifacts by settings, not by the
/// profile's name, and both profiles build into `target/debug`, so `cargo test --workspace`'s
/// artifacts are reused.
fn test_profile_as_dev(root: &Path) -> Result<Vec<String>> {
    let path = root.join("Cargo.toml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut args = vec!["--profile".to_string(), "dev".to_string()];
    args.extend(
        profile_overrides(&text, "test", "dev")
            .into_iter()
            .flat_map(|kv| ["--config".to_string(), kv]),
    );
    ensure!(
        args.len() > 2,
        "{}: no [profile.test] settings found",
        path.display()
    );
    Ok(args)
}

/// The `key = value` lines of `[profile.<from>]` and its `[profile.<from>.package.…]` tables as
/// cargo `--config` overrides of profile `to` (`profile.dev.package."*".opt-level=3`).
fn profile_overrides(cargo_toml: &str, from: &str, to: &str) -> Vec<String> {
    let head = format!("[profile.{from}");
    let mut table: Option<String> = None;
    let mut out = Vec::new();
    for line in cargo_toml.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            table = line
                .strip_prefix(&head)
                .and_then(|rest| rest.strip_suffix(']'))
                .filter(|rest| rest.is_empty() || rest.starts_with('.'))
                .map(|rest| format!("profile.{to}{rest}"));
            continue;
        }
        let (Some(t), Some((k, v))) = (&table, line.split_once('=')) else {
            continue;
        };
        if !line.starts_with('#') {
            out.push(format!("{t}.{}={}", k.trim(), v.trim()));
        }
    }
    out
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// A tensor's values as f64 (f32, i64, u8/bool), with its dtype checked against `want`.
fn values(st: &SafeTensors<'_>, file: &Path, name: &str, want: &[Dtype]) -> Result<Vec<f64>> {
    let t = st
        .tensor(name)
        .with_context(|| format!("{}: no tensor `{name}`", file.display()))?;
    ensure!(
        want.contains(&t.dtype()),
        "{}: `{name}` is {:?}, expected one of {want:?}",
        file.display(),
        t.dtype()
    );
    let b = t.data();
    Ok(match t.dtype() {
        Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        Dtype::I64 => b
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f64)
            .collect(),
        _ => b.iter().map(|&v| v as f64).collect(),
    })
}

/// The largest |petite − lerobot| / max(1, |lerobot|) over the actions; fails past [`BOUND`],
/// on any non-finite value, a length mismatch, or a token or mask that differs.
pub(crate) fn compare(expected: &Path, acted: &Path) -> Result<f64> {
    compare_within(expected, acted, BOUND)
}

/// [`compare`] with another bound on the actions (a bf16 export's).
pub(crate) fn compare_within(expected: &Path, acted: &Path, bound: f32) -> Result<f64> {
    let (eb, ab) = (read(expected)?, read(acted)?);
    let e = SafeTensors::deserialize(&eb).with_context(|| expected.display().to_string())?;
    let a = SafeTensors::deserialize(&ab).with_context(|| acted.display().to_string())?;
    let want = values(&e, expected, "action", &[Dtype::F32])?;
    let got = values(&a, acted, "action", &[Dtype::F32])?;
    ensure!(
        !want.is_empty() && want.len() == got.len(),
        "{} actions from petite act, {} from lerobot",
        got.len(),
        want.len()
    );
    let mut worst = 0f64;
    for (i, (&w, &g)) in want.iter().zip(&got).enumerate() {
        ensure!(
            w.is_finite() && g.is_finite(),
            "action {i}: petite {g}, lerobot {w} (not finite)"
        );
        let rel = (g - w).abs() / w.abs().max(1.0);
        worst = worst.max(rel);
        if rel > bound as f64 {
            bail!(
                "action {i}: petite {g}, lerobot {w}: off by {rel:.3e} × max(1, |a|) > {bound:e}"
            );
        }
    }
    for (mine, theirs, kinds) in [
        ("observation.language.tokens", "tokens", &[Dtype::I64][..]),
        (
            "observation.language.attention_mask",
            "token_mask",
            &[Dtype::BOOL, Dtype::U8][..],
        ),
    ] {
        let g = values(&a, acted, mine, kinds)?;
        let w = values(&e, expected, theirs, &[Dtype::I64, Dtype::U8, Dtype::BOOL])?;
        ensure!(
            !w.is_empty() && g == w,
            "{mine}: petite {g:?}, lerobot {w:?}"
        );
    }
    Ok(worst)
}

#[cfg(test)]
mod tests {
    use super::profile_overrides;

    #[test]
    fn the_test_profile_becomes_dev_overrides() {
        let toml = r#"
[profile.release]
debug = "line-tables-only"

[profile.test.package."*"]
opt-level = 3
[profile.test]
# a comment
opt-level = 2
debug = "line-tables-only"

[profile.tests-other]
opt-level = 1
"#;
        assert_eq!(
            profile_overrides(toml, "test", "dev"),
            [
                r#"profile.dev.package."*".opt-level=3"#,
                "profile.dev.opt-level=2",
                r#"profile.dev.debug="line-tables-only""#,
            ]
        );
    }
}
