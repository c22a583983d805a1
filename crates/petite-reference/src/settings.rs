//! The environment variables the reference executor honours ([`CpuSettings`]), and what every
//! petite crate's settings share: a setting's documentation ([`Setting`]), the error for a value
//! it does not take ([`Invalid`]), and the strict parsers (below the CUDA and engine crates, so
//! each of them parses the same way).
//!
//! Why one place: these variables were once read where they were used, each parsed its own way
//! (`=0` meant off for one and on for another). Here a malformed value is an error naming the
//! variable and what it takes, never silently the default, and tests build settings from a map
//! ([`CpuSettings::from_vars`]) instead of the process environment. This file is the only one
//! of the crate that reads the environment (`cargo xtask settings` checks it).

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::OnceLock;

/// A documented user setting: what `petite doctor` lists and README's "Settings" table holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    /// The environment variable.
    pub name: &'static str,
    /// The values it takes.
    pub values: &'static str,
    /// What applies when it is unset.
    pub default: &'static str,
    /// What it does, and why one would set it.
    pub what: &'static str,
}

/// A value a setting does not take (or an unknown `--tune` key): names the setting, the value
/// and the values it takes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name}={value:?} is not a value it takes ({expected})")]
pub struct Invalid {
    /// The variable (or `--tune` key).
    pub name: String,
    /// The value found.
    pub value: String,
    /// The values it takes.
    pub expected: String,
}

impl Invalid {
    /// `name=value` is not one of `expected`.
    pub fn new(name: &str, value: impl Into<String>, expected: impl Into<String>) -> Self {
        Invalid {
            name: name.to_string(),
            value: value.into(),
            expected: expected.into(),
        }
    }
}

/// Where settings are read from: the process environment ([`std::env::var_os`]) or, in tests,
/// a map.
pub type Vars<'a> = &'a dyn Fn(&str) -> Option<OsString>;

/// `name`'s value as text (`None`: unset); a value that is not UTF-8 is [`Invalid`].
pub fn text(vars: Vars<'_>, name: &str) -> Result<Option<String>, Invalid> {
    match vars(name) {
        None => Ok(None),
        Some(v) => v
            .into_string()
            .map(Some)
            .map_err(|v| Invalid::new(name, v.to_string_lossy(), "UTF-8 text")),
    }
}

/// A switch: `1`/`on` on, `0`/`off` off (`None`: unset); anything else (empty too) is
/// [`Invalid`].
pub fn flag(vars: Vars<'_>, name: &str) -> Result<Option<bool>, Invalid> {
    match text(vars, name)?.as_deref() {
        None => Ok(None),
        Some("1" | "on") => Ok(Some(true)),
        Some("0" | "off") => Ok(Some(false)),
        Some(v) => Err(Invalid::new(name, v, "1 or on, 0 or off")),
    }
}

/// A path (`None`: unset); an empty value is [`Invalid`] (it names no file).
pub fn path(vars: Vars<'_>, name: &str) -> Result<Option<PathBuf>, Invalid> {
    match vars(name) {
        None => Ok(None),
        Some(v) if v.is_empty() => Err(Invalid::new(name, "", "a path")),
        Some(v) => Ok(Some(PathBuf::from(v))),
    }
}

/// A count of at least `min` (`None`: unset); anything else is [`Invalid`].
pub fn count(vars: Vars<'_>, name: &str, min: usize) -> Result<Option<usize>, Invalid> {
    match text(vars, name)? {
        None => Ok(None),
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if n >= min => Ok(Some(n)),
            _ => Err(Invalid::new(
                name,
                v,
                format!("a whole number, at least {min}"),
            )),
        },
    }
}

/// Whether a CPU unit (AMX-BF16 tiles, AVX512-BF16's `vdpbf16ps`) runs the bf16 linears.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Unit {
    /// Where the CPU has it (for `vdpbf16ps`: and is an AMD one, where it was measured faster).
    #[default]
    Auto,
    /// Wherever the CPU has it (`vdpbf16ps` on an Intel core too: how one measures it there).
    On,
    /// Never: the exact f32 path (its documented summation order).
    Off,
}

/// The reference executor's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuSettings {
    /// AMX-BF16 tiles for bf16 linears (`PETITE_CPU_AMX`; [`Unit::On`] means [`Unit::Auto`]:
    /// tiles are used wherever the CPU and OS grant them).
    pub amx: Unit,
    /// AVX512-BF16 `vdpbf16ps` for bf16 linears (`PETITE_CPU_DPBF16`).
    pub dpbf16: Unit,
    /// Time by op kind and the six slowest nodes on stderr after each run
    /// (`PETITE_CPU_PROFILE`).
    pub profile: bool,
}

/// The reference executor's documented settings (README "Settings", `petite doctor`).
pub const SETTINGS: &[Setting] = &[
    Setting {
        name: "PETITE_CPU_AMX",
        values: "auto (on, 1), off (0)",
        default: "auto: AMX-BF16 tiles where the CPU and OS grant them",
        what: "bf16 linears on AMX-BF16 tiles (0.38–0.49× the f32 path's time, session 12); \
               off for the exact f32 path and its documented summation order",
    },
    Setting {
        name: "PETITE_CPU_DPBF16",
        values: "auto, on (1), off (0)",
        default: "auto: vdpbf16ps on AMD CPUs with AVX512-BF16 only",
        what: "bf16 linears with AVX512-BF16 vdpbf16ps (a full verify 0.87× on AMD, session 17; \
               no gain on Intel); on forces it (to measure an Intel core), off for the exact path",
    },
    Setting {
        name: "PETITE_CPU_PROFILE",
        values: "0 or off, 1 or on",
        default: "off",
        what: "after each program run, seconds by op kind and its six slowest nodes on stderr",
    },
];

/// `auto`/`on`/`1`/`off`/`0` as a [`Unit`] (`None`: unset).
fn unit(vars: Vars<'_>, name: &str) -> Result<Option<Unit>, Invalid> {
    match text(vars, name)?.as_deref() {
        None => Ok(None),
        Some("auto") => Ok(Some(Unit::Auto)),
        Some("1" | "on") => Ok(Some(Unit::On)),
        Some("0" | "off") => Ok(Some(Unit::Off)),
        Some(v) => Err(Invalid::new(name, v, "auto, on or 1, off or 0")),
    }
}

impl CpuSettings {
    /// The settings of this process's environment (the crate's one read of it).
    pub fn from_env() -> Result<Self, Invalid> {
        Self::from_vars(&|n| std::env::var_os(n))
    }

    /// The settings `vars` gives; unset variables keep their defaults.
    pub fn from_vars(vars: Vars<'_>) -> Result<Self, Invalid> {
        let d = CpuSettings::default();
        Ok(CpuSettings {
            amx: unit(vars, "PETITE_CPU_AMX")?.unwrap_or(d.amx),
            dpbf16: unit(vars, "PETITE_CPU_DPBF16")?.unwrap_or(d.dpbf16),
            profile: flag(vars, "PETITE_CPU_PROFILE")?.unwrap_or(d.profile),
        })
    }
}

static CONFIGURED: OnceLock<Result<CpuSettings, Invalid>> = OnceLock::new();

/// Sets this process's CPU settings before the first run (what a program that parsed them
/// itself, as `petite` does, calls). Gives `s` back when they were already set or read.
pub fn configure(s: CpuSettings) -> Result<(), CpuSettings> {
    CONFIGURED.set(Ok(s)).map_err(|_| s)
}

/// This process's CPU settings: what [`configure`] set, else the environment's, read once. An
/// embedding program that never configures them still honours the variables; a malformed one
/// fails every [`crate::Executor::run`] naming it.
pub fn current() -> Result<CpuSettings, Invalid> {
    CONFIGURED.get_or_init(CpuSettings::from_env).clone()
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
    fn unset_is_the_default_and_values_parse_strictly() {
        assert_eq!(
            CpuSettings::from_vars(&vars(&[])).unwrap(),
            CpuSettings::default()
        );
        let s = CpuSettings::from_vars(&vars(&[
            ("PETITE_CPU_AMX", "0"),
            ("PETITE_CPU_DPBF16", "on"),
            ("PETITE_CPU_PROFILE", "1"),
        ]))
        .unwrap();
        assert_eq!((s.amx, s.dpbf16, s.profile), (Unit::Off, Unit::On, true));
        // `0` is off for every switch (it once meant on for the CUDA profile).
        let s = CpuSettings::from_vars(&vars(&[("PETITE_CPU_PROFILE", "0")])).unwrap();
        assert!(!s.profile);
        for (k, v) in [
            ("PETITE_CPU_AMX", "no"),
            ("PETITE_CPU_DPBF16", ""),
            ("PETITE_CPU_PROFILE", "yes"),
        ] {
            let e = CpuSettings::from_vars(&vars(&[(k, v)])).unwrap_err();
            assert_eq!(e.name, k);
            assert!(
                e.to_string().contains(k) && e.to_string().contains("off"),
                "{e}"
            );
        }
    }

    #[test]
    fn counts_and_paths_refuse_what_names_nothing() {
        let v = vars(&[("N", "0"), ("M", "abc"), ("K", " 4 "), ("P", "")]);
        assert!(count(&v, "N", 1).is_err() && count(&v, "M", 0).is_err());
        assert_eq!(count(&v, "K", 1).unwrap(), Some(4));
        assert_eq!(count(&v, "unset", 1).unwrap(), None);
        assert!(path(&v, "P").is_err());
    }
}
