//! `--backend portable`: the same stages and bounds as the engine backends, without engines.
//! load (lowering of prefix and step to portable kernel calls and their memory plans: every
//! refusal happens here, before any file) → convert (the mapping file: every weight once, in the
//! program's dtype and the layout the `.pte` stores, streamed tensor by tensor; reused while the
//! checkpoint is unchanged) → timestep table (once, on the reference executor, as the engine
//! backends do: the adaRMS weights it reads, 0.44 GiB at full size, stay out of the `.pte`) →
//! save (`prefix.pte` = method `forward`; `step.pte` = `forward` + `timestep_table`, a kernel
//! call returning the table; constants are regions of the mapping file copied in-kernel, so each
//! weight byte is written into the `.pte` once and never passes through memory).

use std::path::{Path, PathBuf};

use petite_graph::Program;
use petite_pi05::programs::io;
use petite_portable::{ExportReport, Lowered, MemoryPlan, MethodSpec, StoredWeight};
use petite_weights::MappedSafetensors;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::mapping::{self, KEY_META};
use super::{
    ExportOptions, Loaded, METHOD, PORTABLE_CONVERT_BYTES, SaveTargets, Saved, Stages,
    TABLE_METHOD, Table, bar, spec_path, timestep_values,
};
use crate::memory::human;
use crate::report::{
    BackendPart, PortableMapping, PortablePart, PortableProgram, PortablePrograms, Written,
};
use crate::{Error, Result};

/// The portable backend's export, from its lowered programs to its report.
pub(super) struct PortableStages<'l> {
    l: &'l Loaded,
    opts: &'l ExportOptions,
    need: u64,
    prefix: (Lowered, MemoryPlan),
    step: (Lowered, MemoryPlan),
    table: Vec<StoredWeight>,
    rows: petite_weights::RowSlices<'l, dyn petite_weights::WeightSource + 'l>,
    mapping: Option<MappedSafetensors>,
    mapping_path: PathBuf,
    mapping_reused: bool,
    timestep: Option<(Table, Lowered, MemoryPlan)>,
    written: Option<[(u64, u64, Vec<ExportReport>); 2]>,
}

impl<'l> PortableStages<'l> {
    /// The load stage's backend part: budget, lowering, memory plans, weight checks.
    pub(super) fn plan(l: &'l Loaded, opts: &'l ExportOptions) -> Result<Self> {
        let build_need = PORTABLE_CONVERT_BYTES;
        let need = l.base + build_need;
        if let Some(b) = opts.memory_budget
            && need > b
        {
            return Err(Error::Budget(format!(
                "memory budget {} is too small: the process base is {} and converting the weights \
                 one at a time needs {} more, {} in all; nothing was done",
                human(b),
                human(l.base),
                human(build_need),
                human(need)
            )));
        }
        let lower = |what: &str, p: &Program| {
            petite_portable::lower(p).map_err(|e| {
                Error::Usage(format!(
                    "{what} program: {e}; --backend portable cannot export it (nothing was written)"
                ))
            })
        };
        let progs = &l.progs;
        let l_prefix = lower("prefix", &progs.prefix)?;
        let l_step = lower("step", &progs.step)?;
        let (p_prefix, p_step) = (
            petite_portable::plan(&l_prefix),
            petite_portable::plan(&l_step),
        );
        let table = petite_portable::stored_weights(&[&l_prefix, &l_step]);
        // Row-range weights (the sharded token embedding) are served as just their rows.
        let rows = petite_portable::row_source(&[&progs.prefix, &progs.step], &l.ck)?;
        petite_portable::check_weights(&table, &rows)?;
        Ok(PortableStages {
            l,
            opts,
            need,
            prefix: (l_prefix, p_prefix),
            step: (l_step, p_step),
            table,
            rows,
            mapping: None,
            mapping_path: PathBuf::new(),
            mapping_reused: false,
            timestep: None,
            written: None,
        })
    }
}

impl Stages for PortableStages<'_> {
    fn convert(&mut self, identity: &str) -> Result<bool> {
        let mut h = Sha256::new();
        h.update(identity.as_bytes());
        h.update(b"|portable|");
        for w in &self.table {
            h.update(format!("{}|{:?}|", w.key, w.shape).as_bytes());
        }
        let key = hex::encode(h.finalize());
        let cache = self.opts.out.join(crate::layout::CACHE);
        let path = mapping::path(&cache, &key);
        let reuse = mapping::current(&path, &key, self.table.iter().map(|w| w.key.as_str()));
        self.mapping_reused = reuse.is_some();
        let file = match reuse {
            Some(m) => m,
            None => {
                mapping::clear_stale(&cache, &path)?;
                let total: u64 = self.table.iter().map(|w| w.nbytes()).sum();
                let pb = bar(self.opts.progress, total, "convert");
                petite_portable::write_mapping(
                    &self.table,
                    &self.rows,
                    &path,
                    &[(KEY_META.to_string(), key.clone())],
                    &mut |done, _| {
                        pb.set_position(done);
                    },
                )?;
                pb.finish_and_clear();
                MappedSafetensors::open_as(&path, petite_weights::Role::MappingFile)?
            }
        };
        self.mapping = Some(file);
        self.mapping_path = path;
        Ok(self.mapping_reused)
    }

    fn mapping(&self) -> Option<&MappedSafetensors> {
        self.mapping.as_ref()
    }

    fn timestep(&mut self) -> Result<()> {
        let cfg = &self.l.cfg;
        let table = timestep_values(&self.l.progs, &self.l.ck, cfg)?;
        let mut b = petite_graph::Builder::new();
        let c = b.constant_f32(&[cfg.steps, table.row_len], &table.values)?;
        b.output(io::TIMESTEP_TABLE, c)?;
        let lowered = petite_portable::lower(&b.finish()?)?;
        let plan = petite_portable::plan(&lowered);
        self.timestep = Some((table, lowered, plan));
        Ok(())
    }

    fn save(&mut self, save: &SaveTargets) -> Result<()> {
        let out_of_order = || Error::Usage("export stages out of order".into());
        let mapping = self.mapping.as_ref().ok_or_else(out_of_order)?;
        let (_, l_table, p_table) = self.timestep.as_ref().ok_or_else(out_of_order)?;
        let constants = petite_portable::Constants::Mapping(mapping);
        let (prefix_rep, prefix_sum) = petite_portable::write_program_with(
            &[spec(METHOD, &self.prefix)],
            constants,
            &[(crate::bundle::EXPORT_ID_KEY, save.export_id.as_bytes())],
            &save.staged(&save.prefix_pte),
            save.wopts,
        )?;
        save.pb.inc(1);
        let table_spec = MethodSpec {
            name: TABLE_METHOD,
            lowered: l_table,
            plan: p_table,
        };
        let (step_rep, step_sum) = petite_portable::write_program_with(
            &[spec(METHOD, &self.step), table_spec],
            constants,
            &[(crate::bundle::EXPORT_ID_KEY, save.export_id.as_bytes())],
            &save.staged(&save.step_pte),
            save.wopts,
        )?;
        for (pte, reps) in [(&save.prefix_pte, &prefix_rep), (&save.step_pte, &step_rep)] {
            crate::report::write_json(&save.staged(&spec_path(pte)), &json!({ "methods": reps }))?;
        }
        save.pb.finish_and_clear();
        self.written = Some([
            (
                prefix_sum.file_len,
                prefix_sum.bytes_copied_in_kernel,
                prefix_rep,
            ),
            (step_sum.file_len, step_sum.bytes_copied_in_kernel, step_rep),
        ]);
        // The `.pte` files are written: the mapping's pages are no longer needed.
        self.mapping = None;
        Ok(())
    }

    fn report(&self, save: &SaveTargets) -> Saved {
        let weight_bytes: u64 = self.table.iter().map(|w| w.nbytes()).sum();
        let mapping_bytes = std::fs::metadata(&self.mapping_path).map_or(0, |m| m.len());
        let empty = (0, 0, vec![]);
        let [prefix, step] = self
            .written
            .as_ref()
            .map_or([&empty, &empty], |[a, b]| [a, b]);
        let program =
            |pte: &Path, (bytes, copied, reps): &(u64, u64, Vec<ExportReport>)| PortableProgram {
                pte: pte.display().to_string(),
                bytes: *bytes,
                bytes_copied_in_kernel: *copied,
                methods: serde_json::to_value(reps).unwrap_or_default(),
            };
        let row_len = self.timestep.as_ref().map_or(0, |(t, _, _)| t.row_len);
        let part = PortablePart {
            memory_budget: self.opts.memory_budget,
            memory_estimate: self.need,
            mapping: PortableMapping {
                path: self.mapping_path.display().to_string(),
                reused: self.mapping_reused,
                bytes: mapping_bytes,
                tensors: self.table.len(),
            },
            programs: PortablePrograms {
                prefix: program(&save.prefix_pte, prefix),
                step: program(&save.step_pte, step),
                timestep_table: [self.l.cfg.steps, row_len],
            },
        };
        Saved {
            cfg: None,
            runner: None,
            part: BackendPart::Portable(part),
            written: Written {
                weight_bytes,
                mapping: Some(if self.mapping_reused {
                    0
                } else {
                    mapping_bytes
                }),
                programs: prefix.0 + step.0,
                pte: true,
                engines: None,
                copied_in_kernel: Some(prefix.1 + step.1),
            },
            engines_reused: 0,
            engines_built: 0,
        }
    }
}

/// The method `name` of a lowered program and its memory plan.
fn spec<'a>(name: &'a str, (lowered, plan): &'a (Lowered, MemoryPlan)) -> MethodSpec<'a> {
    MethodSpec {
        name,
        lowered,
        plan,
    }
}
