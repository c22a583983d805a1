//! Code generation: one fused group's kernel body as CUDA C ([`Gen`]), each op computed with
//! the shared prelude's device functions and rounded to its dtype, as `pt_ew` computes it.

use std::collections::HashMap;
use std::fmt::Write as _;

use petite_graph::{Dtype, NodeId, Op, Program};

#[cfg(doc)]
use super::{Fusion, Group, Options, Role};
use super::{StridedView, read_from};
use crate::plan::contiguous_strides;
use crate::source::EwOp;
use crate::{Error, Result};

/// One group's generated kernel body and what its launch passes: the values it reads (in
/// parameter order), the prologue norm it computes (if any) and its slice starts.
#[derive(Clone)]
pub(super) struct Generated {
    pub(super) body: String,
    pub(super) leaves: Vec<NodeId>,
    pub(super) prologue: Option<NodeId>,
    pub(super) offsets: Vec<i64>,
}

/// C type of a value held in registers: floats as `float` (already rounded to their dtype),
/// integers and bools as `i64` (the stored value).
fn is_f(d: Dtype) -> bool {
    d.is_float()
}

fn dt_macro(d: Dtype) -> &'static str {
    match d {
        Dtype::F32 => "DT_F32",
        Dtype::Bf16 => "DT_BF16",
        Dtype::F16 => "DT_F16",
        Dtype::I64 => "DT_I64",
        Dtype::I32 => "DT_I32",
        Dtype::U8 => "DT_U8",
        Dtype::Bool => "DT_BOOL",
    }
}

/// `ldf` of a register value of dtype `d`.
fn as_f(v: &str, d: Dtype) -> String {
    if is_f(d) {
        v.to_string()
    } else {
        format!("((float){v})")
    }
}

/// `ldi` of a register value of dtype `d`.
fn as_i(v: &str, d: Dtype) -> String {
    if is_f(d) {
        format!("((i64){v})")
    } else {
        v.to_string()
    }
}

/// The register value `stf(out, d, x)` then `ldf`/`ldi` would give.
fn store_f(x: &str, d: Dtype) -> String {
    match d {
        Dtype::F32 => format!("({x})"),
        Dtype::Bf16 => format!("bf2f(f2bf({x}))"),
        Dtype::F16 => format!("h2f(f2h({x}))"),
        Dtype::I64 => format!("((i64)({x}))"),
        Dtype::I32 => format!("((i64)(int)(i64)({x}))"),
        Dtype::U8 => format!("((i64)(unsigned char)(i64)({x}))"),
        Dtype::Bool => format!("((({x}) != 0.0f) ? 1LL : 0LL)"),
    }
}

/// The register value `sti(out, d, x)` then `ldf`/`ldi` would give.
fn store_i(x: &str, d: Dtype) -> String {
    match d {
        Dtype::F32 => format!("((float)({x}))"),
        Dtype::Bf16 => format!("bf2f(f2bf((float)({x})))"),
        Dtype::F16 => format!("h2f(f2h((float)({x})))"),
        Dtype::I64 => format!("({x})"),
        Dtype::I32 => format!("((i64)(int)({x}))"),
        Dtype::U8 => format!("((i64)(unsigned char)({x}))"),
        Dtype::Bool => format!("((({x}) != 0) ? 1LL : 0LL)"),
    }
}

/// The C type and literal suffix for index arithmetic over a value of `numel` elements: 32-bit
/// below 2³¹ elements, else 64-bit.
pub(super) fn index_type(numel: usize) -> (&'static str, &'static str) {
    if numel < (1 << 31) {
        ("unsigned", "u")
    } else {
        ("i64", "LL")
    }
}

/// An f32 literal with these exact bits.
fn f32_lit(x: f32) -> String {
    format!("__uint_as_float({:#010x}u)", x.to_bits())
}

/// Coordinates of an input broadcast (numpy, right-aligned) to coordinates `c` of the output.
fn broadcast(c: &[String], in_shape: &[usize]) -> Vec<String> {
    let off = c.len() - in_shape.len();
    in_shape
        .iter()
        .enumerate()
        .map(|(j, &s)| {
            if s == 1 {
                "0".to_string()
            } else {
                c[j + off].clone()
            }
        })
        .collect()
}

pub(super) struct Gen<'a> {
    pub(super) program: &'a Program,
    pub(super) group: usize,
    pub(super) group_of: &'a [Option<usize>],
    pub(super) body: String,
    pub(super) memo: HashMap<(NodeId, Vec<String>), String>,
    pub(super) leaves: Vec<NodeId>,
    pub(super) vars: usize,
    /// The norm computed in the kernel's header ([`Role::Prologue`]), held in `nv`.
    pub(super) prologue: Option<NodeId>,
    /// The root's coordinates: where the prologue may be read.
    pub(super) root_coords: Vec<String>,
    /// Linears whose bias is added as they are loaded ([`Fusion::biases`]).
    pub(super) biases: &'a HashMap<NodeId, NodeId>,
    /// Non-zero slice starts read as parameters `s0…` ([`Group::offsets`]); one a value, so
    /// equal starts give equal expressions (and shared loads) as literals would.
    pub(super) offsets: Vec<i64>,
    /// Starts as parameters; else as literals (`offsets=literal`, and the check that
    /// both forms are the same code).
    pub(super) offset_params: bool,
    /// The prologue's statistics by `norm_stats4` ([`Options::unrolled_rows`]).
    pub(super) unrolled_rows: bool,
    /// Operands read in place ([`Fusion::views`]): where the prologue norm reads its input.
    pub(super) views: &'a HashMap<(NodeId, usize), StridedView>,
}

pub(super) fn gen_err(id: NodeId, p: &Program, msg: impl std::fmt::Display) -> Error {
    Error::Node {
        node: p.describe(id),
        message: format!("fusion: {msg}"),
    }
}

impl Gen<'_> {
    fn var(&mut self) -> String {
        self.vars += 1;
        format!("v{}", self.vars)
    }

    fn ctype(d: Dtype) -> &'static str {
        if is_f(d) { "float" } else { "i64" }
    }

    /// Slice start `s` (non-zero) as the kernel reads it: a parameter, or a literal.
    fn start(&mut self, s: i64) -> String {
        if !self.offset_params {
            return format!("{s}LL");
        }
        let j = match self.offsets.iter().position(|&o| o == s) {
            Some(j) => j,
            None => {
                self.offsets.push(s);
                self.offsets.len() - 1
            }
        };
        format!("s{j}")
    }

    pub(super) fn kernel_body(&mut self, root: NodeId) -> Result<String> {
        let t = self
            .program
            .node(root)
            .tensor()
            .ok_or_else(|| gen_err(root, self.program, "tuple result"))?
            .clone();
        let r = t.shape.len();
        let mut coords = Vec::with_capacity(r);
        match self.prologue {
            Some(norm) => {
                // One block a row of the norm: its statistics, then each element normalized as
                // `pt_norm` stores it (rounded to the norm's dtype) and run through the group.
                let d = self
                    .program
                    .node(norm)
                    .tensor()
                    .ok_or_else(|| gen_err(norm, self.program, "tuple norm"))?
                    .dtype;
                // With unrolled rows, the statistics and the element formula for the operands'
                // dtypes (`np.dx`, `dw`, `db` at launch: each view's base where read in place)
                // and the norm's kind, known here.
                let node = self.program.node(norm);
                let mut dts = Vec::with_capacity(3);
                for j in 0..node.inputs.len() {
                    let v = read_from(self.program, self.views, norm, j);
                    let t = self
                        .program
                        .node(v)
                        .tensor()
                        .ok_or_else(|| gen_err(norm, self.program, "tuple norm operand"))?;
                    dts.push(t.dtype);
                }
                let kind = match node.op {
                    Op::LayerNorm { .. } => 0,
                    _ => 1,
                };
                let known = |k: usize| dts.get(k).map_or("-1", |&t| dt_macro(t));
                let floats = dts
                    .iter()
                    .all(|t| matches!(t, Dtype::F32 | Dtype::Bf16 | Dtype::F16));
                let (stats, elem) = if self.unrolled_rows && floats && !dts.is_empty() {
                    (
                        format!("norm_stats4<{}, {kind}>", known(0)),
                        format!(
                            "norm_elem4<{}, {kind}, {}, {}>",
                            known(0),
                            known(1),
                            known(2)
                        ),
                    )
                } else {
                    ("norm_stats".to_string(), "norm_elem".to_string())
                };
                let y = store_f(&format!("{elem}(np, nx, nw, nb, base, jj, nm, nr)"), d);
                let _ = writeln!(
                    self.body,
                    "  __shared__ double shd[32];\n  const i64 row = blockIdx.x;\n  if (row >= np.rows) return;\n  const i64 base = row * np.d;\n  float nm, nr;\n  {stats}(np, nx, base, shd, &nm, &nr);\n  for (i64 jj = threadIdx.x; jj < np.d; jj += blockDim.x) {{\n    const i64 i = base + jj;\n    const float nv = {y};"
                );
            }
            None => {
                let _ = writeln!(
                    self.body,
                    "  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {{"
                );
            }
        }
        // Coordinates by 32-bit division where the value has fewer than 2³¹ elements (a 64-bit
        // division by a constant takes several 64-bit multiplies); every later use widens them
        // to i64.
        let (ity, suf) = index_type(t.shape.iter().product());
        let _ = writeln!(self.body, "    {ity} r = ({ity})i;");
        for d in (0..r).rev() {
            let s = t.shape[d];
            if s == 1 {
                coords.push("0".to_string());
            } else {
                let _ = writeln!(self.body, "    {ity} c{d} = r % {s}{suf}; r /= {s}{suf};");
                coords.push(format!("c{d}"));
            }
        }
        coords.reverse();
        self.root_coords = coords.clone();
        let v = self.value(root, &coords)?;
        let store = match t.dtype {
            Dtype::F32 => format!("((float*)po)[i] = {v};"),
            Dtype::Bf16 => format!("((unsigned short*)po)[i] = f2bf({v});"),
            Dtype::F16 => format!("((unsigned short*)po)[i] = f2h({v});"),
            Dtype::I64 => format!("((i64*)po)[i] = {v};"),
            Dtype::I32 => format!("((int*)po)[i] = (int){v};"),
            Dtype::U8 | Dtype::Bool => format!("((unsigned char*)po)[i] = (unsigned char){v};"),
        };
        let _ = writeln!(self.body, "    {store}\n  }}");
        Ok(std::mem::take(&mut self.body))
    }

    fn emit(&mut self, ty: &str, expr: String) -> String {
        let v = self.var();
        let _ = writeln!(self.body, "    {ty} {v} = {expr};");
        v
    }

    /// The register holding `id`'s value at coordinates `c` (C expressions).
    fn value(&mut self, id: NodeId, c: &[String]) -> Result<String> {
        let key = (id, c.to_vec());
        if let Some(v) = self.memo.get(&key) {
            return Ok(v.clone());
        }
        let p = self.program;
        let node = p.node(id);
        let t = node
            .tensor()
            .ok_or_else(|| gen_err(id, p, "tuple value"))?
            .clone();
        let dt = t.dtype;
        if Some(id) == self.prologue {
            return if c == self.root_coords.as_slice() {
                Ok("nv".to_string())
            } else {
                Err(gen_err(id, p, "a prologue norm read off its own element"))
            };
        }
        let v = if self.group_of[id.index()] != Some(self.group) {
            // A materialized value: load it (dense, row-major).
            let j = match self.leaves.iter().position(|&l| l == id) {
                Some(j) => j,
                None => {
                    self.leaves.push(id);
                    self.leaves.len() - 1
                }
            };
            let st = contiguous_strides(&t.shape);
            let mut idx = String::from("0");
            for (d, cd) in c.iter().enumerate() {
                if cd != "0" && t.shape[d] != 1 {
                    let _ = write!(idx, " + {cd} * {}LL", st[d]);
                }
            }
            let load = if is_f(dt) {
                format!("ldf(p{j}, {idx}, {})", dt_macro(dt))
            } else {
                format!("ldi(p{j}, {idx}, {})", dt_macro(dt))
            };
            let v = self.emit(Self::ctype(dt), load);
            match self.biases.get(&id) {
                // The linear's f32 product plus its bias, one f32 add as `pt_bias` does.
                Some(&b) => {
                    let bt = p
                        .node(b)
                        .tensor()
                        .ok_or_else(|| gen_err(b, p, "tuple bias"))?
                        .shape
                        .clone();
                    let bv = self.value(b, &broadcast(c, &bt))?;
                    self.emit("float", format!("{v} + {bv}"))
                }
                None => v,
            }
        } else {
            self.op_value(id, c, dt)?
        };
        self.memo.insert(key, v.clone());
        Ok(v)
    }

    fn input(&mut self, id: NodeId, k: usize, c: &[String]) -> Result<(String, Dtype)> {
        let p = self.program;
        let x = p.node(id).inputs[k];
        let xt = p
            .node(x)
            .tensor()
            .ok_or_else(|| gen_err(id, p, "tuple input"))?
            .clone();
        let v = self.value(x, &broadcast(c, &xt.shape))?;
        Ok((v, xt.dtype))
    }

    fn op_value(&mut self, id: NodeId, c: &[String], dt: Dtype) -> Result<String> {
        let p = self.program;
        let node = p.node(id);
        let ty = Self::ctype(dt);
        match &node.op {
            Op::Binary { kind } => {
                let (a, da) = self.input(id, 0, c)?;
                let (b, db) = self.input(id, 1, c)?;
                let code = EwOp::Binary(*kind).code();
                let e = if is_f(da) {
                    store_f(
                        &format!("ew_f({code}, {}, {})", as_f(&a, da), as_f(&b, db)),
                        dt,
                    )
                } else {
                    store_i(
                        &format!("ew_i({code}, {}, {})", as_i(&a, da), as_i(&b, db)),
                        dt,
                    )
                };
                Ok(self.emit(ty, e))
            }
            Op::BinaryScalar {
                kind,
                scalar,
                scalar_lhs,
            } => {
                let (a, da) = self.input(id, 0, c)?;
                let code = EwOp::Binary(*kind).code();
                let e = if is_f(da) {
                    let s = match da {
                        Dtype::Bf16 => petite_dtype::round_through_bf16(*scalar as f32),
                        Dtype::F16 => half::f16::from_f32(*scalar as f32).to_f32(),
                        _ => *scalar as f32,
                    };
                    let (x, y) = (as_f(&a, da), f32_lit(s));
                    let (x, y) = if *scalar_lhs { (y, x) } else { (x, y) };
                    store_f(&format!("ew_f({code}, {x}, {y})"), dt)
                } else {
                    let (x, y) = (as_i(&a, da), format!("((i64){}LL)", *scalar as i64));
                    let (x, y) = if *scalar_lhs { (y, x) } else { (x, y) };
                    store_i(&format!("ew_i({code}, {x}, {y})"), dt)
                };
                Ok(self.emit(ty, e))
            }
            Op::Compare { kind } => {
                let (a, da) = self.input(id, 0, c)?;
                let (b, db) = self.input(id, 1, c)?;
                let code = EwOp::Compare(*kind).code();
                let r = if is_f(da) {
                    format!("ew_cmp<float>({code}, {}, {})", as_f(&a, da), as_f(&b, db))
                } else {
                    format!("ew_cmp<i64>({code}, {}, {})", as_i(&a, da), as_i(&b, db))
                };
                Ok(self.emit(ty, store_i(&format!("({r}) ? 1LL : 0LL"), dt)))
            }
            Op::Logical { kind } => {
                let (a, da) = self.input(id, 0, c)?;
                let (b, db) = self.input(id, 1, c)?;
                let op = if EwOp::Logical(*kind).code() == 20 {
                    "&&"
                } else {
                    "||"
                };
                let r = format!("({} != 0) {op} ({} != 0)", as_i(&a, da), as_i(&b, db));
                Ok(self.emit(ty, store_i(&format!("({r}) ? 1LL : 0LL"), dt)))
            }
            Op::Not => {
                let (a, da) = self.input(id, 0, c)?;
                let r = format!("!({} != 0)", as_i(&a, da));
                Ok(self.emit(ty, store_i(&format!("({r}) ? 1LL : 0LL"), dt)))
            }
            Op::Unary { kind } => {
                let (a, da) = self.input(id, 0, c)?;
                let code = EwOp::Unary(*kind).code();
                let e = if is_f(da) {
                    store_f(&format!("ew_f({code}, {}, 0.0f)", as_f(&a, da)), dt)
                } else {
                    store_i(&format!("ew_i({code}, {}, 0)", as_i(&a, da)), dt)
                };
                Ok(self.emit(ty, e))
            }
            Op::Cast { .. } | Op::Expand { .. } => {
                let (a, da) = self.input(id, 0, c)?;
                Ok(self.copy(&a, da, dt))
            }
            Op::Where => {
                let (a, da) = self.input(id, 0, c)?;
                let (b, db) = self.input(id, 1, c)?;
                let (e, de) = self.input(id, 2, c)?;
                let cnd = format!("({} != 0)", as_i(&a, da));
                let r = if is_f(db) {
                    store_f(&format!("{cnd} ? {} : {}", as_f(&b, db), as_f(&e, de)), dt)
                } else {
                    store_i(&format!("{cnd} ? {} : {}", as_i(&b, db), as_i(&e, de)), dt)
                };
                Ok(self.emit(ty, r))
            }
            Op::Slice {
                axis, start, step, ..
            } => {
                let mut ic = c.to_vec();
                let s = if *start == 0 {
                    "0LL".to_string()
                } else {
                    self.start(*start as i64)
                };
                ic[*axis] = match (c[*axis].as_str(), *start, *step) {
                    (x, 0, 1) => x.to_string(),
                    ("0", _, _) => s,
                    (x, _, 1) => format!("({x} + {s})"),
                    (x, _, k) => format!("({s} + {x} * {k}LL)"),
                };
                let x = node.inputs[0];
                let dx = p.node(x).tensor().map(|t| t.dtype).unwrap_or(dt);
                let v = self.value(x, &ic)?;
                Ok(self.copy(&v, dx, dt))
            }
            Op::Permute { perm } => {
                let mut ic = vec![String::new(); perm.len()];
                for (i, &d) in perm.iter().enumerate() {
                    ic[d] = c[i].clone();
                }
                let x = node.inputs[0];
                let dx = p.node(x).tensor().map(|t| t.dtype).unwrap_or(dt);
                let v = self.value(x, &ic)?;
                Ok(self.copy(&v, dx, dt))
            }
            Op::Reshape { shape } => {
                let x = node.inputs[0];
                let xs = p
                    .node(x)
                    .tensor()
                    .ok_or_else(|| gen_err(id, p, "tuple input"))?
                    .shape
                    .clone();
                let ost = contiguous_strides(shape);
                let mut lin = String::from("0");
                for (d, cd) in c.iter().enumerate() {
                    if cd != "0" && shape[d] != 1 {
                        let _ = write!(lin, " + {cd} * {}LL", ost[d]);
                    }
                }
                let (ity, suf) = index_type(shape.iter().product());
                let l = self.emit(ity, format!("({ity})({lin})"));
                let ist = contiguous_strides(&xs);
                let ic: Vec<String> = xs
                    .iter()
                    .enumerate()
                    .map(|(j, &s)| {
                        if s == 1 {
                            "0".to_string()
                        } else if j == 0 {
                            format!("({l} / {}{suf})", ist[j])
                        } else {
                            format!("(({l} / {}{suf}) % {s}{suf})", ist[j])
                        }
                    })
                    .collect();
                self.value(x, &ic)
            }
            Op::Concat { axis } => {
                let out = self.var();
                let _ = writeln!(self.body, "    {ty} {out};");
                let mut start = 0usize;
                let k = node.inputs.len();
                for (j, &x) in node.inputs.iter().enumerate() {
                    let xt = p
                        .node(x)
                        .tensor()
                        .ok_or_else(|| gen_err(id, p, "tuple input"))?
                        .clone();
                    let len = xt.shape[*axis];
                    let end = start + len;
                    let cond = if k == 1 {
                        "{".to_string()
                    } else if j + 1 == k {
                        "else {".to_string()
                    } else if j == 0 {
                        format!("if ({} < {end}LL) {{", c[*axis])
                    } else {
                        format!("else if ({} < {end}LL) {{", c[*axis])
                    };
                    let _ = writeln!(self.body, "    {cond}");
                    let mut ic = c.to_vec();
                    if start > 0 {
                        ic[*axis] = format!("({} - {start}LL)", c[*axis]);
                    }
                    // Values computed inside a branch are not visible after it.
                    let saved = self.memo.clone();
                    let v = self.value(x, &ic)?;
                    let cv = self.copy(&v, xt.dtype, dt);
                    let _ = writeln!(self.body, "    {out} = {cv};\n    }}");
                    self.memo = saved;
                    start = end;
                }
                Ok(out)
            }
            other => Err(gen_err(id, p, format!("{} is not fusible", other.name()))),
        }
    }

    /// `pt_ew`'s copy (op 0) of a register value of dtype `from` into dtype `to`.
    fn copy(&mut self, v: &str, from: Dtype, to: Dtype) -> String {
        if from == to {
            return v.to_string();
        }
        let e = if is_f(from) {
            store_f(&as_f(v, from), to)
        } else {
            store_i(&as_i(v, from), to)
        };
        self.emit(Self::ctype(to), e)
    }
}
