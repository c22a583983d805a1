//! The stages of the engine backends (reference, TensorRT): plans under the engine cap, the
//! mapping file the builder reads, engines built through [`petite_engine::build_plan`] — as many
//! at once as the memory budget and the cores allow, for a backend that takes `--jobs`
//! ([`choose_jobs`]), else one at a time — and `.pte` files whose delegates stream each engine
//! from its file.

use std::collections::BTreeMap;

use petite_engine::{
    BuildMemory, BuildOptions, BuiltEngine, EngineBuilder, EngineReport, WeightBytes,
};
use petite_graph::{Program, ValueId};
use petite_partition::{PartitionOptions, Plan};
use petite_pte::model::{DeviceType, ScalarType};
use petite_pte::{DelegateSpec, MethodBuilder, Processed, ProgramBuilder, SegmentData};
use sha2::{Digest, Sha256};

use super::in_place;
use super::mapping::{self, ExportWeights};
use super::{
    CONVERT_BYTES, DEFAULT_ENGINE_CAP, ENGINE_ALIGNMENT, ExportOptions, Identity, Loaded, METHOD,
    Placement, SaveTargets, Saved, Stages, TABLE_METHOD, Table, bar, interrupted, timestep_values,
};
use crate::backends::Flag;
use crate::engines;
use crate::memory::human;
use crate::report::{
    BackendPart, EngineCounts, EnginePart, EngineProgram, EnginePrograms, EngineRecord,
    MappingReport, Written,
};
use crate::{Error, Result};

/// The engine backends' export, from its plans to its report.
pub(super) struct EngineStages<'l> {
    l: &'l Loaded,
    opts: &'l ExportOptions,
    builder: Box<dyn EngineBuilder>,
    /// The CUDA device the delegates' I/O is planned on (`None`: all in host memory).
    device: Option<u8>,
    engine_cap: u64,
    memory_budget: Option<u64>,
    need: u64,
    /// How many engines are built at once ([`choose_jobs`]).
    jobs: usize,
    /// The most that ran at once.
    max_concurrent: usize,
    prefix_plan: Plan,
    step_plan: Plan,
    selection: Vec<(String, petite_graph::Dtype)>,
    /// Engines written straight into the `.pte`s ([`in_place`]): the builder can, and
    /// `--keep-engines` does not ask for engine files.
    in_place: bool,
    /// The seal of the mapping file the builder would read, where it reads the checkpoint
    /// instead (the export id's fingerprint of the weights).
    seal: Option<String>,
    /// The inputs' identity (checkpoint files and dtype), from the convert stage on.
    identity: Identity,
    weights: Option<ExportWeights<'l>>,
    /// Whether the convert stage reused an earlier mapping file, and what converting cost.
    /// Quantized weights are made by the builder from the checkpoint
    /// ([`EngineBuilder::quantizes_in_build`]), not read from a mapping file.
    quantizes_in_build: bool,
    mapping_reused: bool,
    convert_seconds: Option<f64>,
    /// Engines built by this run (the rest were reused).
    built: usize,
    table: Option<Table>,
    prefix_engines: Vec<BuiltEngine>,
    step_engines: Vec<BuiltEngine>,
    records: [Vec<EngineRecord>; 2],
    pte_bytes: [u64; 2],
    pb: indicatif::ProgressBar,
}

impl<'l> EngineStages<'l> {
    /// The load stage's backend part: the builder found and probed, the budget and cap, the
    /// plans, and every check that can refuse before a file is written.
    pub(super) fn plan(l: &'l Loaded, opts: &'l ExportOptions) -> Result<Self> {
        // The backend's dtypes and flags were checked by `ExportOptions::check`. Finds and
        // probes the backend's tool: a missing builder is refused before any work.
        let builder = opts.backend.builder(&opts.backend_options, opts.weights)?;
        let device = match (opts.placement, builder.device()) {
            (Some(Placement::Host), _) | (None, None) => None,
            (Some(Placement::Device), Some(d)) | (None, Some(d)) => Some(d),
            (Some(Placement::Device), None) => {
                return Err(Error::Usage(format!(
                    "--placement device: the {} backend's engines run on the CPU, so there is no device to place their inputs and outputs on; use --backend tensorrt, or drop --placement",
                    opts.backend.name()
                )));
            }
        };
        let memory = builder.memory();
        // With no cap or budget given, the backend's default budget (TensorRT on an integrated
        // GPU, e.g. a Jetson, which shares one memory pool with the export: what is available).
        let mut memory_budget = opts.memory_budget;
        if opts.engine_cap.is_none() && memory_budget.is_none() {
            memory_budget = opts.backend.spec().default_memory_budget();
        }
        let base = l.base;
        let engine_cap = match (opts.engine_cap, memory_budget) {
            (Some(c), _) => c,
            (None, Some(b)) => memory
                .cap_for(b.saturating_sub(base))
                .unwrap_or(DEFAULT_ENGINE_CAP),
            (None, None) => DEFAULT_ENGINE_CAP,
        };
        if engine_cap == 0 {
            return Err(Error::Budget(format!(
                "memory budget {} leaves no room for an engine: the process already uses {}",
                human(memory_budget.unwrap_or(0)),
                human(base)
            )));
        }
        let progs = &l.progs;
        let popts = PartitionOptions::new(engine_cap);
        let prefix_plan = petite_partition::plan(&progs.prefix, &popts)?;
        let step_plan = petite_partition::plan(&progs.step, &popts)?;
        let largest = prefix_plan
            .max_engine_weight_bytes()
            .max(step_plan.max_engine_weight_bytes());
        // Every engine's weights by dtype: what its build costs under the backend's model.
        let mut all_engines = Vec::new();
        for (plan, program) in [(&prefix_plan, &progs.prefix), (&step_plan, &progs.step)] {
            builder.check_plan(program, plan)?; // e.g. a weight-streaming budget below one layer
            all_engines.extend(
                plan.engines
                    .iter()
                    .map(|e| WeightBytes::of_engine(program, e)),
            );
        }
        // What each build costs under the backend's memory model (by dtype mix), costliest
        // first.
        let mut needs: Vec<u64> = all_engines.iter().map(|&w| memory.bytes(w)).collect();
        needs.sort_unstable_by(|a, b| b.cmp(a));
        let build_need = needs.first().copied().unwrap_or(0).max(CONVERT_BYTES);
        let need = base + build_need;
        if let Some(b) = memory_budget
            && need > b
        {
            return Err(Error::Budget(format!(
                "memory budget {} is too small: the process base is {} and the largest step needs {} \
                 more ({} building an engine of up to {} weights under engine cap {}; conversion \
                 {}), {} in all; nothing was done",
                human(b),
                human(base),
                human(build_need),
                builder.info(),
                human(largest),
                human(engine_cap),
                human(CONVERT_BYTES),
                human(need)
            )));
        }
        let jobs = if opts.backend.spec().flags().contains(&Flag::Jobs) {
            let limit = match memory_budget {
                Some(b) => MemoryLimit::Budget(b),
                None => MemoryLimit::Machine(crate::memory::machine_memory()),
            };
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            let (jobs, line) = choose_jobs(opts.jobs, limit, base, memory, &all_engines, cores)?;
            eprintln!("petite: {line}");
            jobs
        } else {
            1
        };
        // The export's peak: the conversion, or the `jobs` costliest builds at once.
        let need = base + CONVERT_BYTES.max(needs.iter().take(jobs).sum());
        let all_programs = [&progs.timestep_table, &progs.prefix, &progs.step];
        let selection = mapping::selection(&all_programs, builder.as_ref())?;
        let in_place = !opts.keep_engines && builder.in_place().is_some();
        // Quantized weights straight from the checkpoint when the builder quantizes as it
        // streams, unless a weight's codes or scales are cut into row ranges (their scales
        // would need the source's rows of a tensor it does not hold): then from the mapping file.
        let quantizes_in_build = builder.quantizes_in_build()
            && !quantized_row_ranges(&progs.prefix)
            && !quantized_row_ranges(&progs.step);
        Ok(EngineStages {
            l,
            opts,
            builder,
            device,
            engine_cap,
            memory_budget,
            need,
            jobs,
            max_concurrent: 0,
            prefix_plan,
            step_plan,
            selection,
            in_place,
            quantizes_in_build,
            seal: None,
            identity: Identity::default(),
            weights: None,
            mapping_reused: true,
            convert_seconds: None,
            built: 0,
            table: None,
            prefix_engines: vec![],
            step_engines: vec![],
            records: [vec![], vec![]],
            pte_bytes: [0, 0],
            pb: indicatif::ProgressBar::hidden(),
        })
    }

    fn weights(&self) -> Result<&ExportWeights<'l>> {
        self.weights
            .as_ref()
            .ok_or_else(|| Error::Internal("export stages out of order: no weights yet".into()))
    }

    /// Builds (or reuses) every engine of `plan` through the one plan driver.
    /// Engine files are named by the resume identity (a checkpoint rewritten with new values
    /// is never mistaken for the old one); the `.pte` names them by content ([`Self::save`]).
    fn build(&self, tag: &str, plan: &Plan, program: &Program, identity: &str) -> Result<Built> {
        let weights = self.weights()?;
        let builder = self.builder.as_ref();
        let dir = self.opts.out.join(crate::layout::ENGINES);
        let settings = builder.settings();
        let name = |i: usize, sub: &Program| engine_name(&settings, identity, tag, i, sub);
        let pb = &self.pb;
        let pause = self.opts.pause_after_engine;
        let on_engine = |r: &EngineReport| {
            pb.set_message(r.name.clone());
            pb.inc(1);
            if let Some(d) = pause {
                std::thread::sleep(d);
            }
            crate::guard::stop_point(&format!("engine:{tag}:{}", r.index));
        };
        let on_damaged = |p: &std::path::Path, why: &str| {
            crate::guard::damaged(p, "engine file", why);
        };
        let stop = || interrupted();
        let rep = petite_engine::build_plan(
            plan,
            program,
            weights,
            builder,
            &dir,
            &BuildOptions {
                release_after_last_use: true,
                on_engine: Some(&on_engine),
                name: Some(&name),
                reuse: true,
                on_damaged: Some(&on_damaged),
                stop: Some(&stop),
                jobs: self.jobs,
            },
        )
        .map_err(|e| match e {
            petite_engine::Error::Stopped { .. } => Error::Interrupted,
            e => e.into(),
        })?;
        let records = rep
            .reports
            .iter()
            .zip(&plan.engines)
            .zip(&rep.engines)
            .map(|((r, e), built)| {
                let wb = WeightBytes::of_engine(program, e);
                EngineRecord {
                    name: r.name.clone(),
                    weight_bytes: e.weight_bytes,
                    weight_bytes_16bit: wb.half,
                    weight_bytes_32bit: wb.full,
                    build_memory_estimate: builder.memory().bytes(wb),
                    file_bytes: r.file_bytes,
                    over_cap: e.over_cap,
                    reused: r.reused,
                    seconds: r.seconds,
                    rss_after: r.rss_after.map(|s| s.total),
                    builder_peak_rss_bytes: r.stats.map(|s| s.builder_peak_rss_bytes),
                    build_s: r.stats.map(|s| s.build_s),
                    plan_bytes: r.stats.map(|s| s.plan_bytes),
                    compile_specs: engines::compile_specs_json(built),
                }
            })
            .collect();
        Ok(Built {
            built: rep.reports.iter().filter(|r| !r.reused).count(),
            max_concurrent: rep.max_concurrent,
            engines: rep.engines,
            records,
        })
    }
}

/// What bounds the memory of builds running at once.
#[derive(Debug, Clone, Copy)]
enum MemoryLimit {
    /// `--memory-budget` (or the backend's default budget): a `--jobs` above what it fits is
    /// refused.
    Budget(u64),
    /// No budget: what bounds the process's memory ([`crate::memory::machine_memory`]) bounds
    /// the default, if known.
    Machine(Option<(&'static str, u64)>),
}

/// How many engines are built at once, and the line that says so and why: `requested`
/// (`--jobs`) if the budget fits that many builders, else refused; by default as many as both
/// the memory limit (the process `base` plus the costliest `engines` built together, under the
/// builder's memory `model`) and the `cores` allow, at least one.
fn choose_jobs(
    requested: Option<usize>,
    limit: MemoryLimit,
    base: u64,
    model: BuildMemory,
    engines: &[WeightBytes],
    cores: usize,
) -> Result<(usize, String)> {
    let costliest = engines.iter().map(|&w| model.bytes(w)).max().unwrap_or(0);
    let (what, bytes) = match limit {
        MemoryLimit::Budget(b) => ("memory budget", Some(b)),
        MemoryLimit::Machine(m) => (m.map_or("", |m| m.0), m.map(|m| m.1)),
    };
    let fit = bytes.map(|b| model.builders_within(b.saturating_sub(base), engines));
    let fits = |n: usize| {
        let builders = match n {
            // Only a machine limit can fit none (a budget that fits none was refused before):
            // the model is conservative (measured peaks sit well below it), so one still runs.
            0 => "no builder".to_string(),
            1 => "1 builder".to_string(),
            n => format!("{n} builders"),
        };
        format!(
            "{what} {}: {builders} of up to {} under the builder's memory model beside the process's {}",
            human(bytes.unwrap_or(0)),
            human(costliest),
            human(base)
        )
    };
    let cores_text = format!("{cores} core{}", if cores == 1 { "" } else { "s" });
    let (jobs, why) = match (requested, fit) {
        (Some(n), Some(f)) if n > f && matches!(limit, MemoryLimit::Budget(_)) => {
            return Err(Error::Budget(format!(
                "--jobs {n}: {what} {} fits {f} build{} at once (the process's {} and up to {} per build under the builder's memory model); pass --jobs {} or less, a larger --memory-budget or a smaller --engine-cap; nothing was done",
                human(bytes.unwrap_or(0)),
                if f == 1 { "" } else { "s" },
                human(base),
                human(costliest),
                f.max(1)
            )));
        }
        (Some(n), Some(f)) => (n, format!("--jobs {n}; {}", fits(f))),
        (Some(n), None) => (n, format!("--jobs {n}")),
        (None, Some(f)) => (cores.min(f).max(1), format!("{}; {cores_text}", fits(f))),
        (None, None) => (cores.max(1), format!("{cores_text}; memory not known")),
    };
    Ok((
        jobs,
        format!(
            "building up to {jobs} engine{} at once ({why})",
            if jobs == 1 { "" } else { "s" }
        ),
    ))
}

impl EngineStages<'_> {
    /// Adds `step.pte`'s `timestep_table` method (the table as constant data).
    fn add_table(&self, p: &mut ProgramBuilder) -> Result<()> {
        let table = self
            .table
            .as_ref()
            .ok_or_else(|| Error::Internal("export stages out of order: no table yet".into()))?;
        let bytes: Vec<u8> = table.values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let idx = p.add_constant(&bytes);
        let mut tm = MethodBuilder::new(TABLE_METHOD);
        let dims = [self.l.cfg.steps as i32, table.row_len as i32];
        let tv = tm.constant_tensor(ScalarType::FLOAT, &dims, idx);
        tm.outputs(&[tv]);
        p.add_method(tm)?;
        Ok(())
    }

    /// save, engines written in place ([`in_place`]): each program's `.pte` laid out with its
    /// engines' sizes, then every engine streamed from the checkpoint into its segment (the
    /// work of the engines stage, done where the bytes end up).
    fn save_in_place(&mut self, save: &SaveTargets) -> Result<()> {
        let ip = self
            .builder
            .in_place()
            .ok_or_else(|| Error::Internal("in-place save without an in-place builder".into()))?;
        let weights = self.weights()?;
        let identity = self.identity.clone();
        let settings = self.builder.settings();
        let dir = self.opts.out.join(crate::layout::ENGINES);
        // Segments are named in the `.pte` by content; the partial files by the resume identity.
        let n = (self.prefix_plan.engines.len() + self.step_plan.engines.len()) as u64;
        let pb = bar(self.opts.progress, n, "save");
        let pause = self.opts.pause_after_engine;
        let progs = &self.l.progs;
        let mut out = Vec::new();
        for (tag, plan, program, staged) in [
            ("prefix", &self.prefix_plan, &progs.prefix, &save.prefix_pte),
            ("step", &self.step_plan, &progs.step, &save.step_pte),
        ] {
            let name = |i: usize, sub: &Program| -> Result<String> {
                Ok(engine_name(&settings, &identity.content, tag, i, sub)?)
            };
            let laid = in_place::lay_out(plan, program, weights, ip, &name)?;
            let mut p = ProgramBuilder::new();
            let delegates = laid
                .engines
                .iter()
                .zip(&plan.engines)
                .enumerate()
                .map(|(i, ((name, len), _))| -> Result<Delegate<'_>> {
                    let sub = plan.engine_program(program, i)?;
                    Ok(Delegate {
                        name,
                        backend_id: self.builder.backend_id(),
                        compile_specs: Vec::new(),
                        input_values: sub.input_values,
                        output_values: sub.output_values,
                        data: SegmentData::Deferred {
                            id: i as u64,
                            len: *len,
                        },
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            forward_method(&mut p, program, delegates, self.device)?;
            if tag == "step" {
                self.add_table(&mut p)?;
            }
            add_export_id(&mut p, &save.export_id)?;
            let after_engine = |i: usize, name: &str| {
                pb.set_message(name.to_string());
                pb.inc(1);
                if let Some(d) = pause {
                    std::thread::sleep(d);
                }
                crate::guard::stop_point(&format!("engine:{tag}:{i}"));
            };
            let target = in_place::Target {
                tag,
                plan,
                program,
                laid: &laid,
                weights,
                builder: self.builder.as_ref(),
                in_place: ip,
                identity: &identity.resume,
                dir: &dir,
                after_engine: &after_engine,
                stop: &interrupted,
            };
            out.push(in_place::write(&target, p, &save.staged(staged))?);
        }
        pb.finish_and_clear();
        let step = out.pop().expect("two programs");
        let prefix = out.pop().expect("two programs");
        self.pte_bytes = [prefix.file_len, step.file_len];
        self.built = prefix.built + step.built;
        self.records = [prefix.records, step.records];
        // Only this export's partial files lived there, now renamed.
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
}

/// One delegate of a `forward` method: an engine and where its bytes come from.
struct Delegate<'a> {
    name: &'a str,
    backend_id: &'a str,
    compile_specs: Vec<petite_pte::model::CompileSpec>,
    input_values: Vec<ValueId>,
    output_values: Vec<ValueId>,
    data: SegmentData,
}

impl<'a> Delegate<'a> {
    /// A built engine, its bytes streamed from its file, named `name` in the `.pte`.
    fn of_built(e: &'a BuiltEngine, name: &'a str) -> Self {
        let (path, offset, len) = engines::payload(e);
        Delegate {
            name,
            backend_id: &e.backend_id,
            compile_specs: engines::compile_specs(e),
            input_values: e.input_values.clone(),
            output_values: e.output_values.clone(),
            data: SegmentData::file_region(path, offset, len),
        }
    }
}

/// The name of engine `i` of program `tag`: a hash of the builder's settings, the inputs'
/// `identity` and the subgraph. With the resume identity it is the engine file's stem, so an
/// interrupted export re-run with the same arguments finds its finished work; with the content
/// identity, its named-data key in the `.pte` (no modification time in the bytes).
fn engine_name(
    settings: &str,
    identity: &str,
    tag: &str,
    i: usize,
    sub: &Program,
) -> petite_engine::Result<String> {
    let mut h = Sha256::new();
    h.update(settings.as_bytes());
    h.update(b"|");
    h.update(identity.as_bytes());
    h.update(b"|");
    h.update(sub.to_json()?.as_bytes());
    Ok(format!("{tag}_{i:03}_{}", &hex::encode(h.finalize())[..16]))
}

/// One plan's engines and their `report.json` records.
struct Built {
    engines: Vec<BuiltEngine>,
    records: Vec<EngineRecord>,
    built: usize,
    /// The most builds that ran at once.
    max_concurrent: usize,
}

impl EngineStages<'_> {
    /// Whether the convert stage writes the mapping file: the builder reads it, or the
    /// programs read quantized weights (only the mapping file holds their codes and scales).
    fn writes_mapping(&self) -> bool {
        self.builder.needs_mapping_file()
            || (mapping::has_quantized(&self.selection) && !self.quantizes_in_build)
    }
}

impl Stages for EngineStages<'_> {
    fn convert_stage(&self) -> &'static str {
        if self.writes_mapping() {
            "convert"
        } else {
            "fingerprint"
        }
    }

    fn convert(&mut self, identity: &Identity) -> Result<bool> {
        let ck = &self.l.ck;
        self.identity = identity.clone();
        // The export id's fingerprint of the weights: the seal of the mapping file keyed by
        // content (the file a builder reads is keyed for reuse, with modification times).
        let cache = self.opts.out.join(crate::layout::CACHE);
        if !self.writes_mapping() {
            // Every weight streams from the checkpoint; the mapping file is only the weights'
            // fingerprint in the export id, so only its seal is computed.
            self.seal = (!self.selection.is_empty())
                .then(|| mapping::engine_seal(ck, &identity.content, &self.selection, &cache))
                .transpose()?;
            self.weights = Some(ExportWeights {
                mapping: None,
                from_mapping: Default::default(),
                checkpoint: ck,
            });
            self.mapping_reused = false;
            return Ok(false);
        }
        let converted = if self.selection.is_empty() {
            None
        } else {
            Some(mapping::engine_mapping(
                ck,
                identity,
                &self.selection,
                &cache,
                self.opts.progress,
            )?)
        };
        self.seal = converted
            .as_ref()
            .map(|c| mapping::engine_seal(&c.file, &identity.content, &self.selection, &cache))
            .transpose()?;
        let reused = converted.as_ref().is_none_or(|c| c.reused);
        if let Some(c) = &converted {
            self.builder.attach_mapping(c.file.path())?;
            self.convert_seconds = c.seconds;
        }
        self.mapping_reused = reused;
        self.weights = Some(ExportWeights {
            mapping: converted.map(|c| c.file),
            from_mapping: self.selection.iter().map(|(n, _)| n.clone()).collect(),
            checkpoint: ck,
        });
        Ok(reused)
    }

    fn mapping(&self) -> Option<&petite_weights::MappedSafetensors> {
        self.weights.as_ref().and_then(|w| w.mapping.as_ref())
    }

    fn weights_seal(&self) -> Result<Option<String>> {
        Ok(self.seal.clone())
    }

    fn timestep(&mut self) -> Result<()> {
        self.table = Some(timestep_values(
            &self.l.progs,
            self.weights()?,
            &self.l.cfg,
        )?);
        Ok(())
    }

    fn builds_engines(&self) -> bool {
        !self.in_place
    }

    fn engines(&mut self, identity: &Identity) -> Result<bool> {
        let n = (self.prefix_plan.engines.len() + self.step_plan.engines.len()) as u64;
        self.pb = bar(self.opts.progress, n, "engines");
        let progs = &self.l.progs;
        let prefix = self.build("prefix", &self.prefix_plan, &progs.prefix, &identity.resume)?;
        let step = self.build("step", &self.step_plan, &progs.step, &identity.resume)?;
        self.pb.finish_and_clear();
        self.prefix_engines = prefix.engines;
        self.step_engines = step.engines;
        self.built = prefix.built + step.built;
        self.max_concurrent = prefix.max_concurrent.max(step.max_concurrent);
        self.records = [prefix.records, step.records];
        Ok(self.built == 0)
    }

    fn save(&mut self, save: &SaveTargets) -> Result<()> {
        if self.in_place {
            return self.save_in_place(save);
        }
        let progs = &self.l.progs;
        // Each engine's name in the `.pte`: by content, not by its file's (resume) name.
        let settings = self.builder.settings();
        let names = |tag: &str, plan: &Plan, program: &Program| -> Result<Vec<String>> {
            (0..plan.engines.len())
                .map(|i| {
                    let sub = plan.engine_program(program, i)?;
                    Ok(engine_name(
                        &settings,
                        &self.identity.content,
                        tag,
                        i,
                        &sub.program,
                    )?)
                })
                .collect()
        };
        let prefix_names = names("prefix", &self.prefix_plan, &progs.prefix)?;
        let step_names = names("step", &self.step_plan, &progs.step)?;
        fn delegates<'e>(engines: &'e [BuiltEngine], names: &'e [String]) -> Vec<Delegate<'e>> {
            engines
                .iter()
                .zip(names)
                .map(|(e, n)| Delegate::of_built(e, n))
                .collect()
        }
        let mut p = ProgramBuilder::new();
        forward_method(
            &mut p,
            &progs.prefix,
            delegates(&self.prefix_engines, &prefix_names),
            self.device,
        )?;
        add_export_id(&mut p, &save.export_id)?;
        let prefix_sum = p.write(save.staged(&save.prefix_pte), save.wopts)?;
        save.pb.inc(1);
        let mut p = ProgramBuilder::new();
        forward_method(
            &mut p,
            &progs.step,
            delegates(&self.step_engines, &step_names),
            self.device,
        )?;
        self.add_table(&mut p)?;
        add_export_id(&mut p, &save.export_id)?;
        let step_sum = p.write(save.staged(&save.step_pte), save.wopts)?;
        save.pb.finish_and_clear();
        self.pte_bytes = [prefix_sum.file_len, step_sum.file_len];
        if !self.opts.keep_engines {
            for e in self.prefix_engines.iter().chain(&self.step_engines) {
                let _ = std::fs::remove_file(&e.file);
            }
            // Only petite's own files live there (engines, TensorRT's ONNX models, logs, timing
            // cache, the mapping-file link).
            let _ = std::fs::remove_dir_all(self.opts.out.join(crate::layout::ENGINES));
        }
        Ok(())
    }

    fn report(&self, save: &SaveTargets) -> Saved {
        let progs = &self.l.progs;
        let (prefix_plan, step_plan) = (&self.prefix_plan, &self.step_plan);
        let weight_bytes = prefix_plan.weight_bytes
            + step_plan.weight_bytes
            + progs.timestep_table.weight_bytes() as u64;
        // Engines written in place are segments of the `.pte`s, not files of their own.
        let engine_bytes: u64 = self.records.iter().flatten().map(|r| r.file_bytes).sum();
        let pte_bytes = self.pte_bytes[0] + self.pte_bytes[1];
        // A builder that needs no mapping file writes none: nothing to report of it.
        let mapping = self.writes_mapping().then(|| MappingReport {
            path: self.mapping().map(|m| m.path().display().to_string()),
            reused: self.mapping_reused,
            bytes: self.mapping().map_or(0, |m| m.mapped_len() as u64),
            tensors: self.selection.len(),
            convert_seconds: self.convert_seconds,
        });
        let built = self.built;
        let reused = self.records.iter().map(Vec::len).sum::<usize>() - built;
        let part = EnginePart {
            engine_cap: self.engine_cap,
            memory_budget: self.memory_budget,
            memory_estimate: self.need,
            jobs: self.jobs,
            max_concurrent_builds: self.max_concurrent,
            builder: self.builder.info().to_string(),
            placement: match self.device {
                None => "host".to_string(),
                Some(d) => format!("device cuda:{d}"),
            },
            builder_settings: self.builder.settings(),
            build_memory_model: self.builder.memory(),
            mapping: mapping.clone(),
            programs: EnginePrograms {
                prefix: EngineProgram {
                    pte: save.prefix_pte.display().to_string(),
                    bytes: self.pte_bytes[0],
                    engines: self.records[0].clone(),
                    weight_bytes: prefix_plan.weight_bytes,
                    timestep_table: None,
                },
                step: EngineProgram {
                    pte: save.step_pte.display().to_string(),
                    bytes: self.pte_bytes[1],
                    engines: self.records[1].clone(),
                    weight_bytes: step_plan.weight_bytes,
                    timestep_table: Some([
                        self.l.cfg.steps,
                        self.table.as_ref().map_or(0, |t| t.row_len),
                    ]),
                },
            },
            engines: EngineCounts {
                built,
                reused,
                bytes: engine_bytes,
                kept: self.opts.keep_engines,
            },
        };
        Saved {
            cfg: None,
            runner: None,
            weight_bytes: None,
            host_table_bytes: None,
            part: BackendPart::Engines(part),
            written: Written {
                weight_bytes,
                mapping: mapping.map(|m| if m.reused { 0 } else { m.bytes }),
                programs: pte_bytes,
                pte: true,
                engines: (!self.in_place).then_some(engine_bytes),
            },
            engines_reused: reused,
            engines_built: built,
        }
    }
}

/// Adds method `forward` for `program` run as `engines` (each stored once as named data).
///
/// `device: None` plans every value in one host buffer, with no copies. `Some(d)` plans as
/// ExecuTorch ≥ 1.4 plans a device-tagged delegate (`PropagateDevicePass` + memory planning with
/// `enable_non_cpu_memory_planning`): the method's inputs and outputs in host buffer 1, every
/// delegate input and output in buffer 2 on CUDA device `d` (`non_const_buffer_device`, tensors
/// tagged in `extra_tensor_info`), an `et_copy::_h2d_copy.out` into a fresh device tensor before
/// each delegate's use of a method input, an `et_copy::_d2h_copy.out` after the delegate that
/// produces a method output, none between delegates, and `target_device=cuda:d` on every
/// delegate (the compile spec Torch-TensorRT's partitioner sets); device tensors share buffer
/// 2 by lifetime ([`MethodBuilder::reuse_buffer`]). The conformance tier checks
/// this layout against ExecuTorch's own exporter.
fn forward_method(
    pb: &mut ProgramBuilder,
    program: &Program,
    engines: Vec<Delegate<'_>>,
    device: Option<u8>,
) -> Result<()> {
    let mut m = MethodBuilder::new(METHOD);
    let tensor_of = |v: ValueId| -> Result<(ScalarType, Vec<i32>)> {
        let t = program.node(v).tensor().ok_or_else(|| {
            Error::Internal(format!(
                "value {v} crossing an engine boundary is not a tensor"
            ))
        })?;
        let sizes: Vec<i32> = t.shape.iter().map(|&d| d as i32).collect();
        Ok((petite_portable::scalar_type(t.dtype), sizes))
    };
    // Host values (method inputs, outputs) and, with a device, the delegates' device values.
    const HOST: u32 = 1;
    const DEVICE: u32 = 2;
    let mut host: BTreeMap<ValueId, i32> = BTreeMap::new();
    let mut on_device: BTreeMap<ValueId, i32> = BTreeMap::new();
    let new_tensor = |m: &mut MethodBuilder, v: ValueId, buffer: u32| -> Result<i32> {
        let (st, sizes) = tensor_of(v)?;
        Ok(m.planned_tensor_in(buffer, st, &sizes)?)
    };
    // The host tensor of `v`, planned on first use (the whole layout of `--placement host`).
    let host_value =
        |m: &mut MethodBuilder, host: &mut BTreeMap<ValueId, i32>, v: ValueId| -> Result<i32> {
            if let Some(&i) = host.get(&v) {
                return Ok(i);
            }
            let i = new_tensor(m, v, HOST)?;
            host.insert(v, i);
            Ok(i)
        };
    if let Some(d) = device {
        m.place_buffer(DEVICE, DeviceType::CUDA, d as i8);
    }
    let mut inputs = Vec::new();
    for &id in &program.inputs {
        let i = new_tensor(&mut m, id, HOST)?;
        host.insert(id, i);
        inputs.push(i);
    }
    let method_outputs: Vec<ValueId> = program.outputs.iter().map(|o| o.value).collect();
    for e in engines {
        let seg = pb.add_named_data(e.name, e.data, ENGINE_ALIGNMENT)?;
        let mut compile_specs = e.compile_specs;
        if let Some(d) = device {
            compile_specs.push(petite_pte::model::CompileSpec {
                key: "target_device".into(),
                value: format!("cuda:{d}").into_bytes(),
            });
        }
        let di = m.delegate(DelegateSpec {
            id: e.backend_id.to_string(),
            processed: Processed::Segment(seg),
            compile_specs,
        });
        let mut args = Vec::new();
        for &v in &e.input_values {
            let a = match device {
                None => host_value(&mut m, &mut host, v)?,
                Some(_) => match on_device.get(&v) {
                    Some(&i) => i,
                    None => {
                        // A method input: copied into a device tensor of its own for this use.
                        let &src = host.get(&v).ok_or_else(|| {
                            Error::Internal(format!(
                                "engine {}: input value {v} is neither a method input nor an earlier engine's output",
                                e.name
                            ))
                        })?;
                        let t = new_tensor(&mut m, v, DEVICE)?;
                        m.kernel_call("et_copy::_h2d_copy", "out", &[src, t, t]);
                        t
                    }
                },
            };
            args.push(a);
        }
        let mut leaving = Vec::new();
        for &v in &e.output_values {
            let a = match device {
                None => host_value(&mut m, &mut host, v)?,
                Some(_) => {
                    let t = new_tensor(&mut m, v, DEVICE)?;
                    on_device.insert(v, t);
                    if method_outputs.contains(&v) {
                        leaving.push((v, t));
                    }
                    t
                }
            };
            args.push(a);
        }
        m.delegate_call(di, &args);
        for (v, t) in leaving {
            let h = new_tensor(&mut m, v, HOST)?;
            m.kernel_call("et_copy::_d2h_copy", "out", &[t, h, h]);
            host.insert(v, h);
        }
    }
    let mut outputs = Vec::new();
    for &v in &method_outputs {
        let i = match host.get(&v) {
            Some(&i) => i,
            None => new_tensor(&mut m, v, HOST)?,
        };
        outputs.push(i);
    }
    m.inputs(&inputs);
    m.outputs(&outputs);
    if device.is_some() {
        // Device memory is the scarce one (on a Jetson, the one DRAM the engines live in):
        // values share it by lifetime, as ExecuTorch's planner shares it. The host buffer keeps
        // the one-slot-per-value plan of `--placement host`.
        m.reuse_buffer(DEVICE)?;
    }
    pb.add_method(m)?;
    Ok(())
}

/// The export id as named data (no method reads it; readers compare the two files').
fn add_export_id(p: &mut ProgramBuilder, id: &str) -> Result<()> {
    p.add_named_data(
        crate::layout::EXPORT_ID_KEY,
        petite_pte::SegmentData::Bytes(std::sync::Arc::from(id.as_bytes())),
        16,
    )?;
    Ok(())
}

/// Whether `program` reads a quantized weight's codes or scales as a row range (row ranges are
/// the program's own weights; partitioning makes none).
fn quantized_row_ranges(program: &petite_graph::Program) -> bool {
    program.weights().iter().any(|w| {
        w.rows.is_some()
            && (w.dtype.is_quant_code() || petite_graph::quant::scaled_weight(&w.name).is_some())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// Engines of 128 MiB of bf16 weights (739.2 MiB a TensorRT-RTX build under its model)
    /// and smaller ones, with a 38 MiB process.
    fn case() -> (BuildMemory, Vec<WeightBytes>, u64, u64) {
        let m = petite_engine::tensorrt::RTX_BUILD_MEMORY;
        let half = |mib: u64| WeightBytes {
            half: mib * MIB,
            full: 0,
        };
        let engines = vec![half(128), half(100), half(128), half(20)];
        (m, engines, 38 * MIB, m.bytes(half(128)))
    }

    #[test]
    fn jobs_default_to_what_both_the_budget_and_the_cores_allow() {
        let (m, e, base, one) = case();
        let jobs = |limit, cores| choose_jobs(None, limit, base, m, &e, cores).unwrap();
        // The budget holds one build: one, however many cores.
        let (n, line) = jobs(MemoryLimit::Budget(base + 2 * one - 1), 8);
        assert_eq!(n, 1);
        assert_eq!(
            line,
            "building up to 1 engine at once (memory budget 1.48 GiB: 1 builder of up to 739.2 MiB under the builder's memory model beside the process's 38.0 MiB; 8 cores)"
        );
        // Two builds fit: two on two cores, one on one core.
        assert_eq!(jobs(MemoryLimit::Budget(base + 2 * one), 2).0, 2);
        assert_eq!(jobs(MemoryLimit::Budget(base + 2 * one), 1).0, 1);
        // Plenty of memory: the cores decide.
        let (n, line) = jobs(MemoryLimit::Budget(64 << 30), 2);
        assert_eq!(n, 2);
        assert!(line.contains("4 builders of up to 739.2 MiB") && line.ends_with("; 2 cores)"));
        // No budget: what bounds the machine's memory bounds it as a budget would, else the
        // cores alone.
        let (n, line) = jobs(
            MemoryLimit::Machine(Some(("cgroup memory limit", base + one))),
            4,
        );
        assert_eq!(n, 1);
        assert!(
            line.contains("(cgroup memory limit 777.2 MiB: 1 builder"),
            "{line}"
        );
        let (n, line) = jobs(MemoryLimit::Machine(None), 3);
        assert_eq!(n, 3);
        assert!(line.contains("memory not known"), "{line}");
    }

    #[test]
    fn explicit_jobs_above_the_budget_are_refused_in_one_line() {
        let (m, e, base, one) = case();
        let budget = MemoryLimit::Budget(base + 2 * one);
        let (n, line) = choose_jobs(Some(2), budget, base, m, &e, 1).unwrap();
        assert_eq!(n, 2, "--jobs may exceed the cores");
        assert!(line.starts_with("building up to 2 engines at once (--jobs 2; memory budget"));
        let err = choose_jobs(Some(3), budget, base, m, &e, 8)
            .unwrap_err()
            .to_string();
        assert!(!err.contains('\n'));
        assert!(
            err.starts_with("--jobs 3: memory budget 1.48 GiB fits 2 builds at once")
                && err.contains("pass --jobs 2 or less"),
            "{err}"
        );
        // Without a budget an explicit --jobs is the user's call.
        let avail = MemoryLimit::Machine(Some(("memory available", base + one)));
        assert_eq!(choose_jobs(Some(3), avail, base, m, &e, 2).unwrap().0, 3);
    }
}
