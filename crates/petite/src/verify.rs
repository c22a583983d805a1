//! `petite verify`: runs an export's `prefix.pte` and `step.pte` (through petite-pte's reader)
//! with the engines' runtime — each engine mapped in place from its `.pte` segment, never read
//! into memory — then the f32 reference from the original checkpoint on the same inputs, and
//! reports the max abs action error.
//!
//! Only the reference backend's engines run here; a `.pte` with another backend's delegates is
//! refused by name. Portable `.pte` files (plain kernel calls, `--backend portable`) run in
//! ExecuTorch's own runtime instead: a separate Python process with executorch-numpy-runtime,
//! driven by the script embedded in this binary ([`run_portable`]). An ONNX export
//! (`--backend onnx`: `pi05.onnx`, no `.pte`) runs in ONNX Runtime the same way ([`run_onnx`]).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use petite_graph::Program;
use petite_pi05::inputs::{Inputs, check_weights, open_checkpoint};
use petite_pi05::programs::io;
use petite_pi05::{Pi05Config, Precision, build_prefix, build_step};
use petite_pte::PteFile;
use petite_pte::model::{DataLocation, EValue, Instruction, ScalarType};
use petite_reference::Tensor;
use petite_weights::{FileIdentity, Role, WeightSource};
use serde_json::json;

use petite_engine::EngineRuntime;

use crate::engines::REFERENCE_ID;
use crate::export::{METHOD, TABLE_METHOD};
use crate::memory::Recorder;
use crate::runtimes::{Device, Runtime};
use crate::{Error, Result};

/// Settings of one verification.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// Directory holding `prefix.pte` and `step.pte` (and `report.json`, extended).
    pub pte_dir: PathBuf,
    /// The original checkpoint (for the f32 reference).
    pub checkpoint: PathBuf,
    /// pi0.5 config JSON (`None`: the real pi0.5).
    pub config: Option<PathBuf>,
    /// Inputs safetensors (`petite pi05 run`'s format); `None`: seeded inputs.
    pub inputs: Option<PathBuf>,
    /// Seed of the generated inputs.
    pub seed: u64,
    /// Python with executorch-numpy-runtime for portable `.pte` files (`None`: [`find_python`]).
    pub python: Option<PathBuf>,
    /// Largest acceptable max abs action error (recorded; [`VerifyResult::within_bound`]);
    /// `None`: the bound for the export's dtype as its `report.json` records it
    /// ([`default_bound`]).
    pub max_error: Option<f32>,
    /// Where the engines and the f32 reference run (`cuda`: both on GPU 0, through
    /// petite-cuda; only engine exports, not portable or ONNX ones).
    pub device: Device,
}

/// The max abs action error an f32 export must meet by default: it equals the reference to
/// ~1e-6 (goldens 2.4e-7 – 8.6e-7, full size 1.04e-6), and the smallest real mistake the goldens
/// catch is 2.6e-4.
pub const F32_MAX_ERROR: f32 = 1e-4;

/// The bound `petite verify` applies when none is given, and why: [`F32_MAX_ERROR`] for an
/// export whose report says `"dtype": "f32"`, [`DEFAULT_MAX_ERROR`] for bf16 and for an export
/// whose dtype is not recorded (a directory without its `report.json`).
pub fn default_bound(dtype: Option<&str>) -> (f32, String) {
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

/// What a verification measured.
#[derive(Debug, Clone)]
pub struct VerifyResult {
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
    /// Everything as JSON (also written to `report.json` under `verify`).
    pub json: serde_json::Value,
}

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
    }
}

fn bad(path: &Path, reason: impl Into<String>) -> Error {
    Error::BadPte {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// A `.pte` opened for running: the reader's verified program and its engines, each opened
/// once per segment by the runtime registered for the delegates' backend on the device asked
/// for ([`crate::runtimes`]; `release`: each weight's host pages given back after its last read
/// in a run).
struct Loaded<'m> {
    pte: &'m PteFile,
    engines: HashMap<usize, Box<dyn EngineRuntime + 'm>>,
}

fn graph_dtype(s: ScalarType) -> Option<petite_graph::Dtype> {
    use petite_graph::Dtype as D;
    Some(match s {
        ScalarType::FLOAT => D::F32,
        ScalarType::BFLOAT16 => D::Bf16,
        ScalarType::HALF => D::F16,
        ScalarType::LONG => D::I64,
        ScalarType::INT => D::I32,
        ScalarType::BYTE => D::U8,
        ScalarType::BOOL => D::Bool,
        _ => return None,
    })
}

impl<'m> Loaded<'m> {
    fn new(pte: &'m PteFile, release: bool, runtime: &'m dyn Runtime) -> Result<Self> {
        let plan = method(pte, METHOD)?;
        let mut engines = HashMap::new();
        for (i, d) in plan.delegates.iter().enumerate() {
            if d.id != REFERENCE_ID {
                return Err(bad(
                    pte.path(),
                    format!(
                        "delegate {i} is for backend `{}`; only `{REFERENCE_ID}` engines run here",
                        d.id
                    ),
                ));
            }
            if d.processed.location != DataLocation::SEGMENT {
                return Err(bad(
                    pte.path(),
                    format!("delegate {i}: engine not in a segment"),
                ));
            }
            let seg = d.processed.index as usize;
            if let std::collections::hash_map::Entry::Vacant(v) = engines.entry(seg) {
                let (start, len) = pte.segment_range(seg)?;
                let e = runtime
                    .open(pte.path(), start, len, release)
                    .map_err(|e| bad(pte.path(), format!("segment {seg}: {e}")))?;
                v.insert(e);
            }
        }
        Ok(Loaded { pte, engines })
    }

    /// Runs `forward` on `inputs` (the method's inputs, in order); returns its outputs.
    fn run(&self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let plan = method(self.pte, METHOD)?;
        let path = self.pte.path();
        if inputs.len() != plan.inputs.len() {
            return Err(bad(
                path,
                format!(
                    "method takes {} inputs, given {}",
                    plan.inputs.len(),
                    inputs.len()
                ),
            ));
        }
        let mut values: HashMap<i32, Tensor> = HashMap::new();
        for (k, (&vi, t)) in plan.inputs.iter().zip(inputs).enumerate() {
            let Some(EValue::Tensor(decl)) = plan.values.get(vi as usize) else {
                return Err(bad(path, format!("input {k} is not a tensor value")));
            };
            let sizes: Vec<usize> = decl.sizes.iter().map(|&d| d as usize).collect();
            if graph_dtype(decl.scalar_type) != Some(t.dtype()) || sizes != t.shape() {
                return Err(bad(
                    path,
                    format!(
                        "input {k}: the .pte declares {:?}{sizes:?}, the config gives {}{:?} \
                         (was it exported with another config?)",
                        decl.scalar_type,
                        t.dtype(),
                        t.shape()
                    ),
                ));
            }
            values.insert(vi, t);
        }
        for chain in &plan.chains {
            for ins in &chain.instructions {
                let Instruction::DelegateCall {
                    delegate_index,
                    args,
                } = ins
                else {
                    return Err(bad(path, "only delegate calls are expected"));
                };
                let d = &plan.delegates[*delegate_index as usize];
                let e = &self.engines[&(d.processed.index as usize)];
                let n_in = e.inputs().len();
                if args.len() != n_in + e.outputs().len() {
                    return Err(bad(
                        path,
                        format!(
                            "delegate {delegate_index}: {} args for an engine with {} inputs and {} outputs",
                            args.len(),
                            n_in,
                            e.outputs().len()
                        ),
                    ));
                }
                let mut ins = BTreeMap::new();
                for (b, a) in e.inputs().iter().zip(&args[..n_in]) {
                    let t = values.get(a).cloned().ok_or_else(|| {
                        bad(path, format!("value {a} is read before it is written"))
                    })?;
                    ins.insert(b.name.clone(), t);
                }
                let mut outs = e.run(ins)?;
                for (o, a) in e.outputs().iter().zip(&args[n_in..]) {
                    let t = outs.remove(&o.name).ok_or_else(|| {
                        bad(path, format!("engine produced no output `{}`", o.name))
                    })?;
                    values.insert(*a, t);
                }
            }
        }
        plan.outputs
            .iter()
            .map(|o| {
                values
                    .get(o)
                    .cloned()
                    .ok_or_else(|| bad(path, format!("output value {o} is never written")))
            })
            .collect()
    }
}

fn method<'a>(pte: &'a PteFile, name: &str) -> Result<&'a petite_pte::model::ExecutionPlan> {
    pte.program()
        .execution_plan
        .iter()
        .find(|p| p.name == name)
        .ok_or_else(|| bad(pte.path(), format!("no method `{name}`")))
}

/// Reads the timestep table (a constant tensor output of method `timestep_table`).
fn read_table(pte: &PteFile, steps: usize, r: usize) -> Result<Vec<f32>> {
    let plan = method(pte, TABLE_METHOD)?;
    let path = pte.path();
    let Some(EValue::Tensor(t)) = plan
        .outputs
        .first()
        .and_then(|&o| plan.values.get(o as usize))
    else {
        return Err(bad(path, "timestep_table: output is not a tensor"));
    };
    if t.scalar_type != ScalarType::FLOAT || t.sizes != [steps as i32, r as i32] {
        return Err(bad(
            path,
            format!(
                "timestep_table: expected FLOAT [{steps}, {r}], found {:?} {:?}",
                t.scalar_type, t.sizes
            ),
        ));
    }
    let cs = pte
        .program()
        .constant_segment
        .as_ref()
        .ok_or_else(|| bad(path, "no constant segment"))?;
    let off = *cs
        .offsets
        .get(t.data_buffer_idx as usize)
        .ok_or_else(|| bad(path, "timestep_table: constant index out of range"))?;
    let mut buf = vec![0u8; steps * r * 4];
    pte.read_segment_at(cs.segment_index as usize, off, &mut buf)?;
    Ok(buf
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Runs the exported programs from their `.pte` files on `inputs` with `runtime`'s engines;
/// returns the actions.
pub fn run_pte(
    pte_dir: &Path,
    cfg: &Pi05Config,
    inputs: &Inputs,
    runtime: &dyn Runtime,
) -> Result<Vec<f32>> {
    let prefix_path = pte_dir.join("prefix.pte");
    let step_path = pte_dir.join("step.pte");
    let prefix_pte = PteFile::open(&prefix_path)?;
    let step_pte = PteFile::open(&step_path)?;
    // Identities before the engines are mapped: the actions below came from these files only
    // if they are still the files at the end.
    let identity = |p: &Path| -> Result<FileIdentity> {
        let md = std::fs::metadata(p).map_err(|e| Error::io(p, "stat", e))?;
        Ok(FileIdentity::of(&md))
    };
    let (prefix_id, step_id) = (identity(&prefix_path)?, identity(&step_path)?);
    // The prefix runs once: its weights go after their last read. The step runs every
    // Euler step: its weights stay.
    let prefix = Loaded::new(&prefix_pte, true, runtime)?;
    let step = Loaded::new(&step_pte, false, runtime)?;
    // Tests truncate a `.pte` here, while its engines are mapped.
    crate::guard::stop_point("verify");
    let r = petite_pi05::programs::time_row_len(cfg);
    let table = read_table(&step_pte, cfg.steps, r)?;

    let s = cfg.vision.image_size;
    let pprog = build_prefix(cfg, Precision::F32)?;
    let mut by_name: BTreeMap<&str, Tensor> = BTreeMap::new();
    by_name.insert(
        io::IMAGES,
        Tensor::f32(&[cfg.cameras, 3, s, s], inputs.images.clone())?,
    );
    by_name.insert(
        io::IMAGE_MASKS,
        Tensor::u8(&[cfg.cameras], inputs.image_masks.clone())?,
    );
    by_name.insert(
        io::TOKENS,
        Tensor::i64(&[cfg.tokens], inputs.tokens.clone())?,
    );
    by_name.insert(
        io::TOKEN_MASK,
        Tensor::u8(&[cfg.tokens], inputs.token_mask.clone())?,
    );
    let ordered = |prog: &Program, by: &mut BTreeMap<&str, Tensor>| -> Result<Vec<Tensor>> {
        prog.inputs
            .iter()
            .map(|&id| {
                let n = prog.input_name(id).unwrap_or_default();
                by.get(n)
                    .cloned()
                    .ok_or_else(|| Error::Usage(format!("no value for program input `{n}`")))
            })
            .collect()
    };
    let pouts = prefix.run(ordered(&pprog, &mut by_name)?)?;
    let mut kv: BTreeMap<String, Tensor> = BTreeMap::new();
    for (o, t) in pprog.outputs.iter().zip(pouts) {
        kv.insert(o.name.clone(), t);
    }
    drop(prefix);

    let sprog = build_step(cfg, Precision::F32)?;
    let mut x = inputs.noise.clone();
    for k in 0..cfg.steps {
        let mut ins: BTreeMap<&str, Tensor> =
            kv.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
        ins.insert(io::X_T, Tensor::f32(&[cfg.chunk, cfg.action_dim], x)?);
        ins.insert(
            io::TIME_ROW,
            Tensor::f32(&[r], table[k * r..(k + 1) * r].to_vec())?,
        );
        let outs = step.run(ordered(&sprog, &mut ins)?)?;
        let xi = sprog
            .outputs
            .iter()
            .position(|o| o.name == io::X_NEXT)
            .ok_or_else(|| Error::Usage("step program has no x_next".into()))?;
        x = outs
            .into_iter()
            .nth(xi)
            .and_then(|t| t.into_float_values().ok())
            .ok_or_else(|| bad(&step_path, "x_next is not a float tensor"))?;
    }
    // The actions came from these files only if they are still the files that were mapped.
    prefix_id.check(&prefix_path, Role::Program)?;
    step_id.check(&step_path, Role::Program)?;
    Ok(x)
}

/// `petite verify`: the export's actions against the f32 reference; the result is also written
/// into the pte directory's `report.json` (not when it is missing: nothing to add it to).
pub fn verify(opts: &VerifyOptions) -> Result<VerifyResult> {
    // `--device cuda` where CUDA cannot run is refused before anything is read.
    let engines = crate::runtimes::runtime(REFERENCE_ID, opts.device)?;
    let rec = Recorder::start(Duration::from_millis(10));
    // Files of two exports are never run together.
    crate::bundle::check_bundle(&opts.pte_dir)?;
    // The export's report: its dtype picks the default bound, and the verify result is merged
    // into it. Missing is said in one line (files copied without it: the result is not
    // recorded); unreadable is an error naming it, never replaced by an empty report.
    let report = opts.pte_dir.join(crate::report::FILE);
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
        None => default_bound(prior.as_ref().map(|r| r.dtype.as_str())),
    };
    let resolved = crate::bundle::resolve(&opts.checkpoint, opts.config.as_deref(), false)?;
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
    crate::bundle::check_against_weights(&resolved, &ck)?;
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
    drop(f32_progs);

    let prefix_path = opts.pte_dir.join("prefix.pte");
    // An ONNX export (`pi05.onnx`, no `.pte`) runs in ONNX Runtime: its interface is checked
    // against the config and its dtype against what ONNX Runtime's CPU provider runs, and the
    // Python found, before anything runs.
    let onnx = is_onnx(&opts.pte_dir);
    let ort_python = if onnx {
        check_onnx_spec(&opts.pte_dir, &cfg)?;
        Some(find_ort_python(opts.python.as_deref())?)
    } else {
        None
    };
    let portable = !onnx && is_portable(&PteFile::open(&prefix_path)?);
    if opts.device != Device::Cpu && (onnx || portable) {
        return Err(Error::Usage(format!(
            "--device {} runs petite's engine exports only; this is a{} export (run it with --device cpu)",
            opts.device.name(),
            if onnx { "n ONNX" } else { " portable" }
        )));
    }
    let python = if portable {
        check_specs(&opts.pte_dir, &cfg)?;
        Some(find_python(opts.python.as_deref())?)
    } else {
        None
    };
    let st = rec.begin(if onnx { "onnx" } else { "pte" });
    let (actions, runtime) = match (&ort_python, &python) {
        (Some(py), _) => {
            let (a, j) = run_onnx(&opts.pte_dir, &cfg, &inputs, opts.inputs.as_deref(), py)?;
            (
                a,
                json!({"runtime": "onnxruntime (separate process)", "driver": j}),
            )
        }
        (None, Some(py)) => {
            let (a, j) = run_portable(&opts.pte_dir, &cfg, &inputs, opts.inputs.as_deref(), py)?;
            (
                a,
                json!({"runtime": "executorch-numpy-runtime (separate process)", "driver": j}),
            )
        }
        (None, None) => (
            run_pte(&opts.pte_dir, &cfg, &inputs, engines.as_ref())?,
            json!({"runtime": engines.describe(), "device": opts.device.name()}),
        ),
    };
    // The engines' device memory goes before the reference's arrives.
    drop(engines);
    let pte_rec = rec.end(st, false);
    let st = rec.begin("reference");
    let reference = match opts.device {
        Device::Cpu => petite_pi05::run::run_model(&cfg, &ck, &inputs, Precision::F32)?.actions,
        Device::Cuda => {
            let dev = crate::runtimes::open_cuda()?;
            let policy = crate::cuda_run::CudaPolicy::load(&dev, &cfg, &ck, Precision::F32)?;
            policy.chunk(&inputs)?.0
        }
    };
    let ref_rec = rec.end(st, false);
    let compared = action_error(&actions, &reference);
    // The scale, through the shared fold: a non-finite reference has none (null in the report).
    let scale = petite_reference::compare::max_abs(&reference);
    let within_bound = compared.as_ref().is_ok_and(|&e| e <= max_error);
    let j = json!({
        "pte_dir": opts.pte_dir.display().to_string(),
        "checkpoint": opts.checkpoint.display().to_string(),
        "inputs": inputs_desc,
        "backend": if onnx { "onnx" } else if portable { "portable" } else { "engines" },
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
        actions,
        reference,
        max_abs_error,
        max_abs_reference,
        within_bound,
        max_error,
        bound_source,
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

/// Environment variable naming the Python that runs portable `.pte` files.
pub const PYTHON_ENV: &str = "PETITE_PYTHON";
/// Environment variable naming the Python (with onnxruntime and numpy) that runs ONNX exports.
pub const ORT_PYTHON_ENV: &str = "PETITE_ORT_PYTHON";
/// The ONNX Runtime driver: the whole policy in one `session.run`.
const ORT_DRIVER_PY: &str = include_str!("../../../conformance/onnxruntime/run_pi05_onnx.py");

/// Whether `dir` holds an ONNX export (`pi05.onnx`) and no `prefix.pte`.
pub fn is_onnx(dir: &Path) -> bool {
    dir.join(crate::export::onnx::MODEL).exists() && !dir.join("prefix.pte").exists()
}

/// Checks `pi05.onnx.json` (the interface `petite export --backend onnx` writes) against `cfg`
/// and ONNX Runtime's CPU provider: a bf16 model is refused before anything runs (that
/// provider has no bf16 `Gemm`/`MatMul` kernels: onnxruntime 1.31.1 fails the session with
/// `NOT_IMPLEMENTED ... Gemm(13)`), and every input and the output must have the shapes the
/// config gives, each mismatch one line naming the tensor.
pub fn check_onnx_spec(dir: &Path, cfg: &Pi05Config) -> Result<()> {
    let spec_path = dir.join(crate::export::onnx::SPEC);
    let model = dir.join(crate::export::onnx::MODEL);
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

fn no_ort(detail: &str) -> Error {
    Error::Usage(format!(
        "{detail}: ONNX exports run in ONNX Runtime, which needs a Python with onnxruntime and \
         numpy. Pass --python PATH or set ${ORT_PYTHON_ENV}; `cargo xtask conformance --only \
         onnx` builds one at target/venv-ort, or by hand: python3 -m venv V && V/bin/pip \
         install onnxruntime==1.31.1 numpy"
    ))
}

/// The Python to run ONNX exports with: `explicit`, else `$PETITE_ORT_PYTHON`, else the venv
/// `cargo xtask conformance` builds in this workspace (`target/venv-ort`, if present).
/// Checked: it must import onnxruntime and numpy.
pub fn find_ort_python(explicit: Option<&Path>) -> Result<PathBuf> {
    find_runtime_python(explicit, &ORT_RUNTIME)
}

/// A runtime nobody here wrote, run in a Python child: where its Python is looked for and what
/// it must import (one lookup rule for every such runtime).
struct PyRuntime {
    /// The environment variable naming its Python.
    env: &'static str,
    /// The workspace venv `cargo xtask conformance` builds for it, under `target/`.
    venv: &'static str,
    /// What the Python must import (`import {imports}`), the first one named in errors.
    imports: &'static str,
    /// The one-line refusal, what it is and how to get one, after `detail`.
    missing: fn(&str) -> Error,
}

const ORT_RUNTIME: PyRuntime = PyRuntime {
    env: ORT_PYTHON_ENV,
    venv: "venv-ort",
    imports: "onnxruntime, numpy",
    missing: no_ort,
};

const ET_RUNTIME: PyRuntime = PyRuntime {
    env: PYTHON_ENV,
    venv: "venv-pte",
    imports: "executorch_numpy_runtime, numpy",
    missing: no_python,
};

/// `explicit`, else `$env`, else the workspace venv if present; checked by importing.
fn find_runtime_python(explicit: Option<&Path>, rt: &PyRuntime) -> Result<PathBuf> {
    let python = match (explicit, std::env::var_os(rt.env)) {
        (Some(p), _) => p.to_path_buf(),
        (None, Some(p)) => PathBuf::from(p),
        (None, None) => crate::engines::workspace_venv_python(rt.venv)
            .ok_or_else(|| (rt.missing)("no Python given"))?,
    };
    let out = std::process::Command::new(&python)
        .args(["-c", &format!("import {}", rt.imports)])
        .output()
        .map_err(|e| (rt.missing)(&format!("{}: cannot start: {e}", python.display())))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("").to_string();
        let first = rt.imports.split(',').next().unwrap_or(rt.imports);
        return Err((rt.missing)(&format!(
            "{}: cannot import {first} ({last})",
            python.display()
        )));
    }
    Ok(python)
}

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
    let model = dir.join(crate::export::onnx::MODEL);
    // The model's files are the files that ran only if they are the same at the end.
    let ids: Vec<(PathBuf, FileIdentity)> = [crate::export::onnx::MODEL, crate::export::onnx::DATA]
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
const ET_RUNNER_PY: &str = include_str!("../../../conformance/executorch/et_runner.py");
/// The driver: timestep table, prefix once, step `steps` times, in ExecuTorch's runtime.
const DRIVER_PY: &str = include_str!("../../../conformance/executorch/run_pi05_portable.py");

/// Whether `pte`'s `forward` is portable kernel calls (operators, no delegates).
pub fn is_portable(pte: &PteFile) -> bool {
    method(pte, METHOD).is_ok_and(|p| p.delegates.is_empty() && !p.operators.is_empty())
}

fn no_python(detail: &str) -> Error {
    Error::Usage(format!(
        "{detail}: portable .pte files run in ExecuTorch's runtime, which needs a Python 3.12 \
         with executorch-numpy-runtime 1.4.0 and numpy. Pass --python PATH or set \
         ${PYTHON_ENV}; `cargo xtask conformance` builds one at target/venv-pte, or by hand: \
         python3.12 -m venv V && V/bin/pip install executorch-numpy-runtime==1.4.0"
    ))
}

/// The Python to run portable programs with: `explicit`, else `$PETITE_PYTHON`, else the venv
/// `cargo xtask conformance` builds in this workspace (if present). Checked: it must import
/// executorch-numpy-runtime.
pub fn find_python(explicit: Option<&Path>) -> Result<PathBuf> {
    find_runtime_python(explicit, &ET_RUNTIME)
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
    let (prefix, step) = (pte_dir.join("prefix.pte"), pte_dir.join("step.pte"));
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

#[cfg(test)]
mod tests {
    use super::*;

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
        let err = action_error(&a, &[0.5, 0.0, -2.0, 0.0, 0.0])
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
