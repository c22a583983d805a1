//! `PetiteReference` engines on GPU 0: each engine's subgraph run by petite-cuda, its weights
//! uploaded once from the mapped `.pte`. A whole method opens as a [`CudaMethod`]: values stay
//! on the device between engines, and from its second run on the method is one CUDA graph
//! replayed over fixed buffers. Also GPU 0 as a device (`--device cuda`): whether CUDA can run
//! here, its free memory, its f32 reference and `petite pi05 run` on it ([`policy`], [`run`]),
//! its `petite doctor` lines.

mod policy;
mod run;

use std::cell::{Cell, OnceCell};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use petite_cuda::host_gather::{GatherBuffers, Gathered, HostGathers};
use petite_cuda::{DevTensor, DeviceProgram, Graph};
use petite_engine::reference::ReferenceEngine;
use petite_engine::{EngineRuntime, HostTensor, IoBinding};
use petite_reference::Tensor;

use petite_pi05::Pi05Config;
use petite_pi05::inputs::Inputs;
use petite_weights::WeightSource;

use super::{Device, DeviceSpec, MethodSpec, ModelRun, ResidentMethod, Runtime, Value};
use crate::{Error, Result};

/// GPU 0 through petite-cuda.
pub(super) const CUDA: Device = Device(&Cuda);

/// Opens CUDA device 0 for `--device cuda` with this process's settings
/// ([`crate::settings::current`]: the environment's, and `--tune`), or refuses in one line (what
/// is missing) before any work is done.
fn open_cuda() -> Result<petite_cuda::Device> {
    let settings = crate::settings::current()?.cuda;
    petite_cuda::Device::open_with(settings).map_err(Error::cuda("--device cuda"))
}

/// GPU 0 as a device.
struct Cuda;

impl DeviceSpec for Cuda {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn aliases(&self) -> &'static [&'static str] {
        &["cuda:0"]
    }
    fn help(&self) -> &'static str {
        "petite-cuda on GPU 0 (needs the NVIDIA driver, cuBLAS and NVRTC at run time)"
    }
    fn check(&self) -> Result<()> {
        petite_cuda::probe()
            .usable()
            .map_err(Error::cuda("--device cuda"))
    }
    fn free_memory(&self) -> Result<u64> {
        let (free, _) = open_cuda()?
            .mem_info()
            .map_err(Error::cuda("--device cuda"))?;
        Ok(free)
    }
    fn f32_reference(
        &self,
        cfg: &Pi05Config,
        weights: &dyn WeightSource,
        inputs: &Inputs,
    ) -> Result<Vec<f32>> {
        // Its own device handle (stream, cuBLAS), whichever thread it runs on.
        let dev = open_cuda()?;
        let policy = policy::CudaPolicy::load(
            &dev,
            cfg,
            weights,
            petite_pi05::Precision::F32,
            petite_cuda::F32Matmul::Exact,
        )?;
        Ok(policy.chunk(inputs)?.0)
    }
    fn tunable(&self) -> bool {
        true
    }
    fn run_model(&self, a: &ModelRun<'_>, say: &mut dyn FnMut(String)) -> Result<()> {
        run::run_model(&open_cuda()?, a, say)
    }
    fn doctor(&self) -> Vec<String> {
        run::doctor()
    }
}

fn cuda(what: &str) -> impl FnOnce(petite_cuda::Error) -> Error + '_ {
    move |e| Error::cuda(what)(e)
}

pub(super) fn make() -> Result<Box<dyn Runtime>> {
    Ok(Box::new(CudaReference(open_cuda()?)))
}

/// Reference engines on the GPU: the engine's subgraph, its weights uploaded once from the
/// mapped `.pte` (the mapping is dropped once they are on the device), run by petite-cuda.
struct CudaReference(petite_cuda::Device);

struct CudaEngine<'d> {
    program: petite_cuda::DeviceProgram<'d>,
    inputs: Vec<IoBinding>,
    outputs: Vec<IoBinding>,
}

impl Runtime for CudaReference {
    fn device(&self) -> Device {
        CUDA
    }
    fn read_ahead(&self) -> bool {
        true
    }
    fn describe(&self) -> String {
        let i = self.0.info();
        format!(
            "petite reference engines on CUDA (petite-cuda; {}, compute capability {}.{}; a resident bf16 method's f32 products in TF32, as pi05 run --dtype bf16's)",
            i.name, i.compute_capability.0, i.compute_capability.1
        )
    }
    fn open<'s>(
        &'s self,
        path: &Path,
        offset: u64,
        len: u64,
        _release: bool,
    ) -> Result<Box<dyn EngineRuntime + 's>> {
        let e = ReferenceEngine::open_region(path, offset, len)?;
        let program = petite_cuda::DeviceProgram::load(&self.0, e.program(), e.file(), true)
            .map_err(Error::cuda(path.display().to_string()))?;
        let (inputs, outputs) = petite_engine::bindings(e.program());
        Ok(Box::new(CudaEngine {
            program,
            inputs,
            outputs,
        }))
    }

    fn open_method<'s>(
        &'s self,
        m: &MethodSpec<'_>,
    ) -> Option<Result<Box<dyn super::ResidentMethod + 's>>> {
        Some(self.method(m))
    }

    fn upload(&self, t: HostTensor) -> Result<Value> {
        // Its bytes as they are: through a reference tensor they were converted twice more
        // (0.75 ms a chunk for the three cameras' images on the CPU here).
        let d = self
            .0
            .upload_bytes(t.dtype(), t.shape(), t.bytes())
            .map_err(cuda("upload a value"))?;
        let host = (t.bytes().len() <= KEEP_HOST_BYTES).then_some(t);
        Ok(OnDevice::value(d, host))
    }

    fn download(&self, v: Value) -> Result<HostTensor> {
        match v {
            Value::Host(t) => Ok(t),
            Value::Resident(b) => {
                let d = OnDevice::of(&b)?;
                let t = self.0.download(&d.t).map_err(cuda("download a value"))?;
                Ok(HostTensor::from(&t))
            }
        }
    }
}

/// Host values up to this size keep their bytes beside their device copy when uploaded: a
/// method gathering embedding rows on the host reads its tokens there without waiting for the
/// device.
const KEEP_HOST_BYTES: usize = 64 << 10;

/// A value this runtime keeps on the device, with its host bytes when it came up small.
struct OnDevice {
    t: DevTensor,
    host: Option<HostTensor>,
}

impl OnDevice {
    fn value(t: DevTensor, host: Option<HostTensor>) -> Value {
        Value::Resident(std::sync::Arc::new(OnDevice { t, host }))
    }

    fn of(v: &std::sync::Arc<dyn std::any::Any + Send + Sync>) -> Result<&OnDevice> {
        v.downcast_ref::<OnDevice>().ok_or_else(|| {
            Error::Internal("a device value of another runtime reached petite-cuda".into())
        })
    }
}

impl CudaReference {
    fn method<'s>(&'s self, m: &MethodSpec<'_>) -> Result<Box<dyn ResidentMethod + 's>> {
        let dev = &self.0;
        // A bf16 export (bf16 values cross its engines) runs its f32 products (SigLIP, the
        // heads) in TF32, as `pi05 run --dtype bf16` does by default: lerobot's bf16 mode is
        // within the bf16 bound either way. An f32 export's stay exact (its 1e-4 parity).
        let bf16 = m
            .inputs
            .iter()
            .chain(&m.outputs)
            .any(|(_, d, _)| *d == petite_graph::Dtype::Bf16);
        let mut engines = HashMap::new();
        for &(seg, offset, len) in &m.engines {
            let e = ReferenceEngine::open_region(m.path, offset, len)?;
            let (inputs, outputs) = petite_engine::bindings(e.program());
            let at = || Error::cuda(format!("{} segment {seg}", m.path.display()));
            let (plan, reads) = match dev.settings().tuning.host_gather.min_table_bytes() {
                Some(min) => engine_gathers(e.program(), seg, m, min)
                    .map_err(at())?
                    .unzip(),
                None => (None, None),
            };
            let source = plan.as_ref().map_or(e.program(), |p| p.program());
            let mut program = DeviceProgram::load(dev, source, e.file(), true).map_err(at())?;
            if bf16 {
                program.set_f32_matmul(petite_cuda::F32Matmul::Tf32);
            }
            if let Some(p) = &plan {
                let (n, bytes) = p.tables();
                dev.trace(format_args!(
                    "segment {seg}: {n} embedding tables ({:.1} MiB) gathered on the host",
                    bytes as f64 / (1u64 << 20) as f64
                ));
            }
            let gather = match (plan, reads) {
                (Some(plan), Some(reads)) => Some(EngineGather {
                    reads,
                    bufs: plan.alloc(dev).map_err(at())?,
                    plan,
                    staged: Default::default(),
                    engine: e,
                }),
                _ => None,
            };
            let flag = if program.has_embedding() {
                Some(
                    dev.zeros(petite_graph::Dtype::I64, &[1])
                        .map_err(cuda("allocate a flag"))?,
                )
            } else {
                None
            };
            engines.insert(
                seg,
                MethodEngine {
                    program,
                    inputs,
                    outputs,
                    flag,
                    gather,
                },
            );
        }
        let alloc = |(_, d, s): &(i32, petite_graph::Dtype, Vec<usize>)| {
            dev.zeros(*d, s).map_err(cuda("allocate a method buffer"))
        };
        Ok(Box::new(CudaMethod {
            dev,
            engines,
            calls: m.calls.clone(),
            input_ids: m.inputs.iter().map(|(i, _, _)| *i).collect(),
            output_ids: m.outputs.iter().map(|(i, _, _)| *i).collect(),
            fixed_in: m.inputs.iter().map(alloc).collect::<Result<_>>()?,
            fixed_out: m.outputs.iter().map(alloc).collect::<Result<_>>()?,
            zero: dev
                .zeros(petite_graph::Dtype::I64, &[1])
                .map_err(cuda("allocate a flag"))?,
            runs: Cell::new(0),
            graph: OnceCell::new(),
            last: Default::default(),
            unchecked: Cell::new(false),
        }))
    }
}

/// Engine input names a host gather reads, each with the method input it is (by position).
pub(crate) type InputsRead = Vec<(String, usize)>;

/// Engine `seg` of method `m` (its program `program`) with its embeddings of tables of at least
/// `min_bytes` gathered on the host ([`HostGathers::plan`]), where their indices come from
/// engine inputs the chain passes straight from the method's: the plan, and for each engine
/// input it reads, the method input it is (by position). `None`: nothing to gather.
pub(crate) fn engine_gathers(
    program: &petite_graph::Program,
    seg: usize,
    m: &MethodSpec<'_>,
    min_bytes: usize,
) -> petite_cuda::Result<Option<(HostGathers, InputsRead)>> {
    let (inputs, _) = petite_engine::bindings(program);
    let mut calls = m.calls.iter().filter(|(s, _)| *s == seg);
    let from_method: HashMap<String, usize> = match (calls.next(), calls.next()) {
        (Some((_, args)), None) => inputs
            .iter()
            .zip(args)
            .filter_map(|(b, a)| {
                m.inputs
                    .iter()
                    .position(|(i, _, _)| i == a)
                    .map(|k| (b.name.clone(), k))
            })
            .collect(),
        _ => HashMap::new(),
    };
    let Some(plan) = HostGathers::plan(program, min_bytes, &|name| from_method.contains_key(name))?
    else {
        return Ok(None);
    };
    let reads = plan
        .inputs_read()
        .into_iter()
        .filter_map(|n| from_method.get(&n).map(|&k| (n, k)))
        .collect();
    Ok(Some((plan, reads)))
}

/// One engine of a [`CudaMethod`]: its program and I/O binding names.
struct MethodEngine<'d> {
    program: DeviceProgram<'d>,
    inputs: Vec<IoBinding>,
    outputs: Vec<IoBinding>,
    /// The embedding index flag when the program gathers rows (read back after each run).
    flag: Option<DevTensor>,
    /// Its embeddings gathered on the host ([`petite_cuda::host_gather`]), if any.
    gather: Option<EngineGather>,
}

/// An engine's embeddings gathered on the host: the plan, the engine's file whose mapped
/// tables the rows come from, the method inputs the indices are computed from, and the device
/// buffers the rows go up into before each run.
struct EngineGather {
    plan: HostGathers,
    /// The engine input names the gathers read, with the method input each is.
    reads: InputsRead,
    bufs: GatherBuffers,
    staged: std::cell::RefCell<Gathered>,
    engine: ReferenceEngine,
}

/// A method's chain of engines on the device: run directly the first time (a one-shot run pays
/// no capture), captured into a CUDA graph over fixed input and output buffers at the second,
/// replayed from then on.
struct CudaMethod<'d> {
    dev: &'d petite_cuda::Device,
    engines: HashMap<usize, MethodEngine<'d>>,
    calls: Vec<(usize, Vec<i32>)>,
    input_ids: Vec<i32>,
    output_ids: Vec<i32>,
    /// Fixed buffers the graph reads its inputs from and writes its outputs to.
    fixed_in: Vec<DevTensor>,
    fixed_out: Vec<DevTensor>,
    zero: DevTensor,
    runs: Cell<usize>,
    graph: OnceCell<Graph>,
    /// The values last copied into `fixed_in`: the same value passed again (the prefix's K/V
    /// at each of a chunk's steps) is not copied again. A value is the same only as the same
    /// `Arc` (a method's next run returns new ones), and outputs are valid only until their
    /// method runs again, so an unchanged `Arc` holds unchanged contents.
    last: std::cell::RefCell<Vec<Option<std::sync::Arc<dyn std::any::Any + Send + Sync>>>>,
    /// A replay whose embedding checks are not read yet ([`ResidentMethod::finish`], or the
    /// next run, reads them).
    unchecked: Cell<bool>,
}

impl<'d> CudaMethod<'d> {
    /// Queues the chain on `inputs` (by value id); returns the outputs (by value id). `flagged`:
    /// embedding checks are recorded in the engines' flags (reset inside the queued work) for
    /// [`CudaMethod::check`], so that nothing is read back and the work can be captured.
    fn queue(
        &self,
        mut values: HashMap<i32, DevTensor>,
        flagged: bool,
    ) -> petite_cuda::Result<Vec<DevTensor>> {
        for (seg, args) in &self.calls {
            let e = &self.engines[seg];
            let n_in = e.inputs.len();
            let mut ins = BTreeMap::new();
            for (b, a) in e.inputs.iter().zip(&args[..n_in]) {
                let v = values.get(a).cloned().ok_or_else(|| {
                    petite_cuda::Error::Plan(format!("value {a} is read before it is written"))
                })?;
                ins.insert(b.name.clone(), v);
            }
            if let Some(g) = &e.gather {
                ins.extend(g.plan.inputs(&g.bufs));
            }
            let mut outs = match (&e.flag, flagged) {
                (Some(f), true) => {
                    self.dev.copy(&self.zero, f)?;
                    e.program.run_device_flagged(ins, Some(f))?
                }
                _ => e.program.run_device(ins)?,
            };
            for (o, a) in e.outputs.iter().zip(&args[n_in..]) {
                let t = outs.remove(&o.name).ok_or_else(|| {
                    petite_cuda::Error::Plan(format!("engine produced no output `{}`", o.name))
                })?;
                values.insert(*a, t);
            }
        }
        self.output_ids
            .iter()
            .map(|o| {
                values.get(o).cloned().ok_or_else(|| {
                    petite_cuda::Error::Plan(format!("output value {o} is never written"))
                })
            })
            .collect()
    }

    /// The embedding index checks of the last replay (reads the flags back: waits for it).
    fn check(&self) -> petite_cuda::Result<()> {
        for e in self.engines.values() {
            if let Some(f) = &e.flag {
                e.program.check_indices(f)?;
            }
        }
        Ok(())
    }

    /// Gathers each engine's host-gathered embedding rows for `inputs` and queues them up
    /// (before the work that reads them). An index outside its table is refused here, before
    /// anything of this run is queued.
    fn gather(&self, inputs: &[Value]) -> Result<()> {
        for e in self.engines.values() {
            let Some(g) = &e.gather else { continue };
            let mut host = BTreeMap::new();
            for (name, k) in &g.reads {
                let t = match &inputs[*k] {
                    Value::Host(t) => t.to_reference()?,
                    Value::Resident(b) => match &OnDevice::of(b)?.host {
                        Some(t) => t.to_reference()?,
                        None => self
                            .dev
                            .download(&OnDevice::of(b)?.t)
                            .map_err(cuda("download an embedding's indices"))?,
                    },
                };
                host.insert(name.clone(), t);
            }
            let mut staged = g.staged.borrow_mut();
            g.plan
                .gather(&host, g.engine.file(), &mut staged)
                .map_err(cuda("gather embedding rows on the host"))?;
            g.plan
                .upload(self.dev, &g.bufs, &staged)
                .map_err(cuda("upload embedding rows"))?;
        }
        Ok(())
    }

    fn device_value(&self, v: Value) -> Result<DevTensor> {
        match v {
            Value::Resident(b) => Ok(OnDevice::of(&b)?.t.clone()),
            Value::Host(t) => self
                .dev
                .upload_bytes(t.dtype(), t.shape(), t.bytes())
                .map_err(cuda("upload a method input")),
        }
    }
}

impl ResidentMethod for CudaMethod<'_> {
    fn finish(&self) -> Result<()> {
        if self.unchecked.replace(false) {
            self.check().map_err(cuda("check embedding indices"))?;
        }
        Ok(())
    }

    fn run(&self, inputs: Vec<Value>) -> Result<Vec<Value>> {
        if inputs.len() != self.input_ids.len() {
            return Err(Error::Internal(format!(
                "the method takes {} inputs, given {}",
                self.input_ids.len(),
                inputs.len()
            )));
        }
        let arcs: Vec<_> = inputs
            .iter()
            .map(|v| match v {
                Value::Resident(a) => Some(a.clone()),
                Value::Host(_) => None,
            })
            .collect();
        // The last replay's deferred checks, before its flags are reset; then the rows gathered
        // on the host (refused before anything is queued if an index is out of its table).
        self.finish()?;
        self.gather(&inputs)?;
        let ins = inputs
            .into_iter()
            .map(|v| self.device_value(v))
            .collect::<Result<Vec<_>>>()?;
        let n = self.runs.get();
        self.runs.set(n + 1);
        if n == 0 {
            // The first run, directly: a method that runs once (verify's prefix) captures nothing.
            let values = self.input_ids.iter().copied().zip(ins).collect();
            let outs = self.queue(values, false).map_err(cuda("run a method"))?;
            return Ok(outs.into_iter().map(|t| OnDevice::value(t, None)).collect());
        }
        let dev = self.dev;
        let mut last = self.last.borrow_mut();
        last.resize(ins.len(), None);
        for (i, (src, dst)) in ins.iter().zip(&self.fixed_in).enumerate() {
            let same = match (&arcs[i], &last[i]) {
                (Some(a), Some(b)) => std::sync::Arc::ptr_eq(a, b),
                _ => false,
            };
            if !same {
                dev.copy(src, dst).map_err(cuda("copy a method input"))?;
                last[i] = arcs[i].clone();
            }
        }
        if self.graph.get().is_none() {
            let values: HashMap<i32, DevTensor> = self
                .input_ids
                .iter()
                .copied()
                .zip(self.fixed_in.iter().cloned())
                .collect();
            let ((), g) = dev
                .capture(|| {
                    let outs = self.queue(values, true)?;
                    for (src, dst) in outs.iter().zip(&self.fixed_out) {
                        dev.copy(src, dst)?;
                    }
                    Ok(())
                })
                .map_err(cuda("capture a method"))?;
            let _ = self.graph.set(g);
        }
        self.graph
            .get()
            .ok_or_else(|| Error::Internal("no method graph".into()))?
            .launch()
            .map_err(cuda("replay a method"))?;
        // Read back at `finish` (or the next run): reading the flags now would wait for the
        // replay before the caller queues what follows it.
        self.unchecked
            .set(self.engines.values().any(|e| e.flag.is_some()));
        Ok(self
            .fixed_out
            .iter()
            .map(|t| OnDevice::value(t.clone(), None))
            .collect())
    }
}

impl EngineRuntime for CudaEngine<'_> {
    fn inputs(&self) -> &[IoBinding] {
        &self.inputs
    }
    fn outputs(&self) -> &[IoBinding] {
        &self.outputs
    }
    fn run(
        &self,
        inputs: BTreeMap<String, HostTensor>,
    ) -> petite_engine::Result<BTreeMap<String, HostTensor>> {
        let inputs = inputs
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_reference()?)))
            .collect::<petite_engine::Result<BTreeMap<String, Tensor>>>()?;
        let outs = self
            .program
            .run(inputs)
            .map_err(|e| petite_engine::Error::Runtime {
                runtime: "petite-cuda".into(),
                source: Box::new(e),
            })?;
        Ok(outs.into_iter().map(|(n, t)| (n, t.into())).collect())
    }
}
