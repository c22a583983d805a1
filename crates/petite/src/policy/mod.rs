//! A policy a robot runs: an export opened once, chunks served any number of times.
//!
//! [`Policy::open`] checks the bundle (one export, its `policy.json`), loads the tokenizer and
//! opens the programs once on the device asked for — every engine's weights kept for the
//! policy's life — on a thread of their own, the *owner thread*, which alone touches the
//! runtimes. [`Policy::act`] runs lerobot's preprocessing on the caller's thread, hands the model
//! inputs to the owner thread through a bounded queue, waits for the chunk and post-processes
//! it. So one `Policy` is `Send + Sync`: calls from several threads are served one chunk at a
//! time, in the order they reach the queue; [`Policy::try_act`] refuses at once when the queue
//! is full (a server's `RESOURCE_EXHAUSTED`). A bad observation is one error naming the key and
//! leaves the policy usable.
//!
//! The numerics are lerobot 0.6.1's pipeline ([`lerobot`]): `petite act` is this with an
//! observation file, and the lerobot-policy conformance tier checks it against lerobot's own.

pub mod lerobot;
mod model;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;

use petite_pi05::Pi05Config;
use petite_pi05::inputs::Inputs;
use petite_pi05::lerobot::STATE_KEY;
use petite_pi05::policy::Runner;
pub use petite_pi05::rtc::{RtcDefaults, Schedule};

use crate::bundle::{BundleKind, BundleRunner};
use crate::runtimes::Device;
use crate::{Error, Result};

pub use lerobot::Tokenizer;
pub use model::{Ints, MASK_KEY, ModelChunk, ModelInputs, TOKENS_KEY};

/// Values of one observation entry: f32 or u8, row-major, with their shape.
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    /// f32 values.
    F32 {
        /// The shape.
        shape: Vec<usize>,
        /// `shape.iter().product()` values.
        data: Vec<f32>,
    },
    /// u8 values.
    U8 {
        /// The shape.
        shape: Vec<usize>,
        /// `shape.iter().product()` values.
        data: Vec<u8>,
    },
}

impl Array {
    /// An f32 array.
    pub fn f32(shape: &[usize], data: Vec<f32>) -> Self {
        Array::F32 {
            shape: shape.to_vec(),
            data,
        }
    }

    /// A u8 array.
    pub fn u8(shape: &[usize], data: Vec<u8>) -> Self {
        Array::U8 {
            shape: shape.to_vec(),
            data,
        }
    }

    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        match self {
            Array::F32 { shape, .. } | Array::U8 { shape, .. } => shape,
        }
    }

    /// `F32 [3, 224, 224]`: how errors name what was given.
    pub fn describe(&self) -> String {
        let kind = match self {
            Array::F32 { .. } => "F32",
            Array::U8 { .. } => "U8",
        };
        format!("{kind} {:?}", self.shape())
    }

    fn len(&self) -> usize {
        match self {
            Array::F32 { data, .. } => data.len(),
            Array::U8 { data, .. } => data.len(),
        }
    }

    /// The shape without a leading batch dimension of 1 (`[1, …]` → `[…]`); a batch of more
    /// than one is refused: the programs take one observation.
    fn unbatched(&self, key: &str, rank: usize) -> Result<Vec<usize>> {
        let s = self.shape();
        if s.len() == rank + 1 {
            if s[0] != 1 {
                return Err(observation(
                    key,
                    format!(
                        "a batch of {} observations ({}): petite runs one observation a call (batch size 1); send them one at a time",
                        s[0],
                        self.describe()
                    ),
                ));
            }
            return Ok(s[1..].to_vec());
        }
        Ok(s.to_vec())
    }
}

/// A shape's element count, `None` past `usize` (a client's shape can claim anything).
fn elements(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// "N values for its shape", for a shape whose values do not fill it.
fn values_for(shape: &[usize]) -> String {
    match elements(shape) {
        Some(n) => format!("{n} values for its shape"),
        None => format!("a shape of fewer elements than {shape:?} claims"),
    }
}

fn observation(key: &str, reason: impl Into<String>) -> Error {
    Error::Observation {
        key: key.to_string(),
        reason: reason.into(),
    }
}

fn expected(key: &str, want: impl std::fmt::Display, found: impl std::fmt::Display) -> Error {
    observation(key, format!("expected {want}, found {found}"))
}

/// A raw observation, as lerobot names it: each camera's image by its key
/// (`observation.images.…`: f32 `[3, H, W]` in [0, 1] or u8 `[H, W, 3]`, any size; a leading
/// batch dimension of 1 is allowed), `observation.state` (f32 `[state_dim]`), and the task.
/// Cameras the policy's config lists but the observation lacks are masked, as lerobot does.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Observation {
    /// Camera images by key.
    pub images: BTreeMap<String, Array>,
    /// `observation.state`.
    pub state: Option<Array>,
    /// The task (the prompt's text).
    pub task: String,
}

/// Options of one call.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Options {
    /// The flow's starting noise, f32 `[chunk, max_action_dim]` (lerobot's `noise`); `None`:
    /// drawn from `seed`, else from the policy's own generator (new noise every call).
    pub noise: Option<Vec<f32>>,
    /// Makes this call's noise reproducible (standard normal from this seed).
    pub seed: Option<u64>,
    /// Real-time chunking: guide the chunk toward the previous one's leftover (`None`: a plain
    /// chunk).
    pub rtc: Option<Rtc>,
}

/// Real-time chunking for one call: lerobot's `predict_action_chunk(…, inference_delay=,
/// prev_chunk_left_over=, execution_horizon=)` with its `RTCConfig`. Settings left `None` take
/// the export's defaults (`Info::rtc`: the policy folder's `rtc_config`, else lerobot's
/// LINEAR, 10, 10).
#[derive(Debug, Clone, PartialEq)]
pub struct Rtc {
    /// The previous chunk's actions not yet executed, in model space (normalized: what
    /// [`ActionChunk::model`] holds), f32 `[rows, cols]` (or `[1, rows, cols]`) with
    /// `rows ≤ chunk` and `cols ≤ action_dim`; zero-padded as lerobot pads it.
    pub prev_chunk_left_over: Array,
    /// Actions the robot executes while this chunk is computed.
    pub inference_delay: usize,
    /// Rows of the new chunk guided by the leftover.
    pub execution_horizon: Option<usize>,
    /// How the guidance fades along the leftover.
    pub schedule: Option<Schedule>,
    /// The guidance's upper bound (> 0).
    pub max_guidance_weight: Option<f32>,
}

/// How to open a policy.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenOptions {
    /// Where petite's engines run (portable and ONNX exports run on the CPU only).
    pub device: Device,
    /// A `tokenizer.json` (else `$PETITE_TOKENIZER`, a folder named by the tokenizer id, or the
    /// Hugging Face cache).
    pub tokenizer: Option<PathBuf>,
    /// Python with ExecuTorch's or ONNX Runtime's runtime, for portable and ONNX exports.
    pub python: Option<PathBuf>,
    /// Seed of the policy's own noise generator (`None`: from the clock, so two policies draw
    /// different noise).
    pub seed: Option<u64>,
    /// Calls that may wait for the device at once; one more is refused by [`Policy::try_act`]
    /// and waits in [`Policy::act`].
    pub queue: usize,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            device: Device::default(),
            tokenizer: None,
            python: None,
            seed: None,
            queue: 8,
        }
    }
}

/// One chunk of actions, in both of lerobot's spaces.
#[derive(Debug, Clone, PartialEq)]
pub struct ActionChunk {
    /// f32 `[chunk, action_dim]`: post-processed (unnormalized, relative dims made absolute),
    /// what the robot executes.
    pub actions: Vec<f32>,
    /// f32 `[chunk, action_dim]`: the model's chunk (normalized, unpadded), what lerobot's
    /// `predict_action_chunk` returns.
    pub model: Vec<f32>,
    /// Actions a chunk.
    pub chunk: usize,
    /// The real action width.
    pub action_dim: usize,
    /// How many actions lerobot executes before planning again.
    pub n_action_steps: usize,
    /// The prompt as tokenized.
    pub prompt: String,
    /// The prompt's token ids (right-padded).
    pub tokens: Vec<i64>,
    /// 1 for a real token.
    pub token_mask: Vec<u8>,
}

/// What a policy takes and gives, for a caller (and `petite serve`'s `Info`).
#[derive(Debug, Clone, PartialEq)]
pub struct Info {
    /// The export's id.
    pub export_id: String,
    /// The backend that wrote the programs.
    pub backend: String,
    /// `bf16` or `f32`.
    pub dtype: String,
    /// Where the programs run.
    pub device: Device,
    /// The runtimes that run them, as `report.json` names them.
    pub runtime: String,
    /// Camera keys in the model's order; `true` for a slot that is always empty.
    pub cameras: Vec<(String, bool)>,
    /// `observation.state`'s width.
    pub state_dim: usize,
    /// The real action width.
    pub action_dim: usize,
    /// The model's action width (`max_action_dim`: the noise's columns).
    pub max_action_dim: usize,
    /// Actions a chunk.
    pub chunk: usize,
    /// How many actions lerobot executes before planning again.
    pub n_action_steps: usize,
    /// Real-time chunking's defaults for calls that leave them out.
    pub rtc: RtcDefaults,
}

/// A job for the owner thread: model inputs, and where the chunk (and the seconds the programs
/// took) goes.
struct Job {
    inputs: Inputs,
    reply: SyncSender<Result<(Vec<f32>, f64)>>,
}

/// Where one call's time went (seconds of wall time).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Timing {
    /// lerobot's preprocessing on the caller's thread (checks, images, prompt, tokens, noise).
    pub preprocess: f64,
    /// Waiting for the owner thread (other calls' chunks ahead in the queue).
    pub queued: f64,
    /// The programs: the chunk itself.
    pub chunk: f64,
    /// lerobot's postprocessing.
    pub postprocess: f64,
    /// The whole call.
    pub total: f64,
}

/// An exported pi0.5 policy, open: see the module's documentation.
///
/// ```no_run
/// use std::path::Path;
/// use petite::policy::{Array, Observation, OpenOptions, Options, Policy};
///
/// # fn main() -> petite::Result<()> {
/// // Once: the bundle checked, the tokenizer loaded, the programs opened (and kept).
/// let policy = Policy::open(Path::new("mine/"), &OpenOptions::default())?;
/// let (h, w) = (480, 640);
/// loop {
///     let mut obs = Observation {
///         task: "pick up the cube".into(),
///         ..Default::default()
///     };
///     obs.images.insert(
///         "observation.images.front".into(),
///         Array::u8(&[h, w, 3], vec![0; h * w * 3]), // the camera's frame
///     );
///     obs.state = Some(Array::f32(&[6], vec![0.0; 6])); // the robot's state
///     let chunk = policy.act(&obs, &Options::default())?;
///     // Execute the first `chunk.n_action_steps` rows of `chunk.actions`
///     // ([chunk, action_dim]), then observe again.
///     # let _ = chunk;
///     # break;
/// }
/// # Ok(())
/// # }
/// ```
pub struct Policy {
    dir: PathBuf,
    queue: usize,
    tx: Option<SyncSender<Job>>,
    owner: Option<JoinHandle<()>>,
    info: Info,
    cfg: Pi05Config,
    runner: Runner,
    tokenizer: Tokenizer,
    rng: Mutex<NoiseRng>,
}

impl std::fmt::Debug for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Policy").field("info", &self.info).finish()
    }
}

impl Policy {
    /// Opens the export in `dir`: the bundle checked (one export, with a lerobot interface),
    /// the tokenizer loaded, the programs opened on `opts.device` and kept. Returns once the
    /// policy can act (or with the first error).
    pub fn open(dir: &Path, opts: &OpenOptions) -> Result<Self> {
        opts.device.check()?;
        let spec = crate::bundle::check_bundle(dir)?.ok_or_else(|| {
            Error::input(
                dir,
                "no policy.json: export from the lerobot policy folder with this petite",
            )
        })?;
        let runner = spec.runner.clone().ok_or_else(|| {
            Error::input(
                &dir.join(crate::layout::POLICY),
                "no lerobot interface (exported from bare weights): export from the lerobot policy folder (config.json + model.safetensors) to run it as a policy",
            )
        })?;
        let cfg = spec.model.clone();
        cfg.validate()?;
        let tok_path = lerobot::find_tokenizer(opts.tokenizer.as_deref(), &runner.tokenizer)?;
        let tokenizer = Tokenizer::load(&tok_path, cfg.tokens)?;
        let bundle = BundleRunner::prepare(dir, &cfg, opts.python.as_deref(), opts.device)?;
        let (tx, rx) = sync_channel::<Job>(opts.queue.max(1));
        let (ready_tx, ready_rx) = sync_channel::<Result<String>>(1);
        let (dir2, cfg2, device) = (dir.to_path_buf(), cfg.clone(), opts.device);
        let owner = std::thread::Builder::new()
            .name("petite-policy".into())
            .spawn(move || owner(&dir2, &cfg2, device, bundle, ready_tx, rx))
            .map_err(|e| Error::io(dir, "start the policy's thread", e))?;
        let runtime = match ready_rx.recv() {
            Ok(r) => r?,
            Err(_) => {
                let _ = owner.join();
                return Err(Error::Internal(
                    "the policy's thread stopped while opening the programs".into(),
                ));
            }
        };
        let seed = opts.seed.unwrap_or_else(|| {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            t ^ (std::process::id() as u64).rotate_left(32)
        });
        let info = Info {
            export_id: spec.export_id.clone(),
            backend: spec.backend.clone(),
            dtype: spec.dtype.clone(),
            device: opts.device,
            runtime,
            cameras: runner
                .cameras
                .iter()
                .map(|c| (c.key.clone(), c.empty))
                .collect(),
            state_dim: runner.state_dim,
            action_dim: runner.action_dim,
            max_action_dim: cfg.action_dim,
            chunk: cfg.chunk,
            n_action_steps: runner.n_action_steps,
            rtc: runner.rtc.clone(),
        };
        Ok(Policy {
            dir: dir.to_path_buf(),
            queue: opts.queue.max(1),
            tx: Some(tx),
            owner: Some(owner),
            info,
            cfg,
            runner,
            tokenizer,
            rng: Mutex::new(NoiseRng::new(seed)),
        })
    }

    /// What it takes and gives.
    pub fn info(&self) -> &Info {
        &self.info
    }

    /// The tokenizer it loaded.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// One chunk for `obs`: lerobot's preprocessing, the programs (waiting for a place in the
    /// queue), the postprocessing.
    pub fn act(&self, obs: &Observation, opts: &Options) -> Result<ActionChunk> {
        self.act_with(obs, opts, false)
    }

    /// As [`Policy::act`], but refused at once with [`Error::Busy`] when the queue is full.
    pub fn try_act(&self, obs: &Observation, opts: &Options) -> Result<ActionChunk> {
        self.act_with(obs, opts, true)
    }

    /// As [`Policy::act`], with where the call's time went.
    pub fn act_timed(&self, obs: &Observation, opts: &Options) -> Result<(ActionChunk, Timing)> {
        self.timed(obs, opts, false)
    }

    fn act_with(&self, obs: &Observation, opts: &Options, no_wait: bool) -> Result<ActionChunk> {
        self.timed(obs, opts, no_wait).map(|(c, _)| c)
    }

    fn timed(
        &self,
        obs: &Observation,
        opts: &Options,
        no_wait: bool,
    ) -> Result<(ActionChunk, Timing)> {
        let t0 = std::time::Instant::now();
        let pre = self.preprocess(obs, opts)?;
        let t1 = std::time::Instant::now();
        // The model inputs go to the owner thread (no copy of the images); what the chunk's
        // postprocessing and report need stays here.
        let Prepared {
            inputs,
            state,
            prompt,
        } = pre;
        let prompt_ids = (inputs.tokens.clone(), inputs.token_mask.clone());
        let (raw, chunk) = self.run(inputs, no_wait)?;
        let t2 = std::time::Instant::now();
        let c = self.postprocess(&state, prompt, prompt_ids, &raw)?;
        let t3 = std::time::Instant::now();
        let s = |a: std::time::Instant, b: std::time::Instant| (b - a).as_secs_f64();
        Ok((
            c,
            Timing {
                preprocess: s(t0, t1),
                queued: (s(t1, t2) - chunk).max(0.0),
                chunk,
                postprocess: s(t2, t3),
                total: s(t0, t3),
            },
        ))
    }

    fn run(&self, inputs: Inputs, no_wait: bool) -> Result<(Vec<f32>, f64)> {
        let stopped = || Error::Internal("the policy's thread has stopped".into());
        let tx = self.tx.as_ref().ok_or_else(stopped)?;
        let (reply, rx) = sync_channel(1);
        let job = Job { inputs, reply };
        if no_wait {
            match tx.try_send(job) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => return Err(Error::Busy(self.queue)),
                Err(TrySendError::Disconnected(_)) => return Err(stopped()),
            }
        } else {
            tx.send(job).map_err(|_| stopped())?;
        }
        rx.recv().map_err(|_| stopped())?
    }

    fn preprocess(&self, obs: &Observation, opts: &Options) -> Result<Prepared> {
        let cfg = &self.cfg;
        let seen = prepare(cfg, &self.runner, obs)?;
        let text = lerobot::prompt(
            &obs.task,
            &lerobot::state_bins(&seen.norm_state, self.runner.state_bins),
        );
        let (tokens, token_mask) = self.tokenizer.encode(&text)?;
        if let Some(t) = tokens
            .iter()
            .find(|&&t| t < 0 || t as usize >= cfg.language.vocab)
        {
            return Err(Error::input(
                self.tokenizer.path(),
                format!(
                    "token id {t} is outside the model's vocabulary ({}): the wrong tokenizer?",
                    cfg.language.vocab
                ),
            ));
        }
        let noise = self.noise(opts)?;
        let guidance = self.guidance(opts.rtc.as_ref())?;
        Ok(Prepared {
            inputs: Inputs {
                images: seen.images,
                image_masks: seen.image_masks,
                tokens,
                token_mask,
                noise,
                guidance,
            },
            state: seen.state,
            prompt: text,
        })
    }

    /// The step's RTC inputs for `rtc` (checked against the real action width; one error
    /// naming the field), or the plain chunk's.
    fn guidance(&self, rtc: Option<&Rtc>) -> Result<petite_pi05::rtc::Guidance> {
        use petite_pi05::rtc::{Guidance, Rtc as Request};
        let cfg = &self.cfg;
        let Some(rtc) = rtc else {
            return Ok(Guidance::none(cfg));
        };
        const KEY: &str = "rtc.prev_chunk_left_over";
        let r = &self.runner;
        let a = &rtc.prev_chunk_left_over;
        let shape = a.unbatched(KEY, 2)?;
        let want = format!(
            "f32 [rows ≤ {}, columns ≤ {}] (model space)",
            cfg.chunk, r.action_dim
        );
        let data = match a {
            Array::F32 { data, .. }
                if shape.len() == 2
                    && shape[0] <= cfg.chunk
                    && shape[1] <= r.action_dim
                    && data.len() == shape[0] * shape[1] =>
            {
                data
            }
            a => return Err(expected(KEY, want, a.describe())),
        };
        let d = &r.rtc;
        let req = Request {
            prev_chunk_left_over: data.clone(),
            rows: shape[0],
            cols: shape[1],
            inference_delay: rtc.inference_delay,
            execution_horizon: rtc.execution_horizon.unwrap_or(d.execution_horizon),
            schedule: rtc.schedule.unwrap_or(d.schedule),
            max_guidance_weight: rtc.max_guidance_weight.unwrap_or(d.max_guidance_weight),
        };
        Guidance::new(cfg, &req).map_err(|e| match e {
            petite_pi05::Error::Rtc {
                field,
                expected: want,
                found,
            } => expected(&format!("rtc.{field}"), want, found),
            e => Error::from(e),
        })
    }

    /// The call's noise: given (checked), from its seed, or the policy's generator.
    fn noise(&self, opts: &Options) -> Result<Vec<f32>> {
        let cfg = &self.cfg;
        let n = cfg.chunk * cfg.action_dim;
        if let Some(v) = &opts.noise {
            if v.len() != n {
                return Err(expected(
                    "noise",
                    format!("f32 [{}, {}] ({n} values)", cfg.chunk, cfg.action_dim),
                    format!("{} values", v.len()),
                ));
            }
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                return Err(expected(
                    "noise",
                    "finite values",
                    format!("{} at {i}", v[i]),
                ));
            }
            return Ok(v.clone());
        }
        if let Some(seed) = opts.seed {
            // Only the noise's values are drawn (a full set of seeded inputs would draw every
            // image value of every camera first, on every call).
            return Ok(seeded_noise(seed, n));
        }
        let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
        Ok((0..n).map(|_| rng.normal()).collect())
    }

    fn postprocess(
        &self,
        state: &[f32],
        prompt: String,
        (tokens, token_mask): (Vec<i64>, Vec<u8>),
        raw: &[f32],
    ) -> Result<ActionChunk> {
        let (cfg, r) = (&self.cfg, &self.runner);
        if raw.len() != cfg.chunk * cfg.action_dim {
            return Err(Error::Internal(format!(
                "the programs gave {} action values, expected {}",
                raw.len(),
                cfg.chunk * cfg.action_dim
            )));
        }
        if let Some(i) = raw.iter().position(|v| !v.is_finite()) {
            return Err(Error::input(
                &self.dir,
                format!(
                    "the programs' actions are not finite: {} at index {i}",
                    raw[i]
                ),
            ));
        }
        let mut actions = Vec::with_capacity(cfg.chunk * r.action_dim);
        let mut model = Vec::with_capacity(cfg.chunk * r.action_dim);
        for row in raw.chunks_exact(cfg.action_dim) {
            let m = &row[..r.action_dim];
            model.extend_from_slice(m);
            let mut a = lerobot::unnormalize(m, &r.action_norm);
            if let Some(mask) = &r.relative_action_mask {
                for (i, on) in mask.iter().enumerate() {
                    if *on && i < state.len() {
                        a[i] += state[i];
                    }
                }
            }
            actions.extend(a);
        }
        Ok(ActionChunk {
            actions,
            model,
            chunk: cfg.chunk,
            action_dim: r.action_dim,
            n_action_steps: r.n_action_steps,
            prompt,
            tokens,
            token_mask,
        })
    }
}

impl Drop for Policy {
    fn drop(&mut self) {
        // Closing the queue ends the owner thread once the chunk in hand (if any) is done.
        self.tx.take();
        if let Some(t) = self.owner.take() {
            let _ = t.join();
        }
    }
}

/// lerobot's preprocessing of `obs` up to the prompt: every key, shape and value checked (one
/// error naming the key), the state normalized, the images resized and padded, missing cameras
/// masked.
/// The model's image input from the present cameras' prepared planes (in slot order) followed by
/// `missing` planes of -1 with mask 0, as lerobot pads; no camera at all is refused as lerobot
/// refuses it (`what`: "an observation", "a batch").
fn stacked(
    r: &Runner,
    present: &[Vec<f32>],
    missing: usize,
    plane: usize,
    what: &str,
) -> Result<(Vec<f32>, Vec<u8>)> {
    if present.is_empty() {
        return Err(observation(
            "observation.images",
            format!(
                "no camera image: at least one of {} is needed (lerobot refuses {what} without images)",
                r.cameras
                    .iter()
                    .filter(|c| !c.empty)
                    .map(|c| c.key.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    let mut images = Vec::with_capacity((present.len() + missing) * plane);
    let mut image_masks = Vec::with_capacity(present.len() + missing);
    for p in present {
        images.extend_from_slice(p);
        image_masks.push(1);
    }
    images.extend(std::iter::repeat_n(-1f32, missing * plane));
    image_masks.extend(std::iter::repeat_n(0, missing));
    Ok((images, image_masks))
}

fn prepare(cfg: &Pi05Config, r: &Runner, obs: &Observation) -> Result<Seen> {
    for k in obs.images.keys() {
        if !r.cameras.iter().any(|c| &c.key == k) {
            let cams: Vec<&str> = r.cameras.iter().map(|c| c.key.as_str()).collect();
            return Err(expected(
                k,
                format!("one of {}", cams.join(", ")),
                "an unknown camera key",
            ));
        }
    }
    // State.
    let want_state = format!("f32 [{}]", r.state_dim);
    let state_a = obs
        .state
        .as_ref()
        .ok_or_else(|| expected(STATE_KEY, &want_state, "nothing"))?;
    let shape = state_a.unbatched(STATE_KEY, 1)?;
    let state = match state_a {
        Array::F32 { data, .. } if shape == [r.state_dim] && data.len() == r.state_dim => {
            data.clone()
        }
        a => return Err(expected(STATE_KEY, &want_state, a.describe())),
    };
    if let Some(i) = state.iter().position(|v| !v.is_finite()) {
        return Err(expected(
            STATE_KEY,
            "finite values",
            format!("{} at {i}", state[i]),
        ));
    }
    let mut norm_state = lerobot::normalize(&state, &r.state_norm);
    if r.state_padded {
        norm_state.resize(r.max_state_dim, 0.0);
    }
    // Images: present cameras first (config order), then the missing ones masked, as lerobot.
    let res = cfg.vision.image_size;
    let plane = 3 * res * res;
    let mut present = Vec::new();
    let mut missing = 0;
    for c in &r.cameras {
        let Some(a) = obs.images.get(&c.key) else {
            missing += 1;
            continue;
        };
        let want = "float32 [3, H, W] in [0, 1] or uint8 [H, W, 3]";
        let s = a.unbatched(&c.key, 3)?;
        if elements(&s) != Some(a.len()) {
            return Err(expected(&c.key, values_for(&s), a.len()));
        }
        let (h, w, chw) = match (a, s.as_slice()) {
            (Array::F32 { data, .. }, [3, h, w]) if *h > 0 && *w > 0 => (*h, *w, data.clone()),
            (Array::U8 { data, .. }, [h, w, 3]) if *h > 0 && *w > 0 => {
                // uint8 images are scaled by 1/255, as lerobot's datasets and environments do.
                let mut chw = vec![0f32; data.len()];
                for y in 0..*h {
                    for x in 0..*w {
                        for ch in 0..3 {
                            chw[ch * h * w + y * w + x] = data[(y * w + x) * 3 + ch] as f32 / 255.0;
                        }
                    }
                }
                (*h, *w, chw)
            }
            _ => return Err(expected(&c.key, want, a.describe())),
        };
        if let Some(i) = chw.iter().position(|v| !v.is_finite()) {
            return Err(expected(
                &c.key,
                "finite values",
                format!("{} at {i}", chw[i]),
            ));
        }
        present.push(lerobot::prepare_image(&chw, h, w, res));
    }
    let (images, image_masks) = stacked(r, &present, missing, plane, "an observation")?;
    if obs.task.trim().is_empty() {
        return Err(observation(
            "task",
            "empty: the prompt needs the task's text",
        ));
    }
    Ok(Seen {
        images,
        image_masks,
        state,
        norm_state,
    })
}

/// An observation after the checks and the image and state steps of lerobot's preprocessing.
struct Seen {
    images: Vec<f32>,
    image_masks: Vec<u8>,
    state: Vec<f32>,
    norm_state: Vec<f32>,
}

/// Checks `obs` as [`Policy::act`] would, for the export described by `spec`, without opening
/// it: a one-shot caller (`petite act`) refuses a bad observation before any weight is read.
pub fn check_observation(spec: &petite_pi05::policy::PolicySpec, obs: &Observation) -> Result<()> {
    let r = spec.runner.as_ref().ok_or_else(|| {
        Error::Internal("check_observation needs an export with a lerobot interface".into())
    })?;
    prepare(&spec.model, r, obs).map(|_| ())
}

/// An observation after lerobot's preprocessing.
struct Prepared {
    inputs: Inputs,
    state: Vec<f32>,
    prompt: String,
}

/// The owner thread: opens the programs, says it is ready (or why not), then serves jobs until
/// the queue closes. A panic inside one chunk is that chunk's error; the thread goes on.
fn owner(
    dir: &Path,
    cfg: &Pi05Config,
    device: Device,
    bundle: BundleRunner,
    ready: SyncSender<Result<String>>,
    rx: Receiver<Job>,
) {
    let serve = |chunk: &mut dyn FnMut(&Inputs) -> Result<Vec<f32>>| {
        for job in rx.iter() {
            let t = std::time::Instant::now();
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| chunk(&job.inputs)))
                .unwrap_or_else(|p| {
                    let what = p
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    Err(Error::Internal(format!("a chunk panicked: {what}")))
                });
            let _ = job.reply.send(r.map(|x| (x, t.elapsed().as_secs_f64())));
        }
    };
    if bundle.kind() == BundleKind::Engines {
        let opened = crate::bundle::with_resident(dir, cfg, device, |chunk, names| {
            let _ = ready.send(Ok(names.join(", ")));
            serve(chunk);
        });
        if let Err(e) = opened {
            let _ = ready.send(Err(e));
        }
    } else {
        let name = match bundle.kind() {
            BundleKind::Onnx => "onnxruntime (separate process)",
            _ => "executorch-numpy-runtime (separate process)",
        };
        let _ = ready.send(Ok(name.to_string()));
        let mut chunk = |inputs: &Inputs| bundle.run(cfg, inputs, None).map(|(a, _)| a);
        serve(&mut chunk);
    }
}

/// The `n` standard-normal values `Options { seed: Some(seed), .. }` draws as a chunk's noise,
/// so a caller can give the same noise explicitly (or reproduce a seeded chunk elsewhere).
pub fn seeded_noise(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = NoiseRng::new(seed);
    (0..n).map(|_| rng.normal()).collect()
}

/// The policy's own standard-normal noise: splitmix64 words, Box–Muller pairs (both halves
/// used), so no two calls draw the same noise.
struct NoiseRng {
    state: u64,
    spare: Option<f32>,
}

impl NoiseRng {
    fn new(seed: u64) -> Self {
        NoiseRng {
            state: seed ^ 0x2545_f491_4f6c_dd1d,
            spare: None,
        }
    }

    fn unit(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f32 {
        if let Some(s) = self.spare.take() {
            return s;
        }
        let (u1, u2) = (self.unit().max(1e-300), self.unit());
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        self.spare = Some((r * t.sin()) as f32);
        (r * t.cos()) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policys_noise_is_standard_normal_and_never_repeats() {
        let mut g = NoiseRng::new(7);
        let a: Vec<f32> = (0..20_000).map(|_| g.normal()).collect();
        let b: Vec<f32> = (0..20_000).map(|_| g.normal()).collect();
        assert_ne!(a, b);
        let mean = a.iter().map(|&v| v as f64).sum::<f64>() / a.len() as f64;
        let var = a.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / a.len() as f64;
        // 20,000 draws: the mean's standard error is 0.007, the variance's 0.01.
        assert!(
            mean.abs() < 0.04 && (var - 1.0).abs() < 0.05,
            "{mean} {var}"
        );
        assert!(a.iter().all(|v| v.is_finite()));
        assert_eq!(NoiseRng::new(7).normal(), a[0]);
    }

    #[test]
    fn a_batch_of_more_than_one_is_refused_and_a_batch_of_one_unwrapped() {
        let one = Array::u8(&[1, 4, 4, 3], vec![0; 48]);
        assert_eq!(one.unbatched("cam", 3).unwrap(), [4, 4, 3]);
        let two = Array::u8(&[2, 4, 4, 3], vec![0; 96]);
        let e = two.unbatched("cam", 3).unwrap_err().to_string();
        assert!(e.contains("`cam`") && e.contains("a batch of 2"), "{e}");
    }
}
