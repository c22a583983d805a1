//! What `petite serve` adds to a chunk: one `Client::act` round trip on loopback with a
//! full-size pi0.5 observation (three 224×224 RGB cameras, an 8-wide state, a task) and a
//! 50×32 reply, against a backend that answers at once, so only the transport is timed (the
//! client's encode, HTTP/2 both ways, the server's decode and encode, the client's decode).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use petite_serve::{
    Array, Backend, Call, Camera, Chunk, Client, Options, PolicyInfo, Refusal, Server,
};

const CAMERAS: [&str; 3] = [
    "observation.images.base_0_rgb",
    "observation.images.left_wrist_0_rgb",
    "observation.images.right_wrist_0_rgb",
];

/// Answers every call with the same chunk, at once.
struct Instant;

impl Backend for Instant {
    fn info(&self) -> PolicyInfo {
        PolicyInfo {
            export_id: "bench".into(),
            device: "cpu".into(),
            cameras: CAMERAS
                .iter()
                .map(|k| Camera {
                    key: (*k).into(),
                    empty: false,
                })
                .collect(),
            state_dim: 8,
            action_dim: 32,
            max_action_dim: 32,
            chunk: 50,
            n_action_steps: 50,
            ..PolicyInfo::default()
        }
    }

    fn act(&self, call: Call) -> Result<Chunk, Refusal> {
        Ok(Chunk {
            actions: vec![0.5; 50 * 32],
            model: vec![0.25; 50 * 32],
            chunk: 50,
            action_dim: 32,
            n_action_steps: 50,
            prompt: call.task,
            ..Chunk::default()
        })
    }
}

fn transport(c: &mut Criterion) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt
        .block_on(Server::start(
            Arc::new(Instant),
            &Options {
                listen: "127.0.0.1:0".parse().unwrap(),
                max_message_bytes: 4 << 20,
                queue: 1,
            },
        ))
        .unwrap();
    let client = Client::connect(
        &server.local_addr().to_string(),
        Duration::from_secs(5),
        None,
    )
    .unwrap();
    let mut observation: BTreeMap<String, Array> = CAMERAS
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let data = (0..224 * 224 * 3)
                .map(|j| ((i * 31 + j) % 251) as u8)
                .collect();
            (
                (*k).to_string(),
                Array::U8 {
                    shape: vec![224, 224, 3],
                    data,
                },
            )
        })
        .collect();
    observation.insert(
        "observation.state".into(),
        Array::F32 {
            shape: vec![8],
            data: vec![0.1; 8],
        },
    );
    let call = Call {
        observation,
        task: "pick up the red block".into(),
        noise: None,
        seed: Some(0),
        rtc: None,
    };
    let r = client.act(&call).unwrap();
    assert_eq!(r.chunk.actions.len(), 50 * 32);
    let mut g = c.benchmark_group("serve");
    g.sample_size(200);
    g.bench_function("act_loopback_3x224x224", |b| {
        b.iter(|| client.act(&call).unwrap())
    });
    g.finish();
    rt.block_on(server.shutdown()).unwrap();
}

criterion_group!(benches, transport);
criterion_main!(benches);
