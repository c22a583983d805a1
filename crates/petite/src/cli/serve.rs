//! `petite serve`: one exported policy behind gRPC (`proto/petite/v1/policy.proto`) until
//! SIGTERM or SIGINT, then a graceful stop (the calls in flight finish) and exit 0.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use petite::policy::{OpenOptions, Policy};

/// Arguments of `petite serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The export directory (prefix.pte + step.pte, or pi05.onnx, and policy.json), exported
    /// from a lerobot policy folder.
    #[arg(long)]
    pub dir: PathBuf,
    /// Address to listen on. Loopback by default: the server has no authentication or TLS, so
    /// any other address is served with a warning (put it behind a trusted network). Port 0
    /// picks a free port; the address bound is printed on stdout.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// Where a bundle of petite's engines runs: `cpu` (the reference executor) or `cuda`.
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: petite::runtimes::Device,
    /// tokenizer.json (default: $PETITE_TOKENIZER, else the Hugging Face cache's snapshot of
    /// the bundle's tokenizer id).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Python for a portable bundle (executorch-numpy-runtime) or an ONNX one (onnxruntime).
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// Act calls that may wait while one chunk runs; one more is refused at once with
    /// RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 8)]
    pub queue: usize,
    /// The largest request accepted, in MiB (a larger one is refused with OUT_OF_RANGE before
    /// it is read into memory).
    #[arg(long = "max-message", value_name = "MIB", default_value_t = 64)]
    pub max_message_mib: usize,
    /// Seed of the policy's noise generator, for calls that send neither noise nor a seed
    /// (default: from the clock, so every run draws differently).
    #[arg(long)]
    pub seed: Option<u64>,
}

/// Runs `petite serve`.
pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    a.device.check()?;
    if a.max_message_mib == 0 || a.max_message_mib > 4095 {
        return Err(petite::Error::Usage(format!(
            "--max-message {}: expected 1 to 4095 MiB (gRPC's frame length is 32 bits)",
            a.max_message_mib
        ))
        .into());
    }
    if !a.listen.ip().is_loopback() {
        eprintln!(
            "petite serve: warning: listening on {} (not loopback): anyone who can reach it can run the policy; there is no authentication or TLS",
            a.listen
        );
    }
    let policy = Policy::open(
        &a.dir,
        &OpenOptions {
            device: a.device,
            tokenizer: a.tokenizer.clone(),
            python: a.python.clone(),
            seed: a.seed,
            // The server admits `queue + 1` calls (one running): the policy's own queue holds
            // them all, so the server's bound is the one that refuses.
            queue: a.queue + 1,
        },
    )
    .with_context(|| format!("opening {}", a.dir.display()))?;
    let info = policy.info().clone();
    let policy = Arc::new(policy);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("petite-serve")
        .build()
        .context("starting the server's runtime")?;
    rt.block_on(async {
        // Before the address is printed: whoever reads it may signal at once.
        let stop = petite_serve::termination()?;
        let server = petite_serve::Server::start(
            policy.clone(),
            &petite_serve::Options {
                listen: a.listen,
                max_message_bytes: a.max_message_mib << 20,
                queue: a.queue,
            },
        )
        .await?;
        println!(
            "petite serve: listening on {} ({} on {}, cameras {}, state {}, actions [{}, {}], queue {}, max message {} MiB)",
            server.local_addr(),
            info.export_id,
            info.device.name(),
            info.cameras
                .iter()
                .filter(|c| !c.1)
                .map(|c| c.0.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            info.state_dim,
            info.chunk,
            info.action_dim,
            a.queue,
            a.max_message_mib
        );
        server
            .run_until(async {
                let name = stop.await;
                eprintln!("petite serve: {name}: finishing the calls in flight, then stopping");
            })
            .await?;
        anyhow::Ok(())
    })?;
    // Chunks whose clients gave up finish before the runtime is gone; then the policy's
    // thread stops.
    drop(rt);
    eprintln!("petite serve: stopped");
    Ok(())
}
