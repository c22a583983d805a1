//! `cargo xtask bench convert`: `petite convert` on the full-size synthetic pi0.5 checkpoint
//! (f32, shapes from `pi05-tensors.tsv`, 15.4 GiB) to bf16 under `memcap --limit 256MiB
//! --drop-caches`, against the machine's floor measured in the same run: reading the source once
//! (`cat SRC >/dev/null`) plus writing the output once (`dd` of the output's size, fsynced).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::util::memcap_run as memcap;
use anyhow::{Context, Result, bail};
use petite_weights::{Dtype, MappedSafetensors, SafetensorsWriter, TensorSpec, WeightSource};

/// Options of the conversion benchmark.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Tensor table (name, shape, dtype per line); the checkpoint stores every tensor as f32.
    /// Default: the repository's copy of pi0.5's 813-tensor table.
    #[arg(long)]
    pub tsv: Option<PathBuf>,
    /// Use only the first N tensors of the table (a quick run; the default is all of them).
    #[arg(long)]
    pub tensors: Option<usize>,
    /// Memory cap for the conversion.
    #[arg(long, default_value = "256MiB")]
    pub limit: String,
    /// Keep the generated checkpoint and output (default: deleted after measuring).
    #[arg(long)]
    pub keep_files: bool,
}

/// Reads the tensor table: `name<TAB>[d0,d1,...]<TAB>dtype`.
fn table(tsv: &Path, limit: Option<usize>) -> Result<Vec<TensorSpec>> {
    let text =
        std::fs::read_to_string(tsv).with_context(|| format!("reading {}", tsv.display()))?;
    let mut out = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let mut f = line.split('\t');
        let (Some(name), Some(shape)) = (f.next(), f.next()) else {
            bail!("{}:{}: expected name, shape, dtype", tsv.display(), i + 1);
        };
        let shape: Vec<usize> = shape
            .trim_matches(|c| c == '[' || c == ']')
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.trim().parse())
            .collect::<Result<_, _>>()
            .with_context(|| format!("{}:{}: bad shape", tsv.display(), i + 1))?;
        out.push(TensorSpec::new(name, Dtype::F32, &shape));
    }
    if let Some(n) = limit {
        out.truncate(n);
    }
    Ok(out)
}

/// Deterministic f32 fill: random sign and mantissa, exponents around 2^-6..2^1, so rounding
/// to bf16 exercises ties and carries.
fn fill(buf: &mut [u8], seed: u64) {
    let mut x = (seed as u32).wrapping_mul(2_654_435_761) | 1;
    for c in buf.chunks_exact_mut(4) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let bits = (x & 0x807f_ffff) | ((0x79 + (x >> 28) % 8) << 23);
        c.copy_from_slice(&bits.to_le_bytes());
    }
}

fn generate(path: &Path, table: &[TensorSpec]) -> Result<()> {
    let w = SafetensorsWriter::create(path, table, &[("format".into(), "pt".into())])?;
    // One 8 MiB block of random values, repeated with a per-tensor rotation: generation stays
    // disk-bound even in an unoptimised xtask build.
    const BLOCK: usize = 8 << 20;
    let mut block = vec![0u8; 2 * BLOCK];
    fill(&mut block[..BLOCK], 1);
    block.copy_within(..BLOCK, BLOCK);
    let order: Vec<String> = w.order().iter().map(|s| s.to_string()).collect();
    for (k, name) in order.iter().enumerate() {
        let mut sink = w.tensor(name)?;
        let mut left = sink.remaining() as usize;
        let start = (k * 4099 * 4) % BLOCK;
        while left > 0 {
            let n = left.min(BLOCK);
            sink.write_all(&block[start..start + n])?;
            left -= n;
        }
        sink.finish()?;
    }
    w.finish()?;
    Ok(())
}

/// Checks a sample of the output against the source: shapes, and bf16 bits of the first and last
/// elements of every tensor equal round-to-nearest-even of the f32 source.
fn verify(src: &Path, out: &Path, dropped: &[String]) -> Result<()> {
    let s = MappedSafetensors::open(src)?;
    let o = MappedSafetensors::open(out)?;
    let want: Vec<String> = s
        .names()
        .into_iter()
        .filter(|n| !dropped.contains(n))
        .collect();
    if o.names() != want {
        bail!(
            "output holds {} tensors, expected {}",
            o.names().len(),
            want.len()
        );
    }
    for n in &want {
        let (a, b) = (s.tensor(n)?, o.tensor(n)?);
        if a.shape != b.shape || b.dtype != Dtype::Bf16 {
            bail!(
                "`{n}`: {:?} {:?} became {:?} {:?}",
                a.dtype,
                a.shape,
                b.dtype,
                b.shape
            );
        }
        let numel = a.numel();
        for i in [0, numel / 2, numel.saturating_sub(1)]
            .into_iter()
            .filter(|&i| i < numel)
        {
            let x = f32::from_le_bytes(a.bytes[4 * i..4 * i + 4].try_into()?);
            let y = u16::from_le_bytes(b.bytes[2 * i..2 * i + 2].try_into()?);
            if y != petite_dtype::bf16_bits(x) {
                bail!(
                    "`{n}`[{i}]: {x} → {y:#06x}, expected {:#06x}",
                    petite_dtype::bf16_bits(x)
                );
            }
        }
        s.release(&[n])?;
        o.release(&[n])?;
    }
    Ok(())
}

/// Runs the benchmark.
pub fn run(a: &Args) -> Result<()> {
    let root = crate::util::root();
    let petite = crate::util::release_petite()?;
    let dir = root.join("target").join("bench-convert");
    std::fs::create_dir_all(&dir)?;
    let src = dir.join("pi05-f32.safetensors");
    let out = dir.join("pi05-bf16.safetensors");
    let floor_out = dir.join("floor.bin");
    let json = dir.join("memcap.json");

    let tsv = a.tsv.clone().unwrap_or_else(|| {
        crate::util::root().join("crates/petite-pi05/tests/data/pi05-tensors.tsv")
    });
    let table = table(&tsv, a.tensors)?;
    let dropped: Vec<String> = table
        .iter()
        .filter(|t| t.name.ends_with("lm_head.weight"))
        .map(|t| t.name.clone())
        .collect();
    eprintln!(
        "bench convert: generating {} f32 tensors at {}",
        table.len(),
        src.display()
    );
    let t = std::time::Instant::now();
    generate(&src, &table)?;
    let src_len = std::fs::metadata(&src)?.len();
    eprintln!(
        "bench convert: {:.2} GiB written in {:.1} s",
        src_len as f64 / (1u64 << 30) as f64,
        t.elapsed().as_secs_f64()
    );

    let result = (|| -> Result<()> {
        let mut conv = Command::new(&petite);
        conv.arg("convert")
            .arg("--checkpoint")
            .arg(&src)
            .arg("--out")
            .arg(&out)
            .arg("--dtype")
            .arg("bf16");
        if !dropped.is_empty() {
            conv.arg("--drop").arg(dropped.join(","));
        }
        let c = memcap(&["--limit", &a.limit, "--drop-caches"], &conv, &json)?;
        let out_len = std::fs::metadata(&out)?.len();

        // The floor, same run, same cold cache: read the source once (the header and every
        // tensor convert reads: dropped tensors are not read, so `dd` the kept byte ranges; with
        // nothing dropped this is `cat SRC`), write the output's size once.
        let m = MappedSafetensors::open(&src)?;
        let mut ranges = Vec::new();
        ranges.push(0..m.header().data_start);
        let mut kept: Vec<_> = m
            .names()
            .into_iter()
            .filter(|n| !dropped.contains(n))
            .map(|n| m.file_range(&n))
            .collect::<Result<_, _>>()?;
        kept.sort_by_key(|r| r.start);
        for r in kept {
            let last = ranges.last_mut().expect("non-empty");
            // Padding and small tensors between kept ones are read too (at most a page each).
            if r.start <= last.end + (1 << 20) {
                last.end = last.end.max(r.end);
            } else {
                ranges.push(r);
            }
        }
        drop(m);
        let read_script: Vec<String> = ranges
            .iter()
            .map(|r| {
                format!(
                    "dd if='{}' of=/dev/null bs=8M iflag=skip_bytes,count_bytes skip={} count={} status=none",
                    src.display(),
                    r.start,
                    r.len()
                )
            })
            .collect();
        let r = memcap(
            &["--drop-caches"],
            Command::new("sh").arg("-c").arg(read_script.join(" && ")),
            &json,
        )?;
        let mib = 8u64 << 20;
        let w = memcap(
            &["--drop-caches"],
            Command::new("dd")
                .arg("if=/dev/zero")
                .arg(format!("of={}", floor_out.display()))
                .arg("bs=8M")
                .arg(format!("count={}", out_len.div_ceil(mib)))
                .arg("conv=fsync")
                .arg("status=none"),
            &json,
        )?;
        let _ = std::fs::remove_file(&floor_out);
        verify(&src, &out, &dropped)?;

        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let floor = r.wall_s + w.wall_s;
        println!(
            "bench convert ({} tensors, {} dropped)",
            table.len(),
            dropped.len()
        );
        println!(
            "  source {:.2} GiB f32 -> output {:.2} GiB bf16",
            gib(src_len),
            gib(out_len)
        );
        println!(
            "  convert: {:.1} s, peak RSS {:.1} MiB, peak cgroup {:.1} MiB (limit {})",
            c.wall_s,
            c.peak_rss as f64 / (1u64 << 20) as f64,
            c.peak_cgroup as f64 / (1u64 << 20) as f64,
            a.limit
        );
        println!(
            "  floor: read source ({} ranges) {:.1} s + dd output size (fsync) {:.1} s = {:.1} s",
            ranges.len(),
            r.wall_s,
            w.wall_s,
            floor
        );
        println!(
            "  throughput ratio (floor / convert): {:.2}",
            floor / c.wall_s
        );
        println!("  output verified: every tensor's shape, dtype and sampled bf16 bits");
        Ok(())
    })();
    if !a.keep_files {
        let _ = std::fs::remove_file(&src);
        let _ = std::fs::remove_file(&out);
    }
    let _ = std::fs::remove_file(&floor_out);
    result
}
