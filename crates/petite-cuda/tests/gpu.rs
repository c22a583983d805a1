//! petite-cuda on a real GPU. Needs one: ignored by `cargo test`; the gpu tier runs these
//! (`cargo xtask conformance --only gpu`), where they fail, never skip, without one.
//!
//! The fused bf16 attention (`petite_cuda::fuse::Attend`: one cluster launch or two kernels of
//! bf16 `mma.sync`) against the reference executor (petite-reference, on the CPU) running the
//! same op chain node by node; and an embedding's index check read back after a CUDA graph.
//!
//! Both compute the same roundings (bf16 logits, bf16 scaling, f32 mask and softmax, bf16
//! probabilities, bf16 output) and differ only in each dot product's summation order, so the
//! check is that the fused kernels are as close to the exact f64 attention as the reference
//! executor is.

use std::collections::BTreeMap;

use petite_cuda::fuse::{Options, fused_attention_queries};
use petite_cuda::{Device, DeviceProgram};
use petite_graph::{Builder, Dtype, Program};
use petite_reference::{NoWeights, Tensor};

/// pi0.5's mask fill (the most negative bf16-representable f32 lerobot uses).
const FILL: f32 = -2.381_976_3e38;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

struct Case {
    b: usize,
    h: usize,
    kvh: usize,
    q: usize,
    k: usize,
    d: usize,
    dv: usize,
    /// K and v given as two inputs concatenated along the keys, the first of this many keys
    /// (pi0.5's step: the prefix's K/V and its own).
    split: Option<usize>,
}

/// `[b, h, kvh, q, k, d, dv]`.
fn case([b, h, kvh, q, k, d, dv]: [usize; 7], split: Option<usize>) -> Case {
    Case {
        b,
        h,
        kvh,
        q,
        k,
        d,
        dv,
        split,
    }
}

/// pi0.5's bf16 attention as `petite_pi05` builds it: K/V (a concat of two pieces if split),
/// KV heads repeated by reshape/expand/reshape, `q·kᵀ`, bf16 scaling, f32 cast, `+ mask`,
/// softmax, bf16 cast, `p·v`, heads merged.
fn program(c: &Case) -> Program {
    let mut b = Builder::new();
    let q = b.input("q", Dtype::Bf16, &[c.b, c.h, c.q, c.d]).unwrap();
    let mut kv = |name: &str, d: usize| match c.split {
        None => b.input(name, Dtype::Bf16, &[c.b, c.kvh, c.k, d]).unwrap(),
        Some(n) => {
            let x = b
                .input(&format!("{name}0"), Dtype::Bf16, &[c.b, c.kvh, n, d])
                .unwrap();
            let y = b
                .input(&format!("{name}1"), Dtype::Bf16, &[c.b, c.kvh, c.k - n, d])
                .unwrap();
            b.concat(&[x, y], 2).unwrap()
        }
    };
    let k = kv("k", c.d);
    let v = kv("v", c.dv);
    let m = b.input("mask", Dtype::F32, &[1, 1, c.q, c.k]).unwrap();
    let rep = c.h / c.kvh;
    let mut repeat = |t, d| {
        if rep == 1 {
            return t;
        }
        let r = b.reshape(t, &[c.b, c.kvh, 1, c.k, d]).unwrap();
        let r = b.expand(r, &[c.b, c.kvh, rep, c.k, d]).unwrap();
        b.reshape(r, &[c.b, c.h, c.k, d]).unwrap()
    };
    let k = repeat(k, c.d);
    let v = repeat(v, c.dv);
    let kt = b.transpose(k, 2, 3).unwrap();
    let l = b.matmul(q, kt).unwrap();
    let l = b.mul_scalar(l, (c.d as f64).powf(-0.5)).unwrap();
    let l = b.cast(l, Dtype::F32).unwrap();
    let l = b.add(l, m).unwrap();
    let p = b.softmax(l, -1).unwrap();
    let p = b.cast(p, Dtype::Bf16).unwrap();
    let o = b.matmul(p, v).unwrap();
    let o = b.permute(o, &[0, 2, 1, 3]).unwrap();
    b.output("o", o).unwrap();
    b.finish().unwrap()
}

fn tensor(dt: Dtype, shape: &[usize], v: Vec<f32>) -> Tensor {
    Tensor::from_f32_as(dt, shape, v).unwrap()
}

/// The whole inputs (`q`, `k`, `v`, `mask`), bf16-rounded.
fn inputs(c: &Case, seed: u64) -> BTreeMap<String, Tensor> {
    let n = |s: &[usize]| s.iter().product::<usize>();
    let (qs, ks, vs) = (
        [c.b, c.h, c.q, c.d],
        [c.b, c.kvh, c.k, c.d],
        [c.b, c.kvh, c.k, c.dv],
    );
    // Logits of a few units: q·k over d terms of ~1/3 each, times d^-0.5, times 3.
    let q: Vec<f32> = values(n(&qs), seed).iter().map(|x| x * 3.0).collect();
    // Some keys masked for each query, and the last 10% of keys for all (padding).
    let mask: Vec<f32> = (0..c.q * c.k)
        .map(|i| {
            let (qi, j) = (i / c.k, i % c.k);
            if j * 10 >= c.k * 9 || (j * 7 + qi) % 5 == 0 {
                FILL
            } else {
                0.0
            }
        })
        .collect();
    [
        ("q", tensor(Dtype::Bf16, &qs, q)),
        ("k", tensor(Dtype::Bf16, &ks, values(n(&ks), seed + 1))),
        ("v", tensor(Dtype::Bf16, &vs, values(n(&vs), seed + 2))),
        ("mask", tensor(Dtype::F32, &[1, 1, c.q, c.k], mask)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// What the program reads: `k` and `v` cut at the split into their two pieces when split.
fn program_inputs(c: &Case, all: &BTreeMap<String, Tensor>) -> BTreeMap<String, Tensor> {
    let mut out = all.clone();
    let Some(s) = c.split else {
        return out;
    };
    for (name, d) in [("k", c.d), ("v", c.dv)] {
        let full = out
            .remove(name)
            .unwrap()
            .float_values()
            .unwrap()
            .into_owned();
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for (i, row) in full.chunks(d).enumerate() {
            if i % c.k < s {
                x.extend_from_slice(row)
            } else {
                y.extend_from_slice(row)
            }
        }
        let (sx, sy) = ([c.b, c.kvh, s, d], [c.b, c.kvh, c.k - s, d]);
        out.insert(format!("{name}0"), tensor(Dtype::Bf16, &sx, x));
        out.insert(format!("{name}1"), tensor(Dtype::Bf16, &sy, y));
    }
    out
}

/// The exact attention in f64 from the (bf16) inputs, `[B, Q, H, Dv]`.
fn exact(c: &Case, ins: &BTreeMap<String, Tensor>) -> Vec<f64> {
    let f = |n: &str| ins[n].float_values().unwrap().into_owned();
    let (q, k, v, m) = (f("q"), f("k"), f("v"), f("mask"));
    let scale = (c.d as f64).powf(-0.5);
    let mut out = vec![0f64; c.b * c.q * c.h * c.dv];
    for b in 0..c.b {
        for h in 0..c.h {
            let kh = h / (c.h / c.kvh);
            for qi in 0..c.q {
                let qr = &q[((b * c.h + h) * c.q + qi) * c.d..][..c.d];
                let logits: Vec<f64> = (0..c.k)
                    .map(|j| {
                        let kr = &k[((b * c.kvh + kh) * c.k + j) * c.d..][..c.d];
                        let dot: f64 = qr.iter().zip(kr).map(|(&x, &y)| x as f64 * y as f64).sum();
                        dot * scale + m[qi * c.k + j] as f64
                    })
                    .collect();
                let mx = logits.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
                let s: f64 = e.iter().sum();
                for col in 0..c.dv {
                    let acc: f64 = (0..c.k)
                        .map(|j| e[j] / s * v[((b * c.kvh + kh) * c.k + j) * c.dv + col] as f64)
                        .sum();
                    out[((b * c.q + qi) * c.h + h) * c.dv + col] = acc;
                }
            }
        }
    }
    out
}

/// (max, mean) |a − e|; any non-finite value or length mismatch fails.
fn errors(a: &[f32], e: &[f64]) -> (f64, f64) {
    assert!(
        !a.is_empty() && a.len() == e.len(),
        "{} vs {}",
        a.len(),
        e.len()
    );
    let mut mx = 0f64;
    let mut sum = 0f64;
    for (&x, &y) in a.iter().zip(e) {
        assert!(x.is_finite(), "non-finite output {x}");
        let d = (x as f64 - y).abs();
        mx = mx.max(d);
        sum += d;
    }
    (mx, sum / a.len() as f64)
}

#[test]
#[ignore = "needs a GPU: cargo xtask conformance --only gpu"]
fn fused_attention_is_as_close_to_exact_as_the_reference_executor() {
    let dev = Device::open().expect("a CUDA GPU (this test fails without one)");
    let cases = [
        // pi0.5's step: 8 heads over one KV head, 50 queries, 968 + 50 keys, head dim 256;
        // K/V whole, then as the prefix's 968 keys and the step's 50 (read in place).
        case([1, 8, 1, 50, 1018, 256, 256], None),
        case([1, 8, 1, 50, 1018, 256, 256], Some(968)),
        // Own KV heads, two batches, keys and rows off the tiles (70 keys, 20 rows).
        case([2, 2, 2, 20, 70, 32, 128], None),
        case([2, 2, 2, 20, 70, 32, 128], Some(33)),
        // One query, one key; then the most keys one cluster holds (128 a block).
        case([1, 4, 1, 1, 1, 16, 128], None),
        case([1, 8, 1, 100, 1024, 256, 256], Some(1000)),
        // v's head dim not a multiple of 128: two launches only.
        case([1, 4, 1, 3, 40, 16, 32], None),
    ];
    let cc = dev.info().compute_capability;
    for (i, c) in cases.iter().enumerate() {
        let p = program(c);
        let ins = inputs(c, 7 + i as u64);
        let cpu = petite_reference::run(&p, &NoWeights, program_inputs(c, &ins)).unwrap();
        let mut gp =
            DeviceProgram::load_with(&dev, &p, &NoWeights, false, Options::new(128)).unwrap();
        assert_eq!(gp.fused_attentions(), 1, "case {i}: the attention is fused");
        let e = exact(c, &ins);
        let cpu = cpu["o"].float_values().unwrap().into_owned();
        let (cm, ca) = errors(&cpu, &e);
        // One launch in clusters (where it fits), then two.
        let shared = dev.info().max_shared_per_block;
        let fits = petite_cuda::plan::attention_cluster(c.k, c.dv, cc).is_some_and(|b| b <= shared);
        if cc == (9, 0) {
            // An H100/H200: every case whose v head dim allows it runs as one launch.
            assert_eq!(fits, c.dv % 128 == 0, "case {i}");
        }
        for cluster in [true, false] {
            gp.set_attention_cluster(cluster);
            let gpu = gp.run(program_inputs(c, &ins)).unwrap();
            let gpu = gpu["o"].float_values().unwrap().into_owned();
            assert_eq!(gpu.len(), cpu.len(), "case {i}");
            let (gm, ga) = errors(&gpu, &e);
            let same = cpu
                .iter()
                .zip(&gpu)
                .filter(|(a, b)| a.to_bits() == b.to_bits())
                .count();
            let how = if cluster && fits {
                "one launch"
            } else {
                "two launches"
            };
            eprintln!(
                "case {i} ({how}): max/mean |x - exact|: reference {cm:.3e}/{ca:.3e}, fused \
                 {gm:.3e}/{ga:.3e}; {same} of {} outputs bit-identical",
                cpu.len()
            );
            // One bf16 rounding of the largest output is the floor of either error.
            let ulp = e.iter().fold(0f64, |m, x| m.max(x.abs())) * 2f64.powi(-8);
            assert!(
                gm <= 2.0 * cm.max(ulp),
                "case {i} ({how}): fused max error {gm:e} vs {cm:e}"
            );
            assert!(
                ga <= 1.25 * ca + ulp / 64.0,
                "case {i} ({how}): fused mean error {ga:e} vs {ca:e}"
            );
        }
    }
}

/// The harness without a GPU: the reference executor's bf16 chain is within bf16 noise of the
/// exact f64 attention computed here, with K/V whole or in two pieces (so the GPU test compares
/// against a sound baseline).
#[test]
fn the_reference_executor_is_within_bf16_noise_of_the_exact_attention() {
    for split in [None, Some(33)] {
        let c = case([2, 2, 2, 20, 70, 32, 64], split);
        let ins = inputs(&c, 3);
        let cpu = petite_reference::run(&program(&c), &NoWeights, program_inputs(&c, &ins));
        let cpu = cpu.unwrap()["o"].float_values().unwrap().into_owned();
        let e = exact(&c, &ins);
        let (m, a) = errors(&cpu, &e);
        let top = e.iter().fold(0f64, |m, x| m.max(x.abs()));
        assert!(top > 0.05, "outputs of some size: {top}");
        // bf16 probabilities and output: a few bf16 ulps of the largest output at most.
        assert!(
            m <= top * 2f64.powi(-5) && a < m,
            "{split:?}: max {m:e}, mean {a:e}, top {top}"
        );
    }
}

/// An embedding's out-of-table index is an error whether the run reads its flag back itself
/// (`run_device`) or leaves that to the caller (`run_device_flagged`, as a CUDA graph needs:
/// the flag reset inside the graph and read after each replay, as pi0.5's prefix graph does).
#[test]
#[ignore = "needs a GPU: cargo xtask conformance --only gpu"]
fn an_out_of_table_index_is_an_error_also_read_back_after_a_graph() {
    let dev = Device::open().expect("a CUDA GPU (this test fails without one)");
    let mut b = Builder::new();
    let t = b.input("table", Dtype::F32, &[4, 3]).unwrap();
    let i = b.input("idx", Dtype::I64, &[2]).unwrap();
    let e = b.embedding(t, i).unwrap();
    b.output("e", e).unwrap();
    let p = b.finish().unwrap();
    let gp = DeviceProgram::load(&dev, &p, &NoWeights, false).unwrap();
    assert!(gp.has_embedding());
    let table = dev
        .upload(&Tensor::f32(&[4, 3], (0..12).map(|x| x as f32).collect()).unwrap())
        .unwrap();
    let idx = |v: Vec<i64>| dev.upload(&Tensor::i64(&[2], v).unwrap()).unwrap();
    let ins = |ix| {
        BTreeMap::from([
            ("table".to_string(), table.clone()),
            ("idx".to_string(), ix),
        ])
    };
    let rows = |t: &petite_cuda::DevTensor| {
        dev.download(t)
            .unwrap()
            .float_values()
            .unwrap()
            .into_owned()
    };
    // Read back by the run itself.
    let ok = gp.run_device(ins(idx(vec![3, 0]))).unwrap();
    assert_eq!(rows(&ok["e"]), [9.0, 10.0, 11.0, 0.0, 1.0, 2.0]);
    let e = gp.run_device(ins(idx(vec![1, 4]))).unwrap_err().to_string();
    assert!(e.contains("position 1 is outside"), "{e}");
    // No flag where the program gathers: refused before any work.
    assert!(gp.run_device_flagged(ins(idx(vec![0, 0])), None).is_err());
    // Captured once over fixed buffers, replayed with other indices.
    let fixed = idx(vec![0, 0]);
    let [flag, zero] = [(); 2].map(|_| dev.zeros(Dtype::I64, &[1]).unwrap());
    let out = dev.zeros(Dtype::F32, &[2, 3]).unwrap();
    let ((), g) = dev
        .capture(|| {
            dev.copy(&zero, &flag)?;
            let r = gp.run_device_flagged(ins(fixed.clone()), Some(&flag))?;
            dev.copy(&r["e"], &out)
        })
        .unwrap();
    for (v, bad) in [
        (vec![2, 1], None),
        (vec![0, 7], Some(1)),
        (vec![-1, 0], Some(0)),
        (vec![1, 3], None),
    ] {
        dev.copy(&idx(v.clone()), &fixed).unwrap();
        g.launch().unwrap();
        match (gp.check_indices(&flag), bad) {
            (Ok(()), None) => {
                let want: Vec<f32> = v
                    .iter()
                    .flat_map(|&r| (0..3).map(move |c| (r * 3 + c) as f32))
                    .collect();
                assert_eq!(rows(&out), want, "{v:?}");
            }
            (Err(e), Some(pos)) => {
                let e = e.to_string();
                assert!(
                    e.contains(&format!("position {pos} is outside")),
                    "{v:?}: {e}"
                );
            }
            (r, _) => panic!("{v:?}: {r:?}"),
        }
    }
}

/// A sharded embedding table gathered on the host (`petite_cuda::host_gather`): the rewritten
/// program, its rows uploaded before each replay of a CUDA graph captured once, gives the bits
/// of the program that gathers from the table on the device, for several token sets; the
/// table's bytes are not on the device.
#[test]
#[ignore = "needs a GPU: cargo xtask conformance --only gpu"]
fn embedding_rows_gathered_on_the_host_give_the_device_gathers_bits_through_a_graph() {
    use petite_cuda::host_gather::{Gathered, HostGathers};
    let dev = Device::open().expect("a CUDA GPU (this test fails without one)");
    let (rows, width, n) = (300usize, 64usize, 7usize);
    let mut b = Builder::new();
    let t = b.input("tokens", Dtype::I64, &[n]).unwrap();
    // Shards of 64 rows: five row ranges, the last short.
    let e = b
        .embedding_sharded("emb", Dtype::Bf16, &[rows, width], t, 64 * width * 2)
        .unwrap();
    let y = b.mul_scalar(e, 3.0).unwrap();
    b.output("y", y).unwrap();
    let p = b.finish().unwrap();
    let mut w = petite_reference::MemoryWeights::new();
    w.insert_f32("emb", &[rows, width], &values(rows * width, 11))
        .unwrap();
    let hg = HostGathers::plan(&p, 0, &|_| true).unwrap().unwrap();
    assert_eq!(hg.tables().0, 5);
    let on_device = DeviceProgram::load(&dev, &p, &w, false).unwrap();
    let hosted = DeviceProgram::load(&dev, hg.program(), &w, false).unwrap();
    assert_eq!(
        hosted.weight_bytes(),
        0,
        "the rewritten program uploads no table"
    );
    assert!(on_device.weight_bytes() >= (rows * width * 2) as u64);
    let bufs = hg.alloc(&dev).unwrap();
    let fixed = dev.zeros(Dtype::I64, &[n]).unwrap();
    let out = dev.zeros(Dtype::Bf16, &[n, width]).unwrap();
    let flag = dev.zeros(Dtype::I64, &[1]).unwrap();
    let ((), g) = dev
        .capture(|| {
            let mut ins = BTreeMap::from([("tokens".to_string(), fixed.clone())]);
            ins.extend(hg.inputs(&bufs));
            let r = hosted.run_device_flagged(ins, Some(&flag))?;
            dev.copy(&r["y"], &out)
        })
        .unwrap();
    let mut staged = Gathered::default();
    for toks in [
        vec![0i64, 1, 2, 63, 64, 65, 299],
        vec![5; 7],
        vec![299, 256, 255, 128, 127, 3, 0],
    ] {
        let host = Tensor::i64(&[n], toks.clone()).unwrap();
        let ins = BTreeMap::from([("tokens".to_string(), host.clone())]);
        hg.gather(&ins, &w, &mut staged).unwrap();
        hg.upload(&dev, &bufs, &staged).unwrap();
        dev.copy(&dev.upload(&host).unwrap(), &fixed).unwrap();
        g.launch().unwrap();
        hosted.check_indices(&flag).unwrap();
        let want = on_device
            .run_device(BTreeMap::from([(
                "tokens".to_string(),
                dev.upload(&host).unwrap(),
            )]))
            .unwrap();
        assert_eq!(
            dev.download(&out).unwrap().to_bytes(),
            dev.download(&want["y"]).unwrap().to_bytes(),
            "tokens {toks:?}"
        );
        assert!(staged.distinct() <= n + 5, "{}", staged.distinct());
    }
}

#[test]
#[ignore = "needs a GPU: cargo xtask conformance --only gpu"]
fn unrolled_elementwise_kernels_and_free_permutes_give_the_reference_executors_bits() {
    let dev = Device::open().expect("a CUDA GPU (this test fails without one)");
    // A product and a residual add over 1,001 × 1,031 bf16 elements (past `UNROLL_FROM`, not a
    // multiple of the unrolled trip; correctly rounded ops, so every bit must match), and a
    // one-KV-head `[1, S, 1, D]` → `[1, 1, S, D]` permute (a free view) as an output.
    let (rows, cols) = (1001, 1031);
    assert!(rows * cols >= petite_cuda::fuse::UNROLL_FROM);
    let mut b = Builder::new();
    let g = b.input("g", Dtype::Bf16, &[1, rows, cols]).unwrap();
    let u = b.input("u", Dtype::Bf16, &[1, rows, cols]).unwrap();
    let m = b.mul(g, u).unwrap();
    let r = b.add(m, g).unwrap();
    b.output("r", r).unwrap();
    let v = b.input("v", Dtype::Bf16, &[1, 50, 256]).unwrap();
    let v4 = b.reshape(v, &[1, 50, 1, 256]).unwrap();
    let vp = b.permute(v4, &[0, 2, 1, 3]).unwrap();
    b.output("v", vp).unwrap();
    let p = b.finish().unwrap();
    let roots: Vec<_> = p.outputs.iter().map(|o| o.value).collect();
    let plan =
        petite_cuda::fuse::plan_program(&p, Options::new(fused_attention_queries((9, 0)))).unwrap();
    assert_eq!(plan.groups.len(), 1, "one fused group: {:?}", plan.groups);
    assert_eq!(plan.groups[0].unroll, petite_cuda::fuse::UNROLL);
    assert!(petite_cuda::fuse::moves_only_unit_dims(&p, roots[1]));
    let vals = |n: usize, seed| values(n, seed).into_iter().map(|x| x * 4.0).collect();
    let ins = BTreeMap::from([
        (
            "g".to_string(),
            tensor(Dtype::Bf16, &[1, rows, cols], vals(rows * cols, 1)),
        ),
        (
            "u".to_string(),
            tensor(Dtype::Bf16, &[1, rows, cols], vals(rows * cols, 2)),
        ),
        (
            "v".to_string(),
            tensor(Dtype::Bf16, &[1, 50, 256], vals(50 * 256, 3)),
        ),
    ]);
    let cpu = petite_reference::run(&p, &NoWeights, ins.clone()).unwrap();
    let gp = DeviceProgram::load(&dev, &p, &NoWeights, false).unwrap();
    let gpu = gp.run(ins).unwrap();
    for name in ["r", "v"] {
        let (c, g) = (&cpu[name], &gpu[name]);
        assert_eq!(c.shape(), g.shape(), "{name}");
        let (c, g) = (c.float_values().unwrap(), g.float_values().unwrap());
        assert!(!c.is_empty() && c.len() == g.len(), "{name}");
        let differ = c
            .iter()
            .zip(g.iter())
            .filter(|(a, b)| a.to_bits() != b.to_bits() || !b.is_finite())
            .count();
        assert_eq!(differ, 0, "{name}: {differ} of {} values differ", c.len());
    }
}

/// Three layers of a step's residual sum and adaRMS, each reading its gate, scale and shift
/// at its own offsets in one modulation table: the kernels take the slice starts as
/// parameters (`fuse::Group::offsets`), so the layers share kernels and only the launches'
/// values differ. A wrong value, or one passed in the wrong place, reads another layer's
/// modulation: far outside the bound, which allows one bf16 rounding of the result (the
/// norm's statistics are summed in another order than the reference executor's). The same
/// program with rolled row loops (`fuse::Options::unrolled_rows` off) must give the default's
/// bits: each element by the same lines, each thread's sums in the same order.
#[test]
#[ignore = "needs a GPU: cargo xtask conformance --only gpu"]
fn slice_offsets_passed_at_launch_read_each_layers_own_modulation() {
    // d 1,152 (SigLIP's width): one unrolled trip of 1,024 a row and a remainder of 128.
    let (rows, d, layers) = (50, 1152, 3);
    let mut b = Builder::new();
    let table = b
        .input("table", Dtype::F32, &[1, 1, 3 * d * layers])
        .unwrap();
    let mut x = b.input("x", Dtype::Bf16, &[1, rows, d]).unwrap();
    let at = |b: &mut Builder, l: usize, k: usize| {
        let start = (3 * l + k) * d;
        b.slice(table, 2, start as isize, (start + d) as isize, 1)
            .unwrap()
    };
    for l in 0..layers {
        let o = b
            .input(&format!("o{l}"), Dtype::Bf16, &[1, rows, d])
            .unwrap();
        let gate = at(&mut b, l, 2);
        let gate = b.cast(gate, Dtype::Bf16).unwrap();
        let go = b.mul(o, gate).unwrap();
        let sum = b.add(x, go).unwrap();
        let sf = b.cast(sum, Dtype::F32).unwrap();
        let n = b.rms_norm(sf, None, 1e-6).unwrap();
        let (scale, shift) = (at(&mut b, l, 1), at(&mut b, l, 0));
        let s1 = b.add_scalar(scale, 1.0).unwrap();
        let m = b.mul(n, s1).unwrap();
        let m = b.add(m, shift).unwrap();
        let y = b.cast(m, Dtype::Bf16).unwrap();
        b.output(&format!("y{l}"), y).unwrap();
        x = b.add(sum, y).unwrap();
    }
    b.output("x", x).unwrap();
    let p = b.finish().unwrap();
    let plan =
        petite_cuda::fuse::plan_program(&p, Options::new(fused_attention_queries((9, 0)))).unwrap();
    let launched: Vec<_> = plan.groups.iter().filter(|g| !g.absorbed).collect();
    assert!(
        launched
            .iter()
            .any(|g| g.first.is_some_and(|f| !plan.groups[f].offsets.is_empty())),
        "a residual sum computed first by a norm's kernel, reading its gate's offset: {:?}",
        plan.groups
    );
    assert!(
        plan.kernels.len() < launched.len(),
        "layers share kernels: {} kernels, {} launches",
        plan.kernels.len(),
        launched.len()
    );
    let dev = Device::open().expect("a CUDA GPU (this test fails without one)");
    let vals = |n: usize, seed| values(n, seed).into_iter().map(|x| x * 2.0).collect();
    let mut ins = BTreeMap::from([
        (
            "table".to_string(),
            tensor(Dtype::F32, &[1, 1, 3 * d * layers], vals(3 * d * layers, 7)),
        ),
        (
            "x".to_string(),
            tensor(Dtype::Bf16, &[1, rows, d], vals(rows * d, 8)),
        ),
    ]);
    for l in 0..layers {
        ins.insert(
            format!("o{l}"),
            tensor(Dtype::Bf16, &[1, rows, d], vals(rows * d, 9 + l as u64)),
        );
    }
    let cpu = petite_reference::run(&p, &NoWeights, ins.clone()).unwrap();
    let options = Options::new(0);
    let gp = DeviceProgram::load_with(&dev, &p, &NoWeights, false, options).unwrap();
    let gpu = gp.run(ins.clone()).unwrap();
    // Rolled row loops (the default before issue 49): the same bits.
    let rolled = Options {
        unrolled_rows: false,
        ..options
    };
    let gu = DeviceProgram::load_with(&dev, &p, &NoWeights, false, rolled).unwrap();
    let gpu_unrolled = gu.run(ins).unwrap();
    for name in (0..layers)
        .map(|l| format!("y{l}"))
        .chain(["x".to_string()])
    {
        let (g, u) = (
            gpu[&name].float_values().unwrap(),
            gpu_unrolled[&name].float_values().unwrap(),
        );
        assert!(!g.is_empty() && g.len() == u.len(), "{name}");
        let differ = g
            .iter()
            .zip(u.iter())
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(differ, 0, "{name}: rolled rows changed {differ} values");
        let (c, g) = (&cpu[&name], &gpu[&name]);
        assert_eq!(c.shape(), g.shape(), "{name}");
        let (c, g) = (c.float_values().unwrap(), g.float_values().unwrap());
        assert!(!c.is_empty() && c.len() == g.len(), "{name}");
        let mut same = 0;
        for (i, (a, b)) in c.iter().zip(g.iter()).enumerate() {
            // One bf16 rounding of the value: 2⁻⁸ of it.
            let bound = a.abs().max(b.abs()) / 256.0;
            assert!(
                b.is_finite() && (a - b).abs() <= bound,
                "{name}[{i}]: reference {a}, GPU {b}"
            );
            same += usize::from(a.to_bits() == b.to_bits());
        }
        assert!(
            same * 100 >= c.len() * 99,
            "{name}: only {same} of {} values are the reference's bits",
            c.len()
        );
    }
}

/// f32 attention without a mask where the f32 products run as TF32 (pi0.5's SigLIP in the bf16
/// mode): `pt_attn_tf32` (one launch, flash-attention's order) against the unfused TF32 GEMMs
/// and softmax of the same program, both against the exact f64 attention — the fused form must
/// be as close as the unfused one (both carry TF32's rounding of the operands); the exact-f32
/// path checks the harness.
#[test]
#[ignore = "needs a GPU: cargo xtask conformance --only gpu"]
fn tf32_attention_in_one_launch_is_as_close_to_exact_as_the_tf32_gemms() {
    use petite_cuda::F32Matmul;
    let dev = Device::open().expect("a CUDA GPU (this test fails without one)");
    // [b, h, kvh, q, k, d, dv], heads split from [b, rows, heads · d] in place and merged after
    // (SigLIP's layout) or given whole.
    for (i, &([b, h, kvh, nq, nk, d, dv], split)) in [
        ([3, 16, 16, 256, 256, 72, 72], true),
        ([1, 4, 2, 100, 30, 16, 8], false),
        ([2, 2, 2, 1, 1, 8, 8], false),
        ([1, 2, 1, 70, 130, 64, 80], true),
    ]
    .iter()
    .enumerate()
    {
        let mut bld = Builder::new();
        let mut operand = |name: &str, heads: usize, rows: usize, dim: usize| {
            if split {
                let x = bld
                    .input(name, Dtype::F32, &[b, rows, heads * dim])
                    .unwrap();
                let x = bld.reshape(x, &[b, rows, heads, dim]).unwrap();
                bld.permute(x, &[0, 2, 1, 3]).unwrap()
            } else {
                bld.input(name, Dtype::F32, &[b, heads, rows, dim]).unwrap()
            }
        };
        let q = operand("q", h, nq, d);
        let k = operand("k", kvh, nk, d);
        let v = operand("v", kvh, nk, dv);
        let scale = (d as f64).powf(-0.5);
        let o = bld.attention(q, k, v, None, scale).unwrap();
        let o = if split {
            bld.permute(o, &[0, 2, 1, 3]).unwrap()
        } else {
            o
        };
        bld.output("o", o).unwrap();
        let p = bld.finish().unwrap();
        // Values of a few units: logits spread over several units after the scale.
        let vals = |n: usize, seed: u64| -> Vec<f32> {
            values(n, seed).into_iter().map(|x| x * 3.0).collect()
        };
        let (qn, kn, vn) = (b * h * nq * d, b * kvh * nk * d, b * kvh * nk * dv);
        let (qv, kv, vv) = (
            vals(qn, 40 + i as u64),
            vals(kn, 50 + i as u64),
            vals(vn, 60 + i as u64),
        );
        let shape = |heads: usize, rows: usize, dim: usize| {
            if split {
                vec![b, rows, heads * dim]
            } else {
                vec![b, heads, rows, dim]
            }
        };
        let ins = BTreeMap::from([
            (
                "q".to_string(),
                tensor(Dtype::F32, &shape(h, nq, d), qv.clone()),
            ),
            (
                "k".to_string(),
                tensor(Dtype::F32, &shape(kvh, nk, d), kv.clone()),
            ),
            (
                "v".to_string(),
                tensor(Dtype::F32, &shape(kvh, nk, dv), vv.clone()),
            ),
        ]);
        // Element (bb, hh, r, x) of an operand in its input layout.
        let at = |buf: &[f32],
                  heads: usize,
                  rows: usize,
                  dim: usize,
                  bb: usize,
                  hh: usize,
                  r: usize,
                  x: usize| {
            if split {
                buf[(bb * rows + r) * heads * dim + hh * dim + x]
            } else {
                buf[((bb * heads + hh) * rows + r) * dim + x]
            }
        };
        // The exact attention, in the output's layout.
        let mut exact = vec![0f64; b * h * nq * dv];
        for bb in 0..b {
            for hh in 0..h {
                let kh = hh / (h / kvh);
                for r in 0..nq {
                    let s: Vec<f64> = (0..nk)
                        .map(|j| {
                            (0..d)
                                .map(|x| {
                                    at(&qv, h, nq, d, bb, hh, r, x) as f64
                                        * at(&kv, kvh, nk, d, bb, kh, j, x) as f64
                                })
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for x in 0..dv {
                        let y: f64 = (0..nk)
                            .map(|j| e[j] / sum * at(&vv, kvh, nk, dv, bb, kh, j, x) as f64)
                            .sum();
                        let idx = if split {
                            ((bb * nq + r) * h + hh) * dv + x
                        } else {
                            ((bb * h + hh) * nq + r) * dv + x
                        };
                        exact[idx] = y;
                    }
                }
            }
        }
        let mut gp = DeviceProgram::load(&dev, &p, &NoWeights, false).unwrap();
        let mut run = |m: F32Matmul, fused: bool| {
            gp.set_f32_matmul(m);
            gp.set_tf32_attention(fused);
            let out = gp.run(ins.clone()).unwrap();
            errors(&out["o"].float_values().unwrap(), &exact)
        };
        let (em, _) = run(F32Matmul::Exact, true);
        let (um, ua) = run(F32Matmul::Tf32, false);
        let (fm, fa) = run(F32Matmul::Tf32, true);
        eprintln!(
            "case {i} {:?}: max/mean |x - exact|: exact f32 {em:.3e}, TF32 GEMMs {um:.3e}/{ua:.3e}, \
             one launch {fm:.3e}/{fa:.3e}",
            [b, h, kvh, nq, nk, d, dv]
        );
        assert!(em < 1e-5, "case {i}: the exact-f32 path is {em:e} off");
        // TF32 keeps 10 mantissa bits (cuBLAS runs some small shapes exact): the one-launch
        // form within twice the GEMMs' error or four TF32 roundings of the values' scale (the
        // values are within 3), its mean within twice theirs or a quarter rounding.
        let ulp = 3.0 * 2f64.powi(-10);
        assert!(
            fm <= (2.0 * um).max(4.0 * ulp),
            "case {i}: max {fm:e} vs {um:e}"
        );
        assert!(
            fa <= (2.0 * ua).max(ulp / 4.0),
            "case {i}: mean {fa:e} vs {ua:e}"
        );
    }
}

/// Quantized weights (issue 51): `pt_dequant` gives the reference executor's bits for every
/// code (all 256 int8 codes, all 254 finite FP8 E4M3 codes) into bf16 (eight codes a thread)
/// and f32 (a row of 12 codes: one a thread); linears of few bf16 rows read the codes
/// themselves (`pt_wq_gemm`: one split, and 50 rows × 300 features over K = 2048 in several
/// splits, a partial feature tile and a bias; splits of several steps with a shorter last one), those of more rows the dequantized weight
/// (cuBLAS), and all agree with the reference executor up to their sums' order.
#[test]
#[ignore = "needs a GPU: cargo xtask conformance --only gpu"]
fn dequantized_weights_give_the_reference_executors_bits() {
    use petite_cuda::fuse::Role;
    use petite_graph::quant::{Quant, quantize_weights, scale_name};
    let dev = Device::open().expect("a CUDA GPU (this test fails without one)");
    let mut b = Builder::new();
    let w0 = b.weight("w0", Dtype::Bf16, &[24, 64]).unwrap();
    let wf = b.cast(w0, Dtype::F32).unwrap();
    b.output("w", wf).unwrap();
    let x2 = b.input("x2", Dtype::F32, &[5, 12]).unwrap();
    let v = b.weight("v", Dtype::F32, &[7, 12]).unwrap();
    let y2 = b.linear(x2, v, None).unwrap();
    b.output("y2", y2).unwrap();
    let vo = b.mul_scalar(v, 1.0).unwrap();
    b.output("v", vo).unwrap();
    // (name, rows, features, in features, bias)
    let linears = [
        ("y", 50, 300, 2048, true),
        ("y5", 5, 24, 64, false),
        ("yb", 100, 40, 64, false),
        // Splits of several 32-column steps (shared memory reused within a block) whose last
        // split is shorter: kc = 96 over 7 splits, the last 64 columns; kc = 96 over 14, the
        // last 32 (pi0.5's step linears have kc = 64 and more).
        ("yk", 20, 4000, 640, false),
        ("y9", 9, 2100, 1280, true),
    ];
    for (name, rows, n, k, bias) in linears {
        let x = b
            .input(&format!("x_{name}"), Dtype::Bf16, &[rows, k])
            .unwrap();
        let w = b
            .weight(&format!("w_{name}"), Dtype::Bf16, &[n, k])
            .unwrap();
        let bb = bias.then(|| b.weight(&format!("b_{name}"), Dtype::Bf16, &[n]).unwrap());
        let y = b.linear(x, w, bb).unwrap();
        b.output(name, y).unwrap();
    }
    let plain = b.finish().unwrap();
    for quant in [Quant::Int8, Quant::Fp8E4M3] {
        let (p, done) = quantize_weights(&plain, quant, |w| !w.name.starts_with("b_")).unwrap();
        assert_eq!(done.names.len(), 7, "{:?}", done.names);
        // Which dequantizes the linears read themselves.
        let plan =
            petite_cuda::fuse::plan_program(&p, Options::new(fused_attention_queries((9, 0))))
                .unwrap();
        for id in p.ids() {
            if let petite_graph::Op::Dequantize { .. } = p.node(id).op {
                let reader = p.consumers()[id.index()].clone();
                let out = p.node(reader[0]).ty.clone();
                let weight_only = out.to_string().contains("bf16")
                    && reader
                        .iter()
                        .all(|c| matches!(p.node(*c).op, petite_graph::Op::Linear))
                    && p.node(p.node(reader[0]).inputs[0]).tensor().unwrap().shape[0] <= 64;
                assert_eq!(
                    plan.role[id.index()] == Role::WeightOnly,
                    weight_only,
                    "{}",
                    p.describe(id)
                );
            }
        }
        let mut weights = petite_reference::MemoryWeights::new();
        let mut ins = BTreeMap::from([(
            "x2".to_string(),
            tensor(Dtype::F32, &[5, 12], values(5 * 12, 4)),
        )]);
        let mut quantized = vec![("w0", 24, 64), ("v", 7, 12)];
        for (i, (name, rows, n, k, bias)) in linears.into_iter().enumerate() {
            quantized.push((["w_y", "w_y5", "w_yb", "w_yk", "w_y9"][i], n, k));
            ins.insert(
                format!("x_{name}"),
                tensor(Dtype::Bf16, &[rows, k], values(rows * k, 10 + i as u64)),
            );
            if bias {
                let bits: Vec<u16> = values(n, 20)
                    .iter()
                    .map(|v| petite_dtype::bf16_bits(*v))
                    .collect();
                weights
                    .insert_bf16_bits(&format!("b_{name}"), &[n], &bits)
                    .unwrap();
            }
        }
        for (name, rows, per) in quantized {
            let codes: Vec<u8> = (0..rows * per)
                .map(|i| {
                    let c = (i * 37 + i / per) as u8;
                    // FP8's two NaN codes become zero (a quantizer never writes them).
                    if quant == Quant::Fp8E4M3 && c & 0x7f == 0x7f {
                        0
                    } else {
                        c
                    }
                })
                .collect();
            if name == "w0" {
                let seen: std::collections::BTreeSet<u8> = codes.iter().copied().collect();
                assert!(seen.len() >= 254, "{} distinct codes", seen.len());
            }
            let scales: Vec<f32> = values(rows, 7)
                .iter()
                .map(|s| 0.001 + s.abs() * 0.01)
                .collect();
            weights
                .insert_bytes(name, Dtype::of_quant(quant), &[rows, per], codes)
                .unwrap();
            weights
                .insert_f32(&scale_name(name), &[rows], &scales)
                .unwrap();
        }
        let cpu = petite_reference::run(&p, &weights, ins.clone()).unwrap();
        let gp = DeviceProgram::load(&dev, &p, &weights, false).unwrap();
        let gpu = gp.run(ins).unwrap();
        for name in ["w", "v", "y2", "y", "y5", "yb"] {
            let (c, g) = (&cpu[name], &gpu[name]);
            assert_eq!(c.shape(), g.shape(), "{quant} {name}");
            let (c, g) = (c.float_values().unwrap(), g.float_values().unwrap());
            assert!(!c.is_empty() && c.len() == g.len(), "{quant} {name}");
            assert!(
                g.iter().all(|v| v.is_finite()),
                "{quant} {name}: not finite"
            );
            if name == "w" || name == "v" {
                let differ = c
                    .iter()
                    .zip(g.iter())
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                assert_eq!(differ, 0, "{quant} {name}: {differ} of {} differ", c.len());
            } else {
                // One bf16 rounding of each output apart (sums in another order), f32 sums
                // in another order (y2).
                let (mut worst, mut same) = (0f32, 0usize);
                for (x, y) in c.iter().zip(g.iter()) {
                    let tol = if name == "y2" {
                        1e-5 * x.abs().max(1.0)
                    } else {
                        x.abs() / 128.0 + 1e-3
                    };
                    worst = worst.max((x - y).abs() / tol);
                    same += usize::from(x.to_bits() == y.to_bits());
                }
                println!(
                    "case dequantize {quant} {name}: worst |gpu - cpu| {worst:.3} of its bound; {same} of {} bit-identical",
                    c.len()
                );
                assert!(worst <= 1.0, "{quant} {name}: {worst} of the bound");
            }
        }
    }
}
