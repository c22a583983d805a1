//! `petite::policy::Policy`: an export opened once and acting any number of times — the same
//! chunk as a fresh `petite act` process, resident state that never leaks between calls, bad
//! observations refused naming the key with the policy still usable afterwards, calls from
//! several threads each given its own answer, fresh noise unless a seed or noise is given.
//! (lerobot's numerics through the same code are the `lerobot-policy` conformance tier's.)

mod common;

use std::path::Path;

use common::{Scratch, ok, petite};
use petite::policy::{ActionChunk, Array, Observation, OpenOptions, Options, Policy, Rtc};

use common::policy::{FRONT, STATE, exported, observation};

fn open(dir: &Path, tok: &Path) -> Policy {
    Policy::open(
        dir,
        &OpenOptions {
            tokenizer: Some(tok.to_path_buf()),
            ..OpenOptions::default()
        },
    )
    .unwrap()
}

fn seeded(seed: u64) -> Options {
    Options {
        seed: Some(seed),
        ..Options::default()
    }
}

/// Seeded noise, with real-time chunking toward `prev` (model space).
fn rtc(prev: Array, inference_delay: usize, max_guidance_weight: Option<f32>) -> Options {
    Options {
        rtc: Some(Rtc {
            prev_chunk_left_over: prev,
            inference_delay,
            execution_horizon: None,
            schedule: None,
            max_guidance_weight,
        }),
        ..seeded(5)
    }
}

fn finite(c: &ActionChunk) {
    assert_eq!(c.actions.len(), c.chunk * c.action_dim);
    assert_eq!(c.model.len(), c.chunk * c.action_dim);
    assert!(c.actions.iter().chain(&c.model).all(|v| v.is_finite()));
}

#[test]
fn one_policy_acts_many_times_as_a_fresh_process_does() {
    let s = Scratch::new("many");
    let (dir, tok) = exported(&s);
    let p = open(&dir, &tok);
    let info = p.info().clone();
    assert_eq!(
        (info.chunk, info.action_dim, info.max_action_dim),
        (6, 4, 8)
    );
    assert_eq!(info.state_dim, 5);
    assert_eq!(info.cameras.len(), 2);
    let a = p.act(&observation(1, "pick"), &seeded(0)).unwrap();
    let b = p.act(&observation(2, "place"), &seeded(0)).unwrap();
    let a2 = p.act(&observation(1, "pick"), &seeded(0)).unwrap();
    finite(&a);
    // Resident programs keep nothing from one call to the next.
    assert_eq!(a, a2);
    assert_ne!(a.actions, b.actions);
    // Identity normalization: the actions are the model's chunk.
    assert_eq!(a.actions, a.model);

    // A fresh `petite act` process (its own open) gives the same chunk, bit for bit.
    let obs_file = s.0.join("obs.safetensors");
    let o = observation(1, "pick");
    let (img, state) = match (&o.images[FRONT], o.state.as_ref().unwrap()) {
        (Array::U8 { data, .. }, Array::F32 { data: st, .. }) => (data.clone(), st.clone()),
        _ => unreachable!(),
    };
    let st_bytes: Vec<u8> = state.iter().flat_map(|v| v.to_le_bytes()).collect();
    let views = vec![
        (
            FRONT.to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![48, 64, 3], &img)
                .unwrap(),
        ),
        (
            STATE.to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![5], &st_bytes)
                .unwrap(),
        ),
    ];
    std::fs::write(&obs_file, safetensors::serialize(views, None).unwrap()).unwrap();
    let out_file = s.0.join("act.safetensors");
    let timing = s.0.join("timing.json");
    let o = ok(petite()
        .args([
            "act",
            "--task",
            "pick",
            "--seed",
            "0",
            "--repeat",
            "3",
            "--pte-dir",
        ])
        .arg(&dir)
        .arg("--observation")
        .arg(&obs_file)
        .arg("--tokenizer")
        .arg(&tok)
        .arg("--timing-json")
        .arg(&timing)
        .arg("--out")
        .arg(&out_file)
        .output()
        .unwrap());
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(
        said.contains("3 calls: ") && said.contains("the chunk alone"),
        "{said}"
    );
    // The first call and three repeats (each the same chunk: the CLI checks), timed by part.
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&timing).unwrap()).unwrap();
    let calls = t["calls"].as_array().unwrap();
    assert_eq!(calls.len(), 4);
    for c in calls {
        let (chunk, total) = (
            c["chunk_s"].as_f64().unwrap(),
            c["total_s"].as_f64().unwrap(),
        );
        assert!(chunk > 0.0 && total >= chunk, "{c}");
    }
    assert!(t["open_s"].as_f64().unwrap() > 0.0);
    let bytes = std::fs::read(&out_file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let acted: Vec<f32> = st
        .tensor("action")
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(acted, a.actions);
}

#[test]
fn bad_observations_are_refused_by_key_and_the_policy_stays_usable() {
    let s = Scratch::new("bad");
    let (dir, tok) = exported(&s);
    let p = open(&dir, &tok);
    let good = p.act(&observation(3, "pick"), &seeded(5)).unwrap();
    let with = |f: &dyn Fn(&mut Observation)| {
        let mut o = observation(3, "pick");
        f(&mut o);
        o
    };
    let cases: Vec<(Observation, Options, &str)> = vec![
        (
            with(&|o| o.state = None),
            seeded(5),
            "`observation.state`: expected f32 [5], found nothing",
        ),
        (
            with(&|o| o.state = Some(Array::f32(&[5], vec![0.0, f32::NAN, 0.0, 0.0, 0.0]))),
            seeded(5),
            "`observation.state`: expected finite values, found NaN at 1",
        ),
        (
            with(&|o| o.state = Some(Array::f32(&[6], vec![0.0; 6]))),
            seeded(5),
            "`observation.state`: expected f32 [5], found F32 [6]",
        ),
        (
            with(&|o| {
                o.images.insert(
                    FRONT.into(),
                    Array::f32(&[48, 64, 3], vec![0.5; 48 * 64 * 3]),
                );
            }),
            seeded(5),
            "`observation.images.front`: expected float32 [3, H, W] in [0, 1] or uint8 [H, W, 3], found F32 [48, 64, 3]",
        ),
        (
            with(&|o| {
                o.images.insert(
                    "observation.images.wrist".into(),
                    Array::u8(&[2, 2, 3], vec![0; 12]),
                );
            }),
            seeded(5),
            "`observation.images.wrist`: expected one of observation.images.front, observation.images.empty_camera_0, found an unknown camera key",
        ),
        (
            with(&|o| {
                o.images.insert(
                    FRONT.into(),
                    Array::u8(&[2, 48, 64, 3], vec![0; 2 * 48 * 64 * 3]),
                );
            }),
            seeded(5),
            "a batch of 2 observations",
        ),
        (with(&|o| o.images.clear()), seeded(5), "no camera image"),
        (with(&|o| o.task = "  ".into()), seeded(5), "`task`: empty"),
        (
            observation(3, "pick"),
            Options {
                noise: Some(vec![0.0; 47]),
                ..Options::default()
            },
            "`noise`: expected f32 [6, 8] (48 values), found 47 values",
        ),
        (
            observation(3, "pick"),
            Options {
                noise: Some(vec![f32::INFINITY; 48]),
                ..Options::default()
            },
            "`noise`: expected finite values, found inf at 0",
        ),
        // Real-time chunking: a leftover wider than the action space (4), longer than the
        // chunk (6), not finite, batched; a guidance weight that is not positive.
        (
            observation(3, "pick"),
            rtc(Array::f32(&[2, 5], vec![0.0; 10]), 1, None),
            "`rtc.prev_chunk_left_over`: expected f32 [rows ≤ 6, columns ≤ 4] (model space), found F32 [2, 5]",
        ),
        (
            observation(3, "pick"),
            rtc(Array::f32(&[7, 4], vec![0.0; 28]), 1, None),
            "`rtc.prev_chunk_left_over`: expected f32 [rows ≤ 6",
        ),
        (
            observation(3, "pick"),
            rtc(
                Array::f32(&[2, 4], vec![0.0, 1.0, f32::NAN, 0.0, 0.0, 0.0, 0.0, 0.0]),
                1,
                None,
            ),
            "`rtc.prev_chunk_left_over`: expected finite values, found NaN at index 2",
        ),
        (
            observation(3, "pick"),
            rtc(Array::f32(&[2, 2, 4], vec![0.0; 16]), 1, None),
            "a batch of 2 observations",
        ),
        (
            observation(3, "pick"),
            rtc(Array::f32(&[2, 4], vec![0.0; 8]), 1, Some(-1.0)),
            "`rtc.max_guidance_weight`: expected a finite number > 0, found -1",
        ),
    ];
    for (o, opts, want) in cases {
        let e = p.act(&o, &opts).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(want), "{msg}\n  wanted: {want}");
        assert!(!msg.contains('\n'), "one line: {msg}");
        // Still usable, and unchanged.
        assert_eq!(p.act(&observation(3, "pick"), &seeded(5)).unwrap(), good);
    }
    // A batch of one is the observation itself.
    let one = with(&|o| {
        let Array::U8 { data, .. } = o.images[FRONT].clone() else {
            unreachable!()
        };
        o.images
            .insert(FRONT.into(), Array::u8(&[1, 48, 64, 3], data));
        o.state = Some(Array::f32(
            &[1, 5],
            match o.state.clone().unwrap() {
                Array::F32 { data, .. } => data,
                _ => unreachable!(),
            },
        ));
    });
    assert_eq!(p.act(&one, &seeded(5)).unwrap(), good);
}

#[test]
fn threads_share_one_policy_and_each_gets_its_own_chunk() {
    fn shared<T: Send + Sync>(_: &T) {}
    let s = Scratch::new("threads");
    let (dir, tok) = exported(&s);
    let p = open(&dir, &tok);
    shared(&p);
    let want: Vec<ActionChunk> = (0..4u8)
        .map(|k| p.act(&observation(k, "pick"), &seeded(k as u64)).unwrap())
        .collect();
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..4u8)
            .map(|t| {
                let (p, want) = (&p, &want);
                sc.spawn(move || {
                    for i in 0..5u8 {
                        let k = (t + i) % 4;
                        let got = p.act(&observation(k, "pick"), &seeded(k as u64)).unwrap();
                        assert_eq!(got, want[k as usize], "thread {t} call {i}");
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    });
}

#[test]
fn noise_is_fresh_each_call_unless_given_or_seeded() {
    let s = Scratch::new("noise");
    let (dir, tok) = exported(&s);
    let p = open(&dir, &tok);
    let o = observation(4, "pick");
    let a = p.act(&o, &Options::default()).unwrap();
    let b = p.act(&o, &Options::default()).unwrap();
    finite(&a);
    assert_ne!(a.model, b.model, "two calls drew the same noise");
    assert_eq!(
        p.act(&o, &seeded(9)).unwrap(),
        p.act(&o, &seeded(9)).unwrap()
    );
    let noise: Vec<f32> = (0..48).map(|i| ((i % 7) as f32 - 3.0) / 3.0).collect();
    let given = Options {
        noise: Some(noise.clone()),
        ..Options::default()
    };
    let c = p.act(&o, &given).unwrap();
    assert_eq!(c, p.act(&o, &given).unwrap());
    assert_ne!(c.model, a.model);
    // A policy opened with a seed draws the same stream as another opened with it.
    let q = |seed| {
        Policy::open(
            &dir,
            &OpenOptions {
                tokenizer: Some(tok.clone()),
                seed: Some(seed),
                ..OpenOptions::default()
            },
        )
        .unwrap()
    };
    let (q1, q2) = (q(11), q(11));
    assert_eq!(
        q1.act(&o, &Options::default()).unwrap(),
        q2.act(&o, &Options::default()).unwrap()
    );
}

/// Real-time chunking through the policy: a guided chunk moves toward the leftover (its first,
/// fully weighted rows much closer than the plain chunk's), a schedule that weights no row
/// (ZEROS, delay 0) is the plain chunk bit for bit, the call's settings override the export's
/// defaults (lerobot's LINEAR, 10, 10 here), and a guided call repeats exactly. The comparison
/// with lerobot's own RTC is the lerobot-policy tier's.
#[test]
fn real_time_chunking_guides_the_chunk_toward_the_leftover() {
    use petite::policy::Schedule;
    let s = Scratch::new("rtc");
    let (dir, tok) = exported(&s);
    let p = open(&dir, &tok);
    let d = &p.info().rtc;
    assert_eq!(
        (d.schedule, d.max_guidance_weight, d.execution_horizon),
        (Schedule::Linear, 10.0, 10)
    );
    let o = observation(2, "pick");
    let plain = p.act(&o, &seeded(5)).unwrap();
    // The leftover: 5 rows of 4, far from the plain chunk.
    let prev: Vec<f32> = (0..20).map(|i| 3.0 + (i % 4) as f32).collect();
    let guided = p
        .act(&o, &rtc(Array::f32(&[5, 4], prev.clone()), 2, None))
        .unwrap();
    finite(&guided);
    // Fails on a non-finite value or a short row (a NaN must not read as "close").
    let dist = |c: &ActionChunk, row: usize| -> f32 {
        let r = row * 4..row * 4 + 4;
        petite_reference::compare::max_abs_diff(&c.model[r.clone()], &prev[r]).unwrap()
    };
    for row in 0..2 {
        assert!(
            dist(&guided, row) < 0.5 * dist(&plain, row),
            "row {row}: guided {} vs plain {} from the leftover",
            dist(&guided, row),
            dist(&plain, row)
        );
    }
    assert_eq!(
        guided,
        p.act(&o, &rtc(Array::f32(&[5, 4], prev.clone()), 2, None))
            .unwrap()
    );
    let mut zeros = rtc(Array::f32(&[1, 5, 4], prev.clone()), 0, None);
    if let Some(r) = zeros.rtc.as_mut() {
        r.schedule = Some(Schedule::Zeros);
    }
    assert_eq!(p.act(&o, &zeros).unwrap(), plain);
    // Another weight and horizon give another chunk.
    let mut other = rtc(Array::f32(&[5, 4], prev.clone()), 2, Some(2.0));
    if let Some(r) = other.rtc.as_mut() {
        r.execution_horizon = Some(3);
    }
    let o2 = p.act(&o, &other).unwrap();
    assert_ne!(o2.model, guided.model);
    assert_ne!(o2.model, plain.model);
}
