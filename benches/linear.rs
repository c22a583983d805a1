//! GEMM throughput of the reference executor's hot paths at pi0.5 prefix shapes.
//!
//! `cargo bench -p petite-reference --bench linear`; GFLOP/s = 2·M·K·N / time. The
//! single-threaded GEMM on the same shape is the baseline measured in the same run.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use petite_reference::kernels::{
    MatRef, SdpaShape, cpu_bf16_unit, gemm_f32, linear, linear_bf16, linear_bf16_any_order, sdpa,
};
use std::hint::black_box;
use std::time::Duration;

fn data(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            ((s >> 8) as f32 / (1u32 << 24) as f32) - 0.5
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    // Gemma-2B MLP gate/up over the 968-token prefix: [968, 2048] · [16384, 2048]ᵀ
    let (m, k, n) = (968usize, 2048usize, 16384usize);
    let x = data(m * k, 1);
    let w = data(n * k, 2);
    let flops = 2 * m * k * n;
    let mut g = c.benchmark_group("gemm");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(10))
        .throughput(Throughput::Elements(flops as u64));
    g.bench_function("linear_968x2048x16384_rayon", |b| {
        b.iter(|| black_box(linear(&x, m, &w, n, None).unwrap()))
    });
    let mut out = vec![0.0f32; m * n];
    g.bench_function("gemm_968x2048x16384_single_thread", |b| {
        b.iter(|| {
            gemm_f32(
                &mut out,
                MatRef::row_major(&x, m, k).unwrap(),
                MatRef::row_major(&w, n, k).unwrap().t(),
                false,
                false,
            )
            .unwrap();
            black_box(&out);
        })
    });
    // Action expert MLP gate/up over the 50-token chunk (a denoising step): [50, 1024] ·
    // [4096, 1024]ᵀ, where packing the weight weighs most.
    let (m, k, n) = (50usize, 1024usize, 4096usize);
    let xs = data(m * k, 6);
    let ws = data(n * k, 7);
    g.throughput(Throughput::Elements((2 * m * k * n) as u64));
    g.bench_function("linear_50x1024x4096_rayon", |b| {
        b.iter(|| black_box(linear(&xs, m, &ws, n, None).unwrap()))
    });
    // The same product over 48 different weights in turn (768 MiB, more than this VM's share
    // of the last-level cache): as a denoising step reads its 300M weights, from memory.
    let cold: Vec<Vec<f32>> = (0..48).map(|i| data(n * k, 100 + i)).collect();
    let mut next = 0usize;
    g.bench_function("linear_50x1024x4096_rayon_cold_weights", |b| {
        b.iter(|| {
            next = (next + 1) % cold.len();
            black_box(linear(&xs, m, &cold[next], n, None).unwrap())
        })
    });
    g.finish();

    // bf16 programs' linears (bf16 activations and weights): the exact path (weights widened
    // while packed, f32 FMA) against the CPU's own order (the AMX tile unit where present, the
    // same exact path elsewhere), measured in the same run.
    let mut g = c.benchmark_group("bf16");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    eprintln!("bf16 unit in use: {:?}", cpu_bf16_unit());
    for (m, k, n) in [
        (968usize, 2048usize, 16384usize),
        (968, 16384, 2048),
        (50, 1024, 4096),
    ] {
        // Truncating to bf16 keeps the upper half: the activations are bf16 values widened.
        let x: Vec<f32> = data(m * k, 8)
            .into_iter()
            .map(|v| f32::from_bits(v.to_bits() & 0xffff_0000))
            .collect();
        let w: Vec<u16> = data(n * k, 9)
            .into_iter()
            .map(|v| (v.to_bits() >> 16) as u16)
            .collect();
        g.throughput(Throughput::Elements((2 * m * k * n) as u64));
        g.bench_function(format!("exact_{m}x{k}x{n}"), |b| {
            b.iter(|| black_box(linear_bf16(&x, m, &w, n, None).unwrap()))
        });
        g.bench_function(format!("any_order_{m}x{k}x{n}"), |b| {
            b.iter(|| black_box(linear_bf16_any_order(&x, m, &w, n, None).unwrap()))
        });
    }
    g.finish();

    // Gemma-2B prefix attention: 8 query heads, 1 KV head, 968 tokens, head dim 256
    let s = SdpaShape {
        b: 1,
        h: 8,
        kvh: 1,
        sq: 968,
        sk: 968,
        d: 256,
        dv: 256,
    };
    let q = data(s.h * s.sq * s.d, 3);
    let kk = data(s.sk * s.d, 4);
    let v = data(s.sk * s.dv, 5);
    let mask = vec![0.0f32; s.sq * s.sk];
    let mut g = c.benchmark_group("attention");
    g.sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5))
        .throughput(Throughput::Elements((4 * s.h * s.sq * s.sk * s.d) as u64));
    g.bench_function("sdpa_8x968x968x256_mqa", |b| {
        b.iter(|| {
            black_box(
                sdpa(
                    &q,
                    &kk,
                    &v,
                    Some((&mask, [1, 1, s.sq, s.sk])),
                    s,
                    0.0625,
                    false,
                )
                .unwrap(),
            )
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
