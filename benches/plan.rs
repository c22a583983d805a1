//! Planning the full-size pi0.5 prefix and step (shapes only; no checkpoint).
use criterion::{Criterion, criterion_group, criterion_main};
use petite_partition::{PartitionOptions, plan};
use petite_pi05::{
    Pi05Config, Precision, PrefixOptions, build_prefix, build_prefix_with, build_step,
};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    let cfg = Pi05Config::default();
    let prefix = build_prefix(&cfg, Precision::Bf16).expect("prefix");
    let step = build_step(&cfg, Precision::Bf16).expect("step");
    // The prefix as it was before the token embedding was sharded (one 1004.5 MiB weight).
    let unsharded = build_prefix_with(
        &cfg,
        Precision::Bf16,
        &PrefixOptions {
            max_embedding_shard_bytes: usize::MAX,
        },
    )
    .expect("prefix");
    let opts = PartitionOptions::new(512 << 20);
    let mut g = c.benchmark_group("plan");
    g.sample_size(20);
    // Baseline: validating the program (which planning includes) alone.
    g.bench_function("pi05_prefix_validate_only", |b| {
        b.iter(|| black_box(&prefix).validate().expect("valid"))
    });
    g.bench_function("pi05_prefix_512MiB", |b| {
        b.iter(|| plan(black_box(&prefix), &opts).expect("plan"))
    });
    g.bench_function("pi05_prefix_unsharded_embedding_512MiB", |b| {
        b.iter(|| plan(black_box(&unsharded), &opts).expect("plan"))
    });
    g.bench_function("pi05_step_512MiB", |b| {
        b.iter(|| plan(black_box(&step), &opts).expect("plan"))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
