//! The sequential build driver: engines in plan order, each built from the mapped weights into
//! its own file (or a finished file from an earlier run reused), then every weight whose last
//! reader it was is released. The one driver of a plan: the exporter and the benches call it.

use std::path::Path;
use std::time::Instant;

use petite_graph::Program;
use petite_partition::{Plan, WeightUse};
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
    /// Asked before each engine; `true` stops the build with [`Error::Stopped`] (Ctrl-C). The
    /// engines already finished stay on disk for a re-run to reuse.
    pub stop: Option<&'a dyn Fn() -> bool>,
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
    /// Whether `peak_rss` is this engine's own peak (reset worked) or the process's so far.
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

/// Builds every engine of `plan` (made for `program`) with `builder`, in plan order, into files
/// under `dir` (created if missing). After each engine, the weights whose last reader it was are
/// released from `weights`. On error, engines already built stay (their files are complete and
/// valid); the failing engine leaves no file; the error names it.
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
    // Weights to release after engine i.
    let last_use = last_uses(plan);
    let mut engines = Vec::with_capacity(plan.engines.len());
    let mut reports = Vec::with_capacity(plan.engines.len());
    let mut bytes_written = 0;
    for (i, e) in plan.engines.iter().enumerate() {
        if options.stop.is_some_and(|stop| stop()) {
            return Err(Error::Stopped { index: i });
        }
        let sub = plan
            .engine_program(program, i)
            .map_err(|err| Error::from(err).in_engine(i, &engine_name(i)))?;
        let name = match options.name {
            Some(f) => f(i, &sub.program).map_err(|err| err.in_engine(i, &engine_name(i)))?,
            None => engine_name(i),
        };
        let reset = crate::sys::reset_peak_rss();
        let t = Instant::now();
        let job = EngineJob {
            index: i,
            name: &name,
            program: &sub.program,
            input_values: &sub.input_values,
            output_values: &sub.output_values,
        };
        let found = if options.reuse {
            let path = dir.join(builder.file_name(&name));
            match crate::reuse_engine(builder, &path, &job) {
                crate::Reuse::Reused(b) => Some(*b),
                crate::Reuse::Absent => None,
                crate::Reuse::Damaged(why) => {
                    if let Some(f) = options.on_damaged {
                        f(&path, &why);
                    }
                    None
                }
            }
        } else {
            None
        };
        let reused = found.is_some();
        let built = match found {
            Some(b) => b,
            None => builder.build(&job, weights, dir)?,
        };
        let seconds = t.elapsed().as_secs_f64();
        let peak_rss = rss().map(|r| r.peak);
        drop(sub);
        if options.release_after_last_use && !last_use[i].is_empty() {
            release_weights(weights, &last_use[i])
                .map_err(|err| Error::from(err).in_engine(i, &name))?;
        }
        if !reused {
            bytes_written += built.file_bytes;
        }
        let report = EngineReport {
            index: i,
            name,
            seconds,
            reused,
            stats: built.stats,
            file_bytes: built.file_bytes,
            weight_bytes: e.weight_bytes,
            released: last_use[i]
                .iter()
                .map(|w| petite_graph::weight_display(&w.name, w.rows))
                .collect(),
            peak_rss,
            peak_is_per_engine: reset,
            rss_after: rss().map(RssFigures::from),
        };
        if let Some(cb) = options.on_engine {
            cb(&report);
        }
        engines.push(built);
        reports.push(report);
    }
    Ok(BuildReport {
        engines,
        reports,
        seconds: t0.elapsed().as_secs_f64(),
        bytes_written,
    })
}
