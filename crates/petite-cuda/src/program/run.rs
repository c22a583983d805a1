//! Running a program: inputs bound, nodes evaluated in order, values freed after their last
//! reader, outputs returned (on the host or the device), and the per-node profile.

use std::collections::BTreeMap;

use petite_graph::{Dtype, NodeId, Op, ShapeDisplay, ValueType};
use petite_reference::Tensor;

use super::{DeviceProgram, Slot, err};
use crate::device::DevTensor;
use crate::fuse::Role;
use crate::{Error, Result};

fn type_dtype(t: &ValueType) -> &'static str {
    match t {
        ValueType::Tensor(t) => t.dtype.name(),
        ValueType::Tuple(_) => "tuple",
    }
}

impl<'d> DeviceProgram<'d> {
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
                        | Role::WeightOnly
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
        if self.dev.settings().profile == crate::Profile::Nodes {
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
}
