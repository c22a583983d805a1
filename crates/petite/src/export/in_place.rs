//! Engines written once, straight into their `.pte` (a backend whose builder writes in place,
//! [`petite_engine::InPlaceBuilder`]: the reference backend without `--keep-engines`): each
//! engine's size is known from its subgraph and weights' table before any weight is read, so
//! the whole `.pte` is laid out first and each engine segment is then streamed from the
//! checkpoint (converted chunk by chunk) into its place. Each weight is read once and written
//! once; there is no mapping file and no engine file.
//!
//! Resume: the `.pte` is written under `OUT/engines/<tag>-<key>.pte.partial` (`key`: a hash of
//! the planned program bytes and the inputs' identity, so only the same export reuses it), and
//! `<that>.journal` lists every segment whose bytes are on storage, with the seal of its bytes
//! ([`petite_weights::seal::of_region`]: length + SHA-256, sampled over a large segment). A
//! re-run with the same arguments keeps the journaled segments whose seals still match and
//! writes the rest; a damaged one is rewritten with a notice. Neither name carries petite-fs's
//! temporary mark, so the guard's clean-up of killed runs leaves them. Finished, the file is
//! renamed to its staged name and the journal removed.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use petite_engine::{EngineBuilder, EngineJob, InPlaceBuilder, WeightBytes};
use petite_graph::Program;
use petite_partition::Plan;
use petite_pte::{ProgramBuilder, Resume, SegmentData, WriteOptions};
use sha2::{Digest, Sha256};

use crate::report::EngineRecord;
use crate::{Error, Result};

/// What one program's engines are, before any is written.
pub(super) struct Laid {
    /// Per engine: its name and its segment's length.
    pub(super) engines: Vec<(String, u64)>,
}

/// One program written in place: its file's size and its engines' records.
pub(super) struct Written {
    pub(super) file_len: u64,
    pub(super) records: Vec<EngineRecord>,
    pub(super) built: usize,
}

/// The engines of `plan` as [`InPlaceBuilder::engine_len`] sizes them, named by `name`.
pub(super) fn lay_out(
    plan: &Plan,
    program: &Program,
    weights: &dyn petite_weights::WeightSource,
    builder: &dyn InPlaceBuilder,
    name: &dyn Fn(usize, &Program) -> Result<String>,
) -> Result<Laid> {
    let mut engines = Vec::with_capacity(plan.engines.len());
    for i in 0..plan.engines.len() {
        let sub = plan.engine_program(program, i)?;
        let n = name(i, &sub.program)?;
        let job = EngineJob::of(i, &n, &sub);
        let len = builder.engine_len(&job, weights)?;
        engines.push((n, len));
    }
    Ok(Laid { engines })
}

/// Everything [`write`] needs of the export.
pub(super) struct Target<'a> {
    pub(super) tag: &'a str,
    pub(super) plan: &'a Plan,
    pub(super) program: &'a Program,
    pub(super) laid: &'a Laid,
    pub(super) weights: &'a dyn petite_weights::WeightSource,
    pub(super) builder: &'a dyn EngineBuilder,
    pub(super) in_place: &'a dyn InPlaceBuilder,
    /// The inputs' identity (checkpoint files and dtype).
    pub(super) identity: &'a str,
    /// `OUT/engines`.
    pub(super) dir: &'a Path,
    /// Called after each engine is written (and journaled) or kept: progress, pause, stop
    /// point.
    pub(super) after_engine: &'a dyn Fn(usize, &str),
    /// Whether to stop before the next engine (Ctrl-C): the finished segments stay for the
    /// next run.
    pub(super) stop: &'a dyn Fn() -> bool,
}

/// Writes `pb` (whose engine segments are `SegmentData::Deferred { id: engine index }`) to
/// `staged`, resuming a partial file an earlier run of the same export left.
pub(super) fn write(t: &Target<'_>, pb: ProgramBuilder, staged: &Path) -> Result<Written> {
    let (program, segments) = pb.build()?;
    let partial = partial_for(t.dir, t.tag, t.identity, &program, &segments)?;
    let journal = Journal::load(&partial, SEGMENT);
    let engine_of = segments
        .iter()
        .enumerate()
        .filter_map(|(s, seg)| match seg.data {
            SegmentData::Deferred { id, .. } => Some((s, id as usize)),
            _ => None,
        })
        .collect();
    let mut w = Writer {
        t,
        partial: partial.clone(),
        engine_of,
        journal,
        records: BTreeMap::new(),
        last_use: petite_engine::last_uses(t.plan),
    };
    let sum = petite_pte::write_pte_resumable(
        &partial,
        staged,
        &program,
        &segments,
        WriteOptions::default(),
        &mut w,
    )?;
    w.journal.remove();
    let mut records = Vec::with_capacity(t.laid.engines.len());
    let mut built = 0;
    for (i, (name, len)) in t.laid.engines.iter().enumerate() {
        let e = &t.plan.engines[i];
        let wb = WeightBytes::of_engine(t.program, e);
        let (seconds, reused) = w.records.get(&i).copied().unwrap_or((0.0, true));
        built += usize::from(!reused);
        records.push(EngineRecord {
            name: name.clone(),
            weight_bytes: e.weight_bytes,
            weight_bytes_16bit: wb.half,
            weight_bytes_32bit: wb.full,
            build_memory_estimate: t.builder.memory().bytes(wb),
            file_bytes: *len,
            over_cap: e.over_cap,
            reused,
            seconds,
            rss_after: crate::memory::status().map(|s| s.rss),
            builder_peak_rss_bytes: None,
            build_s: None,
            plan_bytes: None,
            compile_specs: serde_json::json!({}),
        });
    }
    Ok(Written {
        file_len: sum.file_len,
        records,
        built,
    })
}

/// The partial file of program `tag` (`program` laid out with `segments`) in `dir` (created):
/// named by a hash of the inputs' `identity`, the program's bytes and its segments' lengths, so
/// only the same export resumes it; `tag`'s other partial files there are removed.
pub(super) fn partial_for(
    dir: &Path,
    tag: &str,
    identity: &str,
    program: &petite_pte::Program,
    segments: &[petite_pte::Segment],
) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "create engine directory", e))?;
    let mut h = Sha256::new();
    h.update(identity.as_bytes());
    h.update(b"|");
    h.update(petite_pte::encode::encode_program(program));
    for s in segments {
        h.update(s.data.len().to_le_bytes());
    }
    let key = &hex::encode(h.finalize())[..16];
    let partial = crate::layout::partial_pte(dir, tag, key);
    clear_stale(dir, tag, &partial);
    Ok(partial)
}

/// Removes `tag`'s partial files (and journals) in `dir` other than `keep`'s: they belong to
/// another export (other inputs or settings), and one output directory holds one.
fn clear_stale(dir: &Path, tag: &str, keep: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let keep_journal = Journal::path_of(keep);
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        let p = e.path();
        if n.starts_with(&format!("{tag}-"))
            && n.contains(crate::layout::PARTIAL_PTE)
            && p != keep
            && p != keep_journal
        {
            let _ = std::fs::remove_file(&p);
        }
    }
}

/// What a journal's entries are: whole segments (the engines written in place).
const SEGMENT: &str = "segment";

/// The parts of a partial `.pte` known to be on storage: `KIND INDEX OFFSET LEN SEAL` lines
/// (`kind`: what an index counts, a segment or a group of weights), rewritten whole
/// (petite-fs: temporary name, fsync, rename) after each part.
pub(super) struct Journal {
    path: PathBuf,
    kind: &'static str,
    /// Index → (offset, length, seal line).
    pub(super) done: BTreeMap<usize, (u64, u64, String)>,
}

impl Journal {
    fn path_of(partial: &Path) -> PathBuf {
        let mut s = partial.as_os_str().to_owned();
        s.push(".journal");
        PathBuf::from(s)
    }

    /// The journal of `partial` (entries of `kind`); empty (and any journal removed) when the
    /// partial file is missing.
    pub(super) fn load(partial: &Path, kind: &'static str) -> Journal {
        let path = Self::path_of(partial);
        let mut done = BTreeMap::new();
        if partial.exists()
            && let Ok(text) = std::fs::read_to_string(&path)
        {
            for l in text.lines() {
                let mut f = l.splitn(5, ' ');
                if let (Some(k), Some(i), Some(o), Some(n), Some(seal)) =
                    (f.next(), f.next(), f.next(), f.next(), f.next())
                    && k == kind
                    && let (Ok(i), Ok(o), Ok(n)) = (i.parse(), o.parse(), n.parse())
                {
                    done.insert(i, (o, n, format!("{seal}\n")));
                }
            }
        } else {
            let _ = std::fs::remove_file(&path);
        }
        Journal { path, kind, done }
    }

    pub(super) fn save(&self) -> Result<()> {
        let mut text = String::new();
        for (i, (o, n, seal)) in &self.done {
            text.push_str(&format!("{} {i} {o} {n} {seal}", self.kind));
        }
        Ok(petite_fs::write(&self.path, text.as_bytes())?)
    }

    /// Removes the journal (its partial file was renamed).
    pub(super) fn remove(&self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The [`Resume`] hooks: engines written by the builder, the journal kept.
struct Writer<'t, 'a> {
    t: &'t Target<'a>,
    partial: PathBuf,
    /// Segment index → engine index.
    engine_of: BTreeMap<usize, usize>,
    journal: Journal,
    /// Engines written by this run: index → seconds.
    records: BTreeMap<usize, (f64, bool)>,
    last_use: Vec<Vec<&'a petite_partition::WeightUse>>,
}

impl Resume for Writer<'_, '_> {
    type Error = Error;

    fn done(&mut self, file: &File, index: usize, offset: u64, len: u64) -> bool {
        let Some((o, n, seal)) = self.journal.done.get(&index) else {
            return false;
        };
        let ok = (*o, *n) == (offset, len)
            && petite_weights::seal::of_region(file, offset, len).is_ok_and(|s| s == *seal);
        if ok {
            if let Some(&i) = self.engine_of.get(&index) {
                (self.t.after_engine)(i, &self.t.laid.engines[i].0);
            }
        } else {
            crate::guard::damaged(
                &self.partial,
                "partial .pte",
                &format!("segment {index} differs from its journal entry"),
            );
            self.journal.done.remove(&index);
        }
        ok
    }

    fn fill(&mut self, id: u64, file: &File, offset: u64, len: u64) -> Result<()> {
        let t = self.t;
        if (t.stop)() {
            return Err(Error::Interrupted);
        }
        let i = id as usize;
        let (name, planned) = &t.laid.engines[i];
        let sub = t.plan.engine_program(t.program, i)?;
        let started = Instant::now();
        let wrote = t.in_place.write_engine(
            &EngineJob::of(i, name, &sub),
            t.weights,
            file,
            &self.partial,
            offset,
        )?;
        if wrote != len || wrote != *planned {
            return Err(Error::Internal(format!(
                "engine {name}: {wrote} bytes written where {len} were planned"
            )));
        }
        if !self.last_use[i].is_empty() {
            petite_engine::release_weights(t.weights, &self.last_use[i])
                .map_err(petite_engine::Error::from)?;
        }
        self.records
            .insert(i, (started.elapsed().as_secs_f64(), false));
        Ok(())
    }

    /// The `.pte` is built from the checkpoint as it was opened: else it stays partial (its
    /// journal too), for a re-run once the checkpoint is back.
    fn ready(&mut self) -> Result<()> {
        Ok(self.t.weights.check_unchanged()?)
    }

    fn finished(&mut self, file: &File, index: usize, offset: u64, len: u64) -> Result<()> {
        let seal = petite_weights::seal::of_region(file, offset, len)
            .map_err(|e| Error::io(&self.partial, "read back segment", e))?;
        self.journal.done.insert(index, (offset, len, seal));
        self.journal.save()?;
        if let Some(&i) = self.engine_of.get(&index) {
            (self.t.after_engine)(i, &self.t.laid.engines[i].0);
        }
        Ok(())
    }
}
