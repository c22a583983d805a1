//! `petite verify`: runs an export through [`crate::bundle::BundleRunner`] (the engines'
//! runtimes, ExecuTorch's or ONNX Runtime's, as `petite act` runs it) and the f32 reference from
//! the original checkpoint on the same inputs (after them, or beside them in a second thread:
//! [`Stages`]), and reports the max abs action error against the export dtype's bound.
//!
//! One file a concern: `inputs` (seeded inputs) and this module (the stages, the bounds, the
//! comparison and the report). Running a bundle is [`crate::bundle`]'s; what `--checkpoint`
//! names, [`crate::checkpoint`]'s.

mod inputs;

use std::path::PathBuf;
use std::time::Duration;

use petite_pi05::Precision;
use petite_pi05::inputs::{Inputs, check_weights, open_checkpoint};
use petite_weights::WeightSource;
use serde_json::json;

use crate::bundle::BundleKind;
use crate::memory::Recorder;
use crate::runtimes::Device;
use crate::{Error, Result};

pub use inputs::seeded_inputs;

/// Settings of one verification.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// The export directory: `prefix.pte` and `step.pte`, or `pi05.onnx` (and `report.json`,
    /// extended).
    pub dir: PathBuf,
    /// The original checkpoint (for the f32 reference).
    pub checkpoint: PathBuf,
    /// pi0.5 config JSON (`None`: the real pi0.5).
    pub config: Option<PathBuf>,
    /// Inputs safetensors (`petite pi05 run`'s format); `None`: seeded inputs.
    pub inputs: Option<PathBuf>,
    /// Seed of the generated inputs.
    pub seed: u64,
    /// Python with executorch-numpy-runtime for portable `.pte` files (`None`: [`crate::bundle::find_python`]).
    pub python: Option<PathBuf>,
    /// Largest acceptable max abs action error (recorded; [`VerifyResult::within_bound`]);
    /// `None`: the bound for the export's dtype as its `report.json` records it
    /// ([`default_bound`]).
    pub max_error: Option<f32>,
    /// Where the engines and the f32 reference run (`cuda`: both on GPU 0, through
    /// petite-cuda; only engine exports, not portable or ONNX ones).
    pub device: Device,
    /// Whether the engines and the f32 reference run one after the other or at once.
    pub stages: Stages,
}

/// How `petite verify`'s two stages — the export's engines and the f32 reference — share the
/// machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Stages {
    /// At once where that was measured faster and the memory holds both: an engine export on
    /// `--device cuda` whose engines and reference fit the GPU's free memory together (the two
    /// stages then read the disk at once, which gives more than one reader), or any export on the
    /// CPU where the machine has 6 GiB of memory for them (one stage's idle moments go to the
    /// other); otherwise one after the other.
    #[default]
    Auto,
    /// One after the other: the engines' memory is given back before the reference's is taken
    /// (what a device with one small memory pool needs).
    Serial,
    /// At once, in two threads, whatever the memory (the caller knows it holds both). An error
    /// of either stage is reported once both have ended.
    Concurrent,
}

/// Device memory `--stages auto` keeps free beyond both stages' weights on the GPU: the
/// reference's values (the f32 prefix's peak is ~0.3 GiB over its weights), the engines' and
/// cuBLAS's workspaces, the staging of two loaders.
const CONCURRENT_MARGIN: u64 = 1 << 30;

/// `--stages auto` on the GPU: at once when the engines' and the reference's weights and
/// [`CONCURRENT_MARGIN`] fit in `free` bytes.
fn fit_on_gpu(engines: u64, reference: u64, free: u64) -> (bool, String) {
    let need = engines
        .saturating_add(reference)
        .saturating_add(CONCURRENT_MARGIN);
    let h = petite_weights::human_bytes;
    let (e, r, f) = (h(engines), h(reference), h(free));
    if need <= free {
        (
            true,
            format!(
                "at once: the engines ({e}) and the f32 reference ({r}) fit the GPU's {f} free"
            ),
        )
    } else {
        (
            false,
            format!(
                "one after the other: the engines ({e}) and the f32 reference ({r}) need {} together, the GPU has {f} free",
                h(need)
            ),
        )
    }
}

/// Memory `--stages auto` wants on the CPU before it runs both stages at once: together they
/// peaked at 2.2 GB of RSS on the full-size export (1.34 GB one after the other; mostly the
/// weights' file pages), and the page cache the weights stream through needs room beside them.
const CPU_CONCURRENT_MEMORY: u64 = 6 << 30;

/// `--stages auto` on the CPU: at once where the machine's memory (`machine`: the cgroup limit
/// or what is available, [`crate::memory::machine_memory`]) is at least
/// [`CPU_CONCURRENT_MEMORY`] — the idle moments of one stage (the steps' small ops) go to the
/// other: a full-size verify 2–3% faster in 7 of 8 alternating pairs (docs/MEASUREMENTS.md) —
/// else one after the other (a small device's one memory pool).
fn fit_on_cpu(machine: Option<(&str, u64)>) -> (bool, String) {
    let h = petite_weights::human_bytes;
    match machine {
        Some((what, m)) if m >= CPU_CONCURRENT_MEMORY => (
            true,
            format!(
                "on the CPU at once: the {what} ({}) holds both stages (at least {})",
                h(m),
                h(CPU_CONCURRENT_MEMORY)
            ),
        ),
        Some((what, m)) => (
            false,
            format!(
                "on the CPU one after the other: the {what} ({}) is under {}",
                h(m),
                h(CPU_CONCURRENT_MEMORY)
            ),
        ),
        None => (
            false,
            "on the CPU one after the other: the machine's memory is unknown".into(),
        ),
    }
}

/// Whether the stages run at once, and why (a line for the report and the progress output).
/// `engines`: the bytes of the export's `.pte` files (an upper bound of its engines' weights);
/// `reference`: the f32 programs' weight bytes.
fn stages_at_once(
    stages: Stages,
    device: Device,
    kind: BundleKind,
    engines: u64,
    reference: u64,
) -> Result<(bool, String)> {
    Ok(match (stages, device, kind) {
        (Stages::Serial, ..) => (false, "--stages serial".into()),
        (Stages::Concurrent, ..) => (true, "--stages concurrent".into()),
        (Stages::Auto, d, _) if d.is_host() => fit_on_cpu(crate::memory::machine_memory()),
        (Stages::Auto, d, BundleKind::Engines) => {
            fit_on_gpu(engines, reference, d.spec().free_memory()?)
        }
        (Stages::Auto, _, _) => (false, "one after the other".into()),
    })
}

/// The max abs action error an f32 export must meet by default: it equals the reference to
/// ~1e-6 (goldens 2.4e-7 – 8.6e-7, full size 1.04e-6), and the smallest real mistake the goldens
/// catch is 2.6e-4.
pub const F32_MAX_ERROR: f32 = 1e-4;

/// The bound `petite verify` applies when none is given, and why: [`F32_MAX_ERROR`] for an
/// export whose report says `"dtype": "f32"`, [`DEFAULT_MAX_ERROR`] for bf16 and for an export
/// whose dtype is not recorded (a directory without its `report.json`).
pub fn default_bound(dtype: Option<&str>, weights: Option<&str>) -> (f32, String) {
    match (weights, dtype) {
        (Some("int8"), _) => (INT8_MAX_ERROR, "int8 weights (report.json)".into()),
        (Some("fp8"), _) => (FP8_MAX_ERROR, "fp8 weights (report.json)".into()),
        (_, dtype) => default_dtype_bound(dtype),
    }
}

fn default_dtype_bound(dtype: Option<&str>) -> (f32, String) {
    match dtype {
        Some("f32") => (F32_MAX_ERROR, "f32 export (report.json)".into()),
        Some(d) => (DEFAULT_MAX_ERROR, format!("{d} export (report.json)")),
        None => (
            DEFAULT_MAX_ERROR,
            "dtype not recorded (no report.json): the bf16 bound".into(),
        ),
    }
}

/// The max abs action error `petite verify` (and `cargo xtask export-pi05`, which runs it)
/// accepts unless told otherwise: the bf16-vs-f32 bound. A bf16 export rounds weights and
/// activations to 8 mantissa bits; lerobot's own bf16 mode lands 8.0e-3 – 9.6e-3 from its f32
/// actions on the goldens. Measured for petite's bf16 exports against the f32 reference: engine
/// backends ≤ 2.5e-2 on the goldens (the bound of `tests/export.rs`) and 1.78e-2 on
/// the full-size synthetic pi0.5 (|actions| up to 4.5); `--backend portable`, whose kernels round
/// inside each matmul, up to 2.95e-2 — its conformance bound is this same 5e-2. So every bf16
/// export passes with margin, while the mistakes the goldens show (a mask ignored: 7.4e-2 –
/// 8.3e-2; 11 Euler steps instead of 10: 0.6 – 0.95) fail. An f32 export equals the reference
/// to ~1e-6: check it with `--max-error 1e-4`.
pub const DEFAULT_MAX_ERROR: f32 = 5e-2;

/// The default bound of an export with `--weights int8` (bf16 activations). Measured on the
/// three goldens × seeds 0–5 against the f32 reference (session 31, bf16-exact scales): int8
/// 3.2e-2 mean, 5.1e-2 max but for one input, three_cams_masked_gqa's seed 5: 1.9e-1 there,
/// where bf16 alone is 5.2e-2, over [`DEFAULT_MAX_ERROR`] too (a sensitive input, not a
/// quantization fault: its 24 seeds' int8 median is 2.2e-2). 1e-1 keeps 2× the rest. Random
/// weights have no outlier channels; a trained checkpoint's error is its own and `petite
/// verify` measures it.
pub const INT8_MAX_ERROR: f32 = 1e-1;

/// The default bound of an export with `--weights fp8` (E4M3: 3 mantissa bits, a relative
/// rounding of up to 1/16 a weight). Measured as [`INT8_MAX_ERROR`]: 8.9e-2 mean, 2.25e-1
/// max (the same sensitive input); 5e-1 keeps 2.2×. At this noise a mistake of the size the goldens show (a mask
/// ignored: 7.4e-2 – 8.3e-2) is not told apart: check a change's correctness on bf16.
pub const FP8_MAX_ERROR: f32 = 5e-1;

/// What a verification measured.
#[derive(Debug, Clone)]
pub struct VerifyResult {
    /// The config the run used (`--config`, else the checkpoint folder's, else the real
    /// pi0.5): the actions' shape.
    pub cfg: petite_pi05::Pi05Config,
    /// Actions of the exported programs, f32 `[chunk, action_dim]`.
    pub actions: Vec<f32>,
    /// Actions of the f32 reference.
    pub reference: Vec<f32>,
    /// max |actions − reference| (finite: non-finite actions are an error, not a result).
    pub max_abs_error: f32,
    /// max |reference|, for scale.
    pub max_abs_reference: f32,
    /// `max_abs_error <= max_error`.
    pub within_bound: bool,
    /// The bound applied: `--max-error`, or [`default_bound`]'s for the export's dtype.
    pub max_error: f32,
    /// Where the bound came from, for the user (`--max-error`, `f32 export (report.json)`, ...).
    pub bound_source: String,
    /// For an export with quantized weights: the format and each layer group's weight error
    /// against the checkpoint ([`petite_pi05::quant::weight_errors`]).
    pub weight_groups: Option<(String, Vec<petite_pi05::quant::GroupError>)>,
    /// Everything as JSON (also written to `report.json` under `verify`).
    pub json: serde_json::Value,
}

/// `petite verify`: the export's actions against the f32 reference; the result is also written
/// into the export directory's `report.json` (not when it is missing: nothing to add it to).
pub fn verify(opts: &VerifyOptions) -> Result<VerifyResult> {
    // `--device cuda` where CUDA cannot run is refused before anything is read.
    opts.device.check()?;
    let rec = Recorder::start(Duration::from_millis(10));
    // Files of two exports are never run together.
    crate::bundle::check_bundle(&opts.dir)?;
    // The export's report: its dtype picks the default bound, and the verify result is merged
    // into it. Missing is said in one line (files copied without it: the result is not
    // recorded); unreadable is an error naming it, never replaced by an empty report.
    let report = opts.dir.join(crate::report::FILE);
    let prior = match std::fs::metadata(&report) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!(
                "petite: {}: not found (the export's dtype is unknown and this result is not recorded)",
                report.display()
            );
            None
        }
        _ => Some(crate::report::Report::read(&report)?),
    };
    let (max_error, bound_source) = match opts.max_error {
        Some(e) => (e, "--max-error".to_string()),
        None => default_bound(
            prior.as_ref().map(|r| r.dtype.as_str()),
            prior
                .as_ref()
                .and_then(|r| r.quantization.as_ref())
                .map(|q| q.weights.as_str()),
        ),
    };
    let resolved = crate::checkpoint::resolve(&opts.checkpoint, opts.config.as_deref(), false)?;
    let cfg = resolved.cfg.clone();
    let (inputs, inputs_desc) = match &opts.inputs {
        Some(p) => (Inputs::from_file(p, &cfg)?, p.display().to_string()),
        None => (
            seeded_inputs(&cfg, opts.seed),
            format!("seeded ({})", opts.seed),
        ),
    };
    // The checkpoint is checked first: a wrong one fails before any work.
    let ck = open_checkpoint(&resolved.weights)?;
    crate::checkpoint::check_against_weights(&resolved, &ck)?;
    let f32_progs = petite_pi05::build_all(&cfg, Precision::F32)?;
    check_weights(
        &ck,
        &resolved.weights.display().to_string(),
        [
            &f32_progs.timestep_table,
            &f32_progs.prefix,
            &f32_progs.step,
        ],
    )?;
    let reference_bytes = [
        &f32_progs.timestep_table,
        &f32_progs.prefix,
        &f32_progs.step,
    ]
    .iter()
    .map(|p| p.weight_bytes() as u64)
    .sum::<u64>();
    drop(f32_progs);

    // What the directory holds, checked against the config and its runtime found, before
    // anything runs (the one bundle runner `petite act` shares).
    let bundle =
        crate::bundle::BundleRunner::prepare(&opts.dir, &cfg, opts.python.as_deref(), opts.device)?;
    let kind = bundle.kind();
    let stage_name = if kind == BundleKind::Onnx {
        "onnx"
    } else {
        "pte"
    };
    // What the engines can upload at most: the `.pte` files' bytes.
    let export_bytes = crate::layout::PTES
        .iter()
        .map(|f| std::fs::metadata(opts.dir.join(f)).map_or(0, |m| m.len()))
        .sum::<u64>();
    let (at_once, why) = stages_at_once(
        opts.stages,
        opts.device,
        kind,
        export_bytes,
        reference_bytes,
    )?;
    eprintln!("petite verify: the export's {stage_name} and the f32 reference: {why}");
    let reference_stage =
        || -> Result<Vec<f32>> { opts.device.spec().f32_reference(&cfg, &ck, &inputs) };
    let ((actions, runtime), reference, pte_rec, ref_rec) = if at_once {
        // Both stages begin now; while they overlap, each record's peaks and bytes are the
        // process's over its span.
        let (st, rt) = (rec.begin(stage_name), rec.begin("reference"));
        std::thread::scope(|s| -> Result<_> {
            let h = s.spawn(|| {
                let r = reference_stage();
                (r, rec.end(rt, false))
            });
            let ran = bundle.run(&cfg, &inputs, opts.inputs.as_deref());
            let pte_rec = rec.end(st, false);
            let (reference, ref_rec) = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
            Ok((ran?, reference?, pte_rec, ref_rec))
        })?
    } else {
        let st = rec.begin(stage_name);
        // The engines' runtimes (and their device memory) are gone when it returns, before the
        // reference's arrives.
        let ran = bundle.run(&cfg, &inputs, opts.inputs.as_deref())?;
        let pte_rec = rec.end(st, false);
        let st = rec.begin("reference");
        let reference = reference_stage()?;
        let ref_rec = rec.end(st, false);
        (ran, reference, pte_rec, ref_rec)
    };
    let compared = action_error(&actions, &reference);
    // Quantized weights: what the codes lose of each layer group, from the checkpoint's rows
    // by the export's rule (the actions above check the codes the engines hold).
    let weight_groups = match prior.as_ref().and_then(|r| r.quantization.as_ref()) {
        Some(qr) => {
            let q = petite_graph::quant::Quant::parse(&qr.weights).ok_or_else(|| Error::Input {
                path: report.display().to_string(),
                reason: format!("quantization `{}`: expected int8 or fp8", qr.weights),
            })?;
            let progs = petite_pi05::build_all(&cfg, Precision::Bf16)?;
            let names = petite_pi05::quant::quantize(&progs, q, &qr.skip)?.1.names;
            let groups = petite_pi05::quant::weight_errors(
                &ck,
                &names,
                q,
                petite_pi05::quant::Granularity::PerRow,
            )?;
            Some((qr.weights.clone(), groups))
        }
        None => None,
    };
    // The scale, through the shared fold: a non-finite reference has none (null in the report).
    let scale = petite_reference::compare::max_abs(&reference);
    let within_bound = compared.as_ref().is_ok_and(|&e| e <= max_error);
    let j = json!({
        "pte_dir": opts.dir.display().to_string(),
        "checkpoint": opts.checkpoint.display().to_string(),
        "inputs": inputs_desc,
        "backend": kind.name(),
        "device": opts.device.name(),
        "reference_device": opts.device.name(),
        "run": runtime,
        // null (and `error` set) when the actions could not be compared (NaN, inf, length).
        "max_abs_action_error": compared.as_ref().ok(),
        "error": compared.as_ref().err().map(ToString::to_string),
        // As written on the command line (5e-2, not f32's 0.05000000074505806).
        "max_error": max_error.to_string().parse::<f64>().unwrap_or(f64::NAN),
        "bound": bound_source,
        "within_bound": within_bound,
        "max_abs_reference_action": scale.as_ref().ok(),
        "stages": [pte_rec, ref_rec],
        // Whether the two stages ran at once (then their spans overlap) and why.
        "stages_at_once": at_once,
        "stages_why": why,
        "weight_groups": weight_groups.as_ref().map(|(q, g)| json!({"weights": q, "groups": g})),
    });
    // Nothing is reported from a checkpoint that changed while it was read.
    ck.check_unchanged()?;
    if let Some(mut full) = prior {
        full.verify = Some(j.clone());
        full.write(&report)?;
    }
    let max_abs_error = compared?;
    let max_abs_reference = scale.map_err(|why| Error::Accuracy {
        what: "the f32 reference actions".into(),
        why,
    })?;
    Ok(VerifyResult {
        cfg,
        actions,
        reference,
        max_abs_error,
        max_abs_reference,
        within_bound,
        max_error,
        bound_source,
        weight_groups,
        json: j,
    })
}

/// max |actions − reference| through the one shared fold ([`petite_reference::max_abs_diff`]):
/// a NaN or ±inf anywhere in either, or a length mismatch, is an error, never a number.
pub fn action_error(actions: &[f32], reference: &[f32]) -> Result<f32> {
    petite_reference::max_abs_diff(actions, reference).map_err(|why| Error::Accuracy {
        what: "exported actions (actual) vs the f32 reference (expected)".into(),
        why,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--stages`: serial and concurrent as asked on any device and export; auto one after the
    /// other on the CPU, and on the GPU at once exactly when both stages fit its free memory.
    #[test]
    fn stages_run_at_once_only_where_asked_or_where_both_fit_the_gpu() {
        use crate::bundle::BundleKind;
        const G: u64 = 1 << 30;
        for kind in [BundleKind::Engines, BundleKind::Portable, BundleKind::Onnx] {
            for &device in crate::runtimes::devices() {
                let at = |s| stages_at_once(s, device, kind, 7 * G, 12 * G).unwrap();
                assert_eq!(at(Stages::Serial), (false, "--stages serial".into()));
                assert_eq!(at(Stages::Concurrent), (true, "--stages concurrent".into()));
                if device.is_host() {
                    let (_, why) = at(Stages::Auto);
                    assert!(why.contains("on the CPU"), "{why}");
                }
            }
        }
        // Auto on the CPU: at once from CPU_CONCURRENT_MEMORY, to the byte; unknown: one after
        // the other.
        let m = super::CPU_CONCURRENT_MEMORY;
        let (once, why) = fit_on_cpu(Some(("memory available", m)));
        assert!(
            once && why.contains("at once") && why.contains("6.00 GiB"),
            "{why}"
        );
        let (once, why) = fit_on_cpu(Some(("cgroup memory limit", m - 1)));
        assert!(!once && why.contains("cgroup memory limit"), "{why}");
        assert!(!fit_on_cpu(None).0);
        // Auto on the GPU: both stages' weights and the margin, to the byte.
        let need = 7 * G + 12 * G + super::CONCURRENT_MARGIN;
        let (once, why) = fit_on_gpu(7 * G, 12 * G, need);
        assert!(once, "{why}");
        assert!(
            why.contains("7.00 GiB") && why.contains("12.00 GiB"),
            "{why}"
        );
        let (once, why) = fit_on_gpu(7 * G, 12 * G, need - 1);
        assert!(!once && why.contains("need 20.00 GiB"), "{why}");
        assert!(
            !fit_on_gpu(u64::MAX, u64::MAX, u64::MAX - 1).0,
            "no overflow"
        );
        // Small exports (the goldens) in units that say something.
        let (_, why) = fit_on_gpu(3 << 20, 5 << 20, 100 * G);
        assert!(why.contains("3.0 MiB") && why.contains("5.0 MiB"), "{why}");
    }

    /// The fold `petite verify` reports: NaN, +inf or -inf at the first, a middle or the last
    /// position of either side fails (the old fold lost a NaN unless it was last), as does a
    /// length mismatch; clean values give the largest difference.
    #[test]
    fn action_error_fails_on_any_non_finite_value_or_length_mismatch() {
        let clean = [0.5f32, -1.0, 2.0, 3.0, -4.0];
        assert_eq!(
            action_error(&clean, &[0.5, -1.0, 2.25, 3.0, -4.0]).unwrap(),
            0.25
        );
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for i in [0, 2, 4] {
                let mut dirty = clean;
                dirty[i] = bad;
                for (a, r) in [(&dirty, &clean), (&clean, &dirty)] {
                    let err = action_error(a, r).unwrap_err().to_string();
                    assert!(
                        err.contains(&format!("index {i}")) && err.contains("f32 reference"),
                        "{err}"
                    );
                    if bad.is_nan() {
                        assert!(err.contains("NaN"), "{err}");
                    }
                }
            }
        }
        let err = action_error(&clean, &clean[..4]).unwrap_err().to_string();
        assert!(err.contains("length mismatch"), "{err}");
        assert!(action_error(&clean[..4], &clean).is_err());
    }
}
