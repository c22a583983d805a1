//! Whatever a client sends (through `petite serve` every field of an observation comes from the
//! network): random camera keys, dtypes, ranks and shapes (empty dims, wrong channel counts),
//! non-finite values, states, tasks, noise and RTC leftovers give `Policy::act` a chunk or one
//! error of one line, never a panic, and the policy answers a good call bit for bit as before
//! after each. A proptest run (384 cases, seeded) on the golden `two_cams_mqa` export.

mod common;

use std::collections::BTreeMap;

use common::Scratch;
use common::policy::{FRONT, exported, observation};
use petite::policy::{Array, Observation, OpenOptions, Options, Policy, Rtc, Schedule};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

fn floats(n: usize) -> impl Strategy<Value = Vec<f32>> {
    prop::collection::vec(
        prop_oneof![
            4 => -2.0f32..2.0,
            1 => Just(f32::NAN),
            1 => Just(f32::INFINITY),
            1 => Just(-1e30f32),
        ],
        n,
    )
}

/// A shape of up to rank 4 whose elements stay few (dims 0..70, at most 20,000 elements).
fn shape() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0usize..70, 0..=4)
        .prop_filter("small", |s| s.iter().product::<usize>() <= 20_000)
}

fn array() -> impl Strategy<Value = Array> {
    (shape(), any::<bool>()).prop_flat_map(|(s, u8s)| {
        let n = s.iter().product::<usize>();
        if u8s {
            prop::collection::vec(any::<u8>(), n)
                .prop_map(move |d| Array::u8(&s, d))
                .boxed()
        } else {
            floats(n).prop_map(move |d| Array::f32(&s, d)).boxed()
        }
    })
}

/// Mostly well-formed images (so the later checks are reached), the rest anything.
fn image() -> impl Strategy<Value = Array> {
    prop_oneof![
        6 => (1usize..70, 1usize..70, any::<u8>())
            .prop_map(|(h, w, v)| Array::u8(&[h, w, 3], vec![v; h * w * 3])),
        1 => (1usize..40, 1usize..40).prop_flat_map(|(h, w)| {
            prop::collection::vec(-0.5f32..1.5, 3 * h * w)
                .prop_map(move |d| Array::f32(&[3, h, w], d))
        }),
        1 => (1usize..40, 1usize..40).prop_flat_map(|(h, w)| {
            floats(3 * h * w).prop_map(move |d| Array::f32(&[3, h, w], d))
        }),
        2 => array(),
    ]
}

fn observation_any() -> impl Strategy<Value = Observation> {
    let key = prop_oneof![
        6 => Just(FRONT.to_string()),
        1 => Just("observation.images.empty_camera_0".to_string()),
        1 => Just("observation.images.wrist".to_string()),
        1 => Just(String::new()),
    ];
    (
        prop::collection::btree_map(key, image(), 0..=3),
        prop_oneof![
            6 => prop::collection::vec(-2.0f32..2.0, 5).prop_map(|d| Some(Array::f32(&[5], d))),
            1 => floats(5).prop_map(|d| Some(Array::f32(&[5], d))),
            1 => array().prop_map(Some),
            1 => Just(None),
        ],
        prop_oneof![
            4 => Just("pick".to_string()),
            1 => Just(String::new()),
            1 => Just("  ".to_string()),
            2 => "[a-z:,;\\u{e9}\\u{1F600} ]{0,40}",
        ],
    )
        .prop_map(|(images, state, task)| Observation {
            images,
            state,
            task,
        })
}

fn options_any() -> impl Strategy<Value = Options> {
    let rtc = (
        prop_oneof![
            4 => (0usize..9, 0usize..10).prop_flat_map(|(r, c)| {
                prop::collection::vec(-2.0f32..2.0, r * c)
                    .prop_map(move |d| Array::f32(&[r, c], d))
            }),
            1 => (0usize..9, 0usize..10).prop_flat_map(|(r, c)| {
                floats(r * c).prop_map(move |d| Array::f32(&[r, c], d))
            }),
            1 => array(),
        ],
        0usize..12,
        prop::option::of(0usize..12),
        prop::option::of(prop_oneof![
            Just(Schedule::Zeros),
            Just(Schedule::Ones),
            Just(Schedule::Linear),
            Just(Schedule::Exp),
        ]),
        prop::option::of(prop_oneof![
            Just(-1.0f32),
            Just(0.0),
            Just(5.0),
            Just(f32::NAN)
        ]),
    )
        .prop_map(|(prev, delay, horizon, schedule, weight)| Rtc {
            prev_chunk_left_over: prev,
            inference_delay: delay,
            execution_horizon: horizon,
            schedule,
            max_guidance_weight: weight,
        });
    (
        prop_oneof![
            3 => Just(None),
            1 => floats(48).prop_map(Some),
            1 => (0usize..100).prop_flat_map(floats).prop_map(Some),
        ],
        prop::option::of(any::<u64>()),
        prop_oneof![1 => Just(None), 2 => rtc.prop_map(Some)],
    )
        .prop_map(|(noise, seed, rtc)| Options { noise, seed, rtc })
}

#[test]
fn any_observation_gives_a_chunk_or_one_error_and_the_policy_stays_usable() {
    let s = Scratch::new("policy-fuzz");
    let (dir, tok) = exported(&s);
    let p = Policy::open(
        &dir,
        &OpenOptions {
            tokenizer: Some(tok),
            ..OpenOptions::default()
        },
    )
    .unwrap();
    let good = observation(1, "pick");
    let seeded = Options {
        seed: Some(3),
        ..Options::default()
    };
    let want = p.act(&good, &seeded).unwrap().actions;
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases: 384,
            failure_persistence: None,
            ..Config::default()
        },
        TestRng::deterministic_rng(RngAlgorithm::ChaCha),
    );
    let seen = std::cell::RefCell::new((0usize, BTreeMap::<String, usize>::new()));
    runner
        .run(&(observation_any(), options_any()), |(obs, opts)| {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                p.act(&obs, &opts).map_err(|e| e.to_string())
            }));
            let Ok(r) = r else {
                return Err(TestCaseError::fail("Policy::act panicked"));
            };
            match r {
                Ok(c) => {
                    prop_assert!(c.actions.iter().all(|v| v.is_finite()), "{c:?}");
                    seen.borrow_mut().0 += 1;
                }
                Err(m) => {
                    prop_assert!(!m.is_empty() && !m.contains('\n'), "{m:?}");
                    // The key or field named first (`observation.state`, `noise`, …).
                    let what = m.split(':').next().unwrap_or("").to_string();
                    *seen.borrow_mut().1.entry(what).or_default() += 1;
                }
            }
            let again = p
                .act(&good, &seeded)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&again.actions, &want);
            Ok(())
        })
        .unwrap();
    let (chunks, refused) = seen.into_inner();
    eprintln!("384 random calls: {chunks} chunks, refused by what they named first: {refused:?}");
    assert!(!refused.is_empty(), "every random call was accepted");
    assert!(
        chunks > 0,
        "no random call was accepted: the accepted paths went unexercised"
    );
    // Found by this test: a leftover of rank 1 (or a shape its values do not fill) was indexed
    // as `[rows, cols]` and panicked.
    for prev in [
        Array::f32(&[5], vec![0.5; 5]),
        Array::F32 {
            shape: vec![2, 3],
            data: vec![0.5; 4],
        },
    ] {
        let rtc = Rtc {
            prev_chunk_left_over: prev,
            inference_delay: 1,
            execution_horizon: None,
            schedule: None,
            max_guidance_weight: None,
        };
        let opts = Options {
            rtc: Some(rtc),
            seed: Some(3),
            ..Options::default()
        };
        let e = p.act(&good, &opts).unwrap_err().to_string();
        assert!(e.contains("`rtc.prev_chunk_left_over`"), "{e}");
    }
    // A shape claiming more elements than a usize counts is refused by its key, not overflowed.
    let mut huge = good.clone();
    huge.images.insert(
        FRONT.to_string(),
        Array::U8 {
            shape: vec![1 << 40, 1 << 40, 3],
            data: vec![0; 12],
        },
    );
    let e = p.act(&huge, &seeded).unwrap_err().to_string();
    assert!(e.contains(FRONT) && e.contains("fewer elements"), "{e}");
}
