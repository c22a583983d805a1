//! Weight-only quantization as a rewrite of a program (issue 51): a chosen float weight `W`
//! becomes its codes (`Weight W` in `i8` or `f8e4m3`), its per-row scales (`Weight
//! W.qscale`, f32) and a [`Op::Dequantize`] back to W's dtype, which every former reader of W
//! now reads. The program says exactly what an engine stores and computes, so a backend either
//! lowers the dequantize (ONNX `DequantizeLinear`, the reference executor) or refuses it by
//! node; the weight source must hold the codes and scales under these names (petite-weights'
//! converter writes them, computed row by row while streaming the f32 checkpoint).

use crate::dtype::{Dtype, TensorType, ValueType};
use crate::error::{Error, Result};
use crate::node::NodeId;
use crate::op::Op;
use crate::program::{Node, Program, WeightInfo};

pub use petite_dtype::quant::{Quant, SCALE_SUFFIX, scale_name, scaled_weight};

/// What [`quantize_weights`] did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Quantized {
    /// The checkpoint names quantized (each once, in node order).
    pub names: Vec<String>,
    /// Bytes of the weights as declared before (their float dtype).
    pub bytes_before: usize,
    /// Bytes of their codes and scales after.
    pub bytes_after: usize,
}

/// Rewrites every float `Weight` node of rank ≥ 1 for which `select` is true into codes of
/// `quant`, scales and a dequantize to its declared dtype (see the module doc). Row ranges stay
/// row ranges of both codes and scales. Node order stays topological (the three nodes take the
/// weight's place); labels carry over. A weight whose scale name is already a weight of the
/// program is refused, naming it.
pub fn quantize_weights(
    program: &Program,
    quant: Quant,
    mut select: impl FnMut(&WeightInfo) -> bool,
) -> Result<(Program, Quantized)> {
    let infos = program.weights();
    let taken: std::collections::BTreeSet<&str> = infos.iter().map(|w| w.name.as_str()).collect();
    let mut chosen = vec![false; program.len()];
    let mut done = Quantized::default();
    for w in &infos {
        if !w.dtype.is_float() || w.shape.is_empty() || !select(w) {
            continue;
        }
        let scale = scale_name(&w.name);
        if taken.contains(scale.as_str()) {
            return Err(Error::InvalidNode {
                node: program.describe(w.node),
                reason: format!(
                    "cannot quantize `{}`: its scale tensor name `{scale}` is already a weight",
                    w.name
                ),
            });
        }
        chosen[w.node.index()] = true;
        if !done.names.contains(&w.name) {
            done.names.push(w.name.clone());
        }
        let rows = w.shape[0];
        done.bytes_before += w.bytes;
        done.bytes_after += w.bytes / w.dtype.size() + rows * 4;
    }
    let mut out = Program::new();
    let mut map: Vec<NodeId> = Vec::with_capacity(program.len());
    let push = |out: &mut Program, n: Node| -> NodeId {
        out.nodes.push(n);
        NodeId(out.nodes.len() as u32 - 1)
    };
    for id in program.ids() {
        let n = program.node(id);
        let new = match (&n.op, n.tensor()) {
            (Op::Weight { name, rows }, Some(t)) if chosen[id.index()] => {
                let codes = push(
                    &mut out,
                    Node {
                        op: Op::Weight {
                            name: name.clone(),
                            rows: *rows,
                        },
                        inputs: Vec::new(),
                        ty: ValueType::Tensor(TensorType {
                            dtype: Dtype::of_quant(quant),
                            shape: t.shape.clone(),
                        }),
                        label: n.label.clone(),
                        recompute: false,
                    },
                );
                let scale = push(
                    &mut out,
                    Node {
                        op: Op::Weight {
                            name: scale_name(name),
                            rows: *rows,
                        },
                        inputs: Vec::new(),
                        ty: ValueType::Tensor(TensorType {
                            dtype: Dtype::F32,
                            shape: vec![t.shape[0]],
                        }),
                        label: n.label.as_ref().map(|l| format!("{l}.qscale")),
                        recompute: false,
                    },
                );
                push(
                    &mut out,
                    Node {
                        op: Op::Dequantize { to: t.dtype },
                        inputs: vec![codes, scale],
                        ty: n.ty.clone(),
                        label: n.label.clone(),
                        recompute: false,
                    },
                )
            }
            _ => {
                let mut c = n.clone();
                for v in &mut c.inputs {
                    *v = map[v.index()];
                }
                push(&mut out, c)
            }
        };
        map.push(new);
    }
    out.inputs = program.inputs.iter().map(|i| map[i.index()]).collect();
    out.outputs = program.outputs.clone();
    for o in &mut out.outputs {
        o.value = map[o.value.index()];
    }
    out.validate()?;
    Ok((out, done))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Builder;

    fn linear_program() -> Program {
        let mut b = Builder::new();
        let x = b.input("x", Dtype::Bf16, &[2, 4]).unwrap();
        let w = b.weight("l.weight", Dtype::Bf16, &[3, 4]).unwrap();
        let n = b.weight("norm.weight", Dtype::Bf16, &[3]).unwrap();
        let y = b.linear(x, w, None).unwrap();
        let y = b.mul(y, n).unwrap();
        b.output("y", y).unwrap();
        b.finish().unwrap()
    }

    #[test]
    fn rewrites_the_chosen_weights_only() {
        let p = linear_program();
        let (q, done) =
            quantize_weights(&p, Quant::Int8, |w| w.name.ends_with("l.weight")).unwrap();
        assert_eq!(done.names, ["l.weight"]);
        assert_eq!((done.bytes_before, done.bytes_after), (24, 12 + 12));
        let ws = q.weights();
        let find = |n: &str| ws.iter().find(|w| w.name == n).unwrap();
        assert_eq!(find("l.weight").dtype, Dtype::I8);
        assert_eq!(find("l.weight.qscale").dtype, Dtype::F32);
        assert_eq!(find("l.weight.qscale").shape, [3]);
        assert_eq!(find("norm.weight").dtype, Dtype::Bf16);
        assert_eq!(q.len(), p.len() + 2);
        assert!(
            q.nodes
                .iter()
                .any(|n| n.op == Op::Dequantize { to: Dtype::Bf16 })
        );
        // The JSON of a program with no quantized weight is unchanged by the pass.
        let (same, none) = quantize_weights(&p, Quant::Fp8E4M3, |_| false).unwrap();
        assert_eq!(same.to_json().unwrap(), p.to_json().unwrap());
        assert!(none.names.is_empty());
    }

    #[test]
    fn codes_are_read_only_by_dequantize() {
        let p = linear_program();
        let (mut q, _) = quantize_weights(&p, Quant::Int8, |w| w.name == "l.weight").unwrap();
        // Point the linear at the codes directly: validation names the linear.
        let codes = q
            .ids()
            .find(|&id| q.node(id).tensor().is_some_and(|t| t.dtype == Dtype::I8))
            .unwrap();
        let lin = q.ids().find(|&id| q.node(id).op == Op::Linear).unwrap();
        q.nodes[lin.index()].inputs[1] = codes;
        let e = q.validate().unwrap_err().to_string();
        assert!(e.contains("read only by dequantize"), "{e}");
        assert!(e.contains("linear"), "{e}");
    }

    #[test]
    fn a_taken_scale_name_is_refused() {
        let mut b = Builder::new();
        let x = b.input("x", Dtype::F32, &[4]).unwrap();
        let w = b.weight("w", Dtype::F32, &[4]).unwrap();
        let s = b.weight("w.qscale", Dtype::F32, &[4]).unwrap();
        let y = b.mul(x, w).unwrap();
        let y = b.mul(y, s).unwrap();
        b.output("y", y).unwrap();
        let p = b.finish().unwrap();
        let e = quantize_weights(&p, Quant::Int8, |w| w.name == "w")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`w.qscale` is already a weight"), "{e}");
    }
}
