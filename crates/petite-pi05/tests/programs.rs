//! The three programs: valid for real and small configs, no dead work, and each reads exactly
//! the weights it should.
use std::collections::BTreeSet;

use petite_graph::{Dtype, Op, Program};
use petite_pi05::names::{self, Part, StoredDtype};
use petite_pi05::programs::{io, time_row_len, time_sinusoid};
use petite_pi05::{Pi05Config, Precision, build_all};

fn weight_names(p: &Program) -> BTreeSet<String> {
    p.weights().into_iter().map(|w| w.name).collect()
}

fn names_where(cfg: &Pi05Config, f: impl Fn(&names::TensorSpec) -> bool) -> BTreeSet<String> {
    names::lerobot_tensors(cfg)
        .into_iter()
        .filter(|t| f(t))
        .map(|t| t.name)
        .collect()
}

fn check(cfg: &Pi05Config, prec: Precision) {
    let p = build_all(cfg, prec).unwrap();
    let last = cfg.language.depth - 1;
    for prog in [&p.timestep_table, &p.prefix, &p.step] {
        prog.validate().unwrap();
        assert!(
            prog.dead_nodes().is_empty(),
            "dead nodes: {:?}",
            prog.dead_nodes()
        );
    }
    // Timestep table: the time MLP and every adaRMS dense, nothing else.
    let want = names_where(cfg, |t| {
        matches!(
            t.part,
            Part::TimeMlp | Part::ExpertAdaRms(_) | Part::ExpertNorm
        )
    });
    assert_eq!(weight_names(&p.timestep_table), want);
    // Prefix: SigLIP, projector, embedding, language layers; the last layer only up to K/V.
    let last_kv: BTreeSet<String> = [
        "input_layernorm.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ]
    .iter()
    .map(|s| names::language_layer(last, s))
    .collect();
    let want = names_where(cfg, |t| match t.part {
        Part::Vision | Part::Projector | Part::Embed => true,
        Part::Language(i) => i < last || last_kv.contains(&t.name),
        _ => false,
    });
    assert_eq!(weight_names(&p.prefix), want);
    // Step: expert attention/MLP and the action projections; no dense, no time MLP.
    let want = names_where(cfg, |t| {
        matches!(t.part, Part::Expert(_) | Part::ActionProj)
    });
    assert_eq!(weight_names(&p.step), want);
    // Nobody reads an lm_head or the language final norm.
    for prog in [&p.timestep_table, &p.prefix, &p.step] {
        let w = weight_names(prog);
        assert!(!w.contains(names::PALIGEMMA_LM_HEAD));
        assert!(!w.contains(names::EXPERT_LM_HEAD));
        assert!(!w.iter().any(|n| n.ends_with("language_model.norm.weight")));
    }
    // Weight dtypes: f32 mode all f32; bf16 mode lerobot's mixed dtypes.
    let stored: std::collections::HashMap<String, StoredDtype> = names::lerobot_tensors(cfg)
        .into_iter()
        .map(|t| (t.name, t.bf16_mode_dtype))
        .collect();
    for prog in [&p.timestep_table, &p.prefix, &p.step] {
        for w in prog.weights() {
            let want = match (prec, stored[&w.name]) {
                (Precision::Bf16, StoredDtype::Bf16) => Dtype::Bf16,
                _ => Dtype::F32,
            };
            assert_eq!(w.dtype, want, "{}", w.name);
        }
    }
    // Interfaces.
    let table = p.timestep_table.output_by_name(io::TIMESTEP_TABLE).unwrap();
    assert_eq!(
        p.timestep_table.node(table).tensor().unwrap().shape,
        [cfg.steps, time_row_len(cfg)]
    );
    let act = if prec == Precision::F32 {
        Dtype::F32
    } else {
        Dtype::Bf16
    };
    for i in 0..cfg.language.depth {
        for name in [io::prefix_k(i), io::prefix_v(i)] {
            let v = p.prefix.output_by_name(&name).unwrap();
            let t = p.prefix.node(v).tensor().unwrap();
            assert_eq!(
                t.shape,
                [
                    1,
                    cfg.language.kv_heads,
                    cfg.prefix_len(),
                    cfg.language.head_dim
                ]
            );
            assert_eq!(t.dtype, act);
            let si = p.step.input_by_name(&name).unwrap();
            assert_eq!(p.step.node(si).tensor().unwrap(), t, "{name}");
        }
    }
    assert_eq!(p.prefix.outputs.len(), 2 * cfg.language.depth + 1);
    // x_t, time_row, the pad mask, RTC's rtc_prev, rtc_weights and rtc_step, and the K/V.
    assert_eq!(p.step.inputs.len(), 2 * cfg.language.depth + 6);
    for (name, shape) in [
        (io::RTC_PREV, vec![cfg.chunk, cfg.action_dim]),
        (io::RTC_WEIGHTS, vec![cfg.chunk, 1]),
        (io::RTC_STEP, vec![2]),
    ] {
        let i = p.step.input_by_name(name).unwrap();
        let t = p.step.node(i).tensor().unwrap();
        assert_eq!((t.dtype, t.shape.to_vec()), (Dtype::F32, shape), "{name}");
    }
    let xn = p.step.output_by_name(io::X_NEXT).unwrap();
    assert_eq!(
        p.step.node(xn).tensor().unwrap().shape,
        [cfg.chunk, cfg.action_dim]
    );
    assert_eq!(p.step.node(xn).tensor().unwrap().dtype, Dtype::F32);
    // Exactly one fused attention per SigLIP layer, per non-last language layer, per expert layer.
    let count = |prog: &Program, f: fn(&Op) -> bool| prog.nodes.iter().filter(|n| f(&n.op)).count();
    let attn = |o: &Op| matches!(o, Op::Attention { .. });
    // bf16 follows transformers' eager attention op by op (matmul, scale, mask, softmax, matmul).
    let fused = if prec == Precision::F32 { 1 } else { 0 };
    assert_eq!(count(&p.prefix, attn), cfg.vision.layers + fused * last);
    assert_eq!(count(&p.step, attn), fused * cfg.expert.depth);
    let softmax = |o: &Op| matches!(o, Op::Softmax { .. });
    assert_eq!(count(&p.prefix, softmax), (1 - fused) * last);
    assert_eq!(count(&p.step, softmax), (1 - fused) * cfg.expert.depth);
    let rope = |o: &Op| matches!(o, Op::Rope);
    assert_eq!(count(&p.prefix, rope), fused * (2 * last + 1));
    assert_eq!(count(&p.step, rope), fused * 2 * cfg.expert.depth);
    assert_eq!(
        count(&p.timestep_table, |o| matches!(o, Op::Input { .. })),
        0
    );
}

#[test]
fn small_programs_validate_f32_and_bf16() {
    check(&Pi05Config::small(), Precision::F32);
    check(&Pi05Config::small(), Precision::Bf16);
    // A small table fits one shard: the plain embedding, no row ranges (same program as before).
    for prec in [Precision::F32, Precision::Bf16] {
        let p = petite_pi05::build_prefix(&Pi05Config::small(), prec).unwrap();
        assert!(p.weights().iter().all(|w| w.rows.is_none()));
    }
}

/// Seconds of CPU this thread has used.
fn thread_cpu_seconds() -> f64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a live timespec; CLOCK_THREAD_CPUTIME_ID needs no other precondition.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(r, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

#[test]
fn real_programs_validate_and_build_in_milliseconds() {
    let cfg = Pi05Config::default();
    // CPU time of this thread, not wall time: on a loaded machine (parallel builds, many test
    // threads on few cores) wall time measures the scheduler, and the bound would fail at random.
    let t0 = thread_cpu_seconds();
    let p = build_all(&cfg, Precision::Bf16).unwrap();
    let ms = (thread_cpu_seconds() - t0) * 1e3;
    eprintln!(
        "real config, 3 programs built+validated in {ms:.1} ms of CPU: nodes table {} prefix {} step {}",
        p.timestep_table.len(),
        p.prefix.len(),
        p.step.len()
    );
    assert!(ms < 1000.0, "building took {ms} ms");
    check(&cfg, Precision::F32);
    check(&cfg, Precision::Bf16);
    // Weight counts: table 2 (time MLP) ×2 + 37 dense ×2; prefix 437 + 2 + 1 + 17×9 + 3, with
    // the token embedding as 16 row ranges of ≤ 64 MiB (bf16) instead of 1; step 18×7 + 4.
    assert_eq!(p.timestep_table.weights().len(), 4 + 74);
    assert_eq!(p.prefix.weights().len(), 437 + 2 + 16 + 17 * 9 + 3);
    let embed: Vec<_> = p
        .prefix
        .weights()
        .into_iter()
        .filter(|w| w.name == petite_pi05::names::EMBED_TOKENS)
        .collect();
    assert!(
        embed
            .iter()
            .all(|w| w.bytes <= 64 << 20 && w.rows.is_some())
    );
    assert_eq!(
        embed.iter().map(|w| w.bytes).sum::<usize>(),
        257_152 * 2048 * 2
    );
    let f32_prefix = petite_pi05::build_prefix(&cfg, Precision::F32).unwrap();
    let n = f32_prefix
        .weights()
        .iter()
        .filter(|w| w.rows.is_some())
        .count();
    assert_eq!(n, 32, "f32: 2009 MiB in 64 MiB shards");
    assert_eq!(p.step.weights().len(), 18 * 7 + 4);
    // Bytes the step program streams in bf16 mode: expert attn+MLP (bf16) + f32 heads.
    assert_eq!(p.step.weight_bytes(), 622_854_144 + 266_368);
}

#[test]
fn time_sinusoid_matches_hand_values() {
    let cfg = Pi05Config::default();
    let emb = time_sinusoid(&cfg);
    assert_eq!(emb.len(), 10 * 1024);
    // t = 1, fraction 0 → period 4e-3 → sin(2π/4e-3 · 1) = sin(500π) ≈ 0; cos ≈ 1.
    let x = 2.0 * std::f64::consts::PI / 0.004;
    assert_eq!(emb[0], x.sin() as f32);
    assert_eq!(emb[512], x.cos() as f32);
    // Last frequency: period 4.0 → 2π/4 · t.
    let t1 = 0.9f32 as f64;
    assert_eq!(
        emb[1024 + 511],
        (std::f64::consts::PI / 2.0 * t1).sin() as f32
    );
}

#[test]
fn rope_inv_freq_hand_values_and_bf16_rounding() {
    use petite_pi05::programs::inv_freq;
    let cfg = Pi05Config::default();
    let f = inv_freq(&cfg, Precision::F32);
    assert_eq!(f.len(), 128);
    assert_eq!(f[0], 1.0);
    // 1 / 10000^(2/256) = 0.930572...
    // A six-digit constant (half an ulp of the 6th digit is 5e-7) and a libm powf vs itself.
    assert!((f[1] - 0.930_572).abs() < 1e-6, "{}", f[1]);
    assert!((f[127] - 1.0 / 10000f32.powf(254.0 / 256.0)).abs() < 1e-9);
    // bf16 mode: every value is representable in bf16 and within half a bf16 ulp of f32's.
    let b = inv_freq(&cfg, Precision::Bf16);
    for (x, y) in f.iter().zip(&b) {
        assert_eq!(y.to_bits() & 0xffff, 0, "{y} is not a bf16 value");
        assert!((x - y).abs() <= x.abs() * 2f32.powi(-8), "{x} vs {y}");
    }
    assert_ne!(f, b);
}
