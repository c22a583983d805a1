//! `petite.Client`: a policy served by `petite serve`, called as a local `petite.Policy` is —
//! the same observation dicts, the same arrays back — over gRPC (petite-serve's blocking
//! [`petite_serve::Client`], the `.proto`'s own stubs; no grpcio needed).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use numpy::ndarray::Array3;
use numpy::{IntoPyArray, PyArray2, PyArray3};
use pyo3::exceptions::{PyConnectionError, PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use petite::policy::{self, Array};
use petite_serve::{self as serve, Call, Error};
use tonic::Code;

use crate::{ActionChunk, Busy, matrix, to_observation, to_options, to_rtc};

/// A client error as a Python exception, as `petite.Policy` raises them: a refused observation
/// is a `ValueError` naming the key, a full queue [`Busy`], a passed deadline `TimeoutError`, a
/// server that cannot be reached `ConnectionError`, anything else `RuntimeError`.
fn py_err(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::Status { code, message } => match code {
            Code::InvalidArgument => PyValueError::new_err(message),
            Code::ResourceExhausted => Busy::new_err(message),
            Code::DeadlineExceeded | Code::Cancelled => PyTimeoutError::new_err(message),
            Code::Unavailable => PyConnectionError::new_err(message),
            _ => PyRuntimeError::new_err(msg),
        },
        Error::Connect { .. } => PyConnectionError::new_err(msg),
        _ => PyRuntimeError::new_err(msg),
    }
}

fn wire(a: Array) -> serve::Array {
    match a {
        Array::F32 { shape, data } => serve::Array::F32 { shape, data },
        Array::U8 { shape, data } => serve::Array::U8 { shape, data },
    }
}

/// A policy served by `petite serve`, with `petite.Policy`'s calls. `target`: the server's
/// `host:port` (`petite serve --listen`; its default is `127.0.0.1:50051`); `timeout`: seconds a
/// call may take before it is abandoned (`TimeoutError`; the server ends it too), `None` to
/// wait for the chunk; `connect_timeout`: seconds to reach the server. Safe to share between
/// threads: their calls travel at once and the server queues them.
#[pyclass(frozen, module = "petite")]
pub(crate) struct Client {
    inner: serve::Client,
    info: serve::ServerInfo,
}

impl Client {
    fn call(
        &self,
        py: Python<'_>,
        obs: &Bound<'_, PyAny>,
        noise: Option<&Bound<'_, PyAny>>,
        seed: Option<u64>,
        rtc: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<(policy::ActionChunk, f64, f64)> {
        let o = to_observation(obs)?;
        let p = &self.info.policy;
        let options = to_options((p.chunk, p.max_action_dim), noise, seed)?;
        let rtc = to_rtc(rtc)?.map(|r| serve::RtcCall {
            prev_chunk_left_over: wire(r.prev_chunk_left_over),
            inference_delay: r.inference_delay.min(u32::MAX as usize) as u32,
            execution_horizon: r.execution_horizon.map(|h| h.min(u32::MAX as usize) as u32),
            schedule: r.schedule.map(|s| s.name().to_string()),
            max_guidance_weight: r.max_guidance_weight,
        });
        let mut observation: BTreeMap<String, serve::Array> =
            o.images.into_iter().map(|(k, a)| (k, wire(a))).collect();
        if let Some(s) = o.state {
            observation.insert(crate::STATE.to_string(), wire(s));
        }
        let call = Call {
            observation,
            task: o.task,
            noise: options.noise.map(|data| serve::Array::F32 {
                shape: vec![p.chunk, p.max_action_dim],
                data,
            }),
            seed: options.seed,
            rtc,
        };
        let (r, secs) = py.detach(|| {
            let t = Instant::now();
            let r = self.inner.act(&call);
            (r, t.elapsed().as_secs_f64())
        });
        let r = r.map_err(py_err)?;
        let c = r.chunk;
        Ok((
            policy::ActionChunk {
                actions: c.actions,
                model: c.model,
                chunk: c.chunk,
                action_dim: c.action_dim,
                n_action_steps: c.n_action_steps,
                prompt: c.prompt,
                tokens: c.tokens,
                token_mask: c.token_mask,
            },
            secs,
            r.server_ms,
        ))
    }
}

#[pymethods]
impl Client {
    #[new]
    #[pyo3(signature = (target="127.0.0.1:50051", timeout=None, connect_timeout=5.0))]
    fn new(
        py: Python<'_>,
        target: &str,
        timeout: Option<f64>,
        connect_timeout: f64,
    ) -> PyResult<Self> {
        let secs = |what: &str, s: f64| {
            if s.is_finite() && s > 0.0 {
                Ok(Duration::from_secs_f64(s))
            } else {
                Err(PyValueError::new_err(format!(
                    "{what}: expected a positive number of seconds, found {s}"
                )))
            }
        };
        let timeout = timeout.map(|t| secs("timeout", t)).transpose()?;
        let connect = secs("connect_timeout", connect_timeout)?;
        py.detach(|| {
            let inner = serve::Client::connect(target, connect, timeout)?;
            let info = inner.info()?;
            Ok(Client { inner, info })
        })
        .map_err(py_err)
    }

    /// What the served policy takes and gives (as `petite.Policy.info`), plus the server's
    /// `max_message_bytes`, `queue` and `version`, asked once when connecting.
    #[getter]
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (s, i) = (&self.info, &self.info.policy);
        let d = PyDict::new(py);
        d.set_item("export_id", &i.export_id)?;
        d.set_item("backend", &i.backend)?;
        d.set_item("dtype", &i.dtype)?;
        d.set_item("device", &i.device)?;
        d.set_item("runtime", &i.runtime)?;
        let cams: Vec<(String, bool)> =
            i.cameras.iter().map(|c| (c.key.clone(), c.empty)).collect();
        d.set_item("cameras", cams)?;
        d.set_item("state_dim", i.state_dim)?;
        d.set_item("action_dim", i.action_dim)?;
        d.set_item("max_action_dim", i.max_action_dim)?;
        d.set_item("chunk", i.chunk)?;
        d.set_item("n_action_steps", i.n_action_steps)?;
        d.set_item("max_message_bytes", s.max_message_bytes)?;
        d.set_item("queue", s.queue)?;
        d.set_item("version", &s.version)?;
        Ok(d)
    }

    /// Whether the server takes calls now (False while it shuts down).
    fn healthy(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| self.inner.healthy()).map_err(py_err)
    }

    /// `petite.Policy.act` on the server: post-processed actions, float32 `[chunk, action_dim]`.
    #[pyo3(signature = (obs, noise=None, seed=None, **rtc))]
    fn act<'py>(
        &self,
        py: Python<'py>,
        obs: &Bound<'py, PyAny>,
        noise: Option<&Bound<'py, PyAny>>,
        seed: Option<u64>,
        rtc: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let (c, _, _) = self.call(py, obs, noise, seed, rtc)?;
        Ok(matrix(py, c.actions, c.chunk, c.action_dim))
    }

    /// `petite.Policy.predict_action_chunk` on the server: the model's chunk, float32
    /// `[1, chunk, action_dim]`.
    #[pyo3(signature = (obs, noise=None, seed=None, **rtc))]
    fn predict_action_chunk<'py>(
        &self,
        py: Python<'py>,
        obs: &Bound<'py, PyAny>,
        noise: Option<&Bound<'py, PyAny>>,
        seed: Option<u64>,
        rtc: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyArray3<f32>>> {
        let (c, _, _) = self.call(py, obs, noise, seed, rtc)?;
        let a = Array3::from_shape_vec((1, c.chunk, c.action_dim), c.model)
            .map_err(|e| PyRuntimeError::new_err(format!("the model's chunk: {e}")))?;
        Ok(a.into_pyarray(py))
    }

    /// Both chunks of one call as an `ActionChunk`; its `seconds` is the round trip and
    /// `server_ms` the server's part of it.
    #[pyo3(signature = (obs, noise=None, seed=None, **rtc))]
    fn act_chunk(
        &self,
        py: Python<'_>,
        obs: &Bound<'_, PyAny>,
        noise: Option<&Bound<'_, PyAny>>,
        seed: Option<u64>,
        rtc: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<ActionChunk> {
        let (c, seconds, server_ms) = self.call(py, obs, noise, seed, rtc)?;
        Ok(ActionChunk {
            c,
            seconds,
            server_ms: Some(server_ms),
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) {}

    fn __repr__(&self) -> String {
        let i = &self.info.policy;
        format!(
            "petite.Client({:?}, device={:?}, chunk={}, action_dim={})",
            self.inner.target(),
            i.device,
            i.chunk,
            i.action_dim
        )
    }
}
