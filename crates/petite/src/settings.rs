//! Every environment variable petite honours, in one registry: the documented settings of each
//! crate ([`all`]; README "Settings", `petite doctor`), petite's own ([`Settings`]: the kept-
//! memory bound and the paths of tools and files), the names once read and since removed with
//! the measurement that decided each ([`REMOVED`]), and the internal plumbing of tests
//! ([`INTERNAL`]), which is no setting.
//!
//! Why: the variables were read where they were used and parsed six ways; a stale or misspelt
//! one silently did nothing (a GPU session once lost four calls to an A/B whose variable never
//! reached the child). Here every value is parsed strictly, once, and the binary refuses a
//! malformed one before any work (exit 2). This file is the only one of the crate that reads
//! the environment, besides [`crate::guard`]'s test hook (`cargo xtask settings` checks both).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub use petite_reference::settings::{Invalid, Setting, Vars};
use petite_reference::settings::{count, path};

use crate::{Error, Result};

/// Environment variable naming a `tokenizer.json` (`petite act`).
pub const TOKENIZER_ENV: &str = "PETITE_TOKENIZER";
/// Environment variable naming the Python that runs portable `.pte` files.
pub const PYTHON_ENV: &str = "PETITE_PYTHON";
/// Environment variable naming the Python (with onnxruntime and numpy) that runs ONNX exports.
pub const ORT_PYTHON_ENV: &str = "PETITE_ORT_PYTHON";

/// petite's own documented settings (README "Settings", `petite doctor`).
pub const SETTINGS: &[Setting] = &[
    Setting {
        name: "PETITE_KEEP_MIB",
        values: "a number of MiB (0: none)",
        default: "256",
        what: "freed large blocks kept for reuse by pi05 run, verify and act (a full-size f32 \
               run ~950k minor faults without, ~155k with; session 22): lower it on a small \
               machine",
    },
    Setting {
        name: TOKENIZER_ENV,
        values: "a tokenizer.json",
        default: "--tokenizer, else the Hugging Face cache's snapshot",
        what: "the tokenizer of `petite act`",
    },
    Setting {
        name: PYTHON_ENV,
        values: "a Python 3.12 with executorch-numpy-runtime",
        default: "--python, else target/venv-pte",
        what: "the Python that runs portable .pte files for `petite verify`",
    },
    Setting {
        name: ORT_PYTHON_ENV,
        values: "a Python with onnxruntime and numpy",
        default: "--python, else target/venv-ort",
        what: "the Python that runs ONNX exports for `petite verify`",
    },
];

/// A name once read and since removed: what decided it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Removed {
    /// The variable.
    pub name: &'static str,
    /// Its fate and the measurement that decided it (docs/MEASUREMENTS.md).
    pub why: &'static str,
}

/// Names once read and since removed (docs/MEASUREMENTS.md, "Switches decided (issue 52)"):
/// `petite doctor` and every command name one that is set as ignored.
pub const REMOVED: &[Removed] = &[
    Removed {
        name: "PETITE_CUDA_NO_PAIR",
        why: "paired launches always on: a bf16 chunk 24.96 -> 24.78 ms, the same bits (session 23)",
    },
    Removed {
        name: "PETITE_CUDA_NO_PTR_BATCH",
        why: "pointer-batched GEMMs always on: a bf16 chunk 25.57 -> 25.37 ms, the same bits (session 23)",
    },
    Removed {
        name: "PETITE_CUDA_NO_PDL",
        why: "programmatic dependent launch always on (sm_90): 31.40 -> 30.60 ms, the same bits (session 15)",
    },
    Removed {
        name: "PETITE_CUDA_ATTN_CLUSTER",
        why: "the cluster attention always on where it fits: ten steps 13.74 -> 11.97 ms (session 20)",
    },
    Removed {
        name: "PETITE_CUDA_NO_TF32_ATTN",
        why: "SigLIP's one-launch TF32 attention always on: 25.50 -> 25.02 ms, bit-identical to the GEMMs (session 24)",
    },
    Removed {
        name: "PETITE_CUDA_NO_GRAPH",
        why: "CUDA graphs always on except while profiling: a bf16 chunk 174.9 -> 106.3 ms (c2228b2)",
    },
    Removed {
        name: "PETITE_CUDA_NO_PREFIX_GRAPH",
        why: "the prefix graph always on except while profiling: 30.03 -> 26.91 ms, the same bits (session 20)",
    },
    Removed {
        name: "PETITE_CUDA_COLUMNS",
        why: "SigLIP's q/k/v as one GEMM removed: 0.16 ms a chunk but a golden's bf16 error 1.09e-2 -> 2.21e-2 (session 23)",
    },
    Removed {
        name: "PETITE_CUDA_NO_COLUMNS",
        why: "its successor PETITE_CUDA_COLUMNS is removed too (session 23)",
    },
    Removed {
        name: "PETITE_CUDA_UNROLL_ROWS",
        why: "unrolled row loops always on: 0.961x a bf16 chunk, bit-identical (issue 49)",
    },
    Removed {
        name: "PETITE_CUDA_NO_FUSE",
        why: "only to compare now: `--tune fuse=off` (cargo xtask bench gpu --variant NAME:fuse=off; session 9)",
    },
    Removed {
        name: "PETITE_CUDA_NO_OFFSETS",
        why: "only to compare now: `--tune offsets=literal` (session 25)",
    },
    Removed {
        name: "PETITE_CUDA_FUSED_ATTN",
        why: "only to compare now: `--tune attention_queries=N|all|off` (sessions 20, 24)",
    },
];

/// Internal names, no settings: the test hook [`crate::guard::stop_point`] reads, and those the
/// tests and xtask pass to child processes.
pub const INTERNAL: &[&str] = &[
    crate::guard::STOP_ENV,
    "PETITE_PTE_FSIZE_CHILD",
    "PETITE_SIGBUS_CHAIN_CHILD",
    "PETITE_PORTABLE_CASES",
];

/// Every documented setting, each crate's in turn: what `petite doctor` lists and README's
/// "Settings" table must hold (a test checks it).
pub fn all() -> Vec<&'static Setting> {
    petite_cuda::settings::SETTINGS
        .iter()
        .chain(petite_reference::settings::SETTINGS)
        .chain(SETTINGS)
        .chain(petite_engine::settings::SETTINGS)
        .collect()
}

/// The settings of a `petite` process.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Settings {
    /// petite-cuda's (its tuning from `--tune`, never the environment).
    pub cuda: petite_cuda::Settings,
    /// The reference executor's.
    pub cpu: petite_reference::settings::CpuSettings,
    /// The TensorRT builder search's.
    pub engine: petite_engine::settings::Settings,
    /// MiB of freed large blocks kept for reuse (`PETITE_KEEP_MIB`; `None`: 256).
    pub keep_mib: Option<usize>,
    /// `PETITE_TOKENIZER`.
    pub tokenizer: Option<PathBuf>,
    /// `PETITE_PYTHON`.
    pub python: Option<PathBuf>,
    /// `PETITE_ORT_PYTHON`.
    pub ort_python: Option<PathBuf>,
    /// The Hugging Face hub cache: `HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    /// `~/.cache/huggingface/hub` (where `petite act` looks for a tokenizer).
    pub hf_hub: Option<PathBuf>,
}

/// The crate's one read of the environment.
fn env(name: &str) -> Option<OsString> {
    std::env::var_os(name)
}

impl Settings {
    /// The settings of this process's environment; a malformed value is [`Error::Usage`]
    /// naming the variable and what it takes.
    pub fn from_env() -> Result<Settings> {
        Self::from_vars(&env).map_err(|e| Error::Usage(e.to_string()))
    }

    /// The settings `vars` gives; unset variables keep their defaults.
    pub fn from_vars(vars: Vars<'_>) -> std::result::Result<Settings, Invalid> {
        let nonempty = |n: &str| vars(n).filter(|v| !v.is_empty()).map(PathBuf::from);
        Ok(Settings {
            cuda: petite_cuda::Settings::from_vars(vars)?,
            cpu: petite_reference::settings::CpuSettings::from_vars(vars)?,
            engine: petite_engine::settings::Settings::from_vars(vars)?,
            keep_mib: count(vars, "PETITE_KEEP_MIB", 0)?,
            tokenizer: path(vars, TOKENIZER_ENV)?,
            python: path(vars, PYTHON_ENV)?,
            ort_python: path(vars, ORT_PYTHON_ENV)?,
            hf_hub: nonempty("HF_HUB_CACHE")
                .or_else(|| nonempty("HF_HOME").map(|h| h.join("hub")))
                .or_else(|| nonempty("HOME").map(|h| h.join(".cache/huggingface/hub"))),
        })
    }

    /// Bytes of freed large blocks to keep ([`Settings::keep_mib`], else 256 MiB).
    pub fn keep_bytes(&self) -> usize {
        self.keep_mib.unwrap_or(256).saturating_mul(1 << 20)
    }

    /// The path setting `name` holds (`PETITE_TOKENIZER`, `PETITE_PYTHON`,
    /// `PETITE_ORT_PYTHON`), if set.
    pub fn path(&self, name: &str) -> Option<&Path> {
        match name {
            TOKENIZER_ENV => self.tokenizer.as_deref(),
            PYTHON_ENV => self.python.as_deref(),
            ORT_PYTHON_ENV => self.ort_python.as_deref(),
            _ => None,
        }
    }
}

static CONFIGURED: OnceLock<Settings> = OnceLock::new();

/// Sets this process's settings once, before any work (the `petite` binary, after parsing the
/// environment and `--tune`); the reference executor's with them. Gives `s` back when already
/// set.
pub fn configure(s: Settings) -> std::result::Result<(), Box<Settings>> {
    let _ = petite_reference::settings::configure(s.cpu);
    CONFIGURED.set(s).map_err(Box::new)
}

/// This process's settings: what [`configure`] set, else the environment's (an embedding
/// program honours the variables too).
pub fn current() -> Result<Settings> {
    match CONFIGURED.get() {
        Some(s) => Ok(s.clone()),
        None => Settings::from_env(),
    }
}

/// `PETITE_*` variables set in `vars` that are removed, as `NAME=VALUE` with what decided each.
pub fn removed_set(vars: Vars<'_>) -> Vec<String> {
    REMOVED
        .iter()
        .filter_map(|r| {
            vars(r.name).map(|v| format!("{}={} ({})", r.name, v.to_string_lossy(), r.why))
        })
        .collect()
}

/// [`removed_set`] of this process's environment.
pub fn removed_in_env() -> Vec<String> {
    removed_set(&env)
}

/// What `petite doctor` prints of the settings: each with its value here (or unset and its
/// default), a malformed one as invalid, and removed ones set here as ignored.
pub fn doctor_lines(vars: Vars<'_>) -> Vec<String> {
    let mut out = vec!["settings (environment variables; README \"Settings\"):".to_string()];
    for s in all() {
        let value = match vars(s.name) {
            Some(v) => v.to_string_lossy().into_owned(),
            None => format!("(unset: {})", s.default),
        };
        out.push(format!("  {:<27} {value}   [{}]", s.name, s.values));
    }
    if let Err(e) = Settings::from_vars(vars) {
        out.push(format!("  invalid: {e} (every other command refuses it)"));
    }
    for r in removed_set(vars) {
        out.push(format!("  ignored: {r}"));
    }
    out
}

/// [`doctor_lines`] of this process's environment.
pub fn doctor_lines_here() -> Vec<String> {
    doctor_lines(&env)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let m: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |n| m.get(n).cloned()
    }

    #[test]
    fn values_parse_strictly_and_defaults_hold() {
        let s = Settings::from_vars(&vars(&[("HOME", "/h")])).unwrap();
        assert_eq!(s.keep_bytes(), 256 << 20);
        assert_eq!(s.hf_hub, Some(PathBuf::from("/h/.cache/huggingface/hub")));
        let s = Settings::from_vars(&vars(&[
            ("PETITE_KEEP_MIB", "0"),
            ("PETITE_PYTHON", "/py"),
            ("HF_HOME", "/hf"),
        ]))
        .unwrap();
        assert_eq!(s.keep_bytes(), 0);
        assert_eq!(s.path("PETITE_PYTHON"), Some(Path::new("/py")));
        assert_eq!(s.hf_hub, Some(PathBuf::from("/hf/hub")));
        for (k, v) in [
            ("PETITE_KEEP_MIB", "lots"),
            ("PETITE_TOKENIZER", ""),
            ("PETITE_CUDA_UPLOAD_THREADS", "0"),
            ("PETITE_CPU_AMX", "no"),
            ("PETITE_TRTEXEC", ""),
        ] {
            let e = Settings::from_vars(&vars(&[(k, v)])).unwrap_err();
            assert_eq!(e.name, k);
        }
    }

    #[test]
    fn doctor_lists_every_setting_and_names_invalid_and_removed_ones() {
        let lines = doctor_lines(&vars(&[
            ("PETITE_CUDA_UPLOAD_THREADS", "abc"),
            ("PETITE_CUDA_NO_PDL", "1"),
        ]));
        for s in all() {
            assert!(lines.iter().any(|l| l.contains(s.name)), "{}", s.name);
        }
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("  invalid: PETITE_CUDA_UPLOAD_THREADS=\"abc\"")),
            "{lines:?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with("  ignored: PETITE_CUDA_NO_PDL=1 (")
                    && l.contains("session 15")),
            "{lines:?}"
        );
    }

    #[test]
    fn names_are_settings_removed_or_internal_once() {
        let mut names: Vec<&str> = all().iter().map(|s| s.name).collect();
        names.extend(REMOVED.iter().map(|r| r.name));
        names.extend(INTERNAL);
        let n = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), n, "a name in two lists");
        assert!(names.iter().all(|n| n.starts_with("PETITE_")));
    }

    /// README's "Settings" table lists every documented setting, and no removed name.
    #[test]
    fn the_readme_settings_table_lists_every_setting() {
        let readme = include_str!("../../../README.md");
        let at = readme
            .find("\n## Settings\n")
            .expect("README has a \"## Settings\" section");
        let section = &readme[at + 1..];
        let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
        let rows: Vec<&str> = section.lines().filter(|l| l.starts_with("| `")).collect();
        for s in all() {
            assert!(
                rows.iter()
                    .any(|r| r.starts_with(&format!("| `{}`", s.name))),
                "README's Settings table has no row for {}",
                s.name
            );
        }
        for r in REMOVED {
            assert!(
                !rows.iter().any(|row| row.contains(r.name)),
                "README's Settings table lists the removed {}",
                r.name
            );
        }
    }
}
