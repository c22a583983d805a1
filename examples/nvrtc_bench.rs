//! NVRTC's time for what a cold run of pi0.5 on a GPU compiles (`cargo xtask bench nvrtc` runs
//! this with libnvrtc from PyPI; no GPU needed): the distinct kernel sources a full-size
//! `petite pi05 run --device cuda --dtype bf16` and a full-size `petite verify --device cuda` of
//! a bf16 export (its engines at the default 512 MiB cap, then the f32 reference) hand NVRTC
//! when no kernel cache holds them — the fixed module, each program's fused kernels, the fused
//! attention's module — under three plans, alternating a round at a time:
//!
//! - `before`: slice starts baked in as literals and the attention kernels compiled with each
//!   program that fuses one (petite before session 25);
//! - `now`: the defaults (starts as kernel parameters, one attention module a process, unrolled
//!   row loops);
//! - `rolled`: `now` with the rolled row loops (the default before issue 49).
//!
//! Usage: `nvrtc_bench [--arch sm_90|sm_87] [--rounds N]`.

use std::collections::BTreeSet;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use petite_cuda::fuse::{self, Options};
use petite_graph::Program;
use petite_pi05::{Pi05Config, Precision};

/// How a program's fused kernels reach NVRTC.
#[derive(Clone, Copy, PartialEq)]
enum Plan {
    Before,
    Now,
    Rolled,
}

impl Plan {
    fn name(self) -> &'static str {
        match self {
            Plan::Before => "before",
            Plan::Now => "now",
            Plan::Rolled => "rolled",
        }
    }
}

/// The sources NVRTC compiles for `p` under `plan` on a device of compute capability `cc`.
fn sources(p: &Program, plan: Plan, cc: (i32, i32), out: &mut BTreeSet<String>) -> Result<()> {
    let base = Options::new(fuse::fused_attention_queries(cc));
    let o = match plan {
        Plan::Before => Options {
            offset_params: false,
            ..base
        },
        Plan::Now => base,
        Plan::Rolled => Options {
            unrolled_rows: false,
            ..base
        },
    };
    let f = fuse::plan_program(p, o)?;
    let attention = petite_cuda::source::attention_module_source();
    let attention_kernels = &attention[petite_cuda::source::fused_prelude().len()..];
    let own = f.attention_kernels.map_or(f.kernels.len(), |[a, ..]| a);
    match (plan, f.attention_kernels.is_some()) {
        (Plan::Before, true) => {
            out.insert(format!("{}{attention_kernels}", f.source));
        }
        (_, with) => {
            if own > 0 {
                out.insert(f.source.clone());
            }
            if with {
                out.insert(attention.clone());
            }
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut arch = "sm_90".to_string();
    let mut rounds = 3usize;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--arch" => arch = it.next().context("--arch needs a value")?.clone(),
            "--rounds" => rounds = it.next().context("--rounds needs a value")?.parse()?,
            other => bail!("unknown argument {other:?} (--arch sm_90|sm_87, --rounds N)"),
        }
    }
    let cc = match arch.as_str() {
        "sm_90" => (9, 0),
        "sm_87" => (8, 7),
        other => bail!("--arch {other:?}: sm_90 or sm_87"),
    };
    if rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let cfg = Pi05Config::default();
    let bf16 = petite_pi05::build_all(&cfg, Precision::Bf16)?;
    let f32 = petite_pi05::build_all(&cfg, Precision::F32)?;
    // The export's engines, as `petite export` cuts them by default.
    let popts = petite_partition::PartitionOptions::new(petite::export::DEFAULT_ENGINE_CAP);
    let mut engines = Vec::new();
    for p in [&bf16.prefix, &bf16.step] {
        let plan = petite_partition::plan(p, &popts)?;
        for i in 0..plan.engines.len() {
            engines.push(plan.engine_program(p, i)?.program);
        }
    }
    let module = petite_cuda::source::module_source();
    let plans = [Plan::Before, Plan::Now, Plan::Rolled];
    // Per set and plan: the distinct sources.
    let mut sets: Vec<(&str, Vec<Vec<String>>)> = Vec::new();
    for (name, programs) in [
        (
            "pi05 run --dtype bf16",
            vec![&bf16.timestep_table, &bf16.prefix, &bf16.step],
        ),
        (
            "verify (bf16 export)",
            engines
                .iter()
                .chain([&f32.timestep_table, &f32.prefix, &f32.step])
                .collect(),
        ),
    ] {
        let mut by_plan = Vec::new();
        for &plan in &plans {
            let mut s = BTreeSet::from([module.clone()]);
            for p in &programs {
                sources(p, plan, cc, &mut s)?;
            }
            by_plan.push(s.into_iter().collect());
        }
        sets.push((name, by_plan));
    }
    println!(
        "nvrtc bench: {arch}, {} engines in the export, {rounds} rounds",
        engines.len()
    );
    // seconds[set][plan][round], bytes[set][plan]
    let mut seconds = vec![vec![Vec::new(); plans.len()]; sets.len()];
    let mut bytes = vec![vec![0usize; plans.len()]; sets.len()];
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..plans.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for (si, (name, by_plan)) in sets.iter().enumerate() {
            for &pi in &order {
                let t0 = Instant::now();
                let mut b = 0;
                for src in &by_plan[pi] {
                    b += petite_cuda::compile_machine_code(cc, src)?.len();
                }
                let s = t0.elapsed().as_secs_f64();
                println!(
                    "nvrtc bench: round {round} {name} {}: {} sources, {s:.2} s, {:.2} MB",
                    plans[pi].name(),
                    by_plan[pi].len(),
                    b as f64 / 1e6
                );
                seconds[si][pi].push(s);
                bytes[si][pi] = b;
            }
        }
    }
    println!(
        "\n| what a cold run compiles | plan | sources | machine code | NVRTC s (each round) | median × before |\n|---|---|---|---|---|---|"
    );
    for (si, (name, by_plan)) in sets.iter().enumerate() {
        let median = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let before = median(&seconds[si][0]);
        for (pi, plan) in plans.iter().enumerate() {
            let each: Vec<String> = seconds[si][pi].iter().map(|s| format!("{s:.2}")).collect();
            println!(
                "| {name} | {} | {} | {:.2} MB | {} | {:.3} |",
                plan.name(),
                by_plan[pi].len(),
                bytes[si][pi] as f64 / 1e6,
                each.join(" / "),
                median(&seconds[si][pi]) / before
            );
        }
    }
    Ok(())
}
