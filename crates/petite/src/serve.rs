//! A [`Policy`] as what `petite serve` serves ([`petite_serve::Backend`]): the wire's decoded
//! tensors become an [`Observation`], the policy's errors become the server's refusals
//! (a bad observation `INVALID_ARGUMENT` naming the key, a full queue `RESOURCE_EXHAUSTED`).
//!
//! The server crate knows no policy (it depends on nothing of petite's), so this one module is
//! where the two meet; the `serve` feature (on by default) brings it and the server in.

use petite_pi05::lerobot::{IMAGE_PREFIX, STATE_KEY};
use petite_serve::{Array as Wire, Backend, Call, Camera, Chunk, PolicyInfo, Refusal};

use crate::Error;
use crate::policy::{Array, Observation, Options, Policy};

fn array(a: Wire) -> Array {
    match a {
        Wire::F32 { shape, data } => Array::F32 { shape, data },
        Wire::U8 { shape, data } => Array::U8 { shape, data },
    }
}

/// The call as the policy takes it; a key that is neither a camera nor the state, or noise that
/// is not f32 `[chunk, max_action_dim]`, is refused here.
fn observation(p: &Policy, call: Call) -> Result<(Observation, Options), Refusal> {
    let mut obs = Observation {
        task: call.task,
        ..Observation::default()
    };
    for (key, a) in call.observation {
        if key == STATE_KEY {
            obs.state = Some(array(a));
        } else if key.starts_with(IMAGE_PREFIX) {
            obs.images.insert(key, array(a));
        } else {
            return Err(Refusal::Invalid(format!(
                "`{key}`: expected {STATE_KEY} or {IMAGE_PREFIX}<camera>, found an unknown key"
            )));
        }
    }
    let i = p.info();
    let noise = match call.noise {
        None => None,
        Some(Wire::F32 { shape, data })
            if shape == [i.chunk, i.max_action_dim] || shape == [1, i.chunk, i.max_action_dim] =>
        {
            Some(data)
        }
        Some(a) => {
            return Err(Refusal::Invalid(format!(
                "`noise`: expected F32 [{}, {}], found {}",
                i.chunk,
                i.max_action_dim,
                a.describe()
            )));
        }
    };
    let rtc = match call.rtc {
        None => None,
        Some(r) => Some(crate::policy::Rtc {
            prev_chunk_left_over: array(r.prev_chunk_left_over),
            inference_delay: r.inference_delay as usize,
            execution_horizon: r.execution_horizon.map(|h| h as usize),
            schedule: match r.schedule {
                None => None,
                Some(s) => Some(s.parse().map_err(|e: String| {
                    Refusal::Invalid(format!("`rtc.prefix_attention_schedule`: {e}"))
                })?),
            },
            max_guidance_weight: r.max_guidance_weight,
        }),
    };
    Ok((
        obs,
        Options {
            noise,
            seed: call.seed,
            rtc,
        },
    ))
}

impl Backend for Policy {
    fn info(&self) -> PolicyInfo {
        let i = Policy::info(self);
        PolicyInfo {
            export_id: i.export_id.clone(),
            backend: i.backend.clone(),
            dtype: i.dtype.clone(),
            device: i.device.name().to_string(),
            runtime: i.runtime.clone(),
            cameras: i
                .cameras
                .iter()
                .map(|(key, empty)| Camera {
                    key: key.clone(),
                    empty: *empty,
                })
                .collect(),
            state_dim: i.state_dim,
            action_dim: i.action_dim,
            max_action_dim: i.max_action_dim,
            chunk: i.chunk,
            n_action_steps: i.n_action_steps,
        }
    }

    fn act(&self, call: Call) -> Result<Chunk, Refusal> {
        let (obs, opts) = observation(self, call)?;
        match self.try_act(&obs, &opts) {
            Ok(c) => Ok(Chunk {
                actions: c.actions,
                model: c.model,
                chunk: c.chunk,
                action_dim: c.action_dim,
                n_action_steps: c.n_action_steps,
                prompt: c.prompt,
                tokens: c.tokens,
                token_mask: c.token_mask,
            }),
            Err(e @ Error::Observation { .. }) => Err(Refusal::Invalid(e.to_string())),
            Err(e @ Error::Busy(_)) => Err(Refusal::Busy(e.to_string())),
            Err(e) => Err(Refusal::Failed(e.to_string())),
        }
    }
}
