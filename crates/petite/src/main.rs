//! The `petite` command line. Each subcommand lives in its own module under `cli/`.
use clap::{Parser, Subcommand};

mod cli;

/// Keeps freed large blocks for reuse once a command runs programs on the reference executor
/// (see [`keep_bytes`]); until then it is the system allocator.
#[global_allocator]
static ALLOC: petite_reference::Recycler = petite_reference::Recycler::new();

/// petite: compile pi0.5 into ExecuTorch `.pte` programs in bounded memory.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Convert a checkpoint to a bf16/f16 safetensors mapping file in bounded memory.
    Convert(cli::convert::ConvertArgs),
    /// pi0.5 tools: synthetic checkpoints, reference runs.
    #[command(subcommand)]
    Pi05(cli::pi05::Pi05Cmd),
    /// Verify a .pte and list its methods, delegates, named data and segments.
    Inspect(cli::inspect::InspectArgs),
    /// Partition a pi0.5 program into engines under a per-engine weight cap (shapes only).
    Plan(cli::plan::PlanArgs),
    /// Export pi0.5 to prefix.pte + step.pte in bounded memory.
    Export(cli::export::ExportArgs),
    /// Lower one pi0.5 program to a portable ExecuTorch .pte (kernel calls, no delegate).
    Lower(cli::lower::LowerArgs),
    /// Run an export's .pte files and compare with the f32 reference (separate process).
    Verify(cli::verify::VerifyArgs),
    /// Run an export from a raw lerobot observation (lerobot's pre- and post-processing).
    Act(cli::act::ActArgs),
    /// Serve an export over gRPC (proto/petite/v1/policy.proto) until SIGTERM: Act, Info,
    /// Health; loopback by default.
    #[cfg(feature = "serve")]
    Serve(cli::serve::ServeArgs),
    /// What this machine offers: the GPU the CUDA driver reports, the TensorRT builder found.
    Doctor(cli::doctor::DoctorArgs),
}

/// Exit codes: 0 success; 1 any error (the message says what and where); 74 (`EX_IOERR`,
/// [`petite_weights::fault::EXIT_CODE`]) an input changed or was truncated while it was read
/// (a SIGBUS on a mapped file, or an identity check at a stage boundary), also under a CUDA or
/// engine error; 2 a command line that cannot be used (clap's errors, and petite's
/// [`petite::Error::Usage`]: a flag that does not apply, a missing one).
fn main() -> std::process::ExitCode {
    // Before any file is mapped: a SIGBUS on a mapped input becomes an error naming the file.
    petite_weights::fault::install_sigbus_handler();
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{}", one_line(&e));
            std::process::ExitCode::from(exit_code(&e))
        }
    }
}

/// Every failure in one form, the SIGBUS handler's too: `petite: error: <what> (<cause>)`.
/// The context chain is walked from the outside in; a cause whose text an outer message already
/// holds (an error type that both prints its source and returns it as `source()`) is left out,
/// so each cause is said once. Messages are already single lines; any newline a foreign error
/// carries is folded to "; " so the whole report stays one line.
fn one_line(e: &anyhow::Error) -> String {
    let mut said: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string().trim().replace('\n', "; ");
        if text.is_empty() || said.iter().any(|s| s.contains(&text)) {
            continue;
        }
        said.push(text);
    }
    let mut out = format!("petite: error: {}", said.first().map_or("", String::as_str));
    if said.len() > 1 {
        out.push_str(&format!(" ({})", said[1..].join(": ")));
    }
    out
}

fn exit_code(e: &anyhow::Error) -> u8 {
    let changed = e.chain().any(|c| {
        c.downcast_ref::<petite::Error>()
            .is_some_and(petite::Error::is_input_changed)
            || c.downcast_ref::<petite_weights::Error>()
                .is_some_and(|w| matches!(w, petite_weights::Error::Changed { .. }))
            || c.downcast_ref::<petite_pi05::Error>().is_some_and(|p| {
                matches!(
                    p,
                    petite_pi05::Error::Weights(petite_weights::Error::Changed { .. })
                )
            })
    });
    let usage = e.chain().any(|c| {
        c.downcast_ref::<petite::Error>()
            .is_some_and(petite::Error::is_usage)
    });
    if changed {
        petite_weights::fault::EXIT_CODE as u8
    } else if usage {
        2
    } else {
        1
    }
}

fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // The environment's settings and `--tune`, parsed once before any work (a malformed value
    // exits 2 naming it); `doctor` names a malformed one instead of refusing it.
    if !matches!(cli.cmd, Cmd::Doctor(_)) {
        let mut settings = petite::settings::Settings::from_env()?;
        let tune: &[String] = match &cli.cmd {
            Cmd::Verify(a) => &a.tune,
            Cmd::Act(a) => &a.tune,
            Cmd::Pi05(cli::pi05::Pi05Cmd::Run(a)) => &a.tune,
            _ => &[],
        };
        settings.cuda.tuning = petite_cuda::Tuning::parse(tune)
            .map_err(|e| petite::Error::Usage(format!("--tune: {e}")))?;
        for r in petite::settings::removed_in_env() {
            eprintln!("petite: ignoring the removed {r}");
        }
        // Freed large blocks kept for reuse by commands that run programs on the reference
        // executor (`pi05 run`, `verify`, `act`): the prefix's per-layer outputs (up to 62 MiB
        // each, the same sizes every layer) are handed out again with their pages mapped
        // instead of page-faulted in afresh — a full-size f32 `pi05 run` took ~950k minor
        // faults, ~155k with this (docs/MEASUREMENTS.md; `PETITE_KEEP_MIB`, 0 keeps none).
        // Export keeps none: its memory is the budget it is held to.
        let runs_programs = match &cli.cmd {
            Cmd::Verify(_) | Cmd::Act(_) | Cmd::Pi05(cli::pi05::Pi05Cmd::Run(_)) => true,
            #[cfg(feature = "serve")]
            Cmd::Serve(_) => true,
            _ => false,
        };
        if runs_programs {
            ALLOC.keep_up_to(settings.keep_bytes());
        }
        let _ = petite::settings::configure(settings);
    }
    match cli.cmd {
        Cmd::Convert(a) => cli::convert::run(a),
        Cmd::Pi05(c) => cli::pi05::run(c),
        Cmd::Inspect(a) => cli::inspect::run(a),
        Cmd::Plan(a) => cli::plan::run(a),
        Cmd::Export(a) => cli::export::run(a),
        Cmd::Verify(a) => cli::verify::run(a),
        Cmd::Lower(a) => cli::lower::run(a),
        Cmd::Doctor(a) => cli::doctor::run(a),
        Cmd::Act(a) => cli::act::run(a),
        #[cfg(feature = "serve")]
        Cmd::Serve(a) => cli::serve::run(a),
    }
}

#[cfg(test)]
mod tests {
    use super::one_line;
    use anyhow::Context;

    #[derive(Debug)]
    struct Io;
    impl std::fmt::Display for Io {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("No space left on device (os error 28)")
        }
    }
    impl std::error::Error for Io {}

    /// An error that prints its source and also returns it (thiserror's `{source}` + `#[source]`).
    #[derive(Debug)]
    struct Write(Io);
    impl std::fmt::Display for Write {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "write /out/cache/w.safetensors: {}", self.0)
        }
    }
    impl std::error::Error for Write {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn each_cause_is_said_once_on_one_line() {
        let e = Err::<(), _>(Write(Io))
            .context("export failed")
            .unwrap_err();
        assert_eq!(
            one_line(&e),
            "petite: error: export failed (write /out/cache/w.safetensors: No space left on \
             device (os error 28))"
        );
        let plain = anyhow::anyhow!("no config.json in /x");
        assert_eq!(one_line(&plain), "petite: error: no config.json in /x");
        let multi = anyhow::anyhow!("python said:\nTraceback\n  boom");
        assert_eq!(
            one_line(&multi),
            "petite: error: python said:; Traceback;   boom"
        );
    }

    fn changed() -> petite_weights::Error {
        petite_weights::Error::Changed {
            role: "checkpoint",
            file: "/ck/model.safetensors".into(),
            what: "size 10 → 4".into(),
        }
    }

    /// Usage errors exit 2 as clap's do; a checkpoint changed under a CUDA upload (petite-cuda's
    /// error, directly or inside an engine runtime's) exits 74 as it does on the CPU; an error
    /// of the input or of CUDA itself exits 1.
    #[test]
    fn exit_codes_follow_the_error_kind_through_wrappers() {
        use super::exit_code;
        let usage = anyhow::Error::from(petite::Error::Usage("--python does not apply".into()))
            .context("petite verify");
        assert_eq!(exit_code(&usage), 2);
        let cuda = petite::Error::Cuda {
            what: "--device cuda".into(),
            source: Box::new(petite_cuda::Error::Weights(changed())),
        };
        assert_eq!(exit_code(&anyhow::Error::from(cuda)), 74);
        let engine = petite::Error::Engine(petite_engine::Error::Runtime {
            runtime: "petite-cuda".into(),
            source: Box::new(petite_cuda::Error::Weights(changed())),
        });
        assert_eq!(exit_code(&anyhow::Error::from(engine)), 74);
        let unavailable = petite::Error::Cuda {
            what: "--device cuda".into(),
            source: Box::new(petite_cuda::Error::Unavailable("no libcuda.so.1".into())),
        };
        assert_eq!(exit_code(&anyhow::Error::from(unavailable)), 1);
        let input = petite::Error::input(std::path::Path::new("/obs.safetensors"), "no task");
        assert_eq!(exit_code(&anyhow::Error::from(input)), 1);
    }
}
