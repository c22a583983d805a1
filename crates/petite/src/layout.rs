//! The output directory's layout: every name petite writes under `--out` and reads back from an
//! export's directory (`verify`, `act`, `bundle`, `inspect`), in one place. The export
//! ([`crate::export`]) writes these names and the guard ([`crate::guard`]) cleans and checks
//! them; both use this module and neither imports the other's names.
//!
//! ```text
//! OUT/
//!   prefix.pte, step.pte          the programs (.pte backends)
//!   prefix.pte.json, step.pte.json their method descriptions (portable)
//!   pi05.onnx, pi05.onnx.data     the model and its external data (onnx)
//!   pi05.onnx.data.seal, .resume  the data file's seal and reuse key (onnx; the mapping
//!                                 file's sidecars, moved with it)
//!   pi05.onnx.json                its interface (onnx)
//!   report.json                   what the export measured (+ verify's result)
//!   policy.json                   the runner's description; written last
//!   cache/                        the mapping file and its .seal and .resume sidecars,
//!                                 kept for the next run (tensorrt; the reference and
//!                                 portable backends write none)
//!   engines/                      engine files while building (or --keep-engines); the
//!                                 reference and portable backends' partial .pte files and
//!                                 their journals ([`partial_pte`]) while weights stream
//!                                 into them
//!   .petite.lock                  one writer per directory
//! ```
//!
//! Temporary names: a file written through petite-fs is `NAME.petite-tmp` until it is renamed;
//! an output staged until the export publishes it is `.NAME.petite-tmp-staged` ([`staged`]).
//! Both contain [`petite_fs::TMP_MARK`], which the guard clears from [`temp_dirs`].

use std::path::{Path, PathBuf};

/// Method name of the main method of each `.pte`.
pub const METHOD: &str = "forward";
/// Method of `step.pte` returning the timestep table.
pub const TABLE_METHOD: &str = "timestep_table";
/// Named-data key under which each `.pte` carries its export id (the one `policy.json` has).
pub const EXPORT_ID_KEY: &str = "petite.export_id";

/// The prefix program.
pub const PREFIX_PTE: &str = "prefix.pte";
/// The step program (and the timestep table).
pub const STEP_PTE: &str = "step.pte";
/// Both `.pte` programs, prefix first.
pub const PTES: [&str; 2] = [PREFIX_PTE, STEP_PTE];
/// What the export measured (and verify's result).
pub const REPORT: &str = "report.json";
/// The runner's description (petite-pi05's `policy.json`), written last.
pub const POLICY: &str = petite_pi05::policy::FILE;
/// The ONNX backend's model.
pub const ONNX_MODEL: &str = "pi05.onnx";
/// Its external data (the mapping file, moved out of the cache when published).
pub const ONNX_DATA: &str = "pi05.onnx.data";
/// Its interface description.
pub const ONNX_SPEC: &str = "pi05.onnx.json";
/// The mapping files' directory.
pub const CACHE: &str = "cache";
/// The engine files' directory (and the partial `.pte`s of engines written in place).
pub const ENGINES: &str = "engines";
/// The lock file of an output directory.
pub const LOCK: &str = ".petite.lock";

/// Every file an export may publish under `OUT` (checked against its inputs before any work).
pub const OUTPUTS: [&str; 7] = [
    PREFIX_PTE, STEP_PTE, REPORT, ONNX_MODEL, ONNX_DATA, ONNX_SPEC, POLICY,
];

/// The file next to a portable `.pte` describing its methods' inputs, outputs and memory plans
/// (`NAME.pte.json`: what a driver needs to feed it; `petite verify` and the conformance
/// driver read it).
pub fn spec_path(pte: &Path) -> PathBuf {
    let mut s = pte.as_os_str().to_owned();
    s.push(".json");
    PathBuf::from(s)
}

/// Where an output is written before the export publishes it under its final name:
/// `DIR/.NAME.petite-tmp-staged`.
pub fn staged(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}{}-staged", petite_fs::TMP_MARK))
}

/// A `.pte` whose engines (or weights) are written in place, while it is written: `ENGINES/TAG-KEY.pte.partial`
/// (`tag`: `prefix` or `step`; `key`: what identifies the export). Not a petite-fs temporary
/// name, so the guard's clean-up of killed runs keeps it for the re-run to resume.
pub fn partial_pte(engines: &Path, tag: &str, key: &str) -> PathBuf {
    engines.join(format!("{tag}-{key}{PARTIAL_PTE}"))
}

/// The suffix of [`partial_pte`] names.
pub const PARTIAL_PTE: &str = ".pte.partial";

/// The directories under `out` that hold petite's temporary files: `out`, `out/cache`,
/// `out/engines`.
pub fn temp_dirs(out: &Path) -> [PathBuf; 3] {
    [out.to_path_buf(), out.join(CACHE), out.join(ENGINES)]
}
