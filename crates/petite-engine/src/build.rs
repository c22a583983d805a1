//! The build driver: engines started in plan order, up to [`BuildOptions::jobs`] at once, each
//! built from the mapped weights into its own file (or a finished file from an earlier run
//! reused); once every engine up to one is finished, the weights whose last reader it was are
//! released. The one driver of a plan: the exporter and the benches call it.

use std::path::Path;
use std::sync::mpsc;
use std::time::Instant;

use petite_graph::Program;
use petite_partition::{EngineProgram, Plan, WeightUse};
use petite_weights::WeightSource;
use petite_weights::residency::{Rss, rss};
use serde::Serialize;

use crate::{BuiltEngine, EngineBuilder, EngineJob, Error, Result};

/// Names an engine from its plan index and standalone program (the file stem).
pub type EngineNamer<'a> = &'a dyn Fn(usize, &Program) -> Result<String>;

/// Told the path and the reason of a damaged engine file before it is rebuilt.
pub type DamagedNotice<'a> = &'a dyn Fn(&Path, &str);

/// Settings of [`build_plan`].
pub struct BuildOptions<'a> {
    /// Release each weight's pages after the last engine that reads it is built (default on).
    pub release_after_last_use: bool,
    /// Called after each engine is built and its weights released (progress, residency logs).
    pub on_engine: Option<&'a dyn Fn(&EngineReport)>,
    /// Engine names (default [`engine_name`]). A name that pins everything the engine's bytes
    /// depend on (subgraph, weights, builder settings) makes `reuse` safe.
    pub name: Option<EngineNamer<'a>>,
    /// Reuse a finished file from an earlier run when its seal matches and the builder
    /// recognises it ([`crate::reuse_engine`]) instead of building (default off).
    pub reuse: bool,
    /// Called with the path and the reason when a file found there is damaged (truncated, wrong
    /// size, checksum, not this backend's): it is rebuilt right after.
    pub on_damaged: Option<DamagedNotice<'a>>,
    /// Asked before each engine is started, and when a build fails; `true` stops the build
    /// with [`Error::Stopped`] (Ctrl-C) once the builds already running have finished. The
    /// engines already finished stay on disk for a re-run to reuse.
    pub stop: Option<&'a dyn Fn() -> bool>,
    /// How many engines are built at once (default 1; 0 counts as 1). Each build runs on a
    /// thread of its own (TensorRT: each in its own child process); the engines, their files
    /// and the reports are those of a one-at-a-time build, in plan order. A failed build stops
    /// new ones from starting; those already running finish (their files are kept for a
    /// re-run) and the failure is returned.
    pub jobs: usize,
}

impl Default for BuildOptions<'_> {
    fn default() -> Self {
        BuildOptions {
            release_after_last_use: true,
            on_engine: None,
            name: None,
            reuse: false,
            on_damaged: None,
            stop: None,
            jobs: 1,
        }
    }
}

impl std::fmt::Debug for BuildOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuildOptions")
            .field("release_after_last_use", &self.release_after_last_use)
            .field("on_engine", &self.on_engine.is_some())
            .field("name", &self.name.is_some())
            .field("reuse", &self.reuse)
            .field("on_damaged", &self.on_damaged.is_some())
            .field("stop", &self.stop.is_some())
            .field("jobs", &self.jobs)
            .finish()
    }
}

/// What building one engine took.
#[derive(Debug, Clone, Serialize)]
pub struct EngineReport {
    /// Position in the plan.
    pub index: usize,
    /// Engine name.
    pub name: String,
    /// Wall time of the build, or of the reuse check (release excluded).
    pub seconds: f64,
    /// Whether a finished file from an earlier run was reused instead of building.
    pub reused: bool,
    /// What the build cost, where the builder measures it (absent when reused).
    pub stats: Option<crate::BuildStats>,
    /// Bytes of the engine file.
    pub file_bytes: u64,
    /// Weight bytes the engine reads (as the plan counts them).
    pub weight_bytes: u64,
    /// Weights released after this engine (their last reader).
    pub released: Vec<String>,
    /// Peak RSS of the process during this build (`VmHWM` reset before it), if measurable.
    pub peak_rss: Option<u64>,
    /// Whether `peak_rss` is this engine's own peak (reset worked, one build at a time) or the
    /// process's so far.
    pub peak_is_per_engine: bool,
    /// Memory right after the release.
    pub rss_after: Option<RssFigures>,
}

/// `/proc/self/status` figures, in bytes.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RssFigures {
    /// `VmRSS`.
    pub total: u64,
    /// `RssAnon`.
    pub anon: u64,
    /// `RssFile`.
    pub file: u64,
}

impl From<Rss> for RssFigures {
    fn from(r: Rss) -> Self {
        RssFigures {
            total: r.total,
            anon: r.anon,
            file: r.file,
        }
    }
}

/// The result of [`build_plan`].
#[derive(Debug, Clone)]
pub struct BuildReport {
    /// Built engines, in plan order.
    pub engines: Vec<BuiltEngine>,
    /// One report per engine.
    pub reports: Vec<EngineReport>,
    /// Wall time of the whole build.
    pub seconds: f64,
    /// Total bytes of engine files written (reused files not counted).
    pub bytes_written: u64,
    /// The most builds that ran at once (0 when every engine was reused).
    pub max_concurrent: usize,
}

/// Engine name of plan index `i` (file stem).
pub fn engine_name(i: usize) -> String {
    format!("engine_{i:03}")
}

/// For each engine of `plan`, the weights (whole tensors and row ranges) whose last reader it is.
pub fn last_uses(plan: &Plan) -> Vec<Vec<&WeightUse>> {
    let mut last_use: Vec<Vec<&WeightUse>> = vec![Vec::new(); plan.engines.len()];
    for w in &plan.weights {
        if let Some(e) = w.last_engine
            && e < last_use.len()
        {
            last_use[e].push(w);
        }
    }
    last_use
}

/// Gives back the pages of `uses` in `source`: whole tensors by name, row ranges by their byte
/// range only (another range of the same tensor may still have a later reader; the source rounds
/// outward to pages, and a shared edge page simply faults back in when read).
pub fn release_weights(
    source: &dyn WeightSource,
    uses: &[&WeightUse],
) -> petite_weights::Result<()> {
    let whole: Vec<&str> = uses
        .iter()
        .filter(|w| w.rows.is_none())
        .map(|w| w.name.as_str())
        .collect();
    if !whole.is_empty() {
        source.release(&whole)?;
    }
    for w in uses {
        if let Some([a, b]) = w.rows {
            let info = source.info(&w.name)?;
            let row = info.shape.iter().skip(1).product::<usize>() * info.dtype.size();
            source.release_range(&w.name, a * row, b * row)?;
        }
    }
    Ok(())
}

/// An engine built or reused, waiting for the engines before it to be reported.
struct Done {
    name: String,
    built: BuiltEngine,
    /// Wall time of the build or the reuse check.
    seconds: f64,
    reused: bool,
    /// Whether the process's peak was reset before it (one build at a time).
    per_engine: bool,
}

/// Engine `i` ready to start: its program to build, or the finished file an earlier run left.
enum Prepared {
    Build(EngineProgram),
    Reused(BuiltEngine),
}

/// What a build thread sends back.
type Outcome = (usize, String, bool, Result<BuiltEngine>, f64);

/// Builds every engine of `plan` (made for `program`) with `builder`, into files under `dir`
/// (created if missing): engines are started in plan order, up to [`BuildOptions::jobs`] at
/// once. Once every engine up to `i` is finished, the weights whose last reader engine `i` was
/// are released from `weights` and [`BuildOptions::on_engine`] is told of engine `i`: both in
/// plan order, as in a one-at-a-time build. On error, engines already built stay (their files
/// are complete and valid); the failing engine leaves no file; the error names it.
pub fn build_plan(
    plan: &Plan,
    program: &Program,
    weights: &dyn WeightSource,
    builder: &dyn EngineBuilder,
    dir: &Path,
    options: &BuildOptions<'_>,
) -> Result<BuildReport> {
    let t0 = Instant::now();
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, "create engine directory", e))?;
    let n = plan.engines.len();
    let jobs = options.jobs.max(1);
    // Weights to release after engine i.
    let last_use = last_uses(plan);
    let stop = || options.stop.is_some_and(|stop| stop());
    let mut done: Vec<Option<Done>> = (0..n).map(|_| None).collect();
    let mut engines = Vec::with_capacity(n);
    let mut reports = Vec::with_capacity(n);
    let (mut bytes_written, mut max_concurrent) = (0, 0);
    // Engines before `reported` are finished, released and reported; those from `next` on are
    // not started.
    let (mut reported, mut next, mut running) = (0, 0, 0);
    let mut failure: Option<Error> = None;
    let (tx, rx) = mpsc::channel::<Outcome>();
    std::thread::scope(|scope| {
        loop {
            // A finished engine is released before the next build starts, so no build reads
            // beside weights whose last reader is done (one at a time: strictly in turn).
            while failure.is_none()
                && next < n
                && running < jobs
                && done.get(reported).is_none_or(Option::is_none)
            {
                if stop() {
                    failure = Some(Error::Stopped { index: next });
                    break;
                }
                let i = next;
                next += 1;
                // One build at a time: the next reading is this engine's own peak.
                let per_engine = jobs == 1 && crate::sys::reset_peak_rss();
                let t = Instant::now();
                match prepare(plan, program, builder, dir, options, i) {
                    Err(e) => failure = Some(e),
                    Ok((name, Prepared::Reused(built))) => {
                        done[i] = Some(Done {
                            name,
                            built,
                            seconds: t.elapsed().as_secs_f64(),
                            reused: true,
                            per_engine,
                        });
                    }
                    Ok((name, Prepared::Build(sub))) => {
                        let tx = tx.clone();
                        scope.spawn(move || {
                            let job = EngineJob::of(i, &name, &sub);
                            let r = builder
                                .build(&job, weights, dir)
                                .map_err(|e| e.in_engine(i, &name));
                            let seconds = t.elapsed().as_secs_f64();
                            // The receiver outlives every build: the loop waits for all of them.
                            let _ = tx.send((i, name, per_engine, r, seconds));
                        });
                        running += 1;
                        max_concurrent = max_concurrent.max(running);
                    }
                }
            }
            // Release and report, in plan order, every engine whose predecessors are finished.
            let mut released_any = false;
            while let Some(d) = done.get_mut(reported).and_then(Option::take) {
                released_any = true;
                let i = reported;
                reported += 1;
                let peak_rss = rss().map(|r| r.peak);
                if options.release_after_last_use
                    && !last_use[i].is_empty()
                    && let Err(err) = release_weights(weights, &last_use[i])
                {
                    failure.get_or_insert(Error::from(err).in_engine(i, &d.name));
                }
                if !d.reused {
                    bytes_written += d.built.file_bytes;
                }
                let report = EngineReport {
                    index: i,
                    name: d.name,
                    seconds: d.seconds,
                    reused: d.reused,
                    stats: d.built.stats,
                    file_bytes: d.built.file_bytes,
                    weight_bytes: plan.engines[i].weight_bytes,
                    released: last_use[i]
                        .iter()
                        .map(|w| petite_graph::weight_display(&w.name, w.rows))
                        .collect(),
                    peak_rss,
                    peak_is_per_engine: d.per_engine,
                    rss_after: rss().map(RssFigures::from),
                };
                if let Some(cb) = options.on_engine {
                    cb(&report);
                }
                engines.push(d.built);
                reports.push(report);
            }
            if running == 0 && (failure.is_some() || next == n) {
                break;
            }
            if released_any {
                continue; // start what the release made room for before waiting
            }
            // A thread always sends before it ends, and `tx` is still held here: this waits
            // for the next build to finish.
            let Ok((i, name, per_engine, result, seconds)) = rx.recv() else {
                break;
            };
            running -= 1;
            match result {
                Ok(built) => {
                    done[i] = Some(Done {
                        name,
                        built,
                        seconds,
                        reused: false,
                        per_engine,
                    });
                }
                // A builder killed by Ctrl-C (it shares the terminal's process group) is a stop,
                // not a failure of its engine.
                Err(_) if stop() => {
                    failure.get_or_insert(Error::Stopped { index: i });
                }
                Err(e) => {
                    failure.get_or_insert(e);
                }
            }
        }
    });
    if let Some(e) = failure {
        return Err(e);
    }
    Ok(BuildReport {
        engines,
        reports,
        seconds: t0.elapsed().as_secs_f64(),
        bytes_written,
        max_concurrent,
    })
}

/// Engine `i`'s name and what to do with it.
fn prepare(
    plan: &Plan,
    program: &Program,
    builder: &dyn EngineBuilder,
    dir: &Path,
    options: &BuildOptions<'_>,
    i: usize,
) -> Result<(String, Prepared)> {
    let sub = plan
        .engine_program(program, i)
        .map_err(|err| Error::from(err).in_engine(i, &engine_name(i)))?;
    let name = match options.name {
        Some(f) => f(i, &sub.program).map_err(|err| err.in_engine(i, &engine_name(i)))?,
        None => engine_name(i),
    };
    if options.reuse {
        let job = EngineJob::of(i, &name, &sub);
        let path = dir.join(builder.file_name(&name));
        match crate::reuse_engine(builder, &path, &job) {
            crate::Reuse::Reused(b) => return Ok((name, Prepared::Reused(*b))),
            crate::Reuse::Absent => {}
            crate::Reuse::Damaged(why) => {
                if let Some(f) = options.on_damaged {
                    f(&path, &why);
                }
            }
        }
    }
    Ok((name, Prepared::Build(sub)))
}
