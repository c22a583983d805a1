//! Project automation: `cargo xtask <command>`. Automation only; the work lives in the crates.
//! One module per task so tasks grow independently.

mod bench;
mod circles;
mod codegen;
mod conformance;
mod export_pi05;
mod gpu_bundle;
mod settings_lint;
mod util;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

/// petite's automation tasks.
#[derive(Parser)]
#[command(
    about = "petite automation: the whole test suite, code generation, conformance, benches, the pi0.5 export",
    after_help = "Environment (xtask's own; petite's settings are README \"Settings\" and `petite doctor`):\n  \
        XTASK_ROOT        the workspace root (default: found from the current directory)\n  \
        PETITE_PYTHON312  a Python 3.12 to build the venvs with (default: pyenv's 3.12.x, else python3.12 on PATH)\n  \
        PETITE_MEMCAP     the memcap tool the benches run under (default: shared/tools/memcap beside the workspace)\n  \
        XTASK_PETITE_BIN  a prebuilt petite for the gpu tier and the GPU benches (a GPU machine without a toolchain)\n  \
        XTASK_CUDA_TESTS  a prebuilt petite-cuda GPU test binary for the gpu tier"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Every check CI runs: rustfmt, no import circles (`circles`), the environment read only in
    /// settings.rs (`settings`), clippy (-D warnings), rustdoc
    /// (-D warnings), all tests (doc
    /// tests included), packaging of the embeddable crates, the outside exporter
    /// (`examples/outside-exporter`), and the conformance tier against real ExecuTorch / lerobot
    /// software in venvs under target/.
    Ci,
    /// Conformance against real ExecuTorch and lerobot software (venvs under target/).
    Conformance(conformance::Args),
    /// Whole-process benchmarks under memcap.
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// No import circles between any crate's top-level modules (reads the sources; no build).
    Circles,
    /// The environment is read only in each crate's settings.rs, and every PETITE_ name in
    /// library code is registered there (reads the sources; no build).
    Settings,
    /// Regenerate petite-pte's flatbuffers code from the vendored schema (`--check`: fail if stale).
    Codegen(codegen::Args),
    /// The whole pi0.5 export (synthesized full-size checkpoint by default), verified.
    ExportPi05(export_pi05::Args),
    /// Release `petite`, `xtask` and petite-cuda's GPU tests in one folder (`.gpu`) with a
    /// `run.sh`, for a GPU machine without a Rust toolchain: the gpu tier and `bench gpu` there.
    GpuBundle(gpu_bundle::Args),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Ci => {
            // A full run writes ~22 GB under target/ (two torch venvs, the test and release
            // builds, the aarch64 build); a full disk shows up as some compiler's IO error deep in
            // the log, so the space is said first and again when a step fails.
            util::report_disk("before CI");
            ci().inspect_err(|_| util::report_disk("when CI failed"))
        }
        Cmd::Conformance(a) => conformance::run(&a),
        Cmd::Bench(b) => bench::run(b),
        Cmd::Circles => circles::run(),
        Cmd::Settings => settings_lint::run(),
        Cmd::Codegen(a) => codegen::run(&a),
        Cmd::ExportPi05(a) => export_pi05::run(&a),
        Cmd::GpuBundle(a) => gpu_bundle::run(&a),
    }
}

fn ci() -> Result<()> {
    // pip's ~8 min (lerobot's and ExecuTorch's torch among them) beside the compiles below.
    // The conformance tiers run the petite binary and examples the test build below makes.
    let conformance = conformance::Args {
        test_build: true,
        ..Default::default()
    };
    conformance::prefetch_venvs(&conformance)?;
    util::cargo(&["fmt", "--all", "--", "--check"])?;
    circles::run()?;
    settings_lint::run()?;
    util::cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    // Rustdoc warnings (broken intra-doc links among them) fail CI.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    util::run(
        std::process::Command::new(&cargo)
            .args(["doc", "--workspace", "--no-deps"])
            .env("RUSTDOCFLAGS", "-D warnings")
            .current_dir(util::root()),
    )?;
    // Unit, property and integration tests, and the doc tests (every embeddable crate's README
    // example is its crate-level doc test).
    util::cargo(&["test", "--workspace"])?;
    // Tests that need root (a tmpfs mount for a real full disk): ignored by plain `cargo test`,
    // run here, where they fail rather than skip when they cannot run.
    // `--workspace`, not `-p petite`: the features resolve as in the run above, so nothing is
    // built again (a single package's features differ and rebuilt the workspace: ~6 min).
    util::cargo(&["test", "--workspace", "--test", "faults", "--", "--ignored"])?;
    embeddable()?;
    // The committed flatbuffers code is what flatc makes of the vendored schema now.
    codegen::run(&codegen::Args { check: true })?;
    conformance::run(&conformance)?;
    Ok(())
}

/// The crates another exporter can embed: packaged as for a registry (every path dependency
/// has a version, nothing publish-only is missing), and used from outside the workspace.
const EMBEDDABLE: &[&str] = &[
    "petite-fs",
    "petite-dtype",
    "petite-graph",
    "petite-weights",
    "petite-pte",
    "petite-partition",
    "petite-portable",
];

fn embeddable() -> Result<()> {
    // Packaged together: dependencies among them resolve through cargo's local overlay, not
    // crates.io. Not verified here (that rebuilds each one); the outside exporter below builds
    // them as a dependent would.
    let mut args = vec!["package", "--no-verify", "--allow-dirty"];
    for p in EMBEDDABLE {
        args.extend(["-p", p]);
    }
    util::cargo(&args)?;
    // A tiny exporter with its own workspace and lock file, depending on them by version.
    let target = util::target_dir().join("outside-exporter");
    let manifest = "examples/outside-exporter/Cargo.toml";
    util::cargo(&["fmt", "--manifest-path", manifest, "--", "--check"])?;
    util::cargo(&[
        "run",
        "--manifest-path",
        manifest,
        "--target-dir",
        target.to_str().context("target directory is not UTF-8")?,
    ])
}
