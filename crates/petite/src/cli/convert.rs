//! `petite convert`: a checkpoint (single file, sharded index or directory) → a bf16/f16
//! safetensors mapping file, streamed in bounded memory.
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use petite_weights::{Checkpoint, ConvertOptions, Selection, TargetDtype, convert};

/// Target float dtype on the command line.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum DtypeArg {
    /// bfloat16 (round-to-nearest-even, like PyTorch's `.to(torch.bfloat16)`).
    Bf16,
    /// IEEE float16.
    F16,
}

/// Arguments of `petite convert`.
#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// Source checkpoint: a .safetensors file, a model.safetensors.index.json, or a directory.
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Output safetensors file (written to a temporary name, fsynced, renamed).
    #[arg(long)]
    pub out: PathBuf,
    /// Float dtype of the output; other dtypes are copied unchanged.
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: DtypeArg,
    /// Only these tensors (comma-separated; `prefix*` matches a prefix).
    #[arg(long, value_delimiter = ',', conflicts_with = "drop")]
    pub keep: Vec<String>,
    /// All tensors but these (comma-separated; `prefix*` matches a prefix).
    #[arg(long, value_delimiter = ',')]
    pub drop: Vec<String>,
    /// Worker threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Source bytes per work item, e.g. 8MiB (memory is a few of these per thread).
    #[arg(long, default_value = "8MiB", value_parser = petite::memory::parse_size)]
    pub chunk: u64,
}

/// Runs `petite convert`.
pub fn run(a: ConvertArgs) -> anyhow::Result<()> {
    let src = Checkpoint::open(&a.checkpoint)?;
    petite::guard::stop_point("convert-cli");
    let selection = if !a.keep.is_empty() {
        Selection::Keep(a.keep)
    } else if !a.drop.is_empty() {
        Selection::Drop(a.drop)
    } else {
        Selection::All
    };
    let opts = ConvertOptions {
        dtype: match a.dtype {
            DtypeArg::Bf16 => TargetDtype::Bf16,
            DtypeArg::F16 => TargetDtype::F16,
        },
        selection,
        chunk_bytes: usize::try_from(a.chunk.max(1)).unwrap_or(usize::MAX),
        threads: a.threads.max(1),
        progress: progress_line(),
        metadata: vec![("petite.source".into(), a.checkpoint.display().to_string())],
        dtypes: Default::default(),
        seal: false,
    };
    let r = convert(&src, &a.out, &opts)
        .with_context(|| format!("converting {}", a.checkpoint.display()))?;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    eprintln!(
        "convert: {} tensors ({} dropped), {:.2} GiB read, {:.2} GiB written to {} in {:.1} s ({:.0} MiB/s read)",
        r.tensors,
        r.dropped.len(),
        gib(r.bytes_read),
        gib(r.bytes_written),
        a.out.display(),
        r.seconds,
        r.bytes_read as f64 / (1u64 << 20) as f64 / r.seconds.max(1e-9)
    );
    Ok(())
}

/// A byte progress bar on stderr when it is a terminal (nothing otherwise), drawn by indicatif
/// like the export's: `convert [=====>    ] 3.10 GiB/15.44 GiB 1.02 GiB/s ETA 12s`.
fn progress_line() -> Option<petite_weights::Progress> {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let pb = indicatif::ProgressBar::new(0);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{prefix:>10} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_prefix("convert");
    Some(petite_weights::Progress::new(move |done, total| {
        pb.set_length(total);
        pb.set_position(done);
        if done >= total {
            pb.finish();
        }
    }))
}
