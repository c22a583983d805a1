//! The delegate interpreter: runs a `.pte` whose methods are delegate calls, each engine opened
//! once per segment by the runtime [`crate::runtimes`] registers for the delegate's backend id
//! on the device asked for, values passed as [`HostTensor`]s.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use petite_engine::{EngineRuntime, HostTensor};
use petite_graph::Program;
use petite_pi05::inputs::Inputs;
use petite_pi05::programs::io;
use petite_pi05::rtc::Guidance;
use petite_pi05::{Pi05Config, Precision, build_prefix, build_step};
use petite_pte::PteFile;
use petite_pte::model::{DataLocation, EValue, Instruction, ScalarType};
use petite_reference::Tensor;
use petite_weights::{FileIdentity, Role};

use super::bad;
use crate::layout::{METHOD, TABLE_METHOD};
use crate::runtimes::{Device, MethodSpec, ResidentMethod, Runtime, Value};
use crate::{Error, Result};

/// A `.pte` opened for running: the reader's verified program and its engines, each opened
/// once per segment by the runtime registered for the delegates' backend on the device asked
/// for ([`crate::runtimes`]; `release`: each weight's host pages given back after its last read
/// in a run) — or, where that runtime keeps values on its device, the whole method opened by it
/// ([`Runtime::open_method`]), so that values never cross host memory between engines.
struct Loaded<'m> {
    pte: &'m PteFile,
    engines: HashMap<usize, Box<dyn EngineRuntime + 'm>>,
    resident: Option<Box<dyn ResidentMethod + 'm>>,
    /// The runtime of every delegate, when there is one (uploads and downloads go through it).
    runtime: Option<&'m dyn Runtime>,
}

fn graph_dtype(s: ScalarType) -> Option<petite_graph::Dtype> {
    use petite_graph::Dtype as D;
    Some(match s {
        ScalarType::FLOAT => D::F32,
        ScalarType::BFLOAT16 => D::Bf16,
        ScalarType::HALF => D::F16,
        ScalarType::LONG => D::I64,
        ScalarType::INT => D::I32,
        ScalarType::BYTE => D::U8,
        ScalarType::BOOL => D::Bool,
        _ => return None,
    })
}

/// The runtimes of one run, by delegate backend id.
type Runtimes = BTreeMap<String, Box<dyn Runtime>>;

/// Asks the kernel to read `[start, start + len)` of `f` into the page cache
/// (`POSIX_FADV_WILLNEED`), from a short-lived thread of its own: for a range this large the
/// call itself waits while it queues the reads. Advice only: failure changes nothing but speed.
fn will_need(f: &std::fs::File, start: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let Ok(f) = f.try_clone() else { return };
    std::thread::spawn(move || {
        // SAFETY: posix_fadvise takes no pointers; the thread owns `f`, so its fd is open for
        // the call.
        unsafe {
            libc::posix_fadvise(
                f.as_raw_fd(),
                start as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            );
        }
    });
}

/// The runtime of every delegate backend id the `.pte` files name, from the registry, on
/// `device`: a backend no runtime runs there is refused naming the file and the id.
fn open_runtimes(ptes: &[&PteFile], device: Device) -> Result<Runtimes> {
    let mut ids: BTreeSet<(&str, &Path)> = BTreeSet::new();
    for pte in ptes {
        for d in &method(pte, METHOD)?.delegates {
            ids.insert((d.id.as_str(), pte.path()));
        }
    }
    let mut out = Runtimes::new();
    for (id, path) in ids {
        if !out.contains_key(id) {
            let rt = crate::runtimes::runtime_for(path, id, device)?;
            out.insert(id.to_string(), rt);
        }
    }
    Ok(out)
}

impl<'m> Loaded<'m> {
    /// Opens every engine of `pte`. `read_ahead`: each engine's segment is asked of the disk
    /// (`POSIX_FADV_WILLNEED`) while the one before it is opened — for runtimes that read the
    /// whole engine at open (a GPU's upload), so the disk never waits between engines.
    /// `whole`: let a runtime with a device open the method whole ([`Runtime::open_method`]).
    fn new(
        pte: &'m PteFile,
        release: bool,
        runtimes: &'m Runtimes,
        read_ahead: bool,
        whole: bool,
    ) -> Result<Self> {
        let plan = method(pte, METHOD)?;
        let mut engines = HashMap::new();
        // The engines' segments in the order they are opened, and the file, for the read-ahead.
        // Best effort: a file that cannot be opened here fails below, with its error.
        let ahead = read_ahead
            .then(|| std::fs::File::open(pte.path()).ok())
            .flatten()
            .map(|f| {
                let mut segs: Vec<usize> = Vec::new();
                for d in &plan.delegates {
                    let seg = d.processed.index as usize;
                    if d.processed.location == DataLocation::SEGMENT && !segs.contains(&seg) {
                        segs.push(seg);
                    }
                }
                (f, segs)
            });
        let advise = |j: usize| {
            if let Some((f, segs)) = &ahead
                && let Some(&seg) = segs.get(j)
                && let Ok((start, len)) = pte.segment_range(seg)
            {
                will_need(f, start, len);
            }
        };
        advise(0);
        let ids: BTreeSet<&str> = plan.delegates.iter().map(|d| d.id.as_str()).collect();
        let runtime: Option<&'m dyn Runtime> = match ids.iter().next() {
            Some(id) if ids.len() == 1 => runtimes.get(*id).map(|r| r.as_ref()),
            _ => None,
        };
        if let (Some(rt), true) = (runtime, whole) {
            let spec = method_spec(pte, plan)?;
            if let Some(m) = rt.open_method(&spec) {
                advise(1);
                let m = m.map_err(|e| bad(pte.path(), e.to_string()))?;
                return Ok(Loaded {
                    pte,
                    engines: HashMap::new(),
                    resident: Some(m),
                    runtime,
                });
            }
        }
        let mut opened = 0usize;
        for (i, d) in plan.delegates.iter().enumerate() {
            let runtime = runtimes.get(d.id.as_str()).ok_or_else(|| {
                bad(
                    pte.path(),
                    format!("delegate {i}: no runtime opened for `{}`", d.id),
                )
            })?;
            if d.processed.location != DataLocation::SEGMENT {
                return Err(bad(
                    pte.path(),
                    format!("delegate {i}: engine not in a segment"),
                ));
            }
            let seg = d.processed.index as usize;
            if let std::collections::hash_map::Entry::Vacant(v) = engines.entry(seg) {
                let (start, len) = pte.segment_range(seg)?;
                opened += 1;
                advise(opened);
                let e = runtime
                    .open(pte.path(), start, len, release)
                    .map_err(|e| bad(pte.path(), format!("segment {seg}: {e}")))?;
                v.insert(e);
            }
        }
        Ok(Loaded {
            pte,
            engines,
            resident: None,
            runtime,
        })
    }

    /// `t` as a value of this method's runtime (on its device where it has one).
    fn upload(&self, t: HostTensor) -> Result<Value> {
        match self.runtime {
            Some(rt) if self.resident.is_some() => rt.upload(t),
            _ => Ok(Value::Host(t)),
        }
    }

    /// `v` on the host.
    fn download(&self, v: Value) -> Result<HostTensor> {
        match (v, self.runtime) {
            (Value::Host(t), _) => Ok(t),
            (v, Some(rt)) => rt.download(v),
            (Value::Resident(_), None) => Err(Error::Internal(
                "a device value reached a method of host engines".into(),
            )),
        }
    }

    /// The checks a resident method deferred from its last run (see
    /// [`ResidentMethod::finish`]).
    fn finish(&self) -> Result<()> {
        match &self.resident {
            Some(m) => m.finish(),
            None => Ok(()),
        }
    }

    /// Runs `forward` on `inputs` (the method's inputs, in order); returns its outputs, kept
    /// where the method's runtime keeps them.
    fn run_values(&self, inputs: Vec<Value>) -> Result<Vec<Value>> {
        if let Some(m) = &self.resident {
            return m.run(inputs);
        }
        let host = inputs
            .into_iter()
            .map(|v| self.download(v))
            .collect::<Result<Vec<_>>>()?;
        Ok(self.run(host)?.into_iter().map(Value::Host).collect())
    }

    /// Runs `forward` on `inputs` (the method's inputs, in order); returns its outputs.
    fn run(&self, inputs: Vec<HostTensor>) -> Result<Vec<HostTensor>> {
        let plan = method(self.pte, METHOD)?;
        let path = self.pte.path();
        if inputs.len() != plan.inputs.len() {
            return Err(bad(
                path,
                format!(
                    "method takes {} inputs, given {}",
                    plan.inputs.len(),
                    inputs.len()
                ),
            ));
        }
        let mut values: HashMap<i32, HostTensor> = HashMap::new();
        for (k, (&vi, t)) in plan.inputs.iter().zip(inputs).enumerate() {
            let Some(EValue::Tensor(decl)) = plan.values.get(vi as usize) else {
                return Err(bad(path, format!("input {k} is not a tensor value")));
            };
            let sizes: Vec<usize> = decl.sizes.iter().map(|&d| d as usize).collect();
            if graph_dtype(decl.scalar_type) != Some(t.dtype()) || sizes != t.shape() {
                return Err(bad(
                    path,
                    format!(
                        "input {k}: the .pte declares {:?}{sizes:?}, the config gives {}{:?} \
                         (was it exported with another config?)",
                        decl.scalar_type,
                        t.dtype(),
                        t.shape()
                    ),
                ));
            }
            values.insert(vi, t);
        }
        for (delegate_index, d, args) in delegate_calls(self.pte, plan)? {
            let e = &self.engines[&(d.processed.index as usize)];
            let n_in = e.inputs().len();
            if args.len() != n_in + e.outputs().len() {
                return Err(bad(
                    path,
                    format!(
                        "delegate {delegate_index}: {} args for an engine with {} inputs and {} outputs",
                        args.len(),
                        n_in,
                        e.outputs().len()
                    ),
                ));
            }
            let mut ins = BTreeMap::new();
            for (b, a) in e.inputs().iter().zip(&args[..n_in]) {
                let t = values
                    .get(a)
                    .cloned()
                    .ok_or_else(|| bad(path, format!("value {a} is read before it is written")))?;
                ins.insert(b.name.clone(), t);
            }
            let mut outs = e.run(ins)?;
            for (o, a) in e.outputs().iter().zip(&args[n_in..]) {
                let t = outs
                    .remove(&o.name)
                    .ok_or_else(|| bad(path, format!("engine produced no output `{}`", o.name)))?;
                values.insert(*a, t);
            }
        }
        plan.outputs
            .iter()
            .map(|o| {
                values
                    .get(o)
                    .cloned()
                    .ok_or_else(|| bad(path, format!("output value {o} is never written")))
            })
            .collect()
    }
}

pub(super) fn method<'a>(
    pte: &'a PteFile,
    name: &str,
) -> Result<&'a petite_pte::model::ExecutionPlan> {
    pte.program()
        .execution_plan
        .iter()
        .find(|p| p.name == name)
        .ok_or_else(|| bad(pte.path(), format!("no method `{name}`")))
}

/// Each delegate call of `plan`'s chains, in order: the delegate's index, the delegate (its
/// engine in a segment: checked) and the call's arguments; anything but a delegate call is
/// refused naming the file.
fn delegate_calls<'p>(
    pte: &PteFile,
    plan: &'p petite_pte::model::ExecutionPlan,
) -> Result<Vec<(u32, &'p petite_pte::model::BackendDelegate, &'p [i32])>> {
    let path = pte.path();
    let mut out = Vec::new();
    for ins in plan.chains.iter().flat_map(|c| &c.instructions) {
        let Instruction::DelegateCall {
            delegate_index,
            args,
        } = ins
        else {
            return Err(bad(path, "only delegate calls are expected"));
        };
        let d = plan
            .delegates
            .get(*delegate_index as usize)
            .ok_or_else(|| bad(path, format!("no delegate {delegate_index}")))?;
        if d.processed.location != DataLocation::SEGMENT {
            return Err(bad(
                path,
                format!("delegate {delegate_index}: engine not in a segment"),
            ));
        }
        out.push((*delegate_index as u32, d, args.as_slice()));
    }
    Ok(out)
}

/// `plan` described for a runtime that opens a method whole: its engines' segments in
/// first-use order, the calls, the inputs' and outputs' declared dtypes and shapes.
fn method_spec<'a>(
    pte: &'a PteFile,
    plan: &petite_pte::model::ExecutionPlan,
) -> Result<MethodSpec<'a>> {
    let path = pte.path();
    let decl = |v: i32| -> Result<(i32, petite_graph::Dtype, Vec<usize>)> {
        let Some(EValue::Tensor(t)) = plan.values.get(v as usize) else {
            return Err(bad(path, format!("value {v} is not a tensor")));
        };
        let d = graph_dtype(t.scalar_type)
            .ok_or_else(|| bad(path, format!("value {v}: dtype {:?}", t.scalar_type)))?;
        Ok((v, d, t.sizes.iter().map(|&s| s as usize).collect()))
    };
    let mut engines: Vec<(usize, u64, u64)> = Vec::new();
    let mut calls = Vec::new();
    for (_, d, args) in delegate_calls(pte, plan)? {
        let seg = d.processed.index as usize;
        if !engines.iter().any(|(s, _, _)| *s == seg) {
            let (start, len) = pte.segment_range(seg)?;
            engines.push((seg, start, len));
        }
        calls.push((seg, args.to_vec()));
    }
    Ok(MethodSpec {
        path,
        engines,
        calls,
        inputs: plan
            .inputs
            .iter()
            .map(|&v| decl(v))
            .collect::<Result<_>>()?,
        outputs: plan
            .outputs
            .iter()
            .map(|&v| decl(v))
            .collect::<Result<_>>()?,
    })
}

/// For each engine of `pte_dir`'s prefix: its segment, and the embeddings and table bytes a
/// device runtime gathers on the host (tables of at least `min_bytes`;
/// [`petite_cuda::host_gather`]). What `--device cuda` leaves off the GPU, computed without one.
#[doc(hidden)]
pub fn host_gathered_tables(pte_dir: &Path, min_bytes: usize) -> Result<Vec<(usize, usize, u64)>> {
    let ptes = Ptes::open(pte_dir)?;
    let plan = method(&ptes.prefix, METHOD)?;
    let spec = method_spec(&ptes.prefix, plan)?;
    let mut out = Vec::new();
    for &(seg, offset, len) in &spec.engines {
        let e = petite_engine::reference::ReferenceEngine::open_region(spec.path, offset, len)?;
        let g = crate::runtimes::engine_gathers(e.program(), seg, &spec, min_bytes)
            .map_err(|e| bad(spec.path, e.to_string()))?;
        let (n, bytes) = g.map_or((0, 0), |(p, _)| p.tables());
        out.push((seg, n, bytes));
    }
    Ok(out)
}

/// Reads the timestep table (a constant tensor output of method `timestep_table`).
fn read_table(pte: &PteFile, steps: usize, r: usize) -> Result<Vec<f32>> {
    let plan = method(pte, TABLE_METHOD)?;
    let path = pte.path();
    let Some(EValue::Tensor(t)) = plan
        .outputs
        .first()
        .and_then(|&o| plan.values.get(o as usize))
    else {
        return Err(bad(path, "timestep_table: output is not a tensor"));
    };
    if t.scalar_type != ScalarType::FLOAT || t.sizes != [steps as i32, r as i32] {
        return Err(bad(
            path,
            format!(
                "timestep_table: expected FLOAT [{steps}, {r}], found {:?} {:?}",
                t.scalar_type, t.sizes
            ),
        ));
    }
    let cs = pte
        .program()
        .constant_segment
        .as_ref()
        .ok_or_else(|| bad(path, "no constant segment"))?;
    let off = *cs
        .offsets
        .get(t.data_buffer_idx as usize)
        .ok_or_else(|| bad(path, "timestep_table: constant index out of range"))?;
    let mut buf = vec![0u8; steps * r * 4];
    pte.read_segment_at(cs.segment_index as usize, off, &mut buf)?;
    Ok(buf
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// What [`run_pte`] produced.
#[derive(Debug, Clone)]
pub struct PteRun {
    /// The actions, f32 `[chunk, action_dim]`.
    pub actions: Vec<f32>,
    /// Each runtime that ran engines, as `report.json` names it.
    pub runtimes: Vec<String>,
}

/// An export's two `.pte` files opened, with the identities they had when opened: actions came
/// from these files only if they are still the files after the run ([`Ptes::check`]).
struct Ptes {
    prefix_path: std::path::PathBuf,
    step_path: std::path::PathBuf,
    prefix: PteFile,
    step: PteFile,
    ids: [FileIdentity; 2],
}

impl Ptes {
    fn open(pte_dir: &Path) -> Result<Self> {
        let prefix_path = pte_dir.join(crate::layout::PREFIX_PTE);
        let step_path = pte_dir.join(crate::layout::STEP_PTE);
        let prefix = PteFile::open(&prefix_path)?;
        let step = PteFile::open(&step_path)?;
        // Identities before the engines are mapped.
        let identity = |p: &Path| -> Result<FileIdentity> {
            let md = std::fs::metadata(p).map_err(|e| Error::io(p, "stat", e))?;
            Ok(FileIdentity::of(&md))
        };
        let ids = [identity(&prefix_path)?, identity(&step_path)?];
        Ok(Ptes {
            prefix_path,
            step_path,
            prefix,
            step,
            ids,
        })
    }

    /// Refuses files that changed since they were opened (the actions would not be theirs).
    fn check(&self) -> Result<()> {
        self.ids[0].check(&self.prefix_path, Role::Program)?;
        self.ids[1].check(&self.step_path, Role::Program)?;
        Ok(())
    }
}

fn runtime_names(runtimes: &Runtimes) -> Vec<String> {
    runtimes
        .values()
        .map(|r| format!("{} ({})", r.describe(), r.device().name()))
        .collect()
}

/// A chunk's RTC guidance and its values where the step's runtime keeps them: `rtc_prev`,
/// `rtc_weights`, each step's `rtc_step`.
type Uploaded = (Guidance, Value, Value, Vec<Value>);

/// The step's program signature and the timestep table's rows (as the step's runtime keeps
/// them: on its device where it has one): what every chunk's steps need.
struct Steps {
    sprog: Program,
    rows: Vec<Value>,
    /// The last chunk's RTC guidance as uploaded (`rtc_prev`, `rtc_weights`, each step's
    /// `rtc_step`): a chunk with the same guidance (every plain chunk after the first) uploads
    /// nothing more.
    guidance: std::cell::RefCell<Option<Uploaded>>,
}

impl Steps {
    fn new(cfg: &Pi05Config, step_pte: &PteFile, step: &Loaded<'_>) -> Result<Self> {
        let r = petite_pi05::programs::time_row_len(cfg);
        let table = read_table(step_pte, cfg.steps, r)?;
        let rows = (0..cfg.steps)
            .map(|k| step.upload(host(Tensor::f32(&[r], table[k * r..(k + 1) * r].to_vec())?)))
            .collect::<Result<_>>()?;
        Ok(Steps {
            sprog: build_step(cfg, Precision::F32)?,
            rows,
            guidance: Default::default(),
        })
    }

    /// The Euler steps from `inputs.noise` with the prefix's outputs `kv` and the chunk's RTC
    /// guidance; returns x after the last. x stays where the step's runtime keeps it between
    /// steps; only the last comes back.
    fn run(
        &self,
        cfg: &Pi05Config,
        step: &Loaded<'_>,
        kv: &BTreeMap<String, Value>,
        inputs: &Inputs,
        step_path: &Path,
    ) -> Result<Vec<f32>> {
        let noise = &inputs.noise;
        let sprog = &self.sprog;
        let xi = sprog
            .outputs
            .iter()
            .position(|o| o.name == io::X_NEXT)
            .ok_or_else(|| Error::Internal("step program has no x_next".into()))?;
        let mut x = step.upload(host(Tensor::f32(
            &[cfg.chunk, cfg.action_dim],
            noise.to_vec(),
        )?))?;
        let g = &inputs.guidance;
        let mut cached = self.guidance.borrow_mut();
        if cached.as_ref().is_none_or(|c| c.0 != *g) {
            let prev = step.upload(host(Tensor::f32(
                &[cfg.chunk, cfg.action_dim],
                g.prev.clone(),
            )?))?;
            let weights = step.upload(host(Tensor::f32(&[cfg.chunk, 1], g.weights.clone())?))?;
            let rows = g
                .steps
                .chunks_exact(2)
                .map(|r| step.upload(host(Tensor::f32(&[2], r.to_vec())?)))
                .collect::<Result<Vec<_>>>()?;
            *cached = Some((g.clone(), prev, weights, rows));
        }
        let (_, prev, weights, rtc_rows) = cached.as_ref().expect("set above");
        for (row, rtc_step) in self.rows.iter().zip(rtc_rows) {
            let mut ins: BTreeMap<&str, Value> =
                kv.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
            ins.insert(io::X_T, x);
            ins.insert(io::TIME_ROW, row.clone());
            ins.insert(io::RTC_PREV, prev.clone());
            ins.insert(io::RTC_WEIGHTS, weights.clone());
            ins.insert(io::RTC_STEP, rtc_step.clone());
            let outs = step.run_values(ordered(sprog, &mut ins)?)?;
            x = outs
                .into_iter()
                .nth(xi)
                .ok_or_else(|| bad(step_path, "the step gave no x_next"))?;
        }
        step.download(x)?
            .to_reference()
            .ok()
            .and_then(|t| t.into_float_values().ok())
            .ok_or_else(|| bad(step_path, "x_next is not a float tensor"))
    }
}

fn host(t: Tensor) -> HostTensor {
    HostTensor::from(&t)
}

/// `prog`'s inputs in order, from `by` (by input name).
fn ordered<T: Clone>(prog: &Program, by: &mut BTreeMap<&str, T>) -> Result<Vec<T>> {
    prog.inputs
        .iter()
        .map(|&id| {
            let n = prog.input_name(id).unwrap_or_default();
            by.get(n)
                .cloned()
                .ok_or_else(|| Error::Internal(format!("no value for program input `{n}`")))
        })
        .collect()
}

/// The prefix run on `inputs`: its outputs (the K/V the steps read) by name, kept where the
/// prefix's runtime keeps them.
fn run_prefix(
    cfg: &Pi05Config,
    pprog: &Program,
    prefix: &Loaded<'_>,
    inputs: &Inputs,
) -> Result<BTreeMap<String, Value>> {
    let s = cfg.vision.image_size;
    let mut by_name: BTreeMap<&str, Value> = BTreeMap::new();
    let up = |t: Tensor| prefix.upload(host(t));
    by_name.insert(
        io::IMAGES,
        up(Tensor::f32(&[cfg.cameras, 3, s, s], inputs.images.clone())?)?,
    );
    by_name.insert(
        io::IMAGE_MASKS,
        up(Tensor::u8(&[cfg.cameras], inputs.image_masks.clone())?)?,
    );
    by_name.insert(
        io::TOKENS,
        up(Tensor::i64(&[cfg.tokens], inputs.tokens.clone())?)?,
    );
    by_name.insert(
        io::TOKEN_MASK,
        up(Tensor::u8(&[cfg.tokens], inputs.token_mask.clone())?)?,
    );
    let pouts = prefix.run_values(ordered(pprog, &mut by_name)?)?;
    Ok(pprog
        .outputs
        .iter()
        .zip(pouts)
        .map(|(o, t)| (o.name.clone(), t))
        .collect())
}

/// Runs the exported programs from their `.pte` files on `inputs`, each delegate's engines by
/// the runtime registered for its backend id on `device`; returns the actions. The runtimes
/// (and any device memory of theirs) are gone when it returns; the prefix's weights go after
/// their last read, before the steps (one chunk, least memory: `petite verify`). A policy that
/// runs many chunks keeps them: [`with_resident`].
pub fn run_pte(
    pte_dir: &Path,
    cfg: &Pi05Config,
    inputs: &Inputs,
    device: Device,
) -> Result<PteRun> {
    let ptes = Ptes::open(pte_dir)?;
    let runtimes = open_runtimes(&[&ptes.prefix, &ptes.step], device)?;
    let (prefix, step) = open_pair(&ptes, &runtimes, false)?;
    // Tests truncate a `.pte` here, while its engines are mapped.
    crate::guard::stop_point("verify");
    let steps = Steps::new(cfg, &ptes.step, &step)?;
    let pprog = build_prefix(cfg, Precision::F32)?;
    let kv = run_prefix(cfg, &pprog, &prefix, inputs)?;
    drop(prefix);
    let x = steps.run(cfg, &step, &kv, inputs, &ptes.step_path)?;
    drop(step);
    // The actions came from these files only if they are still the files that were mapped.
    ptes.check()?;
    Ok(PteRun {
        actions: x,
        runtimes: runtime_names(&runtimes),
    })
}

/// Both programs' engines opened. `resident` (a policy's): every weight kept, and each method
/// opened whole by a runtime that keeps values on its device. Otherwise (verify's one chunk):
/// the prefix's weights go after their last read, the step's stay (it runs every Euler step),
/// and values pass engine by engine through host memory — the path the gpu tier has checked;
/// the device-resident one takes over there once measured on a GPU.
fn open_pair<'m>(
    ptes: &'m Ptes,
    runtimes: &'m Runtimes,
    resident: bool,
) -> Result<(Loaded<'m>, Loaded<'m>)> {
    // Reading ahead helps a runtime that reads each engine whole when it opens it.
    let read_ahead = runtimes.values().any(|r| r.read_ahead());
    Ok((
        Loaded::new(&ptes.prefix, !resident, runtimes, read_ahead, resident)?,
        Loaded::new(&ptes.step, false, runtimes, read_ahead, resident)?,
    ))
}

/// One chunk of a resident export: the model inputs in, the actions (f32 `[chunk,
/// action_dim]`, model space) out.
pub type ChunkFn<'a> = dyn FnMut(&Inputs) -> Result<Vec<f32>> + 'a;

/// Opens the export in `pte_dir` once — both programs' engines on `device`, every weight kept
/// (nothing released between chunks) — and hands `body` a function that runs one chunk, with
/// the runtimes' names as `report.json` gives them. Everything opened lives as long as `body`
/// runs: a long-lived policy runs `body` on the thread that owns the device. Each chunk checks
/// that the `.pte` files are still those that were opened.
pub fn with_resident<T>(
    pte_dir: &Path,
    cfg: &Pi05Config,
    device: Device,
    body: impl FnOnce(&mut ChunkFn<'_>, Vec<String>) -> T,
) -> Result<T> {
    let ptes = Ptes::open(pte_dir)?;
    let runtimes = open_runtimes(&[&ptes.prefix, &ptes.step], device)?;
    let (prefix, step) = open_pair(&ptes, &runtimes, true)?;
    let steps = Steps::new(cfg, &ptes.step, &step)?;
    let pprog = build_prefix(cfg, Precision::F32)?;
    let mut chunk = |inputs: &Inputs| -> Result<Vec<f32>> {
        let kv = run_prefix(cfg, &pprog, &prefix, inputs)?;
        let x = steps.run(cfg, &step, &kv, inputs, &ptes.step_path)?;
        // The prefix's deferred checks: its work is done once the steps' result is back.
        prefix.finish()?;
        step.finish()?;
        ptes.check()?;
        Ok(x)
    };
    Ok(body(&mut chunk, runtime_names(&runtimes)))
}
