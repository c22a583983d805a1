//! `--backend onnx`: the whole policy as one ONNX model, through the same stages as the other
//! backends. load (the policy program, emitted once with stand-in weight locations so that
//! every refusal happens before a file is written) → convert (the mapping file: every weight the
//! prefix and step read, once, in the dtype the program declares, page-aligned, streamed from
//! the checkpoint; reused while the checkpoint is unchanged) → timestep (the table, once, on the
//! reference executor, from the checkpoint: its adaRMS weights stay out of the model) → save
//! (`pi05.onnx`: the protobuf, no weight inside, each weight an initializer whose external data
//! is its bytes in `pi05.onnx.data`; `pi05.onnx.data`: the mapping file itself, moved out of the
//! cache when the export publishes — no weight byte is copied a second time, and a re-run
//! reuses it in place; `pi05.onnx.json`: the interface).
//!
//! The model: inputs `images` f32 `[cameras,3,H,W]`, `image_masks` u8 `[cameras]`, `tokens`
//! i64 `[T]`, `token_mask` u8 `[T]`, `noise` f32 `[chunk, action_dim]` (the golden
//! `inputs.safetensors`' names, dtypes and shapes); output `actions` f32 `[chunk, action_dim]`.
//! Inside: the prefix once, the step inlined `steps` times over the same initializers
//! ([`petite_pi05::build_policy`]), the timestep table one constant initializer. ONNX opset
//! [`petite_engine::onnx::OPSET`] (17: the first with `LayerNormalization`; 19 with FP8
//! weights, [`petite_engine::onnx::opset_for`]; ONNX Runtime
//! runs it, TensorRT ≥ 10's parser takes it), IR version [`petite_engine::onnx::IR_VERSION`]
//! (8, the one opset 17 was released with, so older readers accept the file). `linear` is
//! `Gemm(transB=1)`, so ONNX Runtime reads each stored weight as it is rather than folding a
//! transposed copy per use. bf16 exports keep bf16 values (for TensorRT); ONNX Runtime's CPU
//! provider has no bf16 `Gemm`/`MatMul`, so `petite verify` refuses them before running.

use std::collections::BTreeMap;

use petite_engine::onnx::{self, EmitOptions, Flavor, WeightLocation};
use petite_graph::{Dtype, Program};
use petite_pi05::Precision;
use serde_json::json;

use super::mapping;
use super::{CONVERT_BYTES, ExportOptions, Identity, Loaded, SaveTargets, Saved, Stages, Table};
use crate::memory::human;
use crate::report::{self, BackendPart, MappingReport, OnnxFiles, OnnxPart};
use crate::{Error, Result};

use crate::layout::{ONNX_DATA as DATA, ONNX_MODEL as MODEL, ONNX_SPEC as SPEC};
/// The graph's name.
const GRAPH: &str = "pi05";

/// The ONNX backend's export, from its weight selection to its report.
pub(super) struct OnnxStages<'l> {
    l: &'l Loaded,
    opts: &'l ExportOptions,
    need: u64,
    selection: Vec<(String, Dtype)>,
    mapping: Option<mapping::Converted>,
    /// The export id's fingerprint of the weights ([`Stages::convert`]).
    seal: Option<String>,
    table: Option<Table>,
    policy: Option<Program>,
    written: Option<Written>,
}

/// What save wrote.
struct Written {
    model_bytes: u64,
    data_bytes: u64,
    data_moved: bool,
    initializers: usize,
    weight_bytes: u64,
    page_aligned: usize,
    page_aligned_bytes: u64,
    nodes: usize,
}

/// The stored dtype of a weight the program declares `d`: the dtype itself (f32 programs read
/// f32; lerobot's bf16 mode reads its f32 weights as f32 and the rest as bf16).
fn selection(programs: &[&Program]) -> Result<Vec<(String, Dtype)>> {
    let mut wanted: BTreeMap<String, Dtype> = BTreeMap::new();
    for p in programs {
        for w in p.weights() {
            let slot = *wanted.entry(w.name.clone()).or_insert(w.dtype);
            if slot != w.dtype {
                return Err(Error::Internal(format!(
                    "weight `{}` is read as {} and as {}: one ONNX initializer holds one dtype",
                    w.name,
                    slot.name(),
                    w.dtype.name()
                )));
            }
        }
    }
    Ok(wanted.into_iter().collect())
}

/// Stand-in locations (every weight at offset 0 of its declared size) for the load stage's
/// dry emission: the emitter's checks (ops, shapes, dtypes) without the mapping file.
fn stand_in_locations(programs: &[&Program]) -> BTreeMap<String, WeightLocation> {
    let mut m = BTreeMap::new();
    for p in programs {
        for w in p.weights() {
            let full = match w.rows {
                None => w.shape.clone(),
                Some([_, end]) => {
                    let mut s = w.shape.clone();
                    s[0] = end;
                    s
                }
            };
            let len = (full.iter().product::<usize>() * w.dtype.size()) as u64;
            let e = m.entry(w.name.clone()).or_insert(WeightLocation {
                dtype: w.dtype,
                shape: full.clone(),
                offset: 0,
                len,
            });
            if full.first() > e.shape.first() {
                *e = WeightLocation {
                    dtype: w.dtype,
                    shape: full,
                    offset: 0,
                    len,
                };
            }
        }
    }
    m
}

fn emit_options() -> EmitOptions<'static> {
    EmitOptions {
        flavor: Flavor::TensorRt,
        gemm_linear: true,
        graph_name: GRAPH,
    }
}

/// ONNX type names of the interface (`tensor(float)` etc., what ONNX Runtime reports).
fn onnx_type_name(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "tensor(float)",
        Dtype::Bf16 => "tensor(bfloat16)",
        Dtype::F16 => "tensor(float16)",
        Dtype::I64 => "tensor(int64)",
        Dtype::I32 => "tensor(int32)",
        Dtype::U8 => "tensor(uint8)",
        Dtype::Bool => "tensor(bool)",
        Dtype::I8 => "tensor(int8)",
        Dtype::F8E4M3 => "tensor(float8e4m3fn)",
    }
}

/// The interface of `policy` as `pi05.onnx.json` lists it.
fn interface(policy: &Program) -> (serde_json::Value, serde_json::Value) {
    let io_of = |name: &str, id: petite_graph::ValueId| {
        let t = policy.node(id).tensor();
        json!({
            "name": name,
            "dtype": t.map(|t| t.dtype.name()),
            "onnx_type": t.map(|t| onnx_type_name(t.dtype)),
            "shape": t.map(|t| t.shape.clone()),
        })
    };
    let inputs = policy
        .inputs
        .iter()
        .map(|&id| io_of(policy.input_name(id).unwrap_or_default(), id))
        .collect::<Vec<_>>();
    let outputs = policy
        .outputs
        .iter()
        .map(|o| io_of(&o.name, o.value))
        .collect::<Vec<_>>();
    (inputs.into(), outputs.into())
}

impl<'l> OnnxStages<'l> {
    /// The load stage's backend part: budget, weight selection, and a dry emission of the
    /// policy (with a zero table) so an op or weight the encoder refuses is named before any
    /// file is written.
    pub(super) fn plan(l: &'l Loaded, opts: &'l ExportOptions) -> Result<Self> {
        let need = l.base + CONVERT_BYTES;
        if let Some(b) = opts.memory_budget
            && need > b
        {
            return Err(Error::Budget(format!(
                "memory budget {} is too small: the process base is {} and converting the weights \
                 needs {} more, {} in all; nothing was done",
                human(b),
                human(l.base),
                human(CONVERT_BYTES),
                human(need)
            )));
        }
        let progs = &l.progs;
        let selection = selection(&[&progs.prefix, &progs.step])?;
        // The policy is the prefix and the step (plus a constant, a slice and a reshape per
        // step): emitting those two into nothing checks every op and weight.
        let locs = stand_in_locations(&[&progs.prefix, &progs.step]);
        for (what, p) in [("prefix", &progs.prefix), ("step", &progs.step)] {
            onnx::emit_to(p, &locs, DATA, &emit_options(), &mut std::io::sink()).map_err(|e| {
                Error::Usage(format!(
                    "the {what} program: {e}; --backend onnx cannot export it (nothing was written)"
                ))
            })?;
        }
        Ok(OnnxStages {
            l,
            opts,
            need,
            selection,
            mapping: None,
            seal: None,
            table: None,
            policy: None,
            written: None,
        })
    }

    fn out_of_order() -> Error {
        Error::Internal("export stages out of order".into())
    }
}

impl Stages for OnnxStages<'_> {
    fn convert(&mut self, identity: &Identity) -> Result<bool> {
        let cache = self.opts.out.join(crate::layout::CACHE);
        // An earlier export's `pi05.onnx.data` is this backend's mapping file, moved out of
        // the cache when it was published: reused in place when it is current.
        let data = self.opts.out.join(DATA);
        let c = mapping::engine_mapping_at(
            &self.l.ck,
            identity,
            &self.selection,
            &cache,
            Some(&data),
            self.opts.progress,
        )?;
        // The export id's fingerprint: the seal of this file keyed by content (the file itself
        // is keyed for reuse, with modification times).
        self.seal = Some(mapping::engine_seal(
            &c.file,
            &identity.content,
            &self.selection,
            &cache,
        )?);
        let reused = c.reused;
        self.mapping = Some(c);
        Ok(reused)
    }

    fn mapping(&self) -> Option<&petite_weights::MappedSafetensors> {
        self.mapping.as_ref().map(|c| &c.file)
    }

    fn weights_seal(&self) -> Result<Option<String>> {
        Ok(self.seal.clone())
    }

    fn timestep(&mut self) -> Result<()> {
        let (cfg, progs) = (&self.l.cfg, &self.l.progs);
        let table = super::timestep_values(progs, &self.l.ck, cfg)?;
        self.policy = Some(petite_pi05::build_policy(cfg, progs, &table.values)?);
        // The policy holds the table now (its one constant); only the shape is kept here.
        self.table = Some(Table {
            values: Vec::new(),
            row_len: table.row_len,
        });
        Ok(())
    }

    fn save(&mut self, save: &SaveTargets) -> Result<()> {
        let out = &self.opts.out;
        let c = self.mapping.as_ref().ok_or_else(Self::out_of_order)?;
        let policy = self.policy.as_ref().ok_or_else(Self::out_of_order)?;
        let locs = onnx::locations(c.file.header());
        // The model: streamed as it is encoded, put durably under its staged name (petite-fs;
        // published by finish).
        let model = out.join(MODEL);
        let staged_model = save.staged(&model);
        let model_bytes = {
            use std::io::Write;
            let mut f = petite_fs::AtomicFile::create(&staged_model)?;
            let tmp = f.temp().to_path_buf();
            let mut w = std::io::BufWriter::with_capacity(1 << 20, f.file_mut());
            let n = onnx::emit_to(policy, &locs, DATA, &emit_options(), &mut w)?;
            w.flush().map_err(|e| Error::io(&tmp, "write", e))?;
            drop(w);
            f.commit()?;
            n
        };
        save.pb.inc(1);
        // The external data is the mapping file itself: moved (renamed, with its seal) from the
        // cache to `pi05.onnx.data` when the export publishes, so no weight byte is written
        // twice. (A hard link would keep the cache copy too, but onnx.checker refuses external
        // data with several links, "a potential hardlink attack".) Reused in place: no move.
        let data = out.join(DATA);
        let moved = c.file.path() != data;
        if moved {
            let seal = petite_weights::seal::sidecar;
            save.publish_as(c.file.path().to_path_buf(), data.clone());
            if seal(c.file.path()).exists() {
                save.publish_as(seal(c.file.path()), seal(&data));
            }
            // The resume key goes with it (a re-run reuses the published file in place).
            let resume = mapping::resume_sidecar;
            if resume(c.file.path()).exists() {
                save.publish_as(resume(c.file.path()), resume(&data));
            }
        }
        // What the model references: each weight once, and where its bytes start.
        let weights = policy.weights();
        let page = petite_weights::page::page_size() as u64;
        let (mut aligned, mut aligned_bytes, mut weight_bytes) = (0usize, 0u64, 0u64);
        for w in &weights {
            let loc = &locs[&w.name];
            let (off, len) = match w.rows {
                None => (loc.offset, loc.len),
                Some([a, b]) => {
                    let row = loc.len / loc.shape[0] as u64;
                    (loc.offset + a as u64 * row, (b - a) as u64 * row)
                }
            };
            weight_bytes += len;
            if off % page == 0 {
                aligned += 1;
                aligned_bytes += len;
            }
        }
        let (inputs, outputs) = interface(policy);
        let cfg = &self.l.cfg;
        let dtype = match self.opts.precision {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        };
        let spec = json!({
            "export_id": save.export_id,
            "model": MODEL,
            "external_data": [DATA],
            "opset": onnx::opset_for(policy).0,
            "ir_version": onnx::opset_for(policy).1,
            "dtype": dtype,
            "inputs": inputs,
            "outputs": outputs,
            "steps": cfg.steps,
            "timestep_table": [cfg.steps, self.table.as_ref().map_or(0, |t| t.row_len)],
            "runtimes": {
                "onnxruntime_cpu": self.opts.precision == Precision::F32,
                "tensorrt": ">= 10 (bf16 with --stronglyTyped)",
                "note": if self.opts.precision == Precision::F32 {
                    "f32: ONNX Runtime (CPU) and TensorRT"
                } else {
                    "bf16: TensorRT; ONNX Runtime's CPU provider has no bf16 Gemm/MatMul kernels"
                },
            },
            "initializers": weights.len(),
            "weight_bytes": weight_bytes,
        });
        let spec_file = out.join(SPEC);
        crate::report::write_json(&save.staged(&spec_file), &spec)?;
        save.publish_as(staged_model, model);
        save.publish_as(save.staged(&spec_file), spec_file);
        save.pb.finish_and_clear();
        let data_bytes = std::fs::metadata(c.file.path()).map_or(0, |m| m.len());
        self.written = Some(Written {
            model_bytes,
            data_bytes,
            data_moved: moved,
            initializers: weights.len(),
            weight_bytes,
            page_aligned: aligned,
            page_aligned_bytes: aligned_bytes,
            nodes: policy.len(),
        });
        Ok(())
    }

    fn report(&self, _save: &SaveTargets) -> Saved {
        let out = &self.opts.out;
        let (reused, seconds, bytes) = match &self.mapping {
            Some(c) => (c.reused, c.seconds, c.file.mapped_len() as u64),
            None => (false, None, 0),
        };
        let w = self.written.as_ref();
        let (opset, ir_version) = self
            .policy
            .as_ref()
            .map_or((onnx::OPSET, onnx::IR_VERSION), onnx::opset_for);
        let model_bytes = w.map_or(0, |w| w.model_bytes);
        let weight_bytes = w.map_or(0, |w| w.weight_bytes);
        let part = OnnxPart {
            memory_budget: self.opts.memory_budget,
            memory_estimate: self.need,
            mapping: MappingReport {
                // Published as the model's external data (moved there from the cache).
                path: Some(out.join(DATA).display().to_string()),
                reused,
                bytes,
                tensors: self.selection.len(),
                convert_seconds: seconds,
            },
            onnx: OnnxFiles {
                model: out.join(MODEL).display().to_string(),
                model_bytes,
                data: out.join(DATA).display().to_string(),
                data_bytes: w.map(|w| w.data_bytes),
                data_moved_from_cache: w.map(|w| w.data_moved),
                opset,
                ir_version,
                initializers: w.map(|w| w.initializers),
                weight_bytes,
                initializers_page_aligned: w.map(|w| w.page_aligned),
                weight_bytes_page_aligned: w.map(|w| w.page_aligned_bytes),
                program_nodes: w.map(|w| w.nodes),
                steps: self.l.cfg.steps,
                timestep_table: [
                    self.l.cfg.steps,
                    self.table.as_ref().map_or(0, |t| t.row_len),
                ],
            },
        };
        Saved {
            cfg: None,
            runner: None,
            weight_bytes: None,
            host_table_bytes: None,
            part: BackendPart::Onnx(part),
            written: report::Written {
                weight_bytes,
                mapping: Some(if reused { 0 } else { bytes }),
                programs: model_bytes,
                pte: false,
                engines: None,
            },
            engines_reused: 0,
            engines_built: 0,
        }
    }
}
