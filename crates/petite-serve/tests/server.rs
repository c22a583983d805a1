//! The server's behaviour with a stand-in backend whose calls can be held: the queue's bound
//! (exactly `queue + 1` calls in, the next refused), refusals by status code while other calls
//! are in flight, deadlines, and a graceful shutdown that finishes the calls in flight.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use petite_serve::pb::policy_client::PolicyClient;
use petite_serve::pb::{self, Tensor};
use petite_serve::{Array, Backend, Call, Camera, Chunk, Options, PolicyInfo, Refusal, Server};
use tonic::Code;
use tonic::transport::Channel;

/// A backend that answers `actions = [state[0] + seed]` once its gate is open, and counts the
/// calls inside it.
#[derive(Default)]
struct Held {
    state: Mutex<(bool, usize)>,
    changed: Condvar,
}

impl Held {
    fn open(&self, open: bool) {
        self.state.lock().unwrap().0 = open;
        self.changed.notify_all();
    }

    /// Waits until `n` calls are inside.
    fn wait_inside(&self, n: usize) {
        let g = self.state.lock().unwrap();
        let (_g, t) = self
            .changed
            .wait_timeout_while(g, Duration::from_secs(20), |s| s.1 != n)
            .unwrap();
        assert!(!t.timed_out(), "never {n} calls inside");
    }
}

impl Backend for Held {
    fn info(&self) -> PolicyInfo {
        PolicyInfo {
            export_id: "test".into(),
            device: "cpu".into(),
            cameras: vec![Camera {
                key: "observation.images.front".into(),
                empty: false,
            }],
            state_dim: 1,
            action_dim: 1,
            max_action_dim: 2,
            chunk: 1,
            n_action_steps: 1,
            ..PolicyInfo::default()
        }
    }

    fn act(&self, call: Call) -> Result<Chunk, Refusal> {
        let x = match call.observation.get("observation.state") {
            Some(Array::F32 { data, .. }) if data.len() == 1 => data[0],
            _ => {
                return Err(Refusal::Invalid(
                    "`observation.state`: expected f32 [1]".into(),
                ));
            }
        };
        let mut g = self.state.lock().unwrap();
        g.1 += 1;
        self.changed.notify_all();
        let mut g = self.changed.wait_while(g, |s| !s.0).unwrap();
        g.1 -= 1;
        self.changed.notify_all();
        let v = x + call.seed.unwrap_or(0) as f32;
        Ok(Chunk {
            actions: vec![v],
            model: vec![-v],
            chunk: 1,
            action_dim: 1,
            n_action_steps: 1,
            prompt: call.task,
            tokens: vec![1, 2],
            token_mask: vec![1, 0],
        })
    }
}

fn request(x: f32, seed: u64) -> pb::ActRequest {
    pb::ActRequest {
        observation: [(
            "observation.state".to_string(),
            Tensor::from_f32(&[1], &[x]),
        )]
        .into(),
        task: "pick".into(),
        seed: Some(seed),
        ..Default::default()
    }
}

fn actions(r: &pb::ActReply) -> Vec<f32> {
    match r.actions.as_ref().unwrap().decode("actions").unwrap() {
        Array::F32 { shape, data } => {
            assert_eq!(shape, [1, 1]);
            data
        }
        a => panic!("{}", a.describe()),
    }
}

async fn start(held: &Arc<Held>, queue: usize) -> (Server, PolicyClient<Channel>) {
    let server = Server::start(
        held.clone(),
        &Options {
            listen: "127.0.0.1:0".parse().unwrap(),
            max_message_bytes: 1 << 20,
            queue,
        },
    )
    .await
    .unwrap();
    let client = PolicyClient::connect(format!("http://{}", server.local_addr()))
        .await
        .unwrap();
    (server, client)
}

async fn code(c: &mut PolicyClient<Channel>, r: pb::ActRequest) -> (Code, String) {
    let s = c.act(r).await.unwrap_err();
    (s.code(), s.message().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_is_bounded_and_refusals_leave_the_calls_in_flight_alone() {
    let held = Arc::new(Held::default());
    let (server, mut client) = start(&held, 1).await;

    let info = client.info(pb::InfoRequest {}).await.unwrap().into_inner();
    assert_eq!((info.queue, info.max_message_bytes), (1, 1 << 20));
    assert_eq!(info.cameras[0].key, "observation.images.front");
    let health = client.health(pb::HealthRequest {}).await.unwrap();
    assert_eq!(
        health.into_inner().status,
        pb::health_reply::Status::Serving as i32
    );

    // queue 1: one call runs, one waits; both are held inside.
    let inflight: Vec<_> = (0..2)
        .map(|i| {
            let mut c = client.clone();
            tokio::spawn(async move { c.act(request(i as f32, 10)).await })
        })
        .collect();
    held.wait_inside(2);

    // The next is refused at once, whichever connection it comes on.
    let (c, m) = code(&mut client, request(5.0, 0)).await;
    assert_eq!(c, Code::ResourceExhausted, "{m}");
    assert!(m.contains("busy") && m.contains("--queue"), "{m}");

    // Malformed, oversized and unserved requests are refused as such, queue full or not.
    let mut short = request(1.0, 0);
    short
        .observation
        .get_mut("observation.state")
        .unwrap()
        .data
        .pop();
    let (c, m) = code(&mut client, short).await;
    assert_eq!(c, Code::InvalidArgument);
    assert_eq!(
        m,
        "`observation.state`: shape [1] of float32 needs 4 bytes, found 3"
    );
    let mut dtype = request(1.0, 0);
    dtype
        .observation
        .get_mut("observation.state")
        .unwrap()
        .dtype = 7;
    let (c, m) = code(&mut client, dtype).await;
    assert_eq!(c, Code::InvalidArgument);
    assert!(m.contains("unknown dtype 7"), "{m}");
    let mut noise = request(1.0, 0);
    noise.noise = Some(Tensor {
        dtype: pb::Dtype::Float32 as i32,
        shape: vec![2, 2],
        data: vec![0; 15],
    });
    let (c, m) = code(&mut client, noise).await;
    assert_eq!(
        (c, m.starts_with("`noise`: ")),
        (Code::InvalidArgument, true)
    );
    let mut big = request(1.0, 0);
    big.observation.insert(
        "observation.images.front".into(),
        Tensor::from_u8(&[1024, 1024, 3], &vec![0; 3 << 20]),
    );
    let (c, m) = code(&mut client, big).await;
    assert_eq!(c, Code::OutOfRange, "{m}");
    assert!(m.contains("too large"), "{m}");
    let mut rtc = request(1.0, 0);
    rtc.rtc = Some(pb::Rtc::default());
    let (c, m) = code(&mut client, rtc).await;
    assert_eq!(c, Code::InvalidArgument);
    assert!(
        m.starts_with("`rtc.prev_chunk_left_over`: missing") && !m.contains('\n'),
        "{m}"
    );
    let mut rtc = request(1.0, 0);
    rtc.rtc = Some(pb::Rtc {
        prev_chunk_left_over: Some(Tensor::from_f32(&[1, 1], &[0.5])),
        ..Default::default()
    });
    let (c, m) = code(&mut client, rtc).await;
    assert_eq!(c, Code::InvalidArgument);
    assert!(m.starts_with("`rtc.inference_delay`: missing"), "{m}");

    // The held calls are undisturbed: each gets its own answer.
    held.open(true);
    for (i, h) in inflight.into_iter().enumerate() {
        let r = h.await.unwrap().unwrap().into_inner();
        assert_eq!(actions(&r), [i as f32 + 10.0]);
        assert_eq!(r.prompt, "pick");
        assert_eq!((r.tokens, r.token_mask), (vec![1, 2], vec![1, 0]));
        assert!(r.server_ms > 0.0);
    }
    // A refusal from the backend itself.
    let mut wrong = request(1.0, 0);
    wrong.observation.clear();
    let (c, m) = code(&mut client, wrong).await;
    assert_eq!(
        (c, m.as_str()),
        (
            Code::InvalidArgument,
            "`observation.state`: expected f32 [1]"
        )
    );
    // And the server serves again.
    let r = client.act(request(2.0, 3)).await.unwrap().into_inner();
    assert_eq!(actions(&r), [5.0]);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_ends_the_call_but_its_chunk_keeps_its_place_until_done() {
    let held = Arc::new(Held::default());
    let (server, mut client) = start(&held, 0).await;
    let mut req = tonic::Request::new(request(1.0, 0));
    req.set_timeout(Duration::from_millis(200));
    let s = client.act(req).await.unwrap_err();
    assert_eq!(s.code(), Code::Cancelled, "{s:?}");
    assert_eq!(s.message(), "Timeout expired");
    // The backend still holds that call: queue 0 has no other place.
    held.wait_inside(1);
    let (c, _) = code(&mut client, request(1.0, 0)).await;
    assert_eq!(c, Code::ResourceExhausted);
    held.open(true);
    held.wait_inside(0);
    // Its place is given back once the chunk is done (the blocking task may still be returning).
    let mut ok = None;
    for _ in 0..100 {
        match client.act(request(1.0, 1)).await {
            Ok(r) => {
                ok = Some(r.into_inner());
                break;
            }
            Err(s) if s.code() == Code::ResourceExhausted => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Err(s) => panic!("{s:?}"),
        }
    }
    assert_eq!(actions(&ok.expect("the place was never given back")), [2.0]);
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_the_calls_in_flight_and_takes_no_new_connection() {
    let held = Arc::new(Held::default());
    let (server, client) = start(&held, 2).await;
    let addr = server.local_addr();
    let inflight: Vec<_> = (0..3)
        .map(|i| {
            let mut c = client.clone();
            tokio::spawn(async move { c.act(request(i as f32, 0)).await })
        })
        .collect();
    held.wait_inside(3);
    let stopping = tokio::spawn(server.shutdown());
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!stopping.is_finished(), "returned with calls in flight");
    // No new connection.
    let refused = PolicyClient::connect(format!("http://{addr}")).await;
    assert!(
        refused.is_err(),
        "a new connection was taken while stopping"
    );
    held.open(true);
    for (i, h) in inflight.into_iter().enumerate() {
        assert_eq!(actions(&h.await.unwrap().unwrap().into_inner()), [i as f32]);
    }
    tokio::time::timeout(Duration::from_secs(20), stopping)
        .await
        .expect("shutdown never returned")
        .unwrap()
        .unwrap();
}

/// The blocking [`petite_serve::Client`] against a real server: `Info`, `Health`, chunks from
/// several threads sharing one client, refusals as status codes, a call's deadline, and a
/// connection to nothing as one error naming the address.
#[test]
fn the_blocking_client_shares_one_connection_between_threads() {
    use petite_serve::{Client, Error};
    let rt = tokio::runtime::Runtime::new().unwrap();
    let held = Arc::new(Held::default());
    held.open(true);
    let server = rt
        .block_on(Server::start(
            held.clone(),
            &Options {
                listen: "127.0.0.1:0".parse().unwrap(),
                max_message_bytes: 1 << 20,
                queue: 8,
            },
        ))
        .unwrap();
    let addr = server.local_addr().to_string();
    let client = Arc::new(Client::connect(&addr, Duration::from_secs(5), None).unwrap());
    let info = client.info().unwrap();
    assert_eq!((info.queue, info.max_message_bytes), (8, 1 << 20));
    assert_eq!(info.policy.cameras[0].key, "observation.images.front");
    assert_eq!((info.policy.chunk, info.policy.action_dim), (1, 1));
    assert!(client.healthy().unwrap());

    let call = |x: f32, seed: u64| Call {
        observation: [(
            "observation.state".to_string(),
            Array::F32 {
                shape: vec![1],
                data: vec![x],
            },
        )]
        .into(),
        task: format!("task {x}"),
        seed: Some(seed),
        ..Call::default()
    };
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let client = client.clone();
            std::thread::spawn(move || {
                for i in 0..25u64 {
                    let x = (t * 100) as f32 + i as f32;
                    let r = client.act(&call(x, i)).unwrap();
                    assert_eq!(r.chunk.actions, [x + i as f32]);
                    assert_eq!(r.chunk.model, [-(x + i as f32)]);
                    assert_eq!(r.chunk.prompt, format!("task {x}"));
                    assert_eq!((r.chunk.chunk, r.chunk.action_dim), (1, 1));
                    assert!(r.server_ms >= 0.0 && r.server_ms.is_finite());
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }

    let mut bad = call(1.0, 0);
    bad.observation.clear();
    match client.act(&bad).unwrap_err() {
        Error::Status { code, message } => {
            assert_eq!(code, Code::InvalidArgument);
            assert!(message.contains("observation.state"), "{message}");
        }
        e => panic!("{e}"),
    }
    // The call's deadline travels to the server: a held call ends with it.
    held.open(false);
    let quick = Client::connect(
        &addr,
        Duration::from_secs(5),
        Some(Duration::from_millis(200)),
    )
    .unwrap();
    match quick.act(&call(1.0, 0)).unwrap_err() {
        Error::Status { code, .. } => {
            assert!(
                matches!(code, Code::Cancelled | Code::DeadlineExceeded),
                "{code:?}"
            )
        }
        e => panic!("{e}"),
    }
    held.open(true);
    assert_eq!(client.act(&call(2.0, 1)).unwrap().chunk.actions, [3.0]);
    rt.block_on(server.shutdown()).unwrap();

    let e = Client::connect(&addr, Duration::from_secs(2), None).unwrap_err();
    assert!(matches!(e, Error::Connect { .. }), "{e}");
    assert!(e.to_string().contains(&addr), "{e}");
}
