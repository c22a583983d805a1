//! petite: the export pipeline — a pi0.5 checkpoint to ExecuTorch `.pte` programs in bounded
//! memory ([`export`]), their verification in a separate process ([`verify`]), and what both
//! measure ([`memory`], [`report`]).
#![deny(missing_docs)]

pub mod act;
pub mod bundle;
pub mod engines;
pub mod export;
pub mod guard;
pub mod memory;
pub mod report;
pub mod verify;

/// Errors of the export and verify pipelines; each names the file, stage or setting.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A command-line setting is unusable (names it, expected vs found).
    #[error("{0}")]
    Usage(String),
    /// The memory budget cannot hold the plan; nothing was done.
    #[error("{0}")]
    Budget(String),
    /// An I/O operation failed.
    #[error("{path}: {op}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The export was interrupted (Ctrl-C); finished engines are kept for a re-run.
    #[error(
        "interrupted: stopped cleanly after the last finished step; re-run the same command to resume"
    )]
    Interrupted,
    /// A `.pte` does not hold what the export writes (names the file and what is wrong).
    #[error("{path}: {reason}")]
    BadPte {
        /// The file.
        path: String,
        /// Expected vs found.
        reason: String,
    },
    /// pi0.5 config, checkpoint or inputs problem.
    #[error(transparent)]
    Pi05(#[from] petite_pi05::Error),
    /// Reading or writing weights failed.
    #[error(transparent)]
    Weights(#[from] petite_weights::Error),
    /// Planning failed.
    #[error(transparent)]
    Partition(#[from] petite_partition::Error),
    /// Building an engine failed (names the engine).
    #[error(transparent)]
    Engine(#[from] petite_engine::Error),
    /// Writing or reading a `.pte` failed.
    #[error(transparent)]
    Pte(#[from] petite_pte::Error),
    /// Portable lowering or writing failed (names the node and op, or the weight).
    #[error(transparent)]
    Portable(#[from] petite_portable::Error),
    /// The reference executor failed (names the node).
    #[error(transparent)]
    Reference(#[from] petite_reference::Error),
    /// A program is invalid.
    #[error(transparent)]
    Graph(#[from] petite_graph::Error),
    /// Two sets of values could not be compared: a NaN or ±inf in either, or their lengths
    /// differ (names which, where, and the value).
    #[error("{what}: {why}")]
    Accuracy {
        /// What was compared with what.
        what: String,
        /// Why the comparison failed.
        why: petite_reference::CompareError,
    },
    /// JSON (de)serialisation of the report.
    #[error("report JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// Another process holds the output directory's lock ([`guard::OutputDir`]).
    #[error(
        "{dir}: another petite process ({}) is writing into this output directory; wait for it to finish or choose another --out (lock: {dir}/{lock}, released when that process ends)",
        match .pid { Some(p) => format!("pid {p}"), None => "pid unknown".to_string() },
        lock = guard::LOCK_FILE
    )]
    Locked {
        /// The output directory.
        dir: String,
        /// The holder's pid, as it wrote it into the lock file.
        pid: Option<u32>,
    },
}

/// Whether `e` is petite-weights' "input changed" ([`petite_weights::Error::Changed`]).
fn weights_changed(e: &petite_weights::Error) -> bool {
    matches!(e, petite_weights::Error::Changed { .. })
}

fn engine_changed(e: &petite_engine::Error) -> bool {
    match e {
        petite_engine::Error::Weights(w) => weights_changed(w),
        petite_engine::Error::Engine { source, .. } => engine_changed(source),
        _ => false,
    }
}

impl Error {
    /// Whether this is an input that changed while it was read (the binary exits with
    /// [`petite_weights::fault::EXIT_CODE`] for it, as for a SIGBUS on a truncated input).
    pub fn is_input_changed(&self) -> bool {
        match self {
            Error::Weights(w) => weights_changed(w),
            Error::Pi05(petite_pi05::Error::Weights(w)) => weights_changed(w),
            Error::Portable(petite_portable::Error::Weights(w)) => weights_changed(w),
            Error::Engine(e) => engine_changed(e),
            _ => false,
        }
    }
}

impl Error {
    pub(crate) fn io(path: &std::path::Path, op: &'static str, source: std::io::Error) -> Self {
        Error::Io {
            path: path.display().to_string(),
            op,
            source,
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod layout_tests {
    /// Every end-to-end test file in the workspace's top-level `tests/` is a `[[test]]` of this
    /// package (autotests is off there, so an unregistered file would silently never run).
    #[test]
    fn every_top_level_test_file_is_registered() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let manifest = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
        let mut n = 0;
        for e in std::fs::read_dir(root.join("../../tests")).unwrap() {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            if let Some(stem) = name.strip_suffix(".rs") {
                let want = format!("path = \"../../tests/{stem}.rs\"");
                assert!(
                    manifest.contains(&want),
                    "tests/{name} is not a [[test]] of petite"
                );
                n += 1;
            }
        }
        assert!(n >= 5, "found only {n} test files");
    }
}
