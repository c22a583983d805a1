//! `cargo xtask bench synth`: `petite pi05 synth` writing the full-size (real config) pi0.5
//! checkpoint under `memcap --limit 512MiB --drop-caches`, against the disk's floor measured just
//! before in the same run: `dd` of the checkpoint's data bytes from /dev/zero, fsynced, under the
//! same cap. The output is checked (tensor count, every tensor f32, data bytes) and deleted unless
//! `--keep DIR` asks to keep it.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::util::memcap_run as memcap;
use anyhow::{Context, Result, bail};
use petite_weights::{Dtype, MappedSafetensors, WeightSource};

/// Options of the synthetic-checkpoint benchmark.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Key layout to write (`lerobot`: 813 tensors; `hub`: 812).
    #[arg(long, default_value = "lerobot")]
    pub layout: String,
    /// Memory cap for both the synth run and the dd floor.
    #[arg(long, default_value = "512MiB")]
    pub limit: String,
    /// Generator threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the checkpoint into DIR and keep it (default: a scratch dir under target/, deleted).
    #[arg(long, value_name = "DIR")]
    pub keep: Option<PathBuf>,
}

/// Tensor count and f32 data bytes of the real pi0.5 per layout (pi05-model.md §7).
fn expected(layout: &str) -> Result<(usize, u64)> {
    match layout {
        "lerobot" => Ok((813, 16_573_619_264)),
        "hub" | "hub-prefixed" => Ok((812, 14_467_030_080)),
        other => bail!("--layout: expected lerobot, hub or hub-prefixed, found `{other}`"),
    }
}

/// Checks the written file: tensor count, every tensor f32, total data bytes.
fn verify(path: &Path, layout: &str) -> Result<()> {
    let (count, bytes) = expected(layout)?;
    let m = MappedSafetensors::open(path)?;
    let names = m.names();
    if names.len() != count {
        bail!(
            "{}: {} tensors, expected {count}",
            path.display(),
            names.len()
        );
    }
    let mut total = 0u64;
    for n in &names {
        let info = m.info(n)?;
        if info.dtype != Dtype::F32 {
            bail!("`{n}`: {:?}, expected F32", info.dtype);
        }
        total += info.shape.iter().product::<usize>() as u64 * 4;
    }
    if total != bytes {
        bail!("{}: {total} data bytes, expected {bytes}", path.display());
    }
    Ok(())
}

/// Runs the benchmark.
pub fn run(a: &Args) -> Result<()> {
    expected(&a.layout)?;
    let root = crate::util::root();
    let petite = crate::util::release_petite()?;
    let scratch = root.join("target").join("bench-synth");
    std::fs::create_dir_all(&scratch)?;
    let out_dir = a.keep.clone().unwrap_or_else(|| scratch.join("out"));
    let out = out_dir.join("model.safetensors");
    let floor_out = scratch.join("floor.bin");
    let json = scratch.join("memcap.json");
    let cap = ["--limit", a.limit.as_str(), "--drop-caches"];

    let result = (|| -> Result<()> {
        // The floor first (so the disk never holds both files): the checkpoint's data bytes from
        // /dev/zero, fsynced, same cap, cold cache. Rates are compared, so the output's extra
        // header and alignment bytes (< 0.01%) do not skew the ratio.
        let (_, data_bytes) = expected(&a.layout)?;
        let d = memcap(
            &cap,
            Command::new("dd")
                .arg("if=/dev/zero")
                .arg(format!("of={}", floor_out.display()))
                .args(["bs=4M", "iflag=count_bytes", "conv=fsync", "status=none"])
                .arg(format!("count={data_bytes}")),
            &json,
        )?;
        let floor_len = std::fs::metadata(&floor_out)?.len();
        let _ = std::fs::remove_file(&floor_out);
        if floor_len != data_bytes {
            bail!("dd wrote {floor_len} bytes, expected {data_bytes}");
        }
        let s = memcap(
            &cap,
            Command::new(&petite)
                .args(["pi05", "synth", "--layout", &a.layout, "--out"])
                .arg(&out_dir)
                .args(["--seed", &a.seed.to_string()])
                .args(["--threads", &a.threads.to_string()]),
            &json,
        )?;
        let len = std::fs::metadata(&out)
            .with_context(|| format!("{}", out.display()))?
            .len();
        verify(&out, &a.layout)?;

        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        println!(
            "bench synth: full-size pi0.5, layout {}, {} threads, file {:.2} GiB ({len} bytes)",
            a.layout,
            a.threads,
            gib(len)
        );
        println!(
            "  synth: {:.1} s ({:.3} GiB/s), peak cgroup {:.1} MiB, peak RSS {:.1} MiB (limit {})",
            s.wall_s,
            gib(len) / s.wall_s,
            mib(s.peak_cgroup),
            mib(s.peak_rss),
            a.limit
        );
        let (rs, rd) = (gib(len) / s.wall_s, gib(data_bytes) / d.wall_s);
        println!(
            "  floor: dd if=/dev/zero bs=4M conv=fsync of the {data_bytes} data bytes: {:.1} s ({rd:.3} GiB/s), peak cgroup {:.1} MiB",
            d.wall_s,
            mib(d.peak_cgroup)
        );
        println!("  write-rate ratio (synth / dd floor): {:.2}", rs / rd);
        println!("  output verified: tensor count, every tensor F32, data bytes");
        match &a.keep {
            Some(_) => println!("  kept: {}", out.display()),
            None => println!("  deleted: {}", out.display()),
        }
        Ok(())
    })();
    let _ = std::fs::remove_file(&floor_out);
    if a.keep.is_none() {
        let _ = std::fs::remove_dir_all(scratch.join("out"));
    }
    result
}
