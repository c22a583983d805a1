//! A blocking client of `petite serve`: what the Python package's `petite.Client` and a Rust
//! robot loop call, over the same generated `petite.v1` stubs as the server.
//!
//! Blocking on purpose: a robot's control loop (and Python) calls `act` and waits for the
//! chunk. The client owns a small tokio runtime (one worker) that drives the connection, so it
//! may be shared by threads (`Send + Sync`): each call clones the channel, and calls from
//! several threads travel at once on the one HTTP/2 connection.

use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

use crate::backend::{Camera, Chunk, PolicyInfo};
use crate::pb::{self, policy_client::PolicyClient};
use crate::tensor::Array;
use crate::{Call, Error, Result};

/// What `Info` says: the policy's [`PolicyInfo`] and the server's own limits.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerInfo {
    /// What the policy takes and gives.
    pub policy: PolicyInfo,
    /// The largest request the server decodes, in bytes.
    pub max_message_bytes: u64,
    /// Calls that may wait while one chunk runs.
    pub queue: u32,
    /// The server's petite version.
    pub version: String,
}

/// One `Act` reply: the chunk, and the server's time for it (the client's latency minus this is
/// the transport's).
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// Both chunks and what went with them.
    pub chunk: Chunk,
    /// The server's time for the call, from decoding to the chunk, in milliseconds.
    pub server_ms: f64,
}

/// A connection to one `petite serve`.
#[derive(Debug)]
pub struct Client {
    runtime: tokio::runtime::Runtime,
    channel: PolicyClient<Channel>,
    target: String,
    timeout: Option<Duration>,
}

impl Client {
    /// Connects to `target` (`host:port`, or an `http://` URL), failing within `connect_timeout`
    /// when nothing answers. `timeout` bounds each call (sent as the call's deadline: the server
    /// ends a call that passes it); `None` waits as long as the chunk takes.
    pub fn connect(
        target: &str,
        connect_timeout: Duration,
        timeout: Option<Duration>,
    ) -> Result<Client> {
        let target = if target.contains("://") {
            target.to_string()
        } else {
            format!("http://{target}")
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("petite-client")
            .enable_all()
            .build()
            .map_err(Error::Runtime)?;
        let endpoint = Endpoint::from_shared(target.clone())
            .map_err(|e| Error::Connect {
                target: target.clone(),
                reason: e.to_string(),
            })?
            .connect_timeout(connect_timeout)
            .tcp_nodelay(true);
        let channel = runtime
            .block_on(endpoint.connect())
            .map_err(|e| Error::Connect {
                target: target.clone(),
                reason: chain(&e),
            })?;
        // The server's limit is its own; the client takes replies of any size a chunk has.
        let channel = PolicyClient::new(channel)
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX);
        Ok(Client {
            runtime,
            channel,
            target,
            timeout,
        })
    }

    /// The server's address as connected.
    pub fn target(&self) -> &str {
        &self.target
    }

    fn request<T>(&self, m: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(m);
        if let Some(t) = self.timeout {
            r.set_timeout(t);
        }
        r
    }

    /// What the policy takes and gives, and the server's limits.
    pub fn info(&self) -> Result<ServerInfo> {
        let mut c = self.channel.clone();
        let r = self
            .runtime
            .block_on(c.info(self.request(pb::InfoRequest {})))
            .map_err(status)?
            .into_inner();
        Ok(ServerInfo {
            policy: PolicyInfo {
                export_id: r.export_id,
                backend: r.backend,
                dtype: r.dtype,
                device: r.device,
                runtime: r.runtime,
                cameras: r
                    .cameras
                    .into_iter()
                    .map(|c| Camera {
                        key: c.key,
                        empty: c.empty,
                    })
                    .collect(),
                state_dim: r.state_dim as usize,
                action_dim: r.action_dim as usize,
                max_action_dim: r.max_action_dim as usize,
                chunk: r.chunk as usize,
                n_action_steps: r.n_action_steps as usize,
            },
            max_message_bytes: r.max_message_bytes,
            queue: r.queue,
            version: r.version,
        })
    }

    /// Whether the server takes `Act` calls.
    pub fn healthy(&self) -> Result<bool> {
        let mut c = self.channel.clone();
        let r = self
            .runtime
            .block_on(c.health(self.request(pb::HealthRequest {})))
            .map_err(status)?
            .into_inner();
        Ok(r.status == pb::health_reply::Status::Serving as i32)
    }

    /// One chunk for one observation. A refusal is [`Error::Status`] with the server's code and
    /// message; a reply whose tensors disagree with their shapes is [`Error::Tensor`].
    pub fn act(&self, call: &Call) -> Result<Reply> {
        let req = pb::ActRequest {
            observation: call
                .observation
                .iter()
                .map(|(k, a)| (k.clone(), pb::Tensor::from(a)))
                .collect(),
            task: call.task.clone(),
            noise: call.noise.as_ref().map(pb::Tensor::from),
            seed: call.seed,
            rtc: call.rtc.as_ref().map(|r| pb::Rtc {
                prev_chunk_left_over: Some(pb::Tensor::from(&r.prev_chunk_left_over)),
                inference_delay: Some(r.inference_delay),
                execution_horizon: r.execution_horizon,
                prefix_attention_schedule: match r.schedule.as_deref() {
                    Some("ZEROS") => pb::PrefixAttentionSchedule::Zeros,
                    Some("ONES") => pb::PrefixAttentionSchedule::Ones,
                    Some("LINEAR") => pb::PrefixAttentionSchedule::Linear,
                    Some("EXP") => pb::PrefixAttentionSchedule::Exp,
                    _ => pb::PrefixAttentionSchedule::Unspecified,
                } as i32,
                max_guidance_weight: r.max_guidance_weight,
            }),
        };
        let mut c = self.channel.clone();
        let r = self
            .runtime
            .block_on(c.act(self.request(req)))
            .map_err(status)?
            .into_inner();
        reply(r)
    }
}

/// A reply's tensors checked against each other: both chunks `[chunk, action_dim]` f32.
fn reply(r: pb::ActReply) -> Result<Reply> {
    let matrix = |key: &str, t: Option<pb::Tensor>| -> Result<(usize, usize, Vec<f32>)> {
        let t = t.ok_or_else(|| Error::Tensor {
            key: key.into(),
            reason: "missing from the reply".into(),
        })?;
        match t.into_array(key)? {
            Array::F32 { shape, data } if shape.len() == 2 => Ok((shape[0], shape[1], data)),
            a => Err(Error::Tensor {
                key: key.into(),
                reason: format!("expected F32 [chunk, action_dim], found {}", a.describe()),
            }),
        }
    };
    let (chunk, action_dim, actions) = matrix("actions", r.actions)?;
    let (mc, md, model) = matrix("model", r.model)?;
    if (mc, md) != (chunk, action_dim) {
        return Err(Error::Tensor {
            key: "model".into(),
            reason: format!("[{mc}, {md}] beside actions' [{chunk}, {action_dim}]"),
        });
    }
    Ok(Reply {
        chunk: Chunk {
            actions,
            model,
            chunk,
            action_dim,
            n_action_steps: r.n_action_steps as usize,
            prompt: r.prompt,
            tokens: r.tokens,
            token_mask: r.token_mask,
        },
        server_ms: r.server_ms,
    })
}

fn status(s: tonic::Status) -> Error {
    Error::Status {
        code: s.code(),
        message: s.message().to_string(),
    }
}

/// An error and its sources on one line (tonic's transport errors say little at the top).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(x) = src {
        s.push_str(": ");
        s.push_str(&x.to_string());
        src = x.source();
    }
    s
}
