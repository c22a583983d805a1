//! The environment variables the TensorRT builder search honours ([`Settings`]): the one file
//! of the crate that reads the environment (`cargo xtask settings` checks it), so a malformed
//! value is an error naming the variable and tests need no process environment.

use std::ffi::OsString;
use std::path::PathBuf;

use petite_reference::settings::path;
pub use petite_reference::settings::{Invalid, Setting, Vars};

/// Environment variable naming the `trtexec` binary.
pub const TRTEXEC_ENV: &str = "PETITE_TRTEXEC";
/// Environment variable naming a Python with `tensorrt_rtx` installed.
pub const TRT_PYTHON_ENV: &str = "PETITE_TRT_PYTHON";

/// petite-engine's documented settings (README "Settings", `petite doctor`).
pub const SETTINGS: &[Setting] = &[
    Setting {
        name: TRTEXEC_ENV,
        values: "a trtexec binary",
        default: "--trtexec, else TensorRT-RTX, else trtexec on PATH",
        what: "the TensorRT builder for `petite export --backend tensorrt` (after --trtexec)",
    },
    Setting {
        name: TRT_PYTHON_ENV,
        values: "a Python with tensorrt_rtx",
        default: "--trt-python, else target/venv-trt",
        what: "the TensorRT-RTX builder's Python (after --trt-python)",
    },
];

/// What the TensorRT builder search reads from the environment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Settings {
    /// `PETITE_TRTEXEC`.
    pub trtexec: Option<PathBuf>,
    /// `PETITE_TRT_PYTHON`.
    pub trt_python: Option<PathBuf>,
    /// `PATH` (where `trtexec` is looked for last).
    pub path: Option<OsString>,
}

impl Settings {
    /// The settings of this process's environment (the crate's one read of it).
    pub fn from_env() -> Result<Settings, Invalid> {
        Self::from_vars(&|n| std::env::var_os(n))
    }

    /// The settings `vars` gives; an empty path is [`Invalid`].
    pub fn from_vars(vars: Vars<'_>) -> Result<Settings, Invalid> {
        Ok(Settings {
            trtexec: path(vars, TRTEXEC_ENV)?,
            trt_python: path(vars, TRT_PYTHON_ENV)?,
            path: vars("PATH"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_read_and_an_empty_one_refused() {
        let s =
            Settings::from_vars(&|n| (n == TRTEXEC_ENV).then(|| "/opt/trtexec".into())).unwrap();
        assert_eq!(s.trtexec, Some(PathBuf::from("/opt/trtexec")));
        assert_eq!((s.trt_python, s.path), (None, None));
        let e = Settings::from_vars(&|n| (n == TRT_PYTHON_ENV).then(OsString::new)).unwrap_err();
        assert_eq!(e.name, TRT_PYTHON_ENV);
    }
}
