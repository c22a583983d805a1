//! `petite._petite`: the native half of petite's Python package — a [`petite::policy::Policy`]
//! behind a Python class, numpy arrays in and out.
//!
//! The logic is the Rust policy's; this crate only converts: a lerobot observation dict
//! (`observation.images.*` as uint8 `[H, W, 3]` or float `[3, H, W]`, `observation.state`, `task`;
//! any array-like numpy can read, a leading batch dimension of 1 allowed) into a
//! [`petite::policy::Observation`], and the chunk back into numpy arrays. The GIL is released
//! while the chunk runs (opening too), so other Python threads go on meanwhile.

#![deny(missing_docs)]

mod client;
mod model;

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Instant;

use numpy::ndarray::{Array2, Array3};
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArray3, PyArrayDescrMethods, PyArrayDyn, PyArrayMethods,
    PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use petite::Error;
use petite::policy::{self, Array, Observation, OpenOptions, Options};
use petite::runtimes::Device;

pyo3::create_exception!(
    petite,
    Busy,
    PyRuntimeError,
    "The policy's queue is full: raised by a call with `wait=False` (a server answers RESOURCE_EXHAUSTED)."
);

/// The key lerobot gives the robot's state.
const STATE: &str = "observation.state";
/// The prefix of lerobot's camera keys.
const IMAGES: &str = "observation.images.";
/// The key of the task's text.
const TASK: &str = "task";

/// A petite error as a Python exception: a bad observation (or noise) is a `ValueError` naming
/// the key, a full queue [`Busy`], anything else a `RuntimeError`.
fn py_err(e: Error) -> PyErr {
    match e {
        Error::Observation { .. } | Error::Usage(_) => PyValueError::new_err(e.to_string()),
        Error::Busy(_) => Busy::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

fn bad(key: &str, reason: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("`{key}`: {reason}"))
}

/// `numpy.asarray`, looked up once.
fn asarray<'py>(py: Python<'py>) -> PyResult<&'py Bound<'py, PyAny>> {
    static ASARRAY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    ASARRAY
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("numpy")?.getattr("asarray")?.unbind())
        })
        .map(|f| f.bind(py))
}

/// A numpy array's values in row-major order (a copy; strided arrays walked in order).
fn values<T: numpy::Element + Copy>(
    a: &Bound<'_, PyArrayDyn<T>>,
) -> PyResult<(Vec<usize>, Vec<T>)> {
    let ro = a.try_readonly()?;
    let shape = ro.shape().to_vec();
    let data = match ro.as_slice() {
        Ok(s) => s.to_vec(),
        Err(_) => ro.as_array().iter().copied().collect(),
    };
    Ok((shape, data))
}

/// Which values an entry may hold.
#[derive(Clone, Copy, PartialEq)]
enum Want {
    /// uint8 kept as uint8, any float dtype as float32 (camera images).
    Image,
    /// Any real number dtype as float32 (state, noise).
    Float,
}

/// One observation entry (any array-like numpy reads: numpy arrays, CPU torch tensors, lists)
/// as petite's [`Array`].
fn to_array(key: &str, v: &Bound<'_, PyAny>, want: Want) -> PyResult<Array> {
    if let Ok(a) = v.cast::<PyArrayDyn<f32>>() {
        let (shape, data) = values(a)?;
        return Ok(Array::F32 { shape, data });
    }
    if want == Want::Image
        && let Ok(a) = v.cast::<PyArrayDyn<u8>>()
    {
        let (shape, data) = values(a)?;
        return Ok(Array::U8 { shape, data });
    }
    let py = v.py();
    let any = asarray(py)?
        .call1((v,))
        .map_err(|e| bad(key, format!("not an array numpy can read ({e})")))?;
    let arr = any
        .cast::<PyUntypedArray>()
        .map_err(|_| bad(key, "not an array numpy can read"))?;
    let dtype = arr.dtype();
    let kind = dtype.kind();
    let ok = match want {
        Want::Image => kind == b'f' || (kind == b'u' && dtype.itemsize() == 1),
        Want::Float => matches!(kind, b'f' | b'i' | b'u'),
    };
    if !ok {
        let what = match want {
            Want::Image => "uint8 [H, W, 3] or float32 [3, H, W] in [0, 1]",
            Want::Float => "float32 values",
        };
        return Err(bad(
            key,
            format!("expected {what}, found a {} array", dtype.str()?),
        ));
    }
    if kind == b'u' && want == Want::Image {
        let a = arr.cast::<PyArrayDyn<u8>>()?;
        let (shape, data) = values(a)?;
        return Ok(Array::U8 { shape, data });
    }
    let kw = PyDict::new(py);
    kw.set_item("dtype", "float32")?;
    let f = asarray(py)?.call((arr,), Some(&kw))?;
    let (shape, data) = values(f.cast::<PyArrayDyn<f32>>()?)?;
    Ok(Array::F32 { shape, data })
}

/// The task: a str, or a batch of one str (lerobot's batches hold `["…"]`).
fn to_task(v: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(s) = v.cast::<PyString>() {
        return Ok(s.to_cow()?.into_owned());
    }
    let one = if let Ok(l) = v.cast::<PyList>() {
        (l.len() == 1).then(|| l.get_item(0)).transpose()?
    } else if let Ok(t) = v.cast::<PyTuple>() {
        (t.len() == 1).then(|| t.get_item(0)).transpose()?
    } else {
        None
    };
    match one.as_ref().map(|o| o.cast::<PyString>()) {
        Some(Ok(s)) => Ok(s.to_cow()?.into_owned()),
        _ => Err(bad(
            TASK,
            format!(
                "expected a str (or a list of one str), found {}",
                v.get_type().name()?
            ),
        )),
    }
}

/// A lerobot observation (a dict or any mapping) as petite's: camera keys
/// (`observation.images.*`), `observation.state` and `task`; other keys (a dataset frame's
/// `action`, `timestamp`, `index`, …) are not the policy's inputs and are skipped, as lerobot's
/// preprocessor does.
fn to_observation(obs: &Bound<'_, PyAny>) -> PyResult<Observation> {
    let items = if let Ok(d) = obs.cast::<PyDict>() {
        d.items().into_any()
    } else {
        obs.call_method0("items").map_err(|_| {
            PyTypeError::new_err(format!(
                "the observation must be a dict of lerobot's keys, not {}",
                obs.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?
    };
    let mut out = Observation::default();
    let mut task = None;
    for item in items.try_iter()? {
        let (k, v): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item?.extract()?;
        let Ok(k) = k.cast::<PyString>() else {
            continue;
        };
        let key = k.to_cow()?;
        let key = key.as_ref();
        if key == STATE {
            out.state = Some(to_array(key, &v, Want::Float)?);
        } else if key == TASK {
            task = Some(to_task(&v)?);
        } else if key.starts_with(IMAGES) {
            out.images
                .insert(key.to_string(), to_array(key, &v, Want::Image)?);
        }
    }
    out.task = task.ok_or_else(|| bad(TASK, "missing: the prompt needs the task's text"))?;
    Ok(out)
}

/// The call's options: explicit noise (`[chunk, max_action_dim]`, or with a leading 1) and seed.
fn to_options(
    (chunk, max_action_dim): (usize, usize),
    noise: Option<&Bound<'_, PyAny>>,
    seed: Option<u64>,
) -> PyResult<Options> {
    let noise = match noise {
        None => None,
        Some(n) if n.is_none() => None,
        Some(n) => match to_array("noise", n, Want::Float)? {
            Array::F32 { shape, data } => {
                let (c, m) = (chunk, max_action_dim);
                if shape != [c, m] && shape != [1, c, m] {
                    return Err(bad(
                        "noise",
                        format!("expected float32 [{c}, {m}] (or [1, {c}, {m}]), found {shape:?}"),
                    ));
                }
                Some(data)
            }
            Array::U8 { .. } => unreachable!("noise is read as float"),
        },
    };
    Ok(Options {
        noise,
        seed,
        rtc: None,
    })
}

/// The RTC keywords lerobot's `predict_action_chunk` takes (and `RTCConfig`'s settings).
const RTC_KEYS: [&str; 5] = [
    "prev_chunk_left_over",
    "inference_delay",
    "execution_horizon",
    "prefix_attention_schedule",
    "max_guidance_weight",
];

/// Real-time chunking from lerobot's keywords: `prev_chunk_left_over` (model space, `[rows,
/// cols]` or with a leading 1; `None`: a plain chunk, the others ignored, as lerobot does),
/// `inference_delay` (required with a leftover), and optionally `execution_horizon`,
/// `prefix_attention_schedule` (a name or lerobot's `RTCAttentionSchedule`) and
/// `max_guidance_weight`. An unknown keyword is a TypeError.
fn to_rtc(kw: Option<&Bound<'_, PyDict>>) -> PyResult<Option<policy::Rtc>> {
    let Some(kw) = kw else {
        return Ok(None);
    };
    for k in kw.keys() {
        let k: String = k.extract()?;
        if !RTC_KEYS.contains(&k.as_str()) {
            return Err(PyTypeError::new_err(format!(
                "unexpected keyword argument `{k}` (real-time chunking takes {})",
                RTC_KEYS.join(", ")
            )));
        }
    }
    let get = |k: &str| -> PyResult<Option<Bound<'_, PyAny>>> {
        Ok(kw.get_item(k)?.filter(|v| !v.is_none()))
    };
    let Some(prev) = get("prev_chunk_left_over")? else {
        return Ok(None);
    };
    let key = |k: &str| format!("rtc.{k}");
    let prev = to_array(&key("prev_chunk_left_over"), &prev, Want::Float)?;
    let count = |k: &str| -> PyResult<Option<usize>> {
        match get(k)? {
            None => Ok(None),
            Some(v) => match v.extract::<i64>() {
                Ok(n) if n >= 0 => Ok(Some(n as usize)),
                Ok(n) => Err(bad(&key(k), format!("expected an integer ≥ 0, found {n}"))),
                Err(_) => Err(bad(
                    &key(k),
                    format!("expected an integer ≥ 0, found {}", v.get_type().name()?),
                )),
            },
        }
    };
    let inference_delay = count("inference_delay")?.ok_or_else(|| {
        bad(
            &key("inference_delay"),
            "missing: required with prev_chunk_left_over (the actions executed while the chunk is computed)",
        )
    })?;
    let schedule = match get("prefix_attention_schedule")? {
        None => None,
        Some(v) => {
            // lerobot's RTCAttentionSchedule is a str enum; its `.value` is the name.
            let name: String = match v.extract::<String>() {
                Ok(s) => s,
                Err(_) => v
                    .getattr("value")
                    .and_then(|x| x.extract::<String>())
                    .map_err(|_| bad(&key("prefix_attention_schedule"), "expected a str"))?,
            };
            let name = name.rsplit('.').next().unwrap_or_default().to_string();
            Some(
                name.parse::<policy::Schedule>()
                    .map_err(|e| bad(&key("prefix_attention_schedule"), e))?,
            )
        }
    };
    let max_guidance_weight = match get("max_guidance_weight")? {
        None => None,
        Some(v) => Some(
            v.extract::<f32>()
                .map_err(|_| bad(&key("max_guidance_weight"), "expected a number > 0"))?,
        ),
    };
    Ok(Some(policy::Rtc {
        prev_chunk_left_over: prev,
        inference_delay,
        execution_horizon: count("execution_horizon")?,
        schedule,
        max_guidance_weight,
    }))
}

/// An exported pi0.5 policy, opened once (see the package's documentation).
#[pyclass(frozen, module = "petite")]
struct Policy {
    /// `None` once closed; a call holds its own reference, so closing never cuts a chunk short.
    inner: RwLock<Option<Arc<policy::Policy>>>,
    info: policy::Info,
    dir: PathBuf,
}

impl Policy {
    fn policy(&self) -> PyResult<Arc<policy::Policy>> {
        self.inner
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| PyRuntimeError::new_err("the policy is closed"))
    }

    /// One chunk: the observation converted (GIL held), then `Policy::act` with the GIL
    /// released. Returns the chunk and the seconds `Policy::act` took.
    fn chunk(
        &self,
        py: Python<'_>,
        obs: &Bound<'_, PyAny>,
        noise: Option<&Bound<'_, PyAny>>,
        seed: Option<u64>,
        wait: bool,
        rtc: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<(policy::ActionChunk, f64)> {
        let p = self.policy()?;
        let observation = to_observation(obs)?;
        let mut options = to_options((self.info.chunk, self.info.max_action_dim), noise, seed)?;
        options.rtc = to_rtc(rtc)?;
        let (r, secs) = py.detach(move || {
            let t = Instant::now();
            let r = if wait {
                p.act(&observation, &options)
            } else {
                p.try_act(&observation, &options)
            };
            (r, t.elapsed().as_secs_f64())
        });
        Ok((r.map_err(py_err)?, secs))
    }
}

#[pymethods]
impl Policy {
    /// Opens the export in `export_dir` (what `petite export` wrote from a lerobot policy
    /// folder) on `device` ("cpu" or "cuda"). `tokenizer`: a `tokenizer.json` (else as `petite
    /// act` finds it); `python`: the interpreter with ExecuTorch's or ONNX Runtime's runtime for
    /// portable and ONNX exports; `seed`: the policy's own noise generator; `queue`: calls that
    /// may wait for the device at once.
    #[new]
    #[pyo3(signature = (export_dir, device="cpu", tokenizer=None, python=None, seed=None, queue=8))]
    fn new(
        py: Python<'_>,
        export_dir: PathBuf,
        device: &str,
        tokenizer: Option<PathBuf>,
        python: Option<PathBuf>,
        seed: Option<u64>,
        queue: usize,
    ) -> PyResult<Self> {
        let device = Device::from_name(device).ok_or_else(|| {
            let names: Vec<String> = petite::runtimes::devices()
                .iter()
                .map(|d| format!("{:?}", d.name()))
                .collect();
            PyValueError::new_err(format!(
                "device: expected {}, found {device:?}",
                names.join(" or ")
            ))
        })?;
        let opts = OpenOptions {
            device,
            tokenizer,
            python,
            seed,
            queue,
        };
        let dir = export_dir.clone();
        let p = py.detach(move || policy::Policy::open(&dir, &opts).map_err(py_err))?;
        Ok(Policy {
            info: p.info().clone(),
            inner: RwLock::new(Some(Arc::new(p))),
            dir: export_dir,
        })
    }

    /// What the policy takes and gives: export_id, backend, dtype, device, runtime, cameras
    /// ([(key, always_empty)] in the model's order), state_dim, action_dim, max_action_dim,
    /// chunk, n_action_steps.
    #[getter]
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let i = &self.info;
        let d = PyDict::new(py);
        d.set_item("export_id", &i.export_id)?;
        d.set_item("backend", &i.backend)?;
        d.set_item("dtype", &i.dtype)?;
        d.set_item("device", i.device.name())?;
        d.set_item("runtime", &i.runtime)?;
        d.set_item("cameras", i.cameras.clone())?;
        d.set_item("state_dim", i.state_dim)?;
        d.set_item("action_dim", i.action_dim)?;
        d.set_item("max_action_dim", i.max_action_dim)?;
        d.set_item("chunk", i.chunk)?;
        d.set_item("n_action_steps", i.n_action_steps)?;
        Ok(d)
    }

    /// One chunk of actions for a raw lerobot observation, post-processed (what the robot
    /// executes): float32 `[chunk, action_dim]`. `noise`: the flow's starting noise, float32
    /// `[chunk, max_action_dim]`; `seed`: reproducible noise; neither: fresh noise each call.
    /// `wait=False` raises `petite.Busy` at once when the queue is full. Real-time chunking:
    /// lerobot's keywords `prev_chunk_left_over` (model space), `inference_delay`, and
    /// optionally `execution_horizon`, `prefix_attention_schedule`, `max_guidance_weight`.
    #[pyo3(signature = (obs, noise=None, seed=None, wait=true, **rtc))]
    fn act<'py>(
        &self,
        py: Python<'py>,
        obs: &Bound<'py, PyAny>,
        noise: Option<&Bound<'py, PyAny>>,
        seed: Option<u64>,
        wait: bool,
        rtc: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let (c, _) = self.chunk(py, obs, noise, seed, wait, rtc)?;
        Ok(matrix(py, c.actions, c.chunk, c.action_dim))
    }

    /// The model-space chunk (normalized, unpadded), as lerobot's `predict_action_chunk`
    /// returns it: float32 `[1, chunk, action_dim]`. Takes the raw observation (petite runs
    /// lerobot's preprocessor itself), with `act`'s options.
    #[pyo3(signature = (obs, noise=None, seed=None, wait=true, **rtc))]
    fn predict_action_chunk<'py>(
        &self,
        py: Python<'py>,
        obs: &Bound<'py, PyAny>,
        noise: Option<&Bound<'py, PyAny>>,
        seed: Option<u64>,
        wait: bool,
        rtc: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyArray3<f32>>> {
        let (c, _) = self.chunk(py, obs, noise, seed, wait, rtc)?;
        let a = Array3::from_shape_vec((1, c.chunk, c.action_dim), c.model)
            .map_err(|e| PyRuntimeError::new_err(format!("the model's chunk: {e}")))?;
        Ok(a.into_pyarray(py))
    }

    /// The model-space chunk for a batch as lerobot's PI05 *preprocessor* emits it (what
    /// lerobot's `PI05Policy.predict_action_chunk` takes): the camera images
    /// (`observation.images.*`, float32 `[1, 3, H, W]` or `[3, H, W]` in [0, 1], any size:
    /// petite resizes, pads and masks missing cameras as PI05 does inside its model),
    /// `observation.language.tokens` (int64 `[1, tokens]`) and
    /// `observation.language.attention_mask` (bool); other keys are ignored (PI05 reads the
    /// state through the prompt). Numpy arrays or CPU torch tensors. Returns float32
    /// `[1, chunk, action_dim]`, normalized and unpadded, equal to lerobot's
    /// `predict_action_chunk`. `noise` and `seed` as in `act`; a batch of more than one is
    /// refused (ValueError naming the key). The GIL is released while the chunk runs. Real-time
    /// chunking: lerobot's keywords, as in `act`.
    #[pyo3(signature = (batch, noise=None, seed=None, wait=true, **rtc))]
    fn predict_action_chunk_model<'py>(
        &self,
        py: Python<'py>,
        batch: &Bound<'py, PyAny>,
        noise: Option<&Bound<'py, PyAny>>,
        seed: Option<u64>,
        wait: bool,
        rtc: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyArray3<f32>>> {
        let p = self.policy()?;
        let inputs = model::to_model_inputs(batch)?;
        let mut options = to_options((self.info.chunk, self.info.max_action_dim), noise, seed)?;
        options.rtc = to_rtc(rtc)?;
        let c = py.detach(move || {
            if wait {
                p.act_model(&inputs, &options)
            } else {
                p.try_act_model(&inputs, &options)
            }
            .map_err(py_err)
        })?;
        let a = Array3::from_shape_vec((1, c.chunk, c.action_dim), c.model)
            .map_err(|e| PyRuntimeError::new_err(format!("the model's chunk: {e}")))?;
        Ok(a.into_pyarray(py))
    }

    /// Both chunks of one call and what went with them, as an `ActionChunk`.
    #[pyo3(signature = (obs, noise=None, seed=None, wait=true, **rtc))]
    fn act_chunk(
        &self,
        py: Python<'_>,
        obs: &Bound<'_, PyAny>,
        noise: Option<&Bound<'_, PyAny>>,
        seed: Option<u64>,
        wait: bool,
        rtc: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<ActionChunk> {
        let (c, seconds) = self.chunk(py, obs, noise, seed, wait, rtc)?;
        Ok(ActionChunk {
            c,
            seconds,
            server_ms: None,
        })
    }

    /// Closes the policy: its programs are released once a call in flight returns; later calls
    /// raise RuntimeError.
    fn close(&self, py: Python<'_>) {
        let p = self.inner.write().unwrap_or_else(|p| p.into_inner()).take();
        // Dropping the last reference joins the owner thread: without the GIL.
        py.detach(move || drop(p));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        let i = &self.info;
        format!(
            "petite.Policy({:?}, device={:?}, chunk={}, action_dim={}, runtime={:?})",
            self.dir.display().to_string(),
            i.device.name(),
            i.chunk,
            i.action_dim,
            i.runtime
        )
    }
}

fn matrix(py: Python<'_>, v: Vec<f32>, rows: usize, cols: usize) -> Bound<'_, PyArray2<f32>> {
    match Array2::from_shape_vec((rows, cols), v) {
        Ok(a) => a.into_pyarray(py),
        // `Policy::act` gives rows × cols values; never reached.
        Err(_) => PyArray2::zeros(py, (rows, cols), false),
    }
}

/// One call's output: `actions` (post-processed, float32 `[chunk, action_dim]`), `model` (the
/// model's chunk, float32 `[chunk, action_dim]`), `chunk`, `action_dim`, `n_action_steps`, the
/// `prompt` as tokenized, its `tokens` (int64) and `token_mask` (bool), and `seconds`: the time
/// `Policy::act` took inside the call (GIL released).
#[pyclass(frozen, module = "petite")]
struct ActionChunk {
    c: policy::ActionChunk,
    seconds: f64,
    server_ms: Option<f64>,
}

#[pymethods]
impl ActionChunk {
    /// Post-processed actions, float32 `[chunk, action_dim]`.
    #[getter]
    fn actions<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray2<f32>> {
        matrix(py, self.c.actions.clone(), self.c.chunk, self.c.action_dim)
    }

    /// The model's chunk, float32 `[chunk, action_dim]`.
    #[getter]
    fn model<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray2<f32>> {
        matrix(py, self.c.model.clone(), self.c.chunk, self.c.action_dim)
    }

    /// Actions a chunk.
    #[getter]
    fn chunk(&self) -> usize {
        self.c.chunk
    }

    /// The real action width.
    #[getter]
    fn action_dim(&self) -> usize {
        self.c.action_dim
    }

    /// How many actions lerobot executes before planning again.
    #[getter]
    fn n_action_steps(&self) -> usize {
        self.c.n_action_steps
    }

    /// The prompt as tokenized.
    #[getter]
    fn prompt(&self) -> &str {
        &self.c.prompt
    }

    /// The prompt's token ids (right-padded), int64.
    #[getter]
    fn tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        PyArray1::from_slice(py, &self.c.tokens)
    }

    /// True for a real token.
    #[getter]
    fn token_mask<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<bool>> {
        let m: Vec<bool> = self.c.token_mask.iter().map(|&v| v != 0).collect();
        m.into_pyarray(py)
    }

    /// Seconds `Policy::act` took inside the call (a `Client`'s: the whole round trip).
    #[getter]
    fn seconds(&self) -> f64 {
        self.seconds
    }

    /// A `Client`'s call: the server's time for it in milliseconds (the round trip less this
    /// is the transport's); `None` for an in-process `Policy`.
    #[getter]
    fn server_ms(&self) -> Option<f64> {
        self.server_ms
    }

    fn __repr__(&self) -> String {
        format!(
            "petite.ActionChunk(chunk={}, action_dim={}, n_action_steps={})",
            self.c.chunk, self.c.action_dim, self.c.n_action_steps
        )
    }
}

/// The module `petite._petite`.
#[pymodule]
fn _petite(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Policy>()?;
    m.add_class::<ActionChunk>()?;
    m.add_class::<client::Client>()?;
    m.add("Busy", m.py().get_type::<Busy>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
