//! What a [`crate::Device`] is opened with ([`Settings`]): the documented `PETITE_CUDA_*`
//! environment variables ([`SETTINGS`]), and the A/B [`Tuning`] that no variable sets.
//!
//! Why here, once: the switches were read where they were used and parsed six ways
//! (`PETITE_CUDA_NO_FUSE=0` turned fusion off). The ones measured and decided are gone (their
//! figures: docs/MEASUREMENTS.md, "Switches decided (issue 52)"); the diagnostic and
//! small-machine ones below are parsed strictly, a malformed value an error naming the variable;
//! the ones kept only to compare against are [`Tuning`], which `petite`'s hidden `--tune` flag
//! and `cargo xtask bench gpu --variant` set. This file is the only one of the crate that reads
//! the environment (`cargo xtask settings` checks it).

use std::num::NonZeroUsize;
use std::path::PathBuf;

pub use petite_reference::settings::{Invalid, Setting, Vars};
use petite_reference::settings::{count, flag, path, text};

/// Per-node device timing, printed after each run (`PETITE_CUDA_PROFILE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Profile {
    /// No timing.
    #[default]
    Off,
    /// Device time by op kind and the slowest nodes (`ops`, or `1`).
    Ops,
    /// Also every launched node in run order with its time (`nodes`).
    Nodes,
}

/// A/B options kept to compare against their measured defaults (`cargo xtask bench gpu
/// --variant`, `petite … --tune KEY=VALUE`); never read from the environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    /// Elementwise fusion, in-place GEMM operands and sibling batching (`fuse=on|off`): off is
    /// the bisecting baseline ("is it the fuser?"); on measured a bf16 chunk 107.4 → 50.9 ms
    /// (session 9).
    pub fuse: bool,
    /// Slice starts as kernel parameters (`offsets=params|literal`): literal bakes them in,
    /// one kernel a distinct set (NVRTC's work about twice today's; session 25).
    pub offset_params: bool,
    /// bf16 attentions of up to this many queries fused (`attention_queries=N|all|off`);
    /// `None`: the device's default ([`crate::fuse::fused_attention_queries`]).
    pub attention_queries: Option<usize>,
    /// Which embedding tables a resident method gathers on the host (`host_gather=on|off|all`,
    /// [`crate::host_gather`]): by default those of at least [`MIN_TABLE_BYTES`] (pi0.5's
    /// 1004.5 MiB token embedding stays in the mapped `.pte`, the ~200 rows a chunk reads are
    /// uploaded); off, none (the tables are uploaded); all, every one (so small goldens take
    /// the same path in tests).
    pub host_gather: HostGather,
}

/// Tables smaller than this stay on the device by default ([`HostGather::Large`]): their bytes
/// are not worth a per-run gather.
pub const MIN_TABLE_BYTES: usize = 16 << 20;

/// Which embedding tables are gathered on the host ([`Tuning::host_gather`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostGather {
    /// None: every table is uploaded.
    Off,
    /// Those of at least [`MIN_TABLE_BYTES`] (the default).
    Large,
    /// Every one whose indices the host has.
    All,
}

impl HostGather {
    /// The smallest table gathered on the host, or `None` when none is.
    pub fn min_table_bytes(self) -> Option<usize> {
        match self {
            HostGather::Off => None,
            HostGather::Large => Some(MIN_TABLE_BYTES),
            HostGather::All => Some(0),
        }
    }
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            fuse: true,
            offset_params: true,
            attention_queries: None,
            host_gather: HostGather::Large,
        }
    }
}

impl Tuning {
    /// The keys and values [`Tuning::set`] takes.
    pub const KEYS: &'static str =
        "fuse=on|off, offsets=params|literal, attention_queries=N|all|off, host_gather=on|off|all";

    /// Sets `key` to `value`; an unknown key or a value it does not take is [`Invalid`].
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), Invalid> {
        let bad = |expected: &str| Invalid::new(key, value, expected);
        match key {
            "fuse" => {
                self.fuse = match value {
                    "on" => true,
                    "off" => false,
                    _ => return Err(bad("on or off")),
                }
            }
            "offsets" => {
                self.offset_params = match value {
                    "params" => true,
                    "literal" => false,
                    _ => return Err(bad("params or literal")),
                }
            }
            "attention_queries" => {
                self.attention_queries = Some(match value {
                    "all" => usize::MAX,
                    "off" => 0,
                    n => n
                        .parse()
                        .map_err(|_| bad("a number of queries, all or off"))?,
                })
            }
            "host_gather" => {
                self.host_gather = match value {
                    "on" => HostGather::Large,
                    "off" => HostGather::Off,
                    "all" => HostGather::All,
                    _ => return Err(bad("on, off or all")),
                }
            }
            _ => return Err(Invalid::new(key, value, format!("a key: {}", Self::KEYS))),
        }
        Ok(())
    }

    /// The defaults with each `KEY=VALUE` of `items` set in turn.
    pub fn parse<S: AsRef<str>>(items: &[S]) -> Result<Tuning, Invalid> {
        let mut t = Tuning::default();
        for item in items {
            let item = item.as_ref();
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| Invalid::new(item, "", format!("KEY=VALUE: {}", Self::KEYS)))?;
            t.set(k, v)?;
        }
        Ok(t)
    }

    /// Every key with its value, as [`Tuning::set`] takes it (`attention_queries=default`:
    /// the device's): what `--timing-json` records, so a bench can check its variant applied.
    pub fn describe(&self) -> [(&'static str, String); 4] {
        [
            ("fuse", if self.fuse { "on" } else { "off" }.to_string()),
            (
                "offsets",
                if self.offset_params {
                    "params"
                } else {
                    "literal"
                }
                .to_string(),
            ),
            (
                "attention_queries",
                match self.attention_queries {
                    None => "default".to_string(),
                    Some(0) => "off".to_string(),
                    Some(usize::MAX) => "all".to_string(),
                    Some(n) => n.to_string(),
                },
            ),
            (
                "host_gather",
                match self.host_gather {
                    HostGather::Off => "off",
                    HostGather::Large => "on",
                    HostGather::All => "all",
                }
                .to_string(),
            ),
        ]
    }
}

/// What a [`crate::Device`] is opened with. `Default`: no disk cache of kernels, the default
/// reader threads, no trace or profile, the measured [`Tuning`] (what tests use; the
/// environment's are [`Settings::from_env`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Settings {
    /// The folder of compiled kernels kept between processes ([`crate::KernelCache`]); `None`:
    /// every process compiles its kernels with NVRTC.
    pub kernel_cache: Option<PathBuf>,
    /// Weight reader threads at upload (`None`: up to 4, one a core).
    pub upload_threads: Option<NonZeroUsize>,
    /// Where loading spends its time, on stderr.
    pub trace: bool,
    /// Per-node device timing after each run (CUDA graphs are off while it is on).
    pub profile: Profile,
    /// The A/B options (never from the environment).
    pub tuning: Tuning,
}

/// petite-cuda's documented settings (README "Settings", `petite doctor`).
pub const SETTINGS: &[Setting] = &[
    Setting {
        name: "PETITE_CUDA_CACHE",
        values: "a folder, or off",
        default: "$XDG_CACHE_HOME/petite/cuda, else ~/.cache/petite/cuda",
        what: "compiled kernels kept between processes (a cold full-size verify 19.7 s, 10.94 s \
               once cached; session 23): move it off a read-only home, share it, or turn it off",
    },
    Setting {
        name: "PETITE_CUDA_UPLOAD_THREADS",
        values: "a number, at least 1",
        default: "one a core, up to 4",
        what: "weight reader threads at load, each with 16 MiB of page-locked staging: fewer for \
               a small board whose page-locked memory is GPU memory (on the H200 fewer measured \
               no better; session 13)",
    },
    Setting {
        name: "PETITE_CUDA_TRACE",
        values: "0 or off, 1 or on",
        default: "off",
        what: "where loading spends its time (bytes, seconds, NVRTC) on stderr: why a cold run \
               is slow",
    },
    Setting {
        name: "PETITE_CUDA_PROFILE",
        values: "off (0), ops (1, on), nodes",
        default: "off",
        what: "device time by op kind and the slowest nodes after each run (nodes: every launch \
               too); turns CUDA graphs off, and adds ~6 µs of events a node",
    },
];

impl Settings {
    /// The settings of this process's environment (the crate's one read of it).
    pub fn from_env() -> Result<Settings, Invalid> {
        Self::from_vars(&|n| std::env::var_os(n))
    }

    /// The settings `vars` gives (the kernel cache's default folder from `XDG_CACHE_HOME` or
    /// `HOME` there); unset variables keep their defaults, [`Tuning`] its measured ones.
    pub fn from_vars(vars: Vars<'_>) -> Result<Settings, Invalid> {
        let kernel_cache = match text(vars, "PETITE_CUDA_CACHE")?.as_deref() {
            Some("off") => None,
            Some(_) => path(vars, "PETITE_CUDA_CACHE")?,
            None => {
                let nonempty = |n: &str| vars(n).filter(|v| !v.is_empty()).map(PathBuf::from);
                nonempty("XDG_CACHE_HOME")
                    .or_else(|| nonempty("HOME").map(|h| h.join(".cache")))
                    .map(|c| c.join("petite").join("cuda"))
            }
        };
        let profile = match text(vars, "PETITE_CUDA_PROFILE")?.as_deref() {
            None | Some("0" | "off") => Profile::Off,
            Some("1" | "on" | "ops") => Profile::Ops,
            Some("nodes") => Profile::Nodes,
            Some(v) => {
                return Err(Invalid::new(
                    "PETITE_CUDA_PROFILE",
                    v,
                    "off or 0, ops or 1 or on, nodes",
                ));
            }
        };
        Ok(Settings {
            kernel_cache,
            upload_threads: count(vars, "PETITE_CUDA_UPLOAD_THREADS", 1)?
                .and_then(NonZeroUsize::new),
            trace: flag(vars, "PETITE_CUDA_TRACE")?.unwrap_or(false),
            profile,
            tuning: Tuning::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::ffi::OsString;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<OsString> {
        let m: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        move |n| m.get(n).cloned()
    }

    #[test]
    fn the_environment_parses_strictly() {
        let s = Settings::from_vars(&vars(&[("HOME", "/h")])).unwrap();
        assert_eq!(
            s,
            Settings {
                kernel_cache: Some(PathBuf::from("/h/.cache/petite/cuda")),
                ..Settings::default()
            }
        );
        let s = Settings::from_vars(&vars(&[
            ("HOME", "/h"),
            ("XDG_CACHE_HOME", "/x"),
            ("PETITE_CUDA_UPLOAD_THREADS", "2"),
            ("PETITE_CUDA_TRACE", "on"),
            ("PETITE_CUDA_PROFILE", "1"),
        ]))
        .unwrap();
        assert_eq!(s.kernel_cache, Some(PathBuf::from("/x/petite/cuda")));
        assert_eq!(s.upload_threads, NonZeroUsize::new(2));
        assert!(s.trace && s.profile == Profile::Ops);
        let s = Settings::from_vars(&vars(&[
            ("HOME", "/h"),
            ("PETITE_CUDA_CACHE", "off"),
            ("PETITE_CUDA_PROFILE", "0"),
        ]))
        .unwrap();
        // `0` is off: it once turned profiling on (and CUDA graphs off).
        assert_eq!((s.kernel_cache, s.profile), (None, Profile::Off));
        let s = Settings::from_vars(&vars(&[("PETITE_CUDA_PROFILE", "nodes")])).unwrap();
        assert_eq!(s.profile, Profile::Nodes);
        for (k, v) in [
            ("PETITE_CUDA_UPLOAD_THREADS", "0"),
            ("PETITE_CUDA_UPLOAD_THREADS", "abc"),
            ("PETITE_CUDA_CACHE", ""),
            ("PETITE_CUDA_TRACE", ""),
            ("PETITE_CUDA_PROFILE", "yes"),
        ] {
            let e = Settings::from_vars(&vars(&[(k, v)])).unwrap_err();
            assert_eq!(e.name, k, "{e}");
        }
    }

    #[test]
    fn tuning_takes_its_keys_and_refuses_others() {
        let t = Tuning::parse(&[
            "fuse=off",
            "offsets=literal",
            "attention_queries=all",
            "host_gather=off",
        ])
        .unwrap();
        assert_eq!(
            t,
            Tuning {
                fuse: false,
                offset_params: false,
                attention_queries: Some(usize::MAX),
                host_gather: HostGather::Off,
            }
        );
        assert_eq!(
            Tuning::parse(&["attention_queries=off"])
                .unwrap()
                .attention_queries,
            Some(0)
        );
        assert_eq!(
            Tuning::parse(&["attention_queries=128"])
                .unwrap()
                .describe()[2]
                .1,
            "128"
        );
        assert_eq!(
            Tuning::default()
                .describe()
                .map(|(k, v)| format!("{k}={v}")),
            [
                "fuse=on",
                "offsets=params",
                "attention_queries=default",
                "host_gather=on"
            ]
        );
        assert_eq!(
            Tuning::parse(&["host_gather=all"])
                .unwrap()
                .host_gather
                .min_table_bytes(),
            Some(0)
        );
        for bad in [
            "fuse=0",
            "pairs=off",
            "offsets",
            "attention_queries=on",
            "host_gather=1",
        ] {
            let e = Tuning::parse(&[bad]).unwrap_err();
            assert!(
                e.to_string().contains(bad.split('=').next().unwrap()),
                "{e}"
            );
        }
    }
}
