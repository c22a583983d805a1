//! The real-TensorRT tier: every lerobot golden exported with `--backend tensorrt` through
//! TensorRT-RTX (a real TensorRT parser and builder from PyPI that builds on a CPU-only machine,
//! venv `target/venv-trt`), at the default engine cap and, for one case, at a cap small enough
//! to cut the programs into many engines. Checks: the export succeeds (zero parse or build
//! errors), `report.json` names the builder and records each engine's builder peak RSS, build
//! time and plan size, every delegate blob is a `TR01` blob holding a TensorRT-RTX plan (`vtrt`
//! magic), and no plan exceeds 1.05x its engine's weight bytes + 8 MiB (weights are stored once,
//! in their compute dtype). Weight streaming: one case exported with `--weight-streaming-budget`
//! builds through TensorRT-RTX with `BuilderFlag.WEIGHT_STREAMING` (the driver reads the flag
//! back; petite refuses a build it does not report), every plan differs from the same engine's
//! plan built without it (a weak check on its own: TensorRT-RTX 1.7.1 builds of one ONNX model
//! are not always byte-identical — one engine of 14 differed in 1,603 bytes between two builds
//! here — so the flag read back is what proves streaming), and every delegate
//! of both `.pte` files, read back with petite-pte's reader, carries exactly the
//! `weight_streaming_budget` compile spec (ASCII decimal bytes, Torch-TensorRT's encoding); a
//! budget below one layer is refused. Placement: every export's `.pte` files (default: device
//! placement) and one re-export with `--placement host` are compared field by field with the
//! programs ExecuTorch 1.5.1's own exporter plans for the same delegate dataflow, with and
//! without a `target_device=cuda:0` delegate (`conformance/executorch/placement_check.py`,
//! venv `target/venv-pte-full`). The whole-policy ONNX export (`--backend onnx --dtype bf16`) of
//! every golden is parsed and built by TensorRT-RTX as one engine. Quantized weights: one case
//! exported `--weights int8` (sm86) and `--weights fp8` (sm89) builds every engine, its whole
//! int8 ONNX builds as one, and fp8 for sm86 is refused before any work. What it cannot check: running
//! a plan (no GPU here that
//! TensorRT-RTX supports: so not the plan's streamable size either), and JetPack TensorRT's own
//! builder.

use std::path::Path;

use anyhow::{Context, Result, bail, ensure};

use crate::util;

const CASES: &[&str] = super::GOLDENS;
/// The weight-streaming case and budget (above its largest layer, below its largest engine).
const STREAMING_CASE: &str = "two_cams_mqa";
const STREAMING_BUDGET: (&str, u64) = ("64KiB", 64 << 10);
/// Plan bytes allowed per engine: 1.05x its weights plus this much (kernels, metadata: the
/// small goldens' engines measured 2.4-4.0 MiB of plan around under 0.3 MiB of weights).
const PLAN_SLACK: u64 = 8 << 20;
/// The delegate-placement oracle (ExecuTorch 1.5.1's exporter; see its docstring).
const PLACEMENT_SCRIPT: &str = "conformance/executorch/placement_check.py";

/// Runs the tier.
pub fn run() -> Result<()> {
    let root = util::root();
    let python = super::Venv::Trt.python()?;
    let et_python = super::Venv::PteFull.python()?;
    let petite = util::conformance_petite()?;
    let out = root.join("target").join("tensorrt-conformance");
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("removing {}", out.display()))?;
    }
    let mut runs: Vec<(&str, Option<&str>)> = CASES.iter().map(|c| (*c, None)).collect();
    // The default-cap run of STREAMING_CASE must come first: its plans are compared below.
    assert_eq!(CASES[0], STREAMING_CASE);
    runs.push(("three_cams_masked_gqa", Some("32KiB")));
    let mut total = 0;
    for (case, cap) in runs {
        let case_dir = root.join("testdata").join("pi05").join(case);
        let dir = out.join(format!("{case}-{}", cap.unwrap_or("default")));
        let mut cmd = std::process::Command::new(&petite);
        cmd.arg("export")
            .arg("--backend")
            .arg("tensorrt")
            .arg("--trt-python")
            .arg(&python)
            .arg("--trt-target")
            .arg("sm86")
            .arg("--config")
            .arg(case_dir.join("config.json"))
            .arg("--checkpoint")
            .arg(case_dir.join("model.safetensors"))
            .arg("--keep-engines");
        if let Some(c) = cap {
            // This run also passes --out relative to its working directory (builders run in
            // the engine directory: paths handed to them must not resolve twice).
            std::fs::create_dir_all(&out)?;
            cmd.args(["--engine-cap", c])
                .arg("--out")
                .arg(dir.file_name().expect("a case directory name"))
                .current_dir(&out);
        } else {
            cmd.arg("--out").arg(&dir);
        }
        util::run(&mut cmd)?;
        let n = check_export(&dir).with_context(|| format!("{}", dir.display()))?;
        eprintln!(
            "xtask: tensorrt: {case} (cap {}): {n} engines built by TensorRT-RTX",
            cap.unwrap_or("default")
        );
        total += n;
        placement_check(&et_python, "device", &dir)?;
        if cap.is_some() {
            // The same engines (reused) with the former layout: equal to ExecuTorch's program
            // for delegates without a target device.
            util::run(cmd.arg("--placement").arg("host"))?;
            placement_check(&et_python, "host", &dir)?;
        }
    }
    total += weight_streaming(&petite, &python, &out)?;
    total += quantized(&petite, &python, &out)?;
    refusals(&petite, &python, &out)?;
    whole_policy(&petite, &python, &out)?;
    std::fs::remove_dir_all(&out).with_context(|| format!("removing {}", out.display()))?;
    eprintln!("xtask: tensorrt: {total} engines parsed and built, zero errors");
    Ok(())
}

/// `--backend onnx --dtype bf16` (the whole policy as one model, bf16 kept bf16 for TensorRT)
/// of every golden: TensorRT-RTX parses `pi05.onnx` with its external data and builds it as one
/// strongly typed engine (the driver `--backend tensorrt` runs per engine), zero errors, a
/// `vtrt` plan. Measured here: 8–24 s and a builder peak RSS of 0.58–0.91 GiB per golden.
fn whole_policy(petite: &Path, python: &Path, out: &Path) -> Result<()> {
    for case in CASES {
        let dir = out.join(format!("{case}-onnx-bf16"));
        let built = whole_onnx(petite, python, case, &dir, &["--dtype", "bf16"])
            .with_context(|| case.to_string())?;
        eprintln!(
            "xtask: tensorrt: {case}: whole-policy pi05.onnx (bf16) built as one engine: {built}"
        );
    }
    Ok(())
}

/// `petite export` of golden `case` (its config and checkpoint) into `dir`; the caller adds the
/// backend and its flags.
fn export_golden(petite: &Path, case: &str, dir: &Path) -> std::process::Command {
    let case_dir = util::root().join("testdata").join("pi05").join(case);
    let mut cmd = std::process::Command::new(petite);
    cmd.arg("export")
        .arg("--config")
        .arg(case_dir.join("config.json"))
        .arg("--checkpoint")
        .arg(case_dir.join("model.safetensors"))
        .arg("--out")
        .arg(dir);
    cmd
}

/// Exports golden `case` with `--backend onnx ARGS` into `dir` and builds its `pi05.onnx` for
/// sm86 with the TensorRT-RTX driver; checks the plan is one and returns the driver's line.
fn whole_onnx(
    petite: &Path,
    python: &Path,
    case: &str,
    dir: &Path,
    args: &[&str],
) -> Result<String> {
    util::run(
        export_golden(petite, case, dir)
            .args(["--backend", "onnx"])
            .args(args),
    )?;
    let driver = util::root().join("crates/petite-engine/python/trt_rtx_build.py");
    let plan = dir.join("pi05.plan");
    let o = std::process::Command::new(python)
        .arg(&driver)
        .arg("--onnx")
        .arg(dir.join("pi05.onnx"))
        .arg("--plan")
        .arg(&plan)
        .args(["--target", "sm86"])
        .output()
        .context("starting the TensorRT-RTX driver")?;
    ensure!(
        o.status.success(),
        "TensorRT-RTX did not build {} ({}): {}",
        dir.join("pi05.onnx").display(),
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    let bytes = std::fs::read(&plan).with_context(|| plan.display().to_string())?;
    ensure!(
        bytes.starts_with(b"vtrt"),
        "{} is not a TensorRT-RTX plan",
        plan.display()
    );
    Ok(String::from_utf8_lossy(&o.stdout).trim().to_string())
}

/// `--weights int8` (for sm86) and `--weights fp8` (for sm89, the first with FP8) of
/// [`STREAMING_CASE`]: every engine, with its `DequantizeLinear`s of int8 or FP8 codes, parses
/// and builds through TensorRT-RTX, and `report.json` records the quantization; the same case's
/// whole-policy int8 ONNX (`--backend onnx`) builds as one engine. Returns the engines.
fn quantized(petite: &Path, python: &Path, out: &Path) -> Result<usize> {
    let mut total = 0;
    for (mode, target) in [("int8", "sm86"), ("fp8", "sm89")] {
        let dir = out.join(format!("{STREAMING_CASE}-{mode}"));
        let (n, r) = export_case(
            petite,
            python,
            &dir,
            &["--trt-target", target, "--weights", mode, "--keep-engines"],
        )?;
        let q = &r["quantization"];
        ensure!(
            q["weights"] == mode && q["tensors"].as_u64().is_some_and(|t| t > 0),
            "{mode}: report.json quantization {q}"
        );
        eprintln!(
            "xtask: tensorrt: {STREAMING_CASE} --weights {mode} ({target}): {n} engines built by TensorRT-RTX, {} weights quantized",
            q["tensors"]
        );
        total += n;
    }
    let dir = out.join(format!("{STREAMING_CASE}-onnx-int8"));
    let built = whole_onnx(petite, python, STREAMING_CASE, &dir, &["--weights", "int8"])?;
    eprintln!(
        "xtask: tensorrt: {STREAMING_CASE}: whole-policy pi05.onnx (--weights int8) built as one engine: {built}"
    );
    Ok(total)
}

/// `petite export --backend tensorrt` of [`STREAMING_CASE`] into `dir` with `args`, checked
/// ([`check_export`]): its engines and `report.json`.
fn export_case(
    petite: &Path,
    python: &Path,
    dir: &Path,
    args: &[&str],
) -> Result<(usize, serde_json::Value)> {
    util::run(
        export_golden(petite, STREAMING_CASE, dir)
            .args(["--backend", "tensorrt", "--trt-python"])
            .arg(python)
            .args(args),
    )?;
    let n = check_export(dir).with_context(|| format!("{}", dir.display()))?;
    let r = serde_json::from_str(&std::fs::read_to_string(dir.join("report.json"))?)?;
    Ok((n, r))
}

/// The weight-streaming export of [`STREAMING_CASE`] (see the module docs); returns its engines.
fn weight_streaming(petite: &Path, python: &Path, out: &Path) -> Result<usize> {
    let dir = out.join(format!("{STREAMING_CASE}-weight-streaming"));
    let (n, r) = export_case(
        petite,
        python,
        &dir,
        &[
            "--trt-target",
            "sm86",
            "--keep-engines",
            "--weight-streaming-budget",
            STREAMING_BUDGET.0,
        ],
    )?;
    let want = STREAMING_BUDGET.1.to_string();
    let plain: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        out.join(format!("{STREAMING_CASE}-default"))
            .join("report.json"),
    )?)?;
    for p in ["prefix", "step"] {
        let engines = r["programs"][p]["engines"].as_array().context("engines")?;
        let plain_engines = plain["programs"][p]["engines"]
            .as_array()
            .context("engines")?;
        ensure!(
            engines.len() == plain_engines.len(),
            "{p}: engine counts differ"
        );
        for (e, q) in engines.iter().zip(plain_engines) {
            let name = e["name"].as_str().unwrap_or("?");
            ensure!(
                e["compile_specs"] == serde_json::json!({"weight_streaming_budget": want}),
                "{name}: report.json compile_specs {}",
                e["compile_specs"]
            );
            // Same engine, built without the flag in the default run: the plans must differ.
            let a = plan_bytes(&dir.join("engines").join(format!("{name}.tr01")))?;
            let qname = q["name"].as_str().unwrap_or("?");
            let b = plan_bytes(
                &out.join(format!("{STREAMING_CASE}-default"))
                    .join("engines")
                    .join(format!("{qname}.tr01")),
            )?;
            ensure!(
                a != b,
                "{name}: the weight-streaming plan equals {qname}'s, built without the flag"
            );
        }
        let pte = petite_pte::PteFile::open(dir.join(format!("{p}.pte")))?;
        let mut delegates = 0;
        for plan in &pte.program().execution_plan {
            for d in &plan.delegates {
                let specs: Vec<(&str, &[u8])> = d
                    .compile_specs
                    .iter()
                    .map(|c| (c.key.as_str(), c.value.as_slice()))
                    .collect();
                ensure!(
                    specs
                        == [
                            ("weight_streaming_budget", want.as_bytes()),
                            ("target_device", b"cuda:0")
                        ],
                    "{p}.pte: delegate {} has compile specs {specs:?}",
                    d.id
                );
                delegates += 1;
            }
        }
        ensure!(delegates == engines.len(), "{p}.pte: {delegates} delegates");
    }
    eprintln!(
        "xtask: tensorrt: {STREAMING_CASE} with --weight-streaming-budget {}: {n} weight-streamable engines built by TensorRT-RTX, every delegate carries weight_streaming_budget={want}",
        STREAMING_BUDGET.0
    );
    Ok(n)
}

/// ExecuTorch's own exporter against the delegate placement of `dir`'s `.pte` files
/// (`conformance/executorch/placement_check.py`, `mode` device or host).
fn placement_check(python: &Path, mode: &str, dir: &Path) -> Result<()> {
    let script = util::root().join(PLACEMENT_SCRIPT);
    let o = std::process::Command::new(python)
        .arg(&script)
        .arg(mode)
        .arg(dir.join("prefix.pte"))
        .arg(dir.join("step.pte"))
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    let err = String::from_utf8_lossy(&o.stderr);
    ensure!(
        o.status.success(),
        "{}: {mode} placement differs from ExecuTorch's:\n{}",
        dir.display(),
        err.lines()
            .filter(|l| l.starts_with("placement_check") || l.contains("Error"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    for l in String::from_utf8_lossy(&o.stdout).lines() {
        eprintln!("xtask: tensorrt: placement:{l}");
    }
    Ok(())
}

/// The plan bytes inside a `TR01` blob.
fn plan_bytes(blob: &Path) -> Result<Vec<u8>> {
    let (h, _) = petite_engine::tensorrt::blob::read(blob)
        .with_context(|| format!("reading {}", blob.display()))?;
    let all = std::fs::read(blob)?;
    Ok(all[h.engine_offset as usize..][..h.engine_size as usize].to_vec())
}

/// Bad builder settings with the real TensorRT-RTX: each refused before any work, in one
/// line naming the tool and what to do, with nothing written.
fn refusals(petite: &Path, python: &Path, out: &Path) -> Result<()> {
    let case_dir = util::root().join("testdata").join("pi05").join(CASES[0]);
    let base_python = util::python312()?;
    let cases: [(&str, Vec<std::ffi::OsString>, &str); 4] = [
        (
            "unsupported target",
            vec![
                "--trt-python".into(),
                python.into(),
                "--trt-target".into(),
                "sm87".into(),
            ],
            "--trt-target sm87: tensorrt-rtx 1.7.1.116 builds for sm75, sm80, sm86",
        ),
        (
            "python without tensorrt_rtx",
            vec!["--trt-python".into(), base_python.into()],
            "cannot import tensorrt_rtx",
        ),
        (
            "weight-streaming budget below one layer",
            vec![
                "--trt-python".into(),
                python.into(),
                "--weight-streaming-budget".into(),
                "1KiB".into(),
            ],
            "is below one layer's weights",
        ),
        (
            "fp8 weights for a target without FP8",
            vec![
                "--trt-python".into(),
                python.into(),
                "--trt-target".into(),
                "sm86".into(),
                "--weights".into(),
                "fp8".into(),
            ],
            "--weights fp8: --trt-target sm86 (compute capability 8.6) has no FP8",
        ),
    ];
    for (what, args, needle) in cases {
        let dir = out.join(format!("refused-{}", what.replace(' ', "-")));
        let o = std::process::Command::new(petite)
            .args(["export", "--backend", "tensorrt"])
            .args(&args)
            .arg("--config")
            .arg(case_dir.join("config.json"))
            .arg("--checkpoint")
            .arg(case_dir.join("model.safetensors"))
            .arg("--out")
            .arg(&dir)
            .env("RUST_BACKTRACE", "0")
            .output()?;
        let err = String::from_utf8_lossy(&o.stderr);
        ensure!(!o.status.success(), "{what}: the export succeeded");
        ensure!(
            err.contains(needle),
            "{what}: expected `{needle}` in:\n{err}"
        );
        ensure!(!dir.exists(), "{what}: {} was created", dir.display());
        eprintln!(
            "xtask: tensorrt: {what} refused: {}",
            err.trim().lines().last().unwrap_or("")
        );
    }
    Ok(())
}

/// Checks one export directory; returns the number of engines.
fn check_export(dir: &Path) -> Result<usize> {
    let text = std::fs::read_to_string(dir.join("report.json"))?;
    let r: serde_json::Value = serde_json::from_str(&text)?;
    let builder = r["builder"].as_str().unwrap_or("");
    ensure!(
        builder == format!("tensorrt-rtx {}", rtx_version()),
        "report.json builder is `{builder}`"
    );
    let mut n = 0;
    for p in ["prefix", "step"] {
        let engines = r["programs"][p]["engines"]
            .as_array()
            .with_context(|| format!("no {p} engines in report.json"))?;
        ensure!(!engines.is_empty(), "{p}: no engines");
        for e in engines {
            let name = e["name"].as_str().unwrap_or("?");
            let weights = e["weight_bytes"].as_u64().unwrap_or(0);
            let plan = e["plan_bytes"].as_u64().unwrap_or(0);
            let peak = e["builder_peak_rss_bytes"].as_u64().unwrap_or(0);
            ensure!(
                plan > 0 && peak > 0 && e["build_s"].as_f64().is_some_and(|s| s > 0.0),
                "{name}: build statistics missing: {e}"
            );
            ensure!(
                plan as f64 <= 1.05 * weights as f64 + PLAN_SLACK as f64,
                "{name}: plan of {plan} bytes for {weights} weight bytes (> 1.05x + {PLAN_SLACK})"
            );
            let blob = dir.join("engines").join(format!("{name}.tr01"));
            let (h, _) = petite_engine::tensorrt::blob::read(&blob)
                .with_context(|| format!("{name}: reading its blob"))?;
            ensure!(
                h.engine_size == plan,
                "{name}: blob holds {} plan bytes, report says {plan}",
                h.engine_size
            );
            let mut magic = [0u8; 4];
            use std::io::{Read, Seek, SeekFrom};
            let mut f = std::fs::File::open(&blob)?;
            f.seek(SeekFrom::Start(h.engine_offset as u64))?;
            f.read_exact(&mut magic)?;
            if &magic != b"vtrt" {
                bail!("{name}: the plan starts with {magic:?}, not TensorRT-RTX's `vtrt`");
            }
            n += 1;
        }
    }
    Ok(n)
}

/// The pinned TensorRT-RTX version (`tensorrt-rtx-cu13==1.7.1.116` → `1.7.1.116`).
fn rtx_version() -> &'static str {
    let r = petite_engine::tensorrt::RTX_REQUIREMENT;
    r.split("==").nth(1).unwrap_or(r)
}
