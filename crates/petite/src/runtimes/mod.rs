//! The one registration point for engine runtimes and the devices they run on: which delegate
//! backend runs on which device, how its engines are opened from a `.pte` segment, and
//! everything a command asks of a device (`--device`'s name, whether it can run here, its free
//! memory, its f32 reference, its `petite doctor` lines, `petite pi05 run` on it). `petite
//! verify`, `petite act`, `petite serve`, `petite pi05 run` and `petite doctor` ask [`runtime`]
//! and [`Device`]; nothing outside this module names a device or matches on one. Values between
//! engines are [`Value`]s: host tensors, or values a runtime keeps on its device — a runtime
//! with a device opens a whole method at once ([`Runtime::open_method`]) so that its values
//! never cross host memory between engines, and only the policy's edges upload and download.
//!
//! A new runtime is its module here (a [`Runtime`] whose engines implement [`EngineRuntime`],
//! and, for a new device, a [`DeviceSpec`]), its `mod` line and one line in [`RUNTIMES`]; the
//! conformance suite (`tests/runtimes.rs`) runs every registered runtime.

mod cpu_reference;
mod cuda_reference;
pub(crate) use cuda_reference::engine_gathers;

use std::path::Path;
use std::sync::LazyLock;

use petite_engine::{EngineRuntime, HostTensor};
use petite_graph::Dtype;
use petite_pi05::Pi05Config;
use petite_pi05::inputs::Inputs;
use petite_weights::WeightSource;

use crate::engines::REFERENCE_ID;
use crate::{Error, Result};

/// Where petite runs its own programs: one of the devices [`RUNTIMES`] registers, parsed from
/// `--device` by its name. A handle on its [`DeviceSpec`]: equal when the names are.
#[derive(Clone, Copy)]
pub struct Device(&'static dyn DeviceSpec);

/// Everything a command asks of a device, answered by the module that registers it (so no
/// caller matches on a device).
pub trait DeviceSpec: Sync {
    /// The `--device` name.
    fn name(&self) -> &'static str;
    /// Other names the Python binding accepts for it (`cuda:0`).
    fn aliases(&self) -> &'static [&'static str] {
        &[]
    }
    /// Its line in `--help` (what it is, what it needs).
    fn help(&self) -> &'static str;
    /// Whether it is the host CPU itself: portable and ONNX bundles (a Python child's runtime
    /// on the CPU) run only there, and `verify --stages auto` plans by the machine's memory.
    fn is_host(&self) -> bool {
        false
    }
    /// Refuses the device in one line where it cannot run here, without opening it: what a
    /// command checks before any other work.
    fn check(&self) -> Result<()>;
    /// The device's free memory now, in bytes (`verify --stages auto` on a device that is not
    /// the host).
    fn free_memory(&self) -> Result<u64> {
        Err(Error::Internal(format!(
            "--device {} has no memory of its own",
            self.name()
        )))
    }
    /// The f32 reference actions of `inputs` from the original checkpoint, computed on this
    /// device (what `petite verify` compares an export against).
    fn f32_reference(
        &self,
        cfg: &Pi05Config,
        weights: &dyn WeightSource,
        inputs: &Inputs,
    ) -> Result<Vec<f32>>;
    /// Whether `petite pi05 run` and `petite verify` take its tuning and timing flags
    /// (`--tune`, `--repeat`, `--timing-json`, `--f32-matmul`: the GPU path).
    fn tunable(&self) -> bool {
        false
    }
    /// `petite pi05 run` on this device; `say` prints a line of its summary.
    fn run_model(&self, run: &ModelRun<'_>, say: &mut dyn FnMut(String)) -> Result<()>;
    /// Its lines in `petite doctor` (what it needs and whether that is here).
    fn doctor(&self) -> Vec<String> {
        Vec::new()
    }
}

/// `petite pi05 run`'s request: the model's programs from a checkpoint on a device.
#[derive(Debug, Clone)]
pub struct ModelRun<'a> {
    /// The checkpoint (a file, an index or a directory).
    pub checkpoint: &'a Path,
    /// The config JSON (`None`: the real pi0.5).
    pub config: Option<&'a Path>,
    /// The inputs safetensors.
    pub inputs: &'a Path,
    /// Where the actions are written.
    pub out: &'a Path,
    /// The programs' numerics.
    pub precision: petite_pi05::Precision,
    /// More chunks on the same inputs after `warmup`, timed (a [`DeviceSpec::tunable`]
    /// device's).
    pub repeat: usize,
    /// Untimed chunks before the timed ones.
    pub warmup: usize,
    /// Where the timings are also written as JSON.
    pub timing_json: Option<&'a Path>,
    /// How products of f32 operands run (`None`: the precision's default).
    pub f32_matmul: Option<F32Matmul>,
    /// Whether `--tune` was given (its values are already in [`crate::settings::current`]).
    pub tuned: bool,
}

/// How a device runs products of f32 operands (`petite pi05 run --f32-matmul`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum F32Matmul {
    /// Exact f32 products.
    Exact,
    /// TF32 tensor cores, f32 accumulation.
    Tf32,
}

impl F32Matmul {
    /// The command-line name.
    pub fn name(self) -> &'static str {
        match self {
            F32Matmul::Exact => "exact",
            F32Matmul::Tf32 => "tf32",
        }
    }
}

impl Device {
    /// The `--device` name.
    pub fn name(self) -> &'static str {
        self.0.name()
    }

    /// What the device answers (its free memory, its f32 reference, its doctor lines...).
    pub fn spec(self) -> &'static dyn DeviceSpec {
        self.0
    }

    /// Refuses the device in one line where it cannot run here (for `cuda`: no driver, cuBLAS,
    /// NVRTC or device), without opening it.
    pub fn check(self) -> Result<()> {
        self.0.check()
    }

    /// Whether it is the host CPU ([`DeviceSpec::is_host`]).
    pub fn is_host(self) -> bool {
        self.0.is_host()
    }

    /// The registered device called `name` (or one of its aliases); `None` for another name.
    pub fn from_name(name: &str) -> Option<Device> {
        devices()
            .iter()
            .copied()
            .find(|d| d.name() == name || d.0.aliases().contains(&name))
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
    }
}

impl Eq for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The host CPU (the first device registered): runs everywhere.
impl Default for Device {
    fn default() -> Self {
        devices()[0]
    }
}

impl clap::ValueEnum for Device {
    fn value_variants<'a>() -> &'a [Self] {
        devices()
    }
    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.name()).help(self.0.help()))
    }
}

/// The names of the [`DeviceSpec::tunable`] devices, for a message: `cuda`, `a or b`.
pub fn tunable_names() -> String {
    let names: Vec<&str> = devices()
        .iter()
        .filter(|d| d.spec().tunable())
        .map(|d| d.name())
        .collect();
    names.join(" or ")
}

/// Every device a runtime is registered on, in [`RUNTIMES`]' order (each once).
pub fn devices() -> &'static [Device] {
    static DEVICES: LazyLock<Vec<Device>> = LazyLock::new(|| {
        let mut out: Vec<Device> = Vec::new();
        for (_, d, _) in RUNTIMES {
            if !out.contains(d) {
                out.push(*d);
            }
        }
        out
    });
    &DEVICES
}

/// Runs the engines of one delegate backend on one device.
pub trait Runtime {
    /// Where it runs.
    fn device(&self) -> Device;
    /// What `report.json` calls it.
    fn describe(&self) -> String;
    /// Whether it reads an engine whole when it opens it (a GPU's upload): then each engine's
    /// segment is asked of the disk while the one before it is opened.
    fn read_ahead(&self) -> bool {
        false
    }
    /// Opens the engine stored at `[offset, offset + len)` of `path` (a `.pte` segment).
    /// `release`: give the host pages of its weights back once they are no longer needed.
    fn open<'s>(
        &'s self,
        path: &Path,
        offset: u64,
        len: u64,
        release: bool,
    ) -> Result<Box<dyn EngineRuntime + 's>>;

    /// Opens a whole method, its values kept on the runtime's device between engines; `None`
    /// (the default) for a runtime whose engines take host tensors, one by one through
    /// [`Runtime::open`].
    fn open_method<'s>(
        &'s self,
        _method: &MethodSpec<'_>,
    ) -> Option<Result<Box<dyn ResidentMethod + 's>>> {
        None
    }

    /// `t` as this runtime's value (a host tensor stays one where the runtime has no device).
    fn upload(&self, t: HostTensor) -> Result<Value> {
        Ok(Value::Host(t))
    }

    /// `v` on the host.
    fn download(&self, v: Value) -> Result<HostTensor> {
        match v {
            Value::Host(t) => Ok(t),
            Value::Resident(_) => Err(Error::Internal(format!(
                "{} holds no device values",
                self.describe()
            ))),
        }
    }
}

/// A value between engines: on the host, or kept by the runtime that made it (on its device;
/// only that runtime reads it — [`Runtime::download`] brings it to the host). Cloning a
/// resident value shares it.
#[derive(Clone)]
pub enum Value {
    /// Host memory.
    Host(HostTensor),
    /// The runtime's own (a `petite_cuda::DevTensor` for petite-cuda).
    Resident(std::sync::Arc<dyn std::any::Any + Send + Sync>),
}

/// One method of a `.pte` (a chain of delegate calls), described for a runtime that opens it
/// whole ([`Runtime::open_method`]).
pub struct MethodSpec<'a> {
    /// The `.pte`.
    pub path: &'a Path,
    /// Each engine: its segment index and the segment's byte range in `path`, in first-use order.
    pub engines: Vec<(usize, u64, u64)>,
    /// The calls in order: the engine's segment index, then its arguments (value ids: the
    /// engine's inputs in binding order, then its outputs).
    pub calls: Vec<(usize, Vec<i32>)>,
    /// The method's inputs: value id, dtype, shape.
    pub inputs: Vec<(i32, Dtype, Vec<usize>)>,
    /// The method's outputs: value id, dtype, shape.
    pub outputs: Vec<(i32, Dtype, Vec<usize>)>,
}

/// A method opened whole by a runtime: values stay where the runtime keeps them.
pub trait ResidentMethod {
    /// Runs the method on its inputs (in order); returns its outputs (in order). An output may
    /// be a buffer the method reuses: it is valid until this method runs again.
    fn run(&self, inputs: Vec<Value>) -> Result<Vec<Value>>;

    /// Reports what the last run found wrong that the runtime checks only once its work is
    /// done (petite-cuda: an embedding index out of range), waiting for that work. A runtime
    /// may defer such checks from [`ResidentMethod::run`] to here (or to the next run), so that
    /// a caller queues later work (the steps after the prefix) without waiting.
    fn finish(&self) -> Result<()> {
        Ok(())
    }
}

type Make = fn() -> Result<Box<dyn Runtime>>;

/// Every runtime: (delegate backend id, device, constructor). One line a runtime; the first
/// line's device is the default (the host CPU).
pub const RUNTIMES: &[(&str, Device, Make)] = &[
    (REFERENCE_ID, cpu_reference::CPU, cpu_reference::make),
    (REFERENCE_ID, cuda_reference::CUDA, cuda_reference::make),
];

/// The runtime for `backend_id` engines on `device`; an error naming what runs where when none
/// is registered, or when the device cannot run here.
pub fn runtime(backend_id: &str, device: Device) -> Result<Box<dyn Runtime>> {
    let found = RUNTIMES
        .iter()
        .find(|(id, d, _)| *id == backend_id && *d == device);
    match found {
        Some((_, _, make)) => make(),
        None => {
            let known: Vec<String> = RUNTIMES
                .iter()
                .map(|(id, d, _)| format!("`{id}` on {}", d.name()))
                .collect();
            Err(Error::Usage(format!(
                "no runtime runs `{backend_id}` engines on {}; registered: {}",
                device.name(),
                known.join(", ")
            )))
        }
    }
}

/// The runtime for the `backend_id` delegates of the `.pte` at `path` on `device`: [`runtime`],
/// its refusal naming the file.
pub fn runtime_for(path: &Path, backend_id: &str, device: Device) -> Result<Box<dyn Runtime>> {
    runtime(backend_id, device).map_err(|e| Error::BadPte {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--device` resolves through the registry: each device once, by name or alias; the
    /// default is the host CPU.
    #[test]
    fn devices_resolve_by_name_and_the_default_is_the_host() {
        let names: Vec<&str> = devices().iter().map(|d| d.name()).collect();
        assert!(names.starts_with(&["cpu", "cuda"]), "{names:?}");
        let unique: std::collections::BTreeSet<&str> = names.iter().copied().collect();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        assert!(Device::default().is_host());
        assert_eq!(devices().iter().filter(|d| d.is_host()).count(), 1);
        for d in devices() {
            assert_eq!(Device::from_name(d.name()), Some(*d));
        }
        assert_eq!(Device::from_name("cuda:0"), Some(cuda_reference::CUDA));
        assert_eq!(Device::from_name("metal"), None);
        let parsed = <Device as clap::ValueEnum>::from_str("cuda", false).unwrap();
        assert_eq!(parsed, cuda_reference::CUDA);
    }

    #[test]
    fn unknown_backends_are_refused_by_name() {
        let e = runtime("TensorRTBackend", Device::default())
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("TensorRTBackend") && e.contains("PetiteReference"),
            "{e}"
        );
    }

    #[test]
    fn cuda_without_a_driver_is_refused_in_one_line() {
        // Where a GPU is present this checks nothing (the gpu conformance tier covers it).
        if cuda_reference::CUDA.check().is_ok() {
            return;
        }
        let e = runtime(REFERENCE_ID, cuda_reference::CUDA)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with("--device cuda: CUDA is not available here"),
            "{e}"
        );
        assert_eq!(e.lines().count(), 1, "{e}");
    }
}
