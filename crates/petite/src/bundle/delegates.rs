//! The delegate interpreter: runs a `.pte` whose methods are delegate calls, each engine opened
//! once per segment by the runtime [`crate::runtimes`] registers for the delegate's backend id
//! on the device asked for, values passed as [`HostTensor`]s.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use petite_engine::{EngineRuntime, HostTensor};
use petite_graph::Program;
use petite_pi05::inputs::Inputs;
use petite_pi05::programs::io;
use petite_pi05::{Pi05Config, Precision, build_prefix, build_step};
use petite_pte::PteFile;
use petite_pte::model::{DataLocation, EValue, Instruction, ScalarType};
use petite_reference::Tensor;
use petite_weights::{FileIdentity, Role};

use super::bad;
use crate::layout::{METHOD, TABLE_METHOD};
use crate::runtimes::{Device, Runtime};
use crate::{Error, Result};

/// A `.pte` opened for running: the reader's verified program and its engines, each opened
/// once per segment by the runtime registered for the delegates' backend on the device asked
/// for ([`crate::runtimes`]; `release`: each weight's host pages given back after its last read
/// in a run).
struct Loaded<'m> {
    pte: &'m PteFile,
    engines: HashMap<usize, Box<dyn EngineRuntime + 'm>>,
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
            let rt = crate::runtimes::runtime(id, device).map_err(|e| bad(path, e.to_string()))?;
            out.insert(id.to_string(), rt);
        }
    }
    Ok(out)
}

impl<'m> Loaded<'m> {
    /// Opens every engine of `pte`. `read_ahead`: each engine's segment is asked of the disk
    /// (`POSIX_FADV_WILLNEED`) while the one before it is opened — for runtimes that read the
    /// whole engine at open (a GPU's upload), so the disk never waits between engines.
    fn new(
        pte: &'m PteFile,
        release: bool,
        runtimes: &'m Runtimes,
        read_ahead: bool,
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
        Ok(Loaded { pte, engines })
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
        for chain in &plan.chains {
            for ins in &chain.instructions {
                let Instruction::DelegateCall {
                    delegate_index,
                    args,
                } = ins
                else {
                    return Err(bad(path, "only delegate calls are expected"));
                };
                let d = &plan.delegates[*delegate_index as usize];
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
                    let t = values.get(a).cloned().ok_or_else(|| {
                        bad(path, format!("value {a} is read before it is written"))
                    })?;
                    ins.insert(b.name.clone(), t);
                }
                let mut outs = e.run(ins)?;
                for (o, a) in e.outputs().iter().zip(&args[n_in..]) {
                    let t = outs.remove(&o.name).ok_or_else(|| {
                        bad(path, format!("engine produced no output `{}`", o.name))
                    })?;
                    values.insert(*a, t);
                }
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

/// Runs the exported programs from their `.pte` files on `inputs`, each delegate's engines by
/// the runtime registered for its backend id on `device`; returns the actions. The runtimes
/// (and any device memory of theirs) are gone when it returns.
pub fn run_pte(
    pte_dir: &Path,
    cfg: &Pi05Config,
    inputs: &Inputs,
    device: Device,
) -> Result<PteRun> {
    let prefix_path = pte_dir.join(crate::layout::PREFIX_PTE);
    let step_path = pte_dir.join(crate::layout::STEP_PTE);
    let prefix_pte = PteFile::open(&prefix_path)?;
    let step_pte = PteFile::open(&step_path)?;
    // Identities before the engines are mapped: the actions below came from these files only
    // if they are still the files at the end.
    let identity = |p: &Path| -> Result<FileIdentity> {
        let md = std::fs::metadata(p).map_err(|e| Error::io(p, "stat", e))?;
        Ok(FileIdentity::of(&md))
    };
    let (prefix_id, step_id) = (identity(&prefix_path)?, identity(&step_path)?);
    let runtimes = open_runtimes(&[&prefix_pte, &step_pte], device)?;
    // The prefix runs once: its weights go after their last read. The step runs every
    // Euler step: its weights stay.
    let read_ahead = device == Device::Cuda;
    let prefix = Loaded::new(&prefix_pte, true, &runtimes, read_ahead)?;
    let step = Loaded::new(&step_pte, false, &runtimes, read_ahead)?;
    // Tests truncate a `.pte` here, while its engines are mapped.
    crate::guard::stop_point("verify");
    let r = petite_pi05::programs::time_row_len(cfg);
    let table = read_table(&step_pte, cfg.steps, r)?;

    let s = cfg.vision.image_size;
    let pprog = build_prefix(cfg, Precision::F32)?;
    let host = |t: Tensor| HostTensor::from(&t);
    let mut by_name: BTreeMap<&str, HostTensor> = BTreeMap::new();
    by_name.insert(
        io::IMAGES,
        host(Tensor::f32(&[cfg.cameras, 3, s, s], inputs.images.clone())?),
    );
    by_name.insert(
        io::IMAGE_MASKS,
        host(Tensor::u8(&[cfg.cameras], inputs.image_masks.clone())?),
    );
    by_name.insert(
        io::TOKENS,
        host(Tensor::i64(&[cfg.tokens], inputs.tokens.clone())?),
    );
    by_name.insert(
        io::TOKEN_MASK,
        host(Tensor::u8(&[cfg.tokens], inputs.token_mask.clone())?),
    );
    let ordered =
        |prog: &Program, by: &mut BTreeMap<&str, HostTensor>| -> Result<Vec<HostTensor>> {
            prog.inputs
                .iter()
                .map(|&id| {
                    let n = prog.input_name(id).unwrap_or_default();
                    by.get(n)
                        .cloned()
                        .ok_or_else(|| Error::Internal(format!("no value for program input `{n}`")))
                })
                .collect()
        };
    let pouts = prefix.run(ordered(&pprog, &mut by_name)?)?;
    let mut kv: BTreeMap<String, HostTensor> = BTreeMap::new();
    for (o, t) in pprog.outputs.iter().zip(pouts) {
        kv.insert(o.name.clone(), t);
    }
    drop(prefix);

    let sprog = build_step(cfg, Precision::F32)?;
    let mut x = inputs.noise.clone();
    for k in 0..cfg.steps {
        let mut ins: BTreeMap<&str, HostTensor> =
            kv.iter().map(|(n, t)| (n.as_str(), t.clone())).collect();
        ins.insert(io::X_T, host(Tensor::f32(&[cfg.chunk, cfg.action_dim], x)?));
        ins.insert(
            io::TIME_ROW,
            host(Tensor::f32(&[r], table[k * r..(k + 1) * r].to_vec())?),
        );
        let outs = step.run(ordered(&sprog, &mut ins)?)?;
        let xi = sprog
            .outputs
            .iter()
            .position(|o| o.name == io::X_NEXT)
            .ok_or_else(|| Error::Internal("step program has no x_next".into()))?;
        x = outs
            .into_iter()
            .nth(xi)
            .and_then(|t| t.to_reference().ok())
            .and_then(|t| t.into_float_values().ok())
            .ok_or_else(|| bad(&step_path, "x_next is not a float tensor"))?;
    }
    drop(step);
    // The actions came from these files only if they are still the files that were mapped.
    prefix_id.check(&prefix_path, Role::Program)?;
    step_id.check(&step_path, Role::Program)?;
    let runtimes = runtimes
        .values()
        .map(|r| format!("{} ({})", r.describe(), r.device().name()))
        .collect();
    Ok(PteRun {
        actions: x,
        runtimes,
    })
}
