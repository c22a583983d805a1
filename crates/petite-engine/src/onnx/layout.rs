//! Layout ops: concat, slice, reshape, permute, expand, split and its items.

use super::*;

impl Emitter<'_> {
    /// Layout ops: the node `id` (op `op`) as ONNX nodes.
    pub(super) fn emit_layout(&mut self, id: NodeId, op: &Op) -> Result<()> {
        let n = self.p.node(id);
        match op {
            Op::Concat { axis } => {
                let ins: Vec<String> = (0..n.inputs.len()).map(|i| self.input(id, i)).collect();
                let refs: Vec<&str> = ins.iter().map(String::as_str).collect();
                let y = self.op("Concat", &refs, vec![("axis", Attr::I(*axis as i64))]);
                self.finish_native(id, &y);
            }
            Op::Slice {
                axis,
                start,
                end,
                step,
            } => {
                let x = self.input(id, 0);
                let s = self.const_i64(&[*start as i64]);
                let e = self.const_i64(&[*end as i64]);
                let a = self.const_i64(&[*axis as i64]);
                let st = self.const_i64(&[*step as i64]);
                let y = self.op("Slice", &[&x, &s, &e, &a, &st], vec![]);
                self.finish_native(id, &y);
            }
            Op::Reshape { shape } => {
                let x = self.input(id, 0);
                let s = self.const_i64(&dims(shape));
                let y = self.op("Reshape", &[&x, &s], vec![]);
                self.finish_native(id, &y);
            }
            Op::Permute { perm } => {
                let x = self.input(id, 0);
                let perm = perm.iter().map(|&p| p as i64).collect();
                let y = self.op("Transpose", &[&x], vec![("perm", Attr::Ints(perm))]);
                self.finish_native(id, &y);
            }
            Op::Expand { shape } => {
                let x = self.input(id, 0);
                let s = self.const_i64(&dims(shape));
                let y = self.op("Expand", &[&x, &s], vec![]);
                self.finish_native(id, &y);
            }
            Op::Split { axis, sizes } => {
                let x = self.input(id, 0);
                let s = self.const_i64(&sizes.iter().map(|&v| v as i64).collect::<Vec<_>>());
                let outs: Vec<String> = (0..sizes.len())
                    .map(|i| format!("{}_{i}", self.names[id.index()]))
                    .collect();
                let refs: Vec<&str> = outs.iter().map(String::as_str).collect();
                self.node(
                    "Split",
                    &[&x, &s],
                    &refs,
                    vec![("axis", Attr::I(*axis as i64))],
                );
            }
            Op::GetItem { index } => {
                let src = format!("{}_{index}", self.input(id, 0));
                self.finish_native(id, &src);
            }
            other => unreachable!("{} is not a layout op", other.name()),
        }
        Ok(())
    }
}
