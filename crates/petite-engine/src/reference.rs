//! The `reference` backend: runs everywhere, and is what tests and the default export use here.
//!
//! An engine file is a standard safetensors file: `__metadata__` holds the format tag and the
//! engine's subgraph (petite-graph JSON); the tensors are the subgraph's weights, each in the
//! dtype the subgraph declares (so the runtime reads them in place, no conversion), laid out by
//! petite-weights' page-aligned writer. Weights are streamed from the mapped source in chunks
//! (converted chunk by chunk where the source stores another dtype), so building an engine of
//! N bytes needs O(chunk) memory, not O(N). The runtime maps the file and runs the subgraph with
//! petite-reference; its weights are never loaded, only paged in as the executor reads them.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;

use petite_graph::{Dtype, Op, Program, ShapeDisplay, WeightInfo};
use petite_reference::{Executor, Tensor};
use petite_weights::{
    MappedSafetensors, RowSlices, SafetensorsLayout, SafetensorsWriter, TensorSpec, WeightSource,
};

use crate::{
    BuildMemory, BuilderInfo, BuiltEngine, EngineBuilder, EngineJob, EngineRuntime, Error,
    HostTensor, InPlaceBuilder, IoBinding, Result,
};

/// Backend id of reference engines.
pub const BACKEND_ID: &str = "PetiteReference";
/// `__metadata__` key holding the format tag.
pub const META_FORMAT: &str = "petite.engine.format";
/// The format tag (bumped on any incompatible change).
pub const FORMAT: &str = "petite-reference-engine/1";
/// `__metadata__` key holding the subgraph JSON.
pub const META_PROGRAM: &str = "petite.engine.program";
/// File name suffix of reference engine files.
pub const SUFFIX: &str = ".ref.safetensors";

/// Checks that `source` holds weight `w` with its shape (for a row range: the rows exist and the
/// row shape agrees) and a dtype convertible to its declared one (any float for a float
/// declaration; for quantized codes the codes, or float rows the build quantizes; the same dtype
/// otherwise); returns the stored dtype. A whole weight's scales (`W.qscale`, f32, one a row)
/// that `source` lacks pass where it holds `W` as float rows: the build computes them from those
/// rows beside `W`'s codes ([`petite_weights::stream`]), so both must be in the same engine.
pub fn check_weight(source: &dyn WeightSource, w: &WeightInfo) -> Result<Dtype> {
    let expected = match w.rows {
        None => format!("{}{}", w.dtype.name(), ShapeDisplay(&w.shape)),
        Some([a, b]) => format!(
            "rows [{a}, {b}) as {}{}",
            w.dtype.name(),
            ShapeDisplay(&w.shape)
        ),
    };
    let info = match source.info(&w.name) {
        Ok(info) => info,
        Err(e) => {
            if derived_scale(source, w) {
                return Ok(Dtype::F32);
            }
            return Err(Error::Weight {
                tensor: w.name.clone(),
                expected: expected.clone(),
                found: format!("no such tensor in the weight source ({e})"),
            });
        }
    };
    let dtype_ok = if w.dtype.is_float() {
        info.dtype.is_float()
    } else if w.dtype.is_quant_code() {
        info.dtype == w.dtype || info.dtype.is_float()
    } else {
        info.dtype == w.dtype
    };
    let shape_ok = match w.rows {
        None => info.shape == w.shape,
        Some([a, b]) => {
            info.shape.first().is_some_and(|&n| a < b && b <= n)
                && w.shape.first() == Some(&(b - a))
                && info.shape[1..] == w.shape[1..]
        }
    };
    if !shape_ok || !dtype_ok {
        return Err(Error::Weight {
            tensor: w.name.clone(),
            expected,
            found: format!(
                "{}{}",
                info.dtype.safetensors_name(),
                ShapeDisplay(&info.shape)
            ),
        });
    }
    Ok(info.dtype)
}

/// Whether `w` is the f32 scales of a whole weight `source` holds as float rows (one scale a
/// row): scales the build computes ([`check_weight`]).
fn derived_scale(source: &dyn WeightSource, w: &WeightInfo) -> bool {
    let Some(base) = petite_dtype::quant::scaled_weight(&w.name) else {
        return false;
    };
    w.rows.is_none()
        && w.dtype == Dtype::F32
        && w.shape.len() == 1
        && source
            .info(base)
            .is_ok_and(|b| b.dtype.is_float() && b.shape.first() == w.shape.first())
}

/// Builds reference engines.
#[derive(Debug, Clone)]
pub struct ReferenceBuilder {
    /// Bytes of source read (and converted) per step; the builder's memory is a few of these
    /// per thread.
    pub chunk_bytes: usize,
    /// Threads reading, converting and writing (reads of one overlap the others' work).
    pub threads: usize,
    /// Give the source's pages back behind the stream (a chunk at a time) instead of only after
    /// each weight's last engine: keeps the mapping's residency at about one chunk even within
    /// one large engine. Off, residency grows through an engine and drops at its last-use release.
    pub release_behind: bool,
}

impl Default for ReferenceBuilder {
    fn default() -> Self {
        ReferenceBuilder {
            chunk_bytes: 4 << 20,
            threads: petite_weights::default_threads(),
            release_behind: true,
        }
    }
}

impl ReferenceBuilder {
    /// Plans `job`'s engine file (the subgraph it carries, its table, its layout) and hands it
    /// with the source it streams from (row ranges as tensors of their own) to `f`.
    fn with_plan<R>(
        &self,
        job: &EngineJob<'_>,
        source: &dyn WeightSource,
        path: &Path,
        f: impl FnOnce(&Planned, &dyn WeightSource) -> Result<R>,
    ) -> Result<R> {
        job.program.validate()?;
        // The file stores only the rows a row-range weight reads, as a tensor of its own named
        // `name[start..end]`; the subgraph it carries reads that tensor whole.
        let mut program = job.program.clone();
        let mut sliced = RowSlices::new(source);
        for w in job.program.weights() {
            if let Some(rows) = w.rows {
                check_weight(source, &w)?;
                let key = w.display_name();
                sliced.add(&key, &w.name, rows)?;
                program.nodes[w.node.index()].op = Op::Weight {
                    name: key,
                    rows: None,
                };
            }
        }
        let source: &dyn WeightSource = &sliced;
        let weights = program.weights();
        let mut table = Vec::with_capacity(weights.len());
        for w in &weights {
            check_weight(source, w)?;
            table.push(TensorSpec::new(&w.name, w.dtype, &w.shape));
        }
        let meta = vec![
            (META_FORMAT.to_string(), FORMAT.to_string()),
            (META_PROGRAM.to_string(), program.to_json()?),
        ];
        let layout = SafetensorsLayout::plan(path, &table, &meta)?;
        f(&Planned { program, layout }, source)
    }

    /// Streams every weight of the planned file from `source` into `writer`, converted to its
    /// declared dtype, at disk speed (petite-weights' [`petite_weights::stream`]: reads asked
    /// for ahead, conversion on every thread, written bytes and read pages dropped behind).
    fn stream_all(&self, source: &dyn WeightSource, writer: &SafetensorsWriter) -> Result<()> {
        let opts = petite_weights::StreamOptions {
            chunk_bytes: self.chunk_bytes,
            threads: self.threads,
            release_behind: self.release_behind,
        };
        petite_weights::stream(source, writer, &opts, &AtomicU64::new(0))?;
        // The header, and anything the write-behind left, out of the page cache too.
        crate::sys::flush_and_drop(writer.file(), writer.base(), writer.total_len());
        Ok(())
    }

    fn build_inner(
        &self,
        job: &EngineJob<'_>,
        source: &dyn WeightSource,
        dir: &Path,
    ) -> Result<BuiltEngine> {
        let path = dir.join(format!("{}{SUFFIX}", job.name));
        let program = self.with_plan(job, source, &path, |plan, source| {
            let writer = SafetensorsWriter::create_laid_out(&path, &plan.layout)?;
            self.stream_all(source, &writer)?;
            writer.finish_sealed()?;
            Ok(plan.program.clone())
        })?;
        let file_bytes = std::fs::metadata(&path)
            .map_err(|e| Error::io(&path, "stat", e))?
            .len();
        let (inputs, outputs) = crate::bindings(&program);
        Ok(BuiltEngine {
            index: job.index,
            name: job.name.to_string(),
            backend_id: BACKEND_ID.to_string(),
            file: path.clone(),
            file_bytes,
            inputs,
            outputs,
            payload: crate::FileRegion {
                path,
                offset: 0,
                len: file_bytes,
            },
            input_values: job.input_values.to_vec(),
            output_values: job.output_values.to_vec(),
            stats: None,
            compile_specs: Vec::new(),
        })
    }
}

/// A planned engine file: the subgraph it carries and its layout.
struct Planned {
    program: Program,
    layout: SafetensorsLayout,
}

impl InPlaceBuilder for ReferenceBuilder {
    /// The engine file's size: its header (with the subgraph) and its weights' table fix it.
    fn engine_len(&self, job: &EngineJob<'_>, weights: &dyn WeightSource) -> Result<u64> {
        self.with_plan(job, weights, Path::new(job.name), |plan, _| {
            Ok(plan.layout.total_len())
        })
        .map_err(|e| e.in_engine(job.index, job.name))
    }

    /// The engine file's bytes, exactly as [`EngineBuilder::build`] writes them into a file of
    /// their own, streamed from `weights` straight into the region.
    fn write_engine(
        &self,
        job: &EngineJob<'_>,
        weights: &dyn WeightSource,
        file: &File,
        path: &Path,
        offset: u64,
    ) -> Result<u64> {
        self.with_plan(job, weights, path, |plan, source| {
            let writer = SafetensorsWriter::create_in(file, path, offset, &plan.layout)?;
            self.stream_all(source, &writer)?;
            writer.finish()?;
            Ok(plan.layout.total_len())
        })
        .map_err(|e| e.in_engine(job.index, job.name))
    }
}

impl EngineBuilder for ReferenceBuilder {
    fn backend_id(&self) -> &str {
        BACKEND_ID
    }

    fn info(&self) -> BuilderInfo {
        BuilderInfo {
            name: "petite-reference".to_string(),
            version: FORMAT.to_string(),
        }
    }

    fn settings(&self) -> String {
        format!("{BACKEND_ID}|{FORMAT}")
    }

    fn file_name(&self, name: &str) -> String {
        format!("{name}{SUFFIX}")
    }

    /// Weights are streamed in 4 MiB chunks, so the cost does not grow with the engine (plus
    /// the engine's program JSON, well under 8 MiB).
    fn memory(&self) -> BuildMemory {
        BuildMemory {
            base: 16 << 20,
            per_half_byte: 0.0,
            per_full_byte: 0.0,
        }
    }

    /// A mapping file of this backend would hold the bf16 weights (what the export id
    /// fingerprints); none is written ([`EngineBuilder::needs_mapping_file`]).
    fn mapping_dtype(&self, declared: Dtype) -> Option<Dtype> {
        (declared == Dtype::Bf16).then_some(Dtype::Bf16)
    }

    /// Every weight is read from the checkpoint and converted chunk by chunk as it is
    /// streamed, so a mapping file would only be a second copy of the weights.
    fn needs_mapping_file(&self) -> bool {
        false
    }

    fn in_place(&self) -> Option<&dyn InPlaceBuilder> {
        Some(self)
    }

    /// Its stream quantizes a float weight's rows and writes their scales as it goes.
    fn quantizes_in_build(&self) -> bool {
        true
    }

    /// The file must open as a reference engine whose subgraph equals the job's.
    fn reuse(&self, path: &Path, job: &EngineJob<'_>) -> Option<BuiltEngine> {
        let e = ReferenceEngine::open(path).ok()?;
        if e.program() != job.program {
            return None;
        }
        let file_bytes = std::fs::metadata(path).ok()?.len();
        Some(crate::whole_file_engine(
            job, BACKEND_ID, path, file_bytes, None,
        ))
    }

    fn build(
        &self,
        job: &EngineJob<'_>,
        weights: &dyn WeightSource,
        dir: &Path,
    ) -> Result<BuiltEngine> {
        self.build_inner(job, weights, dir)
            .map_err(|e| e.in_engine(job.index, job.name))
    }
}

/// A built reference engine, mapped: its subgraph and its weights (read in place).
#[derive(Debug)]
pub struct ReferenceEngine {
    path: PathBuf,
    file: MappedSafetensors,
    program: Program,
    inputs: Vec<IoBinding>,
    outputs: Vec<IoBinding>,
    release: bool,
}

impl ReferenceEngine {
    /// Maps an engine file and checks it: format tag, subgraph, and every weight present in the
    /// declared dtype and shape.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = MappedSafetensors::open_as(&path, petite_weights::Role::EngineFile)?;
        Self::from_file(path, file)
    }

    /// Maps an engine stored at `[offset, offset + len)` of `path` (a `.pte` segment) in place,
    /// with the same checks as [`ReferenceEngine::open`].
    pub fn open_region(path: impl AsRef<Path>, offset: u64, len: u64) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file =
            MappedSafetensors::open_region(&path, petite_weights::Role::Program, offset, len)?;
        Self::from_file(path, file)
    }

    /// Gives each weight's pages back after its last read in a run (default off): for engines
    /// run once, so a whole program's weights are never resident together.
    pub fn releasing_weights(mut self, release: bool) -> Self {
        self.release = release;
        self
    }

    fn from_file(path: PathBuf, file: MappedSafetensors) -> Result<Self> {
        let bad = |reason: String| Error::InvalidEngineFile {
            path: path.display().to_string(),
            backend: "reference",
            reason,
        };
        let meta = &file.header().metadata;
        let get = |k: &str| meta.iter().find(|(m, _)| m == k).map(|(_, v)| v.as_str());
        match get(META_FORMAT) {
            Some(FORMAT) => {}
            other => {
                return Err(bad(format!(
                    "`__metadata__.{META_FORMAT}`: expected {FORMAT:?}, found {other:?}"
                )));
            }
        }
        let json =
            get(META_PROGRAM).ok_or_else(|| bad(format!("no `__metadata__.{META_PROGRAM}`")))?;
        let program = Program::from_json(json)
            .map_err(|e| bad(format!("`__metadata__.{META_PROGRAM}`: {e}")))?;
        program
            .validate()
            .map_err(|e| bad(format!("subgraph: {e}")))?;
        for w in program.weights() {
            let info = file
                .info(&w.name)
                .map_err(|_| bad(format!("weight `{}` is missing", w.name)))?;
            if info.dtype != w.dtype || info.shape != w.shape {
                return Err(bad(format!(
                    "weight `{}`: expected {}{}, found {}{}",
                    w.name,
                    w.dtype.name(),
                    ShapeDisplay(&w.shape),
                    info.dtype.safetensors_name(),
                    ShapeDisplay(&info.shape)
                )));
            }
        }
        let (inputs, outputs) = crate::bindings(&program);
        Ok(ReferenceEngine {
            path,
            file,
            program,
            inputs,
            outputs,
            release: false,
        })
    }

    /// The engine's subgraph.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The mapped file (e.g. for residency checks).
    pub fn file(&self) -> &MappedSafetensors {
        &self.file
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl EngineRuntime for ReferenceEngine {
    fn inputs(&self) -> &[IoBinding] {
        &self.inputs
    }

    fn outputs(&self) -> &[IoBinding] {
        &self.outputs
    }

    fn run(&self, inputs: BTreeMap<String, HostTensor>) -> Result<BTreeMap<String, HostTensor>> {
        let inputs = inputs
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_reference()?)))
            .collect::<Result<BTreeMap<String, Tensor>>>()?;
        let outs = Executor::new(&self.program, &self.file)?
            .release_weights(self.release)
            .run(inputs)?;
        Ok(outs.into_iter().map(|(n, t)| (n, t.into())).collect())
    }
}
