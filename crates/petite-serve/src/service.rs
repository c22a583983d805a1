//! The `petite.v1.Policy` service over one [`Backend`]: requests decoded and checked, calls
//! bounded by a semaphore of `queue + 1` places, run on blocking threads, refusals mapped to
//! gRPC statuses.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use tokio::sync::Semaphore;
use tonic::{Request, Response, Status};

use crate::backend::{Backend, Call, Chunk, PolicyInfo, Refusal, RtcCall};
use crate::pb;
use crate::pb::health_reply::Status as Health;
use crate::tensor::Array;

/// The service's state, shared by every call and by the [`crate::Server`] that stops it.
pub(crate) struct PolicyService<B> {
    backend: Arc<B>,
    info: PolicyInfo,
    /// One place per call allowed in the backend at once.
    places: Arc<Semaphore>,
    queue: usize,
    max_message_bytes: usize,
    /// False once shutdown began: Health says so, and a call that still arrives is refused.
    serving: Arc<AtomicBool>,
}

impl<B: Backend> PolicyService<B> {
    pub(crate) fn new(
        backend: Arc<B>,
        queue: usize,
        max_message_bytes: usize,
        serving: Arc<AtomicBool>,
    ) -> Self {
        let info = backend.info();
        PolicyService {
            backend,
            info,
            places: Arc::new(Semaphore::new(queue + 1)),
            queue,
            max_message_bytes,
            serving,
        }
    }
}

fn invalid(e: crate::Error) -> Status {
    Status::invalid_argument(e.to_string())
}

/// The request's tensors decoded, each refusal naming its key.
fn decode(req: pb::ActRequest) -> Result<Call, Status> {
    let rtc = match &req.rtc {
        None => None,
        Some(r) => Some(decode_rtc(r)?),
    };
    let mut observation = BTreeMap::new();
    for (key, t) in req.observation {
        let a = t.into_array(&key).map_err(invalid)?;
        observation.insert(key, a);
    }
    let noise = match req.noise {
        Some(t) => Some(t.into_array("noise").map_err(invalid)?),
        None => None,
    };
    Ok(Call {
        observation,
        task: req.task,
        noise,
        seed: req.seed,
        rtc,
    })
}

/// The request's RTC options: the leftover and the delay are required, the rest default to
/// the export's.
fn decode_rtc(r: &pb::Rtc) -> Result<RtcCall, Status> {
    let prev = r.prev_chunk_left_over.as_ref().ok_or_else(|| {
        Status::invalid_argument(
            "`rtc.prev_chunk_left_over`: missing (a request without RTC leaves `rtc` unset)",
        )
    })?;
    let inference_delay = r.inference_delay.ok_or_else(|| {
        Status::invalid_argument(
            "`rtc.inference_delay`: missing (the actions executed while the chunk is computed)",
        )
    })?;
    let schedule = match pb::PrefixAttentionSchedule::try_from(r.prefix_attention_schedule) {
        Ok(pb::PrefixAttentionSchedule::Unspecified) => None,
        Ok(pb::PrefixAttentionSchedule::Zeros) => Some("ZEROS"),
        Ok(pb::PrefixAttentionSchedule::Ones) => Some("ONES"),
        Ok(pb::PrefixAttentionSchedule::Linear) => Some("LINEAR"),
        Ok(pb::PrefixAttentionSchedule::Exp) => Some("EXP"),
        Err(_) => {
            return Err(Status::invalid_argument(format!(
                "`rtc.prefix_attention_schedule`: unknown value {}",
                r.prefix_attention_schedule
            )));
        }
    };
    Ok(RtcCall {
        prev_chunk_left_over: prev.decode("rtc.prev_chunk_left_over").map_err(invalid)?,
        inference_delay,
        execution_horizon: r.execution_horizon,
        schedule: schedule.map(str::to_string),
        max_guidance_weight: r.max_guidance_weight,
    })
}

fn reply(c: Chunk, server_ms: f64) -> Result<pb::ActReply, Status> {
    let shape = [c.chunk, c.action_dim];
    if c.actions.len() != c.chunk * c.action_dim || c.model.len() != c.actions.len() {
        return Err(Status::internal(format!(
            "the policy gave {} actions and {} model values for a chunk of {shape:?}",
            c.actions.len(),
            c.model.len()
        )));
    }
    Ok(pb::ActReply {
        actions: Some(pb::Tensor::from(&Array::F32 {
            shape: shape.to_vec(),
            data: c.actions,
        })),
        model: Some(pb::Tensor::from_f32(&shape, &c.model)),
        n_action_steps: c.n_action_steps as u32,
        prompt: c.prompt,
        tokens: c.tokens,
        token_mask: c.token_mask,
        server_ms,
    })
}

#[tonic::async_trait]
impl<B: Backend> pb::policy_server::Policy for PolicyService<B> {
    async fn act(
        &self,
        request: Request<pb::ActRequest>,
    ) -> Result<Response<pb::ActReply>, Status> {
        let t0 = Instant::now();
        if !self.serving.load(Ordering::SeqCst) {
            return Err(Status::unavailable("the server is shutting down"));
        }
        // Checked before the queue: a malformed request is refused as such however busy the
        // server is.
        let call = decode(request.into_inner())?;
        let place = self.places.clone().try_acquire_owned().map_err(|_| {
            Status::resource_exhausted(format!(
                "the server is busy: one chunk runs and {} calls wait (its --queue); try again shortly",
                self.queue
            ))
        })?;
        let backend = self.backend.clone();
        // The place is held until the chunk is done, even if the client gave up (its deadline
        // passed and this future was dropped): the backend is still busy with it.
        let done = tokio::task::spawn_blocking(move || {
            let r = backend.act(call);
            drop(place);
            r
        })
        .await
        .map_err(|e| Status::internal(format!("the policy's call failed: {e}")))?;
        let chunk = done.map_err(|r| match r {
            Refusal::Invalid(m) => Status::invalid_argument(m),
            Refusal::Busy(m) => Status::resource_exhausted(m),
            Refusal::Failed(m) => Status::internal(m),
        })?;
        reply(chunk, t0.elapsed().as_secs_f64() * 1e3).map(Response::new)
    }

    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::InfoReply>, Status> {
        let i = &self.info;
        Ok(Response::new(pb::InfoReply {
            export_id: i.export_id.clone(),
            backend: i.backend.clone(),
            dtype: i.dtype.clone(),
            device: i.device.clone(),
            runtime: i.runtime.clone(),
            cameras: i
                .cameras
                .iter()
                .map(|c| pb::Camera {
                    key: c.key.clone(),
                    empty: c.empty,
                })
                .collect(),
            state_dim: i.state_dim as u32,
            action_dim: i.action_dim as u32,
            max_action_dim: i.max_action_dim as u32,
            chunk: i.chunk as u32,
            n_action_steps: i.n_action_steps as u32,
            max_message_bytes: self.max_message_bytes as u64,
            queue: self.queue as u32,
            version: env!("CARGO_PKG_VERSION").to_string(),
        }))
    }

    async fn health(
        &self,
        _: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthReply>, Status> {
        let status = if self.serving.load(Ordering::SeqCst) {
            Health::Serving
        } else {
            Health::NotServing
        };
        Ok(Response::new(pb::HealthReply {
            status: status as i32,
        }))
    }
}
