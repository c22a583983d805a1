//! `petite plan`: partition a pi0.5 program into engines under a per-engine weight cap and print
//! the plan (a table, or the plan's JSON). Shapes only: no checkpoint is read.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Args, ValueEnum};
use petite::memory::parse_size;
use petite_graph::Program;
use petite_partition::{
    DEFAULT_CROSSING_LIMIT, DEFAULT_ENGINE_OVERHEAD, PartitionOptions, Plan, plan,
};
use petite_pi05::{
    DEFAULT_EMBEDDING_SHARD_BYTES, Pi05Config, Precision, PrefixOptions, build_prefix_with,
    build_step,
};

/// Which pi0.5 program to plan.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum ProgramArg {
    /// Images and tokens → per-layer K/V.
    Prefix,
    /// One denoising step of the action expert.
    Step,
}

/// Arguments of `petite plan`.
#[derive(Args, Debug)]
pub struct PlanArgs {
    /// pi0.5 config JSON (sizes only; default: the real pi0.5).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The program to plan.
    #[arg(long, value_enum)]
    pub program: ProgramArg,
    /// Maximum weight bytes per engine, e.g. 512MiB, 1GiB, 268435456.
    #[arg(long, default_value = "512MiB", value_parser = parse_size)]
    pub engine_cap: u64,
    /// Other input-only values above this are recomputed in each engine that reads them;
    /// smaller ones cross between engines.
    #[arg(long, default_value_t = DEFAULT_CROSSING_LIMIT, value_parser = parse_size)]
    pub crossing_limit: u64,
    /// Let masks and rotary tables cross like other values when they are at most
    /// --crossing-limit (by default they are always recomputed in each engine that reads them).
    #[arg(long)]
    pub let_tables_cross: bool,
    /// Crossing bytes one more engine is worth (trades engine count for cheap cuts).
    #[arg(long, default_value_t = DEFAULT_ENGINE_OVERHEAD, value_parser = parse_size)]
    pub engine_overhead: u64,
    /// Numeric mode: bf16 or f32. Default bf16, as `petite export`'s: a plan shows what an
    /// export of the same settings builds.
    #[arg(long, value_enum, default_value = "bf16", alias = "precision")]
    pub dtype: super::PrecisionArg,
    /// Prefix only: largest row shard of the token embedding (a larger table is read as row
    /// ranges, so no engine holds all of it; pass a size above the table to keep it whole).
    #[arg(long, default_value_t = DEFAULT_EMBEDDING_SHARD_BYTES as u64, value_parser = parse_size)]
    pub embedding_shard: u64,
    /// Print the plan as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Runs `petite plan`.
pub fn run(a: PlanArgs) -> anyhow::Result<()> {
    let cfg = match &a.config {
        Some(path) => Pi05Config::from_json_file(path)?,
        None => Pi05Config::default(),
    };
    let precision = Precision::from(a.dtype);
    let (name, program) = match a.program {
        ProgramArg::Prefix => (
            "prefix",
            build_prefix_with(
                &cfg,
                precision,
                &PrefixOptions {
                    max_embedding_shard_bytes: usize::try_from(a.embedding_shard)
                        .unwrap_or(usize::MAX),
                },
            ),
        ),
        ProgramArg::Step => ("step", build_step(&cfg, precision)),
    };
    let program = program.with_context(|| format!("building the {name} program"))?;
    let mut opts = PartitionOptions::new(a.engine_cap)
        .crossing_limit(a.crossing_limit)
        .recompute_positional(!a.let_tables_cross);
    opts.engine_overhead = a.engine_overhead;
    let t0 = Instant::now();
    let plan = plan(&program, &opts).with_context(|| format!("planning the {name} program"))?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    if a.json {
        println!("{}", plan.to_json()?);
    } else {
        print_table(name, &program, &plan);
    }
    eprintln!("planned in {ms:.1} ms");
    Ok(())
}

fn mib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1u64 << 20) as f64)
}

fn print_table(name: &str, p: &Program, plan: &Plan) {
    println!(
        "{name}: {} nodes, {} MiB of weights in {} engines (cap {} MiB, crossing limit {} KiB)",
        p.len(),
        mib(plan.weight_bytes),
        plan.engines.len(),
        mib(plan.engine_cap),
        plan.crossing_limit / 1024
    );
    println!(
        "{:>4} {:>6} {:>6} {:>10} {:>10} {:>9} {:>9}  span / recomputed",
        "eng", "nodes", "recomp", "weight MiB", "build MiB", "in MiB", "out MiB"
    );
    for e in &plan.engines {
        let span = match (&e.first_label, &e.last_label) {
            (Some(f), Some(l)) if f == l => f.clone(),
            (Some(f), Some(l)) => format!("{f} .. {l}"),
            _ => String::new(),
        };
        println!(
            "{:>4} {:>6} {:>6} {:>10} {:>10} {:>9} {:>9}  {span}{}",
            e.index,
            e.nodes.len(),
            e.recomputed.len(),
            mib(e.weight_bytes),
            mib(e.build_bytes),
            mib(e.input_bytes),
            mib(e.output_bytes),
            if e.over_cap {
                "  [OVER CAP: one atomic group larger than the cap alone]"
            } else {
                ""
            }
        );
        if !e.recomputed_values.is_empty() {
            let vals: Vec<String> = e
                .recomputed_values
                .iter()
                .map(|&v| format!("{} {}", p.describe(v), p.node(v).ty))
                .collect();
            println!("{:>58}recomputes {}", "", vals.join(", "));
        }
    }
    println!("boundaries (bytes crossing each cut):");
    for b in &plan.boundaries {
        let vals: Vec<String> = b
            .values
            .iter()
            .map(|&v| format!("{} {}", p.describe(v), p.node(v).ty))
            .collect();
        println!(
            "  after {:>3}: {:>10} bytes ({} MiB): {}",
            b.after,
            b.bytes,
            mib(b.bytes),
            vals.join(", ")
        );
    }
    let max = plan
        .engines
        .iter()
        .map(|e| e.weight_bytes)
        .max()
        .unwrap_or(0);
    let total: u64 = plan.boundaries.iter().map(|b| b.bytes).sum();
    println!(
        "largest engine {} MiB; {} over the cap; {} MiB crossing in total",
        mib(max),
        plan.engines.iter().filter(|e| e.over_cap).count(),
        mib(total)
    );
}
