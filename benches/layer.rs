//! One full-size Gemma-2B decoder layer over the 968-token pi0.5 prefix, through the executor:
//! wall time, GFLOP/s and the per-op breakdown. `cargo bench -p petite-reference --bench layer`
//! (`-- f32` declares the weights f32 instead of bf16; the stored weights are f32 either way,
//! so bf16 runs include the per-use f32 → bf16 rounding an f32 checkpoint needs).

use petite_graph::{Builder, Dtype, Program, ValueId};
use petite_reference::{Executor, MemoryWeights, Tensor};
use std::collections::BTreeMap;
use std::time::Instant;

const S: usize = 968;
const W: usize = 2048;
const H: usize = 8;
const KVH: usize = 1;
const HD: usize = 256;
const MLP: usize = 16384;

fn program(dt: Dtype, ws: &mut MemoryWeights) -> Program {
    let mut b = Builder::new();
    let mut seed = 1u32;
    let mut weight = |b: &mut Builder, name: &str, shape: &[usize]| -> ValueId {
        let n: usize = shape.iter().product();
        let scale = 1.0 / (*shape.last().unwrap() as f32).sqrt();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (((seed >> 8) as f32 / (1u32 << 24) as f32) - 0.5) * scale
            })
            .collect();
        ws.insert_f32(name, shape, &v).unwrap();
        b.weight(name, dt, shape).unwrap()
    };
    let x = b.input("x", dt, &[1, S, W]).unwrap();
    let cos = b.input("cos", dt, &[1, 1, S, HD]).unwrap();
    let sin = b.input("sin", dt, &[1, 1, S, HD]).unwrap();
    let mask = b.input("mask", Dtype::F32, &[1, 1, S, S]).unwrap();
    let ln1 = weight(&mut b, "input_layernorm", &[W]);
    let h = b.rms_norm(x, Some(ln1), 1e-6).unwrap();
    let proj = |b: &mut Builder, h, w, heads| {
        let y = b.linear(h, w, None).unwrap();
        let y = b.reshape(y, &[1, S, heads, HD]).unwrap();
        b.transpose(y, 1, 2).unwrap()
    };
    let wq = weight(&mut b, "q_proj", &[H * HD, W]);
    let wk = weight(&mut b, "k_proj", &[KVH * HD, W]);
    let wv = weight(&mut b, "v_proj", &[KVH * HD, W]);
    let q = proj(&mut b, h, wq, H);
    let k = proj(&mut b, h, wk, KVH);
    let v = proj(&mut b, h, wv, KVH);
    let q = b.rope(q, cos, sin).unwrap();
    let k = b.rope(k, cos, sin).unwrap();
    let a = b
        .attention(q, k, v, Some(mask), (HD as f64).powf(-0.5))
        .unwrap();
    let a = b.transpose(a, 1, 2).unwrap();
    let a = b.reshape(a, &[1, S, H * HD]).unwrap();
    let wo = weight(&mut b, "o_proj", &[W, H * HD]);
    let o = b.linear(a, wo, None).unwrap();
    let r = b.add(x, o).unwrap();
    let ln2 = weight(&mut b, "post_attention_layernorm", &[W]);
    let h2 = b.rms_norm(r, Some(ln2), 1e-6).unwrap();
    let wg = weight(&mut b, "gate_proj", &[MLP, W]);
    let wu = weight(&mut b, "up_proj", &[MLP, W]);
    let wd = weight(&mut b, "down_proj", &[W, MLP]);
    let g = b.linear(h2, wg, None).unwrap();
    let g = b.gelu_tanh(g).unwrap();
    let u = b.linear(h2, wu, None).unwrap();
    let gu = b.mul(g, u).unwrap();
    let d = b.linear(gu, wd, None).unwrap();
    let y = b.add(r, d).unwrap();
    b.output("y", y).unwrap();
    b.output("k", k).unwrap();
    b.output("v", v).unwrap();
    b.finish().unwrap()
}

/// User + system CPU seconds of this process (contention-robust next to wall time).
fn cpu_seconds() -> f64 {
    // SAFETY: `rusage` is a C struct of integers and `timeval`s, for which all-zero bytes are a
    // valid value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one `rusage` through a pointer to a live, exclusively borrowed
    // one; RUSAGE_SELF is always a valid `who`.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(u.ru_utime) + tv(u.ru_stime)
}

fn main() {
    let dt = if std::env::args().any(|a| a == "f32") {
        Dtype::F32
    } else {
        Dtype::Bf16
    };
    let mut ws = MemoryWeights::new();
    let p = program(dt, &mut ws);
    let t = |shape: &[usize], f: &dyn Fn(usize) -> f32| {
        let n: usize = shape.iter().product();
        Tensor::from_f32_as(dt, shape, (0..n).map(f).collect()).unwrap()
    };
    let mut inputs = BTreeMap::new();
    inputs.insert(
        "x".to_string(),
        t(&[1, S, W], &|i| ((i % 97) as f32 - 48.0) / 16.0),
    );
    inputs.insert(
        "cos".to_string(),
        t(&[1, 1, S, HD], &|i| (i as f32 * 0.01).cos()),
    );
    inputs.insert(
        "sin".to_string(),
        t(&[1, 1, S, HD], &|i| (i as f32 * 0.01).sin()),
    );
    inputs.insert(
        "mask".to_string(),
        Tensor::f32(&[1, 1, S, S], vec![0.0; S * S]).unwrap(),
    );
    let flop = 2.0 * S as f64 * W as f64 * ((H + 2 * KVH) * HD) as f64
        + 2.0 * S as f64 * (H * HD) as f64 * W as f64
        + 3.0 * 2.0 * S as f64 * W as f64 * MLP as f64
        + 4.0 * H as f64 * S as f64 * S as f64 * HD as f64;
    let ex = Executor::new(&p, &ws).unwrap().release_weights(false);
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    let (_, stats) = ex.run_with_stats(inputs).unwrap();
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    println!(
        "process CPU time {cpu:.3} s ({:.1} GFLOP per CPU-second; wall/CPU shows how much of 2 cores the machine gave us)",
        flop / 1e9 / cpu
    );
    println!(
        "gemma-2b layer, {S} tokens, weights {dt}: {secs:.3} s, {:.1} GFLOP, {:.1} GFLOP/s, rayon threads {}, peak held values {:.1} MiB",
        flop / 1e9,
        flop / 1e9 / secs,
        rayon::current_num_threads(),
        stats.peak_value_bytes as f64 / (1 << 20) as f64
    );
    let mut ops: Vec<_> = stats.op_seconds.iter().collect();
    ops.sort_by(|a, b| b.1.total_cmp(a.1));
    for (op, s) in ops {
        println!("  {op:<12} {s:>8.3} s");
    }
}
