//! petite: the export pipeline — a pi0.5 checkpoint to ExecuTorch `.pte` programs in bounded
//! memory ([`export`]), their verification in a separate process ([`verify`]), and what both
//! measure ([`memory`], [`report`]).
#![deny(missing_docs)]

pub mod act;
pub mod backends;
pub mod bundle;
pub mod checkpoint;
pub mod engines;
pub mod export;
pub mod guard;
pub mod layout;
pub mod memory;
pub mod policy;
pub mod report;
pub mod runtimes;
#[cfg(feature = "serve")]
pub mod serve;
pub mod settings;
pub mod venv;
pub mod verify;

/// Errors of the export and verify pipelines; each names the file, stage or setting.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A command-line setting is unusable (names it, expected vs found): the binary exits 2, as
    /// for clap's own usage errors.
    #[error("{0}")]
    Usage(String),
    /// An input file is not what it must be (an observation, a tokenizer, an export directory's
    /// programs or their output): names the file and what is wrong.
    #[error("{path}: {reason}")]
    Input {
        /// The file or directory.
        path: String,
        /// Expected vs found.
        reason: String,
    },
    /// Something the command needs is not on this machine (a tokenizer, a runtime's Python):
    /// says where it was looked for and how to provide it.
    #[error("{0}")]
    Unavailable(String),
    /// A CUDA call failed (petite-cuda's error, kept whole: a weight that changed under the
    /// upload is still [`Error::is_input_changed`]).
    #[error("{what}: {source}")]
    Cuda {
        /// What was being done (`--device cuda`, the engine file, the stage).
        what: String,
        /// petite-cuda's error (boxed: it is large, and every `Result` of this crate carries it).
        #[source]
        source: Box<petite_cuda::Error>,
    },
    /// petite-cuda's error where no more context helps (a device call of `petite pi05 run`).
    #[error(transparent)]
    CudaCall(Box<petite_cuda::Error>),
    /// A step of a command failed: what was being done, and its cause kept whole (the binary
    /// prints the chain).
    #[error("{what}")]
    Context {
        /// What was being done.
        what: String,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A run's result that petite refuses to write (non-finite actions, repeated chunks that
    /// differ): says what and where.
    #[error("{0}")]
    Refused(String),
    /// An observation given to a policy is not what it takes (names the key, expected vs
    /// found); the policy stays usable.
    #[error("`{key}`: {reason}")]
    Observation {
        /// The observation's key (`observation.state`, a camera's key, `task`, `noise`).
        key: String,
        /// What is wrong.
        reason: String,
    },
    /// A policy's queue is full: this many calls already wait for the device (a server's
    /// `RESOURCE_EXHAUSTED`; try again later).
    #[error("the policy is busy: {0} calls already wait for the device")]
    Busy(usize),
    /// An invariant of petite itself broke (a bug, not the input's fault): names it.
    #[error("internal error (a bug in petite; please report it): {0}")]
    Internal(String),
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
    /// A JSON file petite reads back (`report.json`) is not what it wrote.
    #[error("{path}: not valid JSON ({reason})")]
    BadJson {
        /// The file.
        path: String,
        /// The parser's message.
        reason: String,
    },
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
        petite_engine::Error::Runtime { source, .. } => source
            .downcast_ref::<petite_cuda::Error>()
            .is_some_and(cuda_changed),
        _ => false,
    }
}

fn cuda_changed(e: &petite_cuda::Error) -> bool {
    matches!(e, petite_cuda::Error::Weights(w) if weights_changed(w))
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
            Error::Cuda { source, .. } => cuda_changed(source),
            Error::CudaCall(e) => cuda_changed(e),
            Error::Context { source, .. } => source
                .downcast_ref::<Error>()
                .is_some_and(Error::is_input_changed),
            _ => false,
        }
    }

    /// Whether this is a command-line setting that cannot be used (the binary exits 2 for it,
    /// as clap does for its own usage errors).
    pub fn is_usage(&self) -> bool {
        matches!(self, Error::Usage(_))
    }

    /// `f` for `map_err`: petite-cuda's error while doing `what`.
    pub fn cuda(what: impl Into<String>) -> impl FnOnce(petite_cuda::Error) -> Self {
        let what = what.into();
        move |source| Error::Cuda {
            what,
            source: Box::new(source),
        }
    }

    /// An input file that is not what it must be.
    pub fn input(path: &std::path::Path, reason: impl Into<String>) -> Self {
        Error::Input {
            path: path.display().to_string(),
            reason: reason.into(),
        }
    }
}

impl From<petite_fs::Error> for Error {
    fn from(e: petite_fs::Error) -> Self {
        let petite_fs::Error::Io { path, op, source } = e;
        Error::io(&path, op, source)
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

    /// A test that writes a script and then executes it must write it through
    /// `tests/common/tool.rs`'s `write_tool`: written any other way, the file can be open for
    /// writing in a child another test thread forks, and executing it fails at random with
    /// ETXTBSY (issue 23). Every `#!` literal in a test source sits inside a `write_tool` call.
    #[test]
    fn stand_in_tools_are_written_by_the_one_helper() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut dirs = vec![root.join("tests")];
        for e in std::fs::read_dir(root.join("crates")).unwrap() {
            dirs.push(e.unwrap().path().join("tests"));
        }
        let (mut files, mut scripts) = (0, 0);
        while let Some(d) = dirs.pop() {
            let Ok(rd) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in rd {
                let p = e.unwrap().path();
                if p.is_dir() {
                    dirs.push(p);
                    continue;
                }
                if p.extension().is_none_or(|x| x != "rs") || p.ends_with("common/tool.rs") {
                    continue;
                }
                files += 1;
                let text = std::fs::read_to_string(&p).unwrap();
                let lines: Vec<&str> = text.lines().collect();
                for (i, l) in lines.iter().enumerate() {
                    if l.contains("\"#!/") {
                        scripts += 1;
                        let before = &lines[i.saturating_sub(4)..=i];
                        assert!(
                            before.iter().any(|b| b.contains("write_tool(")),
                            "{}:{}: a script written without common::write_tool",
                            p.display(),
                            i + 1
                        );
                    }
                }
            }
        }
        assert!(
            files > 20 && scripts >= 4,
            "{files} files, {scripts} scripts"
        );
    }

    /// Every repository path the documentation cites exists: in `README.md`, `docs/*.md` and
    /// `crates/*/README.md`, each backticked word that starts with a top-level directory
    /// (`crates/tests/…`, `docs/…`) and each relative link target. A crate's README may also cite
    /// paths relative to its crate. Words with `*`, `<` or `{` are patterns, not paths; a
    /// trailing `:line` or `#anchor` is dropped; fenced code blocks (commands) are not read.
    #[test]
    fn every_path_the_docs_cite_exists() {
        const TOP: [&str; 10] = [
            "crates/",
            "tests/",
            "xtask/",
            "docs/",
            "conformance/",
            "testdata/",
            "benches/",
            "examples/",
            ".ci/",
            ".cargo/",
        ];
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut docs = vec![root.join("README.md")];
        for e in std::fs::read_dir(root.join("docs")).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "md") {
                docs.push(p);
            }
        }
        for e in std::fs::read_dir(root.join("crates")).unwrap() {
            let p = e.unwrap().path().join("README.md");
            if p.exists() {
                docs.push(p);
            }
        }
        let (mut checked, mut missing) = (0, Vec::new());
        for doc in &docs {
            let dir = doc.parent().unwrap();
            let text = std::fs::read_to_string(doc).unwrap();
            let mut fenced = false;
            let prose: String = text
                .lines()
                .map(|l| {
                    if l.trim_start().starts_with("```") {
                        fenced = !fenced;
                        return "\n".to_string();
                    }
                    if fenced {
                        "\n".into()
                    } else {
                        format!("{l}\n")
                    }
                })
                .collect();
            // Backticked words (a span may wrap onto the next line) and relative link targets.
            let mut cited: Vec<(&str, bool)> = Vec::new();
            for span in prose.split('`').skip(1).step_by(2) {
                cited.extend(
                    span.split_whitespace()
                        .filter(|w| TOP.iter().any(|t| w.starts_with(t)))
                        .map(|w| (w, false)),
                );
            }
            for link in prose.split("](").skip(1) {
                let target = link.split(')').next().unwrap_or("");
                if !target.is_empty() && !target.contains("://") && !target.starts_with('#') {
                    cited.push((target, true));
                }
            }
            for (word, is_link) in cited {
                if word.contains(['*', '<', '{']) {
                    continue;
                }
                let path = word.split(['#', ':']).next().unwrap();
                let path = path.trim_end_matches(['.', ',', ';', ')']);
                checked += 1;
                let found = if is_link {
                    dir.join(path).exists()
                } else {
                    root.join(path).exists() || dir.join(path).exists()
                };
                if !found {
                    let name = doc.strip_prefix(&root).unwrap_or(doc).display().to_string();
                    missing.push(format!("{name}: {word}"));
                }
            }
        }
        assert!(
            missing.is_empty(),
            "cited but missing:\n{}",
            missing.join("\n")
        );
        assert!(
            checked >= 30,
            "only {checked} cited paths found in {} files",
            docs.len()
        );
    }
}
