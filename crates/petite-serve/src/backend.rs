//! What a server serves: a [`Backend`] that turns one decoded call into one chunk, or refuses
//! it in a way the server maps to a gRPC status.

use std::collections::BTreeMap;

use crate::tensor::Array;

/// One `Act` call, decoded: every tensor's bytes, shape and dtype already agree.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Call {
    /// The observation by lerobot's keys (`observation.images.…`, `observation.state`).
    pub observation: BTreeMap<String, Array>,
    /// The task.
    pub task: String,
    /// The flow's starting noise, if the client sent it.
    pub noise: Option<Array>,
    /// The noise's seed, if the client sent one.
    pub seed: Option<u64>,
    /// Real-time chunking, if the client asked for it.
    pub rtc: Option<RtcCall>,
}

/// One call's real-time-chunking options (the `.proto`'s `Rtc`), decoded; unset settings are
/// the policy's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct RtcCall {
    /// The previous chunk's leftover, model space, `[rows, action_dim]`.
    pub prev_chunk_left_over: Array,
    /// Actions executed while this chunk is computed.
    pub inference_delay: u32,
    /// Rows guided by the leftover.
    pub execution_horizon: Option<u32>,
    /// `ZEROS`, `ONES`, `LINEAR` or `EXP`.
    pub schedule: Option<String>,
    /// The guidance's upper bound.
    pub max_guidance_weight: Option<f32>,
}

/// One chunk of actions, in both of lerobot's spaces (see `ActReply` in the `.proto`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Chunk {
    /// f32 `[chunk, action_dim]`: what the robot executes.
    pub actions: Vec<f32>,
    /// f32 `[chunk, action_dim]`: the model's chunk (normalized, unpadded).
    pub model: Vec<f32>,
    /// Actions a chunk.
    pub chunk: usize,
    /// The real action width.
    pub action_dim: usize,
    /// How many actions lerobot executes before planning again.
    pub n_action_steps: usize,
    /// The prompt as tokenized.
    pub prompt: String,
    /// The prompt's token ids.
    pub tokens: Vec<i64>,
    /// 1 for a real token.
    pub token_mask: Vec<u8>,
}

/// A camera slot of the policy.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Camera {
    /// lerobot's key.
    pub key: String,
    /// A slot that is always empty.
    pub empty: bool,
}

/// What the policy takes and gives: `Info`'s reply, less the server's own settings.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PolicyInfo {
    /// The export's id.
    pub export_id: String,
    /// The backend that wrote the programs.
    pub backend: String,
    /// `bf16` or `f32`.
    pub dtype: String,
    /// `cpu` or `cuda`.
    pub device: String,
    /// The runtimes that run the programs.
    pub runtime: String,
    /// Camera slots in the model's order.
    pub cameras: Vec<Camera>,
    /// `observation.state`'s width.
    pub state_dim: usize,
    /// The real action width.
    pub action_dim: usize,
    /// The model's action width.
    pub max_action_dim: usize,
    /// Actions a chunk.
    pub chunk: usize,
    /// How many actions lerobot executes before planning again.
    pub n_action_steps: usize,
}

/// Why a backend gave no chunk; each is one line, and the server sends it as the status's
/// message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The call is not what the policy takes (names the key): `INVALID_ARGUMENT`.
    Invalid(String),
    /// The policy cannot take the call now: `RESOURCE_EXHAUSTED`.
    Busy(String),
    /// The policy failed (not the caller's fault): `INTERNAL`.
    Failed(String),
}

/// One policy, as a server calls it. `act` blocks (the server calls it on a blocking thread)
/// and may be called from several threads at once: the server bounds how many.
pub trait Backend: Send + Sync + 'static {
    /// What the policy takes and gives (asked once, when the server starts).
    fn info(&self) -> PolicyInfo;
    /// One chunk for `call`, or why not.
    fn act(&self, call: Call) -> Result<Chunk, Refusal>;
}
