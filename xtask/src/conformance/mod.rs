//! `cargo xtask conformance [--full]`: checks petite's outputs with software nobody here wrote
//! (ExecuTorch's runtime and deserializer, lerobot's PyTorch PI05, ONNX Runtime, TensorRT-RTX's
//! parser and builder), each in a venv under target/; and petite itself cross-built for aarch64
//! and run under qemu-aarch64.
//! One module per tier so they grow independently.

use anyhow::Result;

use crate::util;

mod aarch64;
pub(crate) mod gpu;
pub(crate) use gpu::petite_bin;
mod lerobot;
pub(crate) mod nvrtc;
mod onnx;
pub(crate) mod policy;
mod portable;
mod pte;
mod tensorrt;
mod weights;

/// The lerobot goldens every tier runs (`testdata/pi05/<case>`). The first is the tiers' one-case
/// pick (weight streaming, the 64 KiB-page run, refusals).
pub(crate) const GOLDENS: &[&str] = &[
    "two_cams_mqa",
    "three_cams_masked_gqa",
    "one_cam_mha_unpadded",
];

/// The Python venvs under `target/` that the tiers, codegen and the benches run: each named here
/// once with its pinned requirements, so [`prefetch_venvs`] builds the same venvs the tiers ask
/// for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Venv {
    /// lerobot 0.6.1 and its torch (`conformance/lerobot/requirements.txt`).
    Lerobot,
    /// executorch-numpy-runtime and flatc (codegen, the pte and portable tiers).
    Pte,
    /// ExecuTorch 1.5.1 with PyTorch (exporter and deserializer).
    PteFull,
    /// Python safetensors, numpy, ml_dtypes.
    Weights,
    /// ONNX and ONNX Runtime.
    Ort,
    /// TensorRT-RTX.
    Trt,
    /// NVIDIA's runtime compiler (no GPU).
    Nvrtc,
}

impl Venv {
    /// `target/venv-<name>`.
    fn name(self) -> &'static str {
        match self {
            Venv::Lerobot => "lerobot",
            Venv::Pte => "pte",
            Venv::PteFull => "pte-full",
            Venv::Weights => "weights",
            Venv::Ort => "ort",
            Venv::Trt => "trt",
            Venv::Nvrtc => "nvrtc",
        }
    }

    /// The pip requirements.
    fn requirements(self) -> Result<Vec<String>> {
        let fixed: &[&str] = match self {
            Venv::Lerobot => return lerobot::requirements(),
            Venv::Pte => pte::REQUIREMENTS,
            Venv::PteFull => pte::FULL_REQUIREMENTS,
            Venv::Weights => weights::REQUIREMENTS,
            Venv::Ort => onnx::REQUIREMENTS,
            Venv::Trt => &[petite_engine::tensorrt::RTX_REQUIREMENT],
            Venv::Nvrtc => nvrtc::REQUIREMENTS,
        };
        Ok(fixed.iter().map(|r| r.to_string()).collect())
    }

    /// The venv's `python`, the venv built or rebuilt first when needed ([`util::venv`]).
    pub(crate) fn python(self) -> Result<std::path::PathBuf> {
        let reqs = self.requirements()?;
        let reqs: Vec<&str> = reqs.iter().map(String::as_str).collect();
        util::venv(self.name(), &reqs)
    }
}

/// Options of the conformance task.
#[derive(clap::Args, Default)]
pub struct Args {
    /// Also run the heavy tier (executorch==1.5.1 with torch, ~5 GB install).
    #[arg(long)]
    pub full: bool,
    /// Rewrite testdata/pi05 from lerobot instead of checking it (then review the diff).
    #[arg(long)]
    pub bless_lerobot: bool,
    /// Run only these tiers (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub only: Vec<Tier>,
    /// Run the petite binary and examples of the test-profile build that `cargo test
    /// --workspace` made (target/debug) instead of building release: what `cargo xtask ci` does.
    #[arg(long)]
    pub test_build: bool,
    /// Testing the drift check: run this golden generator instead of the committed one (its
    /// hash is not checked; its outputs are, against testdata/pi05).
    #[arg(long, hide = true)]
    pub lerobot_generator: Option<std::path::PathBuf>,
}

/// A conformance tier.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// lerobot's PyTorch PI05 regenerates the goldens (under three ISA settings).
    Lerobot,
    /// ExecuTorch's deserializer and runtime read petite-pte's files.
    Pte,
    /// The weights tier (safetensors and conversion against Python's readers).
    Weights,
    /// ONNX Runtime runs the per-engine ONNX models and the whole-policy export (`--backend onnx`).
    Onnx,
    /// ExecuTorch's runtime runs the portable exports.
    Portable,
    /// Real lerobot 0.6.1 policy folders exported and run by `petite act` against lerobot's
    /// whole pipeline (preprocessor → predict_action_chunk → postprocessor); and by the Python
    /// package (`petite.Policy`, `pip install crates/petite-python` as a user runs it) over a loop
    /// of observations.
    LerobotPolicy,
    /// TensorRT-RTX parses and builds every golden's engines.
    Tensorrt,
    /// petite's programs on CUDA GPU 0 (petite-cuda): the goldens through `pi05 run` and
    /// `verify` with `--device cuda`. Fails without a GPU; not part of `cargo xtask ci`.
    Gpu,
    /// petite cross-built for aarch64, a golden exported and verified under qemu-aarch64 (4 KiB
    /// and 64 KiB pages), byte-identical to x86-64.
    Aarch64,
    /// NVRTC (pip, no GPU) compiles every CUDA source petite-cuda generates for pi0.5's
    /// full-size programs, for sm_90 (H200) and sm_87 (Jetson Orin).
    Nvrtc,
}

/// Starts building, in the background, the venvs of the tiers `args` selects, in the order the
/// tiers ask for them (see [`util::prefetch_venvs`]). `cargo xtask ci` calls it first, so pip
/// works while clippy and the tests compile.
pub fn prefetch_venvs(args: &Args) -> Result<()> {
    let on = |t: Tier| args.only.is_empty() || args.only.contains(&t);
    let wanted = [
        (Venv::Lerobot, on(Tier::Lerobot) || on(Tier::LerobotPolicy)),
        (
            Venv::Pte,
            on(Tier::Pte) || on(Tier::Portable) || on(Tier::LerobotPolicy),
        ),
        (Venv::Weights, on(Tier::Weights)),
        (Venv::Ort, on(Tier::Onnx) || on(Tier::LerobotPolicy)),
        (Venv::Trt, on(Tier::Tensorrt)),
        (Venv::PteFull, on(Tier::Tensorrt) || args.full),
        (Venv::Nvrtc, on(Tier::Nvrtc)),
    ];
    let mut venvs = Vec::new();
    for (v, needed) in wanted {
        if needed {
            venvs.push((v.name().to_string(), v.requirements()?));
        }
    }
    util::prefetch_venvs(venvs);
    Ok(())
}

/// Runs every conformance tier.
pub fn run(args: &Args) -> Result<()> {
    let on = |t: Tier| args.only.is_empty() || args.only.contains(&t);
    if args.test_build {
        util::conformance_from_test_build()?;
    }
    if on(Tier::Lerobot) {
        lerobot::run(args.bless_lerobot, args.lerobot_generator.as_deref())?;
    }
    if on(Tier::Pte) {
        pte::run(args.full)?;
    }
    if on(Tier::Weights) {
        weights::run()?;
    }
    if on(Tier::Onnx) {
        onnx::run()?;
    }
    if on(Tier::Portable) {
        portable::run(args.full)?;
    }
    if on(Tier::LerobotPolicy) {
        policy::run()?;
    }
    if on(Tier::Tensorrt) {
        tensorrt::run()?;
    }
    if on(Tier::Aarch64) {
        aarch64::run()?;
    }
    if on(Tier::Nvrtc) {
        nvrtc::run()?;
    }
    // Only when asked for by name: it needs a GPU, and fails without one.
    if args.only.contains(&Tier::Gpu) {
        gpu::run()?;
    }
    if args.full && args.only.is_empty() {
        // The exporter's own .pte files (TensorRT-style delegates over named data), on a small
        // golden, through ExecuTorch 1.5.1's deserialize_pte_binary (the pte tier made its venv).
        util::cargo(&[
            "run",
            "-q",
            "-p",
            "xtask",
            "--",
            "export-pi05",
            "--small",
            "--executorch-check",
        ])?;
    }
    Ok(())
}
