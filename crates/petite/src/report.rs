//! `report.json` (written next to the outputs through petite-fs: temporary name, fsync, rename)
//! as serde structs — what every backend's report holds, its own part, the totals computed once
//! ([`Totals::compute`], called by the export driver) — and the one-screen summary table printed
//! at the end of an export. `petite verify` reads the report through the same [`Report`] and adds
//! its result under `verify`.

use std::path::Path;

use petite_engine::BuildMemory;
use serde::{Deserialize, Serialize};

use crate::memory::{StageRecord, human};
use crate::{Error, Result};

/// The file name of the report in an output directory.
pub const FILE: &str = crate::layout::REPORT;

/// `report.json`: the fields every backend's report starts with, the backend's own part
/// (tagged by `backend`), the stages and the totals.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// The petite that wrote it.
    pub petite_version: String,
    /// What was exported.
    pub checkpoint: CheckpointReport,
    /// The config file given (`None`: the checkpoint's own or pi0.5's).
    pub config: Option<String>,
    /// `bf16` or `f32`.
    pub dtype: String,
    /// The backend's name (`reference`, `tensorrt`, `portable`, `onnx`).
    pub backend: String,
    /// The backend's part of the report.
    #[serde(flatten)]
    pub part: BackendPart,
    /// Weight-only quantization (`--weights`), absent when every weight is in `dtype`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization: Option<QuantReport>,
    /// Every stage's measurements, in order.
    pub stages: Vec<StageRecord>,
    /// The export's totals ([`Totals::compute`]).
    pub totals: Totals,
    /// `petite verify`'s result, once it ran on these files.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<serde_json::Value>,
}

/// What `--weights` quantized.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct QuantReport {
    /// `int8` or `fp8`.
    pub weights: String,
    /// The `--quantize-skip` patterns.
    pub skip: Vec<String>,
    /// Checkpoint tensors quantized.
    pub tensors: usize,
    /// Their bytes in the programs' dtype, and as codes and scales.
    pub bytes_before: u64,
    /// Bytes of their codes and scales.
    pub bytes_after: u64,
}

/// The checkpoint an export read.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointReport {
    /// As given on the command line.
    pub path: String,
    /// `lerobot`, `hub`, `hub (model. prefix)` or `unknown`.
    pub layout: String,
    /// Number of safetensors shards.
    pub shards: usize,
    /// The shard files.
    pub files: Vec<String>,
}

/// A backend's part of the report, by what the backend writes (its name is
/// [`Report::backend`], so a new engine backend needs no variant here).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum BackendPart {
    /// An engine backend (reference, TensorRT): engines inside `.pte` delegates.
    Engines(EnginePart),
    /// `--backend portable`.
    Portable(PortablePart),
    /// `--backend onnx`.
    Onnx(OnnxPart),
}

/// The mapping file of an engine or ONNX export.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MappingReport {
    /// Where it is (engine exports: `None` before convert ran).
    pub path: Option<String>,
    /// Whether an earlier run's file was reused.
    pub reused: bool,
    /// Its size.
    pub bytes: u64,
    /// Tensors in it.
    pub tensors: usize,
    /// Seconds the conversion took (`None`: reused).
    pub convert_seconds: Option<f64>,
}

/// The part of an engine backend (reference, TensorRT).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EnginePart {
    /// Per-engine weight cap.
    pub engine_cap: u64,
    /// `--memory-budget`.
    pub memory_budget: Option<u64>,
    /// The export's peak-memory estimate.
    pub memory_estimate: u64,
    /// How many engines could be built at once (`--jobs`, else what the memory budget and the
    /// cores allow).
    #[serde(default)]
    pub jobs: usize,
    /// The most builds that ran at once (0 when every engine was reused).
    #[serde(default)]
    pub max_concurrent_builds: usize,
    /// The builder (tool and version).
    pub builder: String,
    /// `host` or `device cuda:N`.
    pub placement: String,
    /// The builder's settings.
    pub builder_settings: String,
    /// The builder's memory model.
    pub build_memory_model: BuildMemory,
    /// The mapping file; absent where the builder streams every weight from the checkpoint
    /// into the `.pte` and writes none (the reference backend).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mapping: Option<MappingReport>,
    /// The two programs.
    pub programs: EnginePrograms,
    /// Engine counts and bytes.
    pub engines: EngineCounts,
}

/// `prefix.pte` and `step.pte` of an engine export.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EnginePrograms {
    /// `prefix.pte`.
    pub prefix: EngineProgram,
    /// `step.pte`.
    pub step: EngineProgram,
}

/// One `.pte` of an engine export.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineProgram {
    /// Its path.
    pub pte: String,
    /// Its size.
    pub bytes: u64,
    /// Its engines, in plan order.
    pub engines: Vec<EngineRecord>,
    /// Weight bytes of its plan.
    pub weight_bytes: u64,
    /// `step.pte`: the timestep table's `[steps, row length]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestep_table: Option<[usize; 2]>,
}

/// One engine of an engine export.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineRecord {
    /// Its file name.
    pub name: String,
    /// Weight bytes it reads.
    pub weight_bytes: u64,
    /// Of which bf16/f16.
    pub weight_bytes_16bit: u64,
    /// Of which f32 (and other dtypes).
    pub weight_bytes_32bit: u64,
    /// The builder's memory model for it.
    pub build_memory_estimate: u64,
    /// Its file's size.
    pub file_bytes: u64,
    /// Whether it alone exceeds the cap.
    pub over_cap: bool,
    /// Whether an earlier run's file was reused.
    pub reused: bool,
    /// Seconds to build (or check) it.
    pub seconds: f64,
    /// RSS after it.
    pub rss_after: Option<u64>,
    /// A child builder's peak RSS.
    pub builder_peak_rss_bytes: Option<u64>,
    /// A child builder's seconds.
    pub build_s: Option<f64>,
    /// A child builder's plan size.
    pub plan_bytes: Option<u64>,
    /// The compile specs stored with it.
    pub compile_specs: serde_json::Value,
}

/// Engine counts of an engine export.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineCounts {
    /// Built by this run.
    pub built: usize,
    /// Reused from an earlier run.
    pub reused: usize,
    /// Their files' bytes.
    pub bytes: u64,
    /// `--keep-engines`.
    pub kept: bool,
}

/// The part of the portable backend.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PortablePart {
    /// `--memory-budget`.
    pub memory_budget: Option<u64>,
    /// The export's peak-memory estimate.
    pub memory_estimate: u64,
    /// The weights converted into the `.pte`s.
    pub weights: PortableWeights,
    /// The two programs.
    pub programs: PortablePrograms,
}

/// The weights of a portable export, each converted from the checkpoint straight into its
/// place in a `.pte` (no mapping file).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PortableWeights {
    /// Stored weights (a checkpoint tensor once per stored form).
    pub tensors: usize,
    /// Their bytes.
    pub bytes: u64,
    /// Bytes an interrupted earlier run had written into the partial `.pte`s, kept (journaled,
    /// seals matching) rather than converted again.
    pub resumed: u64,
}

/// `prefix.pte` and `step.pte` of a portable export.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PortablePrograms {
    /// `prefix.pte`.
    pub prefix: PortableProgram,
    /// `step.pte`.
    pub step: PortableProgram,
    /// The timestep table's `[steps, row length]`.
    pub timestep_table: [usize; 2],
}

/// One portable `.pte`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PortableProgram {
    /// Its path.
    pub pte: String,
    /// Its size.
    pub bytes: u64,
    /// Its methods (petite-portable's `ExportReport`s).
    pub methods: serde_json::Value,
}

/// The part of the ONNX backend.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OnnxPart {
    /// `--memory-budget`.
    pub memory_budget: Option<u64>,
    /// The export's peak-memory estimate.
    pub memory_estimate: u64,
    /// The mapping file (published as the model's external data).
    pub mapping: MappingReport,
    /// The model and its data.
    pub onnx: OnnxFiles,
}

/// `pi05.onnx` and `pi05.onnx.data`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OnnxFiles {
    /// The model's path.
    pub model: String,
    /// Its size.
    pub model_bytes: u64,
    /// The external data's path.
    pub data: String,
    /// Its size.
    pub data_bytes: Option<u64>,
    /// Whether it was moved from `cache/`.
    pub data_moved_from_cache: Option<bool>,
    /// ONNX opset.
    pub opset: i64,
    /// ONNX IR version.
    pub ir_version: i64,
    /// Initializers (weights) in the model.
    pub initializers: Option<usize>,
    /// Their bytes.
    pub weight_bytes: u64,
    /// Initializers at page-aligned offsets.
    pub initializers_page_aligned: Option<usize>,
    /// Their bytes.
    pub weight_bytes_page_aligned: Option<u64>,
    /// Nodes of the policy program.
    pub program_nodes: Option<usize>,
    /// Denoising steps.
    pub steps: usize,
    /// The timestep table's `[steps, row length]`.
    pub timestep_table: [usize; 2],
}

/// What a backend wrote, for [`Totals::compute`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Written {
    /// Weight bytes the programs hold or read.
    pub weight_bytes: u64,
    /// Mapping-file bytes written by this run (0 when reused; `None`: the backend writes
    /// none).
    pub mapping: Option<u64>,
    /// Bytes of the program files (`.pte`s, or the ONNX model).
    pub programs: u64,
    /// Whether the programs are `.pte`s (else an ONNX model).
    pub pte: bool,
    /// Engine files' bytes (engine backends).
    pub engines: Option<u64>,
}

/// The export's totals. Ratios are per weight byte; which ones a report has depends on what the
/// backend writes (`.pte`s or a model, engine files or none).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Totals {
    /// Wall seconds of the whole export.
    pub seconds: f64,
    /// Weight bytes the programs hold or read.
    pub weight_bytes: u64,
    /// Bytes of the files this run wrote (mapping unless reused, programs, engines).
    pub bytes_written_files: u64,
    /// Storage bytes written (`/proc/self/io`), summed over stages.
    pub bytes_written_storage: u64,
    /// Storage bytes read, summed over stages.
    pub bytes_read_storage: u64,
    /// `.pte` backends with a mapping file: (mapping + `.pte`s) / weight bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_per_weight_byte_mapping_plus_pte: Option<f64>,
    /// Engine backends: all files / weight bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_per_weight_byte_all_files: Option<f64>,
    /// `.pte` backends without engine files (portable; reference, its engines written into
    /// the `.pte`s): `.pte`s / weight bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_per_weight_byte_pte: Option<f64>,
    /// ONNX: (mapping + model) / weight bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_per_weight_byte_mapping_plus_model: Option<f64>,
    /// Peak RSS over the stages.
    pub peak_rss: Option<u64>,
    /// Peak `RssAnon` over the stages.
    pub peak_anon: Option<u64>,
}

impl Totals {
    /// The totals of an export from its stages, its wall time and what its backend wrote: the
    /// one place they are computed.
    pub fn compute(stages: &[StageRecord], seconds: f64, w: &Written) -> Totals {
        let per = |b: u64| b as f64 / w.weight_bytes.max(1) as f64;
        let mapping = w.mapping.unwrap_or(0);
        let files = mapping + w.programs + w.engines.unwrap_or(0);
        let engines = w.engines.is_some();
        Totals {
            seconds,
            weight_bytes: w.weight_bytes,
            bytes_written_files: files,
            bytes_written_storage: stages.iter().map(|s| s.bytes_written).sum(),
            bytes_read_storage: stages.iter().map(|s| s.bytes_read).sum(),
            written_per_weight_byte_mapping_plus_pte: (w.pte && w.mapping.is_some())
                .then(|| per(mapping + w.programs)),
            written_per_weight_byte_all_files: engines.then(|| per(files)),
            written_per_weight_byte_pte: (w.pte && !engines).then(|| per(w.programs)),
            written_per_weight_byte_mapping_plus_model: (!w.pte).then(|| per(mapping + w.programs)),
            peak_rss: stages.iter().map(|s| s.peak_rss).max(),
            peak_anon: stages.iter().map(|s| s.peak_anon).max(),
        }
    }
}

impl Report {
    /// Reads `report.json` at `path`; an unreadable or malformed file is an error naming it
    /// and the cause.
    pub fn read(path: &Path) -> Result<Report> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, "read", e))?;
        serde_json::from_str(&text).map_err(|e| Error::BadJson {
            path: path.display().to_string(),
            reason: e.to_string(),
        })
    }

    /// Writes it to `path` (petite-fs: temporary name, fsync, rename).
    pub fn write(&self, path: &Path) -> Result<()> {
        write_json(path, self)
    }
}

/// Writes `value` as pretty JSON (and a newline) to `path` through petite-fs (temporary name,
/// fsync, rename, fsync of the directory).
pub fn write_json(path: &Path, value: &impl Serialize) -> Result<()> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    Ok(petite_fs::write(path, text.as_bytes())?)
}

/// Reads a JSON file (a spec next to a program).
pub fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, "read", e))?;
    serde_json::from_str(&text).map_err(|e| Error::BadJson {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// The summary table: one row per stage (wall, peak RSS, peak RssAnon, read, written) and a
/// total row (peaks are the maxima over stages).
pub fn table(stages: &[StageRecord], total_seconds: f64) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "{:<12} {:>9} {:>11} {:>11} {:>11} {:>11}\n",
        "stage", "wall", "peak RSS", "peak anon", "read", "written"
    ));
    let row = |name: &str, secs: f64, r: u64, a: u64, rd: u64, wr: u64, tag: &str| {
        format!(
            "{:<12} {:>8.1}s {:>11} {:>11} {:>11} {:>11}{}\n",
            name,
            secs,
            human(r),
            human(a),
            human(rd),
            human(wr),
            tag
        )
    };
    for st in stages {
        s.push_str(&row(
            &st.name,
            st.seconds,
            st.peak_rss,
            st.peak_anon,
            st.bytes_read,
            st.bytes_written,
            if st.reused { "  (reused)" } else { "" },
        ));
    }
    s.push_str(&row(
        "total",
        total_seconds,
        stages.iter().map(|s| s.peak_rss).max().unwrap_or(0),
        stages.iter().map(|s| s.peak_anon).max().unwrap_or(0),
        stages.iter().map(|s| s.bytes_read).sum(),
        stages.iter().map(|s| s.bytes_written).sum(),
        "",
    ));
    s
}

/// The median of `v` (NaN for none): what the timed runs report (`petite act --repeat`,
/// `petite pi05 run --repeat`).
pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn median_of_odd_even_and_none() {
        use super::median;
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    use super::*;

    #[test]
    fn table_has_a_row_per_stage_and_total_maxima() {
        let st = |n: &str, r: u64| StageRecord {
            name: n.into(),
            seconds: 1.0,
            peak_rss: r,
            peak_anon: r / 2,
            bytes_read: 10,
            bytes_written: 20,
            reused: false,
        };
        let t = table(&[st("load", 1 << 30), st("save", 3 << 30)], 2.0);
        assert_eq!(t.lines().count(), 4);
        let total = t.lines().last().unwrap();
        assert!(
            total.contains("3.00 GiB") && total.contains("40 B"),
            "{total}"
        );
    }

    #[test]
    fn json_is_written_atomically() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("report.json");
        write_json(&p, &serde_json::json!({"a": 1})).unwrap();
        assert_eq!(read_json(&p).unwrap()["a"], 1);
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
        assert!(write_json(&d.path().join("no/such/dir/r.json"), &serde_json::json!(1)).is_err());
    }
}
