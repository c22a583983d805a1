//! `petite serve` end to end on loopback, with the golden `two_cams_mqa` export on the CPU:
//! concurrent clients each given their own chunk, bit for bit the in-process `Policy::act`
//! answer, while malformed, oversized and unserved requests are refused by status code beside
//! them; a full queue refused with RESOURCE_EXHAUSTED; and the `petite serve` binary stopping
//! on SIGTERM only after its calls in flight are answered.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Scratch, error_line, petite};
use petite::policy::{ActionChunk, Array, Observation, OpenOptions, Options, Policy};
use petite_serve::pb::policy_client::PolicyClient;
use petite_serve::pb::{self, Tensor};
use tonic::Code;
use tonic::transport::Channel;

use common::policy::{FRONT, STATE, exported, observation};

fn open(dir: &Path, tok: &Path) -> Arc<Policy> {
    Arc::new(
        Policy::open(
            dir,
            &OpenOptions {
                tokenizer: Some(tok.to_path_buf()),
                queue: 64,
                ..OpenOptions::default()
            },
        )
        .unwrap(),
    )
}

/// One good call of the test: an observation and its options, and the request that carries
/// them.
#[derive(Clone)]
struct Case {
    obs: Observation,
    opts: Options,
}

impl Case {
    /// Variant `v`: 8 observations (two tasks), seeds, and every fifth one explicit noise
    /// instead of a seed.
    fn new(v: usize) -> Case {
        let task = if v.is_multiple_of(2) { "pick" } else { "place" };
        let opts = if v % 5 == 4 {
            Options {
                noise: Some(
                    (0..48)
                        .map(|i| ((i * 3 + v) % 11) as f32 / 5.0 - 1.0)
                        .collect(),
                ),
                ..Options::default()
            }
        } else {
            Options {
                seed: Some(1000 + v as u64),
                // Every third one guided by a leftover (real-time chunking over the wire).
                rtc: (v % 3 == 1).then(|| petite::policy::Rtc {
                    prev_chunk_left_over: Array::F32 {
                        shape: vec![4, 4],
                        data: (0..16).map(|i| ((i + v) % 5) as f32 * 0.4 - 0.8).collect(),
                    },
                    inference_delay: v % 4,
                    execution_horizon: Some(3),
                    schedule: Some(petite::policy::Schedule::Exp),
                    max_guidance_weight: Some(5.0),
                }),
                ..Options::default()
            }
        };
        Case {
            obs: observation((v % 8) as u8, task),
            opts,
        }
    }

    fn request(&self) -> pb::ActRequest {
        let wire = |a: &Array| match a {
            Array::F32 { shape, data } => Tensor::from_f32(shape, data),
            Array::U8 { shape, data } => Tensor::from_u8(shape, data),
        };
        let mut observation: HashMap<String, Tensor> = self
            .obs
            .images
            .iter()
            .map(|(k, a)| (k.clone(), wire(a)))
            .collect();
        observation.insert(STATE.into(), wire(self.obs.state.as_ref().unwrap()));
        pb::ActRequest {
            observation,
            task: self.obs.task.clone(),
            noise: self
                .opts
                .noise
                .as_ref()
                .map(|n| Tensor::from_f32(&[6, 8], n)),
            seed: self.opts.seed,
            rtc: self.opts.rtc.as_ref().map(|r| pb::Rtc {
                prev_chunk_left_over: Some(wire(&r.prev_chunk_left_over)),
                inference_delay: Some(r.inference_delay as u32),
                execution_horizon: r.execution_horizon.map(|h| h as u32),
                prefix_attention_schedule: pb::PrefixAttentionSchedule::Exp as i32,
                max_guidance_weight: r.max_guidance_weight,
            }),
        }
    }
}

fn f32s(t: &Option<Tensor>, shape: &[usize]) -> Vec<f32> {
    match t.as_ref().unwrap().decode("reply").unwrap() {
        petite_serve::Array::F32 { shape: s, data } => {
            assert_eq!(s, shape);
            data
        }
        a => panic!("{}", a.describe()),
    }
}

/// The reply is the in-process chunk, bit for bit.
fn same(r: &pb::ActReply, want: &ActionChunk, what: &str) {
    let shape = [want.chunk, want.action_dim];
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&f32s(&r.actions, &shape)),
        bits(&want.actions),
        "{what}: actions"
    );
    assert_eq!(
        bits(&f32s(&r.model, &shape)),
        bits(&want.model),
        "{what}: model"
    );
    assert_eq!(r.n_action_steps as usize, want.n_action_steps, "{what}");
    assert_eq!(r.prompt, want.prompt, "{what}");
    assert_eq!(r.tokens, want.tokens, "{what}");
    assert_eq!(r.token_mask, want.token_mask, "{what}");
}

/// A request refused before the policy or by it, the code it must get, and a piece of its
/// message (the key it names).
fn bad(n: usize) -> (pb::ActRequest, Code, &'static str) {
    let mut r = Case::new(n).request();
    match n % 7 {
        0 => {
            r.observation.get_mut(FRONT).unwrap().data.pop();
            (
                r,
                Code::InvalidArgument,
                "`observation.images.front`: shape",
            )
        }
        1 => {
            r.observation.get_mut(STATE).unwrap().dtype = 9;
            (
                r,
                Code::InvalidArgument,
                "`observation.state`: unknown dtype 9",
            )
        }
        2 => {
            let mut s = r.observation[STATE].clone();
            s.data[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
            r.observation.insert(STATE.into(), s);
            (
                r,
                Code::InvalidArgument,
                "`observation.state`: expected finite values, found NaN at 1",
            )
        }
        3 => {
            r.observation
                .insert("observation.wrist".into(), Tensor::from_u8(&[1], &[0]));
            (r, Code::InvalidArgument, "`observation.wrist`: expected")
        }
        4 => {
            // 2 MiB of image against the server's 1 MiB.
            r.observation.insert(
                FRONT.into(),
                Tensor::from_u8(&[512, 1366, 3], &vec![7; 512 * 1366 * 3]),
            );
            (r, Code::OutOfRange, "too large")
        }
        5 => {
            r.rtc = Some(pb::Rtc {
                prev_chunk_left_over: Some(Tensor::from_f32(&[2, 9], &[0.0; 18])),
                inference_delay: Some(1),
                ..Default::default()
            });
            (
                r,
                Code::InvalidArgument,
                "`rtc.prev_chunk_left_over`: expected",
            )
        }
        _ => {
            r.noise = Some(Tensor::from_f32(&[8, 6], &[0.0; 48]));
            r.seed = None;
            (r, Code::InvalidArgument, "`noise`: expected F32 [6, 8]")
        }
    }
}

async fn client(addr: std::net::SocketAddr) -> PolicyClient<Channel> {
    // The client's own limit is large: the server's is the one tested.
    PolicyClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_encoding_message_size(64 << 20)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn four_clients_two_hundred_calls_each_answer_the_in_process_chunk_beside_refusals() {
    const CLIENTS: usize = 4;
    const CALLS: usize = 50;
    const VARIANTS: usize = 20;
    let s = Scratch::new("clients");
    let (dir, tok) = exported(&s);
    let policy = open(&dir, &tok);
    let t = Instant::now();
    let want: Vec<ActionChunk> = (0..VARIANTS)
        .map(|v| {
            let c = Case::new(v);
            policy.act(&c.obs, &c.opts).unwrap()
        })
        .collect();
    let in_process_ms = t.elapsed().as_secs_f64() * 1e3 / VARIANTS as f64;
    let want = Arc::new(want);

    let server = petite_serve::Server::start(
        policy.clone(),
        &petite_serve::Options {
            listen: "127.0.0.1:0".parse().unwrap(),
            max_message_bytes: 1 << 20,
            // Every client's call has a place: no RESOURCE_EXHAUSTED in this test.
            queue: CLIENTS,
        },
    )
    .await
    .unwrap();
    let addr = server.local_addr();
    assert!(addr.ip().is_loopback());

    let mut c = client(addr).await;
    let info = c.info(pb::InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(
        (
            info.chunk,
            info.action_dim,
            info.max_action_dim,
            info.state_dim
        ),
        (6, 4, 8, 5)
    );
    assert_eq!((info.device.as_str(), info.dtype.as_str()), ("cpu", "f32"));
    let cams: Vec<(&str, bool)> = info
        .cameras
        .iter()
        .map(|c| (c.key.as_str(), c.empty))
        .collect();
    assert_eq!(
        cams,
        [(FRONT, false), ("observation.images.empty_camera_0", true)]
    );
    assert_eq!(
        (info.queue, info.max_message_bytes, info.n_action_steps),
        (CLIENTS as u32, 1 << 20, 3)
    );
    assert_eq!(info.export_id, policy.info().export_id);
    let h = c.health(pb::HealthRequest {}).await.unwrap().into_inner();
    assert_eq!(h.status, pb::health_reply::Status::Serving as i32);

    // Each client on its own connection: a good call, and after every fourth one a bad one.
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|k| {
            let want = want.clone();
            tokio::spawn(async move {
                let mut c = client(addr).await;
                let (mut good, mut refused) = (0, BTreeMap::<String, usize>::new());
                for i in 0..CALLS {
                    let v = (k * 7 + i * 3) % VARIANTS;
                    let r = c.act(Case::new(v).request()).await;
                    let r = r.unwrap_or_else(|e| panic!("client {k} call {i}: {e:?}"));
                    same(&r.into_inner(), &want[v], &format!("client {k} call {i}"));
                    good += 1;
                    if i % 4 == 3 {
                        let (req, code, says) = bad(k * CALLS + i);
                        let e = c.act(req).await.unwrap_err();
                        assert_eq!(e.code(), code, "client {k} call {i}: {e:?}");
                        assert!(e.message().contains(says), "{:?} lacks {says}", e.message());
                        assert!(!e.message().contains('\n'), "{:?}", e.message());
                        *refused.entry(format!("{code:?}")).or_default() += 1;
                    }
                }
                (good, refused)
            })
        })
        .collect();
    let mut good = 0;
    let mut refused = BTreeMap::<String, usize>::new();
    for t in tasks {
        let (g, r) = t.await.unwrap();
        good += g;
        for (k, n) in r {
            *refused.entry(k).or_default() += n;
        }
    }
    assert_eq!(good, CLIENTS * CALLS);
    for code in ["InvalidArgument", "OutOfRange"] {
        assert!(refused.get(code).is_some_and(|&n| n > 0), "{refused:?}");
    }
    eprintln!("{good} calls from {CLIENTS} concurrent clients answered; refused: {refused:?}");

    // Latency, one call at a time: through loopback vs in process (reported, not asserted).
    let case = Case::new(3);
    let mut rpc = Vec::new();
    let mut local = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        let r = c.act(case.request()).await.unwrap().into_inner();
        rpc.push(t.elapsed().as_secs_f64() * 1e3);
        same(&r, &want[3], "sequential");
        let t = Instant::now();
        policy.act(&case.obs, &case.opts).unwrap();
        local.push(t.elapsed().as_secs_f64() * 1e3);
    }
    eprintln!(
        "latency, median of 20: {:.2} ms through loopback gRPC, {:.2} ms in process (first {VARIANTS} in process: {in_process_ms:.2} ms a call)",
        median(rpc),
        median(local)
    );
    server.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_queue_is_resource_exhausted_and_every_other_reply_is_right() {
    let s = Scratch::new("busy");
    let (dir, tok) = exported(&s);
    let policy = open(&dir, &tok);
    let want: Vec<ActionChunk> = (0..8)
        .map(|v| {
            let c = Case::new(v);
            policy.act(&c.obs, &c.opts).unwrap()
        })
        .collect();
    let want = Arc::new(want);
    // Queue 0: one call at a time; eight at once leave most without a place (how many is up
    // to timing, so rounds repeat, boundedly, until both outcomes are seen).
    let server = petite_serve::Server::start(
        policy.clone(),
        &petite_serve::Options {
            listen: "127.0.0.1:0".parse().unwrap(),
            max_message_bytes: 1 << 20,
            queue: 0,
        },
    )
    .await
    .unwrap();
    let addr = server.local_addr();
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(client(addr).await);
    }
    let (mut good, mut busy, mut rounds) = (0, 0, 0);
    for _ in 0..20 {
        rounds += 1;
        let calls: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(v, c)| {
                let mut c = c.clone();
                let want = want.clone();
                tokio::spawn(async move {
                    match c.act(Case::new(v).request()).await {
                        Ok(r) => {
                            same(&r.into_inner(), &want[v], "busy round");
                            true
                        }
                        Err(e) => {
                            assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
                            assert!(e.message().contains("busy"), "{:?}", e.message());
                            false
                        }
                    }
                })
            })
            .collect();
        for c in calls {
            if c.await.unwrap() {
                good += 1
            } else {
                busy += 1
            }
        }
        if good > 0 && busy > 0 {
            break;
        }
    }
    assert!(good > 0 && busy > 0, "{good} answered, {busy} refused");
    eprintln!(
        "queue 0, 8 calls at once: {good} answered, {busy} RESOURCE_EXHAUSTED in {rounds} round(s)"
    );
    // Nothing is left waiting: a lone call is answered.
    let r = clients[0].act(Case::new(0).request()).await.unwrap();
    same(&r.into_inner(), &want[0], "after");
    server.shutdown().await.unwrap();
}

/// `petite serve` as a process: the bound address on stdout, and on SIGTERM the calls in flight
/// answered (right), then exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_binary_answers_its_calls_in_flight_then_exits_on_sigterm() {
    let s = Scratch::new("sigterm");
    let (dir, tok) = exported(&s);

    // A usage error is refused before the export is opened.
    let o = petite()
        .args(["serve", "--max-message", "0", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(error_line(&String::from_utf8_lossy(&o.stderr)).contains("--max-message 0"));

    let policy = open(&dir, &tok);
    let want: Vec<ActionChunk> = (0..4)
        .map(|v| {
            let c = Case::new(v);
            policy.act(&c.obs, &c.opts).unwrap()
        })
        .collect();
    let mut child = petite()
        .args(["serve", "--listen", "127.0.0.1:0", "--queue", "4", "--dir"])
        .arg(&dir)
        .arg("--tokenizer")
        .arg(&tok)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let addr: std::net::SocketAddr = line
        .split("listening on ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .parse()
        .unwrap();
    assert!(addr.ip().is_loopback() && addr.port() != 0, "{line}");
    assert!(line.contains("observation.images.front"), "{line}");

    let mut c = client(addr).await;
    let h = c.health(pb::HealthRequest {}).await.unwrap().into_inner();
    assert_eq!(h.status, pb::health_reply::Status::Serving as i32);
    let inflight: Vec<_> = (0..4)
        .map(|v| {
            let mut c = c.clone();
            tokio::spawn(async move { c.act(Case::new(v).request()).await })
        })
        .collect();
    // Once the first is answered the others are in the server's hands; then SIGTERM.
    let mut inflight = inflight.into_iter();
    let first = inflight.next().unwrap().await.unwrap().unwrap();
    same(&first.into_inner(), &want[0], "before SIGTERM");
    // SAFETY: kill takes no pointers; the pid is our own unreaped child.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    for (v, h) in inflight.enumerate() {
        let r = h
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("call {}: {e:?}", v + 1));
        same(&r.into_inner(), &want[v + 1], "in flight at SIGTERM");
    }
    drop(c);
    let t = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "never exited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{status}: {err}");
    assert!(
        err.contains("SIGTERM: finishing the calls in flight"),
        "{err}"
    );
    assert!(err.contains("petite serve: stopped"), "{err}");
    // Nobody listens there now.
    assert!(
        PolicyClient::connect(format!("http://{addr}"))
            .await
            .is_err()
    );
}
