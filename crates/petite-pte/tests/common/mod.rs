//! Shared by the integration tests: the samples' model rebuilt from its documented facts.
#![allow(dead_code)]

use petite_pte::model::*;
use petite_pte::{MethodBuilder, ProgramBuilder};

/// The samples' pytree specs (from `tiny_linear.flatc.json`).
pub const INP_SPEC: &str = "[1, {\"type\": \"builtins.tuple\", \"context\": \"null\", \"children_spec\": [{\"type\": \"builtins.tuple\", \"context\": \"null\", \"children_spec\": [{\"type\": null, \"context\": null, \"children_spec\": []}]}, {\"type\": \"builtins.dict\", \"context\": \"[]\", \"children_spec\": []}]}]";
/// Output spec.
pub const OUT_SPEC: &str = "[1, {\"type\": null, \"context\": null, \"children_spec\": []}]";

/// Little-endian f32 bytes.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// w = arange(12).reshape(3,4)/10, b = [1, -1, 0.5, 2] (samples README).
pub fn weights() -> (Vec<u8>, Vec<u8>) {
    let w: Vec<f32> = (0..12).map(|i| i as f32 / 10.0).collect();
    (f32_bytes(&w), f32_bytes(&[1.0, -1.0, 0.5, 2.0]))
}

/// A float tensor with EXIR's `requires_grad` flag.
pub fn tensor(sizes: &[i32], requires_grad: bool) -> Tensor {
    let mut t = Tensor::new(ScalarType::FLOAT, sizes);
    t.requires_grad = requires_grad;
    t
}

/// A float tensor in planned buffer 1.
pub fn planned(sizes: &[i32], requires_grad: bool, offset: u64) -> Tensor {
    let mut t = tensor(sizes, requires_grad);
    t.allocation_info = Some(AllocationDetails {
        memory_id: 1,
        memory_offset: offset,
    });
    t
}

/// `tiny_linear.pte` rebuilt from the facts in the samples README and §2.5 of the format doc.
pub fn rebuild_tiny_linear() -> ProgramBuilder {
    let (w, b) = weights();
    let mut pb = ProgramBuilder::new();
    let wi = pb.add_constant(&w);
    let bi = pb.add_constant(&b);
    let mut m = MethodBuilder::new("forward");
    m.container_meta(INP_SPEC, OUT_SPEC);
    let mut wt = tensor(&[3, 4], true);
    wt.data_buffer_idx = wi;
    let w = m.tensor(wt);
    let mut bt = tensor(&[4], true);
    bt.data_buffer_idx = bi;
    let b = m.tensor(bt);
    let x = m.tensor(planned(&[2, 3], false, 0));
    let mm = m.tensor(planned(&[2, 4], true, 32));
    let out = m.tensor(planned(&[2, 4], true, 0));
    let alpha = m.int(1);
    m.kernel_call("aten::mm", "out", &[x, w, mm, mm]);
    m.kernel_call("aten::add", "out", &[mm, b, alpha, out, out]);
    m.inputs(&[x]);
    m.outputs(&[out]);
    m.set_planned_buffers(&[64]);
    pb.add_method(m).unwrap();
    pb
}
