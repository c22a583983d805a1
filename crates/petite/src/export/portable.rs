//! `--backend portable`: the same stages and bounds as the engine backends, without engines.
//! load (lowering of prefix and step to portable kernel calls and their memory plans: every
//! refusal happens here, before any file) → convert (both `.pte`s laid out, every weight
//! converted — in the program's dtype, transposed where the lowering stores it so — from the
//! checkpoint straight into its place in the constant segment: read once, written once, no
//! mapping file) → timestep table (once, on the reference executor, as the engine backends do:
//! the adaRMS weights it reads, 0.44 GiB at full size, stay out of the `.pte`) → save (the rest
//! of each file — program, small constants, the table, the export id — then renamed to its
//! staged name: `prefix.pte` = method `forward`; `step.pte` = `forward` + `timestep_table`).
//!
//! Resume: as the reference backend's in-place `.pte`s ([`super::in_place`]), each file is
//! written as `OUT/engines/<tag>-<key>.pte.partial` with a journal, here of groups of weights
//! (about [`GROUP`] bytes each, synced and sealed once written): a re-run with the same
//! arguments keeps the journaled groups whose seals match and converts the rest. The export
//! id's fingerprint of the weights is the seal the mapping file would have had
//! ([`petite_portable::mapping_seal`]), read back from the weights where they are.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use petite_graph::Program;
use petite_pi05::programs::io;
use petite_portable::{Built, ExportReport, Lowered, MemoryPlan, MethodSpec, StoredWeight};
use petite_pte::{Placed, Resume};
use petite_weights::WeightSource;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::in_place::{Journal, partial_for};
use super::mapping::{self, KEY_META};
use super::{
    ExportOptions, Identity, Loaded, METHOD, PORTABLE_CONVERT_BYTES, SaveTargets, Saved, Stages,
    TABLE_METHOD, Table, bar, spec_path, timestep_values,
};
use crate::memory::human;
use crate::report::{
    BackendPart, PortablePart, PortableProgram, PortablePrograms, PortableWeights, Written,
};
use crate::{Error, Result};

/// Weight bytes journaled together: a killed run loses at most about this much converted work
/// (plus what was in flight); each group costs one sync and a sampled read-back of its seal
/// (5.2 MiB of small reads), so groups are large.
const GROUP: u64 = 1 << 30;

/// What a journal's entries are here: groups of weights, in file order.
const WEIGHTS: &str = "weights";

/// The portable backend's export, from its lowered programs to its report.
pub(super) struct PortableStages<'l> {
    l: &'l Loaded,
    opts: &'l ExportOptions,
    need: u64,
    prefix: (Lowered, MemoryPlan),
    step: (Lowered, MemoryPlan),
    /// Every stored weight of both programs (the mapping file's table the export id's
    /// fingerprint is the seal of).
    table: Vec<StoredWeight>,
    rows: petite_weights::RowSlices<'l, dyn petite_weights::WeightSource + 'l>,
    /// The inputs' identity, from the convert stage on.
    identity: Identity,
    /// Both programs' partial files, from the convert stage on.
    partials: Vec<Partial>,
    timestep: Option<Table>,
    written: Option<[(u64, Vec<ExportReport>); 2]>,
}

/// One program's partial `.pte` and where its weights are in it.
struct Partial {
    tag: &'static str,
    path: PathBuf,
    /// The program's stored weights (a deferred constant's id indexes it).
    table: Vec<StoredWeight>,
    /// Its weights' places, in file order.
    places: Vec<Placed>,
    /// Bytes kept from an earlier run.
    resumed: u64,
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
            identity: Identity::default(),
            partials: Vec::new(),
            timestep: None,
            written: None,
        })
    }

    /// The timestep table's method: the table's values, or zeros of its shape before the
    /// timestep stage (the layout, and so every weight's place, is the same).
    fn table_method(&self) -> Result<(Lowered, MemoryPlan)> {
        let cfg = &self.l.cfg;
        let row_len = petite_pi05::programs::time_row_len(cfg);
        let zeros;
        let values = match &self.timestep {
            Some(t) => &t.values,
            None => {
                zeros = vec![0f32; cfg.steps * row_len];
                &zeros
            }
        };
        let mut b = petite_graph::Builder::new();
        let c = b.constant_f32(&[cfg.steps, row_len], values)?;
        b.output(io::TIMESTEP_TABLE, c)?;
        let lowered = petite_portable::lower(&b.finish()?)?;
        let plan = petite_portable::plan(&lowered);
        Ok((lowered, plan))
    }

    /// Program `tag` (`prefix` or `step`) built with the export id `id`: its weights deferred
    /// (converted into their places by the convert stage).
    fn build(&self, tag: &str, table: &(Lowered, MemoryPlan), id: &str) -> Result<Built> {
        let named = [(crate::layout::EXPORT_ID_KEY, id.as_bytes())];
        Ok(if tag == "prefix" {
            petite_portable::build_program(&[spec(METHOD, &self.prefix)], None, &named)?
        } else {
            let table_spec = MethodSpec {
                name: TABLE_METHOD,
                lowered: &table.0,
                plan: &table.1,
            };
            petite_portable::build_program(&[spec(METHOD, &self.step), table_spec], None, &named)?
        })
    }

    /// Program `tag`'s partial file in `dir` and its weights' places.
    fn lay_out(&self, tag: &'static str, built: Built, dir: &Path) -> Result<Partial> {
        let Built { builder, table, .. } = built;
        let (program, segments) = builder.build()?;
        Ok(Partial {
            tag,
            path: partial_for(dir, tag, &self.identity.resume, &program, &segments)?,
            table,
            places: petite_pte::deferred_places(&program, &segments)?,
            resumed: 0,
        })
    }

    /// Converts every weight of `p` not already in its partial file (journaled by an earlier
    /// run, seal matching) into its place.
    fn convert_program(&self, p: Partial) -> Result<Partial> {
        let Partial {
            tag,
            path,
            table,
            places,
            ..
        } = p;
        let groups = groups(&places);
        let mut journal = Journal::load(&path, WEIGHTS);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| Error::io(&path, "open", e))?;
        let mut todo = Vec::new();
        let mut resumed = 0;
        for (g, r) in groups.iter().enumerate() {
            let ps = &places[r.clone()];
            let (at, len) = extent(ps);
            let kept = journal.done.get(&g).is_some_and(|(o, n, seal)| {
                (*o, *n) == (at, len) && group_seal(&file, ps).is_ok_and(|s| s == *seal)
            });
            if kept {
                resumed += len;
                continue;
            }
            if journal.done.remove(&g).is_some() {
                crate::guard::damaged(
                    &path,
                    "partial .pte",
                    &format!("weight group {g} differs from its journal entry"),
                );
            }
            todo.extend(ps.iter().map(|p| (p.id as usize, p.offset)));
        }
        let group_of: HashMap<usize, usize> = groups
            .iter()
            .enumerate()
            .flat_map(|(g, r)| places[r.clone()].iter().map(move |p| (p.id as usize, g)))
            .collect();
        let left: Vec<usize> = groups.iter().map(|r| r.len()).collect();
        let state = Mutex::new((journal, left));
        let total: u64 = todo.iter().map(|&(t, _)| table[t].nbytes()).sum();
        let pb = bar(self.opts.progress, total, &format!("convert {tag}"));
        // A group is journaled once its every weight is written and synced; the sync and the
        // seal's read-back run outside the lock, so the other thread keeps converting.
        let done = |t: usize| -> petite_portable::Result<()> {
            let g = group_of[&t];
            {
                let mut st = state.lock().expect("no panics");
                st.1[g] -= 1;
                if st.1[g] > 0 {
                    return Ok(());
                }
            }
            let ps = &places[groups[g].clone()];
            let io = |op: &'static str, e: std::io::Error| petite_portable::Error::Io {
                path: path.clone(),
                op,
                source: e,
            };
            file.sync_data().map_err(|e| io("sync weights", e))?;
            let seal = group_seal(&file, ps).map_err(|e| io("read back weights", e))?;
            let (at, len) = extent(ps);
            let mut st = state.lock().expect("no panics");
            st.0.done.insert(g, (at, len, seal));
            st.0.save()
                .map_err(|e| io("save journal", std::io::Error::other(e.to_string())))?;
            drop(st);
            crate::guard::stop_point(&format!("weights:{tag}:{g}"));
            Ok(())
        };
        petite_portable::write_weights_at(
            &table,
            &todo,
            &self.rows,
            &file,
            &path,
            &mut |d, _| pb.set_position(d),
            &done,
        )?;
        pb.finish_and_clear();
        Ok(Partial {
            tag,
            path,
            table,
            places,
            resumed,
        })
    }
}

/// The groups of `places` (in file order) journaled together: runs of about [`GROUP`] bytes.
fn groups(places: &[Placed]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, p) in places.iter().enumerate() {
        bytes += p.len;
        if bytes >= GROUP || i + 1 == places.len() {
            out.push(start..i + 1);
            (start, bytes) = (i + 1, 0);
        }
    }
    out
}

/// The offset of a group's first weight and its weights' bytes.
fn extent(ps: &[Placed]) -> (u64, u64) {
    (
        ps.first().map_or(0, |p| p.offset),
        ps.iter().map(|p| p.len).sum(),
    )
}

/// The seal of a group's weights' bytes as they are in `file` (back to back; what lies between
/// them is written by the save stage).
fn group_seal(file: &File, ps: &[Placed]) -> std::io::Result<String> {
    let (_, len) = extent(ps);
    petite_weights::seal::line(len, &mut |off, buf| {
        let mut filled = 0usize;
        let mut base = 0u64;
        for p in ps {
            let p_end = base + p.len;
            let want = off + filled as u64;
            if filled < buf.len() && want < p_end {
                let k = ((p_end - want) as usize).min(buf.len() - filled);
                file.read_exact_at(&mut buf[filled..filled + k], p.offset + (want - base))?;
                filled += k;
            }
            base = p_end;
        }
        Ok(())
    })
}

impl Stages for PortableStages<'_> {
    fn convert(&mut self, identity: &Identity) -> Result<bool> {
        self.identity = identity.clone();
        let dir = self.opts.out.join(crate::layout::ENGINES);
        let placeholder = "0".repeat(super::EXPORT_ID_LEN);
        // Both laid out first, then their programs dropped (the timestep table's stand-in and
        // the small constants are MiBs) before any weight is converted.
        let laid = {
            let table = self.table_method()?;
            let mut laid = Vec::with_capacity(2);
            for tag in ["prefix", "step"] {
                laid.push(self.lay_out(tag, self.build(tag, &table, &placeholder)?, &dir)?);
            }
            laid
        };
        let mut partials = Vec::with_capacity(2);
        for p in laid {
            partials.push(self.convert_program(p)?);
        }
        self.partials = partials;
        // Every weight is on storage in the partial files; the checkpoint was not changed
        // meanwhile (else the journaled groups are not trusted by the next run either: its
        // identity differs).
        self.l.ck.check_unchanged()?;
        Ok(false)
    }

    fn mapping(&self) -> Option<&petite_weights::MappedSafetensors> {
        None
    }

    /// The seal the mapping file of the stored weights would have (the export id is unchanged
    /// from the exports that wrote one), its sampled bytes read from the partial `.pte`s.
    fn weights_seal(&self) -> Result<Option<String>> {
        let mut h = Sha256::new();
        h.update(self.identity.content.as_bytes());
        h.update(b"|portable|");
        for w in &self.table {
            h.update(format!("{}|{:?}|", w.key, w.shape).as_bytes());
        }
        let key = hex::encode(h.finalize());
        let path = mapping::path(&self.opts.out.join(crate::layout::CACHE), &key);
        let mut files = Vec::with_capacity(self.partials.len());
        let mut at: HashMap<&str, (usize, u64)> = HashMap::new();
        for (f, p) in self.partials.iter().enumerate() {
            files.push(File::open(&p.path).map_err(|e| Error::io(&p.path, "open", e))?);
            for pl in &p.places {
                at.insert(p.table[pl.id as usize].key.as_str(), (f, pl.offset));
            }
        }
        let seal = petite_portable::mapping_seal(
            &self.table,
            &path,
            &[(KEY_META.to_string(), key.clone())],
            &mut |t, off, buf| {
                let (f, o) = at
                    .get(self.table[t].key.as_str())
                    .copied()
                    .ok_or_else(|| std::io::Error::other("a stored weight is in no program"))?;
                files[f].read_exact_at(buf, o + off)
            },
        )?;
        Ok(Some(seal))
    }

    fn timestep(&mut self) -> Result<()> {
        self.timestep = Some(timestep_values(&self.l.progs, &self.l.ck, &self.l.cfg)?);
        Ok(())
    }

    fn save(&mut self, save: &SaveTargets) -> Result<()> {
        let out_of_order = || Error::Internal("export stages out of order".into());
        if self.timestep.is_none() || self.partials.len() != 2 {
            return Err(out_of_order());
        }
        let table = self.table_method()?;
        let mut written = Vec::with_capacity(2);
        for (p, pte) in self.partials.iter().zip([&save.prefix_pte, &save.step_pte]) {
            let Built {
                builder,
                mut reports,
                ..
            } = self.build(p.tag, &table, &save.export_id)?;
            let (program, segments) = builder.build()?;
            if petite_pte::deferred_places(&program, &segments)? != p.places {
                return Err(Error::Internal(format!(
                    "{}: the weights' places moved between the convert and save stages",
                    p.tag
                )));
            }
            let sum = petite_pte::write_pte_resumable(
                &p.path,
                &save.staged(pte),
                &program,
                &segments,
                save.wopts,
                &mut Converted {
                    ck: &self.l.ck,
                    places: &p.places,
                },
            )?;
            Journal::load(&p.path, WEIGHTS).remove();
            for r in &mut reports {
                r.file_bytes = sum.file_len;
            }
            crate::report::write_json(
                &save.staged(&spec_path(pte)),
                &json!({ "methods": reports }),
            )?;
            save.pb.inc(1);
            written.push((sum.file_len, reports));
        }
        save.pb.finish_and_clear();
        // Only this export's partial files lived there, now renamed.
        let _ = std::fs::remove_dir_all(self.opts.out.join(crate::layout::ENGINES));
        let step = written.pop().ok_or_else(out_of_order)?;
        let prefix = written.pop().ok_or_else(out_of_order)?;
        self.written = Some([prefix, step]);
        Ok(())
    }

    fn report(&self, save: &SaveTargets) -> Saved {
        let weight_bytes: u64 = self.table.iter().map(|w| w.nbytes()).sum();
        let empty = (0, vec![]);
        let [prefix, step] = self
            .written
            .as_ref()
            .map_or([&empty, &empty], |[a, b]| [a, b]);
        let program = |pte: &Path, (bytes, reps): &(u64, Vec<ExportReport>)| PortableProgram {
            pte: pte.display().to_string(),
            bytes: *bytes,
            methods: serde_json::to_value(reps).unwrap_or_default(),
        };
        let row_len = self.timestep.as_ref().map_or(0, |t| t.row_len);
        let part = PortablePart {
            memory_budget: self.opts.memory_budget,
            memory_estimate: self.need,
            weights: PortableWeights {
                tensors: self.table.len(),
                bytes: weight_bytes,
                resumed: self.partials.iter().map(|p| p.resumed).sum(),
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
            weight_bytes: None,
            host_table_bytes: None,
            part: BackendPart::Portable(part),
            written: Written {
                weight_bytes,
                mapping: None,
                programs: prefix.0 + step.0,
                pte: true,
                engines: None,
            },
            engines_reused: 0,
            engines_built: 0,
        }
    }
}

/// The [`Resume`] hooks of the save stage: the weights are already in their places (the
/// convert stage wrote and synced them), every other byte is written again.
struct Converted<'a> {
    ck: &'a petite_pi05::inputs::CanonicalCheckpoint,
    places: &'a [Placed],
}

impl Resume for Converted<'_> {
    type Error = Error;

    fn done(&mut self, _: &File, _: usize, _: u64, _: u64) -> bool {
        false
    }

    fn fill(&mut self, id: u64, _: &File, _: u64, _: u64) -> Result<()> {
        Err(Error::Internal(format!(
            "deferred segment {id}: the portable constants are one gathered segment"
        )))
    }

    fn fill_parts(&mut self, _: &File, parts: &[Placed]) -> Result<()> {
        if parts != self.places {
            return Err(Error::Internal(
                "the constant segment's weights are not those the convert stage wrote".into(),
            ));
        }
        Ok(())
    }

    /// The weights came from the checkpoint as it was opened: else the file stays partial.
    fn ready(&mut self) -> Result<()> {
        Ok(self.ck.check_unchanged()?)
    }

    fn finished(&mut self, _: &File, _: usize, _: u64, _: u64) -> Result<()> {
        Ok(())
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
