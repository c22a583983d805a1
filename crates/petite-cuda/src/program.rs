//! [`DeviceProgram`]: one petite-graph program with its weights on the device, run node by node
//! on the device's stream.

use std::collections::{BTreeMap, HashMap};

use petite_graph::{Dtype, NodeId, Op, Program, ReduceOp, ShapeDisplay, TensorType, ValueType};
use petite_reference::Tensor;
use petite_weights::WeightSource;

use crate::device::{DevTensor, Device, F32Matmul};
use crate::fuse::{Fusion, Role, Siblings};
use crate::plan::{
    ConvParams, EwParams, Gemm, HeadLayout, MatOperand, NormParams, Operand, RopeParams,
    SoftmaxParams, attention_gemms, attention_gemms_per_head, contiguous_strides,
};
use crate::source::{EwOp, dtype_code};
use crate::{Error, Result};

/// A program ready to run on a [`Device`]: validated, ordered, its weights and constants
/// uploaded once in their declared dtypes.
pub struct DeviceProgram<'d> {
    dev: &'d Device,
    program: Program,
    order: Vec<NodeId>,
    live: Vec<bool>,
    uses: Vec<u32>,
    is_output: Vec<bool>,
    /// Weights and constants, by node index.
    sources: Vec<Option<DevTensor>>,
    weight_bytes: u64,
    /// Elementwise chains fused into generated kernels (all [`Role::Plain`] when off).
    fusion: Fusion,
    /// The fused kernels, by [`Fusion::kernels`] index.
    fused: Vec<cudarc::driver::CudaFunction>,
    /// What each node reads from materialized values: its inputs, or a fused root's leaves.
    reads: Vec<Vec<NodeId>>,
    /// Seconds NVRTC spent on the fused kernels (0 when cached).
    fuse_compile_seconds: f64,
    /// Per-node timing ([`profiling`]), read once at load, not every run.
    profile: bool,
    /// Linears whose GEMMs run as one strided batch ([`crate::fuse::siblings`]).
    siblings: Vec<Siblings>,
    /// Linear → its sibling group.
    sibling_of: HashMap<NodeId, usize>,
    /// Each sibling group's weights `[G, N, K]` and biases `[G, N]`, side by side.
    merged: Vec<(DevTensor, Option<DevTensor>)>,
    /// How its f32 products are computed ([`DeviceProgram::set_f32_matmul`]).
    f32_matmul: F32Matmul,
    /// Whether a fused attention runs as one cluster launch where it fits
    /// ([`DeviceProgram::set_attention_cluster`]).
    attention_cluster: bool,
    /// Whether an f32 attention without a mask, its products TF32, runs as one launch
    /// ([`DeviceProgram::set_tf32_attention`]).
    tf32_attention: bool,
}

enum Slot {
    Empty,
    T(DevTensor),
    Tuple(Vec<DevTensor>),
}

/// The `(batch, head, query)` element strides of an attention result of type `out_ty`
/// (`[B, H, Q, Dv]`) as written dense or, with `into` (the head-merging permute's type),
/// straight into `[B, Q, H, Dv]`: heads Dv apart, queries H·Dv apart.
fn head_strides(out_ty: &TensorType, into: Option<&TensorType>) -> [i64; 3] {
    match into {
        Some(t) => {
            let ts = contiguous_strides(&t.shape);
            [ts[0], ts[2], ts[1]]
        }
        None => {
            let os = contiguous_strides(&out_ty.shape);
            [os[0], os[1], os[2]]
        }
    }
}

/// [`SoftmaxParams`]' mask fields for rows `((b·H + h)·Q + q)` of `[B, H, Q, K]` logits and a
/// mask of shape `ms` (rank ≤ 4, broadcast over its size-1 dims): `[H, Q, sb, sh, sq, sk]`.
fn mask_strides(ms: &[usize], h: usize, nq: usize) -> [i64; 6] {
    let mut dims = [1usize; 4];
    dims[4 - ms.len()..].copy_from_slice(ms);
    let [mb, mh, mq, mk] = dims;
    let sk = i64::from(mk != 1);
    let sq = if mq == 1 { 0 } else { mk as i64 };
    let sh = if mh == 1 { 0 } else { (mq * mk) as i64 };
    let sb = if mb == 1 { 0 } else { (mh * mq * mk) as i64 };
    [h as i64, nq as i64, sb, sh, sq, sk]
}

/// Elementwise fusion ([`crate::fuse`]) is on unless `PETITE_CUDA_NO_FUSE` is set (to compare
/// fused and unfused runs).
fn fusing() -> bool {
    std::env::var_os("PETITE_CUDA_NO_FUSE").is_none()
}

/// Per-node device timing, printed after each run, when `PETITE_CUDA_PROFILE` is set (never
/// while capturing a graph: events cannot be read back there).
fn profiling() -> bool {
    std::env::var_os("PETITE_CUDA_PROFILE").is_some()
}

/// `PETITE_CUDA_PROFILE=nodes` also lists every launched node in run order with its time: the
/// sums by op kind hide which of a layer's launches are small and back to back.
fn profiling_nodes() -> bool {
    std::env::var_os("PETITE_CUDA_PROFILE").is_some_and(|v| v == "nodes")
}

fn type_dtype(t: &ValueType) -> &'static str {
    match t {
        ValueType::Tensor(t) => t.dtype.name(),
        ValueType::Tuple(_) => "tuple",
    }
}

fn err(msg: impl Into<String>) -> Error {
    Error::Plan(msg.into())
}

impl<'d> DeviceProgram<'d> {
    /// Validates `program`, orders it, and uploads every weight it reads from `weights` (in
    /// the declared dtype, rows only for a row range) and every constant. With `release`, each
    /// weight's host pages are given back once it is on the device. bf16 attentions of few
    /// queries are fused on sm_90 and later ([`crate::fuse::fused_attention_queries`];
    /// `PETITE_CUDA_FUSED_ATTN` overrides).
    pub fn load(
        dev: &'d Device,
        program: &Program,
        weights: &dyn WeightSource,
        release: bool,
    ) -> Result<Self> {
        Self::load_fusing_attention(
            dev,
            program,
            weights,
            release,
            crate::fuse::fused_attention_queries(dev.info().compute_capability),
        )
    }

    /// [`DeviceProgram::load`], running bf16 attentions of up to `attention_queries` queries
    /// as the fused attention kernels ([`crate::fuse::Attend`]; 0: none; never before sm_80).
    pub fn load_fusing_attention(
        dev: &'d Device,
        program: &Program,
        weights: &dyn WeightSource,
        release: bool,
        attention_queries: usize,
    ) -> Result<Self> {
        let options = crate::fuse::Options::from_env(attention_queries);
        Self::load_with(dev, program, weights, release, options)
    }

    /// [`DeviceProgram::load`] fusing as `options` say: the fusion planner's switches
    /// (`PETITE_CUDA_FUSED_ATTN`, `_NO_PAIR`, `_NO_OFFSETS`, `_UNROLL_ROWS`) are not read; the
    /// others are, as by [`DeviceProgram::load`] (`PETITE_CUDA_NO_FUSE` still turns fusion off).
    pub fn load_with(
        dev: &'d Device,
        program: &Program,
        weights: &dyn WeightSource,
        release: bool,
        options: crate::fuse::Options,
    ) -> Result<Self> {
        let t0 = std::time::Instant::now();
        program.validate()?;
        let order = program.topo_order()?;
        let roots: Vec<NodeId> = program.outputs.iter().map(|o| o.value).collect();
        let live = program.ancestors(&roots);
        let mut is_output = vec![false; program.len()];
        for o in &program.outputs {
            is_output[o.value.index()] = true;
        }
        let fusion = if fusing() {
            // The fused attention's products are bf16 `mma.sync`, sm_80 and later.
            let attention = if dev.info().compute_capability.0 >= 8 {
                options.attention_queries
            } else {
                0
            };
            crate::fuse::plan_opts(
                program,
                &live,
                &is_output,
                crate::fuse::Options {
                    attention_queries: attention,
                    ..options
                },
            )?
        } else {
            Fusion {
                role: vec![Role::Plain; program.len()],
                groups: Vec::new(),
                kernels: Vec::new(),
                source: String::new(),
                views: Default::default(),
                masks: Default::default(),
                attentions: Default::default(),
                biases: Default::default(),
                attention_kernels: None,
            }
        };
        // Uses count the nodes that read a value from its buffer: fused roots read their
        // leaves; inlined nodes read nothing.
        let mut reads: Vec<Vec<NodeId>> = vec![Vec::new(); program.len()];
        for i in 0..program.len() {
            if !live[i] {
                continue;
            }
            let operands = |c: usize| -> Vec<NodeId> {
                let id = NodeId(c as u32);
                // A fused attention reads q and k (its logits product's operands), v, the mask.
                if let Some(a) = fusion.attentions.get(&id) {
                    return match a.pieces {
                        Some((kv, _)) => vec![a.q.base, kv[0], kv[1], kv[2], kv[3], a.mask],
                        None => vec![a.q.base, a.k.base, a.v.base, a.mask],
                    };
                }
                program.nodes[c]
                    .inputs
                    .iter()
                    .enumerate()
                    .map(|(j, _)| crate::fuse::read_from(program, &fusion.views, id, j))
                    .chain(fusion.masks.get(&id).map(|f| f.mask))
                    .collect()
            };
            let mut r = match fusion.role[i] {
                // A cast that runs a narrowed softmax reads the softmax's operands, a permute
                // that runs a transposed product the product's.
                Role::Plain => operands(i)
                    .into_iter()
                    .flat_map(|v| match fusion.role[v.index()] {
                        Role::Narrowed | Role::Transposed => operands(v.index()),
                        _ => vec![v],
                    })
                    .collect(),
                Role::Inlined
                | Role::View
                | Role::Narrowed
                | Role::Transposed
                | Role::Prologue
                | Role::Attended => Vec::new(),
                // An absorbed group's leaves are read by the kernel that computes it.
                Role::Root(g) if fusion.groups[g].absorbed => Vec::new(),
                Role::Root(g) => {
                    let group = &fusion.groups[g];
                    let mut r = group.leaves.clone();
                    r.extend(group.prologue.map_or(Vec::new(), |n| operands(n.index())));
                    // And the absorbed group's own value: its buffer, allocated where its root
                    // ran, must outlive the free views (reshapes) read from it until then.
                    for f in group.first.iter().chain(&group.with) {
                        r.extend(fusion.groups[*f].leaves.iter().copied());
                        r.push(fusion.groups[*f].root);
                    }
                    r
                }
            };
            r.sort();
            r.dedup();
            reads[i] = r;
        }
        let mut uses = vec![0u32; program.len()];
        for r in &reads {
            for v in r {
                uses[v.index()] += 1;
            }
        }
        let mut sources: Vec<Option<DevTensor>> = vec![None; program.len()];
        let mut weight_bytes = 0u64;
        let siblings = if fusing() {
            let consumers = program.consumers();
            // Opt-in (`PETITE_CUDA_COLUMNS=1`): on the H200 the wide TF32 GEMM gave full-size
            // pi0.5 the same bits and 0.16 ms a chunk, but moved the two_cams_mqa golden's bf16
            // actions from 1.09e-2 to 2.21e-2 of lerobot's f32 (lerobot's own bf16: 9.6e-3).
            let columns = std::env::var_os("PETITE_CUDA_COLUMNS").is_some_and(|v| v == "1");
            let in_place = |l: NodeId| {
                columns
                    && crate::fuse::read_in_place_by_attentions(
                        program, &fusion, &consumers, &live, &is_output, l,
                    )
            };
            crate::fuse::siblings(program, &live, &in_place)
        } else {
            Vec::new()
        };
        let mut fusion = fusion;
        for sg in siblings.iter().filter(|sg| sg.columns) {
            let wide = sg.linears.len()
                * program
                    .node(sg.weights[0])
                    .tensor()
                    .map_or(0, |t| t.shape[0]);
            for &l in &sg.linears {
                let shape = &program
                    .node(l)
                    .tensor()
                    .ok_or_else(|| err("tuple linear"))?
                    .shape;
                // A column slice of the dense `[.., wide]` output: that shape's strides.
                let mut all = shape.clone();
                *all.last_mut().ok_or_else(|| err("a scalar linear"))? = wide;
                let st = crate::plan::contiguous_strides(&all);
                crate::fuse::restride(program, &mut fusion, l, &st)?;
            }
        }
        let mut sibling_of = HashMap::new();
        // Weight or bias node → the part of its group's buffer it is uploaded into.
        let mut part_of: HashMap<NodeId, DevTensor> = HashMap::new();
        let mut merged = Vec::with_capacity(siblings.len());
        for (g, sg) in siblings.iter().enumerate() {
            let part = |v: NodeId| -> Result<(Dtype, Vec<usize>)> {
                let t = program
                    .node(v)
                    .tensor()
                    .ok_or_else(|| err("tuple weight"))?;
                Ok((t.dtype, t.shape.clone()))
            };
            let stack =
                |vs: &[NodeId], part_of: &mut HashMap<NodeId, DevTensor>| -> Result<DevTensor> {
                    let (dt, shape) = part(vs[0])?;
                    let mut all = vec![vs.len()];
                    all.extend_from_slice(&shape);
                    let buf = dev.alloc(dt, &all)?;
                    let bytes = shape.iter().product::<usize>() * dt.size();
                    for (i, &v) in vs.iter().enumerate() {
                        part_of.insert(v, buf.view(i * bytes, &shape));
                    }
                    Ok(buf)
                };
            let wm = stack(&sg.weights, &mut part_of)?;
            let bm = match &sg.biases {
                Some(bs) => Some(stack(bs, &mut part_of)?),
                None => None,
            };
            merged.push((wm, bm));
            for &l in &sg.linears {
                sibling_of.insert(l, g);
            }
        }
        // Every live weight's bytes and device value, then all uploaded together (pieces read
        // on several threads, staged in page-locked buffers: [`crate::upload`]).
        let all_weights = program.weights();
        let mut jobs = Vec::new();
        for w in &all_weights {
            if !live[w.node.index()] {
                continue;
            }
            let view = weights.tensor(&w.name)?;
            let stored = view.dtype;
            let range = w
                .stored_range(stored.size())
                .ok_or_else(|| err(format!("weight {:?}: byte range overflows", w.name)))?;
            let bytes = view.bytes.get(range.clone()).ok_or_else(|| {
                err(format!(
                    "weight {:?}: stored {}{} has no bytes {range:?}",
                    w.name,
                    stored.name(),
                    ShapeDisplay(view.shape)
                ))
            })?;
            let dst = match part_of.remove(&w.node) {
                Some(dst) => dst,
                None => dev.alloc(w.dtype, &w.shape)?,
            };
            weight_bytes += dst.bytes() as u64;
            sources[w.node.index()] = Some(dst.clone());
            jobs.push(crate::upload::Job {
                name: &w.name,
                bytes,
                start: range.start,
                stored,
                dst,
                whole: w.rows.is_none(),
            });
        }
        // The fused kernels, and the attention kernels' own module where attentions are fused,
        // compile (NVRTC, on the host, a thread each) while the weights go up.
        let cc = dev.info().compute_capability;
        let t_up = std::time::Instant::now();
        let attention_at = fusion
            .attention_kernels
            .map_or(fusion.kernels.len(), |[a, ..]| a);
        let (own, attention) = fusion.kernels.split_at(attention_at);
        let attention_source = (!attention.is_empty()).then(crate::source::attention_module_source);
        let (compiled, compiled_attention) = std::thread::scope(|s| -> Result<_> {
            let compiling = (!own.is_empty())
                .then(|| s.spawn(|| crate::device::compile_fused(cc, &fusion.source)));
            let compiling_attention = attention_source
                .as_deref()
                .map(|src| s.spawn(move || crate::device::compile_fused(cc, src)));
            let up = crate::upload::upload(dev, &jobs, weights, release);
            let join = |h: Option<std::thread::ScopedJoinHandle<'_, Result<_>>>| match h {
                Some(h) => h
                    .join()
                    .map_err(|_| err("the kernel compiler thread panicked"))?
                    .map(Some),
                None => Ok(None),
            };
            let compiled = join(compiling)?;
            let compiled_attention = join(compiling_attention)?;
            up?;
            Ok((compiled, compiled_attention))
        })?;
        let fuse_compile_seconds = compiled.as_ref().map_or(0.0, |c| c.1)
            + compiled_attention.as_ref().map_or(0.0, |c| c.1);
        crate::device::trace(format_args!(
            "{} weights, {:.2} GiB up in {:.2} s ({} fused kernels, {:.2} s compiling beside)",
            jobs.len(),
            weight_bytes as f64 / (1u64 << 30) as f64,
            t_up.elapsed().as_secs_f64(),
            fusion.kernels.len(),
            fuse_compile_seconds
        ));
        drop(jobs);
        let mut fused = Vec::with_capacity(fusion.kernels.len());
        for (compiled, names) in [(compiled, own), (compiled_attention, attention)] {
            if let Some((ptx, _)) = compiled {
                fused.extend(dev.load_functions(ptx, names)?);
            }
        }
        for (i, node) in program.nodes.iter().enumerate() {
            if let Op::Constant { data } = &node.op
                && live[i]
            {
                let t = node.tensor().ok_or_else(|| err("tuple constant"))?;
                sources[i] = Some(dev.upload_bytes(t.dtype, &t.shape, data)?);
            }
        }
        crate::device::trace(format_args!(
            "program of {} nodes loaded in {:.2} s ({} attentions fused)",
            program.len(),
            t0.elapsed().as_secs_f64(),
            fusion.attentions.len()
        ));
        Ok(DeviceProgram {
            dev,
            program: program.clone(),
            order,
            live,
            uses,
            is_output,
            sources,
            weight_bytes,
            fusion,
            fused,
            reads,
            fuse_compile_seconds,
            profile: profiling(),
            siblings,
            sibling_of,
            merged,
            f32_matmul: F32Matmul::Exact,
            attention_cluster: std::env::var_os("PETITE_CUDA_ATTN_CLUSTER")
                .is_none_or(|v| v != "0"),
            tf32_attention: std::env::var_os("PETITE_CUDA_NO_TF32_ATTN").is_none(),
        })
    }

    /// Sets how this program's f32 GEMMs run (exact f32 from [`DeviceProgram::load`]).
    pub fn set_f32_matmul(&mut self, m: F32Matmul) {
        self.f32_matmul = m;
    }

    /// bf16 attentions run whole by the fused attention kernels ([`crate::fuse::Attend`]).
    pub fn fused_attentions(&self) -> usize {
        self.fusion.attentions.len()
    }

    /// Whether a fused attention runs as one launch of thread-block clusters (`pt_attn_cl`,
    /// sm_90 and later, up to 1,024 keys and v's head dim a multiple of 128:
    /// [`crate::plan::attention_cluster`], where the device grants a block its 162 KB of shared
    /// memory: [`crate::DeviceInfo::max_shared_per_block`]) or as two (`pt_attn_logits`, `pt_attn_pv`). On by
    /// default; `PETITE_CUDA_ATTN_CLUSTER=0` turns it off. Both give the same roundings; only
    /// the dot products' summation orders differ.
    pub fn set_attention_cluster(&mut self, on: bool) {
        self.attention_cluster = on;
    }

    /// Whether an f32 attention without a mask (pi0.5's SigLIP), where the program's f32
    /// products run as TF32 ([`DeviceProgram::set_f32_matmul`]), runs as one launch
    /// (`pt_attn_tf32`: flash-attention's order, no logits in memory;
    /// [`crate::plan::tf32_attention_launch`]) or as its GEMMs and a softmax. On by default;
    /// `PETITE_CUDA_NO_TF32_ATTN=1` turns it off. Exact f32 products always take the GEMMs.
    pub fn set_tf32_attention(&mut self, on: bool) {
        self.tf32_attention = on;
    }

    /// Nodes computed inside fused kernels, fused kernel launches a run, and distinct kernels.
    pub fn fusion_stats(&self) -> (usize, usize, usize) {
        let nodes = self.fusion.groups.iter().map(|g| g.nodes).sum();
        (nodes, self.fusion.groups.len(), self.fusion.kernels.len())
    }

    /// Seconds NVRTC spent compiling this program's fused kernels (0 when cached).
    pub fn fuse_compile_seconds(&self) -> f64 {
        self.fuse_compile_seconds
    }

    /// The program.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// Bytes of the weights on the device.
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// Runs on host tensors: uploads the inputs, runs, downloads every output.
    pub fn run(&self, inputs: BTreeMap<String, Tensor>) -> Result<BTreeMap<String, Tensor>> {
        let mut dins = BTreeMap::new();
        for (k, t) in inputs {
            dins.insert(k, self.dev.upload(&t)?);
        }
        let outs = self.run_device(dins)?;
        let mut host = BTreeMap::new();
        for (k, t) in outs {
            host.insert(k, self.dev.download(&t)?);
        }
        Ok(host)
    }

    /// Runs on device values; the outputs stay on the device. Queues the work on the stream
    /// and returns once an index check of the embeddings has read back (one sync a run).
    pub fn run_device(
        &self,
        inputs: BTreeMap<String, DevTensor>,
    ) -> Result<BTreeMap<String, DevTensor>> {
        let flag = if self.has_embedding() {
            Some(self.dev.zeros(Dtype::I64, &[1])?)
        } else {
            None
        };
        let out = self.run_device_flagged(inputs, flag.as_ref())?;
        if let Some(f) = &flag {
            self.check_indices(f)?;
        }
        Ok(out)
    }

    /// Whether the program gathers rows by index (an embedding), so that a run needs an index
    /// flag ([`DeviceProgram::run_device_flagged`]).
    pub fn has_embedding(&self) -> bool {
        self.program
            .nodes
            .iter()
            .any(|n| matches!(n.op, Op::Embedding))
    }

    /// [`DeviceProgram::run_device`] without reading anything back, so that it can be captured
    /// into a CUDA graph: an out-of-table embedding index is recorded in `flag` (i64 `[1]`,
    /// zero beforehand; required when [`DeviceProgram::has_embedding`]), which the caller reads
    /// with [`DeviceProgram::check_indices`] once the work has run.
    pub fn run_device_flagged(
        &self,
        mut inputs: BTreeMap<String, DevTensor>,
        flag: Option<&DevTensor>,
    ) -> Result<BTreeMap<String, DevTensor>> {
        let p = &self.program;
        let mut slots: Vec<Slot> = (0..p.len()).map(|_| Slot::Empty).collect();
        for &id in &p.inputs {
            let name = p.input_name(id).unwrap_or_default().to_string();
            let want = p.node(id).tensor().cloned().ok_or_else(|| Error::Input {
                name: name.clone(),
                message: "declared as a tuple".into(),
            })?;
            let t = inputs.remove(&name).ok_or_else(|| Error::Input {
                name: name.clone(),
                message: format!("missing (expected {want})"),
            })?;
            if t.dtype() != want.dtype || t.shape() != want.shape.as_slice() {
                return Err(Error::Input {
                    name,
                    message: format!(
                        "expected {want}, found {}{}",
                        t.dtype().name(),
                        ShapeDisplay(t.shape())
                    ),
                });
            }
            if self.live[id.index()] {
                slots[id.index()] = Slot::T(t);
            }
        }
        if let Some(extra) = inputs.keys().next() {
            return Err(Error::Input {
                name: extra.clone(),
                message: "not an input of this program".into(),
            });
        }
        let gather_err = match flag {
            Some(f) if f.dtype() == Dtype::I64 && f.numel() == 1 => Some(f),
            Some(f) => return Err(err(format!("an index flag is i64 [1], not {f:?}"))),
            None if self.has_embedding() => {
                return Err(err("an embedding needs an index flag"));
            }
            None => None,
        };
        let mut remaining = self.uses.clone();
        let profile = self.profile;
        let mut marks: Vec<(NodeId, crate::device::Mark, crate::device::Mark)> = Vec::new();
        for &id in &self.order {
            if !self.live[id.index()]
                || matches!(
                    self.fusion.role[id.index()],
                    Role::Inlined
                        | Role::View
                        | Role::Narrowed
                        | Role::Transposed
                        | Role::Prologue
                        | Role::Attended
                )
            {
                continue;
            }
            let node = p.node(id);
            let before = if profile {
                Some(self.dev.mark()?)
            } else {
                None
            };
            match &node.op {
                Op::Input { .. } => {}
                Op::Weight { .. } | Op::Constant { .. } => {
                    let t = self.sources[id.index()]
                        .clone()
                        .ok_or_else(|| self.node_err(id, err("source not uploaded")))?;
                    slots[id.index()] = Slot::T(t);
                }
                Op::Linear if self.sibling_of.contains_key(&id) => {
                    // The first of its group computes every sibling's output.
                    if !matches!(slots[id.index()], Slot::T(_)) {
                        let g = self.sibling_of[&id];
                        let outs = self
                            .run_siblings(g, &slots)
                            .map_err(|e| self.node_err(id, e))?;
                        for (l, t) in self.siblings[g].linears.iter().zip(outs) {
                            slots[l.index()] = Slot::T(t);
                        }
                    }
                    self.check_type(id, &slots[id.index()])?;
                }
                _ => {
                    let out = match self.fusion.role[id.index()] {
                        Role::Root(g) => self.run_fused(g, id, &slots),
                        _ => self.eval(id, &slots, gather_err),
                    }
                    .map_err(|e| self.node_err(id, e))?;
                    self.check_type(id, &out)?;
                    slots[id.index()] = out;
                }
            }
            if let Some(b) = before {
                marks.push((id, b, self.dev.mark()?));
            }
            for &v in &self.reads[id.index()] {
                remaining[v.index()] -= 1;
                if remaining[v.index()] == 0 && !self.is_output[v.index()] {
                    slots[v.index()] = Slot::Empty;
                }
            }
            if remaining[id.index()] == 0 && !self.is_output[id.index()] {
                slots[id.index()] = Slot::Empty;
            }
        }
        if profile {
            self.report_profile(&marks)?;
        }
        let mut out = BTreeMap::new();
        for o in &p.outputs {
            match &slots[o.value.index()] {
                Slot::T(t) => {
                    out.insert(o.name.clone(), t.clone());
                }
                _ => {
                    return Err(self.node_err(o.value, err("output was not computed")));
                }
            }
        }
        Ok(out)
    }

    /// Reads an index flag of [`DeviceProgram::run_device_flagged`] back (waiting for the work
    /// before it): an error naming the first out-of-table position, if any.
    pub fn check_indices(&self, flag: &DevTensor) -> Result<()> {
        let bad = self.dev.download(flag)?;
        if let Some(&pos) = bad.as_i64().and_then(|v| v.first())
            && pos != 0
        {
            return Err(err(format!(
                "an embedding index at position {} is outside its table",
                pos - 1
            )));
        }
        Ok(())
    }

    /// Prints device time by op kind and the slowest nodes to stderr (`PETITE_CUDA_PROFILE`).
    fn report_profile(
        &self,
        marks: &[(NodeId, crate::device::Mark, crate::device::Mark)],
    ) -> Result<()> {
        let mut by_op: BTreeMap<String, (f64, u32)> = BTreeMap::new();
        let mut nodes: Vec<(f64, NodeId)> = Vec::with_capacity(marks.len());
        let mut total = 0.0;
        for (id, a, b) in marks {
            let ms = a.ms_to(b)?;
            total += ms;
            let node = self.program.node(*id);
            let key = format!("{} {}", node.op.name(), node.ty);
            let key = if matches!(node.op, Op::Linear | Op::MatMul | Op::Attention { .. }) {
                key
            } else {
                format!("{} {}", node.op.name(), type_dtype(&node.ty))
            };
            let e = by_op.entry(key).or_default();
            e.0 += ms;
            e.1 += 1;
            nodes.push((ms, *id));
        }
        let mut rows: Vec<_> = by_op.into_iter().collect();
        rows.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
        eprintln!(
            "petite-cuda profile: {} nodes, {total:.3} ms (sum of per-node device times)",
            marks.len()
        );
        for (k, (ms, n)) in rows.iter().take(40) {
            eprintln!(
                "  {ms:9.3} ms {:5.1}% {n:5}x  {k}",
                100.0 * ms / total.max(1e-9)
            );
        }
        if profiling_nodes() {
            for (ms, id) in &nodes {
                let node = self.program.node(*id);
                if matches!(
                    node.op,
                    Op::Input { .. } | Op::Weight { .. } | Op::Constant { .. }
                ) {
                    continue;
                }
                eprintln!(
                    "  node {:8.2} us  {} {} {:?}",
                    ms * 1e3,
                    self.program.describe(*id),
                    node.ty,
                    self.fusion.role[id.index()]
                );
            }
        }
        nodes.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (ms, id) in nodes.iter().take(12) {
            eprintln!(
                "  slowest {ms:8.3} ms  {} {}",
                self.program.describe(*id),
                self.program.node(*id).ty
            );
        }
        Ok(())
    }

    fn node_err(&self, id: NodeId, e: Error) -> Error {
        match e {
            Error::Node { .. } => e,
            other => Error::Node {
                node: self.program.describe(id),
                message: other.to_string(),
            },
        }
    }

    fn check_type(&self, id: NodeId, out: &Slot) -> Result<()> {
        let want = &self.program.node(id).ty;
        let ok = match out {
            Slot::T(t) => want.admits_tensor(t.dtype(), t.shape()),
            Slot::Tuple(ts) => want.admits_tuple(ts.iter().map(|t| (t.dtype(), t.shape()))),
            _ => false,
        };
        if ok {
            Ok(())
        } else {
            Err(Error::Node {
                node: self.program.describe(id),
                message: format!("produced a value that is not the declared {want}"),
            })
        }
    }

    fn eval(&self, id: NodeId, slots: &[Slot], gather_err: Option<&DevTensor>) -> Result<Slot> {
        let p = &self.program;
        let node = p.node(id);
        let input = |i: usize| -> Result<&DevTensor> {
            let v = node.inputs[i];
            match &slots[v.index()] {
                Slot::T(t) => Ok(t),
                _ => Err(err(format!("input {i} ({v}) is not an available tensor"))),
            }
        };
        let out_ty: &TensorType = match &node.ty {
            ValueType::Tensor(t) => t,
            ValueType::Tuple(_) => {
                if let Op::Split { axis, sizes } = &node.op {
                    return self.split(input(0)?, *axis, sizes);
                }
                return Err(err("tuple result"));
            }
        };
        match node.op {
            Op::MatMul => return Ok(Slot::T(self.matmul(id, slots, out_ty, None)?)),
            Op::Attention { scale } => {
                return Ok(Slot::T(self.attention(
                    id,
                    scale as f32,
                    slots,
                    out_ty,
                    None,
                )?));
            }
            _ => {}
        }
        // A head-merging permute runs the product it permutes, which writes its layout.
        if let Op::Permute { .. } = node.op
            && self.fusion.role[node.inputs[0].index()] == Role::Transposed
        {
            let m = node.inputs[0];
            let m_ty = p
                .node(m)
                .tensor()
                .ok_or_else(|| err("a transposed tuple"))?;
            return Ok(Slot::T(match p.node(m).op {
                Op::MatMul => self.matmul(m, slots, m_ty, Some(out_ty))?,
                Op::Attention { scale } => {
                    self.attention(m, scale as f32, slots, m_ty, Some(out_ty))?
                }
                _ => return Err(err("a transposed node that is not a matmul or attention")),
            }));
        }
        // Operand `i` of node `c`; one read in place (a widening cast's input) is the view's base.
        let operand = |c: NodeId, i: usize| self.in_place(c, i, slots).map(|(t, _)| t);
        if let Op::Cast { .. } = node.op
            && self.fusion.role[node.inputs[0].index()] == Role::Narrowed
        {
            let sm = node.inputs[0];
            let Op::Softmax { axis } = p.node(sm).op else {
                return Err(err("a narrowed node that is not a softmax"));
            };
            return Ok(Slot::T(self.softmax_node(
                sm,
                axis,
                operand(sm, 0)?,
                slots,
                out_ty,
            )?));
        }
        let dev = self.dev;
        let n_in = node.inputs.len();
        let ins: Vec<&DevTensor> = (0..n_in)
            .map(|i| operand(id, i))
            .collect::<Result<_>>()
            .or_else(|e| {
                if let Op::GetItem { .. } = node.op {
                    Ok(Vec::new())
                } else {
                    Err(e)
                }
            })?;
        let out_shape = &out_ty.shape;
        let dt = out_ty.dtype;
        Ok(Slot::T(match &node.op {
            Op::Input { .. } | Op::Weight { .. } | Op::Constant { .. } => {
                return Err(err("sources are bound before the run"));
            }
            Op::Linear => {
                // A bias the fused group reading this linear adds is not added here.
                let b = match self.fusion.biases.contains_key(&id) {
                    true => None,
                    false => ins.get(2).copied(),
                };
                self.linear(ins[0], ins[1], b, out_ty)?
            }
            Op::MatMul => return Err(err("matmul is evaluated above")),
            Op::Conv2d { stride, padding } => self.conv2d(
                ins[0],
                ins[1],
                ins.get(2).copied(),
                *stride,
                *padding,
                out_ty,
            )?,
            Op::LayerNorm { .. } | Op::RmsNorm { .. } => self.norm(id, slots, out_ty)?,
            Op::Softmax { axis } => self.softmax_node(id, *axis, ins[0], slots, out_ty)?,
            Op::Rope => {
                let (x, c, s) = (ins[0], ins[1], ins[2]);
                let out = dev.alloc(dt, out_shape)?;
                let prm = RopeParams::new(dt, x.shape(), c.shape(), s.shape())?;
                let (px, pc, ps, po) = (dev.ptr(x), dev.ptr(c), dev.ptr(s), dev.ptr(&out));
                dev.launch("pt_rope", Device::cfg_elems(x.numel()), |b| {
                    b.arg(&prm);
                    Device::push_u64(b, &px);
                    Device::push_u64(b, &pc);
                    Device::push_u64(b, &ps);
                    Device::push_u64(b, &po);
                })?;
                out
            }
            Op::Attention { .. } => return Err(err("attention is evaluated above")),
            Op::Embedding => {
                let (table, idx) = (ins[0], ins[1]);
                let out = dev.alloc(dt, out_shape)?;
                let nidx = idx.numel() as i64;
                let v = table.shape()[0] as i64;
                let rowbytes = (table.shape()[1] * table.dtype().size()) as i64;
                let di = dtype_code(idx.dtype());
                let e = gather_err.ok_or_else(|| err("no gather error flag"))?;
                let (pi, pt, po, pe) = (dev.ptr(idx), dev.ptr(table), dev.ptr(&out), dev.ptr(e));
                dev.launch("pt_gather", Device::cfg_elems(out.bytes()), |b| {
                    b.arg(&nidx).arg(&v).arg(&rowbytes).arg(&di);
                    Device::push_u64(b, &pi);
                    Device::push_u64(b, &pt);
                    Device::push_u64(b, &po);
                    Device::push_u64(b, &pe);
                })?;
                out
            }
            Op::Binary { kind } => self.ew(EwOp::Binary(*kind), &ins, out_ty, None)?,
            Op::BinaryScalar {
                kind,
                scalar,
                scalar_lhs,
            } => self.ew(
                EwOp::Binary(*kind),
                &ins,
                out_ty,
                Some((*scalar, *scalar_lhs, ins[0].dtype())),
            )?,
            Op::Compare { kind } => self.ew(EwOp::Compare(*kind), &ins, out_ty, None)?,
            Op::Logical { kind } => self.ew(EwOp::Logical(*kind), &ins, out_ty, None)?,
            Op::Not => self.ew(EwOp::Not, &ins, out_ty, None)?,
            Op::Unary { kind } => self.ew(EwOp::Unary(*kind), &ins, out_ty, None)?,
            Op::Cast { .. } | Op::Expand { .. } => self.ew(EwOp::Copy, &ins, out_ty, None)?,
            Op::Where => self.ew(EwOp::Where, &ins, out_ty, None)?,
            Op::CumSum { axis } => {
                let x = ins[0];
                let s = x.shape();
                let outer: usize = s[..*axis].iter().product();
                let inner: usize = s[*axis + 1..].iter().product();
                let n = s[*axis];
                let out = dev.alloc(dt, out_shape)?;
                let (o, nn, ii, d) = (outer as i64, n as i64, inner as i64, dtype_code(dt));
                let (px, po) = (dev.ptr(x), dev.ptr(&out));
                // Integers: a block a line (exact in any order); floats: a thread a line, in
                // order (f64 running sum).
                let (name, cfg, lines) = if dt.is_float() {
                    ("pt_cumsum", Device::cfg_elems(outer * inner), o)
                } else {
                    ("pt_cumsum_i", Device::cfg_rows(outer * inner)?, o * ii)
                };
                if outer * inner > 0 {
                    dev.launch(name, cfg, |b| {
                        b.arg(&lines).arg(&nn).arg(&ii).arg(&d);
                        Device::push_u64(b, &px);
                        Device::push_u64(b, &po);
                    })?;
                }
                out
            }
            Op::Reduce { kind, axes, .. } => self.reduce(ins[0], *kind, axes, out_ty)?,
            Op::Concat { axis } => {
                let out = dev.alloc(dt, out_shape)?;
                let ost = contiguous_strides(out_shape);
                let mut start = 0usize;
                for x in &ins {
                    let o = Operand {
                        dtype: dt,
                        strides: ost.clone(),
                        offset: start as i64 * ost[*axis],
                    };
                    let i = Operand::broadcast(x.dtype(), x.shape(), x.shape())?;
                    self.ew_launch(EwParams::new(EwOp::Copy, x.shape(), &[i], &o)?, &[x], &out)?;
                    start += x.shape()[*axis];
                }
                out
            }
            Op::Slice {
                axis,
                start,
                end: _,
                step,
            } => self.slice(ins[0], *axis, *start, *step, out_shape)?,
            Op::Reshape { shape } => ins[0].reshaped(shape),
            Op::Permute { .. } if crate::fuse::moves_only_unit_dims(p, id) => {
                ins[0].reshaped(out_shape)
            }
            Op::Permute { perm } => {
                let x = ins[0];
                let xs = contiguous_strides(x.shape());
                let i = Operand {
                    dtype: x.dtype(),
                    strides: perm.iter().map(|&d| xs[d]).collect(),
                    offset: 0,
                };
                let out = dev.alloc(dt, out_shape)?;
                let o = Operand::broadcast(dt, out_shape, out_shape)?;
                self.ew_launch(EwParams::new(EwOp::Copy, out_shape, &[i], &o)?, &[x], &out)?;
                out
            }
            Op::Split { .. } => return Err(err("split yields a tuple")),
            Op::GetItem { index } => {
                let v = node.inputs[0];
                match &slots[v.index()] {
                    Slot::Tuple(ts) => ts
                        .get(*index)
                        .cloned()
                        .ok_or_else(|| err(format!("tuple has no element {index}")))?,
                    _ => return Err(err("getitem input is not a tuple")),
                }
            }
        }))
    }

    /// Sibling group `g`'s linears as one strided-batched GEMM over their side-by-side
    /// weights (the shared input read at batch stride 0), then each part's bias as
    /// [`DeviceProgram::linear`] adds it; returns each linear's output, a part of one buffer.
    fn run_siblings(&self, g: usize, slots: &[Slot]) -> Result<Vec<DevTensor>> {
        let dev = self.dev;
        let sg = &self.siblings[g];
        let first = self.program.node(sg.linears[0]);
        let x = match &slots[first.inputs[0].index()] {
            Slot::T(t) => t,
            _ => return Err(err("sibling input is not available")),
        };
        let out_ty = first.tensor().ok_or_else(|| err("tuple linear"))?;
        let (wm, bm) = &self.merged[g];
        let (parts, n, k) = (wm.shape()[0], wm.shape()[1], wm.shape()[2]);
        let rows = x.numel() / k.max(1);
        let dt = out_ty.dtype;
        if sg.columns {
            // One GEMM over the stacked weights ([parts · n, k]); each value a column slice.
            let wide = parts * n;
            let out = dev.alloc(dt, &[rows, wide])?;
            if k == 0 {
                dev.memset_zero(&out)?;
            } else {
                let gm = Gemm::linear(rows, k, wide)?;
                dev.gemm(
                    &gm,
                    dev.ptr(wm),
                    dev.ptr(x),
                    x.dtype(),
                    dev.ptr(&out),
                    dt,
                    self.f32_matmul,
                )?;
            }
            if let Some(b) = bm {
                let bw = b.view(0, &[wide]);
                self.bias(&out, Some(&bw), rows, wide, &out)?;
            }
            return Ok((0..parts)
                .map(|i| out.view(i * n * dt.size(), &out_ty.shape))
                .collect());
        }
        let mut all = vec![parts];
        all.extend_from_slice(&out_ty.shape);
        let out = dev.alloc(dt, &all)?;
        let per = rows * n;
        let gm = Gemm::linear(rows, k, n)?.batched(parts, (n * k) as i64, 0, per as i64)?;
        let acc = if dt == Dtype::F32 || bm.is_none() {
            out.clone()
        } else {
            dev.alloc(Dtype::F32, &all)?
        };
        if k == 0 {
            dev.memset_zero(&acc)?;
        } else {
            dev.gemm(
                &gm,
                dev.ptr(wm),
                dev.ptr(x),
                x.dtype(),
                dev.ptr(&acc),
                acc.dtype(),
                self.f32_matmul,
            )?;
        }
        let views: Vec<DevTensor> = (0..parts)
            .map(|i| out.view(i * per * dt.size(), &out_ty.shape))
            .collect();
        if let Some(b) = bm {
            for (i, o) in views.iter().enumerate() {
                let a = acc.view(i * per * acc.dtype().size(), &out_ty.shape);
                let bi = b.view(i * n * b.dtype().size(), &[n]);
                self.bias(&a, Some(&bi), rows, n, o)?;
            }
        }
        Ok(views)
    }

    /// One launch of fused group `g`'s kernel, writing root `id`'s value.
    fn run_fused(&self, g: usize, id: NodeId, slots: &[Slot]) -> Result<Slot> {
        let group = &self.fusion.groups[g];
        let t = self
            .program
            .node(id)
            .tensor()
            .ok_or_else(|| err("fused tuple"))?;
        let dev = self.dev;
        let mut ptrs: Vec<u64> = Vec::with_capacity(group.leaves.len() + 1);
        for &l in &group.leaves {
            match &slots[l.index()] {
                Slot::T(x) => ptrs.push(dev.ptr(x)),
                _ => return Err(err(format!("fused input {l} is not available"))),
            }
        }
        let out = dev.alloc(t.dtype, &t.shape)?;
        let n = out.numel() as i64;
        if n == 0 || group.absorbed {
            // An absorbed group's value is written by the launch of the group it is first in.
            return Ok(Slot::T(out));
        }
        ptrs.push(dev.ptr(&out));
        // The group computed first, or beside, by this launch: its leaves and output.
        let mut beside_n = None;
        if let Some(f) = group.first.or(group.with) {
            let other = &self.fusion.groups[f];
            for &l in other.leaves.iter().chain([&other.root]) {
                match &slots[l.index()] {
                    Slot::T(x) => ptrs.push(dev.ptr(x)),
                    _ => return Err(err(format!("fused input {l} is not available"))),
                }
            }
            if group.with.is_some() {
                let t = self
                    .program
                    .node(other.root)
                    .tensor()
                    .ok_or_else(|| err("fused tuple"))?;
                beside_n = Some((t.numel() as i64, group.leaves.len() + 1));
            }
        }
        let f = &self.fused[group
            .kernel
            .ok_or_else(|| err("an absorbed group launched"))?];
        // Slice starts after every pointer: the group's own, then its first's or beside's.
        let offsets = self.fusion.launch_offsets(g);
        let Some(norm) = group.prologue else {
            let cfg = cudarc::driver::LaunchConfig {
                grid_dim: (group.blocks, 1, 1),
                block_dim: (crate::plan::BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            return dev
                .launch_fn(f, cfg, |b| {
                    b.arg(&n);
                    for (j, p) in ptrs.iter().enumerate() {
                        // The beside group's `qn` precedes its pointers.
                        if let Some((qn, at)) = &beside_n
                            && j == *at
                        {
                            b.arg(qn);
                        }
                        Device::push_u64(b, p);
                    }
                    for o in offsets {
                        b.arg(o);
                    }
                })
                .map(|()| Slot::T(out));
        };
        // One block a row of the prologue norm, its parameters and operands first.
        let (prm, nptrs) = self.norm_args(norm, slots, t.dtype)?;
        dev.launch_fn(f, Device::cfg_rows(prm.rows as usize)?, |b| {
            b.arg(&prm);
            for p in &nptrs {
                Device::push_u64(b, p);
            }
            b.arg(&n);
            for p in &ptrs {
                Device::push_u64(b, p);
            }
            for o in offsets {
                b.arg(o);
            }
        })?;
        Ok(Slot::T(out))
    }

    /// Operand `j` of node `id` as it is read: the buffer (a view's base where the fusion plan
    /// reads the operand in place, [`Fusion::views`]) and that view.
    fn in_place<'s>(
        &'s self,
        id: NodeId,
        j: usize,
        slots: &'s [Slot],
    ) -> Result<(&'s DevTensor, Option<&'s crate::fuse::StridedView>)> {
        let view = self.fusion.views.get(&(id, j));
        let v = crate::fuse::read_from(&self.program, &self.fusion.views, id, j);
        match &slots[v.index()] {
            Slot::T(t) => Ok((t, view)),
            _ => Err(err(format!("input {j} ({v}) is not available"))),
        }
    }

    /// `pt_norm`'s parameters and `[x, weight, bias]` pointers (0 where absent) for norm node
    /// `id` over its operands (x possibly read through a widening cast's input), writing `dout`.
    fn norm_args(&self, id: NodeId, slots: &[Slot], dout: Dtype) -> Result<(NormParams, [u64; 3])> {
        let node = self.program.node(id);
        let (kind, eps) = match node.op {
            Op::LayerNorm { eps } => (0, eps),
            Op::RmsNorm { eps } => (1, eps),
            _ => return Err(err("not a norm")),
        };
        let mut ins: [Option<&DevTensor>; 3] = [None; 3];
        for (j, i) in ins.iter_mut().enumerate().take(node.inputs.len()) {
            *i = Some(self.in_place(id, j, slots)?.0);
        }
        let x = ins[0].ok_or_else(|| err("norm without input"))?;
        let (w, b) = (ins[1], ins[2]);
        let d = *x.shape().last().unwrap_or(&1);
        let prm = NormParams {
            rows: (x.numel() / d.max(1)) as i64,
            d: d as i64,
            kind,
            has_w: i32::from(w.is_some()),
            has_b: i32::from(b.is_some()),
            dx: dtype_code(x.dtype()),
            dw: w.map_or(0, |t| dtype_code(t.dtype())),
            db: b.map_or(0, |t| dtype_code(t.dtype())),
            dout: dtype_code(dout),
            eps: eps as f32,
            offset: 1.0,
        };
        let dev = self.dev;
        let ptr = |t: Option<&DevTensor>| t.map_or(0, |t| dev.ptr(t));
        Ok((prm, [dev.ptr(x), ptr(w), ptr(b)]))
    }

    fn ew_launch(&self, p: EwParams, ins: &[&DevTensor], out: &DevTensor) -> Result<()> {
        if p.n == 0 {
            return Ok(());
        }
        let dev = self.dev;
        let ptrs: Vec<u64> = ins.iter().map(|t| dev.ptr(t)).collect();
        let pa = ptrs[0];
        let pb = ptrs.get(1).copied().unwrap_or(0);
        let pc = ptrs.get(2).copied().unwrap_or(0);
        let po = dev.ptr(out);
        dev.launch("pt_ew", Device::cfg_elems(p.n as usize), |b| {
            b.arg(&p);
            Device::push_u64(b, &pa);
            Device::push_u64(b, &pb);
            Device::push_u64(b, &pc);
            Device::push_u64(b, &po);
        })
    }

    /// An elementwise op with numpy broadcasting of every input to the output's shape.
    fn ew(
        &self,
        op: EwOp,
        ins: &[&DevTensor],
        out_ty: &TensorType,
        scalar: Option<(f64, bool, Dtype)>,
    ) -> Result<DevTensor> {
        let shape = &out_ty.shape;
        let ops = ins
            .iter()
            .map(|t| Operand::broadcast(t.dtype(), t.shape(), shape))
            .collect::<Result<Vec<_>>>()?;
        let out = self.dev.alloc(out_ty.dtype, shape)?;
        let o = Operand::broadcast(out_ty.dtype, shape, shape)?;
        let mut p = EwParams::new(op, shape, &ops, &o)?;
        if let Some((s, lhs, d)) = scalar {
            p = p.with_scalar(s, lhs, d);
        }
        self.ew_launch(p, ins, &out)?;
        Ok(out)
    }

    /// Copies `x` to a new dense tensor of `dtype`: `dims` with element strides `strides` from
    /// offset `offset` of x.
    fn strided_copy(
        &self,
        x: &DevTensor,
        dims: &[usize],
        strides: Vec<i64>,
        offset: i64,
        dtype: Dtype,
    ) -> Result<DevTensor> {
        let out = self.dev.alloc(dtype, dims)?;
        let i = Operand {
            dtype: x.dtype(),
            strides,
            offset,
        };
        let o = Operand::broadcast(dtype, dims, dims)?;
        self.ew_launch(EwParams::new(EwOp::Copy, dims, &[i], &o)?, &[x], &out)?;
        Ok(out)
    }

    fn slice(
        &self,
        x: &DevTensor,
        axis: usize,
        start: usize,
        step: usize,
        out_shape: &[usize],
    ) -> Result<DevTensor> {
        let mut st = contiguous_strides(x.shape());
        let off = start as i64 * st[axis];
        st[axis] *= step as i64;
        self.strided_copy(x, out_shape, st, off, x.dtype())
    }

    fn split(&self, x: &DevTensor, axis: usize, sizes: &[usize]) -> Result<Slot> {
        let mut pieces = Vec::with_capacity(sizes.len());
        let mut start = 0;
        for &len in sizes {
            let mut s = x.shape().to_vec();
            s[axis] = len;
            pieces.push(self.slice(x, axis, start, 1, &s)?);
            start += len;
        }
        Ok(Slot::Tuple(pieces))
    }

    /// `y = x·wᵀ (+ b)`: f32 straight into y; bf16/f16 without bias straight into y (cuBLAS
    /// rounds the f32 accumulator once); with a bias through an f32 accumulator and one
    /// rounding after the add.
    fn linear(
        &self,
        x: &DevTensor,
        w: &DevTensor,
        b: Option<&DevTensor>,
        out_ty: &TensorType,
    ) -> Result<DevTensor> {
        let dev = self.dev;
        let k = *x.shape().last().unwrap_or(&1);
        let n = w.shape()[0];
        let rows = x.numel() / k.max(1);
        let dt = out_ty.dtype;
        let g = Gemm::linear(rows, k, n)?;
        let out = dev.alloc(dt, &out_ty.shape)?;
        if k == 0 {
            dev.memset_zero(&out)?;
        }
        let acc = if dt == Dtype::F32 || b.is_none() {
            if k > 0 {
                dev.gemm(
                    &g,
                    dev.ptr(w),
                    dev.ptr(x),
                    x.dtype(),
                    dev.ptr(&out),
                    dt,
                    self.f32_matmul,
                )?;
            }
            if b.is_none() {
                return Ok(out);
            }
            out.clone()
        } else {
            let acc = dev.alloc(Dtype::F32, &out_ty.shape)?;
            if k == 0 {
                dev.memset_zero(&acc)?;
            } else {
                dev.gemm(
                    &g,
                    dev.ptr(w),
                    dev.ptr(x),
                    x.dtype(),
                    dev.ptr(&acc),
                    Dtype::F32,
                    self.f32_matmul,
                )?;
            }
            acc
        };
        self.bias(&acc, b, rows, n, &out)?;
        Ok(out)
    }

    /// `out[r, c] = acc[r, c] + bias[c]` rounded to out's dtype (acc and out may alias).
    fn bias(
        &self,
        acc: &DevTensor,
        b: Option<&DevTensor>,
        rows: usize,
        n: usize,
        out: &DevTensor,
    ) -> Result<()> {
        let dev = self.dev;
        let (r, nn) = (rows as i64, n as i64);
        let has = i32::from(b.is_some());
        let db = b.map_or(0, |t| dtype_code(t.dtype()));
        let dout = dtype_code(out.dtype());
        let (pa, pb, po) = (dev.ptr(acc), b.map_or(0, |t| dev.ptr(t)), dev.ptr(out));
        dev.launch("pt_bias", Device::cfg_elems(rows * n), |bl| {
            bl.arg(&r).arg(&nn).arg(&has).arg(&db).arg(&dout);
            Device::push_u64(bl, &pa);
            Device::push_u64(bl, &pb);
            Device::push_u64(bl, &po);
        })
    }

    /// Batched matmul with broadcast batch dims, each operand read in place through its
    /// strides where the fusion plan found a view ([`crate::fuse::StridedView`]): one
    /// strided-batched GEMM when the batch offsets are uniform, else one GEMM a batch.
    /// Matmul `id`, its operands read through their views. With `into` (the type of the
    /// head-merging permute reading its `[1, H, Q, D]` result, [`Role::Transposed`]), the
    /// GEMMs write `[1, Q, H, D]` directly: a leading dimension of `H·D`, `D` between heads.
    fn matmul(
        &self,
        id: NodeId,
        slots: &[Slot],
        out_ty: &TensorType,
        into: Option<&TensorType>,
    ) -> Result<DevTensor> {
        if let Some(a) = self.fusion.attentions.get(&id) {
            return self.attend(a, slots, out_ty, into);
        }
        let dev = self.dev;
        let mut ops: Vec<(&DevTensor, MatOperand)> = Vec::with_capacity(2);
        for j in 0..2 {
            let (t, view) = self.in_place(id, j, slots)?;
            let m = match view {
                Some(w) => MatOperand::from_view(&w.shape, &w.strides)?,
                None => MatOperand::dense(t.shape())?,
            };
            ops.push((t, m));
        }
        let (ta, a) = (&ops[0].0, &ops[0].1);
        let (tb, b) = (&ops[1].0, &ops[1].1);
        let ob = &out_ty.shape[..out_ty.shape.len() - 2];
        let oa = a.batch_offsets(ob)?;
        let obb = b.batch_offsets(ob)?;
        let (m, k, n) = (a.rows, a.cols, b.cols);
        let nb = oa.len();
        let out = dev.alloc(out_ty.dtype, &into.unwrap_or(out_ty).shape)?;
        // Row stride and batch stride of the output (batches are heads when transposed).
        let (ldc, sc) = match into {
            Some(_) => (nb * n, n),
            None => (n, m * n),
        };
        if k == 0 {
            dev.memset_zero(&out)?;
            return Ok(out);
        }
        let es = ta.dtype().size() as u64;
        let os = out_ty.dtype.size() as u64;
        let (pa, pb, po) = (dev.ptr(ta), dev.ptr(tb), dev.ptr(&out));
        let mut g = crate::plan::matmul_gemm(a, b)?;
        g.ldc = i32::try_from(ldc).map_err(|_| err(format!("output row stride {ldc}")))?;
        let (sa, sb) = (
            oa.get(1).copied().unwrap_or(0),
            obb.get(1).copied().unwrap_or(0),
        );
        let uniform = nb > 0
            && oa.iter().enumerate().all(|(i, &x)| x == i as i64 * sa)
            && obb.iter().enumerate().all(|(i, &y)| y == i as i64 * sb);
        if uniform {
            let g = g.batched(nb, sb, sa, sc as i64)?;
            dev.gemm(&g, pb, pa, ta.dtype(), po, out_ty.dtype, self.f32_matmul)?;
        } else {
            for i in 0..nb {
                dev.gemm(
                    &g,
                    pb + obb[i] as u64 * es,
                    pa + oa[i] as u64 * es,
                    ta.dtype(),
                    po + (i * sc) as u64 * os,
                    out_ty.dtype,
                    self.f32_matmul,
                )?;
            }
        }
        Ok(out)
    }

    /// The bf16 attention `a` (run by its `p·v` matmul, [`crate::fuse::Attend`]): q, k and v read
    /// through the views the plan found ([`crate::fuse::Attend::q`]), the output written as
    /// `out_ty` or, with `into`, heads merged (`[B, Q, H, Dv]`).
    fn attend(
        &self,
        a: &crate::fuse::Attend,
        slots: &[Slot],
        out_ty: &TensorType,
        into: Option<&TensorType>,
    ) -> Result<DevTensor> {
        let dev = self.dev;
        let tensor = |n: NodeId| match &slots[n.index()] {
            Slot::T(t) => Ok(t),
            _ => Err(err(format!(
                "attention operand {n} is not an available tensor"
            ))),
        };
        // K and v from their two pieces (their views' layouts are the concats'), or whole.
        let [pk, pk1, pv, pv1] = match a.pieces {
            Some((kv, _)) => [
                dev.ptr(tensor(kv[0])?),
                dev.ptr(tensor(kv[1])?),
                dev.ptr(tensor(kv[2])?),
                dev.ptr(tensor(kv[3])?),
            ],
            None => {
                let (k, v) = (dev.ptr(tensor(a.k.base)?), dev.ptr(tensor(a.v.base)?));
                [k, k, v, v]
            }
        };
        let (q, k, v) = (&a.q, &a.k, &a.v);
        let mask = tensor(a.mask)?;
        let (h, nq) = (q.shape[1], q.shape[2]);
        let out = dev.alloc(out_ty.dtype, &into.unwrap_or(out_ty).shape)?;
        let o = head_strides(out_ty, into);
        let l = crate::plan::attention_launch(
            crate::plan::AttnShape {
                q: (&q.shape, &q.strides),
                k: (&k.shape, &k.strides),
                v: (&v.shape, &v.strides),
                mask: mask_strides(mask.shape(), h, nq),
                scale: a.scale,
                out: o,
                n0: a.pieces.map(|(_, n)| n),
            },
            self.dev.info().compute_capability,
        )?;
        let prm = &l.params;
        let (pq, pm) = (dev.ptr(tensor(q.base)?), dev.ptr(mask));
        if [pq, pk, pk1, pv, pv1].iter().any(|p| p % 16 != 0) {
            return Err(err("fused attention: q, k or v not 16-byte aligned"));
        }
        if out_ty.dtype != Dtype::Bf16 {
            return Err(err("fused attention: a bf16 result only"));
        }
        let [fl, fp, fc] = self
            .fusion
            .attention_kernels
            .map(|k| k.map(|i| &self.fused[i]))
            .ok_or_else(|| err("fused attention: its kernels were not compiled"))?;
        // Where the device grants the cluster kernel's shared memory (consumer GPUs give a
        // block less than an H200's 227 KiB): else the two launches.
        let shared = dev.info().max_shared_per_block;
        if let Some(cfg) = l
            .cluster
            .filter(|c| self.attention_cluster && c.shared_mem_bytes <= shared)
        {
            let po = dev.ptr(&out);
            dev.launch_cluster_fn(fc, cfg, Some(crate::plan::ATTN_CLUSTER), |bl| {
                bl.arg(prm);
                for p in [&pq, &pk, &pk1, &pv, &pv1, &pm, &po] {
                    Device::push_u64(bl, p);
                }
            })?;
            return Ok(out);
        }
        let scratch = dev.alloc(Dtype::F32, &[l.rows, prm.nk as usize])?;
        let stats = dev.alloc(Dtype::F32, &[l.rows, prm.splits as usize, 2])?;
        // Partial products of the key blocks (none with one block), and a counter a tile.
        let parts = if prm.splits2 > 1 {
            l.tiles * prm.splits2 as usize * 16 * prm.dv as usize
        } else {
            0
        };
        let part = dev.alloc(Dtype::F32, &[parts])?;
        let counters = dev.alloc(Dtype::I32, &[l.tiles])?;
        let (pl, ps, po) = (dev.ptr(&scratch), dev.ptr(&stats), dev.ptr(&out));
        let (pp, pc) = (dev.ptr(&part), dev.ptr(&counters));
        dev.launch_fn(fl, l.logits, |bl| {
            bl.arg(prm);
            for p in [&pq, &pk, &pk1, &pm, &pl, &ps, &pc] {
                Device::push_u64(bl, p);
            }
        })?;
        dev.launch_fn(fp, l.pv, |bl| {
            bl.arg(prm);
            for p in [&pl, &ps, &pv, &pv1, &pp, &pc, &po] {
                Device::push_u64(bl, p);
            }
        })?;
        Ok(out)
    }

    /// Convolution as im2col + one GEMM (f32 accumulator) + bias + a move to NCHW.
    fn conv2d(
        &self,
        x: &DevTensor,
        w: &DevTensor,
        b: Option<&DevTensor>,
        stride: [usize; 2],
        padding: [usize; 2],
        out_ty: &TensorType,
    ) -> Result<DevTensor> {
        let dev = self.dev;
        let (n, c, h, wd) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
        let (o, kh, kw) = (w.shape()[0], w.shape()[2], w.shape()[3]);
        let (oh, ow) = (out_ty.shape[2], out_ty.shape[3]);
        let kk = c * kh * kw;
        let rows = n * oh * ow;
        let cols = dev.alloc(x.dtype(), &[rows, kk])?;
        let prm = ConvParams {
            n: n as i64,
            c: c as i64,
            h: h as i64,
            w: wd as i64,
            kh: kh as i64,
            kw: kw as i64,
            oh: oh as i64,
            ow: ow as i64,
            sh: stride[0] as i64,
            sw: stride[1] as i64,
            ph: padding[0] as i64,
            pw: padding[1] as i64,
            dt: dtype_code(x.dtype()),
        };
        let (px, pc) = (dev.ptr(x), dev.ptr(&cols));
        dev.launch("pt_im2col", Device::cfg_elems(rows * kk), |bl| {
            bl.arg(&prm);
            Device::push_u64(bl, &px);
            Device::push_u64(bl, &pc);
        })?;
        let acc = dev.alloc(Dtype::F32, &[n, oh * ow, o])?;
        let g = Gemm::linear(rows, kk, o)?;
        dev.gemm(
            &g,
            dev.ptr(w),
            dev.ptr(&cols),
            x.dtype(),
            dev.ptr(&acc),
            Dtype::F32,
            self.f32_matmul,
        )?;
        self.bias(&acc, b, rows, o, &acc)?;
        // [N, OH·OW, O] → [N, O, OH, OW], rounded once to the output dtype.
        let dims = [n, o, oh, ow];
        let st = vec![(oh * ow * o) as i64, 1, (ow * o) as i64, o as i64];
        self.strided_copy(&acc, &dims, st, 0, out_ty.dtype)
    }

    fn norm(&self, id: NodeId, slots: &[Slot], out_ty: &TensorType) -> Result<DevTensor> {
        let dev = self.dev;
        let (prm, [px, pw, pb]) = self.norm_args(id, slots, out_ty.dtype)?;
        let out = dev.alloc(out_ty.dtype, &out_ty.shape)?;
        if prm.rows == 0 || prm.d == 0 {
            return Ok(out);
        }
        let po = dev.ptr(&out);
        dev.launch("pt_norm", Device::cfg_rows(prm.rows as usize)?, |bl| {
            bl.arg(&prm);
            Device::push_u64(bl, &px);
            Device::push_u64(bl, &pw);
            Device::push_u64(bl, &pb);
            Device::push_u64(bl, &po);
        })?;
        Ok(out)
    }

    fn softmax_rows(
        &self,
        x: &DevTensor,
        out: &DevTensor,
        rows: usize,
        n: usize,
        scale: (f32, Dtype),
        mask: Option<(&DevTensor, [i64; 6])>,
    ) -> Result<()> {
        if rows == 0 || n == 0 {
            return Ok(());
        }
        let dev = self.dev;
        let ms = mask.map_or([1, 1, 0, 0, 0, 0], |m| m.1);
        let prm = SoftmaxParams {
            rows: rows as i64,
            n: n as i64,
            dx: dtype_code(x.dtype()),
            dout: dtype_code(out.dtype()),
            has_mask: i32::from(mask.is_some()),
            dm: mask.map_or(0, |m| dtype_code(m.0.dtype())),
            scale: scale.0,
            dscale: dtype_code(scale.1),
            h: ms[0],
            q: ms[1],
            msb: ms[2],
            msh: ms[3],
            msq: ms[4],
            msk: ms[5],
        };
        let (px, pm, po) = (dev.ptr(x), mask.map_or(0, |m| dev.ptr(m.0)), dev.ptr(out));
        dev.launch("pt_softmax", Device::cfg_rows(rows)?, |bl| {
            bl.arg(&prm);
            Device::push_u64(bl, &px);
            Device::push_u64(bl, &pm);
            Device::push_u64(bl, &po);
        })
    }

    /// Softmax node `sm` of `x`, with the mask the fusion plan folded into it, if any
    /// ([`Fusion::masks`]: rank 4, last axis).
    fn softmax_node(
        &self,
        sm: NodeId,
        axis: usize,
        x: &DevTensor,
        slots: &[Slot],
        out_ty: &TensorType,
    ) -> Result<DevTensor> {
        let Some(f) = self.fusion.masks.get(&sm) else {
            return self.softmax(x, axis, out_ty);
        };
        let Slot::T(mt) = &slots[f.mask.index()] else {
            return Err(err(format!("mask {} is not an available tensor", f.mask)));
        };
        let s = x.shape();
        let out = self.dev.alloc(out_ty.dtype, &out_ty.shape)?;
        let strides = mask_strides(mt.shape(), s[1], s[2]);
        let scale = f.scale.unwrap_or((1.0, Dtype::F32));
        self.softmax_rows(
            x,
            &out,
            s[0] * s[1] * s[2],
            s[3],
            scale,
            Some((mt, strides)),
        )?;
        Ok(out)
    }

    fn softmax(&self, x: &DevTensor, axis: usize, out_ty: &TensorType) -> Result<DevTensor> {
        let s = x.shape();
        let r = s.len();
        if axis + 1 == r {
            let out = self.dev.alloc(out_ty.dtype, &out_ty.shape)?;
            let n = s[r - 1];
            self.softmax_rows(x, &out, x.numel() / n.max(1), n, (1.0, Dtype::F32), None)?;
            return Ok(out);
        }
        // Move the axis last, softmax, move it back.
        let mut perm: Vec<usize> = (0..r).filter(|&d| d != axis).collect();
        perm.push(axis);
        let xs = contiguous_strides(s);
        let pdims: Vec<usize> = perm.iter().map(|&d| s[d]).collect();
        let moved = self.strided_copy(
            x,
            &pdims,
            perm.iter().map(|&d| xs[d]).collect(),
            0,
            x.dtype(),
        )?;
        let n = s[axis];
        self.softmax_rows(
            &moved,
            &moved,
            moved.numel() / n.max(1),
            n,
            (1.0, Dtype::F32),
            None,
        )?;
        let mut inv = vec![0; r];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        let ms = contiguous_strides(&pdims);
        self.strided_copy(
            &moved,
            s,
            inv.iter().map(|&i| ms[i]).collect(),
            0,
            out_ty.dtype,
        )
    }

    /// `softmax(q·kᵀ·scale + mask)·v` in f32: logits by one cuBLAS GEMM (f32 out), the scaled,
    /// masked softmax in place, v widened to f32, the second GEMM in f32. q, k and v are read
    /// where they lie (heads split out of a projection through [`Fusion::views`]) when one head
    /// a batch reaches them ([`attention_gemms_per_head`]), else made dense first. With `into`
    /// ([`Role::Transposed`]) the result is written as `[1, Q, H, Dv]`.
    fn attention(
        &self,
        id: NodeId,
        scale: f32,
        slots: &[Slot],
        out_ty: &TensorType,
        into: Option<&TensorType>,
    ) -> Result<DevTensor> {
        let node = self.program.node(id);
        // Each operand: its buffer, shape and element strides.
        let mut ops: Vec<(&DevTensor, Vec<usize>, Vec<i64>)> = Vec::with_capacity(4);
        for j in 0..node.inputs.len() {
            let (t, view) = self.in_place(id, j, slots)?;
            ops.push(match view {
                Some(w) => (t, w.shape.clone(), w.strides.clone()),
                None => (t, t.shape().to_vec(), contiguous_strides(t.shape())),
            });
        }
        let (b, h, nq, d) = (ops[0].1[0], ops[0].1[1], ops[0].1[2], ops[0].1[3]);
        let (kvh, nk) = (ops[1].1[1], ops[1].1[2]);
        let dv = ops[2].1[3];
        let dims = [b, h, nq, nk];
        let mask = ops.get(3).map(|(t, ..)| *t);
        if mask.is_none()
            && self.tf32_attention
            && self.f32_matmul == F32Matmul::Tf32
            && out_ty.dtype == Dtype::F32
            && ops[..3]
                .iter()
                .all(|o| o.0.dtype() == Dtype::F32 && o.2.len() == 4 && o.2[3] == 1)
            && let Some(out) =
                self.tf32_attention_run(&ops, [b, h, kvh, nq, nk, d, dv], scale, out_ty, into)?
        {
            return Ok(out);
        }
        let is_dense = |(t, s, st): &(&DevTensor, Vec<usize>, Vec<i64>)| {
            t.shape() == s.as_slice() && *st == contiguous_strides(s)
        };
        let dense = ops[..3].iter().all(is_dense);
        let dense_layout = |rows: usize, cols: usize| HeadLayout {
            ld: cols as i64,
            head: (rows * cols) as i64,
        };
        // The f32 PV product is the result when the result is f32: written merged (`into`) or
        // dense. A 16-bit result is converted (and moved) from a dense f32 product.
        let direct = out_ty.dtype == Dtype::F32;
        let lo = match into {
            Some(_) if direct => HeadLayout {
                ld: (h * dv) as i64,
                head: dv as i64,
            },
            _ => dense_layout(nq, dv),
        };
        let layout = |st: &[i64]| HeadLayout {
            ld: st[2],
            head: st[1],
        };
        // v's GEMM reads f32: a 16-bit v is widened into a dense copy first.
        let v16 = ops[2].0.dtype() != Dtype::F32;
        let per_head = if !dense || into.is_some() {
            let lv = if v16 {
                dense_layout(nk, dv)
            } else {
                layout(&ops[2].2)
            };
            attention_gemms_per_head(
                h,
                kvh,
                nq,
                nk,
                d,
                dv,
                [layout(&ops[0].2), layout(&ops[1].2), lv, lo],
            )?
        } else {
            None
        };
        let merged = into.is_some() && direct;
        let (q, k, v, gemms, batches) = match per_head {
            Some(g) => {
                let v = if v16 {
                    self.strided_copy(ops[2].0, &ops[2].1, ops[2].2.clone(), 0, Dtype::F32)?
                } else {
                    ops[2].0.clone()
                };
                // One head a GEMM batch, the B batches one after another.
                let vb = if v16 {
                    (kvh * nk * dv) as i64
                } else {
                    ops[2].2[0]
                };
                // A batch's output is H·Q·Dv elements, heads merged or not.
                let ob = (h * nq * dv) as i64;
                let batches = (b, [ops[0].2[0], ops[1].2[0], vb, ob]);
                (ops[0].0.clone(), ops[1].0.clone(), v, g, batches)
            }
            None => {
                // Dense operands, the `H / KVH` query heads of a KV head as one block.
                let dense_of = |o: &(&DevTensor, Vec<usize>, Vec<i64>)| -> Result<DevTensor> {
                    if is_dense(o) {
                        Ok(o.0.clone())
                    } else {
                        self.strided_copy(o.0, &o.1, o.2.clone(), 0, o.0.dtype())
                    }
                };
                let g = attention_gemms(b, h, kvh, nq, nk, d, dv)?;
                (
                    dense_of(&ops[0])?,
                    dense_of(&ops[1])?,
                    dense_of(&ops[2])?,
                    g,
                    (1, [0; 4]),
                )
            }
        };
        let merged = merged && per_head.is_some();
        let shape = if merged {
            into.map_or(&out_ty.shape, |t| &t.shape)
        } else {
            &out_ty.shape
        };
        let out32 = self.attention_run(&q, &k, &v, dims, gemms, batches, mask, scale, shape)?;
        if direct && (merged || into.is_none()) {
            return Ok(out32);
        }
        let os = contiguous_strides(&out_ty.shape);
        let (to, st) = match into {
            Some(t) => (t, vec![os[0], os[2], os[1], os[3]]),
            None => (out_ty, os),
        };
        self.strided_copy(&out32, &to.shape, st, 0, to.dtype)
    }

    /// `pt_attn_tf32` over f32 operands (their buffers, shapes and strides) where it applies,
    /// writing the f32 result in the `[B, H, Q, Dv]` layout or, with `into`, the heads merged
    /// (`[B, Q, H, Dv]`); `None` where it does not apply.
    fn tf32_attention_run(
        &self,
        ops: &[(&DevTensor, Vec<usize>, Vec<i64>)],
        dims: [usize; 7],
        scale: f32,
        out_ty: &TensorType,
        into: Option<&TensorType>,
    ) -> Result<Option<DevTensor>> {
        let st = |j: usize| [ops[j].2[0], ops[j].2[1], ops[j].2[2]];
        let Some((prm, cfg)) = crate::plan::tf32_attention_launch(
            dims,
            st(0),
            st(1),
            st(2),
            head_strides(out_ty, into),
            scale,
            self.dev.info().max_shared_per_block as usize,
        ) else {
            return Ok(None);
        };
        let dev = self.dev;
        let [pq, pk, pv] = [0, 1, 2].map(|j| dev.ptr(ops[j].0));
        // q, K and v are staged 16 bytes a copy.
        if [pq, pk, pv].iter().any(|p| p % 16 != 0) {
            return Ok(None);
        }
        let out = dev.alloc(Dtype::F32, &into.unwrap_or(out_ty).shape)?;
        let po = dev.ptr(&out);
        let f = dev.func("pt_attn_tf32")?;
        dev.launch_cluster_fn(f, cfg, None, |bl| {
            bl.arg(&prm);
            for p in [&pq, &pk, &pv, &po] {
                Device::push_u64(bl, p);
            }
        })?;
        Ok(Some(out))
    }

    /// Attention's GEMMs and softmax over `dims` `[B, H, Q, K]`: f32 logits from q and k, the
    /// scaled, masked softmax in place, then the PV GEMM (v widened to f32 when it is not) into
    /// a new f32 tensor of `out_shape` (laid out as `gpv` writes it). `(n, [q, k, v, out])`:
    /// the GEMMs run `n` times, stepping each operand by its element stride (the logits are
    /// dense): `n` is 1 where the GEMMs batch over B themselves.
    #[allow(clippy::too_many_arguments)]
    fn attention_run(
        &self,
        q: &DevTensor,
        k: &DevTensor,
        v: &DevTensor,
        [b, h, nq, nk]: [usize; 4],
        (gl, gpv): (Gemm, Gemm),
        (loops, [sq, sk, sv, so]): (usize, [i64; 4]),
        mask: Option<&DevTensor>,
        scale: f32,
        out_shape: &[usize],
    ) -> Result<DevTensor> {
        let dev = self.dev;
        let logits = dev.alloc(Dtype::F32, &[b, h, nq, nk])?;
        // Logits elements a run (the logits are dense).
        let per_run = (b / loops.max(1) * h * nq * nk) as i64;
        if gl.k == 0 {
            dev.memset_zero(&logits)?;
        } else {
            dev.gemm_loops(
                &gl,
                [dev.ptr(k), dev.ptr(q), dev.ptr(&logits)],
                q.dtype(),
                Dtype::F32,
                self.f32_matmul,
                loops,
                [sk, sq, per_run],
            )?;
        }
        let m = mask.map(|mt| (mt, mask_strides(mt.shape(), h, nq)));
        self.softmax_rows(&logits, &logits, b * h * nq, nk, (scale, Dtype::F32), m)?;
        let v32 = if v.dtype() == Dtype::F32 {
            v.clone()
        } else {
            self.strided_copy(v, v.shape(), contiguous_strides(v.shape()), 0, Dtype::F32)?
        };
        let out32 = dev.alloc(Dtype::F32, out_shape)?;
        if nk == 0 {
            dev.memset_zero(&out32)?;
        } else {
            dev.gemm_loops(
                &gpv,
                [dev.ptr(&v32), dev.ptr(&logits), dev.ptr(&out32)],
                Dtype::F32,
                Dtype::F32,
                self.f32_matmul,
                loops,
                [sv, per_run, so],
            )?;
        }
        Ok(out32)
    }

    /// Reduction over `axes`: those axes moved last (a copy unless they already are), then one
    /// block a row.
    fn reduce(
        &self,
        x: &DevTensor,
        kind: ReduceOp,
        axes: &[usize],
        out_ty: &TensorType,
    ) -> Result<DevTensor> {
        let s = x.shape();
        let r = s.len();
        let mut perm: Vec<usize> = (0..r).filter(|d| !axes.contains(d)).collect();
        perm.extend_from_slice(axes);
        let n: usize = axes.iter().map(|&a| s[a]).product();
        let rows: usize = perm[..r - axes.len()].iter().map(|&d| s[d]).product();
        if n == 0 && kind == ReduceOp::Max {
            return Err(err("max over an empty axis"));
        }
        let moved = if perm.iter().enumerate().all(|(i, &p)| i == p) {
            x.clone()
        } else {
            let xs = contiguous_strides(s);
            let pdims: Vec<usize> = perm.iter().map(|&d| s[d]).collect();
            self.strided_copy(
                x,
                &pdims,
                perm.iter().map(|&d| xs[d]).collect(),
                0,
                x.dtype(),
            )?
        };
        let out = self.dev.alloc(out_ty.dtype, &out_ty.shape)?;
        if rows == 0 {
            return Ok(out);
        }
        let kind = match kind {
            ReduceOp::Sum => 0i32,
            ReduceOp::Mean => 1,
            ReduceOp::Max => 2,
        };
        let (rr, nn, d) = (rows as i64, n as i64, dtype_code(x.dtype()));
        let dev = self.dev;
        let (px, po) = (dev.ptr(&moved), dev.ptr(&out));
        dev.launch("pt_reduce", Device::cfg_rows(rows)?, |bl| {
            bl.arg(&rr).arg(&nn).arg(&kind).arg(&d);
            Device::push_u64(bl, &px);
            Device::push_u64(bl, &po);
        })?;
        Ok(out)
    }
}
