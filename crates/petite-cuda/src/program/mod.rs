//! [`DeviceProgram`]: one petite-graph program with its weights on the device, run node by node
//! on the device's stream.
//!
//! By concept: `load` plans fusion, compiles the fused kernels and uploads the weights; `run`
//! runs the program (slots, frees, profiles), `eval` dispatches one node, `fused` launches
//! fused groups and sibling linears, `ops` the module's elementwise, layout, norm, softmax and
//! reduction kernels, `gemm` the cuBLAS products, `attention` the attentions. Here: the
//! program's state, and its setters and getters.

use std::collections::HashMap;

use petite_graph::{NodeId, Program};

use crate::Error;
use crate::device::{DevTensor, Device, F32Matmul};
#[cfg(doc)]
use crate::fuse::Role;
use crate::fuse::{Fusion, Siblings};

mod attention;
mod eval;
mod fused;
mod gemm;
mod load;
mod ops;
mod run;

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
    /// Per-node timing ([`crate::Settings::profile`] not off), fixed at load.
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

fn err(msg: impl Into<String>) -> Error {
    Error::Plan(msg.into())
}

impl<'d> DeviceProgram<'d> {
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
    /// default (pi0.5's ten steps 13.74 → 11.97 ms on the H200, session 20 of
    /// docs/MEASUREMENTS.md); off here to compare. Both give the same roundings; only the dot
    /// products' summation orders differ.
    pub fn set_attention_cluster(&mut self, on: bool) {
        self.attention_cluster = on;
    }

    /// Whether an f32 attention without a mask (pi0.5's SigLIP), where the program's f32
    /// products run as TF32 ([`DeviceProgram::set_f32_matmul`]), runs as one launch
    /// (`pt_attn_tf32`: flash-attention's order, no logits in memory;
    /// [`crate::plan::tf32_attention_launch`]) or as its GEMMs and a softmax. On by default
    /// (a full-size chunk 25.50 → 25.02 ms on the H200, session 24 of docs/MEASUREMENTS.md);
    /// off here to compare. Exact f32 products always take the GEMMs.
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
}
