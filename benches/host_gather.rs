//! Gathering pi0.5's token embedding rows on the host (`petite_cuda::host_gather`): what a
//! resident CUDA method adds to each prefix run before its graph launches. The full-size bf16
//! prefix's 16 table shards, 200 tokens (all distinct: the worst case), from a table in memory;
//! beside it, the copy of the same rows alone (the floor of any gather).
use std::collections::BTreeMap;
use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use petite_cuda::host_gather::{Gathered, HostGathers, MIN_TABLE_BYTES};
use petite_graph::Dtype;
use petite_pi05::{Pi05Config, Precision, build_prefix, names};
use petite_reference::{MemoryWeights, Tensor};

fn bench(c: &mut Criterion) {
    let cfg = Pi05Config::default();
    let prefix = build_prefix(&cfg, Precision::Bf16).expect("prefix");
    let hg = HostGathers::plan(&prefix, MIN_TABLE_BYTES, &|_| true)
        .expect("plan")
        .expect("the token embedding is gathered");
    let (rows, width) = (cfg.language.vocab, cfg.language.width);
    let mut w = MemoryWeights::new();
    let table: Vec<u8> = (0..rows * width * 2).map(|i| (i % 251) as u8).collect();
    w.insert_bytes(names::EMBED_TOKENS, Dtype::Bf16, &[rows, width], table)
        .expect("table");
    let tokens: Vec<i64> = (0..cfg.tokens).map(|i| (i * 7919 % rows) as i64).collect();
    let ins = BTreeMap::from([(
        "tokens".to_string(),
        Tensor::i64(&[cfg.tokens], tokens.clone()).expect("tokens"),
    )]);
    let mut g = Gathered::default();
    let mut group = c.benchmark_group("host_gather");
    group.bench_function("pi05_prefix_200_tokens", |b| {
        b.iter(|| hg.gather(black_box(&ins), &w, &mut g).expect("gather"))
    });
    let view = petite_weights::WeightSource::tensor(&w, names::EMBED_TOKENS).expect("view");
    let mut out = vec![0u8; cfg.tokens * width * 2];
    group.bench_function("copy_200_rows_alone", |b| {
        b.iter(|| {
            for (k, &t) in tokens.iter().enumerate() {
                let r = t as usize * width * 2;
                out[k * width * 2..(k + 1) * width * 2]
                    .copy_from_slice(&view.bytes[r..r + width * 2]);
            }
            black_box(&out);
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
