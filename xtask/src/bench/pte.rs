//! `cargo xtask bench pte`: writes a `.pte` whose delegates' data (≥ 4 GiB over several
//! named-data segments, from generated engine files) streams in from disk, under
//! `memcap --limit 64MiB --drop-caches`, and compares its wall time with `cp` of the same source
//! bytes under the same cap in the same run. Then reads the > 4 GiB file back (64-bit offsets) and
//! compares every segment byte. All big files are deleted at the end.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::util;

/// Timed runs of each command.
const ROUNDS: usize = 3;

/// Options of the pte benchmark.
#[derive(clap::Args)]
pub struct Args {
    /// Number of engine files.
    #[arg(long, default_value_t = 5)]
    pub engines: u64,
    /// Bytes per engine file (default 900 MiB: 4.39 GiB in total).
    #[arg(long, default_value_t = 900 << 20)]
    pub engine_bytes: u64,
    /// Memory cap for the writer and for `cp`.
    #[arg(long, default_value = "64MiB")]
    pub limit: String,
    /// Keep the big files (for inspection).
    #[arg(long)]
    pub keep: bool,
}

fn memcap(limit: &str, json: &Path, cmd: &[&std::ffi::OsStr]) -> Result<crate::util::MemcapRun> {
    let mut c = Command::new(cmd[0]);
    c.args(&cmd[1..]);
    crate::util::memcap_run(&["--limit", limit, "--drop-caches"], &c, json)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// Runs the benchmark.
pub fn run(a: &Args) -> Result<()> {
    util::cargo(&[
        "build",
        "--release",
        "-p",
        "petite-pte",
        "--example",
        "pte_bench",
    ])?;
    let bin = util::target_dir()
        .join("release")
        .join("examples")
        .join("pte_bench");
    let work = util::root().join("target").join("bench-pte");
    if work.exists() {
        std::fs::remove_dir_all(&work)?;
    }
    let src = work.join("engines");
    let cp_dir = work.join("cp");
    std::fs::create_dir_all(&cp_dir)?;
    let result = (|| -> Result<()> {
        let total = a.engines * a.engine_bytes;
        eprintln!(
            "bench pte: generating {} engine files, {:.2} GiB in total",
            a.engines,
            total as f64 / (1u64 << 30) as f64
        );
        util::run(
            Command::new(&bin)
                .arg("gen")
                .arg(&src)
                .arg(a.engines.to_string())
                .arg(a.engine_bytes.to_string()),
        )?;
        let srcs: Vec<PathBuf> = (0..a.engines)
            .map(|i| src.join(format!("engine-{i}.plan")))
            .collect();
        let out = work.join("big.pte");
        let json = work.join("memcap.json");

        // Alternating rounds (cp, petite) x ROUNDS, each output deleted outside the timed
        // command, medians compared: the disk is shared, so single runs drift.
        let cp_cmd = || -> Result<crate::util::MemcapRun> {
            let mut c: Vec<&std::ffi::OsStr> = vec!["cp".as_ref()];
            c.extend(srcs.iter().map(|p| p.as_os_str()));
            c.push(cp_dir.as_os_str());
            let m = memcap(&a.limit, &json, &c)?;
            for p in std::fs::read_dir(&cp_dir)? {
                std::fs::remove_file(p?.path())?;
            }
            Ok(m)
        };
        let petite_cmd = |keep: bool| -> Result<crate::util::MemcapRun> {
            let mut w: Vec<&std::ffi::OsStr> =
                vec![bin.as_os_str(), "write".as_ref(), out.as_os_str()];
            w.extend(srcs.iter().map(|p| p.as_os_str()));
            let m = memcap(&a.limit, &json, &w)?;
            if !keep {
                std::fs::remove_file(&out)?;
            }
            Ok(m)
        };
        let (mut cps, mut pws) = (Vec::new(), Vec::new());
        for round in 0..ROUNDS {
            cps.push(cp_cmd()?);
            pws.push(petite_cmd(round + 1 == ROUNDS)?);
        }
        let median = |v: &[crate::util::MemcapRun]| {
            let mut t: Vec<f64> = v.iter().map(|m| m.wall_s).collect();
            t.sort_by(f64::total_cmp);
            t[t.len() / 2]
        };
        let times = |v: &[crate::util::MemcapRun]| {
            v.iter()
                .map(|m| format!("{:.2}", m.wall_s))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (cp_med, pw_med) = (median(&cps), median(&pws));
        let pw = pws.last().expect("ROUNDS > 0");
        let max_rss =
            |v: &[crate::util::MemcapRun]| v.iter().map(|m| m.peak_rss).max().unwrap_or(0);
        let max_cg =
            |v: &[crate::util::MemcapRun]| v.iter().map(|m| m.peak_cgroup).max().unwrap_or(0);
        let file_len = std::fs::metadata(&out)?.len();
        let n = a.engines.to_string();
        let bytes = a.engine_bytes.to_string();
        let rv = memcap(
            &a.limit,
            &json,
            &[
                bin.as_os_str(),
                "verify".as_ref(),
                out.as_os_str(),
                n.as_ref(),
                bytes.as_ref(),
            ],
        )?;
        println!(
            "bench pte: {} bytes of engine data in {} named-data segments, file {file_len} bytes",
            total, a.engines
        );
        println!(
            "  petite write ({ROUNDS} runs): {} s (median {pw_med:.2} s, {:.0} MB/s), memcap peak RSS {:.1} MiB, cgroup peak {:.1} MiB (limit {}); last run: {}",
            times(&pws),
            total as f64 / pw_med / 1e6,
            mib(max_rss(&pws)),
            mib(max_cg(&pws)),
            a.limit,
            pw.stdout.trim()
        );
        println!(
            "  cp of the same files, same cap ({ROUNDS} runs, alternating): {} s (median {cp_med:.2} s), memcap peak RSS {:.1} MiB",
            times(&cps),
            mib(max_rss(&cps))
        );
        println!(
            "  throughput ratio petite/cp (medians): {:.3}",
            cp_med / pw_med
        );
        println!(
            "  read-back: {:.2} s, peak RSS {:.1} MiB; {}",
            rv.wall_s,
            mib(rv.peak_rss),
            rv.stdout.trim()
        );
        Ok(())
    })();
    if !a.keep {
        std::fs::remove_dir_all(&work).with_context(|| format!("removing {}", work.display()))?;
    }
    result
}
