//! Loading a program: validation and order, the fusion plan and sibling linears, the fused and
//! attention modules compiled beside the weights' upload.

use std::collections::HashMap;

use petite_graph::{Dtype, NodeId, Op, Program, ShapeDisplay};
use petite_weights::WeightSource;

use super::{DeviceProgram, err};
use crate::Result;
use crate::device::{DevTensor, Device, F32Matmul};
use crate::fuse::{Fusion, Role};

impl<'d> DeviceProgram<'d> {
    /// Validates `program`, orders it, and uploads every weight it reads from `weights` (in
    /// the declared dtype, rows only for a row range) and every constant. With `release`, each
    /// weight's host pages are given back once it is on the device. Fuses as the device's
    /// [`crate::Tuning`] says ([`crate::fuse::Options::for_device`]: bf16 attentions of few
    /// queries fused on sm_90 and later).
    pub fn load(
        dev: &'d Device,
        program: &Program,
        weights: &dyn WeightSource,
        release: bool,
    ) -> Result<Self> {
        let options =
            crate::fuse::Options::for_device(dev.info().compute_capability, &dev.settings().tuning);
        Self::load_with(dev, program, weights, release, options)
    }

    /// [`DeviceProgram::load`] planning fusion with `options` (whether to fuse at all is still
    /// the device's [`crate::Tuning::fuse`]).
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
        let fusing = dev.settings().tuning.fuse;
        let fusion = if fusing {
            // The fused attention's and `pt_wq_gemm`'s products are bf16 `mma.sync`, sm_80
            // and later, whatever the caller's options.
            let mma = dev.info().compute_capability.0 >= 8;
            crate::fuse::plan_opts(
                program,
                &live,
                &is_output,
                crate::fuse::Options {
                    attention_queries: if mma { options.attention_queries } else { 0 },
                    weight_only: options.weight_only && mma,
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
                // that runs a transposed product the product's, a linear reading codes
                // itself the dequantize's (codes and scales).
                Role::Plain => operands(i)
                    .into_iter()
                    .flat_map(|v| match fusion.role[v.index()] {
                        Role::Narrowed | Role::Transposed | Role::WeightOnly => operands(v.index()),
                        _ => vec![v],
                    })
                    .collect(),
                Role::Inlined
                | Role::View
                | Role::Narrowed
                | Role::Transposed
                | Role::Prologue
                | Role::Attended
                | Role::WeightOnly => Vec::new(),
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
        let siblings = if fusing {
            crate::fuse::siblings(program, &live)
        } else {
            Vec::new()
        };
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
        let settings = dev.settings();
        let t_up = std::time::Instant::now();
        let attention_at = fusion
            .attention_kernels
            .map_or(fusion.kernels.len(), |[a, ..]| a);
        let (own, attention) = fusion.kernels.split_at(attention_at);
        let attention_source = (!attention.is_empty()).then(crate::source::attention_module_source);
        let (compiled, compiled_attention) = std::thread::scope(|s| -> Result<_> {
            let compiling = (!own.is_empty())
                .then(|| s.spawn(|| crate::device::compile_fused(cc, &fusion.source, settings)));
            let compiling_attention = attention_source
                .as_deref()
                .map(|src| s.spawn(move || crate::device::compile_fused(cc, src, settings)));
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
        dev.trace(format_args!(
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
        dev.trace(format_args!(
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
            profile: dev.settings().profile != crate::Profile::Off,
            siblings,
            sibling_of,
            merged,
            f32_matmul: F32Matmul::Exact,
            attention_cluster: true,
            tf32_attention: true,
        })
    }
}
