//! The export's one registration point for backends. Each backend is one implementation of
//! [`BackendSpec`] in its own module here, answering everything the export and the command line
//! ask of it — its name, what its export writes ([`Output`]), the precisions it exports, the
//! export flags that apply to it ([`Flag`]), its default memory budget, its engine builder and
//! the delegate backend id its engines carry (what [`crate::runtimes`] opens them by) — and is
//! registered by one line in [`BACKENDS`]. Nothing outside these modules matches on a backend.

mod onnx;
mod portable;
mod reference;
mod tensorrt;

use std::path::PathBuf;

use petite_engine::EngineBuilder;
use petite_graph::quant::Quant;
use petite_pi05::Precision;

use crate::{Error, Result};

/// Every backend, in `--help` order. One line a backend.
pub const BACKENDS: &[Backend] = &[
    Backend(&reference::Reference),
    Backend(&tensorrt::TensorRt),
    Backend(&portable::Portable),
    Backend(&onnx::Onnx),
];

/// What a backend's export writes, i.e. which export stages run it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// `prefix.pte` + `step.pte` whose methods call engines built by the backend's
    /// [`EngineBuilder`] (delegates).
    Engines,
    /// `prefix.pte` + `step.pte` of ExecuTorch portable kernel calls (no engines).
    Portable,
    /// One ONNX model (`pi05.onnx` + external data), no `.pte`.
    Onnx,
}

/// A backend-specific flag of `petite export`: refused, in one line before any work, by a
/// backend that does not list it in [`BackendSpec::flags`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flag {
    /// `--engine-cap`.
    EngineCap,
    /// `--jobs`.
    Jobs,
    /// `--keep-engines`.
    KeepEngines,
    /// `--placement`.
    Placement,
    /// `--trtexec`.
    Trtexec,
    /// `--trt-python`.
    TrtPython,
    /// `--trt-target`.
    TrtTarget,
    /// `--weight-streaming-budget`.
    WeightStreamingBudget,
    /// `--weights int8|fp8` (quantized weights: backends that lower `dequantize`).
    Weights,
    /// `--quantize-skip`.
    QuantizeSkip,
}

impl Flag {
    /// The command-line spelling.
    pub fn name(self) -> &'static str {
        match self {
            Flag::EngineCap => "--engine-cap",
            Flag::Jobs => "--jobs",
            Flag::KeepEngines => "--keep-engines",
            Flag::Placement => "--placement",
            Flag::Trtexec => "--trtexec",
            Flag::TrtPython => "--trt-python",
            Flag::TrtTarget => "--trt-target",
            Flag::WeightStreamingBudget => "--weight-streaming-budget",
            Flag::Weights => "--weights",
            Flag::QuantizeSkip => "--quantize-skip",
        }
    }
}

/// Backend settings from the command line (only TensorRT has any today). Its `Debug` text is
/// part of the export id, so its fields are not renamed lightly.
#[derive(Debug, Clone, Default)]
pub struct BackendOptions {
    /// `--trtexec PATH`.
    pub trtexec: Option<PathBuf>,
    /// `--trt-python PY`.
    pub trt_python: Option<PathBuf>,
    /// `--trt-target smXY` (TensorRT-RTX; default: the GPU present, else `sm86`).
    pub trt_target: Option<String>,
    /// `--weight-streaming-budget SIZE`: weight-streamable engines, each given this many bytes
    /// of GPU weight memory at run time (the delegate's `weight_streaming_budget` compile spec).
    pub weight_streaming_budget: Option<u64>,
}

impl BackendOptions {
    /// The flags these options stand for (those set).
    pub fn flags(&self) -> Vec<Flag> {
        [
            (self.trtexec.is_some(), Flag::Trtexec),
            (self.trt_python.is_some(), Flag::TrtPython),
            (self.trt_target.is_some(), Flag::TrtTarget),
            (
                self.weight_streaming_budget.is_some(),
                Flag::WeightStreamingBudget,
            ),
        ]
        .into_iter()
        .filter_map(|(set, f)| set.then_some(f))
        .collect()
    }
}

/// What a backend is: one implementation per backend, registered in [`BACKENDS`].
pub trait BackendSpec: Sync {
    /// The command-line name (`--backend NAME`), also written into `report.json`.
    fn name(&self) -> &'static str;
    /// One line for `--help`.
    fn help(&self) -> &'static str;
    /// What its export writes.
    fn output(&self) -> Output;
    /// The numerics it exports (`--dtype`), and why when not every one (for the refusal).
    fn precisions(&self) -> (&'static [Precision], &'static str) {
        (&[Precision::Bf16, Precision::F32], "")
    }
    /// The backend-specific export flags that apply to it.
    fn flags(&self) -> &'static [Flag];
    /// The memory budget of an export given neither `--engine-cap` nor `--memory-budget`
    /// (TensorRT on an integrated GPU: the memory available now). The default: none.
    fn default_memory_budget(&self) -> Option<u64> {
        None
    }
    /// Its engine builder, its tool found and probed (a missing or broken builder is refused
    /// before any work, as is a `--weights` format its target cannot compute). Backends whose
    /// [`Output`] is not [`Output::Engines`] build none.
    fn builder(
        &self,
        o: &BackendOptions,
        weights: Option<Quant>,
    ) -> Result<Box<dyn EngineBuilder>> {
        let _ = (o, weights);
        Err(Error::Internal(format!(
            "the {} backend builds no engines",
            self.name()
        )))
    }
    /// The delegate backend id its engines carry in a `.pte` — what [`crate::runtimes`] opens
    /// them by — or `None` when it writes no delegates.
    fn delegate_id(&self) -> Option<&'static str> {
        None
    }
}

/// An export backend: a registered [`BackendSpec`] (`--backend NAME`).
#[derive(Clone, Copy)]
pub struct Backend(&'static dyn BackendSpec);

impl Backend {
    /// The default backend (`--backend reference`).
    pub const DEFAULT: Backend = Backend(&reference::Reference);

    /// The registered backend called `name`.
    pub fn named(name: &str) -> Option<Backend> {
        BACKENDS.iter().copied().find(|b| b.name() == name)
    }

    /// The command-line name.
    pub fn name(self) -> &'static str {
        self.0.name()
    }

    /// Everything else about it.
    pub fn spec(self) -> &'static dyn BackendSpec {
        self.0
    }

    /// Its builder ([`BackendSpec::builder`]).
    pub fn builder(
        self,
        o: &BackendOptions,
        weights: Option<Quant>,
    ) -> Result<Box<dyn EngineBuilder>> {
        self.0.builder(o, weights)
    }

    /// Refuses, in one line, a `--dtype` it does not export and every flag in `used` (as given
    /// on the command line, e.g. `--placement host`) that does not apply to it, saying which
    /// backends it applies to. The one check of both, run before any work.
    pub fn check(self, precision: Precision, used: &[(Flag, String)]) -> Result<()> {
        let (precisions, why) = self.0.precisions();
        if !precisions.contains(&precision) {
            let names: Vec<&str> = precisions.iter().map(|p| precision_name(*p)).collect();
            return Err(Error::Usage(format!(
                "--dtype {} does not apply to --backend {}: it exports {} programs only{why}; use --dtype {}",
                precision_name(precision),
                self.name(),
                names.join(" or "),
                names.join(" or --dtype ")
            )));
        }
        for (flag, given) in used {
            if self.0.flags().contains(flag) {
                continue;
            }
            let takers: Vec<&str> = BACKENDS
                .iter()
                .filter(|b| b.0.flags().contains(flag))
                .map(|b| b.name())
                .collect();
            return Err(Error::Usage(format!(
                "{given} does not apply to --backend {}: drop {} (it applies to --backend {} only)",
                self.name(),
                flag.name(),
                takers.join("|")
            )));
        }
        Ok(())
    }
}

fn precision_name(p: Precision) -> &'static str {
    match p {
        Precision::Bf16 => "bf16",
        Precision::F32 => "f32",
    }
}

impl PartialEq for Backend {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
    }
}

impl Eq for Backend {}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl clap::ValueEnum for Backend {
    fn value_variants<'a>() -> &'a [Self] {
        BACKENDS
    }
    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.name()).help(self.0.help()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_found() {
        for b in BACKENDS {
            assert_eq!(Backend::named(b.name()), Some(*b));
            assert_eq!(BACKENDS.iter().filter(|o| o.name() == b.name()).count(), 1);
        }
        assert_eq!(Backend::named("nope"), None);
    }

    /// A backend whose export writes engines says which runtime id opens them, and builds
    /// no engines otherwise.
    #[test]
    fn engine_backends_name_their_delegates() {
        for b in BACKENDS {
            let engines = b.spec().output() == Output::Engines;
            assert_eq!(b.spec().delegate_id().is_some(), engines, "{}", b.name());
            assert_eq!(
                b.spec().flags().contains(&Flag::KeepEngines),
                engines,
                "{}",
                b.name()
            );
        }
        let reference = Backend::named("reference").unwrap();
        let id = reference.spec().delegate_id().unwrap();
        assert!(crate::runtimes::runtime(id, crate::runtimes::Device::default()).is_ok());
    }

    #[test]
    fn inapplicable_flags_are_refused_naming_who_takes_them() {
        let portable = Backend::named("portable").unwrap();
        let e = portable
            .check(
                Precision::F32,
                &[(Flag::KeepEngines, "--keep-engines".into())],
            )
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "--keep-engines does not apply to --backend portable: drop --keep-engines (it applies to --backend reference|tensorrt only)"
        );
        let trt = Backend::named("tensorrt").unwrap();
        let e = trt.check(Precision::F32, &[]).unwrap_err().to_string();
        assert!(
            e.starts_with("--dtype f32 does not apply to --backend tensorrt"),
            "{e}"
        );
        assert!(
            trt.check(Precision::Bf16, &[(Flag::TrtTarget, "--trt-target".into())])
                .is_ok()
        );
    }
}
